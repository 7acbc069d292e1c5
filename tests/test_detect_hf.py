"""Detection of the laws of HF transformers models (conserve.detection.hf), issue 5 part A.

Every family is built from a tiny config with random weights (no download). For each:
(a) every detected law passes the spec's first-order check (float64, random inputs) <= 1e-10;
(b) a planted wrong law (other RoPE pairing, wrong kv group, missing reader, ...) fails it (> 1e-6);
(c) the declined blocks carry the expected reasons; nothing is left undetected.

The HF modeling code upcasts to float32 in places (RMSNorm, softmax, rotary, routers); ``exact64`` runs
the same code with those casts made float64 so the check can resolve 1e-10 (see its docstring).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

from conserve.detection import detect  # noqa: E402
from conserve.detection.hf import FAMILIES, detect_from_config, probe_rope  # noqa: E402
from conserve.errors import UsageError  # noqa: E402
from conserve.laws import (GainBalance, QKGram, RopePairs, RouterSum, ScaleLaw, SwiGLUUnit, Translation, VOGram,  # noqa: E402
                           cols, rows, vector)
from conserve.analysis.verify import TOL, code_in_float64, first_order  # noqa: E402

TINY = dict(hidden_size=16, num_attention_heads=4, intermediate_size=12, num_hidden_layers=1, vocab_size=17)
MOE = ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "qwen3_moe")


def config(name: str, **over):
    c = {
        "gpt2": lambda: T.GPT2Config(n_embd=16, n_head=4, n_layer=1, vocab_size=17, n_positions=32, bos_token_id=0,
                                     eos_token_id=0),
        "llama": lambda: T.LlamaConfig(**TINY, num_key_value_heads=2, head_dim=4),
        "mistral": lambda: T.MistralConfig(**TINY, num_key_value_heads=2, head_dim=6),  # head_dim != H / nH
        "mixtral": lambda: T.MixtralConfig(**TINY, num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2),
        "qwen2": lambda: T.Qwen2Config(**TINY, num_key_value_heads=2),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**TINY, num_key_value_heads=2, moe_intermediate_size=6,
                                              shared_expert_intermediate_size=8, num_experts=3, num_experts_per_tok=2),
        "qwen3": lambda: T.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=4, rms_norm_eps=0.0),
        "gemma": lambda: T.GemmaConfig(**TINY, num_key_value_heads=1, head_dim=6),
        "phi3": lambda: T.Phi3Config(**TINY, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0),
        "gpt_neox": lambda: T.GPTNeoXConfig(**TINY, rotary_pct=0.5, eos_token_id=0, bos_token_id=0),
        "falcon": lambda: T.FalconConfig(hidden_size=16, num_attention_heads=4, num_hidden_layers=1, vocab_size=17,
                                         multi_query=True),
        "bert": lambda: T.BertConfig(**TINY, max_position_embeddings=32),
        "olmoe": lambda: T.OlmoeConfig(**TINY, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2,
                                       rms_norm_eps=0.0),
        "gptj": lambda: T.GPTJConfig(n_embd=24, n_head=4, n_layer=1, vocab_size=17, n_positions=32, rotary_dim=4,
                                     bos_token_id=0, eos_token_id=0),
        "gemma2": lambda: T.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=4, rms_norm_eps=0.0,
                                         tie_word_embeddings=False),  # softcaps: attention 50, final 30
        "gemma3_text": lambda: T.Gemma3TextConfig(**TINY, num_key_value_heads=2, head_dim=4, rms_norm_eps=0.0,
                                                  tie_word_embeddings=False),
        "olmo2": lambda: T.Olmo2Config(**TINY, num_key_value_heads=2, rms_norm_eps=0.0),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**TINY, num_key_value_heads=2, head_dim=4, moe_intermediate_size=6,
                                              num_experts=3, num_experts_per_tok=2, rms_norm_eps=0.0),
        "granite": lambda: T.GraniteConfig(**TINY, num_key_value_heads=2),  # embedding/residual/logit multipliers
        "olmo3": lambda: T.Olmo3Config(**TINY, num_key_value_heads=2, rms_norm_eps=0.0),
        "exaone4": lambda: T.Exaone4Config(**TINY, num_key_value_heads=2, rms_norm_eps=0.0),
        "seed_oss": lambda: T.SeedOssConfig(**TINY, num_key_value_heads=2, head_dim=4),
        "arcee": lambda: T.ArceeConfig(**TINY, num_key_value_heads=2),  # relu^2 MLP: degree-2 unit law
        "glm": lambda: T.GlmConfig(**TINY, num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        "smollm3": lambda: T.SmolLM3Config(**{**TINY, "num_hidden_layers": 2}, num_key_value_heads=2, pad_token_id=0,
                                           bos_token_id=0, eos_token_id=0, no_rope_layers=[1, 0]),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **TINY, num_key_value_heads=4, moe_intermediate_size=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=0, q_lora_rank=8, kv_lora_rank=6, qk_rope_head_dim=2, qk_nope_head_dim=4,
            v_head_dim=4),
    }[name]()
    for k, v in over.items():
        setattr(c, k, v)
    return c


def build(name: str, **over) -> nn.Module:
    torch.manual_seed(0)
    cls = T.AutoModelForMaskedLM if name == "bert" else T.AutoModelForCausalLM
    kw = {"experts_implementation": "eager"} if name in MOE else {}  # grouped_mm has no float64 kernel
    return randomize(cls.from_config(config(name, **over), attn_implementation="eager", **kw).eval())


@torch.no_grad()
def randomize(model: nn.Module) -> nn.Module:
    """Random weights of unit scale: HF's init zeroes biases and keeps routers tiny (0.02), which would let
    a wrong law that misreads a bias or a router pass unnoticed. Meta models are left alone."""
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if p.is_meta:
            continue
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name.lower() else 0.0))
    return model


exact64 = code_in_float64  # the model's own code in float64 (conserve.analysis.verify)


def logits_model(model):
    """Same module, ``forward(input_ids) -> logits`` (what first_order differentiates), float64."""
    model = model.to(torch.float64)
    fwd = type(model).forward
    model.forward = lambda input_ids: fwd(model, input_ids=input_ids, use_cache=False).logits
    return model


def check(model, law) -> float:
    ids = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(1))
    with exact64(model):
        return first_order(model, law, ids, trials=1)


def law(d, name):
    return next(l for l in d.laws if l.name == name)


def without(l, pred):
    return dataclasses.replace(l, terms=[t for t in l.terms if not pred(t)])


def mix(plus_law, minus_law):
    """Plus terms of one law with the minus terms of another (e.g. query heads of group 0 with kv head 1)."""
    return dataclasses.replace(plus_law, terms=[t for t in plus_law.terms if t.sign > 0] +
                               [t for t in minus_law.terms if t.sign < 0])


A = "model.layers.0.self_attn"
M = "model.layers.0.mlp"
EMBED = ("model.embed_tokens", "input embedding")
TIED = ("lm_head", "tied input/output embeddings")
CAUSAL = {"rope_pair": 2, "vo": 2, "gain": 3, "swiglu": 1, "translation": 1}

# name -> (family counts, [(declined module, substring of block + reason)], planted wrong laws)
CASES = {
    "gpt2": ({"qk": 4, "vo": 4, "gain": 2},
             [("transformer.h.0.mlp", "no rescaling symmetry"), ("lm_head", "tied"), ("transformer.ln_f", "tied")],
             lambda m, d: [mix(law(d, "transformer.h.0.attn/qk/group0"), law(d, "transformer.h.0.attn/qk/group1")),
                           # c_proj read as if it were nn.Linear (not Conv1D): the transposition matters
                           VOGram.build("bad", 0, plus=[cols("transformer.h.0.attn.c_attn.weight", (16, 48), 32, 4),
                                                        None],
                                        minus=[cols("transformer.h.0.attn.c_proj.weight", (16, 16), 0, 4)])]),
    "llama": (CAUSAL, [EMBED],
              lambda m, d: [law(detect(m, rope_layout="interleaved"), f"{A}/rope/group0"),
                            mix(law(d, f"{A}/rope/group0"), law(d, f"{A}/rope/group1"))]),
    "mistral": (CAUSAL, [EMBED],
                lambda m, d: [mix(law(d, f"{A}/rope/group1"), law(d, f"{A}/rope/group0")),
                              RopePairs.build("bad", 0, q_weight=f"{A}.q_proj.weight", q_shape=(24, 16), q_starts=[0, 4],
                                              k_weight=f"{A}.k_proj.weight", k_shape=(12, 16), k_starts=[0],
                                              rotary_dim=4, layout="half")]),  # head_dim taken as H / nH = 4
    "mixtral": ({**CAUSAL, "swiglu": 3, "router_sum": 1}, [EMBED],
                lambda m, d: [SwiGLUUnit.build("bad", 0, up=rows(f"{M}.experts.gate_up_proj", (3, 24, 16), 0, 12, lead=(1,)),
                                               down=cols(f"{M}.experts.down_proj", (3, 16, 12), 0, 12, lead=(1,)))]),
    "qwen2": (CAUSAL, [EMBED],
              lambda m, d: [without(law(d, f"{A}/rope/group0"), lambda t: t.ref.param.endswith("k_proj.bias"))]),
    "qwen2_moe": ({**CAUSAL, "swiglu": 4, "router_sum": 1},
                  [EMBED, (f"{M}.shared_expert_gate", "sigmoid")],
                  lambda m, d: [without(law(d, "model.layers.0.post_attention_layernorm/gain"),
                                        lambda t: "shared_expert_gate" in t.ref.param)]),
    "qwen3": ({"qk_scale": 6, "qk_norm_gain": 1, "vo": 2, "gain": 3, "swiglu": 1, "translation": 1},
              [EMBED, (f"{A}.q_proj", "QK-norm")],
              lambda m, d: [RopePairs.build("bad", 0, q_weight=f"{A}.q_proj.weight", q_shape=(16, 16), q_starts=[0, 4],
                                            k_weight=f"{A}.k_proj.weight", k_shape=(8, 16), k_starts=[0], rotary_dim=4,
                                            layout="half"),
                            ScaleLaw.build("bad", 0, blocks=[rows(f"{A}.q_proj.weight", (16, 16), 0, 2)])]),
    "gemma": ({"rope_pair": 1, "vo": 1, "gain": 2, "swiglu": 1}, [EMBED, TIED, ("model.norm", "tied")],
              lambda m, d: [dataclasses.replace(
                  law(d, "model.layers.0.input_layernorm/gain"),
                  terms=[dataclasses.replace(t, shift=0.0) for t in law(d, "model.layers.0.input_layernorm/gain").terms])]),
    "phi3": ({**CAUSAL, "rope_pass": 2}, [EMBED],
             lambda m, d: [RopePairs.build("bad", 0, q_weight=f"{A}.qkv_proj.weight", q_shape=(32, 16), q_starts=[0, 4],
                                           k_weight=f"{A}.qkv_proj.weight", k_shape=(32, 16), k_starts=[16],
                                           rotary_dim=4, layout="half"),  # ignores partial_rotary_factor
                           SwiGLUUnit.build("bad", 0, up=rows(f"{M}.gate_up_proj.weight", (24, 16), 0, 12),
                                            down=cols(f"{M}.down_proj.weight", (16, 12), 0, 12))]),
    "gpt_neox": ({"rope_pair": 4, "rope_pass": 4, "vo": 4, "gain": 3, "translation": 1},
                 [("gpt_neox.layers.0.mlp", "no rescaling symmetry"), ("gpt_neox.embed_in", "input embedding")],
                 # [Q | K | V] blocks instead of NeoX's per-head [q_h k_h v_h]
                 lambda m, d: [RopePairs.build("bad", 0, q_weight="gpt_neox.layers.0.attention.query_key_value.weight",
                                               q_shape=(48, 16), q_starts=[4],
                                               k_weight="gpt_neox.layers.0.attention.query_key_value.weight",
                                               k_shape=(48, 16), k_starts=[20], rotary_dim=2, layout="half",
                                               q_bias="gpt_neox.layers.0.attention.query_key_value.bias",
                                               k_bias="gpt_neox.layers.0.attention.query_key_value.bias")]),
    "falcon": ({"rope_pair": 1, "vo": 1, "gain": 1},
               [("transformer.h.0.mlp", "no rescaling symmetry"), ("lm_head", "tied")],
               # value read at the key's rows of the multi-query layout [Q.. | K | V]
               lambda m, d: [VOGram.build("bad", 0, plus=[rows("transformer.h.0.self_attention.query_key_value.weight",
                                                               (24, 16), 16, 4)],
                                          minus=[cols("transformer.h.0.self_attention.dense.weight", (16, 16), 4 * i, 4)
                                                 for i in range(4)])]),
    # the last layer's output LayerNorm is read only by the MLM head's transform.dense: its gain law holds
    "bert": ({"qk": 4, "vo": 4, "gain": 1},
             [("bert.encoder.layer.0.attention.output.LayerNorm", "post-LN"), ("bert.encoder.layer.0.intermediate",
                                                                               "no rescaling symmetry"),
              ("cls", "tied decoder")],
             lambda m, d: [without(law(d, "bert.encoder.layer.0.attention/qk/group0"),
                                   lambda t: t.ref.param.endswith("bias")),
                           # a gain law as if BERT were pre-LN
                           GainBalance.build("bad", 0, gain=vector("bert.encoder.layer.0.attention.output.LayerNorm.weight", 0, 16),
                                             beta=vector("bert.encoder.layer.0.attention.output.LayerNorm.bias", 0, 16),
                                             readers=[cols("bert.encoder.layer.0.intermediate.dense.weight", (12, 16), 0,
                                                           16)]),
                           # the last output LayerNorm's gain law without its bias (LayerNorm's beta scales too)
                           without(law(d, "bert.encoder.layer.0.output.LayerNorm/gain"),
                                   lambda t: t.ref.param.endswith("LayerNorm.bias"))]),
    "olmoe": ({"qk_scale": 2, "qk_norm_gain": 2, "vo": 2, "gain": 3, "swiglu": 3, "router_sum": 1, "translation": 1},
              [EMBED, (f"{A}.q_proj", "over all heads")],
              # per-head scale law: wrong, OLMoE's q_norm normalises all heads at once
              lambda m, d: [ScaleLaw.build("bad", 0, blocks=[rows(f"{A}.q_proj.weight", (16, 16), 0, 4)])]),
    "gptj": ({"rope_pair": 4, "rope_pass": 4, "vo": 4, "gain": 2, "translation": 1},  # head_dim 6, rotary_dim 4
             [("transformer.h.0.mlp", "no rescaling symmetry"), ("transformer.wte", "input embedding")],
             lambda m, d: [law(detect(m, rope_layout="half"), "transformer.h.0.attn/rope/group0"),
                           without(law(d, "transformer.h.0.ln_1/gain"), lambda t: "fc_in" in t.ref.param),
                           # a QK Gram over the whole head, as if there were no rotary dims
                           QKGram.build("bad", 0, plus=[rows("transformer.h.0.attn.q_proj.weight", (24, 24), 0, 6)],
                                        minus=[rows("transformer.h.0.attn.k_proj.weight", (24, 24), 0, 6)])]),
    "gemma2": ({"rope_pair": 2, "vo": 2, "gain": 3, "swiglu": 1, "norm_scale": 2},
               [EMBED, ("model.layers.0.post_attention_layernorm", "post-norm"),
                ("model.layers.0.post_feedforward_layernorm", "post-norm"), ("lm_head", "final_logit_softcapping")],
               lambda m, d: [
                   # the name-guessing reading: post_attention_layernorm as the MLP's pre-norm
                   GainBalance.build("bad", 0, gain=vector("model.layers.0.post_attention_layernorm.weight", 0, 16),
                                     shift=1.0, readers=[cols(f"{M}.gate_proj.weight", (12, 16), 0, 16),
                                                         cols(f"{M}.up_proj.weight", (12, 16), 0, 16)]),
                   ScaleLaw.build("bad", 0, blocks=[rows(f"{A}.o_proj.weight", (16, 16), 0, 8)]),
                   Translation.build("bad", None, weight=rows("lm_head.weight", (17, 16), 0, 17))]),
    "gemma3_text": ({"qk_scale": 6, "qk_norm_gain": 1, "vo": 2, "gain": 3, "swiglu": 1, "norm_scale": 2,
                     "translation": 1},
                    [EMBED, (f"{A}.q_proj", "QK-norm"), ("model.layers.0.post_feedforward_layernorm", "post-norm")],
                    lambda m, d: [dataclasses.replace(  # q_norm/k_norm gains read as w instead of (1 + w)
                        law(d, f"{A}/qk_norm_gain/group0"),
                        terms=[dataclasses.replace(t, shift=0.0) for t in law(d, f"{A}/qk_norm_gain/group0").terms])]),
    "olmo2": ({"qk_scale": 2, "qk_norm_gain": 2, "vo": 2, "swiglu": 1, "norm_scale": 2, "gain": 1, "translation": 1},
              [EMBED, ("model.layers.0.post_attention_layernorm", "post-norm")],
              lambda m, d: [GainBalance.build("bad", 0, gain=vector("model.layers.0.post_attention_layernorm.weight", 0, 16),
                                              readers=[cols(f"{M}.gate_proj.weight", (12, 16), 0, 16),
                                                       cols(f"{M}.up_proj.weight", (12, 16), 0, 16)]),
                            ScaleLaw.build("bad", 0, blocks=[rows(f"{M}.down_proj.weight", (16, 12), 0, 8)])]),
    "qwen3_moe": ({"qk_scale": 6, "qk_norm_gain": 1, "vo": 2, "gain": 3, "swiglu": 3, "router_sum": 1, "translation": 1},
                  [EMBED, (f"{A}.q_proj", "QK-norm")],
                  lambda m, d: [SwiGLUUnit.build("bad", 0, up=rows(f"{M}.experts.gate_up_proj", (3, 12, 16), 0, 6, lead=(1,)),
                                                 down=cols(f"{M}.experts.down_proj", (3, 16, 6), 0, 6, lead=(1,))),
                                RouterSum.build("bad", 0, weight=rows(f"{M}.gate.weight", (3, 16), 0, 2))]),
    "granite": (CAUSAL, [EMBED], lambda m, d: [mix(law(d, f"{A}/vo/group0"), law(d, f"{A}/vo/group1")),
                                              mix(law(d, f"{A}/rope/group0"), law(d, f"{A}/rope/group1"))]),
    "olmo3": ({"qk_scale": 2, "qk_norm_gain": 2, "vo": 2, "swiglu": 1, "norm_scale": 2, "gain": 1, "translation": 1},
              [EMBED, ("model.layers.0.post_attention_layernorm", "post-norm")],
              lambda m, d: [ScaleLaw.build("bad", 0, blocks=[rows(f"{A}.q_proj.weight", (16, 16), 0, 4)]),
                            mix(law(d, f"{A}/vo/group0"), law(d, f"{A}/vo/group1"))]),
    "exaone4": ({"qk_scale": 6, "qk_norm_gain": 1, "vo": 2, "swiglu": 1, "norm_scale": 2, "gain": 1, "translation": 1},
                [EMBED, ("model.layers.0.post_feedforward_layernorm", "post-norm")],
                lambda m, d: [ScaleLaw.build("bad", 0, blocks=[rows(f"{A}.q_proj.weight", (16, 16), 0, 2)]),
                              mix(law(d, f"{A}/vo/group0"), law(d, f"{A}/vo/group1"))]),
    "seed_oss": (CAUSAL, [EMBED], lambda m, d: [mix(law(d, f"{A}/rope/group0"), law(d, f"{A}/rope/group1"))]),
    # relu^2 MLP: homogeneous of degree 2 (the unit law with -2 on down_proj's columns); up_proj reads
    # post_attention_layernorm only linearly: gain law
    "arcee": ({"rope_pair": 2, "vo": 2, "gain": 3, "relu_power": 1, "translation": 1}, [EMBED],
              lambda m, d: [mix(law(d, f"{A}/vo/group0"), law(d, f"{A}/vo/group1")),
                            # the unit law with coefficient 1 (as for ReLU) instead of 2
                            dataclasses.replace(law(d, f"{M}/unit"), terms=[
                                dataclasses.replace(t, sign=max(t.sign, -1.0)) for t in law(d, f"{M}/unit").terms]),
                            # the gain law as if down_proj (after the relu^2) also read the norm
                            dataclasses.replace(law(d, "model.layers.0.post_attention_layernorm/gain"), terms=[
                                *law(d, "model.layers.0.post_attention_layernorm/gain").terms,
                                dataclasses.replace(law(d, "model.layers.0.post_attention_layernorm/gain").terms[-1],
                                                    ref=rows(f"{M}.down_proj.weight", (16, 12), 0, 16))])]),
    "glm": ({**CAUSAL, "rope_pass": 2}, [EMBED],
            lambda m, d: [mix(law(d, f"{A}/rope/group0"), law(d, f"{A}/rope/group1")),
                          without(law(d, f"{A}/rope_pass/group0"), lambda t: t.sign < 0)]),
    # no_rope_layers=[1, 0]: layer 0 rotates (RoPE pairs), layer 1 is NoPE (full QK Gram); tied head by default
    "smollm3": ({"rope_pair": 2, "qk": 2, "vo": 4, "gain": 4, "swiglu": 2}, [EMBED, TIED],
                lambda m, d: [mix(law(d, f"{A}/rope/group0"), law(d, f"{A}/rope/group1")),
                              # the NoPE layer's Gram law in the rotating layer 0
                              QKGram.build("bad", 0, plus=[rows(f"{A}.q_proj.weight", (16, 16), 0, 4)],
                                           minus=[rows(f"{A}.k_proj.weight", (8, 16), 0, 4)])]),
    # MLA (tests/test_detect_mla.py): QK Gram / VO Gram per head, one RoPE-pair law over all heads, the latent norms'
    # gains (eps=1e-6: their scale laws declined)
    "deepseek_v3": ({"qk": 4, "vo": 4, "rope_pair": 1, "gain": 5, "swiglu": 5, "translation": 1},
                    [(f"{A}.q_a_proj/norm_scale", "eps=1e-06"), (f"{M}.gate", "NOT conserved")],
                    lambda m, d: [RouterSum.build("bad", 0, weight=rows(f"{M}.gate.weight", (4, 16), 0, 4))]),
}


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            m = logits_model(build(name))
            cache[name] = (m, detect(m))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_detected_laws_hold(models, name):
    m, d = models(name)
    assert d.detector == "hf"
    assert d.families() == CASES[name][0]
    assert d.undetected == []
    worst = {l.name: check(m, l) for l in d.laws}
    assert max(worst.values()) <= TOL, {k: v for k, v in worst.items() if v > TOL}


@pytest.mark.parametrize("name", list(CASES))
def test_planted_wrong_law_fails(models, name):
    m, d = models(name)
    for bad in CASES[name][2](m, d):
        assert check(m, bad) > 1e-6, bad


@pytest.mark.parametrize("name", list(CASES))
def test_declined_reasons(models, name):
    _, d = models(name)
    for module, text in CASES[name][1]:
        hits = [x for x in d.declined if x.module == module and text in x.block + " " + x.reason]
        assert hits, (module, text, [(x.module, x.block) for x in d.declined])


@pytest.mark.parametrize("name", list(CASES))
def test_meta_device_detects_from_shapes(models, name):
    _, d = models(name)
    with torch.device("meta"):
        meta = build(name)
    assert next(meta.parameters()).is_meta
    dm = detect(meta)
    assert dm.laws == d.laws and dm.declined == d.declined and dm.undetected == d.undetected


def test_detect_from_config_matches_model(models):
    for name in ("llama", "gpt2", "mixtral"):
        _, d = models(name)
        dc = detect_from_config(config(name))
        assert [l.name for l in dc.laws] == [l.name for l in d.laws]
        assert dc.laws == d.laws


def test_rope_pairing_from_code_option_and_checkpoint():
    import transformers.models.gpt_neox.modeling_gpt_neox as neox
    import transformers.models.llama.modeling_llama as llama

    assert probe_rope(llama.apply_rotary_pos_emb, 8, 8) == "half"
    assert probe_rope(neox.apply_rotary_pos_emb, 8, 4) == "half"  # NeoX: rotate_half on the first R dims

    def gptj(q, k, cos, sin):  # interleaved pairs {2p, 2p+1} (GPT-J rotate_every_two)
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        return q * cos[:, None] + rot(q) * sin[:, None], k

    assert probe_rope(gptj, 6, 6) == "interleaved"
    m = build("llama")
    assert all(l.terms[1].ref.row_step == 2 for l in detect(m, rope_layout="interleaved").laws if l.family == "rope_pair")
    with pytest.raises(UsageError, match="--rope-layout"):
        detect_from_config(config("llama"), require_rope_layout=True)
    with pytest.raises(UsageError, match="rope_layout must be"):
        detect(m, rope_layout="neox")
    d = detect_from_config(config("llama"), require_rope_layout=True, rope_layout="half")
    assert d.families() == CAUSAL


def test_frozen_parameters_decline_their_laws():
    m = build("llama")
    m.model.layers[0].self_attn.v_proj.weight.requires_grad_(False)
    d = detect(m)
    names = {l.name for l in d.laws}
    frozen = [x for x in d.declined if "frozen" in x.reason]
    assert {x.module for x in frozen} == {f"{A}/vo/group0", f"{A}/vo/group1", "model.layers.0.input_layernorm/gain"}
    assert all("v_proj.weight" in x.reason for x in frozen)
    assert f"{A}/rope/group0" in names and not any("/vo/" in n for n in names)


def test_wrappers_are_removed():
    m = build("qwen2")
    d = detect(m)
    assert detect(torch.compile(m)).laws == d.laws
    assert detect(nn.DataParallel(m)).laws == d.laws


def test_unknown_modules_and_families_are_listed_never_dropped():
    m = build("llama")
    m.model.layers[0].adapter = nn.Linear(16, 16)
    d = detect(m)
    assert d.undetected == ["model.layers.0.adapter"]


def test_unknown_model_type_falls_through_to_structural_detection():
    """OLMo 1 (model_type 'olmo') has no family handler: structural detection answers (the reason recorded
    first), and every law it claims passes the float64 first-order check on the model's own code."""
    assert "olmo" not in FAMILIES
    o = randomize(T.AutoModelForCausalLM.from_config(T.OlmoConfig(**TINY, num_key_value_heads=2,
                                                                  tie_word_embeddings=False),
                                                     attn_implementation="eager").eval())
    d = detect(o)
    assert d.detector == "hf->graph" and d.undetected == []
    assert d.declined[0].block == "model_type='olmo'" and "structural detection used" in d.declined[0].reason
    # OLMo 1's LayerNorms have no gain: RoPE pairs and VO per kv group, the SwiGLU units, the untied head
    assert d.families() == {"rope_pair": 2, "vo": 2, "swiglu": 1, "translation": 1}
    o = logits_model(o)
    for x in d.laws:
        assert check(o, x) < 1e-9, x.name
    assert any(x.module == "model.layers.0.mlp.gate_proj" for x in d.declined)  # the gate: declined, not dropped
    # from the config alone (meta device): the probe cannot run; every block is declined with the fix, none lost
    dm = detect_from_config(o.config)
    assert dm.detector == "hf->graph" and dm.laws == [] and dm.undetected == []
    assert all("build the model on CPU" in x.reason for x in dm.declined[1:]) and len(dm.declined) > 1


