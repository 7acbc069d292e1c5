"""The overlap ordering of the fused optimizers' drift steps (``overlap=True``, conserve.optim.fused).

On a drift step the tensors of the DRIFT pass (the snapshot's Gram-law views) are stepped first, the
pass runs (on CUDA on a side stream, ``conserve.kernels.streams``), then the other tensors are stepped.
References: the serial ordering (``overlap=False``, the pass after the whole step) -- weights,
optimizer state (including the tracker's ``h``, ``cumulative``, guards) and every metric row must be
the SAME BITS; the call order of steps / pass / stream operations, logged by spies and by a recording
fake of the stream api (the stream code path on CPU).
"""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import conserve.kernels as CK
from conserve.kernels import optim_step as K
from conserve.kernels import streams
from conserve.kernels.plan import GramTerm, Plan, View
from test_fused_optim import lm
from conserve.optim import FusedAdamW, FusedSGD
from conserve.optim import fused as F

pytestmark = pytest.mark.filterwarnings("ignore::conserve.tracking.breakers.BrokenLawWarning")




def _groups(model, kw):
    """Two groups, the attention weights with another lr and weight decay: laws whose tensors have
    different decay factors (the kernel's per-term decay) and laws within one group."""
    att = [p for n, p in model.named_parameters() if "self_attn" in n]
    rest = [p for n, p in model.named_parameters() if "self_attn" not in n]
    g2 = dict(lr=kw["lr"] * 0.5, weight_decay=kw.get("weight_decay", 0.0) * 2)
    return [{"params": att}, {"params": rest, **g2}]


