"""Multi-head latent attention (DeepSeek-V2/V3 MLA) found by its algebra, whatever the names and code style
(``docs/laws.md``, "Multi-head latent attention"; the HF detector's ``hf.mla`` builds the same laws
from names).

An attention site (``attention.sites``) is MLA when its queries X ``(..., T, D)`` come from one linear ``Wq`` (with
``D = qk_nope_head_dim + qk_rope_head_dim`` per head), its keys from two linear maps ``Wkv_a`` (``kv_a_proj_with_mqa``:
``kv_lora_rank`` latent rows and ``qk_rope_head_dim`` rotary key rows) and ``Wkv_b`` (``kv_b_proj``, reading the
normalised latent), ``Wkv_a`` computed before ``Wkv_b``, and its values from ``Wkv_b`` too. For such a site
(``one_mla``):

1. ``attention.head_rows``: the rows of ``Wq`` giving head i, dim t (position 0, where RoPE is the identity), and
   the value rows of ``Wkv_b``;
2. ``key_rows``: the key dims read from ``Wkv_b`` (no-RoPE, per head) and from ``Wkv_a`` (the rotary key, the same
   rows for every head: expand / broadcast), each map read with the other projection's path cut;
3. ``attention.rope_pairs``: the dims RoPE turns together in q and in the shared key (``{2p, 2p+1}``,
   ``{p, p+R/2}``, ...), which must be exactly the key dims read from ``Wkv_a``;
4. laws, named as ``hf.mla``: per head (``num_heads`` query heads) the QK Gram of the no-RoPE dims
   (``{lab}/qk/head{i}``) and the VO Gram (``{lab}/vo/head{i}``, ``attention.output_columns``), one RoPE-pair law
   summed over all heads against the shared rotary key rows (``{lab}/rope``);
5. ``latent``: the per-feature gain between ``Wkv_a``'s latent rows and ``Wkv_b`` (``kv_a_layernorm``; and between
   ``q_a_proj`` and ``q_b_proj`` when q is low rank, ``q_lora_rank``) gives the gain law with its one reader, and
   the normalisation's scale invariance the ``norm_scale`` law of the rows before it (exact only for eps = 0:
   declined when the invariance is measured to be approximate).

A site whose queries come from one linear and whose values come from a ``Wkv_b`` reading part of the outputs of
another linear ``Wkv_a`` (the latent), while the keys show no path from ``Wkv_a`` (``unread_keys``: e.g. the keys
assembled by an in-place write the graph's edges do not show), is an MLA whose keys cannot be read: its QK laws are
declined with what was seen, its VO laws still read. ``rewrite.slice_writes_to_functional`` turns HF's
``key_states = new_empty(...); key_states[..., :d].copy_(k_nope)`` into values first, so HF's DeepSeek-V2/V3
attention is read like any other MLA.

What cannot be read is declined for this block with what was seen; ``detect_on``'s float64 first-order check
then keeps only the laws that hold. Sites this finder takes are skipped by the attention finder.
"""
from __future__ import annotations

import torch
from torch import fx

from ...laws import NormScaleLaw, QKGram, VOGram
from .. import builders
from ..fxgraph import Graph, Lin, with_strides_of
from ..ops import SHAPE_ONLY
from .attention import HeadRows, Site, output_projection, head_rows, output_columns, rope_pairs, sites
from .found import Found, common_prefix, layer_index
from .gain import scale_points
from .heads import heads_of

__all__ = ["mla", "one_mla"]

EXACT = 1e-12  # relative change of a normalised value under a rescaling, at or below which it is invariant (float64)
BLOCK = "multi-head latent attention (MLA)"


class _Cut:
    """``g`` with the values of the nodes in ``fixed`` held (the path through them cut): the keys of an MLA read
    as a map of one projection while the other projection's output is held at zero. Offers what
    ``Graph.clean_map``, ``heads.partners`` and ``attention.rope_pairs`` use (``env``, ``run``)."""

    clean_map = Graph.clean_map

    def __init__(self, g: Graph, hold: list[fx.Node]):
        self.g, self.env = g, g.env
        self.fixed = {n: with_strides_of(g.env[n], torch.zeros_like(g.env[n])) for n in hold}

    def run(self, subs: dict, targets: list):
        return self.g.run({**self.fixed, **subs}, targets)