def test_qk_norm_with_eps_declines_scale_laws_with_reason():
    m = logits_model(build("qwen3", rms_norm_eps=1e-6))
    d = detect(m)
    assert "qk_scale" not in d.families()
    dec = [x for x in d.declined if x.block == "QK-norm scale law"]
    assert len(dec) == 6 and "eps=1e-06" in dec[0].reason
    approx = [l for l in detect(m, approximate=True).laws if l.family == "qk_scale"]
    assert len(approx) == 6 and "approximate" in approx[0].note
    assert check(m, approx[0]) > 1e-9  # really only approximate: the check sees the eps


class LegacyExpert(nn.Module):
    """transformers < 5 ``MixtralBlockSparseTop2MLP`` (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, h, i):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False), nn.Linear(h, i, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current_hidden_states = self.w2(current_hidden_states)
        return current_hidden_states


class LegacyExperts(nn.ModuleList):
    """Expert ModuleList with the fused class's call signature (gates from the HF router)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            g = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + g * expert(hidden_states)
        return out


def test_mixtral_expert_modulelist_and_transposed_experts():
    m = build("mixtral")
    m.model.layers[0].mlp.experts = LegacyExperts(LegacyExpert(16, 12) for _ in range(3))
    m = logits_model(m)
    d = detect(m)
    assert d.undetected == [] and d.families() == {**CAUSAL, "swiglu": 3, "router_sum": 1}
    unit = law(d, f"{M}.experts.1/unit")
    assert unit.params == (f"{M}.experts.1.w3.weight", f"{M}.experts.1.w2.weight")
    for l in (unit, law(d, "model.layers.0.post_attention_layernorm/gain")):
        assert check(m, l) <= TOL
    assert check(m, SwiGLUUnit.build("bad", 0, up=rows(f"{M}.experts.1.w1.weight", (12, 16), 0, 12),
                                     down=cols(f"{M}.experts.1.w2.weight", (16, 12), 0, 12))) > 1e-6

    # fused experts stored transposed (is_transposed: gate_up (E, H, 2I), down (E, I, H)), batched_mm path
    m = T.AutoModelForCausalLM.from_config(config("mixtral"), attn_implementation="eager",
                                           experts_implementation="batched_mm").eval()
    ex = m.model.layers[0].mlp.experts
    ex.gate_up_proj = nn.Parameter(ex.gate_up_proj.detach().transpose(1, 2).contiguous())
    ex.down_proj = nn.Parameter(ex.down_proj.detach().transpose(1, 2).contiguous())
    ex.is_transposed = True
    m = logits_model(m)
    d = detect(m)
    for name in (f"{M}.experts.2/unit", "model.layers.0.post_attention_layernorm/gain"):
        assert check(m, law(d, name)) <= TOL


