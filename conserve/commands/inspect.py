"""``conserve inspect PATH [OTHER]``: the conservation laws of a checkpoint on disk.

PATH is a local HF checkpoint directory (``config.json`` + ``model.safetensors`` or shards with
``model.safetensors.index.json``) or one ``.safetensors`` file. The model is built on the meta device
from the config (no weights allocated, ``conserve.detection.hf.meta_model``) and handed to ``conserve.detect``;
the detected parameters are mapped onto the checkpoint's tensors (``conserve.checkpoint.resolve``: names
that differ by one prefix, and the per-expert or transposed on-disk layouts of MoE experts).

Integer, bool and 8-bit-float (quantised) tensors are refused before evaluation (one line naming the
tensor and the fix); NaN/Inf weights are named with their counts after the values are printed (exit 2).

Prints a table per layer (family, laws, instances, parameters read), the declined blocks with their
reasons and every module with no law detected. ``--values`` evaluates the invariants from the
checkpoint tensors (``conserve.laws.evaluate_laws``; Triton kernels on GPU, float64 accumulation),
one layer at a time. ``--compare OTHER`` (or a second PATH) prints the drift per law family between
the two checkpoints: the paper's ``eps = mean_i ||h_i(B) - h_i(A)|| / ||h_i(A)||`` (spec "The paper's
error metric"; guarded as in ``conserve.tracker``).

A raw ``.safetensors`` file without a config is read from its tensor names only for the layouts
where that is unambiguous (HF Llama-style and GPT-2 names); it needs ``--num-heads`` (the split of
q rows into heads is not in the shapes) and, with RoPE, ``--rope-layout`` (HF's converter permutes
q/k rows, so the pairing cannot be known: spec "RoPE layouts").
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..checkpoint import Checkpoint, check_float, describe_nonfinite, nonfinite, open_checkpoint, resolve
from ..errors import NonFiniteError, UsageError
from ..laws import Law, Ref, evaluate_laws
from ..tracking.book import guarded_denominators



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="HF checkpoint directory or .safetensors file; a second PATH compares the two")
    p.add_argument("--compare", metavar="OTHER", help="second checkpoint: print the drift per law family")
    p.add_argument("--values", action="store_true", help="evaluate the invariants of the checkpoint")
    p.add_argument("--laws", action="store_true", help="list every law with the exact rows/columns it reads")
    p.add_argument("--rope-layout", choices=("half", "interleaved"),
                   help="RoPE pairing of the q/k rows (required for raw checkpoints of RoPE models)")
    p.add_argument("--num-heads", type=int, help="query heads (raw checkpoints: not in the shapes)")
    p.add_argument("--num-kv-heads", type=int, help="key/value heads (raw checkpoints; default: from k_proj rows)")
    p.add_argument("--loss", default="ce", help="training loss of the logits; the translation law needs 'ce'")
    p.add_argument("--approximate", action="store_true",
                   help="keep laws that hold only up to a norm's eps (QK-norm scale laws)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="law evaluator: auto (Triton on CUDA tensors, torch reference on CPU), torch, triton")
    p.add_argument("--fp32", action="store_true", help="accumulate in float32 instead of float64 (faster on GPU; "
                   "too coarse for the drift of a few steps)")
    p.add_argument("--device", default="auto", help="where --values/--compare evaluate: auto (cuda if present), "
                   "cpu, cuda")


# ------------------------------------------------------------------------------- detection
_LLAMA = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.q_proj\.weight$")
_GPT2 = re.compile(r"^(.*?)h\.(\d+)\.attn\.c_attn\.weight$")


def _need_heads(args, q_rows: int) -> int:
    if not args.num_heads:
        raise UsageError("a raw checkpoint does not say how the q rows split into heads: pass --num-heads "
                         "(and --num-kv-heads for GQA), or put the model's config.json beside the file")
    if q_rows % args.num_heads:
        raise UsageError(f"--num-heads={args.num_heads} does not divide the {q_rows} query rows")
    return args.num_heads


def config_from_names(shapes: dict[str, tuple[int, ...]], args) -> tuple[dict, bool]:
    """An HF config dict for a raw checkpoint, from tensor names and shapes where unambiguous.

    Returns ``(config, uses_rope)``. Recognised: HF Llama-style names (``layers.{i}.self_attn.q_proj``,
    ``mlp.{gate,up,down}_proj``; Qwen3 when ``q_norm`` is present) and GPT-2 names (``h.{i}.attn.c_attn``).
    Raises UsageError saying what is missing."""
    llama = {m.group(2): m.group(1) for k in shapes if (m := _LLAMA.match(k))}
    gpt2 = {m.group(2): m.group(1) for k in shapes if (m := _GPT2.match(k))}
    if llama:
        pre = next(iter(llama.values()))
        L = len(llama)
        g = lambda i, n: shapes.get(f"{pre}layers.{i}.{n}")  # noqa: E731
        if any(".experts." in k or re.search(r"mlp\.(gate|router)\.weight$", k) for k in shapes):
            raise UsageError("a raw mixture-of-experts checkpoint is ambiguous (router kind, top_k): put the "
                             "model's config.json beside the file")
        if g(0, "mlp.gate_proj.weight") is None:
            raise UsageError("raw checkpoint with Llama attention names but no mlp.gate_proj: not recognised; "
                             "put the model's config.json beside the file")
        q, k = g(0, "self_attn.q_proj.weight"), g(0, "self_attn.k_proj.weight")
        nh = _need_heads(args, q[0])
        d = q[0] // nh
        if k[0] % d:
            raise UsageError(f"k_proj has {k[0]} rows, not a multiple of head_dim={d} (--num-heads={nh})")
        nkv = args.num_kv_heads or k[0] // d
        if nkv * d != k[0]:
            raise UsageError(f"--num-kv-heads={nkv} x head_dim={d} != {k[0]} k_proj rows")
        emb = shapes.get(f"{pre}embed_tokens.weight")
        hidden = q[1]
        cfg = dict(model_type="qwen3" if g(0, "self_attn.q_norm.weight") else "llama",
                   vocab_size=emb[0] if emb else 32000, hidden_size=hidden,
                   intermediate_size=g(0, "mlp.up_proj.weight")[0], num_hidden_layers=L,
                   num_attention_heads=nh, num_key_value_heads=nkv, head_dim=d,
                   attention_bias=g(0, "self_attn.q_proj.bias") is not None,
                   mlp_bias=g(0, "mlp.up_proj.bias") is not None,
                   tie_word_embeddings=not any(n.endswith("lm_head.weight") for n in shapes))
        cfg["architectures"] = ["Qwen3ForCausalLM" if cfg["model_type"] == "qwen3" else "LlamaForCausalLM"]
        return cfg, True
    if gpt2:
        pre = next(iter(gpt2.values()))
        ca = shapes[f"{pre}h.0.attn.c_attn.weight"]  # Conv1D: (in, 3 * out)
        nh = _need_heads(args, ca[1] // 3)
        wte, wpe = shapes.get(f"{pre}wte.weight"), shapes.get(f"{pre}wpe.weight")
        if wte is None or wpe is None:
            raise UsageError("raw GPT-2 checkpoint without wte/wpe: put the model's config.json beside the file")
        cfg = dict(model_type="gpt2", vocab_size=wte[0], n_embd=wte[1], n_positions=wpe[0], n_layer=len(gpt2),
                   n_head=nh, n_inner=shapes[f"{pre}h.0.mlp.c_fc.weight"][1], architectures=["GPT2LMHeadModel"],
                   tie_word_embeddings=not any(n.endswith("lm_head.weight") for n in shapes))
        return cfg, False
    raise UsageError("cannot tell the architecture of a raw .safetensors file from its tensor names (known: HF "
                     "Llama-style and GPT-2 names); put the model's config.json beside the file")


def detect_checkpoint(ck: Checkpoint, args):
    """``(Detection, {param name: checkpoint key})`` for a checkpoint. The Detection also carries ``shapes``
    (the model's shape of every parameter a law reads) and ``rename`` (transformers' on-load key renaming),
    which ``resolve`` needs to map a second checkpoint. Raises UsageError."""
    try:
        from ..detection import detect
        from ..detection.hf import meta_model
    except ImportError as e:  # transformers missing
        raise UsageError(f"inspecting an HF checkpoint needs transformers ({e}); pip install transformers") from None
    options = dict(loss=args.loss)
    if args.approximate:
        options["approximate"] = True
    if args.rope_layout:
        options["rope_layout"] = args.rope_layout
    if ck.raw:
        config, rope = config_from_names(ck.shapes, args)
        if rope and not args.rope_layout:
            raise UsageError("--rope-layout half|interleaved is required for a raw checkpoint of a RoPE model: HF's "
                             "converter permutes the q/k rows of Meta checkpoints, so the pairing of rotary dims "
                             "cannot be known from shapes (spec: RoPE layouts)")
        options["require_rope_layout"] = True
    else:
        config = dict(ck.config)
        if "model_type" not in config:
            raise UsageError(f"{ck.path}: config.json has no 'model_type'; it is not an HF transformers config")
        if args.num_heads or args.num_kv_heads:
            raise UsageError("--num-heads/--num-kv-heads are for raw .safetensors files; the config.json says "
                             "how many heads there are")
    import transformers

    where = ck.path if ck.raw else Path(ck.path) / "config.json"
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING as known
    except ImportError:  # pragma: no cover - another layout of transformers: its own error below, cut short
        known = None
    if not ck.raw and known is not None and config["model_type"] not in known:
        close = difflib.get_close_matches(str(config["model_type"]), list(known.keys()), n=4, cutoff=0.6)
        raise UsageError(f"{where}: model_type {config['model_type']!r} is not one this transformers "
                         f"{transformers.__version__} knows" + (f" (close: {', '.join(close)})" if close else "")
                         + "; fix the config's model_type, or upgrade transformers")
    try:
        cfg = transformers.AutoConfig.for_model(**config)
        model = meta_model(cfg)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - a config transformers refuses (its validators raise several types)
        broken = _optional_import_error(e)
        if broken is not None:  # another installed package failed to import, not the config
            raise UsageError(broken) from None
        raise UsageError(f"{where}: transformers cannot build a model from this config ({_last_line(e)}); fix "
                         "config.json so it matches the weights, or re-save the checkpoint with save_pretrained") from None
    try:
        found = detect(model, cfg, **options)
    except UsageError as e:  # UnsupportedModelError: its advice is for the Python API
        raise UsageError(_cli_wording(str(e))) from None
    found.declined = [dataclasses.replace(d, reason=_cli_wording(d.reason)) for d in found.declined]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    found.shapes = {p: shapes[p] for law in found.laws for p in law.params}  # for resolve() of a second checkpoint
    found.rename = _hf_rename(model)
    names = resolve(ck, found.shapes, found.rename)
    _check_fits(found.laws, names, ck)
    return found, names


def _optional_import_error(e: BaseException) -> str | None:
    """The message for an ``ImportError`` (in ``e`` or the exceptions it wraps: transformers re-raises the
    import error of a modelling module as a ``RuntimeError``) that comes from a package other than transformers
    and conserve (an optional dependency of the modelling code, e.g. an incompatible ``torchao``); None for
    any other error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ImportError):
            module = e.name or ""
            if not module:
                m = re.search(r"from '?([A-Za-z_][\w.]*)'?", str(e))
                module = m.group(1) if m else ""
            top = module.split(".")[0]
            if top == "torch":  # transformers and torch of versions that do not go together
                return (f"transformers {getattr(sys.modules.get('transformers'), '__version__', '')} failed to import "
                        f"from torch {torch.__version__}: {module}: {_last_line(e)}; install versions of transformers "
                        "and torch that go together")
            if top and top not in ("transformers", "conserve"):
                return (f"an installed optional package failed to import: {module}: {_last_line(e)}; fix or "
                        f"uninstall it (pip install -U {top}, or pip uninstall {top})")
            return None
        e = e.__cause__ or e.__context__
    return None


