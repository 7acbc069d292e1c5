"""The first-order check (spec check 1) of candidate laws, where detection runs it.

* ``check_laws(g, laws, heads)``: on a traced probe ``g`` (a ``Graph``, or anything with ``gm``, ``params``,
  ``inputs``, ``kwargs``), every law against the model gradients of a few random output projections (and of the
  cross-entropy for translation laws), computed once per trial and shared by all laws;
  ``analysis.firstorder.violation`` measures each law.
* ``check_on_probe(model, laws)``: the same on the model's own forward (a float64 copy with random parameters,
  traced when it can be, else run as is): a module type says what its own ``forward`` computes, not how the model
  calls it.
* ``checked_laws(model, laws, options)``: the laws of a type-based detector (torch.nn, an HF / timm model holding
  user classes) that pass ``check_on_probe``, and a decline for each that does not.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ..analysis.firstorder import (LawTerms, cross_entropy, gradients, law_size, law_vector, norm, output_tensors,
                                   random_projection, to_float64, violation)
from ..laws import Declined, Law, Translation
from ..laws.tolerance import FIRST_ORDER, FIRST_ORDER_UNTRACED
from .probe import make_probe, no_cache, synth_inputs
from .trace import trace

INPUT_SCALE = 30.0  # the floating inputs' scale at every other trial of ``check_laws``

__all__ = ["check_laws", "check_on_probe", "checked_laws"]


def _fresh(buffers: dict) -> dict:
    """Detached copies of ``buffers`` for one forward."""
    return {k: b.detach().clone() if isinstance(b, torch.Tensor) else b for k, b in buffers.items()}


def check_laws(g, laws: list, heads: dict, *, trials: int = 2, seed: int = 0) -> dict[str, float]:
    """Spec check 1 for every law on the traced probe (``conserve.analysis.verify.first_order``'s measure, the
    model gradients shared by all laws): worst ``|<grad (s.h), grad (r.f)>| / (||.|| ||.||)`` (float64) per law
    name; -1 when the law is constant (zero gradient), nan when it reads a parameter the graph does not hold.
    ``heads``: the translation laws' names (their check uses the cross-entropy gradient)."""
    gen = torch.Generator().manual_seed(seed)
    names = [k for k, _ in g.gm.named_parameters()]
    params = {k: g.params[k].detach().clone().requires_grad_(True) for k in names}
    buffers = dict(g.gm.named_buffers())  # copied per forward (``_fresh``): a forward writing them (a KV cache)
    # must not carry autograd history or values into the next
    plist = list(params.values())
    raw, ce = [], []
    for trial in range(trials):
        # every other trial on the floating inputs times INPUT_SCALE: a law holds for every input, while a candidate
        # read off the probe's values may hold only below a clip (ReLU6, hardtanh) those values never reach
        inputs = g.inputs if trial % 2 == 0 else tuple(
            x * INPUT_SCALE if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in g.inputs)
        outs = [t for t in output_tensors(functional_call(g.gm, {**params, **_fresh(buffers)}, inputs, g.kwargs))
                if t.requires_grad]
        if not outs:
            raise ValueError("no floating output of the forward depends on the model's parameters (e.g. a forward "
                             "bound to another instance, or outputs detached)")
        raw.append(dict(zip(names, gradients(random_projection(outs, gen), plist, retain_graph=True))))
        if heads:
            logits = [t for t in outs if t.dim() >= 1 and t.shape[-1] > 1]
            ce.append(dict(zip(names, gradients(cross_entropy(logits, gen), plist))))
    norms = {id(b): norm(list(b.values())) for b in raw + ce}
    out = {}
    for law in laws:
        if any(p not in params for p in law.params):
            out[law.name] = float("nan")
            continue
        mine = list(law.params)
        use = ce if isinstance(law, Translation) else raw
        out[law.name] = violation(law_vector(law, params), [params[k] for k in mine],
                                  [[b[k] for k in mine] for b in use], gen, norms=[norms[id(b)] for b in use])
    return out


class _Forward:
    """What ``check_laws`` reads of a ``Graph``, for a module run as it is: the module, its parameters (every
    name, tied ones included), inputs and keyword arguments."""

    def __init__(self, gm: nn.Module, probe: nn.Module, inputs: tuple, kwargs: dict):
        self.gm, self.inputs, self.kwargs = gm, inputs, kwargs
        self.params = dict(probe.named_parameters(remove_duplicate=False))


