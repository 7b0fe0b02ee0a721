"""Backends by name: ``get_backend("fused")`` returns an instance from the registry."""

from __future__ import annotations

from typing import Any, Iterable


def get_backend(name: str, also: Iterable[str] = ()) -> Any:
    """Instantiate the backend registered under ``name``.

    Args:
        also: names the caller takes besides the registered backends (``"auto"``), listed
            in the error for an unknown name.

    Raises:
        UnknownBackendError: if no plugin registered ``name``.
    """
    from ..plugins import get_registry

    obj = get_registry().backend(name, also).load()
    return obj() if isinstance(obj, type) else obj
