"""Fused optimizers (conserve.optim.FusedAdamW / FusedAdam / FusedSGD) against torch.optim and float64.

References: ``torch.optim.AdamW/Adam/SGD(foreach=True)`` for the update (parameters AND states), the
float64 torch evaluation of the law plan for the law values, and the float64 decomposition
``h(a old) - h(old)``, ``2 B(a old, Delta)``, ``B(Delta, Delta)`` of spec "Discrete steps" for the
drift terms.  The CPU path is the torch twin; the Triton kernels run under TRITON_INTERPRET=1
(tests/conftest.py) on tiny tensors only (the interpreter is slow).
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import numpy as np
import torch
from torch import nn

import conserve
from conserve.kernels import bilinear_reference, evaluate_reference
from conserve.kernels.reference import drift_factors
from conserve.kernels import optim_step as K
from conserve.kernels import step_runner
from conserve.models import MLP
from conserve.models.lm import DecoderLM, LMConfig
from conserve.optim import FusedAdam, FusedAdamW, FusedSGD
from conserve.tracker import Values

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"

# ------------------------------------------------------------------------------------ helpers
MODELS = {
    "rope_half_bias": dict(attention_bias=True, mlp_bias=True),
    "moe_interleaved_partial": dict(num_experts=3, top_k=2, shared_expert=True, rope_layout="interleaved",
                                    rotary_dim=2, nope_layers=(1,)),
    "relu_layernorm_learned": dict(hidden_act="relu", norm="layer", position="learned"),
}

CONFIGS = {
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam_l2_maximize": (FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, maximize=True, betas=(0.8, 0.9))),
    "sgd_plain_wd": (FusedSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=0.1)),
    "sgd_momentum_dampening": (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    "sgd_nesterov_wd": (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01)),
}


def lm(seed=0, **switches):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=24)
    cfg.update(switches)
    return DecoderLM(LMConfig(**cfg))


def twin(model):
    m = copy.deepcopy(model)
    return m


def groups(model, base: dict):
    """Two parameter groups with different hyper-parameters (attention / the rest)."""
    att = [p for n, p in model.named_parameters() if "self_attn" in n]
    rest = [p for n, p in model.named_parameters() if "self_attn" not in n]
    g2 = dict(lr=base["lr"] * 0.5)
    if "weight_decay" in base:
        g2["weight_decay"] = base["weight_decay"] * 2
    return [{"params": att}, {"params": rest, **g2}]


def lm_loss(model, x):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def _close(a, b, rtol, what):
    """Entrywise ``|a - b| <= rtol * (|b| + max|b|)``: relative, with the tensor's scale guarding
    entries near zero (exp_avg entries cancel)."""
    scale = b.detach().abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def check_state(ours, ref, rtol=1e-6):
    for (pa, sa), (pb, sb) in zip(ours.state.items(), ref.state.items()):
        assert set(sa) == set(sb), (set(sa), set(sb))
        for k in sa:
            _close(sa[k], sb[k], rtol, f"state {k}")


def check_params(ma, mb, rtol=1e-6):
    for (n, a), (_, b) in zip(ma.named_parameters(), mb.named_parameters()):
        _close(a, b, rtol, n)


def laws_f64(tracker):
    """h(theta) of the tracker's plan in float64 (independent of the fused statistics)."""
    return Values(*evaluate_reference(tracker.compiled.plan, [t.detach() for t in tracker.tensors], fp64=True))


def drift_f64(tracker, old, a):
    """The three drift terms in float64 from snapshots ``old`` (spec "Discrete steps")."""
    plan = tracker.compiled.plan
    new = [t.detach().double() for t in tracker.tensors]
    ao = [o.double() * ai for o, ai in zip(old, a)]
    d = [n - x for n, x in zip(new, ao)]
    ev = lambda xs: Values(*evaluate_reference(plan, xs, fp64=True))  # noqa: E731
    h_old, h_a, hd = ev([o.double() for o in old]), ev(ao), ev(d)
    b = Values(*bilinear_reference(plan, ao, d, fp64=True))
    lin = tracker.compiled.linear_mask.double()
    return {"decay": h_a.map(torch.sub, h_old),
            "first": Values(2 * b.vec + lin * hd.vec, {k: 2 * g for k, g in b.grams.items()}),
            "second": Values((1 - lin) * hd.vec, hd.grams)}


