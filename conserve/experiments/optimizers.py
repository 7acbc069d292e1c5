"""``conserve experiment optimizers``: measured drift of each law family against the exact three-term identity.

The same model and batches (the Qwen-3-like decoder of ``conserve experiment scaling`` by default; ``--models
vit`` adds the ViT) under SGD, heavy-ball momentum and AdamW, each with and without weight decay (SGD and
momentum: PyTorch's coupled L2; AdamW: decoupled). Spec "Discrete steps: the exact drift identity", per step
with ``theta_{k+1} = a theta_k + Delta``::

    h_{k+1} - h_k = [h(a theta_k) - h(theta_k)] + 2 B(a theta_k, Delta) + B(Delta, Delta)
                      decay                        first order            second order

Expected (the "theory" column):

- SGD: first order = 0 (Noether), drift = sum of ``lr^2 g^T M g``; coupled L2 with plain SGD is a decay
  ``a = 1 - lr wd`` (``a^2`` on quadratic laws) and still no first-order term;
- momentum (dampening 0): ``p_k = theta_k^T M Delta_k`` obeys ``p_k = beta (p_{k-1} + q_{k-1})``, i.e. first_k =
  beta (first_{k-1} + 2 second_{k-1}) exactly (checked every step: the "recursion" column), and with slowly
  varying ``q`` the drift approaches ``(1 + beta)/(1 - beta)`` times the second-order term; coupled L2 enters
  the momentum buffer, so ``theta^T M grad != 0`` and the recursion no longer holds;
- AdamW: the first-order term does not vanish and dominates (drift O(lr) per step); weight decay adds the
  decoupled decay ``(1 - lr wd)^2``.

Writes into ``--out``: ``results.md`` (a table per model and family), ``results.json`` (totals, ratios and the
per-step norms), ``eps_<model>.png`` (eps vs step, one line per optimizer) and ``drift_<model>.png`` (total
measured drift and its terms, per family and optimizer).
"""
from __future__ import annotations

import json
import math
import time

import torch

from ..errors import NonFiniteError, UsageError
from ..train import add_threads_argument, torch_threads
from .common import (DTYPES, MODELS, family_norms, fmt, tasks_from_args, name_list)

CONFIGS = ("sgd", "sgd+wd", "momentum", "momentum+wd", "adamw", "adamw+wd")


def add_arguments(p) -> None:
    g = p.add_argument_group("data and output")
    g.add_argument("--data", default=None, help="text for the LM: a file (plain or .gz) or a PTB/WikiText directory; "
                   "default: the embedded CPython documentation corpus")
    g.add_argument("--images", default=None, help="images for --models vit: an MNIST idx directory or CIFAR-10 .bin "
                   "file or directory; default: scikit-learn's digits when scikit-learn is installed")
    g.add_argument("--out", default=None, help="run directory (default: runs/optimizers-<timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    o = p.add_argument_group("experiment")
    o.add_argument("--models", type=name_list(MODELS), default=("lm",), help="comma-separated: lm, vit (default lm)")
    o.add_argument("--optimizers", type=name_list(CONFIGS), default=CONFIGS,
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default all)")
    o.add_argument("--sgd-lr", type=float, default=0.05)
    o.add_argument("--momentum-lr", type=float, default=0.005, help="heavy-ball lr (default 0.005 = 0.05 (1 - beta))")
    o.add_argument("--adamw-lr", type=float, default=1e-3)
    o.add_argument("--momentum", type=float, default=0.9, help="beta of the heavy ball (default 0.9)")
    o.add_argument("--weight-decay", type=float, default=0.1, help="wd of the +wd runs (default 0.1)")
    o.add_argument("--steps", type=int, default=200)
    o.add_argument("--batch-size", type=int, default=8, help="LM sequences per batch (default 8)")
    o.add_argument("--seq-len", type=int, default=32)
    o.add_argument("--image-batch", type=int, default=64)
    o.add_argument("--image-limit", type=int, default=4096)
    o.add_argument("--hidden", type=int, default=32)
    o.add_argument("--dtype", choices=tuple(DTYPES), default="float64",
                   help="model precision (default float64; laws accumulated in float64). With float32 the rounding of "
                   "the weights shows: residual ~1e-9 of ||h_0||, and SGD's first-order term at rounding level")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default="cpu")
    add_threads_argument(o)


