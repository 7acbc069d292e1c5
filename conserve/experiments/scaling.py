"""``conserve experiment scaling``: how the conservation error of GD/SGD grows with learning rate and step.

Theory (spec "Discrete steps: the exact drift identity"): for plain GD/SGD the first-order term vanishes,
so each step changes a quadratic law by exactly ``lr^2 g^T M g``. While the trajectory changes slowly
(small ``lr * k``) the gradients are roughly constant and ``eps(k) ~ C lr^2 k``: exponent 2 in the learning
rate at fixed step, 1 in the step at fixed learning rate. Linear laws (router_sum, translation) have no
second-order term: GD/SGD conserve them exactly, their ``eps`` is floating-point rounding and is not fitted.

Runs, for each model (``--models``: the Qwen-3-like decoder on text, the ViT on images), each optimizer
(``gd``: full batch on one fixed batch; ``sgd``: fresh minibatches, the same sequence for every lr) and each
learning rate, from the same initialisation: ``eps/<family>`` (spec "The paper's error metric") at
log-spaced steps (laws accumulated in float64). Fits (least squares on logs):

- lr exponent: ``log eps`` vs ``log lr`` over all learning rates at the fixed step ``HI`` of ``--fit-k``;
- k exponent: ``log eps`` vs ``log k`` over the steps in ``[LO, HI]`` (default 1, 30), at each learning rate (the smallest
  one is reported as the family's value: it is closest to the regime of the theory);
- overall: one common exponent over the fitted families, each with its own prefactor.

Writes into ``--out``: ``results.md`` (tables), ``results.json`` (config, every series, every fit),
``eps_vs_step_<model>_<optimizer>.png`` (per family, one line per lr, log-log) and
``eps_vs_lr_<model>_<optimizer>.png`` (eps at the fixed step vs lr with the fitted line, and the lr exponent
fitted at every step: 2 while ``lr k`` is small; beyond, ``eps(k) ~ lr * int_0^{lr k} q(t) dt`` along the
gradient-flow path, so the exponent moves toward 1 as that integral saturates).
"""
from __future__ import annotations

import json
import math
import time

import torch

from ..errors import NonFiniteError, UsageError
from ..train import add_threads_argument, torch_threads
from .common import (DTYPES, MODELS, fit_pooled, fit_power, float_list, fmt, int_pair,
                     linear_families, log_steps, tasks_from_args, name_list)

OPTIMIZERS = ("gd", "sgd", "fullgd")
DEFAULT_OPTIMIZERS = ("gd", "sgd")
DEFAULT_GD_SUBSET = 64
BEND_SLOPE = 0.9  # the collapse curve 'bends' where its local log-log slope in t = lr k falls below this
# The theory needs lr * k small enough that the gradients barely change. The ViT (torch's default init,
# standardised pixels) moves ~10x faster per unit lr than the LM (init std 0.02): its gradient halves within
# lr * k ~ 0.02, hence 10x smaller learning rates. With these, the lr exponent at k <= 30 is within ~0.1 of 2;
# over the 1000 default steps the curves show where and how the constant-gradient picture breaks down.
DEFAULT_LRS = {"lm": (0.00025, 0.0005, 0.001, 0.002), "vit": (0.000025, 0.00005, 0.0001, 0.0002)}
DEFAULT_FIT_HI = 30


