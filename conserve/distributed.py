"""Scale out: the tracker on FSDP2, tensor-parallel and DDP parameters (torch.distributed).

``DistributedTracker`` is a ``conserve.Tracker`` whose parameters may be ``DTensor``s sharded on a
1-D device mesh (``Shard(d)`` for any ``d``: FSDP2 ``fully_shard`` uses ``Shard(0)``, tensor parallel
``ColwiseParallel`` ``Shard(0)`` and ``RowwiseParallel`` ``Shard(1)``), replicated (``Replicate()``,
plain tensors next to a TP plan, or every parameter of a DDP model). Every law is the sum of its terms
(``conserve.kernels.plan``), so each rank evaluates the terms on its own shard with the same kernels,
and the partial values of every pending step are summed by ONE packed all-reduce per flush:

* ``NormTerm`` / ``SumTerm``: a view whose rows are sharded keeps the local rows (other rows add 0
  here); a view whose columns are sharded gives partial row sums (the all-reduce adds them).
* ``GramTerm`` (``V V^T``, V: D x N): columns (N) sharded -> partial Grams that sum exactly. Rows (D)
  on one rank -> the whole Gram is computed there. Rows split over several ranks (a head that
  straddles a shard boundary) -> only those rows travel: one ``all_gather`` per flush brings them to
  the rank holding the first row, which evaluates the full term (``X_a X_b^T`` cross blocks included).
* A replicated parameter's terms are evaluated by one rank each (round robin), so nothing is counted
  twice. A model with no sharded parameter (DDP) needs no communication at all: every rank evaluates
  the full plan and holds the same values.

Collectives (same calls, same order on every rank, empty shards included): one ``all_gather_object``
at construction (shard offsets and a check that every rank tracks the same laws), one all-reduce for
``h_0`` and the guards, then per flush one ``all_gather`` (only if some Gram head straddles ranks)
and one all-reduce. Only rank 0 writes to the sinks. Bytes per flush: ``docs/distributed.md``.

Tracker state goes through ``torch.distributed.checkpoint`` (``state_dict`` has fixed shapes, so a
fresh tracker's ``state_dict()`` is the in-place target of ``dcp.load``).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import kernels
from .errors import UsageError
from .laws import Law
from .tracker import Tracker, Values, _abs_plan, decay_factor
from .tracking.drift import drift_factors

__all__ = ["DistributedTracker", "track", "wants_distributed", "flush_bytes"]

_FORMAT = "conserve.distributed/1"


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if _is_dtensor(t) else t).detach()


def wants_distributed(model: nn.Module | None = None, params: Mapping[str, torch.Tensor] | None = None) -> bool:
    """True when torch.distributed is initialised and the model is DDP-wrapped or has DTensor
    parameters (FSDP2, tensor parallel): then ``DistributedTracker`` is the tracker to use."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if model is not None and type(model).__name__ == "DistributedDataParallel":
        return True
    ps = params.values() if params is not None else (model.parameters() if model is not None else ())
    return any(_is_dtensor(p) for p in ps)


# ------------------------------------------------------------------------------------ localisation
@dataclass(frozen=True)
class _Layout:
    """How one tracked tensor is held: ``dim`` is the sharded dimension (None: replicated) and
    ``ranges[r] = (global offset, length)`` of rank r's shard along it."""

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()


def _local_view(v: kernels.View, lay: _Layout, r: int):
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
    """A Gram term whose D rows lie on several ranks: ``pieces[r] = local view`` (None if no rows)."""

    term: kernels.GramTerm
    pieces: list
    owner: int
    dtype: torch.dtype


