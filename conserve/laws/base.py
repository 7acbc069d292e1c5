"""Law instances and their compilation into one kernel ``Plan``.

A ``Law`` is a named quadratic (or linear) function of named parameters, written as signed terms
over ``Ref``s (row blocks, column blocks or vectors of a parameter). ``compile_laws`` turns a list of
laws into a single ``conserve.kernels.Plan`` plus the layout that says where each law's values land.

Instance conventions for the paper's error ``eps`` (spec "The paper's error metric"):
- ``per="entry"``: every scalar entry is one instance (unit balance, RoPE pairs, gain);
- ``per="law"``: the whole law is one instance (a D x D Gram, Frobenius norm; a router-sum vector).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Mapping, Sequence

import torch

from ..kernels import GramTerm, NormTerm, Plan, SumTerm, View


@dataclass(frozen=True)
class Ref:
    """A strided 2-D view of a named parameter (logical indices; see ``conserve.kernels.View``)."""

    param: str
    start: tuple[int, ...]
    row_dim: int
    rows: int
    col_dim: int | None
    cols: int
    row_step: int = 1

    def view(self, tensor_index: int) -> View:
        return View(tensor_index, self.start, self.row_dim, self.rows, self.col_dim, self.cols, self.row_step)


def rows(param: str, shape: Sequence[int], start: int, n: int, *, step: int = 1, lead: tuple[int, ...] = ()) -> Ref:
    """Rows ``start, start+step, ...`` (n of them) of a weight of logical shape ``lead + (out, in)``.

    ``lead`` indexes leading dims (e.g. the expert of a fused ``(E, 2I, H)`` tensor)."""
    nd = len(lead)
    return Ref(param, lead + (start, 0), nd, n, nd + 1, shape[-1], step)


def cols(param: str, shape: Sequence[int], start: int, n: int, *, lead: tuple[int, ...] = ()) -> Ref:
    """Columns ``start..start+n`` of a weight ``lead + (out, in)``, each column read as one row."""
    nd = len(lead)
    return Ref(param, lead + (0, start), nd + 1, n, nd, shape[-2])


def vector(param: str, start: int, n: int, *, step: int = 1, lead: tuple[int, ...] = ()) -> Ref:
    """Entries ``start, start+step, ...`` of a vector (a bias or a norm gain), read as n rows of 1 column."""
    nd = len(lead)
    return Ref(param, lead + (start,), nd, n, None, 1, step)


@dataclass(frozen=True)
class Term:
    kind: str  # "gram" | "norm" | "sum"
    ref: Ref
    sign: float
    offset: int = 0  # norm: first output entry within the law; sum: first output column
    stride: int = 1  # norm: output stride
    shift: float = 0.0


@dataclass
class Law:
    """One law instance (or a vector of per-entry instances).

    Attributes:
        name: unique, namespaced (``layers.3.mlp/unit``).
        layer: block index or None.
        terms: the signed terms; together they define ``h(theta)``.
        size: number of vector entries (``gram`` laws: the matrix side D).
        note: where the law comes from / caveats, shown in reports.
    """

    family: ClassVar[str] = "law"
    kind: ClassVar[str] = "vector"  # "vector" or "gram"
    linear: ClassVar[bool] = False
    per: ClassVar[str] = "entry"  # eps instances: "entry" or "law"
    source: ClassVar[str] = ""

    name: str
    layer: int | None
    terms: list[Term]
    size: int
    note: str = ""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.ref.param for t in self.terms))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size}, params={list(self.params)})"


@dataclass(frozen=True)
class Declined:
    """A block with no law (or a law that does not apply), and why."""

    module: str
    block: str
    reason: str


@dataclass
class Compiled:
    """A law set compiled to one plan over ``tensors`` (the parameters, in ``names`` order)."""

    laws: list[Law]
    names: list[str]
    plan: Plan
    where: list[tuple[str, int, int]]  # per law: ("vec", first, size) or ("gram", D, slot)
    linear_mask: torch.Tensor  # (vec_size,) bool: entries of linear laws

    def split(self, vec: torch.Tensor, grams: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """Values per law: a vector of ``size`` or a ``D x D`` matrix."""
        out = []
        for kind, a, b in self.where:
            out.append(vec[a : a + b] if kind == "vec" else grams[a][b])
        return out


def compile_laws(laws: Iterable[Law], shapes: Mapping[str, Sequence[int]]) -> Compiled:
    """Compile laws into one ``Plan``; ``shapes`` maps parameter names to shapes (checked here).

    Raises ``ValueError`` naming the law whose reference does not fit its parameter, or a name given to two
    laws (values are reported by name: one would hide the other)."""
    laws = list(laws)
    seen_names: set[str] = set()
    for law in laws:
        if law.name in seen_names:
            raise ValueError(f"two laws are named {law.name!r}: law names must be unique (drop the duplicate, or "
                             "rename one with dataclasses.replace(law, name=...))")
        seen_names.add(law.name)
    names: list[str] = []
    index: dict[str, int] = {}
    plan = Plan()
    where = []
    linear = []
    for law in laws:
        if law.kind == "gram":
            slot = plan.new_gram(law.size)
            where.append(("gram", law.size, slot))
        else:
            first = plan.new_vec(law.size)
            where.append(("vec", first, law.size))
            linear.append((first, law.size, law.linear))
        for t in law.terms:
            p = t.ref.param
            if p not in shapes:
                raise ValueError(f"law {law.name!r} reads {p!r}, which is not a parameter of the model")
            if p not in index:
                index[p] = len(names)
                names.append(p)
            v = t.ref.view(index[p])
            _check_fits(law, v, shapes[p])
            if t.kind == "gram":
                plan.grams.append(GramTerm(v, t.sign, slot))
            elif t.kind == "norm":
                plan.norms.append(NormTerm(v, t.sign, first + t.offset, t.stride, t.shift))
            elif t.kind == "sum":
                plan.sums.append(SumTerm(v, t.sign, first + t.offset))
            else:  # pragma: no cover - programming error
                raise ValueError(t.kind)
    mask = torch.zeros(plan.vec_size, dtype=torch.bool, device="cpu")
    for first, size, lin in linear:
        mask[first : first + size] = lin
    return Compiled(laws, names, plan, where, mask)


def _check_fits(law: Law, v: View, shape: Sequence[int]) -> None:
    try:
        v.resolve(torch.empty(tuple(shape), device="meta"))
    except ValueError as e:
        raise ValueError(f"law {law.name!r}: {e}") from None
