"""Tracking engine v2 (issue 12): drift cadence, snapshot budget, decay from the stored values, no
weight-sized buffer between drift steps, torch.compile.

Every path is compared with the decomposition of today's implementation (every law on every step,
whole tensors copied): the same eps every step and the same drift terms on the sampled steps/laws."""
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve import kernels
from conserve.models import DecoderLM, LMConfig
from conserve.optim import FusedAdamW, FusedSGD
from conserve.tracking.values import Values, abs_plan as _abs_plan
from conserve.tracking.drift import Sampler

CFG = dict(vocab_size=32, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
           num_hidden_layers=3, position="rope", nope_layers=(1,), num_experts=2, top_k=1, moe_layers=(2,),
           attention_bias=True)
TERMS3 = ("decay", "first", "second")


def _model(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(**{**CFG, **kw})).to(dtype)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (2, 8), generator=g) for _ in range(n)]


def _loss(m, x):
    out = m(x[:, :-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))


def _run(m, opt, xs, hook=None):
    """Steps over ``xs``; per step a copy of (last row, tracker.last) for comparison."""
    assert opt.tracker.keep_last  # the comparisons read tracker.last
    out = []
    for x in xs:
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        tr = opt.tracker
        out.append((tr._rows[-1].clone(), {k: v.clone() for k, v in tr.last.items()}))
        tr.last = {}
    return out


def _entries(v: Values, mask):
    parts = [v.vec[mask.vec]] + [g[mask.grams[d]].reshape(-1) for d, g in v.grams.items()]
    return torch.cat(parts).double()


def _close(got, want, rtol, scale=None):
    """``|got - want| <= rtol * scale``; ``scale``: the largest term of the step (SGD's first-order term
    is rounding noise of that size: compared on it, not on its own size)."""
    if scale is None:
        scale = want.abs().max().item() if want.numel() else 0.0
    assert (got - want).abs().max().item() <= rtol * max(scale, 1e-30) if got.numel() else True


OPTS = {"sgd_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "momentum": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
        # weight decay on the matrices only: gain laws mix decay factors (the kernel's per-term decay)
        "adamw_groups": lambda ps: torch.optim.AdamW(_wd_groups(ps), lr=1e-2)}


