"""The ``fused`` backend: Qwen fused modules where a plugin claims the architecture."""

from __future__ import annotations

from .base import MLXBackend


class FusedBackend(MLXBackend):
    name = "fused"
    mlx_backend = "fused"
