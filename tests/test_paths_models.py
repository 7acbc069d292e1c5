"""Cross-path consistency on models we did not write: the same gradients fed to ``conserve.track`` over a
torch optimizer and to the fused optimizer with ``track=`` must give the same law values, ``eps`` and
drift terms, entry by entry, at ``drift_every=1`` (every law) and at ``drift_every=N`` under the
default snapshot budget (on the entries both paths decomposed that step).

Models: tiny random HF transformers (Llama with GQA, tied or not, Mixtral with eager experts, GPT-2,
Qwen2, Qwen3's q/k norms, GPT-NeoX's partial rotary, Gemma's ``(1 + w)`` gains), a shrunk timm ViT and a plain-torch gated MLP; laws from ``conserve.detect``.  Pairs:
``torch.optim.AdamW`` vs ``FusedAdamW`` and ``torch.optim.SGD`` vs ``FusedSGD``, weight decay on (so the
decay factor ``a = 1 - lr wd`` is in every term).  fp32 weights and fp32 accumulation (the default):
tolerances are fp32 rounding of the quantities compared (the law values ``h`` for the measured change
and the residual, the step's largest term for decay / first / second), see ``_scale``.
"""
from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import conserve
from conserve.kernels import bilinear_reference, evaluate_reference
from conserve.optim import FusedAdam, FusedAdamW, FusedSGD
from conserve.tracking.values import Values, abs_plan as _abs_plan
from conserve.tracking.breakers import BrokenLawWarning

TERMS = ("measured", "decay", "first", "second", "residual")
RTOL = 2e-6  # fp32: the paths sum the same products in other orders (drift pass vs step statistics), not more


# --------------------------------------------------------------------------------------- models
def _hf(kind: str) -> nn.Module:
    T = pytest.importorskip("transformers")
    common = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32)
    kw = dict(attn_implementation="eager")
    if kind == "llama":  # GQA, untied head (translation law)
        cfg = T.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    elif kind == "llama_tied":  # lm_head tied to embed_tokens
        cfg = T.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **common)
    elif kind == "mixtral":  # 3-D expert tensors, softmax router
        cfg = T.MixtralConfig(num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, **common)
        kw["experts_implementation"] = "eager"
    elif kind == "gpt2":  # Conv1D (transposed) q/k/v in one c_attn, no RoPE (qk Gram laws)
        cfg = T.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    elif kind == "qwen2":  # q/k/v biases
        cfg = T.Qwen2Config(num_key_value_heads=2, **common)
    elif kind == "qwen3":  # per-head q/k norms (qk_norm_gain laws, balanced at init: h_0 = 0)
        cfg = T.Qwen3Config(num_key_value_heads=2, head_dim=4, **common)
    elif kind == "neox":  # fused query_key_value, partial rotary
        cfg = T.GPTNeoXConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=32)
    else:  # gemma: (1 + w) gains (shifted norm terms), tied head
        cfg = T.GemmaConfig(num_key_value_heads=2, head_dim=4, **common)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg, **kw)


def _vit() -> nn.Module:
    try:
        import timm
    except Exception as e:  # noqa: BLE001 - timm missing, or its torchvision import broken
        pytest.skip(f"timm not importable: {e}")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=48,
                             num_heads=3, num_classes=5)


class GatedMLP(nn.Module):
    """Plain torch: pre-norm SwiGLU block with a residual and a classifier head (structural detection)."""

    def __init__(self, d=12, hidden=20, classes=5):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.norm(x)
        return self.head(x + self.down(nn.functional.silu(self.gate(h)) * self.up(h)))


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return GatedMLP()


BUILD = {"llama": functools.partial(_hf, "llama"), "llama_tied": functools.partial(_hf, "llama_tied"),
         "mixtral": functools.partial(_hf, "mixtral"), "gpt2": functools.partial(_hf, "gpt2"),
         "qwen2": functools.partial(_hf, "qwen2"), "qwen3": functools.partial(_hf, "qwen3"),
         "neox": functools.partial(_hf, "neox"), "gemma": functools.partial(_hf, "gemma"), "vit": _vit,
         "plain": _plain}


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in the logits' dtype (fp32 for half-precision models)."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _loss(name: str, m: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = next(m.parameters()).dtype
    if name == "vit":
        return _ce(m(torch.randn(2, 3, 32, 32, generator=g).to(dt)), torch.randint(0, 5, (2,), generator=g))
    if name == "plain":
        return _ce(m(torch.randn(6, 12, generator=g).to(dt)), torch.randint(0, 5, (6,), generator=g))
    ids = torch.randint(0, 40, (2, 9), generator=g)
    return _ce(m(input_ids=ids[:, :-1]).logits, ids[:, 1:])  # (HF's own loss upcasts float64 logits to float32)


