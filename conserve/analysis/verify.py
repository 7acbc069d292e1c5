"""Numerical checks of laws (spec "The numerical checks every law must pass", checks 1 and 2).

* ``first_order``: in float64 at random parameters and inputs, ``<grad h, grad_theta f(x)>`` must vanish
  for every output coordinate (tested on random output projections ``r . f(x)``, which vanish for all
  ``r`` iff they vanish per coordinate) and every law component (random combinations ``s . h``).
  Laws that hold only for softmax cross-entropy (``Translation``) are tested on that loss's gradient. The
  measure is ``analysis.firstorder.violation``, the one structural detection and ``conserve.discover`` use;
  the tolerance is ``laws.tolerance.FIRST_ORDER`` (``TOL``).
* ``symmetry``: the group action that generates the law (spec "symmetry" column) leaves the output
  unchanged: Gram laws ``X -> A X`` on plus blocks, ``Y -> A^-T Y`` on minus blocks; per-entry laws scale
  plus rows by ``c`` and minus rows by ``1/c``; linear laws add one vector to every row.

``verify(model, laws=None)`` runs both on every law and returns the worst relative violation per law.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from ..detection import detect
from ..detection.probe import no_cache, synth_inputs
from ..detection.trace import trace
from ..laws import Law, Translation
from ..laws.tolerance import TOL
from .firstorder import (cross_entropy, gradients, law_vector, output_tensors, random_projection, to_float64,
                         violation)

__all__ = ["Check", "TOL", "apply_symmetry", "code_in_float64", "exact64", "example_inputs", "first_order",
           "law_vector", "symmetry", "verify"]


@dataclass
class Check:
    """Worst relative violations of one law (float64): ``first_order`` and ``symmetry`` (None: not run)."""

    law: str
    family: str
    first_order: float
    symmetry: float | None

    @property
    def ok(self) -> bool:
        return self.first_order <= TOL and (self.symmetry is None or self.symmetry <= TOL)


def example_inputs(model: nn.Module, batch: int = 2, generator: torch.Generator | None = None):
    """Random inputs for the reference models (``model.example_inputs`` wins when defined), HF models (token ids
    from ``config.vocab_size``, images from ``config.image_size``), else the first of structural detection's
    candidates (``conserve.detection.probe.synth_inputs``: token ids, sequences or batches of the first
    Linear's / norm's width, images at the model's declared size) that ``model`` runs on."""
    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch, generator)
    c = getattr(model, "config", None)
    if c is not None and hasattr(c, "vocab_size"):
        return torch.randint(0, c.vocab_size, (batch, 8), generator=generator)
    if c is not None and hasattr(c, "image_size"):
        return torch.randn(batch, c.num_channels, c.image_size, c.image_size, generator=generator, dtype=torch.float64)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    x = torch.randn(batch, first.in_features, generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad():
            copy.deepcopy(model).to(torch.float64)(x)
        return x
    except Exception:  # noqa: BLE001 - e.g. a ViT (its first Linear reads tokens, not the input)
        probe = copy.deepcopy(model).to(torch.float64).eval()
        inputs = synth_inputs(probe)
        return inputs[0] if len(inputs) == 1 else inputs


class _Torch64:
    """``torch`` as seen by a modeling module inside ``code_in_float64``: float32 / float mean float64."""

    def __getattr__(self, n):
        return torch.float64 if n in ("float32", "float") else getattr(torch, n)


@contextlib.contextmanager
def code_in_float64(model: nn.Module, packages: tuple[str, ...] = ("transformers.", "timm.")):
    """Run the model's own transformers / timm code in float64 end to end, without tracing it: inside the
    block, the modeling modules of ``model``'s submodules (those under ``packages``) see ``torch.float32`` /
    ``torch.float`` as float64, and ``Tensor.float()`` leaves float64 tensors alone, so the code's explicit
    float32 upcasts (RMSNorm, ``softmax(dtype=torch.float32)``, rotary, routers' ``.float()``) become float64.
    They are precision choices, not part of the function, but at float32 they would bound the first-order
    check near 1e-7.  ``model`` must already be float64.  Not thread-safe (patches module globals)."""
    mods = {sys.modules[type(m).__module__] for m in model.modules()}
    mods = [m for m in mods if m.__name__.startswith(packages) and getattr(m, "torch", None) is torch]
    orig = torch.Tensor.float
    for m in mods:
        m.torch = _Torch64()
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else orig(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = orig
        for m in mods:
            m.torch = torch


def exact64(model: nn.Module, inputs) -> tuple[nn.Module, dict]:
    """``(module, kwargs)`` computing ``model`` in float64 end to end: its graph traced (torch.fx, else
    torch.export) with the code's casts to float32/16 made float64 (HF modeling code upcasts norms and
    softmax to float32, which would bound the first-order check near 1e-7), same parameter names; the float64
    model itself (and no kwargs) when it cannot be traced. ``model`` must already be float64."""
    kwargs = no_cache(model, {})
    x = inputs if isinstance(inputs, tuple) else (inputs,)
    try:
        gm, how = trace(model, x, kwargs)
    except Exception:  # noqa: BLE001 - run the module as is
        return model, {}
    return gm, (kwargs if how == "torch.export" else {})


def first_order(model: nn.Module, law: Law | Callable, inputs, *, trials: int = 3, seed: int = 0,
                loss: str | None = None, kwargs: dict | None = None) -> float:
    """Worst ``|<grad (s.h), grad (r.f)>| / (||.|| ||.||)`` over ``trials`` random ``s, r`` (float64; the measure of
    ``conserve.analysis.firstorder.violation``).

    ``law``: a ``Law`` or a function ``h(params: dict[str, Tensor]) -> Tensor`` (any shape).
    ``loss='ce'`` tests the cross-entropy loss gradient instead of the raw outputs (default for
    ``Translation`` laws; on the first floating output, the logits). The outputs are every floating tensor
    ``model`` returns (an HF ``ModelOutput`` included); ``kwargs``: keyword arguments of ``forward``.
    Raises ``ValueError`` when the law reads no parameter that requires grad."""
    g = torch.Generator().manual_seed(seed)
    params = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in model.named_parameters()}
    buffers = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in model.named_buffers()}
    x = to_float64(inputs)
    x = x if isinstance(x, tuple) else (x,)
    if loss is None and isinstance(law, Translation):
        loss = "ce"
    plist = list(params.values())
    h = law_vector(law, params)
    grads = []
    for _ in range(trials):
        outs = output_tensors(functional_call(model, {**params, **buffers}, x, kwargs or {}))
        obj = cross_entropy(outs[:1], g) if loss == "ce" else random_projection(outs, g)
        grads.append(gradients(obj, plist))
    worst = violation(h, plist, grads, g)
    if worst < 0:
        raise ValueError(f"law {getattr(law, 'name', law)!r} has zero gradient: it reads no trainable parameter")
    return worst