def mla(f: Found) -> None:
    """The MLA finder: ``one_mla`` on every attention site whose ``projections`` read like MLA, or whose keys
    ``unread_keys`` says cannot be read; such a site is marked in ``f.used`` (the attention finder skips it); an
    error declines that block only (and drops what it had found)."""
    for site in sites(f.g):
        unread = None
        try:
            proj = projections(f.g, site)
            if proj is None:
                proj, unread = unread_keys(f.g, site) or (None, None)
        except Exception:  # noqa: BLE001 - not read as MLA: left to the attention finder
            proj = None
        if proj is None:
            continue
        f.used.add(site.node)
        n_cands, n_declined = len(f.cands), len(f.c.declined)
        try:
            one_mla(f, site, proj, unread)
        except Exception as e:  # noqa: BLE001 - this attention block only
            del f.cands[n_cands:], f.c.declined[n_declined:]
            f.c.decline(site.where, "structural analysis error",
                        f"{BLOCK}: {type(e).__name__}: {e}: no law claimed for this block (report this model)")


def projections(g: Graph, site: Site) -> tuple[Lin, Lin, Lin] | None:
    """``(Wq, Wkv_a, Wkv_b)`` when the site reads like MLA (module docstring), else None: one linear behind the
    queries, two behind the keys (one computed from the other), the later of them behind the values."""
    nq, nk, nv = (g.nearest_lins(t) for t in (site.x, site.y, site.v))
    if len(nq) != 1 or len(nk) != 2 or len(nv) != 1 or not nv <= nk:
        return None
    kb = next(iter(nv))
    ka = next(iter(nk - nv))
    if ka not in g.ancestors([kb]) or nq & nk:
        return None
    return g.lins[next(iter(nq))], g.lins[ka], g.lins[kb]


def unread_keys(g: Graph, site: Site) -> tuple[tuple[Lin, Lin, Lin], str] | None:
    """``((Wq, Wkv_a, Wkv_b), reason)`` for an MLA whose keys the graph does not show: one linear ``Wq`` behind the
    queries, one ``Wkv_b`` behind the values, its input computed from one other linear ``Wkv_a`` of which it reads
    fewer features than ``Wkv_a`` has outputs (a latent, the rest being the rotary key), the keys showing no path
    from ``Wkv_a`` (at most ``Wkv_b`` behind them), and values computed from ``Wkv_a`` written in place into a tensor
    the graph's edges do not show being read (``_lost_writes``); ``reason`` says so. None when the site is not that
    (a fused-kv attention, for the attention finder)."""
    nq, nk, nv = (g.nearest_lins(t) for t in (site.x, site.y, site.v))
    if len(nq) != 1 or len(nv) != 1 or not nk <= nv:
        return None
    lkb = g.lins[next(iter(nv))]
    na = g.nearest_lins(lkb.x)
    if len(na) != 1 or na & nq or lkb.node in na:
        return None
    lka = g.lins[next(iter(na))]
    lost = _lost_writes(g, lka, site) if lka.n_out > lkb.n_in else None
    if lost is None:
        return None
    lq = g.lins[next(iter(nq))]
    keys = g.lins[next(iter(nk))].module if nk else "no projection"
    reason = (f"an MLA (queries from {lq.module}, values from {lkb.module} reading {lkb.n_in} of the {lka.n_out} "
              f"outputs of {lka.module}), but the graph shows the keys computed from {keys}, not from {lka.module}: "
              f"{lost}, so the shared rotary key cannot be read: no QK Gram / RoPE law")
    return (lq, lka, lkb), reason


def _lost_writes(g: Graph, lka: Lin, site: Site) -> str | None:
    """The in-place writes (``copy_``, ``setitem``, ``index_put_``, ...) of values computed from ``lka`` whose results
    no node reads and that do not reach ``site`` (the written tensor is read through an edge the graph does not
    have), said in words; None when there are none."""
    reach, down = g.ancestors([site.node]), g.descendants([lka.node])
    writes = [(m, _in_place(m)) for m in g.nodes if m in down and m not in reach and not m.users and _in_place(m)]
    if not writes:
        return None
    w, op = writes[0]
    into = w.args[0].name if w.args and isinstance(w.args[0], fx.Node) else "a constant"
    return (f"its values reach {len(writes)} in-place write(s) ({op} at graph node {w.name}, into graph node {into}) "
            "whose written tensor the graph's edges do not show being read")


def _in_place(n: fx.Node) -> str | None:
    """The name of ``n``'s op when it writes into its first argument (``copy_``, ``index_put_``, ``setitem``), else
    None."""
    if n.op == "call_method":
        name = n.target
    elif n.op == "call_function":
        t = n.target
        name = t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", "")
    else:
        return None
    return name if name == "setitem" or (name.endswith("_") and not name.startswith("_")) else None


