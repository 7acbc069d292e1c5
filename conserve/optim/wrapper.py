"""``conserve.track(optimizer, model)``: any torch optimizer, tracked.

The returned ``TrackedOptimizer`` is a ``torch.optim.Optimizer`` that shares ``param_groups``,
``state`` and ``defaults`` with the wrapped optimizer, so LR schedulers, GradScaler and
``zero_grad`` drive the inner one. ``step()`` snapshots the tracked weights, steps the inner
optimizer, then evaluates the laws and drift terms (``conserve.tracker.Tracker``).
``state_dict()`` is the inner state dict plus a ``"conserve"`` entry (ignored by torch optimizers).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..tracker import Tracker


class TrackedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``; ``tracker`` (a ``Tracker``) sees every step. See ``conserve.track``."""

    def __init__(self, optimizer: torch.optim.Optimizer, tracker: Tracker):
        if isinstance(optimizer, TrackedOptimizer):
            raise ValueError("this optimizer is already tracked; pass the inner optimizer (`opt.optimizer`)")
        self.optimizer, self.tracker = optimizer, tracker
        # the hook tables torch.optim.Optimizer.__init__ would create (we do not copy param_groups)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())

    # shared with the inner optimizer, so schedulers and GradScaler act on it
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def step(self, closure=None):
        """Step the inner optimizer, then evaluate the laws (no host sync unless a flush is due)."""
        self.tracker.before_step(self.optimizer)
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.tracker.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return {**self.optimizer.state_dict(), "conserve": self.tracker.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        tracked = state_dict.pop("conserve", None)
        self.optimizer.load_state_dict(state_dict)
        if tracked is not None:
            self.tracker.load_state_dict(tracked)

    def record(self, **scalars) -> None:
        """Attach scalars (e.g. ``loss=loss.detach()``) to the current step's metric row."""
        self.tracker.record(**scalars)

    def flush(self):
        return self.tracker.flush()

    def close(self) -> None:
        self.tracker.close()

    def __repr__(self) -> str:
        return f"TrackedOptimizer({self.optimizer!r}, laws={len(self.tracker.laws)})"


def track(optimizer: torch.optim.Optimizer, model=None, laws=None, **tracker_kwargs) -> torch.optim.Optimizer:
    """Track the conservation laws of ``model`` through ``optimizer``'s steps.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (a conserve fused optimizer is returned as is: it
            tracks inside its own step when given ``model``/``laws`` at construction).
        model: the module (HF, timm, torch.nn or a conserve reference model); its laws come from
            ``model.conservation_laws()`` or ``conserve.detect(model)``.
        laws: explicit laws instead of detection.
        **tracker_kwargs: ``every``, ``sinks``, ``drift``, ``fp64``, ``backend``, ``monitors``
            (see ``conserve.tracker.Tracker``).

    Returns:
        a ``TrackedOptimizer`` (a ``torch.optim.Optimizer``).

    Example::

        opt = conserve.track(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
                             sinks=[conserve.JSONLSink("metrics.jsonl")], every=50)
    """
    from .fused import _FusedOptimizer

    if isinstance(optimizer, _FusedOptimizer) and getattr(optimizer, "tracker", None) is not None:
        return optimizer  # it measures inside its own step
    if model is None and laws is None:
        raise ValueError("track() needs the model (or explicit laws) to know which laws to evaluate")
    from ..tracking.distributed import DistributedTracker, wants_distributed

    cls = DistributedTracker if wants_distributed(model, tracker_kwargs.get("params")) else Tracker
    return TrackedOptimizer(optimizer, cls(model, laws, **tracker_kwargs))
