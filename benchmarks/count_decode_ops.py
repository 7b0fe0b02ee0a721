#!/usr/bin/env python3
"""Primitives per decode token: how many MLX operations one greedy step builds.

On MLX's CUDA backend every operation costs a roughly fixed 8-11 us on the H200
(``profile_decode_kernels.py``'s launch floor), so at batch 1 the number of
kernel-launching primitives per token, not bandwidth, sets decode speed. This
script builds a preset model per backend (and per ablation), prefills
``--context`` tokens, builds ONE decode step's graph without evaluating it, and
counts its primitives from ``mx.export_to_dot``: all of them, those that launch
a kernel (views such as Reshape, Broadcast, Slice, Squeeze, ExpandDims,
Transpose, AsStrided and StopGradient do not), and the kernel-launching ones by
name. Counts depend on which kernels are ready on the device (on the CPU the
portable paths run) and on which kernels accept the shapes: the MoE decode
kernels need a hidden size that is a multiple of 1,024, so count Qwen3.6's
structure with ``--preset full --layers 4 --experts 16 --context 4`` (about a
minute on a CPU); the default ``tiny`` preset shows the structure of a small
model, whose MoE layers keep MLX's gathered matmul.

``--as-gpu cuda`` (or ``metal``) counts, on any machine, the graph that GPU
would build: the compiled decode step is on (``decode-compile``, a GPU's
default), the device probe answers that backend, every self-check passes and
each custom kernel, and each ``mx.fast`` op (RMSNorm, RoPE, attention) and
``mx.dequantize`` that the CPU would split into many primitives, is a
stand-in whose outputs hang off one marker primitive per launch (counted back
as ``stand-in``) and depend on its inputs. Nothing is evaluated through the stand-ins, so the
counts, not the values, are what it shows. With ``--as-gpu`` each row also counts the arrays the
counted token's launches bind (``bound_arrays``: all bindings, distinct arrays, and per kernel
name): MLX's host cost per launch grows with each, most with each distinct one.

Writes ``decode-ops-<device>.json`` into OUT.

Usage:
    python benchmarks/count_decode_ops.py OUT [--preset tiny] [--backends stock,fused]
        [--ablate gdn-kernel,moe-kernel] [--enable l2-prefetch] [--context 64] [--top 25]
        [--as-gpu cuda]
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import sys
from pathlib import Path

from _common import layer_count, variant_model

from qwen_apple_backend.argtypes import nonnegative_int, positive_int

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

#: Primitives that make a view or nothing at all on the GPU (no kernel launch).
VIEWS = frozenset({"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Transpose", "Slice",
                   "AsStrided", "StopGradient", "Depends", "Split", "Unflatten", "Flatten"})


def count_primitives(outputs) -> collections.Counter:
    """Counter of primitive names in the lazy graph that produces ``outputs``."""
    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]',
                                          buf.getvalue()))


class GpuStandIn:
    """Makes this process build the graph of ``backend``'s GPU path (see the module doc)."""

    #: mx.fast ops (and mx.dequantize) that are one kernel on a GPU but split
    #: into many primitives on the CPU.
    FAST = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")

    def __init__(self, backend: str):
        self.backend = backend
        self.calls: collections.Counter = collections.Counter()
        #: ``(name, [input arrays], outputs)`` of every launch since the last
        #: clear (what each launch binds and makes; see :func:`bound_arrays`).
        self.launches: list = []
        self._undo: list = []

    def _set(self, module, name, value):
        self._undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def _launch(self, name, deps, shapes, dtypes):
        """Arrays of ``shapes``/``dtypes`` made by one marked launch that depends on ``deps``."""
        import mlx.core as mx

        # One Sort marks the launch (no decode graph has another Sort, and
        # mx.compile neither fuses nor merges it: its input is a fresh
        # constant); further outputs hang off a CumMax marker.
        self.calls[name] += 1
        self.launches.append((name, [d for d in deps if isinstance(d, mx.array)], len(shapes)))
        outs = []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            # Integer outputs (expert indices) are 0, a valid index for the
            # real ops that consume them (the prefill is evaluated);
            # distinct float values keep the markers distinct.
            value = 0 if mx.issubdtype(dtype, mx.integer) else sum(self.calls.values()) + i
            seed = mx.array([value], dtype=dtype)
            mark = mx.sort(seed) if i == 0 else mx.cummax(seed)
            outs.append(mx.broadcast_to(mark, tuple(shape)))
        deps = [d for d in deps if isinstance(d, mx.array)]
        return mx.depends(outs, deps) if deps else outs

    def __enter__(self):
        import mlx.core as mx

        from qwen_apple_backend.ops import attention as attn_ops
        from qwen_apple_backend.ops import device
        from qwen_apple_backend.ops import gated_delta as gd
        from qwen_apple_backend.ops import linear as lin
        from qwen_apple_backend.ops import moe as moe_ops
        from qwen_apple_backend.ops import norm as norm_ops

        def build(op, backend, **options):
            def kernel(*, inputs, output_shapes, output_dtypes, **kw):
                return self._launch(f"qab:{op}", inputs, output_shapes, output_dtypes)
            return kernel

        def checked(op, backend, key, kernel, reference, make_inputs, *, rtol):
            with device._LOCK:
                device._RESULTS[(op, backend, key)] = (True, "stand-in")
            return True

        for mod in (gd, moe_ops, lin, norm_ops, attn_ops):
            self._set(mod, "gpu_backend", lambda: self.backend)
            self._set(mod, "build_kernel", build)
            self._set(mod, "self_checked", checked)
        self._set(device, "self_checked", checked)
        # Clear kernel objects cached by a run without the stand-in.
        for mod in (gd, moe_ops, lin, norm_ops, attn_ops):
            for fn in vars(mod).values():
                if hasattr(fn, "cache_clear"):
                    fn.cache_clear()

        def one(name, deps, shape, dtype):
            return self._launch(name, deps, [shape], [dtype])[0]

        self._set(mx.fast, "rms_norm",
                  lambda x, weight, eps, **k: one("rms_norm", [x, weight], x.shape, x.dtype))
        self._set(mx.fast, "layer_norm",
                  lambda x, w, b, eps, **k: one("layer_norm", [x, w, b], x.shape, x.dtype))
        self._set(mx.fast, "rope",
                  lambda x, dims, *a, offset=0, freqs=None, **k:
                  one("rope", [x, offset, freqs], x.shape, x.dtype))
        self._set(mx.fast, "scaled_dot_product_attention",
                  lambda q, k, v, *a, scale=1.0, mask=None, sinks=None, **kw:
                  one("sdpa", [q, k, v, mask, sinks], (*q.shape[:-1], v.shape[-1]), q.dtype))
        deq = mx.dequantize

        def dequantize(w, scales, biases=None, group_size=64, bits=4, mode="affine", **k):
            if mode != "affine":
                return deq(w, scales, biases, group_size, bits, mode=mode, **k)
            shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)
            return one("dequantize", [w, scales, biases], shape, scales.dtype)

        self._set(mx, "dequantize", dequantize)
        return self

    def __exit__(self, *exc):
        from qwen_apple_backend.ops import device

        for module, name, value in reversed(self._undo):
            setattr(module, name, value)
        self._undo.clear()
        device.reset_self_checks()
        return False

    @staticmethod
    def adjust(ops: collections.Counter) -> collections.Counter:
        """``ops`` with the stand-ins' markers replaced by one launch each.

        The launches appear as ``stand-in`` (custom kernels and mx.fast ops);
        :attr:`calls` has them by name, counted when Python ran them (a
        compiled function counts once, however often it is replayed).
        """
        ops = collections.Counter(ops)
        launches = ops.pop("Sort", 0)
        ops.pop("CumMax", None)
        if launches:
            ops["stand-in"] = launches
        return ops


