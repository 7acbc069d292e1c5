"""Multi-head latent attention (DeepSeek-V2/V3 MLA; ``docs/laws.md``, "Multi-head latent attention").

* ``conserve.discover`` on a tiny plain-torch MLA block (HF ``DeepseekV3Attention``'s names and math, eps = 0
  norms) finds exactly the laws the detector builds (``conserve.detection.hf.mla.mla_laws``): the same span, all
  of the block's laws by ``conserve.count``;
* HF DeepSeek-V3 (and V2) detection: every law passes the float64 first-order check on the model's own code,
  planted wrong readings (the other RoPE pairing, a QK Gram over the rotary dims, a per-head RoPE law, a kv gain
  law without the value rows) fail it, the latent scale laws follow the norms' eps;
* structural detection (``conserve.detect`` on plain-torch blocks, no HF config; ``conserve.detection.match.mla``):
  the same laws as ``mla_laws`` on the plain block (softmax or SDPA, both RoPE layouts), the laws of a block with
  other names and code style read from its rows, each claimed law passing the float64 first-order check alone,
  wrong readings failing it, and a block whose q and shared key pair different dims declined by itself.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conserve
from conserve.detection import Collector, detect
from conserve.detection.hf.mla import mla_laws
from conserve.kernels import evaluate_reference
from conserve.laws import GainBalance, QKGram, RopePairs, compile_laws, rows

try:  # the HF tests need transformers; the plain-torch block does not
    import transformers as T
    from test_detect_hf import TINY, build, check, logits_model, randomize
except ImportError:  # pragma: no cover - environment dependent
    T = None
needs_hf = pytest.mark.skipif(T is None, reason="transformers not installed")

A = "model.layers.0.self_attn"
WRONG = 1e-6


# ----------------------------------------------------------------------------------- a plain MLA block
class RMSNorm(nn.Module):
    def __init__(self, n, eps=0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def rotate(x, interleaved: bool):
    """RoPE on the last dim: pairs {2p, 2p+1} (interleaved, DeepSeek) or {p, p + R/2}."""
    t, half = x.shape[-2], x.shape[-1] // 2
    ang = torch.arange(t, dtype=x.dtype)[:, None] / 10000 ** (torch.arange(half, dtype=x.dtype) / half)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


class MLA(nn.Module):
    """DeepSeek MLA with HF's attribute names: q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa (latent +
    shared rotary key) -> kv_a_layernorm -> kv_b_proj (per head [k_nope | v]); o_proj. Causal softmax attention."""

    def __init__(self, hidden=4, heads=2, q_lora_rank=2, kv_lora_rank=2, nope=1, rope=4, v=1, eps=0.0,
                 interleaved=True):
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = heads, nope, rope, v
        self.q_lora_rank, self.kv_lora_rank, self.interleaved = q_lora_rank, kv_lora_rank, interleaved
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope + v), bias=False)
        self.o_proj = nn.Linear(heads * v, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h, dn, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, h, -1).transpose(1, 2)
        q_pass, q_rot = q.split([dn, dr], -1)
        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(b, t, h, -1).transpose(1, 2)
        k_pass, v = kv.split([dn, self.v_head_dim], -1)
        k_rot = rotate(k_rot[:, None], self.interleaved).expand(-1, h, -1, -1)
        q = torch.cat([q_pass, rotate(q_rot, self.interleaved)], -1)
        k = torch.cat([k_pass, k_rot], -1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(dn + dr)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class Holder(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = MLA(**kw)

    def forward(self, x):
        return self.attn(x)


def detector_laws(block: Holder, interleaved=True):
    """The laws ``mla_laws`` (the HF detector's MLA part) builds for the plain block."""
    c = Collector(block, {"rope_layout": "interleaved" if interleaved else "half"})
    mla_laws(c, "attn", block.attn, 0, SimpleNamespace(num_attention_heads=block.attn.num_heads))
    return c.laws, c.declined


def law_jacobian(laws, params: dict) -> torch.Tensor:
    """Rows: the gradients of every scalar component of ``laws`` (upper triangles of Gram laws) at ``params``."""
    names = list(params)
    out = []
    for law in laws:
        c = compile_laws([law], {k: tuple(v.shape) for k, v in params.items()})
        vec, grams = evaluate_reference(c.plan, [params[n] for n in c.names], fp64=True)
        h = c.split(vec, grams)[0]
        comps = h[torch.triu_indices(*h.shape).unbind()] if h.dim() == 2 else h.reshape(-1)
        for x in comps:
            g = torch.autograd.grad(x, [params[n] for n in names], retain_graph=True, allow_unused=True)
            out.append(torch.cat([(t if t is not None else torch.zeros_like(params[n])).reshape(-1)
                                  for t, n in zip(g, names)]))
    return torch.stack(out)


def rank(m: torch.Tensor) -> int:
    s = torch.linalg.svdvals(m)
    return int((s > 1e-9 * s[0]).sum())


# ------------------------------------------------------------------------------------------------ tests
def test_discover_finds_exactly_the_detector_laws():
    torch.manual_seed(0)
    block = Holder(nope=2, v=2).double()  # 2 x 2 head Grams (1 x 1 ones read as balances)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    found = conserve.discover(block, x, seed=0, pairs="within", ansatz="structured")
    # 2 heads x (3 QK + 3 VO) + 2 rotary pairs + 2 + 2 gains + 2 scale laws, and nothing else (conserve.count)
    assert found.complete and found.independent == 20, found.markdown()
    kinds = sorted(d.match for d in found.laws)
    assert kinds == sorted(["head Gram"] * 2 + ["deep linear / VO Gram"] * 2 + ["gain balance"] * 4
                           + ["rotary pair"] * 2 + ["new"] * 2), kinds
    assert all(d.ok for d in found.laws)
    laws, declined = detector_laws(block)
    assert declined == [] and {x.family for x in laws} == {"qk", "vo", "rope_pair", "gain", "norm_scale"}
    for law in laws:
        assert conserve.verify(block, [law], x)[0].ok, law.name
    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(v.shape, generator=g, dtype=torch.float64).requires_grad_(True)
              for k, v in block.named_parameters()}
    mine, theirs = law_jacobian(laws, params), law_jacobian(found.tracked_laws(), params)
    assert rank(mine) == rank(theirs) == rank(torch.cat([mine, theirs])) == 20  # the same law space


