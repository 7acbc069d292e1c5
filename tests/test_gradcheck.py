"""Gradient integrity (``conserve.check_gradients``; spec "Gradient integrity"): planted faults are
flagged with their family and layer, clean gradients (global scale, norm clipping, bf16 autocast,
dropout, label smoothing, micro-batches) stay at their floor, and the statistic matches an
independent autograd computation of ``<grad h_i, g>``."""
import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve.analysis.gradcheck import check_gradients, floor, law_products
from conserve.laws import evaluate_laws
from conserve.models.lm import DecoderLM, LMConfig

CFG = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_experts=2, moe_layers=(1,), top_k=1)


def _ce(model, batch):
    logits = model(batch)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    m = DecoderLM(CFG)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    laws = conserve.detect(m, loss="ce")
    m.zero_grad()
    _ce(m, x).backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    return m, x, laws, g


def _flagged(res):
    return sorted(c.name for c in res.flagged)


def _law_value(law, params):
    return evaluate_laws([law], params, fp64=True)[law.name].reshape(-1)


def test_products_match_autograd_jvp_in_float64():
    torch.manual_seed(3)
    m = DecoderLM(CFG).double()
    params = {n: p.detach() for n, p in m.named_parameters()}
    g = {n: torch.randn_like(p) for n, p in params.items()}
    for law in conserve.detect(m, loss="ce").laws:
        p, nh, ng = law_products(law, params, g)
        names = list(law.params)
        # the laws are quadratic or linear: the central difference is their directional derivative exactly
        e = 1e-3
        plus = _law_value(law, {n: params[n] + e * g[n] for n in names})
        minus = _law_value(law, {n: params[n] - e * g[n] for n in names})
        want = ((plus - minus) / (2 * e)).reshape(-1)
        assert torch.allclose(p, want, rtol=1e-8, atol=1e-8 * want.abs().max().item()), law.name
        # ||grad h_i|| from autograd, entry by entry (the first few entries)
        for i in range(min(3, p.numel())):
            xs = tuple(params[n].clone().requires_grad_(True) for n in names)
            gr = torch.autograd.grad(_law_value(law, dict(zip(names, xs)))[i], xs, allow_unused=True)
            want = torch.sqrt(sum((t ** 2).sum() for t in gr if t is not None))
            assert nh[i].item() == pytest.approx(want.item(), rel=1e-10), (law.name, i)
        assert (p.abs() <= nh * ng * (1 + 1e-12)).all(), law.name  # Cauchy-Schwarz


def test_a_true_gradient_is_silent_and_global_scale_and_norm_clipping_keep_it(setup):
    m, x, laws, g = setup
    res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    assert res.ok, str(res)
    assert res.floor == floor(torch.float32) and max(c.worst for c in res.laws) < res.floor / 2
    assert {"vo", "rope_pair", "swiglu", "gain", "router_sum", "translation"} <= set(res.families())
    assert check_gradients(m, laws=laws, grads={n: 0.3 * v for n, v in g.items()}, loss="ce").ok
    total = torch.sqrt(sum((v ** 2).sum() for v in g.values()))
    assert check_gradients(m, laws=laws, grads={n: v * (1e-3 / total) for n, v in g.items()}, loss="ce").ok


def test_micro_batches_summed_dropout_and_label_smoothing_stay_silent(setup):
    m, x, laws, _ = setup

    def micro(model, batch):  # two micro-batches, summed: one backward each
        a, b = batch[:2], batch[2:]
        return _ce(model, a) / 2 + _ce(model, b) / 2

    assert check_gradients(m, micro, x, laws=laws, loss="ce").ok

    def smoothed(model, batch):
        return F.cross_entropy(model(batch).flatten(0, 1), batch.flatten(), label_smoothing=0.1)

    assert check_gradients(m, smoothed, x, laws=laws, loss="ce").ok

    def dropped(model, batch):  # dropout on the logits' input is a mask of the output: still a gradient
        torch.manual_seed(5)
        return F.cross_entropy(F.dropout(model(batch), 0.2).flatten(0, 1), batch.flatten())

    assert check_gradients(m, dropped, x, laws=[l for l in laws.laws if l.family != "translation"]).ok


