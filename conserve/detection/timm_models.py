"""Detector for timm Vision Transformers (``timm.models.vision_transformer.VisionTransformer``, timm 1.0.x).

Structure read from the modules (timm 1.0 source, ``timm/models/vision_transformer.py`` and
``timm/layers/attention.py``), per block ``blocks.{i}`` (``Block``, pre-LN):

* ``attn.qkv`` fused (3A, H) with A = num_heads * head_dim: rows ``[0, A)`` are Q, ``[A, 2A)`` K,
  ``[2A, 3A)`` V (the forward reshapes to (3, num_heads, head_dim)); head i owns rows ``i*D + [0, D)`` of
  each part, with the matching ``qkv.bias`` entries. ``attn.proj`` columns ``[i*D, (i+1)*D)`` are O_i.
  -> QK and VO Gram per head (spec: MHA rows). With ``qk_norm`` (per-head ``q_norm``/``k_norm``) the QK
  Gram is declined and replaced by the scale laws ``||Q_i||_F^2 + ||b_q,i||^2`` (and K) (spec: breakers,
  QK-norm), kept only when the norm has eps == 0 or with ``approximate=True`` (else declined: they
  drift by O(eps)); the q_norm/k_norm gains get a per-dim balance law. VO is kept.
* ``ls1``/``ls2`` LayerScale ``gamma`` multiplies the attention/MLP output rows: ``diag(gamma) (O x + b_o)``.
  It acts on the output side of ``proj``, so the VO column symmetry is untouched; it adds its own
  diagonal-rescaling law per feature c: ``gamma_c^2 - ||W_proj[c,:]||^2 - b_proj[c]^2`` (family
  ``layer_scale``; derived like the deep-linear law, diagonal case; checked by ``conserve.verify``).
* ``norm1`` -> gain law read by the ``qkv`` columns; ``norm2`` -> gain law read by ``mlp.fc1`` columns
  (``fc1_g`` and ``fc1_x`` for SwiGLU); LayerNorm bias gives ``beta_c^2`` (spec: pre-norm gain row).
* ``mlp``: ``Mlp`` with GELU -> declined; with ReLU -> unit balance; ``SwiGLU`` -> unit balance on
  ``fc1_x`` (the un-gated branch) and ``fc2`` (spec: SwiGLU row).
* Head: the norm that feeds ``head`` (``norm`` before pooling, or ``fc_norm`` after it for 'avg'
  pooling) gets a gain law read by the ``head`` columns (token / avg / max / avgmax pooling all commute
  with a positive per-feature scale); ``head`` gets the translation law (softmax cross-entropy; pass
  ``loss`` other than 'ce' to decline it). Attention pooling ('map', 'prr') is not detected.

Everything else (patch embedding, cls/reg tokens, position embedding, unknown block types) is declined
or listed in ``undetected``.
"""
from __future__ import annotations

import sys

from torch import nn

from ..laws import Declined, QKGram, ReLUUnit, ScaleLaw, SwiGLUUnit, Translation, VOGram
from . import builders
from .check import checked_laws
from .core import user_classes, register
from .torchnn import (NO_LAW_ACT, NO_SYMMETRY, POSITIVE_HOMOGENEOUS, POST_LN, Collector, gain_law, linear_cols, norm_parts,
                      walk)


