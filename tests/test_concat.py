"""proj-concat: sibling projections stacked into one matmul (layers/_concat.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import make_prompt_cache

from qwen_apple_backend import get_report, load
from qwen_apple_backend.layers._concat import ConcatProjection
from qwen_apple_backend.layers.attention import FusedGQAAttention
from qwen_apple_backend.layers.gated_delta import FusedGatedDeltaNet
from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

from ._metrics import mx_rel_l2

H = 128


def gdn_stock(quantize: bool):
    mx.random.seed(0)
    args = qwen3_5.TextModelArgs(
        hidden_size=H, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_attention_heads=4, rms_norm_eps=1e-6)
    stock = qwen3_5.GatedDeltaNet(args)
    if quantize:
        nn.quantize(stock, group_size=64, bits=4)
    stock.eval()
    mx.eval(stock.parameters())
    return stock


def moe_pair(seed: int):
    """A 4-bit stock Qwen3-Next MoE block (8 experts, top-2, shared expert) and its fused twin."""
    from types import SimpleNamespace

    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    mx.random.seed(seed)
    margs = SimpleNamespace(hidden_size=H, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, norm_topk_prob=True,
                            num_experts=8, num_experts_per_tok=2)
    moe = Qwen3NextSparseMoeBlock(margs)
    nn.quantize(moe, group_size=64, bits=4)
    moe.eval()
    return moe, FusedSparseMoeBlock.from_stock(moe)


class CountingQMM:
    """Counts mx.quantized_matmul calls (every quantized projection is one)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = mx.quantized_matmul

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(mx, "quantized_matmul", counted)


def test_gdn_projections_run_as_one_matmul_with_the_same_output(monkeypatch):
    stock = gdn_stock(quantize=True)
    x = mx.random.normal((1, 5, H), key=mx.random.key(3))
    ref = stock(x)
    before = {k: mx.array(v) for k, v in tree_flatten(stock.parameters())}
    fused = FusedGatedDeltaNet.from_stock(stock)
    assert fused.concat_projections()
    # The children hold views of the concatenation: same names, same values.
    after = dict(tree_flatten(fused.parameters()))
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[k], before[k]).item() for k in before)
    counter = CountingQMM(monkeypatch)
    y = fused(x)
    assert counter.calls == 2  # one for in_proj_{qkv,z,b,a}, one for out_proj
    # Row-stacking is exact: each output row keeps its own words, scales, biases.
    assert mx_rel_l2(y, ref) <= 1e-6


def test_replaced_weights_or_children_fall_back_to_separate_projections(monkeypatch):
    stock = gdn_stock(quantize=True)
    fused = FusedGatedDeltaNet.from_stock(stock)
    assert fused.concat_projections()
    x = mx.random.normal((1, 3, H), key=mx.random.key(4))
    # load_weights / update replacing one child's array: the concatenation is stale.
    z = fused.in_proj_z
    z.update({"scales": z["scales"] * 2.0})
    counter = CountingQMM(monkeypatch)
    y = fused(x)
    assert counter.calls == 5  # four separate projections + out_proj
    fresh = FusedGatedDeltaNet.from_stock(stock)  # no concat: the separate path
    assert mx.array_equal(y, fresh(x)).item()

    # A wrapper module in place of a child (a LoRA layer, say): separate path.
    stock2 = gdn_stock(quantize=True)
    fused2 = FusedGatedDeltaNet.from_stock(stock2)
    assert fused2.concat_projections()

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __call__(self, x):
            return self.inner(x) * 0.5

    fused2.in_proj_qkv = Wrapped(fused2.in_proj_qkv)
    out = fused2(x)
    fused2.in_proj_qkv = fused2.in_proj_qkv.inner
    assert not mx.allclose(out, fused2(x)).item()


def _flat_valid(cat, owner) -> bool:
    # As the compiled decode step runs identity_checks (decode._CompiledDecode._still_valid).
    containers, keys, expected, children, types = cat.identity_checks(owner)
    return (all(dict.get(c, k) is e for c, k, e in zip(containers, keys, expected))
            and all(type(c) is t for c, t in zip(children, types)))


