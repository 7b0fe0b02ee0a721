"""CUDA kernel bodies run on the CPU through a C++ emulation of the CUDA they use.

The CUDA kernels (``kernels/cuda/*.cu``) run only on an NVIDIA GPU, rarely at
hand where this package is developed. This test runs them first on the CPU
(``tests/_cuda_emulation.py``: one fiber per GPU thread, block and warp
barriers, shuffles through per-warp slots, poisoned shared memory, cp.async
completing at its wait, bfloat16/half rounding, AddressSanitizer and UBSan),
launched by the ops modules' own launch code (``_scan_kernel_call``,
``_staged_kernel_call``, ``_moe_decode_kernel_call`` and the ``gated_delta``
dispatcher with its self-check), at small and odd shapes, against the same
portable MLX references and dtype tolerances as ``tests/test_kernels_gpu.py``.
Every launch runs in two schedules (reverse / forward block and thread order)
that must agree bit for bit; every output element must be written and nothing
outside the outputs. The tests of whole models and of the dispatcher's
plumbing run one schedule (:func:`one_schedule`): each kernel build they
launch is run in both by its own kernel-level test.

What it catches: index arithmetic, masking, partial chunks and blocks, the
warp and group reductions, missing barriers or cp.async waits, reads of
unwritten shared memory, reads past an input, writes past an output, the
48 KiB static shared-memory limit, the launch grid. What it does NOT check:
that nvcc/NVRTC accepts the source, the real memory model and timing,
register pressure, speed, fast-math precision. ``moe_grouped_gemm`` (tensor-core
``mma.sync`` PTX) is out of scope. The negative tests break a kernel on
purpose (a shuffle offset, a barrier, a cp.async wait, a row index) and
require the harness to fail.

Skipped when no C++20 compiler is on PATH.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from qwen_apple_backend.ops import attention as attn_ops
from qwen_apple_backend.ops import device
from qwen_apple_backend.ops import gated_delta as gd
from qwen_apple_backend.ops import linear as lin_ops
from qwen_apple_backend.ops import moe as moe_ops
from qwen_apple_backend.ops._sources import kernel_source
from qwen_apple_backend.ops.moe import serial_decode_trace

from . import _cuda_emulation as emu
from ._metrics import mx_rel_l2
from .test_kernels_gpu import (_anr_inputs, _assert_block_is_the_three_launches,
                               _assert_gdn_block_is_gdn_then_block, _assert_pack_is_the_block,
                               _fused_pair, _gdn_step_case,
                               _assert_next_proj_block_is_block_then_norm_gemv,
                               _assert_out_proj_block_is_gemv_then_block, _next_proj_case,
                               _out_proj_case,
                               _assert_masked_scan, _assert_scan_matches_reference, _block_case,
                               _experts, _inputs)

pytestmark = pytest.mark.skipif(emu.CXX is None, reason="no C++ compiler on PATH")


def _clear_kernel_caches():
    for module in (gd, moe_ops, attn_ops, lin_ops):
        for name in dir(module):
            fn = getattr(module, name)
            if name.endswith(("_object", "_objects")) and hasattr(fn, "cache_clear"):
                fn.cache_clear()


def one_schedule(monkeypatch) -> None:
    """Launches run in one schedule (reverse block and thread order), not two.

    For the tests whose subject is a model's or a dispatcher's plumbing
    (which launch runs, with which pack, states written where, the verdicts)
    rather than a kernel: each build they launch is also a kernel-level case
    here, run in both schedules at the same or Qwen3.6's widths. A second
    schedule is most of such a test's time: the pack test's 139 launches took
    166 s in two schedules and 92 s in one (2 cores, sanitized builds).
    """
    monkeypatch.setattr(emu, "DEFAULT_SCHEDULES", 1)


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    """The ops modules build their CUDA kernels on the CPU emulator."""
    emu.require()
    monkeypatch.setattr(gd, "build_kernel", emu.build_kernel)
    monkeypatch.setattr(moe_ops, "build_kernel", emu.build_kernel)
    monkeypatch.setattr(attn_ops, "build_kernel", emu.build_kernel)
    monkeypatch.setattr(lin_ops, "build_kernel", emu.build_kernel)
    _clear_kernel_caches()
    yield
    _clear_kernel_caches()


def _broken(monkeypatch, op, old, new, *, header=False):
    """Make the ops modules build ``op`` from a copy with ``old`` replaced by ``new``."""
    src = kernel_source(op, "cuda")
    text = src.header if header else src.body
    assert text.count(old) == 1, f"mutation target not found once in {op}: {old!r}"
    text = text.replace(old, new)
    kw = {"header": text} if header else {"source": text}

    def build(name, backend, **options):
        return emu.build_kernel(name, backend, **(kw if name == op else {}), **options)

    for module in (gd, moe_ops, attn_ops, lin_ops):
        monkeypatch.setattr(module, "build_kernel", build)
    _clear_kernel_caches()


# --------------------------------------------------------------------------
# gated_delta_scan and gated_delta_scan_staged
# --------------------------------------------------------------------------

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16

# (B, T, Hk, Hv, Dk, Dv, dtype): GQA with 2 floats per lane and two blocks of
# 4 rows per head, in float32 and bfloat16; one decode token in float16 with
# Hk == Hv and Dk = 32.
SCAN_CASES = [
    (1, 13, 2, 4, 64, 8, F32),
    (1, 13, 2, 4, 64, 8, BF16),
    (1, 1, 2, 2, 32, 4, F16),
]


@pytest.mark.parametrize("case", SCAN_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_gated_delta_scan_emulated(case):
    *shape, dtype = case
    args = _inputs(*shape, dtype, seed=sum(shape))
    out = gd._scan_kernel_call("cuda", *args)
    if dtype == F16:  # not in the GPU tests: y rounds to half (~3e-4 rms relative)
        y_ref, s_ref = gd.gated_delta_sequential_ops(*[a.astype(F32) for a in args[:5]], args[5])
        assert out[0].dtype == F16
        assert mx_rel_l2(out[0], y_ref) <= 2e-3 and mx_rel_l2(out[1], s_ref) <= 2e-5
    else:
        _assert_scan_matches_reference(out, args, dtype, f"{shape} {dtype}")


def test_gated_delta_scan_emulated_mask_batch_one_row_blocks():
    # Batch 2, a mask, Hk == Hv, Dv = 6 (not a multiple of 4: one row per block).
    args = _inputs(2, 9, 2, 2, 32, 6, F32, seed=5, masked=True)
    _assert_masked_scan(gd._scan_kernel_call("cuda", *args), args)


# (B, T, Hk, Hv, Dk, Dv, dtype, lanes per row): T = 37 over a chunk of 32
# (the second chunk partial); T = 70 in three chunks of 32 (both buffers
# reused) with 16 lanes per row (8 rows, two blocks per head).
STAGED_CASES = [
    (1, 37, 1, 2, 64, 16, F32, 8),
    (1, 70, 2, 2, 128, 16, BF16, 16),
]


@pytest.mark.parametrize("case", STAGED_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}-lpr{c[7]}")
def test_gated_delta_scan_staged_emulated(case):
    *shape, dtype, lpr = case
    tc = gd._staged_tile(shape[4], shape[5], dtype, lpr)
    assert tc is not None and shape[1] % tc and shape[1] > tc  # a partial last chunk
    args = _inputs(*shape, dtype, seed=sum(shape))
    out = gd._staged_kernel_call("cuda", *args, lpr=lpr)
    _assert_scan_matches_reference(out, args, dtype, f"{shape} {dtype} lpr {lpr}")


def test_gated_delta_scan_staged_emulated_mask_batch():
    # Dk = 128 float32 halves the chunk to 16 tokens: 37 tokens in three chunks.
    assert gd._staged_tile(128, 16, F32, gd.STAGED_LPR) == 16
    args = _inputs(2, 37, 1, 2, 128, 16, F32, seed=9, masked=True)
    _assert_masked_scan(gd._staged_kernel_call("cuda", *args), args)


def test_gated_delta_dispatcher_self_checks_and_runs_the_emulated_kernel(monkeypatch):
    # The whole GPU path of gated_delta on a faked CUDA device: the staged
    # kernel's self-check (three chunks), then the call itself.
    monkeypatch.setattr(gd, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        args = _inputs(1, 19, 1, 2, 64, 16, F32, seed=3)
        y, s = gd.gated_delta(*args)
        verdicts = device.self_check_results()
        assert verdicts == {("gated_delta_scan_staged", "cuda", (1, 2, 64, 16, str(F32),
                                                                  gd.STAGED_LPR)):
                            (True, "passed")}
        _assert_scan_matches_reference((y, s), args, F32, "dispatcher")
    finally:
        device.reset_self_checks()


# --------------------------------------------------------------------------
# MoE decode GEMVs (moe_gate_up_gemv, moe_down_gemv)
# --------------------------------------------------------------------------

# (N, E, H, I, K, dtype, group size): two tokens, 64-wide groups, float32; one
# token in bfloat16 with H = 2048 (two chunks per lane), K = 3, 32-wide groups.
MOE_CASES = [
    (2, 4, 1024, 64, 2, F32, 64),
    (1, 8, 2048, 32, 3, BF16, 32),
]


def _moe_problem(N, E, H, I, K, dtype, group_size):
    gu, dn = _experts(E, H, I, dtype, seed=N + E + H + I + K, group_size=group_size)
    kx, ki, ks = mx.random.split(mx.random.key(N * K), 3)
    x = mx.random.normal((N, 1, H), key=kx).astype(dtype)
    inds = mx.argsort(mx.random.uniform(shape=(N, 1, E), key=ki), axis=-1)[..., :K]
    scores = mx.softmax(mx.random.normal((N, 1, K), key=ks), axis=-1).astype(dtype)  # router's
    assert moe_ops._gemv_shapes_supported(H, gu, dn)
    return x, inds.astype(mx.uint32), scores, gu, dn


def _assert_moe_matches_reference(x, inds, scores, gu, dn):
    y = moe_ops._moe_decode_kernel_call("cuda", x, inds, scores, gu, dn)
    ref = moe_ops.moe_experts_ops(x.astype(F32), inds, scores.astype(F32), gu, dn, sort=False)
    assert y.shape == x.shape and y.dtype == x.dtype
    tol = 1e-5 if x.dtype == F32 else 3e-2  # as in tests/test_kernels_gpu.py
    err = mx_rel_l2(y, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol}"


@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}")
def test_moe_decode_gemvs_emulated(case):
    _assert_moe_matches_reference(*_moe_problem(*case))


# --------------------------------------------------------------------------
# The harness fails on broken kernels
# --------------------------------------------------------------------------

BROKEN = {
    # The warp butterfly skips a lane distance: wrong sums.
    "wrong shuffle offset": ("gated_delta_scan", "x += __shfl_xor_sync(0xffffffffu, x, o);\n  }\n"
                             "  return x;\n}\n\ntemplate",
                             "x += __shfl_xor_sync(0xffffffffu, x, o ^ 1);\n  }\n"
                             "  return x;\n}\n\ntemplate", True),
    # The next chunk's k/q copies overwrite the buffer other warps still read.
    "missing __syncthreads": ("gated_delta_scan_staged",
                              "__syncthreads();  // everyone is done with buffer p", "", False),
    # Computes on a chunk whose cp.async copies may not have landed.
    "cp.async wait too short": ("gated_delta_scan_staged", "qab_cp_async_wait<1>();",
                                "qab_cp_async_wait<2>();", False),
    # Off-by-one weight row: the last expert reads past the weights.
    "off-by-one row": ("moe_down_gemv", "const size_t row = (size_t)e * H + o;",
                       "const size_t row = (size_t)e * H + o + 1;", False),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_broken_kernels_fail(monkeypatch, what):
    op, old, new, in_header = BROKEN[what]
    _broken(monkeypatch, op, old, new, header=in_header)
    with pytest.raises(AssertionError) as failure:
        if op == "gated_delta_scan":
            args = _inputs(*SCAN_CASES[0][:6], F32, seed=1)
            _assert_scan_matches_reference(gd._scan_kernel_call("cuda", *args), args, F32, what)
        elif op == "gated_delta_scan_staged":
            args = _inputs(1, 70, 1, 2, 64, 16, F32, seed=1)  # three chunks of 32
            _assert_scan_matches_reference(gd._staged_kernel_call("cuda", *args), args, F32, what)
        else:
            # Every expert chosen, so the last expert's last row is read.
            x, inds, scores, gu, dn = _moe_problem(*MOE_CASES[0])
            inds = mx.array(np.array([[[3, 0]], [[2, 3]]], dtype=np.uint32))
            _assert_moe_matches_reference(x, inds, scores, gu, dn)
    # Caught by the emulator or the reference check, not by a compile error.
    assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)


def test_dispatcher_rejects_a_broken_emulated_kernel(monkeypatch):
    # The self-check sees the broken staged kernel, warns, and the call still
    # returns the right answer (from the per-warp scan kernel).
    _broken(monkeypatch, "gated_delta_scan_staged",
            "__syncthreads();  // everyone is done with buffer p", "")
    monkeypatch.setattr(gd, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        args = _inputs(1, 19, 1, 2, 64, 16, F32, seed=3)
        with pytest.warns(device.KernelSelfCheckWarning, match="gated_delta_scan_staged"):
            y, s = gd.gated_delta(*args)
        verdicts = device.self_check_results()
        assert [v[0] for k, v in sorted(verdicts.items())] == [True, False]
        _assert_scan_matches_reference((y, s), args, F32, "fallback")
    finally:
        device.reset_self_checks()


def test_tensor_core_kernel_is_out_of_scope():
    # The mma.sync PTX sits in the grouped GEMM's tile helper (its header):
    # generating the emulated program refuses it.
    kernel = emu.build_kernel("moe_grouped_gemm")
    ins = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16, mx.int32, mx.int32, mx.int32]
    with pytest.raises(emu.NotEmulated, match="asm"):
        kernel.generated_source(ins, [2, 3, 3, 3, 1, 1, 1], [mx.bfloat16],
                                [("KDIM", 64), ("NOUT", 64), ("E", 2), ("GLU", True)])


# --------------------------------------------------------------------------
# The emulator itself: conversions, shuffles, and what it reports
# --------------------------------------------------------------------------

PRIMITIVES = r"""
const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
const int lane = threadIdx.x & 31;
if (i < unsigned(x_shape[0])) {  // the last block is partial
  const float f = x[i];
  bf[i] = __float2bfloat16(f);
  hf[i] = static_cast<__half>(f);
  back[2 * i] = __bfloat162float(bf[i]);
  back[2 * i + 1] = static_cast<float>(hf[i]);
}
const int v = lane * 10 + int(blockIdx.x) * 1000;
shf[5 * i + 0] = __shfl_xor_sync(0xffffffffu, v, 3);
shf[5 * i + 1] = __shfl_down_sync(0xffffffffu, v, 5, 16);
shf[5 * i + 2] = __shfl_up_sync(0xffffffffu, v, 3, 8);
shf[5 * i + 3] = __shfl_sync(0xffffffffu, v, 7, 16);
shf[5 * i + 4] = int(__ballot_sync(0xffffffffu, lane % 3 == 0));
"""


def test_emulated_conversions_and_shuffles():
    kernel = emu.emulated_cuda_kernel("primitives", ["x"], ["bf", "hf", "back", "shf"],
                                      PRIMITIVES)
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 70000.0, 1e-8, 6e-8, 3e-5,
               1.00390625, 1.01171875, 3.0e38, 1e-40, -1e-45]
    x = np.concatenate([special, rng.normal(size=500) * 10.0 ** rng.integers(-8, 6, 500),
                        rng.normal(size=484)]).astype(np.float32)  # 1000: 16 blocks of 64
    n_threads = 1024
    bf, hf, back, shf = kernel(
        inputs=[mx.array(x)], grid=(len(x), 1, 1), threadgroup=(64, 1, 1),
        output_shapes=[(len(x),), (len(x),), (len(x), 2), (n_threads, 5)],
        output_dtypes=[BF16, F16, F32, mx.int32])
    want_bf = np.array(mx.array(x).astype(BF16).view(mx.uint16))
    with np.errstate(over="ignore"):
        want_hf = x.astype(np.float16)
    assert (np.array(bf.view(mx.uint16)) == want_bf).all()
    assert (np.array(hf).view(np.uint16) == want_hf.view(np.uint16)).all()
    np.testing.assert_array_equal(np.array(back)[:, 0],
                                  np.array(mx.array(x).astype(BF16).astype(F32)))
    np.testing.assert_array_equal(np.array(back)[:, 1], want_hf.astype(np.float32))
    lane = np.arange(n_threads) % 32
    warp_base = np.arange(n_threads) - lane
    v = (lane * 10 + (np.arange(n_threads) // 64) * 1000)

    def at(src_lane):
        return v[warp_base + src_lane]

    base16, base8 = lane & ~15, lane & ~7
    want = np.stack([
        at(lane ^ 3),
        at(np.where(lane + 5 < base16 + 16, lane + 5, lane)),
        at(np.where(lane - 3 >= base8, lane - 3, lane)),
        at(base16 + 7),
        np.full(n_threads, sum(1 << l for l in range(0, 32, 3)), dtype=np.int64).astype(np.int32),
    ], axis=1)
    np.testing.assert_array_equal(np.array(shf), want)


FAULTS = r"""
__shared__ float s[64];
const int mode = m[0];
const int t = threadIdx.x;
const int i = blockIdx.x * blockDim.x + t;
if (mode == 1 && t == 0) {
  return;
}
if (mode == 2 && t < 32) {
  __syncthreads();
} else {
  __syncthreads();
}
if (mode == 3 && t == 5) {
  return;
}
float v = __shfl_xor_sync(mode == 9 ? 0xffffu : 0xffffffffu, x[i], 1);
if (mode == 4) {
  v += s[t];
}
if (mode == 7) {
  v += x[i + 1];
}
if (mode == 8) {
  s[t] = v;
  v = s[(t + 1) % 64];
}
if (mode == 5) {
  out[i + 1] = v;
} else if (!(mode == 6 && i == 0)) {
  out[i] = v;
}
"""

# mode -> what the emulator must report (0: runs clean).
FAULT_MODES = {
    0: None,
    1: r"__syncthreads\(\) .* has returned",
    2: r"divergent __syncthreads\(\)",
    3: r"waits at __shfl_xor_sync but .* has returned",
    4: r"differs between schedule A .* and schedule B",
    5: r"wrote past the end of output `out`",
    6: r"never wrote 1 of 128 elements of output `out`\[128\], first at \(0,\)",
    7: r"heap-buffer-overflow",
    8: r"differs between schedule A",
    9: r"only the full-warp mask",
}


@pytest.mark.parametrize("mode", sorted(FAULT_MODES))
def test_emulator_reports_faults(mode):
    if mode == 7 and not emu.sanitized():
        pytest.skip("reads past an input are reported by AddressSanitizer, not available here")
    kernel = emu.emulated_cuda_kernel("faults", ["x", "m"], ["out"], FAULTS)
    x = mx.arange(128, dtype=F32)
    call = functools.partial(kernel, inputs=[x, mx.array([mode], dtype=mx.int32)],
                             grid=(128, 1, 1), threadgroup=(64, 1, 1),
                             output_shapes=[(128,)], output_dtypes=[F32])
    if FAULT_MODES[mode] is None:
        (out,) = call()
        np.testing.assert_array_equal(np.array(out), np.arange(128) ^ 1)
        assert kernel.stats["static_shared_bytes"] == 256
    else:
        with pytest.raises(emu.KernelFault, match=FAULT_MODES[mode]):
            call()


def test_emulator_builds_with_gcc_precompiled_header():
    # Every kernel program includes qab_cuda_emu.h first; with GCC its precompiled
    # .gch is made once per session and kept only where GCC reads it (-H marks it
    # "!"), a third of a small program's build otherwise.
    emu._setup()
    gch = emu._workdir() / "qab_cuda_emu.h.gch"
    if "g++" not in Path(emu.CXX).name:
        pytest.skip(f"{emu.CXX} is not GCC")
    assert gch.exists()
    assert emu.reads_precompiled_header(emu._workdir(), emu._FLAGS)


def test_emulator_checks_launch_limits():
    kernel = emu.emulated_cuda_kernel("faults", ["x", "m"], ["out"], FAULTS)
    with pytest.raises(emu.KernelFault, match="invalid CUDA launch"):
        kernel(inputs=[mx.zeros(2048), mx.array([0], dtype=mx.int32)], grid=(2048, 1, 1),
               threadgroup=(2048, 1, 1), output_shapes=[(2048,)], output_dtypes=[F32])


# A workspace output (named ``ws``) may keep padding unwritten, but what its
# threads write must not depend on the schedule. mode 0: element 0 written,
# 1-3 padding; 1: every thread writes element 0 (the last writer differs
# between the two schedules, which the emulator runs in opposite orders);
# 2: a write past its end.
WORKSPACE = r"""
const int t = threadIdx.x;
if (m[0] == 0 && t == 0) { OUT[0] = x[0]; }
if (m[0] == 1) { OUT[0] = x[t]; }
if (m[0] == 2 && t == 0) { OUT[4] = x[0]; }
"""


@pytest.mark.parametrize("name", ["ws", "out"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_emulator_workspace_output_may_keep_padding_but_not_races(name, mode):
    kernel = emu.emulated_cuda_kernel(f"workspace_{name}", ["x", "m"], [name],
                                      WORKSPACE.replace("OUT", name))
    call = functools.partial(kernel, inputs=[mx.arange(64, dtype=F32) + 1,
                                             mx.array([mode], dtype=mx.int32)],
                             grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(4,)],
                             output_dtypes=[F32])
    if mode == 0 and name == "ws":
        (ws,) = call()
        assert ws[0].item() == 1.0
    else:
        # An ordinary output must be written whole, which it reports first.
        fault = (rf"wrote past the end of output `{name}`" if mode == 2
                 else r"never wrote 3 of 4 elements of output `out`" if name == "out"
                 else r"output `ws` differs between schedule A")
        with pytest.raises(emu.KernelFault, match=fault):
            call()


def test_init_value_fills_outputs():
    kernel = emu.emulated_cuda_kernel("faults", ["x", "m"], ["out"], FAULTS)
    (out,) = kernel(inputs=[mx.arange(128, dtype=F32), mx.array([6], dtype=mx.int32)],
                    grid=(128, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(128,)],
                    output_dtypes=[F32], init_value=-1.0)
    assert out[0].item() == -1.0 and out[1].item() == 0.0


# ==========================================================================
# MoE decode with the shared expert folded in (moe_gate_up_shared_gemv,
# moe_down_shared_gemv) and the prefill combine (moe_combine), launched by
# ops.moe's own launch code. (Appended block; shapes as in
# tests/test_kernels_gpu.py's fold and combine tests, made small.)
# ==========================================================================

# (N, E, H, I, K, shared gate bits, dtype): two tokens, 64-wide groups and an
# 8-bit shared gate in float32; one token in bfloat16 with H = 2048 (two
# chunks per lane), K = 3, 32-wide groups and a 4-bit gate. Both grids end in
# a threadgroup where the gate-logit warp is followed by idle warps.
FOLD_CASES = [
    (2, 4, 1024, 64, 2, 8, F32),
    (1, 8, 2048, 32, 3, 4, BF16),
]


def _fold_problem(case):
    from .test_kernels_gpu import _fold_case

    *shape, dtype = case
    x, inds, scores, gu, dn, sw = _fold_case(tuple(shape), dtype)
    assert moe_ops._fold_shapes_supported(x.shape[-1], gu, dn, sw)
    return x, inds, scores, gu, dn, sw


def _assert_fold_matches_reference(x, inds, scores, gu, dn, sw):
    y = moe_ops._moe_shared_decode_kernel_call("cuda", x, inds, scores, gu, dn, sw)
    ref = moe_ops.moe_shared_experts_ops(x.astype(F32), inds, scores.astype(F32), gu, dn, sw,
                                         sort=False)
    assert y.shape == x.shape and y.dtype == x.dtype
    tol = 1e-5 if x.dtype == F32 else 3e-2  # as in tests/test_kernels_gpu.py
    err = mx_rel_l2(y, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol}"


@pytest.mark.parametrize("case", FOLD_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_moe_shared_fold_emulated(case):
    _assert_fold_matches_reference(*_fold_problem(case))


@pytest.mark.parametrize("case", FOLD_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_moe_shared_fold_adds_the_residual_emulated(case):
    # HAS_RES: the decoder layer's residual added in the epilogue, exactly as
    # the stock layer adds it to the block's rounded output.
    x, inds, scores, gu, dn, sw = _fold_problem(case)
    res = (3.0 * mx.random.normal(x.shape, key=mx.random.key(11))).astype(x.dtype)
    y = moe_ops._moe_shared_decode_kernel_call("cuda", x, inds, scores, gu, dn, sw)
    y_res = moe_ops._moe_shared_decode_kernel_call("cuda", x, inds, scores, gu, dn, sw,
                                                   residual=res)
    assert y_res.shape == x.shape and y_res.dtype == x.dtype
    assert mx.array_equal(y_res, res + y).item()


def _assert_fold_norm(x, inds, scores, gu, dn, sw, where=""):
    # moe_down_shared_norm_gemv: y exactly the fold's residual build, yn the
    # RMSNorm of that y (mx.fast.rms_norm up to the order of the sum).
    k1, k2 = mx.random.split(mx.random.key(13))
    res = (3.0 * mx.random.normal(x.shape, key=k1)).astype(x.dtype)
    w = (1.0 + 0.2 * mx.random.normal((x.shape[-1],), key=k2)).astype(x.dtype)
    y_res = moe_ops._moe_shared_decode_kernel_call("cuda", x, inds, scores, gu, dn, sw,
                                                   residual=res)
    y, yn = moe_ops._moe_shared_decode_norm_call("cuda", x, inds, scores, gu, dn, sw, res, w,
                                                 1e-6, moe_ops.fold_norm_counter())
    assert y.shape == yn.shape == x.shape and y.dtype == yn.dtype == x.dtype, where
    assert mx.array_equal(y, y_res).item(), where
    err = mx_rel_l2(yn, mx.fast.rms_norm(y, w, 1e-6))
    assert err <= (1e-6 if x.dtype == F32 else 3e-4), f"{where}: yn rel-L2 {err:.3g}"


@pytest.mark.parametrize("case", FOLD_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}")
def test_moe_shared_fold_applies_the_next_norm_emulated(case):
    # Two tokens (two counters) in float32; one in bfloat16 at H = 2048. The
    # emulator runs both schedules on the SAME counter input, so a counter
    # not reset by the last block leaves yn unwritten in the second.
    _assert_fold_norm(*_fold_problem(case), where=str(case))


def test_moe_shared_fold_dispatcher_self_checks_the_emulated_kernels(monkeypatch):
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        x, inds, scores, gu, dn, sw = _fold_problem(FOLD_CASES[0])
        assert moe_ops.shared_decode_kernel_ready(x, inds, gu, dn, sw) == "cuda"
        verdicts = device.self_check_results()
        assert list(verdicts.values()) == [(True, "passed")]
        assert next(iter(verdicts))[0] == "moe_shared_decode_gemv"
    finally:
        device.reset_self_checks()


# (N, H, K, dtype): H not a multiple of the 256-thread group (a partial last
# group), float32; K = 1 in bfloat16; one token at the real H in bfloat16.
COMBINE_CASES = [
    (7, 300, 8, F32),
    (5, 256, 1, BF16),
    (1, 2048, 8, BF16),
]


def _combine_problem(N, H, K, dtype):
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(N + H + K), 5)
    y = mx.random.normal((N * K, H), key=k1).astype(dtype)
    pos = mx.argsort(mx.random.uniform(shape=(N * K,), key=k2)).reshape(1, N, K)
    sc = mx.softmax(mx.random.normal((1, N, K), key=k3), axis=-1).astype(dtype)
    sy = mx.random.normal((1, N, H), key=k4).astype(dtype)
    lg = mx.random.normal((1, N, 1), key=k5).astype(dtype)
    return y, pos.astype(mx.uint32), sc, sy, lg


def _assert_combine_matches_reference(y, pos, sc, sy, lg):
    out = moe_ops._combine_kernel_call("cuda", y, pos, sc, sy, lg)
    ref = moe_ops.moe_combine_ops(*(a.astype(F32) if a.dtype != mx.uint32 else a
                                    for a in (y, pos, sc, sy, lg)))
    assert out.shape == sy.shape and out.dtype == y.dtype
    tol = 1e-6 if y.dtype == F32 else 8e-3  # one bf16 rounding of the output
    err = mx_rel_l2(out, ref)
    assert err <= tol, f"rel-L2 {err:.3g} > {tol}"


@pytest.mark.parametrize("case", COMBINE_CASES,
                         ids=lambda c: "x".join(map(str, c[:3])) + f"-{c[3]}")
def test_moe_combine_emulated(case):
    _assert_combine_matches_reference(*_combine_problem(*case))


def test_moe_combine_dispatcher_self_checks_the_emulated_kernel(monkeypatch):
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        assert moe_ops.combine_kernel_ready("cuda", *_combine_problem(*COMBINE_CASES[0]))
        assert [v for k, v in device.self_check_results().items()
                if k[0] == "moe_combine"] == [(True, "passed")]
    finally:
        device.reset_self_checks()


FOLD_BROKEN = {
    # The down kernel weights the last routed slot as the shared expert (in
    # the rows' header moe_down_shared.cuh).
    "shared slot off by one": ("moe_down_shared_gemv", "    if (slot[i] == K) {\n      weight[i]",
                               "    if (slot[i] >= K - 1) {\n      weight[i]", True),
    # The next-norm epilogue: the counter is never reset for the next launch.
    "norm counter not reset": ("moe_down_shared_norm_gemv",
                               "const_cast<uint32_t*>(count)[n] = 0u;", "", False),
    # The last block is taken one count early: it normalises a row other
    # blocks have not finished.
    "norm last block early": ("moe_down_shared_norm_gemv", "last = prev == gridDim.x - 1;",
                              "last = prev == gridDim.x - 2;", False),
    # The 8-bit shared gate decoded as 4-bit values (the block's code is in
    # the header moe_gate_up_shared.cuh).
    "gate logit bit width": ("moe_gate_up_shared_gemv", "(words[q] >> (SGB * b)) & MASK",
                             "(words[q] >> (4 * b)) & MASK", True),
    # The gate-logit warp never runs: sg_logit left unwritten.
    "gate warp skipped": ("moe_gate_up_shared_gemv", "if (warp > NRW) {", "if (warp >= NRW) {",
                          True),
    # The column guard lets the last thread of a row write one past it.
    "combine column guard": ("moe_combine", "if (c >= H) {", "if (c > H) {", False),
}


@pytest.mark.parametrize("what", sorted(FOLD_BROKEN))
def test_broken_fold_and_combine_kernels_fail(monkeypatch, what):
    op, old, new, in_header = FOLD_BROKEN[what]
    _broken(monkeypatch, op, old, new, header=in_header)
    with pytest.raises(AssertionError) as failure:
        if op == "moe_combine":
            _assert_combine_matches_reference(*_combine_problem(*COMBINE_CASES[0]))
        elif op == "moe_down_shared_norm_gemv":
            _assert_fold_norm(*_fold_problem(FOLD_CASES[0]))
        else:
            _assert_fold_matches_reference(*_fold_problem(FOLD_CASES[0]))
    assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)


# --------------------------------------------------------------------------
# gated_delta_decode: one decode token of a whole GDN layer in one launch
# (this block: the decode kernel's tests only)
# --------------------------------------------------------------------------

# (B, Hk, Hv, Dk, Dv, Kc, conv bias, mask + lengths, dtype, BLOCK): two warps
# with 16 state rows each; Dk = 64 (two floats per lane) with a prime Dv
# (19 rows per warp, the second warp's last one idle), a conv bias and a live,
# a left-padded (masked: conv state shifts in zeros) and a finished (lengths 0:
# conv state kept) row; Hk == Hv in float16 with a 3-tap conv; the real block
# of 256 threads (2 rows per warp) with three value heads per key head.
GDN_DECODE_CASES = [
    (2, 2, 4, 32, 32, 4, False, False, F32, 64),
    (3, 2, 4, 64, 37, 4, True, True, BF16, 64),
    (2, 3, 3, 32, 16, 3, False, False, F16, 64),
    (3, 1, 3, 64, 16, 4, True, True, F32, 0),
]


def _gdn_decode_case(case, seed):
    from .test_kernels_gpu import _decode_args

    B, Hk, Hv, Dk, Dv, Kc, bias, masked, dtype, block = case
    return _decode_args(B, Hk, Hv, Dk, Dv, Kc, dtype, seed=seed, bias=bias, masked=masked), block


def _assert_gdn_decode_matches_reference(out, args, where):
    # As tests/test_kernels_gpu.py (float16 like bf16: as close to the float32
    # reference as the ops path in float16).
    from .test_kernels_gpu import _assert_decode_matches_reference

    _assert_decode_matches_reference(out, args, where)


@pytest.mark.parametrize("case", GDN_DECODE_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[8]}-block{c[9]}")
def test_gated_delta_decode_emulated(case):
    args, block = _gdn_decode_case(case, seed=sum(case[:6]))
    out = gd._decode_kernel_call("cuda", *args, block=block)
    _assert_gdn_decode_matches_reference(out, args, str(case))


@pytest.mark.parametrize("case", GDN_DECODE_CASES,
                         ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[8]}-block{c[9]}")
def test_gated_delta_decode_reads_the_packed_projection_emulated(case):
    # proj=: the kernel reads the concatenated projection's row (q | k | v | z
    # | b | a) at channel offsets instead of four arrays: the same arithmetic,
    # so the same bits, with and without the token axis.
    args, block = _gdn_decode_case(case, seed=sum(case[:6]) + 1)
    qkv, z, b, a = args[:4]
    plain = gd._decode_kernel_call("cuda", *args, block=block)
    proj = mx.concatenate([qkv, z, b, a], axis=-1)
    packed = gd._decode_kernel_call("cuda", *args, block=block, proj=proj)
    for x, y, name in zip(plain, packed, ("out", "conv_state", "state")):
        assert x.shape == y.shape and mx.array_equal(x, y).item(), f"{case}: {name}"
    B = qkv.shape[0]
    rows = [x.reshape(B, 1, -1) for x in (qkv, z, b, a)]
    mask = args[11]
    tokens = gd._decode_kernel_call(
        "cuda", *rows, *args[4:11], None if mask is None else mask.reshape(B, 1), args[12],
        block=block, proj=proj.reshape(B, 1, -1))
    assert tokens[0].shape == (B, 1, plain[0].shape[1] * plain[0].shape[2])
    assert mx.array_equal(tokens[0].reshape(plain[0].shape), plain[0]).item(), str(case)


def test_gated_delta_decode_rejects_a_packed_projection_of_another_width():
    args, _ = _gdn_decode_case(GDN_DECODE_CASES[0], seed=3)
    proj = mx.concatenate(args[:4], axis=-1)[:, :-1]
    with pytest.raises(ValueError, match=r"^proj must be \[2, 392\] or \[2, 1, 392\]"):
        gd._decode_kernel_call("cuda", *args, proj=proj)


def test_gated_delta_decode_dispatcher_self_checks_the_emulated_kernel(monkeypatch):
    # gated_delta_decode on a faked CUDA device: the self-check of this shape
    # class (three rows: live, left-padded, finished), then the call.
    monkeypatch.setattr(gd, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        args, _ = _gdn_decode_case((4, 2, 4, 32, 32, 4, False, True, BF16, 0), seed=8)
        out = gd.gated_delta_decode(*args)
        assert device.self_check_results() == {
            ("gated_delta_decode", "cuda", (2, 4, 32, 32, 4, str(BF16), False, True, True)):
            (True, "passed")}
        _assert_gdn_decode_matches_reference(out, args, "dispatcher")
    finally:
        device.reset_self_checks()


@pytest.mark.parametrize("variant,concat", [("qwen3_5", False), ("qwen3_next", False),
                                            ("qwen3_5", True)])
def test_fused_layer_decode_on_the_emulated_kernel(monkeypatch, variant, concat):
    # The fused layer's decode tokens on the emulated decode kernel (its
    # compiled step run eagerly, as the emulator needs arrays it can read)
    # against stock mlx-lm, prefill on the portable path. With the input
    # projections concatenated (proj-concat), Qwen3.5's kernel reads their
    # one row itself (proj=): its own self-check, the same results.
    from mlx_lm.models.cache import ArraysCache

    from qwen_apple_backend.layers import gated_delta as layer_mod

    from .test_layers_gated_delta import HIDDEN, inputs, make_pair

    monkeypatch.setattr(gd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(gd, "kernel_ready", lambda *a: None)
    monkeypatch.setattr(gd, "staged_kernel_ready", lambda *a: None)
    monkeypatch.setattr(layer_mod, "kernel_ready", lambda *a: None)
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    calls = []
    real = layer_mod._decode_step_kernel
    monkeypatch.setattr(layer_mod, "_decode_step_kernel",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    device.reset_self_checks()
    mx.disable_compile()
    try:
        stock, fused = make_pair(variant, BF16)
        if concat:
            assert fused.concat_projections()
        packed = []
        real_call = gd._decode_kernel_call
        monkeypatch.setattr(gd, "_decode_kernel_call",
                            lambda *a, **k: packed.append(k.get("proj") is not None)
                            or real_call(*a, **k))
        cs, cf = ArraysCache(size=2), ArraysCache(size=2)
        x = inputs((2, 6, HIDDEN), BF16)
        stock(x, cache=cs), fused(x, cache=cf)
        for step in range(3):
            x1 = inputs((2, 1, HIDDEN), BF16, seed=40 + step)
            ys, yf = stock(x1, cache=cs), fused(x1, cache=cf)
            # Both round to bf16 at the same points in different elementwise
            # implementations (measured at Hk 16, Hv 32, Dk = Dv = 128, worst
            # of 4 tokens: out 6.2e-3, state 3.4e-3).
            assert mx_rel_l2(yf, ys) <= 3e-2, f"decode {step} out"
            assert mx.array_equal(cf[0], cs[0]).item(), f"decode {step} conv state"
            assert mx_rel_l2(cf[1], cs[1]) <= 2e-2, f"decode {step} state"
        assert len(calls) == 3
        checks = {k[2][-1] == "packed": v for k, v in device.self_check_results().items()
                  if k[0] == "gated_delta_decode"}
        assert checks == ({False: (True, "passed"), True: (True, "passed")} if concat
                          else {False: (True, "passed")})
        # Self-checks first (one per shape class), then one launch per token.
        assert packed[-3:] == [concat] * 3
    finally:
        mx.enable_compile()
        device.reset_self_checks()


GDN_DECODE_BROKEN = {
    # The q/k conv state of a key head is written by no value head.
    "q/k conv state never written": ("owner = hv % (Hv / Hk) == 0;\n    } else if",
                                     "owner = false;\n    } else if"),
    # Warps read the conv outputs before every thread has written them.
    "missing __syncthreads": ("__syncthreads();\n  QAB_SUBMARK(5);", "\n  QAB_SUBMARK(5);"),
    # A finished row's conv state shifts anyway.
    "lengths ignored": ("const int from = shift ? 1 : 0;", "const int from = 1;"),
    # The RMSNorm averages over the wrong length.
    "norm over Dk": ("rsqrtf(ss / static_cast<float>(Dv) + norm_eps[0])",
                     "rsqrtf(ss / static_cast<float>(Dk) + norm_eps[0])"),
}


@pytest.mark.parametrize("what", sorted(GDN_DECODE_BROKEN))
def test_broken_gated_delta_decode_fails(monkeypatch, what):
    old, new = GDN_DECODE_BROKEN[what]
    # The per-head code lives in gated_delta_decode.cuh (shared with the MoE block's GD phase).
    _broken(monkeypatch, "gated_delta_decode", old, new, header=True)
    args, block = _gdn_decode_case(GDN_DECODE_CASES[1], seed=2)
    with pytest.raises(AssertionError) as failure:
        out = gd._decode_kernel_call("cuda", *args, block=block)
        _assert_gdn_decode_matches_reference(out, args, what)
    assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)


# ----------------------------------------------------------------------------
# Dense 4-bit decode GEMV (kernels/cuda/quantized_gemv.cu, ops/linear.py)
# ----------------------------------------------------------------------------


# (M, N, K, group, dtype): several row sets per warp and grid-stride passes
# (N > rows per block x blocks is not reachable at small N, so N not a
# multiple of the block's rows instead), LPR 32 / 16 / 4 / 1 (K = 2048, 512,
# 640, 32 -> 64, 16, 20, 1 chunks), 2-4 rows, group 32 / 128, f32 and f16.
GEMV_CASES = [
    (1, 300, 2048, 64, "bf16"),
    (1, 5000, 512, 64, "bf16"),
    (3, 77, 640, 32, "f32"),
    (2, 40, 4096, 128, "f16"),
    (4, 33, 32, 32, "bf16"),
]
_DT = {"bf16": mx.bfloat16, "f32": mx.float32, "f16": mx.float16}


@pytest.fixture
def _emulated_gemv(monkeypatch):
    monkeypatch.setattr(lin_ops, "build_kernel", emu.build_kernel)
    lin_ops._gemv_object.cache_clear()
    yield
    lin_ops._gemv_object.cache_clear()


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "x".join(map(str, c)))
def test_quantized_gemv_emulated(case, _emulated_gemv):
    M, N, K, G, dt = case
    dtype = _DT[dt]
    w = (mx.random.normal((N, K), key=mx.random.key(N)) * K ** -0.5).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=G, bits=4)
    x = mx.random.normal((M, K), key=mx.random.key(K)).astype(dtype)
    y = lin_ops.quantized_gemv_kernel(x, wq, s, b, G)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                               group_size=G, bits=4).T
    assert y.shape == (M, N) and y.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx_rel_l2(y, ref) <= tol


def test_quantized_gemv_grid_stride_passes_emulated(_emulated_gemv, monkeypatch):
    # Cap the grid at 2 blocks so every warp walks several row passes.
    monkeypatch.setattr(lin_ops, "_MAX_BLOCKS", 2)
    N, K, G = 200, 256, 64
    w = (mx.random.normal((N, K), key=mx.random.key(9)) * K ** -0.5).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=G, bits=4)
    x = mx.random.normal((1, K), key=mx.random.key(10)).astype(mx.bfloat16)
    assert lin_ops.gemv_launch(1, N, K)["blocks"] == 2
    y = lin_ops.quantized_gemv_kernel(x, wq, s, b, G)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                               group_size=G, bits=4).T
    assert mx_rel_l2(y, ref) <= 1e-2


def _gemv_weights(N, K, G, dtype, seed):
    w = (mx.random.normal((N, K), key=mx.random.key(seed)) * K ** -0.5).astype(dtype)
    return mx.quantize(w, group_size=G, bits=4)


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_pipelined_gemv_is_the_plain_kernel_bit_for_bit_emulated(case, norm, _emulated_gemv,
                                                                monkeypatch):
    # PIPE moves loads, not arithmetic: with a grid of 2 blocks (1 SM x 2) every
    # warp walks several passes (odd and even counts, a partial last one), each
    # from the register set loaded during the pass before, and every output
    # equals the one-pass launch's bit for bit.
    M, N, K, G, dt = case
    dtype = _DT[dt]
    wq, s, b = _gemv_weights(N, K, G, dtype, seed=N)
    x = mx.random.normal((M, K), key=mx.random.key(K)).astype(dtype)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=mx.random.key(3))).astype(dtype)
    extra = dict(norm_weight=nw, eps=1e-6) if norm else {}
    plain = lin_ops.quantized_gemv_kernel(x, wq, s, b, G, **extra)
    monkeypatch.setattr(lin_ops, "GEMV_PIPE", True)
    monkeypatch.setattr(lin_ops, "cuda_sm_count", lambda: 1)
    monkeypatch.setattr(lin_ops, "PIPE_BLOCKS_PER_SM", 2)
    p = lin_ops.gemv_launch(M, N, K)
    assert p["PIPE"] and p["blocks"] == min(2, -(-N // (8 * (32 // p["LPR"]) * p["RPW"])))
    piped = lin_ops.quantized_gemv_kernel(x, wq, s, b, G, **extra)
    assert mx.array_equal(piped, plain).item()


PIPE_GEMV_BROKEN = {
    # The next pass's scales never move into the set the arithmetic reads.
    "stale scales": ("          sc[r][i] = sc2[r][i];\n", ""),
    # The next pass loaded into the set being computed.
    "one register set": ("      load_into(wv2, sc2, bi2, base + stride);",
                         "      load_into(wv, sc, bi, base + stride);"),
}


@pytest.mark.parametrize("what", sorted(PIPE_GEMV_BROKEN))
def test_broken_pipelined_gemv_fails(monkeypatch, what):
    _broken(monkeypatch, "quantized_gemv", *PIPE_GEMV_BROKEN[what])
    monkeypatch.setattr(lin_ops, "GEMV_PIPE", True)
    monkeypatch.setattr(lin_ops, "cuda_sm_count", lambda: 1)
    monkeypatch.setattr(lin_ops, "PIPE_BLOCKS_PER_SM", 1)
    N, K, G = 300, 2048, 64
    wq, s, b = _gemv_weights(N, K, G, mx.bfloat16, seed=4)
    x = mx.random.normal((1, K), key=mx.random.key(5)).astype(mx.bfloat16)
    y = lin_ops.quantized_gemv_kernel(x, wq, s, b, G)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s.astype(mx.float32),
                                               b.astype(mx.float32), group_size=G, bits=4).T
    assert not mx_rel_l2(y, ref) <= 1e-2  # (NaN from uninitialised registers fails too)


def test_quantized_gemv_dispatcher_self_checks_the_emulated_kernel(_emulated_gemv,
                                                                 monkeypatch):
    from qwen_apple_backend.ops.device import reset_self_checks, self_check_results

    monkeypatch.setattr(lin_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(lin_ops, "GEMV_MIN_BYTES", 0)
    reset_self_checks()
    w = (mx.random.normal((64, 512), key=mx.random.key(11)) * 512 ** -0.5).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 512), key=mx.random.key(12)).astype(mx.bfloat16)
    assert lin_ops.gemv_ready(x, wq, s, b, 64) == "cuda"
    verdicts = {k: v for k, v in self_check_results().items() if k[0] == "quantized_gemv"}
    assert list(verdicts.values()) == [(True, "passed")]
    reset_self_checks()


def _norm_gemv_case(M, N, K, G, dtype, seed):
    k = mx.random.split(mx.random.key(seed), 3)
    w = (mx.random.normal((N, K), key=k[0]) * K ** -0.5).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=G, bits=4)
    x = (3.0 * mx.random.normal((M, 1, K), key=k[1])).astype(dtype)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=k[2])).astype(dtype)
    return x, nw, wq, s, b


def _assert_norm_gemv(y, x, nw, eps, wq, s, b, G):
    dtype = x.dtype
    xn = mx.fast.rms_norm(x, nw, eps)
    ref = xn.astype(mx.float32) @ mx.dequantize(wq, s.astype(mx.float32),
                                                b.astype(mx.float32), group_size=G, bits=4).T
    assert y.shape == (*x.shape[:-1], wq.shape[0]) and y.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    assert mx_rel_l2(y, ref) <= tol
    # Against the plain kernel on the stock norm's output: the normalised row
    # differs only where the float32 sum of squares, summed in another order,
    # moves a value across a rounding boundary.
    plain = lin_ops.quantized_gemv_kernel(xn, wq, s, b, G)
    assert mx_rel_l2(y, plain) <= (1e-6 if dtype == mx.float32 else 2e-3)


@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "x".join(map(str, c)))
def test_norm_gemv_emulated(case, _emulated_gemv):
    M, N, K, G, dt = case
    x, nw, wq, s, b = _norm_gemv_case(M, N, K, G, _DT[dt], seed=N + K)
    y = lin_ops.norm_gemv_kernel(x, nw, 1e-6, wq, s, b, G)
    _assert_norm_gemv(y, x, nw, 1e-6, wq, s, b, G)


NORM_GEMV_BROKEN = {
    # The mean of squares over the wrong length.
    "norm over KD / 2": ("total / static_cast<float>(KD)", "total / static_cast<float>(KD / 2)"),
    # Row 0's norm for every row.
    "one row's norm": ("v[e] * xinv[m]", "v[e] * xinv[0]"),
    # The partials read before every warp has written them.
    "missing barrier": ("""  }
  __syncthreads();
  if (tid < M) {""", """  }
  if (tid < M) {"""),
}


@pytest.mark.parametrize("what", sorted(NORM_GEMV_BROKEN))
def test_broken_norm_gemv_fails(monkeypatch, what):
    _broken(monkeypatch, "quantized_gemv", *NORM_GEMV_BROKEN[what])
    x, nw, wq, s, b = _norm_gemv_case(3, 77, 640, 32, mx.float32, seed=5)
    with pytest.raises(AssertionError) as failure:
        y = lin_ops.norm_gemv_kernel(x, nw, 1e-6, wq, s, b, 32)
        _assert_norm_gemv(y, x, nw, 1e-6, wq, s, b, 32)
    assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)


def test_norm_gemv_dispatcher_self_checks_the_emulated_kernel(_emulated_gemv, monkeypatch):
    from qwen_apple_backend.ops.device import reset_self_checks, self_check_results

    monkeypatch.setattr(lin_ops, "gpu_backend", lambda: "cuda")
    reset_self_checks()
    try:
        x, nw, wq, s, b = _norm_gemv_case(1, 96, 512, 64, mx.bfloat16, seed=13)
        # Below the plain kernel's size rule: the norm launch takes any size.
        assert lin_ops.gemv_ready(x, wq, s, b, 64) is None
        assert lin_ops.norm_gemv_ready(x, nw, 1e-6, wq, s, b, 64) == "cuda"
        verdicts = {k: v for k, v in self_check_results().items() if k[0] == "quantized_gemv"}
        assert list(verdicts.values()) == [(True, "passed")]
        assert next(iter(verdicts))[2][:2] == ("norm", 1e-6)
        y = lin_ops.norm_gemv(x, nw, 1e-6, wq, s, b, group_size=64, bits=4, backend="cuda")
        _assert_norm_gemv(y, x, nw, 1e-6, wq, s, b, 64)
        # Without a backend: the stock norm, then MLX's quantized matmul.
        plain = lin_ops.norm_gemv(x, nw, 1e-6, wq, s, b, group_size=64, bits=4)
        ref = mx.quantized_matmul(mx.fast.rms_norm(x, nw, 1e-6), wq, s, b, group_size=64,
                                  bits=4)
        assert mx.array_equal(plain, ref).item()
        # Outside the contract (norm weight of another width or dtype): no backend.
        assert lin_ops.norm_gemv_ready(x, nw[:256], 1e-6, wq, s, b, 64) is None
        assert lin_ops.norm_gemv_ready(x, nw.astype(mx.float32), 1e-6, wq, s, b, 64) is None
    finally:
        reset_self_checks()


# --------------------------------------------------------------------------
# MoE router: softmax + top-K + renormalisation in one launch
# (kernels/cuda/moe_router_topk.cu), through ops.moe's launch code
# --------------------------------------------------------------------------

# (leading shape, E, K): Qwen3.6 decode (one token of 256 experts, K = 8),
# batch 3, 17 tokens (five threadgroups of 4 rows, the last with one row);
# 8 experts K = 2 (each lane reads 8 bf16 logits: lanes 1-31 hold only
# padding), 64 experts K = 4, K = 1 of 16, E = 300 (two lane groups in bf16,
# the second partial) with K = 16 (two slot chunks in the renormalisation
# sum), E = 1024 (8 float32 lane groups) with K = 32 (every lane keeps one).
ROUTER_EMU_CASES = [
    ((1, 1), 256, 8),
    ((3, 1), 256, 8),
    ((1, 17), 256, 8),
    ((5,), 8, 2),
    ((2, 2), 64, 4),
    ((6,), 16, 1),
    ((7,), 300, 16),
    ((3,), 1024, 32),
]


def _router_case_logits(lead, E, dtype, seed, scale=2.0):
    return (scale * mx.random.normal((*lead, E), key=mx.random.key(seed))).astype(dtype)


def _assert_router_emulated(logits, K, norm, where):
    """The emulated kernel (ops.moe's launch) against the portable route and
    against the stock route as MLX's GPU kernels compute it."""
    from .test_kernels_gpu import _assert_route_is_the_gpu_route, _assert_route_matches_stock

    inds, scores = moe_ops.topk_route(logits, K, norm, kernel="cuda")
    assert inds.shape == scores.shape == (*logits.shape[:-1], K), where
    assert inds.dtype == mx.uint32 and scores.dtype == logits.dtype, where
    # The same experts as the portable route (MLX's CPU argpartition keeps,
    # of equal probabilities, the higher index too), scores within dtype.
    _assert_route_matches_stock(logits, inds, scores, K, norm, where)
    # Against the GPU route's arithmetic: the same experts in the same slots
    # (ascending probability, ties by ascending index) and the same scores,
    # up to one rounding where MLX's CPU softmax (its own exp) and the
    # kernel's round a probability differently in the last bit.
    _assert_route_is_the_gpu_route(logits, inds, scores, K, norm, where)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("case", ROUTER_EMU_CASES,
                         ids=lambda c: "x".join(map(str, (*c[0], c[1], c[2]))))
def test_moe_router_emulated(case, dtype, norm):
    lead, E, K = case
    logits = _router_case_logits(lead, E, dtype, seed=E + K + len(lead))
    _assert_router_emulated(logits, K, norm, f"{case} {dtype} norm={norm}")


def _router_special_rows(E=64):
    """Rows with exact ties, equal logits and large magnitudes (float32 numpy)."""
    base = np.linspace(-2.0, 2.0, E).astype(np.float32)
    tied = base.copy()
    tied[[3, 9, 40, 57]] = 2.5  # four experts tied for the top
    tied[[1, 20, 33]] = tied[62]  # four tied at ranks 6-9: K = 8 keeps three
    big = 80.0 * np.sign(base) * (np.abs(base) > 1.0)  # +-80 and 0: 16 tied at +80
    spread = np.where(np.arange(E) % 2 == 0, 80.0, -80.0) - base  # exp(-160) underflows
    return np.stack([tied, np.zeros(E, np.float32), big, spread]).astype(np.float32)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
def test_moe_router_emulated_ties_equal_rows_and_large_logits(dtype):
    K = 8
    logits = mx.array(_router_special_rows()).astype(dtype)
    for norm in (True, False):
        _assert_router_emulated(logits, K, norm, f"special rows {dtype} norm={norm}")
        inds, scores = moe_ops.topk_route(logits, K, norm, kernel="cuda")
        inds, sc = np.array(inds), np.array(scores.astype(F32))
        # Ties keep the higher index and order slots by ascending index:
        # the four tied for the top (3, 9, 40, 57) last, before them 63 and,
        # of the four tied at ranks 6-9 (1, 20, 33, 62), the three highest.
        assert list(inds[0, -4:]) == [3, 9, 40, 57]
        assert set(inds[0, :4]) == {20, 33, 62, 63}, inds[0]
        assert list(inds[1]) == list(range(56, 64))  # all equal: the last eight experts
        assert all(e >= 48 for e in inds[2]) and list(inds[2]) == sorted(inds[2])
        want = 1.0 / K if norm else 1.0 / 64
        assert np.all(sc[1] == np.float32(want))
        assert np.isfinite(sc).all()
        if norm:
            assert np.allclose(sc.sum(-1), 1.0, atol=2e-2)


# --------------------------------------------------------------------------
# Residual add + RMSNorm + 8-bit router GEMV + route in one launch
# (kernels/cuda/moe_add_norm_route.cu), through ops.moe's launch code
# --------------------------------------------------------------------------

# (leading shape, D, E, G, K, dtype, norm): Qwen3.6's router (D = 2048, 256
# experts, 8-bit g64, K = 8); 3 rows of a tiny half-precision one; E = 300 (not
# a multiple of the 64 rows of a pass: padding rows) with group 128 and K = 16;
# E = 1024 with K = 32 (every lane of the route keeps one).
ANR_CASES = [
    ((1, 1), 2048, 256, 64, 8, BF16, True),
    ((3,), 256, 16, 32, 4, F16, False),
    ((2, 1), 512, 300, 128, 16, BF16, True),
    ((1,), 256, 1024, 64, 32, F16, True),
]


def _assert_add_norm_route(out, x, r, w, gate, K, norm, where, eps=1e-6):
    from .test_kernels_gpu import _assert_route_is_the_gpu_route, _qmv8_model_logits

    h, y, logits, inds, scores = out
    E = gate.weight.shape[0]
    assert h.shape == y.shape == x.shape and logits.shape == (*x.shape[:-1], E), where
    assert inds.shape == scores.shape == (*x.shape[:-1], K), where
    assert inds.dtype == mx.uint32 and scores.dtype == logits.dtype == x.dtype, where
    # h: MLX's Add exactly; y: mx.fast.rms_norm up to the order of the sum.
    assert mx.array_equal(h, x + r).item(), where
    assert mx_rel_l2(y, mx.fast.rms_norm(h, w, eps)) <= 3e-4, where
    # The logits: MLX's CUDA qmv arithmetic over the kernel's own y, bit for bit.
    want = _qmv8_model_logits(y, gate).reshape(logits.shape)
    got = np.array(logits.astype(F32))
    assert np.array_equal(got, want), (
        f"{where}: {int((got != want).sum())} of {got.size} logits differ from the qmv model")
    # The route of those logits: the GPU route's experts, slots and scores.
    _assert_route_is_the_gpu_route(logits, inds, scores, K, norm, where)
    # (Not against MLX's CPU quantized matmul: at this shape its 8-bit bf16
    # logits were measured 0.50 from the float64 product, the kernel's 0.015,
    # so near the K-th expert the two routes may legitimately differ.)


@pytest.mark.parametrize("case", ANR_CASES, ids=lambda c: "x".join(map(str, (*c[0], *c[1:5])))
                         + f"-{c[5]}-{'norm' if c[6] else 'raw'}")
def test_moe_add_norm_route_emulated(case):
    lead, D, E, G, K, dtype, norm = case
    x, r, w, gate = _anr_inputs(lead, D, E, G, dtype, seed=D + E + K)
    out = moe_ops._add_norm_route_call("cuda", x, r, w, 1e-6, gate, K, norm,
                                        moe_ops.fold_norm_counter())
    _assert_add_norm_route(out, x, r, w, gate, K, norm, str(case))


def test_moe_add_norm_route_emulated_fails_without_the_dequant_rounding(monkeypatch):
    # The harness must see a weight dequantized in float32 instead of the
    # activation dtype (MLX rounds q * scale to it before adding the bias).
    _broken(monkeypatch, "moe_add_norm_route",
            "static_cast<float>(static_cast<T>(qv * sc)) + bi", "qv * sc + bi", header=True)
    x, r, w, gate = _anr_inputs((1, 1), 2048, 256, 64, BF16, seed=7)
    out = moe_ops._add_norm_route_call("cuda", x, r, w, 1e-6, gate, 8, True,
                                        moe_ops.fold_norm_counter())
    with pytest.raises(AssertionError, match="logits differ from the qmv model"):
        _assert_add_norm_route(out, x, r, w, gate, 8, True, "broken")


def test_moe_add_norm_route_dispatcher_self_checks_the_emulated_kernel(monkeypatch):
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        x, r, w, gate = _anr_inputs((1, 1), 256, 64, 64, BF16, seed=3)
        assert moe_ops.add_norm_route_ready(x, w, 1e-6, gate, 4, True) == "cuda"
        assert set(device.self_check_results().values()) == {(True, "passed")}
        out = moe_ops.add_norm_route(x, r, w, 1e-6, gate, 4, True, backend="cuda")
        _assert_add_norm_route(out, x, r, w, gate, 4, True, "dispatcher")
        # Outside the contract: float32, a 4-bit router, D not a multiple of 256,
        # too many rows, K above 32, the norm weight in another dtype.
        assert moe_ops.add_norm_route_ready(x.astype(F32), w.astype(F32), 1e-6, gate, 4,
                                            True) is None
        q4 = moe_ops.ExpertWeights(*mx.quantize(mx.zeros((64, 256), BF16), group_size=64,
                                                bits=4), group_size=64, bits=4, mode="affine")
        assert moe_ops.add_norm_route_ready(x, w, 1e-6, q4, 4, True) is None
        x3, r3, w3, g3 = _anr_inputs((1,), 384, 8, 64, BF16, seed=1)
        assert moe_ops.add_norm_route_ready(x3, w3, 1e-6, g3, 2, True) is None
        assert moe_ops.add_norm_route_ready(mx.zeros((65, 256), BF16), w, 1e-6, gate, 4,
                                            True) is None
        assert moe_ops.add_norm_route_ready(x, w, 1e-6, gate, 33, True) is None
        assert moe_ops.add_norm_route_ready(x, w.astype(F16), 1e-6, gate, 4, True) is None
        monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
        assert moe_ops.add_norm_route_ready(x, w, 1e-6, gate, 4, True) is None
        assert len(device.self_check_results()) == 1
        with pytest.raises(ValueError, match="at least one row, got rows=0"):
            moe_ops.fold_norm_counter(0)
        with pytest.raises(ValueError, match="3 token rows but a counter of 2"):
            moe_ops._add_norm_route_call("cuda", mx.zeros((3, 256), BF16), mx.zeros((3, 256), BF16),
                                         w, 1e-6, gate, 4, True, moe_ops.fold_norm_counter(2))
    finally:
        device.reset_self_checks()


def test_moe_block_add_norm_forward_on_the_emulated_kernels(monkeypatch):
    # A fused MoE block of fold-eligible shape (H = 1024, 4-bit experts and
    # shared expert, 8-bit router and shared gate) on a faked CUDA device:
    # add_norm_forward runs the fused route, then the two fold kernels, all
    # emulated (its compiled graph run eagerly), against the stock layer's
    # h + block(norm(h)); each switch and shape outside the path returns None.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    from .test_moe import inputs, make_stock, quantized

    Hd = 1024
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    calls = []
    real = moe_ops._add_norm_route_call
    monkeypatch.setattr(moe_ops, "_add_norm_route_call",
                        lambda *a: calls.append(a[1].shape) or real(*a))
    device.reset_self_checks()
    mx.disable_compile()
    try:
        stock = quantized(make_stock(h=Hd, i=64, e=16, k=4), dtype=BF16)
        fused = FusedSparseMoeBlock.from_stock(stock)
        norm = nn.RMSNorm(Hd, eps=1e-6)
        norm.weight = (1.0 + 0.1 * mx.random.normal((Hd,), key=mx.random.key(9))).astype(BF16)
        outs = {}
        for one_launch in (True, False):  # moe-block on (default), then off
            fused.one_launch = one_launch
            for step in range(2):
                x = (4.0 * inputs((1, 1, Hd), seed=20 + step)).astype(BF16)
                r = inputs((1, 1, Hd), seed=30 + step).astype(BF16)
                got = fused.add_norm_forward(x, r, norm)
                assert got is not None and got[1] is None  # no next norm given
                out = got[0]
                h = x + r
                ref = h + stock(norm(h))
                assert out.dtype == BF16 and out.shape == x.shape
                # The same experts (MLX's CPU router matmul sums otherwise, so a
                # near-tie could differ; none does here); the fold's bf16 rounding
                # points against the stock block's (measured 2.7e-3, 2.2e-3).
                assert mx_rel_l2(out, ref) <= 1e-2, step
                outs.setdefault(step, []).append(out)
        # The one launch and the three give the same output bit for bit.
        assert all(mx.array_equal(a, b).item() for a, b in outs.values())
        # The route's self-check and the block's (whose reference runs the
        # route), then with the block off one route launch per token.
        assert calls == [(5, 1, Hd), (5, 1, Hd), (1, 1, Hd), (1, 1, Hd)]
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["moe_add_norm_route"] == (True, "passed")
        assert verdicts["moe_shared_decode_gemv"] == (True, "passed")
        assert verdicts["moe_decode_block"] == (True, "passed")
        # Given the next layer's input norm, the last kernel applies it too:
        # the same output, and its norm as mx.fast.rms_norm computes it.
        nxt = nn.RMSNorm(Hd, eps=1e-5)
        nxt.weight = (1.0 + 0.1 * mx.random.normal((Hd,), key=mx.random.key(8))).astype(BF16)
        counter = moe_ops.fold_norm_counter()
        for step in range(2):
            got = fused.add_norm_forward(x, r, norm, nxt)
            assert got is not None and got[1] is not None
            assert mx.array_equal(got[0], out).item()
            assert mx_rel_l2(got[1], mx.fast.rms_norm(got[0], nxt.weight, 1e-5)) <= 3e-4
        assert moe_ops.fold_norm_counter() is counter  # one view serves every launch
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["moe_down_shared_norm_gemv"] == (True, "passed")
        # A next norm of another class is not applied.
        assert fused.add_norm_forward(x, r, norm, nn.LayerNorm(Hd))[1] is None
        # Outside the path: None, no launch.
        n_calls = len(calls)
        fused.fused_route = False
        assert fused.add_norm_forward(x, r, norm) is None
        fused.fused_route = True
        fused.use_kernel = False
        assert fused.add_norm_forward(x, r, norm) is None
        fused.use_kernel = True
        fused.train()
        assert fused.add_norm_forward(x, r, norm) is None
        fused.eval()
        assert fused.add_norm_forward(x, r, nn.LayerNorm(Hd)) is None
        assert fused.add_norm_forward(x, r.astype(F32), norm) is None
        x16 = mx.zeros((1, 16, Hd), BF16)  # 64 (token, expert) rows: prefill-sized
        assert fused.add_norm_forward(x16, x16, norm) is None
        monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
        assert fused.add_norm_forward(x, r, norm) is None
        assert len(calls) == n_calls
    finally:
        mx.enable_compile()
        device.reset_self_checks()


def test_moe_router_dispatcher_self_checks_the_emulated_kernel(monkeypatch):
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    device.reset_self_checks()
    try:
        for (E, K, norm, dtype) in [(256, 8, True, BF16), (256, 8, False, F32), (8, 2, True, F16)]:
            assert moe_ops.router_kernel_ready(mx.zeros((1, E), dtype), K, norm) == "cuda"
        assert set(device.self_check_results().values()) == {(True, "passed")}
        assert moe_ops.router_kernel_ready(mx.zeros((1, 2048), BF16), 8, True) is None  # E
        assert moe_ops.router_kernel_ready(mx.zeros((1, 64), BF16), 33, True) is None  # K
        assert moe_ops.router_kernel_ready(mx.zeros((1, 64), mx.int32), 8, True) is None
        monkeypatch.setenv("QAB_DISABLE_KERNELS", "1")
        assert moe_ops.router_kernel_ready(mx.zeros((1, 256), BF16), 8, True) is None
        assert len(device.self_check_results()) == 3
    finally:
        device.reset_self_checks()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_moe_block_routes_with_the_emulated_kernel(monkeypatch, dtype):
    # The fused block on a faked CUDA device whose only kernel is the
    # emulated router (the small test block is not eligible for the decode
    # GEMVs; the grouped GEMM's tensor-core PTX is not emulated), its
    # compiled decode step run eagerly, against stock mlx-lm: a decode token
    # and a 74-token prefill.
    from qwen_apple_backend.layers.moe import FusedSparseMoeBlock

    from .test_moe import H, inputs, make_stock, quantized

    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(moe_ops, "_grouped_gemm_object", lambda backend: None)
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    calls = []
    real = moe_ops._router_kernel_call
    monkeypatch.setattr(moe_ops, "_router_kernel_call",
                        lambda *a: calls.append(a[1].shape) or real(*a))
    device.reset_self_checks()
    mx.disable_compile()
    try:
        stock = quantized(make_stock(), dtype=None if dtype == F32 else dtype)
        fused = FusedSparseMoeBlock.from_stock(stock)
        for shape in ((1, 1, H), (2, 37, H)):
            x = inputs(shape, dtype=dtype)
            y, ref = fused(x), stock(x)
            assert calls[-1] == (*shape[:-1], 32)  # routed by the kernel (E = 32)
            assert y.dtype == dtype
            if dtype == F32:
                assert mx_rel_l2(y, ref) <= 1e-5, shape  # measured 4e-8, 7e-8
            else:
                # The same experts; the renormalised bf16 scores add in bf16
                # (as on the GPU) where MLX's CPU adds in float32 (measured
                # rel-L2 0.0 decode, 1.6e-3 prefill).
                assert mx_rel_l2(y, ref) <= 1e-2, shape
        router = [v for k, v in device.self_check_results().items() if k[0] == "moe_router_topk"]
        assert router == [(True, "passed")]
        fused.use_kernel = False  # the moe-kernel optimization off: the portable route
        n = len(calls)
        assert mx.array_equal(fused(inputs((1, 1, H), dtype=dtype)),
                              stock(inputs((1, 1, H), dtype=dtype))).item()
        assert len(calls) == n
    finally:
        mx.enable_compile()
        device.reset_self_checks()


ROUTER_BROKEN = {
    # Mutations of the per-row route (kernels/cuda/moe_route_row.cuh, the
    # router kernel's header), with the logits' dtype that runs the mutated
    # code: half-precision routes select with packed (probability, expert)
    # keys, float32 ones with (key, expert) pairs.
    # Packed: the expert index above the probability (selects by index).
    "packed order": ("((static_cast<uint32_t>(bits) << 16) | static_cast<uint32_t>(e))",
                     "((static_cast<uint32_t>(e) << 16) | static_cast<uint32_t>(bits))", BF16),
    # Packed: no warp max, each lane keeps its own best.
    "packed warp max": ("best = __reduce_max_sync(0xffffffffu, best);", "", BF16),
    # Float32: of equal probabilities the lower index wins inside a lane.
    "lower index kept": ("if (key[k] > bv || (key[k] == bv && e > be)) {",
                         "if (key[k] > bv || (key[k] == bv && e < be)) {", F32),
    # Float32: the argmax butterfly skips the last lane distance: two lanes' bests.
    "argmax butterfly": ("for (int o = 16; o > 0; o >>= 1) {\n        const float ov",
                         "for (int o = 16; o > 1; o >>= 1) {\n        const float ov", F32),
    # Slots written largest first (argpartition's order reversed).
    "slot order": ("inds[K - 1 - lane] = static_cast<uint32_t>(mine_e);\n    scores[K - 1 - lane]",
                   "inds[lane] = static_cast<uint32_t>(mine_e);\n    scores[lane]", BF16),
    # The renormalisation sum misses the last slot of each chunk.
    "norm sum": ("const int s = VEC * lane + j;", "const int s = VEC * lane + j + 1;", BF16),
    # The second lane group's sum is not rescaled to the row max.
    "group rescale": ("total = gsum[g] * __expf(gmax[g] - rmax);", "total = gsum[g];", BF16),
}


@pytest.mark.parametrize("what", sorted(ROUTER_BROKEN))
def test_broken_router_kernel_fails(monkeypatch, what):
    old, new, dtype = ROUTER_BROKEN[what]
    _broken(monkeypatch, "moe_router_topk", old, new, header=True)
    with pytest.raises(AssertionError) as failure:
        logits = mx.array(_router_special_rows()).astype(dtype)
        _assert_router_emulated(logits, 8, True, what)
        # E = 300: two lane groups in bf16 (three in float32), one with the row max.
        logits = _router_case_logits((3,), 300, dtype, seed=1)
        logits = mx.concatenate([logits[:, :256], logits[:, 256:] + 6.0], axis=-1)
        _assert_router_emulated(logits, 16, True, what)
    assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)


# --------------------------------------------------------------------------
# add_rms_norm: residual add + RMSNorm in one launch
# (kernels/cuda/add_rms_norm.cu), through ops.norm's launch code
# --------------------------------------------------------------------------

from qwen_apple_backend.ops import norm as norm_ops  # noqa: E402

# N rows x D: Qwen3.6-35B-A3B's D = 2048 (256 threads, 8 elements each), odd
# D with a partial last chunk (100 in one warp, 4 elements per thread; 264 in
# two warps, 5 each), 4096 (512 threads); 1, 3 and 7 rows.
ADD_NORM_N = [1, 3, 7]
ADD_NORM_D = [2048, 100, 264, 4096]


@pytest.fixture
def _emulated_norm(monkeypatch):
    monkeypatch.setattr(norm_ops, "build_kernel", emu.build_kernel)
    norm_ops._kernel_object.cache_clear()
    yield
    norm_ops._kernel_object.cache_clear()


@pytest.mark.parametrize("dt", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("D", ADD_NORM_D)
@pytest.mark.parametrize("N", ADD_NORM_N)
def test_add_rms_norm_emulated(N, D, dt, _emulated_norm):
    from .test_kernels_gpu import _add_rms_norm_inputs, _assert_add_rms_norm_matches

    x, r, w, eps = _add_rms_norm_inputs((N, D), _DT[dt], seed=N * D)
    h, y = norm_ops._kernel_call("cuda", x, r, w, eps)
    # h bit-identical to x + r; y within two ulps of mx.fast.rms_norm on
    # the CPU, on at most 2% of the elements (see the helper for the measured
    # differences).
    _assert_add_rms_norm_matches(h, y, x, r, w, eps, f"{N}x{D} {dt}")


def test_add_rms_norm_emulated_with_a_time_axis(_emulated_norm):
    from .test_kernels_gpu import _add_rms_norm_inputs, _assert_add_rms_norm_matches

    # [B, T, D] as the decoder layer passes it (outputs take x's shape).
    x, r, w, eps = _add_rms_norm_inputs((2, 3, 264), mx.bfloat16, seed=5)
    h, y = norm_ops._kernel_call("cuda", x, r, w, eps)
    _assert_add_rms_norm_matches(h, y, x, r, w, eps, "2x3x264")


def test_add_rms_norm_dispatcher_self_checks_the_emulated_kernel(_emulated_norm, monkeypatch):
    monkeypatch.setattr(norm_ops, "gpu_backend", lambda: "cuda")
    device.reset_self_checks()
    assert norm_ops.add_rms_norm_ready(2048, mx.bfloat16) == "cuda"
    verdicts = {k: v for k, v in device.self_check_results().items() if k[0] == "add_rms_norm"}
    assert verdicts == {("add_rms_norm", "cuda", (2048, str(mx.bfloat16))): (True, "passed")}
    device.reset_self_checks()


ADD_NORM_BROKEN = {
    # Every warp takes the first warp's partial sum only.
    "cross-warp sum": ("float total = lane < WARPS ? partial[lane] : 0.f;",
                       "float total = lane < 1 ? partial[lane] : 0.f;"),
    # The partials are read before every warp wrote them.
    "barrier": ("__syncthreads();\nfloat total", "float total"),
    # The normalised value is not rounded to T before the weight multiply.
    "rounding point": ("static_cast<float>(static_cast<T>(hv[j] * inv))", "hv[j] * inv"),
    # The last partial chunk of the row is dropped.
    "row tail": ("hv[j] = i < D ? static_cast<float>(x[base + i]) : 0.f;",
                 "hv[j] = i < D - 1 ? static_cast<float>(x[base + i]) : 0.f;"),
}


@pytest.mark.parametrize("what", sorted(ADD_NORM_BROKEN))
def test_broken_add_rms_norm_fails(monkeypatch, what):
    from .test_kernels_gpu import _add_rms_norm_inputs, _assert_add_rms_norm_matches

    old, new = ADD_NORM_BROKEN[what]
    body = kernel_source("add_rms_norm", "cuda").body
    assert body.count(old) == 1, f"mutation target not found once: {old!r}"
    monkeypatch.setattr(norm_ops, "build_kernel",
                        lambda op, backend, **o: emu.build_kernel(op, backend,
                                                                  source=body.replace(old, new),
                                                                  **o))
    norm_ops._kernel_object.cache_clear()
    try:
        with pytest.raises(AssertionError) as failure:
            x, r, w, eps = _add_rms_norm_inputs((3, 2048), mx.bfloat16, seed=11)
            h, y = norm_ops._kernel_call("cuda", x, r, w, eps)
            _assert_add_rms_norm_matches(h, y, x, r, w, eps, what)
        assert not isinstance(failure.value, emu.KernelCompileError), str(failure.value)
    finally:
        norm_ops._kernel_object.cache_clear()


# --------------------------------------------------------------------------
# split-K decode attention (gqa_decode_partial + gqa_decode_combine)
# --------------------------------------------------------------------------

# (B, Hq, Hk, D, S, dtype, mask): Qwen3.6's 8 query heads per KV head at a
# smaller D with a partial last key block, batch 2 with MQA, bf16 and f16;
# mask None, one row per batch row ("rows", [B, 1, 1, S]) or one row for
# every batch row ("row", [1, 1, 1, S]: the compiled decode step's).
SPLIT_CASES = [
    (1, 16, 2, 64, 150, F32, None),
    (1, 16, 2, 64, 150, F32, "rows"),
    (2, 3, 1, 32, 70, BF16, "rows"),
    (2, 4, 1, 32, 90, F32, "row"),
    (1, 4, 2, 256, 65, F16, None),
]


def _split_inputs(B, Hq, Hk, D, S, dtype, mask_form):
    kq, kk, kv, km, kg = mx.random.split(mx.random.key(S + D), 5)
    q = mx.random.normal((B, Hq, 1, D), key=kq).astype(dtype)
    # The KV cache's form: a view of the first S positions of a longer buffer.
    k = mx.random.normal((B, Hk, S + 9, D), key=kk).astype(dtype)[:, :, :S]
    v = mx.random.normal((B, Hk, S + 9, D), key=kv).astype(dtype)[:, :, :S]
    mask = None
    if mask_form is not None:
        rows = B if mask_form == "rows" else 1
        mask = (mx.random.uniform(shape=(rows, 1, 1, S), key=km) > 0.3) | (mx.arange(S) == 5)
    gate = mx.split(mx.random.normal((B, 1, Hq, 2 * D), key=kg).astype(dtype), 2, axis=-1)[1]
    return q, k, v, mask, gate


def _split_tol(dtype):
    # float32 partials and merge; bf16 / f16 inputs and one output rounding.
    return 1e-5 if dtype == F32 else (1e-2 if dtype == BF16 else 2e-3)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "x".join(map(str, c[:5]))
                         + f"-{c[5]}-{c[6] or 'nomask'}")
def test_split_decode_attention_emulated(case, monkeypatch):
    B, Hq, Hk, D, S, dtype, mask_form = case
    monkeypatch.setattr(attn_ops, "_SPLIT_KERNEL_WARPS", 4)  # several key blocks per head
    q, k, v, mask, _ = _split_inputs(*case)
    assert -(-S // attn_ops._split_kernel_block(B, Hk, S)) >= 2  # several key blocks
    out = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask)
    ref = attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), D ** -0.5,
                                     mask)
    assert out.shape == (B, Hq, 1, D) and out.dtype == dtype
    assert mx_rel_l2(out, ref) <= _split_tol(dtype)


