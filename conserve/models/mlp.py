"""A plain MLP (``layers.{i}`` Linear maps): deep linear (``activation=None``) or ReLU/GELU.

Laws: deep linear Gram between consecutive layers (Marcotte et al. 2023) or ReLU unit balance."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..detection import builders
from ..laws import Declined, DeepLinearGram, ReLUUnit, cols, rows, vector


class MLP(nn.Module):
    """``widths = (n_0, ..., n_L)``: Linear n_{l} -> n_{l+1} with ``activation`` in between."""

    def __init__(self, widths: Sequence[int], activation: str | None = "relu", bias: bool = True):
        super().__init__()
        if activation not in (None, "relu", "gelu"):
            raise ValueError(f"activation must be None, 'relu' or 'gelu', got {activation!r}")
        self.activation = activation
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x):
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1 and self.activation is not None:
                x = F.relu(x) if self.activation == "relu" else F.gelu(x)
        return x

    def conservation_laws(self):
        laws, declined = [], []
        for l in range(len(self.layers) - 1):
            a, b = self.layers[l], self.layers[l + 1]
            n = a.out_features
            wa, wb = f"layers.{l}.weight", f"layers.{l + 1}.weight"
            ba = vector(f"layers.{l}.bias", 0, n) if a.bias is not None else None
            if self.activation is None:
                laws.append(DeepLinearGram.build(f"layers.{l}-{l + 1}/gram", l, plus=[rows(wa, a.weight.shape, 0, n), ba],
                                                 minus=[cols(wb, b.weight.shape, 0, n)]))
            elif self.activation == "relu":
                laws.append(builders.unit_law(ReLUUnit, f"layers.{l}-{l + 1}/unit", l, up=wa, up_shape=a.weight.shape,
                                              units=range(n), down=wb, down_shape=b.weight.shape,
                                              up_bias=f"layers.{l}.bias" if a.bias is not None else None))
            else:
                declined.append(Declined(f"layers.{l}", "GELU MLP", "no law beyond constants (seed paper)"))
        return laws, declined
