"""Optimizer configurations that break a law (conserve/tracking/breakers.py): broken_by, one warning,
the broken/<family> metric; decay factors by isinstance through wrappers."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conserve
from conserve.optim import FusedAdamW, FusedSGD
from conserve.tracking.breakers import BrokenLawWarning, decay_factor, law_breakers, unwrap_optimizer

LAW = "0-2/unit"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _track(opt, m, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = conserve.track(opt, m, fp64=True, every=100, **kw)
    return t, [x for x in w if issubclass(x.category, BrokenLawWarning)]


def _step(m, opt):
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    m(x).square().mean().backward()
    opt.step()


def test_one_group_is_not_broken():
    m = _model()
    t, w = _track(torch.optim.SGD(m.parameters(), lr=0.1), m)
    assert t.tracker.broken_by == {} and w == []
    _step(m, t)
    assert "broken/relu" not in t.flush()[-1]


def test_different_lr_in_one_law():
    m = _model()
    opt = torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters(), "lr": 0.1}])
    t, w = _track(opt, m)
    assert t.tracker.broken_by == {LAW: "different lr in one law: 0.weight 0.2, 0.bias 0.2, 2.weight 0.1"}
    assert len(w) == 1 and LAW in str(w[0].message) and "different lr" in str(w[0].message)
    for _ in range(2):
        _step(m, t)  # no further warning: tracked anyway
    rec = t.flush()[-1]
    assert rec["broken/relu"] == 1.0 and "eps/relu" in rec
    assert t.tracker.broken_by_family() == {"relu": [f"{LAW}: {t.tracker.broken_by[LAW]}"]}
    # and it is really broken: the first-order drift term no longer vanishes under plain SGD
    assert t.tracker.totals()["relu"]["sum_step_first"] > 1e-6


def test_weight_decay_on_part_of_a_law_and_hf_style_names():
    m = _model()
    opt = torch.optim.AdamW([{"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
                             {"params": [m[0].bias], "weight_decay": 0.0}], lr=1e-3)
    t, w = _track(opt, m)
    assert t.tracker.broken_by[LAW] == "weight decay on only part of one law: 0.weight 0.1, 0.bias 0, 2.weight 0.1"
    assert len(w) == 1


def test_parameter_not_held_then_add_param_group():
    m = _model()
    t, w = _track(torch.optim.SGD(m[0].parameters(), lr=0.1), m)
    assert t.tracker.broken_by[LAW].startswith("not held by the optimizer: 2.weight")
    assert len(w) == 1
    with warnings.catch_warnings(record=True) as w2:
        warnings.simplefilter("always")
        t.add_param_group({"params": m[2].parameters(), "lr": 0.1})  # same lr: the law is whole again
    assert t.tracker.broken_by == {} and not [x for x in w2 if issubclass(x.category, BrokenLawWarning)]
    with warnings.catch_warnings(record=True) as w3:
        warnings.simplefilter("always")
        t.param_groups[1]["params"].clear()
        t.add_param_group({"params": [m[2].weight], "lr": 0.3})  # now a different lr
    assert "different lr" in t.tracker.broken_by[LAW]
    assert len([x for x in w3 if issubclass(x.category, BrokenLawWarning)]) == 1


def test_no_parameter_held():
    m = _model()
    extra = nn.Linear(2, 2).double()
    t, w = _track(torch.optim.SGD(extra.parameters(), lr=0.1), m)
    assert "none of its parameters" in t.tracker.broken_by[LAW] and len(w) == 1


def test_fused_optimizers_check_at_construction_and_add_param_group():
    m = _model()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt = FusedSGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1, track=m, fp64=True)
    assert opt.tracker.broken_by == {}  # no spurious "not held" while __init__ adds the groups one by one
    assert not [x for x in w if issubclass(x.category, BrokenLawWarning)]
    m2 = _model()
    with pytest.warns(BrokenLawWarning, match="different lr"):
        opt = FusedAdamW([{"params": m2[0].parameters(), "lr": 1e-3}, {"params": m2[2].parameters(), "lr": 2e-3}],
                         track=m2, fp64=True)
    assert "different lr" in opt.tracker.broken_by[LAW]
    m3 = _model()
    with pytest.warns(BrokenLawWarning, match="not held"):
        opt = FusedSGD(m3[0].parameters(), lr=0.1, track=m3, fp64=True)
    assert "not held" in opt.tracker.broken_by[LAW]
    opt.add_param_group({"params": m3[2].parameters()})
    assert opt.tracker.broken_by == {}


class MyAdamW(torch.optim.AdamW):
    """A user subclass: its update rule is AdamW's, whatever its name."""


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper of unknown kind: not unwrapped, so a = 1 (the decay goes into Delta)."""

    def __init__(self, inner):
        self.optimizer, self.param_groups, self.defaults, self.state = inner, inner.param_groups, inner.defaults, {}


def test_decay_factor_by_update_rule_not_class_name():
    p = [nn.Parameter(torch.zeros(2))]
    g = dict(lr=0.1, weight_decay=0.5)
    assert decay_factor(MyAdamW(p, **g), MyAdamW(p, **g).param_groups[0]) == pytest.approx(0.95)
    assert decay_factor(torch.optim.AdamW(p, **g), g) == pytest.approx(0.95)
    adam = torch.optim.Adam(p, **g)
    assert decay_factor(adam, adam.param_groups[0]) == 1.0  # coupled L2: inside Delta
    adam_d = torch.optim.Adam(p, decoupled_weight_decay=True, **g)
    assert decay_factor(adam_d, adam_d.param_groups[0]) == pytest.approx(0.95)
    nadam = torch.optim.NAdam(p, decoupled_weight_decay=True, **g)
    assert decay_factor(nadam, nadam.param_groups[0]) == pytest.approx(0.95)
    sgd, sgdm = torch.optim.SGD(p, **g), torch.optim.SGD(p, momentum=0.9, **g)
    assert decay_factor(sgd, sgd.param_groups[0]) == pytest.approx(0.95)
    assert decay_factor(sgdm, sgdm.param_groups[0]) == 1.0

    class AdamW(torch.optim.Adagrad):  # named AdamW, but Adagrad's rule (coupled): no decoupled decay
        pass

    fake = AdamW(p, **g)
    assert decay_factor(fake, fake.param_groups[0]) == 1.0
    fused = FusedAdamW(p, **g)
    assert decay_factor(fused, fused.param_groups[0]) == pytest.approx(0.95)
    assert decay_factor(Wrapper(torch.optim.AdamW(p, **g)), g) == 1.0


def _accelerated(inner):
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True).prepare_optimizer(inner, device_placement=False)


def test_wrapped_optimizers_are_unwrapped():
    p = [nn.Parameter(torch.zeros(2))]
    inner = MyAdamW(p, lr=0.1, weight_decay=0.5)
    acc = _accelerated(inner)
    assert type(acc).__name__ == "AcceleratedOptimizer" and unwrap_optimizer(acc) is inner
    assert decay_factor(acc, acc.param_groups[0]) == pytest.approx(0.95)
    m = _model()
    tracked = conserve.track(torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5), m)
    assert unwrap_optimizer(tracked) is tracked.optimizer
    assert decay_factor(tracked, tracked.param_groups[0]) == pytest.approx(0.95)


def test_wrapped_accelerate_optimizer_breakers_and_drift():
    m = _model()
    inner = MyAdamW([{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters(), "lr": 0.1}],
                    weight_decay=0.5)
    t, w = _track(_accelerated(inner), m, keep_last=True)
    assert "different lr" in t.tracker.broken_by[LAW] and len(w) == 1
    h0 = t.tracker.h.clone()
    _step(m, t)
    # the decay term is the decoupled AdamW one: h(a theta) - h(theta) with a = 1 - lr wd per parameter
    a = {id(p): 1 - g["lr"] * g["weight_decay"] for g in inner.param_groups for p in g["params"]}
    assert [float(x) for x in t.tracker._a] == pytest.approx([a[id(p)] for p in t.tracker.params])
    assert t.tracker.last["decay"].vec.abs().max() > 0 and h0 is not None


def test_lightning_optimizer_is_unwrapped():
    try:
        from lightning.pytorch.core.optimizer import LightningOptimizer
    except Exception as e:  # noqa: BLE001 - lightning missing or its torchvision broken
        pytest.skip(f"lightning not importable: {e}")
    p = [nn.Parameter(torch.zeros(2))]
    inner = MyAdamW(p, lr=0.1, weight_decay=0.5)
    lo = LightningOptimizer(inner)
    assert unwrap_optimizer(lo) is inner
    assert decay_factor(lo, inner.param_groups[0]) == pytest.approx(0.95)


def test_law_breakers_is_pure():
    m = _model()
    laws = conserve.detect(m).laws
    opt = torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters(), "lr": 0.1}])
    out = law_breakers(laws, dict(m.named_parameters()), opt)
    assert list(out) == [LAW]
    assert F is not None


def test_momentum_and_maximize_differences():
    m = _model()
    opt = torch.optim.SGD([{"params": m[0].parameters(), "momentum": 0.9},
                           {"params": m[2].parameters(), "momentum": 0.0, "maximize": True}], lr=0.1)
    t, w = _track(opt, m)
    r = t.tracker.broken_by[LAW]
    assert "different momentum in one law: 0.weight 0.9, 0.bias 0.9, 2.weight 0" in r
    assert "maximize on only part of one law" in r and "different lr" not in r and len(w) == 1


def test_scheduler_that_splits_the_groups_is_caught_at_the_next_step():
    m = _model()
    opt = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1)
    t, w = _track(opt, m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda e: 1.0, lambda e: 0.5 ** e])
    assert t.tracker.broken_by == {} and w == []
    with warnings.catch_warnings(record=True) as w2:
        warnings.simplefilter("always")
        _step(m, t)
        sched.step()  # the groups' lrs now differ: 0.1 and 0.05
        _step(m, t)
        sched.step()
        _step(m, t)  # still different: no second warning
    assert t.tracker.broken_by[LAW] == "different lr in one law: 0.weight 0.1, 0.bias 0.1, 2.weight 0.05"
    assert len([x for x in w2 if issubclass(x.category, BrokenLawWarning)]) == 1
    m2 = _model()  # the same through a fused optimizer's own step
    fused = FusedSGD([{"params": m2[0].parameters()}, {"params": m2[2].parameters()}], lr=0.1, track=m2, fp64=True)
    sched = torch.optim.lr_scheduler.LambdaLR(fused, [lambda e: 1.0, lambda e: 0.5 ** e])
    _step(m2, fused)
    sched.step()
    with pytest.warns(BrokenLawWarning, match="different lr"):
        _step(m2, fused)
    assert "different lr" in fused.tracker.broken_by[LAW]


def test_uniform_scheduler_never_rechecks(monkeypatch):
    import conserve.tracking.breakers as B

    m = _model()
    opt = torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.1)
    t, _ = _track(opt, m)
    calls = []
    monkeypatch.setattr(B, "law_breakers", lambda *a: calls.append(1) or {})
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        _step(m, t)
        sched.step()
    assert calls == []  # every group scaled alike: the agreement pattern did not change


def _steps(m, t, n, at=None, do=None):
    for i in range(n):
        if i == at:
            do()
        _step(m, t)


def test_parameter_frozen_mid_run_breaks_its_half_frozen_laws():
    """``requires_grad_(False)`` on one side of a law after the tracker was built: noticed at the next
    flush, one warning naming the parameter, the law marked ``broken_by`` (and counted); it really is
    broken (plain SGD's first-order drift term no longer vanishes); unfreezing keeps the mark; a later
    re-check of the optimizer's groups keeps it too."""
    m = _model()
    t, _ = _track(torch.optim.SGD(m.parameters(), lr=0.1), m, drift_every=1, snapshot_budget=None)
    _steps(m, t, 3)
    t.flush()
    first_before = t.tracker.totals()["relu"]["first"]
    assert t.tracker.broken_by == {} and first_before < 1e-12
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _steps(m, t, 3, at=1, do=lambda: m[2].weight.requires_grad_(False))
        rec = t.flush()[-1]
        _steps(m, t, 2)
        t.flush()  # no second warning
    said = [str(x.message) for x in w if issubclass(x.category, BrokenLawWarning)]
    assert len(said) == 1 and "2.weight" in said[0] and LAW in said[0] and "freeze whole laws" in said[0], said
    assert t.tracker.broken_by[LAW].startswith("frozen after the tracker was built: 2.weight")
    assert rec["broken/relu"] == 1.0
    assert t.tracker.totals()["relu"]["first"] > 1e-6  # the first-order term of plain SGD no longer vanishes
    m[2].weight.requires_grad_(True)
    _steps(m, t, 1)
    t.flush()
    assert LAW in t.tracker.broken_by  # eps keeps what moved while it was frozen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.param_groups[0]["lr"] = 0.1  # (same lr) and a group of another lr for a tensor outside the law
        t.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.float64))], "lr": 0.3})
    assert t.tracker.broken_by[LAW].startswith("frozen after the tracker was built")


