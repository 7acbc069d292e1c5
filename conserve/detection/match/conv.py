"""Convolutions (``docs/laws.md``, "Convolutions"): the per-channel laws of a conv's output channels read by the
next map, and the gain laws of a per-channel norm read by convolutions, in any forward code.

* channel chains: a map reading (``Conv``, or a plain ``Lin`` after a flatten / pooling) what one convolution wrote,
  through ops that act channel by channel. What those ops allow is measured on the recorded values, not read off
  their names: when the reader's input moves with every mixing of the writer's channels (identity, average
  pooling, zero padding, upsampling, flatten) the channel Gram law (``DeepLinearGram`` over channels); when it
  moves with a positive rescaling of each channel only (ReLU, leaky ReLU, max pooling, dropout) the per-channel
  balance ``||W1[c]||^2 + b1[c]^2 - ||W2[:, c]||^2`` (``ReLUUnit``). A writer whose channels are also read
  elsewhere (a branch, a residual) is declined.
* channel gains: a BatchNorm / GroupNorm / InstanceNorm whose affine output is read, channel by channel and
  positively homogeneously, only by convolutions (or a linear map after a flatten): the gain law
  ``g[c]^2 + beta[c]^2 - sum_M ||W_M[:, c]||^2``; otherwise declined with what reads it.

The laws are built by ``builders.ChannelMap`` (the torch.nn detector's builders) and pass the first-order check
like every candidate.
"""
from __future__ import annotations

import torch
from torch import fx, nn

from ...laws import DeepLinearGram, ReLUUnit
from ...laws.tolerance import PROBE_CONFIRM_ATOL, PROBE_CONFIRM_RTOL
from .. import builders
from ..fxgraph import Graph, with_strides_of
from ..ops import CASTS, NO_LAW, SHAPE_ONLY
from .found import Found, layer_index

__all__ = ["channel_gains", "channel_norms", "channels", "per_channel"]

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def per_channel(g: Graph, src: fx.Node, dst: fx.Node, channels: int) -> tuple[str, int] | None:
    """How ``dst`` depends on the ``channels`` channels (dim 1) of ``src``: ``('linear', per)`` when it moves with
    every mixing of them, ``('positive', per)`` with a positive rescaling of each only, None otherwise. ``dst`` is
    channel-first with the same channels (``per`` = 1), or a 2-D ``(N, channels * per)`` flattened channel-major."""
    z, y = g.env.get(src), g.env.get(dst)
    if not (isinstance(z, torch.Tensor) and isinstance(y, torch.Tensor) and z.is_floating_point()
            and y.is_floating_point()) or z.dim() < 2 or z.shape[1] != channels:
        return None
    if y.dim() >= 3 and y.shape[1] == channels:
        per, flat = 1, False
    elif y.dim() == 2 and y.shape[-1] % channels == 0:
        per, flat = y.shape[-1] // channels, True
    else:
        return None
    gen = torch.Generator().manual_seed(13)

    def mix(t: torch.Tensor, m: torch.Tensor, flat_: bool) -> torch.Tensor:
        """``m`` applied to the channels of ``t`` (dim 1, or blocks of ``per`` features of the last dim)."""
        if flat_:
            return torch.einsum("ij,njp->nip", m, t.reshape(t.shape[0], channels, per)).reshape(t.shape)
        return torch.einsum("ij,nj...->ni...", m, t)

    # the recorded values, and unit normal ones: a probe whose activations are large reaches SiLU / GELU where they
    # are the identity to rounding (an SE block deep in EfficientNet), and small ones stay below ReLU6's clip
    fresh = torch.randn(z.shape, generator=gen, dtype=torch.float64).to(z.dtype)
    try:  # and 30 times larger: ReLU6 / hardtanh clip there (their rescaling holds only below the clip)
        points = [(z, y)] + [(v, g.run({src: with_strides_of(z, v)}, [dst])[0]) for v in (fresh, 30.0 * fresh)]
    except Exception:  # noqa: BLE001 - not a map of src alone
        return None

    def moves_with(m: torch.Tensor) -> bool:
        for z_, y_ in points:
            try:
                out = g.run({src: with_strides_of(z, mix(z_, m, False).to(z.dtype))}, [dst])[0]
            except Exception:  # noqa: BLE001 - not a map of src alone
                return False
            want = mix(y_, m, flat)
            scale = float(want.abs().max()) if want.numel() else 0.0
            if not (isinstance(out, torch.Tensor) and out.shape == y.shape and bool(torch.allclose(
                    out, want, rtol=PROBE_CONFIRM_RTOL, atol=PROBE_CONFIRM_ATOL * max(scale, 1.0)))):
                return False
        return True

    diag = torch.diag(torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5).to(z.dtype)
    if not moves_with(diag):
        return None
    mixing = torch.randn(channels, channels, generator=gen, dtype=torch.float64).to(z.dtype) / channels ** 0.5
    return ("linear" if moves_with(mixing) else "positive"), per


