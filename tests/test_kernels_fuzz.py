"""Fuzzing of conserve.kernels (evaluate / bilinear / drift, both backends; Triton under TRITON_INTERPRET=1)
against an independent float64 reference written here element by element from the math of
``shared/spec/laws.md`` (Gram ``sign X X^T``, norms ``sign sum (x+shift)^2``, sums, bilinear
``sign (X Y^T + Y X^T)/2``, the drift identity ``h(new) = a^2 h(old) + 2a B(old, Delta) + h(Delta)``).
Shapes are tiny (the interpreter is slow)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conserve.kernels import GramTerm, NormTerm, Plan, SumTerm, View, bilinear, drift, evaluate

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"
BACKENDS = ("triton", "torch")


def _view64(v: View, t: torch.Tensor) -> torch.Tensor:
    """The view's entries read one by one by logical index (no strides, no resolve)."""
    t = t.detach().double()
    out = torch.zeros(v.rows, v.cols, dtype=torch.float64)
    for r in range(v.rows):
        for c in range(v.cols):
            i = list(v.start)
            i[v.row_dim] += r * v.row_step
            if v.col_dim is not None:
                i[v.col_dim] += c
            out[r, c] = t[tuple(i)]
    return out


def ref(plan: Plan, xs, ys=None):
    """float64 ``h(xs)`` (``ys`` None) or ``B(xs, ys)`` of ``plan``: ``(vec, {D: grams})``."""
    vec = torch.zeros(plan.vec_size, dtype=torch.float64)
    grams = {d: torch.zeros(n, d, d, dtype=torch.float64) for d, n in plan.gram_slots.items()}
    for g in plan.grams:
        X = _view64(g.view, xs[g.view.tensor])
        Y = X if ys is None else _view64(g.view, ys[g.view.tensor])
        grams[g.view.rows][g.slot] += g.sign * (X @ Y.T + Y @ X.T) / 2
    for n in plan.norms:
        X = _view64(n.view, xs[n.view.tensor]) + n.shift
        Y = X if ys is None else _view64(n.view, ys[n.view.tensor]) + n.shift
        for r, s in enumerate((X * Y).sum(1)):
            vec[n.index + r * n.index_stride] += n.sign * s
    if ys is None:
        for s in plan.sums:
            for c, x in enumerate(_view64(s.view, xs[s.view.tensor]).sum(0)):
                vec[s.index + c] += s.sign * x
    return vec, grams


def _abs(plan: Plan) -> Plan:
    """The plan with |sign| (its reference on |x| bounds every entry's terms: no cancellation hides errors)."""
    def a(t):
        return type(t)(**{**t.__dict__, "sign": abs(t.sign)})
    return Plan([a(t) for t in plan.grams], [a(t) for t in plan.norms], [a(t) for t in plan.sums],
                plan.vec_size, dict(plan.gram_slots))


def close(got, want, scale, rtol, what):
    pairs = [("vec", got[0], want[0], scale[0])] + [(f"D={d}", got[1][d], want[1][d], scale[1][d]) for d in want[1]]
    assert sorted(got[1]) == sorted(want[1]), what
    for part, g, w, s in pairs:
        assert g.shape == w.shape, (what, part)
        err = (g.double() - w).abs()
        assert not (err > rtol * s + 1e-30).any(), f"{what} {part}: max err {err.max():.3e}, scale {s.max():.3e}"


def test_non_float_tensors_are_refused_on_both_backends():
    """A complex weight lost its imaginary part silently in the torch twin (a UserWarning only) and the
    Triton path died in a KeyError; an integer tensor crashed the interpreter's dot.  Both backends now
    raise the same one-line ValueError naming the fix, for evaluate, bilinear and drift."""
    p = Plan()
    s = p.new_gram(3)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 3, 1, 4), 1.0, s))
    good = torch.randn(3, 4)
    for bad in (torch.randn(3, 4, dtype=torch.complex64), torch.ones(3, 4, dtype=torch.int64),
                torch.ones(3, 4, dtype=torch.bool)):
        for be in BACKENDS:
            with pytest.raises(ValueError, match="real float weights"):
                evaluate(p, [bad], backend=be)
            with pytest.raises(ValueError, match="real float weights"):
                bilinear(p, [good], [bad], backend=be)
            with pytest.raises(ValueError, match="real float weights"):
                drift(p, [good], [bad], 0.9, backend=be)
