"""Verdicts a researcher can trust: each carries the numbers it rests on and refuses what they cannot support
(a residual at least as large as the terms, first-order drift under plain SGD, eps above the non-conserved
control); stopped runs and torn metrics lines are said; ``conserve report`` leaves a run's own files alone.

The metrics files are built by hand in the JSONL format ``conserve run`` writes (conserve.tracking.sinks):
one object per step with ``eps/<family>``, ``control/<family>``, ``loss`` and, at drift steps,
``drift/<family>/{measured,decay,first,second,residual}``."""
import json
import math

import pytest

from conserve.analysis.floor import rounding_floor, unit_roundoff
from conserve.cli import main
from conserve.report import read_metrics

SGD = {"command": "conserve run", "optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "momentum": 0.0, "steps": 12}
ADAMW = {**SGD, "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.0}


def _rows(fam="rope_pair", steps=12, eps=2.5e-5, control=3e-3, drift=None, drift_steps=(3, 7, 11), loss=3.0):
    rows = []
    for k in range(1, steps + 1):
        r = {"step": k, f"eps/{fam}": eps * k / steps, f"control/{fam}": control, "loss": loss}
        if drift and k in drift_steps:
            r.update({f"drift/{fam}/{t}": v for t, v in drift.items()})
        rows.append(r)
    return rows


def _run_dir(tmp_path, rows, config=None, name="run", tail=""):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


def _report(d, capsys, *extra):
    assert main(["report", str(d), "--out", str(d / "report"), *extra]) == 0
    out = capsys.readouterr()
    return json.loads((d / "report" / "summary.json").read_text()), out


# float32 rounding at the rope_pair scale of a 170-step CPU run: the residual is ten times the terms
ROUNDING = {"measured": 1.9e-8, "decay": 0.0, "first": 2.6e-9, "second": 1.6e-9, "residual": 2.0e-8}


def test_residual_above_the_terms_is_undetermined_not_broken(tmp_path, capsys):
    d = _run_dir(tmp_path, _rows(drift=ROUNDING), SGD)
    summary, out = _report(d, capsys)
    fam = summary["families"]["rope_pair"]
    assert fam["verdict_key"] == "undetermined", fam["verdict"]
    v = fam["verdict"]
    assert v.startswith("undetermined at this precision (residual >= terms): rerun with --fp64-laws"), v
    assert "broken" not in v and "3 decomposed steps" in v and "residual 6.0e-08" in v and "first 7.8e-09" in v
    assert fam["decomposed_steps"] == 3 and fam["sum_residual"] == pytest.approx(6e-8)
    assert "rope_pair" in out.out and "undetermined" in out.out
    # run with the laws in float64 already: the advice is more decomposed steps, not --fp64-laws
    d64 = _run_dir(tmp_path, _rows(drift=ROUNDING), {**SGD, "fp64_laws": True}, name="run64")
    v64 = _report(d64, capsys)[0]["families"]["rope_pair"]["verdict"]
    assert "--fp64-laws" not in v64 and "--drift-every 1" in v64


def test_first_order_drift_under_plain_sgd_is_a_bug_report(tmp_path, capsys):
    real = {"measured": 1.1e-3, "decay": 0.0, "first": 1e-3, "second": 1e-4, "residual": 1e-9}
    summary, _ = _report(_run_dir(tmp_path, _rows(drift=real), SGD), capsys)
    fam = summary["families"]["rope_pair"]
    assert fam["verdict_key"] == "sgd_first_order"
    assert fam["verdict"].startswith("first-order drift under plain SGD, where theory gives zero: a bug report, not "
                                     "a verdict"), fam["verdict"]
    assert "broken by the optimizer" not in fam["verdict"] and "3 decomposed steps" in fam["verdict"]
    # the same rows under AdamW: the first-order term is the optimizer's, with the numbers it rests on
    summary, _ = _report(_run_dir(tmp_path, _rows(drift=real), ADAMW, name="adam"), capsys)
    fam = summary["families"]["rope_pair"]
    assert fam["verdict_key"] == "first_order"
    v = fam["verdict"]
    assert v.startswith("broken by the optimizer: first order is 91% of decay + first + second (per-step norms "
                        "summed) (3 decomposed steps, per-step norms summed: measured 3.3e-03, decay 0, first 3.0e-03, "
                        "second 3.0e-04, residual 3.0e-09"), v


@pytest.mark.parametrize("first,key", [(1.8e-3, "momentum"), (1e-2, "first_order")])
def test_first_order_under_momentum_is_read_against_its_prediction(tmp_path, capsys, first, key):
    """Heavy-ball momentum: the first-order term is the earlier steps' second-order drift carried along,
    first / second = 2 beta / (1 - beta) = 18 at beta 0.9 in steady state; far more than that is the optimizer's."""
    drift = {"measured": first + 1e-4, "decay": 0.0, "first": first, "second": 1e-4, "residual": 1e-9}
    config = {**SGD, "optimizer": "momentum", "momentum": 0.9, "lr": 0.02}
    fam = _report(_run_dir(tmp_path, _rows(drift=drift), config), capsys)[0]["families"]["rope_pair"]
    assert fam["verdict_key"] == key, fam["verdict"]
    assert "2 beta / (1 - beta) = 18.0" in fam["verdict"]


def test_first_order_at_the_floor_under_sgd_is_zero_as_theory_says(tmp_path, capsys):
    """Under plain SGD a first-order term no larger than the rounding floor is read as zero: the verdict
    rests on the second-order term and says where the first-order one stands."""
    drift = {"measured": 1e-3, "decay": 0.0, "first": 2e-8, "second": 1e-3, "residual": 3e-8}
    fam = _report(_run_dir(tmp_path, _rows(fam="swiglu", drift=drift, eps=3e-3, control=3e-2), SGD),
                  capsys)[0]["families"]["swiglu"]
    assert fam["verdict_key"] == "holds"
    assert "first order 6.0e-08 under the residual 9.0e-08: zero, as plain SGD's theory says" in fam["verdict"]
    assert "of the measured per-step change (|sum measured - sum second| / sum measured)" in fam["verdict"]


def test_eps_above_the_control_is_not_called_conserved(tmp_path, capsys):
    second = {"measured": 1.3e-3, "decay": 0.0, "first": 4e-9, "second": 1.3e-3, "residual": 2e-8}
    rows = _rows(fam="vo", eps=0.65, control=0.38, drift=second)
    fam = _report(_run_dir(tmp_path, rows, SGD), capsys)[0]["families"]["vo"]
    v = fam["verdict"]
    assert fam["verdict_key"] == "step_size" and "conserved by the flow" not in v, v
    assert v.startswith("not conserved at this step size: eps 6.50e-01 is 1.7x its non-conserved control's "
                        "3.80e-01"), v
    assert "second-order (discretisation) term" in v and "3 decomposed steps" in v


@pytest.mark.parametrize("status,reason", [(None, "killed"), ("running", "killed"), ("interrupted", "interrupted")])
def test_a_stopped_run_says_where_it_stopped(tmp_path, capsys, status, reason):
    config = {**SGD, "steps": 300, **({"status": status} if status else {})}
    d = _run_dir(tmp_path, _rows(steps=170), config)
    summary, out = _report(d, capsys)
    assert summary["stopped"].startswith(f"stopped at step 170 of 300 ({reason})"), summary["stopped"]
    md = (d / "report" / "summary.md").read_text()
    assert md.startswith("# conserve run: 170 of 300 steps")
    assert f"**Stopped early:** stopped at step 170 of 300 ({reason})" in md and "steps 1..170 only" in md
    assert f"stopped at step 170 of 300 ({reason})" in out.out and f"stopped at step 170 of 300 ({reason})" in out.err


def test_a_run_whose_loss_went_non_finite_is_diverged_and_a_finished_one_is_not_stopped(tmp_path, capsys):
    rows = _rows(steps=20)
    rows[-1]["loss"] = None
    summary, _ = _report(_run_dir(tmp_path, rows, {**SGD, "steps": 300}), capsys)
    assert summary["stopped"].startswith("stopped at step 20 of 300 (diverged)")
    summary, out = _report(_run_dir(tmp_path, _rows(steps=12), SGD, name="done"), capsys)
    assert "stopped" not in summary and "Stopped early" not in (tmp_path / "done" / "report" / "summary.md").read_text()


def test_a_truncated_last_line_is_said(tmp_path, capsys):
    torn = '{"step": 13, "eps/rope_pair": 2.6e-05, "contr'
    d = _run_dir(tmp_path, _rows(), SGD, tail=torn)
    summary, out = _report(d, capsys)
    assert summary["steps"] == 12
    note = "the last line of metrics.jsonl is truncated (45 bytes): ignored"
    assert summary["notes"] == [note]
    assert f"**Note:** {note}." in (d / "report" / "summary.md").read_text()
    assert note in out.err
    assert read_metrics(d).truncated == 45


def test_report_leaves_the_runs_own_files_alone_unless_overwrite(tmp_path, capsys):
    d = _run_dir(tmp_path, _rows(drift=ROUNDING), SGD)
    originals = {"summary.md": b"# the run's own summary\n", "summary.json": b'{"steps": 12}', "eps.png": b"PNG"}
    for n, b in originals.items():
        (d / n).write_bytes(b)
    assert main(["report", str(d)]) == 0  # the default: the report/ folder beside the metrics file
    out = capsys.readouterr()
    assert {n: (d / n).read_bytes() for n in originals} == originals
    assert f"wrote {d / 'report'}/" in out.out
    for n in ("summary.md", "summary.json", "eps.png", "drift.png"):  # no per-layer keys: no layers.png
        assert (d / "report" / n).stat().st_size > 0, n
    assert main(["report", str(d), "--out", str(d)]) == 2  # into the run's own directory: refused
    err = capsys.readouterr().err
    assert "holds the run's own summary.md, summary.json, eps.png" in err and "--overwrite" in err
    assert {n: (d / n).read_bytes() for n in originals} == originals
    assert main(["report", str(d), "--overwrite"]) == 0
    assert (d / "summary.md").read_text().startswith("# conserve run: 12 steps")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    assert "report/ beside the metrics file" in capsys.readouterr().out


def test_eps_jumps_at_loss_spikes_are_found():
    from conserve.report import eps_jumps

    rows = _rows(fam="vo", steps=40, eps=0.4)
    for r in rows:
        r["loss"] = 3.0 + 0.01 * (r["step"] % 3)
    rows[24]["loss"] = 4.5  # step 25
    for r in rows[25:]:
        r["eps/vo"] *= 3
    for r in rows[33:]:
        r["eps/vo"] *= 3  # step 34: a jump without a loss spike
    got = eps_jumps(rows)
    assert [(j["step"], j["families"], j["loss_spike"]) for j in got] == [(26, ["vo"], True), (34, ["vo"], False)]
    assert got[0]["loss"] == 4.5


def test_rounding_floor():
    assert unit_roundoff("float32") == 2.0 ** -24 and unit_roundoff("fp64") == 2.0 ** -53
    torch = pytest.importorskip("torch")
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert rounding_floor(1.0, 1, "float32", values=1) == 2.0 ** -24
    assert rounding_floor(2.0, 16, "float32", values=2) == pytest.approx(2.0 * 2.0 ** -24 * math.sqrt(32))
    assert rounding_floor(1.0, dtype="float64") < 1e-15
    with pytest.raises(ValueError):
        unit_roundoff("int8")


def test_terms_under_the_rounding_of_the_weights_are_undetermined_whatever_the_law_dtype(tmp_path, capsys):
    """float64 laws (residual ~1e-17) on float32 weights: the first-order term left is the rounding of the
    stored weights (its floor: unit roundoff x the family's magnitude, from the run's totals), not a bug and
    not something --fp64-laws lowers."""
    fp64 = {"measured": 2.1e-9, "decay": 0.0, "first": 2.0e-9, "second": 7e-10, "residual": 2e-17}
    d = _run_dir(tmp_path, _rows(drift=fp64), SGD)
    # the run's own summary.json: Tracker.totals() with ||h_0|| (scale) and mean |h_0| / magnitude (balance)
    (d / "summary.json").write_text(json.dumps({"totals": {"rope_pair": {"scale": 0.23, "balance": 0.34,
                                                                         "cumulative": False}}}))
    fam = _report(d, capsys)[0]["families"]["rope_pair"]
    assert fam["floor"] == pytest.approx(3 * rounding_floor(0.23 / 0.34, 1, "float32", values=2))
    assert fam["verdict_key"] == "undetermined", fam["verdict"]
    assert fam["verdict"].startswith("undetermined at this precision (float32 rounding of the weights >= terms)")
    assert "--fp64-laws does not lower" in fam["verdict"] and "bug" not in fam["verdict"]
