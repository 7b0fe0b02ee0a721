"""The backend contract shared by ``stock``, ``fused`` and plugin backends (``llama.cpp``).

A backend is registered by name through the ``qab_register_backends`` hook as a
``"module:attr"`` string naming a class with this interface. Backends must not
import heavy dependencies at module import time: :meth:`Backend.available`
says, cheaply, whether it can run here and why not.
"""

from __future__ import annotations

from typing import Any, Protocol, Tuple, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """Interface of a text-generation backend.

    Attributes:
        name: registry name (``"stock"``, ``"fused"``, ``"llama.cpp"``, ...).
    """

    name: str

    def available(self) -> Tuple[bool, str]:
        """Return ``(True, "")`` if usable here, else ``(False, reason)``."""
        ...

    def load(self, path: str, **kwargs: Any) -> Tuple[Any, Any]:
        """Load a checkpoint; return ``(model, tokenizer)`` in the backend's own types."""
        ...


def _mlx_available() -> Tuple[bool, str]:
    try:
        import mlx.core as mx  # noqa: F401
        import mlx_lm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return False, f"mlx / mlx-lm not importable: {type(exc).__name__}: {exc}"
    return True, ""


class MLXBackend:
    """Shared implementation of the two MLX backends."""

    name = ""
    mlx_backend = "auto"

    def available(self) -> Tuple[bool, str]:
        return _mlx_available()

    def load(self, path: str, **kwargs: Any):
        from ..loader import load

        return load(path, self.mlx_backend, **kwargs)
