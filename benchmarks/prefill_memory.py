#!/usr/bin/env python3
"""Memory of a long prefill, chunk by chunk: what grows, and which fused module grows it.

Builds the preset model once; for each variant (fused, fused with one module
kind kept stock, stock) prefills ``--length`` random tokens in chunks of
``--chunk`` (mlx-lm's ``prefill_step_size``, cache state evaluated after each
chunk, as ``mlx_lm.generate`` does) and records, after each chunk, MLX's
active memory and the peak since the chunk began. Prints per variant the
weights resident before, the KV/recurrent cache size at the end, the largest
peak above the weights, and that peak minus the cache (the transient working
set: the prefill target is cache + 4 GB at 128K), plus how the active memory
above weights + cache grew from the first to the last chunk (a leak if it
grows). Writes ``prefill-memory-<device>.json`` into OUT.

``--max-seconds`` caps each variant's prefill (stock's per-token Gated
DeltaNet loop needs more than ten minutes for 128K tokens on an H200): the
result then records how many tokens the variant reached in that time.

Usage:
    python benchmarks/prefill_memory.py OUT [--length 16384] [--chunk 2048]
        [--variants fused,fused-attn,fused-gdn,fused-moe,stock] [--preset full]
        [--max-seconds 0] [--warmup 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

GB = 1e9


def _cache_bytes(cache) -> int:
    import mlx.core as mx

    total = 0
    for c in cache:
        for a in c.state if isinstance(c.state, (list, tuple)) else [c.state]:
            if isinstance(a, mx.array):
                total += a.nbytes
    return total


def prefill_memory(model, length: int, chunk: int, max_seconds: float = 0.0,
                   warmup: int = 1) -> dict:
    """Prefill ``length`` tokens in chunks, recording memory per chunk.

    ``warmup`` chunks are first prefilled into a throwaway cache (MLX's kernel
    compiles stay out of the timing); with ``max_seconds`` > 0 the prefill
    stops after the first chunk that ends past it (``completed`` False,
    ``tokens_done`` says how far it got).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    for _ in range(warmup):
        c = make_prompt_cache(model)
        model(mx.zeros((1, min(chunk, length)), dtype=mx.int32), cache=c)
        mx.eval([x.state for x in c])
        del c
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, 1000, (1, length), key=mx.random.key(length))
    mx.eval(ids)
    rows = []
    t0 = time.perf_counter()
    for start in range(0, length, chunk):
        mx.reset_peak_memory()
        model(ids[:, start:start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        mx.synchronize()
        kv = _cache_bytes(cache)
        active = mx.get_active_memory()
        rows.append(dict(tokens=min(start + chunk, length), active=active - before, cache=kv,
                         peak=mx.get_peak_memory() - before,
                         seconds=time.perf_counter() - t0))
        if max_seconds > 0 and rows[-1]["seconds"] > max_seconds and start + chunk < length:
            break
    seconds = time.perf_counter() - t0
    peak = max(r["peak"] for r in rows)
    kv = rows[-1]["cache"]
    del cache
    mx.clear_cache()
    done = rows[-1]["tokens"]
    return dict(length=length, chunk=chunk, seconds=seconds, tokens_done=done,
                completed=done == length, tokens_per_s=done / seconds, weights_bytes=before,
                cache_bytes=kv, peak_above_weights=peak, working_bytes=peak - kv,
                other_active_first=rows[0]["active"] - rows[0]["cache"],
                other_active_last=rows[-1]["active"] - rows[-1]["cache"], chunks=rows)


def main(argv=None) -> int:
    from _common import check_disable_names, check_out

    from qwen_apple_backend.argtypes import nonnegative_float, nonnegative_int, positive_int

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--length", type=positive_int, default=16384, help="prompt tokens")
    p.add_argument("--chunk", type=positive_int, default=2048,
                   help="tokens per prefill step (mlx-lm's prefill_step_size)")
    p.add_argument("--variants", default="fused,fused-attn,fused-gdn,fused-moe",
                   help="comma list: stock, fused, or fused-NAME with NAME a module kind "
                        "(attn, gdn, moe) or an optimization (e.g. attn-blocks, gdn-kernel) "
                        "kept stock / off")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"])
    p.add_argument("--max-seconds", type=nonnegative_float, default=0.0,
                   help="stop a variant's prefill after the chunk that ends past this many "
                        "seconds (0 = never); the result records how many tokens it reached")
    p.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="chunks prefilled into a throwaway cache first, per variant")
    args = p.parse_args(argv)
    check_out(p, args.out)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in ("stock", "fused") and not v.startswith("fused-"):
            p.error(f"unknown variant {v!r}: expected stock, fused or fused-NAME")
    check_disable_names(p, [v.split("-", 1)[1] for v in variants if v.startswith("fused-")])
    import mlx.core as mx

    from _common import stage_logger, variant_model

    from qwen_apple_backend.bench.target import build_preset

    stage = stage_logger()
    stage(f"building preset {args.preset}")
    b = build_preset(args.preset, seed=0)
    results = []
    for name in variants:
        model = variant_model(b, name.split("-", 1)[0], name.split("-", 1)[1:])
        r = prefill_memory(model, args.length, args.chunk, args.max_seconds, args.warmup)
        r["variant"] = name
        results.append(r)
        if not r["completed"]:
            stage(f"{name:12s} STOPPED at --max-seconds: {r['tokens_done']} of {args.length} "
                  f"tokens in {r['seconds']:.1f}s ({r['tokens_per_s']:.1f} tok/s)")
        stage(f"{name:12s} {r['tokens_done']} tokens in {r['seconds']:.1f}s "
              f"({r['tokens_per_s']:.1f} tok/s): weights "
              f"{r['weights_bytes'] / GB:.3f} GB, cache {r['cache_bytes'] / GB:.3f} GB, peak above "
              f"weights {r['peak_above_weights'] / GB:.3f} GB, working (peak - cache) "
              f"{r['working_bytes'] / GB:.3f} GB; other active first/last chunk "
              f"{r['other_active_first'] / GB:.3f}/{r['other_active_last'] / GB:.3f} GB")
        if name != "stock":
            del model
        mx.clear_cache()
    from _common import write_result

    path = write_result(args.out, "prefill-memory", dict(preset=args.preset, results=results))
    stage(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
