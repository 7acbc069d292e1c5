"""Multi-head latent attention (DeepSeek-V2/V3 MLA; ``docs/laws.md``, "Multi-head latent attention"; the spec's
catalogue lists MLA as open).

Names and math of transformers' ``DeepseekV3Attention`` (and V2's): per head ``i`` (``qd = nope + rope``)

* queries ``q_b_proj(q_a_layernorm(q_a_proj x))`` (``q_proj x`` when ``q_lora_rank`` is None), head i rows
  ``[i*qd, i*qd + nope)`` (no RoPE) and ``[i*qd + nope, (i+1)*qd)`` (rotated);
* ``kv_a_proj_with_mqa x`` = latent rows ``[0, kv_lora_rank)`` (through ``kv_a_layernorm``) and the rotary key
  rows ``[kv_lora_rank, kv_lora_rank + rope)``, shared by all heads;
* ``kv_b_proj`` of the normed latent: head i key rows ``[i*(nope+v), i*(nope+v) + nope)``, value rows
  ``[i*(nope+v) + nope, (i+1)*(nope+v))``; ``o_proj`` columns ``[i*v, (i+1)*v)``.

Laws (each derived in ``docs/laws.md`` and found by ``conserve.discover`` on a tiny block, complete by
``conserve.count``): QK Gram per head on the no-RoPE dims (``qk``), VO Gram per head (``vo``), one RoPE-pair law
per rotary pair summed over ALL heads against the shared rotary key rows (``rope_pair``), the gain laws of
``q_a_layernorm`` (reader ``q_b_proj``) and ``kv_a_layernorm`` (reader ``kv_b_proj``), and the scale laws of
``q_a_proj`` and of the latent rows of ``kv_a_proj_with_mqa`` (``norm_scale``: exact for eps = 0 norms, else
declined unless ``approximate``).
"""
from __future__ import annotations

from ...errors import UsageError
from ...laws import NormScaleLaw, QKGram, VOGram
from .. import builders
from .parts import Ctx, forward_src, gain_laws, linear_like, norm_kind, linear_w
from .rope import LAYOUTS, find_rope_layout


def is_mla(attn) -> bool:
    return hasattr(attn, "kv_a_proj_with_mqa") and hasattr(attn, "kv_b_proj")


def _layout(ctx: Ctx, attn, config, r: int) -> str | None:
    """The RoPE pairing of the rotary dims, read from the attention's code: V3 with ``rope_interleave`` and V2's
    complex ``apply_rotary_emb`` (``view_as_complex`` of ``(..., r/2, 2)``) rotate pairs ``{2p, 2p+1}``; V3's
    ``apply_rotary_pos_emb`` (rotate_half) pairs ``{p, p + r/2}``. ``rope_layout=`` overrides."""
    opt = ctx.options.get("rope_layout")
    if opt is not None:
        if opt not in LAYOUTS:
            raise UsageError(f"rope_layout must be one of {LAYOUTS}, got {opt!r}")
        return opt
    src = forward_src(attn)
    if "apply_rotary_pos_emb_interleave(" in src:
        return "interleaved" if getattr(config, "rope_interleave", False) else find_rope_layout(ctx, attn, r, r)
    if "apply_rotary_emb(" in src:
        return "interleaved"
    if "apply_rotary_pos_emb(" in src:
        return find_rope_layout(ctx, attn, r, r)
    return None


