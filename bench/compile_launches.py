"""Compile, for a GPU architecture and without a GPU, every kernel variant a CPU test run launches.

``bench.sass`` compiles the hot kernels in the configurations a Llama plan uses on a GPU; the tests
launch many more variants under ``TRITON_INTERPRET=1`` (fp64, fp16, mixed dtypes, D > 128, the
finishing passes, every optimizer), and the interpreter accepts code the compiler refuses (it runs
the Python, it does not lower it).  This closes that gap in two steps::

    # 1. record (kernel, argument types, constexpr values, num_warps) of every launch of a test run
    CONSERVE_RECORD_LAUNCHES=/tmp/launches.json TRITON_INTERPRET=1 \\
        python -m pytest -q -p bench.compile_launches tests/test_kernels.py tests/test_fused_optim.py
    # 2. compile each distinct one for sm_90 with the installed triton's ptxas (interpreter off)
    python -m bench.compile_launches /tmp/launches.json [--arch 90] [--jobs 2]

Step 2 prints one line per variant (registers, spill bytes, shared memory) or the compiler's error,
and exits 1 if any failed or exceeded a hardware limit of the architecture: shared memory per program
(``SMEM_LIMITS``: 232,448 bytes on sm_90, what ``OutOfResources`` names at launch) and register spills
(``MAX_SPILL``: none).  A variant past a limit is a ``FAIL`` line naming the limit, unless ``EXCEPTIONS``
lists it with its reason and a bound (then ``ok*``).  Arguments are typed as Triton's JIT would type them (tensors by
dtype, Python ints as i32 / i64 by range, floats fp32) with 16-divisibility where the recorded pointer /
int was a multiple of 16; ints equal to 1 are not specialised (a compile check, not a replay).

The tests run the CPU tiles (``launch.Tiles.for_device`` on a CPU tensor); the GPU runs ``Tiles.gpu``.
``--all`` records the GPU tiles' covering set instead of a test run (``gpu_tile_cases``: every kernel,
fp32/bf16/fp16/fp64 inputs, fp64 accumulation on and off, head dims 8/16/80/128/192, row blocks,
column blocks and general strides, evaluate/bilinear/DRIFT and the optimizer step kernels, under each
``Config`` the GPU is run with), each case checked against its float64 torch reference under the
interpreter (a child process), then compiles every distinct launch::

    python -m bench.compile_launches --all [--arch 90] [--jobs 2]

(``tests/test_compile_sm90.py`` compiles one launch per kernel, dtypes and mode of the same set.)
Not a timed benchmark.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

_ENV = "CONSERVE_RECORD_LAUNCHES"
_SESSION = None
_TORCH_TYPES = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


# ---------------------------------------------------------------------------------- 1. recording
def _is_constexpr(param) -> bool:
    ann = param.annotation
    return "constexpr" in (ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann)))


def _arg_type(v):
    """``(triton type, divisible by 16)`` of one runtime argument, as the JIT would see it."""
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + _TORCH_TYPES[str(v.dtype).removeprefix("torch.")], v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        return ("i32" if -2**31 <= v < 2**31 else "i64"), v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    raise TypeError(f"bench.compile_launches: cannot type argument {v!r}")


def _record(fn, args, kwargs, seen: dict):
    sig = inspect.signature(fn)
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    types, consts, aligned = {}, {}, []
    for name, p in sig.parameters.items():
        v = bound.arguments[name]
        if _is_constexpr(p) or v is None:
            consts[name] = v
        else:
            types[name], div = _arg_type(v)
            if div:
                aligned.append(name)
    spec = dict(module=fn.__module__, name=fn.__name__, types=types, constexprs=consts, aligned=aligned,
                num_warps=opts.get("num_warps", 4), num_stages=opts.get("num_stages", 3))
    key = json.dumps(spec, sort_keys=True, default=repr)
    seen[key] = seen.get(key, 0) + 1


@contextlib.contextmanager
def recording():
    """Within the block, every interpreter launch's spec is counted in the yielded dict (spec JSON ->
    launches); ``specs(seen)`` lists them.  Needs ``TRITON_INTERPRET=1``."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        _record(self.fn, args, dict(kwargs), seen)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