def _same(a, b, what=""):
    """Bitwise equality of nested state (tensors: same dtype, shape, bits; floats: equal or both nan)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel()
                           else b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (what, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (what, a, b)
    else:
        assert a == b, (what, a, b)


def _run(cls, kw, overlap, steps, model_kw=None, spy=None, **tracker_kw):
    m = lm(**(model_kw or {}))
    opt = cls(_groups(m, kw), **kw, track=m, every=1000, keep_last=True, overlap=overlap, **tracker_kw)
    opt._model_names = list(m.named_parameters())
    if spy is not None:
        spy(opt)
    x = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
    last = {k: (v.vec.clone(), {d: g.clone() for d, g in v.grams.items()}) for k, v in opt.tracker.last.items()}
    rows = opt.tracker.flush()  # before state_dict (which flushes)
    out = dict(params=[p.detach().clone() for p in m.parameters()], state=copy.deepcopy(opt.state_dict()),
               rows=rows, last=last)
    opt.close()
    return out, opt


class _Log:
    """Spies on the fused step: which tracked tensor each torch-twin step call updates, and each DRIFT
    pass (``drift_pieces`` as ``conserve.optim.fused`` calls it)."""

    def __init__(self, monkeypatch, opt_ref, stream_of=lambda: None):
        self.events = []
        self.pieces = []
        step, drift = K.step_stats_reference, F.drift_pieces

        def step_spy(h, p, *a, **k):
            self.events.append(("step", opt_ref[0]._tracked.get(id(p), -1), stream_of()))
            return step(h, p, *a, **k)

        def drift_spy(*a, **k):
            self.events.append(("drift", None, stream_of()))
            out = drift(*a, **k)
            self.pieces.append(out)
            return out

        monkeypatch.setattr(K, "step_stats_reference", step_spy)
        monkeypatch.setattr(F, "drift_pieces", drift_spy)


CASES = [  # (optimizer, hyper-parameters, drift_every, snapshot_budget)
    (FusedAdamW, dict(lr=1e-2, weight_decay=0.1), 1, None),
    (FusedAdamW, dict(lr=1e-2, weight_decay=0.1), 3, None),
    (FusedAdamW, dict(lr=1e-2, weight_decay=0.1), 2, 0.05),  # round-robin groups of the Gram laws
    (FusedSGD, dict(lr=0.05, weight_decay=0.1), 1, None),  # a = 1 - lr wd: decay from h, no kernel decay dots
    (FusedSGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01), 2, None),
]


@pytest.mark.parametrize("cls,kw,every,budget", CASES)
def test_overlap_ordering_is_bit_identical(monkeypatch, cls, kw, every, budget):
    """Both orderings, 7 steps: the same bits everywhere; the overlap ordering steps exactly the pass's
    tensors (v_proj / o_proj: the VO Gram laws of a RoPE model; with a budget, this step's group of
    them), then runs the pass once, then steps the others (the serial one: all, then the pass)."""
    ref, _ = _run(cls, kw, False, 7, drift_every=every, snapshot_budget=budget)
    holder = [None]
    log = _Log(monkeypatch, holder)

    def spy(o):
        holder[0] = o
        rec = o._record

        def rec_spy(*a, **k):
            rec(*a, **k)
            log.events.append(("done", None, None))
        o._record = rec_spy

    got, opt = _run(cls, kw, True, 7, spy=spy, drift_every=every, snapshot_budget=budget)
    _same(got, ref)
    assert len(ref["rows"]) == 7
    name = {i: n for i, t in enumerate(opt.tracker.tensors) for n, p in opt._model_names if p is t}
    gram = {i for i, n in name.items() if n.endswith(("v_proj.weight", "o_proj.weight"))}
    assert len(gram) == 4
    steps, cur = [], []
    for e in log.events:
        if e[0] == "done":
            steps.append(cur)
            cur = []
        else:
            cur.append(e)
    assert len(steps) == 7 and not cur
    seen = set()
    for k, evs in enumerate(steps):
        kinds = [e[0] for e in evs]
        if k % every:
            assert "drift" not in kinds
            continue
        assert kinds.count("drift") == 1  # once: not again in _record
        at = kinds.index("drift")
        before = {e[1] for e in evs[:at]}
        after = {e[1] for e in evs[at + 1:]}
        assert before and before <= gram and not before & after and "step" in kinds[at + 1:]
        assert len(before) + len(after) == len(kinds) - 1  # each tensor stepped once
        if budget is None:
            assert before == gram
        else:  # a group of the round robin: part of the Gram-law tensors
            assert before < gram
        seen |= before
    assert seen == gram  # round robin: every Gram-law tensor is stepped first on some drift step


def test_overlap_option_errors():
    m = lm()
    with pytest.raises(TypeError, match="overlap"):
        FusedAdamW(m.parameters(), track=m, overlap="yes")
    with pytest.raises(ValueError, match="track=model"):
        FusedAdamW(m.parameters(), overlap=True)
    assert FusedAdamW(m.parameters(), track=m).overlap is False  # the default (not measured on a GPU yet)


# --------------------------------------------------------------- the stream path, on a recording fake
class _FakeStream:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class _FakeApi:
    """``streams.CudaApi`` on CPU: keeps a current stream, numbers the events, logs every operation."""

    def __init__(self):
        self.main = _FakeStream("main")
        self.cur = self.main
        self.log = []
        self.n = 0
        self.on_wait_main = None

    def new_stream(self, device, priority):
        self.log.append(("new_stream", priority))
        return _FakeStream("side")

    def current(self, device):
        return self.cur

    def record(self, stream):
        self.n += 1
        self.log.append(("record", stream.name, self.n))
        return self.n

    def wait(self, stream, event):
        self.log.append(("wait", stream.name, event))
        if stream is self.main and self.on_wait_main is not None:
            self.on_wait_main()

    @contextlib.contextmanager
    def use(self, stream):
        prev, self.cur = self.cur, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.cur = prev
            self.log.append(("exit", stream.name))

    def record_stream(self, t, stream):
        self.log.append(("record_stream", id(t), stream.name))


@pytest.mark.parametrize("every", [1, 2])
def test_stream_path_on_a_fake_stream(monkeypatch, every):
    """The stream code path with a recording fake: the pass's host->device preparation on the main
    stream, a fork after the pass's tensors are stepped, the pass (and only it) on the side stream,
    the other tensors stepped on the main stream meanwhile, the join (main waits on an event of the
    side stream) before the terms are assembled, ``record_stream(main)`` on every output tensor, the
    snapshot copies alive until the join -- and the same bits as the serial ordering."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = _run(FusedAdamW, kw, False, 4, drift_every=every, snapshot_budget=None)
    api = _FakeApi()
    holder = [None]
    log = _Log(monkeypatch, holder, stream_of=lambda: api.cur.name)
    snaps = []
    prep = CK.prepare_drift

    def prep_spy(*a, **k):
        log.events.append(("prepare", None, api.cur.name))
        return prep(*a, **k)

    monkeypatch.setattr(CK, "prepare_drift", prep_spy)

    def spy(o):
        holder[0] = o
        o._stream_api = api
        take = o._sampler.snapshot

        def snap_spy(*a, **k):
            s = take(*a, **k)
            snaps.append(s)
            return s
        o._sampler.snapshot = snap_spy
        drift_pass = o._drift_pass

        def pass_spy(snap, news, a, mask):
            out = drift_pass(snap, news, a, mask)
            log.events.append(("assembled", out is log.pieces[-1], api.cur.name))
            return out
        o._drift_pass = pass_spy

        rec = o._record

        def rec_spy(*a, **k):
            rec(*a, **k)
            log.events.append(("done", None, api.cur.name))
        o._record = rec_spy

        def at_join():  # the snapshot copies are still held when the main stream waits
            assert snaps and len(snaps[-1].olds) > 0 and all(t is not None for t in snaps[-1].olds)
            log.events.append(("join", None, api.cur.name))
        api.on_wait_main = at_join

    got, opt = _run(FusedAdamW, kw, True, 4, spy=spy, drift_every=every, snapshot_budget=None)
    _same(got, ref)
    assert api.log[0] == ("new_stream", -1) and sum(1 for e in api.log if e[0] == "new_stream") == 1
    kinds = [e[0] for e in log.events]
    n_drift = len(range(0, 4, every))
    assert kinds.count("drift") == kinds.count("join") == kinds.count("assembled") == kinds.count("prepare") == n_drift
    # the stream of every event: the pass on the side stream, everything else on the main stream
    for kind, _, stream in log.events:
        assert stream == ("side" if kind == "drift" else "main"), (kind, stream)
    assert kinds.count("done") == 4
    i = 0
    for k in range(4):  # optimizer step k: events i .. its "done"
        e = kinds.index("done", i)
        evs, ks = log.events[i:e], kinds[i:e]
        i = e + 1
        if k % every:
            assert set(ks) == {"step"}
            continue
        p = ks.index("prepare")
        d, j, s = ks.index("drift"), ks.index("join"), ks.index("assembled")
        assert p < d < j < s
        before = {x[1] for x in evs[:p] if x[0] == "step"}
        meanwhile = {x[1] for x in evs[d:j] if x[0] == "step"}
        assert before and meanwhile and before.isdisjoint(meanwhile)  # the pass's tensors first, the rest meanwhile
        assert ks[:p] == ["step"] * p and ks[j:] == ["join", "assembled"]
        assert evs[s][1]  # _record took the very pieces made on the side stream
    # the fake's own log: record(main) -> wait(side) -> enter side -> exit -> record(side) -> wait(main)
    ops = [e for e in api.log if e[0] in ("record", "wait", "enter", "exit")]
    for k in range(n_drift):
        r1, w1, en, ex, r2, w2 = ops[6 * k: 6 * k + 6]
        assert (r1[:2], w1[:2], en, ex, r2[:2], w2[:2]) == (("record", "main"), ("wait", "side"), ("enter", "side"),
                                                             ("exit", "side"), ("record", "side"), ("wait", "main"))
        assert w1[2] == r1[2] and w2[2] == r2[2]
    recorded = {e[1] for e in api.log if e[0] == "record_stream"}
    assert all(e[2] == "main" for e in api.log if e[0] == "record_stream")
    for pieces in log.pieces:
        ids = {id(t) for t in streams.tensors_of(pieces)}
        assert ids and ids <= recorded
    assert opt._early is None  # nothing of a drift step is held between steps


