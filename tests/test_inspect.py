"""``conserve inspect`` on tiny HF checkpoints written to disk (conserve/commands/inspect.py, checkpoint.py).

Independent references: law values recomputed by hand from the in-memory model; the drift between
two checkpoints one plain-SGD step apart, which the spec's drift identity says is exactly
``lr^2 g^T M g`` for every quadratic law (first-order term zero), so eps scales as lr^2.
"""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("conserve.detection.hf")

from conserve.checkpoint import match_names, open_checkpoint  # noqa: E402
from conserve.cli import main  # noqa: E402
from conserve.commands import inspect as ins  # noqa: E402
from conserve.errors import UsageError  # noqa: E402

LR = 0.05
ARGS = argparse.Namespace(loss="ce", approximate=False, rope_layout=None, num_heads=None, num_kv_heads=None)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).double()


def _sgd_step(model, lr):
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    m = type(model)(model.config).double()
    m.load_state_dict(model.state_dict())
    m(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= lr * p.grad
    return m


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a = _llama()
    a.save_pretrained(root / "llama")
    _sgd_step(a, LR).save_pretrained(root / "llama_step")
    _sgd_step(a, LR / 10).save_pretrained(root / "llama_step10")
    a.save_pretrained(root / "llama_sharded", max_shard_size="20KB")
    cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "gpt2")
    (root / "raw").mkdir()
    shutil.copy(root / "llama" / "model.safetensors", root / "raw" / "llama.safetensors")
    shutil.copy(root / "gpt2" / "model.safetensors", root / "raw" / "gpt2.safetensors")
    return root, a


