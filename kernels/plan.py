"""The evaluation plan: what every kernel computes, stated without nn.Module.

Every law of ``../shared/spec/laws.md`` is a signed sum of three kinds of *terms*, each reading a
strided 2-D view of one weight tensor (``V``, ``rows x cols``):

* ``GramTerm``  ``gram[bucket D][slot] += sign * V V^T``            (V: D x N)      -- head Gram laws
* ``NormTerm``  ``vec[index + r*index_stride] += sign * sum_c (V[r, c] + shift)^2`` -- unit, pair, gain laws
* ``SumTerm``   ``vec[index + c] += sign * sum_r V[r, c]``                            -- router / translation sums

A ``Plan`` is a list of such terms over a list of tensors. ``evaluate`` returns one fp32 (or fp64)
vector ``vec`` and, for each Gram size ``D``, a ``(slots, D, D)`` tensor. The same plan also gives the
symmetric *bilinear form* ``B(x, y)`` of the laws (``h(theta) = B(theta, theta)``), which the tracker
uses for the first- and second-order drift terms of spec section "Discrete steps":

* Gram:  ``sign * (X Y^T + Y X^T) / 2``;  Norm:  ``sign * sum_c (X+shift)(Y+shift)`` (shift only
  applies to ``h``, so ``bilinear`` requires shift == 0); Sum: linear laws have no bilinear part.

Views are *logical*: they name tensor dimensions, so transposed, strided or sliced tensors resolve
to the right memory strides at launch time (``View.resolve``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["View", "GramTerm", "NormTerm", "SumTerm", "Plan", "evaluate_reference", "bilinear_reference",
           "drift_reference"]


@dataclass(frozen=True)
class View:
    """A strided 2-D view ``rows x cols`` of one tensor, named in logical indices.

    Element ``(r, c)`` is ``tensor[start + r*row_step*e(row_dim) + c*e(col_dim)]`` where ``e(d)`` is the
    unit vector of dimension ``d``.  ``col_dim=None`` means a single column (a bias vector or gain).

    Attributes:
        tensor: index into the tensor list given to ``evaluate``.
        start: logical multi-index of element (0, 0); its length is the tensor's ``ndim``.
        row_dim, rows, row_step: the dimension walked by rows, how many rows, and the step between them
            (``row_step=2`` picks the even or odd rows of an interleaved RoPE pair).
        col_dim, cols: the dimension walked by columns (stride 1 in logical index), how many columns.
    """

    tensor: int
    start: tuple[int, ...]
    row_dim: int
    rows: int
    col_dim: int | None
    cols: int
    row_step: int = 1

    def resolve(self, t: torch.Tensor) -> tuple[int, int, int]:
        """Memory ``(offset, row_stride, col_stride)`` in elements of ``t``'s storage, relative to
        ``t.data_ptr()``. Raises ``ValueError`` if the view does not fit inside ``t``."""
        if len(self.start) != t.dim():
            raise ValueError(f"view start {self.start} has {len(self.start)} dims but the tensor has shape {tuple(t.shape)}")
        last = list(self.start)
        if self.rows > 0:
            last[self.row_dim] += (self.rows - 1) * self.row_step
        if self.col_dim is not None and self.cols > 0:
            last[self.col_dim] += self.cols - 1
        if any(i < 0 or (i >= n and not (self.rows == 0 or self.cols == 0)) for i, n in zip(last, t.shape)):
            raise ValueError(f"view {self} does not fit in a tensor of shape {tuple(t.shape)}")
        st = t.stride()
        offset = sum(i * s for i, s in zip(self.start, st))
        row_stride = self.row_step * st[self.row_dim]
        col_stride = st[self.col_dim] if self.col_dim is not None else 0
        return offset, row_stride, col_stride

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The view as a torch tensor (no copy): shape ``(rows, cols)``."""
        offset, rs, cs = self.resolve(t)
        return t.as_strided((self.rows, self.cols), (rs, cs), t.storage_offset() + offset)


@dataclass(frozen=True)
class GramTerm:
    """``gram[D][slot] += sign * V V^T`` with ``D = view.rows``."""

    view: View
    sign: float
    slot: int


@dataclass(frozen=True)
class NormTerm:
    """``vec[index + r*index_stride] += sign * sum_c (V[r, c] + shift)^2`` for each row ``r``.

    ``shift`` models gains stored as ``1 + w`` (Gemma)."""

    view: View
    sign: float
    index: int
    index_stride: int = 1
    shift: float = 0.0


@dataclass(frozen=True)
class SumTerm:
    """``vec[index + c] += sign * sum_r V[r, c]`` for each column ``c`` (linear laws)."""

    view: View
    sign: float
    index: int


