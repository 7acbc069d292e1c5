"""Sinks never lose a row: W&B with the user's own wandb.log calls, a failing sink isolated and
retried, JSONL/TensorBoard cut back to the resumed step, one process per run directory."""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve.errors import UsageError
from conserve.models import MLP
from conserve.tracking.sinks import JSONLSink, RunDirLock, TensorBoardSink


def _run(sinks, steps, every=4, state=None, save_at=None, seed=0):
    """Train a tiny MLP for ``steps`` steps (resuming from ``state``); returns the rows it flushed
    and, with ``save_at``, the checkpoint (model + optimizer) taken after that step."""
    torch.manual_seed(seed)
    m = MLP([4, 8, 3])
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=every, sinks=sinks)
    start = 0
    if state is not None:
        m.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    rows, saved = [], None
    for i in range(start, steps):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        loss = F.cross_entropy(m(torch.randn(6, 4, generator=g)), torch.randint(0, 3, (6,), generator=g))
        loss.backward()
        opt.step()
        opt.record(loss=loss.detach())
        if save_at == i + 1:
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "step": i + 1}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
    rows += opt.tracker.flush()
    opt.close()
    return opt, saved


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ W&B
def _wandb_records(path: Path) -> list:
    """The protobuf Records of an offline W&B run file (a LevelDB-style log: 7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    out, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if n == 0 and kind == 0:
            break
        buf, pos = buf + data[pos:pos + n], pos + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            out.append(rec)
    return out


def _wandb_history(run_dir: Path, timeout: float = 60.0) -> list[dict]:
    """History rows of a finished offline W&B run (wandb-core may still be writing after finish():
    wait for its exit record)."""
    import time

    path, t0 = next(run_dir.glob("run-*.wandb")), time.time()
    while True:
        recs = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.time() - t0 > timeout:
            break
        time.sleep(0.2)
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]


def test_wandb_keeps_every_row_when_the_user_logs_too(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    quiet = dict(console="off", x_disable_stats=True, x_disable_meta=True, disable_git=True, disable_code=True)
    try:
        settings = wandb.Settings(**quiet)
    except Exception:  # noqa: BLE001 - an older wandb without some of these settings
        settings = None
    run = wandb.init(project="conserve-test", dir=str(tmp_path), settings=settings)
    try:
        torch.manual_seed(0)
        m = MLP([4, 8, 3])
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=4,
                             sinks=[conserve.WandbSink(run)])
        for i in range(10):
            opt.zero_grad()
            loss = F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,)))
            loss.backward()
            opt.step()
            wandb.log({"user/loss": loss.item()})  # the user's own rows advance W&B's step
        opt.close()
    finally:
        run.finish()
    hist = _wandb_history(Path(run.dir).parent)
    conserve_steps = [h["conserve/step"] for h in hist if "conserve/step" in h]
    assert conserve_steps == list(range(1, 11))
    assert all("conserve_relu/eps" in h for h in hist if "conserve/step" in h)
    assert sum("user/loss" in h for h in hist) == 10


# ------------------------------------------------------------------------------- failing sinks
class _Flaky:
    """Raises OSError for the steps in ``bad`` while ``broken`` is set; records what it wrote."""

    def __init__(self, bad):
        self.bad, self.broken, self.records, self.closed = set(bad), True, [], False

    def write(self, step, metrics):
        if self.broken and step in self.bad:
            raise OSError(28, "No space left on device")
        self.records.append(step)

    def close(self):
        self.closed = True

    def __repr__(self):
        return "Flaky()"


def test_a_failing_sink_is_isolated_and_retried():
    mem, flaky = conserve.MemorySink(), _Flaky(bad={3, 4, 5})
    torch.manual_seed(0)
    m = MLP([4, 8, 3])
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=2, sinks=[flaky, mem])

    def step():
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
        opt.step()

    with pytest.warns(RuntimeWarning, match=r"sink Flaky\(\) failed at step 3 \(OSError.*No space left"):
        for _ in range(5):
            step()
        opt.flush()
    assert [r["step"] for r in mem.records] == [1, 2, 3, 4, 5]  # the other sink got every row
    assert flaky.records == [1, 2]
    assert opt.tracker.step_count == 5  # the steps are booked
    assert [r["step"] for r in opt.tracker.unwritten[flaky]] == [3, 4, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one line per failure spell, not per flush
        step()
        opt.flush()
    flaky.broken = False
    step()
    opt.close()
    assert flaky.records == [1, 2, 3, 4, 5, 6, 7]  # retried in order, each row once
    assert opt.tracker.unwritten == {} and flaky.closed
    assert [r["step"] for r in mem.records] == list(range(1, 8))


def test_dev_full_keeps_the_rows_in_memory_and_other_sinks_written(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    full, good = JSONLSink("/dev/full", lock=False), JSONLSink(tmp_path / "m.jsonl")
    with pytest.warns(RuntimeWarning) as w:
        opt, _ = _run([full, good], steps=6, every=4)
    msgs = [str(x.message) for x in w]
    assert any("failed at step 1" in s and "No space left" in s for s in msgs)
    assert any("could not write 6 row(s) (steps 1..6)" in s for s in msgs)
    assert [r["step"] for r in _lines(tmp_path / "m.jsonl")] == list(range(1, 7))
    assert [r["step"] for r in opt.tracker.unwritten[full]] == list(range(1, 7))


def test_jsonl_failed_write_leaves_no_partial_line(tmp_path, monkeypatch):
    import conserve.tracking.sinks as sinks_mod

    sink = JSONLSink(tmp_path / "m.jsonl")
    real, calls = os.write, []

    def half_then_fail(fd, data):
        calls.append(1)
        if len(calls) == 2:  # the second row: half of it reaches the file, then the disk is full
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(sinks_mod.os, "write", half_then_fail)
    with pytest.warns(RuntimeWarning, match="failed at step 2"):
        _run([sink], steps=3, every=1)
    rows = _lines(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]


# ------------------------------------------------------------------------------ resume truncation
def test_jsonl_and_tensorboard_resume_to_the_checkpoint_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    _, ck = _run([JSONLSink(path), TensorBoardSink(tb)], steps=8, every=3, save_at=5)
    first = _lines(path)
    assert [r["step"] for r in first] == list(range(1, 9))
    # resume from the step-5 checkpoint: steps 6..8 are computed again and must not be duplicated
    with pytest.warns(RuntimeWarning, match="3 row\\(s\\) from step 6 on"):
        _run([JSONLSink(path), TensorBoardSink(tb)], steps=8, every=3, state=ck)
    again = _lines(path)
    assert [r["step"] for r in again] == list(range(1, 9))
    for a, b in zip(first, again):
        assert b["eps/relu"] == pytest.approx(a["eps/relu"], rel=1e-5, abs=1e-9)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    events = acc.Scalars("conserve_relu/eps")
    assert [e.step for e in events] == list(range(1, 9))  # one series: the first run's 6..8 purged
    assert [e.value for e in events] == pytest.approx([r["eps/relu"] for r in again], rel=1e-5, abs=1e-9)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2


def test_jsonl_rerun_into_the_same_file_restarts_the_series(tmp_path):
    path = tmp_path / "m.jsonl"
    _run([JSONLSink(path)], steps=6)
    with path.open("a") as f:
        f.write('{"step": 7, "eps/re')  # a crash mid-line
    with pytest.warns(RuntimeWarning, match="held 7 row"):
        _run([JSONLSink(path)], steps=3)
    assert [r["step"] for r in _lines(path)] == [1, 2, 3]


def test_jsonl_resume_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    _, ck = _run([JSONLSink(path)], steps=4, every=1, save_at=4)
    with path.open("a") as f:
        f.write('{"step": 5, "eps/re')
    with pytest.warns(RuntimeWarning, match="1 row"):
        _run([JSONLSink(path)], steps=6, every=1, state=ck)
    assert [r["step"] for r in _lines(path)] == list(range(1, 7))


# ---------------------------------------------------------------------------------------- lock
_HOLD = textwrap.dedent("""
    import sys
    from conserve.tracking.sinks import RunDirLock, JSONLSink
    lock = RunDirLock(sys.argv[1]).acquire()
    sink = JSONLSink(sys.argv[1] + "/metrics.jsonl")
    print("held", flush=True)
    sys.stdin.read()
