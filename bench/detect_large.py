"""Time and memory of ``conserve.detect`` on large plain-torch Llama3 models, block by block (not a timed test).

    python -m bench.detect_large                  # both cases below, each in its own spawned process
    python -m bench.detect_large --case meta8b    # one case
    python -m bench.detect_large --case dense1b --dtype float32

Cases (a torchtitan-style Llama3 written here in plain torch: ``tok_embeddings``, a ``ModuleDict`` of
``TransformerBlock`` with ``wq/wk/wv/wo``, GQA by ``repeat_kv``, RoPE by complex multiplication with a complex
``freqs_cis`` buffer, SwiGLU ``w1/w2/w3``, RMSNorm, an untied ``output``; no name any detector knows):

* ``meta8b``: the Llama3-8B config (dim 4096, 32 layers, 32 heads, 8 kv heads, ffn 14336, vocab 128256: 8.0e9
  parameters) built on the meta device, as an FSDP2 recipe builds it before sharding;
* ``dense1b``: dim 2048, 8 layers, 16 heads, 8 kv heads, ffn 7168 (torchtitan's ``ffn_dim_multiplier=1.3``,
  ``multiple_of=1024``), vocab 128256: 0.96e9 parameters, built on the meta device and materialised on the CPU
  (``to_empty`` + ``init_weights``, ``--dtype``, default bfloat16), above the whole probe's 3e8.

A row: the case, parameters, seconds of ``conserve.detect(model, loss='ce')`` (after an untimed warm-up detection
of a narrow 2-layer instance: imports, first calls), the peak resident memory of the process (GB: the materialised model
included) and its growth during detection, the law families found, the detection's notes. Every law found is
named for the full model's parameters (``compile_laws`` against the full shapes, as ``Collector.finish`` does).
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import resource
import time

CASES = {
    "meta8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336, vocab=128256, meta=True),
    "dense1b": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, hidden=7168, vocab=128256, meta=False),
}


def _model_classes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    def precompute_freqs_cis(dim, end, theta=500000.0):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t = torch.arange(end, device=freqs.device)
        return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())

    def apply_rotary_emb(xq, xk, freqs_cis):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
        return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
                torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))

    def repeat_kv(x, n_rep):
        bs, slen, n_kv, hd = x.shape
        if n_rep == 1:
            return x
        return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    class Attention(nn.Module):
        def __init__(self, dim, n_heads, n_kv_heads):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
            self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
            self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

        def forward(self, x, freqs_cis):
            bs, seqlen, _ = x.shape
            xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
            xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
            xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
            rep = self.n_heads // self.n_kv_heads
            xq, xk, xv = xq.transpose(1, 2), repeat_kv(xk, rep).transpose(1, 2), repeat_kv(xv, rep).transpose(1, 2)
            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
            return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))

    class FeedForward(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class TransformerBlock(nn.Module):
        def __init__(self, dim, n_heads, n_kv_heads, hidden):
            super().__init__()
            self.attention, self.feed_forward = Attention(dim, n_heads, n_kv_heads), FeedForward(dim, hidden)
            self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

        def forward(self, x, freqs_cis):
            h = x + self.attention(self.attention_norm(x), freqs_cis)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self, dim, n_layers, n_heads, n_kv_heads, hidden, vocab, max_seq=64):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq), persistent=False)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden)
                                         for i in range(n_layers)})
            self.norm = RMSNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)
            self.head_dim, self.max_seq = dim // n_heads, max_seq

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            freqs_cis = self.freqs_cis[0: tokens.shape[1]]
            for layer in self.layers.values():
                h = layer(h, freqs_cis)
            return self.output(self.norm(h))

        @torch.no_grad()
        def init_weights(self):
            """After ``to_empty``: the RoPE buffer recomputed, the weights drawn (uniform: fast)."""
            self.freqs_cis = precompute_freqs_cis(self.head_dim, self.max_seq)
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.uniform_(-0.02, 0.02)

    return Transformer


def _child(case: str, dtype: str, q) -> None:
    import torch

    Transformer = _model_classes()
    import conserve
    from conserve.laws import compile_laws

    cfg = dict(CASES[case])
    on_meta = cfg.pop("meta")
    with torch.device("meta"):  # warm-up (imports, first calls): a narrow 2-layer instance, untimed
        warm = Transformer(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden=512, vocab=cfg["vocab"])
    conserve.detect(warm, loss="ce")
    with torch.device("meta"):
        model = Transformer(**cfg)
    if not on_meta:
        model = model.to(getattr(torch, dtype)).to_empty(device="cpu")
        model.init_weights()
    n = sum(p.numel() for p in model.parameters())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    found = conserve.detect(model, loss="ce")
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compile_laws(found.laws, {k: tuple(p.shape) for k, p in model.named_parameters()})
    q.put({"params": n, "seconds": dt, "peak_gb": peak / 1e6, "growth_gb": (peak - base) / 1e6,
           "families": found.families(), "detector": found.detector, "undetected": len(found.undetected),
           "declined": sorted({x.module for x in found.declined})[:6], "notes": getattr(found, "notes", []),
           "threads": torch.get_num_threads()})


def _run(case: str, dtype: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(case, dtype, q))
    p.start()
    p.join()
    return q.get() if not q.empty() else {"error": f"exit code {p.exitcode}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the materialised case (bfloat16, float32)")
    args = ap.parse_args()
    cases = list(CASES) if args.case == "all" else [args.case]
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"load average before: {load:.2f} on {os.cpu_count()} CPUs")
    for case in cases:
        r = _run(case, args.dtype)
        if "error" in r:
            print(f"{case}: {r['error']}")
            continue
        where = "meta device" if CASES[case]["meta"] else f"materialised on the CPU, {args.dtype}"
        print(f"{case} ({where}): {r['params'] / 1e9:.2f}e9 parameters, {r['seconds']:.1f} s, peak RSS "
              f"{r['peak_gb']:.2f} GB (+{r['growth_gb']:.2f} GB during detection), {r['threads']} threads")
        print(f"  detector {r['detector']}: {r['families']}; undetected {r['undetected']}; declined {r['declined']}")
        for note in r["notes"]:
            print(f"  - {note}")


if __name__ == "__main__":
    main()
