"""A non-conserved control for every law: the same terms with every sign +, tracked beside the law.

A conservation law ``h = sum_t s_t q_t(theta)`` (signs ``s_t = +-1``) and its control
``c = sum_t |s_t| q_t(theta)`` read the same weights through the same quadratic terms; only the
cancellation differs. Under gradient flow ``h`` is constant while ``c`` moves at first order with the
weights' growth (e.g. SwiGLU unit ``||W_up[u,:]||^2 + ||W_down[:,u]||^2``), so ``eps`` of the control is
the baseline a law's ``eps`` is read against: a law that moves as much as its control is not conserved.
(This is the magnitude the tracker's ``eps`` guard already uses, spec "The paper's error metric".)

Laws whose terms are all positive already (linear laws: router sums, translation) have no control.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Mapping, Sequence

import torch

from .. import kernels
from ..laws import Law, compile_laws


class ControlMonitor:
    """``control/<family>``: eps of the all-signs-+ control of each tracked family, at each flush.

    Plugs into the tracker as a monitor (``Tracker(..., monitors=[...])``): ``update()`` does nothing
    per step; ``metrics()`` (called at each flush) evaluates the controls once, on the parameters'
    device, and returns 0-dim tensors ``control/<family>`` = mean over instances of
    ``|c_i(theta_k) - c_i(theta_0)| / |c_i(theta_0)|`` (instances as in the tracker: vector entries for
    ``per="entry"`` laws, the whole law for ``per="law"``; Frobenius norm for Gram laws).

    Args:
        laws: the tracked laws (``tracker.laws``).
        params: parameter name -> tensor (``dict(model.named_parameters())``).
        fp64: accumulate in float64.

    Cost: one whole-model law evaluation per flush (not per step).
    """

    def __init__(self, laws: Sequence[Law], params: Mapping[str, torch.Tensor], *, fp64: bool = False):
        controls = []
        for law in laws:
            if all(t.sign > 0 for t in law.terms):
                continue  # already all-positive: the control would be the law itself
            c = copy.copy(law)
            c.terms = [replace(t, sign=abs(t.sign)) for t in law.terms]
            controls.append(c)
        self.fp64 = fp64
        self.families = sorted({c.family for c in controls})
        self.compiled = compile_laws(controls, {k: tuple(v.shape) for k, v in params.items()}) if controls else None
        self.tensors = [params[n] for n in self.compiled.names] if controls else []
        self.c0 = self._values() if controls else []

    @torch.no_grad()
    def _values(self) -> list[torch.Tensor]:
        vec, grams = kernels.evaluate(self.compiled.plan, [t.detach() for t in self.tensors], fp64=self.fp64)
        return [v.clone() for v in self.compiled.split(vec, grams)]

    def update(self) -> None:
        """Nothing per step (the controls are evaluated at flush)."""

    @torch.no_grad()
    def metrics(self) -> dict[str, torch.Tensor]:
        if self.compiled is None:
            return {}
        sums: dict[str, list[torch.Tensor]] = {f: [] for f in self.families}
        for law, now, then in zip(self.compiled.laws, self._values(), self.c0):
            if law.kind == "gram" or law.per == "law":
                rel = (now - then).norm().reshape(1) / then.norm().clamp_min(torch.finfo(then.dtype).tiny)
            else:
                rel = (now - then).abs() / then.abs().clamp_min(torch.finfo(then.dtype).tiny)
            sums[law.family].append(rel.reshape(-1))
        return {f"control/{f}": torch.cat(v).mean() for f, v in sums.items() if v}

    def state_dict(self) -> dict:
        return {"c0": self.c0}

    def load_state_dict(self, state: Mapping) -> None:
        self.c0 = [v.to(t.device) for v, t in zip(state["c0"], self.c0)]
