"""Memory of the tracking engine (issue 12): what a tracked step creates, and the reference twin's
paths that keep it small, each against an independent form (the float64 term-by-term loop, the
previous full-layout / stacked computation, bit for bit where the sums run in the same order)."""

import numpy as np
import pytest
import torch

import conserve
from conserve.kernels import reference as R
from conserve.kernels.reference import _evaluate_looped, bilinear_reference, evaluate_reference
from conserve.models import DecoderLM, LMConfig
from conserve import kernels
from conserve.tracker import GUARD, Tracker
from conserve.tracking.values import Values, abs_plan as _tracker_abs_plan
from conserve.tracking.drift import Sampler
from bench.track_overhead import LiveBytes  # the bench's storage counter
from test_kernels import _abs_plan, llama_block


def _bits(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][d], b[1][d]) for d in a[1])


def _close64(got, want, scale, rtol):
    for g, w, s in [(got[0], want[0], scale[0])] + [(got[1][d], want[1][d], scale[1][d]) for d in want[1]]:
        assert ((g.double() - w).abs() <= rtol * s + 1e-30).all()


# --------------------------------------------------------------------------------- the reference twin
def test_strided_square_reduction_makes_no_tensor_sized_temporary(monkeypatch):
    """A column sum of squares (reduction along a strided dim) of an embedding-like tensor: above the
    temporary cap it is one ``vector_norm`` (no temporary), within it one ``(x*x).sum``, above
    ``_SMALL`` chunked; every path equals the float64 loop (1e-5 of the entrywise scale)."""
    g = torch.Generator().manual_seed(3)
    V, H = 256, 32
    emb, other = torch.randn(V, H, generator=g), torch.randn(H, 4 * H, generator=g)
    p = R.Plan()
    from conserve.kernels import NormTerm, View
    p.norms.append(NormTerm(View(0, (0, 0), 1, H, 0, V), 1.0, p.new_vec(H)))  # columns of emb: strided
    p.norms.append(NormTerm(View(1, (0, 0), 0, H, 1, 4 * H), -1.0, p.new_vec(H)))  # rows of other: contiguous
    ts = [emb, other]
    want = _evaluate_looped(p, [t.double() for t in ts], None, True)
    scale = _evaluate_looped(_abs_plan(p), [t.double().abs() for t in ts], None, True)
    for temp_share, small in ((16, 1 << 14), (1, 1 << 14), (16, 0)):  # vector_norm, one temporary, chunks
        monkeypatch.setattr(R, "_TEMP_SHARE", temp_share)
        monkeypatch.setattr(R, "_TEMP_MIN", 1 << 10)
        monkeypatch.setattr(R, "_SMALL", small)
        R.clear_cache()
        with LiveBytes() as m:
            got = evaluate_reference(p, ts)
        _close64(got, want, scale, 1e-5)
        nbytes = emb.numel() * 4
        if temp_share == 16 and small:  # cap = 40 KiB / 64 < emb: vector_norm, nothing tensor-sized
            assert m.largest < nbytes // 8, m.largest
        if not small:  # chunks of at most the cap (640 floats, above _TEMP_MIN = 1024: 1024 floats)
            assert m.largest <= 4 * (1 << 10) + 1024, m.largest
    R.clear_cache()


@pytest.mark.parametrize("fp64", [False, True])
def test_line_batches_and_progressions_bit_equal_to_one_stacked_gather(fp64, monkeypatch):
    """The whole-line values added in batches, onto progressions of entries or through the index
    table, give the bits of the single stacked form (one cat, one gather, one index_add_ per sign) and
    the float64 loop's values, for evaluate and bilinear."""
    plan, ts = llama_block()  # every line value read once (a RoPE plan reads some twice: the src table)
    g = torch.Generator().manual_seed(5)
    ys = [torch.randn(t.shape, generator=g) for t in ts]
    got = {}
    batches = R._batches
    for mode in ("stacked", "batched", "progressions"):
        cap = 1 << 30 if mode == "stacked" else 8  # batches of at most ``cap`` values (the plan's temp cap)
        monkeypatch.setattr(R, "_batches", lambda *a, cap=cap: batches(*a[:-1], cap))
        monkeypatch.setattr(R, "_BATCH_MIN", 8)
        monkeypatch.setattr(R, "_CUT_MIN", 1 << 30 if mode == "stacked" else 8)  # (batches end at sign segments)
        monkeypatch.setattr(R, "_PROGRESSIONS", 1 << 10 if mode == "progressions" else 0)
        R.clear_cache()
        s = R._structure(plan, ts, None, False, torch.float64 if fp64 else torch.float32, torch.device("cpu"))
        assert s.lines is not None and s.lines.src is None
        assert (s.lines.progressions is not None) == (mode == "progressions")
        assert len(s.lines.batches) == (1 if mode == "stacked" else max(2, len(s.lines.batches)))
        got[mode] = (evaluate_reference(plan, ts, fp64=fp64), bilinear_reference(plan, ts, ys, fp64=fp64))
    R.clear_cache()
    for mode in ("batched", "progressions"):
        for a, b in zip(got[mode], got["stacked"]):
            assert _bits(a, b), mode
    d64, y64 = [t.double() for t in ts], [t.double() for t in ys]
    _close64(got["batched"][0], _evaluate_looped(plan, d64, None, True),
             _evaluate_looped(_abs_plan(plan), [t.abs() for t in d64], None, True), 1e-12 if fp64 else 1e-5)
    _close64(got["batched"][1], _evaluate_looped(plan, d64, y64, True),
             _evaluate_looped(_abs_plan(plan), [t.abs() for t in d64], [t.abs() for t in y64], True),
             1e-12 if fp64 else 1e-5)


