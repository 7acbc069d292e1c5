"""Host side of the Triton path: the multi-tensor work tables (no Triton import; unit-testable).

``build(plan, xs, ys, fp64, tiles)`` canonicalises every term of a ``Plan`` once into int64
tables (one set per dtype group = ``(x dtype, y dtype)``), like ``multi_tensor_apply``'s address
table, but with *element offsets relative to the group's base tensor* instead of raw pointers: the
kernels receive one base pointer per group and add ``offset + i*stride`` in int64, which works both
compiled and under ``TRITON_INTERPRET=1``.  The pointer-dependent part (the offset columns, the
alignment hint) is re-bound cheaply by ``runner.Prepared._bind`` when the tensors' ``data_ptr`` change;
everything else depends only on the plan and the tensors' dtypes/shapes/strides.

Tables (all int64, row-major; the columns are named in ``tables.py``):

* Gram terms (``tables.GRAM_TERM``), sorted by output slot and, inside a slot, by layout; signs in
  the accumulation dtype.  Items (``GRAM_ITEM``): the slot's term range, a chunk of the contracted
  dim, an upper-triangular output tile.  Finishing groups (``GRAM_GROUP``) index ``order`` (item ids
  of one output tile, across dtype groups, in a fixed order).  DRIFT factors (``FACTOR``, fp32).
* Regions (``REGION``, see ``norms.py``), items (``NORM_ITEM``: one column tile of one row chunk,
  sized by bytes), finishing rows (``FINISH_ROW``) that sum the items' partials into the element
  buffer and their column blocks (``FINISH_BLOCK``), and the CSR gather ``ptr, idx, sgn`` into ``vec``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .config import Config
from .plan import Plan, View, check_dtype
from .tables import FACTOR, FINISH_BLOCK, FINISH_ROW, GRAM_GROUP, GRAM_ITEM, GRAM_TERM, NORM_ITEM, REGION

MAX_ALIGN = 16
FIN_BC = 256  # columns per finishing program (norms.finish_rows)
SM90_SMEM = 232448  # shared memory a program may use on sm_90 (bytes, the opt-in maximum per block)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_divisor(values, cap: int = MAX_ALIGN) -> int:
    """Largest power of two <= ``cap`` dividing every value (0 divides by anything)."""
    a = cap
    for v in values:
        v = int(v)
        while a > 1 and v % a:
            a //= 2
    return a


@dataclass
class Tiles:
    """Block sizes (constexpr), work split and dot precision of one prepared plan.

    ``target_items``: aim for at least this many Gram programs (GPU: 4 per SM).  Norm items: one
    column tile of ``BF`` columns for 4-byte inputs (doubled for 2-byte dtypes, halved for 8-byte ones,
    so a row segment is always ``4*BF`` bytes; narrower for an fp64 accumulation and where a program's
    pipelined row tiles would not fit in ``norm_smem``: ``norm_tile``) times ``slow_rows`` rows if > 0,
    else enough rows to stream ``item_bytes`` if > 0, else the whole region.  ``BS``: rows per loaded tile; ``norm_warps``: warps
    of a norm program for 4-byte inputs (doubled for 2-byte ones).  ``norm_smem``: shared memory a
    program may use (bytes; a GPU's opt-in maximum per block, sm_90: 232,448).  ``BT_FP64``: cap of
    the Gram output tile with fp64 accumulation (GPU: 32; 0: ``BT_MAX``).  ``precision``,
    ``overlap``, ``drift_programs``: ``config.Config``'s ``input_precision``, ``overlap`` and
    ``drift_programs``."""

    target_items: int = 1
    slow_rows: int = 0
    item_bytes: int = 0
    BS: int = 64
    BF: int = 128
    norm_warps: int = 4
    norm_stages: int = 1  # software-pipelined (cp.async) row tiles in flight per norm program
    norm_smem: int = SM90_SMEM
    BK_BIG: int = 32  # contracted block for output tiles of 128
    BK_SMALL: int = 64
    BT_MAX: int = 128
    BT_FP64: int = 0  # Gram output tile cap with fp64 accumulation (0: BT_MAX)
    precision: str = "ieee"  # tl.dot input_precision of fp32 Gram dots
    overlap: bool = True
    drift_programs: int = 0  # cap of programs per DRIFT Gram launch (0: none; runner.Prepared.run_drift)

    @staticmethod
    def for_device(device: torch.device, config: Config | None = None) -> "Tiles":
        """The tiles of ``device`` for the choices of ``config`` (default ``Config()``)."""
        config = config or Config()
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            return Tiles.gpu(props.multi_processor_count, config,
                             getattr(props, "shared_memory_per_block_optin", SM90_SMEM))
        # items of at most 16 row tiles, as a GPU item is (item_bytes): each program's fp32 running sum
        # stays short and the partials are summed in fp64 by finish_rows
        return Tiles(BT_MAX=config.gram_bt, BK_SMALL=16 if config.gram_bt < 128 else Tiles.BK_SMALL,
                     slow_rows=16 * Tiles.BS, precision=config.input_precision, overlap=config.overlap,
                     drift_programs=config.drift_programs)

    @staticmethod
    def gpu(sms: int = 132, config: Config | None = None, smem: int = SM90_SMEM) -> "Tiles":
        """The GPU tiles for a device with ``sms`` multiprocessors (H100/H200: 132) and ``smem`` bytes
        of shared memory per program."""
        config = config or Config()
        # norm tiles [32, 128] fp32 = 16 KiB per load step, one warp per row (32 lanes x one 16-byte
        # vector: the row sums of fused regions are warp shuffles); 256 KiB per item keeps the last
        # wave short.  Norm loads pipelined through shared memory (config.norm_stages, default 3:
        # 16-byte cp.async, several tiles in flight per SM); gram_bt 64 gives D = 128 three 64 x 64
        # tiles (smaller accumulators, 3/4 of the FLOPs).  Both are switches that bench/gpu_check.sh
        # (EXTRA=1) compares (bench/NOTES.md, "Gram tile cap and norm pipelining").  fp64
        # accumulation (a verification mode: rank-1 fp64 updates, gram._fp64_term) takes 32 x 32 Gram
        # tiles: a 64 x 64 fp64 accumulator of a bilinear form spills on sm_90, a 128 x 128 one lives in
        # local memory (bench.compile_launches).
        bt = config.gram_bt
        return Tiles(target_items=4 * sms, item_bytes=256 << 10, BS=32, BF=128, norm_warps=4, BT_MAX=bt, BT_FP64=32,
                     BK_SMALL=16 if bt < 128 else Tiles.BK_SMALL, norm_stages=config.norm_stages, norm_smem=smem,
                     precision=config.input_precision, overlap=config.overlap, drift_programs=config.drift_programs)

    def norm_tile(self, group, bilinear: bool = False, fp64: bool = False, check: bool = False) -> tuple[int, int]:
        """(BF, num_warps) of a norm launch for a (x dtype, y dtype) group (``bilinear``: y is read too;
        ``fp64``: fp64 accumulation): 16-byte vectors per thread (``BF * 4 // esize`` columns), halved
        for an fp64 accumulation of 2- or 4-byte inputs (the fp64 ``[BS, BF]`` accumulator then takes
        the registers of an fp32 one) and for the gradient check's CHECK mode (four accumulators), then
        halved while ``norm_smem_bytes`` exceeds ``norm_smem``."""
        esize = min(torch.empty(0, dtype=d).element_size() for d in group)
        BF, warps = max(1, self.BF * 4 // esize), self.norm_warps * max(1, 4 // esize)
        if fp64 and esize < 8:
            BF //= 2
        if check:
            BF = max(16, BF // 2)
        while BF > 16 and self.norm_smem_bytes(group, bilinear, BF) > self.norm_smem:
            BF //= 2
        return BF, warps

    def norm_smem_bytes(self, group, bilinear: bool, BF: int) -> int:
        """Upper bound of the shared memory of a ``norms.rowcol_kernel`` program with ``[BS, BF]``
        tiles on sm_90 (checked by ``bench.compile_launches``): ``norm_stages - 1`` row tiles of x (and
        y) in flight per streaming loop, each loop with its own buffers; the kernel has three loops (full
        and masked column tile of a contiguous region, strided region), each of which the compiler may
        pipeline for 4- and 8-byte inputs, and only the full-tile one for 2-byte inputs (``cp.async``
        copies 4, 8 or 16 bytes: a masked or strided 2-byte element is loaded directly); plus 1 KiB for
        the reductions."""
        tile = 0
        for d in group[:2 if bilinear else 1]:
            e = torch.empty(0, dtype=d).element_size()
            tile += self.BS * BF * e * (3 if e >= 4 else 1)
        return (max(1, self.norm_stages) - 1) * tile + 1024


def _layout(rows, cols, strides) -> int:
    """0: cs == 1 for every (rs, cs) in ``strides`` (rows strided, columns contiguous); 1: rs == 1;
    2: general.  A dimension of extent <= 1 has no stride to speak of (``_clean`` zeroes it)."""
    if cols > 1 and all(cs == 1 for _, cs in strides):
        return 0
    if rows > 1 and all(rs == 1 for rs, _ in strides):
        return 1
    if cols <= 1:
        return 0
    if rows <= 1:
        return 1
    return 2


def _clean(rows, cols, rs, cs):
    """Strides of extent-1 dimensions are never used: zero them so alignment hints stay true."""
    return (rs if rows > 1 else 0), (cs if cols > 1 else 0)


@dataclass
class GramLaunch:
    """One launch of ``gram_kernel``: bucket ``D``, dtype group ``g``."""

    D: int
    group: tuple
    BT: int
    BK: int
    single: bool
    terms: np.ndarray  # (T, 8) int64, offset columns relative to the tensor (x_tensor/y_tensor below)
    x_tensor: np.ndarray
    y_tensor: np.ndarray
    signs: list
    items: np.ndarray  # (I, 6) int64
    item_base: int  # first item id in the bucket's partial buffer
    fold: bool = False  # signs folded into the dot operands (gram.gram_kernel FOLD)


@dataclass
class GramBucket:
    D: int
    BT: int
    slots: int
    n_items: int
    launches: list
    order: np.ndarray
    groups: np.ndarray  # (G, 5)


@dataclass
class NormLaunch:
    group: tuple
    regions: np.ndarray  # (R, 12)
    x_tensor: np.ndarray
    y_tensor: np.ndarray
    shifts: list
    items: np.ndarray  # (I, 6): region, s_start, s_end, f0, fast_off, slow_off
    BF: int = 128
    warps: int = 4


@dataclass
class Structure:
    """Everything that depends on the plan and on the tensors' dtypes/shapes/strides, not on addresses."""

    bilinear: bool
    fp64: bool
    cfg: Tiles
    vec_size: int
    gram_slots: dict
    check: bool = False  # the gradient check's one pass (``build(check=True)``)
    gram: list = field(default_factory=list)  # GramBucket
    norm: list = field(default_factory=list)  # NormLaunch
    elem_size: int = 0
    part_size: int = 0  # fast + slow partial sums of the norm items
    finish: np.ndarray = None  # (P, 4): part_off, nrows, length, elem_base
    finish_blocks: np.ndarray = None  # (B, 2): finishing row, first column (FIN_BC columns each)
    csr_ptr: np.ndarray = None
    csr_idx: np.ndarray = None
    csr_sgn: list = None
    max_count: int = 0
    part_plane: int = 0  # CHECK: elements between the four planes of the norm partials
    elem_plane: int = 0  # CHECK: elements between the four planes of the element buffer

    def groups(self):
        gs = {l.group for b in self.gram for l in b.launches} | {l.group for l in self.norm}
        return sorted(gs, key=str)


def _check_pair(xs, ys, i: int):
    if ys is not None and tuple(xs[i].shape) != tuple(ys[i].shape):
        raise ValueError(f"bilinear: xs[{i}] has shape {tuple(xs[i].shape)} but ys[{i}] has "
                         f"{tuple(ys[i].shape)}; pass tensors of equal shapes")


def _resolve(view: View, xs, ys):
    if not 0 <= view.tensor < len(xs):
        raise ValueError(f"view {view} names tensor {view.tensor} but {len(xs)} tensors were given")
    _check_pair(xs, ys, view.tensor)
    check_dtype(xs[view.tensor], view.tensor)
    if ys is not None:
        check_dtype(ys[view.tensor], view.tensor)
    xo, xrs, xcs = view.resolve(xs[view.tensor])
    if ys is None:
        return (xo, xrs, xcs), (0, 0, 0)
    return (xo, xrs, xcs), view.resolve(ys[view.tensor])


def _group(xs, ys, i: int):
    return (xs[i].dtype, ys[i].dtype if ys is not None else xs[i].dtype)


def build(plan: Plan, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor] | None, fp64: bool,
          cfg: Tiles, check: bool = False) -> Structure:
    """Canonicalise ``plan`` over tensors of these dtypes/shapes/strides (addresses are bound later).
    ``check`` (with ``ys``: x = weights, y = gradients): the gradient check's one pass
    (``runner.Prepared.run_check``): the Gram tables as for the bilinear form, every NormTerm and SumTerm
    on one region per view (function ignored, shifts kept), four planes of partials and elements, and a
    CSR from them onto ``3 * vec_size`` outputs (``_build_norm``)."""
    bil = ys is not None
    if bil and len(ys) != len(xs):
        raise ValueError(f"bilinear: got {len(xs)} xs but {len(ys)} ys; pass one y per x")
    if check and not bil:
        raise ValueError("the check pass reads weights and gradients: pass ys")
    st = Structure(bilinear=bil, fp64=fp64, cfg=cfg, vec_size=plan.vec_size, gram_slots=dict(plan.gram_slots),
                   check=check)
    _build_gram(st, plan, xs, ys, cfg, bt_max=min(cfg.BT_MAX, cfg.BT_FP64) if fp64 and cfg.BT_FP64 else None)
    _build_norm(st, plan, xs, ys, cfg)
    return st


def gram_bk(cfg: Tiles, BT: int, group, operands: int = 1) -> int:
    """The contracted block of a ``gram_kernel`` launch with ``BT x BT`` output tiles for a (x dtype, y dtype)
    group: ``BK_BIG`` for tiles above 64, else ``BK_SMALL``, narrower where the operand tiles held beside the
    accumulator would spill on sm_90 (``python -m bench.sass --kernels gram``): with 4- or 8-byte inputs, the
    bilinear form (``operands`` 2: four operand tiles) takes at most 32 for tiles of 64 and below, and the
    gradient check's CHECK mode (3: the row norms too) at most 32 there and 16 above."""
    bk = cfg.BK_BIG if BT > 64 else cfg.BK_SMALL
    if operands > 1 and max(torch.empty(0, dtype=d).element_size() for d in group) >= 4:
        bk = min(bk, 32 if BT <= 64 else 16 if operands == 3 else bk)
    return bk


def _build_gram(st: Structure, plan: Plan, xs, ys, cfg: Tiles, bt_max: int | None = None, bk: int | None = None):
    """Gram launches of ``plan`` into ``st.gram``; ``bt_max``/``bk`` override the output tile cap and the
    contracted block (the DRIFT mode's four accumulators need ``BT <= 64``, see ``build_drift``)."""
    by_d = defaultdict(list)
    for t in plan.grams:
        D = t.view.rows
        if D not in plan.gram_slots or not 0 <= t.slot < plan.gram_slots[D]:
            raise ValueError(f"GramTerm slot {t.slot} of size {D} was not reserved with plan.new_gram({D})")
        (xo, xrs, xcs), (yo, yrs, ycs) = _resolve(t.view, xs, ys)
        if D == 0 or t.view.cols == 0 or xs[t.view.tensor].numel() == 0:
            continue
        xrs, xcs = _clean(D, t.view.cols, xrs, xcs)
        yrs, ycs = _clean(D, t.view.cols, yrs, ycs)
        by_d[D].append((t, xo, xrs, xcs, yo, yrs, ycs))
    operands = 1 if ys is None else 3 if st.check else 2
    for D in sorted(by_d):
        BT = min(max(16, next_pow2(D)), bt_max or cfg.BT_MAX)
        NT = -(-D // BT)
        tiles = [(i, j) for i in range(NT) for j in range(i, NT)]
        per_group = defaultdict(list)
        for e in by_d[D]:
            per_group[_group(xs, ys, e[0].view.tensor)].append(e)
        n_out_tiles = len({(e[0].slot,) for e in by_d[D]}) * len(tiles)
        # one program per item: at least target_items (GPU: 4 per SM) items.  In DRIFT mode that is
        # more programs than can be resident at once (a program holds four accumulator tiles, so few
        # fit on an SM): run beside the step kernel
        # (fused optimizers, overlap=True) the launch is sliced by Config.drift_programs instead
        # (runner.Prepared.run_drift; kernels/README.md "Overlap with the step", grid sizing)
        nchunk = max(1, -(-cfg.target_items // max(1, n_out_tiles)))
        launches, item_base = [], 0
        tile_items = defaultdict(list)  # (slot, ti, tj) -> item ids
        for g in sorted(per_group, key=str):
            BK = bk or gram_bk(cfg, BT, g, operands)
            ents = sorted(per_group[g], key=lambda e: e[0].slot)  # stable: plan order inside a slot
            rows, xt, signs = [], [], []
            items = {True: [], False: []}  # diagonal output tiles (ti == tj) / the others
            tags = []  # ((slot, ti, tj), diagonal?, index in its list)
            i = 0
            while i < len(ents):
                slot = ents[i][0].slot
                j = i
                while j < len(ents) and ents[j][0].slot == slot:
                    j += 1
                max_n = max(e[0].view.cols for e in ents[i:j])
                chunk = max(BK, -(-max_n // nchunk))
                chunk = -(-chunk // BK) * BK
                # a slot's terms sorted by layout (stable): the kernel runs one term loop per layout
                # with the layout as a constexpr (a runtime branch keeps the column-block tiles from
                # 16-byte loads, bench/sass.py); items carry the boundaries ta (first layout-1 term)
                # and tb (first layout-2 term)
                lays = [_layout(D, e[0].view.cols, [(e[2], e[3])] + ([(e[5], e[6])] if ys is not None else []))
                        for e in ents[i:j]]
                part = sorted(range(j - i), key=lambda q: lays[q])
                t0 = len(rows)
                ta = t0 + sum(1 for q in lays if q < 1)
                tb = t0 + sum(1 for q in lays if q < 2)
                # the output tiles of one contracted chunk are neighbours: they read the same rows at
                # about the same time (L2 reuse when D spans several tiles); each tile's partials are
                # still summed in k order (``order``), so the results do not depend on this ordering
                for k0 in range(0, max_n, chunk):
                    for (ti, tj) in tiles:
                        d = ti == tj
                        tags.append(((slot, ti, tj), d, len(items[d])))
                        items[d].append(GRAM_ITEM.row(t0=t0, t1=t0 + (j - i), k0=k0, k1=min(k0 + chunk, max_n), ti=ti, tj=tj,
                                                      ta=ta, tb=tb))
                for q in part:
                    (t, xo, xrs, xcs, yo, yrs, ycs) = ents[i + q]
                    rows.append(GRAM_TERM.row(x_off=xo, x_rs=xrs, x_cs=xcs, n=t.view.cols, layout=lays[q], y_off=yo,
                                             y_rs=yrs, y_cs=ycs))
                    xt.append(t.view.tensor)
                    signs.append(float(t.sign))
                i = j
            # sign folded into a half-precision operand must be exact (|sign| == 1); an fp32 operand
            # takes one rounding of sign*x, far below the fp32 accumulation error
            fold = all(abs(v) == 1.0 for v in signs) or all(d == torch.float32 for d in g)
            terms_np = np.asarray(rows, dtype=np.int64).reshape(-1, GRAM_TERM.COLS)
            xt_np = np.asarray(xt, dtype=np.int64)
            # diagonal tiles and the others in separate launches: a diagonal tile (the kernel's SINGLE)
            # loads its row block once and, in DRIFT mode, forms bil with one dot and a transpose
            base_of = {}
            for diag in (True, False):
                if not items[diag]:
                    continue
                base_of[diag] = item_base
                launches.append(GramLaunch(D=D, group=g, BT=BT, BK=BK, single=diag, terms=terms_np, x_tensor=xt_np,
                                           y_tensor=xt_np, signs=signs,
                                           items=np.asarray(items[diag], dtype=np.int64).reshape(-1, GRAM_ITEM.COLS),
                                           item_base=item_base, fold=fold))
                item_base += len(items[diag])
            for key, diag, idx in tags:
                tile_items[key].append(base_of[diag] + idx)
        order, groups = [], []
        for (slot, ti, tj) in sorted(tile_items):
            ids = tile_items[(slot, ti, tj)]
            groups.append(GRAM_GROUP.row(i0=len(order), i1=len(order) + len(ids), slot=slot, ti=ti, tj=tj))
            order.extend(ids)
        st.gram.append(GramBucket(D=D, BT=BT, slots=plan.gram_slots[D], n_items=item_base, launches=launches,
                                  order=np.asarray(order, dtype=np.int64),
                                  groups=np.asarray(groups, dtype=np.int64).reshape(-1, GRAM_GROUP.COLS)))


DRIFT_BT = 64  # DRIFT output tile: 4 fp32 accumulators of 64 x 64 (4 x 128 x 128 would spill)
DRIFT_BK = 16  # DRIFT contracted block: 4-8 operand tiles of [64, BK] live beside the accumulators


def build_drift(plan: Plan, olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], cfg: Tiles) -> Structure:
    """Gram tables of ``plan`` for the DRIFT mode of ``gram.gram_kernel`` (x = ``olds``, y = ``news``):
    ``BT <= DRIFT_BT``, ``BK = DRIFT_BK``, no norm tables (the vector terms go through the standalone
    composition, see ``runner.drift_triton``).  Raises ``ValueError`` for mismatched lists/shapes."""
    if len(olds) != len(news):
        raise ValueError(f"drift: got {len(olds)} old tensors but {len(news)} new ones; pass one old per new")
    st = Structure(bilinear=True, fp64=False, cfg=cfg, vec_size=plan.vec_size, gram_slots=dict(plan.gram_slots))
    _build_gram(st, plan, olds, news, cfg, bt_max=min(DRIFT_BT, cfg.BT_MAX), bk=DRIFT_BK)
    st.finish = np.zeros((0, FINISH_ROW.COLS), dtype=np.int64)
    st.finish_blocks = np.zeros((0, FINISH_BLOCK.COLS), dtype=np.int64)
    st.csr_ptr = np.zeros(plan.vec_size + 1, dtype=np.int64)
    st.csr_idx = np.zeros(0, dtype=np.int64)
    st.csr_sgn = []
    return st


def launch_factors(launch: GramLaunch, a: Sequence[float]) -> tuple[np.ndarray, bool]:
    """Per term ``[a_t, sign_t*(a_t^2 - 1)]`` (float64, the kernel rounds them to fp32 once) of a DRIFT
    launch, ``a`` given per tensor; and whether any ``a_t != 1`` (the DECAY constexpr)."""
    at = np.asarray(a, dtype=np.float64)[launch.x_tensor] if len(launch.x_tensor) else np.zeros(0)
    s = np.asarray(launch.signs, dtype=np.float64)
    f = np.zeros((len(at), FACTOR.COLS))
    f[:, FACTOR.A], f[:, FACTOR.SDEC] = at, s * (at * at - 1.0)
    return f, bool((at != 1.0).any())


def _build_norm(st: Structure, plan: Plan, xs, ys, cfg: Tiles):
    """Regions, items, finishing rows and the CSR of the vector terms into ``st``.  CHECK (``st.check``): one
    region per view whatever its function (the kernel computes ``(x+c) y``, ``(x+c)^2``, ``y^2``, ``y`` for
    all), four planes of partials (``st.part_plane`` apart) and elements (``st.elem_plane``), and the CSR
    onto ``[p | nh2 | ng2]`` (3 x vec_size): a NormTerm ``s sum (x+c)^2`` of entry o gives ``p[o] += 2 s
    sum (x+c) y``, ``nh2[o] += 4 s^2 sum (x+c)^2``, ``ng2[o] += sum y^2``; a SumTerm ``s sum x`` gives ``p[o]
    += s sum y``, ``ng2[o] += sum y^2``."""
    bil = ys is not None
    check = st.check
    terms = [("norm", t) for t in plan.norms] + ([] if bil and not check else [("sum", t) for t in plan.sums])
    regions = {}  # key -> dict(fast=, slow=)
    refs = []  # (out start, out step, n, region key, fast?, pos start, pos step, sign)
    for kind, t in terms:
        v = t.view
        if kind == "norm":
            if bil and not check and t.shift != 0.0:
                raise ValueError("bilinear form of a shifted norm term is not defined; use shift=0")
            if t.index < 0 or (v.rows > 0 and t.index + (v.rows - 1) * t.index_stride >= plan.vec_size) \
                    or (v.rows > 1 and t.index + (v.rows - 1) * t.index_stride < 0):
                raise ValueError(f"NormTerm writes vec[{t.index} + r*{t.index_stride}], r < {v.rows}, "
                                 f"outside vec_size={plan.vec_size}; reserve entries with plan.new_vec")
        else:
            if t.index < 0 or t.index + v.cols > plan.vec_size:
                raise ValueError(f"SumTerm writes vec[{t.index}:{t.index + v.cols}] outside vec_size="
                                 f"{plan.vec_size}; reserve entries with plan.new_vec")
        (xo, xrs, xcs), (yo, yrs, ycs) = _resolve(v, xs, ys)
        R, C = v.rows, v.cols
        if R == 0 or C == 0 or xs[v.tensor].numel() == 0:
            continue
        xrs, xcs = _clean(R, C, xrs, xcs)
        yrs, ycs = _clean(R, C, yrs, ycs)
        strides = [(xrs, xcs)] + ([(yrs, ycs)] if bil else [])
        lay = _layout(R, C, strides)
        if lay == 1:  # rows contiguous: the region is the transpose of the view
            trans, S, F, ss, fs, yss, yfs, lay = True, C, R, xcs, xrs, ycs, yrs, 0
        else:
            trans, S, F, ss, fs, yss, yfs = False, R, C, xrs, xcs, yrs, ycs
        func = 2 if check else 0 if kind == "norm" else 1
        shift = float(t.shift) if kind == "norm" else 0.0
        key = (_group(xs, ys, v.tensor), v.tensor, xo, S, F, ss, fs, lay, func, shift, yo, yss, yfs)
        reg = regions.setdefault(key, dict(fast=False, slow=False))
        # NormTerm reduces over view columns (one output per view row); SumTerm over view rows
        reduce_fast = (kind == "norm") != trans
        reg["fast" if reduce_fast else "slow"] = True
        if kind == "norm":
            refs.append((t.index, t.index_stride, R, key, reduce_fast, 0, 1, float(t.sign), kind))
        else:
            refs.append((t.index, 1, C, key, reduce_fast, 0, 1, float(t.sign), kind))
    remap = _merge_row_regions(regions, bil)
    elem = 0
    part = 0
    finish = []
    per_group = defaultdict(list)
    for key, reg in regions.items():
        if key in remap:
            continue
        per_group[key[0]].append(key)
        S, F = key[3], key[4]
        if reg["fast"]:
            reg["fast_base"] = elem
            elem += S
        else:
            reg["fast_base"] = -1
        if reg["slow"]:
            reg["slow_elem"] = elem
            elem += F
    for g in sorted(per_group, key=str):
        BF, warps = cfg.norm_tile(g, bil, st.fp64, check)
        esize = min(torch.empty(0, dtype=d).element_size() for d in g)
        if cfg.slow_rows > 0:
            rows_per_item = max(cfg.BS, cfg.slow_rows // cfg.BS * cfg.BS)
        elif cfg.item_bytes > 0:
            rows_per_item = max(cfg.BS, cfg.item_bytes // (BF * esize) // cfg.BS * cfg.BS)
        else:
            rows_per_item = 0  # whole region
        rows, xt, shifts, items, sizes = [], [], [], [], []
        for key in per_group[g]:
            reg = regions[key]
            (_, tensor, xo, S, F, ss, fs, lay, func, shift, yo, yss, yfs) = key
            span = rows_per_item or S
            n_chunks, n_tiles = -(-S // span), -(-F // BF)
            ridx = len(rows)
            fast_block = slow_block = -1
            if reg["fast"]:  # partial row sums: one length-S row per column tile
                fast_block = part
                part += n_tiles * S
                finish.append(FINISH_ROW.row(part_off=fast_block, nrows=n_tiles, length=S, elem_base=reg["fast_base"]))
            if reg["slow"]:  # partial column sums: one length-F row per row chunk
                slow_block = part
                part += n_chunks * F
                finish.append(FINISH_ROW.row(part_off=slow_block, nrows=n_chunks, length=F, elem_base=reg["slow_elem"]))
            for c in range(n_chunks):  # column tiles of one row chunk are neighbours (DRAM locality)
                s0, s1 = c * span, min((c + 1) * span, S)
                for t in range(n_tiles):
                    items.append(NORM_ITEM.row(region=ridx, s_start=s0, s_end=s1, f0=t * BF,
                                               fast_off=fast_block + t * S if reg["fast"] else -1,
                                               slow_off=slow_block + c * F if reg["slow"] else -1))
                    sizes.append((s1 - s0) * min(BF, F - t * BF))
            rows.append(REGION.row(x_off=xo, ss=ss, fs=fs, s=S, f=F, layout=lay, func=func, fast_base=reg["fast_base"],
                                   unused=-1, y_off=yo, yss=yss, yfs=yfs))
            xt.append(tensor)
            shifts.append(shift)
        items_np = np.asarray(items, dtype=np.int64).reshape(-1, NORM_ITEM.COLS)
        if len(sizes):  # biggest items first (they are near-equal on a GPU; small regions go last)
            items_np = items_np[np.argsort(-np.asarray(sizes), kind="stable")]
        st.norm.append(NormLaunch(group=g, regions=np.asarray(rows, dtype=np.int64).reshape(-1, REGION.COLS),
                                  x_tensor=np.asarray(xt, dtype=np.int64), y_tensor=np.asarray(xt, dtype=np.int64),
                                  shifts=shifts, items=items_np, BF=BF, warps=warps))
    st.elem_size, st.part_size = elem, part
    if check:  # the same finishing rows for each of the four planes
        st.part_plane, st.elem_plane = -(-max(1, part) // 16) * 16, max(1, elem)
        finish = [FINISH_ROW.row(part_off=f[0] + k * st.part_plane, nrows=f[1], length=f[2],
                                 elem_base=f[3] + k * st.elem_plane) for k in range(4) for f in finish]
    st.finish = np.asarray(finish, dtype=np.int64).reshape(-1, FINISH_ROW.COLS)
    st.finish_blocks = np.asarray([FINISH_BLOCK.row(row=i, c0=c0) for i, f in enumerate(finish)
                                   for c0 in range(0, f[FINISH_ROW.LENGTH], FIN_BC)],
                                  dtype=np.int64).reshape(-1, FINISH_BLOCK.COLS)
    # CSR gather: vec[o] = sum sign * elem[idx], entries of one output in plan order
    outs, idxs, sgns = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0)]
    V, E = plan.vec_size, st.elem_plane
    for (o0, ostep, n, key, fast, p0, pstep, sign, kind) in refs:
        if key in remap:
            key, a, b = remap[key]
            p0, pstep = a + p0 * b, pstep * b
        reg = regions[key]
        r = np.arange(n, dtype=np.int64)
        out, at = o0 + ostep * r, (reg["fast_base"] if fast else reg["slow_elem"]) + p0 + pstep * r
        if not check:
            parts = [(0, 0, sign)]
        elif kind == "norm":  # (output section, element plane, coefficient)
            parts = [(0, 0, 2.0 * sign), (1, 1, 4.0 * sign * sign), (2, 2, 1.0)]
        else:
            parts = [(0, 3, sign), (2, 2, 1.0)]
        for sec, pl, coef in parts:
            outs.append(out + sec * V)
            idxs.append(at + pl * E)
            sgns.append(np.full(n, coef))
    o, idx, sgn = np.concatenate(outs), np.concatenate(idxs), np.concatenate(sgns)
    order = np.argsort(o, kind="stable")
    n_out = 3 * V if check else V
    counts = np.bincount(o, minlength=n_out) if len(o) else np.zeros(n_out, np.int64)
    st.csr_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    st.csr_idx, st.csr_sgn = idx[order], sgn[order].tolist()
    st.max_count = int(counts.max()) if len(o) else 0


def _merge_row_regions(regions: dict, bil: bool) -> dict:
    """Serve fast sums (row norms) of a region from a larger region over the same rows that is read
    anyway (e.g. RoPE pair views of ``W_q`` rows from the gain law's full ``W_q`` region): returns
    ``{key: (host key, a, b)}`` meaning row ``r`` of ``key`` is row ``a + b*r`` of the host."""
    hosts = defaultdict(list)
    for key, reg in regions.items():
        (g, tensor, xo, S, F, ss, fs, lay, func, shift, yo, yss, yfs) = key
        if lay == 0 and (fs == 1 or F == 1) and ss > 0:
            hosts[(g, tensor, F, func, shift)].append(key)
    remap, used = {}, set()
    for key, reg in regions.items():
        (g, tensor, xo, S, F, ss, fs, lay, func, shift, yo, yss, yfs) = key
        if reg["slow"] or not reg["fast"] or lay != 0 or not (fs == 1 or F == 1) or key in used:
            continue
        for h in sorted(hosts[(g, tensor, F, func, shift)], key=lambda k: -k[3]):
            (_, _, hxo, hS, _, hss, _, _, _, _, hyo, hyss, _) = h
            if h == key or h in remap or hS <= S or (xo - hxo) % hss or (S > 1 and ss % hss):
                continue
            a = (xo - hxo) // hss
            b = ss // hss if S > 1 else 1
            if a < 0 or a + b * (S - 1) >= hS:
                continue
            if bil and not (yss == hyss * b and yo - hyo == a * hyss):
                continue
            regions[h]["fast"] = True
            remap[key] = (h, a, b)
            used.add(h)
            break
    return remap
def tensor_deltas(ts: Sequence[torch.Tensor], members: Sequence[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Base tensor (the first of ``members``) and ``(ptr_i - ptr_base) / itemsize`` for every member
    (int64 from exact python ints: correct beyond 2**31 elements).  Raises if an address is not a whole
    number of elements away from the base (cannot happen for tensors of one dtype allocated by torch)."""
    members = sorted(set(int(i) for i in members))
    base = ts[members[0]]
    isz = base.element_size()
    d = np.zeros(len(ts), dtype=np.int64)
    for i in members:
        diff = ts[i].data_ptr() - base.data_ptr()
        if diff % isz:
            raise ValueError(f"tensor {i} is not element-aligned with tensor {members[0]} of the same dtype; "
                             "call .contiguous() on it")
        d[i] = diff // isz
    return base, d


def offsets(view_off: np.ndarray, tensor: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Element offsets relative to the base: ``view_off + delta[tensor]`` (int64)."""
    return view_off.astype(np.int64) + delta[tensor]
