"""Numbers, shapes and paths of ``qwen_apple_backend.ops.gated_delta``.

The reference is mlx-lm's own per-token ``gated_delta_ops``; inputs are
seeded and use the real Qwen3.5/3.6 GDN head size (Dk = Dv = 128) with a GQA
ratio of 2 (Hk = 2, Hv = 4).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

import qwen_apple_backend.ops.gated_delta as gd

B, HK, HV, D = 2, 2, 4, 128

# float32 tolerances (elementwise). Measured, chunked vs mlx-lm's sequential
# reference on these inputs: max |diff| 3.4e-8 on y (|y| < 0.1) and 6e-8 on
# the state, rel-L2 <= 3.2e-7. On a CUDA GPU float32 matmuls are TF32-like
# (~5e-4 relative), so GPU runs need a looser, dtype-based bound.
F32_TOL = dict(atol=1e-5, rtol=1e-4)


def assert_close(actual, expected, *, atol, rtol, name="", max_report=5):
    """allclose in float64 that reports the first mismatching indices on failure."""
    a = np.asarray(actual.astype(mx.float32), dtype=np.float64)
    e = np.asarray(expected.astype(mx.float32), dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    bad = ~np.isclose(a, e, atol=atol, rtol=rtol)
    if bad.any():
        idx = np.argwhere(bad)[:max_report]
        rows = [f"  {tuple(int(i) for i in ix)}: got {a[tuple(ix)]:.7g}, want {e[tuple(ix)]:.7g}" for ix in idx]
        rel = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.size} mismatches (atol={atol}, rtol={rtol}, "
            f"rel-L2={rel:.3g}); first at\n" + "\n".join(rows)
        )


def rel_l2(actual, expected) -> float:
    a = np.asarray(actual.astype(mx.float32), dtype=np.float64)
    e = np.asarray(expected.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def make_inputs(T, *, b=B, hk=HK, hv=HV, d=D, seed=0, with_state=True):
    """Seeded float32 inputs with the contract of the op (normalised q/k, g in (0,1))."""
    mx.random.seed(seed)
    q = mx.random.normal((b, T, hk, d))
    k = mx.random.normal((b, T, hk, d))
    q, k = normalize_qk(q, k, inv_scale=d**-0.5, eps=1e-6)
    v = mx.random.normal((b, T, hv, d))
    # Per-head decays spread over (0.37, 1): long and short memories.
    g = mx.exp(-mx.random.uniform(0.0, 1.0, (b, T, hv)))
    beta = mx.sigmoid(mx.random.normal((b, T, hv)))
    state = mx.random.normal((b, hv, d, d)) * 0.1 if with_state else None
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


@functools.lru_cache(maxsize=None)
def reference(T, seed=0):
    q, k, v, g, beta, state = make_inputs(T, seed=seed)
    y, s = gated_delta_ops(q, k, v, g, beta, state)
    mx.eval(y, s)
    return y, s


# T values, each with the edge it hits (chunk sizes 16 / 32 / 64):
#   1   - a single token: one chunk that is all padding but one row
#   7   - shorter than every chunk; odd; under the 16-row solve block
#   63  - one short of a 64-chunk; crosses 16- and 32-chunk borders with a tail
#   65  - one past a 64-chunk: a second chunk with a single real token
#   130 - several chunks for every size plus a 2-token tail (130 = 2*64 + 2)
@pytest.mark.parametrize("T", [1, 7, 63, 65, 130])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunked_matches_reference_fp32(T, chunk):
    q, k, v, g, beta, state = make_inputs(T)
    y_ref, s_ref = reference(T)
    y, s = gd.gated_delta_chunked_ops(q, k, v, g, beta, state, chunk_size=chunk)
    assert y.dtype == mx.float32 and s.dtype == mx.float32
    assert_close(y, y_ref, **F32_TOL, name=f"y T={T} C={chunk}")
    assert_close(s, s_ref, **F32_TOL, name=f"state T={T} C={chunk}")


@pytest.mark.parametrize("T", [1, 7, 65])
def test_sequential_and_step_match_reference_fp32(T):
    q, k, v, g, beta, state = make_inputs(T)
    y_ref, s_ref = reference(T)
    y, s = gd.gated_delta_sequential_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name="sequential y")
    assert_close(s, s_ref, **F32_TOL, name="sequential state")
    y1, s1 = gd.gated_delta_step_ops(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    y1_ref, s1_ref = gated_delta_ops(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
    assert y1.shape == (B, HV, D)
    assert_close(y1, y1_ref[:, 0], **F32_TOL, name="step y")
    assert_close(s1, s1_ref, **F32_TOL, name="step state")


def test_chunked_from_zero_state_and_carried_state():
    # No initial state means zeros; splitting a sequence and carrying the state
    # must equal one pass (chunk borders 16 apart, split at 37).
    q, k, v, g, beta, _ = make_inputs(100, with_state=False)
    y_all, s_all = gd.gated_delta_chunked_ops(q, k, v, g, beta, None, chunk_size=16)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, None)
    assert_close(y_all, y_ref, **F32_TOL, name="zero-state y")
    assert_close(s_all, s_ref, **F32_TOL, name="zero-state state")
    parts = [(0, 37), (37, 100)]
    s = None
    ys = []
    for a, b in parts:
        y, s = gd.gated_delta_chunked_ops(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s, chunk_size=16
        )
        ys.append(y)
    assert_close(mx.concatenate(ys, axis=1), y_all, **F32_TOL, name="split y")
    assert_close(s, s_all, **F32_TOL, name="split state")


def test_chunked_bf16_matches_reference():
    # bf16 q/k/v/beta with float32 g and state: both paths do float32 math on
    # the same bf16 values and round y to bf16 once, so y differs by at most
    # one bf16 ulp where the float32 values straddle a rounding boundary
    # (measured max |diff| 6.1e-5 on |y| <= 0.057, rel-L2 3.7e-5) and the
    # state by float32 round-off (rel-L2 8.6e-8). Bounds: bf16 eps (7.8e-3)
    # relative plus one ulp at |y| ~ 0.06 (2.4e-4) absolute.
    T = 130
    q, k, v, g, beta, state = make_inputs(T)
    q, k, v, beta = (x.astype(mx.bfloat16) for x in (q, k, v, beta))
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    for chunk in (16, 64):
        y, s = gd.gated_delta_chunked_ops(q, k, v, g, beta, state, chunk_size=chunk)
        assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
        assert_close(y, y_ref, atol=5e-4, rtol=1e-2, name=f"bf16 y C={chunk}")
        assert rel_l2(y, y_ref) < 1e-3
        assert_close(s, s_ref, **F32_TOL, name=f"bf16 state C={chunk}")


def test_mask_keeps_state_and_zeros_output():
    T = 70
    q, k, v, g, beta, state = make_inputs(T)
    mx.random.seed(1)
    mask = mx.random.uniform(shape=(B, T)) > 0.3
    # Row 1: left padding (first 20 tokens masked), as mlx-lm batches prompts.
    mask[1, :20] = False
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    # mlx-lm's ops reference leaves y at masked tokens unspecified (its GPU
    # kernel writes zeros); ours always writes zeros.
    y_ref = mx.where(mask[..., None, None], y_ref, 0.0)
    for name, fn in (
        ("chunked16", functools.partial(gd.gated_delta_chunked_ops, chunk_size=16)),
        ("chunked64", functools.partial(gd.gated_delta_chunked_ops, chunk_size=64)),
        ("sequential", gd.gated_delta_sequential_ops),
    ):
        y, s = fn(q, k, v, g, beta, state, mask)
        assert_close(y, y_ref, **F32_TOL, name=f"{name} masked y")
        assert_close(s, s_ref, **F32_TOL, name=f"{name} masked state")

    # All False: the state comes back unchanged and the output is zero.
    none = mx.zeros((B, T), dtype=mx.bool_)
    y, s = gd.gated_delta_chunked_ops(q, k, v, g, beta, state, none, chunk_size=32)
    assert_close(s, state, atol=0, rtol=0, name="all-masked state")
    assert not mx.any(y).item()
    # Masked suffix: state equals the state after the unmasked prefix.
    tail = mx.broadcast_to(mx.arange(T) < 40, (B, T))
    _, s_tail = gd.gated_delta_chunked_ops(q, k, v, g, beta, state, tail, chunk_size=32)
    _, s_prefix = gd.gated_delta_chunked_ops(
        q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], state, chunk_size=32
    )
    assert_close(s_tail, s_prefix, **F32_TOL, name="masked-suffix state")


def test_underflowing_gates_stay_finite():
    # g == 0 (exp underflow for a large A_log * dt) must wipe the state, not
    # produce inf - inf = nan in the cumulative log-gates.
    T = 40
    q, k, v, g, beta, state = make_inputs(T)
    g[:, 5] = 0.0
    g[0, 30:33, 1] = 1e-42  # float32 denormal
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gd.gated_delta_chunked_ops(q, k, v, g, beta, state, chunk_size=16)
    assert mx.all(mx.isfinite(y)).item() and mx.all(mx.isfinite(s)).item()
    assert_close(y, y_ref, **F32_TOL, name="g=0 y")
    assert_close(s, s_ref, **F32_TOL, name="g=0 state")


def test_gated_delta_precision():
    # 512-step recurrence in bf16 (q, k, v, beta bf16; g, state float32)
    # against the float32 reference on the same values. The state must stay
    # float32 throughout, so it tracks the reference to float32 round-off
    # (measured rel-L2: chunked 8.3e-8, token by token 0) and y only carries
    # its final bf16 rounding (measured rel-L2 1.7e-3). Against float32 inputs
    # that were never rounded to bf16 the drift is the input rounding:
    # measured rel-L2 2.6e-3 (state) and 3.7e-3 (y).
    T = 512
    q, k, v, g, beta, state = make_inputs(T, b=1, seed=3)
    lo = [x.astype(mx.bfloat16) for x in (q, k, v, beta)]
    hi = [x.astype(mx.float32) for x in lo]
    y_ref, s_ref = gated_delta_ops(hi[0], hi[1], hi[2], g, hi[3], state)
    y_f32, s_f32 = gated_delta_ops(q, k, v, g, beta, state)

    y, s = gd.gated_delta(lo[0], lo[1], lo[2], g, lo[3], state, chunk_size=64)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    assert rel_l2(s, s_ref) < 1e-5, rel_l2(s, s_ref)
    assert rel_l2(y, y_ref) < 4e-3, rel_l2(y, y_ref)
    assert rel_l2(s, s_f32) < 1e-2 and rel_l2(y, y_f32) < 1e-2

    # Decode: 512 single-token dispatcher calls.
    s_dec = state
    ys = []
    for t in range(T):
        y_t, s_dec = gd.gated_delta(
            lo[0][:, t : t + 1], lo[1][:, t : t + 1], lo[2][:, t : t + 1],
            g[:, t : t + 1], lo[3][:, t : t + 1], s_dec,
        )
        ys.append(y_t)
        if t % 64 == 63:
            mx.eval(s_dec, ys)
    assert s_dec.dtype == mx.float32
    assert rel_l2(s_dec, s_ref) < 1e-5, rel_l2(s_dec, s_ref)
    assert rel_l2(mx.concatenate(ys, axis=1), y_ref) < 4e-3


def test_chunked_is_differentiable():
    # Training runs the ops path (use_kernel=False); gradients through the
    # blocked solve (chunk 32 = two 16-row blocks) must match the loop's.
    q, k, v, g, beta, state = make_inputs(40, b=1, d=32)

    def loss(fn):
        return lambda v, beta: fn(q, k, v, g, beta, state)[0].sum()

    grads = mx.grad(loss(functools.partial(gd.gated_delta_chunked_ops, chunk_size=32)), argnums=(0, 1))(v, beta)
    grads_ref = mx.grad(loss(gated_delta_ops), argnums=(0, 1))(v, beta)
    for name, a, e in zip(("dv", "dbeta"), grads, grads_ref):
        assert_close(a, e, atol=1e-5, rtol=1e-4, name=name)


def test_compute_gates_and_l2norm_match_mlx_lm_exactly():
    mx.random.seed(4)
    A_log = mx.log(mx.random.uniform(0.5, 16.0, (HV,)))
    for dtype in (mx.float32, mx.bfloat16):
        a = mx.random.normal((B, 9, HV)).astype(dtype)
        b = mx.random.normal((B, 9, HV)).astype(dtype)
        dt_bias = mx.random.normal((HV,)).astype(dtype)
        g, beta = gd.compute_gates(A_log, a, dt_bias, b)
        assert g.dtype == mx.float32 and beta.dtype == dtype
        assert mx.array_equal(g, compute_g(A_log, a, dt_bias)).item()
        assert mx.array_equal(beta, mx.sigmoid(b)).item()
        q = mx.random.normal((B, 9, HK, D)).astype(dtype)
        k = mx.random.normal((B, 9, HK, D)).astype(dtype)
        qn, kn = gd.l2norm_qk(q, k, 1e-6)
        qr, kr = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
        assert mx.array_equal(qn, qr).item() and mx.array_equal(kn, kr).item()


def test_shape_errors():
    q, k, v, g, beta, state = make_inputs(3)
    with pytest.raises(ValueError, match="multiple"):
        gd.gated_delta(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="state"):
        gd.gated_delta(q, k, v, g, beta, state[:, :, :5])
    with pytest.raises(ValueError, match="mask"):
        gd.gated_delta(q, k, v, g, beta, state, mx.ones((B, 4), dtype=mx.bool_))
    with pytest.raises(ValueError, match="chunk_size"):
        gd.gated_delta_chunked_ops(q, k, v, g, beta, state, chunk_size=0)


# ----------------------------------------------------------------------------
# Which path runs
# ----------------------------------------------------------------------------


class _Calls:
    """Wraps a function and records the keyword/positional args of each call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def _spy_paths(monkeypatch):
    spies = {
        name: _Calls(getattr(gd, name))
        for name in ("gated_delta_step_ops", "gated_delta_sequential_ops", "gated_delta_chunked_ops")
    }
    for name, spy in spies.items():
        monkeypatch.setattr(gd, name, spy)
    return spies


