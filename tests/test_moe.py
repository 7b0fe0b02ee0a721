"""FusedSparseMoeBlock and ops.moe against stock mlx-lm's Qwen3NextSparseMoeBlock.

Measured on the CPU (MLX 0.32.4, mlx-lm 0.32.2): the fused block is bit-for-bit
equal to stock (rel-L2 0.0) in float32, in 4-bit with float32 activations and
in 4-bit with bfloat16 activations, for every shape below. The tolerances are
the dtype budgets of STYLE.md, not the measured drift.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

from qwen_apple_backend.layers import moe as moe_layer
from qwen_apple_backend.layers.moe import FusedSparseMoeBlock
from qwen_apple_backend.ops import moe as moe_ops

from ._metrics import assert_close
from ._metrics import mx_rel_l2 as rel_l2

H, I, E, K = 256, 128, 32, 8


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def make_args(h=H, i=I, e=E, k=K, shared=None, norm=True):
    return SimpleNamespace(
        hidden_size=h,
        moe_intermediate_size=i,
        shared_expert_intermediate_size=shared or i,
        norm_topk_prob=norm,
        num_experts=e,
        num_experts_per_tok=k,
    )


def make_stock(seed=0, **kw) -> Qwen3NextSparseMoeBlock:
    mx.random.seed(seed)
    block = Qwen3NextSparseMoeBlock(make_args(**kw))
    # A sharper router than the default init, so routing is not near-uniform.
    block.gate.weight = block.gate.weight * 8.0
    block.eval()
    mx.eval(block.parameters())
    return block


def qwen_quant_predicate(path, module):
    # mlx-lm's qwen3_5 predicate: router and shared-expert gate at 8 bits.
    if path.endswith("mlp.gate") or path == "gate" or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8}
    return hasattr(module, "to_quantized")


def quantized(block, dtype=None):
    nn.quantize(block, group_size=64, bits=4, class_predicate=qwen_quant_predicate)
    if dtype is not None:
        block.update(
            tree_map(
                lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                block.parameters(),
            )
        )
    mx.eval(block.parameters())
    return block


def random_u32(shape):
    # Random packed 4-bit words (all 32 bits random).
    hi = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    lo = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32)
    return (hi << 16) | lo


def inputs(shape, seed=1, dtype=mx.float32):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype)


# --------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------

# (B, T): rows = B*T*K decide the path; stock sorts from 64 rows.
SHAPES = [
    (1, 1),  # single decode token, unsorted gather
    (1, 7),  # 56 rows: largest unsorted case
    (1, 8),  # 64 rows: first sorted case (SORT_THRESHOLD boundary)
    (2, 3),  # batch 2, unsorted
    (2, 37),  # batch 2, odd prime T, sorted prefill
]


@pytest.mark.parametrize("B,T", SHAPES)
def test_matches_stock_fp32(B, T):
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((B, T, H))
    y, ref = fused(x), stock(x)
    assert y.dtype == mx.float32
    # measured: 0.0 (identical primitives in identical order)
    assert rel_l2(y, ref) <= 1e-6
    assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,T", [(1, 1), (2, 37)])
def test_matches_stock_4bit(B, T):
    stock = quantized(make_stock())
    assert stock.gate.bits == 8 and stock.shared_expert_gate.bits == 8
    assert stock.switch_mlp.gate_proj.bits == 4
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((B, T, H))
    # measured: rel-L2 0.0 on the CPU
    assert rel_l2(fused(x), stock(x)) <= 1e-6


@pytest.mark.parametrize("B,T", [(1, 1), (2, 37)])
def test_matches_stock_4bit_bf16(B, T):
    stock = quantized(make_stock(), dtype=mx.bfloat16)
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((B, T, H), dtype=mx.bfloat16)
    y, ref = fused(x), stock(x)
    assert y.dtype == mx.bfloat16
    # STYLE.md bf16 MoE budget; measured: 0.0 (same experts, same sum order).
    assert_close(y, ref, rtol=1e-2, atol=1e-1)


def test_bf16_float_experts():
    # Probe at the test's own sizes (tiny sizes are not what is under test).
    probe = mx.zeros((1, 1, 1, H), mx.bfloat16)
    try:
        mx.eval(mx.gather_mm(probe, mx.zeros((2, H, I), mx.bfloat16), rhs_indices=mx.array([1])))
    except (RuntimeError, ValueError) as err:
        # MLX's CPU GatherMM is float32-only; stock fails the same way.
        pytest.skip(f"gather_mm has no bfloat16 on this device: {err}")
    stock = make_stock()
    stock.update(tree_map(lambda a: a.astype(mx.bfloat16), stock.parameters()))
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((2, 37, H), dtype=mx.bfloat16)
    assert_close(fused(x), stock(x), rtol=1e-2, atol=1e-1)


def test_real_size_single_token_4bit():
    # Qwen3.6-35B-A3B MoE shapes: E=256, K=8, H=2048, I=512 (shared 512).
    e, k, h, i = 256, 8, 2048, 512
    mx.random.seed(3)
    stock = Qwen3NextSparseMoeBlock(make_args(h=h, i=i, e=e, k=k))
    nn.quantize(stock, group_size=64, bits=4, class_predicate=qwen_quant_predicate)
    # Replace the (still lazy) float init with random packed weights directly:
    # never materialises 3 GB of float32 experts.
    for name, (o, n) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
        getattr(stock.switch_mlp, name).update(
            {
                "weight": random_u32((e, o, n * 4 // 32)),
                "scales": mx.random.uniform(0.002, 0.01, (e, o, n // 64)),
                "biases": mx.random.uniform(-0.08, -0.02, (e, o, n // 64)),
            }
        )
    stock.eval()
    mx.eval(stock.parameters())
    fused = FusedSparseMoeBlock.from_stock(stock)
    assert fused.switch_mlp.gate_up_proj["weight"].shape == (e, 2 * i, h * 4 // 32)
    x = inputs((1, 1, h))
    # measured: 0.0
    assert rel_l2(fused(x), stock(x)) <= 1e-6


# --------------------------------------------------------------------------
# routing edge cases
# --------------------------------------------------------------------------


def test_topk_route_matches_stock_selection_and_ties():
    logits = inputs((3, 5, E), seed=4)
    # exact ties: duplicate a column so two experts have identical logits
    logits = mx.concatenate([logits[..., :4], logits[..., 3:4], logits[..., 5:]], axis=-1)
    gates = mx.softmax(logits, axis=-1, precise=True)
    ref_inds = mx.argpartition(gates, kth=-K, axis=-1)[..., -K:]
    ref_scores = mx.take_along_axis(gates, ref_inds, axis=-1)
    ref_scores = ref_scores / ref_scores.sum(-1, keepdims=True)
    inds, scores = moe_ops.topk_route(logits, K, True)
    assert mx.array_equal(inds, ref_inds).item()  # same set, same slot order
    assert mx.array_equal(scores, ref_scores).item()
    assert_close(scores.sum(-1), mx.ones((3, 5)), rtol=1e-6, atol=1e-6)
    inds, scores = moe_ops.topk_route(logits, K, False)
    assert mx.array_equal(scores, mx.take_along_axis(gates, ref_inds, axis=-1)).item()
    with pytest.raises(ValueError):
        moe_ops.topk_route(logits, E + 1, True)


@pytest.mark.parametrize("top_k,T", [(1, 5), (1, 80), (K, 5), (K, 40)])
def test_all_tokens_to_one_expert(top_k, T):
    stock = make_stock(k=top_k)
    target = 11
    # Positive inputs and a router row of ones: expert 11's logit dominates.
    w = mx.zeros((E, H)).at[target].add(1.0)
    stock.gate.weight = w
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = mx.abs(inputs((2, T, H))) + 0.1
    inds, _ = moe_ops.topk_route(stock.gate(x), top_k, True)
    assert (np.array(inds) == target).any(-1).all()
    if top_k == 1:
        assert (np.array(inds) == target).all()
    assert rel_l2(fused(x), stock(x)) <= 1e-6


@pytest.mark.parametrize("T", [1, 40])  # unsorted and sorted
def test_expert_with_zero_tokens(T):
    stock = make_stock()
    starved = 0
    stock.gate.weight = stock.gate.weight.at[starved].add(-10.0)
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = mx.abs(inputs((2, T, H))) + 0.1
    inds, _ = moe_ops.topk_route(stock.gate(x), K, True)
    assert not (np.array(inds) == starved).any()
    assert rel_l2(fused(x), stock(x)) <= 1e-6


@pytest.mark.parametrize("T", [1, 9])
def test_k_equals_e(T):
    stock = make_stock(e=8, k=8)
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((2, T, H))
    assert rel_l2(fused(x), stock(x)) <= 1e-6


def test_routing_permutation_invariance():
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((2, 37, H))
    y = fused(x)
    perm = mx.array(np.random.default_rng(0).permutation(E))
    permuted = make_stock()
    permuted.gate.weight = stock.gate.weight[perm]
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(permuted.switch_mlp, name).weight = getattr(stock.switch_mlp, name).weight[perm]
    y_perm = FusedSparseMoeBlock.from_stock(permuted)(x)
    # Same experts under new names; only the summation order over K may change.
    assert_close(y_perm, y, rtol=1e-5, atol=1e-6, name="permuted")


def test_sorting_threshold_path(monkeypatch):
    calls = []
    real = moe_ops.sort_by_expert
    monkeypatch.setattr(moe_ops, "sort_by_expert", lambda x, i: calls.append(i.size) or real(x, i))
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock, compile_decode=False)
    for T, sorts in ((7, False), (8, True)):  # 56 and 64 rows
        calls.clear()
        x = inputs((1, T, H))
        assert rel_l2(fused(x), stock(x)) <= 1e-6
        assert bool(calls) == sorts, (T, calls)


# --------------------------------------------------------------------------
# interface
# --------------------------------------------------------------------------


def _keys(module):
    return {k: v for k, v in tree_flatten(module.parameters())}


@pytest.mark.parametrize("quant", [False, True])
def test_parameter_keys_and_attributes(quant):
    stock = make_stock()
    if quant:
        quantized(stock)
    fused = FusedSparseMoeBlock.from_stock(stock)
    stock_keys = set(_keys(stock))
    expected = {
        k.replace("switch_mlp.gate_proj.", "switch_mlp.gate_up_proj.")
        for k in stock_keys
        if "switch_mlp.up_proj." not in k
    }
    assert set(_keys(fused)) == expected
    assert "switch_mlp.gate_up_proj.weight" in expected
    for attr in ("norm_topk_prob", "num_experts", "top_k", "sharding_group"):
        assert getattr(fused, attr) == getattr(stock, attr)
    g = stock.switch_mlp.gate_proj["weight"]
    assert fused.switch_mlp.gate_up_proj["weight"].shape == (E, 2 * g.shape[1], g.shape[2])
    # Router, shared expert and down projection are the stock modules themselves.
    assert fused.gate is stock.gate and fused.shared_expert is stock.shared_expert
    assert fused.switch_mlp.down_proj is stock.switch_mlp.down_proj


def test_call_signature_extends_stock():
    # A drop-in: stock's parameters in stock's order; the one extra, the
    # decoder layer's residual (layers/norm.py), is optional.
    ours = list(inspect.signature(FusedSparseMoeBlock.__call__).parameters.values())
    theirs = list(inspect.signature(Qwen3NextSparseMoeBlock.__call__).parameters)
    assert [p.name for p in ours[:len(theirs)]] == theirs
    extra = ours[len(theirs):]
    assert [p.name for p in extra] == ["residual"] and extra[0].default is None


def test_residual_is_added_as_the_stock_layer_adds_it():
    # CPU path (no kernel): block(x, residual=h) == h + block(x), bit for bit.
    stock = quantized(make_stock())
    fused = FusedSparseMoeBlock.from_stock(stock)
    x, h = inputs((2, 1, H), seed=1), inputs((2, 1, H), seed=2)
    assert mx.array_equal(fused(x, residual=h), h + fused(x)).item()
    assert mx.array_equal(fused(x, residual=h), h + stock(x)).item()
    # A residual that needs a broadcast is added after the block.
    h1 = inputs((1, 1, H), seed=3)
    assert mx.array_equal(fused(x, residual=h1), h1 + fused(x)).item()


@pytest.mark.parametrize("quant", [False, True])
def test_to_stock_round_trip(quant):
    stock = make_stock()
    if quant:
        quantized(stock)
    fused = FusedSparseMoeBlock.from_stock(stock)
    back = fused.to_stock()
    assert type(back) is Qwen3NextSparseMoeBlock
    a, b = _keys(stock), _keys(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k
    x = inputs((2, 37, H))
    assert mx.array_equal(back(x), stock(x)).item()
    # Bit-equal on the CPU (measured); GPU kernels may round differently.
    assert rel_l2(fused(x), back(x)) <= 1e-6


def test_mismatched_quantization_raises():
    stock = make_stock()
    nn.quantize(
        stock,
        class_predicate=lambda p, m: (
            {"group_size": 64, "bits": 8} if p.endswith("up_proj") else hasattr(m, "to_quantized")
        ),
        group_size=64,
        bits=4,
    )
    with pytest.raises(ValueError, match=r"switch_mlp.*bits=4.*bits=8"):
        FusedSparseMoeBlock.from_stock(stock)
    with pytest.raises(ValueError, match=r"^model\.layers\.5\.mlp\.switch_mlp: "):
        FusedSparseMoeBlock.from_stock(stock, name="model.layers.5.mlp")
    with pytest.raises(TypeError):
        FusedSparseMoeBlock.from_stock(nn.Linear(4, 4))


def test_from_stock_does_not_touch_rng():
    stock = make_stock()
    mx.random.seed(123)
    before = mx.random.uniform(shape=(4,))
    mx.random.seed(123)
    FusedSparseMoeBlock.from_stock(stock).to_stock()
    assert mx.array_equal(mx.random.uniform(shape=(4,)), before).item()


def test_compiled_decode_reads_live_parameters():
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, H))
    # Bit-equal on the CPU (measured); GPU kernels may round differently.
    assert rel_l2(fused(x), stock(x)) <= 1e-6
    # Replace weights after the first (compiled) call, as load_weights would.
    new_gate = stock.gate.weight[::-1]
    stock.gate.weight = new_gate
    fused.gate.weight = new_gate  # same module object, set twice on purpose
    new_down = stock.switch_mlp.down_proj.weight * 2
    stock.switch_mlp.down_proj.weight = new_down
    assert rel_l2(fused(x), stock(x)) <= 1e-6
    eager = FusedSparseMoeBlock.from_stock(stock, compile_decode=False)
    assert rel_l2(eager(x), fused(x)) <= 1e-6


def test_shard_single_process_group():
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((2, 5, H))
    ref = stock(x)
    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("needs a single-process run")
    fused.shard(group)
    assert fused.sharding_group is group
    assert rel_l2(fused(x), ref) <= 1e-6


# --------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------


class CountingKernel:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return moe_ops.moe_experts_ops(*args)


def _fake_gpu(monkeypatch, kernel):
    """Pretend a GPU with MoE decode kernels is present; ``kernel`` computes them."""
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(moe_ops, "_gemv_objects", lambda backend: (object(), object()))
    monkeypatch.setattr(moe_ops, "_moe_decode_kernel_call", kernel)


# Kernel-eligible sizes: 4-bit g64 experts, H % 1024 == 0, I % 32 == 0.
KH, KI, KE = 1024, 64, 16


def kernel_block(seed=0):
    return quantized(make_stock(seed, h=KH, i=KI, e=KE))


def test_no_decode_kernel_on_cpu():
    assert moe_ops.moe_experts_kernel() is None
    block = kernel_block()
    gu = moe_layer.expert_weights(block.switch_mlp.gate_proj)
    assert moe_ops.decode_kernel_ready(mx.zeros((1, 1, KH)), mx.zeros((1, 1, K)), gu, gu) is None


def test_decode_kernel_used_after_passing_its_self_check(monkeypatch):
    calls = []

    def good(backend, x, inds, scores, gu, dn):
        calls.append(x.shape)
        return moe_ops.moe_experts_ops(x, inds, scores, gu, dn, sort=False).astype(x.dtype)

    _fake_gpu(monkeypatch, good)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    y = fused(x)
    # The self-check calls (3 random tokens as [3, 1, H]; scores in the
    # activations' dtype, then float32: a down kernel per scores dtype), then
    # the real one.
    assert calls == [(3, 1, KH), (3, 1, KH), (1, 1, KH)]
    assert rel_l2(y, stock(x)) <= 1e-6
    fused(x)  # verdict cached, compiled graph reused: no second check
    assert calls[2:] in ([], [(1, 1, KH)])

    n = len(calls)
    fused.use_kernel = False
    fused(inputs((1, 2, KH)))
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    fused.use_kernel = True
    fused(inputs((1, 3, KH)))
    fused(inputs((1, 40, KH)))  # prefill-sized: never the decode kernel
    assert len(calls) == n


def test_wrong_decode_kernel_is_rejected(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    def wrong(backend, x, inds, scores, gu, dn):
        y = moe_ops.moe_experts_ops(x, inds, scores, gu, dn, sort=False)
        return (y + 0.1 * mx.abs(y).mean()).astype(x.dtype)

    _fake_gpu(monkeypatch, wrong)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    with pytest.warns(KernelSelfCheckWarning, match="moe_decode_gemv failed its self-check"):
        y = fused(x)
    assert rel_l2(y, stock(x)) <= 1e-6  # the portable path ran


def test_decode_kernel_shape_and_quantization_gates(monkeypatch):
    seen = []
    _fake_gpu(monkeypatch, lambda *a: seen.append(1))
    # Plain float experts, and 4-bit experts with H % 1024 != 0: never eligible.
    for block in (make_stock(h=KH, i=KI, e=KE), quantized(make_stock())):
        fused = FusedSparseMoeBlock.from_stock(block)
        gu = moe_layer.expert_weights(fused.switch_mlp.gate_up_proj)
        dn = moe_layer.expert_weights(fused.switch_mlp.down_proj)
        h = gu.weight.shape[-1] * (8 if gu.quantized else 1)
        assert moe_ops.decode_kernel_ready(mx.zeros((1, h)), mx.zeros((1, K)), gu, dn) is None
    assert seen == []


def test_layer_module_uses_dispatcher(monkeypatch):
    # The block goes through ops.moe.moe_experts (the only dispatcher).
    seen = []
    real = moe_layer.moe_experts
    monkeypatch.setattr(moe_layer, "moe_experts", lambda *a, **k: seen.append(k) or real(*a, **k))
    fused = FusedSparseMoeBlock.from_stock(make_stock(), compile_decode=False)
    fused(inputs((1, 2, H)))
    assert seen and set(seen[0]) == {"use_kernel", "dequant_gemm", "shared"}
    assert seen[0]["use_kernel"] is True and seen[0]["dequant_gemm"] is True
    shared_y, gate_logit = seen[0]["shared"]  # the gated shared expert is added there
    assert shared_y.shape == (1, 2, H) and gate_logit.shape == (1, 2, 1)


# --------------------------------------------------------------------------
# dequantize-then-GEMM prefill path (the ``moe-gemm`` optimization)
# --------------------------------------------------------------------------


def _spy_dequant_gemm(monkeypatch) -> list:
    """Lower the row threshold to 64, allow the CPU, count calls of the dequantize-then-GEMM path."""
    monkeypatch.setattr(moe_ops, "DEQUANT_GEMM_MIN_ROWS", 64)
    monkeypatch.setattr(moe_ops, "DEQUANT_GEMM_BACKENDS", frozenset({"cuda", "cpu"}))
    taken = []
    real = moe_ops.moe_experts_dequant_gemm
    monkeypatch.setattr(moe_ops, "moe_experts_dequant_gemm",
                        lambda *a, **k: taken.append(1) or real(*a, **k))
    return taken


@pytest.mark.parametrize("B,T", [(1, 64), (2, 37)])
def test_dequant_gemm_matches_stock_4bit(monkeypatch, B, T):
    # A small block takes the path on the CPU with float32 activations
    # (MLX 0.32's CPU gathered matmul is float32-only).
    taken = _spy_dequant_gemm(monkeypatch)
    stock = quantized(make_stock())
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((B, T, H))
    y, ref = fused(x), stock(x)
    assert taken == [1]
    # Same dequantized weight values, float32 GEMM instead of the gathered
    # quantized matmul: summation order only (measured ~1e-7).
    assert rel_l2(y, ref) <= 1e-5
    fused.dequant_gemm = False
    fused(x)
    assert taken == [1]


def test_dequant_gemm_threshold_and_dtype_gate(monkeypatch):
    taken = _spy_dequant_gemm(monkeypatch)
    stock = quantized(make_stock())
    fused = FusedSparseMoeBlock.from_stock(stock, compile_decode=False)
    fused(inputs((1, 7, H)))  # 56 rows < 64: gathered 4-bit matmul
    fused(inputs((1, 8, H), dtype=mx.bfloat16))  # bf16 on the CPU: no float gather_mm
    assert taken == []
    fused(inputs((1, 8, H)))  # 64 rows, float32
    assert taken == [1]
    plain = FusedSparseMoeBlock.from_stock(make_stock(), compile_decode=False)
    plain(inputs((1, 8, H)))  # float experts need no dequantization
    assert taken == [1]


def test_dequantize_experts_values():
    stock = quantized(make_stock())
    w = moe_layer.expert_weights(stock.switch_mlp.gate_proj)
    d = moe_ops.dequantize_experts(w, mx.float32)
    assert not d.quantized and d.weight.shape == (E, I, H) and d.weight.dtype == mx.float32
    e = 5
    ref = mx.dequantize(w.weight[e], w.scales[e], w.biases[e], group_size=64, bits=4)
    assert mx.array_equal(d.weight[e], ref)
    assert moe_ops.dequantize_experts(d, mx.float32) is d


def test_dequant_gemm_only_where_measured(monkeypatch):
    # Default: CUDA only (measured there); the CPU and Metal keep the gathered 4-bit matmul.
    assert moe_ops.DEQUANT_GEMM_BACKENDS == frozenset({"cuda"})
    monkeypatch.setattr(moe_ops, "DEQUANT_GEMM_MIN_ROWS", 64)
    taken = []
    monkeypatch.setattr(moe_ops, "moe_experts_dequant_gemm", lambda *a, **k: taken.append(1))
    fused = FusedSparseMoeBlock.from_stock(quantized(make_stock()), compile_decode=False)
    fused(inputs((1, 16, H)))
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "metal")
    assert not moe_ops._dequant_gemm_runs(inputs((1, H)))
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    assert moe_ops._dequant_gemm_runs(inputs((1, H), dtype=mx.bfloat16))
    assert taken == []


# --------------------------------------------------------------------------
# grouped GEMM block map (kernels/cuda/moe_grouped_gemm.cu launch contract)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("M,E", [(296, 16), (64, 4), (1, 8), (4096, 256), (640, 8)])
@pytest.mark.parametrize("heights", [(16, 32, 64), (64,), (32,)])
def test_grouped_gemm_block_map_covers_every_row_once(M, E, heights):
    # Emulates the kernel's tile -> (expert, rows) search: every row in exactly
    # one tile of its own expert; at most M // max(heights) + E tiles are launched.
    rng = np.random.default_rng(M + E)
    inds = np.sort(rng.integers(0, max(1, E // 2), M))  # half the experts get no rows
    rows, tiles, height = moe_ops.grouped_gemm_block_map(mx.array(inds, dtype=mx.uint32), E,
                                                         heights)
    rows, tiles, height = np.array(rows), np.array(tiles), np.array(height)
    counts = np.bincount(inds, minlength=E)
    assert rows.tolist() == [0, *np.cumsum(counts).tolist()]
    want = [next((h for h in heights if c <= h), heights[-1]) for c in counts]
    assert height.tolist() == want
    bound = M // heights[-1] + E
    assert tiles[-1] == sum(-(-c // h) for c, h in zip(counts, want)) <= bound
    seen = np.zeros(M, dtype=int)
    for t in range(bound):
        if t >= tiles[-1]:
            continue
        e = int(np.searchsorted(tiles, t, side="right") - 1)
        r0 = rows[e] + (t - tiles[e]) * height[e]
        r1 = min(r0 + height[e], rows[e + 1])
        assert r1 > r0 and (inds[r0:r1] == e).all()
        seen[r0:r1] += 1
    assert (seen == 1).all()


def test_grouped_gemm_tile_height_follows_expert_load():
    counts = [0, 5, 16, 17, 32, 33, 64, 65, 200]
    inds = mx.array(np.repeat(np.arange(len(counts)), counts), dtype=mx.uint32)
    rows, tiles, height = moe_ops.grouped_gemm_block_map(inds, len(counts))
    assert np.array(height).tolist() == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    assert np.diff(np.array(tiles)).tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 4]
    assert np.array(rows).tolist() == [0, *np.cumsum(counts).tolist()]


def test_grouped_gemm_tile_heights_by_load_only_for_light_experts(monkeypatch):
    # Heights by load where the mean load is <= 16 rows per expert (measured
    # faster there on the H200), 64-row tiles above it (measured no faster).
    seen = []
    real = moe_ops.grouped_gemm_block_map
    monkeypatch.setattr(moe_ops, "grouped_gemm_block_map",
                        lambda inds, n, rows: seen.append(tuple(rows)) or real(inds, n, rows))
    monkeypatch.setattr(moe_ops, "_grouped_gemm_call",  # [M, NOUT] zeros
                        lambda b, xs, w, glu, *a: mx.zeros(
                            (xs.shape[0], w.weight.shape[1] // (2 if glu else 1)), mx.bfloat16))
    monkeypatch.setattr(moe_ops, "combine_kernel_ready", lambda *a: False)
    limit = moe_ops.GROUPED_GEMM_BY_LOAD_MAX_MEAN_ROWS * E // K  # tokens at the limit
    for T in (limit, limit + 1):
        x, inds, scores, gu, dn = _grouped_gemm_inputs(T)
        moe_ops._moe_grouped_gemm_experts("cuda", x, inds, scores, gu, dn)
    assert seen == [moe_ops.GROUPED_GEMM_TILE_ROWS, (64,)]


def test_grouped_gemm_rejects_tile_heights_the_kernel_lacks():
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    for bad in [(), (64, 32), (16, 48), (128,)]:
        with pytest.raises(ValueError, match="tile_rows"):
            moe_ops._moe_grouped_gemm_experts("cuda", x, inds, scores, gu, dn, tile_rows=bad)


def test_grouped_gemm_not_used_on_cpu_or_unverified():
    stock = quantized(make_stock(), dtype=mx.bfloat16)
    fused = FusedSparseMoeBlock.from_stock(stock)
    gu = moe_layer.expert_weights(fused.switch_mlp.gate_up_proj)
    dn = moe_layer.expert_weights(fused.switch_mlp.down_proj)
    x = inputs((1, 64, H), dtype=mx.bfloat16)
    assert moe_ops.grouped_gemm_ready(x, mx.zeros((1, 64, K)), gu, dn) is None


class FakeGroupedGemm:
    """Stand-in for the ``mx.fast.*_kernel`` object of moe_grouped_gemm.

    Computes the kernel's contract (rows sorted by expert, ``row_offsets``
    from :func:`grouped_gemm_block_map`, optional SiLU-gated epilogue) with
    MLX ops on the CPU, after checking the launch configuration the
    dispatcher passes; ``fail`` raises instead, like a Metal kernel that does
    not compile.
    """

    def __init__(self, fail=False):
        self.fail = fail
        self.calls = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        self.calls.append(t["GLU"])
        if self.fail:
            raise RuntimeError("program_source: error (fake Metal compiler)")
        x, w, scales, biases, rows, tiles, height = inputs
        M, nout, E = x.shape[0], t["NOUT"], t["E"]
        assert t["KDIM"] == x.shape[1] and w.shape[:2] == (E, 2 * nout if t["GLU"] else nout)
        assert grid == (128 * (M // moe_ops.GROUPED_GEMM_BM + E), nout // 64, 1)
        assert threadgroup == (128, 1, 1)
        assert output_shapes == [(M, nout)] and output_dtypes == [mx.bfloat16]
        assert rows.dtype == tiles.dtype == height.dtype == mx.int32
        assert rows.shape == tiles.shape == (E + 1,) and height.shape == (E,)
        assert set(np.array(height).tolist()) <= set(moe_ops.GROUPED_GEMM_TILE_ROWS)
        expert = np.searchsorted(np.array(rows), np.arange(M), side="right") - 1
        wd = mx.dequantize(w, scales, biases, group_size=64, bits=4).astype(mx.float32)
        acc = mx.gather_mm(x.astype(mx.float32)[:, None, :], wd.swapaxes(-1, -2),
                           rhs_indices=mx.array(expert, dtype=mx.uint32))[:, 0]
        if t["GLU"]:
            acc = nn.silu(acc[:, :nout]) * acc[:, nout:]
        return [acc.astype(mx.bfloat16)]


def _fake_metal_grouped_gemm(monkeypatch, kernel):
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(moe_ops, "_grouped_gemm_object", lambda backend: kernel)
    # Only the grouped GEMM is faked: no router kernel (the real Metal one
    # cannot run here and would warn from the block's routing).
    monkeypatch.setattr(moe_ops, "_router_object", lambda backend: None)


def _grouped_gemm_inputs(T=16):
    stock = quantized(make_stock(), dtype=mx.bfloat16)
    fused = FusedSparseMoeBlock.from_stock(stock)
    gu = moe_layer.expert_weights(fused.switch_mlp.gate_up_proj)
    dn = moe_layer.expert_weights(fused.switch_mlp.down_proj)
    x = inputs((1, T, H), dtype=mx.bfloat16)
    inds, scores = moe_ops.topk_route(inputs((1, T, E), seed=2), K, True)
    return x, inds, scores.astype(mx.bfloat16), gu, dn


def test_grouped_gemm_on_metal_after_its_self_check(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    kernel = FakeGroupedGemm()
    _fake_metal_grouped_gemm(monkeypatch, kernel)
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    y = moe_ops.moe_experts(x, inds, scores, gu, dn)
    # Self-check (gate+up, down), then the real call.
    assert kernel.calls == [True, False, True, False]
    assert self_check_results()[("moe_grouped_gemm", "metal", (E, H, I, K))] == (True, "passed")
    assert y.shape == x.shape and y.dtype == mx.bfloat16
    ref = moe_ops.moe_experts_ops(x.astype(mx.float32), inds, scores.astype(mx.float32), gu, dn)
    assert rel_l2(y, ref) <= 1e-2  # bf16 x, h and y; float32 accumulation (measured 6e-3)
    moe_ops.moe_experts(x, inds, scores, gu, dn)
    assert kernel.calls[4:] == [True, False]  # verdict cached: no second check
    moe_ops.moe_experts(x, inds, scores, gu, dn, use_kernel=False)
    moe_ops.moe_experts(x[:, :7], inds[:, :7], scores[:, :7], gu, dn)  # 56 rows: too few
    assert len(kernel.calls) == 6


def test_failing_metal_grouped_gemm_falls_back(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning, self_check_results

    kernel = FakeGroupedGemm(fail=True)
    _fake_metal_grouped_gemm(monkeypatch, kernel)
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    with pytest.warns(KernelSelfCheckWarning,
                      match="metal kernel for moe_grouped_gemm failed its self-check"):
        y = moe_ops.moe_experts(x, inds, scores, gu, dn)
    passed, message = self_check_results()[("moe_grouped_gemm", "metal", (E, H, I, K))]
    assert not passed and "fake Metal compiler" in message
    assert mx.array_equal(y, moe_ops.moe_experts_ops(x, inds, scores, gu, dn))  # portable path
    assert kernel.calls == [True]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is cached: no second warning
        moe_ops.moe_experts(x, inds, scores, gu, dn)
    assert kernel.calls == [True]


def test_wrong_metal_grouped_gemm_is_rejected(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    class Wrong(FakeGroupedGemm):
        def __call__(self, **kw):  # one output column block shifted: a tiling bug
            (y,) = super().__call__(**kw)
            return [mx.roll(y, 64, axis=1)]

    _fake_metal_grouped_gemm(monkeypatch, Wrong())
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    with pytest.warns(KernelSelfCheckWarning, match="relative L2 error"):
        assert moe_ops.grouped_gemm_ready(x, inds, gu, dn) is None


def test_grouped_gemm_backends():
    assert moe_ops.GROUPED_GEMM_BACKENDS == frozenset({"cuda", "metal"})


# --------------------------------------------------------------------------
# Shared expert: portable reference, and the decode fold (the shared expert as
# slot K of kernels/*/moe_*_shared_gemv)
# --------------------------------------------------------------------------


def _f32(a):
    return a.astype(mx.float32)


def _deq(w, scales, biases, group_size, bits):
    return _f32(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits))


class FakeFoldGateUp:
    """Stand-in for the ``mx.fast.*_kernel`` object of moe_gate_up_shared_gemv.

    Computes the kernel's contract (inputs in manifest order, h with the
    shared expert as slot K, the gate logit in float32) with MLX ops in
    float32, after checking the launch configuration the dispatcher passes.
    """

    def __init__(self):
        self.calls = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        (x, inds, w, scales, biases, sg_w, sg_s, sg_b, su_w, su_s, su_b,
         g_w, g_s, g_b) = inputs
        t = dict(template)
        # Token rows over any leading axes (the layer's [B, T, H], no reshape).
        Hx = x.shape[-1]
        N = x.size // Hx
        K, I, G = t["K"], t["I"], t["G"]
        self.calls.append(N)
        assert t["H"] == Hx and inds.shape == (*x.shape[:-1], K) and inds.dtype == mx.uint32
        x, inds = x.reshape(N, Hx), inds.reshape(N, K)
        assert w.shape[1] == 2 * I and sg_w.shape == su_w.shape == (I, Hx // 8)
        assert g_w.shape == (1, Hx * t["SGB"] // 32) and t["SGB"] in (4, 8)
        warps = (K + 1) * I // 2 + 1
        assert grid[0] % 256 == 0 and 32 * warps <= grid[0] < 32 * warps + 256
        assert grid[1:] == (N, 1) and threadgroup == (256, 1, 1)
        # The logit of at least 16 bytes (ops.device.unpooled_length).
        assert output_shapes == [(N, K + 1, I), (max(N, 4),)]
        assert output_dtypes == [t["OutT"], mx.float32] and t["OutT"] == x.dtype
        xf = _f32(x)
        gu = (_deq(w, scales, biases, G, 4)[inds] @ xf[:, None, :, None])[..., 0]
        routed = nn.silu(gu[..., :I]) * gu[..., I:]
        sh = nn.silu(xf @ _deq(sg_w, sg_s, sg_b, G, 4).T) * (xf @ _deq(su_w, su_s, su_b, G, 4).T)
        h = mx.concatenate([routed, sh[:, None]], axis=1).astype(t["OutT"])
        logit = (xf @ _deq(g_w, g_s, g_b, t["SGG"], t["SGB"]).T)[:, 0]
        logit = mx.concatenate([logit, mx.zeros((output_shapes[1][0] - N,))])  # as the kernel
        return [h, logit]


class FakeFoldDown:
    """Stand-in for the kernel object of moe_down_shared_gemv (see FakeFoldGateUp)."""

    def __init__(self):
        self.calls = []
        self.has_res = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        h, inds, scores, w, scales, biases, sd_w, sd_s, sd_b, logit, res = inputs
        t = dict(template)
        N, K, Hx, I, G = h.shape[0], t["K"], t["H"], t["I"], t["G"]
        self.calls.append(N)
        self.has_res.append(t["HAS_RES"])
        # Routes as the router made them ([..., K], scores in their own dtype:
        # the kernel is built per scores dtype, template ST); y in x's shape.
        assert h.shape == (N, K + 1, I) and inds.shape == scores.shape
        assert inds.size == N * K and t["ST"] == scores.dtype
        assert logit.dtype == mx.float32 and logit.shape == (max(N, 4),)
        logit = logit[:N]
        assert sd_w.shape == (Hx, I // 8) and w.shape[1:] == (Hx, I // 8)
        assert grid == (32 * Hx // 2, N, 1) and threadgroup == (256, 1, 1)
        (out_shape,) = output_shapes
        assert out_shape[-1] == Hx and math.prod(out_shape) == N * Hx
        assert output_dtypes == [t["OutT"]]
        inds, scores = inds.reshape(N, K), _f32(scores).reshape(N, K)
        hf = _f32(h)
        routed = (_deq(w, scales, biases, G, 4)[inds] @ hf[:, :K, :, None])[..., 0]
        y = (routed * scores[..., None]).sum(axis=1)
        y = y + mx.sigmoid(logit)[:, None] * (hf[:, K] @ _deq(sd_w, sd_s, sd_b, G, 4).T)
        y = y.astype(t["OutT"]).reshape(out_shape)
        if t["HAS_RES"]:  # the layer's residual, added as the stock layer adds it
            assert res.shape == out_shape and res.dtype == t["OutT"]
            y = res + y
        return [y]


def _fake_fold_gpu(monkeypatch, gate_up=None, down=None):
    """Pretend a GPU with the fold kernels; the routed-only decode kernel must not run."""
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    gate_up, down = gate_up or FakeFoldGateUp(), down or FakeFoldDown()
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(moe_ops, "_fold_objects", lambda backend: (gate_up, down))
    routed = []
    monkeypatch.setattr(moe_ops, "_gemv_objects", lambda backend: (object(), object()))
    monkeypatch.setattr(moe_ops, "_moe_decode_kernel_call",
                        lambda *a: routed.append(1) or moe_ops.moe_experts_ops(
                            *a[1:], sort=False).astype(a[1].dtype))
    return gate_up, down, routed


def _block_weights(fused):
    gu = moe_layer.expert_weights(fused.switch_mlp.gate_up_proj)
    dn = moe_layer.expert_weights(fused.switch_mlp.down_proj)
    return gu, dn, fused._shared_weights()


def test_shared_expert_ops_matches_stock_modules():
    stock = quantized(make_stock())
    fused = FusedSparseMoeBlock.from_stock(stock)
    _, _, sw = _block_weights(fused)
    assert sw.gate.bits == 8 and sw.gate_proj.bits == 4  # mlx-lm's Qwen predicate
    x = inputs((2, 5, H))
    shared_y, logit = moe_ops.shared_expert_ops(x, sw)
    # Identical primitives: bit-equal.
    assert mx.array_equal(shared_y, stock.shared_expert(x)).item()
    assert mx.array_equal(logit, stock.shared_expert_gate(x)).item()
    plain = make_stock()
    sw_plain = FusedSparseMoeBlock.from_stock(plain)._shared_weights()
    assert not sw_plain.gate.quantized
    y, lg = moe_ops.shared_expert_ops(x, sw_plain)
    assert mx.array_equal(y, plain.shared_expert(x)).item()
    assert mx.array_equal(lg, plain.shared_expert_gate(x)).item()


@pytest.mark.parametrize("B,T", [(1, 1), (2, 37)])
def test_moe_shared_experts_ops_matches_stock(B, T):
    stock = quantized(make_stock())
    fused = FusedSparseMoeBlock.from_stock(stock)
    gu, dn, sw = _block_weights(fused)
    x = inputs((B, T, H))
    inds, scores = moe_ops.topk_route(stock.gate(x), K, True)
    y = moe_ops.moe_shared_experts_ops(x, inds, scores, gu, dn, sw)
    # measured: 0.0 (the stock composition's primitives, in its order)
    assert rel_l2(y, stock(x)) <= 1e-6


def test_shared_weights_only_for_plain_linears():
    fused = FusedSparseMoeBlock.from_stock(quantized(make_stock()))
    assert fused._shared_weights() is not None

    class Wrapped(nn.QuantizedLinear):  # a LoRA-like subclass: its call may differ
        pass

    lin = fused.shared_expert.up_proj
    wrapped = Wrapped.__new__(Wrapped)
    wrapped.__dict__.update(lin.__dict__)
    fused.shared_expert.up_proj = wrapped
    assert fused._shared_weights() is None
    assert moe_layer.linear_weights(nn.ReLU()) is None


def test_shared_fold_used_after_its_self_check(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    gate_up, down, routed = _fake_fold_gpu(monkeypatch)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    y = fused(x)
    # The self-check (3 random tokens; scores in x's dtype and float32, each
    # without and with a residual: four calls), then the real call; never the
    # routed-only kernel.
    assert gate_up.calls == [3, 3, 3, 3, 1] and down.calls == [3, 3, 3, 3, 1] and routed == []
    verdicts = {k: v for k, v in self_check_results().items() if k[0] == "moe_shared_decode_gemv"}
    assert list(verdicts.values()) == [(True, "passed")]
    assert not any(k[0] == "moe_decode_gemv" for k in self_check_results())
    # float32 dequantized weights instead of quantized matmuls: summation order only
    assert rel_l2(y, stock(x)) <= 1e-5
    fused(x)  # verdict cached, compiled graph reused: no second check
    assert gate_up.calls[5:] in ([], [1])
    y2 = fused(inputs((2, 3, KH), seed=5))  # batch 2, 3 tokens: 48 rows, still decode
    assert gate_up.calls[-1] == 6
    assert rel_l2(y2, stock(inputs((2, 3, KH), seed=5))) <= 1e-5
    eager = FusedSparseMoeBlock.from_stock(stock, compile_decode=False)
    n = len(gate_up.calls)
    assert rel_l2(eager(x), y) <= 1e-6
    assert len(gate_up.calls) == n + 1


def test_shared_fold_adds_the_residual_in_the_down_kernel(monkeypatch):
    gate_up, down, routed = _fake_fold_gpu(monkeypatch)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x, h = inputs((1, 1, KH)), inputs((1, 1, KH), seed=7)
    y = fused(x, residual=h)
    # Self-check builds (scores x2, each without and with a residual), then the
    # call, with the residual inside.
    assert down.has_res == [False, False, True, True, True] and routed == []
    assert rel_l2(y, h + stock(x)) <= 1e-5
    assert rel_l2(fused(x), stock(x)) <= 1e-5 and down.has_res[-1] is False


def test_shared_fold_with_concatenated_projections(monkeypatch):
    # proj-concat: gate_proj / up_proj hold row views of one stacked matrix;
    # the fold reads the children (the same buffer, no copy).
    gate_up, _, routed = _fake_fold_gpu(monkeypatch)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    assert fused.concat_projections()
    x = inputs((1, 1, KH))
    assert rel_l2(fused(x), stock(x)) <= 1e-5
    assert gate_up.calls == [3, 3, 3, 3, 1] and routed == []
    assert fused._use_cat()  # the views are still recorded after the compiled call


def test_shared_fold_off_when_kernels_are_off(monkeypatch):
    gate_up, _, routed = _fake_fold_gpu(monkeypatch)
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    fused.use_kernel = False  # the moe-kernel optimization off
    assert rel_l2(fused(x), stock(x)) <= 1e-6
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    fused.use_kernel = True
    assert rel_l2(fused(x), stock(x)) <= 1e-6
    monkeypatch.delenv("QAB_DISABLE_KERNELS")
    fused(inputs((1, 40, KH)))  # prefill-sized: never the decode kernels
    fused.train()
    fused(x)
    assert gate_up.calls == [] and routed == []


def _gate_left_float(path, module):
    if path.endswith("shared_expert_gate"):
        return False
    return qwen_quant_predicate(path, module)


@pytest.mark.parametrize("case", ["shared_size", "gate_float", "shared_8bit", "gate_6bit"])
def test_shared_fold_gates_fall_back_to_routed_kernels(monkeypatch, case):
    gate_up, _, routed = _fake_fold_gpu(monkeypatch)
    if case == "shared_size":  # shared expert of another size than the routed ones
        stock = quantized(make_stock(h=KH, i=KI, e=KE, shared=2 * KI))
    else:
        stock = make_stock(h=KH, i=KI, e=KE)
        if case == "gate_float":
            pred = _gate_left_float
        elif case == "shared_8bit":
            def pred(path, module):
                if "shared_expert." in path:
                    return {"group_size": 64, "bits": 8}
                return qwen_quant_predicate(path, module)
        else:
            def pred(path, module):
                if path.endswith("shared_expert_gate"):
                    return {"group_size": 64, "bits": 6}
                return qwen_quant_predicate(path, module)
        nn.quantize(stock, group_size=64, bits=4, class_predicate=pred)
        mx.eval(stock.parameters())
    fused = FusedSparseMoeBlock.from_stock(stock)
    gu, dn, sw = _block_weights(fused)
    x = inputs((1, 1, KH))
    assert moe_ops.shared_decode_kernel_ready(x, mx.zeros((1, 1, K), mx.uint32), gu, dn,
                                              sw) is None
    assert rel_l2(fused(x), stock(x)) <= 1e-6
    # routed kernel: self-check (two calls, one per scores dtype), call
    assert gate_up.calls == [] and routed == [1, 1, 1]


def test_wrong_shared_fold_is_rejected(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    class WrongDown(FakeFoldDown):
        def __call__(self, **kw):  # the shared expert left out: a slot-K bug
            kw["inputs"] = [*kw["inputs"][:-1], mx.full(kw["inputs"][-1].shape, -1e4)]
            return super().__call__(**kw)

    gate_up, down, routed = _fake_fold_gpu(monkeypatch, down=WrongDown())
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    with pytest.warns(KernelSelfCheckWarning, match="moe_shared_decode_gemv failed"):
        y = fused(x)
    assert gate_up.calls == [3, 3, 3, 3] and routed == [1, 1, 1]  # fell back to the routed kernels
    assert rel_l2(y, stock(x)) <= 1e-6


def test_failing_shared_fold_build_falls_back(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    class Broken(FakeFoldGateUp):
        def __call__(self, **kw):
            raise RuntimeError("program_source: error (fake Metal compiler)")

    _, _, routed = _fake_fold_gpu(monkeypatch, gate_up=Broken())
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, KH))
    with pytest.warns(KernelSelfCheckWarning, match="fake Metal compiler"):
        y = fused(x)
    assert rel_l2(y, stock(x)) <= 1e-6 and routed == [1, 1, 1]


def test_moe_shared_experts_kernel_lookup(monkeypatch):
    assert moe_ops.moe_shared_experts_kernel() is None  # CPU: no GPU backend
    _fake_fold_gpu(monkeypatch)
    fn = moe_ops.moe_shared_experts_kernel()
    stock = kernel_block()
    fused = FusedSparseMoeBlock.from_stock(stock)
    gu, dn, sw = _block_weights(fused)
    x = inputs((2, 1, KH))
    inds, scores = moe_ops.topk_route(stock.gate(x), K, True)
    ref = moe_ops.moe_shared_experts_ops(x, inds, scores, gu, dn, sw)
    assert rel_l2(fn(x, inds, scores, gu, dn, sw), ref) <= 1e-5


# --------------------------------------------------------------------------
# Prefill combine (kernels/*/moe_combine): un-sort, weight, sum over K, add
# the gated shared expert in one pass
# --------------------------------------------------------------------------


def test_moe_combine_ops_is_the_stock_composition():
    x = inputs((2, 37, H))
    logits = inputs((2, 37, E), seed=3)
    inds, scores = moe_ops.topk_route(logits, K, True)
    st = moe_ops.sort_by_expert(x, inds)
    y_sorted = inputs((2 * 37 * K, H), seed=4)
    shared_y, logit = inputs((2, 37, H), seed=5), inputs((2, 37, 1), seed=6)
    out = moe_ops.moe_combine_ops(y_sorted, st.inv_order.reshape(inds.shape), scores,
                                  shared_y, logit)
    y = y_sorted[st.inv_order].reshape(*inds.shape, H)
    ref = (y * scores[..., None]).sum(axis=-2) + mx.sigmoid(logit) * shared_y
    assert out.shape == (2, 37, H)
    assert rel_l2(out, ref) <= 1e-6


class FakeCombine:
    """Stand-in for the kernel object of moe_combine: checks the launch, computes in float32."""

    def __init__(self, fail=False):
        self.fail = fail
        self.calls = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        if self.fail:
            raise RuntimeError("program_source: error (fake Metal compiler)")
        y, pos, scores, shared_y, logit = inputs
        t = dict(template)
        N, Kt = pos.shape
        self.calls.append(N)
        assert t["K"] == Kt and t["H"] == y.shape[1] == shared_y.shape[1]
        assert pos.dtype == mx.uint32 and y.shape[0] == N * Kt and scores.shape == (N, Kt)
        assert shared_y.shape[0] == N and logit.shape == (N,)
        assert grid == (-(-t["H"] // 256) * 256, N, 1) and threadgroup == (256, 1, 1)
        assert output_shapes == [(N, t["H"])] and output_dtypes == [t["OutT"]]
        out = (_f32(y)[pos] * _f32(scores)[..., None]).sum(axis=1)
        out = out + mx.sigmoid(_f32(logit))[:, None] * _f32(shared_y)
        return [out.astype(t["OutT"])]


def _fake_metal_prefill(monkeypatch, combine):
    _fake_metal_grouped_gemm(monkeypatch, FakeGroupedGemm())
    monkeypatch.setattr(moe_ops, "_combine_object", lambda backend: combine)


def test_combine_after_grouped_gemm_on_metal(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    combine = FakeCombine()
    _fake_metal_prefill(monkeypatch, combine)
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    shared = (inputs((1, 16, H), seed=8, dtype=mx.bfloat16),
              inputs((1, 16, 1), seed=9, dtype=mx.bfloat16))
    y = moe_ops.moe_experts(x, inds, scores, gu, dn, shared=shared)
    assert combine.calls == [37, 16]  # self-check (37 tokens), then the real call
    key = ("moe_combine", "metal", (H, K, "mlx.core.bfloat16", "mlx.core.bfloat16",
                                    "mlx.core.bfloat16", "mlx.core.bfloat16"))
    assert self_check_results()[key] == (True, "passed")
    assert y.shape == x.shape and y.dtype == mx.bfloat16
    ref = moe_ops.add_gated_shared(
        moe_ops.moe_experts_ops(x.astype(mx.float32), inds, scores.astype(mx.float32), gu, dn),
        *(a.astype(mx.float32) for a in shared))
    assert rel_l2(y, ref) <= 1e-2  # bf16 x, h and y rows; float32 accumulation
    moe_ops.moe_experts(x, inds, scores, gu, dn)  # no shared expert: no combine
    moe_ops.moe_experts(x, inds, scores, gu, dn, shared=shared, use_kernel=False)
    assert combine.calls == [37, 16]


def test_failing_combine_falls_back_to_the_composition(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    _fake_metal_prefill(monkeypatch, FakeCombine(fail=True))
    x, inds, scores, gu, dn = _grouped_gemm_inputs()
    shared = (inputs((1, 16, H), seed=8, dtype=mx.bfloat16),
              inputs((1, 16, 1), seed=9, dtype=mx.bfloat16))
    with pytest.warns(KernelSelfCheckWarning, match="moe_combine failed its self-check"):
        y = moe_ops.moe_experts(x, inds, scores, gu, dn, shared=shared)
    routed = moe_ops.moe_experts(x, inds, scores, gu, dn)  # same grouped GEMM rows
    assert mx.array_equal(y, moe_ops.add_gated_shared(routed, *shared)).item()


def test_combine_shape_gates(monkeypatch):
    combine = FakeCombine()
    _fake_metal_prefill(monkeypatch, combine)
    y = inputs((32, H))
    pos = mx.arange(32, dtype=mx.uint32).reshape(4, 8)
    sc = inputs((4, 8))
    ok = (inputs((4, H)), inputs((4, 1)))
    assert moe_ops.combine_kernel_ready("metal", y, pos, sc, *ok)
    assert not moe_ops.combine_kernel_ready(None, y, pos, sc, *ok)
    assert not moe_ops.combine_kernel_ready("metal", y, pos, sc, inputs((1, H)), ok[1])
    assert not moe_ops.combine_kernel_ready("metal", y, pos, sc, ok[0], inputs((4, 2)))
    assert not moe_ops.combine_kernel_ready("metal", y[:31], pos, sc, *ok)
    assert not moe_ops.combine_kernel_ready("metal", y.astype(mx.int32), pos, sc, *ok)
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    assert not moe_ops.combine_kernel_ready("metal", y, pos, sc, *ok)
    assert combine.calls == [37]  # only the first call's self-check ran the kernel


def test_block_prefill_uses_the_combine_and_matches_stock(monkeypatch):
    combine = FakeCombine()
    _fake_metal_prefill(monkeypatch, combine)
    stock = quantized(make_stock(), dtype=mx.bfloat16)
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((2, 37, H), dtype=mx.bfloat16)
    y, ref = fused(x), stock(x)
    assert combine.calls == [37, 74]
    assert y.dtype == mx.bfloat16
    assert_close(y, ref, rtol=1e-2, atol=1e-1)  # STYLE.md bf16 MoE budget
    # Against the same routing with float32 activations: the fused block's
    # bf16 rounding (x, h, expert rows, and the shared expert, which its own
    # modules run in bf16) measured 1.8e-2 here, stock bf16 2.7e-2 from it;
    # the bf16 budget of grouped_gemm_ready.
    gu, dn, sw = _block_weights(fused)
    inds, scores = moe_ops.topk_route(stock.gate(x), K, True)
    ref32 = moe_ops.moe_shared_experts_ops(x.astype(mx.float32), inds,
                                           scores.astype(mx.float32), gu, dn, sw)
    assert rel_l2(y, ref32) <= 3e-2


# --------------------------------------------------------------------------
# Router kernel (kernels/*/moe_router_topk): dispatch and fallback with a
# stand-in kernel object (tests/test_kernels_cuda_emulated.py runs the CUDA
# body itself)
# --------------------------------------------------------------------------


class FakeRouter:
    """Stand-in for the ``mx.fast.*_kernel`` object of moe_router_topk.

    Checks the launch the dispatcher passes and computes the contract with
    the portable route; ``wrong`` swaps each row's last kept expert for the
    least likely one, like a selection bug.
    """

    def __init__(self, wrong=False):
        self.wrong = wrong
        self.calls = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        (x,) = inputs
        t = dict(template)
        E = x.shape[-1]
        N = x.size // E  # rows over any leading axes (the gate's [B, T, E])
        k, norm = t["K"], t["NORM"]
        self.calls.append(N)
        assert t["InT"] == x.dtype and t["E"] == E and isinstance(norm, bool)
        assert threadgroup == (128, 1, 1) and grid == (32 * (-(-N // 4) * 4), 1, 1)
        lead = x.shape[:-1]
        assert output_shapes == [(*lead, k), (*lead, k)]
        assert output_dtypes == [mx.uint32, x.dtype]
        x = x.reshape(N, E)
        inds, scores = moe_ops._route_fn(k, norm)(x)
        if self.wrong:
            last = mx.argmin(x, axis=-1, keepdims=True).astype(inds.dtype)
            inds = mx.concatenate([inds[:, :-1], last], axis=-1)
        return [inds.astype(mx.uint32).reshape(*lead, k), scores.reshape(*lead, k)]


def _fake_router(monkeypatch, router):
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(moe_ops, "_router_object", lambda backend: router)


def test_no_router_kernel_on_cpu():
    assert moe_ops.router_kernel_ready(mx.zeros((1, E)), K, True) is None
    with pytest.raises(RuntimeError, match="moe_router_topk"):
        moe_ops.topk_route(mx.zeros((1, E)), K, True, kernel="nogpu")


def test_router_kernel_used_after_passing_its_self_check(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    router = FakeRouter()
    _fake_router(monkeypatch, router)
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, H))
    y = fused(x)
    # The self-check (37 rows of this dtype, E and K), then the compiled
    # decode step's trace.
    assert router.calls == [37, 1]
    assert self_check_results()[("moe_router_topk", "fakegpu", (E, K, True, str(mx.float32)))] \
        == (True, "passed")
    assert mx.array_equal(y, stock(x)).item()
    # the routing path (and whether a residual goes in) is in the cache key
    assert (False, None, "fakegpu", False) in fused._compiled
    fused(inputs((1, 1, H), seed=2))  # verdict cached, graph reused: nothing new
    assert router.calls == [37, 1]
    y = fused(inputs((2, 37, H)))  # prefill runs eagerly, also on the kernel
    assert router.calls == [37, 1, 74]
    assert rel_l2(y, stock(inputs((2, 37, H)))) <= 1e-6

    fused.use_kernel = False  # the moe-kernel optimization off
    fused(inputs((1, 3, H)))
    fused.use_kernel = True
    fused.train()
    fused(inputs((1, 4, H)))
    fused.eval()
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    fused(inputs((1, 5, H)))
    assert router.calls == [37, 1, 74]


def test_router_kernel_only_for_the_checked_logits_dtype(monkeypatch):
    # bfloat16 activations through a float32 gate give float32 logits: the
    # block checked the kernel for bf16 logits, so it routes the portable way.
    router = FakeRouter()
    _fake_router(monkeypatch, router)
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock, compile_decode=False)
    x = inputs((1, 2, H), dtype=mx.bfloat16)
    assert fused.gate(x).dtype == mx.float32
    y = fused(x)
    assert router.calls == [37]  # the self-check only
    assert mx.array_equal(y, stock(x)).item()


def test_wrong_router_kernel_is_rejected(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning, self_check_results

    router = FakeRouter(wrong=True)
    _fake_router(monkeypatch, router)
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = inputs((1, 1, H))
    with pytest.warns(KernelSelfCheckWarning, match="moe_router_topk failed its self-check"):
        y = fused(x)
    passed, message = self_check_results()[("moe_router_topk", "fakegpu",
                                            (E, K, True, str(mx.float32)))]
    assert not passed and "output 0 relative L2 error" in message  # the expert sets
    assert mx.array_equal(y, stock(x)).item()  # the portable route ran
    assert router.calls == [37]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is cached: no second warning
        fused(inputs((1, 2, H)))
    assert router.calls == [37]


def test_router_kernel_gates(monkeypatch):
    router = FakeRouter()
    _fake_router(monkeypatch, router)
    ok = mx.zeros((1, 256), mx.bfloat16)
    assert moe_ops.router_kernel_ready(ok, 8, True) == "fakegpu"
    assert moe_ops.router_kernel_ready(mx.zeros((3, 5, 1024), mx.float16), 32, False) == "fakegpu"
    for logits, k in ((mx.zeros((1, 1025)), 8), (mx.zeros((1, 64)), 33), (mx.zeros((1, 4)), 5),
                      (mx.zeros((1, 64), mx.int32), 8), (ok, 0)):
        assert moe_ops.router_kernel_ready(logits, k, True) is None
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    assert moe_ops.router_kernel_ready(ok, 8, True) is None
    assert router.calls == [37, 37]  # two shape classes checked, once each


def test_kernel_choice_is_kept_per_shape_and_weights(monkeypatch):
    # The readiness checks run once per shape class; a replaced weight or a
    # changed kernel switch decides again; outputs are unchanged.
    stock = make_stock()
    fused = FusedSparseMoeBlock.from_stock(stock)
    calls = []
    real_router, real_fold = fused._router_ready, fused._fold_ready
    monkeypatch.setattr(fused, "_router_ready", lambda x: calls.append("router") or real_router(x),
                        raising=False)
    monkeypatch.setattr(fused, "_fold_ready", lambda x: calls.append("fold") or real_fold(x),
                        raising=False)
    x = mx.random.normal((1, 1, H), key=mx.random.key(3))
    ref = stock(x)
    # The first call decides, and traces the compiled decode graph, which
    # re-wraps the module's arrays (new identities): the second decides
    # once more; from then on the choice is reused.
    fused(x)
    fused(x)
    del calls[:]
    for _ in range(3):
        assert mx.allclose(fused(x), ref, atol=1e-5).item()
    assert calls == []
    fused(mx.random.normal((1, 40, H), key=mx.random.key(5)))  # prefill: routing only
    assert calls == ["router"]
    del calls[:]
    fused.switch_mlp.down_proj.weight = fused.switch_mlp.down_proj.weight * 1.0
    fused(x)
    assert calls == ["router", "fold"]
    del calls[:]
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    fused(x)
    assert calls == ["router", "fold"]


def test_a_subclass_with_its_own_call_is_not_handed_the_residual():
    # layers/norm.py passes residual= only to blocks whose __call__ takes it.
    class Mine(FusedSparseMoeBlock):
        def __call__(self, x):
            return super().__call__(x)

    class Same(FusedSparseMoeBlock):
        pass

    assert FusedSparseMoeBlock.takes_residual and Same.takes_residual
    assert not Mine.takes_residual
    # Nor does add_norm_forward compute what such a __call__ would.
    assert FusedSparseMoeBlock.takes_mixer_output and Same.takes_mixer_output
    assert not Mine.takes_mixer_output


# --------------------------------------------------------------------------
# The counting kernels' counter (moe_add_norm_route, the next-norm fold):
# copied per launch, or read in place inside the compiled decode step's trace
# --------------------------------------------------------------------------


def test_serial_counter_and_trace_marker():
    a, b = moe_ops.serial_counter(), moe_ops.serial_counter()
    assert a is not b and a.dtype == mx.uint32 and a.shape == (moe_ops.FOLD_NORM_MAX_ROWS,)
    assert not mx.any(a).item() and a.nbytes >= 16
    # One row would be 4 bytes: allocated as 4 rows (MLX's small pool).
    assert moe_ops.serial_counter(1).shape == (4,)
    with pytest.raises(ValueError, match="at least one row, got rows=0"):
        moe_ops.serial_counter(0)
    assert not moe_ops.serial_decode_tracing()
    with pytest.raises(RuntimeError, match="boom"):
        with moe_ops.serial_decode_trace():
            assert moe_ops.serial_decode_tracing()
            raise RuntimeError("boom")
    assert not moe_ops.serial_decode_tracing()


def test_add_norm_route_reads_the_blocks_own_counter_in_the_decode_step_trace(monkeypatch):
    # Outside the compiled decode step every launch gets a copy of one
    # zero-strided view (a copy kernel each); inside its trace each block
    # passes its own buffer, the same one every time, to every counting launch.
    seen = []

    def route(x, r, w, eps, gate, k, norm_topk, backend=None, counter=None):
        seen.append(counter)
        h = x + r
        lead = x.shape[:-1]
        return h, h, None, mx.zeros((*lead, k), dtype=mx.uint32), mx.zeros((*lead, k), x.dtype)

    monkeypatch.setattr(moe_layer, "add_norm_route", route)
    monkeypatch.setattr(moe_layer, "moe_shared_experts_kernel",
                        lambda fold: (lambda *args, residual: residual * 2))
    monkeypatch.setattr(FusedSparseMoeBlock, "_kernel_choice",
                        lambda self, *a, **k: (None, "fake", "fake", None, None))
    blocks = [FusedSparseMoeBlock.from_stock(make_stock(seed=s)) for s in (0, 1)]
    norm = nn.RMSNorm(H)
    x, r = inputs((1, 1, H)), inputs((1, 1, H), seed=3)
    for compiled in (False, True):
        seen.clear()
        for b in blocks:
            b.compile_decode = compiled
            out, out_norm = b.add_norm_forward(x, r, norm)
            assert out_norm is None and mx.allclose(out, 2 * (x + r)).item()
        assert len(seen) == 2 and all(c is moe_ops.fold_norm_counter() for c in seen)
        seen.clear()
        with moe_ops.serial_decode_trace():
            for b in blocks * 2:
                out, _ = b.add_norm_forward(x, r, norm)
                assert mx.allclose(out, 2 * (x + r)).item()
        # Compiled: traced once per block (the second call replays).
        assert len(seen) == (2 if compiled else 4)
        own = [b.__dict__["_serial_counter"] for b in blocks]
        assert own[0] is not own[1] and all(c is own[i % 2] for i, c in enumerate(seen))
        assert all(c.shape == (moe_ops.FOLD_NORM_MAX_ROWS,) and c.dtype == mx.uint32
                   and not mx.any(c).item() for c in own)
    # The compiled graphs of the two counters are kept apart (the key's seventh
    # entry is serial: "add_norm_route", route, fold, eps, down norm, next eps, serial, ...).
    assert {k[6] for k in blocks[0]._compiled} == {False, True}


def test_moe_decode_block_checks_its_arguments_before_it_needs_a_kernel():
    # The argument errors name what is wrong on any device; only a call that
    # passes them asks for the CUDA kernel (on the CPU: none).
    from qwen_apple_backend.ops.moe import ExpertWeights, NextProjection, OutProjection

    x = mx.zeros((1, 1, 1024), mx.bfloat16)
    w4, s4, b4 = mx.quantize(mx.zeros((1024, 2048), mx.bfloat16), group_size=64, bits=4)
    op = OutProjection(mx.zeros((1, 1, 2048), mx.bfloat16),
                       ExpertWeights(w4, s4, b4, group_size=64, bits=4))
    w8, s8, b8 = mx.quantize(mx.zeros((1024, 2048), mx.bfloat16), group_size=64, bits=8)
    bad_op = op._replace(weights=ExpertWeights(w8, s8, b8, group_size=64, bits=8))
    np8 = NextProjection(mx.ones((1024,), mx.bfloat16), 1e-6,
                         ExpertWeights(*mx.quantize(mx.zeros((64, 1024), mx.bfloat16), 64, 8),
                                       group_size=64, bits=8))
    call = lambda r, **kw: moe_ops.moe_decode_block(  # noqa: E731
        x, r, x[0, 0], 1e-6, None, 8, True, None, None, None, "cpu", **kw)
    with pytest.raises(ValueError, match="r must be None with out_proj"):
        call(x, out_proj=op)
    with pytest.raises(ValueError, match=r"^out_proj: 8-bit affine weight"):
        call(None, out_proj=bad_op)
    with pytest.raises(ValueError, match=r"^next_proj: 8-bit affine weight"):
        call(x, next_proj=np8)
    with pytest.raises(ValueError, match="must have x's shape"):
        call(None)
    assert not moe_ops.out_projection_supported(x, op._replace(weights=None))
    with pytest.raises((RuntimeError, AttributeError)):
        call(x)  # valid arguments: then the kernel (none here) or the weights are needed


@pytest.mark.parametrize("ready", [True, False], ids=["block-projects", "projected-first"])
def test_add_norm_forward_takes_a_deferred_out_projection(monkeypatch, ready):
    # moe-block-out-proj: given the mixer's output before its 4-bit output
    # projection, a ready block build runs the projection as its first phase
    # (moe_decode_block gets out_proj = that input and the projection's
    # arrays, and no r); when that build is not ready, or out_proj_phase is
    # off, the projection runs first (the DeferredProjection's apply) and the
    # block gets r as before.
    from qwen_apple_backend.layers import moe as moe_layer
    from qwen_apple_backend.layers.linear import DeferredProjection

    calls = []

    def block(x, r, w, eps, gate, k, norm_topk, gu, dn, sw, backend, counter=None,
              prefetch=(), out_proj=None, next_proj=None, overrides=None):
        calls.append((r, out_proj))
        if out_proj is not None:
            ow = out_proj.weights
            r = mx.quantized_matmul(out_proj.x, ow.weight, ow.scales, ow.biases,
                                    group_size=ow.group_size, bits=4)
        return (x + r) * 3

    def choice(self, x, decode, norm=None, next_norm=None, out_proj=None, next_proj=None):
        ok = ready or out_proj is None
        return (None, "fake", "fake", None, "fake" if ok else None)

    monkeypatch.setattr(moe_layer, "moe_decode_block", block)
    monkeypatch.setattr(FusedSparseMoeBlock, "_kernel_choice", choice)
    b = FusedSparseMoeBlock.from_stock(make_stock(seed=4))
    assert b.out_proj_phase and FusedSparseMoeBlock.takes_out_proj
    proj = nn.QuantizedLinear(1024, H, bias=False, group_size=64, bits=4)
    norm = nn.RMSNorm(H)
    x, pre = inputs((1, 1, H)), inputs((1, 1, 1024), seed=5)
    want = (x + proj(pre)) * 3
    for compiled in (False, True):
        b.compile_decode = compiled
        calls.clear()
        out, _ = b.add_norm_forward(x, DeferredProjection(pre, proj), norm)
        assert mx.allclose(out, want, atol=1e-5).item()
        (r, op), = calls
        if ready:
            assert r is None and op.weights.group_size == 64 and op.x.shape == pre.shape
        else:  # (inside a compiled call r is a trace placeholder)
            assert op is None and (compiled or mx.allclose(r, proj(pre)).item())
    b.compile_decode = False  # (a compiled replay would not call the stand-in again)
    b.out_proj_phase = False
    calls.clear()
    out, _ = b.add_norm_forward(x, DeferredProjection(pre, proj), norm)
    assert calls[0][1] is None and mx.allclose(out, want, atol=1e-5).item()
    # A projection the phase does not take (8-bit) runs first as well.
    b.out_proj_phase = True
    calls.clear()
    proj8 = nn.QuantizedLinear(1024, H, bias=False, group_size=64, bits=8)
    out, _ = b.add_norm_forward(x, DeferredProjection(pre, proj8), norm)
    assert calls[0][1] is None and mx.allclose(out, (x + proj8(pre)) * 3, atol=1e-5).item()


def test_add_norm_forward_runs_the_one_launch_block_with_its_longer_counter(monkeypatch):
    # moe-block: with a block backend the whole MoE half is one
    # moe_decode_block call, counting in a buffer of decode_block_counter_length
    # elements: its own serial one inside the decode step's trace (kept apart
    # from the three-launch path's), else the per-launch copy of a zero view;
    # one_launch off (QAB_DISABLE=moe-block) keeps the three launches;
    # stage_down (on by default; QAB_DISABLE=moe-block-stage clears it)
    # reaches the call as its overrides' STAGE, early_gate_up (on by default;
    # QAB_DISABLE=moe-block-early clears it) as its EARLY, unroll_stage (on by
    # default; QAB_DISABLE=moe-block-unroll clears it) as its UNROLL, npl_items
    # (on by default; QAB_DISABLE=moe-block-npl clears it) as its NPL,
    # roll_dots (on by default; QAB_DISABLE=moe-block-roll clears it) as its ROLL,
    # npg_grid (on by default; QAB_DISABLE=moe-block-npg clears it) as its NPG.
    from qwen_apple_backend.layers import moe as moe_layer

    seen = []
    stages = []

    def block(x, r, w, eps, gate, k, norm_topk, gu, dn, sw, backend, counter=None,
              prefetch=(), out_proj=None, next_proj=None, overrides=None):
        assert out_proj is None
        seen.append((backend, counter))
        stages.append(tuple(overrides[k]
                            for k in ("STAGE", "EARLY", "UNROLL", "NPL", "ROLL", "NPG")))
        return (x + r) * 3

    monkeypatch.setattr(moe_layer, "moe_decode_block", block)
    monkeypatch.setattr(moe_layer, "add_norm_route",
                        lambda *a, **k: pytest.fail("the three-launch path ran"))
    monkeypatch.setattr(FusedSparseMoeBlock, "_kernel_choice",
                        lambda self, *a, **k: (None, "fake", "fake", None,
                                               "fake" if self.one_launch else None))
    b = FusedSparseMoeBlock.from_stock(make_stock(seed=4))
    assert b.one_launch and b.stage_down and b.early_gate_up and b.unroll_stage and b.npl_items
    b.stage_down = False
    b.early_gate_up = False
    b.unroll_stage = False
    b.npl_items = False
    b.roll_dots = False
    b.npg_grid = False
    norm = nn.RMSNorm(H)
    x, r = inputs((1, 1, H)), inputs((1, 1, H), seed=3)
    n = moe_ops.decode_block_counter_length()
    for compiled in (False, True):
        b.compile_decode = compiled
        seen.clear()
        out, out_norm = b.add_norm_forward(x, r, norm)
        assert out_norm is None and mx.allclose(out, 3 * (x + r)).item()
        assert seen == [("fake", moe_ops.fold_norm_counter(n))]
        assert seen[0][1].shape == (n,)
        seen.clear()
        with moe_ops.serial_decode_trace():
            out, _ = b.add_norm_forward(x, r, norm)
        assert mx.allclose(out, 3 * (x + r)).item()
        own = b.__dict__["_serial_block_counter"]
        assert "_serial_counter" not in b.__dict__
        assert own.shape == (n,) and own.dtype == mx.uint32 and not mx.any(own).item()
        assert seen == [("fake", own)]
    assert stages == [(False, False, False, False, False, False)] * 4
    # (Compiled calls, compile_decode left on: each switch is part of the
    # compiled graph's key, so each change reaches the call in a new trace.)
    switches = ("stage_down", "early_gate_up", "unroll_stage", "npl_items", "roll_dots",
                "npg_grid")
    for i, name in enumerate(switches):
        setattr(b, name, True)
        b.add_norm_forward(x, r, norm)
        assert stages[-1] == tuple(j <= i for j in range(len(switches))), name
    for name in switches:
        setattr(b, name, False)
    b.one_launch = False
    monkeypatch.setattr(moe_layer, "add_norm_route",
                        lambda x, r, *a, **k: (x + r, x + r, None,
                                               mx.zeros((1, 1, 8), dtype=mx.uint32),
                                               mx.zeros((1, 1, 8), x.dtype)))
    monkeypatch.setattr(moe_layer, "moe_shared_experts_kernel",
                        lambda fold: (lambda *args, residual: residual * 2))
    seen.clear()
    out, _ = b.add_norm_forward(x, r, norm)
    assert seen == [] and mx.allclose(out, 2 * (x + r)).item()


def test_decode_block_build_applies_an_overrides_mapping():
    # The one-launch block's build overrides travel as one mapping keyed by
    # DECODE_BLOCK_OPTIONS flag names: _decode_block_build puts in the keys
    # given (as bools; an absent key or None keeps the default), sets PF only
    # with EARLY, and refuses a key that is not a DECODE_BLOCK_OPTIONS flag
    # (an unknown name, an option of another type, a derived build value),
    # naming it.
    opts = moe_ops.DECODE_BLOCK_OPTIONS
    assert moe_ops._decode_block_build() == {**opts, "PF": False, "OP": False, "NP": False}
    assert moe_ops._decode_block_build({}) == moe_ops._decode_block_build()
    got = moe_ops._decode_block_build({"STAGE": False, "NPL": 0, "UNROLL": None}, True,
                                      True, True)
    assert got == {**opts, "STAGE": False, "NPL": False, "PF": True, "OP": True, "NP": True}
    assert got["NPL"] is False and got["UNROLL"] is opts["UNROLL"]
    for flag in ("STAGE", "EARLY", "UNROLL", "NPL", "ROLL"):
        for value in (False, True):
            build = moe_ops._decode_block_build({flag: value})
            assert build[flag] is value
            assert {k: v for k, v in build.items() if k != flag} == {
                k: v for k, v in moe_ops._decode_block_build().items() if k != flag}
    assert not moe_ops._decode_block_build({"EARLY": False}, prefetch=True)["PF"]
    # NPS, the one option of another type an override may set, stays an int.
    assert moe_ops._decode_block_build({"NPS": 2})["NPS"] == 2
    assert moe_ops._decode_block_build({"NPS": True})["NPS"] == 1
    # Values: a flag's True / False / 1 / 0, an int option's DECODE_BLOCK_CHOICES.
    for key, value, allowed in (("RPL", 2, "True, False, 1 or 0"),
                                ("STAGE", "yes", "True, False, 1 or 0"),
                                ("NPS", 3, "0, 1, 2"), ("NPS", 1.0, "0, 1, 2")):
        with pytest.raises(ValueError, match=rf"build overrides: {key}={value!r} is not one of "
                                             rf"{allowed}$"):
            moe_ops._decode_block_build({key: value})
    for bad in ("BOGUS", "PRW", "PF"):
        with pytest.raises(ValueError, match=rf"build overrides: '{bad}' is not a "
                                             r"DECODE_BLOCK_OPTIONS flag \(the flags: .*NPL"):
            moe_ops._decode_block_build({"STAGE": False, bad: True})


def test_block_keywords_become_one_overrides_mapping(monkeypatch):
    # moe_decode_block's and decode_block_ready's stage / early / unroll / npl
    # keywords (None: the default) are turned into that mapping once, at the
    # entry, merged with an overrides mapping given; a keyword that disagrees
    # with the mapping, or an unknown key, is refused before anything runs.
    assert moe_ops._build_overrides(stage=None, early=False, unroll=None, npl=True) == {
        "EARLY": False, "NPL": True}
    assert moe_ops._build_overrides(roll=False) == {"ROLL": False}
    with pytest.raises(ValueError, match=r"roll=True disagrees with overrides\['ROLL'\]"):
        moe_ops._build_overrides({"ROLL": False}, roll=True)
    assert moe_ops._build_overrides({"UNROLL": False, "STAGE": None}, stage=True) == {
        "UNROLL": False, "STAGE": True}
    assert moe_ops._build_overrides({"NPL": True}, npl=True) == {"NPL": True}
    with pytest.raises(ValueError, match=r"unroll=True disagrees with overrides\['UNROLL'\]"):
        moe_ops._build_overrides({"UNROLL": False}, unroll=True)
    seen = []
    monkeypatch.setattr(moe_ops, "_moe_decode_block_call",
                        lambda *a, **k: seen.append(("call", a[12])))
    monkeypatch.setattr(moe_ops, "_decode_block_ready",
                        lambda *a, **k: seen.append(("ready", a[9])))
    counter = mx.zeros((moe_ops.decode_block_counter_length(),), dtype=mx.uint32)
    args = (None,) * 10
    moe_ops.moe_decode_block(*args, "cuda", counter, stage=False, unroll=True)
    moe_ops.moe_decode_block(*args, "cuda", counter, early=False, overrides={"NPL": False})
    moe_ops.decode_block_ready(*args[:9], npl=False, early=None)
    moe_ops.decode_block_ready(*args[:9], overrides={"STAGE": True})
    assert seen == [("call", {"STAGE": False, "UNROLL": True}),
                    ("call", {"NPL": False, "EARLY": False}),
                    ("ready", {"NPL": False}), ("ready", {"STAGE": True})]
    seen.clear()
    with pytest.raises(ValueError, match="'BOGUS' is not a DECODE_BLOCK_OPTIONS flag"):
        moe_ops.moe_decode_block(*args, "cuda", counter, overrides={"BOGUS": False})
    with pytest.raises(ValueError, match="'BOGUS' is not a DECODE_BLOCK_OPTIONS flag"):
        moe_ops.decode_block_ready(*args[:9], overrides={"BOGUS": False})
    with pytest.raises(ValueError, match="stage=False disagrees"):
        moe_ops.moe_decode_block(*args, "cuda", counter, stage=False,
                                 overrides={"STAGE": True})
    assert seen == []


def test_fused_block_passes_its_switches_as_one_overrides_mapping():
    # FusedSparseMoeBlock's build switches (QAB_DISABLE's moe-block-stage,
    # -early, -unroll, -npl, -roll, -npg clear them; QAB_ENABLE's moe-block-rpl and
    # moe-block-nps set theirs) are the one mapping its calls pass.
    b = FusedSparseMoeBlock.from_stock(make_stock(seed=4))
    assert b._block_overrides() == {"STAGE": True, "EARLY": True, "UNROLL": True, "NPL": True,
                                    "ROLL": True, "NPG": True, "RPL": False, "NPS": 0}
    b.early_gate_up = False
    b.npl_items = False
    b.roll_dots = False
    b.npg_grid = False
    b.preload_norm = True  # (the opt-in moe-block-rpl)
    b.nps_mode = 2  # (the opt-in moe-block-nps sets ops.moe.NPS_MODE)
    assert b._block_overrides() == {"STAGE": True, "EARLY": False, "UNROLL": True,
                                    "NPL": False, "ROLL": False, "NPG": False, "RPL": True,
                                    "NPS": 2}
    assert moe_ops._decode_block_build(b._block_overrides())["NPG"] is False
    assert moe_ops._decode_block_build(b._block_overrides())["RPL"] is True
    assert moe_ops._decode_block_build(b._block_overrides())["EARLY"] is False
    assert moe_ops._decode_block_build(b._block_overrides())["NPS"] == 2


def test_nps_build_is_a_persistent_grid_of_two_blocks_per_sm(monkeypatch):
    # NPS (moe-block-nps) needs the next-projection phase and a persistent
    # grid: _nps_build makes the build PERSIST with two blocks per SM (the
    # CUDA driver's count) and NPS_ROWS rows per unit unless GRID / PSM are
    # set, NPS 2 with its dot loops unrolled (ROLL off: rolled it spills);
    # without NP, off CUDA or with the SM count unknown (0) it drops NPS,
    # leaving the plain build.
    monkeypatch.setattr(moe_ops, "cuda_sm_count", lambda: 132)
    opts = moe_ops._decode_block_build({"NPS": 1}, next_proj=True)
    moe_ops._nps_build(opts, "cuda")
    assert (opts["NPS"], opts["PERSIST"], opts["PSM"], opts["GRID"], opts["ROLL"]) == (
        1, True, moe_ops.NPS_ROWS, 264, True)
    opts = moe_ops._decode_block_build({"NPS": 2}, next_proj=True)
    opts.update(PSM=64, GRID=200)
    moe_ops._nps_build(opts, "cuda")
    assert (opts["NPS"], opts["PERSIST"], opts["PSM"], opts["GRID"], opts["ROLL"]) == (
        2, True, 64, 200, False)
    plain = moe_ops._decode_block_build(next_proj=True)
    for build, backend, sms in (({"NPS": 1}, "cuda", 132), ({"NPS": 1}, "metal", 132),
                                ({"NPS": 1}, "cuda", 0)):
        monkeypatch.setattr(moe_ops, "cuda_sm_count", lambda sms=sms: sms)
        opts = moe_ops._decode_block_build(build, next_proj=backend != "cuda" or sms == 0)
        moe_ops._nps_build(opts, backend)
        assert opts["NPS"] == 0 and not opts["PERSIST"] and opts["PSM"] == plain["PSM"], (
            build, backend, sms)
    monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, "NPS", 3)
    with pytest.raises(ValueError, match="NPS .* must be 0, 1 or 2, got NPS=3"):
        moe_ops._check_decode_block_build(moe_ops._decode_block_build(), 512, None)


@pytest.mark.parametrize("ready", [True, False], ids=["next-proj", "not-ready"])
def test_add_norm_forward_runs_the_next_projection_phase(monkeypatch, ready):
    # moe-block-next-proj: given the next layer's input norm and a mixer with a
    # valid 4-bit concatenated projection, a block with next_proj_phase set asks
    # for the NP build and, when ready, passes moe_decode_block a
    # NextProjection of that norm's weight and eps and the concatenation's
    # arrays, and returns its second output as a ProjectedInput of that mixer.
    # Not ready, switched off, another norm class, a mixer that does not take
    # a projected input, or more rows than the mixer's own launch: no NP.
    from qwen_apple_backend.layers import moe as moe_layer
    from qwen_apple_backend.layers.linear import ProjectedInput

    calls = []

    def block(x, r, w, eps, gate, k, norm_topk, gu, dn, sw, backend, counter=None,
              prefetch=(), out_proj=None, next_proj=None, overrides=None):
        calls.append(next_proj)
        out = (x + r) * 3
        if next_proj is None:
            return out
        return out, mx.full((*x.shape[:-1], next_proj.weights.weight.shape[0]), 2.0, x.dtype)

    def choice(self, x, decode, norm=None, next_norm=None, out_proj=None, next_proj=None):
        ok = ready or next_proj is None
        return (None, "fake", "fake", None, "fake" if ok else None)

    monkeypatch.setattr(moe_layer, "moe_decode_block", block)
    monkeypatch.setattr(FusedSparseMoeBlock, "_kernel_choice", choice)
    monkeypatch.setattr(moe_layer, "next_projection_supported", lambda x, np_: True)
    q, s, b = mx.quantize(inputs((96, H)), group_size=64, bits=4)

    class Cat:
        kind = ("q", 64, 4, "affine")
        cat = {"weight": q, "scales": s, "biases": b}

        def valid(self, owner):
            return True

        def _quantized_with_biases(self):
            return True

    class Mixer:
        takes_projected = True
        training = False
        _proj_cat = Cat()

    mixer, next_norm, norm = Mixer(), nn.RMSNorm(H, eps=1e-5), nn.RMSNorm(H)
    b = FusedSparseMoeBlock.from_stock(make_stock(seed=4))
    assert b.next_proj_phase  # on by default
    b.next_proj_phase = False
    x, r = inputs((1, 1, H)), inputs((1, 1, H), seed=3)

    def run(**kw):
        calls.clear()
        out, nxt = b.add_norm_forward(x, r, norm, **kw)
        assert mx.allclose(out, (x + r) * 3).item()
        return nxt, calls[-1]

    b.compile_decode = False
    assert run(next_layer=(next_norm, mixer)) == (None, None)  # switched off
    b.next_proj_phase = True
    nxt, np_ = run(next_layer=(next_norm, mixer))
    if ready:
        assert isinstance(nxt, ProjectedInput) and nxt.mixer is mixer
        assert nxt.y.shape == (1, 1, 96) and mx.all(nxt.y == 2).item()
        assert np_.norm_weight is next_norm["weight"] and np_.eps == 1e-5
        assert np_.weights.weight is q and np_.weights.group_size == 64
    else:
        assert nxt is None and np_ is None
    assert run(next_layer=(nn.LayerNorm(H), mixer)) == (None, None)
    Mixer.takes_projected = False
    assert run(next_layer=(next_norm, mixer)) == (None, None)
    Mixer.takes_projected = True
    x, r = inputs((1, 5, H)), inputs((1, 5, H), seed=3)  # 5 > GEMV_MAX_ROWS
    assert run(next_layer=(next_norm, mixer)) == (None, None)


# A Qwen3.5-MoE preset whose MoE blocks take the packed decode layout (an
# 8-bit router, 4-bit experts and shared expert of one group size).
PACK_PRESET = {
    "hidden_size": 1024, "num_hidden_layers": 2, "full_attention_interval": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "rope_parameters": {"mrope_section": [3, 3, 2]},
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}


def _bytes(a: mx.array) -> np.ndarray:
    """``a``'s bytes, row-major (numpy has no bfloat16)."""
    return np.array(mx.view(a.reshape(-1), mx.uint8))


