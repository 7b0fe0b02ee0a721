"""FusedGQAAttention and ops.attention against stock mlx-lm's Qwen3NextAttention.

Measured on the CPU (MLX 0.32.4, mlx-lm 0.32.2): outputs and KV-cache contents
are bit-for-bit equal to stock (rel-L2 0.0) in float32 and bfloat16, with and
without a cache, for every configuration below. bf16 vs a float32 reference
drifts by rel-L2 ~3e-3 (measured), inside the bf16 budget used here.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache
from mlx_lm.models.qwen3_5 import TextModelArgs
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from qwen_apple_backend.layers.attention import FusedGQAAttention, rope_spec
from qwen_apple_backend.ops import attention as attn_ops

from ._metrics import assert_close
from ._metrics import mx_rel_l2 as rel_l2

REAL_ROPE = {
    "rope_type": "default",
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
    "rope_theta": 10_000_000,
    "partial_rotary_factor": 0.25,
}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def make_args(hidden=512, heads=16, kv_heads=2, head_dim=256, rope=None, rope_scaling=None):
    args = TextModelArgs(
        model_type="qwen3_5_moe_text",
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_parameters=dict(rope or REAL_ROPE),
    )
    if rope_scaling is not None:
        args.rope_scaling = rope_scaling
    return args


def make_pair(seed=0, dtype=mx.float32, **kw):
    mx.random.seed(seed)
    stock = Qwen3NextAttention(make_args(**kw))
    # Non-trivial norm weights (stock inits them to ones).
    stock.q_norm.weight = 1.0 + 0.1 * mx.random.normal(stock.q_norm.weight.shape)
    stock.k_norm.weight = 1.0 + 0.1 * mx.random.normal(stock.k_norm.weight.shape)
    stock.update(tree_map(lambda a: a.astype(dtype), stock.parameters()))
    stock.eval()
    mx.eval(stock.parameters())
    return stock, FusedGQAAttention.from_stock(stock)


def inputs(shape, seed=1, dtype=mx.float32):
    mx.random.seed(seed)
    return mx.random.normal(shape).astype(dtype)


def run_steps(layer, xs, make_cache):
    """Prefill then decode through ``layer``; returns outputs and the cache."""
    cache = make_cache()
    outs = []
    for x in xs:
        mask = create_attention_mask(x, cache)
        outs.append(layer(x, mask=mask, cache=cache))
    return outs, cache


# --------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------

CONFIGS = [
    # real Qwen3.6 attention heads: 16 q / 2 kv, head_dim 256, 64 rotary dims
    dict(hidden=512, heads=16, kv_heads=2, head_dim=256),
    # odd sizes: 3 q heads on 1 kv head (MQA), head_dim 72 -> 18 rotary dims,
    # rotary span not a multiple of 8 and the heads not a power of two
    dict(hidden=96, heads=3, kv_heads=1, head_dim=72,
         rope={**REAL_ROPE, "mrope_section": [3, 3, 3]}),
    # 6 q / 3 kv (group 2), head_dim 64 -> 16 rotary dims
    dict(hidden=192, heads=6, kv_heads=3, head_dim=64,
         rope={**REAL_ROPE, "mrope_section": [3, 3, 2]}),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["real", "mqa-odd", "gqa2"])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 7), (3, 13)])
def test_no_cache_matches_stock_fp32(cfg, B, T):
    stock, fused = make_pair(**cfg)
    x = inputs((B, T, cfg["hidden"]))
    mask = "causal" if T > 1 else None
    y, ref = fused(x, mask=mask), stock(x, mask=mask)
    assert y.dtype == mx.float32
    # measured: 0.0
    assert rel_l2(y, ref) <= 1e-5
    assert_close(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "cfg,dtype",
    [(CONFIGS[0], mx.float32), (CONFIGS[1], mx.float32), (CONFIGS[0], mx.bfloat16)],
    ids=["real-fp32", "mqa-odd-fp32", "real-bf16"],
)
def test_prefill_then_decode_with_cache(cfg, dtype):
    stock, fused = make_pair(dtype=dtype, **cfg)
    h = cfg["hidden"]
    # prefill 11, three decode steps, then a 5-token chunk after the cache
    xs = [inputs((2, n, h), seed=s, dtype=dtype) for s, n in enumerate([11, 1, 1, 1, 5])]
    ys, cf = run_steps(fused, xs, KVCache)
    refs, cs = run_steps(stock, xs, KVCache)
    for step, (y, ref) in enumerate(zip(ys, refs)):
        assert y.dtype == dtype
        if dtype == mx.float32:
            assert rel_l2(y, ref) <= 1e-5, step
        else:
            # measured: 0.0 against stock bf16
            assert_close(y, ref, rtol=1e-2, atol=1e-2, name=f"step {step}")
    assert cf.offset == cs.offset == 19
    k_f, v_f = cf.keys_and_values()
    k_s, v_s = cs.keys_and_values()
    # Bit-equal on the CPU and on the H200 (measured).
    assert rel_l2(k_f, k_s) <= 1e-6 and rel_l2(v_f, v_s) <= 1e-6
    assert k_f.shape[1] == cfg["kv_heads"]  # the cache holds KV heads, not Hq


def test_bf16_drift_against_fp32():
    stock32, _ = make_pair()
    _, fused16 = make_pair(dtype=mx.bfloat16)
    x = inputs((2, 9, 512))
    ref = stock32(x, mask="causal")
    y = fused16(x.astype(mx.bfloat16), mask="causal")
    # measured rel-L2 ~3e-3 (bf16 weights and activations)
    assert rel_l2(y, ref) <= 2e-2
    assert_close(y, ref, rtol=1e-2, atol=5e-2)


def test_array_masks_match_stock():
    stock, fused = make_pair()
    x = inputs((2, 6, 512))
    bool_mask = create_attention_mask(x, None, return_array=True)
    assert bool_mask.dtype == mx.bool_
    additive = mx.where(bool_mask, 0.0, -1e9).astype(mx.float32)
    for mask in (bool_mask, additive, "causal", None):
        assert rel_l2(fused(x, mask=mask), stock(x, mask=mask)) <= 1e-5


def test_batch_cache_left_padding_array_offsets():
    # BatchKVCache keeps one offset per sequence (an array): RoPE must take it.
    stock, fused = make_pair()
    xs = [inputs((3, 6, 512), seed=7), inputs((3, 1, 512), seed=8), inputs((3, 1, 512), seed=9)]
    pad = [2, 0, 5]
    ys, _ = run_steps(fused, xs, lambda: BatchKVCache(pad))
    refs, _ = run_steps(stock, xs, lambda: BatchKVCache(pad))
    for y, ref in zip(ys, refs):
        assert rel_l2(y, ref) <= 1e-5


def test_quantized_kv_cache_uses_stock_path():
    stock, fused = make_pair()
    xs = [inputs((2, 9, 512), seed=3), inputs((2, 1, 512), seed=4)]
    ys, _ = run_steps(fused, xs, lambda: QuantizedKVCache(group_size=64, bits=8))
    refs, _ = run_steps(stock, xs, lambda: QuantizedKVCache(group_size=64, bits=8))
    for y, ref in zip(ys, refs):
        assert rel_l2(y, ref) <= 1e-5


@pytest.mark.parametrize(
    "scaling",
    [
        {"type": "linear", "factor": 2.0},  # still a plain RoPE (scale 1/2)
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    ],
    ids=["linear", "yarn"],
)
def test_other_rope_types_match_stock(scaling):
    stock, fused = make_pair(rope_scaling=scaling)
    plain = type(stock.rope) is nn.RoPE
    assert (rope_spec(stock.rope) is not None) == plain
    xs = [inputs((2, 5, 512), seed=5), inputs((2, 1, 512), seed=6)]
    ys, _ = run_steps(fused, xs, KVCache)
    refs, _ = run_steps(stock, xs, KVCache)
    for y, ref in zip(ys, refs):
        assert rel_l2(y, ref) <= 1e-5


def test_text_mrope_reduces_to_plain_partial_rope():
    """Interleaved M-RoPE with three equal position streams == plain RoPE.

    Independent numpy reference of HF-style interleaved M-RoPE: rotary
    frequency j takes its position from stream (j mod 3) within the
    interleaved span of ``mrope_section`` and stream 0 beyond it; rotation
    is "rotate half" over the first R = D * partial_rotary_factor dims.
    """
    D, R, theta, sections = 256, 64, 1e7, [11, 11, 10]
    T, offset = 9, 5
    q = np.array(inputs((1, T, 1, D), seed=11))
    pos = np.arange(offset, offset + T, dtype=np.float64)
    streams = np.stack([pos, pos, pos])  # text: t = h = w
    inv = theta ** (-np.arange(0, R, 2, dtype=np.float64) / R)  # [R/2]
    stream_of = np.zeros(R // 2, dtype=int)
    for s in (1, 2):
        stream_of[np.arange(s, 3 * sections[s], 3)] = s
    ang = streams[stream_of].T * inv  # [T, R/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = q[..., : R // 2], q[..., R // 2 : R]
    ref = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., R:]], -1)

    stock, _ = make_pair()
    spec = rope_spec(stock.rope)
    assert spec == attn_ops.RopeSpec(R, False, theta, 1.0)
    ones = mx.ones((D,))
    # eps ~ 0 and unit weights make the RMSNorm a plain rescale; undo it.
    qn, _ = attn_ops.prep_qk(
        mx.array(q), mx.array(q), ones, ones, q_eps=0.0, k_eps=0.0, rope=spec, offset=offset
    )
    rms = np.sqrt((q.astype(np.float64) ** 2).mean(-1, keepdims=True))
    got = np.array(qn.transpose(0, 2, 1, 3)) * rms
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# interface
# --------------------------------------------------------------------------


def test_signature_parameters_and_attributes_equal_stock():
    stock, fused = make_pair()
    # Stock's parameters in order, then only input_norm=None (norm-proj),
    # defer_out_proj=False (moe-block-out-proj) and projected=None
    # (moe-block-next-proj).
    assert list(inspect.signature(FusedGQAAttention.__call__).parameters) == list(
        inspect.signature(Qwen3NextAttention.__call__).parameters
    ) + ["input_norm", "defer_out_proj", "projected"]
    assert inspect.signature(FusedGQAAttention.__call__).parameters["input_norm"].default is None
    assert inspect.signature(FusedGQAAttention.__call__).parameters[
        "defer_out_proj"].default is False
    assert inspect.signature(FusedGQAAttention.__call__).parameters["projected"].default is None
    assert inspect.signature(FusedGQAAttention.__call__).parameters["mask"].default is None
    sk = dict(tree_flatten(stock.parameters()))
    fk = dict(tree_flatten(fused.parameters()))
    assert sk.keys() == fk.keys()
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "scale"):
        assert getattr(fused, name) == getattr(stock, name)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope"):
        assert getattr(fused, name) is getattr(stock, name)
    back = fused.to_stock()
    assert type(back) is Qwen3NextAttention
    x = inputs((2, 4, 512))
    assert mx.array_equal(back(x, mask="causal"), stock(x, mask="causal")).item()
    with pytest.raises(TypeError):
        FusedGQAAttention.from_stock(nn.Linear(4, 4))


def test_quantized_projections():
    stock, _ = make_pair()
    nn.quantize(stock, group_size=64, bits=4)
    fused = FusedGQAAttention.from_stock(stock)
    x = inputs((2, 5, 512))
    assert rel_l2(fused(x, mask="causal"), stock(x, mask="causal")) <= 1e-5


# --------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------


def test_no_repeated_kv_heads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("KV heads must not be repeated/tiled")

    for name in ("repeat", "tile"):
        monkeypatch.setattr(mx, name, refuse)
    shapes = []
    real_sdpa = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append((q.shape, k.shape, v.shape))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    _, fused = make_pair()
    xs = [inputs((2, 7, 512)), inputs((2, 1, 512), seed=2)]
    run_steps(fused, xs, KVCache)
    assert shapes == [
        ((2, 16, 7, 256), (2, 2, 7, 256), (2, 2, 7, 256)),
        ((2, 16, 1, 256), (2, 2, 8, 256), (2, 2, 8, 256)),
    ]


def test_prep_qk_one_trace_for_all_decode_positions(monkeypatch):
    traces = []
    real = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda *a, **k: traces.append(1) or real(*a, **k))
    attn_ops._prep_fn.cache_clear()
    try:
        stock, fused = make_pair()
        xs = [inputs((2, 4, 512))] + [inputs((2, 1, 512), seed=s) for s in range(2, 8)]
        ys, _ = run_steps(fused, xs, KVCache)
        # q and k norms traced once for the prefill shape, once for decode:
        # six decode positions share one compiled graph (offset is an input).
        assert len(traces) == 4
    finally:
        attn_ops._prep_fn.cache_clear()
    monkeypatch.undo()
    refs, _ = run_steps(stock, xs, KVCache)
    for y, ref in zip(ys, refs):
        assert rel_l2(y, ref) <= 1e-5


def test_prep_qk_rejects_bad_shapes():
    with pytest.raises(ValueError):
        attn_ops.prep_qk(
            mx.zeros((1, 2, 4, 8)), mx.zeros((1, 3, 1, 8)), mx.ones(8), mx.ones(8),
            q_eps=1e-6, k_eps=1e-6, rope=None,
        )
    with pytest.raises(ValueError, match="multiple"):
        attn_ops.gqa_attention(
            mx.zeros((1, 3, 2, 8)), mx.zeros((1, 2, 2, 8)), mx.zeros((1, 2, 2, 8)), 1.0
        )


def test_dispatcher_kernel_and_fallback(monkeypatch):
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    assert attn_ops.gqa_attention_kernel() is None  # none ships yet
    calls = []

    def fake(q, k, v, scale, mask):
        calls.append(k.shape)
        return attn_ops.gqa_attention_ops(q, k, v, scale, mask)

    monkeypatch.setattr(attn_ops, "gqa_attention_kernel", lambda: fake)
    stock, fused = make_pair()
    x = inputs((2, 5, 512))
    ref = stock(x, mask="causal")
    assert rel_l2(fused(x, mask="causal"), ref) <= 1e-5
    assert calls == [(2, 2, 5, 256)]

    fused.use_kernel = False
    fused(x, mask="causal")
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    fused.use_kernel = True
    fused(x, mask="causal")
    assert len(calls) == 1


def test_compiled_decode_reads_live_parameters():
    stock, fused = make_pair()
    eager = FusedGQAAttention.from_stock(stock, compile_decode=False)
    xs = [inputs((2, 5, 512)), inputs((2, 1, 512), seed=2)]
    ys, _ = run_steps(fused, xs, KVCache)
    # Replace a weight after the compiled decode graph was traced, as
    # load_weights would; the shared module is seen by all three layers.
    stock.q_proj.weight = stock.q_proj.weight * 1.5
    ys2, _ = run_steps(fused, xs, KVCache)
    refs, _ = run_steps(stock, xs, KVCache)
    eag, _ = run_steps(eager, xs, KVCache)
    assert rel_l2(ys2[1], ys[1]) > 1e-3  # the change is visible...
    for y, ref, e in zip(ys2, refs, eag):
        assert rel_l2(y, ref) <= 1e-5  # ...and matches stock
        assert rel_l2(y, e) <= 1e-6


# --------------------------------------------------------------------------
# long prompts: attention in blocks of query rows (attn-blocks)
# --------------------------------------------------------------------------


def test_score_block_rows():
    # Fits: one call. Else the largest multiple of 16 rows within the budget.
    assert attn_ops.score_block_rows(1, 16, 2048, 4096) == 2048  # 512 MiB of scores
    assert attn_ops.score_block_rows(1, 16, 2048, 131072) == 64  # 16 GiB -> 64 rows
    assert attn_ops.score_block_rows(1, 16, 2048, 32768, budget=1 << 20) == 16  # floor 16
    assert attn_ops.score_block_rows(1, 16, 7, 10**7, budget=1) == 7  # T < 16
    assert attn_ops.score_block_rows(2, 4, 100, 1000, budget=2 * 4 * 1000 * 4 * 40) == 32


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_blocked_attention_equals_one_call(rows):
    # A 37-token chunk after 20 cached positions (causal, lower-right aligned),
    # no mask, and boolean / additive array masks of [T, S] and [B, 1, T, S].
    B, Hq, Hk, T, S, D = 2, 6, 2, 37, 57, 32
    q = inputs((B, Hq, T, D), seed=1)
    k = inputs((B, Hk, S, D), seed=2)
    v = inputs((B, Hk, S, D), seed=3)
    causal = mx.arange(S)[None, :] <= (mx.arange(T)[:, None] + S - T)
    masks = {"causal": "causal", "none": None, "bool": causal,
             "additive-4d": mx.broadcast_to(mx.where(causal, 0.0, -1e9), (B, 1, T, S))}
    for name, mask in masks.items():
        ref = attn_ops.gqa_attention_ops(q, k, v, 0.2, mask)
        out = attn_ops.gqa_attention_blocked(q, k, v, 0.2, mask, rows=rows)
        assert out.shape == ref.shape
        assert rel_l2(out, ref) <= 1e-6, name
    # The string mask and the array it stands for give the same blocks.
    a = attn_ops.gqa_attention_blocked(q, k, v, 0.2, "causal", rows=rows)
    b = attn_ops.gqa_attention_blocked(q, k, v, 0.2, causal, rows=rows)
    assert rel_l2(a, b) <= 1e-6


def test_blocked_attention_rejects_bad_input():
    q = inputs((1, 2, 8, 16))
    k = v = inputs((1, 1, 4, 16))
    with pytest.raises(ValueError, match="more queries"):
        attn_ops.gqa_attention_blocked(q, k, v, 0.25, "causal", rows=2)
    with pytest.raises(ValueError, match="rows must be"):
        attn_ops.gqa_attention_blocked(q, k, v, 0.25, None, rows=0)
    with pytest.raises(ValueError, match="unknown attention mask"):
        attn_ops.gqa_attention_blocked(q, k, v, 0.25, "sliding", rows=2)


def test_long_prompt_runs_in_query_blocks_and_matches_stock(monkeypatch):
    # With a small score budget the fused layer splits a chunked prefill
    # into blocks of 16 query rows; outputs and the cache equal stock's.
    stock, fused = make_pair()
    monkeypatch.setattr(attn_ops, "SCORE_BLOCK_BYTES", 16 * 16 * 64 * 4)
    calls = []
    real = attn_ops.gqa_attention_ops
    monkeypatch.setattr(attn_ops, "gqa_attention_ops",
                        lambda q, *a, **k: calls.append(q.shape[2]) or real(q, *a, **k))
    xs = [inputs((1, n, 512), seed=s) for s, n in enumerate([40, 50, 1])]
    ys, cf = run_steps(fused, xs, KVCache)
    refs, cs = run_steps(stock, xs, KVCache)
    for step, (y, ref) in enumerate(zip(ys, refs)):
        assert rel_l2(y, ref) <= 1e-5, step
    assert max(calls) == 16 and len(calls) > 3, calls  # blocked, not one call
    fused.block_queries = False
    calls.clear()
    run_steps(fused, xs, KVCache)
    assert calls == [40, 50, 1]


def test_long_single_block_call_is_evaluated_to_bound_run_ahead(monkeypatch):
    # A prefill chunk whose scores fit one call is still evaluated at the
    # attention layer once it has RUNAHEAD_EVAL_ROWS query rows (the first
    # chunks of a long prompt peaked 8-8.7 GB above weights + cache on the
    # H200 without it); decode steps and the switch-off path are not.
    import qwen_apple_backend.layers.attention as layer_mod

    stock, fused = make_pair()
    monkeypatch.setattr(layer_mod, "RUNAHEAD_EVAL_ROWS", 32)
    evaluated = []
    real = layer_mod.eval_outside_traces
    monkeypatch.setattr(layer_mod, "eval_outside_traces",
                        lambda a: evaluated.append(a.shape[2]) or real(a))
    xs = [inputs((1, n, 512), seed=s) for s, n in enumerate([40, 20, 50, 1])]
    ys, _ = run_steps(fused, xs, KVCache)
    refs, _ = run_steps(stock, xs, KVCache)
    for step, (y, ref) in enumerate(zip(ys, refs)):
        assert rel_l2(y, ref) <= 1e-5, step
    assert evaluated == [40, 50]
    fused.block_queries = False
    evaluated.clear()
    run_steps(fused, xs, KVCache)
    assert evaluated == []


def test_eval_outside_traces_is_lazy_inside_compile():
    seen = []

    def f(x):
        y = x * 2
        seen.append(attn_ops.eval_outside_traces(y))
        return y + 1

    assert attn_ops.eval_outside_traces(mx.ones((3,))) is True
    out = mx.compile(f)(mx.ones((3,)))
    assert seen == [False] and out.tolist() == [3.0, 3.0, 3.0]


def test_attn_blocks_switch(monkeypatch):
    from qwen_apple_backend.bench.target import fuse_in_memory
    from qwen_apple_backend.checkpoint import build_random_model, hf_config

    for disable, expect in ((None, True), (["attn-blocks"], False)):
        model = build_random_model("tiny", vocab_size=64)
        fuse_in_memory(model, "fused", config=hf_config("tiny", 64), disable=disable)
        attn = [m for _, m in model.named_modules() if isinstance(m, FusedGQAAttention)]
        assert attn and all(m.block_queries is expect for m in attn)


def test_blocked_attention_holds_one_block_of_scores():
    # 8 query heads x 512 rows x 8,192 keys: 134 MB of float32 scores in one
    # call. In blocks of 64 rows, each evaluated before the next is built,
    # the peak is about one block's 16.8 MB (measured 18.5 MB on the CPU;
    # left lazy it stayed at ~136 MB, every block alive together).
    q = inputs((1, 8, 512, 64), seed=1)
    k = inputs((1, 2, 8192, 64), seed=2)
    v = inputs((1, 2, 8192, 64), seed=3)
    mx.eval(q, k, v)
    peaks = {}
    for rows in (512, 64):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(attn_ops.gqa_attention_blocked(q, k, v, 0.125, "causal", rows=rows))
        mx.synchronize()
        peaks[rows] = mx.get_peak_memory() - base
    one_block = 8 * 64 * 8192 * 4
    assert peaks[512] >= 8 * one_block
    assert peaks[64] <= 2 * one_block, peaks


def test_blocked_attention_inside_compile_stays_lazy():
    q = inputs((1, 4, 40, 16), seed=1)
    k = inputs((1, 2, 50, 16), seed=2)
    v = inputs((1, 2, 50, 16), seed=3)
    ref = attn_ops.gqa_attention_ops(q, k, v, 0.25, "causal")
    fn = mx.compile(lambda q, k, v: attn_ops.gqa_attention_blocked(q, k, v, 0.25, "causal",
                                                                   rows=16))
    assert rel_l2(fn(q, k, v), ref) <= 1e-6


# --------------------------------------------------------------------------
# split-K decode attention over long KV caches (attn-split)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("S,block", [(57, 16), (64, 16), (10, 16), (300, 128)])
@pytest.mark.parametrize("T", [1, 2])
def test_split_attention_equals_one_call(S, block, T):
    # Keys a multiple of the block, with a remainder, fewer than one block;
    # no mask, a boolean mask over a longer buffer (the compiled decode step's
    # form), additive [B, 1, T, S] and per-head boolean masks.
    B, Hq, Hk, D = 2, 6, 2, 32
    q = inputs((B, Hq, T, D), seed=1)
    k = inputs((B, Hk, S, D), seed=2)
    v = inputs((B, Hk, S, D), seed=3)
    written = mx.arange(S) < S - 3
    per_head = mx.random.uniform(shape=(B, Hq, T, S), key=mx.random.key(4)) > 0.3
    masks = {"none": None, "bool-buffer": written.reshape(1, 1, 1, S),
             "additive-4d": mx.broadcast_to(mx.where(written, 0.0, -1e9), (B, 1, T, S)),
             "bool-per-head": per_head | (mx.arange(S) == 0),
             "bool-1d": written, "bool-2d": mx.broadcast_to(written, (T, S))}
    for name, mask in masks.items():
        ref = attn_ops.gqa_attention_ops(q, k, v, 0.2, mask)
        out = attn_ops.gqa_attention_split(q, k, v, 0.2, mask, block=block)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        # float32 throughout: only the summation order differs (measured <= 3e-7)
        assert rel_l2(out, ref) <= 1e-6, name
    if T == 1:
        a = attn_ops.gqa_attention_split(q, k, v, 0.2, "causal", block=block)
        assert rel_l2(a, attn_ops.gqa_attention_ops(q, k, v, 0.2, None)) <= 1e-6
    else:
        with pytest.raises(ValueError, match="only 'causal' with one row"):
            attn_ops.gqa_attention_split(q, k, v, 0.2, "causal", block=block)


def test_split_attention_takes_a_row_of_keys_mask_as_it_is():
    # The compiled decode step's [1, 1, 1, S] mask broadcasts against the
    # [B, Hk, G, S] scores directly: no broadcast to [B, Hq, 1, S] and reshape
    # (a copy on the GPU) per layer and token; results equal.
    import io
    import re

    def prims(out):
        buf = io.StringIO()
        mx.export_to_dot(buf, out)
        return re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue())

    B, Hq, Hk, D, S = 2, 6, 2, 32, 300
    q, k, v = inputs((B, Hq, 1, D), seed=1), inputs((B, Hk, S, D), seed=2), inputs((B, Hk, S, D),
                                                                                   seed=3)
    row = (mx.arange(S) < 200).reshape(1, 1, 1, S)
    full = mx.broadcast_to(row, (B, Hq, 1, S)) & (mx.ones((B, Hq, 1, S)) > 0)  # per head
    mx.eval(q, k, v, row, full)
    a = attn_ops.gqa_attention_split(q, k, v, 0.2, row, use_kernel=False)
    b = attn_ops.gqa_attention_split(q, k, v, 0.2, full, use_kernel=False)
    c = attn_ops.gqa_attention_split(q, k, v, 0.2, None, use_kernel=False)
    pa, pc = prims(a), prims(c)  # before evaluating (that detaches the graphs)
    assert mx.array_equal(a, b).item()
    # The mask adds only the select (and where's own broadcasts), no reshape.
    assert pa.count("Reshape") == pc.count("Reshape")
    assert len(pa) - len(pc) <= 3


def test_split_attention_bf16_error_against_float32_like_sdpa():
    # bf16 q/k/v at the real head shape over 3,000 keys: the split form's
    # error against a float32 reference is within 1.1x of the one-call form's
    # (its probabilities enter p v in bf16, as FlashAttention's do).
    B, Hq, Hk, D, S = 1, 16, 2, 256, 3000
    q, k, v = (inputs(s, seed=i, dtype=mx.bfloat16)
               for i, s in enumerate([(B, Hq, 1, D), (B, Hk, S, D), (B, Hk, S, D)]))
    ref = attn_ops.gqa_attention_ops(*(a.astype(mx.float32) for a in (q, k, v)), D ** -0.5)
    one = attn_ops.gqa_attention_ops(q, k, v, D ** -0.5)
    split = attn_ops.gqa_attention_split(q, k, v, D ** -0.5)
    assert split.dtype == mx.bfloat16
    e_one, e_split = rel_l2(one, ref), rel_l2(split, ref)
    assert e_split <= 1.1 * e_one + 1e-3, (e_split, e_one)


def test_long_decode_takes_split_attention_on_a_gpu_and_matches_stock(monkeypatch):
    # Decode with more cached keys than SPLIT_KV_MIN_KEYS (lowered here) on a
    # GPU (the probe patched) takes the split form; outputs equal stock's.
    stock, fused = make_pair()
    monkeypatch.setattr(attn_ops, "SPLIT_KV_MIN_KEYS", 32)
    monkeypatch.setattr(attn_ops, "SPLIT_KV_BLOCK", 16)
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(attn_ops, "_split_objects", lambda backend: None)  # the MLX-ops form
    monkeypatch.setattr(attn_ops, "_qk_prep_object", lambda backend: None)  # MLX's norm + RoPE
    calls = []
    real = attn_ops.gqa_attention_split
    monkeypatch.setattr("qwen_apple_backend.layers.attention.gqa_attention_split",
                        lambda q, k, *a, **kw: calls.append(k.shape[2]) or real(q, k, *a, **kw))
    xs = [inputs((1, n, 512), seed=s) for s, n in enumerate([30, 1, 1, 1])]
    ys, cf = run_steps(fused, xs, KVCache)
    refs, cs = run_steps(stock, xs, KVCache)
    for step, (y, ref) in enumerate(zip(ys, refs)):
        assert rel_l2(y, ref) <= 1e-5, step
    assert calls == [32, 33], calls  # the decode steps with >= 32 keys
    fused.split_keys = False
    calls.clear()
    run_steps(fused, xs, KVCache)
    assert calls == []
    fused.split_keys = True
    # The CPU, and Metal (whose MLX SDPA is a fused two-pass kernel split over
    # keys): never; both run mx.fast.scaled_dot_product_attention.
    sdpa = []
    real_sdpa = attn_ops.gqa_attention_ops
    monkeypatch.setattr(attn_ops, "gqa_attention_ops",
                        lambda q, k, *a, **kw: sdpa.append(k.shape[2]) or real_sdpa(q, k, *a, **kw))
    for backend in (None, "metal"):
        monkeypatch.setattr(attn_ops, "gpu_backend", lambda: backend)
        sdpa.clear()
        ys = run_steps(fused, xs, KVCache)[0]
        assert calls == [], backend
        assert sdpa == [30, 31, 32, 33], (backend, sdpa)
        for step, (y, ref) in enumerate(zip(ys, refs)):
            assert rel_l2(y, ref) <= 1e-5, (backend, step)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_compiled_projections_take_the_qk_prep_kernel(monkeypatch, backend):
    # With the q/k preparation kernel ready on a backend (checked outside the
    # trace), the compiled decode projections call prep_qk_decode for that
    # backend (here a traceable stand-in with the kernel's contract:
    # [B, 1, H, D] in, [B, H, 1, D] out) and keep prep_qk for prompts;
    # outputs stay stock's. qk-prep off (prep_kernel False), or a prompt,
    # keeps prep_qk.
    import qwen_apple_backend.layers.attention as layer_mod

    calls = []

    def stand_in(q, k, qw, kw, *, q_eps, k_eps, rope, offset, backend):
        calls.append((q.shape, offset.ndim, backend))
        return attn_ops.prep_qk(q, k, qw, kw, q_eps=q_eps, k_eps=k_eps, rope=rope, offset=offset)

    ready = []
    monkeypatch.setattr(attn_ops, "qk_prep_kernel_ready",
                        lambda *a: ready.append(a[:3]) or backend)
    monkeypatch.setattr(layer_mod, "prep_qk_decode", stand_in)
    stock, fused = make_pair()
    xs = [inputs((1, n, 512), seed=s) for s, n in enumerate([5, 1, 1])]
    ys, _ = run_steps(fused, xs, KVCache)
    refs, _ = run_steps(stock, xs, KVCache)
    for y, ref in zip(ys, refs):
        assert rel_l2(y, ref) <= 1e-6
    # Traced once for the decode tokens (the stand-in runs at trace time).
    assert calls == [((1, 1, 16, 256), 0, backend)], calls
    assert ready == [(16, 2, 256), (16, 2, 256)], ready  # decode tokens only
    assert any(key[1] == backend for key in fused._compiled)
    calls.clear()
    fused.prep_kernel = False
    run_steps(fused, xs, KVCache)
    assert calls == []


_ATTN_SWITCHES = {"attn-kernel": "decode_kernel", "attn-split": "split_keys",
                  "qk-prep": "prep_kernel"}


@pytest.mark.parametrize("name", list(_ATTN_SWITCHES))
def test_attention_optimization_switches(name):
    # Each switch turns off its own attribute on every fused attention layer,
    # leaves the others on, and leaves a note in the fusion report.
    attr = _ATTN_SWITCHES[name]
    from qwen_apple_backend.bench.target import fuse_in_memory
    from qwen_apple_backend.checkpoint import build_random_model, hf_config

    for disable, expect in ((None, True), ([name], False)):
        model = build_random_model("tiny", vocab_size=64)
        report = fuse_in_memory(model, "fused", config=hf_config("tiny", 64), disable=disable)
        attn = [m for _, m in model.named_modules() if isinstance(m, FusedGQAAttention)]
        assert attn and all(getattr(m, attr) is expect for m in attn)
        assert all(getattr(m, other) for m in attn for other in _ATTN_SWITCHES.values()
                   if other != attr)
        assert any(name in n for n in report.notes) is (not expect)