@pytest.mark.parametrize(
    "T, path",
    [
        (1, "gated_delta_step_ops"),
        (gd.SEQUENTIAL_MAX_T, "gated_delta_sequential_ops"),
        (gd.SEQUENTIAL_MAX_T + 1, "gated_delta_chunked_ops"),
        (200, "gated_delta_chunked_ops"),
    ],
)
def test_dispatcher_picks_path_by_length(monkeypatch, T, path):
    spies = _spy_paths(monkeypatch)
    q, k, v, g, beta, state = make_inputs(T, b=1)
    y, s = gd.gated_delta(q, k, v, g, beta, state)
    assert {n: len(sp.calls) for n, sp in spies.items()} == {
        n: int(n == path) for n in spies
    }
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name=f"dispatch y T={T}")
    assert_close(s, s_ref, **F32_TOL, name=f"dispatch state T={T}")


def test_dispatcher_chunk_size_from_env(monkeypatch):
    spies = _spy_paths(monkeypatch)
    q, k, v, g, beta, state = make_inputs(40, b=1)
    monkeypatch.setenv("QAB_GDN_CHUNK", "16")
    gd.gated_delta(q, k, v, g, beta, state)
    gd.gated_delta(q, k, v, g, beta, state, chunk_size=32)
    monkeypatch.delenv("QAB_GDN_CHUNK")
    gd.gated_delta(q, k, v, g, beta, state)  # default 64 > T=40: cut to 64
    gd.gated_delta(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], state)
    gd.gated_delta(q[:, :9], k[:, :9], v[:, :9], g[:, :9], beta[:, :9], state)
    sizes = [args[-1] for args, _ in spies["gated_delta_chunked_ops"].calls]
    # Shorter than one chunk: the next power of two, at least 16.
    assert sizes == [16, 32, 64, 32, 16]


