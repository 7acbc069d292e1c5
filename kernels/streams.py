"""A side CUDA stream for work that overlaps the caller's stream: fork after an event, join back.

Used by the fused optimizers (``conserve.optim.fused``, ``overlap=True``): on a drift step the
Gram-law tensors are stepped first, the caller's ("main") stream records an event, the DRIFT pass over
those tensors runs on the side stream (which waits on that event) while the main stream steps the
remaining, memory-bound tensors, and the main stream waits on the side stream's event before the
terms are assembled.

Caching-allocator rules (PyTorch "CUDA semantics", *Stream semantics of backward passes* / the
``Tensor.record_stream`` note): a block is tied to the stream it was allocated on and is handed out
again, on that stream, as soon as it is freed.  So

* tensors allocated on the main stream and read on the side stream (the snapshot copies, the live
  weights, the cached work tables) must stay referenced until the join is enqueued: after it, any later
  reuse on the main stream is ordered after the side stream's work.  ``SideStream`` does not hold them;
  the caller does (the optimizer keeps the snapshot until ``_record`` has consumed the pieces);
* tensors allocated on the side stream and used on the main stream after the join (the DRIFT pass's
  outputs) are marked with ``record_stream(main)`` in ``join``: their blocks are not reused before the
  main stream's work queued so far has finished;
* nothing is freed on the side stream that the main stream still uses: the side stream only allocates
  and frees its own temporaries;
* nothing allocated on the side stream outlives the join but the outputs given to ``join``: a cache
  filled on the side stream and read later on the main stream (e.g. the torch twin's per-plan index
  structures, ``kernels.reference``) would hand its blocks back to the side stream's pool when dropped,
  while the main stream may still read them (the fused optimizers run the torch twin's pass in place;
  ``tests/test_fused_overlap.py`` checks these rules with a recording fake).

The side stream is private to its owner and every use of it starts with ``fork`` (a wait on the main
stream's progress so far), so a freed output block could be reused on the side stream only after the
main-stream work that read it: ordering alone already makes reuse safe (the deterministic rule of the
allocator notes); ``record_stream`` is kept as the guard that does not depend on that protocol.

No host synchronisation: ``fork`` and ``join`` enqueue an event record and a wait each.

The stream operations go through a small ``api`` object (``CUDA``, below) so that the fork/join logic
runs, unchanged, against a recording fake on CPU (``tests/test_fused_overlap.py``).
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

__all__ = ["SideStream", "CudaApi", "CUDA", "tensors_of"]


class CudaApi:
    """The five stream operations ``SideStream`` needs, on ``torch.cuda``."""

    def new_stream(self, device, priority: int):
        return torch.cuda.Stream(device=device, priority=priority)

    def current(self, device):
        return torch.cuda.current_stream(device)

    def record(self, stream):
        return stream.record_event()

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


CUDA = CudaApi()


def tensors_of(obj) -> Iterable[torch.Tensor]:
    """Every tensor in nested tuples / lists / dicts (values) of ``obj``."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


class SideStream:
    """One side stream of ``device`` (high priority by default: its programs are scheduled before the
    main stream's pending ones as SMs free up, so the compute-bound pass is not starved by a
    memory-bound kernel with thousands of programs queued first).

    ``fork()`` -> the main stream: the side stream waits on an event recorded now on the main stream
    (everything enqueued so far on it).  ``with side.on_side(): ...`` enqueues on the side stream.
    ``join(main, outputs)``: the main stream waits on an event recorded now on the side stream, and
    every tensor in ``outputs`` (allocated on the side stream) gets ``record_stream(main)``.
    """

    def __init__(self, device, api: CudaApi | None = None, priority: int = -1):
        self.api = api or CUDA
        self.device = device
        self.stream = self.api.new_stream(device, priority)

    def fork(self):
        main = self.api.current(self.device)
        self.api.wait(self.stream, self.api.record(main))
        return main

    @contextlib.contextmanager
    def on_side(self):
        with self.api.use(self.stream):
            yield self.stream

    def join(self, main, outputs=()) -> None:
        self.api.wait(main, self.api.record(self.stream))
        seen = set()
        for t in tensors_of(outputs):
            if id(t) not in seen:
                seen.add(id(t))
                self.api.record_stream(t, main)
