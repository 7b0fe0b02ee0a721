"""qwen-apple-backend: fused Qwen3.5/3.6 modules for mlx-lm, discovered through pluggy.

Public names are imported lazily so ``import qwen_apple_backend`` stays cheap and
pulls in neither MLX nor mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"


def _drop_transformers_torch_advisory() -> None:
    """Drop transformers' import-time advisory "PyTorch was not found. Models won't be
    available ..." (``logger.warning_advice`` on the ``transformers`` logger): this package
    uses transformers for tokenizers only, so without torch the line is noise on every
    command. Only that one message is dropped; every other transformers log line stays."""
    import logging

    class _NoTorchAdvisory(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("PyTorch was not found.")

    logger = logging.getLogger("transformers")
    if not any(type(f).__name__ == "_NoTorchAdvisory" for f in logger.filters):
        logger.addFilter(_NoTorchAdvisory())


_drop_transformers_torch_advisory()

_LAZY = {
    "hookimpl": ("qwen_apple_backend.hookspecs", "hookimpl"),
    "hookspec": ("qwen_apple_backend.hookspecs", "hookspec"),
    "load": ("qwen_apple_backend.loader", "load"),
    "enable": ("qwen_apple_backend.loader", "enable"),
    "disable": ("qwen_apple_backend.loader", "disable"),
    "get_report": ("qwen_apple_backend.loader", "get_report"),
    "FuseReport": ("qwen_apple_backend.report", "FuseReport"),
    "pipeline": ("qwen_apple_backend.pipeline", "pipeline"),
    "TextStreamer": ("qwen_apple_backend.pipeline", "TextStreamer"),
    "get_plugin_manager": ("qwen_apple_backend.plugins", "get_plugin_manager"),
    "load_plugins": ("qwen_apple_backend.plugins", "load_plugins"),
}
# The exceptions (qwen_apple_backend.errors), e.g. ``from qwen_apple_backend import
# UnknownTaskError``.
_LAZY.update((name, ("qwen_apple_backend.errors", name)) for name in (
    "QABError", "BackendCapabilityError", "CheckpointError", "EnvVarError", "FuseError",
    "InvalidInputError", "MissingCheckpointFileError", "PluginLoadError", "PromptError",
    "ServeStartupError", "UnknownArchitectureError", "UnknownBackendError", "UnknownPluginError",
    "UnknownTaskError", "UnsupportedArgumentError", "UnsupportedConfigError"))

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'qwen_apple_backend' has no attribute {name!r}") from None
    imported = importlib.import_module(module)
    value = getattr(imported, attr)
    globals()[name] = value
    # Importing a submodule binds it as an attribute of this package; where a lazy name
    # is that submodule's name (``pipeline``: the function), the export keeps the name.
    short = module.rpartition(".")[2]
    if _LAZY.get(short, (None,))[0] == module and short != name:
        globals()[short] = getattr(imported, _LAZY[short][1])
    return value


def __dir__() -> list[str]:
    return __all__
