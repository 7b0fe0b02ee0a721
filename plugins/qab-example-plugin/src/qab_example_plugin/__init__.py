"""A minimal third-party plugin for qwen-apple-backend.

It claims the ``llama`` architecture with an adapter that keeps mlx-lm's own
modules but wraps each decoder layer's MLP in a call counter — enough to show
discovery, precedence and the adapter contract. Install it with
``pip install plugins/qab-example-plugin`` and run ``qab backends``.
"""

from __future__ import annotations

from qwen_apple_backend import hookimpl


@hookimpl
def qab_register_architectures(register):
    register("llama", "qab_example_plugin.adapter:CountingLlamaAdapter",
             description="example: stock llama with counted MLP calls")
