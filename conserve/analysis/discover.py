"""Discover the conservation laws of a block numerically (float64): ``conserve.discover``.

Math (spec ``shared/spec/laws.md``, "The numerical checks", check 1; Marcotte, Gribonval, Peyre 2023):
``h(theta) = theta^T M theta`` is conserved by gradient flow for every dataset and every loss iff
``(M theta)^T grad_theta f_o(theta, x) = 0`` for all ``theta``, ``x`` and outputs ``o``; a linear law
``c^T theta`` iff ``c^T grad_theta f_o = 0``. Both conditions are LINEAR in the unknown (``M`` or ``c``):
stacking them for random ``theta``, ``x`` and random output combinations ``r . f`` (a sketch of the
constraints: one vector-Jacobian product per row) gives a matrix whose numerical null space is the space
of conserved quadratics (linear laws). The rank is read at the largest gap of the log singular values
(``conserve.counting`` rule; the gap and the singular values around it are reported).

Ansatz (the unknowns):

- ``structured`` (default): every tensor is read as ``lead + (out, in)`` (a vector as ``(n, 1)``, a 0-dim
  scalar as ``(1, 1)``); its *fibers* are its rows (length ``in``) and its columns (length ``out``).
  Quadratic unknowns are the coefficients ``C_ab`` of ``<U_a, U_b>`` for every pair of fibers of equal
  length, of one tensor or of two (``M = sum_L C_L (x) I_L``: sums of row and column Grams of each tensor
  and of tensor pairs; every catalogue law has this form). Features that are linear combinations of
  others (``tr W W^T = tr W^T W``) are removed by an in-order QR of their values at random points.
  Linear unknowns: ``alpha`` over the fibers of one length, the law being the vector
  ``sum_a alpha_a U_a`` (router sum: ``alpha = 1`` on the router's rows).
- ``dense``: every monomial ``theta_i theta_j`` (``P (P + 1) / 2`` unknowns) and every ``c in R^P``; only
  for tiny blocks. ``auto`` runs the structured ansatz and, when it fits, the dense one as a check that
  the structured ansatz missed no quadratic law (laws found only by the dense ansatz are reported as
  "outside the structured ansatz").

Readable answers: the null space is put in reduced row echelon form over the features (pivot columns
in parameter order), which splits laws with disjoint supports exactly; each connected group of laws is
then recognised as a Gram law ``sum_c s_c X_c X_c^T`` over blocks of ``D`` fibers (head Gram, deep linear),
or kept as per-fiber balance laws ``sum_a s_a ||U_a||^2``, and named in catalogue terms when it matches
(unit balance, rotary pair, gain, head Gram, router sum / translation, frozen parameter); otherwise it is
"new" with the tensors, index sets and coefficients it couples. Quadratic laws that are products of linear
laws (``||sum_e W_router[e,:]||^2``, ``b_k b_k^T``) are counted but not listed. Every law gets a float64
first-order check (its ``conserve.Law`` evaluated by the kernels' torch twin, autograd gradients).

Scope: laws that hold for EVERY loss of the block's output (end the block with ``log_softmax`` to find
the laws that need softmax cross-entropy, e.g. the translation law of an output layer). Tensors of
``ndim >= 3`` are read as ``lead + (out, in)`` (fused experts ``(E, I, H)``: the fibers of each expert);
a convolution kernel ``(out, in, kh, kw)`` is therefore read per kernel position, not per channel.
Size: the SVD of one solve holds ~(1.2 N)^2 float64 for N unknowns and costs ~N^3 (``max_unknowns``,
default 6,000); above it :class:`BlockTooLarge` says so and names the fix (a smaller width).

Completeness: where ``conserve.count`` applies (``count_limit`` parameters), the number of functionally
independent laws found (rank of their gradients at a random point) is compared with the full count, taken
at the block's parameters on the example batch plus redrawn ones (at least ``4 P`` output rows; redone on
4x more samples while it exceeds the laws found, the lowest kept: a ReLU unit active on few samples adds
frozen directions, "laws" of that batch only). The statement is ``complete``, ``incomplete`` (naming what
ran: after the dense ansatz the missing laws are not polynomial of the degree searched) or ``undecided``
(parameters with no gradient on the count's batch, ``Discovery.dead``: dead units make it an upper bound).

Canonical form: the RREF of a subspace is unique (columns in parameter order), but least-L1 choices are
not (ties between laws with disjoint supports; scipy's HiGHS and the IRLS fallback pick different optima),
so the laws left after the Gram laws are put in RREF again after the L1 passes, then made sparse modulo
the vanishing combinations and the Gram entries only: the result does not depend on the null-space basis
the SVD returns nor on the L1 solver.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.func import vjp, vmap

from ..counting import LawCount, as_tuple, block_function, count_laws, numerical_rank
from ..laws import Law, Ref, Term
from ..laws.tolerance import FIRST_ORDER_DISCOVERED as TOL
from .firstorder import flat_output, gradients, law_vector, to_float64, violation
from .ansatz import Basis as _Basis
from .ansatz import Family as _Family
from .ansatz import Fiber
from .ansatz import QuadraticFeatures as _Quadratic
from .ansatz import count_quadratic as _count_quadratic
from .ansatz import dense_fibers as _dense_fibers
from .ansatz import families as _families
from .ansatz import nullspace as _nullspace
from .ansatz import reduce_l1 as _reduce_l1
from .ansatz import rref as _rref
from .ansatz import structured_fibers as _structured_fibers

__all__ = ["discover", "Discovery", "DiscoveredLaw", "Solve", "BlockTooLarge", "MAX_UNKNOWNS"]

MAX_UNKNOWNS = 6000  # unknowns of one ansatz: the SVD holds ~2 * 1.1 * N^2 float64 (~650 MB at 6000)
DENSE_AUTO = 1200  # "auto" runs the dense cross-check up to this many quadratic unknowns
COUNT_LIMIT = 400  # conserve.count is run up to this many parameters


class BlockTooLarge(ValueError):
    """The ansatz of a block has more unknowns than the limit; the message names the fix."""


# ----------------------------------------------------------------------------------------- results
@dataclass
class Solve:
    """One null-space solve: ``unknowns`` columns, ``constraints`` sketched rows, ``null_dim`` = unknowns -
    rank at the largest gap ``gap`` (``s[rank-1] / s[rank]``; ``next_gap``: the largest other ratio),
    ``around``: the singular values around the gap; ``seconds``, ``megabytes`` (constraint matrix)."""

    ansatz: str
    degree: int
    unknowns: int
    constraints: int
    null_dim: int
    gap: float
    next_gap: float
    around: list[float]
    seconds: float
    megabytes: float
    removed: int = 0  # structured: dependent features removed

    def summary(self) -> str:
        ar = ", ".join(f"{v:.1e}" for v in self.around)
        return (f"{self.ansatz} degree {self.degree}: {self.unknowns} unknowns, {self.constraints} constraints, "
                f"null space {self.null_dim}, gap {self.gap:.1e} (next {self.next_gap:.1e}), s around gap [{ar}], "
                f"{self.seconds:.2f} s")


@dataclass
class DiscoveredLaw:
    """One discovered law (a basis element of the law space, or a Gram law grouping ``size(size+1)/2`` of them).

    Attributes:
        name: unique name (``discover/<tag>/<n>``).
        kind: ``linear`` | ``balance`` (``sum_a s_a ||U_a||^2``) | ``gram`` (``sum_c s_c X_c X_c^T``, D x D)
            | ``quadratic`` (any other quadratic form, listed by its features).
        match: the catalogue family it matches (``unit balance``, ``rotary pair``, ``gain balance``,
            ``layer-scale balance``, ``head Gram``, ``deep linear / VO Gram``, ``row sum (router sum /
            translation)``, ``frozen``) or ``new``.
        terms: ``[(coefficient, what)]``, ``what`` naming the fibers (``q_proj.weight[0:2,:]`` ...).
        law: the ``conserve.Law`` (``None`` when the kernels' term language cannot express it: then
            ``why_no_law`` says why; the value function is still checked).
        first_order: worst relative ``|<grad h, grad (r . f)>| / (||.|| ||.||)``, float64 (spec check 1).
        independent: number of scalar laws it stands for.
    """

    name: str
    kind: str
    match: str
    terms: list[tuple[float, str]]
    law: Law | None
    first_order: float = float("nan")
    independent: int = 1
    why_no_law: str = ""
    value: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.first_order <= TOL

    def formula(self) -> str:
        if self.kind == "linear":
            return " + ".join(f"{c:+.4g} {w}" for c, w in self.terms)
        if self.kind == "gram":
            return " ".join(f"{c:+.4g} G({w})" for c, w in self.terms)
        return " ".join(f"{c:+.4g} {w}" for c, w in self.terms)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "match": self.match, "size": self.independent,
                "terms": [[c, w] for c, w in self.terms], "first_order": self.first_order,
                "trackable": self.law is not None, "why_no_law": self.why_no_law}


@dataclass
class Discovery:
    """The result of :func:`discover`.

    Attributes:
        laws: the discovered laws (linear first, then quadratic), each checked.
        solves: one :class:`Solve` per null-space computation (structured / dense, degree 1 / 2).
        num_params: scalar parameters of the block (all trainable ones).
        null_dim: dimension of the structured quadratic law space (``solves``) and linear law space.
        products: quadratic laws that are products of linear laws (not listed).
        outside_ansatz: laws found only by the dense ansatz (already in ``laws``, ``match='new'``).
        independent: functionally independent laws found (rank of their gradients at a random point).
        count: the ``conserve.count`` result (``None`` above ``count_limit`` parameters or when skipped).
        complete: ``independent == count.count`` (``None`` without a count).
        dead: parameter entries with zero gradient for every output on the count's batch, at the block's
            parameters (only looked for when the count exceeds the laws found): dead units, whose frozen
            directions make that count an upper bound.
    """

    laws: list[DiscoveredLaw]
    solves: list[Solve]
    num_params: int
    linear_dim: int
    quadratic_dim: int
    products: int
    outside_ansatz: int
    independent: int
    count: LawCount | None
    notes: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool | None:
        return None if self.count is None else self.independent == self.count.count

    @property
    def gap(self) -> float:
        """Smallest gap ratio over the solves that found a null space (the least clear rank decision)."""
        gaps = [s.gap for s in self.solves]
        return min(gaps) if gaps else float("nan")

    def tracked_laws(self) -> list[Law]:
        """The ``conserve.Law`` objects (for ``conserve.track(opt, model, laws=...)``)."""
        return [d.law for d in self.laws if d.law is not None]

    def completeness(self) -> str:
        if self.count is None:
            return "not counted (block above count_limit parameters or count=False)"
        c = self.count.count
        if self.independent == c:
            return f"complete: the {self.independent} independent polynomial laws found are all {c} laws of the block"
        if self.independent < c and self.dead:
            shown = ", ".join(self.dead[:6]) + (", ..." if len(self.dead) > 6 else "")
            return (f"undecided: {self.independent} independent laws found, conserve.count says {c}, but "
                    f"{len(self.dead)} parameters get no gradient on the count's batch ({shown}): dead units "
                    "(a ReLU unit never active) add frozen directions, laws of that batch only, so the count is "
                    "an upper bound; give example inputs (and parameters) that activate every unit")
        if self.independent < c:
            deg = max((s.degree for s in self.solves), default=2)
            dense = any(s.ansatz == "dense" and s.degree == deg for s in self.solves)
            kind = "linear" if deg == 1 else "linear or quadratic"
            if dense:
                why = f"the dense ansatz (every monomial) ran too: they are not {kind}"
            elif any(n.startswith("dense cross-check skipped") for n in self.notes):
                why = (f"not {kind} in the structured ansatz; the dense ansatz is too large for this block (see the "
                       "notes): a smaller width lets it run")
            else:
                why = f"not {kind} in the structured ansatz: ansatz='dense' (tiny blocks) searches every monomial"
            if deg == 1:
                why += "; degree=2 also searches quadratic laws"
            return f"incomplete: {c - self.independent} of the block's {c} laws (conserve.count) are not found: {why}"
        return (f"inconsistent: {self.independent} independent laws found but conserve.count says {c} "
                f"(count gap {self.count.gap_ratio:.1e}): check the gaps")

    def markdown(self) -> str:
        lines = ["| # | law | kind | match | size | first-order | trackable |", "|---|---|---|---|---|---|---|"]
        for i, d in enumerate(self.laws):
            lines.append(f"| {i} | `{d.formula()}` | {d.kind} | {d.match} | {d.independent} | {d.first_order:.1e} | "
                         f"{'yes' if d.law is not None else 'no: ' + d.why_no_law} |")
        lines.append("")
        lines += [f"- {s.summary()}" for s in self.solves]
        lines.append(f"- parameters {self.num_params}; linear laws {self.linear_dim}, quadratic {self.quadratic_dim} "
                     f"({self.products} products of linear laws not listed); independent {self.independent}")
        lines.append(f"- {self.completeness()}")
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"num_params": self.num_params, "linear_dim": self.linear_dim, "quadratic_dim": self.quadratic_dim,
                "products": self.products, "outside_ansatz": self.outside_ansatz, "independent": self.independent,
                "count": None if self.count is None else self.count.count, "complete": self.complete,
                "completeness": self.completeness(), "dead": self.dead, "solves": [vars(s) for s in self.solves],
                "laws": [d.to_json() for d in self.laws], "notes": self.notes}

    def __str__(self) -> str:  # pragma: no cover - formatting only
        return self.markdown()


# ------------------------------------------------------------------------------------- the problem
class _Problem:
    """The block as ``f(theta_flat) -> outputs`` plus samplers of generic points and inputs."""

    def __init__(self, block, example_inputs, params, resample: bool, seed: int):
        call, theta = block_function(block, None if isinstance(block, nn.Module) else params)
        if not theta:
            raise ValueError("discover: the block has no trainable parameter")
        self.call, self.theta0 = call, theta
        self.names = list(theta)
        self.shapes = [tuple(theta[n].shape) for n in self.names]
        self.sizes = [theta[n].numel() for n in self.names]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.P = sum(self.sizes)
        if isinstance(block, nn.Module) and params is not None:
            params = list(params)
            bad = [p for p in params if p not in theta]
            if bad:
                raise ValueError(f"discover: {bad} are not trainable parameters of the block; choose from {self.names}")
            self.include = set(params)
        else:
            self.include = set(self.names)
        self.gen = torch.Generator().manual_seed(seed)
        self.scale = {n: (float(t.pow(2).mean().sqrt()) or 1.0) if t.numel() else 1.0 for n, t in theta.items()}
        if callable(example_inputs) and not isinstance(example_inputs, (torch.Tensor, tuple, list)):
            self._inputs = lambda g: tuple(to_float64(x) for x in as_tuple(example_inputs(g)))
            self.example = self._inputs(torch.Generator().manual_seed(seed))
        else:
            self.example = tuple(to_float64(x) for x in as_tuple(example_inputs))
            if resample:
                def draw(g):  # only the first input is data; the others (masks, rotary tables, ...) are kept
                    return (_redraw(self.example[0], g),) + self.example[1:]
                self._inputs = draw
            else:
                self._inputs = lambda g: self.example
        with torch.no_grad():
            out = self.f(self.flat(theta), self.example)
        self.m = out.numel()
        if not torch.isfinite(out).all():
            raise ValueError("discover: the block's output at its parameters is not finite; check the inputs")

    def count_inputs(self, draws: int = 3):
        """The example batch and ``draws - 1`` redrawn ones, concatenated along dim 0 (for ``conserve.count``,
        which needs a generic batch); the example alone when inputs are not redrawn."""
        if self._inputs(torch.Generator().manual_seed(0)) is self.example:
            return self.example
        g = torch.Generator().manual_seed(4321)
        batches = [self.example] + [self._inputs(g) for _ in range(draws - 1)]
        try:
            return tuple(torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() else parts[0]
                         for parts in zip(*batches))
        except RuntimeError:
            return self.example

    def flat(self, d: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([d[n].reshape(-1) for n in self.names])

    def unflat(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.reshape(s) for n, t, s in zip(self.names, torch.split(theta, self.sizes), self.shapes)}

    def f(self, theta: torch.Tensor, inputs) -> torch.Tensor:
        out = self.call(self.unflat(theta), inputs)
        if isinstance(out, Mapping):  # dict / HF ModelOutput: every floating tensor value is an output
            out = tuple(v for v in out.values() if isinstance(v, torch.Tensor))
        try:
            return flat_output(out)
        except TypeError:
            raise TypeError(f"discover: the block returned {type(out).__name__}; return a tensor, a tuple of "
                            "tensors or a dict of tensors") from None

    def sample_theta(self) -> torch.Tensor:
        parts = []
        for n in self.names:
            t = self.theta0[n]
            parts.append((t + self.scale[n] * torch.randn(t.shape, generator=self.gen, dtype=torch.float64)).reshape(-1))
        return torch.cat(parts)

    def gradients(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A generic point ``theta`` (P,) and ``k`` gradients ``grad_theta <r, f(theta, x)>`` (k, P)."""
        theta = self.sample_theta()
        x = self._inputs(self.gen)
        out, pull = vjp(lambda t: self.f(t, x), theta)
        r = torch.randn(k, out.numel(), generator=self.gen, dtype=torch.float64)
        g = vmap(lambda v: pull(v)[0])(r)
        if not torch.isfinite(g).all():
            raise ValueError("discover: non-finite gradients at a random point; the block must be differentiable "
                             "(float64) around its parameters")
        return theta, g