def test_rope_pairs_are_summed_over_all_heads_and_follow_the_layout():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    for interleaved in (True, False):
        block = Holder(interleaved=interleaved).double()
        laws, _ = detector_laws(block, interleaved)
        rope = next(x for x in laws if x.family == "rope_pair")
        assert rope.size == 2 and len({t.ref.param for t in rope.terms}) == 2
        assert conserve.verify(block, [rope], x)[0].ok
        other, _ = detector_laws(block, not interleaved)
        assert conserve.verify(block, [next(x for x in other if x.family == "rope_pair")], x)[0].first_order > WRONG
    # per head (head 0's rotary rows alone against the shared key rows): wrong, the key is shared by all heads
    block = Holder().double()
    q = [("attn.q_b_proj.weight", (6 * 2, 2), None, [1 + t for t in range(4)], False)]
    k = [("attn.kv_a_proj_with_mqa.weight", (6, 4), None, [2 + t for t in range(4)], False)]
    from conserve.detection import builders

    per_head = builders.rope_pair_law("bad", 0, q=q, k=k, pairs=builders.rope_pairs(4, "interleaved"))
    assert conserve.verify(block, [per_head], x)[0].first_order > WRONG


@pytest.fixture(scope="module")
def v3():
    m = logits_model(build("deepseek_v3", qk_rope_head_dim=4))
    return m, detect(m)


@needs_hf
def test_hf_deepseek_v3_laws_hold(v3):
    m, d = v3
    assert d.detector == "hf" and d.undetected == []
    assert d.families() == {"qk": 4, "vo": 4, "rope_pair": 1, "gain": 5, "swiglu": 5, "translation": 1}
    names = {x.name for x in d.laws}
    assert {f"{A}/qk/head0", f"{A}/vo/head3", f"{A}/rope", f"{A}.q_a_layernorm/gain", f"{A}.kv_a_layernorm/gain",
            "model.layers.0.input_layernorm/gain"} <= names
    worst = {x.name: check(m, x) for x in d.laws}
    assert max(worst.values()) <= 1e-10, {k: v for k, v in worst.items() if v > 1e-10}
    reasons = {x.module: x.reason for x in d.declined}
    assert "eps=1e-06" in reasons[f"{A}.q_a_proj/norm_scale"] and "approximate=True" in reasons[f"{A}.q_a_proj/norm_scale"]


