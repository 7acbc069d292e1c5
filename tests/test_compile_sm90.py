"""Offline sm_90 compile (triton's bundled ptxas, no GPU) of the kernels in the configurations a GPU runs,
with the hardware limits asserted: shared memory per program <= 232,448 bytes and no register spills
(``bench.compile_launches.limits``).

The suite's other tests run the CPU tiles (``launch.Tiles.for_device`` on a CPU tensor); here every
prepared plan gets the GPU tiles (``Tiles.gpu(132, config)``, ``bench.compile_launches.gpu_tiles``) and
the optimizer step its GPU tiles (``step_triton(interpret=False)``).  The cases
(``gpu_tile_cases(full=False)``: every kernel -- ``gram_kernel`` evaluate / bilinear / DRIFT,
``gram_finish``, ``rowcol_kernel``, ``finish_rows``, ``gather_rows``, the step and its finishing kernel --,
fp32/bf16/fp16/fp64 inputs, fp64 accumulation on and off, head dims 8 and 80, row blocks, column blocks
and general strides, the default Config, tf32x3 and four norm stages) run under the interpreter with
their values checked against the float64 torch references; their launches are recorded and one per
kernel, dtypes and mode (``covering``) is compiled in a fresh process (interpreter off).  Every distinct
launch of the full set (head dims 8/16/80/128/192, every Config switch, every optimizer):
``python -m bench.compile_launches --all``.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from bench.compile_launches import SMEM_LIMITS, covering, gpu_tiles, record_gpu_tiles, specs, recording
from conserve.kernels import GramTerm, Plan, View, drift, drift_reference, evaluate, evaluate_reference
from conserve.kernels import launch as L

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_ptxas = pytest.mark.skipif(not os.path.exists(_PTXAS), reason="this triton build bundles no ptxas")


def _compile(tmp_path, launches: list):
    """``python -m bench.compile_launches`` on ``launches`` in a fresh process (interpreter off)."""
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches, default=repr))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "bench.compile_launches", str(path), "--jobs", "2"], env=env,
                          cwd=_ROOT, capture_output=True, text=True, timeout=900)


def _plan(sign):
    p = Plan()
    s = p.new_gram(16)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 16, 1, 40), sign, s))  # rows: layout 0
    p.grams.append(GramTerm(View(1, (0, 0), 1, 16, 0, 24), sign, s))  # columns: layout 1
    return p


@needs_ptxas
def test_float64_inputs_of_an_fp32_accumulation_compile_for_sm90(tmp_path):
    """float64 inputs with fp32 accumulation (``fp64=False``) take fp32 dots (``UPCAST``): ``tl.dot``
    compiles no fp64 operands into an fp32 accumulator ("Loop-carried variable acc has initial type fp32
    but is re-assigned to fp64", triton 3.6 and 3.8).  Values at fp32 accuracy."""
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
    grams = [s for s in specs(seen) if s["name"] == "gram_kernel"]
    assert {s["types"]["xb"] for s in grams} == {"*fp64"} and {s["constexprs"]["DRIFT"] for s in grams} == {False, True}
    res = _compile(tmp_path, grams)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(grams)} compiled, 0 failed" in res.stdout


