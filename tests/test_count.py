"""Law counting (spec check 4; Marcotte, Gribonval, Peyre 2023): count_laws against the theory.

The expected counts come from the spec's catalogue (see conserve/toyblocks.py for each reason);
the Lie bracket is checked against a closed form, the rank rule against matrices of known rank.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from conserve.counting import count_laws, lie_bracket, numerical_rank
from conserve.toyblocks import FFN, MoE, seeded, violation, instances

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")

INSTANCES = {inst.name: inst for inst in instances(seed=0)}


@pytest.mark.parametrize("name", list(INSTANCES))
def test_count_matches_theory(name):
    inst = INSTANCES[name]
    res = count_laws(inst.block, inst.inputs, seed=0)
    assert res.count == inst.expected, f"{name}: {inst.why}\n{res.summary()}"
    # the decision must be clear-cut: a gap of many decades, every other ratio small
    assert res.gap_ratio > 1e8, res.summary()
    assert res.second_gap_ratio < 1e2, res.summary()
    assert res.num_params == sum(p.numel() for p in inst.block.parameters())


def test_brackets_are_needed_for_gl_symmetries():
    # two-layer linear: the depth-1 span misses the antisymmetric part of gl(n1), brackets add it
    res = count_laws(INSTANCES["linear2"].block, INSTANCES["linear2"].inputs)
    assert res.ranks_by_depth[:2] == [14 - 4, 14 - 3], res.summary()
    mha = count_laws(INSTANCES["mha"].block, INSTANCES["mha"].inputs)
    # depth 1: P - nH * 2 * D^2 (the GL(D) orbits), Lie: P - nH * D(D+1)
    assert mha.ranks_by_depth[0] == 64 - 2 * 2 * 4 and mha.rank == 64 - 12, mha.summary()


def test_lie_bracket_closed_form():
    # linear fields U = A theta, W = B theta: [U, W] = (B A - A B) theta
    g = torch.Generator().manual_seed(3)
    A, B = (torch.randn(6, 6, generator=g, dtype=torch.float64) for _ in range(2))
    th = torch.randn(6, generator=g, dtype=torch.float64)
    br, scale = lie_bracket(lambda t: A @ t, lambda t: B @ t, th)
    torch.testing.assert_close(br, (B @ A - A @ B) @ th, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scale, (B @ A @ th).norm() + (A @ B @ th).norm())


def test_lie_bracket_against_autograd_jacobians():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(5, 5, generator=g, dtype=torch.float64)
    th = torch.randn(5, generator=g, dtype=torch.float64)

    def u(t):
        return torch.sin(A @ t) * t

    def w(t):
        return (t**3).flip(0) + A.T @ torch.tanh(t)

    ju = torch.autograd.functional.jacobian(u, th)
    jw = torch.autograd.functional.jacobian(w, th)
    br, _ = lie_bracket(u, w, th)
    torch.testing.assert_close(br, jw @ u(th) - ju @ w(th), rtol=1e-12, atol=1e-12)


def test_numerical_rank_known_spectrum():
    g = torch.Generator().manual_seed(5)
    q1, _ = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    s = torch.zeros(20, dtype=torch.float64)
    s[:7] = torch.logspace(0, -4, 7, dtype=torch.float64)  # spread, but far above rounding
    mat = q1 @ torch.diag(s) @ q2[:20]
    r, sv, gap, second = numerical_rank(mat)
    assert r == 7 and gap > 1e8 and second < 1e2
    full, *_ = numerical_rank(q1 @ torch.diag(torch.logspace(0, -3, 20, dtype=torch.float64)) @ q2[:20])
    assert full == 20
    assert numerical_rank(torch.zeros(4, 5, dtype=torch.float64))[0] == 0


def test_dead_relu_unit_adds_frozen_parameters():
    # non-generic point: unit 0 is off for every input, so its 3 + 1 + 2 parameters get no gradient
    # (each a law) and they absorb its balance law: I - 1 + 6 laws instead of I
    inst = INSTANCES["relu_ffn_bias"]
    block = seeded(0, lambda: FFN(3, 5, 2, F.relu))
    with torch.no_grad():
        block.fc_in.bias[0] = -100.0
    res = count_laws(block, inst.inputs)
    assert res.count == 5 - 1 + 6, res.summary()


def test_params_subset_and_callable():
    inst = INSTANCES["linear2"]
    # W2 (3x2) fixed with full column rank: W1 -> W2 W1 is injective, no law is left
    res = count_laws(inst.block, inst.inputs, params=["fc_in.weight"])
    assert res.count == 0 and res.num_params == 8 and res.param_names == ["fc_in.weight"]
    p = {n: t.detach().clone() for n, t in inst.block.named_parameters()}

    def fn(params, x):
        return x @ params["fc_in.weight"].T @ params["fc_out.weight"].T

    res2 = count_laws(fn, inst.inputs, params=p)
    assert res2.count == 3 and res2.rank == 11


def test_router_sum_softmax_vs_normalised_sigmoid():
    # docs/router_sigmoid.md: softmax top-2 keeps sum_e W_router[e,:] (H laws), sigmoid top-2 does not
    g = torch.Generator().manual_seed(11)
    x = torch.randn(60, 3, generator=g, dtype=torch.float64)
    c = torch.randn(3, generator=g, dtype=torch.float64).expand(3, 3).clone()
    soft = seeded(0, lambda: MoE(3, 2, 3, 2, "softmax"))
    sig = seeded(0, lambda: MoE(3, 2, 3, 2, "sigmoid"))
    assert count_laws(soft, x).count == 3 * 2 + 3
    assert count_laws(sig, x).count == 3 * 2
    assert violation(soft, x, {"router.weight": c}) < 1e-13
    assert violation(sig, x, {"router.weight": c}) > 1e-4


def test_bad_input_errors():
    inst = INSTANCES["swiglu"]
    with pytest.raises(ValueError, match="not parameters"):
        count_laws(inst.block, inst.inputs, params=["nope"])
    with pytest.raises(TypeError, match="params="):
        count_laws(lambda p, x: x, inst.inputs)
    with pytest.raises(ValueError, match="depth"):
        count_laws(inst.block, inst.inputs, depth=0)
    with pytest.raises(ValueError, match="do not depend"):
        count_laws(lambda p, x: x * 0 * p["a"], inst.inputs, params={"a": torch.ones(())})
    assert not math.isnan(count_laws(inst.block, inst.inputs, depth=1).gap_ratio)


def test_constant_fields_vanish_and_count_is_the_corank():
    # f(theta) = A theta (3 outputs per input, 2 inputs, 10 params): constant fields, all brackets
    # vanish, laws = P - rank(A-stack) = 10 - 6 exactly (laws of this batch: sample_check off)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 10, generator=g, dtype=torch.float64)
    res = count_laws(lambda p, xx: xx @ p["theta"], x, params={"theta": torch.randn(10, generator=g)},
                     sample_check=False)
    assert res.count == 4 and res.vanished_at == 2, res.summary()


def test_too_few_inputs_is_an_error_not_a_count():
    # user report: Linear(3,4)-ReLU-Linear(4,2) (4 laws) gave laws=11 on 16 inputs, silently: a unit
    # active on few rows leaves directions no field reaches. The rank must be stable when the sample
    # doubles (each half of the batch reaches it), else an error naming the fix.
    from torch import nn

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(16, 3)
    assert count_laws(block, x, sample_check=False).count == 11  # the silent wrong count
    with pytest.raises(ValueError, match="not stable in the sample size.*pass more input rows"):
        count_laws(block, x)
    with pytest.raises(ValueError, match="pass more input rows"):
        count_laws(block, x[:1])
    assert count_laws(block, torch.randn(64, 3)).count == 4
