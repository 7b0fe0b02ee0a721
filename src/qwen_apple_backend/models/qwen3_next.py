"""Adapter for ``qwen3_next`` (Qwen3-Next: Gated DeltaNet + gated attention + MoE)."""

from __future__ import annotations

from mlx_lm.models import qwen3_next as stock

from ._hybrid import QwenHybridAdapter, sanitize_checked


class Model(stock.Model):
    """``mlx_lm.models.qwen3_next.Model`` with validated ``sanitize``."""

    def sanitize(self, weights):
        # Stock qwen3_next already stacks per-expert keys; only validate here.
        return sanitize_checked(self, weights, 0, super().sanitize)


class Adapter(QwenHybridAdapter):
    name = "qwen3_next"
    stock_module = "qwen3_next"

    def model_class(self, config: dict) -> type:
        return Model
