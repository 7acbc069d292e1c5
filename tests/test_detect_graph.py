"""Structural detection (conserve.detection.graph): laws found from what the traced graph computes.

Models written here in plain torch.nn (``graph_models.py``): nanoGPT with a fused ``c_attn`` split by
columns, a torchtitan Llama (complex RoPE on adjacent pairs, GQA by expand, SwiGLU w1/w3/w2), a user MLP with
named attributes, a hand-written top-2 MoE. For each: (a) the right laws (count and families); (b) every
law passes the spec's first-order check in float64 on the ORIGINAL model (``test_detect_torch.violations``,
tied to ``conserve.verify.first_order``), independently of the check detection itself ran on the trace;
(c) planted wrong laws fail that check; (d) blocks outside the catalogue are declined with a reason while
the rest is detected. Then: structural and name-based detection agree on the HF families of
``test_detect_hf.py`` that can be traced.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conserve.detection import detect
from conserve.detection.graph import Graph, check_laws, detect_graph, make_probe, synth_inputs, trace
from conserve.errors import UnsupportedModelError
from conserve.laws import QKGram, ReLUUnit, RopePairs, RouterSum, SwiGLUUnit, VOGram, GainBalance, cols, rows, vector
from conserve.analysis.verify import TOL, first_order
from graph_models import (GPT, BranchMLP, ChainMLP, EinsumAttention, LayerScaleMLP, Llama, MyMLP, NormedSequential,
                          QKNormAttention, Top2MoE, Unknown)
from test_detect_torch import WRONG, randomize, violations


def ids(seed=1, vocab=17, t=6):
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(seed))


def floats(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@contextlib.contextmanager
def float64_casts():
    """``x.float()`` keeps float64 tensors float64 (torchtitan's RoPE upcasts with ``.float()``: a precision
    choice; at float32 the first-order check could not resolve 1e-10)."""
    orig = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else orig(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.float = orig


def hold(model, found, x):
    with float64_casts():
        v = violations(model, found.laws, x)
    bad = {k: w for k, w in v.items() if w > TOL}
    assert not bad, bad


def fail(model, planted: dict, x):
    with float64_casts():
        v = violations(model, [dataclasses.replace(law, name=k) for k, law in planted.items()], x)
    weak = {k: v[k] for k in planted if v[k] <= WRONG}
    assert not weak, f"planted wrong laws pass the check: {weak}"


def reasons(found) -> dict:
    return {d.module: d.block + ": " + d.reason for d in found.declined}


def law(found, name):
    return next(x for x in found.laws if x.name == name)


# ------------------------------------------------------------------------------------------- user MLP
def test_user_mlp_with_named_attributes():
    m = randomize(MyMLP())
    found = detect(m)  # no detector knows MyMLP: structural fallback (it used to raise for the whole model)
    assert found.detector == "graph" and found.families() == {"relu": 1} and found.undetected == []
    unit = law(found, "a/unit")
    assert unit.params == ("a.weight", "a.bias", "b.weight")
    assert "loss='ce'" in reasons(found)["b"]
    x = floats(4, 8)
    hold(m, found, x)
    assert first_order(m, unit, x) <= TOL  # conserve.verify on the user's own module
    with_ce = detect(m, loss="ce")
    assert with_ce.families() == {"relu": 1, "translation": 1}
    hold(m, with_ce, x)
    fail(m, {"unit on b rows": ReLUUnit.build("w", None, up=rows("a.weight", (16, 8), 0, 4),
                                              down=rows("b.weight", (4, 16), 0, 4)),
             "no bias": ReLUUnit.build("w", None, up=rows("a.weight", (16, 8), 0, 16),
                                       down=cols("b.weight", (4, 16), 0, 16))}, x)
    gelu = detect(randomize(MyMLP(act=F.gelu)))
    assert gelu.laws == [] and "no continuous rescaling symmetry" in reasons(gelu)["a"]


def test_structural_is_available_explicitly_and_on_wrappers():
    m = randomize(MyMLP())
    a = detect(m, structural=True)
    assert a.detector == "graph" and a.laws == detect(m).laws
    assert detect(nn.DataParallel(m)).laws == a.laws


# ------------------------------------------------------------------------------ chained MLPs
def leaky(z):
    return F.leaky_relu(z, 0.2)


def where_leaky(z):  # a hand-written leaky ReLU: positively homogeneous, found numerically
    return torch.where(z > 0, z, 0.1 * z)


@pytest.mark.parametrize("n, acts, bias, names", [
    (3, None, True, ["fc1/unit", "fc2/unit"]),  # the user's report: fc2/unit was missing, neither declined nor undetected
    (4, None, True, ["fc1/unit", "fc2/unit", "fc3/unit"]),  # the middle unit was dropped
    (5, None, False, ["fc1/unit", "fc2/unit", "fc3/unit", "fc4/unit"]),
    (4, [torch.relu, nn.LeakyReLU(0.1), leaky], True, ["fc1/unit", "fc2/unit", "fc3/unit"]),
    (4, [where_leaky, F.relu, torch.relu], True, ["fc1/unit", "fc2/unit", "fc3/unit"]),
    (4, [torch.relu, None, torch.relu], True, ["fc1/unit", "fc2-fc3/gram", "fc3/unit"]),
    (4, [None, torch.relu, None], False, ["fc1-fc2/gram", "fc2/unit", "fc3-head/gram"]),
    (4, [torch.relu, F.gelu, torch.relu], True, ["fc1/unit", "fc3/unit"]),
])
def test_chained_mlp_one_law_per_hidden_layer(n, acts, bias, names):
    """The down side of one law is the up side of the next: a plain-module chain gets the laws its
    ``nn.Sequential`` twin gets, each passing the first-order check, and every other block is declined."""
    m = randomize(ChainMLP(n, acts, bias))
    found = detect(m)
    assert found.detector == "graph" and [x.name for x in found.laws] == names and found.undetected == []
    x = floats(4, 8)
    hold(m, found, x)
    for unit in found.laws:
        assert first_order(m, unit, x) <= TOL, unit.name
    r = reasons(found)
    assert "loss='ce'" in r["head"]
    if acts is not None and F.gelu in acts:
        assert "no continuous rescaling symmetry" in r["fc2"]
    if acts is None:
        seq = nn.Sequential(*[mod for name in m.names for mod in (getattr(m, name), nn.ReLU())][:-1])
        assert len(detect(seq).laws) == len(names)  # its torch.nn twin
    # the law pairs each layer's rows with the NEXT layer's columns: skipping a layer or dropping the bias fails
    w = {k: tuple(v.shape) for k, v in m.named_parameters()}
    third = m.names[2] + ".weight"
    planted = {"fc1 rows vs the third layer's cols": ReLUUnit.build("p", None, up=rows("fc1.weight", w["fc1.weight"], 0, 16),
                                                                    down=cols(third, w[third], 0, 16))}
    if bias and acts is None:
        planted["fc2 without its bias"] = ReLUUnit.build("q", None, up=rows("fc2.weight", w["fc2.weight"], 0, 16),
                                                         down=cols(third, w[third], 0, 16))
    fail(m, planted, x)


@pytest.mark.parametrize("where", ["act", "pre", "raw"])
def test_units_read_twice_are_declined_with_the_reason(where):
    """fc2's units read by head and by another reader: no fc2 law (it would need every reader's columns),
    fc2 declined naming both readers; fc1's law is still found and holds."""
    m = randomize(BranchMLP(where))
    found = detect(m)
    assert [x.name for x in found.laws] == ["fc1/unit"] and found.undetected == []
    r = reasons(found)
    assert "also by" in r["fc2"] and "'head'" in r["fc2"] and "every reader" in r["fc2"]
    hold(m, found, floats(4, 8))
    w = {k: tuple(v.shape) for k, v in m.named_parameters()}  # the law the branch rules out indeed fails
    fail(m, {"fc2/unit, head only": ReLUUnit.build("p", None, up=rows("fc2.weight", w["fc2.weight"], 0, 16),
                                                   down=cols("head.weight", w["head.weight"], 0, 16),
                                                   up_bias=vector("fc2.bias", 0, 16))}, floats(4, 8))


