"""GPU kernels against their portable references (run on a CUDA or Metal GPU).

Marked ``gpu``: skipped on the CPU. On the GPU machine run
``python -m pytest -q -m gpu tests/test_kernels_gpu.py``.
Each kernel is called directly (no self-check in the way) on seeded random
inputs at Qwen3.6-35B-A3B head sizes and at odd sizes; outputs AND recurrent
state are compared with the float32 sequential reference.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from qwen_apple_backend.ops import gated_delta as gd

from ._metrics import mx_rel_l2

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _unverified_kernels_allowed(monkeypatch):
    # These tests are what verifies a CUDA kernel: build every kernel, verified
    # in kernels/MANIFEST.toml or not.
    from qwen_apple_backend.ops import moe as moe_ops

    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    caches = (gd._scan_kernel_object, gd._staged_kernel_object, moe_ops._gemv_objects,
              moe_ops._grouped_gemm_object)
    for fn in caches:
        fn.cache_clear()
    yield
    for fn in caches:
        fn.cache_clear()


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed, masked=False):
    keys = mx.random.split(mx.random.key(seed), 7)
    q, k = gd.l2norm_qk(mx.random.normal((B, T, Hk, Dk), key=keys[0]).astype(dtype),
                        mx.random.normal((B, T, Hk, Dk), key=keys[1]).astype(dtype))
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    # Real gates: decays spread over (0, 1) with some near 1 (long memory).
    g = mx.exp(-mx.random.uniform(0.0, 2.0, (B, T, Hv), key=keys[3]) ** 3)
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=keys[4])).astype(dtype)
    state = 0.05 * mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    mask = None
    if masked:
        mask = mx.random.uniform(shape=(B, T), key=keys[6]) > 0.3
    return q * Dk ** -0.5, k, v, g, beta, state, mask


def _reference(q, k, v, g, beta, state, mask):
    f32 = mx.float32
    return gd.gated_delta_sequential_ops(q.astype(f32), k.astype(f32), v.astype(f32), g,
                                         beta.astype(f32), state, mask)


# (B, T, Hk, Hv, Dk, Dv): the real GDN heads at prefill and decode lengths, then
# odd sizes: one token (decode), a prime T, Hk == Hv (no GQA), Dk = 64 (2 floats
# per lane), Dv not a multiple of the 4 rows per block, batch 2.
SHAPES = [
    (1, 1, 16, 32, 128, 128),
    (1, 2048, 16, 32, 128, 128),
    (1, 37, 16, 32, 128, 128),
    (1, 29, 4, 4, 128, 128),
    (1, 53, 2, 6, 64, 64),
    (2, 17, 2, 4, 128, 66),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gated_delta_scan_kernel(shape, dtype):
    backend = gd.gpu_backend()
    B, T, Hk, Hv, Dk, Dv = shape
    args = _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=sum(shape))
    _assert_scan_matches_reference(gd._scan_kernel_call(backend, *args), args, dtype,
                                   f"{shape} {dtype}")


def _assert_scan_matches_reference(out, args, dtype, where):
    """A scan kernel's (y, state) against the float32 sequential reference."""
    y, s = out
    y_ref, s_ref = _reference(*args)
    mx.eval(y, s, y_ref, s_ref)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    # float32: same math, different summation order (warp butterfly).
    # bf16: the reference reads the same bf16 inputs upcast, so the float32 state
    # agrees to summation order; only y is rounded to bf16 (~2e-3 rms relative).
    y_tol, s_tol = (2e-5, 2e-5) if dtype == mx.float32 else (8e-3, 1e-4)
    ey, es = mx_rel_l2(y, y_ref), mx_rel_l2(s, s_ref)
    assert ey <= y_tol, f"y rel-L2 {ey:.3g} > {y_tol} at {where}"
    assert es <= s_tol, f"state rel-L2 {es:.3g} > {s_tol} at {where}"


# The staged prefill scan (CUDA only): the real heads at two chunk counts,
# T = one token, T not a multiple of the chunk, Dk = 64, batch 2, and every
# lanes-per-row choice.
STAGED_SHAPES = [
    (1, 2048, 16, 32, 128, 128),
    (1, 1, 16, 32, 128, 128),
    (1, 101, 16, 32, 128, 128),
    (1, 53, 2, 6, 64, 64),
    (2, 77, 2, 4, 128, 128),
]


