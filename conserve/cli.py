"""The ``conserve`` command line: ``conserve run | inspect | continuity | experiment NAME``.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``.
User errors are raised as ``UsageError`` and printed as one line with exit code 2 (no traceback).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UsageError

# sub-command -> module (imported lazily so `conserve --help` stays fast)
COMMANDS = {
    "run": ("conserve.commands.run", "train the reference LM on text with conservation-law tracking"),
    "inspect": ("conserve.commands.inspect", "list the laws of a checkpoint (HF directory or .safetensors)"),
    "continuity": ("conserve.commands.continuity", "geometric continuity across layers of a checkpoint"),
    "experiment": ("conserve.experiments", "reproduce an experiment: scaling, optimizers, continuity"),
    "reproduce": ("conserve.commands.reproduce", "every claim of both papers beside ours, over seeds: reproduce.md/json"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit 2 with one line, as argparse does, but name the fix
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="conserve", description="Track the conservation laws of training dynamics: conserve run | inspect | "
                "continuity | experiment NAME")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(sp)
        except ModuleNotFoundError as e:  # a command whose module is not installed is reported, not hidden
            if e.name and e.name.startswith("conserve"):
                sp.set_defaults(_missing=str(e))
            else:
                raise
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"conserve {args.command}: not available in this build ({args._missing})", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except UsageError as e:
        print(f"conserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"conserve {args.command}: interrupted; files written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
