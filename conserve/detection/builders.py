"""Shared law builders: the catalogue's gain / unit / head-Gram / RoPE-pair / QK-norm laws from parameter
names, shapes and the output units (rows) or input features (columns) they read.

Used by the torch.nn, structural (graph) and HF detectors and by ``conserve.models``. Everything takes
weights in ``nn.Linear`` convention ``(out_features, in_features)``; ``transposed=True`` reads a weight
stored ``(in, out)`` (GPT-2 ``Conv1D``). Index lists may be any order: they are compressed into strided
``Ref`` runs (``runs``), so fused / per-head / interleaved layouts need no special code; ``lead`` indexes leading dims (the
expert of a fused ``(E, out, in)`` tensor). Math:
``shared/spec/laws.md`` (rows named per builder).
"""
from __future__ import annotations

from typing import Sequence

from ..laws import GainBalance, Law, LayerScaleBalance, QKNormGain, RopePairs, Term, cols, rows, vector
from ..laws.base import Ref



def ce_only(loss) -> str:
    """The reason an output layer's translation law is declined when the loss is not known to be softmax
    cross-entropy (spec table: "untied softmax output layer"), naming how to claim it."""
    return ("the translation law holds only for softmax cross-entropy: if the model is trained with it, pass "
            f"loss='ce' (conserve.track(opt, model, laws=conserve.detect(model, loss='ce'))) (got loss={loss!r})")

def strided(idx: Sequence[int]) -> tuple[int, int, int] | None:
    """``(start, n, step)`` when ``idx`` is an arithmetic progression with step >= 1, else None."""
    idx = list(idx)
    if not idx:
        return None
    if len(idx) == 1:
        return idx[0], 1, 1
    step = idx[1] - idx[0]
    if step < 1 or any(b - a != step for a, b in zip(idx, idx[1:])):
        return None
    return idx[0], len(idx), step


