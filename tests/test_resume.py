"""`conserve run --resume OUT`: a stopped run (killed, interrupted) continues from its last checkpoint with the
rows, byte for byte, of the same run never stopped; ``config.json``'s ``status`` says how a run ended."""
import errno
import json
import signal
import subprocess
import sys

import pytest

from conserve.cli import main
from conserve.commands import run as run_cmd

FAST = ["--size", "tiny", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--batch-size", "2", "--seq-len", "16",
        "--no-progress", "--every", "5", "--optimizer", "adamw", "--weight-decay", "0.1", "--steps", "20"]


def _steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _status(out):
    return json.loads((out / "config.json").read_text())["status"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The same run, never stopped (its rows carry no wall-clock field: compared whole)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(["run", "--out", str(out), *FAST]) == 0
    assert _status(out) == "finished"
    return out


def test_a_killed_run_resumes_with_the_rows_of_an_uninterrupted_run(whole, tmp_path, capsys):
    cut = tmp_path / "cut"
    p = subprocess.run([sys.executable, "-m", "conserve", "run", "--out", str(cut), *FAST, "--kill-after", "10"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert _status(cut) == "running"  # killed outright: `conserve report` infers "killed"
    assert _steps(cut) == list(range(1, 11)) and (cut / "checkpoint.pt").is_file()
    # a kill between a flush and its checkpoint leaves rows after the checkpoint: the resume cuts them
    with open(cut / "metrics.jsonl", "a") as f:
        f.write((whole / "metrics.jsonl").read_text().splitlines()[10] + "\n")
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="1 row"):
        assert main(["run", "--resume", str(cut), "--no-progress"]) == 0
    assert "continuing" in capsys.readouterr().err
    assert (cut / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    cfg = json.loads((cut / "config.json").read_text())
    assert cfg["status"] == "finished" and cfg["resumed_at"] == [10]
    a, b = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    assert a["totals"] == b["totals"] and a["families"] == b["families"]
    assert not list(cut.glob(".*.tmp")) and not list(cut.glob("*.lock")) and not list(cut.glob(".*.lock"))
    assert main(["run", "--resume", str(cut)]) == 2  # finished: nothing to resume
    assert "finished" in capsys.readouterr().err


def test_an_interrupted_run_is_marked_and_resumes(whole, tmp_path, monkeypatch, capsys):
    real = run_cmd._Checkpointer.__call__

    def ctrl_c_at_7(self, step, first_loss):
        real(self, step, first_loss)
        if step == 7:
            raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd._Checkpointer, "__call__", ctrl_c_at_7)
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *FAST]) == 130
    assert _status(out) == "interrupted" and _steps(out) == list(range(1, 8))
    monkeypatch.setattr(run_cmd._Checkpointer, "__call__", real)
    with pytest.warns(RuntimeWarning, match="2 row"):  # steps 6, 7 (after the step-5 checkpoint) are run again
        assert main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert (out / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert _status(out) == "finished"


def test_a_diverged_run_is_marked_and_not_resumed(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *FAST[:-4], "--steps", "20", "--lr", "1e6"]) == 3
    assert _status(out) == "diverged"
    assert main(["run", "--resume", str(out)]) == 2
    assert "diverged" in capsys.readouterr().err.splitlines()[-1]


def test_nothing_to_resume_is_one_line(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no conserve run there" in err


def test_a_full_disk_at_the_start_is_one_line_exit_4(tmp_path, capsys, monkeypatch):
    """config.json cannot be written (ENOSPC): one line naming the disk and the fix, the exit code of a disk
    that fills mid-run, and the start's files removed."""
    def full(path, data=None, save=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(run_cmd, "_atomic_write", full)
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *FAST]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("conserve run: error:") and "No space left on device" in err and "config.json" in err
    assert "free disk space" in err
    assert not out.exists()
