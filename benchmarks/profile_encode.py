#!/usr/bin/env python3
"""Host cost per MLX operation: building and encoding chains of one operation kind.

Decode at batch 1 on MLX's CUDA backend is bound by the host (see
``decode_split.py``). This script times, per operation kind, a chain of
``--ops`` dependent calls on one small activation row: ``build`` (Python
building the lazy graph), ``encode`` (``mx.async_eval`` returning: MLX turning
the graph into GPU work) and ``wait`` (the GPU finishing after that), each in
microseconds per operation, eagerly and as one ``mx.compile``-d function. The
kinds: an elementwise add, RMSNorm, a 4-bit 2048x2048 quantized matmul
(GEMV), and (CUDA) a custom kernel with a short source, the same with a
10 KB and a 36 KB source (MLX hashes a kernel's source on every encode), the
36 KB one handed to MLX as ``#include`` lines
(``ops.device.included_cuda_source``, how the package builds its CUDA
kernels), one with a 134 MB input (inputs count whole towards MLX's
per-graph MB limit), one with 40 more small inputs and one with 10 outputs
(the one-launch MoE block had 38 inputs and 10 outputs; with 2 and 5, the
packed and unpacked Gated DeltaNet block's counts since session 31), a launch
after a Depends of one array (how the compiled step hands back each state
the packed block writes in place) and after one over 60 arrays, against one
reading a plain array (and, on any device, a compiled call handing back 60
arrays through Depends in three forms), and, as a decode
token's layers each read their own weights, one whose every operation reads 40
small arrays of its own against one reading the same bytes as one array of its
own (compile inputs, as the decode step's model is without ``decode-const``,
and the same arrays as trace constants, as with it). Best of
``--repeats`` after two warm-ups. Writes ``profile-encode-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_encode.py OUT [--ops 400] [--repeats 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve().parent
for p in (SRC, HERE):
    if p.is_dir() and str(p) not in sys.path:
        sys.path.insert(0, str(p))

#: The form of each per-operation case whose arrays are trace constants.
_CONSTANT_FORM = {"custom_40_distinct_inputs": "custom_40_distinct_constants",
                  "custom_1_distinct_input": "custom_1_distinct_constant"}

_BODY = """
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 2048) { out[i] = x[i] + InT(1); }
"""


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--ops", type=positive_int, default=400, help="operations per chain")
    p.add_argument("--repeats", type=positive_int, default=6, help="timed chains per form")
    args = p.parse_args(argv)
    from _common import check_out, write_result

    check_out(p, args.out)
    import mlx.core as mx

    x0 = mx.random.normal((1, 2048)).astype(mx.bfloat16)
    wq, sq, bq = mx.quantize(mx.random.normal((2048, 2048)).astype(mx.bfloat16),
                             group_size=64, bits=4)
    mx.eval(x0, wq, sq, bq)
    chains = {
        "add": lambda x: x + 1,
        "rmsnorm": lambda x: mx.fast.rms_norm(x, None, 1e-6),
        "qmm_gemv": lambda x: mx.quantized_matmul(x, wq, sq, bq, transpose=True,
                                                  group_size=64, bits=4),
    }
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        big = mx.random.normal((256, 1024, 256)).astype(mx.bfloat16)
        mx.eval(big)

        def kernel(name, body, inputs):
            return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["out"],
                                       source=body)

        from qwen_apple_backend.ops.device import included_cuda_source

        # Header padding as a long kernel's header is: a dead function per line.
        def pad(kb):
            return "".join(f"__device__ inline int qab_pad_{i}(int v) {{ return v + {i}; }}\n"
                           for i in range(kb * 1024 // 56))

        ks = kernel("probe_small", _BODY, ["x"])
        kb = kernel("probe_10kb", ("// " + "x" * 76 + "\n") * 120 + _BODY, ["x"])
        kb36 = mx.fast.cuda_kernel(name="probe_36kb", input_names=["x"], output_names=["out"],
                                   header=pad(36), source=_BODY)
        short = included_cuda_source("probe_36kb_include", pad(36), _BODY, ("x",))
        if short is None:
            raise SystemExit("included_cuda_source: the cache folder cannot be written")
        kinc = mx.fast.cuda_kernel(name="probe_36kb_include", input_names=["x"],
                                   output_names=["out"], header=short[0], source=short[1])
        ki = kernel("probe_big_input", _BODY, ["x", "w"])
        many = [f"w{i}" for i in range(40)]
        kmany = kernel("probe_40_inputs", _BODY, ["x", *many])
        smalls = [mx.full((4,), float(i)) for i in range(40)]
        touts = mx.fast.cuda_kernel(
            name="probe_10_outputs", input_names=["x"], output_names=[f"o{i}" for i in range(10)],
            source=_BODY.replace("out[i]", "o0[i]") + "  if (i < 4) { "
            + " ".join(f"o{i}[i] = InT(i);" for i in range(1, 10)) + " }\n")
        mx.eval(smalls)

        def call(k, x, extra=()):
            return k(inputs=[x, *extra], template=[("InT", x.dtype)], grid=(2048, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[x.shape],
                     output_dtypes=[x.dtype])[0]

        chains["custom_small"] = lambda x: call(ks, x)
        chains["custom_10kb"] = lambda x: call(kb, x)
        chains["custom_36kb"] = lambda x: call(kb36, x)
        chains["custom_36kb_include"] = lambda x: call(kinc, x)
        chains["custom_134mb_input"] = lambda x: call(ki, x, (big,))
        chains["custom_40_inputs"] = lambda x: call(kmany, x, smalls)
        # A layer's kernel reads its own weights: distinct arrays per operation
        # (40 small ones, or the same bytes as one packed array), compile
        # inputs as the decode step's model is.
        per_op = {
            "custom_40_distinct_inputs": (kmany, [[mx.full((4,), float(i + 40 * j))
                                                   for i in range(40)]
                                                  for j in range(args.ops)]),
            "custom_1_distinct_input": (kernel("probe_1_distinct", _BODY, ["x", "w0"]),
                                        [[mx.full((160,), float(j))] for j in range(args.ops)]),
        }
        for arrays in per_op.values():
            mx.eval(arrays[1])
        distinct = {}
        for name, (k, arrays) in per_op.items():
            def chain(x, k=k, arrays=arrays):
                for extra in arrays:
                    x = call(k, x, extra)
                return x

            distinct[name] = (chain, mx.compile(chain, inputs=arrays))
            # The same arrays as trace constants (decode-const): nothing to
            # bind per call but the activation row.
            distinct[_CONSTANT_FORM[name]] = (chain, mx.compile(chain))
        chains["custom_10_outputs"] = lambda x: touts(
            inputs=[x], template=[("InT", x.dtype)], grid=(2048, 1, 1), threadgroup=(256, 1, 1),
            output_shapes=[x.shape] + [(4,)] * 9, output_dtypes=[x.dtype] * 10)[0]
        # The packed MoE block's launches make 2 outputs where the unpacked GD
        # build makes 5 (its workspace and the Gated DeltaNet states).
        for n_out in (2, 5):
            kn = mx.fast.cuda_kernel(
                name=f"probe_{n_out}_outputs", input_names=["x"],
                output_names=[f"o{i}" for i in range(n_out)],
                source=_BODY.replace("out[i]", "o0[i]") + "  if (i < 4) { "
                + " ".join(f"o{i}[i] = InT(i);" for i in range(1, n_out)) + " }\n")
            chains[f"custom_{n_out}_outputs"] = lambda x, kn=kn, n_out=n_out: kn(
                inputs=[x], template=[("InT", x.dtype)], grid=(2048, 1, 1),
                threadgroup=(256, 1, 1), output_shapes=[x.shape] + [(4,)] * (n_out - 1),
                output_dtypes=[x.dtype] * n_out)[0]
        # The compiled decode step hands the in-place states back through a
        # Depends each (60 per token): a launch reading a Depends of a small
        # array on the chain, and one reading an output of a Depends over 60
        # (MLX's cost of a primitive grows with the square of its outputs),
        # against the same launch reading the plain array.
        k1 = kernel("probe_1_of_depends", _BODY, ["x", "w0"])
        smalls60 = [mx.full((4,), float(i)) for i in range(60)]
        mx.eval(smalls60)
        chains["custom_after_depends_1"] = lambda x: call(
            k1, x, (mx.depends(smalls60[0], [x]),))
        chains["custom_after_depends_60"] = lambda x: call(
            k1, x, (mx.depends(smalls60, [x])[0],))
        chains["custom_1_input"] = lambda x: call(k1, x, (smalls60[0],))

    def run(fn, y):
        for _ in range(args.ops):
            y = fn(y)
        return y

    rows = []
    forms = {name: (lambda f=f: run(f, x0), mx.compile(lambda x, f=f: run(f, x)))
             for name, f in chains.items()}
    if cuda is not None and cuda.is_available():
        forms.update({name: (lambda c=chain: c(x0), comp)
                      for name, (chain, comp) in distinct.items()})
    for name, (eager, comp) in forms.items():
        for mode, g in (("eager", eager), ("compiled", lambda comp=comp: comp(x0))):
            best = None
            for rep in range(args.repeats + 2):
                mx.synchronize()
                t0 = time.perf_counter()
                y = g()
                t1 = time.perf_counter()
                mx.async_eval(y)
                t2 = time.perf_counter()
                mx.eval(y)
                t3 = time.perf_counter()
                r = [(b - a) * 1e6 / args.ops for a, b in ((t0, t1), (t1, t2), (t2, t3))]
                if rep >= 2 and (best is None or r[1] < best[1]):
                    best = r
            rows.append(dict(op=name, mode=mode, build_us=best[0], encode_us=best[1],
                             wait_us=best[2]))
            print(f"{name:20s} {mode:9s} build {best[0]:6.2f}  encode {best[1]:6.2f}  "
                  f"wait {best[2]:6.2f} us/op", flush=True)
    fanout = _depends_fanout(mx, args.repeats)
    path = write_result(args.out, "profile-encode", dict(ops=args.ops, repeats=args.repeats,
                                                         rows=rows, depends_fanout=fanout))
    print(f"wrote {path}")
    return 0


def _depends_fanout(mx, repeats: int) -> list:
    """Host time of a compiled call handing back 60 state-sized arrays after one
    operation: passed through, through 60 Depends of one array each, through 30
    of two, or through one Depends over all 60 (any device).

    The compiled decode step hands back the Gated DeltaNet states the packed
    MoE block wrote in place this way (``decode.py``); MLX's cost of a
    primitive grows with the square of its outputs (each output holds the
    others as siblings), which the one-Depends form shows.
    """
    import time

    states = [mx.zeros((1, 32, 128, 128)) for _ in range(60)]
    x = mx.ones((16,))
    mx.eval(states, x)
    forms = {
        "passthrough": lambda y, st: list(st),
        "depends_60x1": lambda y, st: [mx.depends(a, y) for a in st],
        "depends_30x2": lambda y, st: [d for i in range(0, 60, 2)
                                       for d in mx.depends([st[i], st[i + 1]], [y])],
        "depends_1x60": lambda y, st: mx.depends(list(st), [y]),
    }
    rows = []
    for name, hand_back in forms.items():
        def step(x, *st, hand_back=hand_back):
            y = mx.sort(x)
            return y, hand_back(y, st)
        fn = mx.compile(step)
        mx.eval(fn(x, *states))
        best = None
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            outs = [fn(x, *states) for _ in range(100)]
            t = (time.perf_counter() - t0) * 1e4  # us per call
            mx.eval(outs)
            best = t if best is None else min(best, t)
        rows.append(dict(form=name, build_us=best))
        print(f"hand back 60 arrays: {name:13s} build {best:7.1f} us per call", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