# ----------------------------------------------------------------------------------- the harness
OPT = {"adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                 lambda ps, **kw: FusedAdamW(ps, lr=1e-2, weight_decay=0.1, **kw)),
       "sgd": (lambda ps: torch.optim.SGD(ps, lr=5e-2, weight_decay=0.1),
               lambda ps, **kw: FusedSGD(ps, lr=5e-2, weight_decay=0.1, **kw)),
       # the decay factor is 1 for these (coupled L2 / momentum: the decay is inside Delta)
       "adam_l2": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
                   lambda ps, **kw: FusedAdam(ps, lr=1e-2, weight_decay=0.1, **kw)),
       "nesterov": (lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
                    lambda ps, **kw: FusedSGD(ps, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.1, **kw))}
DECOUPLED = {"adamw": True, "sgd": True, "adam_l2": False, "nesterov": False}  # a = 1 - lr wd, else 1


def _decomposed(opt, step: int):
    """Host bool arrays ``(vec, {D: slots})``: the entries drift step ``step`` (1-based) of ``opt`` decomposed."""
    tr = opt.tracker
    j = (step - 1) // tr.drift_every
    fp = getattr(opt, "_fp", None)
    if fp is not None:  # fused: every entry of the step statistics, plus the sampler's group of the rest
        if fp.rest is None:
            return (np.ones(tr.compiled.plan.vec_size, bool),
                    {d: np.ones(n, bool) for d, n in tr.compiled.plan.gram_slots.items()})
        m = opt._sampler.mask(j)
        return m.vec_np | ~fp.rest_vec, m.gram_np
    m = tr.sampler.mask(j)
    return m.vec_np, m.gram_np


def _per_family(tr, values, vm, gm):
    """``{family: 1-D float64 tensor}`` of ``values`` (a ``Values``) at the entries ``vm``/``gm``."""
    fam = tr.layout.fam_all.cpu().numpy()
    out = {}
    for fi, f in enumerate(tr.families):
        sel = vm & (fam[: len(vm)] == fi)
        parts = [values.vec[torch.from_numpy(sel)].double()]
        for d, g in values.grams.items():
            o = tr.layout.flat_at[d]
            s = gm[d] & (fam[o: o + len(gm[d])] == fi)
            parts.append(g[torch.from_numpy(s)].double().reshape(-1))
        x = torch.cat(parts)
        if x.numel():
            out[f] = x
    return out


def reference_terms(tr, old, a) -> dict:
    """The identity's terms in float64 from the weights before (``old``) and after the step (spec "Discrete
    steps"): ``decay = h(a old) - h(old)``, ``first = 2 B(a old, Delta)`` (+ ``c . Delta`` for linear laws),
    ``second = h(Delta)``, ``Delta = new - a old`` -- independent of both paths' kernels and assembly."""
    plan = tr.compiled.plan
    ao = [o.double() * x for o, x in zip(old, a)]
    d = [t.detach().double() - x for t, x in zip(tr.tensors, ao)]
    ev = lambda xs: Values(*evaluate_reference(plan, xs, fp64=True))  # noqa: E731
    h_old, h_a, hd = ev([o.double() for o in old]), ev(ao), ev(d)
    b = Values(*bilinear_reference(plan, ao, d, fp64=True))
    lin = tr.compiled.linear_mask.double()
    return {"decay": h_a.map(torch.sub, h_old),
            "first": Values(2 * b.vec + lin * hd.vec, {k: 2 * g for k, g in b.grams.items()}),
            "second": Values((1 - lin) * hd.vec, hd.grams)}


