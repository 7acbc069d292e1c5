"""Reading attention heads off exact maps of the graph: which rows of a projection form head i, dim d, and which
dims a rotary embedding turns together.

Maps come from ``Graph.clean_map`` / ``linear_map`` (``{row: {flat index of dst: coefficient}}``) into a tensor
``(leads..., a, b)`` whose feature dim is the last (``contract_last``) or the second-last (a key stored ``K^T``).
"""
from __future__ import annotations

import torch

from ...laws.tolerance import PROBE_NONZERO
from ..fxgraph import Graph, with_strides_of

__all__ = ["heads_of", "by_head", "partners"]


def heads_of(m: dict, shape: tuple, contract_last: bool):
    """From ``linear_map`` output {r: {flat: c}} into a tensor of ``shape`` (leads..., a, b), the clean map
    {(lead, pos, d): r} with the feature dim d = last (contract_last) or second-last; None if not clean."""
    a, b = shape[-2], shape[-1]
    clean = {}
    for r, nz in m.items():
        for flat in nz:  # one row may feed several heads (GQA repeat / expand); one entry reads one row
            lead, rest = divmod(flat, a * b)
            i, j = divmod(rest, b)
            key = (lead, i, j) if contract_last else (lead, j, i)
            if key in clean:
                return None
            clean[key] = r
    return clean


def by_head(clean: dict, d: int) -> dict | None:
    """{lead: [row for dim 0..d-1]} at a single position; None when incomplete."""
    out: dict = {}
    poss = {k[1] for k in clean}
    if len(poss) != 1:
        return None
    for (lead, _, dim), r in clean.items():
        out.setdefault(lead, [None] * d)[dim] = r
    if any(None in v for v in out.values()):
        return None
    return dict(sorted(out.items()))


def partners(g: Graph, src, dst, shape, contract_last, rows_by_head: dict, leads) -> dict | None:
    """RoPE pairing {d: d'} seen at other positions (dims rotated together), {} when none. One run per head dim
    and lead: the rows of dim t of every head are set at once; the dims they reach are t and its partner."""
    a, b = shape[-2], shape[-1]
    sv = g.env[src]
    n = sv.shape[-1]
    by_dim: dict = {}
    for rows_ in rows_by_head.values():
        for dim, r in enumerate(rows_):
            if r is not None:  # a dim not from ``src`` (an MLA key's no-RoPE dims, from another projection)
                by_dim.setdefault(dim, set()).add(r)
    partner: dict = {}
    seen_leads = 0
    for k in leads:
        if k >= sv.numel() // n:
            break
        before = dict(partner)
        for dim, rs in by_dim.items():
            e = torch.zeros(sv.shape, dtype=sv.dtype)
            e.view(-1, n)[k, sorted(rs)] = 1.0
            try:
                y = g.run({src: with_strides_of(sv, e)}, [dst])[0]
            except Exception:  # noqa: BLE001
                return None
            if not isinstance(y, torch.Tensor) or y.is_complex() or not torch.isfinite(y).all():
                return None
            y = y.reshape(-1)
            sc = float(y.abs().max()) if y.numel() else 0.0
            if sc == 0:
                continue
            for flat in (y.abs() > PROBE_NONZERO * sc).nonzero().flatten().tolist():
                _, rest = divmod(flat, a * b)
                i, j = divmod(rest, b)
                other = j if contract_last else i
                if other != dim:
                    if partner.get(dim, other) != other:
                        return None
                    partner[dim] = other
        if partner:
            seen_leads += 1
            if seen_leads >= 2 and partner == before:
                break  # two rotated positions agree: the pairing is complete
    if any(partner.get(v) != k for k, v in partner.items()):
        return None
    return partner
