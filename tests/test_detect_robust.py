"""Structural detection on patterns of third-party libraries, each written here in plain torch: logits ending with
``.float()`` (torchtune); RMSNorm and RoPE upcast inside ``torch.autocast(enabled=False)`` (OLMo-core: export's
autocast regions and their ``_assert_tensor_metadata`` nodes); a Mixtral-style expert loop that depends on the
routing and experts run with ``torch._grouped_mm`` (no float64 kernel; torchtitan), a root forward that cannot
be traced, a parameter read outside its block, a branch that changes the activation (``conserve.detection.blocks``);
x-transformers' einsum attention (MHA, MQA, GQA tiled ``i % n_kv`` or repeated ``i // (nH / nKV)``, interleaved
RoPE) and fused GLU with ``mult_bias``; TransformerLens' per-head ``[heads, d_model, d_head]`` weights (their QK,
VO and gain laws; what the decline reasons say when a weight is computed from them). Every claimed law is checked again on the ORIGINAL model (``test_detect_graph.hold``).
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conserve.detection import detect
from test_detect_graph import fail, floats, hold, ids, law, reasons
from test_detect_torch import randomize


class RMSNorm(nn.Module):
    def __init__(self, d, upcast="plain"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.upcast = upcast

    def forward(self, x):
        if self.upcast == "autocast":  # OLMo-core: the norm in float32 with autocast off
            with torch.autocast(x.device.type, enabled=False):
                h = x.float()
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                return (self.weight * h).to(x.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Attention(nn.Module):
    """sdpa attention; ``rope=True``: rotate_half RoPE computed in float32 inside ``torch.autocast(enabled=False)``
    with ``.float()`` / ``.type_as`` (OLMo-core's RoPE)."""

    def __init__(self, h=16, nh=4, rope=False):
        super().__init__()
        self.nh, self.d, self.rope = nh, h // nh, rope
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (lin(x).view(b, t, self.nh, self.d).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.rope:
            with torch.autocast(x.device.type, enabled=False):
                inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
                ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
                cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
                q_, k_ = q.float(), k.float()
                q_, k_ = q_ * cos + rotate_half(q_) * sin, k_ * cos + rotate_half(k_) * sin
                q, k = q_.type_as(q), k_.type_as(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    def __init__(self, h=16, i=24):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LoopMoE(nn.Module):
    """Mixtral's eager expert loop: which experts run, on which tokens, depends on the routing (``torch.where``,
    ``if tok.numel()``): neither torch.fx nor torch.export traces it."""

    def __init__(self, h=16, i=12, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(experts)])
        self.top_k = top_k

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        w, idx = torch.topk(F.softmax(self.router(z), dim=-1), self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(z)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out = out.index_add(0, tok, expert(z[tok]) * w[tok, slot, None])
        return out.reshape(b, t, h)


class GroupedExperts(nn.Module):
    """torchtitan's experts: 3-D weights run with ``torch._grouped_mm`` (float32/bf16 only: no float64 kernel)."""

    def __init__(self, h=16, i=16, experts=2):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, h, i) / 4)
        self.w3 = nn.Parameter(torch.randn(experts, h, i) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, i, h) / 4)

    def forward(self, x, offs):
        def mm(a, w):  # _grouped_mm wants column-major weights
            return torch._grouped_mm(a, w.transpose(-2, -1).contiguous().transpose(-2, -1), offs=offs)

        return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)


class GroupedMoE(nn.Module):
    def __init__(self, h=16, experts=2):
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = GroupedExperts(h, 16, experts)

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        w, idx = torch.topk(F.softmax(self.router(z), dim=-1), 1, dim=-1)
        order = torch.argsort(idx[:, 0], stable=True)
        counts = torch.bincount(idx[:, 0], minlength=self.router.out_features)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        y = self.experts(z[order], offs) * w[order]
        return torch.zeros_like(z).index_copy(0, order, y).reshape(b, t, h)


class Layer(nn.Module):
    def __init__(self, h=16, ffn="swiglu", upcast="plain"):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(h, upcast), Attention(h, rope=upcast == "autocast")
        self.ffn_norm = RMSNorm(h, upcast)
        self.ffn = {"swiglu": lambda: SwiGLU(h), "loop": lambda: LoopMoE(h), "grouped": lambda: GroupedMoE(h)}[ffn]()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, ffns=("swiglu", "swiglu"), vocab=23, h=16, upcast="plain", cast_out=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList([Layer(h, f, upcast) for f in ffns])
        self.norm, self.output = RMSNorm(h, upcast), nn.Linear(h, vocab, bias=False)
        self.cast_out = cast_out

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        y = self.output(self.norm(x))
        return y.float() if self.cast_out else y


