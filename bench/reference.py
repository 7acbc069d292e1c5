"""CPU cost of the torch twin: the grouped (vectorised) form vs the term-by-term loop (not a timed test).

    python -m bench.reference                       # conserve run's default model, --size base, --hidden 256, MoE
    python -m bench.reference --threads 2 --repeat 20

For each model (built as ``conserve run`` builds it: ``commands.run.build_config`` with the CLI
defaults plus the listed overrides, the laws ``conserve.track`` detects), prints the number of laws
and plan terms, the milliseconds of one whole-model evaluation ``h(theta)``, one bilinear form and
one drift call (the four pieces) with both forms of the twin, their ratio, and the largest
difference between the two in float64 relative to the entrywise scale (the tests demand <= 1e-12),
and the grouped form's memory over the weights' bytes: the peak of the storages one call creates
(outputs included; ``bench.track_overhead.LiveBytes``) and the bytes of the tensors its cached
structures hold (index tables, signs).
Every ratio comes from the same run (best of ``--repeat`` calls each, one intra-op thread by default).
"""
from __future__ import annotations

import argparse
import time

import torch

CASES = {"default": [], "base": ["--size", "base"], "hidden256": ["--hidden", "256"],
         "base256-moe": ["--size", "base", "--hidden", "256", "--experts", "8"]}


def build(extra):
    from conserve.commands import run
    from conserve.models import DecoderLM
    from conserve.tracker import Tracker

    p = argparse.ArgumentParser()
    run.add_arguments(p)
    args = p.parse_args(extra)
    torch.manual_seed(0)
    model = DecoderLM(run.build_config(args))
    tr = Tracker(model)
    return tr.compiled.plan, [t.detach() for t in tr.tensors], len(tr.laws)


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def memory(calls, nbytes: int) -> str:
    """Peak storage of one call of each grouped form and the tensor bytes its cached structures hold,
    over ``nbytes`` (the calls are made once before, so the structures exist and are not counted)."""
    from bench.track_overhead import LiveBytes
    from conserve.kernels import reference as R

    R.clear_cache()
    peaks = []
    with torch.no_grad():
        for what, fn in calls:
            fn()
            with LiveBytes() as m:
                fn()
            peaks.append(f"{what} {m.peak / nbytes:.3f}")
    held, seen, todo = {}, set(), list(R._CACHE.values())
    while todo:  # the storages reachable from the cached structures (dataclasses, lists, tuples)
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if torch.is_tensor(o):
            held[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif hasattr(o, "__dataclass_fields__"):
            todo.extend(vars(o).values())
    return "peak of one call / weights: " + ", ".join(peaks) + f"; cached tables {sum(held.values()) / nbytes:.3f}"


def _maxrel(a, b, s) -> float:
    (va, ga), (vb, gb), (vs, gs) = a, b, s
    out = [((va - vb).abs() / vs.clamp_min(1e-300)).max().item() if vb.numel() else 0.0]
    out += [((ga[d] - gb[d]).abs() / gs[d].clamp_min(1e-300)).max().item() for d in gb if gb[d].numel()]
    return max(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dataclasses import replace

    from conserve.kernels import Plan, bilinear_reference, drift_reference, evaluate_reference
    from conserve.kernels.reference import (_evaluate_looped, check_drift_inputs, drift_factors, drift_operands,
                                            used_tensors)

    def looped_drift(plan, olds, news, av):
        # the former twin: h(new), h(a old) - h(old), B(a old, Delta), h(Delta), each term by term
        check_drift_inputs(plan, olds, news)
        av = drift_factors(av, len(news))
        ao, dl = drift_operands(plan, olds, news, av, False)
        o = [x.float() if i in set(used_tensors(plan)) else x for i, x in enumerate(olds)]
        h_a, h_o = _evaluate_looped(plan, ao, None, False), _evaluate_looped(plan, o, None, False)
        return (_evaluate_looped(plan, news, None, False), (h_a[0] - h_o[0], {d: h_a[1][d] - h_o[1][d] for d in h_a[1]}),
                _evaluate_looped(plan, ao, dl, False), _evaluate_looped(plan, dl, None, False))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), best of {a.repeat}")
    for name in a.cases.split(","):
        plan, ts, nlaws = build(CASES[name])
        ys = [torch.randn_like(t) for t in ts]
        news = [t + 1e-2 * y for t, y in zip(ts, ys)]
        nterms = len(plan.grams) + len(plan.norms) + len(plan.sums)
        mb = sum(t.numel() * t.element_size() for t in ts) / 1e6
        row, grouped_calls = [], []
        for what, grouped, looped in (
                ("evaluate", lambda: evaluate_reference(plan, ts), lambda: _evaluate_looped(plan, ts, None, False)),
                ("bilinear", lambda: bilinear_reference(plan, ts, ys), lambda: _evaluate_looped(plan, ts, ys, False)),
                ("drift", lambda: drift_reference(plan, ts, news, 0.999), lambda: looped_drift(plan, ts, news, 0.999))):
            g, l = best_ms(grouped, a.repeat), best_ms(looped, a.repeat)
            row.append(f"{what} {l:.2f} -> {g:.2f} ms (x{l / g:.1f})")
            grouped_calls.append((what, grouped))
        d64 = [t.double() for t in ts]
        ap_ = Plan([replace(t, sign=abs(t.sign)) for t in plan.grams], [replace(t, sign=abs(t.sign)) for t in plan.norms],
                   [replace(t, sign=abs(t.sign)) for t in plan.sums], plan.vec_size, dict(plan.gram_slots))
        err = _maxrel(evaluate_reference(plan, d64, fp64=True), _evaluate_looped(plan, d64, None, True),
                      _evaluate_looped(ap_, [t.abs() for t in d64], None, True))
        print(f"{name}: {nlaws} laws, {nterms} terms, {len(ts)} tensors, {mb:.1f} MB fp32 | looped -> grouped: "
              + "; ".join(row) + f" | fp64 max diff / scale {err:.1e} | "
              + memory(grouped_calls, sum(t.numel() * t.element_size() for t in ts)), flush=True)


if __name__ == "__main__":
    main()
