"""Fused optimizer steps: update every weight (AdamW / Adam / SGD) and measure it in the same pass.

Knows nothing of nn.Module or of laws: it takes lists of tensors, the hyper-parameters of one
parameter group, and per tensor a *stats request* (which row/column statistics of the updated
weight to accumulate).  The optimizer (``conserve/optim/fused.py``) maps those statistics onto the
law plan's ``NormTerm``/``SumTerm`` entries.

Matrix form.  Every tensor is read as ``B x R x C`` (``B`` = product of the leading dims, ``(R, C)`` =
the last two; a vector of n entries is ``1 x 1 x n``, a scalar ``1 x 1 x 1``), contiguous.  With
``old`` the weight before the step, ``new`` after it, ``a`` the decoupled decay factor of the group
(``1 - lr*wd`` for AdamW and for plain SGD, else 1) and ``Delta = new - a*old`` (spec "Discrete steps:
the exact drift identity"), a stats slot of kind

* ``Q`` (quadratic, for NormTerms) accumulates ``[new^2, a*old*Delta, Delta^2, (a^2-1)*old^2]``,
* ``L`` (linear, for SumTerms) accumulates     ``[new,   Delta,       0,       (a-1)*old]``,

summed over the columns of each row (axis ``row``: ``B*R`` slots) or over the rows of each column
within one batch entry (axis ``col``: ``B*C`` slots).  A NormTerm over whole rows then gets
``h = sum sign*q0``, ``first = 2*sum sign*q1``, ``second = sum sign*q2``, ``decay = sum sign*q3``.

Triton path (``step_triton``): ONE launch of ``_step_kernel`` per (group, dtype): a program per
``(tensor, batch, row block RB, column block CB)`` reads ``param, grad, state`` once, writes the new
``param, state`` and per-program partial row sums (one per CB columns) and column sums (one per RB
rows) into a buffer; ``_finish_kernel`` sums the partials in float64 in a fixed order (no atomics:
deterministic).  Torch twin (``step_reference``): the same math op by op, as ``torch.optim`` does it
(``_single_tensor_adam`` / ``_single_tensor_sgd``; on CPU the ``foreach`` path runs the same ops), and
the same statistics with torch reductions (``stats_reference``); ``step_stats_reference`` runs both on
blocks of whole rows (the update is elementwise: the same bits), so a drift step's old copy and
``Delta`` are block-sized.  Finish (``fold``): the line statistics of a group of tensors added into the
plan entries (slice additions for runs of consecutive entries, else index additions), the coefficients
rebuilt from one sign per segment (or per pair).

Rounding: the kernel computes in fp32 and, for bf16/fp16 parameters, rounds to the storage dtype at
every point where torch's foreach ops write a tensor (``LOWP``), so bf16 parameters follow torch's
rounding (up to fp32 contraction differences inside one op).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from . import tables
from .config import check_triton_device
from .tables import STEP_FINISH, STEP_PROG, STEP_SCALAR
from .tables import STEP_TENSOR as ST

__all__ = ["Hyper", "StatsRequest", "matrix_shape", "step_reference", "step_triton", "stats_reference",
           "step_stats_reference", "chunk_bound", "finish_reference", "compact_terms", "finish_compact",
           "Fold", "fold", "NQ", "CHUNK_MAX", "CHUNK_MIN"]

NQ = 4  # quantities per stats slot
T_COLS = ST.COLS  # columns of the tensor table (tables.STEP_TENSOR)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(B, R, C)`` of the matrix form of a tensor of ``shape`` (see module docstring)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, 1, shape[0]
    return int(math.prod(shape[:-2])), shape[-2], shape[-1]


@dataclass
class Hyper:
    """Hyper-parameters of one parameter group, as python floats/bools (``torch.optim`` names).

    ``algo``: 'adam' (``decoupled`` True = AdamW) or 'sgd'.  ``a``: the decay factor of the drift
    decomposition (``1 - lr*weight_decay`` when decoupled / plain SGD, else 1)."""

    algo: str
    lr: float
    weight_decay: float = 0.0
    maximize: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    decoupled: bool = True
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    @property
    def a_exact(self) -> float:
        """The decay factor ``a`` of ``theta_{k+1} = a theta_k + Delta`` in float64: ``1 - lr wd`` for
        decoupled (AdamW) and momentum-free SGD weight decay, else 1 (``tracking.breakers.decay_factor``)."""
        if self.weight_decay == 0:
            return 1.0
        if (self.algo == "adam" and self.decoupled) or (self.algo == "sgd" and self.momentum == 0):
            return 1.0 - self.lr * self.weight_decay
        return 1.0

    @property
    def a(self) -> float:
        """``a_exact`` rounded to fp32 (the kernels' scalar type), so every path uses the very same ``a``
        and ``a^2 - 1`` is exact in double (``Assembly.correct`` turns the terms into those of ``a_exact``)."""
        return float(np.float32(self.a_exact))


@dataclass
class StatsRequest:
    """Stats slots of one tensor: first slot of each (axis, kind) in the stats buffer, -1 if unused."""

    row_q: int = -1
    row_l: int = -1
    col_q: int = -1
    col_l: int = -1

    @property
    def any(self) -> bool:
        return max(self.row_q, self.row_l, self.col_q, self.col_l) >= 0


# --------------------------------------------------------------------------------- torch twin
def _adam_scalars(h: Hyper, step: float) -> tuple[float, float]:
    """``(step_size, sqrt(bias_correction2))`` exactly as torch computes them (python doubles)."""
    bc1 = 1 - h.beta1 ** step
    bc2 = 1 - h.beta2 ** step
    return (h.lr / bc1) * -1, bc2 ** 0.5


@torch.no_grad()
def step_reference(h: Hyper, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   bufs1: Sequence[torch.Tensor | None], bufs2: Sequence[torch.Tensor | None],
                   steps: Sequence[float], first: Sequence[bool] = ()) -> None:
    """Torch twin of the update (in place), op by op as ``torch.optim`` (``_single_tensor_adam``/``sgd``).

    Args:
        params, grads: the parameters and their gradients (same shapes and dtypes).
        bufs1: ``exp_avg`` (adam) or ``momentum_buffer`` (sgd with momentum; ``first[i]`` True means the
            buffer is fresh and receives a copy of the gradient, as torch's first momentum step does).
        bufs2: ``exp_avg_sq`` (adam), unused for sgd.
        steps: the step count of each tensor AFTER its increment (adam bias correction).
    """
    for i, (p, g) in enumerate(zip(params, grads)):
        g = -g if h.maximize else g
        if h.algo == "adam":
            m, v = bufs1[i], bufs2[i]
            if h.weight_decay != 0:
                if h.decoupled:
                    p.mul_(1 - h.lr * h.weight_decay)
                else:
                    g = g.add(p, alpha=h.weight_decay)
            m.lerp_(g, 1 - h.beta1)
            v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
            step_size, bc2s = _adam_scalars(h, steps[i])
            denom = (v.sqrt() / bc2s).add_(h.eps)
            p.addcdiv_(m, denom, value=step_size)
        else:
            if h.weight_decay != 0:
                g = g.add(p, alpha=h.weight_decay)
            if h.momentum != 0:
                buf = bufs1[i]
                if first and first[i]:
                    buf.copy_(g)
                else:
                    buf.mul_(h.momentum).add_(g, alpha=1 - h.dampening)
                g = g.add(buf, alpha=h.momentum) if h.nesterov else buf
            p.add_(g, alpha=-h.lr)


_CHUNK = 1 << 16  # elements of the transient square in a column sum of squares
# Row blocks of the torch twin's drift step (``step_stats_reference``): at most CHUNK_MAX elements (256 KiB
# in fp32: the block's old copy, Delta and torch's two temporaries of the update stay in a core's L2
# cache, and the Python cost of the ~20 ops per block, ~0.1 ms, is small next to its arithmetic), at
# least CHUNK_MIN (that cost bounded on small models), and at most a quarter of the largest tracked
# tensor (``chunk_bound``): the four block-sized buffers then stay within the two weight-sized
# temporaries (``exp_avg_sq.sqrt() / bc2``) that torch's own AdamW step makes for that tensor.  Measured
# (14M-parameter LM of bench/track_overhead.py, one thread, drift step): blocks of 2Ki / 8Ki / 16Ki /
# 64Ki elements / whole tensors 740 / 212 / 140 / 100 / 130 ms.
CHUNK_MAX = _CHUNK
CHUNK_MIN = 1 << 11


def chunk_bound(largest: int) -> int:
    """Elements per block of the torch twin's drift step, for a largest tracked tensor of ``largest``
    elements: ``min(CHUNK_MAX, max(CHUNK_MIN, largest // 4))``."""
    return min(CHUNK_MAX, max(CHUNK_MIN, int(largest) // 4))


def _aligned(k: int, n: int) -> int:
    """``k`` rounded down to a multiple of ``64 / gcd(n, 64)`` (so ``k * n`` is a multiple of 64 elements:
    torch's vectorised CPU loops then split the blocks where they split the whole tensor) when that is >= 1."""
    m = 64 // math.gcd(max(1, int(n)), 64)
    return k - k % m if k >= m else k


def _blocks(B: int, R: int, C: int, bound: int):
    """Blocks ``(b0, nb, r0, nr, c0, nc)`` covering a ``B x R x C`` matrix form once, in element order, each
    of at most ``bound`` elements: whole batch entries while ``R*C <= bound``, else runs of whole rows of
    one entry, else (a row longer than ``bound``) runs of columns of one row.  So ``nb > 1`` only with
    whole entries and ``nc < C`` only with one row: a block's row and column slots are contiguous."""
    bound = max(1, int(bound))
    if R * C <= bound:
        nb = _aligned(max(1, bound // max(1, R * C)), R * C)
        for b0 in range(0, B, nb):
            yield b0, min(nb, B - b0), 0, R, 0, C
    elif C <= bound:
        nr = _aligned(bound // C, C)
        for b in range(B):
            for r0 in range(0, R, nr):
                yield b, 1, r0, min(nr, R - r0), 0, C
    else:
        for b in range(B):
            for r in range(R):
                for c0 in range(0, C, bound):
                    yield b, 1, r, 1, c0, min(bound, C - c0)


def _starts_aligned(B: int, R: int, C: int, bound: int) -> bool:
    """Whether every block of ``_blocks`` starts at a multiple of 64 elements (of the matrix form)."""
    return all(((b0 * R + r0) * C + c0) % 64 == 0 for b0, _, r0, _, c0, _ in _blocks(B, R, C, bound))


def _view3(t: torch.Tensor | None, B: int, R: int, C: int) -> torch.Tensor | None:
    """``t`` as a ``(B, R, C)`` view (no copy), or None when its strides do not allow one."""
    try:
        return t.view(B, R, C)
    except RuntimeError:
        return None


def _sumsq(x: torch.Tensor, axis: int, chunk: int = _CHUNK) -> torch.Tensor:
    """``(x * x).sum(axis)`` of a ``(B, R, C)`` tensor without a full-size temporary: the squares of at
    most ``chunk`` elements at a time (one row of each entry at least for columns, axis 1), each summed
    by ``torch.sum`` (cascade summation: its error does not grow with the length of the sum, whereas
    ``vector_norm``'s running sums lose digits on long rows of near-equal values); the pieces of a row
    longer than ``chunk`` (axis 2) or of a column (axis 1) are added in order."""
    B, R, C = x.shape
    if axis == 2:
        if B * R * C <= chunk:
            return x.square().sum(2)
        if C > chunk:  # long rows: column pieces of every row
            acc = x[:, :, :chunk].square().sum(2)
            for c0 in range(chunk, C, chunk):
                acc += x[:, :, c0:c0 + chunk].square().sum(2)
            return acc
        out = torch.empty(B, R, dtype=x.dtype, device=x.device)
        step = max(1, chunk // C)
        if step >= R:  # whole entries at a time
            nb = max(1, chunk // (R * C))
            for b0 in range(0, B, nb):
                torch.sum(x[b0:b0 + nb].square(), 2, out=out[b0:b0 + nb])
            return out
        for b in range(B):
            for r0 in range(0, R, step):
                torch.sum(x[b, r0:r0 + step].square(), 1, out=out[b, r0:r0 + step])
        return out
    step = max(1, chunk // max(1, B * C))
    if step >= R:
        return x.square().sum(1)
    acc = x[:, :step].square().sum(1)
    for r0 in range(step, R, step):
        acc += x[:, r0:r0 + step].square().sum(1)
    return acc


def _wanted(req: StatsRequest):
    return [(base, axis, quad) for base, axis, quad in ((req.row_q, 2, True), (req.row_l, 2, False),
                                                         (req.col_q, 1, True), (req.col_l, 1, False)) if base >= 0]


def _block_stats(o: torch.Tensor | None, n: torch.Tensor, a: float, want, out: torch.Tensor, R: int, C: int,
                 blk, delta: torch.Tensor | None, chunk: int = _CHUNK) -> None:
    """The slots of one block ``blk`` (``_blocks``): ``n`` its new values, ``o`` its old values (``out.dtype``,
    overwritten) or None (quantity 0 only), ``delta`` a buffer of ``>= n.numel()`` elements of ``out.dtype``
    or None.  A block's row sums go to its rows' slots (added to when the block starts after column 0),
    its column sums to its columns' slots (added to when it starts after row 0).  ``chunk``: the largest
    temporary of a column sum of squares (``_sumsq``)."""
    b0, nb, r0, nr, c0, nc = blk
    tgt = [(base + (b0 * R + r0 if axis == 2 else b0 * C + c0), axis, quad, c0 > 0 if axis == 2 else r0 > 0)
           for base, axis, quad in want]

    def put(lo, add, k, v):
        v = v.reshape(-1)
        dst = out[k, lo: lo + v.numel()]
        if add:
            dst += v
        else:
            dst.copy_(v)

    for lo, axis, quad, add in tgt:
        put(lo, add, 0, _sumsq(n, axis, chunk) if quad else n.sum(axis))
    if o is None:
        return
    for lo, axis, quad, add in tgt:  # decay: (a^2 - 1) old^2 / (a - 1) old, before old is scaled in place
        put(lo, add, 3, (a * a - 1) * _sumsq(o, axis, chunk) if quad else (a - 1) * o.sum(axis))
    if a != 1.0:
        o.mul_(a)  # a*old, rounded as the kernel rounds it
    if delta is not None and delta.numel() >= n.numel():
        d = torch.sub(n, o, out=delta[: n.numel()].view(n.shape))  # Delta
    else:
        d = n - o  # Delta
    for lo, axis, quad, add in tgt:
        if quad:
            put(lo, add, 2, _sumsq(d, axis, chunk))
        else:  # linear slots: quantity 2 stays 0
            put(lo, add, 1, d.sum(axis))
    if any(quad for _, _, quad in want):
        o.mul_(d)  # (a*old) * Delta
        for lo, axis, quad, add in tgt:
            if quad:
                put(lo, add, 1, o.sum(axis))


def stats_reference(old: torch.Tensor | None, new: torch.Tensor, a: float, req: StatsRequest,
                    out: torch.Tensor, *, consume_old: bool = False, scratch: torch.Tensor | None = None,
                    bound: int | None = None) -> None:
    """Torch twin of the statistics: writes the slots of ``req`` into ``out`` (``(NQ, slots)``, or
    ``(1, slots)`` with ``old=None``).

    ``old`` / ``new``: the tensor before / after the step (any dtype; math in ``out.dtype``).
    ``old=None``: only ``h(new)`` (quantity 0: ``new^2`` / ``new``); the drift quantities 1-3 of those
    slots are left as they are (the caller zeroes ``out``).  Only the requested slots are computed.
    The tensors go in blocks of whole rows (``_blocks``) of at most ``bound`` elements (default: the
    whole tensor for ``h(new)`` of a tensor already in ``out.dtype`` -- no temporary --, else
    ``CHUNK_MAX``), so no temporary is larger than a block; column sums add up over the blocks.
    ``consume_old``: ``old`` (in ``out.dtype``) may be overwritten (a copy the caller drops); otherwise
    each block of it is copied.  ``scratch``: a buffer of ``out.dtype`` that receives ``Delta`` (reused
    across tensors: no allocation per block when it holds one)."""
    acc = out.dtype
    B, R, C = matrix_shape(new.shape)
    if new.numel() == 0 or not req.any:
        return
    n3 = _view3(new.detach(), B, R, C)
    n3 = new.detach().reshape(B, R, C) if n3 is None else n3  # a copy only for strides no view allows
    o3 = None
    if old is not None:
        o3 = _view3(old.detach(), B, R, C)
        o3, consume_old = (old.detach().reshape(B, R, C), True) if o3 is None else (o3, consume_old)
    if bound is None:
        bound = n3.numel() if old is None and n3.dtype == acc else CHUNK_MAX
    want = _wanted(req)
    for blk in _blocks(B, R, C, bound):
        b0, nb, r0, nr, c0, nc = blk
        sl = (slice(b0, b0 + nb), slice(r0, r0 + nr), slice(c0, c0 + nc))
        o = None
        if o3 is not None:
            o = o3[sl]
            o = o.to(acc) if o.dtype != acc else (o if consume_old else o.clone())
        _block_stats(o, n3[sl].to(acc), a, want, out, R, C, blk, scratch if scratch is not None and scratch.dtype == acc else None)


@torch.no_grad()
def step_stats_reference(h: Hyper, p: torch.Tensor, grad: torch.Tensor, buf1: torch.Tensor | None,
                         buf2: torch.Tensor | None, step: float, first: bool, req: StatsRequest,
                         out: torch.Tensor | None, *, drift: bool = False, bound: int = CHUNK_MAX,
                         scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Torch twin of one tensor's fused step: ``step_reference`` on ``p`` (and its buffers, in place)
    and the slots of ``req`` in ``out`` (``stats_reference``), block by block.

    The update is elementwise, so it runs on blocks of whole rows (``_blocks``) -- views of ``p``,
    ``grad`` and the buffers -- with the very ops of the whole-tensor update: weights and buffers are
    bit for bit those of ``step_reference`` (and ``torch.optim``), and each block's statistics are
    taken while it is in cache.  Row statistics are those of the whole tensor; column statistics add
    over the blocks (fp32 rounding).
    ``drift=False``: blocks of ``CHUNK_MAX`` elements, ``h(new)`` only (quantity 0; ``out`` may have one
    row, or be None with an empty ``req``): the update's temporaries are at most those of the
    whole-tensor update.  ``drift=True`` (a drift step): blocks of at most ``bound`` elements, and with a
    non-empty ``req`` all four quantities, each block's old values copied right before its update into ``scratch[0]`` (``p.dtype``) and its
    ``Delta`` formed in ``scratch[1]`` (``out.dtype``), both of ``>= bound`` elements (allocated here when
    None): no temporary is larger than a block.  Column sums of squares square at most ``bound``
    elements at a time (both modes).  Stepped whole (its old values copied whole): a tensor whose
    strides (or whose grad's / buffers') allow no ``(B, R, C)`` view, and a bf16 / fp16 tensor whose
    blocks cannot all start at multiples of 64 elements (torch's vectorised and scalar loops round
    reduced-precision ops differently, so the blocks split where the whole tensor's vector loop does).
    ``first``: SGD's fresh momentum buffer (``step_reference``)."""
    B, R, C = matrix_shape(p.shape)
    tensors = (p, grad, buf1, buf2)
    views = [None if t is None else _view3(t, B, R, C) for t in tensors]
    blocks = bound if drift else CHUNK_MAX  # a drift step: every tensor in small blocks (its peak stays low)
    drift = drift and req.any
    # bf16 / fp16: torch's vectorised and scalar CPU loops may round differently, so blocks must split
    # where the whole tensor's vector loop does (multiples of 64 elements of memory order, which is the
    # matrix form's order only when every operand is contiguous: a transposed bf16 weight split into row
    # blocks came out 1 ulp off torch.optim) to keep its bits
    lowp = p.element_size() < 4 and p.numel() > blocks and (
        not _starts_aligned(B, R, C, blocks) or not all(t is None or t.is_contiguous() for t in tensors))
    if lowp or p.numel() == 0 or any(v is None and t is not None for v, t in zip(views, tensors)):
        old = p.detach().clone() if drift else None
        step_reference(h, [p], [grad], [buf1], [buf2], [step], first=[first])
        if req.any:
            stats_reference(old, p, h.a, req, out, consume_old=True, bound=CHUNK_MAX if drift else None)
        return
    acc = out.dtype if out is not None else p.dtype
    old_buf = delta = None
    if drift:
        if scratch is None:
            n = min(bound, p.numel())
            scratch = (torch.empty(n, dtype=p.dtype, device=p.device), torch.empty(n, dtype=acc, device=p.device))
        old_buf, delta = scratch
        delta = delta if delta.dtype == acc else None
    want = _wanted(req)
    for blk in _blocks(B, R, C, blocks):
        b0, nb, r0, nr, c0, nc = blk
        sl = (slice(b0, b0 + nb), slice(r0, r0 + nr), slice(c0, c0 + nc))
        pb, gb, m1, m2 = (None if v is None else v[sl] for v in views)
        ob = old_buf[: pb.numel()].view(pb.shape).copy_(pb) if drift else None
        step_reference(h, [pb], [gb], [m1], [m2], [step], first=[first])
        if want:
            _block_stats(None if ob is None else ob.to(acc), pb.to(acc), h.a, want, out, R, C, blk, delta,
                         min(bound, _CHUNK))


def finish_reference(stats: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Plan entries from the stats: ``vals[k, o] = sum_j coef[k, o, j] * stats[k, idx[o, j]]`` (fixed order).

    ``stats``: ``(NQ, S)``; ``idx``: ``(V, J)`` int64; ``coef``: ``(NQ, V, J)``. Returns ``(NQ, V)``.
    Deterministic on every device (a gather and a sum; ``NQ x V x J`` temporaries: ``finish_compact``
    is the low-memory CPU form)."""
    if idx.numel() == 0:
        return torch.zeros(NQ, idx.shape[0], dtype=stats.dtype, device=stats.device)
    return (coef * stats[:, idx]).sum(-1)


def compact_terms(idx: torch.Tensor, coef: torch.Tensor):
    """``(entry, slot, coef)`` of the used pairs of a padded ``(idx, coef)`` table, in ``(o, j)`` order:
    ``(P,)`` int64, ``(P,)`` int64, ``(NQ, P)``.  Compute once per plan."""
    used = (coef != 0).any(0)
    o, j = used.nonzero(as_tuple=True)
    return o, idx[o, j], coef[:, o, j]


def finish_compact(stats: torch.Tensor, entry: torch.Tensor, slot: torch.Tensor, coef: torch.Tensor, n: int):
    """``vals[k, o] = sum over pairs p with entry[p] == o of coef[k, p] * stats[k, slot[p]]``: ``(K, n)`` for
    the ``K <= NQ`` rows of ``stats`` (``coef``: ``(NQ, P)``; ``entry``/``slot``: ``(P,)`` int32/int64),
    in pair order (one sequential 1-d ``index_add_`` per row on CPU, atomics on CUDA -- use
    ``finish_reference`` there); temporaries of the size of the pairs (the fused optimizer folds each
    tensor's lines with ``fold`` instead: temporaries of one tensor's lines)."""
    out = torch.zeros(stats.shape[0], n, dtype=stats.dtype, device=stats.device)
    for k in range(stats.shape[0]):
        out[k].index_add_(0, entry, coef[k] * stats[k].index_select(0, slot))
    return out


_MAX_SEGMENTS = 8  # sign segments of a tensor's pairs; beyond: one segment with a sign per pair
_MAX_RUNS = 4  # runs of consecutive entries a sign segment is cut into; beyond: one index segment


@dataclass
class Fold:
    """How the line statistics of ONE tensor add into the plan entries (``fold``; built once per plan).

    The tensor's lines are numbered locally, quadratic ones first; its (entry, line) pairs are in
    local-line order, so the ``n_quad`` pairs reading quadratic lines are a prefix.  ``line``: ``(P,)``
    int16/int32 local line of each pair, or None when pair ``p`` reads line ``p`` (every line read
    once: no gather).  ``segments``: ``((p0, n, s, e), ...)``, the pairs cut where the sign changes
    (at most ``_MAX_SEGMENTS``; else one segment), and those into runs of consecutive entries (at most
    ``_MAX_RUNS`` per sign; else one segment): pairs ``p0 .. p0+n-1`` have the sign ``s`` (a float;
    a ``(n,)`` tensor of the statistics' dtype for the one segment of a tensor whose signs change more
    often) and add into the entries ``e`` -- an int ``e0`` for the consecutive entries ``e0 .. e0+n-1``
    (a slice addition for all the rows, no index held), else a ``(n,)`` index (int16 when the entries
    fit, widened per fold into the caller's int32 buffer).  No temporary in ``fold`` is larger than
    this tensor's pairs.  A quadratic pair's coefficients are ``(s, 2 s, s, s)``, a linear one's
    ``(s, s, 0, s)`` (module docstring)."""

    n_lines: int
    n_quad: int
    n_pairs: int
    line: torch.Tensor | None
    segments: tuple

    @property
    def n_index(self) -> int:
        """Pairs of the largest index segment (the int32 buffer ``fold`` widens it into)."""
        return max([n for _, n, _, e in self.segments if torch.is_tensor(e)] + [0])

    @staticmethod
    def build(entry: torch.Tensor, line: torch.Tensor, sign: torch.Tensor, n_quad_lines: int, n_lines: int,
              n_entries: int, acc: torch.dtype) -> "Fold":
        """From the tensor's pairs in any order (``entry``, ``line``: integer ``(P,)``; ``sign``: ``(P,)``
        floats): sorted by line (stable), cut into segments (class docstring)."""
        order = torch.sort(line, stable=True).indices
        entry, line, sign = entry[order].long(), line[order], sign[order]
        P = entry.numel()
        ident = P == n_lines and bool(torch.equal(line, torch.arange(n_lines, dtype=line.dtype, device=line.device)))
        starts = [0] + ((sign[1:] != sign[:-1]).nonzero().flatten() + 1).tolist() if P else []
        per_pair = len(starts) > _MAX_SEGMENTS
        if per_pair:
            starts = [0]
        narrow = torch.int16 if n_entries < 2 ** 15 else torch.int32 if n_entries < 2 ** 31 else torch.int64
        segs = []
        for a, b in zip(starts, starts[1:] + [P]):
            s = sign[a:b].to(acc) if per_pair else float(sign[a])
            cuts = [a] + ((entry[a + 1:b] - entry[a:b - 1] != 1).nonzero().flatten() + a + 1).tolist()
            if per_pair or len(cuts) > _MAX_RUNS:
                segs.append((a, b - a, s, entry[a:b].to(narrow)))
            else:  # runs of consecutive entries: slice additions
                segs.extend((c, d - c, s, int(entry[c])) for c, d in zip(cuts, cuts[1:] + [b]))
        return Fold(n_lines, int((line < n_quad_lines).sum()), P,
                    None if ident else line.to(torch.int16 if n_lines < 2 ** 15 else torch.int32), tuple(segs))


def fold(vals: torch.Tensor, lines: torch.Tensor, f: Fold, index: torch.Tensor | None = None) -> None:
    """``vals[k, o] += coef[k, p] * lines[k, line[p]]`` over the pairs ``p`` of one tensor (``Fold``), in
    pair order, for the ``K <= NQ`` rows of ``vals`` (``(K, entries)``) and ``lines`` (``(K, n_lines)``, this
    tensor's line statistics, quantity 2 of its linear lines 0: overwritten, a buffer the caller drops
    or reuses).  ``index``: an int32 buffer of ``>= f.n_index`` elements the int16 entries are widened
    into (None: a temporary).  Deterministic (slice additions and sequential 1-d ``index_add_`` on
    CPU, segment by segment in pair order): folding the tensors in a fixed order gives fixed bits.
    No allocation but a gather when lines are not read once each (and the widening without ``index``)."""
    if f.n_pairs == 0:
        return
    src = lines if f.line is None else lines.index_select(1, f.line.int() if f.line.dtype == torch.int16 else f.line)
    if src.shape[0] > 1 and f.n_quad:
        src[1, : f.n_quad].mul_(2)  # the first-order coefficient 2 s of a quadratic pair (exact)
    for p0, n, s, e in f.segments:
        part = src.narrow(1, p0, n)
        if torch.is_tensor(s) or s not in (1.0, -1.0):
            part.mul_(s)  # (a +-1 sign is exact as alpha: no product)
            s = 1.0
        if isinstance(e, int):
            vals.narrow(1, e, n).add_(part, alpha=s)
            continue
        if e.dtype == torch.int16:
            e = index[:n].copy_(e) if index is not None else e.int()
        for k in range(vals.shape[0]):
            vals[k].index_add_(0, e, part[k], alpha=s)


# ------------------------------------------------------------------------------------ triton
_KERNELS = None


def _kernels():
    # defined on first use (so TRITON_INTERPRET can be set before); bound as module globals because
    # @triton.jit resolves names (tl, helpers) through the module's globals
    global _KERNELS, triton, tl, _rnd, _store_rows
    if _KERNELS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _rnd(x, ref, LOWP: tl.constexpr):
            # round fp32 to the storage dtype and back (LOWP 1: bf16, 2: fp16).  bf16 rounds to nearest
            # even by bit arithmetic: the interpreter's fp32->bf16 cast truncates, the GPU's does not.
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
            # quantity q's row starts at part + q*NP: added one NP at a time to the pointer (NP is an
            # int32 argument below 2^31; 3*NP in int32 would wrap above ~715M partial entries)
            p1 = part + NP
            p2 = p1 + NP
            tl.store(part + off + r, s0, mask=mr)
            tl.store(p1 + off + r, s1, mask=mr)
            tl.store(p2 + off + r, s2, mask=mr)
            tl.store(p2 + NP + off + r, s3, mask=mr)

        @triton.jit
        def _step_kernel(base, tensors, scal, progs, part, NP,
                         neg_lr, decay, wd, a, a2m1, am1, w1, beta2, omb2, eps, momentum, omd,
                         ALGO: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                         HAS_WD: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr,
                         LOWP: tl.constexpr, STATS: tl.constexpr, COLS: tl.constexpr, LIN: tl.constexpr,
                         FP64: tl.constexpr, RB: tl.constexpr, BR: tl.constexpr, CB: tl.constexpr,
                         ALIGN: tl.constexpr):
            """COLS / LIN (constexpr, from the launch's requests): some tensor wants column stats / linear
            stats; without them their accumulators are not allocated.  ALIGN: every offset and column
            count of the launch's tensors is a multiple of it (``_launches``), so loads vectorise."""
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
            # column sums: elementwise [BR, CB] accumulators, reduced once after the loop (no
            # cross-warp reduction inside it); row sums: one warp spans a row's CB columns
            # (launch: CB = 32 lanes x one 16-byte vector), so they are warp shuffles only.
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
                            p = _rnd(p * decay, base, LOWP)
                        else:
                            g = _rnd(g + wd * p, base, LOWP)
                    ea = tl.load(base + m_off + e, mask=m, other=0.0).to(tl.float32)
                    es = tl.load(base + v_off + e, mask=m, other=0.0).to(tl.float32)
                    if w1 < 0.5:  # torch's lerp: self + w*(end-self) for w < 0.5, else end - (end-self)*(1-w)
                        ea = _rnd(ea + w1 * (g - ea), base, LOWP)
                    else:
                        ea = _rnd(g - (g - ea) * (1.0 - w1), base, LOWP)
                    es = _rnd(es * beta2, base, LOWP)
                    es = _rnd(es + omb2 * g * g, base, LOWP)
                    den = _rnd(tl.sqrt_rn(es), base, LOWP)
                    den = _rnd(tl.div_rn(den, bc2s), base, LOWP)
                    den = _rnd(den + eps, base, LOWP)
                    p = _rnd(p + step_size * tl.div_rn(ea, den), base, LOWP)
                    tl.store(base + m_off + e, ea.to(base.dtype.element_ty), mask=m)
                    tl.store(base + v_off + e, es.to(base.dtype.element_ty), mask=m)
                else:  # sgd
                    if HAS_WD:
                        g = _rnd(g + wd * p, base, LOWP)
                    if HAS_MOM:
                        buf = tl.load(base + m_off + e, mask=m, other=0.0).to(tl.float32)
                        buf = _rnd(buf * momentum, base, LOWP)
                        buf = _rnd(buf + omd * g, base, LOWP)
                        buf = tl.where(fresh != 0, g, buf)
                        tl.store(base + m_off + e, buf.to(base.dtype.element_ty), mask=m)
                        if NESTEROV:
                            g = _rnd(g + momentum * buf, base, LOWP)
                        else:
                            g = buf
                    p = _rnd(p + neg_lr * g, base, LOWP)
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
        def _finish_kernel(part, NP, stats, NS, table, BF: tl.constexpr, FP64: tl.constexpr):
            """Row ``pid0`` of ``table`` = ``[off, nrows, F, out]``: ``stats[q, out + f] = sum_i part[q, off + i*F + f]``,
            summed in float64 whatever the partials' dtype (a row of many column blocks, or a column of many
            row blocks, has thousands of partials of similar size: an fp32 running sum loses digits), rounded
            once to ``stats``' dtype; ``FP64`` is not read."""
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

        _KERNELS = (_step_kernel, _finish_kernel)
    return _KERNELS


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class _Layout:
    """Shape-only part of one launch: programs, partial offsets, finishing table (cached by the caller)."""

    progs: torch.Tensor
    progs_host: np.ndarray  # (P, 4): tensor, batch, row block, column block
    table_static: np.ndarray  # (T, 16) without the pointer columns
    finish: torch.Tensor | None
    n_part: int
    max_F: int
    RB: int
    BR: int
    CB: int
    cols: bool  # some tensor wants column stats (kernel COLS)
    lin: bool  # some tensor wants linear stats (kernel LIN)
    subsets: dict = field(default_factory=dict)  # misaligned tensor ids -> (aligned progs, other progs)


def _tiles(maxC: int, esize: int, interpret: bool) -> tuple[int, int, int]:
    """``(CB, BR, RB)``.  GPU: one warp spans ``CB = 32 x (one 16-byte vector)`` columns, so row sums are
    warp shuffles; ``BR x CB`` = 1024 = 8 elements per thread of 4 warps (80-114 registers with the
    stats on sm_90, so 4-6 programs per SM keep loads in flight; ``bench/sass.py``); ``RB`` = 256 rows
    per program.  The interpreter pays
    per program: few, large ones."""
    vec = max(1, 16 // esize)
    CB = min(_next_pow2(maxC), 128 if interpret else 32 * vec)
    if interpret:
        BR = max(1, min(64, 4096 // CB))
        return CB, BR, max(BR, 1024)
    BR = max(1, min(64, 1024 // CB))
    return CB, BR, max(BR, 256)


def _layout(shapes, reqs: Sequence[StatsRequest], fresh: Sequence[bool], device, interpret: bool,
            esize: int = 4) -> _Layout:
    mats = [matrix_shape(s) for s in shapes]
    maxC = max([C for _, _, C in mats] + [1])
    CB, BR, RB = _tiles(maxC, esize, interpret)
    progs, fin = [], []
    table = np.zeros((len(shapes), T_COLS), dtype=np.int64)
    n_part = 0
    for t, ((B, R, C), req) in enumerate(zip(mats, reqs)):
        if B * R * C == 0:
            table[t, ST.ROW_Q:ST.COL_L + 1] = -1
            continue
        ncb, nrb = -(-C // CB), -(-R // RB)
        for b in range(B):
            for rb in range(nrb):
                for cb in range(ncb):
                    progs.append(STEP_PROG.row(tensor=t, batch=b, row_block=rb, col_block=cb))
        cols = [-1, -1, -1, -1]
        for k, (slot, axis) in enumerate(((req.row_q, "r"), (req.row_l, "r"), (req.col_q, "c"), (req.col_l, "c"))):
            if slot < 0:
                continue
            cols[k] = n_part
            if axis == "r":
                fin.append(STEP_FINISH.row(off=n_part, nrows=ncb, f=B * R, out=slot))
                n_part += ncb * B * R
            else:
                for b in range(B):
                    fin.append(STEP_FINISH.row(off=n_part + b * nrb * C, nrows=nrb, f=C, out=slot + b * C))
                n_part += B * nrb * C
        table[t, ST.R:ST.FRESH + 1] = [R, C, B * R, nrb, *cols, int(bool(fresh[t])) if fresh else 0]
    ph = np.asarray(progs, dtype=np.int64).reshape(-1, STEP_PROG.COLS)
    fn = torch.as_tensor(np.asarray(fin, dtype=np.int64).reshape(-1, STEP_FINISH.COLS), device="cpu").to(device) if fin else None
    max_F = max([f[STEP_FINISH.F] for f in fin] + [1])
    return _Layout(torch.as_tensor(ph, device="cpu").to(device), ph, table, fn, n_part, max_F, RB, BR, CB,
                   cols=any(r.col_q >= 0 or r.col_l >= 0 for r in reqs),
                   lin=any(r.row_l >= 0 or r.col_l >= 0 for r in reqs))


def _launches(lay: _Layout, table: np.ndarray, base: torch.Tensor, vec: int):
    """``[(progs, ALIGN)]``: the programs of tensors whose four offsets and column count are multiples
    of ``vec`` elements (and a 16-byte aligned base) run with ``ALIGN = vec`` (16-byte vector loads);
    the others, if any, in a second launch with ``ALIGN = 1``."""
    if base.data_ptr() % 16:
        return [(lay.progs, 1)]
    bad = frozenset(int(t) for t in range(table.shape[0])
                    if np.any(table[t, ST.P_OFF:ST.V_OFF + 1] % vec) or table[t, ST.C] % vec)
    if not bad:
        return [(lay.progs, vec)]
    if bad not in lay.subsets:
        sel = np.isin(lay.progs_host[:, STEP_PROG.TENSOR], list(bad))
        dev = lay.progs.device
        lay.subsets[bad] = [(torch.as_tensor(lay.progs_host[k], device="cpu").to(dev), al)
                            for k, al in ((~sel, vec), (sel, 1)) if k.any()]
    return lay.subsets[bad]


def layout_key(params, reqs, fresh):
    return (params[0].dtype if params else None, tuple(tuple(p.shape) for p in params), tuple((r.row_q, r.row_l, r.col_q, r.col_l) for r in reqs),
            tuple(bool(f) for f in fresh))


def triton_eligible(p: torch.Tensor, others: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``p`` and its grad/states can go through the kernel: contiguous, same dtype, a float
    dtype the kernel stores (fp32/bf16/fp16)."""
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not p.is_contiguous():
        return False
    return all(o is None or (o.dtype == p.dtype and o.is_contiguous() and o.device == p.device) for o in others)


def _check_stats(stats: torch.Tensor, shapes, reqs: Sequence[StatsRequest], dev) -> None:
    """``ValueError`` naming the fix unless ``stats`` is a contiguous ``(NQ, S)`` fp32/fp64 buffer on ``dev``
    that holds every requested slot (the finishing kernel writes ``stats[k, slot + j]`` unchecked)."""
    if stats.dtype not in (torch.float32, torch.float64) or stats.dim() != 2 or stats.shape[0] != NQ \
            or not stats.is_contiguous() or stats.device != dev:
        raise ValueError(f"step_triton: stats must be a contiguous ({NQ}, S) float32/float64 tensor on {dev}, got "
                         f"{stats.dtype} {tuple(stats.shape)} on {stats.device}")
    for i, (shape, r) in enumerate(zip(shapes, reqs)):
        B, R, C = matrix_shape(shape)
        for slot, n in ((r.row_q, B * R), (r.row_l, B * R), (r.col_q, B * C), (r.col_l, B * C)):
            if slot >= 0 and slot + n > stats.shape[1]:
                raise ValueError(f"step_triton: tensor {i}'s stats slots {slot}..{slot + n} do not fit in stats of "
                                 f"{stats.shape[1]} columns; allocate ({NQ}, >= {slot + n})")


@torch.no_grad()
def step_triton(h: Hyper, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                bufs1: Sequence[torch.Tensor | None], bufs2: Sequence[torch.Tensor | None],
                steps: Sequence[float], reqs: Sequence[StatsRequest], stats: torch.Tensor | None,
                fresh: Sequence[bool] = (), cache: dict | None = None, interpret: bool = False) -> None:
    """One launch (two if some tensor's offsets are not 16-byte aligned) updating ``params`` (and states) in place; writes the requested stats slots of ``stats``.

    All tensors must pass ``triton_eligible`` and share one dtype and device (the caller groups them).
    ``stats``: ``(NQ, S)`` fp32/fp64 buffer (its dtype sets the accumulation), or None (no stats).
    ``cache``: a dict the caller keeps across steps (shape-only tables are reused).
    Raises ``RuntimeError`` for CPU tensors unless ``TRITON_INTERPRET=1`` (use the torch twin there);
    ``ValueError`` for a tensor ``triton_eligible`` refuses, a grad / state of another shape or dtype, or a
    ``stats`` buffer of the wrong dtype / shape or too small for ``reqs`` (the kernel would read or write
    out of bounds).
    """
    if not params:
        return
    dev, dt = params[0].device, params[0].dtype
    for i, p in enumerate(params):  # the kernel reads every tensor as contiguous in params[0]'s dtype
        others = [grads[i], bufs1[i] if bufs1 else None, bufs2[i] if bufs2 else None]
        if p.dtype != dt or p.device != dev or not triton_eligible(p, others) \
                or any(o is not None and tuple(o.shape) != tuple(p.shape) for o in others):
            raise ValueError(f"step_triton: tensor {i} (param {p.dtype} {tuple(p.shape)} on {p.device}) or its grad / "
                             f"states is not contiguous, of another shape, or not of params[0]'s dtype {dt} "
                             f"(fp32/bf16/fp16) on {dev}; check triton_eligible first and use step_stats_reference")
    want = stats is not None and any(r.any for r in reqs)
    if want:
        _check_stats(stats, [p.shape for p in params], reqs, dev)
    check_triton_device(dev)  # RuntimeError naming the fix, before triton is asked for a driver
    step_kernel, finish_kernel = _kernels()
    reqs = list(reqs) if want else [StatsRequest() for _ in params]
    key = layout_key(params, reqs, fresh)
    lay = cache.get(key) if cache is not None else None
    if lay is None:
        lay = _layout([p.shape for p in params], reqs, fresh, dev, interpret, params[0].element_size())
        if cache is not None:
            if len(cache) > 64:
                cache.clear()
            cache[key] = lay
    if lay.progs.shape[0] == 0:
        return
    base = params[0]
    es = base.element_size()
    b0 = base.data_ptr()
    table = lay.table_static.copy()

    def off(t):
        if t is None:
            return 0
        d = t.data_ptr() - b0
        if d % es:
            raise ValueError("tensor addresses are not aligned to the element size; use the torch backend")
        return d // es

    for i in range(len(params)):
        table[i, ST.P_OFF:ST.V_OFF + 1] = (off(params[i]), off(grads[i]), off(bufs1[i] if bufs1 else None),
                                           off(bufs2[i] if bufs2 else None))
    scal = np.zeros((len(params), STEP_SCALAR.COLS), dtype=np.float32)
    if h.algo == "adam":
        for i, s in enumerate(steps):
            scal[i] = _adam_scalars(h, s)
    pin = dev.type == "cuda"
    tab = torch.from_numpy(table)
    sc = torch.from_numpy(scal)
    if pin:
        tab, sc = tab.pin_memory().to(dev, non_blocking=True), sc.pin_memory().to(dev, non_blocking=True)
    fp64 = want and stats.dtype == torch.float64
    acc = torch.float64 if fp64 else torch.float32
    part = torch.empty(NQ, max(1, lay.n_part), device=dev, dtype=acc) if want else torch.empty(NQ, 1, device=dev, dtype=acc)
    for progs, align in _launches(lay, table, base, max(1, 16 // es)):
        step_kernel[(progs.shape[0],)](
            base, tab, sc, progs, part, part.shape[1],
            -float(h.lr), 1.0 - h.lr * h.weight_decay, float(h.weight_decay), float(h.a), h.a * h.a - 1.0,
            h.a - 1.0, 1.0 - h.beta1,
            float(h.beta2), 1.0 - h.beta2, float(h.eps), float(h.momentum), 1.0 - h.dampening,
            ALGO=0 if h.algo == "adam" else 1, DECOUPLED=bool(h.decoupled), MAXIMIZE=bool(h.maximize),
            HAS_WD=h.weight_decay != 0, HAS_MOM=h.momentum != 0, NESTEROV=bool(h.nesterov),
            LOWP={torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dt], STATS=want, COLS=want and lay.cols,
            LIN=want and lay.lin, FP64=fp64, RB=lay.RB, BR=lay.BR, CB=lay.CB, ALIGN=align,
            num_warps=4 if not interpret else 1)
    if want and lay.finish is not None:
        BF = 256 if not interpret else 64
        finish_kernel[(lay.finish.shape[0], -(-lay.max_F // BF))](part, part.shape[1], stats, stats.shape[1],
                                                                  lay.finish, BF=BF, FP64=fp64, num_warps=4)
