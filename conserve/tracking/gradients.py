"""The tracker's gradient check: each exact law's first-order product with the gradient the optimizer is
about to apply (spec "Gradient integrity"; the statistic, floors and one-shot API are
``conserve.analysis.gradcheck``).

On the drift cadence (``Tracker(check_gradients=True)``), right before the optimizer step -- after
unscaling, clipping and the DDP/FSDP2 reduction, before any decay inside the optimizer -- ``update``
evaluates the per-entry ratios of the tracked parameters' ``.grad`` on the device (no host sync) and gives
the row its ``grad_check/<family>`` and ``grad_check/<family>/layer<i>`` columns: the worst ratio of the
step over the family's (group's) checked laws, NaN on steps not checked.  ``report`` (at each flush) warns
once per newly flagged law, naming it, its parameters and layer, and both readings: a bug, or a method
that changes the gradient on purpose.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from ..analysis.gradcheck import (BUG, KNOWN_METHODS, LOSS_ONLY, GradCheck, GradientCheck, GradPlan, ignored_by,
                                  half_precision_hint, select, zero_if_none)
from ..errors import warn
from ..laws import Law


class GradientCheckWarning(RuntimeWarning):
    """A gradient's first-order product with some exact law is above the rounding floor of its dtype."""


class GradientWatch:
    """Accumulates the gradient check of a tracker's laws (``conserve.analysis.gradcheck.GradCheck``) and
    forms the row's ``grad_check`` columns.

    Args:
        laws: the tracked laws; the approximate ones and those ``ignore`` names are not checked
            (``conserve.analysis.gradcheck.select``).
        named: ``{parameter name: tensor}`` for every parameter the laws read.
        families, groups: the tracker's ``Layout.families`` and ``Layout.groups`` (the columns' order).
        ignore: law names, families or ``fnmatch`` patterns of law or parameter names left out.
        dtype: the dtype the gradients are computed in (``"bfloat16"`` under bf16 autocast: the parameters'
            ``.grad`` are then float32 but their rounding is bf16's); None: the parameters' dtype.
        loss: ``"ce"`` when the user named softmax cross-entropy (the translation laws are checked);
            ``loss_assumed``: detection assumed it without being told (checked, with a note in the warning).

    Raises:
        ValueError: a law reads a parameter ``named`` lacks.
    """

    def __init__(self, laws: Sequence[Law], named: Mapping[str, torch.Tensor], families: Sequence[str],
                 groups: Sequence[tuple], *, ignore: Iterable[str] = (), dtype=None, loss: str | None = None,
                 loss_assumed: bool = False):
        ignore = [ignore] if isinstance(ignore, str) else list(ignore)
        unmatched = [pat for pat in ignore if not any(ignored_by(law, [pat]) for law in laws)]
        if unmatched:
            warn(f"conserve: grad_check_ignore entries {unmatched} match no law (give law names, families such as "
                 f"{sorted({l.family for l in laws})[:4]}, or fnmatch patterns of law or parameter names)",
                 RuntimeWarning)
        translation = LOSS_ONLY.get("translation")
        checked, skipped = select(laws, loss=translation if (loss == translation or loss_assumed) else loss,
                                  ignore=ignore)
        self.assumed = sorted({l.family for l in checked if l.family in LOSS_ONLY and loss != LOSS_ONLY[l.family]})
        self.laws = checked
        self.plan = GradPlan(checked, {n: named[n] for law in checked for n in law.params}) if checked else None
        if dtype is None:
            dts = {named[n].dtype for law in checked for n in law.params}
            dtype = max(dts, key=lambda d: torch.finfo(d).eps) if dts else torch.float32
        self.dtype = dtype
        self.check = GradCheck(self.plan, dtype=dtype, skipped=skipped) if self.plan is not None else None
        self.families, self.groups = list(families), list(groups)
        fam = [self.families.index(l.family) for l in checked]
        grp = [self.groups.index((l.family, -1 if l.layer is None else l.layer)) for l in checked]
        dev = next(iter(named.values())).device if named else "cpu"
        self._fam_of = torch.tensor(fam, dtype=torch.long, device=dev)
        self._grp_of = torch.tensor(grp, dtype=torch.long, device=dev)
        self.warned: set[str] = set()
        self.warned_perturbed = False  # a closure step seen computing its gradient at moved parameters
        self.skipped = skipped

    @property
    def width(self) -> int:
        """The number of ``grad_check`` columns of a row."""
        return len(self.families) + len(self.groups)

    def state_dict(self) -> dict:
        """The accumulated check and the laws warned about, for a resumed run to continue them."""
        return {"check": self.check.state_dict() if self.check is not None else None, "warned": sorted(self.warned)}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue ``state_dict()``'s check (``ValueError`` when it was saved for other laws)."""
        if self.check is not None and state.get("check") is not None:
            self.check.load_state_dict(state["check"], self._fam_of.device)
        self.warned = set(state.get("warned", ()))

    def update(self, named: Mapping[str, torch.Tensor], step: int | None = None) -> torch.Tensor:
        """Check the ``.grad`` of ``named``'s tensors; returns the row columns ``(families + groups,)``, float32
        on the device: the step's worst ratio per family and (family, layer) group, NaN where no law is
        checked; ``step``: the training step being checked (the result's worst entries name it).  A parameter
        whose ``.grad`` is None (backward did not reach it this step, e.g. an expert no token was routed to) is
        checked as a zero gradient: the optimizer leaves it unchanged.  Raises ``ValueError`` naming a
        parameter frozen since the tracker was built (no gradient) and the laws that read it (``grad_check_ignore``
        leaves those laws out)."""
        dev = self._fam_of.device
        out = torch.full((self.width,), float("nan"), dtype=torch.float64, device=dev)
        if self.check is None:
            return out.float()
        names = self.plan.names
        params = {n: named[n] for n in names}
        grads = {n: zero_if_none(named[n]) for n in names}
        prods = self.check.update(params, grads, step=step)
        per_law = self.plan.segments(prods.ratio().to(torch.float64), "max")
        nf = len(self.families)
        out[:nf].scatter_reduce_(0, self._fam_of, per_law, "amax", include_self=False)
        out[nf:].scatter_reduce_(0, self._grp_of, per_law, "amax", include_self=False)
        return out.float()

    def result(self) -> GradientCheck | None:
        """The check over every checked step so far (``GradientCheck``; one host copy), None when no law is
        checked."""
        return self.check.result() if self.check is not None else None

    def report(self) -> None:
        """Warn once per newly flagged law, and once per family flagged by its aggregate alone (a fault spread
        thinly over the family's layers): one ``GradientCheckWarning`` per call naming up to five of them."""
        if self.check is None or self.check.steps == 0:
            return
        res = self.check.result()
        new = [c for c in res.flagged if c.name not in self.warned]
        fams = res.families()
        spread = [f for f, v in sorted(fams.items()) if v["flagged_aggregate"] and not v["flagged"]
                  and f"family:{f}" not in self.warned]
        if not new and not spread:
            return
        self.warned.update(c.name for c in new)
        self.warned.update(f"family:{f}" for f in spread)
        worst = sorted(new, key=lambda c: -max(c.worst / c.floor, c.aggregate / c.aggregate_floor))
        shown = [f"{c.name} (layer {c.layer}; {', '.join(c.params)}): worst {c.worst:.2e} (floor {c.floor:.1e}), "
                 f"aggregate {c.aggregate:.2e} (floor {c.aggregate_floor:.1e})" for c in worst[:5]]
        if len(new) > 5:
            shown.append(f"... ({len(new) - 5} more)")
        shown += [f"family {f}: no law above its floor alone, but the aggregate over its {fams[f]['laws']} laws is "
                  f"{fams[f]['aggregate']:.2e} (floor {fams[f]['aggregate_floor']:.1e})"
                  for f in spread]
        what = f"{len(new)} law(s)" + (f" and {len(spread)} family aggregate(s)" if spread else "") if new \
            else f"the {', '.join(spread)} famil{'ies' if len(spread) > 1 else 'y'} as a whole"
        note = ""
        if any(c.family in self.assumed for c in new) or any(f in self.assumed for f in spread):
            note = (" (the translation laws hold for softmax cross-entropy only, which detection assumed: if the loss "
                    "is another, pass grad_check_ignore=['translation'])")
        half = half_precision_hint(res, new)
        warn(f"conserve: the gradient is not a gradient of the model's output for {what} ({res.dtype} gradient, "
             f"{res.steps} checked step(s)): {'; '.join(shown)}{note}.{half} Either {BUG}, or a method that changes "
             f"the gradient on purpose ({'; '.join(KNOWN_METHODS)}); grad_check_ignore=[...] leaves laws out",
             GradientCheckWarning)