# Every shape at the default lanes per row; the real shape at the others.
STAGED_CASES = [(s, 8) for s in STAGED_SHAPES] + [(STAGED_SHAPES[0], 16),
                                                  (STAGED_SHAPES[0], 32)]


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape,lpr", STAGED_CASES,
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else f"lpr{c}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gated_delta_scan_staged_kernel(shape, dtype, lpr):
    B, T, Hk, Hv, Dk, Dv = shape
    if gd._staged_tile(Dk, Dv, dtype, lpr) is None:
        pytest.skip("shape not supported at this lanes-per-row")
    args = _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=sum(shape))
    _assert_scan_matches_reference(gd._staged_kernel_call("cuda", *args, lpr=lpr), args,
                                   dtype, f"{shape} {dtype} lpr {lpr}")


@pytest.mark.cuda_only
def test_gated_delta_scan_staged_kernel_mask():
    args = _inputs(2, 71, 2, 4, 128, 128, mx.float32, seed=9, masked=True)
    _assert_masked_scan(gd._staged_kernel_call("cuda", *args), args)


def test_gated_delta_scan_kernel_mask():
    args = _inputs(2, 41, 2, 4, 128, 128, mx.float32, seed=7, masked=True)
    _assert_masked_scan(gd._scan_kernel_call(gd.gpu_backend(), *args), args)


def _assert_masked_scan(out, args):
    y, s = out
    y_ref, s_ref = _reference(*args)
    assert mx_rel_l2(y, y_ref) <= 2e-5 and mx_rel_l2(s, s_ref) <= 2e-5
    mask = args[-1]
    # Masked positions write exact zeros.
    assert mx.all(mx.where(mask[:, :, None, None], 0.0, y) == 0).item()


def test_gated_delta_long_bf16_recurrence_stays_close():
    # 512 steps in bf16 against the float32 reference: state drift stays bounded
    # because the state itself is float32 in the kernel.
    backend = gd.gpu_backend()
    args = _inputs(1, 512, 16, 32, 128, 128, mx.bfloat16, seed=3)
    y, s = gd._scan_kernel_call(backend, *args)
    y_ref, s_ref = _reference(*args)
    assert mx_rel_l2(y, y_ref) <= 8e-3
    assert mx_rel_l2(s, s_ref) <= 1e-4


def test_dispatcher_runs_the_kernel_after_its_self_check():
    from qwen_apple_backend.ops.device import self_check_results

    args = _inputs(1, 300, 16, 32, 128, 128, mx.bfloat16, seed=11)
    assert gd.kernel_ready(16, 32, 128, 128, mx.bfloat16) == gd.gpu_backend()
    verdicts = {k: v for k, v in self_check_results().items() if k[0] == "gated_delta_scan"}
    assert all(v == (True, "passed") for v in verdicts.values()) and verdicts
    y, s = gd.gated_delta(*args)
    y_ref, s_ref = _reference(*args)
    assert mx_rel_l2(y, y_ref) <= 8e-3 and mx_rel_l2(s, s_ref) <= 1e-4


# --------------------------------------------------------------------------
# MoE decode kernels (kernels/*/moe_gate_up_gemv, moe_down_gemv)
# --------------------------------------------------------------------------