def dense_laws(found, layers):
    """{layer: families found under it} for the dense layers."""
    out = {}
    for i in layers:
        out[i] = sorted({x.family for x in found.laws if x.name.startswith(f"layers.{i}.")})
    return out


# ------------------------------------------------------------------------------------------ output dtype
def test_output_cast_to_float32_is_not_a_different_function():
    m = randomize(Decoder(cast_out=True))
    found = detect(m, loss="ce")
    assert found.families() == {"qk": 8, "vo": 8, "swiglu": 2, "gain": 5, "translation": 1}, found.families()
    hold(m, found, ids(vocab=23))


# ------------------------------------------------------------------------------ export's autocast regions
def test_norm_upcast_in_an_autocast_region_is_seen():
    m = randomize(Decoder(upcast="autocast"))
    found = detect(m, loss="ce")
    # the RMSNorms and the RoPE run inside ``wrap_with_autocast`` regions of the exported graph (their float32 casts
    # leave ``_assert_tensor_metadata(dtype=float32)`` nodes there): inlined, the casts made float64 and the asserts
    # dropped, the gains found with their readers and the RoPE pairs {p, p + 2} at float64 precision
    assert found.families() == {"rope_pair": 8, "vo": 8, "swiglu": 2, "gain": 5, "translation": 1}, found.families()
    rope = law(found, "layers.1.attn/rope/group3")
    # one vector law over the pairs of head 3 (rows [12, 16)): entry p reads rows 12 + p and 14 + p
    assert {(t.ref.param, t.ref.start[0], t.ref.rows, t.ref.row_step) for t in rope.terms} == {
        ("layers.1.attn.q.weight", s, 2, 1) for s in (12, 14)} | {("layers.1.attn.k.weight", s, 2, 1) for s in (12, 14)}
    assert law(found, "layers.0.ffn_norm/gain").params == (
        "layers.0.ffn_norm.weight", "layers.0.ffn.gate.weight", "layers.0.ffn.up.weight")
    hold(m, found, ids(vocab=23))


# ------------------------------------------------------------------------------ one block, not the model
def test_routing_dependent_expert_loop_does_not_refuse_the_model():
    m = randomize(Decoder(ffns=("swiglu", "loop", "swiglu")))
    found = detect(m, loss="ce")
    assert found.detector == "graph"
    # dense layers: everything; the MoE layer: attention, its attention gain, and, from the MoE block traced with
    # real tensors (its loop as the example input's routing runs it, re-checked on other inputs' routings), the
    # router's softmax law and each expert's SwiGLU law; the gain read by the opaque MoE block takes the linear
    # maps its own graph shows reading its input: the router and every expert's gate and up
    assert dense_laws(found, (0, 2)) == {0: ["gain", "qk", "swiglu", "vo"], 2: ["gain", "qk", "swiglu", "vo"]}
    fam = found.families()
    assert fam["swiglu"] == 2 + 4 and fam["qk"] == 12 and fam["vo"] == 12 and fam["translation"] == 1, fam
    assert {x.name for x in found.laws if x.name.startswith("layers.1.ffn.")} == {
        f"layers.1.ffn.experts.{e}.up/unit" for e in range(4)} | {"layers.1.ffn.router/router"}
    why = reasons(found)
    assert "torch.fx cannot trace" in why["layers.1.ffn"] and "opaque" in why["layers.1.ffn"]
    assert "layers.1.ffn_norm" not in why
    assert set(law(found, "layers.1.ffn_norm/gain").params) == {"layers.1.ffn_norm.weight",
                                                                 "layers.1.ffn.router.weight"} | {
        f"layers.1.ffn.experts.{e}.{p}.weight" for e in range(4) for p in ("gate", "up")}
    assert found.undetected == []
    hold(m, found, ids(vocab=23))


def test_op_without_float64_kernel_is_one_opaque_block():
    m = randomize(Decoder(ffns=("swiglu", "grouped"))).float()  # float32: the model's own dtype runs
    found = detect(m, loss="ce")
    assert dense_laws(found, (0,)) == {0: ["gain", "qk", "swiglu", "vo"]}
    # the MoE layer: attention, its gain, and the softmax router (read by the stand-in's caller through top-1)
    assert {x.family for x in found.laws if x.name.startswith("layers.1.")} == {"qk", "vo", "gain", "router_sum"}
    why = reasons(found)
    assert "float64" in why["layers.1.ffn.experts"], why["layers.1.ffn.experts"]
    assert found.undetected == []
    # the grouped experts cannot run in float64: the claimed laws are checked on the same function with the
    # experts computed by a per-expert loop (the same parameters, float64)
    import copy

    def loop(self, x, offs):
        out, start = [], 0
        for e, end in enumerate(offs.tolist()):
            z = x[start:end]
            out.append((F.silu(z @ self.w1[e]) * (z @ self.w3[e])) @ self.w2[e])
            start = end
        return torch.cat(out)

    ref = copy.deepcopy(m).double()
    ref.layers[1].ffn.experts.forward = loop.__get__(ref.layers[1].ffn.experts)
    hold(ref, found, ids(vocab=23))