@pytest.mark.parametrize("fp64", [False, True])
def test_narrow_index_table_and_early_batch_bit_equal_to_int32_and_in_order(fp64, monkeypatch):
    """The whole-line index tables held as int16 (widened where they are read; the entry table and a
    RoPE plan's gather table) and the batch with the largest temporary reduced before the outputs
    are allocated give the bits of int32 tables and of the batches reduced in order; a table with
    entries >= 2^15 stays int32 (and equals the float64 loop)."""
    plan, ts = llama_block()
    g = torch.Generator().manual_seed(6)
    ys = [torch.randn(t.shape, generator=g) for t in ts]
    acc = torch.float64 if fp64 else torch.float32
    monkeypatch.setattr(R, "_BATCH_MIN", 8)
    monkeypatch.setattr(R, "_CUT_MIN", 8)  # several batches (one per sign segment)
    monkeypatch.setattr(R, "_PROGRESSIONS", 0)  # the index table path
    monkeypatch.setattr(R, "_WINDOWS", False)
    got = {}
    narrow, early = R._narrow_index, R._early
    for mode in ("int16", "int32", "in order"):
        monkeypatch.setattr(R, "_narrow_index", narrow if mode == "int16" else
                            (lambda idx, device: torch.as_tensor(idx, dtype=torch.int32, device=device)))
        monkeypatch.setattr(R, "_early", early if mode == "int16" else (lambda *a: None))
        R.clear_cache()
        s = R._structure(plan, ts, None, False, acc, torch.device("cpu"))
        assert s.lines.out.dtype == (torch.int16 if mode == "int16" else torch.int32)
        assert len(s.lines.batches) >= 2
        got[mode] = (evaluate_reference(plan, ts, fp64=fp64), bilinear_reference(plan, ts, ys, fp64=fp64))
    for mode in ("int32", "in order"):
        for a, b in zip(got["int16"], got[mode]):
            assert _bits(a, b), mode
    rope, rts = llama_block(rope=True)  # a RoPE plan reads some line values twice: the src (gather) table
    rys = [torch.randn(t.shape, generator=g) for t in rts]
    for mode in ("int16", "int32"):
        monkeypatch.setattr(R, "_narrow_index", narrow if mode == "int16" else
                            (lambda idx, device: torch.as_tensor(idx, dtype=torch.int32, device=device)))
        R.clear_cache()
        s = R._structure(rope, rts, None, False, acc, torch.device("cpu"))
        assert s.lines.src is not None and s.lines.src.dtype == s.lines.out.dtype == getattr(torch, mode)
        got[mode] = (evaluate_reference(rope, rts, fp64=fp64), bilinear_reference(rope, rts, rys, fp64=fp64))
    for a, b in zip(got["int16"], got["int32"]):
        assert _bits(a, b), "src"
    monkeypatch.setattr(R, "_narrow_index", narrow)
    monkeypatch.setattr(R, "_early", early)
    # entries past int16: the table stays int32
    from conserve.kernels import NormTerm, View
    big = R.Plan()
    big.new_vec(1 << 15)  # entries 0 .. 2^15 - 1 unused
    x = torch.randn(6, 5, generator=g)
    big.norms.append(NormTerm(View(0, (0, 0), 0, 6, 1, 5), 1.0, big.new_vec(6)))
    big.norms.append(NormTerm(View(0, (0, 0), 1, 5, 0, 6), -1.0, big.new_vec(5)))
    R.clear_cache()
    s = R._structure(big, [x], None, False, acc, torch.device("cpu"))
    assert s.lines.out.dtype == torch.int32
    want = _evaluate_looped(big, [x.double()], None, True)
    _close64(evaluate_reference(big, [x], fp64=fp64), want,
             _evaluate_looped(_abs_plan(big), [x.double().abs()], None, True), 1e-12 if fp64 else 1e-5)
    assert R._narrow_index(np.arange(3) + (1 << 15) - 3, "cpu").dtype == torch.int16
    assert R._narrow_index(np.arange(3) + (1 << 15) - 2, "cpu").dtype == torch.int32
    R.clear_cache()


