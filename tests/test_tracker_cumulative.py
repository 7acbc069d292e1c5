"""``Tracker(cumulative=None|True|False)``: the per-entry cumulative drift sums are kept only where asked
(default: exact mode), and every consumer of ``totals()`` copes without them (state, copies, report)."""
import copy
import json
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import conserve
from conserve.tracking.book import Book
from conserve.tracking.sinks import MemorySink
from conserve.report import NOT_KEPT, summarize, write_summary
from conserve.tracker import CUMULATIVE, CumulativeNotKept, Tracker

PER_ENTRY = {"decay", "first", "second", "predicted", "predicted_no_first", "measured_sampled"}
EXACT = {"drift_every": 1, "snapshot_budget": None}
SAMPLED = {"drift_every": 4, "snapshot_budget": 0.04}  # the sampled mode (these small models are exact by default)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.ReLU(), nn.Linear(3, 2)).double()


def _track(m, lr=0.1, **kw):
    """Tracked in the sampled mode unless ``kw`` says otherwise."""
    opt = torch.optim.SGD(m.parameters(), lr=lr, weight_decay=0.01)
    return conserve.track(opt, m, every=3, fp64=True, **{**SAMPLED, **kw})


def _train(m, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, dtype=torch.float64, generator=g)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


def _law_sized(tr):
    """The storages of law-value shape that the tracker owns (its ``__dict__``, into containers, ``Values`` and its
    ``Book``)."""
    shapes = {tuple(tr.h0.vec.shape)} | {tuple(g.shape) for g in tr.h0.grams.values()}
    seen, out, todo = set(), [], list(tr.__dict__.values())
    while todo:
        o = todo.pop()
        if torch.is_tensor(o):
            if o.is_floating_point() and tuple(o.shape) in shapes and o.untyped_storage().data_ptr() not in seen:
                seen.add(o.untyped_storage().data_ptr())
                out.append(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif isinstance(o, Book):  # the booking state (cumulative sums, guards)
            todo.extend(o.__dict__.values())
        elif hasattr(o, "vec") and hasattr(o, "grams"):  # a Values
            todo.append(o.vec)
            todo.extend(o.grams.values())
    return out


@pytest.mark.parametrize("kw, kept", [({}, False), (EXACT, True), ({"cumulative": True}, True),
                                      ({**EXACT, "cumulative": False}, False), ({"drift": False, **EXACT}, False)])
def test_the_three_settings(kw, kept):
    """None keeps them only in exact mode (drift on every step, every law), True always, False never;
    without them ``cumulative`` is empty, a read names the fix, ``totals()`` has no per-entry key and
    says ``cumulative: False``; with them every key is there."""
    m = _model()
    opt = _track(m, **kw)
    tr = opt.tracker
    assert tr.keep_cumulative is kept
    _train(m, opt, 5)
    tot = tr.totals()
    for f, t in tot.items():
        assert t["cumulative"] is kept
        assert {"eps", "measured", "scale", "sampled_steps", "steps", "guarded", "balance"} <= set(t)
        assert {f"sum_step_{c}" for c in CUMULATIVE} <= set(t)
        assert (PER_ENTRY <= set(t)) if kept else not (PER_ENTRY & set(t)), (f, sorted(t))
    if kept:
        assert set(tr.cumulative) == set(CUMULATIVE)
    else:
        assert isinstance(tr.cumulative, CumulativeNotKept) and not tr.cumulative
        with pytest.raises(KeyError, match="cumulative=True"):
            tr.cumulative["decay"]
    # h0 and h, plus 4 cumulative copies when kept: per layout (vec, then each Gram size)
    assert len(_law_sized(tr)) == (2 + 4 * kept) * (1 + len(tr.h0.grams))
    opt.close()


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="cumulative='yes' must be True, False or None"):
        Tracker(_model(), cumulative="yes")


def test_default_sampled_tracker_owns_no_cumulative_buffer():
    """The default (sampled drift) tracker: after its drift steps its owned law-sized tensors are h0 and h
    only, none of them zeros kept for sums; exact mode adds exactly the 4 cumulative copies per layout."""
    m = _model()
    opt = _track(m, snapshot_budget=0.3, drift_every=2)
    _train(m, opt, 6)
    tr = opt.tracker
    held = _law_sized(tr)
    ptrs = {t.untyped_storage().data_ptr() for v in (tr.h0, tr.h) for t in [v.vec, *v.grams.values()]}
    assert {t.untyped_storage().data_ptr() for t in held} == ptrs
    assert tr.sampled_steps.sum() > 0 and not tr.cumulative


