"""Geometric continuity across layers (Jeong, Paeng, Suh 2026; spec: laws.md, "Geometric continuity").

For every projection type (``self_attn.q_proj``, ``mlp.down_proj``, the ``fc`` of a plain Linear stack, ...)
and adjacent layers ``l, l+1`` of that type, with ``W`` of shape ``(out, in)`` (PyTorch ``nn.Linear``):

- input-space continuity   ``|<v1^(l), v1^(l+1)>|``  (v1: leading right singular vector, length ``in``)
- output-space continuity  ``|<u1^(l), u1^(l+1)>|``  (u1: leading left singular vector, length ``out``)
  Singular vectors are defined up to sign, hence the absolute value. Random baseline for unit vectors in
  ``d`` dimensions: ``E|cos| = sqrt(2 / (pi d))`` (``random_baseline``).
- sigma^2-weighted alignment (spec's proposal) ``tr(G_l G_{l+1}) / (||G_l||_F ||G_{l+1}||_F)`` with
  ``G = W^T W`` (input space, ``align_in``) or ``G = W W^T`` (output space, ``align_out``). Computed without
  forming ``G``: ``tr(W_a^T W_a W_b^T W_b) = ||W_a W_b^T||_F^2`` and ``tr(W_a W_a^T W_b W_b^T) = ||W_a^T W_b||_F^2``;
  ``||W^T W||_F = ||W W^T||_F = sqrt(sum sigma^4)``. In [0, 1]; 1 iff ``G_{l+1}`` is a multiple of ``G_l``.
  Not centred: for independent i.i.d. ``m x n`` weights it is about ``m/(m+n)`` (input) and ``n/(m+n)``
  (output), e.g. 0.5 for square matrices (Marchenko-Pastur: ``E tr(G_a G_b) = n (m/n)^2``,
  ``||G||_F^2 ~ n (m/n)^2 (1 + n/m)``).
- cumulative gradient coherence (spec's proposal) ``cos(S_l, S_{l+1})``, ``S_l = sum_t grad_{W_l}(t)``
  (running sum over optimizer steps, flattened). Signed, in [-1, 1].

Layers: the first ``.<int>.`` component of a parameter name is the layer, the rest of the name (without
``.weight``) is the type: ``model.layers.3.self_attn.q_proj.weight`` -> (``self_attn.q_proj``, 3)
(``group_projections``). Adjacent = consecutive layer indices present for that type.

During training, ``ContinuityMonitor`` keeps one warm-started power-iteration vector pair per matrix and does
``power_steps`` steps per update, batching same-shape matrices with ``torch.bmm``; it never syncs with the host.
For a checkpoint, ``leading_singular_vectors`` runs block (subspace) iteration with Rayleigh-Ritz to a
tolerance, or an exact ``torch.linalg.svd``.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "Projection",
    "split_layer_name",
    "group_projections",
    "as_matrix",
    "random_baseline",
    "power_iteration",
    "leading_singular_vectors",
    "abs_cos",
    "gram_alignment",
    "grams",
    "gram_cosine",
    "gradient_coherence",
    "continuity_report",
    "ContinuityMonitor",
    "METRICS",
    "random_quantile",
    "subspace_overlap",
    "centred_gram_alignment",
    "snapshot",
]

METRICS = ("v1", "u1", "align_in", "align_out", "coherence")
_TINY = 1e-30
_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


# ----------------------------------------------------------------------------------------------------------
# grouping parameters into projection types x layers
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Projection:
    """One weight matrix of a projection type: its parameter ``name``, ``type``, ``layer`` and
    ``shape`` = ``(out, in)`` after flattening trailing dims (conv kernels: ``(out, in*kh*kw)``)."""

    name: str
    type: str
    layer: int
    shape: tuple[int, int]


def split_layer_name(name: str) -> tuple[str, str, int] | None:
    """``(prefix, type, layer)`` of a parameter name, or None if it has no ``.<int>.`` layer component.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``("model.layers", "self_attn.q_proj", 3)``;
    ``blocks.7.fc.weight`` -> ``("blocks", "fc", 7)``; a Sequential of Linears ``net.2.weight`` ->
    ``("net", "net", 2)`` (the type falls back to the prefix, or ``"weight"`` when there is none).
    """
    m = _LAYER.search(name)
    if m is None:
        return None
    prefix, rest = name[: m.start()], name[m.end():]
    type_ = rest[: -len(".weight")] if rest.endswith(".weight") else rest
    if type_ in ("", "weight"):
        type_ = prefix or "weight"
    return prefix, type_, int(m.group(1))


def _shape_of(x) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(x)


def group_projections(named: Iterable[tuple[str, object]] | Mapping[str, object],
                      types: Iterable[str] | None = None) -> dict[str, list[Projection]]:
    """Group 2-D (or higher, flattened) weights by projection type; each list sorted by layer.

    ``named``: ``(name, tensor_or_shape)`` pairs or a mapping (a module's ``named_parameters()``, a
    safetensors header's name -> shape). 1-D parameters (biases, norm gains) are skipped, and so are types
    present in fewer than two layers. When the same type name occurs under two prefixes
    (``encoder.layers.0.fc`` and ``decoder.layers.0.fc``) both are renamed ``prefix.type``.
    ``types``: keep only these type names (after renaming). Raises ``ValueError`` if two parameters land
    on the same (type, layer).
    """
    items = named.items() if isinstance(named, Mapping) else named
    found: dict[tuple[str, str], list[tuple[int, str, tuple[int, ...]]]] = defaultdict(list)
    for name, x in items:
        shape = _shape_of(x)
        if len(shape) < 2:
            continue
        split = split_layer_name(name)
        if split is None:
            continue
        prefix, type_, layer = split
        found[(prefix, type_)].append((layer, name, shape))
    prefixes: dict[str, set[str]] = defaultdict(set)
    for prefix, type_ in found:
        prefixes[type_].add(prefix)
    keep = None if types is None else set(types)
    out: dict[str, list[Projection]] = {}
    for (prefix, type_), rows in found.items():
        key = type_ if len(prefixes[type_]) == 1 else f"{prefix}.{type_}"
        if keep is not None and key not in keep:
            continue
        rows.sort()
        layers = [r[0] for r in rows]
        if len(set(layers)) != len(layers):
            dup = next(l for l in layers if layers.count(l) > 1)
            names = [r[1] for r in rows if r[0] == dup]
            raise ValueError(f"parameters {names} both map to type {key!r}, layer {dup}; pass `types=` to choose")
        if len(rows) < 2:
            continue
        out[key] = [Projection(n, key, l, (s[0], math.prod(s[1:]))) for l, n, s in rows]
    return dict(sorted(out.items()))


def as_matrix(w: torch.Tensor) -> torch.Tensor:
    """``(out, in)`` view of a weight (trailing dims flattened, no copy when contiguous)."""
    return w.reshape(w.shape[0], -1)


# ----------------------------------------------------------------------------------------------------------
# pure metric functions
# ----------------------------------------------------------------------------------------------------------
def random_baseline(d: int) -> float:
    """``E|<a, b>|`` for independent uniform unit vectors in ``d`` dims, large-d form ``sqrt(2 / (pi d))``."""
    return math.sqrt(2.0 / (math.pi * d))


def _normalize(x: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    y = x / n.clamp_min(_TINY)
    if fallback is not None:  # a zero matrix keeps the previous vector instead of collapsing to 0
        y = torch.where(n > 0, y, fallback)
    return y


def _compute_dtype(w_dtype: torch.dtype, v_dtype: torch.dtype) -> torch.dtype:
    """Mat-vecs with half/bfloat16 weights run in the weights' dtype (fp32 accumulation), others in ``v``'s."""
    return w_dtype if w_dtype in (torch.float16, torch.bfloat16) else v_dtype


def power_iteration(w: torch.Tensor, v: torch.Tensor, steps: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Warm-started power iteration on ``W^T W`` for a batch of matrices, no host sync.

    ``w``: ``(B, m, n)`` (or ``(m, n)``), any float dtype; ``v``: ``(B, n)`` (or ``(n,)``) start vectors,
    float32/64. Each step does ``u = W v / ||W v||``, ``v = W^T u / ||W^T u||`` (two batched mat-vecs, in
    ``v``'s dtype; for float16/bfloat16 ``w`` in ``w``'s dtype with float32 accumulation, so no float32 copy of
    ``w`` is made and ``u, v`` carry about 3 significant digits). Returns ``(u, sigma, v)`` with ``sigma = ||W^T u|| = u^T W v`` (estimate of sigma_1).
    The sign is carried over from the start vector (a step never flips it: ``<v_new, v> >= 0``) and
    ``(u, v)`` is a consistent pair. Error after k steps ~ ``(sigma_2 / sigma_1)^(2k)`` times the start error.
    """
    single = w.dim() == 2
    if single:
        w, v = w.unsqueeze(0), v.unsqueeze(0)
    if w.dim() != 3 or v.shape != (w.shape[0], w.shape[2]):
        raise ValueError(f"power_iteration: expected w (B, m, n) and v (B, n), got {tuple(w.shape)}, {tuple(v.shape)}")
    if steps < 1:
        raise ValueError("power_iteration: steps must be >= 1")
    cdt = _compute_dtype(w.dtype, v.dtype)
    w = w.to(cdt)
    v = _normalize(v)
    for _ in range(steps):
        u = _normalize(torch.bmm(w, v.to(cdt).unsqueeze(-1)).squeeze(-1).to(v.dtype))
        x = torch.bmm(w.transpose(1, 2), u.to(cdt).unsqueeze(-1)).squeeze(-1).to(v.dtype)
        sigma = torch.linalg.vector_norm(x, dim=-1)
        v = _normalize(x, v)
    if single:
        return u[0], sigma[0], v[0]
    return u, sigma, v


def leading_singular_vectors(w: torch.Tensor, *, method: str = "auto", block: int = 8, tol: float = 1e-6,
                             max_iters: int = 1000, generator: torch.Generator | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Leading singular triple ``(u1, sigma1, v1)`` of ``(m, n)`` or a batch ``(B, m, n)``, computed in float32
    (float64 input stays float64). ``method``: ``"svd"`` (exact ``torch.linalg.svd``), ``"block"`` (subspace
    iteration on ``W^T W`` with a ``block``-column basis and Rayleigh-Ritz, converged when
    ``1 - |<v1_new, v1_old>| <= tol`` for every matrix, rate ``(sigma_{block+1}/sigma_1)^2`` per iteration), or
    ``"auto"`` (svd when ``min(m, n) <= 1024``, else block). Returns also ``info`` =
    ``{"method", "iters", "converged"}``. Signs: each ``v1`` is flipped so its largest-magnitude entry is
    positive, and ``u1 = W v1 / sigma1``. Host-syncs (convergence test): for checkpoints, not for training.
    """
    single = w.dim() == 2
    if single:
        w = w.unsqueeze(0)
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    w = w.to(dtype)
    B, m, n = w.shape
    if method == "auto":
        method = "svd" if min(m, n) <= 1024 else "block"
    info: dict = {"method": method, "iters": 0, "converged": True}
    if method == "svd":
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        v, s = Vh[:, 0, :], S[:, 0]
    elif method == "block":
        k = max(1, min(block, m, n))
        q = torch.randn(B, n, k, dtype=dtype, device=w.device, generator=generator)
        q = torch.linalg.qr(q).Q
        v_old = None
        info["converged"] = False
        for it in range(1, max_iters + 1):
            z = torch.bmm(w, q)                              # (B, m, k)
            q = torch.linalg.qr(torch.bmm(w.transpose(1, 2), z)).Q   # (B, n, k)
            _, Sz, Vz = torch.linalg.svd(torch.bmm(w, q), full_matrices=False)  # Rayleigh-Ritz
            v = torch.bmm(q, Vz.transpose(1, 2)[:, :, :1]).squeeze(-1)
            s = Sz[:, 0]
            if v_old is not None:
                gap = 1 - (v * v_old).sum(-1).abs()
                if float(gap.max()) <= tol:
                    info["converged"] = True
                    break
            v_old = v
        info["iters"] = it
    else:
        raise ValueError(f"method must be 'auto', 'svd' or 'block', not {method!r}")
    idx = v.abs().argmax(-1, keepdim=True)
    v = v * torch.where(torch.gather(v, -1, idx) >= 0, 1.0, -1.0).to(v.dtype)
    u = torch.bmm(w, v.unsqueeze(-1)).squeeze(-1) / s.clamp_min(_TINY).unsqueeze(-1)
    if single:
        return u[0], s[0], v[0], info
    return u, s, v, info


def abs_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|<a, b>| / (||a|| ||b||)`` along the last dim (0 where a vector is zero). Shapes broadcast."""
    num = (a * b).sum(-1).abs()
    den = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return num / den.clamp_min(_TINY)


def _gram_fro(w: torch.Tensor) -> torch.Tensor:
    """``||W^T W||_F = ||W W^T||_F`` for ``(..., m, n)``, via the smaller Gram."""
    g = w @ w.transpose(-1, -2) if w.shape[-2] <= w.shape[-1] else w.transpose(-1, -2) @ w
    return torch.linalg.matrix_norm(g)


def grams(w: torch.Tensor, input_space: bool = True, output_space: bool = True
          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(W^T W, W W^T)`` in float32 (float64 for float64 ``w``); half/bfloat16 ``w`` is multiplied in its own
    dtype (fp32 accumulation, entries rounded to 3 digits). ``None`` for a space not asked for."""
    out_dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    wc = w if w.dtype in (torch.float16, torch.bfloat16, torch.float64) else w.float()
    gi = (wc.transpose(-1, -2) @ wc).to(out_dtype) if input_space else None
    go = (wc @ wc.transpose(-1, -2)).to(out_dtype) if output_space else None
    return gi, go


def gram_cosine(ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    """``tr(G_a G_b) / (||G_a||_F ||G_b||_F)`` for symmetric ``G`` (= their Frobenius cosine); 0 if one is zero."""
    num = (ga * gb).sum((-1, -2))
    return num / (torch.linalg.matrix_norm(ga) * torch.linalg.matrix_norm(gb)).clamp_min(_TINY)


def gram_alignment(wa: torch.Tensor, wb: torch.Tensor, space: str = "input") -> torch.Tensor:
    """sigma^2-weighted alignment ``tr(G_a G_b) / (||G_a||_F ||G_b||_F)`` (spec proposal).

    ``wa, wb``: ``(..., m, n)`` (batched pairs allowed). ``space="input"``: ``G = W^T W`` (needs equal ``n``),
    ``"output"``: ``G = W W^T`` (needs equal ``m``). Returns ``(...)`` in [0, 1] (0 for a zero matrix),
    computed in the inputs' dtype (use float32/64).
    """
    if space == "input":
        if wa.shape[-1] != wb.shape[-1]:
            raise ValueError(f"input-space alignment needs equal in_features, got {wa.shape} and {wb.shape}")
        cross = wa @ wb.transpose(-1, -2)      # tr(Wa^T Wa Wb^T Wb) = ||Wa Wb^T||_F^2
    elif space == "output":
        if wa.shape[-2] != wb.shape[-2]:
            raise ValueError(f"output-space alignment needs equal out_features, got {wa.shape} and {wb.shape}")
        cross = wa.transpose(-1, -2) @ wb      # tr(Wa Wa^T Wb Wb^T) = ||Wa^T Wb||_F^2
    else:
        raise ValueError(f"space must be 'input' or 'output', not {space!r}")
    num = torch.linalg.matrix_norm(cross).square()
    return num / (_gram_fro(wa) * _gram_fro(wb)).clamp_min(_TINY)


def gradient_coherence(sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """Signed cosine between two (summed) gradients, flattened: ``<S_a, S_b> / (||S_a|| ||S_b||)`` (0 if zero)."""
    a, b = sa.reshape(-1), sb.reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"gradient coherence needs equal shapes, got {tuple(sa.shape)} and {tuple(sb.shape)}")
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return torch.dot(a, b) / den.clamp_min(_TINY)


# ----------------------------------------------------------------------------------------------------------
# checkpoint report (weights only)
# ----------------------------------------------------------------------------------------------------------
@dataclass
class TypeReport:
    """Adjacent-layer continuity of one projection type. ``pairs[i] = (l_a, l_b)``; each metric list is
    aligned with ``pairs`` (``nan`` where the dims of the two layers differ)."""

    type: str
    shape: tuple[int, int]
    pairs: list[tuple[int, int]] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in METRICS[:4]})

    def mean(self, metric: str) -> float:
        xs = [x for x in self.values[metric] if x == x]
        return sum(xs) / len(xs) if xs else float("nan")


def continuity_report(groups: Mapping[str, list[Projection]], load, *, method: str = "auto",
                      alignment: bool = True, device: str | torch.device = "cpu", progress=None,
                      generator: torch.Generator | None = None) -> list[TypeReport]:
    """Weight continuity of every type in ``groups`` (from ``group_projections``).

    ``load(name) -> Tensor`` returns one weight (any dtype; moved to ``device``, computed in float32). Holds
    at most two matrices of a type at a time. ``progress(n)`` is called once per matrix. Metrics:
    ``v1``, ``u1`` (``leading_singular_vectors(method=...)``), ``align_in``, ``align_out`` (if ``alignment``).
    """
    reports = []
    for type_, projs in groups.items():
        rep = TypeReport(type_, projs[0].shape)
        if not alignment:
            rep.values.pop("align_in"), rep.values.pop("align_out")
        prev = None
        for p in projs:
            w = as_matrix(load(p.name)).to(device=device, dtype=torch.float32)
            u, _, v, _ = leading_singular_vectors(w, method=method, generator=generator)
            gi, go = grams(w) if alignment else (None, None)
            cur = (p, w.shape, u, v, gi, go)
            if prev is not None:
                pp, pshape, pu, pv, pgi, pgo = prev
                rep.pairs.append((pp.layer, p.layer))
                same_in, same_out = pshape[1] == w.shape[1], pshape[0] == w.shape[0]
                nan = float("nan")
                rep.values["v1"].append(float(abs_cos(pv, v)) if same_in else nan)
                rep.values["u1"].append(float(abs_cos(pu, u)) if same_out else nan)
                if alignment:
                    rep.values["align_in"].append(float(gram_cosine(pgi, gi)) if same_in else nan)
                    rep.values["align_out"].append(float(gram_cosine(pgo, go)) if same_out else nan)
            prev = cur
            del w
            if progress is not None:
                progress(1)
        reports.append(rep)
    return reports


# ----------------------------------------------------------------------------------------------------------
# the training monitor
# ----------------------------------------------------------------------------------------------------------
class ContinuityMonitor:
    """Continuity metrics during training; plugs into the tracker (``update`` every step, ``metrics`` at flush).

    ``ContinuityMonitor(model_or_named_params, every=1, *, power_steps=1, alignment=True, coherence=True,
    types=None, seed=0, warmup_steps=20, max_batch_bytes=2**28)``

    - ``model_or_named_params``: an ``nn.Module`` or ``(name, Parameter)`` pairs; grouped by
      ``group_projections`` (raises ``ValueError`` if no type has two layers). The construction runs
      ``warmup_steps`` power-iteration steps from random start vectors (seeded by ``seed``).
    - ``update()`` (after each optimizer step, gradients still present): adds each ``.grad`` to its running
      sum (float32, one ``torch._foreach_add_``; a parameter whose ``.grad`` is None is skipped that step),
      and every ``every``-th call runs ``power_steps`` warm-started power-iteration steps: same-shape matrices
      of at most ``stack_max_numel`` elements are stacked (chunks of at most ``max_batch_bytes``) and
      multiplied with ``torch.bmm``; larger ones are not copied (one ``torch.mv`` per matrix into a shared
      buffer, normalised in one batch). Half/bfloat16 weights are multiplied in their dtype. All work stays
      on the parameters' device; nothing is copied to the host.
    - ``metrics()`` (at flush) returns 0-dim float32 tensors on the device under
      ``continuity/{v1,u1,align_in,align_out,coherence}/{type}/{l}-{l+1}`` and per-type means under
      ``continuity/{metric}/{type}``. ``align_*`` (if ``alignment``) are computed from the weights at flush
      time (two Grams per matrix, in the weights' dtype for half/bfloat16: the costly part of a flush);
      ``coherence`` (if ``coherence``) from the running gradient sums.
      v1/u1 are the warm-started estimates (they lag a fast-changing spectrum or a small spectral gap).
    - ``state_dict()`` / ``load_state_dict()``: running sums, power-iteration vectors and counters, keyed by
      parameter name.

    Memory: one float32 copy of the grouped weights for the gradient sums (``coherence=False`` avoids it);
    the stacked chunk of an update is transient. Source: Jeong, Paeng, Suh 2026; spec laws.md.
    """

    def __init__(self, model_or_named_params, every: int = 1, *, power_steps: int = 1, alignment: bool = True,
                 coherence: bool = True, types: Iterable[str] | None = None, seed: int = 0,
                 warmup_steps: int = 20, max_batch_bytes: int = 2 ** 28, stack_max_numel: int = 2 ** 20):
        if isinstance(model_or_named_params, torch.nn.Module):
            named = list(model_or_named_params.named_parameters())
        else:
            named = list(model_or_named_params)
        if every < 1 or power_steps < 1:
            raise ValueError("every and power_steps must be >= 1")
        self.every, self.power_steps = int(every), int(power_steps)
        self.alignment, self.coherence = bool(alignment), bool(coherence)
        self.max_batch_bytes = int(max_batch_bytes)
        params = dict(named)
        self.groups = group_projections(named, types)
        if not self.groups:
            raise ValueError(
                "ContinuityMonitor: no projection type with weights in two or more layers; parameter names need a"
                " `.<int>.` layer component (e.g. `layers.3.mlp.up_proj.weight`)"
            )
        self.names: list[str] = [p.name for ps in self.groups.values() for p in ps]
        self.params: list[torch.Tensor] = [params[n] for n in self.names]
        self._index = {n: i for i, n in enumerate(self.names)}
        gen = torch.Generator().manual_seed(seed)
        # buckets of same-shape matrices: (shape, [param indices]); vectors stored per bucket
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(self.params):
            by_shape[(tuple(as_matrix(p).shape), p.device)].append(i)
        self._buckets: list[tuple[list[int], torch.Tensor, torch.Tensor, bool]] = []
        self._where: dict[int, tuple[int, int]] = {}
        for (shape, device), idx in by_shape.items():
            m, n = shape
            stacked = m * n <= stack_max_numel
            per = max(1, self.max_batch_bytes // max(1, m * n * 4)) if stacked else len(idx)
            for s in range(0, len(idx), per):
                chunk = idx[s: s + per]
                v = _normalize(torch.randn(len(chunk), n, generator=gen)).to(device)
                u = torch.zeros(len(chunk), m, device=device)
                for r, i in enumerate(chunk):
                    self._where[i] = (len(self._buckets), r)
                self._buckets.append((chunk, u, v, stacked))
        self.sums = [torch.zeros(as_matrix(p).shape, dtype=torch.float32, device=p.device) for p in self.params] \
            if self.coherence else []
        self.num_updates = 0
        self.num_power = 0
        if warmup_steps > 0:  # converge from the random start once, so the first metrics are meaningful
            self._refresh_power(warmup_steps)

    # -- training-time work -------------------------------------------------------------------------------
    @torch.no_grad()
    def _refresh_power(self, steps: int = 1) -> None:
        for idx, u, v, stacked in self._buckets:
            ws = [as_matrix(self.params[i].detach()) for i in idx]
            if stacked:  # small matrices: one copy into a stack, then two bmm per step
                w = ws[0].unsqueeze(0) if len(ws) == 1 else torch.stack(ws)
                u_new, _, v_new = power_iteration(w, v, steps)
                u.copy_(u_new)
                v.copy_(v_new)
                continue
            # large matrices: no copy; one mat-vec launch per matrix into a shared buffer, batched normalisation
            cdt = _compute_dtype(ws[0].dtype, v.dtype)
            ws = [w.to(cdt) for w in ws]
            for _ in range(steps):
                vl, ul = v.to(cdt), torch.empty(u.shape, dtype=cdt, device=u.device)
                for r, w in enumerate(ws):
                    torch.mv(w, vl[r], out=ul[r])
                u.copy_(_normalize(ul.to(u.dtype)))
                ul, xl = u.to(cdt), torch.empty(v.shape, dtype=cdt, device=v.device)
                for r, w in enumerate(ws):
                    torch.mv(w.t(), ul[r], out=xl[r])
                v.copy_(_normalize(xl.to(v.dtype), v))

    @torch.no_grad()
    def update(self) -> None:
        """Accumulate gradients; every ``every``-th call one warm-started power-iteration round. No host sync."""
        self.num_updates += 1
        if self.coherence:
            pairs = [(s, as_matrix(p.grad)) for s, p in zip(self.sums, self.params) if p.grad is not None]
            if pairs:  # one fused launch where dtypes allow; mixed (bf16 grad into fp32 sum) is promoted
                sums, grads = zip(*pairs)
                torch._foreach_add_(list(sums), list(grads))
        if self.num_updates % self.every == 0:
            self._refresh_power(self.power_steps)
            self.num_power += 1

    # -- flush ---------------------------------------------------------------------------------------------
    def _vectors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, r = self._where[i]
        _, u, v, _ = self._buckets[b]
        return u[r], v[r]

    @torch.no_grad()
    def metrics(self) -> dict[str, torch.Tensor]:
        """0-dim float32 tensors (on the parameters' device) keyed ``continuity/{metric}/{type}[/{a}-{b}]``."""
        out: dict[str, torch.Tensor] = {}
        for type_, projs in self.groups.items():
            per: dict[str, list[torch.Tensor]] = defaultdict(list)
            prev = None  # (projection, index, G_in, G_out) of the previous layer: each Gram is formed once
            for pb in projs:
                ib = self._index[pb.name]
                gi = go = None
                if self.alignment:
                    gi, go = grams(as_matrix(self.params[ib].detach()))
                if prev is not None:
                    pa, ia, gia, goa = prev
                    ua, va = self._vectors(ia)
                    ub, vb = self._vectors(ib)
                    vals: dict[str, torch.Tensor] = {}
                    same_in, same_out = pa.shape[1] == pb.shape[1], pa.shape[0] == pb.shape[0]
                    if same_in:
                        vals["v1"] = abs_cos(va, vb)
                    if same_out:
                        vals["u1"] = abs_cos(ua, ub)
                    if self.alignment and same_in:
                        vals["align_in"] = gram_cosine(gia, gi).float()
                    if self.alignment and same_out:
                        vals["align_out"] = gram_cosine(goa, go).float()
                    if self.coherence and pa.shape == pb.shape:
                        vals["coherence"] = gradient_coherence(self.sums[ia], self.sums[ib])
                    for k, x in vals.items():
                        out[f"continuity/{k}/{type_}/{pa.layer}-{pb.layer}"] = x
                        per[k].append(x)
                prev = (pb, ib, gi, go)
            for k, xs in per.items():
                out[f"continuity/{k}/{type_}"] = torch.stack(xs).mean()
        return out

    # -- checkpointing -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"num_updates", "num_power", "u": {name: (out,)}, "v": {name: (in,)}, "grad_sum": {name: (out, in)}}``
        (tensors cloned, on their device)."""
        u, v = {}, {}
        for i, n in enumerate(self.names):
            ui, vi = self._vectors(i)
            u[n], v[n] = ui.clone(), vi.clone()
        return {
            "num_updates": self.num_updates,
            "num_power": self.num_power,
            "u": u,
            "v": v,
            "grad_sum": {n: s.clone() for n, s in zip(self.names, self.sums)},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from ``state_dict()``. Raises ``ValueError`` naming the first missing/mismatched entry."""
        for key in ("u", "v"):
            missing = [n for n in self.names if n not in state.get(key, {})]
            if missing:
                raise ValueError(f"ContinuityMonitor state has no {key!r} for {missing[0]}; was it saved from this model?")
        if self.coherence:
            missing = [n for n in self.names if n not in state.get("grad_sum", {})]
            if missing:
                raise ValueError(f"ContinuityMonitor state has no gradient sum for {missing[0]} (saved with coherence=False?)")
        with torch.no_grad():
            for i, n in enumerate(self.names):
                u, v = self._vectors(i)
                for dst, src, what in ((u, state["u"][n], "u"), (v, state["v"][n], "v")):
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ValueError(f"ContinuityMonitor state {what}[{n}] has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
                    dst.copy_(src)
                if self.coherence:
                    src = state["grad_sum"][n]
                    if tuple(src.shape) != tuple(self.sums[i].shape):
                        raise ValueError(f"ContinuityMonitor state grad_sum[{n}] has shape {tuple(src.shape)}, expected {tuple(self.sums[i].shape)}")
                    self.sums[i].copy_(src)
        self.num_updates = int(state.get("num_updates", 0))
        self.num_power = int(state.get("num_power", 0))


# ----------------------------------------------------------------------------------------------------------
# nulls and checkpoint snapshots (exact SVD): what the ablation experiments log at log-spaced steps
# ----------------------------------------------------------------------------------------------------------
def random_quantile(d: int, n_pairs: int = 1, q: float = 0.99, draws: int = 20000, seed: int = 0) -> float:
    """The ``q``-quantile of the MEAN over ``n_pairs`` independent ``|cos|`` of independent uniform unit
    vectors in ``d`` dims (``cos^2 ~ Beta(1/2, (d-1)/2)``), by Monte Carlo (``draws`` samples, seeded).

    This is the statistical basis of the 'low' label: a mean adjacent-layer continuity of ``n_pairs`` pairs
    below this value is what independent random directions give in a fraction ``q`` of cases (the weights at
    a random init are exactly that null). Deterministic for a given ``seed``."""
    if d < 2 or n_pairs < 1:
        raise ValueError(f"random_quantile needs d >= 2 and n_pairs >= 1, got d={d}, n_pairs={n_pairs}")
    g = torch.Generator().manual_seed(seed)
    beta = torch.distributions.Beta(torch.tensor(0.5, dtype=torch.float64), torch.tensor((d - 1) / 2, dtype=torch.float64))
    torch_state = torch.random.get_rng_state()
    try:  # torch.distributions samples from the global generator: seed it and restore it afterwards
        torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=g)))
        x = beta.sample((draws, n_pairs)).sqrt().mean(1)
    finally:
        torch.random.set_rng_state(torch_state)
    return float(torch.quantile(x, q))


def subspace_overlap(va: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """``||Va^T Vb||_F^2 / k`` for orthonormal columns ``Va, Vb`` of shape ``(d, k)``: the mean squared cosine
    of the principal angles between the two top-k subspaces. In [0, 1]; random expectation ``k / d``."""
    k = va.shape[-1]
    return (va.transpose(-1, -2) @ vb).square().sum((-1, -2)) / k


def centred_gram_alignment(wa: torch.Tensor, wb: torch.Tensor, space: str = "input") -> torch.Tensor:
    """Frobenius cosine of the TRACELESS parts of the Grams, ``G - (tr G / n) I`` (``G = W^T W`` input space,
    ``W W^T`` output space), computed in float64.

    Why: the raw sigma^2-weighted alignment ``gram_alignment`` is dominated by the isotropic part of ``G`` (a
    random matrix has ``G ~ c I + noise``), so it sits at ``m/(m+n)`` (0.5 for square weights) for independent
    random matrices and moves little in training. Removing the identity part leaves the anisotropy, whose
    cosine is ~0 (order ``1/n``) for independent random weights and 1 when both layers stretch the same
    directions by proportional amounts. Signed, in [-1, 1]."""
    wa, wb = wa.double(), wb.double()
    if space == "input":
        ga, gb = wa.transpose(-1, -2) @ wa, wb.transpose(-1, -2) @ wb
    elif space == "output":
        ga, gb = wa @ wa.transpose(-1, -2), wb @ wb.transpose(-1, -2)
    else:
        raise ValueError(f"space must be 'input' or 'output', not {space!r}")
    if ga.shape != gb.shape:
        raise ValueError(f"{space}-space alignment needs equal Gram sizes, got {tuple(ga.shape)} and {tuple(gb.shape)}")
    n = ga.shape[-1]
    eye = torch.eye(n, dtype=ga.dtype, device=ga.device)
    ca = ga - ga.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / n * eye
    cb = gb - gb.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / n * eye
    return gram_cosine(ca, cb)


def _off_span(v: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``v`` with its component in the column span of ``basis`` (d, r) removed, normalised."""
    q = torch.linalg.qr(basis).Q
    r = v - q @ (q.T @ v)
    return r / torch.linalg.vector_norm(r).clamp_min(_TINY)


def snapshot(weights: Mapping[str, list[torch.Tensor]], *, init: Mapping[str, list[torch.Tensor]] | None = None,
             input_means: Mapping[str, list[torch.Tensor]] | None = None, top_k: int = 4) -> dict[str, dict]:
    """Exact-SVD continuity metrics of every type: ``weights[type]`` = the matrices of consecutive layers
    (``(out, in)`` each, any float dtype; computed in float64 on their device).

    Per type, means over adjacent pairs (per-pair lists under ``pairs/<metric>``):

    - ``v1``, ``u1``: ``|cos|`` of the leading right / left singular vectors;
    - ``sub_in``, ``sub_out``: top-``top_k`` subspace overlap (``subspace_overlap``; random ``k/d``);
    - ``align_in``, ``align_out``: raw sigma^2-weighted alignment (``gram_alignment``; random ~``m/(m+n)``);
      ``calign_in``, ``calign_out``: the centred replacement (``centred_gram_alignment``; random ~0);
    - with ``init`` (the same matrices at step 0): ``dw_rel`` = mean over layers of ``||W - W_0||_2 /
      ||W_0||_2``, and ``dw_v1``, ``dw_u1``: continuity of the leading singular vectors of ``W - W_0``;
    - with ``input_means`` (each layer's mean input vector, length ``in``): ``v1_perp`` = ``v1`` continuity after
      projecting both layers' ``v1`` off the span of the two mean-input directions (the null for ReLU nets,
      whose inputs are positive and share a large mean direction that can align ``v1`` by itself),
      ``v1_mean`` = ``|cos(v1, mean input)|`` averaged over layers;
    - ``s1_s2``: mean over layers of ``sigma_1 / sigma_2`` (spectral gap: how well ``v1`` is defined).

    Returns ``{type: {metric: float, "pairs/<metric>": [float, ...], "dims": [in, out], "n_pairs": int}}``.
    Raises ``ValueError`` for a type with fewer than two matrices."""
    out: dict[str, dict] = {}
    for type_, ws in weights.items():
        if len(ws) < 2:
            raise ValueError(f"snapshot: type {type_!r} has {len(ws)} matrix; need two or more layers")
        svd = []
        for w in ws:
            U, S, Vh = torch.linalg.svd(as_matrix(w).detach().double(), full_matrices=False)
            svd.append((U, S, Vh))
        per: dict[str, list[float]] = defaultdict(list)
        k = max(1, min(top_k, *(s.numel() for _, s, _ in svd)))
        for (Ua, Sa, Vha), (Ub, Sb, Vhb), wa, wb in zip(svd, svd[1:], ws, ws[1:]):
            if Vha.shape[1] == Vhb.shape[1]:
                per["v1"].append(float(abs_cos(Vha[0], Vhb[0])))
                per["sub_in"].append(float(subspace_overlap(Vha[:k].T, Vhb[:k].T)))
                per["align_in"].append(float(gram_alignment(wa.detach().double(), wb.detach().double(), "input")))
                per["calign_in"].append(float(centred_gram_alignment(wa.detach(), wb.detach(), "input")))
            if Ua.shape[0] == Ub.shape[0]:
                per["u1"].append(float(abs_cos(Ua[:, 0], Ub[:, 0])))
                per["sub_out"].append(float(subspace_overlap(Ua[:, :k], Ub[:, :k])))
                per["align_out"].append(float(gram_alignment(wa.detach().double(), wb.detach().double(), "output")))
                per["calign_out"].append(float(centred_gram_alignment(wa.detach(), wb.detach(), "output")))
        for _, S, _ in svd:
            per["s1_s2"].append(float(S[0] / S[1].clamp_min(_TINY)) if S.numel() > 1 else float("nan"))
        if init is not None:
            dsvd = []
            for w, w0 in zip(ws, init[type_]):
                d = as_matrix(w).detach().double() - as_matrix(w0).detach().double()
                w0n = torch.linalg.matrix_norm(as_matrix(w0).double(), ord=2)
                U, S, Vh = torch.linalg.svd(d, full_matrices=False)
                per["dw_rel"].append(float(S[0] / w0n.clamp_min(_TINY)))
                dsvd.append((U[:, 0], S[0], Vh[0]))
            for (ua, sa, va), (ub, sb, vb) in zip(dsvd, dsvd[1:]):
                if sa > 0 and sb > 0 and va.shape == vb.shape:
                    per["dw_v1"].append(float(abs_cos(va, vb)))
                if sa > 0 and sb > 0 and ua.shape == ub.shape:
                    per["dw_u1"].append(float(abs_cos(ua, ub)))
        if input_means is not None and type_ in input_means:
            ms = [m.detach().double().reshape(-1) for m in input_means[type_]]
            for (_, _, Vh), m in zip(svd, ms):
                per["v1_mean"].append(float(abs_cos(Vh[0], m)))
            for (_, _, Vha), (_, _, Vhb), ma, mb in zip(svd, svd[1:], ms, ms[1:]):
                if Vha.shape[1] == Vhb.shape[1] == ma.numel() == mb.numel():
                    basis = torch.stack([ma, mb], 1)
                    per["v1_perp"].append(float(abs_cos(_off_span(Vha[0], basis), _off_span(Vhb[0], basis))))
        rec: dict = {"dims": [int(ws[0].shape[1]) if ws[0].dim() == 2 else int(as_matrix(ws[0]).shape[1]),
                              int(ws[0].shape[0])], "n_pairs": len(ws) - 1, "top_k": k}
        for key, xs in per.items():
            good = [x for x in xs if x == x]
            rec[key] = sum(good) / len(good) if good else float("nan")
            rec[f"pairs/{key}"] = xs
        out[type_] = rec
    return out