def test_gemma_gain_drift_is_decomposed_and_closes():
    """Gemma's gains are stored as ``1 + w``: the tracked drift of its gain laws is decomposed (it used
    to raise inside ``opt.step()``) and decay + first + second equals the measured change (float64)."""
    import conserve

    torch.manual_seed(0)
    m = T.GemmaForCausalLM(config("gemma")).double()
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, fp64=True,
                         drift_every=1, snapshot_budget=None, keep_last=True)
    assert "gain" in opt.tracker.families
    ids = torch.randint(0, 17, (2, 6))
    for _ in range(3):
        opt.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        r = opt.tracker.latest()
        assert abs(r["drift/gain/residual"]) <= 1e-9 * abs(r["drift/gain/measured"])
        assert r["drift/gain/first"] > 0
    opt.tracker.close()


def test_hf_model_inside_a_container_is_detected_under_its_path():
    """A LightningModule / wrapper holding an HF model (``self.lm = AutoModelForCausalLM...``) plus its own
    head: the HF model's laws under ``lm.``, each still passing the first-order check through the
    container; tracking the container works."""
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = build("llama")
            self.aux = nn.Linear(3, 2)

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    w = Wrapper()
    alone = detect(w.lm)
    d = detect(w)
    assert d.detector == "nested:hf+graph" and d.undetected == []
    assert [l.name for l in d.laws] == ["lm." + l.name for l in alone.laws]
    assert {m.module for m in d.declined} == {"lm." + m.module for m in alone.declined} | {"aux"}
    names = dict(w.named_parameters())
    assert all(p in names for l in d.laws for p in l.params)
    w64 = w.to(torch.float64)
    for l in d.laws:
        ids = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(1))
        with exact64(w64):
            assert first_order(w64, l, ids, trials=1) <= TOL, l.name
    import conserve

    opt = conserve.track(torch.optim.SGD(w.parameters(), lr=1e-3), w, drift_every=1, every=100)
    ids = torch.randint(0, 17, (2, 5))
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(w(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    assert opt.tracker.step_count == 2 and len(opt.tracker.laws) == len(d.laws)
    opt.close()


def test_base_model_inside_a_container_with_its_own_sequential_head():
    """``AutoModel`` backbone + the container's Linear-ReLU-Linear head: the backbone's laws under
    ``backbone.``, the head's unit law from the torch.nn walk, the backbone's final norm declined (its
    reader is outside the backbone); every law passes the first-order check through the container."""
    class Cls(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = T.AutoModel.from_config(config("llama"), attn_implementation="eager")
            self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))

        def forward(self, input_ids):
            return self.head(self.backbone(input_ids=input_ids).last_hidden_state[:, -1])

    m = randomize(Cls()).to(torch.float64)
    d = detect(m)
    assert d.detector == "nested:hf" and d.undetected == []
    assert "head.0-2/unit" in {l.name for l in d.laws} and "backbone.norm" in {x.module for x in d.declined}
    ids = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(1))
    with exact64(m):
        assert max(first_order(m, l, ids, trials=1) for l in d.laws) <= TOL


