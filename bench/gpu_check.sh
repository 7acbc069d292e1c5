#!/usr/bin/env bash
# The prepared GPU run of conserve: from the repository root on the device machine.
#   bash bench/gpu_check.sh              # the must-have part (about 5 minutes on a warm H200)
#   EXTRA=1 bash bench/gpu_check.sh      # then the extras (ViT, the fused-optimizer breakdown, A/Bs)
# Results under $OUT (default ./gpu_out); the summary table (bench.gpu_summary) is printed last.
#
# Must-have, in this order (each part has its own timeout; a part that fails or times out is
# recorded in $OUT/status.txt and the run goes on):
#   parity   bench.gpu_parity: compiled Triton vs the float64 torch reference (evaluate, bilinear,
#            DRIFT; fp32, bf16, fp64 accumulation; 3xTF32 Gram dots)
#   smoke    bench.gpu_smoke: conserve.track(torch fused AdamW) in fp32, bf16 and fp64=True, and the
#            fused optimizers, Triton vs the torch twin; conserve run --device cuda (default, and
#            --fp64-laws with AdamW: the fp64 drift path)
#   overlap  bench.overlap_check --no-fused: the law pass's Config(overlap=True) (on by default) against
#            the serial order, bit for bit (the fused optimizers' overlap=True, off by default: extras)
#   law      bench.kernels: Llama-3-8B x 8 layers, RoPE and no-RoPE plans, fp32 (torch.compile of the
#            naive code beside it) and bf16, with the per-kernel profile
#   steps    bench.step_ab: optimizer step and whole training step (16k tokens, bf16 autocast),
#            tracked / untracked in interleaved blocks, for the fused optimizers and conserve.track
# Compilation: the parity cases share kernel configurations with the timed cases (Triton's on-disk
# cache serves the later processes); torch.compile runs for fp32 only.
set -u
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
: > "$OUT/status.txt"
t0=$(date +%s)
# the device copy is a bare working tree: install the package (kernels/ becomes conserve.kernels, as
# pyproject.toml maps it); offline, so no build isolation and no dependency resolution
python -m pip install -q --no-deps --no-build-isolation -e . || { echo "pip install -e . failed"; exit 2; }
python -c "import conserve.kernels" || { echo "conserve.kernels is not importable after the install"; exit 2; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

part() {  # part NAME TIMEOUT_S COMMAND...: run, tee to $OUT/NAME.txt, record the exit code
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(( $(date +%s) - t0 )) s)"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "$name $rc  ($*)" >> "$OUT/status.txt"
    echo "$name rc=$rc at $(( $(date +%s) - t0 )) s"
}

part parity 120 python -m bench.gpu_parity
part smoke 120 python -m bench.gpu_smoke
part run_default 60 conserve run --device cuda --steps 40 --no-progress --overwrite --out "$OUT/run_default"
part run_fp64 60 conserve run --device cuda --fp64-laws --optimizer adamw --steps 20 --no-progress --overwrite \
    --out "$OUT/run_fp64"
part overlap 60 python -m bench.overlap_check --no-fused
part law_fp32 150 python -m bench.kernels --cases norope,llama --dtypes float32 --profile --csv "$OUT/results.csv"
part law_bf16 60 python -m bench.kernels --cases norope,llama --dtypes bfloat16 --no-compile --profile \
    --csv "$OUT/results.csv"
part steps 200 python -m bench.step_ab --pairs 6 --opt-steps 20 --train-steps 4 --csv "$OUT/step_ab.csv"
echo "must-have part done in $(( $(date +%s) - t0 )) s"

if [ "${EXTRA:-0}" = "1" ]; then
    part vit 60 python -m bench.kernels --cases vit --dtypes float32,bfloat16 --no-compile --csv "$OUT/results_vit.csv"
    part overlap_fused 180 python -m bench.overlap_check
    part fused_optim 300 python -m bench.fused_optim --csv "$OUT/results_optim.csv"
    part ab_no_overlap 60 python -m bench.kernels --cases llama --dtypes float32 --no-compile --no-overlap \
        --csv "$OUT/results_no_overlap.csv"
    part ab_bt64 90 python -m bench.kernels --cases norope,llama --dtypes float32 --no-compile --profile --gram-bt 64 \
        --csv "$OUT/results_bt64.csv"
    part ab_stages1 60 python -m bench.kernels --cases llama --dtypes float32 --no-compile --profile --norm-stages 1 \
        --csv "$OUT/results_stages1.csv"
    part ab_tf32x3 90 python -m bench.kernels --cases norope,llama --dtypes float32 --no-compile --profile \
        --precision tf32x3 --csv "$OUT/results_tf32x3.csv"
fi

echo "== summary ($(( $(date +%s) - t0 )) s)"
python -m bench.gpu_summary "$OUT" | tee "$OUT/summary.txt"
# exit 1 if a must-have check failed (the timings are reported, never asserted)
bad=$(awk '$1 ~ /^(parity|smoke|run_default|run_fp64|overlap)$/ && $2 != 0 {print $1}' "$OUT/status.txt")
[ -z "$bad" ] || { echo "failed checks: $bad"; exit 1; }
