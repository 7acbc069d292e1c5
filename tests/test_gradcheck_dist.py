"""Gradient integrity across 2 gloo ranks on CPU (``torch.multiprocessing``; one run of both ranks serves
every test here): DDP's averaged gradient and FSDP2's reduce-scattered gradient (gathered with
``full_tensor``) stay silent; a hand-written all-reduce that averages one tensor of a multi-tensor law
with the wrong divisor (sums it) is flagged at that law and layer, and the same all-reduce with the
right divisor is silent.  Each rank trains on its own batch, so the averaged gradient is not any one
rank's."""
import os
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TIMEOUT = 180
WORLD = 2


def _model():
    from conserve.models.lm import DecoderLM, LMConfig

    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=48, num_experts=4, moe_layers=(1,), top_k=2))


def _batch(rank):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + rank))


def _ce(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def _summary(res):
    return dict(ok=res.ok, flagged=sorted(c.name for c in res.flagged), layers=sorted({c.layer for c in res.flagged},
                key=str), families=sorted({c.family for c in res.flagged}), text=str(res),
                worst=max(c.worst / c.floor for c in res.laws))


def _cases(rank, world):
    import conserve
    from conserve.analysis.gradcheck import check_gradients

    out = {}
    # DDP: gradients averaged by its bucketed all-reduce during backward
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    laws = conserve.detect(model, loss="ce")
    ddp = DDP(model)
    _ce(ddp, _batch(rank)).backward()
    out["ddp"] = _summary(check_gradients(ddp, laws=laws, loss="ce"))  # the gradients in .grad (inner names)

    # a hand-written all-reduce: SUM then divide by the world size, except layer 0's down_proj (divided by 1)
    for wrong in (False, True):
        model = _model()
        _ce(model, _batch(rank)).backward()
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            p.grad /= 1 if (wrong and name == "layers.0.mlp.down_proj.weight") else world
        out["allreduce_wrong" if wrong else "allreduce"] = _summary(check_gradients(model, laws=laws, loss="ce"))

    # FSDP2 (fully_shard on a CPU mesh): every parameter and gradient is a DTensor sharded on dim 0; the
    # check reads the reduce-scattered gradients in .grad, gathered whole (full_tensor, on every rank)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _ce(model, _batch(rank)).backward()
        sharded = all(type(p).__name__ == "DTensor" and type(p.grad).__name__ == "DTensor"
                      for p in model.parameters())
        out["fsdp2"] = _summary(check_gradients(model, laws=laws, loss="ce")) | dict(sharded=sharded)
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        out["fsdp2"] = dict(skip=f"FSDP2 fully_shard on CPU gloo failed: {type(e).__name__}: {e}")
        return out

    # the tracker on the same FSDP2 model (a DistributedTracker: sharded parameters), checking on its cadence; a
    # second run with one parameter's gradient summed instead of averaged over the ranks
    for wrong in (False, True):
        model = _model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = conserve.track(torch.optim.SGD(model.parameters(), lr=1e-2), model, laws=laws, every=100,
                             check_gradients=True, drift_every=2)
        for step in range(3):
            opt.zero_grad()
            _ce(model, _batch(rank + 10 * step)).backward()
            if wrong:  # summed over the ranks instead of averaged (each rank's shard of it)
                model.layers[0].mlp.down_proj.weight.grad.mul_(world)
            opt.step()
        rows = opt.tracker.flush()
        res = opt.tracker.gradient_check()
        opt.close()
        out["tracker_wrong" if wrong else "tracker"] = _summary(res) | dict(
            kind=type(opt.tracker).__name__, steps=res.steps,
            cols=[r.get("grad_check/swiglu") for r in rows] if rank == 0 else None)
    return out


def _entry(rank, world, port, queue):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT // 2))
        out = _cases(rank, world)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        queue.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' results (``torch.multiprocessing.start_processes``; fork: no re-import per rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("fork").SimpleQueue()
    ctx = mp.start_processes(_entry, args=(WORLD, port, queue), nprocs=WORLD, join=False, start_method="fork")
    got = {}
    try:
        while not ctx.join(timeout=TIMEOUT):
            pass
    except Exception as e:  # a rank died (ProcessRaisedException / ProcessExitedException)
        pytest.fail(f"a rank failed: {e}")
    while not queue.empty():
        rank, status, out = queue.get()
        if status == "error":
            pytest.fail(f"rank {rank} failed:\n{out}")
        got[rank] = out
    assert sorted(got) == list(range(WORLD))
    return got


def test_ddp_gradient_stays_silent_on_every_rank(ranks):
    for r in ranks.values():
        assert r["ddp"]["ok"] and r["ddp"]["worst"] < 0.5, r["ddp"]["text"]


def test_an_all_reduce_with_the_right_divisor_stays_silent(ranks):
    for r in ranks.values():
        assert r["allreduce"]["ok"], r["allreduce"]["text"]


def test_an_all_reduce_that_sums_one_tensor_of_a_law_is_flagged_at_that_law_and_layer(ranks):
    """down_proj of layer 0 summed instead of averaged (its gradient 2x): the unit law reading it, only."""
    for r in ranks.values():
        w = r["allreduce_wrong"]
        assert w["flagged"] == ["layers.0.mlp/unit"] and w["layers"] == [0] and w["families"] == ["swiglu"], w["text"]


def test_the_distributed_tracker_checks_on_its_cadence_and_flags_a_wrong_reduction(ranks):
    if "skip" in ranks[0]["fsdp2"]:
        pytest.skip(ranks[0]["fsdp2"]["skip"])
    for rank, r in ranks.items():
        t, w = r["tracker"], r["tracker_wrong"]
        assert t["kind"] == "DistributedTracker" and t["steps"] == 2 and t["ok"], t["text"]
        assert w["flagged"] == ["layers.0.mlp/unit"] and w["families"] == ["swiglu"], w["text"]
    cols = ranks[0]["tracker"]["cols"]  # steps 1 and 3 checked (drift_every=2), step 2 not: NaN
    assert len(cols) == 3 and 0 <= cols[0] < 1e-5 and cols[1] != cols[1] and 0 <= cols[2] < 1e-5, cols


def test_fsdp2_gradient_gathered_whole_stays_silent(ranks):
    r = ranks[0]["fsdp2"]
    if "skip" in r:
        pytest.skip(r["skip"])
    for r in ranks.values():
        assert r["fsdp2"]["ok"] and r["fsdp2"]["sharded"], r["fsdp2"]["text"]
