"""``conserve continuity PATH``: adjacent-layer geometric continuity of a local checkpoint, per projection type.

PATH is a Hugging Face model directory (``config.json`` + ``*.safetensors``, possibly sharded with
``model.safetensors.index.json``) or a single ``.safetensors`` file. Weights are read lazily, two matrices of
a type at a time. Writes ``continuity.md``, ``continuity.json`` and ``continuity.png`` to ``--out`` and prints
the table. Metrics and their definitions: ``conserve.continuity`` (Jeong, Paeng, Suh 2026; spec laws.md,
"Geometric continuity"). The paper's pattern for Llama-style models: q, k, gate, up continuous in v1 (input
space), o and down in u1 (output space), v low.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..report import json_safe
from ..continuity import continuity_report, group_projections, random_baseline, random_quantile
from ..checkpoint import describe_nonfinite, nonfinite
from ..errors import NonFiniteError, UsageError

PAPER = {"q_proj": "v1", "k_proj": "v1", "gate_proj": "v1", "up_proj": "v1", "o_proj": "u1", "down_proj": "u1",
         "v_proj": "low"}
LOW_Q = 0.99  # 'continuous' = mean |cos| above the 99% quantile of the same mean for random unit vectors


def add_arguments(p) -> None:
    p.add_argument("path", help="HF model directory (config.json + *.safetensors) or one .safetensors file")
    p.add_argument("--out", help="output directory (default: runs/continuity/<checkpoint name>)")
    p.add_argument("--method", choices=("auto", "svd", "block"), default="auto",
                   help="leading singular vectors: exact SVD, block power iteration, or auto (SVD up to 1024 dims)")
    p.add_argument("--no-alignment", action="store_true",
                   help="skip the sigma^2-weighted alignments (two Gram products per pair: the slow part)")
    p.add_argument("--types", help="comma list of projection types to keep (e.g. self_attn.q_proj,mlp.down_proj)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (computation in float32)")


def safetensors_index(path: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """``name -> (file, shape, dtype)`` of every tensor of a checkpoint (headers only, no data read).

    Raises ``UsageError`` for a missing path, a directory without safetensors, a broken index or header."""
    from safetensors import safe_open

    if not path.exists():
        raise UsageError(f"checkpoint not found: {path}; pass a HF model directory or a .safetensors file")
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, OSError) as e:
                raise UsageError(f"{index} is not a valid safetensors index ({e}); re-download it") from e
            files = sorted({path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UsageError(f"shard(s) listed in {index.name} are missing: {', '.join(missing[:3])}; download them")
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                other = sorted(p.name for p in path.glob("*.bin"))[:2] + sorted(p.name for p in path.glob("*.pt"))[:2]
                hint = (f" (found {', '.join(other)}: convert to safetensors, e.g. "
                        "`model.save_pretrained(dir, safe_serialization=True)`)") if other else ""
                raise UsageError(f"no *.safetensors in {path}{hint}; pass a directory with safetensors weights")
    elif path.suffix == ".safetensors":
        files = [path]
    else:
        raise UsageError(f"{path} is neither a directory nor a .safetensors file; pass one of those")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    out[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # noqa: BLE001 -- safetensors raises several types for a bad header
            raise UsageError(f"cannot read safetensors file {f} ({e}); the file is corrupt or incomplete") from e
    return out


def _loader(index):
    from safetensors import safe_open

    handles: dict[Path, object] = {}

    def load(name: str) -> torch.Tensor:
        f = index[name][0]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        t = handles[f].get_tensor(name)
        bad = nonfinite({name: t})
        if bad:  # an SVD of it would fail with a traceback or return NaN; name the tensor instead
            raise NonFiniteError(f"{describe_nonfinite(bad, {name: tuple(t.shape)})} in {f.name}: the continuity "
                                 "metrics of a NaN/Inf weight are undefined; the training diverged or the file is "
                                 "corrupt, use an earlier checkpoint or leave this type out with --types")
        return t

    return load


def observed(v1: float, u1: float, d_in: int, d_out: int, n_pairs: int = 1) -> str:
    """'v1', 'u1' or 'low': the space whose mean |cos| over ``n_pairs`` adjacent pairs exceeds the ``LOW_Q``
    quantile of that mean for independent random unit vectors (``random_quantile(d, n_pairs)``, ``d_in`` for
    v1, ``d_out`` for u1) by the larger factor; 'low' when neither does; '-' when neither was measured."""
    cands = [(x / random_quantile(d, n_pairs, LOW_Q), s) for x, d, s in ((v1, d_in, "v1"), (u1, d_out, "u1"))
             if x == x and d >= 2]
    if not cands:
        return "-"
    r, s = max(cands)
    return s if r > 1 else "low"


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def table_rows(reports) -> list[dict]:
    rows = []
    for rep in reports:
        m, n = rep.shape
        row = {"type": rep.type, "shape": [m, n], "pairs": len(rep.pairs),
               **{k: rep.mean(k) for k in rep.values},
               "baseline_v1": random_baseline(n), "baseline_u1": random_baseline(m)}
        row["observed"] = observed(row["v1"], row["u1"], n, m, max(1, len(rep.pairs)))
        row["low_v1"], row["low_u1"] = (random_quantile(d, max(1, len(rep.pairs)), LOW_Q) for d in (n, m))
        row["paper"] = PAPER.get(rep.type.split(".")[-1], "")
        rows.append(row)
    return rows


def markdown(rows, title: str) -> str:
    align = "align_in" in (rows[0] if rows else {})
    head = ["type", "shape (out x in)", "pairs", "v1", "u1"] + (["align_in", "align_out"] if align else []) + \
           ["baseline v1/u1", "observed", "paper"]
    lines = [f"# Geometric continuity: {title}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["type"], f"{r['shape'][0]} x {r['shape'][1]}", str(r["pairs"]), _fmt(r["v1"]), _fmt(r["u1"])]
        if align:
            cells += [_fmt(r["align_in"]), _fmt(r["align_out"])]
        cells += [f"{r['baseline_v1']:.3f}/{r['baseline_u1']:.3f}", r["observed"], r["paper"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    checked = [r for r in rows if r["paper"]]
    if checked:
        ok = sum(r["observed"] == r["paper"] for r in checked)
        lines.append(f"\nPaper pattern (q, k, gate, up: v1; o, down: u1; v: low): {ok}/{len(checked)} types match.")
    lines.append(f"\nMeans of |cos| over adjacent-layer pairs. 'observed': the space (v1 or u1) whose mean exceeds the "
                 f"{100 * LOW_Q:g}% quantile of the same mean for independent random unit vectors (same d and number of "
                 "pairs; `conserve.continuity.random_quantile`) by the larger factor; else 'low'. Random baseline "
                 "of the alignments: about m/(m+n) (align_in) and n/(m+n) (align_out) for i.i.d. m x n weights.")
    return "\n".join(lines)


def plot(reports, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [k for k in ("v1", "u1", "align_in", "align_out") if reports and k in reports[0].values]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.3 * len(metrics), 3.7), constrained_layout=True, squeeze=False)
    for ax, k in zip(axes[0], metrics):
        for rep in reports:
            ax.plot([a for a, _ in rep.pairs], rep.values[k], marker=".", label=rep.type)
        ax.set_title({"v1": "|cos v1| (input space)", "u1": "|cos u1| (output space)",
                      "align_in": "alignment W^T W", "align_out": "alignment W W^T"}[k])
        ax.set_xlabel("layer l (pair l, next)")
        ax.set_ylim(0, 1.02)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"adjacent-layer continuity: {title}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    path = Path(args.path)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UsageError(f"--device {args.device!r} is not a torch device; use cpu or cuda") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    index = safetensors_index(path)
    floats = {n: s for n, (_, s, dt) in index.items() if n.endswith(".weight") and dt.startswith(("F", "BF"))}
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else None
    groups = group_projections(floats, types)
    if not groups:
        known = sorted(group_projections(floats))
        hint = f" (types present: {', '.join(known[:8])})" if known and types else ""
        raise UsageError(f"no projection type with weights in two or more layers in {path}{hint}; "
                         "parameter names need a `.<int>.` layer component")
    title = path.name
    cfg = path / "config.json" if path.is_dir() else None
    if cfg is not None and cfg.is_file():
        try:
            c = json.loads(cfg.read_text())
            title = f"{path.name} ({c.get('model_type', '?')}, {c.get('num_hidden_layers', '?')} layers)"
        except ValueError:
            pass
    out = Path(args.out) if args.out else Path("runs") / "continuity" / (path.stem or "checkpoint")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create --out {out}: {e.strerror}; choose a writable directory") from e
    console = Console(stderr=True)
    total = sum(len(v) for v in groups.values())
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("matrices", total=total)
        reports = continuity_report(groups, _loader(index), method=args.method, alignment=not args.no_alignment,
                                    device=device, progress=lambda n: progress.advance(task, n),
                                    generator=torch.Generator(device=device).manual_seed(0))
    rows = table_rows(reports)
    md = markdown(rows, title)
    record = {"checkpoint": str(path), "title": title, "method": args.method, "types": rows,
              "pairs": {r.type: {"pairs": r.pairs, **r.values} for r in reports},
              "source": "Jeong, Paeng, Suh 2026; spec laws.md, Geometric continuity"}
    try:
        (out / "continuity.md").write_text(md + "\n\n![continuity](continuity.png)\n")
        (out / "continuity.json").write_text(json.dumps(json_safe(record), indent=1))
        plot(reports, out / "continuity.png", title)
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror}; choose a writable directory") from e
    print(md)
    console.print(f"wrote {out / 'continuity.md'}, {out / 'continuity.json'}, {out / 'continuity.png'}")
    return 0