def _is(m, name: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("timm.")


def _qk_norm(attn) -> bool:
    return not isinstance(getattr(attn, "q_norm", nn.Identity()), nn.Identity) or \
        not isinstance(getattr(attn, "k_norm", nn.Identity()), nn.Identity)


def attention_laws(c: Collector, path: str, attn, layer) -> list | None:
    """Laws of a timm ``Attention`` (fused qkv); returns the qkv column refs (its readers) or None."""
    if not _is(attn, "Attention") or getattr(attn, "gate", None) is not None:
        why = "gated attention output" if getattr(attn, "gate", None) is not None else type(attn).__name__
        c.decline(path, why, "attention variant not recognised: no law detected (the elementwise gate breaks the "
                  "VO symmetry)" if "gated" in why else "attention variant not recognised: no law detected")
        return None
    nh, d = attn.num_heads, attn.head_dim
    a = nh * d
    qkv, proj = f"{path}.qkv", f"{path}.proj"
    scale_norm = not isinstance(attn.norm, nn.Identity)
    head_laws(c, path, attn, layer, qkv=(qkv, attn.qkv, attn.qkv.bias is not None and f"{qkv}.bias"),
              starts=(0, a, 2 * a), proj=None if scale_norm else (f"{proj}.weight", attn.proj.weight.shape, 0),
              note="timm fused qkv")
    if scale_norm:
        c.declined.append(Declined(f"{path}.norm", "scale_norm", "a norm between the attention output and proj "
                                   "breaks the VO law; its own gain law is read by proj"))
        gain_law(c, f"{path}.norm", attn.norm, [linear_cols(proj, attn.proj)], layer, "attn.proj")
    c.mark(path)
    return [linear_cols(qkv, attn.qkv)]


def head_laws(c: Collector, path: str, attn, layer, *, qkv, starts, proj, note: str) -> None:
    """Per-head QK Gram (or QK-norm scale + gain laws) and VO Gram laws of one attention whose q, k, v are
    row blocks of one fused Linear ``qkv = (path, module, bias name or None)`` starting at rows
    ``starts = (q0, k0, v0)``; head i owns rows ``start + i*D + [0, D)``. ``proj = (weight name, shape,
    first column)`` is the output projection (None: no VO law). ``attn`` gives num_heads, head_dim,
    q_norm and k_norm."""
    nh, d = attn.num_heads, attn.head_dim
    qkv_path, lin, bias = qkv
    qs = lin.weight.shape
    q0, k0, v0 = starts

    qk_norm = _qk_norm(attn)
    keep = eps = None
    if qk_norm:
        eps = getattr(attn.q_norm, "eps", None)
        keep = eps == 0 or c.options.get("approximate")
        c.declined.append(Declined(qkv_path, "QK-norm: QK Gram laws", "per-head q_norm/k_norm remove the GL(D) "
                                   "symmetry of the q/k rows; replaced by the scale laws ||Q_i||_F^2, ||K_i||_F^2 "
                                   "(spec: breakers, QK-norm)"))
        qn, kn = norm_parts(attn.q_norm), norm_parts(attn.k_norm)
        if qn and kn and type(attn.q_norm) is type(attn.k_norm) and (qn[1] is None) == (kn[1] is None):
            # scaling dim t of q_norm's output by s and of k_norm's by 1/s leaves every score q.k unchanged
            c.add(builders.qk_norm_gain_law(f"{path}/qk_norm_gain", layer, q_gain=f"{path}.q_norm.weight",
                                            k_gain=f"{path}.k_norm.weight", entries=[[t] for t in range(d)],
                                            q_bias=f"{path}.q_norm.bias" if qn[1] else None,
                                            k_bias=f"{path}.k_norm.bias" if kn[1] else None,
                                            note="per head dim t: g_q[t]^2 + b_q[t]^2 - g_k[t]^2 - b_k[t]^2"))
        c.mark(f"{path}.q_norm", f"{path}.k_norm")
    w = f"{qkv_path}.weight"

    def blk(start):  # head rows start + [0, D) of qkv, with the bias entries
        return builders.block(w, qs, range(start, start + d), bias=bias or None)

    for i in range(nh):
        q_i, k_i = blk(q0 + i * d), blk(k0 + i * d)
        if qk_norm and keep:
            law_note = "QK-norm scale law" + ("" if eps == 0 else f" (approximate: eps={eps}, error O(eps / mean(q^2)))")
            c.add(ScaleLaw.build(f"{path}/qk_scale/q_head{i}", layer, blocks=q_i, note=law_note),
                  ScaleLaw.build(f"{path}/qk_scale/k_head{i}", layer, blocks=k_i, note=law_note))
        elif qk_norm:
            for x in ("q", "k"):
                c.declined.append(Declined(f"{path}/qk_scale/{x}_head{i}", "QK-norm scale law",
                                           f"the norm has eps={eps}: the normalised q/k are scale invariant only up "
                                           "to O(eps / mean(q^2)), so ||Q||^2 drifts by that much; pass "
                                           "approximate=True to track it anyway"))
        else:
            c.add(builders.head_gram(QKGram, f"{path}/qk/head{i}", layer, [q_i], [k_i], note=note))
        if proj is not None:
            pw, ps, p0 = proj
            c.add(builders.head_gram(VOGram, f"{path}/vo/head{i}", layer, [blk(v0 + i * d)],
                                     [builders.block(pw, ps, range(p0 + i * d, p0 + (i + 1) * d), kind="cols")],
                                     note=note))


def parallel_block_laws(c: Collector, path: str, blk, layer) -> None:
    """timm ``ParallelScalingBlock`` (ViT-22B): ``y = in_proj(in_norm(x))`` split by rows into
    ``[mlp (M) | q (C) | k (C) | v (C)]``; attention as in ``head_laws`` on those row blocks, output by
    ``attn_out_proj`` (or columns ``[0, C)`` of a fused ``out_proj``); MLP ``mlp_out_proj(act(x_mlp +
    mlp_bias))`` (columns ``[C, C + M)`` of a fused ``out_proj``): ReLU unit law, none for GELU/SiLU;
    ``in_norm`` gain law read by every column of ``in_proj``; LayerScale ``ls`` on the sum of both outputs:
    ``gamma_c^2`` minus row c of both output maps (and their biases)."""
    lin, C, M = blk.in_proj, blk.num_heads * blk.head_dim, blk.in_split[0]
    if list(blk.in_split) != [M, C, C, C] or not isinstance(lin, nn.Linear):
        c.decline(path, "ParallelScalingBlock", f"in_proj split {blk.in_split} is not [mlp | q | k | v]: no law")
        return
    ip = f"{path}.in_proj"
    bias = f"{ip}.bias" if lin.bias is not None else None
    fused = blk.out_proj is not None
    if fused:
        outs = [(f"{path}.out_proj", blk.out_proj)]
        attn_proj = (f"{path}.out_proj.weight", blk.out_proj.weight.shape, 0)
        down = (f"{path}.out_proj.weight", blk.out_proj.weight.shape, C)
    else:
        outs = [(f"{path}.attn_out_proj", blk.attn_out_proj), (f"{path}.mlp_out_proj", blk.mlp_out_proj)]
        attn_proj = (f"{path}.attn_out_proj.weight", blk.attn_out_proj.weight.shape, 0)
        down = (f"{path}.mlp_out_proj.weight", blk.mlp_out_proj.weight.shape, 0)
    head_laws(c, path, blk, layer, qkv=(ip, lin, bias), starts=(M, M + C, M + 2 * C), proj=attn_proj,
              note="timm ParallelScalingBlock in_proj rows [mlp | q | k | v]")
    act = blk.mlp_act
    up_b = bias or (f"{path}.mlp_bias" if blk.mlp_bias is not None else None)
    if isinstance(act, (nn.ReLU, nn.LeakyReLU)):
        c.add(builders.unit_law(ReLUUnit, f"{path}/mlp/unit", layer, up=f"{ip}.weight", up_shape=lin.weight.shape,
                                units=range(M), up_bias=up_b, down=down[0], down_shape=down[1],
                                features=range(down[2], down[2] + M), note=f"in_proj rows [0, {M}), {type(act).__name__}"))
    else:
        c.decline(f"{path}.mlp_act", f"{type(act).__name__} MLP of the parallel block", NO_LAW_ACT)
    gain_law(c, f"{path}.in_norm", blk.in_norm, [linear_cols(ip, lin)], layer, "in_proj (mlp, q, k, v)")
    if not isinstance(blk.ls, nn.Identity):
        if _is(blk.ls, "LayerScale") and isinstance(getattr(blk.ls, "gamma", None), nn.Parameter):
            c.add(builders.layer_scale_law(f"{path}.ls/layer_scale", layer, f"{path}.ls.gamma", C,
                                           [(f"{op}.weight", o.weight.shape, f"{op}.bias" if o.bias is not None else None,
                                             False) for op, o in outs],
                                           note="LayerScale gamma times the rows of both output maps"))
        else:
            c.decline(f"{path}.ls", type(blk.ls).__name__, "residual scale not recognised: no law detected")
    c.mark(path)


def mlp_laws(c: Collector, path: str, mlp, layer) -> list | None:
    """Laws of a timm ``Mlp`` / ``SwiGLU``; returns the refs of the maps reading its input, or None."""
    hidden_norm = not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity)
    if _is(mlp, "Mlp") and isinstance(mlp.fc1, nn.Linear) and isinstance(mlp.fc2, nn.Linear):
        act = mlp.act
        if hidden_norm:
            c.declined.append(Declined(f"{path}.fc1", "Mlp with a hidden norm", "the norm between fc1 and fc2 breaks "
                                       "the per-unit law; its gain law is read by fc2"))
            gain_law(c, f"{path}.norm", mlp.norm, [linear_cols(f"{path}.fc2", mlp.fc2)], layer, "mlp.fc2")
        elif isinstance(act, (nn.ReLU, nn.LeakyReLU)):
            c.add(_unit(ReLUUnit, path, "fc1", mlp.fc1, 0, mlp.fc1.out_features, mlp.fc2, layer, "timm Mlp, ReLU"))
        else:
            c.declined.append(Declined(path, f"{type(act).__name__} Mlp", NO_LAW_ACT))
        c.mark(path)
        return [linear_cols(f"{path}.fc1", mlp.fc1)]
    if _is(mlp, "SwiGLU") and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("fc1_g", "fc1_x", "fc2")):
        if hidden_norm:
            c.declined.append(Declined(f"{path}.fc1_x", "SwiGLU with a hidden norm", "the norm between fc1 and fc2 "
                                       "breaks the per-unit law; its gain law is read by fc2"))
            gain_law(c, f"{path}.norm", mlp.norm, [linear_cols(f"{path}.fc2", mlp.fc2)], layer, "mlp.fc2")
        elif _elementwise(mlp.act):
            c.add(_unit(SwiGLUUnit, path, "fc1_x", mlp.fc1_x, 0, mlp.fc1_x.out_features, mlp.fc2, layer,
                        f"timm SwiGLU ({type(mlp.act).__name__} gate): up = fc1_x (gate fc1_g not involved)"))
        else:
            c.declined.append(Declined(path, f"GLU with {type(mlp.act).__name__}", "gate activation not "
                                       "recognised as elementwise: no law detected"))
        c.mark(path)
        return [linear_cols(f"{path}.fc1_g", mlp.fc1_g), linear_cols(f"{path}.fc1_x", mlp.fc1_x)]
    if _is(mlp, "GluMlp") and isinstance(mlp.fc1, nn.Linear) and isinstance(mlp.fc2, nn.Linear):
        # fc1 rows [x1 | x2]; gate_last: x1 * act(x2), else act(x1) * x2 (SwiGLUPacked); the un-gated half is "up"
        n = mlp.fc1.out_features // 2
        up0 = 0 if mlp.gate_last else n
        if hidden_norm:
            c.declined.append(Declined(f"{path}.fc1", "GluMlp with a hidden norm", "the norm between fc1 and fc2 "
                                       "breaks the per-unit law; its gain law is read by fc2"))
            gain_law(c, f"{path}.norm", mlp.norm, [linear_cols(f"{path}.fc2", mlp.fc2)], layer, "mlp.fc2")
        elif _elementwise(mlp.act):
            c.add(_unit(SwiGLUUnit, path, "fc1", mlp.fc1, up0, n, mlp.fc2, layer,
                        f"timm GluMlp ({type(mlp.act).__name__} gate on fc1 rows [{n - up0}, {2 * n - up0})): up = fc1 "
                        f"rows [{up0}, {up0 + n})"))
        else:
            c.declined.append(Declined(path, f"GluMlp with {type(mlp.act).__name__}", "gate activation not "
                                       "recognised as elementwise: no law detected"))
        c.mark(path)
        return [linear_cols(f"{path}.fc1", mlp.fc1)]
    c.decline(path, type(mlp).__name__, "MLP variant not recognised: no law detected")
    return None


