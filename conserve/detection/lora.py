"""LoRA / PEFT adapters (spec ``shared/spec/laws.md``, catalogue row "LoRA adapter").

An adapter adds ``s * B(A(dropout(x)))`` to a base layer's output (``A``: in -> r, ``B``: r -> out; ``s`` =
alpha / r, or alpha / sqrt(r) for rsLoRA). The output depends on A and B only through the product ``B A``, so
``B -> B G``, ``A -> G^-1 A`` (G in GL(r)) is a symmetry and the r x r matrix ``A A^T - B^T B`` is conserved by
gradient flow, whatever the base weight does (frozen or trained), the dropout, the scaling, DoRA's detached
magnitude, and the other adapters of the same layer (one law per adapter). Family ``deep_linear`` (the
deep-linear law of the two maps A, B with nothing between them), named ``<layer>/lora.<adapter>``.

Recognised (by structure, both PEFT and plain torch):

* PEFT ``LoraLayer``: ``lora_A`` / ``lora_B`` ``nn.ModuleDict`` of ``nn.Linear`` (or ``nn.ConvNd``: A is the conv
  r <- in, B a 1x1 conv out <- r) keyed by adapter name, ``lora_embedding_A`` / ``lora_embedding_B``
  ``nn.ParameterDict`` (``(r, num_embeddings)``, ``(dim, r)``); the base layer in ``base_layer``; the active
  adapters from ``active_adapters`` / ``disable_adapters`` / ``merged_adapters``; DoRA from ``use_dora`` /
  ``lora_magnitude_vector``. ``ModulesToSaveWrapper`` (PEFT ``modules_to_save``): the active trainable copy is
  the layer in the forward.
* plain torch: a module with ``lora_A``/``lora_B`` (``lora_a``/``lora_b`` as torchtune, ``lora_down``/``lora_up``)
  as ``nn.Linear`` modules or as 2-D parameters (``(r, in)`` / ``(out, r)`` as loralib and litgpt, or ``(in, r)`` /
  ``(r, out)``), the base weight in the module itself (loralib, torchtune) or in a child ``base_layer`` /
  ``linear`` / ``base`` / ``layer`` / ``conv`` / ``emb``.

The base model is detected by the other detectors on a *view* of the model in which every adapter layer is
replaced by its base layer (same parameters). Their laws read base weights as if no adapter were there: a law
that scales or mixes output rows of a wrapped weight is extended with the same rows of every active adapter's
``B`` (``W + s B A``: a left action on W's rows acts on B's rows), one that acts on input columns with the same
columns of ``A``; the base bias rows with ``lora_B``'s bias (PEFT ``lora_bias``). Such extended laws, and the laws
of adapters recognised by name outside PEFT, pass the first-order check on the model's own forward before they
are claimed. With the base frozen (the usual setting) the base laws are declined as reading frozen parameters and
the adapter laws are what is tracked (``conserve.track(optimizer_over_adapters, model)``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from torch import nn

from ..laws import Declined, DeepLinearGram, Law, Ref, cols, rows, vector
from . import builders
from .check import checked_laws
from .core import Collector, Detection, register
from .torchnn import layer_index

PAIRS = (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B"), ("lora_a", "lora_b"),
         ("lora_down", "lora_up"))
BASE_CHILDREN = ("base_layer", "linear", "base", "layer", "conv", "emb", "embedding", "orig", "original")
_depth = 0  # > 0 while the base view is being detected (its adapter layers are gone: no recursion)


@dataclass
class Adapter:
    """One adapter of a layer: ``A`` (in -> r) and ``B`` (r -> out) with the refs of its Gram law."""

    key: str
    a: str
    b: str
    r: int
    plus: list  # refs of A (r rows each): A A^T
    minus: list  # refs of B (r rows each): B^T B
    lin: tuple = (True, True)  # A stored (r, in), B stored (out, r) (nn.Linear convention) per side, else transposed
    b_bias: str | None = None
    a_bias: str | None = None
    active: bool = True
    why_inactive: str = ""
    error: str = ""  # not an adapter pair after all (shapes)
    params: tuple = ()

    def b_rows(self, start: int, n: int, step: int) -> Ref:
        """Output rows ``start, start+step, ...`` of B (r columns each)."""
        return Ref(self.b, (start, 0), 0, n, 1, self.r, step) if self.lin[1] else Ref(self.b, (0, start), 1, n, 0,
                                                                                       self.r, step)

    def a_cols(self, start: int, n: int, step: int) -> Ref:
        """Input columns ``start, start+step, ...`` of A, one row each (r entries)."""
        return Ref(self.a, (0, start), 1, n, 0, self.r, step) if self.lin[0] else Ref(self.a, (start, 0), 0, n, 1,
                                                                                       self.r, step)


@dataclass
class LoraLayer:
    """A module carrying adapters: ``base`` (the wrapped layer) under ``base_child`` ("" = the module holds the
    base weight itself, None = no base found), ``kind`` of the base ('linear' / 'conv' / 'embedding' / 'other'),
    ``t``: base weight stored (in, out) (GPT-2 Conv1D, PEFT ``fan_in_fan_out``)."""

    path: str
    module: nn.Module
    peft: bool
    adapters: list[Adapter]
    base: nn.Module | None = None
    base_child: str | None = None
    kind: str = "other"
    t: bool = False
    dora: list = field(default_factory=list)  # DoRA magnitude parameters


def _p(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _get(m: nn.Module, name: str):
    return m._modules.get(name) if name in m._modules else m._parameters.get(name)


def _base_of(m: nn.Module):
    """(base module, child name) of an adapter layer: ("", itself) when it holds its own 2-D ``weight``."""
    w = m._parameters.get("weight")
    if isinstance(w, nn.Parameter) and w.dim() >= 2:
        return m, ""
    for name in BASE_CHILDREN:
        child = m._modules.get(name)
        if child is not None and isinstance(child._parameters.get("weight"), nn.Parameter):
            return child, name
    return None, None


def _kind(base: nn.Module | None) -> tuple[str, bool]:
    if base is None:
        return "other", False
    if type(base).__name__ == "Conv1D" and hasattr(base, "nf"):
        return "linear", True
    if isinstance(base, nn.modules.conv._ConvNd):
        return "conv", False
    if isinstance(base, nn.Embedding):
        return "embedding", False
    w = base._parameters.get("weight")
    if isinstance(base, nn.Linear) or (w is not None and w.dim() == 2):
        return "linear", False
    return "other", False


def _module_pair(key: str, pa: str, A: nn.Module, pb: str, B: nn.Module) -> Adapter:
    maps = []
    for p, m in ((pa, A), (pb, B)):
        try:
            maps.append(builders.ChannelMap.of(p, m))
        except TypeError:
            return Adapter(key, f"{pa}.weight", f"{pb}.weight", 0, [], [], error=f"{type(m).__name__} is not a Linear "
                           "or convolution")
    ma, mb = maps
    r = ma.out_channels
    params = tuple(n for n in (ma.weight, ma.bias, mb.weight, mb.bias) if n)
    if mb.in_channels != r:
        return Adapter(key, ma.weight, mb.weight, r, [], [], error=f"A writes {r} features but B reads "
                       f"{mb.in_channels}: not one rank-r product", params=params)
    plus, minus = ma.out_pieces(), mb.in_pieces()
    if any(e != 0 or x.rows != r for e, x in plus + minus):
        return Adapter(key, ma.weight, mb.weight, r, [], [], error="grouped adapter convolutions split the rank: no "
                       "single GL(r) law", params=params)
    lin = (not ma.conv, not mb.conv)
    return Adapter(key, ma.weight, mb.weight, r, [x for _, x in plus], [x for _, x in minus], lin=lin,
                   b_bias=mb.bias, a_bias=ma.bias, params=params)


def _param_pair(key: str, pa: str, A, pb: str, B, base_shape) -> Adapter:
    """Two 2-D parameters: (r, in) / (out, r) (``x @ A.T @ B.T``) or (in, r) / (r, out) (``x @ A @ B``)."""
    if A.dim() != 2 or B.dim() != 2:
        return Adapter(key, pa, pb, 0, [], [], error=f"shapes {tuple(A.shape)}, {tuple(B.shape)} are not matrices",
                       params=(pa, pb))
    lin, tr = A.shape[0] == B.shape[1], A.shape[1] == B.shape[0]
    if lin and tr and base_shape is not None and len(base_shape) == 2:  # A (r, n), B (n, r): the base's dims decide
        lin = sorted((A.shape[1], B.shape[0])) == sorted(base_shape)  # in / out of x @ A.T @ B.T (else x @ A @ B)
        tr = not lin
    if lin:
        r = A.shape[0]
        return Adapter(key, pa, pb, r, [rows(pa, A.shape, 0, r)], [cols(pb, B.shape, 0, r)], params=(pa, pb))
    if tr:
        r = A.shape[1]
        return Adapter(key, pa, pb, r, [cols(pa, A.shape, 0, r)], [rows(pb, B.shape, 0, r)], lin=(False, False),
                       params=(pa, pb))
    return Adapter(key, pa, pb, 0, [], [], error=f"shapes {tuple(A.shape)} and {tuple(B.shape)} share no rank "
                   "dimension: not one rank-r product (e.g. a fused per-projection adapter)", params=(pa, pb))


def find_lora_layers(model: nn.Module) -> list[LoraLayer]:
    """Every module of ``model`` carrying LoRA adapters (see the module docstring), outermost first."""
    out = []
    for path, m in model.named_modules():
        if any(path.startswith(x.path + ".") for x in out if x.path) or (out and out[0].path == "" and path):
            continue
        peft = type(m).__module__.startswith("peft.")
        base, child = _base_of(m)
        kind, t = _kind(base)
        t = t or bool(getattr(m, "fan_in_fan_out", False))
        ads = []
        for an, bn in PAIRS:
            A, B = _get(m, an), _get(m, bn)
            if A is None or B is None:
                continue
            pa, pb = _p(path, an), _p(path, bn)
            if isinstance(A, nn.ModuleDict) and isinstance(B, nn.ModuleDict):
                ads += [_module_pair(k, f"{pa}.{k}", A[k], f"{pb}.{k}", B[k]) for k in A.keys() if k in B]
            elif isinstance(A, nn.ParameterDict) and isinstance(B, nn.ParameterDict):
                shape = tuple(base.weight.shape) if base is not None else None
                ads += [_param_pair(k, f"{pa}.{k}", A[k], f"{pb}.{k}", B[k], shape) for k in A.keys() if k in B]
            elif isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter):
                shape = tuple(base.weight.shape) if base is not None else None
                ads.append(_param_pair("", pa, A, pb, B, shape))
            elif isinstance(A, nn.Module) and isinstance(B, nn.Module) and not isinstance(A, (nn.ModuleDict,
                                                                                             nn.ParameterDict)):
                ads.append(_module_pair("", pa, A, pb, B))
        if not ads:
            continue
        layer = LoraLayer(path, m, peft, ads, base, child, kind, t)
        _activity(layer)
        out.append(layer)
    return out


def _activity(layer: LoraLayer) -> None:
    """Which adapters the layer's forward applies (PEFT: active, not disabled, not merged; plain: not merged)."""
    m = layer.module
    active = getattr(m, "active_adapters", None)
    active = [active] if isinstance(active, str) else (list(active) if active is not None else None)
    disabled = bool(getattr(m, "disable_adapters", False) or getattr(m, "disabled", False))
    merged = list(getattr(m, "merged_adapters", []) or [])
    use_dora = getattr(m, "use_dora", {}) or {}
    mags = m._modules.get("lora_magnitude_vector")
    for a in layer.adapters:
        if disabled:
            a.active, a.why_inactive = False, "the layer's adapters are disabled"
        elif a.key and active is not None and a.key not in active:
            a.active, a.why_inactive = False, f"not an active adapter (active: {active})"
        elif a.key in merged or (not a.key and getattr(m, "merged", False) is True):
            a.active, a.why_inactive = False, "merged into the base weight (the forward uses the base only)"
        dora = (isinstance(use_dora, dict) and use_dora.get(a.key)) or (mags is not None and a.key in mags)
        if dora and mags is not None and a.key in mags:
            layer.dora += [_p(layer.path, f"lora_magnitude_vector.{a.key}.{n}")
                           for n, _ in mags[a.key].named_parameters()]
    if isinstance(m._parameters.get("magnitude"), nn.Parameter):  # torchtune DoRALinear
        layer.dora.append(_p(layer.path, "magnitude"))


