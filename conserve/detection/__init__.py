"""Detect the conservation laws of third-party models (HF transformers, timm, torch.nn).

``detect(model, config=None) -> Detection`` returns every law with the exact rows and columns it reads,
the blocks that carry no law with the reason, and the modules nothing recognised ("no law detected").
Detection is structural (module types + config), never by name guessing alone, and never silently
wrong: what is not understood is listed in ``undetected``.

Layout:

* ``core``: the shared base (``Detection``, ``Collector``: the one frozen / tied / undetected filter, the
  ``register`` decorator and the detector registry); it imports nothing of this package.
* ``dispatch``: ``detect``, the detectors run in a fixed order (reference, HF, timm, torch.nn, graph); the first
  that answers wins. Modules the torch.nn detector leaves undetected, and any model no name/type-based detector
  knows, go to structural detection.
* detectors: ``reference``, ``hf/``, ``timm_models``, ``torchnn``, and structural detection ``graph`` (laws found
  from what the traced graph computes, each checked to first order in float64 before it is claimed;
  ``detect(model, structural=True)`` runs it alone) over its steps ``probe``, ``trace`` / ``rewrite``,
  ``fxgraph``, ``match/`` (the block finders), ``check`` (the first-order check), and ``blocks`` (block by block
  when the whole model cannot be traced).
* ``builders``: the gain / unit / head-Gram / RoPE-pair / QK-norm law builders every detector shares.
"""
from __future__ import annotations

from ..wrappers import unwrap
from .core import Collector, Detection, register
from .dispatch import detect
from .graph import detect_graph

__all__ = ["Collector", "Detection", "detect", "detect_graph", "register", "unwrap"]