def _last_line(e: BaseException) -> str:
    """The last non-empty line of an exception's message (transformers' validators wrap the cause in a
    multi-line message whose last line is the reason)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    line = lines[-1] if lines else type(e).__name__
    return line if len(line) <= 300 else line[:300] + " ..."


_PY_ADVICE = (
    (": pass example_inputs=(...) (what forward takes)",
     ": the CLI cannot pass model inputs; run conserve.detect(model, example_inputs=(...)) from Python"),
    ("or example_inputs= if forward needs a particular input",
     "or, from Python, conserve.detect(model, example_inputs=(...)) if forward needs a particular input "
     "(the CLI cannot pass one)"),
)


def _cli_wording(text: str) -> str:
    """Detection's advice reworded for the CLI (``example_inputs=`` is a Python argument, not an option)."""
    for old, new in _PY_ADVICE:
        text = text.replace(old, new)
    return text


def _hf_rename(model):
    """``key -> key`` applying the renamings transformers itself applies on load to this model's checkpoint
    keys (``conversion_mapping``: e.g. GPT-NeoX ``embed_out.`` -> ``lm_head.``, Mixtral ``block_sparse_moe``
    -> ``mlp``); the identity when this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        maps = [t for t in get_model_conversion_mapping(model)
                if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)]
    except Exception:  # noqa: BLE001 - older transformers, or a model it cannot map: names are used as written
        return None

    def rename(key: str) -> str:
        for t in maps:
            key = t.rename_source_key(key)[0]
        return key

    return rename if maps else None


def _check_fits(laws, names, ck) -> None:
    """Every law must fit the checkpoint's tensors (the config matches the weights). Raises UsageError."""
    from ..laws import compile_laws

    try:
        compile_laws(laws, {p: ck.shapes[k] for p, k in names.items()})
    except ValueError as e:
        raise UsageError(f"{ck.path}: the weights do not match the config ({e})") from None


