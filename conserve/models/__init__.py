"""Reference models that declare their own conservation laws (``model.conservation_laws()``)."""
from .blocks import FFN, MoE, Attention, Block, RMSNorm, Rope
from .lm import DecoderLM, LMConfig
from .mlp import MLP
from .vit import ViT, ViTConfig

__all__ = ["DecoderLM", "LMConfig", "ViT", "ViTConfig", "MLP", "Attention", "FFN", "MoE", "Block", "RMSNorm", "Rope"]
