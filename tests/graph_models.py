"""Plain torch.nn models nobody registered a detector for (tests of conserve.detection.graph)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MyMLP(nn.Module):
    """A user's own MLP with named attributes: ``b(relu(a(x)))``."""

    def __init__(self, act=F.relu):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.act = act

    def forward(self, x):
        return self.b(self.act(self.a(x)))


# ------------------------------------------------------------------------------------- nanoGPT
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, flash):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, flash):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias=True)
        self.attn = CausalSelfAttention(n_embd, n_head, flash)
        self.ln_2 = LayerNorm(n_embd, bias=True)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT (Karpathy): fused ``c_attn`` split by columns, learned positions, GELU MLP, tied or untied head,
    ``assert`` on the sequence length (torch.fx cannot trace it: torch.export is used)."""

    def __init__(self, vocab=17, n_embd=16, n_head=4, n_layer=2, tied=True, flash=False):
        super().__init__()
        self.block_size = 16
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(16, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, flash) for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias=True)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return self.lm_head(x), None


# ------------------------------------------------------------------------------ torchtitan Llama
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TTAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention = TTAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """torchtitan's Llama: wq/wk/wv/wo, GQA by ``repeat_kv`` (expand), RoPE by complex multiplication of
    adjacent pairs (``view_as_complex``: interleaved), SwiGLU w1/w3/w2, RMSNorm, untied ``output``."""

    def __init__(self, vocab=17, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden=12):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, 32), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[0: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------------------ MoE
class Expert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.fc_in = nn.Linear(h, 2 * i)  # fused [gate | up]
        self.fc_out = nn.Linear(i, h)

    def forward(self, x):
        g, u = self.fc_in(x).chunk(2, dim=-1)
        return self.fc_out(F.silu(g) * u)


class Top2MoE(nn.Module):
    """A hand-written top-2 MoE: softmax router, top-2 renormalised gates, token dispatch by index."""

    def __init__(self, h=8, i=6, experts=3, top_k=2):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.router = nn.Linear(h, experts, bias=True)
        self.experts = nn.ModuleList([Expert(h, i) for _ in range(experts)])
        self.top_k = top_k

    def forward(self, x):
        b, t, h = x.shape
        z = self.norm(x).reshape(-1, h)
        probs = F.softmax(self.router(z), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(z)
        for e, expert in enumerate(self.experts):
            gate = (w * (idx == e)).sum(-1, keepdim=True)
            out = out + gate * expert(z)
        return x + out.reshape(b, t, h)


class Unknown(nn.Module):
    """An MLP with a catalogue law next to a block that has none (a conv whose output a residual reads) and a
    squared ReLU (homogeneous of degree 2: its own unit law)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 1)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.sq_in = nn.Linear(8, 12)
        self.sq_out = nn.Linear(12, 8)

    def forward(self, x):  # (B, T, 8)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = x + self.down(F.leaky_relu(self.up(x), 0.1))
        return x + self.sq_out(F.relu(self.sq_in(x)) ** 2)


class EinsumAttention(nn.Module):
    """Attention written with einsum, a fused ``qkv`` laid out per head ``[q_h | k_h | v_h]`` (NeoX style:
    ``view(B, T, nh, 3, D)``), a pre-norm ``nn.LayerNorm`` and a ReLU MLP with a residual."""

    def __init__(self, h=12, nh=3):
        super().__init__()
        self.nh, self.d = nh, h // nh
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h, bias=False)
        self.norm2 = nn.LayerNorm(h)
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, self.nh, 3, self.d)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d)
        y = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(b, t, h)
        x = x + self.out(y)
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class LayerScaleMLP(nn.Module):
    """A residual GELU MLP whose output is scaled per feature by ``gamma`` (LayerScale, CaiT / DINOv2)."""

    def __init__(self, h=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 16), nn.Linear(16, h)
        self.gamma = nn.Parameter(torch.full((h,), 0.1))

    def forward(self, x):
        return x + self.gamma * self.fc2(F.gelu(self.fc1(x)))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class QKNormAttention(nn.Module):
    """Qwen3-style attention in plain torch: per-head ``nn.RMSNorm`` on q and k (QK-norm), RoPE by rotate_half
    (pairs {p, p + D/2}), ``F.scaled_dot_product_attention``, separate q/k/v/o projections."""

    def __init__(self, h=16, nh=4):
        super().__init__()
        self.nh, self.d = nh, h // nh
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(self.d, eps=1e-6), nn.RMSNorm(self.d, eps=1e-6)

    def forward(self, x):
        b, t, h = x.shape
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=x.dtype) / self.d))
        ang = torch.arange(t, dtype=x.dtype)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        q = self.q_norm(self.q(x).view(b, t, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, self.nh, self.d)).transpose(1, 2)
        v = self.v(x).view(b, t, self.nh, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, h))


class NormedSequential(nn.Module):
    """A user block: pre-norm ``nn.LayerNorm`` then an ``nn.Sequential`` ReLU MLP, with a residual. The
    Sequential is the torch.nn detector's; the norm's gain law (read by the Sequential's first Linear) is
    found structurally."""

    def __init__(self, h=8):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 16), nn.ReLU(), nn.Linear(16, h))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


# ------------------------------------------------------------------------------ chained MLPs
class ChainMLP(nn.Module):
    """``head(act(fc_k(... act(fc1 x))))`` as a plain module (not ``nn.Sequential``): ``acts[i]`` sits between
    the i-th and the (i+1)-th Linear (None: nothing between); ``n_linear`` Linears in all, the last one
    ``head``."""

    def __init__(self, n_linear=3, acts=None, bias=True, d_in=8, width=16, d_out=4):
        super().__init__()
        self.acts = list(acts) if acts is not None else [torch.relu] * (n_linear - 1)
        assert len(self.acts) == n_linear - 1
        dims = [d_in] + [width] * (n_linear - 1) + [d_out]
        self.names = [f"fc{i + 1}" for i in range(n_linear - 1)] + ["head"]
        for i, name in enumerate(self.names):
            setattr(self, name, nn.Linear(dims[i], dims[i + 1], bias=bias))

    def forward(self, x):
        for i, name in enumerate(self.names):
            x = getattr(self, name)(x)
            if i < len(self.acts) and self.acts[i] is not None:
                x = self.acts[i](x)
        return x


class BranchMLP(nn.Module):
    """``fc2``'s units read twice: ``head(relu(z)) + aux(relu(z))`` (``where='act'``: one ReLU output read by
    both), ``head(relu(z)) + aux(leaky_relu(z))`` (``'pre'``: the pre-activation read twice) or
    ``head(relu(z)) + z[..., :4]`` (``'raw'``: a residual-like read of the pre-activation)."""

    def __init__(self, where="act"):
        super().__init__()
        self.where = where
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        if where != "raw":
            self.aux = nn.Linear(16, 4)

    def forward(self, x):
        z = self.fc2(torch.relu(self.fc1(x)))
        if self.where == "act":
            h = torch.relu(z)
            return self.head(h) + self.aux(h)
        if self.where == "pre":
            return self.head(torch.relu(z)) + self.aux(F.leaky_relu(z, 0.1))
        return self.head(torch.relu(z)) + z[..., :4]
