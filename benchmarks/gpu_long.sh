#!/usr/bin/env bash
# Long prompts on one H200 in one device command (~9 minutes): what the prefill
# issue still needs measured with the current kernels.
#   1. stock vs fused at 16K and 32K, one round (stock's per-token Gated
#      DeltaNet loop makes a 32K prompt take about two minutes);
#   2. fused alone at 64K and 128K, one round: tokens/s and MLX's peak-memory
#      counter (target: weights + KV cache + 4 GB at 128K).
# Stock at 64K/128K would take 4-8 minutes a run and is left out.
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_long.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_long.sh OUT}
mkdir -p "$OUT"
LOG="$OUT/long.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# A step killed by its timeout prints every thread's Python stack.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
step fused alone at 64K and 128K
timeout -s ABRT 200 python3 benchmarks/run_gpu_suite.py "$OUT" --lengths 64K,128K --rounds 1 \
  --backends fused --decode-tokens 16 --no-fidelity --max-seconds 190 --tag long-fused \
  --no-progress >> "$LOG" 2>&1
step stock vs fused at 16K and 32K
timeout -s ABRT 340 python3 benchmarks/run_gpu_suite.py "$OUT" --lengths 16K,32K --rounds 1 \
  --backends stock,fused --decode-tokens 16 --no-fidelity --max-seconds 330 --tag long-stock \
  --no-progress >> "$LOG" 2>&1
step done
tail -40 "$LOG"
