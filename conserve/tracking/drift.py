"""The drift assembly: one optimizer step's law change split into the exact identity's terms.

Spec "Discrete steps: the exact drift identity". With ``theta_{k+1} = a theta_k + Delta`` (``a`` the
decoupled decay of each tensor) and a quadratic law ``h``::

    h_{k+1} - h_k = (a^2 - 1) h_k  +  2 B(a theta_k, Delta)  +  h(Delta)
                    decay              first order              second order

(linear laws: ``(a - 1) h_k + c . Delta``, no second order).  The pieces ``(h_new, decay, bil, h_delta)``
come from ONE call of the DRIFT pass ``conserve.kernels.drift`` (Triton on CUDA, its torch twin on CPU);
this module turns them into ``decay / first / second`` (``Assembly``), and chooses which law entries
a drift step decomposes under a snapshot budget (``Sampler``).  Every path uses the one
``Assembly.terms``: ``conserve.track`` (``Tracker.drift_terms`` -> ``Tracker.assemble``), the fused
optimizers (``Tracker.assemble`` with their step statistics, ``StepStats``) and the distributed
tracker (``DistributedTracker._pieces``).

Decay without cancellation: when every tensor an entry reads has the same ``a`` (the usual case: one
parameter group per law), ``decay = (a^2 - 1) h_k`` from the stored ``h_k`` (``a^2 - 1`` is exact in
float64 for the fp32-rounded ``a``), so no decay dot, no ``h(a theta)`` evaluation, and nothing at all
when ``a == 1``.  Only entries whose tensors have different ``a`` (weight decay on part of a law) or a
shifted norm term with ``a != 1`` take the kernel's per-term decay ``sum_t s_t (a_t^2 - 1) h_t(old)``.
The first- and second-order terms are computed directly (``B(a theta, Delta)`` and ``h(Delta)`` with
``Delta`` formed from the old and new weights), so the tracker's ``residual`` still checks the identity.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
import torch

from .. import kernels
from ..kernels.plan import FIRST_ORDER, GramTerm, NormTerm, Plan, SumTerm, View

from ..kernels.reference import drift_factors

__all__ = ["drift_pieces", "drift_factors", "Assembly", "StepStats", "Sampler", "Shards", "copy_costs", "Snapshot",
           "Mask", "make_mask"]

def drift_pieces(plan: Plan, olds: Sequence[torch.Tensor | None], news: Sequence[torch.Tensor], a, *,
                 fp64: bool, backend: str, decay: bool, donate: bool = False, values: bool = True, config=None):
    """``conserve.kernels.drift`` asking for the per-term decay only when ``decay`` is True.

    Returns ``(h_new, decay, bil, h_delta)``, each a ``(vec, {D: grams})`` pair, ``decay`` None when not
    asked for.  ``donate``: ``olds`` are copies made for this step, which the torch twin may overwrite
    with ``Delta`` (no second view-sized buffer); ``values=False``: ``h_new`` may be None.  ``config``:
    the Triton path's ``kernels.Config`` (None: the default)."""
    return kernels.drift(plan, olds, news, a, fp64=fp64, backend=backend, decay=decay, donate=donate, values=values,
                         config=config)


def _entries_of(plan: Plan):
    """(vec entry, tensor, shifted) and (D, slot, tensor) pairs: which tensors each output reads."""
    vec, gram = [], []
    for t in plan.norms:
        idx = t.index + t.index_stride * np.arange(t.view.rows)
        vec += [(int(i), t.view.tensor, t.shift != 0.0) for i in idx]
    for t in plan.sums:
        vec += [(t.index + c, t.view.tensor, False) for c in range(t.view.cols)]
    for t in plan.grams:
        gram.append((t.view.rows, t.slot, t.view.tensor))
    return vec, gram


@dataclass
class _Runs:
    """Per-entry set ids in run-length form, per part of the layout (``"vec"``, then each D's slots):
    the entries of one law share a set and lie side by side, so a layout has a few runs per law
    family, not one id per entry.  ``sets[p]``/``lengths[p]``: the set and length of each run of part
    ``p`` (host int32); ``dev``: ``{p: (sets, lengths)}`` copies on a GPU device (None on the CPU,
    where ``on_device`` views the host arrays: no tensor object held per run array)."""

    sets: dict
    lengths: dict
    dev: dict | None

    def expand(self, f: np.ndarray, p) -> np.ndarray:
        """``f[set of each entry of part p]`` (a per-set host array at the entries)."""
        return np.repeat(f[self.sets[p]], self.lengths[p])

    def on_device(self, p) -> tuple:
        """``(sets, lengths)`` of part ``p`` as tensors on the device."""
        return self.dev[p] if self.dev is not None else (torch.from_numpy(self.sets[p]), torch.from_numpy(self.lengths[p]))


def _runs(ids: np.ndarray, vec_size: int, gram_slots: Mapping[int, int], device) -> _Runs:
    """``_Runs`` of the per-entry set ids ``ids`` (flat layout: the vec entries, then each D's slots)."""
    ps, pl, at = {}, {}, 0
    for p, n in [("vec", vec_size)] + list(gram_slots.items()):
        x = ids[at: at + n]
        starts = np.flatnonzero(np.r_[True, x[1:] != x[:-1]]) if n else np.zeros(0, dtype=np.int64)
        ps[p], pl[p] = x[starts].astype(np.int32), np.diff(np.r_[starts, n]).astype(np.int32)
        at += n
    host = torch.device(device).type == "cpu"
    return _Runs(ps, pl, None if host else {p: (torch.from_numpy(ps[p]).to(device), torch.from_numpy(pl[p]).to(device))
                                            for p in ps})


