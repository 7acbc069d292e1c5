"""``ConserveCallback`` for the HF ``transformers.Trainer``: one callback, conserve's metrics in the
Trainer's own logs.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ConserveCallback()])

At ``on_train_begin`` it detects the model's laws and tracks the Trainer's optimizer through its step
hooks (accelerate's ``AcceleratedOptimizer`` is looked through; steps GradScaler skips are not
booked). At each logging step (``on_log``) the latest row goes into the ``logs`` dict and
``state.log_history``, under ``conserve/<key>`` (family keys ``eps/<family>``,
``drift/<family>/<term>``, any ``record`` scalars, ``conserve/step`` = the tracker's step), so every
``report_to`` integration (TensorBoard, W&B, MLflow...) logs them. Every row also goes to the
callback's sinks: by default ``<output_dir>/conserve/metrics.jsonl`` (main process), which
``conserve report`` reads; the Trainer's logged ``loss`` is attached to the row of its logging step. ``on_save`` writes the tracker state to ``conserve_tracker.pt`` in the
checkpoint folder; ``train(resume_from_checkpoint=...)`` restores it (the series continues, the
JSONL file drops the rows after the checkpoint). ``on_train_end`` flushes and closes the sinks.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError("conserve.integrations.hf needs transformers: pip install 'torch-conserve[hf]'") from None

from ..errors import UsageError
from ..tracking.sinks import JSONLSink
from ._run import CHECKPOINT_FILE, TrackedRun, grad_dtype_of

__all__ = ["ConserveCallback"]


def _trainer_frame(depth: int = 8):
    """The ``Trainer`` that is calling this callback and the locals of its calling method (the
    callback API passes neither): ``(trainer, locals)`` or ``(None, {})``."""
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if obj is not None and hasattr(obj, "callback_handler") and hasattr(obj, "state"):
            return obj, f.f_locals
        f = f.f_back
    return None, {}


def _reporters() -> tuple[type, ...]:
    try:
        from transformers.integrations import INTEGRATION_TO_CALLBACK
    except Exception:  # noqa: BLE001 - older/newer transformers: no reordering
        return ()
    return tuple(INTEGRATION_TO_CALLBACK.values())


class ConserveCallback(TrainerCallback):
    """Track the conservation laws of a ``Trainer``'s model (see the module docstring).

    Args:
        every: tracker flush period in steps (default: ``args.logging_steps``; the callback also
            flushes at every logging step).
        sinks: where every row goes (default ``None``: ``<output_dir>/conserve/metrics.jsonl`` on the
            main process; ``[]`` for the Trainer's logs only).
        laws: explicit laws instead of ``model.conservation_laws()`` / ``conserve.detect(model)``.
        layers: also put the per-layer ``eps/<family>/layer<i>`` keys in the logs.
        prefix: key prefix in the logs (default ``"conserve/"``).
        **tracker_kwargs: ``drift``, ``fp64``, ``backend``, ``monitors``, ``on_nonfinite``,
            ``check_gradients`` (its ``grad_dtype`` follows ``args.bf16`` / ``args.fp16`` unless given) (see
            ``conserve.Tracker``).

    After ``on_train_begin``, ``self.tracker`` is the ``conserve.Tracker``. Raises ``ValueError`` at
    ``on_train_begin`` if the model has no law to track.
    """

    def __init__(self, *, every: int | None = None, sinks=None, laws=None, layers: bool = False,
                 prefix: str = "conserve/", **tracker_kwargs):
        self.every, self.sinks, self.laws, self.layers, self.prefix = every, sinks, laws, layers, prefix
        self.tracker_kwargs = tracker_kwargs
        self.run: TrackedRun | None = None

    @property
    def tracker(self):
        return None if self.run is None else self.run.tracker

    # ---------------------------------------------------------------------------- placement
    def _before_reporters(self) -> None:
        """Move this callback before the ``report_to`` callbacks (the Trainer puts user callbacks
        after them), so they log the keys ``on_log`` adds."""
        trainer, _ = _trainer_frame()
        handler = getattr(trainer, "callback_handler", None)
        reporters = _reporters()
        if handler is None or not reporters or self not in handler.callbacks:
            return
        cbs = handler.callbacks
        first = next((i for i, cb in enumerate(cbs) if isinstance(cb, reporters)), None)
        if first is not None and cbs.index(self) > first:
            rest = [cb for cb in cbs if cb is not self]
            handler.callbacks = rest[:first] + [self] + rest[first:]  # a new list: the running loop is unaffected

    def on_init_end(self, args, state, control, **kwargs):
        self._before_reporters()

    # ------------------------------------------------------------------------------ training
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._before_reporters()
        if self.run is not None:
            self.run.close()
        if model is None or optimizer is None:
            raise ValueError("ConserveCallback needs the Trainer's model and optimizer at on_train_begin")
        sinks = self.sinks
        if sinks is None:
            sinks = ([JSONLSink(Path(args.output_dir) / "conserve" / "metrics.jsonl")]
                     if state.is_world_process_zero else [])
        every = self.every or (int(args.logging_steps) if args.logging_steps >= 1 else 50)
        kwargs = grad_dtype_of("bf16" if args.bf16 else "fp16" if args.fp16 else None, self.tracker_kwargs)
        self.run = TrackedRun(model, optimizer, prefix=self.prefix, layers=self.layers, laws=self.laws,
                              every=every, sinks=list(sinks), **kwargs)
        if state.global_step > 0:
            self._restore(args, state)

    def _restore(self, args, state) -> None:
        _, local = _trainer_frame()
        ckpt = local.get("resume_from_checkpoint")
        if not isinstance(ckpt, (str, os.PathLike)):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        path = Path(ckpt) / CHECKPOINT_FILE
        if not path.is_file():
            warnings.warn(f"conserve: resuming at step {state.global_step} without {path}: the tracker starts a new "
                          "series at the resumed weights (h_0 = the checkpoint's weights)", RuntimeWarning, stacklevel=2)
            return
        fix = (f"restore {path} from an intact copy, or delete it to resume with a new series (h_0 = the "
               "checkpoint's weights)")
        try:
            saved = torch.load(path, map_location=self.run.tracker.device, weights_only=True)
        except Exception as e:  # truncated / not a torch file: OSError, RuntimeError, EOFError, UnpicklingError
            raise UsageError(f"conserve: cannot read the tracker state {path} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); {fix}") from None
        try:
            self.run.load_state_dict(saved)
        except ValueError as e:  # Tracker.check_state: not a tracker state, or one of other laws: nothing loaded
            raise UsageError(f"conserve: {path}: {e}") from None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run is None or logs is None:
            return
        if isinstance(logs.get("loss"), (int, float)):  # the Trainer's loss, averaged since the last log
            self.run.record(loss=float(logs["loss"]))
        scalars = self.run.scalars()
        if not scalars:
            return
        logs.update(scalars)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step:
            last.update(scalars)  # the Trainer copied logs into log_history before on_log

    def on_save(self, args, state, control, **kwargs):
        if self.run is None:
            return
        trainer, local = _trainer_frame()
        run_dir = args.output_dir
        if trainer is not None and hasattr(trainer, "_get_output_dir"):
            run_dir = trainer._get_output_dir(trial=local.get("trial"))
        folder = Path(run_dir) / f"checkpoint-{state.global_step}"
        sd = self.run.state_dict()  # flushes the pending rows: the checkpoint and the sinks agree
        if not state.is_world_process_zero:
            return
        if not folder.is_dir():
            warnings.warn(f"conserve: checkpoint folder {folder} not found: tracker state not saved",
                          RuntimeWarning, stacklevel=2)
            return
        torch.save(sd, folder / CHECKPOINT_FILE)

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.close()