def _check(args) -> None:
    for name in ("steps", "batch_size", "seq_len", "image_batch", "image_limit", "hidden"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("sgd_lr", "momentum_lr", "adamw_lr"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.momentum < 1:
        raise UsageError(f"--momentum must be in (0, 1), got {args.momentum}")
    if args.weight_decay <= 0:
        raise UsageError(f"--weight-decay must be positive (the runs without it use 0), got {args.weight_decay}")
    if args.hidden % 4:
        raise UsageError(f"--hidden must be a multiple of 4 (4 attention heads), got {args.hidden}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no GPU is available; use --device cpu")


def _optimizer(config: str, params, args):
    from ..commands.run import make_optimizer

    base = config.split("+")[0]
    wd = args.weight_decay if config.endswith("+wd") else 0.0
    lr = {"sgd": args.sgd_lr, "momentum": args.momentum_lr, "adamw": args.adamw_lr}[base]
    opt, lr = make_optimizer(base, params, lr, wd, args.momentum)
    return opt, {"optimizer": base, "lr": lr, "weight_decay": wd, "momentum": args.momentum if base == "momentum" else 0.0}


class MomentumRecursion:
    """Tracker monitor: per step, ``first_k - beta (first_{k-1} + 2 second_{k-1})`` (spec: heavy-ball
    momentum, ``p_k = beta (p_{k-1} + q_{k-1})``), accumulated as sums of squares per entry; ``relative()``
    gives, per family, ``sqrt(sum_k ||err_k||^2) / sqrt(sum_k ||first_k||^2)`` (0 in exact arithmetic)."""

    def __init__(self, beta: float):
        self.beta, self.tracker, self.prev = beta, None, None
        self.err_sq = self.first_sq = None

    def update(self) -> None:
        last = self.tracker.last
        if not last:
            return
        first, second = last["first"], last["second"]
        if self.prev is not None:
            pf, ps = self.prev
            err = first.map(lambda f, a, b: (f - self.beta * (a + 2 * b)).square(), pf, ps)
            fsq = first.map(torch.square)
            self.err_sq = err if self.err_sq is None else self.err_sq.map(torch.add, err)
            self.first_sq = fsq if self.first_sq is None else self.first_sq.map(torch.add, fsq)
        self.prev = (first.clone(), second.clone())

    def metrics(self) -> dict:
        return {}

    def relative(self) -> dict[str, float]:
        if self.err_sq is None:
            return {}
        e = family_norms(self.tracker, self.err_sq.map(torch.sqrt))
        f = family_norms(self.tracker, self.first_sq.map(torch.sqrt))
        return {k: (e[k] / f[k] if f[k] > 0 else (0.0 if e[k] == 0 else math.inf)) for k in e}


def theory(config: str, beta: float) -> str:
    amp = (1 + beta) / (1 - beta)
    return {"sgd": "first = 0 (Noether); drift = sum lr^2 g^T M g",
            "sgd+wd": "coupled L2 = decay a = 1 - lr wd (a^2 on quadratic laws); first = 0",
            "momentum": f"first_k = beta (first_(k-1) + 2 second_(k-1)); measured/second -> (1+beta)/(1-beta) = {amp:.3g}",
            "momentum+wd": "coupled L2 enters the momentum buffer: theta^T M grad != 0, the recursion breaks",
            "adamw": "first order does not vanish and dominates: drift O(lr) per step",
            "adamw+wd": "first order dominates, plus decoupled decay (1 - lr wd)^2"}[config]


def run_one(task, config: str, args, dtype) -> dict:
    """Train ``task``'s model (fixed init, same minibatch sequence) under ``config``; returns per family the
    totals of ``Tracker.totals()``, the identity's residual, the ratios and the per-step records."""
    from ..optim import track
    from ..sinks import MemorySink
    from ..train import train

    model = task.build()
    opt, meta = _optimizer(config, model.parameters(), args)
    monitors = [MomentumRecursion(args.momentum)] if meta["optimizer"] == "momentum" else []
    sink = MemorySink()
    tracked = track(opt, model, every=50, sinks=[sink], drift=True, fp64=True, monitors=monitors, drift_every=1,
                    snapshot_budget=None, keep_last=bool(monitors), cumulative=True)  # every law on every step:
    # exact totals, from the per-entry cumulative sums (exact mode keeps them by default; said, as they are read)
    # (MomentumRecursion reads the per-entry terms of each step: tracker.last)
    for m in monitors:
        m.tracker = tracked.tracker
    try:
        losses = train(model, tracked, task.batches(False, args.seed), args.steps, loss_fn=task.loss_fn,
                       device=args.device, progress=False, log_every=max(1, args.steps // 20))
        tracked.close()
    except NonFiniteError as e:
        raise UsageError(f"{task.name} {config} lr={meta['lr']:g} diverged ({e}); lower its learning rate") from None
    tr = tracked.tracker
    totals = tr.totals()
    c = tr.cumulative
    predicted = c["decay"].map(torch.add, c["first"]).map(torch.add, c["second"])
    residual = family_norms(tr, tr.h.map(torch.sub, tr.h0).map(torch.sub, predicted))
    recursion = monitors[0].relative() if monitors else {}
    fams = {}
    for f, t in totals.items():
        scale = max(t["measured"], t["decay"], t["first"], t["second"])
        fams[f] = {"eps": t["eps"], "measured": t["measured"], "decay": t["decay"], "first": t["first"],
                   "second": t["second"], "residual": residual[f],
                   "residual_relative": residual[f] / t["scale"] if t["scale"] > 0 else residual[f],
                   "residual_over_measured": residual[f] / scale if scale > 0 else 0.0,
                   "first_over_second": t["first"] / t["second"] if t["second"] > 0 else math.nan,
                   "measured_over_second": t["measured"] / t["second"] if t["second"] > 0 else math.nan,
                   "recursion_relative": recursion.get(f)}
    return {**meta, "theory": theory(config, args.momentum), "final_loss": losses[-1] if losses else None,
            "families": fams, "records": sink.records}


def _plots(out, name: str, runs: dict[str, dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fams = sorted(next(iter(runs.values()))["families"])
    cols = min(4, len(fams))
    rows = math.ceil(len(fams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.1 * rows), squeeze=False)
    for ax, f in zip(axes.flat, fams):
        for i, (cfg, r) in enumerate(runs.items()):
            xs = [rec["step"] for rec in r["records"] if rec.get(f"eps/{f}") is not None]
            ys = [max(rec[f"eps/{f}"], 1e-18) for rec in r["records"] if rec.get(f"eps/{f}") is not None]
            ax.loglog(xs, ys, color=plt.cm.tab10(i), ls="--" if cfg.endswith("+wd") else "-", lw=1.2, label=cfg)
        ax.set_title(f, fontsize=9)
        ax.set_xlabel("optimizer step k", fontsize=8)
        ax.set_ylabel("eps (relative drift of the law)", fontsize=8)
        ax.grid(True, which="both", alpha=0.25)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=7, frameon=False)
    fig.suptitle(f"{name}: eps per family vs step, per optimizer (dashed: with weight decay)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    p1 = out / f"eps_{name}.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    terms = ("measured", "decay", "first", "second", "residual")
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    cfgs = list(runs)
    w = 0.8 / len(terms)
    for ax, f in zip(axes.flat, fams):
        for j, term in enumerate(terms):
            vals = [runs[c]["families"][f][term] or math.nan for c in cfgs]  # exact zeros are not drawn
            ax.bar(np.arange(len(cfgs)) + (j - len(terms) / 2 + 0.5) * w, vals, w, label=term, color=plt.cm.Set1(j))
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(cfgs)))
        ax.set_xticklabels(cfgs, rotation=45, ha="right", fontsize=7)
        ax.set_title(f, fontsize=9)
        ax.set_ylabel("norm over the run (law units)", fontsize=8)
        ax.grid(True, axis="y", alpha=0.25)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.suptitle(f"{name}: ||h_K - h_0|| (measured) vs the summed terms of the exact identity (exact zeros omitted)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    p2 = out / f"drift_{name}.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1.name, p2.name]


def _markdown(config: dict, results: dict) -> str:
    lines = ["# conserve experiment optimizers", "",
             "Per step, exactly (spec 'Discrete steps'): h_{k+1} - h_k = decay + first + second. Columns: Euclidean norms",
             "over the family's entries (Frobenius for Gram laws) of the total measured drift h_K - h_0 and of each",
             "term summed over the steps; residual = ||measured - (decay + first + second)||, and relative to ||h_0||",
             "(rounding only); recursion: relative error of first_k = beta (first_(k-1) + 2 second_(k-1)) (momentum",
             "runs).",
             f"{config['steps']} steps, models in {config['dtype']}, laws accumulated in float64.", ""]
    for name, r in results.items():
        lines += [f"## {name}", "", f"data: {r['source']}", ""]
        lines += ["| optimizer | lr | wd | final loss | theory |", "|---|---|---|---|---|"]
        for cfg, run in r["runs"].items():
            lines.append(f"| {cfg} | {run['lr']:g} | {run['weight_decay']:g} | {fmt(run['final_loss'], '.3f')} "
                         f"| {run['theory']} |")
        fams = sorted(next(iter(r["runs"].values()))["families"])
        for f in fams:
            lines += ["", f"### {f}", "",
                      "| optimizer | eps final | measured | decay | first | second | residual (rel.) | first/second "
                      "| measured/second | recursion |", "|---|---|---|---|---|---|---|---|---|---|"]
            for cfg, run in r["runs"].items():
                v = run["families"][f]
                lines.append(f"| {cfg} | {fmt(v['eps'])} | {fmt(v['measured'])} | {fmt(v['decay'])} | {fmt(v['first'])} | "
                             f"{fmt(v['second'])} | {fmt(v['residual'])} ({fmt(v['residual_relative'], '.1e')}) | "
                             f"{fmt(v['first_over_second'], '.3g')} | {fmt(v['measured_over_second'], '.3g')} | "
                             f"{fmt(v['recursion_relative'], '.1e')} |")
        lines += ["", f"Plots: `eps_{name}.png`, `drift_{name}.png`.", ""]
    lines += ["Reading: SGD rows should show first/second at rounding level; momentum rows a recursion error at rounding",
              "level and measured/second growing toward (1+beta)/(1-beta) as the steps accumulate; AdamW rows",
              "first/second >> 1; +wd rows a decay term (SGD, AdamW) or a broken recursion (momentum, coupled L2).",
              "Linear laws (router_sum, translation) have no second-order term: their ratios to it are undefined (-)."]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    _check(args)
    with torch_threads(args.threads):
        return _main(args)


def _main(args) -> int:
    from ..commands.run import out_dir

    dtype = DTYPES[args.dtype]
    out = out_dir(args.out or f"runs/optimizers-{time.strftime('%Y%m%d-%H%M%S')}")
    tasks = tasks_from_args(args, dtype)
    config = {"command": "conserve experiment optimizers", "steps": args.steps, "dtype": args.dtype, "seed": args.seed,
              "momentum": args.momentum, "weight_decay": args.weight_decay, "device": args.device,
              "lrs": {"sgd": args.sgd_lr, "momentum": args.momentum_lr, "adamw": args.adamw_lr},
              "models": {t.name: {"source": t.source, **t.config} for t in tasks}}
    print(f"conserve experiment optimizers: {len(tasks) * len(args.optimizers)} runs of {args.steps} steps; out: {out}")
    t0 = time.time()
    results, plots = {}, []
    from .scaling import Progress

    with Progress(not args.no_progress, len(tasks) * len(args.optimizers)) as bar:
        for t in tasks:
            runs = {}
            for cfg in args.optimizers:
                bar.describe(f"{t.name} {cfg}")
                runs[cfg] = run_one(t, cfg, args, dtype)
                bar.update(bar.completed + 1)
            results[t.name] = {"source": t.source, "runs": runs}
            plots += _plots(out, t.name, runs)
    summary = {"config": config, "seconds": round(time.time() - t0, 1), "results": results}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(_markdown(config, results))
    print(f"wrote {out}/: results.md results.json {' '.join(plots)} ({summary['seconds']} s)")
    for name, r in results.items():
        for cfg, run in r["runs"].items():
            quad = [v for f, v in run["families"].items() if v["second"] > 0]
            fo = max((v["first_over_second"] for v in quad), default=math.nan)
            res = max((v["residual_relative"] for v in run["families"].values()), default=math.nan)
            print(f"  {name} {cfg:12s} max first/second {fmt(fo, '.2e')}  max residual / ||h_0|| {fmt(res, '.1e')}")
    return 0
