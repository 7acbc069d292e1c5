"""Triton kernels for the grouped head-Gram terms (``GramTerm`` of ``plan.py``).

``_gram_kernel``: one program per *item* = (output slot, output tile (ti, tj) with ti <= tj, chunk
[k0, k1) of the contracted dimension).  It loops over every term of its slot (a contiguous range of
the term table, so QK and VO terms of one kv group, their biases, partial-rotary pass-through blocks
and every layer/expert share ONE launch) and accumulates, in registers,

    acc = sum_t sign_t * X_t[rows_i, k0:k1] X_t[rows_j, k0:k1]^T                  (evaluate)
    acc = sum_t sign_t * (X_t Y_t^T + Y_t X_t^T)[rows_i, rows_j] / 2              (bilinear)

with ``X_t`` read through its logical strides (seed paper's head Gram law; spec "The catalogue").
The item writes its BT x BT tile to a partial buffer; ``_gram_finish`` sums, per output tile, the
partials of its items in a fixed order and mirrors off-diagonal tiles (no atomics: deterministic).

Term table row (int64): ``x_off, x_rs, x_cs, n, layout, y_off, y_rs, y_cs`` in elements relative to
the launch's base pointers; layout 0: ``x_cs == 1`` (row blocks of nn.Linear weights: tiles
[BT, BK] loaded along the contiguous k), 1: ``x_rs == 1`` (column blocks, e.g. ``W_o[:, r_i]`` or
GPT-2 Conv1D: tiles [BK, BT] loaded along the contiguous head dim), 2: general strides.
"""
from __future__ import annotations

import triton
import triton.language as tl

TERM_COLS = 8
ITEM_COLS = 6
GROUP_COLS = 5


