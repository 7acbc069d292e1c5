"""Scale out: the tracker on FSDP2, tensor-parallel and DDP parameters (torch.distributed).

``DistributedTracker`` is a ``conserve.Tracker`` whose parameters may be ``DTensor``s sharded on a
1-D device mesh (``Shard(d)`` for any ``d``: FSDP2 ``fully_shard`` uses ``Shard(0)``, tensor parallel
``ColwiseParallel`` ``Shard(0)`` and ``RowwiseParallel`` ``Shard(1)``), replicated (``Replicate()``,
plain tensors next to a TP plan, or every parameter of a DDP model). Every law is the sum of its terms
(``conserve.kernels.plan``), so each rank evaluates the terms on its own shard with the same kernels:

* ``NormTerm`` / ``SumTerm``: a view whose rows are sharded keeps the local rows (other rows add 0
  here); a view whose columns are sharded gives partial row sums.
* ``GramTerm`` (``V V^T``, V: D x N): columns (N) sharded -> partial Grams that sum exactly. Rows (D)
  on one rank -> the whole Gram is computed there. Rows split over several ranks (a head that
  straddles a shard boundary) -> the term has ONE owner rank (a holder of some of its rows, chosen
  so that the bytes each rank receives are balanced: round robin for equal terms); the other holders
  send their rows to the owner only (point to point), which evaluates the full term (cross blocks
  ``X_a X_b^T`` included). No rank receives rows it does not use.
* A replicated parameter's terms are evaluated by one rank each (round robin), so nothing is counted
  twice. A model with no sharded parameter (DDP) needs no communication at all: every rank evaluates
  the full plan and holds the same values.

Per step nothing is communicated. Each law-value entry is either *complete* on one rank (every term
touching it is evaluated there: e.g. a SwiGLU unit whose ``up_proj`` row and ``down_proj`` column lie on
the same rank) or *split* (several ranks contribute partial sums; every straddling Gram is split).
For its complete entries a rank computes the step's contribution to the metric row itself (sum of
the instances' ``eps``, sums of squares of the drift terms: both additive over ranks); for the split
entries it keeps the partial values (the sum over ranks is linear). Both stay on the device and are
summed, for every pending step at once, by ONE packed ``all_reduce`` at the flush; the straddling
rows of the pending steps go to their owners just before it (one ``isend``/``irecv`` per peer that
holds rows of a term the receiver owns). ``max_pending_bytes`` bounds what is kept between flushes.
Where each term runs: ``conserve.tracking.shard_plan``. Bytes per flush: ``flush_bytes`` and
docs/distributed.md (``python -m bench.dist_bytes``).

Drift steps: a budgeted ``Sampler`` over the global plan (``Shards``: a copy cost per rank), so each
rank copies only its pieces of the views of the step's group, at most ``snapshot_budget`` x its own
bytes, and every rank decomposes the same entries (the groups follow from the layouts; no collective).

Collectives (same calls, same order on every rank, empty shards included): one ``all_gather_object``
at construction (shard offsets and a check that every rank tracks the same laws), one all-reduce for
``h_0`` and the guards, then per flush the owner-only row exchange (only if some Gram head straddles
ranks) and one all-reduce. Only rank 0 writes to the sinks.

Tracker state goes through ``torch.distributed.checkpoint`` (``state_dict`` has fixed shapes, so a
fresh tracker's ``state_dict()`` is the in-place target of ``dcp.load``).
"""
from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels
from ..errors import UsageError
from ..laws import Law
from ..tracker import Tracker, decay_factors, eager, record_value, stepped_factors
from .book import residual
from .values import CUMULATIVE, TERMS, Deferred, NotKept, Values, abs_plan
from .shard_plan import EntrySet, ShardLayout, comm_schedule, sampler_shards
from .drift import Mask, Sampler, drift_pieces

__all__ = ["DistributedTracker", "wants_distributed", "flush_bytes"]

_FORMAT = "conserve.distributed/2"


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


def flush_bytes(tracker: "DistributedTracker", steps: int | None = None) -> dict[str, int]:
    """Bytes this rank moves per flush of ``steps`` steps (default ``tracker.every``): ``all_reduce``
    = the packed pending partials it contributes (one call), ``rows_received`` / ``rows_sent`` = the
    straddling Gram rows it receives as owner / sends to owners (0 when every head lies on one rank).
    Counts at drift on every step with every straddling term decomposed (the most: with a snapshot
    budget only the terms of the step's group send their ``theta_k`` rows). See docs/distributed.md."""
    k = tracker.every if steps is None else steps
    if not tracker._comm:
        return {"all_reduce": 0, "rows_received": 0, "rows_sent": 0}
    recv, sent = tracker._schedule.row_traffic(tracker.drift)
    isz = tracker._xdtype.itemsize
    return {"all_reduce": k * tracker._step_elems * tracker._pack_dtype.itemsize,
            "rows_received": k * recv[tracker.rank] * isz, "rows_sent": k * sent[tracker.rank] * isz}