def _wd_groups(ps):
    ps = list(ps)
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("fp64", [False, True], ids=["fp32", "fp64"])
@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("every,budget", [(1, 0.05), (3, None), (2, 0.2)])
def test_track_cadence_and_budget_match_full_decomposition(opt_name, every, budget, fp64):
    """eps equal every step; on each drift step the decomposed entries carry the full decomposition's
    terms (fp32: 1e-6 of the term's scale; fp64: rounding); the other rows carry NaN drift columns."""
    xs = _batches(7)
    m_ref, m = _model(), _model()
    ref = conserve.track(OPTS[opt_name](m_ref.parameters()), m_ref, every=100, fp64=fp64, snapshot_budget=None,
                         drift_every=1, keep_last=True)
    opt = conserve.track(OPTS[opt_name](m.parameters()), m, every=100, fp64=fp64, drift_every=every,
                         snapshot_budget=budget, keep_last=True)
    rows_ref, rows = _run(m_ref, ref, xs), _run(m, opt, xs)
    tr = opt.tracker
    n_eps = len(tr.families) + len(tr.groups)
    rtol = 1e-12 if fp64 else 1e-6
    groups = len(tr.sampler.groups)
    covered = None
    for k, ((row_r, last_r), (row, last)) in enumerate(zip(rows_ref, rows)):
        torch.testing.assert_close(row[:n_eps], row_r[:n_eps], rtol=1e-6, atol=0)  # eps: same values
        if k % every:
            assert not last and torch.isnan(row[n_eps:]).all()
            continue
        mask = tr.sampler.mask(k // every)
        covered = mask.vec.clone() if covered is None else covered | mask.vec
        scale = max(_entries(last_r[t], mask).abs().max().item() for t in ("measured",) + TERMS3)
        for t in ("measured", "first", "second"):
            _close(_entries(last[t], mask), _entries(last_r[t], mask), rtol, scale)
        _close(_entries(last["decay"], mask), _entries(last_r["decay"], mask), rtol, scale)
        # the identity holds to the rounding of the stored law values
        h_scale = _entries(tr.h, mask).abs().max().item() if k == len(xs) - 1 else 1.0 + scale
        res = _entries(last["residual"], mask).abs().max().item()
        assert res <= (1e-13 if fp64 else 1e-6) * max(h_scale, _entries(last_r["measured"], mask).abs().max().item(), 1.0)
        # entries not decomposed this step carry no term
        for t in TERMS3:
            assert (last[t].vec[~mask.vec] == 0).all()
    if budget is not None and groups * every <= len(xs):
        assert covered.all()
    assert tr.sampled_steps.max().item() <= -(-len(xs) // every)


def test_sampler_groups_fit_the_budget_and_cover_every_entry_once():
    m = _model(num_hidden_layers=4, hidden_size=32)
    tr = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, snapshot_budget=0.05).tracker
    s = tr.sampler
    cap = 0.05 * s.tracked_bytes
    seen_v = torch.zeros(tr.compiled.plan.vec_size, dtype=torch.long)
    seen_g = {d: torch.zeros(n, dtype=torch.long) for d, n in tr.compiled.plan.gram_slots.items()}
    for j in range(len(s.groups)):
        snap = s.snapshot(j, tr.tensors)
        assert snap.bytes() <= cap or len(s.groups[j]) == 1  # a unit bigger than the budget goes alone
        seen_v += snap.mask.vec.long()
        for d in seen_g:
            seen_g[d] += snap.mask.grams[d].long()
    assert (seen_v == 1).all() and all((g == 1).all() for g in seen_g.values())


def test_decay_has_no_cancellation_at_a_near_one():
    """a = 1 - 1e-3 (SGD, lr 0.01, wd 0.1), fp32: the decay is (a^2-1) h(theta_k) within fp32 rounding of
    h (|a^2-1| times the fp32 error of the stored h), where h(a theta) - h(theta) in fp32 cancels."""
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.01, weight_decay=0.1), m, snapshot_budget=None,
                         drift_every=1, keep_last=True)
    tr = opt.tracker
    a = 1 - 0.01 * 0.1
    plan = tr.compiled.plan
    for x in _batches(3):
        theta = [t.detach().clone() for t in tr.tensors]
        h64 = Values(*kernels.evaluate_reference(plan, theta, fp64=True))
        h32 = tr.h.clone()
        old = [u - v for u, v in zip(kernels.evaluate_reference(plan, [t * a for t in theta])[:1],
                                    kernels.evaluate_reference(plan, theta)[:1])][0]  # the old way, fp32
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        lin = tr.compiled.linear_mask
        fac = torch.where(lin, torch.tensor(a - 1.0, dtype=torch.float64), torch.tensor(a * a - 1.0, dtype=torch.float64))
        exact = fac * h64.vec
        err = (tr.last["decay"].vec.double() - exact).abs()
        assert (err <= fac.abs() * (1.01 * (h32.vec.double() - h64.vec).abs() + 2e-7 * h64.vec.abs()) + 1e-30).all()
        assert (old.double() - exact).abs().max() > 30 * err.max()  # the cancellation this removes
        for D, g in tr.last["decay"].grams.items():
            bound = abs(a * a - 1) * (1.01 * (h32.grams[D].double() - h64.grams[D]).abs() + 2e-7 * h64.grams[D].abs())
            assert ((g.double() - (a * a - 1) * h64.grams[D]).abs() <= bound + 1e-30).all()


