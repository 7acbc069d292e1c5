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

Memory (``tests/test_tracker_memory.py`` bounds it, ``bench/reference.py`` prints it): the
whole-line entries are held as runs where they are (``_windows``: one int32 per piece of ``G >= 2``
lines, added by one ``index_add_`` per segment into a window view of ``vec``; no per-line table held
or widened), else as index tables, int16 where the entries fit (``_narrow_index``; widened per
segment where an ``index_add_`` reads them, after the reductions' temporaries are freed); the whole-line values alive
at once are one batch (a sign segment, ``_batches``), never all of them stacked; the batch with the
largest reduction temporary is reduced before the outputs are allocated (``_early``), so that
temporary never sits next to them.  None of this changes a bit of the results: the same reductions
run in the same order and every entry receives its additions in the same order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from .cache import KeyedCache
from .plan import Plan, check_dtype

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


_INDEX = torch.int32  # index tensors of the cached structures (index_add_/index_select take int32)


def _narrow_index(idx: np.ndarray, device) -> torch.Tensor:
    """A held index table in the narrowest dtype that holds it: int16 when every entry is below 2^15
    (half of int32's bytes), else ``_INDEX``; ``_wide`` widens it (a transient copy) where an
    ``index_add_`` reads it."""
    small = idx.size == 0 or (int(idx.min()) >= 0 and int(idx.max()) < (1 << 15))
    return torch.as_tensor(idx, dtype=torch.int16 if small else _INDEX, device=device)


def _wide(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` as an index ``index_add_`` takes (int32 / int64): a transient int32 copy of an int16 table."""
    return idx if idx.dtype in (torch.int32, torch.int64) else idx.to(_INDEX)


def _tensor(ts, i: int) -> torch.Tensor:
    if not 0 <= i < len(ts) or ts[i] is None:
        raise ValueError(f"the plan names tensor {i} but {len(ts)} tensors were given")
    check_dtype(ts[i], i)
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


def _grams(blocks, xs, ys, dtype, stack: bool = False) -> torch.Tensor:
    """``(views, D, D)`` Grams ``X X^T`` (``ys``: ``(X Y^T + Y X^T)/2``) of a group: one ``bmm`` per block,
    straight on the strided views (no stacking copy: BLAS takes either stride order).  ``stack``: the
    blocks' products are written into one ``(views, D, D)`` buffer (``bmm(out=)``; not under autograd)
    instead of being concatenated (no second copy of the group's Grams)."""
    if stack:
        n, D = sum(b.count for b in blocks), blocks[0].rows
        G, r = torch.empty(n, D, D, dtype=dtype, device=xs[blocks[0].tensor].device), 0
        for b in blocks:
            x = b.take(xs[b.tensor]).to(dtype)
            y = x if ys is None else b.take(ys[b.tensor], True).to(dtype)
            torch.bmm(x, y.transpose(1, 2), out=G[r: r + b.count])
            r += b.count
        return G if ys is None else torch.add(G, G.transpose(1, 2)).div_(2)
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
    tensor: np.ndarray | None  # tensor index of each stacked view (decay's structure only, else None)
    sign_np: np.ndarray | None  # its sign (float64; decay's structure only)
    slot: torch.Tensor  # (T,) output slot per view (``_INDEX``)
    sign: torch.Tensor  # (T,) signs in the accumulation dtype


@dataclass
class _RowGroup:
    """Vector terms reduced over ``length``: NormTerm rows (``square``) or SumTerm columns (not)."""

    square: bool
    blocks: list
    row_term: np.ndarray | None  # (R,) term id (into ``_Structure.vterms``) of each row (decay's structure only)
    out: torch.Tensor  # (R,) vec index per row (``_narrow_index``: int16 where it fits)
    sign: torch.Tensor | None  # (R,) sign per row (acc dtype; None in decay's structure: its coefficients replace it)
    shift: torch.Tensor | None  # (R,) shift per row, None when every shift is 0 (and in decay's structure)


@dataclass
class _Reduction:
    """One reduction of one whole tensor: ``dim`` None for a 1-D tensor read element by element
    (``x^2`` / ``x*y``), else ``sum_dim x^2`` (``kind`` "sq"), ``sum_dim x*y`` ("dot"), ``sum_dim x``
    ("sum"); its values fill ``[start, start + size)`` of the stacked line values."""

    tensor: int
    dim: int | None
    kind: str
    start: int
    size: int
    norm: bool  # one ``vector_norm`` along a contiguous dim (its values are squared, stacked, once)
    temp: int = 1 << 16  # elements of the largest temporary a strided reduction may make (``_temp_cap``)
    how: object = None  # the path ``_reduce`` takes (``_choose``), set at its first call


@dataclass
class _Lines:
    """Vector terms whose rows are whole lines of their tensor (a NormTerm row spanning every column
    of ``col_dim``, a SumTerm column spanning every row; the usual case: unit, pair, gain, router and
    translation laws): each tensor is reduced ONCE per (dim, kind), and the term rows gather their
    line values from the stacked reductions (``src``) into ``vec[out]``, one ``index_add_`` per distinct
    sign (rows sorted by sign: ``segments`` of ``(sign, start, end)``).  When every line value is read
    by exactly one term row (the usual case), ``src`` is None: ``out`` is indexed by the stacked line
    values themselves (no gathered copy, no ``src`` table) and ``segments`` are runs of equal sign in
    line order (the reductions sorted by sign)."""

    reductions: list
    src: torch.Tensor | None  # (R,) index into the stacked line values, per term row (None: identity)
    out: torch.Tensor  # (R,) vec index per term row (``_narrow_index``: int16 where it fits, as ``src``)
    segments: list  # (sign, r0, r1): rows [r0, r1) carry ``sign``
    norm_size: int = 0  # the first norm_size stacked values are norms (squared once)
    progressions: list | None = None  # (r0, r1, first, step, sign): ``src`` None, ``out`` None, see _build_lines
    batches: list | None = None  # ``src`` None: (i0, i1, values, squared, progressions, segments, sizes), _batches
    windows: list | None = None  # ``src`` and ``out`` None: ``(G, step, firsts)`` per segment, see _windows
    early: int | None = None  # ``_early``'s batch (-1: none), set at the first evaluation


@dataclass
class _Structure:
    grams: list
    rows: list  # vector terms NOT in ``lines``, grouped into strided blocks
    vterms: list  # the vector terms, ids of ``_RowGroup.row_term``
    lines: _Lines | None = None
    gram_stack: int = 0  # a Gram group with fewer output elements is stacked into one buffer (``_run``)


def _clean(n, s):
    return s if n > 1 else 0  # the stride of an extent-1 dimension is never used


def _partner(ys, v, x):
    """The view of ``ys`` paired with view ``v`` of ``x`` in a bilinear form, resolved (equal shapes)."""
    yt = _tensor(ys, v.tensor)
    if tuple(yt.shape) != tuple(x.shape):
        raise ValueError(f"bilinear: xs[{v.tensor}] has shape {tuple(x.shape)} but ys[{v.tensor}] has "
                         f"{tuple(yt.shape)}; pass tensors of equal shapes")
    return v.resolve(yt)


def _build(plan: Plan, xs, ys, bilinear: bool, acc, device, use_lines: bool = True) -> _Structure:
    """The grouped structure; the host arrays of the decay coefficients (``_GramGroup.tensor`` /
    ``sign_np``, ``_RowGroup.row_term``) only in decay's (``use_lines`` False), None otherwise; decay's
    row groups hold no signs or shifts (its coefficients replace them)."""
    check_slots(plan)
    decay = not use_lines
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
        grams.append(_GramGroup(D, blocks, np.asarray([e[0] for e in ents], dtype=np.int64) if decay else None,
                                np.asarray([e[6] for e in ents], dtype=np.float64) if decay else None,
                                torch.tensor([e[5] for e in ents], dtype=_INDEX, device=device),
                                torch.tensor([e[6] for e in ents], dtype=acc, device=device)))
    vterms = list(plan.norms) + ([] if bilinear else list(plan.sums))
    lines, on_lines = (_build_lines(plan, vterms, xs, ys, bilinear, acc, device) if use_lines else (None, set()))
    rgroups: dict = {}
    for k, t in enumerate(vterms):
        if k in on_lines:
            continue
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
        groups.append(_RowGroup(square, blocks, np.concatenate([np.full(e[5], e[6], dtype=np.int64) for e in ents])
                                if decay else None,
                                _narrow_index(np.concatenate([e[7] for e in ents]), device),
                                None if decay else torch.as_tensor(np.concatenate([np.full(e[5], e[8]) for e in ents]),
                                                                   dtype=acc, device=device),
                                torch.as_tensor(shift, dtype=acc, device=device) if shift.any() and not decay else None))
    return _Structure(grams, groups, vterms, lines, _gram_stack(plan, xs, acc))


def _line(t, x, square: bool):
    """``(dim, kind, line indices)`` when every row of vector term ``t`` is a whole line of ``x`` (the
    line index counts in ``x``'s shape with ``dim`` removed, C order), else None."""
    v = t.view
    shape = tuple(x.shape)
    if square:
        if getattr(t, "shift", 0.0) != 0.0:
            return None
        if v.col_dim is None:  # one element per row: only 1-D tensors (gains, biases)
            if x.dim() != 1:
                return None
            return None, v.start[0] + v.row_step * np.arange(v.rows, dtype=np.int64)
        d, n, walk, step = v.col_dim, v.cols, v.row_dim, v.row_step
    else:
        d, n, walk, step = v.row_dim, v.rows, v.col_dim, 1
        if v.row_step != 1:
            return None
    if v.start[d] != 0 or n != shape[d]:
        return None
    count = v.rows if square else v.cols
    rest = [i for i in range(x.dim()) if i != d]
    cstride = np.ones(len(rest), dtype=np.int64)
    for j in range(len(rest) - 2, -1, -1):
        cstride[j] = cstride[j + 1] * shape[rest[j + 1]]
    base = sum(int(v.start[i]) * int(c) for i, c in zip(rest, cstride))
    if walk is None or count == 0:
        return d, np.full(count, base, dtype=np.int64)
    return d, base + step * int(cstride[rest.index(walk)]) * np.arange(count, dtype=np.int64)


def _build_lines(plan: Plan, vterms, xs, ys, bilinear: bool, acc, device):
    """The ``_Lines`` of the vector terms that read whole lines, and the set of their term ids.  A
    (tensor, dim) is reduced whole only when its terms use at least half of its lines (else the view
    blocks read less)."""
    cand: dict = {}
    for k, t in enumerate(vterms):
        x = _tensor(xs, t.view.tensor)
        square = k < len(plan.norms)
        t.view.resolve(x)  # ValueError for a view outside its tensor
        if ys is not None:
            _partner(ys, t.view, x)
        if x.numel() == 0 or t.view.rows == 0 or t.view.cols == 0:
            continue
        got = _line(t, x, square)
        if got is None:
            continue
        d, idx = got
        kind = "dot" if (square and bilinear) else ("sq" if square else "sum")
        cand.setdefault((t.view.tensor, d, kind), []).append((k, idx))
    keep = []
    for (ti, d, kind), ents in cand.items():
        x = xs[ti]
        size = x.numel() // (x.shape[d] if d is not None else 1)
        used = np.unique(np.concatenate([i for _, i in ents]))
        if 2 * len(used) >= size:
            norm = kind == "sq" and d is not None and x.dtype == acc and (x.stride(d) == 1 or x.shape[d] == 1)
            keep.append((ti, d, kind, size, norm, ents))
    if not keep:
        return None, set()
    def first_sign(ents):
        return float(vterms[ents[0][0]].sign)

    keep.sort(key=lambda e: (not e[4], first_sign(e[5])))  # norms first: squared once, stacked; then by sign
    reds, src, out, sign, taken, start = [], [], [], [], set(), 0
    cap = _temp_cap(plan, xs, acc)
    for ti, d, kind, size, norm, ents in keep:
        reds.append(_Reduction(ti, d, kind, start, size, norm, cap))
        for k, idx in ents:
            t = vterms[k]
            square = k < len(plan.norms)
            src.append(start + idx)
            out.append((t.index + t.index_stride * np.arange(t.view.rows, dtype=np.int64)) if square
                       else t.index + np.arange(t.view.cols, dtype=np.int64))
            if out[-1].size and (out[-1].min() < 0 or out[-1].max() >= plan.vec_size):
                raise ValueError(f"{type(t).__name__} writes vec[{out[-1].min()}..{out[-1].max()}] outside "
                                 f"vec_size={plan.vec_size}; reserve entries with plan.new_vec")
            sign.append(np.full(len(idx), float(t.sign)))
            taken.add(k)
        start += size
    src, out, sign = np.concatenate(src), np.concatenate(out), np.concatenate(sign)
    norm_size = sum(r.size for r in reds if r.norm)
    if len(src) == start and (np.bincount(src, minlength=start) == 1).all():  # each line read once
        out_line, sign_line = np.empty_like(out), np.empty_like(sign)
        out_line[src], sign_line[src] = out, sign
        cuts = np.flatnonzero(np.diff(sign_line)) + 1
        bounds = [0, *cuts.tolist(), len(sign_line)]
        segments = [(float(sign_line[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])
                    if b > a and sign_line[a] != 0.0]
        progs = _progressions(reds, out_line, sign_line)
        if progs is not None:  # a few reductions, each onto a progression of entries: no index table at all
            return _Lines(reds, None, None, [], norm_size, progs, _batches(reds, norm_size, progs, [], None, cap)), taken
        wins = _windows(reds, out_line, segments, device)
        if wins is not None:  # runs of entries: one window index per run piece, no per-line table
            return _Lines(reds, None, None, segments, norm_size, None, _batches(reds, norm_size, [], segments, wins, cap),
                          windows=wins), taken
        out_t = _narrow_index(out_line, device)  # held: int16 (widened per segment where it is read)
        return _Lines(reds, None, out_t, segments, norm_size, None, _batches(reds, norm_size, [], segments, out_t, cap)), taken
    order = np.argsort(sign, kind="stable")
    src, out, sign = src[order], out[order], sign[order]
    cuts = np.flatnonzero(np.diff(sign)) + 1
    bounds = [0, *cuts.tolist(), len(sign)]
    segments = [(float(sign[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a and sign[a] != 0.0]
    return _Lines(reds, _narrow_index(src, device), _narrow_index(out, device), segments, norm_size), taken


_PROGRESSIONS = 16  # at most this many reductions are added onto strided views of vec (no index table)


def _progressions(reds, out_line: np.ndarray, sign_line: np.ndarray):
    """``[(r0, r1, first, step, sign)]`` when there are at most ``_PROGRESSIONS`` reductions and the
    line values of each go to entries ``first + step * i`` (``step > 0``) with one sign: ``vec``'s
    strided view ``as_strided((r1 - r0,), (step,), first)`` takes ``sign * v[r0:r1]`` (one ``add_``
    per reduction, in line order: the additions into each entry in the order of ``index_add_``).
    The usual case of a drift sampler's sub-plan over compact copies; else None."""
    if len(reds) > _PROGRESSIONS:
        return None
    progs = []
    for r in reds:
        o, sg = out_line[r.start: r.start + r.size], sign_line[r.start: r.start + r.size]
        if r.size == 0:
            continue
        step = int(o[1] - o[0]) if r.size > 1 else 1
        if step <= 0 or (np.diff(o) != step).any() or (sg != sg[0]).any():
            return None
        if sg[0] != 0.0:
            progs.append((r.start, r.start + r.size, int(o[0]), step, float(sg[0])))
    return progs


_WINDOWS = True  # whole-line entries encoded as runs (``_windows``) where they are; False: the int16 table


def _pow2(x: float) -> bool:
    """Whether ``x`` is +-2^k: ``x * v`` is exact, so ``a + x*v`` has one rounding fused or not."""
    return x != 0.0 and np.isfinite(x) and math.frexp(abs(x))[0] == 0.5


def _windows(reds, out_line: np.ndarray, segments, device):
    """``[(G, step, firsts)]``, one per sign segment ``(sign, r0, r1)``, when the entries of every
    segment's lines are pieces of ``G >= 2`` consecutive lines onto ``first + step * j`` (``firsts``:
    ``(r1 - r0) / G`` int32, one per piece; the pieces end at every reduction's start, so a batch cut
    there clips whole pieces) and every sign is +-2^k; else None (the per-line table).
    ``_add_window`` adds a piece per row of a window view of ``vec`` (one ``index_add_`` per segment,
    rows in line order: each entry receives its additions in the order of the per-line ``index_add_``,
    bit for bit).  The usual case: a term's rows r go to ``index + r*index_stride``, its columns c to
    ``index + c``."""
    if not _WINDOWS or not segments:
        return None
    starts = np.asarray([r.start for r in reds], dtype=np.int64)
    got = []
    for sign, a, b in segments:
        if not _pow2(sign):
            return None
        o = out_line[a:b]
        d = np.diff(o)
        pos = d[d > 0]
        vals, counts = np.unique(pos, return_counts=True)  # the most common forward step (no vec-sized bincount)
        step = int(vals[counts.argmax()]) if pos.size else 1
        cuts = np.union1d(np.flatnonzero(d != step) + 1, starts[(starts > a) & (starts < b)] - a)
        bounds = np.concatenate([[0], cuts, [b - a]])
        G = int(np.gcd.reduce(np.diff(bounds)))
        if G < 2:
            return None
        got.append((G, step, torch.as_tensor(o[::G], dtype=_INDEX, device=device)))
    return got


_WINDOW_ROWS = 128  # a segment of more pieces is added through a transient int32 per-line index


def _add_window(vec: torch.Tensor, values: torch.Tensor, win, sign: float) -> None:
    """``vec[firsts[i] + step * j] += sign * values[i * G + j]`` (``win``: ``(G, step, firsts)``): one
    ``index_add_`` of the ``(pieces, G)`` values into the overlapping window view
    ``vec.as_strided((rows, G), (1, step))`` (row ``e``: entries ``e + step * j``), rows in order.
    More than ``_WINDOW_ROWS`` pieces (on a CPU a 2-D ``index_add_`` costs far more per row than the
    1-D one per line: ``bench/NOTES.md``, "Reference twin: window adds"): the 1-D ``index_add_`` over
    the per-line entries formed transiently in int32 (one op); the same additions in the same order.
    Off the CPU too (a CUDA ``index_add_`` under deterministic algorithms is an ``index_put_``, which
    refuses an overlapping view)."""
    G, step, firsts = win
    if firsts.numel() > _WINDOW_ROWS or vec.device.type != "cpu":
        vec.index_add_(0, _window_index(win, _INDEX), values, alpha=sign)
        return
    vs = vec.stride(0)
    rows = vec.numel() - (G - 1) * step
    vec.as_strided((rows, G), (vs, step * vs), vec.storage_offset()).index_add_(0, firsts, values.view(-1, G),
                                                                                  alpha=sign)


def _window_index(win, dtype=torch.int64) -> torch.Tensor:
    """The per-line entries of ``win``, a transient table (int64: the autograd path's ``index_add_``)."""
    G, step, firsts = win
    return (firsts.to(dtype)[:, None] + torch.arange(0, G * step, step, dtype=dtype, device=firsts.device)).reshape(-1)


_BATCH_MIN = 256  # a batch of stacked line values holds at least this many (a batch costs one cat and its adds)
_CUT_MIN = 256  # ... and is closed at the end of a sign segment once it holds this many (no extra index_add_)


def _batches(reds, norm_size: int, progs, segments, out, cap: int):
    """Reductions ``[i0, i1)`` whose values ``[v0, v1)`` are stacked, squared (up to ``squared end``)
    and added at once, at most ``cap`` values each (``_temp_cap``: the bound on any temporary of the
    plan, 1/16 of its tensors' bytes; at least ``_BATCH_MIN``), with the
    progressions and the segments (clipped; with their view of ``out``) that fall in them, offsets
    relative to ``v0``; the additions into each entry keep their line order.  A batch of at least
    ``_CUT_MIN`` values ends where a sign segment ends (at a reduction boundary): the stacked values
    alive at once are about one segment's, at the cost of one ``empty`` per batch and no extra
    ``index_add_`` (each segment is still added by one call)."""
    size = max(_BATCH_MIN, cap)
    ends = {b for _, _, b in segments}  # a batch holding _CUT_MIN values is closed where a segment ends
    got, i0 = [], 0
    while i0 < len(reds):
        i1, v0 = i0, reds[i0].start
        while i1 < len(reds) and (i1 == i0 or reds[i1].start + reds[i1].size - v0 <= size):
            i1 += 1
            end = reds[i1 - 1].start + reds[i1 - 1].size
            if end in ends and end - v0 >= _CUT_MIN:
                break
        v1 = reds[i1 - 1].start + reds[i1 - 1].size
        ps = [(p[0] - v0, p[1] - v0) + tuple(p[2:]) for p in progs if v0 <= p[0] < v1]
        ss = [(sg, max(a, v0) - v0, min(b, v1) - v0, _clip(out, k, a, max(a, v0), min(b, v1)))
              for k, (sg, a, b) in enumerate(segments) if a < v1 and b > v0]
        got.append((i0, i1, v1 - v0, min(max(norm_size, v0), v1) - v0, ps, ss, [r.size for r in reds[i0:i1]]))
        i0 = i1
    return got


def _clip(out, k: int, a: int, c0: int, c1: int):
    """Lines ``[c0, c1)`` of segment ``k`` (its lines start at ``a``): a view of the table ``out``, or
    ``(G, step, firsts)`` of its windows (``out``: ``_windows``' list; the cut is at a piece's end)."""
    if isinstance(out, list):
        G, step, firsts = out[k]
        assert (c0 - a) % G == 0 and (c1 - a) % G == 0
        return G, step, firsts[(c0 - a) // G: (c1 - a) // G]
    return out[c0:c1]


_CHUNK = 1 << 16  # elements of the largest temporary a strided reduction makes
_GRAM_STACK = 1 << 14  # a Gram group with fewer output elements (and within ``_temp_cap``) is stacked (one
# buffer); larger, block by block (the same bits: ``index_add_`` adds the views in order either way)
_TEMP_SHARE = 16  # ... and at most 1/_TEMP_SHARE of the bytes of the tensors the plan reads
_TEMP_MIN = 1 << 10  # (but never fewer elements than this: each chunk pays a fixed dispatch cost)
_SMALL = 1 << 14  # a strided "sq" above the cap and of at most this many elements: one vector_norm


def _temp_cap(plan: Plan, xs, acc) -> int:
    """Elements of the largest temporary a strided reduction of ``plan`` over ``xs`` may make:
    ``_CHUNK``, and at most ``1 / _TEMP_SHARE`` of the bytes of the tensors the plan reads (in ``acc``
    elements; at least ``_TEMP_MIN``), so no reduction's temporary is a large share of small weights."""
    nbytes = sum(xs[i].numel() * xs[i].element_size() for i in used_tensors(plan) if 0 <= i < len(xs) and xs[i] is not None)
    return int(min(_CHUNK, max(_TEMP_MIN, nbytes // (_TEMP_SHARE * acc.itemsize))))


def _gram_stack(plan: Plan, xs, acc) -> int:
    """Output elements below which a Gram group's products are stacked into one buffer (``_run``):
    ``_GRAM_STACK``, and within ``_temp_cap`` (small weights with many heads: that buffer would be a
    large share of them, e.g. 2x the law values of a Q/K pair)."""
    return min(_GRAM_STACK, _temp_cap(plan, xs, acc))


def _reduce(r: _Reduction, x: torch.Tensor, y: torch.Tensor | None, acc, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of one ``_Reduction`` over tensor ``x`` (``y``: the partner of "dot"), in ``acc``,
    flattened in C order of ``x.shape`` without ``r.dim``; Euclidean norms (to be squared) when
    ``r.norm``.  A reduction along a contiguous dimension of an ``acc`` tensor is one ``vector_norm`` /
    ``sum``.  Along a strided dimension (where ``vector_norm`` is slower than ``(x * x).sum`` on a CPU:
    ``bench/NOTES.md``, "Reference twin: strided reductions") it is summed in chunks of at most
    ``r.temp`` elements (``_temp_cap``: one chunk, the whole tensor, in the usual case), except a
    "sq" above ``r.temp`` and of at most ``_SMALL`` elements: one ``vector_norm`` squared, no
    temporary (a 256 x 32 embedding's ``x * x`` would be 0.15x the default model's weights).  ``out``:
    a contiguous ``acc`` vector of the values' length that receives them (returned; the same values bit
    for bit, no copy)."""
    d, kind, how = r.dim, r.kind, r.how
    if how is None:  # chosen once per structure (its layouts are part of the cache key)
        how = r.how = _choose(r, x, y, acc)
    if out is not None:
        return _reduce_into(out, how, x, y, d, kind, acc)
    if how == "elem":  # 1-D, element by element (small: gains and biases)
        v = x if x.dtype == acc else x.to(acc)
        return v * v if kind != "dot" else v * (y if y.dtype == acc else y.to(acc))
    flat = x.dim() != 2  # results of other ranks (0-d, N-D) are flattened
    if how == "norm":
        v = torch.linalg.vector_norm(x, dim=d)
    elif how == "sum":
        v = x.sum(d)
    elif how == "vn":
        v = torch.linalg.vector_norm(x, dim=d, dtype=acc)
        v = v.square() if v.requires_grad else v.square_()  # not in place under autograd
    elif how == "temp":  # one temporary, the tensor's size
        v = (x * (x if kind == "sq" else y)).sum(d)
    else:
        return _chunked(x, y, d, kind, how, acc)
    return v.reshape(-1) if flat else v


def _reduce_into(out: torch.Tensor, how, x: torch.Tensor, y, d, kind: str, acc) -> torch.Tensor:
    """``_reduce`` writing into ``out`` (the path ``how`` already chosen): the same operations, with
    ``out=`` (or in place on ``out``) instead of a fresh result."""
    if how == "elem":
        if x.dtype == acc and (kind != "dot" or y.dtype == acc):  # one op, the same product
            return torch.mul(x, x if kind != "dot" else y, out=out)
        out.copy_(x)
        return out.mul_(out if kind != "dot" else y)  # in acc: y (any float dtype) is promoted exactly
    o = out if x.dim() == 2 else out.view([n for i, n in enumerate(x.shape) if i != d])  # C order of x without d
    if how == "norm":
        torch.linalg.vector_norm(x, dim=d, out=o)
    elif how == "sum":
        torch.sum(x, d, out=o)
    elif how == "vn":
        torch.linalg.vector_norm(x, dim=d, dtype=acc, out=o).square_()
    elif how == "temp":
        torch.sum(x * (x if kind == "sq" else y), d, out=o)
    else:
        _chunked(x, y, d, kind, how, acc, out=o)
    return out


def _choose(r: _Reduction, x: torch.Tensor, y, acc):
    """How ``_reduce`` reduces ``x``: "elem", "norm", "sum", "vn", "temp", or the chunk length (int)."""
    d, kind = r.dim, r.kind
    if d is None:
        return "elem"
    if r.norm:
        return "norm"
    if kind == "sum" and x.dtype == acc:
        return "sum"
    if kind == "sq" and r.temp < x.numel() <= _SMALL and torch.promote_types(x.dtype, acc) == acc:
        return "vn"
    n = x.shape[d]
    k = max(1, min(_CHUNK, r.temp) // max(1, x.numel() // max(n, 1)))
    if k >= n and x.dtype == acc and (kind != "dot" or y.dtype == acc):
        return "sum" if kind == "sum" else "temp"
    return k


def _chunked(x, y, d: int, kind: str, k: int, acc, out: torch.Tensor | None = None) -> torch.Tensor:
    """``_reduce`` over chunks of ``k`` positions of dim ``d`` (temporaries of at most ``k`` lines);
    ``out``: the result's shape (x's without ``d``), summed into in place."""
    xm = x.movedim(d, -1)
    ym = y.movedim(d, -1) if kind == "dot" else None
    total = None
    for s0 in range(0, xm.shape[-1], k):
        c = xm[..., s0:s0 + k].to(acc)
        prod = c * c if kind == "sq" else (c * ym[..., s0:s0 + k].to(acc) if kind == "dot" else c)
        if total is None:
            total = prod.sum(-1) if out is None else torch.sum(prod, -1, out=out)
        else:
            total.add_(prod.sum(-1))
        del prod
    return total.reshape(-1)


def _batched(lines: _Lines, xs, ys) -> bool:
    """Whether ``lines`` takes the batch path (in place: not under autograd)."""
    return lines.batches is not None and not (torch.is_grad_enabled() and any(
        xs[r.tensor].requires_grad or (ys is not None and ys[r.tensor].requires_grad) for r in lines.reductions))


def _temp_size(r: _Reduction, x: torch.Tensor, y, acc) -> int:
    """Elements of the temporary ``_reduce`` makes for ``r`` (its path chosen here if not yet)."""
    if r.how is None:
        r.how = _choose(r, x, y, acc)
    if r.how == "temp":
        return x.numel()
    if isinstance(r.how, int):
        return r.how * (x.numel() // max(1, x.shape[r.dim]))
    return 0


def _early(lines: _Lines, xs, ys, acc) -> int | None:
    """The batch whose reductions make the largest temporary (``_run`` reduces it before the outputs
    are allocated, so that temporary never sits next to them); None when none makes one.  Chosen once
    per structure (its layouts are part of the cache key)."""
    if lines.early is None:
        best, lines.early = 0, -1
        for b, (i0, i1, *_) in enumerate(lines.batches):
            for r in lines.reductions[i0:i1]:
                t = _temp_size(r, xs[r.tensor], None if ys is None else ys[r.tensor], acc)
                if t > best:
                    best, lines.early = t, b
    return lines.early if lines.early >= 0 else None


def _batch_values(lines: _Lines, batch, xs, ys, acc, device) -> torch.Tensor:
    """The stacked values of one batch (``_batches``): each reduction's values straight into their
    place (no parts, no cat), the norms squared in place."""
    i0, i1, n, sq = batch[:4]
    reds = lines.reductions
    v = torch.empty(n, dtype=acc, device=device)
    for r, part in zip(reds[i0:i1], v.split(batch[6]) if i1 - i0 > 1 else (v,)):  # one op for all the places
        _reduce(r, xs[r.tensor], None if ys is None else ys[r.tensor], acc, out=part)
    if sq > 0:
        (v if sq == n else v[:sq]).square_()
    return v


def _add_lines(vec: torch.Tensor, lines: _Lines, xs, ys, acc, early=None) -> None:
    """``vec[out] += sign * value`` for every term row of ``lines``; ``early``: ``(batch, values)`` of a
    batch already reduced (``_run``), added in its turn (the additions into each entry keep their order)."""
    if _batched(lines, xs, ys):
        for b, batch in enumerate(lines.batches):
            n, progs, segs = batch[2], batch[4], batch[5]
            v = early[1] if early is not None and early[0] == b else _batch_values(lines, batch, xs, ys, acc, vec.device)
            for r0, r1, first, step, sign in progs:
                vec.as_strided((r1 - r0,), (step,), vec.storage_offset() + first).add_(
                    v if r1 - r0 == n else v[r0:r1], alpha=sign)
            for sign, r0, r1, o in segs:  # (the widened index lives after the reductions' temporaries)
                if isinstance(o, tuple):
                    _add_window(vec, v if r1 - r0 == n else v[r0:r1], o, sign)
                else:
                    vec.index_add_(0, _wide(o), v if r1 - r0 == n else v[r0:r1], alpha=sign)
            del v
        return
    norms, other = [], []
    for r in lines.reductions:
        (norms if r.norm else other).append(_reduce(r, xs[r.tensor], None if ys is None else ys[r.tensor], acc))
    if torch.is_grad_enabled() and any(t.requires_grad for t in norms):  # not in place under autograd
        v = _cat(([_cat(norms).square()] if norms else []) + other)
    else:  # the norms are fresh tensors: squared in place, one stacked copy in all
        v = _cat(norms + other) if len(norms) + len(other) > 1 else (norms + other)[0]
        if norms:
            v[: lines.norm_size].square_()
    if lines.src is not None:
        v = v.index_select(0, _wide(lines.src))
    for r0, r1, first, step, sign in lines.progressions or ():
        vec.as_strided((r1 - r0,), (step,), vec.storage_offset() + first).add_(v[r0:r1], alpha=sign)
    for k, (sign, r0, r1) in enumerate(lines.segments):
        idx = _window_index(lines.windows[k]) if lines.windows is not None else _wide(lines.out[r0:r1])
        vec.index_add_(0, idx, v[r0:r1], alpha=sign)


def _order(e):
    """Views of one tensor with equal strides, by offset, so that progressions become one block (the
    order inside a group changes only the fp rounding of the ``index_add_`` sums)."""
    tensor, off, rs, ls, y = e[:5]
    return (tensor, rs, ls) + ((0, 0) if y is None else (y[2], y[3])) + (off, 0 if y is None else y[0])


# The structures of each plan, keyed on its identity first (the drift sampler cycles through ~30-100
# sub-plans, each with its own structures); a plan's entries are forgotten when it is garbage-collected.
_CACHE = KeyedCache(512)
_forget = _CACHE.forget


def _layout_key(ts):
    return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.device) for t in ts)


def _structure(plan: Plan, xs, ys, bilinear: bool, acc, device, use_lines: bool = True) -> _Structure:
    """The grouped structure, cached per (plan object, sizes, tensor layouts): a Plan must not be edited
    after its first evaluation (the Triton path's rule too); ``clear_cache()`` if it is."""
    key = (id(plan), id(plan.grams), id(plan.norms), id(plan.sums), len(plan.grams), len(plan.norms),
           len(plan.sums), plan.vec_size, tuple(sorted(plan.gram_slots.items())), bilinear, acc,
           _layout_key(xs), None if ys is None else _layout_key(ys), use_lines)
    return _CACHE.cached(key, lambda: _build(plan, xs, ys, bilinear, acc, device, use_lines), owner=plan)


def clear_cache():
    """Forget every grouped structure (needed only after editing a Plan that was already evaluated)."""
    _CACHE.clear()


# ----------------------------------------------------------------------------------------- evaluation
def _device(ts):
    given = [t for t in ts if t is not None]
    return given[0].device if given else torch.device("cpu")


def _run(plan: Plan, xs, ys, fp64: bool, gram_coef: Callable | None = None, row_coef: Callable | None = None,
         out=None):
    """``(vec, grams)`` of the grouped plan: evaluate (``ys`` None), bilinear, or decay (``gram_coef`` /
    ``row_coef`` give per-view / per-row coefficients replacing the signs, see ``decay_reference``)."""
    acc = acc_dtype(fp64)
    device = _device(xs)
    s = _structure(plan, xs, ys, ys is not None, acc, device, use_lines=row_coef is None)
    early = None  # the batch of line values with the largest temporary: reduced before the outputs exist
    if s.lines is not None and _batched(s.lines, xs, ys) and (b := _early(s.lines, xs, ys, acc)) is not None:
        early = (b, _batch_values(s.lines, s.lines.batches[b], xs, ys, acc, device))
    vec, grams = empty_out(plan, device, acc) if out is None else (out[0].zero_(), {d: g.zero_() for d, g in out[1].items()})
    if s.lines is not None:
        _add_lines(vec, s.lines, xs, ys, acc, early)
        del early
    for g in s.grams:
        coef = g.sign if gram_coef is None else gram_coef(g)
        if coef is None:  # every coefficient is 0
            continue
        if torch.is_grad_enabled() and any(xs[b.tensor].requires_grad or (ys is not None and ys[b.tensor].requires_grad)
                                           for b in g.blocks):  # under autograd: no in-place writes
            grams[g.D].index_add_(0, g.slot, _grams(g.blocks, xs, ys, acc) * coef[:, None, None])
            continue
        if len(g.slot) * g.D * g.D < s.gram_stack:  # one buffer of the group's Grams, scaled in place
            grams[g.D].index_add_(0, g.slot, _grams(g.blocks, xs, ys, acc, stack=True).mul_(coef[:, None, None]))
            continue
        r = 0  # large Grams: block by block, scaled in place (the block's own output alive, no stacked copies)
        for b in g.blocks:
            G = _grams([b], xs, ys, acc)
            grams[g.D].index_add_(0, g.slot[r: r + b.count], G.mul_(coef[r: r + b.count, None, None]))
            r += b.count
            del G
    for g in s.rows:
        if row_coef is not None:  # decay: c2 * sum x^2 + c1 * sum x per row
            coefs = row_coef(g)
            if coefs is None:
                continue
            c2, c1 = coefs
            v = c2 * _row_sums(g.blocks, xs, None, acc, True) if g.square else 0.0
            if c1 is not None:
                v = v + c1 * _row_sums(g.blocks, xs, None, acc, False)
            vec.index_add_(0, _wide(g.out), v)
        else:
            vec.index_add_(0, _wide(g.out), g.sign * _row_sums(g.blocks, xs, ys, acc, g.square, g.shift))
    return vec, grams


def evaluate_reference(plan: Plan, tensors: Sequence[torch.Tensor], *, fp64: bool = False, out=None):
    """Torch reference twin of every kernel: ``h(theta)`` for all terms of ``plan``.

    Args:
        plan: the terms.
        tensors: the weights the views index (any float dtype, any device, any strides).
        fp64: accumulate in float64 instead of float32.
        out: ``(vec, grams)`` of this layout, dtype and device (checked by ``dispatch.evaluate``), zeroed and
            accumulated into after the checks below (nothing new allocated for the outputs).

    Returns:
        ``(vec, grams)``: ``vec`` of shape ``(plan.vec_size,)`` and a dict ``{D: (slots, D, D)}``, in the
        accumulation dtype, on the device of the tensors (``out``'s tensors when given).

    Raises:
        ValueError: a view outside its tensor, a tensor index past the list, an unreserved Gram slot or
            vec entry.
    """
    return _run(plan, list(tensors), None, fp64, out=out)


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
    s = _structure(plan, olds, None, False, acc, device, use_lines=False)

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


def check_drift_inputs(plan: Plan, olds, news, used: Sequence[int] | None = None):
    """``ValueError`` naming the fix for mismatched old/new lists or shapes (``used``: ``used_tensors(plan)``
    if the caller has it)."""
    if len(olds) != len(news):
        raise ValueError(f"drift: got {len(olds)} old tensors but {len(news)} new ones; pass one old per new")
    for i in used_tensors(plan) if used is None else used:
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


def _donatable(plan: Plan, olds, news, fp64: bool, used: Sequence[int]) -> bool:
    """Whether ``Delta`` can be formed in the storage of ``olds`` (``drift(..., donate=True)``): every
    read old tensor (``used``: ``used_tensors(plan)``) is in the accumulation dtype and shares no memory
    with a new one, and no vec entry mixes a linear (Sum) term with a quadratic one."""
    dt = acc_dtype(fp64)
    for i in used:
        o, n = olds[i], news[i]
        if o.numel() == 0:
            continue
        if o.dtype != dt or o.untyped_storage().data_ptr() == n.untyped_storage().data_ptr():
            return False
    return _linear_entries(plan, _device(news)) is not False


def _linear_entries(plan: Plan, device):
    """Indices of the vec entries Sum terms write (int64; None without Sum terms; False when an
    entry is written by both a Sum and a Norm term).  Cached per plan like the grouped structure."""
    key = (id(plan), "linear", len(plan.sums), len(plan.norms), plan.vec_size, device)

    def build():
        if not plan.sums:
            return None
        lin = {t.index + c for t in plan.sums for c in range(t.view.cols)}
        quad = {int(i) for t in plan.norms for i in t.index + t.index_stride * np.arange(t.view.rows)}
        return False if lin & quad else torch.as_tensor(sorted(lin), dtype=torch.int64, device=device)  # index_fill_: int64

    return _CACHE.cached(key, build, owner=plan)


def _unshifted(plan: Plan):
    """``(plan with every NormTerm shift set to 0, the shifted terms)``; ``(plan, [])`` without shifts.
    Cached per plan (the derived plan keeps its identity, so its grouped structure is cached too)."""
    if not any(t.shift != 0.0 for t in plan.norms):
        return plan, []
    key = (id(plan), "unshifted", len(plan.norms))

    def build():
        return (Plan(list(plan.grams), [replace(t, shift=0.0) for t in plan.norms], list(plan.sums), plan.vec_size,
                     dict(plan.gram_slots)), [t for t in plan.norms if t.shift != 0.0])

    return _CACHE.cached(key, build, owner=plan)


def _shift_first_order(vec: torch.Tensor, shifted, dl) -> None:
    """``vec[index + r*stride] += sign * shift * sum_c Delta[r, c]`` for each shifted NormTerm: the part of
    ``B(a old + shift, Delta)`` that the unshifted bilinear form lacks (``(x+s)^2`` changes by
    ``2 (a old + s) Delta + Delta^2`` besides its decay)."""
    for t in shifted:
        rows = t.view.of(dl[t.view.tensor]).to(vec.dtype).sum(1)
        idx = t.index + t.index_stride * torch.arange(t.view.rows, device=vec.device)
        vec.index_add_(0, idx, rows, alpha=t.sign * t.shift)


def drift_compose(plan: Plan, olds, news, a: Sequence[float], fp64: bool, evaluate: Callable, bilinear: Callable,
                  decay: bool = True, donate: bool = False, values: bool = True, used: Sequence[int] | None = None):
    """The drift pieces from separate evaluations (``evaluate(plan, xs)`` / ``bilinear(plan, xs, ys)``
    return ``(vec, grams)``): ``h(news)`` (None if not ``values``), the closed-form decay
    (``decay_reference``, on the tensors' device; None if not ``decay``), ``B(a olds, Delta)``,
    ``h(Delta)`` (``drift_operands``).

    ``donate``: the caller gives up ``olds`` (copies made for this step): ``Delta = news - a olds`` is
    formed in their storage (no second weight-sized buffer) and ``B(a olds, Delta)`` is taken as
    ``B(news, Delta) - h(Delta)`` on the quadratic entries (exact: ``a olds = news - Delta`` with the
    same rounded ``Delta``; its rounding error is of the same order as the direct form's).  Ignored
    where it cannot apply (``_donatable``).  ``used``: ``used_tensors(plan)`` if the caller has it."""
    dec = decay_reference(plan, olds, a, fp64=fp64) if decay else None  # reads olds before they change
    h_new = evaluate(plan, news) if values else None
    plan, shifted = _unshifted(plan)  # Gemma gains (1 + w)^2: B and h(Delta) of the unshifted form + shift part
    used = used_tensors(plan) if used is None else used  # (the unshifted plan reads the same tensors)
    if donate and _donatable(plan, olds, news, fp64, used):
        dl = list(olds)
        used = [i for i in used if olds[i].numel()]
        if used:  # Delta = news - a olds, in place: two foreach calls for all tensors (fl32(a*o) as drift_operands)
            torch._foreach_mul_([olds[i] for i in used], [-a[i] for i in used])
            torch._foreach_add_([olds[i] for i in used], [news[i] for i in used])
        hd = evaluate(plan, dl)
        bv, bg = bilinear(plan, news, dl)
        bil = (bv.sub_(hd[0]), {d: g.sub_(hd[1][d]) for d, g in bg.items()})  # in place: bv, bg are ours
        lin = _linear_entries(plan, hd[0].device)
        if lin is not None:  # linear laws have no bilinear part
            bil[0].index_fill_(0, lin, 0.0)
    else:
        ao, dl = drift_operands(plan, olds, news, a, fp64)
        bil, hd = bilinear(plan, ao, dl), evaluate(plan, dl)
    if shifted:
        _shift_first_order(bil[0], shifted, dl)
    return h_new, dec, bil, hd


def drift_reference(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, fp64: bool = False,
                    *, decay: bool = True, donate: bool = False, values: bool = True):
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
        donate: ``olds`` are copies the caller gives up: ``Delta`` is formed in their storage (they hold
            ``Delta`` afterwards; see ``drift_compose``).  Applies when the read olds are in the
            accumulation dtype; otherwise ignored (nothing is written).
        values: compute ``h_new``; False returns None in its place (a caller that evaluates ``h(news)``
            over a larger plan anyway).

    Returns:
        four ``(vec, {D: grams})`` pairs (decay None when ``decay=False``, h_new None when ``values=False``), layout of
        ``evaluate_reference``: ``h_new = h(news)``, ``decay = h(a olds) - h(olds)`` in closed form per
        term (``decay_reference``), ``bil = B(a olds, Delta)``, ``h_delta = h(Delta)`` (Sum terms:
        linear, so ``bil`` has none and ``h_delta`` is ``c^T Delta``).  The identity's terms are
        ``decay``, ``first = 2 bil (+ h_delta on linear entries)`` and ``second = h_delta`` (quadratic
        entries).

    Raises:
        ValueError: mismatched lists or shapes, wrong number of factors.

    A shifted NormTerm (Gemma's ``(1 + w)^2``) is drifted as ``(a x + s + Delta)^2 - (x + s)^2``: its
    ``bil`` is ``sum (a x + s) Delta`` and its ``h_delta`` is ``sum Delta^2`` (no shift).
    """
    olds, news = list(olds), list(news)
    used = used_tensors(plan)  # once per pass (the checks and the donated Delta read it)
    check_drift_inputs(plan, olds, news, used)
    a = drift_factors(a, len(news))
    return drift_compose(plan, olds, news, a, fp64, lambda p, xs: evaluate_reference(p, xs, fp64=fp64),
                         lambda p, xs, ys: bilinear_reference(p, xs, ys, fp64=fp64), decay=decay, donate=donate,
                         values=values, used=used)