def add_arguments(p) -> None:
    g = p.add_argument_group("data and output")
    g.add_argument("--data", default=None, help="text for the LM: a file (plain or .gz) or a PTB/WikiText directory; "
                   "default: the embedded CPython documentation corpus")
    g.add_argument("--images", default=None, help="images for the ViT: an MNIST idx directory or CIFAR-10 .bin file "
                   "or directory; default: scikit-learn's digits when scikit-learn is installed")
    g.add_argument("--out", default=None, help="run directory (default: runs/scaling-<timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    o = p.add_argument_group("experiment")
    o.add_argument("--models", type=name_list(MODELS), default=MODELS, help="comma-separated: lm, vit (default both)")
    o.add_argument("--optimizers", type=name_list(OPTIMIZERS), default=DEFAULT_OPTIMIZERS,
                   help="comma-separated: gd (one fixed minibatch of --batch-size every step), sgd (fresh minibatches), "
                   "fullgd (full-batch GD on a fixed subset of --gd-subset sequences / images, the same every step) "
                   "(default gd,sgd)")
    o.add_argument("--gd-subset", type=int, default=DEFAULT_GD_SUBSET,
                   help=f"size of the fixed data subset of --optimizers fullgd (default {DEFAULT_GD_SUBSET} sequences or images)")
    o.add_argument("--lrs", type=float_list, default=None,
                   help="learning rates for the LM, 4 or more recommended, at least 2 "
                   f"(default {','.join(map(str, DEFAULT_LRS['lm']))})")
    o.add_argument("--vit-lrs", type=float_list, default=None,
                   help=f"learning rates for the ViT (default {','.join(map(str, DEFAULT_LRS['vit']))})")
    o.add_argument("--steps", type=int, default=1000, help="optimizer steps per run (default 1000)")
    o.add_argument("--fit-k", type=int_pair, default=None,
                   help=f"step range LO,HI of the k fit; the lr fit is at step HI (default 1,{DEFAULT_FIT_HI})")
    o.add_argument("--batch-size", type=int, default=8, help="LM sequences per batch (default 8)")
    o.add_argument("--seq-len", type=int, default=32)
    o.add_argument("--image-batch", type=int, default=64, help="ViT images per batch (default 64)")
    o.add_argument("--image-limit", type=int, default=4096, help="use the first N images (default 4096)")
    o.add_argument("--hidden", type=int, default=32, help="hidden size of both models (default 32)")
    o.add_argument("--dtype", choices=tuple(DTYPES), default="float64",
                   help="model precision (default float64; laws are always accumulated in float64); with float32 "
                   "the rounding of the weights puts a floor ~1e-7 sqrt(k) under eps")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default="cpu")
    add_threads_argument(o)


