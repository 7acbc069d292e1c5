"""``conserve experiment continuity``: the geometric-continuity ablation of Jeong, Paeng, Suh 2026.

Part ``mlp``: a residual MLP on MNIST, ``h <- embed(x)``, then per layer ``h <- h + act(W_l norm(h))``
(``NoRes``: ``h <- relu(W_l norm(h))``), then ``head(h)``; depth 16, width 256, hidden weights
``layers.{l}.fc.weight`` without bias; ``--norm none|layernorm|rmsnorm`` (no affine gain). Variants: NoRes,
Res+None (linear residual net), Res+Radial (the scaled radial ``z tanh(||z|| / sqrt(d))``, rotation-
equivariant), Res+RadialUnscaled (the literal ``z tanh(||z||)``: at a PyTorch default init ``||z||`` is
3-83, tanh saturates and the variant IS Res+None; kept to show it, flagged by the saturation report),
Res+ReLU, Res+GELU, Res+SiLU. Init of the hidden weights: PyTorch's ``nn.Linear`` default for the residual
nets (``U(-1/sqrt(n), 1/sqrt(n))``, std ``1/sqrt(3n)``), Kaiming-normal (ReLU gain) for NoRes so the plain
net trains at all; ``--init-std S`` (N(0, S^2), residual nets) or ``--init-scale C`` (C x the default).
Part ``lm``: the project's reference LM (``conserve.models.lm.DecoderLM``, HF Llama names) on bytes of a
text file, one model per ``--lm-acts`` entry: ``swiglu``, ``relu``, ``gelu``, ``silu`` or, with the MLP
activation removed/replaced, ``none`` (``down(up x)``) and ``radial`` (scaled radial on the intermediate).

Measured (``conserve.continuity.snapshot``, exact SVD in float64) at log-spaced checkpoints (step 0 = the
init) and reported as final, peak and step of peak, mean +- sd over ``--seeds``:
``v1``/``u1`` adjacent-layer ``|cos|``; top-k subspace overlap; sigma1/sigma2; ``||W - W_0||_2/||W_0||_2``
per layer and the continuity of ``W - W_0``; the raw sigma^2-weighted alignment and its centred
replacement (traceless Grams; raw is ~m/(m+n) for random weights, see ``centred_gram_alignment``);
``v1_perp`` (continuity left after projecting off the layers' mean-input directions: the null for ReLU
nets, whose positive inputs share a mean direction). Gradient coherence: cumulative
(``cos(sum_t g_l, sum_t g_{l+1})``, the spec's definition) and per step (``cos(g_l(t), g_{l+1}(t))``,
averaged over the steps of each checkpoint window). 'low' threshold: the 99% quantile of the mean |cos| of
``n_pairs`` independent random unit vectors in ``d`` dims (``conserve.continuity.random_quantile``).

Paper (as stated in the spec, laws.md "Geometric continuity"; no numeric values beyond these): coherence
~0.93 with residuals vs ~0.05 without; weight continuity high only with element-wise activations, ~0.22
for Res+None and Res+Radial; in transformers q, k, gate, up continuous in v1, o and down in u1, v low.

Output (``--out DIR``): ``results.md``, ``results.json`` (config, per-seed checkpoints, aggregates),
``mlp_curves.png``, ``lm_curves.png``.
"""
from __future__ import annotations

import gzip
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..continuity import group_projections, random_baseline, random_quantile, snapshot
from ..errors import UsageError
from ..report import json_safe

VARIANTS = {  # name -> (residual, activation)
    "NoRes": (False, "relu"),
    "Res+None": (True, "none"),
    "Res+Radial": (True, "radial"),
    "Res+RadialUnscaled": (True, "radial_unscaled"),
    "Res+ReLU": (True, "relu"),
    "Res+GELU": (True, "gelu"),
    "Res+SiLU": (True, "silu"),
}
PARTS = ("mlp", "lm", "all")
NORMS = ("none", "layernorm", "rmsnorm")
LM_ACTS = ("swiglu", "relu", "gelu", "silu", "none", "radial")
SATURATED = 0.99   # tanh above this: the radial factor is ~1 for that sample
IDENTITY_GAP = 0.01  # mean ||act(z) - z|| / ||z|| below this: the activation is effectively the identity
LOW_Q = 0.99       # quantile of the random null used for the 'low' label


