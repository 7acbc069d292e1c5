"""Evaluate laws on a model's parameters (a convenience over ``compile_laws`` + the kernels)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .. import kernels
from .base import Law, compile_laws


def evaluate_laws(laws: Sequence[Law], params: Mapping[str, torch.Tensor], *, fp64: bool = False,
                  backend: str = "auto") -> dict[str, torch.Tensor]:
    """``{law.name: h(theta)}``: a vector (``size``) or a ``D x D`` matrix per law, fp32 (fp64 on request).

    ``params`` maps parameter names to tensors (e.g. ``dict(model.named_parameters())``)."""
    compiled = compile_laws(laws, {k: tuple(v.shape) for k, v in params.items()})
    vec, grams = kernels.evaluate(compiled.plan, [params[n] for n in compiled.names], fp64=fp64, backend=backend)
    return {law.name: v for law, v in zip(compiled.laws, compiled.split(vec, grams))}
