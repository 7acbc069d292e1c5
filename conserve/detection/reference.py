"""Detector for conserve's own reference models: they declare their laws."""
from __future__ import annotations

from .core import Detection, register


@register("reference")
def detect_reference(model, config, **options):
    if not hasattr(model, "conservation_laws"):
        return None
    laws, declined = model.conservation_laws()
    return Detection(list(laws), list(declined))
