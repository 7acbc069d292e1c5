"""FLOP and byte counts of the DRIFT pass, counted from its work tables (no GPU; not a measurement).

    python -m bench.drift_counts                  # 8 Llama-3-8B layers, no-RoPE (QK + VO) and RoPE (VO) plans

Then the overlap ordering of the fused optimizers (``overlap=True``): the bytes of the AdamW step of
the Gram-law tensors (stepped first, after their snapshot copy) and of the other tensors (stepped
while the pass runs on a side stream) against the pass's FLOP and bytes, and the expected hidden
fraction of the pass at those floors (see ``overlap_model``).

For each plan, dtype and mode (decay computed / compiled out), walks every item of the tables
``launch.build_drift`` builds for a 132-SM GPU and adds up, per contracted block of each term:
the dots of ``gram._drift_dots`` (h_new 1, decay 1 if DECAY, bil 2 -- 1 on a diagonal tile --,
h_delta 1; each ``2 * BT^2 * BK`` FLOP, masked tails counted at their true length), the bytes of
the old and new tiles it loads (one row block on a diagonal tile, two otherwise), and the partial
tiles it writes (3 or 4 planes) that ``gram_finish`` reads back.  Time floors use the H200's
~67 TFLOP/s fp32 FMA peak and 4.27 TB/s: arithmetic, not measurements.
"""
from __future__ import annotations

import argparse
import math

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


# AdamW step traffic per parameter: read p, g, m, v and write p, m, v (torch's fused AdamW minimum; the
# fused step kernel's statistics are reduced in registers); the snapshot copy reads and writes once
STEP_BYTES = 7
SNAP_BYTES = 2
# resident DRIFT programs per SM: 255 registers x 128 threads (kernels/README.md, bench.sass) of 64K
DRIFT_PER_SM = 2
SMS = 132


def overlap_model(step_first, step_rest, snap, flop, drift_bytes, fma_slowdown=1.0):
    """Times (ms) at the floors: ``serial`` = snapshot + step of the Gram-law tensors + step of the rest
    + the pass (alone on the GPU, at the FMA peak); ``overlap`` = snapshot + first step + max(rest step +
    the pass's DRAM bytes (they share the bandwidth with the memory-bound step), the pass's FMA time
    ``fma_slowdown`` x longer: the capped grid); ``hidden`` = the fraction of the serial pass's time
    that the overlap removes.  Bytes in B, FLOP in FLOP."""
    t_first, t_rest, t_snap = (b / DRAM_TBS / 1e9 for b in (step_first, step_rest, snap))
    t_f, t_b = flop / FMA_TFLOPS / 1e9, drift_bytes / DRAM_TBS / 1e9
    t_pass = max(t_f, t_b)
    serial = t_snap + t_first + t_rest + t_pass
    over = t_snap + t_first + max(t_rest + t_b, t_f * fma_slowdown)
    return dict(first=t_first, rest=t_rest, snap=t_snap, fma=t_f * fma_slowdown, dram=t_b, serial=serial,
                overlap=over, hidden=(serial - over) / t_pass if t_pass else 0.0)


def programs(plan, ts):
    """Programs per DRIFT Gram launch of the 132-SM tables (one per item)."""
    from conserve.kernels import launch as L

    st = L.build_drift(plan, ts, ts, L.Tiles.gpu(SMS))
    return [len(l.items) for b in st.gram for l in b.launches]


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
    print(f"\noverlap=True (FusedAdamW, one param group: a != 1 alike, so the decay dots are compiled out), "
          f"{STEP_BYTES * 4} B/param fp32 step, whole snapshot (snapshot_budget=None), floors as above:")
    for case, rope in (("norope (QK + VO Grams)", False), ("rope (VO Grams)", True)):
        full = llama_plan(s, rope)
        plan = Plan(grams=full.grams, vec_size=0, gram_slots=dict(full.gram_slots))
        shapes = [(s.nH * s.D, s.H), (s.nKV * s.D, s.H), (s.nKV * s.D, s.H), (s.H, s.nH * s.D),
                  (s.I, s.H), (s.I, s.H), (s.H, s.I), (s.H,), (s.H,)] * s.layers
        used = {t.view.tensor for t in plan.grams}
        n_first = sum(math.prod(sh) for i, sh in enumerate(shapes) if i in used)
        n_rest = sum(math.prod(sh) for i, sh in enumerate(shapes) if i not in used)
        ts = [torch.empty(sh, dtype=torch.float32, device="meta") if i in used else None for i, sh in enumerate(shapes)]
        flop, loaded, partial, unique = counts(plan, ts, False)
        progs = programs(plan, ts)
        torch_ms = (n_first + n_rest) * STEP_BYTES * 4 / DRAM_TBS / 1e9
        print(f"{case}: Gram-law tensors {n_first / 1e6:.0f} M params (step {n_first * STEP_BYTES * 4 / 1e9:.2f} GB, "
              f"snapshot {n_first * SNAP_BYTES * 4 / 1e9:.2f} GB), rest {n_rest / 1e6:.0f} M (step "
              f"{n_rest * STEP_BYTES * 4 / 1e9:.2f} GB); pass {flop / 1e9:.1f} GFLOP, DRAM {(unique + partial) / 1e9:.2f}"
              f"-{(loaded + partial) / 1e9:.2f} GB (tiles from L2 .. none from L2); torch fused AdamW floor {torch_ms:.2f} ms")
        print(f"  DRIFT grid: {sum(progs)} programs in {len(progs)} launches {progs}; resident at most "
              f"{DRIFT_PER_SM} per SM = {DRIFT_PER_SM * SMS} (all registers of every SM: the step kernel starved); "
              f"overlap caps each launch at {SMS} programs (Config.drift_programs: <= 1 per SM on average, half the "
              f"registers left to the step kernel)")
        for label, dram, slow in (("tiles from L2", unique + partial, 1.0), ("no L2 reuse", loaded + partial, 1.0),
                                  ("no L2 reuse, capped pass at half its FMA rate", loaded + partial, 2.0)):
            m = overlap_model(n_first * STEP_BYTES * 4, n_rest * STEP_BYTES * 4, n_first * SNAP_BYTES * 4, flop,
                              dram, slow)
            print(f"  {label:<46}: first {m['snap']:.2f} + {m['first']:.2f} ms, rest {m['rest']:.2f} ms, pass "
                  f"FMA {m['fma']:.2f} / DRAM {m['dram']:.2f} ms -> serial {m['serial']:.2f} ms "
                  f"({m['serial'] / torch_ms:.3f}x torch), overlap {m['overlap']:.2f} ms ({m['overlap'] / torch_ms:.3f}x); "
                  f"hidden {100 * m['hidden']:.0f}% of the pass", flush=True)


if __name__ == "__main__":
    main()
