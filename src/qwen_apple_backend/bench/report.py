"""Result files of ``qab bench`` and ``qab compare``: provenance, statistics, table, plot.

Every result JSON (``schema: "qab-bench/1"``) has the same frame:

* ``kind``: ``"bench"`` or ``"compare"``; ``device``: the device name;
* ``environment``: ``device`` (type, name, MLX's device info), ``versions`` (mlx,
  mlx_lm, qwen_apple_backend, numpy, python), ``platform``, ``git`` (commit,
  dirty) or null, ``command_line`` / ``argv`` (the effective ``qab`` command),
  ``process_argv``, ``created_utc``;
* ``model``: ``source: "path"`` with ``path``, ``config_sha256``,
  ``weight_index_sha256`` (+ ``weight_index_kind``), ``load_s`` per backend; or
  ``source: "preset"`` with ``preset``, ``seed``, ``dtype``, ``quantized``,
  ``vocab_size``, ``config_sha256``, ``share_weights``, ``build_s`` per backend;
* ``settings``: lengths, rounds (and ``rounds_completed``), warm-ups, decode
  tokens, ``batch_size`` (1), ``prefill_step_size``, sampling, timing rules;
* ``engine_flags``: ``QAB_DISABLE``, ``QAB_DISABLE_KERNELS``, ``QAB_GDN_CHUNK``;
* ``backends``: per column ``label``, ``backend``, ``disable``, ``ablation`` and
  ``describe`` (dtype, quantization, fuse report, build time ...);
* ``prompt``: sha256 of the token ids fed to every backend;
* ``alternation``: the backend order per round and the executed ``sequence``;
* ``runs`` (raw samples), ``results`` (statistics per backend/phase/length),
  ``bandwidth``, ``fidelity``, ``warmups``, ``errors`` (bench); ``compare``
  (compare);
* ``shared_prefill`` (bench): null, or with ``--shared-prefill`` the ``source``
  label and per length (``lengths``) its one timed prefill: ``prompt_tokens``,
  ``prefill_s``, ``tokens_per_s``, ``first_token``, ``peak_memory_bytes``; the
  runs then have ``prefill_s: null`` and ``context_from``, and there are no
  prefill results. With ``--synthetic-context``, ``synthetic: true`` there (and
  ``settings.synthetic_context``), each length's record ``synthetic: true``,
  ``prefill_s`` the seconds its random fill took and ``tokens_per_s`` null;
* ``summary``: one record per backend, phase and length::

    {"backend": "fused", "phase": "prefill", "length": 4096,
     "tokens_per_s_p50": 5750.0, "tokens_per_s_p95": 5600.0,
     "ratio_vs_stock": 1.21, "device": "NVIDIA H200", "verdict": "faster", ...}

``tokens_per_s_p50`` is tokens over the median run time; ``tokens_per_s_p95``
is tokens over the 95th-percentile run time (the slow tail: 95% of runs were at
least this fast). ``ratio_vs_stock`` compares medians. A ratio whose distance
from 1 is within the run-to-run spread of either side is reported with
``verdict: "no difference"``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

__all__ = [
    "SCHEMA",
    "SUMMARY_FIELDS",
    "checkpoint_info",
    "device_info",
    "environment",
    "format_table",
    "git_revision",
    "percentile",
    "plot_results",
    "sample_stats",
    "summarize",
    "token_hash",
    "write_json",
]

#: Version tag of the result format.
SCHEMA = "qab-bench/1"

#: Keys every ``summary`` record carries.
SUMMARY_FIELDS = ("backend", "phase", "length", "tokens_per_s_p50", "tokens_per_s_p95",
                  "ratio_vs_stock", "device")

#: Label of the reference backend.
BASELINE = "stock"


# ------------------------------------------------------------------------- provenance


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_version() -> str:
    """The installed distribution's version, else the source tree's ``__version__``."""
    from .. import __version__

    return _version("qwen-apple-backend") or __version__


def git_revision(start: Optional[Path] = None) -> Optional[dict]:
    """Commit and dirty flag of the source checkout the package runs from.

    Returns:
        dict | None: ``{"commit": sha, "dirty": bool}``, or None outside a git checkout
        (an installed wheel) or when git is not available.
    """
    here = Path(start or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=here, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(),
            "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def device_info() -> dict:
    """The MLX default device: type, name and what MLX reports about it."""
    import mlx.core as mx

    dev = mx.default_device()
    info: dict[str, Any] = {"type": str(dev.type).rsplit(".", 1)[-1], "mlx_device": str(dev)}
    try:
        raw = mx.device_info()
    except Exception:  # noqa: BLE001 - older MLX or no device query
        raw = {}
    info["details"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                       for k, v in dict(raw).items()}
    name = raw.get("device_name") or raw.get("name")
    info["name"] = str(name) if name else f"{info['type']} ({platform.processor() or 'unknown'})"
    return info


def environment(argv: Optional[Sequence[str]] = None) -> dict:
    """Everything a result must carry to be reproduced: device, versions, revision, command.

    Args:
        argv (Sequence[str], optional): the command's arguments, starting with the
            program and subcommand (``["qab", "bench", "--quick", ...]``); default
            ``sys.argv``. The process's own ``sys.argv`` is recorded beside it, its
            program by file name only (results carry no machine paths).
    """
    import mlx.core as mx

    process = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []
    argv = list(process if argv is None else argv)
    return {
        "device": device_info(),
        "versions": {
            "mlx": getattr(mx, "__version__", None) or _version("mlx"),
            "mlx_lm": _version("mlx-lm") or _mlx_lm_version(),
            "qwen_apple_backend": package_version(),
            "numpy": _version("numpy"),
            "python": platform.python_version(),
        },
        "platform": platform.platform(),
        "git": git_revision(),
        "command_line": " ".join(shlex.quote(str(a)) for a in argv),
        "argv": argv,
        "process_argv": process,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _mlx_lm_version() -> Optional[str]:
    try:
        from mlx_lm import __version__
    except Exception:  # noqa: BLE001
        return None
    return str(__version__)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_info(path: Path) -> dict:
    """Path and hashes identifying a checkpoint without hashing its weights.

    Returns:
        dict: ``path``, ``config_sha256``, and ``weight_index_sha256`` — of
        ``model.safetensors.index.json`` when present, else of the concatenated
        safetensors headers (tensor names, dtypes, shapes, offsets);
        ``weight_index_kind`` says which.
    """
    path = Path(path).resolve()
    out: dict[str, Any] = {"source": "path", "path": str(path)}
    cfg = path / "config.json"
    out["config_sha256"] = _sha256_file(cfg) if cfg.is_file() else None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        out["weight_index_sha256"] = _sha256_file(index)
        out["weight_index_kind"] = "model.safetensors.index.json"
    else:
        h = hashlib.sha256()
        files = sorted(path.glob("*.safetensors"))
        for f in files:
            with open(f, "rb") as fh:
                raw = fh.read(8)
                if len(raw) == 8:
                    n = int.from_bytes(raw, "little")
                    h.update(f.name.encode() + b"\0" + fh.read(min(n, 1 << 26)))
        out["weight_index_sha256"] = h.hexdigest() if files else None
        out["weight_index_kind"] = "safetensors headers"
    if cfg.is_file():
        try:
            config = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        out["model_type"] = config.get("model_type")
        out["quantization_config"] = config.get("quantization")
    return out


def token_hash(ids: Iterable[int]) -> str:
    """sha256 of token ids as little-endian int64 (the same ids give the same hash anywhere)."""
    import numpy as np

    return hashlib.sha256(np.asarray(list(ids), dtype="<i8").tobytes()).hexdigest()


# ------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def sample_stats(tokens: int, seconds: Sequence[float]) -> dict:
    """Throughput statistics of repeated runs over the same number of tokens.

    Args:
        tokens (int): tokens each run processed.
        seconds (Sequence[float]): wall time of each run.

    Returns:
        dict: ``tokens_per_s_p50`` (tokens / median time), ``tokens_per_s_p95``
        (tokens / 95th-percentile time), ``spread`` ((max - min) / median of the
        times; 0 for one sample), ``n``, and the raw ``samples_s`` and
        ``samples_tokens_per_s``.
    """
    secs = [float(s) for s in seconds]
    med = percentile(secs, 50)
    p95 = percentile(secs, 95)
    spread = (max(secs) - min(secs)) / med if len(secs) > 1 and med > 0 else 0.0
    return {
        "n": len(secs),
        "tokens": int(tokens),
        "samples_s": secs,
        "samples_tokens_per_s": [tokens / s if s > 0 else math.inf for s in secs],
        "seconds_p50": med,
        "seconds_p95": p95,
        "tokens_per_s_p50": tokens / med if med > 0 else math.inf,
        "tokens_per_s_p95": tokens / p95 if p95 > 0 else math.inf,
        "spread": spread,
    }


def verdict(ratio: Optional[float], spread_a: float, spread_b: float, n_a: int,
            n_b: int) -> str:
    """``faster`` / ``slower`` / ``no difference`` / ``single sample``.

    A ratio counts only if its distance from 1 exceeds the larger run-to-run
    spread of the two sides; with one run each there is no spread to judge by.
    """
    if ratio is None or not math.isfinite(ratio):
        return "n/a"
    if n_a < 2 or n_b < 2:
        return "single sample"
    if abs(ratio - 1.0) <= max(spread_a, spread_b):
        return "no difference"
    return "faster" if ratio > 1 else "slower"


def summarize(results: list[dict], device_name: str, baseline: str = BASELINE) -> list[dict]:
    """Add ``ratio_vs_stock`` and ``verdict`` to each result and build the ``summary`` list.

    Args:
        results (list[dict]): one per (backend, phase, length) with the keys of
            :func:`sample_stats` plus ``backend``, ``phase``, ``length``.
        device_name (str): device name written into each record.
        baseline (str): label of the reference backend. Default ``"stock"``.

    Returns:
        list[dict]: the summary records (``SUMMARY_FIELDS`` plus ``verdict``, ``spread``,
        ``n``, and per-phase extras: ``ttft_s_p50``, ``peak_memory_bytes``,
        ``working_memory_bytes``, ``bytes_per_token``, ``roofline_pct``).
    """
    base = {(r["phase"], r["length"]): r for r in results if r["backend"] == baseline}
    summary = []
    for r in results:
        ref = base.get((r["phase"], r["length"]))
        ratio = None
        if ref is not None and ref.get("tokens_per_s_p50"):
            ratio = r["tokens_per_s_p50"] / ref["tokens_per_s_p50"]
        r["ratio_vs_stock"] = ratio
        r["verdict"] = ("baseline" if r["backend"] == baseline else
                        verdict(ratio, r.get("spread", 0.0), ref.get("spread", 0.0) if ref else 0,
                                r.get("n", 0), ref.get("n", 0) if ref else 0))
        rec = {
            "backend": r["backend"],
            "phase": r["phase"],
            "length": r["length"],
            "tokens_per_s_p50": r["tokens_per_s_p50"],
            "tokens_per_s_p95": r["tokens_per_s_p95"],
            "ratio_vs_stock": ratio,
            "device": device_name,
            "verdict": r["verdict"],
            "spread": r.get("spread"),
            "n": r.get("n"),
        }
        for key in ("ttft_s_p50", "peak_memory_bytes", "working_memory_bytes", "bytes_per_token",
                    "roofline_pct", "decode_tokens"):
            if key in r:
                rec[key] = r[key]
        summary.append(rec)
    return summary


# ------------------------------------------------------------------------- output


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


def _finite(obj: Any) -> Any:
    """Replace NaN/inf with None so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: dict, path: Path) -> Path:
    """Write a result as strict JSON (NaN/inf as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(json.loads(json.dumps(result, default=_json_default))), indent=2,
                      allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def human_length(n: int) -> str:
    """``4096`` -> ``"4K"``, ``300`` -> ``"300"``."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_table(summary: list[dict], baseline: str = BASELINE) -> str:
    """The printed table: one row per phase, length and backend, with ratios vs stock."""
    # The backend column fits the longest label (ablation columns such as
    # fused-no-next-norm are 18 characters).
    bw = max([16] + [len(str(r["backend"])) for r in summary])
    header = (f"{'phase':<8} {'length':>7} {'backend':<{bw}} {'tok/s p50':>11} {'tok/s p95':>11} "
              f"{'vs ' + baseline:>9} {'verdict':<15} {'TTFT s':>8} {'peak MiB':>9} "
              f"{'roofline':>8}")
    lines = [header, "-" * len(header)]
    order = {"prefill": 0, "decode": 1}
    for r in sorted(summary, key=lambda r: (order.get(r["phase"], 9), r["length"])):
        ratio = r.get("ratio_vs_stock")
        peak = r.get("peak_memory_bytes")
        roof = r.get("roofline_pct")
        lines.append(
            f"{r['phase']:<8} {human_length(r['length']):>7} {r['backend']:<{bw}} "
            f"{_fmt(r['tokens_per_s_p50'], '11.1f')} {_fmt(r['tokens_per_s_p95'], '11.1f')} "
            f"{(_fmt(ratio, '.3f') + 'x') if ratio is not None else '-':>9} "
            f"{r.get('verdict', ''):<15} {_fmt(r.get('ttft_s_p50'), '8.3f'):>8} "
            f"{_fmt(peak / 2**20 if peak else None, '9.0f'):>9} "
            f"{(_fmt(roof, '.1f') + '%') if roof is not None else '-':>8}")
    return "\n".join(lines)


