#!/usr/bin/env bash
# One device command that verifies what only a GPU can, sized for ~9 minutes
# on one H200 (fresh machine: MLX's CUDA JIT costs ~1-3 min per process, and
# the GPU tests compile one kernel specialization after another: ~4 min):
#   1. every GPU kernel test, unverified CUDA kernels included;
#   2. the gated delta rule op by path and length (plain and staged scan at
#      each lanes-per-row, chunked ops);
#   3. fused (the compiled decode step is on by default on a GPU), with ablation
#      columns for it, the kernels and proj-concat, at 512 and 4K.
# benchmarks/decode_trace.py (decode ms/token by layer count) and
# benchmarks/gpu_long.sh (16K-128K) are separate commands.
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
timeout 260 python3 -m pytest -v -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -rs \
  2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -70 >> "$LOG"
step gated delta profile
QAB_UNVERIFIED_KERNELS=1 timeout 50 python3 benchmarks/profile_gdn.py "$OUT" \
  --lengths 1,512,4096 --repeats 3 >> "$LOG" 2>&1
step fused suite with ablations
timeout 190 python3 benchmarks/run_gpu_suite.py \
  "$OUT" --lengths 512,4K --rounds 2 --backends fused \
  --ablate decode-compile,moe-kernel,gdn-kernel,proj-concat --decode-tokens 64 --no-fidelity \
  --max-seconds 180 --tag verify --no-progress >> "$LOG" 2>&1
step done
tail -80 "$LOG"