def run_pair(name: str, algo: str, every: int, budget, steps: int | None = None, dtype=None, drop=(), fp64=False):
    """Both paths over the same gradients (computed on the ``conserve.track`` model, copied to the fused
    one; the parameters named in ``drop`` get no gradient on even steps). Returns ``(track opt, fused opt, steps)`` where ``steps`` lists, per drift step, ``{family:
    {term: (track entries, fused entries[, float64 reference]), "h": magnitude of h_k}}`` at the entries both
    decomposed."""
    m_a = BUILD[name]()
    if dtype is not None:
        m_a = m_a.to(dtype)
    m_b = copy.deepcopy(m_a)
    # cumulative: the totals' per-entry decomposition is compared (kept by default in exact mode only)
    kw = dict(every=10_000, drift_every=every, keep_last=True, fp64=fp64, cumulative=True)
    if budget != "default":
        kw["snapshot_budget"] = budget
    make_torch, make_fused = OPT[algo]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BrokenLawWarning)
        a = conserve.track(make_torch(m_a.parameters()), m_a, laws=conserve.detect(m_a), **kw)
        b = make_fused(m_b.parameters(), track=m_b, laws=conserve.detect(m_b), **kw)
    assert [l.name for l in a.tracker.laws] == [l.name for l in b.tracker.laws]
    if steps is None:  # every sampler group of both paths comes round once
        steps = 1 if budget is None else every * max(len(a.tracker.sampler.groups), len(b._sampler.groups))
        steps = max(steps, 3)
    grads_b = dict(m_b.named_parameters())
    out = []
    lr, wd = a.param_groups[0]["lr"], a.param_groups[0]["weight_decay"]
    for k in range(1, steps + 1):
        old = [t.detach().clone() for t in a.tracker.tensors]
        a.zero_grad()
        b.zero_grad()
        _loss(name, m_a, k).backward()
        for n, p in m_a.named_parameters():
            if k % 2 == 0 and n in drop:
                p.grad = None
            if p.grad is not None:
                grads_b[n].grad = p.grad.clone()
        a.step()
        b.step()
        if (k - 1) % every:
            continue
        # a = 1 - lr wd (decoupled rules) for every parameter that was stepped (one param group; 1 without a gradient)
        dec = 1 - lr * wd if DECOUPLED[algo] else 1.0
        ref = (reference_terms(a.tracker, old, [1.0 if p.grad is None else dec for p in a.tracker.params])
               if fp64 else {})  # (fp32 accumulation: the paths are compared with each other only)
        va, ga = _decomposed(a, k)
        vb, gb = _decomposed(b, k)
        vm, gm = va & vb, {d: ga[d] & gb[d] for d in ga}
        step = {}
        # the magnitude of each entry (every sign +): the scale of its fp32 rounding, also where h_k ~ 0
        mag = Values(*evaluate_reference(_abs_plan(a.tracker.compiled.plan), old, fp64=True))
        h = _per_family(a.tracker, mag, vm, gm)
        for t in TERMS:
            ta = _per_family(a.tracker, a.tracker.last[t], vm, gm)
            tb = _per_family(b.tracker, b.tracker.last[t], vm, gm)
            tr_ = _per_family(a.tracker, ref[t], vm, gm) if t in ref else {}
            for f in ta:
                step.setdefault(f, {"h": h[f]})[t] = (ta[f], tb[f]) + ((tr_[f],) if t in ref else ())
        out.append(step)
    return a, b, out


def _scale(fam: dict) -> tuple[float, float]:
    """(largest magnitude of h_k -- the law with every sign + --, largest |term|) of one family at one drift
    step: fp32 rounding of the law values is ~1e-7 of the first (also for a balanced law, h_k ~ 0: Qwen3's
    q/k norm gains start equal); the terms (computed directly) differ by ~1e-7 of the step's largest term,
    plus ~1e-8 of the magnitude where a sampled step compares only a few small entries."""
    big = lambda x: x.abs().max().item() if x.numel() else 0.0  # noqa: E731
    return big(fam["h"]), max(big(fam[t][0]) for t in ("measured", "decay", "first", "second"))


