"""Detection of models too large for one float64 probe, or on the meta device (``conserve.detection.large``).

A plain-torch Llama-like decoder written here (no HF names: RMSNorm, GQA attention with rotate-half RoPE whose
cos / sin the model computes from an ``inv_freq`` buffer, SwiGLU, a ``ModuleList`` of layers, tied or untied head):

* on the meta device (FSDP2 recipes build every large model there): ``conserve.detect`` takes the block-by-block
  path and finds exactly the laws (names, terms, shapes) that the whole-model float64 detection finds on the same
  architecture materialised, every one passing the spec's first-order check on the materialised model; above the
  old probe limit (8 layers, a 128256 vocabulary: 3.7e8 parameters) it finds every law named for the full shapes;
* materialised above ``max_probe_params`` (set low here so it stays cheap): the same laws as the whole probe, with
  and without the reduction of the vocabulary outside the blocks;
* the laws found on the meta model track the materialised model (one SGD step, ``conserve.track``);
* the block-by-block first-order check agrees with ``check.check_laws`` (true laws at rounding, planted wrong laws
  far above), and its law gradient with autograd through the kernels' reference twin;
* torchtitan's Llama (complex ``freqs_cis`` buffer, interleaved RoPE, ``ModuleDict`` of layers) and a user MLP with
  no repeated block, on the meta device, get the laws of their materialised twins;
* a law read along a reduced axis (an entry per vocabulary row) is not mapped to the full size;
* a block that cannot run on fake tensors (an op with no float64 kernel) and one that cannot run at all are
  handled per block, never by refusing the model.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conserve
from conserve.detection import detect
from conserve.analysis.firstorder import law_gradient
from conserve.detection.check import check_laws_fast
from conserve.detection.large import detect_large, find_blocks
from conserve.laws import QKGram, SwiGLUUnit, cols, rows
from test_detect_graph import hold, reasons
from test_detect_torch import randomize

TOL = 1e-10


# ------------------------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim, theta=10000.0):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, pos):
        f = pos[:, None].to(self.inv_freq.dtype) * self.inv_freq[None, :]
        emb = torch.cat([f, f], -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], -1)


class Attention(nn.Module):
    def __init__(self, dim, nh, nkv, rope=True):
        super().__init__()
        self.nh, self.nkv, self.hd, self.rope = nh, nkv, dim // nh, rope
        self.q = nn.Linear(dim, nh * self.hd, bias=False)
        self.k = nn.Linear(dim, nkv * self.hd, bias=False)
        self.v = nn.Linear(dim, nkv * self.hd, bias=False)
        self.o = nn.Linear(nh * self.hd, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.rope:  # (a layer without RoPE: Llama 4's NoPE layers, same class and shapes)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)  # GQA: query head i reads kv head i // (nh / nkv)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GPUOnly(nn.Module):
    """A block whose code runs only on a GPU (a custom kernel): it cannot run on fake tensors nor on a CPU."""

    def __init__(self, dim):
        super().__init__()
        self.norm, self.lin = RMSNorm(dim), nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        if not x.is_cuda:
            raise RuntimeError("this kernel runs on CUDA only")
        return x + self.lin(self.norm(x))


class Layer(nn.Module):
    def __init__(self, dim, nh, nkv, ffn, rope=True, peek=None):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, nh, nkv, rope)
        self.mlp_norm, self.mlp = RMSNorm(dim), SwiGLU(dim, ffn)
        self.peek = peek  # [a module of the model] read by attribute, not a submodule: e.g. the final norm

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if self.peek:
            x = x * self.peek[0].weight
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama written in plain torch: nothing here has a name any detector knows."""

    def __init__(self, vocab=64, dim=32, layers=2, nh=4, nkv=2, ffn=48, tied=False, gpu_only=(), nope=(),
                 peek=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim // nh)
        self.norm = RMSNorm(dim)
        self.layers = nn.ModuleList([GPUOnly(dim) if i in gpu_only else
                                     Layer(dim, nh, nkv, ffn, rope=i not in nope, peek=[self.norm] if peek else None)
                                     for i in range(layers)])
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = self.rotary(x, torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed=0):
        """What an FSDP2 recipe runs after ``to_empty``: weights drawn, the RoPE buffer recomputed."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
        hd = self.rotary.inv_freq.numel() * 2
        self.rotary.inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd))


def meta(**cfg) -> Llama:
    with torch.device("meta"):
        return Llama(**cfg)


def key(law) -> tuple:
    return law.name, type(law).__name__, law.size, repr(law.terms)


def ids(vocab=64, seed=1):
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- meta device
@pytest.mark.parametrize("tied", [False, True])
def test_meta_model_gets_the_laws_of_the_materialised_one(tied):
    m = randomize(Llama(tied=tied))
    whole = detect(m, loss="ce")
    assert whole.detector == "graph"
    found = detect(meta(tied=tied), loss="ce")
    assert found.detector == "graph:blocks" and any("meta device" in n for n in found.notes)
    assert {key(x) for x in found.laws} == {key(x) for x in whole.laws}
    fam = {"rope_pair": 4, "vo": 4, "swiglu": 2, "gain": 5, "translation": 1}
    if tied:  # the head shares the embedding: its translation and the final norm's gain are declined (tied)
        fam = {"rope_pair": 4, "vo": 4, "swiglu": 2, "gain": 4}
        assert "tied" in reasons(found)["head/translation"]
    assert found.families() == fam, found.families()
    assert found.undetected == [] and reasons(found)["embed"].startswith("input embedding")
    hold(m, found, ids())  # every law holds on the materialised model (spec check 1, float64)
    forced = detect(meta(tied=tied), loss="ce", structural=True)  # structural only: the same block-by-block path
    assert forced.detector == "graph:blocks" and {key(x) for x in forced.laws} == {key(x) for x in found.laws}


def test_meta_model_above_the_old_probe_limit():
    cfg = dict(vocab=128256, dim=1024, layers=8, nh=8, nkv=2, ffn=2816)
    m = meta(**cfg)
    n = sum(p.numel() for p in m.parameters())
    assert n > 3e8
    found = detect(m, loss="ce")
    assert found.detector == "graph:blocks" and found.undetected == []
    assert found.families() == {"rope_pair": 8 * 2, "vo": 8 * 2, "swiglu": 8, "gain": 8 * 2 + 1, "translation": 1}
    assert any("reduced to 24 and to 40" in x for x in found.notes)  # the vocabulary, outside the blocks
    shapes = {k: tuple(p.shape) for k, p in m.named_parameters()}
    for law in found.laws:  # named for the full model's parameters and shapes
        for t in law.terms:
            assert t.ref.param in shapes
            conserve.laws.compile_laws([law], shapes)
    tr = next(x for x in found.laws if x.family == "translation")
    assert {(t.ref.param, t.ref.rows, t.ref.cols) for t in tr.terms} == {("head.weight", 128256, 1024)}
    gain = next(x for x in found.laws if x.name == "norm/gain")
    assert {(t.ref.param, t.ref.cols) for t in gain.terms if t.ref.param == "head.weight"} == {("head.weight", 128256)}
    unit = next(x for x in found.laws if x.name == "layers.7.mlp.up/unit")
    assert unit.params == ("layers.7.mlp.up.weight", "layers.7.mlp.down.weight")
    assert unit.size == 2816 and unit.layer == 7


# ------------------------------------------------------------------------------------ materialised, large
@pytest.mark.parametrize("vocab, tied", [(64, False), (300, False), (500, True)])
def test_materialised_model_above_max_probe_params(vocab, tied):
    m = randomize(Llama(vocab=vocab, tied=tied))
    whole = detect(m, loss="ce")
    limit = 12_000  # below the model (2e4 to 4e4 parameters), above one layer (7.7e3)
    assert sum(p.numel() for p in m.parameters()) > limit
    found = detect(m, loss="ce", max_probe_params=limit)
    assert found.detector == "graph:blocks" and any("above max_probe_params" in n for n in found.notes)
    assert {key(x) for x in found.laws} == {key(x) for x in whole.laws}
    if vocab > 64:  # the parameters outside the blocks above the limit: the vocabulary reduced (tied: one tensor)
        assert any(f"of size [{vocab}]" in n for n in found.notes), found.notes
    hold(m, found, ids(vocab))


def test_structural_block_detection_never_copies_the_model():
    m = randomize(Llama())
    before = {k: v.clone() for k, v in m.state_dict().items()}
    detect_large(m, loss="ce")
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert find_blocks(m) == ["layers.0", "layers.1"]


# --------------------------------------------------------------------------------- tracking after FSDP2-style init
def test_laws_found_on_meta_track_the_materialised_model():
    m = meta()
    found = detect(m, loss="ce")
    m.to_empty(device="cpu")
    m.init_weights()
    m = m.double()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-3), m, laws=found, fp64=True, every=1)
    tr = opt.tracker
    assert {x.name for x in tr.laws} == {x.name for x in found.laws}
    h0 = {k: v.clone() for k, v in tr.values().items()}
    x = ids()
    opt.zero_grad()
    F.cross_entropy(m(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
    opt.step()
    h1 = tr.values()
    for law in tr.laws:  # plain SGD: each law moves by O(lr^2), its terms by O(lr)
        change = (h1[law.name] - h0[law.name]).abs().max().item()
        assert math.isfinite(change) and change < 1e-4 * (1 + h0[law.name].abs().max().item()), (law.name, change)


# -------------------------------------------------------------------------------------- the block-level check
def test_fast_check_agrees_with_the_reference_check():
    from conserve.detection.graph import Graph, check_laws, synth_inputs, trace
    from conserve.detection.large import materialise

    m = randomize(Llama())
    found = detect(m, loss="ce")
    probe = materialise(m)
    x = synth_inputs(probe, ids())
    gm, how = trace(probe, x, {})
    g = Graph(gm, x, dict(probe.named_parameters(remove_duplicate=False)), {})
    q, k = "layers.0.attn.q.weight", "layers.0.attn.k.weight"
    wrong = [QKGram.build("plain QK Gram under RoPE", 0, plus=[rows(q, (32, 32), 0, 8), rows(q, (32, 32), 8, 8)],
                          minus=[rows(k, (16, 32), 0, 8)]),
             SwiGLUUnit.build("unit on the gate", 0, up=rows("layers.0.mlp.gate.weight", (48, 32), 0, 48),
                              down=cols("layers.0.mlp.down.weight", (32, 48), 0, 48))]
    laws = found.laws + wrong
    heads = {x.name: None for x in laws if x.family == "translation"}
    fast, ref = check_laws_fast(g, laws, heads), check_laws(g, laws, heads)
    for law in found.laws:
        assert 0 <= fast[law.name] <= TOL and 0 <= ref[law.name] <= TOL, (law.name, fast[law.name], ref[law.name])
    for law in wrong:
        assert fast[law.name] > 1e-4 and ref[law.name] > 1e-4, (law.name, fast[law.name], ref[law.name])


def test_law_gradient_is_the_gradient_of_the_law():
    from conserve.analysis.firstorder import law_vector

    m = randomize(Llama())
    params = {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    found = detect(m, loss="ce").laws
    dup = dataclasses.replace(found[0], name="overlapping", terms=found[0].terms + found[0].terms[:1])
    for law in found + [dup]:
        h = law_vector(law, params)
        s = torch.randn(h.shape, generator=gen, dtype=torch.float64)
        want = torch.autograd.grad((s * h).sum(), [params[k] for k in law.params])
        got = law_gradient(law, params, s)
        for k, w in zip(law.params, want):
            dense = torch.zeros_like(w)
            for ref, d in got[k]:
                (dense if ref is None else ref.view(0).of(dense)).add_(d)
            assert torch.allclose(dense, w, rtol=1e-12, atol=1e-12), (law.name, k)


# ------------------------------------------------------------------------------------- blocks that cannot run
def test_block_with_no_float64_kernel_on_meta():
    from test_detect_robust import Decoder

    whole = detect(randomize(Decoder(ffns=("swiglu", "grouped"))).float(), loss="ce")
    with torch.device("meta"):
        m = Decoder(ffns=("swiglu", "grouped"))
    found = detect(m, loss="ce")
    assert found.detector == "graph:blocks" and any("run concretely" in n for n in found.notes), found.notes
    assert {key(x) for x in found.laws} == {key(x) for x in whole.laws}
    assert "cannot run in float64" in reasons(found)["layers.1.ffn.experts"]


def test_block_that_cannot_run_is_declined_by_name():
    m = meta(layers=3, gpu_only=(1,))
    found = detect(m, loss="ce")
    why = reasons(found)
    assert "layers.1" in why and "CUDA only" in why["layers.1"]
    # the other layers and the parts outside the blocks are detected
    assert found.families() == {"rope_pair": 4, "vo": 4, "swiglu": 2, "gain": 5, "translation": 1}, found.families()
    assert found.undetected == []


# ------------------------------------------------------------------------------------------ other layouts
def test_torchtitan_llama_and_a_user_mlp_on_meta():
    from graph_models import Llama as TorchtitanLlama, MyMLP

    for cls, kw, x in ((TorchtitanLlama, {}, ids(vocab=17)), (MyMLP, {}, None)):
        whole = detect(randomize(cls(**kw)), loss="ce")
        with torch.device("meta"):
            m = cls(**kw)
        found = detect(m, loss="ce")
        assert found.detector == "graph:blocks", cls
        assert {key(x) for x in found.laws} == {key(x) for x in whole.laws} and found.laws, cls
    assert found.families() == {"relu": 1, "translation": 1}


def test_reduced_axis_read_entry_by_entry_is_not_mapped():
    from conserve.detection.large import _unreduce

    small, full = {"head.weight": (24, 8)}, {"head.weight": (128256, 8), "w.weight": (8, 24)}
    per_row = SwiGLUUnit.build("rows", 0, up=rows("head.weight", (24, 8), 0, 24), down=cols("w.weight", (8, 24), 0, 24))
    assert _unreduce(per_row, small, full) is None  # one entry per vocabulary row: no full-size law from it
    part = QKGram.build("part", 0, plus=[cols("head.weight", (24, 8), 0, 4)],
                        minus=[cols("head.weight", (24, 8), 4, 4)])
    mapped = _unreduce(part, small, full)  # whole columns: contracted over the reduced axis
    assert mapped is not None and {t.ref.cols for t in mapped.terms} == {128256}


def test_layers_of_one_class_taking_other_code_paths_are_not_grouped():
    m = randomize(Llama(layers=4, nope=(1, 3)))  # every other layer without RoPE: a QK Gram law there
    whole = detect(m, loss="ce")
    found = detect(meta(layers=4, nope=(1, 3)), loss="ce")
    assert {key(x) for x in found.laws} == {key(x) for x in whole.laws}
    assert found.families() == {"rope_pair": 4, "qk": 4, "vo": 8, "swiglu": 4, "gain": 9, "translation": 1}
    assert any("4 block(s) in 2 group(s)" in n for n in found.notes), found.notes
    hold(m, found, ids())


def test_parameter_outside_the_blocks_read_inside_one_declines_its_law():
    m = randomize(Llama(peek=True))  # every layer multiplies by the final norm's gain: its gain law is broken
    whole = detect(m, loss="ce")
    found = detect(meta(peek=True), loss="ce")
    assert "norm/gain" not in {x.name for x in whole.laws} | {x.name for x in found.laws}
    assert "inside a block's forward" in reasons(found)["norm/gain"]
    assert {key(x) for x in found.laws} <= {key(x) for x in whole.laws}
    hold(m, found, ids())
