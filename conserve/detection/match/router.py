"""MoE routers: a linear whose output is only read by ``softmax`` (directly or after ``topk``) gives the router-sum
law (spec: MoE router row, softmax, any top-k, renormalised or not); a sigmoid router is declined (spec: open
row for normalised sigmoid gating). Expert MLPs are found by ``match.mlp``."""
from __future__ import annotations

from ...laws import RouterSum
from .. import builders
from .found import Found, layer_index

__all__ = ["routers"]


def routers(f: Found) -> None:
    """The router finder (module docstring)."""
    g, c = f.g, f.c
    for n, r in f.free_lins():
        if not r.plain:
            continue
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
            f.add(builders.row_sum_law(RouterSum, f"{r.module}/router", layer_index(r.module), r.w, r.shape, e_n,
                                       bias=r.b, transposed=r.t,
                                       note="structural: softmax gating (top-k, renormalised or not) (spec: MoE router "
                                            "row)"), "router")
        elif "sigmoid" in kinds and e_n == 1:
            c.decline(r.module, "sigmoid gate", "one output through a sigmoid, scaling what it gates (e.g. a shared "
                      "expert's gate): no symmetry of its row alone, no law")
        elif "sigmoid" in kinds:
            c.decline(r.module, "sigmoid router", "sum_e W_router[e,:] is NOT conserved for normalised sigmoid gating "
                      "with top-k >= 2 (spec: MoE router, normalised sigmoid: open row)")
        else:
            continue
        f.used.add(n)
