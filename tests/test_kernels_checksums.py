"""The gradient check's one pass (``conserve.kernels.check_sums``; CHECK modes of ``gram_kernel`` and
``rowcol_kernel``, under TRITON_INTERPRET=1) against its torch twin, and the twin against autograd in float64.

The autograd reference: for every output entry ``o`` of a plan whose terms of one entry read disjoint elements
(as every catalogue law's do), ``p_o = <grad h_o(x), y>``, ``||grad h_o||^2`` and ``sum y^2`` over the elements
``h_o`` reads (its gradient's support at a point with no zero coordinate).
"""
from __future__ import annotations

import os

import pytest
import torch

from bench.compile_launches import _abs, _block, _close, _rtol
from bench.gradcheck_cost import launch_bytes, measured_loads, pass_bytes
from conserve.kernels import GramTerm, NormTerm, Plan, SumTerm, View, check_sums, evaluate_reference
from conserve.kernels import launch as L
from conserve.kernels.checksums import check_reference
from conserve.kernels.runner import prepare

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"


def block(D: int, dtype, seed: int = 0, experts: int = 2):
    """``(plan, tensors)``: one Gram slot of head size ``D`` (a row block, a row block with sign -0.5, a column
    block, a doubly strided slice, a bias), row norms of two row blocks and a strided slice into one vector of
    D entries, row norms of a view of tensor 1 into one vector and its column sums with the column norms of another
    view into a second (one view read in both directions), a Gemma-style shifted gain, and per
    expert of a 3-D tensor a unit law (rows of up, columns of down)."""
    g = torch.Generator().manual_seed(seed)
    H, K, I = 300, 40, 24
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    ts = [rnd(2 * D, H), rnd(H, 2 * D), rnd(3 * D, 3 * K)[::3, ::3], rnd(D), rnd(experts, I, K), rnd(experts, K, I)]
    p = Plan()
    s = p.new_gram(D)
    p.grams += [GramTerm(View(0, (0, 0), 0, D, 1, K), 1.0, s), GramTerm(View(0, (D, 0), 0, D, 1, K), -0.5, s),
                GramTerm(View(1, (0, D), 1, D, 0, K), -1.0, s), GramTerm(View(2, (0, 0), 0, D, 1, K), 1.0, s),
                GramTerm(View(3, (0,), 0, D, None, 1), 1.0, s)]
    u = p.new_vec(D)
    p.norms += [NormTerm(View(0, (0, K), 0, D, 1, H - K), 1.0, u), NormTerm(View(0, (D, K), 0, D, 1, H - K), -1.0, u)]
    r, c = p.new_vec(H - K), p.new_vec(D)  # one view of tensor 1 read by rows (r) and by columns (c)
    p.norms.append(NormTerm(View(1, (K, 0), 0, H - K, 1, D), 2.0, r))
    p.sums.append(SumTerm(View(1, (K, 0), 0, H - K, 1, D), 1.0, c))
    p.norms.append(NormTerm(View(1, (K, D), 1, D, 0, H - K), -1.0, c))  # column norms of its right half
    gain = p.new_vec(D)
    p.norms.append(NormTerm(View(3, (0,), 0, D, None, 1), 1.0, gain, 1, 1.0))
    for e in range(experts):
        unit = p.new_vec(I)
        p.norms += [NormTerm(View(4, (e, 0, 0), 1, I, 2, K), 1.0, unit),
                    NormTerm(View(5, (e, 0, 0), 2, I, 1, K), -1.0, unit)]
    return p, ts


def grads_like(ts, dtype, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in ts]


def autograd_sums(plan: Plan, xs, ys):
    """``(p, ||grad h||^2, ng2)`` per vec entry and ``(2 B, ||grad h_aa||^2, ...)`` per Gram entry, by autograd."""
    xs = [x.detach().clone().double().requires_grad_(True) for x in xs]
    ys = [y.double() for y in ys]
    vec, grams = evaluate_reference(plan, xs, fp64=True)
    outs = list(vec) + [g.reshape(-1)[k] for _, g in sorted(grams.items()) for k in range(g.numel())]
    p, nh2, ng2 = [], [], []
    for h in outs:
        gr = torch.autograd.grad(h, xs, retain_graph=True, allow_unused=True)
        gr = [torch.zeros_like(x) if q is None else q for q, x in zip(gr, xs)]
        p.append(sum((q * y).sum() for q, y in zip(gr, ys)))
        nh2.append(sum((q * q).sum() for q in gr))
        ng2.append(sum((y * y * (q != 0)).sum() for q, y in zip(gr, ys)))
    return torch.stack(p), torch.stack(nh2), torch.stack(ng2)


