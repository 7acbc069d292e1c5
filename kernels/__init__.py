"""conserve.kernels: the law evaluators (Triton kernels and their torch reference twins).

Knows nothing of nn.Module: it takes a ``Plan`` (see ``plan.py``) and a list of tensors.
"""
from .plan import GramTerm, NormTerm, Plan, SumTerm, View, bilinear_reference, drift_reference, evaluate_reference
from .dispatch import bilinear, drift, evaluate

__all__ = ["View", "GramTerm", "NormTerm", "SumTerm", "Plan", "evaluate", "bilinear", "drift",
           "evaluate_reference", "bilinear_reference", "drift_reference"]
