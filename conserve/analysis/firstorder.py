"""The numerical core of spec check 1 (``shared/spec/laws.md``, "The numerical checks every law must pass").

A law ``h`` is conserved by gradient flow for every loss iff ``<grad h, grad_theta f_o(x)> = 0`` for every output
coordinate ``o`` and input ``x``. Tested in float64 on random combinations: ``s . h`` of the law's components and
``r . f`` of the outputs (they vanish for all ``s``, ``r`` iff they vanish per component and per coordinate), or
the softmax cross-entropy gradient for laws that hold only for that loss (``Translation``). The measure is
``|<grad (s.h), grad (r.f)>| / (||grad (s.h)|| ||grad (r.f)||)``, compared with ``laws.tolerance.FIRST_ORDER``.

Shared by ``conserve.verify`` (a model and a law), structural detection (many laws on a traced probe, the
model's gradients computed once per trial and shared by every law), ``conserve.discover`` (a law at random
points of a block) and ``conserve.count`` (the model inputs and outputs it differentiates). Imports only the
laws and the kernels' torch twin.

Model values as the checks read them:

* ``to_float64(value)``: floating (complex) tensors of a value (a tensor, or a tuple / list / dict of them)
  detached and made float64 (complex128); other entries unchanged.
* ``output_tensors(out)``: the floating tensors of a model's output, whatever holds them (a tensor; tuples,
  lists, dicts of them; an HF ``ModelOutput``); caches and other objects are skipped.
* ``flat_output(out)``: those tensors flattened into one vector (``TypeError`` when there is none).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..kernels import evaluate_reference
from ..laws import Law, compile_laws

__all__ = ["to_float64", "output_tensors", "flat_output", "law_vector", "random_projection", "cross_entropy",
           "gradients", "norm", "violation"]


def to_float64(value: Any) -> Any:
    """``value`` with every floating tensor detached and float64 (complex: complex128), in the same containers."""

    def cast(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return t.detach().to(torch.float64)
        if t.is_complex():
            return t.detach().to(torch.complex128)
        return t

    return tree_map(cast, value)


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return []


def output_tensors(out) -> list[torch.Tensor]:
    """The floating tensors of a model output, in order (see the module docstring)."""
    return [t for t in _tensors(out) if t.is_floating_point()]


def flat_output(out) -> torch.Tensor:
    """Every floating output tensor flattened and concatenated (one vector of output coordinates)."""
    parts = [t.reshape(-1) for t in output_tensors(out)]
    if not parts:
        raise TypeError(f"the block returned {type(out).__name__}: return a tensor (or a tuple / dict of tensors) "
                        "of outputs")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def law_vector(law: Law | Callable, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``h(params)`` flattened: a ``Law`` evaluated by the kernels' torch twin in float64 (differentiable), or a
    function ``h(params) -> Tensor`` called as is."""
    if isinstance(law, Law):
        c = compile_laws([law], {k: tuple(params[k].shape) for k in law.params if k in params})
        vec, grams = evaluate_reference(c.plan, [params[n] for n in c.names], fp64=True)
        return c.split(vec, grams)[0].reshape(-1)
    return law(params).reshape(-1)


def random_projection(outputs: Sequence[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """``sum_o r_o . f_o`` with Gaussian ``r_o`` of each output's shape and dtype."""
    return sum((torch.randn(t.shape, generator=gen, dtype=t.dtype) * t).sum() for t in outputs)


def cross_entropy(logits: Sequence[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """Softmax cross-entropy of each logits tensor (classes in the last dim) with uniform random targets, summed."""
    return sum(F.cross_entropy(t.reshape(-1, t.shape[-1]),
                               torch.randint(0, t.shape[-1], (t.numel() // t.shape[-1],), generator=gen))
               for t in logits)


def gradients(obj: torch.Tensor, params: Sequence[torch.Tensor], *, retain_graph: bool = False) -> list[torch.Tensor]:
    """``grad obj`` for each of ``params`` (zeros for a parameter ``obj`` does not read)."""
    gs = torch.autograd.grad(obj, list(params), retain_graph=retain_graph, allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(gs, params)]


def norm(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The Euclidean norm of a list of tensors taken as one vector."""
    return torch.sqrt(sum((t * t).sum() for t in ts))


def violation(h: torch.Tensor, params: Sequence[torch.Tensor], out_grads: Sequence[Sequence[torch.Tensor]],
              gen: torch.Generator, norms: Sequence[torch.Tensor] | None = None) -> float:
    """Worst ``|<grad (s.h), b>| / (||grad (s.h)|| ||b||)`` over the model gradients ``b`` in ``out_grads`` (each
    a list aligned with ``params``, the parameters ``h`` was computed from; a fresh Gaussian ``s`` per ``b``).
    ``norms``: ``||b||`` over every parameter of the model when ``params`` are only the law's (default: over
    ``params``). ``b`` = 0 (the outputs do not move) is skipped; -1.0 when ``grad h`` vanishes: ``h`` is constant
    here, there is nothing to track."""
    worst = 0.0
    for i, b in enumerate(out_grads):
        s = torch.randn(h.shape, generator=gen, dtype=torch.float64)
        a = gradients((s * h).sum(), params, retain_graph=True)
        an = norm(a)
        bn = norms[i] if norms is not None else norm(b)
        if an == 0:
            return -1.0
        if bn == 0:
            continue
        dot = sum((x * y).sum() for x, y in zip(a, b))
        worst = max(worst, float(dot.abs() / (an * bn)))
    return worst
