"""Comments and docstrings explain the code as it is: no issue numbers, no timings.

Every ``.py`` file under ``conserve/`` and ``kernels/`` is read as text (nothing is imported):

* an issue number anywhere in the file (``issue 12``, ``Issue #12``): a reader of the code has no
  issue tracker, so the reason goes into the comment itself;
* ``#12``-style references in comments and docstrings;
* a time measurement in a comment or docstring (``6.1 ms``, ``~5 us``): timings depend on the machine
  and go stale; they belong in ``bench/NOTES.md`` beside the bench script that reproduces them.

A failure lists every offender as ``path:line: text``.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conserve", "kernels")

ISSUE = re.compile(r"\bissue\s*#?\s*\d+(?![\w-])", re.IGNORECASE)  # not "issue 16-byte loads"
HASH_REF = re.compile(r"(?<![\w&])#\d{2,}\b")
TIMING = re.compile(r"\d+(?:\.\d+)?\s*(?:ms|µs|us|ns)\b")

# Files whose offenders are shown as a warning, not failed on (none: every file is held to the rules).
PENDING: set[str] = set()


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _prose(src: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every docstring line (a string literal standing alone as a
    statement: module, class, function and attribute docstrings)."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            # the source lines of the literal, so the line numbers are the file's
            lines = src.splitlines()[node.lineno - 1:node.end_lineno]
            out += [(node.lineno + i, line) for i, line in enumerate(lines)]
    return out


def offenders(path: Path) -> list[str]:
    """``path:line: text`` of every issue number and timing in ``path`` (see the module docstring)."""
    src = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    hits: dict[int, str] = {}
    for n, line in enumerate(src.splitlines(), 1):
        if ISSUE.search(line):
            hits[n] = line
    for n, text in _prose(src):
        if HASH_REF.search(text) or TIMING.search(text):
            hits[n] = src.splitlines()[n - 1]
    return [f"{rel}:{n}: {text.strip()}" for n, text in sorted(hits.items())]


def test_the_patterns_catch_what_they_are_for():
    assert ISSUE.search("see issue 12.") and ISSUE.search("(Issue #7)") and ISSUE.search("issue 15's null")
    assert not ISSUE.search("an issue with 2 rows") and not ISSUE.search("it can issue 16-byte loads")
    assert HASH_REF.search("# fixed in #123") and not HASH_REF.search("# item 1") and not HASH_REF.search("&#39;")
    assert TIMING.search("# ~5 us of dispatch") and TIMING.search("6.13 ms") and TIMING.search("0.07µs")
    assert not TIMING.search("# 12 rows") and not TIMING.search("# items")


def test_prose_reads_comments_and_docstrings_only():
    src = 'def f():\n    """doc 5 ms"""\n    x = "3 ms"  # note 4 ms\n    return x\n'
    assert sorted(n for n, _ in _prose(src)) == [2, 3]


def test_no_issue_numbers_or_timings_in_code_comments_or_docstrings():
    bad, pending = [], []
    for path in _files():
        (pending if path.relative_to(ROOT).as_posix() in PENDING else bad).extend(offenders(path))
    if pending:
        warnings.warn("offenders in PENDING files:\n" + "\n".join(pending), stacklevel=1)
    assert not bad, ("comments and docstrings explain the code as it is: no issue numbers (say the reason), "
                     "no timings (bench/NOTES.md holds them, with the bench script that reproduces each):\n"
                     + "\n".join(bad))


def test_pending_names_existing_files():
    """``PENDING`` only names files that exist (a renamed file must not slip out of the check)."""
    missing = sorted(p for p in PENDING if not (ROOT / p).is_file())
    assert not missing, f"PENDING names files that do not exist: {missing}"
