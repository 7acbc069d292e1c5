"""Detection core: the ``Detection`` result, the detector registry and ``detect``."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

from torch import nn

from ..laws import Declined, Law
from ..wrappers import unwrap  # noqa: F401  (re-exported: conserve.detection.unwrap)

# detector modules, imported lazily in this order (each calls @register at import)
_MODULES = ("conserve.detection.reference", "conserve.detection.hf", "conserve.detection.timm_models",
            "conserve.detection.torchnn", "conserve.detection.graph")
_DETECTORS: list[tuple[str, Callable]] = []
_loaded = False


@dataclass
class Detection:
    """What ``detect`` found.

    Attributes:
        laws: law instances (parameter names as in ``model.named_parameters()`` of the unwrapped model).
        declined: blocks with no law (or whose law does not apply), each with the reason.
        undetected: module paths of parameterised modules that no detector understood.
        detector: name of the detector that answered.
    """

    laws: list[Law] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    undetected: list[str] = field(default_factory=list)
    detector: str = ""

    def families(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for l in self.laws:
            out[l.family] = out.get(l.family, 0) + 1
        return out


def register(name: str):
    """Decorator: ``fn(model, config, **options) -> Detection | None``."""

    def deco(fn):
        _DETECTORS.append((name, fn))
        return fn

    return deco


def _load():
    global _loaded
    if not _loaded:
        for m in _MODULES:
            try:
                importlib.import_module(m)
            except ModuleNotFoundError as e:
                if not (e.name or "").startswith("conserve"):
                    raise
        _loaded = True


def _ordered() -> list[tuple[str, Callable]]:
    """Detectors in ``_MODULES`` order whatever order their modules were imported in (others last)."""
    rank = {m: i for i, m in enumerate(_MODULES)}
    return sorted(_DETECTORS, key=lambda d: rank.get(d[1].__module__, len(rank)))




def detect(model: nn.Module, config=None, *, structural: bool = False, **options) -> Detection:
    """Every law of ``model`` with the rows/columns it reads, the declined blocks and the unrecognised ones.

    The name/type-based detectors (reference models, HF transformers, timm, torch.nn modules) are the fast
    path; any model (or part of one) they do not explain goes to structural detection
    (``conserve.detection.graph.detect_graph``: the laws found from what the traced graph computes, each
    passing the spec's first-order check in float64, every other block declined with the reason). The laws the
    torch.nn detector reads from module types, and those of an HF / timm model holding user classes
    (``user_classes``: a subclass, a module put in place of a library block), pass the same check on the model's
    own forward (``_checked``; kept unchecked only when no probe can run: meta device, FSDP, no input).

    Args:
        model: an ``nn.Module`` (HF transformers, timm, torch.nn, plain torch code, conserve reference
            models); wrappers from torch.compile and DDP are removed; meta-device models work for the
            name-based detectors (shapes only).
        config: the model config if it is not ``model.config`` (HF).
        structural: True skips the name-based detectors and runs structural detection only.
        **options: detector options, e.g. ``rope_layout='half'|'interleaved'`` where the layout cannot be
            known from the model, ``loss='ce'`` (the translation law needs softmax cross-entropy),
            ``example_inputs=`` (structural detection: what ``forward`` takes, when it cannot be synthesised).

    Raises:
        conserve.errors.UnsupportedModelError: no detector recognises any block of the model.
        conserve.errors.UsageError: the model still has uninitialised lazy parameters (run a forward first).
    """
    _load()
    model = unwrap(model)
    config = config if config is not None else getattr(model, "config", None)
    from ..errors import UnsupportedModelError, UsageError

    from torch.nn.parameter import UninitializedParameter

    lazy = [n for n, p in model.named_parameters() if isinstance(p, UninitializedParameter)]
    if lazy:
        raise UsageError(f"{lazy[0]} (and {len(lazy) - 1} more) not initialised yet (a lazy module, e.g. nn.LazyLinear):"
                         " run one forward pass before detecting or tracking the model's laws")

    if structural:
        from .graph import detect_graph

        return detect_graph(model, **options)
    for name, fn in _ordered():
        if name == "torch.nn":  # the model itself is no HF/timm/reference model: is one inside it?
            nested = _nested(model, options)
            if nested is not None:
                return _nested_rest(model, *nested, options)
        found = fn(model, config, **options)
        if found is not None:
            found.detector = found.detector or name
            if name == "torch.nn":
                found.laws, more = _checked(model, found.laws, options)
                found.declined += more
                if found.undetected:
                    found = _with_structural(model, found, options)
            return found
    last = getattr(dict(_DETECTORS).get("graph"), "last", None)
    why = "; ".join(f"{d.module}: {d.reason}" for d in (last.declined if last else [])[:3])
    raise UnsupportedModelError(f"no detector recognises {type(model).__name__}"
                                + (f" (structural detection: {why})" if why else "")
                                + "; pass explicit laws (conserve.laws) to track it, or example_inputs= if forward "
                                "needs a particular input")


_NAMED = ("reference", "hf", "timm")  # the detectors that recognise a model by its type


def _prefixed(law: Law, prefix: str) -> Law:
    """``law`` with every parameter name (and the law's name) under the submodule path ``prefix``."""
    terms = [replace(t, ref=replace(t.ref, param=prefix + t.ref.param)) for t in law.terms]
    return replace(law, name=prefix + law.name, terms=terms)


def _nested(model: nn.Module, options: dict) -> tuple[Detection, tuple[str, ...]] | None:
    """The laws of the HF / timm / reference models held inside a container that none of them
    recognises (a LightningModule with ``self.model = AutoModelForCausalLM...``, a wrapper with its own
    head), parameter names as in the container's ``named_parameters()``, and the paths of those
    submodules; None when there is none.

    The outermost recognised submodules are detected as if on their own, so their laws assume that
    what the container does with them goes through their ``forward`` output (as for the model
    alone: a container that reads a causal LM's inner hidden states instead of its logits breaks its
    final-norm law; use the base model, ``AutoModel``, whose final norm is declined). The container's
    own torch.nn blocks are detected as by the torch.nn detector, the frozen / tied checks see every use
    of a parameter in the container, and its other parameterised modules are listed in ``undetected``
    (``detect`` then gives them to structural detection)."""
    named = [(n, fn) for n, fn in _ordered() if n in _NAMED]
    found: list[tuple[str, Detection]] = []
    for path, m in model.named_modules():
        if not path or any(path.startswith(p + ".") for p, _ in found):
            continue
        for name, fn in named:  # a wrapped submodule (torch.compile's _orig_mod) is reached under its own path
            d = fn(m, getattr(m, "config", None), **options)
            if d is not None:
                d.detector = d.detector or name
                found.append((path, d))
                break
    if not found:
        return None
    from .torchnn import walk  # (imported here: torchnn imports this module)

    inside = tuple(p for p, _ in found)
    c = Collector(model, options)
    inner_undetected = []
    for path, d in found:
        c.add(*[_prefixed(law, path + ".") for law in d.laws])
        c.declined += [replace(x, module=f"{path}.{x.module}" if x.module else path) for x in d.declined]
        inner_undetected += [f"{path}.{u}" for u in d.undetected]
    c.mark(*inside)
    n_inner = len(c.laws)
    walk(c, model, options.get("loss"), skip=inside)  # the container's own torch.nn blocks (a Sequential head)
    c.laws[n_inner:], more = _checked(model, c.laws[n_inner:], options)
    c.declined += more
    detector = "+".join(dict.fromkeys(d.detector for _, d in found))
    # finish on the container: frozen / tied checks see every use of a parameter, the container's own
    # parameterised modules are listed in ``undetected`` (``detect`` gives them to structural detection)
    out = c.finish(f"nested:{detector}")
    out.undetected = list(dict.fromkeys(inner_undetected + out.undetected))
    return out, inside


def _nested_rest(model: nn.Module, found: Detection, inside: tuple[str, ...], options: dict) -> Detection:
    """``found`` (``_nested``) with the container's own modules given to structural detection; what that
    pass says about the modules under the detected submodule paths ``inside`` is dropped (they were
    detected on their own)."""
    if not found.undetected:
        return found
    merged = _with_structural(model, found, options)
    mine = {id(x) for x in found.declined}
    merged.declined = [x for x in merged.declined
                       if id(x) in mine or not any(x.module == p or x.module.startswith(p + ".") for p in inside)]
    return merged


def user_classes(model: nn.Module, trusted: tuple[str, ...]) -> list[str]:
    """Module classes in ``model`` defined outside the packages ``trusted`` (module prefixes such as
    ``('transformers.', 'torch.')``): a user subclass of a library class (overriding ``forward`` or a helper such as
    timm's ``forward_head``, e.g. to soft-cap the logits), a user module put in place of one (an attention of one's
    own with the same projections), remote code. A library detector reads the library's code, which may not hold
    for them: their laws go through ``_checked``."""
    out = []
    for m in model.modules():
        cls = type(m)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.__module__.startswith(trusted) and name not in out:
            out.append(name)
    return out


def _checked(model: nn.Module, laws: list[Law], options: dict) -> tuple[list[Law], list[Declined]]:
    """The torch.nn detector's laws that pass the spec's first-order check on the model's own forward
    (``graph.check_on_probe``), and a decline with the violation for each that fails: a module type says what
    its ``forward`` computes, not that the model calls it (an ``nn.Sequential``'s layers called one by one with
    another map between them, a hidden layer also read elsewhere). When the probe cannot run (meta device, an
    input that cannot be synthesised) the laws are kept as the module types give them."""
    from ..analysis.verify import TOL
    from .graph import check_on_probe

    options = dict(options)
    why = options.pop("why", "the model does not use the block as its module's own forward does (e.g. an "
                             "nn.Sequential's layers called one by one with another map between them)")
    viol, _, traced = check_on_probe(model, laws, **options)
    if viol is None:
        return laws, []
    # untraced, the model's own float32 casts (HF's upcasts of norms, softmax, routers) bound the measure near
    # 1e-8; a law the forward breaks violates it by far more (1e-4 and above on every case seen)
    tol = TOL if traced else 1e-6
    kept, declined = [], []
    for law in laws:
        v = viol.get(law.name, 0.0)
        if v > tol:
            declined.append(Declined(law.name, f"{law.family} law (module type)",
                                     f"fails the first-order check on the model's forward in float64 (relative "
                                     f"violation {v:.2e} > {tol:g}): {why}: not claimed"))
        elif v < 0:
            declined.append(Declined(law.name, f"{law.family} law (module type)", "identically constant on this model "
                                     "(zero gradient): nothing to track"))
        else:
            kept.append(law)
    return kept, declined


def _with_structural(model: nn.Module, found: Detection, options: dict) -> Detection:
    """Structural detection for the modules a type-based detector left undetected, merged into ``found``."""
    from .graph import detect_graph

    left = set(found.undetected)
    skip = [k for k, _ in model.named_parameters() if (k.rsplit(".", 1)[0] if "." in k else k) not in left]
    g = detect_graph(model, skip_params=skip, **options)
    have = {(law.family, frozenset(law.params)) for law in found.laws}
    laws = found.laws + [law for law in g.laws if (law.family, frozenset(law.params)) not in have]
    declined = found.declined + g.declined
    return Detection(laws, declined, [m for m in g.undetected if m in left], f"{found.detector}+graph")


class Collector:
    """The one accumulator every detector uses: laws, declined blocks, what is accounted for, and the
    single frozen / tied / undetected filter (``finish``).

    Args:
        model: the unwrapped model (parameter names are ``model.named_parameters()`` names).
        options: the detector options given to ``detect`` (e.g. ``loss``, ``rope_layout``).
        config: the model config (HF), or None.

    ``seen`` holds module (or parameter) paths accounted for (a law or a decline covers everything under
    them); ``understood`` holds parameter names known to carry no law of their own (e.g. an output bias);
    ``rope_cache`` is scratch space for detectors (RoPE layouts probed per attention class).
    """

    def __init__(self, model: nn.Module, options: dict | None = None, *, config=None):
        self.model = model
        self.config = config
        self.options = dict(options or {})
        self.laws: list[Law] = []
        self.declined: list[Declined] = []
        self.seen: set[str] = set()
        self.understood: set[str] = set()
        self.rope_cache: dict = {}

    def covered(self, path: str) -> bool:
        """True when ``path`` (a module or parameter path) is under a path already accounted for."""
        if path in self.understood:
            return True
        parts = path.split(".") if path else []
        return "" in self.seen or any(".".join(parts[:k]) in self.seen for k in range(1, len(parts) + 1))

    def mark(self, *paths: str) -> None:
        self.seen.update(paths)

    def know(self, *names) -> None:
        """Parameters understood to carry no law of their own (e.g. an output bias); None is ignored."""
        self.understood.update(n for n in names if n)

    def decline(self, module: str, block: str, reason: str) -> None:
        """Record a block with no law and why; everything under ``module`` counts as accounted for."""
        self.declined.append(Declined(module, block, reason))
        self.seen.add(module)

    def add(self, *laws: Law) -> None:
        self.laws.extend(laws)

    def finish(self, detector: str = "") -> Detection:
        """The shared last step of every detector.

        * every law's refs are checked against the parameter shapes (``compile_laws``; ValueError naming
          the law otherwise), so a wrong row/column range fails here, never silently later;
        * laws reading a frozen (``requires_grad=False``) parameter move to ``declined``: frozen parameters
          do not follow the gradient flow, so the law is not conserved;
        * laws reading a parameter shared with another module (tied) move to ``declined``: the other use
          breaks the law's symmetry;
        * every parameter no law reads, that is not ``understood`` and not under a declined or marked
          path, is listed (its module path) in ``undetected``, in ``named_parameters`` order.
        """
        from ..laws import compile_laws

        # law names must be unique (values are reported by name): a second law of a name gets '#2', ...
        count: dict[str, int] = {}
        for i, law in enumerate(self.laws):
            count[law.name] = count.get(law.name, 0) + 1
            if count[law.name] > 1:
                self.laws[i] = replace(law, name=f"{law.name}#{count[law.name]}")
        every = dict(self.model.named_parameters(remove_duplicate=False))  # tied parameters under every name
        computed = [law for law in self.laws if any(p not in every for p in law.params)]
        for law in computed:  # e.g. weight_norm / parametrize: `weight` is computed from other parameters
            missing = [p for p in law.params if p not in every]
            self.declined.append(Declined(law.name, f"{law.family} law", f"reads {missing}, computed from other "
                                          "parameters (torch.nn.utils.parametrize, weight_norm, spectral_norm), not a "
                                          "parameter: the tracker reads parameters; remove the parametrization or track "
                                          "explicit laws of its parameters"))
        gone = {id(law) for law in computed}
        self.laws = [law for law in self.laws if id(law) not in gone]
        compile_laws(self.laws, {k: tuple(v.shape) for k, v in every.items()})
        params = every
        aliases: dict[int, list[str]] = {}
        for name, p in every.items():
            aliases.setdefault(id(p), []).append(name)
        kept = []
        for law in self.laws:
            frozen = [p for p in law.params if p in params and not params[p].requires_grad]
            tied = {p: [a for a in aliases[id(params[p])] if a != p] for p in law.params if p in params}
            tied = {p: a for p, a in tied.items() if a}
            if frozen:
                self.declined.append(Declined(law.name, f"{law.family} law", f"reads frozen parameter(s) {frozen} "
                                              "(requires_grad=False): they do not move with the gradient flow, so the "
                                              "law is not conserved; unfreeze them or track the trainable part with "
                                              "explicit laws"))
            elif tied:
                p, a = next(iter(tied.items()))
                self.declined.append(Declined(law.name, f"{law.family} law", f"{p!r} is shared with {a} (tied): the "
                                              "other use breaks the law's symmetry"))
            else:
                kept.append(law)
        covered = set(self.understood)
        for law in self.laws:
            covered.update(law.params)
        undetected: list[str] = []
        for name, _ in self.model.named_parameters():
            if name in covered or self.covered(name):
                continue
            owner = name.rsplit(".", 1)[0] if "." in name else name
            if owner not in undetected:
                undetected.append(owner)
        return Detection(kept, self.declined, undetected, detector)


def finish(model: nn.Module, laws: list[Law], declined: list[Declined], understood=(), detector: str = "") -> Detection:
    """``Collector.finish`` for detectors that gathered ``laws`` / ``declined`` themselves (the HF detector):
    declined module paths count as accounted for, ``understood`` parameters carry no law of their own."""
    c = Collector(model)
    c.laws, c.declined = list(laws), list(declined)
    c.know(*understood)
    c.mark(*(d.module for d in declined if d.module))
    return c.finish(detector)
