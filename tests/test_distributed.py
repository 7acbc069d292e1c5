"""conserve.distributed on CPU with gloo: FSDP2, DDP and tensor parallel against single-process values.

Reference (independent of the sharding): at every step each rank gathers the full parameters
(``DTensor.full_tensor()``) into an unsharded copy of the model tracked by a plain ``conserve.Tracker``;
the distributed tracker's metric rows and law values must equal it to 1e-6 relative (fp64
accumulation: both sides agree to rounding; fp32: to the fp32 rounding of partial sums). A first,
process-free test checks the localisation algebra itself: summed over ranks, the local plans plus
the straddling Gram terms give the global plan, for every shard dimension, uneven and empty shards.

Spawns (the cost of this file is process start-up): one of 3 ranks (FSDP2 with kv heads straddling
shards and an empty shard, DDP, a resume from torch.distributed.checkpoint) and one of 2 ranks
(FSDP2 aligned, FSDP2 with a straddling kv head, FSDP2 with a ``shard_placement_fn``, tensor
parallel, DDP, a NaN stop, and the torch.distributed calls the tracker makes: one all-reduce per
flush, straddling rows to their owner only, bytes checked against the laws' views). Each comparison
runs at ``drift_every`` 1 and 2. With a snapshot budget (FSDP2 aligned, straddling, 3 ranks uneven
and empty; tensor parallel) each drift step's terms are compared with the single-process ones at the
entries of its group, and the storages the tracker creates are measured (``bench.track_overhead.LiveBytes``):
the copies before a drift step fit the rank's budget, no weight-sized storage outlives a step. Every
spawn has a timeout, so a hang fails instead of blocking.
"""
from __future__ import annotations

import inspect
import math
import os
import random
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported here, before the ranks are forked, so that no rank pays for these imports again
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.nn.parallel  # noqa: F401

from conserve import kernels
from conserve.distributed import (DistributedTracker, ShardLayout, localize, comm_schedule, flush_bytes, shard_layouts,
                                  track, wants_distributed)
from conserve.models import DecoderLM, LMConfig
from conserve.sinks import MemorySink
from conserve.tracker import TERMS, Tracker, Values
from conserve.tracking.drift import Sampler
from conserve.tracking.shard_plan import sampler_shards

TIMEOUT = 240  # seconds for one spawn (a hang fails the test)
# the drift cadence (drift_every, snapshot_budget) of conserve.tracking.drift, compared when the Tracker has it
CADENCE = "drift_every" in inspect.signature(Tracker).parameters
FULL = {"snapshot_budget": None, "drift_every": 1} if CADENCE else {}  # every law decomposed on every step
STEPS, EVERY = 5, 2
LR, WD = 2.0 ** -6, 2.0 ** -3  # a = 1 - lr*wd = 1 - 2^-9: exact in fp32 (the kernels round a to fp32)

# heads of D=4: k_proj/v_proj have 8 rows (3/3/2 on 3 ranks: both kv heads straddle), q_proj 16
# (6/6/4); the router has 2 rows (rank 2 of 3 holds none); layer 0 has no RoPE (QK Gram laws with
# biases), layer 1 has interleaved partial RoPE (pair norms with row_step 2, pass-through Gram).
CFG = dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=10,
           num_hidden_layers=2, vocab_size=11, nope_layers=(0,), rope_layout="interleaved", rotary_dim=2,
           attention_bias=True, mlp_bias=True)
MOE = dict(num_experts=2, moe_layers=(1,), top_k=1)
SMALL = {**CFG, "num_hidden_layers": 1, "nope_layers": ()}  # TP and DDP: one RoPE layer (fewer terms to evaluate)


