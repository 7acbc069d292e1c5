"""Triton kernels for the grouped head-Gram terms (``GramTerm`` of ``plan.py``).

``gram_kernel``: one program per *item* = (output slot, output tile (ti, tj) with ti <= tj, chunk
[k0, k1) of the contracted dimension).  It loops over every term of its slot (a contiguous range of
the term table, so QK and VO terms of one kv group, their biases, partial-rotary pass-through blocks
and every layer/expert share ONE launch) and accumulates, in registers,

    acc = sum_t sign_t * X_t[rows_i, k0:k1] X_t[rows_j, k0:k1]^T                  (evaluate)
    acc = sum_t sign_t * (X_t Y_t^T + Y_t X_t^T)[rows_i, rows_j] / 2              (bilinear)

with ``X_t`` read through its logical strides (seed paper's head Gram law; spec "The catalogue").

DRIFT mode (spec "Discrete steps: the exact drift identity"): ``X_t`` = old weights ``O``, ``Y_t`` =
new weights ``N`` of one optimizer step, ``a_t`` its decay factor.  Each tile of ``O`` and ``N`` is
read once and four register tiles are accumulated (``Dl = N - a_t*O`` formed in fp32 registers,
``a_t*O`` rounded to fp32 first, exactly as ``reference.drift_reference`` rounds it)::

    h_new   = sum_t s_t N N^T                               decay = sum_t s_t (a_t^2 - 1) O O^T
    bil     = sum_t s_t (aO Dl^T + Dl aO^T) / 2             h_delta = sum_t s_t Dl Dl^T

and the item writes them to four planes of the partial buffer (``plane`` elements apart).
The item writes its BT x BT tile to a partial buffer; ``gram_finish`` sums, per output tile, the
partials of its items in a fixed order and mirrors off-diagonal tiles (no atomics: deterministic).

Term table row (int64, ``tables.GRAM_TERM``): ``x_off, x_rs, x_cs, n, layout, y_off, y_rs, y_cs`` in elements relative to
the launch's base pointers; layout 0: ``x_cs == 1`` (row blocks of nn.Linear weights: tiles
[BT, BK] loaded along the contiguous k), 1: ``x_rs == 1`` (column blocks, e.g. ``W_o[:, r_i]`` or
GPT-2 Conv1D: tiles [BK, BT] loaded along the contiguous head dim), 2: general strides.  Item row:
``t0, t1, k0, k1, ti, tj, ta, tb``: a slot's terms are sorted by layout, ``[t0, ta)`` layout 0,
``[ta, tb)`` 1, ``[tb, t1)`` 2, and each range runs its own term loop with the layout as a constexpr
(``_slot_terms``); inside a term, full ``BK`` blocks load without a mask along k and the last partial
block is masked.  Both choices exist for the loads: a runtime layout branch or a k mask of unknown
divisibility makes the compiler fall back to 4-byte copies, while a constexpr layout and mask-free
full blocks let it issue 16-byte ``cp.async`` vectors for layouts 0 and 1 (``python -m bench.sass
--kernels gram`` shows the instructions; ``bench/NOTES.md``, "Gram kernel loads").
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tables



@triton.jit
def widen(x, ACC: tl.constexpr):
    """``x`` in the accumulation dtype ``ACC``: fp64 inputs of an fp64 accumulation as they are; any
    other input through fp32 (exact for fp32/bf16/fp16; the interpreter's direct bf16 -> fp64 cast is
    wrong)."""
    if (x.dtype == tl.float64) and (ACC == tl.float64):
        return x
    else:
        return x.to(tl.float32).to(ACC)


@triton.jit
def _tile(base, off, i, j, si, sj, mask):
    """``tile[a, b] = base[off + i[a]*si + j[b]*sj]`` (zero where ``mask`` is false); int64 offsets."""
    ptrs = base + off + i[:, None].to(tl.int64) * si + j[None, :].to(tl.int64) * sj
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _km(mr, mk, MASK_K: tl.constexpr, KFIRST: tl.constexpr):
    """Load mask of a tile: output-row mask ``mr`` and, on the masked tail only (MASK_K), the
    contracted-index mask ``mk``; ``KFIRST``: tiles ``[BK, BT]``.  Without MASK_K the mask is constant
    along the contiguous axis, so loads vectorise (``tl.load`` broadcasts it)."""
    if KFIRST:
        if MASK_K:
            return mk[:, None] & mr[None, :]
        else:
            return mr[None, :]
    else:
        if MASK_K:
            return mr[:, None] & mk[None, :]
        else:
            return mr[:, None]


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """``acc + a b^T``: fp32 operands at ``PREC`` (``"ieee"`` FMA or ``"tf32x3"`` tensor cores,
    ``config.Config.input_precision``); bf16/fp16 operands go to the tensor cores as they are."""
    if a.dtype == tl.float32:
        return tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    else:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")


@triton.jit
def _pair_dot(a, b, c, d, acc, sign, BILINEAR: tl.constexpr, UPCAST: tl.constexpr, APPLY_SIGN: tl.constexpr,
              PREC: tl.constexpr):
    """``acc + s a b^T`` (evaluate) or ``acc + s (a b^T + c d^T)`` (bilinear); ``s = sign`` if
    APPLY_SIGN (folded into the left operands: one fp32 rounding of ``sign*x``; ``_slot_terms`` sets it
    for fp32 inputs only) else 1.

    bf16/fp16 tiles go to the tensor cores as they are (fp32 accumulate: products of half inputs are
    exact in fp32).  UPCAST (set only under TRITON_INTERPRET=1 for bf16, whose interpreter dot
    multiplies the raw bits, for mixed x/y dtypes and for fp64 inputs, which ``tl.dot`` does not compile
    into an fp32 accumulator): fp32.  An fp64 accumulation never comes here (``_fp64_term``)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        c = c.to(tl.float32)
        d = d.to(tl.float32)
    if APPLY_SIGN:
        a = (a * sign).to(a.dtype)
        c = (c * sign).to(c.dtype)
    acc = _dot(a, b, acc, PREC)
    if BILINEAR:
        acc = _dot(c, d, acc, PREC)
    return acc


