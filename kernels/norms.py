"""Triton kernels for the vector terms (``NormTerm``, ``SumTerm`` of ``plan.py``).

Every term is canonicalised (``launch.py``) to a *region*: an ``S x F`` memory block whose F axis is
the contiguous one (stride 1; layout 0) or, failing that, strided (layout 2).  A NormTerm reducing
along the contiguous axis needs the region's *fast sums* ``sum_f v[s, f]``; one reducing along the
strided axis (gain law: columns of q/k/v/gate/up; unit law: columns of down) needs its *slow sums*
``sum_s v[s, f]``.  Terms over the same region with the same function share it, so ``W_up`` is read
ONCE for both the SwiGLU unit law (its rows) and the gain law (its columns).

``_rowcol_kernel``: one program per item = (region, slow range [s_start, s_end)).  Outer loop over F
tiles, inner over S tiles; ``v = (x + shift)^2`` (func 0), ``x`` (func 1, SumTerm) or ``x*y``
(bilinear).  Fast sums (items of one S tile) go straight to the element buffer ``elem``; slow sums
of the item's range go to one row of ``slowpart`` that ``_slow_finish`` sums over the region's items.
``_gather`` then forms ``vec[o] = sum_p sign_p * elem[idx_p]`` (CSR, fixed order).  No atomics.

Region table row (int64): ``x_off, ss, fs, S, F, layout, func, fast_base, slow_row, y_off, yss, yfs``;
``fast_base``/``slow_row`` are -1 when unused; item row: ``region, s_start, s_end, slow_off``.
"""
from __future__ import annotations

import triton
import triton.language as tl

REGION_COLS = 12
ITEM_COLS = 4


@triton.jit
def _tile(base, off, i, j, si, sj, mask):
    ptrs = base + off + i[:, None].to(tl.int64) * si + j[None, :].to(tl.int64) * sj
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _rowcol_kernel(xb, yb, regions, shifts, items, elem, slowpart,
                   BS: tl.constexpr, BF: tl.constexpr, ALIGN: tl.constexpr,
                   BILINEAR: tl.constexpr, FP64: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    it = items + pid * 4
    r = tl.load(it)
    s_start = tl.load(it + 1)
    s_end = tl.load(it + 2)
    slow_off = tl.load(it + 3)
    reg = regions + r * 12
    xo = tl.multiple_of(tl.load(reg), ALIGN)
    ss = tl.load(reg + 1)
    fs = tl.load(reg + 2)
    F = tl.load(reg + 4)
    lay = tl.load(reg + 5)
    func = tl.load(reg + 6)
    fast_base = tl.load(reg + 7)
    yo = tl.multiple_of(tl.load(reg + 9), ALIGN)
    yss = tl.load(reg + 10)
    yfs = tl.load(reg + 11)
    shift = tl.load(shifts + r)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    want_fast = fast_base >= 0
    want_slow = slow_off >= 0
    sr = tl.arange(0, BS)
    fr = tl.arange(0, BF)
    facc = tl.zeros([BS], dtype=ACC)  # complete only when the item is one S tile (launch.py ensures)
    for f0 in range(0, F, BF):
        f = f0 + fr
        mf = f < F
        sacc = tl.zeros([BF], dtype=ACC)
        for s0 in range(s_start, s_end, BS):
            s = s0 + sr
            m = (s < s_end)[:, None] & mf[None, :]
            if lay == 0:
                x = _tile(xb, xo, s, f, tl.multiple_of(ss, ALIGN), 1, m).to(tl.float32).to(ACC)
                if BILINEAR:
                    y = _tile(yb, yo, s, f, tl.multiple_of(yss, ALIGN), 1, m).to(tl.float32).to(ACC)
            else:
                x = _tile(xb, xo, s, f, ss, fs, m).to(tl.float32).to(ACC)
                if BILINEAR:
                    y = _tile(yb, yo, s, f, yss, yfs, m).to(tl.float32).to(ACC)
            if BILINEAR:
                v = x * y
            else:
                xs = x + shift
                v = tl.where(func == 0, xs * xs, x)
                v = tl.where(m, v, 0.0)
            if want_slow:
                sacc += tl.sum(v, axis=0)
            if want_fast:
                facc += tl.sum(v, axis=1)
        if want_slow:
            tl.store(slowpart + slow_off + f, sacc, mask=mf)
    if want_fast:
        s = s_start + sr
        tl.store(elem + fast_base + s, facc, mask=s < s_end)


@triton.jit
def _slow_finish(slowpart, table, elem, BF: tl.constexpr, FP64: tl.constexpr):
    """Region ``pid0``: ``elem[base + f] = sum_i slowpart[off + i*F + f]`` over its ``nrows`` items."""
    pid = tl.program_id(0).to(tl.int64)
    row = table + pid * 4
    off = tl.load(row)
    nrows = tl.load(row + 1)
    F = tl.load(row + 2)
    base = tl.load(row + 3)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    mf = f < F
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    acc = tl.zeros([BF], dtype=ACC)
    for i in range(0, nrows):
        acc += tl.load(slowpart + off + i * F + f, mask=mf, other=0.0)
    tl.store(elem + base + f, acc, mask=mf)


@triton.jit
def _gather(elem, ptr, idx, sgn, vec, n_out, max_count, BO: tl.constexpr, FP64: tl.constexpr):
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
