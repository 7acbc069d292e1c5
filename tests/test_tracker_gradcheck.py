"""The tracker's gradient check (``check_gradients=True``): the row columns, the warning at flush, the fused
optimizers, the integrations' dtype and ``conserve run --check-gradients``."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import conserve
from conserve.integrations._run import grad_dtype_of
from conserve.models import DecoderLM, LMConfig
from conserve.tracking.gradients import GradientCheckWarning

CFG = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=24, max_position_embeddings=16)


def _model(seed=0):
    torch.manual_seed(seed)
    return DecoderLM(LMConfig(**CFG))


def _train(opt, m, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, CFG["vocab_size"], (4, 12), generator=g)
        opt.zero_grad()
        logits = m(x)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
        opt.step()


def _rows(opt):
    return opt.tracker.flush() if hasattr(opt, "tracker") else opt.flush()


def test_clean_gradients_stay_silent_and_fill_the_columns_on_the_cadence():
    m = _model()
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), m, every=100,
                         check_gradients=True, loss="ce", drift_every=2)
    tr = opt.tracker
    cols = [k for k in tr.metric_names if k.startswith("grad_check/")]
    assert "grad_check/vo" in cols and "grad_check/vo/layer0" in cols and "grad_check/translation" in cols
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        _train(opt, m, 4)
        rows = tr.flush()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # checked on steps 1, 3 (the drift cadence); NaN on the others
        v = r["grad_check/swiglu"]
        assert (0 <= v < 1e-5) if r["step"] % 2 == 1 else math.isnan(v), (r["step"], v)
    res = tr.gradient_check()
    assert res.ok and res.steps == 2 and {c.family for c in res.laws} >= {"vo", "swiglu", "gain", "translation"}
    opt.close()


def test_a_hook_on_one_layers_o_proj_gradient_is_flagged_at_flush_with_its_family_and_layer():
    m = _model()
    m.layers[0].self_attn.o_proj.weight.register_hook(lambda g: g * 1.5)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce")
    _train(opt, m, 2)
    with pytest.warns(GradientCheckWarning, match=r"vo.*layer 0") as rec:
        rows = opt.tracker.flush()
    msg = str(rec[0].message)
    assert "o_proj" in msg and "a bug in the gradient" in msg and "clip_grad_value_" in msg
    flagged = opt.tracker.gradient_check().flagged
    assert flagged and {(c.family, c.layer) for c in flagged} == {("vo", 0)}
    assert rows[0]["grad_check/vo/layer0"] > 100 * rows[0]["grad_check/vo/layer1"]
    with warnings.catch_warnings():  # warned once per law
        warnings.simplefilter("error", GradientCheckWarning)
        _train(opt, m, 1)
        opt.tracker.flush()
    opt.close()


def test_the_fused_optimizer_checks_the_gradient_before_its_decay():
    m = _model()
    opt = conserve.optim.FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, track=m, check_gradients=True,
                                    loss="ce", every=100, drift_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        _train(opt, m, 2)
        opt.flush()  # decoupled decay inside the step: not in the checked gradient
    assert opt.tracker.gradient_check().ok
    for p in m.parameters():  # coupled L2 folded into p.grad: every quadratic law sees it
        p.register_hook(lambda g, p=p: g + 0.1 * p.detach())
    _train(opt, m, 1)
    with pytest.warns(GradientCheckWarning):
        opt.flush()
    fams = {c.family for c in opt.tracker.gradient_check().flagged}
    assert {"vo", "swiglu"} <= fams
    opt.close()


def test_the_translation_law_assumed_by_detection_is_checked_with_a_note():
    m = _model()
    m.lm_head.weight.register_hook(lambda g: g + 1e-2)  # a constant over the vocabulary: translation and the gain
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True)
    _train(opt, m, 1)
    with pytest.warns(GradientCheckWarning, match="detection assumed"):
        opt.tracker.flush()
    opt.close()
    m = _model()
    m.lm_head.weight.register_hook(lambda g: g + 1e-2)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True,
                         grad_check_ignore=["translation", "lm_head.*"])  # a family; a parameter pattern
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        _train(opt, m, 1)
        opt.tracker.flush()
    res = opt.tracker.gradient_check()
    assert not any("lm_head.weight" in c.params for c in res.laws) and any("ignored" in why for _, why in res.skipped)
    opt.close()


def test_without_the_check_the_rows_have_no_columns_and_nothing_is_read():
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100)
    assert not any(k.startswith("grad_check/") for k in opt.tracker.metric_names)
    assert opt.tracker.gradient_check() is None
    _train(opt, m, 1)
    assert not any(k.startswith("grad_check/") for k in opt.tracker.flush()[0])
    opt.close()


def test_a_missing_gradient_names_the_laws_and_the_fix():
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce")
    m.layers[1].mlp.down_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj\.weight.*ignore"):
        _train(opt, m, 1)
    opt.close()


def test_mixed_precision_sets_the_floors_dtype():
    assert grad_dtype_of("bf16-mixed", {"check_gradients": True})["grad_dtype"] == "bfloat16"
    assert grad_dtype_of("16-mixed", {"check_gradients": True})["grad_dtype"] == "float16"
    assert "grad_dtype" not in grad_dtype_of("32-true", {"check_gradients": True})
    assert grad_dtype_of("bf16", {"check_gradients": True, "grad_dtype": "float32"})["grad_dtype"] == "float32"
    assert grad_dtype_of("bf16", {}) == {}
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, check_gradients=True, grad_dtype="bfloat16")
    assert opt.tracker.grad_watch.check.dtype == "bfloat16"
    opt.close()


def test_conserve_run_check_gradients(tmp_path, capsys):
    from conserve.cli import main

    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--steps", "3", "--every", "3", "--no-progress", "--check-gradients",
                 "--size", "tiny"]) == 0
    text = capsys.readouterr().out
    assert "gradient check (float32 gradient, 3 steps" in text and "0 of" in text
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["grad_check/swiglu"] < 1e-5 for r in recs)
    assert json.loads((out / "config.json").read_text())["check_gradients"] is True
    summary = (out / "summary.md").read_text()
    assert "## Gradient check" in summary and "| swiglu | 3 |" in summary and "at rounding level" in summary
    g = json.loads((out / "summary.json").read_text())["gradient_check"]["translation"]
    assert g["checked_steps"] == 3 and g["steps_above"] == 0 and g["floor"] > 1e-6  # the linear laws' floor


def test_the_report_reads_a_flagged_step_from_the_rows(tmp_path):
    from conserve.report import gradient_check

    rows = [{"step": 1, "grad_check/vo": 1e-8}, {"step": 2, "grad_check/vo": float("nan")},
            {"step": 3, "grad_check/vo": 3e-3, "grad_check/vo/layer0": 3e-3}]
    got = gradient_check(rows, {"param_dtype": "float32"})
    assert list(got) == ["vo"] and got["vo"]["checked_steps"] == 2 and got["vo"]["steps_above"] == 1
    assert gradient_check(rows, {"grad_dtype": "bfloat16"})["vo"]["steps_above"] == 0  # bf16's floor is 7.8e-3


def test_a_detection_made_with_the_loss_names_it_and_one_without_assumes_it():
    m = _model()
    named = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, laws=conserve.detect(m, loss="ce"),
                           check_gradients=True)
    assumed = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, laws=conserve.detect(m),
                             check_gradients=True)
    assert conserve.detect(m, loss="ce").loss == "ce" and conserve.detect(m).loss is None
    assert named.tracker.grad_watch.assumed == [] and assumed.tracker.grad_watch.assumed == ["translation"]
    assert any(l.family == "translation" for l in named.tracker.grad_watch.laws)
    named.close()
    assumed.close()


def _closure_steps(opt, m, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, CFG["vocab_size"], (4, 12), generator=g)

        def closure():
            opt.zero_grad(set_to_none=False)  # the previous step's gradient stays until the closure runs
            logits = m(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            return loss

        opt.step(closure)


@pytest.mark.parametrize("how", ["track", "attach"])
def test_a_closure_step_is_checked_on_the_gradient_its_closure_computes(how):
    """LBFGS / SAM / Lightning's automatic optimization compute the gradient inside ``step(closure)``: the check
    reads it after the closure, never the previous step's."""
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=1e-2)
    if how == "track":
        opt = conserve.track(inner, m, every=100, check_gradients=True, loss="ce")
        tr = opt.tracker
    else:
        tr = conserve.Tracker(m, every=100, check_gradients=True, loss="ce")
        handle = conserve.optim.attach(inner, tr)
        opt = inner
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        _closure_steps(opt, m, 4)
        rows = tr.flush()
    res = tr.gradient_check()
    assert res.ok and res.steps == 4 and all(r["grad_check/vo"] < 1e-5 for r in rows), str(res)
    if how == "attach":
        handle.remove()
    tr.close()


