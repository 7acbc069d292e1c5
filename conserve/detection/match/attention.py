"""Attention blocks: every ``softmax(f(X @ Y))`` followed by ``@ V`` (any element-wise f: scale, mask, ALiBi,
soft-capping) and every ``scaled_dot_product_attention``, with the QK / RoPE / VO laws their projections carry.

For one attention (``one_attention``), in order:

1. ``projections``: the nearest linear projection of X, Y and V, and the one linear reading the output through
   index ops (any spelling ``Lin`` knows, parameter-shaped heads included);
2. ``head_rows``: which rows of each projection form head i, dim d, read off exact maps through the graph at the
   first position where the map is an index map (RoPE is the identity at position 0): any fused qkv split by
   columns or per head, reshape, transpose, GQA ``repeat_interleave`` / ``expand`` / ``repeat``;
3. ``rope_pairs``: a probe at other positions shows which dims are rotated together: rotate_half pairs
   ``{p, p + R/2}``, adjacent pairs ``{2p, 2p+1}`` (complex multiplication), pass-through dims (partial rotary);
4. ``kv_groups``: the query heads that read each kv head, whatever the GQA convention (``i // (nH / nKV)`` or
   ``i % nKV``), read from the maps;
5. ``qk_laws``: QK Gram per kv group, or RoPE pairs (+ pass-through Gram); a q/k path that is not linear (QK-norm)
   is declined for them and its gains get the QK-norm gain law (``qk_norm``);
6. ``vo_laws``: the output projection's input columns of each head (``output_columns``) and the VO Gram per kv
   group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ...laws import QKGram, RopePassGram, VOGram
from ...laws.tolerance import PROBE_CODE, PROBE_NONZERO
from .. import builders
from ..fxgraph import Graph, Lin, with_strides_of
from ..ops import PASS, PROB_OPS, SCORE_OPS
from .found import Found, common_prefix, layer_index
from .gain import scale_points
from .heads import by_head, heads_of, partners

__all__ = ["Site", "attention", "one_attention", "qk_norm", "sites"]


@dataclass
class Site:
    """One attention in the graph: scores from ``x`` (queries) and ``y`` (keys ``(..., S, D)``, or ``K^T``
    ``(..., D, S)`` when not ``y_last``), values ``v``, output ``out``; ``node``: the softmax or SDPA call."""

    node: fx.Node
    x: fx.Node
    y: fx.Node
    v: fx.Node
    out: fx.Node
    y_last: bool

    @property
    def where(self) -> str:
        return f"attention at graph node {self.node.name}"


@dataclass
class HeadRows:
    """``{head lead: [row of the projection for dim 0..D-1]}`` of queries, keys and values (None: not an index
    map), read at flattened position ``lead`` of the projections' outputs."""

    q: dict | None
    k: dict | None
    v: dict | None
    lead: int


def sites(g: Graph) -> list[Site]:
    """Every attention of the graph (module docstring)."""
    out = []
    for n in g.nodes:
        o = g.op(n)
        if o == "sdpa":
            x, y, v = n.args[:3]
            out.append(Site(n, x, y, v, n, True))
        elif o == "softmax":
            s = _scores(g, n.args[0])
            if not (isinstance(s, fx.Node) and g.op(s) == "matmul"):
                continue
            users = [u for u in g.descendants([n]) if g.op(u) == "matmul" and g.back_pass(u.args[0], PROB_OPS) is n]
            if len(users) == 1:
                out.append(Site(n, s.args[0], s.args[1], users[0].args[1], users[0], False))
    return out


def _scores(g: Graph, s):
    """The scores matmul behind softmax's input: back through ``SCORE_OPS`` on the one operand computed from a
    linear map (``s - max(s)``, softmax's stabiliser, keeps the same scores)."""
    while isinstance(s, fx.Node) and g.op(s) in SCORE_OPS and g.op(s) != "matmul":
        nxt = [a for a in s.all_input_nodes if g.is_tensor(a) and g.ancestors([a]) & set(g.lins)]
        if g.op(s) == "sub" and len(nxt) == 2 and _row_max(g, nxt[1], nxt[0]):
            nxt = nxt[:1]
        if len(nxt) != 1:
            break
        s = nxt[0]
    return s