def test_norm_tiles_fit_the_shared_memory():
    """``Tiles.norm_tile``: 16-byte vectors per thread (BF 128 fp32, 256 bf16/fp16, 64 fp64), the fp32
    and bf16 tiles of the default Config as they were, and BF halved where the pipelined row tiles
    (``norm_smem_bytes``) would exceed the shared memory: bilinear fp32/fp64 with four stages."""
    from conserve.kernels import Config

    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    t = L.Tiles.gpu()
    assert t.norm_smem == SMEM_LIMITS[90]
    for bil in (False, True):
        assert t.norm_tile((f32, f32), bil) == (128, 4) and t.norm_tile((bf16, bf16), bil) == (256, 8)
        assert t.norm_tile((f16, f16), bil) == (256, 8) and t.norm_tile((f64, f64), bil) == (64, 4)
    t4 = L.Tiles.gpu(132, Config(norm_stages=4))
    assert t4.norm_tile((f32, f32)) == (128, 4) and t4.norm_tile((bf16, bf16), True) == (256, 8)
    assert t4.norm_tile((f32, f32), True) == (64, 4) and t4.norm_tile((f64, f64), True) == (32, 4)
    for stages in (1, 2, 3, 4):
        ts = L.Tiles.gpu(132, Config(norm_stages=stages))
        for g in ((f32, f32), (bf16, bf16), (f16, f16), (f64, f64), (bf16, f32), (f32, f64)):
            for bil in (False, True):
                assert ts.norm_smem_bytes(g, bil, ts.norm_tile(g, bil)[0]) <= ts.norm_smem, (stages, g, bil)
    small = L.Tiles.gpu(132, Config(norm_stages=4), smem=101376)  # sm_89 / sm_120: 99 KiB
    assert small.norm_smem_bytes((f32, f32), True, small.norm_tile((f32, f32), True)[0]) <= 101376
    assert L.Tiles().norm_tile((f32, f32), True) == (128, 4)  # CPU tiles: one stage
    # the gradient check's CHECK mode (four accumulators): half the columns
    assert t.norm_tile((f32, f32), True, check=True) == (64, 4) and t.norm_tile((bf16, bf16), True, check=True) == (128, 8)


@needs_ptxas
def test_gpu_tiles_compile_for_sm90_within_the_limits(tmp_path):
    """The GPU tiles' covering set (module docstring): values against the float64 references under the
    interpreter, then one launch per kernel, dtypes and mode compiled for sm_90 with the limits."""
    launches = record_gpu_tiles(full=False)
    with gpu_tiles():  # the patch is undone on exit
        assert L.Tiles.for_device(torch.device("cpu")).BS == L.Tiles.gpu().BS
    assert L.Tiles.for_device(torch.device("cpu")).BS == L.Tiles().BS
    chosen = covering(launches)
    names = {s["name"] for s in chosen}
    assert names == {"gram_kernel", "gram_finish", "rowcol_kernel", "finish_rows", "gather_rows", "step_kernel",
                     "finish_kernel"}, names
    rowcol = [s for s in chosen if s["name"] == "rowcol_kernel"]
    for dt in ("*fp32", "*bf16", "*fp16", "*fp64"):
        for bil in (False, True):
            for fp64 in (False, True):
                assert any(s["types"]["xb"] == dt and s["constexprs"]["BILINEAR"] == bil
                           and s["constexprs"]["FP64"] == fp64 for s in rowcol), (dt, bil, fp64)
    # the tracker's fp64 drift on a GPU: the composition's bilinear form over float64 tensors, four stages
    assert any(s["types"]["xb"] == "*fp64" and s["constexprs"]["BILINEAR"] and s["constexprs"]["FP64"]
               and s["constexprs"]["STAGES"] == 4 for s in rowcol)
    # the gradient check's one pass (CHECK) for every input dtype, fp64 accumulation on and off
    for dt in ("*fp32", "*bf16", "*fp16", "*fp64"):
        for fp64 in (False, True):
            assert any(s["types"]["xb"] == dt and s["constexprs"].get("CHECK") and s["constexprs"]["FP64"] == fp64
                       for s in rowcol), (dt, fp64)
    gram = [s["constexprs"] for s in chosen if s["name"] == "gram_kernel"]
    assert {(c["DRIFT"], c["BILINEAR"], c["FP64"], bool(c.get("CHECK"))) for c in gram} == {
        (False, False, False, False), (False, True, False, False), (False, False, True, False),
        (False, True, True, False), (True, True, False, False), (False, True, False, True), (False, True, True, True)}
    assert {c["SINGLE"] for c in gram if c.get("CHECK") and not c["FP64"]} == {True, False}
    assert {c["PREC"] for c in gram} == {"ieee", "tf32x3"} and max(c["BT"] for c in gram) == 128
    res = _compile(tmp_path, chosen)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(chosen)} compiled, 0 failed" in res.stdout, res.stdout
    assert f"limits: shared memory {SMEM_LIMITS[90]} B, spill 0 B" in res.stdout