def plot_results(summary: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """PNG of tokens/s vs length: prefill and decode panels, one line per backend, log-x.

    Error bars run from the p95 throughput (slow tail) up to the median. Without
    prefill records (``--shared-prefill``) only the decode panel is drawn.

    Returns:
        Path | None: the file written, or None if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    phases = [p for p in ("prefill", "decode") if any(r["phase"] == p for r in summary)]
    phases = phases or ["prefill", "decode"]
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.8), squeeze=False)
    backends = list(dict.fromkeys(r["backend"] for r in summary))
    for ax, phase in zip(axes[0], phases):
        for b in backends:
            rows = sorted((r for r in summary if r["backend"] == b and r["phase"] == phase),
                          key=lambda r: r["length"])
            rows = [r for r in rows if r["tokens_per_s_p50"] and
                    math.isfinite(r["tokens_per_s_p50"])]
            if not rows:
                continue
            xs = [r["length"] for r in rows]
            ys = [r["tokens_per_s_p50"] for r in rows]
            lo = [max(0.0, y - (r["tokens_per_s_p95"] or y)) for y, r in zip(ys, rows)]
            ax.errorbar(xs, ys, yerr=[lo, [0.0] * len(ys)], marker="o", capsize=3, label=b)
        ax.set_xscale("log", base=2)
        lengths = sorted({r["length"] for r in summary})
        if lengths:
            ax.set_xticks(lengths)
            ax.set_xticklabels([human_length(n) for n in lengths], rotation=45)
        ax.set_title(f"{phase} ({'prompt' if phase == 'prefill' else 'generated'} tokens/s)")
        ax.set_xlabel("prompt length" if phase == "prefill" else "context length")
        ax.set_ylabel("tokens/s (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def slug(text: str) -> str:
    """File-name-safe form of a device name (``"NVIDIA H200"`` -> ``"nvidia-h200"``)."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "device"
