"""``conserve report PATH``: summary.md, summary.json and every plot from any conserve metrics file.

PATH is a run directory (``metrics.jsonl`` inside) or a ``metrics.jsonl`` written by ``conserve run`` or by
``conserve.JSONLSink`` in your own training loop. The report goes to ``report/`` beside the metrics file,
so a run's own summary and plots are never replaced unless ``--overwrite`` says so.
"""
from __future__ import annotations

import sys

DESCRIPTION = ("Rebuild the summary (verdicts with the numbers they rest on), summary.json and the plots eps.png, "
               "drift.png, layers.png from a metrics.jsonl. They are written to the folder report/ beside the "
               "metrics file (files in it are replaced by the next report); the run's own summary.md, summary.json "
               "and plots are left as they are. --overwrite writes beside the metrics file instead, replacing "
               "them; --out DIR writes to DIR.")


def add_arguments(p) -> None:
    p.description = DESCRIPTION
    p.add_argument("path", help="a run directory or a metrics.jsonl file")
    p.add_argument("--out", default=None,
                   help="where to write (default: the folder report/ beside the metrics file)")
    p.add_argument("--overwrite", action="store_true",
                   help="write beside the metrics file, replacing the run's summary.md, summary.json and plots")


def main(args) -> int:
    from ..report import report

    summary = report(args.path, args.out, overwrite=args.overwrite)
    fams = summary["families"]
    width = max((len(f) for f in fams), default=6)
    stop = summary.get("stop")
    steps = (f"stopped at step {stop['step']}" + (f" of {stop['planned']:g}" if stop.get("planned") is not None else "")
             + f" ({stop['reason']})") if stop else f"{summary['steps']} steps"
    print(f"conserve report: {steps}; {len(fams)} famil{'y' if len(fams) == 1 else 'ies'}; "
          f"wrote {summary['report_dir']}/")
    for f, r in fams.items():
        print(f"  {f:<{width}}  {r['verdict']}")
    for note in ([summary["stopped"]] if summary.get("stopped") else []) + summary.get("notes", []):
        print(f"conserve report: {note}", file=sys.stderr)
    return 0