def magnitudes(tr) -> dict:
    """Per family the norm of the law magnitudes (every sign +) now: the scale of ``totals()``' rounding
    (``totals()['scale']`` = ||h_0|| is 0 for a law that starts balanced)."""
    mag = Values(*evaluate_reference(_abs_plan(tr.compiled.plan), [t.detach() for t in tr.tensors], fp64=True))
    return dict(zip(tr.families, tr.layout.fam_norm(mag).tolist()))


def check_agree(steps, what: str, rtol: float = RTOL) -> int:
    """The two paths' terms agree entry by entry at every compared drift step; returns how many entries
    were compared (a test that compares nothing cannot fail)."""
    n = 0
    for k, step in enumerate(steps):
        ts = max([_scale(fam)[1] for fam in step.values()] + [0.0])  # the step's largest term (SGD's first-order
        for f, fam in step.items():                                   # term is rounding noise of that size)
            hs = _scale(fam)[0]
            for t in TERMS:
                x, y = fam[t][:2]
                n += x.numel() if t == "measured" else 0
                tol = 2e-5 * hs if t in ("measured", "residual") else rtol * ts + 3e-8 * hs
                err = (x - y).abs().max().item()
                assert err <= tol, f"{what} drift step {k}: {f}/{t} differs by {err:.3e} (tolerance {tol:.1e})"
                if len(fam[t]) > 2:  # both paths against the float64 decomposition
                    for path, z in zip(("track", "fused"), (x, y)):
                        err = (z - fam[t][2]).abs().max().item()
                        assert err <= rtol * ts, f"{what} drift step {k}: {path} {f}/{t} is {err:.3e} off float64 ({rtol * ts:.1e})"
    return n


def check_closes(steps, what: str, path: int) -> None:
    """The identity closes on each path: residual at the fp32 rounding of h."""
    for k, step in enumerate(steps):
        for f, fam in step.items():
            hs, _ = _scale(fam)
            r = fam["residual"][path].abs().max().item()
            assert r <= 2e-5 * hs, f"{what} drift step {k}: {f} residual {r:.3e} vs magnitude {hs:.3e}"


HF_NAMES = ["llama", "mixtral", "gpt2", "qwen2", "qwen3", "neox", "gemma"]


@pytest.mark.parametrize("algo", ["adamw", "sgd"])
@pytest.mark.parametrize("name", HF_NAMES + ["llama_tied", "vit", "plain"])
def test_track_and_fused_agree_every_step(name, algo):
    """drift_every=1, every law each step: the same drift terms, eps rows and totals on both paths."""
    a, b, steps = run_pair(name, algo, every=1, budget=None, steps=3)
    assert check_agree(steps, f"{name}/{algo}") > 0
    check_closes(steps, f"{name}/{algo} track", 0)
    check_closes(steps, f"{name}/{algo} fused", 1)
    ra, rb = a.tracker.flush(), b.tracker.flush()
    ref = None
    for i, (x, y) in enumerate(zip(ra, rb)):
        for key in x:
            if key.startswith("eps/") and abs(x[key] - y[key]) > 1e-5 * abs(y[key]) + 3e-6:
                # the paths round differently (the fused twin sums squares by torch.sum, the evaluator by
                # vector_norm); a law that is a difference of near-equal norms (rope_pair here) turns that
                # into an eps difference of a few 1e-6: both must then be within fp32 reach of float64
                if ref is None:
                    a64, _, _ = run_pair(name, algo, every=1, budget=None, steps=3, fp64=True)
                    ref = a64.tracker.flush()
                z = ref[i][key]
                for v in (x[key], y[key]):
                    assert abs(v - z) <= 2e-4 * abs(z) + 3e-6, (key, x[key], y[key], z)
    ta, tb, mag = a.tracker.totals(), b.tracker.totals(), magnitudes(a.tracker)
    for f in ta:
        for key in ("decay", "first", "second", "predicted", "measured_sampled", "scale"):
            tol = 1e-5 * max(ta[f][key], ta[f]["predicted"], ta[f]["decay"]) + 1e-6 * mag[f]
            assert abs(ta[f][key] - tb[f][key]) <= tol, (f, key, ta[f][key], tb[f][key])
        assert ta[f]["sampled_steps"] == tb[f]["sampled_steps"] == 3
        for t in (ta, tb):  # every step decomposed: the sums telescope to h_k - h_0, and the identity closes
            assert abs(t[f]["measured_sampled"] - t[f]["measured"]) <= 1e-5 * mag[f], (f, t[f])
            assert abs(t[f]["predicted"] - t[f]["measured"]) <= 2e-5 * mag[f], (f, t[f])


