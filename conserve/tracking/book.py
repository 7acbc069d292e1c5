"""The one booking path: a step's evaluated pieces -> one metric row (spec "The paper's error metric",
"Discrete steps: the exact drift identity").

``Layout`` indexes a compiled plan's output entries: the law instance, family and (family, layer) group
of each vec entry and Gram slot, and the scratch layout ``[vec | per-slot sums | Gram matrices]`` the
five per-entry terms of a drift step are formed in.  ``Book`` turns ``h(theta_{k+1})``, ``h_k``, ``h_0``
and the ``decay``/``first``/``second`` terms into the row: ``eps`` per family and group, the norms of
the five ``TERMS`` (``residual``: the identity's check), and keeps the series' sums (``cumulative``,
``sampled_steps``, ``step_sums``).  ``Tracker``, ``DistributedTracker`` (after its reduction) and the
fused optimizers (through ``Tracker.record_step``) all book here.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from ..laws import Compiled
from .drift import Assembly, Mask
from .values import CUMULATIVE, TERMS, CumulativeNotKept, DriftTerms, Values

GUARD = 1e-4  # an instance's |h_0| at most GUARD times its magnitude divides eps by the magnitude


MAX_RUNS = 16  # a tracker holds its vec entries' instances as stretches up to this many (``index_runs``)


def index_runs(idx: np.ndarray, device) -> tuple[list | None, torch.Tensor | None]:
    """``idx`` (an index array) as at most ``MAX_RUNS`` stretches ``(start, length, first, each)``: entries
    ``start..start+length`` index ``first, first+1, ...`` (``each``) or all ``first``; with the zero index the
    longest stretch of one needs.  ``(None, None)`` when it takes more stretches, or a stretch of one is
    longer than an eighth of ``idx`` (an index is then cheaper)."""
    runs, k, n = [], 0, len(idx)
    while k < n:
        j = k + 1
        if j < n and idx[j] == idx[k] + 1:
            while j < n and idx[j] == idx[j - 1] + 1:
                j += 1
            runs.append((k, j - k, int(idx[k]), True))
        else:
            while j < n and idx[j] == idx[k]:
                j += 1
            runs.append((k, j - k, int(idx[k]), j - k == 1))
        if len(runs) > MAX_RUNS:
            return None, None
        k = j
    longest = max([r[1] for r in runs if not r[3]], default=0)
    if longest > max(1, n // 8):
        return None, None
    return runs, torch.zeros(longest, dtype=torch.int32, device=device)


class Layout:
    """The index of a compiled plan's output entries (built once, on the host, then moved to ``device``).

    ``families`` (sorted names), ``groups`` (sorted ``(family, layer)``, layer -1 for a global law), and
    per entry its instance (``vec_inst``, ``gram_inst``), family (``fam_all``, flat layout: vec entries,
    then each D's Gram slots) and the per-instance group runs; ``metric_names`` of a row.  Instances of a
    group lie side by side in law order, so per-group sums are one segment sum per run (``group_sum``)
    and no per-instance index is held.

    Args:
        compiled: ``conserve.laws.compile_laws``' result.
        device: where the per-step indices live.
        drift: the rows carry the drift columns.
        grad_check: the rows carry the gradient check's columns (``conserve.tracking.gradients``).
    """

    def __init__(self, compiled: Compiled, device, drift: bool, grad_check: bool = False):
        self.compiled, self.device = compiled, device
        self.hits: dict = {}  # Mask.key -> (families,) bool: the families a sampler group decomposes
        self.entries_of: dict = {}  # Mask.key -> Entries: a sampler group's compact layout
        c, dev = compiled, device
        fams = sorted({l.family for l in c.laws})
        groups = sorted({(l.family, -1 if l.layer is None else l.layer) for l in c.laws})
        self.families, self.groups = fams, groups
        vec_inst = torch.zeros(c.plan.vec_size, dtype=torch.long, device="cpu")  # host-built (even under torch.device('meta'))
        vec_fam = torch.zeros(c.plan.vec_size, dtype=torch.long, device="cpu")
        gram_inst = {d: torch.zeros(n, dtype=torch.long, device="cpu") for d, n in c.plan.gram_slots.items()}
        gram_fam = {d: torch.zeros(n, dtype=torch.long, device="cpu") for d, n in c.plan.gram_slots.items()}
        inst_fam, inst_group = [], []
        for law, (kind, a, b) in zip(c.laws, c.where):
            f, g = fams.index(law.family), groups.index((law.family, -1 if law.layer is None else law.layer))
            if kind == "vec":
                n = b if law.per == "entry" else 1
                ids = torch.arange(len(inst_fam), len(inst_fam) + n, device="cpu")
                vec_inst[a: a + b] = ids if law.per == "entry" else ids[0]
                vec_fam[a: a + b] = f
            else:
                gram_inst[a][b], gram_fam[a][b], n = len(inst_fam), f, 1
            inst_fam += [f] * n
            inst_group += [g] * n
        # per output entry (vec entries, then each D's Gram slots: the ``flat`` layout of record_step),
        # its instance and family, int32 (index_add_ takes them); the per-layout indices are views
        self.gram_ds = list(c.plan.gram_slots)
        inst_all = torch.cat([vec_inst] + [gram_inst[d] for d in self.gram_ds]).to(dev, torch.int32)
        self.n_flat = inst_all.numel()
        fam_all = torch.cat([vec_fam] + [gram_fam[d] for d in self.gram_ds]).to(dev, torch.int32)
        offs = np.cumsum([c.plan.vec_size] + [c.plan.gram_slots[d] for d in self.gram_ds]).tolist()
        self.flat_at = dict(zip(self.gram_ds, offs[:-1]))  # D -> first flat index of its slots
        # the vec entries' instances: as a few stretches (``vec_runs``) when they form at most ``_MAX_RUNS``
        # (no 4 bytes per entry held), else the int32 index
        self.vec_runs, self.zero_idx = index_runs(vec_inst.numpy(), dev)
        self.vec_inst_held = None if self.vec_runs is not None else inst_all[: c.plan.vec_size]
        gram_part = inst_all[c.plan.vec_size:].clone()  # one int32 per Gram slot (few)
        self.gram_inst = {d: gram_part[o - c.plan.vec_size: o - c.plan.vec_size + c.plan.gram_slots[d]]
                           for d, o in self.flat_at.items()}
        spans, at = [], fam_all.numel()  # the scratch layout of record_step: [vec | slot sums | Grams]
        for d in self.gram_ds:
            n = c.plan.gram_slots[d]
            spans.append((d, at, at + n * d * d, (n, d, d)))
            at += n * d * d
        self.scratch_layout = (at, c.plan.vec_size, spans)
        inst_fam, inst_group = (torch.tensor(inst_fam, dtype=torch.long, device="cpu"),
                                torch.tensor(inst_group, dtype=torch.long, device="cpu"))
        self.n_inst = len(inst_fam)
        self.fam_count = torch.bincount(inst_fam, minlength=len(fams)).clamp_min(1).to(dev)
        self.group_count = torch.bincount(inst_group, minlength=len(groups)).clamp_min(1).to(dev)
        # the (family, layer) group of each instance, held as runs: the instances of a group lie side by side
        # in law order (a few runs per group), so the per-step group
        # sums are one segment sum per run (``group_sum``) and no 4 bytes per instance are held
        new_run = torch.ones(len(inst_group), dtype=torch.bool, device="cpu")
        new_run[1:] = inst_group[1:] != inst_group[:-1]
        starts = torch.nonzero(new_run).flatten()
        self.run_len = torch.diff(starts, append=torch.tensor([len(inst_group)], device="cpu")).to(dev, torch.int32)
        self.run_group = inst_group[starts].to(dev, torch.int32)
        # the family of each (family, layer) group (an instance's is expanded from the runs when needed, an
        # entry's gathered from that, unless an entry belongs to no law)
        self.group_fam = torch.tensor([fams.index(f) for f, _ in groups], dtype=torch.int32, device=dev)
        self.fam_all_held = None if torch.equal(self.inst_fam[inst_all], fam_all) else fam_all
        del inst_all
        self.metric_names = ([f"eps/{f}" for f in fams]
                             + [f"eps/{f}/" + ("global" if l < 0 else f"layer{l}") for f, l in groups]
                             + (([f"drift/{f}/{t}" for t in TERMS for f in fams]) if drift else [])
                             + ([f"grad_check/{f}" for f in fams]
                                + [f"grad_check/{f}/" + ("global" if l < 0 else f"layer{l}") for f, l in groups]
                                if grad_check else []))

    @property
    def vec_inst(self) -> torch.Tensor:
        """(vec entries,) int32: the instance of each vec entry (formed from ``vec_runs`` when held as runs)."""
        if self.vec_inst_held is not None:
            return self.vec_inst_held
        out = torch.empty(self.compiled.plan.vec_size, dtype=torch.int32, device=self.device)
        for a, n, i0, each in self.vec_runs:
            out[a: a + n] = torch.arange(i0, i0 + n, dtype=torch.int32, device=self.device) if each else i0
        return out

    @property
    def inst_all(self) -> torch.Tensor:
        """(entries,) int32: the instance of each output entry, flat layout (vec, then each D's slots)."""
        return torch.cat([self.vec_inst] + [self.gram_inst[d] for d in self.gram_ds])

    def vec_add(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``out.index_add_(0, _vec_inst, v)`` (the same bits: each instance gets its entries' additions in
        entry order), over the stretches when held as runs: a slice addition per stretch of consecutive
        instances, one ``index_add_`` into its instance per stretch of one."""
        if self.vec_runs is None:
            return out.index_add_(0, self.vec_inst_held, v)
        for a, n, i0, each in self.vec_runs:
            if each:
                out[i0: i0 + n].add_(v[a: a + n])
            else:
                out[i0: i0 + 1].index_add_(0, self.zero_idx[:n], v[a: a + n])
        return out

    @property
    def inst_group(self) -> torch.Tensor:
        """(instances,) int32: the (family, layer) group of each instance (expanded from the runs when read:
        not held)."""
        return torch.repeat_interleave(self.run_group, self.run_len)

    @property
    def inst_fam(self) -> torch.Tensor:
        """(instances,) int32: the family of each instance (expanded when read: not held; the per-step
        family sums add the (family, layer) group sums instead)."""
        return torch.repeat_interleave(self.group_fam.index_select(0, self.run_group), self.run_len)

    def group_sum(self, per_inst: torch.Tensor) -> torch.Tensor:
        """(groups,): the sum of a per-instance quantity over each (family, layer) group's instances (one
        segment sum per run of ``_run_len``, then the runs added into their groups)."""
        runs = torch.segment_reduce(per_inst, "sum", lengths=self.run_len)
        return torch.zeros(len(self.groups), dtype=per_inst.dtype, device=per_inst.device).index_add_(
            0, self.run_group, runs)

    def fam_mean(self, per_inst: torch.Tensor) -> torch.Tensor:
        """(families,): the mean of a per-instance quantity over each family's instances."""
        return torch.zeros(len(self.families), dtype=per_inst.dtype, device=per_inst.device).index_add_(
            0, self.inst_fam, per_inst) / self.fam_count

    @property
    def fam_all(self) -> torch.Tensor:
        """(entries,) int32: the family of each output entry, flat layout (vec, then each D's slots)."""
        held = self.fam_all_held
        return held if held is not None else self.inst_fam.index_select(0, self.inst_all)

    @property
    def vec_fam(self) -> torch.Tensor:
        return self.fam_all[: self.compiled.plan.vec_size]

    @property
    def gram_fam(self) -> dict:
        fam = self.fam_all
        return {d: fam[o: o + self.compiled.plan.gram_slots[d]] for d, o in self.flat_at.items()}

    def sq_bins(self, v: Values, vec_ids, gram_ids, n, in_place: bool = False) -> torch.Tensor:
        """(n,) the sums of squares of ``v``'s entries per bin; ``vec_ids`` None: the instances (``vec_add``);
        ``in_place``: ``v``'s tensors are squared in place (the same bits; ``v`` is then spent)."""
        sq = (lambda x: x.square_()) if in_place else (lambda x: x.square())  # noqa: E731
        out = torch.zeros(n, dtype=v.vec.dtype, device=self.device)
        out = self.vec_add(out, sq(v.vec)) if vec_ids is None else out.index_add_(0, vec_ids, sq(v.vec))
        for d, g in v.grams.items():
            out.index_add_(0, gram_ids[d], sq(g).sum((1, 2)))
        return out

    def inst_norm(self, v: Values, in_place: bool = False) -> torch.Tensor:
        return self.sq_bins(v, None, self.gram_inst, self.n_inst, in_place).sqrt()

    def fam_norm(self, v: Values) -> torch.Tensor:
        return self.sq_bins(v, self.vec_fam, self.gram_fam, len(self.families)).sqrt()


    def entries(self, mask: Mask, assembly: Assembly) -> "Entries":
        """The compact layout of ``mask``'s entries (``Entries``; ``assembly``: the drift assembly of the full
        layout, restricted to them), cached per ``mask.key``: a sampler group decomposes the same entries
        every time it comes round (held: see ``Entries``)."""
        got = self.entries_of.get(mask.key) if mask.key is not None else None
        if got is None:
            got = Entries(self, mask, assembly)
            if mask.key is not None:
                self.entries_of[mask.key] = got
        return got

    def family_hit(self, mask: Mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(families,) bool: the family has a decomposed entry under ``mask``, and its negation (cached per ``mask.key``:
        a sampler group decomposes the same entries every time it comes round)."""
        hit = self.hits.get(mask.key) if mask.key is not None else None
        if hit is None:
            flat = torch.cat([mask.vec.reshape(-1)] + [mask.grams[d].reshape(-1) for d in self.gram_ds])
            hit = torch.zeros(len(self.families), dtype=torch.int32, device=self.device)
            hit = hit.index_add_(0, self.fam_all, flat.to(torch.int32)) > 0
            hit = (hit, ~hit)
            if mask.key is not None:
                self.hits[mask.key] = hit
        return hit

    def scratch(self, lead: tuple, dt) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One buffer ``(*lead, V + slots + Gram entries)`` laid out ``[vec | per-slot sums | Gram
        matrices]``: returns it, its vec part and its ``{D: (*lead, slots, D, D)}`` Gram parts (views)."""
        return self.views(torch.empty(lead + (self.scratch_layout[0],), dtype=dt, device=self.device))

    def views(self, buf: torch.Tensor, layout: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(buf, vec part, {D: Gram part})`` of a ``scratch`` buffer (``layout``: a compact one, ``Entries``)."""
        total, nv, spans = self.scratch_layout if layout is None else layout
        return buf, buf[..., : nv], {d: buf[..., a: b].unflatten(-1, shape) for d, a, b, shape in spans}

    def squares(self, buf: torch.Tensor, vec: torch.Tensor, grams: Mapping[int, torch.Tensor],
                 at: "Entries | None" = None) -> torch.Tensor:
        """Square ``scratch`` values in place and sum each Gram slot's squares into its slot column:
        returns ``buf[..., :flat entries]``, the per-entry squares in the flat layout of ``fam_all``
        (``at``: of its ``families``)."""
        flat_at, n_flat = (self.flat_at, self.n_flat) if at is None else (at.flat_at, at.size)
        vec.mul_(vec)  # x * x: the bits of square()
        for d in self.gram_ds:
            g, o = grams[d], flat_at[d]
            torch.sum(g.mul_(g), (-2, -1), out=buf[..., o: o + g.shape[-3]])
        return buf[..., : n_flat]


def selector(ids: np.ndarray, device):
    """Sorted distinct indices ``ids`` as a ``slice`` when they are one run of consecutive integers (every
    sampler group's are: a unit is a run of the layout, a group consecutive units), so selecting them
    is a view and nothing is held; else an int32 index tensor on ``device`` (4 bytes per index)."""
    if len(ids) == 0 or int(ids[-1]) - int(ids[0]) + 1 == len(ids):
        return slice(int(ids[0]) if len(ids) else 0, int(ids[-1]) + 1 if len(ids) else 0)
    return torch.from_numpy(ids).to(device, torch.int32)


def add_at(x: torch.Tensor, sel, y: torch.Tensor) -> None:
    """``x[sel] += y`` in place (``sel``: a ``selector``; each selected entry gets one addition)."""
    if isinstance(sel, slice):
        x[sel].add_(y)
    else:
        x.index_add_(0, sel, y)


class Entries:
    """The entries of a partial drift step (``Mask``), for terms in the compact layout: ``vec`` / ``slots[D]``
    / ``flat`` select them in the vec layout, each D's Gram slots and the flat layout of ``_fam_all``
    (``selector``: slices, or int32 index tensors when not one run); ``size`` of them; the compact
    scratch layout ``[vec | per-slot sums | Gram matrices]`` of ``Layout.views``; ``assembly``, the
    drift assembly in this layout (``Assembly.restrict``).  Built once per sampler group from the
    mask's host arrays and cached per ``Mask.key`` (``Layout.entries``).  Held per group: a few
    Python objects, the assembly's set-id runs (a few, 8 bytes each) and, for selections that are
    not one run, 4 bytes per entry (index) + 1 (linear flag); none for the samplers' groups (every
    group is one run of the layout: slices and views)."""

    __slots__ = ("vec", "slots", "flat", "size", "flat_at", "layout", "assembly")

    def __init__(self, tr: "Layout", mask: Mask, assembly: Assembly):
        dev = tr.device
        vi = np.flatnonzero(mask.vec_np)
        si = {d: np.flatnonzero(mask.gram_np[d]) for d in tr.gram_ds}
        self.vec, self.slots = selector(vi, dev), {d: selector(x, dev) for d, x in si.items()}
        self.flat = selector(np.concatenate([vi] + [tr.flat_at[d] + si[d] for d in tr.gram_ds]), dev)
        self.size = len(vi) + sum(len(x) for x in si.values())
        nv, at, self.flat_at = len(vi), len(vi), {}
        for d in tr.gram_ds:
            self.flat_at[d] = at
            at += len(si[d])
        spans = []
        for d in tr.gram_ds:
            n = len(si[d])
            spans.append((d, at, at + n * d * d, (n, d, d)))
            at += n * d * d
        self.layout = (at, nv, spans)
        # the assembly in this layout (slices: its per-entry flags are views of the parent's)
        host = lambda sel, ids: sel if isinstance(sel, slice) else ids  # noqa: E731
        self.assembly = assembly.restrict(host(self.vec, vi), {d: host(self.slots[d], si[d]) for d in si})

    def families(self, tr: "Layout") -> torch.Tensor:
        """(size,) int32: the family of each of these entries (gathered per call: not held)."""
        held = tr.fam_all_held
        return held[self.flat] if held is not None else tr.inst_fam.index_select(0, tr.inst_all[self.flat])

    def take(self, v: "Values") -> tuple:
        """``(vec, {D: grams})`` of ``v`` at these entries (views for slices, else gathered copies): read only."""
        return v.vec[self.vec], {d: g[self.slots[d]] for d, g in v.grams.items()}


def residual(measured, decay, first, second, out=None):
    """``measured - decay - first - second``, subtracted left to right: the identity's check (zero up to
    rounding; spec "Discrete steps: the exact drift identity").  Tensors of one shape; ``out``: written
    there (it may be ``measured``'s own buffer only if nothing reads ``measured`` afterwards)."""
    if out is None:
        return measured - decay - first - second
    return torch.sub(measured, decay, out=out).sub_(first).sub_(second)


def guarded_denominators(h0_norm: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """(instances,) ``eps`` denominators: ``||h_i(theta_0)||``, or the instance's magnitude (the same law with
    every sign +) where ``||h_i(theta_0)||`` is not above ``GUARD`` times it (a law that starts balanced),
    at least the dtype's ``tiny`` (spec "The paper's error metric")."""
    return torch.where(h0_norm > GUARD * magnitude, h0_norm, magnitude).clamp_min(torch.finfo(h0_norm.dtype).tiny)


class Book:
    """The bookkeeping of a tracked series: turns one step's evaluated pieces into a metric row.

    From ``h(theta_{k+1})``, ``h_k``, ``h_0`` and (on a drift step) the ``decay``/``first``/``second`` terms
    over the decomposed entries (``Mask``), ``row`` forms the row ``Tracker.metric_names`` describes:
    ``eps`` per family and per (family, layer) group, then per term and family the Euclidean norm of the
    five ``TERMS`` (``residual`` from ``residual``; NaN for a family without a decomposed entry).  It keeps
    what the series accumulates: ``cumulative`` (the per-entry sums of the first four terms, when kept),
    ``sampled_steps`` (per family, the drift steps that decomposed some entry of it), ``step_sums``
    (per term and family, the sum of the row norms, on the host) and the ``eps`` guards.
    ``DistributedTracker`` books a rank's share through ``share`` and the reduced row through ``finish``.

    Args:
        layout: the index of the compiled plan (``Layout``).
        h0: ``h(theta_0)`` (``Values``, summed over ranks when sharded).
        magnitude: the magnitude evaluation (``abs_plan``), consumed (squared in place).
        keep_cumulative: keep the per-entry ``cumulative`` sums (4 law-sized copies).
    """

    def __init__(self, layout: Layout, h0: Values, magnitude: Values, *, drift: bool, keep_cumulative: bool):
        self.layout, self.drift = layout, drift
        magn = layout.inst_norm(magnitude, in_place=True)  # (squared in place: no second law-sized buffer)
        del magnitude
        h0n = layout.inst_norm(h0)
        self.guard_at = self.guard_val = None
        self.set_denominators(h0, guarded_denominators(h0n, magn))
        self.fam_count_f, self.group_count_f = (c.to(h0.vec.dtype) for c in (layout.fam_count, layout.group_count))
        # the mean over each family's instances of |h_0| / magnitude (``Tracker.totals()["balance"]``)
        self.balance = layout.fam_mean(h0n / magn.clamp_min(torch.finfo(h0n.dtype).tiny))
        del h0n, magn
        self.keep_cumulative = keep_cumulative
        # each term summed over the decomposed (entry, step) pairs since step 0, in place at each drift step
        self.cumulative: dict[str, Values] = ({k: h0.map(torch.zeros_like) for k in CUMULATIVE}
                                              if keep_cumulative else CumulativeNotKept())
        # per term (CUMULATIVE) and family, the sum over the booked drift steps of the step's family norm: on
        # the host, summed from the rows at each flush; no per-step cost
        self.step_sums = torch.zeros(len(CUMULATIVE), len(layout.families), dtype=torch.float64, device="cpu")
        self.sampled_steps = torch.zeros(len(layout.families), dtype=torch.long, device=layout.device)

    # ------------------------------------------------------------------------------- eps
    def denominators(self, h0: Values, sv: torch.Tensor | None = None,
                     sg: Mapping[int, torch.Tensor] | None = None) -> torch.Tensor:
        """(instances,) the ``eps`` denominators (``guarded_denominators``), dtype of ``h_0``; formed when read
        from ``h0`` (one evaluation of the instance norms): only the guarded instances' values are held
        (``guard_at``, ``guard_val``: 12 bytes each).  ``sv``, ``sg``: scratch of ``h_0``'s vec and Gram
        shapes and dtype the squares are written into (overwritten; the bits of ``Layout.inst_norm``)."""
        lay = self.layout
        if sv is None:
            d = lay.inst_norm(h0)
        else:
            d = lay.vec_add(torch.zeros(lay.n_inst, dtype=h0.vec.dtype, device=lay.device),
                            torch.mul(h0.vec, h0.vec, out=sv))
            for k, g in h0.grams.items():
                d.index_add_(0, lay.gram_inst[k], torch.mul(g, g, out=sg[k]).sum((1, 2)))
            d.sqrt_()
        if self.guard_at.numel():
            d.index_copy_(0, self.guard_at, self.guard_val)
        return d.clamp_min_(torch.finfo(d.dtype).tiny)

    def set_denominators(self, h0: Values, value: torch.Tensor) -> None:
        """Keep the denominators ``value`` that differ from ``||h_i(theta_0)||`` (the guarded ones)."""
        h0n = self.layout.inst_norm(h0)
        value = value.to(device=h0n.device, dtype=h0n.dtype)
        at = torch.nonzero(value != h0n).flatten()  # (a denominator clamped to tiny too)
        self.guard_at, self.guard_val = at, value.index_select(0, at)

    def guarded(self, h0: Values, dtype: torch.dtype) -> torch.Tensor:
        """(families,) the fraction of a family's instances whose ``eps`` divides by the magnitude, ``dtype``."""
        lay = self.layout
        g = torch.zeros(lay.n_inst, dtype=dtype, device=lay.device)
        g[self.guard_at] = (self.guard_val > lay.inst_norm(h0)[self.guard_at]).to(dtype)
        return lay.fam_mean(g)

    def relative(self, h1: Values, h0: Values) -> torch.Tensor:
        """(instances,) ``||h_i(theta_{k+1}) - h_i(theta_0)|| / denominator``, in the promoted dtype of ``h1``
        and ``h0``; the differences and the denominators' squares go through one vec-sized and one
        Gram-sized scratch."""
        lay, dev = self.layout, self.layout.device
        dt = torch.promote_types(h1.vec.dtype, h0.vec.dtype)
        with torch.no_grad():  # (out= takes no autograd inputs; the row is a detached metric either way)
            sv = torch.empty(h1.vec.shape, dtype=dt, device=dev)
            sg = {d: torch.empty(g.shape, dtype=dt, device=dev) for d, g in h1.grams.items()}
            dv, g = torch.sub(h1.vec, h0.vec, out=sv), None
            rel = lay.vec_add(torch.zeros(lay.n_inst, dtype=dt, device=dev), dv.mul_(dv))
            for d, g in h1.grams.items():  # x * x: the bits of square()
                g = torch.sub(g, h0.grams[d], out=sg[d])
                rel.index_add_(0, lay.gram_inst[d], g.mul_(g).sum((1, 2)))
            rel.sqrt_().div_(self.denominators(h0, sv, sg) if dt == h0.vec.dtype else self.denominators(h0))
        return rel

    def family_sums(self, rel: torch.Tensor, per_instance: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``((families,), (groups,))``: the sums of the per-instance ``rel`` over each family and each
        (family, layer) group.  A family's sum adds its groups' sums, or (``per_instance``: a rank's share,
        reduced over ranks before ``eps_means``) its instances directly."""
        lay = self.layout
        grp = lay.group_sum(rel)
        fam = torch.zeros(len(lay.families), dtype=rel.dtype, device=rel.device)
        fam = fam.index_add_(0, lay.inst_fam, rel) if per_instance else fam.index_add_(0, lay.group_fam, grp)
        return fam, grp

    def eps_means(self, fam: torch.Tensor, grp: torch.Tensor) -> list[torch.Tensor]:
        """The row's ``eps`` columns from ``family_sums``: the means over each family's and group's instances."""
        return [fam.div_(self.fam_count_f), grp.div_(self.group_count_f)]

    # ------------------------------------------------------------------------------- drift terms
    def count_sampled(self, sampled: Mask | None) -> torch.Tensor | None:
        """Count a drift step over ``sampled`` in ``sampled_steps``; returns the (families,) mask of the
        families without a decomposed entry (None when the step decomposed every entry)."""
        if sampled is not None and not sampled.full:
            hit, miss = self.layout.family_hit(sampled)
            self.sampled_steps += hit
            return miss
        self.sampled_steps += 1
        return None

    def term_norms(self, squares: torch.Tensor, sampled: Mask | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``(len(TERMS), families)`` row norms from per-family sums of squares (in place when ``out`` is
        ``squares``): the square root, NaN for a family without a decomposed entry; counts the step
        (``count_sampled``)."""
        norms = squares.sqrt_() if out is None else torch.sqrt(squares, out=out)
        miss = self.count_sampled(sampled)
        if miss is not None:
            norms.masked_fill_(miss, float("nan"))
        return norms

    def add_cumulative(self, terms: Sequence, at: "Entries | None" = None) -> None:
        """``cumulative[t] += term`` for the first four ``TERMS`` (``terms``: ``(vec, {D: grams})`` each, in
        ``CUMULATIVE`` order; ``at``: they hold those entries only).  Nothing when not kept."""
        if not self.keep_cumulative:
            return
        for k, (tv, tg) in zip(CUMULATIVE, terms):
            c = self.cumulative[k]
            if at is None:
                c.vec.add_(tv)
                for d, g in c.grams.items():
                    g.add_(tg[d])
            else:  # at the group's entries only (the others would add zeros)
                add_at(c.vec, at.vec, tv)
                for d, g in c.grams.items():
                    add_at(g, at.slots[d], tg[d])

    def drift_norms(self, h1: Values, h_k: Values, terms: Mapping[str, Values], sampled: Mask | None,
                    norms: torch.Tensor, keep_last: bool) -> dict | None:
        """The five terms of one drift step (stacked scratch), ``cumulative += `` the first four (when kept), and
        per term and family the Euclidean norm into ``norms`` (``(len(TERMS), families)``, NaN for a family
        without a decomposed entry).  Returns the per-entry terms (``{term: Values}``, full layout) when
        ``keep_last``, else None."""
        lay = self.layout
        dev = lay.device
        dec, fst, snd = terms["decay"], terms["first"], terms["second"]
        dt = torch.promote_types(torch.promote_types(h1.vec.dtype, h_k.vec.dtype),
                                 torch.promote_types(torch.promote_types(dec.vec.dtype, fst.vec.dtype), snd.vec.dtype))
        partial = sampled is not None and not sampled.full
        at = getattr(terms, "at", None)  # compact terms (drift_terms over a compact sub-plan): the group's entries
        layout = lay.scratch_layout if at is None else at.layout
        buf = getattr(terms, "buf", None)  # assemble wrote the terms into rows 1-3 of it: taken (consumed) here
        if buf is not None:
            terms.buf = None
        if buf is None or buf.dtype != dt or buf.shape[-1] != layout[0] \
                or lay.views(buf, layout)[1][1].data_ptr() != dec.vec.data_ptr():
            buf = torch.empty(len(TERMS), layout[0], dtype=dt, device=dev)
        buf, wv, wg = lay.views(buf, layout)
        if at is not None:  # the group's entries of h_{k+1} and h_k (taken by assemble); the terms need no mask
            hk = terms.h_old if terms.h_old is not None else at.take(h_k)
            h1, partial_masks = at.take(h1), False
        else:
            hk, partial_masks = (h_k.vec, h_k.grams), partial

        def fill(w, hv, ov, parts, mask):
            ws = w.unbind(0)
            torch.sub(hv, ov, out=ws[0])  # measured
            if mask is not None:
                ws[0].mul_(mask)
            for i, x in enumerate(parts, 1):
                if x.data_ptr() != ws[i].data_ptr():
                    ws[i].copy_(x)
            residual(ws[0], ws[1], ws[2], ws[3], out=ws[4])

        h1v, h1g = (h1.vec, h1.grams) if at is None else h1
        hkv, hkg = hk
        fill(wv, h1v, hkv, (dec.vec, fst.vec, snd.vec), sampled.vec if partial_masks else None)
        for d, g in h1g.items():
            fill(wg[d], g, hkg[d], (dec.grams[d], fst.grams[d], snd.grams[d]),
                 sampled.grams[d].view(-1, 1, 1) if partial_masks else None)
        if self.keep_cumulative:
            self.add_cumulative([(wv[i], {d: g[i] for d, g in wg.items()}) for i in range(len(CUMULATIVE))], at)
        last = None
        if keep_last:  # a copy: ``buf`` is squared below (compact: scattered into the full layout)
            if at is None:
                _, kv, kg = lay.views(buf.clone())
            else:
                _, kv, kg = lay.scratch((len(TERMS),), dt)
                kv.zero_()[:, at.vec] = wv
                for d, g in kg.items():
                    g.zero_()[:, at.slots[d]] = wg[d]
            last = {t: Values(kv[i], {d: g[i] for d, g in kg.items()}) for i, t in enumerate(TERMS)}
        sq = lay.squares(buf, wv, wg, at)
        fam = lay.fam_all if at is None else at.families(lay)
        out = norms.zero_() if norms.dtype == dt else torch.zeros(norms.shape, dtype=dt, device=dev)
        for i in range(len(TERMS)):
            out[i].index_add_(0, fam, sq[i])
        if out is norms:
            self.term_norms(norms, sampled if partial else None)
        else:
            self.term_norms(out, sampled if partial else None, out=None)
            norms.copy_(out)
        return last

    def row(self, h1: Values, h0: Values, h_k: Values, terms: Mapping[str, Values] | None, sampled: Mask | None,
            keep_last: bool = False, grad: torch.Tensor | None = None) -> tuple[torch.Tensor, dict | None]:
        """One step's metric row (float32, on the device) and, on a drift step with ``keep_last``, its
        per-entry terms.  ``terms`` None on a drift-enabled series: the drift columns are NaN.  ``grad``:
        the gradient check's columns (``GradientWatch.update``), appended last."""
        lay, dev = self.layout, self.layout.device
        nf = len(lay.families)
        dt = torch.promote_types(h1.vec.dtype, h0.vec.dtype)
        norms, last = None, None
        if self.drift:  # the terms first: their scratch is squared, reduced and freed before the eps scratch exists
            norms = torch.empty(len(TERMS), nf, dtype=dt, device=dev)
            if terms is None:
                norms.fill_(float("nan"))
            else:
                last = self.drift_norms(h1, h_k, terms, sampled, norms, keep_last)
                if isinstance(terms, DriftTerms):  # consumed (documented): its views of the scratch go with it
                    terms.clear()
                    terms.buf = terms.h_old = None
        parts = self.eps_means(*self.family_sums(self.relative(h1, h0)))
        if norms is not None:
            parts.append(norms.view(-1))
        row = torch.cat(parts).float()
        return (row if grad is None else torch.cat([row, grad.to(row.device, row.dtype)])), last

    def drift_sums(self, rows: torch.Tensor | None) -> torch.Tensor:
        """(len(CUMULATIVE), families) float64 on the host: per term and family the sum of the drift
        columns of ``rows`` (metric rows, step-major), NaN (not decomposed) skipped."""
        nf = len(self.layout.families)
        if rows is None or not self.drift or rows.shape[0] == 0:
            return torch.zeros(len(CUMULATIVE), nf, dtype=torch.float64, device="cpu")
        at = nf + len(self.layout.groups)  # the drift columns: drift/<family>/<term>, term-major (TERMS order)
        cols = rows[:, at: at + len(CUMULATIVE) * nf].to(torch.float64)
        return cols.nansum(0).view(len(CUMULATIVE), nf).cpu()
