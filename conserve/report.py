"""Run reports: summary (markdown + JSON) and PNG plots from any ``metrics.jsonl``.

``report(path)`` (``conserve report PATH``) and ``conserve run`` write the same files:
``summary.md`` / ``summary.json`` (per family: eps, drift totals and a verdict a newcomer can read),
``eps.png`` (eps per family beside the loss curve), ``drift.png`` (per family: the measured per-step
change and its exact decomposition into decay / first / second-order terms, spec "Discrete steps") and
``layers.png`` (a family x layer heatmap of the final eps). Plots use matplotlib (Agg).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Mapping

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
    """The records of a metrics.jsonl file (one JSON object per line with a ``step``; a truncated last
    line, from a crash, is skipped; other unreadable lines, and steps that go back, are skipped/kept with a
    ``RuntimeWarning``; integer-valued float steps become ints). Raises ``UsageError`` for a missing file or one without records."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise UsageError(f"{p} not found; pass a run directory or a metrics.jsonl file written by conserve")
    out, bad, back, odd, n_odd = [], [], None, None, 0
    lines = p.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) and line.strip():  # a torn last line is a crash's; one inside the file is damage
                bad.append(i)
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, float) and step.is_integer():
            rec["step"] = step = int(step)
        if isinstance(step, int) and not isinstance(step, bool):
            if back is None and out and step <= out[-1]["step"]:
                back = (i, out[-1]["step"], step)
            for k, v in list(rec.items()):  # a law value / loss another tool wrote as a string, list...
                if (k == "loss" or k.startswith(_NUMERIC)) and v is not None and not _real(v):
                    del rec[k]  # missing, not null (null is a non-finite value)
                    odd = odd or (k, v, step)
                    n_odd += 1
            out.append(rec)
    if bad:
        warnings.warn(f"conserve: {p}: skipped {len(bad)} line(s) that are not JSON (line {bad[0]}"
                      f"{'...' if len(bad) > 1 else ''}); the report covers the other records", RuntimeWarning,
                      stacklevel=2)
    if odd is not None:
        warnings.warn(f"conserve: {p}: {n_odd} value(s) are not numbers (e.g. {odd[0]} = {odd[1]!r} at step {odd[2]}); "
                      "they are left out", RuntimeWarning, stacklevel=2)
    if back is not None:
        warnings.warn(f"conserve: {p}: the steps go back at line {back[0]} (step {back[2]} after {back[1]}): two "
                      "runs in one file? the report mixes them; write each run to its own file", RuntimeWarning,
                      stacklevel=2)
    return out


