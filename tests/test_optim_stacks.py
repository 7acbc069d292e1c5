"""Training stacks a PyTorch user plausibly runs through ``conserve.track``: the decay factor of each
torch optimizer against its update rule (ASGD), parameters that get no gradient on a step, GradScaler
skipping inside an optimizer that unscales in its own step, and the group keys that break a law."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conserve
from conserve.optim import FusedSGD
from conserve.tracking.breakers import BrokenLawWarning

LAW = "0-2/unit"


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()


def _track(opt, m, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BrokenLawWarning)
        return conserve.track(opt, m, fp64=True, every=100, drift_every=1, snapshot_budget=None, keep_last=True, **kw)


def _terms(tr, name):
    """{term: per-entry values of law ``name``} of the last drift step."""
    names = [l.name for l in tr.laws]
    return {t: dict(zip(names, tr.compiled.split(tr.last[t].vec, tr.last[t].grams)))[name]
            for t in ("measured", "decay", "first", "second", "residual")}


def _sgd_step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(5, 4, dtype=torch.float64, generator=g)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("foreach", [False, True])
def test_asgd_decay_is_its_lambd_decay_and_noether_holds(weight_decay, foreach):
    """ASGD steps ``(1 - eta lambd) theta - eta (g + wd theta)``: its decay factor is
    ``1 - eta (lambd + wd)`` (eta from its state), so the first-order term vanishes as for SGD
    (it was booked with a = 1: the lambd decay showed up as a first-order drift of ~40% of the change)."""
    m = _mlp()
    opt = _track(torch.optim.ASGD(m.parameters(), lr=0.05, lambd=0.01, weight_decay=weight_decay, foreach=foreach), m)
    p0 = opt.tracker.params[0]
    for k in range(4):
        eta = float(opt.optimizer.state[p0]["eta"]) if k else float(torch.tensor(0.05))  # ASGD's state: fp32
        _sgd_step(m, opt, k)
        assert float(opt.tracker._a[0]) == pytest.approx(1 - eta * (0.01 + weight_decay), rel=0, abs=1e-15)
        t = _terms(opt.tracker, LAW)
        assert t["decay"].norm() > 0.3 * t["measured"].norm()
        assert t["first"].norm() < 1e-10 * t["decay"].norm(), k
        assert t["residual"].norm() < 1e-10 * t["measured"].norm()


def test_asgd_different_lambd_in_one_law_is_broken():
    m = _mlp()
    opt = torch.optim.ASGD([{"params": m[0].parameters(), "lambd": 0.01}, {"params": m[2].parameters()}], lr=0.05)
    with pytest.warns(BrokenLawWarning, match="lambd"):
        t = conserve.track(opt, m, every=100)
    assert "different ASGD decay (lambd) in one law" in t.tracker.broken_by[LAW]


def test_dampening_breaks_a_law_only_under_momentum():
    """Heavy ball with dampening d steps by ``lr (1 - d)`` times the gradient average: a law split over
    groups with different dampening moves with two step sizes (broken); without momentum dampening
    does nothing (not broken)."""
    m = _mlp()
    groups = lambda mom: [{"params": m[0].parameters(), "dampening": 0.5}, {"params": m[2].parameters()}]  # noqa: E731
    with pytest.warns(BrokenLawWarning, match="different dampening"):
        t = conserve.track(torch.optim.SGD(groups(0.9), lr=0.1, momentum=0.9), m, every=100)
    assert "different dampening in one law" in t.tracker.broken_by[LAW]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BrokenLawWarning)
        t = conserve.track(torch.optim.SGD(groups(0.0), lr=0.1), m, every=100)
    assert t.tracker.broken_by == {}


@pytest.mark.parametrize("fused", [False, True])
def test_decoupled_weight_decay_on_part_of_a_law_breaks_it(fused):
    """Adam with the same weight decay, decoupled (theta scaled by 1 - lr wd) in one group and L2 in the
    other: the law's tensors decay differently (decay factors 1 - lr wd and 1: mixed in the drift
    identity), so it is broken; without weight decay the flag changes nothing."""
    from conserve.optim import FusedAdam

    m = _mlp()
    make = FusedAdam if fused else torch.optim.Adam
    groups = lambda: [{"params": m[0].parameters(), "decoupled_weight_decay": True},  # noqa: E731
                      {"params": m[2].parameters()}]
    build = (lambda wd: FusedAdam(groups(), lr=1e-2, weight_decay=wd, track=m, every=100)) if fused else \
        (lambda wd: conserve.track(make(groups(), lr=1e-2, weight_decay=wd), m, every=100))
    with pytest.warns(BrokenLawWarning, match="decoupled weight decay"):
        t = build(0.1)
    assert "decoupled weight decay on only part of one law" in t.tracker.broken_by[LAW]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BrokenLawWarning)
        t = build(0.0)
    assert t.tracker.broken_by == {}


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _mlp(0), _mlp(1)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0.0)


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.1),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                                  lambda p: torch.optim.ASGD(p, lr=0.05, lambd=0.01)],
                         ids=["SGD", "AdamW", "ASGD"])
@pytest.mark.parametrize("closure", [False, True])
def test_a_parameter_without_grad_is_not_decayed(make, closure):
    """torch optimizers skip a parameter whose grad is None (an unused branch, an expert no token
    reached): no decay either. Its law did not move: every drift term is 0 (it was booked a decay
    (a^2 - 1) h that did not happen, cancelled by a first-order term: a false Noether violation).
    The same with ``step(closure)``, whose gradients exist only inside the step."""
    m = _TwoBranches()
    opt = _track(make(m.parameters()), m)
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for k, use_b in enumerate([True, False, True]):
        def loss():
            opt.zero_grad(set_to_none=True)
            out = m(x, use_b).square().mean()
            out.backward()
            return out
        if closure:
            opt.zero_grad(set_to_none=True)
            opt.step(loss)
        else:
            loss()
            opt.step()
        b, a = _terms(opt.tracker, "b.0-2/unit"), _terms(opt.tracker, "a.0-2/unit")
        assert a["decay"].abs().max() > 0  # the stepped branch is decayed
        if not use_b:
            assert all(b[t].abs().max() == 0 for t in b), (k, {t: float(v.norm()) for t, v in b.items()})
        else:
            assert b["decay"].abs().max() > 0


def test_fused_sgd_and_track_agree_on_a_parameter_without_grad():
    ms = [_TwoBranches(), _TwoBranches()]
    opts = [_track(torch.optim.SGD(ms[0].parameters(), lr=0.1, weight_decay=0.1), ms[0]),
            FusedSGD(ms[1].parameters(), lr=0.1, weight_decay=0.1, track=ms[1], fp64=True, every=100, drift_every=1,
                     snapshot_budget=None, keep_last=True)]
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for m, o in zip(ms, opts):
        for use_b in (True, False):
            o.zero_grad(set_to_none=True)
            m(x, use_b).square().mean().backward()
            o.step()
    for t in ("decay", "first", "second"):
        torch.testing.assert_close(opts[0].tracker.last[t].vec, opts[1].tracker.last[t].vec, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("how", ["track", "attach"])
def test_gradscaler_skip_inside_a_fused_torch_optimizer_is_not_booked(how):
    """``AdamW(fused=True)`` unscales in its own step: GradScaler calls its step() with ``found_inf`` set
    and the step leaves the weights alone. That is no training step: not booked (it was booked with the
    decay ``(a^2 - 1) h`` of a weight decay that did not happen, and the step count ran ahead)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True, weight_decay=0.1)
    sink = conserve.MemorySink()
    if how == "track":
        opt = conserve.track(inner, m, every=50, drift_every=1, sinks=[sink], snapshot_budget=None)
        tr = opt.tracker
    else:
        opt, tr = inner, conserve.Tracker(m, every=50, drift_every=1, sinks=[sink], snapshot_budget=None)
        handle = conserve.optim.attach(inner, tr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = torch.Generator().manual_seed(1)
    for inf in (False, True, False):
        opt.zero_grad()
        loss = F.cross_entropy(m(torch.randn(5, 4, generator=g)), torch.tensor([0, 1, 2, 0, 1]))
        before = [p.detach().clone() for p in m.parameters()]
        scaler.scale(loss * (float("inf") if inf else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        if inf:
            assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert tr.step_count == 2 == int(inner.state[m[0].weight]["step"])
    tr.close()
    assert [r["step"] for r in sink.records] == [1, 2]
    assert all(r["drift/relu/measured"] > 0 for r in sink.records)
    if how == "attach":
        assert handle.steps == 2


# ----------------------------------------------------------------------------- copies and pickles
def _ce_step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    F.cross_entropy(m(torch.randn(5, 4, dtype=torch.float64, generator=g)), torch.tensor([0, 1, 0, 1, 0])).backward()
    opt.step()


@pytest.mark.parametrize("make", [lambda m: conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                                  lambda m: conserve.optim.FusedSGD(m.parameters(), lr=0.1, momentum=0.9),
                                  lambda m: conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, track=m, every=100,
                                                                      drift_every=1)],
                         ids=["adamw", "sgd", "adamw-tracked"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_fused_optimizer_copies_and_pickles_whole(make, how):
    """``copy.deepcopy`` / pickle of a fused optimizer (with its model) steps on as the original (the
    copy had no tracker, plan or backend: Optimizer.__getstate__ keeps three attributes, and its
    ``step()`` raised AttributeError)."""
    import pickle

    m = _mlp()
    opt = make(m)
    _ce_step(m, opt, 0)
    mc, oc = copy_of((m, opt), how)
    for k in (1, 2):
        _ce_step(m, opt, k)
        _ce_step(mc, oc, k)
    for p, q in zip(m.parameters(), mc.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    if opt.tracker is not None:
        assert oc.tracker is not opt.tracker and oc.tracker.step_count == 3
        torch.testing.assert_close(torch.stack(oc.tracker._rows), torch.stack(opt.tracker._rows), equal_nan=True)


def copy_of(obj, how):
    import copy
    import pickle

    return copy.deepcopy(obj) if how == "deepcopy" else pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_tracked_optimizer_copy_watches_its_own_groups(how, tmp_path):
    """A copy (deepcopy, pickle: the JSONL sink's open file is not pickled, the copy has no sinks) of a
    tracked optimizer re-checks the laws against ITS groups when their lr changes (the watch hook was a
    closure: pickling failed, and a copy's inner optimizer kept no hook, so the copy never re-checked)."""
    m = _mlp()
    opt = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1)
    opt = conserve.track(opt, m, every=100, sinks=[conserve.JSONLSink(tmp_path / "m.jsonl")])
    _ce_step(m, opt, 0)
    mc, oc = copy_of((m, opt), how)
    assert oc.tracker.sinks == [] and oc.tracker.step_count == 1
    oc.param_groups[0]["lr"] = 0.5
    with pytest.warns(BrokenLawWarning, match="different lr"):
        _ce_step(mc, oc, 1)
    assert "different lr" in oc.tracker.broken_by[LAW] and opt.tracker.broken_by == {}
    _ce_step(m, opt, 1)
    opt.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 2  # the original's rows only


# ------------------------------------------------------------------------------------- state dicts
def test_fused_adamw_loads_a_torch_fused_adamw_state_and_continues_it():
    """A checkpoint of ``torch.optim.AdamW(fused=True)`` (``fused``/``foreach`` choose torch's
    implementation, not the math) loads into ``FusedAdamW`` and continues the same run; it was refused
    ("does not support fused=True") after the groups were replaced, leaving an optimizer that refused
    every step."""
    ms = [_mlp(), _mlp()]
    tor = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True) for m in ms]
    for k in range(2):
        for m, o in zip(ms, tor):
            _ce_step(m, o, k)
    ours = conserve.optim.FusedAdamW(ms[1].parameters(), lr=1e-2, weight_decay=0.1, track=ms[1], every=100)
    ours.load_state_dict(tor[1].state_dict())
    assert ours.param_groups[0]["fused"] is None and ours.state[ms[1][0].weight]["step"] == 2
    for k in (2, 3):
        _ce_step(ms[0], tor[0], k)
        _ce_step(ms[1], ours, k)
    for p, q in zip(ms[0].parameters(), ms[1].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_a_refused_option_in_a_loaded_state_leaves_the_fused_optimizer_as_it_was():
    m = _mlp()
    tor = torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)
    _ce_step(m, tor, 0)
    ours = conserve.optim.FusedAdamW(m.parameters(), lr=1e-3)
    _ce_step(m, ours, 1)
    before = ours.state_dict()
    with pytest.raises(ValueError, match="amsgrad=True"):
        ours.load_state_dict(tor.state_dict())
    after = ours.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][i]["exp_avg"], before["state"][i]["exp_avg"]) for i in before["state"])
    _ce_step(m, ours, 2)  # still steps


