"""Detector for HF ``transformers`` models: every law with the exact rows/columns it reads.

Detection is structural: the family comes from ``config.model_type`` (the table ``families.FAMILIES`` of
families whose modeling code was read), the blocks from the module classes and the parameter shapes,
the RoPE pairing and rotary width from the model's own ``apply_rotary_pos_emb`` (probed with basis
vectors), the MLP kind from its ``forward`` source and the MoE gating from the router's ``forward``.
What is not understood is listed in ``Detection.undetected``; blocks with no law carry the reason in
``Detection.declined``. A ``model_type`` not in the table goes to structural detection
(``graph.detect_graph``; detector ``'hf->graph'``, the reason first in ``declined``). Math: ``shared/spec/laws.md`` (rows named in each law's note).

Layouts handled (verified against transformers 5.x modeling code):

* separate ``q/k/v/o_proj`` (Llama, Mistral, Qwen2/3, Gemma, Mixtral, Qwen2-MoE, OLMoE); GQA group j is
  query heads ``[j*rep, (j+1)*rep)`` (``repeat_kv``);
* Phi-3 ``qkv_proj`` rows ``[Q | K | V]`` and ``gate_up_proj`` rows ``[gate | up]``;
* GPT-NeoX ``query_key_value`` per head ``[q_h | k_h | v_h]`` (``view(..., nH, 3D)``);
* Falcon: multi-query ``[Q_0..Q_{nH-1} | K | V]``, classic per head ``[q_h k_h v_h]`` and the new
  decoder architecture's per kv group ``[q.. (rep heads) | k_j | v_j]``;
* GPT-2 ``Conv1D`` (weights stored ``(in, out)``), fused ``c_attn`` columns ``[Q | K | V]``;
* fused 3-D experts ``gate_up_proj (E, 2I, H)`` / ``down_proj (E, H, I)`` (``is_transposed`` swaps the
  last two dims), and ``nn.ModuleList`` experts of gated MLPs (transformers < 5 layout);
* GPT-J: interleaved rotary pairs ``{2p, 2p+1}`` on the first ``rotary_dim`` dims of each head (probed
  from its ``apply_rotary_pos_emb(x, sin, cos)``), parallel block (``ln_1`` read by q, k, v and fc_in);
* the role of each norm of a decoder layer (pre-attention, post-attention, pre-MLP, post-MLP) from the
  order of calls in the layer's ``forward`` (``parts._norm_roles``): pre-norms give gain laws; post-norms
  (Gemma2/3 sandwich norms, OLMo2/3 and EXAONE-4 post-norms) give none, and make the Linear they normalise
  scale invariant (``NormScaleLaw``, family ``norm_scale``, kept for eps = 0 or ``approximate``);
* DeepSeek-V2/V3 multi-head latent attention (``mla.py``): per head the QK Gram on the no-RoPE dims (``q_b_proj`` /
  ``q_proj`` rows vs the key rows of ``kv_b_proj``) and the VO Gram (value rows of ``kv_b_proj`` vs ``o_proj``
  columns), one RoPE-pair law per rotary pair over ALL heads against the shared rotary key rows of
  ``kv_a_proj_with_mqa`` (pairs ``{2p, 2p+1}`` with ``rope_interleave`` and in V2), the gain laws of
  ``q_a_layernorm`` / ``kv_a_layernorm`` and their scale laws (eps = 0 or ``approximate``);
* QK-norm per head (Qwen3, Qwen3-MoE, Gemma3 with ``(1 + w)`` gains, EXAONE-4) or over all heads (OLMoE,
  OLMo2/3); Gemma2's attention-logit softcapping keeps the QK/RoPE laws, a final-logit softcap declines the
  translation law; SmolLM3's NoPE layers (``use_rope`` False) get QK Gram laws.

Options (``conserve.detect(model, **options)``):
    rope_layout: 'half' | 'interleaved' overrides what the model's code says.
    require_rope_layout: True for weights whose row order may not follow HF's code (a raw checkpoint):
        a RoPE model then needs ``rope_layout`` (UsageError otherwise).
    loss: the training loss of the logits; the translation law is only kept for 'ce' (default 'ce').
    approximate: True keeps QK-norm scale laws when the norm has eps > 0 (then conserved only up to
        O(eps / mean(q^2))); default False declines them with that reason.
"""
from __future__ import annotations

import sys

import torch

from ...errors import UsageError
from ..check import checked_laws
from ..core import Detection, user_classes, register
from ..dispatch import detect
from .families import FAMILIES
from .parts import Unhandled, Ctx
from .rope import LAYOUTS, probe_rope

__all__ = ["FAMILIES", "LAYOUTS", "detect_from_config", "detect_hf", "meta_model", "probe_rope"]
_FAMILIES = FAMILIES


@register("hf")
def detect_hf(model, config, **options):
    """Laws of an HF ``PreTrainedModel`` (see the module docstring); None for other models."""
    transformers = sys.modules.get("transformers")  # an HF model's class comes from it: already imported
    try:
        base = transformers.PreTrainedModel if transformers is not None else None
    except Exception:  # noqa: BLE001 - transformers present but not importable (broken optional dependency)
        base = None
    if base is None or not isinstance(model, base):
        return None
    config = config if config is not None else model.config
    ctx = Ctx(model, options, config=config)
    model_type = getattr(config, "model_type", None)
    fam = _FAMILIES.get(model_type)
    if fam is None:
        return _structural(model, model_type, options)
    try:
        fam(ctx)
    except Unhandled as e:
        return _structural(model, model_type, options, str(e))
    d = ctx.finish("hf")
    mine = user_classes(model, ("transformers.", "torch."))
    if mine:  # the family handler read transformers' code, not this: keep only the laws the model's forward keeps
        why = f"{mine[0]} is not transformers' code (which the family handler read)"
        d.laws, more = checked_laws(model, d.laws, {**options, "why": why})
        d.declined += more
    return d




def _structural(model, model_type, options, why: str | None = None) -> Detection:
    """An HF model whose ``model_type`` has no family handler: structural detection (``graph.detect_graph``,
    every law checked to first order in float64), with the reason recorded first in ``declined``. The loss
    defaults to 'ce' as for the family handlers."""
    from ...laws import Declined
    from ..graph import detect_graph

    d = detect_graph(model, **{"loss": "ce", **options})
    why = why or f"no HF family handler (known: {sorted(_FAMILIES)})"
    d.declined.insert(0, Declined("", f"model_type={model_type!r}", f"{why}: structural detection used"))
    d.detector = "hf->graph"
    return d


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
        try:
            auto._model_mapping[type(config)]  # noqa: B018
            return auto
        except KeyError:
            continue
    raise UsageError(f"transformers has no model class for config {type(config).__name__}")


def detect_from_config(config, **options) -> Detection:
    """Laws of the HF model a config describes, from shapes only (the model is built on the meta device:
    no weights are allocated or read). ``config``: a ``transformers.PretrainedConfig`` (or a dict with
    ``model_type``). For weights whose row order may differ from HF's code (raw checkpoints) pass
    ``require_rope_layout=True`` and ``rope_layout=``. Raises UsageError when the model cannot be built."""
    import transformers

    if isinstance(config, dict):
        config = transformers.AutoConfig.for_model(**config)
    model = meta_model(config)
    return detect(model, config, **options)


def meta_model(config):
    """The HF model a ``transformers.PretrainedConfig`` describes, built on the meta device (shapes only).
    Raises UsageError when transformers has no model class for it."""
    cls = _model_class(config)
    with torch.device("meta"):
        return cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
