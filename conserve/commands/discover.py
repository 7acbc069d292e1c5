"""``conserve discover MODULE:FACTORY``: the conservation laws of a block, as a markdown table and JSON.

``FACTORY`` is a function of ``MODULE`` (imported from the current directory or the installed packages)
returning ``(block, example_inputs)``; see ``conserve.discover``. Torch is imported only when it runs.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="a Python path to a function returning (block, example_inputs), e.g. mypkg.blocks:tiny_gated_attention")
    p.add_argument("--degree", type=int, default=2, choices=(1, 2))
    p.add_argument("--ansatz", default="auto", choices=("auto", "structured", "dense"))
    p.add_argument("--max-unknowns", type=int, default=6000, help="size limit of one solve (default 6000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-count", action="store_true", help="skip the comparison with conserve.count")
    p.add_argument("--out", default="discover", help="output prefix: writes OUT.md and OUT.json (default: discover)")


def main(args) -> int:
    import importlib
    import json
    import sys
    from pathlib import Path

    from ..analysis.discover import BlockTooLarge, discover, finite_json
    from ..errors import UsageError

    spec = args.factory
    if ":" not in spec:
        raise UsageError(f"{spec!r} is not MODULE:FACTORY; write e.g. mypkg.blocks:make_block")
    mod_name, fn_name = spec.split(":", 1)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import {mod_name!r} ({e}); run from the directory that holds it or install it") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise UsageError(f"{mod_name} has no function {fn_name!r}; it must return (block, example_inputs)")
    made = fn()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise UsageError(f"{spec} must return a tuple (block, example_inputs), got {type(made).__name__}")
    block, inputs = made
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(out) + ".md").touch()
    except OSError as e:
        raise UsageError(f"cannot write {out}.md ({e}); pass --out to a writable place") from None
    try:
        res = discover(block, inputs, degree=args.degree, ansatz=args.ansatz, max_unknowns=args.max_unknowns,
                       seed=args.seed, count=False if args.no_count else None, progress=True)
    except (BlockTooLarge, TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    md = f"# conserve discover {spec}\n\n" + res.markdown()
    Path(str(out) + ".md").write_text(md)
    Path(str(out) + ".json").write_text(json.dumps(finite_json(res.to_json()), indent=1))
    print(md)
    print(f"wrote {out}.md and {out}.json")
    return 0