# --------------------------------------------------------------------------------------------- the view
def _shell(m: nn.Module, kind: str) -> nn.Module:
    """A plain nn.Linear / nn.Embedding holding ``m``'s own base weight and bias (the same Parameters)."""
    s = copy.copy(m)
    s.__class__ = nn.Embedding if kind == "embedding" else nn.Linear
    s._parameters = {k: m._parameters[k] for k in ("weight", "bias") if k in m._parameters}
    s._modules, s._buffers = {}, {}
    s._forward_hooks, s._forward_pre_hooks = type(m._forward_hooks)(), type(m._forward_pre_hooks)()
    w = s._parameters["weight"]
    if kind != "embedding":
        s.out_features, s.in_features = w.shape
    return s


def _modules_to_save(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """PEFT ``ModulesToSaveWrapper``s: (path, the active trainable copy, its key)."""
    out = []
    for path, m in model.named_modules():
        if type(m).__name__ == "ModulesToSaveWrapper" and isinstance(m._modules.get("modules_to_save"), nn.ModuleDict):
            act = getattr(m, "active_adapters", None) or [getattr(m, "active_adapter", None)]
            key = next((k for k in ([act] if isinstance(act, str) else act) if k in m.modules_to_save), None)
            if key is not None and not getattr(m, "disable_adapters", False):
                out.append((path, m.modules_to_save[key], key))
    return out


def base_view(model: nn.Module, layers: list[LoraLayer]) -> tuple[nn.Module, dict[str, str]]:
    """``model`` with every adapter layer replaced by its base layer (shallow copies along the paths, the same
    Parameters) and ``{view parameter name: model parameter name}`` for the names that differ."""
    copies: dict[int, nn.Module] = {}

    def own(m):
        if id(m) not in copies:
            c = copy.copy(m)
            c._modules = dict(m._modules)
            copies[id(m)] = c
        return copies[id(m)]

    root = own(model)
    rename: dict[str, str] = {}
    swaps = [(x.path, x.base if x.base_child else _shell(x.module, x.kind), x.base_child)
             for x in layers if x.base is not None and (x.base_child or x.kind in ("linear", "embedding"))]
    swaps += [(p, m, f"modules_to_save.{k}") for p, m, k in _modules_to_save(model)]
    for path, new, child in swaps:
        if child:
            for n, _ in new.named_parameters():
                rename[_p(path, n)] = _p(path, f"{child}.{n}")
        if not path:
            return new, rename  # the model itself is the adapter layer
        parent = root
        parts = path.split(".")
        for part in parts[:-1]:
            parent._modules[part] = own(parent._modules[part])
            parent = parent._modules[part]
        parent._modules[parts[-1]] = new
    return root, rename


# ---------------------------------------------------------------------------------------- extension
def _extend(law: Law, wrapped: dict) -> tuple[Law | None, bool, str]:
    """``law`` (base names already model names) with the active adapters' rows / columns added to every term
    on a wrapped base weight; ``(law, extended?, why not)``."""
    terms, touched = [], False
    for t in law.terms:
        terms.append(t)
        hit = wrapped.get(t.ref.param)
        if hit is None or t.kind == "sum":  # a row-sum (translation / router) law of W holds as it is
            continue
        layer, role, shape = hit
        act = [a for a in layer.adapters if a.active]
        if not act:
            continue
        touched = True
        if any(a.error for a in act):
            return None, True, f"{layer.path} carries an adapter that is not one rank-r product: base law not extended"
        if layer.dora:
            return None, True, (f"{layer.path} is a DoRA layer: its output rows are renormalised by ||W + s B A||, "
                                "so the base law's rescaling does not carry over")
        if layer.kind != "linear":
            return None, True, f"{layer.path}: adapters on a {type(layer.base).__name__} base: base laws not extended"
        ref = t.ref
        if role == "bias":
            terms += [replace(t, ref=replace(ref, param=a.b_bias)) for a in act if a.b_bias]
            continue
        o, i = (1, 0) if layer.t else (0, 1)
        if ref.row_dim == o and ref.col_dim == i and ref.start[i] == 0 and ref.cols == shape[i]:
            terms += [replace(t, ref=a.b_rows(ref.start[o], ref.rows, ref.row_step), shift=0.0) for a in act]
        elif ref.row_dim == i and ref.col_dim == o and ref.start[o] == 0 and ref.cols == shape[o]:
            terms += [replace(t, ref=a.a_cols(ref.start[i], ref.rows, ref.row_step), shift=0.0) for a in act]
        else:
            return None, True, f"reads part of the rows / columns of {t.ref.param}: not extended to its adapters"
    return replace(law, terms=terms), touched, ""


def _renamed(law: Law, rename: dict) -> Law:
    if not any(t.ref.param in rename for t in law.terms):
        return law
    return replace(law, terms=[replace(t, ref=replace(t.ref, param=rename.get(t.ref.param, t.ref.param)))
                               for t in law.terms])


def _renamed_text(text: str, rename: dict) -> str:
    """A decline reason of the base view with its parameter names as the model names them."""
    import re

    for k in sorted(rename, key=len, reverse=True):
        if k in text:
            text = re.sub(rf"(?<![\w.]){re.escape(k)}(?![\w.])", rename[k], text)
    return text


def _checked(model, laws, options, why):
    return checked_laws(model, laws, {**options, "why": why})


# ----------------------------------------------------------------------------------------- detector
@register("lora")
def detect_lora(model: nn.Module, config, **options) -> Detection | None:
    """Adapter laws of every LoRA layer and the base model's laws extended to its adapters (module docstring);
    None when the model has no adapter."""
    global _depth
    if _depth:
        return None
    layers = find_lora_layers(model)
    if not layers:
        return None
    from . import detect
    from ..errors import UnsupportedModelError

    view, rename = base_view(model, layers)
    _depth += 1
    try:
        base = detect(view, config, **options)
    except UnsupportedModelError as e:
        base = Detection([], [Declined("", "base model", f"no law of the base model: {e}")],
                         sorted({n.rsplit(".", 1)[0] if "." in n else "" for n, _ in view.named_parameters()}), "none")
    finally:
        _depth -= 1
    real = dict(model.named_parameters(remove_duplicate=False))
    wrapped = {}
    for x in layers:
        if x.base is None:
            continue
        pre = _p(x.path, x.base_child) if x.base_child else x.path
        for role in ("weight", "bias"):
            name = _p(pre, role)
            if name in real:
                wrapped[name] = (x, role, tuple(real[_p(pre, "weight")].shape))
    c = Collector(model, options, config=config)
    undetected = set(base.undetected)
    c.know(*(rename.get(n, n) for n, _ in view.named_parameters()
             if (n.rsplit(".", 1)[0] if "." in n else "") not in undetected))
    c.declined += [replace(d, reason=_renamed_text(d.reason, rename)) for d in base.declined]
    c.mark(*(d.module for d in base.declined if d.module and "/" not in d.module))
    to_check = []
    for law in base.laws:
        law = _renamed(law, rename)
        new, touched, why = _extend(law, wrapped)
        frozen = [p for p in law.params if p in real and not real[p].requires_grad]
        if new is None:
            if frozen:  # declined as frozen by finish, with that reason
                c.add(law)
            else:
                c.declined.append(Declined(law.name, f"{law.family} law of the base model", why + ": not claimed"))
        else:
            c.add(new)
            if touched and not frozen:
                to_check.append(new)
    for p, _, _ in _modules_to_save(model):
        c.decline(_p(p, "original_module"), "PEFT modules_to_save original", "the frozen original copy: the forward "
                  "uses the trainable copy in modules_to_save")
    plain = []
    for x in layers:
        c.know(*x.dora)
        for a in x.adapters:
            label = f"{x.path}/lora" + (f".{a.key}" if a.key else "")
            if a.error:
                c.declined.append(Declined(label, "LoRA adapter", a.error + ": no adapter law"))
                continue
            if not a.active:
                c.declined.append(Declined(label, "LoRA adapter", a.why_inactive + ": its parameters get no "
                                           "gradient, nothing to track"))
                c.know(*a.params)
                continue
            note = (f"LoRA adapter {a.key or ''} of {x.path}: A ({a.a}) r={a.r}, B ({a.b}); GL(r): B -> B G, "
                    "A -> G^-1 A" + ("; DoRA magnitude not in the law" if x.dora else ""))
            plus = a.plus + ([vector(a.a_bias, 0, a.r)] if a.a_bias else [])  # a bias on A: A -> G^-1 A acts on it
            law = DeepLinearGram.build(label, _layer(x.path), plus=plus, minus=a.minus, note=note)
            c.add(law)
            c.know(a.b_bias)  # B's bias (PEFT lora_bias) is in no adapter law: the GL(r) action leaves it alone
            if not x.peft:
                plain.append(law)
    if to_check or plain:
        names = {law.name for law in to_check + plain}
        kept, more = _checked(model, to_check + plain, options, "the adapter / base law read by module names does "
                              "not hold on the model's own forward")
        ok = {law.name for law in kept}
        c.laws = [law for law in c.laws if law.name not in names or law.name in ok]
        c.declined += more
    out = c.finish(f"lora+{base.detector}")
    if getattr(base, "loss", None) is not None:  # the loss the base detection was told (translation laws)
        out.loss = base.loss
    return out


def _layer(path: str) -> int | None:
    return layer_index(path)