@pytest.mark.parametrize("algo", ["adamw", "sgd"])
@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3", "gemma", "vit"])
def test_track_and_fused_agree_on_sampled_steps(name, algo):
    """drift_every=2 and the default snapshot budget: until every sampler group of both paths came round,
    the entries both decomposed on a drift step have the same terms; eps rows agree every step."""
    a, b, steps = run_pair(name, algo, every=2, budget="default")
    assert len(a.tracker.sampler.groups) > 1  # the budget really samples
    assert check_agree(steps, f"{name}/{algo} sampled") > 0
    check_closes(steps, f"{name}/{algo} track", 0)
    check_closes(steps, f"{name}/{algo} fused", 1)
    ta, tb, mag = a.tracker.totals(), b.tracker.totals(), magnitudes(a.tracker)
    for f in ta:
        for key in ("measured", "eps", "scale"):  # whole-law quantities: the same on both paths
            assert abs(ta[f][key] - tb[f][key]) <= 1e-5 * abs(ta[f][key]) + 1e-6 * (mag[f] if key != "eps" else 1), \
                (f, key, ta[f][key], tb[f][key])
        for t in (ta, tb):  # each path's totals close the identity over what it decomposed
            assert abs(t[f]["predicted"] - t[f]["measured_sampled"]) <= 1e-5 * mag[f] + 1e-3 * t[f]["predicted"], \
                (f, t[f])
            assert 0 < t[f]["sampled_steps"] <= t[f]["steps"] // 2 + 1


@pytest.mark.parametrize("algo", ["adamw", "sgd", "adam_l2", "nesterov"])
@pytest.mark.parametrize("name", ["llama", "mixtral", "gpt2", "qwen2", "vit", "plain"])
def test_both_paths_match_the_float64_decomposition(name, algo):
    """float64 accumulation: each path's decay / first / second equal the float64 decomposition of the
    step (``reference_terms``: ``decay = h(a theta) - h(theta) = (a^2 - 1) h`` with ``a = 1 - lr wd``);
    Adam with coupled L2 and Nesterov SGD (``a = 1``: the decay is in Delta) too. AdamW on fp32 weights;
    SGD on float64 weights, where the first-order term is resolved at its true
    size, ~0 (Noether: 1e-9 of the decay and second-order terms; fp32 gradients leave ~1e-5 of rounding
    in it). (Gemma's shifted ``(1 + w)`` gain has no bilinear reference: it is in the fp32 cross-path tests.)"""
    a, b, steps = run_pair(name, algo, every=1, budget=None, steps=2, fp64=True,
                           dtype=torch.float64 if algo == "sgd" else None)
    assert check_agree(steps, f"{name}/{algo} fp64", rtol=1e-9) > 0
    for step in steps:
        for f, fam in step.items():
            assert len(fam["decay"]) == 3
            if algo == "sgd":
                big = max(fam[t][0].abs().max().item() for t in ("decay", "second"))
                # (Mixtral's router softmax runs in float32 whatever the weights: its law holds to fp32 rounding)
                bound = 1e-6 if f == "router_sum" else 1e-9
                for path in (0, 1):
                    assert fam["first"][path].abs().max().item() <= bound * big, (f, path)


# --------------------------------------------------------------------------- inputs and stacks
def _transposed(build):
    """``build`` with every 2-D Linear weight held as a transposed (non-contiguous) view."""
    def make():
        m = build()
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(mod.weight.detach().t().contiguous().t())
        return m
    return make


