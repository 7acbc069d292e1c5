"""The torch twin of the fused optimizer step: the update op by op as ``torch.optim`` does it, and the
step statistics with torch reductions (the quantities and the matrix form: ``optim_step``).

``step_reference`` is ``torch.optim``'s ``_single_tensor_adam`` / ``_single_tensor_sgd`` (on CPU the
``foreach`` path runs the same ops); ``stats_reference`` the statistics of one tensor from its old and
new values; ``step_stats_reference`` both on blocks of whole rows (the update is elementwise: the same
bits), so a drift step's old copy and ``Delta`` are block-sized.  ``Hyper`` and ``StatsRequest`` are
the arguments of both paths (``step_runner.step_triton`` too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["Hyper", "StatsRequest", "matrix_shape", "adam_scalars", "step_reference", "stats_reference",
           "step_stats_reference", "chunk_bound", "NQ", "CHUNK_MAX", "CHUNK_MIN"]

NQ = 4  # quantities per stats slot


def matrix_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(B, R, C)`` of the matrix form of a tensor of ``shape`` (``optim_step``)."""
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


def adam_scalars(h: Hyper, step: float) -> tuple[float, float]:
    """``(step_size, sqrt(bias_correction2))`` of Adam at ``step`` (the count after its increment),
    exactly as torch computes them (python doubles)."""
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
            step_size, bc2s = adam_scalars(h, steps[i])
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
# cache, while the fixed Python cost of the ~20 ops per block stays small next to its arithmetic), at
# least CHUNK_MIN (that cost bounded on small models), and at most a quarter of the largest tracked
# tensor (``chunk_bound``): the four block-sized buffers then stay within the two weight-sized
# temporaries (``exp_avg_sq.sqrt() / bc2``) that torch's own AdamW step makes for that tensor
# (bench/NOTES.md, "optim_step").
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
    # blocks comes out 1 ulp off torch.optim) to keep its bits
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
