"""Offline sm_90 compile (triton's bundled ptxas, no GPU) of Gram kernel variants that the interpreter
runs but the compiler may refuse: float64 inputs with fp32 accumulation (``fp64=False``), which once
reached ``tl.dot`` as fp64 operands of an fp32 accumulator ("Loop-carried variable acc has initial type
fp32 but is re-assigned to fp64", triton 3.6 and 3.8).  The launches are recorded under the interpreter
(``bench.compile_launches.recording``) and compiled in a fresh process (interpreter off); the values are
checked against the float64 reference at fp32 accuracy.  Whole-suite version: ``bench/compile_launches.py``.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from bench.compile_launches import recording, specs
from conserve.kernels import GramTerm, Plan, View, drift, drift_reference, evaluate, evaluate_reference

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _plan(sign):
    p = Plan()
    s = p.new_gram(16)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 16, 1, 40), sign, s))  # rows: layout 0
    p.grams.append(GramTerm(View(1, (0, 0), 1, 16, 0, 24), sign, s))  # columns: layout 1
    return p


@pytest.mark.skipif(not os.path.exists(_PTXAS), reason="this triton build bundles no ptxas")
def test_float64_inputs_of_an_fp32_accumulation_compile_for_sm90(tmp_path):
    g = torch.Generator().manual_seed(31)
    olds = [torch.randn(16, 40, dtype=torch.float64, generator=g),
            torch.randn(24, 16, dtype=torch.float64, generator=g)]
    news = [t + 0.1 * torch.randn(t.shape, dtype=torch.float64, generator=g) for t in olds]
    with recording() as seen:
        for sign in (-0.7, 1.0):  # FOLD off (the sign is not +-1 and the inputs not fp32) / on
            p = _plan(sign)
            _, got = evaluate(p, olds, fp64=False, backend="triton")
            _, want = evaluate_reference(p, olds, fp64=True)
            assert got[16].dtype == torch.float32
            assert ((got[16].double() - want[16]).abs().max() / want[16].abs().max()).item() < 1e-5
            pieces = drift(p, olds, news, [0.99, 0.98], fp64=False, backend="triton")
            ref = drift_reference(p, olds, news, [0.99, 0.98], fp64=True)
            for (_, gd), (_, rd) in zip(pieces, ref):
                assert ((gd[16].double() - rd[16]).abs().max() / rd[16].abs().max()).item() < 1e-5
    grams = [s for s in specs(seen) if s["name"] == "_gram_kernel"]
    assert {s["types"]["xb"] for s in grams} == {"*fp64"} and {s["constexprs"]["DRIFT"] for s in grams} == {False, True}
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(grams))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "bench.compile_launches", str(path), "--jobs", "2"], env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(grams)} compiled, 0 failed" in res.stdout
