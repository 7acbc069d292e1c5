"""``conserve.discover``: the catalogue reproduced numerically on toy blocks, and laws NOT in the catalogue.

Every block is tiny (seconds on 2 cores) and float64. For each block the discovered law set is compared
exactly with the catalogue (spec ``shared/spec/laws.md``): the family (``match``), the fibers and the
coefficients of every law, the first-order check (spec check 1) and the completeness against
``conserve.count`` (spec check 4). Laws are then tracked (``conserve.track``) and re-checked with
``conserve.analysis.verify.first_order`` (an independent path), and corrupted laws must fail it.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conserve
from conserve.analysis.discover import BlockTooLarge, Discovery
from conserve.toyblocks import FFN, MoE, Attention, SwiGLU
from conserve.analysis.verify import first_order as verify_first_order


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _make(cls, *args, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(*args, **kw).double()


def _by_match(res: Discovery) -> dict[str, list]:
    out: dict[str, list] = {}
    for d in res.laws:
        out.setdefault(d.match, []).append(d)
    return out


def _terms(d) -> set[tuple[float, str]]:
    return {(round(c, 9), w) for c, w in d.terms}


def _all_checked(res: Discovery):
    assert res.laws, "no law found"
    for d in res.laws:
        assert d.first_order <= 1e-10, (d.name, d.first_order, d.formula())
        assert d.law is not None, (d.name, d.why_no_law)


# --------------------------------------------------------------------------------- the catalogue
def test_relu_mlp_one_law_per_hidden_unit():
    res = conserve.discover(_make(FFN, 3, 4, 2, F.relu), _x(30, 3))
    _all_checked(res)
    assert [d.match for d in res.laws] == ["unit balance"] * 4
    for u, d in enumerate(res.laws):
        assert _terms(d) == {(1.0, f"||fc_in.weight[{u},:]||^2"), (1.0, f"||fc_in.bias[{u}]||^2"),
                             (-1.0, f"||fc_out.weight[:,{u}]||^2")}
    assert res.linear_dim == 0 and res.quadratic_dim == 4
    # the dense ansatz (every monomial) ran as a cross-check and found nothing more
    assert {s.ansatz for s in res.solves} == {"structured", "dense"} and res.outside_ansatz == 0
    assert res.count is not None and res.count.count == 4 and res.complete
    q = [s for s in res.solves if s.degree == 2 and s.ansatz == "structured"][0]
    assert q.null_dim == 4 and q.gap > 1e8


def test_swiglu_one_law_per_unit_gate_not_involved():
    res = conserve.discover(_make(SwiGLU, 3, 2, up_bias=True), _x(20, 3))
    _all_checked(res)
    assert [d.match for d in res.laws] == ["unit balance"] * 2
    for u, d in enumerate(res.laws):
        assert _terms(d) == {(1.0, f"||up_proj.weight[{u},:]||^2"), (1.0, f"||up_proj.bias[{u}]||^2"),
                             (-1.0, f"||down_proj.weight[:,{u}]||^2")}
        assert "gate_proj.weight" not in d.law.params
    assert res.complete


def test_mha_head_grams_qk_and_vo_and_frozen_key_bias():
    """nH=2, D=2 with q/k/v biases: per head one D x D QK Gram (D(D+1)/2 = 3 laws, q bias inside) and one
    VO Gram (v bias inside); the key bias gets zero gradient (4 frozen entries); 16 = conserve.count."""
    res = conserve.discover(_make(Attention, 4, 2, 2, q_bias=True, k_bias=True, v_bias=True), _x(4, 3, 4),
                            ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert sorted(_terms(d).pop()[1] for d in m["frozen"]) == [f"k_proj.bias[{a}]" for a in range(4)]
    assert [_terms(d) for d in m["head Gram"]] == [
        {(1.0, f"q_proj.weight[{i}:{i + 2},:]"), (1.0, f"q_proj.bias[{i}:{i + 2}]"), (-1.0, f"k_proj.weight[{i}:{i + 2},:]")}
        for i in (0, 2)]
    assert [_terms(d) for d in m["deep linear / VO Gram"]] == [
        {(1.0, f"v_proj.weight[{i}:{i + 2},:]"), (1.0, f"v_proj.bias[{i}:{i + 2}]"), (-1.0, f"o_proj.weight[:,{i}:{i + 2}]")}
        for i in (0, 2)]
    assert all(d.law.kind == "gram" and d.law.size == 2 and d.independent == 3 for d in m["head Gram"])
    assert res.independent == 16 and res.count.count == 16 and res.complete
    assert res.products == 10  # b_k[a] b_k[b]: products of the frozen entries, counted, not listed


def test_gqa_one_gram_per_kv_group():
    res = conserve.discover(_make(Attention, 4, 4, 2, num_key_value_heads=2), _x(4, 3, 4), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert [_terms(d) for d in m["head Gram"]] == [
        {(1.0, "q_proj.weight[0:2,:]"), (1.0, "q_proj.weight[2:4,:]"), (-1.0, "k_proj.weight[0:2,:]")},
        {(1.0, "q_proj.weight[4:6,:]"), (1.0, "q_proj.weight[6:8,:]"), (-1.0, "k_proj.weight[2:4,:]")}]
    assert [_terms(d) for d in m["deep linear / VO Gram"]] == [
        {(1.0, "v_proj.weight[0:2,:]"), (-1.0, "o_proj.weight[:,0:2]"), (-1.0, "o_proj.weight[:,2:4]")},
        {(1.0, "v_proj.weight[2:4,:]"), (-1.0, "o_proj.weight[:,4:6]"), (-1.0, "o_proj.weight[:,6:8]")}]
    assert res.complete and res.independent == 12


class _RopeAttention(nn.Module):
    """Single-head-group attention with RoPE in either layout on the first ``rotary_dim`` dims of each head:
    ``half`` pairs (t, t + R/2) (HF rotate_half), ``interleaved`` pairs (2p, 2p + 1) (GPT-J / Meta)."""

    def __init__(self, hidden=4, heads=1, head_dim=4, rotary_dim=4, layout="interleaved"):
        super().__init__()
        self.h, self.d, self.r, self.layout = heads, head_dim, rotary_dim, layout
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def rope(self, x):
        T, R = x.shape[-2], self.r
        ang = torch.arange(T, dtype=x.dtype)[:, None] * 10.0 ** (-torch.arange(0, R, 2, dtype=x.dtype) / R)
        cos, sin = ang.cos(), ang.sin()
        xr, xp = x[..., :R], x[..., R:]
        if self.layout == "half":
            a, b = xr[..., : R // 2], xr[..., R // 2:]
            xr = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
        else:
            a, b = xr[..., 0::2], xr[..., 1::2]
            xr = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([xr, xp], -1)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(self.rope(q) @ self.rope(k).transpose(-1, -2) / math.sqrt(self.d), -1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("layout,pairs", [("half", [(0, 2), (1, 3)]), ("interleaved", [(0, 1), (2, 3)])])
def test_rope_pair_laws_in_both_layouts(layout, pairs):
    res = conserve.discover(_make(_RopeAttention, layout=layout), _x(3, 5, 4), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert [_terms(d) for d in m["rotary pair"]] == [
        {(1.0, f"||q_proj.weight[{a},:]||^2"), (1.0, f"||q_proj.weight[{b},:]||^2"),
         (-1.0, f"||k_proj.weight[{a},:]||^2"), (-1.0, f"||k_proj.weight[{b},:]||^2")} for a, b in pairs]
    assert [_terms(d) for d in m["deep linear / VO Gram"]] == [{(1.0, "v_proj.weight[0:4,:]"), (-1.0, "o_proj.weight[:,0:4]")}]
    assert "head Gram" not in m  # no QK Gram law under RoPE
    assert res.complete and res.independent == 2 + 10


def test_partial_rotary_pairs_plus_pass_through_gram():
    """R=2 of D=4: one pair law on dims {0, 1}, a full 2 x 2 QK Gram on the pass-through dims [2, 4), VO."""
    res = conserve.discover(_make(Attention, 4, 1, 4, rotary_dim=2), _x(3, 5, 4), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert [_terms(d) for d in m["rotary pair"]] == [
        {(1.0, "||q_proj.weight[0,:]||^2"), (1.0, "||q_proj.weight[1,:]||^2"),
         (-1.0, "||k_proj.weight[0,:]||^2"), (-1.0, "||k_proj.weight[1,:]||^2")}]
    assert [_terms(d) for d in m["head Gram"]] == [{(1.0, "q_proj.weight[2:4,:]"), (-1.0, "k_proj.weight[2:4,:]")}]
    assert res.complete and res.independent == 14


def test_moe_softmax_router_sum_and_expert_units():
    res = conserve.discover(_make(MoE, 3, 2, 3, 2, "softmax"), _x(40, 3), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    (router,) = m["row sum (router sum / translation)"]
    assert _terms(router) == {(1.0, f"router.weight[{e},:]") for e in range(3)}
    assert router.law.linear and router.independent == 3
    assert len(m["unit balance"]) == 3 * 2
    assert all(not any("gate_proj" in w for _, w in d.terms) for d in m["unit balance"])
    assert res.products == 1  # ||sum_e W_router[e,:]||^2
    assert res.complete and res.independent == 9


def test_moe_normalised_sigmoid_top2_has_no_router_law():
    res = conserve.discover(_make(MoE, 3, 2, 3, 2, "sigmoid"), _x(40, 3), ansatz="structured")
    _all_checked(res)
    assert res.linear_dim == 0
    assert [d.match for d in res.laws] == ["unit balance"] * 6
    assert not any("router" in w for d in res.laws for _, w in d.terms)
    assert res.complete


class _DeepLinear(nn.Module):
    def __init__(self, dims=(3, 2, 3, 2)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for lin in self.layers:
            x = lin(x)
        return x


def test_deep_linear_gram_between_consecutive_layers():
    res = conserve.discover(_make(_DeepLinear), _x(30, 3))
    _all_checked(res)
    assert [(_terms(d), d.independent) for d in res.laws] == [
        ({(1.0, "layers.0.weight[0:2,:]"), (-1.0, "layers.1.weight[:,0:2]")}, 3),
        ({(1.0, "layers.1.weight[0:3,:]"), (-1.0, "layers.2.weight[:,0:3]")}, 6)]
    assert res.complete and res.outside_ansatz == 0


# ------------------------------------------------------------------------------ NOT in the catalogue
def _mha_projections(m: nn.Module, hidden: int, heads: int, head_dim: int) -> None:
    """q/k/v/o projections without bias (the attention blocks below add their extra parameter)."""
    m.h, m.d = heads, head_dim
    m.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
    m.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
    m.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
    m.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _TemperatureAttention(nn.Module):
    """MHA whose logits are multiplied by a learnable temperature ``tau`` (shape (1,))."""

    def __init__(self, hidden=4, heads=2, head_dim=2):
        super().__init__()
        _mha_projections(self, hidden, heads, head_dim)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(self.temperature * (q @ k.transpose(-1, -2)), -1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


def test_new_law_learnable_temperature_on_attention_logits():
    """Derivation. The logits are ``tau * (W_q x)^T (W_k y)``. The one-parameter group
    ``tau -> e^s tau, W_k -> e^-s W_k`` (ALL heads at once: tau is shared) leaves every logit, hence the
    output, unchanged. Its generator is ``xi = (d tau, d W_k) = (tau, -W_k)``, so ``<grad L, xi> = 0`` for
    every loss and along gradient flow ``d/dt (tau^2 - ||W_k||_F^2) = -2 <grad L, xi> = 0``:

        h = tau^2 - ||W_k||_F^2 = tau^2 - sum_r ||W_k[r,:]||^2   (one law, all heads together).

    (``tau^2 - ||W_q||_F^2`` is the same law modulo the traces of the per-head QK Grams, which survive:
    ``GL(D)`` per head commutes with the scalar tau.) Not in the catalogue: the catalogue has no
    learnable logit scale. Expected: 2 QK Grams + 2 VO Grams (12) + this law = 13 = conserve.count."""
    res = conserve.discover(_make(_TemperatureAttention), _x(3, 4, 4), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert len(m["head Gram"]) == 2 and len(m["deep linear / VO Gram"]) == 2
    (new,) = m["new"]
    assert _terms(new) == {(1.0, "||temperature[0]||^2")} | {(-1.0, f"||k_proj.weight[{r},:]||^2") for r in range(4)}
    assert res.complete and res.independent == 13
    # independent check by the project's verifier, and teeth: tau^2 - ||W_k||^2 / 2 is not conserved
    model, x = _make(_TemperatureAttention), _x(3, 4, 4, seed=5)
    assert verify_first_order(model, new.law, x) <= 1e-10
    bad = type(new.law)("bad", None, [t if t.sign > 0 else type(t)(t.kind, t.ref, -0.5) for t in new.law.terms], 1)
    assert verify_first_order(model, bad, x) > 1e-4


class _Bilinear(nn.Module):
    """Bilinear (gated-linear, no nonlinearity) layer ``w3((w1 x) * (w2 x))``."""

    def __init__(self, hidden=3, inter=2, out=2):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(inter, out, bias=False)

    def forward(self, x):
        return self.w3(self.w1(x) * self.w2(x))


def test_new_law_bilinear_layer_two_laws_per_unit():
    """Derivation. Unit u computes ``w3[:,u] (w1[u] . x)(w2[u] . x)``: for any ``a, b > 0`` the map
    ``w1[u] -> a w1[u], w2[u] -> b w2[u], w3[:,u] -> w3[:,u] / (a b)`` leaves it unchanged: a TWO-parameter
    group per unit (SwiGLU has only one: silu(gate) is not homogeneous, so the gate is not involved).
    The generators ``(w1[u], 0, -w3[:,u])`` and ``(0, w2[u], -w3[:,u])`` give, as in the unit-balance
    argument, two laws per unit:

        ||w1[u,:]||^2 - ||w3[:,u]||^2   and   ||w2[u,:]||^2 - ||w3[:,u]||^2.

    Not in the catalogue (the catalogue's gated FFN is SwiGLU, 1 law per unit). 2 * I = 4 = conserve.count."""
    res = conserve.discover(_make(_Bilinear), _x(30, 3))
    _all_checked(res)
    got = sorted(tuple(sorted(_terms(d))) for d in res.laws)
    want = sorted(tuple(sorted({(1.0, f"||{w}.weight[{u},:]||^2"), (-1.0, f"||w3.weight[:,{u}]||^2")}))
                  for w in ("w1", "w2") for u in range(2))
    assert got == want
    assert res.complete and res.independent == 4 and res.outside_ansatz == 0


class _GatedAttention(nn.Module):
    """MHA with an elementwise sigmoid output gate (gated attention): ``o_proj(attn(x) * sigmoid(gate_proj x))``."""

    def __init__(self, hidden=4, heads=2, head_dim=2):
        super().__init__()
        _mha_projections(self, hidden, heads, head_dim)
        self.gate_proj = nn.Linear(hidden, heads * head_dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d), -1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)


