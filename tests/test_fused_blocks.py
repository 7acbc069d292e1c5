"""The torch twin of the fused step in row blocks (``kernels.optim_step.step_stats_reference``) and the
memory of a CPU ``FusedAdamW`` step.

References: the whole-tensor update (``step_reference``) and statistics (``stats_reference`` with one
block), bit for bit for the weights and optimizer state, to fp32 rounding (float64: 1e-12) for the
statistics; ``torch.optim.AdamW``'s own step for the storages a step may create; the expanded
``(NQ, P)`` coefficient table and a 2-d ``index_add_`` for the fold of a tensor's lines into the entries.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch

from bench.track_overhead import LiveBytes as _Storages  # the bench's storage counter (``sizes``)
from conserve.kernels import optim_step as K
from conserve.kernels import step_twin
from conserve.models import MLP
from conserve.models.lm import DecoderLM, LMConfig
from conserve.optim import FusedAdamW, FusedSGD
from test_fused_optim import _requests

# (shape, transposed): several blocks of whole batch entries, of rows, of columns of one row (a row
# longer than the bound), a scalar, and a transposed (non-contiguous) parameter
SHAPES = [((6, 4, 3), False), ((7, 5), False), ((3, 37), False), ((40,), False), ((), False), ((9, 6), True)]
HYPERS = {
    "adamw": K.Hyper("adam", lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9),
    "adam_l2_maximize": K.Hyper("adam", lr=1e-2, weight_decay=0.05, decoupled=False, maximize=True),
    "sgd_momentum_wd": K.Hyper("sgd", lr=0.05, weight_decay=0.1, momentum=0.9, dampening=0.2),
    "sgd_nesterov": K.Hyper("sgd", lr=0.05, momentum=0.8, nesterov=True),
    "sgd_plain_wd": K.Hyper("sgd", lr=0.1, weight_decay=0.3),
}


def _tensor(shape, transposed, g, scale=1.0):
    t = torch.randn(shape, generator=g) * scale
    return t.t().contiguous().t() if transposed else t



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(HYPERS))
def test_blocks_equal_whole_tensor_step(name, dtype):
    """A drift step in blocks of 8 elements == the whole-tensor update (bit for bit: weights, exp_avg,
    exp_avg_sq / momentum buffer, fresh or not) and its statistics (fp32 rounding; float64 1e-12)."""
    h, bound = HYPERS[name], 8
    g = torch.Generator().manual_seed(1)
    shapes = [s for s, _ in SHAPES]
    reqs, n = _requests(shapes)
    for s in shapes:  # the blocks really split: batch entries, rows, columns of one row
        assert len(list(step_twin._blocks(*K.matrix_shape(s), bound))) > (0 if s == () else 1), s
    P = [_tensor(s, tr, g).to(dtype) for s, tr in SHAPES]
    G = [_tensor(s, tr, g).to(dtype) for s, tr in SHAPES]
    M = [_tensor(s, tr, g, 0.1).to(dtype) for s, tr in SHAPES]
    V = [_tensor(s, tr, g, 0.1).to(dtype).abs() for s, tr in SHAPES]
    if h.algo == "sgd" and h.momentum == 0:
        M = V = [None] * len(P)
    if h.algo == "sgd":
        V = [None] * len(P)
    assert not P[-1].is_contiguous()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for fresh in ([False] if h.algo == "adam" or h.momentum == 0 else [True, False]):
        P2, M2, V2 = ([None if t is None else t.clone(memory_format=torch.preserve_format) for t in ts]
                      for ts in (P, M, V))
        S, S2 = torch.zeros(K.NQ, n, dtype=acc), torch.zeros(K.NQ, n, dtype=acc)
        scratch = (torch.empty(bound, dtype=dtype), torch.empty(bound, dtype=acc))
        for i, r in enumerate(reqs):
            K.step_stats_reference(h, P[i], G[i], M[i], V[i], 3.0, fresh, r, S, drift=True, bound=bound,
                                   scratch=scratch)
            old = P2[i].clone()
            K.step_reference(h, [P2[i]], [G[i]], [M2[i]], [V2[i]], [3.0], first=[fresh])
            K.stats_reference(old, P2[i], h.a, r, S2, bound=P2[i].numel())  # one block: the whole tensor
        for a, b in zip(P + M + V, P2 + M2 + V2):
            if a is not None:
                assert torch.equal(a, b) and a.stride() == b.stride()
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(S, S2, rtol=tol, atol=tol * S2.abs().max().item())
        assert S[1:].abs().sum() > 0 and (S[2] != 0).any()


@pytest.mark.parametrize("name", ["adamw", "adam_l2_maximize", "sgd_momentum_wd"])
def test_blocks_bf16_aligned(name):
    """bf16: blocks that start at multiples of 64 elements keep the whole-tensor bits; a shape whose
    blocks cannot (odd columns) is stepped whole (the same bits)."""
    h = HYPERS[name]
    g = torch.Generator().manual_seed(4)
    for shape, bound, blocked in (((40, 64), 128, True), ((3, 20, 32), 256, True), ((41, 33), 100, False)):
        B, R, C = K.matrix_shape(shape)
        assert step_twin._starts_aligned(B, R, C, bound) == blocked and len(list(step_twin._blocks(B, R, C, bound))) > 1
        P, G, M = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(3))
        V = torch.rand(shape, generator=g).to(torch.bfloat16) if h.algo == "adam" else None
        P2, M2, V2 = P.clone(), M.clone(), None if V is None else V.clone()
        r = K.StatsRequest(row_q=0, col_q=B * R)
        S, S2 = torch.zeros(K.NQ, B * R + B * C), torch.zeros(K.NQ, B * R + B * C)
        K.step_stats_reference(h, P, G, M, V, 2.0, False, r, S, drift=True, bound=bound)
        old = P2.clone()
        K.step_reference(h, [P2], [G], [M2], [V2], [2.0])
        K.stats_reference(old, P2, h.a, r, S2, bound=P2.numel())
        assert torch.equal(P, P2) and torch.equal(M, M2) and (V is None or torch.equal(V, V2))
        torch.testing.assert_close(S, S2, rtol=1e-5, atol=1e-5 * S2.abs().max().item())


def test_blocks_row_sums_exact_and_alignment():
    """Blocks of whole rows give the whole-tensor row statistics bit for bit; the row counts of a
    block make it a multiple of 64 elements when the shape allows (torch's vector loops split there)."""
    assert [b[3] for b in step_twin._blocks(1, 1000, 7, 1000)][:2] == [128, 128]  # 142 rows -> 128 (x 7 = 896)
    assert [b[1] for b in step_twin._blocks(100, 3, 5, 1000)][:2] == [64, 36]  # 66 entries of 15 -> 64 (960 elements)
    g = torch.Generator().manual_seed(2)
    h = HYPERS["adamw"]
    p, gr, m, v = (torch.randn(300, 33, generator=g) for _ in range(4))
    v = v.abs()
    r = K.StatsRequest(row_q=0, row_l=300)
    p2 = p.clone()
    S, S2 = torch.zeros(K.NQ, 600), torch.zeros(K.NQ, 600)
    K.step_stats_reference(h, p, gr, m.clone(), v.clone(), 2.0, False, r, S, drift=True, bound=500)
    old = p2.clone()
    K.step_reference(h, [p2], [gr], [m.clone()], [v.clone()], [2.0])
    K.stats_reference(old, p2, h.a, r, S2, bound=p2.numel())
    assert torch.equal(p, p2) and torch.equal(S, S2)


def lm(seed=0):
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=24))


