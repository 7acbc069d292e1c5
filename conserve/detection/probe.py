"""The probe of structural detection: a float64 copy of the model with random parameters, and its inputs.

* ``make_probe(model, max_params)``: a float64 CPU copy, random parameters (N(0, 1/fan_in) matrices, gains
  1 +- 0.3, biases +- 0.3), eval mode; the user's model is never modified. A law is a property of the
  architecture, so any values serve, and random ones make every block generic.
* ``synth_inputs(model, given)``: what ``forward`` takes: ``given`` (floats cast), else token ids for an
  ``nn.Embedding``, ``(2, 6, in_features)`` / ``(4, in_features)`` floats for the first ``nn.Linear`` / norm, images
  at the model's declared size for a convolution; an HF encoder-decoder also gets ``decoder_input_ids``.
* ``no_cache(model, kwargs)``: ``use_cache=False`` where ``forward`` takes it (a KV cache is inference state).
"""
from __future__ import annotations

import math

import copy
import inspect

import torch
from torch import nn

__all__ = ["make_probe", "randomize", "synth_inputs", "no_cache", "declared_sizes"]


def randomize(model: nn.Module, seed: int = 0) -> None:
    """Random parameters in place (the probe's: see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / max(p.shape[-1], 1) ** 0.5)
            else:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + base)


def make_probe(model: nn.Module, max_params: float) -> nn.Module:
    """float64 CPU copy with random parameters, eval mode (raises ValueError with the reason if impossible)."""
    n = sum(p.numel() for p in model.parameters())
    if n > max_params:
        raise ValueError(f"the model has {n:.3g} parameters, above max_probe_params={max_params:.3g}: the float64 "
                         "probe would be too large; detect a reduced-width instance or raise max_probe_params")
    meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    probe = copy.deepcopy(model)
    if meta:
        if any(b.is_floating_point() or b.is_complex() for b in model.buffers()):
            raise ValueError("meta-device model with floating buffers (e.g. RoPE frequencies): their values are "
                             "unknown, so the probe cannot run; build the model on CPU (a reduced width works)")
        probe = probe.to_empty(device="cpu")
    probe = probe.double()  # floating tensors only (Module.to(float64) would drop complex RoPE buffers' imaginary part)
    with torch.no_grad():
        for mod in probe.modules():
            for k, b in list(mod._buffers.items()):
                if b is not None and b.is_complex():
                    mod._buffers[k] = b.to(torch.complex128)
    randomize(probe)
    _traceable_experts(probe)
    _grad_mode_forwards(probe)
    return probe.eval()


def _grad_mode_forwards(probe: nn.Module) -> None:
    """A ``forward`` decorated with ``torch.inference_mode()`` / ``torch.no_grad()`` (Meta's reference Llama, inference
    code) runs undecorated in the probe: the first-order check differentiates it, and inputs captured under
    inference mode cannot be saved for backward. The user's model keeps its decorator."""
    import types

    for mod in probe.modules():
        f = type(mod).forward
        inner = getattr(f, "__wrapped__", None)
        if inner is None or getattr(f, "__code__", None) is None or f.__code__.co_name != "decorate_context":
            continue
        ctx = [c.cell_contents for c in (f.__closure__ or ()) if callable(getattr(c, "cell_contents", None))]
        owners = {type(getattr(c, "__self__", None)) for c in ctx}
        if owners & {torch.inference_mode, torch.no_grad}:
            mod.forward = types.MethodType(inner, mod)


def _traceable_experts(probe: nn.Module) -> None:
    """HF fused experts (``transformers.integrations.moe.use_experts_implementation``) run as ``batched_mm`` in the
    probe: the same function (each token's gathered expert weights, one batched matmul), without the eager loop
    over the experts a batch routes to (``nonzero`` + Python ``for``: data-dependent, neither torch.fx nor
    torch.export can trace it) or ``grouped_mm`` (no float64 kernel). Only the probe's own config copy changes."""
    for mod in probe.modules():
        cfg = getattr(mod, "config", None)
        if hasattr(mod, "has_gate") and hasattr(mod, "is_transposed") and \
                getattr(cfg, "_experts_implementation", "batched_mm") not in (None, "batched_mm"):
            try:
                cfg._experts_implementation = "batched_mm"
            except Exception:  # noqa: BLE001 - an older transformers without it: the probe runs as it is
                pass