def test_twin_evaluation_of_the_default_model_holds_one_segment_and_no_temporary_next_to_its_outputs():
    """``h`` of ``conserve run``'s default model through the twin (its whole-line values: 48 reductions
    into 1888 values, four sign segments; column sums of squares of 32 x 64 weights, one ``x * x``
    temporary each): no per-line entry table is held (the entries are runs: ``_windows``, one int32
    per piece of >= 4 lines, at most a fifth of the int16 table's bytes) and nothing per line is
    widened; the values alive at once are one batch (a sign segment), never the 1888 stacked; the
    batch with the largest temporary is reduced before the outputs exist.  So the storages created
    inside the evaluation peak at ``max(E + T, outputs + E)`` (E: the largest batch's values, T: the
    largest temporary), not ``outputs + all values + T``."""
    m = _model(cfg=RUN)
    tr = Tracker(m)
    plan, ts = tr.compiled.plan, tr.tensors
    s = R._structure(plan, ts, None, False, torch.float32, torch.device("cpu"))
    lines = s.lines
    total = sum(r.size for r in lines.reductions)
    assert lines.out is None and lines.src is None and lines.windows is not None
    assert len(lines.windows) == len(lines.segments) and min(G for G, _, _ in lines.windows) >= 4
    held = sum(f.numel() * f.element_size() for _, _, f in lines.windows)
    assert held <= 2 * total / 5, held
    assert all(isinstance(o, tuple) for b in lines.batches for *_, o in b[5])  # no table view in any batch
    E = 4 * max(b[2] for b in lines.batches)
    assert len(lines.batches) >= 2 and E < 4 * total * 0.7
    with torch.no_grad():
        evaluate_reference(plan, ts)  # the reductions' paths chosen
        T = 4 * max(R._temp_size(r, ts[r.tensor], None, torch.float32) for r in lines.reductions)
        assert T > 0 and R._early(lines, ts, None, torch.float32) is not None
        with LiveBytes() as mode:
            vec, grams = evaluate_reference(plan, ts)
    out = 4 * (vec.numel() + sum(g.numel() for g in grams.values()))
    assert mode.largest <= max(T, E, out), (mode.largest, T, E)
    assert mode.peak <= max(E + T, out + E), (mode.peak, E, T, out)
    assert mode.peak < out + 4 * total + T - E  # (the stacked form: outputs, all values, a temporary)
    want = _evaluate_looped(plan, [t.double() for t in ts], None, True)
    _close64((vec, grams), want, _evaluate_looped(_abs_plan(plan), [t.double().abs() for t in ts], None, True), 1e-5)


@pytest.mark.parametrize("fp64", [False, True])
def test_window_entries_bit_equal_to_the_per_line_table(fp64, monkeypatch):
    """The whole-line entries added as runs (``_windows``: one ``index_add_`` per segment into a window
    view of ``vec``, overlapping rows where several lines hit an entry, or over a transient int32
    index formed from the runs) give the bits of the int16
    per-line table's ``index_add_``, for evaluate and bilinear, batched (one or several batches) and
    under autograd (the transient per-line index), on the default model's plan and a Llama block;
    ``_windows`` refuses segments of single lines and signs that are not +-2^k (the table then)."""
    cases = [(Tracker(_model(cfg=RUN)).compiled.plan, None), llama_block()]
    acc = torch.float64 if fp64 else torch.float32
    g = torch.Generator().manual_seed(8)
    for plan, ts in cases:
        ts = ts if ts is not None else Tracker(_model(cfg=RUN)).tensors
        ys = [torch.randn(t.shape, generator=g) for t in ts]
        got = {}
        for mode in ("table", "windows", "windows batched", "windows 1-D"):
            monkeypatch.setattr(R, "_WINDOWS", mode != "table")
            monkeypatch.setattr(R, "_WINDOW_ROWS", 0 if mode == "windows 1-D" else 128)  # transient int32 index
            monkeypatch.setattr(R, "_PROGRESSIONS", 0)
            monkeypatch.setattr(R, "_CUT_MIN", 8 if mode == "windows batched" else 256)
            R.clear_cache()
            s = R._structure(plan, ts, None, False, acc, torch.device("cpu"))
            assert (s.lines.windows is not None) == (mode != "table") and (s.lines.out is None) == (mode != "table")
            with torch.no_grad():
                got[mode] = (evaluate_reference(plan, ts, fp64=fp64), bilinear_reference(plan, ts, ys, fp64=fp64))
            leaf = [t.detach().clone().requires_grad_(True) for t in ts]  # the non-batched path (autograd)
            vec, grams = evaluate_reference(plan, leaf, fp64=fp64)
            got[mode] += ((vec.detach(), {d: x.detach() for d, x in grams.items()}),)
            (vec.sum() + sum(x.sum() for x in grams.values())).backward()
            got[mode] += ((torch.cat([t.grad.reshape(-1) for t in leaf]), {}),)
        R.clear_cache()
        for mode in ("windows", "windows batched", "windows 1-D"):
            for a, b in zip(got[mode], got["table"]):
                assert _bits(a, b), mode
    segs = [(1.0, 0, 8), (-1.0, 8, 12)]
    red = [R._Reduction(0, 1, "sq", 0, 12, True)]
    runs = np.concatenate([np.arange(4) + 3, np.arange(4) + 3, np.arange(4) + 10])
    wins = R._windows(red, runs, segs, "cpu")
    assert [(G, st, f.tolist()) for G, st, f in wins] == [(4, 1, [3, 3]), (4, 1, [10])]
    assert R._windows(red, np.asarray([0, 5, 1, 7, 2, 2, 9, 3, 4, 4, 6, 8]), segs, "cpu") is None  # single lines
    assert R._windows(red, runs, [(0.3, 0, 8), (-1.0, 8, 12)], "cpu") is None  # 0.3 * v is rounded
    assert R._windows(red, runs, [(0.5, 0, 8), (-2.0, 8, 12)], "cpu") is not None