def drift_f64_mixed(tracker, old, a):
    """``drift_f64`` at the exact decay factors ``a``, except at the entries whose tensors have different
    factors (a law split over param groups): those are decomposed at the kernels' fp32-rounded factors
    (``Assembly.correct`` leaves them, on the ``conserve.track`` path too)."""
    exact, rounded = drift_f64(tracker, old, a), drift_f64(tracker, old, drift_factors(a, len(a)))
    fv, fg = tracker.assembly._factors(a)[0]

    def pick(e, r, f):
        return torch.where(torch.from_numpy(np.isnan(f)).view((-1,) + (1,) * (e.dim() - 1)), r, e)
    return {k: Values(pick(exact[k].vec, rounded[k].vec, fv), {d: pick(g, rounded[k].grams[d], fg[d])
                                                             for d, g in exact[k].grams.items()}) for k in exact}


def close_values(a: Values, b: Values, rtol, scale=None):
    s = scale if scale is not None else max(b.vec.abs().max().item() if b.vec.numel() else 0.0,
                                            max([g.abs().max().item() for g in b.grams.values()] + [0.0]))
    tol = rtol * max(s, 1e-30)
    assert (a.vec.double() - b.vec.double()).abs().max().item() <= tol if a.vec.numel() else True
    for d in b.grams:
        assert (a.grams[d].double() - b.grams[d].double()).abs().max().item() <= tol, d


# ---------------------------------------------------------------- 1. parity + laws (torch twin)
PAIRS = [("adamw", "rope_half_bias"), ("adamw", "moe_interleaved_partial"), ("adam_l2_maximize", "moe_interleaved_partial"),
         ("sgd_plain_wd", "relu_layernorm_learned"), ("sgd_momentum_dampening", "rope_half_bias"),
         ("sgd_nesterov_wd", "moe_interleaved_partial")]  # every switch and every model, CPU budget


@pytest.mark.parametrize("config,model_name", PAIRS)
def test_parity_and_drift_reference_models(config, model_name):
    """20 steps, two parameter groups: params/states equal torch foreach; law values equal the float64
    plan evaluation; the drift terms equal the float64 decomposition and sum to the measured change."""
    ours_cls, torch_cls, kw = CONFIGS[config]
    m1 = lm(**MODELS[model_name])
    m2 = twin(m1)
    opt = ours_cls(groups(m1, kw), **kw, track=m1, fp64=True, every=1000, snapshot_budget=None, drift_every=1,
                   keep_last=True)
    ref = torch_cls(groups(m2, kw), **kw, foreach=True)
    fp = opt._fp
    assert fp.fused_terms > 0 and not fp.rest.norms and not fp.rest.sums  # only Gram laws left to the 2nd pass
    x = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    tr = opt.tracker
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for k in range(20):
        old = [t.detach().clone() for t in tr.tensors]
        a = [K.Hyper("adam" if ours_cls is not FusedSGD else "sgd", lr=group_of[id(t)]["lr"],
                     weight_decay=group_of[id(t)]["weight_decay"], decoupled=group_of[id(t)].get("decoupled_weight_decay", False),
                     momentum=group_of[id(t)].get("momentum", 0.0)).a_exact for t in tr.tensors]
        for model, o in ((m1, opt), (m2, ref)):
            o.zero_grad()
            lm_loss(model, x).backward()
            o.step()
        if k in (0, 19):
            exp = drift_f64(tr, old, a)
            scale = max(v.vec.abs().max().item() for v in exp.values())
            for key in ("decay", "first", "second"):
                close_values(tr.last[key], exp[key], 1e-6, scale=scale)
            close_values(tr.last["residual"], tr.last["residual"].map(torch.zeros_like), 1e-6, scale=scale)
    check_params(m1, m2)
    check_state(opt, ref)
    close_values(tr.h, laws_f64(tr), 1e-6)
    rows = tr.flush()
    assert len(rows) == 20 and all(torch.isfinite(torch.tensor(list(r.values()), dtype=torch.float64)).all() for r in rows)


