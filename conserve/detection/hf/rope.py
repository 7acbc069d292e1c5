"""RoPE of HF models: the pairing of rotary dims read by running the model's own rotary function on basis
vectors (``probe_rope``; GPT-J's signature: ``probe_gptj``), the rotary width from the config checked
against the ``inv_freq`` buffer (``find_rotary_dim``), and the layout choice with the user's override
(``find_rope_layout``). Math: spec "RoPE layouts"."""
from __future__ import annotations

import sys

import torch
from torch import nn

from ...errors import UsageError

LAYOUTS = ("half", "interleaved")


def probe_rope(fn, head_dim: int, rotary_dim: int) -> str | None:
    """RoPE pairing of an ``apply_rotary_pos_emb(q, k, cos, sin)`` function, found by running it.

    With ``cos = 0`` and ``sin = 1`` each basis vector ``e_t`` of a head is sent to +-``e_partner(t)``;
    'half' pairs ``{p, p + R/2}`` (HF rotate_half), 'interleaved' pairs ``{2p, 2p+1}``. Returns None when
    the function cannot be run this way or rotates a set of dims other than ``[0, rotary_dim)``."""
    d, r = head_dim, rotary_dim
    eye = torch.eye(d, dtype=torch.float64, device="cpu").view(d, 1, 1, d)
    cos = torch.zeros(1, 1, r, dtype=torch.float64, device="cpu")
    sin = torch.ones(1, 1, r, dtype=torch.float64, device="cpu")
    try:
        out = fn(eye, eye.clone(), cos, sin)[0].reshape(d, d)
    except Exception:
        return None
    return _pairing(out, d, r)


def probe_gptj(fn, head_dim: int, rotary_dim: int) -> str | None:
    """``probe_rope`` for GPT-J's ``apply_rotary_pos_emb(x, sin, cos)`` (x: (B, T, heads, R); sin/cos:
    (B, T, R/2), repeated to pairs inside), which GPT-J applies to the first ``rotary_dim`` dims only."""
    r = rotary_dim
    eye = torch.eye(r, dtype=torch.float64, device="cpu").view(r, 1, 1, r)
    try:
        out = fn(eye, torch.ones(1, 1, r // 2, dtype=torch.float64), torch.zeros(1, 1, r // 2, dtype=torch.float64))
        out = out.reshape(r, r)
    except Exception:
        return None
    full = torch.eye(head_dim, dtype=torch.float64)
    full[:r, :r] = out  # dims [r, head_dim) pass through (GPT-J's k_pass / q_pass)
    return _pairing(full, head_dim, r)


def _pairing(out: torch.Tensor, d: int, r: int) -> str | None:
    """'half' / 'interleaved' from the images ``out[t]`` of the basis vectors under a quarter turn."""
    partner = []
    for t in range(d):
        nz = (out[t].abs() > 0.5).nonzero().flatten().tolist()
        if len(nz) != 1:
            return None
        partner.append(nz[0])
    rotated = [t for t in range(d) if partner[t] != t]
    if rotated != list(range(r)):
        return None
    h = r // 2
    if all(partner[p] == p + h and partner[p + h] == p for p in range(h)):
        return "half"
    if all(partner[2 * p] == 2 * p + 1 and partner[2 * p + 1] == 2 * p for p in range(h)):
        return "interleaved"
    return None


def find_rotary_dim(config, head_dim: int, rotary_emb) -> int:
    """Rotary width R from the config (partial_rotary_factor / rotary_pct), checked against the
    ``inv_freq`` buffer of the model's rotary embedding (R/2 frequencies; shape only: meta-safe)."""
    rp = getattr(config, "rope_parameters", None) or {}
    factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is None:
        factor = getattr(config, "rotary_pct", 1.0)
    r = int(head_dim * factor)
    inv = getattr(rotary_emb, "inv_freq", None) if rotary_emb is not None else None
    if inv is None:
        return r
    # the model's own buffer wins: Llama-style code ignores partial_rotary_factor in its default RoPE and rotates
    # the whole head (the pairing probe then checks the rotated dims are exactly [0, R))
    if 2 * inv.shape[-1] > head_dim:
        raise UsageError(f"rotary width mismatch: the model's inv_freq has {inv.shape[-1]} frequencies "
                         f"({2 * inv.shape[-1]} rotary dims) for head_dim={head_dim} (config: {r} rotary dims); "
                         f"report this model (config.model_type={config.model_type!r})")
    return 2 * inv.shape[-1]


def find_rope_layout(ctx, attn: nn.Module, head_dim: int, r: int, probe=None) -> str:
    opt = ctx.options.get("rope_layout")
    if opt is not None:
        if opt not in LAYOUTS:
            raise UsageError(f"rope_layout must be one of {LAYOUTS}, got {opt!r}")
        return opt
    if ctx.options.get("require_rope_layout"):
        raise UsageError("the RoPE pairing cannot be known from a checkpoint's shapes (HF's converter permutes the "
                         "q/k rows of Meta checkpoints, so both layouts have the same shapes): pass "
                         "--rope-layout half (HF rotate_half, NeoX) or --rope-layout interleaved (GPT-J, Meta)")
    key = type(attn)
    if key not in ctx.rope_cache:
        fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
        ctx.rope_cache[key] = (probe or probe_rope)(fn, head_dim, r) if fn is not None else None
    lay = ctx.rope_cache[key]
    if lay is None:
        raise UsageError(f"cannot tell the RoPE pairing of {type(attn).__name__} from its code: pass "
                         "rope_layout='half' (HF rotate_half, NeoX) or 'interleaved' (GPT-J, Meta checkpoints)")
    return lay

