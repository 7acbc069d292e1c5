"""Fuzzing of conserve.kernels (evaluate / bilinear / drift, both backends; Triton under TRITON_INTERPRET=1)
against an independent float64 reference written here element by element from the math of
``shared/spec/laws.md`` (Gram ``sign X X^T``, norms ``sign sum (x+shift)^2``, sums, bilinear
``sign (X Y^T + Y X^T)/2``, the drift identity ``h(new) = a^2 h(old) + 2a B(old, Delta) + h(Delta)``).
Shapes are tiny (the interpreter is slow)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conserve.kernels import GramTerm, NormTerm, Plan, SumTerm, View, bilinear, check_sums, drift, evaluate

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"
BACKENDS = ("triton", "torch")


def _view64(v: View, t: torch.Tensor) -> torch.Tensor:
    """The view's entries read one by one by logical index (no strides, no resolve)."""
    t = t.detach().double()
    out = torch.zeros(v.rows, v.cols, dtype=torch.float64)
    for r in range(v.rows):
        for c in range(v.cols):
            i = list(v.start)
            i[v.row_dim] += r * v.row_step
            if v.col_dim is not None:
                i[v.col_dim] += c
            out[r, c] = t[tuple(i)]
    return out


def ref(plan: Plan, xs, ys=None):
    """float64 ``h(xs)`` (``ys`` None) or ``B(xs, ys)`` of ``plan``: ``(vec, {D: grams})``."""
    vec = torch.zeros(plan.vec_size, dtype=torch.float64)
    grams = {d: torch.zeros(n, d, d, dtype=torch.float64) for d, n in plan.gram_slots.items()}
    for g in plan.grams:
        X = _view64(g.view, xs[g.view.tensor])
        Y = X if ys is None else _view64(g.view, ys[g.view.tensor])
        grams[g.view.rows][g.slot] += g.sign * (X @ Y.T + Y @ X.T) / 2
    for n in plan.norms:
        X = _view64(n.view, xs[n.view.tensor]) + n.shift
        Y = X if ys is None else _view64(n.view, ys[n.view.tensor]) + n.shift
        for r, s in enumerate((X * Y).sum(1)):
            vec[n.index + r * n.index_stride] += n.sign * s
    if ys is None:
        for s in plan.sums:
            for c, x in enumerate(_view64(s.view, xs[s.view.tensor]).sum(0)):
                vec[s.index + c] += s.sign * x
    return vec, grams


def _abs(plan: Plan) -> Plan:
    """The plan with |sign| (its reference on |x| bounds every entry's terms: no cancellation hides errors)."""
    def a(t):
        return type(t)(**{**t.__dict__, "sign": abs(t.sign)})
    return Plan([a(t) for t in plan.grams], [a(t) for t in plan.norms], [a(t) for t in plan.sums],
                plan.vec_size, dict(plan.gram_slots))


def close(got, want, scale, rtol, what):
    pairs = [("vec", got[0], want[0], scale[0])] + [(f"D={d}", got[1][d], want[1][d], scale[1][d]) for d in want[1]]
    assert sorted(got[1]) == sorted(want[1]), what
    for part, g, w, s in pairs:
        assert g.shape == w.shape, (what, part)
        err = (g.double() - w).abs()
        assert not (err > rtol * s + 1e-30).any(), f"{what} {part}: max err {err.max():.3e}, scale {s.max():.3e}"


def test_non_float_tensors_are_refused_on_both_backends():
    """A complex weight lost its imaginary part silently in the torch twin (a UserWarning only) and the
    Triton path died in a KeyError; an integer tensor crashed the interpreter's dot.  Both backends now
    raise the same one-line ValueError naming the fix, for evaluate, bilinear and drift."""
    p = Plan()
    s = p.new_gram(3)
    p.grams.append(GramTerm(View(0, (0, 0), 0, 3, 1, 4), 1.0, s))
    good = torch.randn(3, 4)
    for bad in (torch.randn(3, 4, dtype=torch.complex64), torch.ones(3, 4, dtype=torch.int64),
                torch.ones(3, 4, dtype=torch.bool)):
        for be in BACKENDS:
            with pytest.raises(ValueError, match="real float weights"):
                evaluate(p, [bad], backend=be)
            with pytest.raises(ValueError, match="real float weights"):
                bilinear(p, [good], [bad], backend=be)
            with pytest.raises(ValueError, match="real float weights"):
                drift(p, [good], [bad], 0.9, backend=be)


