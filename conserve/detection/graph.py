"""Structural detection: the catalogue's blocks found by what the model's graph computes, whatever the names.

``detect_graph(model, example_inputs=None, **options) -> Detection`` (also the fallback of
``conserve.detect`` for any model no name-based detector knows, and ``detect(model, structural=True)``).

How it works (spec ``shared/spec/laws.md``; each law's row is named in its note):

1. Probe: a float64 copy of the model with random parameters (N(0, 1/fan_in) matrices, gains 1 +- 0.3,
   biases +- 0.3), in eval mode, and an example input (``example_inputs``, else synthesised from the
   first parameterised module: token ids for an ``nn.Embedding``, ``(2, 6, in_features)`` floats for an
   ``nn.Linear``; an HF encoder-decoder also gets random ``decoder_input_ids`` from its config unless given).
   The user's model is never modified.
2. Trace: ``torch.fx.symbolic_trace`` (``nn.Linear``, norms, ``nn.Embedding``, GPT-2 ``Conv1D`` are
   leaves); when that fails (data-dependent Python control flow, e.g. an ``assert`` on a shape), the
   probe is traced with ``torch.export`` on the example input. Casts to float32/16 in the graph are made
   float64 (precision choices, not part of the function), export's metadata assertions are dropped and its
   autocast / set_grad_enabled regions inlined (``_to64``); the trace must reproduce the model's output (rtol
   1e-4, compared in float64: a cast of the output such as ``logits.float()`` is a precision choice too) or
   nothing is claimed from it. Every intermediate value of one run is recorded.
   When the whole probe cannot be run or traced (an op with no float64 kernel, routing that decides which code
   runs, an untraceable module), ``conserve.detection.blocks`` takes over: the failing modules become opaque
   (kept as one call, or replaced by a stand-in when they cannot run in float64) and each of them, or each child
   when the model's own forward fails, is detected on its own from the input it received in one concrete
   forward of the original model (see that module). A module that yields nothing is declined by name.
3. Blocks, found from the graph and the recorded values. Linear maps are ``nn.Linear``, GPT-2 ``Conv1D``,
   ``F.linear`` of a parameter (through casts), ``x @ W.t()``, ``x @ W`` (W stored ``(in, out)``) and ``addmm``.

   * attention: every ``softmax(f(X @ Y))`` followed by ``@ V`` (any element-wise f: scale, mask, ALiBi,
     soft-capping) and every ``scaled_dot_product_attention``. The nearest linear projections of X, Y, V and
     the linear that reads the attention output are found in the graph; which of their rows (columns for
     the output projection) form head i, dim d, is read off the exact linear maps between them
     (basis-vector probes through the recorded graph: any fused qkv split by columns or per head,
     reshape, transpose, GQA ``repeat_interleave`` / ``expand``). A probe at another position shows which
     dims are rotated together: RoPE by rotate_half (pairs ``{p, p + R/2}``) or by complex multiplication
     of adjacent pairs (``view_as_complex``, pairs ``{2p, 2p+1}``), partial rotary (pass-through dims).
     Laws: QK Gram per kv group (no RoPE) or RoPE pairs (+ pass-through Gram), VO Gram per kv group.
     GQA's kv head of each query head is read the same way, whatever the convention (``i // (nH / nKV)`` by
     ``repeat_interleave`` / ``expand``, ``i % nKV`` by tiling with ``repeat``).
     Attention written with ``einsum`` (``torch.einsum`` or export's ``aten.einsum``; one kv head kept 3-D, MQA's
     ``'bhid,bjd->bhij'``, broadcast) is rewritten as permute -> matmul -> permute first, ``baddbmm`` (BLOOM's
     ALiBi scores) as ``beta * input + alpha * b1 @ b2`` (both re-checked). Softmax's stabiliser ``s - max(s)``,
     extra logits concatenated beside the scores and a slice of the probabilities (GPT-OSS attention sinks) keep
     the scores recognised.
     A q/k path that is not linear (QK-norm) gets no QK law (declined with the reason); VO is kept, and
     a per-feature gain on each of the q and k paths gets the QK-norm gain law (per dim, or per rotary
     pair; one law for gains shared by all heads, one per kv group for a norm over all heads; ``1 + w``
     gains too). The ``||Q||^2`` scale laws are not built structurally.
   * element-wise MLPs ``down(act(up x))``: ReLU / leaky-ReLU unit laws; GELU, SiLU, tanh, ... declined
     (spec: GELU / SiLU FFN row); ``down(up x)`` with nothing between: deep-linear Gram. In a chain
     ``l3(act(l2(act(l1 x))))`` the down side of one law is the up side of the next (one law per hidden
     layer). An up whose output is also read outside the block (a branch) is declined: its law would need
     the columns of every reader.
   * gated MLPs ``down(g * up x)`` where ``up x`` reaches the product through index operations only (any
     gate g: SwiGLU, GeGLU, fused ``gate_up`` chunks): SwiGLU unit law on up rows and down columns.
   * gains: every per-feature scale ``g * x (+ beta)`` (LayerNorm / RMSNorm modules, ``F.layer_norm``,
     hand-written RMSNorms, Gemma's ``(1 + w)``) whose output is read only by linear maps (through
     dropout, casts, reshapes, token indexing or pooling): gain law with every reader. A scale whose
     output also feeds anything else (the residual stream: post-LN; a weight computed from parameters, e.g. a
     rearranged ``[heads, d_model, d_head]`` weight; an opaque block) is declined, the reason naming each other
     reader and the linear readers seen.
   * LayerScale: a per-feature scale of a linear's output (``gamma * (W x + b)``) whose result feeds
     anything (the residual): ``gamma_c^2 - ||W[c,:]||^2 - b_c^2`` (family ``layer_scale``).
   * fused experts: transformers' experts run as ``batched_mm`` in the probe (the eager loop over routed experts
     is data-dependent: untraceable); the per-token gathered weights ``bmm(W[ids], x)`` (W: (E, out, in), or
     transposed) are one linear map per expert: unit laws per expert (``lead=(e,)``), gain readers for every expert.
   * routers: a linear whose output is only read by ``softmax`` (directly or after ``topk``): router sum
     (spec: MoE router, softmax, any top-k, renormalised or not); a sigmoid router is declined (spec
     open row). Expert MLPs are found as MLPs above.
   * output layer: a linear whose output reaches the model output through index operations only gets
     the translation law when the loss is softmax cross-entropy (``loss='ce'``, or ``F.cross_entropy``
     of it inside the graph); declined otherwise (a soft-cap or other op before the output breaks it).
4. Check: every candidate law must pass the spec's first-order check (float64, the traced probe, random
   output projections, cross-entropy for translation laws, relative violation <= ``conserve.analysis.verify.TOL``)
   before it is claimed; a law that fails is declined with its measured violation. Embeddings and every
   parameterised module no block explains are declined with the reason (never the whole model).
   Frozen / tied parameters go through the one ``Collector`` filter.

Options: ``example_inputs`` (a tensor or tuple for ``forward``), ``loss`` ('ce' for the translation law),
``max_probe_params`` (default 3e8: larger models are declined with a reason rather than copied).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.node import map_arg

from ..analysis.verify import TOL  # the spec's first-order tolerance
from ..laws import (Declined, DeepLinearGram, Law, QKGram, ReLUUnit, RopePassGram, RouterSum, SwiGLUUnit, Translation,
                    VOGram, rows)
from . import builders
from .core import Collector, Detection, register
from .torchnn import layer_index

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ALIAS = {"_softmax": "softmax", "bmm": "matmul", "mm": "matmul", "scaled_dot_product_attention": "sdpa",
         "truediv": "div", "relu_": "relu", "mul_": "mul", "add_": "add", "leaky_relu_": "leaky_relu",
         "gelu_": "gelu", "silu_": "silu", "native_dropout": "dropout", "dropout_": "dropout",
         "_to_copy": "to", "type_as": "to", "type": "to", "float": "to", "double": "to", "half": "to", "bfloat16": "to",
         "_unsafe_view": "view", "masked_fill_": "masked_fill", "__getitem__": "getitem", "rms_norm": "rms_norm"}
POSITIVE = {"relu", "leaky_relu"}
NO_LAW = {"gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "mish", "softplus", "hardswish", "hardsigmoid",
          "hardtanh", "relu6", "softsign", "glu", "logsigmoid", "erf"}
# ops that move or copy features without mixing them (a reader behind them still reads the same feature)
PASS = {"dropout", "to", "contiguous", "clone", "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
        "getitem", "index_select", "index", "expand", "mean", "sum", "alias", "identity", "repeat",
        "repeat_interleave", "cat", "stack", "permute", "transpose", "split", "chunk", "split_with_sizes",
        "narrow", "slice", "select", "t", "movedim", "type", "lift_fresh_copy", "dropout1d", "dropout2d"}
SCORE_OPS = {"mul", "div", "add", "sub", "masked_fill", "to", "tanh", "where", "dropout", "float", "permute", "transpose",
             "contiguous", "view", "reshape", "cat"}  # cat: extra logits beside the scores (GPT-OSS attention sinks)
ELEMENTWISE = POSITIVE | NO_LAW | {"pow", "square", "abs", "exp", "sin", "cos", "sqrt", "log", "neg", "sign", "clamp",
                                    "clamp_min", "where"}
TENSOR_METADATA = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "is_sparse", "is_meta"}
SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "size", "dim",
              "sym_size", "_assert_tensor_metadata"}
NO_LAW_ACT = "no law beyond constants: the activation has no continuous rescaling symmetry (spec: GELU / SiLU FFN row)"


# torch.nn modules made of other modules: fx's default keeps every torch.nn module a leaf, which would hide their
# Linears and norms from the graph (their blocks then looked "not used by the traced forward")
_TORCH_CONTAINERS = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
                     nn.TransformerDecoderLayer)


class _Tracer(fx.Tracer):
    """fx tracer that keeps norms, embeddings and GPT-2 ``Conv1D`` as leaves (plus torch.nn's own leaves, except
    the transformer containers ``_TORCH_CONTAINERS``, traced through), and the modules in ``leaves`` or marked
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
        if isinstance(m, _TORCH_CONTAINERS):
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


@dataclass
class Lin:
    """A linear map ``y = x W^T + b`` in the graph (``t``: W stored ``(in, out)``, GPT-2 Conv1D / addmm)."""

    node: fx.Node
    x: fx.Node
    w: str
    b: str | None
    shape: tuple
    t: bool = False
    experts: int = 0  # > 0: a 3-D (E, out, in) weight gathered per token (``W[expert_ids]``, batched matmul)

    @property
    def n_out(self):
        return self.shape[-1] if self.t else self.shape[-2]

    @property
    def n_in(self):
        return self.shape[-2] if self.t else self.shape[-1]

    @property
    def module(self):
        """The owning module's path: "" when the root is the linear module itself (its ``weight``), the parameter's
        own name for another parameter of the root (``x @ self.W_in``)."""
        if "." in self.w:
            return self.w.rsplit(".", 1)[0]
        return "" if self.w == "weight" else self.w

    def reader(self):
        return builders.in_cols(self.w, self.shape, transposed=self.t)

    def readers(self) -> list:
        """Input-column refs of every expert (one ref for a plain linear)."""
        if not self.experts:
            return [self.reader()]
        return [builders.in_cols(self.w, self.shape, transposed=self.t, lead=(e,)) for e in range(self.experts)]


