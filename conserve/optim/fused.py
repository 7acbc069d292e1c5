"""Fused optimizers: ``FusedAdamW`` / ``FusedAdam`` / ``FusedSGD`` update the weights and measure the laws
in the same pass over each parameter (spec "Discrete steps: the exact drift identity").

They are ``torch.optim.Optimizer`` subclasses in the torch.optim style: the class owns
``param_groups``, ``state`` and ``state_dict`` (keys and layout identical to ``torch.optim.AdamW`` /
``SGD``: ``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, the same group keys), and the math
lives in pure functions over tensor lists (``conserve.kernels.optim_step``).  A state dict moves both
ways between these classes and their torch twins.

Tracking: pass the model (``track=model``), or explicit ``laws=`` with ``named_params=``, plus any
``Tracker`` keyword (``every``, ``sinks``, ``fp64``, ``backend``, ``monitors``, ``drift``, ``drift_every``
(default here ``FUSED_DRIFT_EVERY`` = 10), ``snapshot_budget``, ``on_nonfinite``, ``keep_last``,
``cumulative``) and
``overlap`` (bool, default False: see "Overlap" below)::

    opt = conserve.optim.FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, track=model,
                                    sinks=[conserve.JSONLSink("laws.jsonl")], every=50)

Without ``track``/``laws`` they are plain (fused) optimizers.  What one tracked step computes:

* every NormTerm / SumTerm that reads whole rows or whole columns of a parameter (unit, RoPE pair,
  gain, scale, router-sum, translation laws) comes from per-row / per-column sums of ``new^2``,
  ``a*old*Delta``, ``Delta^2``, ``(a^2-1) old^2`` (``new``, ``Delta``, ``(a-1) old`` for sums) that the
  step kernel accumulates while it writes the row: no extra read of any weight;
* the D x D Gram laws (and any other term) come from ``conserve.kernels.drift``: on a drift step only,
  the views they read are copied right before the step (one group of them under ``snapshot_budget``,
  round robin: ``conserve.tracking.drift.Sampler``); after it, ONE pass over old and new (Triton: one
  launch per head size) gives ``B(a old, Delta)`` and ``h(Delta)`` with ``Delta = new - a old`` formed
  in registers; ``h(new)`` of these laws is evaluated every step (``eps``);
* the decay is ``(a^2-1) h(old)`` from the stored values (``conserve.tracking.drift.Assembly``); only
  entries whose tensors have different ``a`` use the per-term decay of the statistics / kernel;
* the torch twin (CPU) steps each tensor in blocks of whole rows (``optim_step.step_stats_reference``:
  bit for bit the whole-tensor update, each block's statistics taken while it is in cache); between
  drift steps it computes only ``h(new)`` statistics and copies nothing; on a drift step the blocks
  hold at most ``optim_step.chunk_bound`` elements (64Ki at most) and each block of a weight with
  statistics is copied into one block-sized scratch buffer (with a second one for ``Delta``) reused
  across blocks and tensors, dropped after the step: no temporary of a drift step is larger than a
  block.  The step statistics live for the step only (one row of ``h(new)`` between drift steps),
  one group of consecutive tensors at a time (at most ``STATS_BUDGET`` = 1% of the tracked bytes of
  lines, or one tensor's): each tensor's row / column sums go to its group's buffer, folded into the
  ``(rows, entries)`` result once the group is stepped (``optim_step.fold``: slice additions for runs
  of consecutive entries, else index additions, one per sign), the groups in order whatever order
  the tensors are stepped in (so the bits do not depend on it; a group stepped early waits for those
  before it); no copy of every (entry, line) pair.  Between steps the optimizer holds per group its
  segments (a few ints per run, an int16 entry per pair of the others, a sign per pair only where
  signs change often); the structures cached for ``h_0``'s evaluation of the whole plan are dropped
  after it.  (A Triton step writes one buffer of every line, the CUDA finish reads the padded
  ``(entry, J)`` tables.)
  ``step`` runs outside ``torch.compile`` graphs (``torch.compiler.disable``): compiling
  it, or a training step that calls it, gives the eager update.

Overlap (``overlap=True``; default False, keep it off on CUDA): on a drift step the tensors the DRIFT
pass reads (the snapshot's Gram-law views: ``q/k/v/o_proj``) are stepped first, then the pass runs, then
the other tensors are stepped.  On CUDA a Triton pass goes to a side stream (the torch twin's pass runs
in place: its cached index structures would be side-stream allocations read on the caller's stream;
``_drift_early``) (``conserve.kernels.streams``: high
priority, waiting on an event recorded after those tensors' step; its host->device copies are made
first, on the caller's stream, ``kernels.prepare_drift``) while the caller's stream steps the rest
(memory-bound: the MLP and embedding weights), and the caller's stream waits on the side stream
before ``_record`` assembles the terms; the snapshot copies stay referenced until then and the pass's
outputs are ``record_stream``-ed on the caller's stream.  On CPU (no streams: the pass runs in place)
the weights, optimizer state and every tracker row and cumulative are the very bits of the serial
ordering (``tests/test_fused_overlap.py``, with a recording fake of the stream api that also checks
which stream allocates, reads and frees each tensor).  On CUDA it is NOT shown bit-identical to the
serial ordering (the GPU parity check, ``bench.overlap_check`` / ``bench.fused_optim``'s
``overlap_parity``, finds law values and rows that differ, weights equal; bench/NOTES.md): the first
overlapped drift step on CUDA warns once
(``RuntimeWarning``); use the default ``overlap=False``.  If the pass raises, the rest of the weights
are still stepped, then the error propagates (no row).

The three drift terms are computed directly (not as residuals), so the tracker's ``residual`` checks
the identity at run time.  GradScaler: these optimizers do not set ``_step_supports_amp_scaling``,
so ``GradScaler.step`` unscales the gradients and skips ``step()`` on an inf/NaN step (no law update
on a skipped step).  ``lr`` may be a tensor (read with ``float()``: a host sync if it lives on a GPU).
Backend: Triton on CUDA tensors, the torch twin on CPU (``backend="triton"`` forces Triton, which
needs ``TRITON_INTERPRET=1`` on CPU).
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype

from .. import kernels
from ..kernels import optim_step as K
from ..kernels import reference, runner, streams
from ..kernels.dispatch import choose_backend
from ..kernels.plan import FIRST_ORDER, Plan, View
from ..tracker import Tracker, eager, record_once
from ..tracking.values import Values
from ..tracking.drift import Mask, Sampler, StepStats, drift_pieces, make_mask

__all__ = ["FusedAdamW", "FusedAdam", "FusedSGD"]

_TRACKER_KEYS = ("every", "sinks", "drift", "fp64", "backend", "monitors", "drift_every", "snapshot_budget",
                 "on_nonfinite", "keep_last", "cumulative", "check_gradients", "grad_check_ignore", "grad_dtype", "loss")
# param_group keys of torch's optimizers that choose an implementation of the same update (not the math)
_IMPLEMENTATION = ("fused", "capturable", "foreach")
# A fused drift step re-reads every weight whose laws the step statistics cover (an old copy and Delta,
# block by block) besides the sampled Gram-law views; between drift steps the statistics cost one read
# of the new weights (in cache: block by block).  A drift step every 10th step keeps the tracked step's cost
# near torch AdamW's (``python -m bench.track_overhead`` measures it); pass drift_every=1 for every step.
FUSED_DRIFT_EVERY = 10
# The torch twin's step statistics go to buffers of groups of consecutive tensors of at most this
# fraction of the tracked bytes (or one tensor's lines), each folded into the entries once stepped: a
# large model folds few groups (a fold's fixed per-op cost is paid per group), a small one tensor by tensor
# (a buffer of every line would be a large fraction of it)
STATS_BUDGET = 0.01


_OVERLAP_WARNED = False
OVERLAP_CUDA_WARNING = (
    "overlap=True on CUDA: the overlap ordering of the fused optimizers' drift steps is not shown bit-identical "
    "to the serial ordering (the GPU parity check found law values and metric rows that differ; weights equal) "
    "and it was not faster than the serial ordering when measured; use overlap=False (the default)")


def _warn_overlap_cuda() -> None:
    """The one-time ``RuntimeWarning`` of ``overlap=True`` on CUDA (module docstring, "Overlap")."""
    global _OVERLAP_WARNED
    if not _OVERLAP_WARNED:
        _OVERLAP_WARNED = True
        warnings.warn(OVERLAP_CUDA_WARNING, RuntimeWarning, stacklevel=4)


# --------------------------------------------------------------------------- term -> stats map
def _map_norm(view: View, shape) -> tuple[str, list[int]] | None:
    """Which stats a NormTerm reads: ``("row", matrix rows)`` or ``("col", b*C + column)`` per view row."""
    B, R, C = K.matrix_shape(shape)
    off, rs, cs = view.resolve(torch.empty(tuple(shape), device="meta"))
    n, k = view.rows, view.cols
    if k == C and (cs == 1 or C == 1) and off % C == 0 and (n <= 1 or rs % C == 0):
        return "row", [off // C + r * (rs // C) for r in range(n)]
    c0 = off % (R * C)
    if k == R and (cs == C or R == 1) and c0 < C and (n <= 1 or (rs > 0 and c0 + (n - 1) * rs < C)):
        b = off // (R * C)
        return "col", [b * C + c0 + r * rs for r in range(n)]
    return None


def _map_sum(view: View, shape) -> tuple[str, list[int]] | None:
    """Which stats a SumTerm reads (sum over the view's rows, one value per view column)."""
    B, R, C = K.matrix_shape(shape)
    off, rs, cs = view.resolve(torch.empty(tuple(shape), device="meta"))
    n, k = view.rows, view.cols
    c0 = off % (R * C)
    if n == R and (rs == C or R == 1) and (cs == 1 or k == 1) and c0 + k - 1 < C:
        b = off // (R * C)
        return "col", [b * C + c0 + c for c in range(k)]
    if n == C and (rs == 1 or C == 1) and off % C == 0 and (k <= 1 or cs % C == 0):
        return "row", [off // C + c * (cs // C) for c in range(k)]
    return None


class _FusedPlan:
    """The tracker's plan split into the part the step kernel measures and the rest (Gram terms...)."""

    def __init__(self, tracker: Tracker):
        plan: Plan = tracker.compiled.plan
        shapes = [tuple(t.shape) for t in tracker.tensors]
        self.reqs = [K.StatsRequest() for _ in shapes]
        entries: list[list[tuple[int, float, bool]]] = [[] for _ in range(plan.vec_size)]
        n_slots = {True: 0, False: 0}  # quadratic slots, then linear ones (numbered after all quadratic)
        rest = Plan(vec_size=plan.vec_size, gram_slots=dict(plan.gram_slots))
        rest.grams = list(plan.grams)

        def slot(i, axis, quad):
            field = f"{axis}_{'q' if quad else 'l'}"
            base = getattr(self.reqs[i], field)
            if base < 0:
                B, R, C = K.matrix_shape(shapes[i])
                base = n_slots[quad]
                n_slots[quad] += B * (R if axis == "row" else C)
                setattr(self.reqs[i], field, base)
            return base

        for t in plan.norms:
            m = _map_norm(t.view, shapes[t.view.tensor]) if t.shift == 0.0 else None
            if m is None:
                rest.norms.append(t)
                continue
            base = slot(t.view.tensor, m[0], True)
            for r, s in enumerate(m[1]):
                entries[t.index + r * t.index_stride].append((base + s, t.sign, True))
        for t in plan.sums:
            m = _map_sum(t.view, shapes[t.view.tensor])
            if m is None:
                rest.sums.append(t)
                continue
            base = slot(t.view.tensor, m[0], False)
            for c, s in enumerate(m[1]):
                entries[t.index + c].append((base + s, t.sign, False))
        nq = n_slots[True]
        self.n_slots = nq + n_slots[False]
        for r in self.reqs:
            r.row_l, r.col_l = (x + nq if x >= 0 else x for x in (r.row_l, r.col_l))
        dev, acc = tracker.device, torch.float64 if tracker.fp64 else torch.float32
        # the lines renumbered in groups of consecutive tensors (index order) of at most ``budget`` lines
        # (or one tensor's), each group's quadratic lines first: a group's lines are one range of the
        # buffer of every line (a Triton step's), its quadratic ones a prefix of it (``K.Fold``)
        tracked = sum(t.numel() * t.element_size() for t in tracker.tensors)
        budget = int(STATS_BUDGET * tracked / (K.NQ * torch.empty((), dtype=acc).element_size()))
        fields = [(i, [(name, getattr(r, name), cnt) for name, cnt in zip(
            ("row_q", "col_q", "row_l", "col_l"), (lambda B, R, C: (B * R, B * C, B * R, B * C))(*K.matrix_shape(shapes[i])))
            if getattr(r, name) >= 0]) for i, r in enumerate(self.reqs) if r.any]
        groups: list[list] = []
        for i, fs in fields:
            n = sum(c for _, _, c in fs)
            if not groups or groups[-1][1] + n > max(budget, n) or groups[-1][1] == 0:
                groups.append([[], 0])
            groups[-1][0].append((i, fs))
            groups[-1][1] += n
        remap = np.zeros(max(1, self.n_slots), dtype=np.int64)
        self.local_reqs: dict[int, K.StatsRequest] = {}
        self.group_of: dict[int, int] = {}
        self.groups: list[tuple[int, int, int, list[int]]] = []  # (first line, lines, quadratic lines, tensors)
        start = 0
        for g, (members, n) in enumerate(groups):
            at = start
            for quad in (True, False):
                for i, fs in members:
                    lr = self.local_reqs.setdefault(i, K.StatsRequest())
                    for name, old, cnt in fs:
                        if name.endswith("_q") == quad:
                            remap[old: old + cnt] = np.arange(at, at + cnt)
                            setattr(self.reqs[i], name, at)
                            setattr(lr, name, at - start)
                            at += cnt
                if quad:
                    n_quad = at - start
            self.groups.append((start, n, n_quad, [i for i, _ in members]))
            for i, _ in members:
                self.group_of[i] = g
            start += n
        entries = [[(remap[s if quad else s + nq], sign, quad) for s, sign, quad in es] for es in entries]
        J = max([len(e) for e in entries] + [1])
        idx = np.zeros((plan.vec_size, J), dtype=np.int64)
        coef = np.zeros((K.NQ, plan.vec_size, J), dtype=np.float64)
        for o, es in enumerate(entries):
            for j, (s, sign, quad) in enumerate(es):
                idx[o, j] = s
                coef[:, o, j] = (sign, FIRST_ORDER * sign if quad else sign, sign if quad else 0.0, sign)
        self.n_entries = plan.vec_size
        idx_t, coef_t = torch.from_numpy(idx), torch.from_numpy(coef).to(acc)
        cuda = torch.device(dev).type == "cuda"
        # the padded (entry, J) tables: only the deterministic CUDA finish reads them
        self.idx, self.coef = (idx_t.to(dev), coef_t.to(dev)) if cuda else (None, None)
        # CPU: one ``K.Fold`` per group (held between steps: per pair segment its sign and its entries --
        # a first entry, or an int16 index --, a line index only when lines are not each read once); the
        # torch twin writes each tensor's lines into its group's buffer (``local_reqs``: relative to the
        # group), folded into the entries once the group is stepped (``_Folds``); the groups are folded
        # in order, so the bits do not depend on the order in which the tensors are stepped
        self.folds: list[K.Fold] = []
        if not cuda:
            o, sl, cf = K.compact_terms(idx_t, coef_t)  # the used (entry, slot) pairs, in (entry, j) order
            for g0, n, n_quad, _ in self.groups:
                m = (sl >= g0) & (sl < g0 + n)
                self.folds.append(K.Fold.build(o[m], sl[m] - g0, cf[0][m], n_quad, n, plan.vec_size, acc))
        self.max_index = max([f.n_index for f in self.folds] + [0])
        self.rest = rest if (rest.grams or rest.norms or rest.sums) else None
        self.rest_tensors = sorted({t.view.tensor for t in rest.grams + rest.norms + rest.sums}) if self.rest else []
        # vec entries written by a term of ``rest`` (decomposed only when the Sampler's group holds them)
        self.rest_vec = np.zeros(plan.vec_size, dtype=bool)
        for t in rest.norms:
            self.rest_vec[t.index + t.index_stride * np.arange(t.view.rows)] = True
        for t in rest.sums:
            self.rest_vec[t.index: t.index + t.view.cols] = True
        self.fused_terms = len(plan.norms) + len(plan.sums) - (len(rest.norms) + len(rest.sums))


# ------------------------------------------------------------------------------- base class
class FusedOptimizer(torch.optim.Optimizer):
    _algo = ""
    _refused: tuple = ()

    def _setup_tracking(self, track, laws, named_params, tracker_kwargs):
        tracker_kwargs = dict(tracker_kwargs)
        overlap = tracker_kwargs.pop("overlap", False)
        bad = sorted(set(tracker_kwargs) - set(_TRACKER_KEYS))
        if bad:
            raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) {bad}; tracking options "
                            f"are {list(_TRACKER_KEYS) + ['overlap']}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r}: pass True or False")
        self.backend = tracker_kwargs.get("backend", "auto")
        self.tracker: Tracker | None = None
        self._fp = None
        # overlap ordering of drift steps (module docstring, "Overlap"); the side stream is made on the
        # first overlapped drift step on CUDA (_side_stream); _stream_api: a test's recording fake
        self.overlap = overlap
        self._side = None
        self._stream_api = None
        self._early = None
        self._drift_config = "auto"  # the side stream's kernels.Config (bench/fused_optim.py compares choices)
        self._layouts: dict = {}
        self._chunk = K.CHUNK_MAX
        if track is None and laws is None:
            if named_params is not None:
                raise ValueError("named_params is only used with laws=...; pass track=model or laws=[...]")
            if overlap:
                raise ValueError("overlap=True orders the drift pass of a tracked step; pass track=model "
                                 "(or laws=...) with it, or drop it")
            return
        if track is None and named_params is None:
            raise ValueError("laws=... needs named_params= (a mapping name -> parameter, e.g. "
                             "dict(model.named_parameters())) or track=model")
        params = dict(named_params) if named_params is not None else None
        tracker_kwargs = {"drift_every": FUSED_DRIFT_EVERY, **tracker_kwargs}
        self.tracker = Tracker(track, laws, params=params, **tracker_kwargs)
        self._fp = _FusedPlan(self.tracker)
        # h_0 was this optimizer's only evaluation of the whole plan (each step: the statistics and the
        # rest plan), so the structures cached for it (the torch twin's line index, the Triton tables)
        # are dropped now rather than held for the tracker's lifetime
        for cache in (reference, runner):
            cache._forget(id(self.tracker.compiled.plan))
        self._tracked = {id(t): i for i, t in enumerate(self.tracker.tensors)}
        self._acc = torch.float64 if self.tracker.fp64 else torch.float32
        # elements of a block of the torch twin's drift step (kernels.optim_step.chunk_bound)
        self._chunk = K.chunk_bound(max([t.numel() for t in self.tracker.tensors] + [1]))
        rest = self._fp.rest if self._fp.rest is not None else Plan(vec_size=self.tracker.compiled.plan.vec_size,
                                                                      gram_slots=dict(self.tracker.compiled.plan.gram_slots))
        self._sampler = Sampler(rest, self.tracker.tensors, self.tracker.snapshot_budget, self.tracker.device)
        self._sampler.compact = _compact_pays(self._sampler, rest)  # (``_compact_terms``)
        self._compact_pos: dict = {}  # Mask.key -> the group's vec entries among the drift step's (``_compact_terms``)

    # ---- param groups ---------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``; a refused option (``amsgrad=True``...) raises
        ``ValueError`` before the group is added (the optimizer is left as it was and keeps stepping)."""
        if isinstance(param_group, Mapping):
            self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])
        if getattr(self, "_tracking_ready", False):  # not during __init__ (later groups still to come)
            self.tracker.check_optimizer(self)

    def _ready_tracking(self) -> None:
        """After ``__init__``: compare the laws with the param_groups (``Tracker.check_optimizer``)."""
        self._tracking_ready = self.tracker is not None
        if self._tracking_ready:
            self.tracker.check_optimizer(self)

    def _check_group(self, group: Mapping) -> None:
        name = type(self).__name__
        for key in self._refused:
            if group.get(key):
                raise ValueError(f"{name} does not support {key}=True; use torch.optim with "
                                 f"conserve.track(optimizer, model) for that option")

    def __getstate__(self) -> dict:
        # the whole optimizer (Optimizer.__getstate__ keeps defaults, state and param_groups only: a copy
        # or an unpickled one had no tracker, no plan and no backend, and its step() failed); the side
        # stream (overlap=True on CUDA) is made again on first use
        return {**self.__dict__, "_side": None, "_early": None}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        tr = self.__dict__.get("tracker")
        if tr is not None and "tensors" in tr.__dict__:  # a copy's tensors are new objects: ids again
            self._tracked = {id(t): i for i, t in enumerate(tr.tensors)}
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        for s in self.state.values():
            if "step" in s and not torch.is_tensor(s["step"]):
                s["step"] = torch.tensor(float(s["step"]), dtype=torch.float32, device="cpu")

    # ---- state dict -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        if self.tracker is not None:
            sd["conserve"] = self.tracker.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of its torch twin. The twin's ``fused`` / ``capturable`` /
        ``foreach`` say how torch ran the same update: they take this optimizer's values. An option
        that changes the math and is not supported (``amsgrad``...), or a ``"conserve"`` tracker state saved
        for other laws, raises ``ValueError`` before anything is loaded (the optimizer is left as it was)."""
        state_dict = dict(state_dict)
        tracked = state_dict.pop("conserve", None)
        groups = [{**g, **{k: self.defaults[k] for k in _IMPLEMENTATION if k in g and k in self.defaults}}
                  for g in state_dict.get("param_groups", [])]
        for g in groups:
            self._check_group(g)
        if tracked is not None and self.tracker is not None:  # (other laws: raised before anything is loaded)
            self.tracker.check_state(tracked)
        state_dict["param_groups"] = groups
        super().load_state_dict(state_dict)
        if tracked is not None and self.tracker is not None:
            self.tracker.load_state_dict(tracked)

    # ---- tracker conveniences -------------------------------------------------------------------
    def record(self, **scalars) -> None:
        """Attach scalars (e.g. ``loss=loss.detach()``) to the current step's metric row. A key recorded
        again before the next step (that step was skipped, e.g. by ``GradScaler``) keeps the value of the
        step it belongs to (one warning), as ``TrackedOptimizer.record``."""
        tr = self._need_tracker()
        record_once(self, tr, tr.step_count, scalars)

    def flush(self):
        return self._need_tracker().flush()

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def __enter__(self):
        """``with FusedAdamW(..., track=model) as opt:`` closes the tracker (flushing its rows) at the end."""
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def _need_tracker(self) -> Tracker:
        if self.tracker is None:
            raise RuntimeError(f"this {type(self).__name__} tracks no laws: build it with track=model")
        return self.tracker

    # ---- the step -------------------------------------------------------------------------------
    def _hyper(self, group) -> K.Hyper:
        raise NotImplementedError

    def _collect(self, group, done: set):
        """Params with a gradient (each once), their state buffers, steps and fresh-buffer flags."""
        raise NotImplementedError

    def _check_grads(self) -> None:
        """Raise (one line naming the fix) for gradients this update does not take, before anything is
        changed (no state made, no step counted, no weight stepped): sparse ones, complex parameters."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._refuse(p)

    def _refuse(self, p: torch.Tensor) -> None:
        """``_check_grads`` for one parameter with a gradient (one pass over the parameters per step)."""
        if p.grad.is_sparse:
            raise RuntimeError("fused optimizers do not support sparse gradients; use torch.optim.SparseAdam")
        if torch.is_complex(p):
            raise RuntimeError("fused optimizers do not support complex parameters; use torch.optim.AdamW")

    @eager
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (and, when tracking, one row of law values; drift terms on drift steps).

        Runs eagerly under ``torch.compile`` (``torch.compiler.disable``: a compiled training step
        breaks the graph here, so the update is exactly the eager one).  Raises ``RuntimeError`` for
        sparse or complex gradients, and (Adam) for a gradient of another dtype than its parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads()
        tr, fp = self.tracker, self._fp
        if tr is not None:
            tr.check_bound()  # a flush is due in this step: the tracked tensors must still be the model's
            tr.check_outside()  # the weights were left as the last step wrote them
            tr.check_step_gradients()  # (on its cadence) the gradients this step applies, before any decay
        drift_step = tr is not None and tr.is_drift_step()
        snap = None
        if tr is not None and drift_step and fp.rest is not None:  # the Gram-law views, copied only before a drift step
            snap = self._sampler.snapshot(tr.step_count // tr.drift_every, tr.tensors)
        a_of: dict[int, float] = {}
        done: set = set()
        work = []  # (hyper, triton, tracked ids, bucket lists) per (group, device, dtype, path)
        for group in self.param_groups:
            h = self._hyper(group)
            params, grads, b1, b2, steps, fresh = self._collect(group, done)
            if not params:
                continue
            buckets = defaultdict(list)
            for j, p in enumerate(params):
                tri = choose_backend(self.backend, [p]) == "triton" and K.triton_eligible(p, [grads[j], b1[j], b2[j]])
                buckets[(p.device, p.dtype, tri)].append(j)
            for (dev, dt, tri), js in buckets.items():
                sub = lambda xs: [xs[j] for j in js] if xs else xs  # noqa: E731
                ids = [self._tracked.get(id(params[j]), -1) if tr is not None else -1 for j in js]
                for i in ids:
                    if i >= 0:
                        a_of[i] = h.a_exact  # the statistics use h.a (fp32); _record corrects to a_exact
                work.append((h, tri, ids, sub(params), sub(grads), sub(b1), sub(b2), sub(steps), sub(fresh)))
        # the step statistics live for this step only: quantity 0 (h(new)) between drift steps, all four
        # on drift steps and wherever the Triton kernel writes them
        stats = folds = None
        if tr is not None:
            tri = any(w[1] for w in work)
            rows = K.NQ if drift_step or tri else 1
            if fp.idx is None and not tri:  # CPU torch twin: each tensor's lines folded after its step
                folds = _Folds(fp, tr.tensors, rows, self._acc, set(a_of), tr.device)
            else:  # one buffer of every line (Triton writes it in one launch; the CUDA finish reads it)
                stats = torch.zeros(rows, max(1, fp.n_slots), device=tr.device, dtype=self._acc)
        self._early = None
        if snap is not None and self.overlap:
            # the overlap ordering: the tensors the DRIFT pass reads are stepped first; their pass runs
            # (on CUDA: on a side stream, after an event of this stream) while the rest is stepped; the
            # join comes before the terms are assembled in _record (see _drift_early)
            head, tail = _split_work(work, self._snap_tensors(snap))
            scratch = self._step_work(head, stats, drift_step, None, folds)
            job = self._drift_early(snap, a_of)
            try:
                scratch = self._step_work(tail, stats, drift_step, scratch, folds)
            except BaseException:
                self._join_early(job)  # the side stream is joined, nothing of the step is kept
                self._early = None
                raise
            self._join_early(job)
            if job.error is not None:  # the pass failed: every weight is stepped, no row is recorded
                self._early = None
                raise job.error
        else:
            scratch = self._step_work(work, stats, drift_step, None, folds)
        if tr is not None:
            del scratch  # the old/Delta buffers: dropped before the drift pass and the terms
            vals = self._finish(a_of, stats, folds)
            del stats, folds  # the statistics: dropped once summed into the plan's entries
            self._record(a_of, vals, snap, drift_step)
        return loss

    def _step_work(self, work, stats, drift_step: bool, scratch, folds=None):
        """Step the buckets ``work`` (see ``step``) in order; returns the torch twin's scratch buffers.
        ``folds`` (``_Folds``): the twin writes each tracked tensor's lines into a buffer of its own,
        folded into the entries after its step; else into ``stats``."""
        fp = self._fp
        for h, tri, ids, ps, gs, m1, m2, st, fr in work:
            reqs = [fp.reqs[i] if i >= 0 else K.StatsRequest() for i in ids]
            if tri:
                K.step_triton(h, ps, gs, m1, m2, st, reqs, stats, fresh=fr, cache=self._layouts,
                              interpret=ps[0].device.type != "cuda")
            else:  # one tensor at a time, in blocks of rows (kernels.optim_step.step_stats_reference); on
                # drift steps each block's old copy and Delta live in two block-sized scratch buffers
                # reused across blocks and tensors, dropped after the step
                for k, p in enumerate(ps):
                    i = ids[k]
                    req, out = reqs[k], stats
                    if folds is not None and i >= 0 and req.any:
                        req, out = fp.local_reqs[i], folds.lines(i)
                    if drift_step and req.any:
                        scratch = self._scratch(scratch, p)
                    K.step_stats_reference(h, p, gs[k], m1[k], m2[k], st[k], bool(fr[k]) if fr else False, req,
                                           out, drift=drift_step, bound=self._chunk, scratch=scratch)
                    if out is not stats:
                        folds.done(i, out)
                    del out
        return scratch

    # ---- the overlap ordering (overlap=True) ------------------------------------------------------
    @staticmethod
    def _snap_tensors(snap) -> set:
        """Tracked tensors the snapshot's plan reads (the DRIFT pass's inputs)."""
        p = snap.plan
        return {snap.sources[t.view.tensor] for t in (*p.grams, *p.norms, *p.sums)}

    def _drift_early(self, snap, a_of: dict) -> "_EarlyDrift":
        """The DRIFT pass of ``snap``, started once its tensors are stepped: the arguments ``_record``
        would pass (same ``a``, same decay flag), so the pieces are the same bits.  CUDA with the Triton
        pass (or a stream api set for a test): the host-to-device copies of the pass (table binding,
        factors) are done here on the main stream, then the launches go to the side stream after a fork;
        elsewhere (CPU, the torch twin) it runs here, before the rest of the step.  An exception is kept (raised after the rest is stepped)."""
        tr = self.tracker
        a = [float(a_of.get(i, 1.0)) for i in range(len(tr.tensors))]
        decay = tr.assembly.needs_kernel_decay(a, self._mask_host(snap))
        fa = self._sampler.factors(snap, a)
        news = self._sampler.news(snap, tr.tensors)
        job = _EarlyDrift(snap, (tuple(a), decay))
        # on CUDA only a Triton pass goes to the side stream: the torch twin caches per-plan index
        # structures (``reference``) that the every-step evaluation on the caller's stream reuses, so
        # built on the side stream their blocks would return to its pool while the caller's stream may
        # still read them (``tests/test_fused_overlap.py``, ownership checks); a test's fake api keeps both
        side = self._side_stream() if self._stream_api is not None or choose_backend(tr.backend, news) == "triton" else None
        try:
            if side is None:
                job.pieces = _pass(snap, news, fa, tr, decay)
            else:
                cfg = self._drift_config
                kernels.prepare_drift(snap.plan, snap.olds, news, fa, fp64=tr.fp64, backend=tr.backend, config=cfg)
                job.main = side.fork()
                with side.on_side():
                    job.pieces = _pass(snap, news, fa, tr, decay, cfg)
        except Exception as e:  # noqa: BLE001 - re-raised by step once every weight is stepped
            job.error = e
        return job

    def _join_early(self, job: "_EarlyDrift") -> None:
        """Main stream waits on the side stream; the pieces (allocated there) are recorded on the main
        stream; ``_record`` takes them (``_drift_pass``)."""
        if job.main is not None:
            self._side.join(job.main, job.pieces)
            job.main = None
        self._early = job

    def _side_stream(self):
        """The side stream of the tracker's device (CUDA, or ``_stream_api`` set: a test's recording
        fake); None: no streams, the pass runs in place."""
        if self._side is None:
            api = self._stream_api
            if api is None and torch.device(self.tracker.device).type == "cuda":
                api = streams.CUDA
            if api is None:
                return None
            if api is streams.CUDA:
                _warn_overlap_cuda()
            self._side = streams.SideStream(self.tracker.device, api)
            if self._drift_config == "auto":
                # grid of the pass beside the step kernel: at most one DRIFT program per SM at a time
                # (kernels/README.md, "Overlap with the step"); the step kernel keeps the rest of each SM
                dev = torch.device(self.tracker.device)
                sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
                self._drift_config = kernels.Config(drift_programs=sms)
        return self._side

    def _drift_pass(self, snap, news, a, mask):
        """The DRIFT pieces of ``snap`` for ``_record``: those ``_drift_early`` computed for this very
        snapshot and these arguments, else computed now (the serial ordering)."""
        tr = self.tracker
        job, self._early = self._early, None
        decay = tr.assembly.needs_kernel_decay(a, mask)
        if job is not None and job.snap is snap:  # the pass ran in step(): its snapshot is donated (Delta)
            if job.key != (tuple(a), decay) or job.pieces is None:
                raise RuntimeError("conserve internal error: the overlapped DRIFT pass ran with other arguments "
                                   "than the step's terms need; pass overlap=False and report it")
            return job.pieces
        return _pass(snap, news, self._sampler.factors(snap, a), tr, decay)

    def _compact_terms(self, pieces, a, mask: Mask, group: Mask, vals: torch.Tensor):
        """A drift step's terms in the compact layout of ``mask``'s entries (``Layout.entries``: every
        entry the statistics cover, and the group's Gram slots; no law-sized buffer over the other
        groups' slots), from the group's compact DRIFT pieces (``group``: the snapshot's mask, whose
        entries they hold) and the statistics taken at those entries."""
        tr = self.tracker
        at = tr.layout.entries(mask, tr.assembly)
        pos = self._compact_pos.get(mask.key) if mask.key is not None else None
        if pos is None:
            mine, ours = np.flatnonzero(group.vec_np), np.flatnonzero(mask.vec_np)
            same = len(mine) == len(ours)  # (then the same entries: the group's are among the step's)
            pos = (None if same else torch.from_numpy(np.searchsorted(ours, mine)).to(tr.device),)
            if mask.key is not None:
                self._compact_pos[mask.key] = pos
        n = at.layout[1]
        pieces = [None] + [_expand(x, pos[0], n) for x in pieces[1:]]
        take = lambda x: None if x is None else x[at.vec]  # noqa: E731
        return tr.assemble(pieces, a, mask, compact=True, stats=StepStats(take(vals[1]), take(vals[2]), take(vals[3])))

    def _scratch(self, scratch, p: torch.Tensor):
        """Two flat buffers (old weights, Delta) of one block (``self._chunk`` elements at most)."""
        if scratch is None or scratch[0].dtype != p.dtype or scratch[0].device != p.device:
            n = min(self._chunk, max(t.numel() for t in self.tracker.tensors))
            scratch = (torch.empty(n, dtype=p.dtype, device=p.device), torch.empty(n, dtype=self._acc, device=p.device))
        return scratch

    def _mask(self, snap) -> Mask:
        """Entries a drift step decomposes: every entry the step statistics cover, except those that
        also read a Gram/unmapped term outside the snapshot's group; the group's Gram slots."""
        vm, gm = self._mask_arrays(snap)
        return make_mask(vm, gm, self.tracker.device, ("fused", None if snap is None else snap.mask.key))

    def _mask_arrays(self, snap):
        """The host bool arrays of ``_mask``: ``(vec entries, {D: Gram slots})``."""
        fp = self._fp
        if snap is None:
            vm = np.ones(len(fp.rest_vec), dtype=bool)
            gm = {d: np.ones(n, dtype=bool) for d, n in self.tracker.compiled.plan.gram_slots.items()}
        else:
            vm, gm = snap.mask.vec_np | ~fp.rest_vec, snap.mask.gram_np
        return vm, gm

    def _mask_host(self, snap) -> Mask:
        """``_mask`` without its device copies (what ``Assembly.needs_kernel_decay`` reads: no host->device
        copy before the side stream's launches)."""
        vm, gm = self._mask_arrays(snap)
        return Mask(vm, dict(gm), None, None, bool(vm.all() and all(m.all() for m in gm.values())))

    def _finish(self, a_of: dict[int, float], stats: torch.Tensor | None, folds=None) -> torch.Tensor:
        """The plan entries ``(rows of stats, vec_size)`` of this step's statistics (tracked tensors that
        were not stepped -- no grad, not in any group -- added with ``Delta = 0``): ``folds``' (the torch
        twin's), else from the one buffer ``stats``."""
        fp = self._fp
        if folds is not None:
            return folds.finish()
        for i, t in enumerate(self.tracker.tensors):
            if i not in a_of and fp.reqs[i].any:
                K.stats_reference(None, t, 1.0, fp.reqs[i], stats)
        if fp.idx is not None:  # deterministic (CUDA)
            return K.finish_reference(stats, fp.idx, fp.coef[: stats.shape[0]])
        vals = torch.zeros(stats.shape[0], fp.n_entries, dtype=stats.dtype, device=stats.device)
        for (g0, n, _, _), f in zip(fp.groups, fp.folds):  # CPU (a Triton step): group by group, in order
            K.fold(vals, stats.narrow(1, g0, n), f)
        return vals

    def _record(self, a_of: dict[int, float], vals: torch.Tensor, snap=None, drift_step: bool = False) -> None:
        """Book the step: ``drift_step`` is ``step()``'s ``tracker.is_drift_step()`` (the statistics rows
        it allocated follow it)."""
        tr, fp = self.tracker, self._fp
        dev, dt = tr.device, vals.dtype

        def h_new() -> Values:  # evaluated after the DRIFT pass: the snapshot is freed by then
            if fp.rest is not None:  # h(new) = the statistics' entries + the rest plan's evaluation
                h_rest = Values(*kernels.evaluate(fp.rest, [t.detach() for t in tr.tensors], fp64=tr.fp64,
                                                  backend=tr.backend))
                return Values(h_rest.vec.add_(vals[0]), h_rest.grams)
            # a copy of a drift step's row: a view would keep all four statistics rows alive as tracker.h
            return Values(vals[0] if vals.shape[0] == 1 else vals[0].clone(), {d: torch.zeros(n, d, d, device=dev, dtype=dt)
                                            for d, n in tr.compiled.plan.gram_slots.items()})
        if not drift_step:
            tr.record_step(h_new(), None)
            return
        a = [float(a_of.get(i, 1.0)) for i in range(len(tr.tensors))]
        mask = self._mask(snap)
        pieces = None  # no DRIFT pass: every term this step comes from the step statistics
        compact = snap.mask if snap is not None and snap.compact else None  # the pieces hold its entries only
        if snap is not None:
            news = self._sampler.news(snap, tr.tensors)
            pieces = list(self._drift_pass(snap, news, a, mask))  # computed in step() under overlap=True
            snap.olds.clear()
            del snap, news
        # the one assembly (Tracker.assemble -> Assembly.terms): the statistics' terms (rows 1, 2; their
        # per-term decay, row 3) join the pass's, at the exact a (the statistics use a rounded to fp32)
        if pieces is not None and compact:
            terms = self._compact_terms(pieces, a, mask, compact, vals)
        else:
            terms = tr.assemble(pieces, a, mask, stats=StepStats(vals[1], vals[2], vals[3]))
        h1 = h_new()
        del pieces, vals
        tr.record_step(h1, terms, mask)


def _compact_pays(sampler: Sampler, plan: Plan) -> bool:
    """Whether the partial groups' drift steps are cheaper in memory in the compact layout
    (``_compact_terms``; same bits) than in the full one: it saves the 8 law-layout rows (3 DRIFT pieces,
    5 scratch rows) over the Gram entries of the other groups, and adds about 6 vec-sized rows (the
    pieces' and the statistics' vec parts at the step's entries) and, held per group, two int32 indices
    of those entries.  Counted in entries; e.g. a ViT of 50k parameters (head_dim 16, hidden 64: 4096
    Gram entries, 385 vec entries, 16 groups) pays, ``conserve run``'s model (768 / 433, 4 groups) does not."""
    n, vec = len(sampler.groups), plan.vec_size
    if n < 2:
        return False
    grams = sum(k * d * d for d, k in plan.gram_slots.items())
    return 8 * (grams - max(sampler.gram_entries())) > (6 + 2 * n) * vec


def _expand(piece, pos, n: int):
    """A compact piece ``(vec, {D: grams})`` over a group's entries as one over the drift step's
    (``pos``: the group's vec entries among the step's; the Gram slots are the same): zeros elsewhere."""
    if piece is None:
        return None
    v, g = piece
    if pos is not None:
        v = torch.zeros(n, dtype=v.dtype, device=v.device).index_copy_(0, pos, v)
    return v, g


class _Folds:
    """The plan entries of one torch-twin step, folded group by group (``_FusedPlan.groups``,
    ``K.fold``): ``lines(i)`` is the zeroed ``(rows, lines)`` buffer of tensor ``i``'s group (its lines
    at ``local_reqs[i]``), ``done(i, buf)`` says tensor ``i`` is stepped.  A group is folded once its
    tensors are stepped and every group before it is folded (a group stepped early waits; a tracked
    tensor this step does not step -- no grad -- is measured when its group is folded: it does not
    change during the step), so the entries' bits do not depend on the stepping order (the overlap
    ordering's) and, stepped in index order, one group's lines are alive at a time."""

    __slots__ = ("fp", "tensors", "rows", "acc", "stepped", "device", "vals", "bufs", "left", "next", "index")

    def __init__(self, fp: _FusedPlan, tensors, rows: int, acc, stepped: set, device):
        self.fp, self.tensors, self.rows, self.acc, self.stepped, self.device = fp, tensors, rows, acc, stepped, device
        self.bufs: dict[int, torch.Tensor] = {}
        self.left = [{i for i in members if i in stepped} for _, _, _, members in fp.groups]
        self.next = 0
        # the result and the int32 buffer of the widened entry indices: made at the first fold (a model
        # of one group holds neither while its weights are stepped)
        self.vals = self.index = None

    def lines(self, i: int) -> torch.Tensor:
        g = self.fp.group_of[i]
        buf = self.bufs.get(g)
        if buf is None:
            buf = self.bufs[g] = torch.zeros(self.rows, self.fp.groups[g][1], dtype=self.acc, device=self.device)
        return buf

    def done(self, i: int, buf: torch.Tensor) -> None:
        self.left[self.fp.group_of[i]].discard(i)
        self._advance()

    def _advance(self) -> None:
        fp = self.fp
        while self.next < len(fp.groups) and not self.left[self.next]:
            g = self.next
            buf = self.bufs.pop(g, None)
            if buf is None:
                buf = torch.zeros(self.rows, fp.groups[g][1], dtype=self.acc, device=self.device)
            for i in fp.groups[g][3]:  # not stepped this step: h(new) of its current values, Delta = 0
                if i not in self.stepped:
                    K.stats_reference(None, self.tensors[i], 1.0, fp.local_reqs[i], buf)
            if self.vals is None:
                self.vals = torch.zeros(self.rows, fp.n_entries, dtype=self.acc, device=self.device)
                self.index = torch.empty(fp.max_index, dtype=torch.int32, device=self.device)
            K.fold(self.vals, buf, fp.folds[g], self.index)
            del buf
            self.next += 1

    def finish(self) -> torch.Tensor:
        """The ``(rows, vec_size)`` entries, once every tensor is stepped."""
        self._advance()
        if self.next != len(self.fp.groups):
            raise RuntimeError("conserve internal error: a tracked tensor was stepped without its statistics; "
                               "report it")
        if self.vals is None:  # no statistics (no tensor with row / column terms)
            self.vals = torch.zeros(self.rows, self.fp.n_entries, dtype=self.acc, device=self.device)
        self.index = None
        return self.vals


def _pass(snap, news, a, tr: Tracker, decay: bool, config=None):
    """The DRIFT pass of a snapshot (one call for both orderings): the snapshot copies are the step's
    own, so the pass may form Delta in them (``donate``); ``h(new)`` comes from the every-step evaluation."""
    return drift_pieces(snap.plan, snap.olds, news, a, fp64=tr.fp64, backend=tr.backend, decay=decay, donate=True,
                        values=False, config=config)


class _EarlyDrift:
    """One DRIFT pass started inside ``step`` (overlap ordering): its snapshot, the key of its arguments
    (``(a, decay)``), the pieces, the main stream to join (None once joined / without streams), and
    the exception it raised, if any."""

    __slots__ = ("snap", "key", "pieces", "main", "error")

    def __init__(self, snap, key):
        self.snap, self.key, self.pieces, self.main, self.error = snap, key, None, None, None


def _split_work(work, first: set):
    """``work`` split into the buckets of the tracked tensors in ``first`` and the others (bucket order
    and the order inside a bucket kept; empty buckets dropped)."""
    head, tail = [], []
    for item in work:
        h, tri, ids = item[:3]
        lists = item[3:]
        for out, keep in ((head, True), (tail, False)):
            js = [j for j, i in enumerate(ids) if (i in first) == keep]
            if js:
                sub = lambda xs: [xs[j] for j in js] if xs else xs  # noqa: E731
                out.append((h, tri, [ids[j] for j in js], *[sub(x) for x in lists]))
    return head, tail


def _params_with_grad(group, done: set):
    out = []
    for p in group["params"]:
        if p.grad is None or id(p) in done:
            continue  # (the gradients were checked before the step changed anything: ``_check_grads``)
        done.add(id(p))
        out.append(p)
    return out


def _scalar(x) -> float:
    return float(x.item()) if torch.is_tensor(x) else float(x)


# ------------------------------------------------------------------------------------- Adam
class FusedAdam(FusedOptimizer):
    """Adam (``decoupled_weight_decay=False``: L2 added to the gradient) / AdamW with the laws measured
    in the same pass.  Same arguments, defaults, state and math as ``torch.optim.Adam``, plus the
    tracking arguments (see the module docstring): ``track`` (the model), ``laws`` + ``named_params``,
    and ``Tracker`` keywords.

    Raises ``ValueError`` at construction (or ``add_param_group`` / ``load_state_dict``) for
    ``amsgrad``, ``capturable``, ``differentiable`` or ``fused`` set to True: use ``torch.optim.Adam``
    with ``conserve.track`` for those.  ``foreach`` is accepted and ignored.

    ``overlap`` (tracking only; default False): keep it off on CUDA, where the overlap ordering is not
    shown bit-identical to the serial one and was not faster; it warns once there (module docstring,
    "Overlap").
    """

    _algo = "adam"
    _refused = ("amsgrad", "capturable", "differentiable", "fused")

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False, track: nn.Module | None = None,
                 laws=None, named_params: Mapping[str, torch.Tensor] | None = None, **tracker_kwargs: Any):
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= _scalar(betas[0]) < 1.0 or not 0.0 <= _scalar(betas[1]) < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        self._setup_tracking(track, laws, named_params, tracker_kwargs)
        super().__init__(params, defaults)
        self._ready_tracking()

    def _hyper(self, group) -> K.Hyper:
        self._check_group(group)
        b1, b2 = group["betas"]
        return K.Hyper("adam", lr=_scalar(group["lr"]), weight_decay=float(group["weight_decay"]),
                       maximize=bool(group["maximize"]), beta1=_scalar(b1), beta2=_scalar(b2), eps=float(group["eps"]),
                       decoupled=bool(group.get("decoupled_weight_decay", False)))

    def _refuse(self, p: torch.Tensor) -> None:
        super()._refuse(p)
        if p.grad.dtype != p.dtype:  # (torch's grad_dtype: fp32 grads of bf16 weights)
            raise RuntimeError(f"{type(self).__name__}: a {str(p.dtype)[6:]} parameter {tuple(p.shape)} has a "
                               f"{str(p.grad.dtype)[6:]} gradient; Adam keeps exp_avg / exp_avg_sq in the "
                               "parameter's dtype (as torch.optim.AdamW): give the gradient the parameter's "
                               "dtype (p.grad_dtype = None) or keep the parameter in float32")

    def _collect(self, group, done):
        params = _params_with_grad(group, done)
        grads, m, v, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if steps:
            torch._foreach_add_(steps, 1.0)
        return params, grads, m, v, [float(s) for s in steps], []


    def decay_factor(self, group) -> float | torch.Tensor:
        """``a`` in ``theta_{k+1} = a theta_k + Delta`` for ``group`` (read by ``conserve.tracking.breakers``):
        ``1 - lr * weight_decay`` with decoupled weight decay, else 1 (L2 is inside ``Delta``).  The step
        reads a tensor ``lr`` as a double (``float(lr)``), so the factor is formed in float64."""
        wd = group.get("weight_decay", 0.0) or 0.0
        if not wd or not group.get("decoupled_weight_decay", False):
            return 1.0
        lr = group.get("lr", 0.0)
        return 1.0 - (lr.double() if torch.is_tensor(lr) else lr) * wd


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default 1e-2) with the laws measured in the same pass; see
    ``FusedAdam`` and the module docstring.  State dicts load into ``torch.optim.AdamW`` and back."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, track: nn.Module | None = None, laws=None,
                 named_params: Mapping[str, torch.Tensor] | None = None, **tracker_kwargs: Any):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, track=track, laws=laws, named_params=named_params,
                         **tracker_kwargs)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


