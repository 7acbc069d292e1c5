"""``conserve discover MODULE:FACTORY``: the conservation laws of a block, as a markdown table and JSON.

``FACTORY`` is a function of ``MODULE`` (imported from the current directory or the installed packages)
returning ``(block, example_inputs)``; see ``conserve.discover``. Torch is imported only when it runs.

Output: ``--out PREFIX`` (default ``discover``) writes exactly two files, ``PREFIX.md`` (the markdown table
and the solves, also printed) and ``PREFIX.json`` (``Discovery.to_json``); a ``.md`` / ``.json`` suffix on
``PREFIX`` is dropped, and an existing directory (or a path ending in ``/``) gets ``discover.md`` and
``discover.json`` inside. Missing parent directories are created.
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
    p.add_argument("--out", default="discover", metavar="PREFIX",
                   help="writes exactly PREFIX.md (the table, also printed) and PREFIX.json (default: discover, in "
                        "the current directory); a .md/.json suffix is dropped; an existing directory or a path "
                        "ending in / gets discover.md and discover.json inside")


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
    out = output_prefix(args.out)
    md_path, json_path = Path(str(out) + ".md"), Path(str(out) + ".json")
    try:  # fail before the (long) solve, leaving nothing behind
        out.parent.mkdir(parents=True, exist_ok=True)
        existed = md_path.exists()
        md_path.touch()
        if not existed:
            md_path.unlink()
    except OSError as e:
        raise UsageError(f"cannot write {md_path} ({e}); pass --out to a writable place") from None
    try:
        res = discover(block, inputs, degree=args.degree, ansatz=args.ansatz, max_unknowns=args.max_unknowns,
                       seed=args.seed, count=False if args.no_count else None, progress=True)
    except (BlockTooLarge, TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    md = f"# conserve discover {spec}\n\n" + res.markdown()
    md_path.write_text(md)
    json_path.write_text(json.dumps(finite_json(res.to_json()), indent=1))
    print(md)
    print(f"wrote {md_path} and {json_path}")
    return 0


def output_prefix(out: str):
    """``--out`` -> the path prefix of the two files: a ``.md`` / ``.json`` suffix dropped; an existing
    directory or a path ending in ``/`` -> ``DIR/discover``."""
    from pathlib import Path

    p = Path(out)
    if out.endswith(("/", "\\")) or p.is_dir():
        return p / "discover"
    return p.with_suffix("") if p.suffix in (".md", ".json") else p