# ------------------------------------------------------------------------------- evaluation
def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here; use --device cpu")
    return torch.device(spec)


def _groups(laws: list[Law]) -> dict:
    out = defaultdict(list)
    for law in laws:
        out[law.layer].append(law)
    return out


def _abs(law: Law) -> Law:
    return dataclasses.replace(law, terms=[dataclasses.replace(t, sign=abs(t.sign)) for t in law.terms])


def evaluate_checkpoint(ck: Checkpoint, laws: list[Law], names: dict[str, str], device="cpu", *,
                        magnitude: bool = False, fp64: bool = True, backend: str = "auto",
                        bad: dict | None = None) -> dict[str, torch.Tensor]:
    """``{law.name: h}`` from the checkpoint's tensors (float64 accumulation unless ``fp64=False``), one layer
    at a time so only that layer's tensors are in memory. ``magnitude=True`` evaluates every term with a
    + sign instead (the scale used to guard ``eps``). ``backend``: see ``conserve.kernels.evaluate``.
    Values are returned on the CPU as float64. NaN/Inf tensors are counted into ``bad`` ({checkpoint key:
    (NaN count, Inf count)}) when given (their laws then evaluate to NaN/Inf)."""
    out = {}
    for _, group in sorted(_groups(laws).items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        need = list(dict.fromkeys(p for law in group for p in law.params))
        loaded = ck.tensors([names[p] for p in need], device)
        tensors = {p: loaded[names[p]] for p in need}
        if bad is not None:
            bad.update(nonfinite(loaded))
        vals = evaluate_laws([_abs(l) for l in group] if magnitude else group, tensors, fp64=fp64, backend=backend)
        out.update({k: v.detach().to("cpu", torch.float64) for k, v in vals.items()})
        del loaded, tensors
    return out


def instances(law: Law, value: torch.Tensor) -> torch.Tensor:
    """Per-instance norms (spec eps instances): every entry (``per='entry'``) or the whole law (``per='law'``,
    Frobenius)."""
    return value.reshape(-1).abs() if law.per == "entry" else value.reshape(1, -1).norm(dim=1)


def compare(laws: list[Law], a: dict, b: dict, mag: dict) -> dict[str, dict]:
    """Per family: ``eps`` (mean over instances of ||h(B) - h(A)|| / guarded ||h(A)||), ``max`` and the count."""
    rel = defaultdict(list)
    for law in laws:
        num = instances(law, b[law.name] - a[law.name])
        den = instances(law, a[law.name])
        m = instances(law, mag[law.name])
        # the tracker's guard; an instance that is 0 with every sign + (all its weights 0) counts 0
        r = torch.where(m > 0, num / guarded_denominators(den, m), torch.zeros_like(num))
        rel[law.family].append(r)
    out = {}
    for fam, rs in rel.items():
        r = torch.cat(rs)
        out[fam] = dict(instances=r.numel(), eps=float(r.mean()), max=float(r.max()))
    return out


# ------------------------------------------------------------------------------------ output
def describe_ref(ref: Ref) -> str:
    """``rows 0:4 of q_proj.weight`` / ``cols 4:8 of o_proj.weight`` / ``[0:16] of norm.weight``."""
    lead = "".join(f"[{i}]" for i in ref.start[: ref.row_dim if ref.col_dim is None else min(ref.row_dim, ref.col_dim)])
    a = ref.start[ref.row_dim]
    step = f":{ref.row_step}" if ref.row_step != 1 else ""
    span = f"{a}:{a + ref.rows * ref.row_step}{step}"
    if ref.col_dim is None:
        return f"{ref.param}{lead}[{span}]"
    kind = "rows" if ref.row_dim < ref.col_dim else "cols"
    return f"{kind} {span} of {ref.param}{lead}"


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    pre = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        pre.append(seg[0])
    pre = pre[: len(min(parts, key=len)) - 1]
    return ".".join(pre) + "." if pre else ""


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False, highlight=False)