""")


def test_a_second_process_on_the_same_run_directory_is_refused(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"is in use by another conserve process \(pid {p.pid}\): wait for it "
                                             "to finish or pass another --out"):
            RunDirLock(tmp_path, hint="pass another --out").acquire()
        with pytest.raises(UsageError, match=r"in use.*write the metrics to another file"):
            JSONLSink(tmp_path / "metrics.jsonl")
        JSONLSink(tmp_path / "other.jsonl").close()  # another file in the same directory is fine
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    with RunDirLock(tmp_path) as lock:  # released when the holder exits
        with RunDirLock(tmp_path):  # re-entrant within one process
            assert lock.held
        assert lock.held
    assert not lock.held


def test_two_open_sinks_on_one_file_in_one_process_never_interleave(tmp_path):
    """Two trackers of one process on the same metrics file (two models; a new Trainer after one that
    raised, its tracker never closed): the second sink's first row cut the first one's rows and the
    steps interleaved (1, 2, 2, 3, 3). The newer sink takes the file, with a warning; the older
    tracker's rows stay in its ``unwritten``, named at its close."""
    path = tmp_path / "metrics.jsonl"

    def tracker():
        torch.manual_seed(0)
        m = MLP([4, 8, 3])
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=1, sinks=[JSONLSink(path)])

        def step():
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
            opt.step()
        return opt, step

    old, old_step = tracker()
    old_step()
    with pytest.warns(RuntimeWarning, match=r"still open in another JSONLSink of this process.*stops writing"):
        new, new_step = tracker()
    with pytest.warns(RuntimeWarning, match=r"written by a newer JSONLSink of this process"):
        for _ in range(3):
            old_step()
            new_step()
    new.close()
    assert [r["step"] for r in _lines(path)] == [1, 2, 3]  # the newer run's series, nothing interleaved
    with pytest.warns(RuntimeWarning, match=r"could not write 4 row\(s\) \(steps 1..4\)"):
        old.close()  # (its step-1 row was still pending when the newer sink took the file)
    assert [r["step"] for r in old.tracker.unwritten[old.tracker.sinks[0]]] == [1, 2, 3, 4]
    assert [r["step"] for r in _lines(path)] == [1, 2, 3]
    JSONLSink(path).close()  # both closed: the file can be written again, without a warning