def test_deep_linear_gram_and_frozen_zero_element():
    """Deep linear MLP (Gram laws only -> second pass), a frozen parameter, a zero-element parameter
    and a parameter without gradient: parity with torch and exact drift terms."""
    torch.manual_seed(0)
    m1 = MLP([5, 6, 4, 3], activation=None)
    m1.extra = nn.Parameter(torch.empty(0, 4))
    m1.unused = nn.Parameter(torch.randn(3))
    m1.layers[2].bias.requires_grad_(False)
    m2 = twin(m1)
    opt = FusedAdamW(m1.parameters(), lr=1e-2, track=m1, fp64=True, snapshot_budget=None, drift_every=1, keep_last=True)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, 5)
    tr = opt.tracker
    for _ in range(5):
        old = [t.detach().clone() for t in tr.tensors]
        for model, o in ((m1, opt), (m2, ref)):
            o.zero_grad()
            (model(x).square().mean() + model.extra.sum()).backward()
            o.step()
        exp = drift_f64(tr, old, [K.Hyper("adam", lr=1e-2, weight_decay=1e-2).a_exact] * len(old))
        for key in ("decay", "first", "second"):
            close_values(tr.last[key], exp[key], 1e-6)
    check_params(m1, m2)
    check_state(opt, ref)
    assert m1.unused not in opt.state and m1.layers[2].bias not in opt.state


