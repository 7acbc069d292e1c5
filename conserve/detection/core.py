"""Detection core: the ``Detection`` result, the detector registry and ``detect``."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..laws import Declined, Law

# detector modules, imported lazily in this order (each calls @register at import)
_MODULES = ("conserve.detection.reference", "conserve.detection.hf", "conserve.detection.timm_models", "conserve.detection.torchnn")
_DETECTORS: list[tuple[str, Callable]] = []
_loaded = False


@dataclass
class Detection:
    """What ``detect`` found.

    Attributes:
        laws: law instances (parameter names as in ``model.named_parameters()`` of the unwrapped model).
        declined: blocks with no law (or whose law does not apply), each with the reason.
        undetected: module paths of parameterised modules that no detector understood.
        detector: name of the detector that answered.
    """

    laws: list[Law] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    undetected: list[str] = field(default_factory=list)
    detector: str = ""

    def families(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for l in self.laws:
            out[l.family] = out.get(l.family, 0) + 1
        return out


def register(name: str):
    """Decorator: ``fn(model, config, **options) -> Detection | None``."""

    def deco(fn):
        _DETECTORS.append((name, fn))
        return fn

    return deco


def _load():
    global _loaded
    if not _loaded:
        for m in _MODULES:
            try:
                importlib.import_module(m)
            except ModuleNotFoundError as e:
                if not (e.name or "").startswith("conserve"):
                    raise
        _loaded = True


def unwrap(model: nn.Module) -> nn.Module:
    """Strip torch.compile (``_orig_mod``) and DDP/DataParallel (``module``) wrappers."""
    from ..tracker import _unwrap

    return _unwrap(model)


def detect(model: nn.Module, config=None, **options) -> Detection:
    """Every law of ``model`` with the rows/columns it reads, the declined blocks and the unrecognised ones.

    Args:
        model: an ``nn.Module`` (HF transformers, timm, torch.nn, conserve reference models); wrappers
            from torch.compile and DDP are removed; meta-device models work (shapes only).
        config: the model config if it is not ``model.config`` (HF).
        **options: detector options, e.g. ``rope_layout='half'|'interleaved'`` where the layout cannot be
            known from the model, ``loss='ce'`` (the translation law needs softmax cross-entropy).

    Raises:
        conserve.errors.UnsupportedModelError: no detector recognises the model at all.
    """
    _load()
    model = unwrap(model)
    config = config if config is not None else getattr(model, "config", None)
    for name, fn in _DETECTORS:
        found = fn(model, config, **options)
        if found is not None:
            found.detector = found.detector or name
            return found
    from ..errors import UnsupportedModelError

    raise UnsupportedModelError(f"no detector recognises {type(model).__name__}; pass explicit laws "
                                "(conserve.laws) to track it, or open an issue with the model's config")


def finish(model: nn.Module, laws: list[Law], declined: list[Declined], understood=(), detector: str = "") -> Detection:
    """Shared last step of a detector (added for the HF detector; usable by every detector).

    * Laws that read a frozen parameter (``requires_grad=False``) move to ``declined`` with the reason:
      frozen parameters do not follow the gradient flow, so the law's Noether identity fails.
    * Every parameterised module with a parameter that no law reads, that is not under a declined
      module path and that is not in ``understood`` (parameter names known to carry no law, e.g. an
      output bias) is listed in ``undetected`` ("no law detected"), in ``named_parameters`` order.
    * All refs are checked against the parameter shapes (``compile_laws``), so a wrong row/column
      range fails loudly here, never silently later.
    """
    from ..laws import compile_laws

    params = dict(model.named_parameters())
    compile_laws(laws, {k: tuple(v.shape) for k, v in params.items()})
    kept, declined = [], list(declined)
    for law in laws:
        frozen = [p for p in law.params if not params[p].requires_grad]
        if frozen:
            declined.append(Declined(law.name, f"{law.family} law",
                                     f"reads frozen parameters {frozen} (requires_grad=False): they do not move with "
                                     "the gradient flow, so the law is not conserved; unfreeze them or track the "
                                     "trainable part with explicit laws"))
        else:
            kept.append(law)
    covered = set(understood)
    for law in laws:
        covered.update(law.params)
    paths = [d.module for d in declined]
    undetected: list[str] = []
    for name in params:
        if name in covered or any(name.startswith(p + ".") for p in paths):
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        if mod not in undetected:
            undetected.append(mod)
    return Detection(kept, declined, undetected, detector)