def _grads(model, k):
    g = torch.Generator().manual_seed(100 + k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype) * 1e-2


def _line_scale(tensors):
    """The largest row or column sum of squares: the size of the statistics a law entry sums with signs."""
    out = 0.0
    for t in tensors:
        x = t.detach().double().reshape(K.matrix_shape(t.shape))
        out = max(out, x.square().sum(2).max().item(), x.square().sum(1).max().item())
    return out


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("cls,kw", [(FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (FusedSGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01))])
def test_fused_optimizer_blocks_equal_whole(cls, kw, fp64):
    """A tracked LM (row/column statistics, Gram laws, weight decay, a transposed weight) stepped with
    blocks of 16 elements == with one block per tensor: the same weights and state bits (and torch.optim's), and
    the same law rows to the rounding of the statistics (fp32: 1e-6, fp64: 1e-13 of the largest line
    sum of squares), over drift and non-drift steps."""
    m1 = lm()
    m2, m3 = copy.deepcopy(m1), copy.deepcopy(m1)
    for m in (m1, m2, m3):  # one weight laid out transposed (a non-contiguous parameter: strided blocks)
        w = m.layers[0].mlp.down_proj.weight
        w.data = w.data.t().contiguous().t()
        assert not w.is_contiguous()
    o1 = cls(m1.parameters(), **kw, track=m1, drift_every=2, snapshot_budget=None, keep_last=True, fp64=fp64)
    o2 = cls(m2.parameters(), **kw, track=m2, drift_every=2, snapshot_budget=None, keep_last=True, fp64=fp64)
    o3 = (torch.optim.AdamW if cls is FusedAdamW else torch.optim.SGD)(m3.parameters(), **kw)
    o1._chunk, o2._chunk = 16, 1 << 30
    assert max(p.numel() for p in m1.parameters()) > 16 * 8
    for k in range(4):
        for m in (m1, m2, m3):
            _grads(m, k)
        o1.step(), o2.step(), o3.step()
        for a, b, c in zip(m1.parameters(), m2.parameters(), m3.parameters()):
            assert torch.equal(a, b) and torch.equal(a, c)
        s = (1e-13 if fp64 else 1e-6) * _line_scale(o2.tracker.tensors)
        for key in ("measured", "decay", "first", "second"):
            x, y = o1.tracker.last.get(key), o2.tracker.last.get(key)
            if x is None:
                assert y is None
                continue
            torch.testing.assert_close(x.vec, y.vec, rtol=0, atol=s)
            for d in y.grams:
                torch.testing.assert_close(x.grams[d], y.grams[d], rtol=0, atol=s)
    for (sa, sb) in zip(o1.state.values(), o3.state.values()):
        for key in sb:
            assert torch.equal(sa[key], sb[key]), key




