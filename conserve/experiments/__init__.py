"""``conserve experiment NAME``: reproduce the papers' experiments, each writing a run directory.

Each experiment is a module here exposing ``add_arguments(parser)`` and ``main(args) -> int``.
"""
from __future__ import annotations

import importlib

EXPERIMENTS = {
    "scaling": "eps per law family vs step and learning rate (GD/SGD), fitted exponents (theory: 2 in lr, 1 in k)",
    "optimizers": "SGD, momentum and AdamW with and without weight decay: measured drift vs the three-term identity",
    "continuity": "geometric-continuity ablation (Jeong, Paeng, Suh 2026): residual MLP on MNIST and a small transformer",
}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="experiment", metavar="NAME", parser_class=type(parser))
    sub.required = True
    for name, help_ in EXPERIMENTS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_experiment=f"{__name__}.{name}")
        try:
            importlib.import_module(f"{__name__}.{name}").add_arguments(sp)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("conserve"):
                sp.set_defaults(_missing=str(e))
            else:
                raise


def main(args) -> int:
    if getattr(args, "_missing", None):
        from ..errors import UsageError

        raise UsageError(f"experiment {args.experiment!r} is not available in this build ({args._missing})")
    return int(importlib.import_module(args._experiment).main(args) or 0)