def test_the_check_continues_across_a_resume_and_names_training_steps():
    m = _model()
    hook = m.layers[1].self_attn.o_proj.weight.register_hook(lambda g: g * 1.01)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce",
                         drift_every=2)
    with pytest.warns(GradientCheckWarning):
        _train(opt, m, 4)  # checked at steps 1 and 3
        state = opt.tracker.state_dict()
    worst = max(opt.tracker.gradient_check().flagged, key=lambda c: c.worst)
    assert worst.worst_step in (1, 3)  # a training step, not the count of checked steps
    hook.remove()
    opt.close()
    again = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True,
                           loss="ce", drift_every=2)
    again.tracker.load_state_dict(state)
    with warnings.catch_warnings():  # the flagged laws were warned before the save: not again
        warnings.simplefilter("error", GradientCheckWarning)
        _train(again, m, 2)
        again.tracker.flush()
    res = again.tracker.gradient_check()
    assert res.steps == 3 and not res.ok and {c.name for c in res.flagged} >= {worst.name}
    again.close()


def test_a_grad_check_ignore_entry_that_matches_nothing_is_said():
    m = _model()
    with pytest.warns(RuntimeWarning, match=r"grad_check_ignore entries \['vo_typo'\] match no law"):
        opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, check_gradients=True,
                             grad_check_ignore=["vo_typo", "vo"])
    opt.close()