@needs_hf
def test_hf_deepseek_v3_planted_wrong_laws_fail(v3):
    m, d = v3
    law = {x.name: x for x in d.laws}
    nh, dn, dr, dv, rq, rkv, h = 4, 4, 4, 4, 8, 6, 16
    qd = dn + dr
    bad = [
        law_of(detect(m, rope_layout="half"), f"{A}/rope"),  # the other pairing
        # a QK Gram over the whole head (no-RoPE and rotary dims), as for an attention without RoPE
        QKGram.build("bad", 0, plus=[rows(f"{A}.q_b_proj.weight", (nh * qd, rq), 0, qd)],
                     minus=[rows(f"{A}.kv_b_proj.weight", (nh * (dn + dv), rkv), 0, qd)]),
    ]
    gain = law[f"{A}.kv_a_layernorm/gain"]
    # the kv latent gain read by head 0's key rows of kv_b_proj only (every key and value row reads it)
    bad.append(GainBalance(gain.name, 0, [gain.terms[0]] + [
        type(gain.terms[1])("norm", type(gain.terms[1].ref)(f"{A}.kv_b_proj.weight", (0, 0), 1, rkv, 0, dn), -1.0)],
        rkv))
    bad.append(RopePairs.build("bad", 0, q_weight=f"{A}.q_b_proj.weight", q_shape=(nh * qd, rq), q_starts=[dn],
                               k_weight=f"{A}.kv_a_proj_with_mqa.weight", k_shape=(rkv + dr, h), k_starts=[rkv],
                               rotary_dim=dr, layout="interleaved"))  # head 0 only
    for x in bad:
        assert check(m, x) > WRONG, x


def law_of(d, name):
    return next(x for x in d.laws if x.name == name)


@needs_hf
def test_hf_latent_scale_laws_follow_eps():
    m = logits_model(build("deepseek_v3"))
    attn = m.model.layers[0].self_attn
    assert "norm_scale" not in detect(m).families()
    approx = [x for x in detect(m, approximate=True).laws if x.family == "norm_scale"]
    assert len(approx) == 2 and all("approximate" in x.note for x in approx)
    assert 1e-13 < max(check(m, x) for x in approx) < 1e-4  # really approximate: the check sees eps = 1e-6
    attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = 0.0
    exact = [x for x in detect(m).laws if x.family == "norm_scale"]
    assert {x.name for x in exact} == {f"{A}.q_a_proj/norm_scale", f"{A}.kv_a_proj_with_mqa/norm_scale"}
    for x in exact:
        assert check(m, x) <= 1e-10, x.name


@needs_hf
def test_hf_variants_and_meta_device():
    """q_lora_rank=None (q_proj), attention biases, DeepSeek-V2 (complex RoPE, softmax router), and detection from
    shapes only (meta device) giving the same laws."""
    for over in ({"q_lora_rank": None}, {"attention_bias": True}):
        m = logits_model(build("deepseek_v3", **over))
        d = detect(m)
        assert d.undetected == [] and d.families()["qk"] == 4 and d.families()["rope_pair"] == 1, (over, d.families())
        assert max(check(m, x) for x in d.laws) <= 1e-10, over
    with torch.device("meta"):
        meta = build("deepseek_v3", qk_rope_head_dim=4)
    real = detect(logits_model(build("deepseek_v3", qk_rope_head_dim=4)))
    assert detect(meta).laws == real.laws
    if not hasattr(T, "DeepseekV2Config"):
        return
    cfg = T.DeepseekV2Config(**TINY, num_key_value_heads=4, moe_intermediate_size=6, n_routed_experts=4,
                             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=8,
                             kv_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_shared_experts=1)
    torch.manual_seed(0)
    m = logits_model(randomize(T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                                  experts_implementation="eager").eval()))
    d = detect(m)
    assert d.detector == "hf" and d.undetected == []
    assert {"qk", "vo", "rope_pair", "gain", "swiglu", "router_sum"} <= set(d.families())
    assert max(check(m, x) for x in d.laws) <= 1e-10


