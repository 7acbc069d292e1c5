"""Gradient integrity: a law's first-order product with a gradient (spec "Gradient integrity").

For an exact law ``h`` of the architecture and a gradient ``g`` of any loss that depends on the weights
only through the model's output (for translation laws: through softmax cross-entropy), the first-order
product ``<grad h(theta), g>`` vanishes at the same ``theta``: per sample, hence for batch sums, rank
averages, one global scale (norm clipping, a loss scale), dropout masks.  A gradient with a product
above rounding was not produced that way: a wrong custom backward, a partial or wrongly scaled
all-reduce, a hook that rescales part of a law's parameters, weight decay folded into ``p.grad`` --
or a method that changes the gradient on purpose (``KNOWN_METHODS``: SAM, DP-SGD, ``clip_grad_value_``,
compression, straight-through estimators, stale gradients, a loss on hidden activations, router
z-loss, a logit soft-cap for a translation law).

The statistic, per law entry ``i`` (a unit, a rotary pair, a gain feature, a router column, one entry
``(a, b)`` of a Gram law)::

    r_i = |p_i| / (||grad h_i|| * ||g_i||),   p_i = <grad h_i, g>           (in [0, 1] by Cauchy-Schwarz)

with ``g_i`` the gradient restricted to the parameter elements ``h_i`` reads (measured against the
law's typical entry when it is smaller: ``GradPlan.finish``).  Per term of the catalogue (the terms of
one law read disjoint blocks):

* norm term ``s * sum_c (x_rc + shift)^2`` (row r): ``p = 2 s sum_c (x_rc + shift) g_rc``,
  ``||grad||^2 = 4 s^2 sum_c (x_rc + shift)^2``, ``||g_i||^2 = sum_c g_rc^2``;
* sum term ``s * sum_r x_rc`` (column c): ``p = s sum_r g_rc`` (``c^T g``), ``||grad||^2 = s^2 * rows``,
  ``||g_i||^2 = sum_r g_rc^2``;
* Gram term ``s X X^T``, entry (a, b): ``p = s (x_a . g_b + g_a . x_b)``; ``||grad||^2`` is
  ``s^2 (||x_a||^2 + ||x_b||^2)`` off the diagonal and ``4 s^2 ||x_a||^2`` on it; ``||g_i||^2`` is
  ``||g_a||^2 + ||g_b||^2`` off the diagonal and ``||g_a||^2`` on it.

Evaluation (``GradPlan``): ``conserve.kernels.check_sums`` of the law plan gives, per law entry, the
products (``2 B(theta, g)`` for the quadratic terms, the shift part of a Gemma gain, the linear laws'
``c^T g``) and the row norms of the weights and gradients each entry reads.  On the GPU (Triton) that is
ONE pass that reads every term's view of the weights and of the gradients once (the CHECK modes of the
Gram and row/column kernels): one extra read of what the laws read, per checked step.  The CPU twin
composes the bilinear form and an evaluation of a derived plan of row norms, reading them twice
(``bench/gradcheck_cost.py`` counts both and times the check beside a training step).

Per law and per family: ``worst`` (the largest ``r_i``) and ``aggregate = |sum p_i| / sqrt(sum n_i^2)``
over the entries and over every checked step (``GradCheck.update``), ``n_i = ||grad h_i|| ||g_i||``.
Rounding of random sign adds up like ``sqrt(n)`` terms and the aggregate stays near the per-entry
rounding level, while a fault that moves the products the same way (weight decay folded in, a scale
on one side of a law while the weights grow) adds up like ``n`` terms: the aggregate lifts a small
consistent fault above the floor, by ``sqrt(entries x steps)``.  A fault of random sign is seen by
``worst`` only.

Floors (``floor``, ``aggregate_floor``; derivation and measured values in the spec and the README,
``python -m bench.gradcheck_cost --floors``): ``max(a u, b u_32)`` with ``u`` the unit roundoff of the dtype
the gradient was computed in (``conserve.analysis.floor.unit_roundoff``) and ``(a, b)`` per statistic and
law kind (``FLOOR_FACTORS``): a half-precision gradient's error is dominated by the rounding of its
elements and activations to that format (under one ``u`` per entry measured), a float32 gradient's by
float32 sums over the tokens (about one ``u_32`` measured; the factor 16 leaves room for longer sums);
a linear law's product cancels by construction, so its floors are 4x the quadratic laws'.  A float64
gradient is held to the float32 floors, because model code commonly computes norms and softmax in
float32 inside a float64 model.

Not checked: the approximate scale laws (``qk_scale``, ``norm_scale``: exact only for eps = 0 norms),
and a loss-dependent law (translation) unless that loss was named (``loss="ce"``).
Blind spots: faults that keep every law's block an exact vector-Jacobian product (labels, masks or
positions wrong in forward and backward alike, a hook at a module boundary, a norm's input gradient,
the gate of a SwiGLU unit, embeddings and tied heads: no law reads them), and a gradient of the wrong
loss of the right architecture.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..kernels.checksums import row_plan
from ..laws import Law, compile_laws
from .floor import relative_floor, unit_roundoff

__all__ = ["FLOOR_FACTORS", "APPROXIMATE", "LOSS_ONLY", "KNOWN_METHODS", "floor", "aggregate_floor",
           "select", "GradPlan", "Raw", "Products", "products", "GradCheck", "LawCheck", "GradientCheck",
           "law_products", "check_gradients"]

#: ``(a, b)`` per statistic and law kind: the floor is ``max(a u, b u_32)`` for a gradient computed in a dtype
#: of unit roundoff ``u`` (``u_32``: float32's).  A linear law (router sum, translation) sums gradient parts
#: that cancel by construction (a router's softmax gradient sums to zero over the experts), so its rounding
#: is several times a quadratic law's (measured: spec "Gradient integrity", README)
FLOOR_FACTORS = {("worst", False): (2.0, 16.0), ("aggregate", False): (1.0, 8.0),
                 ("worst", True): (8.0, 64.0), ("aggregate", True): (4.0, 32.0)}
#: families whose law holds only approximately (eps > 0 norms): never checked
APPROXIMATE = {"qk_scale": "approximate law (exact only for eps = 0 norms)",
               "norm_scale": "approximate law (exact only for eps = 0 norms)"}
#: families that hold for one loss only: checked only when that loss is named
LOSS_ONLY = {"translation": "ce"}
#: the two readings of a flag: ``bug`` and the methods that change the gradient on purpose
KNOWN_METHODS = ("SAM (gradient at a perturbed point)", "DP-SGD (noise, per-sample clipping)",
                 "per-layer or per-value clipping (clip_grad_value_)", "gradient compression",
                 "straight-through estimators", "stale or asynchronous gradients",
                 "a loss on hidden activations a law's symmetry changes (a norm's output, an MLP's inner units) "
                 "or on router logits (router z-loss)",
                 "a logit soft-cap or z-loss (translation law)")
BUG = "a bug in the gradient (a custom backward or fused kernel, an all-reduce, a hook, decay folded into p.grad)"


def _floor(dtype, which: str, linear: bool) -> float:
    return relative_floor(dtype, *FLOOR_FACTORS[(which, bool(linear))])


def floor(dtype, linear: bool = False) -> float:
    """The floor of the per-entry statistic ``worst`` for a gradient computed in ``dtype`` (``FLOOR_FACTORS``):
    quadratic laws ``max(2 u, 16 u_32)``: 9.5e-7 for float32 and float64, 9.8e-4 for float16, 7.8e-3 for
    bfloat16; linear laws (``linear=True``) ``max(8 u, 64 u_32)``: 3.8e-6, 3.9e-3, 3.1e-2.  ``dtype``: a name,
    a ``torch.dtype`` or a unit roundoff (``conserve.analysis.floor.unit_roundoff``)."""
    return _floor(dtype, "worst", linear)


def aggregate_floor(dtype, linear: bool = False) -> float:
    """The floor of ``aggregate`` (a signed sum over entries and steps): quadratic laws ``max(u, 8 u_32)``:
    4.8e-7 for float32, 4.9e-4 for float16, 3.9e-3 for bfloat16; linear laws ``max(4 u, 32 u_32)``: 1.9e-6,
    2.0e-3, 1.6e-2.  Rounding of random sign keeps the aggregate near the per-entry rounding level (not its
    maximum over the entries), so its floor is lower than ``floor``."""
    return _floor(dtype, "aggregate", linear)


def half_precision_hint(res: "GradientCheck", flagged: Sequence["LawCheck"]) -> str:
    """A sentence for a check judged at float32 / float64 floors whose flagged laws all sit within bfloat16's
    floors (the rounding of a gradient computed under half-precision autocast, whose ``.grad`` are float32),
    else ""."""
    if not flagged or res.dtype not in ("float32", "float64"):
        return ""
    widen = floor(torch.bfloat16) / floor(torch.float32)
    if any(c.worst > c.floor * widen for c in flagged):
        return ""
    return (" Every flagged law is within bfloat16's rounding floor: if the gradient is computed under bf16 / fp16 "
            "autocast, pass grad_dtype='bfloat16' / 'float16' (check_gradients: dtype=) so the floors follow the "
            "precision it was computed in.")


def _dtype_name(dtype) -> str:
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        return f"u={float(dtype):.2g}"
    return str(dtype).rsplit(".", 1)[-1]


def ignored_by(law: Law, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` that names ``law`` (its name, its family, or an ``fnmatch`` pattern of its name or
    of a parameter it reads), else None."""
    for pat in patterns:
        if pat in (law.name, law.family) or any(fnmatch.fnmatchcase(p, pat) for p in law.params) \
                or fnmatch.fnmatchcase(law.name, pat):
            return pat
    return None