def _check(args) -> None:
    for name in ("steps", "batch_size", "seq_len", "image_batch", "image_limit", "hidden", "gd_subset"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps < 2:
        raise UsageError("--steps must be >= 2 to fit an exponent in k")
    if args.hidden % 4:
        raise UsageError(f"--hidden must be a multiple of 4 (4 attention heads), got {args.hidden}")
    for flag, lrs in (("--lrs", args.lrs), ("--vit-lrs", args.vit_lrs)):
        if lrs is None:
            continue
        if len(set(lrs)) < 2:
            raise UsageError(f"{flag} needs at least 2 distinct learning rates to fit an exponent (4 recommended)")
        if min(lrs) <= 0:
            raise UsageError(f"{flag}: learning rates must be positive, got {min(lrs)}")
    if args.fit_k is not None and args.fit_k[1] > args.steps:
        raise UsageError(f"--fit-k HI={args.fit_k[1]} exceeds --steps {args.steps}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no GPU is available; use --device cpu")


# ------------------------------------------------------------------------------------------------ runs
def run_one(task, optimizer: str, lr: float, steps: int, checkpoints: list[int], *, seed: int, device: str = "cpu",
            on_segment=None, gd_subset: int = DEFAULT_GD_SUBSET) -> dict:
    """Train ``task``'s model from its fixed initialisation with plain SGD at ``lr`` (``optimizer`` 'gd': the
    same fixed minibatch every step; 'fullgd': the same fixed subset of ``gd_subset`` sequences / images every
    step, i.e. full-batch GD on that subset) and evaluate the laws at ``checkpoints`` only (float64 accumulation).

    Returns ``{"steps": [k...], "loss": [...], "eps": {family: [...]}, "linear": [families]}``.
    Raises ``UsageError`` if the loss or a law value becomes NaN/Inf (names the lr)."""
    from ..tracker import Tracker
    from ..train import train

    model = task.build()
    tracker = Tracker(model, every=len(checkpoints) + 1, drift=False, fp64=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    batches = task.batches(True, seed, gd_subset) if optimizer == "fullgd" else task.batches(optimizer == "gd", seed)
    losses, prev = [], 0
    try:
        for k in checkpoints:
            losses.append(train(model, opt, batches, k - prev, loss_fn=task.loss_fn, device=device, progress=False,
                                log_every=max(k - prev, 1), start_step=prev)[-1])
            tracker.after_step()
            prev = k
            if on_segment is not None:
                on_segment(k)
        records = tracker.flush()
    except NonFiniteError as e:
        raise UsageError(f"{task.name} {optimizer} lr={lr:g} diverged ({e}); use smaller learning rates") from None
    return {"steps": list(checkpoints), "loss": losses,
            "eps": {f: [r[f"eps/{f}"] for r in records] for f in tracker.families},
            "linear": linear_families(tracker)}


def fit_series(runs: dict[float, dict], fit_k: tuple[int, int], dtype: torch.dtype) -> dict:
    """Per family: the lr fit at step ``fit_k[1]``, the k fit at each lr over ``fit_k``, and whether the
    family enters the overall fit (and why not). ``runs``: lr -> ``run_one`` result (same checkpoints)."""
    lrs = sorted(runs)
    ks = runs[lrs[0]]["steps"]
    lo, hi = fit_k
    k_at = max(k for k in ks if k <= hi)
    j = ks.index(k_at)
    linear = set(runs[lrs[0]]["linear"])
    floor = 10 * torch.finfo(dtype).eps * math.sqrt(k_at)
    fams = {}
    for f in runs[lrs[0]]["eps"]:
        eps_k = [runs[lr]["eps"][f][j] for lr in lrs]
        lr_fit = fit_power(lrs, eps_k)
        k_fits = {}
        for lr in lrs:
            sel = [(k, e) for k, e in zip(ks, runs[lr]["eps"][f]) if lo <= k <= hi]
            k_fits[lr] = fit_power([k for k, _ in sel], [e for _, e in sel])
        lr_per_k = [fit_power(lrs, [runs[lr]["eps"][f][i] for lr in lrs])["exponent"] for i in range(len(ks))]
        if f in linear:
            why = ("linear law (h = c . theta): GD/SGD have no second-order term and conserve it exactly; "
                   "its eps is floating-point rounding")
        elif min(eps_k) < floor:
            why = f"eps at the smallest lr ({min(eps_k):.1e}) is at the rounding floor ~{floor:.0e} of {dtype}"
        else:
            why = None
        fams_extra = {"collapse": collapse(runs, f), "exponent_vs_k": exponent_vs_k(runs, f)}
        fams[f] = {**fams_extra, "lr_fit": lr_fit, "k_fit": {str(lr): v for lr, v in k_fits.items()},
                   "k_exponent": k_fits[lrs[0]]["exponent"], "lr_exponent": lr_fit["exponent"],
                   "lr_exponent_per_step": lr_per_k, "eps_at_k": eps_k, "included": why is None, "excluded_because": why}
    inc = [f for f in fams if fams[f]["included"]]
    overall_lr = fit_pooled([(lrs, fams[f]["eps_at_k"]) for f in inc])
    overall_k = {}
    for lr in lrs:
        sel = [i for i, k in enumerate(ks) if lo <= k <= hi]
        overall_k[str(lr)] = fit_pooled([([ks[i] for i in sel], [runs[lr]["eps"][f][i] for i in sel]) for f in inc])
    return {"k_fixed": k_at, "k_range": [lo, hi], "lrs": lrs, "families": fams, "fitted_families": inc,
            "overall": {"lr_exponent": overall_lr["exponent"], "k_exponent": overall_k[str(lrs[0])]["exponent"],
                        "k_exponent_per_lr": {lr: v["exponent"] for lr, v in overall_k.items()}}}


def collapse(runs: dict[float, dict], family: str, points: int = 24) -> dict:
    """The collapse of ``eps / lr`` onto one curve of ``t = lr * k`` (the drift identity along the gradient
    flow: ``eps(k) ~ lr * F(lr k)``, with ``F(t) ~ C t`` while the gradients are constant).

    On ``points`` log-spaced values of ``t`` inside the range every lr covers, ``log(eps/lr)`` of each lr is
    interpolated linearly in ``log t``. Returns ``{"t": [...], "curve": [geometric mean of eps/lr over lrs],
    "spread": [max/min - 1 over lrs at each t], "max_spread", "t_range": [lo, hi], "slope": [local d log F /
    d log t], "bend_t": first t where the slope falls below BEND_SLOPE (None if it never does)}``; an empty
    ``t`` when the lrs share no range of t or a value is not positive."""
    import numpy as np

    lrs = sorted(runs)
    series = []
    for lr in lrs:
        k = np.asarray(runs[lr]["steps"], float)
        e = np.asarray(runs[lr]["eps"][family], float)
        ok = np.isfinite(e) & (e > 0)
        if ok.sum() < 2:
            return {"t": [], "curve": [], "spread": [], "max_spread": math.nan, "t_range": None, "slope": [], "bend_t": None}
        series.append((np.log(lr * k[ok]), np.log(e[ok] / lr)))
    lo, hi = max(s[0][0] for s in series), min(s[0][-1] for s in series)
    if not hi > lo:
        return {"t": [], "curve": [], "spread": [], "max_spread": math.nan, "t_range": None, "slope": [], "bend_t": None}
    grid = np.linspace(lo, hi, points)
    vals = np.stack([np.interp(grid, x, y) for x, y in series])  # (lrs, points), log(eps/lr)
    spread = np.exp(vals.max(0) - vals.min(0)) - 1
    curve = vals.mean(0)
    slope = np.gradient(curve, grid)
    below = np.nonzero(slope < BEND_SLOPE)[0]
    return {"t": np.exp(grid).tolist(), "curve": np.exp(curve).tolist(), "spread": spread.tolist(),
            "max_spread": float(spread.max()), "t_range": [float(math.exp(lo)), float(math.exp(hi))],
            "slope": slope.tolist(), "bend_t": float(math.exp(grid[below[0]])) if below.size else None}


def exponent_vs_k(runs: dict[float, dict], family: str) -> dict:
    """The lr exponent fitted at every checkpoint k (least squares of log eps on log lr over all lrs):
    ``{"k": [...], "exponent": [...], "lr_k_max": [largest lr * k at that k]}``. 2 while lr k is small; it
    moves toward 1 as F(t) saturates."""
    lrs = sorted(runs)
    ks = runs[lrs[0]]["steps"]
    ex = [fit_power(lrs, [runs[lr]["eps"][family][i] for lr in lrs])["exponent"] for i in range(len(ks))]
    return {"k": list(ks), "exponent": ex, "lr_k_max": [lrs[-1] * k for k in ks]}


# ----------------------------------------------------------------------------------------------- plots
def _collapse_plot(out, name: str, runs: dict[float, dict], fit: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lrs = fit["lrs"]
    fams = [f for f in fit["families"] if fit["families"][f]["included"]] or list(fit["families"])
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(lrs)))
    cols = min(4, len(fams)) + 1
    fig, axes = plt.subplots(1, cols, figsize=(3.6 * cols, 3.3), squeeze=False)
    for ax, f in zip(axes[0], fams):
        for c, lr in zip(colors, lrs):
            r = runs[lr]
            t = np.asarray(r["steps"], float) * lr
            ax.loglog(t, np.maximum(np.asarray(r["eps"][f], float) / lr, 1e-18), color=c, lw=1.2, label=f"lr={lr:g}")
        col = fit["families"][f]["collapse"]
        if col["bend_t"]:
            ax.axvline(col["bend_t"], color="r", ls=":", lw=1)
        ax.set_title(f"{f}: spread {100 * col['max_spread']:.1f}%" if col["t"] else f, fontsize=9)
        ax.set_xlabel("t = lr k", fontsize=8)
        ax.grid(True, which="both", alpha=0.25)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("eps / lr", fontsize=9)
    axes[0][0].legend(fontsize=6)
    ax = axes[0][-1]
    for i, f in enumerate(fams):
        ev = fit["families"][f]["exponent_vs_k"]
        ax.semilogx(ev["k"], ev["exponent"], color=plt.cm.tab10(i % 10), lw=1.2, label=f)
    ax.axhline(2, color="k", ls=":", lw=1)
    ax.axhline(1, color="k", ls=":", lw=1)
    ax.set_xlabel("step k", fontsize=8)
    ax.set_title("fitted lr exponent vs k", fontsize=9)
    ax.legend(fontsize=6)
    for a in axes[0][len(fams):-1]:
        a.axis("off")
    fig.suptitle(f"{name}: eps/lr vs lr k (one curve = the drift identity along the flow; red: bend, slope < {BEND_SLOPE})",
                 fontsize=9)
    fig.tight_layout()
    path = out / f"collapse_{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
def _plots(out, name: str, runs: dict[float, dict], fit: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lrs = fit["lrs"]
    fams = list(fit["families"])
    cols = min(4, len(fams))
    rows = math.ceil(len(fams) / cols)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(lrs)))
    written = []
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.1 * rows), squeeze=False)
    for ax, f in zip(axes.flat, fams):
        for c, lr in zip(colors, lrs):
            r = runs[lr]
            ax.loglog(r["steps"], [max(e, 1e-18) for e in r["eps"][f]], color=c, lw=1.3, label=f"lr={lr:g}")
        lo, hi = fit["k_range"]
        ax.axvspan(lo, hi, color="0.9", zorder=0)
        info = fit["families"][f]
        tag = f"k^{info['k_exponent']:.2f}" if info["included"] else "not fitted"
        ax.set_title(f"{f} ({tag})", fontsize=9)
        ax.set_xlabel("step k", fontsize=8)
        ax.grid(True, which="both", alpha=0.25)
        ax.tick_params(labelsize=7)
    axes.flat[0].set_ylabel(r"$\epsilon(k)$", fontsize=9)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    fig.suptitle(f"{name}: eps per law family vs step (grey: k-fit range); theory eps ~ lr^2 k", fontsize=10)
    fig.tight_layout()
    path = out / f"eps_vs_step_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.array(lrs)
    for i, f in enumerate(fams):
        info = fit["families"][f]
        c = plt.cm.tab10(i % 10)
        y = np.array(info["eps_at_k"], float)
        ax.loglog(x, np.maximum(y, 1e-18), "o", color=c, mfc=c if info["included"] else "none")
        lf = info["lr_fit"]
        label = f"{f}: slope {lf['exponent']:.2f}" + ("" if info["included"] else " (not fitted)")
        if math.isfinite(lf["exponent"]):
            ax.loglog(x, lf["prefactor"] * x ** lf["exponent"], "-" if info["included"] else ":", color=c, lw=1, label=label)
    ax.set_xlabel("learning rate")
    ax.set_ylabel(rf"$\epsilon$ at step k={fit['k_fixed']}")
    ax.set_title(f"{name}: eps vs lr at fixed k (theory: slope 2); overall {fit['overall']['lr_exponent']:.2f}", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, ncol=2)
    ks = next(iter(runs.values()))["steps"]
    for i, f in enumerate(fams):
        info = fit["families"][f]
        if info["included"]:
            ax2.semilogx(ks, info["lr_exponent_per_step"], color=plt.cm.tab10(i % 10), lw=1.2, label=f)
    ax2.axhline(2.0, color="k", ls=":", lw=1)
    ax2.axvline(fit["k_fixed"], color="0.6", ls="--", lw=1)
    ax2.set_xlabel("step k")
    ax2.set_ylabel("fitted exponent of eps in lr")
    ax2.set_title("lr exponent at each step (theory 2 while lr k is small)", fontsize=10)
    ax2.grid(True, which="both", alpha=0.25)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"eps_vs_lr_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written