def _pack_block(monkeypatch, preset="pack-cpu"):
    from qwen_apple_backend import checkpoint
    from qwen_apple_backend.bench.target import fuse_in_memory

    monkeypatch.setitem(checkpoint.PRESETS, "pack-cpu", PACK_PRESET)
    m = checkpoint.build_random_model(preset, vocab_size=256, seed=2)
    fuse_in_memory(m, "fused", config=checkpoint.hf_config(preset, 256))
    return m.layers[0].mlp


# "tiny": segments of fewer than 4 bytes (a shared gate of one group: one scale).
@pytest.mark.parametrize("preset", ["pack-cpu", "tiny"])
def test_block_pack_holds_the_block_weights_as_views_of_one_copy(preset, monkeypatch):
    # moe-block-pack: BlockPack.build lays the router's, the shared expert's
    # and the routed experts' 21 arrays out in one uint32 array and puts views
    # of it in the modules: the same values, other objects, and the block's
    # weights held once (the originals freed), not twice.
    block = _pack_block(monkeypatch, preset)
    assert type(block) is FusedSparseMoeBlock
    modules = [moe_layer._walk(block, p) for p in moe_layer.BlockPack.PATHS]
    before = [[_bytes(dict.get(m, n)) for n in ("weight", "scales", "biases")]
              for m in modules]
    expert_bytes = sum(dict.get(m, n).nbytes for m in modules[5:]
                       for n in ("weight", "scales", "biases"))
    mx.synchronize()
    active = mx.get_active_memory()
    pack = moe_layer.BlockPack.build(block)
    assert pack is not None and pack.valid(block)
    pk = pack.cat["pk"]
    assert pk.dtype == mx.uint32 and pk.ndim == 1
    assert pk.nbytes > expert_bytes
    import gc
    gc.collect()
    mx.synchronize()
    # The originals are freed: what the process holds grew by far less than
    # the pack (which, without the views, would hold every array twice).
    assert mx.get_active_memory() - active < 0.25 * pk.nbytes
    offsets = moe_ops.decode_block_pack_offsets(
        moe_layer.linear_weights(block.gate),
        moe_layer.expert_weights(block.switch_mlp.gate_up_proj), block._shared_weights())
    raw = _bytes(pk)
    for k, m in enumerate(modules):
        for j, n in enumerate(("weight", "scales", "biases")):
            a = dict.get(m, n)
            assert np.array_equal(_bytes(a), before[k][j]), (moe_layer.BlockPack.PATHS[k], n)
            at, nbytes = offsets[3 * k + j]
            assert nbytes == a.nbytes
            assert np.array_equal(raw[at:at + nbytes], before[k][j])
    # The shared expert's gate and up projections stay the row views of
    # their concatenation (proj-concat), which stays valid: no pack build
    # switches the one-matmul path of calls outside the block off.
    assert block._use_cat()
    cat = block._shared_cat
    assert [c for c in cat.children] == modules[1:3]
    # A replaced expert array: the pack no longer applies; a new one holds it.
    gu = block.switch_mlp.gate_up_proj
    doubled = gu.scales * 2
    gu.scales = doubled
    assert not pack.valid(block)
    fresh = moe_layer.BlockPack.build(block)
    assert fresh is not None and fresh.valid(block)
    assert gu.scales is not doubled and mx.array_equal(gu.scales, doubled).item()
    at, nbytes = offsets[16]
    assert np.array_equal(_bytes(fresh.cat["pk"])[at:at + nbytes],
                          _bytes(doubled))