def _unit(cls, path: str, up_name: str, up: nn.Linear, start: int, n: int, fc2: nn.Linear, layer, note: str):
    """Unit law (``builders.unit_law``) of rows ``start..start+n`` of ``{path}.{up_name}`` read by ``{path}.fc2``."""
    return builders.unit_law(cls, f"{path}/unit", layer, up=f"{path}.{up_name}.weight", up_shape=up.weight.shape,
                             units=range(start, start + n), up_bias=f"{path}.{up_name}.bias" if up.bias is not None
                             else None, down=f"{path}.fc2.weight", down_shape=fc2.weight.shape, note=note)


def _elementwise(act) -> bool:
    """An elementwise activation module (so ``act(g) * u`` is per unit and the gate is not in the law)."""
    return isinstance(act, NO_SYMMETRY + POSITIVE_HOMOGENEOUS) or any(_is(act, n) for n in ("GELU", "GELUTanh", "QuickGELU"))


def layer_scale_law(c: Collector, path: str, ls, lin_path: str, lin: nn.Linear, layer) -> None:
    if isinstance(ls, nn.Identity):
        return
    if not _is(ls, "LayerScale") or not isinstance(getattr(ls, "gamma", None), nn.Parameter):
        c.decline(path, type(ls).__name__, "residual scale not recognised: no law detected")
        return
    h = lin.out_features
    c.add(builders.layer_scale_law(f"{path}/layer_scale", layer, f"{path}.gamma", h,
                                   [(f"{lin_path}.weight", lin.weight.shape,
                                     f"{lin_path}.bias" if lin.bias is not None else None, False)],
                                   note=f"LayerScale gamma times {lin_path} output rows"))
    c.mark(path)