def test_failing_pass_still_steps_every_weight(monkeypatch):
    """A DRIFT pass that raises (on the fake side stream): the other weights are still stepped (the
    same bits as a serial step), the side stream is joined, then the error propagates."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = _run(FusedAdamW, kw, False, 1, drift_every=1, snapshot_budget=None)

    def boom(*a, **k):
        raise RuntimeError("pass failed")

    monkeypatch.setattr(F, "drift_pieces", boom)
    api = _FakeApi()
    m = lm()
    opt = FusedAdamW(_groups(m, kw), **kw, track=m, every=1000, keep_last=True, overlap=True, drift_every=1,
                     snapshot_budget=None)
    opt._stream_api = api
    x = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    with pytest.raises(RuntimeError, match="pass failed"):
        opt.step()
    _same([p.detach() for p in m.parameters()], ref["params"])
    assert ("wait", "main", 2) in api.log and opt._early is None


def test_side_stream_join_records_every_output():
    """``SideStream`` alone: fork waits on the main stream's event, join on the side stream's, and
    every (distinct) tensor nested in the outputs is recorded once on the main stream."""
    api = _FakeApi()
    side = streams.SideStream("cpu", api, priority=-1)
    a, b = torch.zeros(2), torch.ones(3)
    main = side.fork()
    with side.on_side():
        assert api.cur is side.stream
    side.join(main, [(a, {"x": b}), None, (a,)])
    assert [e for e in api.log if e[0] != "record_stream"] == [
        ("new_stream", -1), ("record", "main", 1), ("wait", "side", 1), ("enter", "side"), ("exit", "side"),
        ("record", "side", 2), ("wait", "main", 2)]
    assert sorted(e[1] for e in api.log if e[0] == "record_stream") == sorted([id(a), id(b)])


# ------------------------------------------------------------------------ Triton (interpreter)
def test_overlap_bit_identical_triton():
    """The Triton step and DRIFT kernels (interpreter), fp32 accumulation: both orderings, same bits."""
    mk = dict(hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = _run(FusedAdamW, kw, False, 2, model_kw=mk, backend="triton", drift_every=1, snapshot_budget=None)
    got, _ = _run(FusedAdamW, kw, True, 2, model_kw=mk, backend="triton", drift_every=1, snapshot_budget=None)
    _same(got, ref)


def test_prepare_drift_leaves_only_launches(monkeypatch):
    """After ``kernels.prepare_drift``, the DRIFT call with the same arguments makes no host->device
    table copy (``Prepared._dev``): nothing in it waits on the stream it runs on.  Without it, a call on
    fresh copies (new addresses) re-binds the tables (the copies a side stream would wait on)."""
    from conserve.kernels import runner

    g = torch.Generator().manual_seed(0)
    olds = [torch.randn(8, 24, generator=g), torch.randn(24, 8, generator=g)]
    news = [o + 1e-2 * torch.randn(o.shape, generator=g) for o in olds]
    plan = Plan(grams=[GramTerm(View(0, (0, 0), 0, 8, 1, 24), 1.0, 0), GramTerm(View(1, (0, 0), 1, 8, 0, 24), -1.0, 0)],
                vec_size=0, gram_slots={8: 1})
    a = [0.999, 0.999]
    copies = []
    dev = runner.Prepared._dev

    def dev_spy(self, x, dtype=torch.int64):
        copies.append(1)
        return dev(self, x, dtype)

    monkeypatch.setattr(runner.Prepared, "_dev", dev_spy)
    want = CK.drift(plan, olds, news, a, backend="triton")
    fresh = [o.clone() for o in olds]
    del copies[:]
    CK.drift(plan, fresh, news, a, backend="triton")
    assert copies  # new addresses: re-bound inside the call
    fresh2 = [o.clone() for o in olds]
    CK.prepare_drift(plan, fresh2, news, a, backend="triton")
    del copies[:]
    got = CK.drift(plan, fresh2, news, a, backend="triton")
    assert not copies
    _same([x for x in got if x is not None], [x for x in want if x is not None])
    CK.prepare_drift(plan, fresh2, news, a, backend="torch")  # the torch twin: nothing to prepare


@pytest.mark.parametrize("cap", [1, 3])
def test_drift_program_cap_same_bits(cap):
    """``Config(drift_programs=cap)``: the DRIFT launch issued as slices of at most ``cap`` programs
    gives the very bits of the single launch (D = 24: several 16-wide output tiles and items)."""
    g = torch.Generator().manual_seed(1)
    olds = [torch.randn(24, 40, generator=g), torch.randn(40, 24, generator=g)]
    news = [o + 1e-2 * torch.randn(o.shape, generator=g) for o in olds]
    plan = Plan(grams=[GramTerm(View(0, (0, 0), 0, 24, 1, 40), 1.0, 0), GramTerm(View(1, (0, 0), 1, 24, 0, 40), -1.0, 0),
                       GramTerm(View(0, (0, 0), 0, 24, 1, 40), 0.5, 1)], vec_size=0, gram_slots={24: 2})
    a = [0.999, 0.98]
    want = CK.drift(plan, olds, news, a, backend="triton", config=CK.Config(gram_bt=16))
    from conserve.kernels import runner
    pr = runner.prepare(plan, olds, news, drift=True, config=CK.Config(gram_bt=16, drift_programs=cap))
    assert max(len(l.items) for b in pr.st.gram for l in b.launches) > cap  # the cap splits a launch
    got = CK.drift(plan, olds, news, a, backend="triton", config=CK.Config(gram_bt=16, drift_programs=cap))
    _same([x for x in got if x is not None], [x for x in want if x is not None])
    with pytest.raises(ValueError, match="drift_programs"):
        CK.Config(drift_programs=-1)


def test_stream_path_triton_no_host_copies_on_the_side_stream(monkeypatch):
    """The Triton step and DRIFT kernels (interpreter) through the stream path (recording fake), the
    pass's grid capped at one program per launch slice: the same bits as the serial ordering, and no
    host->device table copy (``Prepared._dev``) is made while the side stream is current (they are made
    before the fork by ``kernels.prepare_drift``: on a GPU a pageable copy there would wait on the fork
    event and hold the host)."""
    from conserve.kernels import runner

    mk = dict(hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    kw = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = _run(FusedAdamW, kw, False, 2, model_kw=mk, backend="triton", drift_every=1, snapshot_budget=None)
    api = _FakeApi()
    on_side = []
    dev = runner.Prepared._dev

    def dev_spy(self, x, dtype=torch.int64):
        on_side.append(api.cur.name == "side")
        return dev(self, x, dtype)

    monkeypatch.setattr(runner.Prepared, "_dev", dev_spy)

    def spy(o):
        o._stream_api = api
        o._drift_config = CK.Config(drift_programs=1)

    got, opt = _run(FusedAdamW, kw, True, 2, model_kw=mk, spy=spy, backend="triton", drift_every=1,
                    snapshot_budget=None)
    _same(got, ref)
    assert opt._fp.rest is not None and not opt._fp.rest.norms and not opt._fp.rest.sums  # Gram terms only
    assert sum(1 for e in api.log if e == ("enter", "side")) == 2
    assert on_side and not any(on_side)  # copies were made, none of them on the side stream


# ------------------------------------------------------------- allocation / stream ownership (fake)
_METADATA = frozenset({"__get__", "__set__", "data_ptr", "untyped_storage", "storage_offset", "stride", "size", "dim",
                       "numel", "element_size", "is_contiguous", "record_stream", "__len__", "__hash__", "__eq__",
                       "__repr__", "__format__", "dtype", "device", "shape"})


class _OwnershipApi(_FakeApi):
    """The recording fake plus the caching allocator's stream rules, checked on every torch call
    (``TorchFunctionMode``) between a fork and the join and after it.  A storage belongs to the
    stream current when it first appears as a new allocation (a tensor output whose storage is not
    a live one seen before).  Violations (``self.violations``):

    * ``freed-before-join``: a storage of the main stream used on the side stream and freed before the
      join (the allocator hands its block out again on the main stream while the side still reads it);
    * ``shared-in-window``: one storage used by both streams between the fork and the join (a race
      unless both only read it; the overlap ordering gives the two streams disjoint tensors);
    * ``side-alloc-used-on-main``: a storage allocated on the side stream used on the main stream after
      the join without ``record_stream(main)`` (its block may be reused on the side stream while the
      main stream still uses it), e.g. optimizer state or a cached table created inside the side context.

    Triton launches are not torch calls: with the Triton backend only the allocations are seen."""

    def __init__(self):
        super().__init__()
        self.owner = {}  # storage key -> (stream name, StorageWeakRef)
        self.side_used = {}  # storage key -> (StorageWeakRef, owner) used on the side stream this window
        self.main_used = set()  # storage keys used on the main stream this window
        self.recorded = set()  # storage keys given record_stream(main)
        self.window = False
        self.violations = []
        self.windows = 0

    @staticmethod
    def _key(t):
        return t.untyped_storage().data_ptr(), t.device.type

    def _seen(self, ts, new):
        from torch.multiprocessing.reductions import StorageWeakRef

        cur = self.cur.name
        for t in ts:
            if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
                continue
            k = self._key(t)
            own = self.owner.get(k)
            if own is not None and own[1].expired():  # a freed storage's address given to a new one
                was = self.side_used.pop(k, None)
                if was is not None and was[1] == "main":
                    self.violations.append(("freed-before-join", tuple(t.shape)))
                self.main_used.discard(k)
                self.recorded.discard(k)
                own = None
            if own is None:
                if not new:  # an input never seen as an output (made before the check started): main's
                    own = self.owner[k] = ("main", StorageWeakRef(t.untyped_storage()))
                else:
                    own = self.owner[k] = (cur, StorageWeakRef(t.untyped_storage()))
            if self.window:
                if cur == "side":
                    self.side_used.setdefault(k, (own[1], own[0]))
                    if k in self.main_used:
                        self.violations.append(("shared-in-window", tuple(t.shape)))
                else:
                    self.main_used.add(k)
                    if k in self.side_used:
                        self.violations.append(("shared-in-window", tuple(t.shape)))
            elif cur == "main" and own[0] == "side" and k not in self.recorded:
                self.violations.append(("side-alloc-used-on-main", tuple(t.shape)))

    def mode(self):
        from torch.overrides import TorchFunctionMode

        api = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "__name__", "") in _METADATA:  # no access to the data
                    return func(*args, **kwargs)
                ins = list(streams.tensors_of((list(args), kwargs)))
                api._seen(ins, new=False)
                out = func(*args, **kwargs)
                api._seen([t for t in streams.tensors_of(out) if isinstance(t, torch.Tensor)], new=True)
                return out

        return Mode()

    def wait(self, stream, event):
        super().wait(stream, event)
        if stream.name == "side":  # the fork
            self.window, self.windows = True, self.windows + 1
            self.side_used, self.main_used = {}, set()
        else:  # the join
            for k, (ref, own) in self.side_used.items():
                if own == "main" and ref.expired():
                    self.violations.append(("freed-before-join", k))
            self.window = False
            self.side_used, self.main_used = {}, set()

    def record_stream(self, t, stream):
        super().record_stream(t, stream)
        if stream.name == "main":
            self.recorded.add(self._key(t))


def _ownership_run(backend, every, budget, spy_extra=None):
    kw = dict(lr=1e-2, weight_decay=0.1)
    mk = None if backend == "torch" else dict(hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1)
    tk = dict(drift_every=every, snapshot_budget=budget, backend=backend)
    steps = 4 if backend == "torch" else 2
    api = _OwnershipApi()

    def spy(o):
        o._stream_api = api

    with api.mode():
        got, _ = _run(FusedAdamW, kw, True, steps, model_kw=mk, spy=spy, **tk)
    return got, api, (kw, mk, tk, steps)


@pytest.mark.parametrize("backend,every,budget", [("torch", 2, 0.05), ("triton", 1, None)])
def test_stream_ownership_on_a_fake_stream(backend, every, budget):
    """The overlap ordering through the stream path under ``_OwnershipApi``: no storage of the main
    stream freed while the side stream uses it, no storage used by both streams between the fork and
    the join, no side-stream allocation used on the main stream without ``record_stream`` -- and the
    serial ordering's bits."""
    got, api, (kw, mk, tk, steps) = _ownership_run(backend, every, budget)
    ref, _ = _run(FusedAdamW, kw, False, steps, model_kw=mk, **tk)
    _same(got, ref)
    assert api.windows == len(range(0, steps, every))
    assert not api.violations, api.violations[:5]


