"""The gradient check's library API (``conserve.analysis.gradcheck``): ``GradPlan`` / ``products`` evaluate
every law instance in one bilinear and one norms pass of the kernels; ``Raw`` sums add up over shards of
the contracted dimension; ``GradCheck`` accumulates over steps (worst entry and step, aggregates that lift
a consistent fault a single step cannot show), counts non-finite entries, and its errors name the fix;
shifted gains ``(1 + w)`` are checked with their shift; ``bench/gradcheck_cost.py`` runs (smoke)."""
import math

import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve import kernels
from conserve.analysis.gradcheck import (GradCheck, GradPlan, Products, aggregate_floor, check_gradients, floor,
                                         law_products, products, select)
from conserve.laws import evaluate_laws
from conserve.models.lm import DecoderLM, LMConfig

CFG = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_experts=4, moe_layers=(1,), top_k=2)


def _ce(model, x):
    logits = model(x)
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    m = DecoderLM(CFG)
    laws, skipped = select(conserve.detect(m, loss="ce"), loss="ce")
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    m.zero_grad()
    _ce(m, x).backward()
    named = dict(m.named_parameters())
    grads = {n: p.grad.clone() for n, p in named.items()}
    m.zero_grad()
    return m, laws, skipped, {n: p.detach() for n, p in named.items()}, grads


def test_floors_per_dtype_and_law_kind():
    from conserve.analysis.floor import relative_floor

    assert relative_floor("bf16", 2, 16) == 2 * 2.0 ** -8 and relative_floor("float32", 2, 16) == 16 * 2.0 ** -24
    with pytest.raises(ValueError, match="factors"):
        relative_floor("float32", -1)
    assert floor("float32") == floor(torch.float64) == 16 * 2.0 ** -24
    assert floor("bf16") == 2 * 2.0 ** -8 and floor(torch.float16) == 2 * 2.0 ** -11
    assert aggregate_floor("float32") == 8 * 2.0 ** -24 and aggregate_floor("bfloat16") == 2.0 ** -8
    for d in ("float32", "float16", "bfloat16"):
        assert floor(d, linear=True) == 4 * floor(d) and aggregate_floor(d, linear=True) == 4 * aggregate_floor(d)
        assert aggregate_floor(d) < floor(d)


def test_one_check_pass_for_a_hundred_thousand_instances(monkeypatch):
    """A ReLU MLP of 100,000 units (100,000 unit-law entries, plus the gain law): the check makes one
    ``kernels.check_sums`` call (and no other evaluation), the true gradient is silent, and one unit's
    planted fault is found at that unit."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 100_000), torch.nn.ReLU(),
                            torch.nn.Linear(100_000, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    laws = conserve.detect(m)
    assert sum(law.size for law in laws.laws) > 100_000
    calls = {"check_sums": 0, "bilinear": 0, "evaluate": 0}
    for name in calls:
        fn = getattr(kernels, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(kernels, name, counted)
    m.zero_grad()
    F.cross_entropy(m(x), y).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    res = check_gradients(m, laws=laws, grads=grads)
    assert res.ok and calls == {"check_sums": 1, "bilinear": 0, "evaluate": 0}, (str(res), calls)
    unit = int(grads["1.weight"].norm(dim=1).argmax())  # a unit active on the batch
    bad = dict(grads)
    bad["1.weight"] = grads["1.weight"].clone()
    bad["1.weight"][unit] *= 1.01
    res = check_gradients(m, laws=laws, grads=bad)
    [hit] = [c for c in res.flagged if c.family == "relu"]
    assert hit.worst_entry == unit


def test_products_per_law_views_and_law_products_agree(lm):
    m, laws, _, params, grads = lm
    plan = GradPlan(laws, params)
    prod = plan.products(params, grads)
    assert isinstance(prod, Products) and prod.p.dtype == torch.float64 and prod.p.numel() == plan.entries
    by = prod.by_law()
    assert list(by) == [law.name for law in laws]
    for law in laws:
        p, nh, ng = by[law.name]
        assert p.shape == ((law.size, law.size) if law.kind == "gram" else (law.size,))
        q, qh, qg = law_products(law, params, grads)
        torch.testing.assert_close(q, p.reshape(-1), rtol=1e-12, atol=1e-18)
        torch.testing.assert_close(qg, ng.reshape(-1), rtol=1e-12, atol=0.0)
    r = prod.ratio()
    assert (r >= 0).all() and (r <= 1 + 1e-12).all()  # Cauchy-Schwarz
    # tensors as sequences in plan.names order: the same numbers
    seq = plan.products([params[n] for n in plan.names], [grads[n] for n in plan.names])
    assert torch.equal(seq.p, prod.p) and torch.equal(seq.ng, prod.ng)
    # the module-level function compiles a plan each call: same numbers
    torch.testing.assert_close(products(laws, params, grads).p, prod.p)
    # float32 accumulation: the same products within float32 rounding of the norms
    p32 = plan.products(params, grads, fp64=False)
    assert p32.p.dtype == torch.float32
    assert ((p32.p.double() - prod.p).abs() <= 1e-5 * prod.nh * prod.ng).all()


def test_the_triton_kernels_give_the_torch_twins_products(lm):
    """``backend="triton"`` (the CUDA path; here under the interpreter) gives the same products and norms:
    the row plan's transposed views (a vector read as one row) and shifted terms run on both backends."""
    pytest.importorskip("triton")
    m, laws, _, params, grads = lm
    plan = GradPlan(laws, params)
    g = {n: torch.randn(v.shape, generator=torch.Generator().manual_seed(5)) for n, v in grads.items()}
    a, b = plan.products(params, g, backend="torch"), plan.products(params, g, backend="triton")
    for f in ("p", "nh", "ng"):
        x, y = getattr(a, f), getattr(b, f)
        torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12 * float(x.abs().max()))


