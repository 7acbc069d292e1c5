"""The CPU-safe part of ``bench/overlap_check.py`` (the GPU bitwise check of the two stream overlaps):
its comparison runs under the interpreter, and it reports a difference, a non-deterministic control
and a missing side stream instead of passing them."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from bench import overlap_check as OC

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"


def _first_cases(n=2):
    return list(itertools.islice(OC.law_cases("cpu", small=True), n))  # evaluate and bilinear, fp32


def test_law_pass_check_runs_on_cpu():
    res = OC.check_law_pass("cpu", cases=_first_cases())
    assert [n for n, _, _ in res] == ["law_pass evaluate float32", "law_pass bilinear float32"]
    for name, ok, msg in res:
        assert ok and msg.startswith("bitwise equal") and "no side stream was used: CPU" in msg, (name, msg)


def test_law_pass_check_reports_differences(monkeypatch):
    """A result that changes with the overlap is a failure naming what differs; one that changes from
    call to call fails the control."""
    from conserve import kernels

    real = kernels.evaluate
    calls = itertools.count()

    def overlap_differs(plan, xs, **kw):
        vec, grams = real(plan, xs, **kw)
        if kw["config"].overlap:
            vec = vec.clone()
            vec[0] = torch.nextafter(vec[0], torch.tensor(float("inf")))
        return vec, grams

    def nondeterministic(plan, xs, **kw):
        vec, grams = real(plan, xs, **kw)
        d = next(calls)
        grams = {k: g + d * 1e-6 for k, g in grams.items()}
        return vec, grams

    case = _first_cases(1)
    monkeypatch.setattr(kernels, "evaluate", overlap_differs)
    (name, ok, msg), = OC.check_law_pass("cpu", cases=case)
    assert not ok and msg.startswith("vec (1 of ") and "differ" in msg
    monkeypatch.setattr(kernels, "evaluate", nondeterministic)
    (name, ok, msg), = OC.check_law_pass("cpu", cases=case)
    assert not ok and "CONTROL serial vs serial also differs: grams D=" in msg


def test_law_pass_check_needs_a_side_stream_on_cuda(monkeypatch):
    """On CUDA an overlapped run without a side stream (a plan with no Gram or no norm terms, or
    Config(overlap) ignored) is not a pass."""
    monkeypatch.setattr(OC, "compare_law_pass", lambda *a, **k: {"overlap": [], "control": [], "side": False})
    (name, ok, msg), = OC.check_law_pass("cuda", cases=[("evaluate x", None, None, None, False)])
    assert not ok and "no side stream was used)" in msg


def test_fused_overlap_parity_runs_on_cpu():
    """``bench.fused_optim.overlap_parity`` (part 2) on a toy model on CPU: the serial control agrees
    bit for bit, the overlap ordering too, and the line says that no side stream was used (CPU)."""
    from bench.fused_optim import overlap_parity
    from conserve.models.lm import LMConfig

    cfg = LMConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=24)
    lines = []
    ok = overlap_parity("cpu", lines, cfg=cfg, steps=2, cases=((1, None, False),))
    assert not ok  # no side stream on CPU
    (name, msg), = lines
    assert name == "overlap_parity every=1 budget=None"
    assert msg == ("FAILED: 0 weights, 0 optimizer state tensors, 0 tracker state tensors, 0 last h/term tensors, "
                   "0 row values differ (no side stream was used)"), msg