def _localize(plan: kernels.Plan, layouts: Sequence[_Layout], rank: int, world: int, dtypes):
    """Split ``plan`` into this rank's local plan (terms rewritten for the local shards; summed over
    ranks they give the global plan) and the Gram terms that straddle ranks."""
    local = kernels.Plan([], [], [], plan.vec_size, dict(plan.gram_slots))
    straddles: list[_Straddle] = []
    counter = 0

    def owner_of_replicated():
        nonlocal counter
        counter += 1
        return (counter - 1) % world

    for t in plan.grams:
        lay = layouts[t.view.tensor]
        if lay.dim is None:
            if owner_of_replicated() == rank:
                local.grams.append(t)
            continue
        parts = [_local_view(t.view, lay, r) for r in range(world)]
        holders = [r for r, p in enumerate(parts) if p is not None]
        if lay.dim == t.view.row_dim and len(holders) > 1:
            straddles.append(_Straddle(t, [p[0] if p is not None else None for p in parts], holders[0],
                                       dtypes[t.view.tensor]))
        elif parts[rank] is not None:
            local.grams.append(replace(t, view=parts[rank][0]))
    for t in plan.norms:
        lay = layouts[t.view.tensor]
        if lay.dim is None:
            if owner_of_replicated() == rank:
                local.norms.append(t)
            continue
        p = _local_view(t.view, lay, rank)
        if p is not None:
            local.norms.append(replace(t, view=p[0], index=t.index + p[1] * t.index_stride))
    for t in plan.sums:
        lay = layouts[t.view.tensor]
        if lay.dim is None:
            if owner_of_replicated() == rank:
                local.sums.append(t)
            continue
        p = _local_view(t.view, lay, rank)
        if p is not None:
            local.sums.append(replace(t, view=p[0], index=t.index + p[2]))
    return local, straddles


