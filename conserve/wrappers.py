"""The module a wrapper trains: ``unwrap(model)`` strips torch.compile and DDP/DataParallel wrappers.

A leaf module (it imports only torch), so detection, the tracker and the integrations share it.
"""
from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """Strip torch.compile (``_orig_mod``) and DDP/DataParallel (``module``) wrappers.

    Args:
        model: any ``nn.Module``, wrapped or not.

    Returns:
        The innermost module whose parameter names the user's optimizer and laws use.
    """
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        else:
            return model