def test_new_law_gated_attention_output_gate_breaks_vo_gram_to_its_diagonal():
    """Derivation. Without the gate, head i's output ``O_i A V_i x`` is invariant under
    ``V_i -> B V_i, O_i -> O_i B^-1`` for any B in GL(D) (the VO Gram, D(D+1)/2 laws). With the elementwise
    gate, head i emits ``O_i diag(g_i(x)) A V_i x`` with ``g_i = sigmoid(G_i x)`` varying with x, so B must
    satisfy ``diag(g) B = B diag(g)`` for all g: B diagonal. The surviving group is the per-dimension
    rescaling ``V[t,:] -> c V[t,:], O[:,t] -> O[:,t] / c``, whose laws are

        ||W_v[t,:]||^2 - ||W_o[:,t]||^2   for every dim t (D per head instead of D(D+1)/2),

    the gate itself not involved (sigmoid is not homogeneous). q/k are untouched: the QK Gram stays.
    Not in the catalogue. 2 QK Grams (6) + 4 = 10 = conserve.count."""
    res = conserve.discover(_make(_GatedAttention), _x(3, 4, 4), ansatz="structured")
    _all_checked(res)
    m = _by_match(res)
    assert len(m["head Gram"]) == 2 and "deep linear / VO Gram" not in m
    assert [_terms(d) for d in m["unit balance"]] == [
        {(1.0, f"||v_proj.weight[{t},:]||^2"), (-1.0, f"||o_proj.weight[:,{t}]||^2")} for t in range(4)]
    assert not any("gate_proj" in w for d in res.laws for _, w in d.terms)
    assert res.complete and res.independent == 10


