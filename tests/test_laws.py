"""Every law family on the reference models passes the spec's checks 1 (first order, autograd) and 2
(symmetry action) in float64, and wrong laws fail them (the checks have teeth)."""
import pytest
import torch

from conserve.laws import QKGram, RopePairs, compile_laws, evaluate_laws, rows
from conserve.models import MLP, DecoderLM, LMConfig, ViT, ViTConfig
from conserve.analysis.verify import TOL, example_inputs, first_order, symmetry, verify

TINY = dict(vocab_size=11, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
            num_hidden_layers=1)

LM_SWITCHES = {
    "mha-sinusoidal-swiglu": dict(num_key_value_heads=4, position="sinusoidal"),
    "gqa-rope-half-bias": dict(position="rope", attention_bias=True, mlp_bias=True),
    "mqa-rope-interleaved-relu": dict(num_key_value_heads=1, position="rope", rope_layout="interleaved", hidden_act="relu"),
    "partial-rotary-learned-gelu": dict(position="rope", rotary_dim=2, hidden_act="gelu"),
    "nope-silu": dict(position="none", hidden_act="silu"),
    "moe-softmax-top2-shared": dict(position="rope", num_experts=3, top_k=2, shared_expert=True, mlp_bias=True),
    "moe-softmax-top1-dense-renorm-off": dict(position="none", num_experts=2, top_k=1, norm_topk_prob=False),
    "moe-sigmoid-top2": dict(position="rope", num_experts=3, top_k=2, router="sigmoid"),
    "learned-pe-tied": dict(position="learned", tie_word_embeddings=True, num_hidden_layers=2, nope_layers=(1,)),
}


def _check_all(model, expect_families=None):
    checks = verify(model, trials=2)
    bad = [(c.law, c.first_order, c.symmetry) for c in checks if not c.ok]
    assert not bad, f"laws failing the spec checks: {bad}"
    fams = {c.family for c in checks}
    if expect_families:
        assert set(expect_families) <= fams, fams
    return checks


@pytest.mark.parametrize("name", list(LM_SWITCHES))
def test_reference_lm_laws_pass_checks_1_and_2(name):
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(**{**TINY, **LM_SWITCHES[name]}))
    checks = _check_all(model)
    fams = {c.family for c in checks}
    cfg = model.config
    assert "vo" in fams and "gain" in fams
    assert ("rope_pair" in fams) == (cfg.position == "rope")
    assert ("qk" in fams) == (cfg.position != "rope" or bool(cfg.nope_layers))
    assert ("rope_pass" in fams) == bool(cfg.rotary_dim and cfg.rotary_dim < cfg.head_dim)
    assert ("translation" in fams) == (not cfg.tie_word_embeddings)
    assert ("router_sum" in fams) == (cfg.num_experts > 0 and cfg.router == "softmax")


def test_declined_blocks_carry_reasons():
    m = DecoderLM(LMConfig(**{**TINY, "num_experts": 3, "top_k": 2, "router": "sigmoid", "hidden_act": "gelu",
                              "moe_layers": (0,), "tie_word_embeddings": True}))
    _, declined = m.conservation_laws()
    reasons = " | ".join(f"{d.module}: {d.reason}" for d in declined)
    assert "router" in reasons and "not conserved" in reasons
    assert "tied" in " ".join(d.block for d in declined)
    m2 = DecoderLM(LMConfig(**{**TINY, "hidden_act": "gelu"}))
    assert any("GELU" in d.block for d in m2.conservation_laws()[1])


def test_vit_and_mlp_laws_pass():
    torch.manual_seed(0)
    vit = ViT(ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_attention_heads=2, intermediate_size=8,
                        num_hidden_layers=1, hidden_act="relu", num_classes=3))
    _check_all(vit, {"qk", "vo", "relu", "gain", "translation"})
    _check_all(MLP([3, 5, 4, 2], None), {"deep_linear"})
    _check_all(MLP([3, 5, 4, 2], "relu"), {"relu"})