def _fake_gpu(monkeypatch, scan):
    """Pretend a GPU with a gated delta kernel is present; ``scan`` is the kernel."""
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(gd, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(gd, "_scan_kernel_object", lambda backend: object())
    monkeypatch.setattr(gd, "_scan_kernel_call", scan)


def test_no_kernel_on_cpu():
    q, k, v, g, beta, state = make_inputs(20, b=1)
    assert gd.kernel_ready(2, 4, 32, 32, mx.float32) is None
    with pytest.raises(RuntimeError, match="no gated_delta kernel"):
        gd.gated_delta_kernel(q, k, v, g, beta, state)


def test_dispatcher_uses_a_kernel_that_passes_its_self_check(monkeypatch):
    calls = []

    def good_kernel(backend, *args):
        calls.append(backend)
        return gd.gated_delta_sequential_ops(*args)

    _fake_gpu(monkeypatch, good_kernel)
    q, k, v, g, beta, state = make_inputs(20, b=1)
    spies = _spy_paths(monkeypatch)
    y, s = gd.gated_delta(q, k, v, g, beta, state)
    # One self-check call plus the real call; the chunked ops path never ran.
    assert calls == ["fakegpu", "fakegpu"]
    assert len(spies["gated_delta_chunked_ops"].calls) == 0
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name="kernel path y")
    gd.gated_delta(q, k, v, g, beta, state)  # verdict cached: no second check
    assert calls == ["fakegpu"] * 3

    gd.gated_delta(q, k, v, g, beta, state, use_kernel=False)
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    gd.gated_delta(q, k, v, g, beta, state)
    assert calls == ["fakegpu"] * 3
    assert len(spies["gated_delta_chunked_ops"].calls) == 2


