"""Bytes the distributed tracker moves per flush for a Llama-3-70B layout (planning only: no process
group, no 70B allocation; not a timed test).

    python -m bench.dist_bytes                        # 8 / 16 / 64 ranks, every=50, fp32, drift every step
    python -m bench.dist_bytes --ranks 16 --layers 2  # quicker: 2 layers (bytes scale with the layers)

The model is ``conserve.models.DecoderLM`` with Llama-3-70B's sizes (80 layers, hidden 8192, 64 heads,
8 kv heads, head_dim 128, FFN 28672, vocab 128256, RoPE, SwiGLU, untied head) built on the meta
device; its laws come from the real catalogue (``model.conservation_laws()``) and the schedule from
``conserve.distributed.comm_schedule`` on ``torch.chunk`` shard layouts (what ``DTensor`` ``Shard(d)``
and FSDP2 ``fully_shard`` produce) for each placement rule below:

* ``fsdp2-default``: every parameter ``Shard(0)`` (``fully_shard`` without ``shard_placement_fn``);
* ``v:1``: ``v_proj`` on ``Shard(1)``, the rest ``Shard(0)`` (no value head straddles);
* ``v:1,down:1``: also ``down_proj`` on ``Shard(1)`` (a SwiGLU unit's ``up_proj`` row and
  ``down_proj`` column then lie on the same rank: unit entries are complete, not split);
* ``o:1,down:1``: ``v_proj`` on ``Shard(0)`` and ``o_proj``, ``down_proj`` on ``Shard(1)``: with at most
  one kv head per rank (8 ranks here) a kv head's ``v_proj`` rows and its q heads' ``o_proj`` columns
  lie on one rank, so the VO Grams are complete; with more ranks the value heads straddle.

Columns (per rank, per flush of ``every`` steps; the all-reduce is one packed call, a ring moves about
twice that per rank): ``straddles`` Gram terms whose rows span ranks; ``split`` scalars whose value
several ranks contribute to; ``all_reduce`` what each rank contributes to the packed all-reduce(s);
``per step`` what a rank keeps on the device per pending step (metric-row partials + split partials),
``h-only step`` the same for a step without drift terms (``drift_every > 1``);
``calls at 256 MiB`` how many all-reduces a flush takes under the default ``max_pending_bytes`` (1 when
``every`` pending steps fit; raise the cap to ``every * per step`` for one);
``rows in (max)`` straddling rows received by the busiest owner (point to point, owner-only: the
``theta_{k+1}`` rows of every step, and on a drift step the ``theta_k`` rows of the group's terms); then the
previous implementation for comparison: ``old all_gather in`` (every rank received every straddling
row, every step) and ``old all_reduce`` (every law value of every step, in calls of at most
``--max-pending`` bytes: every step for 70B).

Drift snapshots (per rank, right before a drift step; dropped after it): ``groups`` the sampler's
groups under ``--budget`` (``conserve.tracking.drift.Sampler`` with ``Shards``: the same on every
rank; each law is decomposed once every ``groups`` drift steps), ``copy (max)`` the most any rank
copies for one group (the group's views' pieces on that rank, straddling rows included),
``budget (max)`` the largest ``budget x`` a rank's tracked bytes, ``shards (max)`` what a rank copies
with ``snapshot_budget=None`` (its whole shards: the previous behaviour at every drift step); last,
the groups a single-process tracker packs for the same plan under the same budget.
"""
from __future__ import annotations

import argparse
import time

import torch

from conserve.distributed import comm_schedule, shard_layouts
from conserve.tracker import SNAPSHOT_BUDGET
from conserve.tracking.drift import Sampler
from conserve.tracking.shard_plan import sampler_shards
from conserve.laws import compile_laws
from conserve.models import DecoderLM, LMConfig

LLAMA3_70B = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                  intermediate_size=28672, num_hidden_layers=80, vocab_size=128256)


RULES = {"fsdp2-default": (), "v:1": ("v_proj",), "v:1,down:1": ("v_proj", "down_proj"),
         "o:1,down:1": ("o_proj", "down_proj")}


def _rule(name: str):
    """``shard_placement_fn`` of a rule: ``Shard(1)`` for the listed 2-D weights, ``Shard(0)`` otherwise."""
    dim1 = RULES[name]
    return lambda param, shape: 1 if len(shape) == 2 and any(f".{m}." in param for m in dim1) else 0


def _fmt(b: float) -> str:
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s:
            return f"{b / s:.2f} {unit}"
    return f"{b:.0f} B"