# ------------------------------------------------------------------------------------------------- main
def _pick_ks(ks: list[int]) -> list[int]:
    want = [1, 3, 10, 30, 100, 300, 1000, 3000, 10000]
    return sorted({min(ks, key=lambda k: abs(math.log(k / w))) for w in want if w <= 3 * ks[-1]})


def collapse_markdown(fit: dict) -> str:
    """The primary outputs: per family the collapse of eps/lr onto one curve of t = lr k, and the lr exponent
    fitted at each k."""
    fams = fit["families"]
    ev0 = next(iter(fams.values()))["exponent_vs_k"]
    ks = _pick_ks(ev0["k"])
    idx = [ev0["k"].index(k) for k in ks]
    lines = [f"Collapse of eps/lr onto one curve of t = lr k (lrs {', '.join(f'{x:g}' for x in fit['lrs'])}), and "
             "the lr exponent fitted at each step k (over all lrs; 2 in the constant-gradient regime):", "",
             "| family | t range shared by all lrs | max spread of eps/lr | bend at t (slope < "
             f"{BEND_SLOPE}) | " + " | ".join(f"lr exp. k={k}" for k in ks) + " |",
             "|" + "---|" * (4 + len(ks))]
    for f, info in fams.items():
        c, ev = info["collapse"], info["exponent_vs_k"]
        rng = "-" if not c["t_range"] else f"{c['t_range'][0]:.2g} - {c['t_range'][1]:.2g}"
        spread = "-" if not c["t"] else f"{100 * c['max_spread']:.1f}%"
        bend = "-" if not c["t"] else ("none" if c["bend_t"] is None else f"{c['bend_t']:.3g}")
        tag = "" if info["included"] else " (not fitted)"
        lines.append(f"| {f}{tag} | {rng} | {spread} | {bend} | " +
                     " | ".join(fmt(ev["exponent"][i], ".2f") for i in idx) + " |")
    lrk = ", ".join(format(ev0["lr_k_max"][i], ".3g") for i in idx)
    lines.append(f"\nlr k at these k for the largest lr: {lrk}. Plot: "
                 "`collapse_<run>.png`.")
    return "\n".join(lines)


