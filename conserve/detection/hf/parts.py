"""Building blocks of the HF detector: weights in Linear convention (``W``, GPT-2 ``Conv1D`` transposed,
expert lead dims), the detection context, attention (q/k/v/o layouts, GQA groups, RoPE, QK-norm), norms
(pre-norm gains, post-norms read from the layer's forward), MLPs (gated, plain, fused experts, routers,
MoE blocks) and the embedding / head laws. The family handlers in ``families.py`` compose them."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import lru_cache

from torch import nn

from ...errors import UsageError
from ...laws import (NormScaleLaw, QKGram, ReLUPowerUnit, ReLUUnit, RopePassGram, RouterSum, ScaleLaw, SwiGLUUnit,
                     Translation, VOGram, vector)
from .. import builders
from ..core import Collector
from ..torchnn import homogeneous_degree
from .rope import find_rope_layout, find_rotary_dim

NO_EMBED = "input embedding: no law (no parameter on the other side of it)"


# --------------------------------------------------------------------------------------------- helpers
@lru_cache(maxsize=None)
def _src(fn) -> str:
    """Source of a function with all whitespace removed ('' when unavailable)."""
    try:
        return re.sub(r"\s+", "", inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def forward_src(mod: nn.Module) -> str:
    return _src(type(mod).forward)


def _is_conv1d(mod) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    return isinstance(mod, Conv1D)


class Unhandled(Exception):
    """Raised by a family handler for a variant of its family whose modeling code it has not read (the message
    says which): ``detect_hf`` then gives the model to structural detection with that reason."""


@dataclass(frozen=True)
class W:
    """A weight read in nn.Linear convention ``(out, in)``; ``t``: stored transposed ``(in, out)``
    (GPT-2 Conv1D, transposed expert tensors); ``lead``: index of leading dims (expert)."""

    name: str
    shape: tuple
    bias: str | None = None
    t: bool = False
    lead: tuple = ()

    @property
    def n_in(self) -> int:
        return self.shape[-2] if self.t else self.shape[-1]

    @property
    def n_out(self) -> int:
        return self.shape[-1] if self.t else self.shape[-2]

    def out_rows(self, start: int, n: int):
        """Output units ``start..start+n`` (rows of the Linear-convention weight; ``builders.out_rows``)."""
        return builders.out_rows(self.name, self.shape, start, n, transposed=self.t, lead=self.lead)

    def in_cols(self, start: int = 0, n: int | None = None):
        """Input features ``start..start+n`` (columns of the Linear-convention weight), one row each."""
        return builders.in_cols(self.name, self.shape, start, n, transposed=self.t, lead=self.lead)

    def b(self, start: int, n: int):
        return vector(self.bias, start, n, lead=self.lead) if self.bias else None

    def block(self, start: int, n: int, kind: str = "rows"):
        """``builders.block`` of output units (kind 'rows', with the bias) or input features ('cols')
        ``start..start+n``: one D-row block of a head-Gram law."""
        if self.lead:
            raise ValueError(f"{self.name}: head blocks of a weight with leading dims are not supported")
        return builders.block(self.name, self.shape, range(start, start + n), kind=kind, transposed=self.t,
                              bias=self.bias if kind == "rows" else None)

    def by_dim(self, start: int, n: int) -> tuple:
        """``(weight, shape, bias, rows_by_dim, transposed)`` of the head at rows ``start..start+n``
        (``builders.rope_pair_law``)."""
        return self.name, self.shape, self.bias, [start + t for t in range(n)], self.t


def unit_laws(cls, name: str, layer, up: W, start: int, n: int, down: W, note: str, degree: float = 1.0):
    """Unit law (``builders.unit_law``) of output units ``start..start+n`` of ``up`` read by input features
    ``0..n`` of ``down`` (same expert ``lead``; ``degree``: the activation's degree of homogeneity)."""
    if down.n_in != n:
        raise UsageError(f"{name}: up has {n} units but down reads {down.n_in}")
    return builders.unit_law(cls, name, layer, up=up.name, up_shape=up.shape, units=range(start, start + n),
                             down=down.name, down_shape=down.shape, up_bias=up.bias, up_t=up.t, down_t=down.t,
                             lead=up.lead, degree=degree, note=note)


def linear_w(prefix: str, mod: nn.Module) -> W:
    """``W`` of an nn.Linear (FalconLinear included) or a GPT-2 Conv1D at module path ``prefix``."""
    bias = f"{prefix}.bias" if getattr(mod, "bias", None) is not None else None
    if _is_conv1d(mod):
        return W(f"{prefix}.weight", tuple(mod.weight.shape), bias, t=True)
    if isinstance(mod, nn.Linear):
        return W(f"{prefix}.weight", tuple(mod.weight.shape), bias)
    raise TypeError(type(mod).__name__)


def linear_like(mod) -> bool:
    return isinstance(mod, nn.Linear) or _is_conv1d(mod)



# ------------------------------------------------------------------------------------------- context
Ctx = Collector  # the one detector toolkit accumulator (core.Collector: decline / know / options / config)


# ------------------------------------------------------------------------------------------- attention
@dataclass
class Attn:
    """One attention block: per-head row starts into q/k/v and column starts into o."""

    path: str
    layer: int
    q: W
    k: W
    v: W
    o: W
    d: int
    nh: int
    nkv: int
    q_starts: list
    k_starts: list
    v_starts: list
    rope: tuple | None = None  # (rotary_dim, layout)
    qk_norm: tuple | None = None  # ('head'|'all', q_norm path, k_norm path, eps, gain shift)

    @property
    def rep(self) -> int:
        return self.nh // self.nkv


def attn_laws(ctx: Ctx, a: Attn) -> list:
    """QK Gram / RoPE pairs (+ pass-through Gram) / QK-norm scale laws and VO Gram per kv group
    (``builders.head_gram`` / ``builders.rope_pair_law``)."""
    d, rep, laws, layer = a.d, a.rep, [], a.layer
    for j in range(a.nkv):
        heads = range(j * rep, (j + 1) * rep)
        if a.qk_norm is None and a.rope is None:
            laws.append(builders.head_gram(QKGram, f"{a.path}/qk/group{j}", layer,
                                           [a.q.block(a.q_starts[i], d) for i in heads], [a.k.block(a.k_starts[j], d)],
                                           note=f"query heads {list(heads)} read kv head {j}"))
        elif a.qk_norm is None:
            r, layout = a.rope
            if a.q.t or a.k.t:
                raise UsageError(f"{a.path}: RoPE with transposed q/k weights is not supported")
            laws.append(builders.rope_pair_law(
                f"{a.path}/rope/group{j}", layer, q=[a.q.by_dim(a.q_starts[i], d) for i in heads],
                k=[a.k.by_dim(a.k_starts[j], d)], pairs=builders.rope_pairs(r, layout),
                note=f"layout {layout!r}, rotary_dim {r} of head_dim {d}; query heads {list(heads)}"))
            if r < d:
                laws.append(builders.head_gram(
                    RopePassGram, f"{a.path}/rope_pass/group{j}", layer,
                    [a.q.block(a.q_starts[i] + r, d - r) for i in heads], [a.k.block(a.k_starts[j] + r, d - r)],
                    note=f"pass-through dims [{r}, {d}) of each head"))
        laws.append(builders.head_gram(VOGram, f"{a.path}/vo/group{j}", layer, [a.v.block(a.v_starts[j], d)],
                                       [a.o.block(i * d, d, kind="cols") for i in heads],
                                       note=f"query heads {list(heads)} read kv head {j}"))
    if a.qk_norm is not None:
        laws += _qk_norm_laws(ctx, a)
    ctx.know(a.o.bias)
    return laws


def _qk_norm_laws(ctx: Ctx, a: Attn) -> list:
    """QK-norm (spec breakers): the QK Gram / RoPE-pair laws of q_proj/k_proj are replaced by scale laws
    (``||Q_i||^2``, ``||K_j||^2`` per head for a per-head norm; ``||W_q||^2``, ``||W_k||^2`` for a norm over
    all heads) and the norm gains carry a RoPE-pair law ``sum_{t in p} g_q[t]^2 - g_k[t]^2``
    (``builders.qk_norm_gain_law``)."""
    kind, qn, kn, eps, shift = a.qk_norm
    d, rep, laws = a.d, a.rep, []
    ctx.decline(f"{a.path}.q_proj", "QK-norm: QK Gram / RoPE-pair laws of q_proj, k_proj",
                f"{qn} and {kn} normalise q and k ({'per head' if kind == 'head' else 'over all heads at once'}), so "
                "the GL(D) / pair-scaling symmetries of the q/k rows are gone; replaced by scale laws "
                "(spec breakers: QK-norm); the VO laws are kept")
    if kind == "head":
        qblocks = [[(a.q_starts[i], d)] for i in range(a.nh)]
        kblocks = [[(a.k_starts[j], d)] for j in range(a.nkv)]
        names = [f"q_head{i}" for i in range(a.nh)] + [f"k_head{j}" for j in range(a.nkv)]
    else:
        qblocks = [[(a.q_starts[i], d) for i in range(a.nh)]]
        kblocks = [[(a.k_starts[j], d) for j in range(a.nkv)]]
        names = ["q_all", "k_all"]
    scale = []
    for w, blocks in [(a.q, b) for b in qblocks] + [(a.k, b) for b in kblocks]:
        scale.append([x for s, n in blocks for x in (w.out_rows(s, n), w.b(s, n))])
    reason = (f"the RMSNorm has eps={eps}: the normalised q/k are scale invariant only up to O(eps / mean(q^2)), so "
              "||Q||^2 drifts by that much; pass approximate=True to track it anyway")
    for name, blocks in zip(names, scale):
        lname = f"{a.path}/qk_scale/{name}"
        if eps == 0 or ctx.options.get("approximate"):
            laws.append(ScaleLaw.build(lname, a.layer, blocks=blocks,
                                       note="QK-norm scale law" + ("" if eps == 0 else f" (approximate: eps={eps})")))
        else:
            ctx.decline(lname, "QK-norm scale law", reason)
    # gains: scaling rotary pair p of q_norm's gain by c and of k_norm's by 1/c leaves every score unchanged;
    # without RoPE every dim is its own "pair"
    r, layout = a.rope if a.rope is not None else (d, None)
    if a.rope is not None and r < d:
        ctx.decline(qn, "QK-norm gains on pass-through dims",
                    "partial rotary with QK-norm: the gain law of the pass-through dims is not built")
    if kind == "head":
        groups = [([0], [0])]
    else:
        groups = [([a.q_starts[i] - a.q_starts[0] for i in range(j * rep, (j + 1) * rep)],
                   [a.k_starts[j] - a.k_starts[0]]) for j in range(a.nkv)]
    pairs = builders.rope_pairs(r, layout) if a.rope is not None else [(t,) for t in range(d)]
    for g, (qs, ks) in enumerate(groups):
        laws.append(builders.qk_norm_gain_law(
            f"{a.path}/qk_norm_gain/group{g}", a.layer, q_gain=f"{qn}.weight", k_gain=f"{kn}.weight",
            entries=[[s + t for s in qs for t in p] for p in pairs],
            k_entries=[[s + t for s in ks for t in p] for p in pairs], shift=shift,
            note=f"{qn}/{kn} gains, {'shared by all heads' if kind == 'head' else 'per kv group'}; layout {layout!r}"
                 + ("; gains stored as (1 + w)" if shift else "")))
    return laws


def attn_readers(a: Attn) -> list:
    ws = list(dict.fromkeys([a.q, a.k, a.v]))
    return [w.in_cols() for w in ws]


def qkvo_attn(ctx, path, attn, layer, config, nh, nkv, d, rope_emb, *, rope=True) -> Attn | None:
    """Separate q/k/v/o_proj (Llama family) or fused ``qkv_proj`` rows [Q|K|V] (Phi-3)."""
    if all(linear_like(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        q, k, v = (linear_w(f"{path}.{n}", getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj"))
        qs, ks = [i * d for i in range(nh)], [j * d for j in range(nkv)]
        vs = ks
    elif linear_like(getattr(attn, "qkv_proj", None)) and linear_like(getattr(attn, "o_proj", None)):
        q = k = v = linear_w(f"{path}.qkv_proj", attn.qkv_proj)
        qs = [i * d for i in range(nh)]
        ks = [nh * d + j * d for j in range(nkv)]
        vs = [(nh + nkv) * d + j * d for j in range(nkv)]
    else:
        return None
    o = linear_w(f"{path}.o_proj", attn.o_proj)
    if q.n_out < qs[-1] + d or o.n_in != nh * d or v.n_out < vs[-1] + d:
        raise UsageError(f"{path}: projection shapes do not match num_attention_heads={nh}, num_key_value_heads="
                         f"{nkv}, head_dim={d}")
    a = Attn(path, layer, q, k, v, o, d, nh, nkv, qs, ks, vs)
    if rope:
        r = find_rotary_dim(config, d, rope_emb)
        a.rope = (r, find_rope_layout(ctx, attn, d, r))
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if qn is not None or kn is not None:
        if qn is None or kn is None or getattr(qn, "weight", None) is None:
            return None
        nq, nk = qn.weight.shape[-1], kn.weight.shape[-1]
        if (nq, nk) == (d, d):
            kind = "head"
        elif (nq, nk) == (nh * d, nkv * d):
            kind = "all"
        else:
            return None
        eps = getattr(qn, "variance_epsilon", getattr(qn, "eps", None))
        nk = norm_kind(qn)
        if nk is None or nk[0] != "rms" or norm_kind(kn) != nk or eps is None:
            return None
        a.qk_norm = (kind, f"{path}.q_norm", f"{path}.k_norm", float(eps), nk[1])
    return a


# ----------------------------------------------------------------------------------------------- norms
def norm_kind(mod) -> tuple[str, float] | None:
    """('layer'|'rms', shift) of a norm module with a gain, or None (not understood / no gain)."""
    if isinstance(mod, nn.LayerNorm):
        return ("layer", 0.0) if mod.weight is not None else None
    if isinstance(mod, getattr(nn, "RMSNorm", ())):
        return ("rms", 0.0) if mod.weight is not None else None
    w = getattr(mod, "weight", None)
    if w is None or w.dim() != 1 or not type(mod).__name__.endswith("RMSNorm"):
        return None
    s = forward_src(mod)
    if "(1.0+self.weight" in s or "(1+self.weight" in s:
        return ("rms", 1.0)  # Gemma: stored as w, applied as (1 + w)
    if "self.weight*" in s or "*self.weight" in s:
        return ("rms", 0.0)
    return None


def gain_laws(ctx: Ctx, path: str, norm, layer, readers: list, what: str):
    """Pre-norm gain law (spec: pre-norm gain row) of ``norm`` read by ``readers`` (input-column refs)."""
    kind = norm_kind(norm)
    if kind is None:
        ctx.decline(path, f"{type(norm).__name__}", "norm without a recognised gain: no gain law")
        return
    bias = f"{path}.bias" if getattr(norm, "bias", None) is not None else None
    ctx.add(builders.gain_law(f"{path}/gain", layer, f"{path}.weight", norm.weight.shape[0], readers=readers,
                              bias=bias, shift=kind[1],
                              note=f"readers: {what}" + ("; gain stored as (1 + w)" if kind[1] else "")))


# ------------------------------------------------------------------------------------------------- MLP
_GATED = [  # (gate, up, down, forward source fragment): down(act(gate x) * up x)
    ("gate_proj", "up_proj", "down_proj", "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"),
    ("w1", "w3", "w2", "self.act_fn(self.w1(hidden_states))*self.w3(hidden_states)"),
]


@dataclass
class _Mlp:
    laws: list
    readers: list
    what: str


def gated_mlp(ctx, path, mlp, layer) -> _Mlp | None:
    """Gated FFN ``down(act(gate x) * up x)`` (SwiGLU, GeGLU: the gate is not in the law) or Phi-3's
    fused ``gate_up_proj`` rows ``[gate | up]``."""
    src = forward_src(mlp)
    for g, u, dn, frag in _GATED:
        if all(linear_like(getattr(mlp, n, None)) for n in (g, u, dn)) and frag in src:
            gw, uw, dw = (linear_w(f"{path}.{n}", getattr(mlp, n)) for n in (g, u, dn))
            n, start = uw.n_out, 0
            readers = [gw.in_cols(), uw.in_cols()]
            ctx.know(gw.bias)  # the gate (weight and bias) is in no law: scaling an up row leaves it alone
            break
    else:
        if (linear_like(getattr(mlp, "gate_up_proj", None)) and linear_like(getattr(mlp, "down_proj", None))
                and "gate,up_states=up_states.chunk(2,dim=-1)" in src and "up_states*self.activation_fn(gate)" in src):
            uw, dw = linear_w(f"{path}.gate_up_proj", mlp.gate_up_proj), linear_w(f"{path}.down_proj", mlp.down_proj)
            n = start = uw.n_out // 2
            readers = [uw.in_cols()]
        else:
            return None
    act = type(getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))).__name__
    law = unit_laws(SwiGLUUnit, f"{path}/unit", layer, uw, start, n, dw,
                f"gated FFN ({act} gate): the gate is not involved (spec SwiGLU row)")
    ctx.know(dw.bias)
    return _Mlp([law], readers, "gate/up")


def plain_mlp(ctx, path, mlp, layer, up_name, down_name, act, reason: str | None = None) -> _Mlp:
    """``down(act(up x))``: the unit law of a positively homogeneous activation (ReLU / leaky ReLU: degree 1;
    squared ReLU, transformers' ``relu2``: degree 2, ``ReLUPowerUnit``), none for GELU / SiLU (spec rows; ``reason``
    replaces the declined reason for other activations)."""
    uw, dw = linear_w(f"{path}.{up_name}", getattr(mlp, up_name)), linear_w(f"{path}.{down_name}", getattr(mlp, down_name))
    n = uw.n_out
    k = 1.0 if isinstance(act, (nn.ReLU, nn.LeakyReLU)) else homogeneous_degree(act)
    if k:
        law = unit_laws(ReLUUnit if k == 1 else ReLUPowerUnit, f"{path}/unit", layer, uw, 0, n, dw,
                        f"{type(act).__name__} FFN" + (f", homogeneous of degree {k:g}" if k != 1 else ""), degree=k)
        ctx.know(dw.bias)
        return _Mlp([law], [uw.in_cols()], up_name)
    ctx.decline(path, f"{type(act).__name__} FFN", reason or
                "no law beyond constants: the activation has no rescaling symmetry (spec: GELU / SiLU FFN row)")
    return _Mlp([], [uw.in_cols()], up_name)


def ungated_mlp(ctx, path, mlp, layer) -> _Mlp | None:
    """Plain FFN ``down_proj(act_fn(up_proj(x)))`` in a decoder layer (Arcee, Nemotron: ReLU^2): the unit law of a
    positively homogeneous activation (``plain_mlp``), none for other activations (declined); ``up_proj`` is the
    reader of the norm before it."""
    if (hasattr(mlp, "gate_proj") or not all(linear_like(getattr(mlp, n, None)) for n in ("up_proj", "down_proj"))
            or "self.down_proj(self.act_fn(self.up_proj(x)))" not in forward_src(mlp)):
        return None
    act = getattr(mlp, "act_fn", None)
    reason = (f"the activation {type(act).__name__} is not positively homogeneous (no unit law); up_proj still reads "
              "the norm before it only linearly, so that norm's gain law holds")
    return plain_mlp(ctx, path, mlp, layer, "up_proj", "down_proj", act, reason=reason)


def _fused_experts(ctx, path, ex, layer, num_experts) -> _Mlp | None:
    """3-D expert tensors (``use_experts_implementation``): gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3):
        return None
    if (not getattr(ex, "has_gate", True) or not getattr(ex, "is_concatenated", True)
            or getattr(ex, "has_post_expert_norm", False)):
        return None
    from transformers.integrations import moe as moe_mlp

    if getattr(type(ex), "_apply_gate", moe_mlp._default_apply_gate) is not moe_mlp._default_apply_gate:
        return None  # custom gating (e.g. clamped GLU): not the plain act(gate) * up
    t = bool(getattr(ex, "is_transposed", False))
    has_bias = bool(getattr(ex, "has_bias", False))
    e_n = gu.shape[0]
    if e_n != num_experts or dn.shape[0] != e_n:
        return None
    laws, readers = [], []
    for e in range(e_n):
        guw = W(f"{path}.gate_up_proj", tuple(gu.shape), f"{path}.gate_up_proj_bias" if has_bias else None, t, (e,))
        dw = W(f"{path}.down_proj", tuple(dn.shape), None, t, (e,))
        n = guw.n_out // 2
        if dw.n_in != n:
            return None
        laws.append(unit_laws(SwiGLUUnit, f"{path}.{e}/unit", layer, guw, n, n, dw,
                          f"expert {e} of fused 3-D tensors ({'transposed' if t else '(E, out, in)'})"))
        readers.append(guw.in_cols())
    ctx.know(f"{path}.down_proj_bias" if has_bias else None)
    return _Mlp(laws, readers, "experts' gate/up")


def _router(ctx, path, gate, layer, num_experts):
    """Router laws: softmax (dense or top-k, renormalised or not): RouterSum; normalised sigmoid: declined
    (spec open row). Returns (laws, reader) or None when the router is not understood."""
    w = getattr(gate, "weight", None)
    if w is None or w.dim() != 2 or w.shape[0] != num_experts:
        return None
    rw = W(f"{path}.weight", tuple(w.shape), f"{path}.bias" if getattr(gate, "bias", None) is not None else None)
    src = forward_src(gate)
    top_k = getattr(gate, "top_k", None)
    if "softmax(" in src and "sigmoid" not in src:
        law = builders.row_sum_law(RouterSum, f"{path}/router", layer, rw.name, rw.shape, num_experts, bias=rw.bias,
                                   note=f"softmax gating, top_k={top_k}: adding one vector to every row keeps the "
                                        "probabilities and the top-k choice (spec: MoE router row)")
        return [law], rw.in_cols()
    if "sigmoid" in src:
        norm = getattr(gate, "norm_topk_prob", None)
        if top_k == 1 and norm:
            reason = ("normalised sigmoid with top_k=1: g = s_k / s_k = 1, the router weight gets no gradient at all "
                      "(trivially frozen); no sum law to track")
        else:
            reason = (f"sigmoid router (top_k={top_k}, norm_topk_prob={norm}"
                      + (", bias-corrected top-k choice (e_score_correction_bias)"
                         if hasattr(gate, "e_score_correction_bias") else "")
                      + "): sum_e W_router[e,:] is NOT conserved: sum_e dg_k/dz_e = g_k (sum_i g_i s_i - s_k) != 0 "
                        "(spec: MoE router, normalised sigmoid: open row)")
        ctx.decline(path, "sigmoid router: router sum", reason)
        return [], rw.in_cols()
    return None


def moe_mlp(ctx, path, mlp, layer, config) -> _Mlp | None:
    """MoE block: router ``gate``, ``experts`` (fused 3-D or ModuleList), optional shared expert(s) and
    Qwen2-MoE's ``shared_expert_gate`` (sigmoid(Linear H->1) times the shared expert's output: it scales
    the output, so the shared expert's unit law holds; it reads the normed input: a gain-law reader)."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if gate is None or experts is None or getattr(gate, "weight", None) is None:
        return None
    e_n = gate.weight.shape[0]
    r = _router(ctx, f"{path}.gate", gate, layer, e_n)
    if r is None:
        return None
    laws, readers = list(r[0]), [r[1]]
    if isinstance(experts, nn.ModuleList):
        if len(experts) != e_n:
            return None
        for e, ex in enumerate(experts):
            m = gated_mlp(ctx, f"{path}.experts.{e}", ex, layer)
            if m is None:
                return None
            laws += m.laws
            readers += m.readers
    else:
        m = _fused_experts(ctx, f"{path}.experts", experts, layer, e_n)
        if m is None:
            return None
        laws += m.laws
        readers += m.readers
    for name in ("shared_expert", "shared_experts"):
        sh = getattr(mlp, name, None)
        if sh is not None:
            m = gated_mlp(ctx, f"{path}.{name}", sh, layer)
            if m is None:
                return None
            laws += m.laws
            readers += m.readers
    sg = getattr(mlp, "shared_expert_gate", None)
    if sg is not None:
        if not (linear_like(sg) and "sigmoid(self.shared_expert_gate(" in forward_src(mlp)):
            return None
        sw = linear_w(f"{path}.shared_expert_gate", sg)
        readers.append(sw.in_cols())
        ctx.decline(f"{path}.shared_expert_gate", "sigmoid shared-expert gate",
                    "a scalar sigmoid gate has no rescaling symmetry: no law of its own (it scales the shared "
                    "expert's output, so that expert's unit law holds; it is a reader in the gain law)")
    return _Mlp(laws, readers, "router, experts' gate/up" + (", shared expert" if len(readers) > e_n + 1 else ""))


# -------------------------------------------------------------------------------------------- families
def embed_and_head(ctx: Ctx, embed_paths: list, final_norm_path: str | None):
    """Input embeddings (no law), final norm gain read by lm_head and the translation law, or the
    declined tied head."""
    model, config = ctx.model, ctx.config
    for p in embed_paths:
        ctx.decline(p, "input embedding", NO_EMBED)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_path = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    norm = ctx.model.get_submodule(final_norm_path) if final_norm_path else None
    if head is None or head_path is None:
        if norm is not None:
            ctx.decline(final_norm_path, "final norm", "no output layer found after it: no gain law")
        return
    tied = inp is not None and head.weight is inp.weight
    if tied:
        ctx.decline(head_path, "tied input/output embeddings",
                    "the translation law and the final-norm gain law need an untied output layer: the tied weight "
                    "also feeds the input (spec breakers: tied embeddings)")
        if final_norm_path:
            ctx.decline(final_norm_path, "final norm before a tied output layer",
                        "no gain law: its reader (the output layer) is tied to the input embedding")
        ctx.know(f"{head_path}.bias" if getattr(head, "bias", None) is not None else None)
        return
    hw = linear_w(head_path, head)
    if norm is not None:
        gain_laws(ctx, final_norm_path, norm, None, [hw.in_cols()], head_path)
    loss = ctx.options.get("loss", "ce")
    cap = getattr(config, "final_logit_softcapping", None)
    if loss != "ce":
        ctx.decline(head_path, "translation law", f"holds only for softmax cross-entropy, the loss is {loss!r}")
    elif cap:
        ctx.decline(head_path, "translation law", f"final_logit_softcapping={cap} breaks it (spec breakers)")
    else:
        ctx.add(builders.row_sum_law(Translation, f"{head_path}/translation", None, hw.name, hw.shape, hw.n_out,
                                     bias=hw.bias, transposed=hw.t,
                                     note="softmax cross-entropy only (pass loss= to say otherwise)"))


def find_num_kv(config, nh):
    nkv = getattr(config, "num_key_value_heads", None)
    return nh if nkv is None else nkv


def find_head_dim(config):
    d = getattr(config, "head_dim", None)
    return d if d else config.hidden_size // config.num_attention_heads


def norm_roles(layer: nn.Module) -> dict[str, str] | None:
    """Role of each norm of a decoder layer, read from the order of calls in its ``forward``:
    ``pre_attn`` (called before ``self.self_attn(``), ``post_attn`` (after it, before the residual add),
    ``pre_mlp`` (after that add, before ``self.mlp(``), ``post_mlp`` (after ``self.mlp(``, before its add).
    Llama: input_layernorm = pre_attn, post_attention_layernorm = pre_mlp; Gemma2/3 add the post norms;
    OLMo2 has only post norms. None when the source does not show this order."""
    src = forward_src(layer)
    a, m = src.find("self.self_attn("), src.find("self.mlp(")
    if a < 0 or m < a:
        return None
    adds = [x.start() for x in re.finditer(r"residual\+", src)]
    roles: dict[str, str] = {}
    for name, mod in layer.named_children():
        if name in ("self_attn", "mlp") or norm_kind(mod) is None:
            continue
        calls = [x.start() for x in re.finditer(re.escape(f"self.{name}("), src)]
        if len(calls) != 1:
            return None
        p = calls[0]
        if p < a:
            role = "pre_attn"
        elif p < m:
            role = "pre_mlp" if any(a < x < p for x in adds) else "post_attn"
        elif any(m < x < p for x in adds):
            return None
        else:
            role = "post_mlp"
        if role in roles:
            return None
        roles[role] = name
    return roles


def post_norm(ctx: Ctx, path: str, norm, out, layer, what: str):
    """A norm on a block's output (before the residual add): no gain law (its output goes to the residual
    stream); the Linear ``out`` that feeds it is scale invariant: ``NormScaleLaw`` (eps = 0, or
    ``approximate``), else declined with the reason."""
    ctx.decline(path, "post-norm on the block output",
                "no gain law: its output is added to the residual stream, read by every later layer and not only "
                "by linear maps (spec breakers: post-LN)")
    kind = norm_kind(norm)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if out is None or kind is None or eps is None or norm.weight.shape[0] != out.n_out:
        ctx.decline(f"{path}/norm_scale", "post-norm scale law", f"the map feeding {path} is not recognised: no law")
        return
    n = out.n_out
    if float(eps) == 0 or ctx.options.get("approximate"):
        ctx.laws.append(NormScaleLaw.build(f"{path}/norm_scale", layer, blocks=[out.out_rows(0, n), out.b(0, n)],
                                           note=f"{what} output normalised by {path}"
                                                + ("" if float(eps) == 0 else f" (approximate: eps={eps})")))
    else:
        ctx.decline(f"{path}/norm_scale", "post-norm scale law",
                    f"the norm has eps={eps}: {what} is scale invariant only up to O(eps / mean(y^2)), so its "
                    "||W||^2 drifts by that much; pass approximate=True to track it anyway")


