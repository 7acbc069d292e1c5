"""Host memory a failing sink's kept rows take (``Tracker.unwritten``, bounded by ``max_unwritten``): a
24-layer tiny Llama tracked with a sink that always raises, 400 steps, measured with tracemalloc.

    OMP_NUM_THREADS=1 python -m bench.unwritten_rows
"""
import tracemalloc, warnings, torch, conserve, transformers as T
warnings.simplefilter("ignore")
class Bad:
    def write(self, step, m): raise OSError("full")
    def close(self): pass
cfg = T.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=24, vocab_size=50)
m = T.LlamaForCausalLM(cfg)
opt = conserve.track(torch.optim.SGD(m.parameters(), lr=1e-3), m, every=100, sinks=[Bad()], drift=True)
x = torch.randint(0, 50, (2, 8))
def steps(n):
    for _ in range(n):
        opt.zero_grad(); m(input_ids=x, labels=x).loss.backward(); opt.step()
steps(100); opt.flush()
tracemalloc.start()
a = tracemalloc.take_snapshot()
steps(400); opt.flush()
b = tracemalloc.take_snapshot()
owed = len(opt.tracker.unwritten[opt.tracker.sinks[0]])
diff = sum(s.size_diff for s in b.compare_to(a, "filename"))
keys = len(opt.tracker.metric_names)
print(f"keys per row {keys}, rows owed {owed}, +{diff/400:.0f} bytes per row held, {diff/400/keys:.0f} bytes per key")