def specs(seen: dict) -> list:
    return [dict(json.loads(k), launches=n) for k, n in seen.items()]


def pytest_configure(config):  # ``-p bench.compile_launches``: record only when asked
    path = os.environ.get(_ENV)
    if not path:
        return
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit(f"{_ENV} records interpreter launches: set TRITON_INTERPRET=1 as well")
    global _SESSION
    _SESSION = recording()  # held for the whole session: a collected generator would restore the launch
    seen = _SESSION.__enter__()

    def dump():
        out = specs(seen)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=repr)
        print(f"\nbench.compile_launches: {len(out)} distinct launches ({sum(seen.values())} in all) -> {path}",
              file=sys.stderr)

    atexit.register(dump)


# ---------------------------------------------------------------------------------- 2. compiling
def _resolve(module: str, name: str):
    import importlib

    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise LookupError(f"no kernel {name} in {module}")
    return getattr(mod, name)


# Shared memory a program may use (bytes, dynamic + static): the opt-in maximum per block of the
# architecture (``cudaDevAttrMaxSharedMemoryPerBlockOptin``); Triton's launch raises ``OutOfResources``
# past it.  Spilled registers (local memory) are not allowed at all.
SMEM_LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
MAX_SPILL = 0

# Variants allowed past a limit: ``(kernel name, constexpr values the spec must have, the most they may
# use (``spill`` / ``smem`` bytes), reason)``.  Each entry needs its reason written here; a violation
# without one, or past its bound, is a failure.
EXCEPTIONS: list = [
    ("gram_kernel", dict(DRIFT=True), dict(spill=2048),
     "DRIFT pass: four 64 x 64 fp32 accumulators (128 registers per thread of 4 warps) and the fp32 operand "
     "tiles exceed 255 registers; triton 3.8 keeps the rest in local memory.  The tile and warp count are "
     "the Gram kernel's (launch.DRIFT_BT, runner.DRIFT_WARPS)"),
    ("gram_kernel", dict(DRIFT=False, FP64=False, BT=128), dict(spill=1024),
     "evaluate / bilinear 128 x 128 output tile of 8 warps (64 accumulator registers per thread, two for a "
     "term that cannot fold its sign, plus the upcast operands of fp64 inputs): triton 3.8 spills "
     "part of the operand tiles.  The tile is the Gram kernel's (Tiles.BT_MAX, Config.gram_bt)"),
    ("gram_kernel", dict(DRIFT=False, FP64=False, BT=128, UPCAST=True, BILINEAR=True, FOLD=False), dict(spill=10240),
     "bilinear form of mixed (x, y) dtypes: four upcast fp32 operand tiles and two 128 x 128 accumulators of a "
     "term that cannot fold its sign do not fit in registers; the accumulator lives in local memory "
     "(slow, correct).  The tile is the Gram kernel's"),
    ("rowcol_kernel", dict(FP64=False, BS=32, BF=128, BILINEAR=True), dict(spill=128),
     "the default fp32 bilinear norm tiles ([32, 128], 4 warps: x, y and the accumulator, 96 registers of "
     "data per thread) as measured on the GPU: with 2 or 3 stages triton 3.8 spills a few registers"),
    ("rowcol_kernel", dict(FP64=False, BS=32, BF=256, BILINEAR=False, STAGES=3), dict(spill=32),
     "the default fp16 norm tiles ([32, 256], 8 warps, 3 stages, as bf16's): triton 3.8 spills a few "
     "registers of the fp16 -> fp32 conversion"),
    ("step_kernel", dict(FP64=True, STATS=True), dict(spill=512),
     "fp64 statistics: seven [BR, CB] fp64 column-sum accumulators (COLS and LIN) of 4 warps beside the "
     "update; the step tiles are step_runner._tiles'"),
]