def block_laws(c: Collector, path: str, blk, layer) -> None:
    if _is(blk, "ParallelScalingBlock"):
        parallel_block_laws(c, path, blk, layer)
        return
    pre = _is(blk, "Block")
    post = _is(blk, "ResPostBlock")
    if not (pre or post):
        return  # left for the generic walk / undetected
    readers_attn = attention_laws(c, f"{path}.attn", blk.attn, layer)
    readers_mlp = mlp_laws(c, f"{path}.mlp", blk.mlp, layer)
    if pre:
        for ls, sub, lin in (("ls1", "attn", "proj"), ("ls2", "mlp", "fc2")):
            sub_m = getattr(blk, sub)
            if isinstance(getattr(sub_m, lin, None), nn.Linear) and c.covered(f"{path}.{sub}"):
                layer_scale_law(c, f"{path}.{ls}", getattr(blk, ls), f"{path}.{sub}.{lin}", getattr(sub_m, lin), layer)
        for norm, readers, who in (("norm1", readers_attn, "attn.qkv"), ("norm2", readers_mlp, "mlp input (fc1)")):
            if readers is None:
                c.decline(f"{path}.{norm}", "pre-LN gain", "the block it feeds is not recognised, so its readers are "
                          "unknown: no gain law")
            else:
                gain_law(c, f"{path}.{norm}", getattr(blk, norm), readers, layer, who)
    else:
        for norm in ("norm1", "norm2"):
            c.decline(f"{path}.{norm}", "ResPostBlock norm", POST_LN)
    c.mark(path)