def _markdown(config: dict, results: dict) -> str:
    lines = ["# conserve experiment scaling", "",
             "Theory (spec 'Discrete steps'): GD/SGD change a quadratic law by exactly lr^2 g^T M g per step, so",
             "eps ~ C lr^2 k while the gradients stay roughly constant: exponent 2 in lr (at fixed k), 1 in k.",
             f"Models in {config['dtype']}, laws accumulated in float64; {config['steps']} steps per run.", ""]
    for name, r in results.items():
        fit = r["fit"]
        lo, hi = fit["k_range"]
        lrs = fit["lrs"]
        lines += [f"## {name}", "", collapse_markdown(fit), "",
                  f"### Fixed-window fits (window: k in [{lo}, {hi}], lr fit at k = {fit['k_fixed']}, so lr k <= "
                  f"{lrs[-1] * fit['k_fixed']:.3g})", "", f"data: {r['source']}; lrs {', '.join(f'{lr:g}' for lr in lrs)}; "
                  f"final loss at the smallest / largest lr: {fmt(r['runs'][lrs[0]]['loss'][-1], '.3f')} / "
                  f"{fmt(r['runs'][lrs[-1]]['loss'][-1], '.3f')}", "",
                  f"| family | lr exponent at k={fit['k_fixed']} | R^2 | k exponent, k in [{lo},{hi}], lr={lrs[0]:g} "
                  f"| k exponent at lr={lrs[-1]:g} | eps(k={fit['k_fixed']}, lr={lrs[0]:g}) | fitted |",
                  "|---|---|---|---|---|---|---|"]
        for f, info in fit["families"].items():
            kf_hi = info["k_fit"][str(lrs[-1])]["exponent"]
            lines.append(f"| {f} | {fmt(info['lr_exponent'], '.3f')} | {fmt(info['lr_fit']['r2'], '.4f')} | "
                         f"{fmt(info['k_exponent'], '.3f')} | {fmt(kf_hi, '.3f')} | {fmt(info['eps_at_k'][0])} | "
                         f"{'yes' if info['included'] else 'no'} |")
        ov = fit["overall"]
        lines += [f"| **overall** ({len(fit['fitted_families'])} families) | **{fmt(ov['lr_exponent'], '.3f')}** | | "
                  f"**{fmt(ov['k_exponent'], '.3f')}** | {fmt(ov['k_exponent_per_lr'][str(lrs[-1])], '.3f')} | | |", ""]
        for f, info in fit["families"].items():
            if not info["included"]:
                lines.append(f"- {f} not fitted: {info['excluded_because']}.")
        lines += ["", f"Plots: `eps_vs_step_{name}.png`, `eps_vs_lr_{name}.png`.", ""]
    lines += ["Fits: least squares of log eps on log lr (all lrs, at the fixed step) and on log k (steps in the range,",
              "per lr); overall: one common slope with a prefactor per family. The k exponent drifts from 1 at larger",
              "lr or k as the gradients change along the trajectory (the theory's constant-gradient assumption): then",
              "eps(k) ~ lr * integral_0^(lr k) q(t) dt along the gradient-flow path, and the lr exponent moves toward 1",
              "(see the right panel of `eps_vs_lr_*.png`).",
              "For SGD each step's drift is the quadratic form of a different minibatch gradient, so a family's k exponent",
              "over a short range scatters around 1; the pooled exponent averages that out."]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    _check(args)
    with torch_threads(args.threads):
        return _main(args)


