"""The gradient check (``conserve.analysis.gradcheck``): its cost beside a training step, and its floors.

    OMP_NUM_THREADS=1 python -m bench.gradcheck_cost              # cost on CPU (a minute on 2 cores)
    OMP_NUM_THREADS=1 python -m bench.gradcheck_cost --floors     # floors and smallest detected faults
    python -m bench.gradcheck_cost --loads                        # also the bytes the Triton pass loads (interpreter)
    python -m bench.gradcheck_cost --quick [--floors]             # a smoke run (tests/test_gradcheck_api.py)

Cost (default): on a ~14M-parameter LM (``bench.track_overhead.lm14m``, batch 16 x 64, AdamW), timed in
interleaved blocks in one run (``bench.track_overhead.interleaved``): the training step (forward, backward,
``AdamW.step``), one checked step of the check (``GradCheck.update(params, grads)``: the products pass and
the norms pass, finished and accumulated), and ONE streaming read of the laws' weights and gradients
(``torch._foreach_norm`` over each: the cheapest pass that touches every byte).  Printed: the median times,
the paired ratios check / step and check / read, and the bytes (``pass_bytes``, counted from the launch
tables with the GPU tiles): the laws' weights and gradients (each element once) beside what one evaluation of
the laws loads on each, what the check's one Triton pass loads, and what the CPU twin's two passes read.

Floors (``--floors``): a tiny Llama-like LM (conserve's ``DecoderLM``: GQA, RoPE, SwiGLU, a softmax MoE
layer with 4 experts, top 2; untied head; batch 8 x 64) trained by SGD for ``steps`` steps per gradient
dtype: float32; bfloat16 autocast; float16 autocast with ``GradScaler`` (unscaled before the check).  Per
dtype and law kind (quadratic; linear: router sum, translation): the largest ``worst`` (with its family)
and the largest law ``aggregate`` of the true gradients over the steps, beside the floors; then, per
planted fault, the smallest size on a grid (10^(-k/2)) that flags the right law in the right layer, from
one step and from all the steps aggregated.
The transformers Llama (``LlamaForCausalLM``, 2 layers) is measured too when transformers is installed.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch
import torch.nn.functional as F

import conserve
from conserve.analysis.gradcheck import GradCheck, GradPlan, aggregate_floor, floor, select
from conserve.models import DecoderLM, LMConfig

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEAR = ("router_sum", "translation")  # the catalogue's linear laws (their own floors)


# -------------------------------------------------------------------------------------------- cost
def launch_bytes(st) -> int:
    """Bytes the Triton launches of a canonicalised plan (``conserve.kernels.launch.Structure``) load from the
    tensors: every norm item its rows x column tile of x (and y), every Gram item its output rows (both row
    blocks off the diagonal) x contracted chunk of every term of its slot, of x (and y)."""
    from conserve.kernels.tables import GRAM_ITEM, GRAM_TERM, NORM_ITEM, REGION

    total = 0
    for l in st.norm:
        e = sum(torch.empty(0, dtype=d).element_size() for d in (l.group if st.bilinear else l.group[:1]))
        for it in l.items:
            F = int(l.regions[it[NORM_ITEM.REGION], REGION.F])
            total += int(it[NORM_ITEM.S_END] - it[NORM_ITEM.S_START]) * min(l.BF, F - int(it[NORM_ITEM.F0])) * e
    for b in st.gram:
        for l in b.launches:
            e = sum(torch.empty(0, dtype=d).element_size() for d in (l.group if st.bilinear else l.group[:1]))
            for it in l.items:
                ti, tj = int(it[GRAM_ITEM.TI]), int(it[GRAM_ITEM.TJ])
                rows = min(b.BT, b.D - ti * b.BT) + (0 if l.single else min(b.BT, b.D - tj * b.BT))
                for t in range(int(it[GRAM_ITEM.T0]), int(it[GRAM_ITEM.T1])):
                    k = max(0, min(int(it[GRAM_ITEM.K1]), int(l.terms[t, GRAM_TERM.N])) - int(it[GRAM_ITEM.K0]))
                    total += rows * k * e
    return total


@contextlib.contextmanager
def interpreted_loads(tensors):
    """Count, under ``TRITON_INTERPRET=1``, the bytes every Triton load inside the block reads from the storage of
    ``tensors`` (the masked-in elements whose address falls in one of them: work tables and outputs are not
    counted).  Yields a dict whose ``"bytes"`` grows as the kernels run."""
    import numpy as np
    from triton.runtime import interpreter as I

    spans = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                    for t in tensors})
    lo, hi = np.array([a for a, _ in spans], dtype=np.uint64), np.array([b for _, b in spans], dtype=np.uint64)
    out = {"bytes": 0}
    orig = I.InterpreterBuilder.create_masked_load

    def counted(self, ptrs, mask, other, *args, **kwargs):
        addr = np.asarray(ptrs.data).astype(np.uint64).reshape(-1)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)
        k = np.searchsorted(lo, addr, side="right") - 1
        inside = (k >= 0) & (addr < hi[np.clip(k, 0, None)]) & m
        out["bytes"] += int(inside.sum()) * np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize
        return orig(self, ptrs, mask, other, *args, **kwargs)

    I.InterpreterBuilder.create_masked_load = counted
    try:
        yield out
    finally:
        I.InterpreterBuilder.create_masked_load = orig


def measured_loads(plan: GradPlan, params, grads) -> int:
    """Bytes the check's one Triton pass reads from the weights and gradients as the kernels run (the interpreter,
    GPU tiles: ``interpreted_loads`` around ``GradPlan.raw(..., backend="triton")``); needs ``TRITON_INTERPRET=1``."""
    from bench.compile_launches import gpu_tiles

    xs, gs = [params[n].detach() for n in plan.names], [grads[n] for n in plan.names]
    with gpu_tiles(), interpreted_loads(xs + gs) as n:
        plan.raw(params, grads, fp64=False, backend="triton")
    return n["bytes"]


def pass_bytes(plan: GradPlan, params) -> dict:
    """Bytes, with the GPU tiles (``Tiles.gpu``, 132 SMs): ``once`` the laws' weights and gradients, each element
    once; ``law pass`` what one evaluation of the laws loads on the weights plus one on the gradients; ``check``
    what the check's one Triton pass loads (``kernels.check_sums``, CHECK mode); ``twin`` what the torch twin's
    two passes read (each term's view per pass, a tensor once per direction)."""
    from conserve.kernels import launch as L

    cfg = L.Tiles.gpu(132)
    xs = [params[n].detach() for n in plan.names]
    cplan = plan.compiled.plan
    once = sum(x.numel() * x.element_size() for x in xs) * 2
    law = 2 * launch_bytes(L.build(cplan, xs, None, False, cfg))
    check = launch_bytes(L.build(cplan, xs, xs, False, cfg, check=True))
    seen = set()
    for t in list(cplan.grams) + list(cplan.norms) + list(cplan.sums):
        v = t.view
        seen.add((v.tensor, v.start, v.row_dim, v.rows, v.col_dim, v.cols, v.row_step))
    twin = 2 * sum(r * c * xs[i].element_size() for (i, _, _, r, _, c, _) in seen) * 2
    return {"once": once, "law pass": law, "check": check, "twin": twin}


def cost(blocks: int, quick: bool, loads: bool = False) -> None:
    from bench.track_overhead import interleaved, lm14m

    torch.manual_seed(0)
    model = lm14m() if not quick else DecoderLM(LMConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         intermediate_size=128))
    named = dict(model.named_parameters())
    laws, _ = select(conserve.detect(model, loss="ce"), loss="ce")
    plan = GradPlan(laws, named)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def step():
        x = torch.randint(0, vocab, (16, 64), generator=gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()

    checks = {fp64: GradCheck(plan, fp64=fp64) for fp64 in (True, False)}
    lp = [named[n] for n in plan.names]

    def check(fp64):
        checks[fp64].update(named, {n: p.grad for n, p in named.items()})

    def read():
        torch._foreach_norm([p.detach() for p in lp])
        torch._foreach_norm([p.grad for p in lp])

    for _ in range(2):
        step(), check(True), check(False), read()
    fns = {"step": step, "check fp64": lambda: check(True), "check fp32": lambda: check(False), "one read": read}
    times, ratios = interleaved(fns, blocks, 1 if not quick else 2, "step")
    _, per_read = interleaved({"one read": read, "check fp64": lambda: check(True),
                               "check fp32": lambda: check(False)}, blocks, 1, "one read")
    nb = pass_bytes(plan, named)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"gradient check cost, CPU, {torch.get_num_threads()} thread(s): LM of {nparams / 1e6:.1f}M parameters, "
          f"{len(plan.laws)} laws, {plan.entries} entries, batch 16 x 64, AdamW")
    print(f"{'':12s} {'median ms':>10s} {'/ step':>8s} {'/ one read':>11s}")
    for k in fns:
        rd = f"{per_read[k]:11.2f}" if k in per_read else f"{'-':>11s}"
        print(f"{k:12s} {times[k]:10.2f} {ratios[k]:8.3f} {rd}")
    once = nb["once"]
    print(f"bytes (GPU tiles): laws' weights + gradients {once / 1e6:.1f} MB each element once; one law pass on "
          f"each {nb['law pass'] / 1e6:.1f} MB ({nb['law pass'] / once:.3f} x); the check's Triton pass "
          f"{nb['check'] / 1e6:.1f} MB ({nb['check'] / once:.3f} x, {nb['check'] / nb['law pass']:.3f} x the law "
          f"passes); the CPU twin's two passes {nb['twin'] / 1e6:.1f} MB ({nb['twin'] / once:.2f} x)")
    if loads:  # the same pass run by the interpreter, its loads counted as they happen
        got = measured_loads(plan, named, {n: p.grad for n, p in named.items()})
        print(f"loads measured (Triton interpreter, GPU tiles, one checked step): {got / 1e6:.1f} MB "
              f"({got / once:.3f} x the laws' weights + gradients; the tables' count {nb['check'] / 1e6:.1f} MB)")


