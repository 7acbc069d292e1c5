"""Rewrites of a traced graph (torch.fx ``GraphModule``) into the same function in the form the block finders read.

Each rewrite computes the same function (the trace is re-checked against the model afterwards, ``trace``):

* ``casts_to_float64``: the graph's casts to float32/16 made float64 (precision choices, not part of the function),
  export's metadata assertions dropped, its autocast / set_grad_enabled regions inlined (``inline_regions``);
* ``parameter_einsum_to_linear``: an einsum of an activation with a parameter (TransformerLens'
  ``'bpd,hde->bphe'`` with ``W_Q`` stored ``[heads, d_model, d_head]``, ``'bqhe,hed->bqd'`` with ``W_O``) as
  ``F.linear`` of the activation with the parameter rearranged to ``(out, in)`` (``+ b`` folded in as its bias);
* ``einsum_to_matmul``: attention's two-operand einsums as permute -> matmul -> permute;
* ``baddbmm_to_matmul``: ``baddbmm`` (BLOOM's ALiBi scores) as ``beta * input + alpha * b1 @ b2``;
* ``slice_writes_to_functional``: ``copy_`` (or fx's ``setitem``) into slices of a freshly allocated tensor (DeepSeek's
  ``key_states = new_empty(...); key_states[..., :d].copy_(k_nope)``) as a value computed from its sources
  (``write_into``), so the graph's edges show what the tensor is made of.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from .ops import FLOATS

__all__ = ["casts_to_float64", "inline_regions", "parameter_einsum_to_linear", "einsum_to_matmul",
           "baddbmm_to_matmul", "slice_writes_to_functional", "write_into", "float64_dtypes", "ASSERTS"]

ASSERTS = ("_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range")


def casts_to_float64(gm: fx.GraphModule) -> None:
    """Make the graph's casts to float32/16 float64 and drop export's metadata assertions (precision only).
    torch.export's ``wrap_with_autocast`` regions (``with torch.autocast(..., enabled=False)`` around a float32
    upcast, e.g. RoPE) and ``wrap_with_set_grad_enabled`` regions are inlined first (their outputs detached when
    gradients are off there), so their casts and assertions are rewritten like the rest and their ops seen."""
    inline_regions(gm)
    for n in list(gm.graph.nodes):
        name = str(n.target)
        if any(a in name for a in ASSERTS) or name == "_guards_fn":
            n.args, n.kwargs = (), {}
            if not n.users:
                gm.graph.erase_node(n)
            continue
        if n.op == "call_method" and n.target in ("float", "half", "bfloat16"):
            n.target = "double"
        n.args = tuple(float64_dtypes(a) for a in n.args)
        n.kwargs = {k: float64_dtypes(v) for k, v in n.kwargs.items()}
    gm.graph.lint()
    gm.recompile()



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


def inline_regions(gm: fx.GraphModule) -> None:
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
        inline_regions(sub)
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


def einsum_to_matmul(gm: fx.GraphModule) -> None:
    """Rewrite two-operand einsums (``torch.einsum`` in an fx graph, ``aten.einsum`` in an exported one) with one
    free index per operand and one contracted index (attention's 'bhqd,bhkd->bhqk' and 'bhqk,bhkd->bhqd', any index
    order, spaces allowed) as permute -> matmul -> permute, so attention written with einsum is found like
    ``q @ k.transpose``. The trace is then re-checked against the model."""
    for n in list(gm.graph.nodes):
        parts = _einsum(n)
        if parts is None or len(parts[1]) != 2:
            continue
        eq, ops = parts
        ins, out = eq.split("->")
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


def baddbmm_to_matmul(gm: fx.GraphModule) -> None:
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


# ops allocating a new tensor (nothing else aliases it); ``new_empty`` / ``empty_like`` are written as their zeroed
# twins (an entry never written is then 0, not whatever the memory held)
FRESH = {"new_empty": "new_zeros", "empty_like": "zeros_like", "new_zeros": None, "zeros_like": None, "zeros": None,
         "empty": None, "new_ones": None, "ones_like": None, "ones": None, "new_full": None, "full": None,
         "full_like": None, "clone": None, "write_into": None}
VIEWS = ("slice", "select", "narrow", "getitem")


def write_into(base: torch.Tensor, src: torch.Tensor, views: tuple) -> torch.Tensor:
    """A copy of ``base`` with ``src`` copied into its view ``views`` (``(op, *args)`` applied in order: ``('slice',
    dim, start, end, step)``, ``('select', dim, index)``, ``('narrow', dim, start, length)``, ``('getitem', idx)``):
    what ``base`` holds after ``view.copy_(src)``, as a new value."""
    out = base.clone()
    v = out
    for op, *args in views:
        if op == "getitem":
            v = v[args[0]]
        elif op == "slice":
            v = torch.ops.aten.slice.Tensor(v, *args)
        else:
            v = getattr(torch.ops.aten, op).int(v, *args) if op == "select" else torch.ops.aten.narrow.default(v, *args)
    v.copy_(src)
    return out


def _name(n: fx.Node) -> str:
    """The op of a call node: a method's name, an ATen overload's packet name, a function's name."""
    if n.op == "call_method":
        return n.target
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return "getitem" if t is operator.getitem else getattr(t, "__name__", "")