def synth_inputs(model: nn.Module, given=None, kwargs: dict | None = None, dtype=torch.float64, device=None) -> tuple:
    """The probe's positional inputs: ``given`` (floats cast to ``dtype``), else synthesised from the first
    parameterised module (see the module docstring), floats of ``dtype`` on ``device``. Raises ValueError naming
    the fix."""
    g = torch.Generator().manual_seed(1)
    _decoder_inputs(model, kwargs, g, given)
    if given is not None:
        if isinstance(given, dict):
            raise ValueError("example_inputs is a dict: pass keyword inputs as forward_kwargs={...} (example_inputs "
                             "takes what forward takes positionally, a tensor or a tuple)")
        given = given if isinstance(given, tuple) else (given,)
        return tuple(x.detach().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                     for x in given)
    cands = []
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if emb:
        cands.append((torch.randint(0, min(e.num_embeddings for e in emb), (2, 6), generator=g),))
    for m in model.modules():
        width = None
        if isinstance(m, nn.Linear):
            width = m.in_features
        elif type(m).__name__ == "Conv1D" and hasattr(m, "nf"):
            width = m.weight.shape[0]
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.normalized_shape and len(m.normalized_shape) == 1:
            width = m.normalized_shape[0]
        elif isinstance(m, (nn.Conv1d, nn.Conv2d)):
            nd = 1 if isinstance(m, nn.Conv1d) else 2
            for size in dict.fromkeys(declared_sizes(model, nd) + [(8,) * nd, (32,) * nd, (64,) * nd]):
                cands.append((torch.randn((2, m.in_channels) + size, generator=g, dtype=torch.float64),))
        if width is not None:
            cands += [(torch.randn(2, 6, width, generator=g, dtype=torch.float64),),
                      (torch.randn(4, width, generator=g, dtype=torch.float64),)]
            cands += [(torch.randn((2, c) + size, generator=g, dtype=torch.float64),)
                      for c, size in patch_images(model, width)]
        if len(cands) >= 6:
            break
    cands = [tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in x) for x in cands]
    errors = []
    for x in cands:
        try:
            with torch.no_grad():
                model(*x, **(kwargs or {}))
            return x
        except Exception as e:  # noqa: BLE001 - try the next shape
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160])
            continue
    tried = f" (the first candidate, {tuple(tuple(t.shape) for t in cands[0])}, gave {errors[0]})" if errors else ""
    raise ValueError("cannot synthesise an input for this model" + tried
                     + ": pass example_inputs=(...) (what forward takes)")


def _decoder_inputs(model: nn.Module, kwargs: dict | None, g: torch.Generator, given=None) -> None:
    """An HF encoder-decoder (``config.is_encoder_decoder``: T5, Whisper, ...) needs decoder inputs besides the
    encoder's; when neither ``decoder_input_ids`` nor ``decoder_inputs_embeds`` is given (and ``forward`` takes them),
    random ``decoder_input_ids`` (2, 5) from the decoder's vocabulary go into ``kwargs`` (traced by torch.export
    as an input, like a user's ``forward_kwargs``)."""
    cfg = getattr(model, "config", None)
    if kwargs is None or not getattr(cfg, "is_encoder_decoder", False) or \
            {"decoder_input_ids", "decoder_inputs_embeds"} & set(kwargs):
        return
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    names = [k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = given if isinstance(given, tuple) else (() if given is None else (given,))
    if any(k in names and names.index(k) < len(given) and given[names.index(k)] is not None
           for k in ("decoder_input_ids", "decoder_inputs_embeds")):
        return  # given positionally
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    if "decoder_input_ids" in params and isinstance(vocab, int) and vocab > 0:
        kwargs["decoder_input_ids"] = torch.randint(0, vocab, (2, 5), generator=g)


def no_cache(model: nn.Module, kwargs: dict, args=None) -> dict:
    """``use_cache=False`` in ``kwargs`` when ``model.forward`` takes it, by name or through ``**kwargs`` of an HF
    model (Llava, Gemma3 multimodal: a KV cache in the output stops torch.export); it is inference state, not part
    of the function. Not when the positional ``args`` (a block's recorded call) already bind it. Returns
    ``kwargs``."""
    try:
        sig = inspect.signature(model.forward)
        params = sig.parameters
        if args is not None and "use_cache" in sig.bind_partial(*(args if isinstance(args, tuple) else (args,))
                                                                ).arguments:
            return kwargs
    except (TypeError, ValueError):
        return kwargs
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "use_cache" in params or (var_kw and (hasattr(config, "use_cache") or hasattr(text, "use_cache"))):
        kwargs.setdefault("use_cache", False)
    return kwargs


def patch_images(model: nn.Module, width: int) -> list[tuple[int, tuple[int, int]]]:
    """``(channels, (H, W))`` of images a first layer of ``width`` features could read as flattened ``p x p``
    patches (``Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)')``, vit-pytorch): ``width = c p^2`` with 3 or 1
    channels; sizes declared by the model, a grid matching a ``(1, N [+ 1], D)`` position parameter, 2 x 2 and
    4 x 4 patches."""
    out = []
    for c in (3, 1):
        p = math.isqrt(width // c) if width % c == 0 else 0
        if p < 2 or c * p * p != width:
            continue
        sizes = [s for s in declared_sizes(model, 2) if s[0] % p == 0 and s[1] % p == 0]
        for t in model.parameters():
            if t.dim() == 3 and t.shape[0] == 1:
                for n in (t.shape[1], t.shape[1] - 1):
                    r = math.isqrt(max(n, 0))
                    if r > 0 and r * r == n:
                        sizes.append((r * p, r * p))
        sizes += [(2 * p, 2 * p), (4 * p, 4 * p)]
        out += [(c, s) for s in dict.fromkeys(sizes)][:4]
    return out


def declared_sizes(model: nn.Module, nd: int) -> list[tuple]:
    """Input sizes the model declares (timm ``pretrained_cfg['input_size']`` / ``patch_embed.img_size``, HF
    ``config.image_size``, an ``img_size`` attribute): Swin, EVA or a strided ConvNeXt run on no other size."""
    out = []
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    for v in ((cfg or {}).get("input_size"), getattr(getattr(model, "patch_embed", None), "img_size", None),
              getattr(getattr(model, "config", None), "image_size", None), getattr(model, "img_size", None)):
        if isinstance(v, int):
            v = (v,) * nd
        if isinstance(v, (tuple, list)) and len(v) >= nd and all(isinstance(a, int) and a > 0 for a in v[-nd:]):
            out.append(tuple(v[-nd:]))
    return out
