"""Run reports: summary (markdown + JSON) and PNG plots from any ``metrics.jsonl``.

``conserve run`` writes them into its run directory; ``report(path)`` (``conserve report PATH``) writes
the same files into ``report/`` beside the metrics file (``overwrite=True``: beside it, replacing the
run's own). ``summary.md`` / ``summary.json``: per family eps, drift sums and totals and a verdict that
names the numbers it rests on (``verdict``: decomposed steps, the summed terms, the residual and the float
rounding floor of ``conserve.analysis.floor``; "undetermined" where no term clears the floor; first-order
drift under plain SGD is a bug report, not a verdict); a run that stopped before ``config.json``'s
``steps`` says where and why (``run_status``); a torn last metrics line is said (``truncated_note``).
``eps.png`` (eps and its control beside the loss, decomposed steps ticked, eps jumps at loss spikes
marked), ``drift.png`` (per family: the measured per-step change, its exact decomposition into decay /
first / second-order terms, spec "Discrete steps", and the residual, as markers on one step axis, with the
rounding floor) and ``layers.png`` (final eps per family and layer against the family's control). Plots
use matplotlib (Agg).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Mapping

from .errors import UsageError
from .laws.base import Law


def json_safe(x):
    """JSON has no NaN/Inf: replace them with null, recursively (tuples become lists)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


class Records(list):
    """The records of a metrics file (a list of dicts); ``truncated``: the byte length of a torn last line
    that was left out (None when the file ends with a whole record)."""

    truncated: int | None = None
    name: str = "metrics.jsonl"


def read_metrics(path: str | Path) -> Records:
    """The records of a metrics.jsonl file (one JSON object per line with a ``step``). A last line that is
    not JSON (torn by a crash or a kill) is left out and its length kept in ``Records.truncated``
    (``write_summary`` and ``conserve report`` say it: ``truncated_note``); other unreadable lines, and steps that go back, are skipped/kept
    with a ``RuntimeWarning``; integer-valued float steps become ints. Raises ``UsageError`` for a missing
    file or one without records."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise UsageError(f"{p} not found; pass a run directory or a metrics.jsonl file written by conserve")
    out, bad, back, odd, n_odd = Records(), [], None, None, 0
    out.name = p.name
    lines = p.read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # the last line: a write cut short by a crash or kill
                out.truncated = len(line.encode())
            elif line.strip():  # damage inside the file
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


def truncated_note(records: Records) -> str | None:
    """The line that says a metrics file's torn last line was left out, or None."""
    n = getattr(records, "truncated", None)
    if n is None:
        return None
    return f"the last line of {getattr(records, 'name', 'metrics.jsonl')} is truncated ({n} bytes): ignored"


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


def _key(fams: Mapping | None, f: str) -> str | None:
    row = (fams or {}).get(f)
    return row.get("verdict_key") if isinstance(row, Mapping) else None


def plot_eps(records: list[dict], path: Path, title: str = "", fams: Mapping | None = None) -> Path:
    """eps per family vs step (log scale, left; dotted: the family's non-conserved control; the legend gives
    each family's verdict key) beside the training loss (right, when recorded). The strip under the eps
    axis ticks, per family, the steps whose drift was decomposed; the dashed line is the eps under which a
    verdict reads float rounding (``ROUNDING_EPS``); vertical lines mark eps jumps (``eps_jumps``): red at
    a loss spike, grey without one."""
    plt = _plt()
    names = families(records)
    has_loss = any(_real(r.get("loss")) for r in records)
    decomposed = {f: _series(records, f"drift/{f}/measured")[0] for f in names}
    strip = [f for f in names if decomposed[f]]
    fig = plt.figure(figsize=(13.5 if has_loss else 9.5, 5.6 + 0.12 * len(strip)))
    gs = fig.add_gridspec(2 if strip else 1, 2 if has_loss else 1, width_ratios=[3, 1.7] if has_loss else [1],
                          height_ratios=[5, 0.4 + 0.16 * len(strip)] if strip else [1], hspace=0.08)
    ax = fig.add_subplot(gs[0, 0])
    last = max((r["step"] for r in records), default=1)
    controls = False
    for i, f in enumerate(names):
        c = f"C{i % 10}"
        xs, ys = _series(records, f"eps/{f}")
        key = _key(fams, f)
        if xs:
            ax.plot(xs, [max(y, 1e-16) for y in ys], label=f + (f" ({key})" if key else ""), lw=1.5, color=c)
        cx, cy = _series(records, f"control/{f}")
        if cx:  # the non-conserved baseline: same terms, every sign + (conserve.tracking.control)
            ax.plot(cx, [max(y, 1e-16) for y in cy], ls=":", marker=".", ms=3, lw=1, color=c)
            controls = True
    ax.axhline(ROUNDING_EPS, color="0.4", ls="--", lw=1)
    ax.plot([], [], color="0.4", ls="--", lw=1, label=f"eps {ROUNDING_EPS:.0e}: below it a\nverdict reads float32 rounding")
    if controls:
        ax.plot([], [], "k:", marker=".", ms=3, lw=1, label="dotted: control (same terms,\nall signs +: not conserved)")
    jumps = eps_jumps(records)
    axs = [ax]
    if has_loss:
        bx = fig.add_subplot(gs[:, 1], sharex=ax)
        axs.append(bx)
    if strip:
        sx = fig.add_subplot(gs[1, 0], sharex=ax)
        axs.append(sx)
        for i, f in enumerate(strip):
            sx.plot(decomposed[f], [i] * len(decomposed[f]), ls="none", marker="|", ms=7, mew=1.3,
                    color=f"C{names.index(f) % 10}")
        sx.set_yticks(range(len(strip)), strip, fontsize=6.5)
        sx.set_ylim(-0.7, len(strip) - 0.3)
        sx.invert_yaxis()
        sx.set_xlabel("optimizer step k")
        sx.set_ylabel("decomposed\nsteps", fontsize=7)
        sx.grid(True, axis="x", alpha=0.3)
        ax.tick_params(labelbottom=False)
    else:
        ax.set_xlabel("optimizer step k")
    for j in jumps:
        for a in axs:
            a.axvline(j["step"], color="red" if j["loss_spike"] else "0.55", lw=1, alpha=0.7,
                      ls="-" if j["loss_spike"] else (0, (4, 3)))
    if any(j["loss_spike"] for j in jumps):
        ax.plot([], [], color="red", lw=1, alpha=0.7, label="eps jump at a loss spike")
    if any(not j["loss_spike"] for j in jumps):
        ax.plot([], [], color="0.55", lw=1, ls=(0, (4, 3)), label="eps jump (x1.5 in a step),\nno loss spike")
    ax.set_yscale("log")
    ax.set_xlim(0, last + 1)
    ax.set_ylabel(r"$\epsilon(k)$ = mean$_i$ |h$_i$(k) - h$_i$(0)| / |h$_i$(0)|")
    ax.set_title(title or "conservation-law error per family", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if names:
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                  title="family (verdict key)", title_fontsize=8)
    if has_loss:
        lx, ly = _series(records, "loss")
        bx.plot(lx, ly, "k-", lw=1)
        bx.set_xlim(0, last + 1)
        bx.set_xlabel("optimizer step k")
        bx.set_ylabel("training loss")
        bx.set_title("loss" + (" (vertical lines: eps jumps)" if jumps else ""), fontsize=10)
        bx.grid(True, alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.93, bottom=0.1, wspace=0.62 if has_loss else 0.2)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_TERM_STYLE = {  # term: (colour, marker, filled, size)
    "measured": ("k", "o", False, 7), "decay": ("C2", "s", True, 4), "first": ("C0", "^", True, 4),
    "second": ("C3", "v", True, 4), "residual": ("0.45", "x", True, 5)}


