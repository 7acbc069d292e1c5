"""Structural detection of a model too large for one float64 probe, or on the meta device: block by block.

``detect_large(model, ...)`` is what ``conserve.detect`` runs (detector ``"large"``, before the torch.nn and graph
detectors) for a model with no HF / timm / reference name that is on the meta device (an FSDP2 recipe builds every
large model there before sharding) or holds more than ``max_probe_params`` parameters (default 3e8: the whole
float64 probe of ``graph.detect_graph`` would not fit). The model is never modified and its parameters are never
copied (their values are read only when a materialised model's forward cannot run on fake tensors: step 1's
concrete fallback); its buffers are copied where they have values. A model with no repeated blocks is all "outside"
(step 3).

1. **Capture, with no weight values** (``capture``): a clone of the model whose parameters and buffers are fake
   tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and dtypes, no storage; the clone shares no
   tensor with the model) runs its forward once on the example input (given, else synthesised as for the probe).
   Hooks record what every module receives (args and kwargs) and returns, and a ``TorchFunctionMode`` which modules
   were running when each parameter was read (``blocks.Record``). A block whose code cannot run on fake tensors
   (data-dependent routing: ``nonzero``, ``item()``) is materialised alone (float64, random values) and run
   concretely on random inputs of the recorded shapes, its output turned back into fake tensors; if it cannot run
   even so, the run goes on with its first input in place of its output and the block is declined by name. A
   materialised model whose own forward cannot run on fake tensors is recorded by one concrete forward instead
   (``blocks.record``).
2. **Blocks** (``find_blocks``): the children holding parameters of the outermost ``nn.ModuleList`` /
   ``ModuleDict`` / ``Sequential`` with at least two such children that are themselves made of modules (a
   decoder's layers). A block above ``max_probe_params`` is split into its children (recursively; a leaf above it
   is declined). Blocks are grouped by code and shapes (class, parameter and buffer names / shapes / dtypes /
   ``requires_grad``, buffer values when the model has them, and the shapes, dtypes and non-tensor values of
   what the forward passed them); each group is detected ONCE.
3. **Outside the blocks** (``_outside``): the model with every block replaced by a parameter-free stand-in
   (``blocks.Opaque``: a fixed non-linear function of its floating inputs with the recorded output shapes), made
   float64 with random parameters (real buffers copied; meta buffers random, see below), is traced with the
   stand-ins as opaque leaves and detected with ``ongraph.detect_on`` (its embedding, final norm + head, the
   translation law under ``loss='ce'``). The same run records the real values every stand-in receives: the
   inputs of the blocks (hidden states, and e.g. the RoPE cos / sin the model computes from its buffers). When
   these parameters hold more than ``min(max_probe_params, OUTSIDE_PARAMS)`` values, every parameter axis of an
   ``nn.Embedding`` / ``nn.Linear`` outside the blocks whose size occurs in no block parameter and no input
   (the vocabulary) is reduced (``SHRINK``: two sizes, detected separately); a law is kept only when both give
   it, its terms cover each reduced axis whole and read no entry along it (the translation law sums the head's
   rows, the final norm's gain reads the head's whole columns), and it is mapped back to the full size. These laws
   pass the first-order check on the stand-in model at both reduced sizes (a float64 copy at the full vocabulary
   would not fit).
4. **Each group** (``_detect_block``): one block materialised as a float64 CPU copy with random values (the
   parameters of the model are never read: a law is a property of the architecture; buffers as below), detected on
   its own with ``trace.trace`` + ``ongraph.detect_on`` on the input it received in step 3 (else random inputs of
   the recorded shapes); a block that cannot be traced goes through ``graph.detect_graph`` (``blocks.by_blocks``:
   opaque sub-modules, routing specialised to the input). Every law claimed passes the spec's first-order check
   (check 1, float64) on that block, at its full size. The copy is freed (``gc.collect``: its traced graph holds it
   in reference cycles) before the next group. The laws and declines are mapped to
   every block of the group by renaming the block's path; a law reading a parameter the model also reads outside
   that block's forward (step 1's record) is declined.
5. **Merged** on a ``Collector`` of the model itself: every law is compiled against the FULL model's parameter
   names and shapes (meta parameters included), the frozen / tied filter and ``undetected`` as everywhere.
   ``Detection.detector`` is ``"graph:blocks"`` and ``Detection.notes`` says which path
   was taken and why.

Buffers of a meta-device model have no values: each gets random values of the kind the op accepts (floating:
uniform in [0.5, 1.5), e.g. RoPE inverse frequencies; complex with two or more axes: a RoPE table ``exp(i t f_p)``
over positions ``t`` (the second-to-last axis) with random frequencies ``f_p``, the identity at position 0 as every
RoPE table is (the attention finder reads the heads there); other complex: unit modulus; integer: ``arange`` along
the last axis; bool: True). A law verified at such generic values holds at the model's own values: the first-order
identity is analytic in them (random values give at most fewer laws, never a wrong one).

The first-order check of this path (``check.check_laws_fast``) is spec check 1 with ``check.check_laws``' inputs and
verdicts: the model gradients of two random output projections (and of the cross-entropy for translation laws) in
float64, and for each law ``|<grad (s.h), g>| / (||grad (s.h)|| ||g||)`` with ``g`` restricted to the law's own
parameters (never smaller than the measure over all parameters: stricter). ``grad (s.h)`` is formed term by term
on the law's views (a quadratic law's gradient is linear in them), not by differentiating the kernels' reference
twin, whose strided reductions dominate the time of a block of an 8B model (``bench/detect_large.py``); one
trial's gradients, of the laws' parameters only, are held at a time. This path passes it as the ``check`` of
``ongraph.detect_on`` and ``graph.detect_graph``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import math
import time

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..laws import Declined, Law
from .blocks import Opaque, Reads, Record, add_block_laws, positional, set_module, short_error, tree_to_float64
from .core import Collector, Detection, detectors, register
from .check import check_laws_fast
from .dispatch import nested
from .fxgraph import Graph
from .graph import detect_graph
from .ongraph import detect_on
from .probe import no_cache, synth_inputs
from .trace import TraceError, trace

__all__ = ["applies", "detect_large", "find_blocks"]

OUTSIDE_PARAMS = 2e7  # parameters outside the blocks above this (and above max_probe_params): free sizes reduced
SHRINK = (24, 40)  # the reduced sizes of a free axis (two, detected separately; a law must come out of both)
MIN_FREE = 64  # a free size below this is left as it is
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


# ---------------------------------------------------------------------------------------------- helpers
def _params_of(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def applies(model: nn.Module, max_probe_params: float = 3e8) -> str | None:
    """Why the whole float64 probe cannot be used (meta device, too many parameters), or None."""
    if _is_meta(model):
        return "the model is on the meta device (shapes, no values)"
    n = _params_of(model)
    if n > max_probe_params:
        return f"the model has {n:.3g} parameters, above max_probe_params={max_probe_params:.3g}"
    return None


def _composite(m: nn.Module) -> bool:
    return any(any(True for _ in ch.parameters()) for ch in m.children())


def find_blocks(model: nn.Module) -> list[str]:
    """Paths of the repeated blocks (module docstring, step 2), in module order."""
    out: list[str] = []

    def visit(m: nn.Module, prefix: str):
        for name, ch in m.named_children():
            path = prefix + name
            if not any(True for _ in ch.parameters()):
                continue
            if isinstance(ch, CONTAINERS):
                kids = [(n, k) for n, k in ch.named_children() if any(True for _ in k.parameters())]
                if len(kids) >= 2 and all(_composite(k) for _, k in kids):
                    out.extend(f"{path}.{n}" for n, _ in kids)
                    continue
            visit(ch, path + ".")

    visit(model, "")
    return out


def _under(names, path: str) -> list[str]:
    return [k for k in names if k.startswith(path + ".")]


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _clone(model: nn.Module, param, buffer) -> nn.Module:
    """``copy.deepcopy(model)`` whose parameters and buffers are ``param(name, p)`` / ``buffer(name, b)`` (each
    tensor object once, so tied parameters stay tied); nothing of the model's own storage is copied."""
    memo: dict = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = param(k, p)
    for k, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = buffer(k, b)
    return copy.deepcopy(model, memo)