# --------------------------------------------------------------------------------------------- nanoGPT
def test_nanogpt_fused_c_attn_split_by_columns():
    m = randomize(GPT(tied=False))
    found = detect(m, loss="ce")  # fx cannot trace the assert on the length: torch.export is used
    assert found.families() == {"qk": 8, "vo": 8, "gain": 5, "translation": 1}, found.families()
    assert found.undetected == []
    r = reasons(found)
    assert "no continuous rescaling symmetry" in r["transformer.h.0.mlp.c_fc"]
    assert "embedding" in r["transformer.wte"] and "embedding" in r["transformer.wpe"]
    # head 1 of block 0: q rows [4, 8) and k rows 16 + [4, 8) of c_attn (with bias); V rows 32 + [4, 8), c_proj cols
    qk = law(found, "transformer.h.0.attn/qk/group1")
    assert {(t.ref.param, t.ref.start, t.ref.rows, t.sign) for t in qk.terms} == {
        ("transformer.h.0.attn.c_attn.weight", (4, 0), 4, 1.0), ("transformer.h.0.attn.c_attn.bias", (4,), 4, 1.0),
        ("transformer.h.0.attn.c_attn.weight", (20, 0), 4, -1.0), ("transformer.h.0.attn.c_attn.bias", (20,), 4, -1.0)}
    vo = law(found, "transformer.h.0.attn/vo/group1")
    assert {(t.ref.param, t.ref.start, t.sign) for t in vo.terms} == {
        ("transformer.h.0.attn.c_attn.weight", (36, 0), 1.0), ("transformer.h.0.attn.c_attn.bias", (36,), 1.0),
        ("transformer.h.0.attn.c_proj.weight", (0, 4), -1.0)}
    assert law(found, "transformer.h.0.ln_1/gain").params == (
        "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight")
    x = ids()
    hold(m, found, x)
    w, b, s = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias", (48, 16)
    fail(m, {"q of head 0 vs k of head 1": QKGram.build("w", 0, plus=[rows(w, s, 0, 4), vector(b, 0, 4)],
                                                        minus=[rows(w, s, 20, 4), vector(b, 20, 4)]),
             "VO with c_proj rows": VOGram.build("w", 0, plus=[rows(w, s, 32, 4), vector(b, 32, 4)],
                                                 minus=[rows("transformer.h.0.attn.c_proj.weight", (16, 16), 0, 4)]),
             "gain without the LayerNorm bias": GainBalance.build(
                 "w", 0, gain=vector("transformer.h.0.ln_1.weight", 0, 16), readers=[cols(w, s, 0, 16)])}, x)


