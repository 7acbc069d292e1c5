"""Extra memory of the distributed tracker's drift steps per rank (FSDP2 on CPU, gloo; not a timed test).

    OMP_NUM_THREADS=1 python -m bench.dist_memory            # 2 ranks, a 4-layer DecoderLM (hidden 256)
    OMP_NUM_THREADS=1 python -m bench.dist_memory --ranks 3 --hidden 128

Each rank builds ``DistributedTracker(model, snapshot_budget=B, drift_every=1)`` on an FSDP2
``fully_shard`` model and, over one full round of the sampler's groups, measures with
``bench.track_overhead.LiveBytes`` the CPU storages the tracker itself creates (the optimizer's are not
counted): ``copy`` what ``before_step`` leaves alive (the drift step's copies of theta_k), ``peak``
the most alive from ``before_step`` to the end of ``after_step`` (copies, the DRIFT pass, the
assembly, h_{k+1}, the pending pack), ``after`` what is still alive once the step is booked (the
pending pack and h_{k+1}: law-sized, no weight copy), each as a fraction of the tracked bytes the
rank holds, the largest over the steps and ranks. Budget ``None`` is the previous behaviour on every
FSDP2 drift step (each rank copies its whole shards).
"""
from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conserve.tracker import SNAPSHOT_BUDGET


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.track_overhead import LiveBytes
    from conserve.distributed import DistributedTracker
    from conserve.models import DecoderLM, LMConfig

    cfg = LMConfig(vocab_size=512, hidden_size=args.hidden, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=3 * args.hidden, num_hidden_layers=args.layers)
    out = {}
    for budget in args.budgets:
        torch.manual_seed(0)
        model = DecoderLM(cfg)
        laws, _ = model.conservation_laws()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, weight_decay=0.1)
        t = DistributedTracker(model, laws, every=1000, drift_every=1, snapshot_budget=budget)
        mine = sum(x.numel() * x.element_size() for x in t.tensors)
        g = torch.Generator().manual_seed(rank)
        steps = len(t.sampler.groups) if t.snapshot_budget is not None else 2
        worst = {"copy": 0.0, "peak": 0.0, "after": 0.0}
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.distributed.tensor.distribute_tensor(
                    torch.randn(p.shape, generator=g) * 1e-2, p.device_mesh, p.placements)
            with LiveBytes() as m1:
                t.before_step(opt)
            copy = m1.cur
            opt.step()
            with LiveBytes() as m2:
                t.after_step()
            worst["copy"] = max(worst["copy"], copy / mine)
            worst["peak"] = max(worst["peak"], (copy + m2.peak) / mine)
            worst["after"] = max(worst["after"], (m1.cur + m2.cur) / mine)
        out[budget] = {"groups": len(t.sampler.groups) if t.snapshot_budget is not None else 1, "mine": mine, **worst}
        t.close()
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budgets", type=lambda s: None if s == "none" else float(s), nargs="+", default=[SNAPSHOT_BUDGET, None])
    args = ap.parse_args(argv)
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"FSDP2, {args.ranks} ranks, DecoderLM hidden {args.hidden}, {args.layers} layers; per rank, fraction of "
          "the tracked bytes it holds (the largest over a round of groups and the ranks)")
    print("budget | groups | tracked bytes (rank 0) | copy before the step | peak during it | alive after it")
    for b in args.budgets:
        w = {k: max(res[r][b][k] for r in res) for k in ("copy", "peak", "after")}
        print(f"{str(b):6} | {res[0][b]['groups']:6} | {res[0][b]['mine']:22} | {w['copy']:20.3f} | "
              f"{w['peak']:14.3f} | {w['after']:.3f}")


if __name__ == "__main__":
    main()