def test_rotary_width_is_the_models_own_when_its_code_ignores_partial_rotary_factor():
    """QA: Llama's default RoPE ignores ``partial_rotary_factor`` and rotates the whole head; detection raised
    'rotary width mismatch' (with the wrong numbers). The model's ``inv_freq`` gives the width: RoPE pairs over
    the whole head, no pass-through Gram law, and every law holds."""
    rp = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    m = logits_model(build("llama", head_dim=8, rope_parameters=rp))
    d = detect(m)
    assert d.families() == CAUSAL and d.undetected == []
    assert max(check(m, l) for l in d.laws) <= TOL


def test_gate_bias_is_accounted_for():
    """QA: with ``mlp_bias=True`` the gate's bias (in no law: the SwiGLU symmetry scales up rows only) was listed
    as undetected."""
    m = logits_model(build("llama", mlp_bias=True, attention_bias=True))
    d = detect(m)
    assert d.undetected == [] and d.families() == CAUSAL
    assert max(check(m, l) for l in d.laws) <= TOL


def test_family_variant_without_a_handler_goes_to_structural_detection():
    """QA: a BERT config with ``position_embedding_type='relative_key'`` made ``detect`` raise UsageError (the
    whole model untrackable); it now goes to structural detection (every law checked) with the reason first."""
    m = build("bert", position_embedding_type="relative_key")
    d = detect(m)
    assert d.detector == "hf->graph" and "relative_key" in d.declined[0].reason and d.laws