def one_mla(f: Found, site: Site, proj: tuple[Lin, Lin, Lin], unread: str | None = None) -> None:
    """Steps 1-5 of the module docstring for one site whose ``projections`` are ``proj``; ``unread``: the reason
    the keys cannot be read (``unread_keys``): the QK laws are declined with it, the VO laws read."""
    g, c = f.g, f.c
    lq, lka, lkb = proj
    lo = output_projection(g, site.out)
    lqa = _low_rank_source(g, lq)
    lins = [x for x in (lqa, lq, lka, lkb, lo) if x is not None]
    lab = common_prefix([x.module for x in lins]) or lq.module or "model"
    layer = layer_index(lab)
    f.used.update({site.node} | {x.node for x in lins})
    if lo is not None:
        c.know(lo.b)
    if not all(x.plain for x in lins):
        c.decline(lab, BLOCK, "its projections are per-token experts or [heads, ...] parameters: not analysed")
        c.know(*(p for x in lins for p in (x.w, x.b)))
        return
    rows_ = head_rows(g, site, lq, lkb, lkb)  # the q and v rows (the keys come from two maps: ``key_rows``)
    qk_reason = None
    keys = None
    if unread is not None:
        qk_reason = unread
    elif rows_.q is None:
        qk_reason = (f"the queries are not a linear index map of {lq.module} at the first positions (a normalised "
                     "or mixed q): no QK Gram / RoPE law")
    else:
        keys, qk_reason = key_rows(g, site, lka, lkb, rows_)
    if qk_reason is None:
        qk_reason = _qk_laws(f, site, lab, layer, lq, lka, lkb, rows_, keys)
    if qk_reason is not None:
        c.decline(f"{lab}/qk", f"{BLOCK} QK laws", qk_reason)
        c.know(lq.w, lq.b, lka.w, lka.b)
    _vo_laws(f, site, lab, layer, lkb, lo, rows_.v, keys)
    rope = sorted(set(keys[1].values())) if keys else _unread_rows(g, lka, lkb) if unread is not None else None
    _latent(f, lkb, lka, rope=rope)
    if lqa is not None:
        _latent(f, lq, lqa, rope=[])


def _unread_rows(g: Graph, lka: Lin, lkb: Lin) -> list | None:
    """The outputs of ``lka`` that ``lkb``'s input does not read (the rotary key of an MLA whose keys cannot be
    read), found by changing each alone; None when ``lkb`` reads them all."""
    sv = g.env[lka.node]
    xv = g.env[lkb.x]
    out = []
    for r in range(lka.n_out):
        v = sv.clone()
        v[..., r] += 1.0
        if torch.equal(g.run({lka.node: with_strides_of(sv, v)}, [lkb.x])[0], xv):
            out.append(r)
    return out or None


def _low_rank_source(g: Graph, lq: Lin) -> Lin | None:
    """``q_a_proj`` of a low-rank q (``q_lora_rank``): the one linear behind ``Wq``'s input whose output reaches the
    rest of the model only through ``Wq`` (a projection of the residual stream is read elsewhere too); else None."""
    near = g.nearest_lins(lq.x)
    if len(near) != 1:
        return None
    n = next(iter(near))
    return g.lins[n] if _only_through(g, n, lq.node) else None


def _only_through(g: Graph, src: fx.Node, dst: fx.Node) -> bool:
    """Every value computed from ``src`` reaches the model's output only through ``dst`` (shape reads aside)."""
    before, after = g.ancestors([dst]), g.descendants([dst])
    for m in g.descendants([src]) - after:
        if m not in before:
            return False
        if any(u not in before and u not in after and g.op(u) not in SHAPE_ONLY for u in m.users):
            return False
    return True