def _read_bytes(local, shapes, layouts, r, b) -> int:
    """Bytes of rank r's shards of the tensors its local terms read (what it copies per drift step with
    ``snapshot_budget=None``)."""
    out = 0
    for i in {t.view.tensor for t in list(local.grams) + list(local.norms) + list(local.sums)}:
        n, lay = 1, layouts[i]
        for x in shapes[i]:
            n *= x
        if lay.dim is not None:
            n = n // shapes[i][lay.dim] * lay.ranges[r][1]
        out += n * b
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--every", type=int, default=50, help="flush period in steps")
    ap.add_argument("--layers", type=int, default=LLAMA3_70B["num_hidden_layers"])
    ap.add_argument("--max-pending", type=int, default=256 << 20, help="max_pending_bytes (both implementations)")
    ap.add_argument("--drift-every", type=int, default=1, help="drift terms on every N-th step (the new tracker)")
    ap.add_argument("--budget", type=float, default=SNAPSHOT_BUDGET, help="snapshot_budget of the drift columns "
                    "(default: the library's)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = DecoderLM(LMConfig(**{**LLAMA3_70B, "num_hidden_layers": args.layers}))
    laws, _ = model.conservation_laws()
    named = dict(model.named_parameters())
    compiled = compile_laws(laws, {k: tuple(v.shape) for k, v in named.items()})
    shapes = [tuple(named[n].shape) for n in compiled.names]
    dtypes = [torch.float32] * len(shapes)
    plan = compiled.plan
    P = plan.vec_size + sum(n * d * (d + 1) // 2 for d, n in plan.gram_slots.items())
    b, k = 4, args.every  # fp32 values and rows
    print(f"Llama-3-70B layout, {args.layers} layers: {len(laws)} laws, {len(plan.grams)} Gram / {len(plan.norms)} "
          f"norm / {len(plan.sums)} sum terms, {P / 1e6:.2f} M law scalars per step; every={k}, fp32, drift terms "
          f"every {args.drift_every} step(s) (the old columns: every step)\n")
    head = ("placement", "ranks", "straddles", "split", "per step", "h-only step", "all_reduce", "calls at 256 MiB",
            "rows in (max)", "old all_gather in", "old all_reduce", "groups", "copy (max)", "budget (max)",
            "shards (max)")
    rows = []
    for rule in RULES:
        f = _rule(rule)
        for w in args.ranks:
            dims = [f(n, s) for n, s in zip(compiled.names, shapes)]
            layouts = shard_layouts(shapes, dims, w)
            sched = comm_schedule(compiled, layouts, dtypes)
            # the drift sampler every rank builds (the costs of all ranks are the same on each: rank 0's view)
            shards = sampler_shards(sched, shapes, [b] * len(shapes), layouts, 0)
            metas = [torch.empty(0, device="meta")] * len(shapes)  # (element sizes only: fp32)
            sampler = Sampler(plan, metas, args.budget, "cpu", shards=shards)
            whole = max(_read_bytes(sched.plans[r], shapes, layouts, r, b) for r in range(w))
            copy = whole if sampler.groups == [None] else max(int(sum(u.cost for u in g).max()) for g in sampler.groups)
            recv_h, _ = sched.row_traffic(False)  # theta_{k+1} rows, every step
            # theta_k rows on a drift step: those of the straddling terms of the step's group, per group and owner
            gid = sampler._gid[1]  # the group of each Gram slot (every rank's, the same)
            old_in = [[0] * w for _ in sampler.groups]
            for s in sched.straddles:
                n = s.sizes()
                old_in[int(gid[s.term.view.rows][s.term.slot])][s.owner] += sum(n) - n[s.owner]
            # the previous implementation: per step an all_gather of 2 blocks (theta_{k+1}, a theta_k) of the
            # largest per-rank straddle count from every rank, and the packed values (4 blocks) all-reduced
            count = [0] * w
            for s in sched.straddles:
                for r, n in enumerate(s.sizes()):
                    count[r] += n
            old_gather = k * w * 2 * max(count) * b if sched.straddles else 0
            step, h_only = sched.step_scalars(True) * b, sched.step_scalars(False, True) * b
            # the tracker's rule: reduce when the next step's pack would not fit max_pending_bytes
            calls, pending, total, rows_in = 1, 0, 0, 0
            for i in range(k):
                drift = i % args.drift_every == 0
                nxt = step if drift else h_only
                g = (i // args.drift_every) % len(sampler.groups)
                rows_in += max(x + (old_in[g][r] if drift else 0) for r, x in enumerate(recv_h)) * b
                if pending and pending + nxt > args.max_pending:
                    calls, pending = calls + 1, 0
                pending += nxt
                total += nxt
            rows.append((rule, str(w), str(len(sched.straddles)), f"{sched.split_size / 1e6:.2f} M", _fmt(step),
                         _fmt(h_only), _fmt(total), str(calls), _fmt(rows_in),
                         _fmt(old_gather), _fmt(k * 4 * P * b), str(len(sampler.groups)), _fmt(copy),
                         _fmt(args.budget * max(shards.held)), _fmt(whole)))
    width = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(x) for h, x in zip(head, width)))
    print("-|-".join("-" * x for x in width))
    for r in rows:
        print(" | ".join(c.ljust(x) for c, x in zip(r, width)))
    metas = [torch.empty(s, device="meta") for s in shapes]  # one process: the same plan, every weight on it
    one = Sampler(plan, metas, args.budget, "cpu")
    print(f"\none process, snapshot_budget={args.budget}: {len(one.groups)} groups over "
          f"{_fmt(one.tracked_bytes)} of tracked weights")
    print(f"\n(planned in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
