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

The summary groups kernels by name (C++ template arguments and namespaces
dropped; MLX's custom kernels carry their template values in their names,
``custom_kernel_qab_<op>_<values>``, so each instantiation is its own group)
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
import math
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

    MLX's custom kernels (``custom_kernel_<name>_<template values>``) have no
    C++ template syntax in their names, so their template values stay: each
    instantiation is its own group.

    >>> kernel_group("void mlx::core::cu::qmv_kernel<__nv_bfloat16, 4, 64>(const T*, int)")
    'qmv_kernel'
    >>> kernel_group("void cub::DeviceForEachKernel<int, [](int)->int {...}>(int)")
    'DeviceForEachKernel'
    >>> kernel_group("")
    '<unnamed>'
    """
    name = re.sub(r"^void\s+", "", name.strip())
    depth, out, prev = 0, [], ""
    for ch in name:  # drop <...> and (...) at any depth; "->" closes nothing
        if ch in "<(":
            depth += 1
        elif ch in ">)" and not (ch == ">" and prev == "-"):
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
        prev = ch
    return "".join(out).split("::")[-1].strip() or name or "<unnamed>"


#: ncu's time units, in microseconds.
_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
          "second": 1e6, "s": 1e6}


def read_run_record(record: Path) -> dict:
    """A profiling run's record (JSON with at least ``order`` and ``reps``), for --summarize.

    Raises:
        SystemExit: one line naming the file when it is missing or unusable.
    """
    try:
        run = json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{record}: no usable run record ({type(exc).__name__}); run the "
                         "profile into the same OUT first")
    if not isinstance(run, dict):
        raise SystemExit(f"{record}: no usable run record (not a JSON object)")
    reps, order = run.get("reps"), run.get("order")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise SystemExit(f"{record}: no usable run record (reps {reps!r}: an integer >= 1)")
    if not isinstance(order, list) or not order:
        raise SystemExit(f"{record}: no usable run record (order {order!r}: a list of the "
                         "profiled candidates)")
    return run


def marked_segments(csv_path: Path, labels: list[str], reps: int,
                    what: str = "candidates") -> list[list[tuple[str, float]]]:
    """An ncu log cut at its marker launches: ``[(kernel group, us), ...]`` per label.

    The log's first launch is the marker (a small launch the profiling script
    makes before the first candidate and after each one); the launches
    between two markers are one candidate's ``reps`` calls, in the order of
    ``labels`` (the run record's candidates; ``what`` names them in errors).

    Raises:
        SystemExit: as :func:`read_rows`; naming the file when the log does not
            split into one segment per label, or a segment is empty or not a
            multiple of ``reps`` launches.
    """
    rows = read_rows(csv_path)
    mark = rows[0][0]
    segments, cur = [], None
    for name, us, *_ in rows:
        if name == mark:
            if cur is not None:
                segments.append(cur)
            cur = []
        else:
            cur.append((name, us))
    if len(segments) != len(labels):
        raise SystemExit(f"{csv_path}: {len(segments)} marked segments for {len(labels)} "
                         f"{what} in the run record")
    for label, seg in zip(labels, segments):
        if not seg or len(seg) % reps:
            raise SystemExit(f"{csv_path}: {len(seg)} launches for {label}, not a multiple of "
                             f"{reps} reps")
    return segments


def read_rows(csv_path: Path) -> list[tuple[str, float, str, str]]:
    """The kernel launches of an ncu ``--csv`` log, in launch order.

    Returns:
        list: ``(kernel group, microseconds, grid size, block size)`` per launch
        (:func:`kernel_group` names; ncu's own ``==PROF==`` lines and other
        metrics' rows skipped).

    Raises:
        SystemExit: with a one-line message naming the file (and row) when it
            cannot be read, has no time rows, or holds a value or unit it
            cannot convert.
    """
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            lines = [ln for ln in f if ln.lstrip("\ufeff").startswith('"')]
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{csv_path}: cannot read the ncu log ({exc.__class__.__name__}: "
                         f"{exc.strerror if isinstance(exc, OSError) else exc.reason})")
    reader = csv.DictReader(lines)
    missing = {"Kernel Name", "Metric Name", "Metric Value"} - set(reader.fieldnames or ())
    if lines and missing:
        raise SystemExit(f"{csv_path}: not an ncu --csv log (no column {sorted(missing)})")
    rows = []
    for i, rec in enumerate(reader, start=2):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = (rec.get("Metric Unit") or "").strip()
        text = (rec.get("Metric Value") or "").replace(",", "").strip()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if unit not in _UNITS:
            raise SystemExit(f"{csv_path}: row {i}: unknown time unit {unit!r} "
                             f"(known: {', '.join(_UNITS)})")
        if not (math.isfinite(value) and value >= 0):
            raise SystemExit(f"{csv_path}: row {i}: metric value {text!r} is not a "
                             "duration >= 0")
        rows.append((kernel_group(rec.get("Kernel Name") or ""), value * _UNITS[unit],
                     rec.get("Grid Size", ""), rec.get("Block Size", "")))
    if not rows:
        raise SystemExit(f"{csv_path}: no gpu__time_duration.sum rows (was ncu run with "
                         "--metrics gpu__time_duration.sum --csv?)")
    return rows


def summarize(csv_path: Path, tokens: int) -> dict:
    """Per-kernel-group launches and microseconds per token from an ncu ``--csv`` log.

    Args:
        csv_path (Path): ``ncu --csv --metrics gpu__time_duration.sum`` output (its
            own ``==PROF==`` log lines are skipped, as are other metrics' rows).
        tokens (int): decode tokens the log covers.

    Returns:
        dict: ``kernels`` (one row per group, largest first), ``launches_per_token``,
        ``kernel_us_per_token`` and ``notes`` (e.g. launches not a multiple of tokens).

    Raises:
        SystemExit: with a one-line message naming the file (and row) when it
            cannot be read, has no time rows, or holds a value or unit it
            cannot convert.
    """
    rows = read_rows(csv_path)
    groups = defaultdict(lambda: {"launches": 0, "us": 0.0, "grids": set()})
    for name, us, grid, block in rows:
        g = groups[name]
        g["launches"] += 1
        g["us"] += us
        g["grids"].add(f"{grid}x{block}")
    total = sum(g["us"] for g in groups.values())
    table = sorted(({"kernel": k, "launches_per_token": g["launches"] / tokens,
                     "us_per_token": g["us"] / tokens, "us_per_launch": g["us"] / g["launches"],
                     "share": g["us"] / total if total > 0 else 0.0,
                     "grid_x_block": sorted(g["grids"])[:4]}
                    for k, g in groups.items()), key=lambda r: -r["us_per_token"])
    notes = []
    if len(rows) % tokens:
        notes.append(f"{len(rows)} launches are not a multiple of {tokens} tokens: the log "
                     "holds other kernels too, or another run's")
    return {"kernels": table, "launches_per_token": len(rows) / tokens,
            "kernel_us_per_token": total / tokens, "notes": notes}


def main(argv=None) -> int:
    from qwen_apple_backend.argtypes import positive_int, token_lengths

    p = argparse.ArgumentParser(description=__doc__.split("\n\nUsage:")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (created)")
    p.add_argument("--variant", default="fused",
                   help="stock, fused, or fused-NAME (fused with QAB_DISABLE=NAME added); "
                        "default fused")
    p.add_argument("--preset", default="full", choices=["tiny", "small", "full"],
                   help="random-weight model shape; default full (Qwen3.6-35B-A3B, about "
                        "19 GB)")
    p.add_argument("--layers", type=layer_count, default=None,
                   help="keep the first k layers (a multiple of 4); default all")
    p.add_argument("--context", type=token_lengths, default="4K",
                   help="prefilled tokens, one length (K = 1,024); default 4K")
    p.add_argument("--tokens", type=positive_int, default=3,
                   help="profiled decode tokens; default 3")
    p.add_argument("--summarize", metavar="CSV", default=None,
                   help="summarize an ncu CSV written by a profiled run (reads the run's "
                        "token count from OUT/profile-decode-gpu-meta-VARIANT.json; --preset, "
                        "--layers, --context and --tokens are not used)")
    args = p.parse_args(argv)
    check_out(p, args.out)
    if args.variant.startswith("fused-"):
        from _common import check_disable_names

        check_disable_names(p, [args.variant[len("fused-"):]], what=f"--variant {args.variant!r}")
    elif args.variant not in ("stock", "fused"):
        p.error(f"--variant {args.variant!r}: expected stock, fused or fused-NAME")
    if len(args.context) != 1:
        p.error(f"--context: one length, got {len(args.context)}")
    args.context = args.context[0]
    out = Path(args.out)
    if args.summarize is not None:
        if not args.summarize.strip():
            p.error("--summarize: an empty file name")
        meta_path = out / f"profile-decode-gpu-meta-{args.variant}.json"
        if not meta_path.is_file():
            p.error(f"{meta_path} not found: run the profiled decode into OUT first")
        try:
            meta = json.loads(meta_path.read_text())
            missing = {"variant", "context", "layers", "tokens", "device"} - set(meta)
            if missing:
                raise KeyError(", ".join(sorted(missing)))
            tokens = int(meta["tokens"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            p.error(f"{meta_path}: not this script's run record ({exc.__class__.__name__}: {exc})")
        if tokens < 1:
            p.error(f"{meta_path}: tokens must be >= 1, got {tokens}")
        result = {**meta, **summarize(Path(args.summarize), tokens)}
        if not meta.get("profiler_marked", True):
            result["notes"].append("the profiled run marked no profiler range (no CUDA "
                                   "driver): this log is not that run's")
        from _common import write_result

        path = write_result(out, f"profile-decode-gpu-{meta['variant']}", result,
                            device=meta["device"])
        print(f"{meta['variant']} @{meta['context']}, {meta['layers'] or 'all'} layers: "
              f"{result['launches_per_token']:g} launches, "
              f"{result['kernel_us_per_token']:.1f} us of kernels per token")
        for note in result["notes"]:
            print(f"note: {note}")
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