# ------------------------------------------------------------------------------- localisation algebra
def _shard_ranges(n: int, world: int, uneven: bool, rng: random.Random):
    if not uneven:  # torch.chunk semantics (DTensor Shard)
        c = -(-n // world)
        return tuple((min(r * c, n), max(0, min(c, n - r * c))) for r in range(world))
    cuts = sorted(rng.randint(0, n) for _ in range(world - 1))
    edges = [0] + cuts + [n]
    return tuple((edges[r], edges[r + 1] - edges[r]) for r in range(world))


def _random_plan(rng: random.Random, shapes):
    plan = kernels.Plan()
    for _ in range(12):
        i = rng.randrange(len(shapes))
        shape = shapes[i]
        nd = len(shape)
        kind = rng.choice(["gram", "norm", "sum"])
        if nd == 1:
            row_dim, col_dim = 0, None
        else:
            row_dim, col_dim = rng.sample(range(nd), 2)
        step = rng.choice([1, 1, 2])
        start = [rng.randrange(s) for s in shape]
        start[row_dim] = rng.randrange(max(1, shape[row_dim] // 2))
        rows = max(1, (shape[row_dim] - start[row_dim] + step - 1) // step - rng.randrange(2))
        if col_dim is not None:
            start[col_dim] = rng.randrange(shape[col_dim] // 2 + 1)
            cols = shape[col_dim] - start[col_dim] - rng.randrange(2)
            cols = max(1, cols)
        else:
            cols = 1
        v = kernels.View(i, tuple(start), row_dim, rows, col_dim, cols, step)
        sign = rng.choice([1.0, -1.0])
        if kind == "gram":
            plan.grams.append(kernels.GramTerm(v, sign, plan.new_gram(rows)))
        elif kind == "norm":
            stride = rng.choice([0, 1, 1])  # 0: all rows into one entry (ScaleLaw)
            plan.norms.append(kernels.NormTerm(v, sign, plan.new_vec(rows if stride else 1), stride,
                                               rng.choice([0.0, 0.5])))
        elif col_dim is not None:
            plan.sums.append(kernels.SumTerm(v, sign, plan.new_vec(cols)))
    return plan


@pytest.mark.parametrize("seed", range(24))
def test_local_plans_sum_to_the_global_plan(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    shapes = [(rng.randint(1, 9), rng.randint(1, 7)), (rng.randint(1, 9),), (rng.randint(1, 3), rng.randint(2, 8), 5)]
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    plan = _random_plan(rng, shapes)
    layouts = []
    for s in shapes:
        if rng.random() < 0.2:
            layouts.append(ShardLayout(None))
        else:
            d = rng.randrange(len(s))
            layouts.append(ShardLayout(d, _shard_ranges(s[d], world, rng.random() < 0.5, rng)))
    want = kernels.evaluate_reference(plan, full, fp64=True)
    got_vec, got_grams = torch.zeros_like(want[0]), {d: torch.zeros_like(x) for d, x in want[1].items()}
    owners = []
    for r in range(world):
        local_t = [t if lay.dim is None else t.narrow(lay.dim, *lay.ranges[r]) for t, lay in zip(full, layouts)]
        local, straddles = localize(plan, layouts, r, world, [t.dtype for t in full])
        vec, grams = kernels.evaluate_reference(local, local_t, fp64=True)
        got_vec += vec
        for d in grams:
            got_grams[d] += grams[d]
        owners.append([(id(s.term), s.owner) for s in straddles])
        if r == 0:
            for s in straddles:  # the straddling Gram terms, evaluated once on the gathered rows
                pieces = [p.of(t) for p, t in ((p, full[s.term.view.tensor].narrow(
                    layouts[s.term.view.tensor].dim, *layouts[s.term.view.tensor].ranges[q]))
                    for q, p in enumerate(s.pieces)) if p is not None]
                x = torch.cat(pieces)
                torch.testing.assert_close(x, s.term.view.of(full[s.term.view.tensor]))  # rows in order
                got_grams[s.term.view.rows][s.term.slot] += s.term.sign * x @ x.T
    assert all(o == owners[0] for o in owners), "ranks disagree on the straddling terms"
    torch.testing.assert_close(got_vec, want[0], rtol=1e-12, atol=1e-12)
    for d in want[1]:
        torch.testing.assert_close(got_grams[d], want[1][d], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(16))
def test_sharded_sampler_groups_are_the_global_plans(seed):
    """The drift sampler over sharded tensors (``Sampler`` with ``sampler_shards``), process free: every
    rank packs the same groups, which cover every law entry once; in each group, the ranks' sub-plans
    over their copies (plus the group's straddling Gram terms on the gathered rows) sum to the global
    plan at the group's entries (0 elsewhere); each rank's copies fit its budget, or the group is
    one unit."""
    rng = random.Random(100 + seed)
    world = rng.choice([2, 3, 4])
    shapes = [(rng.randint(1, 9), rng.randint(1, 7)), (rng.randint(1, 9),), (rng.randint(1, 3), rng.randint(2, 8), 5)]
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    plan = _random_plan(rng, shapes)
    layouts = [ShardLayout(None) if rng.random() < 0.2 else ShardLayout(d, _shard_ranges(s[d], world, rng.random() < 0.5, rng))
               for s, d in ((s, rng.randrange(len(s))) for s in shapes)]
    sched = comm_schedule(_compiled_of(plan, shapes), layouts, [t.dtype for t in full])
    budget = rng.choice([0.1, 0.3, 0.6])
    locals_ = [[t if lay.dim is None else t.narrow(lay.dim, *lay.ranges[r]) for t, lay in zip(full, layouts)]
               for r in range(world)]
    samplers = [Sampler(plan, locals_[r], budget, "cpu",
                        shards=sampler_shards(sched, shapes, [8] * len(shapes), layouts, r)) for r in range(world)]
    keys = [[[u.key for u in grp] for grp in s.groups] for s in samplers]
    assert all(k == keys[0] for k in keys), "ranks pack different groups"
    assert len(keys[0]) >= 2  # (2 to 20 groups over the seeds)
    want = kernels.evaluate_reference(plan, full, fp64=True)
    seen_v = torch.zeros(plan.vec_size, dtype=torch.long)
    seen_g = {d: torch.zeros(n, dtype=torch.long) for d, n in plan.gram_slots.items()}
    for j in range(len(samplers[0].groups)):
        vec, grams = torch.zeros_like(want[0]), {d: torch.zeros_like(x) for d, x in want[1].items()}
        for r, s in enumerate(samplers):
            snap = s.snapshot(j, locals_[r])
            copied = sum(o.numel() * o.element_size() for o in snap.olds)
            assert copied <= budget * s.tracked_bytes or len(s.groups[j]) == 1, (copied, s.tracked_bytes)
            if snap.plan.grams or snap.plan.norms or snap.plan.sums:
                v, gr = kernels.evaluate_reference(snap.plan, snap.olds, fp64=True)
                vec += v
                for d in gr:
                    grams[d] += gr[d]
        mask = samplers[0].mask(j)
        seen_v += mask.vec.long()
        for d in seen_g:
            seen_g[d] += mask.grams[d].long()
        for x in sched.straddles:
            if mask.gram_np[x.term.view.rows][x.term.slot]:
                rows = x.term.view.of(full[x.term.view.tensor])
                grams[x.term.view.rows][x.term.slot] += x.term.sign * rows @ rows.T
        torch.testing.assert_close(vec, torch.where(mask.vec, want[0], 0.0), rtol=1e-12, atol=1e-12)
        for d in want[1]:
            torch.testing.assert_close(grams[d], torch.where(mask.grams[d][:, None, None], want[1][d], 0.0),
                                       rtol=1e-12, atol=1e-12)
    written = torch.zeros(plan.vec_size, dtype=torch.bool)
    for t in plan.norms:
        written[t.index + t.index_stride * torch.arange(t.view.rows)] = True
    for t in plan.sums:
        written[t.index: t.index + t.view.cols] = True
    assert (seen_v == written.long()).all() and all((seen_g[d] == 1).all() for d in seen_g)


def _compiled_of(plan, shapes):
    """A stand-in for ``Compiled`` with one ``per="entry"`` vector law over the whole vector part (what
    ``comm_schedule`` reads of it: the plan, the laws' families and where they are)."""
    from types import SimpleNamespace

    law = SimpleNamespace(family="f", layer=None, per="entry", name="f")
    return SimpleNamespace(plan=plan, laws=[law], where=[("vec", 0, plan.vec_size)], names=[str(i) for i in range(len(shapes))])


@pytest.mark.parametrize("seed", range(4))
def test_local_plans_run_on_the_triton_kernels(seed):
    # the local plans (offset views, strided and empty shards) through the Triton path (interpreted on CPU)
    rng = random.Random(seed)
    world = 3
    shapes = [(rng.randint(2, 9), rng.randint(1, 7)), (rng.randint(1, 9),), (2, rng.randint(2, 8), 5)]
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=g) for s in shapes]
    plan = _random_plan(rng, shapes)
    layouts = [ShardLayout(d, _shard_ranges(s[d], world, True, rng)) for s, d in zip(shapes, (0, 0, 1))]
    ran = 0
    for r in range(world):
        local_t = [t.narrow(lay.dim, *lay.ranges[r]) for t, lay in zip(full, layouts)]
        local, _ = localize(plan, layouts, r, world, [t.dtype for t in full])
        if local.grams or local.norms or local.sums:
            want = kernels.evaluate(local, local_t, backend="torch")
            got = kernels.evaluate(local, local_t, backend="triton")
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
            for d in want[1]:
                torch.testing.assert_close(got[1][d], want[1][d], rtol=1e-5, atol=1e-6)
            ran += 1
    assert ran


# ------------------------------------------------------------------------------------------- spawning
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, queue, args):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT // 2))
        out = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


def _spawn(fn, world, *args):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns {rank: result}; any error or a
    hang (TIMEOUT) fails the test."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + TIMEOUT
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                pytest.fail(f"distributed test hung: ranks {sorted(set(range(world)) - set(results))} did not finish "
                            f"in {TIMEOUT}s")
            if queue.empty():
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    pytest.fail(f"a rank died: exit codes {[p.exitcode for p in procs]}")
                time.sleep(0.05)
                continue
            rank, status, out = queue.get()
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{out}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results


# ----------------------------------------------------------------------------------------- helpers
def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(**cfg))


def _batch(step, rank, vocab):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, 6), generator=g)