def _owned_tensors(obj, params, seen=None, depth=0):
    """Tensors reachable from ``obj``'s attributes (lists, dicts, plain objects), not the parameters."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [] if obj.untyped_storage().data_ptr() in params else [obj]
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or callable(obj) and not hasattr(obj, "__dict__"):
        return []
    items = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        items = [getattr(obj, n, None) for n in names if n not in ("params", "tensors", "optimizer", "param_groups",
                                                                     "state", "sinks", "monitors")]
    out = []
    for it in items:
        out += _owned_tensors(it, params, seen, depth + 1)
    return out


@pytest.mark.parametrize("kind", ["track", "fused_adamw", "fused_sgd"])
def test_no_weight_sized_buffer_between_drift_steps(kind):
    m = _model(hidden_size=32, intermediate_size=64)
    ps = list(m.parameters())
    if kind == "track":
        opt = conserve.track(torch.optim.AdamW(ps, lr=1e-3), m, drift_every=2)
        owner = opt.tracker
    elif kind == "fused_adamw":
        opt = FusedAdamW(ps, lr=1e-3, track=m, drift_every=2)
        owner = opt
    else:
        opt = FusedSGD(ps, lr=1e-2, momentum=0.9, track=m, drift_every=2)
        owner = opt
    params = {p.untyped_storage().data_ptr() for p in ps}
    state = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
    shapes = {tuple(t.shape) for t in opt.tracker.tensors if t.dim() >= 2}
    half = max(t.numel() for t in opt.tracker.tensors) // 2  # law values / stats of this model are smaller
    assert opt.tracker.compiled.plan.vec_size < half
    for k, x in enumerate(_batches(4)):
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        state |= {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
        owned = [t for t in _owned_tensors(owner, params | state) if t.untyped_storage().data_ptr() not in state]
        assert opt.tracker._snap is None
        big = [tuple(t.shape) for t in owned if t.is_floating_point() and (tuple(t.shape) in shapes or t.numel() >= half)]
        assert not big, f"step {k + 1}: the tracker holds weight-sized tensors {big}"


def test_tracker_arguments_are_checked():
    m = _model()
    with pytest.raises(ValueError, match="drift_every"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, drift_every=0)
    with pytest.raises(ValueError, match="snapshot_budget"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, snapshot_budget=0)
    with pytest.raises(ValueError, match="snapshot_budget"):
        Sampler(kernels.Plan(), [torch.zeros(3)], -1.0, "cpu")


@pytest.mark.parametrize("budget", [None, 0.1])
def test_fused_cadence_matches_full_decomposition(budget):
    """FusedAdamW with drift_every=2 (and a snapshot budget): eps every step, terms on drift steps
    equal a full FusedAdamW run on the decomposed entries."""
    xs = _batches(5)
    m_ref, m = _model(), _model()
    ref = FusedAdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1, track=m_ref, every=100, snapshot_budget=None,
                     drift_every=1, keep_last=True)
    opt = FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, every=100, drift_every=2,
                     snapshot_budget=budget, keep_last=True)
    rows_ref, rows = _run(m_ref, ref, xs), _run(m, opt, xs)
    tr = opt.tracker
    n_eps = len(tr.families) + len(tr.groups)
    for k, ((row_r, last_r), (row, last)) in enumerate(zip(rows_ref, rows)):
        torch.testing.assert_close(row[:n_eps], row_r[:n_eps], rtol=1e-6, atol=0)
        if k % 2:
            assert not last and torch.isnan(row[n_eps:]).all()
            continue
        mask = opt._mask(opt._sampler.snapshot(k // 2, tr.tensors) if opt._fp.rest is not None else None)
        scale = max(_entries(last_r[t], mask).abs().max().item() for t in ("measured",) + TERMS3)
        for t in ("measured", "decay", "first", "second"):
            _close(_entries(last[t], mask), _entries(last_r[t], mask), 1e-6, scale)
    for p, q in zip(m.parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ torch.compile
def _graphs_over_20_steps(make):
    """(graphs compiled after 3 steps, after 20 steps, optimizer, model): tensor lr + OneCycleLR."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    m = _model(hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_experts=0, moe_layers=None)
    opt = make(m, torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=30)

    @torch.compile(backend="eager")
    def step():
        opt.step()

    torch._dynamo.reset()
    counters.clear()
    x = _batches(1)[0]
    early = None
    for k in range(20):
        opt.zero_grad()
        _loss(m, x).backward()
        step()
        sched.step()
        if k == 2:
            early = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return early, graphs, opt, m


