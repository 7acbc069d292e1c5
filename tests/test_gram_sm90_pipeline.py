"""What only the compiled GPU Gram kernel does, checked without a GPU.

1. Shared-memory races of the sm_90 software pipeline.  On the GPU, ``tl.dot`` of bf16/fp16 tiles is
   an asynchronous wgmma that reads its operands from shared memory, and the loop pipeliner fills the
   next k blocks with ``cp.async`` copies into a ring of buffers.  A copy into a buffer that a wgmma
   still in flight reads corrupts that dot (a race: the error changes from run to run).  The
   interpreter runs neither (it upcasts bf16 tiles, ``runner._upcast``, and has no shared memory), so
   every ``gram_kernel`` configuration that real plans launch on a GPU (``launch.Tiles.gpu``,
   ``runner.gram_meta``) is compiled here to sm_90 TTGIR (``triton.compile`` stages up to ``ttgir``,
   no ptxas) and its pipelined loops are checked by ``pipeline_races``.  The pattern this found: a
   diagonal output tile (SINGLE: one loaded tile is both dot operands) whose left operand was a
   sign-multiplied copy got 2 buffers for 2 prefetched blocks while the right operand was read from
   the buffer itself by a wgmma left pending, so the next copy overwrote it (triton 3.6 and 3.8).
2. The ``tl.multiple_of`` hints of the Gram kernel (offsets, slow strides, ``k0``) hold for the GPU
   tiles of real plans (a false hint is a no-op in the interpreter).

Run directly (``python tests/test_gram_sm90_pipeline.py specs.json``) it compiles the specs of a JSON
file and prints one JSON line per spec; the test runs it in a fresh process without
``TRITON_INTERPRET``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------ the race check
_ALLOC = re.compile(r"^(\s*)(%[\w.]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x[^>]*mutable>")
_VIEW = re.compile(r"^\s*(%[\w.]+) = ttg\.memdesc_\w+ (%[\w.]+)")
_COPY = re.compile(r"ttg\.async_copy_global_to_local %[\w.#]+, (%[\w.]+)")
_DOT = re.compile(r"ttng\.warp_group_dot (%[\w.#]+), (%[\w.#]+), ")
_WAIT = re.compile(r"ttng\.warp_group_dot_wait .*\{pendings = (\d+) : i32\}")
_FOR = re.compile(r"^\s*\S.*= scf\.for ")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def pipeline_races(ttgir: str) -> list[str]:
    """Races between the ``cp.async`` ring of a pipelined loop and the asynchronous wgmmas reading it.

    For every mutable multi-buffer ``ttg.local_alloc`` (``N`` buffers) followed, in the same block,
    by an ``scf.for`` that copies into it: ``P`` = the copies issued before the loop (prefetched
    blocks); iteration ``i`` reads buffer ``i % N`` and its copies write buffer ``(i + P) % N`` (the
    pipeliner's ring).  The loop body is replayed for a few iterations with a queue of the
    ``warp_group_dot {isAsync}`` in flight (a ``warp_group_dot_wait {pendings = k}`` leaves the last
    ``k``); a dot reads the ring if an operand is a view (``memdesc_index/trans/subslice``) of it.
    A copy into the buffer that a dot in flight reads is reported (one line per loop)."""
    lines = ttgir.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _ALLOC.match(line)
        if not m:
            continue
        ind, ring, nbuf = len(m[1]), m[2], int(m[3])
        j = next((q for q in range(i + 1, len(lines)) if _FOR.match(lines[q]) and _indent(lines[q]) == ind), None)
        if j is None:
            continue
        end = next((q for q in range(j + 1, len(lines)) if lines[q].strip() and _indent(lines[q]) <= ind),
                   len(lines))
        views = {ring}

        def see(ln):
            v = _VIEW.match(ln)
            if v and v[2] in views:
                views.add(v[1])

        prefetched = 0
        for ln in lines[i + 1:j]:
            see(ln)
            c = _COPY.search(ln)
            prefetched += bool(c and c[1] in views)
        body = lines[j + 1:end]
        for ln in body:
            see(ln)
        if not any((c := _COPY.search(ln)) and c[1] in views for ln in body):
            continue
        pending = []  # (iteration, reads the ring)
        hit = None
        for it in range(2 * nbuf + 2):
            for ln in body:
                d = _DOT.search(ln)
                if d and "isAsync = true" in ln:
                    pending.append((it, any(o.split("#")[0] in views for o in (d[1], d[2]))))
                    continue
                w = _WAIT.search(ln)
                if w:
                    k = int(w[1])
                    pending = pending[len(pending) - k:] if k else []
                    continue
                c = _COPY.search(ln)
                if c and c[1] in views:
                    slot = (it + prefetched) % nbuf
                    late = [jt for jt, reads in pending if reads and jt % nbuf == slot]
                    if late:
                        hit = (it, slot, late[0])
                        break
            if hit:
                break
        if hit:
            found.append(f"loop at line {j + 1}: a copy of iteration {hit[0]} overwrites buffer {hit[1]} of {ring} "
                         f"({nbuf} buffers, {prefetched} prefetched) while a wgmma of iteration {hit[2]} reads it")
    return found


# ------------------------------------------------------------------------------ compiling specs
_TYPES = {"terms": "*i64", "signs": "*fp32", "items": "*i64", "part": "*fp32", "factors": "*fp32", "plane": "i64"}


def _ttgir(spec: dict, arch: int = 90) -> str:
    """sm_``arch`` TTGIR of ``gram.gram_kernel`` for one spec (``dtype``, ``constexprs``, ``num_warps``),
    16-byte aligned pointers as the JIT marks torch allocations; the stages after TTGIR are not run."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    from conserve.kernels import gram

    fn = gram.gram_kernel
    types = dict(_TYPES, xb="*" + spec["dtype"], yb="*" + spec["dtype"])
    # constexprs with a default that the launch did not pass (e.g. CHECK) take their default
    ce = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **spec["constexprs"]}
    sig = {n: ("constexpr" if n in ce else types[n]) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    src = ASTSource(fn, sig, ce, attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": spec["num_warps"], "num_stages": spec.get("num_stages", 3)})
    stages = {}
    backend.add_stages(stages, options, src.language)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    meta = {}
    for ext in ("ttir", "ttgir"):
        mod = stages[ext](mod, meta)
    return str(mod)


def _main(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("compiles real kernels: unset TRITON_INTERPRET")
    sys.path.insert(0, _ROOT)
    import triton

    for spec in json.load(open(path)):
        text = _ttgir(spec)
        print(json.dumps(dict(label=spec["label"], triton=triton.__version__, races=pipeline_races(text),
                              copies=text.count("ttg.async_copy_global_to_local"),
                              async_dots=len(re.findall(r"ttng\.warp_group_dot .*isAsync = true", text)))),
              flush=True)
    return 0


# ------------------------------------------------------------------------------ the plans
def _plans():
    """``(name, plan, tensors)`` of real layouts at small sizes: Llama blocks (D = 128, with and without
    RoPE pairs; D = 256 gives off-diagonal tiles), ViT (D = 64, fused qkv with biases), and a slot with
    a non-unit sign (no sign fold)."""
    from bench.kernels import Shape, llama_plan, llama_tensors, vit_plan, vit_tensors
    from conserve.kernels import GramTerm, Plan, View

    out = []
    for name, s in (("llama D=128", Shape("l128", 1, 256, 4, 2, 128, 384)),
                    ("llama D=256", Shape("l256", 1, 256, 2, 1, 256, 384))):
        out.append((name, llama_plan(s, rope=False), llama_tensors(s, "cpu", torch.float32)))
    s = Shape("vit", 1, 128, 2, 2, 64, 256)
    out.append(("vit D=64", vit_plan(s), vit_tensors(s, "cpu", torch.float32)))
    p = Plan()
    slot = p.new_gram(128)
    p.grams += [GramTerm(View(0, (0, 0), 0, 128, 1, 256), 1.0, slot),
                GramTerm(View(0, (128, 0), 0, 128, 1, 256), -0.5, slot)]
    out.append(("sign -0.5", p, [torch.randn(256, 256)]))
    return out


def _specs() -> list[dict]:
    """The GPU launch configurations of ``gram_kernel`` for the plans of ``_plans``, as
    ``runner.gram_meta`` sets them on a 132-SM GPU, one per distinct code shape (D only sizes masks):
    bf16 evaluate/bilinear/CHECK/DRIFT (decay on and off), fp16 evaluate (the same tensor-core path as bf16),
    fp32 with 3xTF32 (tensor cores too) evaluate/bilinear/CHECK/DRIFT of the D = 128 plan (CHECK: the gradient
    check's pass, whose diagonal tiles also feed the row norms)."""
    from conserve.kernels import Config
    from conserve.kernels import launch as L
    from conserve.kernels.runner import gram_meta

    specs = {}
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for name, plan, ts in _plans():
        for dtype, prec in ((torch.bfloat16, "ieee"), (torch.float16, "ieee"), (torch.float32, "tf32x3")):
            if dtype != torch.bfloat16 and name != "llama D=128":
                continue
            cfg = L.Tiles.gpu(132, Config(input_precision=prec))
            xs = [t.to(dtype) for t in ts]
            modes = [("evaluate", L.build(plan, xs, None, False, cfg), dict(bil=False))]
            if dtype != torch.float16:
                modes.append(("bilinear", L.build(plan, xs, xs, False, cfg), dict(bil=True)))
                modes.append(("check", L.build(plan, xs, xs, False, cfg, check=True), dict(bil=True, check=True)))
                if name == "llama D=128":
                    st = L.build_drift(plan, xs, xs, cfg)
                    modes += [(f"drift decay={dec}", st, dict(bil=True, drift=True, decay=dec))
                              for dec in (True, False)]
            for mode, st, kw in modes:
                for b in st.gram:
                    for l in b.launches:
                        meta = gram_meta(b, l, fp64=False, precision=cfg.precision, interpret=False, **kw)
                        warps = meta.pop("num_warps")
                        stages = meta.pop("num_stages", 3)
                        ce = dict(meta, ALIGN=16, DRIFT=meta.get("DRIFT", False), DECAY=meta.get("DECAY", False),
                                  CHECK=meta.get("CHECK", False))
                        if dtype == torch.float32 and not l.single:
                            continue
                        key = json.dumps([names[dtype], dict(ce, D=None), warps, stages], sort_keys=True)
                        label = (f"{names[dtype]} {name} {mode} D={b.D} BT={b.BT} BK={l.BK} single={l.single} "
                                 f"fold={l.fold}")
                        specs.setdefault(key, dict(label=label, dtype=names[dtype], constexprs=ce, num_warps=warps,
                                                   num_stages=stages))
    return list(specs.values())


def _has_nvidia_backend() -> bool:
    try:
        import triton.backends

        return "nvidia" in triton.backends.backends
    except Exception:  # noqa: BLE001 -- any import problem means: cannot compile for sm_90 here
        return False


# ------------------------------------------------------------------------------ tests
_RING = """\
    %buf = ttg.local_alloc : () -> !ttg.memdesc<{n}x128x32xbf16, #shared, #smem, mutable>
    %v0 = ttg.memdesc_index %buf[%c0_i32] : !ttg.memdesc<{n}x128x32xbf16>
    %t0 = ttg.async_copy_global_to_local %ptrs, %v0 mask %m : tensor<128x32x!tt.ptr<bf16>>
    %v1 = ttg.memdesc_index %buf[%c1_i32] : !ttg.memdesc<{n}x128x32xbf16>
    %t1 = ttg.async_copy_global_to_local %ptrs, %v1 mask %m : tensor<128x32x!tt.ptr<bf16>>
    %r:3 = scf.for %k = %lo to %hi step %c32 iter_args(%acc = %z) -> (tensor<128x128xf32, #mma>) : i64 {{
      %w = ttg.async_wait %t {{num = 1 : i32}}
      %cur = ttg.memdesc_index %buf[%i] : !ttg.memdesc<{n}x128x32xbf16>
      %tr = ttg.memdesc_trans %cur {{order = array<i32: 1, 0>}} : !ttg.memdesc<128x32xbf16>
      %lhs = {lhs}
      %d = ttng.warp_group_dot %lhs, %tr, %acc {{isAsync = true}} : tensor<128x32xbf16> * !ttg.memdesc<32x128xbf16>
      %dw:2 = ttng.warp_group_dot_wait %d, %tr {{pendings = {pend} : i32}} : tensor<128x128xf32, #mma>
      %nxt = ttg.memdesc_index %buf[%j] : !ttg.memdesc<{n}x128x32xbf16>
      %tn = ttg.async_copy_global_to_local %ptrs, %nxt mask %m : tensor<128x32x!tt.ptr<bf16>>
      scf.yield %dw#0 : tensor<128x128xf32, #mma>
    }} loc(#loc1)
    %fin = ttng.warp_group_dot_wait %r#0 {{pendings = 0 : i32}} : tensor<128x128xf32, #mma>
"""


def test_pipeline_race_check_on_ir():
    """The check on hand-written TTGIR of one pipelined loop: 2 buffers, 2 blocks prefetched and the
    right operand read from the ring by a dot left pending is a race; a third buffer, or a wait for
    every dot before the copy, is not; a left operand from registers does not read the ring."""
    reg = "ttg.local_load %cur : !ttg.memdesc<128x32xbf16> -> tensor<128x32xbf16>"
    assert len(pipeline_races(_RING.format(n=2, pend=1, lhs=reg))) == 1
    assert "2 buffers, 2 prefetched" in pipeline_races(_RING.format(n=2, pend=1, lhs=reg))[0]
    assert pipeline_races(_RING.format(n=3, pend=1, lhs=reg)) == []
    assert pipeline_races(_RING.format(n=2, pend=0, lhs=reg)) == []
    # both operands from the ring (the shape of the fixed diagonal tiles), 3 buffers: no race
    assert pipeline_races(_RING.format(n=3, pend=1, lhs="ttg.memdesc_trans %tr {order = array<i32: 1, 0>}")) == []


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_gram_launches_of_real_plans_have_no_wgmma_race_sm90(tmp_path):
    specs = _specs()
    labels = [s["label"] for s in specs]
    # the GPU launch shapes this is about: diagonal tiles of D = 128 (BT 128, BK 32) and D = 64 with the
    # sign folded, off-diagonal tiles (D = 256), an unfolded slot, the DRIFT pass
    for want in ("bf16 llama D=128 evaluate D=128 BT=128 BK=32 single=True fold=True",
                 "bf16 vit D=64 bilinear D=64 BT=64 BK=64 single=True fold=True",
                 "bf16 llama D=256 evaluate D=256 BT=128 BK=32 single=False fold=True",
                 "fp16 llama D=128 evaluate D=128 BT=128 BK=32 single=True fold=True",
                 "bf16 sign -0.5 evaluate D=128 BT=128 BK=32 single=True fold=False",
                 "bf16 llama D=128 drift decay=True D=128 BT=64 BK=16 single=True fold=True",
                 "bf16 llama D=128 check D=128 BT=128 BK=32 single=True fold=True"):
        assert want in labels, (want, labels)
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, os.path.abspath(__file__), str(path)], env=env, cwd=_ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert [r["label"] for r in rows] == labels
    bad = [f"{r['label']}: {r['races']}" for r in rows if r["races"]]
    assert not bad, "\n".join(bad)
    # not vacuous: the half-precision diagonal tiles are pipelined through cp.async into async wgmmas
    for r in rows:
        lab = r["label"]
        if lab.startswith(("bf16", "fp16")) and "single=True fold=True" in lab and "drift" not in lab \
                and " check " not in lab:
            assert r["copies"] > 0 and r["async_dots"] > 0, r
    # the check pass of half tiles is not pipelined (runner.gram_meta): no cp.async ring to race on
    for spec, r in zip(specs, rows):
        if " check " in r["label"] and r["label"].startswith(("bf16", "fp16")):
            assert spec["num_stages"] == 1 and r["copies"] == 0, r


def test_gram_hints_hold_for_gpu_tiles():
    """Every value ``gram.py`` hints with ``tl.multiple_of`` for the GPU tiles of real plans: the
    items' ``k0`` (multiple of BK), the bound offsets and slow strides (multiples of ALIGN, and the base
    pointers ALIGN-element aligned); with a tensor one element off its allocation ALIGN drops to 1."""
    from conserve.kernels import launch as L
    from conserve.kernels.runner import Prepared
    from conserve.kernels.tables import GRAM_ITEM as GI
    from conserve.kernels.tables import GRAM_TERM as GT

    cases = [(n, p, [t.to(torch.bfloat16) for t in ts]) for n, p, ts in _plans()]
    name, plan, ts = cases[0]
    buf = torch.empty(ts[0].numel() + 1, dtype=torch.bfloat16)
    cases.append(("llama D=128, q one element off", plan, [buf[1:].view(ts[0].shape)] + ts[1:]))
    aligns = []
    for name, plan, ts in cases:
        for ys in (None, ts):
            pr = Prepared(plan, ts, ys, False, cfg=L.Tiles.gpu(132))
            pr._bind(ts, ys)
            for b, lb in zip(pr.st.gram, pr.gram_bound):
                for l, (terms, align) in zip(b.launches, lb):
                    assert (l.items[:, GI.K0] % l.BK == 0).all(), (name, "k0")
                    t = terms.cpu().numpy()
                    slow = [(r[GT.X_CS], r[GT.Y_CS]) if r[GT.LAYOUT] == 1 else (r[GT.X_RS], r[GT.Y_RS]) for r in t]
                    hinted = list(t[:, GT.X_OFF]) + list(t[:, GT.Y_OFF]) + [v for pair in slow for v in pair]
                    assert all(int(v) % align == 0 for v in hinted), (name, align)
                    xb, yb = pr.bases[l.group]
                    for base in (xb, yb):
                        assert base.data_ptr() % (align * base.element_size()) == 0, (name, align)
                    aligns.append((name, align))
    assert {a for n, a in aligns if "off" in n} == {1} and {a for n, a in aligns if "off" not in n} == {16}


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
