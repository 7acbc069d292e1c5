"""The finish of the fused optimizer step: the line statistics of a group of tensors (row / column sums
of the four quantities, ``optim_step``) added into the law plan's entries.

``finish_reference`` / ``finish_compact``: from padded ``(entry, J)`` tables of (slot, coefficient)
pairs.  ``Fold`` / ``fold``: one tensor's lines added into the entries it feeds (slice additions for
runs of consecutive entries, else index additions), the coefficients rebuilt from one sign per
segment (or per pair).  A quadratic pair's coefficients are ``(s, 2 s, s, s)``: the factor 2 of the
first-order term ``2 sum s a old Delta`` is applied here (``fold``) and in the caller's padded tables,
not in the statistics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import FIRST_ORDER
from .step_twin import NQ

__all__ = ["finish_reference", "compact_terms", "finish_compact", "Fold", "fold"]


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
    ``(s, s, 0, s)`` (``optim_step``)."""

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
        src[1, : f.n_quad].mul_(FIRST_ORDER)  # the first-order coefficient 2 s of a quadratic pair (exact)
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