def test_a_law_frozen_whole_is_not_broken():
    m = _model()
    t, _ = _track(torch.optim.SGD(m.parameters(), lr=0.1), m)
    _step(m, t)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for p in (m[0].weight, m[0].bias, m[2].weight):  # the law's parameters (2.bias still trains)
            p.requires_grad_(False)
        _step(m, t)
        t.flush()
    said = [str(x.message) for x in w if issubclass(x.category, BrokenLawWarning)]
    assert t.tracker.broken_by == {} and len(said) == 1 and "frozen whole" in said[0]
    m[0].weight.requires_grad_(True)  # unfreezing one side leaves the law half frozen: broken
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(m, t)
        t.flush()
    said = [str(x.message) for x in w if issubclass(x.category, BrokenLawWarning)]
    assert t.tracker.broken_by[LAW].startswith("frozen after the tracker was built: 0.bias, 2.weight")
    assert len(said) == 1 and "0.bias breaks 1 law(s)" in said[0], said


def test_parameter_the_optimizer_no_longer_holds_is_noticed_at_the_flush():
    """A tracked tensor swapped out of the optimizer's group (same group size: the per-step group watch
    does not see it) is marked at the next flush."""
    m = _model()
    t, _ = _track(torch.optim.SGD(m.parameters(), lr=0.1), m)
    _step(m, t)
    group = t.param_groups[0]["params"]
    group[next(i for i, p in enumerate(group) if p is m[2].weight)] = nn.Parameter(torch.zeros(3, 8, dtype=torch.float64))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _step(m, t)
        t.flush()
    assert t.tracker.broken_by[LAW].startswith("not held by the optimizer: 2.weight")
    assert len([x for x in w if issubclass(x.category, BrokenLawWarning)]) == 1