def test_compiled_tracked_step_does_not_recompile():
    """Tensor lr + OneCycleLR, 20 compiled steps: nothing recompiles after the first steps (no guard on
    tracker state such as step_count, pending rows or the drift schedule), and conserve.track compiles
    at most one graph more than the untracked optimizer (torch's ``profile_hook_step`` wrapper code is
    shared by the TrackedOptimizer and the inner optimizer: one more cache entry); rows as eager."""
    _, plain, _, _ = _graphs_over_20_steps(lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        early, tracked, opt, m = _graphs_over_20_steps(
            lambda m, lr: conserve.track(torch.optim.AdamW(m.parameters(), lr=lr), m, every=100, drift_every=3))
    assert not [w for w in seen if "_getframe" in str(w.message)]  # no dynamo warning from our wrapper
    assert tracked == early and tracked <= plain + 1, (early, tracked, plain)
    assert opt.tracker.step_count == 20
    rows = opt.tracker.flush()
    assert len(rows) == 20 and np.isfinite(rows[-1]["eps/vo"])
    early, fused, fopt, _ = _graphs_over_20_steps(lambda m, lr: FusedAdamW(m.parameters(), lr=lr, track=m, every=100))
    assert fused == early and fused <= 1 and fopt.tracker.step_count == 20


@pytest.mark.parametrize("tracked", [False, True])
def test_compiled_fused_step_matches_eager(tracked):
    """torch.compile(FusedAdamW.step) gives the eager weights (it runs eagerly: torch.compiler.disable)."""
    ms = [_model(), _model()]
    opts = [FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **({"track": m, "every": 100} if tracked else {}))
            for m in ms]
    compiled = torch.compile(opts[1].step, backend="eager")
    for x in _batches(4):
        for m, o, f in zip(ms, opts, (opts[0].step, compiled)):
            o.zero_grad()
            _loss(m, x).backward()
            f()
    for p, q in zip(ms[0].parameters(), ms[1].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=0)
    if tracked:
        torch.testing.assert_close(torch.stack(opts[1].tracker._rows), torch.stack(opts[0].tracker._rows),
                                   rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", ["track", "fused"])
def test_triton_drift_pass_on_sampled_views(kind):
    """The sub-plans over copied views (snapshot budget) through the Triton DRIFT pass (interpreter)
    give the torch twin's terms."""
    xs = _batches(2)
    ms = [_model(hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_experts=0, moe_layers=None)
          for _ in range(2)]
    opts = []
    for m, backend in zip(ms, ("torch", "triton")):
        if kind == "track":
            opts.append(conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=100,
                                       snapshot_budget=0.3, backend=backend, drift_every=1, keep_last=True))
        else:
            opts.append(FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, every=100, drift_every=1,
                                   snapshot_budget=0.3, backend=backend, keep_last=True))
    runs = [_run(m, o, xs) for m, o in zip(ms, opts)]
    n_eps = len(opts[0].tracker.families) + len(opts[0].tracker.groups)
    for (row_t, last_t), (row_g, last_g) in zip(*runs):
        # fused: the Triton step rounds like torch's foreach ops up to fp32 contraction, so the weights
        # (and eps, relative to small h_0 entries) differ by more than the law kernels do
        rtol = 1e-5 if kind == "track" else 1e-3
        torch.testing.assert_close(row_g[:n_eps], row_t[:n_eps], rtol=rtol, atol=1e-9)
        for t in TERMS3:
            scale = max(last_t[k].vec.abs().max().item() for k in TERMS3)
            _close(last_g[t].vec.double(), last_t[t].vec.double(), rtol, scale)
            for d, g in last_t[t].grams.items():
                _close(last_g[t].grams[d].double(), g.double(), rtol, max(scale, g.abs().max().item()))


# ------------------------------------------------------------------------- what the tracker keeps
def _own_attrs(opt):
    """An optimizer's own attributes (``_owned_tensors`` does not enter optimizers), not its state."""
    return {k: v for k, v in vars(opt).items() if k not in ("state", "param_groups", "defaults")}


def _law_sized(owner, tr, params):
    """The float tensors ``owner`` holds that have the shape of the law values (vec, or one D's Grams)."""
    shapes = {tuple(tr.h0.vec.shape)} | {tuple(g.shape) for g in tr.h0.grams.values()}
    return [t for t in _owned_tensors(owner, params) if t.is_floating_point() and tuple(t.shape) in shapes]


