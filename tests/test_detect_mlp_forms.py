"""MLP forms third-party code writes: activations homogeneous of degree k (squared ReLU: Primer, Nemotron,
Persimmon), a fused GLU whose linear half is on either side of the product, and PaLM's parallel block whose one
projection holds q, k, v and the MLP's up and gate rows. Each law claimed passes the first-order check on the
model itself (``hold``), and the wrong neighbours fail it (``fail``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conserve.detection import detect
from conserve.laws import ReLUPowerUnit, ReLUUnit, SwiGLUUnit
from conserve.laws.base import cols, rows, vector
from test_detect_graph import fail, floats, hold, law, reasons
from test_detect_torch import randomize

ACTS = {"relu_square": (lambda z: F.relu(z).square(), 2.0), "relu_pow": (lambda z: torch.pow(F.relu(z), 2), 2.0),
        "relu_1.5": (lambda z: F.relu(z) ** 1.5, 1.5), "relu_cubed": (lambda z: F.relu(z) ** 3, 3.0),
        "abs": (torch.abs, 1.0)}


class PowerMLP(nn.Module):
    def __init__(self, act, d=8, h=12):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(d, h), nn.Linear(h, d, bias=False), ACTS[act][0]

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("act", list(ACTS))
def test_a_homogeneous_activation_of_degree_k_gets_its_unit_law(act):
    """``f(c z) = c^k f(z)``: scaling unit u's row of ``up`` by c and its column of ``down`` by ``c^-k`` keeps the
    output, so ``||up[u]||^2 + b[u]^2 - k ||down[:, u]||^2`` is conserved; k read off the activation's values."""
    k = ACTS[act][1]
    m = randomize(PowerMLP(act))
    x = floats(4, 8)
    found = detect(m, example_inputs=x)
    fam = "relu" if k == 1 else "relu_power"
    assert found.families() == {fam: 1}, (found.families(), reasons(found))
    unit = law(found, "up/unit")
    assert isinstance(unit, ReLUPowerUnit if k != 1 else ReLUUnit)
    assert {(t.ref.param, t.sign) for t in unit.terms} == {("up.weight", 1.0), ("up.bias", 1.0), ("down.weight", -k)}
    hold(m, found, x)
    coefficient_one = ReLUUnit.build("k=1", None, up=rows("up.weight", (12, 8), 0, 12),
                                     down=cols("down.weight", (8, 12), 0, 12), up_bias=vector("up.bias", 0, 12))
    if k != 1:
        fail(m, {"coefficient 1": coefficient_one}, x)


def test_gelu_squared_is_declined_as_not_homogeneous():
    m = randomize(nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)))
    m.forward = lambda x: m[2](m[1](m[0](x)) ** 2)
    found = detect(m, example_inputs=floats(4, 8), structural=True)
    assert "relu" not in found.families() and "relu_power" not in found.families(), found.families()


class FusedGLU(nn.Module):
    """``x, gate = fc1(h).chunk(2)``, the linear half first (lucidrains' soft-moe, PaLM), ``order`` placing it on
    the left or the right of the product, with ``act`` on the gate."""

    def __init__(self, order, act=F.silu, d=8, h=12):
        super().__init__()
        self.fc1, self.fc2, self.order, self.act = nn.Linear(d, 2 * h), nn.Linear(h, d), order, act

    def forward(self, t):
        x, gate = self.fc1(t).chunk(2, dim=-1)
        return self.fc2(x * self.act(gate) if self.order == "x*act" else self.act(gate) * x)


@pytest.mark.parametrize("act", [F.silu, F.gelu, F.softplus], ids=["silu", "gelu", "softplus"])
@pytest.mark.parametrize("order", ["x*act", "act*x"])
def test_a_fused_glu_reads_its_linear_half_on_either_side_of_the_product(order, act):
    """SiLU, GELU and softplus are the identity on the large positive codes a feature map runs (silu(43) == 43 in
    float64): the linear half is told from the gate by an odd run (index ops are odd, activations are not)."""
    m = randomize(FusedGLU(order, act))
    x = floats(4, 8)
    found = detect(m, example_inputs=x)
    assert found.families() == {"swiglu": 1}, (found.families(), reasons(found))
    unit = law(found, "fc1/unit")
    assert {(t.ref.param, t.ref.start) for t in unit.terms if t.ref.param == "fc1.weight"} == {("fc1.weight", (0, 0))}
    hold(m, found, x)
    gate_half = SwiGLUUnit.build("gate half", None, up=rows("fc1.weight", (24, 8), 12, 12),
                                 down=cols("fc2.weight", (8, 12), 0, 12), up_bias=vector("fc1.bias", 12, 12))
    fail(m, {"gate half": gate_half}, x)