@triton.jit
def _rows(base, off, r, kk, rs, cs, slow, mr, mk, MASK_K: tl.constexpr, LAY: tl.constexpr):
    """Logical ``[BT, BK]`` tile ``X[r, kk]`` of a term (zero outside ``mr``/``mk``): LAY 0, rows strided
    by ``slow`` and k contiguous; LAY 1, rows contiguous and k strided by ``slow`` (loaded as ``[BK, BT]``
    along the head dim, then transposed); LAY 2, general strides ``rs``, ``cs``.  The contiguous stride
    is the literal 1, so 0/1 tiles load as 16-byte vectors (``slow`` must carry its hint)."""
    if LAY == 0:
        return _tile(base, off, r, kk, slow, 1, _km(mr, mk, MASK_K, False))
    elif LAY == 1:
        return tl.trans(_tile(base, off, kk, r, slow, 1, _km(mr, mk, MASK_K, True)))
    else:
        return _tile(base, off, r, kk, rs, cs, _km(mr, mk, MASK_K, False))


@triton.jit
def _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kend, sign, acc,
          BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr, BILINEAR: tl.constexpr,
          UPCAST: tl.constexpr, APPLY_SIGN: tl.constexpr, MASK_K: tl.constexpr, LAY: tl.constexpr,
          PREC: tl.constexpr):
    """One term's contribution over the contracted range [k0, kend), through ``tl.dot``.  MASK_K: the
    range is the last partial block (masked); otherwise ``kend - k0`` is a multiple of BK.  SINGLE: a
    diagonal output tile (rows j = rows i: one load serves both)."""
    kr = tl.arange(0, BK)
    for k in range(k0, kend, BK):
        kk = k + kr
        mk = kk < kend
        a = _rows(xb, xo, ri, kk, rs, cs, slow, mi, mk, MASK_K, LAY)
        if SINGLE:
            b = a
        else:
            b = _rows(xb, xo, rj, kk, rs, cs, slow, mj, mk, MASK_K, LAY)
        if BILINEAR:
            c = _rows(yb, yo, ri, kk, yrs, ycs, yslow, mi, mk, MASK_K, LAY)
            if SINGLE:
                d = c
            else:
                d = _rows(yb, yo, rj, kk, yrs, ycs, yslow, mj, mk, MASK_K, LAY)
            acc = _pair_dot(a, d, c, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN, PREC)
        else:
            acc = _pair_dot(a, b, a, b, acc, sign, BILINEAR, UPCAST, APPLY_SIGN, PREC)
    return acc