def _no_decay_groups(build_opt):
    """The HF recipe: weight decay on matrices only (gain laws then mix decay factors: ``broken_by``)."""
    def make(m_params, **kw):
        ps = list(m_params)
        return build_opt([{"params": [p for p in ps if p.dim() >= 2]},
                          {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], **kw)
    return make


@pytest.mark.parametrize("variant", ["bf16", "transposed", "grad_none", "no_decay_groups"])
@pytest.mark.parametrize("algo", ["adamw", "sgd"])
@pytest.mark.parametrize("name", ["llama", "vit"])
def test_paths_agree_on_other_inputs(name, algo, variant, monkeypatch):
    """bf16 weights (fp32 law values), transposed weights, parameters without gradient on some steps,
    weight decay on the matrices only: every step and sampled steps agree across the paths."""
    kw = {}
    if variant == "bf16":
        kw["dtype"] = torch.bfloat16
    elif variant == "transposed":
        monkeypatch.setitem(BUILD, name, _transposed(BUILD[name]))
        assert any(not p.is_contiguous() and p.dim() == 2 for p in BUILD[name]().parameters())
    elif variant == "grad_none":
        kw["drop"] = {"llama": ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                                "model.norm.weight"),
                      "vit": ("blocks.0.mlp.fc1.weight", "blocks.1.attn.proj.weight", "blocks.0.norm1.weight")}[name]
    else:
        torch_opt, fused_opt = OPT[algo]
        monkeypatch.setitem(OPT, algo, (_no_decay_groups(torch_opt), _no_decay_groups(fused_opt)))
    for every, budget, steps in ((1, None, 4), (2, "default", 12)):
        a, b, drift = run_pair(name, algo, every=every, budget=budget, steps=steps, **kw)
        assert check_agree(drift, f"{name}/{algo}/{variant}") > 0
        check_closes(drift, f"{name}/{algo}/{variant} track", 0)
        check_closes(drift, f"{name}/{algo}/{variant} fused", 1)
        assert a.tracker.broken_by == b.tracker.broken_by
        assert bool(a.tracker.broken_by) == (variant == "no_decay_groups")


class _Rows:
    def __init__(self):
        self.rows = []

    def write(self, step, rec):
        self.rows.append(dict(rec))

    def close(self):
        pass


def _make(path: str, algo: str, m: nn.Module, sink=None, **kw):
    make_torch, make_fused = OPT[algo]
    kw = {"every": 10_000, "drift_every": 2, "sinks": [sink] if sink is not None else [], **kw}
    return conserve.track(make_torch(m.parameters()), m, **kw) if path == "track" else make_fused(m.parameters(), track=m, **kw)


def _train(name, m, opt, ks, accumulate=1, keep_grads=False):
    for k in ks:
        opt.zero_grad(set_to_none=not keep_grads)
        for j in range(accumulate):
            (_loss(name, m, 100 * k + j) / accumulate).backward()
        opt.step()


def _rows_close(got, want, rtol, what, keys=("eps/", "drift/")):
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for x, y in zip(got, want):
        for key, v in y.items():
            if key.startswith(keys):
                assert (v != v and x[key] != x[key]) or abs(x[key] - v) <= rtol * abs(v) + 1e-6, (what, x["step"], key)


@pytest.mark.parametrize("algo", ["adamw", "sgd"])
def test_state_dict_round_trip_mid_run_continues_the_series_on_either_path(algo):
    """Save after 3 steps (drift_every=2, default budget), load into a fresh model and optimizer of the same
    path or of the other one, run 3 more: the rows are those of the uninterrupted run (bit for bit on the
    same path: the sampler's round robin continues; the eps columns within fp32 rounding across the paths,
    whose drift columns cover other entries under the budget)."""
    name = "llama"
    full, totals = {}, {}
    for path in ("track", "fused"):
        sink, m = _Rows(), BUILD[name]()
        opt = _make(path, algo, m, sink)
        _train(name, m, opt, range(1, 7))
        opt.close()
        full[path], totals[path] = sink.rows, opt.tracker.totals()
    for src, dst in (("track", "track"), ("fused", "fused"), ("track", "fused"), ("fused", "track")):
        first, m = _Rows(), BUILD[name]()
        opt = _make(src, algo, m, first)
        _train(name, m, opt, range(1, 4))
        saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
        opt.close()
        second, m2 = _Rows(), BUILD[name]()
        m2.load_state_dict(saved["model"])
        opt2 = _make(dst, algo, m2, second)
        opt2.load_state_dict(saved["opt"])
        _train(name, m2, opt2, range(4, 7))
        opt2.close()
        if src == dst:
            _rows_close(first.rows + second.rows, full[src], 0.0, f"{src}->{dst}")
            got = opt2.tracker.totals()
            assert all(got[f][k] == v or (v != v and got[f][k] != got[f][k]) for f, t in totals[src].items()
                       for k, v in t.items()), (src, got, totals[src])
        else:
            _rows_close(first.rows + second.rows, full[src], 1e-4, f"{src}->{dst}", keys=("eps/",))


