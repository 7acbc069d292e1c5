"""The gain law of the norm in front of an MoE block: readers = the router and every expert's gate and up (shared
experts too). A Mixtral-style expert loop that depends on the routing (``torch.where``, ``if tok.numel()``) cannot
be traced: it is an opaque call in the model's graph, analysed on its own graph specialised to the example input's
routing (``conserve.detection.blocks``), which says what reads its input (``match.gain.input_readers``). A dense MoE
(every expert on every token, weighted by a softmax top-k mask) is traced as it is. Hidden sizes are not powers of
two. Every claimed law is checked again on the ORIGINAL model in float64 (``test_detect_graph.hold``); laws missing a
reader are shown to fail the check (``fail``, and ``check_laws`` on the graph holding the opaque call).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conserve.detection import detect
from conserve.detection.builders import gain_law, in_cols
from conserve.detection.check import check_laws
from conserve.detection.fxgraph import Graph
from conserve.detection.probe import make_probe
from conserve.detection.trace import trace
from conserve.laws.tolerance import TOL
from test_detect_graph import fail, hold, ids, law, reasons
from test_detect_robust import Attention, GroupedMoE, RMSNorm, SwiGLU
from test_detect_torch import randomize

H, I, VOCAB = 12, 10, 23  # hidden, expert width, vocabulary: not powers of two


class RoutedMoE(nn.Module):
    """Mixtral's eager expert loop (which experts run, on which tokens, depends on the routing). ``shared``: a
    shared expert run on every token beside the loop (Qwen2-MoE); ``extra``: the input also read non-linearly
    (``x * x.sum(-1)``) and added to the output."""

    def __init__(self, h=H, i=I, experts=4, top_k=2, shared=False, extra=False):
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(experts)])
        self.shared_expert = SwiGLU(h, i) if shared else None
        self.top_k, self.extra = top_k, extra

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
        if self.shared_expert is not None:
            out = out + self.shared_expert(z)
        if self.extra:
            out = out + z * z.sum(-1, keepdim=True)
        return out.reshape(b, t, h)


class NoGradTopK(RoutedMoE):
    """``RoutedMoE`` whose expert choice is made in a ``@torch.no_grad()`` method (HF DeepSeek-V3's
    ``get_topk_indices``): the weights keep their gradient, the indices never had one."""

    @torch.no_grad()
    def choose(self, probs):
        return torch.topk(probs, self.top_k, dim=-1)[1]

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        probs = F.softmax(self.router(z), dim=-1)
        idx = self.choose(probs)
        w = probs.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(z)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out = out.index_add(0, tok, expert(z[tok]) * w[tok, slot, None])
        return out.reshape(b, t, h)


class SplitTokens(nn.Module):
    """The tokens split in two groups (``split`` along the token dim: a tuple of tensors on the way from the norm to
    the two maps reading it), each group through its own SwiGLU."""

    def __init__(self):
        super().__init__()
        self.first, self.rest = SwiGLU(H, I), SwiGLU(H, I)

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        head, tail = z.split([1, z.shape[0] - 1])
        return torch.cat([self.first(head), self.rest(tail)]).reshape(b, t, h)


class CapacityMoE(RoutedMoE):
    """Switch-style top-1 routing with an expert capacity of 70% of the tokens: a token over it skips the experts
    and keeps its (normed) input, which then reaches the output not through a stored weight. Random routings over
    4 experts stay under it; a run of one repeated token does not."""

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        probs = F.softmax(self.router(z), dim=-1)
        p, e = probs.max(-1)
        onehot = F.one_hot(e, len(self.experts))
        keep = (torch.cumsum(onehot, 0) * onehot).sum(-1) <= int(0.7 * z.shape[0]) + 1
        out = torch.zeros_like(z)
        for i, expert in enumerate(self.experts):
            tok = torch.where((e == i) & keep)[0]
            if tok.numel():
                out = out.index_add(0, tok, expert(z[tok]))
        tok = torch.where(~keep)[0]
        if tok.numel():
            out = out.index_add(0, tok, z[tok])
        return (p[:, None] * out).reshape(b, t, h)


class ExpertHitMoE(RoutedMoE):
    """transformers' Mixtral loop: the experts hit found with ``nonzero()`` and each taken by indexing the
    ``ModuleList`` with a tensor (``self.experts[expert_idx]``)."""

    def forward(self, x):
        b, t, h = x.shape
        z = x.reshape(-1, h)
        w, idx = torch.topk(F.softmax(self.router(z), dim=-1), self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        mask = F.one_hot(idx, len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(z)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, tok = torch.where(mask[e].squeeze(0))
            out = out.index_add(0, tok, self.experts[e](z[tok]) * w[tok, slot, None])
        return out.reshape(b, t, h)


class DenseMoE(nn.Module):
    """Every expert on every token, weighted by the softmax top-k mask (zero for the experts not chosen): traceable."""

    def __init__(self, h=H, i=I, experts=3, top_k=2):
        super().__init__()
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList([SwiGLU(h, i) for _ in range(experts)])
        self.top_k = top_k

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        mask = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + mask[..., e:e + 1] * expert(x)
        return out


class ShapeCheckedMoE(DenseMoE):
    """``DenseMoE`` behind a branch on the input's rank: torch.fx cannot trace it (a Proxy in ``if``), torch.export
    can (static shapes)."""

    def forward(self, x):
        if x.dim() == 3:
            return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        return super().forward(x)


FFNS = {"swiglu": lambda: SwiGLU(H, 18), "checked": lambda: ShapeCheckedMoE(), "loop": lambda: RoutedMoE(), "loop_shared": lambda: RoutedMoE(shared=True),
        "loop_extra": lambda: RoutedMoE(extra=True), "nograd": lambda: NoGradTopK(), "split": lambda: SplitTokens(), "capacity": lambda: CapacityMoE(), "hit": lambda: ExpertHitMoE(), "dense": lambda: DenseMoE(), "grouped": lambda: GroupedMoE(H)}


class Layer(nn.Module):
    """Pre-norm layer; ``shared``: a shared expert outside the MoE block, read from the same normed value."""

    def __init__(self, ffn="swiglu", shared=False):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(H), Attention(H, nh=4)
        self.ffn_norm, self.ffn = RMSNorm(H), FFNS[ffn]()
        self.shared = SwiGLU(H, I) if shared else None

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        y = self.ffn(h)
        return x + (y if self.shared is None else y + self.shared(h))


class Decoder(nn.Module):
    def __init__(self, ffns=("swiglu", "loop", "swiglu"), shared=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList([Layer(f, shared and f != "swiglu") for f in ffns])
        self.norm, self.output = RMSNorm(H), nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def moe_readers(prefix, experts, shared=None):
    """Reader weights of the MoE gain: the router, every expert's gate and up, the shared expert's gate and up."""
    mods = [f"{prefix}.router"] + [f"{prefix}.experts.{e}.{p}" for e in range(experts) for p in ("gate", "up")]
    mods += [f"{shared}.{p}" for p in ("gate", "up")] if shared else []
    return {m + ".weight" for m in mods}


def readers_of(gain):
    """{parameter: columns read} of a gain law's reader terms."""
    return {t.ref.param: t.ref.rows for t in gain.terms if not t.ref.param.endswith("norm.weight")}


