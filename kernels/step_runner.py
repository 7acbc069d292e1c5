"""Host side of the fused optimizer step on the Triton path: ``step_triton`` checks its arguments, binds
the tensors to a launch layout, allocates the partial sums and launches ``step.step_kernel`` (once per
(group, dtype); twice when some tensor is not 16-byte aligned) and ``step.finish_kernel``.

A *layout* (``_Layout``, built by ``_layout``) is the shape-only part of a launch: the program table
(``tables.STEP_PROG``), the tensor table without its offsets (``tables.STEP_TENSOR``), the finishing
table (``tables.STEP_FINISH``) and the tiles.  It depends on the dtype, the shapes, the requests and
SGD's fresh buffers (``layout_key``), so an optimizer keeps its layouts across steps (``cache``,
``cache.KeyedCache``); each step writes the tensors' element offsets from ``params[0]`` into a copy of
the tensor table, and the per-tensor Adam scalars into ``tables.STEP_SCALAR``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .cache import KeyedCache
from .config import check_triton_device
from .step_twin import NQ, Hyper, StatsRequest, adam_scalars, matrix_shape
from .tables import STEP_FINISH, STEP_PROG, STEP_SCALAR
from .tables import STEP_TENSOR as ST

__all__ = ["step_triton", "triton_eligible", "layout_key", "LAYOUTS_MAX"]

LAYOUTS_MAX = 64  # layouts kept in a ``cache`` of ``step_triton`` (the least recently used evicted first)
_LOWP = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's storage rounding (LOWP)


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
    warp shuffles; ``BR x CB`` = 1024 = 8 elements per thread of 4 warps, so several programs per SM
    keep loads in flight (register use: ``bench/sass.py``); ``RB`` = 256 rows per program.  The
    interpreter pays per program: few, large ones."""
    vec = max(1, 16 // esize)
    CB = min(_next_pow2(maxC), 128 if interpret else 32 * vec)
    if interpret:
        BR = max(1, min(64, 4096 // CB))
        return CB, BR, max(BR, 1024)
    BR = max(1, min(64, 1024 // CB))
    return CB, BR, max(BR, 256)


def _layout(shapes, reqs: Sequence[StatsRequest], fresh: Sequence[bool], device, interpret: bool,
            esize: int = 4) -> _Layout:
    """The layout of tensors of ``shapes`` (element size ``esize``) with these requests: a program per
    (tensor, batch entry, row block, column block); per requested slot kind, its partials' offset in
    the tensor table and its finishing rows."""
    mats = [matrix_shape(s) for s in shapes]
    maxC = max([C for _, _, C in mats] + [1])
    CB, BR, RB = _tiles(maxC, esize, interpret)
    progs, fin = [], []
    table = np.zeros((len(shapes), ST.COLS), dtype=np.int64)
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
    """What a layout depends on: the dtype, the shapes, the requested slots, SGD's fresh buffers."""
    return (params[0].dtype if params else None, tuple(tuple(p.shape) for p in params), tuple((r.row_q, r.row_l, r.col_q, r.col_l) for r in reqs),
            tuple(bool(f) for f in fresh))


def _cached_layout(cache, params, reqs, fresh, interpret: bool) -> _Layout:
    """The layout of this launch, from ``cache`` (a ``KeyedCache``, or a dict held as one of
    ``LAYOUTS_MAX`` entries) when given."""
    def build():
        shapes = [p.shape for p in params]
        return _layout(shapes, reqs, fresh, params[0].device, interpret, params[0].element_size())

    if cache is None:
        return build()
    if not isinstance(cache, KeyedCache):
        cache = KeyedCache(LAYOUTS_MAX, store=cache)
    return cache.cached(layout_key(params, reqs, fresh), build)


def triton_eligible(p: torch.Tensor, others: Sequence[torch.Tensor | None]) -> bool:
    """Whether ``p`` and its grad/states can go through the kernel: contiguous, same dtype, a float
    dtype the kernel stores (fp32/bf16/fp16)."""
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not p.is_contiguous():
        return False
    return all(o is None or (o.dtype == p.dtype and o.is_contiguous() and o.device == p.device) for o in others)


def _check_tensors(params, grads, bufs1, bufs2) -> None:
    """``ValueError`` unless every tensor is ``triton_eligible`` in ``params[0]``'s dtype and device, with
    a grad and states of its shape (the kernel reads them all as contiguous in that dtype)."""
    dev, dt = params[0].device, params[0].dtype
    for i, p in enumerate(params):
        others = [grads[i], bufs1[i] if bufs1 else None, bufs2[i] if bufs2 else None]
        if p.dtype != dt or p.device != dev or not triton_eligible(p, others) \
                or any(o is not None and tuple(o.shape) != tuple(p.shape) for o in others):
            raise ValueError(f"step_triton: tensor {i} (param {p.dtype} {tuple(p.shape)} on {p.device}) or its grad / "
                             f"states is not contiguous, of another shape, or not of params[0]'s dtype {dt} "
                             f"(fp32/bf16/fp16) on {dev}; check triton_eligible first and use step_stats_reference")


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


def _bind(lay: _Layout, h: Hyper, params, grads, bufs1, bufs2, steps) -> tuple[np.ndarray, np.ndarray]:
    """``(tensor table, scalars)`` of this step: the layout's tensor table with the element offsets of
    each param, grad and state from ``params[0]`` (0 for an absent state), and the per-tensor Adam
    scalars (fp32; zeros for SGD)."""
    b0, es = params[0].data_ptr(), params[0].element_size()

    def off(t):
        if t is None:
            return 0
        d = t.data_ptr() - b0
        if d % es:
            raise ValueError("tensor addresses are not aligned to the element size; use the torch backend")
        return d // es

    table = lay.table_static.copy()
    for i in range(len(params)):
        table[i, ST.P_OFF:ST.V_OFF + 1] = (off(params[i]), off(grads[i]), off(bufs1[i] if bufs1 else None),
                                           off(bufs2[i] if bufs2 else None))
    scal = np.zeros((len(params), STEP_SCALAR.COLS), dtype=np.float32)
    if h.algo == "adam":
        for i, s in enumerate(steps):
            scal[i] = adam_scalars(h, s)
    return table, scal


def _hyper(h: Hyper) -> dict:
    """The kernel's hyper-parameter arguments (python floats: fp32 arguments on a GPU)."""
    return dict(neg_lr=-float(h.lr), decay=1.0 - h.lr * h.weight_decay, wd=float(h.weight_decay),
                a=float(h.a), a2m1=h.a * h.a - 1.0, am1=h.a - 1.0,
                w1=1.0 - h.beta1, beta2=float(h.beta2), omb2=1.0 - h.beta2, eps=float(h.eps),
                momentum=float(h.momentum), omd=1.0 - h.dampening)


def _update_switches(h: Hyper, dtype: torch.dtype) -> dict:
    """The kernel's meta-parameters of the update."""
    return dict(ALGO=0 if h.algo == "adam" else 1, DECOUPLED=bool(h.decoupled), MAXIMIZE=bool(h.maximize),
                HAS_WD=h.weight_decay != 0, HAS_MOM=h.momentum != 0, NESTEROV=bool(h.nesterov), LOWP=_LOWP[dtype])


@torch.no_grad()
def step_triton(h: Hyper, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                bufs1: Sequence[torch.Tensor | None], bufs2: Sequence[torch.Tensor | None],
                steps: Sequence[float], reqs: Sequence[StatsRequest], stats: torch.Tensor | None,
                fresh: Sequence[bool] = (), cache: KeyedCache | dict | None = None, interpret: bool = False) -> None:
    """Update ``params`` (and states) in place and write the requested stats slots of ``stats``: one
    launch of the step kernel (two if some tensor's offsets are not 16-byte aligned) and one of the
    finishing kernel.

    All tensors must pass ``triton_eligible`` and share one dtype and device (the caller groups them).
    ``bufs1`` / ``bufs2`` / ``steps`` / ``fresh``: as ``step_twin.step_reference``'s ``bufs1`` / ``bufs2`` /
    ``steps`` / ``first``.  ``stats``: ``(NQ, S)`` fp32/fp64 buffer (its dtype sets the accumulation), or
    None (no stats).  ``cache``: a ``KeyedCache`` or a dict the caller keeps across steps (the layouts are
    reused, at most ``LAYOUTS_MAX`` in a dict).  ``interpret``: the interpreter's tiles.
    Raises ``RuntimeError`` for CPU tensors unless ``TRITON_INTERPRET=1`` (use the torch twin there);
    ``ValueError`` for a tensor ``triton_eligible`` refuses, a grad / state of another shape or dtype, or a
    ``stats`` buffer of the wrong dtype / shape or too small for ``reqs`` (the kernel would read or write
    out of bounds).
    """
    if not params:
        return
    # check
    _check_tensors(params, grads, bufs1, bufs2)
    dev, base = params[0].device, params[0]
    want = stats is not None and any(r.any for r in reqs)
    if want:
        _check_stats(stats, [p.shape for p in params], reqs, dev)
    check_triton_device(dev)  # RuntimeError naming the fix, before triton is asked for a driver
    from .step import finish_kernel, step_kernel

    reqs = list(reqs) if want else [StatsRequest() for _ in params]
    lay = _cached_layout(cache, params, reqs, fresh, interpret)
    if lay.progs.shape[0] == 0:
        return
    # allocate: the tables of this step, the partial sums
    table, scal = _bind(lay, h, params, grads, bufs1, bufs2, steps)
    tab, sc = torch.from_numpy(table), torch.from_numpy(scal)
    if dev.type == "cuda":
        tab, sc = tab.pin_memory().to(dev, non_blocking=True), sc.pin_memory().to(dev, non_blocking=True)
    fp64 = want and stats.dtype == torch.float64
    acc = torch.float64 if fp64 else torch.float32
    part = torch.empty(NQ, max(1, lay.n_part) if want else 1, device=dev, dtype=acc)
    # launch
    hyper, update = _hyper(h), _update_switches(h, base.dtype)
    for progs, align in _launches(lay, table, base, max(1, 16 // base.element_size())):
        step_kernel[(progs.shape[0],)](
            base, tab, sc, progs, part,  # pointers
            part.shape[1],  # sizes
            **hyper, **update,  # hyper-parameters, meta-parameters of the update
            STATS=want, COLS=want and lay.cols, LIN=want and lay.lin, FP64=fp64,  # of the statistics
            RB=lay.RB, BR=lay.BR, CB=lay.CB, ALIGN=align,  # of the tiles
            num_warps=4 if not interpret else 1)
    if want and lay.finish is not None:
        BF = 256 if not interpret else 64
        finish_kernel[(lay.finish.shape[0], -(-lay.max_F // BF))](part, part.shape[1], stats, stats.shape[1],
                                                                  lay.finish, BF=BF, FP64=fp64, num_warps=4)
