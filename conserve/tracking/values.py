"""The data the tracking modules pass around: law values in the plan layout and the drift terms' names.

``Values`` holds one evaluation of every law of a compiled plan (``conserve.kernels.evaluate``'s
layout); ``TERMS`` names the five per-entry terms of a drift step (spec "Discrete steps: the exact
drift identity"). This module imports nothing of conserve above ``conserve.kernels``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from .. import kernels
from ..errors import NonFiniteError

TERMS = ("measured", "decay", "first", "second", "residual")
CUMULATIVE = TERMS[:4]  # the terms ``cumulative`` sums


class Values:
    """Law values in the plan layout: ``vec`` (entries) and ``grams`` ({D: (slots, D, D)})."""

    __slots__ = ("vec", "grams")

    def __init__(self, vec: torch.Tensor, grams: Mapping[int, torch.Tensor]):
        self.vec, self.grams = vec, dict(grams)

    def map(self, f, *others: "Values") -> "Values":
        return Values(f(self.vec, *(o.vec for o in others)),
                      {d: f(g, *(o.grams[d] for o in others)) for d, g in self.grams.items()})

    def clone(self) -> "Values":
        return self.map(torch.clone)

    def state(self) -> dict:
        return {"vec": self.vec, **{f"gram{d}": g for d, g in self.grams.items()}}

    @classmethod
    def from_state(cls, s: Mapping, device) -> "Values":
        return cls(s["vec"].to(device), {int(k[4:]): v.to(device) for k, v in s.items() if k.startswith("gram")})



class DriftTerms(dict):
    """``Tracker.assemble``'s result: ``{"decay", "first", "second"}`` -> ``Values``, views of rows 1-3
    of ``buf``, the step scratch ``record_step`` forms the five terms in (it takes ``buf`` and squares
    it in place: pass them to one ``record_step``).  ``at``: the ``Entries`` they hold when compact
    (None: the full law layout), ``h_old``: then ``h_k`` at those entries (taken once per step)."""

    __slots__ = ("at", "buf", "h_old")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = self.buf = self.h_old = None



class CumulativeNotKept(dict):
    """``Tracker.cumulative`` of a tracker that keeps no per-entry cumulative sums (``cumulative=False``, or
    the default in sampled drift mode): empty, and reading a term raises a ``KeyError`` that names the fix."""

    def __repr__(self) -> str:
        return ("CumulativeNotKept(): the per-entry cumulative drift sums are not kept; build the tracker with "
                "cumulative=True")

    def __missing__(self, key):
        raise KeyError(f"tracker.cumulative[{key!r}]: the tracker keeps no per-entry cumulative drift sums (sampled "
                       "drift: drift_every > 1 or a snapshot_budget); build it with cumulative=True "
                       "(conserve.track(..., cumulative=True) or the fused optimizer's cumulative=True), or "
                       "drift_every=1, snapshot_budget=None")



class NotKept(dict):
    """``Tracker.last`` of a tracker built without ``keep_last``: empty, and reading a term raises a
    ``KeyError`` that names the fix (no stale terms are ever returned)."""

    def __repr__(self) -> str:
        return "NotKept(): the per-entry drift terms are not kept; build the tracker with keep_last=True"

    def __missing__(self, key):
        raise KeyError(f"tracker.last[{key!r}]: the tracker does not keep the per-entry drift terms; build it "
                       "with keep_last=True (conserve.track(..., keep_last=True) or the fused optimizer's "
                       "keep_last=True)")



def abs_plan(plan: kernels.Plan) -> kernels.Plan:
    """``plan`` with every term's sign +: its evaluation is the magnitude the ``eps`` guard divides by."""
    return kernels.Plan([replace(t, sign=abs(t.sign)) for t in plan.grams],
                        [replace(t, sign=abs(t.sign)) for t in plan.norms],
                        [replace(t, sign=abs(t.sign)) for t in plan.sums], plan.vec_size, dict(plan.gram_slots))


class Deferred:
    """A ``NonFiniteError`` raised by a flush due while a step is being booked (inside
    ``optimizer.step()``: the optimizer has applied the step): held by ``call`` until the step is
    booked, then raised by ``raise_booked``, which first marks the steps booked so far as covered
    by it (``Tracker._nonfinite_reported``), so a caller who catches it loses no step and gets one
    error per divergence.  ``call`` keeps the first error of several."""

    __slots__ = ("err",)

    def __init__(self):
        self.err: NonFiniteError | None = None

    def call(self, fn, *args) -> None:
        try:
            fn(*args)
        except NonFiniteError as e:
            self.err = self.err or e

    def raise_booked(self, tracker, booked: int | None) -> None:
        """Raise the held error, if any, after setting ``tracker._nonfinite_reported = booked`` (None:
        leave it to the caller that books the remaining steps)."""
        if self.err is not None:
            if booked is not None:
                tracker._nonfinite_reported = booked
            raise self.err