def found_laws(ffns, shared=False, x=None):
    m = randomize(Decoder(ffns, shared=shared))
    return m, detect(m, loss="ce", **({} if x is None else {"example_inputs": x}))


# ------------------------------------------------------------------------------------- the routed loop
def test_routed_loop_gain_reads_the_router_and_every_expert():
    m, found = found_laws(("swiglu", "loop", "swiglu"))
    why = reasons(found)
    assert "torch.fx cannot trace" in why["layers.1.ffn"], why["layers.1.ffn"]
    gain = law(found, "layers.1.ffn_norm/gain")
    # every expert's gate and up and the router, each read on all H columns; no down projection
    assert readers_of(gain) == {p: H for p in moe_readers("layers.1.ffn", 4)}, readers_of(gain)
    assert "layers.1.ffn_norm" not in why and found.undetected == []
    assert not any(k.startswith("layers.1.ffn.experts.") for k in why), why  # each gate is read by the gain law
    fam = found.families()
    assert fam["gain"] == 7 and fam["swiglu"] == 2 + 4 and fam["router_sum"] == 1, fam
    x = ids(vocab=VOCAB)
    hold(m, found, x)
    # the law with one expert's up (or gate) left out fails the check on the model itself ...
    full = [t.ref for t in gain.terms if not t.ref.param.endswith("norm.weight")]
    no_up, no_gate = (gain_law(name, 1, "layers.1.ffn_norm.weight", H, readers=[r for r in full if r.param != p])
                      for name, p in (("no expert 3 up", "layers.1.ffn.experts.3.up.weight"),
                                      ("no expert 0 gate", "layers.1.ffn.experts.0.gate.weight")))
    assert len(no_up.params) == len(no_gate.params) == len(gain.params) - 1
    fail(m, {"no expert 3 up": no_up, "no expert 0 gate": no_gate}, x)
    # ... and on the graph detection checks it on: the MoE block one opaque call running its own code, whose
    # expert weights (parameters of the call's module) the check differentiates through
    probe = make_probe(m, 3e8)
    gm, how = trace(probe, (x,), {}, leaves={"layers.1.ffn"})
    assert how == "torch.fx" and any(n.op == "call_module" and n.target == "layers.1.ffn" for n in gm.graph.nodes)
    g = Graph(gm, (x,), dict(probe.named_parameters(remove_duplicate=False)))
    viol = check_laws(g, [gain, no_up, no_gate], {})  # (the probe's random weights: violations far above TOL)
    assert viol[gain.name] <= TOL and viol["no expert 3 up"] > 1e5 * TOL and viol["no expert 0 gate"] > 1e5 * TOL, viol


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_routed_loop_with_a_shared_expert(where):
    ffns = ("loop_shared",) if where == "inside" else ("loop",)
    m, found = found_laws(ffns, shared=where == "outside")
    gain = law(found, "layers.0.ffn_norm/gain")
    shared = "layers.0.ffn.shared_expert" if where == "inside" else "layers.0.shared"
    assert readers_of(gain) == {p: H for p in moe_readers("layers.0.ffn", 4, shared)}, readers_of(gain)
    assert found.undetected == []
    hold(m, found, ids(vocab=VOCAB))


