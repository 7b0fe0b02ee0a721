"""Plugin discovery: a pluggy ``PluginManager`` fed from entry points.

``load_plugins()`` is lazy and idempotent. Plugins come from the entry-point
group ``qwen_apple_backend`` and are loaded one by one with pluggy's
``load_setuptools_entrypoints(group, name=...)``, so a plugin that fails to
import is logged, recorded in :attr:`PluginState.failed` and skipped — unless
the user asked for it by name in ``QAB_PLUGINS``, in which case
:class:`~qwen_apple_backend.errors.PluginLoadError` is raised. A name in
``QAB_PLUGINS`` that no installed plugin has raises
:class:`~qwen_apple_backend.errors.UnknownPluginError` (an ``EnvVarError`` too),
listing the available plugins.

If the package runs from a source tree without installed metadata, the built-in
plugin is registered from its module name as a last resort (recorded as
``source="module"``), so the library keeps working.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import pluggy

from . import envs, hookspecs
from .errors import PluginLoadError, UnknownPluginError
from .registry import Registry, candidate_architectures

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
BUILTIN_NAME = "qwen"
BUILTIN_MODULE = "qwen_apple_backend._builtin"


@dataclass
class PluginInfo:
    """What ``qab backends`` shows for one plugin."""

    name: str
    source: str  # "entry point", "module" (built-in fallback) or "runtime"
    module: str
    distribution: Optional[str] = None
    version: Optional[str] = None


@dataclass
class PluginState:
    manager: pluggy.PluginManager
    registry: Registry
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


_state: Optional[PluginState] = None
_lock = threading.RLock()


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _collect(state: PluginState) -> None:
    """(Re)build the registry by calling each plugin's register hooks."""
    registry = Registry()
    pm = state.manager
    for hook_name, add in (("qab_register_architectures", registry.add_architecture),
                           ("qab_register_backends", registry.add_backend)):
        caller = getattr(pm.hook, hook_name)
        # Call implementations one by one (pluggy's order: last registered
        # first) so each registration is attributed to its plugin and one
        # broken plugin cannot hide the others.
        for impl in reversed(caller.get_hookimpls()):
            plugin_name = impl.plugin_name

            def register(name, target, description="", priority=0, _p=plugin_name, _add=add):
                _add(name, target, _p, description, priority)

            try:
                impl.function(register=register)
            except Exception as exc:  # noqa: BLE001 - report and skip the plugin
                msg = f"{hook_name} failed: {type(exc).__name__}: {exc}"
                logger.warning("qwen-apple-backend plugin %r skipped: %s", plugin_name, msg)
                state.failed[plugin_name] = msg
    state.registry = registry


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[Optional[str], Optional[str]]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def load_plugins(force: bool = False) -> PluginState:
    """Discover and register plugins once; return the shared state.

    Args:
        force (bool): discard the current state and discover again. Default False.

    Returns:
        PluginState: the plugin manager, registry, loaded and failed plugins.

    Raises:
        UnknownPluginError: (a ``PluginLoadError`` and an ``EnvVarError``) if
            ``QAB_PLUGINS`` names a plugin that is not installed.
        PluginLoadError: if a plugin named in ``QAB_PLUGINS`` fails to import.
    """
    global _state
    with _lock:
        if _state is not None and not force:
            return _state
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        allow = check_allowlist(eps)
        pm = _new_manager()
        state = PluginState(manager=pm, registry=Registry())
        seen = set()
        for ep in sorted(eps, key=lambda e: e.name):
            if ep.name in seen:
                continue
            seen.add(ep.name)
            if allow is not None and ep.name not in allow:
                continue
            try:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
            except Exception as exc:  # noqa: BLE001 - any import-time failure
                msg = f"{type(exc).__name__}: {exc}"
                if allow is not None:
                    raise PluginLoadError(
                        f"plugin {ep.name!r} (entry point {ep.value!r}) requested in "
                        f"QAB_PLUGINS failed to load: {msg}") from exc
                logger.warning("qwen-apple-backend plugin %r (%s) failed to load and was "
                               "skipped: %s", ep.name, ep.value, msg)
                state.failed[ep.name] = msg
                continue
            dist, version = _dist_of(ep)
            state.plugins[ep.name] = PluginInfo(ep.name, "entry point", ep.value, dist, version)
        if BUILTIN_NAME not in state.plugins and (allow is None or BUILTIN_NAME in allow):
            if pm.get_plugin(BUILTIN_NAME) is None:
                pm.register(importlib.import_module(BUILTIN_MODULE), name=BUILTIN_NAME)
                state.plugins[BUILTIN_NAME] = PluginInfo(BUILTIN_NAME, "module", BUILTIN_MODULE)
        _collect(state)
        _state = state
        return state


