"""Lifecycle of a tracked run: ``with``, the exit-time flush, the NaN policy, and ``TrackedOptimizer``
as a real ``torch.optim.Optimizer`` (hooks, deepcopy, AMP flags, DCP, GradScaler-skipped steps)."""
import copy
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve.errors import NonFiniteError
from conserve.models import MLP


def _model(seed=0):
    torch.manual_seed(seed)
    return MLP([4, 8, 3])


def _step(m, opt, seed=0, scaler=None):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


def test_with_block_flushes_and_closes(tmp_path):
    m = _model()
    path = tmp_path / "m.jsonl"
    with conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50,
                        sinks=[conserve.JSONLSink(path)]) as opt:
        for i in range(7):
            _step(m, opt, i)
        assert path.read_text() == ""  # nothing due yet: every=50
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert opt.tracker._closed
    opt.close()  # a second close is a no-op


def test_with_block_keeps_rows_when_the_body_raises(tmp_path):
    m = _model()
    sink = conserve.MemorySink()
    with pytest.raises(KeyError):
        with conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50, sinks=[sink]) as opt:
            for i in range(3):
                _step(m, opt, i)
            raise KeyError("boom")
    assert [r["step"] for r in sink.records] == [1, 2, 3]


def test_forgotten_close_still_writes_rows_at_exit(tmp_path):
    path = tmp_path / "m.jsonl"
    script = textwrap.dedent(f"""
        import torch, torch.nn.functional as F, conserve, conserve.models
        torch.manual_seed(0)
        m = conserve.models.MLP([4, 8, 3])
        opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=50,
                             sinks=[conserve.JSONLSink({str(path)!r})])
        for i in range(30):
            opt.zero_grad(); F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward(); opt.step()
            opt.record(i=i)
        # no opt.close(): the interpreter exits with 30 rows pending
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert [r["i"] for r in rows] == list(range(30))


def test_garbage_collected_tracker_is_flushed(tmp_path):
    sink = conserve.MemorySink()

    def train():
        m = _model()
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50, sinks=[sink])
        for i in range(4):
            _step(m, opt, i)

    train()
    import gc
    gc.collect()
    assert [r["step"] for r in sink.records] == [1, 2, 3, 4]


def test_garbage_collected_inside_a_meta_device_block_is_flushed():
    # the collection can run anywhere, e.g. while the next model is built on the meta device: the flush
    # (its monitors' values included) must not make its tensors on the ambient default device
    from conserve.tracking.breakers import BrokenMonitor

    sink = conserve.MemorySink()

    def train():
        m = _model()
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50, sinks=[sink])
        opt.tracker.monitors.append(BrokenMonitor(opt.tracker))
        for i in range(3):
            _step(m, opt, i)
        return opt.tracker

    t = train()
    with torch.device("meta"):
        t._close_at_exit()  # what the garbage collector's __del__ runs
    assert [r["step"] for r in sink.records] == [1, 2, 3]
    assert all(math.isfinite(v) for k, v in sink.records[-1].items() if k.startswith("broken/"))
    assert any(k.startswith("broken/") for k in sink.records[-1])


@pytest.mark.parametrize("kind", ["track", "fused"])
def test_a_default_device_other_than_the_weights_changes_nothing(kind):
    # every tensor conserve builds on the host says so (device="cpu"): under a default-device context
    # (torch.set_default_device("cuda"), or here the meta device, which fails at the first host read) the
    # tracker builds, steps, drifts and flushes exactly as without it
    from conserve.models import DecoderLM, LMConfig
    from conserve.optim import FusedAdamW

    cfg = LMConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64)

    def run(ctx):
        torch.manual_seed(0)
        m, sink = DecoderLM(cfg), conserve.MemorySink()
        x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
        with ctx:
            kw = dict(every=3, sinks=[sink], drift_every=2)
            opt = (conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-3), m, **kw) if kind == "track"
                   else FusedAdamW(m.parameters(), lr=1e-3, track=m, **kw))
            for _ in range(7):
                opt.zero_grad()
                F.cross_entropy(m(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1)).backward()
                opt.step()
            opt.close()
        return sink.records

    import contextlib
    ref, got = run(contextlib.nullcontext()), run(torch.device("meta"))
    assert len(ref) == 7 and any(k.startswith("drift/") for k in ref[-1])
    assert [r.keys() for r in got] == [r.keys() for r in ref]
    for r, q in zip(ref, got):
        assert all(r[k] == q[k] or (r[k] != r[k] and q[k] != q[k]) for k in r)  # NaN: not decomposed


def test_meta_device_model_is_refused_naming_the_fix():
    from conserve.optim import FusedAdamW

    with torch.device("meta"):
        m = _model()
    with pytest.raises(ValueError, match=r"meta device .*\(model\.to_empty\(device=\.\.\.\)"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m)
    with pytest.raises(ValueError, match="meta device"):
        FusedAdamW(m.parameters(), track=m)


def _poison(m):
    with torch.no_grad():
        m.layers[0].weight[0, 0] = float("nan")


@pytest.mark.parametrize("policy", ["raise", "warn", "skip"])
def test_on_nonfinite_policies(policy):
    m = _model()
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=10, sinks=[sink], on_nonfinite=policy)
    _step(m, opt, 0)
    _poison(m)
    _step(m, opt, 1)
    _step(m, opt, 2)
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="step 2"):
            opt.flush()
        assert [r["step"] for r in sink.records] == [1]
        return
    with pytest.warns(RuntimeWarning, match=f"step 2.*on_nonfinite='{policy}'"):
        rows = opt.flush()
    assert [r["step"] for r in rows] == [1, 2, 3]  # every step keeps its number
    if policy == "warn":
        assert [r["step"] for r in sink.records] == [1, 2, 3]
        assert math.isnan(sink.records[1]["eps/relu"])
    else:
        assert [r["step"] for r in sink.records] == [1]
        assert opt.tracker.nonfinite_skipped == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not at every flush
        _step(m, opt, 3)
        opt.flush()


def test_on_nonfinite_rejects_unknown_policy():
    m = _model()
    with pytest.raises(ValueError, match="on_nonfinite='stop'.*'raise', 'warn', 'skip'"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, on_nonfinite="stop")


def test_step_hooks_fire_and_optimizer_machinery_runs():
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o is opt)))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o is opt)))
    sd_seen = []
    opt.register_state_dict_post_hook(lambda o, sd: sd_seen.append("conserve" in sd))
    _step(m, opt)
    assert seen == [("pre", True), ("post", True)]
    h1.remove(), h2.remove()
    _step(m, opt, 1)
    assert len(seen) == 2 and opt.tracker.step_count == 2
    opt.state_dict()
    assert sd_seen == [True]
    # the shared attributes are the inner optimizer's, not copies
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    assert len(opt.optimizer.param_groups) == 1
    opt.close()


def test_deepcopy_copies_optimizer_and_tracker_together():
    m = _model()
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=50, sinks=[conserve.MemorySink()])
    _step(m, opt, 0)
    step_before = type(opt).step
    m2, opt2 = copy.deepcopy((m, opt))
    assert type(opt).step is step_before  # the class was not patched again
    assert opt2.tracker is not opt.tracker and opt2.tracker.sinks == []
    p2 = opt2.param_groups[0]["params"][0]
    assert p2 is next(m2.parameters()) and p2 is not next(m.parameters())
    assert opt2.tracker.params[0] is p2  # the copied tracker reads the copied weights
    _step(m2, opt2, 1)
    assert opt2.tracker.step_count == 2 and opt.tracker.step_count == 1
    rows = opt2.flush()
    assert [r["step"] for r in rows] == [1, 2]
    opt.close()


def test_amp_flags_reach_the_inner_optimizer():
    m = _model()
    inner = torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
    opt = conserve.track(inner, m, every=50)
    assert opt._step_supports_amp_scaling is True
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    _step(m, opt, 0, scaler=scaler)
    before = [p.detach().clone() for p in m.parameters()]
    # inf gradients: the fused step reads found_inf (forwarded to it) and leaves the weights alone
    g = torch.Generator().manual_seed(1)
    opt.zero_grad()
    loss = F.cross_entropy(m(torch.randn(5, 4, generator=g)), torch.tensor([0, 1, 2, 0, 1]))
    scaler.scale(loss * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert not hasattr(inner, "found_inf")  # GradScaler's del reached the inner optimizer too
    opt.close()


def test_record_after_a_gradscaler_skipped_step_keeps_the_previous_scalars():
    m = _model()
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=50, sinks=[sink])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    loss = _step(m, opt, 0, scaler=scaler)
    opt.record(loss=loss, lr=0.1)
    # an overflowing step: GradScaler skips optimizer.step()
    opt.zero_grad()
    scaler.scale(F.cross_entropy(m(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.tracker.step_count == 1
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.record(loss=torch.tensor(123.0), extra=1.0)
    loss3 = _step(m, opt, 2, scaler=scaler)
    opt.record(loss=loss3)
    opt.close()
    assert [r["step"] for r in sink.records] == [1, 2]
    assert sink.records[0]["loss"] == pytest.approx(float(loss)) and sink.records[0]["extra"] == 1.0
    assert sink.records[1]["loss"] == pytest.approx(float(loss3))


def test_dcp_state_dict_does_not_book_the_zero_lr_init_step():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    m = _model()
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=50)
    before = [p.detach().clone() for p in m.parameters()]
    osd = get_optimizer_state_dict(m, opt)  # empty state: torch runs a zero-lr step to create it
    assert opt.tracker.step_count == 0 and opt.flush() == []
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert "layers.0.weight" in osd["state"]
    opt.close()


def test_dcp_round_trip_keeps_the_tracker_state(tmp_path):
    import torch.distributed.checkpoint as dcp

    m = _model()
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=3, sinks=[sink])
    for i in range(5):
        _step(m, opt, i)
    dcp.save({"model": m.state_dict(), "optim": conserve.optim.OptimizerState(m, opt)}, checkpoint_id=str(tmp_path))
    for i in range(5, 8):
        _step(m, opt, i)
    reference = opt.flush()
    opt.close()

    m2 = _model(seed=1)
    sink2 = conserve.MemorySink()
    opt2 = conserve.track(torch.optim.AdamW(m2.parameters(), lr=1e-2), m2, every=3, sinks=[sink2])
    state = {"model": m2.state_dict(), "optim": conserve.optim.OptimizerState(m2, opt2)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    m2.load_state_dict(state["model"])
    assert opt2.tracker.step_count == 5
    for i in range(5, 8):
        _step(m2, opt2, i)
    resumed = opt2.flush()
    assert [r["step"] for r in resumed] == [6, 7, 8]
    for a, b in zip(reference, resumed):
        assert a["eps/relu"] == pytest.approx(b["eps/relu"], rel=1e-5, abs=1e-9)
    opt2.close()


def test_attach_drives_a_tracker_from_the_optimizer_hooks():
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_m = copy.deepcopy(m)
    ref = conserve.track(torch.optim.SGD(ref_m.parameters(), lr=0.1), ref_m, every=50, drift_every=1)
    tracker = conserve.Tracker(m, every=50, drift_every=1)
    handle = conserve.optim.attach(inner, tracker)
    for i in range(3):
        _step(m, inner, i)
        _step(ref_m, ref, i)
    a, b = tracker.flush(), ref.flush()
    assert [r["step"] for r in a] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra["drift/relu/first"] == pytest.approx(rb["drift/relu/first"], rel=1e-6, abs=1e-12)
    handle.remove()
    _step(m, inner, 4)
    assert tracker.step_count == 3
    with pytest.raises(ValueError, match="tracks its laws already"):
        conserve.optim.attach(ref, tracker)


def test_attach_checks_the_param_groups_like_track():
    """The callbacks drive the tracker through attach(): laws the param_groups break are named there too."""
    from conserve.tracking.breakers import BrokenLawWarning

    m = _model()
    groups = [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    tracker = conserve.Tracker(m, every=50, drift_every=1)
    with pytest.warns(BrokenLawWarning, match="weight decay on only part of one law"):
        conserve.optim.attach(torch.optim.AdamW(groups, lr=1e-2), tracker)
    assert tracker.broken_by and all("weight decay" in r for r in tracker.broken_by.values())


def test_accelerate_prepare_after_track_keeps_the_decay_term():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    acc = accelerate.Accelerator(cpu=True)
    m, ref_m = _model(), _model()
    ref = conserve.track(torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1), ref_m, every=50, drift_every=1)
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=50, drift_every=1)
    m, opt = acc.prepare(m, opt)
    assert isinstance(opt, AcceleratedOptimizer) and conserve.optim.unwrap_optimizer(opt) is opt.optimizer
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        acc.backward(F.cross_entropy(m(x), y))
        opt.step()
        _step(ref_m, ref, i)
    a, b = opt.optimizer.flush(), ref.flush()
    assert [r["step"] for r in a] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra["drift/relu/decay"] > 0
        assert ra["drift/relu/decay"] == pytest.approx(rb["drift/relu/decay"], rel=1e-6)


def test_tracking_an_accelerated_optimizer_is_refused_naming_the_order():
    """conserve.track(AcceleratedOptimizer): its step() runs on every micro-batch under gradient
    accumulation while the weights step on every 2nd; the tracker would book twice the steps. Refused,
    naming the working order (track, then prepare), which books the real steps."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    m = _model()
    pm, popt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=1e-2))
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        conserve.track(popt, pm)
    m2 = _model()
    pm2, popt2 = acc.prepare(m2, conserve.track(torch.optim.SGD(m2.parameters(), lr=1e-2), m2, every=50))
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        with acc.accumulate(pm2):
            acc.backward(F.cross_entropy(pm2(x), y))
            popt2.step()
            popt2.zero_grad()
    assert popt2.optimizer.tracker.step_count == 2
    popt2.optimizer.close()


