"""The tracker: law values, the paper's error and the exact drift decomposition, step by step.

Data flow: laws -> ``compile_laws`` -> one kernel plan -> per-step values on the device -> a row of
metrics per step, kept on the device and flushed to the sinks every ``every`` steps (one host sync).

Per step k -> k+1 (spec "Discrete steps: the exact drift identity"), writing ``theta_{k+1} = a theta_k +
Delta`` with ``a`` the decoupled decay of each parameter (``1 - lr*wd`` for AdamW and plain SGD, else 1):

    h_{k+1} - h_k = [h(a theta_k) - h(theta_k)] + 2 B(a theta_k, Delta) + B(Delta, Delta)
                      decay                        first order            second order

(linear laws: first order ``c . Delta``, no second order). Each term is computed directly, not as a
residual, so ``residual = measured - (decay + first + second)`` checks the identity at run time.

Metric keys: ``eps/<family>``, ``eps/<family>/layer<i>``, ``drift/<family>/{measured,decay,first,
second,residual}`` (Euclidean norm over the family's entries, Frobenius for Gram laws), and whatever
``record(**scalars)`` adds. The error ``eps`` (spec "The paper's error metric") is the mean over a
family's instances of ``||h_i(theta_k) - h_i(theta_0)|| / ||h_i(theta_0)||``; an instance whose
``||h_i(theta_0)||`` is below ``1e-4`` times its magnitude (the same sum with every sign +) uses that
magnitude as denominator instead (guard for laws that start balanced).
"""
from __future__ import annotations

import atexit
import copy
import math
import numbers
import sys
import weakref
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from . import kernels
from .wrappers import unwrap
from .errors import NonFiniteError, StaleParameterError, warn
from .laws import Compiled, Declined, Law, compile_laws
from .tracking.breakers import (check_frozen, check_optimizer, decay_factor,  # noqa: F401  (decay_factor: re-exported)
                                 per_param_decay)
from .tracking.drift import Assembly, Mask, Sampler, StepStats, drift_pieces

GUARD = 1e-4
TERMS = ("measured", "decay", "first", "second", "residual")
CUMULATIVE = TERMS[:4]  # the terms ``cumulative`` sums
NONFINITE_POLICIES = ("raise", "warn", "skip")
DRIFT_EVERY = 4  # drift cadence of the sampled mode (see Tracker)
SNAPSHOT_BUDGET = 0.04  # bytes copied before a drift step in the sampled mode, as a fraction of the tracked bytes
EXACT_MAX_BYTES = 16 * 2**20  # tracked weights up to this size get the exact mode by default (see Tracker)
AUTO = "auto"  # ``drift_every`` / ``snapshot_budget`` chosen from the tracked bytes (see Tracker)


EAGER_REASON = ("conserve's tracking and fused optimizer steps run eagerly, outside torch.compile graphs: compile the "
                "training step without fullgraph=True (torch.optim's own step breaks the graph too)")


def eager(fn):
    """``torch.compiler.disable(fn)``, with the reason dynamo prints when ``fullgraph=True`` refuses it
    (its default hint, "remove the torch.compiler.disable call", is not the user's fix)."""
    try:
        return torch.compiler.disable(fn, reason=EAGER_REASON)
    except TypeError:  # torch without the reason argument
        return torch.compiler.disable(fn)


def _abs_plan(plan: kernels.Plan) -> kernels.Plan:
    return kernels.Plan([replace(t, sign=abs(t.sign)) for t in plan.grams],
                        [replace(t, sign=abs(t.sign)) for t in plan.norms],
                        [replace(t, sign=abs(t.sign)) for t in plan.sums], plan.vec_size, dict(plan.gram_slots))


_MAX_RUNS = 16  # a tracker holds its vec entries' instances as stretches up to this many (``_index_runs``)


def _index_runs(idx: np.ndarray, device) -> tuple[list | None, torch.Tensor | None]:
    """``idx`` (an index array) as at most ``_MAX_RUNS`` stretches ``(start, length, first, each)``: entries
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
        if len(runs) > _MAX_RUNS:
            return None, None
        k = j
    longest = max([r[1] for r in runs if not r[3]], default=0)
    if longest > max(1, n // 8):
        return None, None
    return runs, torch.zeros(longest, dtype=torch.int32, device=device)


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


def record_value(key: str, v):
    """A ``record(key=v)`` value as a row holds it: a detached one-element tensor (kept on its device,
    reshaped to ``()``), a Python ``int``/``float``/``bool`` (numpy scalars and one-element arrays
    converted), a ``str`` or None. Checked at ``record`` time, so a value no sink can write never
    reaches (and blocks) the sinks. Raises ``ValueError`` for a tensor/array of several elements,
    ``TypeError`` for anything else, ``ValueError`` for the key ``step`` (the row's own step number:
    another value there would misplace the row in every sink and in a resume's cut)."""
    if key == "step":
        raise ValueError("record(step=...): 'step' is the tracker's own step number, the row's key; record your "
                         "counter under another name (e.g. global_step=...)")
    if torch.is_tensor(v) or isinstance(v, np.ndarray):
        if (v.numel() if torch.is_tensor(v) else v.size) != 1:
            raise ValueError(f"record({key}=...): a {type(v).__name__} of shape {tuple(v.shape)}; record one number "
                             f"per key (e.g. {key}=x.mean(), or one key per element)")
        return v.detach().reshape(()) if torch.is_tensor(v) else record_value(key, v.item())
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"record({key}=...): {type(v).__name__} is not a number; record a float, an int or a "
                    "one-element tensor")


