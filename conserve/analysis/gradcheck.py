"""Gradient integrity: a law's first-order product with a gradient (spec "Gradient integrity").

For an exact law ``h`` of the architecture and a gradient ``g`` of any loss that depends on the weights
only through the model's output (for translation laws: through softmax cross-entropy), the first-order
product ``<grad h(theta), g>`` vanishes at the same ``theta``: per sample, hence for batch sums, rank
averages, one global scale (norm clipping, a loss scale), dropout masks.  A gradient with a product
above rounding was not produced that way: a wrong custom backward, a partial or wrongly scaled
all-reduce, a hook that rescales part of a law's parameters, weight decay folded into ``p.grad`` --
or a method that changes the gradient on purpose (SAM, DP-SGD, ``clip_grad_value_``, compression,
straight-through estimators, stale gradients, a loss on hidden activations, router z-loss, a logit
soft-cap for a translation law).

The statistic, per law entry ``i`` (a unit, a rotary pair, a gain feature, a router column, one entry
``(a, b)`` of a Gram law)::

    r_i = |<grad h_i, g>| / (||grad h_i|| * ||g_i||)          (in [0, 1] by Cauchy-Schwarz)

with ``g_i`` the gradient restricted to the parameter elements ``h_i`` reads (measured against the
law's typical entry when it is smaller: ``law_products``).  For the catalogue's
terms, in float64 (the terms of one law read disjoint blocks):

* norm term ``s * sum_c (x_rc + shift)^2`` (row r): ``<grad, g> = 2 s sum_c (x_rc + shift) g_rc``,
  ``||grad||^2 = 4 s^2 sum_c (x_rc + shift)^2``, ``||g_i||^2 = sum_c g_rc^2``;
* sum term ``s * sum_r x_rc`` (column c): ``<grad, g> = s sum_r g_rc``, ``||grad||^2 = s^2 * rows``,
  ``||g_i||^2 = sum_r g_rc^2``;
* Gram term ``s X X^T``, entry (a, b): ``<grad, g> = s (x_a . g_b + g_a . x_b)``; ``||grad||^2`` is
  ``s^2 (||x_a||^2 + ||x_b||^2)`` off the diagonal and ``4 s^2 ||x_a||^2`` on it; ``||g_i||^2`` is
  ``||g_a||^2 + ||g_b||^2`` off the diagonal and ``||g_a||^2`` on it.

Per law: ``worst`` (the largest ``r_i``) and ``aggregate = |sum_i p_i| / sqrt(sum_i (n_i)^2)`` with
``p_i`` the products and ``n_i = ||grad h_i|| ||g_i||``: a rounding error of random sign adds up like
``sqrt(n)`` entries and stays at the floor, while a fault that moves every product the same way
grows like ``n`` entries, so the aggregate lifts a small consistent fault above the floor.

The floor (``floor``): ``FLOOR_FACTOR`` (16) unit roundoffs of the dtype the gradient was computed in
(``conserve.analysis.floor.unit_roundoff``): 9.5e-7 for float32, 7.8e-3 for float16, 6.3e-2 for
bfloat16.  A linear law's product sums a gradient whose parts cancel by construction (a router's
columns: the softmax gradient sums to zero over the experts), so its rounding reaches a few unit
roundoffs; the factor leaves room for that.  A float64 gradient is held to the float32 floor, because model code commonly computes
norms and softmax in float32 inside a float64 model.  Measured floors and the smallest detected faults
are in the README ("Gradient integrity").

Not checked: the approximate scale laws (``qk_scale``, ``norm_scale``: exact only for eps = 0 norms),
and a loss-dependent law (translation) unless that loss was named (``loss="ce"``).
Blind spots: faults that keep every law's block an exact vector-Jacobian product (labels, masks or
positions wrong in forward and backward alike, a hook at a module boundary, a norm's input gradient,
the gate of a SwiGLU unit, embeddings and tied heads: no law reads them), and a gradient of the wrong
loss of the right architecture.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from ..laws import Law, compile_laws
from .floor import unit_roundoff

FLOOR_FACTOR = 16
#: families whose law holds only approximately (eps > 0 norms): never checked
APPROXIMATE = {"qk_scale": "approximate law (exact only for eps = 0 norms)",
               "norm_scale": "approximate law (exact only for eps = 0 norms)"}
#: families that hold for one loss only: checked only when that loss is named
LOSS_ONLY = {"translation": "ce"}


def floor(dtype) -> float:
    """The rounding floor of the statistic for a gradient computed in ``dtype`` (module docstring)."""
    u = unit_roundoff(dtype)
    return FLOOR_FACTOR * max(u, unit_roundoff("float32"))


@dataclass(frozen=True)
class LawCheck:
    """The statistic of one law.  ``worst``: the largest per-entry ratio ``r_i`` (at entry ``worst_entry``,
    row-major for a Gram law); ``aggregate``: the signed-sum ratio over the law's entries; ``floor``: the
    rounding floor both are compared with; ``flagged``: either above it."""

    name: str
    family: str
    layer: int | None
    params: tuple[str, ...]
    entries: int
    worst: float
    worst_entry: int
    aggregate: float
    floor: float

    @property
    def flagged(self) -> bool:
        return self.worst > self.floor or self.aggregate > self.floor


@dataclass
class GradientCheck:
    """What ``check_gradients`` found: one ``LawCheck`` per checked law, the skipped laws with the reason,
    the gradient dtype and the floor.  ``ok``: no law flagged."""

    laws: list[LawCheck] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    dtype: str = "float32"
    floor: float = 0.0

    @property
    def flagged(self) -> list[LawCheck]:
        return [c for c in self.laws if c.flagged]

    @property
    def ok(self) -> bool:
        return not self.flagged

    def families(self) -> dict[str, dict]:
        """Per family: the worst law's ``worst`` and ``aggregate``, how many laws were checked and flagged."""
        out: dict[str, dict] = {}
        for c in self.laws:
            f = out.setdefault(c.family, dict(worst=0.0, aggregate=0.0, laws=0, flagged=0, worst_law=""))
            f["laws"] += 1
            f["flagged"] += c.flagged
            if c.worst >= f["worst"]:
                f["worst"], f["worst_law"] = c.worst, c.name
            f["aggregate"] = max(f["aggregate"], c.aggregate)
        return out

    def __str__(self) -> str:
        lines = [f"gradient check ({self.dtype} gradient, floor {self.floor:.1e}): "
                 f"{len(self.flagged)} of {len(self.laws)} laws above the floor"]
        for fam, f in sorted(self.families().items()):
            lines.append(f"  {fam:<14s} worst {f['worst']:.2e} ({f['worst_law']}), aggregate {f['aggregate']:.2e}, "
                         f"{f['flagged']}/{f['laws']} flagged")
        for c in self.flagged:
            lines.append(f"  FLAGGED {c.name} (layer {c.layer}; {', '.join(c.params)}): worst {c.worst:.2e} at entry "
                         f"{c.worst_entry}, aggregate {c.aggregate:.2e}")
        if self.flagged:
            lines.append("  a bug in the gradient (custom backward, all-reduce, a hook, decay folded into p.grad), or a "
                         "method that changes it on purpose (SAM, DP-SGD, clip_grad_value_, compression, z-loss)")
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