def test_large_gram_groups_block_by_block_bit_equal_to_stacked(monkeypatch):
    """Gram groups added block by block (scaled in place) give the bits of the stacked form."""
    plan, ts = llama_block(nH=8, nKV=2, D=16, H=32)
    g = torch.Generator().manual_seed(7)
    ys = [torch.randn(t.shape, generator=g) for t in ts]
    out = {}
    for stack in (1 << 30, 0):
        monkeypatch.setattr(R, "_gram_stack", lambda *args, stack=stack: stack)
        R.clear_cache()
        out[stack] = (evaluate_reference(plan, ts), bilinear_reference(plan, ts, ys),
                      R.decay_reference(plan, ts, [0.9] * len(ts)))
    R.clear_cache()
    for a, b in zip(out[0], out[1 << 30]):
        assert _bits(a, b)
    monkeypatch.undo()  # the stacked buffer stays within the temporaries' cap (a share of the weights read)
    assert R._gram_stack(plan, ts, torch.float32) == min(R._GRAM_STACK, R._temp_cap(plan, ts, torch.float32))


def test_small_weights_with_many_heads_evaluate_their_grams_within_the_temporaries_cap():
    """A ViT of 50k parameters (head_dim 16, hidden 64: its Q/K and V/O Grams are 8% of its weights):
    the twin's evaluation creates its outputs and temporaries of at most ``1 / _TEMP_SHARE`` of the bytes
    it reads, not one stacked buffer of every Q and K product (2x the Gram values, 16% of the weights)."""
    from conserve.models import ViT, ViTConfig

    torch.manual_seed(0)
    tr = Tracker(ViT(ViTConfig()), drift=False)
    plan, ts = tr.compiled.plan, tr.tensors
    tracked = sum(t.numel() * t.element_size() for t in ts)
    R.clear_cache()
    with torch.no_grad():  # (as the tracker evaluates)
        evaluate_reference(plan, ts)  # the structure built and cached outside the count
        with LiveBytes() as mode:
            vec, grams = evaluate_reference(plan, ts)
    out = vec.numel() * 4 + sum(g.numel() * 4 for g in grams.values())
    assert out > 0.08 * tracked  # many heads on small weights
    assert mode.peak - out <= tracked / R._TEMP_SHARE, ((mode.peak - out) / tracked)


def test_twin_evaluation_under_autograd_keeps_its_gradient():
    """The in-place paths are skipped under autograd: the gradient of a law value is the float64 one."""
    plan, ts = llama_block()
    xs = [t.double().requires_grad_() for t in ts]
    vec, grams = evaluate_reference(plan, xs, fp64=True)
    (vec.sum() + sum(g.sum() for g in grams.values())).backward()
    ref = [t.double().requires_grad_() for t in ts]
    v2, g2 = _evaluate_looped(plan, ref, None, True)
    (v2.sum() + sum(g.sum() for g in g2.values())).backward()
    for a, b in zip(xs, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- the tracker
CFG = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
           num_hidden_layers=2)
# ``conserve run``'s default model (62k parameters)
RUN = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, position="rope", rope_layout="half", nope_layers=(1,), num_experts=4, top_k=2,
           moe_layers=(2,))


def _model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(**cfg))


def _steps(opt, model, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()


@pytest.mark.parametrize("opt_name,fp64,drift_every", [("adamw", False, 1), ("sgd", True, 2), ("adamw", True, 1)])
def test_compact_sub_plans_bit_equal_to_the_full_layout(opt_name, fp64, drift_every, monkeypatch):
    """A budgeted drift step over a compact sub-plan (pieces, terms and scratch the group's size)
    gives the rows, ``cumulative``, ``totals()``, ``last`` and state of the full-layout sub-plan, bit for
    bit (the operations are per entry and the family sums add the same non-zero squares in order)."""
    res = {}
    for compact in (False, True):
        orig = Sampler.__init__

        def init(self, *a, compact_=compact, **k):
            k["compact"] = compact_
            orig(self, *a, **k)
        monkeypatch.setattr(Sampler, "__init__", init)
        m = _model()
        base = (torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) if opt_name == "adamw"
                else torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01))
        opt = conserve.track(base, m, every=4, drift_every=drift_every, snapshot_budget=0.05, keep_last=True,
                             fp64=fp64)
        tr = opt.tracker
        assert len(tr.sampler.groups) > 3 and tr.sampler.compact == compact
        rows, lasts = [], []
        for k in range(9):
            _steps(opt, m, 1, seed=k)
            lasts.append({t: v.clone() for t, v in tr.last.items()})
            tr.last = {}
        rows = tr.flush()
        res[compact] = (rows, lasts, tr.totals(), tr.state_dict(), {k: v.state() for k, v in tr.cumulative.items()})
        monkeypatch.setattr(Sampler, "__init__", orig)
    (r0, l0, t0, s0, c0), (r1, l1, t1, s1, c1) = res[False], res[True]
    nan_eq = lambda a, b: a == b or (a != a and b != b)  # noqa: E731
    assert all(nan_eq(a[k], b[k]) for a, b in zip(r0, r1) for k in a)
    assert t0.keys() == t1.keys() and all(nan_eq(t0[f][k], t1[f][k]) for f in t0 for k in t0[f])
    for a, b in zip(l0, l1):
        assert a.keys() == b.keys()
        for t in a:
            assert _bits((a[t].vec, a[t].grams), (b[t].vec, b[t].grams)), t
    for k in c0:
        assert all(torch.equal(c0[k][n], c1[k][n]) for n in c0[k])
    assert torch.equal(s0["sampled_steps"], s1["sampled_steps"]) and torch.equal(s0["denom"], s1["denom"])


