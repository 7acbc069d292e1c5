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


# columns that only some steps fill (the drift decomposition, the gradient check): logged from the latest
# step that has them
SPARSE = ("drift/", "grad_check/")


def grad_dtype_of(precision, tracker_kwargs: dict) -> dict:
    """``tracker_kwargs`` with ``grad_dtype`` set from a framework's mixed precision when the gradient check is on
    and the caller did not set it: under bf16/fp16 autocast the parameters' ``.grad`` are float32 but their
    rounding is the half dtype's, which sets the check's floors.  ``precision``: ``"bf16"`` or ``"fp16"`` (any
    string containing it, e.g. Lightning's ``"bf16-mixed"``), else nothing."""
    if not tracker_kwargs.get("check_gradients") or "grad_dtype" in tracker_kwargs:
        return tracker_kwargs
    p = str(precision or "").lower()
    half = "bfloat16" if "bf16" in p else ("float16" if "16" in p and "32" not in p and "64" not in p else None)
    return {**tracker_kwargs, "grad_dtype": half} if half else tracker_kwargs

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
        self._drift: dict[str, tuple[int, float]] = {}  # drift key -> (step, value) of its latest decomposition
        self._drift_logged: dict[str, int] = {}
        self.tracker.sinks.append(_Seen(self))  # every written row passes here, whoever flushes

    def _keep(self, key: str, value) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if key.startswith(("eps/", "grad_check/")) and key.count("/") >= 2:
            return self.layers
        return True

    def record(self, **scalars) -> None:
        """Attach scalars to the latest step's row if it is not written yet (else nothing: a row
        already in the sinks is never rewritten)."""
        if self.tracker._rows or getattr(self.tracker, "_pend", None):
            self.tracker.record(**scalars)

    def scalars(self) -> dict[str, float]:
        """Flush (one host sync) and return the latest row as log entries, or ``{}`` when no step was
        booked since the last call.  The drift columns come from the latest step that decomposed each
        of them (``drift_every`` / ``snapshot_budget``: the logging step is seldom a drift step), each
        logged once, with ``drift_step`` the newest of those steps; NaN law values stay NaN (the
        framework logs what conserve measured)."""
        self.tracker.flush()  # the rows pass through ``_Seen`` as they are written
        rec = self.tracker.last_record
        if rec is None or rec["step"] == self._logged:
            return {}
        self._logged = rec["step"]
        out = {f"{self.prefix}{k}": float(v) for k, v in rec.items()
               if k != "step" and not k.startswith(SPARSE) and self._keep(k, v)}
        out[f"{self.prefix}step"] = float(rec["step"])
        fresh = {k: sv for k, sv in self._drift.items() if sv[0] > self._drift_logged.get(k, 0)}
        for k, (step, v) in fresh.items():
            out[f"{self.prefix}{k}"] = v
            self._drift_logged[k] = step
        if fresh:
            out[f"{self.prefix}drift_step"] = float(max(step for step, _ in fresh.values()))
        return out

    def _note(self, rec: dict) -> None:
        """Remember the finite drift and gradient-check columns of a row (the latest step that has each)."""
        for k, v in rec.items():
            if k.startswith(SPARSE) and isinstance(v, float) and v == v and self._keep(k, v):
                self._drift[k] = (rec["step"], v)

    def state_dict(self) -> dict:
        """The tracker's state, plus (``"logs"``) the drift columns not yet given to the framework's logs and
        which were: a resumed run logs them at its next logging step, as the uninterrupted run does."""
        state = self.tracker.state_dict()  # (flushes: the rows pass through ``_Seen`` first)
        state["logs"] = {"drift": {k: [int(s), float(v)] for k, (s, v) in self._drift.items()},
                         "drift_logged": {k: int(s) for k, s in self._drift_logged.items()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state)
        self._logged = None
        logs = state.get("logs") or {}  # (a state without "logs": nothing pending)
        self._drift = {k: (int(s), float(v)) for k, (s, v) in logs.get("drift", {}).items()}
        self._drift_logged = {k: int(s) for k, s in logs.get("drift_logged", {}).items()}

    def close(self) -> None:
        """Take the hooks off (and the row watcher); close the tracker this run built (flush only a user's own tracker)."""
        self.tracker.sinks[:] = [x for x in self.tracker.sinks if not (isinstance(x, _Seen) and x.run is self)]
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.owned:
            self.tracker.close()
        else:
            self.tracker.flush()


class _Seen:
    """A sink that only notes, for ``TrackedRun.scalars``, the drift columns of every row written."""

    def __init__(self, run: TrackedRun):
        self.run = run

    def write(self, step: int, metrics: dict) -> None:
        self.run._note(metrics)

    def close(self) -> None:
        pass