def compile_spec(spec: dict, arch: int) -> dict:
    """``{"ok", "regs", "spill", "smem"}`` of the compiled spec, or ``{"ok": False, "error"}`` with the
    compiler's error (``ok`` says only that it compiled; ``limits`` judges the figures)."""
    from bench.sass import compile_kernel

    try:
        fn = _resolve(spec["module"], spec["name"])
        sig = {n: ("constexpr" if n in spec["constexprs"] else spec["types"][n]) for n in fn.arg_names}
        regs, spill, shared, _, _ = compile_kernel(fn, sig, spec["constexprs"], spec["num_warps"], arch,
                                                   spec["num_stages"], aligned=spec["aligned"])
        return dict(ok=True, regs=regs, spill=spill, smem=shared)
    except Exception as e:  # report every failure, keep compiling the others
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return dict(ok=False, error=f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400])


def _exception(spec: dict, res: dict):
    for name, constexprs, bound, reason in EXCEPTIONS:
        if spec["name"] == name and all(spec["constexprs"].get(k) == v for k, v in constexprs.items()) \
                and all(res[k] <= v for k, v in bound.items()):
            return f"{reason} (up to {', '.join(f'{k} {v} B' for k, v in bound.items())})"
    return None


def limits(spec: dict, res: dict, arch: int) -> tuple[list, str | None]:
    """``(violations, reason)``: the hardware limits ``res`` (of ``compile_spec``) exceeds on ``sm_{arch}``,
    each as text naming the limit, and the ``EXCEPTIONS`` reason that allows them (None: they fail)."""
    if not res["ok"]:
        return [], None
    out = []
    smem = SMEM_LIMITS.get(arch)
    if smem is None:
        raise SystemExit(f"bench.compile_launches: no shared-memory limit known for sm_{arch}; add it to SMEM_LIMITS")
    if res["smem"] > smem:
        out.append(f"shared memory {res['smem']} B > limit {smem} B (sm_{arch})")
    if res["spill"] > MAX_SPILL:
        out.append(f"spill {res['spill']} B > limit {MAX_SPILL} B")
    return out, (_exception(spec, res) if out else None)


def _label(spec: dict) -> str:
    ce = " ".join(f"{k}={v}" for k, v in spec["constexprs"].items() if v is not None)
    dts = sorted({t for t in spec["types"].values() if t.startswith("*") and t not in ("*i64", "*i32")})
    return f"{spec['name']} w{spec['num_warps']} {','.join(dts)} {ce}"


def compile_all(specs: list, arch: int = 90, jobs: int = 2) -> int:
    """Compile ``specs`` for ``sm_{arch}`` in ``jobs`` processes, print one line each and a summary line
    (``N compiled, F failed``: a compiler error or a limit without an exception); returns F."""
    import triton

    print(f"sm_{arch}, triton {triton.__version__}: {len(specs)} distinct launches of "
          f"{sum(s.get('launches', 1) for s in specs)} recorded; limits: shared memory {SMEM_LIMITS.get(arch)} B, "
          f"spill {MAX_SPILL} B", flush=True)
    failed = allowed = 0
    with ProcessPoolExecutor(max(1, jobs)) as ex:
        for spec, res in zip(specs, ex.map(compile_spec, specs, [arch] * len(specs))):
            bad, reason = limits(spec, res, arch)
            if res["ok"]:
                text = f"regs {res['regs']:>3} spill {res['spill']:>4} smem {res['smem'] / 1024:6.1f} KiB"
            else:
                text = res["error"]
            tail = ""
            if not res["ok"] or (bad and reason is None):
                failed += 1
                tag = "FAIL"
                if bad:
                    tail = " -- " + "; ".join(bad)
            elif bad:
                allowed += 1
                tag = "ok* "
                tail = f" -- {'; '.join(bad)}; allowed: {reason}"
            else:
                tag = "ok  "
            print(f"{tag} {text:<40} {_label(spec)}{tail}", flush=True)
    print(f"{len(specs) - failed} compiled, {failed} failed" + (f" ({allowed} past a limit by an exception)"
                                                               if allowed else ""), flush=True)
    return failed


