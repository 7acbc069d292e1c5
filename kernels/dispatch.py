"""Backend choice: CUDA tensors use the Triton kernels (``runner.py``), CPU tensors the torch twins
(``reference.py``).

``backend="triton"`` forces the Triton path, which with ``TRITON_INTERPRET=1`` also runs on CPU
tensors (how the CPU test-suite checks it); ``backend="torch"`` forces the twins.  ``config``
(``config.Config``) holds the Triton path's tunables; the twins ignore it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import Config
from .checksums import RowPlan, check_reference
from .plan import Plan
from .reference import bilinear_reference, drift_reference, evaluate_reference

BACKENDS = ("auto", "torch", "triton")


def choose_backend(backend: str, tensors: Sequence[torch.Tensor]) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` (``"auto"``: Triton for CUDA tensors).  Raises
    ``ValueError`` for an unknown name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        given = [t for t in tensors if t is not None]
        return "triton" if given and given[0].is_cuda else "torch"
    return backend


def check_out(plan: Plan, out, tensors: Sequence[torch.Tensor], fp64: bool) -> None:
    """``ValueError`` (one line) unless ``out`` is ``(vec, {D: grams})`` in the layout, accumulation dtype and
    device an evaluation of ``plan`` over ``tensors`` returns (``evaluate(..., out=)``)."""
    given = [t for t in tensors if t is not None]
    dev, dt = (given[0].device if given else torch.device("cpu")), (torch.float64 if fp64 else torch.float32)
    want = {"vec": (plan.vec_size,), **{d: (n, d, d) for d, n in plan.gram_slots.items()}}
    try:
        vec, grams = out
        have = {"vec": vec, **dict(grams)}
    except (TypeError, ValueError):
        raise ValueError("out= must be (vec, {D: grams}) as evaluate returns it") from None
    bad = sorted((str(k) for k in set(want) ^ set(have)), key=str) or [
        str(k) for k, t in have.items() if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[k]
        or t.dtype != dt or t.device != dev]
    if bad:
        raise ValueError(f"out= does not fit the plan at {bad}: pass (vec {want['vec']}, {{D: (slots, D, D)}}) in {dt} "
                         f"on {dev}, e.g. a previous evaluate's result")


def evaluate(plan: Plan, tensors: Sequence[torch.Tensor], *, fp64: bool = False, backend: str = "auto",
             config: Config | None = None, out=None):
    """``h(theta)`` for every term of ``plan``: returns ``(vec, {D: grams})`` (see
    ``reference.evaluate_reference``).

    ``out``: ``(vec, {D: grams})`` to write the result into (a previous result of the same plan, dtype and
    device; ``ValueError`` otherwise, before anything is written) and return.  The torch twin accumulates
    into it (no new outputs; its checks that can raise run before it is zeroed); Triton copies its result into
    it (same bits, no saving on the GPU)."""
    if out is not None:
        check_out(plan, out, tensors, fp64)
    if choose_backend(backend, tensors) == "triton":
        from .runner import evaluate_triton

        vec, grams = evaluate_triton(plan, tensors, fp64=fp64, config=config)
        if out is None:
            return vec, grams
        out[0].copy_(vec)
        for d, g in out[1].items():
            g.copy_(grams[d])
        return out[0], dict(out[1])
    return evaluate_reference(plan, tensors, fp64=fp64, out=out)


def bilinear(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, fp64: bool = False,
             backend: str = "auto", config: Config | None = None):
    """Bilinear form ``B(x, y)`` of the quadratic terms (see ``reference.bilinear_reference``)."""
    if choose_backend(backend, xs) == "triton":
        from .runner import bilinear_triton

        return bilinear_triton(plan, xs, ys, fp64=fp64, config=config)
    return bilinear_reference(plan, xs, ys, fp64=fp64)


def check_sums(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, fp64: bool = False,
               backend: str = "auto", config: Config | None = None, derived: RowPlan | None = None):
    """The gradient check's sums of weights ``xs`` and gradients ``ys`` (``checksums.py``): ``(vec (3, vec_size),
    {D: (3, slots, D, D)})``.  Triton: one pass over both (``runner.check_triton``); the torch twin:
    ``checksums.check_reference`` (``derived``: its ``row_plan``, built once by the caller)."""
    if choose_backend(backend, xs) == "triton":
        from .runner import check_triton

        return check_triton(plan, xs, ys, fp64=fp64, config=config)
    return check_reference(plan, xs, ys, fp64=fp64, derived=derived)


def drift(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, *, fp64: bool = False,
          backend: str = "auto", decay: bool = True, donate: bool = False, values: bool = True,
          config: Config | None = None):
    """The four pieces of the exact drift identity of one optimizer step (spec "Discrete steps"):
    ``(h_new, decay, bil, h_delta)`` as ``(vec, {D: grams})`` pairs (see ``reference.drift_reference``).

    ``a``: decay factor per tensor (or one float).  ``decay``: the decay piece ``h(a old) - h(old)``,
    computed per term in closed form (``s (a^2-1) h_t(old)``; no difference of two evaluations); with
    ``decay=False`` it is None and not computed on any backend (Triton: the decay dots are compiled
    out).  ``donate``: ``olds`` are the caller's copies, which the torch twin may overwrite with
    ``Delta`` instead of allocating it (Triton forms ``Delta`` in registers and never writes them).
    ``values=False``: ``h_new`` may be None (the twin skips it; Triton computes it in the same pass and
    returns it).  Triton: every Gram term in ONE pass over old and new weights per (D, dtype group)
    (``runner.drift_triton``)."""
    if choose_backend(backend, news) == "triton":
        from .runner import drift_triton

        return drift_triton(plan, olds, news, a, fp64=fp64, decay=decay, config=config)
    return drift_reference(plan, olds, news, a, fp64=fp64, decay=decay, donate=donate, values=values)


def prepare_drift(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, *, fp64: bool = False,
                  backend: str = "auto", config: Config | None = None) -> None:
    """Make, on the current stream, the host->device copies a following ``drift(plan, olds, news, a, ...)``
    with the same arguments would make (Triton: ``runner.prepare_drift_triton``; the torch twin: nothing),
    so that call, e.g. on a side CUDA stream, only allocates and launches."""
    if choose_backend(backend, news) == "triton":
        from .runner import prepare_drift_triton

        prepare_drift_triton(plan, olds, news, a, fp64=fp64, config=config)
