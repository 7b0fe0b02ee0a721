"""The adapter contract: what a plugin's architecture target must provide.

A registry target (``"module:attr"``) names a class (or instance) with these
methods. Subclass :class:`Adapter` to get the defaults: stock mlx-lm classes,
no config fixes, nothing fused.
"""

from __future__ import annotations

from typing import Any, Tuple

from ..report import FuseReport


class Adapter:
    """Base adapter: builds the stock mlx-lm model, then optionally fuses it.

    Third-party plugins override :meth:`fuse` (and, if needed,
    :meth:`prepare_config` / :meth:`get_model_classes`).
    """

    #: Human-readable name shown by ``qab backends``.
    name = "stock"

    def prepare_config(self, config: dict, report: FuseReport) -> dict:
        """Return config overrides to apply before the model is built.

        Args:
            config (dict): the parsed ``config.json`` (not to be mutated).
            report (FuseReport): append human-readable notes for fixes applied.

        Returns:
            dict: top-level keys to replace in the config (may be empty).

        Raises:
            UnsupportedConfigError: if the config cannot be built.
        """
        return {}

    def get_model_classes(self, config: dict) -> Tuple[type, type]:
        """Return ``(Model, ModelArgs)`` for ``config`` (mlx-lm's own by default)."""
        from mlx_lm.utils import _get_classes

        return _get_classes(config)

    def fuse(self, model: Any, config: dict, *, disable: frozenset = frozenset(),
             use_fallback: bool = True, report: FuseReport) -> None:
        """Swap submodules of ``model`` in place for fused ones.

        Args:
            model (nn.Module): the loaded stock mlx-lm model.
            config (dict): the model config as loaded.
            disable (frozenset[str]): module kinds to keep stock (``moe``, ``gdn``, ``attn``).
            use_fallback (bool): keep the stock module when one cannot be fused
                (True) or raise :class:`~qwen_apple_backend.errors.FuseError` (False).
            report (FuseReport): record each module's fate here.
        """
        return None