def _reader_map(g: Graph, n: fx.Node):
    """``(input node, ChannelMap)`` of a convolution or a plain linear map (``(out, in)`` storage), else None."""
    if n in g.convs:
        return g.convs[n].x, g.convs[n].cmap
    lin = g.lin_at(n)
    if lin is not None and lin.plain and not lin.t:
        return lin.x, builders.ChannelMap(lin.w, lin.shape, lin.b)
    return None


def _writer(g: Graph, x: fx.Node) -> fx.Node | None:
    """The one convolution or linear map nearest behind ``x`` (``x`` itself when it is one), walking back over
    tensor values; None when there is none or more than one."""
    seen, out, stack = set(), set(), [x]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in g.convs or m in g.lins:
            out.add(m)
            continue
        stack += [a for a in m.all_input_nodes if g.is_tensor(a) and a.op not in ("get_attr", "placeholder")]
    return next(iter(out)) if len(out) == 1 else None


def _kind(g: Graph, n: fx.Node) -> str:
    """The module type of a ``call_module`` node, else its op."""
    return type(g.gm.get_submodule(n.target)).__name__ if n.op == "call_module" else g.op(n)


def _other_reader(g: Graph, src: fx.Node, dst: fx.Node) -> fx.Node | None:
    """A node reading a value computed from ``src`` that is not on a path to ``dst`` (shape reads aside)."""
    to_dst = g.ancestors([dst])
    seen, stack = {src}, [src]
    while stack:
        m = stack.pop()
        for u in m.users:
            if u is dst or u in seen or g.op(u) in SHAPE_ONLY:
                continue
            if u not in to_dst:
                return u
            seen.add(u)
            stack.append(u)
    return None


def channels(f: Found) -> None:
    """The channel-chain finder (module docstring): every reader of one convolution's channels."""
    g, c = f.g, f.c
    for n in g.nodes:
        rd = _reader_map(g, n)
        if rd is None:
            continue
        x, down = rd
        w = _writer(g, x)
        if w is None or w not in g.convs or w in f.used:
            continue
        up = g.convs[w]
        kind = per_channel(g, w, x, up.cmap.out_channels)
        if kind is None and _other_reader(g, w, n) is None and _path_is_elementwise(g, w, x):
            f.used.add(w)
            reader = down.weight.rsplit(".", 1)[0] if "." in down.weight else down.weight
            c.decline(up.module, f"{_kind(g, w)} output channels",
                      f"read by {reader!r} through an element-wise map that is not positively homogeneous (GELU, SiLU, "
                      "...): no channel rescaling passes it, no law (spec: GELU / SiLU FFN row)")
            continue
        if kind is None or down.in_channels != up.cmap.out_channels * kind[1]:
            continue
        (how, per), other = kind, _other_reader(g, w, n)
        reader = down.weight.rsplit(".", 1)[0] if "." in down.weight else down.weight
        f.used.add(w)
        if other is not None:
            c.decline(up.module, f"{_kind(g, w)} output channels",
                      f"read by {reader!r} and also by a {g.op(other)!r} op: a per-channel law would need the "
                      "columns of every reader: no law")
            continue
        law, layer = None, layer_index(up.module)
        if how == "linear":
            law = builders.channel_gram_law(DeepLinearGram, f"{up.module}-{reader}/gram", layer, up.cmap, down,
                                            per=per, note="structural: channels read through maps that act the same "
                                                          'on every channel (docs/laws.md, "Channel Gram")')
        if law is None:
            law = builders.channel_unit_law(ReLUUnit, f"{up.module}-{reader}/unit", layer, up.cmap, down, per=per,
                                            note="structural: channels read through positively homogeneous "
                                                 'per-channel ops (docs/laws.md, "Conv-ReLU-Conv")')
        f.add(law, "channel Gram" if law.family == "deep_linear" else "channel balance")


