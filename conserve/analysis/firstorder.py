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

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..kernels import evaluate_reference
from ..laws import Law, compile_laws

__all__ = ["to_float64", "output_tensors", "flat_output", "law_vector", "random_projection", "cross_entropy",
           "gradients", "norm", "violation", "law_gradient", "law_size", "LawTerms"]


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


# --------------------------------------------------------------- the measure from a law's terms, no autograd
def _terms_grad(law: Law, params: dict, s: torch.Tensor) -> list[tuple[object, torch.Tensor]]:
    """``grad (s . h)`` of ``law`` as ``[(ref, d h / d view)]``, one per term, each a ``(rows, cols)`` float64
    tensor aligned with ``ref.view(0).of(params[ref.param])`` (``kernels.plan``: gram ``sign V V^T`` into the
    law's D x D slot; norm ``sign sum_c (V[r, c] + shift)^2`` into entry ``offset + r * stride``; sum ``sign
    sum_r V[r, c]`` into entry ``offset + c``)."""
    out = []
    for t in law.terms:
        x = t.ref.view(0).of(params[t.ref.param]).to(torch.float64)
        if t.kind == "gram":
            S = s.reshape(law.size, law.size)
            out.append((t.ref, t.sign * ((S + S.T) @ x)))
        elif t.kind == "norm":
            idx = t.offset + t.stride * torch.arange(t.ref.rows)
            out.append((t.ref, (2.0 * t.sign) * s[idx][:, None] * (x + t.shift)))
        elif t.kind == "sum":
            w = s[t.offset: t.offset + t.ref.cols]
            out.append((t.ref, (t.sign * w)[None, :].expand(t.ref.rows, t.ref.cols)))
        else:  # pragma: no cover - programming error
            raise ValueError(t.kind)
    return out


def law_size(law: Law) -> int:
    return law.size * law.size if law.kind == "gram" else law.size


def _disjoint(a, b) -> bool:
    """True when two refs of one parameter share no element (a structured test; False when unsure)."""
    if a.row_dim != b.row_dim or a.col_dim != b.col_dim:
        return False
    for d, (x, y) in enumerate(zip(a.start, b.start)):
        if d not in (a.row_dim, a.col_dim) and x != y:
            return True
    if a.col_dim is not None and (a.start[a.col_dim] + a.cols <= b.start[b.col_dim]
                                  or b.start[b.col_dim] + b.cols <= a.start[a.col_dim]):
        return True
    ra = set(range(a.start[a.row_dim], a.start[a.row_dim] + a.rows * max(a.row_step, 1), max(a.row_step, 1)))
    rb = set(range(b.start[b.row_dim], b.start[b.row_dim] + b.rows * max(b.row_step, 1), max(b.row_step, 1)))
    return a.row_step > 0 and b.row_step > 0 and not (ra & rb)


def law_gradient(law: Law, params: dict, s: torch.Tensor) -> dict[str, list]:
    """``grad (s . h)`` per parameter name: a list of ``(ref, tensor)`` pieces whose views share no element (pieces
    of one parameter that might overlap are summed into one dense gradient of the parameter, ref None)."""
    by: dict[str, list] = {}
    for ref, d in _terms_grad(law, params, s):
        by.setdefault(ref.param, []).append((ref, d))
    for k, pieces in by.items():
        if len(pieces) > 1 and not all(_disjoint(a, b) for i, (a, _) in enumerate(pieces) for b, _ in pieces[i + 1:]):
            dense = torch.zeros(params[k].shape, dtype=torch.float64)
            for ref, d in pieces:
                ref.view(0).of(dense).add_(d)
            by[k] = [(None, dense)]
    return by


_CHUNK = 1 << 22  # elements of the largest temporary ``_rowdot`` makes


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(x * y).sum(1)`` of two ``(rows, cols)`` views of one layout: one batched product when the rows are
    contiguous (no temporary), else elementwise products over slices of at most ``_CHUNK`` elements (a column
    view of a 4096 x 14336 weight would otherwise make a temporary of the weight's size)."""
    if x.stride(1) == 1 and y.stride(1) == 1 and x.shape[1] > 1:
        return (x.unsqueeze(1) @ y.unsqueeze(2)).reshape(-1)
    rows, cols = x.shape
    step = max(1, _CHUNK // max(rows, 1))
    if step >= cols:
        return (x * y).sum(1)
    out = torch.zeros(rows, dtype=torch.promote_types(x.dtype, y.dtype))
    for c in range(0, cols, step):
        out += (x[:, c: c + step] * y[:, c: c + step]).sum(1)
    return out


class LawTerms:
    """One law's views on the parameters, with what does not change between trials: whether its pieces on each
    parameter are disjoint, and each norm term's row sums of squares."""

    def __init__(self, law: Law, params: dict):
        self.law = law
        by: dict = {}
        for t in law.terms:
            by.setdefault(t.ref.param, []).append(t)
        self.disjoint = all(len(ts) == 1 or all(_disjoint(a.ref, b.ref) for i, a in enumerate(ts) for b in ts[i + 1:])
                            for ts in by.values())
        self.views = [t.ref.view(0).of(params[t.ref.param]) for t in law.terms]
        self.sq = [None if t.kind != "norm" or not self.disjoint else
                   (_rowdot(x, x) if not t.shift else ((x + t.shift) ** 2).sum(1))
                   for t, x in zip(law.terms, self.views)]

    def measure(self, params: dict, grads: dict, norms2: dict, s: torch.Tensor) -> float:
        """``|<grad (s.h), g>| / (||grad (s.h)|| ||g_law||)`` (-1.0: ``grad h`` vanishes; 0.0: ``g_law`` does)."""
        law = self.law
        dot = torch.zeros((), dtype=torch.float64)
        an2 = torch.zeros((), dtype=torch.float64)
        if not self.disjoint:  # pieces of one parameter may overlap: dense gradients of the parameters
            for k, pieces in law_gradient(law, params, s).items():
                for ref, d in pieces:
                    gv = grads[k] if ref is None else ref.view(0).of(grads[k])
                    dot += (d * gv).sum()
                    an2 += (d * d).sum()
        else:
            for t, x, sq in zip(law.terms, self.views, self.sq):
                gv = t.ref.view(0).of(grads[t.ref.param])
                if t.kind == "gram":
                    S = s.reshape(law.size, law.size)
                    d = (S + S.T) @ x
                    dot += t.sign * (d * gv).sum()
                    an2 += (d * d).sum()
                elif t.kind == "norm":
                    w = s[t.offset + t.stride * torch.arange(t.ref.rows)]
                    xs = x + t.shift if t.shift else x
                    dot += 2.0 * t.sign * (w * _rowdot(xs, gv)).sum()
                    an2 += 4.0 * (w * w * sq).sum()
                else:  # sum
                    w = s[t.offset: t.offset + t.ref.cols]
                    dot += t.sign * (w * gv.sum(0)).sum()
                    an2 += t.ref.rows * (w * w).sum()
        bn = math.sqrt(sum(norms2[k] for k in law.params))
        an = math.sqrt(max(float(an2), 0.0))
        if an == 0:
            return -1.0
        if bn == 0:
            return 0.0
        return float(dot.abs()) / (an * bn)