# ------------------------------------------------------------------ 2. Triton (interpreter)
def _synthetic(shapes, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


@pytest.mark.parametrize("config,dtype,steps", [("adamw", torch.float32, 20), ("sgd_nesterov_wd", torch.float32, 3),
                                                ("adam_l2_maximize", torch.bfloat16, 3),
                                                ("sgd_momentum_dampening", torch.bfloat16, 3)])
def test_triton_step_parity(config, dtype, steps):
    """The Triton kernel (interpreter) vs torch foreach on fixed gradients (so only the optimizer
    math differs): fp32 to 1e-6 relative after 20 steps; bf16 within one bf16 rounding step (torch's
    CPU bf16 kernels round some fused ops differently from its GPU opmath, which the kernel follows)."""
    ours_cls, torch_cls, kw = CONFIGS[config]
    shapes = [(6, 10), (10,), (2, 3, 5)]
    torch.manual_seed(0)
    p1 = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    p2 = [nn.Parameter(p.detach().clone()) for p in p1]
    opt = ours_cls([{"params": p1[:2]}, {"params": p1[2:], "lr": kw["lr"] * 2}], **kw, backend="triton")
    ref = torch_cls([{"params": p2[:2]}, {"params": p2[2:], "lr": kw["lr"] * 2}], **kw, foreach=True)
    for gs in _synthetic(shapes, steps, dtype):
        for ps, o in ((p1, opt), (p2, ref)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            o.step()
    if dtype == torch.float32:
        for a, b in zip(p1, p2):
            _close(a, b, 1e-6, "param")
        check_state(opt, ref)
    else:
        for a, b in zip(p1, p2):
            _close(a.float(), b.float(), 2 ** -7, "param")
        check_state(opt, ref, rtol=2 ** -7)


def test_triton_stats_match_torch_twin():
    """Tracked steps on a tiny MoE LM: the Triton kernels' law values and drift terms equal the torch
    twin's (both fp64 accumulation), so the row/column statistics and their mapping agree."""
    m1 = lm(num_experts=2, top_k=1, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    m2 = twin(m1)
    x = torch.randint(0, 32, (1, 4))
    o1 = FusedAdamW(m1.parameters(), lr=1e-2, weight_decay=0.1, track=m1, fp64=True, backend="triton", keep_last=True)
    o2 = FusedAdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, track=m2, fp64=True, backend="torch", keep_last=True)
    for _ in range(2):  # same gradients on both (Adam amplifies O(1e-7) differences of tiny grads)
        o1.zero_grad()
        lm_loss(m1, x).backward()
        for a, b in zip(m1.parameters(), m2.parameters()):
            b.grad = None if a.grad is None else a.grad.clone()
        o1.step()
        o2.step()
    check_params(m1, m2)
    for key in ("measured", "decay", "first", "second"):
        close_values(o1.tracker.last[key], o2.tracker.last[key], 1e-6)
    close_values(o1.tracker.h, laws_f64(o1.tracker), 1e-6)
    assert o1.tracker.last["residual"].vec.abs().max() < 1e-9 * o1.tracker.h.vec.abs().max()


def _requests(shapes):
    """Every statistic of each shape, laid out one after the other: (requests, total slots)."""
    reqs, n = [], 0
    for s in shapes:
        B, R, C = K.matrix_shape(s)
        reqs.append(K.StatsRequest(n, n + B * R, n + 2 * B * R, n + 2 * B * R + B * C))
        n += 2 * B * R + 2 * B * C
    return reqs, n


@pytest.mark.parametrize("shapes", [[(5, 7), (13,), (2, 3, 9), (0, 4), ()],
                                    [(4, 8), (3, 5), (16,), (2, 4, 12)]])  # 16-byte aligned mixed with not
def test_stats_kernel_vs_reference(shapes):
    """Row/column statistics of the kernel == the torch twin, for every (axis, kind) on odd shapes."""
    reqs, n = _requests(shapes)
    torch.manual_seed(0)
    h = K.Hyper("sgd", lr=0.1, weight_decay=0.3)
    P = [torch.randn(s) for s in shapes]
    G = [torch.randn(s) for s in shapes]
    old = [p.clone() for p in P]
    S = torch.zeros(K.NQ, n, dtype=torch.float64)
    none = [None] * len(shapes)
    K.step_triton(h, P, G, none, none, [1.0] * len(shapes), reqs, S, interpret=True)
    S2 = torch.zeros(K.NQ, n, dtype=torch.float64)
    for o, p, r in zip(old, P, reqs):
        K.stats_reference(o, p, h.a, r, S2)
    torch.testing.assert_close(S, S2, rtol=1e-12, atol=1e-12)
    assert S[:, :reqs[0].row_l].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kernel_gpu_tiles(dtype):
    """The GPU tiles of the step kernel (``_tiles(interpret=False)``: [8, 128] fp32 / [4, 256] bf16, 256
    rows per program, so several row and column blocks and a masked tail) under the interpreter: the
    update equals the torch twin and the row/column statistics equal ``stats_reference``."""
    shapes = [(300, 260), (2, 40, 256), (260,)]
    CB, BR, RB = step_runner._tiles(260, torch.empty(0, dtype=dtype).element_size(), interpret=False)
    assert (CB, BR, RB) == ((128, 8, 256) if dtype == torch.float32 else (256, 4, 256))
    reqs, n = [], 0
    for sh in shapes:
        B, R, C = K.matrix_shape(sh)
        reqs.append(K.StatsRequest(n, n + B * R, n + 2 * B * R, n + 2 * B * R + B * C))
        n += 2 * B * R + 2 * B * C
    g = torch.Generator().manual_seed(3)
    h = K.Hyper("adam", lr=1e-2, weight_decay=0.1)
    P = [torch.randn(sh, generator=g).to(dtype) for sh in shapes]
    G = [torch.randn(sh, generator=g).to(dtype) for sh in shapes]
    M = [torch.randn(sh, generator=g).to(dtype) * 0.1 for sh in shapes]
    V = [torch.rand(sh, generator=g).to(dtype) * 0.1 for sh in shapes]
    P2, M2, V2 = ([t.clone() for t in ts] for ts in (P, M, V))
    old = [p.clone() for p in P]
    S = torch.zeros(K.NQ, n, dtype=torch.float64)
    K.step_triton(h, P, G, M, V, [3.0] * 3, reqs, S, interpret=False)
    K.step_reference(h, P2, G, M2, V2, [3.0] * 3)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(P + M + V, P2 + M2 + V2):
        _close(a.float(), b.float(), tol, "param/state")
    S2 = torch.zeros(K.NQ, n, dtype=torch.float64)
    for o, p, r in zip(old, P, reqs):
        K.stats_reference(o, p, h.a, r, S2)
    torch.testing.assert_close(S, S2, rtol=1e-12, atol=1e-12)


def test_launch_split_by_alignment():
    """Tensors whose offsets or column count are not multiples of one 16-byte vector run in a second
    launch with ALIGN=1; together the launches cover every program exactly once."""
    shapes = [(4, 8), (3, 5), (16,), (2, 4, 12)]
    lay = step_runner._layout(shapes, [K.StatsRequest()] * 4, [], torch.device("cpu"), interpret=True)
    table = lay.table_static.copy()
    table[:, 0:4] = [[0, 64, 128, 192], [256, 300, 320, 340], [400, 416, 432, 448], [500, 600, 700, 801]]
    base = torch.zeros(4)
    runs = step_runner._launches(lay, table, base, 4)
    assert [al for _, al in runs] == [4, 1]
    seen = np.concatenate([p.numpy() for p, _ in runs])
    assert sorted(map(tuple, seen)) == sorted(map(tuple, lay.progs_host))
    assert set(runs[1][0][:, 0].tolist()) == {1, 3}  # C = 5; an offset of 801
    table[1, 0:4] = table[3, 0:4] = [0, 4, 8, 12]
    lay2 = step_runner._layout([(4, 8), (16,)], [K.StatsRequest()] * 2, [], torch.device("cpu"), interpret=True)
    assert [al for _, al in step_runner._launches(lay2, table[[0, 2]], base, 4)] == [4]


# --------------------------------------------------------------------------------- 3. interop
@pytest.mark.parametrize("ours_cls,torch_cls,kw", [(FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                                   (FusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9))])
def test_state_dict_round_trip(ours_cls, torch_cls, kw):
    """ours -> torch -> ours: each leg continues exactly as an uninterrupted run."""
    m = lm()
    x = torch.randint(0, 32, (2, 6))
    runs = {name: twin(m) for name in ("straight", "hop")}
    straight = ours_cls(runs["straight"].parameters(), **kw, track=runs["straight"])
    hop = ours_cls(runs["hop"].parameters(), **kw, track=runs["hop"])

    def train(model, o, n):
        for _ in range(n):
            o.zero_grad()
            lm_loss(model, x).backward()
            o.step()

    train(runs["straight"], straight, 9)
    train(runs["hop"], hop, 3)
    tor = torch_cls(runs["hop"].parameters(), **kw, foreach=True)
    tor.load_state_dict(hop.state_dict())  # the "conserve" entry is ignored by torch
    train(runs["hop"], tor, 3)
    back = ours_cls(runs["hop"].parameters(), **kw, track=runs["hop"])
    back.load_state_dict(tor.state_dict())
    train(runs["hop"], back, 3)
    check_params(runs["straight"], runs["hop"])
    check_state(straight, back)
    sd = straight.state_dict()
    assert "conserve" in sd and sd["conserve"]["step"] == 9
    again = ours_cls(runs["straight"].parameters(), **kw, track=runs["straight"])
    again.load_state_dict(sd)
    assert again.tracker.step_count == 9


def test_grad_scaler_skips_inf_step():
    """GradScaler: grads are unscaled, an injected inf skips step() -- no update, no law row -- and the
    run matches torch AdamW driven by the same scaler sequence."""
    m1 = lm()
    m2 = twin(m1)
    x = torch.randint(0, 32, (2, 6))
    o1 = FusedAdamW(m1.parameters(), lr=1e-2, track=m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
    s1, s2 = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    for k in range(4):
        for model, o, s in ((m1, o1, s1), (m2, o2, s2)):
            o.zero_grad()
            s.scale(lm_loss(model, x)).backward()
            if k == 2:
                model.lm_head.weight.grad[0, 0] = float("inf")
                before = [p.detach().clone() for p in model.parameters()]
            s.step(o)
            s.update()
            if k == 2:
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        if k == 2:
            assert o1.tracker.step_count == 2 and s1.get_scale() == 512.0
    assert o1.tracker.step_count == 3
    check_params(m1, m2)
    check_state(o1, o2)


def test_accumulation_scheduler_add_param_group():
    """Gradient accumulation (laws once per optimizer step), an LR scheduler (the decay factor follows
    the scheduled lr), and a parameter group added mid-run: parity with torch, exact drift terms."""
    m1 = lm()
    m2 = twin(m1)
    late1 = [p for n, p in m1.named_parameters() if n.startswith("layers.1.mlp")]
    late2 = [p for n, p in m2.named_parameters() if n.startswith("layers.1.mlp")]
    first1 = [p for p in m1.parameters() if all(p is not q for q in late1)]
    first2 = [p for p in m2.parameters() if all(p is not q for q in late2)]
    o1 = FusedAdamW(first1, lr=1e-2, weight_decay=0.1, track=m1, fp64=True, snapshot_budget=None, drift_every=1,
                    keep_last=True)
    o2 = torch.optim.AdamW(first2, lr=1e-2, weight_decay=0.1, foreach=True)
    sch = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (o1, o2)]
    x = torch.randint(0, 32, (4, 6))
    tr = o1.tracker
    for k in range(6):
        if k == 3:
            o1.add_param_group({"params": late1, "lr": 3e-3, "weight_decay": 0.0})
            o2.add_param_group({"params": late2, "lr": 3e-3, "weight_decay": 0.0})
        group_of = {id(p): g for g in o1.param_groups for p in g["params"]}
        a = [K.Hyper("adam", lr=group_of[id(t)]["lr"], weight_decay=group_of[id(t)]["weight_decay"]).a_exact
             if id(t) in group_of else 1.0 for t in tr.tensors]
        old = [t.detach().clone() for t in tr.tensors]
        for model, o, s in ((m1, o1, sch[0]), (m2, o2, sch[1])):
            o.zero_grad()
            for micro in (x[:2], x[2:]):
                (lm_loss(model, micro) / 2).backward()
            o.step()
            s.step()
        exp = drift_f64_mixed(tr, old, a)
        scale = max(v.vec.abs().max().item() for v in exp.values())
        for key in ("decay", "first", "second"):
            close_values(tr.last[key], exp[key], 1e-6, scale=scale)
    assert tr.step_count == 6
    check_params(m1, m2)
    check_state(o1, o2)


def test_tied_parameters_processed_once():
    """Tied embeddings (one tensor, two modules) and a parameter listed twice are stepped once."""
    m1 = lm(tie_word_embeddings=True)
    m2 = twin(m1)
    ps1 = list(m1.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate; we process it once
        o1 = FusedAdamW([{"params": ps1 + [ps1[0]]}], lr=1e-2, track=m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
    x = torch.randint(0, 32, (2, 6))
    for _ in range(3):
        for model, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            lm_loss(model, x).backward()
            o.step()
    check_params(m1, m2)
    assert float(o1.state[ps1[0]]["step"]) == 3.0


def test_refused_options_and_tensor_lr():
    p = [nn.Parameter(torch.randn(3, 4))]
    for kw in (dict(amsgrad=True), dict(capturable=True), dict(differentiable=True), dict(fused=True)):
        with pytest.raises(ValueError, match=list(kw)[0]):
            FusedAdamW(p, **kw)
    with pytest.raises(ValueError, match="fused"):
        FusedSGD(p, fused=True)
    opt = FusedAdamW(p)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2))], "amsgrad": True})
    with pytest.raises(TypeError, match="tracking options"):
        FusedAdamW(p, track=nn.Linear(2, 2), evry=3)
    with pytest.raises(ValueError, match="named_params"):
        FusedAdamW(p, laws=[])
    # tensor lr (torch: foreach=False path supports it)
    q1 = [nn.Parameter(torch.randn(4, 5))]
    q2 = [nn.Parameter(q1[0].detach().clone())]
    o1 = FusedAdamW(q1, lr=torch.tensor(0.01), weight_decay=0.1)
    o2 = torch.optim.AdamW(q2, lr=torch.tensor(0.01), weight_decay=0.1, foreach=False)
    for gs in _synthetic([(4, 5)], 5, torch.float32):
        for q, o in ((q1, o1), (q2, o2)):
            q[0].grad = gs[0].clone()
            o.step()
    _close(q1[0], q2[0], 1e-6, "param")