def _fix_sizes(model: nn.Module) -> None:
    """Size attributes of ``nn.Embedding`` / ``nn.Linear`` made to agree with their (reduced) weights."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.num_embeddings = m.weight.shape[0]
            if m.padding_idx is not None and m.padding_idx >= m.num_embeddings:
                m.padding_idx = None
        elif isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape


def _uniform(shape, gen: torch.Generator) -> torch.Tensor:
    """Zero-mean, unit-variance random values (uniform: faster than ``randn`` on a CPU; any values serve)."""
    return torch.rand(shape, generator=gen, dtype=torch.float64).sub_(0.5).mul_(12 ** 0.5)


def _random_param(shape, name: str, dtype, gen: torch.Generator) -> torch.Tensor:
    """The probe's convention (``graph``'s ``_randomize``): matrices of variance ``1/fan_in``, vectors named weight
    ``1 + 0.3 u``, other vectors ``0.3 u`` (``u``: zero mean, unit variance); float64 (complex128 for complex
    parameters)."""
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.complex128)
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    if len(shape) >= 2:
        return _uniform(shape, gen).mul_(1.0 / max(shape[-1], 1) ** 0.5)
    base = 1.0 if name.endswith("weight") else 0.0
    return _uniform(shape, gen).mul_(0.3).add_(base)


def _random_buffer(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """A value for a buffer whose values are unknown (meta device): module docstring."""
    if dtype.is_complex:  # a RoPE table (positions x pairs): exp(i t f_p), the identity at position 0
        if len(shape) >= 2:
            f = torch.rand(shape[-1], generator=gen, dtype=torch.float64) * 0.9 + 0.1
            ang = torch.arange(shape[-2], dtype=torch.float64)[:, None] * f[None, :]
            ang = ang.expand(shape).contiguous()
        else:
            ang = torch.rand(shape, generator=gen, dtype=torch.float64) * (2 * math.pi)
        return torch.polar(torch.ones_like(ang), ang)
    if dtype.is_floating_point:
        return torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    n = math.prod(shape)
    last = shape[-1] if len(shape) else 1
    return (torch.arange(n) % max(last, 1)).reshape(shape).to(dtype)


def _real64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        return t.to(device="cpu", dtype=torch.complex128).clone()
    if t.is_floating_point():
        return t.to(device="cpu", dtype=torch.float64).clone()
    return t.to("cpu").clone()


def materialise(module: nn.Module, seed: int = 0, shapes: dict | None = None, leave: tuple = (),
                dtype: torch.dtype | None = None) -> nn.Module:
    """A float64 CPU copy of ``module`` with random parameters (``shapes``: {parameter name: reduced shape}),
    buffers copied (meta buffers random: module docstring); eval mode. ``leave``: module paths whose parameters
    and buffers stay on the meta device (blocks replaced afterwards). ``dtype``: the floating dtype instead of
    float64 (complex: its complex counterpart). The module's parameters are never read."""
    gen = torch.Generator().manual_seed(seed)
    shapes = shapes or {}

    def cast(t):
        if dtype is None or dtype == torch.float64:
            return t
        if t.is_complex():
            return t.to(torch.complex64 if dtype in (torch.float32, torch.float16, torch.bfloat16) else t.dtype)
        return t.to(dtype) if t.is_floating_point() else t

    def left(k):
        return any(k.startswith(p + ".") for p in leave)

    def param(k, p):
        if left(k):
            return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        t = cast(_random_param(tuple(shapes.get(k, p.shape)), k, p.dtype, gen))
        return nn.Parameter(t, requires_grad=p.requires_grad and (t.is_floating_point() or t.is_complex()))

    def buffer(k, b):
        if left(k):
            return torch.empty(b.shape, dtype=b.dtype, device="meta")
        return cast(_random_buffer(tuple(b.shape), b.dtype, gen) if b.is_meta else _real64(b))

    out = _clone(module, param, buffer)
    _fix_sizes(out)
    return out.eval()


