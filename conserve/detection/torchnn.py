"""Detector for generic ``torch.nn`` structures (spec ``shared/spec/laws.md``, catalogue rows named below).

Recognised anywhere in a model (by module type, never by name):

* ``nn.MultiheadAttention``: QK and VO Gram laws per head (spec: MHA rows), for the fused
  ``in_proj_weight`` (3E, E) = [W_q | W_k | W_v] rows and for separate ``q/k/v_proj_weight`` (``kdim``/``vdim``);
  ``in_proj_bias`` enters each head's Gram; ``add_bias_kv`` keys/values (``bias_k``/``bias_v``, (1, 1, E))
  are extra key/value rows acted on by the same GL(D), so they enter the same laws. ``out_proj`` columns
  ``[i*D, (i+1)*D)`` are O_i.
* ``nn.TransformerEncoderLayer``: its attention as above; ``norm_first=True`` (pre-LN): gain laws of
  ``norm1`` (readers: ``in_proj_weight`` columns) and ``norm2`` (readers: ``linear1`` columns), with
  ``beta_c^2`` for LayerNorm biases (spec: pre-norm gain row); ``norm_first=False`` (post-LN): no gain
  law (spec breakers); FFN ``linear2(act(linear1 x))``: ReLU -> unit balance (spec: ReLU row), GELU or
  other -> declined.
* ``nn.Sequential`` (nested plain Sequentials read as one chain; ``sequential_laws``): a map (``nn.Linear``,
  ``nn.Conv1d/2d/3d``, ``nn.ConvTranspose1d/2d/3d``, grouped and depthwise included) or an affine norm writes
  channels, the next map reads them (an ``nn.Linear`` after ``nn.Flatten()`` reads each channel as a block of
  features). Between them: ops that pass a positive per-channel rescaling (ReLU, LeakyReLU, PReLU, max pooling,
  dropout) -> per-channel balance (``relu``; spec: ReLU row; docs/laws.md: Conv-ReLU-Conv); only ops that act the same on
  every channel (identity, average pooling, zero / reflect / replicate padding, upsampling, flatten) -> channel
  Gram (``deep_linear``); GELU/SiLU/Tanh... -> declined. An affine norm (BatchNorm in train or eval mode,
  GroupNorm, InstanceNorm, LayerNorm / RMSNorm) read by the next map -> its gain law (``gain``); the map before
  a GroupNorm / InstanceNorm / LayerNorm -> a scale law per normalised group when eps = 0 (``norm_scale``),
  declined otherwise; the conv before a BatchNorm -> declined (train mode: approximate; eval mode: the law reads
  running_mean). Only torch.nn's own ``forward`` counts (a subclass overriding it stops the chain). The last
  Linear of a model that *is* an ``nn.Sequential`` gets the translation law only with ``loss='ce'`` (spec:
  untied softmax row); a conv there is declined (its channels are the output).

Every other module with parameters is listed in ``Detection.undetected`` with its path. Laws reading a
frozen (``requires_grad=False``) or shared (tied) parameter are moved to ``declined`` with the reason.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..laws import Declined, DeepLinearGram, QKGram, ReLUUnit, Translation, VOGram, cols, rows, vector
from . import builders
from ..laws.tolerance import HOMOGENEOUS
from .core import Collector, register

__all__ = ["Collector", "gain_law", "linear_cols", "norm_parts", "unit_law", "mha_laws", "walk", "layer_index"]

# elementwise maps through which the per-unit positive rescaling passes (f(c x) = c f(x), c > 0)
POSITIVE_HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU, nn.Dropout, nn.Identity)
# elementwise activations with no continuous rescaling symmetry (spec: GELU / SiLU FFN row)
NO_SYMMETRY = (nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Softplus, nn.Hardswish,
               nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid)
NO_LAW_ACT = "no law beyond constants: the activation has no continuous rescaling symmetry (spec: GELU / SiLU FFN row)"
POST_LN = ("post-LN: the norm output also feeds the residual stream, so rescaling a feature is not a symmetry; "
           "no gain law (spec: breakers, post-LN)")


def layer_index(path: str) -> int | None:
    """The last integer component of a module path (``encoder.layers.3.self_attn`` -> 3), or None."""
    nums = [int(p) for p in path.split(".") if p.isdigit()]
    return nums[-1] if nums else None


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _label(path: str) -> str:
    return path or "model"


# ------------------------------------------------------------------------------------------- helpers
def norm_parts(norm: nn.Module) -> tuple[str, str | None] | None:
    """(weight, bias-or-None) attribute names of an affine LayerNorm/RMSNorm, or None if not one."""
    known = isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or type(norm).__name__ in ("RmsNorm", "LayerNorm", "RMSNorm")
    w = getattr(norm, "weight", None)
    if not known or not isinstance(w, nn.Parameter) or w.dim() != 1:
        return None
    b = getattr(norm, "bias", None)
    return "weight", ("bias" if isinstance(b, nn.Parameter) else None)


def gain_law(c: Collector, path: str, norm: nn.Module, readers: list, layer, note: str) -> None:
    """Pre-norm gain law of the norm at ``path`` (spec: pre-norm gain row), or a decline saying why not."""
    parts = norm_parts(norm)
    if parts is None:
        c.decline(path, type(norm).__name__, "not an affine LayerNorm/RMSNorm with a per-feature gain: no gain law")
        return
    w, b = parts
    c.add(builders.gain_law(f"{path}/gain", layer, _p(path, w), getattr(norm, w).shape[0], readers=readers,
                            bias=_p(path, b) if b else None, note=f"readers: {note}"))
    c.mark(path)


def linear_cols(path: str, lin: nn.Linear):
    """Every input feature of a Linear as one row (its weight column)."""
    return builders.in_cols(_p(path, "weight"), lin.weight.shape)


def unit_law(c: Collector, name: str, up_path: str, up: nn.Linear, down_path: str, down: nn.Linear, layer,
             note: str = "") -> None:
    """ReLU-type unit balance between ``up`` (rows, bias) and ``down`` (columns): spec ReLU row."""
    c.add(builders.unit_law(ReLUUnit, name, layer, up=_p(up_path, "weight"), up_shape=up.weight.shape,
                            units=range(up.out_features), down=_p(down_path, "weight"), down_shape=down.weight.shape,
                            up_bias=_p(up_path, "bias") if up.bias is not None else None, note=note))


# ---------------------------------------------------------------------------------------------- MHA
def mha_laws(c: Collector, path: str, m: nn.MultiheadAttention, layer=None) -> None:
    """QK and VO Gram per head of ``nn.MultiheadAttention`` (spec: MHA rows; seed paper)."""
    e, nh, d = m.embed_dim, m.num_heads, m.head_dim
    if m._qkv_same_embed_dim:
        w = _p(path, "in_proj_weight")
        shape = m.in_proj_weight.shape
        (qw, qs, q0), (kw, ks, k0), (vw, vs, v0) = ((w, shape, 0), (w, shape, e), (w, shape, 2 * e))
    else:
        (qw, qs, q0), (kw, ks, k0), (vw, vs, v0) = ((_p(path, f"{x}_proj_weight"), getattr(m, f"{x}_proj_weight").shape, 0)
                                                    for x in "qkv")
    has_b = m.in_proj_bias is not None
    ob = _p(path, "in_proj_bias")
    os_ = m.out_proj.weight.shape
    note = "nn.MultiheadAttention" + (", add_bias_kv: bias_k/bias_v rows join the group" if m.bias_k is not None else "")
    for i in range(nh):
        def b(start):
            return vector(ob, start + i * d, d) if has_b else None

        extra_k = vector(_p(path, "bias_k"), i * d, d, lead=(0, 0)) if m.bias_k is not None else None
        extra_v = vector(_p(path, "bias_v"), i * d, d, lead=(0, 0)) if m.bias_v is not None else None
        c.add(builders.head_gram(QKGram, f"{_label(path)}/qk/head{i}", layer, [[rows(qw, qs, q0 + i * d, d), b(0)]],
                                 [[rows(kw, ks, k0 + i * d, d), b(e), extra_k]], note=note))
        c.add(builders.head_gram(VOGram, f"{_label(path)}/vo/head{i}", layer,
                                 [[rows(vw, vs, v0 + i * d, d), b(2 * e), extra_v]],
                                 [builders.block(_p(path, "out_proj.weight"), os_, range(i * d, (i + 1) * d), kind="cols")],
                                 note=note))
    c.mark(path)


def mha_readers(path: str, m: nn.MultiheadAttention) -> list | None:
    """Column refs of the maps reading the query input (self-attention: q, k and v)."""
    if m._qkv_same_embed_dim:
        return [cols(_p(path, "in_proj_weight"), m.in_proj_weight.shape, 0, m.embed_dim)]
    return None


# ------------------------------------------------------------------------------- activations
def degree_from(y: torch.Tensor, y_big: torch.Tensor, y_small: torch.Tensor) -> float:
    """The degree ``k > 0`` of positive homogeneity of an element-wise ``f`` from ``y = f(z)``, ``y_big = f(2.5 z)``
    and ``y_small = f(0.3 z)`` (``f(c z) = c^k f(z)``: ReLU, leaky ReLU, abs: 1; squared ReLU: 2), measured at 2.5
    and confirmed at 0.3, within ``HOMOGENEOUS`` of an integer read as that integer; 0.0 when f is not positively
    homogeneous (GELU, SiLU, tanh, ...) or is zero on every value."""
    y, y_big, y_small = (t.detach().to(torch.float64) for t in (y, y_big, y_small))
    big = y.abs() > y.abs().max() * 1e-3
    if not big.any():
        return 0.0
    k = float(torch.log((y_big[big] / y[big]).abs()).median() / math.log(2.5))
    if not math.isfinite(k) or k <= 0:
        return 0.0
    if abs(k - round(k)) < HOMOGENEOUS:
        k = float(round(k))
    ok = all(torch.allclose(yc, c ** k * y, rtol=HOMOGENEOUS, atol=HOMOGENEOUS) for yc, c in ((y_big, 2.5), (y_small, 0.3)))
    return k if ok else 0.0


def homogeneous_degree(act) -> float:
    """``degree_from`` an activation module or function, run on fixed float64 values; 0.0 when it cannot run."""
    z = torch.linspace(-3.0, 3.0, 61, dtype=torch.float64)
    try:
        with torch.no_grad():
            return degree_from(act(z), act(2.5 * z), act(0.3 * z))
    except Exception:  # noqa: BLE001 - an activation that takes other inputs: no law read from it
        return 0.0


# ------------------------------------------------------------------------------- encoder layer
def _activation_kind(act) -> str:
    if act is F.relu or isinstance(act, (nn.ReLU, nn.LeakyReLU)) or act is F.leaky_relu:
        return "relu"
    if act is F.gelu or isinstance(act, nn.GELU):
        return "gelu"
    return getattr(act, "__name__", type(act).__name__)


def encoder_layer_laws(c: Collector, path: str, m: nn.TransformerEncoderLayer) -> None:
    layer = layer_index(path)
    mha_laws(c, _p(path, "self_attn"), m.self_attn, layer)
    act = _activation_kind(m.activation)
    ffn = _p(path, "linear1")
    if act == "relu":
        unit_law(c, f"{_label(path)}/ffn/unit", ffn, m.linear1, _p(path, "linear2"), m.linear2, layer,
                 note="nn.TransformerEncoderLayer FFN, ReLU")
        c.mark(ffn, _p(path, "linear2"))
    else:
        c.decline(ffn, f"{act.upper() if act == 'gelu' else act} FFN", NO_LAW_ACT)
        c.mark(_p(path, "linear2"))
    if m.norm_first:
        gain_law(c, _p(path, "norm1"), m.norm1, mha_readers(_p(path, "self_attn"), m.self_attn), layer,
                 "self_attn.in_proj_weight (q, k, v)")
        gain_law(c, _p(path, "norm2"), m.norm2, [linear_cols(ffn, m.linear1)], layer, "linear1")
    else:
        for n in ("norm1", "norm2"):
            c.decline(_p(path, n), "post-LN (norm_first=False)", POST_LN)
    c.mark(path)


# ----------------------------------------------------------------------------------- Sequential
# How an op between a map that writes channels and the map that reads them acts on channel c (docs/laws.md,
# "Convolutions"). 'linear': the same linear map on every channel (commutes with any channel mixing G: the
# deep-linear / channel Gram law); 'positive': commutes with scaling a channel by s > 0 only (the per-channel
# balance law); 'flatten': nn.Flatten() of (C, *spatial) (a Linear then reads channel c at c*per..(c+1)*per).
_PAD = nn.modules.padding
LINEAR_PER_CHANNEL = (nn.Identity, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                      nn.AdaptiveAvgPool3d, nn.Upsample, _PAD._ReflectionPadNd, _PAD._ReplicationPadNd,
                      _PAD._CircularPadNd)
POSITIVE_PER_CHANNEL = (nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                        nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_BN = nn.modules.batchnorm._BatchNorm
_IN = nn.modules.instancenorm._InstanceNorm
_CONV = nn.modules.conv._ConvNd


def _op_kind(m: nn.Module) -> str:
    """'map' | 'norm' | 'linear' | 'positive' | 'flatten' | 'act' (no symmetry) | 'other' (stops the chain).

    Only torch.nn's own ``forward`` counts: a subclass that overrides it (timm's ``StdConv2d`` standardises its
    weight, ``GroupNormAct`` applies an activation inside the norm) is 'other'."""
    if not getattr(type(m).forward, "__module__", "").startswith("torch.nn"):
        return "other"
    if isinstance(m, (nn.Linear, _CONV)) and not isinstance(m, nn.modules.lazy.LazyModuleMixin):
        return "map"
    if isinstance(m, (_BN, nn.GroupNorm, _IN, nn.LayerNorm, nn.RMSNorm)):
        return "norm"
    if isinstance(m, nn.Flatten):
        return "flatten" if (m.start_dim, m.end_dim) == (1, -1) else "other"
    if isinstance(m, _PAD._ConstantPadNd):
        return "linear" if m.value == 0 else "other"
    if isinstance(m, LINEAR_PER_CHANNEL):
        return "linear"
    if isinstance(m, POSITIVE_PER_CHANNEL) and not isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)):
        return "positive"
    if isinstance(m, NO_SYMMETRY):
        return "act"
    return "other"


def _norm_channels(m: nn.Module) -> tuple[int, str]:
    """(channels, space) of a norm: 'cf' channels first (a conv's output), 'cl' channels last (an nn.Linear's
    output), 'both' (BatchNorm / GroupNorm / InstanceNorm: dim 1, which is also the last dim of a (N, C) batch)."""
    if isinstance(m, _BN):
        return m.num_features, "both"
    if isinstance(m, nn.GroupNorm):
        return m.num_channels, "both"
    if isinstance(m, _IN):
        return m.num_features, "cf"
    shape = tuple(m.normalized_shape)
    return shape[0], ("cl" if len(shape) == 1 else "cf")


def _norm_groups(m: nn.Module, C: int, space: str) -> list[list[int]] | None:
    """The channel groups a norm normalises together (a map writing them is scale invariant per group), or None
    when it does not normalise channels as whole units (or depends on running statistics: BatchNorm)."""
    if isinstance(m, nn.GroupNorm) and m.num_channels == C:
        k = C // m.num_groups
        return [list(range(g * k, (g + 1) * k)) for g in range(m.num_groups)]
    if isinstance(m, _IN) and m.num_features == C and not m.track_running_stats and space == "cf":
        return [[c] for c in range(C)]
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        shape = tuple(m.normalized_shape)
        if (space == "cf" and len(shape) > 1 and shape[0] == C) or (space == "cl" and shape == (C,)):
            return [list(range(C))]
    return None


def _chain_name(path: str, pa: str, pb: str) -> str:
    pre = f"{path}." if path else ""
    if pa.startswith(pre) and pb.startswith(pre) and "." not in pa[len(pre):] and "." not in pb[len(pre):]:
        return f"{pa}-{pb[len(pre):]}"  # the existing form: "mlp.0-2", "0-2"
    return f"{pa}-{pb}"


def _leaves(path: str, seq: nn.Sequential, nested: set) -> list[tuple[str, nn.Module]]:
    """The leaf modules of ``seq`` in call order: nested plain ``nn.Sequential`` children are expanded (their
    paths go into ``nested``: walked here, not again on their own)."""
    out = []
    for n, m in seq.named_children():
        p = _p(path, n)
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            nested.add(p)
            out += _leaves(p, m, nested)
        else:
            out.append((p, m))
    return out


def _between(ops: list) -> str:
    return "-".join(type(m).__name__ for m in ops)


def sequential_laws(c: Collector, path: str, seq: nn.Sequential, is_root: bool, loss: str | None,
                    nested: set | None = None) -> None:
    """Laws of the maps and norms of ``seq`` (nested plain Sequentials expanded) read one after another
    (spec: ReLU row, deep linear row, pre-norm gain row; docs/laws.md: Convolutions): a map (``nn.Linear``, ``nn.ConvNd``,
    ``nn.ConvTransposeNd``) or an affine norm writes C channels; the ops after it either pass a channel
    rescaling (``POSITIVE_PER_CHANNEL``: per-channel balance / gain law), also any channel mixing
    (``LINEAR_PER_CHANNEL``, flatten: channel Gram law), or stop it. A norm after a map makes the map's
    channels (per normalised group) scale invariant: a scale law for eps = 0, else declined with the reason;
    BatchNorm is declined (train mode: approximate; eval mode: the law reads running_mean)."""
    leaves = _leaves(path, seq, set() if nested is None else nested)
    n = len(leaves)
    seq_layer = layer_index(path)
    for a, (pa, ma) in enumerate(leaves):
        kind = _op_kind(ma)
        if kind == "map":
            src = builders.ChannelMap.of(pa, ma)
            C, space = src.out_channels, ("cf" if src.conv else "cl")
        elif kind == "norm":
            if not isinstance(getattr(ma, "weight", None), nn.Parameter):
                continue  # no affine gain: nothing writes its output channels
            parts = ("weight", "bias" if isinstance(getattr(ma, "bias", None), nn.Parameter) else None)
            C, space = _norm_channels(ma)
            src = None
        else:
            continue
        layer = seq_layer if seq_layer is not None else layer_index(pa)
        between, flat, b = [], False, a + 1
        stop = None
        while b < n:
            k = _op_kind(leaves[b][1])
            if k in ("map", "norm", "act", "other"):
                stop = k
                break
            if k == "flatten" and space != "cl":
                flat = True
            if isinstance(leaves[b][1], nn.PReLU):
                c.know(_p(leaves[b][0], "weight"))
            between.append(leaves[b][1])
            b += 1
        what = type(ma).__name__
        if stop == "act":
            act = type(leaves[b][1]).__name__
            if src is not None:
                c.decline(pa, f"{what}-{act}" + ("-Linear" if what == "Linear" else ""), NO_LAW_ACT)
            else:
                c.decline(pa, f"{what} gain followed by {act}", "no gain law: " + NO_LAW_ACT)
            continue
        if stop == "norm" and src is not None:
            _map_before_norm(c, pa, ma, src, leaves[b][0], leaves[b][1], C, space, between, layer)
            continue
        if stop is None:  # the end of the Sequential: its consumer is the model's output (root) or unknown
            if is_root:
                _root_output(c, pa, ma, src, a == n - 1, loss, between)
            continue
        if stop != "map":
            continue  # an op this detector does not read: left to structural detection
        pb, mb = leaves[b]
        rd = builders.ChannelMap.of(pb, mb)
        per = 1
        if flat:
            if rd.conv or rd.in_channels % C:
                continue
            per = rd.in_channels // C
        elif rd.in_channels != C or (rd.conv and space == "cl") or (not rd.conv and space == "cf"):
            continue
        name = _chain_name(path, pa, pb)
        note = f"{what}-{_between(between)}-{type(mb).__name__}" if between else f"{what}-{type(mb).__name__}"
        positive = any(_op_kind(m) == "positive" for m in between)
        if src is None:  # an affine norm read (through per-channel ops) by one map: its gain law
            w, bb = parts
            c.add(builders.channel_gain_law(f"{pa}/gain", layer, _p(pa, w), tuple(getattr(ma, w).shape), [(rd, per)],
                                            bias=_p(pa, bb) if bb else None, note=f"readers: {pb} ({note})"))
            c.mark(pa, pb)
            continue
        plain = isinstance(ma, nn.Linear) and isinstance(mb, nn.Linear) and per == 1
        if plain and positive:
            unit_law(c, f"{name}/unit", pa, ma, pb, mb, layer, note=f"{note} (positive rescaling)")
        elif plain and all(isinstance(m, nn.Identity) for m in between):
            units = range(ma.out_features)
            c.add(builders.head_gram(DeepLinearGram, f"{name}/gram", layer,
                                     [builders.block(_p(pa, "weight"), ma.weight.shape, units,
                                                     bias=_p(pa, "bias") if ma.bias is not None else None)],
                                     [builders.block(_p(pb, "weight"), mb.weight.shape, units, kind="cols")],
                                     note="Linear-Linear with no nonlinearity between"))
        else:
            law = None if positive else builders.channel_gram_law(DeepLinearGram, f"{name}/gram", layer, src, rd,
                                                                  per=per, note=f"{note} (channel mixing)")
            if law is None:
                law = builders.channel_unit_law(ReLUUnit, f"{name}/unit", layer, src, rd, per=per,
                                                note=f"{note} (positive rescaling of each channel)")
            c.add(law)
        c.mark(pa, pb)


def _map_before_norm(c: Collector, pa: str, ma: nn.Module, src, pn: str, norm: nn.Module, C: int, space: str,
                     between: list, layer) -> None:
    """A map whose channels reach a norm through per-channel ops (docs/laws.md: Conv before a norm)."""
    what, nw = type(ma).__name__, type(norm).__name__
    if any(_op_kind(m) == "linear" and not isinstance(m, nn.Identity) for m in between) or \
            _norm_channels(norm)[0] != C:
        return  # pooling / flatten before the norm: not a per-channel normalisation of this map's output
    if isinstance(norm, _BN) or (isinstance(norm, _IN) and norm.track_running_stats):
        c.decline(pa, f"{what} before {nw}", (
            f"no law of its channels: in training mode {pn} normalises each channel by batch statistics, so "
            f"channel c of {pa} is scale invariant only up to eps={norm.eps:g} (||W[c]||^2 drifts by "
            "O(eps / var)) and its bias gets no gradient; in eval mode (running statistics) the law "
            f"||W[c]||^2 + (b[c] - running_mean[c])^2 - gamma[c]^2 reads a buffer that training mode changes: "
            "not tracked (docs/laws.md: Conv before a norm)"))
        return
    groups = _norm_groups(norm, C, space)
    if groups is None:
        c.decline(pa, f"{what} before {nw}", f"{pn} does not normalise whole channels of {pa}: no law")
        return
    eps = float(getattr(norm, "eps", 0.0) or 0.0) if getattr(norm, "eps", None) is not None else None
    unit = "channel" if len(groups) == C else ("group" if len(groups) > 1 else "whole output")
    if eps == 0.0:
        c.add(builders.channel_scale_law(f"{pa}/norm_scale", layer, src, groups,
                                         note=f"{pa} normalised by {pn} ({nw}, eps=0): scale invariant per {unit}"))
        c.mark(pa)
    else:
        c.decline(pa, f"{what} before {nw}", (
            f"{pn} normalises each {unit} of {pa}'s output with eps={'default' if eps is None else f'{eps:g}'}: "
            f"||W||^2 + ||b||^2 per {unit} is conserved only up to O(eps / var) (exact for eps=0); not claimed"))


def _root_output(c: Collector, pa: str, ma: nn.Module, src, last: bool, loss: str | None, between: list) -> None:
    """The last map / norm of a model that is an nn.Sequential: its channels are the model's output."""
    if src is not None and last and isinstance(ma, nn.Linear):
        w = ma.weight
        if loss == "ce":
            c.add(builders.row_sum_law(Translation, f"{pa}/translation", None, _p(pa, "weight"), w.shape, w.shape[0],
                                       bias=_p(pa, "bias") if ma.bias is not None else None,
                                       note="softmax cross-entropy only"))
            c.mark(pa)
        else:
            c.declined.append(Declined(pa, "output layer", builders.ce_only(loss)))
        return
    via = f" (through {_between(between)})" if between else ""
    c.decline(pa, f"{type(ma).__name__} at the output", f"its channels are the model's output{via}: rescaling them "
              "changes the output, no law" + (" (a per-pixel softmax cross-entropy translation law is not detected)"
                                              if src is not None and src.conv else ""))


def walk(c: Collector, model: nn.Module, loss: str | None, skip: Iterable[str] = ()) -> None:
    """Recognise every generic structure in ``model`` not already covered by ``c``."""
    nested: set[str] = set()  # plain Sequentials expanded into an enclosing one's chain
    for path, m in model.named_modules():
        if c.covered(path) or path in nested or any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if isinstance(m, nn.TransformerEncoderLayer):
            encoder_layer_laws(c, path, m)
        elif isinstance(m, nn.MultiheadAttention):
            mha_laws(c, path, m, layer_index(path))
        elif isinstance(m, nn.TransformerEncoder) and m.norm is not None:
            c.decline(_p(path, "norm"), "final norm of nn.TransformerEncoder",
                      "its readers are outside the encoder and cannot be known from the module tree: no gain law")
        elif isinstance(m, nn.Sequential):
            sequential_laws(c, path, m, m is model, loss, nested)


@register("torch.nn")
def detect_torchnn(model: nn.Module, config, *, loss: str | None = None, **options):
    """Generic torch.nn detector (see module docstring). Returns None when it recognises nothing."""
    c = Collector(model, options)
    walk(c, model, loss)
    if not c.laws and not c.declined:
        return None
    return c.finish("torch.nn")