def test_recorded_values_no_sink_can_write_are_refused_at_record_time(tmp_path):
    """numpy scalars are converted (json cannot write np.float32: the JSONL sink would fail on that row
    at every retry and hold every later row back); a several-element tensor is refused when recorded,
    not at the flush (which then failed at every flush and lost the pending rows)."""
    import numpy as np

    path = tmp_path / "m.jsonl"
    torch.manual_seed(0)
    m = MLP([4, 8, 3])
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=2, sinks=[JSONLSink(path)])
    values = [np.float32(1.5), np.int64(3), np.array([2.0]), torch.tensor([0.25]), 7, True, None]
    for v in values:
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
        opt.step()
        opt.record(x=v)
    with pytest.raises(ValueError, match=r"record\(h=\.\.\.\): a Tensor of shape \(2,\); record one number"):
        opt.record(h=torch.ones(2))
    with pytest.raises(TypeError, match=r"record\(c=\.\.\.\): complex is not a number"):
        opt.record(c=1j)
    with pytest.raises(ValueError, match=r"'step' is the tracker's own step number.*global_step="):
        opt.record(step=70, loss=1.0)  # the rows' step was silently replaced by the user's value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no sink failure
        opt.close()
    assert opt.tracker.unwritten == {}
    rows = _lines(path)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["x"] for r in rows] == [1.5, 3, 2.0, 0.25, 7, True, None]
    assert "h" not in rows[-1] and "c" not in rows[-1] and "loss" not in rows[-1]