def test_param_groups_with_different_weight_decay_are_tracked():
    # what HF Trainer and most recipes do: decay the weights, not the biases/norms (one law reads both)
    m = _model()
    groups = [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    opt = conserve.track(torch.optim.AdamW(groups, lr=1e-2), m, every=50, drift_every=1)
    for i in range(3):
        _step(m, opt, i)
    rows = opt.flush()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["drift/relu/decay"] > 0
        assert abs(r["drift/relu/residual"]) <= 1e-4 * r["drift/relu/measured"] + 1e-9
    opt.close()


def test_fused_optimizer_as_a_context_manager_with_a_nan_policy(tmp_path):
    m = _model()
    path = tmp_path / "m.jsonl"
    with conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, track=m, every=50, on_nonfinite="warn",
                                   sinks=[conserve.JSONLSink(path)]) as opt:
        for i in range(3):
            _step(m, opt, i)
        assert opt.tracker.on_nonfinite == "warn"
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3]


def test_loading_a_state_of_other_law_sizes_is_refused_at_load():
    """Same law names, other sizes (a resumed run whose hidden width changed): the state loaded and the
    next step failed deep inside the tracker ("The size of tensor a (6) must match ... (8)")."""
    from conserve.models import MLP

    def tracked(widths):
        torch.manual_seed(0)
        m = MLP(widths)
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=2, sinks=[])
        opt.zero_grad()
        m(torch.randn(5, widths[0])).square().mean().backward()
        opt.step()
        return opt

    state = tracked([4, 8, 3]).tracker.state_dict()
    other = tracked([4, 6, 3])
    with pytest.raises(ValueError, match=r"saved for laws of other sizes .*\(8,\).*\(6,\).*same model sizes"):
        other.tracker.load_state_dict(state)
    assert other.tracker.step_count == 1  # untouched
    tracked([4, 8, 3]).tracker.load_state_dict(state)  # the same sizes load


def test_a_forked_child_never_flushes_the_parents_tracker(tmp_path):
    """A fork (a DataLoader worker, a forked rank) holds a copy of every live tracker: collecting it there
    must not write the parent's pending rows into the parent's sinks."""
    import gc
    import os

    import torch

    import conserve

    path = tmp_path / "m.jsonl"
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=100,
                         sinks=[conserve.JSONLSink(path)])
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    pid = os.fork()
    if pid == 0:  # the child drops its copy and exits through the interpreter's own exit path
        del opt
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not path.exists() or path.read_text() == ""
    opt.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
