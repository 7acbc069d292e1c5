"""Run reports: summary (markdown + JSON) and PNG plots from a run's ``metrics.jsonl``.

Plots use matplotlib (Agg): ``eps.png`` (eps vs step per law family, log scale) and, when the drift
terms were tracked, ``drift.png`` (per family: measured change and the decay / first / second-order terms).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import UsageError


def json_safe(x):
    """JSON has no NaN/Inf: replace them with null, recursively (tuples become lists)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file (a truncated last line, from a crash, is skipped)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p} not found; pass a run directory written by `conserve run`")
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def families(records: list[dict]) -> list[str]:
    keys = set().union(*(r.keys() for r in records)) if records else set()
    return sorted(k[4:] for k in keys if k.startswith("eps/") and k.count("/") == 1)


def _series(records, key):
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_eps(records: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = families(records)
    fig, ax = plt.subplots(figsize=(8, 5))
    for f in fams:
        xs, ys = _series(records, f"eps/{f}")
        ys = [max(y, 1e-16) for y in ys]
        if xs:
            ax.plot(xs, ys, label=f, lw=1.5)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step k")
    ax.set_ylabel(r"$\epsilon(k)$ = mean$_i$ |h$_i$(k) - h$_i$(0)| / |h$_i$(0)|")
    ax.set_title(title or "conservation-law error per family")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_drift(records: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = [f for f in families(records) if any(r.get(f"drift/{f}/measured") is not None for r in records)]
    if not fams:
        return None
    n = len(fams)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, f in zip(axes.flat, fams):
        for term, style in (("measured", "k-"), ("decay", "C2-"), ("first", "C0-"), ("second", "C3--")):
            xs, ys = _series(records, f"drift/{f}/{term}")
            if xs and any(y > 0 for y in ys):
                ax.plot(xs, [max(y, 1e-20) for y in ys], style, lw=1, label=term)
        ax.set_yscale("log")
        ax.set_title(f, fontsize=9)
        ax.set_xlabel("step k", fontsize=8)
        ax.set_ylabel("norm of the per-step term", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("per-step change h(k+1) - h(k) of each law family and its exact decomposition\n"
                 "(terms that are identically zero, e.g. decay without weight decay, are not drawn)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(records: list[dict], totals: dict | None = None) -> dict:
    """Per family: final and max eps, max per-step measured drift, and (from ``Tracker.totals``) the
    measured total drift vs the identity's prediction."""
    out = {}
    for f in families(records):
        _, eps = _series(records, f"eps/{f}")
        _, drift = _series(records, f"drift/{f}/measured")
        row = {"eps_final": eps[-1] if eps else None, "eps_max": max(eps) if eps else None,
               "max_step_drift": max(drift) if drift else None}
        if totals and f in totals:
            t = totals[f]
            row.update({"total_drift_measured": t["measured"], "total_drift_predicted": t["predicted"],
                        "total_second_order": t["second"], "total_first_order": t["first"], "total_decay": t["decay"],
                        "predicted_gd": t["predicted_no_first"]})
        out[f] = row
    return out


def _fmt(v):
    return "-" if v is None else f"{v:.3e}"


def write_summary(run_dir: Path, records: list[dict], config: dict, totals: dict | None = None,
                  extra: dict | None = None) -> dict:
    """Write ``summary.json`` and ``summary.md``; return the summary dict."""
    fams = summarize(records, totals)
    summary = {"config": config, "steps": records[-1]["step"] if records else 0,
               "final_loss": next((r["loss"] for r in reversed(records) if r.get("loss") is not None), None),
               "families": fams, **(extra or {})}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    opt = config.get("optimizer", "?")
    lines = [f"# conserve run: {summary['steps']} steps, optimizer {opt}", ""]
    if extra and extra.get("stopped"):
        lines += [f"**Stopped early:** {extra['stopped']}", ""]
    lines += [
             f"data: {config.get('data_source', '?')}; final loss {_fmt(summary['final_loss'])} nats/token", "",
             "| family | eps final | eps max | max step drift | total drift measured | predicted (decay+1st+2nd) "
             "| GD prediction (decay+2nd) | first-order total |",
             "|---|---|---|---|---|---|---|---|"]
    for f, r in fams.items():
        lines.append(f"| {f} | {_fmt(r['eps_final'])} | {_fmt(r['eps_max'])} | {_fmt(r['max_step_drift'])} | "
                     f"{_fmt(r.get('total_drift_measured'))} | {_fmt(r.get('total_drift_predicted'))} | "
                     f"{_fmt(r.get('predicted_gd'))} | {_fmt(r.get('total_first_order'))} |")
    lines += ["", "eps: the paper's error (spec 'The paper's error metric'). Drift columns: Euclidean norms over the",
              "family's entries (Frobenius for Gram laws) of h_K - h_0 and of the summed per-step terms of the exact",
              "identity h_{k+1} - h_k = decay + first + second (spec 'Discrete steps'). For gd/sgd the first-order",
              "term vanishes (Noether), so the measured drift should equal the GD prediction up to rounding.",
              "In float32 that rounding is ~1e-7 relative: it is the whole drift of the linear laws (router_sum,",
              "translation: zero in exact arithmetic) and the floor of the first-order term; `--fp64-laws` and a",
              "float64 model push it down. A family whose h_0 is near zero (e.g. vo at a balanced init) has a",
              "large relative eps even when its absolute drift is tiny.", "",
              "Plots: `eps.png`, `drift.png`."]
    if extra and extra.get("declined"):
        lines += ["", "## Blocks without a law", ""] + [f"- `{d['module']}` ({d['block']}): {d['reason']}"
                                                         for d in extra["declined"]]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return summary
