#!/usr/bin/env python3
"""MoE prefill experts on the grouped 4-bit GEMM kernel: tile heights by expert load vs fixed.

Times the whole expert computation of one Qwen3.6-35B-A3B MoE layer in
prefill (sort by expert, block map, gate+up GEMM with the SiLU epilogue, down
GEMM, un-sort and weighted sum; E = 256, H = 2048, I = 512, K = 8, 4-bit g64
experts, bf16 activations) for T tokens, two ways in the same process:
``by-load`` (each expert's tiles 16, 32 or 64 rows by its row count, the
default) and ``fixed-64`` (every tile 64 rows, as before tile heights were
chosen). The outputs of the two are compared bit for bit (the accumulation
order per output element does not depend on the tile height). Routing:
``uniform`` (distinct random experts per token) and ``skewed`` (a quarter of
the experts take most rows). Median of ``--repeats`` synchronised runs after
two warm-ups. Needs a GPU whose grouped GEMM kernel passes its self-check
(CUDA: verified, or ``QAB_UNVERIFIED_KERNELS=1``). Writes
``profile-grouped-gemm-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_grouped_gemm.py OUT [--lengths 256,512,1024,2048,4096]
        [--repeats 10]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve().parent
for p in (SRC, HERE):
    if p.is_dir() and str(p) not in sys.path:
        sys.path.insert(0, str(p))

E, H, I, K = 256, 2048, 512, 8


def _routing(T: int, skewed: bool, key):
    import mlx.core as mx

    logits = mx.random.uniform(shape=(T, E), key=key)
    if skewed:  # experts 0..63 first for most tokens
        logits = logits + 0.6 * (mx.arange(E) < E // 4)
    return mx.argsort(-logits, axis=-1)[:, :K].astype(mx.uint32)[None]


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int, token_lengths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--lengths", type=token_lengths, default="256,512,1024,2048,4096",
                   help="comma-separated prompt tokens T (K = 1024)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed runs per form")
    args = p.parse_args(argv)
    from _common import check_out, write_result

    check_out(p, args.out)
    import mlx.core as mx
    import numpy as np
    from profile_modules import timeit

    from qwen_apple_backend.ops import moe as moe_ops

    k1, k2, kx = mx.random.split(mx.random.key(0), 3)
    gu, dn = [], []
    for key, shape, dst in ((k1, (E, 2 * I, H), gu), (k2, (E, H, I), dn)):
        w = (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(mx.bfloat16)
        dst.extend(mx.quantize(w, group_size=64, bits=4))
    gate_up = moe_ops.ExpertWeights(*gu, group_size=64, bits=4)
    down = moe_ops.ExpertWeights(*dn, group_size=64, bits=4)
    rows = []
    for T in args.lengths:
        x = mx.random.normal((1, T, H), key=kx).astype(mx.bfloat16)
        scores = mx.softmax(mx.random.normal((1, T, K), key=kx), axis=-1).astype(mx.bfloat16)
        for routing in ("uniform", "skewed"):
            inds = _routing(T, routing == "skewed", mx.random.key(T))
            backend = moe_ops.grouped_gemm_ready(x, inds, gate_up, down)
            if backend is None:
                p.error("the grouped GEMM kernel is not ready on this device "
                        "(no GPU, unverified CUDA kernel, or a failed self-check)")
            outs, times = {}, {}
            for name, heights in (("by-load", moe_ops.GROUPED_GEMM_TILE_ROWS), ("fixed-64", (64,))):
                def run(heights=heights):
                    return moe_ops._moe_grouped_gemm_experts(backend, x, inds, scores, gate_up,
                                                             down, tile_rows=heights)
                outs[name] = run()
                times[name] = 1e3 * timeit(run, args.repeats)
            _, _, height = moe_ops.grouped_gemm_block_map(
                mx.sort(inds.reshape(-1)), E)
            hs, ns = np.unique(np.array(height), return_counts=True)
            used = {int(h): int(n) for h, n in zip(hs, ns)}
            row = dict(T=T, routing=routing, by_load_ms=times["by-load"],
                       fixed_64_ms=times["fixed-64"],
                       speedup=times["fixed-64"] / times["by-load"],
                       identical=bool(mx.array_equal(outs["by-load"], outs["fixed-64"])),
                       experts_by_height=used)
            rows.append(row)
            print(f"T {T:5d} {routing:8s} by-load {row['by_load_ms']:7.3f} ms  fixed-64 "
                  f"{row['fixed_64_ms']:7.3f} ms  x{row['speedup']:.3f}  identical "
                  f"{row['identical']}", flush=True)
    path = write_result(args.out, "profile-grouped-gemm",
                        dict(E=E, H=H, I=I, K=K, repeats=args.repeats, rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
