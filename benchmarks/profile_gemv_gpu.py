#!/usr/bin/env python3
"""GPU time of one decode projection (4-bit GEMV, one row), per kernel, read by ``ncu``.

A decode token runs every projection of the model as a matrix-vector product
over 4-bit weights. This script times, at the projection shapes of
Qwen3.6-35B-A3B (or any ``--shapes``), the candidates that can run one:

* ``mlx``: MLX's own ``mx.quantized_matmul`` (its ``qmv`` kernel);
* ``qab``: this package's ``kernels/cuda/quantized_gemv.cu``
  (:func:`qwen_apple_backend.ops.linear.quantized_gemv_kernel`);
* ``qab-norm``: the same kernel with the input's RMSNorm in its prologue
  (:func:`qwen_apple_backend.ops.linear.norm_gemv_kernel`): the decoder
  layer's input norm and the mixer's concatenated input projection in one
  launch;
* ``mlx-norm``: ``mx.fast.rms_norm`` then ``mx.quantized_matmul`` (two launches).

Each candidate runs ``--reps`` times (each evaluated alone) between
``cuProfilerStart`` and ``cuProfilerStop``, after a warm-up, so ``ncu
--profile-from-start off`` times only those launches; a small ``mx.sort``
launched before the first and after every candidate marks where each one's
launches start in the log::

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file OUT/ncu-gemv.csv python benchmarks/profile_gemv_gpu.py OUT
    python benchmarks/profile_gemv_gpu.py OUT --summarize OUT/ncu-gemv.csv

ncu flushes the caches before each kernel, so the weights stream from HBM as
they do in decode. The summary gives per kernel group the launches per rep, the
microseconds per launch and, for the GEMV kernels, the bytes of weights,
scales and biases read per microsecond (TB/s). Writes
``profile-gemv-gpu-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_gemv_gpu.py OUT [--shapes in_proj=12352x2048,...]
        [--candidates mlx,qab,qab-norm,mlx-norm] [--reps 5] [--dtype bfloat16]
        [--eps-array device|pool|host]
    python benchmarks/profile_gemv_gpu.py OUT --summarize CSV
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import check_out, device_name, write_result  # noqa: E402
from profile_decode_gpu import _profiler, marked_segments, read_run_record  # noqa: E402

#: Qwen3.6-35B-A3B's decode projections (rows x input size): the Gated
#: DeltaNet's concatenated in_proj (qkv 8192 + z 4096 + b 32 + a 32), the
#: attention's concatenated q (with its gate) / k / v, the two output
#: projections and the shared expert's gate+up.
DEFAULT_SHAPES = "in_proj=12352x2048,qkv_proj=9216x2048,out_proj=2048x4096,shared_gate_up=1024x2048"
CANDIDATES = ("mlx", "qab", "qab-norm", "mlx-norm")


def _eps_arrays(kind: str):
    """A stand-in for ``ops.device.f32_scalar`` making the ``kind`` of epsilon array.

    ``device`` (what the package ships): ``[4]`` float32 filled on the device;
    ``pool``: ``[1]`` written by the host, which MLX's CUDA allocator places in
    its small managed pool of <= 8-byte buffers (what the package passed
    before); ``host``: ``[4]`` written by the host (its own managed buffer).
    """
    import functools

    import mlx.core as mx

    from qwen_apple_backend.ops.device import f32_scalar

    if kind == "device":
        return f32_scalar

    @functools.lru_cache(maxsize=None)
    def make(value: float):
        return mx.array([value] * (1 if kind == "pool" else 4), dtype=mx.float32)

    return make


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """``name=NxK,...`` -> ``[(name, N, K), ...]``; ``ValueError`` naming a bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, dims = item.partition("=")
        n, x, k = dims.partition("x")
        if not (sep and x and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0
                and int(k) % 64 == 0 and name):
            raise ValueError(f"--shapes: {item!r} is not NAME=NxK with K a multiple of 64")
        out.append((name, int(n), int(k)))
    if not out:
        raise ValueError("--shapes: no shape given")
    return out


