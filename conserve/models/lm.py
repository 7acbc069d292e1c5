"""A Llama-style decoder LM with switches for every law family of the spec.

``DecoderLM(LMConfig(...))(input_ids) -> logits``; ``model.conservation_laws()`` returns the laws it
carries and the blocks it declines, with reasons. Parameter names follow HF Llama (``layers.{i}...``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..laws import Declined
from .blocks import FFN, MoE, Attention, Block, Rope, make_norm, stack_laws

POSITIONS = ("none", "sinusoidal", "learned", "rope")


@dataclass
class LMConfig:
    """Switches of the reference LM (HF names where they exist).

    Attributes:
        position: 'none', 'sinusoidal', 'learned' (added to the input) or 'rope'.
        rope_layout: 'half' (HF rotate_half) or 'interleaved' (GPT-J); rotary_dim: None = head_dim.
        nope_layers: layers that skip RoPE (as Llama 4 does), so QK Gram laws also appear.
        hidden_act: 'swiglu', 'relu', 'gelu' or 'silu': the dense FFNs' kind (MoE experts are SwiGLU FFNs).
        num_experts: 0 = dense; moe_layers: which layers are MoE (None = all when num_experts > 0).
        router: 'softmax' or 'sigmoid' (normalised over the top_k).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    position: str = "rope"
    rope_layout: str = "half"
    rotary_dim: int | None = None
    rope_theta: float = 10000.0
    nope_layers: tuple[int, ...] = ()
    hidden_act: str = "swiglu"
    attention_bias: bool = False
    mlp_bias: bool = False
    norm: str = "rms"
    num_experts: int = 0
    top_k: int = 2
    moe_layers: tuple[int, ...] | None = None
    router: str = "softmax"
    norm_topk_prob: bool = True
    shared_expert: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}; set head_dim explicitly (conserve run: --head-dim)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        self.nope_layers = tuple(self.nope_layers)
        if self.moe_layers is not None:
            self.moe_layers = tuple(self.moe_layers)

    def to_dict(self) -> dict:
        return asdict(self)


def sinusoidal(n: int, h: int) -> torch.Tensor:
    """Vaswani et al. 2017 sinusoidal table, (n, h)."""
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, h, 2, dtype=torch.float64) * (-math.log(10000.0) / h))
    pe = torch.zeros(n, h, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)[:, : h // 2]
    return pe.float()


class DecoderLM(nn.Module):
    """Pre-norm decoder: embed -> (+PE) -> blocks -> norm -> lm_head. input_ids (B, T) int64 -> logits (B, T, V)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if c.position == "learned":
            self.embed_positions = nn.Parameter(torch.randn(c.max_position_embeddings, c.hidden_size) * 0.02)
        elif c.position == "sinusoidal":
            self.register_buffer("embed_positions", sinusoidal(c.max_position_embeddings, c.hidden_size), persistent=False)
        moe = set(range(c.num_hidden_layers) if c.moe_layers is None else c.moe_layers) if c.num_experts else set()
        layers = []
        for i in range(c.num_hidden_layers):
            rope = Rope(c.rotary_dim or c.head_dim, c.rope_layout, c.rope_theta) \
                if c.position == "rope" and i not in c.nope_layers else None
            attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, rope=rope,
                             bias=c.attention_bias)
            if i in moe:
                mlp = MoE(c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, gating=c.router,
                          norm_topk=c.norm_topk_prob, shared_expert=c.shared_expert, bias=c.mlp_bias)
            else:
                mlp = FFN(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
            layers.append(Block(attn, mlp, c.hidden_size, c.norm))
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(c.norm, c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.apply(self._init)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02 * math.sqrt(64 / m.in_features))
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.position in ("learned", "sinusoidal"):
            x = x + self.embed_positions[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def conservation_laws(self):
        """Laws and declined blocks of the whole model (loss: softmax cross-entropy over the vocabulary)."""
        laws, declined = stack_laws(self.layers, self.norm, "lm_head", self.lm_head,
                                    tied=self.config.tie_word_embeddings)
        declined.append(Declined("embed_tokens", "input embedding", "no law: no parameter on the other side of it"))
        return laws, declined
