#!/usr/bin/env python3
"""Gated delta rule op times at the Qwen3.6-35B-A3B head shapes, by path and length.

Times :func:`qwen_apple_backend.ops.gated_delta.gated_delta` on random
inputs (B = 1, Hk = 16, Hv = 32, Dk = Dv = 128, bf16 q/k/v, float32 gates and
state) for each available path: the GPU scan kernel (when its self-check
passes), the portable chunked form (whole, and its state-independent
preparation alone, to split the chunk-parallel part from the sequential
chunk loop) and, for short T, the per-token loop. Median of ``--repeats``
synchronised runs after two warm-ups. Prints a table and writes
``profile-gdn-<device>.json`` into OUT. Used to choose between the
sequential scan and the chunked form by measured shape.

Usage:
    python benchmarks/profile_gdn.py OUT [--lengths 1,64,512,2048,4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from profile_modules import timeit  # noqa: E402  (this folder; median of synced runs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--lengths", default="1,64,512,2048,4096", help="comma-separated T values")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunks", default="32,64", help="chunk sizes of the chunked path")
    args = p.parse_args(argv)
    import mlx.core as mx

    from qwen_apple_backend.ops import gated_delta as gd
    from qwen_apple_backend.ops.device import gpu_backend

    B, Hk, Hv, D = 1, 16, 32, 128
    dtype = mx.bfloat16
    backend = gpu_backend()
    ready = gd.kernel_ready(Hk, Hv, D, D, dtype)
    staged = gd.staged_kernel_ready(Hk, Hv, D, D, dtype)
    device = mx.device_info().get("device_name", str(mx.default_device())) \
        if hasattr(mx, "device_info") else str(mx.default_device())
    print(f"device {device}; gpu backend {backend}; scan kernel ready: {ready}; "
          f"staged scan ready: {staged}", flush=True)
    rows = []
    t_start = time.perf_counter()
    for T in (int(x) for x in args.lengths.split(",")):
        ks = mx.random.split(mx.random.key(T), 5)
        q, k = gd.l2norm_qk(mx.random.normal((B, T, Hk, D), key=ks[0]).astype(dtype),
                            mx.random.normal((B, T, Hk, D), key=ks[1]).astype(dtype))
        v = mx.random.normal((B, T, Hv, D), key=ks[2]).astype(dtype)
        g = mx.exp(-mx.random.uniform(shape=(B, T, Hv), key=ks[3]) * 0.5)
        beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=ks[4]))
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
        mx.eval(q, k, v, g, beta, state)
        cases = {}
        if ready:
            cases["kernel"] = lambda: gd._scan_kernel_call(ready, q, k, v, g, beta, state)
        if staged and T > 1:
            for lpr in (8, 16, 32):
                cases[f"staged-lpr{lpr}"] = (lambda lpr=lpr: gd._staged_kernel_call(
                    staged, q, k, v, g, beta, state, lpr=lpr))
        if T > 1:
            for C in (int(c) for c in args.chunks.split(",")):
                cases[f"chunked-{C}"] = (lambda C=C: gd.gated_delta_chunked_ops(
                    q, k, v, g, beta, state, None, C))
                cases[f"chunk-prepare-{C}"] = (lambda C=C: gd._chunk_prepare(
                    q, k, v, g, beta, None, C))
        if T <= 64:
            cases["sequential-ops"] = lambda: gd.gated_delta_sequential_ops(
                q, k, v, g, beta, state)
        for name, fn in cases.items():
            ms = 1e3 * timeit(fn, args.repeats)
            rows.append(dict(path=name, T=T, ms=ms, tokens_per_s=T / ms * 1e3))
            print(f"[{time.perf_counter() - t_start:6.1f}s] T={T:6d} {name:18s} {ms:9.3f} ms",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in str(device).lower()).strip("-")
    path = out / f"profile-gdn-{slug}.json"
    path.write_text(json.dumps(dict(device=device, backend=backend, kernel_ready=ready, staged_kernel_ready=staged,
                                    shapes=dict(B=B, Hk=Hk, Hv=Hv, Dk=D, Dv=D, dtype="bfloat16"),
                                    rows=rows), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