def _layer(l) -> str:
    return "-" if l is None else str(l)


def print_detection(con, title: str, det, names: dict[str, str], show_laws: bool) -> None:
    from rich.table import Table

    t = Table(title=f"{title}: {len(det.laws)} laws ({det.detector} detector)", show_lines=False)
    for col in ("layer", "family", "laws", "instances", "parameters read"):
        t.add_column(col, overflow="fold", justify="right" if col in ("laws", "instances") else "left")
    rows_ = defaultdict(list)
    for law in det.laws:
        rows_[(law.layer, law.family)].append(law)
    for (layer, fam), laws in sorted(rows_.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])):
        params = list(dict.fromkeys(names.get(p, p) for law in laws for p in law.params))
        pre = _common_prefix(params) if len(params) > 1 else ""
        n_inst = sum(law.size if law.per == "entry" else 1 for law in laws)
        t.add_row(_layer(layer), fam, str(len(laws)), str(n_inst),
                  (f"{pre}{{" if pre else "") + ", ".join(p[len(pre):] for p in params) + ("}" if pre else ""))
    con.print(t)
    if show_laws:
        for law in det.laws:
            terms = "  ".join(f"{'+' if tm.sign > 0 else '-'}{tm.kind}({describe_ref(dataclasses.replace(tm.ref, param=names.get(tm.ref.param, tm.ref.param)))})"
                              for tm in law.terms)
            con.print(f"{law.name} [{law.family}, size {law.size}]: {terms}", overflow="fold")
    if det.declined:
        d = Table(title=f"declined ({len(det.declined)})")
        for col in ("module", "block", "reason"):
            d.add_column(col, overflow="fold")
        for x in det.declined:
            d.add_row(x.module, x.block, x.reason)
        con.print(d)
    for u in det.undetected:
        con.print(f"no law detected: {u}")