# ------------------------------------------------------------------------- evaluate / bilinear / drift
def _plan(D: int, H: int) -> Plan:
    """Fused [Q|K|V] rows in tensor 0 (one tensor read by several Gram slots), O columns in tensor 1:
    QK and VO Gram laws, unit norms over rows, gain-style column norms, a row-sum."""
    p = Plan()
    s, t = p.new_gram(D), p.new_gram(D)
    p.grams += [GramTerm(View(0, (0, 0), 0, D, 1, H), 1.0, s), GramTerm(View(0, (D, 0), 0, D, 1, H), -1.0, s),
                GramTerm(View(0, (2 * D, 0), 0, D, 1, H), 1.0, t), GramTerm(View(1, (0, 0), 1, D, 0, H), -0.5, t)]
    u = p.new_vec(D)
    p.norms += [NormTerm(View(0, (0, 0), 0, D, 1, H), 1.0, u), NormTerm(View(1, (0, 0), 1, D, 0, H), -1.0, u)]
    c = p.new_vec(H)
    p.norms += [NormTerm(View(0, (0, 0), 1, H, 0, 3 * D), -1.0, c), NormTerm(View(1, (0, 0), 0, H, 1, D), 2.0, c)]
    p.sums += [SumTerm(View(0, (0, 0), 0, 3 * D, 1, H), 1.0, p.new_vec(H))]
    return p


