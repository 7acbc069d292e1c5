"""Tracked vs untracked steps, measured side by side in interleaved blocks (A B A B ...).

    python -m bench.step_ab                          # GPU: 8 Llama-3-8B-shaped layers, fp32 master weights
    python -m bench.step_ab --device cpu --small     # toy size on the CPU (checks the script runs)

Each comparison builds a FRESH optimizer for every block (state, tracker and kernel caches built
before the block's clock starts), runs ``--warmup`` untimed steps, then times ``--steps`` consecutive
steps (a multiple of the tracker's drift cadence, so every block holds the same number of drift
steps: the figure is a mean over whole cadences, not a median that skips the drift steps) with one
clock around the block (CUDA events on a GPU).  A and B alternate for ``--pairs`` pairs; the ratio is
B / A per pair, printed as the median with the min-max spread beside it, and the mean times.

Optimizer step alone (random gradients held fixed):
  * conserve FusedAdamW untracked                / torch fused AdamW
  * conserve FusedAdamW tracked (defaults)        / torch fused AdamW
  * conserve FusedAdamW, drift every step         / torch fused AdamW
  * ``conserve.track(torch fused AdamW)``        / torch fused AdamW
  * ``conserve.track(..., drift=False)`` (eps only) / torch fused AdamW
Whole training step (forward + backward in bf16 autocast + step; ``--tokens`` per step):
  * FusedAdamW tracked / FusedAdamW untracked
  * ``conserve.track(torch fused AdamW)`` / torch fused AdamW

The laws are detected once and handed to every tracker (detection is not part of a step).  One CSV
row per comparison is appended to ``--csv`` (figure, A ms, B ms, ratio, spread); ``bench.gpu_summary``
reads it.  Not a timed test: the figures are printed, never asserted.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import time

import torch

from bench.fused_optim import build, free, set_grads

OPT_CASES = ("fused_untracked", "fused_tracked", "fused_drift_every_step", "track_torch_fused", "track_eps_only")
TRAIN_CASES = ("train_fused", "train_track")


def _clock(device):
    """``(start, stop)``: stop() returns the milliseconds since start() (CUDA events on a GPU)."""
    if device.type == "cuda":
        box = {}

        def start():
            box["a"] = torch.cuda.Event(enable_timing=True)
            box["b"] = torch.cuda.Event(enable_timing=True)
            box["a"].record()

        def stop():
            box["b"].record()
            torch.cuda.synchronize()
            return box["a"].elapsed_time(box["b"])
    else:
        box = {}

        def start():
            box["t"] = time.perf_counter()

        def stop():
            return (time.perf_counter() - box["t"]) * 1e3
    return start, stop


def interleaved(make_a, make_b, step_a, step_b, device, pairs: int, steps: int, warmup: int):
    """Per-step mean times of A and B over ``pairs`` interleaved block pairs: ``(a_ms, b_ms)`` lists."""
    start, stop = _clock(device)
    a_ms, b_ms = [], []
    for _ in range(pairs):
        for make, step, out in ((make_a, step_a, a_ms), (make_b, step_b, b_ms)):
            opt = make()
            for _ in range(warmup):
                step(opt)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start()
            for _ in range(steps):
                step(opt)
            out.append(stop() / steps)
            if hasattr(opt, "close"):
                opt.close()
            free(opt)
    return a_ms, b_ms


def summarise(name, a_ms, b_ms):
    ratios = [b / a for a, b in zip(a_ms, b_ms)]
    med = statistics.median(ratios)
    row = dict(figure=name, a_ms=statistics.mean(a_ms), b_ms=statistics.mean(b_ms), ratio=med,
               lo=min(ratios), hi=max(ratios), pairs=len(ratios))
    print(f"{name:<58s} {row['b_ms']:9.3f} / {row['a_ms']:9.3f} ms = {med:.4f}x "
          f"(pairs {len(ratios)}: {row['lo']:.4f}-{row['hi']:.4f})", flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy sizes (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=6, help="interleaved block pairs per comparison (>= 6 on a GPU)")
    ap.add_argument("--opt-steps", type=int, default=40, help="timed optimizer steps per block (a multiple of the "
                    "drift cadence)")
    ap.add_argument("--train-steps", type=int, default=8, help="timed training steps per block (a multiple of the "
                    "drift cadence)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per training step")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (batch = tokens / seq)")
    ap.add_argument("--parts", default="opt,train", help="comma-separated subset of opt,train")
    ap.add_argument("--cases", default=",".join(OPT_CASES + TRAIN_CASES), help="comma-separated subset of "
                    + ", ".join(OPT_CASES + TRAIN_CASES))
    ap.add_argument("--csv", default=None, help="CSV to append to (default: none)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    import conserve
    from conserve.optim import FusedAdamW
    from conserve.tracker import DRIFT_EVERY

    for k in ("opt_steps", "train_steps"):
        if getattr(args, k) % DRIFT_EVERY:
            ap.error(f"--{k.replace('_', '-')} must be a multiple of the drift cadence ({DRIFT_EVERY})")
    parts = set(args.parts.split(","))
    cases = set(args.cases.split(","))
    model = build(device, args.small, args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    laws = conserve.detect(model)
    lr, wd = 1e-4, 0.1
    fused_kw = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    base_name = "torch fused AdamW" if device.type == "cuda" else "torch foreach AdamW"
    print(f"{n_params / 1e9:.3f} B parameters on {device}; {args.pairs} block pairs; base: {base_name}", flush=True)

    def torch_adamw():
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, **fused_kw)

    def fused(**kw):
        return lambda: FusedAdamW(model.parameters(), lr=lr, weight_decay=wd, **kw)

    def tracked_torch(**kw):
        return lambda: conserve.track(torch_adamw(), model, laws=laws, every=50, **kw)

    rows = []
    if "opt" in parts:
        set_grads(model)
        opt_cases = {
            "fused_untracked": ("FusedAdamW untracked / " + base_name, fused()),
            "fused_tracked": ("FusedAdamW tracked (defaults) / " + base_name, fused(track=model, every=50)),
            "fused_drift_every_step": ("FusedAdamW, drift every step / " + base_name,
                                       fused(track=model, every=50, drift_every=1)),
            "track_torch_fused": ("conserve.track(" + base_name + ") / untracked", tracked_torch()),
            "track_eps_only": ("conserve.track(..., drift=False) / untracked", tracked_torch(drift=False)),
        }
        step = lambda opt: opt.step()  # noqa: E731
        for key in OPT_CASES:
            if key in cases:
                name, make = opt_cases[key]
                a, b = interleaved(torch_adamw, make, step, step, device, args.pairs, args.opt_steps, args.warmup)
                rows.append(summarise("step: " + name, a, b))
    if "train" in parts:
        seq = 64 if args.small else min(args.seq, args.tokens)
        x = torch.randint(0, model.config.vocab_size, (1 if args.small else max(1, args.tokens // seq), seq),
                          device=device, generator=torch.Generator(device).manual_seed(0))

        def train(opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
            loss.backward()
            opt.step()

        train_cases = {
            "train_fused": ("train step: FusedAdamW tracked / untracked", fused(), fused(track=model, every=50)),
            "train_track": ("train step: conserve.track(" + base_name + ") / untracked", torch_adamw,
                            tracked_torch()),
        }
        for key in TRAIN_CASES:
            if key in cases:
                name, make_a, make_b = train_cases[key]
                a, b = interleaved(make_a, make_b, train, train, device, args.pairs, args.train_steps, args.warmup)
                rows.append(summarise(name, a, b))
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        new = not os.path.exists(args.csv)
        try:
            import triton
            tv = triton.__version__
        except ImportError:
            tv = ""
        dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["timestamp", "device", "torch", "triton", "params", "figure", "a_ms", "b_ms", "ratio",
                            "lo", "hi", "pairs"])
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            for r in rows:
                w.writerow([now, dev, torch.__version__, tv, n_params, r["figure"], f"{r['a_ms']:.4f}",
                            f"{r['b_ms']:.4f}", f"{r['ratio']:.4f}", f"{r['lo']:.4f}", f"{r['hi']:.4f}", r["pairs"]])
    return rows


if __name__ == "__main__":
    main()
