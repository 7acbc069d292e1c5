"""The gradient check's sums (``conserve.analysis.gradcheck``): for a plan of quadratic and linear laws, weights
``xs`` and gradients ``ys``, everything the first-order product ``<grad h, y>`` of every law entry and its norms
need, in one pass over both.

``check_sums(plan, xs, ys)`` (``dispatch.py``) returns ``(vec, grams)``:

* ``vec`` ``(3, vec_size)``: per vector entry ``o``, ``[p, nh2, ng2]`` summed over its terms: a NormTerm
  ``s sum_c (x_rc + shift)^2`` of row r gives ``p += 2 s sum_c (x_rc + shift) y_rc``, ``nh2 += 4 s^2 sum_c
  (x_rc + shift)^2`` and ``ng2 += sum_c y_rc^2``; a SumTerm ``s sum_r x_rc`` of column c gives ``p += s sum_r
  y_rc`` and ``ng2 += sum_r y_rc^2`` (its ``||grad h||^2 = s^2 rows`` reads no weight: the caller adds it).
* ``grams`` ``{D: (3, slots, D, D)}``: plane 0 the bilinear form ``B(x, y) = sum_t s_t (X_t Y_t^T + Y_t X_t^T) / 2``
  of each slot (the products of its entries are ``2 B``), plane 1 ``diag(sum_t s_t^2 ||X_t[a]||^2)`` and plane 2
  ``diag(sum_t ||Y_t[a]||^2)`` (row a of every term of the slot).

Triton (``runner.check_triton``): the CHECK modes of ``gram.gram_kernel`` and ``norms.rowcol_kernel`` compute all
of it from ONE read of each term's view of the weights and the gradients (a tensor read in two directions, rows
and columns, once: one region).  The torch twin ``check_reference`` composes the existing twins instead: the
bilinear form of the plan (``reference.bilinear_reference``) and one evaluation of a derived plan of row norms
and sums over ``xs + ys`` (``row_plan``), so it reads the views twice; its results are the independent
reference the Triton path is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .plan import NormTerm, Plan, SumTerm, View
from .reference import bilinear_reference, evaluate_reference

__all__ = ["RowPlan", "row_plan", "check_reference", "transposed"]


def transposed(v: View, tensor: int) -> View:
    """View ``v`` (rows x cols, column stride 1 in logical index) read the other way round, on ``tensor``:
    row c of the result is column c of ``v``.  ``ValueError`` for a view whose rows step by more than 1."""
    if v.row_step != 1 and v.rows > 1:
        raise ValueError(f"a sum over rows stepping by {v.row_step} is not supported by the gradient check")
    if v.col_dim is None:  # a vector (one column): its rows become the one row's columns
        if v.rows <= 1:  # one element: the same view
            return replace(v, tensor=tensor)
        return View(tensor, v.start, v.row_dim, 1, v.row_dim, v.rows)
    return View(tensor, v.start, v.col_dim, v.cols, v.row_dim, v.rows)


@dataclass
class RowPlan:
    """The twin's derived plans of ``plan`` (``row_plan``).

    Attributes:
        bil: the plan with every shift set to 0 (the bilinear form of the quadratic part).
        rows: a plan over ``xs + ys`` whose vec holds the sections ``[0, V)`` ``4 s^2 sum (x+c)^2``, ``[V, 2V)``
            ``sum y^2``, ``[2V, 3V)`` ``s sum y`` (SumTerms) and ``2 s c sum y`` (shifted NormTerms), then per
            Gram size D (ascending) ``slots x D`` entries ``sum_t s_t^2 ||x_t[a]||^2`` and as many ``sum_t
            ||y_t[a]||^2``.
        grow: ``{D: first entry of its slots' rows}`` inside each of the two Gram row sections; gram_rows: their
            length ``R``.
    """

    bil: Plan
    rows: Plan
    grow: dict
    gram_rows: int


def row_plan(plan: Plan, n_tensors: int) -> RowPlan:
    """The derived plans of the torch twin (``RowPlan``) for ``plan`` over ``n_tensors`` weight tensors.
    ``ValueError`` for a layout the check cannot read (a shifted NormTerm with an output stride, a SumTerm
    over rows stepping by more than one)."""
    T, V = n_tensors, plan.vec_size
    bil = Plan(list(plan.grams), [replace(t, shift=0.0) for t in plan.norms], list(plan.sums), V,
               dict(plan.gram_slots))
    grow, R = {}, 0
    for d in sorted(plan.gram_slots):
        grow[d] = R
        R += plan.gram_slots[d] * d
    X, G, S, XR, GR = 0, V, 2 * V, 3 * V, 3 * V + R
    norms, sums = [], []
    for t in plan.norms:
        i, v = t.view.tensor, t.view
        norms.append(NormTerm(v, 4.0 * t.sign ** 2, X + t.index, t.index_stride, t.shift))
        norms.append(NormTerm(replace(v, tensor=T + i), 1.0, G + t.index, t.index_stride))
        if t.shift != 0.0:
            if t.index_stride != 1:
                raise ValueError("a shifted norm term with an output stride is not supported by the gradient check")
            sums.append(SumTerm(transposed(v, T + i), 2.0 * t.sign * t.shift, S + t.index))
    for t in plan.sums:
        i, v = t.view.tensor, t.view
        sums.append(SumTerm(replace(v, tensor=T + i), t.sign, S + t.index))
        norms.append(NormTerm(transposed(v, T + i), 1.0, G + t.index))
    for t in plan.grams:
        i, v = t.view.tensor, t.view
        r0 = grow[v.rows] + t.slot * v.rows
        norms.append(NormTerm(v, t.sign ** 2, XR + r0))
        norms.append(NormTerm(replace(v, tensor=T + i), 1.0, GR + r0))
    return RowPlan(bil, Plan([], norms, sums, 3 * V + 2 * R, {}), grow, R)


def check_reference(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], fp64: bool = False,
                    derived: RowPlan | None = None):
    """The torch twin of ``runner.check_triton`` (module docstring): ``(vec (3, vec_size), {D: (3, slots, D,
    D)})`` in float32 (float64 if ``fp64``) on the tensors' device.  ``derived``: ``row_plan(plan, len(xs))``,
    built once by a caller that checks often."""
    xs, ys = list(xs), list(ys)
    derived = derived or row_plan(plan, len(xs))
    V, R = plan.vec_size, derived.gram_rows
    bv, bg = bilinear_reference(derived.bil, xs, ys, fp64=fp64)
    rv, _ = evaluate_reference(derived.rows, xs + ys, fp64=fp64)
    vec = torch.stack([2 * bv + rv[2 * V:3 * V], rv[:V], rv[V:2 * V]])
    xr, gr = rv[3 * V:3 * V + R], rv[3 * V + R:]
    grams = {}
    for d, n in sorted(plan.gram_slots.items()):
        r0 = derived.grow[d]
        grams[d] = torch.stack([bg[d], torch.diag_embed(xr[r0:r0 + n * d].view(n, d)),
                                torch.diag_embed(gr[r0:r0 + n * d].view(n, d))])
    return vec, grams