def print_values(con, laws, vals, mag) -> None:
    from rich.table import Table

    fam = defaultdict(lambda: [0, [], []])
    linear = {law.family for law in laws if law.linear}
    for law in laws:
        v, m = instances(law, vals[law.name]), instances(law, mag[law.name])
        f = fam[law.family]
        f[0] += v.numel()
        f[1].append(v)
        f[2].append(torch.where(m > 0, v / m.clamp_min(1e-300), torch.zeros_like(v)))
    t = Table(title="invariant values per family",
              caption="|h_i|: the instance's absolute value (Frobenius norm for Gram laws); imbalance: |h_i| over the "
                      "same sum with every sign + (0 = balanced, 1 = one side only; '-' for linear laws)")
    for col in ("family", "instances", "mean |h_i|", "max |h_i|", "mean imbalance"):
        t.add_column(col, justify="right" if col != "family" else "left")
    for name, (n, vs, rs) in sorted(fam.items()):
        v, r = torch.cat(vs), torch.cat(rs)
        t.add_row(name, str(n), f"{float(v.mean()):.6g}", f"{float(v.max()):.6g}",
                  "-" if name in linear else f"{float(r.mean()):.4g}")
    con.print(t)


def print_compare(con, a: str, b: str, drift: dict) -> None:
    from rich.table import Table

    t = Table(title="drift per law family", caption=f"eps = mean_i ||h_i(B) - h_i(A)|| / ||h_i(A)|| (paper's error; "
              f"guarded as in conserve.tracker)\nA = {a}\nB = {b}")
    for col in ("family", "instances", "eps", "max"):
        t.add_column(col, justify="right" if col != "family" else "left")
    for fam, d in sorted(drift.items()):
        t.add_row(fam, str(d["instances"]), f"{d['eps']:.6e}", f"{d['max']:.6e}")
    con.print(t)


