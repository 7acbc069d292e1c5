"""The command line around a run: fast --help, python -m conserve, conserve report on any metrics file,
verdicts, divergence / Ctrl-C / out-of-memory stops, plain progress lines off a terminal."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import conserve
from conserve.cli import main
from conserve.report import verdict

FAST = ["--size", "tiny", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--batch-size", "2", "--seq-len", "16",
        "--every", "2"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_help_imports_no_torch_and_python_m_works():
    code = ("import sys; from conserve.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0 and r.stdout.strip().endswith("False"), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "conserve", "--help"], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0 and "report" in r.stdout and "run" in r.stdout


def test_report_from_a_users_own_loop(tmp_path, capsys):
    """A metrics.jsonl written by conserve.Tracker in a plain loop becomes a summary, verdicts and plots."""
    from conserve.models import MLP

    torch.manual_seed(0)
    model = MLP([6, 8, 3])
    opt = conserve.track(torch.optim.SGD(model.parameters(), lr=0.05), model, every=3,
                         sinks=[conserve.JSONLSink(tmp_path / "mine" / "metrics.jsonl")])
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    for _ in range(7):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        opt.record(loss=loss.detach())
    opt.close()
    assert main(["report", str(tmp_path / "mine" / "metrics.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["steps"] == 7 and summary["final_loss"] is not None
    fam = summary["families"]["relu"]
    # full-batch GD on a ReLU MLP: the unit laws hold, their drift is the second-order term (Noether)
    assert fam["verdict_key"] in ("holds", "holds_rounding"), fam
    assert "relu" in out and fam["verdict"] in out
    for f in ("eps.png", "drift.png", "layers.png", "summary.md"):
        assert (tmp_path / "rep" / f).stat().st_size > 0, f


def test_report_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not found" in _one_line(capsys)
    (tmp_path / "m.jsonl").write_text('{"hello": 1}\nnot json\n')
    assert main(["report", str(tmp_path / "m.jsonl")]) == 2
    assert "no records" in _one_line(capsys)


@pytest.mark.parametrize("stats,key", [
    (dict(eps_final=0.3, sum_measured=1.0, sum_decay=0.0, sum_first=1e-7, sum_second=1.0), "holds"),
    (dict(eps_final=0.3, sum_measured=1.0, sum_decay=0.0, sum_first=0.9, sum_second=0.1), "first_order"),
    (dict(eps_final=0.3, sum_measured=1.0, sum_decay=0.8, sum_first=0.1, sum_second=0.1), "weight_decay"),
    (dict(eps_final=3e-7, sum_measured=1e-8, sum_decay=0.0, sum_first=1e-8, sum_second=0.0), "holds_rounding"),
    (dict(eps_final=0.9, guarded=1.0, total_drift_measured=1e-3), "h0_zero"),
    (dict(eps_final=0.2), "not_decomposed"),
])
def test_verdicts(stats, key):
    assert verdict(stats)[0] == key
    assert verdict(stats, ["different lr in one law: up 0.2, down 0.1"]) == \
        ("broken_by", "broken_by: different lr in one law: up 0.2, down 0.1")


def test_report_of_rows_that_went_non_finite_says_so(tmp_path, capsys):
    """A metrics file from a loop with on_nonfinite='warn' (NaN written as null from step 3 on): the verdict
    names the step, eps final is not the last finite value."""
    rows = [{"step": k, "eps/vo": (0.1 * k if k < 3 else None), "eps/gain": 0.01 * k} for k in range(1, 6)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    fams = json.loads((tmp_path / "rep" / "summary.json").read_text())["families"]
    assert fams["vo"]["verdict_key"] == "nonfinite" and fams["vo"]["eps_final"] is None
    assert "from step 3 (3 recorded step(s))" in fams["vo"]["verdict"] and "2.00e-01" in fams["vo"]["verdict"]
    assert fams["gain"]["verdict_key"] != "nonfinite" and fams["gain"]["eps_final"] == pytest.approx(0.05)
    assert "| vo | non-finite law values from step 3" in (tmp_path / "rep" / "summary.md").read_text()
    assert "non-finite law values from step 3" in capsys.readouterr().out


def test_divergence_stops_names_the_step_and_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *FAST, "--no-progress", "--steps", "30", "--lr", "1e4"]) == 3
    err = _one_line(capsys)
    assert "diverged at step" in err and "--lr" in err
    step = int(err.split("at step ")[1].split(":")[0])
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, step + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert "diverged" in summary["stopped"]
    assert (out / "eps.png").exists()


def test_ctrl_c_keeps_summary_and_plots(tmp_path, capsys, monkeypatch):
    from conserve import data

    calls = {"n": 0}
    orig = data.Batches.__next__

    def interrupting(self):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(data.Batches, "__next__", interrupting)
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *FAST, "--no-progress", "--steps", "50"]) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5 and "interrupted" in summary["stopped"]
    assert (out / "eps.png").exists() and (out / "summary.md").exists()


def test_out_of_memory_sizes_are_refused_in_one_line(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "o"), *FAST, "--no-progress", "--steps", "1",
                 "--seq-len", "100000", "--batch-size", "64"]) == 2
    assert "--seq-len" in _one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_plain_progress_lines_off_a_terminal_and_tensorboard_rerun(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    for again in ([], ["--overwrite"]):  # a re-run into the same directory keeps one series
        assert main(["run", "--out", str(out), *FAST, "--steps", "4", "--tensorboard", *again]) == 0
    text = capsys.readouterr().out
    assert "step 4/4" in text and "worst eps" in text and "\x1b[" not in text
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1


def test_control_monitor_is_a_real_baseline(tmp_path):
    """The all-signs-+ control moves under training while the law it shadows does not (float64, small lr)."""
    from conserve.models import MLP
    from conserve.tracking.control import ControlMonitor

    torch.manual_seed(0)
    model = MLP([5, 7, 3]).double()
    laws = model.conservation_laws()[0]
    mon = ControlMonitor(laws, dict(model.named_parameters()), fp64=True)
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.SGD(model.parameters(), lr=1e-3), model, every=5, sinks=[sink], fp64=True,
                         monitors=[mon])
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    for _ in range(10):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    last = sink.records[-1]
    assert last["control/relu"] > 1e-4  # the weights move at first order
    assert last["eps/relu"] < 1e-2 * last["control/relu"]  # the law only at second order (lr^2)
    assert verdict(dict(eps_final=0.1, control_final=0.12, sum_measured=1.0, sum_decay=0.0, sum_first=0.0,
                        sum_second=1.0))[0] == "step_size"


def test_a_locked_run_directory_is_refused_before_anything_in_it_is_touched(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.json").write_text("{}")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from conserve.tracking.lock import RunDirLock; "
                               f"lock = RunDirLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["run", "--out", str(out), *FAST, "--no-progress", "--steps", "2", "--overwrite"]) == 2
        err = _one_line(capsys)
        assert "in use by another conserve process" in err and "--out" in err
        assert err.count("wait for it to finish") == 1, err  # the lock's own advice, not repeated by the hint
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and (out / "config.json").read_text() == "{}"
    finally:
        holder.kill()
        holder.wait()


def test_report_names_damaged_lines_and_steps_that_go_back(tmp_path):
    """A corrupt line inside the file (not a crash's torn last line) and a second run appended to the
    same file are said, not silently skipped/mixed; float steps written by other tools (2.0) are steps."""
    from conserve.report import read_metrics, truncated_note

    rows = [json.dumps({"step": s, "eps/vo": 0.1 * s}) for s in (1, 2, 3)]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([rows[0], '{"step": 2, "eps/v', rows[2], '{"step": 4.0, "eps/vo": 0.4}', '{"st']) + "\n")
    with pytest.warns(RuntimeWarning, match=r"skipped 1 line\(s\) that are not JSON \(line 2\)"):
        recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 3, 4] and isinstance(recs[-1]["step"], int)
    path.write_text("\n".join(rows + rows[:2]) + "\n")
    with pytest.warns(RuntimeWarning, match=r"steps go back at line 4 \(step 1 after 3\): two runs in one file"):
        assert len(read_metrics(path)) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.write_text("\n".join(rows) + "\n" + rows[0][:9])  # a crash's torn last line: kept for the summary
        recs = read_metrics(path)
        assert [r["step"] for r in recs] == [1, 2, 3] and recs.truncated == 9
    assert truncated_note(recs) == "the last line of m.jsonl is truncated (9 bytes): ignored"


def test_report_beside_a_damaged_or_foreign_summary_and_config(tmp_path, capsys):
    """config.json / summary.json of another program or version (a JSON list) or damaged (binary): the
    report is built from the metrics, with one warning per file, not a traceback."""
    rows = [json.dumps({"step": s, "eps/vo": 0.1 * s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "config.json").write_text("[1, 2]")
    (tmp_path / "summary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(RuntimeWarning) as w:
        assert main(["report", str(tmp_path)]) == 0
    said = sorted(str(x.message) for x in w if "ignored" in str(x.message))
    assert len(said) == 2 and "config.json is a JSON list, not an object" in said[0]
    assert "summary.json is unreadable (UnicodeDecodeError)" in said[1]
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["steps"] == 3
    assert (tmp_path / "summary.json").read_bytes() == b"\xff\xfe\x00garbage"  # the damaged original is left alone


def test_report_of_a_callback_run_names_the_laws_its_param_groups_break(tmp_path, capsys):
    """A framework run (HF Trainer: no weight decay on the norms) has no summary.json with ``broken_by``;
    its rows count them in ``broken/<family>``: the verdict says so instead of judging the family."""
    rows = [json.dumps({"step": s, "eps/gain": 0.01 * s, "broken/gain": 5, "eps/vo": 0.1, "broken/vo": 0})
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    fams = json.loads((tmp_path / "report" / "summary.json").read_text())["families"]
    assert fams["gain"]["verdict_key"] == "broken_by" and "5 law(s) broken by the optimizer's param_groups" in \
        fams["gain"]["verdict"]
    assert fams["vo"]["verdict_key"] != "broken_by"


def test_report_leaves_out_law_values_that_are_not_numbers(tmp_path):
    """A metrics file another tool wrote, with a law value as a string or a list: a TypeError traceback
    (math.isfinite); they are left out, with a warning, and not read as non-finite (null) values."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "eps/vo": "0.1", "loss": "x"}\n{"step": 2, "eps/vo": 0.2, "eps/qk": [1], "loss": true}\n'
        '{"step": 3, "eps/vo": 0.3, "eps/qk": 0.5, "drift/vo/measured": "NaN"}\n')
    with pytest.warns(RuntimeWarning, match=r"5 value\(s\) are not numbers \(e.g. eps/vo = '0.1' at step 1\)"):
        assert main(["report", str(tmp_path)]) == 0
    fams = json.loads((tmp_path / "report" / "summary.json").read_text())["families"]
    assert fams["vo"]["verdict_key"] != "nonfinite" and fams["vo"]["eps_final"] == pytest.approx(0.3)
    assert fams["qk"]["eps_final"] == pytest.approx(0.5)
