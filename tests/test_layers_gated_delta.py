"""FusedGatedDeltaNet / FusedQwen3NextGatedDeltaNet against the stock mlx-lm modules.

Stock modules are built from tiny configs (hidden 64, Hk 2, Hv 4, Dk = Dv = 32,
conv kernel 4) with seeded random weights; the fused module is made with
``from_stock`` and must match the stock module's output and cache states.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache

import qwen_apple_backend.layers.gated_delta as layer_mod
from qwen_apple_backend.layers.gated_delta import (
    FusedGatedDeltaNet,
    FusedQwen3NextGatedDeltaNet,
)

HIDDEN, HK, HV, DK, DV, KERNEL = 64, 2, 4, 32, 32, 4

GDN_FIELDS = dict(
    hidden_size=HIDDEN,
    linear_num_value_heads=HV,
    linear_num_key_heads=HK,
    linear_key_head_dim=DK,
    linear_value_head_dim=DV,
    linear_conv_kernel_dim=KERNEL,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "qwen3_5": (
        lambda: qwen3_5.GatedDeltaNet(
            qwen3_5.TextModelArgs(num_attention_heads=4, **GDN_FIELDS)
        ),
        FusedGatedDeltaNet,
    ),
    "qwen3_next": (
        lambda: qwen3_next.Qwen3NextGatedDeltaNet(
            qwen3_next.ModelArgs(
                model_type="qwen3_next", num_hidden_layers=4, intermediate_size=128,
                num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                decoder_sparse_step=1, shared_expert_intermediate_size=64,
                mlp_only_layers=[], moe_intermediate_size=64, vocab_size=128,
                num_key_value_heads=2, rope_theta=1e4, partial_rotary_factor=0.25,
                max_position_embeddings=512, head_dim=16, **GDN_FIELDS,
            )
        ),
        FusedQwen3NextGatedDeltaNet,
    ),
}

# float32: the brief's bound on rel-L2 of outputs and states.
F32_REL = 1e-5
# bfloat16 outputs: both modules round the same intermediates (projections,
# conv, norm) to bf16 and differ only in float32 summation order inside the
# recurrence, which now and then flips one bf16 rounding of y. Measured
# rel-L2 <= 6.8e-5 on outputs (0 in decode); the recurrent state is float32
# in both and stays within F32_REL (measured 1.1e-7), the conv state is
# bit-equal.
BF16_REL = 1e-3


def rel_l2(actual, expected) -> float:
    a = np.asarray(actual.astype(mx.float32), dtype=np.float64)
    e = np.asarray(expected.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def assert_rel(actual, expected, bound, name, atol=1e-6):
    """rel-L2 check; on failure names the first mismatching indices."""
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
    r = rel_l2(actual, expected)
    if not r <= bound:
        a = np.asarray(actual.astype(mx.float32))
        e = np.asarray(expected.astype(mx.float32))
        bad = np.argwhere(~np.isclose(a, e, atol=atol, rtol=bound))[:5]
        rows = [f"  {tuple(int(i) for i in ix)}: got {a[tuple(ix)]:.7g}, want {e[tuple(ix)]:.7g}" for ix in bad]
        raise AssertionError(f"{name}: rel-L2 {r:.3g} > {bound}; first mismatches at\n" + "\n".join(rows))


def make_stock(variant, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    stock = VARIANTS[variant][0]()
    # Non-trivial norm weights and biases, and decay rates in (0.05, 1) so the
    # recurrent state carries information across many tokens.
    stock.dt_bias = 0.5 * mx.random.normal((HV,))
    stock.A_log = mx.log(mx.random.uniform(0.05, 1.0, (HV,)))
    stock.norm.weight = 1.0 + 0.1 * mx.random.normal((DV,))

    def cast(path, p):
        # mlx-lm keeps A_log float32 in low-precision models (cast_predicate).
        return p if path.endswith("A_log") else p.astype(dtype)

    stock.update(tree_map_with_path(cast, stock.parameters()))
    stock.eval()
    mx.eval(stock.parameters())
    return stock


def make_pair(variant, dtype=mx.float32, seed=0):
    stock = make_stock(variant, dtype, seed)
    return stock, VARIANTS[variant][1].from_stock(stock)


def inputs(shape, dtype=mx.float32, seed=1):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameters_and_attributes_are_stock(variant):
    stock, fused = make_pair(variant)
    stock_params = dict(tree_flatten(stock.parameters()))
    fused_params = dict(tree_flatten(fused.parameters()))
    assert sorted(fused_params) == sorted(stock_params)
    # Adopted, not copied.
    assert all(fused_params[k] is stock_params[k] for k in stock_params)
    for name in ("conv1d", "norm", "out_proj"):
        assert getattr(fused, name) is getattr(stock, name)
    # What mlx-lm's shard() reads and rewrites.
    for name in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
        assert getattr(fused, name) == getattr(stock, name)
    assert fused.sharding_group is None
    assert fused.training == stock.training


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_call_signature_matches_stock(variant):
    stock_cls = type(make_stock(variant))
    fused_cls = VARIANTS[variant][1]

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    # The stock parameters, in order, then only input_norm=None (the
    # decoder layer's norm, norm-proj), defer_out_proj=False
    # (moe-block-out-proj), projected=None (moe-block-next-proj) and
    # defer_step=False (moe-block-gdn), which stock callers never pass.
    stock_shape = shape(stock_cls.__call__)
    fused_shape = shape(fused_cls.__call__)
    assert fused_shape[:len(stock_shape)] == stock_shape
    assert [(n, d) for n, _, d in fused_shape[len(stock_shape):]] == [
        ("input_norm", None), ("defer_out_proj", False), ("projected", None),
        ("defer_step", False)]


def test_from_stock_rejects_the_other_layout():
    with pytest.raises(TypeError, match="in_proj_qkv"):
        FusedGatedDeltaNet.from_stock(make_stock("qwen3_next"))
    with pytest.raises(TypeError, match="in_proj_qkvz"):
        FusedQwen3NextGatedDeltaNet.from_stock(make_stock("qwen3_5"))


def _prefill_then_decode(stock, fused, dtype, bound, label, T=70, steps=3):
    x = inputs((2, T, HIDDEN), dtype)
    # Without a cache.
    assert_rel(fused(x), stock(x), bound, f"{label} no-cache out")
    # With a cache: prefill, then single-token decode steps.
    cs, cf = ArraysCache(size=2), ArraysCache(size=2)
    assert_rel(fused(x, cache=cf), stock(x, cache=cs), bound, f"{label} prefill out")
    for step in range(steps + 1):
        assert cf[0].dtype == dtype and cf[1].dtype == mx.float32
        assert_rel(cf[0], cs[0], bound, f"{label} conv state after {step} decode steps")
        assert_rel(cf[1], cs[1], F32_REL, f"{label} recurrent state after {step} decode steps")
        if step == steps:
            break
        x1 = inputs((2, 1, HIDDEN), dtype, seed=10 + step)
        assert_rel(fused(x1, cache=cf), stock(x1, cache=cs), bound, f"{label} decode {step} out")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_matches_stock(variant, dtype):
    stock, fused = make_pair(variant, dtype)
    bound = F32_REL if dtype == mx.float32 else BF16_REL
    _prefill_then_decode(stock, fused, dtype, bound, f"{variant}/{dtype}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_matches_quantized_stock(variant):
    stock = make_stock(variant)
    nn.quantize(stock, group_size=32, bits=4)
    assert isinstance(stock.out_proj, nn.QuantizedLinear)
    fused = VARIANTS[variant][1].from_stock(stock)
    assert sorted(k for k, _ in tree_flatten(fused.parameters())) == sorted(
        k for k, _ in tree_flatten(stock.parameters())
    )
    _prefill_then_decode(stock, fused, mx.float32, F32_REL, f"{variant}/q4", steps=2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_in_pieces_equals_one_pass(variant):
    # Pieces of 1 (every token a decode step), 7 (the sequential path) and
    # 64 (one whole chunk, then a 6-token tail) must give the one-pass result.
    stock, fused = make_pair(variant)
    T = 70
    x = inputs((2, T, HIDDEN))
    c_one = ArraysCache(size=2)
    y_one = fused(x, cache=c_one)
    y_stock = stock(x)
    assert_rel(y_one, y_stock, F32_REL, "one pass vs stock")
    for piece in (1, 7, 64):
        cache = ArraysCache(size=2)
        ys = [fused(x[:, a : a + piece], cache=cache) for a in range(0, T, piece)]
        label = f"{variant} pieces of {piece}"
        assert_rel(mx.concatenate(ys, axis=1), y_one, F32_REL, f"{label} out")
        assert_rel(cache[0], c_one[0], F32_REL, f"{label} conv state")
        assert_rel(cache[1], c_one[1], F32_REL, f"{label} recurrent state")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padding_mask_and_lengths(variant):
    # Batched generation: row 0 left-padded by 5 (mask from the cache), then
    # lengths set as mlx-lm's BatchGenerator does before a prefill.
    stock, fused = make_pair(variant)
    T = 40
    x = inputs((2, T, HIDDEN))
    cs = ArraysCache(size=2, left_padding=[5, 0])
    cf = ArraysCache(size=2, left_padding=[5, 0])
    mask = cs.make_mask(T)
    ys, yf = stock(x, mask, cs), fused(x, mask, cf)
    # Masked tokens: ours outputs exact zeros (as mlx-lm's Metal kernel);
    # mlx-lm's CPU ops path leaves them unspecified, so compare valid ones.
    assert_rel(yf, mx.where(mask[..., None], ys, 0.0), F32_REL, "valid outputs")
    assert not mx.any(yf[0, :5]).item()
    assert_rel(cf[0], cs[0], F32_REL, "conv state")
    assert_rel(cf[1], cs[1], F32_REL, "recurrent state")

    for c in (cs, cf):
        c.prepare(lengths=[3, 9])
    x2 = inputs((2, 9, HIDDEN), seed=2)
    mask2 = cs.make_mask(9)
    ys2, yf2 = stock(x2, mask2, cs), fused(x2, mask2, cf)
    assert_rel(yf2, mx.where(mask2[..., None], ys2, 0.0), F32_REL, "lengths valid outputs")
    assert_rel(cf[0], cs[0], F32_REL, "lengths conv state")
    assert_rel(cf[1], cs[1], F32_REL, "lengths recurrent state")


def test_decode_graph_is_shared_across_layers(monkeypatch):
    # Weights are inputs of the compiled decode step, so layers of one shape
    # trace it once. Count traces through a helper only the trace calls.
    traces = []
    real = layer_mod._split_projections

    def counting(*args):
        traces.append(1)
        return real(*args)

    monkeypatch.setattr(layer_mod, "_split_projections", counting)
    fused_a = make_pair("qwen3_5", seed=0)[1]
    fused_b = make_pair("qwen3_5", seed=5)[1]
    # Batch 3 is used nowhere else, so the compile cache starts cold for it.
    ca, cb = ArraysCache(size=2), ArraysCache(size=2)
    for step in range(3):
        x = inputs((3, 1, HIDDEN), seed=20 + step)
        mx.eval(fused_a(x, cache=ca), fused_b(x, cache=cb))
    # One trace with empty caches (state None -> zeros), one with filled ones.
    assert len(traces) <= 2, len(traces)


def test_shard_keeps_working_on_one_process():
    # mlx-lm's shard() on a model whose GDN layers are fused: on a group of
    # size 1 it rewrites the same attributes, sets sharding_group, and the
    # output must not change.
    mx.random.seed(0)
    args = qwen3_5.ModelArgs.from_dict(
        dict(
            model_type="qwen3_5", vocab_size=128, num_hidden_layers=2,
            full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, tie_word_embeddings=False,
            rope_parameters={"type": "default", "mrope_section": [1, 1, 0],
                             "rope_theta": 1e4, "partial_rotary_factor": 0.25},
            **GDN_FIELDS,
        )
    )
    model = qwen3_5.Model(args)
    mx.eval(model.parameters())
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])
    expected = model(tokens)
    layer = model.language_model.model.layers[0]
    layer.linear_attn = FusedGatedDeltaNet.from_stock(layer.linear_attn)
    group = mx.distributed.init()
    assert group.size() == 1
    model.shard(group)
    assert layer.linear_attn.sharding_group is group
    assert isinstance(layer.linear_attn, FusedGatedDeltaNet)
    assert_rel(model(tokens), expected, F32_REL, "sharded model logits")


# --------------------------------------------------------------------------
# The one-launch decode kernel (ops.gated_delta.gated_delta_decode_kernel)
# --------------------------------------------------------------------------


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _fake_decode_kernel(monkeypatch):
    """A fake GPU whose decode kernel is the portable reference; count both decode paths.

    Returns ``(kernel_calls, kernel_path, compiled_path)``: the fake kernel's
    calls (traces inside mx.compile count once) and the two decode steps'.
    """
    from qwen_apple_backend.ops import device
    from qwen_apple_backend.ops import gated_delta as gd

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(gd, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(gd, "_decode_kernel_object", lambda backend: object())
    def contract(backend, qkv, z, b, a, *rest, **kw):
        # The kernel's contract on the portable reference: the layer passes its
        # projections with their token axis, [B, 1, ...] (and the mask
        # [B, 1]), and takes out as [B, 1, Hv * Dv]; rows of [B, ...] give
        # [B, Hv, Dv].
        B = qkv.shape[0]
        proj = kw.pop("proj", None)
        if proj is not None:
            # The packed row is the four projections side by side.
            assert mx.array_equal(proj.reshape(B, -1), mx.concatenate(
                [x.reshape(B, -1) for x in (qkv, z, b, a)], axis=-1)).item()
        token_axis = qkv.ndim == 3
        if token_axis:
            qkv, z, b, a = (x.reshape(B, -1) for x in (qkv, z, b, a))
            rest = list(rest)
            if len(rest) > 7 and rest[7] is not None:
                rest[7] = rest[7].reshape(B)
        out, conv_state, state = gd.gated_delta_decode_ops(qkv, z, b, a, *rest, **kw)
        return (out.reshape(B, 1, -1) if token_axis else out), conv_state, state

    kernel = _Counted(contract)
    monkeypatch.setattr(gd, "_decode_kernel_call", kernel)
    kernel_path = _Counted(layer_mod._decode_step_kernel)
    compiled_path = _Counted(layer_mod._decode_step)
    monkeypatch.setattr(layer_mod, "_decode_step_kernel", kernel_path)
    monkeypatch.setattr(layer_mod, "_decode_step", compiled_path)
    return kernel, kernel_path, compiled_path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_decode_runs_the_decode_kernel_when_ready(monkeypatch, variant, dtype):
    # With a decode kernel that passes its self-check every decode token takes
    # it (Qwen3-Next: after the qkvz/ba reordering), never the compiled step,
    # and the layer still matches stock.
    kernel, kernel_path, compiled_path = _fake_decode_kernel(monkeypatch)
    stock, fused = make_pair(variant, dtype)
    bound = F32_REL if dtype == mx.float32 else BF16_REL
    _prefill_then_decode(stock, fused, dtype, bound, f"{variant}/{dtype} decode kernel")
    assert kernel_path.calls == 3 and compiled_path.calls == 0
    assert kernel.calls >= 2  # the self-check, then the traced call

    # Switched off, or training: the compiled step again.
    fused.use_kernel = False
    fused(inputs((2, 1, HIDDEN), dtype), cache=ArraysCache(size=2))
    fused.use_kernel = True
    fused.train()
    fused(inputs((2, 1, HIDDEN), dtype), cache=ArraysCache(size=2))
    assert kernel_path.calls == 3 and compiled_path.calls == 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_kernel_with_left_padding_and_lengths(monkeypatch, variant):
    # Batched generation through the decode kernel: row 0 left-padded, then
    # lengths run out for row 0 after one decode token (it keeps its conv and
    # recurrent states while row 1 goes on), as mlx-lm's BatchGenerator does.
    _, kernel_path, compiled_path = _fake_decode_kernel(monkeypatch)
    stock, fused = make_pair(variant)
    cs = ArraysCache(size=2, left_padding=[3, 0])
    cf = ArraysCache(size=2, left_padding=[3, 0])
    x = inputs((2, 8, HIDDEN))
    mask = cs.make_mask(8)
    stock(x, mask, cs), fused(x, mask, cf)
    for c in (cs, cf):
        c.prepare(lengths=[1, 3])
    for step in range(3):
        x1 = inputs((2, 1, HIDDEN), seed=30 + step)
        m1 = cs.make_mask(1)
        ys, yf = stock(x1, m1, cs), fused(x1, m1, cf)
        assert_rel(yf, mx.where(m1[..., None], ys, 0.0), F32_REL, f"step {step} valid outputs")
        assert_rel(cf[0], cs[0], F32_REL, f"step {step} conv state")
        assert_rel(cf[1], cs[1], F32_REL, f"step {step} recurrent state")
    assert kernel_path.calls == 3 and compiled_path.calls == 0


def test_decode_kernel_decision_inside_a_compiled_step(monkeypatch):
    # The kernel decision is made from shapes and the cached self-check
    # verdict, so a decode step traced by mx.compile (as the decode-compile
    # optimization does after one eager token) takes the kernel too and
    # equals the eager call.
    kernel, kernel_path, _ = _fake_decode_kernel(monkeypatch)
    _, fused = make_pair("qwen3_5")
    cache = ArraysCache(size=2)
    fused(inputs((1, 5, HIDDEN)), cache=cache)
    fused(inputs((1, 1, HIDDEN), seed=3), cache=cache)  # eager: runs the self-check
    checks = kernel.calls

    def step(x, conv_state, state):
        c = ArraysCache(size=2)
        c[0], c[1] = conv_state, state
        return fused(x, cache=c), c[0], c[1]

    x = inputs((1, 1, HIDDEN), seed=4)
    traced = mx.compile(step)(x, cache[0], cache[1])
    eager = (fused(x, cache=cache), cache[0], cache[1])
    for name, t, e in zip(("out", "conv state", "state"), traced, eager):
        assert_rel(t, e, F32_REL, f"traced {name}")
    assert kernel_path.calls == 3 and kernel.calls >= checks


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_cache_holds_no_view_of_the_chunk(variant):
    # The conv state kept in the cache is the last Kc - 1 conv inputs. As a
    # slice of the chunk's conv input it would keep that whole [B, T + Kc - 1,
    # C] buffer alive until the next call (33.6 MB per layer at T = 2,048 for
    # Qwen3.6, ~1 GB over 30 layers); it must be its own small array, so that
    # after a prefill the cache costs what stock's does.
    # Measured as what deleting the cache frees, with the garbage collector
    # off: a delta over the whole forward also counted whatever earlier
    # tests' arrays the collector happened to free meanwhile (CI once saw
    # stock "hold" -1.2 MB that way).
    import gc

    stock, fused = make_pair(variant)
    x = inputs((1, 512, HIDDEN))
    mx.eval(x)
    held = {}
    for name, module in (("stock", stock), ("fused", fused)):
        gc.collect()
        gc.disable()
        try:
            cache = ArraysCache(size=2)
            out = module(x, cache=cache)
            mx.eval(out, cache[0], cache[1])
            del out
            mx.synchronize()
            with_cache = mx.get_active_memory()
            del cache
            mx.synchronize()
            held[name] = with_cache - mx.get_active_memory()
        finally:
            gc.enable()
    conv_state_bytes = (KERNEL - 1) * (2 * HK * DK + HV * DV) * 4
    chunk_bytes = 512 * (2 * HK * DK + HV * DV) * 4
    # Both free their states; anything beyond them is a retained buffer.
    # One conv input would add chunk_bytes (>= 256 KB).
    assert held["fused"] <= held["stock"] + conv_state_bytes, (
        f"fused prefill keeps {held['fused']} bytes alive, stock {held['stock']} "
        f"(a retained chunk would be {chunk_bytes})")


def test_decode_kernel_output_reaches_out_proj_without_a_reshape(monkeypatch):
    # The one-launch decode kernel returns [B, 1, Hv * Dv], the shape out_proj
    # takes; a reshape to that same shape is still a primitive that MLX's CUDA
    # backend encodes for every token and layer (30 per token at Qwen3.6's
    # 40 layers), so the layer hands the kernel's output over as it is.
    import io
    import re

    stock, fused = make_pair("qwen3_5")
    B = 2
    out = mx.zeros((B, 1, HV * DV))
    conv_state = mx.zeros((B, KERNEL - 1, 2 * HK * DK + HV * DV))
    state = mx.zeros((B, HV, DV, DK))
    mx.eval(out, conv_state, state)
    monkeypatch.setattr(type(fused), "_decode_kernel_ready", lambda self, *a: True)
    monkeypatch.setattr(layer_mod, "_decode_step_kernel", lambda *a: (out, conv_state, state))
    seen = []
    real_out_proj = fused.out_proj

    class Recording(nn.Module):
        def __call__(self, x):
            seen.append(x)
            return real_out_proj(x)

    fused.out_proj = Recording()
    fused.use_kernel = True
    fused(inputs((B, 1, HIDDEN)), cache=ArraysCache(size=2))
    (x,) = seen
    buf = io.StringIO()
    mx.export_to_dot(buf, x)
    assert x.shape == (B, 1, HV * DV)
    assert re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue()) == []