def test_block_pack_is_not_built_for_experts_of_another_scales_dtype(monkeypatch):
    # The packed build reads every segment's scales as the activations'
    # dtype: experts whose scales differ from the shared expert's get no pack
    # (the modules keep their arrays; the op's own refusal is tested below).
    block = _pack_block(monkeypatch)
    gu = block.switch_mlp.gate_up_proj
    gu.scales = gu.scales.astype(mx.float32)
    gu.biases = gu.biases.astype(mx.float32)
    kept = gu.weight
    assert moe_layer.BlockPack.build(block) is None
    assert gu.weight is kept


def test_block_pack_stays_valid_when_a_short_prompt_traces(monkeypatch):
    # A call of fewer than SORT_THRESHOLD token-expert rows runs the block's
    # own compiled forward, whose trace (each new length) re-wraps the
    # module's arrays in new objects: the pack, valid before the call, is
    # re-recorded, so the next decode token does not pack the experts again.
    block = _pack_block(monkeypatch)
    assert block.compile_decode and not block.training
    pack = block._new_block_pack()
    assert pack is not None
    for t in (3, 5, 3):
        x = mx.random.normal((1, t, 1024), key=mx.random.key(t)).astype(mx.bfloat16)
        mx.eval(block(x))
        assert block.__dict__["_block_pack"] is pack and pack.valid(block), t
    assert pack.refreshes >= 2