def _spec_key(tree) -> tuple:
    """Shapes, dtypes and non-tensor values of a recorded ``(args, kwargs)``: what a group's members must share."""
    out = []
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            out.append(("T", tuple(x.shape), str(x.dtype)))
        else:
            out.append(("V", repr(x)[:200]))
    return tuple(out)


def _realise(tree):
    """Real float64 values for recorded (fake) tensors: floating ``N(0, 1)``, complex unit modulus, integers
    ``arange`` along the last axis, bool True (a generic point; module docstring)."""
    gen = torch.Generator().manual_seed(3)

    def real(t):
        if not isinstance(t, torch.Tensor):
            return t
        shape = tuple(t.shape)
        if t.is_floating_point():
            return torch.randn(shape, generator=gen, dtype=torch.float64)
        return _random_buffer(shape, t.dtype, gen)

    return tree_map(real, tree)


def _buffer_key(b: torch.Tensor) -> tuple:
    """Shape, dtype and (where the buffer has values) a hash of its bytes."""
    if b.is_meta or getattr(b, "fake_mode", None) is not None:
        return (tuple(b.shape), str(b.dtype))
    raw = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (tuple(b.shape), str(b.dtype), hashlib.sha1(raw).hexdigest())


# ------------------------------------------------------------------------------------------- the capture
@dataclasses.dataclass
class Capture:
    """Step 1: the record (fake tensors), the real example input it ran on, the blocks run concretely (path ->
    why), those that could not run at all (path -> reason) and what each block's forward called."""

    rec: Record
    inputs: tuple
    kwargs: dict
    concrete: dict
    failed: dict
    ops: dict = dataclasses.field(default_factory=dict)  # block path -> hash of its torch calls (fake run)


def _in_vocab(inputs: tuple, model: nn.Module) -> tuple:
    """Integer inputs taken modulo the smallest ``nn.Embedding`` of ``model`` where they exceed it (token ids of
    the full vocabulary given to a model whose vocabulary is reduced)."""
    emb = [m.weight.shape[0] for m in model.modules() if isinstance(m, nn.Embedding)]
    if not emb:
        return inputs
    n = min(emb)
    return tuple(x % n if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
                 and x.dtype != torch.bool and x.numel() and int(x.max()) >= n else x for x in inputs)


def _digest(ops: dict) -> dict:
    return {p: hashlib.sha1(repr(v).encode()).hexdigest() for p, v in ops.items()}