# -------------------------------------------------------------------------------------------- floors
def tiny_lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, num_experts=4, moe_layers=(1,), top_k=2))


def hf_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def trajectory(model, dtype: str, steps: int, seed: int = 1):
    """``steps`` SGD steps of ``model`` (a copy is not made: the caller passes a fresh one) with gradients in
    ``dtype``; returns ``[(params, grads)]`` per step (copies, before the step; float16: unscaled)."""
    named = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu") if dtype == "float16" else None
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    while len(out) < steps:
        x = torch.randint(0, vocab, (8, 64), generator=gen)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=DTYPES[dtype] or torch.bfloat16, enabled=DTYPES[dtype] is not None):
            logits = model(x)
        logits = getattr(logits, "logits", logits)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        grads = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        if all(torch.isfinite(g).all() for g in grads.values()):  # a scaler's skipped step is not a gradient
            out.append(({n: p.detach().clone() for n, p in named.items()}, grads))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return out


def _head_cols(name, cols):
    def f(params, grads, size):
        g = grads[name].clone()
        g[:, cols] *= 1 + size
        return {**grads, name: g}
    return f


def _noise(name, seed=0):
    def f(params, grads, size):
        gen = torch.Generator().manual_seed(seed)
        g = grads[name]
        return {**grads, name: g * (1 + size * torch.randn(g.shape, generator=gen))}
    return f