def test_a_drift_step_creates_at_most_the_law_values_the_snapshot_and_small_scratch():
    """Storages created inside ``opt.step()`` on a budgeted drift step of ``conserve run``'s default
    model: ``h_{k+1}`` (law-sized), the group's snapshot (<= the budget), one reduction temporary
    (<= ``1 / _TEMP_SHARE`` of the tracked bytes) and 0.02 of the tracked bytes for the rest (compact
    terms: the group's entries; stacked line values: a quarter of the rows).  The full-layout
    five-row drift scratch (0.11 of this model's weights, next to h(Delta) and B) or the embedding's
    tensor-sized ``x*x`` (0.15 next to the snapshot) break the bound."""
    m = _model(cfg=RUN)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=100, drift_every=1)
    tr = opt.tracker
    tracked = sum(t.numel() * t.element_size() for t in tr.tensors)
    law = tr.h0.vec.numel() * tr.h0.vec.element_size() + sum(g.numel() * g.element_size() for g in tr.h0.grams.values())
    assert 5 * law > 0.1 * tracked and tracked < 16 * 256 * 32 * 4  # the embedding is above the cap
    s = tr.sampler
    groups = len(s.groups)
    snap = max(s.snapshot(j, tr.tensors).bytes() for j in range(groups)) / tracked
    assert snap <= 0.05
    _steps(opt, m, groups)  # every group's sub-plan built once (its structures are cached)
    worst = 0.0
    g = torch.Generator().manual_seed(9)
    for _ in range(groups):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        with LiveBytes() as mode:
            opt.step()
        worst = max(worst, (mode.peak - law) / tracked)
    assert worst <= snap + 1 / R._TEMP_SHARE + 0.02, (worst, snap)
    opt.tracker.close()


