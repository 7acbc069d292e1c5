"""The ``conserve`` command line: ``conserve run | report | inspect | continuity | experiment NAME``.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
only the module of the command being run is imported (``conserve --help`` imports neither torch nor any
command). User errors are raised as ``UsageError`` and printed as one line with exit code 2 (no
traceback); a ``conserve run`` that diverged exits 3, one interrupted with Ctrl-C 130. Also runs as
``python -m conserve``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UsageError

# sub-command -> module (imported lazily so `conserve --help` stays fast)
COMMANDS = {
    "run": ("conserve.commands.run", "train the reference LM on text with conservation-law tracking"),
    "report": ("conserve.commands.report", "summary.md, summary.json and plots from any metrics.jsonl"),
    "inspect": ("conserve.commands.inspect", "list the laws of a checkpoint (HF directory or .safetensors)"),
    "continuity": ("conserve.commands.continuity", "geometric continuity across layers of a checkpoint"),
    "experiment": ("conserve.experiments", "reproduce an experiment: scaling, optimizers, continuity"),
    "reproduce": ("conserve.commands.reproduce", "every claim of both papers beside ours, over seeds: reproduce.md/json"),
    "discover": ("conserve.commands.discover", "find the conservation laws of a new block: discover MODULE:FACTORY"),
}


class _Parser(argparse.ArgumentParser):
    command: str | None = None  # the sub-command being parsed (its help is the one to read)

    def error(self, message):  # exit 2 with one line, as argparse does, but name the fix
        where = f"conserve {self.command}" if self.prog == "conserve" and self.command else self.prog
        self.exit(2, f"{self.prog}: error: {message} (see `{where} --help`)\n")


def build_parser(only: str | None = "*") -> argparse.ArgumentParser:
    """The parser; the arguments of sub-command ``only`` are added (every one for ``"*"``, none for None)."""
    p = _Parser(prog="conserve", description="Track the conservation laws of training dynamics: conserve "
                + " | ".join(COMMANDS) + " (`conserve COMMAND --help` for each)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=module)
        if only not in ("*", name):
            continue
        try:
            importlib.import_module(module).add_arguments(sp)
        except ModuleNotFoundError as e:  # a command whose module is not installed is reported, not hidden
            if e.name and e.name.startswith("conserve"):
                sp.set_defaults(_missing=str(e))
            else:
                raise
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    parser.command = command if command in COMMANDS else None
    args = parser.parse_args(argv)
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