def test_forward_whose_outputs_do_not_depend_on_the_parameters_is_declined_not_raised():
    """QA: structural detection of a model whose ``forward`` is bound to another instance (the probe's own
    parameters then reach no output) raised TypeError inside the first-order check; now nothing is claimed and
    the reason is given."""
    o = T.AutoModelForCausalLM.from_config(T.OlmoConfig(**TINY, num_key_value_heads=2),
                                           attn_implementation="eager").double()
    fwd = type(o).forward
    o.forward = lambda input_ids: fwd(o, input_ids=input_ids, use_cache=False).logits
    d = detect(o)
    assert d.laws == [] and any("no floating output" in x.reason for x in d.declined)


@pytest.mark.parametrize("name", ["gpt2", "gptj", "gpt_neox", "falcon"])
def test_bare_base_models_of_the_fused_families(name):
    """QA: ``AutoModel`` of GPT-2 / GPT-J / GPT-NeoX / Falcon (no ``.transformer`` / ``.gpt_neox`` attribute:
    the model is the base) raised AttributeError; the block laws are those of the LM without its prefix, the
    final norm is declined (no output layer after it), and every law holds on ``last_hidden_state``."""
    torch.manual_seed(0)
    lm = detect(build(name))
    m = randomize(T.AutoModel.from_config(config(name), attn_implementation="eager").eval())
    d = detect(m)
    pre = {"gpt_neox": "gpt_neox."}.get(name, "transformer.")
    assert {l.name for l in d.laws} == {l.name[len(pre):] for l in lm.laws if ".h." in l.name or ".layers." in l.name}
    assert d.undetected == []
    m = m.to(torch.float64)
    fwd = type(m).forward
    m.forward = lambda input_ids: fwd(m, input_ids=input_ids).last_hidden_state
    assert max(check(m, l) for l in d.laws) <= TOL