# --------------------------------------------------------------- structural detection of a plain-torch MLA
# ``conserve.detect`` on a model with no HF config: the graph detector's MLA finder (``match.mla``) reads the block
# by its algebra. Two blocks: ``Holder`` (HF's names and math) and ``LatentAttention`` (other names and code style).
class LatentAttention(nn.Module):
    """MLA written another way: q without low rank (``to_q``, with bias; per head [rotary | no-RoPE] dims), the
    latent projection ``down`` with the rotary key rows FIRST then ``latent`` rows (``torch.tensor_split``), the
    latent normalised by ``F.normalize`` times a gain, ``up`` giving per head [v | k_nope] (``torch.chunk``), RoPE
    on the rotary part (half-split ``{p, p+R/2}`` by default; ``k_order`` reorders the rotated key's dims, so that
    q and k pair different dims), the shared rotary key broadcast to every head (``broadcast_to``), einsum scores
    and output. ``latent_norm``: 'normalize' (``F.normalize`` times ``latent_gain``), 'layernorm' (an
    ``nn.LayerNorm``, a leaf of the trace), 'centered' (a LayerNorm written out, gain and bias parameters)."""

    def __init__(self, width=6, n_heads=3, latent=5, d_nope=3, d_rot=4, d_v=3, interleaved=False,
                 k_order=None, latent_norm="normalize"):
        super().__init__()
        self.n_heads, self.d_nope, self.d_rot = n_heads, d_nope, d_rot
        self.interleaved = interleaved
        self.k_order = list(range(d_rot)) if k_order is None else list(k_order)
        self.to_q = nn.Linear(width, n_heads * (d_rot + d_nope))
        self.down = nn.Linear(width, d_rot + latent, bias=False)
        self.latent_norm = latent_norm
        self.latent_gain = nn.Parameter(torch.ones(latent))
        if latent_norm == "layernorm":
            self.ln = nn.LayerNorm(latent, eps=0.0)
        elif latent_norm == "centered":
            self.latent_bias = nn.Parameter(torch.zeros(latent))
        self.up = nn.Linear(latent, n_heads * (d_v + d_nope), bias=False)
        self.out = nn.Linear(n_heads * d_v, width)
        assert d_v == d_nope, "torch.chunk splits [v | k_nope] in two equal halves"

    def forward(self, h):
        bsz, t, _ = h.shape
        nh, r = self.n_heads, self.d_rot
        q = self.to_q(h).reshape(bsz, t, nh, -1).permute(0, 2, 1, 3)  # (B, H, T, R + nope)
        q = torch.cat([rotate(q[..., :r], self.interleaved), q[..., r:]], dim=-1)
        k_rot, c = torch.tensor_split(self.down(h), [r], dim=-1)
        if self.latent_norm == "layernorm":
            c = self.ln(c)
        elif self.latent_norm == "centered":
            c = c - c.mean(-1, keepdim=True)
            c = c / c.pow(2).mean(-1, keepdim=True).sqrt() * self.latent_gain + self.latent_bias
        else:
            c = F.normalize(c, dim=-1) * self.latent_gain * c.shape[-1] ** 0.5
        v, k_nope = self.up(c).unflatten(-1, (nh, -1)).transpose(1, 2).chunk(2, dim=-1)
        k_rot = torch.broadcast_to(rotate(k_rot, self.interleaved)[:, None, :, self.k_order], (bsz, nh, t, r))
        k = torch.cat([k_rot, k_nope], dim=-1)
        s = torch.einsum("bhtd,bhsd->bhts", q, k) * (q.shape[-1] ** -0.5)
        s = torch.where(torch.tril(torch.ones(t, t, dtype=torch.bool)), s, torch.finfo(s.dtype).min)
        o = torch.einsum("bhts,bhsd->bthd", s.softmax(dim=-1), v)
        return self.out(o.reshape(bsz, t, -1))


class Stack(nn.Module):
    """Two pre-norm residual ``LatentAttention`` layers and a head: the second layer's q reads the residual
    stream (a projection read elsewhere too, not a low-rank q)."""

    def __init__(self, **kw):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(6) for _ in range(2))
        self.layers = nn.ModuleList(LatentAttention(**kw) for _ in range(2))
        self.head = nn.Linear(6, 5)

    def forward(self, h):
        for norm, layer in zip(self.norms, self.layers):
            h = h + layer(norm(h))
        return self.head(h)


