"""``conserve.track(optimizer, model)``: any torch optimizer, tracked.

The returned ``TrackedOptimizer`` is a ``torch.optim.Optimizer`` that shares ``param_groups``,
``state`` and ``defaults`` with the wrapped optimizer, so LR schedulers, GradScaler and
``zero_grad`` drive the inner one. ``step()`` snapshots the tracked weights, steps the inner
optimizer, then evaluates the laws and drift terms (``conserve.tracker.Tracker``).
``state_dict()`` is the inner state dict plus a ``"conserve"`` entry (ignored by torch optimizers).

It runs ``torch.optim.Optimizer``'s own machinery: step pre/post hooks and state-dict hooks
registered on it fire, ``copy.deepcopy`` copies optimizer and tracker together, GradScaler's
``_step_supports_amp_scaling`` / ``grad_scale`` / ``found_inf`` reach the inner optimizer, and
other attributes of the inner optimizer are readable on the wrapper. The zero-lr step that
``torch.distributed.checkpoint.state_dict`` runs to initialise an empty optimizer state is not
booked as a training step. For DCP, ``OptimizerState(model, opt)`` is the ``Stateful`` that
carries the tracker state next to the optimizer state (``get_optimizer_state_dict`` keeps only
``state`` and ``param_groups``).
"""
from __future__ import annotations

import functools
import sys

import torch

from ..errors import warn
from ..detection import detect
from ..tracker import Tracker, eager, record_once
from ..tracking.distributed import DistributedTracker, wants_distributed
from .fused import FusedOptimizer
from ..tracking.breakers import unwatch, unwrap_optimizer as _unwrap


def unwrap_optimizer(optimizer):
    """Strip the pass-through wrappers training frameworks put around a torch optimizer: accelerate's
    ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` (a ``TrackedOptimizer`` and
    optimizers that change the update are returned as they are)."""
    return _unwrap(optimizer, frameworks_only=True)

__all__ = ["TrackedOptimizer", "OptimizerState", "track", "unwrap_optimizer", "attach"]

# attributes GradScaler sets on / reads from the optimizer it steps: they belong to the inner one
_FORWARDED = ("grad_scale", "found_inf")


def _in_dcp_state_init(depth: int = 8) -> bool:
    """True inside ``torch.distributed.checkpoint.state_dict._init_optim_state`` (its zero-lr step)."""
    f = sys._getframe(1)
    for _ in range(depth):
        f = f.f_back
        if f is None:
            return False
        if f.f_code.co_name == "_init_optim_state" and \
                f.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            return True
    return False


@eager
def _found_inf(found) -> bool:
    return bool(found.item())


def _scaler_skips(optimizer) -> bool:
    """True when ``GradScaler`` steps an optimizer that unscales inside its own step
    (``_step_supports_amp_scaling``, e.g. ``Adam(fused=True)``) and found inf/NaN gradients: that step
    leaves the weights and the state alone, so it is no training step (one host read of ``found_inf``,
    as GradScaler's own skip test of any other optimizer; none when GradScaler set no ``found_inf``)."""
    found = optimizer.__dict__.get("found_inf")
    return found is not None and torch.is_tensor(found) and _found_inf(found)


def _books_training_steps(step):
    """Step the inner optimizer only (nothing booked) for DCP's zero-lr state initialisation and for a
    step GradScaler's ``found_inf`` skips inside the inner optimizer; count the steps that reach the
    tracker (``record`` uses the count to detect skipped steps)."""
    @functools.wraps(step)
    def wrapper(self, closure=None):
        self.__dict__["_stepping"] = True  # the inner optimizer steps inside the tracked one (_OutsideStep)
        try:
            # (not while torch.compile traces: DCP never compiles its state init, and dynamo cannot trace frames)
            if (not torch.compiler.is_compiling() and _in_dcp_state_init()) or _scaler_skips(self.optimizer):
                out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
                self.tracker._accept_weights()  # (a zero-lr / skipped step: no change outside the tracked steps)
                return out
            self.__dict__["_steps"] = self.__dict__.get("_steps", 0) + 1
            return step(self, closure)
        finally:
            self.__dict__["_stepping"] = False
    return wrapper


