#!/usr/bin/env bash
# One prepared GPU check of conserve.kernels (issue 3): run from the repository root on the device.
#   bash bench/gpu_check.sh            # results under $OUT (default: ./gpu_out)
# (a) parity of the compiled Triton path vs the float64 torch reference (< 30 s incl. compilation),
# (b) Llama-3-8B x 8 layers, no-RoPE and RoPE plans, fp32 and bf16, (c) ViT-B/16 x 12,
# (d) the fused AdamW benchmark (issue 4) with its per-kernel breakdown, the overlap parity (overlap=True
# vs serial: bitwise equal weights, state and tracker rows; a FAILED line fails this script) and the
# A/B of overlap on/off on drift steps (ratios to torch's fused AdamW), (e) the RoPE fp32 case again
# with the Gram/norm stream overlap switched off (A/B of that choice).  (b) prints the time per
# kernel (--profile) so the bound (Gram vs row/column kernel) is visible in one run; (f) A/Bs the
# Gram output tile (--gram-bt 64), (g) the norm-load pipelining (--norm-stages 1), (h) 3xTF32 Gram
# dots (--precision tf32x3: kernels.Config(input_precision="tf32x3")).  The tunables are Config
# fields set from bench.kernels' flags (the library reads none from the environment).
# torch.compile of the naive code is skipped by default (it costs ~20-40 s per case on a cold
# machine; the lead's earlier numbers have it): COMPILE=1 bash bench/gpu_check.sh to include it.
set -u
# the device copy is a bare working tree: install the package (kernels/ becomes conserve.kernels, as
# pyproject.toml maps it); offline, so no build isolation and no dependency resolution
python -m pip install -q --no-deps --no-build-isolation -e . || { echo "pip install -e . failed"; exit 2; }
python -c "import conserve.kernels" || { echo "conserve.kernels is not importable after the install"; exit 2; }
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
NOCOMPILE="--no-compile"
[ "${COMPILE:-0}" = "1" ] && NOCOMPILE=""
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== (a) parity"
timeout 90 python -m bench.gpu_parity 2>&1 | tee "$OUT/parity.txt"
parity_rc=${PIPESTATUS[0]}
echo "parity rc=$parity_rc at $(( $(date +%s) - t0 )) s"

echo "== (b) llama-3-8b x 8 layers"
timeout 200 python -m bench.kernels --cases norope,llama --dtypes float32,bfloat16 $NOCOMPILE --profile \
    --csv "$OUT/results.csv" 2>&1 | tee "$OUT/bench_llama.txt"
echo "llama bench rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 )) s"

echo "== (c) vit-b16 x 12"
timeout 60 python -m bench.kernels --cases vit --dtypes float32,bfloat16 $NOCOMPILE \
    --csv "$OUT/results.csv" 2>&1 | tee "$OUT/bench_vit.txt"
echo "vit bench rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 )) s"

echo "== (d) fused AdamW vs torch fused AdamW (issue 4), per-kernel breakdown, overlap parity and A/B"
timeout 300 python -m bench.fused_optim --csv "$OUT/results_optim.csv" 2>&1 | tee "$OUT/bench_optim.txt"
echo "optim bench rc=${PIPESTATUS[0]} at $(( $(date +%s) - t0 )) s"
grep -E "^overlap" "$OUT/bench_optim.txt" || echo "overlap parity / A/B: no output (the bench stopped before them)"
if ! grep -q "^overlap_parity every=1 budget=None: bitwise" "$OUT/bench_optim.txt" \
        || grep -q "^overlap_parity.*FAILED" "$OUT/bench_optim.txt"; then
    echo "overlap parity FAILED or missing"; [ "$parity_rc" = "0" ] && parity_rc=3
fi

echo "== (e) llama fp32 without the Gram/norm stream overlap"
timeout 60 python -m bench.kernels --cases llama --dtypes float32 --no-compile --no-overlap \
    --csv "$OUT/results_no_overlap.csv" 2>&1 | tee "$OUT/bench_no_overlap.txt"
echo "== (f) llama/norope fp32 with 64 x 64 Gram tiles (--gram-bt 64: fewer registers, 3/4 of the FLOPs)"
timeout 90 python -m bench.kernels --cases norope,llama --dtypes float32 --no-compile --profile --gram-bt 64 \
    --csv "$OUT/results_bt64.csv" 2>&1 | tee "$OUT/bench_bt64.txt"
# (g) fp32 only since the overlap A/B joined (d) (keeps the whole script at its former ~8-10 minutes)
echo "== (g) llama fp32 with unpipelined norm loads (--norm-stages 1, the previous kernel)"
timeout 60 python -m bench.kernels --cases llama --dtypes float32 --no-compile --profile --norm-stages 1 \
    --csv "$OUT/results_stages1.csv" 2>&1 | tee "$OUT/bench_stages1.txt"
echo "== (h) norope fp32 with 3xTF32 Gram dots (--precision tf32x3; parity: (a) checks it against float64)"
timeout 90 python -m bench.kernels --cases norope,llama --dtypes float32 --no-compile --profile --precision tf32x3 \
    --csv "$OUT/results_tf32x3.csv" 2>&1 | tee "$OUT/bench_tf32x3.txt"
echo "done in $(( $(date +%s) - t0 )) s; parity rc=$parity_rc"
exit "$parity_rc"