def test_untraceable_root_forward_analyses_each_child():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(23, 16)
            self.blocks = nn.ModuleList([Layer(16) for _ in range(2)])

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                if x.norm() > 1e6:  # data-dependent control flow in the root itself
                    x = x / x.norm()
                x = blk(x)
            return x

    m = randomize(Root())
    found = detect(m)
    assert found.families() == {"qk": 8, "vo": 8, "swiglu": 2, "gain": 4}, found.families()
    assert law(found, "blocks.1.attn/qk/group2").layer == 1
    assert found.undetected == []
    hold(m, found, ids(vocab=23))


def test_parameter_read_outside_its_block_declines_the_law():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(23, 16)
            self.blocks = nn.ModuleList([Layer(16) for _ in range(1)])

        def forward(self, tokens):
            x = self.embed(tokens)
            if x.norm() > 1e6:
                x = x / x.norm()
            x = self.blocks[0](x)
            ffn = self.blocks[0].ffn  # its up and down projections also read outside the block
            return x + F.linear(F.linear(x, ffn.up.weight), ffn.down.weight)

    m = randomize(Shared())
    found = detect(m)
    why = reasons(found)
    assert "layers" not in why and "blocks.0.ffn.up/unit" in why and "outside" in why["blocks.0.ffn.up/unit"]
    assert "blocks.0.ffn.up/unit" not in {x.name for x in found.laws}
    hold(m, found, ids(vocab=23))


class CachedAttention(nn.Module):
    """Attention writing its keys and values into cache buffers and reading them back (inference-style code)."""

    def __init__(self, h=16, nh=2, max_len=32):
        super().__init__()
        self.nh, self.q, self.k, self.v, self.o = nh, *(nn.Linear(h, h, bias=False) for _ in range(4))
        self.register_buffer("k_cache", torch.zeros(4, max_len, h), persistent=False)
        self.register_buffer("v_cache", torch.zeros(4, max_len, h), persistent=False)

    def forward(self, x):
        b, t, h = x.shape
        self.k_cache[:b, :t] = self.k(x)
        self.v_cache[:b, :t] = self.v(x)
        split = lambda y: y.view(b, t, self.nh, -1).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k_cache[:b, :t]), split(self.v_cache[:b, :t]),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, h))


class CachedLM(nn.Module):
    def __init__(self, vocab=23, h=16):
        super().__init__()
        self.embed, self.norm, self.attn = nn.Embedding(vocab, h), RMSNorm(h), CachedAttention(h)
        self.final, self.output = RMSNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm(x))
        return self.output(self.final(x))


def test_buffers_written_in_forward_do_not_break_the_check():
    """A forward that writes a cache buffer: each forward of the check starts from a fresh copy of the buffers
    (no autograd history carried from the previous one, the model's buffers untouched), so the laws that do not
    go through the cache are claimed and hold; the gain read through the cache is not claimed (its reader path
    goes through a buffer)."""
    m = randomize(CachedLM())
    before = m.attn.k_cache.clone()
    found = detect(m, loss="ce")
    assert not [x for x in found.declined if "second time" in x.reason or "could not run" in x.reason], reasons(found)
    assert {"final/gain", "output/translation"} <= {x.name for x in found.laws}, reasons(found)
    assert torch.equal(m.attn.k_cache, before)
    hold(m, found, ids(vocab=23))


def test_nothing_readable_still_raises_with_the_reasons():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.a(-x)

    from conserve.errors import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="could not run"):
        detect(Branchy(), example_inputs=torch.ones(2, 4))


# ------------------------------------------------------------------------------- einsum attention, GQA conventions
def rotate_pairs(x):
    """x-transformers' rotate_half: '... (d r) -> ... d r' with r = 2, then (-x2, x1): adjacent pairs {2p, 2p+1}."""
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), dim=-1).reshape(*x.shape[:-2], -1)