def test_nanogpt_flash_attention_and_tied_head():
    m = randomize(GPT(tied=True, flash=True))
    found = detect(m, loss="ce")
    assert found.families() == {"qk": 8, "vo": 8, "gain": 4}
    r = reasons(found)
    assert "tied" in r["lm_head/translation"] and "tied" in r["transformer.ln_f/gain"]
    hold(m, found, ids())


def test_shape_read_by_attribute_is_not_a_reader_of_the_norm_output():
    """``B, T, C = x.shape`` on the pre-norm output (fx: ``getattr(x, 'shape')``) reads no value of it: the
    gain law of that norm is found and holds (it was declined as 'also read by getattr')."""
    class Attn(nn.Module):
        def __init__(self, d=8, h=2):
            super().__init__()
            self.c_attn, self.c_proj, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), h

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)  # traced by fx (a loop over the split would need export)
            q, k = q.view(B, T, self.h, C // self.h).transpose(1, 2), k.view(B, T, self.h, C // self.h).transpose(1, 2)
            v = v.view(B, T, self.h, C // self.h).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    class Net(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.wte, self.ln_1, self.attn = nn.Embedding(17, d), nn.LayerNorm(d), Attn(d)
            self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, 17, bias=False)

        def forward(self, idx):
            x = self.wte(idx)
            x = x + self.attn(self.ln_1(x))
            return self.lm_head(self.ln_f(x))

    m = randomize(Net())
    found = detect(m, loss="ce")
    assert law(found, "ln_1/gain").params == ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight")
    assert "ln_1" not in reasons(found)
    hold(m, found, ids())


# ------------------------------------------------------------------------------------ torchtitan Llama
def test_torchtitan_llama_complex_rope_gqa_swiglu():
    m = randomize(Llama())
    found = detect(m, loss="ce")
    assert found.families() == {"rope_pair": 4, "vo": 4, "swiglu": 2, "gain": 5, "translation": 1}, found.families()
    assert found.undetected == [] and list(reasons(found)) == ["tok_embeddings"]
    rope = law(found, "layers.0.attention/rope/group1")
    # view_as_complex pairs adjacent dims: {2p, 2p+1}; kv head 1 = wk rows [4, 8), query heads 2, 3 = wq rows [8, 16)
    assert {(t.ref.param, t.ref.start[0], t.ref.rows, t.ref.row_step, t.sign) for t in rope.terms} == {
        ("layers.0.attention.wq.weight", s, 2, 2, 1.0) for s in (8, 9, 12, 13)} | {
        ("layers.0.attention.wk.weight", s, 2, 2, -1.0) for s in (4, 5)}
    unit = law(found, "layers.0.feed_forward.w3/unit")
    assert unit.params == ("layers.0.feed_forward.w3.weight", "layers.0.feed_forward.w2.weight")
    assert law(found, "layers.0.ffn_norm/gain").params == (
        "layers.0.ffn_norm.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight")
    x = ids()
    hold(m, found, x)
    q, k = "layers.0.attention.wq.weight", "layers.0.attention.wk.weight"
    fail(m, {"half-split pairing": RopePairs.build("w", 0, q_weight=q, q_shape=(16, 16), q_starts=[0, 4], k_weight=k,
                                                   k_shape=(8, 16), k_starts=[0], rotary_dim=4, layout="half"),
             "QK Gram under RoPE": QKGram.build("w", 0, plus=[rows(q, (16, 16), 0, 4), rows(q, (16, 16), 4, 4)],
                                                minus=[rows(k, (8, 16), 0, 4)]),
             "unit on the gate": SwiGLUUnit.build("w", 0, up=rows("layers.0.feed_forward.w1.weight", (12, 16), 0, 12),
                                                  down=cols("layers.0.feed_forward.w2.weight", (16, 12), 0, 12))}, x)


def test_einsum_attention_with_per_head_fused_qkv():
    m = randomize(EinsumAttention())
    found = detect(m)
    assert found.families() == {"qk": 3, "vo": 3, "relu": 1, "gain": 2} and found.undetected == []
    # view(B, T, nh, 3, D): head 1 owns rows [12, 16) (q), [16, 20) (k), [20, 24) (v) of qkv
    assert {(t.ref.param, t.ref.start[0], t.sign) for t in law(found, "qkv/qk/group1").terms} == {
        ("qkv.weight", 12, 1.0), ("qkv.bias", 12, 1.0), ("qkv.weight", 16, -1.0), ("qkv.bias", 16, -1.0)}
    x = floats(2, 5, 12)
    hold(m, found, x)
    s = (36, 12)
    fail(m, {"[Q | K | V] layout": QKGram.build("w", None, plus=[rows("qkv.weight", s, 4, 4), vector("qkv.bias", 4, 4)],
                                                minus=[rows("qkv.weight", s, 16, 4), vector("qkv.bias", 16, 4)])}, x)


def test_qk_norm_with_rotate_half_rope():
    m = randomize(QKNormAttention())
    with torch.no_grad():
        for n in (m.q_norm, m.k_norm):
            n.weight.copy_(1 + 0.3 * torch.randn(4, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    found = detect(m)
    assert found.families() == {"qk_norm_gain": 1, "vo": 4}, found.families()
    assert "QK-norm" in reasons(found)["q/qk"]
    g = law(found, "q/qk_norm_gain/group0")
    # rotate_half pairs {0, 2} and {1, 3} of the shared per-head gains
    assert {(t.ref.param, t.ref.start, t.ref.rows, t.ref.row_step, t.sign) for t in g.terms} == {
        ("q_norm.weight", (0,), 2, 1, 1.0), ("q_norm.weight", (2,), 2, 1, 1.0),
        ("k_norm.weight", (0,), 2, 1, -1.0), ("k_norm.weight", (2,), 2, 1, -1.0)}
    x = floats(2, 5, 16)
    hold(m, found, x)
    from conserve.laws import QKNormGain, Term
    inter = QKNormGain("w", None, [Term("norm", vector("q_norm.weight", 0, 2, step=2), 1.0),
                                   Term("norm", vector("q_norm.weight", 1, 2, step=2), 1.0),
                                   Term("norm", vector("k_norm.weight", 0, 2, step=2), -1.0),
                                   Term("norm", vector("k_norm.weight", 1, 2, step=2), -1.0)], 2)
    fail(m, {"interleaved pairing": inter,
             "QK Gram under QK-norm": QKGram.build("w", None, plus=[rows("q.weight", (16, 16), 0, 4)],
                                                   minus=[rows("k.weight", (16, 16), 0, 4)])}, x)


# ------------------------------------------------------------------------------------------- MoE
def test_hand_written_top2_moe():
    m = randomize(Top2MoE())
    found = detect(m)
    assert found.families() == {"router_sum": 1, "swiglu": 3, "gain": 1} and found.undetected == []
    gain = law(found, "norm/gain")
    assert set(gain.params) == {"norm.weight", "norm.bias", "router.weight"} | {f"experts.{e}.fc_in.weight" for e in range(3)}
    unit = law(found, "experts.1.fc_in/unit")
    assert {(t.ref.param, t.ref.start) for t in unit.terms} == {("experts.1.fc_in.weight", (6, 0)),
                                                              ("experts.1.fc_in.bias", (6,)), ("experts.1.fc_out.weight", (0, 0))}
    x = floats(2, 5, 8)
    hold(m, found, x)
    fail(m, {"unit on the gate half": SwiGLUUnit.build("w", 0, up=rows("experts.1.fc_in.weight", (12, 8), 0, 6),
                                                       down=cols("experts.1.fc_out.weight", (8, 6), 0, 6)),
             "gain without the router": dataclasses.replace(gain, terms=[t for t in gain.terms
                                                                          if t.ref.param != "router.weight"])}, x)


class TokenSoftmaxRouter(Top2MoE):
    """Softmax over the TOKENS (dim 0): looks like a router in the graph, but adding one vector to every router
    row shifts each token's logits, which a softmax over tokens does not ignore: the law fails."""

    def forward(self, x):
        b, t, h = x.shape
        z = self.norm(x).reshape(-1, h)
        probs = F.softmax(self.router(z), dim=0)
        out = torch.zeros_like(z)
        for e, expert in enumerate(self.experts):
            out = out + probs[:, e: e + 1] * expert(z)
        return x + out.reshape(b, t, h)


def test_candidate_that_fails_the_check_is_declined_not_claimed():
    m = randomize(TokenSoftmaxRouter())
    found = detect(m)
    assert "router_sum" not in found.families()
    r = reasons(found)
    assert "fails the first-order check" in r["router/router"]
    assert found.families()["swiglu"] == 3
    # the check detection runs is the spec's: the good laws pass it, a planted wrong law fails it
    probe = make_probe(m, 1e6)
    x = synth_inputs(probe)
    gm, _ = trace(probe, x)
    g = Graph(gm, x, dict(probe.named_parameters()))
    wrong = RouterSum.build("r", 0, weight=rows("router.weight", (3, 8), 0, 3))
    v = check_laws(g, found.laws + [wrong], {})
    assert max(v[x.name] for x in found.laws) <= TOL and v["r"] > WRONG
    from conserve.detection import graph

    assert graph.TOL == TOL  # the spec's tolerance, as conserve.verify has it


# ------------------------------------------------------------------------------ unknown blocks
def test_unknown_blocks_are_declined_the_rest_detected():
    m = randomize(Unknown())
    x = floats(2, 5, 8)
    found = detect(m)
    assert found.families() == {"relu": 1, "relu_power": 1}
    assert law(found, "up/unit").params == ("up.weight", "up.bias", "down.weight")
    assert {(t.ref.param, t.sign) for t in law(found, "sq_in/unit").terms} == {
        ("sq_in.weight", 1.0), ("sq_in.bias", 1.0), ("sq_out.weight", -2.0)}
    r = reasons(found)
    assert "no catalogue block" in r["conv"]
    assert found.undetected == []
    hold(m, found, x)


def test_layer_scale_after_a_linear():
    m = randomize(LayerScaleMLP())
    found = detect(m)
    assert found.families() == {"layer_scale": 1} and law(found, "gamma/layer_scale").params == (
        "gamma", "fc2.weight", "fc2.bias")
    assert "no continuous rescaling symmetry" in reasons(found)["fc1"]
    x = floats(3, 8)
    hold(m, found, x)
    fail(m, {"without fc2's bias": GainBalance.build("w", None, gain=vector("gamma", 0, 8),
                                                     readers=[rows("fc2.weight", (8, 16), 0, 8)])}, x)


def test_torchnn_modules_plus_structural_for_the_rest():
    from test_detect_torch import Mixed

    m = randomize(Mixed())
    found = detect(m)
    assert found.detector == "torch.nn+graph"
    assert found.families() == {"qk": 2, "vo": 2, "relu": 1} and found.undetected == []
    r = reasons(found)
    assert "no catalogue block" in r["stem"] and "not only by linear maps" in r["scale"]


def test_gain_read_by_a_torchnn_sequential():
    m = randomize(NormedSequential())
    found = detect(m)
    assert found.detector == "torch.nn+graph"
    assert found.families() == {"relu": 1, "gain": 1} and found.undetected == []
    assert law(found, "norm/gain").params == ("norm.weight", "norm.bias", "mlp.0.weight")
    hold(m, found, floats(3, 8))


def test_untraceable_or_unprobeable_models_are_declined_per_module():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: neither fx nor export traces it
                return self.b(F.relu(self.a(x)))
            return self.b(F.relu(self.a(-x)))

    d = detect_graph(Branchy(), torch.ones(2, 4))  # the whole forward declined once, each Linear analysed alone
    assert d.laws == [] and {x.module for x in d.declined} == {"<forward>", "a", "b"} and d.undetected == []
    why = reasons(d)
    assert "could not run" in why["<forward>"] and all("analysed on its own" in why[k] for k in "ab")
    big = detect_graph(MyMLP(), max_probe_params=10)
    assert "max_probe_params" in big.declined[0].reason
    with pytest.raises(UnsupportedModelError, match="no detector recognises"):
        detect(nn.Conv2d(3, 4, 3))


# ------------------------------------------------------------------ HF: structural agrees with name-based
try:
    import transformers

    transformers.PreTrainedModel  # noqa: B018 - raises when an optional dependency of transformers is broken
    from test_detect_hf import CASES, build
    HF = ""
except Exception as e:  # noqa: BLE001  # pragma: no cover - environment dependent (e.g. a broken torchvision)
    CASES, HF = {}, f"transformers unavailable: {e}"

# HF MoE layers' eager experts dispatch tokens with ``nonzero()`` over the routing mask (a data-dependent loop
# neither torch.fx nor torch.export can trace); the probe runs the fused experts as transformers' ``batched_mm``
# (the same function: each token's gathered expert weights), so structural detection now agrees on MoE models too.
UNTRACEABLE: tuple = ()
# Families the name-based handlers build and structural detection does not: the ||Q||^2 QK-norm scale laws
# (eps = 0 only) and the post-norm scale laws (norm_scale).
NOT_STRUCTURAL = {"qk_scale", "norm_scale"}
# Families, per model, the name-based handlers find and structural detection does not (none at present: DeepSeek-V3's
# MLA QK Grams, RoPE pairs, VO Grams and latent-norm gains are found by both, conserve/detection/match/mla.py).
NOT_STRUCTURAL_BY_NAME: dict = {}
# Laws structural detection finds that the name-based handlers do not (none at present: BERT's last-layer output
# LayerNorm, Arcee's post-attention norm and DeepSeek's MLA used to be found here only).
EXTRA: dict = {}


def fingerprint(laws, params):
    """{family: sorted law values}: two laws over the same rows / columns have the same value at random
    parameters, whatever their names or how their terms are split."""
    from conserve.laws import evaluate_laws

    vals = evaluate_laws(laws, params, fp64=True, backend="torch")
    out: dict = {}
    for x in laws:
        out.setdefault(x.family, []).append(tuple(round(float(v), 8) for v in vals[x.name].reshape(-1)))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.skipif(not CASES, reason=HF or "no HF cases")
@pytest.mark.parametrize("name", list(CASES))
def test_structural_agrees_with_name_based_hf(name):
    m = build(name)
    named = detect(m)
    found = detect_graph(m, loss="ce")
    if name in UNTRACEABLE:
        assert found.laws == [] and all("could not run" in x.reason for x in found.declined)
        return
    params = {k: v.detach().double() for k, v in m.named_parameters(remove_duplicate=False)}
    drop = NOT_STRUCTURAL | NOT_STRUCTURAL_BY_NAME.get(name, set())
    extra = EXTRA.get(name, set())
    assert {x.name for x in found.laws if x.name in extra} == extra
    want = fingerprint([x for x in named.laws if x.family not in drop], params)
    got = fingerprint([x for x in found.laws if x.name not in extra], params)
    assert got == want
    if "qk_scale" in named.families():
        assert any("QK-norm" in x.reason for x in found.declined)


class MatmulLinear(nn.Module):
    """FalconLinear: ``x @ self.weight.T`` and the bias added after (the traced graph has a matmul and an add)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d_out, d_in)), nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        return x @ self.weight.T + self.bias


class MatmulAttention(nn.Module):
    def __init__(self, d=12, nh=3):
        super().__init__()
        self.nh, self.norm = nh, nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (MatmulLinear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, self.nh, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return x + self.o(z)


def test_a_linear_written_as_matmul_then_bias_add_is_one_linear_map():
    """``x @ W.T + b`` (FalconLinear, hand-written layers): the add is the map's output and its bias, so the QK and
    VO Grams (with the biases) and the norm's gain law are found, as for ``nn.Linear``; each holds."""
    m = randomize(MatmulAttention())
    x = floats(2, 5, 12)
    found = detect(m, example_inputs=x)
    assert found.families() == {"qk": 3, "vo": 3, "gain": 1}, (found.families(), reasons(found))
    assert {p for l in found.laws if l.family == "qk" for p in l.params} == {"q.weight", "q.bias", "k.weight",
                                                                              "k.bias"}
    assert set(law(found, "norm/gain").params) >= {"norm.weight", "norm.bias", "q.weight", "k.weight", "v.weight"}
    hold(m, found, x)


@pytest.mark.skipif(not CASES, reason=HF or "no HF cases")
def test_falcons_matmul_linears_with_bias_agree_with_the_name_based_detector():
    import transformers as T
    from test_detect_hf import randomize as hf_randomize

    torch.manual_seed(0)
    cfg = T.FalconConfig(vocab_size=17, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_kv_heads=2,
                         new_decoder_architecture=True, bias=True, alibi=False)
    m = hf_randomize(T.FalconForCausalLM(cfg).eval())
    named, found = detect(m), detect_graph(m, loss="ce")
    params = {k: v.detach().double() for k, v in m.named_parameters(remove_duplicate=False)}
    assert {"rope_pair", "vo", "gain"} <= set(named.families())
    want = fingerprint([x for x in named.laws if x.family not in NOT_STRUCTURAL], params)
    assert fingerprint(found.laws, params) == want


def _bert_head(cls_name: str, layers: int = 2):
    import transformers as T
    from test_detect_hf import config, randomize

    torch.manual_seed(0)
    cls = getattr(T, cls_name)
    return randomize(cls._from_config(config("bert", num_hidden_layers=layers), attn_implementation="eager").eval())


# (model, gain laws both detectors must build, norms both must decline). Spec gain row: a norm gain whose scaled
# output is read only by linear maps. BERT's last output LayerNorm has no residual add after it: it is read by the
# head's dense / pooler / classifier (a law), but is the output itself of a bare BertModel (none); earlier layers'
# LayerNorms feed the residual stream (none). Arcee: post_attention_layernorm is read only by up_proj (the relu^2
# comes after the Linear), so its gain law holds although the MLP has no law.
GAIN_CASES = {
    "BertForMaskedLM": ({"bert.encoder.layer.1.output.LayerNorm/gain"}, {"bert.encoder.layer.0.output.LayerNorm"}),
    "BertForSequenceClassification": ({"bert.encoder.layer.1.output.LayerNorm/gain"}, set()),
    "BertForTokenClassification": ({"bert.encoder.layer.1.output.LayerNorm/gain"}, set()),
    "BertModel": (set(), {"encoder.layer.1.output.LayerNorm", "encoder.layer.0.output.LayerNorm"}),
    "arcee": ({"model.layers.0.post_attention_layernorm/gain"}, set()),
}


@pytest.mark.skipif(not CASES, reason=HF or "no HF cases")
@pytest.mark.parametrize("name", list(GAIN_CASES))
def test_gains_read_only_by_linear_maps(name):
    m = build(name) if name == "arcee" else _bert_head(name)
    named, found = detect(m), detect_graph(m, loss="ce")
    laws, declined = GAIN_CASES[name]
    params = {k: v.detach().double() for k, v in m.named_parameters(remove_duplicate=False)}
    gains = [{x.name: x for x in d.laws if x.family == "gain"} for d in (named, found)]
    for g in gains:
        assert laws <= set(g), (laws, set(g))
    assert fingerprint(list(gains[0].values()), params) == fingerprint(list(gains[1].values()), params)
    for d in (named, found):
        assert declined <= {x.module for x in d.declined}, [x.module for x in d.declined]
    if name in ("BertForMaskedLM", "arcee"):  # the law itself, first order in float64 on the model's own code
        from test_detect_hf import check, logits_model

        lm = logits_model(m)
        assert all(check(lm, gains[0][n]) < 1e-9 for n in laws)


class _SharedBlock(nn.Module):
    """QA: one residual ReLU MLP applied three times (weights shared across depth, as ALBERT's layer group)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        for _ in range(3):
            x = x + self.down(F.relu(self.up(x)))
        return x


def test_block_called_several_times_gives_one_law():
    """QA: each call of a shared block gave its own copy of the law (same name, same rows: ALBERT got every
    law three times, each tracked and counted again); now one law per block, and it holds for all the uses."""
    m = randomize(_SharedBlock())
    found = detect(m)
    assert [l.name for l in found.laws] == ["up/unit"] and found.undetected == []
    assert len(found.declined) == len(set(found.declined))
    hold(m, found, floats(4, 8))


class _TwoScaleBlock(nn.Module):
    """QA: EVA-style block holding its two LayerScale vectors itself (``gamma_1``, ``gamma_2``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.gamma_1, self.gamma_2 = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = x + self.gamma_1 * self.fc1(x)
        return x + self.gamma_2 * self.fc2(x)


def test_two_layer_scales_of_one_block_get_two_names():
    """QA: both LayerScale laws were named after the block ('blk/layer_scale' twice): the first-order verdicts
    are kept by name (one law could be claimed on the other's verdict) and timm's EVA-style ViTs
    (vit_small_patch16_rope_224) then failed to compile their laws; each law is named after its parameter."""
    m = randomize(nn.Sequential(_TwoScaleBlock()))
    found = detect(m, structural=True)
    assert sorted(l.name for l in found.laws if l.family == "layer_scale") == ["0.gamma_1/layer_scale",
                                                                               "0.gamma_2/layer_scale"]
    hold(m, found, floats(4, 8))


def test_collector_keeps_two_laws_of_one_name_apart():
    """Safety net: two different laws a detector gave one name are kept as 'name' and 'name#2' (values are
    reported by name; compile_laws refuses duplicates)."""
    from conserve.detection import Collector

    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    c = Collector(m)
    c.add(ReLUUnit.build("u", 0, up=rows("0.weight", (6, 4), 0, 3), down=cols("2.weight", (3, 6), 0, 3)),
          ReLUUnit.build("u", 0, up=rows("0.weight", (6, 4), 3, 3), down=cols("2.weight", (3, 6), 3, 3)))
    assert [l.name for l in c.finish().laws] == ["u", "u#2"]


class _QuickGeluMLP(nn.Module):
    """QA: CLIP's MLP, ``fc2(quick_gelu(fc1 x))`` with quick_gelu(z) = z * sigmoid(1.702 z)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


def test_candidate_declined_by_the_check_is_not_also_undetected():
    """QA: a candidate that failed the check (quick_gelu read as a gated unit) was declined, and its Linears were
    listed as undetected as well (CLIP's fc1/fc2); they are accounted for by the decline."""
    found = detect(randomize(_QuickGeluMLP()))
    assert found.laws == [] and found.undetected == []
    assert "fails the first-order check" in reasons(found)["fc1/unit"]


def test_the_check_also_runs_on_larger_inputs_so_a_law_valid_only_below_a_clip_fails():
    """A ReLU unit law through ReLU6 holds while no unit reaches 6; the probe's small inputs never do. The check's
    second trial runs on the inputs times ``INPUT_SCALE``, where units clip, and the law fails; a true law passes."""
    from conserve.detection.check import INPUT_SCALE

    m = randomize(nn.Sequential(nn.Linear(8, 12), nn.ReLU6(), nn.Linear(12, 4)))
    x = floats(16, 8) * 0.05
    probe = make_probe(m, 1e6)
    gm, _ = trace(probe, (x,))
    g = Graph(gm, (x,), dict(probe.named_parameters()))
    assert float(g.env[next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "0")].abs().max()) < 6
    law6 = ReLUUnit.build("through relu6", 0, up=rows("0.weight", (12, 8), 0, 12), up_bias=vector("0.bias", 0, 12),
                          down=cols("2.weight", (4, 12), 0, 12))
    assert check_laws(g, [law6], {}, trials=1)["through relu6"] <= TOL  # the probe's inputs alone: it passes
    assert check_laws(g, [law6], {})["through relu6"] > WRONG and INPUT_SCALE > 1
    m2 = randomize(nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 4)))
    probe2 = make_probe(m2, 1e6)
    g2 = Graph(trace(probe2, (x,))[0], (x,), dict(probe2.named_parameters()))
    assert check_laws(g2, [dataclasses.replace(law6, name="relu")], {})["relu"] <= TOL
