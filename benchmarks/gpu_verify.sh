#!/usr/bin/env bash
# One device command (at most 9 1/2 minutes on one H200, within a 10-minute limit)
# for the start of a GPU session: verify what only a GPU can, then measure.
#   1. the decode kernels' GPU tests, kernels not yet verified included
#      (QAB_UNVERIFIED_KERNELS=1): q/k preparation, the split-K attention
#      pair (plain, masked, gated, any strides), the in-place KV write, the
#      router's self-check; then the compiled decode step against eager
#      decoding and the GPU-resident handoff (tests/test_decode.py);
#   2. benchmarks/profile_attention_decode.py at 4K / 32K / 64K / 128K keys
#      (the kernel pair against SDPA and the MLX-ops split);
#   3. benchmarks/decode_split.py: fused, fused without the q/k preparation
#      kernel (qk-prep) and without the attention kernel pair (attn-kernel)
#      at 4K and 128K on one built preset (the full preset takes ~90 s to
#      build), kernels not yet verified included.
# The whole tests/test_kernels_gpu.py takes more than 5 minutes: select with
# -k. Stock's 128K prefill alone takes minutes (its Gated DeltaNet prefill is a
# per-token loop), so stock is left out here; compare it at 4K separately.
# The summary goes to OUT/verify.log, each step's whole output to its own file.
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_verify.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$OUT"
LOG="$OUT/verify.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" QAB_UNVERIFIED_KERNELS=1
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
step decode kernel GPU tests
K="qk_norm_rope or split_decode or gated_decode or kv_cache_write or writes_the_kv"
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "$K or router_kernel_passes" \
  2>&1 | tee "$OUT/kernel-tests.txt" | grep -E "passed|failed|FAILED|ERROR|Error|vs float32|equal" | tail -40 >> "$LOG"
step compiled decode step tests
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py \
  -k "handoff or 64_tokens or in_place" 2>&1 | tee "$OUT/decode-tests.txt" | grep -E "passed|failed|FAILED|Error" \
  | tail -20 >> "$LOG"
step attention profile
timeout 60 python3 benchmarks/profile_attention_decode.py "$OUT" \
  --lengths 4096,32768,65536,131072 --repeats 20 2>&1 | tail -6 >> "$LOG"
step decode split
timeout 220 python3 benchmarks/decode_split.py "$OUT" \
  --variants fused,fused-qk-prep,fused-attn-kernel --context 4K,128K --tokens 24 --rounds 4 2>&1 | tee "$OUT/decode-split.txt" | grep -E "median|rounds|primitives|wrote" \
  >> "$LOG"
step done
tail -80 "$LOG"
