"""``conserve inspect``: an optional package that fails to import while transformers builds the model (an
incompatible ``torchao`` under Qwen2MoE's modelling code) is named as such, not blamed on config.json."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("conserve.detection.hf")

from conserve.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _broken_torchao(wrapped: bool):
    def meta_model(cfg):
        err = ImportError("cannot import name 'TORCH_VERSION_AT_LEAST_2_5' from 'torchao.utils' "
                          "(/site-packages/torchao/utils.py)", name="torchao.utils")
        if not wrapped:
            raise err
        try:
            raise err
        except ImportError as e:  # as transformers' lazy module reports a modelling module that fails to import
            raise RuntimeError("Failed to import transformers.models.llama.modeling_llama because of the following "
                               f"error (look up to see its traceback):\n{e}") from e
    return meta_model


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_broken_optional_package_is_named_not_the_config(llama, capsys, monkeypatch, wrapped):
    monkeypatch.setattr(hf, "meta_model", _broken_torchao(wrapped))
    assert main(["inspect", str(llama)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "an installed optional package failed to import: torchao.utils: cannot import name " in err, err
    assert "fix or uninstall it" in err and "config.json" not in err, err


def test_a_config_error_is_still_the_configs(llama, capsys, monkeypatch):
    def refuse(cfg):
        raise ValueError("hidden_size is not a multiple of num_attention_heads")

    monkeypatch.setattr(hf, "meta_model", refuse)
    assert main(["inspect", str(llama)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "fix config.json" in err and "optional package" not in err, err