def _capture_concrete(model: nn.Module, blocks: list[str], example_inputs, forward_kwargs: dict | None) -> Capture:
    """Step 1 by one concrete forward of a materialised model (``blocks.record``): where its code cannot run on
    fake tensors."""
    from .blocks import record

    ops: dict = {}
    rec, x0, kw0 = record(model, example_inputs, forward_kwargs, blocks, ops)
    return Capture(rec, tuple(x0), dict(kw0), {}, {}, _digest(ops))


@contextlib.contextmanager
def _quiet(name: str = "torch._subclasses.fake_tensor"):
    """The fake-tensor logger silenced (it logs every op that cannot run on fake tensors; here that is expected)."""
    import logging

    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def capture(model: nn.Module, blocks: list[str], example_inputs, forward_kwargs: dict | None,
            shapes: dict | None = None) -> Capture:
    """Step 1 of the module docstring on a fake clone of ``model`` (``shapes``: reduced parameter shapes).
    Raises when the forward cannot run on it."""
    with _quiet():
        return _capture(model, blocks, example_inputs, forward_kwargs, shapes)


def _capture(model: nn.Module, blocks: list[str], example_inputs, forward_kwargs: dict | None,
             shapes: dict | None = None) -> Capture:
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    shapes = shapes or {}
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    with fm:
        fake = _clone(model, lambda k, p: nn.Parameter(torch.empty(tuple(shapes.get(k, p.shape)), dtype=p.dtype),
                                                       requires_grad=p.requires_grad),
                      lambda k, b: torch.empty(tuple(b.shape), dtype=b.dtype))
    _fix_sizes(fake)
    p0 = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = p0.dtype if p0 is not None else torch.float32
    kwargs = {k: (v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in (forward_kwargs or {}).items()}
    no_cache(model, kwargs)
    rec = Record({}, {}, {})
    names: dict = {}
    for k, p in fake.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(k)
    paths = {id(m): path for path, m in fake.named_modules()}
    stack: list = []
    concrete: dict = {}
    failed: dict = {}
    ops: dict = {}
    paused: set = set()

    def pre(m, args, kw):
        path = paths.get(id(m))
        stack.append(path)
        if path not in rec.calls:
            rec.calls[path] = (args, kw)

    def post(m, args, kw, out):
        path = paths.get(id(m))
        if stack and stack[-1] == path:
            stack.pop()
        if path not in rec.outs:
            rec.outs[path] = out

    def concrete_forward(path: str, orig):
        def forward(*args, **kw):
            try:
                return orig(*args, **kw)
            except Exception as e:  # noqa: BLE001 - data-dependent code: run this block alone, concretely
                why = short_error(e)
            while stack and stack[-1] != path:  # (the modules the failed call left on the stack)
                stack.pop()
            floats = [t for t in tree_leaves((args, kw)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            dt = floats[0].dtype if floats else dtype
            paused.add(path)
            with unset_fake_temporarily():
                try:
                    blk = materialise(model.get_submodule(path), seed=5, dtype=dt)
                    ra, rk = tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                                      else t, _realise((args, kw)))
                    with torch.no_grad():
                        out = blk(*ra, **rk)
                    del blk
                    concrete[path] = why
                    res = tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                                   out)
                except Exception as e2:  # noqa: BLE001 - declined by name; the run goes on
                    failed[path] = f"its forward cannot run on fake tensors ({why}) nor concretely alone ({short_error(e2)})"
                    res = None
            if res is None:
                return floats[0] if floats else None
            return tree_map(lambda t: fm.from_tensor(t) if isinstance(t, torch.Tensor) else t, res)

        return forward

    for path in blocks:
        m = fake.get_submodule(path)
        m.forward = concrete_forward(path, m.forward)
    fake.eval()
    gen = torch.Generator().manual_seed(1)
    if example_inputs is not None:
        given = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        real = tuple(x.detach().cpu().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                     else (x.detach().cpu() if isinstance(x, torch.Tensor) else x) for x in given)
        real = _in_vocab(real, fake)
    else:  # synthesised on the fake clone (its reduced vocabulary), then made real with the same shapes
        with fm:
            spec = synth_inputs(fake, None, {k: fm.from_tensor(v) if isinstance(v, torch.Tensor) else v
                                             for k, v in kwargs.items()}, dtype=dtype, device=torch.device("cpu"))
        emb = [m.num_embeddings for m in fake.modules() if isinstance(m, nn.Embedding)]
        real = tuple(torch.randint(0, min(emb), tuple(x.shape), generator=gen) if emb and not x.is_floating_point()
                     else (torch.randn(tuple(x.shape), generator=gen, dtype=dtype) if x.is_floating_point()
                           else _realise(x)) for x in spec)
    concrete.clear()
    failed.clear()
    paused.clear()
    handles = []
    for path, m in fake.named_modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    with fm, torch.no_grad(), Reads(names, stack, rec.reads, blocks, ops, paused):
        fk = {k: fm.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        fake(*[fm.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in real], **fk)
    for h in handles:
        h.remove()
    return Capture(rec, real, kwargs, concrete, failed, _digest(ops))


def _template(tree):
    """Real zeros of a recorded output's shapes (floating float64, complex complex128): ``Opaque``'s template."""

    def z(t):
        if not isinstance(t, torch.Tensor):
            return t
        dt = torch.float64 if t.is_floating_point() else (torch.complex128 if t.is_complex() else t.dtype)
        return torch.zeros(tuple(t.shape), dtype=dt)

    return tree_map(z, tree)


# ------------------------------------------------------------------------------------- outside the blocks
def _free_sizes(model: nn.Module, blocks: list[str], example_inputs) -> set[int]:
    """Sizes of the ``nn.Embedding`` / ``nn.Linear`` axes outside the blocks that no block parameter and no given
    input has (at least ``MIN_FREE``): the vocabulary."""
    taken = {n for b in blocks for p in model.get_submodule(b).parameters() for n in p.shape}
    given = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    taken |= {n for x in given if isinstance(x, torch.Tensor) for n in x.shape}
    out = set()
    for path, m in model.named_modules():
        if any(path == b or path.startswith(b + ".") for b in blocks):
            continue
        if isinstance(m, (nn.Embedding, nn.Linear)):
            out.update(n for n in m.weight.shape if n >= MIN_FREE and n not in taken)
    return out


def _reduced_shapes(model: nn.Module, blocks: list[str], free: set[int], size: int) -> dict[str, tuple]:
    """{parameter name: shape} of the ``nn.Embedding`` / ``nn.Linear`` outside the blocks with every free axis
    reduced to ``size`` (a parameter tied to one inside a block is left as it is)."""
    inside = {id(p) for b in blocks for p in model.get_submodule(b).parameters()}
    out = {}
    for path, m in model.named_modules():
        if any(path == b or path.startswith(b + ".") for b in blocks) or not isinstance(m, (nn.Embedding, nn.Linear)):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in inside:
                continue
            shape = tuple(size if n in free else n for n in p.shape)
            if shape != tuple(p.shape):
                for k, q in model.named_parameters(remove_duplicate=False):
                    if q is p:
                        out[k] = shape
    return out


def _unreduce(law: Law, shapes: dict, full: dict) -> Law | None:
    """``law`` (found with the reduced ``shapes``) at the ``full`` shapes, or None when it cannot be mapped: each
    reduced axis must be covered whole (from 0) and summed over (a sum term's rows) or contracted (a norm / Gram
    term's columns), never an axis of the law's entries."""
    terms = []
    for t in law.terms:
        ref = t.ref
        if ref.param not in shapes:
            terms.append(t)
            continue
        small, big = shapes[ref.param], full[ref.param]
        rows, cols = ref.rows, ref.cols
        for a, (n, N) in enumerate(zip(small, big)):
            if n == N:
                continue
            if ref.start[a] != 0:
                return None
            if a == ref.row_dim and t.kind == "sum" and ref.rows == n and ref.row_step == 1:
                rows = N
            elif a == ref.col_dim and t.kind in ("norm", "gram") and ref.cols == n:
                cols = N
            else:
                return None
        terms.append(dataclasses.replace(t, ref=dataclasses.replace(ref, rows=rows, cols=cols)))
    return dataclasses.replace(law, terms=terms)


def _law_key(law: Law) -> tuple:
    return (law.name, type(law).__name__, law.size, repr(law.terms))


@dataclasses.dataclass
class Outside:
    """Step 3's result: laws (full shapes), declines, undetected module paths and the real float64 inputs of each
    block (path -> (args, kwargs))."""

    laws: list
    declined: list
    undetected: list
    block_inputs: dict


def _outside_plan(model: nn.Module, blocks: list[str], example_inputs, max_probe_params: float) -> tuple[list, str]:
    """The reduced shapes to detect the outside part with (``[{}]``: full size) and the note saying so. Raises
    when it is too large and cannot be reduced."""
    outside = {id(p): p.numel() for k, p in model.named_parameters() if not any(k.startswith(b + ".") for b in blocks)}
    n = sum(outside.values())
    budget = min(max_probe_params, OUTSIDE_PARAMS)
    if n <= budget:
        return [{}], ""
    free = _free_sizes(model, blocks, example_inputs)
    sets = [_reduced_shapes(model, blocks, free, size) for size in SHRINK]
    params = dict(model.named_parameters(remove_duplicate=False))
    small = {id(params[k]): math.prod(shape) for k, shape in sets[0].items()}
    left = sum(small.get(i, v) for i, v in outside.items())
    if not sets[0] or left > budget:
        raise ValueError(f"the {n:.3g} parameters outside the blocks are above {budget:.3g} and cannot be reduced "
                         "(no nn.Embedding / nn.Linear axis of a size the blocks and inputs do not have)")
    return sets, (f"outside the blocks ({n:.3g} parameters): detected with the axes of size {sorted(free)} of "
                  f"{sorted(sets[0])} reduced to {SHRINK[0]} and to {SHRINK[1]}; a law is claimed when both give it, "
                  "mapped to the full shapes")


def _outside(model: nn.Module, blocks: list[str], cap: Capture, shapes: dict, loss, skip: set, options: dict,
             seed: int = 0) -> tuple[Detection, dict]:
    """Step 3 for one set of reduced ``shapes``: the detection of the stand-in model and the real inputs of the
    blocks. Raises when the stand-in model cannot be built, run or traced."""

    skel = materialise(model, seed=seed, shapes=shapes, leave=tuple(blocks))
    for path in blocks:
        out = cap.rec.outs.get(path)
        if out is None:
            raise ValueError(f"{path} was not called by the forward")
        set_module(skel, path, Opaque(_template(out)))
    seen: dict = {}

    def grab(path):
        def pre(m, args, kw):
            if path not in seen:
                seen[path] = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kw))
        return pre

    handles = [skel.get_submodule(p).register_forward_pre_hook(grab(p), with_kwargs=True) for p in blocks]
    args64, kw64 = tree_to_float64(positional(skel, _in_vocab(cap.inputs, skel), cap.kwargs))
    try:
        with torch.no_grad():
            skel(*args64, **kw64)
    finally:
        for h in handles:
            h.remove()
    try:
        gm, how = trace(skel, args64, kw64, leaves=set(blocks))
    except TraceError:
        gm, how = trace(skel, args64, kw64)
    g = Graph(gm, args64, dict(skel.named_parameters(remove_duplicate=False)), kw64 if how == "torch.export" else {})
    c = Collector(skel, {**options, "loss": loss})
    d = detect_on(g, c, skel, f"{how}, blocks as opaque stand-ins", skip, check_laws_fast)
    return d, seen