def _row_max(g: Graph, m, of) -> bool:
    """``m`` is ``max`` / ``amax`` of ``of`` (directly or through ``getitem`` of ``max``'s values, ``detach``, casts)."""
    m = g.back_pass(m, {"getitem", "detach", "to", "alias"})
    return isinstance(m, fx.Node) and g.op(m) in ("max", "amax") and bool(m.args) and m.args[0] is of


def attention(f: Found) -> None:
    """The attention finder: ``one_attention`` on every site; an error declines that block only."""
    for site in sites(f.g):
        if site.node in f.used:  # analysed by an earlier finder (``match.mla``: multi-head latent attention)
            continue
        try:
            one_attention(f, site)
        except Exception as e:  # noqa: BLE001 - this attention block only
            f.c.decline(site.where, "structural analysis error",
                        f"{type(e).__name__}: {e}: no law claimed for this block (report this model)")


def one_attention(f: Found, site: Site) -> None:
    """Steps 1-6 of the module docstring for one attention."""
    g, c = f.g, f.c
    proj = projections(f, site)
    if proj is None:
        return
    lq, lk, lv, lo = proj
    name = common_prefix([lq.module, lk.module, lv.module] + ([lo.module] if lo else [])) or lq.module
    lab, layer = name or "model", layer_index(name)
    f.used.update({lq.node, lk.node, lv.node})
    rows_ = head_rows(g, site, lq, lk, lv)
    pairs = passd = None
    if rows_.q is None or rows_.k is None:
        qk_reason = ("the q/k paths are not linear index maps of the projections (QK-norm or another "
                     "normalisation, or an unrecognised layout): no QK Gram / RoPE law (spec breakers: QK-norm)")
    else:
        pairs, passd, qk_reason = rope_pairs(g, site, lq, lk, rows_)
    if qk_reason is None:
        qk_laws(f, lab, layer, lq, lk, rows_, pairs, passd)
    else:
        c.decline(f"{lab}/qk", "QK laws", qk_norm(f, lq, lk, site.x, site.y, site.y_last, lab, layer) or qk_reason)
        c.know(lq.w, lq.b, lk.w, lk.b)  # the q/k projections' reason is that decline (not "undetected")
    vo_laws(f, site, lab, layer, lv, lo, rows_.v)


def projections(f: Found, site: Site) -> tuple[Lin, Lin, Lin, Lin | None] | None:
    """``(q, k, v, o)``: the nearest linear projection of X, Y, V and the linear reading the output (None when it
    is not one linear, read through index ops); None (declined) unless q, k and v are each one linear map."""
    g, c = f.g, f.c
    near = [g.nearest_lins(t) for t in (site.x, site.y, site.v)]
    if any(len(s) != 1 for s in near):
        c.decline(site.where, "attention", "q, k and v are not each one linear projection of the input: not analysed")
        return None
    lq, lk, lv = (g.lins[next(iter(s))] for s in near)
    if any(l_.experts for l_ in (lq, lk, lv)):
        c.decline(site.where, "attention", "q, k or v is a per-token expert map (mixture of attention experts): not "
                  "analysed")
        return None
    return lq, lk, lv, output_projection(g, site.out)


def output_projection(g: Graph, out: fx.Node) -> Lin | None:
    """The one linear reading ``out`` through index ops (12 hops at most), else None."""
    cur = out
    for _ in range(12):
        readers = g.lin_of_x(cur)
        if readers:
            return readers[0] if len(readers) == 1 and not readers[0].experts else None
        nxt = [u for u in cur.users if g.op(u) in PASS]
        if len(nxt) != 1 or len(cur.users) != 1:
            return None
        cur = nxt[0]
    return None


def head_rows(g: Graph, site: Site, lq: Lin, lk: Lin, lv: Lin) -> HeadRows:
    """Query heads and their rows at the first of three positions where the map is clean (RoPE is the identity
    at position 0), the key heads at the same position, the value heads at position 0."""
    xs, ys, vs = (tuple(g.env[t].shape) for t in (site.x, site.y, site.v))
    d = xs[-1]
    nlead = g.env[lq.node].numel() // lq.n_out
    qmap = kmap = None
    k0 = 0
    for k0 in range(min(nlead, 3)):
        m = g.clean_map(lq.node, site.x, k0)
        clean = heads_of(m, xs, True) if m is not None else None
        qmap = by_head(clean, d) if clean else None
        if qmap:
            break
    if qmap:
        mk = g.clean_map(lk.node, site.y, k0)
        ck = heads_of(mk, ys, site.y_last) if mk is not None else None
        kmap = by_head(ck, d) if ck else None
    mv = g.clean_map(lv.node, site.v, 0)
    cv = heads_of(mv, vs, True) if mv is not None else None
    vmap = by_head(cv, vs[-1]) if cv else None
    return HeadRows(qmap, kmap, vmap, k0)