def run(capsys, *argv):
    code = main(["inspect", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_llama_table(ckpts, capsys):
    root, _ = ckpts
    code, out, err = run(capsys, root / "llama", "--laws")
    assert code == 0, err
    for fam in ("rope_pair", "vo", "swiglu", "gain", "translation"):
        assert fam in out
    assert "model.embed_tokens" in out and "no parameter on the other side" in out  # declined, with the reason
    # exact rows: GQA group 1 reads query heads 2, 3 (rows 8..16) and kv head 1 (rows 4..8) of k_proj
    assert "rows 8:10 of model.layers.0.self_attn.q_proj.weight" in out
    assert "-gram(cols 12:16 of model.layers.1.self_attn.o_proj.weight)" in out


def test_gpt2_tied_embeddings_decline(ckpts, capsys):
    root, _ = ckpts
    code, out, _ = run(capsys, root / "gpt2")
    assert code == 0
    assert "qk" in out and "tied" in out and "translation" not in out.split("declined")[0]


def test_values_match_hand_computation(ckpts, capsys):
    root, model = ckpts
    ck = open_checkpoint(root / "llama")
    det, names = ins.detect_checkpoint(ck, ARGS)
    vals = ins.evaluate_checkpoint(ck, det.laws, names)
    sd = {k: v.to(torch.float64) for k, v in model.state_dict().items()}
    up, down = sd["model.layers.1.mlp.up_proj.weight"], sd["model.layers.1.mlp.down_proj.weight"]
    torch.testing.assert_close(vals["model.layers.1.mlp/unit"], up.pow(2).sum(1) - down.pow(2).sum(0))
    torch.testing.assert_close(vals["lm_head/translation"], sd["lm_head.weight"].sum(0))
    g = sd["model.layers.0.post_attention_layernorm.weight"]
    readers = sum(sd[f"model.layers.0.mlp.{n}_proj.weight"].pow(2).sum(0) for n in ("gate", "up"))
    torch.testing.assert_close(vals["model.layers.0.post_attention_layernorm/gain"], g ** 2 - readers)
    d = 4
    v, o = sd["model.layers.0.self_attn.v_proj.weight"], sd["model.layers.0.self_attn.o_proj.weight"]
    vo1 = v[d:2 * d] @ v[d:2 * d].T - sum(o[:, i * d:(i + 1) * d].T @ o[:, i * d:(i + 1) * d] for i in (2, 3))
    torch.testing.assert_close(vals["model.layers.0.self_attn/vo/group1"], vo1)
    code, out, _ = run(capsys, root / "llama", "--values")
    assert code == 0 and "mean |h_i|" in out and "swiglu" in out.split("invariant values")[1]


def test_sharded_equals_single(ckpts, capsys):
    root, _ = ckpts
    ck = open_checkpoint(root / "llama_sharded")
    assert len(set(ck.files.values())) > 1  # really sharded
    single = open_checkpoint(root / "llama")
    assert ck.shapes == single.shapes
    t1, t2 = ck.tensors(["model.layers.1.mlp.up_proj.weight"]), single.tensors(["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(t1["model.layers.1.mlp.up_proj.weight"], t2["model.layers.1.mlp.up_proj.weight"])
    code, out, _ = run(capsys, root / "llama_sharded", "--compare", root / "llama")
    assert code == 0
    table = out.split("drift per law family")[1]
    assert table.count("0.000000e+00") == 2 * 5  # eps and max of the five families


def test_compare_one_sgd_step(ckpts, capsys):
    root, _ = ckpts
    code, out, err = run(capsys, root / "llama", root / "llama_step")
    assert code == 0, err
    assert "drift per law family" in out
    ck, ck1, ck10 = (open_checkpoint(root / n) for n in ("llama", "llama_step", "llama_step10"))
    det, names = ins.detect_checkpoint(ck, ARGS)
    h0 = ins.evaluate_checkpoint(ck, det.laws, names)
    mag = ins.evaluate_checkpoint(ck, det.laws, names, magnitude=True)
    d1 = ins.compare(det.laws, h0, ins.evaluate_checkpoint(ck1, det.laws, names), mag)
    d10 = ins.compare(det.laws, h0, ins.evaluate_checkpoint(ck10, det.laws, names), mag)
    for fam in ("rope_pair", "vo", "swiglu", "gain"):
        assert 0 < d1[fam]["eps"] < 1e-2, (fam, d1[fam])
        # plain SGD: h(theta - lr g) - h(theta) = lr^2 g^T M g exactly, so eps scales as lr^2
        assert d1[fam]["eps"] / d10[fam]["eps"] == pytest.approx(100.0, rel=1e-6), fam
    # linear law, exactly conserved by softmax cross-entropy; HF's loss casts the logits to float32, so only
    # up to float32 rounding of the gradient (the quadratic laws above drift by lr^2 g^T M g >> that)
    assert d1["translation"]["eps"] < 1e-6 < d1["swiglu"]["eps"]
    assert f"{d1['swiglu']['eps']:.6e}" in out


def test_raw_safetensors_needs_heads_and_rope_layout(ckpts, capsys):
    root, _ = ckpts
    raw = root / "raw" / "llama.safetensors"
    code, _, err = run(capsys, raw)
    assert code == 2 and "--num-heads" in err and err.count("\n") == 1
    code, _, err = run(capsys, raw, "--num-heads", 4)
    assert code == 2 and "--rope-layout" in err and "cannot be known" in err
    code, out, err = run(capsys, raw, "--num-heads", 4, "--rope-layout", "interleaved", "--laws")
    assert code == 0, err
    assert "raw safetensors" in out and "rope_pair" in out
    assert "rows 0:4:2 of model.layers.0.self_attn.q_proj.weight" in out  # interleaved pairs {2p, 2p+1}
    code, out, err = run(capsys, root / "raw" / "gpt2.safetensors", "--num-heads", 2)  # no RoPE: no layout needed
    assert code == 0 and "qk" in out, err


@pytest.mark.parametrize("what", ["missing", "corrupt", "no_config", "missing_shard", "other_model", "unknown_raw"])
def test_errors_are_one_line_exit_2(ckpts, tmp_path, capsys, what):
    root, _ = ckpts
    if what == "missing":
        argv = [tmp_path / "nope"]
        expect = "no such file"
    elif what == "corrupt":
        (tmp_path / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
        argv, expect = [tmp_path / "x.safetensors"], "not a readable safetensors file"
    elif what == "no_config":
        shutil.copy(root / "llama" / "model.safetensors", tmp_path / "model.safetensors")
        argv, expect = [tmp_path], "no config.json"
    elif what == "missing_shard":
        shutil.copytree(root / "llama_sharded", tmp_path / "s")
        shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[-1]
        shard.unlink()
        argv, expect = [tmp_path / "s"], "shard named in"
    elif what == "other_model":
        argv, expect = [root / "llama", root / "gpt2"], "does not hold the same model"
    else:
        torch.save({}, tmp_path / "w.bin")
        from safetensors.torch import save_file

        save_file({"encoder.weight": torch.zeros(2, 2)}, str(tmp_path / "w.safetensors"))
        argv, expect = [tmp_path / "w.safetensors"], "cannot tell the architecture"
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert expect in err and err.startswith("conserve inspect: error:") and err.count("\n") == 1, err


def test_match_names_prefixes():
    keys = {"layers.0.w", "layers.1.w", "lm_head.weight"}
    assert match_names(["model.layers.0.w", "model.layers.1.w", "lm_head.weight"], keys) == {
        "model.layers.0.w": "layers.0.w", "model.layers.1.w": "layers.1.w", "lm_head.weight": "lm_head.weight"}
    assert match_names(["h.0.w"], {"transformer.h.0.w"}) == {"h.0.w": "transformer.h.0.w"}
    with pytest.raises(UsageError, match="no tensor in the checkpoint"):
        match_names(["model.layers.2.w"], keys)


# ------------------------------------------------------------------- MoE layouts and bad weights
MOE_TINY = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=12,
                num_hidden_layers=2, vocab_size=32, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                pad_token_id=0)
MOE = {
    "mixtral": lambda: transformers.MixtralConfig(**MOE_TINY, num_local_experts=3, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**MOE_TINY, moe_intermediate_size=6, num_experts=3,
                                                     shared_expert_intermediate_size=8, num_experts_per_tok=2),
    "olmoe": lambda: transformers.OlmoeConfig(**MOE_TINY, num_experts=3, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE_TINY, moe_intermediate_size=6, num_experts=3,
                                                     num_experts_per_tok=2, head_dim=4),
}


def _moe(name):
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(MOE[name]())
    with torch.no_grad():  # unit-scale weights: HF's init (0.02) would hide a misread expert or router
        g = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name in MOE:
        m = _moe(name)
        m.save_pretrained(root / name)
        out[name] = (root / name, m)
    return out


def _reference(model, laws):
    """Law values from the in-memory model (transformers fused the experts itself on load/init)."""
    from conserve.laws import evaluate_laws

    params = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    return evaluate_laws(laws, params, fp64=True)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_checkpoint_per_expert_layout(moe_ckpts, capsys, name):
    path, model = moe_ckpts[name]
    ck = open_checkpoint(path)
    assert any(".experts.0." in k for k in ck.shapes)  # what save_pretrained wrote: one tensor per expert
    assert not any(k.endswith("experts.gate_up_proj") for k in ck.shapes)
    det, names = ins.detect_checkpoint(ck, ARGS)
    fams = det.families()
    assert fams.get("router_sum") == 2 and fams.get("swiglu", 0) >= 6, fams
    assert ck.fused, "the fused expert tensors are assembled from the per-expert ones"
    vals = ins.evaluate_checkpoint(ck, det.laws, names)
    ref = _reference(model, det.laws)
    for law in det.laws:
        torch.testing.assert_close(vals[law.name], ref[law.name].to(torch.float64), rtol=1e-5, atol=1e-5)
    # an independent hand computation of one expert's unit law from the per-expert tensors on disk
    e, L = 1, 0
    up_key = next(k for k in ck.shapes if f"layers.{L}." in k and f"experts.{e}." in k and k.endswith(("up_proj.weight", "w3.weight")))
    down_key = up_key.replace("up_proj", "down_proj").replace("w3", "w2")
    t = ck.tensors([up_key, down_key])
    unit = next(l for l in det.laws if l.name.endswith(f"layers.{L}.mlp.experts.{e}/unit"))
    torch.testing.assert_close(vals[unit.name], t[up_key].double().pow(2).sum(1) - t[down_key].double().pow(2).sum(0))
    code, out, err = run(capsys, path, "--values")
    assert code == 0, err
    assert "router_sum" in out and "swiglu" in out.split("invariant values")[1]
    assert "read through the checkpoint's layout" in out and "experts.gate_up_proj = stack of (" in out


def test_moe_checkpoint_fused_and_transposed_on_disk(moe_ckpts, tmp_path, capsys):
    from safetensors.torch import save_file

    path, model = moe_ckpts["mixtral"]
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    fused = {k: v for k, v in sd.items()}
    shutil.copy(path / "config.json", tmp_path / "config.json")
    (tmp_path / "fused").mkdir()
    (tmp_path / "transposed").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    tr = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
          for k, v in sd.items()}
    save_file(tr, str(tmp_path / "transposed" / "model.safetensors"))
    for sub in ("fused", "transposed"):
        shutil.copy(path / "config.json", tmp_path / sub / "config.json")
    ref = None
    for sub in ("fused", "transposed"):
        ck = open_checkpoint(tmp_path / sub)
        det, names = ins.detect_checkpoint(ck, ARGS)
        vals = ins.evaluate_checkpoint(ck, det.laws, names)
        ref = ref or _reference(model, det.laws)
        assert (sub == "transposed") == bool(ck.fused)
        for law in det.laws:
            torch.testing.assert_close(vals[law.name], ref[law.name].to(torch.float64), rtol=1e-5, atol=1e-5)
    # per-expert vs fused checkpoints of the same weights: zero drift
    code, out, err = run(capsys, path, "--compare", tmp_path / "transposed")
    assert code == 0, err
    table = out.split("drift per law family")[1]
    assert "swiglu" in table and "router_sum" in table
    assert table.count("0.000000e+00") >= 2 * 5


def _rewrite(src, dst, change, config=None):
    """Copy checkpoint ``src`` to ``dst`` with ``change(state) -> state`` applied to its tensors."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(change(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


KEY = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float8_e4m3fn])
def test_integer_bool_quantised_weights_refused(ckpts, tmp_path, capsys, dtype):
    root, _ = ckpts
    p = _rewrite(root / "llama", tmp_path / "q", lambda sd: {**sd, KEY: sd[KEY].to(dtype)})
    code, out, err = run(capsys, p)  # listing the laws reads no tensor: fine
    assert code == 0, err
    code, out, err = run(capsys, p, "--values")
    assert code == 2 and err.count("\n") == 1 and KEY in err and "dequantise" in err, err


def test_quantisation_config_refused(ckpts, tmp_path, capsys):
    root, _ = ckpts
    p = _rewrite(root / "llama", tmp_path / "q", lambda sd: sd, {"quantization_config": {"quant_method": "bitsandbytes"}})
    code, _, err = run(capsys, p, "--values")
    assert code == 2 and "quantised checkpoint" in err and "bitsandbytes" in err and err.count("\n") == 1, err


def test_nan_weight_named_with_count(ckpts, tmp_path, capsys):
    root, _ = ckpts

    def poison(sd):
        w = sd[KEY].clone()
        w[0, :3] = float("nan")
        w[1, 0] = float("inf")
        return {**sd, KEY: w}

    p = _rewrite(root / "llama", tmp_path / "nan", poison)
    code, out, err = run(capsys, p, "--values")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert f"{KEY}: 3 NaN, 1 Inf (of 384)" in err
    assert f"{KEY}: 3 NaN, 1 Inf" in out and "invariant values" in out  # the values were printed first
    code, out, err = run(capsys, p, "--compare", root / "llama")  # NaN in A: the drift table is still printed
    assert code == 2 and KEY in err and "drift per law family" in out and err.count("\n") == 1
    code, out, err = run(capsys, root / "llama", "--compare", p)
    assert code == 2 and KEY in err and "drift per law family" in out


def test_missing_expert_tensor_names_the_parameter(moe_ckpts, tmp_path, capsys):
    path, _ = moe_ckpts["olmoe"]
    p = _rewrite(path, tmp_path / "x", lambda sd: {k: v for k, v in sd.items() if "layers.1.mlp.experts" not in k})
    code, _, err = run(capsys, p)
    assert code == 2 and "layers.1.mlp.experts" in err and err.count("\n") == 1, err


def test_continuity_names_nan_weight(tmp_path, capsys):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(8, 8, generator=g) for i in range(3)}
    sd["model.layers.1.self_attn.q_proj.weight"][2, 2] = float("nan")
    save_file(sd, str(tmp_path / "model.safetensors"))
    code = main(["continuity", str(tmp_path / "model.safetensors"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    line = [x for x in err.splitlines() if "error:" in x]
    assert len(line) == 1 and "model.layers.1.self_attn.q_proj.weight: 1 NaN, 0 Inf (of 64)" in line[0], err


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt_neox", "falcon",
                                  "gpt2", "bert", "gptj", "olmo2", "deepseek_v3", "granite", "olmo3", "exaone4",
                                  "seed_oss", "glm", "smollm3"])
def test_every_hf_family_round_trips_through_save_pretrained(tmp_path, name):
    """What ``save_pretrained`` writes for each family of tests/test_detect_hf.py is read back onto the detected
    laws, with the values of the in-memory model (the on-disk names and layouts are transformers')."""
    from test_detect_hf import build

    m = build(name)
    m.save_pretrained(tmp_path / name)
    ck = open_checkpoint(tmp_path / name)
    det, names = ins.detect_checkpoint(ck, ARGS)
    assert det.laws
    vals = ins.evaluate_checkpoint(ck, det.laws, names)
    ref = _reference(m, det.laws)
    for law in det.laws:
        torch.testing.assert_close(vals[law.name], ref[law.name].to(torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("what", ["heads_mismatch", "torch_pickle", "unknown_model_type"])
def test_config_and_file_errors_are_one_short_line(ckpts, tmp_path, capsys, what):
    """User reports: a config.json contradicting its weights crashed with a transformers traceback; a .pt
    file said only 'not a .safetensors file'; an unknown model_type printed every model type (11,992 chars)."""
    import json

    root, _ = ckpts
    d = tmp_path / "ck"
    shutil.copytree(root / "llama", d)
    cfg = json.loads((d / "config.json").read_text())
    if what == "heads_mismatch":
        cfg["num_attention_heads"] = 3  # hidden 16 does not split into 3 heads
        cfg.pop("head_dim", None)
        argv, expect = [d], ["config.json", "cannot build a model", "not a multiple", "fix config.json"]
    elif what == "torch_pickle":
        torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
        argv, expect = [tmp_path / "model.pt"], ["torch pickle", "save_file(torch.load(", "save_pretrained"]
    else:
        cfg["model_type"] = "lamma"
        argv, expect = [d], ["config.json", "'lamma'", "close: llama"]
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("conserve inspect: error:") and err.count("\n") == 1, err
    assert all(e in err for e in expect), err
    assert len(err) < 600, err


def test_python_only_advice_is_reworded_for_the_cli(ckpts, capsys, monkeypatch):
    """Detection's "pass example_inputs=(...)" is a Python argument the CLI has no option for."""
    import conserve.detection as detection
    from conserve.errors import UnsupportedModelError

    def refuse(*a, **k):
        raise UnsupportedModelError("no detector recognises T5ForConditionalGeneration; pass explicit laws "
                                    "(conserve.laws) to track it, or example_inputs= if forward needs a particular input")

    monkeypatch.setattr(detection, "detect", refuse)
    code, out, err = run(capsys, ckpts[0] / "llama")
    assert code == 2 and "the CLI cannot pass one" in err and "conserve.detect(model, example_inputs=" in err, err
    assert ins._cli_wording("cannot synthesise an input: pass example_inputs=(...) (what forward takes)") == (
        "cannot synthesise an input: the CLI cannot pass model inputs; run conserve.detect(model, "
        "example_inputs=(...)) from Python")