def test_a_wrong_kernel_is_rejected_with_a_warning(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning, self_check_results

    calls = []

    def wrong_kernel(backend, *args):
        calls.append(backend)
        y, s = gd.gated_delta_sequential_ops(*args)
        return y * 1.5, s  # deliberately wrong output

    _fake_gpu(monkeypatch, wrong_kernel)
    q, k, v, g, beta, state = make_inputs(20, b=1)
    spies = _spy_paths(monkeypatch)
    with pytest.warns(KernelSelfCheckWarning, match=r"gated_delta_scan failed its self-check"
                      r".*output 0 relative L2 error 0\.5"):
        y, s = gd.gated_delta(q, k, v, g, beta, state)
    assert calls == ["fakegpu"]  # only the self-check ran it
    assert len(spies["gated_delta_chunked_ops"].calls) == 1
    y_ref, _ = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name="fallback y")
    (verdict,) = self_check_results().values()
    assert verdict[0] is False and "relative L2 error" in verdict[1]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached verdict: no second warning, no re-check
        gd.gated_delta(q, k, v, g, beta, state)
    assert calls == ["fakegpu"]


@pytest.mark.parametrize("failure", ["raises", "nan", "shape"])
def test_broken_kernels_fall_back(monkeypatch, failure):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    def broken(backend, *args):
        y, s = gd.gated_delta_sequential_ops(*args)
        if failure == "raises":
            raise RuntimeError("nvrtc: error: identifier undefined")
        if failure == "nan":
            return y * float("nan"), s
        return y[:, :-1], s

    _fake_gpu(monkeypatch, broken)
    q, k, v, g, beta, state = make_inputs(20, b=1)
    match = {"raises": "RuntimeError: nvrtc: error", "nan": "non-finite",
             "shape": "the reference"}[failure]
    with pytest.warns(KernelSelfCheckWarning, match=match):
        y, s = gd.gated_delta(q, k, v, g, beta, state)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name="fallback y")
    assert_close(s, s_ref, **F32_TOL, name="fallback state")


