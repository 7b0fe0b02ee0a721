"""Decode kernel launches take the layers' arrays as they come: no reshape, cast or copy.

On MLX's CUDA backend every primitive of the decode step, views included, costs
the host about 5 us per token (``benchmarks/decode_split.py`` records the step's
primitives; 1,266 of them, 699 views, took 6.2 ms of encoding per token on the
H200 for Qwen3.6-35B-A3B). The kernels index token rows flatly, so the launch
code hands them the router's logits, the routed indices and scores, the GDN
projections with their token axis and RoPE's strided K/V rows unchanged, and
asks for outputs in the shape the next op takes. Each test swaps a kernel
object for a recorder (no GPU here) and checks that what reaches the launch is
the caller's evaluated array with no primitive in between (its graph is empty).
The kernels themselves run on a GPU in ``tests/test_kernels_gpu.py`` and
through the emulators in ``tests/test_kernels_{cuda,metal}_emulated.py``.
"""

from __future__ import annotations

import io
import re

import mlx.core as mx
import pytest

from qwen_apple_backend.ops import attention as attn_ops
from qwen_apple_backend.ops import gated_delta as gd
from qwen_apple_backend.ops import moe as moe_ops

from .test_kernels_gpu import _experts, _shared_expert


def _same(passed: mx.array, original: mx.array) -> bool:
    """``passed`` is ``original`` (evaluated) with no reshape, cast or copy applied."""
    buf = io.StringIO()
    mx.export_to_dot(buf, passed)
    prims = re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue())
    return (not prims and passed.shape == original.shape and passed.dtype == original.dtype
            and passed.size == original.size)


