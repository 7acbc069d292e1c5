"""The package's import graph: no circle, no private name imported across modules.

Every ``import`` statement counts, those inside functions included: a lazy import may keep
``conserve --help`` fast, but it must not hide a circle. ``kernels/`` is installed as
``conserve.kernels``, so its modules are named that way here.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Module name -> file, for conserve/ and kernels/ (as conserve.kernels)."""
    out = {}
    for base, prefix in ((ROOT / "conserve", "conserve"), (ROOT / "kernels", "conserve.kernels")):
        for f in base.rglob("*.py"):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = f
    return out


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, list[str], int]]:
    """``(module imported, names taken from it, line)`` for every import statement of ``name``."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("conserve")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if not (src == "conserve" or src.startswith("conserve.")):
                continue
            if src not in mods and src.startswith("conserve.") and "kernels" in src.split("."):
                pass  # (kernels' own top-level name is handled by _modules)
            names = [a.name for a in node.names]
            subs = [f"{src}.{n}" for n in names if f"{src}.{n}" in mods]
            out += [(s, [], node.lineno) for s in subs]
            rest = [n for n in names if f"{src}.{n}" not in mods]
            if rest:
                out.append((src, rest, node.lineno))
    return out


def _graph():
    mods = _modules()
    edges, private = {m: set() for m in mods}, []
    for m, f in mods.items():
        for src, names, line in _imports(m, f, mods):
            if src in mods and src != m:
                edges[m].add(src)
            bad = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if bad and src != m:
                private.append(f"{f.relative_to(ROOT)}:{line}: from {src} import {', '.join(bad)}")
    return edges, private


def _cycles(edges: dict[str, set]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _circles_ignoring_root() -> list[list[str]]:
    """Circles among the package's modules; ``conserve/__init__`` (the public API, which imports the rest)
    is left out: a module that imports from it is reported by its own test below."""
    edges, _ = _graph()
    edges = {m: {w for w in ws if w != "conserve"} for m, ws in edges.items() if m != "conserve"}
    return _cycles(edges)


def test_no_import_circle():
    circles = _circles_ignoring_root()
    assert not circles, "import circles (every import statement counts, lazy ones too):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_no_module_imports_the_public_api_package():
    edges, _ = _graph()
    bad = sorted(m for m, ws in edges.items() if "conserve" in ws and m != "conserve")
    assert not bad, f"modules that import from conserve/__init__ (import the module that defines the name): {bad}"


def test_no_private_name_imported_across_modules():
    _, private = _graph()
    assert not private, "private names imported across modules (make them public where shared):\n" + "\n".join(private)


def test_the_checker_sees_a_circle_and_a_private_import(tmp_path):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from .other import _hidden, public\n")
    got = _imports("conserve.x.m", f, {"conserve.x.other": f})
    assert got == [("conserve.x.other", ["_hidden", "public"], 2)]
