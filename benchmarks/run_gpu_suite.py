#!/usr/bin/env python3
"""The standard GPU benchmark suite: full-size random Qwen3.6-35B-A3B, stock vs fused.

Builds the ``full`` preset (exact Qwen3.6-35B-A3B shapes, random weights,
4-bit affine g64 with 8-bit routers) in device memory once per backend from
the same seed, then runs the ``qab bench`` sweep: by default prompt/context
lengths 512, 2K, 4K and 8K, 3 rounds, 32 decode tokens, stock vs fused
alternating, plus teacher-forced fidelity. Sized for a single 10-minute
command on one H200: building both models takes about 20 s there, but the
first warm-up run of each backend compiles MLX's CUDA kernels (about 140 s for
stock and 80 s for fused on a fresh machine), so a time budget (``--max-seconds``,
default 540 s from the script's start) stops before a round that would overrun
it; rounds stay whole and the JSON records ``rounds_completed``. Build and
warm-up times are printed and recorded. The 128K point needs its own command, e.g.::

    python benchmarks/run_gpu_suite.py OUT --lengths 128K --rounds 1 \\
        --decode-tokens 16 --warmup 0 --no-fidelity --tag 128k

(if stock and fused together do not fit, run ``--backends stock`` and
``--backends fused`` as two commands; each file then has its own absolute
numbers, and ratios need the same run).

Writes into OUT: ``gpu-suite-<device>-<tag>.json`` (the ``qab bench`` result
format, top-level ``summary``), ``.png`` (skipped when matplotlib is missing)
and ``.md`` (the table, ready for benchmarks/PERFORMANCE.md).

Needs only mlx (with its CUDA or Metal backend), mlx-lm, numpy, pluggy and this
package's source: run from a checkout, the script puts ``../src`` on
``sys.path`` itself; no installed entry points are needed.

Usage:
    python benchmarks/run_gpu_suite.py OUT [--lengths 512,2K,4K,8K] [--rounds 3]
        [--backends stock,fused] [--ablate moe,gdn,attn] [--decode-tokens 32]
        [--preset full] [--seed 0] [--share-weights] [--no-fidelity] [--tag TAG]
        [--max-seconds 540]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from qwen_apple_backend.argtypes import file_name_part  # noqa: E402 - after the path setup

DEFAULT_LENGTHS = "512,2K,4K,8K"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Standard GPU suite: full-size random Qwen3.6-35B-A3B, stock vs fused, "
                    "prefill and decode by length, JSON + PNG + Markdown into OUT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated, K = 1024")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per run")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per backend and length")
    p.add_argument("--warmup-max-tokens", type=int, default=2048,
                   help="warm-up prompts are capped here (same prefill chunk shapes)")
    p.add_argument("--backends", default="stock,fused", help="comma-separated backends")
    p.add_argument("--ablate", default="", help="fused kinds to ablate: moe,gdn,attn")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"])
    p.add_argument("--vocab-size", type=int, default=None, help="preset vocabulary override")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--share-weights", action="store_true",
                   help="build the model once; backends share its weight arrays")
    p.add_argument("--no-fidelity", action="store_true")
    p.add_argument("--fidelity-positions", type=int, default=256)
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for the roofline (default: measured)")
    p.add_argument("--max-seconds", type=float, default=540.0,
                   help="time budget from the script's start (model builds included): no "
                        "round starts that would end past it; 0 = no budget")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tag", default="", type=file_name_part,
                   help="file-name suffix (default: UTC timestamp)")
    return p.parse_args(argv)


def markdown_table(summary: list) -> str:
    """The summary as a Markdown table (tokens/s medians, ratio vs stock, verdict)."""
    from qwen_apple_backend.bench.report import human_length

    rows = ["| phase | length | backend | tok/s p50 | tok/s p95 | vs stock | verdict |",
            "|---|---:|---|---:|---:|---:|---|"]
    order = {"prefill": 0, "decode": 1}
    for r in sorted(summary, key=lambda r: (order.get(r["phase"], 9), r["length"])):
        ratio = r.get("ratio_vs_stock")
        rows.append(f"| {r['phase']} | {human_length(r['length'])} | {r['backend']} | "
                    f"{r['tokens_per_s_p50']:.1f} | {r['tokens_per_s_p95']:.1f} | "
                    f"{'-' if ratio is None else f'{ratio:.3f}x'} | {r.get('verdict', '')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import mlx.core as mx

    from qwen_apple_backend.bench.harness import (BenchConfig, parse_lengths, run_bench,
                                                  write_outputs)
    from qwen_apple_backend.bench.report import format_table, slug

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    log(f"device {mx.default_device()}; building preset {args.preset} (seed {args.seed})")
    cfg = BenchConfig(
        preset=args.preset, seed=args.seed, dtype=args.dtype, vocab_size=args.vocab_size,
        share_weights=args.share_weights,
        backends=[b for b in args.backends.split(",") if b.strip()],
        ablate=[a for a in args.ablate.split(",") if a.strip()],
        lengths=parse_lengths(args.lengths), rounds=args.rounds, warmup=args.warmup,
        warmup_max_tokens=args.warmup_max_tokens, decode_tokens=args.decode_tokens,
        bandwidth_gbs=args.bandwidth_gbs, fidelity=not args.no_fidelity,
        fidelity_positions=args.fidelity_positions, progress=not args.no_progress,
        max_seconds=(args.max_seconds - (time.perf_counter() - t0)) if args.max_seconds else None,
        argv=["python", "benchmarks/run_gpu_suite.py", *(sys.argv[1:] if argv is None else argv)],
        extra={"suite": "run_gpu_suite"})
    result = run_bench(cfg, log=log)
    tag = args.tag or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    stem = f"gpu-suite-{slug(result['device'])}-{tag}"
    out = Path(args.out)
    files = write_outputs(result, out, stem=stem)
    md = out / f"{stem}.md"
    build = result["model"].get("build_s", {})
    md.write_text(
        f"Device: {result['device']}; mlx {result['environment']['versions']['mlx']}, "
        f"mlx-lm {result['environment']['versions']['mlx_lm']}; preset {args.preset} "
        f"seed {args.seed}; {args.rounds} rounds; {args.decode_tokens} decode tokens.\n\n"
        + markdown_table(result["summary"]) + "\n", encoding="utf-8")
    print(format_table(result["summary"]))
    print("\nbuild time per backend (s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in build.items()))
    fid = result.get("fidelity")
    if fid:
        for label, r in fid["backends"].items():
            print(f"fidelity {label}: top-1 agreement {100 * r['agreement_vs_stock']:.2f}% over "
                  f"{fid['positions']} positions, perplexity {r['perplexity']:.2f}")
    for e in result.get("errors", []):
        print(f"error: {e}", file=sys.stderr)
    print(f"wrote {files['json']}" + (f", {files['png']}" if files.get("png") else "")
          + f", {md}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
