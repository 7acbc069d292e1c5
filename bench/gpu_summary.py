"""The summary table of one ``bench/gpu_check.sh`` run: every figure beside its floor and target.

    python -m bench.gpu_summary OUT        # OUT: the folder gpu_check.sh wrote

Reads ``OUT/results.csv`` (``bench.kernels``: law pass times, the read floor from the measured copy
bandwidth), ``OUT/step_ab.csv`` (``bench.step_ab``: interleaved tracked/untracked ratios with their
spread) and the checks' status lines (``OUT/status.txt``: one ``name rc`` per line).  A figure that is
missing (its part failed or timed out) is printed as "not measured", never guessed.
"""
from __future__ import annotations

import csv
import os
import sys

# (label, source, key, target): key is (case, dtype) for law-pass rows, a figure prefix for step rows
LAW_ROWS = [
    ("law pass, RoPE plan, fp32", ("llama", "float32"), 1.9),
    ("law pass, RoPE plan, bf16", ("llama", "bfloat16"), 0.95),
    ("law pass, no-RoPE plan (QK Grams), fp32", ("norope", "float32"), 2.6),
    ("law pass, no-RoPE plan (QK Grams), bf16", ("norope", "bfloat16"), None),
]
STEP_ROWS = [
    ("FusedAdamW untracked / torch fused AdamW", "step: FusedAdamW untracked", 1.0),
    ("FusedAdamW tracked (defaults) / torch fused", "step: FusedAdamW tracked (defaults)", 1.05),
    ("FusedAdamW, drift every step / torch fused", "step: FusedAdamW, drift every step", 1.3),
    ("conserve.track(torch fused AdamW) step / untracked", "step: conserve.track(", 1.2),
    ("conserve.track(..., drift=False) step / untracked", "step: conserve.track(..., drift=False)", None),
    ("whole training step, FusedAdamW tracked / untracked", "train step: FusedAdamW tracked", 1.002),
    ("whole training step, conserve.track(torch fused) / untracked", "train step: conserve.track(", 1.005),
]


def _read(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def table(out: str) -> list[str]:
    law = _read(os.path.join(out, "results.csv"))
    steps = _read(os.path.join(out, "step_ab.csv"))
    lines = ["| figure | measured | floor / reference | target | met |", "|---|---|---|---|---|"]
    eps_only = None
    for label, (case, dtype), target in LAW_ROWS:
        rows = [r for r in law if r.get("case") == case and r.get("dtype") == dtype and _num(r.get("triton_ms"))]
        if not rows:
            lines.append(f"| {label} | not measured | | {target or '-'} | |")
            continue
        r = rows[-1]
        ms = _num(r["triton_ms"])
        ref = [f"read floor {_num(r.get('read_floor_ms')):.2f} ms" if _num(r.get("read_floor_ms")) else "",
               f"naive {_num(r.get('naive_ms')):.2f}" if _num(r.get("naive_ms")) else "",
               f"torch.compile {_num(r.get('compiled_ms')):.2f}" if _num(r.get("compiled_ms")) else ""]
        met = "" if target is None else ("yes" if ms <= target else "no")
        lines.append(f"| {label} | {ms:.2f} ms | {', '.join(x for x in ref if x)} | "
                     f"{'<= %.2f ms' % target if target else '-'} | {met} |")
        if (case, dtype) == ("llama", "float32"):
            eps_only = ms
    used = set()
    for label, prefix, target in STEP_ROWS:
        rows = [r for r in steps if r["figure"].startswith(prefix) and r["figure"] not in used
                and not (prefix == "step: conserve.track(" and "drift=False" in r["figure"])]
        if not rows:
            lines.append(f"| {label} | not measured | | {target or '-'} | |")
            continue
        r = rows[-1]
        used.add(r["figure"])
        ratio, lo, hi = _num(r["ratio"]), _num(r["lo"]), _num(r["hi"])
        ref = f"{_num(r['b_ms']):.2f} / {_num(r['a_ms']):.2f} ms, {r['pairs']} pairs {lo:.4f}-{hi:.4f}"
        if "drift=False" in prefix and eps_only is not None:
            extra = _num(r["b_ms"]) - _num(r["a_ms"])
            ref += f"; +{extra:.2f} ms vs law pass {eps_only:.2f} ms (target <= law pass + 0.3 ms)"
            target_txt = f"<= {eps_only + 0.3:.2f} ms extra"
            met = "yes" if extra <= eps_only + 0.3 else "no"
        else:
            target_txt = f"<= {target}x" if target else "-"
            met = "" if target is None else ("yes" if ratio <= target else "no")
        lines.append(f"| {label} | {ratio:.4f}x | {ref} | {target_txt} | {met} |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else "gpu_out"
    status = os.path.join(out, "status.txt")
    if os.path.exists(status):
        print("checks (exit codes; 0 = passed, 124 = timed out):")
        with open(status) as f:
            for line in f:
                print("  " + line.rstrip())
    print()
    print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