class _OutsideStep:
    """Step post-hook on the inner optimizer: one warning when it steps outside its ``TrackedOptimizer``
    (``opt.step()`` on the optimizer given to ``conserve.track``, ``GradScaler.step(inner)``): that step
    is not booked (no row; its change shows in the next tracked step's ``residual``). A class, not a
    closure, so the optimizer pickles."""

    def __init__(self, tracked: "TrackedOptimizer"):
        self.tracked = tracked

    def __call__(self, opt, args, kwargs) -> None:
        d = self.tracked.__dict__
        if d.get("_stepping") or d.get("_warned_outside") or getattr(d.get("tracker"), "_closed", False) \
                or torch.compiler.is_compiling() or _in_dcp_state_init():
            return  # (a closed tracker: training goes on untracked, as asked)
        d["_warned_outside"] = True
        if d.get("tracker") is not None:  # the same change: the tracker's in-place check says no more
            d["tracker"].__dict__["_warned_outside"] = True
        warn(f"conserve: {type(opt).__name__}.step() ran outside the optimizer conserve.track returned: "
                      "that step is not tracked (no row; its change shows in the next tracked step's residual); "
                      "step the tracked optimizer (opt = conserve.track(opt, model), also in GradScaler.step(opt))",
                      RuntimeWarning)


def _check_trackable(optimizer) -> None:
    """Refuse what ``TrackedOptimizer`` cannot wrap correctly, before a tracker (and its sinks) is built."""
    if isinstance(optimizer, TrackedOptimizer):
        raise ValueError("this optimizer is already tracked; pass the inner optimizer (`opt.optimizer`)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"conserve.track needs a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                        "pass the torch optimizer itself")
    accumulating = getattr(getattr(optimizer, "gradient_state", None), "num_steps", 1)
    if unwrap_optimizer(optimizer) is not optimizer and isinstance(accumulating, int) and accumulating > 1:
        # accelerate's step() runs on every micro-batch and steps the weights on every num_steps-th only
        raise ValueError(f"conserve.track got accelerate's {type(optimizer).__name__} with gradient accumulation "
                         f"({accumulating} micro-batches per step): its step() also runs on the micro-batches that do "
                         "not step the weights; track the torch optimizer before accelerator.prepare(...), or use "
                         "conserve.integrations.hf.ConserveCallback")


class TrackedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``tracker`` (a ``Tracker``) sees every step. See ``conserve.track``.

    A context manager: ``with conserve.track(opt, model) as opt:`` closes the tracker at the end
    (flushing its rows). Raises ``ValueError`` for accelerate's ``AcceleratedOptimizer`` under
    gradient accumulation (its ``step()`` runs on micro-batches that do not step the weights: track the
    optimizer before ``accelerator.prepare``) and ``TypeError`` if ``optimizer`` is not a
    ``torch.optim.Optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer, tracker: Tracker):
        _check_trackable(optimizer)
        self.__dict__.update(optimizer=optimizer, tracker=tracker, _building=True)
        try:  # Optimizer's own setup (hook tables, the hooked step); the shared attributes stay the inner's
            torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        finally:
            self.__dict__["_building"] = False
        tracker.check_optimizer(optimizer)  # laws whose parameters the param_groups treat differently
        self._watch_outside_steps()

    def _watch_outside_steps(self) -> None:
        inner = unwrap_optimizer(self.optimizer)  # the torch optimizer under accelerate / Lightning wrappers
        if isinstance(getattr(inner, "_optimizer_step_post_hooks", None), dict):
            self.__dict__["_outside_hook"] = inner.register_step_post_hook(_OutsideStep(self))

    # shared with the inner optimizer, so schedulers and GradScaler act on it
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        if not self._building:
            self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        if not self._building:
            self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        if not self._building:
            self.optimizer.defaults = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def __getattr__(self, name):
        # only reached when normal lookup fails: the inner optimizer's own attributes (e.g. a
        # schedule-free optimizer's train()/eval(), GradScaler's grad_scale/found_inf)
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name, value):
        if name in _FORWARDED:
            setattr(self.optimizer, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in _FORWARDED:
            delattr(self.optimizer, name)
        else:
            super().__delattr__(name)

    # copy.deepcopy / pickle: the whole wrapper (Optimizer.__getstate__ keeps only the shared attributes)
    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._patch_step_function()
        # the inner optimizer's copy has no hooks (Optimizer.__getstate__ keeps none): watch its groups again
        self.tracker.check_optimizer(self.optimizer)
        hooks = getattr(unwrap_optimizer(self.optimizer), "_optimizer_step_post_hooks", None) or {}
        if not any(isinstance(h, _OutsideStep) and h.tracked is self for h in hooks.values()):
            self._watch_outside_steps()

    def __enter__(self) -> "TrackedOptimizer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.tracker.__exit__(exc_type, exc, tb)

    @_books_training_steps
    def step(self, closure=None):
        """Step the inner optimizer, then evaluate the laws (no host sync unless a flush is due).

        ``before_step`` copies what the next drift step reads (nothing on the other steps) and
        ``after_step`` books the row; both run outside ``torch.compile`` graphs, so compiling a
        training step that calls this compiles the inner step alone (no guard on tracker state)."""
        self.tracker.before_step(self.optimizer, gradients=closure is None)
        loss = self.optimizer.step(self.tracker.checked_closure(closure)) if closure is not None else self.optimizer.step()
        self.tracker.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if not self._building:  # Optimizer.__init__ re-adds the inner's groups: they are there already
            self.optimizer.add_param_group(param_group)
            self.tracker.check_optimizer(self.optimizer)

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``"conserve"`` (the tracker state; pending rows are
        flushed first). State-dict hooks registered on this optimizer run as for any optimizer."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = {**self.optimizer.state_dict(), "conserve": self.tracker.state_dict()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            got = post_hook(self, sd)
            if got is not None:
                sd = got
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict`` (with or without ``"conserve"``: a plain torch state dict loads the
        inner optimizer and leaves the tracker as it is). A ``"conserve"`` state saved for other laws raises
        ``ValueError`` before anything is loaded (``Tracker.check_state``)."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            got = pre_hook(self, state_dict)
            if got is not None:
                state_dict = got
        state_dict = dict(state_dict)
        tracked = state_dict.pop("conserve", None)
        if tracked is not None:  # a tracker state for other laws raises before the optimizer state is loaded
            self.tracker.check_state(tracked)
        self.optimizer.load_state_dict(state_dict)
        if tracked is not None:
            self.tracker.load_state_dict(tracked)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def record(self, **scalars) -> None:
        """Attach scalars (e.g. ``loss=loss.detach()``) to the current step's metric row.

        A key recorded again before the next step (the step was skipped, e.g. by ``GradScaler`` on
        inf/NaN gradients) keeps the value of the step it belongs to; the later value is not booked
        (one warning)."""
        record_once(self, self.tracker, self.__dict__.get("_steps", 0), scalars)

    def flush(self):
        return self.tracker.flush()

    def close(self) -> None:
        self.tracker.close()

    def __repr__(self) -> str:
        return f"TrackedOptimizer({self.optimizer!r}, laws={len(self.tracker.laws)})"


class OptimizerState:
    """A ``torch.distributed.checkpoint`` ``Stateful`` for a tracked optimizer: the optimizer state by
    parameter name (``get_optimizer_state_dict``, which reshards under FSDP) plus the tracker state
    under ``"conserve"`` (``get_optimizer_state_dict`` alone keeps only ``state`` and ``param_groups``).

    Args:
        model: the module the optimizer steps (as given to ``get_optimizer_state_dict``).
        optimizer: a ``TrackedOptimizer`` or a fused conserve optimizer built with ``track=``.
        options: ``torch.distributed.checkpoint.state_dict.StateDictOptions`` (optional).

    Example::

        state = {"model": model.state_dict(), "optim": conserve.optim.OptimizerState(model, opt)}
        dcp.save(state, checkpoint_id=path)
        ...
        dcp.load(state, checkpoint_id=path)  # loads the optimizer and the tracker in place

    Raises ``TypeError`` if the optimizer has no tracker.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, options=None):
        if getattr(optimizer, "tracker", None) is None:
            raise TypeError(f"OptimizerState needs a tracked optimizer (conserve.track(...)); got "
                            f"{type(optimizer).__name__}")
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optim": get_optimizer_state_dict(self.model, self.optimizer, options=self.options),
                "conserve": self.optimizer.tracker.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        self.optimizer.tracker.check_state(state_dict["conserve"])  # other laws: raised before anything is loaded
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"], options=self.options)
        self.optimizer.tracker.load_state_dict(state_dict["conserve"])


class _Attached:
    """The step hooks ``attach`` registered (``steps``: how many steps they booked); ``remove()``
    takes them off (and the tracker's watch of this optimizer's groups, ``check_optimizer``)."""

    def __init__(self, optimizer, tracker):
        self.optimizer, self.tracker, self.steps, self._handles = optimizer, tracker, 0, []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        unwatch(self.tracker, self.optimizer)


def attach(optimizer: torch.optim.Optimizer, tracker: Tracker) -> _Attached:
    """Drive ``tracker`` from ``optimizer``'s own step hooks, without wrapping it (the optimizer
    object a framework holds stays the same). Each ``optimizer.step()`` that runs is booked; a step
    GradScaler skips never runs, so it is not booked (nor is one it skips inside an optimizer that unscales
    in its own step, ``Adam(fused=True)``); DCP's zero-lr state initialisation is not booked either.

    Returns a handle with ``remove()``. Raises ``ValueError`` for an optimizer that tracks already
    (``TrackedOptimizer``, fused conserve optimizer with ``track=``): use its ``tracker``."""
    if getattr(optimizer, "tracker", None) is not None:
        raise ValueError(f"{type(optimizer).__name__} tracks its laws already: use its `.tracker`")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")

    tracker.check_optimizer(optimizer)  # laws the param_groups break (as TrackedOptimizer does)
    handle = _Attached(optimizer, tracker)

    skipped = [False]  # this step is DCP's state init or skipped by GradScaler inside the optimizer

    def pre(opt, args, kwargs):
        skipped[0] = _in_dcp_state_init() or _scaler_skips(opt)
        if skipped[0]:
            return None
        # (args: the step's own, the optimizer first)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        tracker.before_step(opt, gradients=closure is None)
        if closure is None or tracker.grad_watch is None:
            return None
        checked = tracker.checked_closure(closure)  # the gradients come from the closure, inside the step
        return ((args[0], checked, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": checked})

    def post(opt, args, kwargs):
        if not skipped[0]:
            tracker.after_step()
            handle.steps += 1
        else:
            tracker._accept_weights()  # (a zero-lr / skipped step: no change outside the tracked steps)

    handle._handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    return handle


# keyword arguments of ``track`` that go to ``conserve.detect`` (the model's laws detected with them)
DETECT_OPTIONS = ("example_inputs", "forward_kwargs", "loss", "rope_layout")


def make_tracker(model=None, laws=None, **tracker_kwargs) -> Tracker:
    """The tracker ``track`` builds: a ``DistributedTracker`` for DTensor/FSDP/DDP models under
    ``torch.distributed``, else a ``Tracker`` (keyword arguments as ``Tracker``, and the detection options
    ``DETECT_OPTIONS``, given to ``conserve.detect(model, ...)``)."""
    if model is None and laws is None:
        raise ValueError("track() needs the model (or explicit laws) to know which laws to evaluate")
    options = {k: tracker_kwargs.pop(k) for k in DETECT_OPTIONS if k in tracker_kwargs}
    if options:  # detection options: the laws are detected with them
        if laws is not None:
            raise ValueError(f"{', '.join(f'{k}=' for k in options)} are options of the laws' detection, but "
                             "laws= is given: pass them to conserve.detect(model, ...) and its result as laws=, or "
                             "drop laws=")
        if model is None:
            raise ValueError(f"{', '.join(f'{k}=' for k in options)} need the model, to detect its laws")
        laws = detect(model, **options)
    policy = tracker_kwargs.pop("on_nonfinite", "raise")
    cls = DistributedTracker if wants_distributed(model, tracker_kwargs.get("params")) else Tracker
    tracker = cls(model, laws, **tracker_kwargs)
    tracker.on_nonfinite = policy
    return tracker


def track(optimizer: torch.optim.Optimizer, model=None, laws=None, **tracker_kwargs) -> torch.optim.Optimizer:
    """Track the conservation laws of ``model`` through ``optimizer``'s steps.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (a conserve fused optimizer is returned as is: it
            tracks inside its own step when given ``model``/``laws`` at construction).
        model: the module (HF, timm, torch.nn or a conserve reference model); its laws come from
            ``model.conservation_laws()`` or ``conserve.detect(model)``.
        laws: explicit laws instead of detection, or a ``Detection`` made with options, e.g.
            ``laws=conserve.detect(model, loss="ce")`` (the output layer's translation law, which holds
            only under softmax cross-entropy).
        **tracker_kwargs: ``every``, ``sinks``, ``drift``, ``drift_every``, ``snapshot_budget``, ``fp64``,
            ``backend``, ``monitors``, ``on_nonfinite``, ``keep_last``, ``cumulative`` (see
            ``conserve.tracker.Tracker``).  ``drift_every``/``snapshot_budget`` default to the exact mode (every
            law on every step) when the tracked weights are at most ``conserve.tracker.EXACT_MAX_BYTES`` (16 MiB),
            to the sampled mode (4, 0.04) above; an explicit value wins (one given: the other takes the sampled
            mode's value).  ``cumulative``: keep the per-entry cumulative drift sums that
            ``totals()``'s decomposition (``decay``/``first``/``second``/``predicted``) needs: 4 law-sized copies
            held for the run; by default (None) only in exact mode (``drift_every=1, snapshot_budget=None``),
            else ``totals()`` gives the sums of per-step norms ``sum_step_<term>`` instead.
            Detection options (without ``laws``): ``example_inputs`` (what ``forward`` takes, for a model whose
            input cannot be synthesised), ``forward_kwargs``, ``loss`` (``'ce'``), ``rope_layout``: the laws are
            ``conserve.detect(model, **options)``.

    Returns:
        a ``TrackedOptimizer`` (a ``torch.optim.Optimizer``).

    Example::

        with conserve.track(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
                            sinks=[conserve.JSONLSink("metrics.jsonl")], every=50) as opt:
            ...  # train; the rows are flushed when the block ends (or at exit if close() is forgotten)
    """
    if isinstance(optimizer, FusedOptimizer) and getattr(optimizer, "tracker", None) is not None:
        return optimizer  # it measures inside its own step
    _check_trackable(optimizer)
    return TrackedOptimizer(optimizer, make_tracker(model, laws, **tracker_kwargs))
