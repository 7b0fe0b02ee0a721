#!/usr/bin/env python3
"""Decode kernels in GB/s against the copy bandwidth, at the Qwen3.6-35B-A3B shapes.

For each 4-bit matrix a decode step reads (a Gated DeltaNet's stacked input
projections and its out_proj, attention's stacked q/k/v and o_proj, the
shared expert, lm_head) it times MLX's ``mx.quantized_matmul`` and this
package's dense GEMV kernel (``ops/linear.py``) at one row (batch-1 decode),
and the MoE decode kernels for the K = 8 routed experts; the bytes counted are
the packed weights plus scales and biases. Each entry is ``--calls``
independent calls evaluated together (launch cost included, as in a decode
step), median of ``--repeats``. Also the device-to-device copy bandwidth of a
1 GiB array, and the launch floor: a 2,048-element add as an MLX op and as
an ``mx.fast.*_kernel`` (does a custom kernel cost more per call?). Prints a table and writes ``profile-decode-kernels-<device>.json``
into OUT.

Usage:
    python benchmarks/profile_decode_kernels.py OUT [--calls 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# name, N (output rows), K (inputs): Qwen3.6-35B-A3B, hidden 2048.
MATRICES = [
    ("gdn in_proj qkv|z|b|a", 12352, 2048),
    ("attn q|k|v", 9216, 2048),
    ("gdn out_proj / o_proj", 2048, 4096),
    ("shared expert gate|up", 1024, 2048),
    ("shared expert down", 2048, 512),
    ("lm_head", 248320, 2048),
]
GROUP = 64


def _time(fn, calls: int, repeats: int) -> float:
    """Median seconds per call of ``calls`` independent calls evaluated together."""
    import mlx.core as mx

    mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _qbytes(N: int, K: int) -> int:
    return N * K // 2 + 2 * (N * K // GROUP) * 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import mlx.core as mx

    from qwen_apple_backend.ops import linear as ql
    from qwen_apple_backend.ops import moe as moe_ops
    from qwen_apple_backend.ops.device import gpu_backend

    backend = gpu_backend()
    device = mx.device_info().get("device_name", str(mx.default_device())) \
        if hasattr(mx, "device_info") else str(mx.default_device())
    dtype = mx.bfloat16
    rows = []

    big = mx.zeros((256, 1024, 1024), dtype=mx.float32)  # 1 GiB
    mx.eval(big)
    t = _time(lambda: big + 0, 4, args.repeats)
    copy_gbs = 2 * big.nbytes / t / 1e9
    print(f"device {device}; gpu backend {backend}; copy bandwidth {copy_gbs:.0f} GB/s",
          flush=True)
    del big

    def add(name, what, seconds, nbytes):
        gbs = nbytes / seconds / 1e9
        rows.append({"kernel": name, "path": what, "us": seconds * 1e6, "bytes": nbytes,
                     "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs})
        print(f"{name:28s} {what:22s} {seconds * 1e6:9.1f} us {gbs:8.0f} GB/s "
              f"{100 * gbs / copy_gbs:6.1f}% of copy", flush=True)

    # Fixed cost per launch: a 2,048-element bf16 add in MLX vs the same as a
    # custom kernel (the floor every decode kernel of this package pays).
    v = mx.random.normal((2048,)).astype(dtype)
    mx.eval(v)
    t_mlx = _time(lambda: v + 1, 200, args.repeats)
    line = f"launch floor: MLX elementwise {t_mlx * 1e6:.1f} us"
    floor = {"mlx_elementwise_us": t_mlx * 1e6}
    factory = getattr(mx.fast, f"{backend}_kernel", None) if backend else None
    if factory is not None:
        body = ("uint i = thread_position_in_grid.x; if (i < 2048) y[i] = x[i] + 1;"
                if backend == "metal" else
                "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 2048) "
                "y[i] = static_cast<T>(static_cast<float>(x[i]) + 1.f);")
        k = factory(name="qab_launch_floor", input_names=["x"], output_names=["y"], source=body)

        def custom():
            return k(inputs=[v], template=[("T", dtype)], grid=(2048, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[(2048,)],
                     output_dtypes=[dtype])[0]

        t_custom = _time(custom, 200, args.repeats)
        floor["custom_kernel_us"] = t_custom * 1e6
        line += f", custom kernel {t_custom * 1e6:.1f} us"
    print(line, flush=True)

    for name, N, K in MATRICES:
        w = (mx.random.normal((N, K), key=mx.random.key(N)) * K ** -0.5).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=GROUP, bits=4)
        x = mx.random.normal((1, 1, K), key=mx.random.key(K)).astype(dtype)
        mx.eval(wq, s, b, x)
        del w
        nbytes = _qbytes(N, K)
        add(name, "mx.quantized_matmul",
            _time(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=GROUP,
                                              bits=4), args.calls, args.repeats), nbytes)
        if ql.gemv_ready(x, wq, s, b, GROUP) is not None:
            add(name, "qab gemv kernel",
                _time(lambda: ql.quantized_gemv_kernel(x, wq, s, b, GROUP), args.calls,
                      args.repeats), nbytes)
        else:
            print(f"{name:28s} qab gemv kernel not ready here", flush=True)

    # Routed experts: E = 256, K = 8 active, H = 2048, I = 512.
    E, H, I, K = 256, 2048, 512, 8

    def experts(shape, seed):
        w = (mx.random.normal(shape, key=mx.random.key(seed)) * shape[-1] ** -0.5).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=GROUP, bits=4)
        return moe_ops.ExpertWeights(wq, s, b, group_size=GROUP, bits=4)

    try:
        gu, dn = experts((E, 2 * I, H), 1), experts((E, H, I), 2)
        x = mx.random.normal((1, 1, H), key=mx.random.key(3)).astype(dtype)
        inds = mx.argsort(mx.random.uniform(shape=(1, 1, E), key=mx.random.key(4)),
                          axis=-1)[..., :K].astype(mx.uint32)
        scores = mx.softmax(mx.random.normal((1, 1, K), key=mx.random.key(5)), axis=-1)
        mx.eval(x, inds, scores)
        nbytes = K * (_qbytes(2 * I, H) + _qbytes(H, I))
        add("routed experts (8 of 256)", "mlx ops (gather_qmm)",
            _time(lambda: moe_ops.moe_experts_ops(x, inds, scores, gu, dn, sort=False),
                  args.calls, args.repeats), nbytes)
        if moe_ops.decode_kernel_ready(x, inds, gu, dn) is not None:
            add("routed experts (8 of 256)", "qab moe gemv kernels",
                _time(lambda: moe_ops._moe_decode_kernel_call(backend, x, inds, scores, gu,
                                                              dn),
                      args.calls, args.repeats), nbytes)
    except Exception as exc:  # noqa: BLE001 - report and keep the dense numbers
        print(f"routed experts: skipped ({type(exc).__name__}: {exc})", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    path = out / f"profile-decode-kernels-{tag}.json"
    path.write_text(json.dumps({"device": device, "mlx": mx.__version__,
                                "copy_gbs": copy_gbs, "calls": args.calls,
                                "repeats": args.repeats, "launch_floor": floor,
                                "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