def rope_pairs(g: Graph, site: Site, lq: Lin, lk: Lin, rows_: HeadRows):
    """``(pairs, pass-through dims, None)``: the dims q and k are rotated together at other positions (``(None,
    None, None)``: no rotation); ``(None, None, reason)`` when the mixing is not one RoPE pairing of q and k."""
    xs, ys = tuple(g.env[site.x].shape), tuple(g.env[site.y].shape)
    d = xs[-1]
    nlead = g.env[lq.node].numel() // lq.n_out
    leads = [k for k in range(1, min(nlead, 5)) if k != rows_.lead]
    pq = partners(g, lq.node, site.x, xs, True, rows_.q, leads)
    pk = partners(g, lk.node, site.y, ys, site.y_last, rows_.k, leads)
    if pq is None or pk is None or pq != pk:
        return None, None, "q and k are mixed across dims in a way that is not a RoPE pairing: no QK law"
    if not pq:
        return None, None, None
    pairs = sorted({tuple(sorted(p)) for p in pq.items()})
    return pairs, [t for t in range(d) if t not in pq], None


def kv_groups(qmap: dict, kmap: dict) -> dict:
    """``{kv rows (tuple): [query head leads reading them]}``. With fewer kv heads than query heads (SDPA's GQA
    broadcast), query head ``l`` reads kv head ``l // rep`` of the kv leads in order."""
    nq = len(qmap)
    q0 = sorted(qmap)[0]
    groups: dict = {}
    for l in qmap:
        if len(kmap) == nq:
            kl = l
        else:
            rep = nq // len(kmap)
            kl = sorted(kmap)[0] + (l - q0) // rep if rep else None
        groups.setdefault(tuple(kmap[kl]) if kl in kmap else None, []).append(l)
    return groups


def qk_laws(f: Found, lab: str, layer, lq: Lin, lk: Lin, rows_: HeadRows, pairs, passd) -> None:
    """QK Gram per kv group (no RoPE), or RoPE pairs and the pass-through Gram of partial rotary."""
    c, qmap = f.c, rows_.q
    for j, (krows, heads) in enumerate(kv_groups(qmap, rows_.k).items()):
        note = f"structural: query heads {list(range(len(heads)))} of group {j} read kv rows of {lk.w}"
        if pairs is None:
            law = builders.head_gram(QKGram, f"{lab}/qk/group{j}", layer, [lq.row_block(qmap[l]) for l in heads],
                                     [lk.row_block(list(krows))], note=note + " (spec: MHA / GQA rows)")
            if law is None:
                c.decline(f"{lab}/qk/group{j}", "QK Gram", "head rows are not a strided block of the weight")
            f.add(law, "QK Gram")
            continue
        d = len(qmap[heads[0]])
        q_heads, k_head = [lq.head_rows(qmap[l]) for l in heads], lk.head_rows(list(krows))
        if None in q_heads or k_head is None:
            c.decline(f"{lab}/rope/group{j}", "RoPE pairs", "a head's dims span two heads of the stored parameter")
            continue
        law = builders.rope_pair_law(f"{lab}/rope/group{j}", layer, q=q_heads, k=[k_head], pairs=pairs,
                                     note=note + f"; RoPE pairs {pairs[:3]}... of head_dim {d} (spec: RoPE rows)")
        f.add(law, "RoPE pairs")
        if passd:
            law = builders.head_gram(RopePassGram, f"{lab}/rope_pass/group{j}", layer,
                                     [lq.row_block([qmap[l][t] for t in passd]) for l in heads],
                                     [lk.row_block([krows[t] for t in passd])],
                                     note=f"pass-through dims {passd} (spec: partial rotary)")
            if law is None:
                c.decline(f"{lab}/rope_pass/group{j}", "partial rotary Gram", "pass-through rows not strided")
            f.add(law, "partial rotary Gram")