# ---------------------------------------------------------------------------------- 3. the GPU tiles
# The ``Config`` switches a GPU runs with (default; bench/gpu_check.sh's A/B switches; every norm_stages).
GPU_CONFIGS = {"default": {}, "tf32x3": dict(input_precision="tf32x3"), "bt64": dict(gram_bt=64),
               "stages1": dict(norm_stages=1), "stages2": dict(norm_stages=2), "stages4": dict(norm_stages=4)}
DTYPES = ("float32", "bfloat16", "float16", "float64")
HEAD_DIMS = (8, 16, 80, 128, 192)


@contextlib.contextmanager
def gpu_tiles(sms: int = 132):
    """Within the block every prepared plan gets ``Tiles.gpu(sms, config)``, whatever its device (the
    plan cache is cleared on entry and exit)."""
    from conserve.kernels import launch, runner

    saved = vars(launch.Tiles)["for_device"]
    launch.Tiles.for_device = staticmethod(lambda device, config=None: launch.Tiles.gpu(sms, config))
    runner.clear_cache()
    try:
        yield
    finally:
        launch.Tiles.for_device = saved
        runner.clear_cache()


def _block(D: int, dtype, seed: int):
    """``(plan, tensors)``: one Gram slot of head size ``D`` over two row blocks (layout 0, signs 1 and
    -0.5), a column block (layout 1), a doubly strided slice (layout 2) and a bias, contracted over
    ``K = 40`` columns (less than one contracted block: masked); row norms of the row blocks and of the
    strided slice, column norms of the whole row tensor (``H = 300`` columns: several column tiles, the
    last one masked), column sums of the column tensor."""
    import torch
    from conserve.kernels import GramTerm, NormTerm, Plan, SumTerm, View

    g = torch.Generator().manual_seed(seed)
    H, K = 300, 40
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    ts = [rnd(2 * D, H), rnd(H, 2 * D), rnd(3 * D, 3 * K)[::3, ::3], rnd(D)]
    p = Plan()
    s = p.new_gram(D)
    p.grams += [GramTerm(View(0, (0, 0), 0, D, 1, K), 1.0, s), GramTerm(View(0, (D, 0), 0, D, 1, K), -0.5, s),
                GramTerm(View(1, (0, D), 1, D, 0, K), -1.0, s), GramTerm(View(2, (0, 0), 0, D, 1, K), 1.0, s),
                GramTerm(View(3, (0,), 0, D, None, 1), 1.0, s)]
    u = p.new_vec(D)
    p.norms += [NormTerm(View(0, (0, 0), 0, D, 1, H), 1.0, u), NormTerm(View(0, (D, 0), 0, D, 1, H), -1.0, u),
                NormTerm(View(2, (0, 0), 0, D, 1, K), 0.5, u)]
    c = p.new_vec(H)
    p.norms.append(NormTerm(View(0, (0, 0), 1, H, 0, 2 * D), -1.0, c))
    p.sums.append(SumTerm(View(1, (0, 0), 1, 2 * D, 0, H), 1.0, c))
    return p, ts


def _abs(plan):
    import dataclasses

    from conserve.kernels import Plan

    return Plan(grams=[dataclasses.replace(t, sign=abs(t.sign)) for t in plan.grams],
                norms=[dataclasses.replace(t, sign=abs(t.sign), shift=abs(t.shift)) for t in plan.norms],
                sums=[dataclasses.replace(t, sign=abs(t.sign)) for t in plan.sums],
                vec_size=plan.vec_size, gram_slots=dict(plan.gram_slots))


def _close(got, want, scale, rtol: float, what: str):
    """``|got - want| <= rtol * scale`` entrywise (``scale``: the reference of the plan with |signs|)."""
    got, want, scale = got.double(), want.double(), scale.double()
    assert got.shape == want.shape, what
    err = (got - want).abs()
    bad = err > rtol * scale + 1e-300
    assert not bad.any(), f"{what}: max err {err.max().item():.3e} > {rtol} x scale (max {scale.max().item():.3e})"