def _outside_detection(model: nn.Module, blocks: list[str], cap: Capture, sets: list, loss, skip: set,
                       options: dict) -> Outside:
    """Step 3 at each set of reduced shapes; the laws every set gives, mapped to the full shapes."""
    full = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    found, inputs = [], {}
    for i, shapes in enumerate(sets):
        d, seen = _outside(model, blocks, cap, shapes, loss, skip, options, seed=i)
        found.append(d)
        if i == 0:
            inputs = seen
    if len(sets) == 1:
        return Outside(found[0].laws, found[0].declined, found[0].undetected, inputs)
    mapped = []
    for d, shapes in zip(found, sets):
        m = {}
        for law in d.laws:
            big = _unreduce(law, shapes, full)
            if big is not None:
                m[_law_key(big)] = big
        mapped.append(m)
    laws = [law for k, law in mapped[0].items() if all(k in m for m in mapped[1:])]
    declined = list(found[0].declined)
    kept = {law.name for law in laws}
    for law in found[0].laws:
        if law.name not in kept:
            declined.append(Declined(law.name, f"{law.family} law (reduced outside part)",
                                     f"found with {sorted(sets[0])} reduced, but it reads part of a reduced axis or "
                                     "is not found the same at the other reduced size: not claimed at the full size"))
    return Outside(laws, declined, found[0].undetected, inputs)


