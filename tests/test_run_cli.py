"""`conserve run` end to end on real text (PTB from ../shared/data) and every bad-input case."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conserve.cli import main

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PTB = DATA / "ptb" / "ptb.train.txt.gz"
FAST = ["--size", "tiny", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--batch-size", "2", "--seq-len", "16",
        "--no-progress", "--every", "2"]


def _run(tmp_path, *extra, out="run"):
    return main(["run", "--out", str(tmp_path / out), *FAST, *extra])


@pytest.mark.skipif(not PTB.exists(), reason="../shared/data/ptb is not laid beside the repository")
def test_run_on_ptb_writes_every_file(tmp_path, capsys):
    # the sampled cadence (the default above conserve.tracker.EXACT_MAX_BYTES), passed explicitly
    assert _run(tmp_path, "--data", str(PTB), "--steps", "5", "--drift-every", "4", "--snapshot-budget", "0.04") == 0
    out = tmp_path / "run"
    for f in ("config.json", "metrics.jsonl", "summary.md", "summary.json", "eps.png", "drift.png"):
        assert (out / f).stat().st_size > 0, f
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    summary = json.loads((out / "summary.json").read_text())
    fams = set(summary["families"])
    assert {"swiglu", "qk", "vo", "rope_pair", "router_sum", "gain", "translation"} <= fams
    assert summary["config"]["data_source"].endswith("ptb.train.txt.gz")
    # the sampled cadence keeps no per-entry cumulative sums: the total decomposition is
    # absent (never estimated) and the summary says how to get it; the measured total is still there
    for f, row in summary["families"].items():
        assert row["total_decomposition"] is False and row["total_drift_predicted"] is None, f
        assert row["total_drift_measured_sampled"] is None and row["total_drift_measured"] >= 0, f
        t = summary["totals"][f]
        assert t["cumulative"] is False and not {"decay", "first", "second", "predicted"} & set(t), f
        assert t["sum_step_second"] >= 0, f
    md = (out / "summary.md").read_text()
    assert "| swiglu |" in md
    assert "total decomposition not kept (sampled drift): pass cumulative=True" in md
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0  # rebuilt from summary.json alike
    assert "total decomposition not kept (sampled drift)" in (tmp_path / "again" / "summary.md").read_text()


def test_the_default_run_is_exact_and_fills_the_total_columns(tmp_path, capsys):
    """By default every law is decomposed on every step and the cumulative sums are kept: each row has every
    family's drift terms, and the summary's measured and predicted totals are filled in (equal by the identity)."""
    assert _run(tmp_path, "--steps", "6") == 0
    out = tmp_path / "run"
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    fams = json.loads((out / "summary.json").read_text())["families"]
    assert all(r[f"drift/{f}/second"] is not None for r in recs for f in fams)
    for f, row in fams.items():
        assert row["total_decomposition"] is True, f
        assert row["total_drift_predicted"] == pytest.approx(row["total_drift_measured_sampled"], rel=1e-3,
                                                             abs=1e-6), f
    drift = (out / "summary.md").read_text().split("## Drift")[1].split("How to read it")[0]
    rows = [line for line in drift.splitlines() if line.startswith("| ") and not line.startswith("| family")]
    assert len(rows) == len(fams) and not any("| - |" in line or line.endswith("| - |") for line in rows), drift
    assert json.loads((out / "config.json").read_text())["status"] == "finished"
    assert not list(out.glob(".*.lock"))  # the lock files go with the run


def test_default_corpus_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    assert _run(tmp_path, "--steps", "2", "--tensorboard", "--optimizer", "adamw", "--weight-decay", "0.1") == 0
    assert any((tmp_path / "run" / "tb").iterdir())
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["data_source"].startswith("embedded")


def test_user_directory_in_wikitext_layout(tmp_path):
    d = tmp_path / "wt"
    d.mkdir()
    with gzip.open(d / "wiki.train.tokens.gz", "wt") as f:
        f.write(" = Title = \n\n The quick brown fox jumps over the lazy dog . \n" * 40)
    assert _run(tmp_path, "--data", str(d), "--steps", "2", "--optimizer", "gd", "--continuity") == 0
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= last["continuity/v1/self_attn.q_proj"] <= 1


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "notutf8"])
def test_bad_data_files(tmp_path, capsys, case):
    p = tmp_path / "data.txt"
    if case == "empty":
        p.write_text("  \n")
    elif case == "binary":
        p.write_bytes(bytes(range(256)) * 10)
    elif case == "notutf8":
        p.write_bytes(b"\xff\xfe\xfa" * 500)
    assert _run(tmp_path, "--data", str(p), "--steps", "1") == 2
    err = _err(capsys)
    assert "--data" in err or "text file" in err


def test_bad_option_value_and_unwritable_output(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--optimizer", "lbfgs"])
    assert e.value.code == 2
    assert "invalid choice" in _err(capsys)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["run", "--out", str(blocker / "sub"), "--steps", "1", "--no-progress"]) == 2
    assert "--out" in _err(capsys)
    assert _run(tmp_path, "--steps", "0") == 2
    assert "--steps" in _err(capsys)


def test_nan_loss_stops_names_the_step_and_keeps_files(tmp_path, capsys):
    assert _run(tmp_path, "--steps", "40", "--lr", "1e6", "--every", "1", "--max-eps", "0") == 3  # diverged (2: bad input)
    err = _err(capsys)
    assert "NaN/Inf at step" in err and ("--lr" in err or "learning rate" in err)
    step = int(err.split("at step ")[1].split()[0].rstrip(";"))
    out = tmp_path / "run"
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, step))
    assert (out / "summary.json").exists() and "stopped" in json.loads((out / "summary.json").read_text())


def test_console_script_reports_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "conserve.cli", "run", "--data", str(tmp_path / "nope.txt"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not found" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--kv-heads", "3", "--heads", "4"], "--kv-heads"), (["--rotary-dim", "3"], "rotary_dim"),
    (["--top-k", "9", "--experts", "4"], "--top-k"), (["--heads", "0"], "--heads"),
    (["--weight-decay", "-1"], "--weight-decay"), (["--device", "foo"], "--device"),
    (["--nope-layers", "7"], "out of range"), (["--lr", "nan"], "--lr"), (["--drift-every", "0"], "--drift-every"),
])
def test_inconsistent_architecture_and_options_are_one_line_errors(tmp_path, capsys, args, needle):
    assert main(["run", "--out", str(tmp_path / "o"), "--steps", "1", "--no-progress", *args]) == 2
    assert needle in _err(capsys)
    assert not (tmp_path / "o").exists()  # nothing is created before the inputs are known to be good


def test_drift_cadence_options(tmp_path):
    """``--drift-every 1 --snapshot-budget none``: every law decomposed on every step (finite drift columns
    each row); the default cadence decomposes steps 1, 1 + N, ... only (NaN columns between); a bad
    budget is refused by argparse naming the option."""
    assert _run(tmp_path, "--steps", "5", "--drift-every", "1", "--snapshot-budget", "none", out="every") == 0
    recs = [json.loads(l) for l in (tmp_path / "every" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 5 and all(r["drift/swiglu/second"] is not None for r in recs)
    # --cumulative keeps the per-entry sums in sampled mode too (exact mode keeps them by default): the
    # identity holds to rounding over the decomposed (law, step) pairs
    assert _run(tmp_path, "--steps", "5", "--drift-every", "2", "--cumulative", out="sparse") == 0
    recs = [json.loads(l) for l in (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()]
    assert [r["drift/swiglu/second"] is None for r in recs][1::2] == [True, True]
    for run in ("every", "sparse"):
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        for f, row in summary["families"].items():
            assert row["total_decomposition"] is True, (run, f)
            assert row["total_drift_predicted"] == pytest.approx(row["total_drift_measured_sampled"], rel=1e-3,
                                                                 abs=1e-6), (run, f)
        assert "total decomposition not kept" not in (tmp_path / run / "summary.md").read_text()
    with pytest.raises(SystemExit):
        main(["run", "--snapshot-budget", "-1", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_rerun_into_the_same_directory_keeps_the_earlier_run_unless_overwrite(tmp_path, capsys):
    assert _run(tmp_path, "--steps", "3") == 0
    out = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert _run(tmp_path, "--steps", "2") == 2  # refused: nothing touched
    err = _err(capsys)
    assert "earlier run (3 metric rows)" in err and "--overwrite" in err and "--out" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert _run(tmp_path, "--steps", "2", "--overwrite") == 0
    assert "replaced the earlier run" in capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "config.json").read_text())["steps"] == 2


def test_failed_start_writes_nothing(tmp_path, capsys, monkeypatch):
    """A check that fails after the inputs (TensorBoard missing, the tracker refusing the model) leaves no
    run directory, config.json or empty metrics.jsonl behind; an existing directory keeps its files."""
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert _run(tmp_path, "--steps", "2", "--tensorboard") == 2
    assert "tensorboard" in _err(capsys).lower()
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(builtins, "__import__", real_import)

    import conserve

    def refuse(*a, **k):
        from conserve.errors import UsageError

        raise UsageError("no laws (test)")

    monkeypatch.setattr(conserve.optim, "track", refuse)
    assert _run(tmp_path, "--steps", "2") == 2
    assert "no laws" in _err(capsys)
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert _run(tmp_path, "--steps", "2", out="mine") == 2
    assert sorted(p.name for p in (tmp_path / "mine").iterdir() if not p.name.endswith(".lock")) == ["notes.txt"]


def test_full_disk_saves_the_run_elsewhere_in_one_line(tmp_path, capsys, monkeypatch):
    """The JSONL file fails (ENOSPC) from step 3 on and the summary cannot be written: every row is saved to
    a fallback directory under tempfile.gettempdir(), one line names it and `conserve report`; exit 4."""
    import errno
    import tempfile

    from conserve import report
    from conserve.tracking import sinks

    fb_root = tmp_path / "tmp"
    fb_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fb_root))
    real_write, real_summary = sinks.JSONLSink.write, report.write_summary

    def full_write(self, step, metrics):
        if step >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, step, metrics)

    def full_summary(run_dir, *a, **k):
        if Path(run_dir) == tmp_path / "run":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_summary(run_dir, *a, **k)

    monkeypatch.setattr(sinks.JSONLSink, "write", full_write)
    monkeypatch.setattr(report, "write_summary", full_summary)
    with pytest.warns(RuntimeWarning):
        assert _run(tmp_path, "--steps", "6") == 4
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    line = err.splitlines()[-1]
    assert "6 metric rows" in line and "conserve report" in line and "free space" in line, line
    saved = next(fb_root.glob("conserve-run-*")) / "metrics.jsonl"
    assert str(saved) in line
    assert [json.loads(l)["step"] for l in saved.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    monkeypatch.setattr(sinks.JSONLSink, "write", real_write)
    assert main(["report", str(saved)]) == 0  # the saved file is a complete run


def test_sizes_that_cannot_fit_are_refused_before_building(tmp_path, capsys):
    for extra in (["--hidden", "100000000"], ["--hidden", "20000", "--layers", "40"]):
        assert main(["run", "--out", str(tmp_path / "o"), "--steps", "5", "--no-progress", *extra]) == 2
        err = _err(capsys)
        assert "GiB" in err and "--hidden" in err and "--layers" in err
    assert not (tmp_path / "o").exists()


def test_allocation_failure_while_building_is_one_line(tmp_path, capsys, monkeypatch):
    from conserve.commands import run

    monkeypatch.setattr(run, "_check_memory", lambda *a: None)  # the estimate passes, the allocator does not
    import conserve.models

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(conserve.models, "DecoderLM", no_memory)
    assert _run(tmp_path, "--steps", "2") == 2
    err = _err(capsys)
    assert "out of memory" in err and "--hidden" in err
    assert not (tmp_path / "run").exists()


def test_argument_errors_point_to_the_sub_command_help(capsys):
    for argv, hint in ((["run", "--bogus"], "`conserve run --help`"), (["run", "--steps", "x"], "`conserve run --help`"),
                       (["bogus"], "`conserve --help`")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.endswith(f"(see {hint})"), err


def test_size_help_names_the_presets_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default tiny" in text and "base (hidden 128, 4 layers, 8 heads / 4 kv)" in text and "--overwrite" in text