@pytest.mark.parametrize("case", [SPLIT_CASES[1], SPLIT_CASES[2], SPLIT_CASES[3]],
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{c[6]}")
def test_split_decode_attention_gated_emulated(case, monkeypatch):
    # The second pass multiplies by the sigmoid gate and writes [B, 1, Hq * D],
    # the layout o_proj reads: the same values as attention, then
    # gate_output's `out * mx.sigmoid(gate)` in the same dtype.
    B, Hq, Hk, D, S, dtype, _ = case
    monkeypatch.setattr(attn_ops, "_SPLIT_KERNEL_WARPS", 4)
    q, k, v, mask, gate = _split_inputs(*case)
    out = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask, gate)
    plain = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask)
    assert out.shape == (B, 1, Hq * D) and out.dtype == dtype
    # MLX's CUDA Sigmoid in the output dtype, step by step (each step rounded:
    # 1 / (1 + exp(|x|)), x < 0 ? y : 1 - y), then the product rounded: the
    # epilogue's contract. (MLX's CPU sigmoid, gate_output here, uses another
    # formula: 18% of bf16 outputs differ from it by a step.)
    cuda_ref = _cuda_sigmoid_gate(plain, gate)
    if dtype == F32:  # numpy's float32 exp and this CPU's expf differ in the last bit
        assert mx_rel_l2(out, cuda_ref) <= 1e-6
    else:
        equal = mx.mean((out == cuda_ref).astype(F32)).item()
        assert equal >= 0.99, equal
    ref = attn_ops.gate_output(
        attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), D ** -0.5, mask),
        gate.astype(F32))
    assert mx_rel_l2(out, ref) <= 2 * _split_tol(dtype)