def test_twin_matches_autograd_in_float64():
    """Every vec entry's product, law-gradient norm (plus a SumTerm's constant ``s^2 rows``) and restricted
    gradient norm; every Gram entry's product and, on the diagonal, ``4 plane1`` and ``plane2``."""
    D = 8
    plan, ts = block(D, torch.float64)
    ts = [t.abs() + 0.1 for t in ts]  # no zero coordinate: the gradient's support is what h_o reads
    ys = grads_like(ts, torch.float64)
    vec, grams = check_reference(plan, ts, ys, fp64=True)
    p, nh2, ng2 = autograd_sums(plan, ts, ys)
    V = plan.vec_size
    const = torch.zeros(V, dtype=torch.float64)  # the SumTerms' ||grad h||^2 = s^2 rows (no weight read)
    for t in plan.sums:
        const[t.index:t.index + t.view.cols] += t.sign ** 2 * t.view.rows
    torch.testing.assert_close(vec[0], p[:V], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vec[1] + const, nh2[:V], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vec[2], ng2[:V], rtol=1e-12, atol=1e-12)
    g = grams[D][:, 0]  # (3, D, D)
    torch.testing.assert_close(2 * g[0].reshape(-1), p[V:], rtol=1e-12, atol=1e-12)
    diag = torch.arange(D) * (D + 1)
    torch.testing.assert_close(4 * g[1].diagonal(), nh2[V:][diag], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g[2].diagonal(), ng2[V:][diag], rtol=1e-12, atol=1e-12)
    assert (g[1] - torch.diag_embed(g[1].diagonal())).abs().max() == 0


CASES = [(D, dt, fp64) for D in (8, 80, 192) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
         for fp64 in (False, True) if not (D == 192 and dt == torch.float64 and not fp64)]  # (that one: as D = 80)


@pytest.mark.parametrize("D, dtype, fp64", CASES)
def test_one_pass_matches_the_twin(D, dtype, fp64):
    """The CHECK pass (Triton, CPU tiles) against the twin in float64, entrywise within ``rtol`` of the same
    sums over ``|x|``, ``|y|``, ``|sign|``: head dims below 16, not a power of two and above one 128 tile
    (off-diagonal tiles: no row norms there), every input dtype, fp64 accumulation on and off."""
    plan, ts = block(D, dtype)
    ys = grads_like(ts, dtype)
    vec, grams = check_sums(plan, ts, ys, fp64=fp64, backend="triton")
    d64 = lambda a: [t.double() for t in a]  # noqa: E731
    rv, rg = check_reference(plan, d64(ts), d64(ys), fp64=True)
    sv, sg = check_reference(_abs(plan), [t.abs() for t in d64(ts)], [y.abs() for y in d64(ys)], fp64=True)
    assert vec.shape == (3, plan.vec_size) and vec.dtype == (torch.float64 if fp64 else torch.float32)
    rtol = _rtol([dtype], fp64)
    _close(vec, rv, sv, rtol, "vec")
    _close(grams[D], rg[D], sg[D], rtol, "grams")


