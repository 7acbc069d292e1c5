"""timm coverage (conserve/detection/timm_models.py): ``ParallelScalingBlock`` (fused ``in_proj`` rows
[mlp | q | k | v], ``attn_out_proj`` / fused ``out_proj``, ``in_norm``, LayerScale) and the SwiGLU MLPs
(``SwiGLU`` with any elementwise gate, ``GluMlp`` / ``SwiGLUPacked`` with fc1 rows [x | gate] or [gate | x]).

Every detected law passes the spec's first-order check in float64 (``conserve.verify.first_order``) and
planted wrong laws (the MLP rows read as queries, the keys read as values, the gate half as up) fail it."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

try:
    import timm.layers as timm_layers
    import timm.models.vision_transformer as timm_vit
except Exception as e:  # noqa: BLE001 - timm missing, or its torchvision import broken
    pytest.skip(f"timm not importable: {e}", allow_module_level=True)

from conserve.detection import detect  # noqa: E402
from conserve.laws import QKGram, SwiGLUUnit, VOGram, cols, rows  # noqa: E402
from conserve.analysis.verify import TOL, first_order  # noqa: E402

PSB = timm_vit.ParallelScalingBlock


def vit(**kw):
    base = dict(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2, num_classes=3)
    base.update(kw)
    torch.manual_seed(0)
    m = timm_vit.VisionTransformer(**base).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5
                    + (1.0 if name.endswith(("norm.weight", "gamma")) else 0.0))
    return m


def images():
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def worst(m, laws):
    return {l.name: first_order(m, l, images(), trials=2) for l in laws}


CASES = {
    "psb_gelu": (dict(block_fn=PSB), {"qk": 2, "vo": 2, "gain": 2, "translation": 1}),
    "psb_relu_bias_ls": (dict(block_fn=PSB, act_layer=nn.ReLU, qkv_bias=True, init_values=0.5),
                         {"qk": 2, "vo": 2, "relu": 1, "layer_scale": 1, "gain": 2, "translation": 1}),
    "psb_fused_out_proj": (dict(block_fn=functools.partial(PSB, fuse_out_proj=True), act_layer=nn.ReLU, init_values=0.5),
                           {"qk": 2, "vo": 2, "relu": 1, "layer_scale": 1, "gain": 2, "translation": 1}),
    "psb_qk_norm": (dict(block_fn=PSB, qk_norm=True), {"qk_norm_gain": 1, "vo": 2, "gain": 2, "translation": 1}),
    "swiglu_packed": (dict(mlp_layer=timm_layers.SwiGLUPacked, act_layer=nn.SiLU, mlp_ratio=4),
                      {"qk": 2, "vo": 2, "swiglu": 1, "gain": 3, "translation": 1}),
    "glu_gate_last": (dict(mlp_layer=timm_layers.GluMlp, mlp_ratio=4), {"qk": 2, "vo": 2, "swiglu": 1, "gain": 3,
                                                                        "translation": 1}),
    "swiglu_gelu_gate": (dict(mlp_layer=timm_layers.SwiGLU, act_layer=nn.GELU),
                         {"qk": 2, "vo": 2, "swiglu": 1, "gain": 3, "translation": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_laws_hold(case):
    kw, fams = CASES[case]
    m = vit(**kw)
    d = detect(m)
    assert d.detector == "timm" and d.families() == fams and d.undetected == [], (d.families(), d.undetected)
    bad = {k: v for k, v in worst(m, d.laws).items() if v > TOL}
    assert not bad, bad


def test_parallel_block_rows_reasons_and_planted_wrong_laws():
    m = vit(block_fn=PSB)
    d = detect(m)
    by = {l.name: l for l in d.laws}
    M, C, D = 16, 8, 4  # mlp hidden, width, head_dim
    ip = "blocks.0.in_proj.weight"
    q1 = by["blocks.0/qk/head1"].terms[0].ref
    assert (q1.param, q1.start, q1.rows) == (ip, (M + D, 0), D)
    v0 = by["blocks.0/vo/head0"].terms[0].ref
    assert v0.start == (M + 2 * C, 0)
    assert [x for x in d.declined if x.module == "blocks.0.mlp_act" and "rescaling" in x.reason]
    shape = (M + 3 * C, C)
    planted = [QKGram.build("bad", 0, plus=[rows(ip, shape, 0, D)], minus=[rows(ip, shape, M + C, D)]),  # mlp rows as q
               VOGram.build("bad", 0, plus=[rows(ip, shape, M + C, D)],  # keys as values
                            minus=[cols("blocks.0.attn_out_proj.weight", (C, C), 0, D)])]
    for law in planted:
        assert first_order(m, law, images(), trials=2) > 1e-6, law


def test_parallel_block_qk_norm_eps_and_approximate():
    m = vit(block_fn=PSB, qk_norm=True)
    d = detect(m)
    assert [x for x in d.declined if x.block == "QK-norm scale law" and "eps=1e-06" in x.reason]
    approx = [l for l in detect(m, approximate=True).laws if l.family == "qk_scale"]
    assert len(approx) == 4
    assert first_order(m, approx[0], images(), trials=2) > 1e-12  # only approximate: the check sees the eps


def test_packed_glu_reads_the_ungated_half():
    for layer, act, up0 in ((timm_layers.SwiGLUPacked, nn.SiLU, 16), (timm_layers.GluMlp, nn.Sigmoid, 0)):
        m = vit(mlp_layer=layer, act_layer=act, mlp_ratio=4)
        unit = next(l for l in detect(m).laws if l.family == "swiglu")
        assert unit.terms[0].ref.start == (up0, 0)
        wrong = SwiGLUUnit.build("bad", 0, up=rows("blocks.0.mlp.fc1.weight", (32, 8), 16 - up0, 16),
                                 down=cols("blocks.0.mlp.fc2.weight", (8, 16), 0, 16))
        assert first_order(m, wrong, images(), trials=2) > 1e-6


def test_deit_distilled_final_norm_is_read_by_both_heads():
    """DeiT distilled: the final norm feeds head (class token) and head_dist (distillation token), averaged at
    inference. The gain law reads both heads' columns (with head alone it fails the first-order check), each
    head has its translation law, and the distillation token is declined like the class token."""
    import timm.models.deit as deit

    torch.manual_seed(0)
    m = deit.VisionTransformerDistilled(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2,
                                        num_classes=3).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
    d = detect(m)
    assert d.undetected == [] and "dist_token" in {x.module for x in d.declined}
    gain = next(l for l in d.laws if l.name == "norm/gain")
    assert {"head.weight", "head_dist.weight"} <= set(gain.params)
    assert {l.name for l in d.laws if l.family == "translation"} == {"head/translation", "head_dist/translation"}
    assert max(worst(m, d.laws).values()) <= TOL
    alone = dataclasses.replace(gain, terms=[t for t in gain.terms if t.ref.param != "head_dist.weight"])
    assert first_order(m, alone, images(), trials=2) > 1e-6


def test_models_that_run_only_at_their_declared_image_size_are_probed_at_it():
    """QA: Swin (window partition) runs only at its ``img_size``; structural detection probed every conv model at
    8x8 and raised UnsupportedModelError ('cannot synthesise an input'). The declared size is tried first: its
    QK/VO laws are found and hold on the model's own forward."""
    import timm

    torch.manual_seed(0)
    m = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=16, patch_size=4, window_size=2,
                          depths=(1,), num_heads=(2,), embed_dim=8, num_classes=3).double().eval()
    d = detect(m)
    assert d.families()["qk"] == 2 and d.families()["vo"] == 2 and d.undetected == []
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert max(first_order(m, l, x, trials=1) for l in d.laws) <= TOL


