"""Tracing the probe: ``trace(probe, inputs)`` gives a ``torch.fx.GraphModule`` that computes what the probe does.

``torch.fx.symbolic_trace`` first (``LeafTracer``: ``nn.Linear``, norms, ``nn.Embedding``, GPT-2 ``Conv1D`` and the
modules marked opaque stay one call; torch.nn's transformer containers are traced through); when that fails
(data-dependent Python control flow, e.g. an ``assert`` on a shape) ``torch.export`` on the example input. The
graph is put in the form the block finders read (``rewrite``) and must reproduce the probe's output
(``reproduces``) or ``TraceError`` is raised, naming the innermost module torch.fx failed in.
"""
from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import fx, nn

from ..analysis.firstorder import output_tensors
from ..laws.tolerance import TRACE_ATOL, TRACE_ATOL_SCALE, TRACE_RTOL
from .rewrite import (baddbmm_to_matmul, casts_to_float64, einsum_to_matmul, parameter_einsum_to_linear,
                      slice_writes_to_functional)

__all__ = ["LeafTracer", "TORCH_CONTAINERS", "TraceError", "reproduces", "to_graph_form", "trace"]


# torch.nn modules made of other modules: fx's default keeps every torch.nn module a leaf, which would hide their
# Linears and norms from the graph (their blocks then looked "not used by the traced forward")
TORCH_CONTAINERS = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
                     nn.TransformerDecoderLayer)


class LeafTracer(fx.Tracer):
    """fx tracer that keeps norms, embeddings and GPT-2 ``Conv1D`` as leaves (plus torch.nn's own leaves, except
    the transformer containers ``TORCH_CONTAINERS``, traced through), and the modules in ``leaves`` or marked
    ``_conserve_opaque``. When tracing fails, ``failed`` names the innermost module whose forward it failed in."""

    def __init__(self, leaves=()):
        super().__init__()
        self.leaves = set(leaves)  # module paths kept opaque (traced as one call: their forward runs as it is)
        self.failed: str | None = None  # the innermost module whose forward the trace failed in ("" : the root's)

    def is_leaf_module(self, m, qualname):
        if qualname in self.leaves or getattr(m, "_conserve_opaque", False):
            return True
        if type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers"):
            return True
        if isinstance(m, TORCH_CONTAINERS):
            return False
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed is None:
                self.failed = self.path_of_module(m)
            raise

    def trace(self, root, concrete_args=None):
        try:
            return super().trace(root, concrete_args)
        except Exception:
            if self.failed is None:
                self.failed = ""
            raise


class TraceError(ValueError):
    """Neither torch.fx nor torch.export gave a graph that runs like the probe; ``culprit``: the innermost module
    whose forward torch.fx failed in ("" : the root's own forward; None: unknown)."""

    culprit: str | None = None


def trace(probe: nn.Module, inputs: tuple, kwargs: dict | None = None, leaves=()) -> tuple[fx.GraphModule, str]:
    """fx symbolic trace, else torch.export on ``inputs``; checked to reproduce the probe's output.
    ``kwargs``: constant keyword arguments of ``forward`` (e.g. ``use_cache=False``), baked into the graph.
    ``leaves``: module paths fx keeps as one opaque call (recorded as ``gm._conserve_opaque``); torch.export, which
    has no leaves, is tried only without them. Raises ``TraceError``."""
    errors = []
    gm = None
    kwargs = dict(kwargs or {})
    tracer = LeafTracer(leaves)
    state = _module_state(probe)
    try:
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):  # fx bakes kwargs in as constants
            raise ValueError("tensor keyword arguments are inputs, not constants")
        graph = tracer.trace(probe, concrete_args=kwargs or None)
        gm = fx.GraphModule(probe, graph)
        gm._conserve_opaque = frozenset(leaves)
        how = "torch.fx"
    except Exception as e:  # noqa: BLE001 - any trace failure falls back to export
        errors.append(f"torch.fx: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                      + (f" (in {tracer.failed})" if tracer.failed else ""))
    finally:
        _restore(state)  # a forward that assigns attributes (self.cache_k = self.cache_k.to(x)) left proxies there
    if gm is not None:
        try:
            to_graph_form(gm)
            reproduces(probe, gm, inputs, kwargs)
        except Exception as e:  # noqa: BLE001
            errors.append(f"torch.fx trace does not run like the model: {e}")
            gm = None
    if gm is None:
        try:
            if leaves:
                raise ValueError("not tried with opaque blocks")
            try:
                with _quiet_export():
                    gm = torch.export.export(probe, inputs, kwargs=kwargs, strict=False).module()
            finally:
                _restore(state)
            how = "torch.export"
            to_graph_form(gm)
            reproduces(probe, gm, inputs, kwargs, export=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"torch.export: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            err = TraceError("; ".join(errors))
            err.culprit = tracer.failed
            raise err from None
    return gm, how


@contextlib.contextmanager
def _quiet_export():
    """torch.export's warnings and stderr off while it is tried (a failed attempt prints pages of the graph it
    reached to stderr; the failure itself is reported in the ``TraceError``)."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export",
                                              "torch._dynamo", "torch._functorch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _module_state(root: nn.Module) -> list:
    """Each module's attributes, buffers, parameters and children, to put back after a trace."""
    return [(m, dict(m.__dict__), dict(m._buffers), dict(m._parameters), dict(m._modules)) for m in root.modules()]


def _restore(state: list) -> None:
    for m, attrs, buffers, params, mods in state:
        for k in [k for k in m.__dict__ if k not in attrs]:
            del m.__dict__[k]
        m.__dict__.update(attrs)
        for d, old in ((m._buffers, buffers), (m._parameters, params), (m._modules, mods)):
            d.clear()
            d.update(old)


def to_graph_form(gm: fx.GraphModule) -> None:
    """Every rewrite of ``rewrite``, in order: copies into slices of a fresh tensor as values, parameter einsums as
    linear maps, attention einsums and ``baddbmm`` as matmuls, then the casts made float64."""
    slice_writes_to_functional(gm)
    parameter_einsum_to_linear(gm)
    einsum_to_matmul(gm)
    baddbmm_to_matmul(gm)
    casts_to_float64(gm)


@torch.no_grad()
def reproduces(probe: nn.Module, gm: fx.GraphModule, inputs: tuple, kwargs: dict, export: bool = False) -> None:
    """Raise ValueError unless the graph ``gm`` reproduces ``probe``'s output on ``inputs`` (``export``: ``gm`` takes
    the keyword arguments too). Compared in float64 (a cast of the output, ``logits.float()``, runs float32 in the
    probe and float64 in the graph: the same function at another precision), within the trace tolerances of
    ``laws.tolerance``: the graph computes in float64 where the model's code downcasts to float32, so entries near
    zero differ by float32 rounding of the output's scale."""
    a = output_tensors(probe(*inputs, **kwargs))
    b = output_tensors(gm(*inputs, **kwargs) if export else gm(*inputs))
    a = [t.to(torch.float64) for t in a]
    b = [t.to(torch.float64) for t in b]
    if len(a) != len(b) or not a or any(x.shape != y.shape or not torch.allclose(
            x, y, rtol=TRACE_RTOL, atol=TRACE_ATOL + TRACE_ATOL_SCALE * float(x.abs().max() if x.numel() else 0.0))
            for x, y in zip(a, b)):
        raise ValueError("the traced graph does not reproduce the model's output")
