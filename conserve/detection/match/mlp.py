"""MLP blocks: ``down(act(up x))`` and gated ``down(g * up x)``, and the unit / deep-linear laws they carry.

* element-wise MLPs: ReLU / leaky-ReLU (or any positively homogeneous element-wise map, decided numerically) give
  the unit law of each hidden unit; GELU, SiLU, tanh, ... are declined (spec: GELU / SiLU FFN row);
  ``down(up x)`` with nothing between gives the deep-linear Gram. In a chain ``l3(act(l2(act(l1 x))))`` the down
  side of one law is the up side of the next. An up whose units are also read outside the block (a branch) is
  declined: its law would need the columns of every reader.
* gated MLPs ``down(g * up x)`` where ``up x`` reaches the product through index operations only (any gate:
  SwiGLU, GeGLU, fused ``gate_up`` chunks; a constant or per-unit scale after the product): the SwiGLU unit law
  on up rows and down columns (spec: SwiGLU row, the gate is not involved).
* fused experts gathered per token (``Lin.experts``): one unit law per expert.
"""
from __future__ import annotations

import torch
from torch import fx

from ...laws import DeepLinearGram, ReLUPowerUnit, ReLUUnit, SwiGLUUnit
from .. import builders
from ..fxgraph import Graph, Lin, with_strides_of
from ..ops import ELEMENTWISE, NO_LAW, POSITIVE, SHAPE_ONLY
from ..torchnn import NO_LAW_ACT, degree_from
from .found import Found, layer_index

__all__ = ["mlps"]