def _experts(E, H, I, dtype, seed, group_size=64):
    from qwen_apple_backend.ops.moe import ExpertWeights

    k1, k2 = mx.random.split(mx.random.key(seed))
    out = []
    for key, shape in ((k1, (E, 2 * I, H)), (k2, (E, H, I))):
        w = (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(dtype)
        q, s, b = mx.quantize(w, group_size=group_size, bits=4)
        out.append(ExpertWeights(q, s, b, group_size=group_size, bits=4))
    return out


# (N, E, H, I, K): Qwen3.6-35B-A3B decode (one token, 256 experts, K = 8),
# then batch 3, K = 1 (one expert), all K slots on distinct experts of a
# small E with K = E, and H = 1024 (one chunk per lane) with I = 96, which
# needs 32-wide quantization groups.
MOE_SHAPES = [
    (1, 256, 2048, 512, 8),
    (3, 256, 2048, 512, 8),
    (1, 16, 2048, 512, 1),
    (2, 8, 1024, 96, 8),
]


@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_moe_decode_kernels(shape, dtype):
    from qwen_apple_backend.ops import moe as moe_ops

    N, E, H, I, K = shape
    gu, dn = _experts(E, H, I, dtype, seed=sum(shape), group_size=64 if I % 64 == 0 else 32)
    kx, ki, ks = mx.random.split(mx.random.key(N * K), 3)
    x = mx.random.normal((N, 1, H), key=kx).astype(dtype)
    inds = mx.argsort(mx.random.uniform(shape=(N, 1, E), key=ki), axis=-1)[..., :K]
    inds = inds.astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((N, 1, K), key=ks), axis=-1)
    assert moe_ops._gemv_shapes_supported(H, gu, dn)
    y = moe_ops._moe_decode_kernel_call(gd.gpu_backend(), x, inds, scores, gu, dn)
    ref = moe_ops.moe_experts_ops(x.astype(mx.float32), inds, scores, gu, dn, sort=False)
    assert y.shape == (N, 1, H) and y.dtype == dtype
    # float32: summation order only. bf16: x and h rounded to bf16 as in the
    # model (the reference keeps float32 activations), ~1e-2 relative.
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    err = mx_rel_l2(y, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol} at {shape} {dtype}"


def test_moe_block_decode_uses_the_kernel_and_matches_stock():
    from types import SimpleNamespace

    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock
    from qwen_apple_backend.ops.device import self_check_results

    args = SimpleNamespace(hidden_size=2048, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512, norm_topk_prob=True,
                           num_experts=64, num_experts_per_tok=8)
    mx.random.seed(0)
    stock = Qwen3NextSparseMoeBlock(args)
    nn.quantize(stock, group_size=64, bits=4)
    stock.update(tree_map(lambda a: a.astype(mx.bfloat16)
                          if mx.issubdtype(a.dtype, mx.floating) else a, stock.parameters()))
    stock.eval()
    fused = FusedSparseMoeBlock.from_stock(stock)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    y, ref = fused(x), stock(x)
    verdicts = {k: v for k, v in self_check_results().items() if k[0] == "moe_decode_gemv"}
    assert verdicts and all(v == (True, "passed") for v in verdicts.values()), verdicts
    assert mx_rel_l2(y, ref) <= 3e-2


# --------------------------------------------------------------------------
# MoE prefill grouped 4-bit GEMM (kernels/{cuda,metal}/moe_grouped_gemm), either GPU
# --------------------------------------------------------------------------

# (T, E, H, I, K): Qwen3.6 prefill chunk (all 256 experts busy), a prime T
# (partial tiles, idle experts), every row on one expert (K = 1, E = 1... one
# expert of 4 chosen by a fixed routing), and a single tile.
GEMM_SHAPES = [
    (512, 256, 2048, 512, 8),
    (37, 64, 2048, 512, 8),
    (300, 4, 1024, 128, 1),
    (8, 8, 1024, 64, 2),
]


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe_grouped_gemm_kernel(shape):
    from qwen_apple_backend.ops import moe as moe_ops

    T, E, H, I, K = shape
    gu, dn = _experts(E, H, I, mx.bfloat16, seed=T + E)
    kx, ki, ks = mx.random.split(mx.random.key(T), 3)
    x = mx.random.normal((1, T, H), key=kx).astype(mx.bfloat16)
    if shape == GEMM_SHAPES[2]:
        inds = mx.full((1, T, K), 2, dtype=mx.uint32)  # all tokens on expert 2
    else:
        inds = mx.argsort(mx.random.uniform(shape=(1, T, E), key=ki), axis=-1)[..., :K]
        inds = inds.astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((1, T, K), key=ks), axis=-1).astype(mx.bfloat16)
    y = moe_ops._moe_grouped_gemm_experts(gd.gpu_backend(), x, inds, scores, gu, dn)
    ref = moe_ops.moe_experts_ops(x.astype(mx.float32), inds, scores.astype(mx.float32),
                                  gu, dn, sort=True)
    assert y.shape == (1, T, H) and y.dtype == mx.bfloat16
    # bf16 operands (x, dequantized weights, h) with float32 accumulation.
    err = mx_rel_l2(y, ref)
    assert err <= 3e-2, f"rel-L2 {err:.3g} at {shape}"