def test_family_ids_gathered_equal_the_built_tables():
    """The family of each instance and of each entry, gathered from the group table (not held), is the
    law's family (compared with a table built from the laws directly)."""
    m = _model()
    tr = Tracker(m, drift=False)
    fams = tr.families
    want_inst, want_entry, want_group = [], torch.zeros(tr.layout.inst_all.numel(), dtype=torch.int32), []
    c = tr.compiled
    offs = tr.layout.flat_at
    for law, (kind, a, b) in zip(c.laws, c.where):
        f = fams.index(law.family)
        g = tr.groups.index((law.family, -1 if law.layer is None else law.layer))
        n = b if kind == "vec" and law.per == "entry" else 1
        want_inst += [f] * n
        want_group += [g] * n
        if kind == "vec":
            want_entry[a: a + b] = f
        else:
            want_entry[offs[a] + b] = f
    assert tr.__dict__.get("_fam_all_held") is None  # every entry belongs to a law here: nothing held
    assert tr.layout.inst_fam.tolist() == want_inst
    assert torch.equal(tr.layout.fam_all, want_entry)
    # the instances' groups are held as runs (fewer than the instances), expanding to the table
    assert tr.layout.inst_group.tolist() == want_group and len(tr.layout.run_len) < tr.layout.n_inst
    assert "_inst_group" not in tr.__dict__
    per_inst = torch.rand(tr.layout.n_inst, dtype=torch.float64)
    want = torch.zeros(len(tr.groups), dtype=torch.float64).index_add_(0, torch.tensor(want_group), per_inst)
    torch.testing.assert_close(tr.layout.group_sum(per_inst), want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("pattern", ["uniform", "per_tensor", "matrices_only"])
def test_assembly_factors_per_tensor_set_equal_the_per_term_form(pattern):
    """The assembly's per-entry common decay factor (kept per set of tensors an entry reads, not per
    term row) equals the term-by-term rule: the one ``a`` of every tensor the entry's terms read,
    NaN where they differ, where a shifted norm term's tensor has ``a != 1``, or where nothing is read."""
    import numpy as np
    from conserve.kernels.reference import drift_factors
    from conserve.tracking.drift import Assembly

    m = _model()
    tr = Tracker(m, drift=False)
    plan, n = tr.compiled.plan, len(tr.tensors)
    # one shifted norm term (a Gemma-style gain) on the first norm term's tensor
    plan.norms[0] = type(plan.norms[0])(plan.norms[0].view, plan.norms[0].sign, plan.norms[0].index,
                                        plan.norms[0].index_stride, 1.0)
    rng = np.random.default_rng(0)
    a = {"uniform": [0.999] * n, "per_tensor": list(1.0 - 1e-3 * rng.integers(0, 3, n)),
         "matrices_only": [0.99 if t.dim() >= 2 else 1.0 for t in tr.tensors]}[pattern]
    asm = Assembly(plan, tr.compiled.linear_mask, "cpu")
    for got, av in zip(asm._factors(a), (np.asarray(a, dtype=np.float64),
                                          np.asarray(drift_factors(a, n), dtype=np.float64))):
        reads = {("v", e): [] for e in range(plan.vec_size)}
        reads.update({("g", d, s): [] for d, k in plan.gram_slots.items() for s in range(k)})
        for t in plan.norms:
            for r in range(t.view.rows):
                reads[("v", t.index + t.index_stride * r)].append((t.view.tensor, t.shift != 0.0))
        for t in plan.sums:
            for c in range(t.view.cols):
                reads[("v", t.index + c)].append((t.view.tensor, False))
        for t in plan.grams:
            reads[("g", t.view.rows, t.slot)].append((t.view.tensor, False))

        def rule(rs):
            if not rs or len({av[t] for t, _ in rs}) > 1 or any(sh and av[t] != 1.0 for t, sh in rs):
                return np.nan
            return av[rs[0][0]]
        want_v = np.asarray([rule(reads[("v", e)]) for e in range(plan.vec_size)])
        assert np.array_equal(got[0], want_v, equal_nan=True)
        mixed = bool(np.isnan(want_v).any())
        for d, k in plan.gram_slots.items():
            want_g = np.asarray([rule(reads[("g", d, s)]) for s in range(k)])
            assert np.array_equal(got[1][d], want_g, equal_nan=True)
            mixed |= bool(np.isnan(want_g).any())
    assert np.isnan(want_v[plan.norms[0].index])  # the shifted term's tensor has a != 1
    assert asm.needs_kernel_decay(a) == mixed


# ------------------------------------------------------------------ the one drift assembly (issue 12 review)


def test_compact_layouts_cached_per_group_bit_equal_to_rebuilt(monkeypatch):
    """A sampler group's compact layout (``Entries``, with its restricted assembly) is built once and
    reused each time the group comes round: one per group, the same object, and the rows, cumulative
    terms and state bit for bit those of a tracker that rebuilds it every drift step."""
    res = {}
    for cached in (True, False):
        m = _model()
        opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), m, every=100,
                             drift_every=1, snapshot_budget=0.05, keep_last=True)
        tr = opt.tracker
        n = len(tr.sampler.groups)
        assert n > 3
        if not cached:  # a fresh layout every drift step (the cache emptied before each use)
            from conserve.tracking.book import Layout
            orig = Layout.entries
            monkeypatch.setattr(Layout, "entries", lambda self, mask, asm: (self.entries_of.clear(), orig(self, mask, asm))[1])
        seen = []
        for k in range(2 * n + 1):
            _steps(opt, m, 1, seed=k)
            seen.append(id(tr.layout.entries_of.get(("sampler", k % n))))
        if cached:
            assert len(tr.layout.entries_of) == n and seen[:n] == seen[n: 2 * n]
        res[cached] = (torch.stack(tr._rows), {k: v.state() for k, v in tr.cumulative.items()},
                       {t: v.clone() for t, v in tr.last.items()}, tr.sampled_steps.clone())
        monkeypatch.undo()
    (r0, c0, l0, s0), (r1, c1, l1, s1) = res[True], res[False]
    assert torch.equal(r0.nan_to_num(7.0), r1.nan_to_num(7.0)) and torch.equal(r0.isnan(), r1.isnan())
    assert all(torch.equal(c0[k][x], c1[k][x]) for k in c0 for x in c0[k]) and torch.equal(s0, s1)
    assert all(_bits((l0[t].vec, l0[t].grams), (l1[t].vec, l1[t].grams)) for t in l0)