def _fake_cuda_with_staged(monkeypatch, staged, scan):
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(gd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(gd, "_scan_kernel_object", lambda backend: object())
    monkeypatch.setattr(gd, "_staged_kernel_object", lambda backend: object())
    monkeypatch.setattr(gd, "_scan_kernel_call", scan)
    monkeypatch.setattr(gd, "_staged_kernel_call", staged)


def test_prefill_prefers_the_staged_scan_and_decode_keeps_the_plain_one(monkeypatch):
    calls = []

    def staged(backend, *args):
        calls.append(("staged", args[0].shape[1]))
        return gd.gated_delta_sequential_ops(*args)

    def scan(backend, *args):
        calls.append(("scan", args[0].shape[1]))
        return gd.gated_delta_sequential_ops(*args)

    _fake_cuda_with_staged(monkeypatch, staged, scan)
    q, k, v, g, beta, state = make_inputs(20, b=1)
    y, s = gd.gated_delta(q, k, v, g, beta, state)
    # Self-check on two whole chunks plus 3 tokens (float32 Dk=128: TC=16),
    # then the real call.
    tc = gd._staged_tile(D, D, mx.float32, gd.STAGED_LPR)
    assert tc == 16
    assert calls == [("staged", 2 * tc + 3), ("staged", 20)]
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(y, y_ref, **F32_TOL, name="staged y")
    calls.clear()
    gd.gated_delta(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
    assert [c[0] for c in calls] == ["scan", "scan"]  # its self-check, then the call


def test_a_wrong_staged_scan_falls_back_to_the_plain_scan(monkeypatch):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    calls = []

    def staged(backend, *args):
        calls.append("staged")
        y, s = gd.gated_delta_sequential_ops(*args)
        return y, s + 1.0  # deliberately wrong state

    def scan(backend, *args):
        calls.append("scan")
        return gd.gated_delta_sequential_ops(*args)

    _fake_cuda_with_staged(monkeypatch, staged, scan)
    q, k, v, g, beta, state = make_inputs(20, b=1)
    with pytest.warns(KernelSelfCheckWarning,
                      match=r"gated_delta_scan_staged failed its self-check.*output 1"):
        y, s = gd.gated_delta(q, k, v, g, beta, state)
    assert calls == ["staged", "scan", "scan"]
    _, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    assert_close(s, s_ref, **F32_TOL, name="fallback state")


def test_staged_tile_fits_shared_memory():
    assert gd._staged_tile(128, 128, mx.bfloat16, 8) == 32
    assert gd._staged_tile(128, 128, mx.float32, 8) == 16
    assert gd._staged_tile(256, 128, mx.bfloat16, 8) == 16
    assert gd._staged_tile(128, 100, mx.bfloat16, 8) is None  # Dv % rows
    assert gd._staged_tile(36, 128, mx.bfloat16, 8) is None   # Dk * 2 bytes % 16


# ----------------------------------------------------------------------------
# One decode token of a whole layer: gated_delta_decode(_ops / _kernel)
# ----------------------------------------------------------------------------

DEC_HK, DEC_HV, DEC_D, DEC_KC = 2, 4, 32, 4


def make_decode_inputs(b=2, hk=DEC_HK, hv=DEC_HV, dk=DEC_D, dv=DEC_D, kc=DEC_KC,
                       dtype=mx.float32, bias=False, mask=None, lengths=None, seed=0):
    """Seeded inputs of gated_delta_decode_ops (projection outputs of one token, weights, states)."""
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 11)
    return (
        mx.random.normal((b, C), key=keys[0]).astype(dtype),
        mx.random.normal((b, hv * dv), key=keys[1]).astype(dtype),
        mx.random.normal((b, hv), key=keys[2]).astype(dtype),
        mx.random.normal((b, hv), key=keys[3]).astype(dtype),
        mx.random.normal((b, kc - 1, C), key=keys[4]).astype(dtype),
        (0.5 * mx.random.normal((C, kc, 1), key=keys[5])).astype(dtype),
        (0.1 * mx.random.normal((C,), key=keys[6])).astype(dtype) if bias else None,
        mx.log(mx.random.uniform(0.05, 2.0, (hv,), key=keys[7])),
        (1.0 + 0.5 * mx.random.normal((hv,), key=keys[8])).astype(dtype),
        (1.0 + 0.1 * mx.random.normal((dv,), key=keys[9])).astype(dtype),
        0.1 * mx.random.normal((b, hv, dv, dk), key=keys[10]),
        None if mask is None else mx.array(mask),
        None if lengths is None else mx.array(lengths, dtype=mx.int32),
    )


# (bias, mask, lengths): stock (no bias, no mask); batched generation with a
# live row, a left-padded row (masked, conv state still shifts) and a finished
# row (lengths 0: conv state kept); lengths alone.
DECODE_VARIANTS = {
    "plain": dict(),
    "bias-mask-lengths": dict(b=3, bias=True, mask=[True, False, False], lengths=[1, 1, 0]),
    "lengths": dict(b=3, lengths=[2, 0, 1]),
}


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_decode_ops_equals_the_layer_decode_step(variant, dtype):
    # The portable reference of the decode kernel is today's compiled decode
    # step of the fused layer (already tested against stock mlx-lm), op for op.
    import qwen_apple_backend.layers.gated_delta as layer_mod

    args = make_decode_inputs(dtype=dtype, **DECODE_VARIANTS[variant])
    qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, state, mask, lengths = args
    out, new_conv, new_state = gd.gated_delta_decode_ops(*args, norm_eps=1e-6)
    Bn = qkv.shape[0]
    ref = layer_mod._decode_step(
        (qkv[:, None], z[:, None].reshape(Bn, 1, DEC_HV * DEC_D), b[:, None], a[:, None]),
        conv_state, state, conv_w, conv_b, A_log, dt_bias, norm_w,
        None if mask is None else mask[:, None], lengths,
        "qwen3_5", DEC_HK, DEC_HV, DEC_D, DEC_D, conv_w.shape[0], 1e-6, False,
    )
    assert out.shape == (Bn, DEC_HV, DEC_D) and out.dtype == dtype
    assert new_conv.shape == conv_state.shape and new_conv.dtype == dtype
    assert new_state.dtype == mx.float32
    for name, got, want in zip(("out", "conv state", "state"), (out, new_conv, new_state), ref):
        assert mx.array_equal(got.reshape(want.shape), want).item(), name
    if mask is not None:
        # Masked rows: zero output, recurrent state passed through.
        assert not mx.any(out[1:]).item()
        assert mx.array_equal(new_state[1:], state[1:]).item()
    if lengths is not None:
        # Rows whose length is used up keep their conv state; others shift.
        for row, n in enumerate(lengths.tolist()):
            want = conv_state[row] if n <= 0 else mx.concatenate(
                [conv_state[row, 1:], mx.where(mask[row], qkv[row], 0)[None]
                 if mask is not None else qkv[row][None]])
            assert mx.array_equal(new_conv[row], want).item(), f"row {row}"


def test_decode_shape_errors():
    args = list(make_decode_inputs())
    cases = {
        "qkv width": (0, args[0][:, :-1]),
        "z must be": (1, args[1][:, :-1]),
        "conv_state must be": (4, args[4][:, :2]),
        "conv_w must be": (5, args[5].reshape(1, *args[5].shape)),
        "norm_w must be": (9, args[9][:-1]),
        "mask must be": (11, mx.ones((2, 1), dtype=mx.bool_)),
    }
    for match, (i, bad) in cases.items():
        broken = list(args)
        broken[i] = bad
        with pytest.raises(ValueError, match=match):
            gd.gated_delta_decode_ops(*broken)
        with pytest.raises(ValueError, match=match):
            gd.gated_delta_decode(*broken)


def test_no_decode_kernel_on_cpu():
    args = make_decode_inputs()
    assert gd.decode_kernel_ready(DEC_HK, DEC_HV, DEC_D, DEC_D, DEC_KC, mx.float32) is None
    with pytest.raises(RuntimeError, match="no gated_delta_decode kernel"):
        gd.gated_delta_decode_kernel(*args)
    out = gd.gated_delta_decode(*args)
    ref = gd.gated_delta_decode_ops(*args)
    assert all(mx.array_equal(o, r).item() for o, r in zip(out, ref))


def test_decode_kernel_support_limits():
    # Dk a multiple of 32 up to 256, conv kernel >= 2, float dtypes, and at
    # most 64 state floats per lane with 8 warps (ceil(Dv / 8) * Dk / 32).
    ok = gd._decode_supported
    assert ok(128, 128, 4, mx.bfloat16) and ok(64, 64, 4, mx.float32) and ok(32, 37, 4, mx.float16)
    assert ok(64, 256, 4, mx.bfloat16) and ok(256, 64, 4, mx.bfloat16)
    assert not ok(48, 128, 4, mx.bfloat16)   # Dk % 32
    assert not ok(128, 129, 4, mx.bfloat16)  # 17 rows per warp x 4 floats
    assert not ok(256, 128, 4, mx.bfloat16)  # 16 rows x 8 floats
    assert not ok(128, 128, 1, mx.bfloat16)  # no conv state
    assert not ok(128, 128, 4, mx.int32)


def _fake_decode_gpu(monkeypatch, kernel):
    """Pretend a GPU whose decode kernel is ``kernel(backend, *args, **kw)``."""
    from qwen_apple_backend.ops import device

    device.reset_self_checks()
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(gd, "gpu_backend", lambda: "fakegpu")
    monkeypatch.setattr(gd, "_decode_kernel_object", lambda backend: object())
    monkeypatch.setattr(gd, "_decode_kernel_call", kernel)


def test_decode_dispatcher_uses_a_kernel_that_passes_its_self_check(monkeypatch):
    from qwen_apple_backend.ops.device import self_check_results

    calls = []

    def good(backend, *args, **kw):
        calls.append(args[0].shape[0])  # batch of the call
        return gd.gated_delta_decode_ops(*args, **kw)

    _fake_decode_gpu(monkeypatch, good)
    args = make_decode_inputs(b=2)
    out = gd.gated_delta_decode(*args)
    # The self-check (one row: no mask, no lengths) at these head sizes, then the call.
    assert calls == [1, 2]
    ref = gd.gated_delta_decode_ops(*args)
    assert all(mx.array_equal(o, r).item() for o, r in zip(out, ref))
    gd.gated_delta_decode(*args)
    assert calls == [1, 2, 2]  # verdict cached
    (key, verdict), = self_check_results().items()
    assert key == ("gated_delta_decode", "fakegpu",
                   (DEC_HK, DEC_HV, DEC_D, DEC_D, DEC_KC, "mlx.core.float32", False, False, False))
    assert verdict == (True, "passed")

    # Another shape class (mask and lengths given): its own self-check on a
    # live, a left-padded and a finished row.
    masked = make_decode_inputs(b=3, mask=[True, True, False], lengths=[1, 1, 0])
    gd.gated_delta_decode(*masked)
    assert calls == [1, 2, 2, 3, 3]
    # Switched off: the ops path.
    gd.gated_delta_decode(*args, use_kernel=False)
    monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
    gd.gated_delta_decode(*args)
    # Activations and weights of different dtypes: the ops path.
    monkeypatch.delenv("QAB_DISABLE_KERNELS")
    mixed = list(args)
    mixed[5] = mixed[5].astype(mx.bfloat16)
    gd.gated_delta_decode(*mixed)
    assert calls == [1, 2, 2, 3, 3]


@pytest.mark.parametrize("failure", ["out", "conv_state", "state", "raises"])
def test_a_wrong_decode_kernel_is_rejected_with_a_warning(monkeypatch, failure):
    from qwen_apple_backend.ops.device import KernelSelfCheckWarning

    calls = []

    def wrong(backend, *args, **kw):
        calls.append(backend)
        out, conv, state = gd.gated_delta_decode_ops(*args, **kw)
        if failure == "raises":
            raise RuntimeError("nvrtc: error: identifier undefined")
        if failure == "out":
            out = out * 1.5
        elif failure == "conv_state":
            conv = conv[:, ::-1]  # rows in the wrong order
        else:
            state = state + 0.5
        return out, conv, state

    _fake_decode_gpu(monkeypatch, wrong)
    args = make_decode_inputs()
    match = {"out": "output 0", "conv_state": "output 1", "state": "output 2",
             "raises": "RuntimeError: nvrtc"}[failure]
    with pytest.warns(KernelSelfCheckWarning,
                      match=f"gated_delta_decode failed its self-check.*{match}"):
        out = gd.gated_delta_decode(*args)
    assert calls == ["fakegpu"]  # only the self-check ran it
    ref = gd.gated_delta_decode_ops(*args)
    assert all(mx.array_equal(o, r).item() for o, r in zip(out, ref))


def test_decode_self_check_compares_at_the_real_shape(monkeypatch):
    seen = []

    def good(backend, *args, **kw):
        seen.append([None if x is None else (tuple(x.shape), x.dtype) for x in args])
        return gd.gated_delta_decode_ops(*args, **kw)

    _fake_decode_gpu(monkeypatch, good)
    assert gd.decode_kernel_ready(16, 32, 128, 128, 4, mx.bfloat16, has_bias=True,
                                  has_mask=True, has_lengths=True) == "fakegpu"
    (shapes,) = seen
    C = 2 * 16 * 128 + 32 * 128
    assert shapes[0] == ((3, C), mx.bfloat16)
    assert shapes[5] == ((C, 4, 1), mx.bfloat16) and shapes[6] == ((C,), mx.bfloat16)
    assert shapes[10] == ((3, 32, 128, 128), mx.float32)
    assert shapes[11][0] == (3,) and shapes[12] == ((3,), mx.int32)
    # Unsupported head sizes never reach the kernel.
    assert gd.decode_kernel_ready(16, 32, 48, 128, 4, mx.bfloat16) is None
    assert len(seen) == 1
