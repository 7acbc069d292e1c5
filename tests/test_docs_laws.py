"""Citations of the math name sections that exist.

The package's comments, docstrings and messages cite derivations by section name, in two places:

* ``docs/laws.md, "<Section>"`` (this repository's derivations): the name must be a heading of ``docs/laws.md``;
* ``spec ... "<Section>"`` (the project's reference ``shared/spec/laws.md``, kept beside the repository and not
  always cloned with it): the name must be a heading of ``docs/laws.md`` or name a place in the spec: a heading, a
  catalogue row (its first cell) or column, a paragraph's lead words ("Breakers"), a numbered check ("Counting").
  A cited name may be the start of that place ("Discrete steps" for "Discrete steps: the exact drift identity").
  Skipped when the spec is not beside the repository (``../shared/spec/laws.md`` or ``shared/spec/laws.md``).

Every ``.py`` file under ``conserve/`` and ``kernels/`` is read as text (nothing is imported); case and runs of
white space are ignored in the comparison. Unquoted mentions (``spec: ReLU row``) are not checked.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conserve", "kernels")
DOCS = ROOT / "docs" / "laws.md"
SPEC_CANDIDATES = (ROOT.parent / "shared" / "spec" / "laws.md", ROOT / "shared" / "spec" / "laws.md")

# a section name in quotes: one line, or two when a docstring wraps it
_NAME = r'"(?P<name>[A-Za-z][^"\n]*(?:\n[ \t]*[^"\n]+)?)"'
DOCS_CITE = re.compile(r"docs/laws\.md(?:``)?,?\s*" + _NAME)
SPEC_CITE = re.compile(r"""(?x)
    (?: (?<![\w/.]) spec \b (?! \s*/ )                      # the word "spec" (not find_spec, __spec__, spec/...)
        (?: \s* \(? `` [^`\n]* `` \)? )?                    # spec ``shared/spec/laws.md``
        (?: \s+ table | \s+ check \s+ \d+ | : \s* laws\.md )?  # spec table: / spec check 1, / spec: laws.md,
      | (?<![\w/]) (?: \.\./ )? (?: shared/spec/ )? laws\.md (?:``)?   # (``../shared/spec/)laws.md`` ("...")
    )
    \s* [,:]? \s* \(? """ + _NAME)

# citations of a spec place that does not exist, in files this test does not own: listed, not failed on.
# (path, cited name) -> where the text lives. Remove an entry once the citation is fixed.
KNOWN_DANGLING: dict[tuple[str, str], str] = {}


def _norm(s: str) -> str:
    return " ".join(s.replace("`", "").lower().split())


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def citations(text: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    """``(line, cited name)`` of every match of ``pattern`` in ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group("name").split())) for m in pattern.finditer(text)]


def headings(md: str) -> list[str]:
    """The text of every Markdown heading (``#`` .. ``######``) outside fenced code."""
    out, fenced = [], False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def spec_places(md: str) -> list[str]:
    """The places a spec citation may name: headings, the first cell of every table row and every header cell,
    the lead words of a paragraph or list item (up to the first ``(`` or ``:``)."""
    out = headings(md)
    lines = [line.strip() for line in md.splitlines()] + [""]
    prev_blank = True
    for i, s in enumerate(lines[:-1]):
        if s.startswith("|"):
            cells = [c.strip() for c in s.strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # not the separator row
                header = re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", lines[i + 1]) is not None
                out += cells if header else cells[:1]
        elif s and not s.startswith("#"):
            item = re.match(r"(?:[-*]|\d+\.)\s+(.*)", s)
            if item or prev_blank:
                lead = re.split(r"[(:]", item.group(1) if item else s, maxsplit=1)[0].strip()
                if lead:
                    out.append(lead)
        prev_blank = not s
    return out


def names(name: str, places: list[str], prefix: bool) -> bool:
    """``name`` names one of ``places``: equal (case and white space ignored), or with ``prefix`` the start of
    one, ending at a word boundary."""
    n = _norm(name)
    for p in map(_norm, places):
        if p == n or (prefix and p.startswith(n) and not p[len(n)].isalnum()):
            return True
    return False


def _spec() -> Path | None:
    return next((p for p in SPEC_CANDIDATES if p.is_file()), None)


def _all(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    out = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        out += [(rel, line, name) for line, name in citations(path.read_text(encoding="utf-8"), pattern)]
    return out


# ------------------------------------------------------------------------------------------ tests
def test_docs_headings_are_unique():
    hs = [_norm(h) for h in headings(DOCS.read_text(encoding="utf-8"))]
    assert hs and len(hs) == len(set(hs)), sorted(h for h in hs if hs.count(h) > 1)


def test_docs_citations_name_headings():
    hs = headings(DOCS.read_text(encoding="utf-8"))
    cites = _all(DOCS_CITE)
    assert {p for p, _, _ in cites} >= {"conserve/detection/match/conv.py", "conserve/detection/hf/mla.py"}, cites
    bad = [f'{p}:{line}: docs/laws.md, "{n}"' for p, line, n in cites if not names(n, hs, prefix=False)]
    assert not bad, "citations of sections docs/laws.md does not have:\n" + "\n".join(bad)


def test_spec_citations_name_sections():
    spec = _spec()
    if spec is None:
        pytest.skip("the spec (../shared/spec/laws.md) is not beside this repository")
    places = spec_places(spec.read_text(encoding="utf-8"))
    ours = headings(DOCS.read_text(encoding="utf-8"))
    dangling = {(p, n): line for p, line, n in _all(SPEC_CITE)
                if not (names(n, places, prefix=True) or names(n, ours, prefix=False))}
    bad = [f'{p}:{line}: spec "{n}"' for (p, n), line in dangling.items() if (p, n) not in KNOWN_DANGLING]
    assert not bad, ("citations of spec sections that neither the spec nor docs/laws.md has (derive the law in "
                     "docs/laws.md and cite it there):\n" + "\n".join(bad))
    stale = [k for k in KNOWN_DANGLING if k not in dangling]
    if stale:
        warnings.warn(f"KNOWN_DANGLING entries no longer dangling (remove them): {stale}", stacklevel=1)


def test_the_matchers_have_teeth():
    """Every citation form in use is read, and a wrong name is caught."""
    text = '''spec "Discrete steps"; spec ``shared/spec/laws.md``, "The numerical checks", check 1;
    (``../shared/spec/laws.md`` ("The catalogue")); spec: laws.md, "Geometric continuity"; spec check 4, "Counting";
    spec table: "untied softmax output layer"; the spec, laws.md "Breakers"; spec "No such section";
    spec ``shared/spec/laws.md``, "Multi-head latent
    attention"; find_spec("lightning"); kernels.__spec__; spec: ReLU row; if spec == "auto"
    (``docs/laws.md``, "Conv-ReLU-Conv") 'x (docs/laws.md, "Norm gains")' docs/laws.md, "No such heading"'''
    got = [n for _, n in citations(text, SPEC_CITE)]
    assert got == ["Discrete steps", "The numerical checks", "The catalogue", "Geometric continuity", "Counting",
                   "untied softmax output layer", "Breakers", "No such section", "Multi-head latent attention"], got
    docs = [n for _, n in citations(text, DOCS_CITE)]
    assert docs == ["Conv-ReLU-Conv", "Norm gains", "No such heading"], docs
    ours = headings(DOCS.read_text(encoding="utf-8"))
    assert names("Conv-ReLU-Conv", ours, prefix=False) and not names("No such heading", ours, prefix=False)
    assert names("conv before a NORM", ours, prefix=False) and not names("Conv", ours, prefix=False)
    md = "# Top\n\n## Discrete steps: the exact drift identity\n| block | symmetry |\n|---|---|\n| RoPE layouts | x |\n" \
         "\nBreakers (the tracker): text\n\n1. First order: x\n4. Counting (Marcotte): y\n"
    places = spec_places(md)
    for ok in ("Discrete steps", "RoPE layouts", "symmetry", "Breakers", "Counting", "top"):
        assert names(ok, places, prefix=True), (ok, places)
    for wrong in ("Discrete step", "RoPE layout", "Convolutions", "No such section"):
        assert not names(wrong, places, prefix=True), wrong