class Assembly:
    """Turns the DRIFT pieces of one step into the identity's ``decay``, ``first``, ``second`` terms.

    Args:
        plan: the full law plan (``Compiled.plan``): which tensors each output entry reads.
        linear: ``(vec_size,)`` bool, entries of linear laws (``Compiled.linear_mask``).
        device: where the terms live.

    ``terms(h_old, pieces, a)``: ``h_old`` the stored law values at ``theta_k`` (the tracker's ``h``),
    ``pieces`` the ``(h_new, decay, bil, h_delta)`` of ``drift_pieces`` (``h_new`` unused; ``decay`` may be None when
    ``needs_kernel_decay(a)`` is False), ``a`` the decay factor per tensor of the FULL plan (floats),
    ``sampled`` the entries the pieces cover (``Mask``; the decay is zeroed elsewhere).
    Returns ``{"decay", "first", "second"}`` as ``(vec, {D: grams})`` pairs in ``h_old``'s dtype.
    """

    def __init__(self, plan: Plan, linear: torch.Tensor, device):
        vec, gram = _entries_of(plan)
        self.vec_size, self.gram_slots = plan.vec_size, dict(plan.gram_slots)
        self.device = device
        self._lin = linear.to(device)
        # host copy, once (no device->host copy per step); on the CPU it views ``linear`` (bool already)
        self._lin_np = linear.detach().cpu().numpy().astype(bool, copy=False)
        # per output entry the set of (tensor, shifted) pairs its terms read, as one small set id
        # (entries of one law share it); the sets' members are kept, not one row per term row
        codes = [(e, 2 * t + int(sh)) for e, t, sh in vec] + [(self.vec_size + self._slot_at(d, sl), 2 * t)
                                                               for d, sl, t in gram]
        n_flat = self.vec_size + sum(self.gram_slots.values())
        per: list = [set() for _ in range(n_flat)]
        for e, c in codes:
            per[e].add(c)
        ids: dict = {}
        flat = np.asarray([ids.setdefault(tuple(sorted(x)), len(ids)) for x in per], dtype=np.int64)
        # (vec entries, then each D's slots) -> set, held as runs (the entries of a law lie side by side)
        self._runs = _runs(flat, self.vec_size, self.gram_slots, self.device)
        members = [(k, c) for key, k in ids.items() for c in key]
        self._m_set = np.asarray([k for k, _ in members], dtype=np.int32)  # (indices: 4 bytes are plenty)
        self._m_tensor = np.asarray([c // 2 for _, c in members], dtype=np.int32)
        self._m_shift = np.asarray([c % 2 == 1 for _, c in members], dtype=bool)
        self._n_sets = len(ids)
        self._cache: tuple | None = None
        self._ccache: tuple | None = None  # correct's per-set table for the last (a, dtype)

    def _slot_at(self, d: int, slot: int) -> int:
        """Flat index of Gram slot ``slot`` of size ``d`` after the vec entries (D in ``gram_slots`` order)."""
        at = 0
        for dd, n in self.gram_slots.items():
            if dd == d:
                return at + slot
            at += n
        raise KeyError(d)

    @property
    def _nlin(self) -> torch.Tensor:
        """``(vec_size,)`` bool: the quadratic entries (made per use, not held)."""
        return ~self._lin

    def _lin_host(self) -> np.ndarray:
        return self._lin_np

    def _set_factors(self, a: Sequence[float]):
        """Per tensor set the common ``a`` of its tensors (nan if they differ or a shifted term's tensor
        has ``a != 1``): ``(true, rounded)``, ``rounded`` = the fp32 value the kernels use
        (``drift_factors``).  Cached for the last ``a`` (it changes only with the lr)."""
        key = tuple(map(float, a))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        at = np.asarray(key, dtype=np.float64)
        af = np.asarray(drift_factors(list(key), len(key)), dtype=np.float64)
        per_set = []
        for av in (at, af):
            first = np.full(self._n_sets, np.nan)
            if len(self._m_set):
                first[self._m_set[::-1]] = av[self._m_tensor[::-1]]  # any one tensor's a per set
                bad = np.zeros(self._n_sets, dtype=bool)
                diff = (av[self._m_tensor] != first[self._m_set]) | (self._m_shift & (av[self._m_tensor] != 1.0))
                np.logical_or.at(bad, self._m_set, diff)
                first[bad] = np.nan
            per_set.append(first)
        self._cache = (key, tuple(per_set))
        return self._cache[1]

    def _factors(self, a: Sequence[float]):
        """Per entry the common ``a`` of its tensors (nan if they differ, or a shifted term's tensor has
        ``a != 1``, or it reads none): ``(true, rounded)`` pairs of ``(vec, {D: slots})`` arrays
        (``_set_factors`` expanded to the entries per call: nothing entry-sized is kept)."""
        out, runs = [], self._runs
        for f in self._set_factors(a):  # f at each entry's set
            out.append((runs.expand(f, "vec"), {d: runs.expand(f, d) for d in self.gram_slots}))
        return tuple(out)

    def restrict(self, vi, si: Mapping) -> "Assembly":
        """The assembly of the entries ``vi`` (vec indices) and ``si[D]`` (Gram slots; index arrays, or
        slices: then its linear flags are views of this assembly's), renumbered in
        order (the layout of a ``Sampler(compact=True)`` sub-plan): its ``terms``/``decay`` take and
        return values of those entries only, equal entry by entry to the full layout's (the
        operations are per entry).  Holds its set ids as runs (``_Runs``) and, for index arrays, 1 byte
        per entry (its linear flag): the tracker caches one per sampler group (``conserve.tracking.book.Entries``)."""
        return _Restricted(self, vi, si)

    def needs_kernel_decay(self, a: Sequence[float], sampled: "Mask | None" = None) -> bool:
        """Whether some (sampled) entry with a nonzero decay reads tensors of different ``a``."""
        nan = np.isnan(self._set_factors(a)[0])  # true factors: entries mixed there are decayed by the kernel
        if not nan.any():
            return False
        runs = self._runs
        if sampled is None or sampled.full:
            return any(bool(nan[x].any()) for x in runs.sets.values())
        if runs.expand(nan, "vec")[sampled.vec_np].any():
            return True
        return any(bool(runs.expand(nan, d)[sampled.gram_np[d]].any()) for d in self.gram_slots)

    def decay(self, h_old, a: Sequence[float], kernel=None, sampled: "Mask | None" = None, out=None):
        """``(a^2 - 1) h_old`` (quadratic entries) / ``(a - 1) h_old`` (linear), ``(vec, {D: grams})``;
        entries whose tensors have different ``a`` take ``kernel`` (the kernel's per-term decay, same
        layout; ``RuntimeError`` if it is needed and None); zero outside ``sampled``.  ``out``: a
        ``(vec, {D: grams})`` pair of tensors (``h_old``'s shapes and dtype) to write into."""
        hv, hg = h_old
        dt = hv.dtype
        fv, fg = self._factors(a)[0]

        def one(h, f, quad_mask, kernel, used, o):
            # factors in float64 on the host (exact for fp32 a), one rounding to dt, one product with h;
            # entries outside ``used`` (not decomposed this step) are zero whatever their factors
            uni = ~np.isnan(f) | ~used
            fac = np.where(uni & used, np.where(quad_mask, f * f - 1.0, f - 1.0), 0.0)
            shape = (-1,) + (1,) * (h.dim() - 1)
            if (fac != 0).any():
                res = torch.mul(torch.from_numpy(fac).to(self.device, dt).view(shape), h, out=o)
            else:
                res = torch.zeros_like(h) if o is None else o.zero_()
            if not uni.all():
                if kernel is None:
                    raise RuntimeError("drift assembly: entries with mixed decay factors need the kernel's decay "
                                       "(call drift_pieces with decay=needs_kernel_decay(a))")
                w = torch.where(torch.from_numpy(~uni).to(self.device).view(shape), kernel.to(dt), res)
                res = w if o is None else o.copy_(w)
            return res  # a fresh tensor (or ``o``): masked in place below

        kv, kg = (None, {}) if kernel is None else kernel
        ov, og = (None, {}) if out is None else out
        part = sampled is not None and not sampled.full
        dv = one(hv, fv, ~self._lin_host(), kv, sampled.vec_np if part else np.ones(len(fv), dtype=bool), ov)
        dg = {d: one(hg[d], fg[d], np.ones(len(fg[d]), dtype=bool), kg.get(d),
                     sampled.gram_np[d] if part else np.ones(len(fg[d]), dtype=bool), og.get(d)) for d in hg}
        if part:  # entries this step did not decompose: no term
            dv.mul_(sampled.vec)
            for d, g in dg.items():
                g.mul_(sampled.grams[d].view(-1, 1, 1))
        return dv, dg

    def correct(self, h_old, first, second, a: Sequence[float]):
        """``first``/``second`` (``(vec, {D: grams})``) computed with the fp32-rounded ``a`` (the kernels'
        ``Delta_f``) turned IN PLACE into those of the true ``a`` (see ``terms``; returned; unchanged where
        they agree), with one temporary of each part's size (the bits of the out-of-place formula).
        The per-entry factors are the per-set ones (``_correction_table``, held per ``a``) expanded on
        the device: nothing law-sized is uploaded per step."""
        hv, hg = h_old
        dt = hv.dtype
        table, nonzero = self._correction_table(a, dt)
        runs = self._runs

        def fix(first, second, h, part, lin_mask):
            if not nonzero[runs.sets[part]].any():  # d = 0 at every entry of this part
                return
            shape = (-1,) + (1,) * (h.dim() - 1)
            # (4, entries): d, a / a_f, a, a_f per entry (1 where an entry's tensors have different a)
            sets, lengths = runs.on_device(part)
            e = torch.repeat_interleave(table[:, sets], lengths, dim=1, output_size=h.shape[0])
            dd, ratio, tt, rr = (x.view(shape) for x in e.unbind(0))
            coef = 2 * dd * rr  # first = ratio (first - 2 d a_f h); linear entries: first - d h
            if lin_mask is not None:
                lm = lin_mask.view(shape)
                coef, ratio = torch.where(lm, dd, coef), torch.where(lm, 1, ratio)
            t = torch.mul(coef, h)
            first.sub_(t).mul_(ratio)
            del coef
            # second -= (d / a) first + d^2 h (nothing at linear entries)
            for k, x in ((dd / tt, first), (dd * dd, h)):
                torch.mul(k, x, out=t)
                if lin_mask is not None:
                    t.masked_fill_(lm, 0)
                second.sub_(t)

        fix(first[0], second[0], hv, "vec", self._lin)
        for d in first[1]:
            fix(first[1][d], second[1][d], hg[d], d, None)
        return first, second

    def _correction_table(self, a: Sequence[float], dt):
        """Per tensor set, for ``correct``: ``(4, sets)`` tensor of ``d = a - a_f``, ``a / a_f``, ``a``,
        ``a_f`` in ``dt`` on the device (``0, 1, 1, 1`` for a set whose tensors have different ``a``),
        and the host bool ``d != 0`` per set.  The factors in float64 on the host, one rounding to
        ``dt`` (as per entry).  Held for the last ``(a, dt)`` (it changes only with the lr): a few
        floats per set."""
        key = (tuple(map(float, a)), dt)
        if self._ccache is not None and self._ccache[0] == key:
            return self._ccache[1]
        t, r = self._set_factors(a)
        uni = ~np.isnan(t) & ~np.isnan(r)
        d = np.where(uni, t - r, 0.0)
        ratio = np.where(uni, t / np.where(uni, r, 1.0), 1.0)
        cols = np.stack([d, ratio, np.where(uni, t, 1.0), np.where(uni, r, 1.0)])
        got = (torch.from_numpy(cols).to(self.device, dt), d != 0)
        self._ccache = (key, got)
        return got

    def terms(self, h_old, pieces, a: Sequence[float], sampled: "Mask | None" = None, out=None,
              stats: "StepStats | None" = None) -> dict:
        """The identity's terms for the true ``a`` (python floats per tensor).  The kernels form
        ``Delta_f = new - a_f old`` with ``a_f`` = ``a`` rounded to fp32; with ``d = a - a_f`` per entry
        (``old`` = theta_k, ``Delta = new - a old = Delta_f - d old``), exactly::

            first  = (a / a_f) (2 B(a_f old, Delta_f) - 2 d a_f h_k)        (linear: c.Delta_f - d h_k)
            second = h(Delta_f) - (d / a) first - d^2 h_k

        so a decay factor that is not an fp32 number (``1 - lr*wd`` in double) keeps the first-order
        term at its true value (Noether: it vanishes for SGD with weight decay) in float64.

        ``pieces``: the DRIFT pass's ``(h_new, decay, bil, h_delta)``; a list is consumed (cleared when
        read, so its law-sized pieces are freed before the corrections are formed); None: no DRIFT pass
        this step (every term then comes from ``stats``; the Gram terms are 0).  ``stats``: the step
        statistics' contributions to the vec entries (``StepStats``, the fused optimizers': their
        terms are added to ``2 B + lin h(Delta)`` / ``(1 - lin) h(Delta)`` before the exact-``a``
        correction, their per-term decay to the pass's).
        ``out``: ``{"decay", "first", "second"}`` -> ``(vec, {D: grams})`` tensors of ``h_old``'s shapes and
        dtype to write the terms into (e.g. rows of the tracker's step scratch); None: fresh tensors."""
        hv, hg = h_old
        dt = hv.dtype
        if out is None:
            out = {k: (torch.empty_like(hv), {d: torch.empty_like(g) for d, g in hg.items()})
                   for k in ("decay", "first", "second")}
        (fv, fg), (sv, sg) = out["first"], out["second"]
        dec = None
        if pieces is None:  # the step statistics alone (no term outside them this step)
            if stats is None:
                fv.zero_()
                sv.zero_()
            else:
                fv.copy_(stats.first)
                sv.copy_(stats.second)
            for d in hg:
                fg[d].zero_()
                sg[d].zero_()
        else:
            _, dec, (bv, bg), (dv, dg) = pieces  # h_new is not used (None is fine)
            if isinstance(pieces, list):
                pieces.clear()
            bv, dv = bv.to(dt), dv.to(dt)
            torch.mul(bv, FIRST_ORDER, out=fv)  # first = 2 B + lin * h(Delta) (+ stats), second = (1 - lin) * h(Delta) (+ stats)
            fv.add_(torch.mul(dv, self._lin, out=sv))
            if stats is not None:
                fv.add_(stats.first)
            torch.mul(dv, self._nlin, out=sv)
            if stats is not None:
                sv.add_(stats.second)
            for d in hg:
                torch.mul(bg[d].to(dt), FIRST_ORDER, out=fg[d])
                sg[d].copy_(dg[d])
            del bv, bg, dv, dg
        self.correct(h_old, (fv, fg), (sv, sg), a)  # in place
        if sampled is not None:  # the corrections touch every entry: mask again
            sampled.restrict_((fv, fg), (sv, sg))
        if stats is not None and stats.decay is not None:  # the statistics' per-term decay (+ the pass's)
            dec = (stats.decay, {}) if dec is None else (stats.decay + dec[0], dec[1])
        self.decay(h_old, a, dec, sampled, out=out["decay"])
        return out


@dataclass
class StepStats:
    """The step statistics' part of one drift step's terms (the fused optimizers, spec "Discrete
    steps"): ``(vec_size,)`` tensors in the law values' dtype, 0 at entries no statistic covers.
    ``first``/``second``: their first- and second-order terms (fp32-rounded ``a``, as the DRIFT pass);
    ``decay``: their per-term decay ``sum_t s_t (a_t^2 - 1) h_t(old)`` (read where the tensors of an
    entry have different ``a``), or None."""

    first: torch.Tensor
    second: torch.Tensor
    decay: torch.Tensor | None = None


class _Restricted(Assembly):
    """``Assembly.restrict``: the parent's per-entry facts (linear mask, decay factors) at some entries."""

    def __init__(self, parent: Assembly, vi, si: Mapping):
        # held: per entry its linear flag (host; a view of the parent's for a slice; the device tensor
        # views it on the CPU, a slice of the parent's elsewhere); the set ids as runs
        self._parent = parent
        self.device = parent.device
        self._lin_np = parent._lin_host()[vi]
        self._lin = parent._lin[vi] if isinstance(vi, slice) else torch.from_numpy(self._lin_np).to(parent.device)
        pr = parent._runs
        ids = [np.repeat(pr.sets["vec"], pr.lengths["vec"])[vi]] + [np.repeat(pr.sets[d], pr.lengths[d])[si[d]]
                                                                   for d in parent.gram_slots]
        self.vec_size, self.gram_slots = len(ids[0]), {d: len(x) for d, x in zip(parent.gram_slots, ids[1:])}
        # the parent's set of each of these entries (vec, then slots), held as runs (no per-entry id)
        self._runs = _runs(np.concatenate(ids), self.vec_size, self.gram_slots, self.device)

    def _set_factors(self, a: Sequence[float]):
        return self._parent._set_factors(a)

    def _correction_table(self, a: Sequence[float], dt):
        return self._parent._correction_table(a, dt)


@dataclass
class Mask:
    """Which output entries a drift step decomposed: host (numpy) and device boolean masks."""

    vec_np: np.ndarray
    gram_np: dict
    vec: torch.Tensor
    grams: dict
    full: bool = False
    key: tuple | None = None  # the same key: the same entries (lets a tracker cache per-mask facts)

    def restrict_(self, *values) -> None:
        """Zero, in place, the entries outside the mask of each ``(vec, {D: grams})`` pair."""
        if self.full:
            return
        for vec, grams in values:
            vec.mul_(self.vec)
            for d, g in grams.items():
                g.mul_(self.grams[d].view(-1, 1, 1))


@dataclass
class Snapshot:
    """What one drift step needs: the (sub-)plan, the old weights it reads (copies made right before the
    step), the matching new tensors (views of the live weights), the source tensor of each, the mask
    of decomposed entries.  Dropped after the step (no weight-sized buffer outlives it)."""

    plan: Plan
    olds: list
    sources: list  # per plan tensor: index of the tracked tensor it views
    mask: Mask
    news: list | None = None
    compact: bool = False  # ``plan`` writes the mask's entries only, in order (``Sampler(compact=True)``)

    def bytes(self) -> int:
        return sum(o.numel() * o.element_size() for o in self.olds if o is not None)


def make_mask(vm: np.ndarray, gm: Mapping[int, np.ndarray], device, key: tuple | None = None) -> Mask:
    """A ``Mask`` from host bool arrays (``key``: the same key must mean the same entries)."""
    full = bool(vm.all() and all(m.all() for m in gm.values()))
    return Mask(vm, dict(gm), torch.from_numpy(vm).to(device), {d: torch.from_numpy(m).to(device) for d, m in gm.items()},
                full, key)


# with shards, vector runs are cut at 1/_SHARD_CUT of each rank's budget: a run that filled one rank's budget
# would leave the other ranks' idle in its group (each costs some ranks only), smaller ones pack first fit
_SHARD_CUT = 4


class _Unit:
    """A part of the law entries (one Gram slot, or a run of vector entries) with the terms this rank
    evaluates for it and its copy cost per rank (``(ranks,)`` int64 bytes)."""

    __slots__ = ("key", "grams", "norms", "sums", "cost")

    def __init__(self, key, ranks: int = 1):
        self.key, self.grams, self.norms, self.sums = key, [], [], []
        self.cost = np.zeros(ranks, dtype=np.int64)


def _vec_spans(p: Plan):
    """Per norm and per sum term of ``p`` the range ``[lo, hi)`` of vector entries it writes (host int64
    arrays), for ``_vec_terms``."""
    def span(t, n, step):
        a, b = t.index, t.index + step * (n - 1)
        return min(a, b), max(a, b) + 1
    ns = np.asarray([span(t, t.view.rows, t.index_stride) for t in p.norms], dtype=np.int64).reshape(-1, 2)
    ss = np.asarray([(t.index, t.index + t.view.cols) for t in p.sums], dtype=np.int64).reshape(-1, 2)
    return ns, ss


def _vec_terms(p: Plan, o0: int, o1: int, spans=None):
    """The norm and sum terms of ``p`` restricted to the vector entries ``[o0, o1)`` (the rows / columns
    of their views that write there); ``spans``: ``_vec_spans(p)`` (only the terms that reach the range
    are looked at)."""
    ns, ss = _vec_spans(p) if spans is None else spans
    norms, sums = [], []
    for k in np.flatnonzero((ns[:, 0] < o1) & (ns[:, 1] > o0)):
        t = p.norms[k]
        idx = t.index + t.index_stride * np.arange(t.view.rows)
        r = np.nonzero((idx >= o0) & (idx < o1))[0]
        if len(r) == 0:
            continue
        r0, r1 = int(r.min()), int(r.max()) + 1
        norms.append(replace(t, view=_sub_view(t.view, t.view.row_dim, r0, r1 - r0, "rows"),
                             index=t.index + t.index_stride * r0))
    for k in np.flatnonzero((ss[:, 0] < o1) & (ss[:, 1] > o0)):
        t = p.sums[k]
        c0, c1 = max(o0, t.index), min(o1, t.index + t.view.cols)
        if c0 >= c1:
            continue
        sums.append(replace(t, view=_sub_view(t.view, t.view.col_dim, c0 - t.index, c1 - c0, "cols")
                            if t.view.col_dim is not None else t.view, index=c0))
    return norms, sums


def _runs_under(cost: np.ndarray, cap: np.ndarray) -> list[tuple[int, int]]:
    """``cost`` (entries, ranks) cut into runs ``[o0, o1)`` in order: a run takes entries while their
    sum stays within ``cap`` on every rank, and at least its first entry of nonzero cost (one bigger
    than ``cap`` is a run of its own, with the zero-cost entries before it)."""
    n = cost.shape[0]
    if n == 0:
        return []
    cs = np.vstack([np.zeros((1, cost.shape[1]), dtype=np.int64), np.cumsum(cost, axis=0)])
    nz = np.flatnonzero(cost.any(axis=1))
    out, start = [], 0
    while start < n:
        k = np.searchsorted(nz, start)
        if k == len(nz):  # no cost left: the rest is one run
            out.append((start, n))
            break
        end = min(int(np.searchsorted(cs[:, r], cs[start, r] + cap[r], side="right")) - 1 for r in range(cost.shape[1]))
        end = min(n, max(int(nz[k]) + 1, end))
        out.append((start, end))
        start = end
    return out


def _sub_view(v: View, dim: int, start: int, n: int, which: str) -> View:
    s = list(v.start)
    if which == "rows":
        s[v.row_dim] += start * v.row_step
        return replace(v, start=tuple(s), rows=n)
    s[v.col_dim] += start
    return replace(v, start=tuple(s), cols=n)


def _check_renumbered(plan: Plan, units, sub: Plan, vpos: np.ndarray) -> None:
    """``AssertionError`` unless each vector term of ``sub`` writes the renumbered entries of its unit's term."""
    k = 0
    for u in units:
        for t in u.norms:
            full = t.index + t.index_stride * np.arange(t.view.rows)
            new = sub.norms[k].index + sub.norms[k].index_stride * np.arange(t.view.rows)
            assert (vpos[full] == new).all(), "compact sub-plan: a norm term's entries are not one run"
            k += 1


@dataclass(frozen=True)
class Shards:
    """How the tracked tensors are spread over the ranks, for a ``Sampler`` over the GLOBAL plan
    (``conserve.tracking.distributed``): every rank builds the same groups from the same ``Shards``
    (no collective) and copies only its own pieces of a group's views.

    ``local``: this rank's terms (local views of its shards, ``conserve.tracking.shard_plan``: summed
    over the ranks with the straddling Gram terms they give the global plan); the groups' sub-plans
    are made of these.  ``costs[r]``: the bytes rank ``r`` copies before a drift step per output entry
    of the global plan (``copy_costs`` of its local terms, plus its rows of the straddling Grams).
    ``held[r]``: the tracked bytes rank ``r`` holds (its budget is ``budget * held[r]``).  ``rank``:
    this rank."""

    local: Plan
    costs: tuple
    held: tuple
    rank: int


def copy_costs(plan: Plan, esize: Sequence[int], grams: Sequence[tuple[int, int, int]] = ()):
    """Bytes of the views the terms of ``plan`` read, per output entry: ``(vec, {(D, slot): bytes})``,
    ``vec`` a ``(vec_size,)`` int64 array (a norm's row to its entry, a sum's column to its entry).
    ``esize``: bytes per element of each tensor; ``grams``: more ``(D, slot, bytes)`` to add (a rank's
    rows of a Gram term that straddles ranks)."""
    vec = np.zeros(plan.vec_size, dtype=np.int64)
    for t in plan.norms:
        np.add.at(vec, t.index + t.index_stride * np.arange(t.view.rows), t.view.cols * esize[t.view.tensor])
    for t in plan.sums:
        vec[t.index: t.index + t.view.cols] += t.view.rows * esize[t.view.tensor]
    gram: dict = {}
    for t in plan.grams:
        key = (t.view.rows, t.slot)
        gram[key] = gram.get(key, 0) + t.view.rows * t.view.cols * esize[t.view.tensor]
    for d, slot, b in grams:
        gram[(d, slot)] = gram.get((d, slot), 0) + b
    return vec, gram


class Sampler:
    """Which laws each drift step decomposes, under a budget on the bytes copied before the step.

    Args:
        plan: the law plan; tensors: the tracked tensors (shapes, dtypes, the bytes they hold).
        budget: ``None``: every drift step decomposes every entry (whole tensors are copied: 1x the
            tracked bytes while the step runs). A fraction ``0 < budget``: the entries are cut into
            units (one Gram slot; a run of vector entries, rows of their views) and packed into groups
            whose copied views sum to at most ``budget`` x the tracked bytes (a unit bigger than that
            is a group of its own); drift step ``j`` decomposes group ``j mod len(groups)`` (round
            robin), so each law is decomposed once every ``len(groups)`` drift steps.
        shards: ``Shards`` when the tensors are sharded over ranks (``tensors`` are then this rank's
            local shards and ``plan`` the global plan): the units are the global plan's, each with a
            copy cost per rank, and the packing is first fit decreasing over the groups, so that every
            rank's copies of a group sum to at most ``budget`` x the bytes THAT rank holds (a unit
            bigger than that on some rank is a group of its own); the groups' sub-plans are made of
            this rank's terms (``Shards.local``) and read its local tensors.  ``tracked_bytes`` is then
            this rank's.  None: one process (units packed in order).

    ``snapshot(j, tensors)``: copies the views of group ``j`` (call right before the optimizer step).
    Held between steps: the plan-sized units and sub-plans (no tensor) and one int16 group id per
    output entry (``mask(j)`` compares them; int32 beyond 32767 groups).

    ``compact``: a partial group's sub-plan writes only the group's entries, renumbered in order
    (``vec_size`` = its vec entries, ``gram_slots[D]`` = its D x D slots: ``Snapshot.compact``; the
    entries are ``np.flatnonzero`` of the mask's host arrays), so the DRIFT pass's outputs are the
    group's size, not the law layout's; default False: every sub-plan writes the full layout.  An
    attribute: it may be set before the first snapshot (the fused optimizers decide from ``gram_entries``).
    """

    def __init__(self, plan: Plan, tensors: Sequence[torch.Tensor], budget: float | None, device,
                 compact: bool = False, shards: Shards | None = None):
        if budget is not None and not budget > 0:
            raise ValueError(f"snapshot_budget={budget} must be > 0 (a fraction of the tracked bytes) or None")
        self.plan, self.budget, self.device, self.compact = plan, budget, device, bool(compact)
        self.shards = shards
        self._esize = [t.element_size() for t in tensors]
        if shards is None:
            self._exec, costs = plan, [copy_costs(plan, self._esize)]
            held = [sum(t.numel() * t.element_size() for t in tensors)]
            rank = 0
        else:
            self._exec, costs, held, rank = shards.local, list(shards.costs), list(shards.held), shards.rank
        self.tracked_bytes = held[rank]
        ex = self._exec
        used = sorted({t.view.tensor for t in list(ex.grams) + list(ex.norms) + list(ex.sums)})
        self._used = used
        if budget is None or budget >= 1.0:
            self.groups = [None]
        else:
            cap = np.asarray([int(budget * b) for b in held], dtype=np.int64)
            self.groups = self._pack(self._units(cap, costs), cap, first_fit=shards is not None)
        self._subs: dict = {}  # group -> (sub-plan, views): plan-sized, built on first use
        self._masks()
    def _masks(self) -> None:
        """Per output entry the group that decomposes it (-1: none), int8/int16/int32 on the host (and a
        device copy off the CPU): a step's mask is one comparison, not a rebuild."""
        p, n = self.plan, len(self.groups)
        it = next(t for t in (np.int8, np.int16, np.int32) if n < np.iinfo(t).max)  # (1 byte per entry up to 126 groups)
        fill = 0 if self.groups == [None] else -1  # budget None: one group, every entry
        gv = np.full(p.vec_size, fill, dtype=it)
        gg = {d: np.full(k, fill, dtype=it) for d, k in p.gram_slots.items()}
        for g, units in enumerate(self.groups):
            for u in units or ():
                if u.key[0] == "gram":
                    gg[u.key[1]][u.key[2]] = g
                else:
                    gv[u.key[1]:u.key[2]] = g
        self._gid = (gv, gg)
        host = torch.device(self.device).type == "cpu"
        self._gid_dev = None if host else (torch.from_numpy(gv).to(self.device),
                                           {d: torch.from_numpy(m).to(self.device) for d, m in gg.items()})
        self._full = [bool((gv == g).all() and all((m == g).all() for m in gg.values())) for g in range(n)]

    def gram_entries(self) -> list[int]:
        """Per group, the Gram-matrix entries (slots x D x D) it decomposes."""
        gg = self._gid[1]
        return [sum(int((m == g).sum()) * d * d for d, m in gg.items()) for g in range(len(self.groups))]

    # ------------------------------------------------------------------ units and groups
    def _units(self, cap: np.ndarray, costs: Sequence[tuple]) -> list[_Unit]:
        """The global plan's entries cut into units (in the plan's order, the same on every rank), each
        with its copy cost per rank (``(ranks,)`` int64, from ``costs``: ``copy_costs`` per rank) and
        this rank's terms of it (``self._exec`` restricted to the unit's entries).  ``cap``: ``(ranks,)``
        bytes per rank."""
        p, ex, W = self.plan, self._exec, len(costs)
        units: dict = {}
        for t in p.grams:  # the slots, in the global plan's order
            key = ("gram", t.view.rows, t.slot)
            units.setdefault(key, _Unit(key, W))
        for r, (_, gc) in enumerate(costs):
            for (d, slot), b in gc.items():
                units[("gram", d, slot)].cost[r] += b
        for t in ex.grams:  # this rank's terms (whole D rows: a straddling term is in no rank's local plan)
            units[("gram", t.view.rows, t.slot)].grams.append(t)
        # vector entries: cost per entry and rank, then runs of entries of at most `cap` bytes on every rank
        cost = np.stack([vc for vc, _ in costs], axis=1) if p.vec_size else np.zeros((0, W), dtype=np.int64)
        sp, sx = _vec_spans(p), (None if ex is p else _vec_spans(ex))
        for (o0, o1) in _runs_under(cost, cap if W == 1 else np.maximum(cap // _SHARD_CUT, 1)):
            u = _Unit(("vec", o0, o1), W)
            gn, gs = _vec_terms(p, o0, o1, sp)
            if not (gn or gs):  # entries no term writes: no unit
                continue
            u.norms, u.sums = (gn, gs) if ex is p else _vec_terms(ex, o0, o1, sx)
            u.cost = cost[o0:o1].sum(axis=0)
            units[u.key] = u
        return list(units.values())

    @staticmethod
    def _pack(units: list[_Unit], cap: np.ndarray, first_fit: bool = False) -> list[list[_Unit]]:
        """Groups of units whose costs sum to at most ``cap`` on every rank (a unit bigger than that is a
        group of its own): in order (a group is consecutive units), or ``first_fit`` (first fit
        decreasing: each unit, largest share of a rank's budget first, joins the first group it fits in;
        with costs on several ranks a group then fills every rank's budget instead of closing when one
        rank's is full)."""
        groups: list[list[_Unit]] = []
        order = {id(u): i for i, u in enumerate(units)}
        if not first_fit:
            cur, acc = [], np.zeros_like(cap)
            for u in units:
                if cur and (acc + u.cost > cap).any():
                    groups.append(cur)
                    cur, acc = [], np.zeros_like(cap)
                cur.append(u)
                acc = acc + u.cost
            if cur:
                groups.append(cur)
            return groups
        # first fit decreasing: the units by their largest share of a rank's budget (stable: ties keep the
        # plan's order), each into the first group it fits in on every rank
        share = np.asarray([(u.cost / np.maximum(cap, 1)).max() if len(cap) else 0.0 for u in units])
        acc = np.zeros((0, len(cap)), dtype=np.int64)
        for i in np.argsort(-share, kind="stable"):
            u = units[i]
            fit = np.flatnonzero((acc + u.cost <= cap).all(axis=1)) if len(groups) else ()
            if len(fit):
                groups[fit[0]].append(u)
                acc[fit[0]] += u.cost
            else:
                groups.append([u])
                acc = np.vstack([acc, u.cost[None]])
        for g in groups:  # each group's units in the plan's order
            g.sort(key=lambda u: order[id(u)])
        return groups

    # ------------------------------------------------------------------ per drift step
    def mask(self, j: int) -> Mask:
        """The entries drift step ``j`` decomposes: one comparison of the per-entry group ids (host
        bool arrays, and on a GPU device bool tensors; built per call, not kept between steps).
        ``Mask.key`` is ``("sampler", group)``."""
        g = j % len(self.groups)
        gv, gg = self._gid
        vm, gm = gv == g, {d: m == g for d, m in gg.items()}
        if self._gid_dev is None:  # CPU: the tensors view the host arrays
            vt, gt = torch.from_numpy(vm), {d: torch.from_numpy(m) for d, m in gm.items()}
        else:
            vt, gt = self._gid_dev[0] == g, {d: m == g for d, m in self._gid_dev[1].items()}
        return Mask(vm, gm, vt, gt, self._full[g], ("sampler", g))

    @torch.no_grad()
    def snapshot(self, j: int, tensors: Sequence[torch.Tensor]) -> Snapshot:
        """Copy what drift step ``j`` reads of ``tensors`` (the weights right before the step)."""
        group = self.groups[j % len(self.groups)]
        p = self._exec  # (this rank's terms with ``shards``)
        if group is None:  # whole tensors, the plan as it is
            olds = [t.detach() for t in tensors]  # unread tensors: the live ones, never copied
            for i in self._used:
                olds[i] = tensors[i].detach().clone()
            return Snapshot(p, olds, list(range(len(tensors))), self.mask(j))
        sub, views = self._sub_plan(j % len(self.groups), tensors)
        olds = []
        for (i, shape, stride, off) in views:
            src = tensors[i].detach()
            buf = torch.empty(shape, dtype=src.dtype, device=src.device)
            buf.copy_(src.as_strided(shape, stride, src.storage_offset() + off))
            olds.append(buf)
        mask = self.mask(j)
        snap = Snapshot(sub, olds, [v[0] for v in views], mask, compact=self._compact(j % len(self.groups)))
        snap.news = views  # resolved against the live tensors after the step (``news``)
        return snap

    def _compact(self, g: int) -> bool:
        return self.compact and not self._full[g]

    def _sub_plan(self, g: int, tensors):
        """Group ``g``'s terms over compact copies of their views (one per distinct view), and per copy
        ``(tensor, shape, stride, offset)`` of the view it copies.  The sub-plan (plan-sized, no tensor)
        is cached; the memory layout is resolved against ``tensors`` at every call, so a parameter
        whose strides change during training (``p.data = ...``) is still read right."""
        if g not in self._subs:
            p = self.plan
            sub = Plan(vec_size=p.vec_size, gram_slots=dict(p.gram_slots))
            logical, index = [], {}
            vpos = gpos = None
            if self._compact(g):  # full entry -> its position among the group's entries (in order)
                gv, gg = self._gid
                vpos, gpos = np.cumsum(gv == g) - 1, {d: np.cumsum(m == g) - 1 for d, m in gg.items()}
                sub = Plan(vec_size=int((gv == g).sum()), gram_slots={d: int((m == g).sum()) for d, m in gg.items()})

            def rebase(v: View) -> View:
                key = (v.tensor, v.start, v.row_dim, v.rows, v.col_dim, v.cols, v.row_step)
                if key not in index:
                    index[key] = len(logical)
                    logical.append(v)
                return View(index[key], (0, 0), 0, v.rows, 1, v.cols)

            def at(i: int) -> int:  # a unit's entries are one run of the group's: progressions stay progressions
                return i if vpos is None else int(vpos[i])

            for u in self.groups[g]:
                sub.grams += [GramTerm(rebase(t.view), t.sign, t.slot if gpos is None else int(gpos[t.view.rows][t.slot]))
                              for t in u.grams]
                sub.norms += [NormTerm(rebase(t.view), t.sign, at(t.index), t.index_stride, t.shift) for t in u.norms]
                sub.sums += [SumTerm(rebase(t.view), t.sign, at(t.index)) for t in u.sums]
            if vpos is not None:  # the renumbering keeps every term's entries (checked once per group)
                _check_renumbered(self.plan, self.groups[g], sub, vpos)
            self._subs[g] = (sub, logical)
        sub, logical = self._subs[g]
        views = []
        for v in logical:
            off, rs, cs = v.resolve(tensors[v.tensor])
            views.append((v.tensor, (v.rows, v.cols), (rs, cs), off))
        return sub, views

    def news(self, snap: Snapshot, tensors: Sequence[torch.Tensor]) -> list:
        """The new tensors matching ``snap.olds`` (views of the live weights, no copy)."""
        if snap.news is None:
            return [t.detach() for t in tensors]
        out = []
        for (i, shape, stride, off) in snap.news:
            t = tensors[i].detach()
            out.append(t.as_strided(shape, stride, t.storage_offset() + off))
        return out

    def factors(self, snap: Snapshot, a: Sequence[float]) -> list[float]:
        """Decay factor per tensor of ``snap.plan`` from the factor per tracked tensor."""
        return [a[s] for s in snap.sources]
