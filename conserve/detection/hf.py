"""Detector for HF ``transformers`` models: every law with the exact rows/columns it reads.

Detection is structural: the family comes from ``config.model_type`` (a whitelist of families whose
modeling code was read, see ``_FAMILIES``), the blocks from the module classes and the parameter shapes,
the RoPE pairing and rotary width from the model's own ``apply_rotary_pos_emb`` (probed with basis
vectors), the MLP kind from its ``forward`` source and the MoE gating from the router's ``forward``.
What is not understood is listed in ``Detection.undetected``; blocks with no law carry the reason in
``Detection.declined``. Math: ``shared/spec/laws.md`` (rows named in each law's note).

Layouts handled (verified against transformers 5.x modeling code):

* separate ``q/k/v/o_proj`` (Llama, Mistral, Qwen2/3, Gemma, Mixtral, Qwen2-MoE, OLMoE); GQA group j is
  query heads ``[j*rep, (j+1)*rep)`` (``repeat_kv``);
* Phi-3 ``qkv_proj`` rows ``[Q | K | V]`` and ``gate_up_proj`` rows ``[gate | up]``;
* GPT-NeoX ``query_key_value`` per head ``[q_h | k_h | v_h]`` (``view(..., nH, 3D)``);
* Falcon: multi-query ``[Q_0..Q_{nH-1} | K | V]``, classic per head ``[q_h k_h v_h]`` and the new
  decoder architecture's per kv group ``[q.. (rep heads) | k_j | v_j]``;
* GPT-2 ``Conv1D`` (weights stored ``(in, out)``), fused ``c_attn`` columns ``[Q | K | V]``;
* fused 3-D experts ``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)`` (``is_transposed`` swaps the
  last two dims), and ``nn.ModuleList`` experts of gated MLPs (transformers < 5 layout).

Options (``conserve.detect(model, **options)``):
    rope_layout: 'half' | 'interleaved' overrides what the model's code says.
    require_rope_layout: True for weights whose row order may not follow HF's code (a raw checkpoint):
        a RoPE model then needs ``rope_layout`` (UsageError otherwise).
    loss: the training loss of the logits; the translation law is only kept for 'ce' (default 'ce').
    approximate: True keeps QK-norm scale laws when the norm has eps > 0 (then conserved only up to
        O(eps / mean(q^2))); default False declines them with that reason.
"""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from ..errors import UsageError
from ..laws import (Declined, GainBalance, QKGram, QKNormGain, ReLUUnit, RopePairs, RopePassGram, RouterSum, ScaleLaw, SwiGLUUnit,
                    Term, Translation, VOGram, cols, rows, vector)
from .core import Collector, Detection, finish, register

LAYOUTS = ("half", "interleaved")
NO_EMBED = "input embedding: no law (no parameter on the other side of it)"


