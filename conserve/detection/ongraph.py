"""The laws found on one traced graph (``detect_on``): the finders' candidates, the first-order check, and a
decline for every parameterised module no law explains.  ``graph.detect_graph`` (the whole model),
``blocks`` (block by block) and ``large`` (meta-device and large models) all end here.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..laws.tolerance import TOL
from .check import check_laws
from .core import Collector, Detection
from .fxgraph import Graph
from .match import FINDERS
from .match.found import Found


def detect_on(g: Graph, c: Collector, model: nn.Module, how: str, skip: set, check=check_laws) -> Detection:
    """The laws of the traced probe ``g``: the candidates every finder (``match.FINDERS``) proposes, each kept only
    if ``check`` (spec check 1 in float64: ``check.check_laws``, or a function with its signature and verdicts)
    passes it, and the declines; ``c.finish``. ``skip``: parameters not to build laws of or decline (explained
    elsewhere)."""
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
        viol = check(g, [law for law, _ in cands], f.heads)
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
    decline_rest(f, model, skip, how)
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


def decline_rest(f: Found, model: nn.Module, skip, how: str):
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
        m = model.get_submodule(mod) if mod and is_module(model, mod) else None
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


def is_module(model, path):
    try:
        return isinstance(model.get_submodule(path), nn.Module)
    except AttributeError:
        return False
