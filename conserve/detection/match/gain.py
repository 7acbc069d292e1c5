"""Per-feature scales: the gain law of a norm read only by linear maps, and LayerScale.

* gains: every per-feature scale ``g * x (+ beta)`` (LayerNorm / RMSNorm / GroupNorm modules, ``F.layer_norm``,
  ``F.rms_norm``, hand-written RMSNorms, Gemma's ``(1 + w)``) whose output is read only by linear maps (through
  dropout, casts, reshapes, token indexing or pooling): the gain law with every reader (spec: pre-norm gain row).
  A scale whose output also feeds anything else (the residual stream: post-LN; an opaque block; a weight computed
  from parameters in a way no ``Lin`` reads) is declined, the reason naming each other reader and the linear
  readers seen.
* LayerScale: a per-feature scale of a linear's output (``gamma * (W x + b)``) whose result feeds anything (the
  residual): ``gamma_c^2 - ||W[c,:]||^2 - b_c^2`` (family ``layer_scale``).
* An opaque block (``blocks``: a module torch.fx cannot trace, kept as one call that runs its own code) is one more
  reader when its own graph, analysed alone, showed that its input is read only by linear maps reading its features
  one to one (``input_readers``: a routed MoE's router and every expert's gate and up, through reshapes and token
  indexing ``z[tok]``): the gain law then takes those maps' columns. The law is still claimed only if it passes the
  first-order check of the graph holding the opaque call, which differentiates through the block's parameters.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.node import map_arg

from .. import builders
from ..fxgraph import Graph
from ..ops import PASS, SHAPE_ONLY
from .conv import channel_norms
from .found import Found, layer_index

__all__ = ["BlockReaders", "Unknown", "gains", "input_readers", "scale_points"]


class Unknown(str):
    """Why the readers of a block's input are not known (its own graph could not be made, the example input routes
    no token to an expert, a parameter-free stand-in): a ``Collector.input_readers`` value, as distinct from a plain
    reason, which names something other than a linear map reading the input."""


@dataclass
class BlockReaders:
    """The linear maps inside the opaque block called by ``node`` that read the value ``x`` fed to it, taken as
    one reader of ``x``: ``refs``, their input-column refs (parameter names of the graph holding the call)."""

    node: fx.Node
    x: fx.Node
    module: str
    refs: list

    @property
    def w(self) -> str:
        return self.module

    def readers(self) -> list:
        return list(self.refs)

    def modules(self) -> list[str]:
        """The modules owning the readers' weights."""
        return list(dict.fromkeys(r.param.rsplit(".", 1)[0] if "." in r.param else r.param for r in self.refs))


def scale_points(g: Graph):
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
            wn = args[2] if len(args) > 2 else n.kwargs.get("weight")
            w, shift = g.param_of(wn), 0.0
            if w is None and isinstance(wn, fx.Node) and g.op(wn) == "add":  # weight + 1 (Nemotron's LayerNorm1P)
                p_node, const = _operands(wn, None)
                if isinstance(const, (int, float)) and g.param_of(g.back_pass(p_node)) is not None:
                    w, shift = g.param_of(g.back_pass(p_node)), float(const)
            b = None
            if o == "layer_norm":  # F.layer_norm(x, shape, weight=..., bias=...) (timm) or positional
                b = g.param_of(args[3]) if len(args) > 3 else g.param_of(n.kwargs.get("bias"))
            if w is not None:
                out.append((n, w, b, shift, o))
        elif o == "mul" and n.op == "call_function":
            for i, a in enumerate(n.args[:2]):
                a0 = g.back_pass(a) if isinstance(a, fx.Node) else a
                shift = 0.0
                if isinstance(a0, fx.Node) and g.op(a0) == "add" and g.param_of(g.back_pass(_operands(a0, None)[0])):
                    p_node, const = _operands(a0, None)
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


