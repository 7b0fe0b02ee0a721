"""add-norm: residual add + post-attention RMSNorm in one kernel (ops/norm.py, layers/norm.py).

The kernel bodies run in tests/test_kernels_cuda_emulated.py (CPU emulation of
the CUDA body, against mx.fast.rms_norm) and tests/test_kernels_gpu.py (GPU
machine). Here: the portable reference, launch parameters, readiness on the
CPU and its gates, the dispatcher, the decoder-layer class swap (parameters,
to_stock, the ablation switch), the self-check gate with a wrong fake kernel,
and whole fused models on the CUDA body through the emulator (prefill and
decode, both model families) against the same models without the switch and
stock mlx-lm.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

from qwen_apple_backend import get_report, load
from qwen_apple_backend.bench.target import fuse_in_memory
from qwen_apple_backend.checkpoint import build_random_model, hf_config
from qwen_apple_backend.layers import norm as layer_norm
from qwen_apple_backend.ops import device
from qwen_apple_backend.ops import norm as norm_ops

from . import _cuda_emulation as emu
from ._metrics import mx_rel_l2
from ._qwen3_next import small_qwen3_next

DTYPES = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}


def _inputs(shape, dtype, seed=0):
    k = mx.random.split(mx.random.key(seed), 3)
    x = (4.0 * mx.random.normal(shape, key=k[0])).astype(dtype)
    r = mx.random.normal(shape, key=k[1]).astype(dtype)
    w = (1.0 + 0.2 * mx.random.normal(shape[-1:], key=k[2])).astype(dtype)
    return x, r, w


# --------------------------------------------------------------------------
# Reference, launch parameters, readiness on the CPU
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 5, 100), (3, 264)])
def test_reference_is_the_stock_add_then_rms_norm(shape, dt):
    x, r, w = _inputs(shape, DTYPES[dt])
    h, y = norm_ops.add_rms_norm_ops(x, r, w, 1e-6)
    assert mx.array_equal(h, x + r).item()
    assert mx.array_equal(y, mx.fast.rms_norm(x + r, w, 1e-6)).item()
    assert mx.array_equal(y, nn.RMSNorm(shape[-1], eps=1e-6).update({"weight": w})(h)).item()
    # Without a backend the dispatcher is the reference.
    h2, y2 = norm_ops.add_rms_norm(x, r, w, 1e-6)
    assert mx.array_equal(h2, h).item() and mx.array_equal(y2, y).item()


@pytest.mark.parametrize("D", [1, 31, 64, 100, 264, 2048, 4096, 5000, 8192, 16384])
def test_launch_covers_the_row(D):
    p = norm_ops.add_rms_norm_launch(D)
    assert p["BLOCK"] % 32 == 0 and 32 <= p["BLOCK"] <= 1024
    assert p["BLOCK"] * p["PER"] >= D and p["BLOCK"] * (p["PER"] - 1) < D
    assert p["PER"] <= (8 if D <= 8192 else 16)
    if D == 2048:  # Qwen3.6-35B-A3B: 256 threads, 8 elements each
        assert p == {"BLOCK": 256, "PER": 8}


@pytest.fixture
def on_cpu():
    """The CPU as the default device (also where the tests run on a GPU machine)."""
    device_before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device_before)


def test_not_ready_on_the_cpu(on_cpu):
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) is None
    with pytest.raises(RuntimeError, match="no add_rms_norm kernel"):
        norm_ops.add_rms_norm_kernel(*_inputs((1, 2048), mx.bfloat16), 1e-6)


def test_contract():
    ok = norm_ops.add_rms_norm_supported
    assert ok(2048, mx.bfloat16) and ok(100, mx.float16) and ok(16384, mx.float32)
    assert not ok(16385, mx.float32) and not ok(0, mx.float32)
    assert not ok(2048, mx.int32)
    assert not ok(2048, mx.bfloat16, mx.float32)  # weight in another dtype


@pytest.fixture
def fake_cuda(monkeypatch):
    """ops.norm on a pretend CUDA device whose kernel is ``state['kernel']``."""
    state = {"calls": 0, "kernel": norm_ops.add_rms_norm_ops}

    def kernel(backend, x, r, w, eps):
        state["calls"] += 1
        return state["kernel"](x, r, w, eps)

    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(norm_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(norm_ops, "_kernel_object", lambda backend: object())
    monkeypatch.setattr(norm_ops, "_kernel_call", kernel)
    device.reset_self_checks()
    yield state
    device.reset_self_checks()


def test_readiness_gates(fake_cuda, monkeypatch):
    assert norm_ops.add_rms_norm_ready(2048, mx.int32) is None
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16, mx.float32) is None
    assert norm_ops.add_rms_norm_ready(1 << 15, mx.bfloat16) is None
    assert fake_cuda["calls"] == 0
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) is None
    assert fake_cuda["calls"] == 0
    monkeypatch.delenv("QAB_DISABLE_KERNELS")
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) == "cuda"
    assert fake_cuda["calls"] == 1  # the self-check, once per (D, dtype)
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) == "cuda"
    assert fake_cuda["calls"] == 1
    assert device.self_check_results()[("add_rms_norm", "cuda", (2048, "mlx.core.bfloat16"))] \
        == (True, "passed")


def test_unverified_cuda_kernel_is_opt_in(monkeypatch, tmp_path):
    # Until its GPU tests pass, the manifest entry has no `verified` stamp.
    import dataclasses

    from qwen_apple_backend.ops._sources import kernel_source

    unverified = dataclasses.replace(kernel_source("add_rms_norm", "cuda"), verified="")
    monkeypatch.setattr(device, "kernel_source", lambda op, backend: unverified)
    monkeypatch.setattr(norm_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: "k", raising=False)
    monkeypatch.delenv("QAB_UNVERIFIED_KERNELS", raising=False)
    monkeypatch.setenv("QAB_CACHE_DIR", str(tmp_path))  # the include form's files
    norm_ops._kernel_object.cache_clear()
    try:
        assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) is None
        norm_ops._kernel_object.cache_clear()
        monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
        assert norm_ops._kernel_object("cuda") == "k"
    finally:
        norm_ops._kernel_object.cache_clear()


def test_dispatcher_checks_the_kernel_contract(fake_cuda):
    x, r, w = _inputs((2, 64), mx.bfloat16)
    with pytest.raises(ValueError, match="add_rms_norm kernel"):
        norm_ops.add_rms_norm(x, r[:1], w, 1e-6, backend="cuda")  # r would broadcast
    with pytest.raises(ValueError, match="add_rms_norm kernel"):
        norm_ops.add_rms_norm(x, r.astype(mx.float32), w, 1e-6, backend="cuda")
    with pytest.raises(ValueError, match="add_rms_norm kernel"):
        norm_ops.add_rms_norm(x, r, w[:32], 1e-6, backend="cuda")
    assert fake_cuda["calls"] == 0
    # An empty x takes the portable path.
    h, y = norm_ops.add_rms_norm(x[:0], r[:0], w, 1e-6, backend="cuda")
    assert h.shape == (0, 64) and fake_cuda["calls"] == 0
    norm_ops.add_rms_norm(x, r, w, 1e-6, backend="cuda")
    assert fake_cuda["calls"] == 1


# --------------------------------------------------------------------------
# The decoder-layer class swap
# --------------------------------------------------------------------------


def _tiny(**fuse):
    # The tiny Qwen3.5-MoE preset (hidden size 64), 4-bit, bf16, fused.
    model = build_random_model("tiny", vocab_size=1024)
    fuse_in_memory(model, "fused", config=hf_config("tiny", 1024), **fuse)
    return model


def _tiny_next(dtype=mx.float32):
    # A small Qwen3-Next (its own DecoderLayer class), random weights.
    return small_qwen3_next(dtype)


def test_fused_layers_get_the_subclass_with_the_same_parameters():
    model = build_random_model("tiny", vocab_size=1024)
    fuse_in_memory(model, "fused", config=hf_config("tiny", 1024), disable=["add-norm"])
    norms = [layer.post_attention_layernorm for layer in model.layers]
    assert all(type(layer) is qwen3_5.DecoderLayer for layer in model.layers)
    before = dict(tree_flatten(model.parameters()))
    assert layer_norm.install_add_norm(model) == 4
    assert all(type(layer) is layer_norm.AddNormDecoderLayer for layer in model.layers)
    assert all(isinstance(layer, qwen3_5.DecoderLayer) for layer in model.layers)
    assert layer_norm.add_norm_installed(model)
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert [layer.post_attention_layernorm for layer in model.layers] == norms
    # The verdict cache is not a parameter or a child module.
    ids = mx.array([[1, 2, 3]])
    model(ids)
    assert dict(tree_flatten(model.parameters())).keys() == before.keys()
    assert layer_norm.install_add_norm(model) == 0  # already swapped
    assert layer_norm.uninstall_add_norm(model) == 4
    assert all(type(layer) is qwen3_5.DecoderLayer for layer in model.layers)
    assert not layer_norm.add_norm_installed(model)
    assert dict(tree_flatten(model.parameters())).keys() == before.keys()


def test_qwen3_next_layers_get_their_subclass():
    model = _tiny_next()
    fuse_in_memory(model, "fused", config={"model_type": "qwen3_next"})
    assert all(type(layer) is layer_norm.AddNormQwen3NextDecoderLayer for layer in model.layers)
    assert model.layers[0].to_stock() is model.layers[0]
    assert type(model.layers[0]) is qwen3_next.Qwen3NextDecoderLayer


def test_other_layers_are_left_alone():
    class Sub(qwen3_5.DecoderLayer):  # may have its own __call__
        pass

    class Holder(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

    model = build_random_model("tiny", vocab_size=1024)
    layers = model.layers
    layers[0].__class__ = Sub
    layers[1].post_attention_layernorm = nn.LayerNorm(64)
    assert layer_norm.install_add_norm(Holder(layers)) == 2
    assert type(layers[0]) is Sub and type(layers[1]) is qwen3_5.DecoderLayer
    assert layer_norm.install_add_norm(nn.Linear(2, 2)) == 0  # no layers


def test_cpu_fused_model_is_unchanged_by_the_switch(on_cpu):
    # On the CPU the kernel is never ready: the subclass runs the stock code.
    on, off = _tiny(), _tiny(disable=["add-norm"])
    assert type(on.layers[0]) is layer_norm.AddNormDecoderLayer
    assert type(off.layers[0]) is qwen3_5.DecoderLayer
    ids = mx.array([[5, 9, 200, 7]])
    assert mx.array_equal(on(ids), off(ids)).item()
    assert all(v == {(mx.bfloat16, mx.bfloat16, mx.bfloat16, 64): None}
               for v in (layer.__dict__[layer_norm._VERDICTS] for layer in on.layers))


def test_fused_moe_block_gets_the_layers_residual(on_cpu, monkeypatch):
    # The add-norm layer hands h to the fused MoE block (which adds it, on the
    # GPU decode path in its last kernel); the result is the stock layer's.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    seen = []
    real = FusedSparseMoeBlock.__call__

    def spy(self, x, residual=None):
        seen.append(residual is not None and residual.shape == x.shape)
        return real(self, x, residual=residual)

    monkeypatch.setattr(FusedSparseMoeBlock, "__call__", spy)
    on, off = _tiny(), _tiny(disable=["add-norm"])
    ids = mx.array([[5, 9, 200, 7]])
    seen.clear()
    y_on = on(ids)
    assert seen == [True] * len(on.layers)
    seen.clear()
    assert mx.array_equal(y_on, off(ids)).item()
    assert seen == [False] * len(off.layers)  # the stock layer adds h itself


def test_fused_moe_block_may_take_the_mixer_output(on_cpu, monkeypatch):
    # The add-norm layer first offers x, r, its post-attention norm and the
    # NEXT layer's input norm to the fused MoE block (add_norm_forward: the
    # fused route on CUDA); it returns what the block returns, and runs its own
    # path when the block says None (always on the CPU). The fused mixers hand
    # r before their output projection (moe-block-out-proj), which projects
    # to x's shape.
    from qwen_apple_backend.layers.linear import DeferredProjection
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    seen = []
    real = FusedSparseMoeBlock.add_norm_forward

    def spy(self, x, r, norm, next_norm=None, next_layer=None):
        out = real(self, x, r, norm, next_norm, next_layer=next_layer)
        assert isinstance(r, DeferredProjection)
        seen.append((x.shape == r.apply().shape, type(norm) is nn.RMSNorm, next_norm,
                     out is None))
        return out

    monkeypatch.setattr(FusedSparseMoeBlock, "add_norm_forward", spy)
    monkeypatch.setenv("QAB_ENABLE", "next-norm")
    on, off = _tiny(), _tiny(disable=["add-norm"])
    ids = mx.array([[5, 9, 200, 7]])
    assert mx.array_equal(on(ids), off(ids)).item()
    nexts = [layer.input_layernorm for layer in on.layers[1:]] + [None]
    assert [(a, b, d) for a, b, _, d in seen] == [(True, True, True)] * len(on.layers)
    assert all(n is want for (_, _, n, _), want in zip(seen, nexts))
    # A block that answers: the layer returns its answer as it is.
    layer0, layer1 = on.layers[0], on.layers[1]
    cache = make_prompt_cache(on)
    x = mx.random.normal((1, 3, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    seven = mx.full(x.shape, 7.0, dtype=x.dtype)
    asked = []

    def answer(self, x, r, norm, next_norm=None, next_layer=None):
        asked.append(norm is layer0.post_attention_layernorm and next_norm is nexts[0])
        return seven, None

    monkeypatch.setattr(FusedSparseMoeBlock, "add_norm_forward", answer)
    assert mx.array_equal(layer0(x, None, cache[0]), seven).item()
    assert asked == [True]
    # In training mode the layer never asks.
    layer0.train()
    asked.clear()
    layer0(x, None, cache[0])
    assert asked == []
    layer0.eval()


def test_next_input_norm_is_handed_to_the_next_layer_only_for_its_own_input(on_cpu,
                                                                             monkeypatch):
    # When the block's last kernel also applied the next layer's input norm,
    # the next layer takes that result instead of calling its input_layernorm,
    # but only when its input IS the handed output and its norm IS that
    # module; the slot is cleared by every layer.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    monkeypatch.setenv("QAB_ENABLE", "next-norm")
    on = _tiny()
    layer0, layer1 = on.layers[0], on.layers[1]
    cache = make_prompt_cache(on)
    x = mx.random.normal((1, 1, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    out = mx.random.normal((1, 1, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    out_norm = layer1.input_layernorm(out)
    monkeypatch.setattr(FusedSparseMoeBlock, "add_norm_forward",
                        lambda self, x, r, norm, next_norm=None, next_layer=None:
                        (out, out_norm))
    normed = []
    real_norm = nn.RMSNorm.__call__
    monkeypatch.setattr(nn.RMSNorm, "__call__",
                        lambda self, v: normed.append(self) or real_norm(self, v))
    assert layer0(x, None, cache[0]) is out
    assert layer_norm._HANDOFF.value[0] is out
    mixer_in = []
    mixer = layer1.linear_attn if layer1.is_linear else layer1.self_attn
    real_mixer = type(mixer).__call__
    monkeypatch.setattr(type(mixer), "__call__",
                        lambda self, v, *a, **k: mixer_in.append(v) or real_mixer(self, v, *a, **k))
    normed.clear()
    layer1(out, None, cache[1])
    assert layer1.input_layernorm not in normed and mixer_in[0] is out_norm
    assert layer_norm._HANDOFF.value[0] is out  # layer 1's own (faked) answer
    # Another input (an equal copy): the layer runs its own norm.
    normed.clear()
    mixer_in.clear()
    layer1(mx.array(out), None, cache[1])
    assert any(m is layer1.input_layernorm for m in normed) and mixer_in[0] is not out_norm
    # A handoff for layer 2's norm is not layer 1's.
    layer_norm._HANDOFF.value = (out, out_norm, on.layers[2].input_layernorm)
    normed.clear()
    layer1(out, None, cache[1])
    assert any(m is layer1.input_layernorm for m in normed)
    layer_norm._HANDOFF.value = None


def test_layers_know_the_next_layers_norm_and_mixer_for_its_projection():
    # moe-block-next-proj: each add-norm layer but the last knows the next
    # layer's input norm and mixer (which takes a projected input), for its
    # MoE block's launch to compute that mixer's projection; to_stock forgets.
    # Read at each call: a next layer given back its stock class, a replaced
    # mixer that takes no projected input, norm-proj off (the projection the
    # phase computes is that launch's) or no phase: nothing to project.
    model = _tiny()
    layers = model.layers
    assert [layer.__dict__[layer_norm._NEXT_LAYER] for layer in layers] == [*layers[1:], None]
    mlp = layers[0].mlp
    assert mlp.next_proj_phase
    for layer, nxt in zip(layers, layers[1:]):
        norm, mixer = layer_norm._next_layer_projection(nxt, layer.mlp)
        assert norm is nxt.input_layernorm
        assert mixer is (nxt.linear_attn if nxt.is_linear else nxt.self_attn)
        assert mixer.takes_projected
    assert layer_norm._next_layer_projection(None, mlp) is None
    mlp.next_proj_phase = False
    assert layer_norm._next_layer_projection(layers[1], mlp) is None
    mlp.next_proj_phase = True
    layers[1].train()
    assert layer_norm._next_layer_projection(layers[1], mlp) is None
    layers[1].eval()
    mixer1 = layers[1].linear_attn
    layers[1].linear_attn = mixer1.to_stock() if hasattr(mixer1, "to_stock") else object()
    assert layer_norm._next_layer_projection(layers[1], mlp) is None
    layers[1].linear_attn = mixer1
    layers[1].to_stock()
    assert layer_norm._next_layer_projection(layers[1], mlp) is None
    assert layer_norm._NEXT_LAYER not in layers[1].__dict__
    off = _tiny(disable=["norm-proj"])
    assert layer_norm._next_layer_projection(off.layers[1], off.layers[0].mlp) is None
    # Stock mixers (QAB_DISABLE=gdn,attn) take no projected input.
    stock_mixers = _tiny(disable=["gdn", "attn"])
    assert layer_norm._next_layer_projection(stock_mixers.layers[1],
                                             stock_mixers.layers[0].mlp) is None


def test_layers_know_the_next_input_norm_only_when_enabled(monkeypatch):
    # next-norm is opt-in (QAB_ENABLE); QAB_DISABLE / disable= wins.
    default = _tiny()
    assert all(layer.__dict__[layer_norm._NEXT_NORM] is None for layer in default.layers)
    assert not any("next-norm" in n for n in get_report(default).notes)
    monkeypatch.setenv("QAB_ENABLE", "next-norm")
    on, off = _tiny(), _tiny(disable=["next-norm"])
    assert any("next-norm from QAB_ENABLE" in n for n in get_report(on).notes)
    assert any("which wins" in n for n in get_report(off).notes)
    nexts = [layer.input_layernorm for layer in on.layers[1:]] + [None]
    assert all(layer.__dict__[layer_norm._NEXT_NORM] is n for layer, n in zip(on.layers, nexts))
    assert all(layer.__dict__[layer_norm._NEXT_NORM] is None for layer in off.layers)
    assert any("next-norm" in n for n in get_report(off).notes)
    on.layers[0].to_stock()
    assert layer_norm._NEXT_NORM not in on.layers[0].__dict__


def test_ablation_switch_keeps_the_stock_class(tiny_q4, monkeypatch):
    monkeypatch.setenv("QAB_DISABLE", "add-norm")
    fused, _ = load(tiny_q4, "fused")
    layers = fused.language_model.model.layers
    assert all(type(layer) is qwen3_5.DecoderLayer for layer in layers)
    assert any("add-norm" in n for n in get_report(fused).notes)
    monkeypatch.delenv("QAB_DISABLE")
    fused, _ = load(tiny_q4, "fused")
    assert all(type(layer) is layer_norm.AddNormDecoderLayer
               for layer in fused.language_model.model.layers)
    assert not any("add-norm" in n for n in get_report(fused).notes)
    # QAB_DISABLE=all keeps every module stock, and so the decoder layers too.
    monkeypatch.setenv("QAB_DISABLE", "all")
    stock_like, _ = load(tiny_q4, "fused")
    assert all(type(layer) is qwen3_5.DecoderLayer
               for layer in stock_like.language_model.model.layers)


# --------------------------------------------------------------------------
# Dispatch in the fused model, with fake kernels
# --------------------------------------------------------------------------


def _prefill_and_decode(model, prompt, steps):
    cache = make_prompt_cache(model)
    outs = [model(prompt, cache=cache)]
    tok = mx.array([[11]])
    for _ in range(steps):
        outs.append(model(tok, cache=cache))
        tok = mx.argmax(outs[-1][:, -1:], axis=-1)
    return outs


def test_a_kernel_that_passes_its_self_check_is_used_every_call(fake_cuda, monkeypatch):
    ready_calls = []
    real_ready = layer_norm.add_rms_norm_ready
    monkeypatch.setattr(layer_norm, "add_rms_norm_ready",
                        lambda *a, **k: ready_calls.append(a) or real_ready(*a, **k))
    on, off = _tiny(), _tiny(disable=["add-norm"])
    prompt = mx.array([[(i * 37) % 900 for i in range(7)]])
    got, ref = _prefill_and_decode(on, prompt, 3), _prefill_and_decode(off, prompt, 3)
    # The fake kernel is the reference: identical logits.
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    # One self-check, then one kernel call per layer and model call.
    assert fake_cuda["calls"] == 1 + 4 * 4
    # Readiness asked once per layer (then a dict lookup), not per call.
    assert len(ready_calls) == 4
    # Training mode (no VJP for a custom kernel) takes the stock code.
    on.train()
    on(prompt)
    assert fake_cuda["calls"] == 1 + 4 * 4


def test_a_wrong_kernel_fails_its_self_check_and_is_never_used(fake_cuda):
    fake_cuda["kernel"] = lambda x, r, w, eps: (x + r, 1.01 * mx.fast.rms_norm(x + r, w, eps))
    on, off = _tiny(), _tiny(disable=["add-norm"])
    prompt = mx.array([[3, 1, 4, 1, 5]])
    with pytest.warns(device.KernelSelfCheckWarning, match="add_rms_norm.*relative L2"):
        got = _prefill_and_decode(on, prompt, 2)
    assert fake_cuda["calls"] == 1  # only the self-check
    ref = _prefill_and_decode(off, prompt, 2)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, ref))
    assert device.self_check_results()[("add_rms_norm", "cuda", (64, "mlx.core.bfloat16"))][0] \
        is False


# --------------------------------------------------------------------------
# Whole fused models on the CUDA body, through the CPU emulator
# --------------------------------------------------------------------------


@pytest.fixture
def emulated(monkeypatch):
    """ops.norm builds its CUDA kernel on the CPU emulator, on a pretend CUDA device."""
    emu.require()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(norm_ops, "build_kernel", emu.build_kernel)
    monkeypatch.setattr(norm_ops, "gpu_backend", lambda: "cuda")
    calls = []
    real = norm_ops._kernel_call
    monkeypatch.setattr(norm_ops, "_kernel_call", lambda *a: calls.append(a[1].shape) or real(*a))
    norm_ops._kernel_object.cache_clear()
    device.reset_self_checks()
    yield calls
    norm_ops._kernel_object.cache_clear()
    device.reset_self_checks()


def test_emulated_kernel_passes_its_self_check(emulated):
    for D, dt in ((2048, mx.bfloat16), (100, mx.float16), (264, mx.float32)):
        assert norm_ops.add_rms_norm_ready(D, dt) == "cuda"
    verdicts = {k: v for k, v in device.self_check_results().items() if k[0] == "add_rms_norm"}
    assert len(verdicts) == 3 and all(v == (True, "passed") for v in verdicts.values())


def test_fused_qwen3_5_moe_on_the_emulated_kernel_matches(emulated):
    on, off = _tiny(), _tiny(disable=["add-norm"])
    stock = build_random_model("tiny", vocab_size=1024)
    prompt = mx.array([[(i * 53) % 1000 for i in range(6)]])
    got = _prefill_and_decode(on, prompt, 3)
    ref = _prefill_and_decode(off, prompt, 3)
    base = _prefill_and_decode(stock, prompt, 3)
    # 4 layers x (prefill + 3 decode tokens), after the self-check's call.
    assert emulated[0] == (3, 64) and emulated[1:] == [(1, 6, 64)] * 4 + [(1, 1, 64)] * 12
    for step, (a, b, s) in enumerate(zip(got, ref, base)):
        # h is bit-identical and y equals mx.fast.rms_norm up to the order of
        # a float32 sum, which may flip a bf16 rounding now and then
        # (measured: bit-identical logits here, and against stock too).
        assert mx_rel_l2(a, b) <= 1e-3, f"step {step}"
        # Against stock mlx-lm: room for the other fused modules' bf16 drift.
        assert mx_rel_l2(a, s) <= 2e-2, f"step {step}"


def test_fused_qwen3_next_on_the_emulated_kernel_matches(emulated):
    on, off = _tiny_next(), _tiny_next()
    fuse_in_memory(on, "fused", config={"model_type": "qwen3_next"})
    fuse_in_memory(off, "fused", config={"model_type": "qwen3_next"}, disable=["add-norm"])
    stock = _tiny_next()
    prompt = mx.array([[1, 20, 33, 4, 50]])
    got = _prefill_and_decode(on, prompt, 2)
    ref = _prefill_and_decode(off, prompt, 2)
    base = _prefill_and_decode(stock, prompt, 2)
    assert len(emulated) == 1 + 4 * 3
    for step, (a, b, s) in enumerate(zip(got, ref, base)):
        # float32: the order of the sum of squares only (measured <= 8.7e-7;
        # the fused model without the switch equals stock bit for bit here).
        assert mx_rel_l2(a, b) <= 1e-5, f"step {step}"
        assert mx_rel_l2(a, s) <= 1e-4, f"step {step}"


def test_self_checks_keep_their_parts_seconds_in_order(monkeypatch):
    # ops.device.self_checked evaluates the reference before it builds the
    # kernel and keeps each part's wall time (self_check_timings), passed or
    # failed; a cached verdict runs nothing and adds no row.
    import time

    from qwen_apple_backend.ops import device

    monkeypatch.setattr(device, "_RESULTS", {})
    monkeypatch.setattr(device, "_TIMINGS", [])
    order = []

    def make():
        order.append("inputs")
        return (mx.arange(4, dtype=mx.float32),)

    def reference(x):
        order.append("reference")
        time.sleep(0.05)
        return [x * 2]

    def kernel(x):
        order.append("kernel")
        return [x + x]

    def broken(x):
        order.append("broken")
        raise RuntimeError("no such kernel")

    check = dict(reference=reference, make_inputs=make, rtol=0.0)
    assert device.self_checked("op-a", "fake", (4, "f32"), kernel=kernel, **check)
    with pytest.warns(device.KernelSelfCheckWarning, match="RuntimeError: no such kernel"):
        assert not device.self_checked("op-b", "fake", (4,), kernel=broken, **check)
    assert device.self_checked("op-a", "fake", (4, "f32"), kernel=broken, **check)  # cached
    assert order == ["inputs", "reference", "kernel", "inputs", "reference", "broken"]
    rows = device.self_check_timings()
    assert [(r["op"], r["backend"], r["key"], r["passed"]) for r in rows] == [
        ("op-a", "fake", "(4, 'f32')", True), ("op-b", "fake", "(4,)", False)]
    assert all(r["reference_s"] >= 0.05 and r["kernel_s"] >= 0
               for r in rows)
    device.reset_self_checks()
    assert device.self_check_timings() == [] and device.self_check_results() == {}
