"""A small training loop shared by ``conserve run`` and the experiments.

It steps a (tracked) optimizer on ``(inputs, targets)`` batches with softmax cross-entropy, records the
loss into the tracker rows, shows a rich progress bar (loss and the worst ``eps``) and stops at the first
non-finite loss, naming the step, with everything before it flushed.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .errors import NonFiniteError, UsageError


def add_threads_argument(group) -> None:
    group.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads on CPU (default 1: small models gain nothing from more and contend "
                            "with other processes; "
                            "0 keeps torch's default)")


class torch_threads:
    """Context manager: ``torch.set_num_threads(n)`` inside (n >= 1), the previous value restored after."""

    def __init__(self, n: int):
        if n < 0:
            raise UsageError(f"--threads must be >= 0, got {n}")
        self.n = n

    def __enter__(self):
        self.prev = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *a):
        torch.set_num_threads(self.prev)
        return False


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats). logits (B, T, V) vs targets (B, T)."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classifier_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits (B, C) vs labels (B,)."""
    return F.cross_entropy(model(inputs), targets)


def worst_eps(record: dict) -> tuple[str, float]:
    """The family with the largest ``eps`` in a metrics record."""
    fam = [(k[4:], v) for k, v in record.items() if k.startswith("eps/") and k.count("/") == 1 and v is not None]
    return max(fam, key=lambda kv: kv[1]) if fam else ("-", float("nan"))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable, steps: int, *,
          loss_fn: Callable = lm_loss, device: str | torch.device = "cpu", progress: bool = True,
          log_every: int = 10, scheduler=None, start_step: int = 0, description: str = "training") -> list[float]:
    """Run ``steps`` optimizer steps. Returns the losses at the progress points (host floats).

    ``optimizer`` may be a ``TrackedOptimizer`` (its tracker gets ``loss`` per step and flushes on its
    own period). Raises ``NonFiniteError`` naming the first step whose loss is NaN/Inf; the tracker rows
    of earlier steps are flushed first."""
    tracker = getattr(optimizer, "tracker", None)
    it: Iterator = iter(batches)
    bad_step = torch.full((), -1, dtype=torch.long, device=device)
    losses: list[float] = []
    last_eps = ("-", float("nan"))
    bar = _progress(progress, description, steps)
    with bar as p:
        task = p.add_task(description, total=steps, loss=float("nan"), eps="-") if p else None
        for k in range(start_step + 1, start_step + steps + 1):
            x, y = (t.to(device) for t in next(it))
            loss = loss_fn(model, x, y)
            # remember the first non-finite step on the device (no host sync per step)
            bad_step = torch.where((bad_step < 0) & ~torch.isfinite(loss.detach()), torch.tensor(k, device=device), bad_step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if tracker is not None:
                tracker.record(loss=loss.detach())
            if k % log_every == 0 or k == start_step + steps:
                first_bad = int(bad_step)
                if first_bad >= 0:
                    _stop(tracker, first_bad)
                losses.append(float(loss.detach()))
                if tracker is not None and tracker.last_record is not None:
                    last_eps = worst_eps(tracker.last_record)
                if p:
                    p.update(task, completed=k - start_step, loss=losses[-1],
                             eps=f"{last_eps[0]} {last_eps[1]:.2e}" if math.isfinite(last_eps[1]) else "-")
    return losses


def _stop(tracker, step: int):
    if tracker is not None:
        # rows up to step-1 are valid; the step with the NaN loss (and any after it) are dropped
        drop = min(len(tracker._rows), max(tracker.step_count - (step - 1), 0))
        if drop:
            del tracker._rows[len(tracker._rows) - drop:]
            del tracker._extras[len(tracker._rows):]
            tracker.step_count -= drop
        tracker.flush()
    raise NonFiniteError(f"the loss is NaN/Inf at step {step}; metrics up to step {step - 1} are saved. "
                         "Lower --lr (or add gradient clipping) and run again")


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _progress(enabled: bool, description: str, steps: int):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("worst eps {task.fields[eps]}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
