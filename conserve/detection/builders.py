"""Shared law builders: the catalogue's gain / unit / head-Gram / RoPE-pair / QK-norm laws from parameter
names, shapes and the output units (rows) or input features (columns) they read.

Used by the torch.nn, structural (graph) and HF detectors and by ``conserve.models``. Everything takes
weights in ``nn.Linear`` convention ``(out_features, in_features)``; ``transposed=True`` reads a weight
stored ``(in, out)`` (GPT-2 ``Conv1D``). Index lists may be any order: they are compressed into strided
``Ref`` runs (``runs``), so fused / per-head / interleaved layouts need no special code; ``lead`` indexes leading dims (the
expert of a fused ``(E, out, in)`` tensor). Convolutions: ``ChannelMap`` (a Linear / ConvNd / ConvTransposeNd read
per channel, groups included) and the per-channel builders ``channel_unit_law``, ``channel_gram_law``,
``channel_gain_law``, ``channel_scale_law`` (``docs/laws.md``, "Convolutions"). Math: ``shared/spec/laws.md`` (rows
named per builder) and ``docs/laws.md`` (the laws this project derived).
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
                 kind: str = "rows", lead: tuple = (), bias_at: tuple | None = None) -> list[Term]:
    """Norm terms reading, for entry e, row ``idx[e]`` (kind 'rows': output unit; 'cols': input feature).
    ``bias_at = (bias indices, bias lead)`` where the bias is not indexed like the weight's rows (heads stored
    ``[H, ...]`` with one bias vector of all heads' units)."""
    terms = []
    if bias is not None and bias_at is not None:
        bidx, blead = bias_at
        terms += [Term("norm", vector(bias, start, n, step=step, lead=blead), sign, offset=e0)
                  for e0, start, n, step in runs(bidx)]
        bias = None
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
             down_t: bool = False, lead: tuple = (), degree: float = 1.0, note: str = "") -> Law:
    """Unit balance (spec: ReLU / SwiGLU rows; ``cls`` = ``ReLUUnit``, ``SwiGLUUnit`` or ``ReLUPowerUnit``): entry e
    reads output unit ``units[e]`` of ``up`` (row + bias) and input feature ``features[e]`` of ``down`` (column;
    default ``range(len(units))``): ``||W_up[u,:]||^2 + b_up[u]^2 - k ||W_down[:,f]||^2`` with ``k = degree``, the
    activation's degree of homogeneity (1 but for ``ReLUPowerUnit``). ``lead``: the expert index of fused
    ``(E, out, in)`` up / down tensors (and ``(E, out)`` bias)."""
    features = list(range(len(units))) if features is None else list(features)
    if len(features) != len(units):
        raise ValueError(f"{name}: {len(units)} units but {len(features)} down features")
    terms = (_entry_terms(up, up_shape, units, +1.0, bias=up_bias, transposed=up_t, lead=lead)
             + _entry_terms(down, down_shape, features, -float(degree), bias=None, transposed=down_t, kind="cols",
                            lead=lead))
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
    for the kv head, ``rows_by_dim[t]`` = the weight row giving head dim t; for heads stored as a ``[H, ...]``
    parameter, three more items: the head's lead ``(h,)``, the bias entries by dim and the bias lead."""
    terms: list[Term] = []
    for heads, sign in ((q, +1.0), (k, -1.0)):
        for weight, shape, bias, by_dim, t, *head in heads:
            lead, bias_by_dim, bias_lead = head or ((), None, ())
            for member in (0, 1):
                at = [p[member] for p in pairs]
                terms += _entry_terms(weight, shape, [by_dim[a] for a in at], sign, bias=bias, transposed=t,
                                      lead=lead, bias_at=None if bias_by_dim is None
                                      else ([bias_by_dim[a] for a in at], bias_lead))
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


