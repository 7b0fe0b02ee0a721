#!/usr/bin/env python3
"""Fixed cost per MLX operation on this GPU, under MLX's CUDA graph settings.

Decode at batch 1 is a long chain of small operations, so the per-operation
cost of the backend bounds tokens/s. Each setting runs in a fresh process (MLX
reads these variables once) and times, per operation:

* ``independent``: 200 independent 2,048-element adds evaluated together;
* ``chain``: a dependent chain of 200 such adds;
* ``layer``: 40 decode-like blocks (RMSNorm -> 4-bit 2048x2048 matmul ->
  residual add), 120 dependent operations.

Settings: MLX's defaults, ``MLX_MAX_OPS_PER_BUFFER`` (operations per CUDA graph
before it is launched) at several sizes, and ``MLX_USE_CUDA_GRAPHS=0`` (one
launch per kernel). Writes ``launch-floor-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_launch_floor.py OUT [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import write_result

from qwen_apple_backend.argtypes import positive_int

SETTINGS = [
    ("default", {}),
    ("ops/graph 60", {"MLX_MAX_OPS_PER_BUFFER": "60"}),
    ("ops/graph 120", {"MLX_MAX_OPS_PER_BUFFER": "120"}),
    ("ops/graph 250", {"MLX_MAX_OPS_PER_BUFFER": "250"}),
    ("no CUDA graphs", {"MLX_USE_CUDA_GRAPHS": "0"}),
]


def _child(repeats: int) -> dict:
    import mlx.core as mx

    dtype = mx.bfloat16
    v = mx.random.normal((2048,)).astype(dtype)
    w = mx.random.normal((2048, 2048)).astype(dtype) * 2048 ** -0.5
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    nw = mx.ones((2048,), dtype=dtype)
    x0 = mx.random.normal((1, 1, 2048)).astype(dtype)
    mx.eval(v, wq, s, b, nw, x0)

    def independent():
        return [v + i for i in range(200)], 200

    def chain():
        y = v
        for _ in range(200):
            y = y + 1
        return [y], 200

    def layer():
        h = x0
        for _ in range(40):
            n = mx.fast.rms_norm(h, nw, 1e-6)
            h = h + mx.quantized_matmul(n, wq, s, b, transpose=True, group_size=64, bits=4)
        return [h], 120

    out = {}
    for name, fn in (("independent", independent), ("chain", chain), ("layer", layer)):
        arrs, n = fn()
        mx.eval(arrs)
        mx.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            arrs, n = fn()
            mx.eval(arrs)
            mx.synchronize()
            times.append((time.perf_counter() - t0) / n)
        out[name] = 1e6 * statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="output folder (created)")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.repeats)))
        return 0
    if not args.out:
        p.error("OUT is required")
    rows = []
    for label, env in SETTINGS:
        proc = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            print(f"{label:16s} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(dict(setting=label, env=env, us_per_op=res))
        print(f"{label:16s} " + "  ".join(f"{k} {v:6.2f} us/op" for k, v in res.items()),
              flush=True)
    path = write_result(args.out, "launch-floor", dict(rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