# -------------------------------------------------------------------------------------- SGD
class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, nesterov, coupled weight decay, maximize) with the laws measured in
    the same pass.  Same arguments, defaults, state (``momentum_buffer``) and math as
    ``torch.optim.SGD``, plus the tracking arguments (module docstring).  ``differentiable`` and
    ``fused`` set to True are refused (``ValueError``); ``foreach`` is accepted and ignored.
    ``overlap`` (tracking only; default False): keep it off on CUDA, where the overlap ordering is not
    shown bit-identical to the serial one and was not faster; it warns once there (module docstring,
    "Overlap").

    Decay factor of the drift decomposition: ``1 - lr*weight_decay`` without momentum (the step is
    exactly ``(1 - lr wd) theta - lr g``), 1 with momentum (the decay is inside ``Delta``), as
    ``conserve.tracker.decay_factor``.
    """

    _algo = "sgd"
    _refused = ("differentiable", "fused")

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 track: nn.Module | None = None, laws=None, named_params: Mapping[str, torch.Tensor] | None = None,
                 **tracker_kwargs: Any):
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if _scalar(lr) < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        self._setup_tracking(track, laws, named_params, tracker_kwargs)
        super().__init__(params, defaults)
        self._ready_tracking()

    def _hyper(self, group) -> K.Hyper:
        self._check_group(group)
        return K.Hyper("sgd", lr=_scalar(group["lr"]), weight_decay=float(group["weight_decay"]),
                       maximize=bool(group["maximize"]), momentum=float(group["momentum"]),
                       dampening=float(group["dampening"]), nesterov=bool(group["nesterov"]))

    def _collect(self, group, done):
        params = _params_with_grad(group, done)
        grads, bufs, fresh = [], [], []
        mom = group["momentum"] != 0
        for p in params:
            grads.append(p.grad)
            if mom:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                fresh.append(buf is None)
                if buf is None:
                    buf = state["momentum_buffer"] = torch.empty_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(buf)
        n = len(params)
        return params, grads, bufs if mom else [None] * n, [None] * n, [0.0] * n, fresh if mom else []

    def decay_factor(self, group) -> float | torch.Tensor:
        """``a`` in ``theta_{k+1} = a theta_k + Delta`` for ``group`` (read by ``conserve.tracking.breakers``):
        without momentum the L2 term gives exactly ``(1 - lr wd) theta - lr g``, so ``1 - lr * weight_decay``
        (a tensor ``lr`` read as a double, as the step reads it); with momentum 1 (the decay is inside ``Delta``)."""
        wd = group.get("weight_decay", 0.0) or 0.0
        if not wd or group.get("momentum", 0.0):
            return 1.0
        lr = group.get("lr", 0.0)
        return 1.0 - (lr.double() if torch.is_tensor(lr) else lr) * wd