def mla_laws(ctx: Ctx, path: str, attn, layer: int, config) -> list | None:
    """Add the MLA laws of the attention at ``path`` to ``ctx``; return the reader refs of the norm before it
    (the columns of ``q_a_proj`` / ``q_proj`` and ``kv_a_proj_with_mqa``), or None when the layout is not
    recognised (declined with the reason)."""
    nh = config.num_attention_heads
    dn, dr, dv = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    rkv, rq = attn.kv_lora_rank, attn.q_lora_rank
    qd = dn + dr
    names = ("q_b_proj", "q_a_proj") if rq is not None else ("q_proj",)
    if not all(linear_like(getattr(attn, n, None)) for n in names + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")):
        ctx.decline(path, "multi-head latent attention (MLA)", "its projections are not all Linear layers: no law")
        return None
    q = linear_w(f"{path}.{names[0]}", getattr(attn, names[0]))
    kva = linear_w(f"{path}.kv_a_proj_with_mqa", attn.kv_a_proj_with_mqa)
    kvb = linear_w(f"{path}.kv_b_proj", attn.kv_b_proj)
    o = linear_w(f"{path}.o_proj", attn.o_proj)
    if (q.n_out, kva.n_out, kvb.n_out, o.n_in) != (nh * qd, rkv + dr, nh * (dn + dv), nh * dv):
        raise UsageError(f"{path}: MLA projection shapes {(q.n_out, kva.n_out, kvb.n_out, o.n_in)} do not match "
                         f"heads={nh}, qk_nope_head_dim={dn}, qk_rope_head_dim={dr}, v_head_dim={dv}, "
                         f"kv_lora_rank={rkv}")
    note = f"MLA head {{i}} of {nh}; nope {dn}, rope {dr}, v {dv}, kv_lora_rank {rkv}, q_lora_rank {rq}"
    for i in range(nh):
        if dn:
            ctx.add(builders.head_gram(QKGram, f"{path}/qk/head{i}", layer, [q.block(i * qd, dn)],
                                       [kvb.block(i * (dn + dv), dn)],
                                       note=note.format(i=i) + ": q rows vs kv_b_proj key rows, no-RoPE dims"))
        ctx.add(builders.head_gram(VOGram, f"{path}/vo/head{i}", layer, [kvb.block(i * (dn + dv) + dn, dv)],
                                   [o.block(i * dv, dv, kind="cols")],
                                   note=note.format(i=i) + ": kv_b_proj value rows vs o_proj columns"))
    if dr:
        layout = _layout(ctx, attn, config, dr)
        if layout is None:
            ctx.decline(f"{path}/rope", "MLA rotary dims", "the RoPE pairing could not be read from the attention's "
                        "code: pass rope_layout='half' or 'interleaved'")
        else:
            ctx.add(builders.rope_pair_law(
                f"{path}/rope", layer, q=[q.by_dim(i * qd + dn, dr) for i in range(nh)], k=[kva.by_dim(rkv, dr)],
                pairs=builders.rope_pairs(dr, layout),
                note=f"MLA: pair p of every head's rotary q rows vs the shared rotary key rows of kv_a_proj_with_mqa; "
                     f"layout {layout!r}"))
    if rq is not None:
        gain_laws(ctx, f"{path}.q_a_layernorm", attn.q_a_layernorm, layer, [q.in_cols()], "q_b_proj")
        qa = linear_w(f"{path}.q_a_proj", attn.q_a_proj)
        _scale(ctx, f"{path}.q_a_proj", layer, [qa.out_rows(0, rq), qa.b(0, rq)], attn.q_a_layernorm, "q_a_layernorm",
               "q_a_proj")
    gain_laws(ctx, f"{path}.kv_a_layernorm", attn.kv_a_layernorm, layer, [kvb.in_cols()], "kv_b_proj (keys and values)")
    _scale(ctx, f"{path}.kv_a_proj_with_mqa", layer, [kva.out_rows(0, rkv), kva.b(0, rkv)], attn.kv_a_layernorm,
           "kv_a_layernorm", f"the latent rows [0, {rkv}) of kv_a_proj_with_mqa")
    ctx.know(o.bias)
    first = linear_w(f"{path}.q_a_proj", attn.q_a_proj) if rq is not None else q
    return [first.in_cols(), kva.in_cols()]


def _scale(ctx: Ctx, path: str, layer, blocks: list, norm, norm_name: str, what: str) -> None:
    """The RMSNorm after ``what`` makes its rows scale invariant (exact for eps = 0; the mechanism of the spec's
    QK-norm breaker; ``docs/laws.md``, "MLA latent scale laws")."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if norm_kind(norm) is None or eps is None:
        ctx.decline(f"{path}/norm_scale", "MLA latent scale law", f"{norm_name} is not a recognised RMSNorm: no law")
        return
    if float(eps) == 0.0 or ctx.options.get("approximate"):
        ctx.add(NormScaleLaw.build(f"{path}/norm_scale", layer, blocks=[b for b in blocks if b is not None],
                                   note=f"{what} normalised by {norm_name}" + ("" if float(eps) == 0.0 else
                                                                               f" (approximate: eps={eps})")))
    else:
        ctx.know(*(b.param for b in blocks[1:] if b is not None))  # a bias only this (approximate) law would read
        ctx.decline(f"{path}/norm_scale", "MLA latent scale law",
                    f"{norm_name} has eps={eps}: {what} is scale invariant only up to O(eps / mean(x^2)), so its "
                    "squared norm drifts by that much; pass approximate=True to track it anyway")