class Tracker:
    """Evaluate laws after every optimizer step; keep ``h_0``, ``eps`` and the drift terms on the device.

    Args:
        model: the module whose laws are tracked (``model.conservation_laws()`` if it has it, else
            ``conserve.detect(model)``), unless ``laws`` is given.
        laws: explicit list of ``Law`` (parameter names as in ``model.named_parameters()``), or a
            ``Detection`` (``conserve.detect(model, loss="ce")``: detection options such as the loss;
            its ``declined`` are kept).
        every: flush period in steps (host sync and sink writes happen only then: when the next step
            finds ``every`` rows pending, and at ``flush()``/``close()``).
        sinks: objects with ``write(step, metrics: dict[str, float])`` and ``close()``.
        drift: compute the three drift terms (False: never; ``eps`` and the law values are still
            evaluated every step).
        drift_every: decompose the drift on every ``drift_every``-th step (steps 1, 1 + N, 1 + 2N, ...);
            the other steps log ``eps`` and NaN drift columns.  Default ``"auto"``: the exact mode (1, with
            ``snapshot_budget=None`` and the cumulative sums kept: every law decomposed on every step) when the
            tracked weights (``tracked_bytes``: the parameters the laws read, whole) are at most
            ``EXACT_MAX_BYTES`` = 16 MiB, else the sampled mode (``DRIFT_EVERY`` = 4, ``SNAPSHOT_BUDGET`` = 0.04).
            The step time is not what bounds the exact mode (the drift pass and the training step both follow
            the bytes: ``python -m bench.exact_threshold`` prints exact / sampled step ratios, figures in the
            README); the memory is: the exact mode holds a copy of the whole tracked weights while each step
            runs (the sampled mode 0.04 of them) and 4 law-sized cumulative copies for the run, so the default
            keeps it to small models.  With the snapshot budget each law is decomposed
            once every ``drift_every * len(sampler.groups)`` steps.  An explicit value always wins: giving
            ``drift_every`` or ``snapshot_budget`` chooses the cadence, and the other one, left at ``"auto"``,
            takes the sampled mode's value (``drift_every=1`` alone: every step, one group of laws per step).
        snapshot_budget: bytes copied right before a drift step, as a fraction of the tracked bytes
            (``None``: every law on every drift step, whole tensors copied, 1x the tracked bytes while the step
            runs; default ``"auto"``: ``None`` in the exact mode (``drift_every`` not given either, at most
            ``EXACT_MAX_BYTES`` of tracked weights), else 0.04, ``SNAPSHOT_BUDGET``).  With a budget, a drift
            step decomposes one group of laws (round robin, ``conserve.tracking.drift.Sampler``): its
            ``drift/<family>/*`` columns are norms over the family's decomposed entries only (NaN for a
            family with none that step), and ``totals()`` says how many (with ``cumulative=True``, it also
            sums the terms per entry over the decomposed (entry, step) pairs).  No weight-sized buffer is held
            between steps.
        fp64: accumulate in float64.
        keep_last: keep the last drift step's per-entry terms in ``last`` (``{"measured", "decay", "first",
            "second", "residual"}``, each a ``Values``; 5 law-sized copies held between steps).  Default
            False: ``last`` is an empty ``NotKept`` dict whose items raise a ``KeyError`` naming this
            option; the metric rows, ``cumulative`` and ``totals()`` are the same either way.
        cumulative: keep ``cumulative``, the per-entry sums of the ``measured``/``decay``/``first``/``second``
            terms over the decomposed (entry, step) pairs (4 law-sized copies held for the whole run:
            on ``conserve run``'s 62.8k-parameter model 0.088x the tracked bytes).  ``None`` (default):
            kept only when every (entry, step) pair is decomposed (``drift`` with ``drift_every=1`` and
            ``snapshot_budget=None``, the exact mode); ``True``: always; ``False``: never.  Without
            them ``totals()`` has no per-entry decomposition (no ``decay``/``first``/``second``/
            ``predicted``/``predicted_no_first``/``measured_sampled``): it gives ``measured`` (from
            ``h`` and ``h_0``), ``eps``, the guards and, per family, ``sum_step_<term>``, the sum over
            the drift steps of each step's family norm (a sum of norms: an upper bound of the norm of
            the summed term, not that norm), with ``cumulative: False``; ``cumulative`` is then an empty
            ``CumulativeNotKept`` dict whose items raise a ``KeyError`` naming this option.
        backend: 'auto' (Triton on CUDA, torch on CPU), 'torch' or 'triton' (see ``conserve.kernels``).
        monitors: extra metric sources with ``update()`` (after each step) and ``metrics() -> dict``.
        on_nonfinite: what a flush does with a row whose law values are NaN/Inf (the parameters
            diverged, e.g. after NaN/Inf gradients were applied): ``"raise"`` (default) writes the finite rows
            of the flush and raises ``NonFiniteError`` naming the first non-finite step and how many
            more (those rows are not written; counted in ``nonfinite_skipped``).  A flush due inside
            ``optimizer.step()`` raises after that step is booked, and the non-finite rows of the steps
            booked before the error reached the caller are not reported again, so a caller who catches
            it, repairs the weights and goes on loses no step and gets one error per divergence; ``"warn"`` writes every row (NaN
            as null in JSONL) and warns once; ``"skip"`` writes the finite rows only, counts the others
            in ``nonfinite_skipped`` and warns once. Steps keep their numbers in every case.

    The model changing under the tracker: a tracked parameter replaced (``module.weight = nn.Parameter(...)``,
    ``load_state_dict(..., assign=True)``, a replaced module, ``parametrize``/``prune``, another shape) makes
    the next step whose booking flushes raise ``StaleParameterError`` before the optimizer changes anything
    (``stale()`` lists them; an explicit ``flush()``/``close()`` writes and warns once); weights written in
    place outside the tracked step (``model.load_state_dict``, a second optimizer, an EMA/LoRA merge) are
    told by one ``RuntimeWarning`` at the next step (``check_outside``: ``eps`` jumps, a drift step's
    ``residual`` holds the change).  In-place changes of layout (``p.data = ...``, same shape), dtype
    (``model.to(torch.float64)``) and ``requires_grad`` keep the tensors: tracked as they are.

    Laws that read a frozen parameter are not tracked: they are listed in ``declined`` with the reason.
    ``broken_by`` ({law name: reason}) lists the laws the optimizer's ``param_groups`` break (different lr or
    weight decay inside one law, a parameter the optimizer does not hold); they are tracked, warned once
    and counted in the ``broken/<family>`` metric (``check_optimizer``, ``conserve.tracking.breakers``).
    A parameter frozen after construction (``requires_grad_(False)``) or dropped from the watched
    optimizer's groups is noticed at the next flush (``check_frozen``): the laws it leaves half frozen are
    marked ``broken_by`` the same way, with one warning naming it.
    Raises ``NonFiniteError`` at a flush when a law value is NaN/Inf (rows before it are written first).

    Cost: one evaluation ``h(theta_{k+1})`` per step (``eps``); on a drift step, a copy of the views
    the decomposed laws read (before the step) and ONE ``conserve.kernels.drift`` pass over them
    (``B(a theta, Delta)``, ``h(Delta)``; the decay is ``(a^2 - 1) h_k`` from the stored values, see
    ``conserve.tracking.drift``).  ``before_step``/``after_step``/``record`` run outside
    ``torch.compile`` graphs (``torch.compiler.disable``), so compiled training steps put no guard on
    the tracker's Python state.

    Lifecycle: ``with Tracker(...) as t:`` closes it on exit; a tracker never closed is flushed and
    closed when it is garbage-collected or at interpreter exit (single process; a
    ``DistributedTracker`` must be closed on every rank). A sink that raises is isolated: the other
    sinks still get the rows, a one-line warning names the sink, step and error, and its unwritten
    rows are kept (``unwritten``) and retried at the next flush and at ``close()``; the step is booked.
    A sink that keeps failing (a full or read-only disk) is owed at most ``max_unwritten`` rows (default
    10,000; a row is a dict of ``len(metric_names)`` floats, ~63 bytes per key measured: 10,000 rows of a
    24-layer Llama's 128 keys hold ~80 MB): beyond that its oldest
    rows are dropped, told once (one line naming the fix) and counted in ``dropped`` ({sink: rows}), in the
    ``sinks/dropped_rows`` key of each later flush's last row (all sinks, as the flush began) and in
    ``close()``'s warning.
    ``copy.deepcopy`` gives an independent tracker without sinks (a snapshot: set ``sinks`` to write).
    """

    def __init__(self, model: nn.Module | None = None, laws: Sequence[Law] | None = None, *, every: int = 50,
                 sinks: Iterable = (), drift: bool = True, fp64: bool = False, backend: str = "auto",
                 monitors: Iterable = (), params: Mapping[str, torch.Tensor] | None = None,
                 on_nonfinite: str = "raise", drift_every: int | str = AUTO,
                 snapshot_budget: float | None | str = AUTO, keep_last: bool = False,
                 cumulative: bool | None = None):
        if every < 1:
            raise ValueError(f"every={every} must be >= 1")
        if isinstance(drift_every, str) and drift_every == AUTO:
            pass
        elif isinstance(drift_every, bool) or not (isinstance(drift_every, numbers.Integral) and drift_every >= 1):
            raise ValueError(f"drift_every={drift_every!r} must be an int >= 1 (use drift=False for no drift terms)")
        else:
            drift_every = int(drift_every)
        if snapshot_budget is not None and not (isinstance(snapshot_budget, str) and snapshot_budget == AUTO):
            if isinstance(snapshot_budget, bool) or not (isinstance(snapshot_budget, numbers.Real)
                                                         and math.isfinite(snapshot_budget) and snapshot_budget > 0):
                raise ValueError(f"snapshot_budget={snapshot_budget!r} must be a finite fraction > 0 of the tracked "
                                 "bytes (>= 1: every law on every drift step), or None")
            snapshot_budget = float(snapshot_budget)
        if not isinstance(keep_last, bool):
            raise ValueError(f"keep_last={keep_last!r} must be True or False")
        if cumulative is not None and not isinstance(cumulative, bool):
            raise ValueError(f"cumulative={cumulative!r} must be True, False or None (None: kept only with "
                             "drift_every=1 and snapshot_budget=None)")
        self.on_nonfinite = on_nonfinite
        named = dict(params) if params is not None else dict(_unwrap(model).named_parameters())
        self.declined: list[Declined] = []
        if laws is None:
            laws, self.declined = _model_laws(_unwrap(model))
        elif hasattr(laws, "laws") and hasattr(laws, "declined"):  # a Detection (conserve.detect(model, loss="ce"))
            laws, self.declined = laws.laws, list(laws.declined)
        laws = list(laws)
        kept = []
        for law in laws:
            frozen = [p for p in law.params if p in named and not named[p].requires_grad]
            if frozen:
                self.declined.append(Declined(law.name, law.family, f"reads frozen parameter(s) {frozen}: "
                                              "unfreeze them or drop the law"))
            else:
                kept.append(law)
        if not kept:
            raise ValueError("no law to track: the model has no detected law on trainable parameters "
                             f"(declined: {[d.reason for d in self.declined][:3]})")
        meta = sorted({p for law in kept for p in law.params if p in named and named[p].is_meta})
        if meta:
            raise ValueError(f"cannot track {meta[0]}" + (f" (and {len(meta) - 1} more)" if len(meta) > 1 else "")
                             + ": it is on the meta device (shapes, no values); materialise the model first "
                             "(model.to_empty(device=...) then load or initialise its weights), then build the tracker")
        self.compiled: Compiled = compile_laws(kept, {k: tuple(v.shape) for k, v in named.items()})
        self.laws = kept
        self.params = [named[n] for n in self.compiled.names]
        # where each tracked parameter lives in the model (checked before a flush: ``stale``); None
        # without a model (``params=``)
        self._bound = weakref.ref(_unwrap(model)) if params is None and model is not None else None
        self._bound_shapes = [tuple(p.shape) for p in self.params]
        self.tensors = self._local_tensors(self.params)
        # the bytes of the tracked weights (whole tensors, the same on every rank): what chooses the mode
        self.tracked_bytes = sum(math.prod(p.shape) * p.dtype.itemsize for p in self.params)
        # neither given: the exact mode for small tracked weights; a cadence given: the other is the sampled mode's
        exact = isinstance(drift_every, str) and isinstance(snapshot_budget, str) \
            and self.tracked_bytes <= EXACT_MAX_BYTES
        if isinstance(drift_every, str):
            drift_every = 1 if exact else DRIFT_EVERY
        if isinstance(snapshot_budget, str):
            snapshot_budget = None if exact else SNAPSHOT_BUDGET
        self.every, self.drift, self.fp64, self.backend = every, drift, fp64, backend
        self.sinks, self.monitors = list(sinks), list(monitors)
        self.device = self.tensors[0].device
        self._build_index()
        self.step_count = 0
        self._rows: list[torch.Tensor] = []
        self._extras: list[dict[str, torch.Tensor]] = []
        self._prev: list[torch.Tensor] | None = None  # (distributed tracker)
        self._a: list[float | torch.Tensor] = [1.0] * len(self.tensors)
        self.drift_every, self.snapshot_budget = drift_every, snapshot_budget
        self._snap = None  # the copies of one drift step: made in before_step, dropped in after_step
        self._sampler: Sampler | None = None
        self._assembly: Assembly | None = None
        self.keep_last = bool(keep_last)
        self.last: dict[str, Values] = {} if self.keep_last else NotKept()
        self._hits: dict = {}  # Mask.key -> (families,) bool: the families a sampler group decomposes
        self._entries_of: dict = {}  # Mask.key -> _Entries: a sampler group's compact layout
        self.last_record: dict | None = None
        self.broken_by: dict[str, str] = {}  # law name -> why the optimizer breaks it (check_optimizer)
        self._setup()
        with torch.no_grad():
            self.h0, mag = self._initial_values()
        magn = self._inst_norm(mag, in_place=True)  # (squared in place: no second law-sized buffer)
        del mag  # (the magnitudes' law values: only their instance norms are kept)
        h0n = self._inst_norm(self.h0)
        self.denom = torch.where(h0n > GUARD * magn, h0n, magn).clamp_min(torch.finfo(h0n.dtype).tiny)
        self._fam_count_f, self._group_count_f = (c.to(self.h0.vec.dtype) for c in (self._fam_count, self._group_count))
        # the mean over each family's instances of |h_0| / magnitude (``totals()["balance"]``): per family, held
        self.h0_balance = self._fam_mean(h0n / magn.clamp_min(torch.finfo(h0n.dtype).tiny))
        del h0n, magn
        self.h = self.h0.clone()  # (once the norms' temporaries are freed: h_0, h and one of them at most)
        self._h_own = self.h  # h's buffers are the tracker's own: later evaluations write into them (_eval_into_h)
        # each term summed over the decomposed (entry, step) pairs since step 0, in place at each drift step
        # (only where kept: ``cumulative``)
        self.keep_cumulative = (bool(drift) and drift_every == 1 and snapshot_budget is None) if cumulative is None \
            else cumulative
        self.cumulative: dict[str, Values] = ({k: self.h0.map(torch.zeros_like) for k in CUMULATIVE}
                                              if self.keep_cumulative else CumulativeNotKept())
        # per term (CUMULATIVE) and family, the sum over the booked drift steps of the step's family norm: on
        # the host, summed from the rows at each flush (``totals()["sum_step_<term>"]``); no per-step cost
        self._step_sums = torch.zeros(len(CUMULATIVE), len(self.families), dtype=torch.float64, device="cpu")
        self.sampled_steps = torch.zeros(len(self.families), dtype=torch.long, device=self.device)
        self._versions = self._tensor_versions()  # the weights h_0 was evaluated on (``check_outside``)
        _LIVE.add(self)

    def check_optimizer(self, optimizer) -> dict[str, str]:
        """Compare every law's parameters with ``optimizer.param_groups`` (lr, weight_decay, membership);
        sets and returns ``broken_by`` ({law name: reason}); see ``conserve.tracking.breakers``."""
        return check_optimizer(self, optimizer)

    def broken_by_family(self) -> dict[str, list[str]]:
        """``broken_by`` grouped by law family: ``{family: ["<law>: <reason>", ...]}`` (for summaries)."""
        fam = {l.name: l.family for l in self.laws}
        out: dict[str, list[str]] = {}
        for name, why in self.broken_by.items():
            out.setdefault(fam[name], []).append(f"{name}: {why}")
        return out

    # -------------------------------------------------------------- hooks (see conserve.distributed)
    def _local_tensors(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors the kernels read (the parameters themselves; local shards when distributed)."""
        return params

    def _setup(self) -> None:
        """Called after the plan and index are built, before ``h_0`` is evaluated."""

    def _initial_values(self) -> tuple["Values", "Values"]:
        """``h(theta_0)`` and the magnitudes (every sign +) used by the ``eps`` guard."""
        mag = Values(*kernels.evaluate(_abs_plan(self.compiled.plan), self.tensors, fp64=self.fp64, backend=self.backend))
        return self._eval(self.tensors), mag

    # ------------------------------------------------------------------------------------ layout
    def _build_index(self):
        c, dev = self.compiled, self.device
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
        self._gram_ds = list(c.plan.gram_slots)
        inst_all = torch.cat([vec_inst] + [gram_inst[d] for d in self._gram_ds]).to(dev, torch.int32)
        self._n_flat = inst_all.numel()
        fam_all = torch.cat([vec_fam] + [gram_fam[d] for d in self._gram_ds]).to(dev, torch.int32)
        offs = np.cumsum([c.plan.vec_size] + [c.plan.gram_slots[d] for d in self._gram_ds]).tolist()
        self._flat_at = dict(zip(self._gram_ds, offs[:-1]))  # D -> first flat index of its slots
        # the vec entries' instances: as a few stretches (``_vec_runs``) when they form at most ``_MAX_RUNS``
        # (``conserve run``'s model: 688 entries, 11 stretches; no 4 bytes per entry held), else the int32 index
        self._vec_runs, self._zero_idx = _index_runs(vec_inst.numpy(), dev)
        self._vec_inst_held = None if self._vec_runs is not None else inst_all[: c.plan.vec_size]
        gram_part = inst_all[c.plan.vec_size:].clone()  # one int32 per Gram slot (few)
        self._gram_inst = {d: gram_part[o - c.plan.vec_size: o - c.plan.vec_size + c.plan.gram_slots[d]]
                           for d, o in self._flat_at.items()}
        spans, at = [], fam_all.numel()  # the scratch layout of record_step: [vec | slot sums | Grams]
        for d in self._gram_ds:
            n = c.plan.gram_slots[d]
            spans.append((d, at, at + n * d * d, (n, d, d)))
            at += n * d * d
        self._layout = (at, c.plan.vec_size, spans)
        inst_fam, inst_group = (torch.tensor(inst_fam, dtype=torch.long, device="cpu"),
                                torch.tensor(inst_group, dtype=torch.long, device="cpu"))
        self._n_inst = len(inst_fam)
        self._fam_count = torch.bincount(inst_fam, minlength=len(fams)).clamp_min(1).to(dev)
        self._group_count = torch.bincount(inst_group, minlength=len(groups)).clamp_min(1).to(dev)
        # the (family, layer) group of each instance, held as runs: the instances of a group lie side by side
        # in law order (``conserve run``'s model: 634 instances, 15 groups, 21 runs), so the per-step group
        # sums are one segment sum per run (``_group_sum``) and no 4 bytes per instance are held
        new_run = torch.ones(len(inst_group), dtype=torch.bool, device="cpu")
        new_run[1:] = inst_group[1:] != inst_group[:-1]
        starts = torch.nonzero(new_run).flatten()
        self._run_len = torch.diff(starts, append=torch.tensor([len(inst_group)], device="cpu")).to(dev, torch.int32)
        self._run_group = inst_group[starts].to(dev, torch.int32)
        # the family of each (family, layer) group (an instance's is expanded from the runs when needed, an
        # entry's gathered from that, unless an entry belongs to no law)
        self._group_fam = torch.tensor([fams.index(f) for f, _ in groups], dtype=torch.int32, device=dev)
        self._fam_all_held = None if torch.equal(self._inst_fam[inst_all], fam_all) else fam_all
        del inst_all
        self.metric_names = ([f"eps/{f}" for f in fams]
                             + [f"eps/{f}/" + ("global" if l < 0 else f"layer{l}") for f, l in groups]
                             + (([f"drift/{f}/{t}" for t in TERMS for f in fams]) if self.drift else []))

    @property
    def _vec_inst(self) -> torch.Tensor:
        """(vec entries,) int32: the instance of each vec entry (formed from ``_vec_runs`` when held as runs)."""
        if self._vec_inst_held is not None:
            return self._vec_inst_held
        out = torch.empty(self.compiled.plan.vec_size, dtype=torch.int32, device=self.device)
        for a, n, i0, each in self._vec_runs:
            out[a: a + n] = torch.arange(i0, i0 + n, dtype=torch.int32, device=self.device) if each else i0
        return out

    @property
    def _inst_all(self) -> torch.Tensor:
        """(entries,) int32: the instance of each output entry, flat layout (vec, then each D's slots)."""
        return torch.cat([self._vec_inst] + [self._gram_inst[d] for d in self._gram_ds])

    def _vec_add(self, out: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``out.index_add_(0, _vec_inst, v)`` (the same bits: each instance gets its entries' additions in
        entry order), over the stretches when held as runs: a slice addition per stretch of consecutive
        instances, one ``index_add_`` into its instance per stretch of one."""
        if self._vec_runs is None:
            return out.index_add_(0, self._vec_inst_held, v)
        for a, n, i0, each in self._vec_runs:
            if each:
                out[i0: i0 + n].add_(v[a: a + n])
            else:
                out[i0: i0 + 1].index_add_(0, self._zero_idx[:n], v[a: a + n])
        return out

    @property
    def _inst_group(self) -> torch.Tensor:
        """(instances,) int32: the (family, layer) group of each instance (expanded from the runs when read:
        not held)."""
        return torch.repeat_interleave(self._run_group, self._run_len)

    @property
    def _inst_fam(self) -> torch.Tensor:
        """(instances,) int32: the family of each instance (expanded when read: not held; the per-step
        family sums add the (family, layer) group sums instead)."""
        return torch.repeat_interleave(self._group_fam.index_select(0, self._run_group), self._run_len)

    def _group_sum(self, per_inst: torch.Tensor) -> torch.Tensor:
        """(groups,): the sum of a per-instance quantity over each (family, layer) group's instances (one
        segment sum per run of ``_run_len``, then the runs added into their groups)."""
        runs = torch.segment_reduce(per_inst, "sum", lengths=self._run_len)
        return torch.zeros(len(self.groups), dtype=per_inst.dtype, device=per_inst.device).index_add_(
            0, self._run_group, runs)

    @property
    def denom(self) -> torch.Tensor:
        """(instances,) the ``eps`` denominators: ``||h_i(theta_0)||``, or for a guarded instance (``|h_0|``
        below ``GUARD`` times its magnitude) that magnitude, at least the dtype's ``tiny``; dtype of ``h_0``.
        Formed when read from the held ``h_0`` (one evaluation of the instance norms): only the guarded
        instances' values are held (``_guard_at``, ``_guard_val``: 12 bytes each; none on a model whose
        laws all start unbalanced).  Setting it (construction, ``load_state_dict``) keeps those."""
        return self._denominators()

    def _denominators(self, sv: torch.Tensor | None = None, sg: Mapping[int, torch.Tensor] | None = None) -> torch.Tensor:
        """``denom`` (see there); ``sv``, ``sg``: scratch of ``h_0``'s vec and Gram shapes and dtype the squares
        are written into (overwritten; the bits of ``_inst_norm``: ``x * x`` is ``square()``)."""
        if sv is None:
            d = self._inst_norm(self.h0)
        else:
            h0 = self.h0
            d = self._vec_add(torch.zeros(self._n_inst, dtype=h0.vec.dtype, device=self.device),
                              torch.mul(h0.vec, h0.vec, out=sv))
            for k, g in h0.grams.items():
                d.index_add_(0, self._gram_inst[k], torch.mul(g, g, out=sg[k]).sum((1, 2)))
            d.sqrt_()
        if self._guard_at.numel():
            d.index_copy_(0, self._guard_at, self._guard_val)
        return d.clamp_min_(torch.finfo(d.dtype).tiny)

    @denom.setter
    def denom(self, value: torch.Tensor) -> None:
        h0n = self._inst_norm(self.h0)
        value = value.to(device=h0n.device, dtype=h0n.dtype)
        at = torch.nonzero(value != h0n).flatten()  # (a denominator clamped to tiny too)
        self._guard_at, self._guard_val = at, value.index_select(0, at)

    def _fam_mean(self, per_inst: torch.Tensor) -> torch.Tensor:
        """(families,): the mean of a per-instance quantity over each family's instances."""
        return torch.zeros(len(self.families), dtype=per_inst.dtype, device=per_inst.device).index_add_(
            0, self._inst_fam, per_inst) / self._fam_count

    @property
    def _fam_all(self) -> torch.Tensor:
        """(entries,) int32: the family of each output entry, flat layout (vec, then each D's slots)."""
        held = self.__dict__.get("_fam_all_held")
        return held if held is not None else self._inst_fam.index_select(0, self._inst_all)

    @property
    def _vec_fam(self) -> torch.Tensor:
        return self._fam_all[: self.compiled.plan.vec_size]

    @property
    def _gram_fam(self) -> dict:
        fam = self._fam_all
        return {d: fam[o: o + self.compiled.plan.gram_slots[d]] for d, o in self._flat_at.items()}

    def _sq_bins(self, v: Values, vec_ids, gram_ids, n, in_place: bool = False) -> torch.Tensor:
        """(n,) the sums of squares of ``v``'s entries per bin; ``vec_ids`` None: the instances (``_vec_add``);
        ``in_place``: ``v``'s tensors are squared in place (the same bits; ``v`` is then spent)."""
        sq = (lambda x: x.square_()) if in_place else (lambda x: x.square())  # noqa: E731
        out = torch.zeros(n, dtype=v.vec.dtype, device=self.device)
        out = self._vec_add(out, sq(v.vec)) if vec_ids is None else out.index_add_(0, vec_ids, sq(v.vec))
        for d, g in v.grams.items():
            out.index_add_(0, gram_ids[d], sq(g).sum((1, 2)))
        return out

    def _inst_norm(self, v: Values, in_place: bool = False) -> torch.Tensor:
        return self._sq_bins(v, None, self._gram_inst, self._n_inst, in_place).sqrt()

    def _fam_norm(self, v: Values) -> torch.Tensor:
        return self._sq_bins(v, self._vec_fam, self._gram_fam, len(self.families)).sqrt()

    def _eval(self, tensors) -> Values:
        return Values(*kernels.evaluate(self.compiled.plan, tensors, fp64=self.fp64, backend=self.backend))

    def _eval_into_h(self, tensors) -> Values:
        """``h(theta_{k+1})`` written into the held ``h``'s buffers when the tracker made them (its own
        evaluation or construction's clone: ``_h_own``; never a ``Values`` a caller handed to ``record_step``
        or ``load_state_dict``, nor the fused optimizers' ``h``) and returned as that ``h``; else a fresh
        evaluation.  Only where the old ``h`` is no longer read (``after_step``).  The evaluation's checks
        that can raise (views outside their tensors, reserved slots, ``out``'s layout) run before the buffers
        are zeroed, so an error leaves ``h`` as it was."""
        own = self.__dict__.get("_h_own")
        if own is None or own is not self.h:
            return self._eval(tensors)
        kernels.evaluate(self.compiled.plan, tensors, fp64=self.fp64, backend=self.backend, out=(own.vec, own.grams))
        return own

    # ------------------------------------------------------------------ the model's parameters, still
    def stale(self) -> list[str]:
        """The tracked parameters that are no longer the model's, one reason each: the module's
        parameter under that name is another tensor (``module.weight = nn.Parameter(...)``,
        ``load_state_dict(..., assign=True)``, ``resize_token_embeddings``, re-tying embeddings), is
        gone (``torch.nn.utils.parametrize`` / ``prune`` moved it to ``weight_orig`` / ``original``), or
        has another shape than the tracker was built for (``p.data = ...``).  ``[]`` when all are the
        model's, and for a tracker built from ``params=`` / a copy without its model (nothing to
        compare).  One dict look-up per tracked tensor."""
        bound = self.__dict__.get("_bound")
        root = bound() if bound is not None else None
        if root is None or getattr(self, "world", 1) > 1:  # (a distributed tracker: every rank would have to agree)
            return []
        out, mods = [], {"": root}
        for name, t, shape in zip(self.compiled.names, self.params, self._bound_shapes):
            prefix, _, key = name.rpartition(".")
            mod = mods.get(prefix)  # resolved from the root each time: a replaced module (model.lm_head = ...) is seen
            if mod is None:
                parent, _, child = prefix.rpartition(".")
                up = mods.get(parent) if parent in mods else _submodule(root, parent)
                mod = mods[prefix] = (up._modules.get(child) if up is not None else None)
            if mod is None:
                out.append(f"{name} is no longer in the model (its module was removed)")
                continue
            now = mod._parameters.get(key)
            if now is None:
                out.append(f"{name} is no longer a parameter of the model (parametrize / prune / deleted)")
            elif now is not t:
                out.append(f"{name} was replaced by another tensor")
            elif tuple(t.shape) != shape:
                out.append(f"{name} has shape {tuple(t.shape)}, the tracker was built for {shape}")
        return out

    def _stale_message(self, why: list[str]) -> str:
        more = f" (and {len(why) - 2} more)" if len(why) > 2 else ""
        return (f"conserve: {'; '.join(why[:2])}{more} since the tracker was built, so it would report tensors "
                "that are no longer the model's: build a new tracker over the model as it is now "
                "(conserve.track(optimizer, model), or the fused optimizer's track=model) and give the optimizer the "
                "new parameters")

    def _tensor_versions(self) -> list[int] | None:
        """The in-place version counter of each tracked tensor (``Tensor._version``: every in-place write,
        ``copy_`` of ``load_state_dict`` included, bumps it; ``p.data = ...`` does not)."""
        if getattr(self, "world", 1) > 1:
            return None
        return [t._version for t in self.params]

    def check_outside(self) -> None:
        """Right before a step: warn once (one line) if a tracked tensor was written in place since the
        last booked step (or since the tracker was built): ``model.load_state_dict`` (pretrained weights
        loaded after the tracker was built), a second optimizer, an EMA or LoRA merge written into the
        weights.  That change is no step of the tracked optimizer: ``eps`` jumps with it (still measured
        against the ``theta_0`` the tracker was built on) and, before a drift step, the drift ``residual``
        holds it.  Reads one counter per tracked tensor (~0.1 us each)."""
        was = self.__dict__.get("_versions")
        if was is None or self._closed or self.__dict__.get("_warned_outside"):
            return
        moved = [n for n, t, v in zip(self.compiled.names, self.params, was) if t._version != v]
        if moved:
            self._warned_outside = True
            more = f" (and {len(moved) - 2} more)" if len(moved) > 2 else ""
            when = "the tracker was built" if self.step_count == 0 else f"step {self.step_count}"
            warn(f"conserve: {', '.join(moved[:2])}{more} changed in place since {when}, outside the tracked "
                          "optimizer step (load_state_dict, a second optimizer, an EMA/LoRA merge?): eps jumps with "
                          "it (still measured against the weights the tracker was built on) and a drift step's residual "
                          "holds it; build the tracker after loading weights, and change them only through the "
                          "tracked optimizer", RuntimeWarning)

    def _accept_weights(self) -> None:
        """The weights as they are now are those the next step starts from, without a warning: after an
        optimizer step that is no training step and leaves the values alone (DCP's zero-lr state
        initialisation, a step GradScaler skipped inside the optimizer) but may bump the counters."""
        self._versions = self._tensor_versions()

    def check_bound(self) -> None:
        """Before a step whose booking flushes the pending rows (``every`` of them): raise
        ``StaleParameterError`` (one line naming the parameters and the fix) if ``stale()`` finds a
        tracked parameter that is no longer the model's, before the optimizer changes anything; the
        pending rows are kept (``close()`` writes them, with a warning).  Otherwise free (one length
        test per step)."""
        if len(self._rows) >= self.every and not self._closed:
            why = self.stale()
            if why:
                raise StaleParameterError(self._stale_message(why))

    # ------------------------------------------------------------------------------------- steps
    @property
    def sampler(self) -> Sampler:
        """Which laws each drift step decomposes (``conserve.tracking.drift.Sampler``)."""
        if self._sampler is None:
            self._sampler = Sampler(self.compiled.plan, self.tensors, self.snapshot_budget, self.device, compact=True)
        return self._sampler

    @property
    def assembly(self) -> Assembly:
        if self._assembly is None:
            self._assembly = Assembly(self.compiled.plan, self.compiled.linear_mask, self.device)
        return self._assembly

    def is_drift_step(self) -> bool:
        """Whether the next step (``step_count + 1``) decomposes the drift (never once closed)."""
        return self.drift and not self._closed and self.step_count % self.drift_every == 0

    def _books_after_close(self) -> bool:
        """False once ``close()`` ran: later steps are not booked (one warning names how to track them);
        before, a step after ``close()`` was booked and its flush failed in the closed sinks."""
        if not self._closed:
            return True
        if not self.__dict__.get("_warned_closed"):
            self._warned_closed = True
            warn("conserve: the tracker is closed (close() or the end of its `with` block): steps after it "
                          "are not tracked; build a new tracker (conserve.track, or a fused optimizer's track=) to "
                          "track them", RuntimeWarning)
        return False

    @eager
    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Right before the optimizer step: on a drift step, copy what it reads of ``theta_k`` and take
        each parameter's decay factor ``a``; on the other steps nothing (nor after ``close()``)."""
        self._snap = None
        self.check_bound()  # (a flush is due in this step: the tracked tensors must still be the model's)
        self.check_outside()
        if not self.is_drift_step():
            return
        self._snap = self.sampler.snapshot(self.step_count // self.drift_every, self.tensors)
        self._a = decay_factors(optimizer, self.tensors)

    @eager
    @torch.no_grad()
    def after_step(self) -> None:
        """Evaluate the laws at ``theta_{k+1}`` (and the drift terms if ``before_step`` copied ``theta_k``);
        nothing after ``close()`` (one warning)."""
        if not self._books_after_close():
            return
        snap, self._snap = self._snap, None
        if snap is None:  # h_k is not read again: h_{k+1} is evaluated into its buffers
            h1 = self._eval_into_h(self.tensors)
            self.record_step(h1)
            self._h_own = h1
            return
        a = stepped_factors(self._a, self.params)  # an unstepped parameter (grad None) is not decayed
        # the DRIFT pass first: it frees the copies of theta_k before h(theta_{k+1}) is evaluated (the
        # pass's pieces, smaller, are held instead); then the terms
        pieces = self._drift_pass(snap, a)
        if snap.compact:  # a copy of the group's entries of h_k: then h_k's buffers take h_{k+1}, and the terms
            # scratch is formed after that evaluation (the pieces, smaller, are held through it instead)
            hv, hg = self._entries(snap.mask).take(self.h)
            h_old = (hv.clone(), {d: g.clone() for d, g in hg.items()})
            del hv, hg
            h1 = self._eval_into_h(self.tensors)
            terms = self.assemble(pieces, a, snap.mask, compact=True, h_old=h_old)
            del pieces, h_old
        else:  # every entry: record_step reads the full h_k (measured = h_{k+1} - h_k), a fresh h_{k+1}
            h1 = self._eval(self.tensors)
            terms = self.assemble(pieces, a, snap.mask)
            del pieces
        self.record_step(h1, terms, snap.mask)
        self._h_own = h1

    def _drift_pass(self, snap, a: list[float]) -> list:
        """The DRIFT pass's ``[None, decay, bil, h_delta]`` over ``snap`` (its copies of theta_k are
        overwritten with Delta and freed) and the live weights, for ``assemble``."""
        news = self.sampler.news(snap, self.tensors)
        pieces = drift_pieces(snap.plan, snap.olds, news, self.sampler.factors(snap, a), fp64=self.fp64,
                              backend=self.backend, decay=self.assembly.needs_kernel_decay(a, snap.mask), donate=True,
                              values=False)  # the snapshot is ours (Delta is formed in it); h1 is the eps evaluation
        snap.olds.clear()  # the copies of theta_k (now Delta) are read: free them before the terms are formed
        # h(new) of the pass: not used (h1 is the eps evaluation); a list, which the assembly empties once read
        return [None, *pieces[1:]]

    def drift_terms(self, snap, a: list[float]) -> "DriftTerms":
        """The identity's ``decay``/``first``/``second`` from one DRIFT pass over ``snap`` (old copies)
        and the live weights; ``a``: decay factor per tracked tensor.  The terms are written into the
        step scratch of ``record_step``, which consumes it (squares it in place): pass them to the next
        ``record_step`` once, clone them to keep them."""
        return self.assemble(self._drift_pass(snap, a), a, snap.mask, compact=snap.compact)

    def assemble(self, pieces, a: Sequence[float], mask: Mask, *, compact: bool = False,
                 stats: StepStats | None = None, h_old: tuple | None = None) -> "DriftTerms":
        """One drift step's ``decay``/``first``/``second`` from the DRIFT pass's ``pieces`` and, for a fused
        optimizer, its step statistics ``stats``: ``Assembly.terms`` (the one assembly), written into the
        step scratch that ``record_step`` consumes (squares in place: pass the result to one
        ``record_step``, clone it to keep it).

        ``pieces``: ``(h_new, decay, bil, h_delta)`` of ``drift_pieces`` over the entries of ``mask`` (a
        list is emptied once read), or None (no DRIFT pass this step); ``a``: decay factor per tracked
        tensor; ``compact``: the pieces hold ``mask``'s entries only, in order (``Snapshot.compact``;
        ``stats`` then at those vec entries too: the fused optimizers' ``_compact_terms``); ``h_old``: then
        ``(vec, {D: grams})`` of ``h_k`` at those entries (default: taken from ``h``; copied into the scratch
        either way)."""
        asm = self.assembly
        # the terms go straight into rows 1-3 of record_step's scratch (no copy, no temporary per term)
        at = self._entries(mask) if compact else None
        if at is None:
            buf, wv, wg = self._scratch((len(TERMS),), self.h.vec.dtype)
            h_old, sampled = (self.h.vec, self.h.grams), mask
        else:  # a compact sub-plan: the pieces, terms and scratch hold the group's entries only
            buf, wv, wg = self._views(torch.empty(len(TERMS), at.layout[0], dtype=self.h.vec.dtype, device=self.device),
                                      at.layout)
            h_old, sampled = (at.take(self.h) if h_old is None else h_old), None
            asm = at.assembly
        out = {k: (wv[i], {d: g[i] for d, g in wg.items()}) for i, k in enumerate(TERMS[:4]) if i}
        terms = DriftTerms({k: Values(*v) for k, v in asm.terms(h_old, pieces, a, sampled, out=out, stats=stats).items()})
        if at is not None:  # the group's h_k into row 0 (where measured = h_{k+1} - h_k goes): a copy, so h's
            wv[0].copy_(h_old[0])  # buffers may take h_{k+1} before record_step (``take`` gives views of slices)
            for d, g in wg.items():
                g[0].copy_(h_old[1][d])
            h_old = (wv[0], {d: g[0] for d, g in wg.items()})
        terms.at, terms.buf, terms.h_old = at, buf, (h_old if at is not None else None)
        return terms

    def _entries(self, mask: Mask) -> "_Entries":
        """The compact layout of ``mask``'s entries (``_Entries``), cached per ``mask.key``: a sampler group
        decomposes the same entries every time it comes round (held: see ``_Entries``)."""
        got = self._entries_of.get(mask.key) if mask.key is not None else None
        if got is None:
            got = _Entries(self, mask)
            if mask.key is not None:
                self._entries_of[mask.key] = got
        return got

    def _family_hit(self, mask: Mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(families,) bool: the family has a decomposed entry under ``mask``, and its negation (cached per ``mask.key``:
        a sampler group decomposes the same entries every time it comes round)."""
        hit = self._hits.get(mask.key) if mask.key is not None else None
        if hit is None:
            flat = torch.cat([mask.vec.reshape(-1)] + [mask.grams[d].reshape(-1) for d in self._gram_ds])
            hit = torch.zeros(len(self.families), dtype=torch.int32, device=self.device)
            hit = hit.index_add_(0, self._fam_all, flat.to(torch.int32)) > 0
            hit = (hit, ~hit)
            if mask.key is not None:
                self._hits[mask.key] = hit
        return hit

    def _scratch(self, lead: tuple, dt) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One buffer ``(*lead, V + slots + Gram entries)`` laid out ``[vec | per-slot sums | Gram
        matrices]``: returns it, its vec part and its ``{D: (*lead, slots, D, D)}`` Gram parts (views)."""
        return self._views(torch.empty(lead + (self._layout[0],), dtype=dt, device=self.device))

    def _views(self, buf: torch.Tensor, layout: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(buf, vec part, {D: Gram part})`` of a ``_scratch`` buffer (``layout``: a compact one, ``_Entries``)."""
        total, nv, spans = self._layout if layout is None else layout
        return buf, buf[..., : nv], {d: buf[..., a: b].unflatten(-1, shape) for d, a, b, shape in spans}

    def _squares(self, buf: torch.Tensor, vec: torch.Tensor, grams: Mapping[int, torch.Tensor],
                 at: "_Entries | None" = None) -> torch.Tensor:
        """Square ``_scratch`` values in place and sum each Gram slot's squares into its slot column:
        returns ``buf[..., :flat entries]``, the per-entry squares in the flat layout of ``_fam_all``
        (``at``: of its ``families``)."""
        flat_at, n_flat = (self._flat_at, self._n_flat) if at is None else (at.flat_at, at.size)
        vec.mul_(vec)  # x * x: the bits of square()
        for d in self._gram_ds:
            g, o = grams[d], flat_at[d]
            torch.sum(g.mul_(g), (-2, -1), out=buf[..., o: o + g.shape[-3]])
        return buf[..., : n_flat]

    def record_step(self, h1: Values, terms: Mapping[str, Values] | None = None, sampled: Mask | None = None) -> None:
        """Book one step given ``h(theta_{k+1})`` and optionally the drift terms (``decay``, ``first``,
        ``second``), e.g. computed by a fused optimizer kernel; ``sampled``: the entries they cover
        (None: all).  Appends one metric row (on device).

        Memory: the five per-entry terms of a drift step (``measured``, the three given, ``residual``)
        are formed in one stacked scratch buffer, summed into ``cumulative`` in place (when kept) and
        reduced to the family norms, and dropped after the step (``keep_last``: ``last`` views a copy of it).
        The tracker's own budgeted drift steps (``drift_terms`` over a compact sub-plan) form them over
        the group's entries only (the scratch is the group's size, not five law-sized rows); terms
        given here are in the full layout.  Nothing is booked after ``close()`` (one warning)."""
        if not self._books_after_close():
            return
        deferred = _Deferred()
        if len(self._rows) >= self.every:  # flush lazily, so record() can still reach the last row
            deferred.call(self.flush)  # a NonFiniteError is raised once this step is booked
        self.step_count += 1
        nf, dev = len(self.families), self.device
        dt = torch.promote_types(h1.vec.dtype, self.h0.vec.dtype)
        norms = None
        if self.drift:  # the terms first: their scratch is squared, reduced and freed before the eps scratch exists
            norms = torch.empty(len(TERMS), nf, dtype=dt, device=dev)
            if terms is None:
                norms.fill_(float("nan"))
            else:
                self._drift_norms(h1, terms, sampled, norms)
                if isinstance(terms, DriftTerms):  # consumed (documented): its views of the scratch go with it
                    terms.clear()
                    terms.buf = terms.h_old = None
        # eps: per instance ||h1 - h0|| / denom, averaged per family and per (family, layer) group; the
        # differences and the denominators' squares go through one vec-sized and one Gram-sized scratch
        with torch.no_grad():  # (out= takes no autograd inputs; the row is a detached metric either way)
            sv = torch.empty(h1.vec.shape, dtype=dt, device=dev)
            sg = {d: torch.empty(g.shape, dtype=dt, device=dev) for d, g in h1.grams.items()}
            dv, g = torch.sub(h1.vec, self.h0.vec, out=sv), None
            rel = self._vec_add(torch.zeros(self._n_inst, dtype=dt, device=dev), dv.mul_(dv))
            for d, g in h1.grams.items():  # x * x: the bits of square()
                g = torch.sub(g, self.h0.grams[d], out=sg[d])
                rel.index_add_(0, self._gram_inst[d], g.mul_(g).sum((1, 2)))
            rel.sqrt_().div_(self._denominators(sv, sg) if dt == self.h0.vec.dtype else self.denom)
            del dv, g, sv, sg
        grp = self._group_sum(rel)
        fam = torch.zeros(nf, dtype=dt, device=dev).index_add_(0, self._group_fam, grp)  # (a family: its groups)
        parts = [fam.div_(self._fam_count_f), grp.div_(self._group_count_f)]
        if norms is not None:
            parts.append(norms.view(-1))
        row = torch.cat(parts)
        self._rows.append(row.float())
        if self.__dict__.get("_h_own") is not h1:  # a caller's h1 (after_step marks its own once this returns)
            self._h_own = None
        self.h = h1
        if not self.__dict__.get("_warned_outside"):  # (check_outside warns once: no counters read after that)
            self._versions = self._tensor_versions()  # the weights as this step left them (``check_outside``)
        for m in self.monitors:
            m.update()
        deferred.raise_booked(self, self.step_count)  # this step was booked before the caller saw the error

    def _drift_norms(self, h1: Values, terms: Mapping[str, Values], sampled: Mask | None, norms: torch.Tensor) -> None:
        """The five terms of one drift step (stacked scratch), ``cumulative += `` the first four (when kept), and per
        term and family the Euclidean norm into ``norms`` (``(len(TERMS), families)``, NaN for a family
        without a decomposed entry)."""
        dev = self.device
        dec, fst, snd = terms["decay"], terms["first"], terms["second"]
        dt = torch.promote_types(torch.promote_types(h1.vec.dtype, self.h.vec.dtype),
                                 torch.promote_types(torch.promote_types(dec.vec.dtype, fst.vec.dtype), snd.vec.dtype))
        partial = sampled is not None and not sampled.full
        at = getattr(terms, "at", None)  # compact terms (drift_terms over a compact sub-plan): the group's entries
        layout = self._layout if at is None else at.layout
        buf = getattr(terms, "buf", None)  # assemble wrote the terms into rows 1-3 of it: taken (consumed) here
        if buf is not None:
            terms.buf = None
        if buf is None or buf.dtype != dt or buf.shape[-1] != layout[0] \
                or self._views(buf, layout)[1][1].data_ptr() != dec.vec.data_ptr():
            buf = torch.empty(len(TERMS), layout[0], dtype=dt, device=dev)
        buf, wv, wg = self._views(buf, layout)
        if at is not None:  # the group's entries of h_{k+1} and h_k (taken by assemble); the terms need no mask
            h_k = terms.h_old if terms.h_old is not None else at.take(self.h)
            h1, partial_masks = at.take(h1), False
        else:
            h_k, partial_masks = (self.h.vec, self.h.grams), partial

        def fill(w, hv, ov, parts, mask):
            ws = w.unbind(0)
            torch.sub(hv, ov, out=ws[0])  # measured
            if mask is not None:
                ws[0].mul_(mask)
            for i, x in enumerate(parts, 1):
                if x.data_ptr() != ws[i].data_ptr():
                    ws[i].copy_(x)
            torch.sub(ws[0], ws[1], out=ws[4]).sub_(ws[2]).sub_(ws[3])  # residual = m - d - f - s

        h1v, h1g = (h1.vec, h1.grams) if at is None else h1
        hkv, hkg = h_k
        fill(wv, h1v, hkv, (dec.vec, fst.vec, snd.vec), sampled.vec if partial_masks else None)
        for d, g in h1g.items():
            fill(wg[d], g, hkg[d], (dec.grams[d], fst.grams[d], snd.grams[d]),
                 sampled.grams[d].view(-1, 1, 1) if partial_masks else None)
        for i, k in enumerate(CUMULATIVE if self.keep_cumulative else ()):  # cumulative += measured, decay, ...
            c = self.cumulative[k]
            if at is None:
                c.vec.add_(wv[i])
                for d, g in c.grams.items():
                    g.add_(wg[d][i])
            else:  # at the group's entries only (the others would add zeros)
                _add_at(c.vec, at.vec, wv[i])
                for d, g in c.grams.items():
                    _add_at(g, at.slots[d], wg[d][i])
        if self.keep_last:  # a copy: ``buf`` is squared below (compact: scattered into the full layout)
            if at is None:
                _, kv, kg = self._views(buf.clone())
            else:
                _, kv, kg = self._scratch((len(TERMS),), dt)
                kv.zero_()[:, at.vec] = wv
                for d, g in kg.items():
                    g.zero_()[:, at.slots[d]] = wg[d]
            self.last = {t: Values(kv[i], {d: g[i] for d, g in kg.items()}) for i, t in enumerate(TERMS)}
        sq = self._squares(buf, wv, wg, at)
        fam = self._fam_all if at is None else at.families(self)
        out = norms.zero_() if norms.dtype == dt else torch.zeros(norms.shape, dtype=dt, device=dev)
        for i in range(len(TERMS)):
            out[i].index_add_(0, fam, sq[i])
        out.sqrt_()
        if out is not norms:
            norms.copy_(out)
        if partial:
            hit, miss = self._family_hit(sampled)
            norms.masked_fill_(miss, float("nan"))
            self.sampled_steps += hit
        else:
            self.sampled_steps += 1

    @eager
    def record(self, **scalars) -> None:
        """Attach scalars (tensors stay on the device; floats are fine) to the current step's row. Tensors
        are kept detached: ``record(loss=loss)`` does not hold the step's autograd graph until the flush."""
        if self._closed:  # steps after close() are not booked (after_step / record_step warned)
            return
        if not self._rows:
            raise RuntimeError("record() needs a step first: call it after optimizer.step()")
        while len(self._extras) < len(self._rows):
            self._extras.append({})
        self._extras[len(self._rows) - 1].update({k: record_value(k, v) for k, v in scalars.items()})

    def latest(self) -> dict | None:
        """The most recent step's row (``eps/...``, ``drift/...`` and the ``step``) as host floats, without
        flushing (one small device->host copy); None before the first step."""
        if self._rows:
            return {"step": self.step_count, **dict(zip(self.metric_names, self._rows[-1].tolist()))}
        return self.last_record

    # ------------------------------------------------------------------------------------ output
    def values(self) -> dict[str, torch.Tensor]:
        """Current ``h(theta_k)`` per law name (vector or D x D): copies (the tracker writes later steps'
        values into its held ``h``)."""
        return {l.name: v.clone() for l, v in zip(self.laws, self.compiled.split(self.h.vec, self.h.grams))}

    def totals(self) -> dict[str, dict[str, float]]:
        """Per family, since step 0: ``eps`` now, ``measured`` = ||h_k - h_0||; ``sampled_steps``: drift steps
        that decomposed some law of the family, of ``steps``; ``scale`` = ||h_0||; ``guarded``: the
        fraction of the family's instances whose ``eps`` divides by their magnitude (the same law with
        every sign +) because ``|h_0|`` is ~0; ``balance``: the mean over instances of ``|h_0|`` / magnitude
        (1: one side of the law dominates, 0: balanced); ``sum_step_measured``, ``sum_step_decay``,
        ``sum_step_first``, ``sum_step_second``: the sum over the drift steps of each step's family norm
        of the term (the ``drift/<family>/<term>`` columns summed, NaN steps skipped: a sum of norms, an
        upper bound of the norm of the summed term, not that norm; NaN after loading a state saved
        without them); ``cumulative``: whether the per-entry sums below are kept (``Tracker(cumulative=)``).

        With them (``cumulative`` True; the default in exact mode, ``drift_every=1, snapshot_budget=None``),
        over the decomposed (entry, step) pairs only (every step and entry in exact mode):
        ``measured_sampled`` (norm of the summed measured changes), the cumulative ``decay``, ``first``
        and ``second`` terms (norms of their per-entry sums), ``predicted`` = ||decay + first + second||
        (equals ``measured_sampled`` by the identity) and ``predicted_no_first`` = ||decay + second||
        (the GD/SGD prediction, where the first-order term vanishes).  Without them these keys are
        absent (never estimated).  Nothing is extrapolated to the steps or laws that were not
        decomposed.  Host floats (one sync)."""
        parts = {"measured": self._fam_norm(self.h.map(torch.sub, self.h0))}
        if self.keep_cumulative:
            c = self.cumulative
            parts.update({"measured_sampled": self._fam_norm(c["measured"]),
                          "decay": self._fam_norm(c["decay"]), "first": self._fam_norm(c["first"]),
                          "second": self._fam_norm(c["second"]),
                          "predicted": self._fam_norm(c["decay"].map(torch.add, c["first"]).map(torch.add, c["second"])),
                          "predicted_no_first": self._fam_norm(c["decay"].map(torch.add, c["second"]))})
        parts.update({"scale": self._fam_norm(self.h0), "sampled_steps": self.sampled_steps,
                      "steps": torch.full_like(self.sampled_steps, self.step_count)})
        rel = self._inst_norm(self.h.map(torch.sub, self.h0)) / self.denom
        parts["eps"] = self._fam_mean(rel)
        # fraction of a family's instances whose h_0 is ~0 (the eps guard divides by the magnitude instead)
        guarded = torch.zeros(self._n_inst, dtype=rel.dtype, device=rel.device)
        guarded[self._guard_at] = (self._guard_val > self._inst_norm(self.h0)[self._guard_at]).to(rel.dtype)
        parts["guarded"] = self._fam_mean(guarded)
        parts["balance"] = self.h0_balance.to(device=self.device, dtype=rel.dtype)
        host = {k: v.double().cpu().tolist() for k, v in parts.items()}
        sums = self._step_sums + self._pending_step_sums()  # (flushed rows + the rows still pending)
        for i, t in enumerate(CUMULATIVE):
            host[f"sum_step_{t}"] = sums[i].tolist()
        kept = self.keep_cumulative
        return {f: {**{k: host[k][i] for k in host}, "cumulative": kept} for i, f in enumerate(self.families)}

    def _pending_step_sums(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(len(CUMULATIVE), families) float64 on the host: per term and family the sum of the drift
        columns of ``rows`` (default: the pending rows), NaN (not decomposed) skipped."""
        nf = len(self.families)
        if rows is None:
            rows = torch.stack(self._rows) if self._rows else None
        if rows is None or not self.drift or rows.shape[0] == 0:
            return torch.zeros(len(CUMULATIVE), nf, dtype=torch.float64, device="cpu")
        at = nf + len(self.groups)  # the drift columns: drift/<family>/<term>, term-major (TERMS order)
        cols = rows[:, at: at + len(CUMULATIVE) * nf].to(torch.float64)
        return cols.nansum(0).view(len(CUMULATIVE), nf).cpu()

    def flush(self) -> list[dict]:
        """Move the pending rows to the host (one sync) and write them to the sinks.

        Returns the rows (dicts with ``step`` and the metric keys), those of a failing sink included.
        Rows with NaN/Inf law values follow ``on_nonfinite``: with ``"raise"``, ``NonFiniteError``
        names the first such step after the rows before it were written."""
        if not self._rows:
            self._write([])  # retries what a failing sink still owes
            return []
        first_step = self.step_count - len(self._rows) + 1
        why = self.stale()
        if why and not self.__dict__.get("_warned_stale"):  # an explicit flush / close: write, and say so once
            self._warned_stale = True
            warn(f"{self._stale_message(why)} (steps {first_step}..{self.step_count} are written; those after "
                          "the change describe the old tensors)", RuntimeWarning)
        host = torch.stack(self._rows).cpu()
        self._step_sums = self._step_sums + self._pending_step_sums(host)  # (a new tensor: a state's copy is not aliased)
        extras = [{k: (float(v) if torch.is_tensor(v) else v) for k, v in e.items()} for e in self._extras]
        extras += [{}] * (len(self._rows) - len(extras))
        check_frozen(self)  # parameters frozen since the last flush: their laws' broken_by (before the monitors)
        mon = {}
        for m in self.monitors:  # one device->host copy per monitor, not one per key
            got = m.metrics()
            if got:
                vals = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device).reshape(())
                                    for v in got.values()]).cpu().tolist()
                mon.update(zip(got.keys(), vals))
        if self._dropped_rows:  # rows a failing sink never got (``max_unwritten``), as of this flush
            mon["sinks/dropped_rows"] = sum(self._dropped_rows.values())
        self._rows, self._extras = [], []
        n_eps = len(self.families) + len(self.groups)
        out, written = [], []
        bad_steps, first_what = [], None
        for i, row in enumerate(host):
            step = first_step + i
            rec = {"step": step, **dict(zip(self.metric_names, row.tolist())), **extras[i]}
            if i == len(host) - 1:
                rec.update(mon)
            out.append(rec)
            if torch.isfinite(row[:n_eps]).all():
                written.append(rec)
                continue
            bad = [n for n, x in zip(self.metric_names, row.tolist()) if not math.isfinite(x)][:3]
            what = (f"law values are NaN/Inf at step {step} ({', '.join(bad)}): the parameters diverged; lower the "
                    "learning rate or check the gradients" + self._half_hint())
            if self.on_nonfinite == "raise":
                if step <= self._nonfinite_reported:  # booked before the error that covered it reached the caller
                    self.nonfinite_skipped += 1
                else:
                    bad_steps.append(step)
                    first_what = first_what or what
                continue
            if self.on_nonfinite == "warn":
                written.append(rec)
                if not self._warned_nonfinite:
                    warn(f"conserve: {what} (on_nonfinite='warn': rows are written, NaN as null)",
                                  RuntimeWarning)
            else:
                self.nonfinite_skipped += 1
                if not self._warned_nonfinite:
                    warn(f"conserve: {what} (on_nonfinite='skip': such rows are not written; count in "
                                  "tracker.nonfinite_skipped)", RuntimeWarning)
            self._warned_nonfinite = True
        self._write(written)
        if written:
            self.last_record = written[-1] if bad_steps else out[-1]
        if bad_steps:
            self._nonfinite_reported = self.step_count
            more = f"; {len(bad_steps) - 1} more non-finite step(s) up to {bad_steps[-1]}" if len(bad_steps) > 1 else ""
            self.nonfinite_skipped += len(bad_steps)
            raise NonFiniteError(f"{first_what}{more} (the finite rows were written, the non-finite ones are not; "
                                 "steps booked before this error reaches you are not reported again)")
        return out

    def _half_hint(self) -> str:
        """The likelier cause when float16 weights are tracked: a small optimizer eps (Adam's 1e-8) is 0 in
        float16 (its smallest subnormal is 6e-8), so a first step divides 0 by 0."""
        if not any(t.dtype == torch.float16 for t in self.tensors):
            return ""
        return ("; with float16 weights an optimizer eps below 6e-8 (Adam's default 1e-8) is 0 in float16: keep "
                "float32 weights under torch.autocast, use bfloat16, or raise eps")

    def _write(self, recs: list[dict]) -> None:
        """Write ``recs`` to every sink, each sink isolated from the others' failures.

        A sink first gets the rows it still owes (``unwritten``), in order; at the first row it fails
        on, it keeps that row and the later ones, and one line names the sink, step and error (once per
        failure spell, again after it recovered).  It keeps at most ``max_unwritten`` of them: beyond
        that the oldest are dropped, counted in ``dropped`` (one warning per sink names the fix)."""
        for s in self.sinks:
            owed = self._unwritten.get(id(s))
            todo = owed + list(recs) if owed else recs
            for i, r in enumerate(todo):
                try:
                    s.write(r["step"], r)
                except Exception as e:  # noqa: BLE001 - any sink error: keep the rows, keep training
                    self._unwritten[id(s)] = self._bounded(s, todo[i:])
                    if id(s) not in self._failing:
                        self._failing.add(id(s))
                        warn(f"conserve: sink {s!r} failed at step {r['step']} ({type(e).__name__}: {e}); its "
                                      f"rows are kept in memory (tracker.unwritten, up to tracker.max_unwritten="
                                      f"{self.max_unwritten}) and retried at the next flush, the other sinks are "
                                      "written; fix the sink (disk space, permissions, network)",
                                      RuntimeWarning)
                    break
            else:
                self._unwritten.pop(id(s), None)
                self._failing.discard(id(s))

    def _bounded(self, s, left: list[dict]) -> list[dict]:
        """``left`` (rows sink ``s`` still owes, oldest first) cut to the newest ``max_unwritten``; the rows
        cut are counted in ``dropped`` and told once per sink (one line naming the fix)."""
        cap = max(0, int(self.max_unwritten))
        n = len(left) - cap
        if n <= 0:
            return left
        dropped = self._dropped_rows
        dropped[id(s)] = dropped.get(id(s), 0) + n
        if id(s) not in self._warned_dropped:
            self._warned_dropped.add(id(s))
            warn(f"conserve: sink {s!r} still fails and owes more than tracker.max_unwritten={cap} rows: the "
                          f"oldest are dropped for it, from step {left[0]['step']} on (counted in tracker.dropped and "
                          "the rows' sinks/dropped_rows; the other sinks keep every row); fix the sink (disk space, "
                          "permissions, network), or raise tracker.max_unwritten to keep more in memory",
                          RuntimeWarning)
        return left[n:]

    @property
    def unwritten(self) -> dict:
        """Per sink that failed, the rows it has not written yet (oldest first): ``{sink: [row, ...]}``."""
        return {s: list(self._unwritten[id(s)]) for s in self.sinks if self._unwritten.get(id(s))}

    @property
    def dropped(self) -> dict:
        """Per sink, how many rows it never got: it kept failing while it owed more than
        ``max_unwritten`` rows, so the oldest were dropped (``{sink: count}``; the other sinks have them)."""
        return {s: self._dropped_rows[id(s)] for s in self.sinks if self._dropped_rows.get(id(s))}

    def close(self) -> None:
        """Flush what is pending and close the sinks (each isolated: a failing ``close`` is reported,
        the others still close). Rows a sink could not write stay in ``unwritten``, with a warning.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            self.flush()
        finally:
            for s in self.sinks:
                left, lost = self._unwritten.get(id(s)), self._dropped_rows.get(id(s), 0)
                if left or lost:
                    kept = (f"could not write {len(left)} row(s) (steps {left[0]['step']}..{left[-1]['step']}); they are "
                            "in tracker.unwritten") if left else "wrote every row it kept"
                    more = (f"; {lost} older row(s) were dropped for it (tracker.dropped; max_unwritten="
                            f"{self.max_unwritten})") if lost else ""
                    warn(f"conserve: sink {s!r} {kept}{more}", RuntimeWarning)
                try:
                    s.close()
                except Exception as e:  # noqa: BLE001
                    warn(f"conserve: closing sink {s!r} failed ({type(e).__name__}: {e})", RuntimeWarning)

    # ------------------------------------------------------------------------------- lifecycle
    on_nonfinite = property(lambda self: self.__dict__.get("_on_nonfinite", "raise"), doc="NaN/Inf row policy")

    @on_nonfinite.setter
    def on_nonfinite(self, policy: str) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={policy!r}: use one of {', '.join(map(repr, NONFINITE_POLICIES))}")
        self.__dict__["_on_nonfinite"] = policy

    # state of the lifecycle and of the sink isolation (class defaults: no edit of __init__ needed)
    _closed = False
    _warned_nonfinite = False
    nonfinite_skipped = 0
    _nonfinite_reported = 0  # steps up to this one were covered by a NonFiniteError already raised
    max_unwritten = 10_000  # rows a failing sink may owe (``_write``): beyond it the oldest are dropped (``dropped``)

    @property
    def _unwritten(self) -> dict:
        return self.__dict__.setdefault("_unwritten_rows", {})

    @property
    def _failing(self) -> set:
        return self.__dict__.setdefault("_failing_sinks", set())

    @property
    def _dropped_rows(self) -> dict:
        return self.__dict__.setdefault("_dropped_by_sink", {})

    @property
    def _warned_dropped(self) -> set:
        return self.__dict__.setdefault("_warned_dropped_sinks", set())

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # keep what was recorded, without hiding the error that ends the block
            self.close()
        except Exception as e:  # noqa: BLE001
            warn(f"conserve: closing the tracker after {exc_type.__name__} failed too "
                          f"({type(e).__name__}: {e})", RuntimeWarning)

    def _close_at_exit(self) -> None:
        """Flush and close a tracker its user never closed (garbage collection, interpreter exit)."""
        if self._closed or "cumulative" not in self.__dict__:  # closed, or __init__ did not finish
            return
        if getattr(self, "world", 1) > 1:  # a collective flush needs every rank: not at exit
            if self._rows or getattr(self, "_pend", None):
                print(f"conserve: a DistributedTracker was not closed; its pending rows are lost "
                      "(call close() on every rank, or use `with`)", file=sys.stderr)
            self._closed = True
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001
            print(f"conserve: flushing an unclosed tracker failed: {type(e).__name__}: {e}", file=sys.stderr)

    def __del__(self):
        if _tracing():  # collected while torch.compile traces (fake tensors): flush at exit instead
            _DEFERRED.append(self)
            return
        self._close_at_exit()

    def __deepcopy__(self, memo) -> "Tracker":
        """An independent tracker over the copies of the tensors (as ``copy.deepcopy`` of the optimizer
        and model in the same call makes them), without sinks: a snapshot, not a second writer."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        skip = _SNAPSHOT_RESET
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.copy(skip[k]) if k in skip else copy.deepcopy(v, memo)
        # the bindings follow a model copied in the same call (else the copy has none: nothing to check)
        root = self.__dict__["_bound"]() if self.__dict__.get("_bound") is not None else None
        if root is not None and id(root) in memo:
            new._bound = weakref.ref(memo[id(root)])
        new._accept_weights()  # the copies' version counters start afresh
        _LIVE.add(new)
        return new

    def __getstate__(self) -> dict:
        """Pickling keeps the series (values, pending rows, cumulative terms) without the sinks, as
        ``copy.deepcopy`` does: an unpickled tracker is a snapshot, not a second writer (set ``sinks``)."""
        skip = _SNAPSHOT_RESET  # (weak references to the model's modules do not pickle)
        return {k: (copy.copy(skip[k]) if k in skip else v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        denom = state.pop("denom", None)  # (pickled before the denominators were formed when read)
        self.__dict__.update(state)
        if denom is not None and "_guard_at" not in state:
            self.denom = denom
        if "params" in state:
            self._accept_weights()  # the unpickled tensors' version counters start afresh
        _LIVE.add(self)

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Everything needed to continue the same series: ``h0``, ``h_k``, the guards, the cumulative
        drift terms (``{}`` for a tracker that keeps none: ``cumulative``), the per-step norm sums
        (``step_sums``) and the step counter. Pending rows are flushed to the sinks first (one host
        sync), so a run resumed from this state neither repeats nor loses a row."""
        self.flush()
        return {"step": self.step_count, "h0": self.h0.state(), "h": self.h.clone().state(), "denom": self.denom,
                # copies: the tracker sums into its buffers in place
                "cumulative": {k: v.clone().state() for k, v in self.cumulative.items()} if self.keep_cumulative else {},
                "step_sums": self._step_sums.clone(), "laws": [l.name for l in self.laws],
                "sampled_steps": self.sampled_steps.clone(), "balance": self.h0_balance,
                "pending": torch.stack(self._rows) if self._rows else None,
                "pending_extras": copy.deepcopy(self._extras),
                "monitors": [m.state_dict() if hasattr(m, "state_dict") else None for m in self.monitors]}

    def check_state(self, state: Mapping) -> None:
        """Raise ``ValueError`` (one line naming the fix) if ``state`` (from ``state_dict``) was saved for other
        laws or other law sizes; changes nothing.  The optimizers call it before loading their own state, so a
        refused state leaves optimizer and tracker as they were.  (A distributed state keeps its law names
        in its packed metadata: only the sizes are checked here, ``load_state_dict`` checks the names.)
        A state that is not one (empty, truncated, garbled values) raises ``ValueError`` naming the entry, and
        a state saved without the per-entry cumulative sums (``cumulative`` not kept) given to a tracker that
        keeps them raises ``ValueError`` naming ``cumulative=False`` (they cannot be rebuilt).  The reverse is
        loaded (``load_state_dict`` drops them, with a warning)."""
        bad = _state_problem(state)
        if bad:
            raise ValueError(f"tracker state is not one saved by Tracker.state_dict: {bad}; resume from an intact "
                             "checkpoint, or drop its 'conserve' entry to load the optimizer state alone (the "
                             "tracker then starts a new series)")
        if "laws" in state and list(state["laws"]) != [l.name for l in self.laws]:
            raise ValueError("tracker state was saved for a different set of laws; build the tracker with the same "
                             "model and laws as the saved run")
        if self.keep_cumulative and "cumulative" in state and not state["cumulative"]:
            raise ValueError("tracker state was saved without the per-entry cumulative drift sums (cumulative not "
                             "kept: sampled drift, or cumulative=False), which this tracker keeps; build it with "
                             "cumulative=False to resume that run (totals() then reports no per-entry decomposition)")
        shapes = lambda v: {k: tuple(t.shape) for k, t in v.items()}  # noqa: E731
        if "h0" in state and shapes(state["h0"]) != shapes(self.h0.state()):  # same names, other sizes (hidden, heads)
            raise ValueError(f"tracker state was saved for laws of other sizes (law values {shapes(state['h0'])}, this "
                             f"tracker's {shapes(self.h0.state())}); build the tracker with the same model sizes as "
                             "the saved run")

    def load_state_dict(self, state: Mapping) -> None:
        """Continue the series of ``state`` (from ``state_dict``). Sinks with ``resume(step)`` are told the
        last step the saved run wrote, so the JSONL file and TensorBoard drop what came after it.
        Raises ``ValueError`` (``check_state``) before anything is changed."""
        self.check_state(state)
        dev = self.device
        self.step_count = int(state["step"])
        self.h0, self.h = Values.from_state(state["h0"], dev), Values.from_state(state["h"], dev)
        self._h_own = None  # (the state's tensors, maybe the caller's: never written into)
        self.denom = state["denom"].to(dev)
        if self.keep_cumulative:
            # copies: the tracker sums into them in place (the state's tensors are not aliased)
            self.cumulative = {k: Values.from_state(v, dev).clone() for k, v in state["cumulative"].items()}
            self.cumulative.setdefault("measured", self.h0.map(torch.zeros_like))  # states saved before v2
        elif state["cumulative"]:
            warn("conserve: the tracker state holds per-entry cumulative drift sums, which this tracker does "
                          "not keep (sampled drift, or cumulative=False): they are dropped and totals() reports no "
                          "per-entry decomposition; build the tracker with cumulative=True to continue them",
                          RuntimeWarning)
        sums = state.get("step_sums")  # states saved before it: unknown (NaN), never restarted from 0
        self._step_sums = (sums.detach().to("cpu", torch.float64).clone() if sums is not None
                           else torch.full_like(self._step_sums, float("nan")))
        if state.get("sampled_steps") is not None:
            self.sampled_steps = state["sampled_steps"].to(dev).clone()  # summed into in place
        if state.get("balance") is not None:  # |h_0| / magnitude of the saved run's theta_0, per family
            self.h0_balance = state["balance"].to(dev)
        elif state.get("h0_balance") is not None:  # (states saved before: per instance)
            self.h0_balance = self._fam_mean(state["h0_balance"].to(dev))
        self._rows = list(state["pending"].to(dev)) if state.get("pending") is not None else []
        self._extras = copy.deepcopy(list(state.get("pending_extras", [])))
        for m, s in zip(self.monitors, state.get("monitors", [])):
            if s is not None and hasattr(m, "load_state_dict"):
                m.load_state_dict(s)
        # a resume: the weights are loaded around it (before or after, in place: DCP, load_state_dict), so they
        # are compared from the first step booked after it on (check_outside)
        self._versions = None
        written = self.step_count - len(self._rows)  # the last step the saved run had written
        for s in self.sinks:  # one series: sinks drop what an earlier run wrote after it
            if hasattr(s, "resume"):
                s.resume(written)


# what a copy or an unpickled tracker starts afresh (a snapshot, not a second writer): each is copied
# (``copy.copy``) into the new tracker, never shared
_SNAPSHOT_RESET = {"sinks": [], "_idle_sinks": [], "_unwritten_rows": {}, "_failing_sinks": set(), "_dropped_by_sink": {},
                   "_warned_dropped_sinks": set(), "_closed": False, "_bound": None}


def _state_problem(state) -> str | None:
    """What makes ``state`` not a ``Tracker.state_dict`` (nor a distributed one, with ``"meta"``), or None."""
    if not isinstance(state, Mapping):
        return f"it is a {type(state).__name__}, not a dict"
    need = ("h0", "h", "denom", "cumulative") + (("meta", "pending") if "meta" in state else ("step",))
    missing = [k for k in need if k not in state]
    if missing:
        return f"it lacks {missing}" + (" (it is empty)" if not state else "")
    tensor = lambda v: isinstance(v, torch.Tensor)  # noqa: E731

    def values(v) -> bool:  # a Values.state(): {"vec": tensor, "gram<d>": tensor, ...}
        return isinstance(v, Mapping) and tensor(v.get("vec")) and all(tensor(t) for t in v.values())

    step = state.get("step", 0)
    if isinstance(step, bool) or not (isinstance(step, numbers.Integral) or (tensor(step) and step.numel() == 1)):
        return f"'step' is {step!r}, not an integer"
    for k in ("h0", "h"):
        if not values(state[k]):
            return f"{k!r} is a {type(state[k]).__name__}, not the law values"
    if not tensor(state["denom"]):
        return f"'denom' is a {type(state['denom']).__name__}, not a tensor"
    cum = state["cumulative"]
    if not isinstance(cum, Mapping) or not all(values(v) for v in cum.values()):
        return "'cumulative' is not the drift terms' law values"
    for k in ("sampled_steps", "balance", "h0_balance", "pending", "step_sums"):
        if state.get(k) is not None and not tensor(state[k]):
            return f"{k!r} is a {type(state[k]).__name__}, not a tensor"
    for k in ("laws", "pending_extras", "monitors"):
        if state.get(k) is not None and not isinstance(state[k], (list, tuple)):
            return f"{k!r} is a {type(state[k]).__name__}, not a list"
    if "meta" in state and not isinstance(state["meta"], (bytes, bytearray)):
        return f"'meta' is a {type(state['meta']).__name__}, not the packed metadata"
    return None


class DriftTerms(dict):
    """``Tracker.assemble``'s result: ``{"decay", "first", "second"}`` -> ``Values``, views of rows 1-3
    of ``buf``, the step scratch ``record_step`` forms the five terms in (it takes ``buf`` and squares
    it in place: pass them to one ``record_step``).  ``at``: the ``_Entries`` they hold when compact
    (None: the full law layout), ``h_old``: then ``h_k`` at those entries (taken once per step)."""

    __slots__ = ("at", "buf", "h_old")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at = self.buf = self.h_old = None


class _Deferred:
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

    def raise_booked(self, tracker: "Tracker", booked: int | None) -> None:
        """Raise the held error, if any, after setting ``tracker._nonfinite_reported = booked`` (None:
        leave it to the caller that books the remaining steps)."""
        if self.err is not None:
            if booked is not None:
                tracker._nonfinite_reported = booked
            raise self.err


def _selector(ids: np.ndarray, device):
    """Sorted distinct indices ``ids`` as a ``slice`` when they are one run of consecutive integers (every
    sampler group's are: a unit is a run of the layout, a group consecutive units), so selecting them
    is a view and nothing is held; else an int32 index tensor on ``device`` (4 bytes per index)."""
    if len(ids) == 0 or int(ids[-1]) - int(ids[0]) + 1 == len(ids):
        return slice(int(ids[0]) if len(ids) else 0, int(ids[-1]) + 1 if len(ids) else 0)
    return torch.from_numpy(ids).to(device, torch.int32)


def _add_at(x: torch.Tensor, sel, y: torch.Tensor) -> None:
    """``x[sel] += y`` in place (``sel``: a ``_selector``; each selected entry gets one addition)."""
    if isinstance(sel, slice):
        x[sel].add_(y)
    else:
        x.index_add_(0, sel, y)


class _Entries:
    """The entries of a partial drift step (``Mask``), for terms in the compact layout: ``vec`` / ``slots[D]``
    / ``flat`` select them in the vec layout, each D's Gram slots and the flat layout of ``_fam_all``
    (``_selector``: slices, or int32 index tensors when not one run); ``size`` of them; the compact
    scratch layout ``[vec | per-slot sums | Gram matrices]`` of ``Tracker._views``; ``assembly``, the
    drift assembly in this layout (``Assembly.restrict``).  Built once per sampler group from the
    mask's host arrays and cached per ``Mask.key`` (``Tracker._entries``).  Held per group: a few
    Python objects, the assembly's set-id runs (a few, 8 bytes each) and, for selections that are
    not one run, 4 bytes per entry (index) + 1 (linear flag); none for the samplers' groups (every
    group is one run of the layout: slices and views)."""

    __slots__ = ("vec", "slots", "flat", "size", "flat_at", "layout", "assembly")

    def __init__(self, tr: "Tracker", mask: Mask):
        dev = tr.device
        vi = np.flatnonzero(mask.vec_np)
        si = {d: np.flatnonzero(mask.gram_np[d]) for d in tr._gram_ds}
        self.vec, self.slots = _selector(vi, dev), {d: _selector(x, dev) for d, x in si.items()}
        self.flat = _selector(np.concatenate([vi] + [tr._flat_at[d] + si[d] for d in tr._gram_ds]), dev)
        self.size = len(vi) + sum(len(x) for x in si.values())
        nv, at, self.flat_at = len(vi), len(vi), {}
        for d in tr._gram_ds:
            self.flat_at[d] = at
            at += len(si[d])
        spans = []
        for d in tr._gram_ds:
            n = len(si[d])
            spans.append((d, at, at + n * d * d, (n, d, d)))
            at += n * d * d
        self.layout = (at, nv, spans)
        # the assembly in this layout (slices: its per-entry flags are views of the parent's)
        host = lambda sel, ids: sel if isinstance(sel, slice) else ids  # noqa: E731
        self.assembly = tr.assembly.restrict(host(self.vec, vi), {d: host(self.slots[d], si[d]) for d in si})

    def families(self, tr: "Tracker") -> torch.Tensor:
        """(size,) int32: the family of each of these entries (gathered per call: not held)."""
        held = tr.__dict__.get("_fam_all_held")
        return held[self.flat] if held is not None else tr._inst_fam.index_select(0, tr._inst_all[self.flat])

    def take(self, v: "Values") -> tuple:
        """``(vec, {D: grams})`` of ``v`` at these entries (views for slices, else gathered copies): read only."""
        return v.vec[self.vec], {d: g[self.slots[d]] for d, g in v.grams.items()}


def decay_factors(optimizer, tensors: Sequence[torch.Tensor]) -> list:
    """``decay_factor`` of each tensor's param group (1.0 for a tensor the optimizer does not hold),
    computed once per group."""
    if optimizer is None:
        return [1.0] * len(tensors)
    of, per_param = {}, per_param_decay(optimizer)
    for g in optimizer.param_groups:
        a = decay_factor(optimizer, g)
        for p in g["params"]:
            of[id(p)] = decay_factor(optimizer, g, p) if per_param else a  # (a tensor is in one group only)
    return [of.get(id(t), 1.0) for t in tensors]


def stepped_factors(a: Sequence, params: Sequence[torch.Tensor]) -> list[float]:
    """``a`` as floats, 1.0 for a parameter whose ``.grad`` is None after the step: torch optimizers (and
    conserve's fused ones) skip such a parameter, so it is not decayed either (read after the step, so
    the gradients a ``step(closure)`` computes count)."""
    return [1.0 if p.is_leaf and p.grad is None else float(x) for p, x in zip(params, a)]  # (no .grad warning
    # for a non-leaf tensor given as ``params=``: no optimizer holds it, its factor is 1 already)


_LIVE: "weakref.WeakSet[Tracker]" = weakref.WeakSet()  # trackers not closed yet
_DEFERRED: list = []  # unclosed trackers collected during a torch.compile trace, closed at exit


def _tracing() -> bool:
    """True while torch.compile traces (a flush there would see fake tensors)."""
    try:
        from torch._guards import detect_fake_mode

        return bool(torch.compiler.is_compiling() or detect_fake_mode() is not None)
    except Exception:  # noqa: BLE001 - older torch: no tracing to detect
        return False


@atexit.register
def _close_live_trackers() -> None:
    """At interpreter exit, flush and close every tracker nobody closed (rows are not lost)."""
    for t in list(_LIVE) + _DEFERRED:
        t._close_at_exit()


_unwrap = unwrap  # the name the tracker's methods use


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    """``root.get_submodule(path)``, or None where the path no longer leads to a module."""
    mod = root
    for part in path.split(".") if path else ():
        mod = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        if mod is None:
            return None
    return mod


def _model_laws(model: nn.Module):
    if hasattr(model, "conservation_laws"):
        return model.conservation_laws()
    from .detection import detect

    found = detect(model)
    return found.laws, found.declined
