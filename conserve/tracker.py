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
import os
import sys
import weakref
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from . import kernels
from .detection import detect
from .wrappers import unwrap
from .errors import NonFiniteError, StaleParameterError, warn
from .laws import Compiled, Declined, Law, compile_laws
from .tracking.breakers import (BreakerState, check_frozen, check_optimizer, decay_factor,  # noqa: F401  (decay_factor: re-exported)
                                 per_param_decay)
from .tracking.gradients import GradientCheckWarning, GradientWatch
from .tracking.book import GUARD, Book, Layout  # noqa: F401  (GUARD: re-exported)
from .tracking.drift import Assembly, Mask, Sampler, StepStats, drift_pieces
from .tracking.values import (CUMULATIVE, TERMS, CumulativeNotKept, Deferred, DriftTerms, NotKept,  # noqa: F401
                              Values, abs_plan)

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


def record_once(owner, tracker, steps: int, scalars: dict) -> None:
    """``tracker.record(**scalars)``, except keys already recorded since step ``steps`` (the count of steps
    ``owner`` booked): the step in between was skipped (GradScaler), so the later values are not booked
    (one ``RuntimeWarning`` per ``owner``) and the row keeps the values of the step it belongs to."""
    seen = owner.__dict__.get("_recorded")
    if seen is None or seen[0] != steps:
        seen = owner.__dict__["_recorded"] = (steps, set())
    again = [k for k in scalars if k in seen[1]]
    if again:
        if not owner.__dict__.get("_warned_skip"):
            owner.__dict__["_warned_skip"] = True
            warn(f"conserve: record({', '.join(again)}=...) twice without an optimizer step in between "
                          "(the step was skipped, e.g. by GradScaler): the values of the step that ran are kept, "
                          "the later ones are not booked", RuntimeWarning)
        scalars = {k: v for k, v in scalars.items() if k not in seen[1]}
        if not scalars:
            return
    tracker.record(**scalars)
    seen[1].update(scalars)


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
            terms over the decomposed (entry, step) pairs (4 law-sized copies held for the whole run; law
            values are a small fraction of the weights they read).  ``None`` (default):
            kept only when every (entry, step) pair is decomposed (``drift`` with ``drift_every=1`` and
            ``snapshot_budget=None``, the exact mode); ``True``: always; ``False``: never.  Without
            them ``totals()`` has no per-entry decomposition (no ``decay``/``first``/``second``/
            ``predicted``/``predicted_no_first``/``measured_sampled``): it gives ``measured`` (from
            ``h`` and ``h_0``), ``eps``, the guards and, per family, ``sum_step_<term>``, the sum over
            the drift steps of each step's family norm (a sum of norms: an upper bound of the norm of
            the summed term, not that norm), with ``cumulative: False``; ``cumulative`` is then an empty
            ``CumulativeNotKept`` dict whose items raise a ``KeyError`` naming this option.
        check_gradients: on the drift cadence, check that the gradient the optimizer is about to apply
            (after unscaling, clipping and the DDP/FSDP2 reduction) is a gradient of the model's output:
            every exact law's first-order product with it must be at the rounding floor of its dtype
            (spec "Gradient integrity", ``conserve.analysis.gradcheck``).  The rows get
            ``grad_check/<family>`` and ``grad_check/<family>/layer<i>`` (the step's worst ratio; NaN on
            steps not checked); a flush warns once per newly flagged law or family aggregate
            (``GradientCheckWarning``); ``gradient_check()`` gives the whole result.  A parameter whose
            ``.grad`` is None on a step is checked as a zero gradient.  Cost per checked step: one pass over
            the checked laws' weights and gradients on a GPU (``conserve.kernels.check_sums``), two with the
            CPU's torch twin.
        grad_check_ignore: law names, families or ``fnmatch`` patterns of law or parameter names the check
            leaves out (e.g. ``["translation"]`` for a loss other than softmax cross-entropy).
        loss: the training loss, for the check's loss-dependent laws: ``"ce"`` (softmax cross-entropy of the
            logits) checks the translation laws; None: they are checked when the laws were given as a list or
            by a ``Detection`` made with ``loss="ce"``, and with a note in the warning when detection
            assumed the loss.
        grad_dtype: the dtype the gradients are computed in, which sets the floors: ``"bfloat16"`` under
            bf16 autocast (the parameters' ``.grad`` are float32, their rounding bf16's); default the
            parameters' dtype.
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
    10,000; a row is a dict of ``len(metric_names)`` floats): beyond that its oldest
    rows are dropped, told once (one line naming the fix) and counted in ``dropped`` ({sink: rows}), in the
    ``sinks/dropped_rows`` key of each later flush's last row (all sinks, as the flush began) and in
    ``close()``'s warning.
    ``copy.deepcopy`` gives an independent tracker without sinks (a snapshot: set ``sinks`` to write).
    """

    world = 1  # the ranks whose shares make one row (DistributedTracker: its world size)
    rank = 0  # this process's rank among them (warnings that every rank would repeat come from rank 0)

    def __init__(self, model: nn.Module | None = None, laws: Sequence[Law] | None = None, *, every: int = 50,
                 sinks: Iterable = (), drift: bool = True, fp64: bool = False, backend: str = "auto",
                 monitors: Iterable = (), params: Mapping[str, torch.Tensor] | None = None,
                 on_nonfinite: str = "raise", drift_every: int | str = AUTO,
                 snapshot_budget: float | None | str = AUTO, keep_last: bool = False,
                 cumulative: bool | None = None, check_gradients: bool = False, grad_check_ignore: Iterable[str] = (),
                 grad_dtype=None, loss: str | None = None):
        # the lifecycle and the sink isolation (first: a tracker whose construction raises is collected too)
        self._closed = False  # close() ran: later steps are not booked
        self._warned_closed = self._warned_outside = self._warned_stale = self._warned_nonfinite = False
        self._on_nonfinite = "raise"
        self.nonfinite_skipped = 0  # non-finite rows not written
        self._nonfinite_reported = 0  # steps up to this one were covered by a NonFiniteError already raised
        self.max_unwritten = 10_000  # rows a failing sink may owe (``_write``): beyond it the oldest are dropped
        self._unwritten: dict = {}  # id(sink) -> rows it still owes
        self._failing: set = set()  # id(sink) of the sinks failing now
        self._dropped_rows: dict = {}  # id(sink) -> rows dropped for it (``max_unwritten``)
        self._warned_dropped: set = set()  # id(sink) of the sinks whose drops were told
        self._idle_sinks: list = []  # sinks held but not written (a DistributedTracker's other ranks)
        self._built = False  # __init__ finished (a tracker whose construction raised has nothing to flush)
        self._pid = os.getpid()  # the process whose sinks these are: a forked copy (a DataLoader worker) never writes
        self._bound = None  # a weak reference to the model whose parameters are tracked (``stale``)
        self._versions: list[int] | None = None  # the tracked tensors' version counters (``check_outside``)
        self._h_own = None  # ``h`` when its buffers are the tracker's own (``_eval_into_h``)
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
        named = dict(params) if params is not None else dict(unwrap(model).named_parameters())
        self.declined: list[Declined] = []
        detection = None  # the Detection the laws come from, when given one (its loss: named or assumed)
        given_laws = laws is not None
        if laws is None:
            laws, self.declined = model_laws(unwrap(model))
        elif hasattr(laws, "laws") and hasattr(laws, "declined"):  # a Detection (conserve.detect(model, loss="ce"))
            detection = laws
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
        self._bound = weakref.ref(unwrap(model)) if params is None and model is not None else None
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
        self.layout = Layout(self.compiled, self.device, drift, grad_check=bool(check_gradients))
        self.families, self.groups, self.metric_names = self.layout.families, self.layout.groups, self.layout.metric_names
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
        self.last_record: dict | None = None
        self.broken_by: dict[str, str] = {}  # law name -> why the optimizer breaks it (check_optimizer)
        self.breakers = BreakerState()  # what the breaker checks keep (conserve.tracking.breakers)
        # the gradient check (``check_gradients``): its accumulator, and the columns of the step being booked
        self.grad_watch = None
        if check_gradients:
            # a loss-dependent law (translation: softmax cross-entropy) is checked when the user named the loss
            # (laws given as a list, or a Detection made with loss=...), and with a note when detection assumed it
            explicit = loss is not None or (detection is None and given_laws)
            named = loss if loss is not None else ("ce" if explicit else getattr(detection, "loss", None))
            self.grad_watch = GradientWatch(kept, dict(zip(self.compiled.names, self.params)), self.families,
                                            self.groups, ignore=grad_check_ignore, dtype=grad_dtype, loss=named,
                                            loss_assumed=not explicit and named is None)
        self._grad_row: torch.Tensor | None = None
        self._setup()
        with torch.no_grad():
            self.h0, mag = self._initial_values()
        keep = (bool(drift) and drift_every == 1 and snapshot_budget is None) if cumulative is None else cumulative
        self.book = Book(self.layout, self.h0, mag, drift=drift, keep_cumulative=keep)
        del mag  # (the magnitudes' law values: only their instance norms are kept)
        self.h = self.h0.clone()  # (once the norms' temporaries are freed: h_0, h and one of them at most)
        self._h_own = self.h  # h's buffers are the tracker's own: later evaluations write into them (_eval_into_h)
        self._versions = self._tensor_versions()  # the weights h_0 was evaluated on (``check_outside``)
        self._built = True
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
        mag = Values(*kernels.evaluate(abs_plan(self.compiled.plan), self.tensors, fp64=self.fp64, backend=self.backend))
        return self._eval(self.tensors), mag

    # ------------------------------------------------------------------------------------ layout
    @property
    def denom(self) -> torch.Tensor:
        """(instances,) the ``eps`` denominators (``conserve.tracking.book.guarded_denominators``): formed when
        read from ``h_0``; only the guarded instances' values are held.  Setting it (construction,
        ``load_state_dict``) keeps those."""
        return self.book.denominators(self.h0)

    @denom.setter
    def denom(self, value: torch.Tensor) -> None:
        self.book.set_denominators(self.h0, value)

    @property
    def cumulative(self) -> dict:
        """Per ``CUMULATIVE`` term, its per-entry sum over the decomposed (entry, step) pairs (``Values``), when
        kept (``cumulative=``); else an empty ``CumulativeNotKept``."""
        return self.book.cumulative

    @cumulative.setter
    def cumulative(self, value: dict) -> None:
        self.book.cumulative = value

    @property
    def keep_cumulative(self) -> bool:
        return self.book.keep_cumulative

    @property
    def sampled_steps(self) -> torch.Tensor:
        """(families,) int64: per family, the drift steps that decomposed some entry of it."""
        return self.book.sampled_steps

    @sampled_steps.setter
    def sampled_steps(self, value: torch.Tensor) -> None:
        self.book.sampled_steps = value

    @property
    def h0_balance(self) -> torch.Tensor:
        """(families,) the mean over each family's instances of ``|h_0|`` / magnitude."""
        return self.book.balance

    @h0_balance.setter
    def h0_balance(self, value: torch.Tensor) -> None:
        self.book.balance = value

    def _eval(self, tensors) -> Values:
        return Values(*kernels.evaluate(self.compiled.plan, tensors, fp64=self.fp64, backend=self.backend))

    def _eval_into_h(self, tensors) -> Values:
        """``h(theta_{k+1})`` written into the held ``h``'s buffers when the tracker made them (its own
        evaluation or construction's clone: ``_h_own``; never a ``Values`` a caller handed to ``record_step``
        or ``load_state_dict``, nor the fused optimizers' ``h``) and returned as that ``h``; else a fresh
        evaluation.  Only where the old ``h`` is no longer read (``after_step``).  The evaluation's checks
        that can raise (views outside their tensors, reserved slots, ``out``'s layout) run before the buffers
        are zeroed, so an error leaves ``h`` as it was."""
        own = self._h_own
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
        bound = self._bound
        root = bound() if bound is not None else None
        if root is None or self.world > 1:  # (a distributed tracker: every rank would have to agree)
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
        if self.world > 1:
            return None
        return [t._version for t in self.params]

    def check_outside(self) -> None:
        """Right before a step: warn once (one line) if a tracked tensor was written in place since the
        last booked step (or since the tracker was built): ``model.load_state_dict`` (pretrained weights
        loaded after the tracker was built), a second optimizer, an EMA or LoRA merge written into the
        weights.  That change is no step of the tracked optimizer: ``eps`` jumps with it (still measured
        against the ``theta_0`` the tracker was built on) and, before a drift step, the drift ``residual``
        holds it.  Reads one version counter per tracked tensor."""
        was = self._versions
        if was is None or self._closed or self._warned_outside:
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

    @property
    def steps_taken(self) -> int:
        """The optimizer steps seen so far (booked, and pending a reduction on a ``DistributedTracker``)."""
        return self.step_count

    def is_drift_step(self) -> bool:
        """Whether the next step (``steps_taken + 1``) decomposes the drift: steps 1, 1 + N, ... for
        ``drift_every`` N (never once closed)."""
        return self.drift and not self._closed and self.steps_taken % self.drift_every == 0

    def _books_after_close(self) -> bool:
        """False once ``close()`` ran: later steps are not booked (their flush would write into closed sinks);
        one warning names how to track them."""
        if not self._closed:
            return True
        if not self._warned_closed:
            self._warned_closed = True
            warn("conserve: the tracker is closed (close() or the end of its `with` block): steps after it "
                          "are not tracked; build a new tracker (conserve.track, or a fused optimizer's track=) to "
                          "track them", RuntimeWarning)
        return False

    @eager
    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer | None = None, gradients: bool = True) -> None:
        """Right before the optimizer step: on a drift step, copy what it reads of ``theta_k`` and take
        each parameter's decay factor ``a``; on the other steps nothing (nor after ``close()``).  ``gradients``:
        the ``.grad`` the step applies are there already (else a closure computes them inside the step:
        ``checked_closure`` checks them then)."""
        self._snap = None
        self.check_bound()  # (a flush is due in this step: the tracked tensors must still be the model's)
        self.check_outside()
        if gradients:
            self.check_step_gradients()
        else:
            self._grad_row = None
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
            hv, hg = self.layout.entries(snap.mask, self.assembly).take(self.h)
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

    def is_grad_check_step(self) -> bool:
        """Whether the next step's gradient is checked (``check_gradients``: on the drift cadence)."""
        return self.grad_watch is not None and not self._closed and self.steps_taken % self.drift_every == 0

    @torch.no_grad()
    def check_step_gradients(self) -> None:
        """Right before the optimizer step applies the gradients: on a checked step (``is_grad_check_step``),
        the first-order product of every checked law with the tracked parameters' ``.grad``, accumulated
        and kept for the step's row (``conserve.tracking.gradients``).  Nothing otherwise."""
        self._grad_row = self.grad_watch.update(dict(zip(self.compiled.names, self.params)), self.steps_taken + 1) \
            if self.is_grad_check_step() else None

    def checked_closure(self, closure):
        """``closure`` (an ``optimizer.step(closure)`` argument that computes the gradients inside the step:
        LBFGS, SAM, Lightning's automatic optimization) that checks the gradient it produced after its first
        call (``check_step_gradients``); ``closure`` itself without the gradient check.

        A step that changes the tracked parameters before its closure runs (SAM's ascent to a perturbed point)
        has its gradient checked where the closure computed it, where it is a gradient; the step applies it
        at the parameters it started from. A ``GradientCheckWarning`` says so once: attaching the tracker to
        the inner optimizer (SAM's ``base_optimizer``) checks the gradient where it is applied."""
        if closure is None or not self.is_grad_check_step():  # (the parameters' versions read on checked steps only)
            return closure
        done = []
        entry = [p._version for p in self.params]

        def run():
            moved = not done and [p._version for p in self.params] != entry
            loss = closure()
            if not done:
                done.append(True)
                self.check_step_gradients()
                if moved and not self.grad_watch.warned_perturbed:
                    self.grad_watch.warned_perturbed = True
                    warn("conserve: this optimizer step changed the parameters before its closure computed the "
                         "gradient (a perturbed point, as SAM's first step makes): the gradient check reads that "
                         "gradient where it was computed, but the step applies it at the parameters it started "
                         "from. To check the gradient where it is applied, attach the tracker to the inner "
                         "optimizer (conserve.optim.attach(sam.base_optimizer, tracker); SAM's ascent and return "
                         "then show as weights changed outside the tracked step)", GradientCheckWarning)
            return loss

        return run

    def gradient_check(self):
        """The gradient check over every checked step so far (``conserve.analysis.gradcheck.GradientCheck``:
        per law ``worst`` and ``aggregate`` against the dtype's floors, ``str()`` reads it), or None without
        ``check_gradients``.  One host copy."""
        return self.grad_watch.result() if self.grad_watch is not None else None

    def _grad_columns(self) -> torch.Tensor | None:
        """The step's ``grad_check`` columns (NaN on a step not checked), taken once; None without the check."""
        if self.grad_watch is None:
            return None
        got, self._grad_row = self._grad_row, None
        return got if got is not None else torch.full((self.grad_watch.width,), float("nan"), device=self.device)

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
        at = self.layout.entries(mask, self.assembly) if compact else None
        if at is None:
            buf, wv, wg = self.layout.scratch((len(TERMS),), self.h.vec.dtype)
            h_old, sampled = (self.h.vec, self.h.grams), mask
        else:  # a compact sub-plan: the pieces, terms and scratch hold the group's entries only
            buf, wv, wg = self.layout.views(torch.empty(len(TERMS), at.layout[0], dtype=self.h.vec.dtype, device=self.device),
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

    def record_step(self, h1: Values, terms: Mapping[str, Values] | None = None, sampled: Mask | None = None) -> None:
        """Book one step given ``h(theta_{k+1})`` and optionally the drift terms (``decay``, ``first``,
        ``second``), e.g. computed by a fused optimizer kernel; ``sampled``: the entries they cover
        (None: all).  Appends one metric row (on device), formed by ``Book.row``.

        Memory: the five per-entry terms of a drift step (``measured``, the three given, ``residual``)
        are formed in one stacked scratch buffer, summed into ``cumulative`` in place (when kept) and
        reduced to the family norms, and dropped after the step (``keep_last``: ``last`` views a copy of it).
        The tracker's own budgeted drift steps (``drift_terms`` over a compact sub-plan) form them over
        the group's entries only (the scratch is the group's size, not five law-sized rows); terms
        given here are in the full layout.  Nothing is booked after ``close()`` (one warning)."""
        if not self._books_after_close():
            return
        deferred = Deferred()
        if len(self._rows) >= self.every:  # flush lazily, so record() can still reach the last row
            deferred.call(self.flush)  # a NonFiniteError is raised once this step is booked
        self.step_count += 1
        row, last = self.book.row(h1, self.h0, self.h, terms, sampled, self.keep_last, self._grad_columns())
        if last is not None:
            self.last = last
        self._rows.append(row)
        if self._h_own is not h1:  # a caller's h1 (after_step marks its own once this returns)
            self._h_own = None
        self.h = h1
        if not self._warned_outside:  # (check_outside warns once: no counters read after that)
            self._versions = self._tensor_versions()  # the weights as this step left them (``check_outside``)
        for m in self.monitors:
            m.update()
        deferred.raise_booked(self, self.step_count)  # this step was booked before the caller saw the error

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
        parts = {"measured": self.layout.fam_norm(self.h.map(torch.sub, self.h0))}
        if self.keep_cumulative:
            c = self.cumulative
            parts.update({"measured_sampled": self.layout.fam_norm(c["measured"]),
                          "decay": self.layout.fam_norm(c["decay"]), "first": self.layout.fam_norm(c["first"]),
                          "second": self.layout.fam_norm(c["second"]),
                          "predicted": self.layout.fam_norm(c["decay"].map(torch.add, c["first"]).map(torch.add, c["second"])),
                          "predicted_no_first": self.layout.fam_norm(c["decay"].map(torch.add, c["second"]))})
        parts.update({"scale": self.layout.fam_norm(self.h0), "sampled_steps": self.sampled_steps,
                      "steps": torch.full_like(self.sampled_steps, self.step_count)})
        rel = self.layout.inst_norm(self.h.map(torch.sub, self.h0)) / self.denom
        parts["eps"] = self.layout.fam_mean(rel)
        # fraction of a family's instances whose h_0 is ~0 (the eps guard divides by the magnitude instead)
        parts["guarded"] = self.book.guarded(self.h0, rel.dtype)
        parts["balance"] = self.h0_balance.to(device=self.device, dtype=rel.dtype)
        host = {k: v.double().cpu().tolist() for k, v in parts.items()}
        sums = self.book.step_sums + self.book.drift_sums(torch.stack(self._rows) if self._rows else None)  # (flushed rows + the rows still pending)
        for i, t in enumerate(CUMULATIVE):
            host[f"sum_step_{t}"] = sums[i].tolist()
        kept = self.keep_cumulative
        return {f: {**{k: host[k][i] for k in host}, "cumulative": kept} for i, f in enumerate(self.families)}

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
        if why and not self._warned_stale:  # an explicit flush / close: write, and say so once
            self._warned_stale = True
            warn(f"{self._stale_message(why)} (steps {first_step}..{self.step_count} are written; those after "
                          "the change describe the old tensors)", RuntimeWarning)
        host = torch.stack(self._rows).cpu()
        self.book.step_sums = self.book.step_sums + self.book.drift_sums(host)  # (a new tensor: a state's copy is not aliased)
        extras = [{k: (float(v) if torch.is_tensor(v) else v) for k, v in e.items()} for e in self._extras]
        extras += [{}] * (len(self._rows) - len(extras))
        check_frozen(self)  # parameters frozen since the last flush: their laws' broken_by (before the monitors)
        if self.grad_watch is not None and self.rank == 0:  # (one host copy of a few per-law values)
            self.grad_watch.report()
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
    @property
    def on_nonfinite(self) -> str:
        """NaN/Inf row policy (``"raise"``, ``"warn"`` or ``"skip"``; see ``Tracker``)."""
        return self._on_nonfinite

    @on_nonfinite.setter
    def on_nonfinite(self, policy: str) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={policy!r}: use one of {', '.join(map(repr, NONFINITE_POLICIES))}")
        self._on_nonfinite = policy

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
        """Flush and close a tracker its user never closed (garbage collection, interpreter exit).  Nothing in a
        forked child process (its copy of the tracker would write the parent's rows into the parent's sinks)."""
        if not self.__dict__.get("_built") or self._closed or os.getpid() != self._pid:
            return  # (__init__ did not finish, possibly before any state was set: nothing to flush)
        if self.world > 1:  # a collective flush needs every rank: not at exit
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
        root = self._bound() if self._bound is not None else None
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
        self._pid = os.getpid()  # unpickled here: this process owns the copy (it has no sinks until given some)
        if denom is not None and "book" not in state:
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
                "step_sums": self.book.step_sums.clone(), "laws": [l.name for l in self.laws],
                "sampled_steps": self.sampled_steps.clone(), "balance": self.h0_balance,
                "pending": torch.stack(self._rows) if self._rows else None,
                "pending_extras": copy.deepcopy(self._extras),
                "grad_check": self.grad_watch.state_dict() if self.grad_watch is not None else None,
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
        self.book.step_sums = (sums.detach().to("cpu", torch.float64).clone() if sums is not None
                           else torch.full_like(self.book.step_sums, float("nan")))
        if state.get("sampled_steps") is not None:
            self.sampled_steps = state["sampled_steps"].to(dev).clone()  # summed into in place
        if state.get("balance") is not None:  # |h_0| / magnitude of the saved run's theta_0, per family
            self.h0_balance = state["balance"].to(dev)
        elif state.get("h0_balance") is not None:  # (states saved before: per instance)
            self.h0_balance = self.layout.fam_mean(state["h0_balance"].to(dev))
        if self.grad_watch is not None and state.get("grad_check") is not None:  # (checked at the steps since 1)
            self.grad_watch.load_state_dict(state["grad_check"])
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
_SNAPSHOT_RESET = {"sinks": [], "_idle_sinks": [], "_unwritten": {}, "_failing": set(), "_dropped_rows": {},
                   "_warned_dropped": set(), "_closed": False, "_bound": None}


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




def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    """``root.get_submodule(path)``, or None where the path no longer leads to a module."""
    mod = root
    for part in path.split(".") if path else ():
        mod = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        if mod is None:
            return None
    return mod


def model_laws(model: nn.Module) -> tuple[list[Law], list[Declined]]:
    """``(laws, declined)`` of ``model``: ``model.conservation_laws()`` where it has one (conserve's reference
    models), else ``conserve.detect(model)``'s."""
    if hasattr(model, "conservation_laws"):
        return model.conservation_laws()
    found = detect(model)
    return found.laws, found.declined
