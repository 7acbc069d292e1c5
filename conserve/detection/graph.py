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

from typing import Iterable

import torch
from torch import nn

from ..analysis.firstorder import to_float64
from ..laws.tolerance import TOL
from .blocks import by_blocks, record_input_readers
from .check import check_laws, check_on_probe, checked_laws
from .core import Collector, Detection, register
from .fxgraph import Graph, Lin
from .ongraph import detect_on, param_modules
from .probe import make_probe, no_cache, synth_inputs
from .trace import TraceError, to_graph_form, trace

__all__ = ["Graph", "Lin", "TOL", "TraceError", "check_laws", "check_on_probe", "checked_laws", "detect_graph",
           "detect_on", "make_probe", "no_cache", "param_modules", "synth_inputs", "to_graph_form", "trace"]


def detect_graph(model: nn.Module, example_inputs=None, *, forward_kwargs: dict | None = None,
                 loss: str | None = None, max_probe_params: float = 3e8, skip_params: Iterable[str] = (),
                 check=check_laws, **options) -> Detection:
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
        check: the first-order check every candidate law must pass (``check.check_laws``; ``large`` passes a
            faster one with the same inputs and verdicts).
    Returns:
        ``Detection`` with ``detector='graph'``.
    """
    # the check differentiates the model: grad on inside; a model's code may switch it off (``@torch.no_grad()`` on
    # a router method) in a graph that a partial run leaves midway: the caller gets its own mode back
    with torch.inference_mode(False), torch.enable_grad():
        return _detect_graph(model, example_inputs, forward_kwargs=forward_kwargs, loss=loss,
                             max_probe_params=max_probe_params, skip_params=skip_params, check=check, **options)


def _detect_graph(model: nn.Module, example_inputs=None, *, forward_kwargs: dict | None = None,
                  loss: str | None = None, max_probe_params: float = 3e8, skip_params: Iterable[str] = (),
                  check=check_laws, **options) -> Detection:
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
        no_cache(model, kwargs, example_inputs)
        inputs = synth_inputs(probe, example_inputs, kwargs)
        gm, how = trace(probe, inputs, kwargs)
        g = Graph(gm, inputs, dict(probe.named_parameters(remove_duplicate=False)),
                  kwargs if how == "torch.export" else {})
    except Exception as e:  # noqa: BLE001 - the blocks are analysed one by one (``blocks``)
        return by_blocks(model, c, e, example_inputs=example_inputs, forward_kwargs=forward_kwargs, loss=loss,
                         max_probe_params=max_probe_params, skip=skip, options=options, depth=depth,
                         detect=detect_graph, check=check)
    if depth > 0:  # a block analysed on its own: what reads its inputs (the gain law of a norm in front of it)
        record_input_readers(g, c)
    return detect_on(g, c, model, how, skip, check)


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

