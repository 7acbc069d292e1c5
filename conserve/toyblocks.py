"""Tiny canonical blocks and the law counts the theory predicts for them (spec check 4).

Each :class:`Instance` is a block, a batch of float64 inputs and the expected number of independent
conservation laws with the reason (the spec's catalogue, /work/shared/spec/laws.md). They feed
``tests/test_count.py`` and the router study in ``docs/router_sigmoid.md``:

    python -m conserve.toyblocks            # every instance: expected vs measured
    python -m conserve.toyblocks router     # the normalised-sigmoid router study

Conventions follow the spec: ``nn.Linear`` weights ``(out, in)``; head ``i`` owns rows
``[i*D, (i+1)*D)`` of q/k/v and columns of o; GQA query head ``i`` reads kv head ``i // (nH // nKV)``;
RoPE is the half-split (``rotate_half``) layout on the first ``rotary_dim`` dims of each head.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "FFN",
    "SwiGLU",
    "Attention",
    "MoE",
    "Instance",
    "instances",
    "router_study",
]


class FFN(nn.Module):
    """``fc_out(act(fc_in x))``; x ``(N, d_in)`` -> ``(N, d_out)``."""

    def __init__(self, d_in: int, width: int, d_out: int, act: Callable, bias: bool = True):
        super().__init__()
        self.fc_in = nn.Linear(d_in, width, bias=bias)
        self.fc_out = nn.Linear(width, d_out, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


class SwiGLU(nn.Module):
    """``down(silu(gate x) * up x)``; x ``(..., H)`` -> ``(..., H)``."""

    def __init__(self, hidden: int, inter: int, up_bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=up_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention, softmax over all keys (no mask).

    x ``(B, T, H)`` -> ``(B, T, H)``. ``rotary_dim`` (even, <= head_dim) applies half-split RoPE
    with base ``rope_base`` at positions ``0..T-1`` to the first ``rotary_dim`` dims of q and k.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        num_key_value_heads: int | None = None,
        rotary_dim: int = 0,
        rope_base: float = 10.0,
        q_bias: bool = False,
        k_bias: bool = False,
        v_bias: bool = False,
    ):
        super().__init__()
        nkv = num_key_value_heads or num_heads
        if num_heads % nkv:
            raise ValueError("num_heads must be a multiple of num_key_value_heads")
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError("rotary_dim must be even and <= head_dim")
        self.nh, self.nkv, self.d, self.r, self.base = num_heads, nkv, head_dim, rotary_dim, rope_base
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=q_bias)
        self.k_proj = nn.Linear(hidden, nkv * head_dim, bias=k_bias)
        self.v_proj = nn.Linear(hidden, nkv * head_dim, bias=v_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def _rope(self, x):  # x (B, heads, T, D)
        if not self.r:
            return x
        T, R = x.shape[-2], self.r
        inv = self.base ** (-torch.arange(0, R, 2, dtype=x.dtype) / R)
        ang = torch.arange(T, dtype=x.dtype)[:, None] * inv[None, :]  # (T, R/2)
        ang = torch.cat([ang, ang], dim=-1)
        xr, xp = x[..., :R], x[..., R:]
        xr = xr * ang.cos() + _rotate_half(xr) * ang.sin()
        return torch.cat([xr, xp], dim=-1)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)
        q, k = self._rope(q), self._rope(k)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * self.d)
        return self.o_proj(y)


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts; x ``(N, H)`` -> ``(N, H)``.

    router ``"softmax"``: ``p = softmax(z)``, gates ``p_k`` of the top-k (``renorm``: divided by their sum);
    router ``"sigmoid"``: ``s = sigmoid(z)``, gates ``s_k / sum_{i in topk} s_i`` (``renorm``) or ``s_k``.
    ``z = router(x)`` (no bias). Experts are evaluated densely and masked (ties have probability 0).
    """

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, router: str = "softmax",
                 renorm: bool = True):
        super().__init__()
        if router not in ("softmax", "sigmoid"):
            raise ValueError("router must be 'softmax' or 'sigmoid'")
        self.kind, self.top_k, self.renorm = router, top_k, renorm
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(num_experts))

    def gates(self, x):
        z = self.router(x)
        s = torch.softmax(z, dim=-1) if self.kind == "softmax" else torch.sigmoid(z)
        kth = torch.topk(s, self.top_k, dim=-1).values[..., -1:]
        g = s * (s >= kth).to(s.dtype)
        return g / g.sum(-1, keepdim=True) if self.renorm else g

    def forward(self, x):
        g = self.gates(x)  # (N, E)
        ys = torch.stack([e(x) for e in self.experts], dim=-1)  # (N, H, E)
        return (ys * g[:, None, :]).sum(-1)


