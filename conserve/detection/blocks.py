"""Structural detection block by block, for a model whose float64 probe cannot be run or traced as a whole.

``by_blocks`` is what ``graph.detect_graph`` does when probing or tracing the whole model fails (an op with no
float64 kernel such as ``torch._grouped_mm``, routing that decides which Python code runs, an untraceable module):

1. One concrete forward of the original model, in its own dtype and device, on ``example_inputs`` (else inputs
   synthesised as for the probe), with hooks on every module: the first input (args and kwargs) and output each
   module gets, and every torch call that reads a parameter with the modules running at that moment (a
   ``TorchFunctionMode``). A block's laws only hold for the model when its parameters are read inside its own
   forward: a law reading a parameter also read elsewhere (``F.linear(h, self.block.weight)`` from outside) is
   declined.
2. The whole float64 probe again, with the failing modules made opaque: a module whose forward torch.fx cannot
   trace is kept as one call (it runs as it is, in float64, in the graph and in the check); a module that cannot
   run in float64 is replaced by a parameter-free stand-in (``Opaque``: a fixed non-linear function of all its
   floating inputs with the shapes of its recorded output). Both are an ``opaque`` op to the block finders, so
   a law needing to know what reads a value (a gain, an MLP, a translation law) is declined where one of them
   reads it; the parameters inside them are not part of the whole graph's laws. The rest of the model is
   detected and checked as usual (``graph.detect_on``).
3. Each opaque module, or, when the model's own forward is what fails, each child holding parameters (the
   modules of a ``ModuleList`` / ``ModuleDict`` one by one), is detected on its own: ``detect_graph`` on the
   module with the input it received in step 1 (floats made float64), recursively (depth <= 4), laws and
   declines named under its path. A module that still yields nothing is declined by name with the reason.
4. A module (not the model itself) whose own forward branches on data (Mixtral's expert loop: ``torch.where``,
   ``if tok.numel()``) and runs in float64 is first traced with real tensors (``specialised``: ``make_fx``, the
   branches the example input takes), provided that input reaches every parameter of the module (else a value's
   readers could be missed); the laws found there are checked again on graphs specialised to three other random
   inputs (other routings, other branches) and a law failing any of them is declined. A branch on a value read
   with ``item()`` (``if x.sum() > 0``) cannot be traced even so: its children are analysed one by one.
5. A block analysed as one graph of its own also says what reads each of its positional inputs
   (``match.gain.input_readers``: the linear maps reading its features one to one, e.g. a routed MoE's router and
   every expert's gate and up, or why something else does), into the parent's ``Collector.input_readers`` under
   the block's path; what reads an input on the other routings of step 4 must be among them. A gain in front of
   an opaque block that runs its own code takes those maps as readers (``match.gain``); where the example input
   routes no token to an expert, that expert's columns are unknown and the gain is declined naming it. That law is
   checked on the parent's graph, whose opaque call runs the block's own forward with the block's parameters
   (parameters of the graph module's submodule, substituted and differentiated by the check like any other).

Every law claimed passes the first-order check of the graph it was found in (the whole model with stand-ins, or
the block alone). A law of a block alone holds for the model because the block's function is unchanged by the
law's symmetry for every input and the model reads the block's parameters only through it (step 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from ..laws import Declined
from ..laws.tolerance import TOL
from .check import check_laws
from .core import Collector, Detection, prefixed
from .fxgraph import Graph
from .match.gain import Unknown, input_readers
from .ongraph import detect_on, param_modules
from .probe import make_probe, no_cache, synth_inputs
from .rewrite import baddbmm_to_matmul, casts_to_float64, einsum_to_matmul
from .torchnn import layer_index
from .trace import TraceError, reproduces, trace

MAX_DEPTH = 4
MAX_OPAQUE = 12


def short_error(e: BaseException | str, n: int = 240) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s if len(s) <= n else s[: n - 3] + "..."


class Opaque(nn.Module):
    """Stand-in for a module that cannot run in float64: no parameters; each floating output, with the shape the
    module's output had in the concrete forward, is ``tanh`` of the input of that shape (else a constant) times
    ``1 + tanh(s)``, ``s`` the sum of ``mean(tanh(x))`` over every floating input x: every input reaches every
    output through a non-linear function, so no block finder takes the stand-in for a linear or index map."""

    _conserve_opaque = True

    def __init__(self, template):
        super().__init__()
        self.template = template

    def forward(self, *args, **kwargs):
        xs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        s = sum(torch.tanh(x.to(torch.float64)).mean() for x in xs) if xs else torch.zeros((), dtype=torch.float64)
        scale = 1 + torch.tanh(s)

        def fill(t):
            if not isinstance(t, torch.Tensor):
                return t
            if not t.is_floating_point():
                return t.clone()
            for x in xs:
                if tuple(x.shape) == tuple(t.shape):
                    return torch.tanh(x.to(torch.float64)) * scale
            return torch.full(tuple(t.shape), 0.5, dtype=torch.float64) * scale

        return tree_map(fill, self.template)


@dataclasses.dataclass
class Record:
    """One concrete forward: first ``(args, kwargs)`` and output per module path, and for every parameter name
    the module stacks (tuples of paths) that were running when a torch call read it."""

    calls: dict
    outs: dict
    reads: dict

    def outside(self, block: str, names) -> list[str]:
        """Parameters among ``names`` (full names) read at least once while ``block`` was not running."""
        return [k for k in names if any(block not in st for st in self.reads.get(k, ()))]


def _detached(tree):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def tree_to_float64(tree):
    """Floating tensors float64, complex ones complex128, all on CPU (the probe's inputs); a tensor recorded under
    ``torch.inference_mode`` (a forward decorated with it) is copied out of it, so that autograd can save it."""

    def cast(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach().cpu()
        if t.is_inference():
            t = t.clone()
        if t.is_floating_point():
            return t.to(torch.float64)
        if t.is_complex():
            return t.to(torch.complex128)
        return t

    return tree_map(cast, tree)


class Reads(TorchFunctionMode):
    """Which modules run (``stack``) when each parameter is read (``reads``: name -> set of stacks). With ``ops``:
    also, per unit path of ``units`` on the stack (not in ``paused``), the sequence of torch calls made there
    (function, argument shapes and dtypes, scalar arguments): what ``large`` groups blocks by."""

    def __init__(self, names: dict, stack: list, reads: dict, units=(), ops: dict | None = None,
                 paused: set | None = None):
        super().__init__()
        self.names, self.stack, self.reads = names, stack, reads
        self.units, self.ops, self.paused = set(units), ops, paused if paused is not None else set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        for a in leaves:
            if isinstance(a, nn.Parameter) and id(a) in self.names:
                for k in self.names[id(a)]:
                    self.reads.setdefault(k, set()).add(tuple(self.stack))
        if self.ops is not None:
            unit = next((p for p in self.stack if p in self.units), None)
            if unit is not None and unit not in self.paused:
                self.ops.setdefault(unit, []).append((getattr(func, "__qualname__", None) or repr(func), tuple(
                    (tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else
                    (repr(a) if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a).__name__)
                    for a in leaves)))
        return func(*args, **kwargs)


def record(model: nn.Module, example_inputs, forward_kwargs: dict | None, units=(), ops: dict | None = None
           ) -> tuple[Record, tuple, dict]:
    """Step 1 of the module docstring. Returns the record and the inputs it ran on (the model's dtype). ``units`` /
    ``ops``: the torch calls made under each of these module paths, recorded into ``ops`` (``Reads``)."""
    p0 = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = p0.dtype if p0 is not None else torch.float32
    device = p0.device if p0 is not None else torch.device("cpu")
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        raise ValueError("the model is on the meta device: no concrete forward can run (build it on CPU)")
    kwargs = {k: (v.detach().to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v) for k, v in (forward_kwargs or {}).items()}
    no_cache(model, kwargs, example_inputs)
    inputs = synth_inputs(model, example_inputs, kwargs, dtype=dtype, device=device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    rec = Record({}, {}, {})
    names: dict = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(k)
    stack: list = []
    handles = []
    paths = {id(m): path for path, m in model.named_modules()}

    def pre(m, args, kw):
        path = paths.get(id(m))
        stack.append(path)
        if path not in rec.calls:
            rec.calls[path] = _detached((args, kw))

    def post(m, args, kw, out):
        path = paths.get(id(m))
        if stack and stack[-1] == path:
            stack.pop()
        if path not in rec.outs:
            rec.outs[path] = _detached(out)

    for path, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    was = model.training
    try:
        model.eval()
        with torch.no_grad(), Reads(names, stack, rec.reads, units, ops):
            model(*inputs, **kwargs)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return rec, inputs, kwargs


def failing_module(probe: nn.Module, inputs: tuple, kwargs: dict) -> tuple[str | None, Exception | None]:
    """Run the float64 probe; on an error, the innermost module running when it was raised ("" : the root)."""
    stack: list = []
    handles = []
    paths = {id(m): path for path, m in probe.named_modules()}
    def pre(m, args):
        stack.append(paths.get(id(m)))

    def post(m, args, out):
        if stack:
            stack.pop()

    for m in probe.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad():
            probe(*inputs, **kwargs)
        return None, None
    except Exception as e:  # noqa: BLE001
        return (stack[-1] if stack else ""), e
    finally:
        for h in handles:
            h.remove()


def positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Tensor keyword arguments moved to positions where ``forward``'s signature allows (torch.fx takes tensors
    as positional inputs only; the other keyword arguments are constants of the trace)."""
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return tuple(args), dict(kwargs)
    return tuple(bound.args), dict(bound.kwargs)


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def _under(names, path: str) -> list[str]:
    return [k for k in names if k.startswith(path + ".")]


def by_blocks(model: nn.Module, c: Collector, err: Exception, *, example_inputs, forward_kwargs, loss,
              max_probe_params, skip: set, options: dict, depth: int = 0, detect, check=check_laws) -> Detection:
    """``graph.detect_graph`` when the whole probe cannot be run or traced (module docstring). ``c``: the
    model's collector; ``err``: why the whole model failed; ``detect``: the structural detector a block alone
    goes through (``graph.detect_graph``, which calls this); ``check``: the first-order check (``check_laws``).
    Returns ``c.finish('graph')``."""

    what = "the model" if depth == 0 else "this block"
    whole = f"structural detection could not run on {what} as a whole ({short_error(err, 200)})"
    try:
        rec, x0, kw0 = record(model, example_inputs, forward_kwargs)
    except Exception as e:  # noqa: BLE001 - nothing can be read: one decline per module, naming the fix
        reason = (f"structural detection could not run: {short_error(err, 400)}; a concrete forward to analyse its blocks "
                  f"one by one failed too ({short_error(e)}): pass example_inputs=(...) that forward takes")
        for mod in param_modules(model, skip):
            c.decline(mod, "not analysed", reason)
        return c.finish("graph")
    params = [k for k, _ in model.named_parameters()]
    args64, kw64 = tree_to_float64(positional(model, x0, kw0))
    opaque: dict = {}  # path -> why it is opaque
    g = how = None
    if depth < MAX_DEPTH:
        try:
            probe = make_probe(model, max_probe_params)
            leaves: set = set()
            for _ in range(MAX_OPAQUE):
                path, e = failing_module(probe, args64, kw64)
                if e is not None:
                    if not path or path in opaque or path not in rec.outs:
                        break
                    set_module(probe, path, Opaque(tree_to_float64(rec.outs[path])))
                    opaque[path] = f"cannot run in float64 ({short_error(e)})"
                    leaves.add(path)
                    continue
                try:
                    gm, how = trace(probe, args64, kw64, leaves=leaves)
                    g = Graph(gm, args64, dict(probe.named_parameters(remove_duplicate=False)),
                              kw64 if how == "torch.export" else {})
                    break
                except TraceError as te:
                    cul = te.culprit
                    if not cul or cul in leaves:
                        break
                    opaque[cul] = f"torch.fx cannot trace its forward ({short_error(te)})"
                    leaves.add(cul)
        except Exception:  # noqa: BLE001 - the children are analysed one by one below
            g = None
    sub_opts = {k: v for k, v in options.items() if k not in ("example_inputs", "forward_kwargs", "loss")}
    if g is None and not opaque and depth > 0:  # a block whose own forward branches on values: specialise it
        try:
            probe = make_probe(model, max_probe_params)
            gm = specialised(probe, args64, kw64, every=True)
            g, how = Graph(gm, args64, dict(probe.named_parameters(remove_duplicate=False))), "specialised"
        except Exception as e:  # noqa: BLE001 - the children are analysed one by one below
            whole += f"; specialised to the example input's control flow: {short_error(e)}"
            g = None
            why = Unknown(f"the probe input reaches no parameter of {e.modules} (no token is routed to them, e.g. an "
                          "expert), so which columns of this input they read is not known (example_inputs=(...) whose "
                          "routing reaches every expert would show them)" if isinstance(e, Unreached) else
                          f"its own graph, which would say what reads this input, could not be traced "
                          f"({short_error(e)})")
            for i, a in enumerate(args64):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    c.input_readers[("", i)] = why
        if g is not None:
            record_input_readers(g, c)
            d = detect_on(g, c, model, "specialised torch.fx (real tensors)", skip, check)
            return _recheck(d, probe, args64, kw64, loss, check=check)
    if g is not None:  # (no opaque module: the whole model runs on the concrete input where synthesis failed)
        for path, why in opaque.items():
            _one_block(model, c, rec, path, f"{path}: {why}", skip, max_probe_params, sub_opts, depth, detect, check,
                       declare=why)
        if depth > 0:
            record_input_readers(g, c)
        inner = {k for p in opaque for k in _under(params, p)}
        d = detect_on(g, c, model, how, skip | inner, check)
        # a gated MLP's gate declined inside an opaque block ("nothing else reads it with a law") that a law of this
        # graph reads (the gain law whose readers include the block's gates): no decline, as in a traced graph
        read = {p for law in d.laws for p in law.params}
        d.declined = [x for x in d.declined if not (x.block == "gated MLP gate" and any(
            p.startswith(x.module + ".") for p in read))]
        return d
    # the model's own forward is what fails (or nothing made it traceable): each child on its own
    own = [name for name, _ in model.named_parameters(recurse=False) if name not in skip]
    note = f"{whole}; its submodules holding parameters are analysed one by one"
    if own:
        note += f"; its own parameters {own} are read by that forward itself: no law"
    # one decline for the forward ("": the block's own path in its parent; "<forward>": the model's)
    c.declined.append(Declined("<forward>" if depth == 0 else "", "forward", note))
    c.know(*own)
    short = f"the {'model' if depth == 0 else 'block holding it'} cannot be traced as a whole"
    for path in _children(model, rec, ""):
        _one_block(model, c, rec, path, short, skip, max_probe_params, sub_opts, depth, detect, check)
    return c.finish("graph")


class Unreached(ValueError):
    """The example input reaches no parameter of ``modules`` (the largest submodules all of whose parameters it
    leaves unread: an expert no token is routed to); ``params``: those parameters."""

    def __init__(self, params: list, modules: list):
        super().__init__(f"the example input does not reach {params[:3]} (e.g. an expert no token is routed to): "
                         "a value's readers would be missed")
        self.params, self.modules = params, modules


def _unreached(names: list, unused: list) -> list:
    """The largest submodules (else the parameters) all of whose parameters are in ``unused``."""
    out = []
    for k in unused:
        parts, owner = k.split("."), k
        for j in range(1, len(parts)):
            p = ".".join(parts[:j])
            if all(q in unused for q in names if q.startswith(p + ".")):
                owner = p
                break
        if owner not in out:
            out.append(owner)
    return out


def record_input_readers(g: Graph, c: Collector) -> None:
    """``c.input_readers`` of the block whose own graph is ``g`` (its positional inputs, under the path "")."""
    try:
        c.input_readers.update({("", i): r for i, r in input_readers(g, c).items()})
    except Exception as e:  # noqa: BLE001 - a gain in front of the block is then declined with the reason
        for i, a in enumerate(g.inputs):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                c.input_readers[("", i)] = Unknown(f"what reads this input in its own graph could not be found "
                                                   f"({short_error(e)})")


@contextlib.contextmanager
def _modules_indexed_by_tensors():
    """Within the block, ``ModuleList[t]`` for an integer tensor ``t`` of one element (HF Mixtral's loop over the
    experts hit, ``self.experts[expert_idx]``) takes ``t``'s value as it is on the traced input (a specialised
    trace fixes the control flow anyway) instead of failing on ``item()`` inside ``make_fx``."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    orig = nn.ModuleList.__getitem__

    def getitem(self, idx):
        if isinstance(idx, torch.Tensor) and idx.numel() == 1 and not idx.is_floating_point():
            with disable_proxy_modes_tracing():
                idx = int(idx.reshape(()))
        return orig(self, idx)

    nn.ModuleList.__getitem__ = getitem
    try:
        yield
    finally:
        nn.ModuleList.__getitem__ = orig


def specialised(probe: nn.Module, inputs: tuple, kwargs: dict, every: bool = False):
    """The probe traced with real tensors (``make_fx``, pre-dispatch): Python control flow that depends on values
    (a routed expert loop) runs as it does for ``inputs``, so the graph is the function at and near them (the
    branch taken is locally constant). Parameters become ``get_attr`` nodes under their names. ``every``: raise
    ``Unreached`` unless the input reaches every parameter (a law reading a value must see every reader of it)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import functional_call
    from torch import fx


    named = dict(probe.named_parameters())
    names = list(named)

    def run(ps, *args):
        return functional_call(probe, dict(zip(names, ps)), args, kwargs)

    # traced with grad enabled, as training runs it: a ``torch.no_grad()`` region of the model's code (a router's
    # top-k) is recorded as switching grad off and back ON (traced under no_grad, its exit would restore "off")
    with torch.enable_grad(), _modules_indexed_by_tensors():
        gm0 = make_fx(run, tracing_mode="real", pre_dispatch=True)([named[k] for k in names], *inputs)
    graph = gm0.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    root: dict = {n.target: getattr(gm0, n.target) for n in graph.nodes if n.op == "get_attr"}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with warnings.catch_warnings():  # (the attributes are on the GraphModule built below, not yet on make_fx's)
        warnings.simplefilter("ignore")
        for k, ph in zip(names, phs):
            with graph.inserting_before(first):
                ga = graph.get_attr(k)
            ph.replace_all_uses_with(ga)
            graph.erase_node(ph)
            root[k] = named[k]
    unused = [k for k in names if not any(n.op == "get_attr" and n.target == k and n.users for n in graph.nodes)]
    if every and unused:
        raise Unreached(unused, _unreached(names, unused))
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs (make_fx's pytree codegen expects (params, *inputs))
    gm = fx.GraphModule(root, graph)
    gm._conserve_opaque = frozenset()
    einsum_to_matmul(gm)
    baddbmm_to_matmul(gm)
    casts_to_float64(gm)
    reproduces(probe, gm, inputs, kwargs)
    return gm


def _recheck(d: Detection, probe: nn.Module, inputs: tuple, kwargs: dict, loss, n: int = 3, check=check_laws
             ) -> Detection:
    """Laws found on a graph specialised to one input's control flow, checked again (spec check 1) on graphs
    specialised to ``n`` other random inputs of the same shapes (other branches: other experts, other tokens)
    and to two inputs whose tokens are all one token (every token routed alike: experts over their capacity drop
    tokens, branches no random input takes); a law failing any of them is declined. The readers of each input (``d.input_readers``) are found again on each
    of those graphs: where something else reads the input there, or a linear map not seen on the example input's
    routing, they are replaced by the reason."""
    gen = torch.Generator().manual_seed(11)
    bad: dict = {}
    known = {k: set(v) for k, v in d.input_readers.items() if k[0] == "" and not isinstance(v, str)}

    def other(t):
        if not isinstance(t, torch.Tensor) or t.is_complex():
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=t.dtype) * (t.std() if t.numel() > 1 else 1.0)
        if t.dtype == torch.bool:
            return t
        hi = int(t.max()) + 1 if t.numel() else 1
        return torch.randint(0, max(hi, 1), t.shape, generator=gen, dtype=t.dtype)

    def alike(t, k):
        """Every token (every row of the last dim; every id) equal to token ``k`` of ``t``."""
        if not isinstance(t, torch.Tensor) or t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
            return t
        if t.is_floating_point():
            rows = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
            return rows[k % rows.shape[0]].expand(rows.shape).reshape(t.shape).clone()
        return torch.full_like(t, int(t.reshape(-1)[k % t.numel()]))

    variants = [lambda: tree_map(other, inputs) for _ in range(n)]
    variants += [lambda k=k: tree_map(lambda t: alike(t, k), inputs) for k in (0, 1)]
    for make in variants:
        xs = make()
        try:
            gm = specialised(probe, xs, kwargs)
            g = Graph(gm, xs, dict(probe.named_parameters(remove_duplicate=False)))
            viol = check(g, d.laws, {})
        except Exception:  # noqa: BLE001 - this input does not run: it checks nothing
            continue
        again = None  # input_readers of this graph, found once
        for (p, i), refs in known.items():
            if isinstance(d.input_readers[(p, i)], str):
                continue
            if again is None:
                try:
                    again = input_readers(g, Collector(probe))
                except Exception as e:  # noqa: BLE001 - what reads the inputs on this routing cannot be told
                    again = e
            got = again.get(i) if isinstance(again, dict) else Unknown(
                f"what reads its input {i} could not be found ({short_error(again)})")
            if got is None:
                continue
            if isinstance(got, str):
                d.input_readers[(p, i)] = type(got)(f"on another input's routing, {got}")
            elif not set(got) <= refs:
                new = sorted({r.param for r in set(got) - refs})
                d.input_readers[(p, i)] = Unknown(f"on another input's routing, {new} read its input {i}, which the "
                                                  "example input's routing does not show")
        for law in d.laws:
            v = viol.get(law.name, 0.0)
            if v == v and v > TOL:
                bad[law.name] = max(bad.get(law.name, 0.0), v)
    if bad:
        d.declined += [Declined(law.name, f"{law.family} law (specialised graph)",
                                f"holds where the example input's control flow goes, but fails the first-order check "
                                f"on another input's (relative violation {bad[law.name]:.2e}): not claimed")
                       for law in d.laws if law.name in bad]
        d.laws = [law for law in d.laws if law.name not in bad]
    return d


def _children(model: nn.Module, rec: Record, prefix: str) -> list[str]:
    out = []
    for name, ch in model.named_children():
        path = prefix + name
        if not any(True for _ in ch.parameters()):
            continue
        if path in rec.calls or not any(True for _ in ch.children()):
            out.append(path)
        else:  # a container (ModuleList / ModuleDict) or a module the forward does not call: its children
            out += _children(ch, rec, path + ".")
    return out


def add_block_laws(c: Collector, d: Detection, path: str, outside: set, skip=frozenset()) -> int:
    """Add the laws ``d`` found on the block at ``path`` alone to ``c``, named under ``path`` (their layer from it);
    a law reading a parameter the model also reads outside the block's forward (``outside``) is declined, one
    reading only parameters in ``skip`` left out.  Returns how many were added."""
    kept = 0
    for law in d.laws:
        law = prefixed(law, path + ".")
        if skip and set(law.params) <= skip:
            continue
        law = dataclasses.replace(law, layer=layer_index(path) if law.layer is None else law.layer)
        bad = [p for p in law.params if p in outside]
        if bad:
            c.decline(law.name, f"{law.family} law (block alone)",
                      f"holds for {path} alone, but the model also reads {bad[:3]} outside {path}'s forward: that use "
                      "breaks the law's symmetry: not claimed")
            continue
        c.add(law)
        kept += 1
    return kept


def _one_block(model: nn.Module, c: Collector, rec: Record, path: str, context: str, skip: set, max_probe_params,
               options: dict, depth: int, detect, check, declare: str | None = None) -> None:
    """Detect ``path`` alone on the input it got in the concrete forward; merge its laws and declines into ``c``
    under its path (``detect``: ``graph.detect_graph``, with ``check``). ``declare``: why the block is opaque in its
    parent's graph (declined by name with it)."""
    block = model.get_submodule(path)
    names = _under([k for k, _ in model.named_parameters()], path)
    if path not in rec.calls:
        c.decline(path, type(block).__name__, f"{context}; not called by the model's forward on the example input: "
                                              "not analysed")
        return
    if depth + 1 > MAX_DEPTH:
        c.decline(path, type(block).__name__, f"{context}; nested too deep to analyse further: no law")
        return
    args, kwargs = rec.calls[path]
    args, kwargs = tree_to_float64(positional(block, args, kwargs))
    inner_skip = [k[len(path) + 1:] for k in names if k in skip]
    try:
        d = detect(block, args, forward_kwargs=kwargs, loss=None, max_probe_params=max_probe_params,
                   skip_params=inner_skip, _depth=depth + 1, check=check, **options)
    except Exception as e:  # noqa: BLE001
        c.decline(path, type(block).__name__, f"{context}; analysing it on its own failed ({short_error(e)}): no law")
        return
    kept = add_block_laws(c, d, path, set(rec.outside(path, names)))
    for (p, i), refs in d.input_readers.items():  # what reads the block's (and its blocks') inputs, named here
        c.input_readers[(f"{path}.{p}" if p else path, i)] = refs if isinstance(refs, str) else [
            dataclasses.replace(r, param=f"{path}.{r.param}") for r in refs]
    own = ""
    in_laws = {p for law in d.laws for p in law.params}
    for x in d.declined:
        reason, block_ = x.reason, x.block
        if x.block == "output layer":  # the block's output is not the model's: no translation law to consider
            mod_params = [k for k, _ in block.named_parameters()
                          if (k.rsplit(".", 1)[0] if "." in k else "") == x.module]
            if mod_params and all(k in in_laws for k in mod_params):
                continue  # (e.g. the down projection of a unit law)
            reason, block_ = ("a linear map whose output leaves the block (what reads it outside is not seen when "
                              "the block is analysed alone): no law"), "linear"
        if not x.module:  # the block's own forward (and parameters): one decline under its path
            if declare is not None:
                own = f"; {reason}"
            else:
                c.declined.append(Declined(path, block_, reason if x.block == "forward" else
                                           f"{reason} (analysed on its own: {context})"))
            c.know(*[k for k in names if "." not in k[len(path) + 1:]])
            continue
        if declare is None:
            reason = f"{reason} (analysed on its own: {context})"
        c.decline(f"{path}.{x.module}", block_, reason)
    undetected = {f"{path}.{u}" for u in d.undetected}
    for k in names:  # understood by the block's own detection (e.g. an output bias): not undetected here either
        owner = k.rsplit(".", 1)[0]
        if owner not in undetected and not c.covered(k):
            c.know(k)
    if declare is not None:
        c.declined.append(Declined(path, f"opaque block ({type(block).__name__})",
                                   f"{declare}: an opaque function of its inputs in the model's graph (laws that "
                                   f"depend on what reads a value it reads are declined there, but for a gain law "
                                   f"where its own graph showed only linear maps reading that value); its own "
                                   f"parameters analysed on its own: {kept} law(s){own}"))