def plot_drift(records: list[dict], path: Path, fams: Mapping | None = None) -> Path | None:
    """Per family: the measured per-step change, its decay / first / second-order terms and the residual
    (measured minus the three) at each decomposed step, as markers on one step axis shared by every
    panel (log scale); the dashed line is the family's float rounding floor per step (when the run's
    totals give its magnitude); the panel title carries the verdict key. Terms that are zero at every
    decomposed step are not drawn and not in the legend."""
    plt = _plt()
    from matplotlib.ticker import NullFormatter

    names = [f for f in families(records) if any(r.get(f"drift/{f}/measured") is not None for r in records)]
    if not names:
        return None
    n = len(names)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    last = max(r["step"] for r in records)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.1 * rows + 1.3), squeeze=False, sharex=True)
    drawn, floors = set(), False
    for ax, f in zip(axes.flat, names):
        for term, (c, mk, filled, ms) in _TERM_STYLE.items():
            xs, ys = _series(records, f"drift/{f}/{term}")
            pts = [(x, y) for x, y in zip(xs, ys) if y > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="none", marker=mk, ms=ms, color=c,
                        mfc=c if filled else "none", mew=1.1, label=term)
                drawn.add(term)
        row = (fams or {}).get(f) or {}
        nd = row.get("decomposed_steps")
        if _finite(row.get("floor")) and nd:
            ax.axhline(row["floor"] / nd, color="0.3", ls="--", lw=1)
            floors = row.get("weight_dtype") or "float32"
        key = row.get("verdict_key")
        ax.set_title((f"{f}: {key}" if key else f) + (f" ({nd} decomposed steps)" if nd else ""), fontsize=9, fontweight="bold" if key in (
            "undetermined", "sgd_first_order", "step_size", "first_order", "weight_decay", "nonfinite") else None)
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(0, last + 1)
        ax.tick_params(labelsize=7, labelbottom=True)
        ax.set_xlabel("optimizer step k", fontsize=8)
        ax.set_ylabel("|per-step term| (law units)", fontsize=8)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles = [plt.Line2D([], [], ls="none", marker=mk, ms=ms, color=c, mfc=c if filled else "none", label=t)
               for t, (c, mk, filled, ms) in _TERM_STYLE.items() if t in drawn]
    if floors:
        handles.append(plt.Line2D([], [], color="0.3", ls="--", lw=1, label=f"{floors} rounding floor of the weights, per step"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("per-step change h(k+1) - h(k) of each law family (norm over its decomposed laws) and its exact "
                 "decomposition, at the decomposed steps\nresidual = measured - (decay + first + second): rounding; "
                 "a term under the residual or the floor is not resolved. Title: family: verdict key", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(records: list[dict], path: Path, fams: Mapping | None = None) -> Path | None:
    """Final eps per family (rows) and layer (columns) against the family's non-conserved control: colour =
    log10(eps / control eps) (blue: far under the control, red: as large or larger, grey: no control), text
    = the eps; the last column is the control's own final eps."""
    lk = layer_keys(records)
    if not lk or not records:
        return None
    plt = _plt()
    import numpy as np

    cols = sorted({c for v in lk.values() for c in v}, key=lambda c: (c == "global", int(c[5:]) if c[5:].isdigit() else 0))
    names = sorted(lk)
    last = {}
    for r in records:  # the latest finite value of every key
        for f in names:
            for c, key in lk[f].items():
                v = r.get(key)
                if _finite(v):
                    last[(f, c)] = v
    ctrl = {}
    for f in names:
        _, cy = _series(records, f"control/{f}")
        if cy and cy[-1] > 0:
            ctrl[f] = cy[-1]
    grid = np.full((len(names), len(cols) + 1), np.nan)
    for (f, c), v in last.items():
        if f in ctrl:
            grid[names.index(f), cols.index(c)] = math.log10(max(v, 1e-16) / ctrl[f])
    for f, v in ctrl.items():
        grid[names.index(f), len(cols)] = 0.0
    lim = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
    fig, ax = plt.subplots(figsize=(2.6 + 1.0 * (len(cols) + 1), 1.2 + 0.5 * len(names)))
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=-lim, vmax=lim)
    ax.axvline(len(cols) - 0.5, color="k", lw=1.5)
    ax.set_xticks(range(len(cols) + 1), [*cols, "control\n(family)"], rotation=30, ha="right", fontsize=8)
    ylabels = [f + (f"\n({_key(fams, f)})" if _key(fams, f) else "") for f in names]
    ax.set_yticks(range(len(names)), ylabels, fontsize=7.5)
    ax.set_xlabel("layer")
    for i, f in enumerate(names):
        for j, c in enumerate(cols):
            if (f, c) in last:
                g = grid[i, j]
                ax.text(j, i, f"{last[(f, c)]:.0e}", ha="center", va="center", fontsize=7,
                        color="w" if np.isfinite(g) and abs(g) > 0.6 * lim else "k")
        ax.text(len(cols), i, f"{ctrl[f]:.0e}" if f in ctrl else "none", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="log10(eps / control eps)\n(0: as large as a non-conserved quantity)")
    ax.set_title(f"final eps per family and layer (text) against the family's control (colour), step "
                 f"{records[-1]['step']}\ngrey with a value: no control recorded for the family; grey without: no law there",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- verdicts
ROUNDING_EPS = 1e-5  # below this eps a law holds to float32 rounding whatever its drift terms
FIRST_ORDER_MARGIN = 10.0  # under plain SGD a first-order term this many times its rounding floor is a finding

#: verdict keys and what each says, shortest first (plot titles show the key)
VERDICT_KEYS = {
    "nonfinite": "the law values went NaN/Inf",
    "broken_by": "the optimizer's configuration breaks the law (param_groups, decay on part of a law...)",
    "no_data": "no finite eps recorded",
    "h0_zero": "h_0 ~ 0: relative eps not meaningful",
    "holds_rounding": "eps under the float rounding threshold",
    "not_decomposed": "no drift step decomposed this family",
    "undetermined": "the drift terms are at or under the rounding floor (residual or float estimate)",
    "sgd_first_order": "first-order drift under plain SGD, where theory gives zero (a bug report)",
    "weight_decay": "weight decay dominates the drift",
    "first_order": "the optimizer's first-order term dominates (Adam, sign methods)",
    "momentum": "first order dominates under heavy-ball momentum (carried second-order drift)",
    "step_size": "second-order drift as large as a non-conserved control's motion",
    "holds": "the drift is the second-order (discretisation) term",
}


def optimizer_theory(config: Mapping | None) -> str | None:
    """What the drift identity predicts for the first-order term of the run in ``config`` (``config.json``
    of ``conserve run``: ``optimizer``, ``momentum``, ``weight_decay``): ``"plain_sgd"`` (GD/SGD without
    momentum or weight decay: zero, Noether), ``"momentum"`` (heavy-ball: non-zero, carried second-order
    terms), ``"adaptive"`` (Adam/AdamW and others: non-zero, no closed form), ``"sgd_decay"`` (SGD with
    weight decay: the decay term), or None when the config does not say."""
    if not config:
        return None
    name = str(config.get("optimizer") or "").lower()
    mom = config.get("momentum") or 0.0
    wd = config.get("weight_decay") or 0.0
    if not name:
        return None
    if name in ("gd", "sgd") and _real(mom) and _real(wd):
        return "plain_sgd" if mom == 0 and wd == 0 else ("momentum" if mom else "sgd_decay")
    if name == "momentum" or (name in ("gd", "sgd") and mom):
        return "momentum"
    return "adaptive"


def law_dtype(config: Mapping | None) -> str | None:
    """The dtype the run accumulated its law values in when ``config`` says it (``fp64_laws`` or
    ``law_dtype``), else None (the tracker's default is float32)."""
    config = config or {}
    if isinstance(config.get("law_dtype"), str):
        return config["law_dtype"]
    return {True: "float64", False: "float32"}.get(config.get("fp64_laws"))


def weight_dtype(config: Mapping | None) -> str:
    """The dtype the run's weights are stored in: ``config["dtype"]`` (or ``param_dtype``) when given, else
    float32 (``conserve run`` trains in float32)."""
    config = config or {}
    for k in ("param_dtype", "dtype"):
        if isinstance(config.get(k), str):
            return config[k]
    return "float32"


def _e(v) -> str:
    return "0" if v == 0 else f"{v:.1e}"


def _evidence(stats: dict) -> str:
    """The numbers a decomposed verdict rests on: decomposed steps and the per-step term norms summed."""
    n = stats.get("decomposed_steps")
    pairs = stats.get("decomposed_pairs")
    where = (f"{n} decomposed step{'s' if n != 1 else ''}" if n is not None else "the decomposed steps") + \
        (f" ({pairs:g} (law, step) pairs)" if _real(pairs) else "")
    terms = ", ".join(f"{t} {_e(stats[f'sum_{t}'])}" for t in ("measured", "decay", "first", "second", "residual")
                      if stats.get(f"sum_{t}") is not None)
    floor = stats.get("floor")
    wd = stats.get("weight_dtype") or "float32"
    tot, gd, pred = (stats.get(k) for k in ("total_drift_measured_sampled", "predicted_gd", "total_drift_predicted"))
    whole = ""
    if _finite(tot) and tot > 0 and _finite(pred):
        whole = (f"; totals over the decomposed (law, step) pairs: measured {_e(tot)}, decay + first + second "
                 f"{_e(pred)}" + (f", decay + second {_e(gd)} ({abs(gd - tot) / tot:.1%} from measured)"
                                  if _finite(gd) else ""))
    return (f"{where}, per-step norms summed: {terms}"
            + (f"; {wd} rounding floor of the weights ~{_e(floor)}" if floor else "") + whole)


def verdict(stats: dict, broken_by: list[str] | None = None) -> tuple[str, str]:
    """A verdict for one family: ``(key, sentence)``; the sentence carries the numbers it rests on.

    ``stats``: ``eps_final``; the per-step term norms summed over the decomposed steps (``sum_measured``,
    ``sum_decay``, ``sum_first``, ``sum_second``, ``sum_residual``; None when the drift was not decomposed)
    and ``decomposed_steps``; optionally ``floor`` (the rounding floor of those sums set by the weights'
    dtype ``weight_dtype``, ``conserve.analysis.floor``), ``law_dtype``, ``theory`` (``optimizer_theory``), ``guarded`` (fraction
    of instances with ``h_0 ~ 0``), ``total_drift_measured``, ``balance`` and ``control_final`` (eps of the
    family's all-signs-+ control). ``nonfinite_from`` (first step whose eps is NaN/Inf/null, with
    ``nonfinite_steps`` and ``eps_last_finite``) makes the verdict ``nonfinite`` whatever the rest says.

    A term is read only above the floor: the larger of the summed residual (the rounding of the law
    values: the identity's own check in this run) and ``floor`` (the rounding of the stored weights, which
    moves the laws by about that much at every step, whatever the law dtype); when no term clears it the
    verdict is ``undetermined``, with the advice that lowers the larger one (``--fp64-laws`` for the
    residual, a float64 model for the weights). Under plain SGD
    (``theory == "plain_sgd"``) the first-order term is zero by theory: one above ``FIRST_ORDER_MARGIN``
    times the floor is reported as a bug (``sgd_first_order``), never as the optimizer breaking the law.
    Keys: ``VERDICT_KEYS``."""
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
        return "holds_rounding", (f"holds to float rounding: eps {eps:.1e} < {ROUNDING_EPS:.0e} (eps: mean over the "
                                  "family's laws of |h_k - h_0| / |h_0|)")
    sm, sd, sf, ss = (stats.get(k) for k in ("sum_measured", "sum_decay", "sum_first", "sum_second"))
    if sm is None or sd is None or sf is None or ss is None:
        ctrl = stats.get("control_final")
        return "not_decomposed", (f"eps {eps:.2e}" + (f" ({eps / ctrl:.2g}x its non-conserved control's {ctrl:.2e})"
                                                      if ctrl else "")
                                  + "; drift not decomposed in this run (drift off, or no drift step "
                                  "reached this family's laws: more steps, or drift_every=1 / "
                                  "--drift-every 1 --snapshot-budget none)")
    total = sd + sf + ss
    if total <= 0 and not sm:
        return "holds_rounding", f"holds (no drift term recorded; eps {eps:.1e})"
    ev = _evidence(stats)
    theory = stats.get("theory")
    resid = stats.get("sum_residual") or 0.0
    est = stats.get("floor") or 0.0
    floor = max(resid, est)
    # float64 laws: said by the config, or seen in a residual far under the float32 rounding of the values
    fp64 = stats.get("law_dtype") == "float64" or (0 < resid < 1e-6 * est)
    wd = stats.get("weight_dtype") or "float32"
    what = "residual" if resid >= est else f"{wd} rounding of the weights"
    if resid >= est:
        undetermined = ("undetermined at this precision (residual >= terms): " +
                        ("rerun with --fp64-laws" if not fp64 else
                         "float64 laws already: decompose more steps (--drift-every 1 --snapshot-budget none)"))
    else:
        undetermined = (f"undetermined at this precision ({wd} rounding of the weights >= terms): the drift is at "
                        f"the rounding of the stored weights, which --fp64-laws does not lower (a float64 model does)")
    if max(sd, sf, ss) <= floor:
        return "undetermined", (f"{undetermined}; the {what} {_e(floor)} is not smaller than any term, so the "
                                f"drift cannot be attributed (eps {eps:.2e}; {ev})")
    sgd = theory == "plain_sgd"
    if sgd and sf > FIRST_ORDER_MARGIN * floor:
        return "sgd_first_order", (f"first-order drift under plain SGD, where theory gives zero: a bug report, not a "
                                   f"verdict (first order {_e(sf)} is {sf / floor if floor else math.inf:.0f}x the "
                                   f"rounding floor {_e(floor)}: check the gradients, hooks and the optimizer; eps "
                                   f"{eps:.2e}; {ev})")
    if sgd:
        sf_read = 0.0 if sf <= FIRST_ORDER_MARGIN * floor else sf
        total = sd + ss
        if total <= floor:
            return "undetermined", (f"{undetermined}; under plain SGD "
                                    f"(first order zero by theory) the decay and second-order terms do not clear "
                                    f"the floor {_e(floor)} (eps {eps:.2e}; {ev})")
        sgd_note = (f"first order {_e(sf)} " + ("under" if sf <= floor else f"under {FIRST_ORDER_MARGIN:g}x") +
                    f" the {what} {_e(floor)}: zero, as plain SGD's theory says")
        sf = sf_read
    d, f1 = sd / total, sf / total
    share = "of decay + first + second (per-step norms summed)"
    if d >= max(f1, ss / total):
        return "weight_decay", f"broken by weight decay: decay is {d:.0%} {share} ({ev})"
    if f1 >= 0.5:
        beta = stats.get("momentum")
        if theory == "momentum" and _real(beta) and 0 < beta < 1 and ss > 0:
            pred = 2 * beta / (1 - beta)  # steady state of p_k = beta (p_{k-1} + q_{k-1}): first = 2p = pred * second
            said = (f"first order / second order = {sf / ss:.1f}, heavy-ball momentum (beta {beta:g}) carrying "
                    f"earlier second-order drift gives 2 beta / (1 - beta) = {pred:.1f} in steady state (spec: "
                    "p_k = beta (p_{k-1} + q_{k-1}))")
            if sf / ss <= 2 * pred:
                return "momentum", (f"first order is {f1:.0%} {share}, as momentum predicts: {said}; the drift is "
                                    f"carried discretisation, not a broken symmetry: a smaller lr conserves it "
                                    f"better ({ev})")
            return "first_order", f"broken by the optimizer: first order is {f1:.0%} {share}, more than {said} ({ev})"
        return "first_order", f"broken by the optimizer: first order is {f1:.0%} {share} ({ev})"
    within = abs(sm - ss) / sm if sm > 0 else 0.0
    tol = f"{within:.0e}" if within < 0.01 else f"{within:.0%}"
    what = (f"its drift is the second-order (discretisation) term, to {tol} of the measured per-step change "
            "(|sum measured - sum second| / sum measured)")
    ctrl = stats.get("control_final")
    tail = f"; {sgd_note}" if sgd else ""
    tail += f" ({ev})"
    if ctrl:  # read the law against its non-conserved control (conserve.tracking.control)
        ratio = eps / ctrl
        if ratio >= 1:
            return "step_size", (f"not conserved at this step size: eps {eps:.2e} is {ratio:.1f}x its non-conserved "
                                 f"control's {ctrl:.2e} (the same quadratic with every sign +): the law moved as "
                                 f"much as a quantity with no conservation law; {what}, which gradient flow does not "
                                 f"have: a smaller lr conserves it better{tail}")
        if ratio > 0.5:
            return "step_size", (f"barely conserved at this step size: eps {eps:.2e} is {ratio:.0%} of its "
                                 f"non-conserved control's {ctrl:.2e}; {what}; its second-order drift (O(lr^2) per "
                                 f"step) is near a non-conserved quantity's motion: a smaller lr conserves it "
                                 f"better{tail}")
    text = f"holds: {what}"
    if ctrl:
        text += f"; eps {eps:.2e} = {eps / ctrl:.0e} x its non-conserved control's {ctrl:.2e}"
    bal = stats.get("balance")
    if eps > 0.05 and bal is not None and bal < 0.1:
        text += f"; eps is large because h_0 is small (|h_0| = {bal:.0e} of its magnitude)"
    return "holds", text + tail


def _magnitude(t: Mapping) -> float | None:
    """A family's law magnitude (the norm of its laws with every sign +) estimated from ``Tracker.totals``:
    ``scale`` (||h_0||) over ``balance`` (mean |h_0| / magnitude)."""
    scale, bal = t.get("scale"), t.get("balance")
    if _finite(scale) and _finite(bal) and bal > 0:
        return scale / bal
    return None


def summarize(records: list[dict], totals: dict | None = None, broken_by: dict[str, list[str]] | None = None,
              config: Mapping | None = None) -> dict:
    """Per family: final and max eps, max per-step measured drift, the per-step term norms summed over
    the decomposed steps (and how many), the float rounding floor of those sums (from the magnitude in
    ``Tracker.totals`` and the law dtype in ``config``; ``conserve.analysis.floor``), the verdict, and
    (from ``Tracker.totals``) the measured total drift vs the identity's prediction. ``config``
    (``config.json``) says the optimizer, which decides what theory predicts for the first-order term.
    Totals of a tracker that kept no per-entry cumulative sums (``cumulative`` False: sampled drift) give
    ``total_drift_measured`` (||h_K - h_0||), ``guarded`` and ``balance`` and ``total_decomposition:
    False``; the prediction columns are None then (not estimated)."""
    from .analysis.floor import rounding_floor

    theory, dtype, wdtype = optimizer_theory(config), law_dtype(config), weight_dtype(config)
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
        for term in ("measured", "decay", "first", "second", "residual"):
            _, ys = _series(records, f"drift/{f}/{term}")
            row[f"sum_{term}"] = math.fsum(ys) if ys else None
        m_steps, m = _series(records, f"drift/{f}/measured")
        row["max_step_drift"] = max(m) if m else None
        row["decomposed_steps"] = len(m_steps)
        row.update(theory=theory, law_dtype=dtype, weight_dtype=wdtype, floor=None)
        if theory == "momentum":
            row["momentum"] = (config or {}).get("momentum")
        if totals and f in totals:
            t = totals[f]
            kept = decomposition_kept(t)
            row.update({"total_drift_measured": t.get("measured"), "total_drift_predicted": t.get("predicted"),
                        "total_second_order": t.get("second"), "total_first_order": t.get("first"),
                        "total_decay": t.get("decay"), "predicted_gd": t.get("predicted_no_first"),
                        "guarded": t.get("guarded"), "balance": t.get("balance"),
                        # the change over the decomposed (law, step) pairs: what decay+1st+2nd predicts
                        # (totals without a measured_sampled key: the measured total, if they kept the
                        # decomposition)
                        "total_drift_measured_sampled": t.get("measured_sampled", t.get("measured") if kept else None),
                        "total_decomposition": kept})
            if _real(t.get("sampled_pairs")):
                row["decomposed_pairs"] = t["sampled_pairs"]
            mag = _magnitude(t)
            if mag is not None and m_steps:  # per decomposed step h(k+1) - h(k) of weights stored in wdtype
                row["floor"] = len(m_steps) * rounding_floor(mag, 1, wdtype, values=2)
        reasons = (broken_by or {}).get(f)
        if not reasons:  # a run without a summary.json (a framework callback, a user's loop): the rows' count
            n = next((r[f"broken/{f}"] for r in reversed(records) if _finite(r.get(f"broken/{f}"))), 0)
            reasons = [f"{n:g} law(s) broken by the optimizer's param_groups (broken/{f}; the run's "
                       "BrokenLawWarning names them)"] if n > 0 else None
        row["verdict_key"], row["verdict"] = verdict(row, reasons)
        out[f] = row
    return out


STOP_REASONS = ("killed", "interrupted", "diverged", "failed")


def run_status(records: list[dict], config: Mapping | None, cause: str | None = None) -> dict | None:
    """Whether the run behind ``records`` stopped before its planned steps: ``{"step", "planned", "reason",
    "line"}`` or None (finished, or nothing says otherwise).

    ``planned``: ``config["steps"]``; ``cause``: the stop the run itself recorded (summary.json ``stopped``:
    divergence, Ctrl-C...). ``reason``: ``config["status"]`` when it names a stop (``interrupted``,
    ``diverged``, ``failed``...); else ``diverged`` when the cause says so or the last row's loss or eps is
    non-finite, ``interrupted`` when the cause says so, else ``killed`` (the metrics end early and the run
    recorded no stop: ``kill -9``, a crash, a lost machine, or a run still going)."""
    if not records:
        return None
    config = config or {}
    last = records[-1]["step"]
    planned = config.get("steps") if _real(config.get("steps")) and not isinstance(config.get("steps"), bool) else None
    status = config.get("status") if isinstance(config.get("status"), str) else None
    early = planned is not None and last < planned
    if not (early or cause or status in ("interrupted", "diverged", "failed")):
        return None
    tail = records[-1]
    nonfinite = any(k == "loss" or k.startswith("eps/") for k, v in tail.items() if v is None) or \
        any(isinstance(v, float) and not math.isfinite(v) for k, v in tail.items() if k == "loss" or k.startswith("eps/"))
    low = (cause or "").lower()
    if status and status not in ("running", "finished", "completed", "done"):
        reason = status
    elif "diverg" in low or "non-finite" in low or nonfinite:
        reason = "diverged"
    elif "interrupt" in low:
        reason = "interrupted"
    elif cause:
        reason = "stopped"
    elif status == "finished":
        reason = "config.json says finished: rows are missing"
    else:
        reason = "killed"
    line = f"stopped at step {last}" + (f" of {planned:g}" if planned is not None else "") + f" ({reason})"
    if reason == "killed":
        line += (": the metrics end early and the run recorded no stop (kill -9, a crash or a lost machine; or "
                 "the run is still going)")
    if cause:
        line += f": {cause}"
    return {"step": last, "planned": planned, "reason": reason, "line": line, "cause": cause}


NOT_KEPT = ("total decomposition not kept (sampled drift): pass cumulative=True (conserve run: --cumulative) to keep "
            "the per-entry sums that the total and prediction columns need")


def decomposition_kept(totals_of_family: Mapping) -> bool:
    """Whether ``Tracker.totals()`` of one family holds the per-entry decomposition (``decay``, ``first``,
    ``second``, ``predicted``...): False for a tracker built without ``cumulative`` (its ``cumulative`` key
    is False); totals without the key hold it."""
    return bool(totals_of_family.get("cumulative", True))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _fmt(v):
    return "-" if v is None else f"{v:.3e}"


def _verdict_cell(r: dict) -> str:
    return "non-finite" if r.get("nonfinite_from") is not None and r["eps_final"] is None else _fmt(r["eps_final"])


REPORT_FILES = ("summary.md", "summary.json", "eps.png", "drift.png", "layers.png")


def write_summary(run_dir: Path, records: list[dict], config: dict, totals: dict | None = None,
                  extra: dict | None = None, broken_by: dict[str, list[str]] | None = None) -> dict:
    """Write ``summary.json`` and ``summary.md`` into ``run_dir``; return the summary dict.

    ``totals``: ``Tracker.totals()`` (kept in summary.json so ``conserve report`` can rebuild the same
    summary); ``extra``: e.g. ``declined``, ``seconds``, ``stopped`` (the stop the run recorded),
    ``notes`` (lines to show); ``broken_by``: reasons per family. A run whose metrics end before
    ``config["steps"]`` (or that recorded a stop) gets ``stopped`` = "stopped at step k of N (reason)..."
    (``run_status``) and ``stop`` = its parts; a torn last metrics line (``Records.truncated``) a note."""
    extra = dict(extra or {})
    fams = summarize(records, totals, broken_by, config)
    grads = gradient_check(records, config)
    if grads:
        extra["gradient_check"] = grads
    stop = run_status(records, config, extra.pop("stopped", None) or None)
    notes = [n for n in [*(extra.pop("notes", None) or []), truncated_note(records)] if n]
    summary = {"config": config, "steps": records[-1]["step"] if records else 0,
               "final_loss": next((r["loss"] for r in reversed(records) if isinstance(r.get("loss"), (int, float))), None),
               "families": fams, **({"totals": totals} if totals else {}), **extra,
               **({"stopped": stop["line"], "stop": stop} if stop else {}), **({"notes": notes} if notes else {})}
    Path(run_dir, "summary.json").write_text(json.dumps(json_safe(summary), indent=2))
    lm = config.get("command") == "conserve run"
    planned = stop["planned"] if stop else None
    lines = [f"# {config.get('command', 'conserve')}: {summary['steps']}"
             + (f" of {planned:g}" if planned is not None else "") + " steps"
             + (f", optimizer {config['optimizer']}" if config.get("optimizer") else ""), ""]
    if stop:
        lines += [f"**Stopped early:** {stop['line']}. The verdicts below cover steps 1..{stop['step']} only.", ""]
    lines += [f"**Note:** {n}." for n in notes] + ([""] if notes else [])
    theory = optimizer_theory(config)
    lines += [f"data: {config.get('data_source', '?')}; final loss {_fmt(summary['final_loss'])}"
              + (" nats/token" if lm else ""), "",
              "## Verdicts", "",
              {"plain_sgd": "Plain SGD (no momentum, no weight decay): the first-order term is zero by theory.",
               "momentum": "Heavy-ball momentum: the first-order term carries earlier second-order drift.",
               "adaptive": f"{config.get('optimizer')}: the first-order term is non-zero by theory (O(lr) per step).",
               "sgd_decay": "SGD with weight decay: the decay term is the theory's drift, first order zero.",
               None: "The optimizer is not recorded (no config.json): first-order terms are read without a theory."}
              [theory], "",
              "| family | verdict | eps final | control eps final | decomposed steps |", "|---|---|---|---|---|"]
    for f, r in fams.items():
        lines.append(f"| {f} | {r['verdict']} | {_verdict_cell(r)} | {_fmt(r.get('control_final'))} | "
                     f"{r.get('decomposed_steps', 0)} |")
    lines += ["", "## Drift", "",
              "| family | eps max | max step drift | sum of per-step decay | first | second | residual | rounding floor "
              "| total drift measured | predicted (decay+1st+2nd) | GD prediction (decay+2nd) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f, r in fams.items():
        lines.append(f"| {f} | {_fmt(r['eps_max'])} | {_fmt(r['max_step_drift'])} | {_fmt(r['sum_decay'])} | "
                     f"{_fmt(r['sum_first'])} | {_fmt(r['sum_second'])} | {_fmt(r.get('sum_residual'))} | {_fmt(r.get('floor'))} | "
                     f"{_fmt(r.get('total_drift_measured_sampled'))} | "
                     f"{_fmt(r.get('total_drift_predicted'))} | {_fmt(r.get('predicted_gd'))} |")
    if any(r.get("total_decomposition") is False for r in fams.values()):
        lines += ["", NOT_KEPT + "."]
    jumps = eps_jumps(records)
    if jumps:
        lines += ["", "eps jumps (x1.5 in one step): " + "; ".join(
            f"step {j['step']} ({', '.join(j['families'])}; "
            + (f"at a loss spike: loss {j['loss']:.3g} vs {j['loss_before']:.3g} before)" if j["loss_spike"]
               else "no loss spike)") for j in jumps) + "."]
    lines += ["", "How to read it. eps is the error of Tran et al. 2026: the mean over a family's laws of",
              "|h(k) - h(0)| / |h(0)|. Each step's change splits exactly into decay (weight decay), first order",
              "(the optimizer's update direction; zero for plain GD/SGD by Noether's theorem) and second order",
              "(the discretisation, O(lr^2) per step; README 'Use it in a training loop'); the residual",
              "(measured - decay - first - second) is zero in exact arithmetic, so it measures this run's rounding.",
              "Every verdict names the decomposed steps it rests on and the per-step norms of the terms summed over",
              "them. A term counts only above the floor: the larger of the summed residual (the rounding of the",
              "law values) and the rounding floor of the stored weights (conserve.analysis.floor: unit roundoff of",
              "the weights' dtype x the family's magnitude, its laws with every sign +, per decomposed step: storing",
              "theta_k+1 moves the laws by about that much). When no term clears it the verdict is 'undetermined at",
              "this precision': --fp64-laws lowers the residual, only a float64 model lowers the weights' floor.",
              "Under plain SGD a first-order term above 10x the floor is a bug"
              "report (theory gives zero), not a verdict. The control of a family is the same quadratic with every",
              "sign + (e.g. |W_up[u,:]|^2 + |W_down[:,u]|^2): it is not conserved, so a law whose eps reaches its",
              "control's is not conserved at that step size whatever the flow does. A law 'holds' when its drift",
              "is the discretisation alone ('within X' is |sum measured - sum second| / sum measured); 'broken by",
              "the optimizer' when the first-order term is most of decay + first + second (Adam, sign methods);",
              "'broken by weight decay' when decay is. A family whose h_0 is ~0 (e.g. vo at a balanced init) has a",
              "large relative eps even when its absolute drift is tiny: read its drift columns instead.",
              "Drift columns: Euclidean norms over the family's entries (Frobenius for Gram laws); totals are norms",
              "of the summed measured changes and terms over the decomposed (law, step) pairs (equal by the identity;",
              "by default each drift step decomposes one group of laws, see conserve.track's snapshot_budget; the",
              "per-entry sums they need are kept in exact mode or with cumulative=True / --cumulative). The 'total'",
              "and 'prediction' columns and the float floor need the live tracker's totals (conserve run); from a",
              "metrics file alone they are '-' and the floor is the residual.", "",
              "Plots: `eps.png` (eps and its control beside the loss; decomposed steps ticked; eps jumps at loss",
              "spikes marked), `drift.png` (per-step terms, residual and rounding floor; verdict key per panel),",
              "`layers.png` (final eps per family and layer against the family's control)."]
    if grads:
        lines += ["", "## Gradient check", "",
                  "Per family, over the checked steps: the worst ratio |<grad h, g>| / (|grad h| |g|) of any law entry "
                  "(zero for a gradient of the model's output, up to rounding) against the floor of the gradient's "
                  "dtype (README 'Check that a gradient is a gradient'; the run's warning names any flagged law).", "",
                  "| family | checked steps | worst ratio | floor | reading |", "|---|---|---|---|---|"]
        for f, g in grads.items():
            if not g["checked_steps"]:
                reading = "not checked"
            elif g["steps_above"]:
                reading = (f"above the floor at {g['steps_above']} of {g['checked_steps']} checked steps: not a gradient "
                           "of the output for some law (a bug, or a method that changes the gradient on purpose)")
            else:
                reading = f"at rounding level ({g['worst'] / g['floor']:.2g}x the {g['dtype']} floor)"
            lines.append(f"| {f} | {g['checked_steps']} | {_fmt(g['worst'])} | {_fmt(g['floor'])} | {reading} |")
    if extra.get("declined"):
        lines += ["", "## Blocks without a law", ""] + [f"- `{d['module']}` ({d['block']}): {d['reason']}"
                                                         for d in extra["declined"]]
    Path(run_dir, "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def _linear_families() -> set[str]:
    """Families of the linear laws (router sums, translation), whose gradient-check floor is the linear one."""
    out, todo = set(), [Law]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.linear and getattr(cls, "family", None):
            out.add(cls.family)
    return out


def gradient_check(records: list[dict], config: Mapping | None) -> dict:
    """Per family with ``grad_check/<family>`` columns (``Tracker(check_gradients=True)``): the checked steps,
    the worst per-entry ratio over them, the floor of the gradient's dtype (``config["grad_dtype"]``, else
    the weights' dtype; ``conserve.analysis.gradcheck.floor``, the linear one for router and translation
    laws) and the steps above it.  ``{}`` without such columns."""
    from .analysis.gradcheck import floor

    dtype = (config or {}).get("grad_dtype") or weight_dtype(config)
    linear = _linear_families()
    out = {}
    for key in sorted({k for r in records for k in r if k.startswith("grad_check/") and k.count("/") == 1}):
        vals = [r[key] for r in records if _finite(r.get(key))]
        fam = key.split("/", 1)[1]
        fl = floor(dtype, fam in linear)
        out[fam] = {"checked_steps": len(vals), "worst": max(vals) if vals else None, "floor": fl, "dtype": dtype,
                    "steps_above": sum(v > fl for v in vals)}
    return out


def eps_jumps(records: list[dict], window: int = 10) -> list[dict]:
    """Steps where some family's eps jumps: ``[{"step", "families", "loss_spike", "loss", "loss_before"}]``.

    An eps jump: after the family's first ``window`` records, eps above ``ROUNDING_EPS`` grows by more than
    1.5x from the previous record and by more than 5x the family's median step-to-step log change. A loss
    spike: the loss exceeds the median of the ``window`` losses before it by more than 10% of that median
    and 5 median absolute deviations. ``loss_spike`` is True when one lies within 2 steps of the jump
    (``loss`` / ``loss_before``: the spike's loss and that median; None otherwise)."""
    lx, ly = _series(records, "loss")
    spikes = []
    for i in range(window, len(ly)):
        prev = sorted(ly[i - window:i])
        med = prev[window // 2]
        mad = sorted(abs(v - med) for v in prev)[window // 2]
        if ly[i] - med > max(0.1 * abs(med), 5 * mad):
            spikes.append((lx[i], ly[i], med))
    jumps: dict[int, list[str]] = {}
    for f in families(records):
        xs, ys = _series(records, f"eps/{f}")
        logs = [math.log(b / a) for a, b in zip(ys, ys[1:]) if a > 0 and b > 0]
        typical = sorted(abs(v) for v in logs)[len(logs) // 2] if logs else 0.0
        for i in range(max(window, 1), len(ys)):
            a, b = ys[i - 1], ys[i]
            if a > 0 and b > ROUNDING_EPS and b / a > 1.5 and math.log(b / a) > 5 * typical:
                jumps.setdefault(xs[i], []).append(f)
    out = []
    for step in sorted(jumps):
        near = [sp for sp in spikes if abs(sp[0] - step) <= 2]
        out.append({"step": step, "families": sorted(jumps[step]), "loss_spike": bool(near),
                    "loss": near[0][1] if near else None, "loss_before": near[0][2] if near else None})
    return out


def plot_all(records: list[dict], out: Path, title: str = "", summary: Mapping | None = None) -> list[Path]:
    """Every plot of a run that its records allow: eps.png, drift.png, layers.png. ``summary`` (the dict
    ``write_summary`` returns) gives the verdicts, controls and rounding floors the plots draw; without it
    the ``summary.json`` in ``out`` is read when present, else the records are summarised alone."""
    fams = (summary or {}).get("families")
    if not isinstance(fams, dict):
        fams = _json_object(Path(out) / "summary.json").get("families")
    if not isinstance(fams, dict):
        fams = summarize(records)
    made = [plot_eps(records, out / "eps.png", title, fams), plot_drift(records, out / "drift.png", fams),
            plot_layers(records, out / "layers.png", fams)]
    return [p for p in made if p is not None]


def report(path: str | Path, out: str | Path | None = None, overwrite: bool = False) -> dict:
    """Build ``summary.md``, ``summary.json`` and every plot from a ``metrics.jsonl`` (a run directory or
    the file itself, e.g. from your own training loop with ``conserve.JSONLSink``).

    ``config.json`` and the totals of an earlier ``summary.json`` beside the metrics are used when
    present. Output goes to ``out``, by default the ``report/`` folder beside the metrics file (the run's
    own summary and plots are left as they are; a later report replaces that folder's files);
    ``overwrite=True`` (without ``out``) writes beside the metrics file, replacing the run's summary and
    plots. An ``out`` that is the metrics file's own directory and holds them is refused without
    ``overwrite``. Returns the summary dict (``summary["report_dir"]``: where it went). Raises
    ``UsageError`` for a missing file, a file without conserve records, or an unwritable ``out``."""
    src = Path(path)
    metrics = src / "metrics.jsonl" if src.is_dir() else src
    records = read_metrics(metrics)
    if not records:
        raise UsageError(f"{metrics} has no records with a 'step'; pass a metrics.jsonl written by conserve "
                         "(conserve run, or conserve.JSONLSink in your loop)")
    if not families(records):
        raise UsageError(f"{metrics} has no eps/<family> metrics; pass a metrics.jsonl written by conserve")
    here = metrics.parent
    dest = Path(out) if out is not None else (here if overwrite else here / "report")
    if not overwrite and dest.resolve() == here.resolve():
        held = [n for n in REPORT_FILES if (dest / n).exists()]
        if held:
            raise UsageError(f"{dest} holds the run's own {', '.join(held)}; pass --overwrite to replace them, or "
                             f"leave out --out to write into {here / 'report'}")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create {dest}: {e.strerror}; pass --out to a writable directory") from None
    config = _json_object(here / "config.json") or {"command": "conserve report", "data_source": str(metrics)}
    old = _json_object(here / "summary.json")
    extra = {k: old[k] for k in ("declined", "seconds", "broken_by") if k in old}
    stop = old.get("stop")
    cause = stop.get("cause") if isinstance(stop, dict) else old.get("stopped")
    if isinstance(cause, str) and cause:
        extra["stopped"] = cause
    totals, broken = old.get("totals"), old.get("broken_by")
    try:
        summary = write_summary(dest, records, config, totals if isinstance(totals, dict) else None, extra,
                                broken if isinstance(broken, dict) else None)
        plot_all(records, dest, f"{config.get('optimizer', '')} {metrics.parent.name}".strip(), summary)
    except OSError as e:
        raise UsageError(f"cannot write the report into {dest}: {e.strerror}; pass --out to a writable directory") from None
    summary["report_dir"] = str(dest)
    return summary