def test_raw_sums_add_up_over_shards_of_the_contracted_dimension(lm):
    """Split every tensor by hidden feature (the dimension each law entry contracts: a Gram row pair's
    columns, a unit's row, a gain or router column's feature) into two disjoint shards: the ``Raw`` sums of
    the shards add up to the whole's, so ranks holding such shards all-reduce ``Raw.tensors()``."""
    m, laws, _, params, grads = lm
    plan = GradPlan(laws, params)
    H = CFG.hidden_size
    keep = torch.rand(H, generator=torch.Generator().manual_seed(3)) < 0.5

    def shard(t, name, mask):
        if t.dim() == 1 or name.endswith(("o_proj.weight", "down_proj.weight")):  # H along dim 0
            return t * mask.view(-1, *([1] * (t.dim() - 1))).to(t.dtype) if t.shape[0] == H else t
        return t * mask.to(t.dtype) if t.shape[-1] == H else t

    parts = [plan.raw({n: shard(t, n, k) for n, t in params.items()}, {n: shard(t, n, k) for n, t in grads.items()})
             for k in (keep, ~keep)]
    whole = plan.raw(params, grads)
    scale = (whole.nh2 * whole.ng2).sqrt().max().item()  # p is a cancelling sum: compare it on the norms' scale
    for a, b, w in zip(parts[0].tensors(), parts[1].tensors(), whole.tensors()):
        torch.testing.assert_close(a + b, w, rtol=1e-10, atol=1e-12 * scale)


def test_shifted_gains_are_checked_with_their_shift():
    """Gemma stores its norm gains as ``w`` and multiplies by ``(1 + w)``: the gain law's product is
    ``2 s sum (x + 1) g``; it matches the directional derivative of the law in float64, and the true
    gradient is silent with random gains (without the shift the products would be off by ``2 s sum g``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    m = transformers.GemmaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    laws = conserve.detect(m, loss="ce").laws
    gains = [law for law in laws if any(t.shift for t in law.terms)]
    assert gains
    m64 = m.double()
    params = {n: p.detach() for n, p in m64.named_parameters()}
    g = {n: torch.randn_like(p) for n, p in params.items()}
    for law in gains:
        p, _, _ = law_products(law, params, g)
        e = 1e-3
        plus = evaluate_laws([law], {n: params[n] + e * g[n] for n in law.params}, fp64=True)[law.name]
        minus = evaluate_laws([law], {n: params[n] - e * g[n] for n in law.params}, fp64=True)[law.name]
        torch.testing.assert_close(p, ((plus - minus) / (2 * e)).reshape(-1), rtol=1e-8, atol=1e-10)
    x = torch.randint(0, 64, (2, 8))
    res = check_gradients(m64.float(), _ce, x, laws=laws, loss="ce")
    assert res.ok and "gain" in res.families(), str(res)


@pytest.fixture(scope="module")
def bf16_steps():
    """8 SGD steps of the bench's tiny LM with bf16-autocast gradients: ``[(params, grads)]``."""
    from bench.gradcheck_cost import tiny_lm, trajectory

    m = tiny_lm()
    laws, _ = select(conserve.detect(m, loss="ce"), loss="ce")
    return GradPlan(laws, dict(m.named_parameters())), trajectory(m, "bfloat16", 8)