# ------------------------------------------------------------------------------------ integration
def test_discovered_laws_are_tracked_and_verified():
    model, x = _make(_TemperatureAttention), _x(3, 4, 4)
    res = conserve.discover(model, x, ansatz="structured", count=False)
    laws = res.tracked_laws()
    from conserve.analysis.verify import verify

    checks = verify(model, laws, _x(3, 4, 4, seed=9))  # spec checks 1 (first order) and 2 (symmetry action)
    assert len(checks) == len(laws) == 5 and all(c.ok for c in checks), checks
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.SGD(model.parameters(), lr=1e-3), model, laws=laws, sinks=[sink], every=1,
                         fp64=True)
    for _ in range(3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.close()
    eps = [v for row in sink.records for k, v in row.items() if k.startswith("eps/discovered_")]
    assert eps and max(float(v) for v in eps) < 1e-4  # GD: O(lr^2) per step


def test_dense_ansatz_and_callable_block():
    """A callable ``block(params, x)`` with the dense ansatz (every monomial): ReLU unit laws, no bias."""
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(3, 2, generator=g, dtype=torch.float64),
              "b": torch.randn(2, 3, generator=g, dtype=torch.float64)}

    def block(p, x):
        return F.relu(x @ p["a"].T) @ p["b"].T

    res = conserve.discover(block, _x(30, 2), params=params, ansatz="dense")
    assert [s.ansatz for s in res.solves] == ["dense", "dense"]
    assert res.quadratic_dim == 3 and res.complete
    for d in res.laws:
        assert d.first_order <= 1e-10
        assert len(d.terms) == 2 + 2  # ||a[u,:]||^2 (2 monomials) - ||b[:,u]||^2 (2 monomials)


