#!/usr/bin/env bash
# One device command that verifies what only a GPU can, sized for ~9 minutes
# on one H200 (fresh machine: MLX's CUDA JIT costs ~3 min of it):
#   1. every GPU kernel test, unverified CUDA kernels included;
#   2. the gated delta rule op by path and length (scan kernel vs chunked);
#   3. stock alone at 512 and 4K, 3 rounds: the baseline the issues quote;
#   4. fused with the experimental compiled decode step and the unverified
#      MoE kernels on, with ablation columns for each.
# All logs go to OUT/verify.log (the device returns at most 8 files).
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_verify.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$OUT"
LOG="$OUT/verify.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
step gpu kernel tests
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -x -rs \
  2>&1 | tail -30 >> "$LOG"
step gated delta profile
timeout 60 python3 benchmarks/profile_gdn.py "$OUT" --lengths 1,512,2048,4096 --repeats 3 \
  >> "$LOG" 2>&1
step stock baseline
timeout 190 python3 benchmarks/run_gpu_suite.py "$OUT" --lengths 512,4K --rounds 3 \
  --backends stock --no-fidelity --max-seconds 180 --tag baseline-stock --no-progress \
  >> "$LOG" 2>&1
step fused decode
QAB_ENABLE=decode-compile QAB_UNVERIFIED_KERNELS=1 timeout 170 python3 benchmarks/run_gpu_suite.py \
  "$OUT" --lengths 512,4K --rounds 2 --backends fused --ablate decode-compile,moe-kernel,gdn-kernel \
  --decode-tokens 64 --no-fidelity --max-seconds 160 --tag decode --no-progress \
  >> "$LOG" 2>&1
step done
tail -60 "$LOG"
