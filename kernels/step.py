"""Triton kernels of the fused optimizer step (the host side is ``step_runner.py``; the math and the
torch twin are in ``optim_step.py`` / ``step_twin.py``).

``step_kernel``: one program per ``(tensor, batch entry, row block of RB rows, column block of CB
columns)`` of the launch's tensors (``tables.STEP_PROG``), each read as its ``B x R x C`` matrix form
at an element offset from the launch's base pointer (``tables.STEP_TENSOR``).  It reads ``param, grad``
and the state buffers once per ``[BR, CB]`` tile, writes the new ``param`` and state, and, with
``STATS``, the tile's drift quantities

    Q: ``[new^2, a old Delta, Delta^2, (a^2 - 1) old^2]``        L: ``[new, Delta, 0, (a - 1) old]``

(``Delta = new - a old``): row sums per tile into the partial buffer (one partial per column block),
column sums accumulated elementwise over the program's row tiles and reduced once (one partial per
row block).  ``finish_kernel`` sums each slot's partials in float64, in a fixed order (no atomics:
deterministic).

Rounding: the update computes in fp32 and, for bf16/fp16 parameters, rounds to the storage dtype at
every point where torch's foreach ops write a tensor (``_rnd``), so bf16 parameters follow torch's
rounding (up to fp32 contraction differences inside one op).  The first-order quantity is
``a old Delta`` as it is; its coefficient 2 is applied when the statistics are added into the plan's
entries (``step_fold``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tables


@triton.jit
def _rnd(x, LOWP: tl.constexpr):
    """``x`` (fp32) rounded to the storage dtype and back (LOWP 1: bf16, 2: fp16, 0: as it is).  bf16
    rounds to nearest even by bit arithmetic: the interpreter's fp32 -> bf16 cast truncates, the GPU's
    does not."""
    if LOWP == 1:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (((u >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    elif LOWP == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _store_rows(part, NP, off, r, mr, s0, s1, s2, s3):
    """``part[q * NP + off + r] = s_q`` for the four quantities.  Quantity q's row starts at
    ``part + q*NP``, reached by adding NP to the pointer once per quantity (NP is an int32 argument
    below 2^31; ``3 * NP`` in int32 would wrap above ~715M partial entries)."""
    p1 = part + NP
    p2 = p1 + NP
    tl.store(part + off + r, s0, mask=mr)
    tl.store(p1 + off + r, s1, mask=mr)
    tl.store(p2 + off + r, s2, mask=mr)
    tl.store(p2 + NP + off + r, s3, mask=mr)


@triton.jit
def _adam(p, g, ea, es, step_size, bc2s, w1, beta2, omb2, eps, LOWP: tl.constexpr):
    """Adam's update of a tile after the weight decay: ``(param, exp_avg, exp_avg_sq)``, op by op as
    ``torch.optim._single_tensor_adam``."""
    if w1 < 0.5:  # torch's lerp: self + w*(end-self) for w < 0.5, else end - (end-self)*(1-w)
        ea = _rnd(ea + w1 * (g - ea), LOWP)
    else:
        ea = _rnd(g - (g - ea) * (1.0 - w1), LOWP)
    es = _rnd(es * beta2, LOWP)
    es = _rnd(es + omb2 * g * g, LOWP)
    den = _rnd(tl.sqrt_rn(es), LOWP)
    den = _rnd(tl.div_rn(den, bc2s), LOWP)
    den = _rnd(den + eps, LOWP)
    p = _rnd(p + step_size * tl.div_rn(ea, den), LOWP)
    return p, ea, es


@triton.jit
def step_kernel(
        # pointers: the launch's base tensor (every tensor is an element offset from it), the tensor table,
        # the per-tensor scalars, the program table, the partial sums
        base, tensors, scal, progs, part,
        # sizes: elements per quantity row of ``part``
        NP,
        # hyper-parameters (step_runner._hyper): -lr, 1 - lr wd, wd; the drift decomposition's decay factor
        # a, a^2 - 1, a - 1; Adam's 1 - beta1, beta2, 1 - beta2, eps; SGD's momentum, 1 - dampening
        neg_lr, decay, wd, a, a2m1, am1, w1, beta2, omb2, eps, momentum, omd,
        # meta-parameters of the update: algorithm (0: adam, 1: sgd) and its switches, storage rounding
        ALGO: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
        HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, LOWP: tl.constexpr,
        # meta-parameters of the statistics: any, column, linear ones; float64 accumulation
        STATS: tl.constexpr, COLS: tl.constexpr, LIN: tl.constexpr, FP64: tl.constexpr,
        # meta-parameters of the tiles: rows per program, [BR, CB] tile, vector width of every offset
        RB: tl.constexpr, BR: tl.constexpr, CB: tl.constexpr, ALIGN: tl.constexpr):
    """COLS / LIN (from the launch's requests): some tensor wants column / linear statistics; without
    them their accumulators are not allocated.  ALIGN: every offset and column count of the launch's
    tensors is a multiple of it (``step_runner._launches``), so loads vectorise."""
    pid = tl.program_id(0).to(tl.int64)
    pr = progs + pid * tables.STEP_PROG.COLS
    t = tl.load(pr + tables.STEP_PROG.TENSOR)
    b = tl.load(pr + tables.STEP_PROG.BATCH)
    rb = tl.load(pr + tables.STEP_PROG.ROW_BLOCK)
    cb = tl.load(pr + tables.STEP_PROG.COL_BLOCK)
    row = tensors + t * tables.STEP_TENSOR.COLS
    p_off = tl.multiple_of(tl.load(row + tables.STEP_TENSOR.P_OFF), ALIGN)
    g_off = tl.multiple_of(tl.load(row + tables.STEP_TENSOR.G_OFF), ALIGN)
    m_off = tl.multiple_of(tl.load(row + tables.STEP_TENSOR.M_OFF), ALIGN)
    v_off = tl.multiple_of(tl.load(row + tables.STEP_TENSOR.V_OFF), ALIGN)
    R = tl.load(row + tables.STEP_TENSOR.R)
    C = tl.multiple_of(tl.load(row + tables.STEP_TENSOR.C), ALIGN)
    BRt = tl.load(row + tables.STEP_TENSOR.BR)  # B*R
    nrb = tl.load(row + tables.STEP_TENSOR.NRB)
    rq = tl.load(row + tables.STEP_TENSOR.ROW_Q)
    rl = tl.load(row + tables.STEP_TENSOR.ROW_L)
    cq = tl.load(row + tables.STEP_TENSOR.COL_Q)
    cl = tl.load(row + tables.STEP_TENSOR.COL_L)
    fresh = tl.load(row + tables.STEP_TENSOR.FRESH)  # sgd: momentum buffer not yet initialised
    step_size = tl.load(scal + t * tables.STEP_SCALAR.COLS + tables.STEP_SCALAR.STEP_SIZE)
    bc2s = tl.load(scal + t * tables.STEP_SCALAR.COLS + tables.STEP_SCALAR.BC2S)
    ACC: tl.constexpr = tl.float64 if FP64 else tl.float32
    c = tl.multiple_of(cb * CB, CB) + tl.arange(0, CB)
    mc = c < C
    r_start = rb * RB
    r_end = tl.minimum(r_start + RB, R)
    # column sums: elementwise [BR, CB] accumulators, reduced once after the loop (no cross-warp
    # reduction inside it); row sums: one warp spans a row's CB columns (step_runner._tiles: CB = 32
    # lanes x one 16-byte vector), so they are warp shuffles only.
    z2 = tl.zeros([BR, CB], dtype=ACC)
    cq0, cq1, cq2, cq3 = z2, z2, z2, z2
    cl0, cl1, cl3 = z2, z2, z2
    for r0 in range(r_start, r_end, BR):
        r = r0 + tl.arange(0, BR)
        mr = r < r_end
        m = mr[:, None] & mc[None, :]
        e = (b * R + r).to(tl.int64)[:, None] * C + c[None, :]
        p = tl.load(base + p_off + e, mask=m, other=0.0).to(tl.float32)
        g = tl.load(base + g_off + e, mask=m, other=0.0).to(tl.float32)
        old = p
        if MAXIMIZE:
            g = -g
        if ALGO == 0:  # adam / adamw
            if HAS_WD:
                if DECOUPLED:
                    p = _rnd(p * decay, LOWP)
                else:
                    g = _rnd(g + wd * p, LOWP)
            ea = tl.load(base + m_off + e, mask=m, other=0.0).to(tl.float32)
            es = tl.load(base + v_off + e, mask=m, other=0.0).to(tl.float32)
            p, ea, es = _adam(p, g, ea, es, step_size, bc2s, w1, beta2, omb2, eps, LOWP)
            tl.store(base + m_off + e, ea.to(base.dtype.element_ty), mask=m)
            tl.store(base + v_off + e, es.to(base.dtype.element_ty), mask=m)
        else:  # sgd
            if HAS_WD:
                g = _rnd(g + wd * p, LOWP)
            if HAS_MOM:
                buf = tl.load(base + m_off + e, mask=m, other=0.0).to(tl.float32)
                buf = _rnd(buf * momentum, LOWP)
                buf = _rnd(buf + omd * g, LOWP)
                buf = tl.where(fresh != 0, g, buf)  # a fresh buffer takes the gradient
                tl.store(base + m_off + e, buf.to(base.dtype.element_ty), mask=m)
                if NESTEROV:
                    g = _rnd(g + momentum * buf, LOWP)
                else:
                    g = buf
            p = _rnd(p + neg_lr * g, LOWP)
        tl.store(base + p_off + e, p.to(base.dtype.element_ty), mask=m)
        if STATS:
            if (rq >= 0) | (rl >= 0) | (cq >= 0) | (cl >= 0):
                n = tl.where(m, p.to(ACC), 0.0)
                o = tl.where(m, old.to(ACC), 0.0)
                ao = o * a
                d = n - ao
                q0 = n * n
                q1 = ao * d
                q2 = d * d
                q3 = (o * o) * a2m1
                rows = b * R + r
                if rq >= 0:
                    _store_rows(part, NP, rq + cb * BRt, rows, mr, tl.sum(q0, 1), tl.sum(q1, 1),
                                tl.sum(q2, 1), tl.sum(q3, 1))
                if COLS:
                    if cq >= 0:
                        cq0 += q0
                        cq1 += q1
                        cq2 += q2
                        cq3 += q3
                if LIN:
                    l3 = o * am1
                    if rl >= 0:
                        _store_rows(part, NP, rl + cb * BRt, rows, mr, tl.sum(n, 1), tl.sum(d, 1),
                                    tl.zeros([BR], dtype=ACC), tl.sum(l3, 1))
                    if COLS:
                        if cl >= 0:
                            cl0 += n
                            cl1 += d
                            cl3 += l3
    if STATS:
        if COLS:
            cidx = (b * nrb + rb) * C + c
            if cq >= 0:
                _store_rows(part, NP, cq, cidx, mc, tl.sum(cq0, 0), tl.sum(cq1, 0), tl.sum(cq2, 0),
                            tl.sum(cq3, 0))
            if LIN:
                if cl >= 0:
                    _store_rows(part, NP, cl, cidx, mc, tl.sum(cl0, 0), tl.sum(cl1, 0),
                                tl.zeros([CB], dtype=ACC), tl.sum(cl3, 0))


@triton.jit
def finish_kernel(
        # pointers: the partial sums, the statistics, the finishing table (tables.STEP_FINISH)
        part, NP, stats, NS, table,
        # meta-parameters: columns per program; FP64 is not read
        BF: tl.constexpr, FP64: tl.constexpr):
    """Row ``pid0`` of ``table`` = ``[off, nrows, F, out]``: ``stats[q, out + f] = sum_i part[q, off + i*F + f]``
    (``NP`` / ``NS``: elements per quantity row of ``part`` / ``stats``), summed in float64 whatever the
    partials' dtype (a row of many column blocks, or a column of many row blocks, has thousands of
    partials of similar size: an fp32 running sum loses digits), rounded once to ``stats``' dtype."""
    pid = tl.program_id(0).to(tl.int64)
    tr = table + pid * tables.STEP_FINISH.COLS
    off = tl.load(tr + tables.STEP_FINISH.OFF)
    nrows = tl.load(tr + tables.STEP_FINISH.NROWS)
    F = tl.load(tr + tables.STEP_FINISH.F)
    out = tl.load(tr + tables.STEP_FINISH.OUT)
    f = tl.program_id(1).to(tl.int64) * BF + tl.arange(0, BF)
    mf = f < F
    src, dst = part, stats  # quantity q's rows: NP / NS added per q to the pointers (no int32 q * NP)
    for q in tl.static_range(4):
        acc = tl.zeros([BF], dtype=tl.float64)
        for i in range(0, nrows):
            acc += tl.load(src + off + i * F + f, mask=mf, other=0.0).to(tl.float64)
        tl.store(dst + out + f, acc.to(dst.dtype.element_ty), mask=mf)
        src += NP
        dst += NS
