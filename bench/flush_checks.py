"""What the per-flush checks cost beside the flush itself: ``check_frozen`` (frozen / no longer held
parameters, ``conserve.tracking.breakers``) against a whole ``Tracker.flush`` of ``every`` rows, on a
24-layer tiny Llama (218 tracked tensors), CPU.

    OMP_NUM_THREADS=1 python -m bench.flush_checks
"""
from __future__ import annotations

import timeit
import warnings

import torch


def main() -> None:
    import transformers as T

    import conserve
    from conserve.tracking.breakers import check_frozen

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                        num_hidden_layers=24, vocab_size=50)
    model = T.LlamaForCausalLM(cfg)
    every = 50
    opt = conserve.track(torch.optim.AdamW(model.parameters(), lr=1e-3), model, every=10 ** 9, drift=False)
    tr = opt.tracker
    x = torch.randint(0, 50, (2, 8))
    check_frozen(tr)
    n = 500
    check = timeit.timeit(lambda: check_frozen(tr), number=n) / n
    flushes = []
    for _ in range(3):
        for _ in range(every):
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        flushes.append(timeit.timeit(opt.flush, number=1))
    flush = min(flushes)
    print(f"tracked tensors {len(tr.params)}, laws {len(tr.laws)}; check_frozen {check * 1e6:.1f} us per flush, "
          f"flush of {every} rows {flush * 1e3:.2f} ms: the check is {check / flush:.3f}x the flush (which runs it once)")
    opt.close()


if __name__ == "__main__":
    main()
