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
and exits 1 if any failed.  Arguments are typed as Triton's JIT would type them (tensors by dtype,
Python ints as i32 / i64 by range, floats fp32) with 16-divisibility where the recorded pointer /
int was a multiple of 16; ints equal to 1 are not specialised (a compile check, not a replay).
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
    if hasattr(mod, name):
        return getattr(mod, name)
    # optim_step defines its kernels on first use (``_kernels()`` returns them)
    found = [k for k in (mod._kernels() if hasattr(mod, "_kernels") else ()) if k.fn.__name__ == name]
    if not found:
        raise LookupError(f"no kernel {name} in {module}")
    return found[0]


def compile_spec(spec: dict, arch: int) -> tuple:
    """``(ok, text)``: registers / spill / shared memory of the compiled spec, or the compiler's error."""
    from bench.sass import compile_kernel

    try:
        fn = _resolve(spec["module"], spec["name"])
        sig = {n: ("constexpr" if n in spec["constexprs"] else spec["types"][n]) for n in fn.arg_names}
        regs, spill, shared, _, _ = compile_kernel(fn, sig, spec["constexprs"], spec["num_warps"], arch,
                                                   spec["num_stages"], aligned=spec["aligned"])
        return True, f"regs {regs:>3} spill {spill:>4} smem {shared / 1024:6.1f} KiB"
    except Exception as e:  # report every failure, keep compiling the others
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        return False, f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def _label(spec: dict) -> str:
    ce = " ".join(f"{k}={v}" for k, v in spec["constexprs"].items() if v is not None)
    dts = sorted({t for t in spec["types"].values() if t.startswith("*") and t not in ("*i64", "*i32")})
    return f"{spec['name']} w{spec['num_warps']} {','.join(dts)} {ce}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("launches", help="JSON written by a recorded test run (see the module docstring)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel (processes)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("bench.compile_launches compiles real kernels: unset TRITON_INTERPRET")
    import triton

    with open(args.launches) as f:
        specs = json.load(f)
    print(f"sm_{args.arch}, triton {triton.__version__}: {len(specs)} distinct launches of "
          f"{sum(s['launches'] for s in specs)} recorded", flush=True)
    failed = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:
        for spec, (ok, text) in zip(specs, ex.map(compile_spec, specs, [args.arch] * len(specs))):
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {text:<40} {_label(spec)}", flush=True)
    print(f"{len(specs) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