# --------------------------------------------------------------------------------------------- helpers
@lru_cache(maxsize=None)
def _src(fn) -> str:
    """Source of a function with all whitespace removed ('' when unavailable)."""
    try:
        return re.sub(r"\s+", "", inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def _fwd(mod: nn.Module) -> str:
    return _src(type(mod).forward)


def _is_conv1d(mod) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        return False
    return isinstance(mod, Conv1D)


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
        """Output units ``start..start+n`` (rows of the Linear-convention weight)."""
        if self.t:
            return cols(self.name, self.shape, start, n, lead=self.lead)
        return rows(self.name, self.shape, start, n, lead=self.lead)

    def in_cols(self, start: int = 0, n: int | None = None):
        """Input features ``start..start+n`` (columns of the Linear-convention weight), one row each."""
        n = self.n_in - start if n is None else n
        if self.t:
            return rows(self.name, self.shape, start, n, lead=self.lead)
        return cols(self.name, self.shape, start, n, lead=self.lead)

    def b(self, start: int, n: int):
        return vector(self.bias, start, n, lead=self.lead) if self.bias else None


def _w(prefix: str, mod: nn.Module) -> W:
    """``W`` of an nn.Linear (FalconLinear included) or a GPT-2 Conv1D at module path ``prefix``."""
    bias = f"{prefix}.bias" if getattr(mod, "bias", None) is not None else None
    if _is_conv1d(mod):
        return W(f"{prefix}.weight", tuple(mod.weight.shape), bias, t=True)
    if isinstance(mod, nn.Linear):
        return W(f"{prefix}.weight", tuple(mod.weight.shape), bias)
    raise TypeError(type(mod).__name__)


def _linear_like(mod) -> bool:
    return isinstance(mod, nn.Linear) or _is_conv1d(mod)


# ------------------------------------------------------------------------------------------------ RoPE
def probe_rope(fn, head_dim: int, rotary_dim: int) -> str | None:
    """RoPE pairing of an ``apply_rotary_pos_emb(q, k, cos, sin)`` function, found by running it.

    With ``cos = 0`` and ``sin = 1`` each basis vector ``e_t`` of a head is sent to +-``e_partner(t)``;
    'half' pairs ``{p, p + R/2}`` (HF rotate_half), 'interleaved' pairs ``{2p, 2p+1}``. Returns None when
    the function cannot be run this way or rotates a set of dims other than ``[0, rotary_dim)``."""
    d, r = head_dim, rotary_dim
    eye = torch.eye(d, dtype=torch.float64, device="cpu").view(d, 1, 1, d)
    cos = torch.zeros(1, 1, r, dtype=torch.float64, device="cpu")
    sin = torch.ones(1, 1, r, dtype=torch.float64, device="cpu")
    try:
        out = fn(eye, eye.clone(), cos, sin)[0].reshape(d, d)
    except Exception:
        return None
    partner = []
    for t in range(d):
        nz = (out[t].abs() > 0.5).nonzero().flatten().tolist()
        if len(nz) != 1:
            return None
        partner.append(nz[0])
    rotated = [t for t in range(d) if partner[t] != t]
    if rotated != list(range(r)):
        return None
    h = r // 2
    if all(partner[p] == p + h and partner[p + h] == p for p in range(h)):
        return "half"
    if all(partner[2 * p] == 2 * p + 1 and partner[2 * p + 1] == 2 * p for p in range(h)):
        return "interleaved"
    return None


def _rotary_dim(config, head_dim: int, rotary_emb) -> int:
    """Rotary width R from the config (partial_rotary_factor / rotary_pct), checked against the
    ``inv_freq`` buffer of the model's rotary embedding (R/2 frequencies; shape only: meta-safe)."""
    rp = getattr(config, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is None:
        factor = getattr(config, "rotary_pct", 1.0)
    r = int(head_dim * factor)
    inv = getattr(rotary_emb, "inv_freq", None) if rotary_emb is not None else None
    if inv is not None and 2 * inv.shape[-1] != r:
        raise UsageError(f"rotary width mismatch: config says {r} rotary dims of head_dim={head_dim}, the model's "
                         f"inv_freq has {inv.shape[-1]} frequencies; report this model (config.model_type="
                         f"{config.model_type!r})")
    return r


def _rope_layout(ctx: "_Ctx", attn: nn.Module, head_dim: int, r: int) -> str:
    opt = ctx.options.get("rope_layout")
    if opt is not None:
        if opt not in LAYOUTS:
            raise UsageError(f"rope_layout must be one of {LAYOUTS}, got {opt!r}")
        return opt
    if ctx.options.get("require_rope_layout"):
        raise UsageError("the RoPE pairing cannot be known from a checkpoint's shapes (HF's converter permutes the "
                         "q/k rows of Meta checkpoints, so both layouts have the same shapes): pass "
                         "--rope-layout half (HF rotate_half, NeoX) or --rope-layout interleaved (GPT-J, Meta)")
    key = type(attn)
    if key not in ctx.rope_cache:
        fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
        ctx.rope_cache[key] = probe_rope(fn, head_dim, r) if fn is not None else None
    lay = ctx.rope_cache[key]
    if lay is None:
        raise UsageError(f"cannot tell the RoPE pairing of {type(attn).__name__} from its code: pass "
                         "rope_layout='half' (HF rotate_half, NeoX) or 'interleaved' (GPT-J, Meta checkpoints)")
    return lay


# ------------------------------------------------------------------------------------------- context
_Ctx = Collector  # the one detector toolkit accumulator (core.Collector: decline / know / options / config)


# ------------------------------------------------------------------------------------------- attention
@dataclass
class _Attn:
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
    qk_norm: tuple | None = None  # ('head'|'all', q_norm path, k_norm path, eps)

    @property
    def rep(self) -> int:
        return self.nh // self.nkv


def _attn_laws(ctx: _Ctx, a: _Attn) -> list:
    """QK Gram / RoPE pairs (+ pass-through Gram) / QK-norm scale laws and VO Gram per kv group."""
    d, rep, laws, layer = a.d, a.rep, [], a.layer
    for j in range(a.nkv):
        heads = range(j * rep, (j + 1) * rep)
        if a.qk_norm is None and a.rope is None:
            laws.append(QKGram.build(
                f"{a.path}/qk/group{j}", layer,
                plus=[x for i in heads for x in (a.q.out_rows(a.q_starts[i], d), a.q.b(a.q_starts[i], d))],
                minus=[a.k.out_rows(a.k_starts[j], d), a.k.b(a.k_starts[j], d)],
                note=f"query heads {list(heads)} read kv head {j}"))
        elif a.qk_norm is None:
            r, layout = a.rope
            if a.q.t or a.k.t:
                raise UsageError(f"{a.path}: RoPE with transposed q/k weights is not supported")
            laws.append(RopePairs.build(
                f"{a.path}/rope/group{j}", layer, q_weight=a.q.name, q_shape=a.q.shape,
                q_starts=[a.q_starts[i] for i in heads], k_weight=a.k.name, k_shape=a.k.shape,
                k_starts=[a.k_starts[j]], rotary_dim=r, layout=layout, q_bias=a.q.bias, k_bias=a.k.bias,
                note=f"layout {layout!r}, rotary_dim {r} of head_dim {d}; query heads {list(heads)}"))
            if r < d:
                laws.append(RopePassGram.build(
                    f"{a.path}/rope_pass/group{j}", layer,
                    plus=[x for i in heads
                          for x in (a.q.out_rows(a.q_starts[i] + r, d - r), a.q.b(a.q_starts[i] + r, d - r))],
                    minus=[a.k.out_rows(a.k_starts[j] + r, d - r), a.k.b(a.k_starts[j] + r, d - r)],
                    note=f"pass-through dims [{r}, {d}) of each head"))
        laws.append(VOGram.build(
            f"{a.path}/vo/group{j}", layer,
            plus=[a.v.out_rows(a.v_starts[j], d), a.v.b(a.v_starts[j], d)],
            minus=[a.o.in_cols(i * d, d) for i in heads], note=f"query heads {list(heads)} read kv head {j}"))
    if a.qk_norm is not None:
        laws += _qk_norm_laws(ctx, a)
    ctx.know(a.o.bias)
    return laws


def _qk_norm_laws(ctx: _Ctx, a: _Attn) -> list:
    """QK-norm (spec breakers): the QK Gram / RoPE-pair laws of q_proj/k_proj are replaced by scale laws
    (``||Q_i||^2``, ``||K_j||^2`` per head for a per-head norm; ``||W_q||^2``, ``||W_k||^2`` for a norm over
    all heads) and the norm gains carry a RoPE-pair law ``sum_{t in p} g_q[t]^2 - g_k[t]^2``."""
    kind, qn, kn, eps = a.qk_norm
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
    # gains: scaling rotary pair p of q_norm's gain by c and of k_norm's by 1/c leaves every score unchanged
    qg, kg = f"{qn}.weight", f"{kn}.weight"
    r, layout = a.rope if a.rope is not None else (d, None)
    if a.rope is not None and r < d:
        ctx.decline(qn, "QK-norm gains on pass-through dims",
                    "partial rotary with QK-norm: the gain law of the pass-through dims is not built")
    if kind == "head":
        groups = [([0], [0])]
    else:
        groups = [([a.q_starts[i] - a.q_starts[0] for i in range(j * rep, (j + 1) * rep)],
                   [a.k_starts[j] - a.k_starts[0]]) for j in range(a.nkv)]
    half = r // 2
    members = [(0, 1), (half, 1)] if layout in ("half", None) else [(0, 2), (1, 2)]
    for g, (qs, ks) in enumerate(groups):
        terms = []
        for vec, starts, sign in ((qg, qs, +1.0), (kg, ks, -1.0)):
            for s in starts:
                for off, step in members:
                    terms.append(Term("norm", vector(vec, s + off, half, step=step), sign))
        if a.rope is None:  # no RoPE: every dim is its own "pair"; members overlap -> use one member of size d
            terms = [Term("norm", vector(vec, s, d), sign) for vec, starts, sign in ((qg, qs, +1.0), (kg, ks, -1.0))
                     for s in starts]
        laws.append(QKNormGain(f"{a.path}/qk_norm_gain/group{g}", a.layer, terms, half if a.rope else d,
                              note=f"{qn}/{kn} gains, {'shared by all heads' if kind == 'head' else 'per kv group'}"
                                   f"; layout {layout!r}"))
    return laws


def _attn_readers(a: _Attn) -> list:
    ws = list(dict.fromkeys([a.q, a.k, a.v]))
    return [w.in_cols() for w in ws]


def _qkvo_attn(ctx, path, attn, layer, config, nh, nkv, d, rope_emb, *, rope=True) -> _Attn | None:
    """Separate q/k/v/o_proj (Llama family) or fused ``qkv_proj`` rows [Q|K|V] (Phi-3)."""
    if all(_linear_like(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        q, k, v = (_w(f"{path}.{n}", getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj"))
        qs, ks = [i * d for i in range(nh)], [j * d for j in range(nkv)]
        vs = ks
    elif _linear_like(getattr(attn, "qkv_proj", None)) and _linear_like(getattr(attn, "o_proj", None)):
        q = k = v = _w(f"{path}.qkv_proj", attn.qkv_proj)
        qs = [i * d for i in range(nh)]
        ks = [nh * d + j * d for j in range(nkv)]
        vs = [(nh + nkv) * d + j * d for j in range(nkv)]
    else:
        return None
    o = _w(f"{path}.o_proj", attn.o_proj)
    if q.n_out < qs[-1] + d or o.n_in != nh * d or v.n_out < vs[-1] + d:
        raise UsageError(f"{path}: projection shapes do not match num_attention_heads={nh}, num_key_value_heads="
                         f"{nkv}, head_dim={d}")
    a = _Attn(path, layer, q, k, v, o, d, nh, nkv, qs, ks, vs)
    if rope:
        r = _rotary_dim(config, d, rope_emb)
        a.rope = (r, _rope_layout(ctx, attn, d, r))
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
        if _norm_kind(qn) != ("rms", 0.0) or eps is None:
            return None
        a.qk_norm = (kind, f"{path}.q_norm", f"{path}.k_norm", float(eps))
    return a


# ----------------------------------------------------------------------------------------------- norms
def _norm_kind(mod) -> tuple[str, float] | None:
    """('layer'|'rms', shift) of a norm module with a gain, or None (not understood / no gain)."""
    if isinstance(mod, nn.LayerNorm):
        return ("layer", 0.0) if mod.weight is not None else None
    if isinstance(mod, getattr(nn, "RMSNorm", ())):
        return ("rms", 0.0) if mod.weight is not None else None
    w = getattr(mod, "weight", None)
    if w is None or w.dim() != 1 or not type(mod).__name__.endswith("RMSNorm"):
        return None
    s = _fwd(mod)
    if "(1.0+self.weight" in s or "(1+self.weight" in s:
        return ("rms", 1.0)  # Gemma: stored as w, applied as (1 + w)
    if "self.weight*" in s or "*self.weight" in s:
        return ("rms", 0.0)
    return None


def _gain(ctx: _Ctx, path: str, norm, layer, readers: list, what: str):
    """Pre-norm gain law (spec: pre-norm gain row) of ``norm`` read by ``readers`` (input-column refs)."""
    kind = _norm_kind(norm)
    if kind is None:
        ctx.decline(path, f"{type(norm).__name__}", "norm without a recognised gain: no gain law")
        return
    h = norm.weight.shape[0]
    beta = vector(f"{path}.bias", 0, h) if getattr(norm, "bias", None) is not None else None
    ctx.laws.append(GainBalance.build(f"{path}/gain", layer, gain=vector(f"{path}.weight", 0, h), beta=beta,
                                      readers=readers, shift=kind[1],
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


def _gated_mlp(ctx, path, mlp, layer) -> _Mlp | None:
    """Gated FFN ``down(act(gate x) * up x)`` (SwiGLU, GeGLU: the gate is not in the law) or Phi-3's
    fused ``gate_up_proj`` rows ``[gate | up]``."""
    src = _fwd(mlp)
    for g, u, dn, frag in _GATED:
        if all(_linear_like(getattr(mlp, n, None)) for n in (g, u, dn)) and frag in src:
            gw, uw, dw = (_w(f"{path}.{n}", getattr(mlp, n)) for n in (g, u, dn))
            n = uw.n_out
            up, ub = uw.out_rows(0, n), uw.b(0, n)
            readers = [gw.in_cols(), uw.in_cols()]
            break
    else:
        if (_linear_like(getattr(mlp, "gate_up_proj", None)) and _linear_like(getattr(mlp, "down_proj", None))
                and "gate,up_states=up_states.chunk(2,dim=-1)" in src and "up_states*self.activation_fn(gate)" in src):
            guw, dw = _w(f"{path}.gate_up_proj", mlp.gate_up_proj), _w(f"{path}.down_proj", mlp.down_proj)
            n = guw.n_out // 2
            up, ub = guw.out_rows(n, n), guw.b(n, n)
            readers = [guw.in_cols()]
        else:
            return None
    if dw.n_in != n:
        raise UsageError(f"{path}: up has {n} units but down reads {dw.n_in}")
    act = type(getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))).__name__
    law = SwiGLUUnit.build(f"{path}/unit", layer, up=up, down=dw.in_cols(0, n), up_bias=ub,
                           note=f"gated FFN ({act} gate): the gate is not involved (spec SwiGLU row)")
    ctx.know(dw.bias)
    return _Mlp([law], readers, "gate/up")


def _plain_mlp(ctx, path, mlp, layer, up_name, down_name, act) -> _Mlp:
    """``down(act(up x))``: ReLU / leaky-ReLU unit law, none for GELU / SiLU (spec rows)."""
    uw, dw = _w(f"{path}.{up_name}", getattr(mlp, up_name)), _w(f"{path}.{down_name}", getattr(mlp, down_name))
    n = uw.n_out
    if isinstance(act, (nn.ReLU, nn.LeakyReLU)):
        law = ReLUUnit.build(f"{path}/unit", layer, up=uw.out_rows(0, n), down=dw.in_cols(0, n), up_bias=uw.b(0, n),
                             note=f"{type(act).__name__} FFN")
        ctx.know(dw.bias)
        return _Mlp([law], [uw.in_cols()], up_name)
    ctx.decline(path, f"{type(act).__name__} FFN",
                "no law beyond constants: the activation has no rescaling symmetry (spec: GELU / SiLU FFN row)")
    return _Mlp([], [uw.in_cols()], up_name)


def _fused_experts(ctx, path, ex, layer, num_experts) -> _Mlp | None:
    """3-D expert tensors (``use_experts_implementation``): gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3):
        return None
    if (not getattr(ex, "has_gate", True) or not getattr(ex, "is_concatenated", True)
            or getattr(ex, "has_post_expert_norm", False)):
        return None
    from transformers.integrations import moe as _moe

    if getattr(type(ex), "_apply_gate", _moe._default_apply_gate) is not _moe._default_apply_gate:
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
        laws.append(SwiGLUUnit.build(f"{path}.{e}/unit", layer, up=guw.out_rows(n, n), down=dw.in_cols(0, n),
                                     up_bias=guw.b(n, n),
                                     note=f"expert {e} of fused 3-D tensors ({'transposed' if t else '(E, out, in)'})"))
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
    src = _fwd(gate)
    top_k = getattr(gate, "top_k", None)
    if "softmax(" in src and "sigmoid" not in src:
        law = RouterSum.build(f"{path}/router", layer, weight=rw.out_rows(0, num_experts),
                              bias=rw.b(0, num_experts) if rw.bias else None,
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


def _moe(ctx, path, mlp, layer, config) -> _Mlp | None:
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
            m = _gated_mlp(ctx, f"{path}.experts.{e}", ex, layer)
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
            m = _gated_mlp(ctx, f"{path}.{name}", sh, layer)
            if m is None:
                return None
            laws += m.laws
            readers += m.readers
    sg = getattr(mlp, "shared_expert_gate", None)
    if sg is not None:
        if not (_linear_like(sg) and "sigmoid(self.shared_expert_gate(" in _fwd(mlp)):
            return None
        sw = _w(f"{path}.shared_expert_gate", sg)
        readers.append(sw.in_cols())
        ctx.decline(f"{path}.shared_expert_gate", "sigmoid shared-expert gate",
                    "a scalar sigmoid gate has no rescaling symmetry: no law of its own (it scales the shared "
                    "expert's output, so that expert's unit law holds; it is a reader in the gain law)")
    return _Mlp(laws, readers, "router, experts' gate/up" + (", shared expert" if len(readers) > e_n + 1 else ""))


# -------------------------------------------------------------------------------------------- families
def _embed_and_head(ctx: _Ctx, embed_paths: list, final_norm_path: str | None):
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
    hw = _w(head_path, head)
    if norm is not None:
        _gain(ctx, final_norm_path, norm, None, [hw.in_cols()], head_path)
    loss = ctx.options.get("loss", "ce")
    cap = getattr(config, "final_logit_softcapping", None)
    if loss != "ce":
        ctx.decline(head_path, "translation law", f"holds only for softmax cross-entropy, the loss is {loss!r}")
    elif cap:
        ctx.decline(head_path, "translation law", f"final_logit_softcapping={cap} breaks it (spec breakers)")
    else:
        ctx.laws.append(Translation.build(f"{head_path}/translation", None, weight=hw.out_rows(0, hw.n_out),
                                          bias=hw.b(0, hw.n_out),
                                          note="softmax cross-entropy only (pass loss= to say otherwise)"))


def _num_kv(config, nh):
    nkv = getattr(config, "num_key_value_heads", None)
    return nh if nkv is None else nkv


def _head_dim(config):
    d = getattr(config, "head_dim", None)
    return d if d else config.hidden_size // config.num_attention_heads


def _llama_like(ctx: _Ctx):
    """Pre-norm decoders with ``model.layers[i].{input_layernorm, self_attn, post_attention_layernorm, mlp}``:
    Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3."""
    model, config = ctx.model, ctx.config
    base_path = model.base_model_prefix if hasattr(model, model.base_model_prefix or "") else ""
    base = getattr(model, base_path) if base_path else model
    pre = f"{base_path}." if base_path else ""
    nh = config.num_attention_heads
    nkv, d = _num_kv(config, nh), _head_dim(config)
    rope_emb = getattr(base, "rotary_emb", None)
    for i, layer in enumerate(base.layers):
        lp = f"{pre}layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        ap, mp = f"{lp}.self_attn", f"{lp}.mlp"
        if hasattr(attn, "kv_a_proj_with_mqa"):  # DeepSeek MLA
            ctx.decline(ap, "multi-head latent attention (MLA)",
                        "q and k are built from low-rank latents through RMSNorms (q_a_layernorm, kv_a_layernorm), "
                        "k_nope and v share kv_b_proj and one decoupled RoPE key is shared by all heads: the spec's "
                        "per-head QK/VO rows do not apply as written (spec breakers: MLA, decline with a reason)")
            a_readers = [_w(f"{ap}.{n}", getattr(attn, n)).in_cols() for n in ("q_a_proj", "kv_a_proj_with_mqa")
                         if _linear_like(getattr(attn, n, None))] if hasattr(attn, "q_a_proj") else None
            if a_readers is not None and len(a_readers) == 2:
                _gain(ctx, f"{lp}.input_layernorm", layer.input_layernorm, i, a_readers, "q_a_proj, kv_a_proj_with_mqa")
            else:
                ctx.decline(f"{lp}.input_layernorm", "norm before MLA", "readers not recognised: no gain law")
        else:
            a = _qkvo_attn(ctx, ap, attn, i, config, nh, nkv, d, rope_emb)
            if a is None:
                ctx.decline(f"{lp}.input_layernorm", "norm before an unrecognised attention", "no gain law")
            else:
                ctx.laws.extend(_attn_laws(ctx, a))
                _gain(ctx, f"{lp}.input_layernorm", layer.input_layernorm, i, _attn_readers(a), "q, k, v")
        m = _moe(ctx, mp, mlp, i, config) if hasattr(mlp, "experts") else _gated_mlp(ctx, mp, mlp, i)
        if m is None:
            ctx.decline(f"{lp}.post_attention_layernorm", "norm before an unrecognised MLP", "no gain law")
        else:
            ctx.laws.extend(m.laws)
            _gain(ctx, f"{lp}.post_attention_layernorm", layer.post_attention_layernorm, i, m.readers, m.what)
    _embed_and_head(ctx, [f"{pre}embed_tokens"], f"{pre}norm")


def _gpt2(ctx: _Ctx):
    """GPT-2: Conv1D weights (in, out); c_attn output columns [Q | K | V]; learned absolute positions
    (QK Gram laws hold, with biases); pre-LN blocks ln_1 -> attn, ln_2 -> mlp."""
    model, config = ctx.model, ctx.config
    tr = model.transformer
    nh, h = config.num_attention_heads, config.hidden_size
    d = h // nh
    for i, blk in enumerate(tr.h):
        lp = f"transformer.h.{i}"
        if getattr(blk, "crossattention", None) is not None:
            ctx.decline(f"{lp}.crossattention", "cross-attention", "not analysed (reads encoder states)")
        at = blk.attn
        c = _w(f"{lp}.attn.c_attn", at.c_attn)
        o = _w(f"{lp}.attn.c_proj", at.c_proj)
        a = _Attn(f"{lp}.attn", i, c, c, c, o, d, nh, nh, [x * d for x in range(nh)],
                  [h + x * d for x in range(nh)], [2 * h + x * d for x in range(nh)])
        ctx.laws.extend(_attn_laws(ctx, a))
        _gain(ctx, f"{lp}.ln_1", blk.ln_1, i, [c.in_cols()], "c_attn (q, k, v)")
        m = _plain_mlp(ctx, f"{lp}.mlp", blk.mlp, i, "c_fc", "c_proj", blk.mlp.act)
        ctx.laws.extend(m.laws)
        _gain(ctx, f"{lp}.ln_2", blk.ln_2, i, m.readers, "c_fc")  # holds whatever the activation
    _embed_and_head(ctx, ["transformer.wte", "transformer.wpe"], "transformer.ln_f")


def _neox(ctx: _Ctx):
    """GPT-NeoX: ``query_key_value`` per head [q_h | k_h | v_h] (view(..., nH, 3D).chunk(3)); partial
    rotary; parallel residual: attention reads input_layernorm, the MLP post_attention_layernorm (both
    from the same residual input), so each norm has its own gain law."""
    model, config = ctx.model, ctx.config
    base = model.gpt_neox
    nh, h = config.num_attention_heads, config.hidden_size
    d = h // nh
    for i, layer in enumerate(base.layers):
        lp = f"gpt_neox.layers.{i}"
        at = layer.attention
        qkv = _w(f"{lp}.attention.query_key_value", at.query_key_value)
        o = _w(f"{lp}.attention.dense", at.dense)
        a = _Attn(f"{lp}.attention", i, qkv, qkv, qkv, o, d, nh, nh, [x * 3 * d for x in range(nh)],
                  [x * 3 * d + d for x in range(nh)], [x * 3 * d + 2 * d for x in range(nh)])
        if getattr(at, "rotary_ndims", None) is not None and at.rotary_ndims != _rotary_dim(config, d, base.rotary_emb):
            raise UsageError(f"{lp}: rotary_ndims={at.rotary_ndims} disagrees with the config")
        r = _rotary_dim(config, d, base.rotary_emb)
        a.rope = (r, _rope_layout(ctx, at, d, r))
        ctx.laws.extend(_attn_laws(ctx, a))
        _gain(ctx, f"{lp}.input_layernorm", layer.input_layernorm, i, [qkv.in_cols()], "query_key_value")
        m = _plain_mlp(ctx, f"{lp}.mlp", layer.mlp, i, "dense_h_to_4h", "dense_4h_to_h", layer.mlp.act)
        ctx.laws.extend(m.laws)
        _gain(ctx, f"{lp}.post_attention_layernorm", layer.post_attention_layernorm, i, m.readers, m.what)
    _embed_and_head(ctx, ["gpt_neox.embed_in"], "gpt_neox.final_layer_norm")


def _falcon(ctx: _Ctx):
    """Falcon: fused ``query_key_value``: multi-query [Q_0..Q_{nH-1} | K | V]; classic per head
    [q_h k_h v_h]; new decoder architecture per kv group [q (rep heads) | k_j | v_j]. RoPE (rotate_half)
    or ALiBi (no RoPE: QK Gram laws). Parallel attention: one norm read by attention and MLP."""
    model, config = ctx.model, ctx.config
    tr = model.transformer
    nh, h = config.num_attention_heads, config.hidden_size
    d = h // nh
    for i, blk in enumerate(tr.h):
        lp = f"transformer.h.{i}"
        at = blk.self_attention
        qkv = _w(f"{lp}.self_attention.query_key_value", at.query_key_value)
        o = _w(f"{lp}.self_attention.dense", at.dense)
        if config.new_decoder_architecture:
            nkv = config.num_kv_heads
            rep = nh // nkv
            blk_rows = (rep + 2) * d
            qs = [(x // rep) * blk_rows + (x % rep) * d for x in range(nh)]
            ks = [j * blk_rows + rep * d for j in range(nkv)]
            vs = [j * blk_rows + (rep + 1) * d for j in range(nkv)]
        elif config.multi_query:
            nkv = 1
            qs, ks, vs = [x * d for x in range(nh)], [nh * d], [(nh + 1) * d]
        else:
            nkv = nh
            qs, ks, vs = ([x * 3 * d + s * d for x in range(nh)] for s in range(3))
        if qkv.n_out != (nh + 2 * nkv) * d:
            raise UsageError(f"{lp}: query_key_value has {qkv.n_out} rows, expected {(nh + 2 * nkv) * d}")
        a = _Attn(f"{lp}.self_attention", i, qkv, qkv, qkv, o, d, nh, nkv, qs, ks, vs)
        if not config.alibi:
            r = _rotary_dim(config, d, getattr(tr, "rotary_emb", None))
            a.rope = (r, _rope_layout(ctx, at, d, r))
        ctx.laws.extend(_attn_laws(ctx, a))
        m = _plain_mlp(ctx, f"{lp}.mlp", blk.mlp, i, "dense_h_to_4h", "dense_4h_to_h", blk.mlp.act)
        ctx.laws.extend(m.laws)
        if hasattr(blk, "ln_attn"):
            _gain(ctx, f"{lp}.ln_attn", blk.ln_attn, i, [qkv.in_cols()], "query_key_value")
            _gain(ctx, f"{lp}.ln_mlp", blk.ln_mlp, i, m.readers, m.what)
        elif hasattr(blk, "post_attention_layernorm"):
            _gain(ctx, f"{lp}.input_layernorm", blk.input_layernorm, i, [qkv.in_cols()], "query_key_value")
            _gain(ctx, f"{lp}.post_attention_layernorm", blk.post_attention_layernorm, i, m.readers, m.what)
        else:  # parallel attention, one norm read by both
            _gain(ctx, f"{lp}.input_layernorm", blk.input_layernorm, i, [qkv.in_cols()] + m.readers,
                  f"query_key_value and {m.what} (parallel attention)")
    _embed_and_head(ctx, ["transformer.word_embeddings"], "transformer.ln_f")


def _bert(ctx: _Ctx):
    """BERT (post-LN): absolute positions, so per-head QK and VO Grams hold with biases; GELU FFN: none;
    LayerNorms sit on the residual stream (post-LN): no gain law."""
    model, config = ctx.model, ctx.config
    bert = model.bert if hasattr(model, "bert") else model
    pre = "bert." if bert is not model else ""
    nh, h = config.num_attention_heads, config.hidden_size
    d = h // nh
    if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        raise UsageError(f"BERT with position_embedding_type={config.position_embedding_type!r} is not analysed")
    for i, layer in enumerate(bert.encoder.layer):
        lp = f"{pre}encoder.layer.{i}"
        sa = layer.attention.self
        q, k, v = (_w(f"{lp}.attention.self.{n}", getattr(sa, n)) for n in ("query", "key", "value"))
        o = _w(f"{lp}.attention.output.dense", layer.attention.output.dense)
        starts = [x * d for x in range(nh)]
        ctx.laws.extend(_attn_laws(ctx, _Attn(f"{lp}.attention", i, q, k, v, o, d, nh, nh, starts, starts, starts)))
        if getattr(layer, "crossattention", None) is not None:
            ctx.decline(f"{lp}.crossattention", "cross-attention", "not analysed (reads encoder states)")
        for p in (f"{lp}.attention.output.LayerNorm", f"{lp}.output.LayerNorm"):
            ctx.decline(p, "post-LN LayerNorm",
                        "no gain law: the normed vector is the residual stream itself (read by the skip connection, "
                        "not only by linear maps) (spec breakers: post-LN)")
        act = layer.intermediate.intermediate_act_fn
        uw, dw = _w(f"{lp}.intermediate.dense", layer.intermediate.dense), _w(f"{lp}.output.dense", layer.output.dense)
        if isinstance(act, (nn.ReLU, nn.LeakyReLU)):
            n = uw.n_out
            ctx.laws.append(ReLUUnit.build(f"{lp}.intermediate/unit", i, up=uw.out_rows(0, n), down=dw.in_cols(0, n),
                                           up_bias=uw.b(0, n), note=f"{type(act).__name__} FFN"))
            ctx.know(dw.bias)
        else:
            ctx.decline(f"{lp}.intermediate", f"{type(act).__name__} FFN",
                        "no law beyond constants: the activation has no rescaling symmetry (spec: GELU FFN row)")
            ctx.decline(f"{lp}.output.dense", f"{type(act).__name__} FFN output", "see the FFN above")
    ctx.decline(f"{pre}embeddings", "embeddings + post-LN LayerNorm", NO_EMBED + "; its LayerNorm feeds the "
                "residual stream (post-LN): no gain law")
    if getattr(bert, "pooler", None) is not None:
        ctx.decline(f"{pre}pooler", "tanh pooler", "no rescaling symmetry: no law")
    for name, mod in model.named_children():
        if name != "bert" and bert is not model:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            tied = head is not None and head.weight is model.get_input_embeddings().weight
            ctx.decline(name, f"{type(mod).__name__} head",
                        ("tied decoder: no translation law (spec breakers: tied embeddings); " if tied else "")
                        + "the transform (dense -> GELU -> LayerNorm) has no law")


_FAMILIES = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "qwen3": _llama_like, "gemma": _llama_like,
    "phi3": _llama_like, "mixtral": _llama_like, "qwen2_moe": _llama_like, "olmoe": _llama_like,
    "deepseek_v3": _llama_like, "gpt2": _gpt2, "gpt_neox": _neox, "falcon": _falcon, "bert": _bert,
}


@register("hf")
def detect_hf(model, config, **options):
    """Laws of an HF ``PreTrainedModel`` (see the module docstring); None for other models."""
    transformers = sys.modules.get("transformers")  # an HF model's class comes from it: already imported
    try:
        base = transformers.PreTrainedModel if transformers is not None else None
    except Exception:  # noqa: BLE001 - transformers present but not importable (broken optional dependency)
        base = None
    if base is None or not isinstance(model, base):
        return None
    config = config if config is not None else model.config
    ctx = Collector(model, options, config=config)
    fam = _FAMILIES.get(getattr(config, "model_type", None))
    if fam is None:
        ctx.decline("", f"model_type={getattr(config, 'model_type', None)!r}",
                    f"no HF family handler (known: {sorted(_FAMILIES)}); every parameterised module is listed as "
                    "'no law detected'")
        d = finish(model, [], [], detector="hf")
        d.declined = ctx.declined
        return d
    fam(ctx)
    return ctx.finish("hf")


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
        try:
            auto._model_mapping[type(config)]  # noqa: B018
            return auto
        except KeyError:
            continue
    raise UsageError(f"transformers has no model class for config {type(config).__name__}")


def detect_from_config(config, **options) -> Detection:
    """Laws of the HF model a config describes, from shapes only (the model is built on the meta device:
    no weights are allocated or read). ``config``: a ``transformers.PretrainedConfig`` (or a dict with
    ``model_type``). For weights whose row order may differ from HF's code (raw checkpoints) pass
    ``require_rope_layout=True`` and ``rope_layout=``. Raises UsageError when the model cannot be built."""
    import transformers

    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    cls = _model_class(config)
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    from .core import detect

    return detect(model, config, **options)