def test_torch_twin_pass_stays_on_the_callers_stream():
    """The torch twin's pass over the whole snapshot, put on the (fake) side stream, builds the index
    structures of ``kernels.reference`` that the every-step evaluation then reuses on the main stream
    (``side-alloc-used-on-main``: freed later, their blocks would go back to the side stream's pool while
    the main stream may still read them).  So without a test's api (CUDA) only a Triton pass is given
    the side stream; the twin's runs in place."""
    _, api, _ = _ownership_run("torch", 1, None)
    assert api.violations and {v[0] for v in api.violations} == {"side-alloc-used-on-main"}
    for backend, wants in (("torch", False), ("triton", True)):
        asked = []
        mk = None if backend == "torch" else dict(hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1)

        def spy(o):
            real = o._side_stream
            o._side_stream = lambda: asked.append(1) or real()

        _run(FusedAdamW, dict(lr=1e-2, weight_decay=0.1), True, 1, model_kw=mk, spy=spy, drift_every=1,
             snapshot_budget=None, backend=backend)
        assert bool(asked) == wants, backend


def test_ownership_fake_catches_the_hazards():
    """``_OwnershipApi`` itself: each of its three rules fires on a minimal breach."""
    api = _OwnershipApi()
    side = streams.SideStream("cpu", api)
    with api.mode():
        x = torch.ones(4)  # main
        main = side.fork()
        with side.on_side():
            y = x * 2  # side reads x; y: a side allocation
        x.add_(1)  # main writes x meanwhile
        del x  # and frees it before the join
        side.join(main)
        z = y + 1  # main uses a side allocation that was not recorded
    kinds = {v[0] for v in api.violations}
    assert kinds == {"shared-in-window", "freed-before-join", "side-alloc-used-on-main"}, api.violations
    del z
    api = _OwnershipApi()
    side = streams.SideStream("cpu", api)
    with api.mode():
        x = torch.ones(4)
        main = side.fork()
        with side.on_side():
            y = x * 2
        side.join(main, [y])
        z = y + x
    assert not api.violations, api.violations


