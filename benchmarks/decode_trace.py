#!/usr/bin/env python3
"""Where decode time goes: per-token time of the full-size model by layer count.

Builds the ``full`` preset (random Qwen3.6-35B-A3B shapes, 4-bit) once per
backend, prefills ``--context`` tokens, then times greedy decode steps
(mlx-lm's own pipelining: the next step is enqueued before the previous
token is read) with only the first k decoder layers kept, for each k in
``--layer-counts``. A straight line through (k, ms/token) splits the token
into a fixed cost (embedding, final norm, lm_head, sampling, host overhead)
and a per-layer cost; the script prints both, with the tokens/s of the whole
model. Each k must keep the first full-attention layer (mlx-lm's Qwen3.5
model indexes its cache): at least 4 for the Qwen3.6 layer pattern.
Writes ``decode-trace-<device>.json`` into OUT.

Usage:
    python benchmarks/decode_trace.py OUT [--backends stock,fused] [--context 512]
        [--layer-counts 4,8,20,40] [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def decode_ms_per_token(model, context: int, tokens: int, warmup: int = 4, log=None) -> float:
    """Median-free simple timing: ``tokens`` greedy steps after ``warmup`` steps."""
    import mlx.core as mx
    from _common import pipelined_ms
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(context))
    logits = model(prompt, cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(y)
    if log:
        log(f"  prefilled {context} tokens")

    def step(y):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)

    for _ in range(warmup):
        y = step(y)
        mx.eval(y)
    return pipelined_ms(step, y, tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--backends", default="stock,fused")
    p.add_argument("--context", type=int, default=512, help="prefilled tokens before decoding")
    p.add_argument("--layer-counts", default="4,8,20,40", help="first-k layers to keep")
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"])
    args = p.parse_args(argv)
    import mlx.core as mx

    from _common import variant_model

    from qwen_apple_backend.bench.target import build_preset

    t_start = time.perf_counter()

    def stage(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    stage(f"building preset {args.preset}")
    b = build_preset(args.preset, seed=0)
    rows = []
    for backend in args.backends.split(","):
        model = variant_model(b, backend)
        stage(f"{backend}: built; timing decode (first run pays the GPU JIT)")
        layers = model.language_model.model.layers
        full = list(layers)
        for k in (int(x) for x in args.layer_counts.split(",")):
            k = min(k, len(full))
            model.language_model.model.layers = full[:k]
            try:
                ms = decode_ms_per_token(model, args.context, args.tokens, log=stage)
            finally:
                model.language_model.model.layers = full
            rows.append(dict(backend=backend, layers=k, context=args.context, ms_per_token=ms))
            print(f"[{time.perf_counter() - t_start:6.1f}s] {backend:8s} layers {k:3d}: "
                  f"{ms:8.3f} ms/token ({1e3 / ms:7.1f} tok/s)", flush=True)
        pts = [(r["layers"], r["ms_per_token"]) for r in rows if r["backend"] == backend]
        if len(pts) >= 2:
            n = len(pts)
            mk = sum(k for k, _ in pts) / n
            mm = sum(m for _, m in pts) / n
            var = sum((k - mk) ** 2 for k, _ in pts)
            slope = sum((k - mk) * (m - mm) for k, m in pts) / var if var else float("nan")
            fixed = mm - slope * mk
            print(f"  {backend}: {slope:.3f} ms per layer + {fixed:.3f} ms fixed per token",
                  flush=True)
            rows.append(dict(backend=backend, fit_ms_per_layer=slope, fit_fixed_ms=fixed))
        if backend != "stock":
            del model
            mx.clear_cache()
    from _common import write_result

    path = write_result(args.out, "decode-trace", dict(preset=args.preset, rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
