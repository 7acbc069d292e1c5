"""The torch reference twins of the kernels: ``evaluate``, ``bilinear``, ``drift`` on any device.

Vectorised: the terms of a ``Plan`` are grouped once per (plan, tensor layout) -- Gram terms by
``(D, contracted length, dtype)``, vector terms (``NormTerm`` rows, ``SumTerm`` columns) by
``(reduced length, function, dtype)`` -- and each group is ONE stacked tensor (same-shape views,
zero-copy ``as_strided`` blocks where the offsets form a progression, concatenated across tensors),
ONE batched matmul / reduction and ONE ``index_add_`` into the outputs.  The CPU cost follows the
FLOPs and bytes, not the number of terms (``bench/reference.py`` measures it against the looped
form, kept as ``_evaluate_looped`` for the tests).

Decay (spec "Discrete steps"): ``h(a old) - h(old)`` is computed per term in closed form --
quadratic terms ``s_t (a_t^2 - 1) h_t(old)`` (a Gemma-shifted norm adds ``2 s_t (a_t - 1) shift
sum_c x``), linear terms ``s_t (a_t - 1) sum x`` -- never as a difference of two evaluations (which
cancels to ~1e-4 relative in fp32 at ``a = 1 - 1e-3``).
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .plan import Plan, View

__all__ = ["evaluate_reference", "bilinear_reference", "decay_reference", "drift_reference", "drift_factors",
           "check_drift_inputs", "used_tensors", "drift_compose"]


def acc_dtype(fp64: bool) -> torch.dtype:
    return torch.float64 if fp64 else torch.float32


def empty_out(plan: Plan, device, dtype):
    """Zero ``(vec, {D: (slots, D, D)})`` of ``plan`` (the layout every evaluation returns)."""
    vec = torch.zeros(plan.vec_size, device=device, dtype=dtype)
    grams = {d: torch.zeros(n, d, d, device=device, dtype=dtype) for d, n in sorted(plan.gram_slots.items())}
    return vec, grams


def check_slots(plan: Plan):
    """``ValueError`` naming ``plan.new_gram`` for a GramTerm whose slot was not reserved."""
    for t in plan.grams:  # the Triton path says the same (launch._build_gram)
        D = t.view.rows
        if D not in plan.gram_slots or not 0 <= t.slot < plan.gram_slots[D]:
            raise ValueError(f"GramTerm slot {t.slot} of size {D} was not reserved with plan.new_gram({D})")


def _tensor(ts, i: int) -> torch.Tensor:
    if not 0 <= i < len(ts) or ts[i] is None:
        raise ValueError(f"the plan names tensor {i} but {len(ts)} tensors were given")
    return ts[i]


# ---------------------------------------------------------------------------------- grouped structure
@dataclass
class _Block:
    """``count`` views of one tensor, ``rows x length`` each, whose offsets advance by ``step``:
    ``tensor.as_strided((count, rows, length), (step, rs, ls), offset)`` (and the same for ``y``)."""

    tensor: int
    off: int
    step: int
    count: int
    rows: int
    length: int
    rs: int
    ls: int
    y: tuple | None = None  # (off, step, rs, ls) of the y tensor (bilinear), same index

    def take(self, t: torch.Tensor, y: bool = False) -> torch.Tensor:
        off, step, rs, ls = self.y if y else (self.off, self.step, self.rs, self.ls)
        return t.as_strided((self.count, self.rows, self.length), (step, rs, ls), t.storage_offset() + off)


def _extend(blocks: list, tensor, off, rows, length, rs, ls, y):
    """Append one view to ``blocks``, merging it into the last block when it continues its progression."""
    if blocks:
        b = blocks[-1]
        if b.tensor == tensor and b.rows == rows and b.length == length and b.rs == rs and b.ls == ls \
                and (b.y is None) == (y is None) and (y is None or (b.y[2], b.y[3]) == (y[2], y[3])):
            step = off - b.off if b.count == 1 else b.step
            ystep = (y[0] - b.y[0] if b.count == 1 else b.y[1]) if y is not None else 0
            if off == b.off + b.count * step and (y is None or y[0] == b.y[0] + b.count * ystep):
                b.step, b.count = step, b.count + 1
                if y is not None:
                    b.y = (b.y[0], ystep, b.y[2], b.y[3])
                return
    blocks.append(_Block(tensor, off, 0, 1, rows, length, rs, ls, None if y is None else (y[0], 0, y[2], y[3])))


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _grams(blocks, xs, ys, dtype) -> torch.Tensor:
    """``(views, D, D)`` Grams ``X X^T`` (``ys``: ``(X Y^T + Y X^T)/2``) of a group: one ``bmm`` per block,
    straight on the strided views (no stacking copy: BLAS takes either stride order)."""
    parts = []
    for b in blocks:
        x = b.take(xs[b.tensor]).to(dtype)
        y = x if ys is None else b.take(ys[b.tensor], True).to(dtype)
        parts.append(torch.bmm(x, y.transpose(1, 2)))
    G = _cat(parts)
    return G if ys is None else (G + G.transpose(1, 2)) / 2


def _row_sums(blocks, xs, ys, dtype, square: bool, shift=None) -> torch.Tensor:
    """Per stacked row of a group: ``sum (x + shift)^2`` (``square``), ``sum x`` (not), ``sum x*y``
    (``ys``), reduced on each block's strided view (no stacking copy)."""
    parts, r = [], 0
    for b in blocks:
        x = b.take(xs[b.tensor]).to(dtype)
        if ys is not None:
            v = (x * b.take(ys[b.tensor], True).to(dtype)).sum(-1)
        elif square:
            if shift is not None:
                x = x + shift[r:r + b.count * b.rows].view(b.count, b.rows, 1)
            v = torch.linalg.vector_norm(x, dim=-1).square()  # no (x * x) temporary the size of the view
        else:
            v = x.sum(-1)
        parts.append(v.reshape(-1))
        r += b.count * b.rows
    return _cat(parts)


