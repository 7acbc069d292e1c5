"""Tunables of the Triton path, and where it can run.

A ``Config`` is passed explicitly (``evaluate(..., config=Config(...))``, ``drift(...)``); the library
reads no tunable from the environment (the benchmark scripts set these fields from their flags).
``TRITON_INTERPRET`` is Triton's own switch (the interpreter on CPU tensors), not a tunable: it is
only consulted to say whether a CPU tensor can take the Triton path at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["Config", "PRECISIONS", "interpreting", "check_triton_device"]

PRECISIONS = ("ieee", "tf32x3")


@dataclass(frozen=True)
class Config:
    """Choices of the Triton path that change speed (and, for ``input_precision``, rounding).

    Attributes:
        input_precision: ``tl.dot`` precision of the fp32 Gram dots (evaluate, bilinear and the DRIFT
            pass): ``"ieee"`` (fp32 FMA, the default) or ``"tf32x3"`` (three TF32 tensor-core products,
            error ~ fp32 rounding; Hopper/Ampere).  bf16/fp16 dots and fp64 mode are unaffected.
        gram_bt: cap of the Gram output tile (16, 32, 64 or 128; 64 gives D = 128 three 64 x 64
            upper-triangular tiles instead of one 128 x 128).  The DRIFT pass caps it at 64.
        norm_stages: row tiles in flight per norm program (1-4; > 1 pipelines the loads through
            shared memory with ``cp.async`` on a GPU; where that many tiles would not fit in the shared
            memory, e.g. fp64 or a bilinear form with 4 stages, the tile is narrowed instead,
            ``launch.Tiles.norm_tile``).
        overlap: on CUDA, run the Gram launches on a side stream concurrently with the norm launches.
        drift_programs: at most this many programs per DRIFT-pass Gram launch (0, the default: one
            launch of every item).  A larger grid is issued as consecutive launches of at most this
            many programs on the same stream, so no more than that many DRIFT programs are resident
            at once: the cap the fused optimizers' ``overlap=True`` uses (one per SM) to leave room on
            every SM for the memory-bound step kernel running beside it (``kernels/README.md``, "Overlap
            with the step").  Same bits whatever the cap (every item writes its own partial tile).

    Raises:
        ValueError: a value outside the ranges above (the message names the allowed values).
    """

    input_precision: str = "ieee"
    gram_bt: int = 128
    norm_stages: int = 3
    overlap: bool = True
    drift_programs: int = 0

    def __post_init__(self):
        if self.input_precision not in PRECISIONS:
            raise ValueError(f"Config(input_precision={self.input_precision!r}): use one of {PRECISIONS}")
        if self.gram_bt not in (16, 32, 64, 128):
            raise ValueError(f"Config(gram_bt={self.gram_bt}): use 16, 32, 64 or 128")
        if not 1 <= int(self.norm_stages) <= 4:
            raise ValueError(f"Config(norm_stages={self.norm_stages}): use 1 to 4")
        if isinstance(self.drift_programs, bool) or not isinstance(self.drift_programs, int) or self.drift_programs < 0:
            raise ValueError(f"Config(drift_programs={self.drift_programs!r}): use an int >= 0 (0: no cap)")


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, read by Triton itself)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` naming the fix when Triton cannot run on ``device`` (a CPU tensor without
    ``TRITON_INTERPRET=1`` set before triton is imported)."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError("the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           "imported for CPU tensors; use backend='torch' on CPU")