def _big(model_fn, make, steps, limit):
    """Sizes above ``limit`` bytes of the storages each of ``steps`` optimizer steps creates."""
    model = model_fn()
    opt = make(model)
    out = []
    for k in range(steps):
        _grads(model, k)
        mode = _Storages()
        with mode:
            opt.step()
        out.append(collections.Counter(s for s in mode.sizes if s > limit))
    return opt, out


def test_drift_step_storages_beyond_torch_adamw():
    """A CPU FusedAdamW step (drift steps and between them) creates no storage larger than its block
    (16 KiB here) that torch's AdamW step does not create as well: the two 64 KiB weights (256 x 64,
    unit laws: row and column statistics) are stepped in 4 blocks on drift steps, whole between them
    (torch's sqrt and div temporaries).  (Gram laws: their D x D values and the Sampler's snapshot are
    the tracker's, see test_block_storages_bounded for the step's part.)"""
    model_fn = lambda: (torch.manual_seed(0), MLP([64, 256, 64], activation="relu"))[1]  # noqa: E731
    tracked = lambda m: FusedAdamW(m.parameters(), lr=1e-3, track=m, drift_every=2, every=1000)  # noqa: E731
    opt = tracked(model_fn())
    bound = opt._chunk * 4
    assert bound == K.chunk_bound(256 * 64) * 4 == 16384
    opt, ours = _big(model_fn, tracked, 5, bound)
    _, base = _big(model_fn, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 5, bound)
    assert opt.tracker.step_count == 5  # steps 0, 2, 4: drift steps
    for k, (a, b) in enumerate(zip(ours, base)):
        assert not (a - b), (k, a, b)
    assert sum(base[1].values()) >= 4  # torch's step: sqrt and div of each weight


def test_block_storages_bounded():
    """Inside ``step_stats_reference`` a drift step of a tracked tensor creates nothing above one block
    (LM with Gram laws, blocks of 32 elements, fp32 and fp64 statistics)."""
    for fp64 in (False, True):
        m = lm()
        opt = FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, drift_every=1, fp64=fp64)
        opt._chunk = 32
        sizes = []
        real = K.step_stats_reference

        def spy(*a, **kw):
            mode = _Storages()
            with mode:
                real(*a, **kw)
            if a[7].any:  # a tracked tensor (the untracked ones are stepped as torch does)
                sizes.extend(mode.sizes)

        K.step_stats_reference = spy
        try:
            for k in range(2):
                _grads(m, k)
                opt.step()
        finally:
            K.step_stats_reference = real
        assert sizes and max(sizes) <= 32 * (8 if fp64 else 4), max(sizes)


