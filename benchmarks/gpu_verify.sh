#!/usr/bin/env bash
# One device command that verifies what only a GPU can, sized for ~9 minutes
# on one H200 (fresh machine: MLX's CUDA JIT costs ~1-3 min per process):
#   1. every GPU kernel test, unverified CUDA kernels included;
#   2. the gated delta rule op by path and length (scan kernels vs chunked);
#   3. fused decode time by layer count (per-layer and fixed cost per token);
#   4. fused with the experimental compiled decode step and the unverified
#      kernels on, with ablation columns for each, at 512 and 4K;
#   5. if Nsight Systems is installed, a kernel summary of fused decode.
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
timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider -rs \
  2>&1 | tail -40 >> "$LOG"
step gated delta profile
timeout 60 python3 benchmarks/profile_gdn.py "$OUT" --lengths 1,512,2048,4096 --repeats 3 \
  >> "$LOG" 2>&1
step fused decode by layer count
timeout 150 python3 benchmarks/decode_trace.py "$OUT" --backends fused \
  --context 512 --layer-counts 4,8,20,40 --tokens 32 >> "$LOG" 2>&1
step fused suite with ablations
QAB_ENABLE=decode-compile QAB_UNVERIFIED_KERNELS=1 timeout 170 python3 benchmarks/run_gpu_suite.py \
  "$OUT" --lengths 512,4K --rounds 2 --backends fused \
  --ablate decode-compile,moe-kernel,gdn-kernel,proj-concat --decode-tokens 64 --no-fidelity \
  --max-seconds 160 --tag verify --no-progress >> "$LOG" 2>&1
if command -v nsys >/dev/null; then
  step nsys kernel summary of fused decode
  QAB_UNVERIFIED_KERNELS=1 timeout 100 nsys profile -o "$OUT/nsys" --force-overwrite true \
    --stats=false python3 benchmarks/decode_trace.py "$OUT/nsys-run" --backends fused \
    --context 512 --layer-counts 40 --tokens 16 >> "$LOG" 2>&1
  timeout 40 nsys stats -r cuda_gpu_kern_sum -f csv "$OUT/nsys.nsys-rep" 2>/dev/null \
    | head -45 >> "$LOG"
  rm -rf "$OUT/nsys.nsys-rep" "$OUT/nsys.sqlite" "$OUT/nsys-run"
else
  step no nsys on this machine
fi
step done
tail -80 "$LOG"