def test_the_pass_reads_each_view_of_weights_and_gradients_once():
    """Bytes the launches load (GPU tiles, counted from the tables): a plan whose views cover each element once
    (unit laws of 3-D experts, a Gram slot of row blocks) loads exactly the weights and gradients once; the
    torch twin's plan reads them twice."""
    g = torch.Generator().manual_seed(0)
    up, down, q = torch.randn(3, 48, 40, generator=g), torch.randn(3, 40, 48, generator=g), torch.randn(64, 40, generator=g)
    p = Plan()
    for e in range(3):
        u = p.new_vec(48)
        p.norms += [NormTerm(View(0, (e, 0, 0), 1, 48, 2, 40), 1.0, u), NormTerm(View(1, (e, 0, 0), 2, 48, 1, 40), -1.0, u)]
    for h in range(2):
        s = p.new_gram(32)
        p.grams.append(GramTerm(View(2, (32 * h, 0), 0, 32, 1, 40), 1.0, s))
    xs = [up, down, q]
    once = 2 * sum(x.numel() * 4 for x in xs)
    cfg = L.Tiles.gpu(132)
    assert launch_bytes(L.build(p, xs, xs, False, cfg, check=True)) == once
    assert 2 * launch_bytes(L.build(p, xs, None, False, cfg)) == once


def test_a_language_model_check_loads_no_more_than_a_law_pass_on_each():
    """On conserve's Llama-like LM with an MoE layer and the translation law: the one pass loads at most what
    one evaluation of the laws loads on the weights plus one on the gradients (a tensor read by two laws in
    two directions, e.g. the output layer by translation and the final gain, is one region)."""
    import conserve
    from conserve.analysis.gradcheck import GradPlan, select
    from conserve.models import DecoderLM, LMConfig

    torch.manual_seed(0)
    m = DecoderLM(LMConfig(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=80, num_experts=4, moe_layers=(1,)))
    laws, _ = select(conserve.detect(m, loss="ce"), loss="ce")
    named = dict(m.named_parameters())
    nb = pass_bytes(GradPlan(laws, named), named)
    assert nb["check"] <= nb["law pass"] and nb["check"] < 1.2 * nb["once"] and nb["twin"] > 2 * nb["once"], nb
    # the loads as the kernels run them (interpreter, GPU tiles, a real gradient): exactly the tables' count
    x = torch.randint(0, 96, (2, 16))
    torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    assert measured_loads(GradPlan(laws, named), named, {n: p.grad for n, p in named.items()}) == nb["check"]


def test_gradplan_on_triton_and_torch_agree():
    """``GradPlan.products`` through the one pass (interpreter) and through the twin, on the same LM's laws and
    a real gradient: the same products and norms."""
    import torch.nn.functional as F

    import conserve
    from conserve.analysis.gradcheck import GradPlan, select
    from conserve.models import DecoderLM, LMConfig

    torch.manual_seed(1)
    m = DecoderLM(LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=48, num_experts=4, moe_layers=(1,))).double()
    laws, _ = select(conserve.detect(m, loss="ce"), loss="ce")
    x = torch.randint(0, 64, (2, 12))
    F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    named = dict(m.named_parameters())
    params = {n: p.detach() for n, p in named.items()}
    grads = {n: p.grad for n, p in named.items()}
    plan = GradPlan(laws, params)
    a = plan.products(params, grads, backend="triton")
    b = plan.products(params, grads, backend="torch")
    torch.testing.assert_close(a.nh, b.nh, rtol=1e-11, atol=0.0)
    torch.testing.assert_close(a.ng, b.ng, rtol=1e-11, atol=0.0)
    # the products of a true gradient are rounding: equal within float64 rounding of their terms' scale
    torch.testing.assert_close(a.p, b.p, rtol=0.0, atol=1e-13 * float((b.nh * b.ng).max()))
    assert float(a.ratio().max()) < 1e-9  # a true gradient, float64


def test_a_prepared_plan_runs_only_its_own_mode():
    plan, ts = block(8, torch.float32)
    ys = grads_like(ts, torch.float32)
    with pytest.raises(ValueError, match="another mode"):
        prepare(plan, ts, ys, check=True).run(ts, ys)
    with pytest.raises(ValueError, match="shifted norm"):  # the plain bilinear form has no shift
        prepare(plan, ts, ys)
    plan, ts = _block(8, torch.float32, 0)
    ys = grads_like(ts, torch.float32)
    with pytest.raises(ValueError, match="not built for the check pass"):
        prepare(plan, ts, ys).run_check(ts, ys)
    with pytest.raises(ValueError, match="pass ys"):
        L.build(plan, ts, None, False, L.Tiles(), check=True)
