"""FLOP and byte counts of the DRIFT pass, counted from its work tables (no GPU; not a measurement).

    python -m bench.drift_counts                  # 8 Llama-3-8B layers, no-RoPE (QK + VO) and RoPE (VO) plans

For each plan, dtype and mode (decay computed / compiled out), walks every item of the tables
``launch.build_drift`` builds for a 132-SM GPU and adds up, per contracted block of each term:
the dots of ``gram._drift_dots`` (h_new 1, decay 1 if DECAY, bil 2 -- 1 on a diagonal tile --,
h_delta 1; each ``2 * BT^2 * BK`` FLOP, masked tails counted at their true length), the bytes of
the old and new tiles it loads (one row block on a diagonal tile, two otherwise), and the partial
tiles it writes (3 or 4 planes) that ``_gram_finish`` reads back.  Time floors use the H200's
~67 TFLOP/s fp32 FMA peak and 4.27 TB/s: arithmetic, not measurements.
"""
from __future__ import annotations

import argparse

import torch

FMA_TFLOPS = 67.0
DRAM_TBS = 4.27


def counts(plan, ts, decay: bool):
    from conserve.kernels import launch as L
    from conserve.kernels.tables import GRAM_ITEM as I
    from conserve.kernels.tables import GRAM_TERM as T

    st = L.build_drift(plan, ts, ts, L.Tiles.gpu(132))
    flop = loaded = partial = 0
    for b in st.gram:
        planes = 4 if decay else 3
        for l in b.launches:
            esize = torch.empty(0, dtype=l.group[0]).element_size()
            dots = 1 + (1 if decay else 0) + (1 if l.single else 2) + 1
            for it in l.items:
                for t in range(it[I.T0], it[I.T1]):
                    n = int(l.terms[t, T.N])
                    k = max(0, min(int(it[I.K1]), n) - int(it[I.K0]))
                    rows_i = min(b.BT, b.D - int(it[I.TI]) * b.BT)
                    rows_j = min(b.BT, b.D - int(it[I.TJ]) * b.BT)
                    flop += dots * 2 * b.BT * b.BT * k
                    loaded += 2 * esize * k * (rows_i if l.single else rows_i + rows_j)  # old + new tiles
                partial += 2 * planes * b.BT * b.BT * 4  # written by the item, read by the finishing pass
    unique = 2 * sum(t.numel() * t.element_size() for t in ts if t is not None)  # old + new, read once
    return flop, loaded, partial, unique


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args(argv)
    from dataclasses import replace

    from bench.kernels import LLAMA3_8B, llama_plan
    from conserve.kernels import Plan

    s = replace(LLAMA3_8B, layers=a.layers)
    print(f"{s.name} x {s.layers} layers; DRIFT tables for 132 SMs; floors at {FMA_TFLOPS} TFLOP/s fp32 FMA, "
          f"{DRAM_TBS} TB/s (arithmetic, not measured)")
    for case, rope in (("norope (QK + VO Grams)", False), ("rope (VO Grams)", True)):
        full = llama_plan(s, rope)
        plan = Plan(grams=full.grams, vec_size=0, gram_slots=dict(full.gram_slots))  # the DRIFT pass: Gram terms
        for dtype in (torch.float32, torch.bfloat16):
            shapes = [(s.nH * s.D, s.H), (s.nKV * s.D, s.H), (s.nKV * s.D, s.H), (s.H, s.nH * s.D),
                      (s.I, s.H), (s.I, s.H), (s.H, s.I), (s.H,), (s.H,)] * s.layers
            used = {t.view.tensor for t in plan.grams}
            ts = [torch.empty(sh, dtype=dtype, device="meta") if i in used else None for i, sh in enumerate(shapes)]
            for decay in (True, False):
                flop, loaded, partial, unique = counts(plan, ts, decay)
                print(f"{case:<24} {str(dtype).split('.')[-1]:<8} decay={'on ' if decay else 'off'}: "
                      f"{len(plan.grams)} terms, {flop / 1e9:7.1f} GFLOP (>= {flop / FMA_TFLOPS / 1e9:5.2f} ms FMA), "
                      f"tiles loaded {loaded / 1e9:5.2f} GB (unique old+new {unique / 1e9:5.2f} GB, "
                      f">= {unique / DRAM_TBS / 1e9:5.2f} ms), partials {partial / 1e6:6.1f} MB", flush=True)


if __name__ == "__main__":
    main()