def test_bf16_autocast_stays_under_its_floor(setup):
    m, x, laws, _ = setup

    def bf16(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _ce(model, batch)

    res = check_gradients(m, bf16, x, laws=laws, loss="ce", dtype="bfloat16")
    assert res.ok, str(res)
    # at the float32 floor the same gradient is flagged: the dtype decides what can be told from rounding
    assert not check_gradients(m, bf16, x, laws=laws, loss="ce").ok


def test_a_hook_that_rescales_one_heads_o_proj_columns_flags_that_layers_vo_law(setup):
    m, x, laws, g = setup
    w = m.layers[0].self_attn.o_proj.weight
    h = w.register_hook(lambda gr: torch.cat([gr[:, :8] * 0.5, gr[:, 8:]], 1))
    try:
        res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    finally:
        h.remove()
    assert _flagged(res) == ["layers.0.self_attn/vo/group0"]
    assert "FLAGGED layers.0.self_attn/vo/group0 (layer 0" in str(res)


class _WrongBackward(torch.autograd.Function):
    """``x @ W^T`` whose backward gives W a gradient 1% too large in its first row."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gw = go.flatten(0, -2).T @ x.flatten(0, -2)
        gw = torch.cat([gw[:1] * 1.01, gw[1:]])
        return go @ w, gw


def test_a_custom_backward_with_a_wrong_weight_gradient_flags_the_unit_law(setup):
    m, x, laws, _ = setup
    up = m.layers[0].mlp.up_proj
    orig = up.forward
    up.forward = lambda t: _WrongBackward.apply(t, up.weight)
    try:
        res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    finally:
        up.forward = orig
    # the unit law and the gain law whose readers include up_proj's columns; nothing outside layer 0
    assert _flagged(res) == ["layers.0.mlp/unit", "layers.0.post_attention_layernorm/gain"]


def test_weight_decay_folded_into_the_gradient_and_clip_grad_value_are_flagged(setup):
    m, x, laws, g = setup
    params = dict(m.named_parameters())
    res = check_gradients(m, laws=laws, grads={n: v + 0.01 * params[n].detach() for n, v in g.items()}, loss="ce")
    assert len(res.flagged) == len(res.laws)
    m.zero_grad()
    _ce(m, x).backward()
    torch.nn.utils.clip_grad_value_(m.parameters(), 0.3 * max(p.grad.abs().max().item() for p in m.parameters()))
    res = check_gradients(m, laws=laws, loss="ce")  # the gradients in .grad
    m.zero_grad()
    assert not res.ok and "clip_grad_value_" in str(res)


def test_router_z_loss_flags_the_router_law_and_translation_needs_its_loss_named(setup):
    m, x, laws, _ = setup

    def z_loss(model, batch):
        logits = []
        h = model.layers[1].mlp.router.register_forward_hook(lambda mod, i, o: logits.append(o))
        try:
            loss = _ce(model, batch)
        finally:
            h.remove()
        return loss + 1e-2 * torch.logsumexp(logits[0], -1).square().mean()

    res = check_gradients(m, z_loss, x, laws=laws, loss="ce")
    assert _flagged(res) == ["layers.1.mlp/router"]
    res = check_gradients(m, _ce, x, laws=laws)  # loss not named: translation skipped with the reason
    assert any(name == "lm_head/translation" and "loss='ce'" in why for name, why in res.skipped)
    assert all(c.family != "translation" for c in res.laws)


def test_ignore_takes_law_names_families_and_parameter_patterns(setup):
    m, x, laws, g = setup
    bad = dict(g)
    bad["layers.0.mlp.down_proj.weight"] = g["layers.0.mlp.down_proj.weight"] * 1.5
    assert _flagged(check_gradients(m, laws=laws, grads=bad, loss="ce")) == ["layers.0.mlp/unit"]
    for ign in (["layers.0.mlp/unit"], ["swiglu"], ["layers.0.mlp.*"]):
        res = check_gradients(m, laws=laws, grads=bad, loss="ce", ignore=ign)
        assert res.ok and any(n == "layers.0.mlp/unit" for n, _ in res.skipped), ign


def test_a_missing_gradient_is_one_clear_error(setup):
    m, x, laws, g = setup
    g2 = {n: v for n, v in g.items() if not n.startswith("layers.0.mlp.down_proj")}
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.weight.*no gradient.*ignore=\['layers.0.mlp/unit'\]"):
        check_gradients(m, laws=laws, grads=g2, loss="ce")
    with pytest.raises(ValueError, match="no gradient to check"):
        m.zero_grad()
        check_gradients(m, laws=laws)


def test_a_compiled_model_is_checked_under_the_names_of_the_model_inside():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def ce(model, b):
        return F.cross_entropy(model(b[0]), b[1])

    plain = check_gradients(m, ce, (x, y))
    compiled = check_gradients(torch.compile(m, backend="eager"), ce, (x, y))
    assert plain.ok and compiled.ok and [c.name for c in compiled.laws] == [c.name for c in plain.laws]
    assert {c.family for c in plain.laws} == {"gain", "relu"}
