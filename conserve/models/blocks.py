"""Transformer building blocks that declare their own conservation laws.

Every module here has ``conservation_laws(prefix, layer) -> (laws, declined)``, naming its parameters
exactly as ``named_parameters()`` does under ``prefix``. Parameter names follow HF Llama:
``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``mlp.router``, ``mlp.experts.{e}``,
``mlp.shared_expert``, ``input_layernorm``, ``post_attention_layernorm``.
Math: ``../shared/spec/laws.md`` (catalogue rows named in each docstring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..detection import builders
from ..laws import (Declined, GainBalance, QKGram, ReLUUnit, RopePairs, RopePassGram, RouterSum, SwiGLUUnit,
                    Translation, VOGram, cols, rows, vector)

ACTIVATIONS = ("swiglu", "relu", "gelu", "silu")


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (H)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, hidden_size: int) -> nn.Module:
    if kind == "rms":
        return RMSNorm(hidden_size)
    if kind == "layer":
        return nn.LayerNorm(hidden_size)
    raise ValueError(f"norm must be 'rms' or 'layer', got {kind!r}")


def gain_law(prefix: str, norm: nn.Module, layer, readers: list, name: str):
    """Pre-norm gain law of ``norm`` read by the ``readers`` (column refs); spec: pre-norm gain row."""
    return builders.gain_law(f"{prefix}/gain", layer, f"{prefix}.weight", norm.weight.shape[0], readers=readers,
                             bias=f"{prefix}.bias" if getattr(norm, "bias", None) is not None else None,
                             note=f"readers: {name}")


def linear_cols(prefix: str, lin: nn.Linear):
    """Column view (one row per input feature) of a Linear's weight."""
    return builders.in_cols(f"{prefix}.weight", lin.weight.shape)


# ----------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: ``rotary_dim`` leading dims of each head, ``layout`` 'half' (HF
    rotate_half) or 'interleaved' (GPT-J), base ``theta``."""

    rotary_dim: int
    layout: str = "half"
    theta: float = 10000.0


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: (B, heads, T, D) -> same, rotating the first ``rotary_dim`` dims of each head."""
    t, r = x.shape[-2], rope.rotary_dim
    inv = rope.theta ** (-torch.arange(0, r, 2, device=x.device, dtype=torch.float64) / r)
    ang = torch.arange(t, device=x.device, dtype=torch.float64)[:, None] * inv[None, :]  # (T, R/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    if rope.layout == "half":
        a, b = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    elif rope.layout == "interleaved":
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    else:
        raise ValueError(f"RoPE layout must be 'half' or 'interleaved', got {rope.layout!r}")
    return torch.cat([out, xp], -1)


class Attention(nn.Module):
    """Causal (or bidirectional) multi-head attention with GQA/MQA: ``num_attention_heads`` query heads
    of ``head_dim``, ``num_key_value_heads`` kv heads; query head i reads kv head ``i // (nH // nKV)``."""

    def __init__(self, hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int, *,
                 rope: Rope | None = None, bias: bool = False, causal: bool = True):
        super().__init__()
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={num_key_value_heads}")
        if rope is not None and not (0 < rope.rotary_dim <= head_dim and rope.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={rope.rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.nh, self.nkv, self.d, self.rope, self.causal = num_attention_heads, num_key_value_heads, head_dim, rope, causal
        self.q_proj = nn.Linear(hidden_size, self.nh * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, self.nkv * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, self.nkv * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.nh * head_dim, hidden_size, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        if self.rope is not None:
            q, k = apply_rope(q, self.rope), apply_rope(k, self.rope)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        y = att.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.d))

    def conservation_laws(self, prefix: str, layer=None):
        """QK Gram (no RoPE) or RoPE pairs (+ pass-through Gram if rotary_dim < head_dim), and VO Gram,
        per kv group (spec: MHA, GQA/MQA, RoPE, partial rotary rows)."""
        d, rep, laws = self.d, self.nh // self.nkv, []
        q, k, v, o = (f"{prefix}.{n}_proj" for n in "qkvo")
        qs, ks, vs, os_ = (m.weight.shape for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))
        bias = self.q_proj.bias is not None

        def vb(p, s, n):
            return vector(f"{p}.bias", s, n) if bias else None

        for j in range(self.nkv):
            heads = range(j * rep, (j + 1) * rep)
            if self.rope is None:
                laws.append(QKGram.build(
                    f"{prefix}/qk/group{j}", layer,
                    plus=[r for i in heads for r in (rows(f"{q}.weight", qs, i * d, d), vb(q, i * d, d))],
                    minus=[rows(f"{k}.weight", ks, j * d, d), vb(k, j * d, d)]))
            else:
                r = self.rope.rotary_dim
                laws.append(RopePairs.build(
                    f"{prefix}/rope/group{j}", layer, q_weight=f"{q}.weight", q_shape=qs,
                    q_starts=[i * d for i in heads], k_weight=f"{k}.weight", k_shape=ks, k_starts=[j * d],
                    rotary_dim=r, layout=self.rope.layout, q_bias=f"{q}.bias" if bias else None,
                    k_bias=f"{k}.bias" if bias else None))
                if r < d:
                    laws.append(RopePassGram.build(
                        f"{prefix}/rope_pass/group{j}", layer,
                        plus=[x for i in heads for x in (rows(f"{q}.weight", qs, i * d + r, d - r), vb(q, i * d + r, d - r))],
                        minus=[rows(f"{k}.weight", ks, j * d + r, d - r), vb(k, j * d + r, d - r)]))
            laws.append(VOGram.build(
                f"{prefix}/vo/group{j}", layer, plus=[rows(f"{v}.weight", vs, j * d, d), vb(v, j * d, d)],
                minus=[cols(f"{o}.weight", os_, i * d, d) for i in heads]))
        return laws, []

    def readers(self, prefix: str):
        return [linear_cols(f"{prefix}.{n}_proj", getattr(self, f"{n}_proj")) for n in "qkv"]


