"""The tracker evaluates ``h(theta_{k+1})`` into its held ``h`` (issue 12): ``kernels.evaluate(out=)`` gives
the bits of a fresh evaluation on both backends and checks ``out`` before writing; a tracked run gives the
rows and ``h`` of trackers that evaluate afresh every step, bit for bit; nothing handed to the caller
(``values()``, ``state_dict()``, ``record_step``'s ``h1``) changes later."""

import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve import kernels
from conserve.models import DecoderLM, LMConfig
from conserve.tracker import Values
from test_kernels import llama_block

CFG = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=24, max_position_embeddings=16)


def _bits(a, b):
    return torch.equal(a[0], b[0]) and set(a[1]) == set(b[1]) and all(torch.equal(a[1][d], b[1][d]) for d in a[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_evaluate_out_is_a_fresh_evaluation_written_in_place(backend):
    plan, ts = llama_block(rope=True)
    want = kernels.evaluate(plan, ts, backend=backend)
    out = kernels.evaluate(plan, [t * 0.5 for t in ts], backend=backend)  # other values in the buffers
    got = kernels.evaluate(plan, ts, backend=backend, out=out)
    assert _bits(got, want)
    assert got[0] is out[0] and all(got[1][d] is out[1][d] for d in out[1])


def test_evaluate_out_that_does_not_fit_raises_before_writing():
    plan, ts = llama_block()
    vec, grams = kernels.evaluate(plan, ts)
    keep = (vec.clone(), {d: g.clone() for d, g in grams.items()})
    bad = [(vec.double(), grams), (vec[:-1], grams), (vec, {}), (vec, {d: g[:1] for d, g in grams.items()}), vec]
    for out in bad:
        with pytest.raises(ValueError, match="out="):
            kernels.evaluate(plan, [t * 2 for t in ts], out=out)
    assert _bits((vec, grams), keep)


def _loss(m, x):
    out = m(x[:, :-1])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))


@pytest.mark.parametrize("kw", [{}, dict(drift_every=1, snapshot_budget=None), dict(drift_every=2, keep_last=True)])
def test_tracked_run_equals_fresh_evaluations_and_hands_out_copies(kw):
    """Default (sampled, compact drift steps), exact mode (the old h read: fresh buffers) and keep_last: rows,
    h and last equal a tracker made to evaluate afresh each step (``_h_own`` cleared), bit for bit; non-drift
    and compact drift steps reuse h's buffers; values() / state_dict() taken earlier keep their values."""
    runs = []
    for fresh in (False, True):
        torch.manual_seed(0)
        m = DecoderLM(LMConfig(**CFG))
        opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=100,
                             **{"drift_every": 4, "snapshot_budget": 0.04, **kw})  # sampled unless kw says
        tr = opt.tracker
        g = torch.Generator().manual_seed(1)
        held, reused = [], 0
        for k in range(6):
            if fresh:
                tr._h_own = None
            ptr = tr.h.vec.data_ptr()
            vals, state = tr.values(), tr.state_dict()
            held.append(({n: v.clone() for n, v in vals.items()}, vals, Values.from_state(state["h"], "cpu").clone(),
                         Values.from_state(state["h"], "cpu")))
            x = torch.randint(0, CFG["vocab_size"], (2, 8), generator=g)
            opt.zero_grad()
            _loss(m, x).backward()
            opt.step()
            reused += tr.h.vec.data_ptr() == ptr
        for want, got, swant, sgot in held:  # what was handed out did not change
            assert all(torch.equal(want[n], got[n]) for n in want)
            assert _bits((swant.vec, swant.grams), (sgot.vec, sgot.grams))
        last = {k: (v.vec.clone(), v.grams) for k, v in tr.last.items()} if tr.keep_last else {}
        runs.append((torch.stack(tr._rows), tr.h, last, reused))
    (rows, h, last, reused), (rows_f, h_f, last_f, reused_f) = runs
    torch.testing.assert_close(rows, rows_f, rtol=0, atol=0, equal_nan=True)  # (NaN: no decomposed entry)
    assert _bits((h.vec, h.grams), (h_f.vec, h_f.grams))
    assert set(last) == set(last_f) and all(_bits(last[k], last_f[k]) for k in last)
    assert reused_f == 0
    exact = kw.get("snapshot_budget", 0.05) is None and kw.get("drift_every", 4) == 1
    assert reused == (0 if exact else 6), reused


def test_record_step_keeps_the_callers_h1():
    """A Values handed to record_step becomes h but is never written into by later steps."""
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(**CFG))
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, drift=False)
    tr = opt.tracker
    mine = tr._eval(tr.tensors)
    keep = mine.clone()
    tr.record_step(mine)
    assert tr.h is mine
    for _ in range(2):
        opt.zero_grad()
        _loss(m, torch.randint(0, CFG["vocab_size"], (2, 8))).backward()
        opt.step()
    assert tr.h is not mine and _bits((mine.vec, mine.grams), (keep.vec, keep.grams))


def _steps(opt, m, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        _loss(m, torch.randint(0, CFG["vocab_size"], (2, 8), generator=g)).backward()
        opt.step()
        yield


def test_eps_through_the_scratch_equals_the_direct_form():
    """record_step's eps (differences and denominators through one reused scratch) equals the direct form
    (fresh differences, ``square()``, the ``denom`` property) bit for bit, step by step."""
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(**CFG))
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=100)
    tr, nf, ng = opt.tracker, len(opt.tracker.families), len(opt.tracker.groups)
    for _ in _steps(opt, m, 5):
        h1, h0 = tr.h, tr.h0
        dv = torch.sub(h1.vec, h0.vec)
        rel = torch.zeros(tr.layout.n_inst).index_add_(0, tr.layout.vec_inst, dv.square())
        for d, g in h1.grams.items():
            rel.index_add_(0, tr.layout.gram_inst[d], torch.sub(g, h0.grams[d]).square().sum((1, 2)))
        rel = rel.sqrt() / tr.denom
        grp = tr.layout.group_sum(rel)
        fam = torch.zeros(nf).index_add_(0, tr.layout.group_fam, grp) / tr.book.fam_count_f
        assert torch.equal(tr._rows[-1][: nf + ng], torch.cat([fam, grp / tr.book.group_count_f]).float())


def test_drift_terms_scratch_is_freed_before_the_eps_scratch():
    """A drift step's terms (the DriftTerms and its scratch) are consumed before record_step forms eps: the
    scratch's storage is gone when the denominators are formed, and the DriftTerms is empty after."""
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(**CFG))
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2), m, every=100, drift_every=1)
    tr = opt.tracker
    seen, assemble, denominators = [], tr.assemble, tr.book.denominators

    def spy_assemble(*a, **k):
        terms = assemble(*a, **k)
        freed = []
        st = terms.buf.untyped_storage()
        import weakref
        weakref.finalize(st, freed.append, True)
        seen.append((terms, freed))
        return terms

    def spy_denominators(*a, **k):
        assert seen[-1][1] == [True], "the drift terms' scratch is still alive while eps is formed"
        return denominators(*a, **k)

    tr.assemble, tr.book.denominators = spy_assemble, spy_denominators
    for _ in _steps(opt, m, 3):
        pass
    assert len(seen) == 3 and all(len(t) == 0 and t.buf is None and t.h_old is None for t, _ in seen)