def _operands(add_node, _):
    """(tensor operand, constant operand) of a binary add."""
    a, b = (list(add_node.args) + [None, None])[:2]
    return (a, b) if isinstance(a, fx.Node) else (b, a)


def gains(f: Found) -> None:
    """The gain finder (module docstring); an error on one scale declines that scale only."""
    g, c = f.g, f.c
    experts_x = _experts_x(g)
    claimed = {p for law, _ in f.cands for p in law.params}
    channel_first = {m for n, *_ in channel_norms(g) for m in (n, n.args[0] if g.op(n) == "permute" else n)}
    # (``match.conv``: their gains scale dim 1; a channels-last layer_norm permuted back is one of them)
    for n, w, b, shift, what in scale_points(g):
        if w in claimed or n in channel_first:  # e.g. a QK-norm gain, already in a law
            continue
        try:
            _one_gain(f, n, w, b, shift, what, experts_x)
        except Exception as e:  # noqa: BLE001 - this scale only
            path = w.rsplit(".", 1)[0] if "." in w else w
            c.decline(path, what if what != "scale" else "per-feature scale",
                      f"structural analysis error: {type(e).__name__}: {e}; its gain law is not claimed (report this "
                      "model)")


def _one_gain(f: Found, n: fx.Node, w: str, b, shift: float, what: str, experts_x: dict) -> None:
    """The gain law (or LayerScale law, or the decline) of the scale ``w`` applied at ``n``."""
    g, c = f.g, f.c
    h = g.params[w].shape[0]
    path = w.rsplit(".", 1)[0] if "." in w else w
    readers, bad, why = _readers(g, c, n, h, experts_x)
    what_ = what if what != "scale" else "per-feature scale"
    if (bad or not readers) and what == "scale" and b is None and shift == 0.0 and _layer_scale(f, n, w, h):
        return
    if bad or not readers:
        uses = list(dict.fromkeys(_use(g, u, n) + (f" ({why[u]})" if u in why else "") for u in bad)) or ["nothing"]
        by = ", ".join(dict.fromkeys(r.module or r.w for r in readers))
        seen_ = "; ".join(uses) + (f" (besides the linear map(s) {by})" if readers else "")
        if bad and all(isinstance(why.get(u), Unknown) for u in bad):
            c.decline(path, what_, f"the scaled output is read by {seen_}: which linear maps read it there is not "
                      "known, and a gain law needs every reader: no gain law (spec: pre-norm gain row)")
            return
        c.decline(path, what_, f"the scaled output is read by {seen_}: not only by linear maps with stored weights, "
                  "as a gain law needs (the residual stream in a post-LN block, attention scores after a QK-norm, "
                  "a weight computed from parameters, or an unrecognised module): no gain law (spec: pre-norm gain "
                  "row; breakers: post-LN)")
        return
    maps = [g.feature_map(n, r.x, positive=True) for r in readers]
    if any(m != list(range(h)) for m in maps):
        c.decline(path, what_, "its readers do not read the features one to one: no gain law")
        return
    refs = [r.readers() for r in readers]
    if any(x is None for x in refs):
        split = [r.w for r, x in zip(readers, refs) if x is None]
        c.decline(path, what_, f"read by {split}, heads stored as [heads, ...] parameters that each read a part of "
                  "the features: no gain law built")
        return
    inside = [r.module for r in readers if isinstance(r, BlockReaders)]
    names = [m for r in readers for m in (r.modules() if isinstance(r, BlockReaders) else [r.module])]
    f.add(builders.gain_law(f"{path}/gain", layer_index(path), w, h, readers=[x for rs in refs for x in rs],
                            bias=b, shift=shift,
                            note="structural: readers " + ", ".join(dict.fromkeys(names))
                            + (f" (inside the opaque block(s) {inside}: found on the block's own graph)" if inside
                               else "")
                            + (f"; gain applied as ({shift:g} + w)" if shift else "") + " (spec: pre-norm gain row)"),
          "gain")


