"""``ConserveCallback`` for Lightning (``lightning`` or ``pytorch_lightning``): one callback, conserve's
metrics in the Trainer's loggers.

    trainer = lightning.Trainer(callbacks=[ConserveCallback()], ...)

At ``on_fit_start`` it detects the LightningModule's laws and tracks the Trainer's optimizer through its
step hooks (``LightningOptimizer`` is looked through; steps a GradScaler skips are not booked).
After each batch that stepped, the step's ``loss`` (from ``training_step``'s output) is attached to
the row; at Lightning's logging steps (``log_every_n_steps``) the latest row is logged with
``pl_module.log_dict`` under ``conserve/<key>`` (family keys ``eps/<family>``,
``drift/<family>/<term>``, ``conserve/step`` = the tracker's step), so every logger (CSV,
TensorBoard, W&B...) gets it and ``ModelCheckpoint``/``EarlyStopping`` can monitor it. Every row
also goes to the callback's sinks: by default ``<trainer.log_dir>/conserve/metrics.jsonl``
(global rank 0). The tracker state is the callback's ``state_dict`` in Lightning checkpoints, so
``fit(ckpt_path=...)`` continues the series (the JSONL file drops the rows after the checkpoint; a
logger that opens a new version on resume, as Lightning's default does, puts the resumed rows in the
new version's file, from the checkpoint's step on, with a warning naming it).
``on_train_end`` (and ``on_exception``) flush and close the sinks. ``gradient_clip_algorithm="value"``
marks every law ``broken_by`` (each gradient entry is clipped on its own; clipping by norm keeps the
laws). Without a logger (``logger=False``) the row still reaches ``trainer.callback_metrics``.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

try:
    from lightning.pytorch import Callback
except ImportError as first:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError:
        import importlib.util

        if importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning"):
            raise ImportError(f"conserve.integrations.lightning: Lightning is installed but does not import ({first}); "
                              "fix that environment (e.g. a torchvision that does not match torch)") from first
        raise ImportError("conserve.integrations.lightning needs Lightning: pip install 'torch-conserve[lightning]'") \
            from None

from ..errors import UsageError
from ..tracking.breakers import mark_broken
from ..tracking.sinks import JSONLSink
from ._run import TrackedRun

__all__ = ["ConserveCallback"]


class ConserveCallback(Callback):
    """Track the conservation laws of a ``LightningModule`` (see the module docstring).

    Args:
        every: tracker flush period in steps (default ``trainer.log_every_n_steps``; the callback also
            flushes at every logging step).
        sinks: where every row goes (default ``None``: ``<log_dir>/conserve/metrics.jsonl`` on global
            rank 0; ``[]`` for the loggers only).
        laws: explicit laws instead of ``model.conservation_laws()`` / ``conserve.detect(model)``.
        layers: also log the per-layer ``eps/<family>/layer<i>`` keys.
        prefix: key prefix in the logs (default ``"conserve/"``).
        record_loss: attach ``training_step``'s loss to each stepped row (default True).
        **tracker_kwargs: ``drift``, ``fp64``, ``backend``, ``monitors``, ``on_nonfinite``.

    After ``on_fit_start``, ``self.tracker`` is the ``conserve.Tracker``. Raises ``UsageError`` for a
    module with several optimizers (track one model/optimizer pair per callback).
    """

    def __init__(self, *, every: int | None = None, sinks=None, laws=None, layers: bool = False,
                 prefix: str = "conserve/", record_loss: bool = True, **tracker_kwargs):
        self.every, self.sinks, self.laws, self.layers, self.prefix = every, sinks, laws, layers, prefix
        self.record_loss, self.tracker_kwargs = record_loss, tracker_kwargs
        self.run: TrackedRun | None = None
        self._pending_state: dict | None = None
        self._seen_steps = 0
        self._logged_keys: set[str] = set()  # keys given to ``log_dict`` whose values Lightning still holds

    @property
    def tracker(self):
        return None if self.run is None else self.run.tracker

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.run is not None:
            self.run.close()
        opts = trainer.optimizers
        if len(opts) != 1:
            raise UsageError(f"ConserveCallback tracks one optimizer; this module has {len(opts)}: configure one "
                             "optimizer, or track each with conserve.track(optimizer, submodule)")
        sinks, fresh = self.sinks, None
        if sinks is None:
            root = trainer.log_dir or trainer.default_root_dir
            path = Path(root) / "conserve" / "metrics.jsonl"
            fresh = path if not (path.is_file() and path.stat().st_size > 0) else None
            sinks = [JSONLSink(path)] if trainer.is_global_zero else []
        every = self.every or max(1, int(trainer.log_every_n_steps or 50))
        self.run = TrackedRun(pl_module, opts[0], prefix=self.prefix, layers=self.layers, laws=self.laws,
                              every=every, sinks=list(sinks), **self.tracker_kwargs)
        self._seen_steps = self._booked()
        clip = getattr(trainer, "gradient_clip_val", None)
        algo = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
        if clip and algo.endswith("value"):
            mark_broken(self.run.tracker, f"Lightning's gradient clipping by value (gradient_clip_val={clip}, "
                        "gradient_clip_algorithm='value': each gradient entry clipped on its own, so a clipped step "
                        "is not along the gradient); clip by 'norm' to keep the laws")
        if self._pending_state is not None:  # restored before the optimizer existed
            self.run.load_state_dict(self._pending_state)
            self._pending_state = None
            step = self.run.tracker.step_count
            if fresh is not None and step > 0 and trainer.is_global_zero:
                warnings.warn(f"conserve: resumed at step {step} into a new metrics file {fresh} (the logger opened a "
                              f"new version): steps 1-{step} are in the earlier run's file; give the logger a fixed "
                              "version (e.g. CSVLogger(..., version=0)) or sinks=[JSONLSink(path)] to keep one file",
                              RuntimeWarning, stacklevel=2)

    def _booked(self) -> int:
        h = self.run._handle
        return h.steps if h is not None else self.run.tracker.step_count

    @staticmethod
    def _accumulating(trainer, pl_module, stepped: bool) -> bool:
        """True at a batch that only accumulates gradients (``accumulate_grad_batches``) under automatic
        optimization: Lightning hands the loggers nothing at it (``update_train_step_metrics``), so what
        this callback logged there would be dropped with the values of the next batch."""
        if not getattr(pl_module, "automatic_optimization", True):
            return False
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if hasattr(loop, "_should_accumulate"):
            return bool(loop._should_accumulate())
        return not stepped

    def _forget_logged(self, trainer) -> None:
        """Take the values this callback logged at an earlier batch out of Lightning's results: Lightning
        keeps every ``log`` value of a hook for the rest of the epoch and hands it to the loggers again at
        each logging step where the key is not logged anew, so a row's drift columns (logged once: they come
        from the step that decomposed them) and a whole row where no step was booked since the last logging
        step (manual optimization stepping less often than ``log_every_n_steps``) were logged again, under a
        later step.  The values already logged stay in ``trainer.callback_metrics``."""
        results = getattr(trainer, "_results", None)
        if not self._logged_keys or results is None or not hasattr(results, "values"):
            return
        for item in list(results.values()):
            meta = getattr(item, "meta", None)
            if getattr(meta, "name", None) in self._logged_keys and hasattr(item, "reset"):
                item.reset()
        self._logged_keys.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.run is None:
            return
        self._forget_logged(trainer)
        booked = self._booked()
        stepped, self._seen_steps = booked != self._seen_steps, booked
        if stepped and self.record_loss:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if torch.is_tensor(loss) and loss.numel() == 1:
                self.run.record(loss=loss.detach())
        conn = getattr(trainer, "_logger_connector", None)
        due = conn.should_update_logs if hasattr(conn, "should_update_logs") else \
            trainer.global_step % max(1, trainer.log_every_n_steps) == 0
        if due and self._accumulating(trainer, pl_module, stepped):
            due = False  # Lightning logs nothing at this batch: the row waits for the batch that steps
        if due:
            scalars = self.run.scalars()
            if scalars:
                pl_module.log_dict(scalars, on_step=True, on_epoch=False, prog_bar=False, batch_size=1,
                                   logger=bool(getattr(trainer, "loggers", True)))  # (no logger: callback_metrics only)
                self._logged_keys.update(scalars)

    def state_dict(self) -> dict:
        if self.run is not None:
            return {"tracker": self.run.state_dict()}
        return {"tracker": self._pending_state} if self._pending_state is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get("tracker")
        if state is None:
            return
        if self.run is not None:
            self.run.load_state_dict(state)
        else:
            self._pending_state = state

    def on_train_end(self, trainer, pl_module) -> None:
        if self.run is not None:
            self.run.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.run is not None:  # keep every row recorded before the failure
            self.run.close()