def law_products(law: Law, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]):
    """``(p, n_h, n_g)`` per entry of ``law``, float64: ``p_i = <grad h_i, g>``, ``n_h_i = ||grad h_i||``,
    ``n_g_i = max(||g_i||, sqrt(m_i / M) ||g_law||)`` (``m_i`` elements read by entry i, ``M`` by the law:
    an entry whose gradient is smaller than the law's typical one is measured against the typical one,
    because the rounding of a gradient follows its tensor's scale, not the entry's).  Formulas in the
    module docstring.  ``params`` / ``grads`` map parameter names to tensors of the same shapes (any
    float dtype; read as float64).  Raises ``ValueError`` naming a parameter the law reads that is missing."""
    missing = [n for n in law.params if n not in params or n not in grads]
    if missing:
        raise ValueError(f"law {law.name!r} reads {missing}, which has no tensor or no gradient")
    c = compile_laws([law], {n: tuple(params[n].shape) for n in law.params})
    xs = [params[n].detach().to(torch.float64) for n in c.names]
    gs = [grads[n].detach().to(xs[i].device, torch.float64) for i, n in enumerate(c.names)]
    plan, dev = c.plan, xs[0].device
    z = lambda n: torch.zeros(n, dtype=torch.float64, device=dev)  # noqa: E731
    if law.kind == "gram":
        D = law.size
        p = torch.zeros(D, D, dtype=torch.float64, device=dev)
        dx, dg, dm = z(D), z(D), z(D)  # per row a: sum_t s^2 ||x_ta||^2, sum_t ||g_ta||^2, elements
        for t in plan.grams:
            x, g = t.view.of(xs[t.view.tensor]), t.view.of(gs[t.view.tensor])
            xg = x @ g.T
            p += t.sign * (xg + xg.T)
            dx += t.sign ** 2 * (x * x).sum(1)
            dg += (g * g).sum(1)
            dm += x.shape[1]
        eye = torch.eye(D, dtype=torch.bool, device=dev)
        pair = lambda v, diag: torch.where(eye, diag * v[:, None].expand(D, D), v[:, None] + v[None, :])  # noqa: E731
        nh2, ng2, m = pair(dx, 4), pair(dg, 1), pair(dm, 1)
        total_g2, total_m = dg.sum(), dm.sum()
        p, nh2, ng2, m = p.reshape(-1), nh2.reshape(-1), ng2.reshape(-1), m.reshape(-1)
    else:
        n = plan.vec_size
        p, nh2, ng2, m = z(n), z(n), z(n), z(n)
        total_g2, total_m = z(()), z(())
        for t in plan.norms:
            x, g = t.view.of(xs[t.view.tensor]) + t.shift, t.view.of(gs[t.view.tensor])
            idx = t.index + t.index_stride * torch.arange(x.shape[0], device=dev)
            p.index_add_(0, idx, 2 * t.sign * (x * g).sum(1))
            nh2.index_add_(0, idx, 4 * t.sign ** 2 * (x * x).sum(1))
            ng2.index_add_(0, idx, (g * g).sum(1))
            m.index_add_(0, idx, torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64, device=dev))
            total_g2, total_m = total_g2 + (g * g).sum(), total_m + g.numel()
        for t in plan.sums:
            g = t.view.of(gs[t.view.tensor])
            idx = t.index + torch.arange(g.shape[1], device=dev)
            p.index_add_(0, idx, t.sign * g.sum(0))
            nh2.index_add_(0, idx, torch.full((g.shape[1],), t.sign ** 2 * g.shape[0], dtype=torch.float64, device=dev))
            ng2.index_add_(0, idx, (g * g).sum(0))
            m.index_add_(0, idx, torch.full((g.shape[1],), float(g.shape[0]), dtype=torch.float64, device=dev))
            total_g2, total_m = total_g2 + (g * g).sum(), total_m + g.numel()
    typical2 = m / total_m.clamp_min(1) * total_g2
    return p, nh2.sqrt(), torch.maximum(ng2, typical2).sqrt()