def test_too_large_block_names_the_limit_and_the_fix():
    with pytest.raises(BlockTooLarge, match=r"max_unknowns=50.*smaller width"):
        conserve.discover(_make(SwiGLU, 3, 2), _x(20, 3), ansatz="structured", pairs="all", max_unknowns=50)
    with pytest.raises(BlockTooLarge, match=r"single-tensor pairs.*max_unknowns=10.*smaller width"):
        conserve.discover(_make(SwiGLU, 3, 2), _x(20, 3), ansatz="structured", max_unknowns=10)
    with pytest.raises(ValueError, match="degree must be 1 or 2"):
        conserve.discover(_make(SwiGLU, 3, 2), _x(20, 3), degree=3)


def test_cli_writes_markdown_and_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "myblocks_discover.py").write_text(
        "import torch\nfrom conserve.toyblocks import SwiGLU\n"
        "def tiny():\n    torch.manual_seed(0)\n    return SwiGLU(3, 2).double(), torch.randn(20, 3, dtype=torch.float64)\n")
    monkeypatch.chdir(tmp_path)
    from conserve.cli import main

    assert main(["discover", "myblocks_discover:tiny", "--ansatz", "structured", "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert "unit balance" in md and "complete" in md
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["complete"] is True and len(data["laws"]) == 2 and data["laws"][0]["match"] == "unit balance"
    # exactly PREFIX.md and PREFIX.json; a .md suffix is dropped; a directory gets discover.md / .json inside
    (tmp_path / "d").mkdir()
    for out, files in ((str(tmp_path / "s.md"), ["s.json", "s.md"]), (str(tmp_path / "d"), ["d/discover.json", "d/discover.md"]),
                       (str(tmp_path / "new") + "/", ["new/discover.json", "new/discover.md"])):
        before = {p for p in tmp_path.rglob("*") if p.is_file()}
        assert main(["discover", "myblocks_discover:tiny", "--ansatz", "structured", "--no-count", "--out", out]) == 0
        made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p not in before
                      and "__pycache__" not in str(p))
        assert made == files, (out, made)
    assert main(["discover", "myblocks_discover"]) == 2
    assert main(["discover", "no_such_module_xyz:f"]) == 2
    assert "MODULE:FACTORY" in capsys.readouterr().err


class _Classifier(nn.Module):
    """A linear classifier ending in log_softmax (so that laws valid only for softmax cross-entropy hold
    for every loss of its output)."""

    def __init__(self, d_in=3, classes=4):
        super().__init__()
        self.lm_head = nn.Linear(d_in, classes, bias=True)

    def forward(self, x):
        return torch.log_softmax(self.lm_head(x), -1)


def test_translation_law_of_a_softmax_output_layer_and_degree_1():
    """Adding one vector c to every row of W_U (and a constant to every bias) shifts every logit of a sample
    by the same amount, which log_softmax removes: ``sum_v W_U[v,:]`` and ``sum_v b_U[v]`` are conserved
    (spec: untied softmax output layer). The bias sum is a separate 1-vector law on the bias column."""
    res = conserve.discover(_make(_Classifier), _x(20, 3), degree=1)
    _all_checked(res)
    m = _by_match(res)
    bias, rows = m["row sum (router sum / translation)"]
    assert _terms(rows) == {(1.0, f"lm_head.weight[{v},:]") for v in range(4)}
    assert _terms(bias) == {(1.0, f"lm_head.bias[{v}]") for v in range(4)}
    assert res.linear_dim == 3 + 1 and res.quadratic_dim == 0
    assert [s.degree for s in res.solves] == [1, 1]  # structured + dense, linear only


def test_gelu_ffn_has_no_law_and_pre_norm_gain_balance():
    """GELU FFN: no law (spec: none beyond constants). Pre-norm LayerNorm read by two maps: per feature c,
    ``g_c^2 + beta_c^2 - ||W_q[:,c]||^2 - ||W_k[:,c]||^2`` (spec: pre-norm gain row)."""
    res = conserve.discover(_make(FFN, 3, 4, 2, F.gelu), _x(30, 3))
    assert res.laws == [] and res.linear_dim == 0 and res.quadratic_dim == 0 and res.complete

    class PreNorm(nn.Module):
        def __init__(self, hidden=3):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.q_proj = nn.Linear(hidden, 2, bias=False)
            self.k_proj = nn.Linear(hidden, 2, bias=False)

        def forward(self, x):
            h = self.norm(x)
            return torch.tanh(self.q_proj(h)) * self.k_proj(h)

    res = conserve.discover(_make(PreNorm), _x(30, 3))
    _all_checked(res)
    assert [(d.match, _terms(d)) for d in res.laws] == [
        ("gain balance", {(1.0, f"||norm.weight[{c}]||^2"), (1.0, f"||norm.bias[{c}]||^2"),
                          (-1.0, f"||q_proj.weight[:,{c}]||^2"), (-1.0, f"||k_proj.weight[:,{c}]||^2")}) for c in range(3)]
    assert res.complete


def test_single_tensor_pairs_find_the_same_laws_with_fewer_unknowns():
    block, x = _make(Attention, 4, 4, 2, num_key_value_heads=2), _x(4, 3, 4)
    full = conserve.discover(block, x, ansatz="structured", pairs="all", count=False)
    within = conserve.discover(block, x, ansatz="structured", pairs="within", count=False)
    nq = lambda r: [s for s in r.solves if s.degree == 2][0].unknowns  # noqa: E731
    assert nq(within) < nq(full) / 2
    assert [(d.match, _terms(d)) for d in within.laws] == [(d.match, _terms(d)) for d in full.laws]
    # auto: all pairs do not fit, single-tensor pairs do -> used, and said
    auto = conserve.discover(block, x, ansatz="structured", max_unknowns=nq(within) + 10, count=False)
    assert nq(auto) == nq(within) and any("cross-tensor pairs left out" in n for n in auto.notes)
    assert len(auto.laws) == len(full.laws)


class _FusedExperts(nn.Module):
    """Experts stored as 3-D tensors (``gate_up`` (E, 2I, H), ``down`` (E, H, I)), dense mixture, dict output."""

    def __init__(self, experts=2, hidden=3, inter=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=g))
        self.down = nn.Parameter(torch.randn(experts, hidden, inter, generator=g))
        self.inter = inter

    def forward(self, x):
        h = torch.einsum("eoh,nh->neo", self.gate_up, x)
        y = F.silu(h[..., : self.inter]) * h[..., self.inter:]
        return {"out": torch.einsum("ehi,nei->nh", self.down, y)}


