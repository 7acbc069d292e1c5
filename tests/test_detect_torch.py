"""Detection of torch.nn and timm structures (conserve/detection/torchnn.py, timm_models.py).

For every model: (a) each detected law passes the spec's first-order check (float64 autograd, random
parameters and inputs, ``conserve.verify.first_order``); (b) a planted wrong law fails that check;
(c) declined blocks carry the expected reason, and nothing with parameters is dropped silently.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from conserve.detection import detect
from conserve.kernels import evaluate_reference
from conserve.laws import (DeepLinearGram, GainBalance, QKGram, ReLUUnit, Translation, VOGram, cols, compile_laws, rows,
                          vector)
from conserve.analysis.verify import TOL, first_order

WRONG = 1e-6  # a planted wrong law violates the first-order check by far more than this


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """float64, eval mode, every parameter drawn N(0, 0.5^2) (+1 for gains) so no law is trivially balanced."""
    g = torch.Generator().manual_seed(seed)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if name.endswith(("norm.weight", "gamma")) else 0.0))
    return model


def violations(model, laws, x, *, trials: int = 2, seed: int = 0) -> dict[str, float]:
    """Spec check 1 for many laws at once: ``conserve.verify.first_order``'s measure (worst
    ``|<grad (s.h), grad (r.f)>| / (||.|| ||.||)`` over random s, r in float64; the cross-entropy gradient
    for translation laws), with the model gradients computed once per trial and shared by every law
    (the CPU budget does not allow one forward/backward per law). ``test_shared_check_agrees_with_verify``
    ties it to ``first_order``."""
    g = torch.Generator().manual_seed(seed)
    params = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    plist = list(params.values())

    def flat(grads):
        return torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(grads, plist)])

    raw, ce = [], []
    for _ in range(trials):
        out = functional_call(model, {**params, **{k: b.detach().clone() for k, b in buffers.items()}}, (x,))
        if isinstance(out, (tuple, list)):  # (logits, loss) models: the first output
            out = out[0]
        r = torch.randn(out.shape, generator=g, dtype=torch.float64)
        raw.append(flat(torch.autograd.grad((r * out).sum(), plist, retain_graph=True, allow_unused=True)))
        tgt = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))
        ce.append(flat(torch.autograd.grad(loss, plist, allow_unused=True)))
    out = {}
    for law in laws:
        c = compile_laws([law], {k: tuple(v.shape) for k, v in params.items()})
        vec, grams = evaluate_reference(c.plan, [params[n] for n in c.names], fp64=True)
        h = c.split(vec, grams)[0].reshape(-1)
        worst = 0.0
        for b in (ce if isinstance(law, Translation) else raw):
            s = torch.randn(h.shape, generator=g, dtype=torch.float64)
            a = flat(torch.autograd.grad((s * h).sum(), plist, retain_graph=True, allow_unused=True))
            assert a.norm() > 0, f"{law.name} reads no trainable parameter"
            worst = max(worst, float((a @ b).abs() / (a.norm() * b.norm())))
        out[law.name] = worst
    return out


def assert_all_hold(model, found, x):
    assert found.laws, "no law detected"
    bad = {k: v for k, v in violations(model, found.laws, x).items() if v > TOL}
    assert not bad, bad


def assert_all_fail(model, planted: dict, x):
    v = violations(model, [dataclasses.replace(law, name=what) for what, law in planted.items()], x)
    weak = {what: v[what] for what in planted if v[what] <= WRONG}
    assert not weak, f"planted wrong laws pass the check: {weak}"


def reasons(found) -> dict[str, str]:
    return {d.module: d.reason for d in found.declined}


# --------------------------------------------------------------------------------------- MHA
class SelfAttention(nn.Module):
    """One nn.MultiheadAttention fed slices of x as query / key / value (so kdim/vdim variants work)."""

    def __init__(self, e=8, heads=2, kdim=None, vdim=None, **kw):
        super().__init__()
        self.e, self.kd, self.vd = e, kdim or e, vdim or e
        self.mha = nn.MultiheadAttention(e, heads, kdim=kdim, vdim=vdim, batch_first=True, **kw)

    def forward(self, x):
        q, k, v = x[..., : self.e], x[..., self.e: self.e + self.kd], x[..., self.e + self.kd:]
        return self.mha(q, k, v, need_weights=False)[0]

    def inputs(self, seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 5, self.e + self.kd + self.vd, generator=g, dtype=torch.float64)


MHA_CASES = {"fused": {}, "separate_kv": dict(kdim=4, vdim=6), "bias_kv": dict(add_bias_kv=True),
             "no_bias_separate_bias_kv": dict(bias=False, kdim=5, vdim=3, add_bias_kv=True),
             "zero_attn": dict(add_zero_attn=True)}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_mha_laws_hold(case):
    m = randomize(SelfAttention(**MHA_CASES[case]))
    found = detect(m)
    assert found.detector == "torch.nn"
    assert found.families() == {"qk": 2, "vo": 2}
    assert found.undetected == []
    assert_all_hold(m, found, m.inputs())


def test_mha_exact_rows_fused_and_planted_wrong_laws():
    m = randomize(SelfAttention(add_bias_kv=True))
    found = detect(m)
    qk1 = next(l for l in found.laws if l.name == "mha/qk/head1")
    # head 1: q rows [4, 8) of in_proj_weight, k rows [8 + 4, 8 + 8), its biases and bias_k entries [4, 8)
    refs = {(t.ref.param, t.ref.start, t.ref.rows, t.sign) for t in qk1.terms}
    assert refs == {("mha.in_proj_weight", (4, 0), 4, 1.0), ("mha.in_proj_bias", (4,), 4, 1.0),
                    ("mha.in_proj_weight", (12, 0), 4, -1.0), ("mha.in_proj_bias", (12,), 4, -1.0),
                    ("mha.bias_k", (0, 0, 4), 4, -1.0)}
    x = m.inputs()
    w, b = "mha.in_proj_weight", "mha.in_proj_bias"
    s = m.mha.in_proj_weight.shape
    planted = {
        # key rows of the other head
        "wrong head": QKGram.build("w", None, plus=[rows(w, s, 0, 4), vector(b, 0, 4)],
                                   minus=[rows(w, s, 12, 4), vector(b, 12, 4), vector("mha.bias_k", 4, 4, lead=(0, 0))]),
        # the add_bias_kv key is acted on by the same GL(D): leaving it out breaks the law
        "missing bias_k": QKGram.build("w", None, plus=[rows(w, s, 0, 4), vector(b, 0, 4)],
                                       minus=[rows(w, s, 8, 4), vector(b, 8, 4)]),
        "VO with out_proj rows": VOGram.build("w", None, plus=[rows(w, s, 16, 4), vector(b, 16, 4),
                                                               vector("mha.bias_v", 0, 4, lead=(0, 0))],
                                              minus=[rows("mha.out_proj.weight", (8, 8), 0, 4)]),
    }
    assert_all_fail(m, planted, x)


def test_shared_check_agrees_with_verify():
    m = randomize(SelfAttention(add_bias_kv=True))
    x = m.inputs()
    law = detect(m).laws[0]
    wrong = QKGram.build("w", None, plus=[rows("mha.in_proj_weight", (24, 8), 0, 4)],
                         minus=[rows("mha.in_proj_weight", (24, 8), 8, 4)])  # bias terms left out
    assert first_order(m, law, x) <= TOL and violations(m, [law], x)[law.name] <= TOL
    assert first_order(m, wrong, x) > WRONG and violations(m, [wrong], x)["w"] > WRONG


# ---------------------------------------------------------------------------- encoder layers
def encoder(norm_first=True, activation="relu", layers=2, final_norm=False):
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation=activation, norm_first=norm_first,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(8) if final_norm else None,
                                 enable_nested_tensor=False)


def x_seq(seed=1, e=8):
    return torch.randn(2, 5, e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_pre_ln_encoder_relu():
    m = randomize(encoder(norm_first=True, activation="relu", final_norm=True))
    found = detect(m)
    assert found.families() == {"qk": 4, "vo": 4, "relu": 2, "gain": 4}
    assert found.undetected == []
    gain = next(l for l in found.laws if l.name == "layers.0.norm1/gain")
    assert gain.params == ("layers.0.norm1.weight", "layers.0.norm1.bias", "layers.0.self_attn.in_proj_weight")
    assert "readers are outside the encoder" in reasons(found)["norm"]
    x = x_seq()
    assert_all_hold(m, found, x)
    # planted: the gain law without beta (LayerNorm bias) and a unit law reading linear2 rows
    h = 8
    no_beta = GainBalance.build("w", 0, gain=vector("layers.0.norm2.weight", 0, h),
                                readers=[cols("layers.0.linear1.weight", (12, 8), 0, h)])
    bad_unit = ReLUUnit.build("w", 0, up=rows("layers.0.linear1.weight", (12, 8), 0, 8),
                              down=rows("layers.0.linear2.weight", (8, 12), 0, 8))
    assert_all_fail(m, {"no beta": no_beta, "unit on linear2 rows": bad_unit}, x)


def test_post_ln_gelu_encoder_declines():
    m = randomize(encoder(norm_first=False, activation="gelu"))
    found = detect(m)
    assert found.families() == {"qk": 4, "vo": 4}
    r = reasons(found)
    for i in range(2):
        assert "post-LN" in r[f"layers.{i}.norm1"] and "post-LN" in r[f"layers.{i}.norm2"]
        assert "no continuous rescaling symmetry" in r[f"layers.{i}.linear1"]
    assert found.undetected == []
    x = x_seq()
    assert_all_hold(m, found, x)
    # the law a post-LN encoder does NOT have: a pre-norm gain law on norm1
    fake = GainBalance.build("w", 0, gain=vector("layers.0.norm1.weight", 0, 8), beta=vector("layers.0.norm1.bias", 0, 8),
                             readers=[cols("layers.0.self_attn.in_proj_weight", (24, 8), 0, 8)])
    # and the ReLU unit law on a GELU FFN
    fake_unit = ReLUUnit.build("w", 0, up=rows("layers.0.linear1.weight", (12, 8), 0, 12),
                               up_bias=vector("layers.0.linear1.bias", 0, 12),
                               down=cols("layers.0.linear2.weight", (8, 12), 0, 12))
    assert_all_fail(m, {"post-LN gain": fake, "ReLU law on GELU": fake_unit}, x)


# ---------------------------------------------------------------------------------- Sequential
def test_sequential_mlps():
    relu = randomize(nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Dropout(0.0), nn.Linear(7, 6), nn.LeakyReLU(0.1),
                                   nn.Linear(6, 3)))
    lin = randomize(nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 6), nn.Identity(), nn.Linear(6, 3, bias=False)))
    gelu = randomize(nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3)))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    f = detect(relu)
    assert f.families() == {"relu": 2} and f.undetected == []
    assert "loss='ce'" in reasons(f)["5"]
    assert_all_hold(relu, f, x)
    f = detect(relu, loss="ce")
    assert f.families() == {"relu": 2, "translation": 1}
    assert_all_hold(relu, f, x)  # translation checked on the cross-entropy gradient
    f = detect(lin)
    assert f.families() == {"deep_linear": 2}
    assert [l.size for l in f.laws] == [4, 6]
    assert_all_hold(lin, f, x)
    f = detect(gelu)
    assert f.laws == [] and "no continuous rescaling symmetry" in reasons(f)["0"]
    # planted: deep-linear Gram without the first layer's bias; the ReLU law on the GELU net
    assert_all_fail(lin, {"no bias": DeepLinearGram.build("w", 0, plus=[rows("0.weight", (4, 5), 0, 4)],
                                                          minus=[cols("1.weight", (6, 4), 0, 4)])}, x)
    assert_all_fail(gelu, {"ReLU law on GELU": ReLUUnit.build("w", 0, up=rows("0.weight", (7, 5), 0, 7),
                                                              up_bias=vector("0.bias", 0, 7),
                                                              down=cols("2.weight", (3, 7), 0, 7))}, x)


class Mixed(nn.Module):
    """A conv stem (no law), a custom parameter (no law) and an MLP and attention that have laws."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(3, 8, 1)
        self.scale = nn.Parameter(torch.ones(8))
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):  # x: (B, 3, T)
        h = self.stem(x).transpose(1, 2) * self.scale
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.mlp(h)