class SdpaMLA(MLA):
    """``MLA`` with ``F.scaled_dot_product_attention`` (as HF's default attention) instead of softmax(q k^T) v."""

    def forward(self, x):
        b, t, _ = x.shape
        h, dn, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, h, -1).transpose(1, 2)
        q_pass, q_rot = q.split([dn, dr], -1)
        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(b, t, h, -1).transpose(1, 2)
        k_pass, v = kv.split([dn, self.v_head_dim], -1)
        k = torch.cat([k_pass, rotate(k_rot[:, None], self.interleaved).expand(-1, h, -1, -1)], -1)
        q = torch.cat([q_pass, rotate(q_rot, self.interleaved)], -1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def structural(block, x):
    d = detect(block, example_inputs=x)
    assert d.detector == "graph"
    return d


def each_law_holds(block, d, x):
    """Every claimed law, one at a time, passes the float64 first-order check on the original block."""
    for law in d.laws:
        r = conserve.verify(block, [law], x)[0]
        assert r.ok and r.first_order <= 1e-10, (law.name, r.first_order)


@pytest.mark.parametrize("interleaved,sdpa", [(True, False), (False, False), (True, True)])
def test_structural_finds_the_detector_laws_on_the_plain_block(interleaved, sdpa):
    torch.manual_seed(2)
    block = Holder(nope=2, v=2, interleaved=interleaved).double()
    if sdpa:
        block.attn.__class__ = SdpaMLA
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    d = structural(block, x)
    theirs, declined = detector_laws(block, interleaved)
    assert declined == [] and len(theirs) == 9
    mine = {law.name: law for law in d.laws}
    assert sorted(mine) == sorted(law.name for law in theirs)  # HF's names: attn/qk/head0, attn/rope, ...
    for law in theirs:  # the same terms (rows, columns, signs, offsets): the same law
        assert (type(mine[law.name]), mine[law.name].terms, mine[law.name].size) == (type(law), law.terms, law.size)
    assert {x.module for x in d.declined} == {"attn.o_proj"} and d.undetected == []  # the output layer (no loss='ce')
    each_law_holds(block, d, x)


def test_structural_latent_scale_laws_follow_the_norms_eps():
    torch.manual_seed(3)
    block = Holder(eps=1e-6).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    d = structural(block, x)
    assert d.families() == {"qk": 2, "vo": 2, "rope_pair": 1, "gain": 2}
    why = {x.module: x.reason for x in d.declined}
    for name in ("attn.q_a_proj/norm_scale", "attn.kv_a_proj_with_mqa/norm_scale"):
        assert "only approximately" in why[name] and "eps > 0" in why[name], why[name]
    assert d.undetected == []
    each_law_holds(block, d, x)


def test_structural_other_names_and_style():
    """No low-rank q, rotary key rows before the latent rows, [v | k_nope] per head, half-split RoPE on dims [0, 4)
    of each head, F.normalize, broadcast_to, einsum: the laws follow the rows the graph shows."""
    torch.manual_seed(4)
    block = LatentAttention().double()
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    d = structural(block, x)
    assert d.families() == {"qk": 3, "vo": 3, "rope_pair": 1, "gain": 1, "norm_scale": 1}, d.families()
    law = {x.name: x for x in d.laws}
    qd, kvd = 4 + 3, 3 + 3
    # head 2: q rows [2*7 + 4, 2*7 + 7) (its no-RoPE dims) vs up's key rows [2*6 + 3, 2*6 + 6), with to_q's bias
    # (the blocks' modules have no common prefix: the laws are named after the query projection, as attention's)
    qk = law["to_q/qk/head2"]
    assert sorted((t.ref.param, t.ref.start, t.ref.rows, t.sign) for t in qk.terms) == sorted([
        ("to_q.weight", (2 * qd + 4, 0), 3, 1.0), ("to_q.bias", (2 * qd + 4,), 3, 1.0),
        ("up.weight", (2 * kvd + 3, 0), 3, -1.0)])
    vo = law["to_q/vo/head1"]
    assert sorted((t.ref.param, t.ref.start, t.ref.rows) for t in vo.terms) == [("out.weight", (0, 3), 3),
                                                                                ("up.weight", (kvd, 0), 3)]
    rope = law["to_q/rope"]
    assert rope.size == 2  # pairs {0, 2}, {1, 3}: entries 0, 1 read rows 0, 1 (first members) and 2, 3 of down
    k_rows = sorted((t.ref.start[0], t.ref.rows, t.offset) for t in rope.terms if t.ref.param == "down.weight")
    assert {t.ref.param for t in rope.terms} == {"to_q.weight", "to_q.bias", "down.weight"}
    assert k_rows == [(0, 2, 0), (2, 2, 0)]
    assert law["latent_gain/gain"].params == ("latent_gain", "up.weight")
    assert law["down/norm_scale"].params == ("down.weight",)
    assert [t.ref.start[0] for t in law["down/norm_scale"].terms] == [4]  # the latent rows [4, 9), not the key's
    assert d.undetected == []
    each_law_holds(block, d, x)


@pytest.mark.parametrize("norm", ["layernorm", "centered"])
def test_structural_latent_layer_norms(norm):
    """A LayerNorm on the latent: kept whole by the trace (its gain law is the gain finder's) or written out (gain
    and bias read from the graph); both give the gain law with beta and the exact scale law (eps = 0)."""
    torch.manual_seed(8)
    block = LatentAttention(latent_norm=norm).double()
    if norm == "layernorm":
        del block.latent_gain
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    d = structural(block, x)
    assert d.families() == {"qk": 3, "vo": 3, "rope_pair": 1, "gain": 1, "norm_scale": 1}, d.families()
    gain = next(x for x in d.laws if x.family == "gain")
    assert gain.params == (("ln.weight", "ln.bias") if norm == "layernorm" else ("latent_gain", "latent_bias")) \
        + ("up.weight",)
    assert [x.module for x in d.declined] == ["out"] and d.undetected == []
    each_law_holds(block, d, x)


def test_structural_stacked_layers_residual_q():
    """In a residual stack the q of layer 1 reads the residual stream, which the previous layer's output
    projection also feeds: that projection is not taken for a low-rank q (no gain / scale law of it)."""
    torch.manual_seed(5)
    block = Stack(interleaved=True).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    d = structural(block, x)
    fam = d.families()
    assert (fam["qk"], fam["vo"], fam["rope_pair"], fam["norm_scale"]) == (6, 6, 2, 2), fam
    names = {x.name for x in d.laws}
    assert {"layers.0/rope", "layers.1/rope", "layers.1/qk/head2", "layers.1.down/norm_scale",
            "layers.1.latent_gain/gain"} <= names
    assert not any("layers.0.out" in n for n in names if n.endswith(("norm_scale", "/gain")))
    assert d.undetected == []
    each_law_holds(block, d, x)


def test_structural_wrong_readings_fail_the_check():
    """The check each claimed law passed is not trivially passed: the other RoPE pairing, a QK Gram over a head's
    rotary dims (as without RoPE), one over the whole head, and a per-head RoPE law all fail it."""
    from conserve.detection import builders
    from test_detect_graph import fail

    torch.manual_seed(6)
    block = Holder(nope=2, v=2).double()  # interleaved
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    d = structural(block, x)
    half = next(x for x in detector_laws(block, interleaved=False)[0] if x.family == "rope_pair")
    assert half.terms != next(x for x in d.laws if x.family == "rope_pair").terms
    qd, rq, rkv, h = 2 + 4, 2, 2, 4
    planted = {
        "half pairs on an interleaved block": half,
        "QK Gram of head 0's rotary dims vs the shared key": QKGram.build(
            "bad", 0, plus=[rows("attn.q_b_proj.weight", (2 * qd, rq), 2, 4)],
            minus=[rows("attn.kv_a_proj_with_mqa.weight", (rkv + 4, h), rkv, 4)]),
        "QK Gram of head 1 over its whole head": QKGram.build(
            "bad", 0, plus=[rows("attn.q_b_proj.weight", (2 * qd, rq), qd, 4)],
            minus=[rows("attn.kv_b_proj.weight", (2 * 4, rkv), 4, 4)]),
        "RoPE pairs of head 0 alone": builders.rope_pair_law(
            "bad", 0, q=[("attn.q_b_proj.weight", (2 * qd, rq), None, [2 + t for t in range(4)], False)],
            k=[("attn.kv_a_proj_with_mqa.weight", (rkv + 4, h), None, [rkv + t for t in range(4)], False)],
            pairs=builders.rope_pairs(4, "interleaved")),
    }
    fail(block, planted, x)
    other = LatentAttention(interleaved=False).double()  # half-split: the interleaved pairing must fail
    xo = torch.randn(2, 6, 6, dtype=torch.float64)
    got = next(x for x in structural(other, xo).laws if x.family == "rope_pair")
    swapped = builders.rope_pair_law(
        "bad", None, q=[("to_q.weight", (21, 6), "to_q.bias", [7 * i + t for t in range(4)], False) for i in range(3)],
        k=[("down.weight", (9, 6), None, list(range(4)), False)], pairs=builders.rope_pairs(4, "interleaved"))
    right = builders.rope_pair_law(
        "good", None, q=[("to_q.weight", (21, 6), "to_q.bias", [7 * i + t for t in range(4)], False) for i in range(3)],
        k=[("down.weight", (9, 6), None, list(range(4)), False)], pairs=builders.rope_pairs(4, "half"))
    assert right.terms == got.terms
    fail(other, {"interleaved pairs on a half-split block": swapped}, xo)


def test_structural_declines_what_it_cannot_read_per_block():
    """q and the shared key paired differently (q: {0, 2}, {1, 3}; the key's rotated dims reordered: {0, 3}, {1, 2}):
    the block's QK laws are declined with what was seen (its VO and latent laws kept); the rest of the model is
    still analysed."""
    torch.manual_seed(7)
    block = Stack(interleaved=False).double()
    block.layers[1].k_order = [0, 1, 3, 2]
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    d = structural(block, x)
    names = {x.name for x in d.laws}
    assert "layers.0/rope" in names and "layers.0/qk/head0" in names
    assert not any(n.startswith(("layers.1/qk", "layers.1/rope")) for n in names)
    assert {"layers.1/vo/head0", "layers.1.latent_gain/gain", "layers.1.down/norm_scale"} <= names
    why = {x.module: x.reason for x in d.declined}
    assert "not a RoPE pairing" in why["layers.1/qk"] and "rotary key of layers.1.down" in why["layers.1/qk"], why
    assert not any(k.startswith("attention at graph node") for k in why)  # not declined again as an attention
    assert d.undetected == []
    each_law_holds(block, d, x)


# ------------------------------------------------- keys written in place (HF DeepseekV3Attention.expand_kv)
class InPlaceKeysMLA(MLA):
    """``MLA`` with its keys written in place: ``write='copy_'``: HF's ``expand_kv`` (``new_empty``, then ``copy_``
    of the no-RoPE keys and the broadcast rotary key into its slices); ``'setitem'``: the same with
    ``k[..., :d] = ...``; ``'cat'``: the no-RoPE keys concatenated with a placeholder (their first dims), the
    rotary key copied over the placeholder (a write into the output of ``cat``, which
    ``rewrite.slice_writes_to_functional`` does not take for a fresh tensor: the graph's edges show the keys made
    of the no-RoPE keys only)."""

    write = "copy_"

    def forward(self, x):
        b, t, _ = x.shape
        h, dn, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, h, -1).transpose(1, 2)
        q_pass, q_rot = q.split([dn, dr], -1)
        kv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(b, t, h, -1).transpose(1, 2)
        k_pass, v = kv.split([dn, self.v_head_dim], -1)
        k_rot = rotate(k_rot[:, None], self.interleaved).expand(-1, h, -1, -1)
        q = torch.cat([q_pass, rotate(q_rot, self.interleaved)], -1)
        if self.write == "cat":
            k = torch.cat([k_pass, k_pass[..., :1].expand(-1, -1, -1, dr)], -1)
        else:
            k = kv.new_empty(*kv.shape[:-1], dn + dr)
        if self.write == "setitem":
            k[..., :dn] = k_pass
            k[..., dn:] = k_rot
        elif self.write == "cat":
            k[..., dn:].copy_(k_rot)
        else:
            k[..., :dn].copy_(k_pass)
            k[..., dn:].copy_(k_rot)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(dn + dr)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