def check_allowlist(eps=None) -> Optional[frozenset[str]]:
    """``QAB_PLUGINS`` checked against the installed plugin names, importing no plugin.

    Args:
        eps (Iterable[importlib.metadata.EntryPoint], optional): the entry points
            of group ``qwen_apple_backend``; default: discovered here.

    Returns:
        frozenset[str] | None: the allowlist, or None when ``QAB_PLUGINS`` is unset.

    Raises:
        UnknownPluginError: (an ``EnvVarError``) naming ``QAB_PLUGINS``, the names
            no installed distribution provides and the available plugins.
    """
    allow = envs.plugin_allowlist()
    if allow is None:
        return None
    if eps is None:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    # The built-in plugin is always available (from its module name, as a last resort).
    available = sorted({ep.name for ep in eps} | {BUILTIN_NAME})
    missing = sorted(allow - set(available))
    if missing:
        names = ", ".join(repr(n) for n in missing)
        plural = "s" if len(missing) > 1 else ""
        raise UnknownPluginError(
            f"QAB_PLUGINS: unknown plugin{plural} {names} (available: {', '.join(available)})")
    return allow


def register_plugin(plugin: object, name: Optional[str] = None) -> str:
    """Register a plugin object at run time (tests, notebooks) and rebuild the registry.

    Args:
        plugin (object): a module or object with ``hookimpl``-decorated functions.
        name (str, optional): plugin name; defaults to pluggy's canonical name.

    Returns:
        str: the name it was registered under.
    """
    with _lock:
        state = load_plugins()
        registered = state.manager.register(plugin, name=name)
        if registered is None:
            raise ValueError(f"plugin {name or plugin!r} is already registered")
        name = state.manager.get_name(plugin)
        state.plugins[name] = PluginInfo(name, "runtime", getattr(plugin, "__name__", repr(plugin)))
        _collect(state)
        return name


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin`."""
    with _lock:
        state = load_plugins()
        state.manager.unregister(name=name)
        state.plugins.pop(name, None)
        _collect(state)


def get_plugin_manager() -> pluggy.PluginManager:
    """The shared pluggy ``PluginManager`` (plugins loaded on first use)."""
    return load_plugins().manager


def get_registry() -> Registry:
    """The shared registry of architectures and backends."""
    return load_plugins().registry


def resolve_architecture(config: dict):
    """Find the adapter entry for a model config, or None for stock mlx-lm.

    Candidate names are tried in the order of
    :func:`~qwen_apple_backend.registry.candidate_architectures`; for each, the
    ``qab_get_builder`` hook is asked first (first non-None answer wins), then
    the registrations.

    Returns:
        tuple[str, Entry] | None: the matched name and its winning entry.
    """
    state = load_plugins()
    for name in candidate_architectures(config):
        target = state.manager.hook.qab_get_builder(architecture=name)
        if target:
            from .registry import Entry

            return name, Entry(name, target, "qab_get_builder", "dynamic answer", 1 << 30, 0)
        entry = state.registry.architecture(name)
        if entry is not None:
            return name, entry
    return None


def reset() -> None:
    """Forget loaded plugins (tests)."""
    global _state
    with _lock:
        _state = None


__all__ = [
    "ENTRY_POINT_GROUP", "PluginInfo", "PluginState", "check_allowlist", "get_plugin_manager",
    "get_registry", "load_plugins", "register_plugin", "resolve_architecture", "reset",
    "unregister_plugin",
]