@dataclass
class Plan:
    """Terms over ``num_tensors`` tensors, writing ``vec_size`` scalars and ``gram_slots[D]`` D x D blocks."""

    grams: list[GramTerm] = field(default_factory=list)
    norms: list[NormTerm] = field(default_factory=list)
    sums: list[SumTerm] = field(default_factory=list)
    vec_size: int = 0
    gram_slots: dict[int, int] = field(default_factory=dict)

    def new_vec(self, n: int) -> int:
        """Reserve ``n`` entries of ``vec``; returns the first index."""
        i = self.vec_size
        self.vec_size += n
        return i

    def new_gram(self, d: int) -> int:
        """Reserve one ``d x d`` slot; returns its slot index in bucket ``d``."""
        i = self.gram_slots.get(d, 0)
        self.gram_slots[d] = i + 1
        return i


def _acc_dtype(fp64: bool) -> torch.dtype:
    return torch.float64 if fp64 else torch.float32


def _empty_out(plan: Plan, device, dtype):
    vec = torch.zeros(plan.vec_size, device=device, dtype=dtype)
    grams = {d: torch.zeros(n, d, d, device=device, dtype=dtype) for d, n in sorted(plan.gram_slots.items())}
    return vec, grams


def evaluate_reference(plan: Plan, tensors: Sequence[torch.Tensor], *, fp64: bool = False):
    """Torch reference twin of every kernel: ``h(theta)`` for all terms of ``plan``.

    Args:
        plan: the terms.
        tensors: the weights the views index (any float dtype, any device, any strides).
        fp64: accumulate in float64 instead of float32.

    Returns:
        ``(vec, grams)``: ``vec`` of shape ``(plan.vec_size,)`` and a dict ``{D: (slots, D, D)}``, in the
        accumulation dtype, on the device of the tensors.
    """
    return _evaluate(plan, tensors, None, fp64)


def bilinear_reference(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, fp64: bool = False):
    """Symmetric bilinear form ``B(x, y)`` of the quadratic laws (spec "Discrete steps").

    ``B(x, x) == h(x)`` for Gram and Norm terms (shift must be 0); Sum terms contribute 0 here, since a
    linear law has no bilinear part. Same return layout as ``evaluate_reference``.
    """
    return _evaluate(plan, xs, ys, fp64)


def _evaluate(plan: Plan, xs, ys, fp64):
    for t in plan.grams:  # the Triton path says the same (launch._build_gram)
        D = t.view.rows
        if D not in plan.gram_slots or not 0 <= t.slot < plan.gram_slots[D]:
            raise ValueError(f"GramTerm slot {t.slot} of size {D} was not reserved with plan.new_gram({D})")
    dtype = _acc_dtype(fp64)
    device = xs[0].device if len(xs) else torch.device("cpu")
    vec, grams = _empty_out(plan, device, dtype)
    for t in plan.grams:
        x = t.view.of(xs[t.view.tensor]).to(dtype)
        if ys is None:
            g = x @ x.T
        else:
            y = t.view.of(ys[t.view.tensor]).to(dtype)
            g = x @ y.T
            g = (g + g.T) / 2
        grams[t.view.rows][t.slot] += t.sign * g
    for t in plan.norms:
        x = t.view.of(xs[t.view.tensor]).to(dtype)
        idx = t.index + t.index_stride * torch.arange(t.view.rows, device=device)
        if ys is None:
            s = ((x + t.shift) ** 2).sum(1)
        else:
            if t.shift != 0.0:
                raise ValueError("bilinear form of a shifted norm term is not defined; use shift=0")
            s = (x * t.view.of(ys[t.view.tensor]).to(dtype)).sum(1)
        vec.index_add_(0, idx, t.sign * s)
    if ys is None:
        for t in plan.sums:
            x = t.view.of(xs[t.view.tensor]).to(dtype)
            vec[t.index : t.index + t.view.cols] += t.sign * x.sum(0)
    return vec, grams


def drift_factors(a, n: int) -> list[float]:
    """Per-tensor decay factors of a step as python floats rounded to fp32 (as ``Hyper.a`` is, so every
    path uses the same ``a`` and ``a^2 - 1`` is exact in double).  ``a``: one float or ``n`` floats.
    Raises ``ValueError`` for a wrong length or a non-finite factor."""
    if isinstance(a, (int, float, np.integer, np.floating)) or (torch.is_tensor(a) and a.dim() == 0) \
            or (isinstance(a, np.ndarray) and a.ndim == 0):
        a = [float(a)] * n
    a = [float(np.float32(float(x))) for x in a]
    if len(a) != n:
        raise ValueError(f"drift: got {len(a)} decay factors for {n} tensors; pass one a per tensor (or one float)")
    if not all(np.isfinite(x) for x in a):
        raise ValueError(f"drift: decay factors must be finite, got {a}")
    return a


