"""Backends by name: ``get_backend("fused")`` returns an instance from the registry."""

from __future__ import annotations

from typing import Any


def get_backend(name: str) -> Any:
    """Instantiate the backend registered under ``name``.

    Raises:
        UnknownBackendError: if no plugin registered ``name``.
    """
    from ..plugins import get_registry

    obj = get_registry().backend(name).load()
    return obj() if isinstance(obj, type) else obj