def _layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in another storage: transposed, column-strided, at a storage offset, or as is."""
    if kind == "transposed":
        return x.t().contiguous().t()
    if kind == "strided":
        y = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
        y[:, 1::2] = x
        return y[:, 1::2]
    if kind == "offset":
        y = torch.empty(x.numel() + 7, dtype=x.dtype)
        y[7:] = x.reshape(-1)
        return y[7:].view(x.shape)
    return x


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(D=st.sampled_from([1, 3, 5, 7, 12, 24]), H=st.sampled_from([1, 2, 5, 33]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       kind=st.sampled_from(["contig", "transposed", "strided", "offset"]), fp64=st.booleans(),
       a=st.sampled_from([1.0, 0.9, (0.75, 1.0)]), seed=st.integers(0, 2**16))
def test_fuzz_evaluate_bilinear_drift_vs_float64(D, H, dtype, kind, fp64, a, seed):
    """Head dims below 16 and not powers of two, single rows / columns, strided / transposed / offset
    storage, every input dtype, fp32 and fp64 accumulation, a == 1 exactly (decay exactly 0) and a != 1:
    both backends agree with the element-by-element float64 reference (entrywise scale of |terms|)."""
    g = torch.Generator().manual_seed(seed)
    p, ap = _plan(D, H), None
    ap = _abs(p)
    olds = [torch.randn(3 * D, H, generator=g).to(dtype), torch.randn(H, D, generator=g).to(dtype)]
    news = [_layout((o.double() + 0.1 * torch.randn(o.shape, generator=g, dtype=torch.float64)).to(dtype), kind)
            for o in olds]
    olds = [_layout(o, kind if i == 0 else "contig") for i, o in enumerate(olds)]
    rtol = 1e-12 if fp64 else (1e-5 if dtype in (torch.float32, torch.float64) else 1e-4)
    af = [float(torch.tensor(x, dtype=torch.float32)) for x in (a if isinstance(a, tuple) else (a, a))]
    o64, n64 = [t.double() for t in olds], [t.double() for t in news]
    ao = [o * x for o, x in zip(o64, af)]
    dl = [n - x for n, x in zip(n64, ao)]
    dl_abs = [n.abs() + x.abs() for n, x in zip(n64, ao)]
    h_o, h_ao = ref(p, o64), ref(p, ao)
    want = [ref(p, n64), (h_ao[0] - h_o[0], {d: h_ao[1][d] - h_o[1][d] for d in h_o[1]}), ref(p, ao, dl), ref(p, dl)]
    abs64 = [t.abs() for t in o64]
    scale = [ref(ap, [t.abs() for t in n64]), ref(ap, abs64), ref(ap, [t.abs() for t in ao], dl_abs), ref(ap, dl_abs)]
    for be in BACKENDS:
        close(evaluate(p, news, fp64=fp64, backend=be), want[0], scale[0], rtol, f"{be} evaluate")
        close(bilinear(p, ao if fp64 or dtype == torch.float64 else [x.float() for x in ao], dl, fp64=fp64,
                       backend=be), want[2], scale[2], max(rtol, 1e-5), f"{be} bilinear")
        a_arg = list(a) if isinstance(a, tuple) else a
        got = drift(p, olds, news, a_arg, fp64=fp64, backend=be)
        for k, name in enumerate(("h_new", "decay", "bil", "h_delta")):
            close(got[k], want[k], scale[k], rtol if k != 1 else max(rtol, 1e-6), f"{be} drift {name}")
        if a == 1.0:
            assert (got[1][0] == 0).all() and all((x == 0).all() for x in got[1][1].values()), be


def check_ref(plan: Plan, xs, ys):
    """float64 sums of the gradient check (``kernels.checksums``) read element by element: per vec entry
    ``[p, nh2, ng2]`` (NormTerm: ``2 s sum (x+c) y``, ``4 s^2 sum (x+c)^2``, ``sum y^2``; SumTerm: ``s sum y``,
    ``sum y^2``) and per Gram slot ``[sum_t s (X Y^T + Y X^T) / 2, diag(sum_t s^2 ||X[a]||^2), diag(sum_t ||Y[a]||^2)]``."""
    vec = torch.zeros(3, plan.vec_size, dtype=torch.float64)
    grams = {d: torch.zeros(3, n, d, d, dtype=torch.float64) for d, n in plan.gram_slots.items()}
    for g in plan.grams:
        X, Y = _view64(g.view, xs[g.view.tensor]), _view64(g.view, ys[g.view.tensor])
        out = grams[g.view.rows][:, g.slot]
        out[0] += g.sign * (X @ Y.T + Y @ X.T) / 2
        out[1] += torch.diag(g.sign ** 2 * (X * X).sum(1))
        out[2] += torch.diag((Y * Y).sum(1))
    for n in plan.norms:
        X, Y = _view64(n.view, xs[n.view.tensor]) + n.shift, _view64(n.view, ys[n.view.tensor])
        for r in range(n.view.rows):
            o = n.index + r * n.index_stride
            vec[:, o] += torch.stack([2 * n.sign * (X[r] * Y[r]).sum(), 4 * n.sign ** 2 * (X[r] * X[r]).sum(),
                                      (Y[r] * Y[r]).sum()])
    for t in plan.sums:
        Y = _view64(t.view, ys[t.view.tensor])
        for c in range(t.view.cols):
            vec[0, t.index + c] += t.sign * Y[:, c].sum()
            vec[2, t.index + c] += (Y[:, c] * Y[:, c]).sum()
    return vec, grams


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(D=st.sampled_from([1, 3, 5, 7, 12, 24]), H=st.sampled_from([1, 2, 5, 33]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       kind=st.sampled_from(["contig", "transposed", "strided", "offset"]), fp64=st.booleans(),
       shift=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**16))
def test_fuzz_check_sums_vs_float64(D, H, dtype, kind, fp64, shift, seed):
    """The gradient check's one pass (Triton) and its twin against the element-by-element float64 sums, on the
    fused [Q|K|V] plan with a Gemma-style shifted gain: a tensor read by rows, columns and Gram slots at once."""
    g = torch.Generator().manual_seed(seed)
    p = _plan(D, H)
    gain = p.new_vec(H)
    p.norms.append(NormTerm(View(2, (0,), 0, H, None, 1), 1.0, gain, 1, shift))
    xs = [torch.randn(3 * D, H, generator=g).to(dtype), torch.randn(H, D, generator=g).to(dtype),
          torch.randn(H, generator=g).to(dtype)]
    ys = [_layout(torch.randn(x.shape, generator=g).to(dtype), kind) if x.dim() == 2 else
          torch.randn(x.shape, generator=g).to(dtype) for x in xs]
    xs = [_layout(x, kind) if i == 0 else x for i, x in enumerate(xs)]
    x64, y64 = [t.double() for t in xs], [t.double() for t in ys]
    want = check_ref(p, x64, y64)
    scale = check_ref(_abs(p), [t.abs() for t in x64], [t.abs() for t in y64])
    rtol = 1e-12 if fp64 else (1e-5 if dtype in (torch.float32, torch.float64) else 1e-4)
    for be in BACKENDS:
        vec, grams = check_sums(p, xs, ys, fp64=fp64, backend=be)
        close((vec, grams), want, scale, rtol, f"{be} check_sums")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_inputs_propagate_never_masked(bad):
    """A NaN / Inf weight (old, new, or the y of bilinear) makes exactly the entries that read it
    non-finite, on both backends (no mask, no clamp, no neighbour polluted)."""
    p = _plan(3, 5)
    g = torch.Generator().manual_seed(1)
    olds = [torch.randn(9, 5, generator=g), torch.randn(5, 3, generator=g)]
    news = [o + 0.1 for o in olds]
    for where in ("old", "new"):
        o, n = [t.clone() for t in olds], [t.clone() for t in news]
        (o if where == "old" else n)[0][4, 2] = bad
        a = float(torch.tensor(0.9, dtype=torch.float32))
        o64, n64 = [t.double() for t in o], [t.double() for t in n]
        ao = [t * a for t in o64]
        dl = [x - y for x, y in zip(n64, ao)]
        h_o, h_ao = ref(p, o64), ref(p, ao)
        want = [ref(p, n64), (h_ao[0] - h_o[0], {d: h_ao[1][d] - h_o[1][d] for d in h_o[1]}), ref(p, ao, dl), ref(p, dl)]
        assert any(not torch.isfinite(w[0]).all() for w in want)
        for be in BACKENDS:
            got = list(drift(p, o, n, 0.9, backend=be)) + [bilinear(p, o, n, backend=be)]
            for k, (gk, wk) in enumerate(zip(got, want + [ref(p, o64, n64)])):
                assert torch.equal(torch.isfinite(gk[0]), torch.isfinite(wk[0])), (where, be, k)
                for d in wk[1]:
                    assert torch.equal(torch.isfinite(gk[1][d]), torch.isfinite(wk[1][d])), (where, be, k, d)


# ------------------------------------------------------------------------------ fused optimizer step
def _my_stats(old, new, a, req, n, bound=False):
    """float64 stats from the math of optim_step's docstring: Q ``[new^2, a old Delta, Delta^2, (a^2-1) old^2]``,
    L ``[new, Delta, 0, (a-1) old]``, summed over each row's columns / each column's rows.  ``bound``:
    the same with |.| everywhere and |Delta| <= |new| + |a old| (an entrywise scale)."""
    from conserve.kernels import optim_step as K

    S = torch.zeros(K.NQ, n, dtype=torch.float64)
    B, R, C = K.matrix_shape(new.shape)
    o, w = old.double().reshape(B, R, C), new.double().reshape(B, R, C)
    if bound:
        o, w, a = o.abs(), w.abs(), abs(a)
    d = w + a * o if bound else w - a * o
    q = torch.stack([w * w, a * o * d, d * d, (a * a - 1) * o * o])
    lin = torch.stack([w, d, torch.zeros_like(d), (a - 1) * o])
    if bound:
        q, lin = q.abs(), lin.abs()
    for slot, x, axis, m in ((req.row_q, q, -1, B * R), (req.row_l, lin, -1, B * R), (req.col_q, q, -2, B * C),
                             (req.col_l, lin, -2, B * C)):
        if slot >= 0:
            S[:, slot:slot + m] = x.sum(axis).reshape(K.NQ, -1)
    return S


def _torch_optim(h, p, g, m, v, step, fresh):
    """One step of torch.optim itself (single-tensor loops) on copies: (param, buf1, buf2)."""
    p = p.clone().requires_grad_()
    p.grad = g.clone()
    if h.algo == "adam":
        cls = torch.optim.AdamW if h.decoupled else torch.optim.Adam
        o = cls([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay, maximize=h.maximize,
                foreach=False)
        o.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        o.step()
        return p.detach(), o.state[p]["exp_avg"], o.state[p]["exp_avg_sq"]
    o = torch.optim.SGD([p], lr=h.lr, momentum=h.momentum, dampening=h.dampening, nesterov=h.nesterov,
                        weight_decay=h.weight_decay, maximize=h.maximize, foreach=False)
    if h.momentum and not fresh:
        o.state[p] = {"momentum_buffer": m.clone()}
    o.step()
    return p.detach(), o.state[p].get("momentum_buffer"), None


HYPERS = [dict(algo="adam", lr=1e-2, weight_decay=0.1), dict(algo="adam", lr=1e-2, weight_decay=0.1, decoupled=False),
          dict(algo="adam", lr=1e-2, maximize=True), dict(algo="sgd", lr=0.1), dict(algo="sgd", lr=0.1, weight_decay=0.3),
          dict(algo="sgd", lr=0.1, momentum=0.9, weight_decay=0.1), dict(algo="sgd", lr=0.1, momentum=0.9, nesterov=True),
          dict(algo="sgd", lr=0.1, momentum=0.9, dampening=0.5, maximize=True)]
SHAPES = [[(1, 1), (1, 5), (5, 1), (), (3,)], [(3, 0), (0,), (2, 1, 3)], [(7, 33), (2, 3, 17), (70,)]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=st.sampled_from(HYPERS), shapes=st.sampled_from(SHAPES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), fp64=st.booleans(), fresh=st.booleans(),
       picks=st.lists(st.tuples(*[st.booleans()] * 4), min_size=5, max_size=5), seed=st.integers(0, 2**16))
def test_fuzz_step_triton_vs_torch_optim_and_float64_stats(hyper, shapes, dtype, fp64, fresh, picks, seed):
    """``step_triton`` (interpreter) on single rows / columns / scalars / empty / 3-D tensors: the update
    equals torch.optim's own step (AdamW, Adam with L2, SGD +- momentum / nesterov / dampening /
    maximize, a fresh momentum buffer) and every requested row / column statistic equals the float64
    statistic computed here from old and new weights."""
    from conserve.kernels import optim_step as K

    h = K.Hyper(**hyper)
    fresh = fresh and h.algo == "sgd" and h.momentum != 0
    g = torch.Generator().manual_seed(seed)
    reqs, n = [], 0
    for s, (rq, rl, cq, cl) in zip(shapes, picks):
        B, R, C = K.matrix_shape(s)
        r = K.StatsRequest()
        for name, on, m in (("row_q", rq, B * R), ("row_l", rl, B * R), ("col_q", cq, B * C), ("col_l", cl, B * C)):
            if on:
                setattr(r, name, n)
                n += m
        reqs.append(r)
    P = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    G = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    M = [(0.1 * torch.randn(s, generator=g)).to(dtype) for s in shapes]
    V = [(0.1 * torch.rand(s, generator=g)).to(dtype) for s in shapes]
    use1, use2 = h.algo == "adam" or h.momentum != 0, h.algo == "adam"
    old, M0, V0 = [p.clone() for p in P], [m.clone() for m in M], [v.clone() for v in V]
    S = torch.zeros(K.NQ, n, dtype=torch.float64 if fp64 else torch.float32)
    none = [None] * len(P)
    K.step_triton(h, P, G, M if use1 else none, V if use2 else none, [3.0] * len(P), reqs, S,
                  fresh=[fresh] * len(P), interpret=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for i in range(len(P)):
        wp, wm, _ = _torch_optim(h, old[i], G[i], M0[i], V0[i], 3, fresh)
        if wp.numel():
            assert (P[i].float() - wp.float()).abs().max() <= tol * (1 + wp.float().abs().max()), (i, "param")
            if use1:
                assert (M[i].float() - wm.float()).abs().max() <= tol * (1 + wm.float().abs().max()), (i, "buf1")
    want = sum((_my_stats(o, p, h.a, r, n) for o, p, r in zip(old, P, reqs)), torch.zeros(K.NQ, n, dtype=torch.float64))
    scale = sum((_my_stats(o, p, h.a, r, n, True) for o, p, r in zip(old, P, reqs)),
                torch.zeros(K.NQ, n, dtype=torch.float64))
    err = (S.double() - want).abs()
    assert not (err > (1e-12 if fp64 else 1e-5) * scale + 1e-30).any(), err.max()


def test_step_triton_refuses_tensors_the_kernel_would_misread():
    """``step_triton`` used to read a transposed param / grad as contiguous (wrong update, silently), an
    fp64 grad as fp32 bits (garbage, and past the end of the storage) and to write stats slots past the
    end of a too-small ``stats`` buffer.  Now each raises a ValueError naming the fix, before anything
    is written (the params stay as they were)."""
    from conserve.kernels import optim_step as K

    h = K.Hyper("sgd", lr=0.1)
    p = torch.randn(3, 4)
    keep = p.clone()
    cases = [([torch.randn(4, 3).t()], [torch.randn(3, 4)]), ([p], [torch.randn(4, 3).t()]),
             ([p], [torch.randn(3, 4, dtype=torch.float64)]), ([p], [torch.randn(4, 3)]),
             ([p.double()], [torch.randn(3, 4, dtype=torch.float64)])]
    for P, G in cases:
        with pytest.raises(ValueError, match="step_triton"):
            K.step_triton(h, P, G, [None], [None], [1.0], [K.StatsRequest()], None, interpret=True)
    req = K.StatsRequest(row_q=0, col_q=3)  # needs 3 + 4 = 7 columns
    for S in (torch.zeros(K.NQ, 6), torch.zeros(K.NQ, 7, dtype=torch.float16), torch.zeros(2, 7),
              torch.zeros(7, K.NQ).t()):
        with pytest.raises(ValueError, match="step_triton: .*stats"):
            K.step_triton(h, [p], [torch.randn(3, 4)], [None], [None], [1.0], [req], S, interpret=True)
    assert torch.equal(p, keep)
    S = torch.zeros(K.NQ, 7)
    K.step_triton(h, [p], [torch.zeros(3, 4)], [None], [None], [1.0], [req], S, interpret=True)  # fits: runs
    assert torch.allclose(S[0, :3].double(), keep.double().pow(2).sum(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_step_stats_reference_keeps_torch_bits_for_transposed_low_precision_weights(dtype):
    """The twin's drift step runs in blocks of whole rows; for a bf16 / fp16 weight it must split where
    torch's whole-tensor vector loop does, which is memory order.  A transposed (70, 40) bf16 weight and
    grad (rows not contiguous) split into row blocks of CHUNK_MIN elements came out 1 ulp off
    ``step_reference`` on the very same tensor layout; it is now stepped whole: same bits, and its
    statistics still equal the float64 ones."""
    from conserve.kernels import optim_step as K

    g = torch.Generator().manual_seed(1)
    h = K.Hyper("sgd", lr=0.1, weight_decay=0.3)
    B, R, C = 1, 70, 40
    p = torch.randn(R, C, generator=g).to(dtype).t().contiguous().t()
    grad = torch.randn(R, C, generator=g).to(dtype).t().contiguous().t()
    want, old = p.clone(), p.clone()
    assert want.stride() == p.stride()
    K.step_reference(h, [want], [grad], [None], [None], [1.0])
    r = K.StatsRequest(0, B * R, 2 * B * R, 2 * B * R + B * C)
    n = 2 * B * R + 2 * B * C
    S = torch.zeros(K.NQ, n, dtype=torch.float64)
    K.step_stats_reference(h, p, grad, None, None, 1.0, False, r, S, drift=True, bound=K.CHUNK_MIN)
    assert torch.equal(p, want)
    err = (S - _my_stats(old, p, h.a, r, n)).abs()
    assert not (err > 1e-12 * _my_stats(old, p, h.a, r, n, True) + 1e-30).any()


def test_negative_view_steps_are_refused_on_both_backends():
    """``View.resolve`` bounds-checked only the last row, so a negative ``row_step`` whose start row lies
    past the tensor (start 7 of 6 rows, step -3: last row 1) passed and the Triton path read outside the
    tensor, while the torch twin died in ``as_strided``.  Negative steps / sizes now raise one ValueError
    on both backends; ``row_step=0`` (one row repeated) stays allowed and exact."""
    x = torch.randn(6, 5)
    for start, step in (((7, 0), -3), ((5, 0), -1)):
        p = Plan()
        p.grams.append(GramTerm(View(0, start, 0, 3, 1, 5, step), 1.0, p.new_gram(3)))
        for be in BACKENDS:
            with pytest.raises(ValueError, match="negative row_step"):
                evaluate(p, [x], backend=be)
    p = Plan()
    p.grams.append(GramTerm(View(0, (2, 0), 0, 3, 1, 5, 0), 1.0, p.new_gram(3)))
    p.norms.append(NormTerm(View(0, (2, 0), 0, 3, 1, 5, 0), 1.0, p.new_vec(3)))
    for be in BACKENDS:
        got = evaluate(p, [x], backend=be)
        close(got, ref(p, [x]), ref(_abs(p), [x.abs()]), 1e-5, be)


def test_views_the_backends_read_differently_are_refused():
    """``col_dim=None`` (a single column) with ``cols=3``: Triton repeated the column three times, the
    torch twin read it once (different laws from one plan); a ``row_dim`` the tensor lacks raised a bare
    IndexError.  Both are now one ValueError on both backends; ``row_dim == col_dim`` (an overlapping
    Hankel-style view) is read alike by both and stays allowed."""
    x, b = torch.randn(6, 5), torch.randn(6)
    for v, t, msg in ((View(0, (1,), 0, 4, None, 3), b, "use cols=1"), (View(0, (0, 0), 2, 3, 1, 5), x, "dimension")):
        p = Plan()
        p.norms.append(NormTerm(v, 1.0, p.new_vec(v.rows)))
        p.sums.append(SumTerm(v, 1.0, p.new_vec(v.cols)))
        for be in BACKENDS:
            with pytest.raises(ValueError, match=msg):
                evaluate(p, [t], backend=be)
    v = View(0, (0, 0), 0, 3, 0, 3)
    p = Plan()
    p.grams.append(GramTerm(v, 1.0, p.new_gram(3)))
    p.norms.append(NormTerm(v, -1.0, p.new_vec(3)))
    p.sums.append(SumTerm(v, 1.0, p.new_vec(3)))
    for be in BACKENDS:
        close(evaluate(p, [x], backend=be), ref(p, [x]), ref(_abs(p), [x.abs()]), 1e-5, be)
