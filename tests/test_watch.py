"""layers/_watch.py: the identity record behind decode-const's trace constants."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from qwen_apple_backend.layers._watch import ParameterRecord, compile_watched


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.layers = [nn.Linear(8, 8, bias=False), nn.Linear(8, 8)]

    def __call__(self, x):
        x = self.proj(self.norm(x))
        for layer in self.layers:
            x = layer(x)
        return x


def _tree():
    root = _Block()
    mx.eval(root.parameters())
    return root


def test_the_record_holds_every_array_and_container():
    root = _tree()
    rec = ParameterRecord(root)
    assert rec.valid()
    assert len(rec.expected) == 6  # proj w/b, norm w, layers[0] w, layers[1] w/b
    assert all(any(a is e for e in rec.expected)
               for a in (root.proj.weight, root.norm.weight, root.layers[1].bias))
    assert {id(root), id(root.proj), id(root.layers[0])} <= set(rec.spans)
    lo, hi = rec.spans[id(root.proj)]
    assert {id(a) for a in rec.expected[lo:hi]} == {id(root.proj.weight), id(root.proj.bias)}
    # 6 arrays; 5 containers (proj, norm, layers, its 2 linears); their 5 lengths and the root's
    assert rec.size == 6 + 5 + 6


@pytest.mark.parametrize("change", ["array", "list-item", "module", "class", "added-array",
                                    "deleted-array", "list-append", "new-list"])
def test_any_replacement_makes_the_record_invalid(change):
    # Assignments, update(), a module swapped for another (LoRA wrappers), a
    # class changed in place, arrays added or deleted, a layer list changed.
    root = _tree()
    rec = ParameterRecord(root)
    if change == "array":
        root.proj.update({"weight": root.proj.weight * 2})
    elif change == "list-item":
        root.layers[1].weight = root.layers[1].weight + 1
    elif change == "module":
        root.norm = nn.RMSNorm(8)
    elif change == "class":
        class Other(nn.Linear):
            pass

        root.proj.__class__ = Other
    elif change == "added-array":
        root.layers[0].bias = mx.zeros((8,))
    elif change == "deleted-array":
        del root.proj["bias"]
    elif change == "list-append":
        root.layers.append(nn.Linear(8, 8))
    else:
        root.layers = list(root.layers)
    assert not rec.valid(), change


def test_an_array_changed_in_place_is_not_seen():
    # decode-const's documented limit: MLX swaps the array inside the same
    # Python object, which an identity check cannot see.
    root = _tree()
    rec = ParameterRecord(root)
    root.proj.weight *= 2.0
    assert rec.valid()


def test_a_watched_trace_keeps_the_record_and_a_replacement_before_it_does_not():
    # A function compiled with inputs=module re-wraps the module's arrays in
    # new Python objects when it traces: the watched call re-points the
    # record's slots that held what it expected, so the record stays valid.
    # A replacement made before that call is still seen after it.
    root = _tree()
    x = mx.ones((1, 8))
    fn = compile_watched(root.proj, lambda v: root.proj(v) * 2)
    rec = ParameterRecord(root)
    rec.watch()
    w0 = root.proj.weight
    mx.eval(fn(x))  # traces: re-wraps
    assert root.proj.weight is not w0 and rec.valid()
    mx.eval(fn(x))  # replays: nothing to do
    assert rec.valid()
    root.proj.weight = root.proj.weight * 3.0
    mx.eval(fn(x[:, :8] + mx.zeros((2, 8))))  # a new shape: traces again
    assert not rec.valid()
    # An unwatched module's compiled function is the plain compiled call.
    other = _tree()
    g = compile_watched(other.proj, lambda v: other.proj(v))
    assert mx.array_equal(g(x), other.proj(x)).item()


def test_a_module_holding_a_tuple_is_not_watched():
    # MLX rebuilds a tuple when it re-wraps a module's arrays, which the
    # record cannot follow: such a module gets no span, so its traces count
    # as a change (a rebuild of the step), never as a valid record.
    root = _tree()
    root.pair = (mx.ones((8,)), mx.zeros((8,)))
    mx.eval(root.parameters())
    fn = compile_watched(root, lambda v: root.proj(v) + root.pair[0])
    rec = ParameterRecord(root)
    rec.watch()
    assert id(root) not in rec.spans and id(root.proj) in rec.spans
    assert rec.valid()
    mx.eval(fn(mx.ones((1, 8))))
    assert not rec.valid()


def test_an_unwatched_trace_breaks_the_record():
    # Without watch() (or through a plain mx.compile), the re-wrap is a
    # mismatch: what the compiled decode step would take for a replacement.
    root = _tree()
    rec = ParameterRecord(root)
    mx.eval(mx.compile(lambda v: root.proj(v), inputs=root.proj)(mx.ones((1, 8))))
    assert not rec.valid()
