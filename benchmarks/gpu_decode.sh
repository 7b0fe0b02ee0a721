#!/usr/bin/env bash
# Decode kernels on one H200 in one device command (~9 minutes):
#   1. the GPU tests of the decode kernels (dense GEMV, one-launch GDN decode,
#      MoE shared-expert fold and prefill combine), unverified ones included;
#   2. decode kernels in GB/s against the copy bandwidth
#      (benchmarks/profile_decode_kernels.py);
#   3. stock vs fused at 4K with ablation columns for the decode kernels.
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_decode.sh OUT
# QAB_TEST_FILTER (pytest -k), QAB_TEST_SECONDS, QAB_SUITE_SECONDS and
# QAB_SKIP_PROFILE=1 reshape it for a shorter or longer device slot.
set -uo pipefail
OUT=${1:?usage: gpu_decode.sh OUT}
mkdir -p "$OUT"
LOG="$OUT/decode.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
step decode kernel GPU tests
timeout -s ABRT ${QAB_TEST_SECONDS:-230} python3 -m pytest -v -m gpu -p no:cacheprovider -rs \
  tests/test_kernels_gpu_linear.py tests/test_kernels_gpu.py \
  -k "${QAB_TEST_FILTER:-quantized_gemv or gemv_ready or shared or combine or moe_block or gated_delta_decode or decode_kernel_passes or fused_layer_decode}" \
  2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error|assert|Fatal|File" | tail -90 >> "$LOG"
if [ -z "${QAB_SKIP_PROFILE:-}" ]; then
step decode kernels in GB/s
QAB_UNVERIFIED_KERNELS=1 timeout -s ABRT 70 python3 benchmarks/profile_decode_kernels.py "$OUT" \
  --calls 50 --repeats 3 >> "$LOG" 2>&1
fi
step stock vs fused at 4K with decode ablations
QAB_UNVERIFIED_KERNELS=1 timeout -s ABRT ${QAB_SUITE_SECONDS:-230} python3 benchmarks/run_gpu_suite.py "$OUT" \
  --lengths 4K --rounds 1 --backends stock,fused --ablate gemv-kernel,moe-kernel,gdn-kernel \
  --decode-tokens 32 --no-fidelity --max-seconds $(( ${QAB_SUITE_SECONDS:-230} - 10 )) --tag decode --no-progress >> "$LOG" 2>&1
step done
tail -60 "$LOG"