def _odd_layouts(dtype):
    """q, k, v views the kernel pair must read through strides: K/V stored
    [B, Hk, D, S] (last axis strided: scalar loads), and K/V rows starting one
    element into their buffer (not 16-byte aligned: no vector loads)."""
    kq, kk, kv = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((1, 1, 4, 64), key=kq).astype(dtype).swapaxes(1, 2)
    k_t = mx.random.normal((1, 2, 64, 70), key=kk).astype(dtype).swapaxes(2, 3)
    v_t = mx.random.normal((1, 2, 64, 70), key=kv).astype(dtype).swapaxes(2, 3)
    flat_k = mx.random.normal((1 + 2 * 70 * 64,), key=kk).astype(dtype)
    flat_v = mx.random.normal((1 + 2 * 70 * 64,), key=kv).astype(dtype)
    k_off = flat_k[1:].reshape(1, 2, 70, 64)
    v_off = flat_v[1:].reshape(1, 2, 70, 64)
    return [("transposed", q, k_t, v_t), ("unaligned", q, k_off, v_off)]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_split_decode_attention_reads_any_strides_emulated(dtype, monkeypatch):
    # The emulator hands kernels built with ensure_row_contiguous=False the
    # views as they are (strides, offset, 16-byte alignment as on the device).
    monkeypatch.setattr(attn_ops, "_SPLIT_KERNEL_WARPS", 4)
    for what, q, k, v in _odd_layouts(dtype):
        n = np.asarray(k.view(mx.uint16) if dtype == BF16 else k)
        if what == "transposed":
            assert n.strides[-1] != n.itemsize
        else:
            assert n.__array_interface__["data"][0] % 16 != 0
        out = attn_ops._split_kernel_call("cuda", q, k, v, 0.125, None)
        ref = attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), 0.125)
        assert mx_rel_l2(out, ref) <= _split_tol(dtype), what