def key_rows(g: Graph, site: Site, lka: Lin, lkb: Lin, rows_: HeadRows):
    """``((nope, rope), None)``: ``nope`` = ``{head lead: {key dim: row of Wkv_b}}``, ``rope`` = ``{key dim: row of
    Wkv_a}`` (the rotary key, the same row for every head), read at the queries' clean position; ``(None,
    reason)`` when the keys are not that."""
    ys = tuple(g.env[site.y].shape)
    found = []
    for src, other in ((lkb, lka), (lka, lkb)):
        cut = _Cut(g, [other.node])
        m = cut.clean_map(src.node, site.y, rows_.lead)
        clean = heads_of(m, ys, site.y_last) if m is not None else None
        if not clean or len({k[1] for k in clean}) != 1:
            return None, (f"the keys are not a linear index map of {src.module} (with {other.module}'s path held): "
                          "no QK Gram / RoPE law")
        by: dict = {}
        for (lead, _, dim), r in clean.items():
            by.setdefault(lead, {})[dim] = r
        found.append(by)
    nope, shared = found
    d = len(next(iter(rows_.q.values())))
    if sorted(nope) != sorted(rows_.q):
        return None, (f"{len(nope)} key heads from {lkb.module} for {len(rows_.q)} query heads (MLA has one key head "
                      "per query head): no QK Gram / RoPE law")
    rope = next(iter(shared.values()))
    if any(v != rope for v in shared.values()) or sorted(shared) != sorted(rows_.q):
        return None, f"the key dims read from {lka.module} are not the same rows for every head: no QK Gram / RoPE law"
    for lead, dims in nope.items():
        if set(dims) & set(rope) or len(dims) + len(rope) != d:
            return None, (f"key dims {sorted(dims)} from {lkb.module} and {sorted(rope)} from {lka.module} do not "
                          f"partition the head dim {d}: no QK Gram / RoPE law")
    if len({tuple(sorted(v)) for v in nope.values()}) != 1:
        return None, f"the heads read different key dims from {lkb.module}: no QK Gram / RoPE law"
    return (nope, rope), None


def _qk_laws(f: Found, site: Site, lab: str, layer, lq: Lin, lka: Lin, lkb: Lin, rows_: HeadRows, keys) -> str | None:
    """The QK Gram per head on the no-RoPE dims and the RoPE-pair law summed over all heads (module docstring, step
    4); returns the decline reason when the rotation does not pair exactly the shared key dims."""
    nope, rope = keys
    d = len(next(iter(rows_.q.values())))
    krope = {l: [rope.get(t) for t in range(d)] for l in rows_.q}
    cut = _Cut(f.g, [lkb.node])
    pairs, passd, reason = rope_pairs(cut, site, lq, lka, HeadRows(rows_.q, krope, rows_.v, rows_.lead))
    if reason is not None:
        return reason.replace("q and k are", f"q and the rotary key of {lka.module} are")
    if pairs is None:
        return (f"the key dims {sorted(rope)} of {lka.module}, shared by all heads, are not rotated: the shared-key "
                "law of an MLA without RoPE is not built")
    if sorted(t for p in pairs for t in p) != sorted(rope):
        return (f"RoPE turns the dims {sorted(t for p in pairs for t in p)}, the shared key of {lka.module} is read at "
                f"dims {sorted(rope)}: not MLA's RoPE layout, no QK law")
    leads = sorted(rows_.q)
    dn = [t for t in range(d) if t not in rope]
    heads, shape = len(leads), f"{len(dn)} no-RoPE + {len(rope)} rotary dims"
    for i, l in enumerate(leads):
        if not dn:
            break
        law = builders.head_gram(QKGram, f"{lab}/qk/head{i}", layer, [lq.row_block([rows_.q[l][t] for t in dn])],
                                 [lkb.row_block([nope[l][t] for t in dn])],
                                 note=f"structural MLA head {i} of {heads} ({shape}): {lq.module} rows vs {lkb.module} "
                                      "key rows, no-RoPE dims (docs/laws.md: MLA QK Gram)")
        if law is None:
            f.c.decline(f"{lab}/qk/head{i}", f"{BLOCK} QK Gram", "the head's no-RoPE rows are not a strided block")
            f.c.know(lq.w, lkb.w)
        f.add(law, "MLA QK Gram")
    f.add(builders.rope_pair_law(
        f"{lab}/rope", layer, q=[(lq.w, lq.shape, lq.b, rows_.q[l], lq.t) for l in leads],
        k=[(lka.w, lka.shape, lka.b, krope[leads[0]], lka.t)], pairs=pairs,
        note=f"structural MLA: RoPE pairs {pairs[:3]}... of every head's rotary q rows ({lq.module}) vs the shared "
             f"rotary key rows of {lka.module} (docs/laws.md: MLA RoPE pairs)"), "MLA RoPE pairs")
    return None