def check_law(law: Law, params, grads, floor_value: float) -> LawCheck:
    """The statistic of one law (``law_products``) against ``floor_value``."""
    p, nh, ng = law_products(law, params, grads)
    n = nh * ng
    r = torch.where(n > 0, p.abs() / n.clamp_min(1e-300), torch.zeros_like(p))
    den = n.square().sum().sqrt()
    agg = float(p.sum().abs() / den) if den > 0 else 0.0
    k = int(r.argmax()) if r.numel() else 0
    return LawCheck(law.name, law.family, law.layer, law.params, int(r.numel()),
                    float(r[k]) if r.numel() else 0.0, k, agg, floor_value)


def _ignored(law: Law, patterns: Iterable[str]) -> str | None:
    for pat in patterns:
        if pat in (law.name, law.family) or any(fnmatch.fnmatchcase(p, pat) for p in law.params) \
                or fnmatch.fnmatchcase(law.name, pat):
            return pat
    return None


def check_gradients(model: nn.Module, loss_fn: Callable | None = None, batch=None, *, laws=None,
                    loss: str | None = None, grads: Mapping[str, torch.Tensor] | None = None,
                    ignore: Iterable[str] = (), dtype=None, floor_value: float | None = None) -> GradientCheck:
    """Check that a gradient is a gradient of the model's output: every exact law's first-order product
    with it must be at rounding level (module docstring; spec "Gradient integrity").

    Args:
        model: the module whose parameters the laws read (names as ``model.named_parameters()`` of the
            model inside a ``torch.compile`` / DDP wrapper; ``loss_fn`` gets ``model`` as given).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; its ``backward()`` produces the gradient
            checked (the model's own dtype, autocast, custom autograd functions and hooks included).  The
            parameters' ``.grad`` are restored afterwards.  ``None``: check ``grads`` if given, else the
            gradients already in the parameters' ``.grad`` (what your training stack produced: after
            unscaling, clipping, all-reduce).
        batch: passed to ``loss_fn``.
        laws: the laws to check (a ``Detection``, a list of ``Law``); default ``conserve.detect(model,
            loss=loss)``.
        loss: ``"ce"`` when the loss is softmax cross-entropy of the model's logits: translation laws are
            then checked; otherwise they are skipped with the reason.
        grads: ``{parameter name: gradient}`` to check instead of a backward pass.
        ignore: law names, families or ``fnmatch`` patterns of parameter / law names to skip.
        dtype: the dtype the gradient was computed in (``"bfloat16"`` under bf16 autocast); default the
            gradients' own dtype.  It sets the floor (``floor``).
        floor_value: an explicit floor instead of the one ``dtype`` gives.

    Returns:
        ``GradientCheck``: per law ``worst`` and ``aggregate`` against the floor; ``ok`` when none is above;
        ``str()`` prints the families, the flagged laws with their parameters and layer, and both readings
        of a flag (a bug, or a method that changes the gradient on purpose).

    Raises:
        ValueError: no gradient for a parameter a checked law reads (pass ``ignore=`` for it, or run a
            backward pass that reaches it), or ``loss_fn`` did not return a scalar.
    """
    from ..detection.core import unwrap

    named = dict(unwrap(model).named_parameters())  # the laws' names: torch.compile / DDP wrappers stripped
    if laws is None:
        from ..detection import detect

        laws = detect(model, loss=loss)
    laws = list(getattr(laws, "laws", laws))
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
                grads = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
            finally:
                for n, p in named.items():
                    p.grad = saved[n]
        else:
            grads = {n: p.grad for n, p in named.items() if p.grad is not None}
    if not grads:
        raise ValueError("no gradient to check: pass loss_fn and batch, grads=, or run a backward pass first")
    gdtype = dtype if dtype is not None else next(iter(grads.values())).dtype
    name = str(gdtype).rsplit(".", 1)[-1]
    fl = floor_value if floor_value is not None else floor(gdtype)
    result = GradientCheck(dtype=name, floor=fl)
    for law in laws:
        if law.family in APPROXIMATE:
            result.skipped.append((law.name, APPROXIMATE[law.family]))
        elif law.family in LOSS_ONLY and loss != LOSS_ONLY[law.family]:
            result.skipped.append((law.name, f"holds for loss={LOSS_ONLY[law.family]!r} only: pass "
                                             f"loss={LOSS_ONLY[law.family]!r} if that is the loss"))
        elif (pat := _ignored(law, ignore)) is not None:
            result.skipped.append((law.name, f"ignored ({pat!r})"))
        else:
            missing = [n for n in law.params if n not in grads]
            if missing:
                raise ValueError(f"law {law.name!r} reads {missing}, which has no gradient: run a backward pass that "
                                 f"reaches it, or pass ignore=[{law.name!r}]")
            result.laws.append(check_law(law, named, grads, fl))
    return result