# ---------------------------------------------------------------------------------------------- the blocks
def _detect_block(module: nn.Module, args: tuple, kwargs: dict, options: dict, dtype: torch.dtype
                  ) -> tuple[Detection, str]:
    """Step 4 for the block ``module`` of the model (never read: a float64 copy with random values is detected, and
    freed before this returns) on the real inputs ``args`` / ``kwargs`` (float64): ``(detection, how)``. A copy
    that cannot be traced goes through ``graph.detect_graph`` as a copy in the model's ``dtype`` (``blocks``
    records it at its own dtype: an op with no float64 kernel still runs there)."""

    sub = {k: v for k, v in options.items() if k not in ("example_inputs", "forward_kwargs", "loss", "max_probe_params",
                                                         "skip_params")}
    blk = materialise(module, seed=7)
    a64, k64 = positional(blk, args, kwargs)
    try:
        gm, how = trace(blk, a64, k64)
        g = Graph(gm, a64, dict(blk.named_parameters(remove_duplicate=False)), k64 if how == "torch.export" else {})
    except Exception:  # noqa: BLE001 - untraceable / data-dependent / no float64 kernel: blocks.by_blocks below
        g = None
    if g is not None:
        return detect_on(g, Collector(blk, {**sub, "loss": None}), blk, how, set(), check_laws_fast), how
    del blk
    gc.collect()
    own = materialise(module, seed=7, dtype=dtype)
    cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
    d = detect_graph(own, tree_map(cast, tuple(args)), forward_kwargs=tree_map(cast, dict(kwargs)), loss=None,
                     max_probe_params=math.inf, _depth=1, check=check_laws_fast, **sub)
    return d, "structural detection of the block alone, its parts analysed one by one"