@pytest.mark.parametrize("fp64", [False, True])
def test_assembly_correct_from_the_held_table_bit_equal_to_per_entry_factors(fp64):
    """``Assembly.correct`` expands a per-set table held per ``a`` (nothing law-sized uploaded per step);
    it equals, bit for bit, the per-entry form: the factors of each entry (``_factors``) turned into
    ``d, a / a_f, a, a_f`` in float64 on the host and rounded once to the values' dtype.  Mixed decay
    (two parameter groups inside some laws) and linear laws included; a restricted layout too."""
    import numpy as np
    from conserve.tracking.drift import Assembly

    m = _model()
    tr = Tracker(m, drift=False, fp64=fp64)
    plan, n, dt = tr.compiled.plan, len(tr.tensors), tr.h.vec.dtype
    a = [0.999 if t.dim() >= 2 else (1.0 - 1e-3 * 0.3) for t in tr.tensors]  # not fp32 numbers; mixed
    asm = Assembly(plan, tr.compiled.linear_mask, "cpu")
    g = torch.Generator().manual_seed(0)
    rnd = lambda v: (torch.randn(v[0].shape, generator=g, dtype=dt),  # noqa: E731
                     {d: torch.randn(x.shape, generator=g, dtype=dt) for d, x in v[1].items()})
    h = rnd((tr.h.vec, tr.h.grams))

    def per_entry(asm, h, first, second):
        (tv, tg), (rv, rg) = asm._factors(a)

        def fix(f, s, h, t, r, lin):
            uni = ~np.isnan(t) & ~np.isnan(r)
            d = np.where(uni, t - r, 0.0)
            if not d.any():
                return f, s
            shape = (-1,) + (1,) * (h.dim() - 1)
            up = lambda x: torch.from_numpy(x).to(dt).view(shape)  # noqa: E731
            dd, ratio = up(d), up(np.where(uni, t / np.where(uni, r, 1.0), 1.0))
            tt, rr = up(np.where(uni, t, 1.0)), up(np.where(uni, r, 1.0))
            fq = ratio * (f - 2 * dd * rr * h)
            sq = s - (dd / tt) * fq - dd * dd * h
            if lin is None:
                return fq, sq
            return torch.where(lin.view(shape), f - dd * h, fq), torch.where(lin.view(shape), s, sq)
        fv, sv = fix(first[0], second[0], h[0], tv, rv, asm._lin)
        out = {d: fix(first[1][d], second[1][d], h[1][d], tg[d], rg[d], None) for d in first[1]}
        return (fv, {d: x[0] for d, x in out.items()}), (sv, {d: x[1] for d, x in out.items()})

    vi = np.arange(3, plan.vec_size, 7)
    si = {d: np.arange(0, k, 2) for d, k in plan.gram_slots.items()}
    sub = asm.restrict(vi, si)
    hs = (h[0][vi], {d: x[si[d]] for d, x in h[1].items()})
    mixed = False
    for layout, hh in ((asm, h), (sub, hs)):
        for _ in range(2):  # the second call reads the held table
            first, second = rnd(hh), rnd(hh)
            want = per_entry(layout, hh, first, second)
            copies = [(v.clone(), {d: x.clone() for d, x in g.items()}) for v, g in (first, second)]
            got = layout.correct(hh, *copies, a)
            assert _bits(got[0], want[0]) and _bits(got[1], want[1])
            assert got[0][0] is copies[0][0] and got[1][0] is copies[1][0]  # in place
            assert not _bits(got[0], first)  # the factors are not fp32 numbers: a correction was made
        mixed |= bool(np.isnan(layout._factors(a)[0][0]).any())
    assert mixed and asm._ccache is not None and asm._ccache[1][0].shape == (4, asm._n_sets)


def test_assembly_terms_with_step_statistics_bit_equal_to_their_composition():
    """``Assembly.terms(..., stats=StepStats)`` (the fused optimizers' path): ``first = 2 B + lin h(Delta) +
    s_first``, ``second = (1 - lin) h(Delta) + s_second`` corrected to the exact ``a``, masked, and the
    decay with the statistics' per-term decay added to the pass's, bit for bit; without a DRIFT pass
    (``pieces=None``) the terms are the statistics' alone (Gram terms 0).  A list of pieces is emptied."""
    from conserve.tracking.drift import Assembly, StepStats, make_mask
    import numpy as np

    m = _model()
    tr = Tracker(m, drift=False)
    plan, dt = tr.compiled.plan, tr.h.vec.dtype
    a = [0.999 if t.dim() >= 2 else 0.9995 for t in tr.tensors]
    asm = Assembly(plan, tr.compiled.linear_mask, "cpu")
    g = torch.Generator().manual_seed(1)
    rnd = lambda: (torch.randn(plan.vec_size, generator=g, dtype=dt),  # noqa: E731
                   {d: torch.randn(k, d, d, generator=g, dtype=dt) for d, k in plan.gram_slots.items()})
    h, b, hd, dec = rnd(), rnd(), rnd(), rnd()
    st = StepStats(*(torch.randn(plan.vec_size, generator=g, dtype=dt) for _ in range(3)))
    vm = np.arange(plan.vec_size) % 3 != 0
    mask = make_mask(vm, {d: np.arange(k) % 2 == 0 for d, k in plan.gram_slots.items()}, "cpu")
    lin = tr.compiled.linear_mask
    for with_pass in (True, False):
        pieces = [None, dec, b, hd] if with_pass else None
        got = asm.terms(h, pieces, a, mask, stats=st)
        if with_pass:
            assert pieces == []
            f = (2 * b[0] + hd[0] * lin + st.first, {d: 2 * x for d, x in b[1].items()})
            s = (hd[0] * ~lin + st.second, dict(hd[1]))
            kernel = (st.decay + dec[0], dec[1])
        else:
            f = (st.first.clone(), {d: torch.zeros_like(x) for d, x in h[1].items()})
            s = (st.second.clone(), {d: torch.zeros_like(x) for d, x in h[1].items()})
            kernel = (st.decay, {})
        f, s = asm.correct(h, f, s, a)
        mask.restrict_(f, s)
        want = {"first": f, "second": s, "decay": asm.decay(h, a, kernel, mask)}
        for k in want:
            assert _bits(got[k], want[k]), (with_pass, k)