@dataclass
class _GramGroup:
    D: int
    blocks: list
    tensor: np.ndarray  # tensor index of each stacked view
    sign_np: np.ndarray  # its sign (float64)
    slot: torch.Tensor  # (T,) int64 output slot per view
    sign: torch.Tensor  # (T,) signs in the accumulation dtype


@dataclass
class _RowGroup:
    """Vector terms reduced over ``length``: NormTerm rows (``square``) or SumTerm columns (not)."""

    square: bool
    blocks: list
    row_term: np.ndarray  # (R,) term id (into ``_Structure.vterms``) of each stacked row
    out: torch.Tensor  # (R,) vec index per row
    sign: torch.Tensor  # (R,) sign per row (acc dtype)
    shift: torch.Tensor | None  # (R,) shift per row, None when every shift is 0


@dataclass
class _Structure:
    grams: list
    rows: list
    vterms: list  # the vector terms, ids of ``_RowGroup.row_term``


def _clean(n, s):
    return s if n > 1 else 0  # the stride of an extent-1 dimension is never used


def _partner(ys, v, x):
    """The view of ``ys`` paired with view ``v`` of ``x`` in a bilinear form, resolved (equal shapes)."""
    yt = _tensor(ys, v.tensor)
    if tuple(yt.shape) != tuple(x.shape):
        raise ValueError(f"bilinear: xs[{v.tensor}] has shape {tuple(x.shape)} but ys[{v.tensor}] has "
                         f"{tuple(yt.shape)}; pass tensors of equal shapes")
    return v.resolve(yt)