def test_a_float32_tensor_lr_equal_to_a_float_lr_does_not_break_a_law():
    """``lr=torch.tensor(0.01)`` (float32, as for compiled optimizers) in one group and ``lr=0.01`` in the
    other are the same step size (they were "different lr in one law: 0.weight 0.01, ... 2.weight 0.01")."""
    m = _mlp()
    opt = torch.optim.AdamW([{"params": m[0].parameters(), "lr": torch.tensor(1e-2)},
                             {"params": m[2].parameters(), "lr": 1e-2}], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BrokenLawWarning)
        t = conserve.track(opt, m, every=100)
        _ce_step(m, t, 0)
    assert t.tracker.broken_by == {}
    t.param_groups[1]["lr"] = 2e-2
    with pytest.warns(BrokenLawWarning, match="different lr"):
        _ce_step(m, t, 1)


def test_per_group_tensor_lrs_that_a_scheduler_moves_apart_break_the_law():
    """Two groups with their own (CPU) tensor lr, LambdaLR with one lambda per group: the scheduler
    writes the tensors in place, so the groups stop agreeing without any key changing identity; the
    laws are re-checked (they were compared by tensor identity: never re-checked)."""
    m = _mlp()
    opt = torch.optim.SGD([{"params": m[0].parameters(), "lr": torch.tensor(0.1)},
                           {"params": m[2].parameters(), "lr": torch.tensor(0.1)}], lr=0.1)
    t = conserve.track(opt, m, every=100)
    sched = torch.optim.lr_scheduler.LambdaLR(t, [lambda s: 1.0, lambda s: 0.5 ** s])
    _ce_step(m, t, 0)
    sched.step()
    assert t.tracker.broken_by == {}
    with pytest.warns(BrokenLawWarning, match="different lr"):
        _ce_step(m, t, 1)
    assert "different lr in one law" in t.tracker.broken_by[LAW]