# ------------------------------------------------------------------------------------ channels (conv)
# A channel of a convolution is a whole slice of its kernel (``W[c]`` of shape ``(in/groups, *k)``, or
# ``W[:, c]``), which no single 2-D ``Ref`` holds. A law of channels is therefore written as *pieces*:
# ``(first entry, Ref)`` pairs whose rows walk the channel dimension (one row per channel) and whose columns
# walk one other dimension; the remaining dimensions are enumerated, one piece each. The norm terms of all
# pieces of one channel add up to ``||W[c]||^2``; their Gram terms add up to the channel Gram ``W_(c) W_(c)^T``
# (the kernel flattened per channel). The column dimension is the largest one, so a 3x3 kernel costs 9
# pieces (one per kernel position) and a 1x1 kernel or an ``nn.Linear`` one.
Piece = tuple  # (first law entry, Ref)


def _slices(param: str, shape, ch_dim: int, start: int, n: int, *, step: int = 1, entry: int = 0,
            ranges: dict | None = None) -> list:
    """Pieces reading channels ``start, start+step, ...`` (n) along ``ch_dim`` of ``param``, every other
    dimension over ``ranges[d] = (lo, hi)`` (default: all of it)."""
    import itertools

    shape = tuple(shape)
    if n <= 0:
        return []
    others = [d for d in range(len(shape)) if d != ch_dim]
    if not others:  # a vector: a bias or a per-channel gain
        return [(entry, Ref(param, (start,), 0, n, None, 1, step))]
    span = {d: (ranges or {}).get(d, (0, shape[d])) for d in others}
    col = max(others, key=lambda d: (span[d][1] - span[d][0], d))  # the largest; ties: the innermost (stride 1)
    rest = [d for d in others if d != col]
    out = []
    for idx in itertools.product(*(range(*span[d]) for d in rest)):
        at = [0] * len(shape)
        at[ch_dim], at[col] = start, span[col][0]
        for d, i in zip(rest, idx):
            at[d] = i
        out.append((entry, Ref(param, tuple(at), ch_dim, n, col, span[col][1] - span[col][0], step)))
    return out


