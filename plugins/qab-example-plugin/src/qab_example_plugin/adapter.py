"""The example adapter: stock mlx-lm llama, MLPs wrapped in a call counter."""

from __future__ import annotations

import mlx.nn as nn

from qwen_apple_backend.models.base import Adapter
from qwen_apple_backend.report import ModuleRecord


class CountingMLP(nn.Module):
    """Calls the wrapped MLP unchanged and counts the calls."""

    calls = 0

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        CountingMLP.calls += 1
        return self.inner(x)


class CountingLlamaAdapter(Adapter):
    name = "example-counting-llama"

    def fuse(self, model, config, *, disable=frozenset(), use_fallback=True, report):
        for i, layer in enumerate(model.layers):
            stock = layer.mlp
            layer.mlp = CountingMLP(stock)
            report.modules.append(ModuleRecord(f"model.layers.{i}.mlp", "mlp",
                                               type(stock).__name__, "CountingMLP"))