@triton.jit
def _fp64_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc, BILINEAR: tl.constexpr):
    """fp64 accumulation without ``tl.dot`` (triton 3.6 rejects an fp64 accumulator there): one rank-1
    update ``acc += sign * a_k b_k^T`` per contracted index, from two column loads (any strides).
    Inputs are widened by ``widen`` (fp64 inputs kept exact; others through fp32, exactly).  A
    correctness mode: O(BT^2) fp64 FMAs per loaded column, no tensor cores."""
    ri64 = ri.to(tl.int64)
    rj64 = rj.to(tl.int64)
    for k in range(k0, kend):
        a = widen(tl.load(xb + xo + ri64 * rs + k * cs, mask=mi, other=0.0), tl.float64) * sign
        b = widen(tl.load(xb + xo + rj64 * rs + k * cs, mask=mj, other=0.0), tl.float64)
        if BILINEAR:
            c = widen(tl.load(yb + yo + ri64 * yrs + k * ycs, mask=mi, other=0.0), tl.float64) * sign
            d = widen(tl.load(yb + yo + rj64 * yrs + k * ycs, mask=mj, other=0.0), tl.float64)
            acc += a[:, None] * d[None, :] + c[:, None] * b[None, :]
        else:
            acc += a[:, None] * b[None, :]
    return acc


@triton.jit
def _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kend, sign, acc, nx, ng,
                BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr, UPCAST: tl.constexpr,
                APPLY_SIGN: tl.constexpr, MASK_K: tl.constexpr, LAY: tl.constexpr, PREC: tl.constexpr):
    """CHECK twin of ``_term`` (bilinear, x = weights, y = gradients): on a diagonal output tile (SINGLE) it
    also adds the squared row norms of the loaded tiles, ``nx += sum_k x[ri, k]^2`` and ``ng += sum_k
    y[ri, k]^2`` (fp32), from the same loads as the dots."""
    kr = tl.arange(0, BK)
    for k in range(k0, kend, BK):
        kk = k + kr
        mk = kk < kend
        a = _rows(xb, xo, ri, kk, rs, cs, slow, mi, mk, MASK_K, LAY)
        c = _rows(yb, yo, ri, kk, yrs, ycs, yslow, mi, mk, MASK_K, LAY)
        if SINGLE:
            a32 = a.to(tl.float32)
            c32 = c.to(tl.float32)
            nx += tl.sum(a32 * a32, axis=1)
            ng += tl.sum(c32 * c32, axis=1)
            acc = _pair_dot(a, c, c, a, acc, sign, True, UPCAST, APPLY_SIGN, PREC)
        else:
            b = _rows(xb, xo, rj, kk, rs, cs, slow, mj, mk, MASK_K, LAY)
            d = _rows(yb, yo, rj, kk, yrs, ycs, yslow, mj, mk, MASK_K, LAY)
            acc = _pair_dot(a, d, c, b, acc, sign, True, UPCAST, APPLY_SIGN, PREC)
    return acc, nx, ng


@triton.jit
def _fp64_check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc, nx, ng,
                     SINGLE: tl.constexpr):
    """CHECK twin of ``_fp64_term`` (bilinear): rank-1 fp64 updates, and on a diagonal tile the squared row
    norms ``nx`` (weights) and ``ng`` (gradients) of the rows ``ri`` from the same column loads."""
    ri64 = ri.to(tl.int64)
    rj64 = rj.to(tl.int64)
    for k in range(k0, kend):
        a = widen(tl.load(xb + xo + ri64 * rs + k * cs, mask=mi, other=0.0), tl.float64)
        b = widen(tl.load(xb + xo + rj64 * rs + k * cs, mask=mj, other=0.0), tl.float64)
        c = widen(tl.load(yb + yo + ri64 * yrs + k * ycs, mask=mi, other=0.0), tl.float64)
        d = widen(tl.load(yb + yo + rj64 * yrs + k * ycs, mask=mj, other=0.0), tl.float64)
        acc += (a * sign)[:, None] * d[None, :] + (c * sign)[:, None] * b[None, :]
        if SINGLE:
            nx += a * a
            ng += c * c
    return acc, nx, ng