def _expanded(f: K.Fold):
    """The Fold's pairs as ``(entry, line, coef (NQ, P))`` in its pair order (the independent form)."""
    P = f.n_pairs
    entry = torch.cat([torch.arange(e, e + n) if isinstance(e, int) else e.long() for _, n, _, e in f.segments])
    sign = torch.cat([s.double() if torch.is_tensor(s) else torch.full((n,), s, dtype=torch.float64)
                      for _, n, s, _ in f.segments])
    line = torch.arange(P) if f.line is None else f.line.long()
    quad = (torch.arange(P) < f.n_quad).double()
    return entry, line, torch.stack([sign, sign * (1 + quad), sign * quad, sign])


@pytest.mark.parametrize("case", ["run", "run_gather", "linear", "runs", "index_shared", "index_mixed", "index_float"])
def test_fold_equals_the_expanded_table(case):
    """``K.fold`` of one tensor's lines == a 2-d ``index_add_`` over the expanded ``(NQ, P)`` coefficients
    in the fold's pair order (bit for bit), and == ``finish_reference`` of the pairs as given (any order:
    to fp32 rounding); segments of consecutive entries and of an entry index, one per sign, or one with a
    sign per pair (+-1 signs changing often, float signs), lines read once each or gathered (some twice,
    some never), quadratic and linear lines."""
    g = torch.Generator().manual_seed(hash(case) % 1000)
    L, V = 96, 200
    nql = 0 if case == "linear" else 64  # the first nql lines are quadratic
    if case in ("run", "run_gather", "linear"):
        line, entry, sign = torch.arange(L), torch.arange(50, 50 + L), -torch.ones(L, dtype=torch.float64)
        if case == "run_gather":
            line = torch.sort(torch.cat([line[:90], torch.tensor([3, 3, 70, 70, 95, 1])])).values  # 90-94: none
    else:
        line = torch.randperm(L, generator=g)
        entry = torch.randint(0, V, (L,), generator=g)
        if case == "runs":  # runs of consecutive entries, two signs: a segment per (sign, run)
            line, entry = torch.arange(L), torch.cat([torch.arange(10, 42), torch.arange(100, 132), torch.arange(50, 82)])
        sign = {"runs": torch.cat([torch.ones(40), -torch.ones(56)]), "index_shared": -torch.ones(L),
                "index_mixed": torch.randint(0, 2, (L,), generator=g) * 2.0 - 1,
                "index_float": torch.randn(L, generator=g)}[case].double()
    f = K.Fold.build(entry, line, sign, nql, L, V, torch.float32)
    kinds = [("run" if isinstance(e, int) else "index", "pair" if torch.is_tensor(s) else s) for _, _, s, e in f.segments]
    assert kinds == {"run": [("run", -1.0)], "run_gather": [("run", -1.0)], "linear": [("run", -1.0)],
                     "runs": [("run", 1.0)] * 2 + [("run", -1.0)] * 2, "index_shared": [("index", -1.0)],
                     "index_mixed": [("index", "pair")], "index_float": [("index", "pair")]}[case], kinds
    assert (f.line is None) == (case != "run_gather")
    lines = torch.randn(K.NQ, L, generator=g)
    lines[2, nql:] = 0  # linear lines: quantity 2 is 0
    e, l, c = _expanded(f)
    want = torch.zeros(K.NQ, V).index_add_(1, e, c.float() * lines[:, l])
    for rows in (K.NQ, 1):
        for index in (None, torch.empty(f.n_index, dtype=torch.int32)):
            got = torch.zeros(rows, V)
            K.fold(got, lines[:rows].clone(), f, index)
            assert torch.equal(got, want[:rows]), case
    quad = line < nql
    coef = torch.stack([sign, sign * (1 + quad.double()), sign * quad.double(), sign])
    pad_idx = torch.zeros(V, L, dtype=torch.long)
    pad_coef = torch.zeros(K.NQ, V, L, dtype=torch.float64)
    for p in range(L):  # the padded table, pairs in the given order
        pad_idx[entry[p], p], pad_coef[:, entry[p], p] = line[p], coef[:, p]
    ref = K.finish_reference(lines.double(), pad_idx, pad_coef)
    torch.testing.assert_close(want.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(K.finish_compact(lines, entry, line, coef.float(), V), torch.zeros(K.NQ, V).index_add_(
        1, entry, coef.float() * lines[:, line]))


def _deep_mlp():
    torch.manual_seed(0)
    return MLP([16] + [32] * 12 + [16], activation="relu")


def test_tracking_storages_of_a_step_bounded_by_one_tensor():
    """What tracking creates inside a CPU FusedAdamW step (drift steps and between them; the update's
    own temporaries and the tracker's booking left out): the one ``(rows, entries)`` result, and else
    nothing above one tensor's line statistics ``(NQ, lines)`` -- no buffer of every line, no index or
    product copy of every (entry, line) pair -- and at most the result plus two tensors' lines and the
    two block buffers alive at once.  The MLP has 12 hidden layers: all its lines are 18x one tensor's,
    an int32 index of every pair 4.5x one tensor's statistics."""
    from torch.utils._python_dispatch import _disable_current_modes

    m = _deep_mlp()
    opt = FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, drift_every=2, every=1000)
    opt._chunk = 64
    fp = opt._fp
    assert fp.rest is None and len(fp.local_reqs) == 25  # no Gram laws: no snapshot; the last bias in no law
    n_lines = max(f.n_lines for f in fp.folds)  # the largest group: one tensor's lines (a tiny model)

    def lines(i, r):
        B, R, C = K.matrix_shape(opt.tracker.tensors[i].shape)
        return sum(c for f, c in (("row_q", B * R), ("col_q", B * C), ("row_l", B * R), ("col_l", B * C))
                   if getattr(r, f) >= 0)
    assert n_lines == max(lines(i, r) for i, r in fp.local_reqs.items()) and len(fp.groups) == 25
    lines_b, vals_b = K.NQ * n_lines * 4, K.NQ * fp.n_entries * 4
    assert fp.n_slots * 4 > 3 * lines_b and fp.n_slots * K.NQ * 4 > vals_b + 2 * lines_b + 2 * 64 * 4

    def outside(fn):
        def run(*a, **kw):
            with _disable_current_modes():
                return fn(*a, **kw)
        return run

    real = step_twin.step_reference  # the update step_stats_reference calls
    step_twin.step_reference = outside(real)
    opt._record = outside(opt._record)
    try:
        _grads(m, 0)
        opt.step()  # (the first step makes Adam's state)
        for k in range(1, 5):
            _grads(m, k)
            mode = _Storages()
            with mode:
                opt.step()
            big = [s for s in mode.sizes if s > lines_b]
            assert big == [vals_b if k % 2 == 0 else vals_b // K.NQ], (k, big, lines_b, vals_b)  # the result
            assert mode.peak <= vals_b + 2 * lines_b + 2 * 64 * 4, (k, mode.peak)
    finally:
        step_twin.step_reference = real
    assert opt.tracker.step_count == 5


def test_fold_order_does_not_depend_on_the_parameter_order():
    """The law rows of a FusedAdamW over the parameters in reverse order (every tensor's lines wait
    for the ones before it) == in model order, bit for bit, with a parameter left without gradient
    (measured when its turn comes); both == conserve.track over torch.optim.AdamW (every entry decomposed on
    every drift step) to fp32 rounding."""
    import conserve
    ms = [_deep_mlp() for _ in range(3)]
    kw = dict(lr=1e-2, weight_decay=0.1)
    o1 = FusedAdamW(ms[0].parameters(), **kw, track=ms[0], drift_every=2, keep_last=True)
    o2 = FusedAdamW(list(ms[1].parameters())[::-1], **kw, track=ms[1], drift_every=2, keep_last=True)
    o3 = conserve.track(torch.optim.AdamW(ms[2].parameters(), **kw), ms[2], drift_every=2, snapshot_budget=None,
                        keep_last=True)
    for k in range(4):
        for m in ms:
            _grads(m, k)
            m.layers[3].bias.grad = None
        for o in (o1, o2, o3):
            o.step()
        for key in ("measured", "decay", "first", "second"):
            x, y, z = (o.tracker.last.get(key) for o in (o1, o2, o3))
            if x is None:
                assert y is None and z is None
                continue
            assert torch.equal(x.vec, y.vec), (k, key)
            torch.testing.assert_close(x.vec, z.vec, rtol=1e-5, atol=1e-6)
