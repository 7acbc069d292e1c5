"""Time and memory of ``conserve.discover`` vs block size, structured vs dense ansatz (not a timed test).

    python -m bench.discover                 # SwiGLU blocks from 12 to ~20,000 parameters, three ansatzes
    python -m bench.discover --max-seconds 60 --max-unknowns 6000

Each (block, ansatz) runs in its own spawned process, after an untimed warm-up run on a 2-unit block
(imports, first-call compilation); peak MB is the growth of the peak resident memory over the warm-up,
with ``degree=2``, ``count=False`` and the given
``max_unknowns``. Blocks: SwiGLU ``down(silu(gate x) * up x)`` with hidden ``H`` and width ``I``
(``P = 3 H I``), whose law count is known (``I``, one per unit). Ansatz: ``structured`` (fiber pairs of
all tensors and tensor pairs), ``within`` (``pairs="within"``: single tensors) and ``dense``. A row
reports: parameters, the quadratic unknowns (``P (P + 1) / 2`` dense; ``~ (3I)^2/2 + (3H)^2/2``
structured; ``~ 3 (I^2 + H^2) / 2`` within, before dependent features are removed), seconds,
peak MB above baseline, laws found, and whether the catalogue count was reproduced; or the reason it did
not run (above ``max_unknowns``: the error ``BlockTooLarge`` that discover raises, or the predicted
time above ``--max-seconds``, extrapolated from the measured rows as ``unknowns^3``).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

SIZES = [(2, 2), (3, 3), (4, 4), (6, 4), (8, 6), (12, 8), (16, 12), (24, 16), (32, 24), (48, 32), (82, 82)]


def _child(H: int, I: int, mode: str, max_unknowns: int, q) -> None:
    import torch

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    import conserve
    from conserve.analysis.discover import BlockTooLarge
    from conserve.toyblocks import SwiGLU

    warm = SwiGLU(2, 2).double()  # imports and first-call compilation, not timed
    ansatz, pairs = {"structured": ("structured", "all"), "within": ("structured", "within"),
                     "dense": ("dense", "all")}[mode]
    conserve.discover(warm, torch.randn(8, 2, dtype=torch.float64), ansatz=ansatz, pairs=pairs, count=False,
                      progress=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    block = SwiGLU(H, I).double()
    x = torch.randn(max(32, 2 * H), H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t0 = time.perf_counter()
    try:
        res = conserve.discover(block, x, ansatz=ansatz, pairs=pairs, count=False, max_unknowns=max_unknowns,
                                progress=False)
    except BlockTooLarge as e:
        q.put({"error": "BlockTooLarge" if "max_unknowns" in str(e) else str(e), "seconds": time.perf_counter() - t0})
        return
    dt = time.perf_counter() - t0
    solve = [s for s in res.solves if s.degree == 2][0]
    q.put({"seconds": dt, "unknowns": solve.unknowns, "laws": res.quadratic_dim + res.linear_dim,
           "ok": res.quadratic_dim == I and res.linear_dim == 0 and all(d.ok for d in res.laws),
           "gap": solve.gap, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base})


def _run(H, I, ansatz, max_unknowns):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(H, I, ansatz, max_unknowns, q))
    p.start()
    out = q.get()
    p.join()
    return out


def _unknowns(H: int, I: int, ansatz: str) -> int:
    P = 3 * H * I
    if ansatz == "dense":
        return P * (P + 1) // 2
    if ansatz == "within":  # per tensor: its rows (I of length H) and columns (H of length I)
        return 3 * (2 * H * (2 * H + 1) // 2 if H == I else I * (I + 1) // 2 + H * (H + 1) // 2)
    if H == I:
        return 6 * H * (6 * H + 1) // 2
    return 3 * I * (3 * I + 1) // 2 + 3 * H * (3 * H + 1) // 2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-unknowns", type=int, default=6000)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="skip a run predicted to take longer")
    args = ap.parse_args(argv)
    print(f"conserve.discover, SwiGLU(H, I) float64, degree 2, max_unknowns={args.max_unknowns}; peak MB: "
          "resident-memory growth of the run in its own process, after a warm-up run")
    print("| H | I | params | ansatz | unknowns | seconds | peak MB | laws (expected I) | gap | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fit = {"structured": None, "within": None, "dense": None}  # (unknowns, seconds) of the largest run, for extrapolation
    for H, I in SIZES:
        for ansatz in ("structured", "within", "dense"):
            n = _unknowns(H, I, ansatz)
            P = 3 * H * I
            if n > args.max_unknowns:
                r = _run(H, I, ansatz, args.max_unknowns)
                print(f"| {H} | {I} | {P} | {ansatz} | {n} | - | - | - | - | {r['error']} raised after "
                      f"{r['seconds']:.2f} s ({n} unknowns > max_unknowns) |")
                continue
            if fit[ansatz] is not None and fit[ansatz][1] > 1.0:  # extrapolate from runs the SVD dominates
                n0, t0 = fit[ansatz]
                pred = t0 * (n / n0) ** 3
                if pred > args.max_seconds:
                    print(f"| {H} | {I} | {P} | {ansatz} | {n} | - | - | - | - | skipped: predicted {pred:.0f} s "
                          f"> --max-seconds |")
                    continue
            r = _run(H, I, ansatz, args.max_unknowns)
            fit[ansatz] = (r["unknowns"], max(r["seconds"], 1e-3))
            print(f"| {H} | {I} | {P} | {ansatz} | {r['unknowns']} | {r['seconds']:.2f} | "
                  f"{max(0, r['rss']) / 1024:.0f} | {r['laws']} ({'ok' if r['ok'] else 'WRONG'}) | "
                  f"{r['gap']:.1e} | |", flush=True)


if __name__ == "__main__":
    main()
