#!/usr/bin/env bash
# One device command that verifies what only a GPU can, sized for ~9 minutes
# on one H200 (fresh machine: MLX's CUDA JIT costs ~3 min of it):
#   1. every GPU kernel test, unverified CUDA kernels included;
#   2. stock alone at 512 and 4K, 3 rounds: the baseline the issues quote;
#   3. fused decode with the experimental compiled step and the unverified
#      MoE decode kernels on, with ablation columns for each.
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_verify.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 | tail -25 \
  | tee "$OUT/gpu-tests.log"
timeout 200 python3 benchmarks/run_gpu_suite.py "$OUT" --lengths 512,4K --rounds 3 \
  --backends stock --no-fidelity --max-seconds 190 --tag baseline-stock --no-progress \
  > "$OUT/baseline.log" 2>&1; tail -8 "$OUT/baseline.log"
QAB_ENABLE=decode-compile QAB_UNVERIFIED_KERNELS=1 timeout 200 python3 benchmarks/run_gpu_suite.py \
  "$OUT" --lengths 512,4K --rounds 3 --backends fused --ablate decode-compile,moe-kernel,gdn-kernel \
  --decode-tokens 64 --no-fidelity --max-seconds 190 --tag decode --no-progress \
  > "$OUT/decode.log" 2>&1; tail -10 "$OUT/decode.log"