def _rtol(dtypes, fp64: bool) -> float:
    """float64 accumulation: 1e-12 (every input is widened exactly); fp32: 1e-5, with a half input 1e-4."""
    import torch

    if fp64:
        return 1e-12
    return 1e-4 if {torch.bfloat16, torch.float16} & set(dtypes) else 1e-5


def _run_forms(D, dtype, fp64, config, ydtype=None, seed=0):
    """evaluate and bilinear of ``_block`` against ``evaluate_reference`` / ``bilinear_reference`` in float64."""
    import torch
    from conserve.kernels import bilinear, bilinear_reference, evaluate, evaluate_reference

    p, ts = _block(D, dtype, seed)
    ys = [(t.double() + torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 1),
                                    dtype=torch.float64)).to(ydtype or dtype) for t in ts]
    d64, y64 = [t.double() for t in ts], [y.double() for y in ys]
    ap = _abs(p)
    rtol = _rtol([dtype, ydtype or dtype], fp64)
    forms = [("evaluate", evaluate(p, ts, fp64=fp64, backend="triton", config=config),
              evaluate_reference(p, d64, fp64=True), evaluate_reference(ap, [t.abs() for t in d64], fp64=True)),
             ("bilinear", bilinear(p, ts, ys, fp64=fp64, backend="triton", config=config),
              bilinear_reference(p, d64, y64, fp64=True),
              bilinear_reference(ap, [t.abs() for t in d64], [y.abs() for y in y64], fp64=True))]
    for what, (vec, grams), (rv, rg), (sv, sg) in forms:
        assert vec.dtype == (torch.float64 if fp64 else torch.float32), what
        _close(vec, rv, sv, rtol, f"{what} vec")
        for d in rg:
            _close(grams[d], rg[d], sg[d], rtol, f"{what} gram D={d}")


def _run_check(D, dtype, fp64, config, seed=0):
    """``check_sums`` (the gradient check's one CHECK pass) of ``_block`` plus a shifted norm, against the torch
    twin ``check_reference`` in float64 (Gram planes: the bilinear form and the diagonal row norms)."""
    import torch
    from conserve.kernels import NormTerm, View, check_sums
    from conserve.kernels.checksums import check_reference

    p, ts = _block(D, dtype, seed)
    u = p.new_vec(D)
    p.norms.append(NormTerm(View(3, (0,), 0, D, None, 1), 1.0, u, 1, 1.0))  # a Gemma-style (1 + w) gain
    g = torch.Generator().manual_seed(seed + 3)
    ys = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in ts]
    vec, grams = check_sums(p, ts, ys, fp64=fp64, backend="triton", config=config)
    d64 = lambda a: [t.double() for t in a]  # noqa: E731
    rv, rg = check_reference(p, d64(ts), d64(ys), fp64=True)
    sv, sg = check_reference(_abs(p), [t.abs() for t in d64(ts)], [y.abs() for y in d64(ys)], fp64=True)
    rtol = _rtol([dtype], fp64)
    assert vec.dtype == (torch.float64 if fp64 else torch.float32)
    _close(vec, rv, sv, rtol, "check vec")
    for d in rg:
        _close(grams[d], rg[d], sg[d], rtol, f"check gram D={d}")


def _run_drift(D, dtype, fp64, config, seed=0, both=True):
    """``drift`` (DRIFT pass, or with ``fp64`` the composition over float64 ``a old`` and ``Delta``) of
    ``_block`` against ``drift_reference`` in float64: a != 1 with the decay, and (``both``) a == 1
    without it."""
    import torch
    from conserve.kernels import drift, drift_reference

    p, olds = _block(D, dtype, seed)
    g = torch.Generator().manual_seed(seed + 2)
    news = [(o.double() + 0.3 * torch.randn(o.shape, generator=g, dtype=torch.float64)).to(dtype) for o in olds]
    news[2] = news[2].contiguous()  # other strides than olds[2]
    d64 = lambda ts: [t.double() for t in ts]  # noqa: E731
    rtol = _rtol([dtype], fp64)
    for a, decay in (([0.9, 0.8, 0.95, 0.7], True), (1.0, False))[:2 if both else 1]:
        got = drift(p, olds, news, a, fp64=fp64, backend="triton", decay=decay, config=config)
        want = drift_reference(p, d64(olds), d64(news), a, fp64=True, decay=decay)
        for k, (gp, wp) in enumerate(zip(got, want)):
            assert (gp is None) == (wp is None), k
            if wp is None:
                continue
            for x, y in [(gp[0], wp[0])] + [(gp[1][d], wp[1][d]) for d in wp[1]]:
                scale = y.abs().max().item() if y.numel() else 0.0
                err = (x.double() - y.double()).abs().max().item() if y.numel() else 0.0
                assert err <= rtol * scale, f"drift piece {k}: err {err:.3e} > {rtol} x {scale:.3e}"