# ------------------------------------------------------------------ decay factors against the update rule
def _timm(name):
    timm_optim = pytest.importorskip("timm.optim")
    return getattr(timm_optim, name)


def _muon(params, wd):
    """torch's Muon for the 2-D weights (it refuses the rest), SGD (no decay) for the biases."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon needs torch >= 2.9")
    params = list(params)
    return torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02, weight_decay=wd,
                            adjust_lr_fn="match_rms_adamw")


def _lr(opt, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    return opt


_RULES = {  # name: (factory(params, weight_decay), its decay factor, from the optimizer's code); decoupled
    # rules only (a coupled L2 under momentum or Adam is inside Delta: a = 1, nothing to compare)
    "SGD": (lambda p, wd: torch.optim.SGD(p, lr=0.1, weight_decay=wd), lambda wd: 1 - 0.1 * wd),
    "Adam-decoupled": (lambda p, wd: torch.optim.Adam(p, lr=0.01, weight_decay=wd, decoupled_weight_decay=True),
                       lambda wd: 1 - 0.01 * wd),
    "AdamW": (lambda p, wd: torch.optim.AdamW(p, lr=0.01, weight_decay=wd), lambda wd: 1 - 0.01 * wd),
    "NAdam-decoupled": (lambda p, wd: torch.optim.NAdam(p, lr=0.01, weight_decay=wd, decoupled_weight_decay=True),
                        lambda wd: 1 - 0.01 * wd),
    "RAdam-decoupled": (lambda p, wd: torch.optim.RAdam(p, lr=0.01, weight_decay=wd, decoupled_weight_decay=True),
                        lambda wd: 1 - 0.01 * wd),
    # a float32 tensor lr: SGD steps with it as a double, AdamW multiplies by 1 - lr wd formed in float32
    "SGD-tensor-lr": (lambda p, wd: torch.optim.SGD(p, lr=torch.tensor(0.1), weight_decay=wd),
                      lambda wd: 1 - float(torch.tensor(0.1)) * wd),
    "AdamW-tensor-lr": (lambda p, wd: torch.optim.AdamW(p, lr=torch.tensor(0.01), weight_decay=wd),
                        lambda wd: float(1 - torch.tensor(0.01) * wd)),
    "AdamW-fused-tensor-lr": (lambda p, wd: torch.optim.AdamW(p, lr=torch.tensor(0.01), weight_decay=wd, fused=True),
                              lambda wd: 1 - float(torch.tensor(0.01)) * wd),  # float64 weights: a double
    "Adafactor": (lambda p, wd: torch.optim.Adafactor(p, lr=0.01, weight_decay=wd), lambda wd: 1 - 0.01 * wd),
    "Muon": (lambda p, wd: _muon(p, wd), lambda wd: 1 - 0.02 * wd),
    # as the HF Trainer's optim="adafactor" builds it (the decay was booked as first-order drift)
    "transformers-Adafactor": (lambda p, wd: _hf_adafactor(p, lr=0.01, weight_decay=wd, scale_parameter=False,
                                                           relative_step=False, warmup_init=False),
                               lambda wd: 1 - 0.01 * wd),
    "timm-SGDW-momentum": (lambda p, wd: _timm("SGDW")(p, lr=0.1, momentum=0.9, weight_decay=wd),
                           lambda wd: 1 - 0.1 * wd),
    "timm-Lion": (lambda p, wd: _timm("Lion")(p, lr=0.01, weight_decay=wd), lambda wd: 1 - 0.01 * wd),
    "timm-NAdamW": (lambda p, wd: _timm("NAdamW")(p, lr=0.01, weight_decay=wd), lambda wd: 1 - 0.01 * wd),
    "timm-AdamWLegacy-corrected": (lambda p, wd: _lr(_timm("AdamWLegacy")(p, lr=0.01, weight_decay=wd,
                                                                            corrected_weight_decay=True), 0.005),
                                   lambda wd: 1 - 0.005 ** 2 / 0.01 * wd),  # scheduled down to half its max lr
}


def _hf_adafactor(params, **kw):
    try:
        from transformers.optimization import Adafactor
    except Exception as e:  # noqa: BLE001 - absent, or broken by its own dependencies
        pytest.skip(f"transformers unavailable: {e}")
    return Adafactor(params, **kw)


@pytest.mark.parametrize("name", list(_RULES))
def test_decay_factor_matches_the_update_rule(name):
    """Independent reference: the same step from the same state without weight decay gives the update
    ``Delta`` that does not depend on the decay; ``theta_{k+1} = a theta_k + Delta`` then fixes ``a``
    (after a first step, so momentum and moment buffers are non-zero). A factor left at 1 (torch's
    Adafactor, timm's decoupled optimizers) booked the decay as first-order drift."""
    make, rule = _RULES[name]
    wd = 0.5
    m = _mlp()
    opt = _track(make(m.parameters(), wd), m)
    _sgd_step(m, opt, 0)
    twin = _mlp()
    twin.load_state_dict(m.state_dict())
    t_opt = make(twin.parameters(), wd)
    t_opt.load_state_dict(copy.deepcopy(opt.optimizer.state_dict()))  # (torch would share the buffers)
    for g in t_opt.param_groups:
        g["weight_decay"] = 0.0
    theta = [p.detach().clone() for p in m.parameters()]
    _sgd_step(twin, t_opt, 1)
    _sgd_step(m, opt, 1)
    a = rule(wd)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for p, q, t in zip(m.parameters(), twin.parameters(), theta):
        if id(p) in held:  # (Muon holds the 2-D weights only)
            torch.testing.assert_close(p - a * t, q - t, rtol=1e-9, atol=1e-12)  # the rule is the optimizer's
    want = [a if id(p) in held else 1.0 for p in opt.tracker.params]
    assert [float(x) for x in opt.tracker._a] == pytest.approx(want, rel=0, abs=1e-15)


# ----------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("fused", [False, True])
def test_fullgraph_compile_of_a_tracked_step_names_the_fix(fused):
    """``fullgraph=True`` cannot hold the tracker's eager bookkeeping (nor torch.optim's own step): dynamo's
    error carries conserve's reason, naming the fix, instead of "(reason: None) ... remove the
    torch.compiler.disable call"."""
    m = _mlp()
    opt = (conserve.optim.FusedAdamW(m.parameters(), lr=torch.tensor(1e-2), track=m, every=100) if fused else
           conserve.track(torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2)), m, every=100))
    step = torch.compile(lambda: opt.step(), fullgraph=True, backend="eager")
    opt.zero_grad()
    m(torch.randn(5, 4, dtype=torch.float64)).square().mean().backward()
    with pytest.raises(Exception, match="without fullgraph=True"):
        step()
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [FusedSGD, conserve.optim.FusedAdamW])
def test_fused_record_after_a_gradscaler_skipped_step_keeps_the_step_values(cls):
    """GradScaler skips the fused optimizer's step on inf gradients; a ``record(loss=...)`` of the skipped
    step keeps the loss of the step that ran (it overwrote it silently), as ``TrackedOptimizer.record``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    sink = conserve.MemorySink()
    opt = cls(m.parameters(), lr=0.1, track=m, every=50, sinks=[sink])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = torch.Generator().manual_seed(0)

    def step(inf):
        opt.zero_grad()
        loss = F.cross_entropy(m(torch.randn(5, 4, generator=g)), torch.tensor([0, 1, 2, 0, 1]))
        scaler.scale(loss * (float("inf") if inf else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    first = step(False)
    opt.record(loss=first)
    step(True)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.record(loss=torch.tensor(123.0))
    third = step(False)
    opt.record(loss=third)
    opt.close()
    assert [(r["step"], r["loss"]) for r in sink.records] == [(1, pytest.approx(float(first))),
                                                              (2, pytest.approx(float(third)))]


def test_record_of_a_loss_with_its_graph_does_not_keep_the_graph():
    """``opt.record(loss=loss)`` without ``.detach()`` (a plausible slip): the row keeps a detached value,
    so the step's autograd graph (its activations) is not held until the flush, ``every`` steps later."""
    import weakref

    m = _mlp()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=100)
    x = torch.randn(5, 4, dtype=torch.float64)
    opt.zero_grad()
    h = m[0](x).relu()  # an activation the graph saves
    loss = m[2](h).square().mean()
    loss.backward()
    opt.step()
    opt.record(loss=loss)
    alive = weakref.ref(h)
    del h, loss
    assert alive() is None
    assert not opt.tracker._extras[-1]["loss"].requires_grad
    assert opt.flush()[-1]["loss"] > 0