def _decay(params, grads, size):
    """Weight decay folded into the gradient: ``g + lam theta`` with ``||lam theta|| = size ||g||`` over the
    laws' parameters (the fault's size relative to the gradient)."""
    t = math.sqrt(sum(float((params[n] ** 2).sum()) for n in grads))
    gn = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    lam = size * gn / t
    return {n: g + lam * params[n] for n, g in grads.items()}


FAULTS = {  # name: (what, fault(params, grads, size), law that must be flagged)
    "o_proj head": ("one head's o_proj columns x (1 + f) (a hook)", _head_cols("layers.0.self_attn.o_proj.weight",
                                                                              slice(0, 16)), "layers.0.self_attn/vo/"),
    "down noise": ("relative noise f on one down_proj gradient (a kernel)", _noise("layers.0.mlp.down_proj.weight"),
                   "layers.0.mlp/unit"),
    "decay": ("L2 folded into p.grad, ||lam theta|| = f ||g||", _decay, "layers."),
}
GRID = [10 ** (-k / 2) for k in range(14, -1, -1)]  # 1e-7 ... 1


def smallest(traj, plan, dtype, fault, target, steps):
    """The smallest size on ``GRID`` whose fault flags a law named ``target...`` (from the first ``steps``)."""
    for size in GRID:
        chk = GradCheck(plan, dtype=dtype)
        for params, grads in traj[:steps]:
            chk.update(params, fault(params, grads, size))
        if any(c.name.startswith(target) for c in chk.flagged()):
            return size
    return None


