"""Structural detection: the catalogue's blocks found by what the model's graph computes, whatever the names.

``detect_graph(model, example_inputs=None, **options) -> Detection`` (also the fallback of ``conserve.detect`` for
any model no name-based detector knows, and ``detect(model, structural=True)``). This module orchestrates; each
step has a module of its own (spec ``shared/spec/laws.md``; each law's row is named in its note):

1. Probe (``probe``): a float64 copy of the model with random parameters, in eval mode, and an example input
   (``example_inputs``, else synthesised). The user's model is never modified.
2. Trace (``trace``, ``rewrite``): ``torch.fx`` (norms, embeddings, ``nn.Linear`` as leaves), else
   ``torch.export``; the graph rewritten into the form the finders read (float64 casts, einsums of a parameter as
   linear maps, attention einsums and ``baddbmm`` as matmuls) and checked to reproduce the model's output, or
   nothing is claimed from it. Every intermediate value of one run is recorded (``fxgraph.Graph``).
   When the whole probe cannot be run or traced (an op with no float64 kernel, routing that decides which code
   runs, an untraceable module), ``blocks`` takes over: the failing modules become opaque and each is detected
   on its own from the input it received in one concrete forward of the original model.
3. Blocks (``match``): attention (``match.attention``: QK / RoPE / VO laws, QK-norm gains), routers
   (``match.router``), MLPs (``match.mlp``: unit and deep-linear laws), gains and LayerScale (``match.gain``),
   output layers (``match.output``: the translation law). Linear maps are any spelling ``fxgraph.Lin`` reads.
4. Check (``check``): every candidate law must pass the spec's first-order check (float64, the traced probe,
   random output projections, cross-entropy for translation laws, relative violation <=
   ``laws.tolerance.FIRST_ORDER``) before it is claimed; a law that fails is declined with its measured violation.
   Embeddings and every parameterised module no block explains are declined with the reason (never the whole
   model). Frozen / tied parameters go through the one ``Collector`` filter.

Options: ``example_inputs`` (a tensor or tuple for ``forward``), ``forward_kwargs``, ``loss`` ('ce' for the
translation law), ``max_probe_params`` (default 3e8: larger models are declined with a reason rather than copied).

The names other modules read from here (``Graph``, ``trace``, ``make_probe``, ``check_laws`` ...) are those of the
step modules, re-exported.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from torch import nn

from ..analysis.firstorder import to_float64
from ..laws.tolerance import TOL
from .blocks import by_blocks
from .check import check_laws, check_on_probe, checked_laws
from .core import Collector, Detection, register
from .fxgraph import Graph, Lin
from .match import FINDERS
from .match.found import Found
from .probe import make_probe, no_cache, synth_inputs
from .rewrite import baddbmm_to_matmul, casts_to_float64, einsum_to_matmul
from .trace import TraceError, reproduces, to_graph_form, trace

__all__ = ["Graph", "Lin", "TOL", "TraceError", "check_laws", "check_on_probe", "checked_laws", "detect_graph",
           "detect_on", "make_probe", "no_cache", "param_modules", "synth_inputs", "to_graph_form", "trace"]


def detect_graph(model: nn.Module, example_inputs=None, *, forward_kwargs: dict | None = None,
                 loss: str | None = None, max_probe_params: float = 3e8, skip_params: Iterable[str] = (),
                 **options) -> Detection:
    """Structural detection (module docstring): every catalogue law the graph of ``model`` computes, each
    passing the spec's first-order check in float64, and every other parameterised block declined with the
    reason. Never raises for an unknown block; a model whose whole probe cannot be run or traced is analysed
    block by block (``conserve.detection.blocks``); one that cannot be probed at all (too large, meta device, no
    concrete forward) gets one decline per parameterised module naming the fix.

    Args:
        model: any ``nn.Module`` (wrappers removed by ``conserve.detect``); it is copied, never modified.
        example_inputs: positional input(s) of ``forward`` (a tensor or a tuple); synthesised when None for
            models starting with an ``nn.Embedding`` / ``nn.Linear`` / norm.
        loss: 'ce' when trained with softmax cross-entropy (the translation law needs it).
        max_probe_params: larger models are declined (the float64 probe copy would be too large).
        skip_params: parameters already explained by another detector: no law reading only them is built and
            they are not declined (a law reading them and others, e.g. a gain read by their Linear, is).
    Returns:
        ``Detection`` with ``detector='graph'``.
    """
    depth = options.pop("_depth", 0)
    c = Collector(model, {**options, "loss": loss})
    skip = set(skip_params)
    try:
        probe = make_probe(model, max_probe_params)
    except Exception as e:  # noqa: BLE001 - the reason is reported per module, nothing is claimed
        reason = f"structural detection could not run: {e}"
        for mod in param_modules(model, skip):
            c.decline(mod, "not analysed", reason)
        return c.finish("graph")
    try:
        kwargs = to_float64(dict(forward_kwargs or {}))  # tensors: inputs of the float64 probe, as example_inputs
        no_cache(model, kwargs)
        inputs = synth_inputs(probe, example_inputs, kwargs)
        gm, how = trace(probe, inputs, kwargs)
        g = Graph(gm, inputs, dict(probe.named_parameters(remove_duplicate=False)),
                  kwargs if how == "torch.export" else {})
    except Exception as e:  # noqa: BLE001 - the blocks are analysed one by one (``blocks``)
        return by_blocks(model, c, e, example_inputs=example_inputs, forward_kwargs=forward_kwargs, loss=loss,
                         max_probe_params=max_probe_params, skip=skip, options=options, depth=depth)
    return detect_on(g, c, model, how, skip)


def detect_on(g: Graph, c: Collector, model: nn.Module, how: str, skip: set) -> Detection:
    """Steps 3 and 4 of the module docstring on the traced probe ``g``: candidate laws, the first-order check,
    the declines; ``c.finish``. ``skip``: parameters not to build laws of or decline (explained elsewhere)."""
    f = Found(g, c)
    for step in FINDERS:
        try:
            step(f)
        except Exception as e:  # noqa: BLE001 - one block kind failing never fails the whole model
            c.decline(f"<{step.__name__}>", "structural analysis error",
                      f"{type(e).__name__}: {e}; the blocks of this kind are not claimed (report this model)")
    cands, seen, named = [], set(), {}
    for law, what in f.cands:
        key = (law.name, law.family, repr(law.terms))  # a block called more than once (ALBERT's shared layer): one law
        if set(law.params) <= skip or key in seen:  # (nothing new to say about skipped parameters)
            continue
        seen.add(key)
        named[law.name] = named.get(law.name, 0) + 1
        if named[law.name] > 1:  # two different laws under one name: the check's verdicts are kept by name
            law = dataclasses.replace(law, name=f"{law.name}#{named[law.name]}")
        cands.append((law, what))
    try:
        viol = check_laws(g, [law for law, _ in cands], f.heads)
    except Exception as e:  # noqa: BLE001 - nothing unchecked is claimed; each candidate is declined with the reason
        c.decline("<check>", "first-order check", f"could not run on the traced probe: {e}; no law is claimed")
        for law, what in cands:
            c.decline(law.name, f"{law.family} law ({what})", f"the first-order check could not run: {e}: not claimed")
        cands, viol = [], {}
    aliases: dict = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(k)
    tied = {k for ks in aliases.values() if len(ks) > 1 for k in ks}
    for law, what in cands:
        v = viol[law.name]
        f.explained.update(law.params)
        if not (v <= TOL or (v != v and set(law.params) & tied)):
            c.know(*law.params)  # declined below, with the reason: accounted for, not 'undetected'
        if v < 0:
            c.decline(law.name, f"{law.family} law ({what})", "identically constant on this model (zero gradient, e.g. "
                      "q and k from the same rows): nothing to track")
        elif v <= TOL or (v != v and set(law.params) & tied):  # tied: declined by the Collector's filter below
            c.add(law)
        elif v != v:
            c.decline(law.name, f"{law.family} law ({what})", "reads a parameter the traced graph does not use: "
                      "not checked, not claimed")
        else:
            c.decline(law.name, f"{law.family} law ({what})",
                      f"found in the graph but fails the first-order check in float64 (relative violation {v:.2e} > "
                      f"{TOL:g}): not claimed")
    _decline_rest(f, model, skip, how)
    c.declined = list(dict.fromkeys(c.declined))  # a shared block's uses give the same decline once
    return c.finish("graph")


def param_modules(model: nn.Module, skip) -> list[str]:
    out = []
    for name, _ in model.named_parameters():
        if name in skip:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else name
        if mod not in out:
            out.append(mod)
    return out


def _decline_rest(f: Found, model: nn.Module, skip, how: str):
    """Embeddings and every parameterised module no block explains: declined with what the graph does."""
    g, c = f.g, f.c
    covered = set(skip) | set(c.understood) | f.explained
    for law in c.laws:
        covered.update(law.params)
    used = {}
    for n in g.nodes:
        if n.op == "call_module":
            used[n.target] = g.op(n)
        elif n.op == "get_attr" and n.target in g.params:
            owner = n.target.rsplit(".", 1)[0] if "." in n.target else n.target
            for u in n.users:
                used.setdefault(owner, g.op(u))
    for mod in param_modules(model, skip):
        names = [k for k, _ in model.named_parameters() if (k.rsplit(".", 1)[0] if "." in k else k) == mod]
        if all(k in covered for k in names) or c.covered(mod):
            continue
        m = model.get_submodule(mod) if mod and _is_module(model, mod) else None
        if isinstance(m, nn.Embedding) or used.get(mod) == "embedding":
            c.decline(mod, "input embedding", "no law: no parameter on the other side of it")
        elif mod not in used and not any(k in g.params and any(n.op == "get_attr" and n.target == k for n in g.nodes)
                                         for k in names):
            c.decline(mod, type(m).__name__ if m is not None else "parameter",
                      f"not used by the traced forward ({how}): no law")
        elif mod in f.gates:
            c.decline(mod, "gated MLP gate", f"the gate of the gated units of {f.gates[mod]!r}: their unit law does not "
                      "involve it (spec: SwiGLU row, gate NOT involved) and nothing else reads it with a law")
        else:
            kind = type(m).__name__ if m is not None else "parameter"
            op = used.get(mod)
            c.decline(mod, kind, f"no catalogue block reads it this way (used by {op!r} in the {how} graph): no law "
                      "detected" if op is not None else f"no catalogue block reads it this way (its uses in the {how} "
                      "graph match none): no law detected")


def _is_module(model, path):
    try:
        return isinstance(model.get_submodule(path), nn.Module)
    except AttributeError:
        return False


@register("graph")
def detect_graph_fallback(model: nn.Module, config, **options):
    """Registry entry: structural detection for any model no earlier detector answered. Returns None when it
    finds no catalogue block at all (then ``detect`` raises UnsupportedModelError with the reasons)."""
    d = detect_graph(model, **options)
    if not d.laws and all(x.block in ("not analysed",) or "no catalogue block" in x.reason or "not used" in x.reason
                          or "analysed on its own" in x.reason or "could not run" in x.reason for x in d.declined):
        detect_graph_fallback.last = d
        return None
    return d


# the names ``blocks`` imports from here under their former private spelling
_param_modules, _same, _to64 = param_modules, reproduces, casts_to_float64
_einsum_to_matmul, _baddbmm_to_matmul = einsum_to_matmul, baddbmm_to_matmul