def mlps(f: Found) -> None:
    """The MLP finder (module docstring): every linear ``down`` not yet explained, read back to what feeds it."""
    g, c = f.g, f.c
    for n, down in f.free_lins():
        u = g.back_pass(down.x)
        o = g.op(u)
        if u in g.lins and u not in f.used and len(u.users) == 1 and _branch(g, u, n) is None \
                and g.lins[u].plain and down.plain:
            up = g.lins[u]
            fm = g.feature_map(u, down.x)
            if fm and -1 not in fm:
                f.add(builders.head_gram(DeepLinearGram, f"{up.module}-{down.module}/gram", layer_index(up.module),
                                         [up.row_block(fm)], [down.col_block(range(len(fm)))],
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
                fm = g.feature_map(src, down.x, positive=True)
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
                k = _elementwise(g, src, down.x)
                if k and not _declined_branch(f, src, n, f"Linear-{kinds}-Linear"):
                    fm = g.feature_map(src, down.x, positive=True) if k == 1 else list(range(up.n_out))
                    _homogeneous_unit(f, up, down, fm, k, f"Linear-{kinds}-Linear")
                    c.know(down.b)
                elif not k:
                    c.decline(up.module, f"Linear-{kinds}-Linear", f"the element-wise map {kinds!r} is not positively "
                              "homogeneous (f(c z) = c^k f(z) for c > 0 fails on the probe's values): no rescaling "
                              "symmetry, no law")
                    c.decline(down.module, f"Linear-{kinds}-Linear output", "see the MLP's input layer")
        elif o != "mul" and _generic_act(f, n, down):
            continue
        elif o == "mul":
            u = _peel_scale(g, u)  # (up x * g) * c: a constant or per-unit parameter c (x-transformers' mult_bias)
            ops = [a for a in u.args if isinstance(a, fx.Node)]
            if len(ops) != 2:
                continue
            unmapped = []  # operands read from one linear, but not through index ops alone (a fused gate/up whose
            # halves both reach the product through other ops: declined below)
            for i in (1, 0):
                cand = ops[i]
                lins = g.nearest_lins(cand)
                if len(lins) != 1:
                    continue
                src = next(iter(lins))
                fm = g.feature_map(src, cand)
                if not fm or -1 in fm:
                    unmapped.append(src)
                    continue
                if src in f.used and len(set(fm)) >= g.lins[src].n_out:
                    continue  # every row of this map is explained already; a map fused with attention's
                    # projections (PaLM's parallel block: q, k, v and the MLP's up rows in one linear) has rows left
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
            else:
                if len(unmapped) == 2 and unmapped[0] is unmapped[1] and unmapped[0] not in f.used \
                        and g.lins[unmapped[0]].n_out == 2 * down.n_in \
                        and all(getattr(g.env.get(a), "shape", (0,))[-1] == down.n_in for a in ops):
                    f.used.add(unmapped[0])
                    c.decline(g.lins[unmapped[0]].module, "gated MLP",
                              "neither operand of the gated product is the linear's units through index ops alone (a "
                              "shift or clamp on the linear half, as in (up + 1) * glu(gate)): rescaling a unit does "
                              "not pass through it, so the SwiGLU unit law does not hold: no law")


def _peel_scale(g: Graph, u: fx.Node) -> fx.Node:
    """The inner product of ``(a * b) * c`` when c is a constant or a parameter (repeatedly); ``u`` otherwise."""
    while g.op(u) == "mul" and len(u.args) == 2:
        t = [a for a in u.args if isinstance(a, fx.Node) and g.param_of(g.back_pass(a)) is None]
        if len(t) != 1 or g.op(g.back_pass(t[0])) != "mul" or len(t[0].users) != 1:
            break
        u = g.back_pass(t[0])
    return u


def _unit_laws(f: Found, cls, name: str, up: Lin, down: Lin, units, note: str, what: str, degree: float = 1.0) -> bool:
    """Unit law(s) of ``up`` rows ``units`` read by ``down`` columns: one law, or one per expert when both are
    fused experts gathered per token (``Lin.experts``: token s uses expert ids[s] in both maps, as the graph's
    index shows; named ``<experts module>.<e>/unit`` as the HF handler does). False (nothing added) when only one
    of them is per-expert or their expert counts differ."""
    if up.heads or down.heads:
        return False
    if not up.experts and not down.experts:
        f.add(builders.unit_law(cls, name, layer_index(up.module), up=up.w, up_shape=up.shape, units=units, down=down.w,
                                down_shape=down.shape, up_bias=up.b, up_t=up.t, down_t=down.t, degree=degree,
                                note=note), what)
        return True
    if up.experts != down.experts:
        return False
    for e in range(up.experts):
        f.add(builders.unit_law(cls, f"{up.module}.{e}/unit", layer_index(up.module), up=up.w, up_shape=up.shape,
                                units=units, down=down.w, down_shape=down.shape, up_bias=up.b, up_t=up.t, down_t=down.t,
                                lead=(e,), degree=degree, note=f"{note}; expert {e} of fused experts gathered per token"),
              what)
    return True


def _elementwise(g: Graph, src: fx.Node, dst: fx.Node) -> float | None:
    """The degree ``k > 0`` when ``dst = f(src)`` element-wise with ``f(c z) = c^k f(z)`` for ``c > 0`` (ReLU,
    leaky ReLU, abs: 1; squared ReLU: 2), 0.0 for any other element-wise f, None when the map is not element-wise
    (checked on the recorded values, ``torchnn.degree_from``)."""
    z, y = g.env[src], g.env[dst]
    if not (isinstance(z, torch.Tensor) and isinstance(y, torch.Tensor)) or z.shape != y.shape or not z.is_floating_point():
        return None
    n = z.shape[-1]
    try:
        for r in (0, n // 2, n - 1):
            z2 = z.detach().clone().contiguous()
            z2.view(-1, n)[0, r] += 0.37
            d = (g.run({src: with_strides_of(z, z2)}, [dst])[0] - y).reshape(-1, n)
            d[0, r] = 0.0
            if d.abs().max() > 0:
                return None
        run = lambda v: g.run({src: with_strides_of(z, v)}, [dst])[0]  # noqa: E731
        k = degree_from(y, run(2.5 * z), run(0.3 * z))
        if not k:
            return k
        # and on unit normal values: large probe activations reach SiLU / GELU where they are the identity to rounding
        # and 30 times larger ones, beyond ReLU6 / hardtanh's clip
        fresh = torch.randn(z.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64).to(z.dtype)
        return k if all(degree_from(run(v), run(2.5 * v), run(0.3 * v)) == k for v in (fresh, 30.0 * fresh)) else 0.0
    except Exception:  # noqa: BLE001
        return None


def _homogeneous_unit(f: Found, up: Lin, down: Lin, units, k: float, what: str) -> None:
    """The unit law of a degree-``k`` positively homogeneous activation between ``up`` and ``down``: ``ReLUUnit``
    (k = 1, spec: ReLU row), else ``ReLUPowerUnit`` with ``k`` on the down columns."""
    if k == 1:
        _unit_laws(f, ReLUUnit, f"{up.module}/unit", up, down, units, f"structural: {what} (spec: ReLU row)",
                   "ReLU unit")
    else:
        _unit_laws(f, ReLUPowerUnit, f"{up.module}/unit", up, down, units,
                   f"structural: {what}, homogeneous of degree {k:g} (docs/laws.md, \"Homogeneous activations of "
                   f"degree k\")", f"degree-{k:g} unit", degree=k)


def _generic_act(f: Found, n: fx.Node, down: Lin) -> bool:
    """``down(act(up x))`` for an element-wise act written with several ops (GPT-2's tanh GELU, torch.where
    ReLU...): ReLU unit law when act is positively homogeneous, declined otherwise (numerically decided)."""
    g, c = f.g, f.c
    lins = g.nearest_lins(down.x)
    if len(lins) != 1:
        return False
    src = next(iter(lins))
    if src in f.used or src is n:
        return False
    k = _elementwise(g, src, down.x)
    if k is None:
        return False
    up = g.lins[src]
    f.used.add(src)
    if k:
        if _declined_branch(f, src, n, "Linear-activation-Linear"):
            return True
        _homogeneous_unit(f, up, down, range(up.n_out), k, "positively homogeneous element-wise activation")
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


def _declined_branch(f: Found, src: fx.Node, down: fx.Node, block: str) -> bool:
    """Decline the up map ``src`` of a unit law when its units are also read outside ``down`` (``_branch``)."""
    other = _branch(f.g, src, down)
    if other is None:
        return False
    up, lin = f.g.lins[src], f.g.lins[down]
    reader = repr(f.g.lins[other].module) if other in f.g.lins else f"a {f.g.op(other)!r} op"
    f.c.decline(up.module, block, f"its units are read by {lin.module!r} and also by {reader}: a per-unit law would "
                "need the columns of every reader (not in the catalogue): no law")
    return True
