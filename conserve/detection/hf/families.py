"""The HF family handlers and the ``model_type -> handler`` table (``FAMILIES``): each handler walks one
architecture's module tree and composes the parts of ``parts.py``. A model_type is listed only when its
modeling code was read (transformers 5.x); everything else is declined with the reason."""
from __future__ import annotations

from torch import nn

from ...errors import UsageError
from ...laws import ReLUUnit
from .parts import (Unhandled, Attn, Ctx, forward_src, attn_laws, attn_readers, embed_and_head, gain_laws, gated_mlp, find_head_dim,
                    linear_like, moe_mlp, norm_roles, find_num_kv, plain_mlp, post_norm, qkvo_attn, ungated_mlp, unit_laws,
                    linear_w, NO_EMBED)
from .mla import is_mla, mla_laws
from .rope import probe_gptj, find_rope_layout, find_rotary_dim


def _llama_like(ctx: Ctx):
    """Decoders with ``model.layers[i].{self_attn, mlp}`` and norms whose roles come from the layer's
    forward (``norm_roles``): pre-norm (Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, DeepSeek-V3), sandwich (Gemma2, Gemma3: pre and post norms) and post-norm only
    (OLMo2). Gemma2's attention-logit softcapping ``cap * tanh(s / cap)`` acts on the scores q.k, which the
    QK/RoPE symmetries leave unchanged, so those laws hold; its final-logit softcapping breaks the
    translation law (``embed_and_head``)."""
    model, config = ctx.model, ctx.config
    base_path = model.base_model_prefix if hasattr(model, model.base_model_prefix or "") else ""
    base = getattr(model, base_path) if base_path else model
    pre = f"{base_path}." if base_path else ""
    nh = config.num_attention_heads
    nkv, d = find_num_kv(config, nh), find_head_dim(config)
    rope_emb = getattr(base, "rotary_emb", None)
    for i, layer in enumerate(base.layers):
        lp = f"{pre}layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        ap, mp = f"{lp}.self_attn", f"{lp}.mlp"
        roles = norm_roles(layer)
        if roles is None:
            ctx.decline(lp, f"{type(layer).__name__}", "the order of its norms, attention and MLP could not be read "
                        "from its forward: no law detected for this layer")
            continue
        norm = {r: (f"{lp}.{n}", getattr(layer, n)) for r, n in roles.items()}
        a = None
        if is_mla(attn):  # DeepSeek-V2/V3 multi-head latent attention
            readers = mla_laws(ctx, ap, attn, i, config)
            if "pre_attn" in norm:
                if readers is not None:
                    gain_laws(ctx, *norm["pre_attn"], i, readers, "q_a_proj (or q_proj), kv_a_proj_with_mqa")
                else:
                    ctx.decline(norm["pre_attn"][0], "norm before MLA", "readers not recognised: no gain law")
        else:
            # SmolLM3-style NoPE layers skip the rotation (``if self.use_rope:`` in the attention's forward)
            nope = "ifself.use_rope:" in forward_src(attn) and not attn.use_rope
            a = qkvo_attn(ctx, ap, attn, i, config, nh, nkv, d, rope_emb, rope=not nope)
            if a is None:
                ctx.decline(ap, type(attn).__name__, "attention layout not recognised: no law detected")
                if "pre_attn" in norm:
                    ctx.decline(norm["pre_attn"][0], "norm before an unrecognised attention", "no gain law")
            else:
                ctx.laws.extend(attn_laws(ctx, a))
                if "pre_attn" in norm:
                    gain_laws(ctx, *norm["pre_attn"], i, attn_readers(a), "q, k, v")
                else:
                    ctx.know(*(ref.param for ref in attn_readers(a)))
        if "post_attn" in norm:
            post_norm(ctx, *norm["post_attn"], a.o if a is not None else None, i, "o_proj")
        m = moe_mlp(ctx, mp, mlp, i, config) if hasattr(mlp, "experts") else (gated_mlp(ctx, mp, mlp, i)
                                                                            or ungated_mlp(ctx, mp, mlp, i))
        if m is None:
            ctx.decline(mp, type(mlp).__name__, "MLP layout not recognised: no law detected")
            if "pre_mlp" in norm:
                ctx.decline(norm["pre_mlp"][0], "norm before an unrecognised MLP", "no gain law")
        else:
            ctx.laws.extend(m.laws)
            if "pre_mlp" in norm:
                gain_laws(ctx, *norm["pre_mlp"], i, m.readers, m.what)
            else:  # no norm before it (OLMo2): the gate reads the residual stream and is in no law
                ctx.know(*(ref.param for ref in m.readers))
        if "post_mlp" in norm:
            down = getattr(mlp, "down_proj", None) if m is not None and not hasattr(mlp, "experts") else None
            post_norm(ctx, *norm["post_mlp"], linear_w(f"{mp}.down_proj", down) if linear_like(down) else None, i,
                       "down_proj")
    embed_and_head(ctx, [f"{pre}embed_tokens"], f"{pre}norm")


