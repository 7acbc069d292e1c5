"""What a user runs most, on the GPU: ``conserve.track`` and the fused optimizers against the torch
twin, in every accumulation mode (not a test: the CPU suite checks the same code under the interpreter).

    python -m bench.gpu_smoke            # on the GPU; exits 1 if a check fails
    TRITON_INTERPRET=1 python -m bench.gpu_smoke --device cpu --small   # the same checks on the CPU

For a small reference LM (RoPE, GQA, SwiGLU, an MoE layer), 4 training steps, each of:

* ``conserve.track(torch fused AdamW)``: fp32 weights, bf16 weights, and ``fp64=True``
  (float64 accumulation: the DRIFT composition goes through the norm kernel's bilinear path);
* ``FusedAdamW(track=model)`` and ``FusedSGD(track=model)`` in fp32 and with ``fp64=True``;

run with ``backend="triton"`` and ``backend="torch"`` in lockstep (the Triton twin's gradients copied
to the torch twin), every drift step decomposed: the law values ``h`` and the drift terms of every
step (``keep_last``) must match the torch twin's, and none may be non-finite.  ``conserve.track``
steps both copies with torch's optimizer (the same weights): each term within 1e-4 of its largest
entry (1e-9 with ``fp64=True``; the residual against the largest measured drift).  The fused
optimizers' Triton and torch steps round the weights differently, so their terms are held to 1e-5
of the largest law value (a few fp32 roundings of ``h``).  Prints one line per case, ``ok`` / ``FAILED`` with the worst
relative difference and where.
"""
from __future__ import annotations

import sys
import time

import torch


def _model(device, dtype, small=False):
    from conserve.models.lm import DecoderLM, LMConfig

    cfg = (LMConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=48, num_experts=2, moe_layers=(1,), top_k=1) if small else
           LMConfig(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, intermediate_size=384, num_experts=4, moe_layers=(1,), top_k=2))
    with torch.device(device):
        torch.manual_seed(0)
        m = DecoderLM(cfg)
    return m.to(dtype)


def _pair(kind, dtype, fp64, device, small):
    """The same optimizer twice over two copies of one model: ``backend="triton"`` and ``"torch"``."""
    import conserve
    from conserve.optim import FusedAdamW, FusedSGD

    out = []
    for backend in ("triton", "torch"):
        m = _model(device, dtype, small)
        kw = dict(every=1000, drift_every=1, snapshot_budget=None, fp64=fp64, backend=backend, keep_last=True)
        if kind == "track":
            fused = dict(fused=True) if device.type == "cuda" else {}
            opt = conserve.track(torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, **fused), m, **kw)
        elif kind == "fused_adamw":
            opt = FusedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1, track=m, **kw)
        else:
            opt = FusedSGD(m.parameters(), lr=1e-2, momentum=0.9, track=m, **kw)
        out.append((m, opt))
    return out


def _amax(v):
    return max([v.vec.abs().max().item() if v.vec.numel() else 0.0]
               + [g.abs().max().item() for g in v.grams.values() if g.numel()])


def _worst(got, want, scale):
    """Largest ``|got - want|`` over the entries of two ``Values``, divided by ``scale``."""
    d = (got.vec.double() - want.vec.double()).abs().max().item() if want.vec.numel() else 0.0
    for k, g in want.grams.items():
        if g.numel():
            d = max(d, (got.grams[k].double() - g.double()).abs().max().item())
    return d / max(scale, 1e-300)


def _run(kind, dtype, fp64, device, small, steps=4):
    """Steps both twins with the same gradients (computed on the Triton twin's model, copied); returns
    ``(worst relative difference, where)`` over the law values and every drift term of every step:
    each term against the largest entry of the torch twin's same term, the residual against the
    largest measured drift."""
    (ma, oa), (mb, ob) = _pair(kind, dtype, fp64, device, small)
    g = torch.Generator(device).manual_seed(1)
    worst, where = 0.0, ""
    for step in range(1, steps + 1):
        x = torch.randint(0, 128, (4, 32), device=device, generator=g)
        oa.zero_grad()
        torch.nn.functional.cross_entropy(ma(x).float().flatten(0, 1), x.flatten()).backward()
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = None if pa.grad is None else pa.grad.clone()
        oa.step()
        ob.step()
        ta, tb = oa.tracker, ob.tracker
        hmax = _amax(tb.h)
        checks = [("h", ta.h, tb.h, hmax)]
        if kind == "track":  # one optimizer (torch's) steps both copies: the same weights, per-term scales
            checks += [(t, ta.last[t], tb.last[t], _amax(tb.last["measured" if t == "residual" else t]))
                       for t in ("measured", "decay", "first", "second", "residual")]
        else:  # the Triton and torch steps round differently: terms against |h| (one fp32 step's rounding)
            checks += [(t, ta.last[t], tb.last[t], hmax) for t in ("measured", "decay", "first", "second", "residual")]
        for name, a, b, scale in checks:
            for v in (a.vec, *a.grams.values()):
                if not torch.isfinite(v).all():
                    raise FloatingPointError(f"step {step}: non-finite {name} (Triton)")
            d = _worst(a, b, scale)
            if d > worst:
                worst, where = d, f"{name} at step {step}"
    oa.close()
    ob.close()
    return worst, where


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a toy model (the CPU run under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (--device cpu with TRITON_INTERPRET=1 runs the checks on the CPU)")
        return 0
    cases = [("track", torch.float32, False), ("track", torch.bfloat16, False), ("track", torch.float32, True),
             ("fused_adamw", torch.float32, False), ("fused_adamw", torch.float32, True),
             ("fused_sgd", torch.float32, False), ("fused_sgd", torch.float32, True)]
    failed = 0
    for kind, dtype, fp64 in cases:
        name = f"{kind} {str(dtype).split('.')[-1]}{' fp64=True' if fp64 else ''}"
        t = time.perf_counter()
        try:
            worst, where = _run(kind, dtype, fp64, dev, args.small)
            tol = 1e-9 if fp64 and kind == "track" else 1e-4 if kind == "track" else 1e-5
            ok = worst <= tol
            line = f"worst rel diff {worst:.2e} ({where}; tolerance {tol:.0e})"
        except Exception as e:  # report and go on to the next case
            ok, line = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        failed += not ok
        print(f"smoke {name:<28s} {'ok    ' if ok else 'FAILED'} {line}  ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"gpu_smoke: {len(cases) - failed} ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