class ChannelMap:
    """A linear map read per channel: ``nn.Linear`` (weight ``(out, in)``), ``nn.Conv1d/2d/3d`` (weight
    ``(out, in/groups, *kernel)``) or ``nn.ConvTranspose1d/2d/3d`` (weight ``(in, out/groups, *kernel)``), with
    an optional bias ``(out,)``. Output channel ``c`` of a conv is every weight entry that writes it (its
    kernel slice); input channel ``c`` is every entry that reads it (with ``groups``, only the output channels
    of its group). ``per`` (``in_pieces``): an ``nn.Linear`` reading ``C`` channels flattened from
    ``(C, *spatial)`` (``nn.Flatten()`` after a conv) reads channel ``c`` at features ``c*per .. (c+1)*per``.

    Used by the torch.nn detector (``nn.Sequential`` CNNs), the LoRA detector (conv adapters) and open to the
    structural detector (convs in custom forward code): build one with ``ChannelMap.of(path, module)`` or
    directly from names and shapes, then ``channel_unit_law`` / ``channel_gram_law`` / ``channel_gain_law`` /
    ``channel_scale_law``. Math: ``docs/laws.md``, "Convolutions"."""

    def __init__(self, weight: str, shape, bias: str | None = None, *, groups: int = 1, transposed: bool = False):
        self.weight, self.shape, self.bias = weight, tuple(shape), bias
        self.groups, self.transposed = int(groups), bool(transposed)
        if len(self.shape) < 2:
            raise ValueError(f"{weight}: a channel map needs a weight with >= 2 dims, got shape {self.shape}")

    @classmethod
    def of(cls, path: str, module) -> "ChannelMap":
        """The map of an ``nn.Linear`` / ``nn.ConvNd`` / ``nn.ConvTransposeNd`` at module path ``path``."""
        from torch import nn

        pre = f"{path}." if path else ""
        bias = f"{pre}bias" if getattr(module, "bias", None) is not None else None
        if isinstance(module, nn.Linear):
            return cls(f"{pre}weight", module.weight.shape, bias)
        if isinstance(module, nn.modules.conv._ConvNd):
            return cls(f"{pre}weight", module.weight.shape, bias, groups=module.groups, transposed=module.transposed)
        raise TypeError(f"{path}: {type(module).__name__} is not an nn.Linear or convolution")

    def __repr__(self) -> str:
        return (f"ChannelMap({self.weight!r}, {self.shape}, bias={self.bias!r}, groups={self.groups}, "
                f"transposed={self.transposed})")

    @property
    def conv(self) -> bool:
        return len(self.shape) > 2

    @property
    def out_channels(self) -> int:
        return self.shape[1] * self.groups if self.transposed else self.shape[0]

    @property
    def in_channels(self) -> int:
        return self.shape[0] if self.transposed else self.shape[1] * self.groups

    def _grouped(self, full_dim: int, start: int, n: int) -> list:
        """Pieces of channels on the grouped side (dim ``1 - full_dim`` is the channel dim, size C/groups)."""
        ch_dim = 1 - full_dim
        per_group_ch, per_group_full = self.shape[ch_dim], self.shape[full_dim] // self.groups
        out, c = [], start
        while c < start + n:
            g, local = divmod(c, per_group_ch)
            m = min(per_group_ch - local, start + n - c)
            out += _slices(self.weight, self.shape, ch_dim, local, m, entry=c - start,
                           ranges={full_dim: (g * per_group_full, (g + 1) * per_group_full)})
            c += m
        return out

    def out_pieces(self, start: int = 0, n: int | None = None, *, with_bias: bool = True) -> list:
        """Pieces of output channels ``start .. start+n`` (entry 0 = channel ``start``), and the bias."""
        n = self.out_channels - start if n is None else n
        if self.transposed:
            out = self._grouped(0, start, n)
        else:
            out = _slices(self.weight, self.shape, 0, start, n)
        if with_bias and self.bias:
            out.append((0, vector(self.bias, start, n)))
        return out

    def in_pieces(self, start: int = 0, n: int | None = None, *, per: int = 1) -> list:
        """Pieces of input channels ``start .. start+n`` (entry 0 = channel ``start``); ``per`` > 1: an
        ``nn.Linear`` reading channel ``c`` at features ``c*per + j``, j < per (a flattened ``(C, *spatial)``)."""
        if per != 1:
            if self.conv or self.transposed:
                raise ValueError(f"{self.weight}: per={per} is for an nn.Linear reading flattened channels")
            n = self.shape[1] // per - start if n is None else n
            return [x for j in range(per) for x in _slices(self.weight, self.shape, 1, start * per + j, n, step=per)]
        n = self.in_channels - start if n is None else n
        if self.transposed:
            return _slices(self.weight, self.shape, 0, start, n)
        if self.groups == 1:
            return _slices(self.weight, self.shape, 1, start, n)
        return self._grouped(0, start, n)


def _channel_terms(pieces: Sequence, sign: float) -> list[Term]:
    return [Term("norm", ref, sign, offset=e) for e, ref in pieces]


def channel_unit_law(cls, name: str, layer, up: ChannelMap, down: ChannelMap, *, per: int = 1,
                     note: str = "") -> Law:
    """Per-channel balance (docs/laws.md: Conv-ReLU-Conv; ``cls`` = ``ReLUUnit``): channel ``c`` written by
    ``up`` (kernel slice ``W_up[c]`` and bias ``b_up[c]``) and read by ``down`` (``W_down[:, c]``, or its
    group's rows; ``per`` features of a flattened channel for an ``nn.Linear``):
    ``||W_up[c]||^2 + b_up[c]^2 - ||W_down[:, c]||^2``, one entry per channel. Symmetry: channel c scaled by
    ``s > 0`` in ``up``, by ``1/s`` in ``down`` (passes ReLU / leaky ReLU / max-pool / dropout)."""
    n = up.out_channels
    if down.in_channels != n * per:
        raise ValueError(f"{name}: {up.weight} writes {n} channels but {down.weight} reads {down.in_channels}"
                         + (f" (= {n} x {per} expected)" if per != 1 else ""))
    terms = _channel_terms(up.out_pieces(), +1.0) + _channel_terms(down.in_pieces(per=per), -1.0)
    return cls(name, layer, terms, n, note)


