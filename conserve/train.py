"""A small training loop shared by ``conserve run`` and the experiments.

It steps a (tracked) optimizer on ``(inputs, targets)`` batches with softmax cross-entropy, records the
loss into the tracker rows, shows progress (a rich bar on a terminal, plain lines otherwise: loss and the
current worst ``eps``) and stops at the first non-finite loss, or when the run diverges (the loss exceeds
``max_loss_ratio`` times its first value, or a family's ``eps`` exceeds ``max_eps``), naming the step, with
everything before it flushed.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .commands.common import add_threads_argument, torch_threads  # noqa: F401  (re-exported for the experiments)
from .errors import DivergenceError, NonFiniteError, UsageError


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
          log_every: int = 10, scheduler=None, start_step: int = 0, description: str = "training",
          max_eps: float | None = None, max_loss_ratio: float | None = None, first_loss: float | None = None,
          on_step: Callable[[int, float | None], None] | None = None) -> list[float]:
    """Run ``steps`` optimizer steps, numbered ``start_step + 1`` on. Returns the losses at the progress
    points (host floats).

    ``optimizer`` may be a ``TrackedOptimizer`` (its tracker gets ``loss`` per step and flushes on its
    own period). Every ``log_every`` steps (one host sync) the loss and the current worst ``eps`` are
    read, shown, and checked. ``first_loss``: the loss the divergence check compares with (default: the
    first one read here; a resumed run passes the one its first part read). ``on_step(k, first_loss)`` is
    called after each step ``k`` and its checks (``conserve run`` saves its resume checkpoints there).

    Raises:
        NonFiniteError: naming the first step whose loss is NaN/Inf; the tracker rows of earlier steps
            are flushed first.
        DivergenceError: the loss exceeds ``max_loss_ratio`` x its first value, or a family's ``eps``
            exceeds ``max_eps`` (None disables either check); the rows up to that step are flushed first.
    """
    tracker = getattr(optimizer, "tracker", None)
    it: Iterator = iter(batches)
    bad_step = torch.full((), -1, dtype=torch.long, device=device)
    losses: list[float] = []
    show = _progress(progress, description, steps)
    with show:
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
                first_loss = losses[-1] if first_loss is None else first_loss
                worst = worst_eps(tracker.latest() or {}) if tracker is not None and hasattr(tracker, "latest") else None
                show.update(k - start_step, losses[-1], worst)
                _check_divergence(tracker, k, losses[-1], first_loss, worst, max_eps, max_loss_ratio)
            if on_step is not None:
                on_step(k, first_loss)
    return losses


def _check_divergence(tracker, step: int, loss: float, first_loss: float, worst, max_eps, max_loss_ratio) -> None:
    why = None
    if max_loss_ratio is not None and step > 1 and loss > max_loss_ratio * max(first_loss, 1e-12):
        why = f"the loss grew from {first_loss:.3f} to {loss:.3f} (> {max_loss_ratio:g}x)"
    elif max_eps is not None and worst is not None and math.isfinite(worst[1]) and worst[1] > max_eps:
        why = f"the {worst[0]} laws moved by eps {worst[1]:.2e} (> --max-eps {max_eps:g}; loss {loss:.3f})"
    if why is None:
        return
    if tracker is not None:
        tracker.flush()
    raise DivergenceError(f"the run diverged at step {step}: {why}; metrics up to step {step} are saved. "
                          "Lower --lr and run again")


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


class Progress:
    """Progress at the log points: a rich bar on a terminal, a plain line per ~5% of the run otherwise
    (CI logs, pipes: no control codes, no truncation). Disabled: nothing."""

    def __init__(self, enabled: bool, description: str, steps: int, tty: bool | None = None):
        self.enabled, self.description, self.steps = enabled, description, steps
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.bar = self.task = None
        self.every = max(1, steps // 20)
        self.t0 = time.time()
        self._last = 0

    def __enter__(self):
        if self.enabled and self.tty:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("worst eps {task.fields[eps]}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self.bar.__enter__()
            self.task = self.bar.add_task(self.description, total=self.steps, loss="-", eps="-")
        return self

    def update(self, done: int, loss: float, worst) -> None:
        eps = f"{worst[0]} {worst[1]:.2e}" if worst is not None and math.isfinite(worst[1]) else "-"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, loss=f"{loss:.3f}", eps=eps)
        elif self.enabled and (done - self._last >= self.every or done == self.steps):
            self._last = done
            print(f"{self.description}: step {done}/{self.steps}  loss {loss:.4f}  worst eps {eps}  "
                  f"{time.time() - self.t0:.1f} s", flush=True)

    def __exit__(self, *a):
        if self.bar is not None:
            self.bar.__exit__(*a)
        return False


def _progress(enabled: bool, description: str, steps: int) -> Progress:
    return Progress(enabled, description, steps)