def test_fused_3d_expert_tensors_and_dict_output():
    """Per expert e and unit u: ||gate_up[e, I + u, :]||^2 - ||down[e, :, u]||^2 (the up half of the fused
    weight; the gate half is not involved), as Laws on 3-D views (``lead=(e,)``)."""
    res = conserve.discover(_make(_FusedExperts), _x(30, 3))
    _all_checked(res)
    assert [(d.match, _terms(d)) for d in res.laws] == [
        ("unit balance", {(1.0, f"||gate_up[{e}][{2 + u},:]||^2"), (-1.0, f"||down[{e}][:,{u}]||^2")})
        for e in range(2) for u in range(2)]
    assert res.complete


class _TinyLM(nn.Module):
    """Token ids -> embedding -> ReLU MLP -> logits."""

    def __init__(self, vocab=5, hidden=2, inter=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.fc_in = nn.Linear(hidden, inter, bias=False)
        self.fc_out = nn.Linear(inter, vocab, bias=False)

    def forward(self, ids):
        return self.fc_out(F.relu(self.fc_in(self.embed_tokens(ids))))


def test_token_inputs_are_redrawn_over_the_vocabulary():
    """The example batch uses only ids 0 and 4; redrawn ids cover 0..4, so no embedding row looks frozen
    (a row never looked up would get zero gradient: a linear "law" of that data only). Laws: the embedding
    feeds fc_in linearly, ``fc_in(E[id])``, so ``E -> E A^T, W_in -> W_in A^-1`` (GL(hidden)) gives the
    deep-linear Gram ``E^T E - W_in^T W_in`` over columns (E is stored (vocab, hidden)), 3 laws for
    hidden 2; plus one ReLU unit balance per unit (3)."""
    ids = torch.tensor([[0, 4, 0, 4]] * 3)
    res = conserve.discover(_make(_TinyLM), ids)
    _all_checked(res)
    assert res.linear_dim == 0
    assert [(d.match, _terms(d) if d.kind == "gram" else len(d.terms)) for d in res.laws] == [
        ("deep linear / VO Gram", {(1.0, "embed_tokens.weight[:,0:2]"), (-1.0, "fc_in.weight[:,0:2]")})] + [
        ("unit balance", 2)] * 3
    assert res.complete


def test_sparse_forms_without_scipy(monkeypatch):
    """The least-L1 representatives also come out of the torch-only fallback (IRLS) when scipy is missing."""
    import conserve.analysis.ansatz as ansatz

    monkeypatch.setattr(ansatz, "_l1_linprog", lambda x, T: None)
    res = conserve.discover(_make(_Bilinear), _x(30, 3), ansatz="structured")
    got = sorted(tuple(sorted(_terms(d))) for d in res.laws)
    want = sorted(tuple(sorted({(1.0, f"||{w}.weight[{u},:]||^2"), (-1.0, f"||w3.weight[:,{u}]||^2")}))
                  for w in ("w1", "w2") for u in range(2))
    assert got == want


@pytest.mark.parametrize("solver", ["highs", "irls"])
@pytest.mark.parametrize("mix", [False, True])
def test_canonical_form_does_not_depend_on_the_l1_solver_or_the_svd_basis(monkeypatch, solver, mix):
    """Regression: least L1 modulo the other laws has ties (``||u0|| = ||(u0 - u2) / 2||`` for balance laws
    with disjoint supports), resolved differently by scipy's HiGHS (a vertex) and the IRLS fallback (a
    midpoint: what CI, without scipy, ran). The canonical form must not depend on the solver, nor on the
    basis the SVD returns for the null space (``mix``: the null-space basis multiplied by a random
    orthogonal matrix)."""
    import conserve.analysis.ansatz as ansatz
    import conserve.analysis.discover as disc

    if solver == "irls":
        monkeypatch.setattr(ansatz, "_l1_linprog", lambda x, T: None)
    else:
        pytest.importorskip("scipy")
    if mix:
        orig = disc._nullspace

        def mixed(A):
            null, *rest = orig(A)
            k = null.shape[1]
            if k > 1:
                q, _ = torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(k), dtype=torch.float64))
                null = null @ q
            return (null, *rest)

        monkeypatch.setattr(disc, "_nullspace", mixed)
    res = conserve.discover(_make(_TinyLM), torch.tensor([[0, 4, 0, 4]] * 3), ansatz="structured", count=False)
    assert [(d.match, _terms(d)) for d in res.laws] == [
        ("deep linear / VO Gram", {(1.0, "embed_tokens.weight[:,0:2]"), (-1.0, "fc_in.weight[:,0:2]")})] + [
        ("unit balance", {(1.0, f"||fc_in.weight[{u},:]||^2"), (-1.0, f"||fc_out.weight[:,{u}]||^2")}) for u in range(3)]