def _loss(model, x):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@torch.no_grad()
def _full(model):
    """Full parameters by unwrapped name (a collective for DTensors: same order on every rank)."""
    out = {}
    for n, p in model.named_parameters():
        n = n.replace("module.", "", 1) if n.startswith("module.") else n
        out[n] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    return out


class _Counter:
    """A monitor: counts ``update`` calls (one per optimizer step on every tracker)."""

    def __init__(self):
        self.n = 0

    def update(self):
        self.n += 1

    def metrics(self):
        return {"monitor/updates": float(self.n)}


class _Reference:
    """A single-process ``Tracker`` on an unsharded copy, fed the gathered full parameters."""

    def __init__(self, cfg, laws, dtype=torch.float32, **kw):
        # values are overwritten by the gathered ones; an fp64 copy makes the reference exact in fp64 mode
        # (a Tracker on fp32 weights rounds a*theta_k to fp32 before its fp64 evaluation)
        self.model = _model(cfg, seed=123).to(dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, weight_decay=WD)  # decay factors only
        for p in self.model.parameters():  # stepped (a parameter without grad is not: no decay), never stepped here
            p.grad = torch.zeros_like(p)
        self.sink = MemorySink()
        self.named = dict(self.model.named_parameters())
        self.kw, self.laws = kw, laws
        self.tracker = None

    @torch.no_grad()
    def load(self, full):
        for n, p in full.items():
            self.named[n].copy_(p)

    def start(self, full):
        self.load(full)
        self.tracker = Tracker(self.model, self.laws, sinks=[self.sink], **{**FULL, **self.kw})


def _check_rows(got, want, what, rtol=1e-6, atol=1e-12):
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for a, b in zip(got, want):
        assert a.keys() == b.keys(), what
        for k in b:
            x, y = float(a[k]), float(b[k])
            if math.isnan(y):  # a drift column of a step that did not decompose the drift
                assert math.isnan(x), f"{what} step {b['step']} {k}: {x} != nan"
                continue
            assert abs(x - y) <= rtol * abs(y) + atol, f"{what} step {b['step']} {k}: {x} != {y}"


def _check_values(got, want, rtol, what):
    assert got.keys() == want.keys()
    for k in want:
        err = (got[k].double() - want[k].double()).norm()
        assert err <= rtol * want[k].double().norm() + 1e-30, \
            f"{what} {k}: |diff| {err:.3g} vs |h| {want[k].norm():.3g}"


def _train(model, opt, trackers, refs, steps, rank, vocab, first=1):
    """Steps ``first..first+steps-1``: each tracker drives its own before/after around one optimizer step."""
    for k in range(first, first + steps):
        opt.zero_grad()
        loss = _loss(model, _batch(k, rank, vocab))
        loss.backward()
        for r in refs:
            r.tracker.before_step(r.opt)
        for t in trackers:
            t.before_step(opt)
        opt.step()
        for t in trackers:
            t.after_step()
            t.record(loss=loss.detach())
        full = _full(model)
        for r in refs:
            r.load(full)
            r.tracker.after_step()
            r.tracker.record(loss=loss.detach())


