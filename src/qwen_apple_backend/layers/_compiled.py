"""``mx.compile(fn, inputs=module)`` that leaves the module's array objects as they were.

A compiled function with a captured module swaps the module's arrays for
tracers while it traces and then puts back *new Python objects* for the same
arrays (MLX's ``tree_replace``). Nothing changes numerically, but code that
tells replaced parameters apart by object identity (the compiled decode step's
check, ``decode._Snapshot``; ``ConcatProjection.valid``) would take every
trace for a replaced weight. :class:`ModuleCompiled` records the module's
array slots before a call that may trace (input shapes and dtypes not seen
before, or any call inside another function's trace, :func:`outer_trace`: MLX
runs a compiled function called inside a trace as a plain call, which re-wraps
too) and puts the original objects back after it; replays (seen shapes)
touch nothing, so they cost one tuple and one set lookup more than the bare
compiled function.

A trace this misses (the module's own arrays changed shape or dtype under
inputs seen before) leaves the new objects: identity checks then report a
change, which costs a rebuild, never a wrong result.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import mlx.core as mx

__all__ = ["ModuleCompiled", "array_slots", "outer_trace", "put_back"]

_OUTER = [0]  # depth of outer_trace() blocks


@contextlib.contextmanager
def outer_trace() -> Iterator[None]:
    """Mark a block that traces a compiled function calling :class:`ModuleCompiled` ones."""
    _OUTER[0] += 1
    try:
        yield
    finally:
        _OUTER[0] -= 1


def array_slots(module: Any) -> list:
    """``(container, key, array)`` for every array under ``module`` (dicts, lists, tuples)."""
    out, stack = [], [module]
    while stack:
        c = stack.pop()
        items = dict.items(c) if isinstance(c, dict) else enumerate(c)
        for k, v in items:
            if isinstance(v, mx.array):
                out.append((c, k, v))
            elif isinstance(v, (dict, list)):
                stack.append(v)
            elif isinstance(v, tuple):
                stack.append(v)  # read-only: a traced tuple is rebuilt, see put_back
    return out


def put_back(slots: list) -> None:
    """Store each recorded array object back into its slot where another object sits now."""
    for c, k, v in slots:
        if isinstance(c, tuple):
            continue  # MLX replaces tuples whole; nothing of ours holds arrays in tuples
        if (dict.get(c, k) if isinstance(c, dict) else c[k]) is not v:
            if isinstance(c, dict):
                dict.__setitem__(c, k, v)
            else:
                c[k] = v


class ModuleCompiled:
    """``mx.compile(fn, inputs=module)``, called like it, with ``module``'s array objects kept.

    Args:
        module (nn.Module): the captured input tree (parameters replaced later
            are read live, as with ``inputs=module``).
        fn (Callable): the function to compile (arrays and constants in,
            arrays out).
    """

    def __init__(self, module: Any, fn: Callable):
        self._module = module
        self._fn = mx.compile(fn, inputs=module)
        self._seen: set = set()

    def __call__(self, *args):
        key = tuple((a.shape, a.dtype) if isinstance(a, mx.array) else a for a in args)
        if key in self._seen and not _OUTER[0]:
            return self._fn(*args)
        slots = array_slots(self._module)
        try:
            return self._fn(*args)
        finally:
            put_back(slots)
            self._seen.add(key)