def test_unrecognised_modules_are_listed_frozen_and_tied_are_declined():
    m = randomize(Mixed())
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    found = detect(m)
    assert found.families() == {"qk": 2, "vo": 2, "relu": 1}
    # what the module types do not explain goes to structural detection, which declines it with the reason
    assert found.detector == "torch.nn+graph" and found.undetected == []
    assert "no catalogue block" in reasons(found)["stem"] and "not only by linear maps" in reasons(found)["scale"]
    assert_all_hold(m, found, x)
    m.mlp[2].weight.requires_grad_(False)
    found = detect(m)
    assert found.families() == {"qk": 2, "vo": 2}
    assert "frozen" in reasons(found)["mlp.0-2/unit"] and "mlp.2.weight" in reasons(found)["mlp.0-2/unit"]
    tied = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    found = detect(tied)
    assert found.laws == [] and "tied" in reasons(found)["0-2/unit"]


def test_wrappers_and_meta_device():
    m = randomize(encoder(norm_first=True))
    ref = detect(m)
    key = [(l.name, l.family, l.size, [(t.ref, t.sign) for t in l.terms]) for l in ref.laws]
    for wrapped in (torch.compile(m), nn.DataParallel(m)):
        f = detect(wrapped)
        assert [(l.name, l.family, l.size, [(t.ref, t.sign) for t in l.terms]) for l in f.laws] == key
    with torch.device("meta"):
        meta = encoder(norm_first=True)
    f = detect(meta)
    assert [(l.name, l.family, l.size, [(t.ref, t.sign) for t in l.terms]) for l in f.laws] == key


