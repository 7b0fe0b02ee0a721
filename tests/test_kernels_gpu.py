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
    y, s = gd._scan_kernel_call(backend, *args)
    y_ref, s_ref = _reference(*args)
    mx.eval(y, s, y_ref, s_ref)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    # float32: same math, different summation order (warp butterfly).
    # bf16: the reference reads the same bf16 inputs upcast, so the float32 state
    # agrees to summation order; only y is rounded to bf16 (~2e-3 rms relative).
    y_tol, s_tol = (2e-5, 2e-5) if dtype == mx.float32 else (8e-3, 1e-4)
    ey, es = mx_rel_l2(y, y_ref), mx_rel_l2(s, s_ref)
    assert ey <= y_tol, f"y rel-L2 {ey:.3g} > {y_tol} at {shape} {dtype}"
    assert es <= s_tol, f"state rel-L2 {es:.3g} > {s_tol} at {shape} {dtype}"


def test_gated_delta_scan_kernel_mask():
    backend = gd.gpu_backend()
    args = _inputs(2, 41, 2, 4, 128, 128, mx.float32, seed=7, masked=True)
    y, s = gd._scan_kernel_call(backend, *args)
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
