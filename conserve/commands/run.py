"""``conserve run``: train the reference LM on text with conservation-law tracking.

Writes a run directory: ``config.json``, ``metrics.jsonl`` (appended and flushed as it goes),
``summary.md`` / ``summary.json`` and ``eps.png`` / ``drift.png`` / ``layers.png`` (``conserve.report``);
TensorBoard events with ``--tensorboard``. A run that diverges (NaN/Inf or exploding loss, ``eps`` beyond
``--max-eps``) or is interrupted (Ctrl-C) stops with the summary and plots of what was recorded.
Every input is checked before the run directory is touched (a failed start writes nothing); a directory
holding an earlier run is refused unless ``--overwrite``; the memory a size needs is estimated before the
model is built (exit 2). A disk that fails mid-run saves every row kept, the config and the summary to a
fallback directory under ``tempfile.gettempdir()``, named in one line with the fix (exit 4); a disk that is
full when the run starts is one line too (exit 4), and the start's files are removed.
``config.json`` holds ``status``: ``running`` while the run goes (and after a kill), then ``finished``,
``interrupted`` (Ctrl-C), ``diverged`` or ``failed`` (out of memory). At each flush (``--every``) the whole
state (model, optimizer, tracker, data position, RNG states) is saved atomically to ``checkpoint.pt``;
``--resume OUT`` continues a stopped run from it, with the rows an uninterrupted run writes.
The drift is exact by default (every law on every step, the per-entry cumulative sums kept, so the summary
has its total and prediction columns): ``conserve.track``'s default up to ``conserve.tracker.EXACT_MAX_BYTES``
of tracked weights, which every ``--size`` and preset is below.
The default model covers every law family of the paper: RoPE pairs (layers 0, 2), a NoPE layer with MHA
QK Gram laws (layer 1), VO Grams, SwiGLU units, an MoE layer (router sum and experts' units), pre-norm
gains and the untied output translation law.
"""
from __future__ import annotations

import argparse
import json
import sys
import math
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import DivergenceError, NonFiniteError, UsageError
from .common import add_device_argument, add_threads_argument, resolve_device, torch_threads

OPTIMIZERS = ("gd", "sgd", "momentum", "adamw")
SIZES = {  # hidden, layers, heads, kv heads, intermediate, experts
    "tiny": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    "small": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "base": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=256),
}