def test_nothing_recognised_raises():
    from conserve.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="no detector recognises"):
        detect(nn.Conv2d(3, 4, 3))


# ---------------------------------------------------------------------------------------- timm
try:  # timm imports torchvision, which fails to load (RuntimeError) when its build does not match torch
    import timm.models.vision_transformer as timm_vit
    TIMM_MISSING = ""
except (ImportError, RuntimeError) as e:  # pragma: no cover - environment dependent
    timm_vit, TIMM_MISSING = None, f"timm unavailable: {e}"
needs_timm = pytest.mark.skipif(timm_vit is None, reason=TIMM_MISSING)


def vit(**kw):
    base = dict(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2, num_classes=3)
    base.update(kw)
    return randomize(timm_vit.VisionTransformer(**base))


def images(seed=4):
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


TIMM_CASES = {
    "token": (dict(), {"qk": 2, "vo": 2, "gain": 3, "translation": 1}),
    "layerscale": (dict(init_values=0.5), {"qk": 2, "vo": 2, "layer_scale": 2, "gain": 3, "translation": 1}),
    "avg_fc_norm": (dict(global_pool="avg", class_token=False), {"qk": 2, "vo": 2, "gain": 3, "translation": 1}),
    "max_relu_reg": (dict(global_pool="max", fc_norm=False, act_layer=nn.ReLU, reg_tokens=2, init_values=0.3),
                     {"qk": 2, "vo": 2, "relu": 1, "layer_scale": 2, "gain": 3, "translation": 1}),
    "swiglu_nobias": (dict(mlp_layer=timm_vit.SwiGLU if timm_vit else None, act_layer=nn.SiLU, qkv_bias=False, depth=2),
                      {"qk": 4, "vo": 4, "swiglu": 2, "gain": 5, "translation": 1}),
}


