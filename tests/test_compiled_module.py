"""layers._compiled.ModuleCompiled and decode._Snapshot: identity-stable compiled modules."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from qwen_apple_backend.decode import _Snapshot
from qwen_apple_backend.layers._compiled import ModuleCompiled, array_slots, outer_trace, put_back


def _net():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mx.eval(net.parameters())
    return net


def _ids(module):
    return [id(v) for _, _, v in array_slots(module)]


def test_plain_inputs_module_compile_rewraps_arrays():
    # The MLX behaviour ModuleCompiled exists for: a trace with inputs=module
    # puts new Python objects back for the same arrays.
    net = _net()
    before = net.layers[0].weight
    fn = mx.compile(lambda x: net(x), inputs=net)
    fn(mx.ones((2, 8)))
    assert net.layers[0].weight is not before
    assert mx.array_equal(net.layers[0].weight, before).item()


def test_module_compiled_keeps_array_objects_across_traces():
    net = _net()
    ids = _ids(net)
    fn = ModuleCompiled(net, lambda x: net(x))
    for shape in [(2, 8), (3, 8), (2, 8), (1, 1, 8)]:  # traces, and a replay
        x = mx.random.normal(shape, key=mx.random.key(shape[0]))
        assert mx.allclose(fn(x), net(x), atol=1e-6).item()
        assert _ids(net) == ids, shape


def test_module_compiled_inside_an_outer_trace_keeps_array_objects():
    # Called inside another compiled function's trace, MLX runs it as a plain
    # call (re-wrapping); inside outer_trace() the objects are put back.
    net = _net()
    inner = ModuleCompiled(net, lambda x: net(x))
    x = mx.ones((2, 8))
    inner(x)  # traced once, eagerly
    ids = _ids(net)
    outer = mx.compile(lambda y: inner(y) * 2)
    with outer_trace():
        out = outer(x)
    assert _ids(net) == ids
    assert mx.allclose(out, 2 * net(x), atol=1e-6).item()


def test_module_compiled_reads_replaced_parameters():
    net = _net()
    fn = ModuleCompiled(net, lambda x: net(x))
    x = mx.ones((2, 8))
    fn(x)
    net.layers[2].weight = net.layers[2].weight * -3.0
    assert mx.allclose(fn(x), net(x), atol=1e-6).item()


def test_put_back_restores_only_slots_that_changed():
    net = _net()
    slots = array_slots(net)
    w = net.layers[0].weight
    net.layers[0]["weight"] = w * 1  # another object
    put_back(slots)
    assert net.layers[0].weight is w


def test_snapshot_sees_replaced_arrays_modules_and_list_entries():
    net = _net()
    snap = _Snapshot(net)
    assert snap.holds()
    net.layers[0].weight = net.layers[0].weight + 0  # an array replaced
    assert not snap.holds()
    snap = _Snapshot(net)
    net.layers[2] = nn.Linear(16, 4)  # a list entry replaced
    assert not snap.holds()
    snap = _Snapshot(net)
    net.extra = nn.Linear(2, 2)  # a child added
    assert not snap.holds()
    snap = _Snapshot(net)
    assert snap.holds()


def test_snapshot_does_not_keep_its_root_alive():
    import gc
    import weakref

    net = _net()
    snap = _Snapshot(net)
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None
    assert not snap.holds()


@pytest.mark.parametrize("value", [mx.zeros((2,)), [mx.zeros((2,))]])
def test_snapshot_of_plain_containers(value):
    net = _net()
    net.buffers_ = value
    snap = _Snapshot(net)
    assert snap.holds()
    if isinstance(value, list):
        value[0] = mx.ones((2,))
    else:
        net.buffers_ = mx.ones((2,))
    assert not snap.holds()