def bound_arrays(launches: list) -> dict:
    """What a token's launches bind and make: ``{"launches", "bound", "distinct",
    "outputs", "by_name"}``.

    MLX's host cost per launch grows with each array it binds, and most with
    each distinct one (``benchmarks/profile_encode.py``: ~0.9 us per distinct
    array per token on the H200, ~0.2 us per repeated one), and with each
    output it makes (~2 us to build and ~3 us to encode per output there).
    ``launches`` is :attr:`GpuStandIn.launches` for one token: ``bound``
    counts every input of every launch, ``distinct`` the different arrays
    among them (by identity: in the compiled step's trace each parameter is
    one tracer), ``outputs`` every output, ``by_name`` per kernel name
    ``[launches, bound, first-bound, outputs]``, the third counting the
    arrays no earlier launch of the token bound.
    """
    seen, by = set(), {}
    for name, deps, outs in launches:
        row = by.setdefault(name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += len(deps)
        row[3] += outs
        for d in deps:
            if id(d) not in seen:
                seen.add(id(d))
                row[2] += 1
    return dict(launches=len(launches), bound=sum(len(d) for _, d, _ in launches),
                distinct=len(seen), outputs=sum(o for _, _, o in launches), by_name=by)


def decode_step_ops(model, context: int, stand_in: "GpuStandIn | None" = None
                    ) -> collections.Counter:
    """Primitives of one greedy decode step after a ``context``-token prefill.

    The counted step is the third decode token, or with the compiled decode
    step the token after its first compiled call: the first token runs
    eagerly (kernel self-checks), and the step's first compiled call copies
    the caches' buffers once (and where it built packs, first runs their
    self-checks in an eager check pass on scratch caches); so with
    ``decode-compile`` on, the count is the compiled step's replayed graph in
    its steady state. With ``stand_in``, its
    :attr:`~GpuStandIn.launches` hold, after the call, the launches of one
    more token run with ``mx.compile`` off (the same Python, so the same
    launches and arguments as the compiled step's trace).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 100, (1, context), key=mx.random.key(context))
    y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(y, [c.state for c in cache])
    # The first decode token runs eagerly; then the compiled step's first call
    # (its caches' buffers copied once to private ones; with packs built,
    # moe-block-pack on a GPU, after their check pass on scratch caches).
    # The token counted next is a steady-state one.
    step = getattr(getattr(model, "language_model", model), "__dict__", {}).get("_qab_decode")
    for i in range(8):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y, [c.state for c in cache])
        if (i >= 1 and step is None) or (step is not None and step.compiled_calls >= 1):
            break
    nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
    ops = count_primitives([nxt])
    if stand_in is not None:
        # One more token with mx.compile off: every compiled function (the
        # step's and the layers' own, whose traces the step's replays
        # without calling them) runs its Python, so every launch reaches
        # the stand-ins, with the arrays the trace would bind. The step
        # treats the call as a trace (what it replays): with compile off,
        # its model input is re-wrapped on every call, which a replay never
        # does, and the concatenations and packs would look replaced.
        if step is not None:
            step._traced.clear()
        stand_in.launches.clear()
        mx.disable_compile()
        try:
            mx.eval(model(nxt[:, None], cache=cache))
        finally:
            mx.enable_compile()
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "full"])
    p.add_argument("--backends", default="stock,fused")
    p.add_argument("--ablate", default="", help="comma list of optimizations to turn off, "
                   "one fused column each")
    p.add_argument("--enable", default="", help="comma list of opt-in optimizations "
                   "(QAB_ENABLE names) to turn on, one fused column each ('fused +NAME')")
    p.add_argument("--context", type=positive_int, default=64, help="prefilled tokens")
    p.add_argument("--top", type=positive_int, default=25, help="primitive names listed per column")
    p.add_argument("--layers", type=layer_count, default=None,
                   help="keep only this many decoder layers (a multiple of 4 keeps the "
                        "3 linear + 1 full attention pattern; counts are per layer anyway)")
    p.add_argument("--experts", type=positive_int, default=None,
                   help="routed experts instead of the preset's (the count does not depend "
                        "on it; fewer save memory when counting --preset full on a CPU)")
    p.add_argument("--vocab", type=nonnegative_int, default=1024,
                   help="vocabulary rows (default 1024; 0 = the real 248,320, whose lm_head "
                        "takes the gemv-kernel path on CUDA)")
    p.add_argument("--as-gpu", choices=["cuda", "metal"], default=None,
                   help="count the graph this GPU backend would build (stand-in kernels)")
    args = p.parse_args(argv)
    from _common import check_disable_names, check_out

    check_out(p, args.out)
    unknown = [b for b in args.backends.split(",") if b and b not in ("stock", "fused")]
    if unknown:
        p.error(f"unknown backend(s) {unknown}; choose from stock, fused")
    check_disable_names(p, [a for a in args.ablate.split(",") if a])
    from qwen_apple_backend.envs import check_enable

    try:
        check_enable(args.enable.split(","), "--enable")
    except ValueError as exc:
        p.error(str(exc))
    enable = list(dict.fromkeys(e.strip().lower() for e in args.enable.split(",") if e.strip()))
    import os

    import mlx.core as mx

    from qwen_apple_backend.bench.target import build_preset

    from qwen_apple_backend import checkpoint

    preset = args.preset
    if args.layers or args.experts:
        shape = dict(checkpoint.PRESETS[preset])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        if args.experts:
            shape["num_experts"] = args.experts
        preset = f"{preset}-{shape['num_hidden_layers']}x{shape['num_experts']}"
        checkpoint.PRESETS[preset] = shape
    b = build_preset(preset, seed=0, vocab_size=args.vocab or None)
    n_layers = len(b.model.language_model.model.layers)
    # (backend, optimization switched off, optimization switched on)
    columns = [(name, "", "") for name in args.backends.split(",") if name]
    columns += [("fused", opt, "") for opt in args.ablate.split(",") if opt]
    columns += [("fused", "", opt) for opt in enable]
    rows = []
    for backend, off, on in columns:
        label = backend + (f" -{off}" if off else "") + (f" +{on}" if on else "")
        old = os.environ.get("QAB_DISABLE")
        if off:
            os.environ["QAB_DISABLE"] = ",".join(filter(None, [old, off]))
        stand_in = GpuStandIn(args.as_gpu) if args.as_gpu else None
        old_enable = os.environ.get("QAB_ENABLE")
        extra = [on] if on else []
        if stand_in is not None and backend != "stock":
            # The compiled decode step is on by default on a GPU (off on the
            # CPU): count the graph the GPU would run.
            extra.append("decode-compile")
        if extra:
            given = [e for e in (old_enable or "").split(",") if e.strip()]
            os.environ["QAB_ENABLE"] = ",".join(given + [e for e in extra if e not in given])
        try:
            model = variant_model(b, backend, [off] if off else [])
            if stand_in is None:
                ops = decode_step_ops(model, args.context)
            else:
                with stand_in:
                    ops = stand_in.adjust(decode_step_ops(model, args.context, stand_in))
        finally:
            if old_enable is None:
                os.environ.pop("QAB_ENABLE", None)
            else:
                os.environ["QAB_ENABLE"] = old_enable
            if off:
                if old is None:
                    os.environ.pop("QAB_DISABLE", None)
                else:
                    os.environ["QAB_DISABLE"] = old
        kernels = collections.Counter({k: v for k, v in ops.items() if k not in VIEWS})
        total, launches = sum(ops.values()), sum(kernels.values())
        row = dict(column=label, backend=backend, disabled=off, enabled=on, primitives=total,
                   kernel_primitives=launches,
                   kernel_primitives_per_layer=launches / n_layers,
                   by_name=dict(kernels.most_common()))
        print(f"{label:24s} {total:6d} primitives, {launches:6d} launch kernels "
              f"({launches / n_layers:.1f} per layer of {n_layers})", flush=True)
        print("    " + ", ".join(f"{k} {v}" for k, v in kernels.most_common(args.top)),
              flush=True)
        if stand_in is not None:
            bound = bound_arrays(stand_in.launches)
            row["bound_arrays"] = bound
            print(f"    stand-in launches bind {bound['bound']} arrays, "
                  f"{bound['distinct']} distinct ({bound['distinct'] / n_layers:.1f} per layer), "
                  f"make {bound['outputs']} outputs", flush=True)
        rows.append(row)
        if backend != "stock":
            del model
            mx.clear_cache()
    from _common import device_name, write_result

    dev = device_name() + (f" as {args.as_gpu}" if args.as_gpu else "")
    path = write_result(args.out, "decode-ops", dict(preset=preset, context=args.context,
                                                     layers=n_layers, rows=rows), device=dev)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
