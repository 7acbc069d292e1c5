"""conserve.analysis: numerical checks and discovery of laws (spec "The numerical checks every law must pass").

* ``firstorder``: the numerical core of check 1, the first-order product ``<grad h, grad f>`` in float64,
  shared by ``verify``, ``discover``, structural detection and ``conserve.counting``;
* ``verify``: the first-order and symmetry checks of a law set (checks 1 and 2; ``conserve.verify``);
* ``gradcheck``: gradient integrity, a law's first-order product with a training gradient (spec
  "Gradient integrity"; ``conserve.check_gradients``);
* ``discover``: the conservation laws of a block found numerically (``conserve.discover``), over the
  unknowns and linear algebra of ``ansatz``;
* ``floor``: float rounding floors, the size below which a computed drift term or product cannot be
  told from rounding (used by the run report's verdicts and by ``gradcheck``).

Law counting is ``conserve.counting``; geometric continuity is ``conserve.continuity``.
"""