def channel_gram_law(cls, name: str, layer, up: ChannelMap, down: ChannelMap, *, per: int = 1,
                     note: str = "") -> Law | None:
    """Channel Gram (spec: deep linear row; docs/laws.md: Channel Gram; ``cls`` = ``DeepLinearGram``) of two maps with only
    maps that act the same on every channel between them (identity, average pooling, zero padding,
    upsampling, flatten): ``W_up W_up^T + b b^T - W_down^T W_down`` over channels (kernels flattened per
    channel; C x C). Symmetry: GL(C) mixing the channels. None when a grouped conv splits the channels (only
    the per-channel law then holds: ``channel_unit_law``)."""
    ups, downs = up.out_pieces(), down.in_pieces(per=per)
    n = up.out_channels
    if any(e != 0 or r.rows != n for e, r in ups + downs):
        return None
    return cls.build(name, layer, plus=[r for _, r in ups], minus=[r for _, r in downs], note=note)


def channel_gain_law(name: str, layer, gain: str, gain_shape, readers: Sequence[tuple], *, bias: str | None = None,
                     shift: float = 0.0, note: str = "") -> GainBalance:
    """Gain law of a per-channel affine norm (docs/laws.md: Norm gains; BatchNorm / GroupNorm /
    InstanceNorm ``(C,)`` gains, a LayerNorm ``(C, *spatial)`` gain summed over its positions):
    ``sum_pos (g[c,pos] + shift)^2 + beta[c,pos]^2 - sum_M ||W_M[:, c]||^2``. ``readers``: one
    ``(ChannelMap, per)`` per map reading the (rescaled) norm output."""
    n = gain_shape[0]
    terms = [Term("norm", r, +1.0, offset=e, shift=shift) for e, r in _slices(gain, gain_shape, 0, 0, n)]
    if bias:
        terms += _channel_terms(_slices(bias, gain_shape, 0, 0, n), +1.0)
    for m, per in readers:
        if m.in_channels != n * per:
            raise ValueError(f"{name}: {m.weight} reads {m.in_channels} features, not {n} channels x {per}")
        terms += _channel_terms(m.in_pieces(per=per), -1.0)
    return GainBalance(name, layer, terms, n, note)


def channel_layer_scale_law(name: str, layer, gamma: str, writer: ChannelMap, *, note: str = "") -> Law:
    """LayerScale of a convolution's output channels (catalogue ``LayerScaleBalance``; ConvNeXt's
    ``gamma.reshape(1, -1, 1, 1) * conv(x)``): ``gamma_c^2 - ||W[c]||^2 - b[c]^2`` per output channel ``c``, the
    kernel slice ``W[c]`` writing it. Symmetry: ``gamma_c -> s gamma_c``, ``W[c], b[c] -> / s``."""
    n = writer.out_channels
    terms = [Term("norm", vector(gamma, 0, n), +1.0)] + _channel_terms(writer.out_pieces(0, n), -1.0)
    return LayerScaleBalance(name, layer, terms, n, note)


def channel_scale_law(name: str, layer, up: ChannelMap, groups: Sequence[Sequence[int]], *, note: str = ""):
    """Scale law of a map whose output is normalised group by group (docs/laws.md: Conv before a norm;
    ``NormScaleLaw``): entry g is ``sum_{c in groups[g]} ||W_up[c]||^2 + b_up[c]^2`` (GroupNorm: its groups,
    InstanceNorm: one channel each, LayerNorm over ``(C, *spatial)``: all channels). Exact only for a norm
    with eps = 0."""
    from ..laws import NormScaleLaw

    terms = []
    for g, chans in enumerate(groups):
        for _, start, n, step in runs(list(chans)):
            if step != 1:
                terms += [Term("norm", r, +1.0, offset=g, stride=0) for c in range(start, start + n * step, step)
                          for _, r in up.out_pieces(c, 1)]
            else:
                terms += [Term("norm", r, +1.0, offset=g, stride=0) for _, r in up.out_pieces(start, n)]
    return NormScaleLaw(name, layer, terms, len(groups), note)
