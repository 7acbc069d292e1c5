"""Count the independent conservation laws of a small block (spec check 4, "Counting").

Marcotte, Gribonval, Peyre (2023), "Abide by the law and follow the flow: conservation laws for
gradient flows", Thm. 3.3 / Prop. 4.2: for a model ``f(x; theta)``, the number of independent
functions of ``theta`` conserved by gradient flow for every dataset and every loss is, locally at a
generic ``theta``,

    #laws = #params - dim Lie(V)(theta),

where ``V`` is the linear space of vector fields ``V_{x,o}(theta) = grad_theta f_o(x; theta)`` (every
input ``x`` and output coordinate ``o``) and ``Lie(V)`` is the Lie algebra they generate under the
bracket ``[U, W](theta) = J_W(theta) U(theta) - J_U(theta) W(theta)``.

How the dimension is measured (all in float64):

- depth 1: the Jacobian of every output coordinate of the whole batch, one column per ``(x, o)``;
- depth k >= 2: random right-nested brackets ``[U_1, [U_2, ... [U_{k-1}, U_k]]]`` with
  ``U_i = grad_theta <a_i, f(theta)>`` for Gaussian ``a_i`` over all outputs of the batch. Right-nested
  brackets of generators span the algebra, and the bracket is multilinear, so random samples span
  (almost surely) the same subspace at ``theta`` as all brackets of that length; a depth takes
  ``#params - rank so far + margin`` samples, which is enough for the projection onto the part not yet
  spanned. The Jacobian of a field is applied with ``torch.func.jvp`` (for a gradient field that is a
  Hessian-vector product), nested once per level;
- each depth block is divided by the size of the terms it was computed from (depth 1: its largest
  column; depth k: the largest ``||J_W U|| + ||J_U W||``), so a bracket that vanishes analytically sits at
  rounding level (~1e-16) instead of being blown up by a per-column normalisation. A depth whose
  brackets all cancel to below ``sqrt(eps)`` of their terms is recorded as vanishing and ends the
  iteration (every deeper right-nested bracket is built on it);
- the rank is the position of the largest gap in ``log`` singular values of all blocks side by side,
  the smallest singular value being compared with the rounding floor ``eps * s_max * max(shape)``
  (the ``numpy.linalg.matrix_rank`` tolerance) so a full-rank matrix is recognised. No threshold is
  tuned: the gap ratio and the singular values around it are returned so a reader can judge.

Iteration stops when the rank has not grown at one depth >= 2 (``patience``), when it reaches
``#params`` or at ``depth``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from .analysis.firstorder import flat_output, to_float64

__all__ = ["LawCount", "count_laws", "lie_bracket", "numerical_rank", "gap_rank", "as_tuple", "block_function"]


@dataclass
class LawCount:
    """The result of :func:`count_laws`.

    Attributes:
        count: number of independent conservation laws, ``num_params - rank``.
        rank: ``dim Lie(V)(theta)`` as measured.
        num_params: number of scalar parameters the fields live on.
        singular_values: float64 tensor ``(min(num_params, columns),)``, descending, of the scaled
            field matrix (see the module docstring for the scaling).
        gap_ratio: ``s[rank-1] / s[rank]`` (``s[rank]`` is the rounding floor if ``rank == num_params``).
        second_gap_ratio: the largest ratio ``s[i] / s[i+1]`` at any other position: how clear the choice is.
        depth: deepest bracket length evaluated.
        ranks_by_depth: rank of the span of all fields up to each depth (index 0 is depth 1).
        fields_by_depth: number of sampled fields (columns) per depth.
        vanished_at: the depth whose brackets all cancelled (``None`` if none did).
        param_names: names of the parameters, in the order of ``theta``.
    """

    count: int
    rank: int
    num_params: int
    singular_values: torch.Tensor
    gap_ratio: float
    second_gap_ratio: float
    depth: int
    ranks_by_depth: list[int]
    fields_by_depth: list[int]
    vanished_at: int | None = None
    param_names: list[str] = field(default_factory=list)

    def around_gap(self, k: int = 3) -> list[float]:
        """The singular values ``s[rank-k : rank+k]`` (the ones that decide the rank)."""
        lo, hi = max(0, self.rank - k), min(len(self.singular_values), self.rank + k)
        return [float(v) for v in self.singular_values[lo:hi]]

    def summary(self) -> str:
        around = ", ".join(f"{v:.2e}" for v in self.around_gap())
        return (
            f"laws={self.count} (params={self.num_params}, rank={self.rank}); "
            f"gap s[r-1]/s[r]={self.gap_ratio:.2e} (next largest {self.second_gap_ratio:.2e}); "
            f"s around gap: [{around}]; ranks by depth {self.ranks_by_depth}; "
            f"fields by depth {self.fields_by_depth}"
            + (f"; brackets vanish at depth {self.vanished_at}" if self.vanished_at else "")
        )

    def __str__(self) -> str:  # pragma: no cover - formatting only
        return self.summary()


def numerical_rank(mat: torch.Tensor) -> tuple[int, torch.Tensor, float, float]:
    """Rank of ``mat`` at the largest gap of its log singular values.

    Args:
        mat: ``(n, m)`` float64 matrix.

    Returns:
        ``(rank, s, gap_ratio, second_gap_ratio)``: ``s`` the singular values (descending),
        ``gap_ratio = s[rank-1] / s[rank]`` with ``s[n_s]`` read as the rounding floor
        ``eps * s_max * max(n, m)``, and the largest ratio at any other position.
    """
    s = torch.linalg.svdvals(mat)
    r, gap_ratio, second = gap_rank(s, tuple(mat.shape))
    return r, s, gap_ratio, second


def gap_rank(s: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, float, float]:
    """The rule of :func:`numerical_rank` applied to given singular values ``s`` (descending) of a
    matrix of ``shape``: ``(rank, gap_ratio, second_gap_ratio)``."""
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0, math.inf, 1.0
    eps = torch.finfo(s.dtype).eps
    floor = float(s[0]) * eps * max(shape)
    ext = torch.cat([s, s.new_tensor([floor])]).clamp_min(floor)
    logs = ext.log()
    gaps = logs[:-1] - logs[1:]
    r = int(torch.argmax(gaps)) + 1
    gap_ratio = float(s[r - 1] / (s[r] if r < len(s) else floor))
    others = torch.cat([gaps[: r - 1], gaps[r:]])
    second = float(others.max().exp()) if others.numel() else 1.0
    return r, gap_ratio, second


def lie_bracket(
    u: Callable[[torch.Tensor], torch.Tensor],
    w: Callable[[torch.Tensor], torch.Tensor],
    theta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Lie bracket ``[U, W](theta) = J_W(theta) U(theta) - J_U(theta) W(theta)`` of two vector fields.

    Args:
        u, w: vector fields ``R^P -> R^P`` written with ``torch.func``-traceable ops.
        theta: ``(P,)`` point (float64 recommended).

    Returns:
        ``(bracket, scale)``: the ``(P,)`` bracket and ``||J_W U|| + ||J_U W||``, the size of the two
        terms it is the difference of (its rounding error is ~eps times ``scale``). For gradient fields
        ``U = grad phi`` the Jacobian products are Hessian-vector products. Two forward-mode ``jvp``.
    """
    uu = u(theta)
    with warnings.catch_warnings():  # torch's forward-mode decompositions are built with torch.jit.script
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        ww, jw_u = jvp(w, (theta,), (uu,))
        _, ju_w = jvp(u, (theta,), (ww,))
    return jw_u - ju_w, jw_u.norm() + ju_w.norm()