def _sparse_moe_forward(self, x):
    """``MoE.forward`` as research MoE code writes it: an expert no token is routed to is skipped, so its
    parameters get no ``.grad`` on that step."""
    g = self.gates(x)
    y = torch.zeros_like(x)
    for e, expert in enumerate(self.experts):
        idx = (g[..., e] > 0).nonzero(as_tuple=True)
        if idx[0].numel():
            y = y.index_put(idx, y[idx] + g[..., e][idx][:, None] * expert(x[idx]))
    return y


def test_an_expert_backward_did_not_reach_is_checked_as_a_zero_gradient(monkeypatch):
    from conserve.models import blocks

    monkeypatch.setattr(blocks.MoE, "forward", _sparse_moe_forward)
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(**CFG | dict(num_experts=8, top_k=1, moe_layers=(1,))))
    experts = m.layers[1].mlp.experts
    opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-3), m, every=100, check_gradients=True, loss="ce")
    unreached = []
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientCheckWarning)
        for _ in range(3):
            x = torch.randint(0, CFG["vocab_size"], (1, 3), generator=g)
            opt.zero_grad()
            logits = m(x)
            F.cross_entropy(logits[0, :-1], x[0, 1:]).backward()
            unreached.append(sum(e.up_proj.weight.grad is None for e in experts))
            opt.step()
        opt.tracker.flush()
    res = opt.tracker.gradient_check()
    assert min(unreached) > 0 and res.ok and res.steps == 3, (unreached, str(res))
    assert {c.name for c in res.laws} >= {f"layers.1.mlp.experts.{e}/unit" for e in range(8)}
    opt.close()
    one = conserve.check_gradients(m, lambda mm, b: F.cross_entropy(mm(b)[0, :-1], b[0, 1:]), x, loss="ce")
    assert one.ok and any(e.up_proj.weight.grad is None for e in experts), str(one)  # the .grad restored


