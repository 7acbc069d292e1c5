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
    assert _run(tmp_path, "--data", str(PTB), "--steps", "5") == 0
    out = tmp_path / "run"
    for f in ("config.json", "metrics.jsonl", "summary.md", "summary.json", "eps.png", "drift.png"):
        assert (out / f).stat().st_size > 0, f
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    summary = json.loads((out / "summary.json").read_text())
    fams = set(summary["families"])
    assert {"swiglu", "qk", "vo", "rope_pair", "router_sum", "gain", "translation"} <= fams
    assert summary["config"]["data_source"].endswith("ptb.train.txt.gz")
    for f, row in summary["families"].items():  # the identity holds to rounding over the whole run
        # (over the decomposed (law, step) pairs: the snapshot budget decomposes a subset of laws per step)
        assert row["total_drift_predicted"] == pytest.approx(row["total_drift_measured_sampled"], rel=1e-3, abs=1e-6), f
    assert "| swiglu |" in (out / "summary.md").read_text()


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
    (["--kv-heads", "3", "--heads", "4"], "multiple"), (["--rotary-dim", "3"], "rotary_dim"),
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
    assert _run(tmp_path, "--steps", "5", "--drift-every", "2", out="sparse") == 0
    recs = [json.loads(l) for l in (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()]
    assert [r["drift/swiglu/second"] is None for r in recs][1::2] == [True, True]
    with pytest.raises(SystemExit):
        main(["run", "--snapshot-budget", "-1", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_rerun_into_the_same_directory_says_it_replaces_the_earlier_run(tmp_path, capsys):
    assert _run(tmp_path, "--steps", "3") == 0
    capsys.readouterr()
    assert _run(tmp_path, "--steps", "2") == 0
    err = capsys.readouterr().err
    assert "held an earlier run (3 metric rows): replaced" in err and "--out" in err
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_argument_errors_point_to_the_sub_command_help(capsys):
    for argv, hint in ((["run", "--bogus"], "`conserve run --help`"), (["run", "--steps", "x"], "`conserve run --help`"),
                       (["bogus"], "`conserve --help`")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.endswith(f"(see {hint})"), err