def _units(model: nn.Module, blocks: list[str], limit: float, c: Collector) -> list[str]:
    """Blocks above ``limit`` parameters split into their children holding parameters (recursively); a leaf above
    it is declined."""
    out = []
    for path in blocks:
        m = model.get_submodule(path)
        n = _params_of(m)
        if n <= limit:
            out.append(path)
            continue
        kids = [f"{path}.{k}" for k, ch in m.named_children() if any(True for _ in ch.parameters())]
        own = [k for k, _ in m.named_parameters(recurse=False)]
        if own or not kids:
            c.decline(path, type(m).__name__, f"one block of {n:.3g} parameters, above max_probe_params={limit:.3g} "
                      f"(its float64 copy would be too large){'; its own parameters ' + str(own) if own else ''}: "
                      "not analysed; raise max_probe_params")
            continue
        c.declined.append(Declined(path, type(m).__name__, f"one block of {n:.3g} parameters, above max_probe_params="
                                   f"{limit:.3g}: its children analysed one by one (a law across them is missed)"))
        out += _units(model, kids, limit, c)
    return out


def _group_key(model: nn.Module, path: str, cap: Capture) -> tuple:
    """What the blocks of one group share (module docstring, step 2; the torch calls of their forward too)."""
    m = model.get_submodule(path)
    ps = tuple((k, tuple(p.shape), str(p.dtype), p.requires_grad) for k, p in m.named_parameters())
    bs = tuple((k, _buffer_key(b)) for k, b in m.named_buffers())
    return (type(m), ps, bs, _spec_key(cap.rec.calls[path]), path in cap.concrete, cap.ops.get(path))


def _merge_block(c: Collector, model: nn.Module, path: str, d: Detection, rec: Record, names: list[str],
                 block: nn.Module, skip: set) -> None:
    """The laws / declines of one group's detection ``d`` under ``path`` (``blocks._one_block``'s rules; a law
    reading only parameters in ``skip`` is left out)."""
    add_block_laws(c, d, path, set(rec.outside(path, names)), skip)
    in_laws = {p for law in d.laws for p in law.params}
    for x in d.declined:
        reason, kind = x.reason, x.block
        if x.block == "output layer":  # the block's output is not the model's
            mod_params = [k for k, _ in block.named_parameters() if _owner(k) == x.module]
            if mod_params and all(k in in_laws for k in mod_params):
                continue
            reason, kind = ("a linear map whose output leaves the block (what reads it outside is not seen when the "
                            "block is analysed alone): no law"), "linear"
        module = f"{path}.{x.module}" if x.module else path
        if not x.module:
            c.declined.append(Declined(module, kind, reason))
            c.know(*[k for k in names if "." not in k[len(path) + 1:]])
        else:
            c.decline(module, kind, reason)
    undetected = {f"{path}.{u}" for u in d.undetected}
    for k in names:
        if _owner(k) not in undetected and not c.covered(k):
            c.know(k)