def _vo_laws(f: Found, site: Site, lab: str, layer, lkb: Lin, lo: Lin | None, vmap: dict | None, keys) -> None:
    """The VO Gram per head: ``Wkv_b``'s value rows of head i vs the output projection's input columns of head i."""
    c = f.c
    reason = None
    if lo is None:
        reason = "the attention output is not read by one linear projection: no VO law"
    omap = output_columns(f.g, site.out, lo) if lo is not None and vmap else None
    if reason is None and (vmap is None or omap is None or len(omap) != len(vmap)):
        reason = (f"the values are not a linear index map of {lkb.module}, or the output columns of "
                  f"{lo.module} are not read one to one per head: no VO law")
    if reason is None and keys is not None:
        krows = {r for dims in keys[0].values() for r in dims.values()}
        if krows & {r for rs in vmap.values() for r in rs}:
            reason = f"the values read rows of {lkb.module} that the keys read too: no VO law"
    if reason is not None:
        c.decline(f"{lab}/vo", f"{BLOCK} VO laws", reason)
        c.know(lkb.w, lkb.b, *((lo.w,) if lo is not None else ()))
        return
    for i, (vl, ol) in enumerate(zip(sorted(vmap), sorted(omap))):
        law = builders.head_gram(VOGram, f"{lab}/vo/head{i}", layer, [lkb.row_block(vmap[vl])],
                                 [lo.col_block(omap[ol])],
                                 note=f"structural MLA head {i}: {lkb.module} value rows vs {lo.module} columns "
                                      "(docs/laws.md: MLA VO Gram)")
        if law is None:
            c.decline(f"{lab}/vo/head{i}", f"{BLOCK} VO Gram", "value rows / output columns are not strided blocks")
            c.know(lkb.w, lo.w)
        f.add(law, "MLA VO Gram")


def _latent(f: Found, reader: Lin, src: Lin, rope: list | None) -> None:
    """The norm between ``src``'s latent rows (every row not in ``rope``) and ``reader`` (``kv_a_layernorm`` between
    ``Wkv_a`` and ``Wkv_b``, ``q_a_layernorm`` between ``q_a_proj`` and ``q_b_proj``): the gain law of its per-feature
    gain ``g`` (``reader``'s input is ``g * n(z)`` (+ beta), read by ``reader`` alone) and the ``norm_scale`` law of
    the latent rows (``reader``'s input is unchanged when they are rescaled). ``rope``: the rotary key rows (read
    from the keys, or, when the keys cannot be read, the rows ``reader`` does not read: ``_unread_rows``); None:
    unknown (the queries or keys were not read): nothing built."""
    g, c = f.g, f.c
    if rope is None:
        c.decline(f"{src.module}/latent", f"{BLOCK} latent norm", "the rotary key rows were not read (see the QK "
                  "reason): no gain or scale law of the latent")
        c.know(src.w, src.b)
        return
    latent = [r for r in range(src.n_out) if r not in set(rope)]
    if not latent:
        c.decline(f"{src.module}/latent", f"{BLOCK} latent norm", f"every row of {src.module} is a rotary key row: "
                  "no latent, no gain or scale law")
        return
    sv, xv = g.env[src.node], g.env[reader.x]
    scale = float(xv.abs().max()) or 1.0

    def scaled(rows, factor) -> torch.Tensor:
        """``reader``'s input when ``src``'s output ``rows`` are multiplied by ``factor``."""
        v = sv.clone()
        v[..., rows] *= factor
        return g.run({src.node: with_strides_of(sv, v)}, [reader.x])[0]

    def changed(rows, factor) -> float:
        return float((scaled(rows, factor) - xv).abs().max()) / scale

    if rope and changed(rope, 3.0) > EXACT:
        c.decline(f"{src.module}/latent", f"{BLOCK} latent norm", f"the input of {reader.module} depends on the rotary "
                  f"key rows {rope} of {src.module}: no gain or scale law of the latent")
        c.know(src.w, src.b)
        return
    gain = _gain(f, reader, src)  # None: a torch.nn norm module, the gain finder's
    if isinstance(gain, str):
        c.decline(f"{src.module}/latent", f"{BLOCK} latent norm", gain)
    elif gain is not None:
        w, b = gain
        path = w.rsplit(".", 1)[0] if "." in w else w
        # a norm module's gain (kv_a_layernorm.weight) names the law after the module, a block's own parameter
        # (self.latent_gain) after the parameter
        label = path if w.rsplit(".", 1)[-1] in ("weight", "gain", "scale", "gamma") else w
        f.add(builders.gain_law(f"{label}/gain", layer_index(path), w, reader.n_in, readers=[reader.reader()], bias=b,
                                note=f"structural MLA: the normalised latent of {src.module}, read by {reader.module} "
                                     "alone (docs/laws.md: MLA norm gains)"), "MLA latent gain")
    name = f"{src.module}/norm_scale"
    what = f"rows {latent[0]}..{latent[-1]} of {src.module}" if rope else f"the rows of {src.module}"
    block = src.row_block(latent)
    drift = max(changed(latent, 3.0), changed(latent, 0.25))
    if block is None:
        c.decline(name, f"{BLOCK} latent scale law", f"the latent rows of {src.module} are not a strided block")
    elif drift <= EXACT:
        f.add(NormScaleLaw.build(name, layer_index(src.module), blocks=[b for b in block if b is not None],
                                 note=f"structural MLA: {what} normalised before {reader.module} (docs/laws.md: MLA "
                                      "latent scale laws)"), "MLA latent scale")
    elif _limit(scaled(latent, 1e4), scaled(latent, 1e8)) <= 1e-8:  # invariant as the rows grow: an eps
        c.decline(name, f"{BLOCK} latent scale law",
                  f"the input of {reader.module} changes by {drift:.1e} (relative) when {what} are rescaled: the norm "
                  "is scale invariant only approximately (an eps > 0), and structural detection claims only laws "
                  "passing the float64 first-order check: no law")
    else:
        c.decline(name, f"{BLOCK} latent scale law", f"the input of {reader.module} changes by {drift:.1e} (relative) "
                  f"when {what} are rescaled: not normalised, no scale law")
    if block is None or drift > EXACT:
        c.know(src.w, src.b)  # declined above with the reason