@dataclass
class Instance:
    """A tiny block, its inputs and the law count the theory predicts (with the reason)."""

    name: str
    block: nn.Module
    inputs: torch.Tensor
    expected: int
    why: str


def seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(seed)
    return make().double()


def instances(seed: int = 0) -> list[Instance]:
    """The canonical tiny instances (float64, random init from ``seed``)."""
    g = torch.Generator().manual_seed(seed + 1000)

    def x(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    out = []
    out.append(Instance(
        "gelu_ffn", seeded(seed, lambda: FFN(3, 4, 2, F.gelu)), x(40, 3), 0,
        "GELU FFN with biases: no law (spec: none beyond constants)"))
    out.append(Instance(
        "silu_ffn", seeded(seed, lambda: FFN(3, 4, 2, F.silu)), x(40, 3), 0,
        "SiLU FFN with biases: no law"))
    out.append(Instance(
        "relu_ffn_bias", seeded(seed, lambda: FFN(3, 5, 2, F.relu)), x(240, 3), 5,
        "ReLU FFN, width I=5, with biases: one law per unit ||w_in,u||^2 + b_in,u^2 - ||w_out[:,u]||^2"))
    out.append(Instance(
        "relu_ffn", seeded(seed, lambda: FFN(3, 4, 2, F.relu, bias=False)), x(60, 3), 4,
        "ReLU FFN, width I=4, no bias: one law per unit"))
    out.append(Instance(
        "linear2", seeded(seed, lambda: FFN(4, 2, 3, lambda t: t, bias=False)), x(30, 4), 3,
        "two-layer linear 4->2->3: W1 W1^T - W2^T W2, n1(n1+1)/2 = 3 (Marcotte et al. 2023)"))
    out.append(Instance(
        "swiglu", seeded(seed, lambda: SwiGLU(3, 3)), x(40, 3), 3,
        "SwiGLU H=3, I=3: one law per unit (up/down scaling), gate free"))
    out.append(Instance(
        "swiglu_upbias", seeded(seed, lambda: SwiGLU(3, 2, up_bias=True)), x(40, 3), 2,
        "SwiGLU H=3, I=2 with up bias: one law per unit"))
    out.append(Instance(
        "mha", seeded(seed, lambda: Attention(4, 2, 2)), x(8, 4, 4), 12,
        "MHA nH=2, D=2, H=4: per head D(D+1)/2 (QK) + D(D+1)/2 (VO) -> nH*D(D+1) = 12"))
    out.append(Instance(
        "mha_qkv_bias", seeded(seed, lambda: Attention(4, 2, 2, q_bias=True, k_bias=True, v_bias=True)),
        x(8, 4, 4), 16,
        "MHA nH=2, D=2 with q/k/v biases: 12 Gram laws (q,v biases inside them) + the key bias "
        "gets zero gradient, nH*D = 4 frozen entries -> 16"))
    out.append(Instance(
        "rope", seeded(seed, lambda: Attention(4, 2, 4, rotary_dim=4)), x(6, 5, 4), 24,
        "RoPE nH=2, D=4 (full rotary): per head D/2 pair laws + D(D+1)/2 VO = 2 + 10 -> 24"))
    out.append(Instance(
        "rope_partial", seeded(seed, lambda: Attention(4, 1, 4, rotary_dim=2)), x(6, 5, 4), 14,
        "partial RoPE nH=1, D=4, R=2: 1 pair law + D'(D'+1)/2 = 3 pass-through Gram + 10 VO = 14"))
    out.append(Instance(
        "gqa", seeded(seed, lambda: Attention(4, 4, 2, num_key_value_heads=2)), x(8, 4, 4), 12,
        "GQA nH=4, nKV=2, D=2, H=4: one GL(D) per kv group, nKV*D(D+1) = 12"))
    out.append(Instance(
        "moe_softmax_top2", seeded(seed, lambda: MoE(3, 2, 3, 2, "softmax")), x(60, 3), 3 * 2 + 3,
        "MoE E=3 SwiGLU experts (I=2), softmax top-2 renorm, H=3: E*I unit laws + H router sum = 9"))
    return out


def violation(block: nn.Module, x: torch.Tensor, direction: dict[str, torch.Tensor]) -> float:
    """Relative first-order violation max_o |<grad h, grad f_o>| / (||grad h|| ||grad f_o||) of a
    linear law with gradient ``direction`` (spec check 1), by forward mode over the whole batch."""
    from torch.func import functional_call, jvp

    params = {n: p.detach() for n, p in block.named_parameters()}
    tangent = {n: direction.get(n, torch.zeros_like(p)) for n, p in params.items()}

    def f(p):
        return functional_call(block, p, (x,)).reshape(-1)

    _, df = jvp(f, (params,), (tangent,))
    jac = torch.func.jacrev(f)(params)
    gnorm = torch.sqrt(sum(j.reshape(j.shape[0], -1).pow(2).sum(1) for j in jac.values()))
    hnorm = math.sqrt(sum(float(t.pow(2).sum()) for t in tangent.values()))
    return float((df.abs() / (gnorm * hnorm).clamp_min(1e-300)).max())


def router_study(seed: int = 0, num_experts: int = 4, hidden: int = 3, inter: int = 2):
    """Count laws and check the router-sum law for softmax / normalised-sigmoid routers.

    Returns a list of rows ``(router, top_k, renorm, unit_laws, LawCount, violation)`` where
    ``unit_laws = num_experts * inter`` (the experts' SwiGLU laws) and
    ``violation`` is the relative first-order violation of ``h = <c, sum_e W_router[e,:]>`` for a
    random ``c`` (spec check 1)."""
    from .counting import count_laws

    rows = []
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(80, hidden, generator=g, dtype=torch.float64)
    c = torch.randn(hidden, generator=g, dtype=torch.float64)
    configs = [(kind, k, True) for kind in ("softmax", "sigmoid") for k in range(1, num_experts + 1)]
    configs += [("softmax", 1, False), ("sigmoid", 2, False)]
    for kind, k, renorm in configs:
        moe = seeded(seed, lambda: MoE(hidden, inter, num_experts, k, kind, renorm))
        res = count_laws(moe, x)
        viol = violation(moe, x, {"router.weight": c.expand(num_experts, hidden).clone()})
        rows.append((kind, k, renorm, num_experts * inter, res, viol))
    return rows


def _main(argv: list[str]) -> None:
    from .counting import count_laws

    if argv[:1] == ["router"]:
        print("E=4 SwiGLU experts (I=2), H=3, 80 inputs, float64; unit laws alone = E*I = 8")
        print("| router | top_k | renorm | params | laws | laws - E*I | gap ratio | next ratio "
              "| router-sum first-order violation |")
        print("|---|---|---|---|---|---|---|---|---|")
        for kind, k, renorm, base, res, viol in router_study():
            print(f"| {kind} | {k} | {'yes' if renorm else 'no'} | {res.num_params} | {res.count} | "
                  f"{res.count - base} | {res.gap_ratio:.1e} | {res.second_gap_ratio:.1e} | {viol:.1e} |")
        return
    for inst in instances():
        res = count_laws(inst.block, inst.inputs)
        flag = "ok " if res.count == inst.expected else "DIFF"
        print(f"{flag} {inst.name:18} expected {inst.expected:3d}  {res.summary()}")


if __name__ == "__main__":
    _main(sys.argv[1:])