def as_tuple(inputs: Any) -> tuple:
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    return (inputs,)


def block_function(block, params) -> tuple[Callable[[dict, tuple], Any], dict[str, torch.Tensor]]:
    """Return ``call(param_dict, inputs)`` and the float64 parameters to differentiate."""
    if isinstance(block, nn.Module):
        module = block
        named = dict(module.named_parameters())
        if params is None:
            chosen = [n for n, p in named.items() if p.requires_grad]
        elif isinstance(params, Mapping):
            raise TypeError(
                "count_laws: for an nn.Module pass params as an iterable of parameter names "
                "(or None for all), not a mapping"
            )
        else:
            chosen = list(params)
            missing = [n for n in chosen if n not in named]
            if missing:
                raise ValueError(
                    f"count_laws: {missing} are not parameters of the block; choose from {list(named)}"
                )
        theta = {n: named[n].detach().to(torch.float64) for n in chosen}
        fixed = {n: to_float64(p) for n, p in named.items() if n not in theta}
        fixed.update({n: to_float64(b) for n, b in module.named_buffers()})

        def call(p: dict, inputs: tuple) -> Any:
            return functional_call(module, {**fixed, **p}, inputs)

        return call, theta
    if callable(block):
        if not isinstance(params, Mapping) or not params:
            raise TypeError(
                "count_laws: a plain callable needs params={name: tensor}; it is called as "
                "block(params, *inputs)"
            )
        theta = {n: to_float64(torch.as_tensor(p)) for n, p in params.items()}

        def call(p: dict, inputs: tuple) -> Any:
            return block(p, *inputs)

        return call, theta
    raise TypeError(f"count_laws: block must be an nn.Module or a callable, got {type(block).__name__}")