def _limit(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two values of a normalised output (``inf`` when not finite)."""
    d = float((a - b).abs().max()) / (float(a.abs().max()) or 1.0)
    return d if d == d else float("inf")


def _gain(f: Found, reader: Lin, src: Lin):
    """``(gain, bias or None)``: the 1-D parameters between ``src`` and ``reader`` with ``reader``'s input
    ``g * n(z) + beta`` (scaling g and beta by s per feature scales it by s), read by ``reader`` alone; None for a
    torch.nn norm module kept whole by the trace (``gain.scale_points`` reads it: the gain finder builds its law);
    else the decline reason."""
    g = f.g
    nodes = g.ancestors([reader.x]) - g.ancestors([src.node])
    between = [n for n in nodes if g.param_of(n) is not None]
    mods = [n for n in nodes if n.op == "call_module" and next(g.gm.get_submodule(n.target).parameters(), None)
            is not None]
    if mods:
        if len(mods) == 1 and not between and mods[0] in {p[0] for p in scale_points(g)}:
            return None  # a torch.nn norm module (a leaf of the trace): its gain law is the gain finder's
        return (f"{[n.target for n in mods]} between {src.module} and {reader.module} hold parameters the trace does "
                "not show (an opaque module): no gain law")
    n_in = reader.n_in
    if not between or any(g.params[g.param_of(n)].shape != (n_in,) for n in between) or len(between) > 2:
        seen = sorted(g.param_of(n) for n in between)
        return (f"the parameters between {src.module} and {reader.module} are {seen}, not a gain (and bias) of its "
                f"{n_in} input features: no gain law")
    xv = g.env[reader.x]
    s = torch.rand(n_in, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(xv.dtype) + 0.5
    subs = {n: with_strides_of(g.env[n], g.env[n] * s) for n in between}
    bias = None
    if len(between) == 2:  # which one is beta: reader's input moves by exactly its change
        for n in between:
            d = g.run({n: with_strides_of(g.env[n], g.env[n] + 1.0)}, [reader.x])[0] - xv
            if torch.allclose(d, torch.ones_like(d), rtol=0, atol=1e-12):
                bias = n
        if bias is None:
            return (f"two parameters {sorted(g.param_of(n) for n in between)} between {src.module} and "
                    f"{reader.module}, neither a bias added last: no gain law")
    y = g.run(subs, [reader.x])[0]
    if (y - xv * s).abs().max() > EXACT * (float(xv.abs().max()) or 1.0):
        return (f"{reader.module}'s input is not scaled feature by feature by {g.param_of(between[0])}: no gain law")
    gain = next(n for n in between if n is not bias)
    for n in between:
        if not _only_through(g, n, reader.node):
            return f"{g.param_of(n)} scales a value read by more than {reader.module}: no gain law"
    return g.param_of(gain), (g.param_of(bias) if bias is not None else None)