def _buffer_base(n: fx.Node, buffers: set) -> bool:
    """``n`` is a module buffer (``get_attr``), or its ``.to(...)`` / alias read once (a KV cache written in place:
    ``self.cache_k = self.cache_k.to(x); self.cache_k[:b, s:s + t] = k``, Meta's reference Llama)."""
    if n.op == "get_attr":
        return n.target in buffers
    return n.op in ("call_function", "call_method") and _name(n) in ("to", "_to_copy", "alias", "type_as") \
        and bool(n.args) and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr" \
        and n.args[0].target in buffers \
        and [u for u in n.args[0].users if _name(u) != "_assert_tensor_metadata"] == [n]


def _view_chain(dst, buffers: set = frozenset()) -> tuple[fx.Node, list[fx.Node], list] | None:
    """``(base, view nodes from base to dst, views for write_into)`` when ``dst`` is a fresh tensor ``base``
    (``FRESH``), a buffer (``_buffer_base``), or slices / selects of one with constant arguments; else None."""
    chain, views = [], []
    n = dst
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and _name(n) in VIEWS:
        op, rest = _name(n), list(n.args[1:])
        if n.kwargs or not rest or _has_node(rest):
            return None
        if op == "slice":
            rest = (rest + [0, None, None, 1][len(rest):])[:4]
        views.append((op, *rest) if op != "getitem" else ("getitem", rest[0]))
        chain.append(n)
        n = n.args[0]
    if not isinstance(n, fx.Node) or not (_buffer_base(n, buffers) or (
            n.op in ("call_function", "call_method") and _name(n) in FRESH)):
        return None
    return n, chain[::-1], views[::-1]


def _has_node(a) -> bool:
    """``a`` (an argument, nested) holds a graph node."""
    found = []
    fx.node.map_arg(a, found.append)
    return bool(found)


def slice_writes_to_functional(gm: fx.GraphModule) -> None:
    """``view.copy_(src)`` (or ``view[idx] = src``, fx's ``setitem``) where ``view`` is a fresh tensor ``base``, a
    buffer (a KV cache written in place), or slices of one (``_view_chain``), the write's result and the views unused elsewhere, and every other reader of
    ``base`` after the write: those readers read ``write_into(base, src, views)`` instead (a value whose inputs are
    ``base`` and ``src``), the write and its views are dropped. Writes are taken in graph order, so successive
    writes chain. ``new_empty`` / ``empty_like`` bases become ``new_zeros`` / ``zeros_like``. The trace is then
    re-checked against the model."""
    changed = False
    buffers = {k for k, _ in gm.named_buffers()}
    for n in list(gm.graph.nodes):
        if n.op not in ("call_function", "call_method") or n.kwargs or n.users:
            continue
        if _name(n) == "copy_" and len(n.args) == 2:
            dst, src, last = n.args[0], n.args[1], []
        elif n.op == "call_function" and n.target is operator.setitem and len(n.args) == 3 \
                and not _has_node(n.args[1]):
            dst, src, last = n.args[0], n.args[2], [("getitem", n.args[1])]
        else:
            continue
        got = _view_chain(dst, buffers) if isinstance(src, fx.Node) else None
        if got is None:
            continue
        base, chain, views = got
        views = views + last
        inner = set(chain) | {n}
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
        if any(set(m.users) - inner for m in chain) or \
                any(u not in inner and order[u] < order[n] for u in base.users):
            continue  # another reader of a view, or of base before the write: not a fresh value written once
        with gm.graph.inserting_after(n):
            w = gm.graph.call_function(write_into, (base, n.args[1], tuple(views)))
        for u in [u for u in base.users if u not in inner and u is not w]:
            u.replace_input_with(base, w)
        gm.graph.erase_node(n)
        for m in chain[::-1]:
            gm.graph.erase_node(m)
        zeroed = FRESH.get(_name(base)) if base.op != "get_attr" else None
        if zeroed is not None:
            if base.op == "call_method":
                base.target = zeroed
            else:
                base.target = getattr(torch.ops.aten, zeroed).default
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def float64_dtypes(a):
    if isinstance(a, torch.dtype) and a in FLOATS:
        return torch.float64
    if isinstance(a, (tuple, list)):
        return type(a)(float64_dtypes(x) for x in a)
    return a