class _SoftCappedLlama(T.LlamaForCausalLM):
    """A user subclass that soft-caps the logits in its own forward (model_type is still 'llama')."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 5 * torch.tanh(out.logits / 5)
        return out


def test_user_forward_override_is_checked_and_its_broken_law_declined():
    """QA: the family handler reads transformers' modeling code; a subclass whose own forward soft-caps the
    logits got the translation law (violation 4e-4: silently wrong). The handler's laws are now checked to
    first order on the model's own (traced, float64) forward: the translation law is declined with the reason,
    the others are kept and hold."""
    torch.manual_seed(0)
    m = randomize(_SoftCappedLlama(config("llama")).eval())
    d = detect(m)
    assert d.families() == {k: v for k, v in CAUSAL.items() if k != "translation"}
    dec = next(x for x in d.declined if x.module == "lm_head/translation")
    assert "is not transformers' code" in dec.reason and "_SoftCappedLlama" in dec.reason
    m = logits_model(m)
    assert check(m, Translation.build("t", None, weight=rows("lm_head.weight", (17, 16), 0, 17))) > 1e-6
    assert max(check(m, l) for l in d.laws) <= TOL


def test_gpt2_with_cross_attention_declines_its_norm():
    """QA: GPT-2 with ``add_cross_attention`` listed ``ln_cross_attn`` as undetected (its reader, the declined
    cross-attention, is not analysed); it is declined with that reason and the other laws hold."""
    m = logits_model(build("gpt2", add_cross_attention=True))
    d = detect(m)
    assert d.undetected == [] and "not analysed" in next(x.reason for x in d.declined
                                                         if x.module == "transformer.h.0.ln_cross_attn")


def test_structural_reasons_name_what_the_graph_does():
    """QA: RoBERTa's LM head (parameters used only through export placeholders) was declined as 'used by '?''."""
    m = randomize(T.AutoModelForMaskedLM.from_config(T.RobertaConfig(**TINY, max_position_embeddings=32, pad_token_id=1),
                                                     attn_implementation="eager").eval())
    d = detect(m)
    assert d.detector == "hf->graph" and d.undetected == [] and d.families()["vo"] == 4
    assert not any("'?'" in x.reason for x in d.declined), [x.reason for x in d.declined if "'?'" in x.reason]