def _path_is_elementwise(g: Graph, src: fx.Node, dst: fx.Node) -> bool:
    """Whether ``dst`` has ``src``'s shape and each of its entries depends on the same entry of ``src`` only, through
    activations of the spec's GELU / SiLU row (a norm between: the norm finders' reasons)."""
    z, y = g.env.get(src), g.env.get(dst)
    if not (isinstance(z, torch.Tensor) and isinstance(y, torch.Tensor)) or z.shape != y.shape:
        return False
    between = (g.ancestors([dst]) & g.descendants([src])) - {src}
    ops = {g.op(m) for m in between if g.op(m) not in CASTS}
    if not ops or not ops <= NO_LAW:
        return False
    z2 = z.detach().clone().contiguous()
    z2.view(-1)[0] += 0.37
    try:
        d = (g.run({src: with_strides_of(z, z2)}, [dst])[0] - y).reshape(-1)
    except Exception:  # noqa: BLE001
        return False
    return bool(d[0] != 0) and not bool(d[1:].abs().max() > 0)


def channel_norms(g: Graph) -> list[tuple[fx.Node, str, str | None, int]]:
    """``(node, gain, bias, channels)`` of every affine BatchNorm / GroupNorm / InstanceNorm module applied to a
    channel-first value (>= 3 dims: dim 1 holds the channels its gain scales)."""
    out = []
    for n in g.nodes:
        if n.op != "call_module":
            moved = _channels_last_norm(g, n)
            if moved is not None:
                out.append(moved)
            continue
        m = g.gm.get_submodule(n.target)
        v = g.env.get(n)
        if isinstance(m, _NORMS) and isinstance(getattr(m, "weight", None), nn.Parameter) and \
                isinstance(v, torch.Tensor) and v.dim() >= 3:
            b = f"{n.target}.bias" if isinstance(getattr(m, "bias", None), nn.Parameter) else None
            out.append((n, f"{n.target}.weight", b, m.weight.shape[0]))
    return out


def _channels_last_norm(g: Graph, n: fx.Node):
    """``(permute node, gain, bias, channels)`` for a channels-last ``layer_norm`` over the last dim whose only
    reader permutes that dim back to dim 1 (timm's ``LayerNorm2d``: ``layer_norm(x.permute(0, 2, 3, 1)).permute(0,
    3, 1, 2)``), else None."""
    if g.op(n) != "permute" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    ln = n.args[0]
    if g.op(ln) != "layer_norm" or len(ln.users) != 1:
        return None
    args = list(ln.args)
    w = g.param_of(args[2]) if len(args) > 2 else g.param_of(ln.kwargs.get("weight"))
    b = g.param_of(args[3]) if len(args) > 3 else g.param_of(ln.kwargs.get("bias"))
    dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
    z, v = g.env.get(ln), g.env.get(n)
    if w is None or g.params[w].dim() != 1 or not isinstance(z, torch.Tensor) or not isinstance(v, torch.Tensor) \
            or z.dim() < 3 or len(dims) != z.dim() or dims[1] % z.dim() != z.dim() - 1:
        return None
    return n, w, b, g.params[w].shape[0]