def test_wandb_rows_after_the_run_finished_are_kept_and_the_fix_named(tmp_path, monkeypatch):
    """``wandb.finish()`` before the tracker is closed: the rows still pending are kept (tracker.unwritten)
    and the warning says to close the tracker first, not "disk space, permissions, network"."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="conserve-test", dir=str(tmp_path))
    torch.manual_seed(0)
    m = MLP([4, 8, 3])
    sink = conserve.WandbSink(run)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=100, sinks=[sink])
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
        opt.step()
    run.finish()
    with pytest.warns(RuntimeWarning, match=r"W&B run \w+ is finished: close the tracker \(tracker.close\(\)\) "
                                            r"before wandb.finish\(\)"):
        opt.close()
    assert [r["step"] for r in opt.tracker.unwritten[sink]] == [1, 2, 3]


def test_a_closed_jsonl_sink_reopens_for_the_next_run(tmp_path):
    """``ConserveCallback(sinks=[JSONLSink(p)])``: the callback closes its sinks at the end of each
    ``train``/``fit``; the next one reuses the object. A closed sink failed every row of the next run
    (TypeError on the closed descriptor; the rows only in memory); it reopens, as TensorBoardSink does."""
    path = tmp_path / "m.jsonl"
    sink, mem = JSONLSink(path), conserve.MemorySink()
    _run([sink, mem], steps=3)
    assert sink._fd is None  # closed with its tracker
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no sink failure ...
        warnings.filterwarnings("ignore", r".*cut off so the series continues")  # ... the re-run restarts the series
        opt, _ = _run([sink, mem], steps=5)
    assert opt.tracker.unwritten == {}
    assert [r["step"] for r in _lines(path)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in mem.records] == [1, 2, 3, 1, 2, 3, 4, 5]


def test_tensorboard_sink_beside_the_users_own_writer_keeps_the_users_events(tmp_path):
    """``TensorBoardSink(args.logging_dir)`` / ``TensorBoardSink(trainer.log_dir)``: the directory the
    user's own writer logs to. Its ``purge_step`` made TensorBoard discard every event of the user's
    writer from that step on (``train/loss`` showed nothing). conserve's events go to the run
    ``<dir>/conserve``, where a resumed series is still one."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    tb = tmp_path / "tb"
    user = SummaryWriter(str(tb))
    for s in range(1, 11):
        user.add_scalar("train/loss", 1.0 / s, s)
    user.flush()
    _, ck = _run([TensorBoardSink(tb)], steps=8, every=3, save_at=5)
    _run([TensorBoardSink(tb)], steps=8, every=3, state=ck)  # resumed at 5: steps 6..8 again
    user.close()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 11))
    own = EventAccumulator(str(tb / "conserve"))  # conserve's run, beside the user's
    own.Reload()
    assert [e.step for e in own.Scalars("conserve_relu/eps")] == list(range(1, 9))


def test_a_sink_that_keeps_failing_owes_at_most_max_unwritten_rows(tmp_path, monkeypatch):
    """A full disk under one JSONL file for the rest of a long run: the tracker keeps the newest
    ``max_unwritten`` rows for it (memory bounded), says once that older ones are dropped and how to fix
    it, counts them (``dropped``, ``sinks/dropped_rows``, close()); what the file holds stays, the other
    sinks get every row, and the kept rows are written once the disk has room again."""
    import errno

    import conserve.tracking.sinks as sinks_mod

    bad, good, mem = JSONLSink(tmp_path / "bad.jsonl"), JSONLSink(tmp_path / "good.jsonl"), conserve.MemorySink()
    real, full = os.write, [False]

    def write(fd, data):
        if full[0] and fd == bad._fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(sinks_mod.os, "write", write)
    torch.manual_seed(0)
    m = MLP([4, 8, 3])
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=2, sinks=[bad, good, mem])
    opt.tracker.max_unwritten = 5
    owed = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(1, 21):
            full[0] = step > 5  # rows 1-4 reach the file (flushed inside step 5), then the disk is full
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(5, 4)), torch.randint(0, 3, (5,))).backward()
            opt.step()
            owed.append(len(opt.tracker.unwritten.get(bad, [])))
        opt.flush()
        assert max(owed) <= 5 and [r["step"] for r in opt.tracker.unwritten[bad]] == [16, 17, 18, 19, 20]
        assert opt.tracker.dropped == {bad: 11}  # steps 5..15
        full[0] = False  # room again: the kept rows are written at close
        opt.close()
    msgs = [str(x.message) for x in w]
    said = [s for s in msgs if "the oldest are dropped" in s]
    assert len(said) == 1 and "max_unwritten=5" in said[0] and "fix the sink" in said[0], msgs
    assert sum("failed at step 5" in s for s in msgs) == 1
    assert any("wrote every row it kept; 11 older row(s) were dropped" in s for s in msgs), msgs
    assert [r["step"] for r in _lines(tmp_path / "bad.jsonl")] == [1, 2, 3, 4, 16, 17, 18, 19, 20]
    assert [r["step"] for r in _lines(tmp_path / "good.jsonl")] == list(range(1, 21))
    assert [r["step"] for r in mem.records] == list(range(1, 21))
    # the count as the last flush began (steps 5..13 dropped by then; it wrote rows 19, 20)
    assert mem.records[-1]["sinks/dropped_rows"] == 9 and not any("sinks/dropped_rows" in r for r in mem.records[:8])