class _CappedViT(timm_vit.VisionTransformer):
    """A user subclass soft-capping the logits in its own forward_head."""

    def forward_head(self, x, pre_logits: bool = False):
        return 2 * torch.tanh(super().forward_head(x, pre_logits) / 2)


def test_user_subclass_of_a_timm_vit_is_checked():
    """QA: the timm detector reads timm's code; a subclass whose forward_head soft-caps the logits got the
    translation law (broken by the cap). Its laws are now checked on the model's forward: the translation law is
    declined naming the class, the block laws are kept and hold."""
    torch.manual_seed(0)
    m = _CappedViT(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, mlp_ratio=2, num_classes=3).double()
    d = detect(m)
    assert d.detector == "timm" and "translation" not in d.families() and d.families()["qk"] == 2
    assert "is not timm's code" in next(x.reason for x in d.declined if x.module == "head/translation")
    assert max(worst(m, d.laws).values()) <= TOL


def test_structural_detection_of_a_plain_vit_agrees_with_the_timm_detector():
    """timm's LayerNorm calls ``F.layer_norm(x, shape, weight=..., bias=...)``: the bias passed by keyword is part of
    the gain law (without it the law fails its check and was declined)."""
    from conserve.detection.graph import detect_graph

    m = vit(depth=2)
    named, found = detect(m), detect_graph(m, loss="ce")
    gains = {l.name: set(l.params) for l in found.laws if l.family == "gain"}
    assert {l.name: set(l.params) for l in named.laws if l.family == "gain"} == gains and len(gains) == 5
    assert {"blocks.0.norm1.weight", "blocks.0.norm1.bias"} <= gains["blocks.0.norm1/gain"]
    assert max(worst(m, found.laws).values()) <= TOL