# ------------------------------------------------------------------------------------------- entry point
def detect_large(model: nn.Module, example_inputs=None, *, forward_kwargs: dict | None = None, loss: str | None = None,
                 max_probe_params: float = 3e8, skip_params=(), **options) -> Detection:
    """Block-by-block structural detection (module docstring). Never raises for a block; returns a ``Detection``
    with ``detector='graph:blocks'`` and ``notes`` (list of str: the path taken and why, the reduction, the time).

    Args: as ``graph.detect_graph``; ``max_probe_params`` bounds each float64 copy (one block, the part outside
    the blocks), not the model."""
    t0 = time.perf_counter()
    options.pop("_depth", None)
    c = Collector(model, {**options, "loss": loss})
    skip = set(skip_params)
    names = [k for k, _ in model.named_parameters()]
    notes = [f"structural detection block by block: {applies(model, max_probe_params) or 'asked for'}"]

    def done():
        d = c.finish("graph:blocks")
        d.notes = notes + [f"{time.perf_counter() - t0:.1f} s"]
        return d

    def decline_all(reason, where=None):
        for mod in dict.fromkeys(_owner(k) for k in names if k not in skip and (where is None or where(k))):
            c.decline(mod, "not analysed", reason)

    units = _units(model, find_blocks(model), max_probe_params, c)
    inside = (lambda k: any(k.startswith(u + ".") for u in units))
    try:
        sets, note = _outside_plan(model, units, example_inputs, max_probe_params)
    except Exception as e:  # noqa: BLE001 - the blocks are still detected
        sets, note = None, f"outside the blocks: not detected ({short_error(e, 300)})"
    try:
        cap = capture(model, units, example_inputs, forward_kwargs, shapes=(sets or [{}])[0])
        how = "fake tensors"
    except Exception as e:  # noqa: BLE001
        if _is_meta(model):
            decline_all(f"the model's forward cannot run on fake tensors (shapes, no values): {short_error(e, 300)}; pass "
                        "example_inputs=(...) that forward takes, or materialise the model")
            return done()
        try:  # a materialised model: one concrete forward at its own dtype
            cap = _capture_concrete(model, units, example_inputs, forward_kwargs)
            how = f"a concrete forward ({short_error(e)})"
        except Exception as e2:  # noqa: BLE001
            decline_all(f"the model's forward cannot run on fake tensors ({short_error(e)}) nor concretely ({short_error(e2)}); "
                        "pass example_inputs=(...) that forward takes")
            return done()
    notes.append(f"what each block receives recorded from the forward on {how}")
    block_inputs: dict = {}
    if sets is not None:
        try:
            out = _outside_detection(model, units, cap, sets, loss, skip, options)
            read_inside = {k for k, stacks in cap.rec.reads.items() if any(u in st for st in stacks for u in units)}
            for law in out.laws:  # a parameter a block reads too: the stand-in did not show that use
                bad = [p for p in law.params if p in read_inside]
                if bad:
                    c.decline(law.name, f"{law.family} law (outside the blocks)", f"the model also reads {bad[:3]} "
                              "inside a block's forward: that use breaks the law's symmetry: not claimed")
                else:
                    c.add(law)
            for x in out.declined:
                c.declined.append(x)
                if x.module:
                    c.mark(x.module)
            undetected = set(out.undetected)
            c.know(*[k for k in names if not inside(k) and _owner(k) not in undetected])
            block_inputs = out.block_inputs
        except Exception as e:  # noqa: BLE001 - the blocks are still detected, on random inputs of the recorded shapes
            sets, note = None, f"outside the blocks: not detected ({short_error(e, 300)})"
    if sets is None:
        decline_all(f"{note}: no law", where=lambda k: not inside(k))
        note += "; the blocks detected on random inputs of the recorded shapes"
    if note:
        notes.append(note)
    # the blocks, one group of one code and shapes at a time
    groups: dict = {}
    for path in units:
        kind = type(model.get_submodule(path)).__name__
        if path in cap.failed:
            c.decline(path, kind, f"{cap.failed[path]}: not analysed")
        elif path not in cap.rec.calls:
            c.decline(path, kind, "not called by the model's forward on the example input: not analysed")
        else:
            groups.setdefault(_group_key(model, path, cap), []).append(path)
    p0 = next((p for p in model.parameters() if p.is_floating_point()), None)
    own = p0.dtype if p0 is not None else torch.float32
    for members in groups.values():
        rep = members[0]
        block = model.get_submodule(rep)
        args, kwargs = block_inputs[rep] if rep in block_inputs else _realise(cap.rec.calls[rep])
        args, kwargs = tree_to_float64((tuple(args), dict(kwargs)))
        try:
            d, _ = _detect_block(block, args, kwargs, options, own)
        except Exception as e:  # noqa: BLE001 - this group is declined by name, never the model
            for path in members:
                c.decline(path, type(block).__name__,
                          f"detecting one block of this code and shapes failed ({short_error(e, 300)}): no law")
            gc.collect()
            continue
        for path in members:
            _merge_block(c, model, path, d, cap.rec, _under(names, path), block, skip)
        del d
        gc.collect()  # the float64 copy is held in reference cycles (its traced graph): freed before the next one
    concrete = (f"; run concretely (code that cannot run on fake tensors): {sorted(cap.concrete)}"
                if cap.concrete else "")
    notes.append(f"{len(units)} block(s) in {len(groups)} group(s) of one code and shapes, each group detected once on "
                 f"a float64 copy of one block with random values{concrete}")
    if any(b.is_meta for b in model.buffers()):
        notes.append("meta-device buffers given random values of the kind their ops accept")
    return done()


@register("large")
def detect_large_fallback(model: nn.Module, config, **options):
    """Registry entry: ``detect_large`` for a model on the meta device or above ``max_probe_params`` that holds no
    model a name-based detector knows and parameters the torch.nn detector does not all explain by module type.
    None otherwise (the next detector answers), and None when it finds no law at all and nothing but "not
    analysed" declines (``detect`` then says why)."""
    if applies(model, options.get("max_probe_params", 3e8)) is None:
        return None
    if nested(model, options) is not None:  # an HF / timm / reference model inside: detected by its names
        return None
    torchnn = dict(detectors()).get("torch.nn")  # torch.nn modules that explain every parameter by their type
    known = torchnn(model, config, **options) if torchnn is not None else None
    if known is not None and not known.undetected:
        return None
    d = detect_large(model, **options)
    if not d.laws and all(x.block == "not analysed" for x in d.declined):
        return None
    return d


# ``conserve.detect(..., structural=True)`` skips the registry loop: what it runs for a model the whole float64
# probe cannot copy (``dispatch._detect`` reads these from the registry entry; it cannot import this module)
detect_large_fallback.applies = applies
detect_large_fallback.structural = detect_large
