"""A small pre-LN Vision Transformer (Dosovitskiy et al. 2021) that declares its laws.

``ViT(ViTConfig(...))(images) -> logits``; images (B, C, S, S) float. LayerNorm with bias, so the
gain laws include ``beta_c^2`` (spec: pre-norm gain row); q/k/v biases enter the head Grams.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..laws import Declined
from .blocks import FFN, Attention, Block, make_norm, stack_laws


@dataclass
class ViTConfig:
    image_size: int = 28
    patch_size: int = 7
    num_channels: int = 1
    num_classes: int = 10
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    hidden_act: str = "gelu"
    qkv_bias: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


class ViT(nn.Module):
    """Patch embedding -> [CLS] + learned positions -> pre-LN blocks -> LayerNorm -> classifier (head)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        c = self.config = config
        if c.image_size % c.patch_size:
            raise ValueError(f"image_size={c.image_size} must be a multiple of patch_size={c.patch_size}")
        n = (c.image_size // c.patch_size) ** 2
        self.patch_embed = nn.Linear(c.num_channels * c.patch_size ** 2, c.hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, c.hidden_size) * 0.02)
        d = c.hidden_size // c.num_attention_heads
        self.layers = nn.ModuleList(
            Block(Attention(c.hidden_size, c.num_attention_heads, c.num_attention_heads, d, bias=c.qkv_bias, causal=False),
                  FFN(c.hidden_size, c.intermediate_size, c.hidden_act, bias=True), c.hidden_size, "layer")
            for _ in range(c.num_hidden_layers))
        self.norm = make_norm("layer", c.hidden_size)
        self.head = nn.Linear(c.hidden_size, c.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.config.patch_size
        b = images.shape[0]
        x = images.unfold(2, p, p).unfold(3, p, p)  # B C h w p p
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, self.config.num_channels * p * p)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.patch_embed(x)], 1) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))

    def conservation_laws(self):
        """Head Grams, FFN laws and gains of each block, final-norm gain and the classifier translation law."""
        laws, declined = stack_laws(self.layers, self.norm, "head", self.head, head_bias=True)
        declined.append(Declined("patch_embed", "patch embedding", "no law: no parameter on the other side of it"))
        return laws, declined
