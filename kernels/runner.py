"""Launch side of the Triton path (``evaluate`` / ``bilinear`` / ``drift``): every term of a Plan in a
handful of launches.

Per call, for a plan whose tensors all share one dtype (the ``(x dtype, y dtype)`` *group*):

1. ``gram_kernel``   once per Gram size D   (every head, kv group, layer and expert of that D)
2. ``rowcol_kernel`` once                   (every NormTerm / SumTerm region, fused rows+columns)
3. ``gram_finish``   once per D, ``finish_rows`` once, ``gather_rows`` once (small finishing passes)

On CUDA the Gram launches (1, 3a) run on a side stream concurrently with the norm launches (2, 3b).
``drift_triton`` (DRIFT mode): one ``gram_kernel`` pass over old AND new weights per D for the four
Gram pieces of the drift identity + one ``gram_finish`` per D over 4 planes (3 with ``decay=False``:
the decay dots are compiled out; README "DRIFT mode").  ``check_triton`` (CHECK mode, the gradient
check): one ``gram_kernel`` and one ``rowcol_kernel`` pass over weights AND gradients (``checksums.py``).
``config.Config`` selects the fp32 dot
precision (``"ieee"`` / ``"tf32x3"``), the Gram tile cap, the norm pipelining and the stream overlap.

No host synchronisation, no atomics (bitwise deterministic for fixed tensors).  The work tables are
built once per (plan, dtypes/shapes/strides) and re-bound only when ``data_ptr``s change
(``prepare``); see ``launch.py`` / ``tables.py`` for the table layout and ``README.md`` for what is fused.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import launch as L
from .cache import KeyedCache
from .config import Config, check_triton_device, interpreting
from .plan import Plan
from .tables import GRAM_TERM as GT
from .tables import REGION as RG
from .reference import check_drift_inputs, drift_compose, drift_factors

__all__ = ["evaluate_triton", "bilinear_triton", "check_triton", "drift_triton", "prepare_drift_triton", "prepare", "Prepared",
           "clear_cache"]

DRIFT_WARPS = 4  # DRIFT mode (64 x 64 tiles, 4 accumulators): see README "DRIFT mode" for the sm_90 compile

# Prepared plans, keyed on the plan's identity first; a plan's entries are forgotten when it is
# garbage-collected.
_CACHE = KeyedCache(32)
_forget = _CACHE.forget


def _fingerprint(plan: Plan):
    return (len(plan.grams), len(plan.norms), len(plan.sums), plan.vec_size, tuple(sorted(plan.gram_slots.items())))


def _layout_key(ts):
    """Dtypes/shapes/strides/devices of ``ts`` (``None`` allowed for a tensor the plan does not read)."""
    return tuple(None if t is None else (t.dtype, tuple(t.shape), tuple(t.stride()), t.device) for t in ts)


class Prepared:
    """A plan canonicalised for tensors of fixed dtypes/shapes/strides; ``run`` evaluates it.

    Rebinds the device tables (a few small host->device copies) only when the tensors' addresses
    change; parameters updated in place keep their addresses, so the tracker's per-step call costs
    the launches alone.
    """

    def __init__(self, plan: Plan, xs, ys, fp64: bool, cfg: L.Tiles | None = None, drift: bool = False,
                 config: Config | None = None, check: bool = False):
        if len(xs) == 0 and (plan.grams or plan.norms or plan.sums):
            raise ValueError("the plan has terms but no tensors were given")
        given = [t for t in xs if t is not None]
        self.device = given[0].device if given else torch.device("cpu")
        check_triton_device(self.device)
        for i, t in enumerate(list(xs) + list(ys or [])):
            if t is not None and t.device != self.device:
                raise ValueError(f"tensor {i % max(1, len(xs))} is on {t.device}, expected {self.device}; "
                                 "move all tensors to one device")
        self.cfg = cfg or L.Tiles.for_device(self.device, config)
        self.fp64 = fp64
        self.acc = torch.float64 if fp64 else torch.float32
        self.drift = drift
        if drift:  # Gram terms only (DRIFT mode); the vector terms go through ``drift_compose``
            if fp64:
                raise ValueError("the DRIFT mode accumulates in fp32; fp64 drift uses the standalone composition")
            self.st = L.build_drift(plan, xs, ys, self.cfg)
            self.vec_plan = (Plan(norms=list(plan.norms), sums=list(plan.sums), vec_size=plan.vec_size)
                             if plan.norms or plan.sums else None)
            self._a_key = None
        else:
            self.st = L.build(plan, xs, ys, fp64, self.cfg, check=check)
        self.check = check
        self._ptrs = None
        self._static_tables()

    # ---- device tables -------------------------------------------------------------------------
    def _dev(self, a, dtype=torch.int64):
        t = torch.as_tensor(np.asarray(a), dtype=dtype, device="cpu")  # host-built, whatever the default device
        if self.device.type == "cuda" and t.numel():  # staged through pinned memory: no host wait (a pageable copy
            # synchronises its stream, and a side stream still waiting on its fork event with it)
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _static_tables(self):
        st, acc = self.st, self.acc
        self.gram_static = []
        for b in st.gram:
            self.gram_static.append(dict(
                order=self._dev(b.order), groups=self._dev(b.groups),
                launches=[dict(signs=self._dev(l.signs, acc), items=self._dev(l.items)) for l in b.launches]))
        self.norm_static = [dict(shifts=self._dev(l.shifts, acc), items=self._dev(l.items)) for l in st.norm]
        self.finish = self._dev(st.finish)
        self.finish_blocks = self._dev(st.finish_blocks)
        self.csr = (self._dev(st.csr_ptr), self._dev(st.csr_idx), self._dev(st.csr_sgn, acc))
        self.normpart = torch.empty(4 * st.part_plane if st.check else max(1, st.part_size), device=self.device,
                                    dtype=acc)
        # DRIFT: h_new, decay, bil, h_delta planes; CHECK: bilinear form, weight and gradient row norms
        planes = 4 if self.drift else 3 if st.check else 1
        self.part = {b.D: torch.empty(planes * max(1, b.n_items) * b.BT * b.BT, device=self.device, dtype=acc)
                     for b in st.gram}
        # CUDA: the (compute-bound, fp32) Gram launches run on a side stream, concurrently with the
        # (bandwidth-bound) norm launches; Config(overlap=False) serialises them (for comparison).
        self.side = None
        if self.device.type == "cuda" and st.gram and st.norm and self.cfg.overlap:
            self.side = torch.cuda.Stream(self.device)

    def _bind(self, xs, ys):
        ptrs = tuple(0 if t is None else t.data_ptr() for t in list(xs) + list(ys or ()))
        if ptrs == self._ptrs:
            return
        st = self.st
        bases, deltas = {}, {}
        for g in st.groups():
            idx = [int(i) for b in st.gram for l in b.launches if l.group == g for i in l.x_tensor] + \
                  [int(i) for l in st.norm if l.group == g for i in l.x_tensor]
            xb, xd = L.tensor_deltas(xs, idx)
            yb, yd = L.tensor_deltas(ys, idx) if ys is not None else (xb, xd)
            bases[g] = (xb, yb)
            deltas[g] = (xd, yd)
        self.bases = bases
        self.gram_bound = []
        for b in st.gram:
            lb = []
            for l in b.launches:
                xd, yd = deltas[l.group]
                terms = l.terms.copy()
                terms[:, GT.X_OFF] = L.offsets(l.terms[:, GT.X_OFF], l.x_tensor, xd)
                terms[:, GT.Y_OFF] = L.offsets(l.terms[:, GT.Y_OFF], l.y_tensor, yd) if ys is not None else 0
                hint = list(terms[:, GT.X_OFF]) + list(terms[:, GT.Y_OFF])
                for row in terms:  # gram._strides hints the slow stride
                    hint += [row[GT.X_CS], row[GT.Y_CS]] if row[GT.LAYOUT] == 1 else [row[GT.X_RS], row[GT.Y_RS]]
                lb.append((self._dev(terms), self._align(l.group, hint)))
            self.gram_bound.append(lb)
        self.norm_bound = []
        for l in st.norm:
            xd, yd = deltas[l.group]
            regs = l.regions.copy()
            regs[:, RG.X_OFF] = L.offsets(l.regions[:, RG.X_OFF], l.x_tensor, xd)
            regs[:, RG.Y_OFF] = L.offsets(l.regions[:, RG.Y_OFF], l.y_tensor, yd) if ys is not None else 0
            hint = list(regs[:, RG.X_OFF]) + list(regs[:, RG.Y_OFF])
            for row in regs:
                if row[RG.LAYOUT] == 0:
                    hint += [row[RG.SS], row[RG.YSS]]
            self.norm_bound.append((self._dev(regs), self._align(l.group, hint)))
        self._ptrs = ptrs

    def _align(self, group, values) -> int:
        """Power-of-two element alignment shared by every offset/stride the kernel hints with
        ``tl.multiple_of`` and by the base pointers (the hint must be true, so it is computed)."""
        xb, yb = self.bases[group]
        a = L.pow2_divisor(values)
        while a > 1 and (xb.data_ptr() % (a * xb.element_size()) or yb.data_ptr() % (a * yb.element_size())):
            a //= 2
        return a

    # ---- launches ------------------------------------------------------------------------------
    def run(self, xs, ys=None):
        """Evaluate: returns ``(vec, {D: (slots, D, D)})`` in the accumulation dtype."""
        st, acc = self.st, self.acc
        bil = ys is not None
        if bil != st.bilinear or st.check:
            raise ValueError("this prepared plan was built for another mode (evaluate, bilinear or check)")
        self._bind(xs, ys)
        grams = {d: torch.zeros(n, d, d, device=self.device, dtype=acc) for d, n in sorted(st.gram_slots.items())}
        if self.side is not None:
            main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(main)  # inputs, grams and the partial buffers are ready
            with torch.cuda.stream(self.side):
                self._run_gram(grams, bil)
            vec = self._run_norm(bil)
            main.wait_stream(self.side)  # the caller's stream sees finished grams
        else:
            self._run_gram(grams, bil)
            vec = self._run_norm(bil)
        return vec, grams

    def _run_gram(self, grams, bil):
        from .gram import gram_finish, gram_kernel

        st, fp64 = self.st, self.fp64
        for b, bs, lb in zip(st.gram, self.gram_static, self.gram_bound):
            part = self.part[b.D]
            for l, ls, (terms, align) in zip(b.launches, bs["launches"], lb):
                if len(l.items) == 0:
                    continue
                xb, yb = self.bases[l.group]
                gram_kernel[(len(l.items),)](
                    xb, yb, terms, ls["signs"], ls["items"], part[l.item_base * b.BT * b.BT:], ls["signs"], 0,
                    ALIGN=align, **gram_meta(b, l, bil, fp64, self.cfg.precision))
            if len(b.groups):
                gram_finish[(len(b.groups), 1)](part, bs["order"], bs["groups"], grams[b.D], 0, 0,
                                                 D=b.D, BT=b.BT, FP64=fp64, SKIP1=False, num_warps=4)

    # ---- CHECK mode ----------------------------------------------------------------------------
    def run_check(self, xs, ys):
        """The gradient check's one pass over weights ``xs`` and gradients ``ys``: returns ``(vec, grams)``,
        ``vec`` ``(3, vec_size)`` = ``[p, nh2, ng2]`` of the vector terms (``launch._build_norm``) and ``grams``
        ``{D: (3, slots, D, D)}`` = ``[B(x, y), diag(sum_t s_t^2 ||x_t[r]||^2), diag(sum_t ||y_t[r]||^2)]``, in
        the accumulation dtype.  One ``gram_kernel`` (CHECK) per (D, dtype group) and one ``rowcol_kernel``
        (CHECK) per dtype group read each term's view of x and y once; then ``gram_finish`` (3 planes),
        ``finish_rows`` and ``gather_rows``."""
        from .gram import gram_finish, gram_kernel
        from .norms import finish_rows, gather_rows, rowcol_kernel

        st, acc, fp64 = self.st, self.acc, self.fp64
        if not st.check:
            raise ValueError("this prepared plan was not built for the check pass (prepare(..., check=True))")
        self._bind(xs, ys)
        grams = {d: torch.zeros(3, n, d, d, device=self.device, dtype=acc) for d, n in sorted(st.gram_slots.items())}
        for b, bs, lb in zip(st.gram, self.gram_static, self.gram_bound):
            part = self.part[b.D]
            plane = max(1, b.n_items) * b.BT * b.BT
            for l, ls, (terms, align) in zip(b.launches, bs["launches"], lb):
                if len(l.items) == 0:
                    continue
                xb, yb = self.bases[l.group]
                gram_kernel[(len(l.items),)](
                    xb, yb, terms, ls["signs"], ls["items"], part[l.item_base * b.BT * b.BT:], ls["signs"], plane,
                    ALIGN=align, **gram_meta(b, l, True, fp64, self.cfg.precision, check=True))
            if len(b.groups):
                gram_finish[(len(b.groups), 3)](part, bs["order"], bs["groups"], grams[b.D], plane,
                                                 grams[b.D][0].numel(), D=b.D, BT=b.BT, FP64=fp64, SKIP1=False,
                                                 num_warps=4)
        elem = torch.zeros(4 * st.elem_plane, device=self.device, dtype=acc)
        for l, ls, (regs, align) in zip(st.norm, self.norm_static, self.norm_bound):
            if len(l.items) == 0:
                continue
            xb, yb = self.bases[l.group]
            rowcol_kernel[(len(l.items),)](xb, yb, regs, ls["shifts"], ls["items"], self.normpart, st.part_plane,
                                            BS=self.cfg.BS, BF=l.BF, ALIGN=align, BILINEAR=True, FP64=fp64,
                                            STAGES=self.cfg.norm_stages, CHECK=True, num_warps=l.warps)
        if len(st.finish_blocks):
            finish_rows[(len(st.finish_blocks),)](self.normpart, self.finish, self.finish_blocks, elem,
                                                   RB=8, BC=L.FIN_BC, FP64=fp64, num_warps=4)
        n_out = 3 * st.vec_size
        vec = torch.zeros(n_out, device=self.device, dtype=acc)
        if n_out:
            BO = 128
            ptr, idx, sgn = self.csr
            gather_rows[(-(-n_out // BO),)](elem, ptr, idx, sgn, vec, n_out, st.max_count, BO=BO, FP64=fp64,
                                            num_warps=4)
        return vec.view(3, st.vec_size), grams

    # ---- DRIFT mode ----------------------------------------------------------------------------
    def _factors(self, a):
        """Device table of per-term ``[a_t, sign_t*(a_t^2-1)]`` (fp32) per launch and its DECAY flag;
        re-sent only when ``a`` changes (one small host->device copy per step under an lr schedule)."""
        key = tuple(a)
        if key != self._a_key:
            fs, flags = [], []
            for b in self.st.gram:
                for l in b.launches:
                    f, decay = L.launch_factors(l, a)
                    fs.append(f)
                    flags.append(decay)
            allf = self._dev(np.concatenate(fs + [np.zeros((1, 2))]), torch.float32)
            out, i = [], 0
            for f, decay in zip(fs, flags):
                out.append((allf[i:], decay))
                i += len(f)
            self._fac, self._a_key = out, key
        return self._fac

    def run_drift(self, olds, news, a, decay: bool = True):
        """DRIFT pass: ``[h_new, decay, bil, h_delta]`` Gram dicts ``{D: (slots, D, D)}`` in fp32 (one
        ``gram_kernel`` launch per (D, dtype group) + one ``gram_finish`` per D).  ``decay=False``:
        the decay dots, stores and finishing plane are compiled out / not launched (DECAY constexpr)
        and its entry is None; with ``decay`` and every ``a_t == 1`` of a launch, the same (zeros)."""
        from .gram import gram_finish, gram_kernel

        st = self.st
        self._bind(olds, news)
        fac = self._factors(a)
        out = {d: torch.zeros(4, n, d, d, device=self.device, dtype=torch.float32)
               for d, n in sorted(st.gram_slots.items())}
        i = 0
        for b, bs, lb in zip(st.gram, self.gram_static, self.gram_bound):
            part = self.part[b.D]
            plane = max(1, b.n_items) * b.BT * b.BT
            flags = [decay and fl for _, fl in fac[i:i + len(b.launches)]]
            bucket_decay = any(flags)  # the finishing pass reads the decay plane of every item
            for l, ls, (terms, align), (f, _), dec in zip(b.launches, bs["launches"], lb, fac[i:], flags):
                if len(l.items) == 0:
                    continue
                xb, yb = self.bases[l.group]
                if bucket_decay and not dec:  # these items store no decay partial: zeros
                    part[plane + l.item_base * b.BT * b.BT: plane + (l.item_base + len(l.items)) * b.BT * b.BT].zero_()
                # Config.drift_programs: consecutive launches of at most that many programs (a program
                # reads its item row and writes its partial tile by program id: slices of both)
                n = len(l.items)
                cap = self.cfg.drift_programs or n
                for s0 in range(0, n, cap):
                    gram_kernel[(min(cap, n - s0),)](
                        xb, yb, terms, ls["signs"], ls["items"][s0:], part[(l.item_base + s0) * b.BT * b.BT:], f,
                        plane, ALIGN=align, **gram_meta(b, l, True, False, self.cfg.precision, drift=True, decay=dec))
            i += len(b.launches)
            if len(b.groups):  # planes h_new, [decay], bil, h_delta
                gram_finish[(len(b.groups), 4 if bucket_decay else 3)](
                    part, bs["order"], bs["groups"], out[b.D], plane, out[b.D][0].numel(), D=b.D, BT=b.BT,
                    FP64=False, SKIP1=not bucket_decay, num_warps=4)
        res = [{d: g[p] for d, g in out.items()} for p in range(4)]
        if not decay:
            res[1] = None
        return res

    def _run_norm(self, bil):
        from .norms import finish_rows, gather_rows, rowcol_kernel

        st, acc, fp64 = self.st, self.acc, self.fp64
        elem = torch.empty(max(1, st.elem_size), device=self.device, dtype=acc)
        for l, ls, (regs, align) in zip(st.norm, self.norm_static, self.norm_bound):
            if len(l.items) == 0:
                continue
            xb, yb = self.bases[l.group]
            rowcol_kernel[(len(l.items),)](xb, yb, regs, ls["shifts"], ls["items"], self.normpart, 16,
                                            BS=self.cfg.BS, BF=l.BF, ALIGN=align, BILINEAR=bil,
                                            FP64=fp64, STAGES=self.cfg.norm_stages, num_warps=l.warps)
        if len(st.finish_blocks):
            finish_rows[(len(st.finish_blocks),)](self.normpart, self.finish, self.finish_blocks, elem,
                                                   RB=8, BC=L.FIN_BC, FP64=fp64, num_warps=4)
        vec = torch.empty(st.vec_size, device=self.device, dtype=acc)
        if st.vec_size:
            BO = 128
            ptr, idx, sgn = self.csr
            gather_rows[(-(-st.vec_size // BO),)](elem, ptr, idx, sgn, vec, st.vec_size, st.max_count, BO=BO,
                                              FP64=fp64, num_warps=4)
        return vec


def _upcast(group, interpret: bool | None = None) -> bool:
    """fp32 dots for bf16 tiles under the interpreter (its dot multiplies raw bits; ``interpret``: None
    asks ``TRITON_INTERPRET``), mixed x/y dtypes and fp64 inputs (of an fp32 accumulation: ``tl.dot``
    compiles no fp64 operands into an fp32 accumulator; fp64 accumulation never reaches ``tl.dot``,
    ``gram._fp64_term``)."""
    interpret = interpreting() if interpret is None else interpret
    return (interpret and torch.bfloat16 in group) or group[0] != group[1] or torch.float64 in group


def gram_meta(b: L.GramBucket, l: L.GramLaunch, bil: bool, fp64: bool, precision: str, drift: bool = False,
              decay: bool = False, interpret: bool | None = None, check: bool = False) -> dict:
    """Constexprs, ``num_warps`` (and ``num_stages`` where it is not the default) of the ``gram.gram_kernel``
    launch of ``l`` (bucket ``b``) except ``ALIGN``, which depends on the bound addresses: evaluate/bilinear
    (``bil``), the gradient check's pass (``check``) or the DRIFT pass (``drift``; ``decay``: its DECAY).
    ``interpret`` as in ``_upcast`` (False: what a GPU compiles; tests/test_gram_sm90_pipeline.py compiles
    these for sm_90).

    The CHECK pass with half-precision tiles is not software-pipelined (``num_stages=1``): its diagonal tiles
    feed both the tensor-core dots and the row norms in registers, and with that second use the sm_90
    pipeliner (triton 3.6, 3.8) gives the cp.async ring 2 buffers for 2 prefetched blocks while a wgmma still
    reads one (tests/test_gram_sm90_pipeline.py)."""
    meta = dict(D=b.D, BT=b.BT, BK=l.BK, SINGLE=l.single, FOLD=l.fold, UPCAST=_upcast(l.group, interpret),
                PREC=precision)
    if drift:
        return dict(meta, BILINEAR=True, FP64=False, DRIFT=True, DECAY=decay, num_warps=DRIFT_WARPS)
    meta = dict(meta, BILINEAR=bil or check, FP64=fp64, num_warps=8 if b.BT >= 128 else 4)
    if check:
        meta["CHECK"] = True
        if not fp64 and {torch.bfloat16, torch.float16} & set(l.group):
            meta["num_stages"] = 1
    return meta


def clear_cache():
    """Forget every prepared plan (needed only after mutating a Plan that was already evaluated)."""
    _CACHE.clear()


def prepare(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor] | None = None, *,
            fp64: bool = False, drift: bool = False, config: Config | None = None, check: bool = False) -> Prepared:
    """The cached ``Prepared`` for this plan object, these tensors' dtypes/shapes/strides/device and
    ``config`` (default ``Config()``).

    Keyed on the plan's identity (plus a fingerprint of its sizes) -- a Plan must not be edited after
    its first evaluation (``clear_cache()`` if it is).  ``ys``: the second argument of ``bilinear``
    (``drift``: ``xs`` old and ``ys`` new weights, DRIFT mode; ``check``: ``xs`` weights and ``ys`` gradients,
    the gradient check's one pass).
    """
    config = config or Config()
    key = (id(plan), _fingerprint(plan), ys is not None, fp64, drift, check, config, _layout_key(xs),
           _layout_key(ys) if ys is not None else None)
    return _CACHE.cached(key, lambda: Prepared(plan, xs, ys, fp64, drift=drift, config=config, check=check),
                         owner=plan)


def evaluate_triton(plan: Plan, tensors: Sequence[torch.Tensor], fp64: bool = False, config: Config | None = None):
    """Triton twin of ``reference.evaluate_reference``: ``(vec (vec_size,), {D: (slots, D, D)})`` in fp32
    (fp64 if ``fp64``), for fp32/bf16/fp16 tensors of any strides, on CUDA (or CPU under the
    interpreter).  Raises ``ValueError`` for views outside their tensor or unreserved slots/entries."""
    tensors = list(tensors)
    return prepare(plan, tensors, fp64=fp64, config=config).run(tensors)


def bilinear_triton(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], fp64: bool = False,
                    config: Config | None = None):
    """Triton twin of ``reference.bilinear_reference``: Gram ``sign*(X Y^T + Y X^T)/2``, Norm
    ``sign*sum X*Y`` (shift must be 0), Sum terms 0.  ``xs[i]`` and ``ys[i]`` must have equal shapes."""
    xs, ys = list(xs), list(ys)
    return prepare(plan, xs, ys, fp64=fp64, config=config).run(xs, ys)


def check_triton(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], fp64: bool = False,
                 config: Config | None = None):
    """Triton twin of ``check.check_reference``: the gradient check's sums of weights ``xs`` and gradients
    ``ys`` in ONE pass over both (``Prepared.run_check``).  Returns ``(vec (3, vec_size), {D: (3, slots, D,
    D)})`` as ``run_check`` does.  Equal shapes per pair; fp32/bf16/fp16/fp64 tensors, on CUDA (or CPU
    under the interpreter)."""
    xs, ys = list(xs), list(ys)
    return prepare(plan, xs, ys, fp64=fp64, config=config, check=True).run_check(xs, ys)


def drift_triton(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a, fp64: bool = False,
                 decay: bool = True, config: Config | None = None):
    """Triton twin of ``reference.drift_reference``: ``[h_new, decay, bil, h_delta]``, each
    ``(vec, {D: grams})`` (decay None when ``decay=False``).

    Gram terms: ONE pass of ``gram.gram_kernel`` (DRIFT mode) per (D, dtype group) reads each tile of
    old and new weights once and accumulates the Grams (64 x 64 output tiles; decay ``s (a^2-1) O O^T``
    only if ``decay``), + one finishing launch per D.  Vector terms (NormTerm/SumTerm: rare in the
    optimizer's rest plan, e.g. Gemma-shifted gains, unmapped views) and ``fp64=True`` use the
    standalone composition ``reference.drift_compose`` (Triton evaluate/bilinear over materialised
    ``a*old`` and ``Delta``; their decay is the closed form ``reference.decay_reference`` in torch on
    the same device).  CUDA tensors, or CPU under ``TRITON_INTERPRET=1``; fp32/bf16/fp16 inputs.
    Raises ``ValueError`` like ``drift_reference``."""
    olds, news = list(olds), list(news)
    check_drift_inputs(plan, olds, news)
    a = drift_factors(a, len(news))
    acc = torch.float64 if fp64 else torch.float32
    ev = lambda p, xs: evaluate_triton(p, xs, fp64=fp64, config=config)  # noqa: E731
    bl = lambda p, xs, ys: bilinear_triton(p, xs, ys, fp64=fp64, config=config)  # noqa: E731
    if fp64 or not plan.grams:
        return list(drift_compose(plan, olds, news, a, fp64, ev, bl, decay=decay))
    pr = prepare(plan, olds, news, drift=True, config=config)
    grams = pr.run_drift(olds, news, a, decay)
    if pr.vec_plan is not None:
        vecs = [None if r is None else r[0] for r in drift_compose(pr.vec_plan, olds, news, a, False, ev, bl,
                                                                   decay=decay)]
    else:
        vecs = [torch.zeros(plan.vec_size, device=pr.device, dtype=acc) if decay or k != 1 else None
                for k in range(4)]
    return [None if g is None else (v, g) for v, g in zip(vecs, grams)]


def prepare_drift_triton(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], a,
                         fp64: bool = False, config: Config | None = None) -> None:
    """Do now, on the current stream, every host->device copy that ``drift_triton`` with these arguments
    would make: build (first call) the cached DRIFT tables, bind them to these addresses, upload the
    per-term factors of ``a``.  The call that follows (same plan, tensors, ``a`` and ``config``) then
    only allocates its outputs and launches (the copies go through pinned memory, ``Prepared._dev``,
    so they do not wait for the stream either; made here they are also the caller's stream's own
    persistent tables, not side-stream allocations).  Vector terms and
    ``fp64=True`` (``drift_compose`` over fresh ``a old`` / ``Delta`` tensors, re-bound at every call)
    are not covered: their bindings are made in the call.  Raises like ``drift_triton``."""
    olds, news = list(olds), list(news)
    if fp64 or not plan.grams:
        return
    check_drift_inputs(plan, olds, news)
    pr = prepare(plan, olds, news, drift=True, config=config)
    pr._bind(olds, news)
    pr._factors(drift_factors(a, len(news)))
