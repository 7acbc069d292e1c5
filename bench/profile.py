"""Per-kernel GPU time of a callable (``torch.profiler``), shared by the GPU benchmarks."""
from __future__ import annotations

import torch


def kernel_breakdown(fn, device, steps: int, title: str, top: int = 12):
    """Where a step's GPU time goes: ``torch.profiler`` device time per kernel name, summed over
    ``steps`` calls of ``fn`` (printed as ms per step and share of the total).  Returns the total (ms
    per step): above the step's wall time, kernels ran concurrently (side streams)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / steps
    total = sum(per.values()) or 1.0
    print(f"  {title} (total {total:.2f} ms per step):")
    for k, ms in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {ms:8.3f} ms  {100 * ms / total:5.1f}%  {k[:90]}")
    return total
