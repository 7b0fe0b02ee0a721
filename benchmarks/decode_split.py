#!/usr/bin/env python3
"""Where a decode token's time goes on the host and on the GPU.

For each variant (stock, fused, fused with the compiled decode step, ...) the
script builds the preset model, prefills ``--context`` tokens and then, per
greedy decode token, times three phases one after the other (no overlap):

* ``build``: Python building the token's lazy graph (mlx-lm modules, our
  dispatch, or the compiled step's replay);
* ``encode``: ``mx.async_eval`` returning, i.e. MLX turning the graph into GPU
  work (on CUDA: kernel nodes in CUDA graphs, launched every
  ``MLX_MAX_OPS_PER_BUFFER`` operations);
* ``wait``: until the token's id is on the host (the GPU finishing).

``build + encode`` is the host's share; when it exceeds ``wait`` the GPU is not
the bottleneck. It also counts the token graph's primitives (as
``count_decode_ops.py``, with the real kernels of this device) and times the
pipelined loop mlx-lm runs (step t+1 built while step t runs) for the
tokens/s a user sees. With ``--rounds R`` every variant is measured R times,
variants alternating (all models and caches alive at once), so host and clock
drift hit every variant alike; rows report medians and the tokens/s spread
(decode on MLX's CUDA backend is host-bound and varies 1.5x between runs of
the same build). Several ``--context`` lengths share one built preset (a
minute or more at the full shape), one context after the other. Writes
``decode-split-<device>.json`` into OUT.

Usage:
    python benchmarks/decode_split.py OUT [--variants fused,fused-decode-compile,stock]
        [--preset full] [--layers 40] [--context 512 | 4K,128K] [--tokens 32]
        [--prefill-step 2048] [--rounds 1] [--dot]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve().parent
for p in (SRC, HERE):
    if p.is_dir() and str(p) not in sys.path:
        sys.path.insert(0, str(p))

#: variant -> (backend, environment while fusing and running)
VARIANTS = {
    "stock": ("stock", {}),
    "fused": ("fused", {}),
    # decode-compile is on by default on a GPU: "fused" there is compiled,
    # "fused-decode-compile" eager; "fused+compile" compiles on the CPU too.
    "fused+compile": ("fused", {"QAB_ENABLE": "decode-compile"}),
    "fused-decode-compile": ("fused", {"QAB_DISABLE": "decode-compile"}),
    "fused-gdn-kernel": ("fused", {"QAB_DISABLE": "gdn-kernel"}),
    "fused-moe-kernel": ("fused", {"QAB_DISABLE": "moe-kernel"}),
    "fused-attn-split": ("fused", {"QAB_DISABLE": "attn-split"}),
    "fused-attn-kernel": ("fused", {"QAB_DISABLE": "attn-kernel"}),
    "fused-qk-prep": ("fused", {"QAB_DISABLE": "qk-prep"}),
    "fused-kv-in-place": ("fused", {"QAB_DISABLE": "kv-in-place"}),
}


def _mlx_settings() -> dict:
    """The MLX_* environment settings of this run (tuning knobs; path settings such as a
    kernel cache folder are left out: they name this machine, not the measurement)."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("MLX_") and not k.endswith(("_DIR", "_FILE", "_PATH"))}


