"""The CUDA dense 4-bit decode GEMV (kernels/cuda/quantized_gemv.cu) against MLX's dequantized matmul.

Marked ``gpu`` and CUDA-only (Metal keeps MLX's own ``qmv``). On the GPU
machine: ``python -m pytest -q -m gpu tests/test_kernels_gpu_linear.py``.
The kernel is called directly (no self-check in the way) at the Qwen3.6-35B-A3B
projection shapes and odd ones; the reference multiplies float32 activations
by the dequantized float32 weights.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from qwen_apple_backend.ops import linear as ql

from ._metrics import mx_rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_only]


@pytest.fixture(autouse=True)
def _unverified_kernels_allowed(monkeypatch):
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    ql._gemv_object.cache_clear()
    ql._embedding_object.cache_clear()
    yield
    ql._gemv_object.cache_clear()
    ql._embedding_object.cache_clear()


def _weights(N, K, group_size, seed, dtype=mx.bfloat16):
    key = mx.random.key(seed)
    w = (mx.random.normal((N, K), key=key) * K ** -0.5).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=4)
    return wq, s, b


# (M, N, K, group_size): GDN in-projections (qkv|z|b|a), attention q|k|v,
# GDN out_proj / attention o_proj, shared expert down, lm_head (a 32K slice of
# the 248,320 rows: same per-row work), then odd ones: N not a multiple of any
# block's rows, K = 640 (20 chunks: 4 lanes per row), K = 96, group 32 and 128,
# 2-4 rows (batched decode).
SHAPES = [
    (1, 12352, 2048, 64),
    (1, 9216, 2048, 64),
    (1, 2048, 4096, 64),
    (1, 2048, 512, 64),
    (1, 32768, 2048, 64),
    (1, 100, 2048, 64),
    (1, 333, 640, 64),
    (3, 77, 96, 32),
    (2, 2048, 4096, 128),
    (4, 5000, 2048, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16],
                         ids=["f32", "bf16", "f16"])
def test_quantized_gemv_kernel(shape, dtype):
    M, N, K, G = shape
    wq, s, b = _weights(N, K, G, seed=N + K)
    s, b = s.astype(dtype), b.astype(dtype)
    x = mx.random.normal((M, 1, K), key=mx.random.key(M * N)).astype(dtype)
    y = ql.quantized_gemv_kernel(x, wq, s, b, G)
    wf = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=G, bits=4)
    # On the CPU: a float32 GEMM on the GPU may round its inputs to TF32
    # (seen as ~1e-3 errors at M > 1 in the first H200 run, M = 1 exact).
    ref = mx.matmul(x.astype(mx.float32), wf.T, stream=mx.cpu)
    assert y.shape == (M, 1, N) and y.dtype == dtype
    # float32: summation order only. bf16 / fp16: the output's own rounding.
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    err = mx_rel_l2(y, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol} at {shape} {dtype}"


def test_gemv_ready_passes_and_linear_takes_the_kernel(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    monkeypatch.setattr(ql, "GEMV_MIN_BYTES", 0)
    mx.random.seed(0)
    lin = nn.Linear(2048, 4096, bias=False)
    lin.weight = lin.weight.astype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    ql.prepare(x, q)
    verdicts = {k: v for k, v in self_check_results().items() if k[0] == "quantized_gemv"}
    assert verdicts and all(v == (True, "passed") for v in verdicts.values()), verdicts
    ref = x.astype(mx.float32) @ mx.dequantize(q["weight"], q["scales"].astype(mx.float32),
                                               q["biases"].astype(mx.float32), 64, 4).T
    assert mx_rel_l2(ql.linear(q, x), ref) <= 1e-2


# The norm + GEMV launch (norm-proj): the mixers' concatenated projections
# (GDN in_proj, attention q|k|v), lm_head with the model's final norm (the
# compiled decode step's fold; a 32K slice of the 248,320 rows: same per-row
# work), then odd shapes.
NORM_SHAPES = [
    (1, 12352, 2048, 64),
    (1, 9216, 2048, 64),
    (1, 32768, 2048, 64),
    (2, 12352, 2048, 64),
    (1, 333, 640, 64),
    (3, 77, 96, 32),
]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16],
                         ids=["f32", "bf16", "f16"])
def test_norm_gemv_kernel(shape, dtype):
    M, N, K, G = shape
    wq, s, b = _weights(N, K, G, seed=N + K + 1)
    s, b = s.astype(dtype), b.astype(dtype)
    k = mx.random.split(mx.random.key(M * N + 1), 2)
    x = (3.0 * mx.random.normal((M, 1, K), key=k[0])).astype(dtype)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=k[1])).astype(dtype)
    y = ql.norm_gemv_kernel(x, nw, 1e-6, wq, s, b, G)
    xn = mx.fast.rms_norm(x, nw, 1e-6)
    wf = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=G, bits=4)
    ref = mx.matmul(xn.astype(mx.float32), wf.T, stream=mx.cpu)  # no TF32 (see above)
    assert y.shape == (M, 1, N) and y.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    err = mx_rel_l2(y, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol} at {shape} {dtype}"
    # Against the plain kernel on MLX's own GPU norm: only rounding-boundary
    # flips of the normalised row (the float32 sum of squares in another order).
    plain = ql.quantized_gemv_kernel(xn, wq, s, b, G)
    err = mx_rel_l2(y, plain)
    assert err <= (1e-6 if dtype == mx.float32 else 2e-3), f"vs plain {err:.3g}"


def test_norm_gemv_ready_passes():
    from qwen_apple_backend.ops.device import self_check_results

    wq, s, b = _weights(12352, 2048, 64, seed=3)
    x = mx.random.normal((1, 1, 2048)).astype(mx.bfloat16)
    nw = mx.ones((2048,), dtype=mx.bfloat16)
    assert ql.norm_gemv_ready(x, nw, 1e-6, wq, s, b, 64) == "cuda"
    verdicts = {k: v for k, v in self_check_results().items()
                if k[0] == "quantized_gemv" and k[2][0] == "norm"}
    assert verdicts and all(v == (True, "passed") for v in verdicts.values()), verdicts


# PIPE (double-buffered passes, a grid of about one resident wave): the same
# arithmetic per row as the one-pass launch, so the same bits, at the model's
# shapes (lm_head in full: 59 passes per warp on an H200) and odd ones, with
# and without the norm prologue; also with a grid of 1 block per SM, so
# every warp walks many passes.
PIPE_SHAPES = [
    (1, 12352, 2048, 64),
    (1, 9216, 2048, 64),
    (1, 2048, 4096, 64),
    (1, 248320, 2048, 64),
    (1, 333, 640, 64),
    (3, 77, 96, 32),
    (4, 5000, 2048, 32),
]


@pytest.mark.parametrize("shape", PIPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("bps", [1, 4])
def test_pipelined_gemv_is_the_one_pass_kernel_bit_for_bit(shape, norm, bps, monkeypatch):
    M, N, K, G = shape
    wq, s, b = _weights(N, K, G, seed=N + K)
    x = (3.0 * mx.random.normal((M, 1, K), key=mx.random.key(M * N))).astype(mx.bfloat16)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=mx.random.key(K))).astype(mx.bfloat16)
    extra = dict(norm_weight=nw, eps=1e-6) if norm else {}
    one_pass = ql.quantized_gemv_kernel(x, wq, s, b, G, **extra)
    monkeypatch.setattr(ql, "GEMV_PIPE", True)
    monkeypatch.setattr(ql, "PIPE_BLOCKS_PER_SM", bps)
    p = ql.gemv_launch(M, N, K)
    assert p["PIPE"] and ql.cuda_sm_count() > 0
    assert p["blocks"] <= bps * ql.cuda_sm_count()
    piped = ql.quantized_gemv_kernel(x, wq, s, b, G, **extra)
    assert mx.array_equal(piped, one_pass).item(), (shape, norm, bps)
    ref = mx.matmul(x.astype(mx.float32) if not norm else
                    mx.fast.rms_norm(x, nw, 1e-6).astype(mx.float32),
                    mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=G,
                                  bits=4).T, stream=mx.cpu)
    assert mx_rel_l2(piped, ref) <= 1e-2


@pytest.mark.parametrize("id_dtype", [mx.uint32, mx.int32], ids=["u32", "i32"])
@pytest.mark.parametrize("bits,dtype", [(4, mx.bfloat16), (8, mx.float16)], ids=["q4-bf16",
                                                                                  "q8-f16"])
def test_embedding_dequantize_kernel_is_mlx_s_lookup(bits, dtype, id_dtype):
    # embed-kernel: Qwen3.6's token embedding (248,320 rows of 2,048, group 64)
    # and an 8-bit f16 one: the one launch equals mlx-lm's three gathers and
    # dequantize bit for bit for a decode token, a batch of 4 and 64 ids (the
    # table's first and last rows among them), and the self-check passes.
    V, D = 248320, 2048
    k = mx.random.split(mx.random.key(bits), 3)
    w, s, b = mx.quantize(mx.random.normal((V, D), key=k[0]).astype(dtype), group_size=64,
                          bits=bits)
    for shape in [(1, 1), (4, 1), (2, 32)]:
        ids = mx.random.randint(0, V, shape, key=k[1]).reshape(-1)
        ids = mx.concatenate([mx.array([0, V - 1]), ids])[:ids.size].reshape(shape)
        ids = ids.astype(id_dtype)
        out = ql.embedding_dequantize_kernel(ids, w, s, b, 64, bits)
        ref = ql.embedding_dequantize_ops(ids, w, s, b, 64, bits)
        assert out.shape == (*shape, D)
        assert mx.array_equal(out, ref).item(), f"{shape}: rel-L2 {mx_rel_l2(out, ref):.3g}"
    assert ql.embedding_ready(ids, w, s, b, 64, bits) == "cuda"