@triton.jit
def _slot_check(xb, yb, terms, signs, t0, t1, k0, k1, ri, rj, mi, mj, acc, nx, ng, BT: tl.constexpr,
                BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr, FP64: tl.constexpr,
                UPCAST: tl.constexpr, FOLD: tl.constexpr, LAY: tl.constexpr, PREC: tl.constexpr):
    """CHECK twin of ``_slot_terms``: the bilinear form of terms [t0, t1) into ``acc`` (the sign handled as
    there) and, on a diagonal tile, ``nx += sign_t^2 ||x_t[r]||^2``, ``ng += ||y_t[r]||^2`` per output row r."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    for t in range(t0, t1):
        xo, rs, cs, n, yo, yrs, ycs, slow, yslow = _strides(terms + t * tables.GRAM_TERM.COLS, ALIGN, LAY)
        sign = tl.load(signs + t)
        kend = tl.maximum(tl.minimum(k1, n), k0)
        kfull = k0 + (kend - k0) // BK * BK
        tnx = tl.zeros([BT], dtype=ACC)
        tng = tl.zeros([BT], dtype=ACC)
        if FP64:
            acc, tnx, tng = _fp64_check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc,
                                             tnx, tng, SINGLE)
        elif FOLD and (xb.dtype.element_ty == tl.float32):
            acc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull, sign,
                                        acc, tnx, tng, BK, ALIGN, SINGLE, UPCAST, True, False, LAY, PREC)
            acc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend,
                                        sign, acc, tnx, tng, BK, ALIGN, SINGLE, UPCAST, True, True, LAY, PREC)
        elif FOLD:  # |sign| == 1: on the accumulator around the term (``_slot_terms``)
            acc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull, sign,
                                        acc * sign, tnx, tng, BK, ALIGN, SINGLE, UPCAST, False, False, LAY, PREC)
            acc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend,
                                        sign, acc, tnx, tng, BK, ALIGN, SINGLE, UPCAST, False, True, LAY, PREC)
            acc = acc * sign
        else:
            tacc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull,
                                         sign, tl.zeros([BT, BT], dtype=ACC), tnx, tng, BK, ALIGN, SINGLE, UPCAST,
                                         False, False, LAY, PREC)
            tacc, tnx, tng = _check_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend,
                                         sign, tacc, tnx, tng, BK, ALIGN, SINGLE, UPCAST, False, True, LAY, PREC)
            acc += sign * tacc
        nx += (sign * sign) * tnx
        ng += tng
    return acc, nx, ng


@triton.jit
def _drift_dots(oi, ni, oj, nj, a, sign, sdec, acc_n, acc_d, acc_b, acc_l,
                SINGLE: tl.constexpr, DECAY: tl.constexpr, FOLD: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    """One contracted block of the four DRIFT accumulators from ``[BT, BK]`` (logical) tiles of the
    old (``oi``, ``oj``) and new (``ni``, ``nj``) weights of output rows i and j (``*j`` ignored if
    SINGLE: a diagonal output tile, ti == tj; launch.py gives those their own launch).  Factors folded into the left operands:
    ``sign`` (h_new, bil, h_delta), ``sdec = sign*(a^2-1)`` (decay).  Everything but h_new runs in
    fp32 (``aO``, ``Dl`` are fp32 by construction, and ``sdec`` is not +-1); h_new folds ``sign`` in the
    input dtype when FOLD (|sign| == 1 or fp32 inputs: exact / one rounding), so bf16/fp16 tiles go to
    the tensor cores, else in fp32.  bil on a SINGLE tile: one dot ``aO Dl^T`` here, the transpose is
    added once at the end of the item."""
    oi32 = oi.to(tl.float32)
    ni32 = ni.to(tl.float32)
    aoi = oi32 * a  # rounded to fp32, as torch rounds ``old * a``
    dli = ni32 - aoi
    if SINGLE:
        oj32 = oi32
        nj32 = ni32
        nj = ni
        aoj = aoi
        dlj = dli
    else:
        oj32 = oj.to(tl.float32)
        nj32 = nj.to(tl.float32)
        aoj = oj32 * a
        dlj = nj32 - aoj
    if FOLD:
        nl = (ni * sign).to(ni.dtype)
        nr = nj
        if UPCAST:
            nl = nl.to(tl.float32)
            nr = nr.to(tl.float32)
    else:
        nl = ni32 * sign
        nr = nj32
    acc_n = _dot(nl, nr, acc_n, PREC)
    if DECAY:  # compiled out when decay is not requested or every a_t == 1 (launch.launch_factors)
        acc_d = _dot(oi32 * sdec, oj32, acc_d, PREC)
    dls = dli * sign
    acc_b = _dot(aoi * sign, dlj, acc_b, PREC)
    if not SINGLE:
        acc_b = _dot(dls, aoj, acc_b, PREC)
    acc_l = _dot(dls, dlj, acc_l, PREC)
    return acc_n, acc_d, acc_b, acc_l


@triton.jit
def _drift_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kend, a, sign, sdec,
                acc_n, acc_d, acc_b, acc_l, BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr,
                DECAY: tl.constexpr, FOLD: tl.constexpr, UPCAST: tl.constexpr, MASK_K: tl.constexpr,
                LAY: tl.constexpr, PREC: tl.constexpr):
    """One term's DRIFT contribution over [k0, kend): ``xb`` = old weights, ``yb`` = new weights
    (MASK_K, SINGLE as in ``_term``)."""
    kr = tl.arange(0, BK)
    for k in range(k0, kend, BK):
        kk = k + kr
        mk = kk < kend
        oi = _rows(xb, xo, ri, kk, rs, cs, slow, mi, mk, MASK_K, LAY)
        ni = _rows(yb, yo, ri, kk, yrs, ycs, yslow, mi, mk, MASK_K, LAY)
        if SINGLE:
            oj = oi
            nj = ni
        else:
            oj = _rows(xb, xo, rj, kk, rs, cs, slow, mj, mk, MASK_K, LAY)
            nj = _rows(yb, yo, rj, kk, yrs, ycs, yslow, mj, mk, MASK_K, LAY)
        acc_n, acc_d, acc_b, acc_l = _drift_dots(oi, ni, oj, nj, a, sign, sdec, acc_n, acc_d, acc_b, acc_l,
                                                 SINGLE, DECAY, FOLD, UPCAST, PREC)
    return acc_n, acc_d, acc_b, acc_l


@triton.jit
def _strides(row, ALIGN: tl.constexpr, LAY: tl.constexpr):
    """``xo, rs, cs, n, yo, yrs, ycs, slow, yslow`` of a term-table row; ``slow``: the strided axis of
    layout 0 (rows) / 1 (columns), hinted HERE right after its load, so the compiler can emit 16-byte
    vector loads (a ``tl.multiple_of`` on a callee's argument is lost; ``bench/sass.py``)."""
    xo = tl.multiple_of(tl.load(row + tables.GRAM_TERM.X_OFF), ALIGN)
    rs = tl.load(row + tables.GRAM_TERM.X_RS)
    cs = tl.load(row + tables.GRAM_TERM.X_CS)
    n = tl.load(row + tables.GRAM_TERM.N)
    yo = tl.multiple_of(tl.load(row + tables.GRAM_TERM.Y_OFF), ALIGN)
    yrs = tl.load(row + tables.GRAM_TERM.Y_RS)
    ycs = tl.load(row + tables.GRAM_TERM.Y_CS)
    if LAY == 1:
        slow = tl.multiple_of(tl.load(row + tables.GRAM_TERM.X_CS), ALIGN)
        yslow = tl.multiple_of(tl.load(row + tables.GRAM_TERM.Y_CS), ALIGN)
    else:
        slow = tl.multiple_of(tl.load(row + tables.GRAM_TERM.X_RS), ALIGN)
        yslow = tl.multiple_of(tl.load(row + tables.GRAM_TERM.Y_RS), ALIGN)
    return xo, rs, cs, n, yo, yrs, ycs, slow, yslow


@triton.jit
def _slot_terms(xb, yb, terms, signs, t0, t1, k0, k1, ri, rj, mi, mj, acc, BT: tl.constexpr, BK: tl.constexpr,
                ALIGN: tl.constexpr, SINGLE: tl.constexpr, BILINEAR: tl.constexpr, FP64: tl.constexpr,
                UPCAST: tl.constexpr, FOLD: tl.constexpr, LAY: tl.constexpr, PREC: tl.constexpr):
    """Terms [t0, t1) of one layout (constexpr LAY: one code path per loop): full contracted blocks
    without a mask along k, then the masked tail."""
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    for t in range(t0, t1):
        xo, rs, cs, n, yo, yrs, ycs, slow, yslow = _strides(terms + t * tables.GRAM_TERM.COLS, ALIGN, LAY)
        sign = tl.load(signs + t)
        kend = tl.maximum(tl.minimum(k1, n), k0)
        kfull = k0 + (kend - k0) // BK * BK
        if FP64:
            acc = _fp64_term(xb, yb, xo, rs, cs, yo, yrs, ycs, ri, rj, mi, mj, k0, kend, sign, acc, BILINEAR)
        elif FOLD and (xb.dtype.element_ty == tl.float32):
            acc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull, sign, acc,
                        BK, ALIGN, SINGLE, BILINEAR, UPCAST, True, False, LAY, PREC)
            acc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend, sign, acc,
                        BK, ALIGN, SINGLE, BILINEAR, UPCAST, True, True, LAY, PREC)
        elif FOLD:
            # |sign| == 1 (launch.py folds inputs other than fp32 only then): the sign goes on the
            # accumulator, acc + s X Y^T = s (s acc + X Y^T) exactly, and the dots take the loaded tiles
            # as they are.  With a sign-multiplied copy of a diagonal tile (SINGLE: the same tile is the
            # other operand) the sm_90 pipeliner (triton 3.6, 3.8) gives the tile's cp.async ring 2
            # buffers for 2 prefetched blocks while a pending wgmma still reads the current one from
            # shared memory, and the next copy overwrites it (tests/test_gram_sm90_pipeline.py)
            acc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull, sign, acc * sign,
                        BK, ALIGN, SINGLE, BILINEAR, UPCAST, False, False, LAY, PREC)
            acc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend, sign, acc,
                        BK, ALIGN, SINGLE, BILINEAR, UPCAST, False, True, LAY, PREC)
            acc = acc * sign
        else:
            tacc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0, kfull, sign,
                         tl.zeros([BT, BT], dtype=ACC), BK, ALIGN, SINGLE, BILINEAR, UPCAST, False, False, LAY,
                         PREC)
            tacc = _term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull, kend, sign,
                         tacc, BK, ALIGN, SINGLE, BILINEAR, UPCAST, False, True, LAY, PREC)
            acc += sign * tacc
    return acc