@triton.jit
def _tile(base, off, i, j, si, sj, mask):
    """``tile[a, b] = base[off + i[a]*si + j[b]*sj]`` (zero where ``mask`` is false); int64 offsets."""
    ptrs = base + off + i[:, None].to(tl.int64) * si + j[None, :].to(tl.int64) * sj
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _pair_dot(a, b, c, d, acc, sign, BILINEAR: tl.constexpr, UPCAST: tl.constexpr, APPLY_SIGN: tl.constexpr):
    """``acc + s a b^T`` (evaluate) or ``acc + s (a b^T + c d^T)`` (bilinear); ``s = sign`` if
    APPLY_SIGN (folded into the left operands: exact for |sign| == 1, one fp32 rounding for fp32
    inputs -- launch.py decides) else 1.

    bf16/fp16 tiles go to the tensor cores as they are (fp32 accumulate: products of half inputs are
    exact in fp32).  UPCAST (set only under TRITON_INTERPRET=1 for bf16, whose interpreter dot
    multiplies the raw bits, and for mixed x/y dtypes): fp32.  fp64 never comes here (``_fp64_term``)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        c = c.to(tl.float32)
        d = d.to(tl.float32)
    if APPLY_SIGN:
        a = (a * sign).to(a.dtype)
        c = (c * sign).to(c.dtype)
    acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if BILINEAR:
        acc = tl.dot(c, tl.trans(d), acc, input_precision="ieee")
    return acc


@triton.jit
def _term(xb, yb, xo, rs, cs, yo, yrs, ycs, lay, ri, rj, mi, mj, k0, kend, sign, acc,
          BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr, BILINEAR: tl.constexpr,
          UPCAST: tl.constexpr, APPLY_SIGN: tl.constexpr):
    """One term's contribution over the contracted range [k0, kend), through ``tl.dot``."""
    kr = tl.arange(0, BK)
    if lay == 0:
        # rows of the view are strided, columns contiguous: tiles [BT, BK]
        rs_a = tl.multiple_of(rs, ALIGN)
        yrs_a = tl.multiple_of(yrs, ALIGN)
        for k in range(k0, kend, BK):
            kk = k + kr
            mk = kk < kend
            a = _tile(xb, xo, ri, kk, rs_a, 1, mi[:, None] & mk[None, :])
            if BILINEAR:
                c = _tile(yb, yo, ri, kk, yrs_a, 1, mi[:, None] & mk[None, :])
                if SINGLE:
                    b = a
                    d = c
                else:
                    b = _tile(xb, xo, rj, kk, rs_a, 1, mj[:, None] & mk[None, :])
                    d = _tile(yb, yo, rj, kk, yrs_a, 1, mj[:, None] & mk[None, :])
                acc = _pair_dot(a, d, c, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN)
            else:
                if SINGLE:
                    b = a
                else:
                    b = _tile(xb, xo, rj, kk, rs_a, 1, mj[:, None] & mk[None, :])
                acc = _pair_dot(a, b, a, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN)
    elif lay == 1:
        # the head dim is contiguous (column blocks, Conv1D): tiles [BK, BT], contracted over axis 0
        cs_a = tl.multiple_of(cs, ALIGN)
        ycs_a = tl.multiple_of(ycs, ALIGN)
        for k in range(k0, kend, BK):
            kk = k + kr
            mk = kk < kend
            at = _tile(xb, xo, kk, ri, cs_a, 1, mk[:, None] & mi[None, :])
            if BILINEAR:
                ct = _tile(yb, yo, kk, ri, ycs_a, 1, mk[:, None] & mi[None, :])
                if SINGLE:
                    bt = at
                    dt = ct
                else:
                    bt = _tile(xb, xo, kk, rj, cs_a, 1, mk[:, None] & mj[None, :])
                    dt = _tile(yb, yo, kk, rj, ycs_a, 1, mk[:, None] & mj[None, :])
                acc = _pair_dot(tl.trans(at), tl.trans(dt), tl.trans(ct), tl.trans(bt), acc, sign,
                                BILINEAR, UPCAST, APPLY_SIGN)
            else:
                if SINGLE:
                    bt = at
                else:
                    bt = _tile(xb, xo, kk, rj, cs_a, 1, mk[:, None] & mj[None, :])
                acc = _pair_dot(tl.trans(at), tl.trans(bt), tl.trans(at), tl.trans(bt), acc, sign,
                                BILINEAR, UPCAST, APPLY_SIGN)
    else:
        # general strides (neither dimension contiguous)
        for k in range(k0, kend, BK):
            kk = k + kr
            mk = kk < kend
            a = _tile(xb, xo, ri, kk, rs, cs, mi[:, None] & mk[None, :])
            b = _tile(xb, xo, rj, kk, rs, cs, mj[:, None] & mk[None, :])
            if BILINEAR:
                c = _tile(yb, yo, ri, kk, yrs, ycs, mi[:, None] & mk[None, :])
                d = _tile(yb, yo, rj, kk, yrs, ycs, mj[:, None] & mk[None, :])
                acc = _pair_dot(a, d, c, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN)
            else:
                acc = _pair_dot(a, b, a, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN)
    return acc


@triton.jit
def _fp64_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc, BILINEAR: tl.constexpr):
    """fp64 accumulation without ``tl.dot`` (triton 3.6 rejects an fp64 accumulator there): one rank-1
    update ``acc += sign * a_k b_k^T`` per contracted index, from two column loads (any strides).
    Inputs are upcast through fp32, exactly (the interpreter casts bf16 -> fp64 wrongly).  A
    correctness mode: O(BT^2) fp64 FMAs per loaded column, no tensor cores."""
    ri64 = ri.to(tl.int64)
    rj64 = rj.to(tl.int64)
    for k in range(k0, kend):
        a = tl.load(xb + xo + ri64 * rs + k * cs, mask=mi, other=0.0).to(tl.float32).to(tl.float64) * sign
        b = tl.load(xb + xo + rj64 * rs + k * cs, mask=mj, other=0.0).to(tl.float32).to(tl.float64)
        if BILINEAR:
            c = tl.load(yb + yo + ri64 * yrs + k * ycs, mask=mi, other=0.0).to(tl.float32).to(tl.float64) * sign
            d = tl.load(yb + yo + rj64 * yrs + k * ycs, mask=mj, other=0.0).to(tl.float32).to(tl.float64)
            acc += a[:, None] * d[None, :] + c[:, None] * b[None, :]
        else:
            acc += a[:, None] * b[None, :]
    return acc