def _experts_x(g: Graph) -> dict:
    """The unsqueeze node through which a per-token expert map reads its input -> that map."""
    out = {}
    for lin in g.lins.values():
        if lin.experts:
            for u in lin.x.users:
                if g.op(u) == "unsqueeze" and u in g.ancestors([lin.node]):
                    out[u] = lin
    return out


def _readers(g: Graph, c, src: fx.Node, h: int, experts_x: dict) -> tuple[list, list, dict]:
    """What reads ``src`` (``h`` features on the last dim), walking through dropout, casts, reshapes, token indexing
    and pooling: ``(readers, other users, {opaque call: why its readers are unknown})``; a reader is a ``Lin`` or the
    ``BlockReaders`` of an opaque block whose readers of that input ``c.input_readers`` holds (else the opaque call
    is another user, with the reason)."""
    readers, bad, why = [], [], {}

    def visit(m, u):
        if (lin := g.lin_at(u)) is not None and lin.x is m:
            readers.append(lin)
        elif u in experts_x and experts_x[u].x is m:  # x.unsqueeze(...) of a per-token expert map
            readers.append(experts_x[u])
        elif g.op(u) == "opaque":
            got = _block_readers(g, c, m, u)
            if isinstance(got, str):
                bad.append(u)
                why[u] = got
            else:
                readers.append(got)
        elif g.op(u) == "to" and u.args and u.args[0] is not m:
            pass  # type_as(other, m): m's dtype only
        elif g.op(u) in PASS and g.is_tensor(u) and _last_dim(g.env[u]) == h \
                and g.op(u) not in ("transpose", "permute", "movedim", "t"):
            return True
        elif g.op(u) not in SHAPE_ONLY:
            bad.append(u)
        return False

    g.walk_users([src], visit)
    return readers, bad, why


def _last_dim(v) -> int | None:
    """The size of the last dim of a tensor, or of every part of a tuple of tensors (``split`` / ``chunk`` along
    another dim); None for a scalar or parts that differ."""
    parts = v if isinstance(v, (tuple, list)) else [v]
    dims = {t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in parts}
    return dims.pop() if len(dims) == 1 else None


def _block_readers(g: Graph, c, m: fx.Node, u: fx.Node) -> "BlockReaders | str":
    """The linear maps inside the opaque block called by ``u`` that read ``m`` (``c.input_readers`` of the block's
    positional inputs ``m`` is passed as), or the reason they are not taken (``Unknown`` where they are not known)."""
    mod = g.gm.get_submodule(u.target)
    if getattr(mod, "_conserve_opaque", False):
        return Unknown("a parameter-free stand-in for a module that cannot run in float64: what reads the value inside "
                       "the module is not in the graph")
    try:
        bound = inspect.signature(mod.forward).bind(*u.args, **u.kwargs)
        args, kwargs = tuple(bound.args), dict(bound.kwargs)
    except (TypeError, ValueError):
        args, kwargs = tuple(u.args), dict(u.kwargs)
    pos = [i for i, a in enumerate(args) if a is m]
    uses = []
    map_arg((args, kwargs), lambda a: uses.append(a) if a is m else None)
    if not pos or len(uses) != len(pos):
        return Unknown("it takes the value inside a container or as a keyword argument: what reads it inside is "
                       "not known")
    refs = []
    for i in pos:
        got = c.input_readers.get((u.target, i))
        if got is None:
            return Unknown("its own graph, which would say what reads its input, was not analysed")
        if isinstance(got, str):
            return got
        refs += got
    return BlockReaders(u, m, u.target, refs)


