"""Exceptions raised by qwen-apple-backend.

Each one subclasses the builtin a caller would already catch (``KeyError``,
``ValueError``, ``FileNotFoundError``), so code written for mlx-lm keeps working.
"""

from __future__ import annotations


class QABError(Exception):
    """Base class of every error raised by this package."""


class UnknownArchitectureError(QABError, KeyError):
    """No registered plugin claims this architecture name (``model_type``)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown architecture"


class UnknownBackendError(QABError, KeyError):
    """No registered backend has this name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown backend"


class EnvVarError(QABError, ValueError):
    """An environment variable (``QAB_*``) has a value this package cannot use.

    The message starts with the variable's name and lists the accepted values.
    """


class PluginLoadError(QABError, ImportError):
    """A plugin the user asked for by name could not be imported."""


class UnknownPluginError(PluginLoadError, EnvVarError):
    """``QAB_PLUGINS`` names a plugin that no installed distribution provides.

    The message names the variable, the unknown names and the available plugins.
    """


class CheckpointError(QABError, ValueError):
    """A checkpoint's files, keys or config are missing, corrupt or inconsistent.

    The message names the file, key or config field at fault.
    """


class MissingCheckpointFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs (config, weights, index shard) is absent."""


class UnsupportedConfigError(CheckpointError):
    """The config asks for something the fused path cannot do (e.g. unknown layer_types)."""


class FuseError(QABError, RuntimeError):
    """A module could not be fused and ``use_fallback=False`` was requested."""


class PromptError(QABError, ValueError):
    """The prompt is empty or longer than the model's ``max_position_embeddings``."""


class UnknownTaskError(QABError, ValueError):
    """A task ``pipeline()`` does not implement; the message lists the supported tasks."""


class UnsupportedArgumentError(QABError, TypeError):
    """A keyword argument the function does not take; the message lists the supported ones."""


class InvalidInputError(QABError, ValueError):
    """Pipeline inputs or generation settings of the wrong shape, type or range
    (e.g. a chat message without ``role``); the message names the bad item."""


class BackendCapabilityError(QABError, RuntimeError):
    """A registered backend cannot do what was asked here (not available on this
    machine, or it cannot generate text for the pipeline); the message says why."""


class ServeStartupError(QABError, RuntimeError):
    """``qab serve`` could not start: the model did not load or the port cannot be bound."""
