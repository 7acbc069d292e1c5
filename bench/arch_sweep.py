"""Architecture sweep: ``conserve.detect`` on every model type the installed transformers can build (and a set
of timm models), each from a tiny random config, every found law checked independently.

Not a test (nothing here passes or fails): it prints one row per architecture and a summary of counts.

For each HF ``model_type`` of the chosen auto mappings (``--families``: ``causal`` = AutoModelForCausalLM,
``masked`` = AutoModelForMaskedLM, ``seq2seq`` = AutoModelForSeq2SeqLM, ``vision`` = image classification)
the config class is built from its defaults with every size shrunk (hidden size, layers, heads, kv heads,
head_dim, MLP / expert widths, experts, vocab, positions, image / patch size; per-layer lists truncated;
sub-configs shrunk the same way); architectures whose config cannot be shrunk or whose model needs a package
that is not installed are ``skipped`` with the reason. The model gets random unit-scale weights (biases and
routers not zero, as in ``tests/test_detect_hf.py``) and ``conserve.detect(model)`` runs on it:

* ``raised``: detect raised anything but a ``UsageError`` / ``UnsupportedModelError`` (those are ``usage``,
  their message is printed: it must name the fix);
* ``refuted``: a law detect claims fails the independent check: the spec's first-order check in float64
  (``conserve.analysis.verify.first_order`` on the model's own, untraced forward with transformers' float32
  upcasts made float64, as ``tests/test_detect_hf.py``'s ``exact64``) above ``--tol``; ``unchecked`` when
  that forward cannot run on synthesised inputs;
* ``detected`` (at least one law, none refuted) or ``none`` (no law found: every block declined).

timm (``--timm``): the smallest variants of the main families, ``pretrained=False``, at a small image size where
the model allows it; the same check on the logits.

Run: ``OMP_NUM_THREADS=1 python -m bench.arch_sweep [--families causal,masked,seq2seq,vision] [--timm]
[--only llama,gpt2] [--json out.json] [--verbose]`` (the 196 causal-LM types of transformers 5.24 took ~38 min
on a shared 2-core CPU; ``--compare BEFORE AFTER`` prints what changed between two runs). Each architecture runs
in a forked child, killed after ``--timeout`` s; ``--max-checks`` laws per family are checked (default 12).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import time
import traceback
import warnings

import torch

from conserve.analysis.verify import code_in_float64

H, NH, NKV, HD, INTER, LAYERS, VOCAB, EXPERTS, TOPK, MOE_INTER, POS = 32, 4, 2, 8, 48, 2, 128, 4, 2, 16, 64

# config attribute -> tiny value (only attributes the config class has are set)
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim", "model_dim",
                     "hidden_dim_model", "embedding_size", "d_embed", "emb_dim"), H),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "n_heads", "num_attention_heads_per_layer"), NH),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_key_value_groups_model"), NKV),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "d_kv", "attention_head_size"), HD),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                     "ffn_hidden_size", "inner_hidden_size", "ffn_size", "mlp_dim", "dim_feedforward"), INTER),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "expert_dim", "moe_dim", "shared_intermediate_size"), MOE_INTER),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "n_layers",
                     "num_decoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"),
                    EXPERTS),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx",
                     "max_target_positions", "max_source_positions"), POS),
    "vocab_size": VOCAB,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": HD,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "topk_method_group": 1,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
CAPPED = {"num_experts_per_tok": TOPK, "moe_topk": TOPK, "top_k": TOPK, "num_selected_experts": TOPK,
          "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "rotary_dim": HD // 2,
          "sliding_window": 16, "local_window_size": 16, "attention_window": 16, "window_size": 16,
          "num_kv_shared_layers": 0}
MAX_PARAMS = 3e6
MAX_CHECKS = 12  # laws checked per family and architecture (0: all)
MAX_RSS = 8 << 30  # bytes of address space per architecture
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "n_layers")


class Skip(Exception):
    """The architecture is not swept (the message says why)."""


class Timeout(Exception):
    pass


def shrink(cfg):
    """A tiny copy of ``cfg`` (a ``PretrainedConfig`` built from its class defaults)."""
    d = cfg.to_dict()
    over = {}
    for k, v in d.items():
        if k in SIZES and isinstance(v, int) and not isinstance(v, bool):
            over[k] = SIZES[k]
        elif k in CAPPED and isinstance(v, int) and not isinstance(v, bool) and v > CAPPED[k]:
            over[k] = CAPPED[k]
    n_old = next((d[k] for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    n_new = next((over[k] for k in LAYER_KEYS if k in over), None)
    for k, v in d.items():  # per-layer lists (layer_types, no_rope_layers, ...): truncated
        if isinstance(v, list) and n_old and len(v) == n_old and n_new:
            over[k] = v[:n_new]
    for k, v in d.items():  # token ids must stay inside the shrunk vocabulary
        if k.endswith("token_id") and isinstance(v, int) and v >= VOCAB:
            over[k] = v % VOCAB
        if k.endswith("token_ids") and isinstance(v, list):
            over[k] = [x % VOCAB if isinstance(x, int) else x for x in v]
    from transformers import PretrainedConfig

    for name in d:  # sub-configs (text_config, vision_config, encoder_config, patcher_config, ...)
        sub = getattr(cfg, name, None)
        if isinstance(sub, PretrainedConfig):
            over[name] = shrink(sub).to_dict()
    if "kv_lora_rank" in d and "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: head_dim is the rotary width
        over["head_dim"] = over["qk_rope_head_dim"]
        if "num_key_value_heads" in d:  # MLA keys are built per query head
            over["num_key_value_heads"] = NH
    if over.get("head_dim") and over.get("hidden_size") and "num_attention_heads" not in over and \
            "num_attention_heads" in d:
        over["num_attention_heads"] = NH
    try:
        return type(cfg)(**over)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"config cannot be shrunk: {type(e).__name__}: {str(e)[:120]}") from e


def _auto(family: str):
    import transformers as T
    from transformers.models.auto import modeling_auto as ma

    return {"causal": (T.AutoModelForCausalLM, ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
            "masked": (T.AutoModelForMaskedLM, ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
            "seq2seq": (T.AutoModelForSeq2SeqLM, ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
            "vision": (T.AutoModelForImageClassification, ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)}[family]


@torch.no_grad()
def randomize(model):
    """Unit-scale random weights (as tests/test_detect_hf.py): biases and routers not zero, norm gains near 1."""
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name.lower() else 0.0))
    return model


def build(model_type: str, family: str):
    import transformers as T

    auto, names = _auto(family)
    try:
        cfg_cls = T.AutoConfig.for_model(model_type).__class__
        cfg = shrink(cfg_cls())
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001
        raise Skip(f"config: {type(e).__name__}: {str(e)[:120]}") from e
    cls_name = names[model_type]
    cls_name = cls_name[0] if isinstance(cls_name, (tuple, list)) else cls_name
    cls = getattr(T, cls_name, None)
    if cls is None:
        raise Skip(f"{cls_name} not importable")
    last = None
    for kw in ({"attn_implementation": "eager", "experts_implementation": "eager"}, {"attn_implementation": "eager"},
               {}):
        try:
            with torch.device("meta"):  # size first: a config that did not shrink is not allocated
                n = sum(p.numel() for p in cls._from_config(cfg, **kw).parameters())
            break
        except ImportError as e:
            raise Skip(f"needs a package: {str(e)[:120]}") from e
        except Exception as e:  # noqa: BLE001
            last = e
    else:
        raise Skip(f"build: {type(last).__name__}: {str(last)[:140]}")
    if n > MAX_PARAMS:
        raise Skip(f"{n / 1e6:.1f}M parameters after shrinking (some size of the config did not shrink)")
    torch.manual_seed(0)
    try:
        m = cls._from_config(cfg, **kw)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"build: {type(e).__name__}: {str(e)[:140]}") from e
    return randomize(m.eval()), cfg


exact64 = code_in_float64  # the model's own code in float64 (conserve.analysis.verify)


def hf_inputs(model, cfg):
    """``(positional inputs, forward)``: token ids (and decoder ids for encoder-decoders) or images -> logits."""
    g = torch.Generator().manual_seed(1)
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", VOCAB)
    fwd = type(model).forward
    if getattr(cfg, "is_encoder_decoder", False):
        ids = torch.randint(3, vocab, (2, 6), generator=g)
        dec = torch.randint(3, vocab, (2, 5), generator=g)
        return ids, lambda x: fwd(model, input_ids=x, decoder_input_ids=dec, use_cache=False).logits
    if "pixel_values" in fwd.__code__.co_varnames[:4] and "input_ids" not in fwd.__code__.co_varnames[:4]:
        s = getattr(cfg, "image_size", 32)
        s = s[0] if isinstance(s, (list, tuple)) else s
        x = torch.randn(2, getattr(cfg, "num_channels", 3), s, s, generator=g, dtype=torch.float64)
        return x, lambda x: fwd(model, pixel_values=x).logits
    ids = torch.randint(3, vocab, (2, 6), generator=g)
    kw = {"use_cache": False} if "use_cache" in fwd.__code__.co_varnames else {}
    return ids, lambda x: fwd(model, input_ids=x, **kw).logits


def check_laws(model, laws, inputs_fn, tol):
    """``{law name: first-order violation}`` on the model's own float64 forward (``exact64``), or a string why not."""
    from conserve.analysis.verify import first_order

    if not laws:
        return {}
    m = copy.deepcopy(model).to(torch.float64)
    x, f = inputs_fn(m)
    m.forward = f
    try:
        with exact64(m), torch.enable_grad():
            m(x)
    except Exception as e:  # noqa: BLE001
        return f"forward: {type(e).__name__}: {str(e)[:100]}"
    out, per = {}, {}
    with exact64(m):
        for law in laws:
            per[law.family] = per.get(law.family, 0) + 1
            if MAX_CHECKS and per[law.family] > MAX_CHECKS:  # the first MAX_CHECKS laws of each family (all layers' kinds)
                continue
            try:
                out[law.name] = first_order(m, law, x, trials=1)
            except Timeout:
                raise
            except Exception as e:  # noqa: BLE001
                out[law.name] = float("nan")
                out.setdefault("_errors", []).append(f"{law.name}: {type(e).__name__}: {str(e)[:80]}")
    return out


