"""Accumulation precision of the law values: the fused optimizers' step statistics (torch twin and the
Triton step kernel's finishing pass) and the Triton law pass (``evaluate(..., backend="triton")``)
against a float64 reference, on near-identical bf16 / fp16 / fp32 weights whose sums are large.

A running fp32 sum of thousands of near-equal values loses digits (each addition rounds at the size
of the sum), and a SwiGLU unit law ``||up_u||^2 - ||down_u||^2`` of two nearly equal norms multiplies
that relative error by the cancellation.  Every path must stay within ``RTOL`` of float64.
"""
from __future__ import annotations

import os

import pytest
import torch

from conserve.kernels import evaluate, evaluate_reference
from conserve.kernels import optim_step as K
from conserve.kernels import step_twin
from conserve.kernels.plan import NormTerm, Plan, View
from conserve.optim import FusedSGD
from conserve.toyblocks import SwiGLU

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"

RTOL = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _swiglu(dt, hidden: int, units: int, seed: int = 0) -> SwiGLU:
    """``up`` ~ 1, ``down`` ~ 0.985 (noise 1e-2, rounded to ``dt``): each unit's law is a difference of
    two norms of ~``hidden`` that cancel to ~3% of them."""
    g = torch.Generator().manual_seed(seed)
    m = SwiGLU(hidden, units)
    with torch.no_grad():
        m.up_proj.weight.copy_(1.0 + 1e-2 * torch.randn(m.up_proj.weight.shape, generator=g))
        m.down_proj.weight.copy_(0.985 + 1e-2 * torch.randn(m.down_proj.weight.shape, generator=g))
        m.gate_proj.weight.normal_(generator=g)
    return m.to(dt)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_fused_step_h_matches_float64(dt):
    """``FusedSGD(lr=0)`` on CPU (the torch twin's step statistics), 1.05M weights in two units of
    rows of 2^18 elements: ``tracker.h`` within RTOL of the float64 evaluation of the same weights,
    and as close as the torch evaluator."""
    m = _swiglu(DTYPES[dt], 1 << 18, 2)
    opt = FusedSGD(m.parameters(), lr=0.0, track=m, every=1)
    tr = opt.tracker
    ts = [t.detach() for t in tr.tensors]
    ref = evaluate_reference(tr.compiled.plan, [t.double() for t in ts], fp64=True)[0]
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    err = _rel(tr.h.vec, ref)
    opt.close()
    assert err <= RTOL, f"{dt}: fused h relative error {err:.2e}"
    torch_err = _rel(evaluate(tr.compiled.plan, ts, backend="torch")[0], ref)
    assert err <= max(4 * torch_err, 1e-6), (err, torch_err)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_sumsq_long_rows(dt):
    """The torch twin's row sums of squares (``_sumsq``) of rows longer than one chunk, of many short
    rows and of a block of several batch entries: float64 to rounding level."""
    g = torch.Generator().manual_seed(3)
    for shape in ((1, 2, 300_000), (1, 700, 96), (5, 3, 5000)):
        x = (1.0 + 1e-2 * torch.randn(shape, generator=g)).to(DTYPES[dt]).float()
        ref = x.double().square().sum(2)
        for chunk in (K.CHUNK_MAX, 4096):
            got = step_twin._sumsq(x, 2, chunk)
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert ((got.double() - ref).abs() / ref).max().item() <= 1e-6, (shape, chunk)


def test_triton_step_finish_sums_partials_in_float64():
    """The step kernel's finishing pass (``step.finish_kernel``): 2048 near-equal fp32 partials of a row
    summed to float64 rounding (a running fp32 sum is off by ~1e-6 here), for fp32 and fp64 stats."""
    from conserve.kernels.step import finish_kernel as finish

    nrows, F = 2048, 3
    g = torch.Generator().manual_seed(1)
    part = (255.7 + 0.3 * torch.rand(K.NQ, nrows * F, generator=g)).float()
    table = torch.tensor([[0, nrows, F, 0]], dtype=torch.int64)
    ref = part.double().view(K.NQ, nrows, F).sum(1)
    for acc in (torch.float32, torch.float64):
        stats = torch.zeros(K.NQ, F, dtype=acc)
        finish[(1, 1)](part, part.shape[1], stats, stats.shape[1], table, BF=64, FP64=acc == torch.float64,
                       num_warps=4)
        err = ((stats.double() - ref).abs() / ref).max().item()
        assert err <= (6e-8 if acc == torch.float32 else 1e-12), (acc, err)


def test_fused_step_triton_h_matches_float64():
    """``FusedSGD(lr=0, backend="triton")`` (the step kernel under the interpreter) on bf16 weights,
    up and down in separate groups (one launch each), gate not stepped: ``tracker.h`` within RTOL."""
    m = _swiglu(torch.bfloat16, 1 << 13, 2)
    groups = [{"params": [m.up_proj.weight, m.gate_proj.weight]}, {"params": [m.down_proj.weight]}]
    opt = FusedSGD(groups, lr=0.0, track=m, every=1, backend="triton")
    tr = opt.tracker
    ref = evaluate_reference(tr.compiled.plan, [t.detach().double() for t in tr.tensors], fp64=True)[0]
    m.up_proj.weight.grad = torch.zeros_like(m.up_proj.weight)
    m.down_proj.weight.grad = torch.zeros_like(m.down_proj.weight)
    opt.step()
    err = _rel(tr.h.vec, ref)
    opt.close()
    assert err <= RTOL, f"fused (Triton) h relative error {err:.2e}"


@pytest.mark.parametrize("dt,base,noise", [("bf16", 0.985, 1e-2), ("fp16", 0.985, 1e-3), ("fp32", 0.985, 1e-2)])
def test_triton_law_pass_long_columns(dt, base, noise):
    """The Triton law pass on a unit law whose columns are 2^15 rows long (the CPU tiles stream a region
    in one item: 512 row tiles into one accumulator; a single fp32 running sum is off by ~1e-4 in
    bf16 / fp16), rows scaled so the law is 3% of each norm: within RTOL of float64, deterministic."""
    S = 1 << 15
    g = torch.Generator().manual_seed(2)
    down = (base + noise * torch.randn(S, 2, generator=g)).to(DTYPES[dt])
    scale = (1.03 * down.double().square().sum(0) / 64).sqrt()
    up = (scale[:, None] * (1 + 1e-3 * torch.randn(2, 64, generator=g).double())).to(DTYPES[dt])
    plan = Plan(norms=[NormTerm(View(0, (0, 0), row_dim=0, rows=2, col_dim=1, cols=64), 1.0, 0),
                       NormTerm(View(1, (0, 0), row_dim=1, rows=2, col_dim=0, cols=S), -1.0, 0)], vec_size=2)
    ref = evaluate_reference(plan, [up.double(), down.double()], fp64=True)[0]
    got = evaluate(plan, [up, down], backend="triton")[0]
    err = _rel(got, ref)
    assert err <= RTOL, f"{dt}: Triton law pass relative error {err:.2e}"
    assert torch.equal(got, evaluate(plan, [up, down], backend="triton")[0])  # deterministic
