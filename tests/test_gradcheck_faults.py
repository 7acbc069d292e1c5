"""Gradient integrity on a training stack (``conserve.check_gradients``; spec "Gradient integrity"):
planted faults are flagged with their family AND layer, each sized against the floor of its gradient's
dtype, and the clean setups of a training stack stay silent at their floor.

Faults: a hook on one head's rows of q / k / v (columns of o); a custom ``autograd.Function`` whose
backward drops one token from a down projection's weight gradient; coupled L2 folded into ``p.grad``
(float32 and bfloat16); router z-loss; ``clip_grad_value_`` (named as a known method).  Clean: global-norm
clipping, ``GradScaler`` with float16 autocast (unscaled first), gradient accumulation, dropout on the
residual stream, bfloat16 autocast, label smoothing, an MoE load-balancing loss.  The 2-rank gloo cases
(DDP, FSDP2, an all-reduce with a wrong divisor) are in ``tests/test_gradcheck_dist.py``."""
import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve.analysis.gradcheck import aggregate_floor, check_gradients, floor
from conserve.models.lm import DecoderLM, LMConfig

CFG = LMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_experts=4, moe_layers=(1,), top_k=2)
D = CFG.hidden_size // CFG.num_attention_heads


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    m = DecoderLM(CFG)
    x = torch.randint(0, CFG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    return m, x, conserve.detect(m, loss="ce")


def _ce(model, batch, **kw):
    return F.cross_entropy(model(batch).flatten(0, 1).float(), batch.flatten(), **kw)


def _bf16(loss_fn):
    def f(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, batch)
    return f


def _router_logits(model, batch, loss_fn=_ce):
    """``(loss, [router logits of each MoE layer])`` from one forward."""
    logits = []
    hooks = [layer.mlp.router.register_forward_hook(lambda mod, i, o: logits.append(o))
             for layer in model.layers if hasattr(layer.mlp, "router")]
    try:
        loss = loss_fn(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return loss, logits


def _flagged(res):
    return {c.name: c for c in res.flagged}


# ------------------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("proj,family", [("q", "rope_pair"), ("k", "rope_pair"), ("v", "vo"), ("o", "vo")])
def test_a_hook_on_one_heads_gradient_flags_that_layers_law(setup, proj, family):
    """One head's rows of q / k / v (columns of o) scaled by 1.001 through a hook on the weight's gradient:
    in float32 (floor 9.5e-7) the head's law of that layer is flagged and no law outside the layer."""
    m, x, laws = setup
    w = getattr(m.layers[0].self_attn, f"{proj}_proj").weight
    head = slice(D, 2 * D)  # query head 1 / kv head 1

    def hook(g):
        g = g.clone()
        if proj == "o":
            g[:, head] *= 1.001
        else:
            g[head] *= 1.001
        return g

    h = w.register_hook(hook)
    try:
        res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    finally:
        h.remove()
    hit = _flagged(res)
    assert hit and {c.layer for c in hit.values()} == {0}, str(res)
    assert any(c.family == family for c in hit.values()), str(res)
    worst = max(c.worst for c in hit.values() if c.family == family)
    assert worst > 10 * floor("float32"), str(res)  # sized against the floor: a clear margin
    assert res.layers() and set(res.layers()) == {0}


def test_a_hook_on_one_heads_gradient_under_bf16_autocast_is_flagged_at_the_bf16_floor(setup):
    """bf16 autocast: its floor (7.8e-3) needs a larger fault: o_proj head 1 doubled."""
    m, x, laws = setup
    w = m.layers[0].self_attn.o_proj.weight
    h = w.register_hook(lambda g: torch.cat([g[:, :D], 2 * g[:, D:2 * D], g[:, 2 * D:]], 1))
    try:
        res = check_gradients(m, _bf16(_ce), x, laws=laws, loss="ce", dtype="bfloat16")
    finally:
        h.remove()
    hit = _flagged(res)
    assert res.floor == floor("bfloat16") and hit, str(res)
    assert {c.layer for c in hit.values()} == {0} and any(c.family == "vo" for c in hit.values()), str(res)


class _DropsLastToken(torch.autograd.Function):
    """``x @ W^T`` whose weight gradient leaves out the last token (a kernel that misses its last tile)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        go2, x2 = go.flatten(0, -2), x.flatten(0, -2)
        return go @ w, go2[:-1].T @ x2[:-1]


def test_a_custom_backward_that_drops_a_token_from_a_down_projection_flags_its_unit_law(setup):
    m, x, laws = setup
    down = m.layers[0].mlp.down_proj
    orig = down.forward
    down.forward = lambda t: _DropsLastToken.apply(t, down.weight)
    try:
        res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    finally:
        down.forward = orig
    assert sorted(_flagged(res)) == ["layers.0.mlp/unit"], str(res)  # no other law reads down_proj


@pytest.mark.parametrize("dtype,wd", [("float32", 1e-4), ("bfloat16", 1e-1)])
def test_coupled_l2_folded_into_the_gradient_is_flagged(setup, dtype, wd):
    """``p.grad += wd * p`` (coupled L2, as ``torch.optim.SGD(weight_decay=)`` does inside ``step``; here folded
    into the gradient the check sees): float32 at wd = 1e-4, bf16 autocast at 0.1 (its floor is 8000x higher).
    The decay's products have one sign per law over the whole run, so most laws are flagged."""
    m, x, laws = setup
    fn = _ce if dtype == "float32" else _bf16(_ce)
    m.zero_grad()
    fn(m, x).backward()
    with torch.no_grad():
        for p in m.parameters():
            p.grad += wd * p
    try:
        res = check_gradients(m, laws=laws, loss="ce", dtype=dtype)
    finally:
        m.zero_grad()
    assert len(res.flagged) >= len(res.laws) // 2 and not res.ok, str(res)
    assert {0, 1} <= {c.layer for c in res.flagged}


def test_router_z_loss_flags_the_moe_layers_router_law(setup):
    m, x, laws = setup

    def z_loss(model, batch):
        loss, logits = _router_logits(model, batch)
        return loss + 1e-3 * torch.logsumexp(logits[0], -1).square().mean()

    hit = _flagged(check_gradients(m, z_loss, x, laws=laws, loss="ce"))
    assert "layers.1.mlp/router" in hit and {c.family for c in hit.values()} == {"router_sum"}


def test_clip_grad_value_is_flagged_and_named_as_a_known_method(setup):
    m, x, laws = setup
    m.zero_grad()
    _ce(m, x).backward()
    top = max(p.grad.abs().max().item() for p in m.parameters())
    torch.nn.utils.clip_grad_value_(m.parameters(), 0.5 * top)
    try:
        res = check_gradients(m, laws=laws, loss="ce")
    finally:
        m.zero_grad()
    assert not res.ok and "clip_grad_value_" in str(res) and "a bug in the gradient" in str(res)


# ------------------------------------------------------------------------------------------------ clean
def test_global_norm_clipping_stays_silent(setup):
    m, x, laws = setup
    m.zero_grad()
    _ce(m, x).backward()
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    try:
        assert total > 1e-2  # the clip scaled the gradient by < 0.1
        res = check_gradients(m, laws=laws, loss="ce")
    finally:
        m.zero_grad()
    assert res.ok, str(res)


def test_grad_scaler_with_float16_autocast_stays_silent_once_unscaled(setup):
    """CPU float16 autocast and ``torch.amp.GradScaler("cpu")``: the gradients are unscaled (``unscale_``)
    before the check, which uses the float16 floors."""
    m, x, laws = setup
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _ce(m, x)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    try:
        res = check_gradients(m, laws=laws, loss="ce", dtype="float16")
        scaled = check_gradients(m, laws=laws, loss="ce", dtype="float16",
                                 grads={n: p.grad * scaler.get_scale() for n, p in m.named_parameters()})
    finally:
        m.zero_grad()
    assert res.ok and res.floor == floor("float16") and res.nonfinite == 0, str(res)
    assert scaled.ok  # one global scale: the statistic does not depend on it


def test_gradient_accumulation_over_micro_batches_stays_silent(setup):
    m, x, laws = setup
    m.zero_grad()
    for part in x.chunk(4):  # four backward passes accumulate into .grad
        (_ce(m, part) / 4).backward()
    try:
        res = check_gradients(m, laws=laws, loss="ce")
    finally:
        m.zero_grad()
    assert res.ok, str(res)


def test_dropout_on_the_residual_stream_stays_silent(setup):
    m, x, laws = setup
    torch.manual_seed(7)
    hooks = [layer.register_forward_hook(lambda mod, i, o: F.dropout(o, 0.2, training=True)) for layer in m.layers]
    try:
        res = check_gradients(m, _ce, x, laws=laws, loss="ce")
    finally:
        for h in hooks:
            h.remove()
    assert res.ok, str(res)


def test_bf16_autocast_and_label_smoothing_stay_silent_at_the_bf16_floor(setup):
    m, x, laws = setup
    res = check_gradients(m, _bf16(lambda mm, b: _ce(mm, b, label_smoothing=0.1)), x, laws=laws, loss="ce",
                          dtype="bfloat16")
    assert res.ok and res.aggregate_floor == aggregate_floor("bfloat16"), str(res)


def test_an_moe_load_balancing_loss_stays_silent(setup):
    """Switch-Transformer auxiliary loss ``E * sum_e f_e P_e`` (``f_e``: the fraction of tokens routed to
    expert e, ``P_e``: the mean router probability): a function of the router's softmax, which the
    router-sum symmetry leaves unchanged."""
    m, x, laws = setup

    def balanced(model, batch):
        loss, logits = _router_logits(model, batch)
        probs = logits[0].float().softmax(-1).flatten(0, -2)
        top = probs.topk(CFG.top_k, -1).indices
        frac = torch.zeros_like(probs).scatter(-1, top, 1.0).mean(0)
        return loss + 0.1 * CFG.num_experts * (frac * probs.mean(0)).sum()

    res = check_gradients(m, balanced, x, laws=laws, loss="ce")
    assert res.ok, str(res)
    g = res.families()["router_sum"]
    assert g["laws"] == 1 and g["worst"] < floor("float32", linear=True) / 4