def _build(plan: Plan, xs, ys, bilinear: bool, acc, device) -> _Structure:
    check_slots(plan)
    ggroups: dict = {}
    for t in plan.grams:
        v = t.view
        x = _tensor(xs, v.tensor)
        xo, xrs, xcs = v.resolve(x)
        y = None
        if ys is not None:
            yo, yrs, ycs = _partner(ys, v, x)
            y = (yo, 0, _clean(v.rows, yrs), _clean(v.cols, ycs))
        if v.rows == 0 or v.cols == 0 or x.numel() == 0:
            continue
        key = (v.rows, v.cols, x.dtype, None if ys is None else ys[v.tensor].dtype)
        ggroups.setdefault(key, []).append((v.tensor, xo, _clean(v.rows, xrs), _clean(v.cols, xcs), y,
                                            t.slot, float(t.sign)))
    grams = []
    for (D, N, *_), ents in ggroups.items():
        ents.sort(key=_order)
        blocks: list = []
        for (ti, xo, rs, cs, y, _, _) in ents:
            _extend(blocks, ti, xo, D, N, rs, cs, y)
        grams.append(_GramGroup(D, blocks, np.asarray([e[0] for e in ents], dtype=np.int64),
                                np.asarray([e[6] for e in ents], dtype=np.float64),
                                torch.tensor([e[5] for e in ents], dtype=torch.int64, device=device),
                                torch.tensor([e[6] for e in ents], dtype=acc, device=device)))
    vterms = list(plan.norms) + ([] if bilinear else list(plan.sums))
    rgroups: dict = {}
    for k, t in enumerate(vterms):
        v = t.view
        x = _tensor(xs, v.tensor)
        square = k < len(plan.norms)
        if square and bilinear and t.shift != 0.0:
            raise ValueError("bilinear form of a shifted norm term is not defined; use shift=0")
        xo, xrs, xcs = v.resolve(x)
        y = None
        if ys is not None:
            y = _partner(ys, v, x)
        if square:  # rows r -> vec[index + r*index_stride], reduced over the view's columns
            rows, length, rs, ls = v.rows, v.cols, xrs, xcs
            out = t.index + t.index_stride * np.arange(rows, dtype=np.int64)
            yy = None if y is None else (y[0], 0, _clean(rows, y[1]), _clean(length, y[2]))
        else:  # columns c -> vec[index + c], reduced over the view's rows
            rows, length, rs, ls = v.cols, v.rows, xcs, xrs
            out = t.index + np.arange(rows, dtype=np.int64)
            yy = None
        if rows == 0 or length == 0 or x.numel() == 0:
            continue
        if len(out) and (out.min() < 0 or out.max() >= plan.vec_size):
            raise ValueError(f"{type(t).__name__} writes vec[{out.min()}..{out.max()}] outside vec_size="
                             f"{plan.vec_size}; reserve entries with plan.new_vec")
        key = (square, length, x.dtype, None if ys is None else ys[v.tensor].dtype)
        rgroups.setdefault(key, []).append((v.tensor, xo, _clean(rows, rs), _clean(length, ls), yy, rows, k, out,
                                            float(t.sign), float(t.shift) if square else 0.0))
    groups = []
    for (square, length, *_), ents in rgroups.items():
        ents.sort(key=lambda e: (e[5],) + _order(e))  # equal row counts side by side: longer blocks
        blocks: list = []
        for (ti, xo, rs, ls, yy, rows, *_) in ents:
            _extend(blocks, ti, xo, rows, length, rs, ls, yy)
        shift = np.concatenate([np.full(e[5], e[9]) for e in ents])
        groups.append(_RowGroup(square, blocks, np.concatenate([np.full(e[5], e[6], dtype=np.int64) for e in ents]),
                                torch.as_tensor(np.concatenate([e[7] for e in ents]), device=device),
                                torch.as_tensor(np.concatenate([np.full(e[5], e[8]) for e in ents]), dtype=acc,
                                                device=device),
                                torch.as_tensor(shift, dtype=acc, device=device) if shift.any() else None))
    return _Structure(grams, groups, vterms)


def _order(e):
    """Views of one tensor with equal strides, by offset, so that progressions become one block (the
    order inside a group changes only the fp rounding of the ``index_add_`` sums)."""
    tensor, off, rs, ls, y = e[:5]
    return (tensor, rs, ls) + ((0, 0) if y is None else (y[2], y[3])) + (off, 0 if y is None else y[0])


_CACHE: "OrderedDict[tuple, _Structure]" = OrderedDict()
_CACHE_MAX = 512  # the drift sampler cycles through ~30-100 sub-plans, each with its own structures
_LOCK = threading.Lock()