def _redraw(x, g):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 1 and bool(torch.isfinite(x).all()):
        std = float(x.std()) or 1.0
        return float(x.mean()) + std * torch.randn(x.shape, generator=g, dtype=torch.float64)
    if isinstance(x, torch.Tensor) and x.dtype in (torch.int32, torch.int64) and x.numel() > 1:
        # token ids: uniform over the range the example spans (give ids that cover the vocabulary)
        return torch.randint(int(x.min()), int(x.max()) + 1, x.shape, generator=g, dtype=x.dtype)
    return x


class _Bar:
    """A rich progress bar on stderr (rich is a dependency of conserve); ``update(k)``, ``close()``."""

    def __init__(self, total: int, desc: str):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn(desc), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          console=Console(stderr=True), transient=True)
        self.p.start()
        self.task = self.p.add_task(desc, total=total)

    def update(self, k: int) -> None:
        self.p.advance(self.task, k)

    def close(self) -> None:
        self.p.stop()


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        return _Bar(total, desc)
    except ImportError:  # pragma: no cover - rich is a declared dependency
        return None


def _estimate(n: int, m: int) -> tuple[float, float]:
    """(megabytes of the constraint matrix and its SVD, flop of the SVD)."""
    return 8 * (m * n + n * n + m * m) / 2**20, 4.0 * m * n * n + 8.0 * n**3


