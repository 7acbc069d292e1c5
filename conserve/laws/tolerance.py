"""The tolerances of the numerical checks, named once (spec ``shared/spec/laws.md``, "The numerical checks every
law must pass").

Every number is relative (a ratio to the size of what it is compared with) and meant for float64, where an exact
identity computed by a few hundred operations leaves ~1e-16 to 1e-14 of rounding.

First-order check (spec check 1): ``|<grad h, grad f>| / (||grad h|| ||grad f||)``.

* ``FIRST_ORDER``: an exact law passes at or below it; ``TOL`` is the same number under its historic name.
* ``FIRST_ORDER_DISCOVERED``: a law found numerically (``conserve.discover``: its coefficients come out of a
  null space, rounded at ~1e-12) passes at or below it.
* ``FIRST_ORDER_UNTRACED``: the check run on a model's own forward when it cannot be traced and made float64 end
  to end: the code's float32 upcasts (HF norms, softmax, routers) bound the measure near 1e-8, while a law the
  forward breaks measures 1e-4 and above.

Probing a traced graph with basis vectors and codes (structural detection, ``conserve.detection``):

* ``PROBE_NONZERO``: an entry of a probed map below this fraction of the map's largest entry is zero (an index
  map or a linear map of a few terms is exact in float64; rounding leaves ~1e-16).
* ``PROBE_CODE``: a decoded row code (a ratio of two probed values) is an integer within this.
* ``PROBE_CONFIRM_RTOL`` / ``PROBE_CONFIRM_ATOL``: a decoded map reproduces a run with random values within these
  (``atol`` a fraction of the map's scale).
* ``HOMOGENEOUS``: ``f(c z) = c f(z)`` of an element-wise map holds within this (rtol and atol).
* ``TRACE_RTOL``, ``TRACE_ATOL``, ``TRACE_ATOL_SCALE``: a traced graph reproduces the model's output within
  ``rtol`` and ``atol + atol_scale * max |output|``. The graph computes in float64 where the model's code
  downcasts to float32 (a precision choice), so entries near zero differ by float32 rounding of the output's scale.
"""
from __future__ import annotations

FIRST_ORDER = 1e-10
TOL = FIRST_ORDER
FIRST_ORDER_DISCOVERED = 1e-9
FIRST_ORDER_UNTRACED = 1e-6

PROBE_NONZERO = 1e-9
PROBE_CODE = 1e-6
PROBE_CONFIRM_RTOL = 1e-9
PROBE_CONFIRM_ATOL = 1e-12
HOMOGENEOUS = 1e-12

TRACE_RTOL = 1e-4
TRACE_ATOL = 1e-6
TRACE_ATOL_SCALE = 1e-5

__all__ = ["TOL", "FIRST_ORDER", "FIRST_ORDER_DISCOVERED", "FIRST_ORDER_UNTRACED", "PROBE_NONZERO", "PROBE_CODE",
           "PROBE_CONFIRM_RTOL", "PROBE_CONFIRM_ATOL", "HOMOGENEOUS", "TRACE_RTOL", "TRACE_ATOL", "TRACE_ATOL_SCALE"]
