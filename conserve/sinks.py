"""Where tracked metrics go: a JSONL file (always), TensorBoard and W&B when installed.

A sink has ``write(step: int, metrics: dict[str, float])`` and ``close()``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import UsageError
from .report import json_safe


class JSONLSink:
    """One JSON object per step, appended and flushed at once (a crash keeps what was written).

    Non-finite floats are written as ``null``. Raises ``UsageError`` if the file cannot be opened."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot write metrics to {self.path}: {e.strerror}; choose a writable --out directory") from None

    def write(self, step: int, metrics: dict) -> None:
        self._f.write(json.dumps(json_safe(metrics)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MemorySink:
    """Keeps the records in ``self.records`` (for notebooks and tests)."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, step: int, metrics: dict) -> None:
        self.records.append(dict(metrics))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars under the same keys, prefixed ``conserve/``. Needs ``tensorboard`` (pip extra ``tensorboard``)."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("TensorBoard is not installed: pip install 'torch-conserve[tensorboard]'") from None
        self._w = SummaryWriter(str(log_dir))

    def write(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self._w.add_scalar(f"conserve/{k}", v, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class WandbSink:
    """Logs to the active W&B run (``wandb.init`` first). Needs ``wandb`` (pip extra ``wandb``)."""

    def __init__(self, run=None):
        try:
            import wandb
        except ImportError:
            raise UsageError("wandb is not installed: pip install 'torch-conserve[wandb]'") from None
        self._run = run or wandb.run
        if self._run is None:
            raise UsageError("no active W&B run: call wandb.init(...) before creating WandbSink")

    def write(self, step: int, metrics: dict) -> None:
        self._run.log({f"conserve/{k}": v for k, v in metrics.items() if k != "step"}, step=step)

    def close(self) -> None:
        pass


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True
