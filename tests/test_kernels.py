"""Triton kernels (under TRITON_INTERPRET=1 on CPU) against the float64 torch reference.

Tolerance: every output entry is compared against ``rtol * scale`` where ``scale`` is the same plan
evaluated in float64 on ``|x|`` with ``|sign|`` and ``|shift|`` -- an entrywise bound on the terms'
magnitudes (|sum_t s_t X X^T| <= sum_t |s_t| |X||X|^T), so cancellation in the laws (Q Q^T - K K^T)
cannot hide or fake an error.  rtol: 1e-5 for fp32 inputs, 1e-4 for bf16/fp16 inputs (reference
computed from the same rounded values), 1e-12 with fp64=True.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conserve.kernels import (GramTerm, NormTerm, Plan, SumTerm, View, bilinear, bilinear_reference, evaluate,
                              evaluate_reference)
from conserve.kernels import Config
from conserve.kernels import launch as L
from conserve.kernels.reference import _evaluate_looped

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


# ---------------------------------------------------------------------------------------------- plans
def row_block(t, start, rows, cols, row_dim=0, row_step=1):
    """Rows ``start .. start+rows`` of a 2-D weight (or a row block at a multi-index ``start``)."""
    start = start if isinstance(start, tuple) else (start, 0)
    col_dim = 1 - row_dim if len(start) == 2 else len(start) - 1
    return View(t, start, row_dim, rows, col_dim, cols, row_step)


def attention(p: Plan, nH, nKV, D, H, q, k, v, o, layout="separate", bq=None, bv=None, qk=True, vo=True):
    """QK and VO Gram laws of (GQA) attention for several storage layouts (spec: MHA/GQA rows).

    layout: "separate" (q/k/v/o are tensor indices), "fused" ([Q|K|V] rows in tensor q), "interleaved"
    (per-head [q_h|k_h|v_h] rows in tensor q, nH == nKV), "conv1d" (GPT-2: tensor q is (H, 3H) with
    columns [Q|K|V], tensor o is (nH*D, H) so head i of O is its rows)."""
    g = nH // nKV

    def qv(i):
        if layout == "separate":
            return View(q, (i * D, 0), 0, D, 1, H)
        if layout == "fused":
            return View(q, (i * D, 0), 0, D, 1, H)
        if layout == "interleaved":
            return View(q, (3 * i * D, 0), 0, D, 1, H)
        return View(q, (0, i * D), 1, D, 0, H)

    def kv(j, which):  # which 0: k, 1: v
        if layout == "separate":
            return View(k if which == 0 else v, (j * D, 0), 0, D, 1, H)
        if layout == "fused":
            return View(q, ((nH + which * nKV + j) * D, 0), 0, D, 1, H)
        if layout == "interleaved":
            return View(q, ((3 * j + 1 + which) * D, 0), 0, D, 1, H)
        return View(q, (0, (nH + which * nKV + j) * D), 1, D, 0, H)

    def ov(i):
        if layout == "conv1d":
            return View(o, (i * D, 0), 0, D, 1, H)
        return View(o, (0, i * D), 1, D, 0, H)

    for j in range(nKV):
        if qk:
            s = p.new_gram(D)
            for i in range(j * g, (j + 1) * g):
                p.grams.append(GramTerm(qv(i), 1.0, s))
                if bq is not None:
                    p.grams.append(GramTerm(View(bq, (i * D,), 0, D, None, 1), 1.0, s))
            p.grams.append(GramTerm(kv(j, 0), -1.0, s))
        if vo:
            s = p.new_gram(D)
            p.grams.append(GramTerm(kv(j, 1), 1.0, s))
            if bv is not None:
                p.grams.append(GramTerm(View(bv, (j * D,), 0, D, None, 1), 1.0, s))
            for i in range(j * g, (j + 1) * g):
                p.grams.append(GramTerm(ov(i), -1.0, s))


def swiglu_units(p: Plan, up, down, I, H, up_at=(), down_at=(), b_up=None):
    """Unit law ``||W_up[u,:]||^2 + b_up[u]^2 - ||W_down[:,u]||^2``; ``*_at``: leading expert index."""
    u = p.new_vec(I)
    n = len(up_at)
    p.norms.append(NormTerm(View(up, up_at + (0, 0), n, I, n + 1, H), 1.0, u))
    p.norms.append(NormTerm(View(down, down_at + (0, 0), n + 1, I, n, H), -1.0, u))
    if b_up is not None:
        p.norms.append(NormTerm(View(b_up, (0,), 0, I, None, 1), 1.0, u))
    return u


def gain(p: Plan, g, readers, H, shift=0.0):
    """Gain law ``(g_c + shift)^2 - sum_M ||W_M[:, c]||^2``; readers: (tensor, rows, lead index)."""
    c = p.new_vec(H)
    p.norms.append(NormTerm(View(g, (0,), 0, H, None, 1), 1.0, c, shift=shift))
    for t, rows, at in readers:
        n = len(at)
        p.norms.append(NormTerm(View(t, at + (0, 0), n + 1, H, n, rows), -1.0, c))
    return c


def rope_pairs(p: Plan, nH, nKV, D, H, q, k, R=None, interleaved=True):
    """Pair laws on rotary dims [0, R); pass-through Gram on [R, D) when R < D (partial rotary)."""
    R = D if R is None else R
    g = nH // nKV
    for j in range(nKV):
        base = p.new_vec(R // 2)
        for half in (0, 1):
            start, step = (half, 2) if interleaved else (half * R // 2, 1)
            for i in range(j * g, (j + 1) * g):
                p.norms.append(NormTerm(View(q, (i * D + start, 0), 0, R // 2, 1, H, step), 1.0, base))
            p.norms.append(NormTerm(View(k, (j * D + start, 0), 0, R // 2, 1, H, step), -1.0, base))
        if R < D:
            s = p.new_gram(D - R)
            for i in range(j * g, (j + 1) * g):
                p.grams.append(GramTerm(View(q, (i * D + R, 0), 0, D - R, 1, H), 1.0, s))
            p.grams.append(GramTerm(View(k, (j * D + R, 0), 0, D - R, 1, H), -1.0, s))


# --------------------------------------------------------------------------------------------- checks
def _abs_plan(plan: Plan) -> Plan:
    return Plan(grams=[dataclasses.replace(t, sign=abs(t.sign)) for t in plan.grams],
                norms=[dataclasses.replace(t, sign=abs(t.sign), shift=abs(t.shift)) for t in plan.norms],
                sums=[dataclasses.replace(t, sign=abs(t.sign)) for t in plan.sums],
                vec_size=plan.vec_size, gram_slots=dict(plan.gram_slots))


def _close(got, want, scale, rtol, what):
    got, want, scale = got.double(), want.double(), scale.double()
    assert got.shape == want.shape, what
    err = (got - want).abs()
    bad = err > rtol * scale + 1e-30
    assert not bad.any(), (f"{what}: max err {err.max().item():.3e}, max scale {scale.max().item():.3e}, "
                           f"worst rel {(err / scale.clamp_min(1e-300)).max().item():.3e}")


def check_grouped_twin(plan, xs, ys, got, scale):
    """The grouped (vectorised) torch twin ``got`` equals the term-by-term form in float64 to 1e-12 of
    the entrywise scale (``check`` runs this on every plan it sees: every layout of this file)."""
    want = _evaluate_looped(plan, xs, ys, True)
    _close(got[0], want[0], scale[0], 1e-12, "grouped twin vec")
    assert sorted(got[1]) == sorted(want[1])
    for d in want[1]:
        _close(got[1][d], want[1][d], scale[1][d], 1e-12, f"grouped twin gram D={d}")


def check(plan, ts, ys=None, fp64=False, rtol=None):
    """Triton vs float64 reference for evaluate (and bilinear when ``ys`` is given)."""
    rtol = rtol or (1e-12 if fp64 else max(RTOL[t.dtype] for t in ts if t.is_floating_point()))
    acc = torch.float64 if fp64 else torch.float32
    d64 = [t.double() for t in ts]
    vec, grams = evaluate(plan, ts, fp64=fp64, backend="triton")
    rv, rg = evaluate_reference(plan, d64, fp64=True)
    sv, sg = evaluate_reference(_abs_plan(plan), [t.abs() for t in d64], fp64=True)
    check_grouped_twin(plan, d64, None, (rv, rg), (sv, sg))
    assert vec.dtype == acc and vec.shape == (plan.vec_size,)
    _close(vec, rv, sv, rtol, "vec")
    assert sorted(grams) == sorted(rg)
    for d in rg:
        assert grams[d].dtype == acc
        _close(grams[d], rg[d], sg[d], rtol, f"gram D={d}")
    if ys is not None:
        y64 = [t.double() for t in ys]
        vec, grams = bilinear(plan, ts, ys, fp64=fp64, backend="triton")
        rv, rg = bilinear_reference(plan, d64, y64, fp64=True)
        ap = _abs_plan(plan)
        sv, sg = bilinear_reference(ap, [t.abs() for t in d64], [t.abs() for t in y64], fp64=True)
        check_grouped_twin(plan, d64, y64, (rv, rg), (sv, sg))
        _close(vec, rv, sv, rtol, "bilinear vec")
        for d in rg:
            _close(grams[d], rg[d], sg[d], rtol, f"bilinear gram D={d}")


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


def llama_block(nH=4, nKV=2, D=16, H=24, I=20, dtype=torch.float32, rope=False, seed=0):
    """A tiny Llama-style block: (plan, tensors) with GQA attention, SwiGLU units, gain, q/v biases."""
    g = torch.Generator().manual_seed(seed)
    ts = [randn(nH * D, H, dtype=dtype, gen=g), randn(nKV * D, H, dtype=dtype, gen=g),
          randn(nKV * D, H, dtype=dtype, gen=g), randn(H, nH * D, dtype=dtype, gen=g),
          randn(nH * D, dtype=dtype, gen=g), randn(nKV * D, dtype=dtype, gen=g),
          randn(I, H, dtype=dtype, gen=g), randn(I, H, dtype=dtype, gen=g), randn(H, I, dtype=dtype, gen=g),
          randn(H, dtype=dtype, gen=g), randn(I, dtype=dtype, gen=g)]
    p = Plan()
    if rope:
        rope_pairs(p, nH, nKV, D, H, 0, 1, R=D // 2, interleaved=True)
        attention(p, nH, nKV, D, H, 0, 1, 2, 3, bv=5, qk=False)
    else:
        attention(p, nH, nKV, D, H, 0, 1, 2, 3, bq=4, bv=5)
    swiglu_units(p, 7, 8, I, H, b_up=10)
    gain(p, 9, [(0, nH * D, ()), (1, nKV * D, ()), (2, nKV * D, ()), (6, I, ()), (7, I, ())], H)
    return p, ts


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_llama_block_all_dtypes(dtype):
    p, ts = llama_block(dtype=dtype)
    ys = [torch.randn(t.shape).to(dtype) for t in ts]
    check(p, ts, ys)


def test_rope_partial_rotary_and_fp64():
    p, ts = llama_block(rope=True, D=16, seed=1)
    # fused: the pair views of q/k rows are served by the gain law's q/k regions (one read each)
    st = L.build(p, ts, None, False, L.Tiles())
    per_tensor = [sum(int(t) == i for l in st.norm for t in l.x_tensor) for i in range(len(ts))]
    assert per_tensor[0] == 1 and per_tensor[1] == 1 and per_tensor[7] == 1, per_tensor  # q, k, up
    check(p, ts, [torch.randn_like(t) for t in ts])
    check(p, ts, [torch.randn_like(t) for t in ts], fp64=True)


@pytest.mark.parametrize("D,nH,nKV,H", [(8, 14, 14, 16), (64, 2, 1, 24), (80, 2, 2, 16), (96, 1, 1, 40),
                                        (128, 2, 1, 16), (192, 1, 1, 24), (256, 1, 1, 16), (8, 71, 1, 16)])
def test_head_dims_and_head_counts(D, nH, nKV, H):
    g = torch.Generator().manual_seed(D + nH)
    ts = [randn(nH * D, H, gen=g), randn(nKV * D, H, gen=g), randn(nKV * D, H, gen=g), randn(H, nH * D, gen=g)]
    p = Plan()
    attention(p, nH, nKV, D, H, 0, 1, 2, 3)
    check(p, ts, [torch.randn_like(t) for t in ts] if D in (80, 192) else None)


@pytest.mark.parametrize("layout", ["fused", "interleaved", "conv1d"])
def test_fused_qkv_layouts(layout):
    nH, nKV, D, H = (2, 2, 16, 24) if layout == "interleaved" else (4, 2, 16, 24)
    g = torch.Generator().manual_seed(3)
    if layout == "conv1d":  # GPT-2 Conv1D: y = x @ W + b, W: (in, out)
        ts = [randn(H, (nH + 2 * nKV) * D, gen=g), randn(nH * D, H, gen=g)]
    else:
        ts = [randn((nH + 2 * nKV) * D, H, gen=g), randn(H, nH * D, gen=g)]
    p = Plan()
    attention(p, nH, nKV, D, H, 0, None, None, 1, layout=layout)
    check(p, ts, [torch.randn_like(t) for t in ts])


def test_transposed_and_strided_tensors():
    """Same law on a transposed tensor (layout 1) and a doubly strided slice (general layout 2)."""
    g = torch.Generator().manual_seed(4)
    D, H = 16, 20
    q = randn(H, 2 * D, gen=g).t()  # logical (2D, H), rows contiguous
    k = randn(3 * D, 3 * H, gen=g)[::3, ::3][:D]  # neither stride 1
    big = randn(4 * H, 2 * D, gen=g)
    p = Plan()
    s = p.new_gram(D)
    p.grams += [GramTerm(View(0, (0, 0), 0, D, 1, H), 1.0, s), GramTerm(View(0, (D, 0), 0, D, 1, H), 0.5, s),
                GramTerm(View(1, (0, 0), 0, D, 1, H), -1.0, s), GramTerm(View(2, (1, 3), 1, D, 0, H, 1), -2.0, s)]
    i = p.new_vec(D)
    p.norms += [NormTerm(View(0, (0, 0), 0, D, 1, H), 1.0, i), NormTerm(View(1, (0, 0), 1, H, 0, D), -1.0, 0)]
    p.vec_size = max(p.vec_size, H)
    p.norms += [NormTerm(View(2, (0, 1), 0, D, 1, D, row_step=3), 1.0, 0, index_stride=1)]
    p.sums += [SumTerm(View(1, (0, 0), 0, D, 1, H), 1.0, 0), SumTerm(View(0, (0, 0), 0, 2 * D, 1, H), -1.0, 0)]
    ts = [q, k, big]
    ys = [torch.randn(H, 2 * D).t(), torch.randn(D, H), torch.randn(4 * H, 2 * D)]  # y strides differ from x
    check(p, ts, ys)


def test_moe_fused_experts_router_and_gain():
    """3-D fused expert tensors (E, 2I, H) gate_up / (E, H, I) down, router and lm_head sums, Gemma gain."""
    g = torch.Generator().manual_seed(5)
    E, I, H, V = 3, 12, 16, 10
    ts = [randn(E, 2 * I, H, gen=g), randn(E, H, I, gen=g), randn(E, H, gen=g), randn(H, gen=g),
          randn(V, H, gen=g), randn(E, gen=g)]
    p = Plan()
    for e in range(E):
        u = p.new_vec(I)  # up = second half of gate_up (rows I..2I)
        p.norms.append(NormTerm(View(0, (e, I, 0), 1, I, 2, H), 1.0, u))
        p.norms.append(NormTerm(View(1, (e, 0, 0), 2, I, 1, H), -1.0, u))
    readers = [(0, 2 * I, (e,)) for e in range(E)] + [(2, E, ())]
    gain(p, 3, readers, H, shift=1.0)
    r = p.new_vec(H)
    p.sums.append(SumTerm(View(2, (0, 0), 0, E, 1, H), 1.0, r))
    b = p.new_vec(1)
    p.sums.append(SumTerm(View(5, (0,), 0, E, None, 1), 1.0, b))  # sum_e b_router[e]
    w = p.new_vec(H)
    p.sums.append(SumTerm(View(4, (0, 0), 0, V, 1, H), -1.0, w))
    check(p, ts)
    # bilinear needs shift == 0
    p0 = Plan(grams=p.grams, norms=[dataclasses.replace(t, shift=0.0) for t in p.norms], sums=p.sums,
              vec_size=p.vec_size, gram_slots=p.gram_slots)
    check(p0, ts, [torch.randn_like(t) for t in ts])
    with pytest.raises(ValueError, match="shift"):
        bilinear(p, ts, ts, backend="triton")


def test_zero_element_tensors_and_views():
    g = torch.Generator().manual_seed(6)
    D, H = 16, 8
    ts = [randn(0, H, gen=g), randn(D, H, gen=g), randn(D, 0, gen=g)]
    p = Plan()
    s0 = p.new_gram(D)  # gets only an empty-column term: stays 0
    s1 = p.new_gram(D)
    p.grams += [GramTerm(View(2, (0, 0), 0, D, 1, 0), 1.0, s0), GramTerm(View(1, (0, 0), 0, D, 1, H), 1.0, s1),
                GramTerm(View(1, (0, 0), 0, D, 1, 0), -1.0, s1)]
    z = p.new_gram(0)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 0, 1, H), 1.0, z))
    i = p.new_vec(D)
    p.norms += [NormTerm(View(2, (0, 0), 0, D, 1, 0), 1.0, i), NormTerm(View(0, (0, 0), 0, 0, 1, H), 1.0, i)]
    p.sums += [SumTerm(View(0, (0, 0), 0, 0, 1, H), 1.0, p.new_vec(H))]
    check(p, ts, [torch.randn_like(t) for t in ts])
    vec, grams = evaluate(p, ts, backend="triton")
    assert grams[D][s0].abs().max() == 0 and grams[0].shape == (1, 0, 0)
    assert vec[:D].abs().max() == 0 and vec[D:].abs().max() == 0


def test_empty_plan():
    vec, grams = evaluate(Plan(), [torch.randn(3)], backend="triton")
    assert vec.shape == (0,) and grams == {}


def test_cache_reuses_tables_and_sees_in_place_updates():
    from conserve.kernels import runner as T

    p, ts = llama_block(seed=7)
    pr = T.prepare(p, ts)
    v1, _ = evaluate(p, ts, backend="triton")
    assert T.prepare(p, ts) is pr
    with torch.no_grad():
        ts[0].mul_(2.0)  # in place: same tables, new values
    v2, g2 = evaluate(p, ts, backend="triton")
    rv, rg = evaluate_reference(p, ts, fp64=True)
    assert T.prepare(p, ts) is pr
    assert torch.allclose(v2.double(), rv, rtol=1e-5, atol=1e-4) and not torch.equal(v1, v2)
    for lb in pr.gram_bound:  # the tl.multiple_of hints are true
        for terms, align in lb:
            t = terms.numpy()
            hinted = np.concatenate([t[:, 0], t[:, 5], t[t[:, 4] == 0][:, [1, 6]].ravel(), t[t[:, 4] == 1][:, [2, 7]].ravel()])
            assert align > 1 and (hinted % align == 0).all()
    for regs, align in pr.norm_bound:
        r = regs.numpy()
        assert (np.concatenate([r[:, 0], r[:, 9], r[r[:, 5] == 0][:, [1, 10]].ravel()]) % align == 0).all()
    ts2 = [t.clone() for t in ts]  # new addresses, same layout: same structure, rebound offsets
    v3, g3 = evaluate(p, ts2, backend="triton")
    assert T.prepare(p, ts2) is pr and torch.equal(v3, v2) and all(torch.equal(g3[d], g2[d]) for d in g2)


def test_deterministic():
    p, ts = llama_block(seed=8, dtype=torch.bfloat16)
    a = evaluate(p, ts, backend="triton")
    b = evaluate(p, ts, backend="triton")
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][d], b[1][d]) for d in a[1])


def test_bad_input_errors():
    p = Plan()
    p.grams.append(GramTerm(View(0, (0, 0), 0, 4, 1, 4), 1.0, 0))
    with pytest.raises(ValueError, match="new_gram"):
        evaluate(p, [torch.randn(4, 4)], backend="triton")
    p = Plan()
    p.norms.append(NormTerm(View(0, (0, 0), 0, 4, 1, 4), 1.0, 0))
    with pytest.raises(ValueError, match="new_vec"):
        evaluate(p, [torch.randn(4, 4)], backend="triton")
    p.vec_size = 4
    with pytest.raises(ValueError, match="does not fit"):
        evaluate(p, [torch.randn(3, 4)], backend="triton")
    with pytest.raises(ValueError, match="equal shapes"):
        bilinear(p, [torch.randn(4, 4)], [torch.randn(4, 5)], backend="triton")


# -------------------------------------------------------------------------------------- int64 offsets
def test_offsets_past_2_31_elements_in_tables():
    """Table arithmetic is int64: a view deep inside a >2**31-element (meta, unallocated) tensor."""
    big = torch.empty(3, 2**31 + 64, device="meta")
    p = Plan()
    s = p.new_gram(2)
    p.grams.append(GramTerm(View(0, (0, 2**31 + 5), 1, 2, 0, 3), 1.0, s))  # column block, row stride 2**31+64
    p.norms.append(NormTerm(View(0, (1, 2**31 + 1), 1, 2, 0, 2), 1.0, p.new_vec(2)))
    st = L.build(p, [big], None, False, L.Tiles())
    row = st.gram[0].launches[0].terms[0]
    assert row[0] == 2**31 + 5 and row[2] == 2**31 + 64 and row[4] == 1
    reg = st.norm[0].regions[0]
    assert reg[0] == (2**31 + 64) + 2**31 + 1 and reg[1] == 2**31 + 64  # transposed: slow stride
    _, d = L.tensor_deltas([_Ptr(0), _Ptr(4 * (2**33 + 3))], [0, 1])
    assert d.dtype == np.int64 and d[1] == 2**33 + 3
    assert L.offsets(np.array([7]), np.array([1]), d)[0] == 2**33 + 10


class _Ptr:
    def __init__(self, p):
        self.p = p

    def data_ptr(self):
        return self.p

    def element_size(self):
        return 4


def _far_page(near: int, distance: int):
    """Map one page ~``distance`` bytes above ``near`` (the kernel then reaches it through an int64
    element offset > 2**31 from the base tensor); None if the OS places it elsewhere."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    hint = (near + distance) & ~(mmap.PAGESIZE - 1)
    addr = libc.mmap(hint, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value) or abs(addr - near) < 2**31 * 4:
        return None
    return addr