@pytest.mark.parametrize("path", ["track", "fused"])
def test_compiled_model_accumulation_and_kept_grads_book_what_eager_books(path):
    """torch.compile(model) with a tracked optimizer, gradient accumulation over two micro-batches and
    zero_grad(set_to_none=False): the same rows as the eager model with freshly zeroed gradients."""
    name, rows = "llama", {}
    for how in ("eager", "compiled"):
        sink, m = _Rows(), BUILD[name]()
        opt = _make(path, "adamw", m, sink)
        model = torch.compile(m, backend="eager") if how == "compiled" else m
        _train(name, model, opt, range(1, 5), accumulate=2, keep_grads=how == "compiled")
        opt.close()
        rows[how] = sink.rows
    _rows_close(rows["compiled"], rows["eager"], 1e-5, path)


def test_add_param_group_after_tracking_started_agrees_across_paths():
    """The down projections join the optimizer after step 1 (add_param_group): until then their laws are
    broken_by "not held" on both paths, afterwards by nothing; the terms agree throughout."""
    name, opts, models = "llama", {}, {}
    for path in ("track", "fused"):
        m = BUILD[name]()
        held = [p for n, p in m.named_parameters() if "down_proj" not in n]
        make_torch, make_fused = OPT["adamw"]
        kw = dict(every=10_000, drift_every=1, snapshot_budget=None, keep_last=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BrokenLawWarning)
            opts[path] = conserve.track(make_torch(held), m, **kw) if path == "track" else make_fused(held, track=m, **kw)
        models[path] = m
    assert opts["track"].tracker.broken_by == opts["fused"].tracker.broken_by != {}
    for k in range(1, 4):
        if k == 2:
            for path, o in opts.items():
                o.add_param_group({"params": [p for n, p in models[path].named_parameters() if "down_proj" in n]})
            assert opts["track"].tracker.broken_by == opts["fused"].tracker.broken_by == {}
        for path, o in opts.items():
            o.zero_grad()
        _loss(name, models["track"], k).backward()
        grads = {n: p.grad for n, p in models["track"].named_parameters()}
        for n, p in models["fused"].named_parameters():
            p.grad = grads[n].clone()
        for o in opts.values():
            o.step()
        la, lb = opts["track"].tracker.last, opts["fused"].tracker.last
        scale = max(la[t].vec.abs().max().item() for t in ("decay", "first", "second"))
        for t in ("decay", "first", "second"):
            assert (la[t].vec - lb[t].vec).abs().max().item() <= RTOL * scale, (k, t)
            for d in la[t].grams:
                assert (la[t].grams[d] - lb[t].grams[d]).abs().max().item() <= RTOL * scale, (k, t, d)


@pytest.mark.parametrize("algo", ["adamw", "sgd"])
def test_a_law_split_over_lr_groups_is_warned_and_broken_on_both_paths(algo):
    """Attention at half the lr of the rest: the gain laws that read q/k/v beside their norm weight are
    warned once (BrokenLawWarning naming the lrs) and marked broken_by, the same laws on both paths."""
    broken = {}
    for path in ("track", "fused"):
        m = BUILD["llama"]()
        att = [p for n, p in m.named_parameters() if "self_attn" in n]
        rest = [p for n, p in m.named_parameters() if "self_attn" not in n]
        groups = [{"params": rest}, {"params": att, "lr": 1e-3}]
        make_torch, make_fused = OPT[algo]
        with pytest.warns(BrokenLawWarning, match="different lr in one law") as w:
            opt = conserve.track(make_torch(groups), m) if path == "track" else make_fused(groups, track=m)
        assert len([x for x in w if issubclass(x.category, BrokenLawWarning)]) == 1
        broken[path] = opt.tracker.broken_by
        assert broken[path]
        assert {l.family for l in opt.tracker.laws if l.name in broken[path]} == {"gain"}
    assert broken["track"] == broken["fused"]