@needs_timm
@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_timm_vit_laws_hold(case):
    kw, fams = TIMM_CASES[case]
    m = vit(**kw)
    found = detect(m)
    assert found.detector == "timm"
    assert found.families() == fams
    assert found.undetected == []
    r = reasons(found)
    assert "residual stream" in r["patch_embed"] and "residual stream" in r["pos_embed"]
    if "act_layer" not in kw:
        assert "no continuous rescaling symmetry" in r["blocks.0.mlp"]
    assert_all_hold(m, found, images())


@needs_timm
def test_timm_exact_rows_and_planted_wrong_laws():
    m = vit(init_values=0.5)
    found = detect(m)
    byname = {l.name: l for l in found.laws}
    vo1 = byname["blocks.0.attn/vo/head1"]
    # V of head 1: rows 2*8 + 4 .. 2*8 + 8 of the fused qkv, and its bias; O_1 = proj columns 4..8
    assert {(t.ref.param, t.ref.start, t.ref.rows, t.sign) for t in vo1.terms} == {
        ("blocks.0.attn.qkv.weight", (20, 0), 4, 1.0), ("blocks.0.attn.qkv.bias", (20,), 4, 1.0),
        ("blocks.0.attn.proj.weight", (0, 4), 4, -1.0)}
    assert byname["norm/gain"].params == ("norm.weight", "norm.bias", "head.weight")
    x = images()
    s = (24, 8)
    planted = {
        # Q of head 0 against the V rows instead of K
        "q vs v": QKGram.build("w", 0, plus=[rows("blocks.0.attn.qkv.weight", s, 0, 4), vector("blocks.0.attn.qkv.bias", 0, 4)],
                               minus=[rows("blocks.0.attn.qkv.weight", s, 16, 4), vector("blocks.0.attn.qkv.bias", 16, 4)]),
        # LayerScale law without proj's bias
        "layerscale no bias": GainBalance.build("w", 0, gain=vector("blocks.0.ls1.gamma", 0, 8),
                                                readers=[rows("blocks.0.attn.proj.weight", (8, 8), 0, 8)]),
        # gain of norm1 read by q and k only (v columns left out)
        "gain without v": GainBalance.build("w", 0, gain=vector("blocks.0.norm1.weight", 0, 8),
                                            beta=vector("blocks.0.norm1.bias", 0, 8),
                                            readers=[cols("blocks.0.attn.qkv.weight", (16, 8), 0, 8)]),  # rows [0, 16)
    }
    assert_all_fail(m, planted, x)