def _is_vit(model) -> bool:
    mod = sys.modules.get("timm.models.vision_transformer")
    return mod is not None and isinstance(model, mod.VisionTransformer)


@register("timm")
def detect_timm(model: nn.Module, config, *, loss: str | None = "ce", **options):
    """timm VisionTransformer detector (module docstring); None for any other model.

    Options: ``loss`` (translation law only for 'ce', the default), ``approximate=True`` keeps the QK-norm
    scale laws when the norm has eps > 0 (same meaning as in ``conserve.detection.hf``)."""
    if not _is_vit(model):
        return None
    c = Collector(model, options)
    for i, blk in enumerate(model.blocks):
        block_laws(c, f"blocks.{i}", blk, i)
    # what feeds the head (DeiT distilled: head_dist reads the distillation token of the same norm)
    head = model.head
    heads = ["head"] + (["head_dist"] if isinstance(getattr(model, "head_dist", None), nn.Linear) else [])
    pool = model.global_pool
    norm_path = "fc_norm" if not isinstance(model.fc_norm, nn.Identity) else "norm"
    norm = getattr(model, norm_path)
    if not isinstance(head, nn.Linear):
        if not isinstance(norm, nn.Identity):
            c.decline(norm_path, "final norm", "no classifier head (num_classes=0): the normed features are the "
                      "output, nothing reads them; no gain law")
    else:
        if getattr(model, "attn_pool", None) is not None:
            if not isinstance(norm, nn.Identity):
                c.decline(norm_path, f"final norm before '{pool}' attention pooling",
                          "the attention pool between the norm and the head is not detected: no gain law")
        elif not isinstance(norm, nn.Identity):
            readers = [linear_cols(h, getattr(model, h)) for h in heads]
            gain_law(c, norm_path, norm, readers, None, f"{' and '.join(heads)} (after '{pool or 'no'}' pooling)")
        if not isinstance(model.norm, nn.Identity) and not isinstance(model.fc_norm, nn.Identity):
            c.decline("norm", "final norm feeding fc_norm", "the norm output is re-normalised by fc_norm: no gain law")
        for h in heads:  # the logits of each head enter a softmax (DeiT: averaged with head_dist's, or its own loss)
            w, b = getattr(model, h).weight, getattr(model, h).bias
            if loss == "ce":
                c.add(builders.row_sum_law(Translation, f"{h}/translation", None, f"{h}.weight", w.shape, w.shape[0],
                                           bias=f"{h}.bias" if b is not None else None,
                                           note="softmax cross-entropy only (pass loss=... otherwise)"))
                c.mark(h)
            else:
                c.decline(h, "classifier", f"translation law holds only for softmax cross-entropy (loss={loss!r})")
    emb = "no law: the embedding feeds the residual stream, nothing on the other side of it"
    c.decline("patch_embed", "patch embedding", emb)
    for p in ("cls_token", "reg_token", "dist_token", "pos_embed"):
        if isinstance(getattr(model, p, None), nn.Parameter):
            c.decline(p, p.replace("_", " "), emb)
    if not isinstance(getattr(model, "norm_pre", nn.Identity()), nn.Identity):
        c.decline("norm_pre", "pre-norm after the embedding", POST_LN.replace("post-LN", "norm_pre"))
    walk(c, model, loss=None, skip=[f"blocks.{i}" for i in range(len(model.blocks))] + heads)
    d = c.finish("timm")
    mine = user_classes(model, ("timm.", "torch."))
    if mine:  # user code inside (a subclass, a module put in place of one): keep only the laws the model's forward keeps
        why = f"{mine[0]} is not timm's code (which this detector read)"
        d.laws, more = checked_laws(model, d.laws, {**options, "why": why})
        d.declined += more
    return d