def test_expert_no_token_is_routed_to_declines_the_gain_by_name():
    # one token, top-2 of 4 experts: two experts get no token of the probe input, their columns are unknown
    x = ids(vocab=VOCAB, t=1)[:1]
    m, found = found_laws(("swiglu", "loop"), x=x)
    assert "layers.1.ffn_norm/gain" not in {g.name for g in found.laws}
    why = reasons(found)["layers.1.ffn_norm"]
    unreached = re.findall(r"'(experts\.\d)'", why)
    assert len(unreached) == 2 and "no token is routed to" in why and "example_inputs" in why, why
    assert "layers.0.ffn_norm/gain" in {g.name for g in found.laws}
    hold(m, found, x)


def test_input_also_read_non_linearly_inside_the_block_declines_the_gain():
    m, found = found_laws(("swiglu", "loop_extra"))
    assert "layers.1.ffn_norm/gain" not in {g.name for g in found.laws}
    why = reasons(found)["layers.1.ffn_norm"]
    assert "opaque block 'layers.1.ffn'" in why and "not only by linear maps" in why and "'mul'" in why, why
    hold(m, found, ids(vocab=VOCAB))
    # the law with the block's linear readers alone: the non-linear reader breaks it
    readers = [in_cols(p, (4, H) if p.endswith("router.weight") else (I, H))
               for p in sorted(moe_readers("layers.1.ffn", 4))]
    fail(m, {"linear readers only": gain_law("g", 1, "layers.1.ffn_norm.weight", H, readers=readers)},
         ids(vocab=VOCAB))


def test_stand_in_block_keeps_declining_the_gain():
    m = randomize(Decoder(("swiglu", "grouped"))).float()  # torch._grouped_mm: no float64 kernel
    found = detect(m, loss="ce")
    assert "layers.1.ffn_norm/gain" not in {g.name for g in found.laws}
    assert "stand-in" in reasons(found)["layers.1.ffn_norm"], reasons(found)["layers.1.ffn_norm"]


# ------------------------------------------------------------------------------------------ dense MoE
def test_dense_moe_gain_reads_the_router_and_every_expert():
    m, found = found_laws(("dense", "swiglu"))
    gain = law(found, "layers.0.ffn_norm/gain")
    assert readers_of(gain) == {p: H for p in moe_readers("layers.0.ffn", 3)}, readers_of(gain)
    assert found.undetected == []
    x = ids(vocab=VOCAB)
    hold(m, found, x)
    short = [t.ref for t in gain.terms if not t.ref.param.endswith(("norm.weight", "experts.1.gate.weight"))]
    fail(m, {"no expert 1 gate": gain_law("g", 0, "layers.0.ffn_norm.weight", H, readers=short)}, x)


def test_block_torch_export_traces_alone_gives_its_readers():
    """The model cannot be exported whole (the routed loop of layer 1), so torch.fx makes both MoE blocks opaque;
    layer 0's block alone is traced by torch.export (not specialised): its readers are recorded all the same and
    the gain in front of it is claimed."""
    m, found = found_laws(("checked", "loop"))
    gain = law(found, "layers.0.ffn_norm/gain")
    assert readers_of(gain) == {p: H for p in moe_readers("layers.0.ffn", 3)}, readers_of(gain)
    assert readers_of(law(found, "layers.1.ffn_norm/gain")) == {p: H for p in moe_readers("layers.1.ffn", 4)}
    hold(m, found, ids(vocab=VOCAB))


