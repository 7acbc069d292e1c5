"""``conserve.distributed``: the distributed tracker (``conserve.tracking.distributed``) and its
``track`` factory. This module sits above both ``conserve.optim`` and ``conserve.tracking`` (neither
imports it), so the optimizer wrapper and the distributed tracker do not import each other."""
from __future__ import annotations

import torch

from .optim.wrapper import TrackedOptimizer
from .tracking.distributed import DistributedTracker, flush_bytes, wants_distributed
from .tracking.shard_plan import CommSchedule, ShardLayout, localize, comm_schedule, shard_layouts

__all__ = ["DistributedTracker", "track", "wants_distributed", "flush_bytes", "comm_schedule", "shard_layouts",
           "CommSchedule"]


def track(optimizer: torch.optim.Optimizer, model=None, laws=None, **tracker_kwargs):
    """``conserve.track`` for FSDP2 / tensor-parallel / DDP models: a ``TrackedOptimizer`` driving a
    ``DistributedTracker`` (keyword arguments as ``DistributedTracker``). Call on every rank."""
    if model is None and laws is None:
        raise ValueError("track() needs the model (or explicit laws) to know which laws to evaluate")
    return TrackedOptimizer(optimizer, DistributedTracker(model, laws, **tracker_kwargs))