def test_jsonl_unwritable_path_names_the_path_argument_not_a_cli_flag(tmp_path):
    # user report: the Python API said "choose a writable --out directory" (there is no --out there)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="pass JSONLSink a path in a writable directory") as e:
        JSONLSink(blocker / "m" / "metrics.jsonl")
    assert "--out" not in str(e.value) and str(blocker / "m" / "metrics.jsonl") in str(e.value)


@pytest.mark.parametrize("what", ["file", "directory", "replaced"])
def test_jsonl_file_deleted_or_replaced_mid_run_is_reopened_not_written_into_the_void(tmp_path, what):
    """A cleanup script deletes the metrics file (or the run directory, or log rotation moves it and puts
    a new file there) while the run writes it: the rows after that go into a file at the path, with a
    warning naming the step it starts at; before, every later row went into the unlinked file, silently."""
    import shutil

    run = tmp_path / "run"
    path = run / "m.jsonl"
    sink = JSONLSink(path)
    for step in (1, 2, 3):
        sink.write(step, {"step": step})
    if what == "file":
        path.unlink()
    elif what == "directory":
        shutil.rmtree(run)
    else:
        path.rename(run / "m.jsonl.1")
        path.write_text("")
    with pytest.warns(RuntimeWarning, match=r"deleted, moved or replaced .* its rows start at step 4"):
        sink.write(4, {"step": 4})
    sink.write(5, {"step": 5})
    sink.close()
    assert [r["step"] for r in _lines(path)] == [4, 5]
    if what == "replaced":
        assert [r["step"] for r in _lines(run / "m.jsonl.1")] == [1, 2, 3]


# ---------------------------------------------------------------------------------- lock files
def test_lock_files_are_removed_when_released(tmp_path):
    sink = JSONLSink(tmp_path / "m.jsonl")
    assert (tmp_path / ".m.jsonl.lock").exists()
    sink.close()
    assert not (tmp_path / ".m.jsonl.lock").exists()
    outer = RunDirLock(tmp_path).acquire()
    with RunDirLock(tmp_path):  # counted: the file stays while a holder is left
        pass
    assert (tmp_path / ".conserve.lock").exists()
    outer.release()
    assert not (tmp_path / ".conserve.lock").exists()
    # a process that opened the file before its holder removed it locks the new file, not the removed one
    first = RunDirLock(tmp_path).acquire()
    stale = os.open(tmp_path / ".conserve.lock", os.O_RDWR)
    try:
        first.release()
        with RunDirLock(tmp_path) as again:
            assert again.held and (tmp_path / ".conserve.lock").exists()
            assert os.fstat(stale).st_ino != os.stat(tmp_path / ".conserve.lock").st_ino
    finally:
        os.close(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


# ------------------------------------------------------------------------------- dashboard sections
def test_tensorboard_groups_a_32_layer_model_by_family(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conserve.tracking.sinks import section_tag

    fams = ("vo", "qk", "swiglu", "gain", "rope_pair")
    row = {"step": 1, "loss": 2.0, **{f"eps/{f}": 0.1 for f in fams}, "eps/gain/global": 0.1,
           **{f"eps/{f}/layer{i}": 0.1 for f in fams for i in range(32)},
           **{f"drift/{f}/{t}": 0.1 for f in fams for t in ("measured", "decay", "first", "second", "residual")},
           "continuity/gram/q/3-4": 0.5, "continuity/gram/q": 0.5}
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, row)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert len(tags) == len(row) - 1
    sections: dict[str, list[str]] = {}
    for t in tags:
        head, tail = t.split("/", 1)
        sections.setdefault(head, []).append(tail)
    assert sorted(sections["conserve_vo_layers"]) == [f"layer{i:02d}" for i in range(32)]
    assert sorted(sections["conserve_vo"]) == ["drift_decay", "drift_first", "drift_measured", "drift_residual",
                                               "drift_second", "eps"]
    assert "eps_global" in sections["conserve_gain"] and sections["conserve"] == ["loss"]
    assert sections["conserve_continuity_gram_layers"] == ["q_03-04"] and sections["conserve_continuity"] == ["gram_q"]
    assert max(len(v) for v in sections.values()) <= 32  # no section holds every series of the model
    assert section_tag("sinks/dropped_rows") == "conserve/sinks/dropped_rows"