def _fsdp(cfg, world, seed=0, dim1=()):
    """FSDP2 per layer + root; the 2-D weights whose name has a part in ``dim1`` on ``Shard(1)`` (a
    ``shard_placement_fn``, as docs/distributed.md recommends), the rest on the default ``Shard(0)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _model(cfg, seed)
    laws, _ = model.conservation_laws()
    mesh = init_device_mesh("cpu", (world,))
    names = {id(p): n for n, p in model.named_parameters()}
    place = (lambda p: Shard(1) if p.ndim == 2 and set(names[id(p)].split(".")) & set(dim1) else None) if dim1 else None
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=place)
    fully_shard(model, mesh=mesh, shard_placement_fn=place)
    return model, laws


def _compare_run(rank, world, model, laws, cfg, what, *, data_rank=None):
    """Three distributed trackers (fp64 with drift terms at every step; fp32 without; fp64 with the drift
    on every 2nd step) against three single-process references. SGD with weight decay: the decay factor
    a = 1 - lr*wd enters the drift terms."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    sinks = [MemorySink(), MemorySink(), MemorySink()]
    trackers = [DistributedTracker(model, laws, every=EVERY, fp64=True, sinks=[sinks[0]], monitors=[_Counter()],
                                   **FULL),  # DDP: every law at every drift step, as the reference
                DistributedTracker(model, laws, every=2 * EVERY, fp64=False, drift=False, sinks=[sinks[1]],
                                   backend="torch", max_pending_bytes=1)]  # all-reduce at every step
    if trackers[0]._comm:
        assert trackers[0]._reduce_every == EVERY and trackers[1]._reduce_every == 1
    refs = [_Reference(cfg, laws, torch.float64, every=EVERY, fp64=True, monitors=[_Counter()]),
            _Reference(cfg, laws, every=2 * EVERY, fp64=False, drift=False)]
    if CADENCE:
        trackers.append(DistributedTracker(model, laws, every=EVERY + 1, fp64=True, drift_every=2, sinks=[sinks[2]],
                                           snapshot_budget=None))
        refs.append(_Reference(cfg, laws, torch.float64, every=EVERY + 1, fp64=True, drift_every=2))
    full = _full(model)
    for r in refs:
        r.start(full)
    # h_0 and the guards equal the single-process ones
    _check_values({"h0": trackers[0].h0.vec, **{f"g{d}": g for d, g in trackers[0].h0.grams.items()}},
                  {"h0": refs[0].tracker.h0.vec, **{f"g{d}": g for d, g in refs[0].tracker.h0.grams.items()}},
                  1e-12, what + " h0")
    torch.testing.assert_close(trackers[0].denom, refs[0].tracker.denom, rtol=1e-12, atol=0)
    _train(model, opt, trackers, refs, STEPS, rank if data_rank is None else data_rank, cfg["vocab_size"])
    _check_values(trackers[0].values(), refs[0].tracker.values(), 1e-12, what + " fp64")
    _check_values(trackers[1].values(), refs[1].tracker.values(), 1e-6, what + " fp32")
    if CADENCE:
        _check_values(trackers[2].values(), refs[2].tracker.values(), 1e-12, what + " drift_every=2")
    assert all(t._snap is None and t._old is None for t in trackers if t._comm)  # the copies are dropped after each step
    for k in ("decay", "first", "second"):
        _check_values(dict(enumerate(trackers[0].cumulative[k].grams.values())),
                      dict(enumerate(refs[0].tracker.cumulative[k].grams.values())), 1e-9, f"{what} cumulative {k}")
    for t, r in zip(trackers, refs):
        t.close()
        r.tracker.close()
    if rank == 0:
        _check_rows(sinks[0].records, refs[0].sink.records, what)
        # fp32 rows: eps_i = |h_i - h0_i| / |h0_i| divides fp32 rounding (~1e-7 |terms|) by entries that may
        # be 1e-4 of their terms, so two summation orders agree to ~1e-3 only (the values above: 1e-6)
        _check_rows(sinks[1].records, refs[1].sink.records, what + " fp32", rtol=1e-2, atol=1e-6)
        if CADENCE:
            _check_rows(sinks[2].records, refs[2].sink.records, what + " drift_every=2")
            assert [math.isnan(r["drift/vo/first"]) for r in sinks[2].records] == [k % 2 == 0 for k in range(1, STEPS + 1)]
        assert len(sinks[0].records) == STEPS and "eps/vo" in sinks[0].records[0]
        assert sinks[0].records[-1]["monitor/updates"] == STEPS
    else:
        assert sinks[0].records == sinks[1].records == sinks[2].records == [], "only rank 0 writes"
    return trackers[0]


# --------------------------------------------------------------------------------------- scenarios
def _scenario_fsdp(rank, world, cfg, tmpdir, dim1=()):
    """FSDP2 (fully_shard per layer + root) vs single process; then a DCP save/resume."""
    model, laws = _fsdp(cfg, world, dim1=dim1)
    assert wants_distributed(model)
    t = _compare_run(rank, world, model, laws, cfg, f"fsdp{world}")
    # the planner bench/dist_bytes.py uses (torch.chunk layouts, no process group) sees what FSDP2 built
    named = dict(model.named_parameters())
    shapes = [tuple(named[n].shape) for n in t.compiled.names]
    dims = [1 if len(sh) == 2 and set(n.split(".")) & set(dim1) else 0 for n, sh in zip(t.compiled.names, shapes)]
    plan = comm_schedule(t.compiled, shard_layouts(shapes, dims, world), [torch.float32] * len(shapes))
    assert plan.split_size == t._split.size and len(plan.straddles) == len(t._straddles)
    assert [s.owner for s in plan.straddles] == [s.owner for s in t._straddles]
    info = {"straddles": len(t._straddles), "comm": t._comm, "bytes": flush_bytes(t),
            "split": t._split.size if t._comm else 0,
            "straddling": sorted({t.compiled.names[s.term.view.tensor] for s in t._straddles}) if t._comm else [],
            "empty": [n for n, p in model.named_parameters() if p.to_local().numel() == 0]}
    if tmpdir is not None:
        info["resume"] = _resume(rank, world, cfg, tmpdir)
    return info


def _resume(rank, world, cfg, tmpdir):
    """Run 6 steps with a DCP checkpoint after step 3 (a pending, unreduced step inside); a fresh model,
    optimizer and tracker loaded from it continue the same series (rows, values and totals). A snapshot
    budget with the drift at every step: the resumed tracker decomposes the same groups (the sampler's
    position is the step count), the first of them right after the load (h_k then comes from the group's
    copies of theta_k)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_model_state_dict,
                                                         set_optimizer_state_dict, set_model_state_dict)

    def build(seed):
        model, laws = _fsdp(cfg, world, seed)
        inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        sink = MemorySink()
        opt = track(inner, model, every=EVERY, sinks=[sink], drift_every=1, snapshot_budget=0.2)  # fp32
        return model, inner, opt, sink

    def run(model, opt, first, n):
        for k in range(first, first + n):
            opt.zero_grad()
            loss = _loss(model, _batch(k, rank, cfg["vocab_size"]))
            loss.backward()
            opt.step()
            opt.record(loss=loss.detach())

    model, inner, opt, sink = build(0)
    run(model, opt, 1, 3)
    assert opt.tracker._pend, "steps not yet reduced when the checkpoint is taken"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, inner),
              "conserve": opt.tracker.state_dict()}, checkpoint_id=tmpdir)
    flushed = len(sink.records)  # state_dict() reduced and wrote the pending steps: none is repeated or lost
    if rank == 0:
        assert flushed == 3, [r["step"] for r in sink.records]
    run(model, opt, 4, 3)
    want_values, want_totals = opt.tracker.values(), opt.tracker.totals()
    assert len(opt.tracker.sampler.groups) > 3
    opt.close()

    model2, inner2, opt2, sink2 = build(7)  # different initial weights: everything must come from the checkpoint
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, inner2),
             "conserve": opt2.tracker.state_dict()}
    dcp.load(state, checkpoint_id=tmpdir)
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, inner2, state["optim"])
    opt2.tracker.load_state_dict(state["conserve"])
    run(model2, opt2, 4, 3)
    got_values, got_totals = opt2.tracker.values(), opt2.tracker.totals()
    opt2.close()
    _check_values(got_values, want_values, 1e-7, "resumed values")
    for f, want in want_totals.items():
        for k, v in want.items():
            assert abs(got_totals[f][k] - v) <= 1e-5 * abs(v) + 1e-12, (f, k, got_totals[f][k], v)
    if rank == 0:
        assert sink2.records and sink2.records[0]["step"] == flushed + 1, [r["step"] for r in sink2.records]
        _check_rows(sink2.records, sink.records[flushed:], "resumed series")
        assert "loss" in sink2.records[0]
    return flushed


def _scenario_ddp(rank, world, cfg):
    """DDP: replicated parameters, no communication by the tracker, identical values on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(cfg)
    laws, _ = model.conservation_laws()
    ddp = DDP(model)
    assert wants_distributed(ddp)
    t = _compare_run(rank, world, ddp, None, cfg, f"ddp{world}")
    assert not t._comm
    h = torch.cat([v.reshape(-1) for v in t.values().values()]).double()
    allh = [torch.zeros_like(h) for _ in range(world)]
    dist.all_gather(allh, h)
    assert all(torch.equal(x, allh[0]) for x in allh), "ranks disagree"


