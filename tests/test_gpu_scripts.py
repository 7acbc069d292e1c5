"""The prepared GPU run (``bench/gpu_check.sh``) checked on the CPU: the script parses, every module it
runs exists, the interleaved step bench runs end to end at toy size and writes the rows the summary
reads, and the summary table compares each figure with its target (and says "not measured" for a
missing one)."""
import csv
import importlib.util
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")


def test_gpu_check_parses_and_names_existing_modules():
    res = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = open(SCRIPT).read()
    mods = set(re.findall(r"python -m (bench\.\w+)", text))
    assert {"bench.gpu_parity", "bench.gpu_smoke", "bench.overlap_check", "bench.kernels", "bench.step_ab",
            "bench.gpu_summary"} <= mods
    for m in mods:
        assert importlib.util.find_spec(m) is not None, f"gpu_check.sh runs {m}, which does not exist"


def test_step_ab_runs_interleaved_and_summary_reads_it(tmp_path):
    from bench import gpu_summary, step_ab

    path = tmp_path / "step_ab.csv"
    rows = step_ab.main(["--device", "cpu", "--small", "--pairs", "1", "--opt-steps", "4", "--train-steps", "4",
                         "--warmup", "1", "--cases", "fused_untracked,track_eps_only,train_track",
                         "--csv", str(path)])
    assert [r["pairs"] for r in rows] == [1, 1, 1]
    assert all(r["a_ms"] > 0 and r["b_ms"] > 0 and r["lo"] <= r["ratio"] <= r["hi"] for r in rows)
    with open(path, newline="") as f:
        written = list(csv.DictReader(f))
    assert [w["figure"] for w in written] == [r["figure"] for r in rows]
    lines = gpu_summary.table(str(tmp_path))
    text = "\n".join(lines)
    assert "| FusedAdamW untracked / torch fused AdamW | %.4fx" % rows[0]["ratio"] in text
    assert "| whole training step, conserve.track(torch fused) / untracked | %.4fx" % rows[2]["ratio"] in text
    assert "| law pass, RoPE plan, fp32 | not measured |" in text
    assert "| FusedAdamW tracked (defaults) / torch fused | not measured |" in text


def test_step_ab_refuses_a_block_that_is_not_whole_drift_cadences():
    from bench import step_ab

    with pytest.raises(SystemExit):
        step_ab.main(["--device", "cpu", "--small", "--opt-steps", "3"])


def test_summary_compares_law_pass_with_targets(tmp_path):
    from bench import gpu_summary

    cols = ["case", "dtype", "triton_ms", "naive_ms", "compiled_ms", "read_floor_ms"]
    with open(tmp_path / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerow(["llama", "float32", "2.84", "8.74", "4.37", "1.64"])
        w.writerow(["llama", "bfloat16", "0.90", "13.8", "", "0.82"])
    text = "\n".join(gpu_summary.table(str(tmp_path)))
    assert "| law pass, RoPE plan, fp32 | 2.84 ms | read floor 1.64 ms, naive 8.74, torch.compile 4.37 | <= 1.90 ms | no |" in text
    assert "| law pass, RoPE plan, bf16 | 0.90 ms |" in text and "<= 0.95 ms | yes |" in text
    assert "| law pass, no-RoPE plan (QK Grams), fp32 | not measured |" in text