def channel_gains(f: Found) -> None:
    """The channel-gain finder (module docstring)."""
    g, c = f.g, f.c
    for n, w, b, ch in channel_norms(g):
        path, what = w.rsplit(".", 1)[0], "channels-last LayerNorm" if g.op(n) == "permute" else _kind(g, n)
        _before_norm(f, n, path, what)
        readers, bad = [], []

        def visit(m, u, readers=readers, bad=bad):
            rd = _reader_map(g, u)
            if rd is not None and rd[0] is m:
                readers.append(rd)
            elif g.op(u) == "output" or u in g.convs or g.lin_at(u) is not None:
                bad.append(u)
            elif g.op(u) not in SHAPE_ONLY:
                return True
            return False

        g.walk_users([n], visit)
        kinds = [per_channel(g, n, x, ch) for x, _ in readers]
        if bad or not readers or any(k is None or cm.in_channels != ch * k[1] for k, (_, cm) in zip(kinds, readers)):
            seen_ = ", ".join(dict.fromkeys(repr(cm.weight) for _, cm in readers)) or "no convolution"
            others = ", ".join(dict.fromkeys(repr(_kind(g, u)) for u in bad))
            c.decline(path, f"{what} gain", f"its output channels are read by {seen_}"
                      + (f" and by {others}" if others else "")
                      + (" (not channel by channel, positively homogeneous)" if None in kinds else "")
                      + ": a gain law needs every reader to be a map reading the channels through positively "
                      'homogeneous per-channel ops: no gain law (docs/laws.md, "Norm gains")')
            continue
        f.add(builders.channel_gain_law(f"{path}/gain", layer_index(path), w, (ch,),
                                        [(cm, k[1]) for (_, cm), k in zip(readers, kinds)], bias=b,
                                        note=f"structural: {what} read by "
                                             + ", ".join(dict.fromkeys(cm.weight for _, cm in readers))
                                             + ' (docs/laws.md, "Norm gains")'), "channel gain")


def _before_norm(f: Found, n: fx.Node, path: str, what: str) -> None:
    """Decline the convolution whose channels only the norm ``n`` reads (``docs/laws.md``, "Conv before a norm")."""
    g = f.g
    w = _writer(g, n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if w is None or w not in g.convs or w in f.used or _other_reader(g, w, n) is not None:
        return
    f.used.add(w)
    f.c.decline(g.convs[w].module, f"{_kind(g, w)} before {what}",
                f"its output channels are normalised by {path!r}: the scale of each channel (group) is invariant only "
                "up to the norm's eps, with batch statistics in training mode and running statistics in eval mode "
                'for BatchNorm: no law claimed (docs/laws.md, "Conv before a norm")')


def channel_layer_scales(f: Found) -> None:
    """LayerScale on convolution channels: ``gamma.reshape(1, C, 1, ...) * conv(x)`` (ConvNeXt), the conv's output
    read by the product only: the diagonal-rescaling law of each output channel (``builders.channel_layer_scale_law``)."""
    g = f.g
    claimed = {p for law, _ in f.cands for p in law.params}
    for n in g.nodes:
        if g.op(n) != "mul" or len(n.args) != 2:
            continue
        for a, other in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            gamma = g.param_of(g.back_pass(a, CASTS | {"view", "reshape", "unsqueeze"})) if isinstance(a, fx.Node) \
                else None
            src = g.back_pass(other) if isinstance(other, fx.Node) else None
            if gamma is None or gamma in claimed or src not in g.convs or src in f.used or len(src.users) != 1:
                continue
            conv, gv, y = g.convs[src], g.params[gamma], g.env.get(src)
            av = g.env.get(a)
            if gv.dim() != 1 or not isinstance(y, torch.Tensor) or y.dim() < 3 or conv.cmap.out_channels != gv.shape[0] \
                    or not isinstance(av, torch.Tensor) or av.dim() != y.dim() or av.shape[1] != gv.shape[0] \
                    or av.numel() != gv.numel():
                continue
            path = gamma.rsplit(".", 1)[0] if "." in gamma else gamma
            label = path if gamma.rsplit(".", 1)[-1] in ("gamma", "weight", "scale") else gamma
            f.add(builders.channel_layer_scale_law(f"{label}/layer_scale", layer_index(path), gamma, conv.cmap,
                                                   note=f"structural: {gamma} scales the output channels of "
                                                        f"{conv.module} (diagonal rescaling)"), "LayerScale")
            f.used.add(src)
            claimed.add(gamma)
            break