@pytest.mark.parametrize("cls,kw", [(FusedAdamW, {"amsgrad": True}), (FusedSGD, {"differentiable": True})])
def test_a_refused_param_group_is_not_added(cls, kw):
    """add_param_group with a refused option raises before the group is added: the optimizer (and its
    tracker) keeps stepping its groups (the group was appended first, so every later step raised)."""
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    extra = nn.Parameter(torch.randn(2))
    opt = cls(m.parameters(), lr=1e-2, track=m, every=1)
    with pytest.raises(ValueError, match=list(kw)[0]):
        opt.add_param_group({"params": [extra], **kw})
    assert len(opt.param_groups) == 1 and all(p is not extra for p in opt.param_groups[0]["params"])
    m(torch.randn(5, 3)).square().sum().backward()
    opt.step()
    assert opt.tracker.step_count == 1


def test_a_refused_gradient_in_a_later_group_changes_nothing():
    """A complex parameter in the second group is refused before the first group's state is made or its
    step counted (it was refused while collecting that group, after the first group's)."""
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3, dtype=torch.complex64))
    a.grad, b.grad = torch.randn(3), torch.randn(3, dtype=torch.complex64)
    opt = FusedAdamW([{"params": [a]}, {"params": [b]}])
    a0 = a.detach().clone()
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()
    assert not opt.state and torch.equal(a.detach(), a0)