def test_asgd_alpha_breaks_a_law_but_rmsprop_alpha_does_not():
    """ASGD's eta_t = lr / (1 + lambd lr t)^alpha: groups with different alpha step a law with two step
    sizes (broken); RMSprop's alpha (a smoothing constant, no lambd) is not compared."""
    m = _mlp()
    groups = lambda: [{"params": m[0].parameters(), "alpha": 0.5}, {"params": m[2].parameters()}]  # noqa: E731
    with pytest.warns(BrokenLawWarning, match="alpha"):
        t = conserve.track(torch.optim.ASGD(groups(), lr=0.05, lambd=0.01), m, every=100)
    assert "different ASGD step-size power (alpha)" in t.tracker.broken_by[LAW]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BrokenLawWarning)
        t = conserve.track(torch.optim.RMSprop(groups(), lr=0.01), m, every=100)
    assert t.tracker.broken_by == {}


def test_attach_remove_also_stops_the_group_watch():
    """After ``handle.remove()`` the optimizer steps on untracked: no hook of the tracker is left on it
    (the breakers' watch stayed, re-checking a detached tracker and warning on a later lr change)."""
    m = _mlp()
    opt = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1)
    tr = conserve.Tracker(m, every=100)
    handle = conserve.optim.attach(opt, tr)
    _ce_step(m, opt, 0)
    handle.remove()
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    opt.param_groups[0]["lr"] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", BrokenLawWarning)
        _ce_step(m, opt, 1)
    assert tr.step_count == 1 and tr.broken_by == {}
    opt.param_groups[0]["lr"] = 0.1
    conserve.optim.attach(opt, tr)  # attaches (and watches) again
    opt.param_groups[0]["lr"] = 0.5
    with pytest.warns(BrokenLawWarning, match="different lr"):
        _ce_step(m, opt, 2)
    assert tr.step_count == 2


