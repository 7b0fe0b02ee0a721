"""What a fused load replaced, and why the rest stayed stock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
        modules: one :class:`ModuleRecord` per swappable submodule.
        notes: loader fixes applied (e.g. derived ``full_attention_interval``).
    """

    backend: str
    architecture: Optional[str] = None
    adapter: Optional[str] = None
    plugin: Optional[str] = None
    modules: list[ModuleRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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
        """A few human-readable lines (printed by the CLI with ``--verbose``)."""
        head = f"backend={self.backend}"
        if self.architecture is None:
            return head + ": architecture not claimed by any plugin; stock mlx-lm model"
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