def in_place_block(write: str, interleaved=True) -> Holder:
    block = Holder(nope=2, v=2, interleaved=interleaved).double()
    block.attn.__class__ = InPlaceKeysMLA
    block.attn.write = write
    return block


@pytest.mark.parametrize("write,interleaved", [("copy_", True), ("copy_", False), ("setitem", True)])
def test_structural_reads_keys_written_into_a_fresh_tensor(write, interleaved):
    """Keys assembled in a fresh tensor by in-place writes (HF's ``expand_kv``) are read as the values written
    (``rewrite.slice_writes_to_functional``): the same laws, term for term, as the detector builds."""
    torch.manual_seed(2)
    block = in_place_block(write, interleaved)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    d = structural(block, x)
    theirs, _ = detector_laws(block, interleaved)
    mine = {law.name: law for law in d.laws}
    assert sorted(mine) == sorted(law.name for law in theirs)
    for law in theirs:
        assert (type(mine[law.name]), mine[law.name].terms) == (type(law), law.terms), law.name
    assert {x.module for x in d.declined} == {"attn.o_proj"} and d.undetected == []
    each_law_holds(block, d, x)


def test_structural_declines_keys_it_cannot_see_written():
    """The rotary key copied into the output of a ``cat``: the graph shows no path from kv_a_proj_with_mqa to the
    keys. The block is still recognised as an MLA by its values, its QK laws declined saying what the graph shows
    (the in-place write, not a QK-norm), its VO and latent laws read (the latent: the rows kv_b_proj reads); the
    attention finder does not decline it again."""
    torch.manual_seed(2)
    block = in_place_block("cat")
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    d = structural(block, x)
    assert {x.name for x in d.laws} == {"attn/vo/head0", "attn/vo/head1", "attn.kv_a_layernorm/gain",
                                        "attn.kv_a_proj_with_mqa/norm_scale", "attn.q_a_layernorm/gain",
                                        "attn.q_a_proj/norm_scale"}
    scale = next(x for x in d.laws if x.name == "attn.kv_a_proj_with_mqa/norm_scale")
    assert [(t.ref.start[0], t.ref.rows) for t in scale.terms] == [(0, 2)]  # the latent rows kv_b_proj reads
    why = {x.module: x.reason for x in d.declined}
    qk = why["attn/qk"]
    assert "QK-norm" not in qk and "an MLA" in qk and "attn.kv_a_proj_with_mqa" in qk and "in-place write" in qk, qk
    assert "keys computed from attn.kv_b_proj" in qk and "copy_" in qk, qk
    assert not any(k.startswith("attention at graph node") for k in why), why
    assert set(why) == {"attn/qk", "attn.o_proj"} and d.undetected == []
    each_law_holds(block, d, x)


