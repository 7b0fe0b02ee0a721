#!/usr/bin/env python3
"""GPU time of every kernel of a decode token, read by Nsight Compute (``ncu``).

``decode_split.py`` splits a token into host and GPU phases; this script says
where the GPU's share goes. It builds the preset (optionally only its first
``--layers`` layers), prefills ``--context`` tokens, warms up, and then decodes
``--tokens`` greedy tokens one at a time (each evaluated before the next)
between ``cuProfilerStart`` and ``cuProfilerStop``, so that ``ncu
--profile-from-start off`` times only the decode tokens' kernels. Run it once
per variant under ncu, then summarize the CSV::

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file OUT/ncu-fused.csv \\
        python benchmarks/profile_decode_gpu.py OUT --variant fused --layers 8 --context 4K
    python benchmarks/profile_decode_gpu.py OUT --variant fused --summarize OUT/ncu-fused.csv

The summary groups kernels by name (template arguments and namespaces dropped)
and gives, per decode token, launches, GPU microseconds and the share of the
token's kernel time; the sum is the token's kernel time without the gaps
between kernels (ncu serializes and times each kernel alone, with caches
flushed before each: weights stream from HBM as they do in decode). Writes
``profile-decode-gpu-<variant>-<device>.json`` into OUT.

Usage:
    python benchmarks/profile_decode_gpu.py OUT [--variant fused] [--preset full]
        [--layers 8] [--context 4K] [--tokens 3]
    python benchmarks/profile_decode_gpu.py OUT --variant fused --summarize CSV
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import check_layers, check_out, layer_count, stage_logger, variant_model  # noqa: E402



def _profiler(call: str) -> bool:
    """``cuProfilerStart`` / ``cuProfilerStop`` through the CUDA driver; False without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return getattr(lib, call)() == 0


def kernel_group(name: str) -> str:
    """A kernel's name without return type, namespaces, template or call arguments.

    >>> kernel_group("void mlx::core::cu::qmv_kernel<__nv_bfloat16, 4, 64>(const T*, int)")
    'qmv_kernel'
    """
    name = re.sub(r"^void\s+", "", name.strip())
    depth, out = 0, []
    for ch in name:  # drop <...> and (...) at any depth
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).split("::")[-1].strip() or name


def summarize(csv_path: Path, tokens: int) -> dict:
    """Per-kernel-group launches and microseconds per token from an ncu ``--csv`` log."""
    rows = []
    with open(csv_path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu prints its own log lines too
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec.get("Metric Unit", "nsecond")
        us = value / 1e3 if unit.startswith("n") else value * (1e3 if unit.startswith("m") else 1)
        rows.append((kernel_group(rec["Kernel Name"]), us, rec.get("Grid Size", ""),
                     rec.get("Block Size", "")))
    if not rows:
        raise SystemExit(f"{csv_path}: no gpu__time_duration.sum rows (was ncu run with "
                         "--metrics gpu__time_duration.sum --csv?)")
    groups = defaultdict(lambda: {"launches": 0, "us": 0.0, "grids": set()})
    for name, us, grid, block in rows:
        g = groups[name]
        g["launches"] += 1
        g["us"] += us
        g["grids"].add(f"{grid}x{block}")
    total = sum(g["us"] for g in groups.values())
    table = sorted(({"kernel": k, "launches_per_token": g["launches"] / tokens,
                     "us_per_token": g["us"] / tokens, "us_per_launch": g["us"] / g["launches"],
                     "share": g["us"] / total, "grid_x_block": sorted(g["grids"])[:4]}
                    for k, g in groups.items()), key=lambda r: -r["us_per_token"])
    return {"kernels": table, "launches_per_token": len(rows) / tokens,
            "kernel_us_per_token": total / tokens}


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int, token_lengths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--variant", default="fused",
                   help="stock, fused, or fused-NAME (fused with QAB_DISABLE=NAME added)")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"])
    p.add_argument("--layers", type=layer_count, default=None,
                   help="keep the first k layers (a multiple of 4)")
    p.add_argument("--context", type=token_lengths, default="4K",
                   help="prefilled tokens (K = 1,024)")
    p.add_argument("--tokens", type=positive_int, default=3, help="profiled decode tokens")
    p.add_argument("--summarize", metavar="CSV", default=None,
                   help="summarize an ncu CSV written by a profiled run (reads the run's "
                        "token count from OUT/profile-decode-gpu-meta-VARIANT.json)")
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.variant.startswith("fused-"):
        from _common import check_disable_names

        check_disable_names(p, [args.variant[len("fused-"):]])
    elif args.variant not in ("stock", "fused"):
        p.error(f"--variant {args.variant!r}: expected stock, fused or fused-NAME")
    if len(args.context) != 1:
        p.error(f"--context: one length, got {len(args.context)}")
    args.context = args.context[0]
    out = Path(args.out)
    if args.summarize:
        meta_path = out / f"profile-decode-gpu-meta-{args.variant}.json"
        if not meta_path.is_file():
            p.error(f"{meta_path} not found: run the profiled decode into OUT first")
        meta = json.loads(meta_path.read_text())
        result = {**meta, **summarize(Path(args.summarize), meta["tokens"])}
        from _common import write_result

        path = write_result(out, f"profile-decode-gpu-{meta['variant']}", result,
                            device=meta["device"])
        print(f"{meta['variant']} @{meta['context']}, {meta['layers'] or 'all'} layers: "
              f"{result['launches_per_token']:.0f} launches, "
              f"{result['kernel_us_per_token']:.0f} us of kernels per token")
        for r in result["kernels"]:
            print(f"  {r['kernel'][:48]:48s} {r['launches_per_token']:6.1f} x "
                  f"{r['us_per_launch']:8.1f} us = {r['us_per_token']:8.1f} us  "
                  f"{100 * r['share']:5.1f}%")
        print(f"wrote {path}")
        return 0
    backend = "stock" if args.variant == "stock" else "fused"
    disable = [args.variant[len("fused-"):]] if args.variant.startswith("fused-") else []
    check_layers(p, args.layers, args.preset)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from _common import device_name

    from qwen_apple_backend.bench.target import build_preset

    stage = stage_logger()
    stage(f"building preset {args.preset}")
    b = build_preset(args.preset, seed=0)
    model = variant_model(b, backend, disable)
    if args.layers:
        model.language_model.model.layers = model.language_model.model.layers[:args.layers]
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (1, args.context), key=mx.random.key(0))
    stage(f"prefilling {args.context} tokens")
    for start in range(0, args.context - 1, 2048):
        model(prompt[:, start:min(start + 2048, args.context - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    y = mx.argmax(model(prompt[:, -1:], cache=cache)[:, -1], axis=-1)
    for _ in range(6):  # warm-up: compiled step traced, kernels built and self-checked
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.synchronize()
    on = _profiler("cuProfilerStart")
    for _ in range(args.tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.synchronize()
    _profiler("cuProfilerStop")
    meta = dict(variant=args.variant, preset=args.preset, layers=args.layers,
                context=args.context, tokens=args.tokens, device=device_name(),
                profiler_marked=on)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-decode-gpu-meta-{args.variant}.json").write_text(json.dumps(meta, indent=1))
    stage(f"decoded {args.tokens} profiled tokens (profiler range {'marked' if on else 'NOT marked: no CUDA driver'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