def _gptj(ctx: Ctx):
    """GPT-J: separate ``q/k/v_proj`` and ``out_proj`` (no biases); rotary on the first ``rotary_dim``
    dims of each head, pairs ``{2p, 2p+1}`` (``rotate_every_two``; probed from the model's code), the
    other dims pass through (their own Gram law); parallel block: ``ln_1`` feeds the attention and the
    MLP ``fc_in -> gelu -> fc_out`` (no law of its own), so its gain law is read by q, k, v and fc_in."""
    model, config = ctx.model, ctx.config
    tr, pre = _base(model, "transformer")
    nh, h, d = _heads(config)
    r = config.rotary_dim or d
    for i, blk in enumerate(tr.h):
        lp = f"{pre}h.{i}"
        at = blk.attn
        q, k, v = (linear_w(f"{lp}.attn.{n}", getattr(at, n)) for n in ("q_proj", "k_proj", "v_proj"))
        o = linear_w(f"{lp}.attn.out_proj", at.out_proj)
        starts = [x * d for x in range(nh)]
        a = Attn(f"{lp}.attn", i, q, k, v, o, d, nh, nh, starts, starts, starts)
        a.rope = (r, find_rope_layout(ctx, at, d, r, probe=probe_gptj))
        ctx.laws.extend(attn_laws(ctx, a))
        m = plain_mlp(ctx, f"{lp}.mlp", blk.mlp, i, "fc_in", "fc_out", blk.mlp.act)
        ctx.laws.extend(m.laws)
        gain_laws(ctx, f"{lp}.ln_1", blk.ln_1, i, attn_readers(a) + m.readers, "q, k, v and fc_in (parallel block)")
    embed_and_head(ctx, [f"{pre}wte"], f"{pre}ln_f")


def _gpt2(ctx: Ctx):
    """GPT-2: Conv1D weights (in, out); c_attn output columns [Q | K | V]; learned absolute positions
    (QK Gram laws hold, with biases); pre-LN blocks ln_1 -> attn, ln_2 -> mlp."""
    model, config = ctx.model, ctx.config
    tr, pre = _base(model, "transformer")
    nh, h, d = _heads(config)
    for i, blk in enumerate(tr.h):
        lp = f"{pre}h.{i}"
        if getattr(blk, "crossattention", None) is not None:
            ctx.decline(f"{lp}.crossattention", "cross-attention", "not analysed (reads encoder states)")
            if getattr(blk, "ln_cross_attn", None) is not None:
                ctx.decline(f"{lp}.ln_cross_attn", "norm before the cross-attention",
                            "no gain law: its reader (the cross-attention's queries) is not analysed")
        at = blk.attn
        c = linear_w(f"{lp}.attn.c_attn", at.c_attn)
        o = linear_w(f"{lp}.attn.c_proj", at.c_proj)
        a = Attn(f"{lp}.attn", i, c, c, c, o, d, nh, nh, [x * d for x in range(nh)],
                  [h + x * d for x in range(nh)], [2 * h + x * d for x in range(nh)])
        ctx.laws.extend(attn_laws(ctx, a))
        gain_laws(ctx, f"{lp}.ln_1", blk.ln_1, i, [c.in_cols()], "c_attn (q, k, v)")
        m = plain_mlp(ctx, f"{lp}.mlp", blk.mlp, i, "c_fc", "c_proj", blk.mlp.act)
        ctx.laws.extend(m.laws)
        gain_laws(ctx, f"{lp}.ln_2", blk.ln_2, i, m.readers, "c_fc")  # holds whatever the activation
    embed_and_head(ctx, [f"{pre}wte", f"{pre}wpe"], f"{pre}ln_f")


