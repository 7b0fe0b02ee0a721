"""Adapter for dense ``qwen3_5`` (Qwen3.5 dense: Gated DeltaNet + gated attention + MLP).

Same loader fixes as the MoE adapter; the dense MLP stays stock.
"""

from __future__ import annotations

from mlx_lm.models import qwen3_5 as stock

from ._hybrid import QwenHybridAdapter, sanitize_checked


class Model(stock.Model):
    """``mlx_lm.models.qwen3_5.Model`` with validated ``sanitize``."""

    def sanitize(self, weights):
        n = self.language_model.args.num_experts
        return sanitize_checked(self, weights, n, super().sanitize)


class Adapter(QwenHybridAdapter):
    name = "qwen3_5"
    stock_module = "qwen3_5"
    required_fields = QwenHybridAdapter.required_fields + ("intermediate_size",)

    def model_class(self, config: dict) -> type:
        return Model
