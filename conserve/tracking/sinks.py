"""Where tracked metrics go: a JSONL file (always), TensorBoard and W&B when installed.

A sink has ``write(step: int, metrics: dict[str, float])`` and ``close()``; optionally
``resume(step)``, called by ``Tracker.load_state_dict`` with the last step the restored run had
written, so a resumed run continues one series: the JSONL file drops its rows after that step and
TensorBoard purges its events from the next step on. A sink that gets its first row without a
``resume`` does the same at that row's step (a re-run into the same file restarts the series
instead of appending a second one). Rows a sink fails to write are kept by the tracker and retried
(``Tracker`` docstring; at most ``Tracker.max_unwritten`` per sink, the oldest dropped and counted beyond
that), so a sink should write a row completely or not at all.
"""
from __future__ import annotations

import json
import math
import os
import re
import weakref
from pathlib import Path

from ..errors import UsageError, warn
from ..report import json_safe
from .lock import RunDirLock

__all__ = ["JSONLSink", "MemorySink", "TensorBoardSink", "WandbSink", "RunDirLock", "section_tag",
           "tensorboard_available"]

_TB_SUFFIX = ".conserve"  # conserve's TensorBoard event files (``filename_suffix``)
_OPEN: dict[str, "weakref.ref[JSONLSink]"] = {}  # realpath -> the JSONLSink of this process writing it
_STEP = re.compile(rb'^\{"step": (-?\d+)[,}]')


