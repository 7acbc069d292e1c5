"""Compatibility name for ``conserve.tracking.sinks`` (JSONL / TensorBoard / W&B sinks, ``RunDirLock``)."""
from .tracking.sinks import (JSONLSink, MemorySink, RunDirLock, TensorBoardSink, WandbSink,  # noqa: F401
                             tensorboard_available)

__all__ = ["JSONLSink", "MemorySink", "TensorBoardSink", "WandbSink", "RunDirLock", "tensorboard_available"]
