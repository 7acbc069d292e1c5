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
* ``nn.Sequential``: ``Linear, [ReLU | LeakyReLU | Dropout | Identity]..., Linear`` -> unit balance
  (positive rescaling of the units), ``Linear, [Identity]..., Linear`` -> deep-linear Gram (spec:
  deep linear row), ``Linear, GELU/SiLU/Tanh..., Linear`` -> declined. The last Linear of a model that
  *is* an ``nn.Sequential`` gets the translation law only with ``loss='ce'`` (spec: untied softmax row).

Every other module with parameters is listed in ``Detection.undetected`` with its path. Laws reading a
frozen (``requires_grad=False``) or shared (tied) parameter are moved to ``declined`` with the reason.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch.nn.functional as F
from torch import nn

from ..laws import (Declined, DeepLinearGram, GainBalance, Law, QKGram, ReLUUnit, Translation, VOGram, cols, rows,
                    vector)
from . import builders
from .core import Collector, Detection, register

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
def sequential_laws(c: Collector, path: str, seq: nn.Sequential, is_root: bool, loss: str | None) -> None:
    ch = list(seq.named_children())
    for a in range(len(ch)):
        na, la = ch[a]
        if not isinstance(la, nn.Linear):
            continue
        b = a + 1
        while b < len(ch) and isinstance(ch[b][1], POSITIVE_HOMOGENEOUS + NO_SYMMETRY):
            b += 1
        if b >= len(ch) or not isinstance(ch[b][1], nn.Linear) or ch[b][1].in_features != la.out_features:
            continue
        nb, lb = ch[b]
        between = [m for _, m in ch[a + 1: b]]
        pa, pb = _p(path, na), _p(path, nb)
        name = f"{path}.{na}-{nb}" if path else f"{na}-{nb}"
        # the block's index when the Sequential sits in a layer stack (layers.3.mlp), else the Linear's position
        layer = layer_index(path) if layer_index(path) is not None else (int(na) if na.isdigit() else None)
        if any(isinstance(m, NO_SYMMETRY) for m in between):
            act = next(type(m).__name__ for m in between if isinstance(m, NO_SYMMETRY))
            c.decline(pa, f"Linear-{act}-Linear", NO_LAW_ACT)
        elif all(isinstance(m, nn.Identity) for m in between):
            units = range(la.out_features)
            c.add(builders.head_gram(DeepLinearGram, f"{name}/gram", layer,
                                     [builders.block(_p(pa, "weight"), la.weight.shape, units,
                                                     bias=_p(pa, "bias") if la.bias is not None else None)],
                                     [builders.block(_p(pb, "weight"), lb.weight.shape, units, kind="cols")],
                                     note="Linear-Linear with no nonlinearity between"))
        else:
            kinds = "-".join(type(m).__name__ for m in between)
            unit_law(c, f"{name}/unit", pa, la, pb, lb, layer, note=f"Linear-{kinds}-Linear (positive rescaling)")
        c.mark(pa, pb)
    if is_root and ch and isinstance(ch[-1][1], nn.Linear):
        nl, last = ch[-1]
        pl = _p(path, nl)
        if loss == "ce":
            w = last.weight
            c.add(builders.row_sum_law(Translation, f"{pl}/translation", None, _p(pl, "weight"), w.shape, w.shape[0],
                                       bias=_p(pl, "bias") if last.bias is not None else None,
                                       note="softmax cross-entropy only"))
            c.mark(pl)
        else:
            c.declined.append(Declined(pl, "output layer", builders.ce_only(loss)))


def walk(c: Collector, model: nn.Module, loss: str | None, skip: Iterable[str] = ()) -> None:
    """Recognise every generic structure in ``model`` not already covered by ``c``."""
    for path, m in model.named_modules():
        if c.covered(path) or any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if isinstance(m, nn.TransformerEncoderLayer):
            encoder_layer_laws(c, path, m)
        elif isinstance(m, nn.MultiheadAttention):
            mha_laws(c, path, m, layer_index(path))
        elif isinstance(m, nn.TransformerEncoder) and m.norm is not None:
            c.decline(_p(path, "norm"), "final norm of nn.TransformerEncoder",
                      "its readers are outside the encoder and cannot be known from the module tree: no gain law")
        elif isinstance(m, nn.Sequential):
            sequential_laws(c, path, m, m is model, loss)


@register("torch.nn")
def detect_torchnn(model: nn.Module, config, *, loss: str | None = None, **options):
    """Generic torch.nn detector (see module docstring). Returns None when it recognises nothing."""
    c = Collector(model, options)
    walk(c, model, loss)
    if not c.laws and not c.declined:
        return None
    return c.finish("torch.nn")