@needs_timm
def test_timm_qk_norm():
    m = vit(qk_norm=True)
    found = detect(m)
    r = reasons(found)
    assert "QK-norm" in r["blocks.0.attn.qkv"]
    assert "eps=1e-06" in r["blocks.0.attn/qk_scale/q_head0"] and "approximate=True" in r["blocks.0.attn/qk_scale/q_head0"]
    assert found.families() == {"vo": 2, "gain": 3, "qk_norm_gain": 1, "translation": 1}  # norm1, norm2, final
    x = images()
    assert_all_hold(m, found, x)
    approx = detect(m, approximate=True)
    scale = [l for l in approx.laws if l.family == "qk_scale"]
    assert len(scale) == 4
    worst = max(violations(m, scale, x).values())
    assert TOL < worst < 1e-4  # conserved only up to O(eps)
    for blk in m.blocks:
        blk.attn.q_norm.eps = blk.attn.k_norm.eps = 0.0
    exact = detect(m)
    assert exact.families()["qk_scale"] == 4
    assert_all_hold(m, exact, x)


@needs_timm
def test_timm_heads_declined():
    r = reasons(detect(vit(num_classes=0)))
    assert "no classifier head" in r["norm"]
    m = vit(global_pool="map")
    f = detect(m)
    assert "attention pool" in reasons(f)["norm"]
    assert "attn_pool.q" in f.undetected and "attn_pool.kv" in f.undetected
    assert_all_hold(m, f, images())
    f = detect(vit(), loss="mse")
    assert "translation" not in f.families() and "cross-entropy" in reasons(f)["head"]