@pytest.mark.parametrize("kind", ["track", "fused_adamw"])
def test_keep_last_off_holds_no_term_values(kind):
    """Without keep_last the tracker holds h0 and h (one law-sized tensor per layout each; sampled drift:
    no cumulative sums) between steps and nothing else law-sized; keep_last adds the five step terms; the
    rows and totals are the same bit for bit; reading ``last`` without keep_last raises, naming the fix."""
    runs = {}
    for keep in (False, True):
        m = _model()
        if kind == "track":
            opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=100,
                                 keep_last=keep, snapshot_budget=0.2)
            owner = opt.tracker
        else:
            opt = FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, every=100, drift_every=2,
                             keep_last=keep, snapshot_budget=0.2)
            owner = _own_attrs(opt)
        tr = opt.tracker
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        layouts = 1 + len(tr.h0.grams)
        for k, x in enumerate(_batches(3)):
            opt.zero_grad()
            _loss(m, x).backward()
            opt.step()
            state = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
            held = _law_sized(owner, tr, params | state)
            assert len(held) == (2 + (5 if keep else 0)) * layouts, (k, [tuple(t.shape) for t in held])
        if keep:
            assert set(tr.last) == {"measured", "decay", "first", "second", "residual"}
        else:
            assert tr.last == {} and not tr.last
            with pytest.raises(KeyError, match="keep_last=True"):
                tr.last["first"]
        runs[keep] = (tr.flush(), tr.totals())
    for a, b in [(x, y) for x, y in zip(runs[False][0], runs[True][0])] + [(runs[False][1][f], runs[True][1][f])
                                                                           for f in runs[False][1]]:
        assert a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)  # NaN == NaN


def test_cumulative_summed_in_place_equals_the_sum_of_the_step_terms():
    """``cumulative`` is updated in place (same storages every step) and equals, bit for bit, the
    out-of-place sum of the per-step terms; ``state_dict`` hands out copies (not the live buffers)."""
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.05, weight_decay=0.1), m, every=100, keep_last=True,
                         snapshot_budget=0.3, drift_every=1)
    tr = opt.tracker
    ptrs = {k: (v.vec.data_ptr(), {d: g.data_ptr() for d, g in v.grams.items()}) for k, v in tr.cumulative.items()}
    ref = {k: v.clone() for k, v in tr.cumulative.items()}
    saved = None
    for k, x in enumerate(_batches(5)):
        opt.zero_grad()
        _loss(m, x).backward()
        opt.step()
        for t in ref:
            ref[t] = ref[t].map(torch.add, tr.last[t])
        if k == 1:
            saved = tr.state_dict()["cumulative"]
            frozen = {t: {n: v.clone() for n, v in s.items()} for t, s in saved.items()}
    for t, v in tr.cumulative.items():
        assert (v.vec.data_ptr(), {d: g.data_ptr() for d, g in v.grams.items()}) == ptrs[t]
        assert torch.equal(v.vec, ref[t].vec) and all(torch.equal(g, ref[t].grams[d]) for d, g in v.grams.items())
    for t, s in saved.items():
        assert all(torch.equal(s[n], frozen[t][n]) for n in s)  # later steps did not write into the state
    # a loaded state is copied in too: stepping does not write into the dict it came from
    sd = copy.deepcopy(tr.state_dict())
    keep = copy.deepcopy(sd["cumulative"])
    tr.load_state_dict(sd)
    opt.zero_grad()
    _loss(m, _batches(1)[0]).backward()
    opt.step()
    assert all(torch.equal(sd["cumulative"][t][n], keep[t][n]) for t in keep for n in keep[t])


def test_decay_factor_once_per_param_group(monkeypatch):
    import conserve.tracker as T

    m = _model()
    ps = list(m.parameters())
    opt = conserve.track(torch.optim.AdamW(_wd_groups(ps), lr=1e-2), m, every=100)
    calls = []
    orig = T.decay_factor
    monkeypatch.setattr(T, "decay_factor", lambda o, g: calls.append(1) or orig(o, g))
    opt.zero_grad()
    _loss(m, _batches(1)[0]).backward()
    opt.step()
    assert len(calls) == len(opt.param_groups) == 2
    wd = {id(p): 1 - 1e-2 * g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert opt.tracker._a == [wd[id(t)] for t in opt.tracker.tensors]


@pytest.mark.parametrize("budget", [None, 0.05, 0.3])
def test_sampler_masks_from_group_ids(budget):
    """Each group's mask (one comparison of the group ids: 1 byte per entry up to 126 groups) marks exactly
    the entries of its units."""
    m = _model()
    tr = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, snapshot_budget=budget).tracker
    s, p = tr.sampler, tr.compiled.plan
    assert len(s.groups) < 127 and s._gid[0].dtype == np.int8
    for g, units in enumerate(s.groups):
        vm = np.zeros(p.vec_size, dtype=bool) if units is not None else np.ones(p.vec_size, dtype=bool)
        gm = {d: np.zeros(n, dtype=bool) if units is not None else np.ones(n, dtype=bool) for d, n in p.gram_slots.items()}
        for u in units or ():
            if u.key[0] == "gram":
                gm[u.key[1]][u.key[2]] = True
            else:
                vm[u.key[1]:u.key[2]] = True
        mask = s.mask(g + len(s.groups))  # round robin
        assert (mask.vec_np == vm).all() and torch.equal(mask.vec, torch.from_numpy(vm))
        assert all((mask.gram_np[d] == gm[d]).all() and torch.equal(mask.grams[d], torch.from_numpy(gm[d])) for d in gm)
        assert mask.full == bool(vm.all() and all(x.all() for x in gm.values())) and mask.key == ("sampler", g)