def _run_step(dtype, algo: str, stats, seed=0):
    """``optim_step.step_triton`` with its GPU tiles (``interpret=False``: ``step_runner._tiles`` of a GPU) against
    ``step_reference`` and ``stats_reference`` (float64): tensors with several row and column blocks, a
    masked tail, a 3-D tensor, a vector, and one whose column count is not a multiple of a 16-byte
    vector (the ALIGN=1 launch); every stats kind, or rows only, or none."""
    import torch
    from conserve.kernels import optim_step as K

    shapes = [(300, 260), (2, 40, 256), (260,), (33, 7)]
    g = torch.Generator().manual_seed(seed)
    rnd = lambda sh, s=1.0: (torch.randn(sh, generator=g) * s).to(dtype)  # noqa: E731
    h = (K.Hyper("adam", lr=1e-2, weight_decay=0.1) if algo == "adam" else
         K.Hyper("sgd", lr=1e-2, weight_decay=0.1, momentum=0.9, nesterov=True) if algo == "sgd_nesterov" else
         K.Hyper("sgd", lr=1e-2, weight_decay=0.1))
    P, G = [rnd(sh) for sh in shapes], [rnd(sh) for sh in shapes]
    M = [rnd(sh, 0.1) for sh in shapes] if algo != "sgd" else None
    V = [rnd(sh).abs() * 0.1 for sh in shapes] if algo == "adam" else None
    reqs, n = [], 0
    for sh in shapes:
        B, R, C = K.matrix_shape(sh)
        if stats == "rows":
            reqs.append(K.StatsRequest(row_q=n))
            n += B * R
        else:
            reqs.append(K.StatsRequest(n, n + B * R, n + 2 * B * R, n + 2 * B * R + B * C))
            n += 2 * B * R + 2 * B * C
    S = None if stats is None else torch.zeros(K.NQ, n, dtype=torch.float64 if stats != "fp32" else torch.float32)
    old = [p.clone() for p in P]
    P2, G2 = [p.clone() for p in P], [x.clone() for x in G]
    M2, V2 = ([t.clone() for t in M] if M else None), ([t.clone() for t in V] if V else None)
    none = [None] * len(shapes)
    K.step_triton(h, P, G, M or none, V or none, [3.0] * len(shapes), reqs if S is not None else
                  [K.StatsRequest()] * len(shapes), S, interpret=False)
    K.step_reference(h, P2, G2, M2 or none, V2 or none, [3.0] * len(shapes))
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(P + (M or []) + (V or []), P2 + (M2 or []) + (V2 or [])):
        err = (a.double() - b.double()).abs()
        assert (err <= tol * (1 + b.double().abs())).all(), f"step {algo} {dtype}: max err {err.max().item():.3e}"
    if S is not None:
        S2 = torch.zeros(K.NQ, n, dtype=torch.float64)
        for o, p, r in zip(old, P, reqs):
            K.stats_reference(o, p, h.a, r, S2)
        # of the largest entry of each quantity; fp32: the kernel forms the drift quantities from fp32 products
        rtol = 1e-12 if S.dtype == torch.float64 else 1e-4
        _close(S, S2, S2.abs().amax(dim=1, keepdim=True).expand_as(S2), rtol, f"step stats {algo} {dtype} {stats}")