def test_sequential_inside_a_layer_stack_takes_the_block_index():
    """QA: laws of a Sequential MLP inside ``layers.<i>`` are binned under layer i (not the Linear's position)."""
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))

        def forward(self, x):
            return x + self.mlp(x)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Blk(), Blk()])

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    laws = [l for l in detect(M()).laws if l.family == "relu"]
    assert sorted((l.name.split(".")[1], l.layer) for l in laws) == [("0", 0), ("1", 1)]


class _SequentialBypassed(nn.Module):
    """QA: the Sequential's layers called one by one with tanh in place of its ReLU (``skip``), or its hidden
    layer also read by another Linear (``aux``): the module type's unit law is wrong for this model."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.mlp = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))
        self.aux = nn.Linear(6, 2)

    def forward(self, x):
        if self.how == "skip":
            return self.mlp[2](torch.tanh(self.mlp[0](x))) + self.aux.weight.sum()
        h = self.mlp[1](self.mlp[0](x))
        return torch.cat([self.mlp[2](h), self.aux(h)], -1)


@pytest.mark.parametrize("how", ["skip", "aux"])
def test_module_type_law_the_forward_breaks_is_declined_not_claimed(how):
    m = randomize(_SequentialBypassed(how))
    wrong = ReLUUnit.build("w", 0, up=rows("mlp.0.weight", (6, 8), 0, 6), up_bias=vector("mlp.0.bias", 0, 6),
                           down=cols("mlp.2.weight", (8, 6), 0, 6))
    assert first_order(m, wrong, x_seq()) > WRONG  # the law the Sequential's type alone would give
    found = detect(m)
    assert "relu" not in found.families()
    assert "fails the first-order check on the model's forward" in reasons(found)["mlp.0-2/unit"]


class _Decoder(nn.Module):
    def __init__(self, norm_first):
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(8, 2, 12, dropout=0.0, activation="relu", norm_first=norm_first,
                                              batch_first=True)

    def forward(self, x):
        return self.dec(x, x[:, :3])


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_decoder_layer_is_traced_through(norm_first):
    """QA: fx keeps every torch.nn module a leaf, so structural detection saw nn.TransformerDecoderLayer as one
    call and declined its FFN and norms as 'not used by the traced forward'; its ReLU FFN law (and, pre-LN, the
    gain law of the norm before the FFN) are found and hold."""
    m = randomize(_Decoder(norm_first))
    found = detect(m)
    assert found.undetected == [] and not any("not used by the traced forward" in d.reason for d in found.declined)
    fam = found.families()
    assert fam["qk"] == fam["vo"] == 4 and fam["relu"] == 1 and fam.get("gain", 0) == (1 if norm_first else 0)
    assert_all_hold(m, found, x_seq())


def test_parametrized_weights_are_declined_not_raised():
    """QA: ``weight_norm`` / ``spectral_norm`` make ``weight`` a computed tensor (the parameters are
    ``parametrizations.weight.original*``): detection raised ValueError ('reads 0.weight, which is not a
    parameter'); the law is declined naming the parametrization, the other laws stay."""
    from torch.nn.utils import parametrizations

    m = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 5))
    parametrizations.weight_norm(m[0])
    assert "parametrize" in reasons(detect(m))["0-2/unit"]
    enc = encoder(norm_first=True, layers=1)
    parametrizations.spectral_norm(enc.layers[0].linear1)
    found = detect(enc)
    assert found.families() == {"qk": 2, "vo": 2, "gain": 1}
    assert "weight_norm" in reasons(found)["layers.0/ffn/unit"]


def test_lazy_parameters_get_a_one_line_error():
    """QA: an ``nn.LazyLinear`` not yet run made detection (and ``conserve.track``) fail with torch's
    'Can't access the shape of an uninitialized parameter'; now a UsageError naming the fix; after one forward
    the model is detected."""
    import conserve
    from conserve.errors import UsageError

    m = nn.Sequential(nn.LazyLinear(6), nn.ReLU(), nn.Linear(6, 3))
    with pytest.raises(UsageError, match="run one forward pass"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m)
    m(torch.randn(2, 4))
    assert detect(m).families() == {"relu": 1}