def _layout_key(ts):
    return tuple(None if t is None else (t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
                 for t in ts)


def _forget(pid: int):
    with _LOCK:
        for k in [k for k in _CACHE if k[0] == pid]:
            del _CACHE[k]


def _structure(plan: Plan, xs, ys, bilinear: bool, acc, device) -> _Structure:
    """The grouped structure, cached per (plan object, sizes, tensor layouts): a Plan must not be edited
    after its first evaluation (the Triton path's rule too); ``clear_cache()`` if it is."""
    key = (id(plan), id(plan.grams), id(plan.norms), id(plan.sums), len(plan.grams), len(plan.norms),
           len(plan.sums), plan.vec_size, tuple(sorted(plan.gram_slots.items())), bilinear, acc,
           _layout_key(xs), None if ys is None else _layout_key(ys))
    with _LOCK:
        s = _CACHE.get(key)
        if s is not None:
            _CACHE.move_to_end(key)
            return s
    s = _build(plan, xs, ys, bilinear, acc, device)
    with _LOCK:
        new = key not in _CACHE
        _CACHE[key] = s
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    if new:
        weakref.finalize(plan, _forget, id(plan))
    return s


def clear_cache():
    """Forget every grouped structure (needed only after editing a Plan that was already evaluated)."""
    with _LOCK:
        _CACHE.clear()


# ----------------------------------------------------------------------------------------- evaluation
def _device(ts):
    given = [t for t in ts if t is not None]
    return given[0].device if given else torch.device("cpu")


def _run(plan: Plan, xs, ys, fp64: bool, gram_coef: Callable | None = None, row_coef: Callable | None = None):
    """``(vec, grams)`` of the grouped plan: evaluate (``ys`` None), bilinear, or decay (``gram_coef`` /
    ``row_coef`` give per-view / per-row coefficients replacing the signs, see ``decay_reference``)."""
    acc = acc_dtype(fp64)
    device = _device(xs)
    s = _structure(plan, xs, ys, ys is not None, acc, device)
    vec, grams = empty_out(plan, device, acc)
    for g in s.grams:
        coef = g.sign if gram_coef is None else gram_coef(g)
        if coef is None:  # every coefficient is 0
            continue
        grams[g.D].index_add_(0, g.slot, _grams(g.blocks, xs, ys, acc) * coef[:, None, None])
    for g in s.rows:
        if row_coef is not None:  # decay: c2 * sum x^2 + c1 * sum x per row
            coefs = row_coef(g)
            if coefs is None:
                continue
            c2, c1 = coefs
            v = c2 * _row_sums(g.blocks, xs, None, acc, True) if g.square else 0.0
            if c1 is not None:
                v = v + c1 * _row_sums(g.blocks, xs, None, acc, False)
            vec.index_add_(0, g.out, v)
        else:
            vec.index_add_(0, g.out, g.sign * _row_sums(g.blocks, xs, ys, acc, g.square, g.shift))
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

    Raises:
        ValueError: a view outside its tensor, a tensor index past the list, an unreserved Gram slot or
            vec entry.
    """
    return _run(plan, list(tensors), None, fp64)


def bilinear_reference(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], *, fp64: bool = False):
    """Symmetric bilinear form ``B(x, y)`` of the quadratic laws (spec "Discrete steps").

    ``B(x, x) == h(x)`` for Gram and Norm terms (shift must be 0: ``ValueError`` otherwise); Sum terms
    contribute 0 here, since a linear law has no bilinear part. Same return layout as
    ``evaluate_reference``; ``xs[i]`` and ``ys[i]`` must have equal shapes.
    """
    return _run(plan, list(xs), list(ys), fp64)


def decay_reference(plan: Plan, olds: Sequence[torch.Tensor], a: Sequence[float], *, fp64: bool = False):
    """``h(a old) - h(old)`` per term in closed form (no difference of two evaluations, so no fp32
    cancellation): Gram and unshifted Norm terms ``s_t (a_t^2 - 1) h_t(old)``; a Norm term with shift
    ``c`` adds ``2 s_t (a_t - 1) c sum_col x``; Sum terms ``s_t (a_t - 1) sum x``.  ``a``: one python
    float per tensor (``drift_factors``).  Terms with ``a_t == 1`` are exact zeros; a group whose terms
    all have ``a_t == 1`` is not read.  Layout of ``evaluate_reference``."""
    olds = list(olds)
    acc = acc_dtype(fp64)
    device = _device(olds)
    av = np.asarray(a, dtype=np.float64)
    s = _structure(plan, olds, None, False, acc, device)

    def gram_coef(g):
        at = av[g.tensor]
        if (at == 1.0).all():
            return None
        return torch.as_tensor(g.sign_np * (at * at - 1.0), dtype=acc, device=device)

    tens = np.asarray([t.view.tensor for t in s.vterms], dtype=np.int64)
    signs = np.asarray([t.sign for t in s.vterms], dtype=np.float64)
    shifts = np.asarray([getattr(t, "shift", 0.0) for t in s.vterms], dtype=np.float64)

    def row_coef(g):
        at = av[tens[g.row_term]]
        if (at == 1.0).all():
            return None
        sg = signs[g.row_term]
        if g.square:
            c2 = torch.as_tensor(sg * (at * at - 1.0), dtype=acc, device=device)
            sh = shifts[g.row_term]
            c1 = torch.as_tensor(2.0 * sg * (at - 1.0) * sh, dtype=acc, device=device) if sh.any() else None
            return c2, c1
        return None, torch.as_tensor(sg * (at - 1.0), dtype=acc, device=device)

    return _run(plan, olds, None, fp64, gram_coef, row_coef)


def _evaluate_looped(plan: Plan, xs, ys, fp64):
    """The term-by-term form (one matmul / reduction per term): the tests' reference for the grouped one."""
    check_slots(plan)
    dtype = acc_dtype(fp64)
    device = _device(xs)
    vec, grams = empty_out(plan, device, dtype)
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


# ----------------------------------------------------------------------------------------------- drift
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


def used_tensors(plan: Plan) -> list[int]:
    """Sorted indices of the tensors the plan's terms read."""
    return sorted({t.view.tensor for t in list(plan.grams) + list(plan.norms) + list(plan.sums)})


def check_drift_inputs(plan: Plan, olds, news):
    """``ValueError`` naming the fix for mismatched old/new lists or shapes."""
    if len(olds) != len(news):
        raise ValueError(f"drift: got {len(olds)} old tensors but {len(news)} new ones; pass one old per new")
    for i in used_tensors(plan):
        if not 0 <= i < len(news):
            raise ValueError(f"the plan names tensor {i} but {len(news)} tensors were given")
        if tuple(olds[i].shape) != tuple(news[i].shape):
            raise ValueError(f"drift: olds[{i}] has shape {tuple(olds[i].shape)} but news[{i}] has "
                             f"{tuple(news[i].shape)}; pass the same tensor before and after the step")


def drift_operands(plan: Plan, olds, news, a: Sequence[float], fp64: bool):
    """``a olds`` and ``Delta = news - a olds`` in fp32 (half inputs upcast exactly) or float64, only for
    the tensors the plan reads (the others are passed through untouched)."""
    dt = acc_dtype(fp64)
    ao, dl = list(olds), list(news)
    for i in used_tensors(plan):
        o = olds[i].to(dt)
        ao[i] = o * a[i] if a[i] != 1.0 else o
        dl[i] = news[i].to(dt) - ao[i]
    return ao, dl


def drift_compose(plan: Plan, olds, news, a: Sequence[float], fp64: bool, evaluate: Callable, bilinear: Callable,
                  decay: bool = True):
    """The drift pieces from separate evaluations (``evaluate(plan, xs)`` / ``bilinear(plan, xs, ys)``
    return ``(vec, grams)``): ``h(news)``, the closed-form decay (``decay_reference``, on the tensors'
    device; None if not ``decay``), ``B(a olds, Delta)``, ``h(Delta)`` (``drift_operands``)."""
    ao, dl = drift_operands(plan, olds, news, a, fp64)
    dec = decay_reference(plan, olds, a, fp64=fp64) if decay else None
    return evaluate(plan, news), dec, bilinear(plan, ao, dl), evaluate(plan, dl)


def drift_reference(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, fp64: bool = False,
                    *, decay: bool = True):
    """Torch twin of ``drift``: the law values after an optimizer step and the pieces of the exact drift
    identity (spec "Discrete steps")  ``h(new) = a^2 h(old) + 2a old^T M Delta + Delta^T M Delta``.

    Args:
        plan: the terms (``h``: ``evaluate_reference``; ``B``: ``bilinear_reference``).
        olds, news: the weights before / after the step, one pair per tensor of the plan, equal shapes
            (any float dtype, device or strides; tensors the plan does not read are not touched and may
            be None).
        a: decay factor per tensor (python floats, e.g. ``1 - lr*wd``; rounded to fp32 as ``Hyper.a``)
            or one float for all.
        fp64: float64 accumulation and ``Delta`` formed in float64; else fp32 (half inputs are upcast
            to fp32 before ``a*old`` and ``Delta = new - a*old`` are formed, each rounded to fp32).
        decay: compute the decay piece; False returns None in its place and reads nothing for it.

    Returns:
        four ``(vec, {D: grams})`` pairs (decay None when ``decay=False``), layout of
        ``evaluate_reference``: ``h_new = h(news)``, ``decay = h(a olds) - h(olds)`` in closed form per
        term (``decay_reference``), ``bil = B(a olds, Delta)``, ``h_delta = h(Delta)`` (Sum terms:
        linear, so ``bil`` has none and ``h_delta`` is ``c^T Delta``).  The identity's terms are
        ``decay``, ``first = 2 bil (+ h_delta on linear entries)`` and ``second = h_delta`` (quadratic
        entries).

    Raises:
        ValueError: mismatched lists or shapes, wrong number of factors, a shifted NormTerm (its
            bilinear form is undefined).
    """
    olds, news = list(olds), list(news)
    check_drift_inputs(plan, olds, news)
    a = drift_factors(a, len(news))
    return drift_compose(plan, olds, news, a, fp64, lambda p, xs: evaluate_reference(p, xs, fp64=fp64),
                         lambda p, xs, ys: bilinear_reference(p, xs, ys, fp64=fp64), decay=decay)
