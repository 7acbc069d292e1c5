"""What the framework callbacks share: a tracker driven by the framework's own optimizer.

``TrackedRun`` finds the torch optimizer under the framework's wrappers
(``conserve.optim.unwrap_optimizer``), builds the tracker ``conserve.track`` would build
(``model.conservation_laws()`` or ``conserve.detect(model)``) and drives it from the optimizer's step
hooks (``conserve.optim.attach``), so the object the framework holds is never replaced and steps a
GradScaler skips are not booked. An optimizer the user already tracks keeps its own tracker.
``scalars()`` gives the latest row, once, as ``{prefix + key: float}`` for the framework's logger.
"""
from __future__ import annotations

import torch

from ..optim.wrapper import attach, make_tracker, unwrap_optimizer

CHECKPOINT_FILE = "conserve_tracker.pt"


class TrackedRun:
    """The tracker of one training run inside a framework (see the module docstring).

    Args:
        model: the module being trained (wrappers such as DDP are stripped by the tracker).
        optimizer: the framework's optimizer (AcceleratedOptimizer, LightningOptimizer or plain).
        prefix: the key prefix in the framework's logs.
        layers: also log the per-layer ``eps/<family>/layer<i>`` keys (family keys always).
        **tracker_kwargs: ``laws``, ``every``, ``sinks``, ``drift``, ``fp64``, ``backend``,
            ``monitors``, ``on_nonfinite`` (see ``conserve.Tracker``).
    """

    def __init__(self, model: torch.nn.Module, optimizer, *, prefix: str = "conserve/", layers: bool = False,
                 laws=None, **tracker_kwargs):
        self.optimizer = unwrap_optimizer(optimizer)
        self.prefix, self.layers = prefix, layers
        existing = getattr(self.optimizer, "tracker", None)
        if existing is not None:  # conserve.track / a fused optimizer with track=: the user's own tracker
            self.tracker, self.owned, self._handle = existing, False, None
        else:
            self.tracker, self.owned = make_tracker(model, laws, **tracker_kwargs), True
            self._handle = attach(self.optimizer, self.tracker)
        self._logged: int | None = None

    def _keep(self, key: str, value) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if key.startswith("eps/") and key.count("/") >= 2:
            return self.layers
        return True

    def record(self, **scalars) -> None:
        """Attach scalars to the latest step's row if it is not written yet (else nothing: a row
        already in the sinks is never rewritten)."""
        if self.tracker._rows or getattr(self.tracker, "_pend", None):
            self.tracker.record(**scalars)

    def scalars(self) -> dict[str, float]:
        """Flush (one host sync) and return the latest row as log entries, or ``{}`` when no step was
        booked since the last call. NaN values stay NaN (the framework logs what conserve measured)."""
        self.tracker.flush()
        rec = self.tracker.last_record
        if rec is None or rec["step"] == self._logged:
            return {}
        self._logged = rec["step"]
        out = {f"{self.prefix}{k}": float(v) for k, v in rec.items() if k != "step" and self._keep(k, v)}
        out[f"{self.prefix}step"] = float(rec["step"])
        return out

    def state_dict(self) -> dict:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state)
        self._logged = None

    def close(self) -> None:
        """Take the hooks off; close the tracker this run built (flush only a user's own tracker)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.owned:
            self.tracker.close()
        else:
            self.tracker.flush()
