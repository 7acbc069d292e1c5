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
