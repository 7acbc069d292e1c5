"""The shared base of detection: the ``Detection`` result, the detector registry and the ``Collector``.

Every detector module imports this one; it imports nothing of the detection package. ``detect`` (the
orchestration that runs the detectors in order) is in ``dispatch``.

* ``Detection``: laws, declined blocks (with the reason), undetected module paths, the detector that answered.
* ``register(name)``: the decorator a detector module puts on its ``fn(model, config, **options) -> Detection |
  None``; ``load_detectors()`` imports the modules of ``DETECTOR_MODULES`` (each registers at import) and
  ``detectors()`` lists them in that order.
* ``Collector``: the one accumulator every detector uses, with the single frozen / tied / undetected filter
  (``finish``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

from torch import nn

from ..laws import Declined, Law, compile_laws
from ..wrappers import unwrap  # noqa: F401  (re-exported: conserve.detection.unwrap)

# detector modules, imported by ``load_detectors`` in this order (each calls @register at import)
_MODULES = ("conserve.detection.lora", "conserve.detection.reference", "conserve.detection.hf", "conserve.detection.timm_models",
            "conserve.detection.large", "conserve.detection.torchnn", "conserve.detection.graph")
DETECTOR_MODULES = _MODULES
_DETECTORS: list[tuple[str, Callable]] = []
_loaded = False

__all__ = ["Collector", "DETECTOR_MODULES", "Detection", "detectors", "finish", "load_detectors", "prefixed",
           "register", "unwrap", "user_classes"]


@dataclass
class Detection:
    """What ``detect`` found.

    Attributes:
        laws: law instances (parameter names as in ``model.named_parameters()`` of the unwrapped model).
        declined: blocks with no law (or whose law does not apply), each with the reason.
        undetected: module paths of parameterised modules that no detector understood.
        detector: name of the detector that answered.
        loss: the training loss named to ``detect`` (``loss="ce"``); None: not named, so a translation law in
            ``laws`` (HF and timm detection add it) assumes softmax cross-entropy.
        notes: how the detection ran where it took another path than one probe of the whole model (block by
            block on a meta-device or large model, a reduced vocabulary, the time it took).
        input_readers: ``Collector.input_readers`` of the structural detection that answered (blocks analysed on
            their own): what reads each positional input of a block, for a gain law of the caller's graph.
    """

    laws: list[Law] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    undetected: list[str] = field(default_factory=list)
    detector: str = ""
    loss: str | None = None
    notes: list[str] = field(default_factory=list)
    input_readers: dict = field(default_factory=dict)

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


def load_detectors() -> None:
    """Import every module of ``DETECTOR_MODULES`` once (a missing optional dependency skips its module)."""
    global _loaded
    if not _loaded:
        for m in _MODULES:
            try:
                importlib.import_module(m)
            except ModuleNotFoundError as e:
                if not (e.name or "").startswith("conserve"):
                    raise
        _loaded = True


_load = load_detectors  # the bench's name for it


def detectors() -> list[tuple[str, Callable]]:
    """``(name, fn)`` of the registered detectors in ``DETECTOR_MODULES`` order, whatever order their modules were
    imported in (others last)."""
    rank = {m: i for i, m in enumerate(_MODULES)}
    return sorted(_DETECTORS, key=lambda d: rank.get(d[1].__module__, len(rank)))


def prefixed(law: Law, prefix: str) -> Law:
    """``law`` with every parameter name (and the law's name) under the submodule path ``prefix``."""
    terms = [replace(t, ref=replace(t.ref, param=prefix + t.ref.param)) for t in law.terms]
    return replace(law, name=prefix + law.name, terms=terms)


_prefixed = prefixed  # the name ``blocks`` imports


def user_classes(model: nn.Module, trusted: tuple[str, ...]) -> list[str]:
    """Module classes in ``model`` defined outside the packages ``trusted`` (module prefixes such as
    ``('transformers.', 'torch.')``): a user subclass of a library class (overriding ``forward`` or a helper such as
    timm's ``forward_head``, e.g. to soft-cap the logits), a user module put in place of one (an attention of one's
    own with the same projections), remote code. A library detector reads the library's code, which may not hold
    for them: their laws go through ``check.checked_laws``."""
    out = []
    for m in model.modules():
        cls = type(m)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.__module__.startswith(trusted) and name not in out:
            out.append(name)
    return out


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
    ``input_readers`` maps ``(block path, position)`` (``""``: the module detected itself, when it was analysed
    as a block alone) to the input-column refs of the linear maps that read that positional input of the block,
    each of its features one to one, and nothing else (``match.gain.input_readers``), or to a sentence saying what
    else reads it or why they are not known (``match.gain.Unknown``): the gain finder takes an opaque block's call
    as those linear maps.
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
        self.input_readers: dict = {}

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
        return Detection(kept, self.declined, undetected, detector, input_readers=dict(self.input_readers))


def finish(model: nn.Module, laws: list[Law], declined: list[Declined], understood=(), detector: str = "") -> Detection:
    """``Collector.finish`` for detectors that gathered ``laws`` / ``declined`` themselves (the HF detector):
    declined module paths count as accounted for, ``understood`` parameters carry no law of their own."""
    c = Collector(model)
    c.laws, c.declined = list(laws), list(declined)
    c.know(*understood)
    c.mark(*(d.module for d in declined if d.module))
    return c.finish(detector)