HF_MLA = {
    "v3 interleaved": dict(rope_interleave=True),
    "v3 half-split": dict(rope_interleave=False),
    "v3 q_proj, half-split": dict(rope_interleave=False, q_lora_rank=None),
    "v2": dict(v2=True),
}


@needs_hf
@pytest.mark.parametrize("case", list(HF_MLA))
def test_structural_reads_hf_deepseek_attention(case):
    """transformers' DeepSeek-V3 (both ``rope_interleave`` settings, low-rank q or q_proj) and V2 attention read
    by structural detection: the same QK Gram, RoPE-pair, VO and gain laws (by value at random parameters) as the
    name-based detector, each passing the float64 first-order check (in detection)."""
    from test_detect_graph import fingerprint

    from conserve.detection.graph import detect_graph

    over = dict(HF_MLA[case])
    if over.pop("v2", False):
        if not hasattr(T, "DeepseekV2Config"):
            pytest.skip("no DeepSeek-V2 in this transformers")
        cfg = T.DeepseekV2Config(**TINY, num_key_value_heads=4, moe_intermediate_size=6, n_routed_experts=4,
                                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                                 q_lora_rank=8, kv_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                 n_shared_experts=1)
    else:
        cfg = T.DeepseekV3Config(**{"q_lora_rank": 8, **over}, **TINY, num_key_value_heads=4,
                                 moe_intermediate_size=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                 topk_group=1, first_k_dense_replace=0, kv_lora_rank=6, qk_rope_head_dim=4,
                                 qk_nope_head_dim=4, v_head_dim=4)
    torch.manual_seed(0)
    m = randomize(T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                     experts_implementation="eager").eval())
    named, found = detect(m), detect_graph(m, loss="ce")
    fam = {"qk", "rope_pair", "vo", "gain"}
    assert {k: v for k, v in found.families().items() if k in fam} == \
        {k: v for k, v in named.families().items() if k in fam}
    assert found.families()["qk"] == 4 and found.families()["rope_pair"] == 1
    params = {k: v.detach().double() for k, v in m.named_parameters(remove_duplicate=False)}
    assert fingerprint([x for x in found.laws if x.family in fam], params) == \
        fingerprint([x for x in named.laws if x.family in fam], params)
    assert not any("/qk" in x.module for x in found.declined), [(x.module, x.reason) for x in found.declined]
