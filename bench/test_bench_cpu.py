"""pytest-benchmark cases for the CPU paths (run: ``pytest bench/test_bench_cpu.py --benchmark-enable``).

Not collected by the default test run (``testpaths = tests``); with ``--benchmark-disable`` (the
project default) each case runs once as a smoke test.  Speed goals live in ``bench/kernels.py``.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' triton.jit functions exist

import pytest
import torch

from bench.kernels import TOY_LLAMA, llama_plan, llama_tensors, naive_llama
from conserve.kernels import evaluate, evaluate_reference
from conserve.kernels import launch as L

SHAPE = TOY_LLAMA


@pytest.fixture(scope="module", params=[False, True], ids=["norope", "llama"])
def case(request):
    rope = request.param
    return rope, llama_plan(SHAPE, rope), llama_tensors(SHAPE, "cpu", torch.float32)


def test_reference(benchmark, case):
    rope, plan, ts = case
    vec, grams = benchmark(evaluate_reference, plan, ts)
    nv, ng = naive_llama(SHAPE, rope, ts)
    assert torch.allclose(vec, nv, rtol=1e-4, atol=1e-6) and torch.allclose(grams[SHAPE.D], ng[SHAPE.D], atol=1e-6)


def test_naive(benchmark, case):
    rope, plan, ts = case
    benchmark(naive_llama, SHAPE, rope, ts)


def test_table_build(benchmark, case):
    """Host cost of canonicalising a plan (paid once per plan and tensor layout, then cached)."""
    rope, plan, ts = case
    st = benchmark(L.build, plan, ts, None, False, L.Tiles())
    assert st.vec_size == plan.vec_size


def test_triton_interpreter(benchmark, case):
    rope, plan, ts = case
    vec, grams = benchmark.pedantic(evaluate, args=(plan, ts), kwargs=dict(backend="triton"), rounds=1, iterations=1)
    nv, ng = naive_llama(SHAPE, rope, ts)
    assert torch.allclose(vec, nv, rtol=1e-4, atol=1e-6) and torch.allclose(grams[SHAPE.D], ng[SHAPE.D], atol=1e-6)


def test_offline_sm90_compile_of_the_step_kernel():
    """``python -m bench.sass`` compiles for sm_90 without a GPU (triton's bundled ptxas; in a fresh
    process: the kernels must not be the interpreter's): the AdamW step kernel at its GPU tiles uses
    16-byte loads and does not spill."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.sass", "--kernels", "step"], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("adamw step")]
    assert len(rows) == 6
    for r in rows:  # ... regs spill smem prog/SM N x128b / M scalar bar shfl
        assert int(r[-10]) == 0 and int(r[-7]) > 0 and r[-6] == "x128b"
