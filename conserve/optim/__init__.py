"""Optimizer integration: the generic wrapper (any optimizer) and the fused optimizers."""
from .fused import FusedAdam, FusedAdamW, FusedSGD
from .wrapper import OptimizerState, TrackedOptimizer, attach, track, unwrap_optimizer

__all__ = ["TrackedOptimizer", "track", "OptimizerState", "attach", "unwrap_optimizer", "FusedAdam", "FusedAdamW",
           "FusedSGD"]