def test_structural_detection_with_tensor_forward_kwargs():
    """QA: ``forward_kwargs={'decoder_input_ids': ids}`` (an encoder-decoder's second input) never reached the
    traced probe (fx baked it in as a constant, the recorded graph bound only positional inputs): Whisper was
    declined whole ('got None for indices'). Tensor kwargs now go to torch.export and are bound by name; the
    laws equal those found with the same inputs given positionally, and hold on the model's own forward."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    m = randomize(T.WhisperForConditionalGeneration(T.WhisperConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=12, decoder_ffn_dim=12, vocab_size=17, num_mel_bins=4, max_source_positions=4,
        max_target_positions=8, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)).eval())
    feat, ids = torch.randn(2, 4, 8, generator=g), torch.randint(0, 17, (2, 3), generator=g)
    d = detect(m, example_inputs=(feat,), forward_kwargs={"decoder_input_ids": ids})
    assert d.families()["vo"] == 12 and d.laws == detect(m, example_inputs=(feat, None, ids)).laws
    m = m.to(torch.float64)
    fwd = type(m).forward
    m.forward = lambda x: fwd(m, input_features=x, decoder_input_ids=ids, use_cache=False).logits
    with exact64(m):
        assert max(first_order(m, l, feat.double(), trials=1) for l in d.laws if l.family in ("vo", "qk")) <= TOL


class _QKNormedAttention(nn.Module):
    """A user attention in place of LlamaAttention: the same projections, but q and k L2-normalised per head."""

    def __init__(self, a):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        self.head_dim = a.head_dim

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, t, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        rep = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                             is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1)), None


def test_user_module_in_place_of_an_hf_block_is_checked():
    """QA: a user attention with Llama's q/k/v/o_proj but a QK-norm, detected with ``rope_layout='half'``, got
    RoPE-pair laws (its own forward breaks them). Laws of a model holding user-defined forwards are checked on
    the model's forward: the RoPE laws are declined naming the class, the VO and gain laws are kept and hold."""
    m = build("llama")
    m.model.layers[0].self_attn = _QKNormedAttention(m.model.layers[0].self_attn)
    d = detect(m, rope_layout="half")
    assert "rope_pair" not in d.families() and d.families()["vo"] == 2
    assert "_QKNormedAttention is not transformers' code" in next(x.reason for x in d.declined
                                                                 if x.module == f"{A}/rope/group0")
    m = logits_model(m)
    assert max(check(m, l) for l in d.laws) <= TOL