def test_kernel_with_element_offset_past_2_31():
    base = torch.randn(4, 16)
    addr = _far_page(base.data_ptr(), 2**34)
    if addr is None:
        pytest.skip("the OS did not map a page 16 GiB away from the heap")
    buf = (ctypes.c_float * (mmap.PAGESIZE // 4)).from_address(addr)
    far = torch.frombuffer(buf, dtype=torch.float32)[: 16 * 16].view(16, 16)
    far.copy_(torch.randn(16, 16))
    p = Plan()
    s = p.new_gram(16)
    p.grams += [GramTerm(View(1, (0, 0), 0, 16, 1, 16), 1.0, s), GramTerm(View(1, (0, 0), 1, 16, 0, 16), -0.5, s)]
    i = p.new_vec(16)
    p.norms += [NormTerm(View(1, (0, 0), 0, 16, 1, 16), 1.0, i), NormTerm(View(0, (0, 0), 1, 16, 0, 4), 1.0, i)]
    ts = [base, far]
    _, d = L.tensor_deltas(ts, [0, 1])
    assert abs(int(d[1])) > 2**31
    check(p, ts)


# ------------------------------------------------------------------------------------------ hypothesis
@st.composite
def random_case(draw):
    """A random 2-D weight (maybe transposed / strided / a 3-D slice), views of random rectangles."""
    R = draw(st.integers(1, 40))
    C = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["contig", "transposed", "strided", "3d"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if kind == "contig":
        t = randn(R, C, gen=g, dtype=dtype)
    elif kind == "transposed":
        t = randn(C, R, gen=g, dtype=dtype).t()
    elif kind == "strided":
        t = randn(2 * R, 3 * C, gen=g, dtype=dtype)[::2, 1::3]
    else:
        t = randn(2, R, C, gen=g, dtype=dtype)
    at = (1,) if t.dim() == 3 else ()
    p = Plan()
    nterms = draw(st.integers(1, 4))
    for _ in range(nterms):
        what = draw(st.sampled_from(["gram", "norm", "sum"]))
        axis = draw(st.integers(0, 1))  # which logical dim the view's rows walk
        n_r, n_c = (R, C) if axis == 0 else (C, R)
        rows = draw(st.integers(0, n_r))
        step = draw(st.integers(1, 2))
        rows = min(rows, (n_r + step - 1) // step)
        r0 = draw(st.integers(0, n_r - (rows - 1) * step - 1)) if rows else 0
        cols = draw(st.integers(0, n_c))
        c0 = draw(st.integers(0, n_c - cols))
        start = (r0, c0) if axis == 0 else (c0, r0)
        n = len(at)
        v = View(0, at + start, n + axis, rows, n + 1 - axis, cols, step)
        sign = draw(st.sampled_from([1.0, -1.0, 0.5]))
        if what == "gram":
            p.grams.append(GramTerm(v, sign, p.new_gram(rows)))
        elif what == "norm":
            shift = draw(st.sampled_from([0.0, 0.0, 1.0]))
            p.norms.append(NormTerm(v, sign, p.new_vec(rows), 1, shift))
        else:
            p.sums.append(SumTerm(v, sign, p.new_vec(cols)))
    return p, [t]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_case())
def test_hypothesis_random_shapes_and_layouts(case):
    p, ts = case
    check(p, ts)
    if all(t.shift == 0.0 for t in p.norms):
        y = torch.randn(ts[0].shape).to(ts[0].dtype)
        check(p, ts, [y])


def test_gpu_work_split_under_interpreter():
    """The GPU configuration's splits (contracted-dim chunks per Gram slot, several items and slow
    partial rows per region) give the same results as the single-item CPU configuration."""
    from conserve.kernels import runner as T

    p, ts = llama_block(nH=4, nKV=1, D=16, H=48, I=40, seed=9)
    cfg = L.Tiles(target_items=64, slow_rows=32, BS=16, BF=32, BK_SMALL=16)
    ys = [torch.randn_like(t) for t in ts]
    for y in (None, ys):
        pr = T.Prepared(p, ts, y, False, cfg)
        assert max(len(l.items) for b in pr.st.gram for l in b.launches) > len(pr.st.gram[0].groups)
        assert any((pr.st.finish[:, 1] > 1))
        vec, grams = pr.run(ts, y)
        d64 = [t.double() for t in ts]
        rv, rg = (evaluate_reference(p, d64, fp64=True) if y is None
                  else bilinear_reference(p, d64, [t.double() for t in y], fp64=True))
        sv, sg = evaluate_reference(_abs_plan(p), [t.abs() for t in d64], fp64=True)
        if y is not None:
            sv, sg = bilinear_reference(_abs_plan(p), [t.abs() for t in d64], [t.double().abs() for t in y], fp64=True)
        _close(vec, rv, sv, 1e-5, "vec")
        for d in rg:
            _close(grams[d], rg[d], sg[d], 1e-5, f"gram {d}")


def test_exact_gpu_config_under_interpreter():
    """The configuration a 132-SM GPU gets (``Tiles.gpu``: [32, 128] norm tiles, [32, 256] for bf16,
    256 KiB items, Gram chunks for 4 programs per SM) on a block whose columns give full and masked
    tiles, against the float64 reference."""
    from conserve.kernels import runner as T

    cfg = L.Tiles.gpu()
    assert (cfg.BS, cfg.BF) == (32, 128) and cfg.norm_tile((torch.bfloat16, torch.bfloat16)) == (256, 8)
    for dtype in (torch.float32, torch.bfloat16):
        p, ts = llama_block(nH=2, nKV=1, D=16, H=300, I=40, dtype=dtype, seed=12)
        vec, grams = T.Prepared(p, ts, None, False, cfg).run(ts)
        d64 = [t.double() for t in ts]
        rv, rg = evaluate_reference(p, d64, fp64=True)
        sv, sg = evaluate_reference(_abs_plan(p), [t.abs() for t in d64], fp64=True)
        _close(vec, rv, sv, RTOL[dtype], f"vec {dtype}")
        for d in rg:
            _close(grams[d], rg[d], sg[d], RTOL[dtype], f"gram {dtype}")


def test_norm_items_sized_by_bytes_and_fp64_gram_without_dot():
    """GPU-style norm split (``item_bytes``: several row chunks AND column tiles per region, the
    unmasked full-tile branch and the masked last tile, fast partials per column tile, BF doubled for
    bf16) and the fp64 Gram path (rank-1 updates, no tl.dot), against the float64 reference."""
    from conserve.kernels import runner as T

    cfg = L.Tiles(target_items=16, item_bytes=32 * 32 * 4, BS=16, BF=32)  # 32 rows x 32 fp32 columns
    for dtype in (torch.float32, torch.bfloat16):
        p, ts = llama_block(nH=2, nKV=1, D=16, H=72, I=40, dtype=dtype, seed=10)
        st = L.build(p, ts, None, False, cfg)
        (nl,) = st.norm
        assert nl.BF == (32 if dtype == torch.float32 else 64) and nl.warps == (4 if dtype == torch.float32 else 8)
        assert (nl.items[:, 3] % nl.BF == 0).all()
        it = nl.items
        sizes = (it[:, 2] - it[:, 1]) * np.minimum(nl.BF, nl.regions[it[:, 0], 4] - it[:, 3])
        assert (np.diff(sizes) <= 0).all()  # biggest first
        if dtype == torch.float32:
            assert sizes.max() == 32 * 32 and (st.finish[:, 1] > 1).sum() >= 2  # split rows and columns
        ys = [torch.randn_like(t, dtype=torch.float32).to(dtype) for t in ts]
        for fp64, y in ([(False, None), (False, ys), (True, ys)] if dtype == torch.float32 else [(False, ys)]):
            pr = T.Prepared(p, ts, y, fp64, cfg)
            vec, grams = pr.run(ts, y)
            d64 = [t.double() for t in ts]
            ap = _abs_plan(p)
            if y is None:
                (rv, rg), (sv, sg) = evaluate_reference(p, d64, fp64=True), evaluate_reference(ap, [t.abs() for t in d64], fp64=True)
            else:
                y64 = [t.double() for t in y]
                rv, rg = bilinear_reference(p, d64, y64, fp64=True)
                sv, sg = bilinear_reference(ap, [t.abs() for t in d64], [t.abs() for t in y64], fp64=True)
            rtol = 1e-12 if fp64 else RTOL[dtype]
            _close(vec, rv, sv, rtol, f"vec {dtype} fp64={fp64}")
            for d in rg:
                _close(grams[d], rg[d], sg[d], rtol, f"gram {dtype} fp64={fp64}")


def test_gram_sign_folding_rule():
    """Signs are folded into the dot operands only where that is exact enough: any sign for fp32
    inputs, |sign| == 1 for half inputs (else a separate accumulator); both paths are checked."""
    g = torch.Generator().manual_seed(11)
    for dtype, signs, fold in ((torch.float32, (1.0, -0.3), True), (torch.bfloat16, (1.0, -1.0), True),
                               (torch.bfloat16, (1.0, -0.3), False)):
        ts = [randn(32, 24, gen=g, dtype=dtype)]
        p = Plan()
        s = p.new_gram(16)
        p.grams += [GramTerm(View(0, (0, 0), 0, 16, 1, 24), signs[0], s), GramTerm(View(0, (16, 0), 0, 16, 1, 24), signs[1], s)]
        st = L.build(p, ts, None, False, L.Tiles())
        assert st.gram[0].launches[0].fold is fold
        check(p, ts)


# ------------------------------------------------------------------------- drift (one fused Gram pass)
def drift_case(D, dtype, seed, vec_terms=False, odd_sign=True):
    """GQA-like VO slots of head size D over row blocks (v_proj rows), column blocks (o_proj columns),
    a transposed tensor, a doubly strided slice and a zero-element tensor; signs +-1 and, if
    ``odd_sign``, -0.5 (bf16 then folds h_new's sign in fp32, else in bf16: ``GramLaunch.fold``).  Returns (plan, olds, news): news = olds + 0.3 noise,
    rounded to ``dtype``; news[2] has other strides than olds[2] (a contiguous copy)."""
    g = torch.Generator().manual_seed(seed)
    H, nKV, nH = 24, 2, 4
    olds = [randn(nKV * D, H, gen=g, dtype=dtype), randn(H, nH * D, gen=g, dtype=dtype),
            randn(H, D, gen=g, dtype=dtype).t(), randn(2 * D, 2 * H, gen=g, dtype=dtype)[::2, ::2],
            randn(D, 0, gen=g, dtype=dtype)]
    news = [(o.float() + 0.3 * torch.randn(o.shape, generator=g)).to(dtype) for o in olds]
    news[0], news[1], news[4] = news[0].contiguous(), news[1].contiguous(), news[4].contiguous()
    news[3] = news[3].contiguous()  # other strides than olds[3]: general layout for both
    news[2] = news[2].t().contiguous().t()  # same (transposed) strides as olds[2]
    p = Plan()
    for j in range(nKV):
        s = p.new_gram(D)
        p.grams.append(GramTerm(View(0, (j * D, 0), 0, D, 1, H), 1.0, s))
        for i in range(j * nH // nKV, (j + 1) * nH // nKV):
            p.grams.append(GramTerm(View(1, (0, i * D), 1, D, 0, H), -1.0, s))
    s = p.new_gram(D)
    p.grams += [GramTerm(View(2, (0, 0), 0, D, 1, H), 1.0, s), GramTerm(View(3, (0, 0), 0, D, 1, H), -0.5 if odd_sign else -1.0, s),
                GramTerm(View(4, (0, 0), 0, D, 1, 0), 1.0, s)]
    s = p.new_gram(D)  # only a zero-element term: zeros
    p.grams.append(GramTerm(View(4, (0, 0), 0, D, 1, 0), -1.0, s))
    if vec_terms:  # vector terms go through the standalone composition
        u = p.new_vec(D)
        p.norms += [NormTerm(View(0, (0, 0), 0, D, 1, H), 1.0, u), NormTerm(View(2, (0, 0), 0, D, 1, H), -1.0, u)]
        c = p.new_vec(H)
        p.sums.append(SumTerm(View(1, (0, 0), 1, D, 0, H), 1.0, c))
    return p, olds, news


DRIFT_NAMES = ("h_new", "decay", "bil", "h_delta")


def check_drift(got, want, rtol, what):
    """Per output and component: ``|got - want| <= rtol * max|want|`` (0 demands exact zeros)."""
    for name, (gv, gg), (wv, wg) in zip(DRIFT_NAMES, got, want):
        assert gv.dtype == torch.float32 and gv.shape == wv.shape, (what, name)
        pairs = [("vec", gv, wv)] + [(f"gram D={d}", gg[d], wg[d]) for d in wg]
        assert sorted(gg) == sorted(wg), (what, name)
        for part, x, y in pairs:
            scale = y.abs().max().item() if y.numel() else 0.0
            err = (x.double() - y.double()).abs().max().item() if y.numel() else 0.0
            assert err <= rtol * scale, f"{what} {name} {part}: err {err:.3e} > {rtol} * {scale:.3e}"


@pytest.mark.parametrize("D,dtype", [(8, torch.float32), (80, torch.float32), (128, torch.float32),
                                     (192, torch.float32), (8, torch.bfloat16), (80, torch.bfloat16)])
def test_drift_triton_vs_float64(D, dtype):
    """DRIFT pass vs ``drift_reference`` in float64 from the same values, a != 1 (per tensor) and all
    a == 1 (decay must then be exactly 0); D = 80 also has vector terms (standalone composition).  D = 8 / 80: one / two 64-wide tiles (80: masked); 128: two
    full tiles; 192: three (six output tiles)."""
    from conserve.kernels import drift, drift_reference

    from conserve.kernels import runner as T

    p, olds, news = drift_case(D, dtype, seed=D, vec_terms=D == 80, odd_sign=D != 8)
    folds = {l.fold for b in T.prepare(p, olds, news, drift=True).st.gram for l in b.launches}
    assert folds == {dtype == torch.float32 or D == 8}  # bf16: both h_new fold paths are covered
    d64 = lambda ts: [t.double() for t in ts]  # noqa: E731
    for a in ([0.9, 0.8, 0.95, 1.0, 0.7], 1.0):
        got = drift(p, olds, news, a, backend="triton")
        want = drift_reference(p, d64(olds), d64(news), a, fp64=True)
        check_drift(got, want, RTOL[dtype], f"D={D} {dtype} a={a}")
        if a == 1.0:
            assert all((g == 0).all() for g in got[1][1].values())
        else:
            assert all(g.abs().max() > 0 for g in got[1][1].values() if g.shape[0]) and got[1][1][D][-1].abs().max() == 0


def test_drift_gpu_work_split_and_tables():
    """GPU-style split (several contracted-dim chunks per output tile, summed by the 4-plane finishing
    pass), the DRIFT tables (64-wide tiles, one launch per (D, dtype group) for the diagonal output
    tiles and one for the others), and the cache."""
    from conserve.kernels import drift_reference
    from conserve.kernels import runner as T

    p, olds, news = drift_case(128, torch.float32, seed=7)
    olds[0] = randn(2 * 128, 200, gen=torch.Generator().manual_seed(1))  # longer contracted dim: chunks
    news[0] = olds[0] + 0.3 * torch.randn(olds[0].shape)
    p.grams[0] = GramTerm(View(0, (0, 0), 0, 128, 1, 200), 1.0, 0)
    p.grams[3] = GramTerm(View(0, (128, 0), 0, 128, 1, 200), 1.0, 1)
    cfg = L.Tiles(target_items=40)
    pr = T.Prepared(p, olds, news, False, cfg, drift=True)
    (b,) = pr.st.gram
    assert b.BT == 64 and [l.single for l in b.launches] == [True, False]
    assert all(l.BK == L.DRIFT_BK for l in b.launches)
    assert all(((l.items[:, 4] == l.items[:, 5]) == l.single).all() for l in b.launches)  # ti == tj iff diagonal
    assert sum(len(l.items) for l in b.launches) > len(b.groups)  # several items per output tile
    a = [0.9, 0.85, 1.0, 0.75, 1.0]
    got = pr.run_drift(olds, news, a)
    want = drift_reference(p, [t.double() for t in olds], [t.double() for t in news], a, fp64=True)
    check_drift([(w[0].float(), g) for g, w in zip(got, want)], want, 1e-5, "split")
    with pytest.raises(ValueError, match="fp32"):
        T.Prepared(p, olds, news, True, cfg, drift=True)


def test_drift_reference_pieces_and_closed_form_decay():
    """The torch twin's h_new, bil, h_delta are exactly the evaluations the optimizer composed before
    (same fp32 ops: equal bit for bit); its decay is the closed form ``s (a^2-1) h_t(old)`` per term
    (Gemma-shifted norms ``+ 2 s (a-1) c sum x``, Sum terms ``s (a-1) sum x``): equal to the float64
    ``h(a old) - h(old)`` of the term-by-term twin to 1e-12 in fp64, and to fp32 rounding of the
    per-term decay in fp32 at a = 1 - 1e-3, where the fp32 difference of two evaluations cancels."""
    from conserve.kernels import decay_reference, drift

    p, olds, news = drift_case(16, torch.float32, seed=3, vec_terms=True)
    a = [0.9, 0.8, 0.95, 1.0, 0.7]
    a_old = [o * x if x != 1.0 else o for o, x in zip(olds, a)]
    delta = [n - x for n, x in zip(news, a_old)]
    got = drift(p, olds, news, a, backend="torch")
    want = {0: evaluate_reference(p, news), 2: bilinear_reference(p, a_old, delta), 3: evaluate_reference(p, delta)}
    for k, (wv, wg) in want.items():
        gv, gg = got[k]
        assert torch.equal(gv, wv) and all(torch.equal(gg[d], wg[d]) for d in wg), DRIFT_NAMES[k]
    # decay alone (bilinear is undefined for shifted norms): + a Gemma-style shifted gain and a Sum term
    p = Plan(grams=list(p.grams), norms=list(p.norms), sums=list(p.sums), vec_size=p.vec_size,
             gram_slots=dict(p.gram_slots))
    p.norms.append(NormTerm(View(1, (0, 0), 0, 24, 1, 3), -0.5, p.new_vec(24), shift=1.0))
    p.sums.append(SumTerm(View(0, (0, 0), 0, 5, 1, 24), 2.0, p.new_vec(24)))
    o64 = [t.double() for t in olds]
    ao64 = [o * x for o, x in zip(o64, a)]
    h_a, h_o = _evaluate_looped(p, ao64, None, True), _evaluate_looped(p, o64, None, True)
    dv, dg = decay_reference(p, o64, a, fp64=True)
    sv, sg = _evaluate_looped(_abs_plan(p), [t.abs() for t in o64], None, True)
    _close(dv, h_a[0] - h_o[0], sv, 1e-12, "decay vec fp64")
    for d in dg:
        _close(dg[d], h_a[1][d] - h_o[1][d], sg[d], 1e-12, f"decay gram fp64 D={d}")
    # fp32 at a = 1 - 1e-3: the closed form is within fp32 rounding of the per-term decay (1e-3 h)
    a = float(np.float32(1 - 1e-3))
    dv, dg = decay_reference(p, olds, [a] * len(olds))
    h_a, h_o = _evaluate_looped(p, [o * a for o in o64], None, True), _evaluate_looped(p, o64, None, True)
    f_a, f_o = _evaluate_looped(p, [o * a for o in olds], None, False), _evaluate_looped(p, olds, None, False)
    for d in dg:
        want, scale = h_a[1][d] - h_o[1][d], (1 - a * a) * sg[d]
        _close(dg[d], want, scale, 1e-5, f"decay fp32 D={d}")
        diff_err = ((f_a[1][d] - f_o[1][d]).double() - want).abs().max() / (scale.max())
        assert diff_err > 1e-5  # the difference of two fp32 evaluations does not resolve it


def test_decay_false_on_both_backends():
    """``drift(..., decay=False)``: decay is None on both backends, the other pieces equal decay=True's
    bit for bit, and the Triton DRIFT pass neither writes nor reads the decay plane (its partial
    buffer stays as it was: the decay dots and stores are compiled out, the finishing grid has 3
    planes)."""
    from conserve.kernels import drift
    from conserve.kernels import runner as T

    p, olds, news = drift_case(80, torch.float32, seed=5, vec_terms=True)
    a = [0.9, 0.8, 0.95, 1.0, 0.7]
    for backend in ("torch", "triton"):
        full = drift(p, olds, news, a, backend=backend)
        if backend == "triton":
            pr = T.prepare(p, olds, news, drift=True)
            for buf in pr.part.values():
                buf.fill_(float("nan"))
        part = drift(p, olds, news, a, backend=backend, decay=False)
        assert part[1] is None and full[1] is not None
        for k in (0, 2, 3):
            assert torch.equal(part[k][0], full[k][0]), (backend, k)
            assert all(torch.equal(part[k][1][d], full[k][1][d]) for d in full[k][1]), (backend, k)
        if backend == "triton":
            for b in pr.st.gram:
                plane = max(1, b.n_items) * b.BT * b.BT
                assert pr.part[b.D][plane:2 * plane].isnan().all()  # decay plane untouched
                assert not pr.part[b.D][:plane].isnan().any()
    for backend in ("torch", "triton"):  # no Gram term / fp64: the standalone composition skips it too
        q = Plan(norms=list(p.norms), sums=list(p.sums), vec_size=p.vec_size)
        assert drift(q, olds, news, a, backend=backend, decay=False)[1] is None
        assert drift(p, olds, news, a, backend=backend, decay=False, fp64=True)[1] is None


def test_config_fields_and_tf32x3_plumbing():
    """``Config``: bad values name the allowed ones; ``gram_bt`` / ``norm_stages`` / ``input_precision``
    reach the tiles of both devices; a tf32x3 plan is prepared separately from the ieee one and runs
    (evaluate, bilinear, DRIFT) under the interpreter, matching the float64 reference at fp32
    tolerance (the interpreter computes its dots in fp32; the 3xTF32 rounding on a GPU is checked by
    ``bench/gpu_parity.py``)."""
    from conserve.kernels import drift, drift_reference
    from conserve.kernels import runner as T

    for bad, match in ((dict(input_precision="tf32"), "ieee"), (dict(gram_bt=48), "16, 32, 64 or 128"),
                       (dict(norm_stages=0), "1 to 4")):
        with pytest.raises(ValueError, match=match):
            Config(**bad)
    cfg = Config(input_precision="tf32x3", gram_bt=64, norm_stages=2, overlap=False)
    tg = L.Tiles.gpu(132, cfg)
    assert (tg.BT_MAX, tg.norm_stages, tg.precision, tg.overlap) == (64, 2, "tf32x3", False)
    assert L.Tiles.for_device(torch.device("cpu"), cfg).precision == "tf32x3"
    assert L.Tiles.for_device(torch.device("cpu")).precision == "ieee"
    p, ts = llama_block(D=128, H=40, I=20, nH=2, nKV=1, seed=4)
    ys = [torch.randn_like(t) for t in ts]
    pr = T.prepare(p, ts, config=cfg)
    assert pr is not T.prepare(p, ts) and pr.cfg.precision == "tf32x3" and pr.st.gram[0].BT == 64
    d64 = [t.double() for t in ts]
    for got, want, scale in (
            (evaluate(p, ts, backend="triton", config=cfg), evaluate_reference(p, d64, fp64=True),
             evaluate_reference(_abs_plan(p), [t.abs() for t in d64], fp64=True)),
            (bilinear(p, ts, ys, backend="triton", config=cfg), bilinear_reference(p, d64, [y.double() for y in ys], fp64=True),
             bilinear_reference(_abs_plan(p), [t.abs() for t in d64], [y.double().abs() for y in ys], fp64=True))):
        _close(got[0], want[0], scale[0], 1e-5, "vec tf32x3")
        _close(got[1][128], want[1][128], scale[1][128], 1e-5, "gram tf32x3")
    pd, olds, news = drift_case(80, torch.float32, seed=6)
    a = [0.9, 0.8, 0.95, 1.0, 0.7]
    got = drift(pd, olds, news, a, backend="triton", config=Config(input_precision="tf32x3"))
    want = drift_reference(pd, [t.double() for t in olds], [t.double() for t in news], a, fp64=True)
    check_drift(got, want, 1e-5, "drift tf32x3")


def test_grouped_twin_groups_views_not_terms():
    """The grouped twin stacks same-shape views: a Llama plan of several layers has a handful of groups
    (one bmm / reduction each) and blocks, not one per term; the structure is cached per plan and
    layout (and rebuilt for other strides)."""
    from conserve.kernels import reference as R

    p, ts = llama_block(nH=4, nKV=2, D=16, H=24, I=20, seed=8)
    s = R._structure(p, ts, None, False, torch.float32, torch.device("cpu"))
    assert len(s.grams) == 2  # (D, contracted length): q/k/v rows and o columns (24), q/v biases (1)
    assert sum(len(g.blocks) for g in s.grams) < len(p.grams) / 2
    assert R._structure(p, ts, None, False, torch.float32, torch.device("cpu")) is s
    ts2 = [t.t().contiguous().t() if t.dim() == 2 else t for t in ts]
    assert R._structure(p, ts2, None, False, torch.float32, torch.device("cpu")) is not s
    got = evaluate_reference(p, ts2, fp64=True)
    want = _evaluate_looped(p, [t.double() for t in ts], None, True)
    sv, sg = evaluate_reference(_abs_plan(p), [t.double().abs() for t in ts], fp64=True)
    _close(got[0], want[0], sv, 1e-12, "vec")
    _close(got[1][16], want[1][16], sg[16], 1e-12, "gram")


@pytest.mark.parametrize("dtype,fp64", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                         (torch.float64, True)])
def test_twin_reduces_whole_lines_once_per_tensor(dtype, fp64, monkeypatch):
    """Vector terms whose rows are whole lines (unit rows, gain columns, RoPE pairs, router/lm_head sums,
    1-D gains, 3-D experts) are read as ONE reduction per (tensor, dim): equal to the term-by-term
    float64 form on the same rounded inputs (fp32 accumulation: 1e-5 of the entrywise scale), for
    contiguous, transposed and strided tensors, through the chunked path too (a strided reduction larger
    than a chunk), evaluate and bilinear."""
    from conserve.kernels import reference as R

    monkeypatch.setattr(R, "_CHUNK", 64)  # every strided reduction here spans several chunks
    g = torch.Generator().manual_seed(11)
    E, I, H, V = 2, 12, 16, 10
    up = randn(I, H, dtype=dtype, gen=g)
    down_t = randn(I, H, dtype=dtype, gen=g).t()  # (H, I) transposed: its unit columns are contiguous
    gate_up = randn(E, 2 * I, H, dtype=dtype, gen=g)
    router = randn(3 * E, 2 * H, dtype=dtype, gen=g)[::3, ::2]  # (E, H), neither stride 1
    ts = [up, down_t, gate_up, router, randn(H, dtype=dtype, gen=g), randn(V, H, dtype=dtype, gen=g)]
    p = Plan()
    u = swiglu_units(p, 0, 1, I, H)
    for e in range(E):
        p.norms.append(NormTerm(View(2, (e, I, 0), 1, I, 2, H), 0.5, u))
    gain(p, 4, [(0, I, ()), (3, E, ())] + [(2, 2 * I, (e,)) for e in range(E)], H)
    p.sums.append(SumTerm(View(3, (0, 0), 0, E, 1, H), 1.0, p.new_vec(H)))
    p.sums.append(SumTerm(View(5, (0, 0), 0, V, 1, H), -1.0, p.new_vec(H)))
    p.norms.append(NormTerm(View(0, (1, 0), 0, 3, 1, H, row_step=4), 1.0, p.new_vec(3)))  # rows 1, 5, 9
    acc = torch.float64 if fp64 else torch.float32
    s = R._structure(p, ts, None, False, acc, torch.device("cpu"))
    assert s.lines is not None and not s.rows, "every vector term here reads whole lines"
    assert len(s.lines.reductions) <= 2 * len(ts)
    d64 = [t.double() for t in ts]
    ys = [torch.randn(t.shape, generator=g).to(dtype) for t in ts]
    y64 = [t.double() for t in ys]
    rtol = 1e-12 if fp64 else 1e-5
    for got, want, scale in (
            (evaluate_reference(p, ts, fp64=fp64), _evaluate_looped(p, d64, None, True),
             _evaluate_looped(_abs_plan(p), [t.abs() for t in d64], None, True)),
            (bilinear_reference(p, ts, ys, fp64=fp64), _evaluate_looped(p, d64, y64, True),
             _evaluate_looped(_abs_plan(p), [t.abs() for t in d64], [t.abs() for t in y64], True))):
        assert got[0].dtype == acc
        _close(got[0], want[0], scale[0], rtol, f"vec {dtype} fp64={fp64}")
    # a tensor whose terms read under half of its lines is read through its views instead
    q = Plan()
    q.norms.append(NormTerm(View(0, (0, 0), 0, 2, 1, H), 1.0, q.new_vec(2)))
    sq = R._structure(q, ts, None, False, acc, torch.device("cpu"))
    assert sq.lines is None and len(sq.rows) == 1
    _close(evaluate_reference(q, ts, fp64=fp64)[0], _evaluate_looped(q, d64, None, True)[0],
           _evaluate_looped(q, [t.abs() for t in d64], None, True)[0], rtol, "partial")


@pytest.mark.parametrize("fp64", [False, True])
def test_drift_donate_forms_delta_in_the_olds(fp64):
    """``drift(..., donate=True)`` writes ``Delta = new - a old`` into the given olds (no second
    buffer) and takes ``B(a old, Delta) = B(new, Delta) - h(Delta)``: the pieces equal the undonated
    ones to rounding (1e-5 of the scale in fp32, 1e-12 in fp64); ``values=False`` skips ``h_new``.  Olds
    not in the accumulation dtype are not written (and the pieces are the undonated ones)."""
    from conserve.kernels import drift

    dt = torch.float64 if fp64 else torch.float32
    p, olds, news = drift_case(16, torch.float32, seed=7, vec_terms=True)
    olds, news = [o.to(dt) for o in olds], [n.to(dt) for n in news]
    p.sums.append(SumTerm(View(0, (0, 0), 0, 2 * 16, 1, 24), 1.0, p.new_vec(24)))  # a linear law too
    a = [0.9, 1.0, 0.95, 1.0, 0.7]
    want = drift(p, olds, news, a, backend="torch", fp64=fp64)
    mine = [o.clone() for o in olds]
    got = drift(p, mine, news, a, backend="torch", fp64=fp64, donate=True, values=False)
    assert got[0] is None
    af = [float(np.float32(x)) for x in a]
    for i, (o, n) in enumerate(zip(olds, news)):
        if o.numel():
            torch.testing.assert_close(mine[i], n - af[i] * o, rtol=0, atol=0)
    rtol = 1e-12 if fp64 else 1e-5
    o64 = [t.double() for t in olds]
    d64 = [t.double() for t in mine]
    sv, sg = _evaluate_looped(_abs_plan(p), [t.abs() for t in o64], [t.abs() for t in d64], True)
    for k in (1, 2, 3):
        _close(got[k][0], want[k][0], sv + 1e-30, rtol, f"{DRIFT_NAMES[k]} vec")
        for d in want[k][1]:
            _close(got[k][1][d], want[k][1][d], sg[d], rtol, f"{DRIFT_NAMES[k]} gram D={d}")
    if not fp64:  # fp32 olds with fp64 accumulation: not donated, nothing written
        keep = [o.clone() for o in olds]
        got = drift(p, keep, news, a, backend="torch", fp64=True, donate=True)
        assert all(torch.equal(k, o) for k, o in zip(keep, olds))
        ref = drift(p, olds, news, a, backend="torch", fp64=True)
        assert all(torch.equal(x[0], y[0]) for x, y in zip(got[1:], ref[1:]))


@pytest.mark.parametrize("backend,donate", [("torch", False), ("torch", True), ("triton", False)])
def test_drift_of_a_shifted_gain(backend, donate):
    """Gemma stores the gain as ``1 + w``: the law ``(w_c + 1)^2 - sum ||W[:, c]||^2`` drifts as
    ``[(a w + 1)^2 - (w + 1)^2] + 2 (a w + 1) Delta + Delta^2`` per entry: ``bil`` includes the shift on
    the old side, ``h_delta`` has none, and decay + 2 bil + h_delta is the measured change (float64)."""
    from conserve.kernels import drift

    g = torch.Generator().manual_seed(12)
    H, R = 6, 5
    olds = [randn(H, gen=g, dtype=torch.float64), randn(R, H, gen=g, dtype=torch.float64)]
    news = [o + 0.1 * torch.randn(o.shape, generator=g, dtype=torch.float64) for o in olds]
    p = Plan()
    gain(p, 0, [(1, R, ())], H, shift=1.0)
    a = [0.9, 0.95]
    got = drift(p, [o.clone() for o in olds], news, a, fp64=True, backend=backend, donate=donate)
    w, W = olds
    a = [float(np.float32(x)) for x in a]  # the kernels' factors (``drift_factors``)
    dw, dW = news[0] - a[0] * w, news[1] - a[1] * W
    want_bil = (a[0] * w + 1.0) * dw - (a[1] * W * dW).sum(0)
    want_hd = dw * dw - (dW * dW).sum(0)
    h = lambda w, W: (w + 1.0) ** 2 - (W * W).sum(0)  # noqa: E731
    torch.testing.assert_close(got[2][0], want_bil, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[3][0], want_hd, rtol=1e-12, atol=1e-14)
    total = got[1][0] + 2 * got[2][0] + got[3][0]
    torch.testing.assert_close(total, h(*news) - h(w, W), rtol=1e-10, atol=1e-13)


def test_drift_bad_input():
    from conserve.kernels import drift

    p, olds, news = drift_case(8, torch.float32, seed=1)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="one old per new"):
            drift(p, olds[:-1], news, 1.0, backend=backend)
        with pytest.raises(ValueError, match="one a per tensor"):
            drift(p, olds, news, [1.0, 0.9], backend=backend)
        with pytest.raises(ValueError, match="same tensor before and after"):
            drift(p, [olds[0][:, :3]] + olds[1:], news, 1.0, backend=backend)


def test_drift_through_fused_adamw_fp32():
    """FusedAdamW tracking a tiny GQA LM in fp32: the Triton path (DRIFT pass for the Gram laws) gives
    the torch twin's law values and first/second-order terms (same fp32 Delta; accumulation order
    differs); its decay ``(a^2-1) O O^T`` equals the float64 ``h(a old) - h(old)`` (the torch twin's fp32
    difference of two Grams cancels ~1e-4 relative here, so it is not the reference for decay)."""
    from conserve.kernels import drift_reference
    from conserve.models.lm import DecoderLM, LMConfig
    from conserve.optim import FusedAdamW

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=12)
    m1 = DecoderLM(cfg)
    m2 = DecoderLM(cfg)
    m2.load_state_dict(m1.state_dict())
    full = dict(drift_every=1, snapshot_budget=None, keep_last=True)  # every law on every step, terms kept
    o1 = FusedAdamW(m1.parameters(), lr=1e-2, weight_decay=0.1, track=m1, backend="triton", **full)
    o2 = FusedAdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, track=m2, backend="torch", **full)
    assert o1._fp.rest is not None and o1._fp.rest.grams
    x = torch.randint(0, 32, (1, 5))
    for _ in range(2):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            if o is o1:
                grads = [q.grad for q in m1.parameters()]
                olds1 = [t.detach().clone() for t in o1.tracker.tensors]  # theta_k of the last step
            else:
                for q, gq in zip(m2.parameters(), grads):
                    q.grad = None if gq is None else gq.clone()
            o.step()
    for key in ("first", "second"):
        a, b = o1.tracker.last[key], o2.tracker.last[key]
        for d in b.grams:
            scale = b.grams[d].abs().max().item()
            assert (a.grams[d] - b.grams[d]).abs().max().item() <= 1e-5 * scale, (key, d)
    ts = o1.tracker.tensors
    olds = [t.double() for t in olds1]
    _, (_, dec64), _, _ = drift_reference(o1._fp.rest, olds, [t.detach().double() for t in ts],
                                          float(np.float32(1 - 1e-2 * 0.1)), fp64=True)
    a, af = 1 - 1e-2 * 0.1, float(np.float32(1 - 1e-2 * 0.1))  # the terms are those of the exact a
    for d, g in dec64.items():
        g = g * ((a * a - 1) / (af * af - 1))  # (a^2-1) O O^T from the fp32-a reference (closed form)
        got = o1.tracker.last["decay"].grams[d]
        assert g.abs().max() > 0 and (got - g).abs().max().item() <= 1e-5 * g.abs().max().item(), d
    for d, g in o2.tracker.h.grams.items():
        assert (o1.tracker.h.grams[d] - g).abs().max().item() <= 1e-5 * g.abs().max().item(), d


