"""conserve: track the conservation laws of training dynamics (spec: ``shared/spec/laws.md``).

The path: model -> laws (``model.conservation_laws()`` or ``conserve.detect``) -> kernels
(``conserve.kernels``) -> tracker (``conserve.track`` / ``Tracker``) -> sinks.

The public names below are imported on first use (PEP 562), so ``import conserve`` and the command
line's ``--help`` do not pay for importing torch until a name that needs it is touched.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    "track": ("conserve.optim", "track"),
    "TrackedOptimizer": ("conserve.optim", "TrackedOptimizer"),
    "Tracker": ("conserve.tracker", "Tracker"),
    "Law": ("conserve.laws", "Law"),
    "Declined": ("conserve.laws", "Declined"),
    "compile_laws": ("conserve.laws", "compile_laws"),
    "evaluate_laws": ("conserve.laws", "evaluate_laws"),
    "verify": ("conserve.analysis.verify", "verify"),
    "JSONLSink": ("conserve.sinks", "JSONLSink"),
    "MemorySink": ("conserve.sinks", "MemorySink"),
    "TensorBoardSink": ("conserve.sinks", "TensorBoardSink"),
    "WandbSink": ("conserve.sinks", "WandbSink"),
    "detect": ("conserve.detection", "detect"),
    "count": ("conserve.counting", "count_laws"),
    "discover": ("conserve.analysis.discover", "discover"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
    elif not name.startswith("_"):  # a subpackage used as an attribute: conserve.optim.FusedAdamW
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'conserve' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'conserve' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
