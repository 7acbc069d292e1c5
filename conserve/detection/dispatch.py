"""``detect``: every law of a model, from the registered detectors run in order (``core.detectors()``).

The name/type-based detectors (reference models, HF transformers, timm, torch.nn modules) are the fast path; an
HF / timm / reference model held inside a container is detected on its own (``nested``); any model (or part of
one) they do not explain goes to structural detection (``graph.detect_graph``). The laws the torch.nn detector
reads from module types pass the first-order check on the model's own forward (``check.checked_laws``).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from ..errors import UnsupportedModelError, UsageError
from ..wrappers import unwrap
from .check import checked_laws
from .core import Collector, Detection, detectors, load_detectors, prefixed
from .graph import detect_graph
from .torchnn import walk

__all__ = ["detect", "nested"]


def detect(model: nn.Module, config=None, *, structural: bool = False, **options) -> Detection:
    """Every law of ``model`` with the rows/columns it reads, the declined blocks and the unrecognised ones.

    The name/type-based detectors (reference models, HF transformers, timm, torch.nn modules) are the fast
    path; any model (or part of one) they do not explain goes to structural detection
    (``conserve.detection.graph.detect_graph``: the laws found from what the traced graph computes, each
    passing the spec's first-order check in float64, every other block declined with the reason). The laws the
    torch.nn detector reads from module types, and those of an HF / timm model holding user classes
    (``user_classes``: a subclass, a module put in place of a library block), pass the same check on the model's
    own forward (``check.checked_laws``; kept unchecked only when no probe can run: meta device, FSDP, no input).

    Args:
        model: an ``nn.Module`` (HF transformers, timm, torch.nn, plain torch code, conserve reference
            models); wrappers from torch.compile and DDP are removed; meta-device models work for the
            name-based detectors (shapes only).
        config: the model config if it is not ``model.config`` (HF).
        structural: True skips the name-based detectors and runs structural detection only (block by block for a
            model on the meta device or above ``max_probe_params``, as without it).
        **options: detector options, e.g. ``rope_layout='half'|'interleaved'`` where the layout cannot be
            known from the model, ``loss='ce'`` (the translation law needs softmax cross-entropy),
            ``example_inputs=`` (structural detection: what ``forward`` takes, when it cannot be synthesised).

    Raises:
        conserve.errors.UnsupportedModelError: no detector recognises any block of the model.
        conserve.errors.UsageError: the model still has uninitialised lazy parameters (run a forward first), or
            ``example_inputs`` is a dict (keyword inputs go in ``forward_kwargs``).
    """
    if isinstance(options.get("example_inputs"), dict):
        raise UsageError("detect(example_inputs=...) got a dict: pass keyword inputs as forward_kwargs={...}; "
                         "example_inputs takes what forward takes positionally (a tensor or a tuple)")
    # the checks differentiate the model: grad on inside (a caller's no_grad / inference_mode is restored on exit,
    # and so is any switch the model's own code leaves behind)
    with torch.inference_mode(False), torch.enable_grad():
        found = _detect(model, config, structural, options)
    found.loss = options.get("loss")
    # a block two detectors declined (the torch.nn one and the structural one) is listed once, with the first reason
    seen: set = set()
    found.declined = [d for d in found.declined if (d.module, d.block) not in seen and not seen.add((d.module, d.block))]
    return found


def _detect(model: nn.Module, config, structural: bool, options: dict) -> Detection:
    load_detectors()
    model = unwrap(model)
    config = config if config is not None else getattr(model, "config", None)
    lazy = [n for n, p in model.named_parameters() if isinstance(p, UninitializedParameter)]
    if lazy:
        raise UsageError(f"{lazy[0]} (and {len(lazy) - 1} more) not initialised yet (a lazy module, e.g. nn.LazyLinear):"
                         " run one forward pass before detecting or tracking the model's laws")

    if structural:  # a model the float64 probe cannot copy (meta device, too large): block by block
        big = dict(detectors()).get("large")
        if big is not None and big.applies(model, options.get("max_probe_params", 3e8)) is not None:
            return big.structural(model, **options)
        return detect_graph(model, **options)
    for name, fn in detectors():
        if name == "torch.nn":  # the model itself is no HF/timm/reference model: is one inside it?
            found_nested = nested(model, options)
            if found_nested is not None:
                return _nested_rest(model, *found_nested, options)
        found = fn(model, config, **options)
        if found is not None:
            found.detector = found.detector or name
            if name == "torch.nn":
                found.laws, more = checked_laws(model, found.laws, options)
                found.declined += more
                if found.undetected:
                    found = _with_structural(model, found, options)
            return found
    last = getattr(dict(detectors()).get("graph"), "last", None)
    why = "; ".join(f"{d.module}: {d.reason}" for d in (last.declined if last else [])[:3])
    raise UnsupportedModelError(f"no detector recognises {type(model).__name__}"
                                + (f" (structural detection: {why})" if why else "")
                                + "; pass explicit laws (conserve.laws) to track it, or example_inputs= if forward "
                                "needs a particular input")


_NAMED = ("reference", "hf", "timm")  # the detectors that recognise a model by its type


def nested(model: nn.Module, options: dict) -> tuple[Detection, tuple[str, ...]] | None:
    """The laws of the HF / timm / reference models held inside a container that none of them
    recognises (a LightningModule with ``self.model = AutoModelForCausalLM...``, a wrapper with its own
    head), parameter names as in the container's ``named_parameters()``, and the paths of those
    submodules; None when there is none.

    The outermost recognised submodules are detected as if on their own, so their laws assume that
    what the container does with them goes through their ``forward`` output (as for the model
    alone: a container that reads a causal LM's inner hidden states instead of its logits breaks its
    final-norm law; use the base model, ``AutoModel``, whose final norm is declined). The container's
    own torch.nn blocks are detected as by the torch.nn detector, the frozen / tied checks see every use
    of a parameter in the container, and its other parameterised modules are listed in ``undetected``
    (``detect`` then gives them to structural detection)."""
    named = [(n, fn) for n, fn in detectors() if n in _NAMED]
    found: list[tuple[str, Detection]] = []
    for path, m in model.named_modules():
        if not path or any(path.startswith(p + ".") for p, _ in found):
            continue
        for name, fn in named:  # a wrapped submodule (torch.compile's _orig_mod) is reached under its own path
            d = fn(m, getattr(m, "config", None), **options)
            if d is not None:
                d.detector = d.detector or name
                found.append((path, d))
                break
    if not found:
        return None
    inside = tuple(p for p, _ in found)
    c = Collector(model, options)
    inner_undetected = []
    for path, d in found:
        c.add(*[prefixed(law, path + ".") for law in d.laws])
        c.declined += [replace(x, module=f"{path}.{x.module}" if x.module else path) for x in d.declined]
        inner_undetected += [f"{path}.{u}" for u in d.undetected]
    c.mark(*inside)
    n_inner = len(c.laws)
    walk(c, model, options.get("loss"), skip=inside)  # the container's own torch.nn blocks (a Sequential head)
    c.laws[n_inner:], more = checked_laws(model, c.laws[n_inner:], options)
    c.declined += more
    detector = "+".join(dict.fromkeys(d.detector for _, d in found))
    # finish on the container: frozen / tied checks see every use of a parameter, the container's own
    # parameterised modules are listed in ``undetected`` (``detect`` gives them to structural detection)
    out = c.finish(f"nested:{detector}")
    out.undetected = list(dict.fromkeys(inner_undetected + out.undetected))
    return out, inside


def _nested_rest(model: nn.Module, found: Detection, inside: tuple[str, ...], options: dict) -> Detection:
    """``found`` (``nested``) with the container's own modules given to structural detection; what that
    pass says about the modules under the detected submodule paths ``inside`` is dropped (they were
    detected on their own)."""
    if not found.undetected:
        return found
    merged = _with_structural(model, found, options)
    mine = {id(x) for x in found.declined}
    merged.declined = [x for x in merged.declined
                       if id(x) in mine or not any(x.module == p or x.module.startswith(p + ".") for p in inside)]
    return merged


def _with_structural(model: nn.Module, found: Detection, options: dict) -> Detection:
    """Structural detection for the modules a type-based detector left undetected, merged into ``found``."""
    left = set(found.undetected)
    skip = [k for k, _ in model.named_parameters() if (k.rsplit(".", 1)[0] if "." in k else k) not in left]
    g = detect_graph(model, skip_params=skip, **options)
    have = {(law.family, frozenset(law.params)) for law in found.laws}
    laws = found.laws + [law for law in g.laws if (law.family, frozenset(law.params)) not in have]
    declined = found.declined + g.declined
    return Detection(laws, declined, [m for m in g.undetected if m in left], f"{found.detector}+graph")


_nested = nested  # the name ``large`` imports