@torch.no_grad()
def apply_symmetry(model: nn.Module, law: Law, *, strength: float = 0.3, seed: int = 0) -> None:
    """Apply a random element of the law's symmetry group to ``model``'s parameters, in place."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    if law.kind == "gram":
        d = law.size
        a = torch.eye(d, dtype=torch.float64) + strength * torch.randn(d, d, generator=g, dtype=torch.float64) / d ** 0.5
        for t in law.terms:
            m = a if t.sign > 0 else torch.linalg.inv(a).T
            v = t.ref.view(0).of(params[t.ref.param])
            v.copy_((m @ v.to(torch.float64)).to(v.dtype))
    elif law.linear:
        width = max(t.offset + t.ref.cols for t in law.terms)
        shift = strength * torch.randn(width, generator=g, dtype=torch.float64)
        for t in law.terms:
            v = t.ref.view(0).of(params[t.ref.param])
            v += shift[t.offset: t.offset + t.ref.cols].to(v.dtype)
    else:
        c = torch.exp(strength * torch.randn(law.size, generator=g, dtype=torch.float64))
        for t in law.terms:
            v = t.ref.view(0).of(params[t.ref.param])
            idx = t.offset + t.stride * torch.arange(t.ref.rows)
            f = (c[idx] if t.sign > 0 else 1 / c[idx])[:, None]
            v.copy_(((v.to(torch.float64) + t.shift) * f - t.shift).to(v.dtype))


def symmetry(model: nn.Module, law: Law, inputs, *, seed: int = 0, kwargs: dict | None = None) -> float:
    """Relative change of the model output (float64; every floating output tensor, an HF ``ModelOutput``
    included) under a random group element of ``law``."""
    m = copy.deepcopy(model).to(torch.float64)
    x = to_float64(inputs)
    x = x if isinstance(x, tuple) else (x,)

    def out():
        ys = output_tensors(m(*x, **(kwargs or {})))
        if isinstance(law, Translation):  # class translation: logits move by a constant per sample
            ys = [y - y.mean(-1, keepdim=True) for y in ys]
        return torch.cat([y.reshape(-1) for y in ys])

    with torch.no_grad():
        y0 = out()
        apply_symmetry(m, law, seed=seed)
        y1 = out()
    return float((y1 - y0).norm() / y0.norm())


def verify(model: nn.Module, laws: Sequence[Law | Callable] | None = None, inputs=None, *, seed: int = 0,
           trials: int = 3) -> list[Check]:
    """Checks 1 and 2 of the spec for every law of ``model`` (``model.conservation_laws()`` by default,
    else ``conserve.detect``). User functions ``h(params)`` get the first-order check only."""
    if laws is None:
        if hasattr(model, "conservation_laws"):
            laws = model.conservation_laws()[0]
        else:
            laws = detect(model).laws
    g = torch.Generator().manual_seed(seed)
    model64 = copy.deepcopy(model).to(torch.float64)
    if inputs is None:
        inputs = example_inputs(model64, generator=g)
    run, kw = exact64(model64, to_float64(inputs))
    out = []
    for i, law in enumerate(laws):
        fo = first_order(run, law, inputs, trials=trials, seed=seed + i, kwargs=kw)
        sy = symmetry(run, law, inputs, seed=seed + i, kwargs=kw) if isinstance(law, Law) else None
        out.append(Check(getattr(law, "name", getattr(law, "__name__", "h")), getattr(law, "family", "user"), fo, sy))
    return out