class _Decoder:
    """One variant's model with its context prefilled, decoding greedily."""

    def __init__(self, model, context: int, warmup: int = 4, prefill_step: int = 2048):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(context))
        for start in range(0, context - 1, prefill_step):
            model(prompt[:, start:min(start + prefill_step, context - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        self.y = mx.argmax(model(prompt[:, -1:], cache=cache)[:, -1], axis=-1)
        mx.eval(self.y)
        self.step = lambda y: mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        for _ in range(warmup):
            self.y = self.step(self.y)
            mx.eval(self.y)

    def count_ops(self, dot: Path | None = None):
        """(kernel-launching primitives, all primitives, launching by name, views by name)
        of one decode token's graph; with ``dot``, the graph is also written there
        (Graphviz, ``mx.export_to_dot``)."""
        import mlx.core as mx
        from count_decode_ops import VIEWS, count_primitives

        out = self.step(self.y)  # built, never evaluated
        if dot is not None:
            with open(dot, "w") as f:
                mx.export_to_dot(f, out)
        ops = count_primitives([out])
        return (sum(v for k, v in ops.items() if k not in VIEWS), sum(ops.values()),
                {k: v for k, v in ops.most_common() if k not in VIEWS},
                {k: v for k, v in ops.most_common() if k in VIEWS})

    def phases(self, tokens: int) -> dict:
        """Median ms per token of build / encode / wait (serial), and the pipelined ms."""
        import mlx.core as mx
        from _common import pipelined_ms

        build, encode, wait = [], [], []
        y = self.y
        for _ in range(tokens):
            t0 = time.perf_counter()
            nxt = self.step(y)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            nxt.item()
            t3 = time.perf_counter()
            build.append(t1 - t0)
            encode.append(t2 - t1)
            wait.append(t3 - t2)
            y = nxt
        self.y = y
        pipelined = pipelined_ms(self.step, y, tokens) / 1e3
        med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        return dict(build_ms=med(build), encode_ms=med(encode), wait_ms=med(wait),
                    serial_ms=med([a + b + c for a, b, c in zip(build, encode, wait)]),
                    pipelined_ms=1e3 * pipelined, tok_s=1.0 / pipelined)


def _run_context(context, names, args, b, variant_env, show, stage) -> list:
    """Rows of every variant at one context length (rounds alternating variants)."""
    import mlx.core as mx

    from _common import variant_model

    rows, live = [], []
    for name in names:
        backend, env = VARIANTS[name]
        with variant_env(name):
            model = variant_model(b, backend,
                                  [x for x in env.get("QAB_DISABLE", "").split(",") if x])
            full = list(model.language_model.model.layers)
            if args.layers:
                model.language_model.model.layers = full[:args.layers]
            d = _Decoder(model, context, prefill_step=args.prefill_step)
            dot = None
            if args.dot:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                tag = f"-{context}" if len(args.context) > 1 else ""
                dot = Path(args.out) / f"decode-step-{name}{tag}.dot"
            launches, total, by_name, views = d.count_ops(dot)
            r = d.phases(args.tokens)
        r.update(variant=name, context=context, prefill_step=args.prefill_step,
                 tokens=args.tokens, switches=dict(env),
                 kernel_primitives=launches, primitives=total, by_name=by_name,
                 views_by_name=views, rounds=[dict(r)],
                 mlx_env=_mlx_settings())
        rows.append(r)
        show(name, r, f" r1/{args.rounds}")
        stage(f"{name:18s} @{context}: {launches} kernel primitives, {total} in all "
              "(views included)")
        if args.rounds > 1:
            live.append((model, full, d))
        else:
            model.language_model.model.layers = full
            del model, d
            mx.clear_cache()
    for rnd in range(2, args.rounds + 1):
        for name, r, (model, full, d) in zip(names, rows, live):
            with variant_env(name):
                x = d.phases(args.tokens)
            r["rounds"].append(x)
            show(name, x, f" r{rnd}/{args.rounds}")
    if args.rounds > 1:
        for name, r in zip(names, rows):
            for key in ("build_ms", "encode_ms", "wait_ms", "serial_ms", "pipelined_ms"):
                r[key] = statistics.median(x[key] for x in r["rounds"])
            r["tok_s"] = 1e3 / r["pipelined_ms"]
            speeds = [x["tok_s"] for x in r["rounds"]]
            r["tok_s_min"], r["tok_s_max"] = min(speeds), max(speeds)
            show(name, r, " median")
            stage(f"{name:18s} @{context}: tok/s over {args.rounds} rounds: "
                  f"{min(speeds):.1f}..{max(speeds):.1f}")
        for model, full, _ in live:
            model.language_model.model.layers = full
    del live
    mx.clear_cache()
    return rows


def main(argv=None) -> int:
    from _common import layer_count

    from qwen_apple_backend.argtypes import positive_int, token_lengths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--variants", default="fused,fused-decode-compile,stock",
                   help=f"comma list of: {', '.join(VARIANTS)} (fused = this package's "
                        "defaults; fused-NAME = fused with NAME switched off through "
                        "QAB_DISABLE (any name it accepts), added to any QAB_DISABLE of yours; "
                        "fused+compile = the compiled decode "
                        "step also on a CPU)")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"],
                   help="random-weight model shape (full: Qwen3.6-35B-A3B, about 19 GB)")
    p.add_argument("--layers", type=layer_count, default=None,
                   help="keep the first k layers (a multiple of 4)")
    p.add_argument("--context", type=token_lengths, default="512",
                   help="prefilled tokens, or a comma list (K = 1,024: 4K,128K): each context, "
                        "shortest first, runs all variants and rounds in turn on the one built "
                        "preset")
    p.add_argument("--tokens", type=positive_int, default=32,
                   help="timed decode tokens per phase")
    p.add_argument("--prefill-step", type=positive_int, default=2048,
                   help="tokens per prefill chunk (mlx-lm's prefill_step_size)")
    p.add_argument("--dot", action="store_true",
                   help="also write each variant's decode-token graph as OUT/decode-step-"
                        "<variant>.dot, or decode-step-<variant>-<context>.dot with several "
                        "contexts (every primitive, views included)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="timed rounds per variant, variants alternating (from 2, every "
                        "variant's model and cache stay alive; rows report the medians and the "
                        "tok/s spread)")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    from _common import check_disable_names

    for v in names:  # any other switch: fused with QAB_DISABLE=NAME
        if v not in VARIANTS and v.startswith("fused-"):
            check_disable_names(p, [v[len("fused-"):]], what=f"--variants {v!r}")
            VARIANTS[v] = ("fused", {"QAB_DISABLE": v[len("fused-"):]})
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    twice = sorted({v for v in names if names.count(v) > 1})
    if twice:
        p.error(f"variant(s) {twice} named more than once")
    from _common import check_layers, check_out

    check_out(p, args.out)
    check_layers(p, args.layers, args.preset)
    import mlx.core as mx

    from _common import stage_logger

    from qwen_apple_backend.bench.target import build_preset

    stage = stage_logger()
    stage(f"building preset {args.preset}")
    b = build_preset(args.preset, seed=0)

    @contextlib.contextmanager
    def variant_env(name):
        env = dict(VARIANTS[name][1])
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():  # added to the user's own switches, not instead of them
            if saved[k]:
                env[k] = f"{saved[k]},{v}"
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def show(name, r, tag=""):
        stage(f"{name:18s}{tag} build {r['build_ms']:6.2f}  encode {r['encode_ms']:6.2f}  "
              f"wait {r['wait_ms']:6.2f}  serial {r['serial_ms']:6.2f}  pipelined "
              f"{r['pipelined_ms']:6.2f} ms/token ({r['tok_s']:6.1f} tok/s)")

    rows = []
    for context in args.context:
        rows += _run_context(context, names, args, b, variant_env, show, stage)
    from _common import write_result

    path = write_result(args.out, "decode-split",
                        dict(preset=args.preset, layers=args.layers, rows=rows))
    stage(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
