"""``Graph``: a traced probe with the values of one run recorded, and the queries the block finders ask of it.

* execution: ``run(subs, targets)`` re-runs the part of the graph between substituted nodes and targets (the
  rest as recorded): the block finders read exact linear maps and index maps this way, with basis vectors and
  codes (``linear_map``, ``clean_map``, ``feature_map``);
* structure: ``op(node)`` (the ``ops`` vocabulary), ancestors / descendants, ``back_pass`` through casts,
  ``nearest_lins``;
* ``Lin``: every linear map of the graph, ``y = x W^T + b``, whatever its spelling (``nn.Linear``, GPT-2
  ``Conv1D``, ``F.linear``, ``x @ W.t()``, ``x @ W``, ``addmm``, fused experts gathered per token, a weight that is a
  parameter rearranged, e.g. TransformerLens' ``[heads, d_model, d_head]`` heads), and the ``Ref``s of its rows
  and columns that the laws read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import fx, nn
from torch.fx.node import map_arg

from ..laws import Ref, vector
from ..laws.tolerance import PROBE_CODE, PROBE_CONFIRM_ATOL, PROBE_CONFIRM_RTOL, PROBE_NONZERO
from . import builders
from .ops import ALIAS, CASTS, TENSOR_METADATA

__all__ = ["Conv", "Graph", "Lin", "with_strides_of"]


@dataclass
class Lin:
    """A linear map ``y = x W^T + b`` in the graph, ``W`` read from the parameter ``w`` of shape ``shape``.

    * ``t``: W stored ``(in, out)`` (GPT-2 Conv1D, ``addmm``, ``x @ W``); for ``heads``, each head's slice is;
    * ``experts`` > 0: a 3-D ``(E, out, in)`` weight gathered per token (``W[expert_ids]``, batched matmul): each
      expert is one linear map of ``out`` units;
    * ``heads`` > 0: a 3-D ``(H, a, b)`` parameter whose lead indexes heads, rearranged into one weight: output
      unit (``head_side='out'``, TransformerLens' ``W_Q [H, d_model, d_head]``) or input feature (``'in'``,
      ``W_O [H, d_head, d_model]``) ``h * per + j`` is row / column ``j`` of head ``h``'s slice; ``b`` is then
      ``(H, per)`` read the same way when ``bias_heads``, else a vector of the whole output.
    """

    node: fx.Node
    x: fx.Node
    w: str
    b: str | None
    shape: tuple
    t: bool = False
    experts: int = 0
    heads: int = 0
    head_side: str = "out"
    bias_heads: bool = False

    @property
    def plain(self) -> bool:
        """One 2-D weight read as stored (no per-token experts, no heads rearranged into it)."""
        return not self.experts and not self.heads

    @property
    def n_out(self):
        per = self.shape[-1] if self.t else self.shape[-2]
        return per * self.heads if self.heads and self.head_side == "out" else per

    @property
    def n_in(self):
        per = self.shape[-2] if self.t else self.shape[-1]
        return per * self.heads if self.heads and self.head_side == "in" else per

    @property
    def module(self):
        """The owning module's path: "" when the root is the linear module itself (its ``weight``), the parameter's
        own name for another parameter of the root (``x @ self.W_in``)."""
        if "." in self.w:
            return self.w.rsplit(".", 1)[0]
        return "" if self.w == "weight" else self.w

    def _head(self, idx, side: str):
        """``(lead, local indices)`` of the units (``side='out'``) / features (``'in'``) ``idx``: the head they all
        belong to when heads split that side (None when they span heads), else ``((), idx)``."""
        idx = list(idx)
        if not (self.heads and self.head_side == side):
            return (), idx
        per = (self.n_out if side == "out" else self.n_in) // self.heads
        leads = {i // per for i in idx}
        if len(leads) != 1:
            return None
        h = leads.pop()
        return (h,), [i - h * per for i in idx]

    def row_block(self, idx) -> list[Ref | None] | None:
        """Output units ``idx`` (in that order) and their bias entries as the D-row block of a head-Gram law
        (``builders.block(kind='rows')``); None when they are not one strided run of one head."""
        got = self._head(idx, "out")
        s = builders.strided(got[1]) if got is not None else None
        if s is None or self.experts or (self.t and s[2] != 1):
            return None
        (lead, _), (start, n, step) = got, s
        ref = builders.out_rows(self.w, self.shape, start, n, step=step, transposed=self.t, lead=lead)
        if self.b is None:
            return [ref, None]
        if self.heads and not self.bias_heads:
            start += lead[0] * (self.n_out // self.heads)
            lead = ()
        return [ref, vector(self.b, start, n, step=step, lead=lead)]

    def head_rows(self, idx) -> tuple | None:
        """Output units ``idx`` (one head's dims, in order) as ``builders.rope_pair_law``'s per-head items:
        ``(weight, shape, bias, rows, transposed)``, plus ``(lead, bias entries, bias lead)`` for heads stored as a
        ``[H, ...]`` parameter; None when the units span heads or come from per-token experts."""
        got = self._head(idx, "out")
        if got is None or self.experts:
            return None
        lead, local = got
        base = (self.w, self.shape, self.b, local, self.t)
        if not self.heads:
            return base
        if self.bias_heads:
            return base + (lead, local, lead)
        return base + (lead, list(idx), ())

    def col_block(self, idx) -> list[Ref | None] | None:
        """Input features ``idx`` (in that order) as the D-row block of a head-Gram law (``builders.block(kind=
        'cols')``); None when they are not one contiguous run of one head."""
        got = self._head(idx, "in")
        s = builders.strided(got[1]) if got is not None else None
        if s is None or s[2] != 1 or self.experts:
            return None
        (lead, _), (start, n, _) = got, s
        return [builders.in_cols(self.w, self.shape, start, n, transposed=self.t, lead=lead), None]

    def reader(self):
        return builders.in_cols(self.w, self.shape, transposed=self.t)

    def readers(self) -> list | None:
        """Input-column refs reading every input feature: one per expert (each expert reads them all), one per head
        for heads split on the output side, one for a plain linear; None for heads split on the input side (each
        head reads a part of the features: no gain law takes them)."""
        if self.experts:
            return [builders.in_cols(self.w, self.shape, transposed=self.t, lead=(e,)) for e in range(self.experts)]
        if self.heads:
            if self.head_side != "out":
                return None
            return [builders.in_cols(self.w, self.shape, transposed=self.t, lead=(h,)) for h in range(self.heads)]
        return [self.reader()]


@dataclass
class Conv:
    """A convolution in the graph: ``y = conv(x, W) + b``, its weight read channel by channel (``cmap``: output
    channel c is ``W[c]``, the kernel slice writing it; input channel c is every entry reading it)."""

    node: fx.Node
    x: fx.Node
    cmap: "builders.ChannelMap"

    @property
    def module(self) -> str:
        w = self.cmap.weight
        return w.rsplit(".", 1)[0] if "." in w else ("" if w == "weight" else w)


def with_strides_of(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
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
        self.lins, self.convs = {}, {}
        self._folded: dict = {}  # the matmul node of a linear whose bias add is its output (``_with_bias``)
        for n in self.nodes:
            lin = self._lin(n)
            if lin is not None:
                lin = self._with_bias(lin)
                self.lins[lin.node] = lin
                if lin.node is not n:
                    self._folded[n] = lin
            conv = self._conv(n)
            if conv is not None:
                self.convs[n] = conv

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
        # a partial run may stop between the graph's own ``_set_grad_enabled(False)`` and the node turning it back on
        with torch.set_grad_enabled(torch.is_grad_enabled()):
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

    def _with_bias(self, lin: Lin) -> Lin:
        """``x @ W.T + b`` written as a matmul and an add (FalconLinear, hand-written layers): the add of a vector
        parameter of the output's width, the matmul's only reader, is the linear map's output and bias."""
        if lin.b is not None or not lin.plain or len(lin.node.users) != 1:
            return lin
        add = next(iter(lin.node.users))
        if self.op(add) != "add" or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
            return lin
        other = add.args[1] if add.args[0] is lin.node else add.args[0]
        b = self.param_of(other)
        if b is None or self.params[b].dim() != 1 or self.params[b].shape[0] != lin.n_out:
            return lin
        return dataclasses.replace(lin, node=add, b=b)

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
            if w is None:
                return self._rearranged_lin(n, n.args[0], args[1], args[2] if len(n.args) > 2 else args[-1])
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
        if o == "matmul" and len(n.args) == 2 and isinstance(n.args[0], fx.Node) and self.param_of(n.args[1]) is None:
            lin = self._rearranged_lin(n, n.args[0], n.args[1], None, stored_in_out=True)  # z @ W_O.reshape(H*D, d)
            if lin is not None:
                return lin
        if o == "addmm" and len(n.args) >= 3:
            w, b = self.param_of(n.args[2]), self.param_of(n.args[0])
            if w is not None and self.params[w].dim() == 2:
                return Lin(n, n.args[1], w, b, tuple(self.params[w].shape), True)
        return self._experts_lin(n)

    def _source_param(self, n) -> fx.Node | None:
        """The one parameter (``get_attr`` node) a computed tensor ``n`` is made from, when no input enters it."""
        if not isinstance(n, fx.Node) or self.param_of(n) is not None:
            return None
        anc = self.ancestors([n])
        if any(a.op == "placeholder" for a in anc):
            return None
        ps = [a for a in anc if self.param_of(a) is not None]
        return ps[0] if len(ps) == 1 else None

    def rearrangement(self, src: fx.Node, dst: fx.Node) -> torch.Tensor | None:
        """For every entry of ``dst``'s value, the flat index of the entry of ``src``'s value it is, when ``dst`` only
        rearranges ``src`` (permute, reshape, transpose, casts: codes in, the same codes out; confirmed with random
        values); None otherwise (a scale, a sum, a slice of a bigger value all fail)."""
        sv, dv = self.env.get(src), self.env.get(dst)
        if not (isinstance(sv, torch.Tensor) and isinstance(dv, torch.Tensor) and sv.is_floating_point()
                and dv.is_floating_point()) or sv.numel() != dv.numel():
            return None
        codes = torch.arange(1, sv.numel() + 1, dtype=torch.float64).reshape(sv.shape).to(sv.dtype)
        rnd = (torch.rand(sv.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5).to(sv.dtype)
        try:
            out, out2 = (self.run({src: v}, [dst])[0] for v in (codes, rnd))
        except Exception:  # noqa: BLE001 - not a map of src alone
            return None
        if not isinstance(out, torch.Tensor) or out.shape != dv.shape or not torch.equal(out, out.round()) \
                or out.min() < 1 or out.max() > sv.numel():
            return None
        idx = out.long() - 1
        return idx if torch.equal(out2.reshape(-1), rnd.reshape(-1)[idx.reshape(-1)]) else None

    def _rearranged_lin(self, n: fx.Node, x, wn, bn, stored_in_out: bool = False) -> Lin | None:
        """``F.linear(x, W', b')`` (``x @ W'`` with ``stored_in_out``) whose weight ``W'`` is one parameter rearranged
        (``W.t()``, TransformerLens' ``W_Q.permute(0, 2, 1).reshape(H * D, d)`` or its einsum rewritten by
        ``rewrite.parameter_einsum_to_linear``), ``b'`` a vector parameter or an ``(H, D)`` one flattened."""
        pnode = self._source_param(wn)
        idx = self.rearrangement(pnode, wn) if pnode is not None else None
        if idx is None or idx.dim() != 2 or not isinstance(x, fx.Node):
            return None
        w = pnode.target
        shape = tuple(self.params[w].shape)
        layout = _layout(idx.t() if stored_in_out else idx, shape)
        if layout is None:
            return None
        t, heads, side = layout
        lin = Lin(n, x, w, None, shape, t, heads=heads, head_side=side)
        xv = self.env.get(x)
        if not isinstance(xv, torch.Tensor) or xv.dim() < 1 or xv.shape[-1] != lin.n_in:
            return None
        if bn is None:
            return lin
        cast = {"to", "contiguous", "alias", "clone"}
        b = self.param_of(self.back_pass(bn, cast))
        if b is not None and tuple(self.params[b].shape) == (lin.n_out,):
            lin.b = b
            return lin
        bp = self._source_param(bn)
        bidx = self.rearrangement(bp, bn) if bp is not None else None
        if bidx is None or not heads or side != "out" or \
                tuple(self.params[bp.target].shape) != (heads, lin.n_out // heads) or \
                not torch.equal(bidx, torch.arange(lin.n_out)):
            return None
        lin.b, lin.bias_heads = bp.target, True
        return lin

    def _conv(self, n: fx.Node) -> "Conv | None":
        """A convolution: an ``nn.ConvNd`` / ``nn.ConvTransposeNd`` module, or ``F.conv1d/2d/3d`` of a parameter."""
        if n.op == "call_module":
            m = self.gm.get_submodule(n.target)
            if isinstance(m, nn.modules.conv._ConvNd) and n.args and isinstance(n.args[0], fx.Node):
                return Conv(n, n.args[0], builders.ChannelMap.of(n.target, m))
            return None
        if n.op != "call_function" or self.op(n) not in ("conv1d", "conv2d", "conv3d"):
            return None
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        args = dict(zip(names, n.args)) | {k: v for k, v in n.kwargs.items() if k in names}
        cast = {"to", "contiguous", "alias", "clone"}
        w = self.param_of(self.back_pass(args.get("weight"), cast))
        b = self.param_of(self.back_pass(args.get("bias"), cast))
        if w is None or not isinstance(args.get("input"), fx.Node) or (args.get("bias") is not None and b is None):
            return None
        groups = args.get("groups", 1)
        if not isinstance(groups, int):
            return None
        return Conv(n, args["input"], builders.ChannelMap(w, tuple(self.params[w].shape), b, groups=groups))

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
        return [lin for u in n.users if (lin := self.lin_at(u)) is not None and lin.x is n]

    def lin_at(self, n: fx.Node) -> Lin | None:
        """The linear map computed at ``n``: its output node, or the matmul of a map whose bias is added after."""
        return self.lins.get(n) or self._folded.get(n)

    def back_pass(self, n, ops=None):
        """Follow ``n`` back through single-input pass ops (dropout, casts) to the first other node."""
        ops = ops or CASTS
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

    def feature_map(self, src: fx.Node, dst: fx.Node, held: dict | None = None, positive: bool = False) -> list | None:
        """For each last-dim feature of ``dst``, the last-dim feature of ``src`` it is (index ops only; -1:
        not from ``src``), the same at every position; None when the path mixes or rescales features.
        ``positive``: positively homogeneous element-wise maps of degree 1 (ReLU) may sit on the path too.
        ``held``: ``{node: value}`` kept at these values while ``src`` carries the feature codes (e.g. routing
        indices computed from ``src``).

        The codes ``1..n`` run, then the codes times ``s``: ``s = -1`` (index ops are odd) or, with ``positive``,
        ``s = 1 / (n + 1)``; the two outputs must agree up to ``s``. An activation that is the identity on large
        positive values (ReLU; SiLU, GELU, softplus in floating point) passes the first run alone."""
        sv = self.env[src]
        n = sv.shape[-1]
        idx = torch.arange(1, n + 1, dtype=torch.float64).expand(sv.shape).clone()
        scales = ((1.0, 1.0 / (n + 1)) if positive else (1.0, -1.0)) if sv.is_floating_point() else (1.0,)
        flats = []
        for sc in scales:
            try:
                out = self.run({src: with_strides_of(sv, (sc * idx).to(sv.dtype) if sv.is_floating_point() else idx),
                                **(held or {})}, [dst])[0]
            except Exception:
                return None
            if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
                return None
            flats.append(out.reshape(-1, out.shape[-1]).to(torch.float64) / sc)
        flat = flats[0]
        if any(x.shape != flat.shape or not torch.allclose(x, flat, rtol=1e-12, atol=1e-9) for x in flats[1:]):
            return None
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
            return self.run({src: with_strides_of(sv, e)}, [dst])[0]

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
        nz = (b.abs() > PROBE_NONZERO * scale).nonzero().flatten()
        if nz.numel() == 0 or not torch.isfinite(a[nz]).all():
            return None
        ratio = a[nz] / b[nz]
        row = ratio.round()
        if (ratio - row).abs().max() > PROBE_CODE or (row < 1).any() or (row > n).any():
            return None
        row = row.long() - 1
        if not torch.allclose(c[nz], b[nz] * rnd[row], rtol=PROBE_CONFIRM_RTOL, atol=PROBE_CONFIRM_ATOL * scale):
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
            base = self.run({src: with_strides_of(sv, zero)}, [dst])[0]
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
            y = self.run({src: with_strides_of(sv, e)}, [dst])[0]
            if y.is_complex():
                return None
            vals[r] = y.reshape(-1)
            scale = max(scale, float(y.abs().max()))
        if scale == 0:
            return {r: {} for r in vals}
        for r, y in vals.items():
            nz = (y.abs() > PROBE_NONZERO * scale).nonzero().flatten().tolist()
            out[r] = {i: float(y[i]) for i in nz}
        # linearity: f(2 e_r) = 2 f(e_r) and f(e_r + e_s) = f(e_r) + f(e_s) on a few rows
        some = list(vals)[:2]
        e = zero.clone()
        for r in some:
            e.view(-1, n)[lead, r] = 2.0
        y = self.run({src: with_strides_of(sv, e)}, [dst])[0].reshape(-1)
        ref = sum(2 * vals[r] for r in some)
        if (y - ref).abs().max() > PROBE_NONZERO * max(scale, 1e-300):
            return None
        return out


def _layout(idx: torch.Tensor, shape: tuple) -> tuple[bool, int, str] | None:
    """``(t, heads, head_side)`` of ``Lin`` when ``idx`` (a weight in ``(out, in)`` convention, each entry the flat
    index of the parameter entry it is) is a parameter of ``shape`` read as stored (2-D), transposed, or a 3-D
    ``(H, a, b)`` parameter with its heads laid side by side on the output or the input side; None otherwise."""
    base = torch.arange(idx.numel()).reshape(shape) if idx.numel() == torch.Size(shape).numel() else None
    if base is None:
        return None
    if len(shape) == 2:
        cands = [(base, (False, 0, "out")), (base.t(), (True, 0, "out"))]
    elif len(shape) == 3:
        h, a, b = shape
        cands = [(base.permute(0, 2, 1).reshape(h * b, a), (True, h, "out")),   # W_Q [H, d_model, d_head]
                 (base.reshape(h * a, b), (False, h, "out")),                  # [H, d_head, d_model]
                 (base.reshape(h * a, b).t(), (True, h, "in")),                # W_O [H, d_head, d_model]
                 (base.permute(1, 0, 2).reshape(a, h * b), (False, h, "in"))]  # [H, d_model, d_head] read back
    else:
        return None
    for cand, layout in cands:
        if cand.shape == idx.shape and torch.equal(cand, idx):
            return layout
    return None