def radial(z: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Rotation-equivariant ``z * tanh(||z|| / scale)`` (norm over the last dim; ``scale`` default ``sqrt(d)``,
    so that a vector with entries of order 1 sits in the non-saturated range): ``radial(R z) = R radial(z)``."""
    s = math.sqrt(z.shape[-1]) if scale is None else scale
    return z * torch.tanh(torch.linalg.vector_norm(z, dim=-1, keepdim=True) / s)


def radial_unscaled(z: torch.Tensor) -> torch.Tensor:
    """The literal ``z * tanh(||z||)``: saturated (the identity) whenever ``||z|| >~ 2.6``."""
    return radial(z, 1.0)


ACTIVATIONS = {"none": lambda z: z, "radial": radial, "radial_unscaled": radial_unscaled, "relu": F.relu,
               "gelu": F.gelu, "silu": F.silu}
RADIAL_SCALE = {"radial": None, "radial_unscaled": 1.0}


def _norm(kind: str, width: int) -> nn.Module:
    if kind == "none":
        return nn.Identity()
    if kind == "layernorm":
        return nn.LayerNorm(width, elementwise_affine=False)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, elementwise_affine=False)
    raise UsageError(f"--norm must be one of {', '.join(NORMS)}, not {kind!r}")


class _Layer(nn.Module):
    def __init__(self, width: int, norm: str):
        super().__init__()
        self.norm = _norm(norm, width)
        self.fc = nn.Linear(width, width, bias=False)


class ResidualMLP(nn.Module):
    """``(B, in_features) -> (B, classes)``; hidden weights ``layers.{l}.fc.weight`` (width x width).

    ``residual=False`` gives the plain net ``h <- act(W norm(h))`` (Kaiming-normal init); ``activation`` is a
    key of ``ACTIVATIONS``; ``norm`` one of ``NORMS`` (pre-norm of the branch input, no gain).
    ``init_std``: hidden weights N(0, init_std^2) (residual nets; the plain net keeps Kaiming);
    ``init_scale``: the hidden weights' init multiplied by this. ``forward(x, probe=dict)`` also records,
    per layer, ``z`` norms, branch-input norms and the activation's deviation from the identity."""

    def __init__(self, residual: bool, activation: str, depth: int = 16, width: int = 256,
                 in_features: int = 784, classes: int = 10, *, norm: str = "none", init_std: float | None = None,
                 init_scale: float = 1.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}")
        self.residual, self.activation, self.act = residual, activation, ACTIVATIONS[activation]
        self.embed = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(_Layer(width, norm) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        with torch.no_grad():
            for layer in self.layers:
                if not residual:
                    nn.init.kaiming_normal_(layer.fc.weight, nonlinearity="relu")
                elif init_std is not None:
                    nn.init.normal_(layer.fc.weight, std=init_std)
                layer.fc.weight.mul_(init_scale)

    def forward(self, x: torch.Tensor, probe: dict | None = None) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            z = layer.fc(layer.norm(h))
            a = self.act(z)
            if probe is not None:
                zn = torch.linalg.vector_norm(z, dim=-1)
                probe.setdefault("z_norm", []).append(zn)
                probe.setdefault("h_norm", []).append(torch.linalg.vector_norm(h, dim=-1))
                probe.setdefault("a_norm", []).append(torch.linalg.vector_norm(a, dim=-1))
                probe.setdefault("gap", []).append(torch.linalg.vector_norm(a - z, dim=-1) / zn.clamp_min(1e-30))
                if self.activation in RADIAL_SCALE:
                    s = RADIAL_SCALE[self.activation] or math.sqrt(z.shape[-1])
                    probe.setdefault("tanh", []).append(torch.tanh(zn / s))
            h = h + a if self.residual else a
        return self.head(h)


def activation_report(model: ResidualMLP, x: torch.Tensor) -> dict:
    """On a probe batch: ``identity_gap`` = mean ``||act(z) - z|| / ||z||`` (0: the activation is the identity),
    ``block_change`` = mean ``||act(z)|| / ||h||`` (how much one block changes the residual stream), ``z_norm``
    median, and for radial activations ``saturated`` = fraction of (sample, layer) with ``tanh > 0.99`` and
    per layer ``saturated_per_layer``."""
    probe: dict = {}
    with torch.no_grad():
        model(x, probe=probe)
    st = {k: torch.stack(v) for k, v in probe.items()}  # (layers, batch)
    out = {"identity_gap": float(st["gap"].mean()), "block_change": float((st["a_norm"] / st["h_norm"].clamp_min(1e-30)).mean()),
           "z_norm_median": float(st["z_norm"].median()), "z_norm_range": [float(st["z_norm"].min()), float(st["z_norm"].max())]}
    if "tanh" in st:
        sat = (st["tanh"] > SATURATED).double()
        out["saturated"] = float(sat.mean())
        out["saturated_per_layer"] = sat.mean(1).tolist()
    return out


# ------------------------------------------------------------------------------------- measurement
def input_means(model: nn.Module, groups: dict, run_forward) -> dict[str, list[torch.Tensor]]:
    """Mean input vector (over every leading dim) of each grouped Linear, by forward pre-hooks during
    ``run_forward()`` (the module of parameter ``a.b.weight`` is ``a.b``)."""
    modules = dict(model.named_modules())
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for projs in groups.values():
        for p in projs:
            mod = modules.get(p.name.removesuffix(".weight"))
            if mod is None:
                continue

            def pre(m, args, name=p.name):
                x = args[0].detach()
                sums[name] = x.reshape(-1, x.shape[-1]).double().mean(0)
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in hooks:
            h.remove()
    return {t: [sums[p.name] for p in ps] for t, ps in groups.items() if all(p.name in sums for p in ps)}


class GradStats:
    """Per type: cumulative gradient sums (the spec's cumulative coherence) and the per-step coherence
    ``cos(g_l(t), g_{l+1}(t))`` (mean over adjacent pairs) accumulated between ``window()`` calls."""

    def __init__(self, params: dict[str, torch.Tensor], groups: dict):
        self.types = {t: [params[p.name] for p in ps] for t, ps in groups.items()
                      if len({tuple(p.shape) for p in ps}) == 1}
        self.sums = {t: torch.zeros(len(ps), ps[0].numel(), dtype=torch.float64) for t, ps in self.types.items()}
        self.step_sum = {t: 0.0 for t in self.types}
        self.all_sum = {t: 0.0 for t in self.types}
        self.n = self.n_all = 0

    @staticmethod
    def _adjacent_cos(g: torch.Tensor) -> torch.Tensor:
        gn = g / torch.linalg.vector_norm(g, dim=1, keepdim=True).clamp_min(1e-300)
        return (gn[:-1] * gn[1:]).sum(1).mean()

    @torch.no_grad()
    def update(self) -> None:
        for t, ps in self.types.items():
            if any(p.grad is None for p in ps):
                continue
            g = torch.stack([p.grad.reshape(-1) for p in ps]).double()
            self.sums[t] += g
            c = float(self._adjacent_cos(g))
            self.step_sum[t] += c
            self.all_sum[t] += c
        self.n += 1
        self.n_all += 1

    def window(self) -> dict[str, float]:
        """``{"coherence/<type>": cumulative, "step_coherence/<type>": mean per-step since the last window}``."""
        out = {}
        for t in self.types:
            out[f"coherence/{t}"] = float(self._adjacent_cos(self.sums[t])) if self.n_all else math.nan
            out[f"step_coherence/{t}"] = self.step_sum[t] / self.n if self.n else math.nan
            self.step_sum[t] = 0.0
        self.n = 0
        return out

    def overall(self) -> dict[str, float]:
        return {t: self.all_sum[t] / self.n_all if self.n_all else math.nan for t in self.types}


CURVE_METRICS = ("v1", "u1", "v1_perp", "sub_in", "sub_out", "calign_in", "calign_out", "align_in", "dw_rel",
                 "dw_v1", "dw_u1", "s1_s2")


def checkpoint_steps(steps: int, per_decade: int) -> list[int]:
    """0 (the init) and log-spaced steps up to ``steps`` (1, 2, 3, ... densely at the start: the formation
    of continuity happens in the first tens of steps)."""
    from .common import log_steps

    return [0] + log_steps(steps, per_decade)


def train_with_checkpoints(model: nn.Module, groups: dict, batch, steps: int, opt, checkpoints: list[int],
                           probe_forward, progress=None, task=None) -> dict:
    """Train ``steps`` steps of cross-entropy on ``batch(step) -> (x, y)``; at every step in ``checkpoints``
    take an exact-SVD ``snapshot`` (with the step-0 weights as ``init`` and the mean inputs of
    ``probe_forward()``) and the gradient coherences. Returns ``{"curve": {"step", "loss", "<metric>/<type>"},
    "final": {type: snapshot + coherences}}``."""
    params = dict(model.named_parameters())
    def weights():
        return {t: [params[p.name].detach().clone() for p in ps] for t, ps in groups.items()}
    init = weights()
    stats = GradStats(params, groups)
    curve: dict[str, list] = {"step": [], "loss": []}
    loss_acc, n_acc, last = 0.0, 0, None
    marks = set(checkpoints)

    def record(step):
        nonlocal loss_acc, n_acc, last
        snap = snapshot(weights(), init=init, input_means=input_means(model, groups, probe_forward))
        coh = stats.window()
        curve["step"].append(step)
        curve["loss"].append(loss_acc / n_acc if n_acc else math.nan)
        loss_acc, n_acc = 0.0, 0
        for t, rec in snap.items():
            for m in CURVE_METRICS:
                curve.setdefault(f"{m}/{t}", []).append(rec.get(m, math.nan))
            for m in ("coherence", "step_coherence"):
                curve.setdefault(f"{m}/{t}", []).append(coh.get(f"{m}/{t}", math.nan))
        last = snap

    if 0 in marks:
        record(0)
    for step in range(1, steps + 1):
        x, y = batch(step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        stats.update()
        opt.step()
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise UsageError(f"the loss became {lv} at step {step}; lower --lr (or the init scale)")
        loss_acc += lv
        n_acc += 1
        if step in marks:
            record(step)
        if progress is not None:
            progress.advance(task)
    final = {}
    per_step = stats.overall()
    for t, rec in last.items():
        final[t] = {k: v for k, v in rec.items() if not k.startswith("pairs/")}
        final[t]["pairs"] = {k[6:]: v for k, v in rec.items() if k.startswith("pairs/")}
        final[t]["coherence"] = curve.get(f"coherence/{t}", [math.nan])[-1]
        final[t]["step_coherence_mean"] = per_step.get(t, math.nan)
        d_in, d_out = rec["dims"]
        final[t]["baseline_v1"], final[t]["baseline_u1"] = random_baseline(d_in), random_baseline(d_out)
        final[t]["low_v1"] = random_quantile(d_in, rec["n_pairs"], LOW_Q)
        final[t]["low_u1"] = random_quantile(d_out, rec["n_pairs"], LOW_Q)
    return {"curve": curve, "final": final}


def peak(curve: dict, key: str) -> tuple[float, int]:
    """(max value, its step) of a checkpoint series (NaN-safe)."""
    pts = [(v, s) for v, s in zip(curve.get(key, []), curve["step"]) if v == v]
    if not pts:
        return math.nan, -1
    v, s = max(pts)
    return float(v), int(s)


def mean_sd(xs) -> dict:
    """``{"mean", "sd", "n", "values"}`` over the finite values (sd: sample standard deviation, 0 for one value)."""
    vals = [float(x) for x in xs if x is not None and x == x and math.isfinite(x)]
    if not vals:
        return {"mean": math.nan, "sd": math.nan, "n": 0, "values": []}
    return {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals),
            "values": vals}


SUMMARY_FINAL = ("v1", "u1", "v1_perp", "v1_mean", "sub_in", "sub_out", "align_in", "calign_in", "calign_out",
                 "dw_rel", "dw_v1", "dw_u1", "s1_s2", "coherence", "step_coherence_mean")


def aggregate(runs: list[dict], type_: str) -> dict:
    """Mean +- sd over seeds of the final metrics of ``type_``, and of the peak / step of peak of v1 and u1."""
    out = {m: mean_sd([r["final"][type_].get(m, math.nan) for r in runs]) for m in SUMMARY_FINAL}
    for m in ("v1", "u1", "v1_perp"):
        pk = [peak(r["curve"], f"{m}/{type_}") for r in runs]
        out[f"{m}_peak"] = mean_sd([p[0] for p in pk])
        out[f"{m}_peak_step"] = mean_sd([p[1] for p in pk])
    for extra in ("test_accuracy", "final_loss"):
        if extra in runs[0]:
            out[extra] = mean_sd([r[extra] for r in runs])
    return out


# ------------------------------------------------------------------------------------------ configs
@dataclass
class MLPConfig:
    depth: int = 16
    width: int = 256
    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    optimizer: str = "adam"
    betas: tuple[float, float] = (0.9, 0.999)
    norm: str = "none"
    init_std: float | None = None
    init_scale: float = 1.0
    seed: int = 0
    seeds: int = 1
    per_decade: int = 6
    probe_size: int = 512
    variants: tuple[str, ...] = tuple(VARIANTS)
    device: str = "cpu"
    log_every: int = 0  # not read: the checkpoints are log-spaced (per_decade)


@dataclass
class LMAblationConfig:
    acts: tuple[str, ...] = ("swiglu",)
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 344
    seq_len: int = 128
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    seeds: int = 1
    per_decade: int = 6
    device: str = "cpu"
    log_every: int = 0  # not read: the checkpoints are log-spaced (per_decade)


def _optimizer(name: str, params, lr: float, betas=(0.9, 0.999)):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=tuple(betas))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise UsageError(f"--optimizer must be 'adam' or 'sgd', not {name!r}")


def mnist_tensors(root) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): images normalised with the MNIST mean/std, flattened to 784, float32."""
    from ..images import MNIST_MEAN, MNIST_STD, load_mnist

    out = []
    for split in ("train", "test"):
        x, y = load_mnist(root, split)
        out += [((x.float() / 255 - MNIST_MEAN) / MNIST_STD).reshape(len(x), -1), y]
    return tuple(out)


def _warnings(name: str, act: str, reports: dict) -> list[str]:
    out = []
    if act == "none":
        return out
    for when, rep in reports.items():
        if rep["identity_gap"] < IDENTITY_GAP:
            sat = f", {100 * rep['saturated']:.1f}% of samples with tanh > {SATURATED}" if "saturated" in rep else ""
            out.append(f"{name}: at {when} (worst seed) the activation is effectively the identity (mean ||act(z) - z|| / ||z|| = "
                       f"{rep['identity_gap']:.2e}{sat}; median ||z|| = {rep['z_norm_median']:.3g}): its rows measure "
                       "Res+None, not a non-linear net")
    return out


def _worst(runs: list[dict], when: str) -> dict:
    """The activation report of the seed whose activation is closest to the identity at ``when``."""
    return max((r["activation"][when] for r in runs), key=lambda a: -a["identity_gap"])


def run_mlp_ablation(cfg: MLPConfig, data, progress=None) -> dict:
    """Train every variant of ``cfg.variants`` for ``cfg.seeds`` seeds (``seed, seed+1, ...``) on
    ``data = (train_x, train_y, test_x, test_y)``.

    Returns ``{variant: {"final": {metric: mean over seeds}, "summary": {metric: mean_sd}, "test_accuracy",
    "curve" (first seed), "runs": [per seed: curve, final, activation reports, seconds], "warnings": [...]}}``;
    the metrics are those of type ``fc`` (``train_with_checkpoints``)."""
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    dev = torch.device(cfg.device)
    xtr, ytr, xte, yte = (t.to(dev) for t in data)
    probe_x = xtr[: cfg.probe_size]
    checkpoints = checkpoint_steps(cfg.steps, cfg.per_decade)
    results = {}
    for name in cfg.variants:
        residual, act = VARIANTS[name]
        runs = []
        for s in range(cfg.seeds):
            seed = cfg.seed + s
            torch.manual_seed(seed)
            model = ResidualMLP(residual, act, cfg.depth, cfg.width, xtr.shape[1], int(ytr.max()) + 1, norm=cfg.norm,
                                init_std=cfg.init_std, init_scale=cfg.init_scale).to(dev)
            reports = {"init": activation_report(model, probe_x)}
            opt = _optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.betas)
            groups = group_projections(model.named_parameters())
            gen = torch.Generator(device="cpu").manual_seed(seed)

            def batch(step):
                idx = torch.randint(0, len(xtr), (cfg.batch_size,), generator=gen).to(dev)
                return xtr[idx], ytr[idx]

            task = progress.add_task(f"mlp {name} seed {seed}", total=cfg.steps) if progress is not None else None
            t0 = time.perf_counter()
            res = train_with_checkpoints(model, groups, batch, cfg.steps, opt, checkpoints, lambda: model(probe_x),
                                         progress, task)
            reports["end"] = activation_report(model, probe_x)
            with torch.no_grad():
                acc = sum(int((model(xte[i:i + 2000]).argmax(-1) == yte[i:i + 2000]).sum())
                          for i in range(0, len(xte), 2000)) / max(1, len(xte))
            runs.append({"seed": seed, "curve": res["curve"], "final": res["final"], "activation": reports,
                         "test_accuracy": acc, "final_loss": res["curve"]["loss"][-1],
                         "seconds": time.perf_counter() - t0})
        summary = aggregate(runs, "fc")
        results[name] = {"final": {m: v["mean"] for m, v in summary.items()} | {
                             k: runs[0]["final"]["fc"][k] for k in ("baseline_v1", "baseline_u1", "low_v1", "low_u1",
                                                                   "dims", "n_pairs")},
                         "summary": summary, "test_accuracy": summary["test_accuracy"]["mean"],
                         "curve": runs[0]["curve"], "runs": runs,
                         "activation": {w: mean_sd([r["activation"][w]["identity_gap"] for r in runs])["mean"]
                                        for w in ("init", "end")},
                         "saturated": {w: mean_sd([r["activation"][w].get("saturated", math.nan) for r in runs])["mean"]
                                       for w in ("init", "end")},
                         "block_change_init": mean_sd([r["activation"]["init"]["block_change"] for r in runs])["mean"],
                         "warnings": _warnings(name, act, {w: _worst(runs, w) for w in ("init", "end")})}
    return results


def read_text_bytes(path) -> torch.Tensor:
    """Bytes of a text file (``.gz`` allowed) as an int64 tensor of token ids 0-255."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"text file not found: {path}; pass --text FILE (e.g. shared/data/tinyshakespeare/input.txt.gz)")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except Exception as e:  # noqa: BLE001 -- any decode failure is the same user error
            raise UsageError(f"text file {path} is a corrupt gzip file ({e}); replace it") from e
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class _FFNAct(nn.Module):
    """``down(act(up x))`` with the reference FFN's ``up_proj``/``down_proj`` (names kept); ``act`` 'none'
    removes the activation (a linear MLP), 'radial' the scaled radial ``z tanh(||z||/sqrt(d))``."""

    def __init__(self, up: nn.Linear, down: nn.Linear, act: str):
        super().__init__()
        self.up_proj, self.down_proj, self.act = up, down, ACTIVATIONS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