def _used(plan: Plan) -> list[int]:
    return sorted({t.view.tensor for t in list(plan.grams) + list(plan.norms) + list(plan.sums)})


def _check_drift_inputs(plan: Plan, olds, news):
    if len(olds) != len(news):
        raise ValueError(f"drift: got {len(olds)} old tensors but {len(news)} new ones; pass one old per new")
    for i in _used(plan):
        if not 0 <= i < len(news):
            raise ValueError(f"the plan names tensor {i} but {len(news)} tensors were given")
        if tuple(olds[i].shape) != tuple(news[i].shape):
            raise ValueError(f"drift: olds[{i}] has shape {tuple(olds[i].shape)} but news[{i}] has "
                             f"{tuple(news[i].shape)}; pass the same tensor before and after the step")


def drift_compose(plan: Plan, olds, news, a: Sequence[float], fp64: bool, evaluate: Callable, bilinear: Callable):
    """The drift terms as separate evaluations (``evaluate(plan, xs)`` / ``bilinear(plan, xs, ys)``
    return ``(vec, grams)``): ``h(news)``, ``h(a olds) - h(olds)``, ``B(a olds, Delta)``, ``h(Delta)``
    with ``Delta = news - a olds`` formed in fp32 (half inputs upcast exactly) or float64 (``fp64``).
    Only the tensors the plan reads are upcast / materialised."""
    dt = torch.float64 if fp64 else torch.float32
    o_, ao, dl = list(olds), list(olds), list(news)
    decays = False
    for i in _used(plan):
        n, o = news[i].to(dt), olds[i].to(dt)
        o_[i] = o
        if a[i] != 1.0:
            ao[i] = o * a[i]
            decays = True
        else:
            ao[i] = o
        dl[i] = n - ao[i]
    h_new = evaluate(plan, news)
    if decays:
        h_old, h_a = evaluate(plan, o_), evaluate(plan, ao)
        decay = (h_a[0] - h_old[0], {d: h_a[1][d] - h_old[1][d] for d in h_a[1]})
    else:  # h(a old) - h(old) == 0 exactly
        z = _empty_out(plan, h_new[0].device, h_new[0].dtype)
        decay = z
    return h_new, decay, bilinear(plan, ao, dl), evaluate(plan, dl)


def drift_reference(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, fp64: bool = False):
    """Torch twin of ``drift``: the law values after an optimizer step and the pieces of the exact drift
    identity (spec "Discrete steps")  ``h(new) = a^2 h(old) + 2a old^T M Delta + Delta^T M Delta``.

    Args:
        plan: the terms (``h``: ``evaluate_reference``; ``B``: ``bilinear_reference``).
        olds, news: the weights before / after the step, one pair per tensor of the plan, equal shapes
            (any float dtype, device or strides; tensors the plan does not read are not touched).
        a: decay factor per tensor (python floats, e.g. ``1 - lr*wd``; rounded to fp32 as ``Hyper.a``)
            or one float for all.
        fp64: float64 accumulation and ``Delta`` formed in float64; else fp32 (half inputs are upcast
            to fp32 before ``a*old`` and ``Delta = new - a*old`` are formed, each rounded to fp32).

    Returns:
        four ``(vec, {D: grams})`` pairs, layout of ``evaluate_reference``:
        ``h_new = h(news)``, ``decay = h(a olds) - h(olds)``, ``bil = B(a olds, Delta)``,
        ``h_delta = h(Delta)`` (Sum terms: linear, so ``bil`` has none and ``h_delta`` is ``c^T Delta``).
        The identity's terms are ``decay``, ``first = 2 bil (+ h_delta on linear entries)`` and
        ``second = h_delta`` (quadratic entries); see ``conserve.optim.fused``.

    Raises:
        ValueError: mismatched lists or shapes, wrong number of factors, a shifted NormTerm (its
            bilinear form is undefined).
    """
    olds, news = list(olds), list(news)
    _check_drift_inputs(plan, olds, news)
    a = drift_factors(a, len(news))
    ev = lambda p, xs: evaluate_reference(p, xs, fp64=fp64)  # noqa: E731
    bil = lambda p, xs, ys: bilinear_reference(p, xs, ys, fp64=fp64)  # noqa: E731
    return drift_compose(plan, olds, news, a, fp64, ev, bil)