def _neox(ctx: Ctx):
    """GPT-NeoX: ``query_key_value`` per head [q_h | k_h | v_h] (view(..., nH, 3D).chunk(3)); partial
    rotary; parallel residual: attention reads input_layernorm, the MLP post_attention_layernorm (both
    from the same residual input), so each norm has its own gain law."""
    model, config = ctx.model, ctx.config
    base, pre = _base(model, "gpt_neox")
    nh, h, d = _heads(config)
    for i, layer in enumerate(base.layers):
        lp = f"{pre}layers.{i}"
        at = layer.attention
        qkv = linear_w(f"{lp}.attention.query_key_value", at.query_key_value)
        o = linear_w(f"{lp}.attention.dense", at.dense)
        a = Attn(f"{lp}.attention", i, qkv, qkv, qkv, o, d, nh, nh, [x * 3 * d for x in range(nh)],
                  [x * 3 * d + d for x in range(nh)], [x * 3 * d + 2 * d for x in range(nh)])
        if getattr(at, "rotary_ndims", None) is not None and at.rotary_ndims != find_rotary_dim(config, d, base.rotary_emb):
            raise UsageError(f"{lp}: rotary_ndims={at.rotary_ndims} disagrees with the config")
        r = find_rotary_dim(config, d, base.rotary_emb)
        a.rope = (r, find_rope_layout(ctx, at, d, r))
        ctx.laws.extend(attn_laws(ctx, a))
        gain_laws(ctx, f"{lp}.input_layernorm", layer.input_layernorm, i, [qkv.in_cols()], "query_key_value")
        m = plain_mlp(ctx, f"{lp}.mlp", layer.mlp, i, "dense_h_to_4h", "dense_4h_to_h", layer.mlp.act)
        ctx.laws.extend(m.laws)
        gain_laws(ctx, f"{lp}.post_attention_layernorm", layer.post_attention_layernorm, i, m.readers, m.what)
    embed_and_head(ctx, [f"{pre}embed_in"], f"{pre}final_layer_norm")