def _alarm(sig, frame):
    raise Timeout()


def run_one(name, make, inputs_fn, tol, timeout):
    """``_run_one`` in a forked child (killed after ``timeout`` s, memory capped at ``MAX_RSS``): a hang in C code
    or a config that did not shrink cannot stop the sweep."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MAX_RSS, MAX_RSS))
        send.send(_run_one(name, make, inputs_fn, tol, timeout))
        os._exit(0)  # no interpreter shutdown (atexit hooks, threads) in the child

    t0 = time.time()
    p = ctx.Process(target=child)
    p.start()
    row = recv.recv() if recv.poll(timeout + 30) else None
    p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    if row is None:
        row = {"arch": name, "status": "timeout" if p.exitcode in (None, -9) else "sweep-error", "detector": "",
               "families": {}, "declined": 0, "refuted": [], "secs": round(time.time() - t0, 1),
               "msg": f"killed after {timeout + 30}s" if p.exitcode in (None, -9) else f"child exit code {p.exitcode}"}
    return row


def _run_one(name, make, inputs_fn, tol, timeout):
    """One row: status, detector, families, declined, refuted laws, message."""
    from conserve import detect
    from conserve.errors import UnsupportedModelError, UsageError

    row = {"arch": name, "status": "", "detector": "", "families": {}, "declined": 0, "refuted": [], "msg": "",
           "secs": 0.0}
    t0 = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        try:
            model, cfg = make()
        except Skip as e:
            row.update(status="skipped", msg=str(e))
            return row
        try:
            d = detect(model)
        except (UsageError, UnsupportedModelError) as e:
            row.update(status="usage", msg=f"{type(e).__name__}: {e}")
            return row
        except Timeout:
            raise
        except Exception as e:  # noqa: BLE001
            tb = traceback.extract_tb(e.__traceback__)[-1]
            row.update(status="raised", msg=f"{type(e).__name__}: {str(e)[:200]} @ {tb.filename.split('/')[-1]}:"
                                            f"{tb.lineno}")
            return row
        row.update(detector=d.detector, families=d.families(), declined=len(d.declined),
                   undetected=list(d.undetected)[:5], reasons=[f"{x.module}: {x.block}: {x.reason}"[:200]
                                                              for x in d.declined][:40])
        res = check_laws(model, d.laws, lambda m: inputs_fn(m, cfg), tol)
        if isinstance(res, str):
            row.update(status="unchecked" if d.laws else "none", msg=res)
            return row
        errs = res.pop("_errors", [])
        bad = {k: v for k, v in res.items() if not v <= tol}
        row["refuted"] = [f"{k} ({v:.1e})" for k, v in bad.items()]
        row["worst"] = max(res.values(), default=0.0)
        row["status"] = "refuted" if bad else ("detected" if d.laws else "none")
        row["msg"] = "; ".join(errs)[:200]
        return row
    except Timeout:
        row.update(status="timeout", msg=f"> {timeout}s")
        return row
    except Exception as e:  # noqa: BLE001 - the sweep goes on
        row.update(status="sweep-error", msg=f"{type(e).__name__}: {str(e)[:200]}")
        return row
    finally:
        signal.alarm(0)
        row["secs"] = round(time.time() - t0, 1)
        gc.collect()


TIMM = ["vit_tiny_patch16_224", "deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "vit_small_patch16_224",
        "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "convnext_atto", "convnextv2_atto", "resnet18",
        "resnet10t", "efficientnet_b0", "mobilenetv3_small_050", "mixer_s32_224", "resmlp_12_224", "eva02_tiny_patch14_224",
        "beit_base_patch16_224", "cait_xxs24_224", "xcit_nano_12_p16_224", "levit_128s", "poolformer_s12", "regnetx_002",
        "vit_little_patch16_reg4_gap_256", "vit_medium_patch16_gap_256", "flexivit_small", "pvt_v2_b0", "coat_tiny",
        "twins_svt_small", "maxvit_nano_rw_256", "gmlp_ti16_224", "convmixer_768_32", "edgenext_xx_small",
        "mobilevit_xxs", "efficientformer_l1", "crossvit_tiny_240", "vit_base_patch16_siglip_224", "fastvit_t8",
        "hiera_tiny_224", "ghostnet_050", "densenet121", "dla34"]
TIMM_SMALL = {"img_size": 32}  # tried first; many timm models take it (patch models need img_size % patch == 0)


def timm_make(name):
    def make():
        import timm

        torch.manual_seed(0)
        for kw in ({"img_size": 64, "num_classes": 10}, {"num_classes": 10}):
            try:
                m = timm.create_model(name, pretrained=False, **kw)
                break
            except TypeError:
                continue
            except Exception as e:  # noqa: BLE001
                raise Skip(f"create_model: {type(e).__name__}: {str(e)[:120]}") from e
        else:
            raise Skip("create_model failed")
        return randomize(m.eval()), kw
    return make


def timm_inputs(model, kw):
    s = kw.get("img_size") or model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    x = torch.randn(2, 3, s, s, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return x, type(model).forward.__get__(model)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="causal", help="comma list of causal,masked,seq2seq,vision (or 'none')")
    p.add_argument("--timm", action="store_true", help="also sweep the timm models")
    p.add_argument("--only", default="", help="comma list of model types / timm names")
    p.add_argument("--tol", type=float, default=1e-8, help="first-order violation above which a law is refuted")
    p.add_argument("--timeout", type=int, default=180, help="seconds per architecture")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--verbose", action="store_true", help="print the declined blocks of each architecture")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="print the status changes between two --json files (architectures in both) and exit")
    p.add_argument("--max-checks", type=int, default=MAX_CHECKS,
                   help="laws checked per family and architecture, the first found (0: all)")
    a = p.parse_args(argv)
    globals()["MAX_CHECKS"] = a.max_checks
    if a.compare:
        return compare(*a.compare)
    warnings.filterwarnings("ignore")
    import transformers

    import conserve.detection.core as core  # imported once here, inherited by every forked child

    core._load()

    transformers.logging.set_verbosity_error()
    only = set(filter(None, a.only.split(",")))
    rows = []
    fams = [] if a.families == "none" else a.families.split(",")
    for fam in fams:
        _, names = _auto(fam)
        for mt in names:
            if only and mt not in only:
                continue
            r = run_one(mt, lambda mt=mt, fam=fam: build(mt, fam), hf_inputs, a.tol, a.timeout)
            r["family"] = fam
            rows.append(r)
            _print(r, a.verbose)
    if a.timm:
        for name in TIMM:
            if only and name not in only:
                continue
            r = run_one(name, timm_make(name), timm_inputs, a.tol, a.timeout)
            r["family"] = "timm"
            rows.append(r)
            _print(r, a.verbose)
    summary(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _print(r, verbose):
    fams = ",".join(f"{k}:{v}" for k, v in sorted(r["families"].items()))
    extra = " ".join(r["msg"].split()) or ("; ".join(r["refuted"]) if r["refuted"] else "")
    if r.get("undetected"):
        extra += f" undetected={r['undetected']}"
    print(f"{r['family'] if 'family' in r else '':8} {r['arch']:28} {r['status']:9} {r['detector']:14} "
          f"{fams:60} dec={r['declined']:<3} {r['secs']:6.1f}s {extra[:300]}", flush=True)
    if verbose:
        for x in r.get("reasons", []):
            print("      ", x)


def _rows(path: str) -> dict:
    """``{(family, arch): row}`` from a ``--json`` file, or from the printed table (a sweep cut short)."""
    if path.endswith(".json"):
        with open(path) as f:
            return {(r["family"], r["arch"]): r for r in json.load(f)}
    out = {}
    for line in open(path):
        parts = line.split()
        if line.startswith(" ") or len(parts) < 3 or parts[0] in ("summary", "all") or parts[0].endswith(":"):
            continue
        fams = next((x for x in parts[3:5] if ":" in x and not x.startswith("dec=")), "")
        fam = dict((k, int(v)) for k, v in (x.split(":") for x in fams.split(",") if x)) if fams else {}
        out[(parts[0], parts[1])] = {"family": parts[0], "arch": parts[1], "status": parts[2], "families": fam}
    return out


def compare(before: str, after: str):
    """Status and law-count changes between two sweeps, over the architectures both ran."""
    b, a = _rows(before), _rows(after)
    both = [k for k in a if k in b]
    print(f"{len(both)} architectures in both sweeps")
    for k in both:
        nb, na = sum(b[k]["families"].values()), sum(a[k]["families"].values())
        if b[k]["status"] != a[k]["status"] or nb != na:
            print(f"  {k[0]:8} {k[1]:28} {b[k]['status']:9} -> {a[k]['status']:9} laws {nb:4} -> {na:4}  "
                  + ",".join(f"{f}:{n}" for f, n in sorted(a[k]["families"].items())))
    print("before:")
    summary([b[k] for k in both])
    print("after:")
    summary([a[k] for k in both])


def summary(rows):
    from collections import Counter

    print("\nsummary (status counts per family):")
    for fam in dict.fromkeys(r["family"] for r in rows):
        c = Counter(r["status"] for r in rows if r["family"] == fam)
        built = sum(v for k, v in c.items() if k != "skipped")
        print(f"  {fam:8} total={sum(c.values())} built={built} " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))
    c = Counter(r["status"] for r in rows)
    print(f"  all      total={len(rows)} built={len(rows) - c['skipped']} "
          + " ".join(f"{k}={v}" for k, v in sorted(c.items())))


if __name__ == "__main__":
    main()
