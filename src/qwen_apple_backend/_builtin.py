"""The built-in plugin: Qwen3.5 / Qwen3.6 / Qwen3-Next fused builders and the
``stock`` and ``fused`` backends.

Registered through the ``qwen_apple_backend`` entry-point group like any
third-party plugin (see ``pyproject.toml``). It registers with
``BUILTIN_PRIORITY`` so a third-party plugin claiming the same name wins.
Targets are strings: nothing here imports MLX.
"""

from __future__ import annotations

from .hookspecs import hookimpl
from .registry import BUILTIN_PRIORITY

#: architecture name -> (adapter target, description)
ARCHITECTURES = {
    "qwen3_5_moe": ("qwen_apple_backend.models.qwen3_5_moe:Adapter",
                    "Qwen3.5/3.6 MoE (e.g. Qwen3.6-35B-A3B): fused MoE, Gated DeltaNet, GQA"),
    "qwen3_5_moe_text": ("qwen_apple_backend.models.qwen3_5_moe:Adapter",
                         "Qwen3.5/3.6 MoE, text-only config"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen_apple_backend.models.qwen3_5_moe:Adapter",
                                           "Qwen3.5/3.6 MoE (HF architecture name)"),
    "Qwen3_5MoeForCausalLM": ("qwen_apple_backend.models.qwen3_5_moe:Adapter",
                              "Qwen3.5/3.6 MoE text model (HF architecture name)"),
    "qwen3_5": ("qwen_apple_backend.models.qwen3_5:Adapter",
                "dense Qwen3.5: fused Gated DeltaNet and GQA, stock MLP"),
    "qwen3_5_text": ("qwen_apple_backend.models.qwen3_5:Adapter",
                     "dense Qwen3.5, text-only config"),
    "Qwen3_5ForConditionalGeneration": ("qwen_apple_backend.models.qwen3_5:Adapter",
                                        "dense Qwen3.5 (HF architecture name)"),
    "qwen3_next": ("qwen_apple_backend.models.qwen3_next:Adapter",
                   "Qwen3-Next: fused MoE, Gated DeltaNet, GQA"),
    "Qwen3NextForCausalLM": ("qwen_apple_backend.models.qwen3_next:Adapter",
                             "Qwen3-Next (HF architecture name)"),
}

BACKENDS = {
    "stock": ("qwen_apple_backend.backends.mlx_stock:StockBackend",
              "plain mlx-lm layers (the reference every other backend is compared to)"),
    "fused": ("qwen_apple_backend.backends.fused:FusedBackend",
              "Qwen-specific fused modules on MLX; stock mlx-lm for other architectures"),
}


@hookimpl
def qab_register_architectures(register):
    for name, (target, description) in ARCHITECTURES.items():
        register(name, target, description=description, priority=BUILTIN_PRIORITY)


@hookimpl
def qab_register_backends(register):
    for name, (target, description) in BACKENDS.items():
        register(name, target, description=description, priority=BUILTIN_PRIORITY)
