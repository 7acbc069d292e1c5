"""Whole-model law evaluation: Triton kernels vs naive torch vs torch.compile (not a timed test).

    python -m bench.kernels                       # GPU: Llama-3-8B x 8 layers (no-RoPE and RoPE plans)
                                                  #      and ViT-B/16 x 12, fp32 and bf16
    python -m bench.kernels --device cpu --small  # CPU smoke run: toy sizes, Triton under the interpreter

Prints, per case: ms of the Triton path (``conserve.kernels.evaluate``, tables prepared once), of a
naive torch implementation (batched matmul per layer, fp32 accumulation) and of ``torch.compile`` of
that naive code; GB/s of the Triton path (weight bytes read once / time) against a device copy
bandwidth measured in the same run; max relative difference between Triton and naive.  Appends one
CSV row per case to ``bench/results.csv`` (GPU name, torch/triton versions, timestamp).

Plans are built here directly from ``View``s (the law catalogue builds its own): per layer,
"norope": QK Gram per kv group + VO Gram per kv group + SwiGLU units + gains (attention norm reads
q, k, v; MLP norm reads gate, up); "llama": RoPE pair norms (HF half-split layout) instead of the QK
Gram; "vit": QK + VO Grams of a fused qkv weight with biases.  Spec: ../shared/spec/laws.md.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results.csv"


@dataclass
class Shape:
    name: str
    layers: int
    H: int
    nH: int
    nKV: int
    D: int
    I: int


LLAMA3_8B = Shape("llama3-8b", 8, 4096, 32, 8, 128, 14336)
VIT_B16 = Shape("vit-b16", 12, 768, 12, 12, 64, 3072)
TOY_LLAMA = Shape("toy-llama", 2, 64, 4, 2, 16, 96)
TOY_VIT = Shape("toy-vit", 2, 48, 3, 3, 16, 96)


# -------------------------------------------------------------------------------------------- models
def llama_tensors(s: Shape, device, dtype, seed=0):
    """Per layer: q (nH*D, H), k, v (nKV*D, H), o (H, nH*D), gate, up (I, H), down (H, I), g_attn, g_mlp (H,)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ts = []
    for _ in range(s.layers):
        for shape in [(s.nH * s.D, s.H), (s.nKV * s.D, s.H), (s.nKV * s.D, s.H), (s.H, s.nH * s.D),
                      (s.I, s.H), (s.I, s.H), (s.H, s.I), (s.H,), (s.H,)]:
            ts.append((torch.randn(shape, device=device, generator=g) * 0.02).to(dtype))
    return ts