def main(args) -> int:
    paths = list(args.paths)
    if args.compare:
        paths.append(args.compare)
    if len(paths) > 2:
        raise UsageError(f"at most two checkpoints (PATH [OTHER] or PATH --compare OTHER), got {len(paths)}")
    ck = _open(paths[0])
    other = _open(paths[1]) if len(paths) == 2 else None
    det, names = detect_checkpoint(ck, args)
    con = _console()
    src = "raw safetensors (architecture from tensor names)" if ck.raw else f"config model_type={ck.config.get('model_type')!r}"
    n_disk = sum(1 for k in ck.shapes if k not in ck.fused or ck.fused[k].keys() == [k])
    con.print(f"{paths[0]}: {n_disk} tensors, {src}")
    if ck.fused:
        con.print(f"read through the checkpoint's layout ({len(ck.fused)} model tensors): "
                  + "; ".join(_describe_fused(n, f) for n, f in list(ck.fused.items())[:3])
                  + ("; ..." if len(ck.fused) > 3 else ""), overflow="fold")
    print_detection(con, str(paths[0]), det, names, args.laws)
    if not (args.values or other is not None):
        return 0
    if not det.laws:
        raise UsageError(f"{paths[0]}: no law detected, nothing to evaluate")
    dev = _device(args.device)
    kw = dict(fp64=not args.fp32, backend=args.backend)
    check_float(ck, names.values())
    bad: dict = {}
    vals = evaluate_checkpoint(ck, det.laws, names, dev, bad=bad, **kw)
    mag = evaluate_checkpoint(ck, det.laws, names, dev, magnitude=True, **kw)
    if args.values:
        print_values(con, det.laws, vals, mag)
    nonfinite_in = [(paths[0], bad, ck)] if bad else []
    if other is not None:
        try:
            names_b = resolve(other, det.shapes, det.rename)
        except UsageError as e:
            raise UsageError(f"{paths[1]} does not hold the same model: {e}") from None
        diff = [p for p, k in names_b.items() if other.shapes[k] != ck.shapes[names[p]]]
        if diff:
            raise UsageError(f"{paths[1]} does not hold the same model: {diff[0]!r} has shape "
                             f"{other.shapes[names_b[diff[0]]]} there, {ck.shapes[names[diff[0]]]} in {paths[0]}")
        check_float(other, names_b.values())
        bad_b: dict = {}
        vals_b = evaluate_checkpoint(other, det.laws, names_b, dev, bad=bad_b, **kw)
        print_compare(con, paths[0], paths[1], compare(det.laws, vals, vals_b, mag))
        if bad_b:
            nonfinite_in.append((paths[1], bad_b, other))
    if nonfinite_in:
        _nonfinite(con, nonfinite_in)
    return 0


_TORCH_FILES = (".pt", ".pth", ".bin", ".ckpt")


def _open(path: str) -> Checkpoint:
    """``open_checkpoint``; a torch pickle (``.pt``/``.pth``/``.bin``/``.ckpt``) is refused with how to convert it."""
    p = Path(path)
    if p.is_file() and p.suffix in _TORCH_FILES:
        raise UsageError(f"{p}: a torch pickle, not safetensors (only safetensors is read: no code runs on load); "
                         "convert it: from safetensors.torch import save_file; save_file(torch.load(path, "
                         "weights_only=True), 'model.safetensors') for a state dict, or model.save_pretrained(dir) "
                         "for an HF model")
    return open_checkpoint(path)


def _describe_fused(name: str, f) -> str:
    """``model.layers.0.mlp.experts.gate_up_proj = stack of (experts.0.w1.weight, experts.0.w3.weight) x 3``."""
    if not f.stack:
        return f"{name} = {f.parts[0][0]}" + (" transposed" if f.transpose else "")
    first = ", ".join(f.parts[0])
    return f"{name} = stack of ({first}) x {len(f.parts)}" + (" transposed" if f.transpose else "")


def _nonfinite(con, found: list) -> None:
    """Name the NaN/Inf tensors of each checkpoint in the output, then fail (exit 2), after everything that
    was computed has been printed. ``found``: ``[(path, {key: (nan, inf)}, Checkpoint)]``."""
    texts = []
    for path, bad, ck in found:
        text = describe_nonfinite(bad, ck.shapes)
        con.print(f"non-finite weights in {path}: {text}", overflow="fold")
        texts.append(f"{path}: {len(bad)} weight tensor(s) hold NaN/Inf ({text})")
    raise NonFiniteError("; ".join(texts) + "; the laws that read them are NaN: the training diverged or the file "
                         "is corrupt, inspect an earlier checkpoint")
