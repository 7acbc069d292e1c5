"""Backend choice: CUDA tensors use the Triton kernels, CPU tensors the torch reference.

``backend="triton"`` (or the environment variable ``CONSERVE_BACKEND=triton``) forces the Triton
path, which with ``TRITON_INTERPRET=1`` also runs on CPU tensors (how the CPU test-suite checks it).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from .plan import Plan, bilinear_reference, drift_reference, evaluate_reference

_BACKENDS = ("auto", "torch", "triton")


def _choose(backend: str, tensors: Sequence[torch.Tensor]) -> str:
    backend = os.environ.get("CONSERVE_BACKEND", backend) if backend == "auto" else backend
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {_BACKENDS}")
    if backend == "auto":
        return "triton" if len(tensors) and tensors[0].is_cuda else "torch"
    return backend


def check_triton_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` naming the fix when Triton cannot run on ``device`` (a CPU tensor without
    ``TRITON_INTERPRET=1`` set before triton is imported)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported for CPU tensors; use backend='torch' (or unset CONSERVE_BACKEND) on CPU")


def evaluate(plan: Plan, tensors: Sequence[torch.Tensor], *, fp64: bool = False, backend: str = "auto"):
    """``h(theta)`` for every term of ``plan``: returns ``(vec, {D: grams})`` (see ``plan.evaluate_reference``)."""
    if _choose(backend, tensors) == "triton":
        from .triton_impl import evaluate_triton

        return evaluate_triton(plan, tensors, fp64=fp64)
    return evaluate_reference(plan, tensors, fp64=fp64)


def bilinear(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, fp64: bool = False,
             backend: str = "auto"):
    """Bilinear form ``B(x, y)`` of the quadratic terms (see ``plan.bilinear_reference``)."""
    if _choose(backend, xs) == "triton":
        from .triton_impl import bilinear_triton

        return bilinear_triton(plan, xs, ys, fp64=fp64)
    return bilinear_reference(plan, xs, ys, fp64=fp64)


def drift(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, *, fp64: bool = False,
          backend: str = "auto"):
    """The four pieces of the exact drift identity of one optimizer step (spec "Discrete steps"):
    ``h_new, decay, bil, h_delta`` as ``(vec, {D: grams})`` pairs (see ``plan.drift_reference``).
    ``a``: decay factor per tensor (or one float).  Triton: every Gram term in ONE pass over old and
    new weights per (D, dtype group) (``triton_impl.drift_triton``)."""
    if _choose(backend, news) == "triton":
        from .triton_impl import drift_triton

        return drift_triton(plan, olds, news, a, fp64=fp64)
    return drift_reference(plan, olds, news, a, fp64=fp64)
