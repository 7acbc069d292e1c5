"""Output layers: a linear whose output reaches the model output through index operations only (or a constant logit
scale) gets the translation law when the loss is softmax cross-entropy (``loss='ce'``, or ``F.cross_entropy`` of
it inside the graph); declined otherwise (a soft-cap or another op before the output breaks it; spec: untied
softmax output row)."""
from __future__ import annotations

from ...laws import Translation
from .. import builders
from .found import Found

__all__ = ["output_layers"]


def output_layers(f: Found) -> None:
    """The output-layer finder (module docstring)."""
    g, c = f.g, f.c
    loss = c.options.get("loss")
    for n, lin in g.lins.items():
        if not lin.plain:
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