@triton.jit
def _slot_drift(xb, yb, terms, signs, factors, t0, t1, k0, k1, ri, rj, mi, mj, acc_n, acc_d, acc_b, acc_l,
                BK: tl.constexpr, ALIGN: tl.constexpr, SINGLE: tl.constexpr, DECAY: tl.constexpr,
                FOLD: tl.constexpr, UPCAST: tl.constexpr, LAY: tl.constexpr, PREC: tl.constexpr):
    """DRIFT twin of ``_slot_terms``: terms [t0, t1) of one layout into the four accumulators."""
    for t in range(t0, t1):
        xo, rs, cs, n, yo, yrs, ycs, slow, yslow = _strides(terms + t * tables.GRAM_TERM.COLS, ALIGN, LAY)
        sign = tl.load(signs + t)
        a = tl.load(factors + t * tables.FACTOR.COLS + tables.FACTOR.A)
        sdec = tl.load(factors + t * tables.FACTOR.COLS + tables.FACTOR.SDEC)
        kend = tl.maximum(tl.minimum(k1, n), k0)
        kfull = k0 + (kend - k0) // BK * BK
        acc_n, acc_d, acc_b, acc_l = _drift_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, k0,
                                                 kfull, a, sign, sdec, acc_n, acc_d, acc_b, acc_l,
                                                 BK, ALIGN, SINGLE, DECAY, FOLD, UPCAST, False, LAY, PREC)
        acc_n, acc_d, acc_b, acc_l = _drift_term(xb, yb, xo, rs, cs, yo, yrs, ycs, slow, yslow, ri, rj, mi, mj, kfull,
                                                 kend, a, sign, sdec, acc_n, acc_d, acc_b, acc_l,
                                                 BK, ALIGN, SINGLE, DECAY, FOLD, UPCAST, True, LAY, PREC)
    return acc_n, acc_d, acc_b, acc_l


