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

    def bench_target(self, path_or_model: Any, *, label: Any = None, disable: Any = None,
                     prefill_step_size: Any = None, config: Any = None, tokenizer: Any = None,
                     extra: Any = None) -> Any:
        """A benchmark target (``qwen_apple_backend.bench.target.MLXTarget``) for this backend.

        Args:
            path_or_model (str | Path | nn.Module): a checkpoint directory (its model
                is loaded; its tokenizer only through ``tokenizer``), a Hugging Face
                repo id (loaded with :meth:`load`), or an in-memory stock mlx-lm
                model, fused in place for the fused backend (pass a copy to keep
                the original stock).
            label (str, optional): report name; default the backend name.
            disable (Iterable[str], optional): fused module kinds kept stock (ablations).
            prefill_step_size (int, optional): prefill chunk; default mlx-lm's (2048).
            config (dict, optional): ``config.json`` of an in-memory model (finds its adapter).
            tokenizer (optional): tokenizer to attach to the target.
            extra (dict, optional): more facts for the target's ``describe()``.

        Returns:
            MLXTarget: ready to measure.
        """
        from pathlib import Path

        from .. import envs
        from ..bench.target import MLXTarget, fuse_in_memory

        # None: the kinds QAB_DISABLE names, as load() does.
        kinds = envs.disabled_kinds() if disable is None else envs.check_disable(disable)
        if self.mlx_backend == "stock":
            kinds = frozenset()
        if isinstance(path_or_model, (str, Path)):
            kwargs = {"disable": kinds} if self.mlx_backend != "stock" else {}
            if Path(path_or_model).is_dir():
                from ..loader import load_model

                # The model only: the caller loads the tokenizer once for all backends.
                model, _, _ = load_model(Path(path_or_model), self.mlx_backend, **kwargs)
            else:
                model, tok = self.load(str(path_or_model), **kwargs)
                tokenizer = tokenizer if tokenizer is not None else tok
        else:
            model = path_or_model
            fuse_in_memory(model, self.mlx_backend, config=config, disable=kinds)
        return MLXTarget(model, label=label or self.name, backend=self.name,
                         prefill_step_size=prefill_step_size, tokenizer=tokenizer,
                         disable=kinds, extra=extra)