# ------------------------------------------------------------------------------------------ packing
class _Packer:
    """Values <-> one flat vector: ``vec`` then the upper triangle (diagonal included) of every Gram."""

    def __init__(self, plan: kernels.Plan, device):
        self.vec_size = plan.vec_size
        self.grams = sorted(plan.gram_slots.items())
        self.tri = {d: torch.triu_indices(d, d, device=device) for d, _ in self.grams}
        self.size = self.vec_size + sum(n * d * (d + 1) // 2 for d, n in self.grams)

    def pack(self, v: Values, dtype) -> torch.Tensor:
        parts = [v.vec.to(dtype)]
        for d, _ in self.grams:
            i, j = self.tri[d]
            parts.append(v.grams[d][:, i, j].reshape(-1).to(dtype))
        return torch.cat(parts)

    def unpack(self, x: torch.Tensor, dtype) -> Values:
        x = x.to(dtype)
        vec, o, grams = x[: self.vec_size], self.vec_size, {}
        for d, n in self.grams:
            k = d * (d + 1) // 2
            u = x[o: o + n * k].view(n, k)
            o += n * k
            g = torch.zeros(n, d, d, dtype=dtype, device=x.device)
            i, j = self.tri[d]
            g[:, i, j] = u
            g[:, j, i] = u
            grams[d] = g
        return Values(vec, grams)


def flush_bytes(tracker: "DistributedTracker", steps: int | None = None) -> dict[str, int]:
    """Bytes each rank contributes per flush of ``steps`` steps (default ``tracker.every``):
    ``all_reduce`` = the packed partial values, ``all_gather`` = the straddling Gram rows (0 when
    every head lies on one rank). See docs/distributed.md for the formula."""
    k = tracker.every if steps is None else steps
    if not tracker._comm:
        return {"all_reduce": 0, "all_gather": 0}
    return {"all_reduce": k * tracker._step_elems * tracker._pack_dtype.itemsize,
            "all_gather": k * tracker._straddle_max * tracker._row_dtype.itemsize}


# ------------------------------------------------------------------------------------------ tracker
class _Pending:
    """One step's packed partial values (``drift``: the drift terms are in it), straddling rows, extras."""

    __slots__ = ("pack", "rows", "drift", "extras", "a")

    def __init__(self, pack, rows, drift, a=None):
        self.pack, self.rows, self.drift, self.extras, self.a = pack, rows, drift, {}, a


class DistributedTracker(Tracker):
    """``conserve.Tracker`` for parameters sharded or replicated by torch.distributed.

    Same arguments and metrics as ``Tracker`` (``model`` may be FSDP2-sharded, tensor-parallel or
    DDP-wrapped; parameter names are those of the unwrapped model, shapes the global ones), plus:

    Args:
        max_pending_bytes: cap on the memory of partial values kept between flushes (per rank); when
            ``every`` steps would exceed it, the partials are all-reduced every
            ``max_pending_bytes // step_bytes`` steps instead (still one packed all-reduce each time).

    Requirements: ``torch.distributed`` initialised; DTensor parameters on a 1-D mesh spanning all
    ranks in rank order, placement ``Shard(d)`` or ``Replicate()``; plain tensors are taken to be
    identical on every rank (DDP, or the replicated parameters of a tensor-parallel model).
    Raises ``UsageError`` otherwise, and when ranks build different law sets.

    Collective methods (call them on every rank, in the same order): the constructor, ``after_step``
    (when a flush is due), ``flush``, ``close``, ``values``, ``totals``, ``state_dict``. Between
    flushes, ``h``, ``last`` and ``cumulative`` describe the last flushed step; ``values()`` brings
    them up to date. Sinks are written on rank 0 only (sinks given on other ranks are closed by
    ``close`` without being written). ``record(**scalars)`` writes rank 0's scalars.
    """

    def __init__(self, model: nn.Module | None = None, laws: Sequence[Law] | None = None, *, every: int = 50,
                 sinks: Iterable = (), drift: bool = True, fp64: bool = False, backend: str = "auto",
                 monitors: Iterable = (), params: Mapping[str, torch.Tensor] | None = None,
                 max_pending_bytes: int = 256 << 20):
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("DistributedTracker needs torch.distributed: call torch.distributed.init_process_group() "
                             "first (torchrun sets its environment), or use conserve.Tracker in a single process")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._max_pending_bytes = max_pending_bytes
        super().__init__(model, laws, every=every, sinks=sinks, drift=drift, fp64=fp64, backend=backend,
                         monitors=monitors, params=params)

    def _local_tensors(self, params):
        return [_local(p) for p in params]

    def _setup(self) -> None:
        """Shard layouts, the local plan, straddling Gram rows and the packed all-reduce buffers."""
        drift, fp64, every, max_pending_bytes = self.drift, self.fp64, self.every, self._max_pending_bytes
        # sinks are written on rank 0 only; the others keep theirs to close them
        self._idle_sinks = self.sinks if self.rank != 0 else []
        if self.rank != 0:
            self.sinks = []
        local = self.tensors
        self._layouts = self._gather_layouts()
        self._comm = self.world > 1 and any(l.dim is not None for l in self._layouts)
        dtypes = [t.dtype for t in local]
        if self._comm:
            self._local_plan, self._straddles = _localize(self.compiled.plan, self._layouts, self.rank, self.world,
                                                          dtypes)
        else:
            self._local_plan, self._straddles = self.compiled.plan, []
        self._abs_local = _abs_plan(self._local_plan)
        self._mine = [s for s in self._straddles if s.owner == self.rank]
        # the straddling terms this rank evaluates, each over its gathered (D, N) rows (tensor j)
        self._mini = kernels.Plan([replace(s.term, view=kernels.View(j, (0, 0), 0, s.term.view.rows, 1, s.term.view.cols))
                                   for j, s in enumerate(self._mine)], [], [], self.compiled.plan.vec_size,
                                  dict(self.compiled.plan.gram_slots))
        self._row_dtype = (torch.float64 if any(s.dtype == torch.float64 for s in self._straddles) else torch.float32)
        # per rank: element count of its straddle rows (current weights; x2 with drift: + a*theta_k)
        blocks = 2 if drift else 1
        self._straddle_count = [sum(p.rows * p.cols for s in self._straddles if (p := s.pieces[r]) is not None)
                                for r in range(self.world)]
        self._straddle_max = max(self._straddle_count, default=0) * blocks
        self._packer = _Packer(self.compiled.plan, self.device)
        self._pack_dtype = torch.float64 if fp64 else torch.float32
        # NCCL only moves CUDA tensors: parameters kept on the CPU (FSDP2 offload) reduce through the GPU
        nccl = self._comm and dist.get_backend() == "nccl"
        self._comm_device = torch.device("cuda", torch.cuda.current_device()) if nccl else self.device
        self._step_elems = self._packer.size * (4 if drift else 1)
        step_bytes = self._step_elems * self._pack_dtype.itemsize
        self._reduce_every = max(1, min(every, max_pending_bytes // step_bytes))
        self._pend: list[_Pending] = []

    # ---------------------------------------------------------------------------------- layout
    def _gather_layouts(self) -> list[_Layout]:
        mine, errors = [], []
        for name, p in zip(self.compiled.names, self.params):
            if not _is_dtensor(p):
                mine.append(None)
                continue
            mesh, pl = p.device_mesh, p.placements
            if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != list(range(self.world)):
                errors.append(f"{name}: DTensor on mesh {mesh.mesh.tolist()}; conserve supports a 1-D mesh over all "
                              f"{self.world} ranks in order (track the laws of one mesh dimension's model)")
                mine.append(None)
                continue
            kind = type(pl[0]).__name__
            if kind == "Replicate":
                mine.append(None)
            elif kind == "Shard":
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                d = pl[0].dim % p.ndim
                shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, pl)
                if tuple(shape) != tuple(p.to_local().shape):
                    errors.append(f"{name}: local shard shape {tuple(p.to_local().shape)} != {tuple(shape)}")
                mine.append((d, int(offset[d]), int(shape[d])))
            else:
                errors.append(f"{name}: placement {pl[0]} is not supported (use Shard(d) or Replicate())")
                mine.append(None)
        sig = (tuple(self.compiled.names), tuple(l.name for l in self.laws))
        allv = [None] * self.world
        dist.all_gather_object(allv, (sig, mine, errors))
        errs = [f"rank {r}: {e}" for r, (_, _, es) in enumerate(allv) for e in es]
        if any(s != allv[0][0] for s, _, _ in allv):
            errs.append("ranks track different laws or parameters: build the model and the tracker identically "
                        "on every rank")
        if errs:
            raise UsageError("; ".join(errs[:3]))
        out = []
        for i in range(len(self.params)):
            per = [allv[r][1][i] for r in range(self.world)]
            if per[0] is None:
                out.append(_Layout(None))
            else:
                out.append(_Layout(per[0][0], tuple((o, n) for _, o, n in per)))
        return out

    # -------------------------------------------------------------------------------- evaluation
    def _evaluate(self, plan, tensors) -> Values:
        if not (plan.grams or plan.norms or plan.sums):
            dtype = torch.float64 if self.fp64 else torch.float32
            return Values(torch.zeros(plan.vec_size, dtype=dtype, device=self.device),
                          {d: torch.zeros(n, d, d, dtype=dtype, device=self.device)
                           for d, n in sorted(plan.gram_slots.items())})
        return Values(*kernels.evaluate(plan, tensors, fp64=self.fp64, backend=self.backend))

    def _bilinear(self, plan, xs, ys) -> Values:
        if not (plan.grams or plan.norms or plan.sums):
            return self._evaluate(plan, xs)
        return Values(*kernels.bilinear(plan, xs, ys, fp64=self.fp64, backend=self.backend))

    def _step_values(self, plan, cur, prev, lin):
        """(h1, h_a, first, second) of ``plan`` as in ``Tracker.after_step`` (decay = h_a - h_k later)."""
        h1 = self._evaluate(plan, cur)
        if prev is None:
            return [h1]
        delta = [t - p for t, p in zip(cur, prev)]
        h_a = self._evaluate(plan, prev)
        b = self._bilinear(plan, prev, delta)
        hd = self._evaluate(plan, delta)
        lin = lin.to(hd.vec.dtype)
        return [h1, h_a, Values(2 * b.vec + lin * hd.vec, {d: 2 * g for d, g in b.grams.items()}),
                Values((1 - lin) * hd.vec, hd.grams)]

    def _straddle_rows(self, tensors) -> torch.Tensor:
        return torch.cat([s.pieces[self.rank].of(tensors[s.term.view.tensor]).reshape(-1).to(self._row_dtype)
                          for s in self._straddles if s.pieces[self.rank] is not None]
                         or [torch.zeros(0, dtype=self._row_dtype, device=self.device)])

    def _gather_straddles(self, rows: torch.Tensor, blocks: int) -> list[list[list[torch.Tensor]]]:
        """All-gather the straddling rows of k steps (``rows``: (k, blocks * my count)). Returns, for
        each step and block, the full ``(D, N)`` view of every straddle term this rank owns."""
        k, m = rows.shape[0], max(self._straddle_count) * blocks
        buf = torch.zeros(k, m, dtype=self._row_dtype, device=self._comm_device)
        buf[:, : rows.shape[1]] = rows
        got = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(got, buf)
        got = [g.to(self.device) for g in got]
        out = [[[] for _ in range(blocks)] for _ in range(k)]
        starts = [0] * self.world
        for s in self._straddles:
            chunks = []
            for r, p in enumerate(s.pieces):
                if p is None:
                    continue
                n = p.rows * p.cols
                chunks.append((r, starts[r], n, p))
                starts[r] += n
            if s.owner != self.rank:
                continue
            for i in range(k):
                for b in range(blocks):
                    v = torch.cat([got[r][i, b * self._straddle_count[r] + o: b * self._straddle_count[r] + o + n]
                                   .view(p.rows, p.cols) for r, o, n, p in chunks])
                    out[i][b].append(v.to(s.dtype))
        return out

    @torch.no_grad()
    def _initial_values(self):
        """``h(theta_0)`` and the magnitude plan (guard denominators), summed over ranks."""
        h0 = self._evaluate(self._local_plan, self.tensors)
        mag = self._evaluate(self._abs_local, self.tensors)
        if not self._comm:
            return h0, mag
        if self._straddles:
            full = self._gather_straddles(self._straddle_rows(self.tensors)[None], 1)[0][0]
            if self._mine:
                h0 = h0.map(torch.add, self._evaluate(self._mini, full))
                mag = mag.map(torch.add, self._evaluate(_abs_plan(self._mini), full))
        x = torch.stack([self._packer.pack(h0, self._pack_dtype), self._packer.pack(mag, self._pack_dtype)])
        x = x.to(self._comm_device)
        dist.all_reduce(x)
        x = x.to(self.device)
        dtype = h0.vec.dtype
        return self._packer.unpack(x[0], dtype), self._packer.unpack(x[1], dtype)

    # ------------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Snapshot this rank's shard of ``theta_k`` and each parameter's decay factor ``a``."""
        if not self.drift:
            return
        local = [_local(p) for p in self.params]
        if self._prev is None or any(p.shape != t.shape for p, t in zip(self._prev, local)):
            self._prev = [t.clone() for t in local]
        else:
            for p, t in zip(self._prev, local):
                p.copy_(t)
        if optimizer is not None:
            group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
            self._a = [decay_factor(optimizer, group_of[id(t)]) if id(t) in group_of else 1.0 for t in self.params]
            self._a = [float(a) for a in self._a]  # the true factors (kept for the drift assembly)

    @torch.no_grad()
    def after_step(self) -> None:
        """Evaluate this rank's partial law values at ``theta_{k+1}`` (and the drift terms when
        ``before_step`` ran). Collective only when the pending steps are due for reduction."""
        if len(self._pend) >= self._reduce_every:
            self._sync()
            if len(self._rows) >= self.every:
                Tracker.flush(self)
        cur = [_local(p) for p in self.params]
        self.tensors = cur
        prev = None
        raw_rows = None  # straddling rows of theta_k before a is applied (exact in their dtype; the owner scales)
        if self.drift and self._prev is not None and self._straddles and self._comm:
            raw_rows = self._straddle_rows(self._prev)
        if self.drift and self._prev is not None:
            # a*theta_k formed in the accumulation dtype (fp64: no fp32 rounding of a*theta, as kernels.drift)
            # a rounded to fp32 as the kernels do (the assembly turns the terms into the true a's)
            prev = [p if isinstance(a, float) and a == 1.0 else (p.double() if self.fp64 else p).mul_(a)
                    for p, a in zip(self._prev, drift_factors(self._a, len(self._a)))]
        vals = self._step_values(self._local_plan, cur, prev, self._lin)
        if not self._comm:
            self._replay(vals, None, list(self._a))
            return
        pack = torch.cat([self._packer.pack(v, self._pack_dtype) for v in vals])
        if pack.numel() < self._step_elems:  # no drift terms this step: keep the packed layout fixed
            pack = torch.cat([pack, pack.new_zeros(self._step_elems - pack.numel())])
        rows = None
        if self._straddles:
            rows = self._straddle_rows(cur)
            if self.drift:
                rows = torch.cat([rows, raw_rows if raw_rows is not None else torch.zeros_like(rows)])
        self._pend.append(_Pending(pack, rows, len(vals) == 4, list(self._a)))
        for m in self.monitors:  # they sample the training state: at every step, not when the step is booked
            m.update()

    def _replay(self, vals: Sequence[Values], extras: Mapping | None = None, a=None) -> None:
        terms = None
        if len(vals) == 4:
            h1, h_a, first, second = vals
            kernel = h_a.map(torch.sub, self.h)
            if a is not None:  # (a^2 - 1) h_k from the stored values (conserve.tracking.drift): no cancellation
                h = (self.h.vec, self.h.grams)
                kernel = Values(*self.assembly.decay(h, a, (kernel.vec, kernel.grams)))
                f, s = self.assembly.correct(h, (first.vec, first.grams), (second.vec, second.grams), a)
                first, second = Values(*f), Values(*s)
            terms = {"decay": kernel, "first": first, "second": second}
        Tracker.record_step(self, vals[0], terms)
        if extras:
            Tracker.record(self, **extras)

    def _sync(self) -> None:
        """Reduce the pending steps (one all_gather if heads straddle ranks, one all-reduce) and book
        them in order. Collective; a no-op on every rank when nothing is pending."""
        if not self._pend:
            return
        pend, self._pend = self._pend, []
        packs = torch.stack([p.pack for p in pend])
        if self._straddles:
            blocks = 2 if self.drift else 1
            full = self._gather_straddles(torch.stack([p.rows for p in pend]), blocks)
            if self._mine:
                for i, step in enumerate(full):
                    prev = None
                    if pend[i].drift:  # a*theta_k of the owned straddle terms, in the accumulation dtype
                        dt = torch.float64 if self.fp64 else torch.float32
                        a = pend[i].a or [1.0] * len(self.params)
                        af = drift_factors(a, len(a))
                        prev = [x.to(dt) * af[st.term.view.tensor] for x, st in zip(step[1], self._mine)]
                    vals = self._step_values(self._mini, step[0], prev, self._lin)
                    add = torch.cat([self._packer.pack(v, self._pack_dtype) for v in vals])
                    packs[i, : add.numel()] += add
        packs = packs.to(self._comm_device)
        dist.all_reduce(packs)
        packs = packs.to(self.device)
        dtype = self.h0.vec.dtype
        n = self._packer.size
        monitors, self.monitors = self.monitors, []  # updated in after_step already
        try:
            for i, p in enumerate(pend):
                vals = [self._packer.unpack(packs[i, j * n:(j + 1) * n], dtype) for j in range(4 if p.drift else 1)]
                self._replay(vals, p.extras, p.a)
        finally:
            self.monitors = monitors

    def record_step(self, h1: Values, terms: Mapping[str, Values] | None = None) -> None:
        """Book one step from values a fused optimizer computed (full, not partial values: they are
        booked as given, on every rank). Pending partial steps are reduced first."""
        self._sync()
        super().record_step(h1, terms)

    def record(self, **scalars) -> None:
        """Attach scalars to the current step's row (rank 0's values are the ones written)."""
        if self._pend:
            self._pend[-1].extras.update(scalars)
        else:
            super().record(**scalars)

    # ------------------------------------------------------------------------------------ output
    def flush(self) -> list[dict]:
        """Reduce the pending steps and write their rows (rank 0). Collective."""
        self._sync()
        return super().flush()

    def close(self) -> None:
        """Flush (collective) and close the sinks (also those given on ranks other than 0)."""
        super().close()
        for s in self._idle_sinks:
            s.close()

    def values(self) -> dict[str, torch.Tensor]:
        """Current full ``h(theta_k)`` per law name, the same on every rank. Collective."""
        self._sync()
        return super().values()

    def totals(self):
        """``Tracker.totals`` after reducing the pending steps. Collective."""
        self._sync()
        return super().totals()

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Tracker state for ``torch.distributed.checkpoint`` (fixed shapes; the same on every rank,
        so DCP writes it once). Collective (reduces the pending steps first).

        Example::

            dcp.save({"model": model.state_dict(), "conserve": tracker.state_dict()}, checkpoint_id=path)
            state = {"model": model.state_dict(), "conserve": tracker.state_dict()}
            dcp.load(state, checkpoint_id=path); tracker.load_state_dict(state["conserve"])
        """
        self._sync()
        s = super().state_dict()
        rows = s.pop("pending")
        n = 0 if rows is None else rows.shape[0]
        if n > self.every:  # pragma: no cover - record_step flushes before exceeding every
            raise RuntimeError(f"{n} pending rows exceed every={self.every}")
        buf = torch.zeros(self.every, len(self.metric_names), dtype=torch.float32, device=self.device)
        if n:
            buf[:n] = rows
        extras = [[{k: (float(v) if torch.is_tensor(v) else v) for k, v in e.items()} for e in s.pop("pending_extras")]]
        if self.world > 1:  # rank 0's scalars are the ones written; DCP keeps one copy of the (replicated) state
            dist.broadcast_object_list(extras, src=0)
        extras = extras[0]
        meta = {"format": _FORMAT, "step": s.pop("step"), "laws": s.pop("laws"), "pending_count": n,
                "pending_extras": extras, "monitors": s.pop("monitors")}
        return {**s, "pending": buf, "meta": pickle.dumps(meta)}

    def load_state_dict(self, state: Mapping) -> None:
        """Load a state from ``state_dict`` (after ``dcp.load``) or from a single-process ``Tracker``."""
        state = dict(state)
        if "meta" in state:
            meta = pickle.loads(state.pop("meta"))
            if meta.get("format") != _FORMAT:
                raise UsageError(f"unknown tracker state format {meta.get('format')!r}; save it with this version")
            n = meta["pending_count"]
            state.update(step=meta["step"], laws=meta["laws"], pending_extras=meta["pending_extras"],
                         monitors=meta["monitors"], pending=state["pending"][:n] if n else None)
        self._pend = []
        super().load_state_dict(state)


def track(optimizer: torch.optim.Optimizer, model=None, laws=None, **tracker_kwargs):
    """``conserve.track`` for FSDP2 / tensor-parallel / DDP models: a ``TrackedOptimizer`` driving a
    ``DistributedTracker`` (keyword arguments as ``DistributedTracker``). Call on every rank."""
    from .optim.wrapper import TrackedOptimizer

    if model is None and laws is None:
        raise ValueError("track() needs the model (or explicit laws) to know which laws to evaluate")
    return TrackedOptimizer(optimizer, DistributedTracker(model, laws, **tracker_kwargs))
