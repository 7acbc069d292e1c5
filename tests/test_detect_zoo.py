"""Detection of HF architectures that have no family handler, found by ``bench/arch_sweep.py`` (the sweep over
every model type transformers can build): each case was declined whole or missed a block before; now
structural detection finds its laws, and every law passes the spec's first-order check in float64 on the
model's own (untraced) code (``test_detect_hf.check``: transformers' float32 upcasts made float64).
"""
from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers")

from conserve.detection import detect  # noqa: E402
from conserve.analysis.verify import TOL, first_order  # noqa: E402
from test_detect_hf import exact64, randomize  # noqa: E402

SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=12, num_hidden_layers=1,
             vocab_size=17, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def _lm(cfg, **kw):
    torch.manual_seed(0)
    return randomize(T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw).eval())


def _worst(model, laws, ids, **fixed):
    """Worst first-order violation of ``laws`` on ``model``'s own float64 forward ``ids -> logits``."""
    m = model.to(torch.float64)
    fwd = type(m).forward
    m.forward = lambda x: fwd(m, input_ids=x, use_cache=False, **fixed).logits
    with exact64(m):
        return {law.name: first_order(m, law, ids, trials=1) for law in laws}


IDS = torch.randint(1, 17, (2, 5), generator=torch.Generator().manual_seed(1))


def test_t5_without_example_inputs_gets_decoder_ids_from_its_config():
    """T5 (an encoder-decoder) was declined whole without ``example_inputs`` ('cannot synthesise an input': its
    forward needs decoder inputs). The probe now gets ``decoder_input_ids`` from the config's vocabulary: the
    QK / VO Grams of every attention (self and cross; the relative position bias is added to q.k, which the QK
    symmetry keeps), the ReLU units and the pre-norm gains are found, and each holds."""
    cfg = T.T5Config(d_model=16, d_kv=4, d_ff=12, num_layers=1, num_decoder_layers=1, num_heads=4, vocab_size=17,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    m = randomize(T.T5ForConditionalGeneration(cfg).eval())
    d = detect(m)
    assert d.detector == "hf->graph" and d.undetected == []
    assert d.families() == {"qk": 12, "vo": 12, "relu": 2, "gain": 5}, d.families()
    dec = torch.randint(1, 17, (2, 4), generator=torch.Generator().manual_seed(2))
    worst = _worst(m, d.laws, IDS, decoder_input_ids=dec)
    assert max(worst.values()) <= TOL, {k: v for k, v in worst.items() if v > TOL}


@pytest.mark.parametrize("name", ["granitemoe", "gpt_oss"])
def test_fused_experts_are_traced_through_batched_mm(name):
    """GraniteMoE / GPT-OSS (fused experts, no family handler) were declined whole: the eager experts loop over
    the experts a batch routes to (``nonzero`` + a Python ``for``), which neither torch.fx nor torch.export can
    trace. The probe runs transformers' ``batched_mm`` experts (the same function), whose per-token gathered
    weights ``bmm(W[ids], x)`` are read as one linear map per expert: GraniteMoE's SwiGLU unit law per expert and
    the gain law of the norm read by the router and every expert are found, with the attention and router laws.
    GPT-OSS: its experts clamp and shift the gate (``(up + 1) * glu``): their SwiGLU candidates fail the check and
    are declined; its attention sinks (a learned logit per head beside the scores, ``softmax(cat(s, sink) - max)``,
    then the real keys' slice) keep the RoPE and VO laws. Every law holds; the user's model keeps its own experts
    implementation."""
    if name == "granitemoe":
        cfg = T.GraniteMoeConfig(**SMALL, num_local_experts=3, num_experts_per_tok=2)
        fams = {"rope_pair": 2, "vo": 2, "router_sum": 1, "swiglu": 3, "gain": 3, "translation": 1}
    else:
        cfg = T.GptOssConfig(**{**SMALL, "num_hidden_layers": 2}, head_dim=4, num_local_experts=3,
                             num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=4)
        fams = {"rope_pair": 4, "vo": 4, "router_sum": 2, "gain": 5, "translation": 1}
    m = _lm(cfg, experts_implementation="eager")
    d = detect(m)
    assert m.config._experts_implementation == "eager"
    assert d.detector == "hf->graph" and d.undetected == []
    assert d.families() == fams
    if name == "gpt_oss":
        assert "(up + 1) * glu(gate)" in next(x.reason for x in d.declined if x.module == "model.layers.0.mlp.experts")
    worst = _worst(m, d.laws, IDS)
    assert max(worst.values()) <= TOL, {k: v for k, v in worst.items() if v > TOL}


def test_bloom_alibi_baddbmm_scores_are_attention():
    """BLOOM computes its scores as ``alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(D))``: the attention was not
    found (q/k/v/o declined as 'no catalogue block'). ``baddbmm`` is read as ``beta * alibi + alpha * q @ k^T``:
    the per-head QK Grams (ALiBi adds a score offset that does not depend on q, k) and VO Grams are found and hold."""
    cfg = T.BloomConfig(hidden_size=16, n_head=4, n_layer=1, vocab_size=17, pad_token_id=0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    m = randomize(T.BloomForCausalLM(cfg).eval())
    d = detect(m)
    assert d.families() == {"qk": 4, "vo": 4, "gain": 2} and d.undetected == []
    worst = _worst(m, d.laws, IDS)
    assert max(worst.values()) <= TOL, {k: v for k, v in worst.items() if v > TOL}


def test_unsynthesisable_input_says_what_the_model_raised():
    """The decline of a model whose forward rejects every synthesised input names the error it gave."""
    from conserve.detection.graph import synth_inputs

    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            raise RuntimeError("needs a mask")

    with pytest.raises(ValueError, match="needs a mask.*pass example_inputs"):
        synth_inputs(Picky())


def test_trace_compared_at_the_outputs_scale():
    """VaultGemma was declined whole ('the traced graph does not reproduce the model's output'): the graph computes
    in float64 where the code downcasts to float32, so logits near zero differed from the model's by float32
    rounding of the logits' scale (7.8e-6 > atol 1e-6). The comparison's absolute tolerance now follows the
    output's scale; its RoPE, VO, SwiGLU and gain laws are found and hold."""
    cfg = T.VaultGemmaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=48, num_hidden_layers=2, vocab_size=128, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)  # the sweep's size (bench/arch_sweep.py): the smaller one passed before
    m = _lm(cfg)
    d = detect(m)
    assert d.detector == "hf->graph" and d.undetected == []
    assert {"rope_pair", "vo", "swiglu", "gain"} <= set(d.families()), d.families()
    worst = _worst(m, d.laws, IDS)
    assert max(worst.values()) <= TOL, {k: v for k, v in worst.items() if v > TOL}