def test_compact_layout_selects_by_slice_or_index_alike():
    """``Entries`` selects a sampler group's entries by slices (one run of the layout: views, nothing
    held) and any other mask by int32 indices: both give the gathered values, families, linear flags
    and in-place additions of plain fancy indexing."""
    import numpy as np
    from conserve.tracking.book import Entries as _Entries, add_at as _add_at
    from conserve.tracking.drift import make_mask

    m = _model()
    tr = Tracker(m, drift=False)
    plan = tr.compiled.plan
    fam_all, lin = tr.layout.fam_all, tr.compiled.linear_mask
    for kind in ("run", "strided"):
        vm = np.zeros(plan.vec_size, dtype=bool)
        gm = {d: np.zeros(k, dtype=bool) for d, k in plan.gram_slots.items()}
        if kind == "run":
            vm[5: 40] = True
        else:
            vm[3::4] = True
            for d in gm:
                gm[d][::2] = True
        at = _Entries(tr.layout, make_mask(vm, gm, "cpu"), tr.assembly)
        assert isinstance(at.vec, slice) == (kind == "run")
        vi, si = torch.from_numpy(np.flatnonzero(vm)), {d: torch.from_numpy(np.flatnonzero(x)) for d, x in gm.items()}
        got = at.take(tr.h)
        assert torch.equal(got[0], tr.h.vec[vi]) and all(torch.equal(got[1][d], tr.h.grams[d][si[d]]) for d in si)
        flat = torch.cat([vi] + [tr.layout.flat_at[d] + si[d] for d in tr.layout.gram_ds])
        assert torch.equal(at.families(tr.layout), fam_all[flat]) and at.size == flat.numel()
        assert torch.equal(at.assembly._lin, lin[vi]) and np.array_equal(at.assembly._lin_np, lin[vi].numpy())
        x, y = torch.randn(plan.vec_size), torch.randn(len(vi))
        want = x.clone().index_add_(0, vi, y)
        _add_at(x, at.vec, y)
        assert torch.equal(x, want)


def test_eps_denominators_formed_from_h0_hold_only_the_guarded_ones():
    """``denom`` is formed when read from ``h_0`` (not held): ``|h_0,i|`` where the law starts unbalanced,
    the magnitude (every sign +) where the guard takes it; only those are held, and the value set by a
    ``load_state_dict`` (the saved run's guards) is the one read back, bit for bit."""
    m = _model()
    tr = Tracker(m, drift=False)
    assert "denom" not in tr.__dict__
    h0n = tr.layout.inst_norm(tr.h0)
    mag = tr.layout.inst_norm(Values(*kernels.evaluate(_tracker_abs_plan(tr.compiled.plan), tr.tensors)))
    want = torch.where(h0n > GUARD * mag, h0n, mag).clamp_min(torch.finfo(h0n.dtype).tiny)
    assert torch.equal(tr.denom, want)
    assert tr.book.guard_at.numel() == int((want != h0n).sum())
    # a state whose guards differ (another theta_0's magnitudes): those instances are held and read back
    sd = tr.state_dict()
    other = sd["denom"].clone()
    other[::3] *= 7.0
    sd["denom"] = other
    tr.load_state_dict(sd)
    assert torch.equal(tr.denom, other) and tr.book.guard_at.numel() == len(other[::3])
    assert tr.totals()  # (guarded read from the held ones)
    tr.close()


def test_vec_instances_held_as_stretches_add_with_the_bits_of_index_add():
    """The default model's vec entries map to their instances in a few stretches (no per-entry index held);
    ``_vec_add`` gives the bits of ``index_add_`` over the materialised index, and an index of many
    stretches (or a long stretch of one instance) stays an index."""
    from conserve.tracking.book import MAX_RUNS as _MAX_RUNS, index_runs as _index_runs
    from bench.track_overhead import run_model

    torch.manual_seed(0)
    tr = conserve.track(torch.optim.SGD((m := run_model("tiny")).parameters(), lr=0.1), m).tracker
    assert tr.layout.vec_runs is not None and tr.layout.vec_inst_held is None and len(tr.layout.vec_runs) <= _MAX_RUNS
    idx = tr.layout.vec_inst
    for dt in (torch.float32, torch.float64):
        v = torch.randn(idx.numel(), dtype=dt)
        want = torch.zeros(tr.layout.n_inst, dtype=dt).index_add_(0, idx, v)
        assert torch.equal(tr.layout.vec_add(torch.zeros(tr.layout.n_inst, dtype=dt), v), want)
    assert _index_runs(np.random.default_rng(0).integers(0, 50, 200), "cpu") == (None, None)
    assert _index_runs(np.zeros(100, dtype=np.int64), "cpu") == (None, None)  # one instance over all: an index
    runs, zero = _index_runs(np.array([0, 1, 2, 3, 3, 3, 4, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9,
                                       9, 9, 10, 11]), "cpu")
    assert runs is None or all(r[1] >= 1 for r in runs)
    runs, zero = _index_runs(np.array([0, 1, 2, 5, 5, 6, 7] * 1 + list(range(8, 40))), "cpu")
    assert runs == [(0, 3, 0, True), (3, 2, 5, False), (5, 34, 6, True)] and zero.numel() == 2
