"""Step cost of exact drift tracking against sampled tracking, by tracked bytes (the ``Tracker``'s
``EXACT_MAX_BYTES``: below it the default is the exact mode).

    OMP_NUM_THREADS=1 python -m bench.exact_threshold            # five model sizes (a few minutes on 2 cores)
    OMP_NUM_THREADS=1 python -m bench.exact_threshold --quick    # fewer repetitions

For each model (``conserve run``'s reference LM at growing widths, SGD lr 0.1, batch 16 x 64, flush every 10
steps into a JSONL file, as ``conserve run`` does) it times, in interleaved blocks (``bench.track_overhead``):
the untracked training step, the sampled mode (``drift_every=4, snapshot_budget=0.04``, no cumulative sums)
and the exact mode (``drift_every=1, snapshot_budget=None, cumulative=True``), and prints the tracked bytes
(the weights the laws read), the median step times and the paired ratios exact / sampled and exact / untracked.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import conserve
from conserve.data import load_tokens
from conserve.models import DecoderLM, LMConfig

from .track_overhead import interleaved, lm_step, run_model

MODES = {"sampled": {"drift_every": 4, "snapshot_budget": 0.04, "cumulative": False},
         "exact": {"drift_every": 1, "snapshot_budget": None, "cumulative": True}}


def lm(hidden: int, layers: int = 4) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                              num_key_value_heads=4, intermediate_size=2 * hidden, moe_layers=(2,), num_experts=4,
                              top_k=2, nope_layers=(1,)))


MODELS = {"tiny": lambda: run_model("tiny"), "small": lambda: run_model("small"), "base": lambda: run_model("base"),
          "h256": lambda: lm(256), "h512": lambda: lm(512)}


def measure(build, blocks: int, tmp: str, tag: str) -> tuple[int, int, dict, dict]:
    tokens, _ = load_tokens(None)
    fns, opts, nbytes, nparams = {}, [], 0, 0
    for name in ("untracked", *MODES):
        model = build()
        nparams = sum(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if name != "untracked":
            opt = conserve.track(opt, model, every=10, sinks=[conserve.JSONLSink(f"{tmp}/{tag}-{name}.jsonl")],
                                 **MODES[name])
            nbytes = opt.tracker.tracked_bytes
        fns[name] = lm_step(model, opt, tokens, warmup=8)
        opts.append(opt)
    times, ratios = interleaved(fns, blocks, 4, "untracked")
    _, vs_sampled = interleaved({"sampled": fns["sampled"], "exact": fns["exact"]}, blocks, 4, "sampled")
    for opt in opts[1:]:
        opt.close()
    return nparams, nbytes, times, {**ratios, "exact/sampled": vs_sampled["exact"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing blocks")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    blocks = 3 if args.quick else 7
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread; EXACT_MAX_BYTES = "
          f"{conserve.tracker.EXACT_MAX_BYTES / 2**20:g} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            n, b, t, r = measure(MODELS[name], blocks, tmp, name)
            print(f"{name}: {n:,} parameters, {b / 2**20:.2f} MiB tracked; step ms untracked {t['untracked']:.1f}, "
                  f"sampled {t['sampled']:.1f}, exact {t['exact']:.1f}; exact/sampled {r['exact/sampled']:.3f}, "
                  f"exact/untracked {r['exact']:.3f}, sampled/untracked {r['sampled']:.3f}", flush=True)


if __name__ == "__main__":
    main()
