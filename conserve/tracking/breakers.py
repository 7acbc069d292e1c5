"""Optimizer configurations that break a law, and the decay factor of an optimizer's update rule.

A law ``h(theta)`` is conserved by gradient flow because its parameters move with the SAME step size
along the gradient (spec "Breakers"). The tracker therefore compares every law's parameters with the
optimizer's ``param_groups`` and marks the law ``broken_by`` (it is still tracked) when

* its parameters sit in groups with different ``lr`` ("different lr in one law: up_proj.weight 0.2,
  down_proj.weight 0.1"): ``dh/dt = -2 lr_1 <W_1, g_1> + 2 lr_2 <W_2, g_2> != 0``;
* weight decay differs inside the law ("weight decay on only part of one law: ..."): the decay
  term of the drift identity is then not a common rescaling of the law;
* some of its parameters are not held by the optimizer ("not held by the optimizer: ..."): they do
  not move, the others do;
* ``momentum`` (heavy ball scales the effective step by ``1 / (1 - momentum)``), ``dampening`` under
  momentum (it scales the step by ``1 - dampening``), ``maximize`` or ASGD's ``lambd`` (its decay) or
  ``alpha`` (its step-size schedule) differ, or Adam's ``decoupled_weight_decay`` under a weight decay
  (part of the law decayed by ``1 - lr wd``, the rest by L2 inside the adaptive step).

``decay_factor(optimizer, group)`` is ``a`` in ``theta_{k+1} = a theta_k + Delta`` (spec "Discrete
steps"), read from the group's hyper-parameters and the update rule of the optimizer's class found by
``isinstance`` after removing wrappers (conserve's ``TrackedOptimizer``, HF accelerate's
``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``), so subclasses and
wrapped optimizers get their decay, never a class-name match.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
from torch.optim.optimizer import _get_scalar_dtype

from ..errors import warn


@dataclass
class BreakerState:
    """What the breaker checks keep per tracker (``Tracker.breakers``): the optimizer whose groups are
    watched and its pre-step hook, the (law, reason) pairs warned, the laws the optimizer's groups break,
    the tracked tensors it did not hold, those seen frozen, and the laws marked broken by freezing
    (``check_frozen``) or by the caller (``mark_broken``)."""

    watch: object = None
    hook: object = None
    warned: set = field(default_factory=set)
    optimizer_broken: dict = field(default_factory=dict)
    held_seen: tuple | None = None
    frozen_seen: tuple = ()
    frozen_broken: dict = field(default_factory=dict)
    marked_broken: dict = field(default_factory=dict)

# (module, class, attribute holding the wrapped optimizer); checked only when the module is imported
_WRAPPERS = (("conserve.optim.wrapper", "TrackedOptimizer", "optimizer"),
             ("accelerate.optimizer", "AcceleratedOptimizer", "optimizer"),
             ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),
             ("pytorch_lightning.core.optimizer", "LightningOptimizer", "_optimizer"))


class BrokenLawWarning(UserWarning):
    """A law whose parameters the optimizer treats differently (tracked anyway, marked ``broken_by``)."""


def unwrap_optimizer(optimizer, *, frameworks_only: bool = False):
    """The innermost optimizer under conserve / accelerate / Lightning wrappers (by ``isinstance``);
    ``frameworks_only``: strip only the frameworks' pass-through wrappers (accelerate, Lightning) and
    stop at a ``TrackedOptimizer``. Optimizers that change the update (Lookahead, ZeRO) are returned as
    they are."""
    wrappers = _WRAPPERS[1:] if frameworks_only else _WRAPPERS
    for _ in range(16):
        for mod, cls, attr in wrappers:
            c = getattr(sys.modules.get(mod), cls, None)
            if c is not None and isinstance(optimizer, c) and getattr(optimizer, attr, None) is not None:
                optimizer = getattr(optimizer, attr)
                break
        else:
            return optimizer
    return optimizer


# timm optimizers that multiply the weights by ``1 - s * weight_decay`` before their step, ``s`` = lr (or
# lr^2 / max_lr_snapshot with ``corrected_weight_decay``); checked only when their module is imported
_TIMM_DECOUPLED = (("timm.optim.adamw", "AdamWLegacy"), ("timm.optim.nadamw", "NAdamW"), ("timm.optim.sgdw", "SGDW"),
                   ("timm.optim.lion", "Lion"))


def _timm_decoupled(opt) -> bool:
    return any(isinstance(opt, c) for c in (getattr(sys.modules.get(m), n, None) for m, n in _TIMM_DECOUPLED)
               if isinstance(c, type))


def _decoupled(opt, group: Mapping) -> bool:
    """True when the update rule multiplies the weights by ``1 - lr * weight_decay`` before the step."""
    O = torch.optim
    if isinstance(opt, (O.AdamW, *(getattr(O, n) for n in ("Adafactor", "Muon") if hasattr(O, n)))):
        return True
    if isinstance(opt, (O.Adam, O.NAdam, O.RAdam)):
        return bool(group.get("decoupled_weight_decay", False))
    if any(c.__name__ == "Adafactor" and c.__module__.startswith("transformers.") for c in type(opt).__mro__):
        # ``p -= lr wd p`` then the update, with lr = the group's own only without relative_step and
        # scale_parameter (as the HF Trainer's optim="adafactor" builds it); else lr is per-step/parameter
        return not group.get("relative_step") and not group.get("scale_parameter")
    return False


def decay_factor(optimizer, group: Mapping, param: torch.Tensor | None = None) -> float | torch.Tensor:
    """``a`` in ``theta_{k+1} = a theta_k + Delta`` for the parameters of ``group`` (``param``: for the
    optimizers whose factor is per parameter, ``per_param_decay``; read before the step).

    * decoupled weight decay (``AdamW`` and subclasses; ``Adam``/``NAdam``/``RAdam`` and conserve's
      ``FusedAdam`` with ``decoupled_weight_decay=True``): ``1 - lr * weight_decay``;
    * an optimizer with a ``decay_factor(group)`` method (conserve's fused optimizers): what it returns;
    * ``SGD`` (and conserve's ``FusedSGD``) without momentum: the L2 term gives exactly
      ``(1 - lr wd) theta - lr g``, so ``1 - lr * weight_decay``;
    * ``ASGD``: its step is ``(1 - eta lambd) theta - eta (g + wd theta)`` with ``eta`` the parameter's
      state (``lr`` before its first step), so ``1 - eta * (lambd + weight_decay)``;
    * torch's ``Adafactor`` and ``Muon``: ``1 - lr * weight_decay`` (Muon: the group lr, not its adjusted
      one); transformers' ``Adafactor`` with ``relative_step=False, scale_parameter=False`` (the HF
      Trainer's ``optim="adafactor"``): ``1 - lr * weight_decay``; timm's ``AdamWLegacy``, ``NAdamW``, ``SGDW`` (with or without momentum) and ``Lion``:
      ``1 - s * weight_decay``, ``s = lr`` (``lr^2 / max_lr`` with ``corrected_weight_decay``);
    * anything else (momentum, coupled L2 in Adam, unknown rules): 1, the decay is inside ``Delta``.

    ``optimizer`` may be wrapped (see ``unwrap_optimizer``); ``lr`` may be a tensor (then so is ``a``)."""
    opt = unwrap_optimizer(optimizer)
    wd = group.get("weight_decay", 0.0) or 0.0
    lr = group.get("lr", 0.0)
    if isinstance(opt, torch.optim.ASGD):
        eta = opt.state.get(param, {}).get("eta") if param is not None else None
        rate = (group.get("lambd", 0.0) or 0.0) + wd
        if eta is None:  # before its first step: the state ASGD will make from lr (a float32 scalar by default)
            eta = torch.tensor(_num(lr), dtype=_get_scalar_dtype(), device="cpu")
        eta = eta.double() if torch.is_tensor(eta) else eta  # torch reads the float32 state as a double
        return 1.0 - eta * rate if rate else 1.0
    own = getattr(opt, "decay_factor", None)
    if callable(own):  # an optimizer that states its own factor (conserve's fused optimizers)
        return own(group)
    if wd and _timm_decoupled(opt):
        return 1.0 - (lr ** 2 / group["max_lr_snapshot"] if group.get("corrected_weight_decay") else lr) * wd
    sgd = isinstance(opt, torch.optim.SGD) and not group.get("momentum", 0.0)
    if not wd or not (sgd or _decoupled(opt, group)):
        return 1.0
    if torch.is_tensor(lr) and (sgd or (group.get("fused") and all(p.dtype == torch.float64 for p in group["params"]))):
        # these step with the lr as a double (SGD: ``add_(grad, alpha=-lr)``; torch's fused kernels on float64
        # weights), while torch's other decoupled rules multiply by ``1 - lr * wd`` formed in the tensor's
        # dtype, as here
        lr = lr.double()
    return 1.0 - lr * wd


def per_param_decay(optimizer) -> bool:
    """True when ``decay_factor`` depends on the parameter (``ASGD``: its ``eta`` is per-parameter state)."""
    return isinstance(unwrap_optimizer(optimizer), torch.optim.ASGD)


def _num(x) -> float:
    return float(x.detach().reshape(()).item()) if torch.is_tensor(x) else float(x)


def _labels(names: list[str]) -> list[str]:
    """Shortest distinct suffixes (``model.layers.0.mlp.up_proj.weight`` -> ``up_proj.weight``)."""
    parts = [n.split(".") for n in names]
    for k in range(1, max(len(p) for p in parts) + 1):
        lab = [".".join(p[-k:]) for p in parts]
        if len(set(lab)) == len(lab):
            return lab
    return names


def _describe(names: list[str], vals: list[float]) -> str:
    return ", ".join(f"{lab} {v:g}" for lab, v in zip(_labels(names), vals))


# group keys that must agree inside a law: the step size, the decay, the momentum (heavy ball scales the
# effective step by 1 / (1 - momentum)) and the sign of the step (``maximize``)
_COMPARED = (("lr", "different lr in one law"), ("weight_decay", "weight decay on only part of one law"),
             ("momentum", "different momentum in one law"), ("maximize", "maximize on only part of one law"),
             ("dampening", "different dampening in one law"), ("lambd", "different ASGD decay (lambd) in one law"),
             ("alpha", "different ASGD step-size power (alpha) in one law"),
             ("decoupled_weight_decay", "decoupled weight decay on only part of one law"))
# keys that matter only with another one: dampening scales the step under momentum only; ASGD's eta =
# lr / (1 + lambd lr t)^alpha depends on alpha only when lambd != 0 (other optimizers' alpha, RMSprop's
# smoothing constant, has no lambd beside it: not compared)
_ONLY_WITH = {"dampening": "momentum", "alpha": "lambd"}
# keys compared among the groups that have the other one only: Adam's decoupled_weight_decay (theta scaled
# by 1 - lr wd, or wd theta added to the gradient) says nothing in a group without weight decay
_AMONG = {"decoupled_weight_decay": "weight_decay"}


def law_breakers(laws, named: Mapping[str, torch.Tensor], optimizer) -> dict[str, str]:
    """``{law name: reason}`` for every law that ``optimizer``'s ``param_groups`` break (module docstring).

    ``named``: parameter name -> tensor (the names the laws use). Parameters are matched to groups by
    identity. A law none of whose parameters the optimizer holds is reported too (it cannot move)."""
    opt = unwrap_optimizer(optimizer)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    out: dict[str, str] = {}
    for law in laws:
        ps = [p for p in law.params if p in named]
        groups = [group_of.get(id(named[p])) for p in ps]
        missing = [p for p, g in zip(ps, groups) if g is None]
        if missing:
            out[law.name] = ("none of its parameters is held by the optimizer (nothing moves it)"
                             if len(missing) == len(ps) else
                             f"not held by the optimizer: {', '.join(_labels(ps)[ps.index(m)] for m in missing)} "
                             "(they do not move while the rest of the law does)")
            continue
        reasons = []
        for key, what in _COMPARED:
            if not any(key in g for g in groups):
                continue
            need = _ONLY_WITH.get(key)
            vals = [_num(g.get(key, 0.0) or 0.0) if need is None or g.get(need) else 0.0 for g in groups]
            among = [v for v, g in zip(vals, groups) if key not in _AMONG or _num(g.get(_AMONG[key], 0.0) or 0.0)]
            if len({float(np.float32(v)) for v in among}) > 1:  # at fp32 resolution: lr=tensor(0.01) is lr=0.01
                reasons.append(f"{what}: {_describe(ps, vals)}")
        if reasons:
            out[law.name] = "; ".join(reasons)
    return out


class BrokenMonitor:
    """Tracker monitor: ``broken/<family>`` = number of that family's laws marked ``broken_by``."""

    def __init__(self, tracker):
        self.tracker = tracker

    def update(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        fam = {l.name: l.family for l in self.tracker.laws}
        out = {f"broken/{f}": 0.0 for f in sorted(set(fam.values()))}
        for name in self.tracker.broken_by:
            out[f"broken/{fam[name]}"] += 1.0
        return out


def _signature(opt) -> tuple:
    """Which groups agree on each compared key (at fp32 resolution, as ``law_breakers`` compares), and their
    sizes: a law's breakers can only change when this does (a scheduler scaling every group alike leaves it
    unchanged). Tensor values on the CPU are read; off the CPU (capturable lr) and while torch.compile traces
    they count by identity, so reading them never syncs the device nor breaks a graph, and beside plain
    numbers the numbers' values count (a change of one of them re-checks)."""
    out, tracing = [], torch.compiler.is_compiling()  # (traced: by identity too, no graph break on a read)
    for key, _ in _COMPARED:
        if not any(key in g for g in opt.param_groups):  # (law_breakers skips it too)
            out.append(None)
            continue
        vals = [g.get(key, 0.0) for g in opt.param_groups]
        if tracing:
            vals = [id(v) if torch.is_tensor(v) else float(v or 0.0) for v in vals]
        else:
            vals = [("tensor", id(v)) if torch.is_tensor(v) and v.device.type != "cpu"
                    else float(np.float32(_num(v or 0.0))) for v in vals]
        if len({type(v) for v in vals}) > 1:
            out.append(tuple(vals))
            continue
        first = {}
        out.append(tuple(first.setdefault(v, len(first)) for v in vals))
    out.append(tuple(len(g["params"]) for g in opt.param_groups))
    return tuple(out)


class _Watch:
    """The step pre-hook of ``_watch`` (a class, not a closure: ``copy.deepcopy`` of an optimizer that holds
    it gives the copy's tracker, and the optimizer pickles)."""

    def __init__(self, tracker, sig: tuple):
        self.tracker, self.sig = tracker, sig

    def __call__(self, o, args, kwargs) -> None:
        if getattr(self.tracker, "_closed", False):  # a closed tracker books nothing more: nothing to re-check
            return
        sig = _signature(o)
        if sig != self.sig:
            self.sig = sig
            check_optimizer(self.tracker, o, _watching=True)


def _watch(tracker, optimizer) -> None:
    """Re-check before every step of the innermost optimizer when its groups stop agreeing the way they
    did (e.g. a LambdaLR with one lambda per group), via ``register_step_pre_hook``: O(groups) per step.
    Registered once per (tracker, optimizer); again on a copy whose hooks were not copied (torch
    optimizers' ``__getstate__`` keeps no hook)."""
    opt = unwrap_optimizer(optimizer)
    if not hasattr(opt, "register_step_pre_hook"):
        return
    hooks = getattr(opt, "_optimizer_step_pre_hooks", None) or {}
    if any(isinstance(h, _Watch) and h.tracker is tracker for h in hooks.values()):
        return
    tracker.breakers.watch = opt
    tracker.breakers.hook = opt.register_step_pre_hook(_Watch(tracker, _signature(opt)))


def unwatch(tracker, optimizer) -> None:
    """Take off the group watch ``_watch`` registered for ``tracker`` on ``optimizer`` (none: nothing)."""
    opt = unwrap_optimizer(optimizer)
    st = tracker.breakers
    if st.watch is opt:
        st.hook.remove()
        st.watch = st.hook = None


def check_optimizer(tracker, optimizer, *, _watching: bool = False) -> dict[str, str]:
    """Set ``tracker.broken_by`` from ``optimizer`` (at construction and after ``add_param_group``, and
    before any step at which the groups' lr / weight_decay / momentum / maximize stop agreeing as they
    did); warn once per (law, reason) (``BrokenLawWarning``, one warning per call listing the new ones); add
    the ``broken/<family>`` metrics (``BrokenMonitor``) the first time a law is broken. Returns the dict."""
    if not _watching:
        _watch(tracker, optimizer)
    named = dict(zip(tracker.compiled.names, tracker.params))
    found = law_breakers(tracker.laws, named, optimizer)
    st = tracker.breakers
    new = [(n, r) for n, r in found.items() if (n, r) not in st.warned]
    st.optimizer_broken = found
    tracker.broken_by = _with_marks(tracker, found)
    st.held_seen = _not_held(tracker, optimizer)
    if new:
        st.warned.update(new)
        shown = "; ".join(f"{n}: {r}" for n, r in new[:3]) + (f"; ... ({len(new) - 3} more)" if len(new) > 3 else "")
        warn(f"conserve: {len(new)} law(s) broken by the optimizer's param_groups (still tracked, marked "
                      f"broken_by; put each law's parameters in one group to conserve it): {shown}",
                      BrokenLawWarning)
        _monitor(tracker)
    return found


def _monitor(tracker) -> None:
    if not any(isinstance(m, BrokenMonitor) for m in tracker.monitors):
        tracker.monitors.append(BrokenMonitor(tracker))


def _with_marks(tracker, found: dict[str, str]) -> dict[str, str]:
    """``found`` (the optimizer's breakers) with the laws ``check_frozen`` and ``mark_broken`` marked,
    reasons joined."""
    out = dict(found)
    for store in (tracker.breakers.frozen_broken, tracker.breakers.marked_broken):
        for n, r in store.items():
            out[n] = f"{out[n]}; {r}" if n in out else r
    return out


def mark_broken(tracker, reason: str, laws=None) -> None:
    """Mark ``laws`` (law names; default every tracked law) ``broken_by`` for ``reason``, something
    outside the optimizer's ``param_groups`` that breaks them (a framework's gradient clipping by value,
    say): still tracked, counted in ``broken/<family>``, kept through later ``check_optimizer`` calls;
    one ``BrokenLawWarning`` per new reason."""
    names = [l.name for l in tracker.laws] if laws is None else list(laws)
    marks = tracker.breakers.marked_broken
    new = [n for n in names if marks.get(n) != reason]
    if not new:
        return
    for n in new:
        marks[n] = reason
    tracker.broken_by = _with_marks(tracker, tracker.breakers.optimizer_broken)
    _monitor(tracker)
    warn(f"conserve: {len(new)} law(s) broken by {reason} (still tracked, marked broken_by)",
                  BrokenLawWarning)


def _not_held(tracker, optimizer) -> tuple[int, ...]:
    """Indices of the tracked tensors ``optimizer``'s ``param_groups`` do not hold (by identity)."""
    held = {id(p) for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]}
    return tuple(i for i, p in enumerate(tracker.params) if id(p) not in held)


def check_frozen(tracker) -> None:
    """At each flush (``Tracker.flush``): notice a tracked parameter frozen after the tracker was built
    (``p.requires_grad_(False)``: the optimizer no longer moves it) or no longer held by the optimizer
    the tracker watches (its ``param_groups`` edited).  A law some but not all of whose parameters are
    frozen is no longer conserved by gradient flow (one side stands still while the other follows the
    gradient; spec "Breakers": a zero learning rate on part of a law): it is marked ``broken_by`` (still
    tracked, counted in ``broken/<family>``) and stays marked if the parameter is unfrozen later (its
    ``eps`` keeps what moved meanwhile).  A law frozen whole is constant, not broken (unfreezing part of
    it breaks it).  One ``BrokenLawWarning`` per flush that finds a newly frozen parameter or a newly half
    frozen law, naming the parameters.  Cost per flush: one ``requires_grad``
    read per tracked tensor and, when the tracker watches an optimizer, one pass over its parameters."""
    params = tracker.params
    frozen = tuple(i for i, p in enumerate(params) if not p.requires_grad)
    st = tracker.breakers
    opt = st.watch
    if opt is not None and st.held_seen is not None:
        if _not_held(tracker, opt) != st.held_seen:
            check_optimizer(tracker, opt, _watching=True)  # (sets held_seen)
    seen = st.frozen_seen
    if frozen == seen:
        return
    st.frozen_seen = frozen
    newly = sorted(set(frozen) - set(seen))  # (an unfreezing can leave a law frozen whole half frozen too)
    names = tracker.compiled.names
    at = {n: i for i, n in enumerate(names)}
    now = set(frozen)
    marks = st.frozen_broken
    step = getattr(tracker, "step_count", 0)
    culprits: dict[int, list[str]] = {}  # frozen parameter -> the laws marked now because of it
    for law in tracker.laws:
        if law.name in marks:
            continue
        ps = [at[p] for p in law.params if p in at]
        fr = [i for i in ps if i in now]
        if not fr or len(fr) == len(ps):
            continue
        labels = _labels([names[i] for i in ps])
        marks[law.name] = (f"frozen after the tracker was built: {', '.join(labels[ps.index(i)] for i in fr)} "
                           f"(requires_grad=False, seen at step {step}; they do not move while the rest of the law does)")
        for i in fr:
            culprits.setdefault(i, []).append(law.name)
    rest = [i for i in newly if i not in culprits]
    if not culprits and not rest:
        return
    tracker.broken_by = _with_marks(tracker, st.optimizer_broken)
    if marks:
        _monitor(tracker)
    parts = [f"{names[i]} breaks {len(laws)} law(s) whose other parameters still train "
             f"({', '.join(laws[:3])}{', ...' if len(laws) > 3 else ''})" for i, laws in sorted(culprits.items())]
    shown = parts[:3] + ([f"... ({len(parts) - 3} more)"] if len(parts) > 3 else [])
    if parts:
        shown[-1] += ": marked broken_by, still tracked"
    if rest:
        shown.append(f"{', '.join(names[i] for i in rest[:3])}{f' (and {len(rest) - 3} more)' if len(rest) > 3 else ''}"
                     ": only in laws frozen whole (constant from now on) or marked already")
    warn(f"conserve: parameter(s) frozen (requires_grad=False) after the tracker was built, seen at step {step}: "
                  f"{'; '.join(shown)}; freeze whole laws (every parameter a law reads) to keep the others conserved, "
                  "or build the tracker after freezing (frozen parameters' laws are then declined)",
                  BrokenLawWarning)