def parse_variant(text: str) -> dict:
    """``pipe+rpw2+bps3`` -> ``{"pipe": True, "rpw": 2, "bps": 3}``; ``ValueError`` naming a bad token.

    Tokens: ``pipe`` (double-buffered passes, the kernel's PIPE), ``rpwN``
    (row sets per warp pass), ``bpsN`` (with ``pipe``: thread blocks per SM
    the grid aims at). Unnamed values are the dispatcher's.
    """
    out: dict = {}
    for tok in filter(None, text.split("+")):
        if tok == "pipe":
            out["pipe"] = True
        elif tok[:3] in ("rpw", "bps") and tok[3:].isdigit() and 1 <= int(tok[3:]) <= 16:
            out[tok[:3]] = int(tok[3:])
        else:
            raise ValueError(f"--variants: {tok!r} in {text!r} is not pipe, rpwN or bpsN "
                             "(N from 1 to 16)")
    if not out:
        raise ValueError(f"--variants: {text!r} names nothing")
    return out


def _with_launch(lin, fn, rpw: int = 0, pipe: bool = False, bps: int = 0):
    """``fn`` with the GEMV launched at ``rpw`` row sets per warp pass (grid to match).

    With ``pipe``, the double-buffered build (PIPE) with a grid of at most
    ``bps`` blocks per SM (the dispatcher's :data:`PIPE_BLOCKS_PER_SM` when 0).
    """
    def call():
        chosen = lin.gemv_launch

        def launch(M, N, K, **_caller):
            # The variant's build and grid, whatever the caller asked for.
            return chosen(M, N, K, pipe=pipe, rpw=rpw or None, blocks_per_sm=bps or None)

        lin.gemv_launch = launch
        try:
            return fn()
        finally:
            lin.gemv_launch = chosen
    return call