def build_lm(cfg: LMAblationConfig, act: str, seed: int):
    """The reference LM with ``hidden_act=act``; 'none' / 'radial' replace each layer's MLP by ``_FFNAct``."""
    from ..models.lm import DecoderLM, LMConfig

    torch.manual_seed(seed)
    base = act if act in ("swiglu", "relu", "gelu", "silu") else "relu"
    model = DecoderLM(LMConfig(vocab_size=256, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                               intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.seq_len,
                               hidden_act=base))
    if base != act:
        for layer in model.layers:
            layer.mlp = _FFNAct(layer.mlp.up_proj, layer.mlp.down_proj, act)
    return model


def run_lm_ablation(cfg: LMAblationConfig, tokens: torch.Tensor, progress=None) -> dict:
    """Train the reference LM (byte vocabulary) per ``cfg.acts`` and seed; per projection type the
    checkpointed metrics. Returns ``{act: {"final": {type: mean over seeds}, "init": {type: step-0 values},
    "summary": {type: {metric: mean_sd}}, "curve" (first seed), "runs": [...]}}``."""
    bad = [a for a in cfg.acts if a not in LM_ACTS]
    if bad:
        raise UsageError(f"--lm-acts: unknown activation(s) {bad}; choose from {', '.join(LM_ACTS)}")
    dev = torch.device(cfg.device)
    if len(tokens) < cfg.seq_len + 2:
        raise UsageError(f"the text has {len(tokens)} bytes, fewer than --seq-len {cfg.seq_len} + 2; use a longer text")
    toks = tokens.to(dev)
    checkpoints = checkpoint_steps(cfg.steps, cfg.per_decade)
    offs = torch.arange(cfg.seq_len + 1, device=dev)
    results = {}
    for act in cfg.acts:
        runs = []
        for s in range(cfg.seeds):
            seed = cfg.seed + s
            model = build_lm(cfg, act, seed).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=0.0)
            groups = group_projections(model.named_parameters())
            gen = torch.Generator(device="cpu").manual_seed(seed)
            pg = torch.Generator(device="cpu").manual_seed(10_000 + seed)
            pstart = torch.randint(0, len(toks) - cfg.seq_len - 1, (8, 1), generator=pg).to(dev)
            probe_x = toks[pstart + offs][:, :-1]

            def batch(step):
                start = torch.randint(0, len(toks) - cfg.seq_len - 1, (cfg.batch_size, 1), generator=gen).to(dev)
                chunk = toks[start + offs]
                return chunk[:, :-1], chunk[:, 1:]

            task = progress.add_task(f"lm {act} seed {seed}", total=cfg.steps) if progress is not None else None
            t0 = time.perf_counter()
            res = train_with_checkpoints(model, groups, batch, cfg.steps, opt, checkpoints, lambda: model(probe_x),
                                         progress, task)
            runs.append({"seed": seed, "curve": res["curve"], "final": res["final"],
                         "final_loss": res["curve"]["loss"][-1], "seconds": time.perf_counter() - t0})
        types = list(runs[0]["final"])
        summary = {t: aggregate(runs, t) for t in types}
        final = {t: {m: v["mean"] for m, v in summary[t].items()} | {
                     k: runs[0]["final"][t][k] for k in ("baseline_v1", "baseline_u1", "low_v1", "low_u1", "dims", "n_pairs")}
                 for t in types}
        init = {t: {m: statistics.fmean(r["curve"][f"{m}/{t}"][0] for r in runs) for m in ("v1", "u1")} for t in types}
        results[act] = {"final": final, "init": init, "summary": summary, "curve": runs[0]["curve"], "runs": runs}
    return results


