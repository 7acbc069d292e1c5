"""Detect the conservation laws of third-party models (HF transformers, timm, torch.nn).

``detect(model, config=None) -> Detection`` returns every law with the exact rows and columns it reads,
the blocks that carry no law with the reason, and the modules nothing recognised ("no law detected").
Detection is structural (module types + config), never by name guessing alone, and never silently
wrong: what is not understood is listed in ``undetected``.

Detectors register with ``@register``; each gets the unwrapped model and its config and returns a
``Detection`` or None (not mine). The first that answers wins. See ``core.py`` for shared helpers.
"""
from __future__ import annotations

from .core import Detection, detect, register

__all__ = ["Detection", "detect", "register"]
