"""Hook specifications for qwen-apple-backend plugins (pluggy).

A plugin is a module or object with functions decorated by ``hookimpl`` and
named after one of the specs below. It is discovered through the entry-point
group ``qwen_apple_backend`` (the built-in Qwen plugin is registered the same
way, in this package's ``pyproject.toml``)::

    [project.entry-points.qwen_apple_backend]
    my_plugin = "my_package.plugin"

Every hook name starts with ``qab_``. Targets are ``"module:attr"`` strings so
that nothing heavy (MLX, mlx-lm, kernels) is imported until a model of that
architecture is actually loaded.
"""

from __future__ import annotations

from typing import Callable, Optional

import pluggy

PROJECT_NAME = "qwen_apple_backend"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def qab_register_architectures(register: Callable[..., None]) -> None:
    """Declare the architectures this plugin can build fused models for.

    Call ``register(name, target, description="")`` once per architecture name,
    where ``name`` is an HF ``model_type`` (e.g. ``"qwen3_5_moe"``) or an
    ``architectures[]`` entry (e.g. ``"Qwen3_5MoeForConditionalGeneration"``),
    and ``target`` is a ``"module:attr"`` string naming an adapter class (see
    ``qwen_apple_backend.models.base.Adapter``). The target is imported only
    when a model of that architecture is loaded.

    Who implements it: any plugin. How results combine: every implementation
    is called; all registrations are kept (used by ``qab backends`` and as the
    fallback answer of :func:`qab_get_builder`).
    """


@hookspec(firstresult=True)
def qab_get_builder(architecture: str) -> Optional[str]:
    """Return the ``"module:attr"`` adapter that builds ``architecture``, or None.

    Called once per candidate architecture name of a config, in order:
    ``model_type``, ``text_config.model_type``, then each ``architectures[]``
    entry. ``firstresult``: the first non-None answer wins. The built-in plugin
    answers with ``trylast=True``, so a third-party plugin that claims the same
    name wins over it. Plugins that only call ``register`` in
    :func:`qab_register_architectures` need not implement this hook; the
    registry answers from those registrations afterwards.
    """


@hookspec
def qab_register_backends(register: Callable[..., None]) -> None:
    """Declare inference backends (``stock``, ``fused``, ``llama.cpp``, ...).

    Call ``register(name, target, description="")`` where ``target`` is a
    ``"module:attr"`` string naming a backend class following
    ``qwen_apple_backend.backends.base.Backend``.

    Who implements it: any plugin. How results combine: all are kept; a name
    registered twice keeps the first plugin that pluggy calls (third-party
    plugins are called before the built-in one).
    """