def input_readers(g: Graph, c) -> dict:
    """For a block's own graph ``g`` (a block analysed alone: ``blocks``), ``{position: refs}`` of each positional
    floating input read only by linear maps (``_readers``' walk, opaque blocks inside it included) that read its
    features one to one, ``refs`` their input-column refs; ``{position: reason}`` when something else reads it
    (``Unknown`` when what reads it is not known).
    The feature maps hold the routing (every integer value computed from the input: top-k ids, token indices) at
    its recorded value, as a graph specialised to one routing computes it."""
    out: dict = {}
    experts_x = _experts_x(g)
    phs = [n for n in g.nodes if n.op == "placeholder"]
    for i, (ph, v) in enumerate(zip(phs, g.inputs)):
        if g.env.get(ph) is not v:  # (placeholders of keyword arguments: not positional inputs)
            break
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1):
            continue
        h = v.shape[-1]
        readers, bad, why = _readers(g, c, ph, h, experts_x)
        if bad or not readers:
            uses = list(dict.fromkeys(_use(g, u, ph) + (f" ({why[u]})" if u in why else "") for u in bad))
            by = ", ".join(dict.fromkeys(r.module or r.w for r in readers))
            text = f"inside it, its input {i} is read by {'; '.join(uses) or 'nothing'}" + (
                f" besides the linear map(s) {by}" if readers else "")
            known = not bad or not all(isinstance(why.get(u), Unknown) for u in bad)
            out[i] = text + ", not only by linear maps" if known else Unknown(text)
            continue
        off = [r.module or r.w for r in readers if _held_feature_map(g, ph, r.x) != list(range(h))]
        if off:
            out[i] = f"inside it, {off} do not read the features of its input {i} one to one"
            continue
        refs = [r.readers() for r in readers]
        if any(x is None for x in refs):
            out[i] = (f"inside it, {[r.w for r, x in zip(readers, refs) if x is None]} read its input {i} as heads "
                      "stored as [heads, ...] parameters that each read a part of the features")
            continue
        out[i] = [x for rs in refs for x in rs]
    return out


def _held_feature_map(g: Graph, src: fx.Node, dst: fx.Node) -> list | None:
    """``Graph.feature_map`` with every integer or boolean value computed from ``src`` (routing: top-k ids, the
    token indices of each expert) held at its recorded value: the features of ``src`` that ``dst`` reads, for the
    tokens the recorded routing sends there (all tokens given the same codes would all take one route)."""
    def integral(v):
        if isinstance(v, (tuple, list)):
            return bool(v) and all(integral(t) for t in v)
        return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex()

    held = {n: g.env[n] for n in g.descendants([src]) if n is not src and n.op != "output" and integral(g.env.get(n))}
    return g.feature_map(src, dst, held, positive=True)


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


def _layer_scale(f: Found, n: fx.Node, w: str, h: int) -> bool:
    """LayerScale ``gamma * (W x + b)`` (the scale reads a linear's output feature by feature): the catalogue's
    diagonal-rescaling law ``gamma_c^2 - ||W[c,:]||^2 - b_c^2``. True when built."""
    g = f.g
    arg = next((a for a in n.args[:2] if isinstance(a, fx.Node) and g.param_of(g.back_pass(a)) != w), None)
    src = g.back_pass(arg) if arg is not None else None
    if src not in g.lins or len(src.users) != 1 or not g.lins[src].plain:
        return False
    lin = g.lins[src]
    if lin.n_out != h or g.feature_map(src, arg, positive=True) != list(range(h)):
        return False
    path = w.rsplit(".", 1)[0] if "." in w else w
    # a LayerScale module's one parameter (ls1.gamma): the module names the law; a block's own parameters
    # (EVA's gamma_1, gamma_2 on the block): the parameter does, so that the two laws keep two names
    label = path if w.rsplit(".", 1)[-1] in ("gamma", "weight", "scale") else w
    f.add(builders.layer_scale_law(f"{label}/layer_scale", layer_index(path), w, h, [(lin.w, lin.shape, lin.b, lin.t)],
                                   note=f"structural: {path} scales the output features of {lin.module} (diagonal "
                                        "rescaling, as the spec's deep-linear row)"), "LayerScale")
    return True