def select(laws, *, loss: str | None = None, ignore: Iterable[str] = ()) -> tuple[list[Law], list[tuple[str, str]]]:
    """``(checked, skipped)``: the laws the check reads and ``(name, reason)`` for the others: the
    approximate families (``APPROXIMATE``), a loss-dependent law whose loss was not named (``LOSS_ONLY``:
    translation needs ``loss="ce"``), and the laws ``ignore`` matches (law names, families or ``fnmatch``
    patterns of law or parameter names).  ``laws``: a ``Detection`` or an iterable of ``Law``."""
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    checked, skipped = [], []
    for law in getattr(laws, "laws", laws):
        if law.family in APPROXIMATE:
            skipped.append((law.name, APPROXIMATE[law.family]))
        elif law.family in LOSS_ONLY and loss != LOSS_ONLY[law.family]:
            skipped.append((law.name, f"holds for loss={LOSS_ONLY[law.family]!r} only: pass "
                                      f"loss={LOSS_ONLY[law.family]!r} if that is the loss"))
        elif (pat := ignored_by(law, ignore)) is not None:
            skipped.append((law.name, f"ignored ({pat!r})"))
        else:
            checked.append(law)
    return checked, skipped


def zero_if_none(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, or zeros like ``param`` when it is None and ``param`` requires grad: a trainable parameter
    backward did not reach (an expert no token was routed to) has a zero gradient, and the optimizer leaves it
    unchanged.  A frozen parameter's None stays None (its gradient is unknown, not zero)."""
    return torch.zeros_like(param) if param.grad is None and param.requires_grad else param.grad


# ------------------------------------------------------------------------------------------ products
@dataclass
class Raw:
    """The additive per-entry sums of one gradient (``GradPlan.raw``), float64 or float32 on the tensors'
    device: every field is a sum over parameter elements, so the raw sums of disjoint shards of the same
    weights and gradients add up to the whole tensors' (an all-reduce SUM of each field, then
    ``GradPlan.finish``).

    Attributes:
        p: ``(entries,)`` the products ``<grad h_i, g>``.
        nh2: ``(entries,)`` ``||grad h_i||^2`` of the quadratic terms (a linear law's, ``s^2`` times its rows, is
            a constant that ``GradPlan.finish`` adds).
        ng2: ``(entries,)`` ``||g_i||^2``.
        law_g2: ``(laws,)`` ``||g||^2`` over every element each law reads.
    """

    p: torch.Tensor
    nh2: torch.Tensor
    ng2: torch.Tensor
    law_g2: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        """The fields, for a collective (``torch.distributed.all_reduce`` of each, in place)."""
        return [self.p, self.nh2, self.ng2, self.law_g2]


@dataclass
class Products:
    """Per entry of a ``GradPlan`` (flat layout: the law plan's vec entries, then each Gram size's
    ``slots x D x D`` entries, row-major): ``p`` the products ``<grad h_i, g>``, ``nh`` ``||grad h_i||``,
    ``ng`` ``||g_i||`` (raised to the law's typical entry, ``GradPlan.finish``).  Float64 (float32 when the
    plan was evaluated with ``fp64=False``), on the tensors' device.  ``plan``: the ``GradPlan``."""

    p: torch.Tensor
    nh: torch.Tensor
    ng: torch.Tensor
    plan: "GradPlan"

    def ratio(self) -> torch.Tensor:
        """``(entries,)`` ``r_i = |p_i| / (nh_i ng_i)`` (0 where the norms are 0)."""
        n = self.nh * self.ng
        return torch.where(n > 0, self.p.abs() / n.clamp_min(torch.finfo(n.dtype).tiny), torch.zeros_like(n))

    def law(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(p, nh, ng)`` of one law: a vector of its ``size`` entries, or ``D x D`` for a Gram law (views)."""
        k = self.plan.index[name]
        a, n = int(self.plan.starts[k]), int(self.plan.lengths[k])
        law = self.plan.laws[k]
        shape = (law.size, law.size) if law.kind == "gram" else (law.size,)
        return tuple(t[a:a + n].view(shape) for t in (self.p, self.nh, self.ng))

    def by_law(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``{law name: (p, nh, ng)}`` for every law of the plan (``law``)."""
        return {law.name: self.law(law.name) for law in self.plan.laws}


class GradPlan:
    """The laws' gradient check compiled once for a set of laws and parameter shapes: the law plan, whose
    ``conserve.kernels.check_sums`` gives every entry's product and norms, and the per-entry bookkeeping
    (elements read, the linear laws' constant ``||grad h||``).

    Args:
        laws: the laws to check, as given (filter them with ``select``): a ``Detection`` or ``Law`` list.
        shapes: ``{parameter name: shape}`` or ``{name: tensor}`` (every parameter the laws read).

    Attributes:
        laws: the laws, in the order of every per-law vector; names: the parameters they read (the order of
            tensor sequences); entries: the number of law entries (``Products``' length); starts, lengths:
            each law's range in the flat entry layout; compiled: the law plan (``conserve.laws.Compiled``).

    Raises:
        ValueError: a law reads a parameter ``shapes`` lacks or a block outside it, two laws share a name,
            or a term layout the check cannot read (a column sum over rows stepping by more than one).
    """

    def __init__(self, laws, shapes: Mapping[str, Sequence[int] | torch.Tensor]):
        self.laws: list[Law] = list(getattr(laws, "laws", laws))
        shapes = {n: tuple(s.shape) if isinstance(s, torch.Tensor) else tuple(s) for n, s in shapes.items()}
        self.compiled = c = compile_laws(self.laws, shapes)
        self.names: list[str] = c.names
        self.index = {law.name: k for k, law in enumerate(self.laws)}
        plan, V = c.plan, c.plan.vec_size
        # the torch twin's derived plans (raises for a layout the check cannot read, on every backend)
        self.derived = row_plan(plan, len(c.names))
        self.dsizes = sorted(plan.gram_slots)
        self.grow = self.derived.grow  # D -> first row of its slots in the Gram-row layout
        R = self.rows = self.derived.gram_rows
        m_vec = np.zeros(V)  # elements each vec entry reads
        nh2_sum = np.zeros(V)  # ||grad h||^2 of the linear entries (constants)
        m_row = np.zeros(R)
        for t in plan.norms:
            np.add.at(m_vec, t.index + t.index_stride * np.arange(t.view.rows), t.view.cols)
        for t in plan.sums:
            v = t.view
            np.add.at(nh2_sum, t.index + np.arange(v.cols), t.sign ** 2 * v.rows)
            np.add.at(m_vec, t.index + np.arange(v.cols), v.rows)
        for t in plan.grams:
            r0 = self.grow[t.view.rows] + t.slot * t.view.rows
            m_row[r0: r0 + t.view.rows] += t.view.cols
        self.vec_size = V
        # flat entry layout and the laws' ranges in it
        self.gram_entry = {}
        E = V
        for d in self.dsizes:
            self.gram_entry[d] = E
            E += plan.gram_slots[d] * d * d
        self.entries = E
        starts, lengths = np.zeros(len(self.laws), dtype=np.int64), np.zeros(len(self.laws), dtype=np.int64)
        law_rows = []  # per law: (first, count) of its rows in the row-unit layout (vec entries, then Gram rows)
        for k, (kind, a, b) in enumerate(c.where):
            if kind == "vec":
                starts[k], lengths[k] = a, b
                law_rows.append((a, b))
            else:
                starts[k], lengths[k] = self.gram_entry[a] + b * a * a, a * a
                law_rows.append((V + self.grow[a] + b * a, a))
        self.starts, self.lengths = starts, lengths
        # the laws in flat order (segment reductions) and the per-law sums of the row units
        self.order = np.argsort(starts, kind="stable")
        self.sorted_lengths = torch.as_tensor(lengths[self.order])
        unit_law = np.zeros(V + R, dtype=np.int64)
        for k, (a, n) in enumerate(law_rows):
            unit_law[a: a + n] = k
        self._unit_law = torch.as_tensor(unit_law)
        m_units = np.concatenate([m_vec, m_row])
        law_m = np.bincount(unit_law, weights=m_units, minlength=len(self.laws)) if len(unit_law) \
            else np.zeros(len(self.laws))
        self._host = dict(m_vec=m_vec, nh2_sum=nh2_sum, m_row=m_row, law_m=law_m)
        self._dev: dict = {}

    def _on(self, device) -> dict:
        """The plan's constant tensors on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._dev:
            h = self._host
            f = lambda a: torch.as_tensor(a, dtype=torch.float64, device=device)  # noqa: E731
            on = self._dev[key] = dict(m_vec=f(h["m_vec"]), nh2_sum=f(h["nh2_sum"]), m_row=f(h["m_row"]),
                                       law_m=f(h["law_m"]), unit_law=self._unit_law.to(device),
                                       lengths=self.sorted_lengths.to(device),
                                       order=torch.as_tensor(self.order, device=device))
            ms = [on["m_vec"]]  # elements each entry reads
            for d in self.dsizes:
                r0, n = self.grow[d], self.compiled.plan.gram_slots[d]
                ma = on["m_row"][r0:r0 + n * d].view(n, d)
                eye = torch.eye(d, dtype=torch.bool, device=device)
                ms.append(torch.where(eye, ma[:, :, None].expand(n, d, d), ma[:, :, None] + ma[:, None, :]).reshape(-1))
            on["m_entry"] = torch.cat(ms)
        return self._dev[key]

    def _tensors(self, params, grads):
        if not isinstance(params, Mapping):
            params = dict(zip(self.names, params))
        if not isinstance(grads, Mapping):
            grads = dict(zip(self.names, grads))
        missing = [n for n in self.names if n not in params or n not in grads or grads[n] is None]
        if missing:
            laws = sorted({law.name for law in self.laws for n in missing if n in law.params})
            more = lambda xs: f" and {len(xs) - 3} more" if len(xs) > 3 else ""  # noqa: E731
            raise ValueError(f"no tensor or no gradient for {', '.join(missing[:3])}{more(missing)} (read by "
                             f"{', '.join(laws[:3])}{more(laws)}): check the gradients after backward() has reached "
                             f"them, or leave those laws out (ignore=[...])")
        xs, gs = [], []
        for n in self.names:
            x, g = params[n].detach(), grads[n].detach()
            if hasattr(x, "full_tensor"):  # a DTensor (FSDP2, tensor parallel): the whole tensor (a collective)
                x = x.full_tensor()
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            if tuple(x.shape) != tuple(g.shape):
                raise ValueError(f"{n}: the gradient has shape {tuple(g.shape)} but the parameter {tuple(x.shape)}")
            xs.append(x)
            gs.append(g if g.device == x.device else g.to(x.device))
        return xs, gs

    def raw(self, params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
            grads: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *, fp64: bool = True,
            backend: str = "auto") -> Raw:
        """The additive per-entry sums (``Raw``) of ``grads`` at ``params``: ``kernels.check_sums`` of the law
        plan (Triton: one pass over the weights and gradients).

        Args:
            params, grads: ``{parameter name: tensor}`` for every parameter the laws read (more are
                ignored), or sequences of tensors in ``names`` order; equal shapes; any float dtype (read
                as is, accumulated in float64 when ``fp64``, else float32); the gradients are moved to
                their parameter's device if elsewhere.  A
                ``DTensor`` (FSDP2's sharded parameters and gradients) is gathered whole with
                ``full_tensor()``, a collective every rank must reach; to check shards in place, sum the
                ``Raw`` of each rank's local shards instead (``Raw``).
            backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"`` (``conserve.kernels``).

        Raises:
            ValueError: a parameter or gradient missing (naming the laws that read it), or shapes that differ.
        """
        xs, gs = self._tensors(params, grads)
        vec, grams = kernels.check_sums(self.compiled.plan, xs, gs, fp64=fp64, backend=backend,
                                        derived=self.derived)
        acc, dev = vec.dtype, vec.device
        on = self._on(dev)
        ng2_v = vec[2]
        ps, nhs, ngs, grs = [vec[0]], [vec[1]], [ng2_v], []
        for d in self.dsizes:
            n = self.compiled.plan.gram_slots[d]
            bil, xa, ga = grams[d][0], grams[d][1].diagonal(dim1=-2, dim2=-1), grams[d][2].diagonal(dim1=-2, dim2=-1)
            eye = torch.eye(d, dtype=torch.bool, device=dev)
            ps.append((2 * bil).reshape(-1))
            nhs.append(torch.where(eye, 4 * xa[:, :, None], xa[:, :, None] + xa[:, None, :]).reshape(-1))
            ngs.append(torch.where(eye, ga[:, :, None].expand(n, d, d), ga[:, :, None] + ga[:, None, :]).reshape(-1))
            grs.append(ga.reshape(-1))
        law_g2 = torch.zeros(len(self.laws), dtype=acc, device=dev)
        law_g2.index_add_(0, on["unit_law"], torch.cat([ng2_v] + grs))
        return Raw(torch.cat(ps), torch.cat(nhs), torch.cat(ngs), law_g2)

    def finish(self, raw: Raw) -> Products:
        """``Products`` from ``Raw`` sums: ``nh = sqrt(nh2)`` and ``ng = max(||g_i||, sqrt(m_i / M) ||g_law||)``
        (``m_i`` elements read by entry i, ``M`` by its law: an entry whose gradient is smaller than the law's
        typical one is measured against the typical one, because the rounding of a gradient follows its
        tensor's scale, not the entry's)."""
        dev, acc = raw.p.device, raw.p.dtype
        on = self._on(dev)
        per_law_typ = raw.law_g2 / on["law_m"].to(acc).clamp_min(1)  # ||g_law||^2 / M per law
        typical2 = on["m_entry"].to(acc) * self._expand(per_law_typ, dev)
        nh2 = raw.nh2.clone()
        nh2[:self.vec_size] += on["nh2_sum"].to(acc)  # a linear law's ||grad h||^2 = s^2 rows: no weight read
        return Products(raw.p, nh2.clamp_min(0).sqrt(), torch.maximum(raw.ng2, typical2).sqrt(), self)

    def _expand(self, per_law: torch.Tensor, device) -> torch.Tensor:
        """``(entries,)``: each entry's law's value of ``per_law`` (``(laws,)``)."""
        on = self._on(device)
        return torch.repeat_interleave(per_law[on["order"]], on["lengths"], output_size=self.entries) \
            if self.entries else per_law.new_zeros(0)

    def products(self, params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                 grads: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], *, fp64: bool = True,
                 backend: str = "auto") -> Products:
        """``finish(raw(params, grads))``: the per-entry products and norms (``Products``)."""
        return self.finish(self.raw(params, grads, fp64=fp64, backend=backend))

    def segments(self, values: torch.Tensor, reduce: str) -> torch.Tensor:
        """``(laws,)`` the per-law ``reduce`` (``"sum"``, ``"max"``, ``"min"``) of per-entry ``values``, in
        the plan's law order (a law without entries gets 0)."""
        on = self._on(values.device)
        out = torch.zeros(len(self.laws), dtype=values.dtype, device=values.device)
        if len(self.laws):
            init = {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduce]
            seg = torch.segment_reduce(values, reduce, lengths=on["lengths"], unsafe=True, initial=init)
            out[on["order"]] = torch.where(on["lengths"] > 0, seg, 0.0)
        return out


def products(laws, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], *, fp64: bool = True,
             backend: str = "auto") -> Products:
    """The per-entry products ``<grad h_i, g>`` and norms of every law in ``laws`` (``Products``; per law:
    ``Products.law(name)`` / ``by_law()``).  ``laws``: a ``GradPlan`` (compiled once: what a training loop
    should pass) or a ``Detection`` / ``Law`` list (compiled here, every law as given: ``select`` filters
    them).  ``params``, ``grads``: ``{name: tensor}``; see ``GradPlan.raw``."""
    plan = laws if isinstance(laws, GradPlan) else GradPlan(laws, params)
    return plan.products(params, grads, fp64=fp64, backend=backend)


def law_products(law: Law, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]):
    """``(p, n_h, n_g)`` per entry of one law, float64 (a Gram law's ``D x D`` entries flattened row-major):
    ``products([law], ...)``.  Raises ``ValueError`` naming a parameter the law reads that is missing."""
    missing = [n for n in law.params if n not in params or n not in grads]
    if missing:
        raise ValueError(f"law {law.name!r} reads {missing}, which has no tensor or no gradient")
    p, nh, ng = products([law], {n: params[n] for n in law.params}, grads).law(law.name)
    return p.reshape(-1), nh.reshape(-1), ng.reshape(-1)


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class LawCheck:
    """The statistic of one law.  ``worst``: the largest per-entry ratio ``r_i`` over every checked step
    (at entry ``worst_entry``, row-major for a Gram law, of step ``worst_step``); ``aggregate``: the
    signed-sum ratio over the law's entries and steps; ``floor`` / ``aggregate_floor``: what they are
    compared with; ``flagged``: either above its floor."""

    name: str
    family: str
    layer: int | None
    params: tuple[str, ...]
    entries: int
    worst: float
    worst_entry: int
    aggregate: float
    floor: float
    aggregate_floor: float = math.inf
    worst_step: int = 0
    steps: int = 1

    @property
    def flagged(self) -> bool:
        return self.worst > self.floor or self.aggregate > self.aggregate_floor


@dataclass
class GradientCheck:
    """What a check found: one ``LawCheck`` per checked law, the skipped laws with the reason, the
    gradient dtype, the floors and the number of checked steps.  ``ok``: nothing flagged (no law, no
    family aggregate).  ``str()``: per family, the flagged laws with their layer and parameters, and the
    two readings of a flag (a bug, or one of ``KNOWN_METHODS`` used on purpose).

    ``floor`` / ``aggregate_floor``: the quadratic laws' floors; ``linear_floor`` /
    ``linear_aggregate_floor``: the linear laws' (router sum, translation).  Each ``LawCheck`` carries its own."""

    laws: list[LawCheck] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    dtype: str = "float32"
    floor: float = 0.0
    aggregate_floor: float = math.inf
    linear_floor: float = 0.0
    linear_aggregate_floor: float = math.inf
    steps: int = 1
    family_sums: dict = field(default_factory=dict)  # family -> (sum p, sum n^2) over laws and steps
    nonfinite: int = 0  # entries left out because the gradient was not finite (a loss scaler's skipped step)

    @property
    def flagged(self) -> list[LawCheck]:
        return [c for c in self.laws if c.flagged]

    @property
    def ok(self) -> bool:
        return not self.flagged and not any(f["flagged_aggregate"] for f in self.families().values())

    def families(self) -> dict[str, dict]:
        """Per family: ``worst`` (and ``worst_law``), ``aggregate`` (the signed sum over every law, entry and
        step of the family: a fault spread thinly over its layers), ``laws`` checked, ``flagged`` laws,
        ``flagged_aggregate`` (the family aggregate above its laws' ``aggregate_floor``) and ``layers`` (the
        layers of its flagged laws)."""
        out: dict[str, dict] = {}
        for c in self.laws:
            f = out.setdefault(c.family, dict(worst=0.0, worst_law="", aggregate=0.0, laws=0, flagged=0,
                                              flagged_aggregate=False, layers=[], aggregate_floor=c.aggregate_floor))
            f["laws"] += 1
            f["flagged"] += c.flagged
            if c.flagged and c.layer not in f["layers"]:
                f["layers"].append(c.layer)
            if c.worst >= f["worst"]:
                f["worst"], f["worst_law"] = c.worst, c.name
        for fam, f in out.items():
            sp, sn2 = self.family_sums.get(fam, (0.0, 0.0))
            f["aggregate"] = abs(sp) / math.sqrt(sn2) if sn2 > 0 else 0.0
            f["flagged_aggregate"] = f["aggregate"] > f["aggregate_floor"]
        return out

    def layers(self) -> dict:
        """``{layer: [flagged law names]}`` (``None``: laws outside any layer); empty when nothing is flagged."""
        out: dict = {}
        for c in self.flagged:
            out.setdefault(c.layer, []).append(c.name)
        return out

    def __str__(self) -> str:
        fams = self.families()
        fam_only = [k for k, f in fams.items() if f["flagged_aggregate"] and not f["flagged"]]
        lines = [f"gradient check ({self.dtype} gradient, {self.steps} step{'s' * (self.steps != 1)}; floors worst / "
                 f"aggregate: quadratic laws {self.floor:.1e} / {self.aggregate_floor:.1e}, linear laws "
                 f"{self.linear_floor:.1e} / {self.linear_aggregate_floor:.1e}): {len(self.flagged)} of "
                 f"{len(self.laws)} laws above the floor"
                 + (f"; family aggregate above the floor: {', '.join(fam_only)}" if fam_only else "")]
        for fam, f in sorted(fams.items()):
            lines.append(f"  {fam:<14s} worst {f['worst']:.2e} ({f['worst_law']}), aggregate {f['aggregate']:.2e}, "
                         f"{f['flagged']}/{f['laws']} flagged"
                         + (" (FLAGGED aggregate)" if f["flagged_aggregate"] else ""))
        for c in self.flagged:
            lines.append(f"  FLAGGED {c.name} (layer {c.layer}; {', '.join(c.params)}): worst {c.worst:.2e} at entry "
                         f"{c.worst_entry}" + (f" of step {c.worst_step}" if self.steps > 1 else "")
                         + f", aggregate {c.aggregate:.2e}")
        if not self.ok:
            lines.append(f"  either {BUG}, or a method that changes the gradient on purpose: "
                         f"{'; '.join(KNOWN_METHODS)}")
            if hint := half_precision_hint(self, self.flagged):
                lines.append(" " + hint)
        if self.nonfinite:
            lines.append(f"  {self.nonfinite} entries with a non-finite gradient were left out (a loss scaler skips "
                         "those steps)")
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


class GradCheck:
    """The accumulating check: ``update`` per checked step (device tensors only, no host sync), ``result``
    when a report is due.

    Args:
        plan: a ``GradPlan`` (or a ``Detection`` / ``Law`` list with ``shapes``: compiled here as given).
        dtype: the dtype the gradients are computed in (``"bfloat16"`` under bf16 autocast, ``"float16"``
            with a loss scaler: unscale first); it sets the floors (``floor``, ``aggregate_floor``; each law
            by its kind, quadratic or linear).
        floor, aggregate_floor: explicit floors for every law instead of the ones ``dtype`` gives.
        skipped: ``(name, reason)`` pairs carried into the result (``select``'s).
        fp64: float64 accumulation of the products (``GradPlan.raw``); ``None``: when the gradient's dtype is
            float32 or wider (a float32 accumulation's rounding is near float32's floor, far under a half
            dtype's).
        backend: how ``update(params, grads)`` evaluates the products (``GradPlan.raw``).

    Per law it keeps, over every update: the worst ratio (with its entry and step), ``sum p_i`` and
    ``sum n_i^2`` (the aggregate) and the count of non-finite entries, as float64 tensors of one entry per
    law on the gradients' device.
    """

    def __init__(self, plan, shapes: Mapping | None = None, *, dtype="float32", floor: float | None = None,
                 aggregate_floor: float | None = None, skipped: Sequence[tuple[str, str]] = (),
                 fp64: bool | None = None, backend: str = "auto"):
        if not isinstance(plan, GradPlan):
            if shapes is None:
                raise ValueError("GradCheck(laws, shapes): pass the parameters' shapes (or a GradPlan)")
            plan = GradPlan(plan, shapes)
        self.plan = plan
        self.dtype = _dtype_name(dtype)
        fl, afl = globals()["floor"], globals()["aggregate_floor"]
        self.floors = {lin: (fl(dtype, lin) if floor is None else float(floor),
                             afl(dtype, lin) if aggregate_floor is None else float(aggregate_floor))
                       for lin in (False, True)}
        self.skipped = list(skipped)
        self.fp64 = unit_roundoff(dtype) <= unit_roundoff("float32") if fp64 is None else bool(fp64)
        self.backend = backend
        self.reset()

    def reset(self) -> None:
        """Forget every update."""
        self.steps = 0
        self._acc = None

    def state_dict(self) -> dict:
        """What ``update`` accumulated (``steps`` and per law the worst ratio, its entry and step, the sums of the
        aggregate, the non-finite count), copies; ``load_state_dict`` continues from it."""
        return {"steps": self.steps, "acc": None if self._acc is None else {k: v.clone() for k, v in self._acc.items()}}

    def load_state_dict(self, state: Mapping, device=None) -> None:
        """Continue from ``state_dict()``'s result (its tensors moved to ``device``, the gradients' device; default
        where they are).  Raises ``ValueError`` when it holds another number of laws."""
        acc = state.get("acc")
        if acc is not None and any(v.shape != (len(self.plan.laws),) for v in acc.values()):
            raise ValueError(f"gradient check state for another set of laws ({next(iter(acc.values())).shape[0]} laws, "
                             f"this check has {len(self.plan.laws)})")
        self.steps = int(state.get("steps", 0))
        self._acc = None if acc is None else {k: v.to(device if device is not None else v.device).clone()
                                              for k, v in acc.items()}

    def update(self, products: Products | Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor] | None = None,
               *, step: int | None = None):
        """Add one checked step: ``update(products)`` (``GradPlan.products``) or ``update(params, grads)``.
        Entries whose product or norms are not finite are left out and counted (``GradientCheck.nonfinite``).
        ``step``: the step's number as the caller counts (a tracker: its training step; default the count
        of updates so far), reported as the worst entry's step.  Returns the step's ``Products``."""
        if grads is not None:
            products = self.plan.products(products, grads, fp64=self.fp64, backend=self.backend)
        elif not isinstance(products, Products):
            raise TypeError("update(products) takes GradPlan.products(...), or update(params, grads)")
        if products.plan is not self.plan:
            raise ValueError("these products come from another GradPlan than this check's")
        plan, p, dev = self.plan, products.p.to(torch.float64), products.p.device
        n = (products.nh * products.ng).to(torch.float64)
        fin = torch.isfinite(p) & torch.isfinite(n)
        p, n = torch.where(fin, p, 0.0), torch.where(fin, n, 0.0)
        r = torch.where(n > 0, p.abs() / n.clamp_min(1e-300), torch.zeros_like(p))
        worst = plan.segments(r, "max")
        # the first entry of each law where its maximum is reached (a flat index in float64: exact)
        at_max = r == plan._expand(worst, dev)
        flat = torch.arange(plan.entries, dtype=torch.float64, device=dev)
        entry = plan.segments(torch.where(at_max, flat, math.inf), "min")
        if self._acc is None:
            z = lambda: torch.zeros(len(plan.laws), dtype=torch.float64, device=dev)  # noqa: E731
            self._acc = dict(worst=z(), entry=z(), step=z(), sum_p=z(), sum_n2=z(), nonfinite=z())
        a = self._acc
        better = worst > a["worst"]
        a["worst"] = torch.where(better, worst, a["worst"])
        a["entry"] = torch.where(better, entry, a["entry"])
        a["step"] = torch.where(better, float(self.steps if step is None else step), a["step"])
        a["sum_p"] += plan.segments(p, "sum")
        a["sum_n2"] += plan.segments(n * n, "sum")
        a["nonfinite"] += plan.segments((~fin).to(torch.float64), "sum")
        self.steps += 1
        return products

    def result(self) -> GradientCheck:
        """The ``GradientCheck`` of every update so far (one host copy of a few per-law vectors)."""
        plan = self.plan
        res = GradientCheck(skipped=list(self.skipped), dtype=self.dtype, floor=self.floors[False][0],
                            aggregate_floor=self.floors[False][1], linear_floor=self.floors[True][0],
                            linear_aggregate_floor=self.floors[True][1], steps=self.steps)
        if self._acc is None:
            return res
        a = {k: v.cpu().numpy() for k, v in self._acc.items()}
        fam: dict = {}
        for k, law in enumerate(plan.laws):
            sp, sn2 = float(a["sum_p"][k]), float(a["sum_n2"][k])
            f = fam.setdefault(law.family, [0.0, 0.0])
            f[0] += sp
            f[1] += sn2
            e = int(a["entry"][k]) - int(plan.starts[k]) if a["worst"][k] > 0 else 0
            fl, afl = self.floors[bool(law.linear)]
            res.laws.append(LawCheck(law.name, law.family, law.layer, law.params, int(plan.lengths[k]),
                                     float(a["worst"][k]), e, abs(sp) / math.sqrt(sn2) if sn2 > 0 else 0.0,
                                     fl, afl, int(a["step"][k]), self.steps))
        res.family_sums = {f: tuple(v) for f, v in fam.items()}
        res.nonfinite = int(a["nonfinite"].sum())
        return res

    def flagged(self, floor: float | None = None, aggregate_floor: float | None = None) -> list[LawCheck]:
        """The flagged laws of ``result()``, against ``floor`` / ``aggregate_floor`` (for every law) when given."""
        out = []
        for c in self.result().laws:
            c = replace(c, floor=c.floor if floor is None else floor,
                        aggregate_floor=c.aggregate_floor if aggregate_floor is None else aggregate_floor)
            if c.flagged:
                out.append(c)
        return out