def floors(steps: int, quick: bool) -> None:
    models = {"conserve DecoderLM": tiny_lm}
    if not quick:
        import importlib.util

        if importlib.util.find_spec("transformers") is not None:
            models["transformers Llama"] = hf_llama
    print(f"true-gradient floors over {steps} SGD steps (batch 8 x 64), quadratic and linear laws apart")
    print(f"{'model':20s} {'gradient':30s} {'laws':9s} {'max worst (family)':>26s} {'max law aggregate':>17s} "
          f"{'floors worst / aggregate':>25s}")
    kept = {}
    for mname, build in models.items():
        for dtype in DTYPES:
            model = build()
            laws, _ = select(conserve.detect(model, loss="ce"), loss="ce")
            plan = GradPlan(laws, dict(model.named_parameters()))
            traj = trajectory(model, dtype, steps)
            chk = GradCheck(plan, dtype=dtype)
            for params, grads in traj:
                chk.update(params, grads)
            res = chk.result()
            label = {"float32": "float32", "bfloat16": "bfloat16 autocast",
                     "float16": "float16 autocast + GradScaler"}[dtype]
            for linear in (False, True):
                some = [c for c in res.laws if c.family in LINEAR] if linear else \
                    [c for c in res.laws if c.family not in LINEAR]
                if not some:
                    continue
                w = max(some, key=lambda c: c.worst)
                a = max(some, key=lambda c: c.aggregate)
                print(f"{mname:20s} {label:30s} {'linear' if linear else 'quadratic':9s} {w.worst:12.2e} "
                      f"({w.family:>11s}) {a.aggregate:17.2e} {floor(dtype, linear):14.1e} / "
                      f"{aggregate_floor(dtype, linear):.1e}")
            if mname == "conserve DecoderLM":
                kept[dtype] = (plan, traj)
    print(f"\nsmallest planted fault flagged (right law and layer; grid 10^(-k/2)), conserve DecoderLM, "
          f"1 step / {steps} steps aggregated")
    print(f"{'fault':52s} " + " ".join(f"{d:>20s}" for d in DTYPES))
    for name, (what, fault, target) in FAULTS.items():
        cells = []
        for dtype in DTYPES:
            plan, traj = kept[dtype]
            one, many = (smallest(traj, plan, dtype, fault, target, k) for k in (1, steps))
            fmt = lambda s: "none" if s is None else f"{s:.0e}"  # noqa: E731
            cells.append(f"{fmt(one):>9s} / {fmt(many):>8s}")
        print(f"{what:52s} " + " ".join(f"{c:>20s}" for c in cells))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floors", action="store_true", help="floors and smallest detected faults instead of the cost")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few repetitions")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved timing blocks (cost)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per dtype (floors)")
    ap.add_argument("--loads", action="store_true", help="also run the check's Triton pass under the interpreter "
                    "with the GPU tiles and count the bytes its loads read (cost; sets TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.loads:  # read when the kernels are first imported (lazily, by the first Triton call)
        os.environ["TRITON_INTERPRET"] = "1"
    t = time.perf_counter()
    if args.floors:
        floors(args.steps or (2 if args.quick else 16), args.quick)
    else:
        cost(args.blocks or (2 if args.quick else 7), args.quick, args.loads)
    print(f"({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