@triton.jit
def gram_kernel(xb, yb, terms, signs, items, part, factors, plane,
                 D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ALIGN: tl.constexpr,
                 SINGLE: tl.constexpr, BILINEAR: tl.constexpr, FP64: tl.constexpr,
                 UPCAST: tl.constexpr, FOLD: tl.constexpr, PREC: tl.constexpr = "ieee",
                 DRIFT: tl.constexpr = False, DECAY: tl.constexpr = False, CHECK: tl.constexpr = False):
    """FOLD (launch.py: every sign is +-1, or fp32 inputs): every term accumulates into ONE register
    tile, the sign applied to the left operands (fp32 inputs) or to the accumulator around the term
    (others: ``_slot_terms``); otherwise each term gets its own tile that is scaled and added (twice
    the accumulator registers).

    DRIFT (fp32 accumulation only; ``xb`` old, ``yb`` new weights): ``factors`` holds per term
    ``[a_t, sign_t*(a_t^2-1)]`` in fp32, four accumulators (h_new, decay, bil, h_delta) are written
    ``plane`` elements apart; DECAY=False (decay not requested, or every a_t == 1) compiles the decay
    dots and the decay store out (the caller zeroes or skips that plane).  PREC: ``tl.dot`` precision
    of fp32 operands (``_dot``).
    FOLD here only selects the input-dtype fold of h_new (see ``_drift_dots``).  Ignored otherwise.

    CHECK (the gradient check's one pass, ``xb`` weights, ``yb`` gradients): plane 0 the bilinear form (as
    BILINEAR), plane 1 ``diag(sum_t sign_t^2 ||X_t[r]||^2)`` and plane 2 ``diag(sum_t ||Y_t[r]||^2)`` of the
    tile's rows, computed from the tiles the dots load (non-zero on diagonal tiles only: SINGLE launches),
    ``plane`` elements apart."""
    pid = tl.program_id(0).to(tl.int64)
    it = items + pid * tables.GRAM_ITEM.COLS
    t0 = tl.load(it + tables.GRAM_ITEM.T0)
    t1 = tl.load(it + tables.GRAM_ITEM.T1)
    ta = tl.load(it + tables.GRAM_ITEM.TA)  # the slot's terms are sorted by layout: [t0, ta) 0, [ta, tb) 1, [tb, t1) 2
    tb = tl.load(it + tables.GRAM_ITEM.TB)
    k0 = tl.multiple_of(tl.load(it + tables.GRAM_ITEM.K0), BK)  # launch.py: chunks are multiples of BK
    k1 = tl.load(it + tables.GRAM_ITEM.K1)
    ti = tl.load(it + tables.GRAM_ITEM.TI)
    tj = tl.load(it + tables.GRAM_ITEM.TJ)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    ri = ti * BT + tl.arange(0, BT)
    rj = tj * BT + tl.arange(0, BT)
    mi = ri < D
    mj = rj < D
    o = tl.arange(0, BT)
    out = part + pid * (BT * BT) + o[:, None] * BT + o[None, :]
    if DRIFT:
        z = tl.zeros([BT, BT], dtype=tl.float32)
        acc_n, acc_d, acc_b, acc_l = _slot_drift(xb, yb, terms, signs, factors, t0, ta, k0, k1, ri, rj, mi, mj,
                                                 z, z, z, z, BK, ALIGN, SINGLE, DECAY, FOLD, UPCAST, 0, PREC)
        acc_n, acc_d, acc_b, acc_l = _slot_drift(xb, yb, terms, signs, factors, ta, tb, k0, k1, ri, rj, mi, mj,
                                                 acc_n, acc_d, acc_b, acc_l, BK, ALIGN, SINGLE, DECAY, FOLD,
                                                 UPCAST, 1, PREC)
        acc_n, acc_d, acc_b, acc_l = _slot_drift(xb, yb, terms, signs, factors, tb, t1, k0, k1, ri, rj, mi, mj,
                                                 acc_n, acc_d, acc_b, acc_l, BK, ALIGN, SINGLE, DECAY, FOLD,
                                                 UPCAST, 2, PREC)
        if SINGLE:  # one dot per step (aO Dl^T), its transpose added once here
            acc_b = acc_b + tl.trans(acc_b)
        pl = plane.to(tl.int64)
        tl.store(out, acc_n)
        if DECAY:
            tl.store(out + pl, acc_d)
        tl.store(out + 2 * pl, acc_b * 0.5)
        tl.store(out + 3 * pl, acc_l)
    elif CHECK:
        acc = tl.zeros([BT, BT], dtype=ACC)
        nx = tl.zeros([BT], dtype=ACC)
        ng = tl.zeros([BT], dtype=ACC)
        if FP64:
            acc, nx, ng = _slot_check(xb, yb, terms, signs, t0, t1, k0, k1, ri, rj, mi, mj, acc, nx, ng, BT, BK, ALIGN,
                                      SINGLE, FP64, UPCAST, FOLD, 2, PREC)
        else:
            acc, nx, ng = _slot_check(xb, yb, terms, signs, t0, ta, k0, k1, ri, rj, mi, mj, acc, nx, ng, BT, BK, ALIGN,
                                      SINGLE, FP64, UPCAST, FOLD, 0, PREC)
            acc, nx, ng = _slot_check(xb, yb, terms, signs, ta, tb, k0, k1, ri, rj, mi, mj, acc, nx, ng, BT, BK, ALIGN,
                                      SINGLE, FP64, UPCAST, FOLD, 1, PREC)
            acc, nx, ng = _slot_check(xb, yb, terms, signs, tb, t1, k0, k1, ri, rj, mi, mj, acc, nx, ng, BT, BK, ALIGN,
                                      SINGLE, FP64, UPCAST, FOLD, 2, PREC)
        pl = plane.to(tl.int64)
        eye = o[:, None] == o[None, :]
        tl.store(out, acc * 0.5)
        tl.store(out + pl, tl.where(eye, nx[:, None], 0.0))
        tl.store(out + 2 * pl, tl.where(eye, ng[:, None], 0.0))
    else:
        acc = tl.zeros([BT, BT], dtype=ACC)
        if FP64:
            acc = _slot_terms(xb, yb, terms, signs, t0, t1, k0, k1, ri, rj, mi, mj, acc, BT, BK, ALIGN, SINGLE,
                              BILINEAR, FP64, UPCAST, FOLD, 2, PREC)
        else:
            acc = _slot_terms(xb, yb, terms, signs, t0, ta, k0, k1, ri, rj, mi, mj, acc, BT, BK, ALIGN, SINGLE,
                              BILINEAR, FP64, UPCAST, FOLD, 0, PREC)
            acc = _slot_terms(xb, yb, terms, signs, ta, tb, k0, k1, ri, rj, mi, mj, acc, BT, BK, ALIGN, SINGLE,
                              BILINEAR, FP64, UPCAST, FOLD, 1, PREC)
            acc = _slot_terms(xb, yb, terms, signs, tb, t1, k0, k1, ri, rj, mi, mj, acc, BT, BK, ALIGN, SINGLE,
                              BILINEAR, FP64, UPCAST, FOLD, 2, PREC)
        if BILINEAR:
            acc = acc * 0.5
        tl.store(out, acc)


@triton.jit
def gram_finish(part, order, groups, out, pplane, oplane, D: tl.constexpr, BT: tl.constexpr,
                 FP64: tl.constexpr, SKIP1: tl.constexpr = False):
    """Per output tile: sum its items' partial tiles in table order; write the tile and its mirror.
    Program axis 1 selects a plane (DRIFT: 4 outputs): ``part``/``out`` advance by ``pplane``/``oplane``.
    SKIP1 (DRIFT without decay): a grid of 3 planes maps to planes 0, 2, 3 (the decay plane is not read)."""
    pid = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    if SKIP1:
        p = p + (p > 0).to(tl.int64)
    part += p * pplane
    out += p * oplane
    g = groups + pid * tables.GRAM_GROUP.COLS
    i0 = tl.load(g + tables.GRAM_GROUP.I0)
    i1 = tl.load(g + tables.GRAM_GROUP.I1)
    slot = tl.load(g + tables.GRAM_GROUP.SLOT)
    ti = tl.load(g + tables.GRAM_GROUP.TI)
    tj = tl.load(g + tables.GRAM_GROUP.TJ)
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
