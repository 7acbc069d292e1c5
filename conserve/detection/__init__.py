"""Detect the conservation laws of third-party models (HF transformers, timm, torch.nn).

``detect(model, config=None) -> Detection`` returns every law with the exact rows and columns it reads,
the blocks that carry no law with the reason, and the modules nothing recognised ("no law detected").
Detection is structural (module types + config), never by name guessing alone, and never silently
wrong: what is not understood is listed in ``undetected``.

Detectors register with ``@register``; each gets the unwrapped model and its config and returns a
``Detection`` or None (not mine). They run in a fixed order (reference, HF, timm, torch.nn, graph); the
first that answers wins. Modules the torch.nn detector leaves undetected, and any model no name/type-based
detector knows, go to structural detection (``graph.detect_graph``: laws found from what the traced graph
computes, each checked to first order in float64 before it is claimed; ``detect(model, structural=True)``
runs it alone). Shared toolkit: ``core.Collector`` (the one frozen / tied / undetected filter) and
``builders`` (gain / unit / head-Gram / RoPE-pair / QK-norm law builders).
"""
from __future__ import annotations

from .core import Collector, Detection, detect, register


def detect_graph(model, example_inputs=None, **options) -> Detection:
    """Structural detection only (see ``conserve.detection.graph.detect_graph``)."""
    from .graph import detect_graph as _detect_graph

    return _detect_graph(model, example_inputs, **options)


__all__ = ["Collector", "Detection", "detect", "detect_graph", "register"]
