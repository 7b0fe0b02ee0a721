"""Architecture and backend registry: names mapped to ``"module:attr"`` strings.

Targets are stored as strings and imported only when resolved, so listing what
is available (``qab backends``) imports no MLX code. This module imports only
the standard library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from .errors import UnknownArchitectureError, UnknownBackendError

#: Priority the built-in plugin registers with; any third-party registration of
#: the same name (default priority 0) wins over it.
BUILTIN_PRIORITY = -100

#: Backends that come from the optional plugins shipped in this repository's
#: ``plugins/`` folder, with what to install: an unknown-backend error names it.
OPTIONAL_PLUGIN_BACKENDS = {"llama.cpp": "plugins/qab-llamacpp (from this project's source tree)"}


@dataclass(frozen=True)
class Entry:
    """One registration: ``name`` handled by ``target`` from ``plugin``."""

    name: str
    target: str
    plugin: str
    description: str = ""
    priority: int = 0
    order: int = 0

    def load(self) -> Any:
        """Import and return the object named by ``target``.

        Raises:
            ImportError: if the module cannot be imported.
            AttributeError: if the module has no such attribute.
        """
        return import_target(self.target)


def import_target(target: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute.

    Raises:
        ValueError: if ``target`` is not of the form ``module:attr``.
        ImportError, AttributeError: as raised by the import.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"registry target must look like 'package.module:attr', got {target!r}")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _check_target(target: str) -> None:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"registry target must look like 'package.module:attr', got {target!r}")


@dataclass
class Registry:
    """Names (architectures, backends) to ``"module:attr"`` targets."""

    architectures: dict[str, list[Entry]] = field(default_factory=dict)
    backends: dict[str, list[Entry]] = field(default_factory=dict)
    _counter: int = 0

    def _add(self, table: dict[str, list[Entry]], name: str, target: str, plugin: str,
             description: str, priority: int) -> Entry:
        if not isinstance(name, str) or not name:
            raise ValueError(f"plugin {plugin!r} registered an empty or non-string name: {name!r}")
        _check_target(target)
        self._counter += 1
        entry = Entry(name, target, plugin, description, priority, self._counter)
        table.setdefault(name, []).append(entry)
        return entry

    def add_architecture(self, name: str, target: str, plugin: str, description: str = "",
                         priority: int = 0) -> Entry:
        return self._add(self.architectures, name, target, plugin, description, priority)

    def add_backend(self, name: str, target: str, plugin: str, description: str = "",
                    priority: int = 0) -> Entry:
        return self._add(self.backends, name, target, plugin, description, priority)

    @staticmethod
    def _winner(entries: list[Entry]) -> Entry:
        # Highest priority first; among equals the latest registration wins,
        # like pluggy's last-registered-first call order.
        return max(entries, key=lambda e: (e.priority, e.order))

    def architecture(self, name: str) -> Optional[Entry]:
        entries = self.architectures.get(name)
        return self._winner(entries) if entries else None

    def backend(self, name: str, also: Iterable[str] = ()) -> Entry:
        """The entry that wins for backend ``name``.

        Args:
            also: names the caller takes besides the registered backends (``"auto"``),
                listed first in the error for an unknown name.

        Raises:
            UnknownBackendError: if no plugin registered it.
        """
        entries = self.backends.get(name)
        if not entries:
            also = list(also)
            known = ", ".join([*also, *sorted(self.backends)]) or "none"
            hint = ""
            if name in OPTIONAL_PLUGIN_BACKENDS:
                hint = (f" ({name!r} comes from an optional plugin: "
                        f"pip install {OPTIONAL_PLUGIN_BACKENDS[name]})")
            raise UnknownBackendError(
                f"unknown backend {name!r}; {'available' if also else 'registered backends'}: "
                f"{known}{hint}")
        return self._winner(entries)

    def require_architecture(self, name: str) -> Entry:
        """Like :meth:`architecture` but raises when nothing claims ``name``.

        Raises:
            UnknownArchitectureError: if no plugin registered ``name``.
        """
        entry = self.architecture(name)
        if entry is None:
            known = ", ".join(sorted(self.architectures)) or "none"
            raise UnknownArchitectureError(
                f"no plugin claims architecture {name!r}; registered: {known}")
        return entry

    def iter_architectures(self) -> Iterator[Entry]:
        for name in sorted(self.architectures):
            yield from sorted(self.architectures[name], key=lambda e: (-e.priority, -e.order))

    def iter_backends(self) -> Iterator[Entry]:
        for name in sorted(self.backends):
            yield from sorted(self.backends[name], key=lambda e: (-e.priority, -e.order))


def candidate_architectures(config: dict) -> list[str]:
    """Architecture names a config answers to, most specific first.

    Order: ``model_type``, ``text_config.model_type``, then ``architectures[]``.
    Duplicates are dropped.
    """
    names: list[str] = []

    def add(value: Any) -> None:
        if isinstance(value, str) and value and value not in names:
            names.append(value)

    add(config.get("model_type"))
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        add(text_config.get("model_type"))
    archs: Iterable[Any] = config.get("architectures") or ()
    if isinstance(archs, str):
        archs = (archs,)
    for arch in archs:
        add(arch)
    return names