def _qa_relu_block(bias0=None):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3, bias=False)).double()
    if bias0 is not None:
        with torch.no_grad():
            block[0].bias[0] = bias0
    return block, torch.randn(8, 3, dtype=torch.float64)


def test_completeness_counts_on_enough_samples_and_never_advises_what_ran():
    """QA regression: on 8 example rows (24 with the redrawn batches) a ReLU unit active on one sample made
    ``conserve.count`` say 7 laws for this block (true: 4, one per unit), and the statement advised
    ansatz='dense' although the dense ansatz had run. The count now runs on >= 4 P output rows, and is
    redone on more samples while it exceeds the laws found."""
    res = conserve.discover(*_qa_relu_block())
    assert [d.match for d in res.laws] == ["unit balance"] * 4
    assert res.count.count == 4 and res.complete and res.completeness().startswith("complete")
    # the statement names what ran: after the dense ansatz, no advice to run it
    res.independent = 3
    assert "dense ansatz (every monomial) ran too" in res.completeness() and "try" not in res.completeness()
    only = conserve.discover(*_qa_relu_block(), ansatz="structured")
    only.independent = 3
    assert "ansatz='dense'" in only.completeness()


def test_dead_unit_makes_the_count_undecided_not_incomplete():
    """A unit whose bias (-1.5) keeps it inactive on every sample of the count's batch at the block's
    parameters: its weights get no gradient there, so conserve.count (10) is an upper bound, a property of
    that batch. The statement says so and names the dead parameters; no spurious linear law is listed."""
    res = conserve.discover(*_qa_relu_block(-1.5))
    assert res.linear_dim == 0 and [d.match for d in res.laws] == ["unit balance"] * 4
    assert res.count.count > res.independent == 4 and not res.complete
    assert "0.bias[0]" in res.dead and "2.weight[0,0]" in res.dead
    assert res.completeness().startswith("undecided") and "dense" not in res.completeness()
    assert res.to_json()["dead"] == res.dead