def llama_plan(s: Shape, rope: bool):
    """Laws of ``s.layers`` Llama blocks in the tensor order of ``llama_tensors`` (slot/vec order below
    matches ``naive_llama``): per layer [QK slots (norope)] [VO slots] ; vec: [pairs (rope)] units gains."""
    from conserve.kernels import GramTerm, NormTerm, Plan, View

    p = Plan()
    D, H, g = s.D, s.H, s.nH // s.nKV
    for l in range(s.layers):
        q, k, v, o, gate, up, down, ga, gm = range(9 * l, 9 * l + 9)
        if rope:  # HF rotate_half: pair t <-> t + D/2
            for j in range(s.nKV):
                base = p.new_vec(D // 2)
                for half in (0, 1):
                    for i in range(j * g, (j + 1) * g):
                        p.norms.append(NormTerm(View(q, (i * D + half * D // 2, 0), 0, D // 2, 1, H), 1.0, base))
                    p.norms.append(NormTerm(View(k, (j * D + half * D // 2, 0), 0, D // 2, 1, H), -1.0, base))
        else:
            for j in range(s.nKV):
                slot = p.new_gram(D)
                for i in range(j * g, (j + 1) * g):
                    p.grams.append(GramTerm(View(q, (i * D, 0), 0, D, 1, H), 1.0, slot))
                p.grams.append(GramTerm(View(k, (j * D, 0), 0, D, 1, H), -1.0, slot))
        for j in range(s.nKV):
            slot = p.new_gram(D)
            p.grams.append(GramTerm(View(v, (j * D, 0), 0, D, 1, H), 1.0, slot))
            for i in range(j * g, (j + 1) * g):
                p.grams.append(GramTerm(View(o, (0, i * D), 1, D, 0, H), -1.0, slot))
        u = p.new_vec(s.I)
        p.norms.append(NormTerm(View(up, (0, 0), 0, s.I, 1, H), 1.0, u))
        p.norms.append(NormTerm(View(down, (0, 0), 1, s.I, 0, H), -1.0, u))
        for gain, readers in ((ga, [(q, s.nH * D), (k, s.nKV * D), (v, s.nKV * D)]), (gm, [(gate, s.I), (up, s.I)])):
            c = p.new_vec(H)
            p.norms.append(NormTerm(View(gain, (0,), 0, H, None, 1), 1.0, c))
            for t, rows in readers:
                p.norms.append(NormTerm(View(t, (0, 0), 1, H, 0, rows), -1.0, c))
    return p


def naive_llama(s: Shape, rope: bool, ts):
    """The same laws with batched matmuls per layer (fp32 accumulation): ``(vec, {D: grams})``."""
    D, H, g = s.D, s.H, s.nH // s.nKV
    vecs, grams = [], []
    for l in range(s.layers):
        q, k, v, o, gate, up, down, ga, gm = (t.float() for t in ts[9 * l: 9 * l + 9])
        qh, kh, vh = q.view(s.nKV, g, D, H), k.view(s.nKV, D, H), v.view(s.nKV, D, H)
        oh = o.view(H, s.nKV, g, D).permute(1, 2, 3, 0)  # (nKV, g, D, H)
        if rope:
            qn = qh.pow(2).sum(-1).sum(1) - kh.pow(2).sum(-1)  # (nKV, D)
            vecs.append((qn[:, : D // 2] + qn[:, D // 2:]).reshape(-1))
        else:
            grams.append(torch.matmul(qh, qh.transpose(-1, -2)).sum(1) - torch.bmm(kh, kh.transpose(-1, -2)))
        grams.append(torch.bmm(vh, vh.transpose(-1, -2)) - torch.matmul(oh, oh.transpose(-1, -2)).sum(1))
        upsq = up.pow(2)
        vecs.append(upsq.sum(1) - down.pow(2).sum(0))
        vecs.append(ga.pow(2) - q.pow(2).sum(0) - k.pow(2).sum(0) - v.pow(2).sum(0))
        vecs.append(gm.pow(2) - gate.pow(2).sum(0) - upsq.sum(0))
    return torch.cat(vecs), {D: torch.cat(grams)}


def vit_tensors(s: Shape, device, dtype, seed=0):
    """Per layer: fused qkv (3H, H), qkv bias (3H,), proj (H, H)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ts = []
    for _ in range(s.layers):
        for shape in [(3 * s.H, s.H), (3 * s.H,), (s.H, s.H)]:
            ts.append((torch.randn(shape, device=device, generator=g) * 0.02).to(dtype))
    return ts


def vit_plan(s: Shape):
    from conserve.kernels import GramTerm, Plan, View

    p = Plan()
    D, H = s.D, s.H
    for l in range(s.layers):
        qkv, b, proj = 3 * l, 3 * l + 1, 3 * l + 2
        for i in range(s.nH):
            slot = p.new_gram(D)
            p.grams.append(GramTerm(View(qkv, (i * D, 0), 0, D, 1, H), 1.0, slot))
            p.grams.append(GramTerm(View(b, (i * D,), 0, D, None, 1), 1.0, slot))
            p.grams.append(GramTerm(View(qkv, (H + i * D, 0), 0, D, 1, H), -1.0, slot))
        for i in range(s.nH):
            slot = p.new_gram(D)
            p.grams.append(GramTerm(View(qkv, (2 * H + i * D, 0), 0, D, 1, H), 1.0, slot))
            p.grams.append(GramTerm(View(b, (2 * H + i * D,), 0, D, None, 1), 1.0, slot))
            p.grams.append(GramTerm(View(proj, (0, i * D), 1, D, 0, H), -1.0, slot))
    return p


def naive_vit(s: Shape, ts):
    D, H = s.D, s.H
    grams = []
    for l in range(s.layers):
        qkv, b, proj = (t.float() for t in ts[3 * l: 3 * l + 3])
        w = torch.cat([qkv, b[:, None]], 1).view(3, s.nH, D, H + 1)
        qq, kk, vv = w[0], w[1, :, :, :H], w[2]
        oh = proj.view(H, s.nH, D).permute(1, 2, 0)
        grams.append(torch.bmm(qq, qq.transpose(1, 2)) - torch.bmm(kk, kk.transpose(1, 2)))
        grams.append(torch.bmm(vv, vv.transpose(1, 2)) - torch.bmm(oh, oh.transpose(1, 2)))
    return torch.zeros(0, device=ts[0].device), {D: torch.cat(grams)}


# ------------------------------------------------------------------------------------------- harness
def _bench(fn, device) -> float:
    """Milliseconds per call: ``triton.testing.do_bench`` on CUDA, a best-of wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200)
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def copy_bandwidth(nbytes: int, device) -> float:
    """GB/s of a device-to-device copy of ``nbytes``, counting the bytes read AND written (the DRAM
    traffic rate: a copy of N bytes moves 2N).  Reading N bytes at that rate takes N / rate."""
    n = max(1, min(nbytes, 2 << 30)) // 4
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a), device)
    return 2 * n * 4 / ms / 1e6


def read_floor_ms(nbytes: int, copy_gbs: float) -> float:
    """Milliseconds to read ``nbytes`` once at the DRAM rate ``copy_gbs`` (``copy_bandwidth``: read +
    write bytes per second, so it is the rate of the traffic itself; 7.0 GB at 4.27 TB/s = 1.63 ms).
    (It was ``nbytes / (copy_gbs / 2)``: the read-only share of a copy's traffic, twice the floor.)"""
    return nbytes / copy_gbs / 1e6


def max_rel(a, b) -> float:
    (va, ga), (vb, gb) = a, b
    errs = [((va.double() - vb.double()).abs().max() / vb.double().abs().max().clamp_min(1e-30)).item()
            if vb.numel() else 0.0]
    for d in gb:
        errs.append(((ga[d].double() - gb[d].double()).abs().max() / gb[d].double().abs().max()).item())
    return max(errs)


def run_case(name, shape, make, plan, naive, *, dtype, device, compile_naive, copy_gbs, interpret, profile=False,
             config=None):
    from conserve.kernels import evaluate, evaluate_reference

    ts = make(shape, device, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    row = dict(case=name, shape=shape.name, dtype=str(dtype).replace("torch.", ""), device=str(device),
               weights_MB=round(nbytes / 1e6, 1))
    backend = "triton" if (device.type == "cuda" or interpret) else "torch"
    kw = dict(backend=backend, config=config)
    out = evaluate(plan, ts, **kw)  # prepares (tables cached) + compiles
    ref = naive(ts)
    row["maxrel_vs_naive"] = f"{max_rel(out, ref):.2e}"
    row[f"{backend}_ms"] = round(_bench(lambda: evaluate(plan, ts, **kw), device), 4)
    if backend == "triton" and device.type == "cpu":  # the reference twin too, for scale
        row["torch_ref_ms"] = round(_bench(lambda: evaluate_reference(plan, ts), device), 4)
    row["naive_ms"] = round(_bench(lambda: naive(ts), device), 4)
    if compile_naive:
        cn = torch.compile(naive)
        cn(ts)
        row["compiled_ms"] = round(_bench(lambda: cn(ts), device), 4)
    if profile and device.type == "cuda":
        from bench.profile import kernel_breakdown

        kernel_breakdown(lambda: evaluate(plan, ts, **kw), device, 5, f"{name} {row['dtype']}")
    ms = row[f"{backend}_ms"]
    row["GBps"] = round(nbytes / ms / 1e6, 1)
    row["copy_GBps"] = round(copy_gbs, 1)
    row["read_floor_ms"] = round(read_floor_ms(nbytes, copy_gbs), 4)
    row["x_naive"] = round(row["naive_ms"] / ms, 2)
    if "compiled_ms" in row:
        row["x_compiled"] = round(row["compiled_ms"] / ms, 2)
    return row


def append_csv(rows, path=RESULTS):
    import triton

    dev = rows[0]["device"] if rows else "cpu"
    meta = dict(timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                gpu=torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
                torch=torch.__version__, triton=triton.__version__)
    cols = ["timestamp", "gpu", "torch", "triton", "case", "shape", "dtype", "device", "weights_MB",
            "triton_ms", "torch_ms", "torch_ref_ms", "naive_ms", "compiled_ms", "GBps", "copy_GBps",
            "read_floor_ms", "x_naive", "x_compiled", "maxrel_vs_naive"]
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**meta, **r})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy shapes (the CPU smoke run)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default="norope,llama,vit")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the naive code")
    ap.add_argument("--no-interpret", action="store_true", help="on CPU: time only the torch paths")
    ap.add_argument("--profile", action="store_true", help="GPU: print the Triton path's time per kernel "
                    "(torch.profiler), e.g. Gram vs row/column kernels")
    ap.add_argument("--precision", default="ieee", help="fp32 Gram dots: ieee or tf32x3 (Config.input_precision)")
    ap.add_argument("--gram-bt", type=int, default=128, help="Gram output tile cap (Config.gram_bt; A/B: 64)")
    ap.add_argument("--norm-stages", type=int, default=3, help="norm row tiles in flight (Config.norm_stages; A/B: 1)")
    ap.add_argument("--no-overlap", action="store_true", help="serialise the Gram and norm streams (Config.overlap)")
    ap.add_argument("--csv", default=None, help="CSV to append to (default: bench/results.csv on a GPU, "
                    "bench/results-cpu.csv, untracked, on the CPU smoke run)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    interpret = device.type == "cpu" and not a.no_interpret
    if interpret:  # before the kernels' triton.jit functions are defined (imported lazily)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from conserve.kernels import Config

    config = Config(input_precision=a.precision, gram_bt=a.gram_bt, norm_stages=a.norm_stages,
                    overlap=not a.no_overlap)
    print(f"kernels {config}")
    llama, vit = (TOY_LLAMA, TOY_VIT) if a.small else (LLAMA3_8B, VIT_B16)
    compile_naive = not a.no_compile and device.type == "cuda"
    rows = []
    s = llama
    probe = 4 * s.layers * (2 * (s.nH + s.nKV) * s.D * s.H + 3 * s.I * s.H + 2 * s.H)  # fp32 weight bytes
    copy_gbs = copy_bandwidth(probe if device.type == "cuda" else 1 << 24, device)
    print(f"copy bandwidth {copy_gbs:.1f} GB/s on {device}")
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for case in a.cases.split(","):
            if case in ("norope", "llama"):
                rope = case == "llama"
                args = (llama, llama_tensors, llama_plan(llama, rope), lambda ts, r=rope: naive_llama(llama, r, ts))
            elif case == "vit":
                args = (vit, vit_tensors, vit_plan(vit), lambda ts: naive_vit(vit, ts))
            else:
                raise SystemExit(f"unknown case {case!r}; use norope, llama, vit")
            row = run_case(case, *args, compile_naive=compile_naive, copy_gbs=copy_gbs, interpret=interpret,
                           dtype=dtype, device=device, profile=a.profile, config=config)
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    csv_path = Path(a.csv) if a.csv else (RESULTS if device.type == "cuda" else RESULTS.with_name("results-cpu.csv"))
    append_csv(rows, csv_path)
    print(f"appended {len(rows)} rows to {csv_path}")
    return rows


if __name__ == "__main__":
    main()