@pytest.mark.parametrize("tracked", [False, True])
def test_adam_refuses_a_gradient_of_another_dtype_sgd_steps_it(tracked):
    """A bfloat16 weight with a float32 gradient (torch's ``grad_dtype``): FusedAdamW raises one line
    naming the fix before anything is stepped (torch.optim.AdamW fails inside ``lerp``); FusedSGD steps
    it as torch.optim.SGD does (same bits), its momentum buffer in the gradient's dtype."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("torch without grad_dtype")
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(4, 6, generator=g).to(torch.bfloat16), torch.randn(4, 6, generator=g)

    def param():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 4, bias=False), nn.ReLU(), nn.Linear(4, 6, bias=False)).to(torch.bfloat16)
        m[0].weight.data.copy_(w0)
        for p in m.parameters():
            p.grad_dtype = torch.float32
            p.grad = torch.ones_like(p, dtype=torch.float32)
        m[0].weight.grad = grad.clone()
        return m

    m = param()
    m[2].weight.grad_dtype = None  # the second group's gradient is fine: nothing of it is stepped either
    m[2].weight.grad = torch.ones_like(m[2].weight)
    opt = FusedAdamW([{"params": [m[2].weight]}, {"params": [m[0].weight]}], lr=1e-2,
                     **(dict(track=m) if tracked else {}))
    w2 = m[2].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"grad_dtype = None"):
        opt.step()
    assert torch.equal(m[0].weight.detach(), w0) and torch.equal(m[2].weight.detach(), w2) and not opt.state
    mf, mt = param(), param()
    of = FusedSGD(mf.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, **(dict(track=mf) if tracked else {}))
    ot = torch.optim.SGD(mt.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        of.step()
        ot.step()
    check_params(mf, mt, rtol=0)
    check_state(of, ot, rtol=0)


def test_bf16_parameters_torch_twin():
    """bf16 parameters on the CPU path: identical to torch foreach (same ops, same rounding)."""
    m1 = lm().to(torch.bfloat16)
    m2 = twin(m1)
    o1 = FusedAdamW(m1.parameters(), lr=1e-2, weight_decay=0.1, track=m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    x = torch.randint(0, 32, (2, 6))
    for _ in range(5):
        for model, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            lm_loss(model, x).backward()
            o.step()
    check_params(m1, m2, rtol=0)
    check_state(o1, o2, rtol=0)


def test_compiled_model():
    """torch.compile'd model: the fused optimizer tracks the original module's parameters."""
    m1 = lm()
    m2 = twin(m1)
    c1 = torch.compile(m1, backend="eager")
    o1 = FusedAdamW(c1.parameters(), lr=1e-2, track=c1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
    x = torch.randint(0, 32, (2, 6))
    for _ in range(3):
        for model, o in ((c1, o1), (m2, o2)):
            o.zero_grad()
            lm_loss(model, x).backward()
            o.step()
    check_params(m1, m2)
    assert o1.tracker.step_count == 3


# ----------------------------------------------------------- 4. any other optimizer (wrapper)
class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), written here as a user-defined optimizer."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_((m * b1 + p.grad * (1 - b1)).sign(), alpha=-g["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_user_defined_optimizer_through_track():
    """Lion through conserve.track: the drift terms equal the float64 decomposition (a = 1 for an
    unknown optimizer, so the decoupled decay sits in Delta) and sum to the measured change."""
    m = lm()
    opt = conserve.track(Lion(m.parameters(), lr=1e-3, weight_decay=0.1), m, fp64=True, snapshot_budget=None, drift_every=1,
                         keep_last=True)
    tr = opt.tracker
    x = torch.randint(0, 32, (2, 6))
    for _ in range(3):
        old = [t.detach().clone() for t in tr.tensors]
        opt.zero_grad()
        lm_loss(m, x).backward()
        opt.step()
        exp = drift_f64(tr, old, [1.0] * len(old))
        scale = max(v.vec.abs().max().item() for v in exp.values())
        for key in ("decay", "first", "second"):
            close_values(tr.last[key], exp[key], 1e-6, scale=scale)
        close_values(tr.last["residual"], tr.last["residual"].map(torch.zeros_like), 1e-6, scale=scale)
        assert tr.last["first"].vec.abs().max() > 1e-3 * scale  # sign steps: a real first-order drift


def test_forced_triton_on_cpu_without_interpreter_says_how_to_fix():
    """``backend='triton'`` on CPU tensors without TRITON_INTERPRET: a RuntimeError naming the fix (not
    triton's driver error), for the untracked step as for the law kernels."""
    import os
    import subprocess
    import sys

    code = ("import torch, conserve.optim as O\n"
            "p = torch.nn.Parameter(torch.randn(4, 8)); p.grad = torch.randn(4, 8)\n"
            "O.FusedSGD([p], lr=0.1, backend='triton').step()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CONSERVE_BACKEND")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr and "backend='torch'" in r.stderr


def test_finish_compact_equals_padded_finish():
    g = torch.Generator().manual_seed(0)
    stats = torch.randn(K.NQ, 50, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 50, (20, 4), generator=g)
    coef = torch.randn(K.NQ, 20, 4, generator=g, dtype=torch.float64) * (torch.rand(1, 20, 4, generator=g) > 0.4)
    want = K.finish_reference(stats, idx, coef)
    torch.testing.assert_close(K.finish_compact(stats, *K.compact_terms(idx, coef), 20), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused_cls,torch_cls,kw", [
    (FusedSGD, torch.optim.SGD, dict(lr=0.05, weight_decay=0.01)),
    (FusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))])
