#!/usr/bin/env bash
# One device command (at most 9 1/2 minutes on one H100 / H200, within a
# 10-minute limit) for the start of a GPU session: verify what only a GPU
# can, then measure, kernels not yet verified included
# (QAB_UNVERIFIED_KERNELS=1).
#   1. the packed MoE block's GPU tests (moe-block-pack: the router, the
#      shared expert and the routed experts as one input that holds the
#      weights, and whose launches make two outputs: the workspace in the
#      block's counter, the Gated DeltaNet states written in place): every
#      output and state bit-identical to the unpacked build at Qwen3.6's
#      shape, and the compiled decode step with packs against the model
#      without them (logits and GDN states per token, both pack self-checks
#      passed, a pack rebuilt after a replaced array included), and the
#      one-launch block with the GDN step;
#   2. stock vs fused at 4K, with ablation columns for moe-block-pack and
#      decode-const (the trace-constant parameters, QAB_ENABLE=decode-const):
#      the packs' and the constants' effect in one run;
#   3. benchmarks/profile_encode.py (host cost per bound array, constants
#      included).
# Memory: the bench's columns share the stock model's arrays
# (--share-weights) and are all alive at once; each column that builds packs
# ("fused", "fused -decode-const") holds its experts' down projections, router
# and shared expert once more (~6 GB each at Qwen3.6's shape).
# Pass the tests' verdicts on to kernels/MANIFEST.toml (`verified`) only
# when they pass. The ten-length / 128K rerun is a command of its own
# (README, "Decode").
# The summary goes to OUT/verify.log, each step's whole output to its own file.
# Usage (from the repository root, MLX with its CUDA backend importable):
#   bash benchmarks/gpu_verify.sh OUT
# QAB_TEST_FILTER (pytest -k), QAB_TEST_SECONDS, QAB_BENCH_SECONDS and QAB_ENCODE_SECONDS
# (0: skip) reshape it for another device slot; QAB_LONG_SECONDS (default 0: skip) adds stock
# vs fused at 128K, 2 rounds.
set -uo pipefail
OUT=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$OUT"
LOG="$OUT/verify.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" QAB_UNVERIFIED_KERNELS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
step packed MoE block GPU tests
timeout -s ABRT "${QAB_TEST_SECONDS:-200}" python3 -m pytest -v -m gpu -p no:cacheprovider -rs \
  tests/test_kernels_gpu.py -k "${QAB_TEST_FILTER:-pack_is_the_block or one_pack or gdn_step_in_the_moe_block}" \
  2>&1 | tee "$OUT/pack-tests.txt" \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error|assert" | tail -40 >> "$LOG"
step stock vs fused at 4K, ablating moe-block-pack and decode-const
QAB_ENABLE=decode-const timeout -s ABRT "${QAB_BENCH_SECONDS:-290}" python3 -m qwen_apple_backend.cli bench --preset full \
  --share-weights --shared-prefill fused --backends stock,fused --decode-tokens 64 \
  --no-fidelity --lengths 4K --rounds 3 --ablate moe-block-pack,decode-const \
  --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | tail -30 >> "$LOG"
if [ "${QAB_LONG_SECONDS:-0}" != 0 ]; then
step stock vs fused at 128K
timeout -s ABRT "$QAB_LONG_SECONDS" python3 -m qwen_apple_backend.cli bench --preset full --share-weights --shared-prefill fused \
  --backends stock,fused --decode-tokens 32 --no-fidelity --lengths 128K --rounds 2 \
  --out "$OUT/long" 2>&1 | tee "$OUT/bench-long.txt" | tail -20 >> "$LOG"
fi
if [ "${QAB_ENCODE_SECONDS:-80}" != 0 ]; then
step host cost per bound array
timeout -s ABRT "${QAB_ENCODE_SECONDS:-80}" python3 benchmarks/profile_encode.py "$OUT" --repeats 6 2>&1 \
  | tail -20 >> "$LOG"
fi
step done
tail -100 "$LOG"