def test_split_decode_attention_checks_alignment_emulated(monkeypatch):
    # Negative control: without the alignment test, the first pass's 16-byte
    # K loads of rows that start one element into their buffer are misaligned,
    # and the emulator (UBSan) reports it.
    monkeypatch.setattr(attn_ops, "_SPLIT_KERNEL_WARPS", 4)
    _broken(monkeypatch, "gqa_decode_partial",
            "kd == 1 && ks % CH == 0 && qab_vec_aligned<InT, CH>(kb)", "kd == 1 && ks % CH == 0")
    _, q, k, v = _odd_layouts(BF16)[1]
    with pytest.raises(emu.KernelFault, match="misaligned|alignment"):
        mx.eval(attn_ops._split_kernel_call("cuda", q, k, v, 0.125, None))


# The lane-group first pass (gqa_decode_partial_lanes, attn-lanes): (B, Hq,
# Hk, D, S, dtype, mask, thread blocks one launch aims for). Qwen3.6's 8 query
# heads per KV head at D 256 (bf16: LPK 8, 4 K pieces per lane) with a partial
# last block and a masked hole over whole key blocks; D 128 in float32; G 2
# and G 1; S below one thread block's first round of steps (warps without
# keys); f16 with 8 steps per warp (few thread blocks) and D 32 (LPK 4).
LANES_CASES = [
    (1, 16, 2, 256, 150, BF16, "row", 128),
    (1, 16, 2, 128, 77, F32, "rows", 128),
    (2, 4, 2, 64, 45, BF16, None, 128),
    (1, 2, 2, 256, 20, F32, "rows", 128),
    (2, 8, 1, 64, 300, F16, "row", 2),
    (1, 4, 2, 32, 100, BF16, "hole", 128),
]


def _lanes_inputs(B, Hq, Hk, D, S, dtype, mask_form):
    q, k, v, mask, gate = _split_inputs(B, Hq, Hk, D, S, dtype,
                                        "row" if mask_form == "hole" else mask_form)
    if mask_form in ("row", "hole"):
        # Keys 32..95 masked: whole thread blocks (32 keys) and steps with no allowed key.
        mask = mask & ((mx.arange(S) < 32) | (mx.arange(S) >= 96))
    return q, k, v, mask, gate


def _lanes_id(c):
    return "x".join(map(str, c[:5])) + f"-{c[5]}-{c[6] or 'nomask'}-ctas{c[7]}"


@pytest.mark.parametrize("case", LANES_CASES, ids=_lanes_id)
def test_split_decode_attention_lanes_emulated(case, monkeypatch):
    B, Hq, Hk, D, S, dtype, mask_form, ctas = case
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", ctas)
    q, k, v, mask, gate = _lanes_inputs(*case[:7])
    block, lpk, warps = attn_ops._lanes_params(B, Hk, S, Hq // Hk, D, dtype)
    assert lpk == min(8, D * dtype.size // 16) and warps == 8
    assert block % (32 // lpk) == 0 and B * Hk * -(-S // block) <= max(ctas, B * Hk)
    ref = attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), D ** -0.5,
                                     mask)
    out = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask, lanes=True)
    assert out.shape == (B, Hq, 1, D) and out.dtype == dtype
    assert mx_rel_l2(out, ref) <= _split_tol(dtype)
    # Gated: the same second pass, so the lane-per-key first pass's bits up to
    # the order of float32 sums.
    gated = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask, gate, lanes=True)
    ref_g = attn_ops.gate_output(ref, gate.astype(F32))
    assert gated.shape == (B, 1, Hq * D) and mx_rel_l2(gated, ref_g) <= 2 * _split_tol(dtype)
    old = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask)
    assert mx_rel_l2(out, old) <= _split_tol(dtype)


def test_split_decode_attention_lanes_partials_emulated(monkeypatch):
    # The partials themselves: one per (b, query head, thread block of BLOCK
    # keys), as the lane-per-key pass's contract (m in log2 units, l, o
    # unnormalised; a block with no allowed key m = -inf, l = 0, o = 0).
    B, Hq, Hk, D, S = 1, 8, 1, 64, 200
    q, k, v, mask, _ = _lanes_inputs(B, Hq, Hk, D, S, F32, "hole")
    block, lpk, warps = attn_ops._lanes_params(B, Hk, S, Hq // Hk, D, F32)
    assert (block, lpk, warps) == (32, 8, 8)
    nb = -(-S // block)
    o, ml = attn_ops._lanes_object("cuda")(
        inputs=[q, k, v, mask, attn_ops.f32_scalar(0.125)],
        template=[("InT", F32), ("D", D), ("G", Hq), ("BLOCK", block), ("LPK", lpk),
                  ("WARPS", warps), ("HAS_MASK", True)],
        grid=(32 * warps * nb, Hk, B), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(B, Hq, nb, D), (B, Hq, nb, 2)], output_dtypes=[F32, F32])
    qn, kn, vn = (np.array(a, dtype=np.float64) for a in (q, k, v))
    mn = np.array(mask).reshape(-1)
    for j in range(nb):
        keys = [s for s in range(j * block, min(S, (j + 1) * block)) if mn[s]]
        got_m, got_l = np.array(ml[0, :, j, 0]), np.array(ml[0, :, j, 1])
        if not keys:  # keys 32..95: blocks 1 and 2
            assert j in (1, 2) and np.all(got_m == -np.inf) and np.all(got_l == 0)
            assert np.all(np.array(o[0, :, j]) == 0)
            continue
        sc = qn[0, :, 0] @ kn[0, 0, keys].T * 0.125 / np.log(2)  # [Hq, keys], log2 units
        m = sc.max(axis=1)
        p = np.exp2(sc - m[:, None])
        np.testing.assert_allclose(got_m, m, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_l, p.sum(axis=1), rtol=1e-5)
        np.testing.assert_allclose(np.array(o[0, :, j]), p @ vn[0, 0, keys], rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_split_decode_attention_lanes_reads_any_strides_emulated(dtype):
    # K/V stored [B, Hk, D, S] (scalar loads) and rows one element into their
    # buffer (no vector loads), through the lane-group first pass.
    for what, q, k, v in _odd_layouts(dtype):
        out = attn_ops._split_kernel_call("cuda", q, k, v, 0.125, None, lanes=True)
        ref = attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), 0.125)
        assert mx_rel_l2(out, ref) <= _split_tol(dtype), what


# Mutations of the lane-group pass's merges that the reference check must catch:
# the warps' partials not rescaled to the thread block's max, half the warps
# dropped from the shared-memory tree, the group's score tree one step short.
LANES_BREAKS = {
    "no-rescale": ("const float c = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mb);",
                   "const float c = m[g] == -INFINITY ? 0.f : 1.f;"),
    "tree-drops-warps": ("for (int n = WARPS; n > 1; n >>= 1) {",
                         "for (int n = WARPS / 2; n > 1; n >>= 1) {"),
    "group-tree-short": ("for (int x = 1; x < LPK; x <<= 1) {",
                         "for (int x = 2; x < LPK; x <<= 1) {"),
}


@pytest.mark.parametrize("what", sorted(LANES_BREAKS))
def test_split_decode_attention_lanes_broken_merge_fails_emulated(what, monkeypatch):
    case = LANES_CASES[0]
    q, k, v, mask, _ = _lanes_inputs(*case[:7])
    D = case[3]
    ref = attn_ops.gqa_attention_ops(q.astype(F32), k.astype(F32), v.astype(F32), D ** -0.5,
                                     mask)
    good = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask, lanes=True)
    assert mx_rel_l2(good, ref) <= _split_tol(BF16)
    # The pass lives in gqa_lanes.cuh (shared with gqa_decode_step).
    _broken(monkeypatch, "gqa_decode_partial_lanes", *LANES_BREAKS[what], header=True)
    bad = attn_ops._split_kernel_call("cuda", q, k, v, D ** -0.5, mask, lanes=True)
    assert mx_rel_l2(bad, ref) > 10 * _split_tol(BF16), what


def test_split_decode_attention_lanes_dispatch_emulated(monkeypatch):
    # gqa_decode_attention_gated takes the lane-group first pass only with
    # lanes (attn-lanes) and below _LANES_MAX_KEYS keys; with lanes the
    # self-check runs both first passes under a verdict of its own.
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    device.reset_self_checks()
    try:
        _lanes_dispatch(monkeypatch)
    finally:
        device.reset_self_checks()


def _lanes_dispatch(monkeypatch):
    calls = []
    real = attn_ops._split_kernel_call
    monkeypatch.setattr(attn_ops, "_split_kernel_call",
                        lambda *a, **kw: calls.append((a[2].shape[2], kw.get("lanes", False)))
                        or real(*a, **kw))
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
    k = mx.random.normal((1, 2, 100, 64), key=mx.random.key(2))
    v = mx.random.normal((1, 2, 100, 64), key=mx.random.key(3))
    gate = mx.random.normal((1, 1, 4, 64), key=mx.random.key(4))
    row = mx.arange(100).reshape(1, 1, 1, 100) < 90
    ref = attn_ops.gate_output(attn_ops.gqa_attention_ops(q, k, v, 0.3, row), gate)
    out = attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row, gate)
    assert calls == [(777, False)] * 4 + [(100, False)], calls
    assert mx_rel_l2(out, ref) <= 1e-5
    calls.clear()
    out = attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row, gate, lanes=True)
    assert calls == [(777, False)] * 4 + [(777, True)] * 4 + [(100, True)], calls
    assert mx_rel_l2(out, ref) <= 1e-5
    verdicts = {key: val for key, val in device.self_check_results().items()
                if key[0] == "gqa_decode_attention"}
    assert sorted(key[2][-1] for key in verdicts) == [False, True]
    assert all(val == (True, "passed") for val in verdicts.values()), verdicts
    # From _LANES_MAX_KEYS keys the lane-per-key pass runs (no new self-check).
    calls.clear()
    monkeypatch.setattr(attn_ops, "_LANES_MAX_KEYS", 100)
    attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row, gate, lanes=True)
    assert calls == [(100, False)], calls
    # A shape the lane-group pass does not take (G x D over 2,048) keeps the
    # lane-per-key pass with lanes on, under the lanes-off verdict.
    monkeypatch.setattr(attn_ops, "_LANES_MAX_KEYS", 65536)
    calls.clear()
    q16 = mx.random.normal((1, 32, 1, 256), key=mx.random.key(5))
    k16 = mx.random.normal((1, 2, 40, 256), key=mx.random.key(6))
    assert not attn_ops._lanes_usable("cuda", q16, k16)
    out = attn_ops.gqa_decode_attention_gated(q16, k16, k16, 0.1, None,
                                              mx.zeros((1, 1, 32, 256)), lanes=True)
    assert calls[-1] == (40, False)
    ref = attn_ops.gate_output(attn_ops.gqa_attention_ops(q16, k16, k16, 0.1, None),
                               mx.zeros((1, 1, 32, 256)))
    assert mx_rel_l2(out, ref) <= 1e-5


