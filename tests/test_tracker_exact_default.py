"""The default drift mode follows the tracked bytes: exact (every law on every step, cumulative sums kept) up to
``conserve.tracker.EXACT_MAX_BYTES``, sampled above; an explicit argument always wins."""
import math

import pytest
import torch

import conserve
import conserve.tracker as tracker_mod
from conserve.models import MLP


def _track(model, **kw):
    return conserve.track(torch.optim.SGD(model.parameters(), lr=0.1), model, **kw).tracker


def _mode(t):
    return t.drift_every, t.snapshot_budget, t.keep_cumulative


def test_small_models_are_exact_by_default():
    torch.manual_seed(0)
    m = MLP([8, 16, 4])
    t = _track(m)
    assert t.tracked_bytes == sum(p.numel() * p.element_size() for p in t.params)  # the weights the laws read
    assert 0 < t.tracked_bytes <= tracker_mod.EXACT_MAX_BYTES
    assert _mode(t) == (1, None, True)
    x = torch.randn(5, 8)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=1)
    for _ in range(3):
        opt.zero_grad()
        m(x).pow(2).sum().backward()
        opt.step()
    totals = opt.tracker.totals()
    assert all(v["cumulative"] for v in totals.values())  # the total and prediction columns are there
    assert all(math.isfinite(v["predicted"]) for v in totals.values())


def test_above_the_threshold_the_default_is_sampled(monkeypatch):
    torch.manual_seed(0)
    m = MLP([8, 16, 4])
    monkeypatch.setattr(tracker_mod, "EXACT_MAX_BYTES", 100)  # this model's weights are above it now
    t = _track(m)
    assert _mode(t) == (tracker_mod.DRIFT_EVERY, tracker_mod.SNAPSHOT_BUDGET, False)


@pytest.mark.parametrize("kw, expect_small, expect_large", [  # a cadence given: the other is the sampled mode's
    (dict(drift_every=4), (4, tracker_mod.SNAPSHOT_BUDGET, False), (4, tracker_mod.SNAPSHOT_BUDGET, False)),
    (dict(drift_every=1), (1, tracker_mod.SNAPSHOT_BUDGET, False), (1, tracker_mod.SNAPSHOT_BUDGET, False)),
    (dict(snapshot_budget=0.5), (tracker_mod.DRIFT_EVERY, 0.5, False), (tracker_mod.DRIFT_EVERY, 0.5, False)),
    (dict(drift_every=1, snapshot_budget=None), (1, None, True), (1, None, True)),
    (dict(cumulative=False), (1, None, False), (tracker_mod.DRIFT_EVERY, tracker_mod.SNAPSHOT_BUDGET, False)),
    (dict(drift_every=3, snapshot_budget=0.1, cumulative=True), (3, 0.1, True), (3, 0.1, True)),
])
def test_an_explicit_argument_always_wins(monkeypatch, kw, expect_small, expect_large):
    torch.manual_seed(0)
    m = MLP([8, 16, 4])
    assert _mode(_track(m, **kw)) == expect_small
    monkeypatch.setattr(tracker_mod, "EXACT_MAX_BYTES", 100)
    assert _mode(_track(m, **kw)) == expect_large


def test_a_bad_cadence_is_still_refused():
    m = MLP([8, 16, 4])
    for kw in (dict(drift_every="sometimes"), dict(drift_every=0), dict(snapshot_budget="half")):
        with pytest.raises(ValueError):
            _track(m, **kw)