def _int_tuple(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 1,3, got {s!r}") from None
    if any(i < 0 for i in out):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0, got {s!r}")
    return out


def _budget(text: str):
    """``--snapshot-budget``: a fraction > 0, or 'none' (every law on every drift step)."""
    if text.lower() == "none":
        return "none"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction of the tracked bytes (e.g. 0.05) or 'none'")
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the fraction must be finite and > 0 (or 'none')")
    return v


def add_arguments(p) -> None:
    g = p.add_argument_group("data and output")
    g.add_argument("--data", default=None, help="text file (plain or .gz), or a PTB/WikiText directory; default: the "
                   "embedded CPython documentation corpus")
    g.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>); a directory holding an "
                   "earlier run is refused unless --overwrite")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in --out (its metrics, summary and TensorBoard events)")
    g.add_argument("--resume", default=None, metavar="OUT",
                   help="continue the stopped run in OUT (killed, interrupted, out of memory) from its last checkpoint "
                        "(OUT/checkpoint.pt, saved at each flush): its own options are used (those given here are "
                        "ignored, except --no-progress and --threads) and its rows continue as if it had not stopped")
    g.add_argument("--kill-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: SIGKILL after a checkpoint
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to OUT/tb")
    g.add_argument("--every", type=int, default=10,
                   help="flush metrics (and save the resume checkpoint) every N steps (default 10)")
    g.add_argument("--continuity", action="store_true",
                   help="also log geometric continuity across layers (Jeong, Paeng, Suh 2026) at each flush")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    o = p.add_argument_group("optimization")
    o.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="gd = full-batch gradient descent on one fixed batch; sgd; momentum (heavy ball); adamw")
    o.add_argument("--lr", type=float, default=None, help="learning rate (default: 0.1 for gd/sgd, 0.02 momentum, 3e-3 adamw)")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--momentum", type=float, default=0.9, help="for --optimizer momentum")
    o.add_argument("--steps", type=int, default=300)
    o.add_argument("--batch-size", type=int, default=16)
    o.add_argument("--seq-len", type=int, default=64)
    o.add_argument("--seed", type=int, default=0)
    add_device_argument(o)
    o.add_argument("--max-eps", type=float, default=1e3,
                   help="stop as diverged when a family's eps exceeds this (default 1e3; 0 disables)")
    add_threads_argument(o)
    o.add_argument("--fp64-laws", action="store_true", help="accumulate law values in float64")
    o.add_argument("--drift-every", type=int, default=None, metavar="N",
                   help="decompose the drift on every N-th step (default: conserve.track's exact mode, every law "
                        "on every step, up to 16 MiB of tracked weights, which covers every --size and preset; "
                        "given, the drift is sampled: --snapshot-budget then defaults to 0.04)")
    o.add_argument("--snapshot-budget", type=_budget, default=None, metavar="FRACTION",
                   help="bytes copied before a drift step, as a fraction of the tracked bytes (e.g. 0.04: one group "
                        "of laws per drift step, round robin); 'none': every law on every drift step (default: "
                        "'none' in the exact mode, see --drift-every; 0.04 when sampled)")
    o.add_argument("--check-gradients", action="store_true",
                   help="on the drift cadence, check that each gradient is a gradient of the model's output: every "
                        "law's first-order product with it must be at rounding level (grad_check/<family> columns; "
                        "a warning names any law above its floor, and the run ends with the check's line)")
    o.add_argument("--cumulative", action="store_true",
                   help="keep the per-entry cumulative drift sums, for the summary's total and prediction columns, in "
                        "sampled mode too (4 law-sized copies held; kept by default in the exact mode, every law "
                        "on every step)")
    m = p.add_argument_group("model")
    m.add_argument("--size", choices=tuple(SIZES), default="tiny",
                   help=", ".join(f"{k} (hidden {v['hidden_size']}, {v['num_hidden_layers']} layers, "
                                  f"{v['num_attention_heads']} heads / {v['num_key_value_heads']} kv)"
                                  for k, v in SIZES.items())
                        + "; default tiny; --hidden, --layers, --heads, --kv-heads override it")
    m.add_argument("--layers", type=int, default=None, help="number of layers (overrides --size)")
    m.add_argument("--hidden", type=int, default=None, help="hidden size (overrides --size)")
    m.add_argument("--heads", type=int, default=None)
    m.add_argument("--kv-heads", type=int, default=None, help="num_key_value_heads: = heads for MHA, 1 for MQA")
    m.add_argument("--head-dim", type=int, default=None)
    m.add_argument("--position", choices=("rope", "none", "sinusoidal", "learned"), default="rope")
    m.add_argument("--rope-layout", choices=("half", "interleaved"), default="half")
    m.add_argument("--rotary-dim", type=int, default=None, help="partial rotary: rotary dims per head (< head_dim)")
    m.add_argument("--nope-layers", type=_int_tuple, default=(1,), help="layers without RoPE (default 1)")
    m.add_argument("--ffn", choices=("swiglu", "relu", "gelu", "silu"), default="swiglu",
                   help="dense FFN kind (the MoE layers' experts stay SwiGLU; --experts 0 for no MoE layer)")
    m.add_argument("--experts", type=int, default=4, help="MoE experts (0 = dense everywhere)")
    m.add_argument("--moe-layers", type=_int_tuple, default=(2,), help="which layers are MoE (default 2)")
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--router", choices=("softmax", "sigmoid"), default="softmax")
    m.add_argument("--shared-expert", action="store_true")
    m.add_argument("--tie-embeddings", action="store_true")
    # --- presets: named defaults, each overridable by its own flag -------------------------------------
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="wikitext2: the laws at training scale: the largest reference LM this 2-core CPU trains in "
                   "minutes (hidden 128, 6 layers, 8 heads / 4 kv) on WikiText-2 (--data: your WikiText-103 files) "
                   "with AdamW lr 1e-3, weight decay 0.1, 1000 steps of 16 x 128 bytes; explicit flags win")
    p.set_defaults(_preset_defaults={k: p.get_default(k) for k in PRESET_KEYS})


PRESETS = {"wikitext2": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "size": "base", "layers": 6,
                         "steps": 1000, "batch_size": 16, "seq_len": 128, "every": 25, "fp64_laws": True,
                         "data": "wikitext-2"}}
PRESET_KEYS = sorted({k for v in PRESETS.values() for k in v})