def _einsum(n: fx.Node):
    """``(equation, operands)`` of an einsum node (``torch.einsum`` in an fx graph, ``aten.einsum`` in an exported
    one), else None."""
    aten = getattr(getattr(torch.ops.aten, "einsum", None), "default", None)
    if not (n.op == "call_function" and (n.target is torch.einsum or (aten is not None and n.target is aten))):
        return None
    eq, *ops = n.args
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    return eq.replace(" ", ""), ops


def _parameter(gm: fx.GraphModule, n) -> torch.Tensor | None:
    """The parameter a ``get_attr`` node reads, else None."""
    if not (isinstance(n, fx.Node) and n.op == "get_attr"):
        return None
    obj = gm
    for a in n.target.split("."):
        obj = getattr(obj, a, None)
    return obj if isinstance(obj, torch.nn.Parameter) else None


def _is_add(u: fx.Node) -> bool:
    aten = getattr(getattr(torch.ops.aten, "add", None), "Tensor", None)
    return u.op == "call_function" and u.target in (operator.add, torch.add, aten) and not u.kwargs \
        and len(u.args) == 2


def _permuted(gm: fx.GraphModule, node, have: str, order: list):
    """``node`` (indices ``have``) permuted to ``order`` (no node when that is the identity)."""
    perm = [have.index(i) for i in order]
    return node if perm == list(range(len(perm))) else gm.graph.call_method("permute", (node, *perm))


def parameter_einsum_to_linear(gm: fx.GraphModule) -> None:
    """Rewrite an einsum of an activation ``x`` (indices ``a``) with a parameter ``P`` (indices ``p``) whose output
    keeps the free indices of each (``Fa``, ``Fp``) and contracts the shared ones (``C``), with no index in all
    three, as ``F.linear(x', P')`` with ``x'`` = x permuted to ``Fa + C`` (C flattened) and ``P'`` = P permuted to
    ``Fp + C`` and reshaped ``(prod Fp, prod C)``, the result unflattened to ``Fp`` and permuted to the output's
    order. An ``+ b`` of a parameter over the output's trailing ``Fp`` indices is folded in as the linear's bias.
    The block finders then read a linear map whose weight is the parameter rearranged (``Graph``'s ``Lin`` with
    ``heads`` when P has a head index)."""
    changed = False
    for n in list(gm.graph.nodes):
        parts = _einsum(n)
        if parts is None or len(parts[1]) != 2:
            continue
        (eq, ops) = parts
        ins, out = eq.split("->")
        idx = ins.split(",")
        pi = next((i for i in (1, 0) if _parameter(gm, ops[i]) is not None and _parameter(gm, ops[1 - i]) is None
                   and isinstance(ops[1 - i], fx.Node)), None)
        if pi is None or any(len(set(t)) != len(t) for t in idx + [out]):
            continue
        p, a = idx[pi], idx[1 - pi]
        param = _parameter(gm, ops[pi])
        if param.dim() != len(p):
            continue
        contract = [i for i in a if i in p and i not in out]
        free_a = [i for i in out if i in a and i not in p]
        free_p = [i for i in out if i in p and i not in a]
        if not contract or not free_p or sorted(free_a + free_p) != sorted(out) or \
                sorted(free_a + contract) != sorted(a) or sorted(free_p + contract) != sorted(p):
            continue
        sizes = dict(zip(p, param.shape))
        bias_add = bias = None
        users = list(n.users)
        if len(users) == 1 and _is_add(users[0]) and out.endswith("".join(free_p)):
            other = users[0].args[1] if users[0].args[0] is n else users[0].args[0]
            b = _parameter(gm, other)
            if b is not None and tuple(b.shape) == tuple(sizes[i] for i in free_p):
                bias_add, bias = users[0], other
        with gm.graph.inserting_before(bias_add if bias_add is not None else n):
            x = _permuted(gm, ops[1 - pi], a, free_a + contract)
            if len(contract) > 1:
                x = gm.graph.call_method("flatten", (x, len(free_a)))
            w = _permuted(gm, ops[pi], p, free_p + contract)
            w = gm.graph.call_method("reshape", (w, math.prod(sizes[i] for i in free_p),
                                                 math.prod(sizes[i] for i in contract)))
            if bias is not None and len(free_p) > 1:
                bias = gm.graph.call_method("reshape", (bias, -1))
            y = gm.graph.call_function(F.linear, (x, w) if bias is None else (x, w, bias))
            if len(free_p) > 1:
                y = gm.graph.call_method("unflatten", (y, -1, tuple(sizes[i] for i in free_p)))
            y = _permuted(gm, y, "".join(free_a + free_p), list(out))
        if bias_add is not None:
            bias_add.replace_all_uses_with(y)
            gm.graph.erase_node(bias_add)
        n.replace_all_uses_with(y)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
