"""``Found``: what the block finders gather from one traced graph before the first-order check.

Each finder (``match.attention``, ``match.router``, ``match.mlp``, ``match.gain``, ``match.output``) reads the
``Graph``, adds candidate laws (``add``) and records what it explained; declines go to the ``Collector``.
"""
from __future__ import annotations

from torch import fx

from ...laws import Law
from ..core import Collector
from ..fxgraph import Graph
from ..torchnn import layer_index

__all__ = ["Found", "common_prefix", "layer_index"]


class Found:
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


def common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return ".".join(out)