def test_parameter_relaid_out_during_training_keeps_the_drift_identity():
    """A parameter whose memory layout changes after tracking started (``p.data = ...``, same values,
    other strides) is read at its new layout by the budgeted drift steps (QA finding: cached strides
    gave residuals of 1e-3 against measured changes of 1e-4)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, drift_every=1, snapshot_budget=0.3, fp64=True)
    assert len(opt.tracker.sampler.groups) > 1
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for s in range(1, 9):
        if s == 3:
            for p in m.parameters():
                if p.dim() == 2:
                    p.data = p.data.t().contiguous().t()
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        r = opt.tracker.latest()
        assert abs(r["drift/relu/residual"]) <= 1e-9 * abs(r["drift/relu/measured"]) + 1e-15, s
    opt.tracker.close()


def test_state_dict_copies_sampled_steps_and_keeps_the_balance_of_theta_0():
    """``state_dict()`` is a snapshot (``sampled_steps`` is summed into in place afterwards), and a
    tracker resumed on moved weights reports the saved run's ``balance`` (|h_0| / magnitude at
    theta_0), not one recomputed at resume time (QA findings)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.2), m, drift_every=1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def steps(o, n):
        for _ in range(n):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    steps(opt, 5)
    sd = opt.tracker.state_dict()
    before = sd["sampled_steps"].clone()
    balance = opt.tracker.totals()["relu"]["balance"]
    steps(opt, 5)
    assert torch.equal(sd["sampled_steps"], before)
    resumed = conserve.track(torch.optim.SGD(m.parameters(), lr=0.2), m, drift_every=1)
    assert resumed.tracker.totals()["relu"]["balance"] != pytest.approx(balance, rel=1e-6)  # theta moved
    resumed.tracker.load_state_dict(sd)
    assert resumed.tracker.totals()["relu"]["balance"] == pytest.approx(balance, rel=1e-12)
    opt.tracker.close()
    resumed.tracker.close()


def test_cadence_arguments_accept_numpy_numbers_and_refuse_the_rest():
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    tr = conserve.Tracker(m, drift_every=np.int64(3), snapshot_budget=np.float32(0.5))
    assert tr.drift_every == 3 and isinstance(tr.drift_every, int) and tr.snapshot_budget == 0.5
    for bad in (dict(drift_every=0), dict(drift_every=True), dict(drift_every=2.0), dict(snapshot_budget=float("inf")),
                dict(snapshot_budget=float("nan")), dict(snapshot_budget=0), dict(keep_last="no")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            conserve.Tracker(m, **bad)


def test_state_saved_with_per_instance_balance_loads():
    """States saved before ``balance`` was held per family carry ``h0_balance`` per instance: loading one
    reports the mean over each family's instances (summed here independently, instance by instance)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.ReLU(),
                            torch.nn.Linear(4, 3))
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.2), m, drift_every=1)
    sd = dict(opt.tracker.state_dict())
    tr = opt.tracker
    per_inst = torch.rand(tr.layout.n_inst, dtype=tr.h0.vec.dtype)
    del sd["balance"]
    sd["h0_balance"] = per_inst
    tr.load_state_dict(sd)
    fams = tr.layout.inst_fam.tolist()
    got = tr.totals()
    assert len(tr.families) >= 1 and tr.layout.n_inst > len(tr.families)
    for i, f in enumerate(tr.families):
        vals = [float(per_inst[k]) for k in range(tr.layout.n_inst) if fams[k] == i]
        assert got[f]["balance"] == pytest.approx(sum(vals) / len(vals), rel=1e-6)
    tr.close()