def check_on_probe(model: nn.Module, laws: list, *, example_inputs=None, forward_kwargs: dict | None = None,
                   max_probe_params: float = 3e8, **_options) -> tuple[dict[str, float] | None, str, bool]:
    """Spec check 1 (``check_laws``' measure) of ``laws`` found by a type-based detector, on ``model``'s own
    forward: a float64 copy with random parameters, run as is (not traced), on ``example_inputs`` or synthesised
    ones. A module type says what its own ``forward`` computes, not how the model calls it (an
    ``nn.Sequential``'s layers may be called one by one, with other maps between them). Returns
    ``({law name: worst violation}, "", traced)`` (-1: identically constant; nan: reads a parameter the model does
    not hold under that name, e.g. tied; ``traced``: False when the module ran as is, its own float32 casts then
    bound the measure near 1e-8) or ``(None, reason, False)`` when the probe cannot run (meta device, no input)."""
    if not laws:
        return {}, "", True
    try:
        probe = make_probe(model, max_probe_params)
        kwargs = to_float64(dict(forward_kwargs or {}))
        no_cache(model, kwargs, example_inputs)
        inputs = synth_inputs(probe, example_inputs, kwargs)
    except Exception as e:  # noqa: BLE001 - the caller keeps the laws and says why they were not checked
        return None, str(e), False
    try:  # traced: the code's float32 casts made float64 (HF modeling code), so the check resolves 1e-10
        gm, how = trace(probe, inputs, kwargs)
        run_kwargs, traced = (kwargs if how == "torch.export" else {}), True
    except Exception:  # noqa: BLE001 - the module as is (plain torch.nn code computes in the probe's float64)
        gm, run_kwargs, traced = probe, kwargs, False
    heads = {law.name: None for law in laws if isinstance(law, Translation)}
    try:
        return check_laws(_Forward(gm, probe, inputs, run_kwargs), laws, heads), "", traced
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}", False


def checked_laws(model: nn.Module, laws: list[Law], options: dict) -> tuple[list[Law], list[Declined]]:
    """The laws a type-based detector found that pass the spec's first-order check on the model's own forward
    (``check_on_probe``), and a decline with the violation for each that fails: a module type says what its
    ``forward`` computes, not that the model calls it (an ``nn.Sequential``'s layers called one by one with another
    map between them, a hidden layer also read elsewhere). ``options``: ``detect``'s, and ``why``, the reason
    given in a decline. When the probe cannot run (meta device, an input that cannot be synthesised) the laws are
    kept as the module types give them."""
    options = dict(options)
    why = options.pop("why", "the model does not use the block as its module's own forward does (e.g. an "
                             "nn.Sequential's layers called one by one with another map between them)")
    viol, _, traced = check_on_probe(model, laws, **options)
    if viol is None:
        return laws, []
    tol = FIRST_ORDER if traced else FIRST_ORDER_UNTRACED
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


def check_laws_fast(g, laws: list, heads: dict, *, trials: int = 2, seed: int = 0) -> dict[str, float]:
    """``check_laws`` (same inputs, same verdicts: worst relative violation per law name, -1 constant, nan reads a
    parameter the graph does not hold) with each law's gradient formed term by term from its views
    (``analysis.firstorder.LawTerms``) instead of by autograd of the kernels' reference twin: the measure's
    ``||g||`` is over the law's own parameters (never smaller than over all: stricter), and one trial's
    gradients of the laws' parameters only are held at a time.  What ``large`` checks an 8B block with."""
    gen = torch.Generator().manual_seed(seed)
    every = [k for k, _ in g.gm.named_parameters()]
    out: dict[str, float] = {}
    todo = []
    for law in laws:
        if any(p not in every for p in law.params):
            out[law.name] = float("nan")
        else:
            out[law.name] = 0.0
            todo.append(law)
    if not todo:
        return out
    read = {p for law in todo for p in law.params}
    names = [k for k in every if k in read]  # the gradients of the laws' parameters only (the measure's g_law)
    params = {k: g.params[k].detach().requires_grad_(k in read) for k in every}
    buffers = dict(g.gm.named_buffers())  # copied per forward (``_fresh``): a forward writing them (a KV cache)
    # must not carry autograd history or values into the next
    plist = [params[k] for k in names]
    kinds = [("raw", [law for law in todo if not isinstance(law, Translation)]),
             ("ce", [law for law in todo if isinstance(law, Translation)])]
    with torch.no_grad():
        terms = {law.name: LawTerms(law, params) for law in todo}
    for _ in range(trials):
        for kind, mine in kinds:
            if not mine:
                continue
            outs = [t for t in output_tensors(functional_call(g.gm, {**params, **_fresh(buffers)}, g.inputs, g.kwargs))
                    if t.requires_grad]
            if not outs:
                raise ValueError("no floating output of the forward depends on the model's parameters (e.g. a forward "
                                 "bound to another instance, or outputs detached)")
            if kind == "raw":
                obj = random_projection(outs, gen)
            else:
                obj = cross_entropy([t for t in outs if t.dim() >= 1 and t.shape[-1] > 1], gen)
            grads = dict(zip(names, gradients(obj, plist)))
            del outs, obj
            with torch.no_grad():
                norms2 = {k: float(torch.linalg.vector_norm(g_) ** 2) for k, g_ in grads.items()}
                for law in mine:
                    if out[law.name] < 0:
                        continue
                    s = torch.randn(law_size(law), generator=gen, dtype=torch.float64)
                    v = terms[law.name].measure(params, grads, norms2, s)
                    out[law.name] = -1.0 if v < 0 else max(out[law.name], v)
            grads.clear()
    for p in plist:
        p.requires_grad_(False)
    return out
