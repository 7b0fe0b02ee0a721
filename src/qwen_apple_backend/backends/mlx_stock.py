"""The ``stock`` backend: plain mlx-lm modules (loader gaps closed, nothing fused)."""

from __future__ import annotations

from .base import MLXBackend


class StockBackend(MLXBackend):
    name = "stock"
    mlx_backend = "stock"