def test_drift_terms_at_the_exact_decay_factor_as_track(fused_cls, torch_cls, kw):
    """The fused step forms Delta with ``a = 1 - lr wd`` rounded to fp32 (``Hyper.a``); its drift terms
    are those of the exact ``a`` (``Hyper.a_exact``), as ``conserve.track``'s: float64 laws, the same
    decay / first / second entry by entry, and SGD's first-order term 0 (Noether) -- with the fp32 ``a``
    it was ``2 (a - a_f) a_f h``, 5e-5 of the decay."""
    x = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    last = {}
    for name in ("fused", "track"):
        m = lm().double()
        opts = dict(every=100, drift_every=1, snapshot_budget=None, keep_last=True, fp64=True)
        o = (fused_cls(m.parameters(), **kw, track=m, **opts) if name == "fused"
             else conserve.track(torch_cls(m.parameters(), **kw), m, **opts))
        for _ in range(3):
            o.zero_grad()
            lm_loss(m, x).backward()
            o.step()
        last[name] = o.tracker.last
        o.close()
    for key in ("decay", "first", "second"):
        close_values(last["fused"][key], last["track"][key], 1e-9, scale=last["track"]["decay"].vec.abs().max().item())
    if fused_cls is FusedSGD:
        f = last["fused"]["first"]
        assert f.vec.abs().max() <= 1e-9 * last["fused"]["decay"].vec.abs().max()
        for d, g in f.grams.items():
            assert g.abs().max() <= 1e-9 * last["fused"]["decay"].grams[d].abs().max()