# ------------------------------------------------------------------------------------------ one-shot
def check_gradients(model: nn.Module, loss_fn: Callable | None = None, batch=None, *, laws=None,
                    loss: str | None = None, grads: Mapping[str, torch.Tensor] | None = None,
                    ignore: Iterable[str] = (), dtype=None, floor_value: float | None = None,
                    aggregate_floor_value: float | None = None) -> GradientCheck:
    """Check that a gradient is a gradient of the model's output: every exact law's first-order product
    with it must be at rounding level (module docstring; spec "Gradient integrity").

    Args:
        model: the module whose parameters the laws read (names as ``model.named_parameters()`` of the
            model inside a ``torch.compile`` / DDP wrapper; ``loss_fn`` gets ``model`` as given).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; its ``backward()`` produces the gradient
            checked (the model's own dtype, autocast, custom autograd functions and hooks included).  The
            parameters' ``.grad`` are restored afterwards.  ``None``: check ``grads`` if given, else the
            gradients already in the parameters' ``.grad`` (what your training stack produced: after
            unscaling, clipping, all-reduce).  A trainable parameter whose ``.grad`` is None (backward did not
            reach it: an expert no token was routed to) is checked as a zero gradient; a law reading a frozen
            parameter (``requires_grad=False``) is skipped with the reason.
        batch: passed to ``loss_fn``.
        laws: the laws to check (a ``Detection``, a list of ``Law``); default ``conserve.detect(model,
            loss=loss)``.
        loss: ``"ce"`` when the loss is softmax cross-entropy of the model's logits: translation laws are
            then checked; otherwise they are skipped with the reason.
        grads: ``{parameter name: gradient}`` to check instead of a backward pass.
        ignore: law names, families or ``fnmatch`` patterns of parameter / law names to skip.
        dtype: the dtype the gradient was computed in (``"bfloat16"`` under bf16 autocast, ``"float16"``
            under fp16 autocast); default the gradients' own dtype.  It sets the floors.
        floor_value, aggregate_floor_value: explicit floors instead of the ones ``dtype`` gives.

    Returns:
        ``GradientCheck``: per law ``worst`` and ``aggregate`` against the floors; ``ok`` when none is above;
        ``str()`` prints the families, the flagged laws with their parameters and layer, and both readings
        of a flag (a bug, or a method that changes the gradient on purpose).

    Raises:
        ValueError: no gradient for a parameter a checked law reads (pass ``ignore=`` for it, or run a
            backward pass that reaches it), or ``loss_fn`` did not return a scalar.
    """
    from ..wrappers import unwrap

    named = dict(unwrap(model).named_parameters())  # the laws' names: torch.compile / DDP wrappers stripped
    if laws is None:
        from ..detection import detect

        laws = detect(model, loss=loss)
    if grads is None:
        if loss_fn is not None:
            saved = {n: p.grad for n, p in named.items()}
            try:
                for p in named.values():
                    p.grad = None
                out = loss_fn(model, batch)
                if not (isinstance(out, torch.Tensor) and out.numel() == 1):
                    raise ValueError("loss_fn(model, batch) must return a scalar loss tensor")
                out.backward()
                grads = {n: zero_if_none(p).detach().clone() for n, p in named.items() if p.requires_grad}
            finally:
                for n, p in named.items():
                    p.grad = saved[n]
        elif any(p.grad is not None for p in named.values()):
            grads = {n: zero_if_none(p) for n, p in named.items() if p.requires_grad}
    if not grads:
        raise ValueError("no gradient to check: pass loss_fn and batch, grads=, or run a backward pass first")
    checked, skipped = select(laws, loss=loss, ignore=ignore)
    frozen = {law.name: [n for n in law.params if n in named and not named[n].requires_grad] for law in checked}
    skipped += [(name, f"reads frozen parameter(s) {ps}: the product needs their gradient") for name, ps in
                frozen.items() if ps]
    checked = [law for law in checked if not frozen[law.name]]
    for law in checked:
        unknown = [n for n in law.params if n not in named]
        if unknown:
            raise ValueError(f"law {law.name!r} reads {unknown}, which model.named_parameters() does not list (a "
                             f"module shared by two names lists its parameters once, under the first): pass "
                             f"ignore=[{law.name!r}]")
        missing = [n for n in law.params if n not in grads]
        if missing:
            raise ValueError(f"law {law.name!r} reads {missing}, which has no gradient: run a backward pass that "
                             f"reaches it, or pass ignore=[{law.name!r}]")
    if dtype is not None:
        gdtype = dtype
    else:  # the coarsest gradient the checked laws read (a bf16 model with float32 embeddings: bf16)
        dts = {grads[n].dtype for law in checked for n in law.params if n in grads} or \
            {next(iter(grads.values())).dtype}
        gdtype = max(dts, key=lambda d: torch.finfo(d).eps)
    chk = GradCheck(GradPlan(checked, {n: named[n] for law in checked for n in law.params}), dtype=gdtype,
                    floor=floor_value, aggregate_floor=aggregate_floor_value, skipped=skipped)
    if checked:
        chk.update(named, grads)
    return chk.result()