def _tp(cfg, world, seed=0):
    """Tensor parallel: ColwiseParallel on q/k/v/gate/up (Shard(0)), RowwiseParallel on o/down (Shard(1));
    norms, embeddings and lm_head stay replicated plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(cfg, seed)
    laws, _ = model.conservation_laws()  # before the heads are split (global head counts)
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i, layer in enumerate(model.layers):
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"layers.{i}.self_attn.{n}"] = ColwiseParallel()
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
        layer.self_attn.nh //= world  # the attention runs on the local heads
        layer.self_attn.nkv //= world
    parallelize_module(model, mesh, plan)
    return model, laws


def _scenario_tp(rank, world, cfg):
    """Tensor parallel (``_tp``) against one process: every rank sees the same batch."""
    model, laws = _tp(cfg, world)
    kinds = {type(p).__name__ for p in model.parameters()}
    assert kinds == {"DTensor", "Parameter"}, kinds
    t = _compare_run(rank, world, model, laws, cfg, f"tp{world}", data_rank=0)  # TP: every rank, same batch
    assert t._comm and not t._straddles


def _sampled_expected(ref, mask):
    """Per family and term, the norm over the family's entries in ``mask`` of the reference's per-entry terms
    (``ref.tracker.last``: every entry decomposed), NaN for a family with none: the row of a sampled step."""
    tr = ref.tracker
    out, hit = {}, torch.zeros(len(tr.families), dtype=torch.bool)
    hit.index_fill_(0, tr.layout.vec_fam[mask.vec].long(), True)
    for d, m in mask.grams.items():
        hit.index_fill_(0, tr.layout.gram_fam[d][m].long(), True)
    for t in TERMS:
        v = tr.last[t]
        sq = torch.zeros(len(tr.families), dtype=torch.float64).index_add_(
            0, tr.layout.vec_fam.long(), torch.where(mask.vec, v.vec.double(), 0.0) ** 2)
        for d, g in v.grams.items():
            sq.index_add_(0, tr.layout.gram_fam[d].long(), (torch.where(mask.grams[d][:, None, None], g.double(), 0.0) ** 2).sum((1, 2)))
        for i, f in enumerate(tr.families):
            out[f"drift/{f}/{t}"] = sq[i].sqrt().item() if hit[i] else float("nan")
    return out, hit


def _scenario_sampled(rank, world, cfg, drift_every, budget=0.2, steps=STEPS, build=None, lr=LR, wd=WD,
                      cumulative=True):
    """FSDP2 with a snapshot budget: each drift step decomposes one group of the GLOBAL plan (the same on
    every rank); its drift columns, ``cumulative``, ``sampled_steps`` and ``totals()`` equal those of a
    single-process Tracker that decomposes every entry (``keep_last``), restricted to the group's
    entries. The storages ``before_step`` creates (the copies) fit this rank's budget, and a whole step
    leaves no weight-sized storage alive (the pending pack and h_{k+1} only).  ``cumulative=False``
    (the default of sampled drift): no per-entry cumulative buffer on any rank, ``totals()`` without the
    per-entry decomposition, its ``sum_step_<term>`` the sums of the expected rows' drift columns."""
    from bench.track_overhead import LiveBytes

    model, laws = (build or _fsdp)(cfg, world)
    data_rank = 0 if build is _tp else rank  # tensor parallel: every rank, same batch
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    sink = MemorySink()
    t = DistributedTracker(model, laws, every=EVERY, fp64=True, sinks=[sink], drift_every=drift_every,
                           snapshot_budget=budget, **({"cumulative": True} if cumulative else {}))
    assert t.keep_cumulative is cumulative
    if not cumulative:
        assert not t.cumulative and not getattr(t, "_cum_p", {}) and not getattr(t, "_cum_split", {})
    ref = _Reference(cfg, laws, torch.float64, every=EVERY, fp64=True, keep_last=True)
    ref.opt = torch.optim.SGD(ref.model.parameters(), lr=lr, weight_decay=wd)
    ref.start(_full(model))
    s = t.sampler
    assert s.shards is not None and len(s.groups) >= 3, len(s.groups)
    mine = sum(x.numel() * x.element_size() for x in t.tensors)
    assert s.tracked_bytes == mine  # this rank's bytes (uneven and empty shards included)
    cap = budget * mine
    # budget None: every local shard the laws read, whole (the previous behaviour)
    every_law = Sampler(t.compiled.plan, t.tensors, None, t.device, shards=t._shards)
    snap = every_law.snapshot(0, t.tensors)
    assert every_law.groups == [None] and snap.mask.full and snap.plan is t._local_plan
    lp = t._local_plan
    read = {v.view.tensor for v in list(lp.grams) + list(lp.norms) + list(lp.sums)}
    assert sum(o.numel() * o.element_size() for o, x in zip(snap.olds, t.tensors) if o.data_ptr() != x.data_ptr()) \
        == sum(t.tensors[i].numel() * t.tensors[i].element_size() for i in read)
    del snap
    rows, copied, cum, straddled, seen = [], [], {k: None for k in TERMS[:4]}, 0, []
    sampled = torch.zeros(len(t.families), dtype=torch.long)
    for k in range(1, steps + 1):
        opt.zero_grad()
        _loss(model, _batch(k, data_rank, cfg["vocab_size"])).backward()
        ref.tracker.before_step(ref.opt)
        drift = t.is_drift_step()
        with LiveBytes() as m:
            t.before_step(opt)
        assert (t._snap is not None) == drift
        if drift:
            j = (k - 1) // drift_every
            group = s.groups[j % len(s.groups)]
            mask = t._snap.mask
            # the copies made right before the step: this rank's pieces of the group's views only
            assert m.cur == t._snap.bytes() + sum(x.numel() * x.element_size() for x in t._old[1].values())
            assert m.cur <= sum(int(u.cost[rank]) for u in group)
            assert m.cur <= cap or len(group) == 1, (m.cur, cap)
            copied.append(m.cur)
            seen.append(j)
        opt.step()
        with LiveBytes() as m:
            t.after_step()
        assert t._snap is None and t._old is None
        straddled += bool(t._pend and t._pend[-1].sel)
        kept = t._pend[-1].pack if t._pend else None
        law = sum(v.numel() * v.element_size() for v in [t._hp.vec, *t._hp.grams.values()])
        held = sum(b.numel() * b.element_size() for p in t._pend if p.held for bl in p.held.values() for b in bl)
        split = t._h_split.numel() * t._h_split.element_size()  # (replaced at a flush)
        assert m.cur <= law + split + (0 if kept is None else kept.numel() * kept.element_size()) + held + 1024, \
            (m.cur, sorted(m.live.values()))
        ref.load(_full(model))
        ref.tracker.after_step()
        want = dict(zip(ref.tracker.metric_names, ref.tracker._rows[-1].tolist()))
        if drift:
            exp, hit = _sampled_expected(ref, mask)
            want.update(exp)
            sampled += hit.long()
            for c in cum:
                v = ref.tracker.last[c]
                part = Values(torch.where(mask.vec, v.vec, 0.0), {d: torch.where(mask.grams[d][:, None, None], g, 0.0)
                                                                  for d, g in v.grams.items()})
                cum[c] = part if cum[c] is None else cum[c].map(torch.add, part)
        else:
            want.update({n: float("nan") for n in want if n.startswith("drift/")})
        rows.append({"step": k, **want})
    tot, ref_tot = t.totals(), ref.tracker.totals()
    # straddling rows received (owner only): theta_{k+1} at every step and h_0, theta_k only when the group has the term
    want_rows = 0
    for x in t._straddles:
        if x.owner == rank:
            n = x.sizes()
            picked = sum(bool(s.mask(j).gram_np[x.term.view.rows][x.term.slot]) for j in seen)
            want_rows += (sum(n) - n[rank]) * (1 + steps + picked) * t._xdtype.itemsize
    assert t.comm_bytes["rows_received"] == want_rows, (t.comm_bytes, want_rows)
    for i, f in enumerate(t.families):  # the sums of the per-step family norms (either way)
        for c in cum:
            want_sum = math.fsum(r[f"drift/{f}/{c}"] for r in rows if r[f"drift/{f}/{c}"] == r[f"drift/{f}/{c}"])
            assert abs(tot[f][f"sum_step_{c}"] - want_sum) <= 1e-5 * want_sum + 1e-12, (f, c, tot[f], want_sum)
        assert tot[f]["cumulative"] is cumulative
    if not cumulative:  # nothing per entry was held, and nothing per entry is reported
        assert not t.cumulative and not t._cum_p and not t._cum_split
        assert all(not {"decay", "first", "second", "predicted", "measured_sampled"} & set(tot[f]) for f in tot), tot
    for c in cum if cumulative else ():
        got = t.cumulative[c]
        _check_values({"v": got.vec, **{f"g{d}": g for d, g in got.grams.items()}},
                      {"v": cum[c].vec, **{f"g{d}": g for d, g in cum[c].grams.items()}}, 1e-9, f"sampled cumulative {c}")
    assert torch.equal(t.sampled_steps.cpu(), sampled), (t.sampled_steps, sampled)
    for i, f in enumerate(t.families):
        assert tot[f]["sampled_steps"] == sampled[i].item() and tot[f]["steps"] == steps
        for key in ("measured", "eps", "scale"):
            assert abs(tot[f][key] - ref_tot[f][key]) <= 1e-9 * abs(ref_tot[f][key]) + 1e-15, (f, key)
        want_n = {c: (cum[c].vec[ref.tracker.layout.vec_fam == i].double().norm() ** 2
                      + sum((g[ref.tracker.layout.gram_fam[d] == i].double() ** 2).sum() for d, g in cum[c].grams.items())).sqrt().item()
                  for c in cum}
        for c, key in (("measured", "measured_sampled"), ("decay", "decay"), ("first", "first"), ("second", "second")):
            if cumulative:
                assert abs(tot[f][key] - want_n[c]) <= 1e-9 * want_n[c] + 1e-15, (f, key, tot[f][key], want_n[c])
    t.close()
    ref.tracker.close()
    # after close(): no drift copy, nothing booked (one warning), nothing pending
    opt.zero_grad()
    _loss(model, _batch(0, data_rank, cfg["vocab_size"])).backward()
    t.before_step(opt)
    assert t._snap is None and not t.is_drift_step()
    opt.step()
    with pytest.warns(RuntimeWarning, match="closed"):
        t.after_step()
    assert t.step_count == steps and not t._pend
    if rank == 0:
        _check_rows(sink.records, rows, "sampled")
    full_bytes = mine  # budget None copies every local shard the laws read
    return {"groups": len(s.groups), "copied": copied, "mine": mine, "cap": cap, "full": full_bytes,
            "straddled": straddled, "straddle_groups": sorted({j for j in range(len(s.groups)) for x in t._straddles
                                                               if s.mask(j).gram_np[x.term.view.rows][x.term.slot]})}


