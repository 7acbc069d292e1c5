"""conserve: track the conservation laws of training dynamics (spec: ``shared/spec/laws.md``).

The path: model -> laws (``model.conservation_laws()`` or ``conserve.detect``) -> kernels
(``conserve.kernels``) -> tracker (``conserve.track`` / ``Tracker``) -> sinks.

The public names below are imported on first use (PEP 562), so ``import conserve`` and the command
line's ``--help`` do not pay for importing torch until a name that needs it is touched.
"""
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
    "check_gradients": ("conserve.analysis.gradcheck", "check_gradients"),
    "JSONLSink": ("conserve.sinks", "JSONLSink"),
    "MemorySink": ("conserve.sinks", "MemorySink"),
    "TensorBoardSink": ("conserve.sinks", "TensorBoardSink"),
    "WandbSink": ("conserve.sinks", "WandbSink"),
    "detect": ("conserve.detection", "detect"),
    "count": ("conserve.counting", "count_laws"),
    "discover": ("conserve.analysis.discover", "discover"),
    # the errors a user can catch (conserve.errors; importing it does not import torch)
    "UsageError": ("conserve.errors", "UsageError"),
    "UnsupportedModelError": ("conserve.errors", "UnsupportedModelError"),
    "NonFiniteError": ("conserve.errors", "NonFiniteError"),
    "DivergenceError": ("conserve.errors", "DivergenceError"),
    "StaleParameterError": ("conserve.errors", "StaleParameterError"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    import importlib

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
    """The public names (``__all__``), the submodules imported so far and the module's dunders."""
    return sorted({k for k in globals() if not k.startswith("_") or k.startswith("__")} | set(_EXPORTS))
