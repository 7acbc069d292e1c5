"""Optimizer integration: the generic wrapper (any optimizer) and the fused optimizers."""
from .wrapper import TrackedOptimizer, track

__all__ = ["TrackedOptimizer", "track"]