def test_overlap_warns_once_on_cuda(monkeypatch):
    """``overlap=True`` with the CUDA stream api warns once (``RuntimeWarning``) that the ordering is not
    shown bit-identical on CUDA and not faster; a test's fake api does not warn."""
    import warnings

    class _Side:
        def __init__(self, device, api):
            self.api = api

    monkeypatch.setattr(F, "_OVERLAP_WARNED", False)
    monkeypatch.setattr(F.streams, "SideStream", _Side)
    m = lm()
    o1 = FusedAdamW(m.parameters(), lr=1e-2, track=m, overlap=True)
    o2 = FusedAdamW(m.parameters(), lr=1e-2, track=m, overlap=True)
    o1._stream_api = o2._stream_api = streams.CUDA
    with pytest.warns(RuntimeWarning, match="not shown bit-identical") as rec:
        o1._side_stream()
        o2._side_stream()
    assert sum(issubclass(w.category, RuntimeWarning) and "overlap=True" in str(w.message) for w in rec) == 1
    o3 = FusedAdamW(m.parameters(), lr=1e-2, track=m, overlap=True)
    o3._stream_api = _FakeApi()
    monkeypatch.setattr(F, "_OVERLAP_WARNED", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        o3._side_stream()
    for o in (o1, o2, o3):
        o.close()