def test_float64_inputs_stay_exact_in_fp64_mode():
    """fp64 mode on float64 tensors (the tracker's fp64 drift terms form Delta in float64): the Triton
    kernels read them as float64 -- no rounding through fp32 -- so Gram, norm and bilinear results
    equal the float64 reference to fp64 rounding; with fp32 accumulation they are rounded once."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(16, 40, dtype=torch.float64, generator=g) * (1 + 1e-9)
    y = torch.randn(16, 40, dtype=torch.float64, generator=g)
    p = Plan()
    s = p.new_gram(16)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 16, 1, 40), -0.7, s))
    i = p.new_vec(16)
    p.norms.append(NormTerm(View(0, (0, 0), 0, 16, 1, 40), 1.0, i))
    for got, want in ((evaluate(p, [x], fp64=True, backend="triton"), evaluate_reference(p, [x], fp64=True)),
                      (bilinear(p, [x], [y], fp64=True, backend="triton"),
                       bilinear_reference(p, [x], [y], fp64=True))):
        assert got[0].dtype == torch.float64
        for a, b in ((got[0], want[0]), (got[1][16], want[1][16])):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-14
    v32, g32 = evaluate(p, [x], fp64=False, backend="triton")
    rv, rg = evaluate_reference(p, [x], fp64=True)
    assert v32.dtype == torch.float32 and ((g32[16].double() - rg[16]).abs().max() / rg[16].abs().max()).item() < 1e-5


def test_gram_terms_sorted_by_layout_within_a_slot():
    """A slot mixing a general-stride view (layout 2), a row block (0) and a column block (1): the
    term table lists it as 0, 1, 2 and every item carries the boundaries ``ta``/``tb`` the kernel's
    per-layout loops use; the Triton result equals the float64 reference."""
    g = torch.Generator().manual_seed(22)
    w = randn(24, 40, gen=g)
    big = randn(64, 48, gen=g)
    p = Plan()
    s = p.new_gram(8)
    p.grams.append(GramTerm(View(2, (0, 0), 0, 8, 1, 30), 0.5, s))  # a transposed, strided tensor: layout 2
    p.grams.append(GramTerm(View(0, (0, 4), 1, 8, 0, 24), -1.0, s))  # columns of w: layout 1
    p.grams.append(GramTerm(View(1, (0, 0), 0, 8, 1, 20, row_step=3), 1.0, s))  # every 3rd row of big: layout 0
    ts = [w, big, randn(60, 50, gen=g).t()[::2]]
    st = L.build(p, ts, None, False, L.Tiles())
    (lch,) = st.gram[0].launches
    assert list(lch.terms[:, 4]) == [0, 1, 2]
    assert (lch.items[:, 6] == 1).all() and (lch.items[:, 7] == 2).all()
    vec, grams = evaluate(p, ts, backend="triton")
    rv, rg = evaluate_reference(p, [t.double() for t in ts], fp64=True)
    sv, sg = evaluate_reference(_abs_plan(p), [t.double().abs() for t in ts], fp64=True)
    _close(grams[8], rg[8], sg[8], 1e-5, "gram")


def test_drift_inputs_users_pass():
    """``a`` as a numpy scalar, ``None`` for a tensor the plan does not read (both backends agree), and
    an unreserved Gram slot named the same way by the torch twin as by the Triton path."""
    from conserve.kernels import drift, drift_reference

    g = torch.Generator().manual_seed(23)
    p = Plan()
    s = p.new_gram(4)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 4, 1, 8), 1.0, s))
    o = randn(4, 8, gen=g)
    n = o + 0.1 * randn(4, 8, gen=g)
    want = drift_reference(p, [o.double(), None], [n.double(), None], 0.9, fp64=True)
    for backend in ("torch", "triton"):
        got = drift(p, [o, None], [n, None], np.float32(0.9), backend=backend)
        check_drift(got, want, 1e-5, backend)
    bad = Plan()
    bad.grams.append(GramTerm(View(0, (0, 0), 0, 4, 1, 8), 1.0, 0))
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=r"not reserved with plan.new_gram\(4\)"):
            evaluate(bad, [o], backend=backend)


def test_work_tables_have_the_named_columns():
    """Every table the builders emit has the width ``tables.py`` names (the kernels index it by those
    names), and a row built by name must name every column."""
    from conserve.kernels import tables as TB

    p, ts = llama_block(seed=13)
    st = L.build(p, ts, None, False, L.Tiles())
    for b in st.gram:
        assert b.groups.shape[1] == TB.GRAM_GROUP.COLS
        for l in b.launches:
            assert l.terms.shape[1] == TB.GRAM_TERM.COLS and l.items.shape[1] == TB.GRAM_ITEM.COLS
            assert (l.terms[:, TB.GRAM_TERM.N] > 0).all()
    for l in st.norm:
        assert l.regions.shape[1] == TB.REGION.COLS and l.items.shape[1] == TB.NORM_ITEM.COLS
    assert st.finish.shape[1] == TB.FINISH_ROW.COLS and st.finish_blocks.shape[1] == TB.FINISH_BLOCK.COLS
    f, _ = L.launch_factors(st.gram[0].launches[0], [0.9] * len(ts))
    assert f.shape[1] == TB.FACTOR.COLS and np.allclose(f[:, TB.FACTOR.A], 0.9)
    with pytest.raises(KeyError, match="columns are"):
        TB.FACTOR.row(a=1.0)