def test_stepping_the_inner_optimizer_outside_the_tracked_one_warns_once():
    """``opt = torch.optim.SGD(...); t = conserve.track(opt, model)`` then ``opt.step()`` (or
    ``GradScaler.step(opt)``): the step is not tracked; one warning names the fix (it was silent: no
    rows at all, or a residual jump at the next tracked step). Steps through the tracked optimizer and
    DCP's state initialisation do not warn; a copy keeps the watch."""
    import copy as copy_mod

    m = _mlp()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = conserve.track(inner, m, every=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _ce_step(m, opt, 0)
    with pytest.warns(RuntimeWarning, match="outside the optimizer conserve.track returned"):
        _ce_step(m, inner, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _ce_step(m, inner, 2)  # once
        _ce_step(m, opt, 3)  # and the tracker's in-place check does not tell the same change again
    assert opt.tracker.step_count == 2
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    m3 = _mlp()
    inner3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    conserve.track(inner3, m3, every=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        get_optimizer_state_dict(m3, inner3)  # its zero-lr state initialisation steps the inner optimizer
    m2 = _mlp()
    mc, oc = copy_mod.deepcopy((m2, conserve.track(torch.optim.SGD(m2.parameters(), lr=0.1), m2, every=100)))
    with pytest.warns(RuntimeWarning, match="outside"):
        _ce_step(mc, oc.optimizer, 3)


def test_after_close_the_optimizer_trains_on_untracked_without_warnings():
    """``with conserve.track(opt, model) as t: ...`` then training goes on with ``opt``: neither the
    outside-step warning nor a re-check of the closed tracker's laws fires."""
    m = _mlp()
    inner = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1)
    with conserve.track(inner, m, every=100) as t:
        _ce_step(m, t, 0)
    inner.param_groups[0]["lr"] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ce_step(m, inner, 1)
    assert t.tracker.step_count == 1 and t.tracker.broken_by == {}


@pytest.mark.parametrize("fused", [False, True])
def test_steps_after_close_are_not_booked_and_warn_once(fused, tmp_path):
    """After ``close()`` a step was booked and its flush failed inside the closed JSONL sink ("sink failed
    ... TypeError"), keeping rows in memory; now: nothing booked, one warning naming how to track on."""
    m = _mlp()
    sink = conserve.JSONLSink(tmp_path / "m.jsonl")
    opt = (conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, track=m, every=2, sinks=[sink]) if fused else
           conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=2, sinks=[sink]))
    for k in range(3):
        _ce_step(m, opt, k)
    opt.close()
    with pytest.warns(RuntimeWarning, match="tracker is closed") as seen:
        for k in range(3, 8):
            _ce_step(m, opt, k)
            opt.record(loss=1.0)
    assert len([w for w in seen if "closed" in str(w.message)]) == 1
    assert not [w for w in seen if "sink" in str(w.message)]
    assert opt.tracker.step_count == 3 and opt.tracker._rows == [] and opt.tracker.unwritten == {}
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 3


@pytest.mark.parametrize("fused", [False, True])
def test_steps_after_close_at_a_drift_aligned_count_train_on(fused):
    """Closed at a step count that is a multiple of ``drift_every``: the fused step allocated one statistics
    row (no drift step once closed) but ``_record`` worked the cadence out again without the closed check
    and read the drift rows (IndexError); now the step's own ``is_drift_step`` is passed down."""
    m = _mlp()
    kw = dict(every=1, drift_every=2, backend="torch")
    opt = (conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, track=m, **kw) if fused else
           conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, **kw))
    for k in range(2):
        _ce_step(m, opt, k)
    opt.close()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.warns(RuntimeWarning, match="tracker is closed"):
        for k in range(2, 5):
            _ce_step(m, opt, k)
    assert opt.tracker.step_count == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters()))  # training went on