def test_the_aggregate_over_steps_lifts_a_consistent_fault_one_step_cannot_show(bf16_steps):
    """Coupled L2 of relative size f folded into bf16-autocast gradients: its products keep one sign per law,
    so the aggregate over 8 steps flags a fault 3x or more smaller than one step needs; the clean gradients
    stay silent over the 8 steps."""
    from bench.gradcheck_cost import _decay, smallest

    plan, traj = bf16_steps
    clean = GradCheck(plan, dtype="bfloat16")
    for params, grads in traj:
        clean.update(params, grads)
    res = clean.result()
    assert res.ok and res.steps == 8 and not clean.fp64, str(res)
    one, many = (smallest(traj, plan, "bfloat16", _decay, "layers.", k) for k in (1, 8))
    assert one is not None and many is not None and many <= one / 3, (one, many)


def test_worst_entry_and_step_point_at_the_fault_and_flagged_takes_other_floors(lm):
    m, laws, skipped, params, grads = lm
    plan = GradPlan(laws, params)
    chk = GradCheck(plan, skipped=skipped)
    for step in range(4):
        g = dict(grads)
        if step == 2:
            g["layers.0.mlp.up_proj.weight"] = grads["layers.0.mlp.up_proj.weight"].clone()
            g["layers.0.mlp.up_proj.weight"][5] *= 1.01
        prod = chk.update(params, g)
        assert prod.plan is plan
    res = chk.result()
    unit = next(c for c in res.laws if c.name == "layers.0.mlp/unit")
    assert unit.flagged and unit.worst_step == 2 and unit.worst_entry == 5 and unit.steps == 4
    assert "of step 2" in str(res) and res.layers()[0]
    assert [c.name for c in chk.flagged()] == [c.name for c in res.flagged]
    assert chk.flagged(floor=1.0, aggregate_floor=1.0) == []
    fams = res.families()
    assert fams["swiglu"]["flagged"] >= 1 and fams["swiglu"]["layers"] == [0]
    chk.reset()
    assert chk.steps == 0 and chk.result().laws == []


def test_non_finite_gradients_are_left_out_and_counted(lm):
    """A loss scaler's overflowed step (inf in a gradient) is not a fault: its entries are counted, not flagged."""
    m, laws, _, params, grads = lm
    chk = GradCheck(GradPlan(laws, params), dtype="float16")
    g = dict(grads)
    g["layers.0.mlp.down_proj.weight"] = grads["layers.0.mlp.down_proj.weight"].clone()
    g["layers.0.mlp.down_proj.weight"][0, 0] = math.inf
    chk.update(params, g)
    res = chk.result()
    assert res.ok and res.nonfinite > 0 and "non-finite" in str(res)


def test_errors_name_the_fix(lm):
    m, laws, _, params, grads = lm
    plan = GradPlan(laws, params)
    g = {n: v for n, v in grads.items() if n != "layers.0.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match=r"no tensor or no gradient for layers\.0\.mlp\.down_proj\.weight .*"
                                         r"layers.0.mlp/unit.*ignore="):
        plan.raw(params, g)
    g = dict(grads)
    g["lm_head.weight"] = grads["lm_head.weight"][:, :-1]
    with pytest.raises(ValueError, match="lm_head.weight: the gradient has shape"):
        plan.raw(params, g)
    other = GradPlan(laws, params)
    with pytest.raises(ValueError, match="another GradPlan"):
        GradCheck(plan).update(other.products(params, grads))
    with pytest.raises(TypeError, match="update"):
        GradCheck(plan).update(params)
    with pytest.raises(ValueError, match="shapes"):
        GradCheck(laws)
    with pytest.raises(ValueError, match="not a parameter"):
        GradPlan(laws, {n: v for n, v in params.items() if n != "lm_head.weight"})


def test_select_skips_approximate_and_unnamed_loss_laws_with_the_reason(lm):
    m, laws, _, params, _ = lm
    det = conserve.detect(m)
    checked, skipped = select(det)
    assert all(law.family != "translation" for law in checked)
    assert ("lm_head/translation", "holds for loss='ce' only: pass loss='ce' if that is the loss") in skipped
    checked, skipped = select(det, loss="ce", ignore="layers.1.*")
    assert all(law.layer != 1 for law in checked) and any("ignored" in why for _, why in skipped)


def test_the_bench_runs_quick():
    """``python -m bench.gradcheck_cost --quick`` (cost) and ``--quick --floors`` print their tables."""
    import contextlib
    import io

    from bench.gradcheck_cost import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--quick", "--blocks", "1"])
        main(["--quick", "--floors", "--steps", "1"])
    text = out.getvalue()
    assert "check fp64" in text and "/ step" in text and "the check's Triton pass" in text
    assert "bfloat16 autocast" in text and "float16 autocast + GradScaler" in text and "smallest planted fault" in text