class _Recorder:
    """A kernel object that records its launch and returns zeros of the asked shapes."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kw):
        self.calls.append(kw)
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]


def test_the_check_sees_ops():
    # Positive control: _same notices a reshape, a cast and a copy.
    x = mx.zeros((2, 3))
    mx.eval(x)
    assert _same(x, x)
    assert not _same(x.reshape(2, 3, 1), x)
    assert not _same(x.astype(mx.float16), x)
    assert not _same(mx.contiguous(x.T).T, x)


def test_router_takes_the_logits_and_returns_routes_in_their_shape(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(moe_ops, "_router_object", lambda backend: rec)
    logits = mx.random.normal((3, 1, 64)).astype(mx.bfloat16)  # [B, T, E] from the gate
    mx.eval(logits)
    inds, scores = moe_ops._router_kernel_call("cuda", logits, 8, True)
    (kw,) = rec.calls
    assert _same(kw["inputs"][0], logits)
    assert kw["output_shapes"] == [(3, 1, 8), (3, 1, 8)]
    assert kw["output_dtypes"] == [mx.uint32, mx.bfloat16]
    assert kw["grid"] == (32 * 4, 1, 1)  # 3 rows, padded to a threadgroup of 4
    assert inds.shape == scores.shape == (3, 1, 8)


@pytest.mark.parametrize("fold", [True, False], ids=["shared-fold", "routed-only"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_moe_decode_kernels_take_router_outputs_unchanged(monkeypatch, fold, dtype):
    gate_up_k, down_k = _Recorder(), _Recorder()
    E, H, I, K = 4, 1024, 64, 2
    gu, dn = _experts(E, H, I, dtype, seed=3)
    x = mx.random.normal((2, 1, H)).astype(dtype)
    inds = mx.array([[[0, 3]], [[1, 2]]], dtype=mx.uint32)
    scores = mx.array([[[0.25, 0.75]], [[0.5, 0.5]]], dtype=dtype)  # the router's dtype
    mx.eval(x, inds, scores)
    if fold:
        monkeypatch.setattr(moe_ops, "_fold_objects", lambda backend: (gate_up_k, down_k))
        sw = _shared_expert(H, I, dtype, seed=4)
        y = moe_ops._moe_shared_decode_kernel_call("cuda", x, inds, scores, gu, dn, sw)
    else:
        monkeypatch.setattr(moe_ops, "_gemv_objects", lambda backend: (gate_up_k, down_k))
        y = moe_ops._moe_decode_kernel_call("cuda", x, inds, scores, gu, dn)
    (g,), (d,) = gate_up_k.calls, down_k.calls
    assert _same(g["inputs"][0], x) and _same(g["inputs"][1], inds)
    assert g["grid"][1] == 2  # token rows over the leading axes
    assert _same(d["inputs"][1], inds) and _same(d["inputs"][2], scores)
    assert ("ST", dtype) in d["template"]  # the down kernel is built for the scores' dtype
    assert d["output_shapes"] == [x.shape] and y.shape == x.shape and y.dtype == dtype


def test_moe_decode_rows_must_match(monkeypatch):
    monkeypatch.setattr(moe_ops, "_gemv_objects", lambda backend: (_Recorder(), _Recorder()))
    gu, dn = _experts(4, 1024, 64, mx.float32, seed=3)
    x = mx.zeros((2, 1, 1024))
    inds = mx.zeros((3, 1, 2), dtype=mx.uint32)
    with pytest.raises(ValueError, match="inds .* must have the rows of x"):
        moe_ops._moe_decode_kernel_call("cuda", x, inds, mx.zeros((3, 1, 2)), gu, dn)


def _gdn_inputs(B=2, Hk=2, Hv=4, Dk=32, Dv=32, Kc=4, token_axis=True):
    C = 2 * Hk * Dk + Hv * Dv
    lead = (B, 1) if token_axis else (B,)
    args = dict(
        qkv=mx.zeros((*lead, C)), z=mx.zeros((*lead, Hv * Dv)), b=mx.zeros((*lead, Hv)),
        a=mx.zeros((*lead, Hv)), conv_state=mx.zeros((B, Kc - 1, C)),
        conv_w=mx.zeros((C, Kc, 1)), conv_b=None, A_log=mx.zeros((Hv,)),
        dt_bias=mx.zeros((Hv,)), norm_w=mx.ones((Dv,)), state=mx.zeros((B, Hv, Dv, Dk)))
    mx.eval([v for v in args.values() if v is not None])
    return args


def test_gdn_decode_kernel_takes_projections_with_their_token_axis(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(gd, "_decode_kernel_object", lambda backend: rec)
    args = _gdn_inputs()
    mask = mx.ones((2, 1), dtype=mx.bool_)
    mx.eval(mask)
    out, conv_state, state = gd._decode_kernel_call("cuda", **args, mask=mask)
    (kw,) = rec.calls
    for i, name in enumerate(("qkv", "z", "b", "a")):
        assert _same(kw["inputs"][i], args[name]), name
    assert _same(kw["inputs"][12], mask)
    # out in the shape the output projection takes: [B, 1, Hv * Dv].
    assert kw["output_shapes"][0] == (2, 1, 4 * 32) and out.shape == (2, 1, 128)
    assert conv_state.shape == (2, 3, 256) and state.shape == (2, 4, 32, 32)
    # Without the token axis, the documented [B, Hv, Dv].
    gd._decode_kernel_call("cuda", **_gdn_inputs(token_axis=False))
    assert rec.calls[1]["output_shapes"][0] == (2, 4, 32)
    # z may also be [B, 1, Hv, Dv] (the stock split's shape).
    args["z"] = mx.zeros((2, 1, 4, 32))
    mx.eval(args["z"])
    gd._decode_kernel_call("cuda", **args)
    assert _same(rec.calls[2]["inputs"][1], args["z"])


def test_gdn_decode_kernel_reads_the_packed_projection_as_it_comes(monkeypatch):
    # proj=: the concatenated projection's [B, 1, W] row goes to all four
    # projection inputs unchanged (its split views are checked, never passed),
    # with PROJ_W = W; without it PROJ_W = 0.
    rec = _Recorder()
    monkeypatch.setattr(gd, "_decode_kernel_object", lambda backend: rec)
    args = _gdn_inputs()
    proj = mx.zeros((2, 1, 256 + 128 + 8))
    mx.eval(proj)
    out, _, _ = gd._decode_kernel_call("cuda", **args, proj=proj)
    (kw,) = rec.calls
    assert all(_same(kw["inputs"][i], proj) for i in range(4))
    assert ("PROJ_W", 392) in kw["template"] and out.shape == (2, 1, 128)
    gd._decode_kernel_call("cuda", **args)
    assert ("PROJ_W", 0) in rec.calls[1]["template"]


@pytest.mark.parametrize("name, shape", [("z", (2, 1, 129)), ("b", (2, 2, 4)),
                                         ("a", (3, 1, 4)), ("mask", (2, 2))])
def test_gdn_decode_kernel_names_a_bad_token_row(monkeypatch, name, shape):
    monkeypatch.setattr(gd, "_decode_kernel_object", lambda backend: _Recorder())
    args = _gdn_inputs()
    args["mask"] = None
    args[name] = mx.zeros(shape, dtype=mx.bool_ if name == "mask" else mx.float32)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        gd._decode_kernel_call("cuda", **args)


def test_gdn_ops_path_keeps_the_two_dimensional_contract():
    # The portable path (and its public function) still takes [B, ...] rows only.
    with pytest.raises(ValueError, match="qkv must be"):
        gd.gated_delta_decode(**_gdn_inputs(), use_kernel=False)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kv_write_takes_ropes_strided_rows(monkeypatch, backend):
    rec = _Recorder()
    monkeypatch.setattr(attn_ops, "_kv_write_object", lambda b: rec)
    B, Hk, D, S = 1, 2, 64, 256
    k_new = mx.zeros((B, 1, Hk, D)).transpose(0, 2, 1, 3)  # as RoPE leaves it
    v_new = mx.zeros((B, 1, Hk, D)).transpose(0, 2, 1, 3)
    k_buf, v_buf = mx.zeros((B, Hk, S, D)), mx.zeros((B, Hk, S, D))
    offset = mx.array(7, dtype=mx.int32)  # the compiled step's 0-d offset
    mx.eval(k_new, v_new, k_buf, v_buf, offset)  # k_new / v_new stay strided views
    mask = attn_ops.kv_cache_write(backend, k_new, v_new, k_buf, v_buf, offset)
    (kw,) = rec.calls
    assert _same(kw["inputs"][0], k_new) and _same(kw["inputs"][1], v_new)
    assert _same(kw["inputs"][2], k_buf) and _same(kw["inputs"][3], v_buf)
    if backend == "cuda":
        assert _same(kw["inputs"][4], offset)  # a CUDA kernel gets a pointer even for 0-d
    else:
        assert kw["inputs"][4].shape == (1,)  # Metal passes 0-d inputs by reference
    assert mask.shape == (1, 1, 1, S)