def _rope_model(layout="half"):
    torch.manual_seed(1)
    return DecoderLM(LMConfig(**{**TINY, "position": "rope", "rope_layout": layout}))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_wrong_rope_pairing_fails_first_order(layout):
    m = _rope_model(layout)
    x = example_inputs(m, generator=torch.Generator().manual_seed(0))
    other = "interleaved" if layout == "half" else "half"
    q, k = m.layers[0].self_attn.q_proj.weight.shape, m.layers[0].self_attn.k_proj.weight.shape

    def law(lay):
        return RopePairs.build("wrong", 0, q_weight="layers.0.self_attn.q_proj.weight", q_shape=q, q_starts=[0, 4],
                               k_weight="layers.0.self_attn.k_proj.weight", k_shape=k, k_starts=[0], rotary_dim=4,
                               layout=lay)

    m64 = m.double()
    assert first_order(m64, law(layout), x) <= TOL
    assert first_order(m64, law(other), x) > 1e-6


def test_plain_qk_gram_under_rope_and_wrong_kv_group_fail():
    m = _rope_model().double()
    x = example_inputs(m, generator=torch.Generator().manual_seed(0))
    q, k = m.layers[0].self_attn.q_proj.weight.shape, m.layers[0].self_attn.k_proj.weight.shape
    qk = QKGram.build("qk-under-rope", 0, plus=[rows("layers.0.self_attn.q_proj.weight", q, 0, 4)],
                      minus=[rows("layers.0.self_attn.k_proj.weight", k, 0, 4)])
    assert first_order(m, qk, x) > 1e-6
    nope = DecoderLM(LMConfig(**{**TINY, "position": "none"})).double()
    right = QKGram.build("right", 0, plus=[rows("layers.0.self_attn.q_proj.weight", q, i * 4, 4) for i in (0, 1)],
                         minus=[rows("layers.0.self_attn.k_proj.weight", k, 0, 4)])
    wrong = QKGram.build("wrong-group", 0, plus=[rows("layers.0.self_attn.q_proj.weight", q, i * 4, 4) for i in (0, 1)],
                         minus=[rows("layers.0.self_attn.k_proj.weight", k, 4, 4)])
    assert first_order(nope, right, x) <= TOL
    assert first_order(nope, wrong, x) > 1e-6
    assert symmetry(nope, wrong, x) > 1e-6


def test_gain_law_missing_a_reader_fails():
    m = DecoderLM(LMConfig(**{**TINY, "position": "none"})).double()
    x = example_inputs(m, generator=torch.Generator().manual_seed(0))
    gain = next(l for l in m.conservation_laws()[0] if l.name == "layers.0.input_layernorm/gain")
    assert first_order(m, gain, x) <= TOL
    gain.terms = [t for t in gain.terms if "v_proj" not in t.ref.param]
    assert first_order(m, gain, x) > 1e-6


def test_values_match_closed_form():
    """Law values equal the spec formulas written out with plain indexing (float64)."""
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(**{**TINY, "position": "rope", "rotary_dim": 2, "attention_bias": True,
                              "mlp_bias": True, "nope_layers": ()})).double()
    laws, _ = m.conservation_laws()
    vals = evaluate_laws(laws, dict(m.named_parameters()), fp64=True)
    a = m.layers[0].self_attn
    d, r = 4, 2
    Wq, bq, Wk, bk, Wv, bv, Wo = (a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
                                  a.v_proj.bias, a.o_proj.weight)
    # group 1 reads query heads 2, 3 and kv head 1
    exp_pair = sum(Wq[i * d + t].square().sum() + bq[i * d + t] ** 2 for i in (2, 3) for t in (0, 1)) \
        - sum(Wk[d + t].square().sum() + bk[d + t] ** 2 for t in (0, 1))
    torch.testing.assert_close(vals["layers.0.self_attn/rope/group1"], exp_pair.reshape(1))
    Qp = [torch.cat([Wq[i * d + r:(i + 1) * d], bq[i * d + r:(i + 1) * d, None]], 1) for i in (2, 3)]
    Kp = torch.cat([Wk[d + r:2 * d], bk[d + r:2 * d, None]], 1)
    torch.testing.assert_close(vals["layers.0.self_attn/rope_pass/group1"], sum(q @ q.T for q in Qp) - Kp @ Kp.T)
    V = torch.cat([Wv[d:2 * d], bv[d:2 * d, None]], 1)
    O = [Wo[:, i * d:(i + 1) * d] for i in (2, 3)]
    torch.testing.assert_close(vals["layers.0.self_attn/vo/group1"], V @ V.T - sum(o.T @ o for o in O))
    f = m.layers[0].mlp
    torch.testing.assert_close(vals["layers.0.mlp/unit"], f.up_proj.weight.square().sum(1) + f.up_proj.bias ** 2
                               - f.down_proj.weight.square().sum(0))
    g = m.layers[0].input_layernorm.weight
    torch.testing.assert_close(vals["layers.0.input_layernorm/gain"],
                               g ** 2 - sum(w.square().sum(0) for w in (Wq, Wk, Wv)))
    torch.testing.assert_close(vals["lm_head/translation"], m.lm_head.weight.sum(0))