# ----------------------------------------------------------------------------------------------- FFN
class FFN(nn.Module):
    """``down(act(gate x) * up x)`` for ``activation='swiglu'``, else ``down(act(up x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "swiglu", bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        if activation == "swiglu":
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[self.activation]
        return self.down_proj(act(self.up_proj(x)))

    def conservation_laws(self, prefix: str, layer=None):
        """Unit balance per hidden unit for SwiGLU and ReLU (spec rows); none for GELU/SiLU."""
        if self.activation in ("gelu", "silu"):
            return [], [Declined(prefix, f"{self.activation.upper()} FFN",
                                 "no law beyond constants: the activation has no rescaling symmetry (seed paper)")]
        up, down = self.up_proj, self.down_proj
        cls = SwiGLUUnit if self.activation == "swiglu" else ReLUUnit
        law = builders.unit_law(cls, f"{prefix}/unit", layer, up=f"{prefix}.up_proj.weight", up_shape=up.weight.shape,
                                units=range(up.out_features), down=f"{prefix}.down_proj.weight",
                                down_shape=down.weight.shape,
                                up_bias=f"{prefix}.up_proj.bias" if up.bias is not None else None)
        return [law], []

    def readers(self, prefix: str):
        names = ["gate_proj", "up_proj"] if self.activation == "swiglu" else ["up_proj"]
        return [linear_cols(f"{prefix}.{n}", getattr(self, n)) for n in names]


class MoE(nn.Module):
    """Mixture of experts: ``router`` (Linear H -> E, no bias), ``experts`` (SwiGLU FFNs), ``top_k``.

    ``gating='softmax'``: p = softmax(router x), top-k, renormalised over the top-k if ``norm_topk``.
    ``gating='sigmoid'``: s = sigmoid(router x), top-k, g_k = s_k / sum_{top-k} s (DeepSeek-V3 style).
    An optional ``shared_expert`` is always on. Computed densely (exact gates; tiny models only)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 gating: str = "softmax", norm_topk: bool = True, shared_expert: bool = False, bias: bool = False):
        super().__init__()
        if gating not in ("softmax", "sigmoid"):
            raise ValueError(f"gating must be 'softmax' or 'sigmoid', got {gating!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.gating, self.norm_topk = top_k, gating, norm_topk
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(FFN(hidden_size, intermediate_size, "swiglu", bias) for _ in range(num_experts))
        self.shared_expert = FFN(hidden_size, intermediate_size, "swiglu", bias) if shared_expert else None

    def gates(self, x):
        z = self.router(x)
        s = z.softmax(-1) if self.gating == "softmax" else torch.sigmoid(z)
        top = s.topk(self.top_k, -1).indices
        mask = torch.zeros_like(s).scatter(-1, top, 1.0)
        g = s * mask
        if self.gating == "sigmoid" or self.norm_topk:
            g = g / g.sum(-1, keepdim=True)
        return g

    def forward(self, x):
        g = self.gates(x)
        y = sum(g[..., e: e + 1] * exp(x) for e, exp in enumerate(self.experts))
        return y + self.shared_expert(x) if self.shared_expert is not None else y

    def conservation_laws(self, prefix: str, layer=None):
        """SwiGLU law per expert (shared expert too) and the router-sum law for softmax gating
        (spec: MoE rows). Normalised-sigmoid gating is declined (spec open row, docs/router_sigmoid.md)."""
        laws, declined = [], []
        for e, exp in enumerate(self.experts):
            laws += exp.conservation_laws(f"{prefix}.experts.{e}", layer)[0]
        if self.shared_expert is not None:
            laws += self.shared_expert.conservation_laws(f"{prefix}.shared_expert", layer)[0]
        w = self.router.weight
        if self.gating == "softmax":
            laws.append(RouterSum.build(f"{prefix}/router", layer, weight=rows(f"{prefix}.router.weight", w.shape, 0, w.shape[0])))
        elif self.top_k == 1:
            declined.append(Declined(f"{prefix}.router", "sigmoid router, top_k=1",
                                     "g = s_k / s_k = 1: the router gets no gradient and is trivially frozen"))
        else:
            declined.append(Declined(f"{prefix}.router", f"normalised-sigmoid router, top_k={self.top_k}",
                                     "sum_e W_router[e,:] is not conserved: sum_e dg_k/dz_e = g_k(sum_i g_i s_i - s_k) != 0 "
                                     "(spec: open row; measured in docs/router_sigmoid.md)"))
        return laws, declined

    def readers(self, prefix: str):
        out = [linear_cols(f"{prefix}.router", self.router)]
        for e, exp in enumerate(self.experts):
            out += exp.readers(f"{prefix}.experts.{e}")
        if self.shared_expert is not None:
            out += self.shared_expert.readers(f"{prefix}.shared_expert")
        return out


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1 x)``, then ``x + mlp(norm2 x)``."""

    def __init__(self, attn: Attention, mlp: nn.Module, hidden_size: int, norm: str = "rms"):
        super().__init__()
        self.input_layernorm = make_norm(norm, hidden_size)
        self.self_attn = attn
        self.post_attention_layernorm = make_norm(norm, hidden_size)
        self.mlp = mlp

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def conservation_laws(self, prefix: str, layer=None):
        """Attention and MLP laws plus the two pre-norm gain laws (spec: pre-norm gain row)."""
        a_laws, a_dec = self.self_attn.conservation_laws(f"{prefix}.self_attn", layer)
        m_laws, m_dec = self.mlp.conservation_laws(f"{prefix}.mlp", layer)
        gains = [gain_law(f"{prefix}.input_layernorm", self.input_layernorm, layer,
                          self.self_attn.readers(f"{prefix}.self_attn"), "q, k, v"),
                 gain_law(f"{prefix}.post_attention_layernorm", self.post_attention_layernorm, layer,
                          self.mlp.readers(f"{prefix}.mlp"), "mlp inputs (gate/up; router and experts in MoE)")]
        return a_laws + m_laws + gains, a_dec + m_dec


def stack_laws(layers, norm: nn.Module, head: str, head_linear: nn.Linear, *, head_bias: bool = False,
               tied: bool = False):
    """Laws of a pre-norm stack ``layers.{i}`` -> ``norm`` -> output Linear ``head``: every block's laws,
    then, for an untied head, the final-norm gain law (read by the head) and the head's translation law
    (softmax cross-entropy only; spec: untied output layer row). A tied head is declined: its weight
    also feeds the input (spec: breakers)."""
    laws, declined = [], []
    for i, layer in enumerate(layers):
        l_, d_ = layer.conservation_laws(f"layers.{i}", i)
        laws += l_
        declined += d_
    if tied:
        declined.append(Declined(head, "tied input/output embeddings",
                                 f"the translation law and the final-norm gain law need an untied {head}: "
                                 "the tied weight also feeds the input"))
        return laws, declined
    w = head_linear.weight
    laws.append(gain_law("norm", norm, None, [cols(f"{head}.weight", w.shape, 0, w.shape[1])], head))
    laws.append(Translation.build(f"{head}/translation", None, weight=rows(f"{head}.weight", w.shape, 0, w.shape[0]),
                                  bias=vector(f"{head}.bias", 0, w.shape[0]) if head_bias else None,
                                  note="softmax cross-entropy only"))
    return laws, declined
