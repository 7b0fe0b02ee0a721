"""Every environment variable the package reads, in one place.

Read through the functions here (never ``os.environ`` elsewhere) so tests can
monkeypatch one module and users can find every switch.

Variables:
    QAB_BACKEND: default backend for ``load`` and the CLI when none is given
        (``auto``, ``fused`` or ``stock``). Default ``auto``.
    QAB_DISABLE: comma-separated fused module kinds to keep stock
        (``moe``, ``gdn``, ``attn``, ``all``) or single optimizations to
        switch off (``gdn-kernel``, ``moe-gemm``, ``decode-compile``), for
        ablations: ``moe``, ``gdn``, ``attn`` (``all`` = every kind).
    QAB_DISABLE_KERNELS: ``1`` forces the portable pure-MLX path of every op.
    QAB_ENABLE: comma-separated experimental optimizations to switch on
        (``decode-compile``: the compiled one-token decode step).
    QAB_UNVERIFIED_KERNELS: ``1`` also uses CUDA kernels whose GPU tests have
        not yet passed on a GPU (``verified`` missing in kernels/MANIFEST.toml);
        they still pass the self-check first. For developing kernels.
    QAB_PLUGINS: comma-separated allowlist of plugin (entry-point) names to
        load; unset loads all. The built-in plugin is named ``qwen``.
    QAB_GDN_CHUNK: chunk size of the chunked Gated DeltaNet prefill. Default 64.
    QAB_CACHE_DIR: where ``make demo`` caches its checkpoint. Default
        ``~/.cache/qwen-apple-backend``.
"""

from __future__ import annotations

import os
from pathlib import Path

FUSABLE_KINDS = ("moe", "gdn", "attn")
# Single optimizations inside a fused module kind, switchable for ablations.
OPTIMIZATIONS = {
    "gdn-kernel": "gdn",  # the GPU gated delta scan kernel (else chunked MLX ops)
    "moe-gemm": "moe",  # dequantize-then-grouped-GEMM experts for prefill
    "moe-kernel": "moe",  # the GPU MoE decode kernels (moe_gate_up_gemv, moe_down_gemv)
    "decode-compile": "model",  # the compiled one-token decode step (decode.py)
}


def _get(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def backend() -> str:
    return _get("QAB_BACKEND", "auto")


def disabled_kinds() -> frozenset[str]:
    """Module kinds forced to stock, and optimizations switched off, by ``QAB_DISABLE``.

    Raises:
        ValueError: if a name is not one of ``moe``, ``gdn``, ``attn``,
            ``all`` or an optimization name (``gdn-kernel``, ``moe-gemm``, ``decode-compile``).
    """
    raw = _get("QAB_DISABLE", "")
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(FUSABLE_KINDS)
    unknown = names - set(FUSABLE_KINDS) - set(OPTIMIZATIONS)
    if unknown:
        raise ValueError(
            f"QAB_DISABLE: unknown module kind(s) {sorted(unknown)}; "
            f"expected a comma-separated subset of {list(FUSABLE_KINDS)}, "
            f"optimizations {list(OPTIMIZATIONS)}, or 'all'"
        )
    return frozenset(names)


def kernels_disabled() -> bool:
    return _get("QAB_DISABLE_KERNELS", "0") not in ("0", "false", "False")


# Optimizations that are off unless named in QAB_ENABLE (not yet measured to
# pay off on a GPU).
EXPERIMENTAL = ("decode-compile",)


def enabled_experimental() -> frozenset[str]:
    """Experimental optimizations switched on by ``QAB_ENABLE`` (comma-separated).

    Raises:
        ValueError: for a name that is not in :data:`EXPERIMENTAL`.
    """
    raw = _get("QAB_ENABLE", "")
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    unknown = names - set(EXPERIMENTAL)
    if unknown:
        raise ValueError(f"QAB_ENABLE: unknown optimization(s) {sorted(unknown)}; "
                         f"expected a comma-separated subset of {list(EXPERIMENTAL)}")
    return frozenset(names)


def unverified_kernels_allowed() -> bool:
    """``QAB_UNVERIFIED_KERNELS=1``: also build CUDA kernels not yet verified on a GPU."""
    return _get("QAB_UNVERIFIED_KERNELS", "0") not in ("0", "false", "False")


def plugin_allowlist() -> frozenset[str] | None:
    raw = _get("QAB_PLUGINS")
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def gdn_chunk_size() -> int:
    raw = _get("QAB_GDN_CHUNK", "64")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"QAB_GDN_CHUNK must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"QAB_GDN_CHUNK must be a positive integer, got {raw!r}")
    return value


def cache_dir() -> Path:
    raw = _get("QAB_CACHE_DIR")
    if raw:
        return Path(raw).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "qwen-apple-backend"