def test_compile_rejects_bad_refs():
    with pytest.raises(ValueError, match="not a parameter"):
        compile_laws([QKGram.build("x", 0, plus=[rows("nope", (4, 4), 0, 2)], minus=[])], {"w": (4, 4)})
    with pytest.raises(ValueError, match="does not fit"):
        compile_laws([QKGram.build("x", 0, plus=[rows("w", (4, 4), 3, 2)], minus=[])], {"w": (4, 4)})


def test_verify_api_flags_wrong_laws_and_checks_user_functions():
    """``conserve.verify`` on a mix: detected laws pass, a planted wrong law and a wrong user h fail,
    a right user h (the SwiGLU law written by hand) passes."""
    import conserve

    m = DecoderLM(LMConfig(**{**TINY, "position": "none"}))
    q, k = m.layers[0].self_attn.q_proj.weight.shape, m.layers[0].self_attn.k_proj.weight.shape
    wrong = QKGram.build("wrong-group", 0, plus=[rows("layers.0.self_attn.q_proj.weight", q, 0, 4)],
                         minus=[rows("layers.0.self_attn.k_proj.weight", k, 4, 4)])

    def unit_by_hand(p):
        return p["layers.0.mlp.up_proj.weight"].square().sum(1) - p["layers.0.mlp.down_proj.weight"].square().sum(0)

    def gate_by_hand(p):  # the gate is NOT part of the SwiGLU law
        return p["layers.0.mlp.gate_proj.weight"].square().sum(1) - p["layers.0.mlp.down_proj.weight"].square().sum(0)

    right = m.conservation_laws()[0][:2]
    checks = {c.law: c for c in conserve.verify(m, right + [wrong, unit_by_hand, gate_by_hand])}
    assert all(checks[l.name].ok for l in right)
    assert not checks["wrong-group"].ok and checks["wrong-group"].first_order > 1e-6
    assert checks["unit_by_hand"].ok and checks["unit_by_hand"].symmetry is None
    assert not checks["gate_by_hand"].ok


def test_package_level_detect_and_count_stay_callable():
    import conserve
    import conserve.detection.hf  # importing sub-modules must not shadow the functions
    import conserve.counting  # noqa: F401

    m = DecoderLM(LMConfig(**TINY))
    assert conserve.detect(m).laws and conserve.detect(m).laws
    assert callable(conserve.count) and callable(conserve.detect)


def test_verify_runs_on_hf_and_timm_models():
    """QA: ``conserve.verify`` raised on an HF model (its output is a ``ModelOutput``, not a tensor) and on a
    timm ViT (the input was built from the first Linear's width: a 2-D batch for an image model). Now every
    detected law is verified on the model's own float64 forward (HF's float32 upcasts traced away: the check
    resolves 1e-10) and a wrong law still fails."""
    import conserve

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=12, num_hidden_layers=1,
        vocab_size=17, tie_word_embeddings=False)).eval()
    checks = conserve.verify(lm, trials=1)
    assert checks and all(c.ok for c in checks), [(c.law, c.first_order, c.symmetry) for c in checks if not c.ok]
    a = "model.layers.0.self_attn"
    wrong = QKGram.build("no-rope", 0, plus=[rows(f"{a}.q_proj.weight", (16, 16), 0, 4)],
                         minus=[rows(f"{a}.k_proj.weight", (8, 16), 0, 4)])  # a full QK Gram under RoPE
    assert not conserve.verify(lm, [wrong], trials=1)[0].ok
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, depth=1,
                            embed_dim=8, num_heads=2, num_classes=3)
    checks = conserve.verify(vit, trials=1)
    assert checks and all(c.ok for c in checks)


def test_duplicate_law_names_are_refused():
    """QA: ``conserve.track(..., laws=laws + laws)`` was accepted: both copies tracked, ``values()`` kept one
    (the other's entry hidden under the same name). Compiling two laws of one name is now a one-line error."""
    import conserve

    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    laws = conserve.detect(m).laws
    with pytest.raises(ValueError, match="law names must be unique"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, laws=laws + laws)