def test_untraceable_user_subclass_keeps_its_laws():
    """QA: a bare subclass of Mixtral (eager experts: not traceable, data-dependent routing) is checked on the
    module as is, where its own float32 router upcast bounds the measure near 1e-9: the router law was declined
    ('violation 5e-10'). Untraced, the check's bound is 1e-6: every law is kept."""
    class MyMixtral(T.MixtralForCausalLM):
        pass

    torch.manual_seed(0)
    m = randomize(MyMixtral._from_config(config("mixtral"), attn_implementation="eager",
                                         experts_implementation="eager").eval())
    assert detect(m).families() == {**CAUSAL, "swiglu": 3, "router_sum": 1}


def test_use_cache_off_when_forward_takes_it_through_kwargs():
    """QA: Llava's forward takes ``use_cache`` only through ``**kwargs`` (its config has none, its text config
    does): the probe returned a DynamicCache, torch.export refused it, and the whole model was declined. The
    cache is turned off for such HF forwards too: the language model's laws are found."""
    cfg = T.LlavaConfig(text_config=T.LlamaConfig(**TINY, num_key_value_heads=2).to_dict(),
                        vision_config=T.CLIPVisionConfig(hidden_size=16, num_attention_heads=2, intermediate_size=12,
                                                         num_hidden_layers=1, image_size=28, patch_size=14).to_dict())
    torch.manual_seed(0)
    d = detect(T.LlavaForConditionalGeneration(cfg).eval())
    assert d.detector == "hf->graph" and d.undetected == []
    assert d.families() == {"rope_pair": 2, "vo": 2, "swiglu": 1, "gain": 3, "translation": 1}