# ------------------------------------------------------------------------------------------ tracker
class _Pending:
    """One step not yet reduced: ``pack`` = [metric-row partials of this rank's complete entries |
    partial values of the split entries: h(new), then first, second (and the kernel's decay)], ``drift``
    (the drift terms are in it), ``held`` (this rank's straddling rows until the exchange), ``a`` (decay
    factors), ``group`` (the drift step's index for ``Sampler.mask``; None without drift terms), ``sel``
    (the straddling terms whose ``theta_k`` rows travel: those of the step's group), extras."""

    __slots__ = ("pack", "drift", "held", "a", "kdecay", "group", "sel", "extras", "grad")

    def __init__(self, pack, drift, held, a, kdecay, group=None, sel=frozenset(), grad=None):
        self.pack, self.drift, self.held, self.a, self.kdecay, self.extras = pack, drift, held, a, kdecay, {}
        self.group, self.sel, self.grad = group, sel, grad


class DistributedTracker(Tracker):
    """``conserve.Tracker`` for parameters sharded or replicated by torch.distributed.

    Same arguments and metrics as ``Tracker`` (``model`` may be FSDP2-sharded, tensor-parallel or
    DDP-wrapped; parameter names are those of the unwrapped model, shapes the global ones), plus:

    Args:
        max_pending_bytes: cap on the memory kept between flushes per rank (pending partials and
            straddling rows); when ``every`` steps would exceed it, the partials are reduced every
            ``max_pending_bytes // step_bytes`` steps instead (one packed all-reduce each time) and the
            rows sent to their owners as often as the cap requires.

    Drift: ``drift_every`` and ``snapshot_budget`` as in ``Tracker``. With sharded parameters the
    sampler (``sampler``: ``conserve.tracking.drift.Sampler`` over the GLOBAL plan with ``Shards``) cuts
    the law entries into units and packs them into groups whose copies fit ``snapshot_budget`` x the
    bytes EACH rank holds (a unit bigger than that on some rank is a group of its own). Every rank
    builds the same groups from the shard layouts (no collective); on drift step ``j`` each rank copies,
    right before the step, only its pieces of the views of group ``j mod len(groups)`` (and its rows
    of the group's straddling Gram terms, which travel to their owners with the flush's rows) and drops
    them after the step: no weight copy is held between drift steps. The drift columns and
    ``totals()`` cover the decomposed (entry, step) pairs exactly as ``Tracker``'s (NaN columns for a
    family without a decomposed entry; ``sampled_steps``), but the groups are packed per rank, so they
    are not the single-process tracker's groups. ``snapshot_budget=None``: every law on every drift
    step, each rank copying its whole shards (1/W of the tracked bytes for W ranks) while the step
    runs. The decay is ``(a^2 - 1) h_k`` from the stored values (``conserve.tracking.drift.Assembly``,
    the one assembly every path uses). Held between steps besides the law-sized values: the pending
    steps' packs and, for Gram heads that straddle ranks, their rows until the flush (both bounded by
    ``max_pending_bytes``; a placement without straddles holds no rows, docs/distributed.md).

    Requirements: ``torch.distributed`` initialised; DTensor parameters on a 1-D mesh spanning all
    ranks in rank order, placement ``Shard(d)`` or ``Replicate()``; plain tensors are taken to be
    identical on every rank (DDP, or the replicated parameters of a tensor-parallel model).
    Raises ``UsageError`` otherwise, and when ranks build different law sets.

    Collective methods (call them on every rank, in the same order): the constructor, ``after_step``
    (when a reduction is due), ``flush``, ``close``, ``values``, ``totals``, ``state_dict``. Between
    flushes ``h`` and ``cumulative`` describe the last ``values()``/``totals()``/``state_dict()``
    call, and with sharded parameters ``last`` stays empty (the per-step terms are only reduced into
    the metric rows). Sinks are written on rank 0 only (sinks given on other ranks are closed by
    ``close`` without being written). ``record(**scalars)`` writes rank 0's scalars.
    ``comm_bytes`` counts the bytes this rank has moved (``all_reduce``, ``rows_sent``, ``rows_received``).
    """

    def __init__(self, model: nn.Module | None = None, laws: Sequence[Law] | None = None, *,
                 max_pending_bytes: int = 256 << 20, **tracker_kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("DistributedTracker needs torch.distributed: call torch.distributed.init_process_group() "
                             "first (torchrun sets its environment), or use conserve.Tracker in a single process")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._max_pending_bytes = max_pending_bytes
        self.comm_bytes = {"all_reduce": 0, "rows_sent": 0, "rows_received": 0}
        super().__init__(model, laws, **tracker_kwargs)
        if self._comm:
            self._adopt()

    def _local_tensors(self, params):
        # plain tensors as themselves (Tracker.before_step finds their decay factor by identity)
        return [_local(p) if _is_dtensor(p) else p for p in params]

    def _setup(self) -> None:
        """Shard layouts, the local plan, straddling Gram rows, split entries and the pending buffers."""
        # sinks are written on rank 0 only; the others keep theirs to close them
        self._idle_sinks = self.sinks if self.rank != 0 else []
        if self.rank != 0:
            self.sinks = []
        self._pend: list[_Pending] = []
        self._layouts = self._gather_layouts()
        self._comm = self.world > 1 and any(l.dim is not None for l in self._layouts)
        if not self._comm:
            return
        dev = self.device
        sched = self._schedule = comm_schedule(self.compiled, self._layouts, [t.dtype for t in self.tensors])
        self._local_plan, self._straddles = sched.plans[self.rank], sched.straddles
        self._mine = [(j, s) for j, s in enumerate(self._straddles) if s.owner == self.rank]
        self._shards = sampler_shards(sched, [tuple(p.shape) for p in self.params],
                                      [t.element_size() for t in self.tensors], self._layouts, self.rank)
        # the straddling terms this rank owns, each over its assembled (D, N) rows (tensor j of the list)
        self._mini = kernels.Plan([replace(s.term, view=kernels.View(j, (0, 0), 0, s.term.view.rows, 1, s.term.view.cols))
                                   for j, (_, s) in enumerate(self._mine)], [], [], self.compiled.plan.vec_size,
                                  dict(self.compiled.plan.gram_slots))
        self._xdtype = torch.float32
        for s in self._straddles:  # rows travel in one dtype per message (an upcast is exact)
            self._xdtype = torch.promote_types(self._xdtype, s.dtype)
        vo, go = sched.vec_owner.to(dev), {d: o.to(dev) for d, o in sched.gram_owner.items()}
        self._own = (vo == self.rank, {d: (o == self.rank)[:, None, None] for d, o in go.items()})
        self._split = EntrySet(torch.nonzero(vo < 0).flatten(), {d: torch.nonzero(o < 0).flatten() for d, o in go.items()}, dev)
        self._all = EntrySet(torch.arange(self.compiled.plan.vec_size, device="cpu"), {d: torch.arange(n, device="cpu") for d, n in
                                                                        self.compiled.plan.gram_slots.items()}, dev)
        # per split scalar: its instance, family and weight in a sum of squares over the full D x D matrix
        grams = self.compiled.plan.gram_slots
        self._split_inst = self._split.take(Values(self.layout.vec_inst, {d: self.layout.gram_inst[d][:, None, None].expand(n, d, d)
                                                                    for d, n in grams.items()}))
        self._split_fam = self._split.take(Values(self.layout.vec_fam, {d: self.layout.gram_fam[d][:, None, None].expand(n, d, d)
                                                                  for d, n in grams.items()}))
        vdt = torch.float64 if self.fp64 else torch.float32
        self._split_w = self._split.take(Values(torch.ones(self.compiled.plan.vec_size, dtype=vdt, device=dev),
                                                {d: (2 - torch.eye(d, dtype=vdt, device=dev)).expand(n, d, d)
                                                 for d, n in grams.items()}))
        self._pack_dtype = vdt
        nf, ng = len(self.families), len(self.groups)
        self._row_size = nf + ng + (len(TERMS) * nf if self.drift else 0)
        self._step_elems = sched.step_scalars(self.drift)
        step_bytes = self._step_elems * self._pack_dtype.itemsize
        recv, sent = sched.row_traffic(self.drift)
        row_bytes = max((a + b for a, b in zip(recv, sent)), default=0) * self._xdtype.itemsize  # the same on every rank
        cap = self._max_pending_bytes
        self._reduce_every = max(1, min(self.every, cap // max(1, step_bytes)))  # at most (drift at every step)
        self._exchange_every = max(1, min(self._reduce_every, cap // max(1, row_bytes)))
        # NCCL only moves CUDA tensors: parameters kept on the CPU (FSDP2 offload) reduce through the GPU
        nccl = dist.get_backend() == "nccl"
        self._comm_device = torch.device("cuda", torch.cuda.current_device()) if nccl else dev

    @property
    def sampler(self) -> Sampler:
        """Which laws each drift step decomposes: with sharded parameters a ``Sampler`` over the GLOBAL
        plan whose groups every rank builds alike from the shard layouts (``Shards``: at most
        ``snapshot_budget`` x the bytes each rank holds copied per rank, this rank's terms in the
        groups' sub-plans); else ``Tracker.sampler``."""
        if not self.__dict__.get("_comm"):
            return Tracker.sampler.fget(self)
        if self._sampler is None:
            self._sampler = Sampler(self.compiled.plan, self.tensors, self.snapshot_budget, self.device,
                                    shards=self._shards)
        return self._sampler

    def _adopt(self) -> None:
        """Per-rank state from the full ``h``/``cumulative`` (after construction or a load): this rank's
        partial ``h`` (its complete entries are exact) and the full values of the split entries. ``_hp`` holds the
        full ``h`` until the next step (``_hp_full``): that step's drift terms take this rank's share of ``h_k`` from
        its shards of ``theta_k`` instead (the assembly corrects first/second for a decay factor that is not an fp32
        number with ``h_k``, linearly: a split entry's full value would be counted once per rank)."""
        self._hp = self.h.clone()
        self._hp_full = True
        self._h_split, self._h0_split = self._split.take(self.h), self._split.take(self.h0)
        kept = self.cumulative if self.keep_cumulative else {}  # (none held without cumulative)
        self._cum_p = {k: v.clone() for k, v in kept.items()}
        self._cum_split = {k: self._split.take(v) for k, v in kept.items()}
        self.last = {} if self.keep_last else NotKept()

    # ---------------------------------------------------------------------------------- layout
    def _gather_layouts(self) -> list[ShardLayout]:
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
                out.append(ShardLayout(None))
            else:
                out.append(ShardLayout(per[0][0], tuple((o, n) for _, o, n in per)))
        return out

    # -------------------------------------------------------------------------------- evaluation
    def _zeros(self) -> Values:
        plan, dtype = self.compiled.plan, (torch.float64 if self.fp64 else torch.float32)
        return Values(torch.zeros(plan.vec_size, dtype=dtype, device=self.device),
                      {d: torch.zeros(n, d, d, dtype=dtype, device=self.device) for d, n in sorted(plan.gram_slots.items())})

    def _values(self, plan, tensors) -> Values:
        if not (plan.grams or plan.norms or plan.sums):
            return self._zeros()
        return Values(*kernels.evaluate(plan, tensors, fp64=self.fp64, backend=self.backend))

    def _drift_terms(self, plan, olds, news, a_plan, a, h_old, mask: Mask, *, donate: bool = False):
        """``(terms, kernel decay)`` of ``plan`` (partial sums of this rank's terms) over ``olds`` (theta_k,
        before the decay; tensors the plan does not read may be None) and ``news``: one DRIFT pass
        (``conserve.tracking.drift.drift_pieces``; ``donate``: ``olds`` are copies made for this step).
        ``a_plan``: decay factor per tensor of ``plan``; ``a``: per tracked tensor; ``mask``: the entries
        the step decomposes (the terms are 0 elsewhere). ``terms`` come from the drift assembly
        (``Tracker.assembly``) with ``h_old`` as the stored ``h_k``: exact on this rank's complete
        entries. A split entry's decay is ``(a^2 - 1) h_k`` of the REDUCED ``h_k``, formed at the flush;
        what the kernel adds to it (entries whose tensors have different ``a``) is the second result
        (None when no decomposed entry needs it)."""
        asm = self.assembly
        need = asm.needs_kernel_decay(a, mask)
        if plan.grams or plan.norms or plan.sums:
            pieces = drift_pieces(plan, olds, news, a_plan, fp64=self.fp64, backend=self.backend, decay=need,
                                  donate=donate, values=False)
            if donate:  # the copies (now Delta) are read: freed before the terms are formed
                olds.clear()
            pieces = [None, *pieces[1:]]  # a list: the assembly empties it once read
        else:
            z = self._zeros()
            pieces = [None, (z.vec, z.grams) if need else None, (z.vec, z.grams), (z.vec, z.grams)]
        kern = pieces[1]
        terms = {k: Values(*v) for k, v in asm.terms((h_old.vec, h_old.grams), pieces, a, mask).items()}
        kdec = None
        if need:
            z = self._zeros()
            kdec = Values(*asm.decay((z.vec, z.grams), a, kern, mask))
        return terms, kdec

    def _split_blocks(self, h1, terms, kdec) -> list:
        """The split entries' blocks of one step's pack: h(new), then first, second (and the kernel decay)."""
        out = [self._split.take(h1)]
        if terms is not None:
            out += [self._split.take(terms["first"]), self._split.take(terms["second"])]
            if kdec is not None:
                out.append(self._split.take(kdec))
        return [x.to(self._pack_dtype) for x in out]

    @torch.no_grad()
    def _initial_values(self):
        """``h(theta_0)`` and the magnitude plan (guard denominators), summed over ranks."""
        if not self._comm:
            plan = self.compiled.plan
            return self._values(plan, self.tensors), self._values(abs_plan(plan), self.tensors)
        h0 = self._values(self._local_plan, self.tensors)
        mag = self._values(abs_plan(self._local_plan), self.tensors)
        if self._straddles:
            full = self._exchange([self._held(self.tensors, {})], [frozenset()])[0]
            if self._mine:
                news = [f[0] for f in full]
                h0 = h0.map(torch.add, self._values(self._mini, news))
                mag = mag.map(torch.add, self._values(abs_plan(self._mini), news))
        x = torch.stack([self._all.take(h0), self._all.take(mag)]).to(self._pack_dtype)
        x = self._all_reduce(x)
        return self._all.put(self._zeros(), x[0]), self._all.put(self._zeros(), x[1])

    # -------------------------------------------------------------------------------- collectives
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self._comm_device)
        dist.all_reduce(y)
        self.comm_bytes["all_reduce"] += y.numel() * y.element_size()
        return y.to(self.device)

    def _old_rows(self, tensors, mask: Mask) -> dict:
        """This rank's rows of ``theta_k`` of the straddling terms that ``mask`` decomposes (copies made
        right before the step: ``{straddle index: rows}``)."""
        out = {}
        for j, s in enumerate(self._straddles):
            p = s.pieces[self.rank]
            if p is not None and mask.gram_np[s.term.view.rows][s.term.slot]:
                out[j] = p.of(tensors[s.term.view.tensor]).clone()
        return out

    def _held(self, cur, old_rows: Mapping) -> dict:
        """This rank's rows of each straddling term (new, copied: the weights change before they are
        sent; and the old ones of ``old_rows``, the drift step's copies)."""
        out = {}
        for j, s in enumerate(self._straddles):
            p = s.pieces[self.rank]
            if p is not None:
                out[j] = [p.of(cur[s.term.view.tensor]).clone()] + ([old_rows[j]] if j in old_rows else [])
        return out

    def _exchange(self, helds: list[dict], sels: list) -> list[list[list[torch.Tensor]]]:
        """Send the straddling rows of some steps to their owners (one ``isend`` per owner, one ``irecv``
        per holder; nobody receives rows of a term it does not own). ``sels``: per step the straddling
        terms whose old rows travel too (the same sets on every rank). Returns, per step and owned term
        (``self._mine`` order), the full ``(D, N)`` rows: ``[new]`` or ``[new, old]``."""
        me, xd, dev = self.rank, self._xdtype, self._comm_device
        sends: dict[int, list[torch.Tensor]] = {}
        for held in helds:
            for j, s in enumerate(self._straddles):
                if s.owner != me and j in held:
                    sends.setdefault(s.owner, []).extend(b.reshape(-1) for b in held[j])
        counts = [0] * self.world
        for held, sel in zip(helds, sels):
            for j, s in self._mine:
                for h, n in enumerate(s.sizes()):
                    if h != me:
                        counts[h] += n * (2 if j in sel else 1)
        recv, ops = {}, []
        for h, n in enumerate(counts):
            if n:
                recv[h] = torch.empty(n, dtype=xd, device=dev)
                ops.append(dist.irecv(recv[h], src=h))
                self.comm_bytes["rows_received"] += n * xd.itemsize
        for o, parts in sorted(sends.items()):
            buf = torch.cat([p.to(xd) for p in parts]).to(dev)
            ops.append(dist.isend(buf, dst=o))
            self.comm_bytes["rows_sent"] += buf.numel() * xd.itemsize
        for op in ops:
            op.wait()
        recv = {h: b.to(self.device) for h, b in recv.items()}
        off = [0] * self.world
        out = []
        for held, sel in zip(helds, sels):
            step = []
            for j, s in self._mine:
                nb = 2 if j in sel else 1
                blocks = [[] for _ in range(nb)]
                for h, p in enumerate(s.pieces):
                    if p is None:
                        continue
                    n = p.rows * p.cols
                    for b in range(nb):
                        if h == me:
                            blocks[b].append(held[j][b])
                        else:
                            blocks[b].append(recv[h][off[h]: off[h] + n].view(p.rows, p.cols).to(s.dtype))
                            off[h] += n
                step.append([torch.cat(x) for x in blocks])
            out.append(step)
        return out

    def _exchange_pending(self) -> None:
        """Exchange the rows of the pending steps that still hold them; the owners add their straddling
        terms to those steps' split partials."""
        steps = [p for p in self._pend if p.held is not None]
        if not steps:
            return
        got = self._exchange([p.held for p in steps], [p.sel for p in steps])
        r = self._row_size
        mini = self._mini
        for p, full in zip(steps, got):
            p.held = None
            if not self._mine:
                continue
            news = [f[0] for f in full]
            h1 = self._values(mini, news)
            terms = kdec = None
            if p.drift:  # the owned terms of the step's group, over their old rows (the others are not read)
                idx = [i for i, (j, _) in enumerate(self._mine) if j in p.sel]
                sub = kernels.Plan([mini.grams[i] for i in idx], [], [], mini.vec_size, dict(mini.gram_slots))
                olds = [full[i][1] if i in idx else None for i in range(len(full))]
                # h_k of the straddling terms (the assembly's correction for a non-fp32 decay factor reads it;
                # their decay is formed at the flush from the reduced h_k)
                h_old = self._values(sub, [o if o is not None else n for o, n in zip(olds, news)])
                terms, kdec = self._drift_terms(sub, olds, news, [p.a[s.term.view.tensor] for _, s in self._mine],
                                                p.a, h_old, self.sampler.mask(p.group))
            add = torch.cat(self._split_blocks(h1, terms, kdec if p.kdecay else None))
            p.pack[r: r + add.numel()] += add

    # ------------------------------------------------------------------------------------- steps
    @property
    def steps_taken(self) -> int:
        """Booked steps and those pending the reduction."""
        return self.step_count + len(self._pend)

    @eager
    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer | None = None, gradients: bool = True) -> None:
        """On a drift step, copy this rank's pieces of the views of ``theta_k`` that the step's group
        reads (``sampler``: every local shard with ``snapshot_budget=None``; dropped after the step: no
        copy is held between drift steps) and take each parameter's decay factor ``a``; else nothing."""
        if not self._comm:
            return super().before_step(optimizer, gradients)
        self._snap, self._old = None, None
        if gradients:
            self.check_step_gradients()
        else:
            self._grad_row = None
        if not self.is_drift_step():
            return
        j = (self.step_count + len(self._pend)) // self.drift_every  # drift step j: group j mod len(groups)
        self.tensors = [_local(p) for p in self.params]
        snap = self.sampler.snapshot(j, self.tensors)
        self._old = (j, self._old_rows(self.tensors, snap.mask) if self._straddles else {})
        self._snap = snap
        self._a = decay_factors(optimizer, self.params)

    def _masked(self, v: Values) -> Values:
        """``v`` on this rank's complete entries, 0 elsewhere (NaN elsewhere does not leak)."""
        vec, grams = self._own
        return Values(torch.where(vec, v.vec, 0.0), {d: torch.where(grams[d], g, 0.0) for d, g in v.grams.items()})

    def _own_row(self, h1: Values, terms, mask: Mask | None = None) -> torch.Tensor:
        """This rank's additive share of one metric row: per family and group the sum of the ``eps``
        of its complete instances, then per term and family the sum of squares over its complete entries
        (of ``mask``: the entries the step decomposed; ``terms["measured"]`` is set, 0 outside it)."""
        rel = self.layout.inst_norm(self._masked(h1.map(torch.sub, self.h0))) / self.denom
        nf = len(self.families)
        parts = list(self.book.family_sums(rel, per_instance=True))
        if self.drift:
            if terms is None:
                parts.append(torch.zeros(len(TERMS) * nf, dtype=rel.dtype, device=self.device))
            else:
                meas = h1.map(torch.sub, self._hp)
                if mask is not None:
                    mask.restrict_((meas.vec, meas.grams))
                res = meas.map(residual, terms["decay"], terms["first"], terms["second"])
                terms["measured"] = meas
                for v in (meas, terms["decay"], terms["first"], terms["second"], res):
                    parts.append(self._own_squares(v, nf))
        return torch.cat(parts)

    def _own_squares(self, v: Values, nf: int) -> torch.Tensor:
        """Per family the sum of squares of ``v`` over this rank's complete entries (a Gram slot's as one
        batched dot per slot: no masked copy, no squared temporary of the Grams; NaN elsewhere does
        not leak)."""
        vec_own, gram_own = self._own
        out = torch.zeros(nf, dtype=v.vec.dtype, device=self.device).index_add_(
            0, self.layout.vec_fam, torch.where(vec_own, v.vec, 0.0).square())
        fam = self.layout.gram_fam
        for d, g in v.grams.items():
            if g.shape[0]:
                flat = g.reshape(g.shape[0], 1, -1)
                sq = torch.bmm(flat, flat.transpose(1, 2)).view(-1)
                out.index_add_(0, fam[d], torch.where(gram_own[d].view(-1), sq, 0.0))
        return out

    @eager
    @torch.no_grad()
    def after_step(self) -> None:
        """Evaluate this rank's terms at ``theta_{k+1}`` (and the drift terms when ``before_step`` ran)
        and keep the step pending on the device. Collective only when a reduction is due."""
        if not self._comm:  # every rank holds every parameter: the single-process step, on every rank
            return super().after_step()
        if not self._books_after_close():  # (one warning; nothing is booked after close())
            return
        snap, self._snap = self._snap, None
        old, self._old = self.__dict__.get("_old"), None
        if self._straddles and sum(p.held is not None for p in self._pend) >= self._exchange_every:
            self._exchange_pending()
        # reduce when `every` steps are pending or this step's pack would not fit max_pending_bytes (the
        # sizes are the same on every rank, so every rank decides the same)
        nxt = self._schedule.step_scalars(snap is not None, self.drift) * self._pack_dtype.itemsize
        pending = sum(p.pack.numel() for p in self._pend) * self._pack_dtype.itemsize
        deferred = Deferred()  # a NonFiniteError is raised once this step is pending (the optimizer applied it)
        if self._pend and (len(self._pend) >= self.every or pending + nxt > self._max_pending_bytes):
            deferred.call(self._reduce_and_flush)
        cur = [_local(p) for p in self.params]
        self.tensors = cur
        a = stepped_factors(self._a, self.params)  # an unstepped parameter (grad None) is not decayed
        terms = kdec = mask = None
        group, sel, old_rows = None, frozenset(), {}
        if snap is not None:
            mask, (group, old_rows) = snap.mask, old
            # this rank's share of h_k at the group's entries: the last step's (after a load: the full h, so
            # from the copies of theta_k)
            h_old = self._values(snap.plan, snap.olds) if self._hp_full else self._hp
            terms, kdec = self._drift_terms(snap.plan, snap.olds, self.sampler.news(snap, cur),
                                            self.sampler.factors(snap, a), a, h_old, mask, donate=True)
            del snap, h_old  # (the copies of theta_k were freed once the DRIFT pass read them)
            sel = frozenset(j for j, s in enumerate(self._straddles) if mask.gram_np[s.term.view.rows][s.term.slot])
        h1 = self._values(self._local_plan, cur)
        # a step without drift terms packs h(new) only (every rank agrees on which steps have them)
        parts = [self._own_row(h1, terms, mask).to(self._pack_dtype)]
        drifted, kdecay = terms is not None, kdec is not None
        if drifted:  # each law-sized term freed once it is summed and packed
            for k in self._cum_p:  # (empty without cumulative)
                self._cum_p[k].map(torch.Tensor.add_, terms[k])  # in place (its own buffers, see _adopt)
            del terms["measured"], terms["decay"]
        parts += self._split_blocks(h1, terms, kdec)
        del terms, kdec
        held = self._held(cur, old_rows) if self._straddles else None
        del old_rows
        self._pend.append(_Pending(torch.cat(parts), drifted, held, a, kdecay, group, sel, self._grad_columns()))
        del parts
        self._hp, self._hp_full = h1, False
        for m in self.monitors:  # they sample the training state: at every step, not when the step is booked
            m.update()
        deferred.raise_booked(self, self.step_count + len(self._pend))  # this step too (pending)

    def _reduce_and_flush(self) -> None:
        """Reduce the pending steps, then write the rows if ``every`` are due (``after_step``)."""
        self._sync()
        if len(self._rows) >= self.every:
            Tracker.flush(self)

    def _sync(self) -> None:
        """Reduce the pending steps (the owner-only row exchange if heads straddle ranks, then ONE
        packed all-reduce) and book their metric rows in order. Collective; a no-op on every rank when
        nothing is pending."""
        if not self._pend:
            return
        if self._straddles:
            self._exchange_pending()
        pend, self._pend = self._pend, []
        x = self._all_reduce(torch.cat([p.pack for p in pend]))
        deferred = Deferred()
        for row, p in zip(x.split([p.pack.numel() for p in pend]), pend):
            deferred.call(self._book, row, p)  # the step is booked (see _book): book the rest first
        deferred.raise_booked(self, self.step_count)  # these steps were booked before the caller saw it

    def _book(self, x: torch.Tensor, p: _Pending) -> None:
        """Finish one step's metric row from its reduced pack: add the split instances' ``eps`` and
        sums of squares (full values now) to the complete ones', then append it as ``Tracker`` does."""
        nf, ng, S, r = len(self.families), len(self.groups), self._split.size, self._row_size
        dt, dev = self.h0.vec.dtype, self.device
        x = x.to(dt)
        hs = x[r: r + S]
        d = hs - self._h0_split
        sq = torch.zeros(self.layout.n_inst, dtype=dt, device=dev).index_add_(0, self._split_inst, self._split_w * d * d)
        rel = sq.sqrt() / self.denom  # 0 on complete instances (their share is in x[:nf + ng])
        fam, grp = self.book.family_sums(rel, per_instance=True)
        parts = self.book.eps_means(x[:nf] + fam, x[nf: nf + ng] + grp)
        if self.drift:
            if p.drift:
                mask = self.sampler.mask(p.group)
                fst, snd = x[r + S: r + 2 * S], x[r + 2 * S: r + 3 * S]
                # decay = (a^2 - 1) h_k of the reduced h_k (conserve.tracking.drift), + the kernel's part
                h_old, z = self._split.put(self._zeros(), self._h_split), self._zeros()
                dec = self._split.take(Values(*self.assembly.decay((h_old.vec, h_old.grams), p.a,
                                                                   (z.vec, z.grams) if p.kdecay else None, mask)))
                if p.kdecay:
                    dec = dec + x[r + 3 * S: r + 4 * S]
                meas = hs - self._h_split
                if not mask.full:  # the split entries the step decomposed
                    meas = meas * self._split.take(Values(mask.vec, {d: g[:, None, None].expand(-1, d, d)
                                                                     for d, g in mask.grams.items()})).to(dt)
                split = (meas, dec, fst, snd, residual(meas, dec, fst, snd))
                own = x[nf + ng: nf + ng + len(TERMS) * nf].view(len(TERMS), nf)
                sq = torch.stack([own[i] + torch.zeros(nf, dtype=dt, device=dev).index_add_(
                    0, self._split_fam, self._split_w * v * v) for i, v in enumerate(split)])
                parts.append(self.book.term_norms(sq, mask).view(-1))
                for k, v in zip(CUMULATIVE, split[:4]):
                    if k in self._cum_split:  # (empty without cumulative)
                        self._cum_split[k].add_(v)
            else:
                parts.append(torch.full((len(TERMS) * nf,), float("nan"), dtype=dt, device=dev))
        self._h_split = hs.clone()  # (a view would keep the reduced buffer of every pending step alive)
        deferred = Deferred()
        if len(self._rows) >= self.every:  # as Tracker.record_step: flush lazily, raise once this step is booked
            deferred.call(Tracker.flush, self)
        self.step_count += 1
        row = torch.cat(parts).float()
        self._rows.append(row if p.grad is None else torch.cat([row, p.grad.to(row.device, row.dtype)]))
        if p.extras:  # (not Tracker.record: it ignores scalars once closed, and close() books the pending steps)
            while len(self._extras) < len(self._rows):
                self._extras.append({})
            self._extras[len(self._rows) - 1].update(p.extras)
        deferred.raise_booked(self, None)  # _sync marks the booked steps once it has booked them all

    def _materialize(self) -> None:
        """Full ``h`` and ``cumulative`` (when kept) on every rank (one packed all-reduce after the pending steps)."""
        if not self._comm:
            return
        self._sync()
        cum = [k for k in CUMULATIVE if k in self._cum_p]  # (none without cumulative: h alone is reduced)
        srcs = [self._hp] + [self._cum_p[k] for k in cum]
        x = self._all_reduce(torch.stack([self._all.take(self._masked(v)) for v in srcs]).to(self._pack_dtype))
        full = [self._split.put(self._all.put(self._zeros(), x[i]), s)
                for i, s in enumerate([self._h_split] + [self._cum_split[k] for k in cum])]
        self.h, self._h_own = full[0], None  # (a view of the gathered values: not written into)
        if cum:
            self.cumulative = dict(zip(cum, full[1:]))

    def record_step(self, h1: Values, terms: Mapping[str, Values] | None = None, sampled=None) -> None:
        """Book one step from FULL values (a fused optimizer's). Only without sharded parameters (DDP):
        with sharded ones the values must be this rank's partial sums, which only ``after_step`` makes."""
        if self._comm:
            raise UsageError("record_step() takes full law values, but this tracker's parameters are sharded: "
                             "use a torch optimizer with conserve.distributed.track (or Tracker.after_step)")
        super().record_step(h1, terms, sampled)

    @eager
    def record(self, **scalars) -> None:
        """Attach scalars to the current step's row (rank 0's values are the ones written)."""
        if self._pend:
            self._pend[-1].extras.update({k: record_value(k, v) for k, v in scalars.items()})
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
        self._materialize()
        return super().values()

    def totals(self):
        """``Tracker.totals`` after reducing the pending steps. Collective."""
        self._materialize()
        return super().totals()

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Tracker state for ``torch.distributed.checkpoint`` (fixed shapes; the same on every rank,
        so DCP writes it once). Collective: the pending steps are reduced and their rows written to
        the sinks first (rank 0), as ``Tracker.state_dict`` does.

        Example::

            dcp.save({"model": model.state_dict(), "conserve": tracker.state_dict()}, checkpoint_id=path)
            state = {"model": model.state_dict(), "conserve": tracker.state_dict()}
            dcp.load(state, checkpoint_id=path); tracker.load_state_dict(state["conserve"])
        """
        self._materialize()
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
                "pending_extras": extras, "monitors": s.pop("monitors"), "grad_check": s.pop("grad_check")}
        return {**s, "pending": buf, "meta": pickle.dumps(meta)}

    def load_state_dict(self, state: Mapping) -> None:
        """Load a state from ``state_dict`` (after ``dcp.load``) or from a single-process ``Tracker``."""
        state = dict(state)
        if "meta" in state:
            meta = pickle.loads(state.pop("meta"))
            if meta.get("format") not in (_FORMAT, "conserve.distributed/1"):  # /1: same fields
                raise UsageError(f"unknown tracker state format {meta.get('format')!r}; save it with this version")
            n = meta["pending_count"]
            state.update(step=meta["step"], laws=meta["laws"], pending_extras=meta["pending_extras"],
                         monitors=meta["monitors"], pending=state["pending"][:n] if n else None,
                         grad_check=meta.get("grad_check"))
        self._pend, self._snap, self._old = [], None, None
        super().load_state_dict(state)
        if self._comm:
            self._adopt()
