"""What a fused load replaced, and why the rest stayed stock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional


@dataclass
class ModuleRecord:
    """One swappable submodule of a loaded model.

    Attributes:
        path: dotted module path, e.g. ``language_model.model.layers.0.mlp``.
        kind: ``moe``, ``gdn``, ``attn`` or ``mlp``.
        stock: class name of the mlx-lm module that was built.
        fused: class name of the replacement, or None if it stayed stock.
        reason: why it stayed stock; for a fused module, the optimizations
            switched off in it (empty when none).
    """

    path: str
    kind: str
    stock: str
    fused: Optional[str] = None
    reason: str = ""


@dataclass
class FuseReport:
    """Result of :func:`qwen_apple_backend.load`: backend, adapter, and every module's fate.

    Attributes:
        backend: backend requested (``auto``, ``fused``, ``stock``).
        architecture: architecture name that matched, or None (stock mlx-lm).
        adapter: ``"module:attr"`` of the adapter used, or None.
        plugin: name of the plugin that supplied the adapter.
        modules: one :class:`ModuleRecord` per swappable submodule (attention,
            Gated DeltaNet / other mixers, MLP or MoE of each layer), fused or not;
            a model nothing was fused in lists each as stock with the reason.
        notes: loader fixes applied (e.g. derived ``full_attention_interval``).
    """

    backend: str
    architecture: Optional[str] = None
    adapter: Optional[str] = None
    plugin: Optional[str] = None
    modules: list[ModuleRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add_stock_modules(self, model: Any, reason: str) -> None:
        """Record every swappable submodule of ``model`` as stock, with ``reason``.

        Used for models nothing was fused in (an architecture no plugin claims,
        ``backend="stock"``, a model loaded without this package), so a report
        always lists each layer's attention / mixer / MLP modules and why they
        stayed stock.
        """
        for path, kind, module in swappable_modules(model):
            self.modules.append(ModuleRecord(path, kind, type(module).__name__, None, reason))

    @property
    def fused(self) -> list[ModuleRecord]:
        return [m for m in self.modules if m.fused]

    @property
    def stock(self) -> list[ModuleRecord]:
        return [m for m in self.modules if not m.fused]

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per kind: (number fused, number total)."""
        out: dict[str, tuple[int, int]] = {}
        for m in self.modules:
            f, t = out.get(m.kind, (0, 0))
            out[m.kind] = (f + (1 if m.fused else 0), t + 1)
        return out

    def summary(self) -> str:
        """A few human-readable lines (printed by ``qab generate|chat|serve --qab-report``)."""
        head = f"backend={self.backend}"
        if self.architecture is None:
            lines = [head + ": no fused modules; stock mlx-lm model"]
        else:
            lines = [f"{head} architecture={self.architecture} adapter={self.adapter} "
                     f"(plugin {self.plugin})"]
        for kind, (f, t) in sorted(self.counts().items()):
            fused_as = sorted({m.fused for m in self.modules if m.kind == kind and m.fused})
            reasons = sorted({m.reason for m in self.modules if m.kind == kind and not m.fused})
            line = f"  {kind}: {f}/{t} fused"
            if fused_as:
                line += f" -> {', '.join(fused_as)}"
            if reasons:
                line += f"; stock because: {'; '.join(reasons)}"
            lines.append(line)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "backend": self.backend, "architecture": self.architecture, "adapter": self.adapter,
            "plugin": self.plugin, "notes": list(self.notes),
            "modules": [m.__dict__.copy() for m in self.modules],
        }


#: Layer attributes that hold a swappable module, and the kind each is reported as.
_SWAPPABLE_ATTRS = (
    ("linear_attn", "gdn"), ("self_attn", "attn"), ("attention", "attn"), ("attn", "attn"),
    ("mixer", "mixer"), ("mlp", "mlp"), ("feed_forward", "mlp"), ("block_sparse_moe", "moe"),
)


def _is_moe(module: Any) -> bool:
    name = type(module).__name__.lower()
    return ("moe" in name or "sparse" in name or "switch_mlp" in module
            or "experts" in module) if hasattr(module, "__contains__") else "moe" in name


def _children(module: Any) -> dict:
    try:
        return dict(module.children())
    except Exception:  # noqa: BLE001 - not an mlx.nn.Module
        return {}


def swappable_modules(model: Any) -> Iterator[tuple[str, str, Any]]:
    """``(path, kind, module)`` for each layer's attention, mixer and MLP/MoE modules.

    Kinds are those of the fused reports: ``gdn``, ``attn``, ``moe``, ``mlp``
    (and ``mixer`` for other sequence mixers). Works on any mlx-lm model with a
    ``layers`` list (``model.layers``, ``model.model.layers`` or
    ``model.language_model.model.layers``).
    """
    layers = None
    for obj in (model, getattr(model, "model", None), getattr(model, "language_model", None),
                getattr(getattr(model, "language_model", None), "model", None)):
        candidate = getattr(obj, "layers", None) if obj is not None else None
        if isinstance(candidate, (list, tuple)):
            layers = candidate
            break
    if not layers:
        return
    try:
        names = {id(m): n for n, m in model.named_modules()}
    except Exception:  # noqa: BLE001
        names = {}
    for i, layer in enumerate(layers):
        base = names.get(id(layer), f"layers.{i}")
        children = _children(layer)
        for attr, kind in _SWAPPABLE_ATTRS:
            module = children.get(attr)
            if module is None or not callable(getattr(module, "children", None)):
                continue  # absent, or a list of modules rather than one
            if kind == "mlp" and _is_moe(module):
                kind = "moe"
            yield f"{base}.{attr}", kind, module