def test_no_grad_region_in_the_block_leaves_grad_mode_and_the_laws_alone():
    """A ``torch.no_grad()`` method inside the routed block: detection gives the same laws as without it and
    leaves grad mode as it found it (a partial run of a graph that switches it off never leaks)."""
    assert torch.is_grad_enabled()
    m, found = found_laws(("swiglu", "nograd", "swiglu"))
    assert torch.is_grad_enabled()
    _, plain = found_laws(("swiglu", "loop", "swiglu"))
    assert found.families() == plain.families() and found.families()["swiglu"] == 6, found.families()
    gain = law(found, "layers.1.ffn_norm/gain")
    assert readers_of(gain) == {p: H for p in moe_readers("layers.1.ffn", 4)}
    hold(m, found, ids(vocab=VOCAB))
    with torch.no_grad():  # detection under a caller's no_grad: the same laws, and the caller's mode kept
        _, again = found_laws(("swiglu", "nograd", "swiglu"))
        assert not torch.is_grad_enabled()
    assert sorted(x.name for x in again.laws) == sorted(x.name for x in found.laws)


def test_a_tuple_on_the_way_to_the_readers_is_no_error():
    """A ``split`` into a tuple of tensors between the norm and the maps reading it: the gain law with both maps'
    gate and up as readers, no structural analysis error, every claimed law holding."""
    m, found = found_laws(("swiglu", "split"))
    assert not [x for x in found.declined if "error" in x.reason], reasons(found)
    gain = law(found, "layers.1.ffn_norm/gain")
    assert set(readers_of(gain)) == {f"layers.1.ffn.{s}.{p}.weight" for s in ("first", "rest") for p in ("gate", "up")}
    hold(m, found, ids(vocab=VOCAB))


def test_a_read_only_a_repeated_token_routing_shows_declines_the_gain():
    """Tokens over an expert's capacity pass through: a non-linear read that no random routing shows. The
    recheck on inputs whose tokens are all one token finds it: the gain is declined saying so, the experts'
    unit laws still hold on the original model."""
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))  # top-1: reach every expert
    m, found = found_laws(("swiglu", "capacity"), x=x)
    assert "layers.1.ffn_norm/gain" not in {x.name for x in found.laws}
    assert "another input's routing" in reasons(found)["layers.1.ffn_norm"], reasons(found)["layers.1.ffn_norm"]
    assert found.families()["swiglu"] == 1 + 4
    hold(m, found, ids(vocab=VOCAB))
    hold(m, found, torch.full((2, 9), 3))  # every token alike: drops


def test_experts_taken_by_a_tensor_index():
    """``self.experts[expert_idx]`` with a tensor index (transformers' Mixtral): specialised all the same, the gain
    reads the router and every expert."""
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    m, found = found_laws(("swiglu", "hit"), x=x)
    gain = law(found, "layers.1.ffn_norm/gain")
    assert readers_of(gain) == {p: H for p in moe_readers("layers.1.ffn", 4)}, readers_of(gain)
    assert found.families()["swiglu"] == 1 + 4
    hold(m, found, ids(vocab=VOCAB))


# ------------------------------------------------------------------------- the readers on other routings
class Branchy(RoutedMoE):
    """The routed loop, plus a non-linear read of the input on a branch taken when ``mode`` holds a 0 (a branch on
    a size: ``specialised`` follows it). The example input's mode (1) does not take it; the other inputs ``blocks``
    re-checks on draw their mode from {0, 1}."""

    def forward(self, x, mode):
        out = super().forward(x)
        return out + x * x.sum(-1, keepdim=True) if torch.where(mode == 0)[0].numel() else out


@pytest.mark.parametrize("cls", [RoutedMoE, Branchy])
def test_block_readers_are_found_again_on_other_routings(cls):
    from conserve.detection.graph import detect_graph

    block = randomize(cls())
    x = 3 * torch.randn(1, 16, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    inputs = (x,) if cls is RoutedMoE else (x, torch.ones(1, dtype=torch.long))
    d = detect_graph(block, inputs, _depth=1)  # a block analysed alone (as ``blocks`` does): specialised, rechecked
    got = d.input_readers[("", 0)]
    if cls is RoutedMoE:
        assert {r.param: r.rows for r in got} == {p[len("layers.1.ffn."):]: H for p in moe_readers("layers.1.ffn", 4)}
    else:  # the example input's graph shows only linear readers; another input's graph (mode 0) the product
        assert isinstance(got, str) and "on another input's routing" in got and "'mul'" in got, got
