"""``conserve report PATH``: summary.md, summary.json and every plot from any conserve metrics file.

PATH is a run directory (``metrics.jsonl`` inside) or a ``metrics.jsonl`` written by ``conserve run`` or by
``conserve.JSONLSink`` in your own training loop.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("path", help="a run directory or a metrics.jsonl file")
    p.add_argument("--out", default=None, help="where to write (default: beside the metrics file)")


def main(args) -> int:
    from ..report import report

    summary = report(args.path, args.out)
    fams = summary["families"]
    width = max((len(f) for f in fams), default=6)
    print(f"conserve report: {summary['steps']} steps, {len(fams)} famil{'y' if len(fams) == 1 else 'ies'}")
    for f, r in fams.items():
        print(f"  {f:<{width}}  {r['verdict']}")
    return 0