def apply_preset(args) -> None:
    """Fill the options the user left at their defaults from ``--preset``; ``data`` 'wikitext-2' resolves to
    ``$CONSERVE_DATA`` or ``/work/shared/data`` + ``wikitext-2/wiki.train.tokens.gz`` (``UsageError`` naming
    ``--data`` when absent)."""
    import os

    if not getattr(args, "preset", None):
        return
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) == args._preset_defaults.get(k):
            setattr(args, k, v)
    if args.data == "wikitext-2":
        root = Path(os.environ.get("CONSERVE_DATA") or "/work/shared/data")
        path = root / "wikitext-2" / "wiki.train.tokens.gz"
        if not path.is_file():
            raise UsageError(f"--preset {args.preset}: WikiText-2 not found at {path}; pass --data FILE_OR_DIR "
                             "(e.g. your WikiText-103 wiki.train.tokens) or set CONSERVE_DATA")
        args.data = str(path)


def _out_path(arg) -> Path:
    """The run directory's path (default ``runs/<timestamp>``, with a suffix if two runs start in the same second);
    nothing is created."""
    if arg:
        return Path(arg)
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


def out_dir(arg) -> Path:
    """The run directory (default ``runs/<timestamp>``), created and checked writable (``UsageError``; a full
    disk raises its ``OSError``: exit 4, as a disk that fills mid-run)."""
    import errno

    out = _out_path(arg)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise
        raise UsageError(f"cannot write to the output directory {out}: {e.strerror}; pass --out to a writable directory") from None
    return out


_RUN_FILES = ("metrics.jsonl", "config.json", "summary.json", "summary.md", "eps.png", "drift.png", "layers.png",
              "checkpoint.pt")


def earlier_run(out: Path) -> str | None:
    """What an earlier run left in ``out`` (e.g. ``'12 metric rows'``), or None when it holds none."""
    if not out.is_dir():
        return None
    metrics = out / "metrics.jsonl"
    rows = 0
    if metrics.is_file():
        with open(metrics, "rb") as f:
            rows = sum(1 for line in f if line.strip())
    if rows:
        return f"{rows} metric rows"
    found = [f for f in _RUN_FILES[1:] if (out / f).exists()] + (
        ["tb/"] if any((out / "tb").glob("events.out.tfevents.*")) else [])
    return ", ".join(found) if found else None


def _clear_earlier_run(out: Path) -> None:
    """``--overwrite``: remove the files an earlier ``conserve run`` wrote into ``out`` (nothing else)."""
    for f in _RUN_FILES:
        (out / f).unlink(missing_ok=True)
    if (out / "tb").is_dir():
        for old in (out / "tb").glob("events.out.tfevents.*"):  # one TensorBoard series, not two
            old.unlink()


_FLAG = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
         "num_key_value_heads": "kv-heads", "intermediate_size": "size"}
_SHRINK = "lower --hidden or --layers (or a smaller --size), --batch-size or --seq-len"
_OPT_STATES = {"gd": 0, "sgd": 0, "momentum": 1, "adamw": 2}  # optimizer state tensors per parameter


