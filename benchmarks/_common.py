"""Helpers shared by the benchmark scripts in this folder (not part of the package)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def device_name() -> str:
    """The MLX default device's name (e.g. ``NVIDIA H200``), as the bench reports print it."""
    from qwen_apple_backend.bench.report import device_info

    return device_info()["name"]


def write_result(out: str | Path, stem: str, payload: dict, *, device: str | None = None) -> Path:
    """Write ``payload`` (plus ``device``) as ``OUT/<stem>-<device slug>.json``; return the path."""
    from qwen_apple_backend.bench.report import slug

    dev = device or device_name()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{slug(dev.split(' as ')[0])}.json"
    path.write_text(json.dumps({"device": dev, **payload}, indent=1))
    return path


def stage_logger() -> Callable[[str], None]:
    """``stage(msg)`` prints ``[  12.3s] msg``: seconds since this call, flushed."""
    t0 = time.perf_counter()

    def stage(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    return stage


def variant_model(build: Any, backend: str, disable=()) -> Any:
    """The preset's stock model, or a fused clone of it with ``disable`` switched off.

    Args:
        build: a :class:`qwen_apple_backend.bench.target.PresetBuild`.
        backend (str): ``"stock"`` or ``"fused"``.
        disable (Iterable[str]): module kinds / optimizations kept stock (fused only).
    """
    if backend == "stock":
        return build.model
    from qwen_apple_backend.bench.target import clone_model_structure, fuse_in_memory

    model = clone_model_structure(build.model)
    fuse_in_memory(model, backend, config=build.config, disable=list(disable))
    return model


def pipelined_ms(step: Callable[[Any], Any], y: Any, tokens: int) -> float:
    """ms per token of mlx-lm's decode loop: step t+1 is enqueued before token t is read."""
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    nxt = step(y)
    mx.async_eval(nxt)
    for _ in range(tokens - 1):
        cur = nxt
        nxt = step(cur)
        mx.async_eval(nxt)
        cur.item()
    nxt.item()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0) / tokens


def layer_count(text: str) -> int:
    """argparse type: a positive multiple of 4 (3 linear-attention layers, then 1 full)."""
    import argparse

    from qwen_apple_backend.argtypes import positive_int

    value = positive_int(text)
    if value % 4:
        raise argparse.ArgumentTypeError(
            f"expected a multiple of 4 (the 3 linear + 1 full attention pattern; mlx-lm's "
            f"model indexes its first full-attention layer), got {value}")
    return value


def check_layers(parser, layers, preset: str) -> None:
    """``parser.error`` when ``--layers`` asks for more layers than the preset has."""
    if layers is None:
        return
    from qwen_apple_backend.checkpoint import hf_config

    total = hf_config(preset)["text_config"]["num_hidden_layers"]
    if layers > total:
        parser.error(f"--layers {layers}: preset {preset!r} has {total} layers")


def check_disable_names(parser, names, what: str | None = None) -> None:
    """``parser.error`` unless every name is one ``QAB_DISABLE`` accepts.

    ``what`` (e.g. ``"--variant 'fused-bogus'"``) names the argument in the
    message instead of ``disable=``; an empty name is an error too.
    """
    from qwen_apple_backend.envs import check_disable

    names = list(names)
    if any(not str(n).strip() for n in names):
        parser.error(f"{what or 'disable='}: an empty optimization name")
    try:
        check_disable(names)
    except ValueError as exc:
        msg = str(exc)
        if what and msg.startswith("disable=:"):
            msg = what + msg[len("disable="):]
        parser.error(msg)


def check_out(parser, out: str | Path) -> None:
    """``parser.error`` when OUT exists and is not a folder, or a ``QAB_*`` variable has a
    bad value (both checked before any work, as the ``qab`` commands do)."""
    from qwen_apple_backend import envs
    from qwen_apple_backend.errors import EnvVarError

    if Path(out).exists() and not Path(out).is_dir():
        parser.error(f"OUT {str(out)!r} exists and is not a folder")
    try:
        envs.validate()
    except EnvVarError as exc:
        parser.error(str(exc))