def runs(idx: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Split ``idx`` (entry e reads index idx[e]) into maximal strided runs ``(first entry, start, n, step)``."""
    out, e, idx = [], 0, list(idx)
    while e < len(idx):
        n = 1
        step = idx[e + 1] - idx[e] if e + 1 < len(idx) else 1
        if step >= 1:
            while e + n < len(idx) and idx[e + n] - idx[e + n - 1] == step:
                n += 1
        else:
            step = 1
        out.append((e, idx[e], n, step))
        e += n
    return out


def out_rows(weight: str, shape, start: int, n: int, *, step: int = 1, transposed: bool = False,
             lead: tuple = ()) -> Ref:
    """Output units ``start, start+step, ...`` (n) of a Linear-convention weight (columns when stored (in, out))."""
    if transposed:
        if step != 1:
            raise ValueError(f"{weight}: strided output units of a transposed weight are not supported")
        return cols(weight, shape, start, n, lead=lead)
    return rows(weight, shape, start, n, step=step, lead=lead)


def in_cols(weight: str, shape, start: int = 0, n: int | None = None, *, transposed: bool = False,
            lead: tuple = ()) -> Ref:
    """Input features ``start..start+n`` of a Linear-convention weight, one row each (its reader ref)."""
    n_in = shape[-2] if transposed else shape[-1]
    n = n_in - start if n is None else n
    return rows(weight, shape, start, n, lead=lead) if transposed else cols(weight, shape, start, n, lead=lead)


def gain_law(name: str, layer, weight: str, size: int, *, readers: Sequence[Ref], bias: str | None = None,
             shift: float = 0.0, note: str = "") -> GainBalance:
    """Pre-norm gain law (spec: pre-norm gain row): ``(g_c + shift)^2 + beta_c^2 - sum_M ||W_M[:,c]||^2``.

    ``weight``/``bias``: the (H,) gain and optional shift parameters; ``readers``: input-column refs of
    every linear map reading the scaled vector (``in_cols``); ``shift=1`` for gains applied as ``1 + w``."""
    return GainBalance.build(name, layer, gain=vector(weight, 0, size), beta=vector(bias, 0, size) if bias else None,
                             readers=list(readers), shift=shift, note=note)


def row_sum_law(cls, name: str, layer, weight: str, shape, n: int, *, bias: str | None = None,
                transposed: bool = False, note: str = "") -> Law:
    """Row-sum law over output units ``0..n`` (spec: untied softmax output / MoE router rows; ``cls`` =
    ``Translation`` or ``RouterSum``): ``sum_r W[r,:]`` (and ``sum_r b[r]``), a vector of in_features (+1)."""
    return cls.build(name, layer, weight=out_rows(weight, shape, 0, n, transposed=transposed),
                     bias=vector(bias, 0, n) if bias else None, note=note)


def layer_scale_law(name: str, layer, gamma: str, size: int, outputs: Sequence[tuple], note: str = ""):
    """LayerScale law (catalogue ``LayerScaleBalance``; diagonal case of the spec's deep-linear row):
    ``gamma_c^2 - sum_M (||W_M[c,:]||^2 + b_M[c]^2)`` over the maps M whose output features ``0..size`` gamma
    scales; ``outputs``: one ``(weight, shape, bias-or-None, transposed)`` per map."""
    readers = []
    for weight, shape, bias, t in outputs:
        readers.append(out_rows(weight, shape, 0, size, transposed=t))
        if bias:
            readers.append(vector(bias, 0, size))
    return LayerScaleBalance.build(name, layer, gain=vector(gamma, 0, size), readers=readers, note=note)


def _entry_terms(weight: str, shape, idx: Sequence[int], sign: float, *, bias: str | None, transposed: bool,
                 kind: str = "rows", lead: tuple = ()) -> list[Term]:
    """Norm terms reading, for entry e, row ``idx[e]`` (kind 'rows': output unit; 'cols': input feature)."""
    terms = []
    for e0, start, n, step in runs(idx):
        if kind == "rows":
            if transposed and step != 1:
                terms += [Term("norm", cols(weight, shape, start + k * step, 1, lead=lead), sign, offset=e0 + k)
                          for k in range(n)]
            else:
                terms.append(Term("norm", out_rows(weight, shape, start, n, step=step, transposed=transposed, lead=lead),
                                  sign, offset=e0))
            if bias is not None:
                terms.append(Term("norm", vector(bias, start, n, step=step, lead=lead), sign, offset=e0))
        else:
            if transposed:
                terms.append(Term("norm", rows(weight, shape, start, n, step=step, lead=lead), sign, offset=e0))
            elif step == 1:
                terms.append(Term("norm", cols(weight, shape, start, n, lead=lead), sign, offset=e0))
            else:
                terms += [Term("norm", cols(weight, shape, start + k * step, 1, lead=lead), sign, offset=e0 + k)
                          for k in range(n)]
    return terms


def unit_law(cls, name: str, layer, *, up: str, up_shape, units: Sequence[int], down: str, down_shape,
             features: Sequence[int] | None = None, up_bias: str | None = None, up_t: bool = False,
             down_t: bool = False, lead: tuple = (), note: str = "") -> Law:
    """Unit balance (spec: ReLU / SwiGLU rows; ``cls`` = ``ReLUUnit`` or ``SwiGLUUnit``): entry e reads output
    unit ``units[e]`` of ``up`` (row + bias) and input feature ``features[e]`` of ``down`` (column; default
    ``range(len(units))``): ``||W_up[u,:]||^2 + b_up[u]^2 - ||W_down[:,f]||^2``. ``lead``: the expert index
    of fused ``(E, out, in)`` up / down tensors (and ``(E, out)`` bias)."""
    features = list(range(len(units))) if features is None else list(features)
    if len(features) != len(units):
        raise ValueError(f"{name}: {len(units)} units but {len(features)} down features")
    terms = (_entry_terms(up, up_shape, units, +1.0, bias=up_bias, transposed=up_t, lead=lead)
             + _entry_terms(down, down_shape, features, -1.0, bias=None, transposed=down_t, kind="cols", lead=lead))
    return cls(name, layer, terms, len(units), note)


def block(weight: str, shape, idx: Sequence[int], *, kind: str = "rows", transposed: bool = False,
          bias: str | None = None) -> list[Ref | None] | None:
    """The D-row block (and bias block) of a head-Gram law: output units ``idx`` (kind 'rows') or input
    features ``idx`` (kind 'cols') in the order given; None when ``idx`` is not strided (no single Ref)."""
    s = strided(idx)
    if s is None:
        return None
    start, n, step = s
    if kind == "rows":
        if transposed and step != 1:
            return None
        ref = out_rows(weight, shape, start, n, step=step, transposed=transposed)
        return [ref, vector(bias, start, n, step=step) if bias else None]
    if step != 1:
        return None
    return [in_cols(weight, shape, start, n, transposed=transposed), None]


def head_gram(cls, name: str, layer, plus: Sequence[list | None], minus: Sequence[list | None], note: str = ""):
    """A head-Gram law (spec: MHA / GQA / deep-linear / partial-rotary rows; ``cls`` = ``QKGram``, ``VOGram``,
    ``RopePassGram`` or ``DeepLinearGram``) from ``block`` results; None when a block is not strided."""
    if any(b is None for b in list(plus) + list(minus)):
        return None
    return cls.build(name, layer, plus=[r for b in plus for r in b], minus=[r for b in minus for r in b], note=note)


def rope_pairs(rotary_dim: int, layout: str) -> list[tuple[int, int]]:
    """The RoPE pairs of head dims (spec: RoPE layouts): 'half' ``(p, p + R/2)`` (HF rotate_half),
    'interleaved' ``(2p, 2p + 1)``, p < R/2. ValueError for an odd ``rotary_dim`` or another layout."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim} must be even")
    half = rotary_dim // 2
    if layout == "half":
        return [(p, p + half) for p in range(half)]
    if layout == "interleaved":
        return [(2 * p, 2 * p + 1) for p in range(half)]
    raise ValueError(f"RoPE layout must be 'half' or 'interleaved', got {layout!r}")


def rope_pair_law(name: str, layer, *, q: Sequence[tuple], k: Sequence[tuple], pairs: Sequence[tuple[int, int]],
                  note: str = "") -> RopePairs:
    """RoPE pair law of one kv group (spec: RoPE rows), any layout: entry p sums over the two dims of
    ``pairs[p]`` ``sum_{i in group} ||W_q[row_i(t),:]||^2 (+b^2) - ||W_k[row_j(t),:]||^2 (-b^2)``.

    ``q``/``k``: one ``(weight, shape, bias-or-None, rows_by_dim, transposed)`` per query head of the group /
    for the kv head, ``rows_by_dim[t]`` = the weight row giving head dim t."""
    terms: list[Term] = []
    for heads, sign in ((q, +1.0), (k, -1.0)):
        for weight, shape, bias, by_dim, t in heads:
            for member in (0, 1):
                terms += _entry_terms(weight, shape, [by_dim[p[member]] for p in pairs], sign, bias=bias, transposed=t)
    return RopePairs(name, layer, terms, len(pairs), note)


def qk_norm_gain_law(name: str, layer, *, q_gain: str, k_gain: str, entries: Sequence[Sequence[int]],
                     k_entries: Sequence[Sequence[int]] | None = None, q_bias: str | None = None,
                     k_bias: str | None = None, shift: float = 0.0, note: str = "") -> QKNormGain:
    """QK-norm gain law (catalogue ``QKNormGain``): entry e sums ``g_q[t]^2 (+b_q[t]^2)`` over the q_norm gain
    indices ``entries[e]`` minus ``g_k[t]^2 (+b_k[t]^2)`` over ``k_entries[e]`` (default: the same indices).
    One dim per entry without RoPE, the rotary pair (times the group's query heads) with RoPE. ``shift=1`` for
    gains applied as ``1 + w`` (Gemma3): the terms are ``(g + shift)^2``."""
    k_entries = entries if k_entries is None else k_entries
    if len(k_entries) != len(entries):
        raise ValueError(f"{name}: {len(entries)} q entries but {len(k_entries)} k entries")
    terms: list[Term] = []
    for ents, vecs, sign in ((entries, (q_gain, q_bias), +1.0), (k_entries, (k_gain, k_bias), -1.0)):
        width = max(len(e) for e in ents)
        if any(len(e) != width for e in ents):
            raise ValueError(f"{name}: entries of different sizes")
        for m in range(width):
            idx = [e[m] for e in ents]
            for vec, sh in zip(vecs, (shift, 0.0)):
                if vec is None:
                    continue
                for e0, start, n, step in runs(idx):
                    terms.append(Term("norm", vector(vec, start, n, step=step), sign, offset=e0, shift=sh))
    return QKNormGain(name, layer, terms, len(entries), note)
