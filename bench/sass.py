"""Offline compile of the hot kernels for a GPU architecture, without a GPU: registers, spills, shared
memory, load widths and barriers of the SASS that ``ptxas`` produces (not a timed benchmark).

    python -m bench.sass                      # every hot kernel, sm_90 (H100/H200)
    python -m bench.sass --kernels step,norm  # a subset; --arch 80 for A100

What it is for: a session without a GPU can still see whether a kernel's loads vectorise (``LDG.E.128``
vs scalar ``LDG.E``), whether it spills (``local`` bytes), how many programs fit on an SM
(registers x threads against the 64K-register file, shared memory against 228 KiB) and how many
barriers a program crosses -- the causes found this way in this project: scalar loads in the
optimizer step kernel (offsets without alignment hints), cross-warp row reductions in the norm kernel
(two warps per row), 255-register Gram programs.  It cannot say how fast a kernel runs; measure that
with ``bench/kernels.py`` / ``bench/fused_optim.py`` on the GPU.

The kernels are compiled as Triton's JIT would for 16-byte aligned pointer arguments, with the
block sizes ``conserve.kernels`` picks on a 132-SM GPU (``launch.Tiles.gpu``, ``step_runner._tiles``).
Uses triton's bundled ``ptxas`` and ``cuobjdump`` (``triton/backends/nvidia/bin``).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.compiler import ASTSource

REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
MAX_WARPS_PER_SM = 64
_OPS = re.compile(r"\b(LDGSTS(?:\.\w+)*|LDG\.E(?:\.\w+)*|STG\.E(?:\.\w+)*|BAR\.SYNC|SHFL\.BFLY|HGMMA|HMMA|FFMA)\b")


@dataclass
class Report:
    kernel: str
    config: str
    warps: int
    regs: int
    spill: int  # local memory bytes per thread (spills and stack frame)
    shared: int  # bytes per program (dynamic + static)
    ops: dict

    @property
    def programs_per_sm(self) -> int:
        threads = 32 * self.warps
        regs = -(-self.regs // 8) * 8  # allocation granularity
        by_regs = REGS_PER_SM // max(1, regs * threads)
        by_smem = SMEM_PER_SM // max(1, self.shared) if self.shared else 99
        return max(0, min(by_regs, by_smem, MAX_WARPS_PER_SM // self.warps))

    def loads(self) -> str:
        """Global load instructions: 16-byte vectors / narrower (``LDGSTS``: cp.async to shared memory)."""
        v = sum(n for k, n in self.ops.items() if k.startswith("LDG") and k.endswith(".128"))
        s = sum(n for k, n in self.ops.items() if k.startswith("LDG") and not k.endswith((".128", ".64")))
        return f"{v} x128b / {s} scalar"


def _tools():
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tool = os.path.join(d, "cuobjdump")
    if not os.path.exists(tool):
        raise SystemExit(f"cuobjdump not found in {d}: this triton build has no bundled CUDA tools")
    return tool


def compile_kernel(fn, sig: dict, constexprs: dict, warps: int, arch: int = 90, stages: int = 3,
                   aligned=None) -> tuple:
    """``(regs, spill bytes, shared bytes, SASS op counts, SASS text)`` of ``fn`` compiled for ``sm_{arch}``.
    Spill bytes: local memory per thread, the stack frame included (ptxas can report a kernel that keeps
    its accumulator in local memory as 32 registers, a stack frame of kilobytes and ``LOCAL:0``).

    ``sig``: every argument name -> Triton type (``"*fp32"``, ``"i64"``, ``"fp32"``, ``"constexpr"``), in
    the kernel's order; ``aligned``: the argument names the JIT would mark divisible by 16 (default:
    every pointer, i.e. 16-byte aligned tensors)."""
    from triton.backends.compiler import GPUTarget

    names = list(sig)
    if aligned is None:
        aligned = [n for n in names if sig[n].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        tool = _tools()
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", res)
    ops = dict(collections.Counter(_OPS.findall(sass)))
    return int(m[1]), int(m[2]) + int(m[4]), int(k.metadata.shared) + int(m[3]), ops, sass


def _sig(fn, types: dict, constexprs: dict) -> dict:
    """Signature in argument order: ``types`` for runtime arguments, 'constexpr' for the others."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            raise KeyError(f"bench.sass: no type given for argument {name!r} of {fn.__name__}")
    return sig