@triton.jit
def _gram_kernel(xb, yb, terms, signs, items, part,
                 D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ALIGN: tl.constexpr,
                 SINGLE: tl.constexpr, BILINEAR: tl.constexpr, FP64: tl.constexpr,
                 UPCAST: tl.constexpr, FOLD: tl.constexpr):
    """FOLD (launch.py: every sign is +-1, or fp32 inputs): the sign is applied to the left operands
    and every term accumulates into ONE register tile; otherwise each term gets its own tile that is
    scaled and added (twice the accumulator registers)."""
    pid = tl.program_id(0).to(tl.int64)
    it = items + pid * 6
    t0 = tl.load(it)
    t1 = tl.load(it + 1)
    k0 = tl.load(it + 2)
    k1 = tl.load(it + 3)
    ti = tl.load(it + 4)
    tj = tl.load(it + 5)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    ri = ti * BT + tl.arange(0, BT)
    rj = tj * BT + tl.arange(0, BT)
    mi = ri < D
    mj = rj < D
    acc = tl.zeros([BT, BT], dtype=ACC)
    for t in range(t0, t1):
        row = terms + t * 8
        xo = tl.multiple_of(tl.load(row), ALIGN)
        rs = tl.load(row + 1)
        cs = tl.load(row + 2)
        n = tl.load(row + 3)
        lay = tl.load(row + 4)
        yo = tl.multiple_of(tl.load(row + 5), ALIGN)
        yrs = tl.load(row + 6)
        ycs = tl.load(row + 7)
        sign = tl.load(signs + t)
        kend = tl.minimum(k1, n)
        if FP64:
            acc = _fp64_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc, BILINEAR)
        elif FOLD:
            acc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, lay, ri, rj, mi, mj, k0, kend, sign, acc,
                        BK, ALIGN, SINGLE, BILINEAR, UPCAST, True)
        else:
            tacc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, lay, ri, rj, mi, mj, k0, kend, sign,
                         tl.zeros([BT, BT], dtype=ACC), BK, ALIGN, SINGLE, BILINEAR, UPCAST, False)
            acc += sign * tacc
    if BILINEAR:
        acc = acc * 0.5
    o = tl.arange(0, BT)
    tl.store(part + pid * (BT * BT) + o[:, None] * BT + o[None, :], acc)


@triton.jit
def _gram_finish(part, order, groups, out, D: tl.constexpr, BT: tl.constexpr, FP64: tl.constexpr):
    """Per output tile: sum its items' partial tiles in table order; write the tile and its mirror."""
    pid = tl.program_id(0).to(tl.int64)
    g = groups + pid * 5
    i0 = tl.load(g)
    i1 = tl.load(g + 1)
    slot = tl.load(g + 2)
    ti = tl.load(g + 3)
    tj = tl.load(g + 4)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    o = tl.arange(0, BT)
    acc = tl.zeros([BT, BT], dtype=ACC)
    for i in range(i0, i1):
        item = tl.load(order + i)
        acc += tl.load(part + item * (BT * BT) + o[:, None] * BT + o[None, :])
    ri = ti * BT + o
    rj = tj * BT + o
    m = (ri < D)[:, None] & (rj < D)[None, :]
    base = out + slot * (D * D)
    tl.store(base + ri[:, None] * D + rj[None, :], acc, mask=m)
    if ti != tj:
        tl.store(base + rj[None, :] * D + ri[:, None], acc, mask=m)