class ParallelBlock(nn.Module):
    """PaLM's parallel block: one bias-free projection gives q, k, v and the MLP's linear and gate halves
    (``split(fused_dims)``); multi-query attention (one k and v head) and the SwiGLU MLP read the same input."""

    def __init__(self, d=16, heads=4, dh=4, ff=12):
        super().__init__()
        self.heads, self.dh, self.ff = heads, dh, ff
        self.fused_dims = (heads * dh, dh, dh, 2 * ff)
        self.norm = nn.LayerNorm(d)
        self.fused_attn_ff_proj = nn.Linear(d, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(heads * dh, d, bias=False)
        self.ff_out = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v, ff = self.fused_attn_ff_proj(self.norm(x)).split(self.fused_dims, dim=-1)
        q = q.view(b, n, self.heads, self.dh).transpose(1, 2)
        sim = torch.einsum("bhid,bjd->bhij", q, k) * self.dh ** -0.5
        out = torch.einsum("bhij,bjd->bhid", sim.softmax(-1), v).transpose(1, 2).reshape(b, n, -1)
        h, gate = ff.chunk(2, dim=-1)
        return x + self.attn_out(out) + self.ff_out(F.silu(gate) * h)


def test_palms_parallel_block_gets_the_mlp_unit_law_from_the_fused_projection():
    m = randomize(ParallelBlock())
    x = floats(2, 5, 16)
    found = detect(m, example_inputs=x)
    fam = found.families()
    assert fam.get("swiglu") == 1 and fam.get("qk") == 1 and fam.get("vo") == 1, (fam, reasons(found))
    unit = next(l for l in found.laws if l.family == "swiglu")
    up = [t.ref for t in unit.terms if t.ref.param == "fused_attn_ff_proj.weight"]
    assert len(up) == 1 and up[0].start == (24, 0) and up[0].rows == 12, up  # rows after q (16), k (4), v (4)
    hold(m, found, x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_degree_k_unit_law_evaluates_tracks_and_checks_gradients(backend):
    """The ``-k`` coefficient reaches the kernels: the law's value is ``||up[u]||^2 + b[u]^2 - 2 ||down[:, u]||^2``
    (float64 by hand), a clean gradient passes the gradient check and a 1% fault on ``down``'s gradient is flagged;
    under plain SGD the tracked drift's first-order term is zero (the law's symmetry)."""
    import conserve

    torch.manual_seed(0)
    m = PowerMLP("relu_square").double()
    x = floats(16, 8)
    found = detect(m, example_inputs=x)
    params = dict(m.named_parameters())
    value = conserve.evaluate_laws(found.laws, params, fp64=True, backend=backend)["up/unit"]
    up, b, down = (params[n].detach() for n in ("up.weight", "up.bias", "down.weight"))
    assert torch.allclose(value, (up ** 2).sum(1) + b ** 2 - 2 * (down ** 2).sum(0), rtol=1e-12, atol=1e-12)

    def loss(mm, xx):
        return (mm(xx) ** 2).mean()

    assert conserve.check_gradients(m, loss, x, laws=found).ok
    h = m.down.weight.register_hook(lambda g: g * 1.01)
    res = conserve.check_gradients(m, loss, x, laws=found)
    h.remove()
    assert [c.name for c in res.flagged] == ["up/unit"], str(res)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-3), m, laws=found.laws, every=100, drift_every=1,
                         snapshot_budget=None, fp64=True, backend=backend)
    for _ in range(3):
        opt.zero_grad()
        loss(m, x).backward()
        opt.step()
    rows_ = opt.tracker.flush()
    t = opt.tracker.totals()["relu_power"]
    assert len(rows_) == 3 and t["first"] < 1e-6 * t["second"], t  # coefficient 1 instead: first ~ 1e3 x second
    opt.close()