# ------------------------------------------------------------------------------------------ output
PAPER_MLP = {"NoRes": "coherence ~0.05", "Res+None": "weight continuity ~0.22", "Res+Radial": "weight continuity ~0.22",
             "Res+RadialUnscaled": "weight continuity ~0.22 (the paper's x tanh(||x||))",
             "Res+ReLU": "high weight continuity (no value stated)", "Res+GELU": "high weight continuity (no value stated)",
             "Res+SiLU": "high weight continuity (no value stated)"}
PAPER_LM = {"q_proj": "v1", "k_proj": "v1", "gate_proj": "v1", "up_proj": "v1", "o_proj": "u1",
            "down_proj": "u1", "v_proj": "low"}


def label(v1: float, u1: float, low_v1: float, low_u1: float) -> str:
    """'v1', 'u1' or 'low': the space whose mean continuity exceeds its 99% random quantile by the larger
    factor; 'low' when neither exceeds it; '-' when neither was measured."""
    c = [(x / lo, s) for x, lo, s in ((v1, low_v1, "v1"), (u1, low_u1, "u1")) if x == x and lo == lo]
    if not c:
        return "-"
    r, s = max(c)
    return s if r > 1 else "low"


def _f(x, spec=".3f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _ms(s: dict, spec=".3f") -> str:
    if not s or s.get("n", 0) == 0:
        return "-"
    return _f(s["mean"], spec) if s["n"] == 1 else f"{_f(s['mean'], spec)} ± {_f(s['sd'], spec)}"


def _pk(summary: dict, m: str) -> str:
    return f"{_ms(summary[m + '_peak'])} @ {_f(summary[m + '_peak_step']['mean'], '.0f')}"


def mlp_markdown(res: dict) -> str:
    lines = ["| variant | coherence cum. | coherence per step | v1 final | v1 peak @ step | u1 final | u1 peak @ step | "
             "v1_perp | sub_in (k=4) | centred align_in | raw align_in | ‖ΔW‖/‖W0‖ | ΔW v1 | σ1/σ2 | test acc | "
             "id. gap init | saturated init/end | paper |",
             "|" + "---|" * 18]
    for name, r in res.items():
        s = r["summary"]
        sat = r["saturated"]
        satx = "-" if sat["init"] != sat["init"] else f"{100 * sat['init']:.0f}% / {100 * sat['end']:.0f}%"
        lines.append(f"| {name} | {_ms(s['coherence'])} | {_ms(s['step_coherence_mean'])} | {_ms(s['v1'])} | "
                     f"{_pk(s, 'v1')} | {_ms(s['u1'])} | {_pk(s, 'u1')} | {_ms(s['v1_perp'])} | {_ms(s['sub_in'])} | "
                     f"{_ms(s['calign_in'])} | {_ms(s['align_in'])} | {_ms(s['dw_rel'])} | {_ms(s['dw_v1'])} | "
                     f"{_ms(s['s1_s2'], '.2f')} | {_ms(s['test_accuracy'])} | {_f(r['activation']['init'], '.2e')} | "
                     f"{satx} | {PAPER_MLP.get(name, '')} |")
    if res:
        f = next(iter(res.values()))["final"]
        d, n = f["dims"][0], f["n_pairs"]
        lines.append(f"\nRandom null for |cos| in d={d}: mean {f['baseline_v1']:.3f}; 99% quantile of the mean over "
                     f"{n} pairs {f['low_v1']:.3f} (the 'low' threshold). Random sub_in (k=4): {4 / d:.3f}; raw "
                     "align_in of independent random weights ~0.5, centred ~0. Values: mean ± sd over seeds, exact SVD "
                     "at the final step; peaks over the log-spaced checkpoints (step 0 = init).")
    warns = [w for r in res.values() for w in r["warnings"]]
    if warns:
        lines.append("\n**Warnings**\n\n" + "\n".join(f"- {w}" for w in warns))
    return "\n".join(lines)


def lm_markdown(res: dict) -> str:
    out = []
    for act, r in res.items():
        out.append(f"\n**MLP activation: {act}** (init -> final, mean ± sd over seeds)\n")
        out.append("| type | v1 | v1 peak @ step | u1 | u1 peak @ step | 99% null v1/u1 | coherence cum. / per step | "
                   "‖ΔW‖/‖W0‖ | observed | paper |")
        out.append("|" + "---|" * 10)
        for t, f in r["final"].items():
            s, i = r["summary"][t], r["init"][t]
            obs = label(f["v1"], f["u1"], f["low_v1"], f["low_u1"])
            paper = PAPER_LM.get(t.split(".")[-1], "")
            out.append(f"| {t} | {_f(i['v1'])} -> {_ms(s['v1'])} | {_pk(s, 'v1')} | {_f(i['u1'])} -> {_ms(s['u1'])} | "
                       f"{_pk(s, 'u1')} | {f['low_v1']:.3f}/{f['low_u1']:.3f} | {_ms(s['coherence'])} / "
                       f"{_ms(s['step_coherence_mean'])} | {_ms(s['dw_rel'])} | {obs} | {paper or '-'} |")
    out.append(f"\n'observed': the space (v1 or u1) whose final mean continuity exceeds the {100 * LOW_Q:.0f}% quantile "
               "of the mean |cos| of independent random unit vectors (same d, same number of pairs; "
               "`conserve.continuity.random_quantile`) by the larger factor; 'low' if neither does.")
    return "\n".join(out)


def plot_curves(res: dict, path: Path, title: str, metrics=("step_coherence", "coherence", "v1", "u1", "v1_perp", "loss")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(3.9 * len(metrics), 3.6), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    types = sorted({k.split("/", 1)[1] for r in res.values() for k in r["curve"] if "/" in k})
    many = len(types) > 1  # LM: colour = projection type, line style = variant; MLP: colour = variant
    for ax, metric in zip(axes, metrics):
        for vi, (name, r) in enumerate(res.items()):
            c = r["curve"]
            x = [max(s, 0.5) for s in c["step"]]  # step 0 (init) drawn at 0.5 on the log axis
            keys = [k for k in c if k.split("/", 1)[0] == metric] if metric != "loss" else ["loss"]
            for k in keys:
                t = k.split("/", 1)[1] if "/" in k else ""
                color = colors[(types.index(t) if many and t in types else vi) % len(colors)]
                lab = f"{name} {t.split('.')[-1]}" if many and t else name
                ax.plot(x, c[k], label=lab, color=color, ls=styles[vi % len(styles)] if many else "-", marker=".", ms=3)
        ax.set_xscale("log")
        ax.set_title({"coherence": "cumulative grad coherence", "step_coherence": "per-step grad coherence",
                      "v1": "|cos v1| adjacent layers", "u1": "|cos u1| adjacent layers",
                      "v1_perp": "v1, mean-input dirs removed", "loss": "train loss"}.get(metric, metric), fontsize=9)
        ax.set_xlabel("step (0.5 = init)")
    if many:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center", fontsize=6)
    else:
        axes[0].legend(fontsize=6)
    fig.suptitle(title + " (first seed)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def _betas(s: str) -> tuple[float, float]:
    import argparse

    try:
        b1, b2 = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers B1,B2 like 0.9,0.999 (the paper: 0.9,0), got {s!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"betas must be in [0, 1), got {s!r}")
    return b1, b2


def add_arguments(p) -> None:
    from ..commands.common import add_threads_argument

    p.add_argument("--out", required=True, help="run directory for results.md/json and the PNG curves")
    p.add_argument("--part", choices=PARTS, default="all", help="mlp (MNIST), lm (text) or all")
    p.add_argument("--mnist", help="directory with the MNIST idx files (.gz or plain), for --part mlp/all")
    p.add_argument("--text", help="text file (.gz allowed) for the LM ablation, for --part lm/all")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of MLP variants ({', '.join(VARIANTS)})")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000, help="MLP training steps per variant and seed")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-limit", type=int, default=None, help="use the first N MNIST training images")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--betas", type=_betas, default=(0.9, 0.999), help="Adam betas B1,B2 (MLP and LM; the paper: beta2=0)")
    p.add_argument("--norm", choices=NORMS, default="none", help="pre-norm of each MLP branch input (no gain)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--init-std", type=float, default=None, help="hidden weights N(0, STD^2) for the residual variants")
    g.add_argument("--init-scale", type=float, default=1.0, help="multiply the default init of the hidden weights")
    p.add_argument("--seeds", type=int, default=1, help="seeds per variant (seed, seed+1, ...): mean ± sd")
    p.add_argument("--per-decade", type=int, default=6, help="exact-SVD checkpoints per decade of steps")
    p.add_argument("--lm-acts", default="swiglu", help=f"comma list of LM MLP activations ({', '.join(LM_ACTS)})")
    p.add_argument("--lm-steps", type=int, default=1000)
    p.add_argument("--lm-layers", type=int, default=8)
    p.add_argument("--lm-hidden", type=int, default=128)
    p.add_argument("--lm-batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lm-lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=None, help=argparse_suppress())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    add_threads_argument(p)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise UsageError(f"--device {device!r} is not a torch device ({e}); use cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")


def _positive(**kw) -> None:
    for k, v in kw.items():
        if v < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 1, got {v}")


def main(args) -> int:
    from ..commands.common import torch_threads

    with torch_threads(args.threads):
        return _main(args)


def _main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    check_device(args.device)
    _positive(depth=args.depth, width=args.width, steps=args.steps, batch_size=args.batch_size, seeds=args.seeds,
              lm_steps=args.lm_steps, lm_layers=args.lm_layers, lm_hidden=args.lm_hidden, per_decade=args.per_decade,
              lm_batch_size=args.lm_batch_size, seq_len=args.seq_len)
    if args.depth < 2 or args.lm_layers < 2:
        raise UsageError("continuity compares adjacent layers: --depth and --lm-layers must be >= 2")
    if args.init_std is not None and not args.init_std > 0:
        raise UsageError(f"--init-std must be > 0, got {args.init_std}")
    if not args.init_scale > 0:
        raise UsageError(f"--init-scale must be > 0, got {args.init_scale}")
    do_mlp, do_lm = args.part in ("mlp", "all"), args.part in ("lm", "all")
    if do_mlp and not args.mnist:
        raise UsageError("--part mlp needs --mnist DIR (the directory with the MNIST idx files)")
    if do_lm and not args.text:
        raise UsageError("--part lm needs --text FILE (e.g. tinyshakespeare/input.txt.gz)")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if do_mlp and unknown:
        raise UsageError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    acts = tuple(a.strip() for a in args.lm_acts.split(",") if a.strip())
    bad = [a for a in acts if a not in LM_ACTS]
    if do_lm and bad:
        raise UsageError(f"--lm-acts: unknown activation(s) {bad}; choose from {', '.join(LM_ACTS)}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror}; choose a writable directory") from e
    mcfg = MLPConfig(depth=args.depth, width=args.width, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     optimizer=args.optimizer, betas=args.betas, norm=args.norm, init_std=args.init_std,
                     init_scale=args.init_scale, seed=args.seed, seeds=args.seeds, per_decade=args.per_decade,
                     variants=variants, device=args.device)
    lcfg = LMAblationConfig(acts=acts, hidden_size=args.lm_hidden, num_hidden_layers=args.lm_layers,
                            intermediate_size=int(round(args.lm_hidden * 8 / 3 / 8)) * 8, seq_len=args.seq_len,
                            steps=args.lm_steps, batch_size=args.lm_batch_size, lr=args.lm_lr, betas=args.betas,
                            seed=args.seed, seeds=args.seeds, per_decade=args.per_decade, device=args.device)
    data = None
    if do_mlp:
        data = mnist_tensors(args.mnist)
        if args.train_limit:
            data = (data[0][: args.train_limit], data[1][: args.train_limit], data[2], data[3])
    tokens = read_text_bytes(args.text) if do_lm else None
    console = Console(stderr=True)
    record: dict = {"config": {"mlp": asdict(mcfg) if do_mlp else None, "lm": asdict(lcfg) if do_lm else None,
                               "threads": args.threads},
                    "source": "Jeong, Paeng, Suh 2026 (claims as stated in spec laws.md, Geometric continuity)"}
    md = ["# Geometric continuity ablation (Jeong, Paeng, Suh 2026)\n"]
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        if do_mlp:
            res = run_mlp_ablation(mcfg, data, progress)
            record["mlp"] = res
            init = f"N(0, {mcfg.init_std:g}^2)" if mcfg.init_std else f"{mcfg.init_scale:g} x PyTorch default"
            md += [f"## Residual MLP on MNIST (depth {mcfg.depth}, width {mcfg.width}, {mcfg.steps} steps, "
                   f"{mcfg.optimizer} lr {mcfg.lr:g} betas {mcfg.betas}, norm {mcfg.norm}, init {init}, "
                   f"{mcfg.seeds} seed(s))\n", mlp_markdown(res), "\n![curves](mlp_curves.png)\n"]
            plot_curves(res, out / "mlp_curves.png", "residual MLP on MNIST")
        if do_lm:
            res = run_lm_ablation(lcfg, tokens, progress)
            record["lm"] = res
            md += [f"## Reference LM on {Path(args.text).name} (bytes; {lcfg.num_hidden_layers} layers, hidden "
                   f"{lcfg.hidden_size}, {lcfg.steps} steps, AdamW lr {lcfg.lr:g} betas {lcfg.betas}, "
                   f"{lcfg.seeds} seed(s))\n", lm_markdown(res), "\n![curves](lm_curves.png)\n"]
            plot_curves(res, out / "lm_curves.png", "reference LM: per projection type",
                        metrics=("step_coherence", "coherence", "v1", "u1", "loss"))
    record["seconds"] = round(time.time() - t0, 1)
    md.append(f"\n{record['seconds']} s with {args.threads} thread(s).")
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(json_safe(record), indent=1))
    print("\n".join(md))
    console.print(f"wrote {out / 'results.md'}, {out / 'results.json'} and the PNG curves")
    return 0
