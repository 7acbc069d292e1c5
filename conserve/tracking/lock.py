"""One writer per run directory (or metrics file): an advisory OS lock held for a process's lifetime.

``RunDirLock(path)`` takes an exclusive, non-blocking ``flock`` (POSIX) / ``msvcrt.locking`` (Windows)
on ``path/.conserve.lock``. A second process asking for the same directory is refused at once with
a ``UsageError`` naming the holder's pid and the fix; the OS drops the lock when the holder exits,
crashes or is killed, so a stale lock file never blocks a later run. Within one process a path
may be locked again (nested ``with`` blocks, a CLI that locks the directory and a sink inside it):
the lock is counted and released with its last holder, which removes the lock file (POSIX: unlinked
while still locked; a process that locked the unlinked file meanwhile sees that the path no longer
names it and locks the new file instead, so two holders never coexist).

Example::

    with RunDirLock(out_dir, hint="pass another --out"):
        ...  # write metrics.jsonl, tb/, summary.md
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import UsageError

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
    import msvcrt

__all__ = ["RunDirLock", "LOCK_NAME"]

LOCK_NAME = ".conserve.lock"

_held: dict[str, list] = {}  # realpath of the lock file -> [fd, count] (locks this process holds)
_guard = threading.Lock()


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:  # pragma: no cover - Windows
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


def _names(path: str, fd: int) -> bool:
    """``path`` still names the file open as ``fd``."""
    try:
        at, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


class RunDirLock:
    """Exclusive lock on a run directory; a context manager (``acquire()``/``release()`` also work).

    Args:
        path: the run directory (created if missing); the lock file is ``path/<name>``.
        name: lock file name (default ``.conserve.lock``).
        hint: the fix named in the error (default: "write to another directory").

    Raises:
        UsageError: another process holds the lock ("<path> is in use by another conserve process
            (pid N): wait for it to finish or <hint>"), or the directory cannot be created.
    """

    def __init__(self, path: str | os.PathLike, *, name: str = LOCK_NAME,
                 hint: str = "write to another directory"):
        self.path, self.hint = Path(path), hint
        self.file = self.path / name
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> "RunDirLock":
        if self._key is not None:
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create {self.path}: {e.strerror}; choose a writable directory") from None
        key = os.path.realpath(self.file)
        with _guard:
            if key in _held:
                _held[key][1] += 1
                self._key = key
                return self
            for _ in range(100):  # a holder that removes the file as it releases: lock the new file
                try:
                    fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:
                    raise UsageError(f"cannot create the lock file {self.file}: {e.strerror}; "
                                     "choose a writable directory") from None
                if not _try_lock(fd):
                    try:
                        pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                    finally:
                        os.close(fd)
                    raise UsageError(f"{self.path} is in use by another conserve process (pid {pid}): wait for it "
                                     f"to finish or {self.hint}")
                if _names(key, fd):
                    break
                os.close(fd)  # the file was removed by its last holder after we opened it
            else:  # pragma: no cover - the file removed under us again and again
                raise UsageError(f"cannot lock {self.file}: it is removed each time it is opened; "
                                 f"wait for the other conserve processes on {self.path} to finish or {self.hint}")
            try:  # the holder's pid, for the message above (best effort: the lock is what counts)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:
                pass
            _held[key] = [fd, 1]
            self._key = key
        return self

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                if fcntl is not None:  # removed while still locked (a waiting process then re-checks the path)
                    try:
                        if _names(key, entry[0]):
                            os.unlink(key)
                    except OSError:
                        pass
                os.close(entry[0])  # closing the descriptor drops the OS lock

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"RunDirLock({str(self.path)!r}, held={self.held})"