class EinsumGQA(nn.Module):
    """x-transformers' default attention: scores and output by ``einsum``, ``masked_fill`` with ``-finfo.max``,
    ``F.softmax(..., dtype=float32)`` then ``.type(dtype)``. GQA ``tile='mod'``: the kv heads tiled
    (``repeat(t, 'b h ... -> b (r h) ...')``: query head i reads kv head ``i % n_kv``); ``'div'``: HF ``repeat_kv``
    (``i // (nH / nKV)``). ``n_kv=1`` with ``mqa=True``: the one kv head kept 3-D (``'b h i d, b j d -> b h i j'``)."""

    def __init__(self, h=16, nh=4, n_kv=2, tile="mod", rope=False, mqa=False):
        super().__init__()
        self.nh, self.n_kv, self.d, self.tile, self.rope, self.mqa = nh, n_kv, h // nh, tile, rope, mqa
        self.to_q = nn.Linear(h, h, bias=False)
        self.to_k, self.to_v = nn.Linear(h, n_kv * self.d, bias=False), nn.Linear(h, n_kv * self.d, bias=False)
        self.to_out = nn.Linear(h, h, bias=False)
        self.softmax_dtype = torch.float32

    def forward(self, x):
        b, t, _ = x.shape
        q = self.to_q(x).view(b, t, self.nh, self.d).transpose(1, 2)
        if self.mqa:
            k, v = self.to_k(x), self.to_v(x)
            sim = torch.einsum("b h i d, b j d -> b h i j", q, k) * self.d ** -0.5
            attn = F.softmax(sim, dim=-1, dtype=self.softmax_dtype).type(sim.dtype)
            out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
            return x + self.to_out(out.transpose(1, 2).reshape(b, t, -1))
        k = self.to_k(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        v = self.to_v(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        if self.rope:
            inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=x.dtype) / self.d))
            ang = (torch.arange(t, dtype=x.dtype)[:, None] * inv[None]).repeat_interleave(2, dim=-1)
            q, k = (z * ang.cos() + rotate_pairs(z) * ang.sin() for z in (q, k))
        r = self.nh // self.n_kv
        if r > 1:
            if self.tile == "mod":
                k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
            else:
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.d ** -0.5
        sim = sim.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.finfo(sim.dtype).max)
        attn = F.softmax(sim, dim=-1, dtype=self.softmax_dtype).type(sim.dtype)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return x + self.to_out(out.transpose(1, 2).reshape(b, t, -1))


def rows_of(found, name):
    return sorted({(t.ref.param, t.ref.start, t.sign) for t in law(found, name).terms})


def hold64(m, found, x):
    m.softmax_dtype = torch.float64  # the model's float32 softmax is a precision choice the detection made float64
    hold(m, found, x)


@pytest.mark.parametrize("kind", ["mha", "mqa"])
def test_einsum_attention_mha_and_mqa(kind):
    m = randomize(EinsumGQA(n_kv=4) if kind == "mha" else EinsumGQA(n_kv=1, mqa=True))
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = detect(m, example_inputs=x)
    groups = 4 if kind == "mha" else 1
    assert found.families() == {"qk": groups, "vo": groups}, found.families()
    if kind == "mha":
        assert rows_of(found, "to_q/qk/group2") == [("to_k.weight", (8, 0), -1.0), ("to_q.weight", (8, 0), 1.0)]
    else:  # every query head reads the one kv head
        assert [p for p, s, _ in rows_of(found, "to_q/qk/group0")].count("to_q.weight") == 4
    hold64(m, found, x)