def test_split_decode_attention_lanes_params():
    # Qwen3.6's full attention (B 1, Hk 2, G 8, D 256, bf16): 128 thread blocks
    # of 8 warps (1,024 warps), 64 partials per query head, at 4K and 32K keys;
    # BLOCK from the ladder 32 x 1, 1.25, 1.5, 1.75, 2, 2.5, ... (a template value:
    # few builds as a cache grows), so 4,100 and 4,352 keys take 80 (55 blocks a head).
    bf = BF16
    assert attn_ops._lanes_params(1, 2, 4096, 8, 256, bf) == (64, 8, 8)
    assert attn_ops._lanes_params(1, 2, 4352, 8, 256, bf) == (80, 8, 8)
    assert attn_ops._lanes_params(1, 2, 4100, 8, 256, bf) == (80, 8, 8)
    # Four values per doubling of the cache, every one a multiple of a step.
    ladder = {attn_ops._lanes_params(1, 2, s, 8, 256, bf)[0] for s in range(256, 65537, 256)}
    assert ladder == {32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                      448, 512, 640, 768, 896, 1024}
    assert attn_ops._lanes_params(1, 2, 32768, 8, 256, bf) == (512, 8, 8)
    assert attn_ops._lanes_params(1, 2, 131072, 8, 256, bf) == (2048, 8, 8)
    assert attn_ops._lanes_params(1, 2, 1000, 8, 256, bf) == (32, 8, 8)
    assert attn_ops._lanes_params(1, 2, 4096, 8, 256, F32) == (64, 8, 8)
    assert attn_ops._lanes_params(1, 4, 4096, 4, 32, bf) == (128, 4, 8)  # 4 pieces a row
    assert attn_ops._lanes_params(1, 1, 4096, 16, 256, bf) is None  # G x D over 2,048
    # More (b, KV head) pairs than thread blocks aimed for: one block of all S keys.
    assert attn_ops._lanes_params(64, 4, 100, 8, 128, bf) == (112, 8, 8)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_attention_layer_decodes_through_the_kernel_pair(dtype, monkeypatch):
    # FusedGQAAttention at Qwen3.6's heads (16 q / 2 kv, D 256) over a KV cache:
    # each decode token's attention and output gate run as the kernel pair
    # (gate handed over as q_proj's strided half), and the outputs are stock
    # Qwen3NextAttention's; with attn-kernel off (decode_kernel False) the
    # MLX path runs (likewise qk-prep for the q/k preparation kernel).
    from mlx_lm.models.cache import KVCache

    from .test_attention import inputs, make_pair, run_steps

    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    gated, preps = [], []
    real = attn_ops._split_kernel_call
    monkeypatch.setattr(attn_ops, "_split_kernel_call",
                        lambda *a, **kw:
                        gated.append((a[2].shape[2], len(a) > 6)) or real(*a, **kw))
    real_prep = attn_ops._qk_prep_call
    monkeypatch.setattr(attn_ops, "_qk_prep_call",
                        lambda *a: preps.append(a[1].shape[0]) or real_prep(*a))
    device.reset_self_checks()
    stock, fused = make_pair(dtype=dtype)
    # The emulator evaluates its inputs, which an mx.compile trace forbids:
    # the projections run eagerly here (test_attention covers the compiled
    # projections' routing with a traceable stand-in).
    fused.compile_decode = False
    xs = [inputs((1, n, 512), seed=s).astype(dtype) for s, n in enumerate([20, 1, 1])]
    ys, _ = run_steps(fused, xs, KVCache)
    refs, _ = run_steps(stock, xs, KVCache)
    # The self-check's four launches, then the two decode tokens, gated.
    check = [(777, False), (777, False), (777, True), (777, False)]
    assert gated == check + [(21, True), (22, True)], gated
    # q/k preparation: its self-check (batch 2), then one launch per decode token.
    assert preps == [2, 1, 1], preps
    tol = 1e-5 if dtype == F32 else 2e-2  # bf16: p v in float32 vs MLX's bf16 steps
    for step, (y, ref) in enumerate(zip(ys, refs)):
        assert y.dtype == ref.dtype and mx_rel_l2(y, ref) <= tol, step
    # Past SPLIT_KV_MIN_KEYS too (lowered here), the kernel pair runs.
    gated.clear()
    monkeypatch.setattr(attn_ops, "SPLIT_KV_MIN_KEYS", 16)
    ys_long, _ = run_steps(fused, xs, KVCache)
    assert gated == [(21, True), (22, True)], gated
    assert mx_rel_l2(ys_long[-1], refs[-1]) <= tol
    assert preps == [2, 1, 1, 1, 1], preps
    # Each switch alone: attn-kernel off keeps q/k preparation's launch, qk-prep
    # off keeps the kernel pair; both off, the MLX path runs.
    for decode_kernel, prep_kernel in ((False, True), (True, False), (False, False)):
        gated.clear()
        preps.clear()
        fused.decode_kernel, fused.prep_kernel = decode_kernel, prep_kernel
        ys_off, _ = run_steps(fused, xs, KVCache)
        assert bool(gated) is decode_kernel and bool(preps) is prep_kernel, (gated, preps)
        for y, ref in zip(ys_off, refs):
            assert mx_rel_l2(y, ref) <= tol
    device.reset_self_checks()  # no verdict for the shapes of the tests that follow


# (Hq, Hk, D, R, traditional, dtype, offset): Qwen3.6's full attention (16 / 2
# heads, D 256, 64 rotary dims), a smaller "rotate half" with 2 elements per
# lane (partner 8 lanes away), and a traditional RoPE; bf16, f16, float32.
QK_PREP_CASES = [
    (16, 2, 256, 64, False, BF16, 4097),
    (16, 2, 256, 64, False, F32, 131071),
    (3, 1, 64, 32, False, F16, 7),
    (4, 2, 64, 16, True, BF16, 300),
]


@pytest.mark.parametrize("case", QK_PREP_CASES, ids=lambda c: "x".join(map(str, c[:4]))
                         + f"-{'trad' if c[4] else 'half'}-{c[5]}")
def test_qk_norm_rope_emulated(case):
    # One launch = prep_qk's rms_norm, transpose and rope for q and k, read
    # through strides (q as the first half of each head of q_proj's output).
    Hq, Hk, D, R, trad, dtype, pos = case
    rope = attn_ops.RopeSpec(R, trad, 1e7 if not trad else 1e4, 1.0)
    kq, kk, kw = mx.random.split(mx.random.key(D + R), 3)
    B = 2
    q = mx.split(mx.random.normal((B, 1, Hq, 2 * D), key=kq).astype(dtype), 2, axis=-1)[0]
    k = mx.random.normal((B, 1, Hk, D), key=kk).astype(dtype)
    w = (1.0 + 0.2 * mx.random.normal((2, D), key=kw)).astype(dtype)
    offset = mx.array(pos, dtype=mx.int32)
    q_out, k_out = attn_ops._qk_prep_call("cuda", q, k, w[0], w[1], 1e-6, 1e-5, rope, offset)
    q_ref, k_ref = attn_ops.prep_qk(q, k, w[0], w[1], q_eps=1e-6, k_eps=1e-5, rope=rope,
                                    offset=offset)
    exact = _qk_prep_reference(q, k, w[0], w[1], (1e-6, 1e-5), rope, pos)
    for out, ref, cuda_ref in ((q_out, q_ref, exact[0]), (k_out, k_ref, exact[1])):
        assert out.shape == ref.shape and out.dtype == dtype
        # MLX's CPU ops (the self-check's reference on a GPU is its CUDA ops):
        # its RMSNorm and RoPE compute theta and the normaliser in another
        # order, a last-bit difference that RoPE's large angles (4,097 rad)
        # amplify in float32 (one float32 step of a 131,071 rad angle is
        # 0.008 rad) and move across a rounding boundary in bf16.
        assert mx_rel_l2(out, ref) <= (1e-4 if dtype == F32 else 1e-2)
        # The formula of MLX's CUDA kernels, step by step in float32 with the
        # same roundings: in bf16 / f16 equal but where this CPU's cos / sin
        # land on the other side of a rounding boundary than CUDA's would; in
        # float32 the sum of squares' order (butterflies vs numpy's pairwise
        # sum) moves the last bit.
        if dtype != F32:
            same = mx.mean((out == cuda_ref).astype(F32)).item()
            assert same >= 0.99, same
        assert mx_rel_l2(out, cuda_ref) <= (1e-6 if dtype == F32 else 2e-3)