def test_a_fault_the_family_aggregate_alone_shows_is_warned_at_flush():
    """A fault spread thinly over a family's layers: no law above its floors, the family's aggregate above it."""
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce")
    _train(opt, m, 1)
    watch = opt.tracker.grad_watch
    res = watch.check.result()
    sp, sn2 = res.family_sums["vo"]
    res.family_sums["vo"] = (3 * res.aggregate_floor * math.sqrt(sn2), sn2)  # what a spread fault leaves
    assert not res.flagged and res.families()["vo"]["flagged_aggregate"] and not res.ok
    watch.check.result = lambda: res
    with pytest.warns(GradientCheckWarning, match=r"the vo family as a whole .*family vo: no law above its floor "
                                                  r"alone, but the aggregate over its 4 laws is 1\.4[0-9]e-06"):
        opt.tracker.flush()
    with warnings.catch_warnings():  # once
        warnings.simplefilter("error", GradientCheckWarning)
        opt.tracker.flush()
    opt.close()


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its common implementation writes it: ``step(closure)`` moves the weights to
    ``θ + ρ g/‖g‖``, the closure computes the gradient there, the base optimizer applies it at ``θ``."""

    def __init__(self, params, rho=0.05, lr=1e-2):
        super().__init__(params, dict(rho=rho, lr=lr))
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=lr)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        gn = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]).norm()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["e"] = e = p.grad * g["rho"] / (gn + 1e-12)
                    p.add_(e)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if "e" in self.state[p]:
                    p.sub_(self.state[p]["e"])
        self.base_optimizer.step()
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        self.first_step()
        torch.enable_grad()(closure)()
        self.second_step()


def test_sam_through_its_closure_is_said_and_attached_to_its_base_optimizer_is_flagged():
    def loss(m, x):
        logits = m(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    x = torch.randint(0, CFG["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(1))
    m = _model()
    opt = conserve.track(_SAM(m.parameters()), m, every=100, check_gradients=True, loss="ce")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            loss(m, x).backward()
            opt.step(lambda: loss(m, x).backward())
        opt.tracker.flush()
    said = [str(c.message) for c in w if issubclass(c.category, GradientCheckWarning)]
    assert len(said) == 1 and "perturbed point" in said[0] and "base_optimizer" in said[0], said
    opt.close()
    m = _model()
    sam = _SAM(m.parameters())
    tr = conserve.Tracker(m, every=100, check_gradients=True, loss="ce")
    handle = conserve.optim.attach(sam.base_optimizer, tr)
    warnings.filterwarnings("ignore", "conserve: .* changed in place since the tracker was built")  # the ascent
    for _ in range(2):
        sam.zero_grad()
        loss(m, x).backward()
        sam.first_step()
        loss(m, x).backward()
        sam.second_step()
    with pytest.warns(GradientCheckWarning, match="not a gradient"):
        tr.flush()
    assert {c.family for c in tr.gradient_check().flagged} >= {"vo", "swiglu"}
    handle.remove()
    tr.close()


def test_a_bf16_model_with_a_float32_embedding_is_checked_at_bf16_floors():
    m = _model().to(torch.bfloat16)
    m.embed_tokens.float().register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
    x = torch.randint(0, CFG["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(1))

    def loss(mm, b):
        logits = mm(b).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    res = conserve.check_gradients(m, loss, x, loss="ce")
    assert res.dtype == "bfloat16" and res.ok, str(res)


def test_half_precision_rounding_judged_at_float32_floors_is_named_in_the_warning():
    m = _model()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _train(opt, m, 1)
    with pytest.warns(GradientCheckWarning, match=r"within bfloat16's rounding floor.*grad_dtype='bfloat16'"):
        opt.tracker.flush()
    assert "grad_dtype='bfloat16'" in str(opt.tracker.gradient_check())
    opt.close()
    m = _model()
    m.layers[0].self_attn.o_proj.weight.register_hook(lambda g: g * 1.5)
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-2), m, every=100, check_gradients=True, loss="ce")
    _train(opt, m, 1)
    with pytest.warns(GradientCheckWarning) as rec:  # a fault above bf16's floors: no such hint
        opt.tracker.flush()
    assert "bfloat16's rounding floor" not in str(rec[0].message)
    opt.close()


def test_the_one_shot_check_skips_a_law_reading_a_frozen_parameter():
    m = _model()
    m.layers[1].mlp.down_proj.weight.requires_grad_(False)
    x = torch.randint(0, CFG["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(1))
    res = conserve.check_gradients(m, lambda mm, b: F.cross_entropy(mm(b)[:, :-1].reshape(-1, CFG["vocab_size"]),
                                                                    b[:, 1:].reshape(-1)), x, loss="ce")
    why = dict(res.skipped)
    assert res.ok and "frozen" in why["layers.1.mlp/unit"] and "layers.0.mlp/unit" in {c.name for c in res.laws}
