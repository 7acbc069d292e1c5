"""conserve.kernels: the law evaluators (Triton kernels and their torch reference twins).

Knows nothing of nn.Module: it takes a ``Plan`` (see ``plan.py``) and a list of tensors.
"""
from .config import Config
from .dispatch import bilinear, drift, evaluate, prepare_drift
from .plan import GramTerm, NormTerm, Plan, SumTerm, View
from .reference import bilinear_reference, decay_reference, drift_reference, evaluate_reference

__all__ = ["View", "GramTerm", "NormTerm", "SumTerm", "Plan", "Config", "evaluate", "bilinear", "drift", "prepare_drift",
           "evaluate_reference", "bilinear_reference", "drift_reference", "decay_reference"]