def _available_bytes(device: str) -> int:
    """Memory free for a new run: CUDA ``mem_get_info``; on CPU ``MemAvailable`` (/proc/meminfo) or free pages."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def estimate_bytes(cfg, args) -> tuple[int, int, int]:
    """``(total, parameter_bytes, activation_bytes)`` a run of ``cfg`` needs, float32, estimated before building.

    Parameters are counted on a ``meta`` model (no memory); each one costs its weight, gradient, the
    optimizer's state (0 for gd/sgd, 1 momentum, 2 AdamW) and ~1 copy for the tracker's snapshots and
    law values. Activations kept for backward: ~16 floats per token, hidden unit and layer plus
    the attention scores (3 x batch x heads x T^2 per layer) and the logits (3 x batch x T x vocab)."""
    import torch

    from ..models import DecoderLM

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in DecoderLM(cfg).parameters())
    except ValueError as e:
        raise model_error(e) from None
    params = 4 * n * (3 + _OPT_STATES.get(args.optimizer, 2))
    bt = args.batch_size * args.seq_len
    act = 4 * (bt * cfg.num_hidden_layers * (16 * cfg.hidden_size + 3 * cfg.num_attention_heads * args.seq_len)
               + 3 * bt * cfg.vocab_size)
    return params + act, params, act


def model_error(e: ValueError) -> UsageError:
    """An inconsistent architecture (``ValueError`` of the model) as a ``UsageError`` naming the flags."""
    msg = str(e)
    if "num_key_value_heads" in msg and "multiple" in msg:
        msg += "; pass --heads a multiple of --kv-heads (--kv-heads = --heads for MHA, 1 for MQA)"
    elif "rotary_dim" in msg:
        msg += " (--rotary-dim, --head-dim)"
    return UsageError(msg)


def _check_memory(cfg, args, device: str) -> None:
    """Refuse (``UsageError`` naming the flags to shrink) a run whose estimate exceeds the memory available."""
    need, params, act = estimate_bytes(cfg, args)
    have = _available_bytes(device)
    if need > have:
        raise UsageError(f"this run needs ~{need / 2**30:.1f} GiB ({params / 2**30:.1f} GiB of weights, gradients and "
                         f"optimizer state; {act / 2**30:.1f} GiB of activations at --batch-size {args.batch_size} "
                         f"--seq-len {args.seq_len}) but {have / 2**30:.1f} GiB is available on {device}; {_SHRINK}")


def _out_of_memory(e: BaseException, args) -> UsageError | None:
    import torch

    if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e):
        return UsageError(f"out of memory at --batch-size {args.batch_size} --seq-len {args.seq_len}; {_SHRINK}")
    return None


def build_config(args):
    from ..models import LMConfig

    kw = dict(SIZES[args.size])
    for key, val in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden), ("num_attention_heads", args.heads),
                     ("num_key_value_heads", args.kv_heads)):
        if val is not None:
            kw[key] = val
    if args.heads is not None and args.kv_heads is None:
        kw["num_key_value_heads"] = args.heads
    for key, val in kw.items():
        if val < 1:
            raise UsageError(f"--{_FLAG[key]} must be >= 1, got {val}")
    if args.experts < 0:
        raise UsageError(f"--experts must be >= 0, got {args.experts}")
    n = kw["num_hidden_layers"]
    explicit = {"nope_layers": args.nope_layers != (1,), "moe_layers": args.moe_layers != (2,)}
    for name in ("nope_layers", "moe_layers"):
        bad = [i for i in getattr(args, name) if i >= n]
        if bad and explicit[name]:
            raise UsageError(f"--{name.replace('_', '-')} {bad} is out of range for {n} layers (indices 0..{n - 1})")
    nope = tuple(i for i in args.nope_layers if i < n)
    moe = tuple(i for i in args.moe_layers if i < n) if args.experts else None
    if moe and args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} is larger than --experts {args.experts}; use --top-k <= --experts")
    try:
        return LMConfig(vocab_size=256, max_position_embeddings=max(512, args.seq_len), head_dim=args.head_dim,
                        position=args.position, rope_layout=args.rope_layout, rotary_dim=args.rotary_dim,
                        nope_layers=nope, hidden_act=args.ffn, num_experts=args.experts if moe else 0, top_k=args.top_k,
                        moe_layers=moe, router=args.router, shared_expert=args.shared_expert,
                        tie_word_embeddings=args.tie_embeddings, **kw)
    except ValueError as e:
        raise model_error(e) from None


def make_optimizer(name: str, params, lr: float | None, weight_decay: float, momentum: float):
    lr = lr if lr is not None else {"gd": 0.1, "sgd": 0.1, "momentum": 0.02, "adamw": 3e-3}[name]
    if not (math.isfinite(lr) and lr > 0):
        raise UsageError(f"--lr must be a positive number, got {lr}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise UsageError(f"--weight-decay must be >= 0, got {weight_decay}")
    if name == "momentum" and not 0 <= momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1), got {momentum}")
    import torch

    if name in ("gd", "sgd"):
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay), lr
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay), lr
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay), lr


def main(args) -> int:
    with torch_threads(args.threads):
        return _main(args)


def _main(args) -> int:
    import torch

    resumed = _resume_point(args) if getattr(args, "resume", None) else None
    if resumed is not None:
        args = resumed["args"]
    apply_preset(args)
    from ..optim import track
    from ..tracking.sinks import JSONLSink
    from ..data import Batches, load_tokens
    from ..models import DecoderLM
    from ..sinks import TensorBoardSink

    # everything is checked before the run directory is touched: a failed start writes nothing
    for name in ("steps", "batch_size", "seq_len", "every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.max_eps >= 0):
        raise UsageError(f"--max-eps must be >= 0 (0 disables the check), got {args.max_eps}")
    if args.drift_every is not None and args.drift_every < 1:
        raise UsageError(f"--drift-every must be >= 1 (every N-th step), got {args.drift_every}")
    device = resolve_device(args.device)
    tokens, source = load_tokens(args.data)
    if resumed is not None and int(tokens.numel()) != resumed["config"].get("tokens"):
        raise UsageError(f"{args.out}: the run's data ({source}) now has {int(tokens.numel())} tokens, not the "
                         f"{resumed['config'].get('tokens')} it was trained on; restore that data to resume it")
    cfg = build_config(args)
    _check_memory(cfg, args, device)
    path = _out_path(args.out)
    held = None if resumed is not None else earlier_run(path)
    if held and not getattr(args, "overwrite", False):
        resumable = f", --resume {path} to continue it" if _stopped(path) else ""
        raise UsageError(f"{path} holds an earlier run ({held}); pass --overwrite to replace it{resumable}, or another "
                         "--out to keep both")
    tb = TensorBoardSink(path / "tb") if args.tensorboard else None  # not installed: refused here, nothing written
    torch.manual_seed(args.seed)
    try:
        model = DecoderLM(cfg).to(device)
    except ValueError as e:
        raise model_error(e) from None
    except RuntimeError as e:
        oom = _out_of_memory(e, args)
        if oom is None:
            raise
        raise oom from None
    opt, lr = make_optimizer(args.optimizer, model.parameters(), args.lr, args.weight_decay, args.momentum)
    batches = Batches(tokens, args.batch_size, args.seq_len, seed=args.seed, fixed=args.optimizer == "gd")
    if resumed is not None:  # the weights before the tracker is built: it starts from them
        model.load_state_dict(resumed["checkpoint"]["model"])
    created = not path.exists()
    try:
        out = out_dir(path)  # created only once the inputs are known to be good
    except OSError as e:  # the disk is full
        _undo_start(path, created)
        print(f"conserve run: error: {_disk_line(path, e)}", file=sys.stderr)
        return 4
    from ..tracking.lock import RunDirLock

    # one writer per run directory, taken before anything in it is touched (a second process is refused)
    lock = RunDirLock(out, hint="pass another --out").acquire()
    sinks = []
    try:
        if held:  # --overwrite
            _clear_earlier_run(out)
            print(f"conserve run: --overwrite: replaced the earlier run in {out} ({held})", file=sys.stderr)
        if resumed is not None:
            config = {**resumed["config"], "status": "running",
                      "resumed_at": [*resumed["config"].get("resumed_at", []), resumed["step"]]}
        else:
            config = {"command": "conserve run", "data_source": source, "tokens": int(tokens.numel()),
                      "optimizer": args.optimizer, "lr": lr, "weight_decay": args.weight_decay,
                      "momentum": args.momentum if args.optimizer == "momentum" else 0.0, "steps": args.steps,
                      "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed, "device": device,
                      "model": cfg.to_dict(), "parameters": sum(p.numel() for p in model.parameters()),
                      "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                      "fp64_laws": bool(args.fp64_laws), "check_gradients": bool(args.check_gradients),
                      "status": "running"}
        metrics = out / "metrics.jsonl"
        sinks = [JSONLSink(metrics)] + ([tb] if tb is not None else [])
        monitors = []
        if args.continuity:
            from ..continuity import ContinuityMonitor

            monitors.append(ContinuityMonitor(model, every=1))
        cadence = {} if args.drift_every is None else {"drift_every": args.drift_every}
        if args.snapshot_budget is not None:
            cadence["snapshot_budget"] = None if args.snapshot_budget == "none" else args.snapshot_budget
        if args.cumulative:
            cadence["cumulative"] = True
        if args.check_gradients:  # the model is trained on softmax cross-entropy: its translation laws are checked
            cadence.update(check_gradients=True, loss="ce")
        tracked = track(opt, model, every=args.every, sinks=sinks, fp64=args.fp64_laws, monitors=monitors, **cadence)
        config.update(drift_every=tracked.tracker.drift_every, snapshot_budget=tracked.tracker.snapshot_budget)
        from ..tracking.control import ControlMonitor

        tracked.tracker.monitors.append(ControlMonitor(tracked.tracker.laws, dict(model.named_parameters()),
                                                       fp64=args.fp64_laws))
        if resumed is not None:  # the optimizer, the tracker (its sinks drop the rows after the checkpoint), data, RNG
            ck = resumed["checkpoint"]
            tracked.load_state_dict(ck["optimizer"])
            batches.load_state_dict(ck["batches"])
            _set_rng(ck["rng"])
            print(f"conserve run: --resume: continuing {out} from step {resumed['step']} of {args.steps}",
                  file=sys.stderr)
        write_config(out, config)
    except BaseException as e:
        for s in sinks:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                pass
        if resumed is None:
            _undo_start(out, created)
        lock.release()
        if isinstance(e, OSError):  # the disk (full, failing): the same exit code as a disk that fails mid-run
            print(f"conserve run: error: {_disk_line(out, e)}", file=sys.stderr)
            return 4
        raise
    try:
        return _train_and_report(args, model, tracked, batches, device, lr, source, out, config, sinks, lock,
                                 resumed)
    finally:
        lock.release()


def _disk_line(out: Path, e: OSError) -> str:
    """One line for a run directory the disk cannot take (full, quota, I/O error): what failed and the fix."""
    what = f" writing {Path(e.filename).name}" if getattr(e, "filename", None) else ""
    return (f"cannot write the run directory {out}{what} ({e.strerror or e}); free disk space there or pass --out "
            "on another disk, then run again")


def write_config(out: Path, config: dict) -> None:
    """``config.json``, written atomically (a temporary file, then ``os.replace``)."""
    _atomic_write(out / "config.json", json.dumps(config, indent=2).encode())


def _atomic_write(path: Path, data: bytes | None = None, save=None) -> None:
    """Write ``path`` through ``<dir>/.<name>.tmp`` and ``os.replace``: a reader (or a kill) sees the old file
    or the new one, never a part. ``save(tmp_path)`` writes the temporary file when given, else ``data``."""
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if save is not None:
            save(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


CHECKPOINT = "checkpoint.pt"


def _stopped(out: Path) -> bool:
    """``out`` holds a run that stopped before its end (killed or interrupted) and a checkpoint to resume it."""
    try:
        status = json.loads((out / "config.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False
    return status in ("running", "interrupted", "failed") and (out / CHECKPOINT).is_file()
_RESUME_KEEPS = ("no_progress", "threads")  # options of the resuming command line that apply to the resumed run


def _saved_args(args) -> dict:
    return {k: v for k, v in vars(args).items()
            if not k.startswith("_") and k not in ("resume", "kill_after", "overwrite")}


def _resume_point(args) -> dict:
    """``--resume OUT``: the stopped run's options (the resuming line's ``--no-progress``/``--threads`` kept), config
    and last checkpoint; ``UsageError`` naming the fix when there is nothing to resume."""
    import torch

    out = Path(args.resume)
    ck_path, cfg_path = out / CHECKPOINT, out / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"--resume {out}: no conserve run there (no config.json); pass the run directory of a stopped "
                         "`conserve run`")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--resume {out}: cannot read config.json ({e}); start a new run with --overwrite") from None
    status = config.get("status")
    if status == "finished":
        raise UsageError(f"--resume {out}: the run finished its {config.get('steps')} steps; nothing to resume "
                         "(start a new run with another --out, or --overwrite)")
    if status == "diverged":
        raise UsageError(f"--resume {out}: the run diverged; resuming it would diverge again: start a new run with "
                         "a lower --lr (--overwrite or another --out)")
    if not ck_path.is_file():
        raise UsageError(f"--resume {out}: no checkpoint (the run stopped before its first flush, or was written by "
                         "a conserve without --resume); start it again with --overwrite")
    try:
        ck = torch.load(ck_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise UsageError(f"--resume {out}: cannot read {CHECKPOINT} ({type(e).__name__}: {e}); start the run again "
                         "with --overwrite") from None
    saved = argparse.Namespace(**{k: tuple(v) if k in ("nope_layers", "moe_layers") else v
                                  for k, v in ck["args"].items()})
    for k in _RESUME_KEEPS:
        setattr(saved, k, getattr(args, k))
    saved.out, saved.resume, saved.overwrite, saved.kill_after = str(out), str(out), False, args.kill_after
    saved._preset_defaults = getattr(args, "_preset_defaults", {})
    saved.preset = None  # (applied when the run started: its values are in the saved options)
    return {"args": saved, "config": config, "checkpoint": ck, "step": int(ck["step"])}


def _rng_state(device: str) -> dict:
    import torch

    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if device.startswith("cuda") and torch.cuda.is_available() else []}


def _set_rng(state: dict) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])


class _Checkpointer:
    """``train``'s ``on_step``: at each flush step (every ``--every`` steps) the whole state of the run --
    model, optimizer and tracker (``state_dict``: the tracker flushes its rows first), the data position,
    the RNG states, the divergence check's first loss and the options -- saved atomically to
    ``OUT/checkpoint.pt``. A save the disk refuses is told once (the rows are what counts; the run goes on)."""

    def __init__(self, args, model, tracked, batches, device: str, out: Path):
        self.args, self.model, self.tracked, self.batches, self.device, self.out = \
            args, model, tracked, batches, device, out
        self.failed = False

    def __call__(self, step: int, first_loss) -> None:
        import os
        import signal

        import torch

        if step % self.args.every:
            return
        state = {"step": step, "args": _saved_args(self.args), "model": self.model.state_dict(),
                 "optimizer": self.tracked.state_dict(), "batches": self.batches.state_dict(),
                 "rng": _rng_state(self.device), "first_loss": first_loss}
        try:
            _atomic_write(self.out / CHECKPOINT, save=lambda tmp: torch.save(state, tmp))
        except (OSError, RuntimeError) as e:  # (torch.save reports a failed write as RuntimeError)
            if not self.failed:
                self.failed = True
                print(f"conserve run: warning: cannot save the resume checkpoint {self.out / CHECKPOINT} at step "
                      f"{step} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); the run goes on",
                      file=sys.stderr)
            return
        if self.args.kill_after is not None and step >= self.args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # (tests: a run killed right after a checkpoint)


def _undo_start(out: Path, created: bool) -> None:
    """A start that failed after the run directory was made: remove what it wrote (an empty metrics file, the
    config, the directory itself when this run created it and nothing else is in it)."""
    m = out / "metrics.jsonl"
    try:
        if m.is_file() and m.stat().st_size == 0:
            m.unlink()
        if created:
            (out / "config.json").unlink(missing_ok=True)
            left = [p for p in out.iterdir() if not p.name.endswith(".lock")]
            if not left:
                for p in out.iterdir():
                    p.unlink()
                out.rmdir()
    except OSError:
        pass


def _fallback_dir(out: Path) -> Path | None:
    """A writable directory for a run whose own directory failed: ``<tempdir>/conserve-<name>-<time>``
    (then the home directory); None when neither can be written."""
    import tempfile

    name = f"conserve-{out.resolve().name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    for root in (tempfile.gettempdir(), str(Path.home())):
        d = Path(root) / name
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / ".write-test").write_text("")
            (d / ".write-test").unlink()
            return d
        except OSError:
            continue
    return None


def _save_elsewhere(out: Path, records: list[dict], config: dict, summary_args: tuple, why: str) -> str:
    """Write the whole run (every row: those in ``out`` and those its sink still owed, the config, the
    summary) to a fallback directory; the one line naming where it went and the fix."""
    from ..report import json_safe, write_summary

    fb = _fallback_dir(out)
    if fb is not None:
        try:
            with open(fb / "metrics.jsonl", "w") as f:
                for r in records:
                    f.write(json.dumps(json_safe(r)) + "\n")
            (fb / "config.json").write_text(json.dumps(config, indent=2))
            try:
                write_summary(fb, records, config, *summary_args)
            except OSError:
                pass
            return (f"{why}; saved the run ({len(records)} metric rows) to {fb}/metrics.jsonl: free space in {out}, "
                    f"then `conserve report {fb}/metrics.jsonl` (or copy it into {out})")
        except OSError:
            pass
    return f"{why}; no fallback directory could be written either ({len(records)} metric rows lost): free disk space"


def _train_and_report(args, model, tracked, batches, device, lr, source, out, config, sinks, lock,
                      resumed=None) -> int:
    from ..report import plot_all, read_metrics, write_summary
    from ..train import train

    tracker = tracked.tracker
    declined = [asdict(d) for d in tracker.declined]
    metrics = out / "metrics.jsonl"
    print(f"conserve run: {config['parameters']:,} parameters, {len(tracker.laws)} laws in "
          f"{len(tracker.families)} families ({', '.join(tracker.families)}); data: {source}; out: {out}")
    stopped, code = None, 0
    t0 = time.time()
    try:
        start = resumed["step"] if resumed is not None else 0
        train(model, tracked, batches, args.steps - start, device=device, progress=not args.no_progress,
              log_every=max(1, min(args.every, 10)), description=f"{args.optimizer} lr={lr:g}",
              max_eps=args.max_eps or None, max_loss_ratio=3.0, start_step=start,
              first_loss=resumed["checkpoint"]["first_loss"] if resumed is not None else None,
              on_step=_Checkpointer(args, model, tracked, batches, device, out))
    except (NonFiniteError, DivergenceError) as e:  # exit 3: the run diverged (2: bad input)
        stopped, code = str(e), 3
    except KeyboardInterrupt:
        stopped, code = f"interrupted (Ctrl-C) after step {tracker.step_count}", 130
    except RuntimeError as e:
        oom = _out_of_memory(e, args)
        if oom is None:
            raise
        stopped, code = str(oom), 2
    finally:
        owed = []
        try:
            owed = list(tracker.unwritten.get(sinks[0], ()))  # rows the JSONL file could not take
            tracked.close()  # flush what is pending (rows of a stopped run are already flushed)
            owed = list(tracker.unwritten.get(sinks[0], ()))
        except (NonFiniteError, OSError) as e:
            stopped = stopped or str(e)
            code = code or 2
            for s in sinks:
                try:
                    s.close()
                except Exception:  # noqa: BLE001 - closing a failed sink must not hide the run's outcome
                    pass
    dropped = tracker.dropped.get(sinks[0], 0)
    disk_error = None
    # how the run ended, for `conserve report` (a run killed outright stays "running")
    config["status"] = {0: "finished", 3: "diverged", 130: "interrupted"}.get(code, "failed")
    try:
        write_config(out, config)
    except OSError as e:
        disk_error = e
    try:
        records = read_metrics(metrics) if metrics.exists() else []
    except OSError as e:
        records, disk_error = [], e
    if owed:
        records = [r for r in records if r["step"] < owed[0]["step"]] + owed
    totals = tracker.totals() if code == 0 or code == 130 else None
    broken = getattr(tracker, "broken_by_family", None)
    summary_args = (totals, {"declined": declined, "seconds": round(time.time() - t0, 1),
                             **({"stopped": stopped} if stopped else {})}, broken() if callable(broken) else None)
    if not (owed or dropped or disk_error):
        try:
            write_summary(out, records, config, *summary_args)
            if records:
                plot_all(records, out, f"{args.optimizer}, lr={lr:g}, {source.split('/')[-1]}")
        except OSError as e:
            disk_error = e
    if owed or dropped or disk_error:
        why = (f"the run directory {out} could not be written"
               + (f" ({disk_error.strerror or disk_error})" if disk_error else "")
               + (f": {len(owed)} metric rows (steps {owed[0]['step']}..{owed[-1]['step']}) are missing from {metrics}"
                  if owed else "")
               + (f"; {dropped} older rows were dropped in memory (tracker.max_unwritten)" if dropped else ""))
        print(f"conserve run: error: {_save_elsewhere(out, records, config, summary_args, why)}", file=sys.stderr)
        return 4
    if code == 2:
        raise UsageError(stopped)
    if code == 3:  # diverged: the same one line as a usage error, its own exit code
        print(f"conserve run: error: {stopped}", file=sys.stderr)
        return 3
    if not records:
        raise UsageError(f"no metrics were recorded in {out}/metrics.jsonl (the summary is empty); check that the disk "
                         "is writable and run again")
    written = [f for f in ("config.json", "metrics.jsonl", "summary.md", "summary.json", "eps.png", "drift.png",
                           "layers.png", CHECKPOINT, "tb") if (out / f).exists()]
    print(f"wrote {out}/: {' '.join(written)}" + (f" ({CHECKPOINT}: for --resume)" if CHECKPOINT in written else ""))
    text = (out / "summary.md").read_text()
    print(text.split("\n## Drift")[0].rstrip())
    checked = tracker.gradient_check()
    if checked is not None:  # per family the worst and aggregate ratios, each flagged law (not the skipped ones)
        print("\n".join(line for line in str(checked).splitlines() if not line.startswith("  skipped")))
    if code == 130:
        print(f"conserve run: {stopped}; the summary and plots above cover what was recorded", file=sys.stderr)
    return code
