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

Data only: the torch twins that evaluate a plan are in ``reference.py``, the Triton path in ``runner.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["View", "GramTerm", "NormTerm", "SumTerm", "Plan", "FLOAT_DTYPES", "check_dtype"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what every backend reads
# the first-order term of a quadratic law h(theta) = B(theta, theta) over theta_{k+1} = a theta_k + Delta:
# h(a theta + Delta) - h(a theta) = FIRST_ORDER * B(a theta, Delta) + B(Delta, Delta) (spec "Discrete steps")
FIRST_ORDER = 2


def check_dtype(t: torch.Tensor, i: int) -> None:
    """``ValueError`` naming the fix when tensor ``i`` of a plan is not a real float of ``FLOAT_DTYPES``
    (a complex weight would lose its imaginary part, an integer one is not a weight; both backends
    refuse them alike)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"tensor {i} has dtype {t.dtype}; the laws read real float weights: pass it as "
                         f"one of {[str(d) for d in FLOAT_DTYPES]} (e.g. t.float())")


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
        ``t.data_ptr()``. Raises ``ValueError`` if the view does not fit inside ``t``
        or has a negative ``row_step`` / ``rows`` / ``cols``, a dimension ``t`` lacks, or ``cols > 1`` with
        ``col_dim=None``."""
        if len(self.start) != t.dim():
            raise ValueError(f"view start {self.start} has {len(self.start)} dims but the tensor has shape {tuple(t.shape)}")
        if self.row_step < 0 or self.rows < 0 or self.cols < 0:
            # the bounds check below reads the last element, the one farthest from the start only
            # when every step is >= 0
            raise ValueError(f"view {self} has a negative row_step, rows or cols; use row_step >= 0 from the "
                             f"lowest row (and rows, cols >= 0)")
        if not 0 <= self.row_dim < t.dim() or not (self.col_dim is None or 0 <= self.col_dim < t.dim()):
            raise ValueError(f"view {self} names a dimension outside a tensor of shape {tuple(t.shape)}")
        if self.col_dim is None and self.cols > 1:
            # one meaning for every backend: Triton would repeat the single column, the twin read it once
            raise ValueError(f"view {self} has col_dim=None (a single column) but cols={self.cols}; use cols=1")
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