def gpu_tile_cases(full: bool = True) -> list:
    """``[(label, run)]``: the covering set of launches with the GPU tiles, each ``run()`` checking its
    values against the float64 torch reference (run inside ``gpu_tiles()`` under the interpreter).

    ``full``: every head dim of ``HEAD_DIMS`` x input dtype x fp64 accumulation, evaluate, bilinear and
    drift (fp64 drift: the composition over float64 tensors, whose launches are those of float64 inputs
    with fp64 accumulation, at D = 8), under the default Config; the other Configs of ``GPU_CONFIGS``
    where they change a launch (tf32x3: fp32 Gram dots; gram_bt 64: the Gram tiles; norm_stages: the
    norm kernel); a mixed (bf16, fp32) bilinear group; the step kernel for every dtype x algorithm x
    stats kind.  Otherwise the subset ``tests/test_compile_sm90.py`` runs: one case per kernel, dtype and
    mode (D = 80, fp64 accumulation at D = 8 but for fp32 inputs, drift with a != 1 only, the step
    kernel for Adam)."""
    import functools

    import torch
    from conserve.kernels import Config

    f32, bf16, f16, f64 = (getattr(torch, d) for d in DTYPES)
    name = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
    out = []

    def forms(cname, D, dt, fp64, ydt=None):
        out.append((f"{cname} D={D} {name(dt)}{' x ' + name(ydt) if ydt else ''} fp64={fp64} evaluate+bilinear",
                    functools.partial(_run_forms, D, dt, fp64, Config(**GPU_CONFIGS[cname]), ydt)))

    def check(cname, D, dt, fp64):
        out.append((f"{cname} D={D} {name(dt)} fp64={fp64} check",
                    functools.partial(_run_check, D, dt, fp64, Config(**GPU_CONFIGS[cname]))))

    def drift(cname, D, dt, fp64):
        out.append((f"{cname} D={D} {name(dt)} fp64={fp64} drift",
                    functools.partial(_run_drift, D, dt, fp64, Config(**GPU_CONFIGS[cname]), both=full)))

    dts = (f32, bf16, f16, f64)
    if full:
        for D in HEAD_DIMS:
            for dt in dts:
                for fp64 in (False, True):
                    forms("default", D, dt, fp64)
                    check("default", D, dt, fp64)
                drift("default", D, dt, False)
        for dt in dts:
            drift("default", 8, dt, True)
        for D in (8, 80, 192):
            forms("tf32x3", D, f32, False)
            drift("tf32x3", D, f32, False)
        for D in (80, 192):
            for dt in dts:
                for fp64 in (False, True):
                    forms("bt64", D, dt, fp64)
        for cname in ("stages1", "stages2", "stages4"):
            for dt in dts:
                for fp64 in (False, True):
                    forms(cname, 8, dt, fp64)
        steps = [(dt, algo, stats) for dt in (f32, bf16, f16) for algo in ("adam", "sgd", "sgd_nesterov")
                 for stats in (None, "rows", "fp32", "fp64")]
    else:
        for dt in dts:
            forms("default", 80, dt, False)
            forms("default", 80 if dt == f32 else 8, dt, True)
            check("default", 80, dt, False)
            check("default", 80 if dt == f32 else 8, dt, True)
        check("default", 192, f32, False)  # off-diagonal Gram tiles of the CHECK mode
        for dt in (f32, bf16, f16):
            drift("default", 80, dt, False)
        drift("default", 8, f32, True)  # the tracker's fp64 drift: bilinear of float64 a old, Delta
        forms("tf32x3", 80, f32, False)
        drift("tf32x3", 80, f32, False)
        forms("stages4", 8, f32, False)
        forms("stages4", 8, f64, True)
        steps = [(f32, "adam", None), (f32, "adam", "fp32"), (f32, "adam", "fp64"), (bf16, "adam", "fp64"),
                 (f16, "adam", "fp32")]
    forms("default", 80, bf16, False, f32)  # mixed (x, y) dtypes of a bilinear form: fp32 dots of upcast tiles
    for dt, algo, stats in steps:  # the step kernel stores fp32 / bf16 / fp16 parameters
        out.append((f"step {algo} {name(dt)} stats={stats}", functools.partial(_run_step, dt, algo, stats)))
    return out