def _world3(rank, world, tmpdir):
    info = _scenario_fsdp(rank, world, {**CFG, **MOE}, tmpdir)
    info["sampled"] = _scenario_sampled(rank, world, {**CFG, **MOE}, 1)
    _scenario_ddp(rank, world, SMALL)
    return info


def _scenario_mismatch(rank, world, cfg):
    """Ranks that build different law sets get a UsageError on every rank (not a hang)."""
    from conserve.errors import UsageError

    model, laws = _fsdp(cfg, world)
    with pytest.raises(UsageError, match="different laws"):
        DistributedTracker(model, laws if rank == 0 else laws[:-1])


# heads of D=4 on 2 ranks: k_proj/v_proj have 12 rows (6/6: kv head 1, rows 4..7, straddles), q_proj 24
# (12/12: aligned); layer 0 (no RoPE) has QK Gram laws on k_proj too
STRADDLE2 = {**CFG, "num_attention_heads": 6, "num_key_value_heads": 3}
_COMM = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "isend", "irecv", "send", "recv",
         "batch_isend_irecv", "barrier", "gather", "scatter", "reduce")


class _CommLog:
    """Records every torch.distributed call made inside the ``with`` block: (name, bytes of its tensor, peer)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in _COMM if hasattr(dist, n)}
        for n, f in self._saved.items():
            setattr(dist, n, self._wrap(n, f))
        return self

    def _wrap(self, name, f):
        def call(*args, **kw):
            t = args[0] if args and torch.is_tensor(args[0]) else None
            peer = kw.get("src", kw.get("dst", args[1] if len(args) > 1 and isinstance(args[1], int) else None))
            self.calls.append((name, 0 if t is None else t.numel() * t.element_size(), peer))
            return f(*args, **kw)
        return call

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(dist, n, f)

    def names(self):
        return sorted({c[0] for c in self.calls})


def _scenario_collectives(rank, world, cfg):
    """Per flush: exactly one all-reduce, of the pending steps' packs (row partials + split partials), and
    the straddling rows sent point to point to their owners only: each rank receives exactly the rows of
    the terms it owns that it does not hold (checked against the laws' views, not the tracker's counts)."""
    model, laws = _fsdp(cfg, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    t = DistributedTracker(model, laws, every=EVERY, drift_every=1, snapshot_budget=None)
    log = _CommLog()
    for k in range(1, STEPS + 1):
        opt.zero_grad()
        _loss(model, _batch(k, rank, cfg["vocab_size"])).backward()
        with log:
            t.before_step(opt)
        opt.step()
        with log:
            t.after_step()
    with log:
        t.flush()
    flushes = -(-STEPS // EVERY)
    reduces = [c for c in log.calls if c[0] == "all_reduce"]
    assert len(reduces) == flushes, log.calls
    assert set(log.names()) <= {"all_reduce", "isend", "irecv"}, log.names()
    assert sum(c[1] for c in reduces) == t._schedule.step_scalars(True) * STEPS * 4  # drift terms at every step
    # straddling rows this rank must receive, from the plan's views alone: the rows of each term it owns
    # that lie in another rank's shard (2 blocks per step: new and old; 1 block at construction, for h_0)
    names = t.compiled.names
    want = 0
    for s in t._straddles:
        assert s.pieces[s.owner] is not None, "the owner holds some of the term's rows"
        if s.owner != rank:
            continue
        v = s.term.view
        lo, hi = t._layouts[v.tensor].ranges[rank][0], sum(t._layouts[v.tensor].ranges[rank])
        mine = sum(lo <= v.start[v.row_dim] + i * v.row_step < hi for i in range(v.rows))
        want += (v.rows - mine) * v.cols * 4
        assert names[v.tensor].split(".")[-2] in ("k_proj", "v_proj"), names[v.tensor]  # weights and biases
    from conserve.errors import UsageError

    with pytest.raises(UsageError, match="sharded"):  # full values cannot be booked as partial sums
        t.record_step(t.h0)
    got = sum(c[1] for c in log.calls if c[0] == "irecv")
    assert got == 2 * STEPS * want and t.comm_bytes["rows_received"] == (2 * STEPS + 1) * want
    assert flush_bytes(t, STEPS)["rows_received"] == 2 * STEPS * want
    recvs = [c for c in log.calls if c[0] == "irecv"]
    assert len(recvs) == flushes * len({c[2] for c in recvs})  # one message per peer per flush
    t.close()
    return {"straddles": len(t._straddles), "received": got, "owned": sum(s.owner == rank for s in t._straddles),
            "irecv_peers": sorted({c[2] for c in log.calls if c[0] == "irecv"})}


def _scenario_nan(rank, world, cfg, tmpdir=None):
    """A NaN in one rank's shard stops every rank at the flush, naming the step; rows before it are written."""
    from conserve.errors import NonFiniteError

    model, laws = _fsdp(cfg, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    sink = MemorySink()
    t = DistributedTracker(model, laws, every=4, sinks=[sink])
    for k in range(1, 4):
        opt.zero_grad()
        _loss(model, _batch(k, rank, cfg["vocab_size"])).backward()
        t.before_step(opt)
        opt.step()
        if k == 3 and rank == 1:
            with torch.no_grad():
                w = dict(model.named_parameters())["layers.1.mlp.up_proj.weight"].to_local()
                w[0, 0] = float("nan")
        t.after_step()
    with pytest.raises(NonFiniteError, match="step 3"):
        t.flush()
    if rank == 0:
        assert [r["step"] for r in sink.records] == [1, 2]
    else:
        assert sink.records == []
    # go on: the NaN weights step twice more (rows 4, 5 bad), are repaired, then steps 6-9 are finite; the
    # flush due inside after_step of step 8 raises once for rows 4 and 5, after step 8 is pending
    raised = []
    for k in range(4, 10):
        if k == 6:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().nan_to_num_(0.0)
        opt.zero_grad()
        _loss(model, _batch(k, rank, cfg["vocab_size"])).backward()
        t.before_step(opt)
        opt.step()
        try:
            t.after_step()
        except NonFiniteError as e:
            raised.append((k, str(e)))
    assert [k for k, _ in raised] == [8] and "step 4" in raised[0][1] and "1 more" in raised[0][1]  # one error
    t.flush()
    assert t.step_count == 9  # every step the optimizer applied is booked
    if rank == 0:
        assert [r["step"] for r in sink.records] == [1, 2, 6, 7, 8, 9]
    t.close()


def _scenario_inexact_decay(rank, world, cfg):
    """QA: a decay factor a = 1 - lr*wd that is no fp32 number (here 1 - 1e-3): the drift assembly corrects
    first/second with h_k, which was the full (reduced) h on every rank at the first step (split entries
    corrected once per rank) and zero for the straddling heads' terms; rows equal the single-process ones. The last
    step is still pending at close(): its recorded loss is written too."""
    model, laws = _fsdp(cfg, world)
    lr, wd = 0.05, 0.02
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    sink = MemorySink()
    t = DistributedTracker(model, laws, every=EVERY, fp64=True, sinks=[sink], **FULL)
    assert t._comm and t._straddles
    ref = _Reference(cfg, laws, torch.float64, every=EVERY, fp64=True)
    ref.opt = torch.optim.SGD(ref.model.parameters(), lr=lr, weight_decay=wd)
    ref.start(_full(model))
    _train(model, opt, [t], [ref], 3, rank, cfg["vocab_size"])
    t.close()
    ref.tracker.close()
    if rank == 0:
        _check_rows(sink.records, ref.sink.records, "inexact decay factor")


def _world2(rank, world):
    info = _scenario_fsdp(rank, world, {**CFG, **MOE}, None)
    info["aligned"] = _scenario_collectives(rank, world, CFG)
    info["straddle"] = _scenario_fsdp(rank, world, STRADDLE2, None)
    info["placed"] = _scenario_fsdp(rank, world, STRADDLE2, None, dim1=("v_proj", "k_proj", "down_proj"))
    info["straddle_comm"] = _scenario_collectives(rank, world, STRADDLE2)
    info["sampled"] = _scenario_sampled(rank, world, CFG, 1)
    info["sampled_straddle"] = _scenario_sampled(rank, world, STRADDLE2, 2)
    info["sampled_tp"] = _scenario_sampled(rank, world, {**CFG, "num_hidden_layers": 1}, 1, build=_tp)
    # a = 1 - 1e-3, no fp32 number: the assembly's correction with each rank's share of h_k at the group's entries
    _scenario_sampled(rank, world, STRADDLE2, 1, lr=0.05, wd=0.02, cumulative=False)  # (the default there)
    _scenario_inexact_decay(rank, world, STRADDLE2)
    _scenario_nan(rank, world, CFG)
    _scenario_tp(rank, world, {**CFG, "num_hidden_layers": 1})
    _scenario_ddp(rank, world, SMALL)
    _scenario_mismatch(rank, world, SMALL)
    return info


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # (a half-built tracker collected)
def test_needs_an_initialised_process_group():
    from conserve.errors import UsageError

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(UsageError, match="init_process_group"):
        DistributedTracker(_model(SMALL))
    assert not wants_distributed(_model(SMALL))


def test_three_ranks_fsdp_straddling_heads_empty_shard_ddp_and_resume(tmp_path):
    res = _spawn(_world3, 3, str(tmp_path / "ckpt"))
    assert res[0]["straddles"] > 0 and res[0]["comm"]  # kv heads (and q heads) straddle 3/3/2 shards
    assert res[2]["empty"] == ["layers.1.mlp.router.weight"]  # dim 0 = 2 < 3 ranks: rank 2 holds nothing
    assert res[0]["bytes"]["rows_received"] + res[1]["bytes"]["rows_received"] > 0
    assert res[0]["resume"] == 3  # rows 1, 2 were flushed before the checkpoint; state_dict() wrote the pending step 3
    # a snapshot budget with uneven (3/3/2) and empty shards: each rank copied at most 0.2 of its own bytes
    for r in range(3):
        got = res[r]["sampled"]
        assert got["groups"] >= 3 and max(got["copied"]) <= got["cap"] < got["full"], got


def test_two_ranks_fsdp_tensor_parallel_and_ddp():
    res = _spawn(_world2, 2)
    assert res[0]["comm"] and res[0]["straddles"] == 0  # 8 kv rows 4/4 and 16 q rows 8/8: heads aligned
    assert res[0]["bytes"]["rows_received"] == 0 and res[0]["bytes"]["all_reduce"] > 0
    assert all(res[r]["aligned"]["straddles"] == 0 and res[r]["aligned"]["received"] == 0 for r in (0, 1))
    # kv head 1 of each layer's k_proj and v_proj straddles (4 terms, layer 0 also has QK Gram terms on k_proj);
    # owners alternate, and each rank receives rows only from the other (its only peer)
    st = [res[r]["straddle_comm"] for r in (0, 1)]
    assert res[0]["straddle"]["straddles"] == st[0]["straddles"] > 0
    assert st[0]["owned"] + st[1]["owned"] == st[0]["straddles"] and min(st[0]["owned"], st[1]["owned"]) > 0
    assert all(s["received"] > 0 and s["irecv_peers"] == [1 - r] for r, s in enumerate(st))
    # the same model with k/v_proj and down_proj on Shard(1): no weight row straddles (only the 1-D biases,
    # which FSDP2 shards on dim 0: a few scalars travel); values still equal the single-process ones
    placed, straddled = res[0]["placed"], res[0]["straddle"]
    assert placed["straddling"] and all(n.endswith("_proj.bias") for n in placed["straddling"]), placed["straddling"]
    assert any(n.endswith("v_proj.weight") for n in straddled["straddling"])
    total = lambda info: sum(res[r][info]["bytes"]["rows_received"] for r in (0, 1))  # noqa: E731
    assert 0 < total("placed") < total("straddle") / 10
    # a snapshot budget: per drift step each rank copies at most 0.2 of the bytes it holds (5x less than its
    # whole shards), every rank packs the same groups; with straddling heads, a group with one was decomposed
    for key in ("sampled", "sampled_straddle", "sampled_tp"):
        for r in (0, 1):
            got = res[r][key]
            assert got["groups"] == res[0][key]["groups"] >= 3 and max(got["copied"]) < got["full"], got
            if key != "sampled_tp":  # (TP: a replicated embedding's entry reads more than 0.2 of a rank's bytes:
                assert max(got["copied"]) <= got["cap"], got  # a unit of its own, checked in the scenario)
    assert res[0]["sampled_straddle"]["straddled"] > 0 and res[0]["sampled_straddle"]["straddle_groups"]


def test_dist_bytes_bench_prints_the_table(capsys):
    """``python -m bench.dist_bytes`` (the docs' table), one 70B layer on 2 and 16 ranks: the straddles
    appear at 16 ranks under FSDP2's default placement and vanish with ``v_proj`` on ``Shard(1)``."""
    from bench.dist_bytes import main

    main(["--layers", "1", "--ranks", "2", "16"])
    rows = {tuple(c.strip() for c in line.split("|")[:3]) for line in capsys.readouterr().out.splitlines() if "|" in line}
    assert ("fsdp2-default", "16", "8") in rows and ("fsdp2-default", "2", "0") in rows  # 8 value heads straddle
    assert ("v:1", "16", "0") in rows
