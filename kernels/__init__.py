"""conserve.kernels: the law evaluators (Triton kernels and their torch reference twins).

Knows nothing of nn.Module: it takes a ``Plan`` (see ``plan.py``) and a list of tensors.
"""
import os as _os
import sys as _sys

if __name__ == "kernels":
    # This folder is ``conserve.kernels``.  Python started in the repository root (``python -c``,
    # ``python -m``, pytest's ``pythonpath``) finds it first as the top-level ``kernels``, which is also
    # the name of Hugging Face's ``kernels`` distribution (a transformers dependency).  Hand the import
    # over to that distribution, found on ``sys.path`` without the repository root; without one, the
    # top-level name does not exist.
    import importlib.machinery as _machinery
    import importlib.util as _util

    def _other_kernels():
        root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
        path = [p for p in _sys.path
                if isinstance(p, str) and _os.path.realpath(p or _os.getcwd()) != root]
        return _machinery.PathFinder.find_spec("kernels", path)

    _spec = _other_kernels()
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels': the repository's kernels/ folder is conserve's, import it as "
            "`from conserve import kernels` (or `import conserve.kernels`)", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        _sys.modules.pop("kernels", None)
        raise
else:
    from .config import Config
    from .dispatch import bilinear, check_sums, drift, evaluate, prepare_drift
    from .plan import GramTerm, NormTerm, Plan, SumTerm, View
    from .reference import bilinear_reference, decay_reference, drift_reference, evaluate_reference

    __all__ = ["View", "GramTerm", "NormTerm", "SumTerm", "Plan", "Config", "evaluate", "bilinear", "check_sums", "drift", "prepare_drift",
               "evaluate_reference", "bilinear_reference", "drift_reference", "decay_reference"]
