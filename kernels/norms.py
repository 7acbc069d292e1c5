"""Triton kernels for the vector terms (``NormTerm``, ``SumTerm`` of ``plan.py``).

Every term is canonicalised (``launch.py``) to a *region*: an ``S x F`` memory block whose F axis is
the contiguous one (stride 1; layout 0) or, failing that, strided (layout 2).  A NormTerm reducing
along the contiguous axis needs the region's *fast sums* ``sum_f v[s, f]``; one reducing along the
strided axis (gain law: columns of q/k/v/gate/up; unit law: columns of down) needs its *slow sums*
``sum_s v[s, f]``.  Terms over the same region with the same function share it, so ``W_up`` is read
ONCE for both the SwiGLU unit law (its rows) and the gain law (its columns).

``rowcol_kernel``: one program per item = (region, rows [s_start, s_end), ONE column tile
[f0, f0 + BF)).  Items are sized by bytes (``launch.Tiles.item_bytes``, ~256 KiB on a GPU) so that
every program streams the same amount of memory.  The inner loop over row tiles ``[BS, BF]`` is a
pure streaming loop: one (vectorised, 16-byte) load per thread and vector, ``v = (x + shift)^2``
(func 0), ``x`` (func 1, SumTerm) or ``x*y`` (bilinear; CHECK: four quantities of x and y, see
``rowcol_kernel``), and an elementwise add into a
``[BS, BF]`` register accumulator -- no reduction and no branch on the layout inside the loop.  The
column (slow) sums are reduced ONCE per item (at most 16 row tiles on both the GPU and the CPU tiles:
a short fp32 running sum) and written as one partial row; the row (fast) sums of a
tile are reduced per tile and written as a partial for this column tile (a region with fast sums and
``F`` columns has ``ceil(F / BF)`` fast partials per row).  ``finish_rows`` sums partial rows in a
fixed order into the element buffer ``elem``; ``gather_rows`` then forms
``vec[o] = sum_p sign_p * elem[idx_p]`` (CSR, fixed order).  No atomics: bitwise deterministic.

Region table row (int64, ``tables.REGION``): ``x_off, ss, fs, S, F, layout, func, fast_base, -, y_off, yss, yfs``;
item row (``tables.NORM_ITEM``): ``region, s_start, s_end, f0, fast_off, slow_off`` (partial-buffer offsets, -1 when unused:
row ``s``'s fast partial goes to ``part[fast_off + s]``, column ``f``'s slow partial to
``part[slow_off + f]``); finishing row: ``part_off, nrows, length, elem_base``
(``elem[elem_base + j] = sum_i part[part_off + i*length + j]``), processed in column blocks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tables
from .gram import widen

@triton.jit
def _tile(xb, yb, xo, yo, ss, yss, fo, yfo, s0, sr, s_end, mf, is_sq, shift, fast_off, part,
          ACC: tl.constexpr, MASK_F: tl.constexpr, BILINEAR: tl.constexpr):
    """``v`` of the row tile starting at ``s0`` (its row sums stored as fast partials if wanted)."""
    s = s0 + sr
    ms = s < s_end
    if MASK_F:
        m = ms[:, None] & mf[None, :]
    else:
        m = ms[:, None]  # broadcast by tl.load: constant along the contiguous axis
    x = widen(tl.load(xb + xo + s[:, None].to(tl.int64) * ss + fo, mask=m, other=0.0), ACC)
    if BILINEAR:
        y = tl.load(yb + yo + s[:, None].to(tl.int64) * yss + yfo, mask=m, other=0.0)
        v = x * widen(y, ACC)
    else:
        xs = x + shift
        v = tl.where(is_sq, xs * xs, x)
        v = tl.where(m, v, 0.0)  # masked entries would give shift^2
    if fast_off >= 0:
        tl.store(part + fast_off + s, tl.sum(v, axis=1), mask=ms)
    return v


@triton.jit
def _col_offsets(f, fs, yfs, CONTIG: tl.constexpr):
    """``[1, BF]`` element offsets of the columns ``f`` in x and y (CONTIG: the column stride is the literal 1)."""
    if CONTIG:
        return f[None, :], f[None, :]
    else:
        return f[None, :].to(tl.int64) * fs, f[None, :].to(tl.int64) * yfs


@triton.jit
def _sweep(xb, yb, xo, yo, ss, fs, yss, yfs, s_start, s_end, f, mf, is_sq, shift, fast_off, part,
           BS: tl.constexpr, BF: tl.constexpr, ACC: tl.constexpr, CONTIG: tl.constexpr,
           MASK_F: tl.constexpr, BILINEAR: tl.constexpr, STAGES: tl.constexpr):
    """Stream rows [s_start, s_end) of one column tile ``f``; returns the ``[BF]`` column sums of
    ``v`` (the slow sums).  CONTIG: the column stride is the literal 1 (the
    compiler then vectorises along it); MASK_F: the tile crosses the region's last column (otherwise
    only the row mask, constant along the contiguous axis, is applied, so loads stay vectorised)."""
    sr = tl.arange(0, BS)
    fo, yfo = _col_offsets(f, fs, yfs, CONTIG)
    acc = tl.zeros([BS, BF], dtype=ACC)
    for s0 in tl.range(s_start, s_end, BS, num_stages=STAGES):
        acc += _tile(xb, yb, xo, yo, ss, yss, fo, yfo, s0, sr, s_end, mf, is_sq, shift, fast_off, part,
                     ACC, MASK_F, BILINEAR)
    return tl.sum(acc, axis=0)


@triton.jit
def _check_tile(xb, yb, xo, yo, ss, yss, fo, yfo, s0, sr, s_end, mf, shift, fast_off, part, pplane,
                ACC: tl.constexpr, MASK_F: tl.constexpr):
    """CHECK twin of ``_tile`` (x weights, y gradients): the four quantities ``(x + shift) y``, ``(x + shift)^2``,
    ``y^2`` and ``y`` of the row tile from one load of each (their row sums stored as fast partials in four
    planes ``pplane`` apart if wanted)."""
    s = s0 + sr
    ms = s < s_end
    if MASK_F:
        m = ms[:, None] & mf[None, :]
    else:
        m = ms[:, None]
    x = widen(tl.load(xb + xo + s[:, None].to(tl.int64) * ss + fo, mask=m, other=0.0), ACC)
    y = widen(tl.load(yb + yo + s[:, None].to(tl.int64) * yss + yfo, mask=m, other=0.0), ACC)
    xs = tl.where(m, x + shift, 0.0)
    v0 = xs * y
    v1 = xs * xs
    v2 = y * y
    if fast_off >= 0:
        p = part + fast_off + s
        tl.store(p, tl.sum(v0, axis=1), mask=ms)
        tl.store(p + pplane, tl.sum(v1, axis=1), mask=ms)
        tl.store(p + 2 * pplane, tl.sum(v2, axis=1), mask=ms)
        tl.store(p + 3 * pplane, tl.sum(y, axis=1), mask=ms)
    return v0, v1, v2, y


@triton.jit
def _check_sweep(xb, yb, xo, yo, ss, fs, yss, yfs, s_start, s_end, f, mf, shift, fast_off, part, pplane,
                 BS: tl.constexpr, BF: tl.constexpr, ACC: tl.constexpr, CONTIG: tl.constexpr,
                 MASK_F: tl.constexpr, STAGES: tl.constexpr):
    """CHECK twin of ``_sweep``: the ``[BF]`` column sums of the four quantities of ``_check_tile``."""
    sr = tl.arange(0, BS)
    fo, yfo = _col_offsets(f, fs, yfs, CONTIG)
    a0 = tl.zeros([BS, BF], dtype=ACC)
    a1 = tl.zeros([BS, BF], dtype=ACC)
    a2 = tl.zeros([BS, BF], dtype=ACC)
    a3 = tl.zeros([BS, BF], dtype=ACC)
    for s0 in tl.range(s_start, s_end, BS, num_stages=STAGES):
        v0, v1, v2, v3 = _check_tile(xb, yb, xo, yo, ss, yss, fo, yfo, s0, sr, s_end, mf, shift, fast_off, part,
                                     pplane, ACC, MASK_F)
        a0 += v0
        a1 += v1
        a2 += v2
        a3 += v3
    return tl.sum(a0, axis=0), tl.sum(a1, axis=0), tl.sum(a2, axis=0), tl.sum(a3, axis=0)


@triton.jit
def rowcol_kernel(xb, yb, regions, shifts, items, part, pplane,
                   BS: tl.constexpr, BF: tl.constexpr, ALIGN: tl.constexpr,
                   BILINEAR: tl.constexpr, FP64: tl.constexpr, STAGES: tl.constexpr = 1,
                   CHECK: tl.constexpr = False):
    """One item (module docstring).  CHECK (the gradient check's one pass; x weights, y gradients, every
    region's function ignored): the fast and slow sums of ``(x + shift) y``, ``(x + shift)^2``, ``y^2`` and
    ``y`` from one read of both, written to four planes of ``part`` ``pplane`` elements apart."""
    pid = tl.program_id(0).to(tl.int64)
    it = items + pid * tables.NORM_ITEM.COLS
    r = tl.load(it + tables.NORM_ITEM.REGION)
    s_start = tl.load(it + tables.NORM_ITEM.S_START)
    s_end = tl.load(it + tables.NORM_ITEM.S_END)
    f0 = tl.multiple_of(tl.load(it + tables.NORM_ITEM.F0), BF)  # launch.py: f0 is a multiple of BF
    fast_off = tl.load(it + tables.NORM_ITEM.FAST_OFF)
    slow_off = tl.load(it + tables.NORM_ITEM.SLOW_OFF)
    reg = regions + r * tables.REGION.COLS
    xo = tl.multiple_of(tl.load(reg + tables.REGION.X_OFF), ALIGN)
    ss = tl.load(reg + tables.REGION.SS)
    fs = tl.load(reg + tables.REGION.FS)
    F = tl.load(reg + tables.REGION.F)
    lay = tl.load(reg + tables.REGION.LAYOUT)
    func = tl.load(reg + tables.REGION.FUNC)
    yo = tl.multiple_of(tl.load(reg + tables.REGION.Y_OFF), ALIGN)
    yss = tl.load(reg + tables.REGION.YSS)
    yfs = tl.load(reg + tables.REGION.YFS)
    shift = tl.load(shifts + r)
    is_sq = func == 0
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    f = f0 + tl.arange(0, BF)
    mf = f < F
    if CHECK:
        pp = pplane.to(tl.int64)  # (runner: a multiple of 16, never specialised to a constant)
        if lay == 0:
            ssa = tl.multiple_of(ss, ALIGN)
            yssa = tl.multiple_of(yss, ALIGN)
            if f0 + BF <= F:
                c0, c1, c2, c3 = _check_sweep(xb, yb, xo, yo, ssa, 1, yssa, 1, s_start, s_end, f, mf, shift, fast_off,
                                              part, pp, BS, BF, ACC, True, False, STAGES)
            else:
                c0, c1, c2, c3 = _check_sweep(xb, yb, xo, yo, ssa, 1, yssa, 1, s_start, s_end, f, mf, shift, fast_off,
                                              part, pp, BS, BF, ACC, True, True, STAGES)
        else:
            c0, c1, c2, c3 = _check_sweep(xb, yb, xo, yo, ss, fs, yss, yfs, s_start, s_end, f, mf, shift, fast_off,
                                          part, pp, BS, BF, ACC, False, True, STAGES)
        if slow_off >= 0:
            q = part + slow_off + f
            tl.store(q, c0, mask=mf)
            tl.store(q + pp, c1, mask=mf)
            tl.store(q + 2 * pp, c2, mask=mf)
            tl.store(q + 3 * pp, c3, mask=mf)
    else:
        if lay == 0:
            ssa = tl.multiple_of(ss, ALIGN)
            yssa = tl.multiple_of(yss, ALIGN)
            if f0 + BF <= F:
                acc = _sweep(xb, yb, xo, yo, ssa, 1, yssa, 1, s_start, s_end, f, mf, is_sq, shift, fast_off, part,
                             BS, BF, ACC, True, False, BILINEAR, STAGES)
            else:
                acc = _sweep(xb, yb, xo, yo, ssa, 1, yssa, 1, s_start, s_end, f, mf, is_sq, shift, fast_off, part,
                             BS, BF, ACC, True, True, BILINEAR, STAGES)
        else:
            acc = _sweep(xb, yb, xo, yo, ss, fs, yss, yfs, s_start, s_end, f, mf, is_sq, shift, fast_off, part,
                         BS, BF, ACC, False, True, BILINEAR, STAGES)
        if slow_off >= 0:
            tl.store(part + slow_off + f, acc, mask=mf)


@triton.jit
def finish_rows(part, table, blocks, elem, RB: tl.constexpr, BC: tl.constexpr, FP64: tl.constexpr):
    """Block ``pid`` = (finishing row, first column): ``elem[base + c] = sum_i part[off + i*len + c]``
    for ``BC`` columns, summing ``RB`` partial rows per step into a 2-D accumulator (fixed order)."""
    pid = tl.program_id(0).to(tl.int64)
    blk = blocks + pid * tables.FINISH_BLOCK.COLS
    row = table + tl.load(blk + tables.FINISH_BLOCK.ROW) * tables.FINISH_ROW.COLS
    c0 = tl.load(blk + tables.FINISH_BLOCK.C0)
    off = tl.load(row + tables.FINISH_ROW.PART_OFF)
    nrows = tl.load(row + tables.FINISH_ROW.NROWS)
    length = tl.load(row + tables.FINISH_ROW.LENGTH)
    base = tl.load(row + tables.FINISH_ROW.ELEM_BASE)
    c = c0 + tl.arange(0, BC)
    mc = c < length
    rr = tl.arange(0, RB)
    # summed in float64 whatever FP64 (an fp32 running sum over thousands of near-equal partials of a long
    # row or column loses digits), rounded once to elem's dtype
    acc = tl.zeros([RB, BC], dtype=tl.float64)
    for i0 in range(0, nrows, RB):
        i = i0 + rr
        m = (i < nrows)[:, None] & mc[None, :]
        acc += tl.load(part + off + i[:, None].to(tl.int64) * length + c[None, :], mask=m, other=0.0).to(tl.float64)
    tl.store(elem + base + c, tl.sum(acc, axis=0).to(elem.dtype.element_ty), mask=mc)


@triton.jit
def gather_rows(elem, ptr, idx, sgn, vec, n_out, max_count, BO: tl.constexpr, FP64: tl.constexpr):
    """``vec[o] = sum_{p in [ptr[o], ptr[o+1])} sgn[p] * elem[idx[p]]`` for a block of BO outputs."""
    o = tl.program_id(0).to(tl.int64) * BO + tl.arange(0, BO)
    mo = o < n_out
    p0 = tl.load(ptr + o, mask=mo, other=0)
    p1 = tl.load(ptr + o + 1, mask=mo, other=0)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    acc = tl.zeros([BO], dtype=ACC)
    for j in range(0, max_count):
        p = p0 + j
        m = p < p1
        i = tl.load(idx + p, mask=m, other=0)
        acc += tl.load(sgn + p, mask=m, other=0.0) * tl.load(elem + i, mask=m, other=0.0)
    tl.store(vec + o, acc, mask=mo)