def record_gpu_tiles(full: bool = True, verbose: bool = False) -> list:
    """Run ``gpu_tile_cases(full)`` with the GPU tiles under the interpreter (values checked) and return
    the distinct launch specs."""
    import time

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("bench.compile_launches: the GPU tiles' cases run under the interpreter: "
                         "set TRITON_INTERPRET=1")
    with gpu_tiles(), recording() as seen:
        for label, run in gpu_tile_cases(full):
            t0 = time.perf_counter()
            run()
            if verbose:
                print(f"  {time.perf_counter() - t0:5.1f} s  {label}", file=sys.stderr, flush=True)
    out = {}
    for s in specs(seen):
        s = as_gpu(s)
        key = json.dumps({k: v for k, v in s.items() if k != "launches"}, sort_keys=True, default=repr)
        if key in out:
            out[key]["launches"] += s["launches"]
        else:
            out[key] = s
    return list(out.values())


def as_gpu(spec: dict) -> dict:
    """``spec`` as a GPU launches it: ``gram_kernel``'s UPCAST without the interpreter's bf16 upcast
    (``runner._upcast(group, interpret=False)``: mixed x/y dtypes or a float64 input only)."""
    if spec["name"] != "gram_kernel":
        return spec
    xb, yb = spec["types"]["xb"], spec["types"]["yb"]
    return dict(spec, constexprs=dict(spec["constexprs"], UPCAST=xb != yb or "*fp64" in (xb, yb)))


def covering(specs: list) -> list:
    """One spec per (kernel, pointer dtypes, mode): the mode constexprs (BILINEAR, DRIFT, DECAY, CHECK, FP64,
    PREC, STATS, COLS, LIN, LOWP, ALGO); of several, the one with the largest tiles and stages
    (shared memory and registers grow with them), an off-diagonal Gram tile (two row blocks) before a
    diagonal one."""
    mode = ("BILINEAR", "DRIFT", "DECAY", "CHECK", "FP64", "PREC", "STATS", "COLS", "LIN", "LOWP", "ALGO")
    size = ("STAGES", "BT", "BF", "BS", "BK", "CB", "BR", "RB", "BC", "BO", "D")
    best = {}
    for s in specs:
        ce = s["constexprs"]
        key = (s["name"], tuple(sorted(set(s["types"].values()))), tuple(repr(ce.get(k)) for k in mode),
               ce.get("SINGLE") if ce.get("CHECK") else None)  # CHECK: the diagonal tiles add the row norms
        rank = (tuple(int(ce.get(k) or 0) for k in size), not ce.get("SINGLE", False), json.dumps(s, sort_keys=True))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, s)
    return [s for _, s in sorted(best.values(), key=lambda v: v[0][2])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("launches", nargs="?", help="JSON written by a recorded test run (see the module docstring)")
    ap.add_argument("--all", action="store_true", help="record the GPU tiles' covering set (``gpu_tile_cases``) "
                    "in a child process under the interpreter, then compile every distinct launch")
    ap.add_argument("--covering", action="store_true", help="with --all: the test's subset (one launch per "
                    "kernel, dtypes and mode)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel (processes)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("bench.compile_launches compiles real kernels: unset TRITON_INTERPRET")
    if args.all == bool(args.launches):
        ap.error("give a launches JSON or --all")
    if args.all:
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "launches.json")
            code = ("import json, sys; from bench.compile_launches import record_gpu_tiles; "
                    f"json.dump(record_gpu_tiles(full={not args.covering}, verbose=True), open(sys.argv[1], 'w'), "
                    "default=repr)")
            subprocess.run([sys.executable, "-c", code, path], env=dict(os.environ, TRITON_INTERPRET="1"),
                           check=True)
            with open(path) as f:
                specs = json.load(f)
        if args.covering:
            specs = covering(specs)
    else:
        with open(args.launches) as f:
            specs = json.load(f)
    return 1 if compile_all(specs, args.arch, args.jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
