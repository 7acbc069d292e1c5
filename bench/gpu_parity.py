"""CUDA parity check of the compiled Triton path against the float64 torch reference (not a test:
the CPU suite checks the same code under TRITON_INTERPRET=1; this checks what the GPU compiles).

    python -m bench.gpu_parity        # needs a CUDA device; exits 1 on the first mismatch

Reuses the plan builders and the tolerance check of ``tests/test_kernels.py`` (entrywise bound
``rtol * scale``, scale = the same plan on ``|x|`` in float64): a Llama block large enough for the
GPU work split (several row chunks and column tiles per norm region, D = 128 Gram tiles) in fp32 and
bf16 (evaluate + bilinear), the fp64 mode, a multi-tile head dim (D = 192) and the Conv1D layout;
and the DRIFT pass of a tracked optimizer step (``kernels.drift`` vs ``drift_reference`` in float64,
D = 128 / 192, fp32 and bf16, a != 1 and a == 1, with and without the decay piece).  Then the same
fp32 evaluate / bilinear / DRIFT cases with 3xTF32 Gram dots (``Config(input_precision="tf32x3")``)
against float64 at the fp32 tolerance (1e-5 of the entrywise scale): the interpreter cannot check
that rounding (it multiplies in fp32), only the GPU can.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch


def _load_test_helpers():
    """Import tests/test_kernels.py for its helpers.  It asserts TRITON_INTERPRET=1 at import time,
    so the variable is set only while importing it (no triton.jit function is defined then: the
    kernels are imported lazily on the first call) and removed before any kernel is compiled."""
    path = Path(__file__).resolve().parents[1] / "tests" / "test_kernels.py"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        assert "conserve.kernels.gram" not in sys.modules, "import bench.gpu_parity before the kernels"
        spec = importlib.util.spec_from_file_location("_kernel_test_helpers", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def _bf16_repeat(T, dev) -> int:
    """bf16 Gram tiles on the tensor cores: an asynchronous wgmma reads its operands from the cp.async
    ring of the pipelined k loop (tests/test_gram_sm90_pipeline.py checks the compiled ring offline).
    Diagonal output tiles with the sign folded (Llama D = 128: BT 128, BK 32; ViT D = 64: BT 64, BK 64)
    and, as the control, a slot with a non-unit sign (no fold): against float64 at the bf16 tolerance,
    then 5 more calls on the same tensors, which must give the same bits (the kernel has no atomics: a
    difference is a race).  Returns the number of failed cases."""
    from bench.kernels import Shape, vit_plan, vit_tensors
    from conserve.kernels import bilinear, evaluate

    g = torch.Generator().manual_seed(3)
    cases = [("llama D=128", *T.llama_block(dtype=torch.bfloat16, nH=4, nKV=2, D=128, H=1024, I=2816, seed=1))]
    s = Shape("vit-b16 x 2", 2, 768, 12, 12, 64, 3072)
    cases.append(("vit D=64", vit_plan(s), vit_tensors(s, "cpu", torch.bfloat16, seed=2)))
    p = T.Plan()
    slot = p.new_gram(128)
    p.grams += [T.GramTerm(T.View(0, (0, 0), 0, 128, 1, 1024), 1.0, slot),
                T.GramTerm(T.View(0, (128, 0), 0, 128, 1, 1024), -0.5, slot)]
    cases.append(("sign -0.5 (no fold)", p, [T.randn(256, 1024, dtype=torch.bfloat16, gen=g)]))
    failed = 0
    for name, plan, ts in cases:
        t = time.perf_counter()
        ts = [x.to(dev) for x in ts]
        ys = [torch.randn(x.shape, generator=g).to(x.dtype).to(dev) for x in ts]
        try:
            T.check(plan, ts, ys)
            for what, run in (("evaluate", lambda: evaluate(plan, ts, backend="triton")),
                              ("bilinear", lambda: bilinear(plan, ts, ys, backend="triton"))):
                first = run()[1]
                for rep in range(5):
                    again = run()[1]
                    for d in first:
                        diff = (again[d] - first[d]).abs().max().item()
                        assert torch.equal(again[d], first[d]), f"{what} D={d} call {rep + 2}: max diff {diff:.3e}"
            status = "ok"
        except AssertionError as e:
            status, failed = f"FAIL {e}", failed + 1
        torch.cuda.synchronize()
        print(f"parity bf16 {name} (+bilinear, 6 calls bitwise): {status} ({time.perf_counter() - t:.1f} s)",
              flush=True)
    return failed


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_parity: no CUDA device; the CPU suite (pytest tests/test_kernels.py) covers the interpreter")
        return 0
    T = _load_test_helpers()
    dev = torch.device("cuda")
    cases = []

    def block(dtype, rope, **kw):
        p, ts = T.llama_block(dtype=dtype, rope=rope, **kw)
        return p, [t.to(dev) for t in ts]

    big = dict(nH=4, nKV=2, D=128, H=1024, I=2816, seed=1)
    cases.append(("llama D=128 fp32 (+bilinear)", *block(torch.float32, False, **big), True, False))
    cases.append(("llama D=128 bf16 (+bilinear)", *block(torch.bfloat16, False, **big), True, False))
    cases.append(("llama rope partial-rotary fp32 fp64=True (+bilinear)", *block(torch.float32, True, D=64, H=96, I=80),
                  True, True))
    g = torch.Generator().manual_seed(2)
    D, H = 192, 256
    ts = [T.randn(2 * D, H, gen=g), T.randn(D, H, gen=g), T.randn(D, H, gen=g), T.randn(H, 2 * D, gen=g)]
    p = T.Plan()
    T.attention(p, 2, 1, D, H, 0, 1, 2, 3)
    cases.append(("head_dim 192 (multi-tile)", p, [t.to(dev) for t in ts], False, False))
    nH, nKV, D, H = 4, 2, 64, 256
    ts = [T.randn(H, (nH + 2 * nKV) * D, gen=g), T.randn(nH * D, H, gen=g)]
    p = T.Plan()
    T.attention(p, nH, nKV, D, H, 0, None, None, 1, layout="conv1d")
    cases.append(("conv1d layout", p, [t.to(dev) for t in ts], False, False))

    t_all = time.perf_counter()
    failed = 0
    for name, plan, ts, bil, fp64 in cases:
        t = time.perf_counter()
        try:
            T.check(plan, ts, [torch.randn_like(x, dtype=torch.float32).to(x.dtype) for x in ts] if bil else None,
                    fp64=fp64)
            status = "ok"
        except AssertionError as e:  # report every case, then fail
            status, failed = f"FAIL {e}", failed + 1
        torch.cuda.synchronize()
        print(f"parity {name}: {status} ({time.perf_counter() - t:.1f} s incl. compile)", flush=True)
    from conserve.kernels import drift, drift_reference

    failed += _bf16_repeat(T, dev)
    for D, dtype in ((128, torch.float32), (192, torch.float32), (128, torch.bfloat16)):
        t = time.perf_counter()
        p, olds, news = T.drift_case(D, dtype, seed=D)
        olds, news = [x.to(dev) for x in olds], [x.to(dev) for x in news]
        try:
            for a in ([0.9, 0.8, 0.95, 1.0, 0.7], 1.0):
                got = drift(p, olds, news, a, backend="triton")
                nodec = drift(p, olds, news, a, backend="triton", decay=False)
                assert nodec[1] is None and all(torch.equal(nodec[k][1][d], got[k][1][d])
                                                for k in (0, 2, 3) for d in got[k][1]), "decay=False differs"
                want = drift_reference(p, [x.double() for x in olds], [x.double() for x in news], a, fp64=True)
                T.check_drift(got, want, T.RTOL[dtype], f"drift D={D} {dtype} a={a}")
            status = "ok"
        except AssertionError as e:
            status, failed = f"FAIL {e}", failed + 1
        torch.cuda.synchronize()
        print(f"parity drift D={D} {str(dtype).split('.')[-1]}: {status} ({time.perf_counter() - t:.1f} s incl. compile)",
              flush=True)
    from conserve.kernels import Config, bilinear, evaluate

    tf = Config(input_precision="tf32x3")
    for name, plan, ts, bil, fp64 in cases:
        if fp64 or any(x.dtype != torch.float32 for x in ts):
            continue
        t = time.perf_counter()
        try:
            d64 = [x.double() for x in ts]
            ap = T._abs_plan(plan)
            got = evaluate(plan, ts, backend="triton", config=tf)
            want = T.evaluate_reference(plan, d64, fp64=True)
            scale = T.evaluate_reference(ap, [x.abs() for x in d64], fp64=True)
            pairs = [(got, want, scale, "")]
            if bil:
                ys = [torch.randn_like(x) for x in ts]
                y64 = [y.double() for y in ys]
                pairs.append((bilinear(plan, ts, ys, backend="triton", config=tf),
                              T.bilinear_reference(plan, d64, y64, fp64=True),
                              T.bilinear_reference(ap, [x.abs() for x in d64], [y.abs() for y in y64], fp64=True),
                              " bilinear"))
            for (gv, gg), (wv, wg), (sv, sg), what in pairs:
                T._close(gv, wv, sv, T.RTOL[torch.float32], f"tf32x3{what} vec")
                for d in wg:
                    T._close(gg[d], wg[d], sg[d], T.RTOL[torch.float32], f"tf32x3{what} gram D={d}")
            status = "ok"
        except AssertionError as e:
            status, failed = f"FAIL {e}", failed + 1
        torch.cuda.synchronize()
        print(f"parity tf32x3 {name}: {status} ({time.perf_counter() - t:.1f} s incl. compile)", flush=True)
    for D in (128, 192):
        t = time.perf_counter()
        p, olds, news = T.drift_case(D, torch.float32, seed=D)
        olds, news = [x.to(dev) for x in olds], [x.to(dev) for x in news]
        try:
            for a, dec in (([0.9, 0.8, 0.95, 1.0, 0.7], True), ([0.9, 0.8, 0.95, 1.0, 0.7], False), (1.0, True)):
                got = drift(p, olds, news, a, backend="triton", decay=dec, config=tf)
                want = drift_reference(p, [x.double() for x in olds], [x.double() for x in news], a, fp64=True)
                if not dec:
                    assert got[1] is None, "decay=False returned a decay piece"
                    got, want = [got[k] for k in (0, 2, 3)], [want[k] for k in (0, 2, 3)]
                T.check_drift(got, want, T.RTOL[torch.float32], f"drift tf32x3 D={D} a={a} decay={dec}")
            status = "ok"
        except AssertionError as e:
            status, failed = f"FAIL {e}", failed + 1
        torch.cuda.synchronize()
        print(f"parity drift tf32x3 D={D} fp32: {status} ({time.perf_counter() - t:.1f} s incl. compile)", flush=True)
    print(f"parity total {time.perf_counter() - t_all:.1f} s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