def _rounded_as(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` rounded to ``dtype`` by MLX, back as float32 numpy (one rounding step)."""
    return np.array(mx.array(a.astype(np.float32)).astype(dtype).astype(F32))


def _qk_prep_reference(q, k, q_w, k_w, eps, rope, pos):
    """qk_norm_rope's documented formula (MLX's CUDA rms_norm and rope), in numpy
    float32 with every rounding to the input dtype done by MLX."""
    dtype = q.dtype
    rnd = functools.partial(_rounded_as, dtype=dtype)
    R, half = rope.dims, rope.dims // 2
    log2_base = np.log2(np.float32(rope.base), dtype=np.float32)
    i = np.arange(half, dtype=np.float32)
    # exp2, cos and sin of the float32 arguments evaluated in float64 and rounded
    # once: what CUDA's exp2f / cosf / sinf return to within an ulp. numpy's own
    # float32 versions are SIMD approximations whose error at angles of 1e5 rad
    # depends on the numpy build (2.4 moved this test's float32 case by 3e-4).
    ex = (-(i / np.float32(half)) * log2_base).astype(np.float64)
    theta = np.float32(rope.scale * pos) * np.exp2(ex).astype(np.float32)
    t64 = theta.astype(np.float64)
    c, s_ = np.cos(t64).astype(np.float32), np.sin(t64).astype(np.float32)
    outs = []
    for x, w, e in ((q, q_w, eps[0]), (k, k_w, eps[1])):
        x = np.array(x.astype(F32)).transpose(0, 2, 1, 3)  # [B, H, 1, D]
        ss = (x * x).sum(-1, keepdims=True, dtype=np.float32)
        norm = np.float32(1) / np.sqrt(ss / np.float32(x.shape[-1]) + np.float32(e))
        n = rnd(np.array(w.astype(F32)) * rnd(x * norm))
        out = n.copy()
        if rope.traditional:
            a, b = n[..., 0:R:2], n[..., 1:R:2]
            out[..., 0:R:2], out[..., 1:R:2] = rnd(a * c - b * s_), rnd(a * s_ + b * c)
        else:
            a, b = n[..., :half], n[..., half:R]
            out[..., :half], out[..., half:R] = rnd(a * c - b * s_), rnd(a * s_ + b * c)
        outs.append(mx.array(out).astype(dtype))
    return outs


def test_qk_prep_readiness(monkeypatch):
    # Ready on "cuda" for the shapes the kernel takes (self-checked once per
    # class), None for the others, before any build.
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    device.reset_self_checks()
    rope = attn_ops.RopeSpec(64, False, 1e7, 1.0)
    assert attn_ops.qk_prep_kernel_ready(16, 2, 256, BF16, BF16, rope) == "cuda"
    verdicts = {k: v for k, v in device.self_check_results().items() if k[0] == "qk_norm_rope"}
    assert list(verdicts.values()) == [(True, "passed")], verdicts
    assert attn_ops.qk_prep_kernel_ready(16, 2, 256, BF16, BF16, None) is None  # other RoPE
    assert attn_ops.qk_prep_kernel_ready(16, 2, 72, BF16, BF16, rope) is None  # D % 32
    assert attn_ops.qk_prep_kernel_ready(16, 2, 256, BF16, F32, rope) is None  # weight dtype
    odd = attn_ops.RopeSpec(18, False, 1e7, 1.0)  # 9 pairs: not a lane multiple
    assert attn_ops.qk_prep_kernel_ready(16, 2, 256, BF16, BF16, odd) is None
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: None)
    assert attn_ops.qk_prep_kernel_ready(16, 2, 256, BF16, BF16, rope) is None
    device.reset_self_checks()


def _cuda_sigmoid_gate(out, gate):
    """``out * sigmoid(gate)`` as MLX's CUDA ops round it in ``out``'s dtype:
    [B, Hq, 1, D] attention, [B, 1, Hq, D] gate -> [B, 1, Hq * D]."""
    dtype = out.dtype
    rnd = functools.partial(_rounded_as, dtype=dtype)
    x = np.array(gate.astype(F32))
    r = rnd(np.float32(1) / rnd(np.float32(1) + rnd(np.exp(np.abs(x)))))
    sg = np.where(x < 0, r, rnd(np.float32(1) - r))
    o = np.array(out.astype(F32)).transpose(0, 2, 1, 3)  # [B, 1, Hq, D]
    y = rnd(o * sg)
    return mx.array(y.reshape(y.shape[0], 1, -1)).astype(dtype)


def test_split_decode_attention_dispatch_and_self_check(monkeypatch):
    # gqa_attention_split takes the kernel pair once its self-check (a
    # strided cache-like view, masked keys) passed, on "cuda".
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    calls = []
    real = attn_ops._split_kernel_call
    monkeypatch.setattr(attn_ops, "_split_kernel_call",
                        lambda *a, **kw: calls.append(a[2].shape[2]) or real(*a, **kw))
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(1))
    k = mx.random.normal((1, 2, 100, 32), key=mx.random.key(2))
    v = mx.random.normal((1, 2, 100, 32), key=mx.random.key(3))
    out = attn_ops.gqa_attention_split(q, k, v, 0.3, None)
    verdicts = {key: val for key, val in device.self_check_results().items()
                if key[0] == "gqa_decode_attention"}
    assert list(verdicts.values()) == [(True, "passed")], verdicts
    # The self-check's inputs (unmasked, masked, masked and gated, several
    # tiles per warp), then the call.
    assert calls == [777] * 4 + [100]
    assert mx_rel_l2(out, attn_ops.gqa_attention_ops(q, k, v, 0.3, None)) <= 1e-5
    attn_ops.gqa_attention_split(q, k, v, 0.3, None, use_kernel=False)
    assert calls == [777] * 4 + [100]
    # One verdict per (Hq, Hk, D, dtype): a masked, gated call does not check again.
    gate = mx.random.normal((1, 1, 4, 32), key=mx.random.key(4))
    row = mx.arange(100).reshape(1, 1, 1, 100) < 90
    gated = attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row, gate)
    assert calls == [777] * 4 + [100, 100] and gated.shape == (1, 1, 128)
    ref = attn_ops.gate_output(attn_ops.gqa_attention_ops(q, k, v, 0.3, row), gate)
    assert mx_rel_l2(gated, ref) <= 1e-5
    # Forms the kernel does not take: None, and the caller runs MLX ops.
    per_head = mx.broadcast_to(row, (1, 4, 1, 100))
    assert attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, per_head, gate) is None
    assert attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row.astype(F32), gate) is None
    assert attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row, gate.astype(BF16)) is None
    # Masks of rank 3 or 5: under broadcasting a [2, 1, S] mask's first axis
    # is the heads', not the batch's.
    assert attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row[0], gate) is None
    assert attn_ops.gqa_decode_attention_gated(q, k, v, 0.3, row[None], gate) is None
    assert calls == [777] * 4 + [100, 100]



# --------------------------------------------------------------------------
# The MoE half of a decode layer in one launch (kernels/cuda/moe_decode_block.cu:
# route, gate/up and down as ticketed phases), through ops.moe's launch code
# --------------------------------------------------------------------------

# (N, E, H, I, K, shared gate bits), dtype, router group, norm: two rows in
# bfloat16 with an 8-bit shared gate; one row in float16, 40 experts (a
# partial route block), a 4-bit gate, raw scores.
BLOCK_EMU_CASES = [((2, 16, 1024, 64, 4, 8), BF16, 64, True),
                   ((1, 40, 1024, 32, 3, 4), F16, 32, False),
                   # (9 slots of 4 chunks: 36 down tasks, 2 per lane, and 2 chunks per
                   # lane of each gate/up row, so that the rolled loops of ROLL, the
                   # default, shift their arrays)
                   ((1, 16, 2048, 128, 8, 8), BF16, 64, True)]


@pytest.mark.parametrize("shape,dtype,rg,norm", BLOCK_EMU_CASES,
                         ids=lambda v: str(v).replace("mlx.core.", "").replace(" ", ""))
def test_moe_decode_block_is_the_three_launches_emulated(shape, dtype, rg, norm):
    # Both schedules (reverse and forward block order) run on the SAME counter
    # input: a counter the launch does not reset would break the second.
    case = _block_case(shape, dtype, rg)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_block_is_the_three_launches("cuda", case, shape[4], norm, counter, str(shape))


@pytest.mark.parametrize("options", [{"CS": 1, "PREFETCH": False}, {"PREFETCH": False},
                                     {"PERSIST": True, "GRID": 3},
                                     {"CS": 1, "PERSIST": True, "PREFETCH": False, "GRID": 5},
                                     {"STAGE": True, "PREFETCH": False},
                                     {"STAGE": True, "PERSIST": True, "GRID": 3},
                                     {"GRPW": 4}, {"EARLY": False},
                                     {"EARLY": False, "STAGE": False},
                                     {"EARLY": True, "GRPW": 4, "STAGE": True},
                                     {"EARLY": True, "PERSIST": True, "GRID": 3},
                                     {"RPL": True}, {"GSR": True},
                                     {"RPL": True, "GSR": True, "PERSIST": True, "GRID": 3},
                                     {"RPL": True, "GSR": True, "EARLY": False}],
                         ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_moe_decode_block_build_options_are_the_three_launches_emulated(options, monkeypatch):
    # Adjacent or spaced counters, down items that load before they wait or
    # not, that stage h in shared memory or not, 1, 2 or 4 gate/up row pairs
    # per warp, gate/up items that stage the norm themselves (EARLY: the
    # shared expert's blocks first, not waiting for the route) or not, and a
    # grid of fewer blocks than tickets (each block takes tickets until none is
    # left), route and EARLY gate/up items that load x, nw and eps before their
    # wait (RPL), gate/up items that route their row themselves from the
    # counted logits (GSR; the route then leaves its per-row counts to the
    # last block out; no effect without EARLY) give the same outputs, and
    # leave the counter zero.
    for key, value in options.items():
        monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, key, value)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    assert counter.size == 7 * moe_ops.DECODE_BLOCK_OPTIONS["CS"] + moe_ops.FOLD_NORM_MAX_ROWS
    _assert_block_is_the_three_launches("cuda", case, shape[4], norm, counter, str(options))


@pytest.mark.parametrize("options", [{}, {"EARLY": False}, {"PERSIST": True, "GRID": 3},
                                     {"RPL": True, "GSR": True},
                                     {"RPL": True, "GSR": True, "PERSIST": True, "GRID": 3}],
                         ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()) or "default")
def test_moe_decode_block_out_proj_is_the_gemv_then_the_block_emulated(options, monkeypatch):
    # OP: the mixer's 4-bit output projection as the launch's first phase
    # (2048 inputs, two rows) equals quantized_gemv's output fed to the block,
    # bit for bit, with route and gate/up items waiting for it (EARLY or not;
    # a grid of fewer blocks than tickets), and leaves the counter zero.
    for key, value in options.items():
        monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, key, value)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_out_proj_block_is_gemv_then_block("cuda", case, shape[4], norm, counter,
                                              _out_proj_case(case, 2048), str(options))


@pytest.mark.parametrize("options,op", [({}, False), ({"EARLY": False}, True),
                                        ({"PERSIST": True, "GRID": 3}, True),
                                        ({"PRW": 4}, True), ({"PRW": 1}, False),
                                        ({"PSM": 32}, True), ({"PSM": 64}, False),
                                        ({"PSM": 16, "PERSIST": True, "GRID": 3}, False),
                                        ({"UNROLL": False}, True),
                                        ({"UNROLL": False, "PSM": 32}, False),
                                        ({"NPL": True}, True), ({"NPL": True, "PRW": 1}, False),
                                        ({"NPL": True, "PERSIST": True, "GRID": 3}, True),
                                        ({"NPL": True, "PSM": 32}, False),
                                        ({"PSM": 32, "PERSIST": True, "GRID": 3, "NPS": 1},
                                         True),
                                        ({"PSM": 16, "PERSIST": True, "GRID": 4, "NPS": 2},
                                         False),
                                        ({"PSM": 32, "NPS": 1}, False),
                                        ({"ROLL": False}, True), ({"ROLL": False}, False),
                                        ({"NPG": True, "SMS": 1}, True),
                                        ({"NPG": True, "SMS": 2}, False),
                                        ({"NPG": True, "SMS": 32}, False),
                                        ({"NPG": False, "SMS": 1}, False)],
                         ids=["default", "EARLYFalse-op", "PERSIST-op", "PRW4-op", "PRW1",
                              "PSM32-op", "PSM64", "PSM16-PERSIST", "UNROLLFalse-op",
                              "UNROLLFalse-PSM32", "NPL-op", "NPL-PRW1", "NPL-PERSIST-op",
                              "NPL-PSM32", "NPS1-PSM32-PERSIST-op", "NPS2-PSM16-PERSIST",
                              "NPS1-PSM32-not-persistent", "ROLLFalse-op", "ROLLFalse",
                              "NPG-2-op", "NPG-4", "NPG-64", "NPGFalse"])
def test_moe_decode_block_next_proj_is_the_block_then_the_norm_gemv_emulated(options, op,
                                                                             monkeypatch):
    # NP: the next layer's input RMSNorm + 4-bit input projection (80 rows: a
    # partial last block) as the launch's last phase equals quantized_gemv's
    # norm build on the block's output, bit for bit, with or without the
    # out-projection phase, with a grid of fewer blocks than tickets, and with
    # 4 or 1 next-projection rows per warp (PRW; 2 shipped: a row's
    # arithmetic does not depend on it), and with 32, 64 or 16 rows per block
    # staged in dynamic shared memory by cp.async (PSM: 3, 2 and 5 blocks of
    # the 80 rows, the last partial but at 16; on a persistent grid of 3
    # blocks, each taking several items into the same shared memory); with
    # the staging loops unrolled over the block's compile-time size (UNROLL,
    # the default) and without (UNROLL off, moe-block-unroll's ablation);
    # with NPL (a block that ran a next-projection item takes the next
    # tickets, for the 2 token rows' 10 items (20 at PRW 1) crossing from row 0
    # to row 1, restaging there; on a persistent grid too; no effect with PSM);
    # with NPS (a persistent block's next-projection units after its tickets,
    # its first unit's rows copied into shared memory at its start (1) or after
    # its first item (2): on 3 blocks each unit's chunk is the block's for both
    # token rows, so the second reuses the copy; on 4 blocks of 5 chunks a
    # block's later units restage other chunks; no effect without PERSIST);
    # with NPG (the grid holds two blocks per SM for the next projection's 10
    # items, which loop over them with NPL: 2 or 4 blocks; 64, more than the
    # items, and NPG off: one block per item). The same values.
    options = dict(options)
    sms = options.pop("SMS", None)
    if sms is not None:
        monkeypatch.setattr(moe_ops, "cuda_sm_count", lambda: sms)
    for key, value in options.items():
        monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, key, value)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_next_proj_block_is_block_then_norm_gemv(
        "cuda", case, shape[4], norm, counter, _next_proj_case(case, 80),
        _out_proj_case(case, 2048) if op else None, str(options))


def test_moe_decode_block_unroll_switch_is_its_own_build_with_the_same_bits_emulated(
        monkeypatch):
    # moe-block-unroll (FusedSparseMoeBlock.unroll_stage -> UNROLL, as unroll=): the
    # argument reaches the launch as the UNROLL template value (None:
    # DECODE_BLOCK_OPTIONS["UNROLL"], on by default), each build self-checks
    # under its own key, and with both projection phases (OP + NP: the phases
    # whose input staging UNROLL unrolls) the two builds' outputs are the
    # same bits.
    assert moe_ops.DECODE_BLOCK_OPTIONS["UNROLL"] is True
    assert moe_ops._decode_block_build()["UNROLL"] is True
    assert moe_ops._decode_block_build({"UNROLL": False})["UNROLL"] is False
    with monkeypatch.context() as m:
        m.setitem(moe_ops.DECODE_BLOCK_OPTIONS, "UNROLL", False)
        assert moe_ops._decode_block_build()["UNROLL"] is False
        assert moe_ops._decode_block_build({"UNROLL": True})["UNROLL"] is True
    built = []

    def build(name, backend, **options):
        kernel = emu.build_kernel(name, backend, **options)

        def launch(**kw):
            if name == "moe_decode_block":
                built.append(dict(kw["template"])["UNROLL"])
            return kernel(**kw)
        return launch

    for module in (gd, moe_ops, attn_ops, lin_ops):
        monkeypatch.setattr(module, "build_kernel", build)
    _clear_kernel_caches()
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    x, r, w, gate, gu, dn, sw = case = _block_case(shape, dtype, rg)
    K = shape[4]
    op, nxt = _out_proj_case(case, 2048), _next_proj_case(case, 80)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    outs = {}
    for unroll in (False, True, None):
        built.clear()
        outs[unroll] = moe_ops.moe_decode_block(x, None, w, 1e-6, gate, K, norm, gu, dn, sw,
                                                "cuda", counter=counter, unroll=unroll,
                                                out_proj=op, next_proj=nxt)
        mx.eval(outs[unroll])
        assert built and set(built) == {unroll is not False}, (unroll, built)
    for a, b, c in zip(outs[False], outs[True], outs[None]):
        assert mx.array_equal(a, b).item() and mx.array_equal(b, c).item()
    assert not mx.any(counter).item()
    device.reset_self_checks()
    try:
        for unroll in (False, True):
            assert moe_ops.decode_block_ready(x, w, 1e-6, gate, K, norm, gu, dn, sw,
                                              unroll=unroll, out_proj=op,
                                              next_proj=nxt) == "cuda", unroll
        checked = [dict(k[2][12])["UNROLL"] for k, v in device.self_check_results().items()
                   if k[0] == "moe_decode_block" and v == (True, "passed")
                   and dict(k[2][12])["OP"] and dict(k[2][12])["NP"]]
        assert sorted(checked) == [False, True], checked
    finally:
        device.reset_self_checks()


# (Hk, Hv, Dk, Dv), conv bias, next projection rows (0: no NP), build options:
# 4 passes of 4 state rows per warp (Dv 128 -> 16 rows per warp), 2 passes
# with 2 lanes' floats per row and a conv bias, and a grid of fewer blocks
# than tickets; then the same with each head split over GDS items (4 items
# of 32 rows, one pass; 2 of 32 rows of 2 floats per lane; a persistent
# grid), their gated RMSNorm applied by the out-projection items; and the
# projection phases' staging as a loop, not unrolled (UNROLL off:
# moe-block-unroll's ablation; the other cases run the default, UNROLL on).
GDN_BLOCK_EMU_CASES = [((4, 8, 32, 128), False, 80, {}),
                       ((2, 16, 64, 64), True, 0, {"EARLY": False}),
                       ((4, 8, 32, 128), False, 0, {"PERSIST": True, "GRID": 3}),
                       ((4, 8, 32, 128), False, 80, {"GDS": 4}),
                       ((2, 16, 64, 64), True, 0, {"GDS": 2}),
                       ((4, 8, 32, 128), False, 0, {"GDS": 4, "PERSIST": True, "GRID": 3}),
                       ((4, 8, 32, 128), False, 80, {"UNROLL": False}),
                       ((4, 8, 32, 128), False, 80, {"UNROLL": False, "GDS": 4})]


@pytest.mark.parametrize("heads,bias,pn,options", GDN_BLOCK_EMU_CASES,
                         ids=lambda v: str(v).replace(" ", ""))
def test_moe_decode_block_gdn_is_the_gdn_launch_then_the_block_emulated(heads, bias, pn, options,
                                                                     monkeypatch):
    # GD: the Gated DeltaNet decode step as the launch's first phase (its
    # per-head code in passes), its output read by the out-projection phase
    # through L2 after every GDN item is done: the layer output, both states
    # and the next projection equal the GDN launch followed by the block, bit
    # for bit, and the counter is left zero.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    for key, value in options.items():
        monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, key, value)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    step, op = _gdn_step_case(case, heads, bias=bias)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_gdn_block_is_gdn_then_block("cuda", case, shape[4], norm, counter, step, op,
                                        _next_proj_case(case, pn) if pn else None,
                                        str((heads, options)))


def test_moe_decode_block_gdn_refuses_a_split_that_is_not_a_choice(monkeypatch):
    # GDS 3 (not 1, 2 or 4): refused by name before any launch.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, "GDS", 3)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    step, op = _gdn_step_case(case, (4, 8, 32, 128))
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(ValueError, match=r"DECODE_BLOCK_OPTIONS: GDS \(Gated DeltaNet items per "
                                         r"value head\) must be 1, 2 or 4 .* got GDS=3"):
        _assert_gdn_block_is_gdn_then_block("cuda", case, shape[4], norm, counter, step, op,
                                            None, "GDS 3")


# Phases with the packed build: none (no OP, no NP), OP + NP, GD + NP, GD on
# a persistent grid of 3 blocks; the last two with UNROLL off (moe-block-unroll's
# ablation; the others unrolled, the default).
PACK_EMU_CASES = [("plain", {}), ("op-np", {}), ("gdn-np", {}),
                  ("gdn", {"PERSIST": True, "GRID": 3}), ("gdn-np", {"PRW": 4}),
                  ("gdn-np", {"PSM": 64}), ("gdn-np", {"GDS": 4, "PSM": 32}),
                  ("op-np", {"UNROLL": False}), ("gdn-np", {"UNROLL": False})]


@pytest.mark.parametrize("phases,options", PACK_EMU_CASES,
                         ids=[f"{p}-{'-'.join(o) or 'default'}" for p, o in PACK_EMU_CASES])
def test_moe_decode_block_pack_is_the_block_emulated(phases, options, monkeypatch):
    # moe-block-pack: the router's, shared expert's and experts' arrays from
    # segments of one input give every output of the unpacked build bit for
    # bit (an 8-bit router of 64-wide groups, an 8-bit shared gate), and leave
    # the counter zero.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    for key, value in options.items():
        monkeypatch.setitem(moe_ops.DECODE_BLOCK_OPTIONS, key, value)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    step = op = nxt = None
    if phases.startswith("gdn"):
        step, op = _gdn_step_case(case, (4, 8, 32, 128))
    elif phases == "op-np":
        op = _out_proj_case(case, 2048)
    if phases.endswith("np"):
        nxt = _next_proj_case(case, 80)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_pack_is_the_block("cuda", case, shape[4], norm, counter, op, nxt, step, phases)


@pytest.mark.parametrize("gate_bits,gate_group", [(4, 32), (8, 128)])
def test_moe_decode_block_pack_emulated_sizes_each_segment_by_its_own_quantization(
        gate_bits, gate_group, monkeypatch):
    # Each segment's size follows its own array's group size and bits: an
    # 8-bit router of 128-wide groups, experts and shared projections of 64,
    # float16, and a shared gate of 4 bits in 32-wide groups or 8 bits in
    # 128-wide ones. (With one group size and an 8-bit gate everywhere, a
    # gate segment sized at 8 bits or scales sized by the router's group
    # would go unseen.)
    from .test_kernels_gpu import _shared_expert

    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    shape = (2, 16, 1024, 64, 4, gate_bits)
    x, r, w, gate, gu, dn, _ = _block_case(shape, F16, 128)
    sw = _shared_expert(1024, 64, F16, seed=11, gate_bits=gate_bits, gate_group=gate_group)
    assert gate.group_size == 128 and gu.group_size == 64
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    _assert_pack_is_the_block("cuda", (x, r, w, gate, gu, dn, sw), 4, True, counter,
                              where=f"gate {gate_bits} bits, groups of {gate_group}")


@pytest.mark.parametrize("first,second", [("sg_scales", "sg_biases"), ("d_scales", "d_biases"),
                                          ("scales", "biases")])
def test_moe_decode_block_pack_emulated_fails_on_swapped_segments(first, second, monkeypatch):
    # Segments the kernel takes in another order than decode_block_pack put
    # them (the shared gate's, the experts' down or the experts' gate/up
    # biases read as their scales and back) are caught.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    src = kernel_source("moe_decode_block_pack", "cuda").body
    at = {}
    for name in (first, second):
        hit = re.search(rf"#define {name} (QAB_PK_AT\(T, QAB_PK_\w+\))", src)
        assert hit is not None, name
        at[name] = hit.group(1)
    _broken(monkeypatch, "moe_decode_block_pack",
            f"#define {first} {at[first]}\n#define {second} {at[second]}",
            f"#define {first} {at[second]}\n#define {second} {at[first]}")
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(AssertionError, match="unpacked build"):
        _assert_pack_is_the_block("cuda", case, shape[4], norm, counter, where="shifted")


def test_packed_self_check_reads_the_pack_it_is_given_emulated(monkeypatch):
    # decode_block_ready(..., pack=pk) checks the packed build with the block's
    # own pack (no second copy of a layer's experts); pack=True packs itself.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    x, r, w, gate, gu, dn, sw = _block_case(shape, dtype, rg)
    pk = moe_ops.decode_block_pack(gate, gu, dn, sw)
    packed = []
    real = moe_ops.decode_block_pack
    monkeypatch.setattr(moe_ops, "decode_block_pack",
                        lambda *a, **k: packed.append(1) or real(*a, **k))
    device.reset_self_checks()
    args = (x, w, 1e-6, gate, shape[4], norm, gu, dn, sw)
    assert moe_ops.decode_block_ready(*args, pack=pk) == "cuda"
    assert packed == []
    device.reset_self_checks()
    assert moe_ops.decode_block_ready(*args, pack=True) == "cuda"
    assert packed == [1]
    checks = {k[0]: v for k, v in device.self_check_results().items()}
    assert checks["moe_decode_block_pack"] == (True, "passed")


def test_decode_block_pack_names_the_array_that_does_not_fit():
    # A shared expert quantized with another group size than the routed
    # experts' cannot take the packed layout: the error names the array.
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    x, r, w, gate, gu, dn, sw = _block_case(shape, dtype, rg)
    g = sw.gate_proj
    q, sc, bi = mx.quantize(mx.dequantize(g.weight, g.scales, g.biases, group_size=g.group_size,
                                          bits=g.bits), group_size=32, bits=4)
    bad = sw._replace(gate_proj=g._replace(weight=q, scales=sc, biases=bi, group_size=32))
    with pytest.raises(ValueError, match="shared gate_proj scales"):
        moe_ops.decode_block_pack(gate, gu, dn, bad)
    pk = moe_ops.decode_block_pack(gate, gu, dn, sw)
    with pytest.raises(ValueError, match="decode_block_pack makes"):
        moe_ops.moe_decode_block(x, r, w, 1e-6, gate, shape[4], norm, gu, dn, sw, "cuda",
                                 pack=pk[:-32])


def test_moe_decode_block_gdn_emulated_fails_when_the_out_projection_does_not_wait(monkeypatch):
    # Out-projection items must wait for every GDN item (GDBLK per row):
    # waiting for one more than there are is caught.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    _broken(monkeypatch, "moe_decode_block_gdn", "static_cast<uint32_t>(GDBLK * rows)",
            "static_cast<uint32_t>(GDBLK * rows + 1)")
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    step, op = _gdn_step_case(case, (4, 8, 32, 128))
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(emu.KernelFault, match="qab_wait_count"):
        _assert_gdn_block_is_gdn_then_block("cuda", case, shape[4], norm, counter, step, op)


def test_moe_decode_block_gdn_emulated_fails_when_a_pass_loads_the_first_pass_rows(monkeypatch):
    # The GDN phase runs its state rows in passes (gated_delta_decode.cuh's
    # PASSES): a pass that loads the first pass's rows again is caught.
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    _broken(monkeypatch, "moe_decode_block_gdn",
            "const int dv = (pass * RPP + r) * NW + warp;\n#pragma unroll\n      for",
            "const int dv = r * NW + warp;\n#pragma unroll\n      for", header=True)
    shape, dtype, rg, norm = BLOCK_EMU_CASES[0]
    case = _block_case(shape, dtype, rg)
    step, op = _gdn_step_case(case, (4, 8, 32, 128))
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(AssertionError, match="from the GDN launch"):
        _assert_gdn_block_is_gdn_then_block("cuda", case, shape[4], norm, counter, step, op)


@pytest.mark.parametrize("phase", ["out-proj", "next-proj"])
def test_moe_decode_block_projection_phase_emulated_fails_when_a_wait_is_off(monkeypatch, phase):
    # Route and gate/up items must wait for every out-projection item (OBLK
    # per row), next-projection items for every down item (DBLK per row):
    # waiting for one more than there are is caught (the emulator checks the
    # count it waits for).
    blocks = "OBLK" if phase == "out-proj" else "DBLK"
    _broken(monkeypatch, "moe_decode_block", f"static_cast<uint32_t>({blocks} * rows)",
            f"static_cast<uint32_t>({blocks} * rows + 1)")
    case = _block_case(*BLOCK_EMU_CASES[0][:3])
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(emu.KernelFault, match="qab_wait_count"):
        if phase == "out-proj":
            _assert_out_proj_block_is_gemv_then_block("cuda", case, 4, True, counter,
                                                      _out_proj_case(case, 2048))
        else:
            _assert_next_proj_block_is_block_then_norm_gemv("cuda", case, 4, True, counter,
                                                            _next_proj_case(case, 80))


def test_moe_decode_block_emulated_fails_without_the_reset(monkeypatch):
    # The last block out must zero the phase counters; without it the second
    # schedule's blocks draw tickets past the grid and wait on blocks that
    # never run (the emulator reports the wait instead of hanging).
    _broken(monkeypatch, "moe_decode_block", "    *tickets = 0u;\n", "")
    case = _block_case(*BLOCK_EMU_CASES[0][:3])
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(AssertionError):
        _assert_block_is_the_three_launches("cuda", case, 4, True, counter)


def test_moe_decode_block_emulated_fails_when_a_phase_does_not_wait(monkeypatch):
    # Down blocks must wait for every gate/up block: waiting for one fewer is
    # caught (the emulator checks the count it waits for).
    _broken(monkeypatch, "moe_decode_block", "static_cast<uint32_t>(GBLK * rows)",
            "static_cast<uint32_t>(GBLK * rows + 1)")
    case = _block_case(*BLOCK_EMU_CASES[0][:3])
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    with pytest.raises(emu.KernelFault, match="qab_wait_count"):
        _assert_block_is_the_three_launches("cuda", case, 4, True, counter)


def test_moe_decode_block_prefetch_stays_inside_its_arrays_emulated(monkeypatch):
    # PF: the gate/up items that wait for nothing prefetch each given array
    # whole (the emulator checks every prefetched range lies in one input);
    # a byte count one array too long is caught.
    x, r, w, gate, gu, dn, sw = case = _block_case(*BLOCK_EMU_CASES[0][:3])
    counter = moe_ops.fold_norm_counter(moe_ops.decode_block_counter_length())
    ref = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                   counter=counter)
    # Odd sizes: a 4-chunk weight, 36 bytes of scales, a 3-element norm weight.
    pf = (mx.zeros((4 * 4096 // 4 + 5,), mx.uint32), gu.scales[:1, :1, :18], w[:3])
    out = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                   counter=counter, prefetch=pf)
    assert mx.array_equal(out, ref).item()
    _broken(monkeypatch, "moe_decode_block", "qab_input_bytes(pf1, pf1_shape, pf1_ndim)",
            "2 * qab_input_bytes(pf1, pf1_shape, pf1_ndim)")
    with pytest.raises(emu.KernelFault, match="qab_prefetch_l2"):
        moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                 counter=counter, prefetch=pf)


@pytest.mark.slow
def test_moe_decode_block_dispatcher_self_checks_the_emulated_kernel(monkeypatch):
    one_schedule(monkeypatch)
    monkeypatch.setattr(moe_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    device.reset_self_checks()
    try:
        x, r, w, gate, gu, dn, sw = _block_case(*BLOCK_EMU_CASES[0][:3])
        assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw) == "cuda"
        verdicts = device.self_check_results()
        assert verdicts[next(k for k in verdicts if k[0] == "moe_decode_block")] == (
            True, "passed")
        out = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda")
        _assert_block_is_the_three_launches("cuda", (x, r, w, gate, gu, dn, sw), 4, True,
                                            moe_ops.fold_norm_counter(
                                                moe_ops.decode_block_counter_length()))
        assert out.shape == x.shape
        # The build without EARLY (moe-block-early off) and the L2-prefetch build
        # (PF) each self-check under their own key and give the same output.
        for kw in (dict(early=False), dict(prefetch=True)):
            assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw,
                                              **kw) == "cuda", kw
        # The out-projection build (OP) self-checks under its own key against
        # quantized_gemv + the three launches; a projection outside its
        # contract (8-bit, or an input width of 1,536, not a multiple of 1,024) is None
        # from ready and an error from the call, naming out_proj.
        op = _out_proj_case((x, r, w, gate, gu, dn, sw), 2048)
        assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw,
                                          out_proj=op) == "cuda"
        keys = [k for k in device.self_check_results() if k[0] == "moe_decode_block"]
        assert len(keys) == 4
        projected = moe_ops.moe_decode_block(x, None, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                             out_proj=op)
        r_op = lin_ops.quantized_gemv_kernel(op.x, op.weights.weight, op.weights.scales,
                                             op.weights.biases, 64, pipe=False)
        assert mx.array_equal(projected, moe_ops.moe_decode_block(
            x, r_op, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda")).item()
        q8 = moe_ops.ExpertWeights(*mx.quantize(mx.dequantize(
            op.weights.weight, op.weights.scales, op.weights.biases, 64), 64, 8),
            group_size=64, bits=8)
        narrow = _out_proj_case((x, r, w, gate, gu, dn, sw), 1536)
        for bad in (op._replace(weights=q8), narrow):
            assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw,
                                              out_proj=bad) is None
            with pytest.raises(ValueError, match="out_proj"):
                moe_ops.moe_decode_block(x, None, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                         out_proj=bad)
        # The next-projection build (NP) self-checks under its own key against
        # the three launches + quantized_gemv's norm build, both outputs; the
        # public call returns (out, po); an 8-bit projection is refused.
        npc = _next_proj_case((x, r, w, gate, gu, dn, sw), 48)
        assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw,
                                          next_proj=npc) == "cuda"
        assert len([k for k in device.self_check_results() if k[0] == "moe_decode_block"]) == 5
        got, po = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                           next_proj=npc)
        assert mx.array_equal(got, out).item() and po.shape == (*x.shape[:-1], 48)
        ref_po = lin_ops.norm_gemv_kernel(out, npc.norm_weight, npc.eps, npc.weights.weight,
                                          npc.weights.scales, npc.weights.biases, 64, pipe=False)
        assert mx.array_equal(po, ref_po).item()
        bad = npc._replace(weights=q8)
        assert moe_ops.decode_block_ready(x, w, 1e-6, gate, 4, True, gu, dn, sw,
                                          next_proj=bad) is None
        with pytest.raises(ValueError, match="next_proj"):
            moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                     next_proj=bad)
        late = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                        early=False)
        pf = moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                      prefetch=(gu.weight, gu.scales, w))
        assert mx.array_equal(late, out).item() and mx.array_equal(pf, out).item()
        assert moe_ops._decode_block_build({"EARLY": True}, prefetch=True)["PF"]
        assert not moe_ops._decode_block_build({"EARLY": False}, prefetch=True)["PF"]
        with pytest.raises(ValueError, match="at most 3 arrays"):
            moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                     prefetch=(w, w, w, w))
        # Build options that cannot work: counters on one element, an empty grid,
        # 3 gate/up row pairs per warp, 8 next-projection rows per warp (spills),
        # 40 next-projection rows per block in shared memory (not a choice).
        for bad in ({"CS": 0}, {"PERSIST": True, "GRID": 0}, {"GRPW": 3}, {"PRW": 8},
                    {"PSM": 40}):
            with monkeypatch.context() as m:
                for k, v in bad.items():
                    m.setitem(moe_ops.DECODE_BLOCK_OPTIONS, k, v)
                with pytest.raises(ValueError, match="DECODE_BLOCK_OPTIONS"):
                    moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda")
        # Too many rows for the counter; r of another shape.
        with pytest.raises(ValueError, match="counter"):
            moe_ops.moe_decode_block(x, r, w, 1e-6, gate, 4, True, gu, dn, sw, "cuda",
                                     counter=moe_ops.serial_counter(4))
        with pytest.raises(ValueError, match="shape"):
            moe_ops.moe_decode_block(x, r[:1], w, 1e-6, gate, 4, True, gu, dn, sw, "cuda")
        # Outside the contract: float32 activations.
        assert moe_ops.decode_block_ready(x.astype(F32), w, 1e-6, gate, 4, True, gu, dn,
                                          sw) is None
    finally:
        device.reset_self_checks()


# --------------------------------------------------------------------------
# The one-launch decode attention step (gqa_decode_step, attn-step)
# --------------------------------------------------------------------------

# (B, Hq, Hk, D, S, offset, dtype, RoPE dims, traditional, thread blocks one
# launch aims for): Qwen3.6's 8 query heads per KV head at D 256 with its
# partial RoPE (64 of 256 dims) and key blocks past the token; float32 at D
# 128 with the token in the buffer's last row; float16, traditional full RoPE,
# one big key block and an empty one; the first token (offset 0), G 1, D 32;
# many key blocks (two chunks of merge weights).
STEP_CASES = [
    (1, 16, 2, 256, 150, 137, BF16, 64, False, 128),
    (2, 8, 2, 128, 77, 76, F32, 32, False, 128),
    (1, 4, 1, 64, 300, 40, F16, 64, True, 2),
    (2, 2, 2, 32, 45, 0, BF16, 32, False, 128),
    # 130 key blocks with keys: the merge's weights staged in two chunks (128 at D 32).
    (1, 2, 1, 32, 4200, 4150, F32, 32, False, 512),
    # Two key blocks of 328 keys: each warp of the tensor-core pass takes 5-6
    # steps (its running max and rescale), G 8 at D 64.
    (1, 8, 1, 64, 700, 650, BF16, 64, False, 2),
]


def _aligned16(shape, key, dtype):
    """Random values of ``shape`` in a view whose first element sits on a 16-byte
    boundary, as MLX's GPU buffers do (its CPU buffers may start 8 bytes off,
    which the kernels' vector and tensor-core paths refuse)."""
    n = int(np.prod(shape))
    flat = mx.random.normal((n + 16,), key=key).astype(dtype)
    mx.eval(flat)
    ptr = np.asarray(emu._numpy_compatible(flat)).__array_interface__["data"][0]
    skip = (-ptr % 16) // dtype.size
    view = flat[skip:skip + n].reshape(shape)
    mx.eval(view)
    assert emu._view_bytes(view)[2] == 0, "not a 16-byte aligned view"
    return view


def _step_case(B, Hq, Hk, D, S, off, dtype, R, trad):
    kx, kw, kk, kv = mx.random.split(mx.random.key(S + D + off), 4)
    qkv = mx.random.normal((B, 1, Hq * 2 * D + 2 * Hk * D), key=kx).astype(dtype)
    w = (1.0 + 0.2 * mx.random.normal((2, D), key=kw)).astype(dtype)
    # The cache's form: a view of the first S rows of a longer buffer (16-byte
    # aligned, as on the GPU: the tensor-core pass needs it).
    k_buf = _aligned16((B, Hk, S + 9, D), kk, dtype)[:, :, :S]
    v_buf = _aligned16((B, Hk, S + 9, D), kv, dtype)[:, :, :S]
    rope = attn_ops.RopeSpec(R, trad, 10000.0, 1.0)
    return qkv, w[0], w[1], k_buf, v_buf, mx.array(off, dtype=mx.int32), rope


def _step_id(c):
    return "x".join(map(str, c[:6])) + f"-{c[6]}-R{c[7]}{'trad' if c[8] else ''}-ctas{c[9]}"


def _four_launches(qkv, qw, kw, k_buf, v_buf, offset, Hq, rope, lanes=True):
    """The same token through qk_norm_rope, the buffers written by MLX ops (the
    emulator does not hand in-place writes back), the split-K pair with the
    step's mask, and the gate: the launches the step replaces."""
    B, Hk, D = qkv.shape[0], k_buf.shape[1], k_buf.shape[3]
    qg, k, v = mx.split(qkv, [Hq * 2 * D, Hq * 2 * D + Hk * D], axis=-1)
    q, gate = mx.split(qg.reshape(B, 1, Hq, 2 * D), 2, axis=-1)
    q, k = attn_ops.prep_qk_decode(q, k.reshape(B, 1, Hk, D), qw, kw, q_eps=1e-6, k_eps=1e-5,
                                   rope=rope, offset=offset)
    kb, vb, mask = attn_ops.kv_cache_write_ops(
        k, v.reshape(B, 1, Hk, D).transpose(0, 2, 1, 3), k_buf, v_buf, offset)
    return attn_ops._split_kernel_call("cuda", q, kb, vb, D ** -0.5, mask, gate, lanes=lanes)


def _step(case, counter=None, mma=True, merge_split=True, merge_spread=False):
    qkv, qw, kw, k_buf, v_buf, offset, rope = case
    B, Hk = k_buf.shape[:2]
    Hq = (qkv.shape[-1] - 2 * Hk * k_buf.shape[3]) // (2 * k_buf.shape[3])
    return attn_ops._step_call("cuda", qkv, qw, kw, k_buf, v_buf, offset, Hq, 1e-6, 1e-5, rope,
                               k_buf.shape[3] ** -0.5,
                               attn_ops.step_counter(B, Hk) if counter is None else counter,
                               mma=mma, merge_split=merge_split, merge_spread=merge_spread)


def _step_builds(monkeypatch, record=lambda kw: dict(kw["template"])["PM"]):
    """The step's launches, each recorded as ``record`` of its keywords (by
    default its PM template value), in a list in order."""
    built = []
    real = attn_ops._step_object

    def obj(backend):
        kernel = real(backend)

        def launch(**kw):
            built.append(record(kw))
            return kernel(**kw)
        return launch

    monkeypatch.setattr(attn_ops, "_step_object", obj)
    return built


def test_decode_step_two_level_merge_rule():
    # PM where asked for and above STEP_PM_MIN_BLOCKS key blocks; groups of
    # ceil(sqrt(NB)) key blocks; the step counter holds every group's count.
    assert attn_ops._step_pm(attn_ops.STEP_PM_MIN_BLOCKS + 1, merge_split=True)
    assert not attn_ops._step_pm(attn_ops.STEP_PM_MIN_BLOCKS, merge_split=True)
    assert not attn_ops._step_pm(64)  # opt-in (attn-merge-split): off unless asked for
    assert [attn_ops._step_groups(n) for n in (1, 2, 17, 64, 65, 128)] == [1, 1, 4, 8, 8, 11]
    assert attn_ops.step_counter(1, 2).size >= 2 * (1 + attn_ops._step_groups(64))


@pytest.mark.parametrize("split", [True, False], ids=["split-merge", "one-merger"])
@pytest.mark.parametrize("mma", [True, False], ids=["mma", "lanes"])
@pytest.mark.parametrize("case", STEP_CASES, ids=_step_id)
def test_decode_step_is_the_four_launches_emulated(case, mma, split, monkeypatch):
    # mma: the tensor-core key pass (gqa_mma.cuh) where the case allows it
    # (16-bit inputs, G <= 8, D a multiple of 64: the first and third cases),
    # else, and with mma False, the lane-group pass. split: the two-level
    # merge (PM: the last block of each group of key blocks merges the group,
    # the last of those the groups) where the case has more than 2 key blocks
    # (STEP_PM_MIN_BLOCKS lowered to 2), else the last block of each KV head
    # merging every key block.
    B, Hq, Hk, D, S, off, dtype, R, trad, ctas = case
    if not mma and not attn_ops._step_mma(Hq // Hk, D, dtype):
        pytest.skip("the lane-group pass either way")
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", ctas)
    monkeypatch.setattr(attn_ops, "STEP_PM_MIN_BLOCKS", 2 if split else 10 ** 9)
    built = _step_builds(monkeypatch)
    c = _step_case(B, Hq, Hk, D, S, off, dtype, R, trad)
    qkv, qw, kw, k_buf, v_buf, offset, rope = c
    # Both schedules run on the SAME counter: one the launch leaves non-zero
    # breaks the second.
    counter = attn_ops.step_counter(B, Hk)
    out = _step(c, counter, mma=mma)
    assert out.shape == (B, 1, Hq * D) and out.dtype == dtype
    assert np.all(np.array(counter) == 0)
    nb = -(-S // attn_ops._lanes_params(B, Hk, S, Hq // Hk, D, dtype)[0])
    if split and nb <= 2:
        pytest.skip("two key blocks or fewer: one level either way")
    assert built == [split], (built, nb)
    ref, kb, vb = attn_ops.gqa_decode_step_ops(
        *(a.astype(F32) for a in (qkv, qw, kw, k_buf, v_buf)), offset, heads=Hq, q_eps=1e-6,
        k_eps=1e-5, rope=rope, scale=D ** -0.5)
    # float32: RoPE at position 4,150 turns a last-bit difference in the angle
    # between the kernel's formula and MLX's rope into ~3e-5 (as the q/k
    # kernel's self-check allows); the four launches share the kernel's formula.
    assert mx_rel_l2(out, ref) <= (1e-4 if dtype == F32 else 2 * _split_tol(dtype))
    # The same arithmetic as the four launches but for the order of the key
    # blocks' merge (float32): at most a last-bit difference of the output dtype.
    four = _four_launches(qkv, qw, kw, k_buf, v_buf, offset, Hq, rope)
    assert mx_rel_l2(out, four) <= (1e-6 if dtype == F32 else 4e-3)
    # The public entry takes the same launch.
    pub = attn_ops.gqa_decode_step(qkv, qw, kw, k_buf, v_buf, offset, counter, heads=Hq,
                                   q_eps=1e-6, k_eps=1e-5, rope=rope, scale=D ** -0.5, mma=mma,
                                   merge_split=True)
    assert mx.array_equal(pub, out).item()
    if mma and attn_ops._step_mma(Hq // Hk, D, dtype):
        # The tensor-core pass no further from float32 than the lane-group pass
        # (both round float32 sums to the output dtype once; 10 % + a hair).
        lanes = _step(c, mma=False)
        assert mx_rel_l2(out, ref) <= 1.1 * mx_rel_l2(lanes, ref) + 1e-4
        assert mx_rel_l2(out, lanes) <= 4e-3
    if split:
        # The one-merger build: the same partials merged in another order (float32).
        one = _step(c, mma=mma, merge_split=False)
        assert mx_rel_l2(out, one) <= (1e-6 if dtype == F32 else 4e-3)


@pytest.mark.parametrize("case", STEP_CASES, ids=_step_id)
def test_decode_step_merge_spread_is_the_same_bits_emulated(case, monkeypatch):
    # merge_spread (the kernel's MS = G merging blocks per KV head, one query
    # head each, the rows' elements spread over the block's warps; every
    # block takes a ticket as it starts, the merging blocks the last G and
    # wait for the key blocks' count) gives the one-block merge's output bit
    # for bit, and leaves the counts and tickets at zero (both schedules run
    # on the SAME counter). The fifth case merges 130 key blocks in two
    # chunks of rows; the fourth's 2 query heads over 8 warps of 32 floats.
    B, Hq, Hk, D, S, off, dtype, R, trad, ctas = case
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", ctas)
    built = _step_builds(monkeypatch, lambda kw: (
        dict(kw["template"])["PM"], dict(kw["template"])["MS"],
        kw["grid"][0] // kw["threadgroup"][0]))
    c = _step_case(B, Hq, Hk, D, S, off, dtype, R, trad)
    one = _step(c, merge_split=False)
    counter = attn_ops.step_counter(B, Hk)
    spread = _step(c, counter, merge_split=False, merge_spread=True)
    assert mx.array_equal(spread, one).item()
    assert np.all(np.array(counter) == 0)
    nb = built[0][2]
    assert built == [(False, 0, nb), (False, Hq // Hk, nb + Hq // Hk)], built
    # Not with the two-level merge (PM), nor unless asked for.
    assert attn_ops._step_ms(Hq // Hk, True, pm=True) == 0
    assert attn_ops._step_ms(Hq // Hk, False) == 0


# The spread merge's, with the STEP_CASES case each runs: the count or the
# tickets not reset by the last merging block (handed back non-zero: the next
# launch's merging blocks would not wait, or every block would take a merging
# ticket); in the one-trip merge (up to 64 rows) a row's m shuffled from the
# wrong lane; in the chunked merge (the fifth case's 130 rows) a row's weight
# without the common max, the rows past the chunk weighed.
STEP_SPREAD_BREAKS = {
    "count-not-reset": ("      *cnt0 = 0u;\n", "", 1),
    "tickets-not-reset": ("      cnt0[(int64_t)gridDim.z * Hk] = 0u;\n", "", 1),
    "one-trip-m-lane": ("mr[u / 32], u % 32);", "mr[u / 32], (u + 1) % 32);", 1),
    "no-rescale": ("i0 + u < c1 ? exp2f(mv[u] - M) : 0.f;", "i0 + u < c1 ? exp2f(mv[u]) : 0.f;",
                   4),
    "repeat-weighs": ("i0 + u < c1 ? exp2f(mv[u] - M) : 0.f;", "exp2f(mv[u] - M);", 4),
}


@pytest.mark.parametrize("what", sorted(STEP_SPREAD_BREAKS))
def test_decode_step_merge_spread_broken_fails_emulated(what, monkeypatch):
    # (The second case: B 2, f32, D 128: 4 warps per head, 2 heads per merging
    # block.) Each break must change the output, fault, or leave the counter
    # non-zero.
    old, new, k = STEP_SPREAD_BREAKS[what]
    B, Hk = STEP_CASES[k][0], STEP_CASES[k][2]
    case = _step_case(*STEP_CASES[k][:9])
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", STEP_CASES[k][9])
    one = _step(case, merge_split=False)
    _broken(monkeypatch, "gqa_decode_step", old, new)
    counter = attn_ops.step_counter(B, Hk)
    try:
        bad = _step(case, counter, merge_split=False, merge_spread=True)
    except emu.KernelFault:
        return
    assert not (mx.array_equal(bad, one).item() and np.all(np.array(counter) == 0)), what


# Mutations the checks must catch: the token's row never written (its key is
# then the buffer's old row), the count not reset (handed back non-zero: the
# next launch's merge would never run), the last block taken one count
# early (a key block merged before it is written), the merge's weights not
# rescaled to the common max.
STEP_BREAKS = {
    "row-not-written": ("kw[(int64_t)d * k_buf_strides[3]] = ko[e];", ""),
    "count-not-reset": ("const_cast<uint32_t*>(count)[(int64_t)b * Hk + h] = 0u;", ""),
    "last-too-early": ("static_cast<uint32_t>(NB - 1) &&", "static_cast<uint32_t>(NB - 2) &&"),
    "no-rescale": ("const float wi = exp2f(qab_ldcg(mp + (base + i) * 2) - M);",
                   "const float wi = 1.f;"),
    # A repeated row past the chunk's end not weighed 0.
    "repeat-weighs": ("const float wi = i0 + u < c1 ? sw[i0 + u - c0] : 0.f;",
                      "const float wi = sw[min(i0 + u, c1 - 1) - c0];"),
}


# The tensor-core pass (gqa_mma.cuh, a header): a lane's o not rescaled when
# its head's max grows, the keys past the block weighed, one V row of the
# pair read twice, the probabilities' low part dropped (p to 8 bits).
STEP_MMA_BREAKS = {
    "mma-no-rescale": ("qab_mma_scale_o<D>(o, c0, c1);\n    uint32_t phi", "uint32_t phi"),
    "mma-keys-past-block": ("const float x1 = t0 + 2 * t + 1 < s1 ?", "const float x1 = true ?"),
    "mma-v-row-twice": ("min(t0 + 2 * t + 1, s1 - 1) * vs", "min(t0 + 2 * t, s1 - 1) * vs"),
    "mma-p-low-part-dropped": ("qab_mma_1688<InT>(o + 4 * i, a0, a1, plo);", ""),
}


@pytest.mark.parametrize("what", sorted(STEP_MMA_BREAKS))
def test_decode_step_mma_broken_fails_emulated(what, monkeypatch):
    # The last case (bf16, G 8, D 64, warps of 5-6 steps) through the
    # tensor-core pass against the same launch with the lane-group pass (float32
    # p v): intact, only a rare last-bit rounding of the output differs; each
    # break must move it well past that.
    case = _step_case(*STEP_CASES[-1][:9])
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", STEP_CASES[-1][9])
    lanes = _step(case, mma=False)
    good = mx_rel_l2(_step(case), lanes)
    _broken(monkeypatch, "gqa_decode_step", *STEP_MMA_BREAKS[what], header=True)
    try:
        bad = _step(case)
    except emu.KernelFault:
        return
    assert mx_rel_l2(bad, lanes) > max(4 * good, 2e-4), (what, good, mx_rel_l2(bad, lanes))


# The two-level merge's: a group's last block taken one count early (a key
# block merged before it is written), the group's count not reset, the
# groups' merge taken one count early, the level-2 rows read with the key
# blocks' row stride, a group's level-2 l dropped.
STEP_SPLIT_BREAKS = {
    "group-last-too-early": ("static_cast<uint32_t>(q1 - q0 - 1);",
                             "static_cast<uint32_t>(q1 - q0 - 2);"),
    "group-count-not-reset": ("*gcnt = 0u;", ""),
    "groups-last-too-early": ("static_cast<uint32_t>(NG - 1);", "static_cast<uint32_t>(NG - 2);"),
    "groups-row-stride": ("fnb = NG;", "fnb = NB;"),
    "group-den-dropped": ("ml2[prow * 2 + 1] = den;", "ml2[prow * 2 + 1] = 1.f;"),
}


@pytest.mark.parametrize("what", sorted(STEP_SPLIT_BREAKS))
def test_decode_step_two_level_merge_broken_fails_emulated(what, monkeypatch):
    # G 8 at D 64 over 20 key blocks of 40 keys, 15 holding keys (groups of
    # 5: the last group empty): intact, the two-level merge is within 4e-3 of
    # the four launches; each break must move it past 8e-3, fault, or leave
    # the counter non-zero.
    monkeypatch.setattr(attn_ops, "STEP_PM_MIN_BLOCKS", 2)
    monkeypatch.setattr(attn_ops, "_LANES_CTAS", 20)
    case = _step_case(1, 8, 1, 64, 800, 590, BF16, 64, False)
    qkv, qw, kw, k_buf, v_buf, offset, rope = case
    ref = _four_launches(qkv, qw, kw, k_buf, v_buf, offset, 8, rope)
    assert mx_rel_l2(_step(case), ref) <= 4e-3
    _broken(monkeypatch, "gqa_decode_step", *STEP_SPLIT_BREAKS[what])
    counter = attn_ops.step_counter(1, 1)
    try:
        bad = _step(case, counter)
    except emu.KernelFault:
        return
    assert not (mx_rel_l2(bad, ref) <= 8e-3 and np.all(np.array(counter) == 0)), what


@pytest.mark.parametrize("what", sorted(STEP_BREAKS))
def test_decode_step_broken_fails_emulated(what, monkeypatch):
    case = _step_case(*STEP_CASES[0][:9])
    qkv, qw, kw, k_buf, v_buf, offset, rope = case
    ref = _four_launches(qkv, qw, kw, k_buf, v_buf, offset, 16, rope)
    assert mx_rel_l2(_step(case), ref) <= 4e-3
    _broken(monkeypatch, "gqa_decode_step", *STEP_BREAKS[what])
    counter = attn_ops.step_counter(1, 2)
    try:
        bad = _step(case, counter)
    except emu.KernelFault:
        return  # e.g. an output element never written
    # (One wrong key of 138 moves the output ~3 %; the intact launch is within 4e-3.)
    assert not (mx_rel_l2(bad, ref) <= 8e-3 and np.all(np.array(counter) == 0)), what


def test_decode_step_dispatch_and_errors_emulated(monkeypatch):
    # step_kernel_ready self-checks the launch (output and both written
    # buffers; the emulator hands no in-place write back, so the buffer
    # outputs fail there) and declines shapes it does not take; the public
    # entry names what does not fit.
    monkeypatch.setattr(attn_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    rope = attn_ops.RopeSpec(64, False, 10000.0, 1.0)
    device.reset_self_checks()
    try:
        assert attn_ops.step_kernel_ready(1, 16, 2, 256, BF16, None) is None
        assert attn_ops.step_kernel_ready(1, 16, 2, 256, BF16,
                                          attn_ops.RopeSpec(60, False, 1e4, 1.0)) is None
        assert attn_ops.step_kernel_ready(1, 34, 2, 256, BF16, rope) is None  # G 17
        assert attn_ops.step_kernel_ready(1, 16, 2, 256, mx.int32, rope) is None
        case = _step_case(*STEP_CASES[0][:9])
        qkv, qw, kw, k_buf, v_buf, offset, _ = case
        counter = attn_ops.step_counter(1, 2)
        kw_ = dict(heads=16, q_eps=1e-6, k_eps=1e-5, rope=rope, scale=0.0625)
        with pytest.raises(ValueError, match=r"qkv must be \[B, 1, Hq \* 2 D \+ 2 Hk D\]"):
            attn_ops.gqa_decode_step(qkv[..., 1:], qw, kw, k_buf, v_buf, offset, counter, **kw_)
        with pytest.raises(ValueError, match="one dtype expected"):
            attn_ops.gqa_decode_step(qkv, qw.astype(F32), kw, k_buf, v_buf, offset, counter,
                                     **kw_)
        with pytest.raises(ValueError, match="k_buf and v_buf"):
            attn_ops.gqa_decode_step(qkv, qw, kw, k_buf, v_buf[:, :, :9], offset, counter,
                                     **kw_)
        with pytest.raises(ValueError, match="counter must be uint32 of >= 2"):
            attn_ops.gqa_decode_step(qkv, qw, kw, k_buf, v_buf, offset,
                                     mx.zeros((4,), mx.int32), **kw_)
        with pytest.raises(ValueError, match="B >= 1 and Hk >= 1"):
            attn_ops.step_counter(0, 2)
    finally:
        device.reset_self_checks()


# --------------------------------------------------------------------------
# The Gated DeltaNet step in the MoE block's launch (moe-block-gdn), through
# the fused model's own layers
# --------------------------------------------------------------------------

# Two Gated DeltaNet decoder layers and a full-attention one (mlx-lm's model
# needs one) at widths the one-launch block's phases take (H 1024; Hv Dv = 8 x
# 128 = 1024 outputs for the out-projection phase), 16 experts of 64, 4 per
# token, a 512-token vocabulary.
GDN_BLOCK_PRESET = {
    "hidden_size": 1024, "num_hidden_layers": 3, "full_attention_interval": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "rope_parameters": {"mrope_section": [3, 3, 2]},
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}


def _fake_cuda_gdn_block_preset(monkeypatch) -> None:
    """Register GDN_BLOCK_PRESET as "gdn-block" and make every op module see a
    CUDA device whose kernels (unverified ones too) are emulated."""
    from qwen_apple_backend import checkpoint
    from qwen_apple_backend.ops import norm as norm_ops

    monkeypatch.setitem(checkpoint.PRESETS, "gdn-block", GDN_BLOCK_PRESET)
    for module in (gd, moe_ops, lin_ops, attn_ops, norm_ops):
        monkeypatch.setattr(module, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(norm_ops, "build_kernel", emu.build_kernel)
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    norm_ops._kernel_object.cache_clear()


@pytest.mark.slow
def test_fused_model_runs_the_gdn_step_in_the_moe_block_emulated(monkeypatch):
    # A fused Qwen3.5-MoE model of two Gated DeltaNet layers (and a stock
    # attention one) on a faked CUDA device, every kernel emulated, eager
    # decode from an empty cache: each
    # layer's mixer leaves its decode step to its MoE block (a
    # DeferredGatedDelta), whose one launch (moe_decode_block_gdn) runs it
    # ahead of the output projection, the first block also projecting the
    # second layer's input (NP). Against the same model with moe-block-gdn off
    # (the GDN launch, then the block with its out-projection phase): the same
    # logits and the same conv and recurrent states bit for bit, token after
    # token, with no GDN launch of its own left in the decode tokens.
    one_schedule(monkeypatch)
    from mlx_lm.models.cache import make_prompt_cache

    from qwen_apple_backend.ops import norm as norm_ops

    _fake_cuda_gdn_block_preset(monkeypatch)
    launches = []
    real_block, real_gdn = moe_ops._moe_decode_block_call, gd._decode_kernel_call
    def block(*a, **k):  # gdn_step: keyword or positional
        step = inspect.signature(real_block).bind(*a, **k).arguments.get("gdn_step")
        launches.append("block" if step is None else "block+gdn")
        return real_block(*a, **k)

    monkeypatch.setattr(moe_ops, "_moe_decode_block_call", block)
    monkeypatch.setattr(gd, "_decode_kernel_call",
                        lambda *a, **k: launches.append("gdn") or real_gdn(*a, **k))
    device.reset_self_checks()
    mx.disable_compile()
    try:
        models = _fused_pair("gdn-block", "moe-block-gdn", seed=3,
                             disable=["decode-compile", "attn"])
        caches = [make_prompt_cache(m) for m in models]
        for t in range(2):
            tok = mx.array([[(t * 53 + 7) % 500]])
            got = []
            for m, c in zip(models, caches):
                launches.clear()
                got.append(m(tok, cache=c))
                mx.eval(got[-1], [e.state for e in c])
                got.append(list(launches))
            (on, on_launches), (off, off_launches) = got[:2], got[2:]
            assert mx.array_equal(on, off).item(), f"token {t}: rel-L2 {mx_rel_l2(on, off):.3g}"
            for layer, (a, b) in enumerate(zip(caches[0][:2], caches[1][:2])):
                assert mx.array_equal(a[0], b[0]).item(), f"token {t} layer {layer} conv state"
                assert mx.array_equal(a[1], b[1]).item(), f"token {t} layer {layer} state"
                assert a[1].dtype == mx.float32
            if t >= 1:  # (the first token also runs the self-checks)
                assert on_launches == ["block+gdn", "block+gdn", "block"], on_launches
                assert off_launches == ["gdn", "block", "gdn", "block", "block"], off_launches
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["moe_decode_block_gdn"] == (True, "passed")
        # (The GPU test's check: _kernel_choice's key has the GD step's key,
        # heads first, at index 13.)
        took = [any(len(k) > 13 and k[13][0] == (4, 8, 32, 128) and v[4] is not None
                    for k, v in layer.mlp._choices.items()) for layer in models[0].layers]
        assert took == [True, True, False], took
        # With the block's GD build unavailable (as without
        # QAB_UNVERIFIED_KERNELS while it is unverified), the deferred step
        # runs in its own launch first: the same logits.
        monkeypatch.setattr(moe_ops, "_decode_block_gdn_object", lambda backend: None)
        for layer in models[0].layers:
            layer.mlp.__dict__.pop("_choices", None)
        launches.clear()
        tok = mx.array([[11]])
        a, b = (m(tok, cache=c) for m, c in zip(models, caches))
        assert mx.array_equal(a, b).item()
        assert launches == ["gdn", "block", "gdn", "block", "block"] * 2, launches
    finally:
        mx.enable_compile()
        device.reset_self_checks()
        norm_ops._kernel_object.cache_clear()


def _same_buffer(a: mx.array, b: mx.array) -> bool:
    """Whether two evaluated arrays are views of the same memory (same first element)."""
    def at(x):
        return np.asarray(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
                          ).__array_interface__["data"][0]
    return at(a) == at(b)


@pytest.mark.slow
def test_fused_model_reads_the_router_and_shared_expert_from_one_pack_emulated(monkeypatch):
    # moe-block-pack on the emulated fused model of the test above (two Gated
    # DeltaNet layers, a stock attention one; eager decode inside
    # serial_decode_trace, as the compiled decode step traces): every layer's
    # block reads its router, shared expert and experts from one BlockPack (GD
    # build in the GDN layers, the plain one after the stock attention), and
    # the logits and the conv and recurrent states (written in place by the
    # packed GD build, into the cache's own arrays) equal the model with
    # moe-block-pack off bit for bit. Outside that trace the block runs
    # unpacked. A router array replaced in both models (as load_weights does)
    # makes the next call build a new pack from it: the same logits again.
    one_schedule(monkeypatch)
    from mlx_lm.models.cache import make_prompt_cache

    from qwen_apple_backend.layers.moe import BlockPack
    from qwen_apple_backend.ops import norm as norm_ops

    _fake_cuda_gdn_block_preset(monkeypatch)
    launches = []
    real_block = moe_ops._moe_decode_block_call

    def block(*a, **k):  # pack, gdn_step: keyword or positional
        given = inspect.signature(real_block).bind(*a, **k).arguments
        pack, step = given.get("pack"), given.get("gdn_step")
        launches.append(("block" if step is None else "block+gdn")
                        + ("" if pack is None else "+pack"))
        return real_block(*a, **k)

    monkeypatch.setattr(moe_ops, "_moe_decode_block_call", block)
    device.reset_self_checks()
    mx.disable_compile()
    try:
        models = _fused_pair("gdn-block", "moe-block-pack", seed=3,
                             disable=["decode-compile", "attn"])
        caches = [make_prompt_cache(m) for m in models]

        def step(t, serial=True, compiled=False, check=False):
            tok = mx.array([[(t * 53 + 7) % 500]])
            got = []
            for m, c in zip(models, caches):
                launches.clear()
                states = [(e[0], e[1]) for e in c[:2]]
                if serial or check:  # (as the compiled decode step before it traces)
                    for layer in m.layers:
                        layer.mlp.prepare_block_pack()
                with (serial_decode_trace(compiled) if serial else
                      moe_ops.pack_check_pass() if check else contextlib.nullcontext()):
                    got.append(m(tok, cache=c))
                mx.eval(got[-1])
                got.append(list(launches))
                got.append(states)
            (on, on_launches, on_states), (off, off_launches, _) = got[:3], got[3:]
            assert mx.array_equal(on, off).item(), f"token {t}: rel-L2 {mx_rel_l2(on, off):.3g}"
            for layer, (a, b) in enumerate(zip(caches[0][:2], caches[1][:2])):
                assert mx.array_equal(a[0], b[0]).item(), f"token {t} layer {layer} conv state"
                assert mx.array_equal(a[1], b[1]).item(), f"token {t} layer {layer} state"
                assert a[1].dtype == mx.float32
                if serial and t >= 1 and "+pack" in on_launches[0]:
                    # Written in place: the cache keeps the buffers it had.
                    assert _same_buffer(a[0], on_states[layer][0]), on_launches
                    assert _same_buffer(a[1], on_states[layer][1]), on_launches
            return on_launches, off_launches

        for t in range(3):
            on_launches, off_launches = step(t)
            if t >= 1:  # (the first token also runs the self-checks)
                assert on_launches == ["block+gdn+pack", "block+gdn+pack", "block+pack"]
                assert off_launches == ["block+gdn", "block+gdn", "block"], off_launches
            if t == 1:
                kept = [layer.mlp.__dict__["_block_pack"] for layer in models[0].layers]
        # The packs outlive the calls (no packing per token).
        assert [layer.mlp.__dict__["_block_pack"] for layer in models[0].layers] == kept
        # Outside the compiled step's trace: unpacked, the same logits and states.
        on_launches, _ = step(3, serial=False)
        assert on_launches == ["block+gdn", "block+gdn", "block"], on_launches
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["moe_decode_block_gdn_pack"] == (True, "passed")
        assert verdicts["moe_decode_block_pack"] == (True, "passed")
        # Inside mx.compile's trace (serial_decode_compiling) no self-check can
        # run: a packed build not checked for the call's shape class is left
        # out (PackCheckDue, counted), the block runs unpacked; an eager call
        # inside pack_check_pass runs the checks (and the unpacked build);
        # then the trace runs packed.
        checks = device._RESULTS
        for k in [k for k in checks if k[0].endswith("_pack")]:
            del checks[k]
        due = moe_ops.pack_checks_due()
        on_launches, _ = step(5, compiled=True)
        assert on_launches == ["block+gdn", "block+gdn", "block"], on_launches
        assert moe_ops.pack_checks_due() == due + 3
        assert not any(k[0].endswith("_pack") for k in device.self_check_results())
        on_launches, _ = step(6, serial=False, check=True)
        # (each shape class's check launches its packed build once; the
        # layers' own launches are unpacked: the last one, the plain block)
        assert on_launches[-1] == "block", on_launches
        packed = [x for x in on_launches if "+pack" in x]
        classes = [k for k in device.self_check_results() if k[0].endswith("_pack")]
        assert set(packed) == {"block+gdn+pack", "block+pack"}
        assert len(packed) == len(classes), (packed, classes)
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["moe_decode_block_gdn_pack"] == (True, "passed")
        assert verdicts["moe_decode_block_pack"] == (True, "passed")
        on_launches, _ = step(7, compiled=True)
        assert on_launches == ["block+gdn+pack", "block+gdn+pack", "block+pack"], on_launches
        assert moe_ops.pack_checks_due() == due + 3
        packs = [layer.mlp.__dict__.get("_block_pack") for layer in models[0].layers]
        assert all(type(p) is BlockPack and p.valid(layer.mlp)
                   for p, layer in zip(packs, models[0].layers))
        assert all(layer.mlp.__dict__.get("_block_pack") is None for layer in models[1].layers)
        # A replaced array: the pack is no longer valid; the next call packs anew.
        for m in models:
            g = m.layers[1].mlp.gate
            g.scales = g.scales * 1.5
        assert not packs[1].valid(models[0].layers[1].mlp)
        on_launches, _ = step(4)
        assert on_launches == ["block+gdn+pack", "block+gdn+pack", "block+pack"], on_launches
        fresh = models[0].layers[1].mlp.__dict__["_block_pack"]
        assert fresh is not packs[1] and fresh.valid(models[0].layers[1].mlp)
        assert not mx.array_equal(fresh.cat["pk"], packs[1].cat["pk"]).item()
        # The compiled decode step builds (or rebuilds) every pack before it
        # traces (never inside a trace) and takes them among its inputs.
        from qwen_apple_backend.decode import _CompiledDecode

        mlps = [layer.mlp for layer in models[0].layers]
        for mlp in mlps:
            mlp.__dict__.pop("_block_pack")
        g = mlps[0].shared_expert.down_proj
        g.biases = g.biases + 0.0  # replaced after the first pack below
        step = _CompiledDecode(models[0].language_model, lambda *a, **k: None)
        step._build()
        built = [mlp.__dict__["_block_pack"] for mlp in mlps]
        assert all(type(p) is BlockPack and p.valid(m) for p, m in zip(built, mlps))
        assert [c for c in step._uses if type(c) is BlockPack] == built
        g.biases = g.biases + 0.0
        assert not step._still_valid()
        step._build()
        assert mlps[0].__dict__["_block_pack"] is not built[0]
        assert mlps[1].__dict__["_block_pack"] is built[1]
        assert step._still_valid()
        # Not where the block does not run packed.
        models[1].layers[0].mlp.block_pack = True
        assert models[1].layers[0].mlp.prepare_block_pack() is not None
        mlps[2].block_pack = False
        assert mlps[2].prepare_block_pack() is None
    finally:
        mx.enable_compile()
        device.reset_self_checks()
        norm_ops._kernel_object.cache_clear()


# --------------------------------------------------------------------------
# A decode token's quantized embedding rows (kernels/cuda/embedding_dequantize.cu)
# --------------------------------------------------------------------------

# (V, D, bits, group, dtype, ids dtype, ids shape): 4-bit bf16 with uint32 ids
# (an argmax's), 8-bit f16 with int32 ids in a [2, 3] batch, float32 at
# group 32 with a row width that is not a multiple of the block.
EMBED_EMU_CASES = [(300, 1024, 4, 64, BF16, mx.uint32, (1, 1)),
                   (97, 512, 8, 64, F16, mx.int32, (2, 3)),
                   (7, 96, 4, 32, F32, mx.int32, (5,))]


@pytest.mark.parametrize("case", EMBED_EMU_CASES, ids=lambda c: "-".join(map(str, c[:5])))
def test_embedding_dequantize_is_mlx_s_gathers_and_dequantize_emulated(case):
    # The one launch equals mlx-lm's QuantizedEmbedding (three gathers and a
    # dequantize) bit for bit (with more than two ids, the table's first and
    # last rows among them); a negative id wraps as MLX's gather wraps it, an
    # id past the table reads its last row.
    V, D, bits, gs, dtype, id_dtype, shape = case
    k = mx.random.split(mx.random.key(V + D), 2)
    table = mx.random.normal((V, D), key=k[0]).astype(dtype)
    w, s, b = mx.quantize(table, group_size=gs, bits=bits)
    ids = mx.random.randint(0, V, shape, key=k[1])
    ids = ids.reshape(-1)
    ids = mx.concatenate([mx.array([0, V - 1]), ids[2:]]).reshape(shape).astype(id_dtype) \
        if ids.size > 2 else ids.reshape(shape).astype(id_dtype)
    out = lin_ops.embedding_dequantize_kernel(ids, w, s, b, gs, bits)
    ref = lin_ops.embedding_dequantize_ops(ids, w, s, b, gs, bits)
    assert out.shape == (*shape, D) and out.dtype == dtype
    assert mx.array_equal(out, ref).item(), f"rel-L2 {mx_rel_l2(out, ref):.3g}"
    past = lin_ops.embedding_dequantize_kernel(mx.array([V + 5], dtype=mx.int32), w, s, b, gs,
                                               bits)
    assert mx.array_equal(past, lin_ops.embedding_dequantize_ops(
        mx.array([V - 1]), w, s, b, gs, bits)).item()
    neg = mx.array([-1, -V], dtype=mx.int32)
    assert mx.array_equal(lin_ops.embedding_dequantize_kernel(neg, w, s, b, gs, bits),
                          lin_ops.embedding_dequantize_ops(neg, w, s, b, gs, bits)).item()


def test_embedding_dequantize_emulated_fails_with_the_wrong_group(monkeypatch):
    # A group index off by one word is caught by the exact comparison.
    _broken(monkeypatch, "embedding_dequantize", "(size_t)(j * PER) / G;",
            "(size_t)(j * PER + PER) / G;")
    w, s, b = mx.quantize(mx.random.normal((9, 256), key=mx.random.key(1)).astype(BF16),
                          group_size=32, bits=4)
    ids = mx.array([[3]], dtype=mx.uint32)
    out = lin_ops.embedding_dequantize_kernel(ids, w, s, b, 32, 4)
    assert not mx.array_equal(out, lin_ops.embedding_dequantize_ops(ids, w, s, b, 32, 4)).item()


def test_quantized_embedding_decodes_on_the_emulated_kernel(monkeypatch):
    # embed-kernel: the fused model's QuantizedEmbedding, given the class
    # DecodeQuantizedEmbedding, runs a decode token's lookup as the one
    # launch after its self-check (on a faked CUDA device) with the same
    # values as the stock module; a prompt-sized lookup, training mode and a
    # failed self-check keep the stock path.
    from qwen_apple_backend.layers.linear import (DecodeQuantizedEmbedding,
                                                  install_embedding_kernel)

    monkeypatch.setattr(lin_ops, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("QAB_DISABLE_KERNELS", raising=False)
    calls = []
    real = lin_ops.embedding_dequantize_kernel
    monkeypatch.setattr(lin_ops, "embedding_dequantize_kernel",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    device.reset_self_checks()
    try:
        emb = nn.Embedding(200, 512)
        emb.weight = mx.random.normal((200, 512), key=mx.random.key(2)).astype(BF16)
        q = nn.QuantizedEmbedding.from_embedding(emb, group_size=64, bits=4)
        stock = nn.QuantizedEmbedding.from_embedding(emb, group_size=64, bits=4)
        q.eval()  # (a new module is in training mode; mlx-lm's loaded models are not)
        holder = nn.Module()
        holder.model = nn.Module()
        holder.model.embed_tokens = q
        assert install_embedding_kernel(holder) and type(q) is DecodeQuantizedEmbedding
        assert not install_embedding_kernel(holder)  # (already swapped)
        tok = mx.array([[17]], dtype=mx.uint32)
        assert mx.array_equal(q(tok), stock(tok)).item()
        assert calls == [(2, 32), (1, 1)]  # the self-check's ids, then the token's
        verdicts = {k[0]: v for k, v in device.self_check_results().items()}
        assert verdicts["embedding_dequantize"] == (True, "passed")
        prompt = mx.arange(70).reshape(1, 70)
        assert mx.array_equal(q(prompt), stock(prompt)).item() and len(calls) == 2
        q.train()
        assert mx.array_equal(q(tok), stock(tok)).item() and len(calls) == 2
        q.eval()
        # A kernel that fails its self-check is never used: the stock values.
        device.reset_self_checks()
        q.__dict__.pop("_qab_embed_verdicts")
        monkeypatch.setattr(lin_ops, "embedding_dequantize_kernel",
                            lambda *a, **k: calls.append("bad") or real(*a, **k) + 1)
        with pytest.warns(device.KernelSelfCheckWarning, match="embedding_dequantize"):
            assert mx.array_equal(q(tok), stock(tok)).item()
        assert calls[2:] == ["bad"]
    finally:
        device.reset_self_checks()


def _load_layer_profiler(monkeypatch):
    """benchmarks/profile_layer_gpu.py as a fresh module (its folder on sys.path)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_layer_gpu.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location("profile_layer_gpu", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _layer_profiler(monkeypatch):
    """benchmarks/profile_layer_gpu.py at a small shape its kernel accepts (H
    and Hv Dv multiples of 1,024), on the emulator."""
    m = _load_layer_profiler(monkeypatch)
    heads = (2, 8, 32, 128)
    for name, value in (("H", 1024), ("E", 16), ("I", 64), ("K", 2), ("HEADS", heads),
                        ("PN", 2 * heads[0] * heads[2] + 2 * heads[1] * heads[3] + 2 * heads[1])):
        monkeypatch.setattr(m, name, value)
    monkeypatch.setattr(mx.fast, "cuda_kernel", emu.emulated_cuda_kernel)
    monkeypatch.setenv("QAB_UNVERIFIED_KERNELS", "1")
    return m


@pytest.mark.slow
def test_layer_profiler_chains_packed_and_unpacked_layers_emulated(monkeypatch):
    # profile_layer_gpu.py's chain: two distinct Gated DeltaNet layers, each
    # launch's output and next projection the next launch's inputs; the
    # packed build (default) and the unpacked GD build (PACK=0) give the same
    # four outputs bit for bit; a variant whose output differs is named; the
    # timing rows and the byte count are filled in. A variant with a text
    # prefix (SLEEP=0; the timeline's marks) builds its own kernel object
    # from the op's text with the prefix and the marks indexed by the
    # absolute ticket (the GDN items' relative one is negative).
    one_schedule(monkeypatch)
    m = _layer_profiler(monkeypatch)
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or object())
    v = m.Variant(*m.split_variant("SLEEP=0+PACK=0"), stamps=7)
    v.kernel("#define QAB_WAIT_SLEEP_NS 0\n")
    (kw,) = made
    assert kw["output_names"][-1] == "stamps" and "gd_state" in kw["input_names"]
    assert "pk" not in kw["input_names"]  # the unpacked GD build
    assert "#define QAB_WAIT_SLEEP_NS 0" in kw["header"]
    assert "(size_t)ticket * 16" in kw["header"] and "(size_t)tk" not in kw["header"]
    # The sub-step marks write through the row QAB_MARK(0) points to.
    assert "#define QAB_SUBMARK(k)" in kw["header"] and "qab_mark_row_" in kw["header"]
    monkeypatch.setattr(mx.fast, "cuda_kernel", emu.emulated_cuda_kernel)
    layers = [m.build_layer(100 + i) for i in range(2)]
    kx, kp = mx.random.split(mx.random.key(3))
    x = (4.0 * mx.random.normal((1, 1, m.H), key=kx)).astype(mx.bfloat16)
    proj = mx.random.normal((1, 1, m.PN), key=kp).astype(mx.bfloat16)
    variants = [(v, m.Variant(*m.split_variant(v))) for v in ("default", "PACK=0")]
    assert [v.packed for _, v in variants] == [True, False]
    m.check_variants(variants, layers[0], x, proj)
    # The check runs each variant on private states: the layer's are unchanged.
    assert mx.array_equal(layers[0].state, m.build_layer(100).state).item()
    rows = m.chain_times(variants, layers, x, proj, chain=3, reps=1)
    assert [r["variant"] for r in rows] == ["default", "PACK=0"]
    assert all(r["us_per_launch"] > 0 and r["gb_per_s"] > 0 for r in rows)
    lay = layers[0]
    experts = sum(a.nbytes for w in (lay.gate_up, lay.down)
                  for a in (w.weight, w.scales, w.biases)) * m.K // m.E
    assert m.layer_bytes(lay) > experts + lay.next_proj.weights.weight.nbytes + 2 * lay.state.nbytes
    real = m.launch

    def broken(variant, layer, x, proj, counter):
        out = real(variant, layer, x, proj, counter)
        return out if variant.packed else (out[0], out[1] + 1, *out[2:])

    with pytest.raises(SystemExit, match=r"variant PRW=8: DECODE_BLOCK_OPTIONS: PRW \(the next "
                                         r"projection's rows per warp\) must be 1, 2 or 4"):
        m.check_variants([variants[0], ("PRW=8", m.Variant({"PRW": 8}, True))],
                         layers[0], x, proj)
    # (The command line refuses those before building anything.)
    # PF=1 (l2-prefetch's build, asking the L2 for the next projection's
    # arrays): the same four outputs.
    pf = m.Variant(*m.split_variant("PF=1"))
    assert pf.opts == {"PF": True} and pf.packed
    m.check_variants([variants[0], ("PF=1", pf)], layers[0], x, proj)
    # PIN=1 (a kernel-text key: the loads used before each wait): the same
    # outputs. (Unpacked: a variant's own kernel object does not declare the
    # packed build's in-place writes, which the emulator then drops.)
    pin = m.Variant(*m.split_variant("PIN=1+PACK=0"))
    m.check_variants([variants[1], ("PIN=1+PACK=0", pin)], layers[0], x, proj)
    # MANT=1 (QAB_NIBBLE_MANTISSA: the experts' and the router's quantized
    # weights made floats through a float's mantissa): the same outputs.
    mant = m.Variant(*m.split_variant("MANT=1+PACK=0"))
    assert ("#define QAB_NIBBLE_MANTISSA 1"
            in sys.modules["profile_moe_block_gpu"].build_prefix(mant.opts))
    m.check_variants([variants[1], ("MANT=1+PACK=0", mant)], layers[0], x, proj)
    # PS=1 (QAB_Q4_PRESCALE: every 4-bit dot's inputs prescaled so that each
    # nibble is masked in place): the same outputs.
    ps = m.Variant(*m.split_variant("PS=1+PACK=0"))
    assert ("#define QAB_Q4_PRESCALE 1"
            in sys.modules["profile_moe_block_gpu"].build_prefix(ps.opts))
    m.check_variants([variants[1], ("PS=1+PACK=0", ps)], layers[0], x, proj)
    for text, msg in (("PRW=8", "PRW must be one of 1, 2, 4, got 8"),
                      ("GRPW=3+PACK=0", "GRPW must be one of 1, 2, 4, got 3"),
                      ("PACK=2", "PACK is a flag"), ("PF=2", "PF is a flag"),
                      ("PF=1+EARLY=0", "PF needs EARLY"),
                      ("PRW=4+PRW=2", "PRW given twice")):
        with pytest.raises(ValueError, match=msg):
            m.split_variant(text)
    monkeypatch.setattr(m, "launch", broken)
    with pytest.raises(SystemExit, match="variant PACK=0: its next projection differs from "
                                         "default's"):
        m.check_variants(variants[:2], layers[0], x, proj)


def test_layer_profiler_phase_bounds_and_summary(monkeypatch):
    # The six phases' ticket bounds end at the op's own grid (at Qwen3.6's
    # shape, and with another GRPW), and the timeline summary reads each
    # phase's marks: starts, wait ends (a phase without a wait mark: its
    # start), work ends, blocks started within 1 us.
    m = _load_layer_profiler(monkeypatch)
    for opts in ({}, {"GRPW": 4}, {"PRW": 4}, {"PSM": 64}):
        bounds = m.phase_bounds(opts)
        want = moe_ops._decode_block_launch(m.E, m.H, m.I, m.K, grpw=opts.get("GRPW"),
                                            out_proj=True, next_rows=m.PN,
                                            gdn_heads=m.HEADS[1], prw=opts.get("PRW"),
                                            psm=opts.get("PSM"))[2]
        assert bounds[0] == 0 and bounds[-1] == want and len(bounds) == 7
    assert m.phase_bounds({})[1:3] == [32, 160]  # 32 GDN heads, 128 out-projection blocks
    # 772 next-projection blocks of 16 rows; 386 of 32 with PRW 4; 193 of 64
    # with PSM 64.
    assert [b[-1] - b[-2] for b in (m.phase_bounds({}), m.phase_bounds({"PRW": 4}),
                                    m.phase_bounds({"PSM": 64}))] == [772, 386, 193]
    # Two phases of two tickets each: [start, wait end, work end, mark 3, SM] in ns.
    launch = [[1000, 0, 5000, 0, 0], [1500, 0, 6000, 0, 1],
              [1200, 7000, 9000, 0, 2], [3000, 8000, 12000, 0, 3]]
    got = m.summarize_phases([launch, launch], [0, 2, 4])
    assert got["gdn"] == {"start_first": 0.0, "start_median": 0.5, "wait_end_median": 0.5,
                          "wait_end_last": 0.5, "work_end_median": 5.0, "work_end_p90": 5.0,
                          "work_end_last": 5.0, "blocks": 2, "started_1us": 2}
    assert got["out-proj"]["wait_end_median"] == 7.0 and got["out-proj"]["work_end_last"] == 11.0
    assert got["out-proj"]["started_1us"] == 1
    # Mark 3 (the route's logits counted; the down items' gate/up wait end),
    # where a phase's tickets set it.
    launch[2][3], launch[3][3] = 8500, 10000
    got = m.summarize_phases([launch, launch], [0, 2, 4])
    assert "mark3_median" not in got["gdn"]
    assert (got["out-proj"]["mark3_median"], got["out-proj"]["mark3_last"]) == (9.0, 9.0)
    # Sub-step marks (the timeline build's rows are STAMP_WIDTH wide): per
    # mark its name (profile_moe_block_gpu.SUBMARKS) and its own median over
    # the items that set it, in time order; a mark no item set is left out,
    # and a phase without any has no "sub". Work ends: the median and 90th
    # percentile (nearest rank: the 9th of ten) item's too (ten items ending
    # 1..10 us after the first ticket).
    width = sys.modules["profile_moe_block_gpu"].STAMP_WIDTH
    wide = [row + [0] * (width - 5) for row in launch]
    wide[2][5], wide[3][5] = 7500, 8500   # out-proj: staged
    wide[2][6], wide[3][6] = 8000, 11000  # dots
    wide[2][11] = 9500                    # counted (one item)
    got = m.summarize_phases([wide, wide], [0, 2, 4])
    assert "sub" not in got["gdn"]
    assert got["out-proj"]["sub"] == {"5 staged": 7.5, "6 dots": 10.0, "11 counted": 8.5}
    ten = [[1000, 0, 1000 + 1000 * (i + 1), 0, 0] for i in range(10)]
    got = m.summarize_phases([ten], [0, 10])
    assert (got["gdn"]["work_end_median"], got["gdn"]["work_end_p90"],
            got["gdn"]["work_end_last"]) == (6.0, 9.0, 10.0)


def test_layer_profiler_chain_spans(monkeypatch):
    # The warm timeline's GPU-only chain timing, from every launch's marks:
    # a launch spans its first ticket to its last mark of any kind (a work
    # end, a count, a sub-step mark; never the SM column, 4, nor an unset 0),
    # the period is the first tickets' spacing, the gap a launch's last mark
    # to the next one's first ticket; medians over the chains, in us.
    m = _load_layer_profiler(monkeypatch)

    def launch(t0, last, sm=10 ** 12):
        # Two tickets; the second's last mark is a sub-step mark (index 6)
        # and its SM column is huge, to show it is not taken for a time.
        return [[t0, 0, t0 + 3000, 0, 0, 0, 0], [t0 + 500, 0, t0 + 2000, 0, sm, 0, last]]

    chain = [launch(1000, 51_000), launch(61_000, 116_000), launch(131_000, 171_000)]
    assert m.launch_spans(chain) == ([1000, 61_000, 131_000], [51_000, 116_000, 171_000])
    got = m.chain_spans([chain, chain])
    # period (131 - 1) / 2 = 65 us; spans 50, 55, 40 (median 50); gaps 10, 15 (median 12.5)
    assert got == {"period": 65.0, "span": 50.0, "gap": 12.5, "chains": 2}
    slower = [launch(1000, 51_000), launch(71_000, 126_000), launch(151_000, 191_000)]
    got = m.chain_spans([chain, slower, slower])
    assert (got["period"], got["gap"]) == (75.0, 22.5)  # its gaps 20 and 25