def _main(args) -> int:
    from ..commands.run import out_dir

    dtype = DTYPES[args.dtype]
    out = out_dir(args.out or f"runs/scaling-{time.strftime('%Y%m%d-%H%M%S')}")
    fit_k = args.fit_k or (1, min(args.steps, DEFAULT_FIT_HI))
    checkpoints = sorted(set(log_steps(args.steps)) | set(fit_k))
    tasks = tasks_from_args(args, dtype)
    lrs_of = {"lm": args.lrs or DEFAULT_LRS["lm"], "vit": args.vit_lrs or DEFAULT_LRS["vit"]}
    jobs = [(t, o, lr) for t in tasks for o in args.optimizers for lr in sorted(set(lrs_of[t.name]))]
    config = {"command": "conserve experiment scaling", "steps": args.steps, "fit_k": list(fit_k), "dtype": args.dtype,
              "optimizers": list(args.optimizers), "seed": args.seed, "device": args.device,
              "gd_subset": args.gd_subset if "fullgd" in args.optimizers else None,
              "checkpoints": checkpoints, "models": {t.name: {"source": t.source, "lrs": sorted(set(lrs_of[t.name])),
                                                             **t.config} for t in tasks}}
    print(f"conserve experiment scaling: {len(jobs)} runs of {args.steps} steps "
          f"({', '.join(t.name + ': ' + t.source for t in tasks)}); out: {out}")
    t0 = time.time()
    all_runs: dict[str, dict[float, dict]] = {}
    with Progress(not args.no_progress, len(jobs) * args.steps) as bar:
        for t, o, lr in jobs:
            done = bar.completed
            bar.describe(f"{t.name} {o} lr={lr:g}")
            all_runs.setdefault(f"{t.name}_{o}", {})[lr] = run_one(
                t, o, lr, args.steps, checkpoints, seed=args.seed, device=args.device, gd_subset=args.gd_subset,
                on_segment=lambda k, d=done: bar.update(d + k))
    results, plots = {}, []
    for t in tasks:
        for o in args.optimizers:
            name = f"{t.name}_{o}"
            fit = fit_series(all_runs[name], fit_k, dtype)
            results[name] = {"source": t.source, "runs": all_runs[name], "fit": fit}
            plots += [_collapse_plot(out, name, all_runs[name], fit)] + _plots(out, name, all_runs[name], fit)
    summary = {"config": config, "seconds": round(time.time() - t0, 1),
               "results": {n: {"source": r["source"], "fit": r["fit"],
                               "runs": {str(lr): v for lr, v in r["runs"].items()}} for n, r in results.items()}}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(_markdown(config, results))
    print(f"wrote {out}/: results.md results.json {' '.join(plots)} ({summary['seconds']} s)")
    for name, r in results.items():
        ov = r["fit"]["overall"]
        lo, hi = r["fit"]["k_range"]
        print(f"  {name}: fit window k in [{lo}, {hi}], lr fit at k={r['fit']['k_fixed']}: lr exponent "
              f"{fmt(ov['lr_exponent'], '.3f')} (theory 2), k exponent {fmt(ov['k_exponent'], '.3f')} (theory 1) over "
              f"{', '.join(r['fit']['fitted_families'])}")
        for f in r["fit"]["fitted_families"]:
            info = r["fit"]["families"][f]
            c, ev = info["collapse"], info["exponent_vs_k"]
            if c["t"]:
                bend = "no bend" if c["bend_t"] is None else f"bends at t={c['bend_t']:.3g}"
                print(f"    {f}: eps/lr vs lr*k collapses within {100 * c['max_spread']:.1f}% over t in "
                      f"[{c['t_range'][0]:.2g}, {c['t_range'][1]:.2g}], {bend}; lr exponent "
                      f"{fmt(ev['exponent'][0], '.2f')} at k={ev['k'][0]} -> {fmt(ev['exponent'][-1], '.2f')} at k={ev['k'][-1]}")
    return 0


class Progress:
    """One rich progress bar over all runs (or nothing)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.completed = enabled, total, 0

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TimeRemainingColumn())
            self.p.__enter__()
            self.task = self.p.add_task("scaling", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self.enabled:
            self.p.update(self.task, description=text)

    def update(self, completed: int) -> None:
        self.completed = completed
        if self.enabled:
            self.p.update(self.task, completed=completed)

    def __exit__(self, *a):
        if self.enabled:
            self.p.__exit__(*a)
        return False
