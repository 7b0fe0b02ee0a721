"""Identity records of a module tree, for traces that hold its arrays as constants.

The compiled decode step (``decode.py``, ``decode-const``) traces the model
with its parameters as trace constants instead of compile inputs: MLX then
neither flattens the model's tree nor binds ~1,600 input arrays on every
token. Such a trace is right only while the model still holds the very
arrays it was traced with. :class:`ParameterRecord` remembers every array,
module, dict and list of the tree by identity and checks them in a few
C-level passes; a replaced array or module (``load_weights``, ``update``,
a LoRA wrapper, an assignment) fails the check and the step is rebuilt.

MLX re-wraps a module's arrays in new Python objects (the same arrays)
whenever a function compiled with ``inputs=module`` traces (the fused layers'
own eager compiled paths, once per new shape). :func:`compile_watched`
compiles such functions so that a call that re-wraps updates the record:
only the slots that held, before the call, the object the record expects.
A user's replacement made before that call stays a mismatch.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

__all__ = ["ParameterRecord", "compile_watched"]

_GET = operator.getitem
_IS = operator.is_
#: The instance attribute through which a module finds the record that watches it.
_ATTR = "_qab_record"


class ParameterRecord:
    """Every array and container of a module tree, by identity.

    Containers are ``nn.Module`` s and the dicts, lists and tuples of the
    tree (mlx's ``Module.parameters()`` structure); :meth:`valid` is true
    while every recorded slot ``container[key]`` still holds the recorded
    object, every recorded module is still of its type and every dict and
    list still has its length (an array added to a module counts as a
    change). An array changed in place (``w *= c``, ``w[...] = v``: MLX
    swaps the array inside the same Python object) is NOT seen.

    Args:
        root (nn.Module): the tree's root (the text model).
    """

    def __init__(self, root: Any):
        self.containers: list = []  # the array slots: container, key, object
        self.keys: list = []
        self.expected: list = []
        self.node_containers: list = []  # the container slots
        self.node_keys: list = []
        self.nodes: list = []
        self.node_types: list = []
        self.sized: list = []  # dicts and lists, with their lengths
        self.lengths: list = []
        #: ``id(module)`` -> ``(lo, hi)``: the module's subtree's array slots
        #: (modules whose subtree holds a tuple left out: MLX rebuilds a
        #: tuple when it re-wraps, which :meth:`rewrapped` does not follow,
        #: so such a module's traces count as changes: a rebuild, never a
        #: stale step).
        self.spans: dict = {}
        self._walk(root)
        self.sized.append(root)
        self.lengths.append(len(root))

    def _walk(self, node: Any) -> bool:
        """Record ``node``'s subtree; whether it holds a tuple."""
        lo = len(self.expected)
        tuples = isinstance(node, tuple)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, mx.array):
                self.containers.append(node)
                self.keys.append(key)
                self.expected.append(value)
            elif isinstance(value, (dict, list, tuple)):
                self.node_containers.append(node)
                self.node_keys.append(key)
                self.nodes.append(value)
                self.node_types.append(type(value))
                if not isinstance(value, tuple):
                    self.sized.append(value)
                    self.lengths.append(len(value))
                tuples = self._walk(value) or tuples
        if isinstance(node, nn.Module) and not tuples:
            self.spans[id(node)] = (lo, len(self.expected))
        return tuples

    @property
    def size(self) -> int:
        """Entries checked by :meth:`valid` (arrays, containers, lengths)."""
        return len(self.expected) + len(self.nodes) + len(self.sized)

    def valid(self) -> bool:
        """Whether the tree still holds every recorded object (see the class doc)."""
        try:
            return (all(map(_IS, map(_GET, self.node_containers, self.node_keys), self.nodes))
                    and all(map(_IS, map(type, self.nodes), self.node_types))
                    and list(map(len, self.sized)) == self.lengths
                    and all(map(_IS, map(_GET, self.containers, self.keys), self.expected)))
        except (KeyError, IndexError, TypeError):
            return False

    def watch(self) -> None:
        """Let every module of the tree find this record (:func:`compile_watched`)."""
        ref = weakref.ref(self)
        for node in self.nodes:
            if isinstance(node, nn.Module):
                object.__setattr__(node, _ATTR, ref)

    def _current(self, lo: int, hi: int) -> Optional[list]:
        try:
            return list(map(_GET, self.containers[lo:hi], self.keys[lo:hi]))
        except (KeyError, IndexError, TypeError):
            return None

    def rewrapped(self, span: tuple, before: Optional[list]) -> None:
        """Take the objects of ``span``'s slots after a call that may have
        re-wrapped them, where the slot held before the call the object
        recorded (``before``: the slots' objects then)."""
        lo, hi = span
        after = self._current(lo, hi)
        if before is None or after is None:
            return
        expected = self.expected
        for i, (b, a) in enumerate(zip(before, after), lo):
            if a is not b and expected[i] is b:
                expected[i] = a


def compile_watched(module: nn.Module, fun: Callable) -> Callable:
    """``mx.compile(fun, inputs=module)`` that keeps a :class:`ParameterRecord` of a
    tree holding ``module`` (:meth:`ParameterRecord.watch`) current when a
    call re-wraps ``module``'s arrays (a trace).

    Without a watching record the call is the compiled function's, plus one
    dict lookup.
    """
    compiled = mx.compile(fun, inputs=module)

    def call(*args):
        ref = module.__dict__.get(_ATTR)
        record = None if ref is None else ref()
        span = None if record is None else record.spans.get(id(module))
        if span is None:
            return compiled(*args)
        before = record._current(*span)
        out = compiled(*args)
        record.rewrapped(span, before)
        return out

    return call