def _check_size(n: int, what: str, limit: int, P: int, within: bool = False) -> None:
    if n > limit:
        mb, _ = _estimate(n, n + max(32, n // 5))
        raise BlockTooLarge(
            f"discover: the {what} has {n} unknowns ({P} parameters), above the limit max_unknowns={limit} "
            f"(the SVD would need ~{mb / 1024:.1f} GiB). Fix: build the same block with a smaller width "
            "(hidden size, heads, head_dim, intermediate size: the laws' structure does not depend on the width), "
            "or pass params=[...] to search a subset of its tensors, "
            + ("" if within else "or pairs='within' (single-tensor Grams), ") + "or raise max_unknowns")


# ------------------------------------------------------------------------------------------- discover
def discover(
    block: nn.Module | Callable,
    example_inputs: Any,
    *,
    degree: int = 2,
    ansatz: str = "auto",
    pairs: str = "auto",
    params: Iterable[str] | Mapping[str, torch.Tensor] | None = None,
    max_unknowns: int = MAX_UNKNOWNS,
    margin: int | None = None,
    resample_inputs: bool = True,
    count: bool | None = None,
    count_limit: int = COUNT_LIMIT,
    seed: int = 0,
    progress: bool | None = None,
) -> Discovery:
    """Find the linear and quadratic conservation laws of ``block`` numerically, in float64.

    Spec: ``shared/spec/laws.md`` (checks 1 and 4); the module docstring gives the method.

    Args:
        block: an ``nn.Module`` called as ``block(*inputs)`` (all parameters that require grad are
            trained; the laws are sought over ``params`` of them, default all), or a callable
            ``block(params, *inputs)`` with ``params={name: tensor}``. Outputs: a tensor or a tuple of
            tensors; batch rows must be independent (no batch norm).
        example_inputs: a tensor or tuple of tensors (a batch), or a function ``inputs(generator)``
            returning a fresh batch. With ``resample_inputs`` (default) the FIRST input (the data) is
            redrawn per random point: floating and finite -> a Gaussian with the example's shape, mean
            and std; integer token ids -> uniform over the range the example spans (so give ids that
            cover the vocabulary: an id never seen has a frozen embedding row, a "law" of that data
            only). The other inputs (masks, rotary tables, ...) are passed as given.
        degree: 1 (linear laws) or 2 (linear and quadratic).
        ansatz: ``"structured"``, ``"dense"`` (tiny blocks) or ``"auto"`` (structured, plus the dense
            cross-check when it has at most ``1200`` quadratic unknowns).
        pairs: structured quadratic features over fiber pairs of ``"all"`` tensors (and tensor pairs),
            ``"within"`` single tensors only (about 3x fewer unknowns; every catalogue law is of that form),
            or ``"auto"``: all pairs when they fit in ``max_unknowns``, else single tensors (noted).
        params: parameter names the laws may read (module) / the parameter dict (callable).
        max_unknowns: size limit of one solve (raises :class:`BlockTooLarge` above it).
        margin: extra constraint rows beyond the unknowns (default ``max(32, unknowns // 5)``).
        count: compare with ``conserve.count`` (default: when the block has <= ``count_limit`` parameters).
        seed: seeds every random draw (private generators; the global RNG is untouched).
        progress: show a progress bar and the work estimate on stderr (default: when stderr is a tty).

    Returns:
        a :class:`Discovery`: the laws (``conserve.Law`` objects in ``.law``, ``tracked_laws()``), the
        solves (null-space dimensions, gaps), products of linear laws, completeness vs ``conserve.count``.

    Raises:
        BlockTooLarge: an ansatz exceeds ``max_unknowns`` (the message names the fix: a smaller width).
        ValueError / TypeError: bad degree / ansatz / block / params / inputs (one line naming the fix).
    """
    if degree not in (1, 2):
        raise ValueError(f"discover: degree must be 1 or 2, got {degree}")
    if ansatz not in ("auto", "structured", "dense"):
        raise ValueError(f"discover: ansatz must be 'auto', 'structured' or 'dense', got {ansatz!r}")
    if pairs not in ("auto", "all", "within"):
        raise ValueError(f"discover: pairs must be 'auto', 'all' or 'within', got {pairs!r}")
    show = sys.stderr.isatty() if progress is None else bool(progress)
    pb = _Problem(block, example_inputs, params, resample_inputs, seed)
    P = pb.P
    notes: list[str] = []
    extra = (lambda n: margin) if margin is not None else (lambda n: max(32, n // 5))
    setups = []  # (name, fibers, families, quadratic features or None)
    for name, make in (("structured", _structured_fibers), ("dense", _dense_fibers)):
        if ansatz not in (name, "auto"):
            continue
        fibers, idxs = make(pb.names, pb.shapes, pb.offsets, pb.include)
        if not fibers:
            raise ValueError("discover: params selects no parameter; pass names from the block's named_parameters()")
        fams = _families(fibers, idxs)
        within = name == "structured" and pairs == "within"
        nq = _count_quadratic(fams, fibers, within) if degree == 2 else 0
        nl = max(len(F.fibers) for F in fams)
        limit = min(max_unknowns, DENSE_AUTO) if (ansatz == "auto" and name == "dense") else max_unknowns
        if name == "structured" and pairs == "auto" and nq > limit:
            nw = _count_quadratic(fams, fibers, True) if degree == 2 else 0
            notes.append(f"cross-tensor pairs left out ({nq} unknowns > max_unknowns={limit}): the laws are sums "
                         f"of Grams of single tensors ({nw} unknowns), as every catalogue law is")
            within, nq = True, nw
        if max(nq, nl) > limit:
            if ansatz == "auto" and name == "dense":
                notes.append(f"dense cross-check skipped: {nq} quadratic unknowns > {limit}")
                continue
            _check_size(max(nq, nl), f"{name} ansatz ({'quadratic' if nq >= nl else 'linear'}"
                        f"{', single-tensor pairs' if within else ''})", limit, P, within)
        quad = _Quadratic(fibers, idxs, name == "structured", pb.P, within) if degree == 2 else None
        setups.append((name, fibers, fams, quad))
    # rows each consumer needs (quadratic: one per gradient; linear family of length L: L per gradient)
    need_q = {name: q.n + extra(q.n) for name, _, _, q in setups if q is not None}
    # linear rows are cheap (n fibers unknowns, not n^2): 4x more, so that a unit active on few samples
    # (ReLU) still spans its directions and gives no data-dependent "frozen" law
    need_l = {(name, k): 4 * (len(F.fibers) + extra(len(F.fibers))) for name, _, fams, _ in setups
              for k, F in enumerate(fams)}
    length = {(name, k): F.length for name, _, fams, _ in setups for k, F in enumerate(fams)}
    n_grad = max([*need_q.values(), *(math.ceil(v / length[key]) for key, v in need_l.items())])
    # gradients per random point: a point gives at most ~P independent rows, so a few per P/8 parameters
    k_per = max(1, min(pb.m, 16, max(2, P // 8)))
    if show:
        for name, _, _, q in setups:
            if q is not None:
                mb, fl = _estimate(q.n, need_q[name])
                print(f"discover: {name} quadratic ansatz: {q.n} unknowns ({q.removed} dependent removed), "
                      f"{need_q[name]} constraints; SVD ~{mb:.0f} MB, ~{fl:.1e} flop", file=sys.stderr)
        print(f"discover: {P} parameters, {n_grad} gradients at {math.ceil(n_grad / k_per)} random points",
              file=sys.stderr)
    t0 = time.perf_counter()
    Aq = {name: torch.empty(need_q[name], q.n, dtype=torch.float64) for name, _, _, q in setups if q is not None}
    fill_q = dict.fromkeys(Aq, 0)
    Al: dict[tuple, list[torch.Tensor]] = {key: [] for key in need_l}
    got_l = dict.fromkeys(need_l, 0)
    bar = _progress(n_grad, "discover: constraints", show)
    done = 0
    while done < n_grad:
        k = min(k_per, n_grad - done)
        theta, g = pb.gradients(k)
        for name, _, fams, q in setups:
            if q is not None and fill_q[name] < need_q[name]:
                take = min(k, need_q[name] - fill_q[name])
                Aq[name][fill_q[name] : fill_q[name] + take] = q.rows(theta, g[:take])
                fill_q[name] += take
            for kf, F in enumerate(fams):
                key = (name, kf)
                if got_l[key] < need_l[key]:
                    G = g[:, F.idx].permute(0, 2, 1).reshape(-1, len(F.fibers))
                    Al[key].append(G)
                    got_l[key] += G.shape[0]
        done += k
        if bar is not None:
            bar.update(k)
    if bar is not None:
        bar.close()
    t_rows = time.perf_counter() - t0
    solves: list[Solve] = []
    results = {}
    for name, fibers, fams, q in setups:
        t1 = time.perf_counter()
        lin_laws = []  # (family id, alpha over its fibers)
        unk = nrows = null_tot = 0
        gap_min, nxt, around_min, mb = math.inf, 1.0, [], 0.0
        for kf, F in enumerate(fams):
            A = torch.cat(Al[(name, kf)])
            mb += 8 * A.numel() / 2**20
            null, rank, gap, second, around = _nullspace(A)
            unk, nrows = unk + A.shape[1], nrows + A.shape[0]
            if null.shape[1]:
                null_tot += null.shape[1]
                if gap < gap_min:
                    gap_min, nxt, around_min = gap, second, around
                lin_laws += [(kf, row) for row in _rref(null.T)]
        solves.append(Solve(name, 1, unk, nrows, null_tot, gap_min, nxt, around_min,
                            time.perf_counter() - t1, mb))
        quad_rows = None
        if q is not None:
            t1 = time.perf_counter()
            null, rank, gap, second, around = _nullspace(Aq[name])
            quad_rows = [q.inflate(r) for r in _rref(null.T)]
            solves.append(Solve(name, 2, q.n, need_q[name], null.shape[1], gap, second, around,
                                time.perf_counter() - t1 + t_rows, _estimate(q.n, need_q[name])[0], q.removed))
        results[name] = (fibers, fams, lin_laws, q, quad_rows)
    return _assemble(pb, results, solves, notes, degree, count, count_limit, seed)


# ------------------------------------------------------------------------------------ interpretation
def _fiber_ref(pb: _Problem, f: Fiber, n: int = 1, step: int = 1) -> Ref | None:
    """A kernel ``Ref`` reading ``n`` fibers ``f.index, f.index + step, ...`` of one kind, one row each."""
    shape = pb.shapes[pb.names.index(f.param)]
    nd = len(shape)
    if f.kind == "scalar" or nd == 0:
        return None
    if f.kind == "row":
        lead = f.lead
        return Ref(f.param, lead + (f.index, 0), len(lead), n, len(lead) + 1, shape[-1], step)
    if f.kind == "col":
        lead = f.lead
        return Ref(f.param, lead + (0, f.index), len(lead) + 1, n, len(lead), shape[-2], step)
    if f.kind == "vector":
        return Ref(f.param, (0,), 0, 1, 0, shape[0]) if n == 1 else None
    if f.kind == "entry":
        if nd == 1:
            return Ref(f.param, (f.index,), 0, n, None, 1, step)
        if n != 1:
            return None
        return Ref(f.param, tuple(f.lead), 0, 1, None, 1)
    return None


def _law_class(kind: str, tag: str) -> type:
    key = (kind, tag)
    if key not in _CLASSES:
        attrs = {"family": f"discovered_{tag}", "source": "conserve.discover (numerical, float64)"}
        if kind == "gram":
            attrs.update(kind="gram", per="law")
        if kind == "linear":
            attrs.update(linear=True, per="law")
        _CLASSES[key] = type(f"Discovered_{kind}_{tag}", (Law,), attrs)
    return _CLASSES[key]


_CLASSES: dict[tuple[str, str], type] = {}
_TAGS = {"unit balance": "unit", "rotary pair": "rope_pair", "gain balance": "gain", "layer-scale balance": "layer_scale",
         "head Gram": "head_gram", "deep linear / VO Gram": "vo_gram", "row sum (router sum / translation)": "row_sum",
         "frozen": "frozen", "new": "new"}


def _classify_balance(fibs: list[Fiber], coefs: list[float]) -> str:
    if not all(abs(abs(c) - 1) < 1e-8 for c in coefs):
        return "new"
    plus = [f for f, c in zip(fibs, coefs) if c > 0]
    minus = [f for f, c in zip(fibs, coefs) if c < 0]
    for P_, M_ in ((plus, minus), (minus, plus)):
        rows_p = [f for f in P_ if f.kind == "row"]
        ents_p = [f for f in P_ if f.kind == "entry"]
        cols_m = [f for f in M_ if f.kind == "col"]
        rows_m = [f for f in M_ if f.kind == "row"]
        ents_m = [f for f in M_ if f.kind == "entry"]
        if (len(rows_p) == 1 and len(P_) == len(rows_p) + len(ents_p) and len(ents_p) <= 1 and cols_m
                and len(cols_m) == len(M_) and len({f.index for f in rows_p + ents_p}) == 1
                and len({f.index for f in cols_m}) == 1):
            return "unit balance"  # row u of the map in (+ its bias), column u' of the map out (fused: u' != u)
        if (ents_p and len(ents_p) == len(P_) and len({f.param for f in ents_p}) == len(ents_p) <= 2 and M_
                and all(f.kind == "col" for f in M_) and len({f.index for f in ents_p + M_}) == 1):
            return "gain balance"  # g_c^2 (+ beta_c^2) - sum_readers ||W[:,c]||^2
        if (len(ents_p) == 1 and len(P_) == 1 and rows_m and len(rows_m) + len(ents_m) == len(M_)
                and len({f.index for f in ents_p + rows_m + ents_m}) == 1):
            return "layer-scale balance"
        if (P_ and M_ and all(f.kind in ("row", "entry") for f in P_ + M_) and len({f.param for f in rows_p}) == 1
                and len({f.param for f in rows_m}) == 1 and rows_p and rows_m and rows_p[0].param != rows_m[0].param
                and len(rows_p) % 2 == 0 and len(rows_m) == 2):
            return "rotary pair"
    return "new"


def _assemble(pb: _Problem, results, solves, notes, degree, count, count_limit, seed) -> Discovery:
    laws: list[DiscoveredLaw] = []
    # ---- linear laws: structured vector laws first, then dense scalar laws where they add rank
    span = torch.zeros(pb.P, 0, dtype=torch.float64)
    lin_vectors = []  # (family, alpha): for the products of linear laws
    outside = 0
    for name in ("structured", "dense"):
        if name not in results:
            continue
        fibers, fams, lin_laws, _, _ = results[name]
        for kf, alpha in lin_laws:
            F = fams[kf]
            nz = alpha.nonzero().flatten().tolist()
            expanded = torch.zeros(pb.P, F.length, dtype=torch.float64)
            for a in nz:
                expanded[F.idx[a], torch.arange(F.length)] += alpha[a]
            new_span = torch.cat([span, expanded], dim=1)
            gain = _rank(new_span) - _rank(span)
            if gain <= 0:
                continue
            span = new_span
            lin_vectors.append((F, alpha))
            laws.append(_linear_law(pb, fibers, F, alpha, nz, gain, name))
            if name == "dense" and "structured" in results:
                outside += gain
    n_linear = _rank(span)
    # ---- quadratic laws, minus the products of linear laws (functional dependence read from values)
    products = quad_dim = 0
    if degree == 2:
        items = []
        for name in ("structured", "dense"):
            if name in results and results[name][3] is not None:
                q, rows_ = results[name][3], results[name][4]
                items += [(name, q, r) for r in rows_]
                if name == "structured" or "structured" not in results:
                    quad_dim = len(rows_)
        S = len(lin_vectors) * (len(lin_vectors) + 1) // 2 + len(items) + 16
        g = torch.Generator().manual_seed(seed + 99)
        pts = torch.randn(S, pb.P, generator=g, dtype=torch.float64)
        lv = [_linear_values_at(F, alpha, pts) for F, alpha in lin_vectors]  # (S, L) each
        prods = [(lv[i] * lv[j]).sum(1) for i in range(len(lv)) for j in range(i, len(lv))
                 if lv[i].shape[1] == lv[j].shape[1]]
        basis = torch.stack(prods, 1) if prods else torch.zeros(S, 0, dtype=torch.float64)
        brank = _rank(basis)
        kept: dict[str, list] = {"structured": [], "dense": []}
        vals = {name: results[name][3].values(pts) for name in results if results[name][3] is not None}
        for name, q, row in items:
            trial = torch.cat([basis, (vals[name] @ row)[:, None]], 1)
            r = _rank(trial)
            if r > brank:
                basis, brank = trial, r
                kept[name].append(row)
            elif name == "structured" or "structured" not in results:
                products += 1
        for name in ("structured", "dense"):
            if kept[name]:
                q = results[name][3]
                if name == "dense" and "structured" in results:
                    outside += len(kept[name])
                laws += _quadratic_laws(pb, q, torch.stack(kept[name]), name)
    counts: dict[str, int] = {}
    for d in laws:
        tag = _TAGS.get(d.match, "new")
        d.name = f"discover/{tag}/{counts.get(tag, 0)}"
        counts[tag] = counts.get(tag, 0) + 1
        if d.law is not None:
            d.law.name = d.name
        d.first_order = _first_order(pb, d, seed)
    indep = _independent(pb, laws)
    want = (pb.P <= count_limit) if count is None else count
    lc, dead = _count(pb, indep, seed, notes) if want else (None, [])
    bad = [d.name for d in laws if not d.ok]
    if bad:
        notes.append(f"first-order check above {TOL:g} for {bad}: the rank decision may be wrong (see the gaps)")
    return Discovery(laws, solves, pb.P, n_linear, quad_dim, products, outside, indep, lc, notes, dead)


def _linear_law(pb: _Problem, fibers, F: _Family, alpha, nz, gain: int, name: str) -> DiscoveredLaw:
    fibs = [fibers[F.fibers[a]] for a in nz]
    co = [float(alpha[a]) for a in nz]
    if co[0] < 0:
        co, alpha = [-c for c in co], -alpha
    match = "new"
    shape0 = pb.shapes[pb.names.index(fibs[0].param)]
    if len(fibs) == 1 and fibs[0].kind in ("entry", "vector", "scalar"):
        match = "frozen"
    elif (len({f.param for f in fibs}) == 1 and all(abs(c - co[0]) < 1e-8 for c in co)
          and ((all(f.kind == "row" for f in fibs) and len(shape0) == 2 and len(fibs) == shape0[0])
               or (all(f.kind == "entry" for f in fibs) and len(shape0) == 1 and len(fibs) == shape0[0]))):
        match = "row sum (router sum / translation)"  # sum of all rows of a weight / all entries of its bias
    refs = [_fiber_ref(pb, f) for f in fibs]
    law, why = None, ""
    if all(r is not None for r in refs):
        cls = _law_class("linear", _TAGS[match])
        law = cls("", None, [Term("sum", r, c) for r, c in zip(refs, co)], F.length, "found by conserve.discover")
    else:
        why = "reads a 0-dim parameter (store it as shape (1,) to track it)"
    return DiscoveredLaw("", "linear", match, [(c, f.label()) for c, f in zip(co, fibs)], law, independent=gain,
                         why_no_law=why, value=_linear_value(pb, F, alpha))


def _count(pb: _Problem, found: int, seed: int, notes: list[str]) -> tuple[LawCount, list[str]]:
    """``conserve.count`` at the block's parameters on a batch of at least ``4 P`` output rows (the example
    and redrawn batches). The count is a property of the data too: a ReLU unit active on too few samples of
    the batch adds frozen directions, "laws" of that batch only. So while the count exceeds the ``found``
    laws, it is redone on 4x more samples (up to twice); a count that drops was data-dependent and the
    lowest is kept (more data can only lower it), with a note. Parameters that get no gradient on the
    final batch are named in a note (dead units)."""
    draws = min(64, max(3, math.ceil(4 * pb.P / max(pb.m, 1))))
    block = _count_block(pb)
    inputs = pb.count_inputs(draws)
    # the sample size is handled here (redraws, the lowest count kept, a note), not by count_laws' check
    lc = count_laws(block, inputs, params=dict(pb.theta0), seed=seed, sample_check=False)
    redrawn = inputs is not pb.example
    history = [(_batch_rows(inputs), lc.count)]
    while redrawn and lc.count > found and len(history) < 3:
        draws *= 4
        inputs = pb.count_inputs(draws)
        more = count_laws(block, inputs, params=dict(pb.theta0), seed=seed, sample_check=False)
        history.append((_batch_rows(inputs), more.count))
        if more.count >= lc.count:
            break
        lc = more
    if len({c for _, c in history}) > 1:
        notes.append("conserve.count is data-dependent here: " + ", ".join(f"{c} laws on {n} samples" for n, c in history)
                     + f"; {lc.count} kept (more samples can only lower it: units active on few samples add "
                       "frozen directions)")
    dead = _dead_parameters(pb, inputs) if lc.count > found else []
    if lc.count > found and not redrawn:
        notes.append("the count used the example batch only (inputs not redrawn): a count above the laws "
                     "found may be laws of that batch only")
    return lc, dead


def _batch_rows(inputs) -> int:
    first = inputs[0] if isinstance(inputs, tuple) and inputs else inputs
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


def _dead_parameters(pb: _Problem, inputs) -> list[str]:
    """Entries of theta (at the block's parameters) whose gradient is zero for every output on ``inputs``."""
    theta = pb.flat(pb.theta0)
    out, pull = vjp(lambda t: pb.f(t, inputs), theta)
    r = torch.randn(min(out.numel(), 32), out.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = vmap(lambda v: pull(v)[0])(r).abs().amax(0)
    scale = float(g.max()) if g.numel() else 0.0
    names = []
    for n, off, size, shape in zip(pb.names, pb.offsets, pb.sizes, pb.shapes):
        for j in (g[off : off + size] <= 1e-12 * scale).nonzero().flatten().tolist():
            idx = list(_unravel(j, shape))
            names.append(f"{n}[{','.join(map(str, idx))}]" if shape else n)
    return names


def _unravel(j: int, shape) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(j % s)
        j //= s
    return tuple(reversed(out))


def _count_block(pb: _Problem):
    def block(params, *inputs):
        return pb.f(pb.flat(params), inputs)
    return block


def _rank(mat: torch.Tensor) -> int:
    if mat.numel() == 0 or mat.shape[1] == 0:
        return 0
    s = torch.linalg.svdvals(mat / mat.norm(dim=0).clamp_min(1e-300))
    return int((s > s[0] * 1e-9).sum())


def _linear_values_at(F: _Family, alpha: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    return torch.einsum("n,snl->sl", alpha, pts[:, F.idx])


def _linear_value(pb: _Problem, F: _Family, alpha: torch.Tensor):
    def h(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        theta = torch.cat([params[n].reshape(-1) for n in pb.names])
        return torch.einsum("n,nl->l", alpha, theta[F.idx])
    return h


def _quadratic_value(pb: _Problem, q: _Quadratic, row: torch.Tensor):
    def h(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        theta = torch.cat([params[n].reshape(-1) for n in pb.names])
        return q.values(theta[None])[0] @ row
    return h


def _quadratic_laws(pb: _Problem, q: _Quadratic, rows_: torch.Tensor, name: str) -> list[DiscoveredLaw]:
    """Interpret the echelon-form laws ``rows_`` (k, N_all).

    1. Gram blocks: fibers linked by the off-diagonal features ``<U_a, U_b>`` (a != b) of the laws form
       candidate groups; a group whose Gram law ``sum_c s_c X_c X_c^T`` (chunks of D fibers) lies entirely in
       the law space (modulo identically vanishing combinations) becomes one Gram law of D(D+1)/2 laws.
    2. The rest of the space: the echelon laws not spanned by the Gram laws found, each a balance law
       (squared norms only) or a general quadratic form ("new")."""
    fibers = q.fibers
    k = rows_.shape[0]
    parent = list(range(len(fibers)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    # link the fibers of the off-diagonal features of each law (diagonal-only laws link nothing: a
    # balance law such as tau^2 - sum ||K rows||^2 must not merge the heads' Gram blocks)
    offd = q.fa != q.fb
    linked: set[int] = set()
    for i in range(k):
        m = (rows_[i] != 0) & offd
        fs = sorted(set(q.fa[m].tolist()) | set(q.fb[m].tolist()))
        linked.update(fs)
        for a_ in fs[1:]:
            parent[find(a_)] = find(fs[0])
    groups: dict[int, set[int]] = {}
    for a_ in linked:
        groups.setdefault(find(a_), set()).add(a_)
    span = [rows_]
    for idx, t in q.trivial:
        v = torch.zeros(q.n_all, dtype=torch.float64)
        v[idx] = t
        span.append(v[None])
    Sm = torch.cat(span)
    Sm = Sm / Sm.norm(dim=1, keepdim=True)
    Uw, sw, _ = torch.linalg.svd(Sm.T, full_matrices=False)
    Qw = Uw[:, sw > 1e-9 * float(sw[0])]
    out: list[DiscoveredLaw] = []
    basis = _Basis(q.n_all)
    for idx, t in q.trivial:
        v = torch.zeros(q.n_all, dtype=torch.float64)
        v[idx] = t
        basis.add(v)
    combos: list[torch.Tensor] = []  # Gram entries found and the vanishing combinations
    for idx, t in q.trivial:
        v = torch.zeros(q.n_all, dtype=torch.float64)
        v[idx] = t
        combos.append(v)
    for root in sorted(groups, key=lambda r: min(groups[r])):
        found = _gram(pb, q, Qw, groups[root])
        if found is None:
            continue
        law, entries = found
        before = basis.rank
        for e in entries:
            basis.add(e)
        if basis.rank - before == law.independent:
            out.append(law)
            combos += entries
    if len(combos) > len(q.trivial):  # Gram laws found: echelon form again with their features last, so the
        gram_feats = torch.zeros(q.n_all, dtype=torch.bool)  # remaining laws pivot outside the Gram blocks
        for e in combos[len(q.trivial):]:
            gram_feats |= e != 0
        order = torch.cat([(~gram_feats).nonzero().flatten(), gram_feats.nonzero().flatten()])
        R2 = _rref(rows_[:, order])
        rows_ = torch.zeros_like(R2)
        rows_[:, order] = R2
        k = rows_.shape[0]
    rest = [rows_[i] for i in range(k) if basis.add(rows_[i])]
    if combos and rest:
        # the rest of the space modulo the Gram laws found: each law replaced by its least-L1 representative
        # modulo the Gram entries, the vanishing combinations and the other laws (sparsest first, twice)
        for _ in range(2):
            for i in sorted(range(len(rest)), key=lambda i: int((rest[i] != 0).sum())):
                rest[i] = _reduce_l1(rest[i], combos + rest[:i] + rest[i + 1:])
    if rest:
        # canonical basis of the rest: least L1 modulo the other laws has ties (laws with disjoint supports:
        # ||u0|| = ||(u0 - u2) / 2|| in L1), resolved differently by each solver (HiGHS vertex, IRLS midpoint);
        # the reduced row echelon form of the sparse representatives (columns in parameter order) is unique
        # and splits disjoint supports; then each law is made sparse modulo the combinations alone (no tie
        # between laws can arise there; only strict L1 improvements are taken)
        rest = list(_rref(torch.stack(rest)))
        if combos:
            rest = [_reduce_l1(r, combos) for r in rest]
    out += [_single(pb, q, r, name) for r in rest]
    return out


def _single(pb: _Problem, q: _Quadratic, row: torch.Tensor, name: str) -> DiscoveredLaw:
    nz = row.nonzero().flatten()
    if float(row[nz[0]]) < 0:  # sign convention: the first feature (parameter order) enters with +
        row = -row
    fa, fb = q.fa[nz].tolist(), q.fb[nz].tolist()
    co = [float(row[i]) for i in nz]
    fib = q.fibers
    if all(a == b for a, b in zip(fa, fb)):
        fibs = [fib[a] for a in fa]
        match = _classify_balance(fibs, co) if name == "structured" else "new"
        refs = [_fiber_ref(pb, f) for f in fibs]
        terms = [(c, f"||{f.label()}||^2") for c, f in zip(co, fibs)]
        law, why = None, ""
        if all(r is not None for r in refs):
            cls = _law_class("balance", _TAGS[match])
            law = cls("", None, [Term("norm", r, c) for r, c in zip(refs, co)], 1, "found by conserve.discover")
        else:
            why = "reads a 0-dim parameter (store it as shape (1,) to track it)"
        return DiscoveredLaw("", "balance", match, terms, law, why_no_law=why, value=_quadratic_value(pb, q, row))
    terms = [(c, f"<{fib[a].label()}, {fib[b].label()}>") for c, a, b in zip(co, fa, fb)]
    return DiscoveredLaw("", "quadratic", "new", terms, None,
                         why_no_law="a cross term <U_a, U_b> that is not part of a whole Gram block (the kernels' "
                                    "terms are squared norms and Gram blocks of strided views)",
                         value=_quadratic_value(pb, q, row))


def _gram(pb: _Problem, q: _Quadratic, Q: torch.Tensor, fset: set[int]):
    """Try to write the span of the laws ``R`` as the entries of ``sum_c s_c X_c X_c^T`` over chunks of D fibers."""
    fib = q.fibers
    by: dict[tuple, list[int]] = {}
    for a in sorted(fset):
        f = fib[a]
        by.setdefault((f.param, f.kind, f.lead), []).append(a)
    sizes = [len(v) for v in by.values()]
    D = min(sizes)
    k = D * (D + 1) // 2
    if D < 2 or any(s % D for s in sizes):
        return None
    chunks = []
    for key, ids in by.items():
        ids = sorted(ids, key=lambda a: fib[a].index)
        for c in range(len(ids) // D):
            chunks.append(ids[c * D : (c + 1) * D])
    feat = q.index
    # e_{tt'}(s) = sum_c s_c e[feature(chunk_c[t], chunk_c[t'])] must lie in span(R) (modulo the feature
    # combinations that vanish identically) for all t <= t'
    blocks = []
    for t in range(D):
        for u in range(t, D):
            cols = []
            for ch in chunks:
                a, b = sorted((ch[t], ch[u]))
                i = feat.get((a, b))
                if i is None:
                    return None
                e = torch.zeros(q.n_all, dtype=torch.float64)
                e[i] = 1.0
                cols.append(e - Q @ (Q.T @ e))
            blocks.append(torch.stack(cols, 1))
    Mx = torch.cat(blocks, 0)  # (T*N, chunks): Mx s = 0, s_0 = 1
    s = torch.zeros(len(chunks), dtype=torch.float64)
    s[0] = 1.0
    if len(chunks) > 1:
        sol = torch.linalg.lstsq(Mx[:, 1:], -Mx[:, 0:1]).solution.flatten()
        s[1:] = sol
    if float((Mx @ s).norm()) > 1e-8 * math.sqrt(len(chunks)) or (s.abs() < 1e-8).any():
        return None
    s = torch.where((s - s.round()).abs() < 1e-9, s.round(), s)
    refs, terms = [], []
    for ch, c in zip(chunks, s.tolist()):
        f0 = fib[ch[0]]
        steps = {fib[b].index - fib[a].index for a, b in zip(ch, ch[1:])}
        step = steps.pop() if len(steps) == 1 else None
        ref = _fiber_ref(pb, f0, D, step) if step is not None and step > 0 else None
        refs.append(ref)
        lo, hi = fib[ch[0]].index, fib[ch[-1]].index
        what = fib[ch[0]].label().replace(f"[{lo},:]", f"[{lo}:{hi + 1}:{step},:]" if step != 1 else f"[{lo}:{hi + 1},:]")
        what = what.replace(f"[:,{lo}]", f"[:,{lo}:{hi + 1}]" if step == 1 else f"[:,{lo}:{hi + 1}:{step}]")
        if fib[ch[0]].kind == "entry":
            what = f"{f0.param}[{lo}:{hi + 1}]"
        terms.append((c, what))
    kinds = {fib[ch[0]].kind for ch in chunks}
    plus = [fib[ch[0]] for ch, c in zip(chunks, s.tolist()) if c > 0]
    minus = [fib[ch[0]] for ch, c in zip(chunks, s.tolist()) if c < 0]
    signs_unit = all(abs(abs(c) - 1) < 1e-9 for c in s.tolist())
    if not signs_unit or kinds - {"row", "col", "entry"}:
        match = "new"
    elif any(f.kind == "col" for f in plus + minus):
        match = "deep linear / VO Gram"  # rows vs columns; columns vs columns: a weight stored transposed (embedding)
    elif {f.param for f in plus} & {f.param for f in minus}:
        match = "new"
    else:
        match = "head Gram"
    law, why = None, ""
    if all(r is not None for r in refs):
        cls = _law_class("gram", _TAGS[match])
        law = cls("", None, [Term("gram", r, c) for r, c in zip(refs, s.tolist())], D, "found by conserve.discover")
    else:
        why = "a block whose fibers are not evenly spaced (no strided view)"
    value = _gram_value(pb, q, chunks, s, feat)
    entries = []
    for t in range(D):
        for u in range(t, D):
            e = torch.zeros(q.n_all, dtype=torch.float64)
            for ch, c in zip(chunks, s.tolist()):
                e[feat[tuple(sorted((ch[t], ch[u])))]] += c
            entries.append(e)
    return DiscoveredLaw("", "gram", match, terms, law, independent=k, why_no_law=why, value=value), entries


def _gram_value(pb, q, chunks, s, feat):
    D = len(chunks[0])

    def h(params):
        theta = torch.cat([params[n].reshape(-1) for n in pb.names])
        vals = q.values(theta[None])[0]
        out = []
        for t in range(D):
            for u in range(D):
                a_b = [tuple(sorted((ch[t], ch[u]))) for ch in chunks]
                out.append(sum(c * vals[feat[ab]] for c, ab in zip(s.tolist(), a_b)))
        return torch.stack(out).reshape(D, D)
    return h


def _law_fn(pb: _Problem, d: DiscoveredLaw):
    if d.law is not None:
        law = d.law
        return lambda params: law_vector(law, params)
    return lambda params: d.value(params).reshape(-1)


def _first_order(pb: _Problem, d: DiscoveredLaw, seed: int, trials: int = 3) -> float:
    """Spec check 1 (``firstorder.violation``) at ``trials`` random points, inputs, ``s`` and ``r``."""
    g = torch.Generator().manual_seed(seed + 7)
    h = _law_fn(pb, d)
    worst = 0.0
    for _ in range(trials):
        theta = pb.sample_theta().requires_grad_(True)
        out = pb.f(theta, pb._inputs(g))
        b = gradients((torch.randn(out.shape, generator=g, dtype=torch.float64) * out).sum(), [theta])
        worst = max(worst, violation(h(pb.unflat(theta)), [theta], [b], g), 0.0)
    return worst


def _independent(pb: _Problem, laws: list[DiscoveredLaw]) -> int:
    """Functionally independent laws: rank of the gradients of all law components at a random point."""
    if not laws:
        return 0
    theta = pb.sample_theta().requires_grad_(True)
    params = pb.unflat(theta)
    grads = []
    for d in laws:
        hv = _law_fn(pb, d)(params)
        for i in range(hv.numel()):
            (gi,) = torch.autograd.grad(hv[i], theta, retain_graph=True, allow_unused=True)
            if gi is not None:
                grads.append(gi)
    if not grads:
        return 0
    G = torch.stack(grads, 1)
    return numerical_rank(G)[0]


# ------------------------------------------------------------------------------------------- JSON
def finite_json(x):
    """JSON-safe copy: non-finite floats become the strings "inf" / "-inf" / "nan" (strict JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x