def _falcon(ctx: Ctx):
    """Falcon: fused ``query_key_value``: multi-query [Q_0..Q_{nH-1} | K | V]; classic per head
    [q_h k_h v_h]; new decoder architecture per kv group [q (rep heads) | k_j | v_j]. RoPE (rotate_half)
    or ALiBi (no RoPE: QK Gram laws). Parallel attention: one norm read by attention and MLP."""
    model, config = ctx.model, ctx.config
    tr, pre = _base(model, "transformer")
    nh, h, d = _heads(config)
    for i, blk in enumerate(tr.h):
        lp = f"{pre}h.{i}"
        at = blk.self_attention
        qkv = linear_w(f"{lp}.self_attention.query_key_value", at.query_key_value)
        o = linear_w(f"{lp}.self_attention.dense", at.dense)
        if config.new_decoder_architecture:
            nkv = config.num_kv_heads
            rep = nh // nkv
            blk_rows = (rep + 2) * d
            qs = [(x // rep) * blk_rows + (x % rep) * d for x in range(nh)]
            ks = [j * blk_rows + rep * d for j in range(nkv)]
            vs = [j * blk_rows + (rep + 1) * d for j in range(nkv)]
        elif config.multi_query:
            nkv = 1
            qs, ks, vs = [x * d for x in range(nh)], [nh * d], [(nh + 1) * d]
        else:
            nkv = nh
            qs, ks, vs = ([x * 3 * d + s * d for x in range(nh)] for s in range(3))
        if qkv.n_out != (nh + 2 * nkv) * d:
            raise UsageError(f"{lp}: query_key_value has {qkv.n_out} rows, expected {(nh + 2 * nkv) * d}")
        a = Attn(f"{lp}.self_attention", i, qkv, qkv, qkv, o, d, nh, nkv, qs, ks, vs)
        if not config.alibi:
            r = find_rotary_dim(config, d, getattr(tr, "rotary_emb", None))
            a.rope = (r, find_rope_layout(ctx, at, d, r))
        ctx.laws.extend(attn_laws(ctx, a))
        m = plain_mlp(ctx, f"{lp}.mlp", blk.mlp, i, "dense_h_to_4h", "dense_4h_to_h", blk.mlp.act)
        ctx.laws.extend(m.laws)
        if hasattr(blk, "ln_attn"):
            gain_laws(ctx, f"{lp}.ln_attn", blk.ln_attn, i, [qkv.in_cols()], "query_key_value")
            gain_laws(ctx, f"{lp}.ln_mlp", blk.ln_mlp, i, m.readers, m.what)
        elif hasattr(blk, "post_attention_layernorm"):
            gain_laws(ctx, f"{lp}.input_layernorm", blk.input_layernorm, i, [qkv.in_cols()], "query_key_value")
            gain_laws(ctx, f"{lp}.post_attention_layernorm", blk.post_attention_layernorm, i, m.readers, m.what)
        else:  # parallel attention, one norm read by both
            gain_laws(ctx, f"{lp}.input_layernorm", blk.input_layernorm, i, [qkv.in_cols()] + m.readers,
                  f"query_key_value and {m.what} (parallel attention)")
    embed_and_head(ctx, [f"{pre}word_embeddings"], f"{pre}ln_f")


def _bert(ctx: Ctx):
    """BERT (post-LN): absolute positions, so per-head QK and VO Grams hold with biases; GELU FFN: none;
    LayerNorms sit on the residual stream (post-LN): no gain law."""
    model, config = ctx.model, ctx.config
    bert = model.bert if hasattr(model, "bert") else model
    pre = "bert." if bert is not model else ""
    nh, h, d = _heads(config)
    if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        raise Unhandled(f"BERT with position_embedding_type={config.position_embedding_type!r} (relative position "
                        "scores q.E_rel are not invariant under the QK symmetry) has no family handler")
    for i, layer in enumerate(bert.encoder.layer):
        lp = f"{pre}encoder.layer.{i}"
        sa = layer.attention.self
        q, k, v = (linear_w(f"{lp}.attention.self.{n}", getattr(sa, n)) for n in ("query", "key", "value"))
        o = linear_w(f"{lp}.attention.output.dense", layer.attention.output.dense)
        starts = [x * d for x in range(nh)]
        ctx.laws.extend(attn_laws(ctx, Attn(f"{lp}.attention", i, q, k, v, o, d, nh, nh, starts, starts, starts)))
        if getattr(layer, "crossattention", None) is not None:
            ctx.decline(f"{lp}.crossattention", "cross-attention", "not analysed (reads encoder states)")
        last = i == len(bert.encoder.layer) - 1
        for p in (f"{lp}.attention.output.LayerNorm",) + (() if last else (f"{lp}.output.LayerNorm",)):
            ctx.decline(p, "post-LN LayerNorm",
                        "no gain law: the normed vector is the residual stream itself (read by the skip connection, "
                        "not only by linear maps) (spec breakers: post-LN)")
        if last:
            _bert_last_norm(ctx, model, f"{lp}.output.LayerNorm", layer.output.LayerNorm, i)
        act = layer.intermediate.intermediate_act_fn
        uw, dw = linear_w(f"{lp}.intermediate.dense", layer.intermediate.dense), linear_w(f"{lp}.output.dense", layer.output.dense)
        if isinstance(act, (nn.ReLU, nn.LeakyReLU)):
            ctx.add(unit_laws(ReLUUnit, f"{lp}.intermediate/unit", i, uw, 0, uw.n_out, dw, f"{type(act).__name__} FFN"))
            ctx.know(dw.bias)
        else:
            ctx.decline(f"{lp}.intermediate", f"{type(act).__name__} FFN",
                        "no law beyond constants: the activation has no rescaling symmetry (spec: GELU FFN row)")
            ctx.decline(f"{lp}.output.dense", f"{type(act).__name__} FFN output", "see the FFN above")
    ctx.decline(f"{pre}embeddings", "embeddings + post-LN LayerNorm", NO_EMBED + "; its LayerNorm feeds the "
                "residual stream (post-LN): no gain law")
    if getattr(bert, "pooler", None) is not None:
        ctx.decline(f"{pre}pooler", "tanh pooler", "no rescaling symmetry: no law")
    for name, mod in model.named_children():
        if name != "bert" and bert is not model:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            tied = head is not None and head.weight is model.get_input_embeddings().weight
            ctx.decline(name, f"{type(mod).__name__} head",
                        ("tied decoder: no translation law (spec breakers: tied embeddings); " if tied else "")
                        + "the transform (dense -> GELU -> LayerNorm) has no law")


# Linear maps that read the last encoder layer's output (the sequence output, or its first token through the
# pooler) in each BERT head class (transformers' modeling_bert): nothing else reads it, so that LayerNorm's gain
# law holds with them as readers (spec: pre-norm gain row: the scaled vector is read only by linear maps).
_BERT_READERS = {
    "BertForMaskedLM": ("cls.predictions.transform.dense",), "BertLMHeadModel": ("cls.predictions.transform.dense",),
    "BertForPreTraining": ("cls.predictions.transform.dense", "bert.pooler.dense"),
    "BertForSequenceClassification": ("bert.pooler.dense",), "BertForMultipleChoice": ("bert.pooler.dense",),
    "BertForNextSentencePrediction": ("bert.pooler.dense",), "BertForTokenClassification": ("classifier",),
    "BertForQuestionAnswering": ("qa_outputs",),
}


def _bert_last_norm(ctx: Ctx, model, path: str, norm, layer: int):
    """The last layer's output LayerNorm: no residual add follows it, so when the model's head reads it only
    through linear maps (``_BERT_READERS``) its gain law holds with those maps as readers; otherwise (bare
    ``BertModel``: it is the model's output; an unknown head) declined with the reason."""
    names = _BERT_READERS.get(type(model).__name__)
    mods = dict(model.named_modules())
    if names is None or not all(linear_like(mods.get(n)) for n in names):
        ctx.decline(path, "last post-LN LayerNorm",
                    f"no gain law: the last hidden state is the output of {type(model).__name__} (or read by a head "
                    "not known to read it only through linear maps)")
        return
    gain_laws(ctx, path, norm, layer, [linear_w(n, mods[n]).in_cols() for n in names],
          ", ".join(names) + " (the last layer's output: no residual add after it)")


def _base(model, name: str):
    """``(base model, its path prefix)``: ``model.<name>`` and ``'<name>.'`` for a model with a head
    (``GPT2LMHeadModel.transformer``), the model itself and ``''`` for the bare base model (``GPT2Model``)."""
    sub = getattr(model, name, None)
    return (sub, f"{name}.") if isinstance(sub, nn.Module) else (model, "")


def _heads(config) -> tuple[int, int, int]:
    """``(num_attention_heads, hidden_size, head_dim = hidden_size // num_attention_heads)`` of a config."""
    nh, h = config.num_attention_heads, config.hidden_size
    return nh, h, h // nh


FAMILIES = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "qwen3": _llama_like, "gemma": _llama_like,
    "phi3": _llama_like, "mixtral": _llama_like, "qwen2_moe": _llama_like, "olmoe": _llama_like,
    "deepseek_v3": _llama_like, "deepseek_v2": _llama_like, "qwen3_moe": _llama_like, "gemma2": _llama_like, "gemma3_text": _llama_like,
    "olmo2": _llama_like, "olmo3": _llama_like, "exaone4": _llama_like, "granite": _llama_like,
    "seed_oss": _llama_like, "arcee": _llama_like, "glm": _llama_like, "smollm3": _llama_like, "gptj": _gptj, "gpt2": _gpt2, "gpt_neox": _neox, "falcon": _falcon, "bert": _bert,
}