def count_laws(
    block: nn.Module | Callable,
    inputs: Any,
    *,
    params: Iterable[str] | Mapping[str, torch.Tensor] | None = None,
    depth: int = 4,
    seed: int = 0,
    patience: int = 1,
    margin: int = 8,
    chunk_size: int | None = 64,
    sample_check: bool = True,
) -> LawCount:
    """Number of independent conservation laws of ``block`` at its current parameters.

    Spec: /work/shared/spec/laws.md, check 4 (Marcotte, Gribonval, Peyre 2023). The count is
    ``#params - dim Lie(V)(theta)``; see the module docstring for the algorithm and the rank rule.

    Args:
        block: an ``nn.Module`` (called as ``block(*inputs)``, parameters read from it) or a callable
            ``block(params, *inputs)``. Must treat the batch rows independently (no batch norm) and be
            differentiable twice by ``torch.func`` (forward-over-reverse, nested ``depth - 1`` times).
        inputs: a tensor or a tuple of tensors, the batch. Floating tensors are cast to float64. Use
            more samples than the parameters need, so the depth-1 span is generic.
        params: for a module, the names of the parameters to count over (default: all that require
            grad; the others are held fixed); for a callable, a ``{name: tensor}`` dict (required).
            Evaluate at a random ``theta``: a structured one (zeros, identity) may be non-generic.
        depth: the longest bracket to evaluate (>= 1).
        seed: seeds the random bracket coefficients (a private generator; global RNG untouched).
        patience: stop after this many consecutive depths (>= 2) that did not raise the rank.
        margin: extra samples per depth beyond ``#params - rank so far``.
        chunk_size: ``vmap`` chunk over bracket samples (memory bound); ``None`` for one chunk.
        sample_check: check that the batch is large enough: the rank is recomputed on each half of
            the batch (rows ``0::2`` and ``1::2`` of every input whose first dimension is the batch's)
            and must already equal the rank on the whole batch, i.e. the rank is stable when the
            sample doubles. Too few samples make the rank deficient (a ReLU unit active on few rows
            leaves directions no field reaches) and the count too high, without any other sign.
            ``False`` counts the laws of this batch only (e.g. a data-dependent count on purpose).

    Returns:
        a :class:`LawCount` (count, rank, singular values, gap ratio, depth reached, ...).

    Raises:
        TypeError: bad block / params / output types (the message names the fix).
        ValueError: unknown parameter names, no parameters, ``depth < 1``, an output that does not
            depend on the parameters at all; with ``sample_check``, a batch of fewer than 2 rows or a
            rank that is lower on a half of the batch (the message names the fix: more input rows).
    """
    res = _count(block, inputs, params, depth, seed, patience, margin, chunk_size)
    if not sample_check:
        return res
    tensors = [x for x in as_tuple(inputs) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    rows = int(tensors[0].shape[0]) if tensors else 0
    if rows < 2:
        raise ValueError(
            f"count_laws: cannot check the sample size on a batch of {rows} row(s) (inputs' first "
            "dimension is the batch); pass more input rows, or sample_check=False to count this batch's laws"
        )

    def half(start: int) -> tuple:
        return tuple(
            x[start::2] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == rows else x
            for x in as_tuple(inputs)
        )

    halves = [_count(block, half(i), params, depth, seed, patience, margin, chunk_size).rank for i in (0, 1)]
    if any(r != res.rank for r in halves):
        raise ValueError(
            f"count_laws: the rank is not stable in the sample size (rank {res.rank} on {rows} input rows, "
            f"{halves[0]} and {halves[1]} on each half), so the count {res.count} may hold laws of this batch "
            f"only; pass more input rows (e.g. {4 * rows}), or sample_check=False to count this batch's laws"
        )
    return res


def _count(block, inputs, params, depth, seed, patience, margin, chunk_size) -> LawCount:
    """:func:`count_laws` on one batch, without the sample-size check."""
    if depth < 1:
        raise ValueError(f"count_laws: depth must be >= 1, got {depth}")
    call, theta_dict = block_function(block, params)
    if not theta_dict:
        raise ValueError("count_laws: no parameters to count over; pass params or unfreeze some")
    names = list(theta_dict)
    shapes = [theta_dict[n].shape for n in names]
    sizes = [theta_dict[n].numel() for n in names]
    theta0 = torch.cat([theta_dict[n].reshape(-1) for n in names])
    P = theta0.numel()
    inputs = tuple(to_float64(x) for x in as_tuple(inputs))

    def f(theta: torch.Tensor) -> torch.Tensor:
        parts = torch.split(theta, sizes)
        p = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes)}
        try:
            return flat_output(call(p, inputs))
        except TypeError as e:
            raise TypeError(f"count_laws: {e}") from None

    # depth 1: the Jacobian, one column per output coordinate of the batch
    with torch.no_grad():
        m = f(theta0).numel()
    jac = torch.func.jacrev(f)(theta0)  # (m, P)
    if not torch.isfinite(jac).all():
        raise ValueError("count_laws: the Jacobian has NaN/Inf; check the block and the inputs")
    scale1 = jac.norm(dim=1).max()
    if float(scale1) == 0.0:
        raise ValueError("count_laws: the outputs do not depend on the parameters (zero Jacobian)")
    blocks = [(jac / scale1).T]  # (P, m)

    def phi(a: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        return f(theta) @ a

    gen = grad(phi, argnums=1)

    def nested(A: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        # A: (k, m) coefficients; returns [U_1, [U_2, ... U_k]](theta)
        if A.shape[0] == 1:
            return gen(A[0], theta)
        return _bracket(A, theta)[0]

    def _bracket(A: torch.Tensor, theta: torch.Tensor):
        a0, rest = A[0], A[1:]
        return lie_bracket(lambda t: gen(a0, t), lambda t: nested(rest, t), theta)

    g = torch.Generator().manual_seed(seed)
    rank, s, gap, second = numerical_rank(torch.cat(blocks, dim=1))
    ranks = [rank]
    nfields = [m]
    vanished = None
    stall = 0
    k = 1
    while k < depth and rank < P:
        k += 1
        n = P - rank + margin
        A = torch.randn(n, k, m, generator=g, dtype=torch.float64)
        vals, scales = vmap(lambda a: _bracket(a, theta0), chunk_size=chunk_size)(A)
        if not torch.isfinite(vals).all():
            raise ValueError(f"count_laws: brackets of depth {k} have NaN/Inf; check the block")
        top = float(scales.max())
        if top == 0.0 or float(vals.norm(dim=1).max()) <= math.sqrt(torch.finfo(torch.float64).eps) * top:
            vanished = k
            ranks.append(rank)
            nfields.append(n)
            break
        blocks.append((vals / top).T)
        new_rank, s, gap, second = numerical_rank(torch.cat(blocks, dim=1))
        ranks.append(new_rank)
        nfields.append(n)
        stall = stall + 1 if new_rank <= rank else 0
        rank = max(rank, new_rank)
        if stall >= patience:
            break
    rank, s, gap, second = numerical_rank(torch.cat(blocks, dim=1))
    return LawCount(
        count=P - rank,
        rank=rank,
        num_params=P,
        singular_values=s,
        gap_ratio=gap,
        second_gap_ratio=second,
        depth=k,
        ranks_by_depth=ranks,
        fields_by_depth=nfields,
        vanished_at=vanished,
        param_names=names,
    )