def cases(kernels):
    """``(name, config, fn, types, constexprs, warps)`` for the kernels the Llama plans launch."""
    from conserve.kernels import gram, norms, step, step_runner
    from conserve.kernels.launch import Tiles

    import torch

    cfg = Tiles.gpu()
    t = {"fp32": "*fp32", "bf16": "*bf16"}
    out = []
    if "norm" in kernels:
        for dt, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for bil, check in ((False, False), (True, False), (True, True)):
                BF, warps = cfg.norm_tile((tdt, tdt), bil, check=check)
                types = {"xb": t[dt], "yb": t[dt], "regions": "*i64", "shifts": "*fp32", "items": "*i64",
                         "part": "*fp32", "pplane": "i64"}
                ce = dict(BS=cfg.BS, BF=BF, ALIGN=16, BILINEAR=bil, FP64=False, STAGES=cfg.norm_stages, CHECK=check)
                what = " check" if check else " bilinear" if bil else ""
                out.append(("rowcol", f"{dt} [{cfg.BS},{BF}] x{cfg.norm_stages}{what}", norms.rowcol_kernel,
                            types, ce, warps))
    if "gram" in kernels:
        from conserve.kernels.launch import DRIFT_BK, DRIFT_BT, gram_bk
        from conserve.kernels.runner import DRIFT_WARPS

        gtypes = {"terms": "*i64", "signs": "*fp32", "items": "*i64", "part": "*fp32", "factors": "*fp32",
                  "plane": "i64"}
        for dt in ("fp32", "bf16"):
            tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
            for D, BT, warps in ((128, 128, 8), (64, 64, 4)):
                for bil, check in ((False, False), (True, False), (True, True)):
                    BK = gram_bk(cfg, BT, (tdt, tdt), 3 if check else 2 if bil else 1)
                    ce = dict(D=D, BT=BT, BK=BK, ALIGN=16, SINGLE=D == BT, BILINEAR=bil, FP64=False, UPCAST=False,
                              FOLD=True, PREC="ieee", DRIFT=False, DECAY=False, CHECK=check)
                    what = " check" if check else " bilinear" if bil else ""
                    if check and dt == "bf16":  # runner.gram_meta: the half-precision check pass is not pipelined
                        ce["num_stages"], what = 1, what + " stages 1"
                    out.append(("gram", f"{dt} D={D} BT={BT} BK={BK}{what}",
                                gram.gram_kernel, dict(gtypes, xb=t[dt], yb=t[dt]), ce, warps))
            # the DRIFT pass with the decay dot, without it (decay=False or every a == 1), and (fp32)
            # with 3xTF32 tensor-core dots (Config(input_precision="tf32x3"))
            variants = [(True, "ieee", "a!=1"), (False, "ieee", "no decay")]
            if dt == "fp32":
                variants.append((False, "tf32x3", "no decay tf32x3"))
            for dec, prec, what in variants:
                ce = dict(D=128, BT=DRIFT_BT, BK=DRIFT_BK, ALIGN=16, SINGLE=False, BILINEAR=True, FP64=False,
                          UPCAST=False, FOLD=True, PREC=prec, DRIFT=True, DECAY=dec, CHECK=False)
                out.append(("gram drift", f"{dt} D=128 BT={DRIFT_BT} BK={DRIFT_BK} {what}", gram.gram_kernel,
                            dict(gtypes, xb=t[dt], yb=t[dt]), ce, DRIFT_WARPS))
    if "step" in kernels:
        for dt, lowp, es in (("fp32", 0, 4), ("bf16", 1, 2)):
            CB, BR, RB = step_runner._tiles(4096, es, interpret=False)
            for stats, cols in ((False, False), (True, False), (True, True)):
                types = {"base": t[dt], "tensors": "*i64", "scal": "*fp32", "progs": "*i64", "part": "*fp32",
                         "NP": "i64"}
                types.update({n: "fp32" for n in ("neg_lr", "decay", "wd", "a", "a2m1", "am1", "w1", "beta2",
                                                  "omb2", "eps", "momentum", "omd")})
                ce = dict(ALGO=0, DECOUPLED=True, MAXIMIZE=False, HAS_WD=True, HAS_MOM=False, NESTEROV=False,
                          LOWP=lowp, STATS=stats, COLS=cols, LIN=False, FP64=False, RB=RB, BR=BR, CB=CB,
                          ALIGN=16 // es)
                what = "untracked" if not stats else ("row stats" if not cols else "row+col stats")
                out.append(("adamw step", f"{dt} [{BR},{CB}] {what}", step.step_kernel, types, ce, 4))
    return out


def main(argv=None) -> list[Report]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="norm,gram,step", help="comma list of norm, gram, step")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("bench.sass compiles real kernels: unset TRITON_INTERPRET (the interpreter's functions "
                         "cannot be compiled)")
    wanted = {k.strip() for k in args.kernels.split(",") if k.strip()}
    if not wanted or wanted - {"norm", "gram", "step"}:
        raise SystemExit(f"--kernels {args.kernels!r}: use a comma list of norm, gram, step")
    reports = []
    print(f"sm_{args.arch}, triton {triton.__version__}")
    print(f"{'kernel':<11} {'config':<34} {'warps':>5} {'regs':>4} {'spill':>5} {'smem KiB':>8} "
          f"{'prog/SM':>7} {'loads':>22} {'bar':>4} {'shfl':>4}")
    for name, config, fn, types, ce, warps in cases(wanted):
        stages = ce.pop("num_stages", 3)
        regs, spill, shared, ops, _ = compile_kernel(fn, _sig(fn, types, ce), ce, warps, args.arch, stages)
        r = Report(name, config, warps, regs, spill, shared, ops)
        reports.append(r)
        print(f"{name:<11} {config:<34} {warps:>5} {regs:>4} {spill:>5} {shared / 1024:>8.1f} "
              f"{r.programs_per_sm:>7} {r.loads():>22} {ops.get('BAR.SYNC', 0):>4} {ops.get('SHFL.BFLY', 0):>4}",
              flush=True)
    return reports


if __name__ == "__main__":
    main()