def output_columns(g: Graph, out: fx.Node, lo: Lin) -> dict | None:
    """``{head lead: [input column of the output projection for dim 0..D-1]}``: every (head lead l, dim t) of the
    attention output at position 0 encoded as one value, the projection's input columns at batch 0 / position 0
    read them one to one (decoded as ratios, confirmed with random values); None when they do not."""
    on = g.env[out]
    shape = tuple(on.shape)
    nl, dd = on.numel() // (shape[-2] * shape[-1]), shape[-1]

    def run(vals):
        e = torch.zeros(on.shape, dtype=on.dtype)
        e.view(-1, shape[-2], dd)[:, 0, :] = vals.view(nl, dd)
        return g.run({out: with_strides_of(on, e)}, [lo.x])[0].reshape(-1, lo.n_in)

    codes = torch.arange(1, nl * dd + 1, dtype=on.dtype)
    rnd = torch.rand(nl * dd, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(on.dtype) + 0.5
    ya, yb, yc = run(codes), run(torch.ones_like(codes)), run(rnd)
    omap: dict = {}
    sc = float(yb.abs().max())
    for col in range(lo.n_in):
        if sc == 0 or abs(float(yb[0, col])) <= PROBE_NONZERO * sc:
            continue
        ratio = float(ya[0, col] / yb[0, col])
        code = round(ratio)
        if abs(ratio - code) > PROBE_CODE or not 1 <= code <= nl * dd or \
                abs(float(yc[0, col]) - float(yb[0, col]) * float(rnd[code - 1])) > PROBE_NONZERO * sc:
            return None
        l, t = divmod(code - 1, dd)
        omap.setdefault(l, [None] * dd)[t] = col
    if any(None in cols_ for cols_ in omap.values()):
        return None
    return omap


def vo_laws(f: Found, site: Site, lab: str, layer, lv: Lin, lo: Lin | None, vmap: dict | None) -> None:
    """The VO Gram law of each kv group: value rows ``V_j`` (and bias) against the output projection's input
    columns ``O_i`` of every query head reading them."""
    c = f.c
    if lo is None:
        c.decline(f"{lab}/vo", "VO laws", "the attention output is not read by one linear projection: no VO law")
        return
    f.used.add(lo.node)
    c.know(lo.b)
    omap = output_columns(f.g, site.out, lo) if vmap else None
    if omap is None or vmap is None or not omap or len(omap) % len(vmap):
        c.decline(f"{lab}/vo", "VO laws", "the value / output paths are not linear index maps: no VO law")
        return
    vgroups: dict = {}
    vleads, rep = sorted(vmap), len(omap) // len(vmap)
    for i, l in enumerate(sorted(omap)):
        vgroups.setdefault(tuple(vmap[vleads[i // rep]]), []).append(l)
    for j, (vrows, heads) in enumerate(vgroups.items()):
        law = builders.head_gram(VOGram, f"{lab}/vo/group{j}", layer, [lv.row_block(list(vrows))],
                                 [lo.col_block(omap[l]) for l in heads],
                                 note=f"structural: {len(heads)} query head(s) read these value rows (spec: MHA value/"
                                      "output row)")
        if law is None:
            c.decline(f"{lab}/vo/group{j}", "VO Gram", "value rows / output columns are not strided blocks")
        f.add(law, "VO Gram")


def qk_norm(f: Found, lq: Lin, lk: Lin, x, y, y_last, lab: str, layer) -> str | None:
    """QK-norm (a per-feature gain on each of the q and k paths after a normalisation): the QK Gram / RoPE laws
    are gone; scaling dim t of the q gain by c and of the k gain by 1/c (equally within a rotary pair) keeps
    every score, which gives the ``qk_norm_gain`` law. Returns the decline reason for the QK laws, or None
    when no QK-norm gain was found."""
    g = f.g
    pts = scale_points(g)

    def on(src, dst):
        between = g.ancestors([dst]) & g.descendants([src])
        return [p for p in pts if p[0] in between]

    sq, sk = on(lq.node, x), on(lk.node, y)
    if len(sq) != 1 or len(sk) != 1:
        return None
    (nq, wq, bq, shq, _), (nk, wk, bk, shk, _) = sq[0], sk[0]
    if shq != shk:
        return None
    f.explained.update({lq.w, lk.w} | ({lq.b} if lq.b else set()) | ({lk.b} if lk.b else set()))
    reason = (f"QK-norm ({wq.rsplit('.', 1)[0]}, {wk.rsplit('.', 1)[0]}): q and k are normalised, so the QK Gram / "
              "RoPE-pair symmetries of the q/k rows are gone (spec breakers: QK-norm); the VO laws are kept, the "
              "gains get a qk_norm_gain law; the ||Q||^2 scale laws are not built structurally")
    xs, ys = tuple(g.env[x].shape), tuple(g.env[y].shape)

    def gain_map(src, dst, shp, last):
        """{head lead: [gain index for head dim 0..D-1]} at position 0, and the RoPE partners."""
        n_src = g.env[src].numel() // g.env[src].shape[-1]
        for k0 in range(min(n_src, 2)):
            m = g.clean_map(src, dst, k0)
            clean = heads_of(m, shp, last) if m is not None else None
            bh = by_head(clean, shp[-1] if last else shp[-2]) if clean else None
            if bh:
                part = partners(g, src, dst, shp, last, bh, range(k0 + 1, min(n_src, 4 * len(bh) + 4)))
                return bh, part
        return None, None

    mq, pq = gain_map(nq, x, xs, True)
    mk, pk = gain_map(nk, y, ys, y_last)
    if not mq or not mk or pq is None or pk is None or pq != pk:
        return reason.replace("the gains get a qk_norm_gain law", "the gains' layout is not recognised (no gain law)")
    d = xs[-1]
    pairs = sorted({tuple(sorted(p)) for p in pq.items()}) if pq else [(t,) for t in range(d)]
    if pq and len(pairs) * 2 != d:
        return reason.replace("the gains get a qk_norm_gain law", "partial rotary with QK-norm: no gain law")
    lq_, lk_ = sorted(mq), sorted(mk)
    if g.params[wq].numel() == d and g.params[wk].numel() == d:  # one gain shared by all heads (per-head norm)
        groups = [([lq_[0]], [lk_[0]])]
    else:  # a norm over all heads: one law per kv group (the query heads reading the same k gains)
        if len(lk_) % len(lq_) and len(lq_) % len(lk_):
            return reason
        rep = max(len(lq_) // len(lk_), 1)
        by_k: dict = {}
        for i, l in enumerate(lq_):
            kl = lk_[i] if len(lk_) == len(lq_) else lk_[i // rep]
            by_k.setdefault(tuple(mk[kl]), ([], [kl]))[0].append(l)
        groups = list(by_k.values())
    for j, (qh, kh) in enumerate(groups):
        qe = [[mq[l][t] for l in qh for t in pair] for pair in pairs]
        ke = [[mk[l][t] for l in kh for t in pair] for pair in pairs]
        f.add(builders.qk_norm_gain_law(f"{lab}/qk_norm_gain/group{j}", layer, q_gain=wq, k_gain=wk, entries=qe,
                                        k_entries=ke, q_bias=bq, k_bias=bk, shift=shq,
                                        note=f"structural: QK-norm gains, {'RoPE pairs' if pq else 'per dim'} "
                                             "(spec: QK-norm breaker + RoPE row)"), "QK-norm gain")
    return reason


class _Candidates:
    """What ``torchnn.mha_laws`` writes to (``add``, ``mark``, ``decline``), turned into candidates of ``Found``."""

    def __init__(self, f: Found, what: str):
        self.f, self.what = f, what

    def add(self, law) -> None:
        self.f.add(law, self.what)

    def mark(self, *paths) -> None:
        self.f.c.mark(*paths)

    def decline(self, *args) -> None:
        self.f.c.decline(*args)


def mha_modules(f: Found) -> None:
    """``nn.MultiheadAttention`` kept whole as one call in the traced graph (torch.fx's leaf): its per-head QK and VO
    Grams from the module's own layout (``torchnn.mha_laws``), checked as every candidate is."""
    from torch import nn

    from ..torchnn import mha_laws

    g = f.g
    for n in g.nodes:
        if n.op != "call_module":
            continue
        m = g.gm.get_submodule(n.target)
        if isinstance(m, nn.MultiheadAttention):
            mha_laws(_Candidates(f, "nn.MultiheadAttention heads"), n.target, m, layer_index(n.target))
