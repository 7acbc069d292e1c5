"""Optimizer integration: the generic wrapper (any optimizer) and the fused optimizers."""
from .fused import FusedAdam, FusedAdamW, FusedSGD
from .wrapper import TrackedOptimizer, track

__all__ = ["TrackedOptimizer", "track", "FusedAdam", "FusedAdamW", "FusedSGD"]