def test_flattened_identity_checks_agree_with_valid():
    class Sub(nn.QuantizedLinear):
        pass

    changes = {
        "replaced array": lambda f: f.in_proj_z.update({"scales": f.in_proj_z["scales"] * 2}),
        "replaced child": lambda f: setattr(f, "in_proj_b", f.in_proj_b.__class__(
            H, f.in_proj_b["weight"].shape[0], bias=False, group_size=64, bits=4)),
        "child's class swapped": lambda f: setattr(f.in_proj_a, "__class__", Sub),
        "array removed": lambda f: f.in_proj_qkv.pop("biases"),
    }
    for what, change in changes.items():
        fused = FusedGatedDeltaNet.from_stock(gdn_stock(quantize=True))
        assert fused.concat_projections()
        cat = fused._proj_cat
        assert cat.valid(fused) and _flat_valid(cat, fused), what
        change(fused)
        assert not cat.valid(fused), what
        assert not _flat_valid(cat, fused), what


def test_mismatched_projections_are_left_separate():
    stock = gdn_stock(quantize=False)
    # One projection quantized, the others not: nothing to stack.
    stock.in_proj_z = nn.QuantizedLinear.from_linear(stock.in_proj_z, group_size=64, bits=4)
    fused = FusedGatedDeltaNet.from_stock(stock)
    assert not fused.concat_projections()
    assert ConcatProjection.build(fused, ("in_proj_qkv",)) is None  # fewer than two
    x = mx.random.normal((1, 2, H), key=mx.random.key(5))
    assert mx.array_equal(fused(x), stock(x)).item()


def test_attention_and_shared_expert_concat_match_stock():
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    mx.random.seed(1)
    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_moe_text", hidden_size=H, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.25})
    attn = Qwen3NextAttention(args)
    nn.quantize(attn, group_size=64, bits=4)
    attn.eval()
    fa = FusedGQAAttention.from_stock(attn)
    assert fa.concat_projections()
    x = mx.random.normal((1, 6, H), key=mx.random.key(6))
    assert mx_rel_l2(fa(x, mask="causal"), attn(x, mask="causal")) <= 1e-6
    # Decode through the compiled projection path, with a KV cache.
    from mlx_lm.models.cache import KVCache

    c1, c2 = KVCache(), KVCache()
    fa(x, mask="causal", cache=c1)
    attn(x, mask="causal", cache=c2)
    x1 = x[:, :1]
    for _ in range(2):  # the compiled projection path keeps the concat across calls
        assert mx_rel_l2(fa(x1, cache=c1), attn(x1, cache=c2)) <= 1e-6
        assert fa._use_cat()

    moe, fm = moe_pair(seed=1)
    assert fm.concat_projections()
    for T in (1, 9):  # compiled decode graph, eager prefill
        xm = mx.random.normal((1, T, H), key=mx.random.key(T))
        assert mx_rel_l2(fm(xm), moe(xm)) <= 1e-6


def test_loaded_model_uses_concat_and_ablation_switches_it_off(tiny_q4, monkeypatch):
    monkeypatch.delenv("QAB_DISABLE", raising=False)
    fused, tok = load(tiny_q4, "fused")
    layers = fused.language_model.model.layers
    gdn = [lyr.linear_attn for lyr in layers if hasattr(lyr, "linear_attn")]
    assert gdn and all(g._proj_cat is not None and g._proj_cat.valid(g) for g in gdn)
    assert all(lyr.mlp._use_cat() for lyr in layers)
    prompt = mx.array([[(i * 29) % 500 for i in range(24)]])
    y_cat = fused(prompt, cache=make_prompt_cache(fused))

    monkeypatch.setenv("QAB_DISABLE", "proj-concat")
    plain, _ = load(tiny_q4, "fused")
    assert any("proj-concat" in n for n in get_report(plain).notes)
    assert getattr(plain.language_model.model.layers[0].linear_attn, "_proj_cat", None) is None
    y_plain = plain(prompt, cache=make_prompt_cache(plain))
    assert mx_rel_l2(y_cat, y_plain) <= 1e-5


def test_compiled_decode_keeps_the_concat_and_still_sees_replaced_weights(monkeypatch):
    # mx.compile(..., inputs=module) re-wraps the module's arrays while
    # tracing; the block re-records them after a call that started valid, so
    # later decode tokens keep the one-matmul path, and a user's replacement
    # is still noticed.
    moe, fm = moe_pair(seed=2)
    assert fm.concat_projections()
    x = mx.random.normal((1, 1, H), key=mx.random.key(7))
    for _ in range(3):
        assert mx_rel_l2(fm(x), moe(x)) <= 1e-6
        assert fm._use_cat()
    up = moe.shared_expert.up_proj  # shared with the fused block
    up.update({"scales": up["scales"] * 0.5})
    assert not fm._use_cat()
    assert mx_rel_l2(fm(x), moe(x)) <= 1e-6