_NUMERIC = ("eps/", "drift/", "control/", "broken/")  # the keys whose values the report computes with


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json_object(path: Path) -> dict:
    """The JSON object in ``path`` beside a metrics file (``config.json``, ``summary.json``), or ``{}``
    when absent; one that is unreadable or not an object (damaged, another program's) is ignored with
    a ``RuntimeWarning``: the report is then built from the metrics alone."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        obj = e
    if isinstance(obj, dict):
        return obj
    why = f"unreadable ({type(obj).__name__})" if isinstance(obj, Exception) else f"a JSON {type(obj).__name__}, not an object"
    warnings.warn(f"conserve: {path} is {why}; ignored (the report uses the metrics file alone): remove or "
                  "restore it", RuntimeWarning, stacklevel=3)
    return {}


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


def layer_keys(records: list[dict]) -> dict[str, dict[str, str]]:
    """``{family: {"layer0": "eps/swiglu/layer0", ..., "global": ...}}`` from the metric keys."""
    keys = set().union(*(r.keys() for r in records)) if records else set()
    out: dict[str, dict[str, str]] = {}
    for k in sorted(keys):
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "eps":
            out.setdefault(parts[1], {})[parts[2]] = k
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_eps(records: list[dict], path: Path, title: str = "") -> Path:
    """eps per family vs step (log scale, left) beside the training loss (right, when recorded)."""
    plt = _plt()
    fams = families(records)
    has_loss = any(isinstance(r.get("loss"), (int, float)) for r in records)
    fig, axes = plt.subplots(1, 2 if has_loss else 1, figsize=(12 if has_loss else 8, 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2] if has_loss else [1]})
    ax = axes[0, 0]
    controls = False
    for i, f in enumerate(fams):
        xs, ys = _series(records, f"eps/{f}")
        if xs:
            ax.plot(xs, [max(y, 1e-16) for y in ys], label=f, lw=1.5, color=f"C{i % 10}")
        cx, cy = _series(records, f"control/{f}")
        if cx:  # the non-conserved baseline: same terms, every sign + (conserve.tracking.control)
            ax.plot(cx, [max(y, 1e-16) for y in cy], ls=":", marker=".", ms=3, lw=1, color=f"C{i % 10}")
            controls = True
    if controls:
        ax.plot([], [], "k:", marker=".", ms=3, lw=1, label="dotted: control\n(same terms, all\nsigns +: not\nconserved)")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step k")
    ax.set_ylabel(r"$\epsilon(k)$ = mean$_i$ |h$_i$(k) - h$_i$(0)| / |h$_i$(0)|")
    ax.set_title(title or "conservation-law error per family", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if fams:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, title="family")
    if has_loss:
        lx, ly = _series(records, "loss")
        bx = axes[0, 1]
        bx.plot(lx, ly, "k-", lw=1)
        bx.set_xlabel("optimizer step k")
        bx.set_ylabel("training loss")
        bx.set_title("loss", fontsize=10)
        bx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_drift(records: list[dict], path: Path) -> Path | None:
    """Per family: the measured per-step change and its decay / first / second-order terms (log scale)."""
    plt = _plt()
    fams = [f for f in families(records) if any(r.get(f"drift/{f}/measured") is not None for r in records)]
    if not fams:
        return None
    n = len(fams)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows + 0.9), squeeze=False)
    styles = (("measured", "k-"), ("decay", "C2-"), ("first", "C0-"), ("second", "C3--"))
    for ax, f in zip(axes.flat, fams):
        for term, style in styles:
            xs, ys = _series(records, f"drift/{f}/{term}")
            if xs and any(y > 0 for y in ys):
                ax.plot(xs, [max(y, 1e-20) for y in ys], style, lw=1, label=term)
        ax.set_yscale("log")
        ax.set_title(f, fontsize=9)
        ax.set_xlabel("optimizer step k", fontsize=8)
        ax.set_ylabel("|per-step term| (law units)", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=c, ls=ls, label=t) for t, (c, ls) in
               zip((s[0] for s in styles), (("k", "-"), ("C2", "-"), ("C0", "-"), ("C3", "--")))]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("per-step change h(k+1) - h(k) of each law family and its exact decomposition\n"
                 "(terms that are identically zero, e.g. decay without weight decay, are not drawn)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(records: list[dict], path: Path) -> Path | None:
    """Heatmap of the final eps per family (rows) and layer (columns), log10 colour scale."""
    lk = layer_keys(records)
    if not lk or not records:
        return None
    plt = _plt()
    import numpy as np

    cols = sorted({c for v in lk.values() for c in v}, key=lambda c: (c == "global", int(c[5:]) if c[5:].isdigit() else 0))
    fams = sorted(lk)
    last = {}
    for r in records:  # the latest finite value of every key
        for f in fams:
            for c, key in lk[f].items():
                v = r.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    last[(f, c)] = v
    grid = np.full((len(fams), len(cols)), np.nan)
    for (f, c), v in last.items():
        grid[fams.index(f), cols.index(c)] = math.log10(max(v, 1e-16))
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(cols), 0.8 + 0.45 * len(fams)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(fams)), fams, fontsize=8)
    ax.set_xlabel("layer")
    ax.set_ylabel("law family")
    for i in range(len(fams)):
        for j in range(len(cols)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{10 ** grid[i, j]:.0e}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=ax, label=r"log$_{10}$ eps at the last step")
    ax.set_title(f"eps per family and layer, step {records[-1]['step']} (blank: no law there)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- verdicts
ROUNDING_EPS = 1e-5  # below this eps a law holds to float32 rounding whatever its drift terms


def verdict(stats: dict, broken_by: list[str] | None = None) -> tuple[str, str]:
    """A short verdict for one family: ``(key, sentence)``.

    ``stats``: ``eps_final``; the per-step term norms summed over the recorded steps (``sum_measured``,
    ``sum_decay``, ``sum_first``, ``sum_second``, None when the drift was not decomposed); optionally
    ``guarded`` (fraction of instances with ``h_0 ~ 0``, from ``Tracker.totals``) and
    ``total_drift_measured``, ``balance`` and ``control_final`` (eps of the family's all-signs-+ control).
    ``nonfinite_from`` (first step whose eps is NaN/Inf/null, with ``nonfinite_steps`` and
    ``eps_last_finite``) makes the verdict ``nonfinite`` whatever the rest says.
    Keys: ``nonfinite``, ``broken_by``, ``h0_zero``, ``no_data``, ``holds_rounding``, ``weight_decay``, ``first_order``,
    ``step_size`` (second-order drift as large as the control's motion), ``holds``, ``not_decomposed``."""
    bad_from = stats.get("nonfinite_from")
    if bad_from is not None:
        last = stats.get("eps_last_finite")
        return "nonfinite", (f"non-finite law values from step {bad_from} ({stats.get('nonfinite_steps')} recorded "
                             "step(s)): the parameters diverged; lower the learning rate or check the gradients"
                             + (f" (last finite eps {last:.2e})" if last is not None else ""))
    if broken_by:
        return "broken_by", "broken_by: " + "; ".join(broken_by)
    eps = stats.get("eps_final")
    if eps is None:
        return "no_data", "no finite eps recorded"
    if (stats.get("guarded") or 0.0) >= 0.5:
        tot = stats.get("total_drift_measured")
        return "h0_zero", ("h_0 ~ 0: relative eps not meaningful, absolute drift shown"
                           + (f" (|h_K - h_0| = {tot:.2e})" if tot is not None else ""))
    if eps < ROUNDING_EPS:
        return "holds_rounding", f"holds to float rounding (eps {eps:.1e})"
    sm, sd, sf, ss = (stats.get(k) for k in ("sum_measured", "sum_decay", "sum_first", "sum_second"))
    if sm is None or sd is None or sf is None or ss is None:
        return "not_decomposed", (f"eps {eps:.2e}; drift not decomposed in this run (drift off, or no drift step "
                                  "reached this family's laws: more steps, or drift_every=1 / "
                                  "--drift-every 1 --snapshot-budget none)")
    total = sd + sf + ss
    if total <= 0:
        return "holds_rounding", f"holds (no drift term recorded; eps {eps:.1e})"
    d, f1 = sd / total, sf / total
    if d >= max(f1, ss / total):
        return "weight_decay", f"broken by weight decay (decay is {d:.0%} of the per-step drift)"
    if f1 >= 0.5:
        return "first_order", f"broken by the optimizer (first order: {f1:.0%} of the per-step drift)"
    within = abs(sm - ss) / sm if sm > 0 else 0.0
    text = f"holds: drift = discretisation (second order) within {within:.0e}" if within < 0.01 else \
        f"holds: drift = discretisation (second order) within {within:.0%}"
    ctrl = stats.get("control_final")
    if ctrl:  # read the law against its non-conserved control (conserve.tracking.control)
        ratio = eps / ctrl
        if ratio > 0.5:
            return "step_size", (f"conserved by the flow; at this learning rate its second-order drift (O(lr^2) per "
                                 f"step) is {ratio:.0%} of a non-conserved control's motion: a smaller lr conserves "
                                 "it better")
        text += f"; eps {ratio:.0e} x the control's"
    bal = stats.get("balance")
    if eps > 0.05 and bal is not None and bal < 0.1:
        text += f"; eps is large because h_0 is small (|h_0| = {bal:.0e} of its magnitude)"
    return "holds", text


def summarize(records: list[dict], totals: dict | None = None, broken_by: dict[str, list[str]] | None = None) -> dict:
    """Per family: final and max eps, max per-step measured drift, the per-step term norms summed over
    the recorded steps, the verdict, and (from ``Tracker.totals``) the measured total drift vs the
    identity's prediction.  Totals of a tracker that kept no per-entry cumulative sums (``cumulative``
    False: sampled drift) give ``total_drift_measured`` (||h_K - h_0||), ``guarded`` and ``balance`` and
    ``total_decomposition: False``; the prediction columns are None then (not estimated)."""
    out = {}
    for f in families(records):
        _, eps = _series(records, f"eps/{f}")
        row = {"eps_final": eps[-1] if eps else None, "eps_max": max(eps) if eps else None}
        bad = [r["step"] for r in records if f"eps/{f}" in r and not _finite(r[f"eps/{f}"])]
        if bad:  # NaN/Inf law values (JSONL null, on_nonfinite='warn'): never summarised as the last finite eps
            row.update(nonfinite_from=bad[0], nonfinite_steps=len(bad), eps_last_finite=row["eps_final"])
            if bad[-1] == max(r["step"] for r in records if f"eps/{f}" in r):
                row["eps_final"] = None
        _, ctrl = _series(records, f"control/{f}")
        row["control_final"] = ctrl[-1] if ctrl else None
        for term in ("measured", "decay", "first", "second"):
            _, ys = _series(records, f"drift/{f}/{term}")
            row[f"sum_{term}"] = math.fsum(ys) if ys else None
        _, m = _series(records, f"drift/{f}/measured")
        row["max_step_drift"] = max(m) if m else None
        if totals and f in totals:
            t = totals[f]
            kept = decomposition_kept(t)
            row.update({"total_drift_measured": t.get("measured"), "total_drift_predicted": t.get("predicted"),
                        "total_second_order": t.get("second"), "total_first_order": t.get("first"),
                        "total_decay": t.get("decay"), "predicted_gd": t.get("predicted_no_first"),
                        "guarded": t.get("guarded"), "balance": t.get("balance"),
                        # the change over the decomposed (law, step) pairs: what decay+1st+2nd predicts
                        # (totals saved before measured_sampled existed: the measured total)
                        "total_drift_measured_sampled": t.get("measured_sampled", t.get("measured") if kept else None),
                        "total_decomposition": kept})
        reasons = (broken_by or {}).get(f)
        if not reasons:  # a run without a summary.json (a framework callback, a user's loop): the rows' count
            n = next((r[f"broken/{f}"] for r in reversed(records) if _finite(r.get(f"broken/{f}"))), 0)
            reasons = [f"{n:g} law(s) broken by the optimizer's param_groups (broken/{f}; the run's "
                       "BrokenLawWarning names them)"] if n > 0 else None
        row["verdict_key"], row["verdict"] = verdict(row, reasons)
        out[f] = row
    return out


NOT_KEPT = ("total decomposition not kept (sampled drift): pass cumulative=True (conserve run: --cumulative) to keep "
            "the per-entry sums that the total and prediction columns need")


def decomposition_kept(totals_of_family: Mapping) -> bool:
    """Whether ``Tracker.totals()`` of one family holds the per-entry decomposition (``decay``, ``first``,
    ``second``, ``predicted``...): False for a tracker built without ``cumulative`` (its ``cumulative`` key
    is False); totals saved before the key existed always had it."""
    return bool(totals_of_family.get("cumulative", True))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _fmt(v):
    return "-" if v is None else f"{v:.3e}"


def write_summary(run_dir: Path, records: list[dict], config: dict, totals: dict | None = None,
                  extra: dict | None = None, broken_by: dict[str, list[str]] | None = None) -> dict:
    """Write ``summary.json`` and ``summary.md`` into ``run_dir``; return the summary dict.

    ``totals``: ``Tracker.totals()`` (kept in summary.json so ``conserve report`` can rebuild the same
    summary); ``extra``: e.g. ``declined``, ``seconds``, ``stopped``; ``broken_by``: reasons per family."""
    fams = summarize(records, totals, broken_by)
    summary = {"config": config, "steps": records[-1]["step"] if records else 0,
               "final_loss": next((r["loss"] for r in reversed(records) if isinstance(r.get("loss"), (int, float))), None),
               "families": fams, **({"totals": totals} if totals else {}), **(extra or {})}
    Path(run_dir, "summary.json").write_text(json.dumps(json_safe(summary), indent=2))
    lm = config.get("command") == "conserve run"
    lines = [f"# {config.get('command', 'conserve')}: {summary['steps']} steps"
             + (f", optimizer {config['optimizer']}" if config.get("optimizer") else ""), ""]
    if extra and extra.get("stopped"):
        lines += [f"**Stopped early:** {extra['stopped']}", ""]
    lines += [f"data: {config.get('data_source', '?')}; final loss {_fmt(summary['final_loss'])}"
              + (" nats/token" if lm else ""), "",
              "## Verdicts", "", "| family | verdict | eps final |", "|---|---|---|"]
    lines += [f"| {f} | {r['verdict']} | {'non-finite' if r.get('nonfinite_from') is not None and r['eps_final'] is None else _fmt(r['eps_final'])} |"
              for f, r in fams.items()]
    lines += ["", "## Drift", "",
              "| family | eps max | max step drift | sum of per-step decay | first | second | total drift measured "
              "| predicted (decay+1st+2nd) | GD prediction (decay+2nd) |", "|---|---|---|---|---|---|---|---|---|"]
    for f, r in fams.items():
        lines.append(f"| {f} | {_fmt(r['eps_max'])} | {_fmt(r['max_step_drift'])} | {_fmt(r['sum_decay'])} | "
                     f"{_fmt(r['sum_first'])} | {_fmt(r['sum_second'])} | {_fmt(r.get('total_drift_measured_sampled'))} | "
                     f"{_fmt(r.get('total_drift_predicted'))} | {_fmt(r.get('predicted_gd'))} |")
    if any(r.get("total_decomposition") is False for r in fams.values()):
        lines += ["", NOT_KEPT + "."]
    lines += ["", "How to read it. eps is the error of Tran et al. 2026: the mean over a family's laws of",
              "|h(k) - h(0)| / |h(0)|. Each step's change splits exactly into decay (weight decay), first order",
              "(the optimizer's update direction; zero for gradient descent by Noether's theorem) and second order",
              "(the discretisation, O(lr^2) per step; README 'Use it in a training loop'). The control of a family",
              "is the same quadratic with every sign + (e.g. |W_up[u,:]|^2 + |W_down[:,u]|^2): it is not conserved, so",
              "a law whose eps approaches its control's is not conserved at that step size. A law 'holds' when its drift is the",
              "discretisation alone; 'broken by the optimizer' when the first-order term dominates (Adam, sign",
              "methods); 'broken by weight decay' when decay does. A family whose h_0 is ~0 (e.g. vo at a balanced",
              "init) has a large relative eps even when its absolute drift is tiny: read its drift columns instead.",
              "Drift columns: Euclidean norms over the family's entries (Frobenius for Gram laws); totals are norms",
              "of the summed measured changes and terms over the decomposed (law, step) pairs (equal by the identity;",
              "by default each drift step decomposes one group of laws, see conserve.track's snapshot_budget; the",
              "per-entry sums they need are kept in exact mode or with cumulative=True / --cumulative). float32",
              "rounding (~1e-7 relative) is the whole drift of the linear laws (router_sum, translation); `--fp64-laws`",
              "pushes it down. The 'total' and 'prediction' columns need the live tracker (conserve run); from a",
              "metrics file alone they are '-'.", "",
              "Plots: `eps.png` (eps beside the loss), `drift.png` (per-step terms), `layers.png` (eps per layer)."]
    if extra and extra.get("declined"):
        lines += ["", "## Blocks without a law", ""] + [f"- `{d['module']}` ({d['block']}): {d['reason']}"
                                                         for d in extra["declined"]]
    Path(run_dir, "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def plot_all(records: list[dict], out: Path, title: str = "") -> list[Path]:
    """Every plot of a run that its records allow: eps.png, drift.png, layers.png."""
    made = [plot_eps(records, out / "eps.png", title), plot_drift(records, out / "drift.png"),
            plot_layers(records, out / "layers.png")]
    return [p for p in made if p is not None]


def report(path: str | Path, out: str | Path | None = None) -> dict:
    """Build ``summary.md``, ``summary.json`` and every plot from a ``metrics.jsonl`` (a run directory or
    the file itself, e.g. from your own training loop with ``conserve.JSONLSink``).

    ``config.json`` and the totals of an earlier ``summary.json`` beside the metrics are used when
    present. Output goes to ``out`` (default: the metrics file's directory). Returns the summary dict.
    Raises ``UsageError`` for a missing file, a file without conserve records, or an unwritable ``out``."""
    src = Path(path)
    metrics = src / "metrics.jsonl" if src.is_dir() else src
    records = read_metrics(metrics)
    if not records:
        raise UsageError(f"{metrics} has no records with a 'step'; pass a metrics.jsonl written by conserve "
                         "(conserve run, or conserve.JSONLSink in your loop)")
    if not families(records):
        raise UsageError(f"{metrics} has no eps/<family> metrics; pass a metrics.jsonl written by conserve")
    here = metrics.parent
    dest = Path(out) if out is not None else here
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create {dest}: {e.strerror}; pass --out to a writable directory") from None
    config = _json_object(here / "config.json") or {"command": "conserve report", "data_source": str(metrics)}
    old = _json_object(here / "summary.json")
    extra = {k: old[k] for k in ("declined", "stopped", "seconds", "broken_by") if k in old}
    totals, broken = old.get("totals"), old.get("broken_by")
    try:
        summary = write_summary(dest, records, config, totals if isinstance(totals, dict) else None, extra,
                                broken if isinstance(broken, dict) else None)
        plot_all(records, dest, f"{config.get('optimizer', '')} {metrics.parent.name}".strip())
    except OSError as e:
        raise UsageError(f"cannot write the report into {dest}: {e.strerror}; pass --out to a writable directory") from None
    return summary
