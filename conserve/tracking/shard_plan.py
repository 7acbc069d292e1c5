"""Where each law term is evaluated when the tracked tensors are sharded over ranks (no process group).

Given the compiled laws and how each tensor is held (``ShardLayout``: ``Shard(d)`` ranges per rank, or
replicated), ``comm_schedule`` gives every rank's local terms (views rewritten for its shard; summed over
ranks they give the global plan), the Gram terms whose rows straddle ranks with their owner rank, and
which law-value entries are complete on one rank or split over several. ``DistributedTracker`` runs
it at construction; ``bench/dist_bytes.py`` runs it on meta tensors to size a 70B layout.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from .. import kernels
from ..laws import Compiled
from .values import TERMS, Values
from .drift import Shards, copy_costs

__all__ = ["CommSchedule", "comm_schedule", "shard_layouts", "sampler_shards"]

# ------------------------------------------------------------------------------------ localisation
@dataclass(frozen=True)
class ShardLayout:
    """How one tracked tensor is held: ``dim`` is the sharded dimension (None: replicated) and
    ``ranges[r] = (global offset, length)`` of rank r's shard along it."""

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()


def shard_layouts(shapes: Sequence[Sequence[int]], dims: Sequence[int | None], world: int) -> list[ShardLayout]:
    """Layouts of tensors sharded like ``DTensor`` ``Shard(dim)`` (``torch.chunk`` pieces, trailing
    ranks possibly empty) on ``world`` ranks; ``dim=None``: replicated. For planning without a process
    group (``bench/dist_bytes.py``)."""
    out = []
    for shape, d in zip(shapes, dims):
        if d is None:
            out.append(ShardLayout(None))
            continue
        n = shape[d]
        c = -(-n // world)
        out.append(ShardLayout(d, tuple((min(r * c, n), max(0, min(c, n - r * c))) for r in range(world))))
    return out


def _local_view(v: kernels.View, lay: ShardLayout, r: int):
    """Rank r's part of view ``v``: ``(local view, first row, first col)`` in view coordinates, or None
    when rank r holds none of it."""
    if lay.dim is None:
        return v, 0, 0
    if v.rows == 0 or v.cols == 0:
        return None
    off, n = lay.ranges[r]
    s, start = lay.dim, list(v.start)
    rows, cols, r_lo, c_lo = v.rows, v.cols, 0, 0
    if s == v.row_dim:
        a, step = v.start[s], v.row_step
        r_lo = max(0, -(-(off - a) // step))
        r_hi = min(v.rows, -(-(off + n - a) // step))
        if r_hi <= r_lo:
            return None
        start[s], rows = a + r_lo * step - off, r_hi - r_lo
    elif s == v.col_dim:
        c_lo, c_hi = max(0, off - v.start[s]), min(v.cols, off + n - v.start[s])
        if c_hi <= c_lo:
            return None
        start[s], cols = v.start[s] + c_lo - off, c_hi - c_lo
    else:
        if not off <= v.start[s] < off + n:
            return None
        start[s] -= off
    return replace(v, start=tuple(start), rows=rows, cols=cols), r_lo, c_lo


@dataclass
class _Straddle:
    """A Gram term whose D rows lie on several ranks: ``pieces[r]`` = rank r's local view (None if it
    holds no row), in row order; ``owner`` evaluates the term on the rows the others send it."""

    term: kernels.GramTerm
    pieces: list
    owner: int
    dtype: torch.dtype

    def sizes(self) -> list[int]:
        return [0 if p is None else p.rows * p.cols for p in self.pieces]


def _split(plan: kernels.Plan, layouts: Sequence[ShardLayout], world: int, dtypes):
    """Every rank's local plan (terms rewritten for the local shards; summed over ranks, plus the
    straddling terms, they give the global plan) and the Gram terms that straddle ranks, each with
    its owner: the holder that keeps the bytes received per rank balanced (the one with the least
    received so far after taking this term; ties to the lower rank, so equal terms go round robin)."""
    plans = [kernels.Plan([], [], [], plan.vec_size, dict(plan.gram_slots)) for _ in range(world)]
    straddles: list[_Straddle] = []
    load = [0] * world
    counter = 0

    def owner_of_replicated():
        nonlocal counter
        counter += 1
        return (counter - 1) % world

    for t in plan.grams:
        lay = layouts[t.view.tensor]
        if lay.dim is None:
            plans[owner_of_replicated()].grams.append(t)
            continue
        parts = [_local_view(t.view, lay, r) for r in range(world)]
        holders = [r for r, p in enumerate(parts) if p is not None]
        if lay.dim == t.view.row_dim and len(holders) > 1:
            n = {r: parts[r][0].rows * parts[r][0].cols for r in holders}
            total = sum(n.values())
            owner = min(holders, key=lambda r: (load[r] + total - n[r], r))
            load[owner] += total - n[owner]
            straddles.append(_Straddle(t, [p[0] if p is not None else None for p in parts], owner,
                                       dtypes[t.view.tensor]))
        else:
            for r in holders:
                plans[r].grams.append(replace(t, view=parts[r][0]))
    # vector terms: a norm's local rows start at entry index + first_row * index_stride, a sum's local
    # columns at index + first_col
    for kind, terms, at in (("norms", plan.norms, lambda t, p: t.index + p[1] * t.index_stride),
                            ("sums", plan.sums, lambda t, p: t.index + p[2])):
        for t in terms:
            lay = layouts[t.view.tensor]
            if lay.dim is None:
                getattr(plans[owner_of_replicated()], kind).append(t)
                continue
            for r in range(world):
                p = _local_view(t.view, lay, r)
                if p is not None:
                    getattr(plans[r], kind).append(replace(t, view=p[0], index=at(t, p)))
    return plans, straddles


def localize(plan: kernels.Plan, layouts: Sequence[ShardLayout], rank: int, world: int, dtypes):
    """Rank ``rank``'s local plan and the straddling Gram terms (the same list on every rank)."""
    plans, straddles = _split(plan, layouts, world, dtypes)
    return plans[rank], straddles


# --------------------------------------------------------------------------------- entries, owners
class EntrySet:
    """A selection of law-value entries <-> one flat vector: the selected vector entries, then the
    upper triangle (diagonal included) of each selected Gram slot (D ascending)."""

    def __init__(self, vec: torch.Tensor, slots: Mapping[int, torch.Tensor], device):
        self.vec = vec.to(device=device, dtype=torch.long)
        self.slots = {d: s.to(device=device, dtype=torch.long) for d, s in sorted(slots.items()) if s.numel()}
        self.tri = {d: torch.triu_indices(d, d, device=device) for d in self.slots}
        self.size = self.vec.numel() + sum(s.numel() * d * (d + 1) // 2 for d, s in self.slots.items())

    def take(self, v: Values) -> torch.Tensor:
        parts = [v.vec[self.vec]]
        for d, s in self.slots.items():
            i, j = self.tri[d]
            parts.append(v.grams[d][s[:, None], i[None], j[None]].reshape(-1))  # (no copy of the whole slots)
        return torch.cat(parts)

    def put(self, v: Values, x: torch.Tensor) -> Values:
        """Write ``x`` (from ``take``) into ``v`` in place (both triangles); returns ``v``."""
        n = self.vec.numel()
        v.vec[self.vec] = x[:n].to(v.vec.dtype)
        o = n
        for d, s in self.slots.items():
            k = d * (d + 1) // 2
            u = x[o: o + s.numel() * k].view(s.numel(), k).to(v.grams[d].dtype)
            o += s.numel() * k
            g = v.grams[d][s]
            i, j = self.tri[d]
            g[:, i, j] = u
            g[:, j, i] = u
            v.grams[d][s] = g
        return v


def _touched(p: kernels.Plan):
    """Vector entries and Gram slots (by D) that the terms of ``p`` add to."""
    vec = [t.index + torch.arange(t.view.rows, device="cpu") * t.index_stride for t in p.norms]
    vec += [t.index + torch.arange(t.view.cols, device="cpu") for t in p.sums]
    slots: dict[int, list[int]] = {}
    for t in p.grams:
        slots.setdefault(t.view.rows, []).append(t.slot)
    return (torch.cat(vec) if vec else torch.zeros(0, dtype=torch.long, device="cpu")), slots


def _entry_owners(compiled: Compiled, plans, straddles):
    """Per vector entry and per Gram slot: the one rank whose terms give its whole value, or -1 when
    several ranks contribute (split). Every straddling Gram slot is split (its owner's part arrives
    only at the exchange); a ``per="law"`` vector law is complete only if all its entries are on one rank."""
    plan = compiled.plan

    def mark(first, multi, idx, r):
        hit = torch.zeros_like(multi)
        hit[idx] = True
        multi |= hit & (first >= 0) & (first != r)
        first[hit & (first < 0)] = r

    vf = torch.full((plan.vec_size,), -1, dtype=torch.long, device="cpu")
    vm = torch.zeros(plan.vec_size, dtype=torch.bool, device="cpu")
    gf = {d: torch.full((n,), -1, dtype=torch.long, device="cpu") for d, n in plan.gram_slots.items()}
    gm = {d: torch.zeros(n, dtype=torch.bool, device="cpu") for d, n in plan.gram_slots.items()}
    for r, p in enumerate(plans):
        vec, slots = _touched(p)
        if vec.numel():
            mark(vf, vm, vec, r)
        for d, s in slots.items():
            mark(gf[d], gm[d], torch.tensor(s, dtype=torch.long, device="cpu"), r)
    for s in straddles:
        gm[s.term.view.rows][s.term.slot] = True
    vec_owner = torch.where(vm, -1, vf.clamp_min(0))
    gram_owner = {d: torch.where(gm[d], -1, gf[d].clamp_min(0)) for d in gf}
    for law, (kind, a, b) in zip(compiled.laws, compiled.where):
        if kind == "vec" and law.per == "law" and b:
            seg = vec_owner[a: a + b]
            if seg[0] < 0 or not bool((seg == seg[0]).all()):
                vec_owner[a: a + b] = -1
    return vec_owner, gram_owner


@dataclass
class CommSchedule:
    """What the distributed tracker communicates, worked out from the laws and the shard layouts
    alone (no process group): ``plans[r]`` rank r's local terms, ``straddles`` the Gram terms whose
    rows span ranks (with their owners), ``vec_owner`` / ``gram_owner`` the rank holding each entry's
    whole value (-1: split), ``split_size`` the scalars of the split entries (upper triangles for
    Grams), ``families`` / ``groups`` the sizes of the metric row's eps parts."""

    plans: list
    straddles: list
    vec_owner: torch.Tensor
    gram_owner: dict
    split_size: int
    families: int
    groups: int

    def step_scalars(self, drift: bool = True, tracked_drift: bool | None = None, kernel_decay: bool = False) -> int:
        """Scalars one rank keeps per pending step and all-reduces at the flush: the metric-row partials
        (eps sums per family and group; with ``tracked_drift`` (default ``drift``) sums of squares of the 5
        drift norms per family) and the split entries' partial h(new), plus first and second on a step
        with ``drift`` terms (their decay is ``(a^2 - 1) h_k`` from the reduced h_k; ``kernel_decay``: one
        block more, the kernel's decay of entries whose tensors have different ``a``)."""
        tracked = drift if tracked_drift is None else tracked_drift
        return (self.families + self.groups + (len(TERMS) * self.families if tracked else 0)
                + (1 + (2 + kernel_decay) * drift) * self.split_size)

    def row_traffic(self, drift: bool = True) -> tuple[list[int], list[int]]:
        """Per rank, (elements received, elements sent) of straddling rows per step (owner-only)."""
        world = len(self.plans)
        recv, sent = [0] * world, [0] * world
        blocks = 2 if drift else 1  # new rows, and the old rows for the drift terms
        for s in self.straddles:
            n = s.sizes()
            recv[s.owner] += blocks * (sum(n) - n[s.owner])
            for r, m in enumerate(n):
                if r != s.owner:
                    sent[r] += blocks * m
        return recv, sent


def comm_schedule(compiled: Compiled, layouts: Sequence[ShardLayout], dtypes) -> CommSchedule:
    """``CommSchedule`` of ``compiled`` laws on tensors held as ``layouts`` (one per ``compiled.names``)."""
    world = max([len(l.ranges) for l in layouts if l.dim is not None], default=1)
    plans, straddles = _split(compiled.plan, layouts, world, dtypes)
    vec_owner, gram_owner = _entry_owners(compiled, plans, straddles)
    split = int((vec_owner < 0).sum()) + sum(int((o < 0).sum()) * d * (d + 1) // 2 for d, o in gram_owner.items())
    fams = {l.family for l in compiled.laws}
    groups = {(l.family, l.layer) for l in compiled.laws}
    return CommSchedule(plans, straddles, vec_owner, gram_owner, split, len(fams), len(groups))


def sampler_shards(sched: CommSchedule, shapes: Sequence[Sequence[int]], esize: Sequence[int],
                   layouts: Sequence[ShardLayout], rank: int) -> Shards:
    """The drift sampler's view of the shards (``conserve.tracking.drift.Shards``) for rank ``rank``:
    per rank the bytes it copies before a drift step per law entry (``copy_costs`` of its local terms,
    plus its rows of each straddling Gram term: it sends them to the owner) and the tracked bytes it
    holds, from the global ``shapes``, the bytes per element and the layouts alone (no process group:
    every rank gets the same costs, so every rank packs the same groups)."""
    costs, held = [], []
    for r, local in enumerate(sched.plans):
        rows = [(s.term.view.rows, s.term.slot, s.pieces[r].rows * s.pieces[r].cols * esize[s.term.view.tensor])
                for s in sched.straddles if s.pieces[r] is not None]
        costs.append(copy_costs(local, esize, rows))
        b = 0
        for shape, e, lay in zip(shapes, esize, layouts):
            n = 1
            for x in shape:
                n *= x
            if lay.dim is not None:
                n = 0 if shape[lay.dim] == 0 else n // shape[lay.dim] * lay.ranges[r][1]
            b += n * e
        held.append(b)
    return Shards(sched.plans[rank], tuple(costs), tuple(held), rank)