def _line_step(line: bytes) -> int | None:
    """The ``step`` of one JSONL line (None for a line that is not a complete record)."""
    m = _STEP.match(line)
    if m:
        return int(m.group(1))
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class JSONLSink:
    """One JSON object per step, appended with one ``write(2)`` per row (a crash keeps what was written).

    Non-finite floats are written as ``null``. The file is locked for this process (``RunDirLock`` on
    ``<dir>/.<name>.lock``): a second process writing the same file is refused; in this process a
    newer ``JSONLSink`` on the same file takes it over, with a warning (the older sink's rows stay in its
    tracker's ``unwritten``, never interleaved into the file). At the first row
    (or at ``resume(step)``) rows left by an earlier run at or after that step are cut off, with a
    warning naming how many. A failed write leaves no partial line (the file is cut back to its
    previous length), so the tracker's retry writes each row exactly once. A closed sink reopens at its
    next row (a new series: as a re-run, it cuts the rows from that row's step on). A file deleted,
    moved or replaced while open (a cleanup script, log rotation, the run directory removed) is
    reopened at ``path`` (its directory created again) before the next row, with a warning naming the
    step the new file starts at: rows are never written into a file nobody can read.

    Args:
        path: the ``.jsonl`` file (its directory is created).
        lock: take the per-file lock (default True).

    Raises:
        UsageError: the file cannot be opened, or another process writes it.
    """

    def __init__(self, path: str | Path, *, lock: bool = True):
        self.path, self._locking = Path(path), lock
        self._lock = self._fd = None
        self._open()

    def _open(self) -> None:
        """Open the file (at construction, and again at the first row after a ``close``: a sink given to
        a framework callback is closed at the end of each ``fit``/``train`` and reused by the next)."""
        self._superseded = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._locking:
                self._lock = RunDirLock(self.path.parent, name=f".{self.path.name}.lock",
                                        hint=f"write the metrics to another file than {self.path}").acquire()
                self._claim()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self._release()
            raise UsageError(f"cannot write metrics to {self.path}: {e.strerror}; pass JSONLSink a path in a "
                             "writable directory") from None
        self._started = False

    _superseded = False

    def _claim(self) -> None:
        """One writing sink per file in this process too (the OS lock only keeps other processes out): a
        second tracker writing the same file would cut the first one's rows and interleave its steps. The
        newest sink writes; an older one still open (another tracker, or an earlier run that was not
        closed, e.g. a Trainer that raised) stops writing: its tracker keeps its rows (``unwritten``)."""
        key = os.path.realpath(self.path)
        other = _OPEN.get(key)
        other = other() if other is not None else None
        if other is not None and getattr(other, "_fd", None) is not None:
            other._superseded = True
            warn(f"conserve: {self.path} was still open in another JSONLSink of this process (another "
                          "tracker, or an earlier one not closed): that one stops writing, its rows stay in its "
                          "tracker (tracker.unwritten); give each tracker its own file", RuntimeWarning)
        _OPEN[key] = weakref.ref(self)
        self._key = key

    def resume(self, step: int) -> None:
        """Keep the rows up to ``step`` (the last step of the restored run); cut off the rest."""
        if self._fd is None:
            self._open()
        self._cut(step + 1)

    def _cut(self, first_new: int) -> None:
        """Truncate the file at its first line whose step is >= ``first_new`` (or that is incomplete)."""
        if self._superseded:  # the file is a newer sink's
            return
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = 0
        if size == 0 or not self.path.is_file():
            self._started = True
            return
        offset, cut, dropped = 0, None, 0
        with open(self.path, "rb") as f:
            for line in f:
                step = _line_step(line)
                if cut is None and (step is None or step >= first_new or not line.endswith(b"\n")):
                    cut = offset
                if cut is not None:
                    dropped += 1
                offset += len(line)
        if cut is not None:
            os.ftruncate(self._fd, cut)
            warn(f"conserve: {self.path} held {dropped} row(s) from step {first_new} on, left by an earlier "
                          f"run; they were cut off so the series continues from step {first_new}", RuntimeWarning)
        self._started = True

    def write(self, step: int, metrics: dict) -> None:
        if self._superseded:
            raise RuntimeError(f"{self.path} is written by a newer JSONLSink of this process; this sink's rows are "
                               "kept by its tracker: give each tracker its own file")
        if self._fd is not None and not self._same_file():
            self.close()
            warn(f"conserve: {self.path} was deleted, moved or replaced while this JSONLSink had it open; "
                          f"reopened it at that path: its rows start at step {step} (the earlier ones are wherever "
                          "the old file went)", RuntimeWarning)
        if self._fd is None:
            self._open()
        if not self._started:
            self._cut(step)
        data = (json.dumps(json_safe(metrics)) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            try:  # no partial line: the retry writes the whole row again
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise

    def _same_file(self) -> bool:
        """The open file is still the one at ``path`` (two ``stat`` calls per row)."""
        try:
            at, held = os.stat(self.path), os.fstat(self._fd)
        except OSError:
            return False
        return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
        self._release()

    def _release(self) -> None:
        key = self.__dict__.pop("_key", None)
        if key is not None and _OPEN.get(key) is not None and _OPEN[key]() in (self, None):
            del _OPEN[key]
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __repr__(self) -> str:
        return f"JSONLSink({str(self.path)!r})"


class MemorySink:
    """Keeps the records in ``self.records`` (for notebooks and tests); ``resume(step)`` drops later ones."""

    def __init__(self):
        self.records: list[dict] = []

    def resume(self, step: int) -> None:
        self.records = [r for r in self.records if r.get("step", 0) <= step]

    def write(self, step: int, metrics: dict) -> None:
        self.records.append(dict(metrics))

    def close(self) -> None:
        pass


_FAMILY_KINDS = ("eps", "drift", "control", "broken")  # ``<kind>/<family>[/...]`` metric keys
_LAYER = re.compile(r"^(.*?)(\d+)(?:-(\d+))?$")


def _pad(part: str) -> str:
    """``layer3`` -> ``layer03``, ``2-3`` -> ``02-03``: layer series sort in layer order up to 99 layers."""
    m = _LAYER.match(part)
    if not m:
        return part
    head, a, b = m.groups()
    return f"{head}{int(a):02d}" + (f"-{int(b):02d}" if b is not None else "")


def section_tag(key: str, prefix: str = "conserve") -> str:
    """The dashboard tag of a metric key, one section per law family and one per family's layer series, so
    a 32-layer model stays browsable (TensorBoard and W&B group panels by the part before the first ``/``):

    ``eps/<family>`` -> ``conserve_<family>/eps``; ``drift/<family>/<term>`` -> ``conserve_<family>/drift_<term>``;
    ``control/<family>``, ``broken/<family>``, ``eps/<family>/global`` -> ``conserve_<family>/control`` (...,
    ``eps_global``); ``eps/<family>/layer3`` -> ``conserve_<family>_layers/layer03`` (another kind per layer:
    ``<kind>_layer03``); ``continuity/<metric>/<type>/<a>-<b>`` -> ``conserve_continuity_<metric>_layers/<type>_<a>-<b>``,
    ``continuity/<metric>/<type>`` -> ``conserve_continuity/<metric>_<type>``; anything else (``loss``, your
    ``record`` scalars, ``sinks/dropped_rows``) -> ``conserve/<key>``."""
    parts = key.split("/")
    kind = parts[0]
    if kind in _FAMILY_KINDS and len(parts) >= 2:
        fam, rest = parts[1], parts[2:]
        if rest and _LAYER.match(rest[-1]) and rest[-1] != "global":
            tag = "_".join(([] if kind == "eps" else [kind]) + rest[:-1] + [_pad(rest[-1])])
            return f"{prefix}_{fam}_layers/{tag}"
        return f"{prefix}_{fam}/" + "_".join([kind, *rest])
    if kind == "continuity" and len(parts) >= 3:
        if len(parts) >= 4:
            return f"{prefix}_continuity_{parts[1]}_layers/" + "_".join(parts[2:-1] + [_pad(parts[-1])])
        return f"{prefix}_continuity/" + "_".join(parts[1:])
    return f"{prefix}/{key}"


class TensorBoardSink:
    """Scalars in one section per law family (``section_tag``: ``conserve_<family>/eps``,
    ``conserve_<family>/drift_second``, ``conserve_<family>_layers/layer03``, ``conserve/loss``). Needs
    ``tensorboard`` (pip extra ``tensorboard``).

    The event writer opens at the first row (or ``resume``) with ``purge_step`` at that step, so
    events an earlier run left at or after it are discarded by TensorBoard: one series per tag,
    no duplicated steps. The purge covers every tag of the directory, so in a directory another
    writer already logs to (the Trainer's, Lightning's ``TensorBoardLogger``) the events go to the
    run ``<log_dir>/conserve`` instead (``events_dir``), not to discard that writer's events.
    conserve's event files end in ``.conserve``."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("TensorBoard is not installed: pip install 'torch-conserve[tensorboard]'") from None
        self._cls, self.log_dir, self._w = SummaryWriter, str(log_dir), None

    def _open(self, purge_step: int):
        if self._w is None:
            d = Path(self.log_dir)
            # TensorBoard's purge drops the events of every tag in the directory, the user's own writer's too
            # (train/loss...): beside another writer, conserve's events go to their own run, <log_dir>/conserve
            if d.is_dir() and any(not p.name.endswith(_TB_SUFFIX) for p in d.glob("events.out.tfevents.*")):
                d = d / "conserve"
            self.events_dir = str(d)
            self._w = self._cls(self.events_dir, purge_step=purge_step, filename_suffix=_TB_SUFFIX)
        return self._w

    def resume(self, step: int) -> None:
        self._open(step + 1)

    def write(self, step: int, metrics: dict) -> None:
        w = self._open(step)
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                w.add_scalar(section_tag(k), v, step)

    def close(self) -> None:
        w, self._w = self._w, None
        if w is not None:
            w.flush()
            w.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.log_dir!r})"


class WandbSink:
    """Logs to the active W&B run (``wandb.init`` first). Needs ``wandb`` (pip extra ``wandb``).

    Keys as TensorBoard's, one section per law family (``section_tag``: ``conserve_<family>/eps``,
    ``conserve_<family>_layers/layer03``, ``conserve/loss``), with ``prefix="conserve/"`` (the default; another
    prefix ending in ``/`` names the sections alike; any other prefix is put before each metric key as it is).

    Rows are logged against their own x-axis ``conserve/step`` (``run.define_metric("conserve/*",
    step_metric="conserve/step")``), never with ``step=``: W&B drops a row whose ``step=`` is below
    its current step, which the user's own ``wandb.log`` calls advance. Log your own metrics
    without ``step=`` too (or against your own ``define_metric`` axis): W&B keeps one increasing
    history step per run, and conserve's rows take their places in it."""

    def __init__(self, run=None, *, prefix: str = "conserve/"):
        try:
            import wandb
        except ImportError:
            raise UsageError("wandb is not installed: pip install 'torch-conserve[wandb]'") from None
        self._run = run or wandb.run
        if self._run is None:
            raise UsageError("no active W&B run: call wandb.init(...) before creating WandbSink")
        self.prefix = prefix
        # "conserve/" (a section name and "/"): one section per family (section_tag); any other prefix: prefix + key
        self._base = prefix[:-1] if prefix.endswith("/") and len(prefix) > 1 else None
        self.step_metric = f"{prefix}step"
        self._run.define_metric(self.step_metric, hidden=True)
        self._run.define_metric(f"{self._base or prefix}*", step_metric=self.step_metric)

    def __repr__(self) -> str:
        return f"WandbSink(run={getattr(self._run, 'id', None)!r})"

    def write(self, step: int, metrics: dict) -> None:
        if getattr(self._run, "_is_finished", False):  # W&B would only say "the call to `log` will be ignored"
            raise RuntimeError(f"the W&B run {getattr(self._run, 'id', '')} is finished: close the tracker "
                               "(tracker.close()) before wandb.finish(), or pass a live run")
        row = {section_tag(k, self._base) if self._base else f"{self.prefix}{k}": v
               for k, v in metrics.items() if k != "step"}
        row[self.step_metric] = step
        self._run.log(row)

    def close(self) -> None:
        pass


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True