@pytest.mark.parametrize("tile,heads", [("mod", (1, 3)), ("div", (2, 3))])
@pytest.mark.parametrize("rope", [False, True])
def test_einsum_gqa_reads_which_kv_head_each_query_head_uses(tile, heads, rope):
    m = randomize(EinsumGQA(n_kv=2, tile=tile, rope=rope))
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = detect(m, example_inputs=x)
    assert found.families() == {"rope_pair" if rope else "qk": 2, "vo": 2}, found.families()
    qk = law(found, f"to_q/{'rope' if rope else 'qk'}/group1")
    q_rows = sorted({t.ref.start[0] // 4 for t in qk.terms if t.ref.param == "to_q.weight"})
    k_rows = sorted({t.ref.start[0] // 4 for t in qk.terms if t.ref.param == "to_k.weight"})
    assert q_rows == list(heads) and k_rows == [1]  # kv head 1 and the query heads that read it
    if rope:  # x-transformers rotates adjacent pairs {2p, 2p+1}
        assert {(t.ref.start[0] % 4, t.ref.row_step) for t in qk.terms} == {(0, 2), (1, 2)}
    vo = law(found, "to_q/vo/group1")
    assert sorted(t.ref.start[1] // 4 for t in vo.terms if t.ref.param == "to_out.weight") == list(heads)
    hold64(m, found, x)
    # the other convention's grouping fails the check
    from conserve.laws import QKGram, rows
    other = (2, 3) if tile == "mod" else (1, 3)
    wrong = QKGram.build("w", None, plus=[rows("to_q.weight", (16, 16), 4 * i, 4) for i in other],
                         minus=[rows("to_k.weight", (8, 16), 4, 4)])
    if not rope:
        from test_detect_graph import fail
        m.softmax_dtype = torch.float64
        fail(m, {"other GQA convention": wrong}, x)


# ------------------------------------------------------------------------------------------ decline reasons
class LNw(nn.Module):
    """TransformerLens' LayerNorm: parameters ``w`` and ``b``."""

    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * self.w + self.b


class TLAttention(nn.Module):
    """TransformerLens: ``W_Q`` etc. stored ``[heads, d_model, d_head]`` (``W_K`` / ``W_V`` ``[n_kv, ...]``, their
    heads repeated ``i // (nH / nKV)`` for GQA), ``W_O`` ``[heads, d_head, d_model]``, read by ``F.linear`` of the
    rearranged weight (``mode='linear'``), by einsum (``'einsum'``), or by ``F.linear`` of a weight normalised on
    the fly (``'normed'``: computed from the parameter, not a rearrangement of it)."""

    def __init__(self, d=16, nh=4, mode="linear", n_kv=None, rope=False, rotary_dim=None):
        super().__init__()
        self.mode, self.nh, self.rope, dh = mode, nh, rope, d // nh
        self.rotary_dim = rotary_dim or dh
        n_kv = n_kv or nh
        self.W_Q = nn.Parameter(torch.randn(nh, d, dh))
        self.W_K, self.W_V = (nn.Parameter(torch.randn(n_kv, d, dh)) for _ in range(2))
        self.W_O = nn.Parameter(torch.randn(nh, dh, d))
        self.b_Q = nn.Parameter(torch.zeros(nh, dh))
        self.b_K, self.b_V = (nn.Parameter(torch.zeros(n_kv, dh)) for _ in range(2))

    def lin(self, x, w, b):
        nh, d, dh = w.shape
        if self.mode == "linear":
            return F.linear(x, w.permute(0, 2, 1).reshape(nh * dh, d), b.reshape(-1)).reshape(*x.shape[:-1], nh, dh)
        if self.mode == "normed":
            w = w / w.norm(dim=1, keepdim=True)
            return F.linear(x, w.permute(0, 2, 1).reshape(nh * dh, d), b.reshape(-1)).reshape(*x.shape[:-1], nh, dh)
        return torch.einsum("bpd,hde->bphe", x, w) + b

    def forward(self, x):
        q, k, v = self.lin(x, self.W_Q, self.b_Q), self.lin(x, self.W_K, self.b_K), self.lin(x, self.W_V, self.b_V)
        if self.rope:  # rotate_half on the first rotary_dim dims of each head, as TransformerLens' rotary
            t, rd = x.shape[1], self.rotary_dim
            inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=x.dtype) / rd))
            ang = torch.cat([torch.arange(t, dtype=x.dtype)[:, None] * inv[None]] * 2, -1)[:, None, :]
            q, k = (torch.cat([z[..., :rd] * ang.cos() + rotate_half(z[..., :rd]) * ang.sin(), z[..., rd:]], -1)
                    for z in (q, k))
        r = self.nh // k.shape[-2]
        k, v = k.repeat_interleave(r, dim=-2), v.repeat_interleave(r, dim=-2)
        z = torch.einsum("bhqk,bkhe->bqhe", (torch.einsum("bqhe,bkhe->bhqk", q, k) / 2).softmax(-1), v)
        return torch.einsum("bqhe,hed->bqd", z, self.W_O)


class TLBlock(nn.Module):
    def __init__(self, mode, **attn):
        super().__init__()
        self.ln1, self.attn, self.ln2 = LNw(16), TLAttention(mode=mode, **attn), LNw(16)
        self.W_in, self.W_out = nn.Parameter(torch.randn(16, 32)), nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + F.gelu(self.ln2(x) @ self.W_in) @ self.W_out


def tl_input():
    return torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("mode", ["linear", "einsum"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_parameter_shaped_heads_get_their_qk_vo_and_gain_laws(mode, n_kv):
    """TransformerLens' heads: ``W_Q[h]`` is ``[d_model, d_head]`` (head h's queries are its columns), ``W_O[h]``
    ``[d_head, d_model]`` (head h's output columns are its rows): one QK and one VO Gram law per kv group, the first
    norm's gain law read by every head of W_Q, W_K, W_V. Each law passes the first-order check on the model itself."""
    from conserve.analysis.verify import TOL, first_order
    from conserve.laws import QKGram, VOGram
    from conserve.laws.base import Ref

    m = randomize(TLBlock(mode, n_kv=n_kv))
    x = tl_input()
    found = detect(m, example_inputs=x)
    assert found.families() == {"qk": n_kv, "vo": n_kv, "gain": 2} and found.undetected == [], found.families()
    assert law(found, "ln1/gain").params == ("ln1.w", "ln1.b", "attn.W_Q", "attn.W_K", "attn.W_V")
    rep = 4 // n_kv
    qk = law(found, "attn/qk/group1")
    # query heads rep..2 rep - 1 (columns of W_Q[h]: rows along dim 2) read kv head 1
    assert {(t.ref.param, t.ref.start, t.ref.row_dim, t.sign) for t in qk.terms if t.ref.param.startswith("attn.W")} \
        == {("attn.W_Q", (h, 0, 0), 2, 1.0) for h in range(rep, 2 * rep)} | {("attn.W_K", (1, 0, 0), 2, -1.0)}
    vo = law(found, "attn/vo/group1")
    assert {(t.ref.param, t.ref.start, t.ref.row_dim) for t in vo.terms if t.ref.param == "attn.W_O"} \
        == {("attn.W_O", (h, 0, 0), 1) for h in range(rep, 2 * rep)}  # W_O[h]'s rows
    for l in found.laws:
        assert first_order(m, l, x, trials=2) <= TOL, l.name
    hold(m, found, x)
    # another head pairing fails the check: query head 0 with the last kv head, value head 0 with W_O[1]
    q, k = Ref("attn.W_Q", (0, 0, 0), 2, 4, 1, 16), Ref("attn.W_K", (n_kv - 1, 0, 0), 2, 4, 1, 16)
    v, o = Ref("attn.W_V", (0, 0, 0), 2, 4, 1, 16), Ref("attn.W_O", (rep, 0, 0), 1, 4, 2, 16)
    wrong = {"qk of another kv head": QKGram.build("w", None, plus=[q], minus=[k]),
             "vo of another head": VOGram.build("w2", None, plus=[v], minus=[o])}
    fail(m, wrong, x)


@pytest.mark.parametrize("mode", ["linear", "einsum"])
@pytest.mark.parametrize("n_kv,rotary_dim", [(4, None), (2, None), (2, 2)])
def test_parameter_shaped_heads_with_rope_get_their_rope_pair_laws(mode, n_kv, rotary_dim):
    """RoPE on ``[heads, d_model, d_head]`` heads (TransformerLens' rotary; partial with ``rotary_dim``): one
    RoPE-pair law per kv group, reading each head's slice of ``W_Q`` / ``W_K`` (its bias ``b_Q[h]``), plus the
    pass-through Gram of partial rotary; each law passes the first-order check on the model itself, and a wrong
    pairing fails it."""
    from conserve.analysis.verify import TOL, first_order
    from conserve.laws import RopePairs
    from conserve.laws.base import Ref, Term

    m = randomize(TLBlock(mode, rope=True, n_kv=n_kv, rotary_dim=rotary_dim))
    x = tl_input()
    found = detect(m, example_inputs=x)
    fam = {"rope_pair": n_kv, "vo": n_kv, "gain": 2} | ({"rope_pass": n_kv} if rotary_dim else {})
    assert found.families() == fam and found.undetected == [], found.families()
    rope = law(found, "attn/rope/group1")
    rep = 4 // n_kv
    assert {(t.ref.param, t.ref.start[0]) for t in rope.terms} \
        == {(p, h) for p in ("attn.W_Q", "attn.b_Q") for h in range(rep, 2 * rep)} \
        | {("attn.W_K", 1), ("attn.b_K", 1)}
    for l in found.laws:
        assert first_order(m, l, x, trials=2) <= TOL, l.name
    hold(m, found, x)
    # dims 0 and 1 are not rotated together (rotate_half pairs d with d + rotary_dim / 2)
    wrong = RopePairs("wrong", None, [Term("norm", Ref(p, (0, 0, t), 2, 1, 1, 16), sign)
                                      for p, sign in (("attn.W_Q", 1.0), ("attn.W_K", -1.0)) for t in (0, 1)], 1, "")
    if (rotary_dim or 4) > 2:
        fail(m, {"pairing dims 0 and 1": wrong}, x)


def test_decline_reasons_say_what_reads_the_norm():
    """A weight computed from the parameter (normalised on the fly): no linear map with a stored weight reads the
    first norm; the reason names the parameters the weights come from, once, without contradicting itself."""
    m = randomize(TLBlock("normed"))
    x = tl_input()
    found = detect(m, example_inputs=x)
    # ``x @ W_in`` (W stored (in, out)) is a linear map: the second norm's gain law reads W_in's rows
    assert law(found, "ln2/gain").params == ("ln2.w", "ln2.b", "W_in")
    why = reasons(found)["ln1"]
    assert "W_Q" in why and "W_K" in why and "['linear']" not in why, why  # the reader named, not just its op
    assert why.count("ln1") == 0 and len([d for d in found.declined if d.module == "ln1"]) == 1
    assert "" not in {d.module for d in found.declined}
    hold(m, found, x)


# ------------------------------------------------------------------------------------------ fused GLU
class FusedGLU(nn.Module):
    """x-transformers' GLU: one projection chunked into (x, gate), ``x * act(gate) * mult_bias`` (the constant 1.0,
    or a per-unit parameter), inside an ``nn.Sequential`` with an Identity and a Dropout before the output."""

    def __init__(self, dim=16, inner=32, mult_bias=False):
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)
        self.mult_bias = nn.Parameter(torch.ones(inner)) if mult_bias else 1.0

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.silu(gate) * self.mult_bias


class GLUFeedForward(nn.Module):
    def __init__(self, mult_bias):
        super().__init__()
        self.ff = nn.Sequential(FusedGLU(mult_bias=mult_bias), nn.Identity(), nn.Dropout(0.0), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.ff(x)


@pytest.mark.parametrize("mult_bias", [False, True])
def test_fused_glu_with_a_scale_after_the_product(mult_bias):
    m = randomize(GLUFeedForward(mult_bias))
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = detect(m, example_inputs=x)
    assert found.families().get("swiglu") == 1, found.families()
    unit = law(found, "ff.0.proj/unit")
    # the up half is the first chunk: rows [0, 32) of proj (weight and bias), read by the 32 columns of the output projection
    assert {(t.ref.param, t.ref.start[0], t.ref.rows) for t in unit.terms} == {
        ("ff.0.proj.weight", 0, 32), ("ff.0.proj.bias", 0, 32), ("ff.3.weight", 0, 32)}
    hold(m, found, x)


class Switch(nn.Module):
    """A block whose forward picks its activation by how many tokens are selected (``nonzero``, as a router's
    dispatch does): ReLU (a unit law) when most are, else GELU (none). ``by_value``: by the sign of a sum (an
    ``item()`` read: no trace of any kind runs it)."""

    def __init__(self, h=8, by_value=False):
        super().__init__()
        self.up, self.down = nn.Linear(h, 16), nn.Linear(16, h)
        self.by_value = by_value

    def forward(self, x):
        z = self.up(x)
        if self.by_value:
            most = x[..., 0].sum() > 0
        else:
            most = torch.nonzero(x[..., 0] > 0).shape[0] * 2 > x[..., 0].numel()
        return x + self.down(F.relu(z) if most else F.gelu(z))


class SwitchNet(nn.Module):
    def __init__(self, h=8, by_value=False):
        super().__init__()
        self.blocks = nn.ModuleList([Switch(h, by_value)])
        self.head = nn.Linear(h, 4)

    def forward(self, x):
        return self.head(self.blocks[0](x))


@pytest.mark.parametrize("by_value", [False, True])
def test_law_of_one_branch_only_is_not_claimed(by_value):
    m = randomize(SwitchNet(by_value=by_value))
    x = torch.ones(2, 5, 8, dtype=torch.float64)  # the ReLU branch
    found = detect(m, example_inputs=x)
    why = reasons(found)
    assert "blocks.0.up/unit" not in {law.name for law in found.laws}
    if by_value:  # not traceable at all: each Linear alone, nothing claimed
        assert "analysed on its own" in why["blocks.0.up"], why
    else:  # traced with real tensors on the ReLU branch; other inputs take the GELU one: the unit law fails there
        assert "another input" in why["blocks.0.up/unit"], why


# ------------------------------------------------------------------------------------------ patch images
class PatchViT(nn.Module):
    """vit-pytorch's ViT: the image cut into ``p x p`` patches by a rearrangement (``b c (h p1) (w p2) -> b (h w)
    (p1 p2 c)``), a LayerNorm and a Linear of ``c p^2`` features first, a class token and ``(1, N + 1, D)``
    positions sliced to the patches; forward takes an image only."""

    def __init__(self, image=12, p=3, c=3, d=16, heads=2):
        super().__init__()
        self.p, self.heads = p, heads
        n = (image // p) ** 2
        self.patch_norm, self.patch = nn.LayerNorm(c * p * p), nn.Linear(c * p * p, d)
        self.cls_token, self.pos_embedding = nn.Parameter(torch.randn(1, 1, d)), nn.Parameter(torch.randn(1, n + 1, d))
        self.norm, self.qkv, self.out, self.head = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 5)

    def forward(self, img):
        b, c, hh, ww = img.shape
        p = self.p
        x = img.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (hh // p) * (ww // p), -1)
        x = self.patch(self.patch_norm(x))
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], 1) + self.pos_embedding[:, :x.shape[1] + 1]
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return self.head(x[:, 0])


def test_a_vit_reading_image_patches_is_probed_with_an_image():
    """No ``example_inputs``: the first layer's 27 features are 3 x 3 x 3 patches; the image tried is sized to
    the position parameter's 16 patches (12 x 12), and the attention's laws are found."""
    m = randomize(PatchViT())
    found = detect(m, structural=True)
    assert found.families().get("qk") == 2 and found.families().get("vo") == 2, (found.families(), reasons(found))
    hold(m, found, torch.randn(2, 3, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's LayerNorm1P: the gain stored as ``w`` and applied as ``1 + w``, with a bias."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class OnePlusBlock(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.up, self.down = LayerNorm1P(d), nn.Linear(d, 12), nn.Linear(12, d)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


def test_a_layer_norm_applying_one_plus_its_weight_gets_the_shifted_gain_law():
    m = randomize(OnePlusBlock())
    x = floats(2, 5, 8)
    found = detect(m, example_inputs=x, structural=True)
    gain = law(found, "norm/gain")
    assert {t.shift for t in gain.terms if t.ref.param == "norm.weight"} == {1.0}, gain.terms
    assert set(gain.params) == {"norm.weight", "norm.bias", "up.weight"}
    hold(m, found, x)


class WholeQKNorm(nn.Module):
    """OLMo2's QK-norm: one RMSNorm over all heads' queries (and keys) before the head split."""

    def __init__(self, h=16, nh=4):
        super().__init__()
        self.nh = nh
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(h, eps=1e-6), nn.RMSNorm(h, eps=1e-6)

    def forward(self, x):
        b, t, h = x.shape
        q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
        q, k, v = (z.view(b, t, self.nh, -1).transpose(1, 2) for z in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, h))


def test_q_and_k_projections_behind_a_whole_width_qk_norm_are_declined_not_undetected():
    m = randomize(WholeQKNorm())
    x = floats(2, 5, 16)
    found = detect(m, example_inputs=x, structural=True)
    assert found.undetected == [] and "QK-norm" in reasons(found)["q/qk"], (found.undetected, reasons(found))
    assert found.families() == {"qk_norm_gain": 4, "vo": 4}
    hold(m, found, x)


class SeqFFNBlock(nn.Module):
    """An ``nn.Sequential`` GELU MLP (the torch.nn detector's) beside attention in custom code (the structural
    detector's): both see the MLP."""

    def __init__(self, d=16):
        super().__init__()
        self.attn = TLAttention(d, mode="einsum")
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(d, 32), nn.GELU()), nn.Dropout(0.0), nn.Linear(32, d))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


def test_a_block_two_detectors_decline_is_listed_once():
    """Once per module and block kind, with the first detector's reason."""
    found = detect(randomize(SeqFFNBlock()), example_inputs=tl_input())
    keys = [(d.module, d.block) for d in found.declined]
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    assert any(d.module.startswith("ff.") for d in found.declined)


class DataDependentSlice(nn.Module):
    """A forward that slices by a count read off the input: neither torch.fx nor torch.export can trace it, and a
    failed torch.export prints the partial graph it reached to stderr."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        n = int((x[:, 0] > 0).sum())
        h = torch.relu(self.a(x))
        return self.b(h[:n]) if n else self.b(h)


def test_a_failed_export_attempt_prints_nothing(capfd):
    found = detect(randomize(DataDependentSlice()), example_inputs=floats(4, 8), structural=True)
    assert "torch.export" in reasons(found)["<forward>"]
    err = capfd.readouterr().err
    assert "def forward" not in err, err[:500]


class MHABlock(nn.Module):
    """open_clip / torchvision ViT residual block: ``nn.MultiheadAttention`` called from custom forward code."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x):
        h = self.ln_1(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


def test_multihead_attention_called_from_custom_code_gets_its_head_laws_structurally():
    m = randomize(MHABlock())
    x = floats(2, 5, 16)
    found = detect(m, example_inputs=x, structural=True)
    assert found.families().get("qk") == 4 and found.families().get("vo") == 4, (found.families(), reasons(found))
    assert found.families() == detect(m, example_inputs=x).families()
    hold(m, found, x)


def test_keyword_inputs_given_as_example_inputs_name_forward_kwargs():
    from conserve.errors import UsageError

    with pytest.raises(UsageError, match=r"forward_kwargs=\{\.\.\.\}"):
        detect(randomize(MHABlock()), example_inputs={"x": floats(2, 5, 16)})


def test_use_cache_bound_positionally_by_a_recorded_call_is_not_added_again():
    """A block's recorded call (Qwen2-VL's inner model: ``use_cache`` passed on by the outer forward) binds
    ``use_cache`` positionally once replayed: adding it as a keyword gave "multiple values for argument"."""
    from conserve.detection.probe import no_cache

    class Inner(nn.Module):
        def forward(self, x, use_cache=None, **kwargs):
            return x

    assert no_cache(Inner(), {}) == {"use_cache": False}
    assert no_cache(Inner(), {}, (floats(2, 3), True)) == {}
    assert no_cache(Inner(), {}, (floats(2, 3),)) == {"use_cache": False}