@pytest.mark.parametrize("cls, kw", [(FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
                                     (FusedSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2))])
def test_compact_drift_steps_equal_the_full_layout_bit_for_bit(cls, kw):
    """A 50k-parameter ViT (head_dim 16 = hidden / 4: its Gram entries are 10x its vec entries) takes its
    budgeted drift steps in the compact layout of the step's entries (``_compact_pays``); the rows, the
    cumulative totals and the last step's terms are those of the full-layout path, bit for bit, and a
    drift step holds less.  ``conserve run``'s default model keeps the full layout (it would not pay)."""
    import math
    from bench.track_overhead import LiveBytes
    from conserve.models import ViT, ViTConfig

    def run(compact):
        torch.manual_seed(0)
        m = ViT(ViTConfig())
        sink = conserve.MemorySink()
        o = cls(m.parameters(), **kw, track=m, every=5, sinks=[sink], drift_every=2, cumulative=True, keep_last=True)
        assert o._sampler.compact and len(o._sampler.groups) > 2  # (the decision, then forced for the reference)
        o._sampler.compact = compact
        g = torch.Generator().manual_seed(3)
        peak = 0
        for k in range(2 * 2 * len(o._sampler.groups)):  # every group decomposed twice
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            with LiveBytes() as mode:
                o.step()
            peak = max(peak, mode.peak)
        out = (sink.records, o.tracker.last, o.tracker.totals())
        o.close()
        return out, peak

    (rows, last, tot), peak = run(True)
    (rows0, last0, tot0), peak0 = run(False)
    same = lambda x, y: x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))  # noqa: E731
    assert len(rows) == len(rows0) and all(r.keys() == q.keys() and all(same(r[k], q[k]) for k in r)
                                           for r, q in zip(rows, rows0))
    assert any(not math.isnan(r[k]) for r in rows for k in r if k.startswith("drift/qk/"))
    for t in last0:
        assert torch.equal(last[t].vec, last0[t].vec) and all(torch.equal(last[t].grams[d], g) for d, g in last0[t].grams.items())
    for fam, v in tot0.items():
        for k, x in v.items():
            y = tot[fam][k]
            assert (torch.equal(x, y) or bool(((x == y) | (x.isnan() & y.isnan())).all())) if torch.is_tensor(x) \
                else str(x) == str(y), (fam, k)
    assert peak < peak0 - 0.1 * sum(p.numel() * 4 for p in ViT(ViTConfig()).parameters())
    m = DecoderLM(LMConfig(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64))
    assert not cls(m.parameters(), **kw, track=m)._sampler.compact