def test_exact_totals_are_the_same_with_and_without_and_sums_of_norms_bound_the_norm_of_sums():
    """In exact mode the rows and every common totals key are the same bit for bit with and without the
    sums; ``sum_step_<term>`` is the sum of the rows' drift columns (flushed and pending rows) and, a sum
    of norms, bounds the norm of the summed term from above."""
    runs = {}
    for keep in (True, False):
        m = _model()
        opt = _track(m, cumulative=keep, **EXACT)
        _train(m, opt, 7)  # every=3: two flushes, one row pending
        rows = opt.tracker.flush()
        runs[keep] = (opt.tracker.totals(), rows, opt)
    (ta, rows_a, opt_a), (tb, rows_b, _) = runs[True], runs[False]
    assert [r for r in rows_a] == [r for r in rows_b]
    for f in ta:
        for k, v in tb[f].items():
            if k != "cumulative":
                assert ta[f][k] == v or (v != v and ta[f][k] != ta[f][k]), (f, k)
    m = _model()
    opt = _track(m, cumulative=True, **EXACT)
    sink = MemorySink()
    got = sink.records
    opt.tracker.sinks.append(sink)
    _train(m, opt, 7)
    tot = opt.tracker.totals()  # one row still pending: counted too
    assert len(got) == 6 and len(opt.tracker._rows) == 1
    opt.tracker.flush()
    for f, t in tot.items():
        for c in CUMULATIVE:
            want = math.fsum(r[f"drift/{f}/{c}"] for r in got)
            assert t[f"sum_step_{c}"] == pytest.approx(want, rel=1e-12, abs=0), (f, c)
        for c, key in (("measured", "measured_sampled"), ("decay", "decay"), ("first", "first"),
                       ("second", "second")):
            assert t[key] <= t[f"sum_step_{c}"] * (1 + 1e-6) + 1e-12, (f, c)


def test_state_dict_between_settings():
    """With -> without: loaded, the sums dropped with one warning naming cumulative=True; without -> with:
    refused by check_state (and load_state_dict) before anything changes, naming cumulative=False;
    without -> without continues the series (step_sums included) as an uninterrupted run."""
    m = _model()
    opt = _track(m, cumulative=True)
    _train(m, opt, 4)
    with_state = opt.tracker.state_dict()
    assert set(with_state["cumulative"]) == set(CUMULATIVE)
    m2 = _model()
    plain = _track(m2)
    _train(m2, plain, 4)
    without_state = plain.tracker.state_dict()
    assert without_state["cumulative"] == {} and without_state["step_sums"].shape == (4, 1)

    fresh = _track(_model())
    with pytest.warns(RuntimeWarning, match="dropped .*cumulative=True"):
        fresh.tracker.load_state_dict(with_state)
    assert not fresh.tracker.cumulative and fresh.tracker.step_count == 4
    assert not (PER_ENTRY & set(fresh.tracker.totals()["relu"]))

    keeper = _track(_model(), cumulative=True)
    before = keeper.tracker.state_dict()
    with pytest.raises(ValueError, match="cumulative=False"):
        keeper.tracker.check_state(without_state)
    with pytest.raises(ValueError, match="cumulative=False"):
        keeper.tracker.load_state_dict(without_state)
    assert keeper.tracker.step_count == 0 and set(keeper.tracker.cumulative) == set(CUMULATIVE)
    assert torch.equal(keeper.tracker.h.vec, before["h"]["vec"])

    # without -> without: the resumed totals equal those of the run that went on
    m3 = _model()
    whole = _track(m3)
    _train(m3, whole, 4)
    mid = copy.deepcopy(whole.tracker.state_dict())
    m_copy = copy.deepcopy(m3)
    _train(m3, whole, 4, seed=1)
    want = whole.tracker.totals()
    resumed = _track(m_copy)
    resumed.tracker.load_state_dict(mid)
    _train(m_copy, resumed, 4, seed=1)
    got = resumed.tracker.totals()
    for k, v in want["relu"].items():
        assert got["relu"][k] == pytest.approx(v, rel=1e-12, abs=1e-15), k

    # a state saved before step_sums existed: the sums are unknown (NaN), not restarted from 0
    old = dict(without_state)
    del old["step_sums"]
    t = _track(_model())
    t.tracker.load_state_dict(old)
    assert all(math.isnan(t.tracker.totals()["relu"][f"sum_step_{c}"]) for c in CUMULATIVE)


def test_copies_and_pickles_keep_the_setting():
    m = _model()
    opt = _track(m, drift_every=2)
    _train(m, opt, 5)
    want = opt.tracker.totals()
    for new in (copy.deepcopy(opt.tracker), pickle.loads(pickle.dumps(opt.tracker))):
        assert new.keep_cumulative is False and isinstance(new.cumulative, CumulativeNotKept)
        assert new.totals() == want
        new.close()


def test_report_with_and_without(tmp_path):
    """summary.json / summary.md from totals with the decomposition (prediction columns) and without (None,
    one line naming the fix); ``conserve report`` rebuilds the same from summary.json."""
    for keep in (True, False):
        m = _model()
        opt = _track(m, cumulative=keep)
        sink = MemorySink()
        got = sink.records
        opt.tracker.sinks.append(sink)
        _train(m, opt, 6)
        opt.close()
        tot = opt.tracker.totals()
        row = summarize(got, tot)["relu"]
        assert row["total_decomposition"] is keep
        assert (row["total_drift_predicted"] is not None) is keep and row["total_drift_measured"] is not None
        out = tmp_path / str(keep)
        out.mkdir()
        with open(out / "metrics.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in got)
        write_summary(out, got, {"command": "test"}, tot)
        md = (out / "summary.md").read_text()
        assert (NOT_KEPT in md) is (not keep)
        again = conserve.report.report(out, tmp_path / f"again{keep}")
        assert again["families"]["relu"]["total_decomposition"] is keep
        assert (NOT_KEPT in (tmp_path / f"again{keep}" / "summary.md").read_text()) is (not keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert summarize(got, None)["relu"].get("total_decomposition") is None  # no totals: nothing said
