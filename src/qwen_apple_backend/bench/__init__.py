"""Benchmark harness: ``qab bench`` (throughput sweep) and ``qab compare`` (side by side).

Backends are measured through the small :class:`~.target.BenchTarget` interface,
so any registered backend whose class offers ``bench_target(path_or_model, **kw)``
(the MLX backends inherit one) can be benchmarked without the harness knowing
how it runs. Names are imported lazily; importing this package pulls in
neither MLX nor mlx-lm.

Example:
    >>> from qwen_apple_backend.bench import BenchConfig, run_bench
    >>> result = run_bench(BenchConfig(preset="tiny", vocab_size=1024, quick=True))
    >>> {r["phase"] for r in result["summary"]}
    {'decode', 'prefill'}
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BenchTarget": "target",
    "MLXTarget": "target",
    "BackendSpec": "target",
    "fuse_in_memory": "target",
    "make_bench_target": "target",
    "BenchConfig": "harness",
    "run_bench": "harness",
    "write_outputs": "harness",
    "CompareConfig": "compare",
    "run_compare": "compare",
    "run_fidelity": "fidelity",
    "FIDELITY_TEXT": "fidelity",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
