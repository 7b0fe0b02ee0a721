#!/usr/bin/env bash
# Where a decode token's GPU time goes, per kernel, on one GPU in one device
# command (~3 minutes per variant and context at --layers 8; each run builds
# the full preset): benchmarks/profile_decode_gpu.py under Nsight Compute
# (ncu), then its summary.
#   VARIANTS (default "fused stock"): stock, fused or fused-NAME each;
#   CONTEXTS (default "4K"): prefilled lengths, e.g. "4K 128K";
#   LAYERS (default 8, a multiple of 4) and TOKENS (default 3).
# Writes OUT/<context>/profile-decode-gpu-<variant>-<device>.json, the ncu CSVs
# and OUT/ncu.log; prints each summary.
# Usage (from the repository root, MLX with its CUDA backend importable, ncu on
# the PATH or NCU=/path/to/ncu):
#   bash benchmarks/gpu_ncu_decode.sh OUT
set -uo pipefail
OUT=${1:?usage: gpu_ncu_decode.sh OUT}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
if [ ! -x "$NCU" ]; then
  echo "gpu_ncu_decode.sh: no ncu (Nsight Compute) found; set NCU=/path/to/ncu" >&2
  exit 2
fi
mkdir -p "$OUT"
LOG="$OUT/ncu.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
step() { echo "=== $* ($(date -u +%T))" | tee -a "$LOG"; }
for ctx in ${CONTEXTS:-4K}; do
  for v in ${VARIANTS:-fused stock}; do
    step "$v at $ctx"
    mkdir -p "$OUT/$ctx"
    timeout -s ABRT ${STEP_SECONDS:-280} "$NCU" --profile-from-start off --clock-control none \
      --metrics gpu__time_duration.sum --csv --log-file "$OUT/$ctx/ncu-$v.csv" \
      python3 benchmarks/profile_decode_gpu.py "$OUT/$ctx" --variant "$v" \
      --layers "${LAYERS:-8}" --context "$ctx" --tokens "${TOKENS:-3}" >> "$LOG" 2>&1
    python3 benchmarks/profile_decode_gpu.py "$OUT/$ctx" --variant "$v" \
      --summarize "$OUT/$ctx/ncu-$v.csv" 2>&1 | tee -a "$LOG" | head -24
  done
done
step done