def _like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` laid out with ``ref``'s strides (graph paths may rely on them, e.g. ``view`` after ``transpose``)."""
    out = torch.empty_strided(ref.shape, ref.stride(), dtype=value.dtype)
    return out.copy_(value)


class Graph:
    """A traced probe: the GraphModule, its recorded values and the graph queries the detectors need."""

    def __init__(self, gm: fx.GraphModule, inputs: tuple, params: dict, kwargs: dict | None = None):
        self.gm, self.inputs, self.params, self.kwargs = gm, inputs, params, dict(kwargs or {})
        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.env: dict = {}
        self._paths: dict = {}  # (sources, targets) -> the nodes between them, in graph order
        self._record()
        self.lins = {}
        for n in self.nodes:
            lin = self._lin(n)
            if lin is not None:
                self.lins[n] = lin

    # ------------------------------------------------------------------ execution
    def _exec(self, n: fx.Node, args, kwargs):
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.gm.get_submodule(n.target)(*args, **kwargs)
        if n.op == "get_attr":
            obj = self.gm
            for a in n.target.split("."):
                obj = getattr(obj, a)
            return obj
        raise RuntimeError(n.op)

    @torch.no_grad()
    def _record(self):
        it = iter(self.inputs)
        kw = {k: v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)}  # export: by placeholder name
        for n in self.nodes:
            if n.op == "placeholder":
                if n.target in kw or n.name in kw:
                    self.env[n] = kw[n.target if n.target in kw else n.name]
                    continue
                try:
                    self.env[n] = next(it)
                except StopIteration:
                    self.env[n] = n.args[0] if n.args else None
            elif n.op == "output":
                self.env[n] = map_arg(n.args[0], lambda a: self.env[a])
            else:
                args, kwargs = map_arg((n.args, n.kwargs), lambda a: self.env[a])
                self.env[n] = self._exec(n, args, kwargs)

    @staticmethod
    def _reach(start: Iterable[fx.Node], step) -> set:
        """Nodes reachable from ``start`` (included) following ``step(node)``."""
        seen, stack = set(), list(start)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(step(n))
        return seen

    def ancestors(self, targets: Iterable[fx.Node]) -> set:
        return self._reach(targets, lambda n: n.all_input_nodes)

    def descendants(self, srcs: Iterable[fx.Node]) -> set:
        return self._reach(srcs, lambda n: n.users)

    def walk_users(self, start: Iterable[fx.Node], visit) -> None:
        """Depth-first over users from ``start``: ``visit(node, user)`` is called once per edge of a node
        reached; a True answer continues the walk through ``user``."""
        self._reach(start, lambda m: [u for u in m.users if visit(m, u)])

    @torch.no_grad()
    def run(self, subs: dict, targets: list):
        """Values of ``targets`` when the nodes in ``subs`` take the given values (the rest as recorded)."""
        key = (tuple(subs), tuple(targets))
        order = self._paths.get(key)
        if order is None:
            need = self.ancestors(targets) & self.descendants(subs)
            order = [n for n in self.nodes if n in need and n not in subs and n.op != "output"]
            self._paths[key] = order
        vals = dict(subs)
        for n in order:
            args, kwargs = map_arg((n.args, n.kwargs), lambda a: vals[a] if a in vals else self.env[a])
            vals[n] = self._exec(n, args, kwargs)
        return [vals.get(t, self.env[t]) for t in targets]

    # ------------------------------------------------------------------ queries
    def op(self, n: fx.Node) -> str:
        if n.op == "call_module":
            m = self.gm.get_submodule(n.target)
            if n.target in getattr(self.gm, "_conserve_opaque", ()) or getattr(m, "_conserve_opaque", False):
                return "opaque"  # a block analysed on its own (``blocks``): an unknown function of its inputs
            if isinstance(m, (nn.Dropout, nn.Identity)):
                return "dropout"
            if isinstance(m, nn.ReLU):
                return "relu"
            if isinstance(m, nn.LeakyReLU):
                return "leaky_relu"
            name = type(m).__name__.lower()
            return name
        if n.op == "call_function":
            t = n.target
            if t is getattr and len(n.args) > 1 and n.args[1] in TENSOR_METADATA:
                return "size"  # x.shape / x.dtype / x.device: reads no value of x
            name = t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
            if name.endswith("_") and not name.startswith("_"):
                name = name[:-1]  # in-place variants (div_, mul_, ...)
            return ALIAS.get(name, name)
        if n.op == "call_method":
            return ALIAS.get(n.target, n.target)
        return n.op

    def is_tensor(self, n) -> bool:
        """A node carrying a tensor (or a tuple of tensors: split / chunk / topk), not a size or a constant."""
        if not isinstance(n, fx.Node):
            return False
        v = self.env.get(n)
        if isinstance(v, (tuple, list)):
            return bool(v) and all(isinstance(t, torch.Tensor) for t in v)
        return isinstance(v, torch.Tensor)

    def param_of(self, n) -> str | None:
        """Parameter name when ``n`` is a get_attr of a parameter."""
        if isinstance(n, fx.Node) and n.op == "get_attr" and n.target in self.params:
            return n.target
        return None

    def _lin(self, n: fx.Node) -> Lin | None:
        if n.op == "call_module":
            m = self.gm.get_submodule(n.target)
            if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf")):
                t = not isinstance(m, nn.Linear)
                b = f"{n.target}.bias" if getattr(m, "bias", None) is not None else None
                return Lin(n, n.args[0], f"{n.target}.weight", b, tuple(m.weight.shape), t)
            return None
        o = self.op(n)
        if o == "linear" and n.op == "call_function":
            args = list(n.args) + [n.kwargs.get("weight"), n.kwargs.get("bias")]
            cast = {"to", "contiguous", "alias", "clone"}  # F.linear(x, self.weight.float()): a precision choice
            w = self.param_of(self.back_pass(args[1], cast))
            b = self.param_of(self.back_pass(args[2] if len(n.args) > 2 else n.kwargs.get("bias"), cast))
            if w is not None and self.params[w].dim() == 2:
                return Lin(n, n.args[0], w, b, tuple(self.params[w].shape))
        if o == "matmul" and len(n.args) == 2 and isinstance(n.args[1], fx.Node) \
                and self.op(n.args[1]) in ("t", "numpy_T", "transpose", "T"):
            w = self.param_of(n.args[1].args[0]) if n.args[1].args else None
            if w is not None and self.params[w].dim() == 2:
                return Lin(n, n.args[0], w, None, tuple(self.params[w].shape))
        if o == "matmul" and len(n.args) == 2 and self.param_of(n.args[1]) is not None \
                and isinstance(n.args[0], fx.Node) and not self.param_of(n.args[0]):
            w = self.param_of(n.args[1])  # x @ W with W stored (in, out): nanoGPT-style / TransformerLens MLPs
            xv = self.env.get(n.args[0])
            if self.params[w].dim() == 2 and isinstance(xv, torch.Tensor) and xv.dim() >= 2 \
                    and xv.shape[-1] == self.params[w].shape[0]:
                return Lin(n, n.args[0], w, None, tuple(self.params[w].shape), True)
        if o == "addmm" and len(n.args) >= 3:
            w, b = self.param_of(n.args[2]), self.param_of(n.args[0])
            if w is not None and self.params[w].dim() == 2:
                return Lin(n, n.args[1], w, b, tuple(self.params[w].shape), True)
        return self._experts_lin(n)

    def _gathered(self, n, dim: int) -> str | None:
        """The parameter when ``n`` is ``W[ids]`` (index / getitem by one integer tensor) of a ``dim``-D parameter."""
        if not (isinstance(n, fx.Node) and self.op(n) in ("index", "getitem") and len(n.args) == 2):
            return None
        w, idx = self.param_of(n.args[0]), n.args[1]
        idx = idx[0] if isinstance(idx, (list, tuple)) and len(idx) == 1 else idx
        if w is None or self.params[w].dim() != dim or not isinstance(idx, fx.Node):
            return None
        v = self.env.get(idx)
        return w if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() == 1 else None

    def _experts_lin(self, n: fx.Node) -> Lin | None:
        """Fused experts run per token (transformers' ``batched_mm``): ``bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)``
        (W: (E, out, in)) or ``bmm(x.unsqueeze(1), W[ids]).squeeze(1)`` (W: (E, in, out), transposed), plus
        ``b[ids]`` when the experts have biases: token s goes through expert ``ids[s]``."""
        bias = None
        if self.op(n) == "add" and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args):
            for a, bb in (n.args, n.args[::-1]):
                if self.op(a) == "squeeze" and self._gathered(bb, 2) is not None:
                    bias, n_sq = self._gathered(bb, 2), a
                    break
            else:
                return None
        elif self.op(n) == "squeeze":
            n_sq = n
            if any(self._experts_lin(u) is not None for u in n.users):
                return None  # its bias add is the linear map
        else:
            return None
        mm = n_sq.args[0] if n_sq.args else None
        if not (isinstance(mm, fx.Node) and self.op(mm) == "matmul" and len(mm.args) == 2):
            return None
        for wn, xn, t in ((mm.args[0], mm.args[1], False), (mm.args[1], mm.args[0], True)):
            w = self._gathered(wn, 3)
            if w is None or not (isinstance(xn, fx.Node) and self.op(xn) == "unsqueeze" and xn.args):
                continue
            x, shape = xn.args[0], tuple(self.params[w].shape)
            xv, yv = self.env.get(x), self.env.get(n)
            if not (isinstance(xv, torch.Tensor) and isinstance(yv, torch.Tensor) and xv.dim() == 2 and yv.dim() == 2):
                return None
            lin = Lin(n, x, w, bias, shape, t, experts=shape[0])
            if xv.shape[-1] != lin.n_in or yv.shape[-1] != lin.n_out or \
                    (bias is not None and tuple(self.params[bias].shape) != (shape[0], lin.n_out)):
                return None
            return lin
        return None

    def lin_of_x(self, n: fx.Node) -> list:
        """Linear maps reading ``n`` as their input."""
        return [self.lins[u] for u in n.users if u in self.lins and self.lins[u].x is n]

    def back_pass(self, n, ops=None):
        """Follow ``n`` back through single-input pass ops (dropout, casts) to the first other node."""
        ops = ops or {"dropout", "to", "contiguous", "clone", "alias", "identity"}
        while isinstance(n, fx.Node) and self.op(n) in ops and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        return n

    def nearest_lins(self, n: fx.Node) -> set:
        """Linear nodes reached walking back from ``n`` over tensor values, not past a linear."""
        if n in self.lins:
            return {n}
        seen, out, stack = set(), set(), [n]
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in self.lins and m is not n:
                out.add(m)
                continue
            for a in m.all_input_nodes:
                if self.is_tensor(a) and a.op not in ("get_attr", "placeholder"):
                    stack.append(a)
        return out

    def feature_map(self, src: fx.Node, dst: fx.Node) -> list | None:
        """For each last-dim feature of ``dst``, the last-dim feature of ``src`` it is (index ops only; -1:
        not from ``src``), the same at every position; None when the path mixes or rescales features."""
        sv = self.env[src]
        n = sv.shape[-1]
        idx = torch.arange(1, n + 1, dtype=torch.float64).expand(sv.shape).clone()
        try:
            out = self.run({src: _like(sv, idx.to(sv.dtype) if sv.is_floating_point() else idx)}, [dst])[0]
        except Exception:
            return None
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            return None
        flat = out.reshape(-1, out.shape[-1]).to(torch.float64)
        if not torch.equal(flat, flat[:1].expand_as(flat)) or not torch.equal(flat[0], flat[0].round()):
            return None
        f = flat[0].long() - 1
        if (f < -1).any() or (f >= n).any():
            return None
        return f.tolist()

    def clean_map(self, src: fx.Node, dst: fx.Node, lead: int):
        """``linear_map`` in 3 runs when every entry of ``dst`` reads at most one row of ``src`` at ``lead`` (an
        index map up to scale, e.g. a head split, GQA repeat, RoPE at position 0); None otherwise (not linear, or
        rows mixed). Rows are encoded as values (r + 1), decoded as ratios and confirmed with random values."""
        sv = self.env[src]
        n = sv.shape[-1]
        if not sv.is_floating_point():
            return None
        gen = torch.Generator().manual_seed(7)
        codes = torch.arange(1, n + 1, dtype=sv.dtype)
        rnd = torch.rand(n, generator=gen, dtype=torch.float64).to(sv.dtype) + 0.5

        def run(vals):
            e = torch.zeros(sv.shape, dtype=sv.dtype)
            e.view(-1, n)[lead] = vals
            return self.run({src: _like(sv, e)}, [dst])[0]

        try:
            z = run(torch.zeros(n, dtype=sv.dtype))
            if not isinstance(z, torch.Tensor) or z.numel() == 0 or not torch.isfinite(z).all() or z.abs().max() > 0:
                return None
            a, b, c = (run(v) for v in (codes, torch.ones(n, dtype=sv.dtype), rnd))
        except Exception:  # noqa: BLE001
            return None
        if not isinstance(b, torch.Tensor) or b.is_complex():
            return None
        a, b, c = a.reshape(-1), b.reshape(-1), c.reshape(-1)
        scale = float(b.abs().max()) if b.numel() else 0.0
        out: dict = {r: {} for r in range(n)}
        if scale == 0:
            return out
        nz = (b.abs() > 1e-9 * scale).nonzero().flatten()
        if nz.numel() == 0 or not torch.isfinite(a[nz]).all():
            return None
        ratio = a[nz] / b[nz]
        row = ratio.round()
        if (ratio - row).abs().max() > 1e-6 or (row < 1).any() or (row > n).any():
            return None
        row = row.long() - 1
        if not torch.allclose(c[nz], b[nz] * rnd[row], rtol=1e-9, atol=1e-12 * scale):
            return None
        for i, r in zip(nz.tolist(), row.tolist()):
            out[r][i] = float(b[i])
        return out

    def linear_map(self, src: fx.Node, dst: fx.Node, lead: int, rows_: Iterable[int] | None = None):
        """The exact linear map from row r of ``src`` at flattened lead ``lead`` to ``dst``: ``{r: {flat index of
        dst: coefficient}}`` (nonzeros only), or None when the path is not linear in ``src`` there."""
        sv = self.env[src]
        n = sv.shape[-1]
        zero = torch.zeros(sv.shape, dtype=sv.dtype)
        try:
            base = self.run({src: _like(sv, zero)}, [dst])[0]
        except Exception:
            return None
        if not isinstance(base, torch.Tensor) or base.numel() == 0 or not torch.isfinite(base).all() \
                or base.abs().max() > 0:
            return None  # affine, not linear (an offset independent of src), or undefined at 0 (a norm)
        out = {}
        scale = 0.0
        rows_ = range(n) if rows_ is None else rows_
        vals = {}
        for r in rows_:
            e = zero.clone()
            e.view(-1, n)[lead, r] = 1.0
            y = self.run({src: _like(sv, e)}, [dst])[0]
            if y.is_complex():
                return None
            vals[r] = y.reshape(-1)
            scale = max(scale, float(y.abs().max()))
        if scale == 0:
            return {r: {} for r in vals}
        for r, y in vals.items():
            nz = (y.abs() > 1e-9 * scale).nonzero().flatten().tolist()
            out[r] = {i: float(y[i]) for i in nz}
        # linearity: f(2 e_r) = 2 f(e_r) and f(e_r + e_s) = f(e_r) + f(e_s) on a few rows
        some = list(vals)[:2]
        e = zero.clone()
        for r in some:
            e.view(-1, n)[lead, r] = 2.0
        y = self.run({src: _like(sv, e)}, [dst])[0].reshape(-1)
        ref = sum(2 * vals[r] for r in some)
        if (y - ref).abs().max() > 1e-9 * max(scale, 1e-300):
            return None
        return out


# ---------------------------------------------------------------------------------------------- probe
def _randomize(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / max(p.shape[-1], 1) ** 0.5)
            else:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + base)


def make_probe(model: nn.Module, max_params: float) -> nn.Module:
    """float64 CPU copy with random parameters, eval mode (raises ValueError with the reason if impossible)."""
    n = sum(p.numel() for p in model.parameters())
    if n > max_params:
        raise ValueError(f"the model has {n:.3g} parameters, above max_probe_params={max_params:.3g}: the float64 "
                         "probe would be too large; detect a reduced-width instance or raise max_probe_params")
    meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    probe = copy.deepcopy(model)
    if meta:
        if any(b.is_floating_point() or b.is_complex() for b in model.buffers()):
            raise ValueError("meta-device model with floating buffers (e.g. RoPE frequencies): their values are "
                             "unknown, so the probe cannot run; build the model on CPU (a reduced width works)")
        probe = probe.to_empty(device="cpu")
    probe = probe.double()  # floating tensors only (Module.to(float64) would drop complex RoPE buffers' imaginary part)
    with torch.no_grad():
        for mod in probe.modules():
            for k, b in list(mod._buffers.items()):
                if b is not None and b.is_complex():
                    mod._buffers[k] = b.to(torch.complex128)
    _randomize(probe)
    _traceable_experts(probe)
    return probe.eval()


def _traceable_experts(probe: nn.Module) -> None:
    """HF fused experts (``transformers.integrations.moe.use_experts_implementation``) run as ``batched_mm`` in the
    probe: the same function (each token's gathered expert weights, one batched matmul), without the eager loop
    over the experts a batch routes to (``nonzero`` + Python ``for``: data-dependent, neither torch.fx nor
    torch.export can trace it) or ``grouped_mm`` (no float64 kernel). Only the probe's own config copy changes."""
    for mod in probe.modules():
        cfg = getattr(mod, "config", None)
        if hasattr(mod, "has_gate") and hasattr(mod, "is_transposed") and \
                getattr(cfg, "_experts_implementation", "batched_mm") not in (None, "batched_mm"):
            try:
                cfg._experts_implementation = "batched_mm"
            except Exception:  # noqa: BLE001 - an older transformers without it: the probe runs as it is
                pass


def synth_inputs(model: nn.Module, given=None, kwargs: dict | None = None, dtype=torch.float64, device=None) -> tuple:
    """The probe's positional inputs: ``given`` (floats cast to ``dtype``), else synthesised from the first
    parameterised module (see the module docstring), floats of ``dtype`` on ``device``. Raises ValueError naming
    the fix."""
    g = torch.Generator().manual_seed(1)
    _decoder_inputs(model, kwargs, g, given)
    if given is not None:
        given = given if isinstance(given, tuple) else (given,)
        return tuple(x.detach().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                     for x in given)
    cands = []
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if emb:
        cands.append((torch.randint(0, min(e.num_embeddings for e in emb), (2, 6), generator=g),))
    for m in model.modules():
        width = None
        if isinstance(m, nn.Linear):
            width = m.in_features
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            width = m.weight.shape[0]
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.normalized_shape and len(m.normalized_shape) == 1:
            width = m.normalized_shape[0]
        elif isinstance(m, (nn.Conv1d, nn.Conv2d)):
            nd = 1 if isinstance(m, nn.Conv1d) else 2
            for size in dict.fromkeys(_declared_sizes(model, nd) + [(8,) * nd, (32,) * nd, (64,) * nd]):
                cands.append((torch.randn((2, m.in_channels) + size, generator=g, dtype=torch.float64),))
        if width is not None:
            cands += [(torch.randn(2, 6, width, generator=g, dtype=torch.float64),),
                      (torch.randn(4, width, generator=g, dtype=torch.float64),)]
        if len(cands) >= 6:
            break
    cands = [tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in x) for x in cands]
    errors = []
    for x in cands:
        try:
            with torch.no_grad():
                model(*x, **(kwargs or {}))
            return x
        except Exception as e:  # noqa: BLE001 - try the next shape
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
            continue
    tried = f" (the first candidate, {tuple(tuple(t.shape) for t in cands[0])}, gave {errors[0]})" if errors else ""
    raise ValueError("cannot synthesise an input for this model" + tried
                     + ": pass example_inputs=(...) (what forward takes)")


def _decoder_inputs(model: nn.Module, kwargs: dict | None, g: torch.Generator, given=None) -> None:
    """An HF encoder-decoder (``config.is_encoder_decoder``: T5, Whisper, ...) needs decoder inputs besides the
    encoder's; when neither ``decoder_input_ids`` nor ``decoder_inputs_embeds`` is given (and ``forward`` takes them),
    random ``decoder_input_ids`` (2, 5) from the decoder's vocabulary go into ``kwargs`` (traced by torch.export
    as an input, like a user's ``forward_kwargs``)."""
    cfg = getattr(model, "config", None)
    if kwargs is None or not getattr(cfg, "is_encoder_decoder", False) or \
            {"decoder_input_ids", "decoder_inputs_embeds"} & set(kwargs):
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    names = [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = given if isinstance(given, tuple) else (() if given is None else (given,))
    if any(k in names and names.index(k) < len(given) and given[names.index(k)] is not None
           for k in ("decoder_input_ids", "decoder_inputs_embeds")):
        return  # given positionally
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    if "decoder_input_ids" in params and isinstance(vocab, int) and vocab > 0:
        kwargs["decoder_input_ids"] = torch.randint(0, vocab, (2, 5), generator=g)


def no_cache(model: nn.Module, kwargs: dict) -> dict:
    """``use_cache=False`` in ``kwargs`` when ``model.forward`` takes it, by name or through ``**kwargs`` of an HF
    model (Llava, Gemma3 multimodal: a KV cache in the output stops torch.export); it is inference state, not part
    of the function. Returns ``kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "use_cache" in params or (var_kw and (hasattr(config, "use_cache") or hasattr(text, "use_cache"))):
        kwargs.setdefault("use_cache", False)
    return kwargs


def _declared_sizes(model: nn.Module, nd: int) -> list[tuple]:
    """Input sizes the model declares (timm ``pretrained_cfg['input_size']`` / ``patch_embed.img_size``, HF
    ``config.image_size``, an ``img_size`` attribute): Swin, EVA or a strided ConvNeXt run on no other size."""
    out = []
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    for v in ((cfg or {}).get("input_size"), getattr(getattr(model, "patch_embed", None), "img_size", None),
              getattr(getattr(model, "config", None), "image_size", None), getattr(model, "img_size", None)):
        if isinstance(v, int):
            v = (v,) * nd
        if isinstance(v, (tuple, list)) and len(v) >= nd and all(isinstance(a, int) and a > 0 for a in v[-nd:]):
            out.append(tuple(v[-nd:]))
    return out


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flat(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _flat(v)]
    if hasattr(out, "to_tuple"):
        return _flat(out.to_tuple())
    return []


def _to64(gm: fx.GraphModule) -> None:
    """Make the graph's casts to float32/16 float64 and drop export's metadata assertions (precision only).
    torch.export's ``wrap_with_autocast`` regions (``with torch.autocast(..., enabled=False)`` around a float32
    upcast, e.g. RoPE) and ``wrap_with_set_grad_enabled`` regions are inlined first (their outputs detached when
    gradients are off there), so their casts and assertions are rewritten like the rest and their ops seen."""
    _inline_regions(gm)
    for n in list(gm.graph.nodes):
        name = str(n.target)
        if any(a in name for a in _ASSERTS) or name == "_guards_fn":
            n.args, n.kwargs = (), {}
            if not n.users:
                gm.graph.erase_node(n)
            continue
        if n.op == "call_method" and n.target in ("float", "half", "bfloat16"):
            n.target = "double"
        n.args = tuple(_swap(a) for a in n.args)
        n.kwargs = {k: _swap(v) for k, v in n.kwargs.items()}
    gm.graph.lint()
    gm.recompile()


_ASSERTS = ("_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range")


def _region(n: fx.Node):
    """``(submodule get_attr node, operands, grad_enabled)`` of an export HOP region, else None."""
    if n.op != "call_function":
        return None
    name = getattr(n.target, "__name__", str(n.target))
    if name == "wrap_with_autocast" and len(n.args) >= 5:
        return n.args[4], n.args[5:], True
    if name == "wrap_with_set_grad_enabled" and len(n.args) >= 2:
        return n.args[1], n.args[2:], bool(n.args[0])
    return None


def _inline_regions(gm: fx.GraphModule) -> None:
    """Copy the body of every autocast / set_grad_enabled region of an exported graph into the graph itself
    (outputs read by ``getitem``); a region with other users or attributes of its own stays as it is."""
    changed = False
    for n in list(gm.graph.nodes):
        reg = _region(n)
        if reg is None:
            continue
        sub_node, operands, grad = reg
        sub = getattr(gm, sub_node.target, None) if isinstance(sub_node, fx.Node) and sub_node.op == "get_attr" else None
        if not isinstance(sub, fx.GraphModule) or any(u.op != "call_function" or u.target is not operator.getitem
                                                      for u in n.users):
            continue
        _inline_regions(sub)
        if any(m.op == "get_attr" for m in sub.graph.nodes):
            continue
        phs = [m for m in sub.graph.nodes if m.op == "placeholder"]
        if len(phs) != len(operands):
            continue
        with gm.graph.inserting_before(n):
            outs = gm.graph.graph_copy(sub.graph, dict(zip(phs, operands)))
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            if not grad:
                outs = [gm.graph.call_method("detach", (o,)) if isinstance(o, fx.Node) else o for o in outs]
        for u in list(n.users):
            u.replace_all_uses_with(outs[u.args[1]])
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        if not any(m.op == "get_attr" and m.target == sub_node.target for m in gm.graph.nodes if m is not sub_node) \
                and not sub_node.users:
            gm.graph.erase_node(sub_node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _einsum_to_matmul(gm: fx.GraphModule) -> None:
    """Rewrite two-operand einsums (``torch.einsum`` in an fx graph, ``aten.einsum`` in an exported one) with one
    free index per operand and one contracted index (attention's 'bhqd,bhkd->bhqk' and 'bhqk,bhkd->bhqd', any index
    order, spaces allowed) as permute -> matmul -> permute, so attention written with einsum is found like
    ``q @ k.transpose``. The trace is then re-checked against the model."""
    aten = getattr(getattr(torch.ops.aten, "einsum", None), "default", None)
    for n in list(gm.graph.nodes):
        if not (n.op == "call_function" and (n.target is torch.einsum or (aten is not None and n.target is aten))):
            continue
        eq, *ops = n.args
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        if not isinstance(eq, str) or len(ops) != 2 or "..." in eq or "->" not in eq:
            continue
        ins, out = eq.replace(" ", "").split("->")
        xs, ys = ins.split(",")
        if any(len(set(t)) != len(t) for t in (xs, ys, out)):
            continue
        xf = [i for i in xs if i in out and i not in ys]
        yf = [i for i in ys if i in out and i not in xs]
        cc = [i for i in xs if i in ys and i not in out]
        # an index of the output only one operand has, besides its own free one (the free one: the last of them in
        # the output), is a batch index the other operand broadcasts over (MQA's 'bhid,bjd->bhij': one kv head)
        xf, yf = (sorted(f, key=out.index)[-1:] for f in (xf, yf))
        batch = [i for i in out if i not in xf + yf]
        if len(xf) != 1 or len(yf) != 1 or len(cc) != 1 or any(i not in xs + ys for i in batch) or \
                any(i not in out + cc[0] for i in xs + ys):
            continue

        def arrange(op, have, order):
            """``op`` (indices ``have``) permuted to ``order``, size-1 dims where it lacks a batch index."""
            node = gm.graph.call_method("permute", (op, *[have.index(i) for i in order if i in have]))
            for pos, i in enumerate(order):
                if i not in have:
                    node = gm.graph.call_method("unsqueeze", (node, pos))
            return node

        with gm.graph.inserting_before(n):
            xp = arrange(ops[0], xs, batch + xf + cc)
            yp = arrange(ops[1], ys, batch + cc + yf)
            mm = gm.graph.call_function(torch.matmul, (xp, yp))
            mid = batch + xf + yf
            res = gm.graph.call_method("permute", (mm, *[mid.index(i) for i in out]))
        n.replace_all_uses_with(res)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _baddbmm_to_matmul(gm: fx.GraphModule) -> None:
    """Rewrite ``baddbmm(input, b1, b2, beta=, alpha=)`` (BLOOM's ALiBi scores ``alibi.baddbmm(q, k^T)``) as
    ``beta * input + alpha * (b1 @ b2)``, so its ``b1 @ b2`` is found as attention scores like ``q @ k.transpose``
    (the same function; the trace is then re-checked against the model)."""
    aten = getattr(torch.ops.aten, "baddbmm", None)
    for n in list(gm.graph.nodes):
        fn = n.op == "call_function" and (n.target is torch.baddbmm or (aten is not None and n.target in
                                                                          (aten, getattr(aten, "default", None))))
        if not (fn or (n.op == "call_method" and n.target == "baddbmm")):
            continue
        names = ("input", "batch1", "batch2")
        args = list(n.args) + [n.kwargs[k] for k in names[len(n.args):] if k in n.kwargs]
        if len(args) != 3 or not all(isinstance(a, fx.Node) for a in args):
            continue
        beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
        if not all(isinstance(c, (int, float)) for c in (beta, alpha)):
            continue
        with gm.graph.inserting_before(n):
            res = gm.graph.call_function(torch.matmul, (args[1], args[2]))
            if alpha != 1:
                res = gm.graph.call_function(torch.mul, (res, alpha))
            if beta != 0:
                base = args[0] if beta == 1 else gm.graph.call_function(torch.mul, (args[0], beta))
                res = gm.graph.call_function(torch.add, (base, res))
        n.replace_all_uses_with(res)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _swap(a):
    if isinstance(a, torch.dtype) and a in FLOATS:
        return torch.float64
    if isinstance(a, (tuple, list)):
        return type(a)(_swap(x) for x in a)
    return a


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
    tracer = _Tracer(leaves)
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
    if gm is not None:
        try:
            _einsum_to_matmul(gm)
            _baddbmm_to_matmul(gm)
            _to64(gm)
            _same(probe, gm, inputs, kwargs)
        except Exception as e:  # noqa: BLE001
            errors.append(f"torch.fx trace does not run like the model: {e}")
            gm = None
    if gm is None:
        try:
            if leaves:
                raise ValueError("not tried with opaque blocks")
            gm = torch.export.export(probe, inputs, kwargs=kwargs, strict=False).module()
            how = "torch.export"
            _einsum_to_matmul(gm)
            _baddbmm_to_matmul(gm)
            _to64(gm)
            _same(probe, gm, inputs, kwargs, export=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"torch.export: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            err = TraceError("; ".join(errors))
            err.culprit = tracer.failed
            raise err from None
    return gm, how


@torch.no_grad()
def _same(probe, gm, inputs, kwargs, export=False):
    a = _flat(probe(*inputs, **kwargs))
    b = _flat(gm(*inputs, **kwargs) if export else gm(*inputs))
    # compared in float64: a cast of the output (``logits.float()``) runs float32 in the probe and float64 in the
    # graph (``_to64``), the same function at another precision
    a = [t.to(torch.float64) for t in a if t.is_floating_point()]
    b = [t.to(torch.float64) for t in b if t.is_floating_point()]
    # the graph computes in float64 where the model's code downcasts to float32 (precision only, ``_to64``): entries
    # near zero then differ by float32 rounding of the output's scale, so the absolute tolerance follows that scale
    if len(a) != len(b) or not a or any(x.shape != y.shape or not torch.allclose(
            x, y, rtol=1e-4, atol=1e-6 + 1e-5 * float(x.abs().max() if x.numel() else 0.0)) for x, y in zip(a, b)):
        raise ValueError("the traced graph does not reproduce the model's output")


# ------------------------------------------------------------------------------------------- detection
class _Found:
    """Candidate laws and declines gathered from the graph, before the first-order check."""

    def __init__(self, g: Graph, c: Collector):
        self.g, self.c = g, c
        # linear nodes whose output side is explained by a block (the up side of an MLP law, an attention or
        # router block); the down side of an MLP law stays free: it is the up side of the next law in a chain
        self.used: set = set()
        self.cands: list[tuple[Law, str]] = []  # (law, block description)
        self.heads: dict[str, fx.Node] = {}  # translation law name -> head output node
        self.explained: set = set()  # parameters of candidate laws (claimed or declined with a reason)
        self.gates: dict = {}  # module of a gated MLP's gate -> the module of its up projection

    def add(self, law: Law | None, what: str):
        if law is not None:
            self.cands.append((law, what))

    def free_lins(self):
        """``(node, linear)`` of the linear maps no block has used yet (checked lazily: ``used`` grows while
        the caller iterates)."""
        for n, lin in self.g.lins.items():
            if n not in self.used:
                yield n, lin


def _layer(path: str):
    return layer_index(path)


def _common(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)


def _heads(m: dict, shape: tuple, contract_last: bool):
    """From ``linear_map`` output {r: {flat: c}} into a tensor of ``shape`` (leads..., a, b), the clean map
    {(lead, pos, d): r} with the feature dim d = last (contract_last) or second-last; None if not clean."""
    a, b = shape[-2], shape[-1]
    clean = {}
    for r, nz in m.items():
        for flat in nz:  # one row may feed several heads (GQA repeat / expand); one entry reads one row
            lead, rest = divmod(flat, a * b)
            i, j = divmod(rest, b)
            key = (lead, i, j) if contract_last else (lead, j, i)
            if key in clean:
                return None
            clean[key] = r
    return clean


def _by_head(clean: dict, d: int) -> dict | None:
    """{lead: [row for dim 0..d-1]} at a single position; None when incomplete."""
    out: dict = {}
    poss = {k[1] for k in clean}
    if len(poss) != 1:
        return None
    for (lead, _, dim), r in clean.items():
        out.setdefault(lead, [None] * d)[dim] = r
    if any(None in v for v in out.values()):
        return None
    return dict(sorted(out.items()))


def _partners(g: Graph, src, dst, shape, contract_last, by_head, leads) -> dict | None:
    """RoPE pairing {d: d'} seen at other positions (dims rotated together), {} when none. One run per head dim
    and lead: the rows of dim t of every head are set at once; the dims they reach are t and its partner."""
    a, b = shape[-2], shape[-1]
    sv = g.env[src]
    n = sv.shape[-1]
    by_dim: dict = {}
    for rows_ in by_head.values():
        for dim, r in enumerate(rows_):
            by_dim.setdefault(dim, set()).add(r)
    partner: dict = {}
    seen_leads = 0
    for k in leads:
        if k >= sv.numel() // n:
            break
        before = dict(partner)
        for dim, rs in by_dim.items():
            e = torch.zeros(sv.shape, dtype=sv.dtype)
            e.view(-1, n)[k, sorted(rs)] = 1.0
            try:
                y = g.run({src: _like(sv, e)}, [dst])[0]
            except Exception:  # noqa: BLE001
                return None
            if not isinstance(y, torch.Tensor) or y.is_complex() or not torch.isfinite(y).all():
                return None
            y = y.reshape(-1)
            sc = float(y.abs().max()) if y.numel() else 0.0
            if sc == 0:
                continue
            for flat in (y.abs() > 1e-9 * sc).nonzero().flatten().tolist():
                _, rest = divmod(flat, a * b)
                i, j = divmod(rest, b)
                other = j if contract_last else i
                if other != dim:
                    if partner.get(dim, other) != other:
                        return None
                    partner[dim] = other
        if partner:
            seen_leads += 1
            if seen_leads >= 2 and partner == before:
                break  # two rotated positions agree: the pairing is complete
    if any(partner.get(v) != k for k, v in partner.items()):
        return None
    return partner


def _attention(f: _Found):
    g, c = f.g, f.c
    for n in g.nodes:
        o = g.op(n)
        if o == "sdpa":
            x, y, v = n.args[:3]
            out, y_last, site = n, True, n
        elif o == "softmax":
            s = n.args[0]
            while isinstance(s, fx.Node) and g.op(s) in SCORE_OPS and g.op(s) != "matmul":
                nxt = [a for a in s.all_input_nodes if g.is_tensor(a) and g.ancestors([a]) & set(g.lins)]
                if g.op(s) == "sub" and len(nxt) == 2 and _row_max(g, nxt[1], nxt[0]):
                    nxt = nxt[:1]  # s - max(s): softmax's shift invariance (a stabiliser), same scores
                if len(nxt) != 1:
                    break
                s = nxt[0]
            if not (isinstance(s, fx.Node) and g.op(s) == "matmul"):
                continue
            x, y = s.args[:2]
            p_ops = {"dropout", "to", "contiguous", "clone", "alias", "identity", "permute", "transpose", "view", "reshape",
                     "getitem", "slice", "narrow"}  # a slice: the probabilities of the real keys (GPT-OSS sinks)
            users = [u for u in g.descendants([n]) if g.op(u) == "matmul" and g.back_pass(u.args[0], p_ops) is n]
            if len(users) != 1:
                continue
            out, y_last, site = users[0], False, n
            v = out.args[1]
        else:
            continue
        try:
            _one_attention(f, site, x, y, v, out, y_last)
        except Exception as e:  # noqa: BLE001 - this attention block only
            f.c.decline(f"attention at graph node {site.name}", "structural analysis error",
                        f"{type(e).__name__}: {e}: no law claimed for this block (report this model)")


def _row_max(g: Graph, m, of) -> bool:
    """``m`` is ``max`` / ``amax`` of ``of`` (directly or through ``getitem`` of ``max``'s values, ``detach``, casts)."""
    m = g.back_pass(m, {"getitem", "detach", "to", "alias"})
    return isinstance(m, fx.Node) and g.op(m) in ("max", "amax") and bool(m.args) and m.args[0] is of


def _one_attention(f: _Found, site, x, y, v, out, y_last):
    g, c = f.g, f.c
    lq, lk, lv = (g.nearest_lins(t) for t in (x, y, v))
    where = f"attention at graph node {site.name}"
    if not (len(lq) == len(lk) == len(lv) == 1):
        c.decline(where, "attention", "q, k and v are not each one linear projection of the input: not analysed")
        return
    lq, lk, lv = (g.lins[next(iter(s))] for s in (lq, lk, lv))
    if any(l_.experts for l_ in (lq, lk, lv)):
        c.decline(where, "attention", "q, k or v is a per-token expert map (mixture of attention experts): not analysed")
        return
    # the output projection: the one linear reading the attention output through index ops
    cur, lo = out, None
    for _ in range(12):
        readers = g.lin_of_x(cur)
        if readers:
            lo = readers[0] if len(readers) == 1 and not readers[0].experts else None
            break
        nxt = [u for u in cur.users if g.op(u) in PASS]
        if len(nxt) != 1 or len(cur.users) != 1:
            break
        cur = nxt[0]
    xs, ys, vs, os_ = (tuple(g.env[t].shape) for t in (x, y, v, out))
    d = xs[-1]
    name = _common([lq.module, lk.module, lv.module] + ([lo.module] if lo else [])) or lq.module
    layer = _layer(name)
    f.used.update({lq.node, lk.node, lv.node})
    # query heads and their rows, at the first lead whose map is clean (RoPE is the identity at position 0)
    nlead = g.env[lq.node].numel() // lq.n_out
    qmap = None
    for k0 in range(min(nlead, 3)):
        m = g.clean_map(lq.node, x, k0)
        if m is None:
            continue
        clean = _heads(m, xs, True)
        qmap = _by_head(clean, d) if clean else None
        if qmap:
            break
    kmap = None
    if qmap:
        mk = g.clean_map(lk.node, y, k0)
        ck = _heads(mk, ys, y_last) if mk is not None else None  # manual: Y = K^T (..., D, S)
        kmap = _by_head(ck, d) if ck else None
    mv = g.clean_map(lv.node, v, 0)
    cv = _heads(mv, vs, True) if mv is not None else None
    vmap = _by_head(cv, vs[-1]) if cv else None
    qk_reason = None
    if qmap is None or kmap is None:
        qk_reason = ("the q/k paths are not linear index maps of the projections (QK-norm or another "
                     "normalisation, or an unrecognised layout): no QK Gram / RoPE law (spec breakers: QK-norm)")
    nq = len(qmap) if qmap else 0
    # kv lead of query head lead l (sdpa GQA broadcasts fewer kv heads)

    def kv_lead(l, mp, shp):
        if not mp or len(mp) == nq:
            return l
        rep = nq // len(mp)
        return sorted(mp)[0] + (l - sorted(qmap)[0]) // rep if rep else None

    # RoPE pairing from other positions
    pairs = passd = None
    if qk_reason is None:
        leads = [k for k in range(1, min(nlead, 5)) if k != k0]
        pq = _partners(g, lq.node, x, xs, True, qmap, leads)
        pk = _partners(g, lk.node, y, ys, y_last, kmap, leads)
        if pq is None or pk is None or pq != pk:
            qk_reason = "q and k are mixed across dims in a way that is not a RoPE pairing: no QK law"
        elif pq:
            pairs = sorted({tuple(sorted(p)) for p in pq.items()})
            passd = [t for t in range(d) if t not in pq]
    groups: dict = {}
    if qmap:
        for l in qmap:
            kl = kv_lead(l, kmap, ys)
            key = tuple(kmap[kl]) if kmap and kl in kmap else None
            groups.setdefault(key, []).append(l)
    lab = name or "model"
    if qk_reason is None:
        for j, (krows, heads) in enumerate(groups.items()):
            note = f"structural: query heads {list(range(len(heads)))} of group {j} read kv rows of {lk.w}"
            if pairs is None:
                law = builders.head_gram(QKGram, f"{lab}/qk/group{j}", layer,
                                         [builders.block(lq.w, lq.shape, qmap[l], transposed=lq.t, bias=lq.b) for l in heads],
                                         [builders.block(lk.w, lk.shape, list(krows), transposed=lk.t, bias=lk.b)],
                                         note=note + " (spec: MHA / GQA rows)")
                if law is None:
                    c.decline(f"{lab}/qk/group{j}", "QK Gram", "head rows are not a strided block of the weight")
                f.add(law, "QK Gram")
            else:
                law = builders.rope_pair_law(
                    f"{lab}/rope/group{j}", layer,
                    q=[(lq.w, lq.shape, lq.b, qmap[l], lq.t) for l in heads], k=[(lk.w, lk.shape, lk.b, list(krows), lk.t)],
                    pairs=pairs, note=note + f"; RoPE pairs {pairs[:3]}... of head_dim {d} (spec: RoPE rows)")
                f.add(law, "RoPE pairs")
                if passd:
                    law = builders.head_gram(
                        RopePassGram, f"{lab}/rope_pass/group{j}", layer,
                        [builders.block(lq.w, lq.shape, [qmap[l][t] for t in passd], transposed=lq.t, bias=lq.b)
                         for l in heads],
                        [builders.block(lk.w, lk.shape, [krows[t] for t in passd], transposed=lk.t, bias=lk.b)],
                        note=f"pass-through dims {passd} (spec: partial rotary)")
                    if law is None:
                        c.decline(f"{lab}/rope_pass/group{j}", "partial rotary Gram", "pass-through rows not strided")
                    f.add(law, "partial rotary Gram")
    else:
        qkn = _qk_norm(f, lq, lk, x, y, y_last, lab, layer)
        c.decline(f"{lab}/qk", "QK laws", qkn or qk_reason)
    # VO
    if lo is None:
        c.decline(f"{lab}/vo", "VO laws", "the attention output is not read by one linear projection: no VO law")
        return
    f.used.add(lo.node)
    c.know(lo.b)
    omap = None
    if vmap:
        # every (head lead l, dim t) of the attention output at position 0 encoded as one value: the output
        # projection's input columns at batch 0 / position 0 read them one to one
        on = g.env[out]
        nl, dd = on.numel() // (os_[-2] * os_[-1]), os_[-1]

        def orun(vals):
            e = torch.zeros(on.shape, dtype=on.dtype)
            e.view(-1, os_[-2], dd)[:, 0, :] = vals.view(nl, dd)
            return g.run({out: _like(on, e)}, [lo.x])[0].reshape(-1, lo.n_in)

        codes = torch.arange(1, nl * dd + 1, dtype=on.dtype)
        rnd = torch.rand(nl * dd, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(on.dtype) + 0.5
        ya, yb, yc = orun(codes), orun(torch.ones_like(codes)), orun(rnd)
        omap = {}
        sc = float(yb.abs().max())
        for col in range(lo.n_in):
            if sc == 0 or abs(float(yb[0, col])) <= 1e-9 * sc:
                continue
            ratio = float(ya[0, col] / yb[0, col])
            code = round(ratio)
            if abs(ratio - code) > 1e-6 or not 1 <= code <= nl * dd or \
                    abs(float(yc[0, col]) - float(yb[0, col]) * float(rnd[code - 1])) > 1e-9 * sc:
                omap = None
                break
            l, t = divmod(code - 1, dd)
            omap.setdefault(l, [None] * dd)[t] = col
        if omap is not None and any(None in cols_ for cols_ in omap.values()):
            omap = None
        if omap is not None and (not omap or len(omap) % len(vmap)):
            omap = None
    if omap is None or vmap is None:
        c.decline(f"{lab}/vo", "VO laws", "the value / output paths are not linear index maps: no VO law")
        return
    vgroups: dict = {}
    vleads, rep = sorted(vmap), len(omap) // len(vmap)
    for i, l in enumerate(sorted(omap)):
        vgroups.setdefault(tuple(vmap[vleads[i // rep]]), []).append(l)
    for j, (vrows, heads) in enumerate(vgroups.items()):
        law = builders.head_gram(VOGram, f"{lab}/vo/group{j}", layer,
                                 [builders.block(lv.w, lv.shape, list(vrows), transposed=lv.t, bias=lv.b)],
                                 [builders.block(lo.w, lo.shape, omap[l], kind="cols", transposed=lo.t) for l in heads],
                                 note=f"structural: {len(heads)} query head(s) read these value rows (spec: MHA value/"
                                      "output row)")
        if law is None:
            c.decline(f"{lab}/vo/group{j}", "VO Gram", "value rows / output columns are not strided blocks")
        f.add(law, "VO Gram")


def _qk_norm(f: _Found, lq: Lin, lk: Lin, x, y, y_last, lab: str, layer) -> str | None:
    """QK-norm (a per-feature gain on each of the q and k paths after a normalisation): the QK Gram / RoPE laws
    are gone; scaling dim t of the q gain by c and of the k gain by 1/c (equally within a rotary pair) keeps
    every score, which gives the ``qk_norm_gain`` law. Returns the decline reason for the QK laws, or None
    when no QK-norm gain was found."""
    g = f.g
    pts = _scale_points(g)

    def on(src, dst):
        between = g.ancestors([dst]) & g.descendants([src])
        return [p for p in pts if p[0] in between]

    sq, sk = on(lq.node, x), on(lk.node, y)
    if len(sq) != 1 or len(sk) != 1:
        return None
    (nq, wq, bq, shq, _), (nk, wk, bk, shk, _) = sq[0], sk[0]
    if shq != shk:
        return None
    f.explained.update({lq.w, lk.w} | ({lq.b} if lq.b else set()) | ({lk.b} if lk.b else set()))
    reason = (f"QK-norm ({wq.rsplit('.', 1)[0]}, {wk.rsplit('.', 1)[0]}): q and k are normalised, so the QK Gram / "
              "RoPE-pair symmetries of the q/k rows are gone (spec breakers: QK-norm); the VO laws are kept, the "
              "gains get a qk_norm_gain law; the ||Q||^2 scale laws are not built structurally")
    xs, ys = tuple(g.env[x].shape), tuple(g.env[y].shape)

    def gain_map(src, dst, shp, last):
        """{head lead: [gain index for head dim 0..D-1]} at position 0, and the RoPE partners."""
        n_src = g.env[src].numel() // g.env[src].shape[-1]
        for k0 in range(min(n_src, 2)):
            m = g.clean_map(src, dst, k0)
            clean = _heads(m, shp, last) if m is not None else None
            bh = _by_head(clean, shp[-1] if last else shp[-2]) if clean else None
            if bh:
                part = _partners(g, src, dst, shp, last, bh, range(k0 + 1, min(n_src, 4 * len(bh) + 4)))
                return bh, part
        return None, None

    mq, pq = gain_map(nq, x, xs, True)
    mk, pk = gain_map(nk, y, ys, y_last)
    if not mq or not mk or pq is None or pk is None or pq != pk:
        return reason.replace("the gains get a qk_norm_gain law", "the gains' layout is not recognised (no gain law)")
    d = xs[-1]
    pairs = sorted({tuple(sorted(p)) for p in pq.items()}) if pq else [(t,) for t in range(d)]
    if pq and len(pairs) * 2 != d:
        return reason.replace("the gains get a qk_norm_gain law", "partial rotary with QK-norm: no gain law")
    lq_, lk_ = sorted(mq), sorted(mk)
    if g.params[wq].numel() == d and g.params[wk].numel() == d:  # one gain shared by all heads (per-head norm)
        groups = [([lq_[0]], [lk_[0]])]
    else:  # a norm over all heads: one law per kv group (the query heads reading the same k gains)
        if len(lk_) % len(lq_) and len(lq_) % len(lk_):
            return reason
        rep = max(len(lq_) // len(lk_), 1)
        by_k: dict = {}
        for i, l in enumerate(lq_):
            kl = lk_[i] if len(lk_) == len(lq_) else lk_[i // rep]
            by_k.setdefault(tuple(mk[kl]), ([], [kl]))[0].append(l)
        groups = list(by_k.values())
    for j, (qh, kh) in enumerate(groups):
        qe = [[mq[l][t] for l in qh for t in pair] for pair in pairs]
        ke = [[mk[l][t] for l in kh for t in pair] for pair in pairs]
        f.add(builders.qk_norm_gain_law(f"{lab}/qk_norm_gain/group{j}", layer, q_gain=wq, k_gain=wk, entries=qe,
                                        k_entries=ke, q_bias=bq, k_bias=bk, shift=shq,
                                        note=f"structural: QK-norm gains, {'RoPE pairs' if pq else 'per dim'} "
                                             "(spec: QK-norm breaker + RoPE row)"), "QK-norm gain")
    return reason


def _mlps(f: _Found):
    g, c = f.g, f.c
    for n, down in f.free_lins():
        u = g.back_pass(down.x)
        o = g.op(u)
        if u in g.lins and u not in f.used and len(u.users) == 1 and _branch(g, u, n) is None \
                and not (g.lins[u].experts or down.experts):
            up = g.lins[u]
            fm = g.feature_map(u, down.x)
            if fm and -1 not in fm:
                f.add(builders.head_gram(DeepLinearGram, f"{up.module}-{down.module}/gram", _layer(up.module),
                                         [builders.block(up.w, up.shape, fm, transposed=up.t, bias=up.b)],
                                         [builders.block(down.w, down.shape, range(len(fm)), kind="cols", transposed=down.t)],
                                         note="structural: two linear maps with nothing but index ops between (spec: "
                                              "deep linear row)"), "deep linear")
                f.used.add(u)
            continue
        chain, src = [], u
        while isinstance(src, fx.Node) and src not in g.lins and g.op(src) in ELEMENTWISE and src.args \
                and isinstance(src.args[0], fx.Node) and len(src.users) == 1:
            chain.append(g.op(src))
            src = g.back_pass(src.args[0])
        if chain and src in g.lins and src not in f.used:
            up = g.lins[src]
            kinds = "-".join(reversed(chain))
            f.used.add(src)
            if all(o_ in POSITIVE for o_ in chain):
                if _declined_branch(f, src, n, f"Linear-{kinds}-Linear"):
                    continue
                fm = g.feature_map(src, down.x)
                if not fm or -1 in fm:
                    c.decline(up.module, f"Linear-{kinds}-Linear", "the units between the two maps are not an index map")
                    continue
                _unit_laws(f, ReLUUnit, f"{up.module}/unit", up, down, fm,
                           f"structural: Linear-{kinds}-Linear (spec: ReLU row)", "ReLU unit")
                c.know(down.b)
            elif any(o_ in NO_LAW for o_ in chain) and len(chain) == 1:
                c.decline(up.module, f"Linear-{kinds.upper()}-Linear", NO_LAW_ACT)
                c.decline(down.module, f"Linear-{kinds.upper()}-Linear output", "see the MLP's input layer")
            else:
                c.decline(up.module, f"Linear-{kinds}-Linear", f"the element-wise map {kinds!r} is not in the catalogue "
                          "(no rescaling symmetry is known for it): no law")
                c.decline(down.module, f"Linear-{kinds}-Linear output", "see the MLP's input layer")
        elif o != "mul" and _generic_act(f, n, down):
            continue
        elif o == "mul":
            u = _peel_scale(g, u)  # (up x * g) * c: a constant or per-unit parameter c (x-transformers' mult_bias)
            ops = [a for a in u.args if isinstance(a, fx.Node)]
            if len(ops) != 2:
                continue
            for i in (1, 0):
                cand = ops[i]
                lins = g.nearest_lins(cand)
                if len(lins) != 1:
                    continue
                src = next(iter(lins))
                if src in f.used:
                    continue
                fm = g.feature_map(src, cand)
                if not fm or -1 in fm:
                    continue
                other = ops[1 - i]
                gate = g.op(g.back_pass(other))
                up = g.lins[src]
                if not _unit_laws(f, SwiGLUUnit, f"{up.module}/unit", up, down, fm,
                                  f"structural: down({gate} gate * up x); the gate is not involved (spec: SwiGLU row)",
                                  "gated unit"):
                    continue
                c.know(down.b)
                f.used.update({src} | {x for x in g.nearest_lins(other)})
                for x in g.nearest_lins(other):
                    if x in g.lins and g.lins[x].module != up.module:
                        f.gates[g.lins[x].module] = up.module
                break


def _peel_scale(g: Graph, u: fx.Node) -> fx.Node:
    """The inner product of ``(a * b) * c`` when c is a constant or a parameter (repeatedly); ``u`` otherwise."""
    while g.op(u) == "mul" and len(u.args) == 2:
        t = [a for a in u.args if isinstance(a, fx.Node) and g.param_of(g.back_pass(a)) is None]
        if len(t) != 1 or g.op(g.back_pass(t[0])) != "mul" or len(t[0].users) != 1:
            break
        u = g.back_pass(t[0])
    return u


def _unit_laws(f: _Found, cls, name: str, up: Lin, down: Lin, units, note: str, what: str) -> bool:
    """Unit law(s) of ``up`` rows ``units`` read by ``down`` columns: one law, or one per expert when both are
    fused experts gathered per token (``Lin.experts``: token s uses expert ids[s] in both maps, as the graph's
    index shows; named ``<experts module>.<e>/unit`` as the HF handler does). False (nothing added) when only one
    of them is per-expert or their expert counts differ."""
    if not up.experts and not down.experts:
        f.add(builders.unit_law(cls, name, _layer(up.module), up=up.w, up_shape=up.shape, units=units, down=down.w,
                                down_shape=down.shape, up_bias=up.b, up_t=up.t, down_t=down.t, note=note), what)
        return True
    if up.experts != down.experts:
        return False
    for e in range(up.experts):
        f.add(builders.unit_law(cls, f"{up.module}.{e}/unit", _layer(up.module), up=up.w, up_shape=up.shape,
                                units=units, down=down.w, down_shape=down.shape, up_bias=up.b, up_t=up.t, down_t=down.t,
                                lead=(e,), note=f"{note}; expert {e} of fused experts gathered per token"), what)
    return True


def _elementwise(g: Graph, src: fx.Node, dst: fx.Node) -> str | None:
    """'positive' when ``dst = f(src)`` element-wise with f(c z) = c f(z) for c > 0 (ReLU-like), 'none' for any
    other element-wise f, None when the map is not element-wise (checked on the recorded values)."""
    z, y = g.env[src], g.env[dst]
    if not (isinstance(z, torch.Tensor) and isinstance(y, torch.Tensor)) or z.shape != y.shape or not z.is_floating_point():
        return None
    n = z.shape[-1]
    try:
        for r in (0, n // 2, n - 1):
            z2 = z.detach().clone().contiguous()
            z2.view(-1, n)[0, r] += 0.37
            d = (g.run({src: _like(z, z2)}, [dst])[0] - y).reshape(-1, n)
            d[0, r] = 0.0
            if d.abs().max() > 0:
                return None
        hom = all(torch.allclose(g.run({src: _like(z, c * z)}, [dst])[0], c * y, rtol=1e-12, atol=1e-12)
                  for c in (2.5, 0.3))
    except Exception:  # noqa: BLE001
        return None
    return "positive" if hom else "none"


def _generic_act(f: _Found, n: fx.Node, down: Lin) -> bool:
    """``down(act(up x))`` for an element-wise act written with several ops (GPT-2's tanh GELU, torch.where
    ReLU...): ReLU unit law when act is positively homogeneous, declined otherwise (numerically decided)."""
    g, c = f.g, f.c
    lins = g.nearest_lins(down.x)
    if len(lins) != 1:
        return False
    src = next(iter(lins))
    if src in f.used or src is n:
        return False
    kind = _elementwise(g, src, down.x)
    if kind is None:
        return False
    up = g.lins[src]
    f.used.add(src)
    if kind == "positive":
        if _declined_branch(f, src, n, "Linear-activation-Linear"):
            return True
        _unit_laws(f, ReLUUnit, f"{up.module}/unit", up, down, range(up.n_out),
                   "structural: positively homogeneous element-wise activation (spec: ReLU row)", "ReLU unit")
        c.know(down.b)
    else:
        c.decline(up.module, "Linear-activation-Linear", NO_LAW_ACT + " (element-wise, not positively homogeneous)")
        c.decline(down.module, "Linear-activation-Linear output", "see the MLP's input layer")
    return True


def _branch(g: Graph, src: fx.Node, down: fx.Node) -> fx.Node | None:
    """A node reading a value computed from ``src`` (an up map's output) that is not on a path to the linear
    node ``down`` (a second reader of the units: another linear, a residual, the output); None when the
    units reach the rest of the model only through ``down``. Shape reads (``SHAPE_ONLY``) are not readers."""
    to_down = g.ancestors([down])
    seen, stack = {src}, [src]
    while stack:
        m = stack.pop()
        for u in m.users:
            if u is down or u in seen or g.op(u) in SHAPE_ONLY:
                continue
            if u not in to_down:
                return u
            seen.add(u)
            stack.append(u)
    return None


def _declined_branch(f: _Found, src: fx.Node, down: fx.Node, block: str) -> bool:
    """Decline the up map ``src`` of a unit law when its units are also read outside ``down`` (``_branch``)."""
    other = _branch(f.g, src, down)
    if other is None:
        return False
    up, lin = f.g.lins[src], f.g.lins[down]
    reader = repr(f.g.lins[other].module) if other in f.g.lins else f"a {f.g.op(other)!r} op"
    f.c.decline(up.module, block, f"its units are read by {lin.module!r} and also by {reader}: a per-unit law would "
                "need the columns of every reader (not in the catalogue): no law")
    return True


def _routers(f: _Found):
    g, c = f.g, f.c
    for n, r in f.free_lins():
        ends, stack, ok = [], [n], True
        while stack:
            m = stack.pop()
            for u in m.users:
                o = g.op(u)
                if o in ("softmax", "sigmoid", "log_softmax"):
                    ends.append(u)
                elif o == "topk":
                    vals = [w for w in u.users if g.op(w) == "getitem" and w.args[1] == 0]
                    stack.extend(vals)
                elif o in ("to", "dropout", "view", "reshape"):
                    stack.append(u)
                elif o == "getitem" and m is not n:
                    stack.append(u)
                else:
                    ok = False
        if not ok or not ends:
            continue
        kinds = {g.op(e) for e in ends}
        gated = any(g.op(w) != "output" for e in ends for w in g.descendants([e]) if w is not e)
        if not gated:
            continue
        e_n = r.n_out
        if kinds == {"softmax"}:
            f.add(builders.row_sum_law(RouterSum, f"{r.module}/router", _layer(r.module), r.w, r.shape, e_n,
                                       bias=r.b, transposed=r.t,
                                       note="structural: softmax gating (top-k, renormalised or not) (spec: MoE router "
                                            "row)"), "router")
        elif "sigmoid" in kinds:
            c.decline(r.module, "sigmoid router", "sum_e W_router[e,:] is NOT conserved for normalised sigmoid gating "
                      "with top-k >= 2 (spec: MoE router, normalised sigmoid: open row)")
        else:
            continue
        f.used.add(n)


def _scale_points(g: Graph):
    """(out node, gain param, bias param, shift, what) of every per-feature scale ``g * x (+ beta)``."""
    out = []
    for n in g.nodes:
        if n.op == "call_module":
            m = g.gm.get_submodule(n.target)
            w = getattr(m, "weight", None)
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or type(m).__name__.endswith(("Norm", "RMSNorm")):
                if isinstance(w, nn.Parameter) and w.dim() == 1 and not g.lins.get(n):
                    b = getattr(m, "bias", None)
                    out.append((n, f"{n.target}.weight", f"{n.target}.bias" if isinstance(b, nn.Parameter) else None,
                                0.0, type(m).__name__))
            continue
        o = g.op(n)
        if o in ("layer_norm", "rms_norm") and n.op == "call_function":
            args = list(n.args)
            w = g.param_of(args[2]) if len(args) > 2 else g.param_of(n.kwargs.get("weight"))
            b = g.param_of(args[3]) if o == "layer_norm" and len(args) > 3 else None
            if w is not None:
                out.append((n, w, b, 0.0, o))
        elif o == "mul" and n.op == "call_function":
            for i, a in enumerate(n.args[:2]):
                a0 = g.back_pass(a) if isinstance(a, fx.Node) else a
                shift = 0.0
                if isinstance(a0, fx.Node) and g.op(a0) == "add" and g.param_of(g.back_pass(_other(a0, None)[0])):
                    p_node, const = _other(a0, None)
                    if isinstance(const, (int, float)):
                        shift, a0 = float(const), g.back_pass(p_node)
                p = g.param_of(a0)
                if p is not None and g.params[p].dim() == 1:
                    nxt = [u for u in n.users]
                    beta = None
                    if len(nxt) == 1 and g.op(nxt[0]) == "add":
                        q = [g.param_of(x) for x in nxt[0].args if isinstance(x, fx.Node)]
                        q = [x for x in q if x and g.params[x].dim() == 1 and g.params[x].shape == g.params[p].shape]
                        if q:
                            beta, n2 = q[0], nxt[0]
                            out.append((n2, p, beta, shift, "scale"))
                            break
                    out.append((n, p, beta, shift, "scale"))
                    break
    return out


def _other(add_node, _):
    """(tensor operand, constant operand) of a binary add."""
    a, b = (list(add_node.args) + [None, None])[:2]
    return (a, b) if isinstance(a, fx.Node) else (b, a)


def _gains(f: _Found):
    g, c = f.g, f.c
    experts_x = {}  # the unsqueeze node through which a per-token expert map reads its input -> that map
    for lin in g.lins.values():
        if lin.experts:
            for u in lin.x.users:
                if g.op(u) == "unsqueeze" and u in g.ancestors([lin.node]):
                    experts_x[u] = lin
    claimed = {p for law, _ in f.cands for p in law.params}
    for n, w, b, shift, what in _scale_points(g):
        if w in claimed:  # e.g. a QK-norm gain, already in a law
            continue
        h = g.params[w].shape[0]
        path = w.rsplit(".", 1)[0] if "." in w else w
        readers, bad = [], []

        def visit(m, u, h=h, readers=readers, bad=bad):
            if u in g.lins and g.lins[u].x is m:
                readers.append(g.lins[u])
            elif u in experts_x and experts_x[u].x is m:  # x.unsqueeze(...) of a per-token expert map
                readers.append(experts_x[u])
            elif g.op(u) == "to" and u.args and u.args[0] is not m:
                pass  # type_as(other, m): m's dtype only
            elif g.op(u) in PASS and g.is_tensor(u) and g.env[u].dim() > 0 and g.env[u].shape[-1] == h \
                    and g.op(u) not in ("transpose", "permute", "movedim", "t"):
                return True
            elif g.op(u) not in SHAPE_ONLY:
                bad.append(u)
            return False

        g.walk_users([n], visit)
        what_ = what if what != "scale" else "per-feature scale"
        if (bad or not readers) and what == "scale" and b is None and shift == 0.0 and _layer_scale(f, n, w, h):
            continue
        if bad or not readers:
            uses = list(dict.fromkeys(_use(g, u, n) for u in bad)) or ["nothing"]
            by = ", ".join(dict.fromkeys(r.module or r.w for r in readers))
            seen_ = "; ".join(uses) + (f" (besides the linear map(s) {by})" if readers else "")
            c.decline(path, what_, f"the scaled output is read by {seen_}: not only by linear maps with stored weights, "
                      "as a gain law needs (the residual stream in a post-LN block, attention scores after a QK-norm, "
                      "a weight computed from parameters, or an unrecognised module): no gain law (spec: pre-norm gain "
                      "row; breakers: post-LN)")
            continue
        maps = [g.feature_map(n, r.x) for r in readers]
        if any(m != list(range(h)) for m in maps):
            c.decline(path, what_, "its readers do not read the features one to one: no gain law")
            continue
        f.add(builders.gain_law(f"{path}/gain", _layer(path), w, h, readers=[x for r in readers for x in r.readers()], bias=b,
                                shift=shift, note="structural: readers " + ", ".join(dict.fromkeys(r.module for r in readers))
                                + (f"; gain applied as ({shift:g} + w)" if shift else "") + " (spec: pre-norm gain row)"),
              "gain")


def _use(g: Graph, u: fx.Node, src: fx.Node) -> str:
    """What the graph node ``u`` reading ``src``'s value is, in words (for a decline reason)."""
    o = g.op(u)
    hops = []
    while o in PASS and len(u.users) == 1 and len(hops) < 4:  # a layout change on the way to the real reader
        hops.append(o)
        u = next(iter(u.users))
        o = g.op(u)
    if hops:
        return f"{' -> '.join(map(repr, hops))} then {_use(g, u, src)}"
    if o == "opaque":
        return f"the opaque block {u.target!r} (analysed on its own)"
    if u.op == "call_module":
        return f"{o} module {u.target!r}"
    if o in ("linear", "matmul", "einsum", "addmm", "baddbmm", "conv1d", "conv2d"):
        down = g.descendants([src])
        ps = sorted({a.target for a in g.ancestors([a for a in u.all_input_nodes if a not in down])
                     if a.op == "get_attr" and a.target in g.params})
        if ps:
            return f"{o} with a weight computed from {ps} (not the parameter as stored: its rows / columns unknown)"
        return f"{o} with another activation (not a parameter)"
    return repr(o)


def _layer_scale(f: _Found, n: fx.Node, w: str, h: int) -> bool:
    """LayerScale ``gamma * (W x + b)`` (the scale reads a linear's output feature by feature): the catalogue's
    diagonal-rescaling law ``gamma_c^2 - ||W[c,:]||^2 - b_c^2``. True when built."""
    g = f.g
    arg = next((a for a in n.args[:2] if isinstance(a, fx.Node) and g.param_of(g.back_pass(a)) != w), None)
    src = g.back_pass(arg) if arg is not None else None
    if src not in g.lins or len(src.users) != 1 or g.lins[src].experts:
        return False
    lin = g.lins[src]
    if lin.n_out != h or g.feature_map(src, arg) != list(range(h)):
        return False
    path = w.rsplit(".", 1)[0] if "." in w else w
    # a LayerScale module's one parameter (ls1.gamma): the module names the law; a block's own parameters
    # (EVA's gamma_1, gamma_2 on the block): the parameter does, so that the two laws keep two names
    label = path if w.rsplit(".", 1)[-1] in ("gamma", "weight", "scale") else w
    f.add(builders.layer_scale_law(f"{label}/layer_scale", _layer(path), w, h, [(lin.w, lin.shape, lin.b, lin.t)],
                                   note=f"structural: {path} scales the output features of {lin.module} (diagonal "
                                        "rescaling, as the spec's deep-linear row)"), "LayerScale")
    return True


def _output_layers(f: _Found):
    g, c = f.g, f.c
    loss = c.options.get("loss")
    for n, lin in g.lins.items():
        if lin.experts:
            continue
        ends, other = set(), set()

        def visit(m, u, ends=ends, other=other):
            o = g.op(u)
            if o == "output":
                ends.add("output")
            elif o == "cross_entropy" and u.args[0] is m:
                ends.add("ce")
            elif o in ("view", "reshape", "getitem", "to", "contiguous", "flatten", "squeeze", "unsqueeze"):
                return True
            elif o in ("mul", "div") and len(u.args) == 2 and isinstance(u.args[1], (int, float)) and u.args[1]:
                return True  # a constant logit scale (Granite): shifting every logit commutes with it
            else:
                other.add(o)
            return False

        g.walk_users([n], visit)
        to_out, ce = "output" in ends, "ce" in ends
        if not (to_out or ce):
            continue
        if other:
            c.decline(lin.module, "output layer", f"its logits also go through {sorted(other)} before the output (e.g. a "
                      "soft-cap): no translation law (spec breakers)")
        elif ce or loss == "ce":
            law = builders.row_sum_law(Translation, f"{lin.module}/translation", None, lin.w, lin.shape, lin.n_out,
                                       bias=lin.b, transposed=lin.t,
                                       note="structural: softmax cross-entropy only (spec: untied softmax output row)")
            f.add(law, "translation")
            f.heads[law.name] = n
        else:
            c.decline(lin.module, "output layer", builders.ce_only(loss))


# ------------------------------------------------------------------------------------------- the check
def check_laws(g: Graph, laws: list, heads: dict, *, trials: int = 2, seed: int = 0) -> dict[str, float]:
    """Spec check 1 for every law on the traced probe (``conserve.analysis.verify.first_order``'s measure, the model
    gradients shared by all laws): worst ``|<grad (s.h), grad (r.f)>| / (||.|| ||.||)`` (float64)."""
    from ..kernels import evaluate_reference
    from ..laws import compile_laws
    from torch.func import functional_call

    gen = torch.Generator().manual_seed(seed)
    names = [k for k, _ in g.gm.named_parameters()]
    params = {k: g.params[k].detach().clone().requires_grad_(True) for k in names}
    buffers = dict(g.gm.named_buffers())
    plist = list(params.values())

    def flat(grads):
        return {k: (t if t is not None else torch.zeros_like(p)) for (k, p), t in zip(params.items(), grads)}

    raw, ce = [], []
    for _ in range(trials):
        outs = [t for t in _flat(functional_call(g.gm, {**params, **buffers}, g.inputs, g.kwargs))
                if t.is_floating_point() and t.requires_grad]
        if not outs:
            raise ValueError("no floating output of the forward depends on the model's parameters (e.g. a forward "
                             "bound to another instance, or outputs detached)")
        obj = sum((torch.randn(t.shape, generator=gen, dtype=t.dtype) * t).sum() for t in outs)
        raw.append(flat(torch.autograd.grad(obj, plist, retain_graph=True, allow_unused=True)))
        if heads:
            logits = [t for t in outs if t.dim() >= 1 and t.shape[-1] > 1]
            lo = sum(F.cross_entropy(t.reshape(-1, t.shape[-1]),
                                     torch.randint(0, t.shape[-1], (t.numel() // t.shape[-1],), generator=gen))
                     for t in logits)
            ce.append(flat(torch.autograd.grad(lo, plist, allow_unused=True)))
    norms = [torch.sqrt(sum((v * v).sum() for v in b.values())) for b in raw]
    cnorms = [torch.sqrt(sum((v * v).sum() for v in b.values())) for b in ce]
    out = {}
    for law in laws:
        if any(p not in params for p in law.params):
            out[law.name] = float("nan")
            continue
        comp = compile_laws([law], {k: tuple(params[k].shape) for k in law.params})
        vec, grams = evaluate_reference(comp.plan, [params[k] for k in comp.names], fp64=True)
        h = comp.split(vec, grams)[0].reshape(-1)
        worst = 0.0
        use = (ce, cnorms) if isinstance(law, Translation) else (raw, norms)
        for b, bn in zip(*use):
            s = torch.randn(h.shape, generator=gen, dtype=torch.float64)
            ga = torch.autograd.grad((s * h).sum(), [params[k] for k in comp.names], retain_graph=True, allow_unused=True)
            a = {k: t for k, t in zip(comp.names, ga) if t is not None}
            an = torch.sqrt(sum((t * t).sum() for t in a.values()))
            if an == 0:  # h does not move with any parameter here: constant, nothing to track
                worst = -1.0
                break
            if bn == 0:
                continue
            dot = sum((a[k] * b[k]).sum() for k in a)
            worst = max(worst, float(dot.abs() / (an * bn)))
        out[law.name] = worst
    return out


def check_on_probe(model: nn.Module, laws: list, *, example_inputs=None, forward_kwargs: dict | None = None,
                   max_probe_params: float = 3e8, **_options) -> tuple[dict[str, float] | None, str, bool]:
    """Spec check 1 (``check_laws``' measure) of ``laws`` found by a type-based detector, on ``model``'s own
    forward: a float64 copy with random parameters, run as is (not traced), on ``example_inputs`` or synthesised
    ones. A module type says what its own ``forward`` computes, not how the model calls it (an
    ``nn.Sequential``'s layers may be called one by one, with other maps between them). Returns
    ``({law name: worst violation}, "", traced)`` (-1: identically constant; nan: reads a parameter the model does
    not hold under that name, e.g. tied; ``traced``: False when the module ran as is, its own float32 casts then
    bound the measure near 1e-8) or ``(None, reason, False)`` when the probe cannot run (meta device, no input)."""
    if not laws:
        return {}, "", True
    try:
        probe = make_probe(model, max_probe_params)
        kwargs = {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in (forward_kwargs or {}).items()}
        no_cache(model, kwargs)
        inputs = synth_inputs(probe, example_inputs, kwargs)
    except Exception as e:  # noqa: BLE001 - the caller keeps the laws and says why they were not checked
        return None, str(e), False
    try:  # traced: the code's float32 casts made float64 (HF modeling code), so the check resolves 1e-10
        gm, how = trace(probe, inputs, kwargs)
        run_kwargs, traced = (kwargs if how == "torch.export" else {}), True
    except Exception:  # noqa: BLE001 - the module as is (plain torch.nn code computes in the probe's float64)
        gm, run_kwargs, traced = probe, kwargs, False

    class _Probe:  # what check_laws reads of a Graph: the module run, its parameters, inputs and kwargs
        params = dict(probe.named_parameters(remove_duplicate=False))

    _Probe.gm, _Probe.inputs, _Probe.kwargs = gm, inputs, run_kwargs
    heads = {law.name: None for law in laws if isinstance(law, Translation)}
    try:
        return check_laws(_Probe, laws, heads), "", traced
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}", False


# ------------------------------------------------------------------------------------------- entry point
def detect_graph(model: nn.Module, example_inputs=None, *, forward_kwargs: dict | None = None, loss: str | None = None, max_probe_params: float = 3e8,
                 skip_params: Iterable[str] = (), **options) -> Detection:
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
        for mod in _param_modules(model, skip):
            c.decline(mod, "not analysed", reason)
        return c.finish("graph")
    try:
        kwargs = {k: (v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in (forward_kwargs or {}).items()}  # tensors: inputs of the float64 probe, as example_inputs
        no_cache(model, kwargs)
        inputs = synth_inputs(probe, example_inputs, kwargs)
        gm, how = trace(probe, inputs, kwargs)
        g = Graph(gm, inputs, dict(probe.named_parameters(remove_duplicate=False)),
                  kwargs if how == "torch.export" else {})
    except Exception as e:  # noqa: BLE001 - the blocks are analysed one by one (``blocks``)
        from .blocks import by_blocks

        return by_blocks(model, c, e, example_inputs=example_inputs, forward_kwargs=forward_kwargs, loss=loss,
                         max_probe_params=max_probe_params, skip=skip, options=options, depth=depth)
    return detect_on(g, c, model, how, skip)


def detect_on(g: Graph, c: Collector, model: nn.Module, how: str, skip: set) -> Detection:
    """Steps 3 and 4 of the module docstring on the traced probe ``g``: candidate laws, the first-order check,
    the declines; ``c.finish``. ``skip``: parameters not to build laws of or decline (explained elsewhere)."""
    f = _Found(g, c)
    for step in (_attention, _routers, _mlps, _gains, _output_layers):
        try:
            step(f)
        except Exception as e:  # noqa: BLE001 - one block kind failing never fails the whole model
            c.decline(f"<{step.__name__.strip('_')}>", "structural analysis error",
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


def _param_modules(model: nn.Module, skip) -> list[str]:
    out = []
    for name, _ in model.named_parameters():
        if name in skip:
            continue
        mod = name.rsplit(".", 1)[0] if "." in name else name
        if mod not in out:
            out.append(mod)
    return out


def _decline_rest(f: _Found, model: nn.Module, skip, how: str):
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
    for mod in _param_modules(model, skip):
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