def summarize_runs(csv_path: Path, run: dict) -> list[dict]:
    """Per (shape, candidate) of ``run``'s order: launches per call, GPU us per call, TB/s.

    The log's first launch is the marker (see the module doc); the launches
    between two markers belong to one candidate's ``reps`` calls.

    Raises:
        SystemExit: naming the file when the log does not split into one
            segment per candidate of the run record, or a segment's launches
            are not a multiple of ``reps``.
    """
    order, reps = run["order"], int(run["reps"])
    segments = marked_segments(csv_path, [f"{i['shape']} {i['candidate']}" for i in order], reps,
                               "candidate x shape pairs")
    out = []
    for item, seg in zip(order, segments):
        us = sum(u for _, u in seg) / reps
        kernels = list(dict.fromkeys(n for n, _ in seg))
        out.append({**item, "launches": len(seg) // reps, "us": round(us, 2),
                    "tb_per_s": round(item["weight_bytes"] / (us * 1e6), 3) if us > 0 else 0.0,
                    "kernels": kernels})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"default {DEFAULT_SHAPES}")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help=f"comma list from {', '.join(CANDIDATES)}")
    p.add_argument("--reps", type=int, default=5, help="profiled launches per candidate")
    p.add_argument("--rpw", default="", help="comma list of row sets per warp pass to try "
                   "besides the dispatcher's choice: one extra qab-norm/rpwR candidate each "
                   "(the grid shrinks with R)")
    p.add_argument("--variants", default="", help="comma list of launch variants of qab and "
                   "qab-norm to try besides the dispatcher's choice, each a '+' list of pipe "
                   "(double-buffered passes), rpwN, bpsN (pipe's blocks per SM): one "
                   "qab/SPEC and one qab-norm/SPEC candidate each, e.g. pipe+rpw1+bps4")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--eps-array", default="device", choices=["device", "pool", "host"],
                   help="the NORM launch's epsilon array: device (as shipped: [4] filled on "
                        "the device), pool ([1] from the host, in MLX's small managed pool), "
                        "host ([4] from the host); default device")
    p.add_argument("--summarize", type=Path, default=None, metavar="CSV",
                   help="summarize an ncu --csv log of an earlier run instead of running")
    args = p.parse_args(argv)
    check_out(p, args.out)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        p.error(str(exc))
    cands = [c for c in args.candidates.split(",") if c]
    bad = sorted(set(cands) - set(CANDIDATES))
    if bad or not cands:
        p.error(f"unknown candidate(s) {bad}; choose from {', '.join(CANDIDATES)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    try:
        rpws = [int(r) for r in args.rpw.split(",") if r]
    except ValueError:
        p.error(f"--rpw: {args.rpw!r} is not a comma list of integers")
    if any(r < 1 or r > 16 for r in rpws):
        p.error("--rpw: values between 1 and 16")
    try:
        variants = [(v, parse_variant(v)) for v in args.variants.split(",") if v]
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = out / "profile-gemv-gpu-run.json"
    if args.summarize is not None:
        run = read_run_record(record)
        result = {**run, "rows": summarize_runs(args.summarize, run)}
        dest = write_result(out, "profile-gemv-gpu", result, device=str(run.get("device", "unknown")))
        for row in result["rows"]:
            print(f"{row['shape']:>16} {row['N']:>7}x{row['K']:<5} {row['candidate']:>14}: "
                  f"{row['launches']:d} launch(es) {row['us']:8.2f} us  "
                  f"{row['tb_per_s']:.2f} TB/s  ({', '.join(row['kernels'])})")
        print(f"wrote {dest}")
        return 0

    import mlx.core as mx

    if not mx.cuda.is_available():
        p.error("profiling needs MLX's CUDA backend and a CUDA GPU (--summarize runs anywhere)")
    from qwen_apple_backend.ops import linear as lin

    dtype = getattr(mx, args.dtype)
    lin.f32_scalar = _eps_arrays(args.eps_array)  # the norm GEMV's epsilon (this process only)
    plan = []
    for i, (name, N, K) in enumerate(shapes):
        k = mx.random.split(mx.random.key(i), 3)
        w = (0.02 * mx.random.normal((N, K), key=k[0])).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((1, 1, K), key=k[1]).astype(dtype)
        nw = (1.0 + 0.1 * mx.random.normal((K,), key=k[2])).astype(dtype)
        mx.eval(wq, s, b, x, nw)
        nbytes = wq.nbytes + s.nbytes + b.nbytes
        fns = {
            "mlx": lambda x=x, wq=wq, s=s, b=b: mx.quantized_matmul(
                x, wq, s, b, transpose=True, group_size=64, bits=4),
            "qab": lambda x=x, wq=wq, s=s, b=b: lin.quantized_gemv_kernel(x, wq, s, b, 64),
            "qab-norm": lambda x=x, wq=wq, s=s, b=b, nw=nw: lin.norm_gemv_kernel(
                x, nw, 1e-6, wq, s, b, 64),
            "mlx-norm": lambda x=x, wq=wq, s=s, b=b, nw=nw: mx.quantized_matmul(
                mx.fast.rms_norm(x, nw, 1e-6), wq, s, b, transpose=True, group_size=64, bits=4),
        }
        for c in cands:
            plan.append((name, N, K, nbytes, c, fns[c]))
        for r in rpws:
            plan.append((name, N, K, nbytes, f"qab-norm/rpw{r}",
                         _with_launch(lin, fns["qab-norm"], rpw=r)))
        for spec, v in variants:
            for c in ("qab", "qab-norm"):
                plan.append((name, N, K, nbytes, f"{c}/{spec}", _with_launch(lin, fns[c], **v)))
    for *_, fn in plan:  # compile and warm every kernel outside the profiled range
        mx.eval(fn())
        mx.eval(fn())
    mx.synchronize()
    marker = mx.array([3.0, 1.0, 2.0, 5.0, 4.0])
    mx.eval(mx.sort(marker))
    mx.synchronize()
    on = _profiler("cuProfilerStart")
    mx.eval(mx.sort(marker))
    for *_, fn in plan:
        for _ in range(args.reps):
            mx.eval(fn())
        mx.eval(mx.sort(marker))
    mx.synchronize()
    _profiler("cuProfilerStop")
    run = {"device": device_name(), "dtype": args.dtype, "reps": args.reps,
           "eps_array": args.eps_array,
           "profiler": on,
           "order": [{"shape": n, "N": N, "K": K, "weight_bytes": nb, "candidate": c}
                     for n, N, K, nb, c, _ in plan],
           "command": "python benchmarks/profile_gemv_gpu.py OUT " + " ".join(argv or sys.argv[2:])}
    record.write_text(json.dumps(run, indent=1) + "\n")
    print(f"profiled {len(plan)} candidate x shape pairs x {args.reps} reps "
          f"(profiler {'on' if on else 'unavailable'}); wrote {record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