def test_block_pack_no_longer_valid_is_dropped_by_the_next_call(monkeypatch):
    # After an array is replaced (load_weights, update), the block's next
    # call (a prefill) drops the stale pack, which holds a copy of the old
    # experts, rather than keeping it until the next decode token.
    import gc
    import weakref

    block = _pack_block(monkeypatch)
    pack = block._new_block_pack()
    assert pack is not None
    gone = weakref.ref(pack)
    x = mx.random.normal((1, 16, 1024), key=mx.random.key(3)).astype(mx.bfloat16)
    mx.eval(block(x))  # 64 token-expert rows: the eager path
    assert block.__dict__.get("_block_pack") is pack  # still valid: kept
    dn = block.switch_mlp.down_proj
    dn.weight = dn.weight + 0
    del pack
    mx.eval(block(x))
    assert "_block_pack" not in block.__dict__
    gc.collect()
    assert gone() is None


def test_decode_block_pack_refuses_a_pack_past_mlx_shapes(monkeypatch):
    # MLX's shapes are 32-bit: a pack of more bytes than that (a layer of
    # Qwen3.5-397B-A17B's experts) would overflow its byte view. It is
    # refused by name, and BlockPack.build leaves the modules as they are.
    block = _pack_block(monkeypatch)
    gate = moe_layer.linear_weights(block.gate)
    gu = moe_layer.expert_weights(block.switch_mlp.gate_up_proj)
    dn = moe_layer.expert_weights(block.switch_mlp.down_proj)
    sizes = moe_ops.decode_block_pack_segments(gate, gu, block._shared_weights())
    total = sum(-(-n // moe_ops.PACK_ALIGN) * moe_ops.PACK_ALIGN for n in sizes)
    assert moe_ops.decode_block_pack_bytes(gate, gu, block._shared_weights()) == total
    pk = moe_ops.decode_block_pack(gate, gu, dn, block._shared_weights())
    assert pk.nbytes == total
    monkeypatch.setattr(moe_ops, "PACK_MAX_BYTES", total - 1)
    with pytest.raises(ValueError, match=f"{total} bytes of segments exceed"):
        moe_ops.decode_block_pack(gate, gu, dn, block._shared_weights())
    kept = block.switch_mlp.gate_up_proj.weight
    assert moe_layer.BlockPack.build(block) is None
    assert block.switch_mlp.gate_up_proj.weight is kept


def test_packed_block_refuses_experts_scales_of_another_dtype_than_x():
    # The packed build reads every segment's scales as x's dtype: a call
    # whose experts' scales are of another dtype is refused before any launch.
    from .test_kernels_gpu import _block_case

    x, r, w, gate, gu, dn, sw = _block_case((1, 16, 1024, 64, 4, 8), mx.bfloat16, 64)
    pk = moe_ops.decode_block_pack(gate, gu, dn, sw)
    with pytest.raises(ValueError, match="must be of x's dtype mlx.core.float16"):
        moe_ops.moe_decode_block(x.astype(mx.float16), r.astype(mx.float16),
                                 w.astype(mx.float16), 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                 pack=pk)


def test_block_pack_is_not_built_for_a_subclass_of_the_expert_linear(monkeypatch):
    # A subclass of the experts' linear (an adapter wrapper, say) may compute
    # something else than a plain 4-bit matmul of its arrays: no pack, and
    # the modules keep their arrays (as for the router and shared expert,
    # which must be plain nn.QuantizedLinear).
    block = _pack_block(monkeypatch)
    dn = block.switch_mlp.down_proj

    class Adapted(type(dn)):
        pass

    dn.__class__ = Adapted
    kept = block.switch_mlp.gate_up_proj.weight
    assert moe_layer.BlockPack.build(block) is None
    assert block.switch_mlp.gate_up_proj.weight is kept
