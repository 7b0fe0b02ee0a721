"""Adapter for ``qwen3_5_moe`` (Qwen3.5 / Qwen3.6 MoE, e.g. Qwen3.6-35B-A3B).

Builds mlx-lm's own ``mlx_lm.models.qwen3_5_moe`` model with three loader gaps
closed — text-only ``qwen3_5_moe_text`` configs, per-expert checkpoint keys,
``full_attention_interval`` derived from ``layer_types`` — then swaps in the
fused MoE, Gated DeltaNet and attention modules.
"""

from __future__ import annotations

from mlx_lm.models import qwen3_5_moe as stock

from ._hybrid import QwenHybridAdapter, sanitize_checked


class Model(stock.Model):
    """``mlx_lm.models.qwen3_5_moe.Model`` whose ``sanitize`` also accepts per-expert keys
    and validates expert counts and quantization shapes."""

    def sanitize(self, weights):
        n = self.language_model.args.num_experts
        return sanitize_checked(self, weights, n, super().sanitize)


class Adapter(QwenHybridAdapter):
    name = "qwen3_5_moe"
    stock_module = "qwen3_5_moe"
    required_fields = QwenHybridAdapter.required_fields + (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size")

    def model_class(self, config: dict) -> type:
        return Model
