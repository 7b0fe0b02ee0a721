"""Dense 4-bit GEMV for decode: ``lm_head`` (and any projection this large) at batch 1.

At decode, every projection of the model is a matrix-vector product over
4-bit weights. The kernel ``kernels/cuda/quantized_gemv.cu`` keeps every
16-byte weight load of a pass in flight before computing, stages the
activations once per thread block in shared memory, and turns nibbles into
floats without conversion instructions. Measured on an H200
(``benchmarks/profile_decode_kernels.py``): on ``lm_head`` (254 MB) it
streams 1.9 TB/s against MLX's 0.96 TB/s; on the 1-13 MB projections both
are bound by fixed per-call cost and MLX's own kernel is as fast or faster,
so only matrices of at least :data:`GEMV_MIN_BYTES` take it, and only
``lm_head`` is routed here (``layers/linear.py``): in the one same-run decode
measurement where every projection went through this dispatcher, decode at
4K was slower with it on (55 vs 74 tokens/s, one sample each). The kernel
has since been rewritten (loads in flight before any arithmetic) and under
Nsight Compute takes less GPU time than MLX's ``qmv`` at every decode
projection shape of Qwen3.6-35B-A3B (``benchmarks/profile_gemv_gpu.py``),
but routing the concatenated input projections through it (``proj-gemv``,
opt-in, ``min_bytes=0``) still measured 4 % slower at 4K on the H200: a
custom kernel's launch costs the host more, and 4K decode is host-bound.

Only CUDA has a kernel: MLX's Metal ``qmv`` already streams near bandwidth.
Like every kernel of this package, it is used only after its self-check
against ``mx.quantized_matmul`` (see :mod:`qwen_apple_backend.ops.device`).
That check evaluates arrays, so it cannot run inside ``mx.compile``: callers
run :func:`gemv_ready` (or :func:`prepare`) outside any trace first, as
``layers.linear.DecodeQuantizedLinear`` does; :func:`quantized_matmul` itself only reads the
cached verdict and otherwise takes MLX's path.

This module imports only ``mlx``, the standard library and this package's
``envs`` / ``ops.device``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from .. import envs
from .device import (build_kernel, cuda_sm_count, f32_scalar, gpu_backend, padded_zeros,
                     self_check_passed, self_checked)

__all__ = [
    "GEMV_MAX_ROWS",
    "gemv_launch",
    "gemv_ready",
    "gemv_supported",
    "is_plain_quantized_linear",
    "linear",
    "norm_gemv",
    "norm_gemv_kernel",
    "norm_gemv_ready",
    "norm_gemv_supported",
    "prepare",
    "quantized_gemv_kernel",
    "quantized_matmul",
]

#: Most rows (tokens x batch) the GEMV kernel takes; more go to MLX's GEMM.
GEMV_MAX_ROWS = 4
#: Smallest packed weight (bytes) the kernel takes. Measured on an H200
#: (benchmarks/profile_decode_kernels.py, bf16, one row): MLX's quantized
#: matmul and this kernel tie at 6-13 MB (~575 GB/s, both bound by fixed
#: per-call cost), MLX wins below (5.8 vs 16.2 us at 0.5 MB), the kernel wins
#: at lm_head's 254 MB (149 vs 298 us: 1.9 vs 0.96 TB/s).
GEMV_MIN_BYTES = 32 << 20
# Shared memory the kernel stages x in (M * K floats), bytes.
_MAX_SMEM = 32 * 1024
# Warps per thread block and the grid cap (warps walk rows grid-stride).
_WARPS = 8
_MAX_BLOCKS = 1024
_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
#: The default of every ``pipe`` argument here: double-buffered passes (the
#: kernel's PIPE) with a grid of about one resident wave
#: (:data:`PIPE_BLOCKS_PER_SM` blocks per SM). Off: on the H200 it left
#: ``lm_head`` as it was (138.6 vs 137.6 us under ncu); the decoder layers'
#: concatenated projections pass ``pipe=True`` with the opt-in ``gemv-pipe``
#: (16.5 vs 19.4 us at the Gated DeltaNet's in_proj with its norm, 14.4 vs
#: 17.6 at attention's q/k/v; ``benchmarks/profile_gemv_gpu.py``).
GEMV_PIPE = False
#: Thread blocks per SM of a PIPE launch (the kernel at 256 threads and
#: <= 64 registers per thread fits 4 per SM of a 64K-register file).
PIPE_BLOCKS_PER_SM = 4


def gemv_launch(M: int, N: int, K: int, pipe: Optional[bool] = None,
                sms: Optional[int] = None, rpw: Optional[int] = None,
                blocks_per_sm: Optional[int] = None) -> dict:
    """Launch parameters of the GEMV kernel for ``y[M, N] = x[M, K] W[N, K]^T``.

    Args:
        M, N, K (int): rows of x, output columns (rows of W), input size.
        pipe (bool | None): double-buffered passes; None: :data:`GEMV_PIPE`.
        sms (int | None): SMs of the device for the PIPE grid; None:
            :func:`~qwen_apple_backend.ops.device.cuda_sm_count` (0 = unknown:
            the grid is capped at 1,024 blocks only).
        rpw (int | None): row sets per warp pass instead of the rule below
            (profiling; the grid follows).
        blocks_per_sm (int | None): the PIPE grid's blocks per SM instead of
            :data:`PIPE_BLOCKS_PER_SM` (profiling).

    Returns:
        dict: ``LPR`` (lanes per row: the largest power of two <= 32
        dividing ``K / 32``), ``RPW`` (row sets per warp pass, more for
        taller matrices so a pass keeps more loads in flight; with PIPE one
        fewer step, since two passes are in flight), ``PIPE``, ``blocks``,
        ``threads`` (per block). Without PIPE the grid covers every row in
        one pass up to 1,024 blocks; with it, at most
        :data:`PIPE_BLOCKS_PER_SM` blocks per SM (every warp walks several
        passes, their loads one pass ahead of the arithmetic).
    """
    pipe = GEMV_PIPE if pipe is None else bool(pipe)
    nc = K // 32
    lpr = 32
    while nc % lpr:
        lpr //= 2
    sub = 32 // lpr
    if rpw is None:
        if pipe:
            rpw = 1 if N <= 32768 else 2
        else:
            rpw = 1 if N <= 4096 else (2 if N <= 32768 else 4)
    rows_per_block = _WARPS * sub * rpw
    cap = _MAX_BLOCKS
    if pipe:
        sms = cuda_sm_count() if sms is None else sms
        if sms > 0:
            cap = min(cap, (blocks_per_sm or PIPE_BLOCKS_PER_SM) * sms)
    blocks = max(1, min(cap, -(-N // rows_per_block)))
    return {"LPR": lpr, "RPW": rpw, "PIPE": pipe, "blocks": blocks, "threads": 32 * _WARPS}


def _gemv_contract(M: int, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                   group_size: int, bits: int, mode: str, dtype: mx.Dtype, min_bytes: int) -> bool:
    if (bits != 4 or mode != "affine" or biases is None or not group_size or group_size % 32
            or dtype not in _DTYPES or w.dtype != mx.uint32 or w.ndim != 2):
        return False
    N, K = w.shape[0], w.shape[1] * 8
    return (0 < M <= GEMV_MAX_ROWS and w.nbytes >= min_bytes and K % 32 == 0
            and K % group_size == 0 and M * K * 4 <= _MAX_SMEM and N >= 32
            and scales.shape == (N, K // group_size) and biases.shape == scales.shape)


def gemv_supported(M: int, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                   group_size: int, bits: int, mode: str, dtype: mx.Dtype) -> bool:
    """Whether the kernel's contract covers this call (no backend check).

    4-bit affine weights ``[N, K / 8]`` uint32 of at least
    :data:`GEMV_MIN_BYTES` (in practice ``lm_head``) with scales and biases
    ``[N, K / group_size]``, ``group_size % 32 == 0``, ``K % 32 == 0``, at most
    :data:`GEMV_MAX_ROWS` rows whose float copy fits 32 KB of shared memory,
    activations float32 / bfloat16 / float16.
    """
    return _gemv_contract(M, w, scales, biases, group_size, bits, mode, dtype, GEMV_MIN_BYTES)


def norm_gemv_supported(M: int, norm_weight: mx.array, w: mx.array, scales: mx.array,
                        biases: Optional[mx.array], group_size: int, bits: int, mode: str,
                        dtype: mx.Dtype) -> bool:
    """Whether the norm + GEMV launch's contract covers this call (no backend check).

    :func:`gemv_supported`'s contract at any weight size (the launch it saves
    is worth more than the bandwidth MLX's ``qmv`` may win on a small matrix;
    see :func:`norm_gemv`), with the RMSNorm weight ``[K]`` of the
    activations' dtype.
    """
    K = w.shape[1] * 8 if w.ndim == 2 else -1
    return (norm_weight.shape == (K,) and norm_weight.dtype == dtype
            and _gemv_contract(M, w, scales, biases, group_size, bits, mode, dtype, 0))


@functools.lru_cache(maxsize=None)
def _gemv_object(backend: str):
    return build_kernel("quantized_gemv", backend)


def quantized_gemv_kernel(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                          group_size: int, norm_weight: Optional[mx.array] = None,
                          eps: float = 0.0,
                          pipe: Optional[bool] = None) -> mx.array:
    """``x @ dequantize(w).T`` on the CUDA GEMV kernel (no self-check, no fallback).

    With ``norm_weight``, ``mx.fast.rms_norm(x, norm_weight, eps) @
    dequantize(w).T`` in the same launch (see :func:`norm_gemv_kernel`).

    Args:
        x (mx.array): ``[..., K]`` float32 / bfloat16 / float16, at most
            :data:`GEMV_MAX_ROWS` rows.
        w (mx.array): ``[N, K / 8]`` uint32, 4-bit affine (MLX layout).
        scales, biases (mx.array): ``[N, K / group_size]``.
        group_size (int): a multiple of 32.
        norm_weight (mx.array | None): ``[K]``, dtype of ``x``: normalise
            ``x`` first. Default None.
        eps (float): the norm's epsilon (with ``norm_weight``).
        pipe (bool | None): the double-buffered build (see
            :func:`gemv_launch`); None: :data:`GEMV_PIPE`. Same output.

    Returns:
        mx.array: ``[..., N]``, dtype of ``x``.

    Raises:
        RuntimeError: when this MLX build or the manifest has no CUDA kernel
            (or it is unverified and ``QAB_UNVERIFIED_KERNELS`` is unset).
    """
    kernel = _gemv_object("cuda")
    if kernel is None:
        raise RuntimeError("no CUDA quantized_gemv kernel (sources, MLX API or verification)")
    K = x.shape[-1]
    N = w.shape[0]
    lead = x.shape[:-1]
    M = x.size // K
    p = gemv_launch(M, N, K, pipe=pipe)
    norm = norm_weight is not None
    # nw when NORM is off: never read, but of x's dtype (MLX caches a CUDA
    # kernel by its template arguments, so every launch of one instantiation
    # passes the same input dtypes).
    nw = norm_weight if norm else padded_zeros(x.dtype)
    (y,) = kernel(
        # x as it is (row-contiguous [..., K] is [M, K] to the kernel): no
        # reshape primitive before the launch either.
        inputs=[x, w, scales, biases, nw, f32_scalar(float(eps))],
        # ST: MLX caches a CUDA kernel by its template arguments alone, so the
        # scales' dtype must be one of them.
        template=[("OutT", x.dtype), ("ST", scales.dtype), ("KD", K), ("N", N), ("G", group_size), ("M", M),
                  ("LPR", p["LPR"]), ("RPW", p["RPW"]), ("NORM", norm), ("PIPE", p["PIPE"])],
        grid=(p["blocks"] * p["threads"], 1, 1), threadgroup=(p["threads"], 1, 1),
        # The callers' shape: no reshape primitive after the launch.
        output_shapes=[(*lead, N)], output_dtypes=[x.dtype])
    return y


def norm_gemv_kernel(x: mx.array, norm_weight: mx.array, eps: float, w: mx.array,
                     scales: mx.array, biases: mx.array, group_size: int,
                     pipe: Optional[bool] = None) -> mx.array:
    """``rms_norm(x) @ dequantize(w).T`` in one CUDA launch (no self-check, no fallback).

    The GEMV kernel with the RMSNorm in its prologue: every thread block
    normalises the (at most :data:`GEMV_MAX_ROWS`) rows of ``x`` itself, with
    ``mx.fast.rms_norm``'s rounding points (float32 sum of squares, the
    normalised value rounded to ``x``'s dtype, then the weight product
    rounded once), and stages the result where the plain kernel stages ``x``.

    Args:
        x (mx.array): ``[..., K]`` un-normalised activations.
        norm_weight (mx.array): RMSNorm weight ``[K]``, dtype of ``x``.
        eps (float): RMSNorm epsilon.
        w, scales, biases, group_size: as :func:`quantized_gemv_kernel`.

    Returns:
        mx.array: ``[..., N]``, dtype of ``x``.

    Raises:
        RuntimeError: as :func:`quantized_gemv_kernel`.
    """
    return quantized_gemv_kernel(x, w, scales, biases, group_size, norm_weight=norm_weight,
                                 eps=eps, pipe=pipe)


def _key(M, w, scales, group_size, dtype, pipe: Optional[bool] = None) -> tuple:
    # pipe: each build (and launch shape) self-checks on its own.
    return (M, int(w.shape[0]), int(w.shape[1]) * 8, group_size, str(dtype), str(scales.dtype),
            bool(GEMV_PIPE if pipe is None else pipe))


def gemv_ready(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
               group_size: int, bits: int = 4, mode: str = "affine", *,
               min_bytes: Optional[int] = None, pipe: Optional[bool] = None) -> Optional[str]:
    """The backend whose GEMV kernel may run ``x @ dequantize(w).T``, or None.

    Call it outside ``mx.compile``: the first call per shape class (rows,
    N, K, group size, dtypes) runs the kernel's self-check on random
    activations with these very weights, against ``mx.quantized_matmul`` on
    float32 activations.

    ``min_bytes``: the smallest packed weight taken (None:
    :data:`GEMV_MIN_BYTES`, i.e. ``lm_head``); the concatenated input
    projections (``proj-gemv``, ``layers/_concat.py``) pass 0. ``pipe``: the
    build to check (see :func:`quantized_gemv_kernel`), keyed apart.

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, all kernels disabled
        (``QAB_DISABLE_KERNELS``), unsupported shapes / quantization, or a failed
        self-check, which also warns).
    """
    if envs.kernels_disabled():
        return None
    M = x.size // x.shape[-1] if x.ndim else 0
    if gpu_backend() != "cuda" or not _gemv_contract(M, w, scales, biases, group_size, bits,
                                                     mode, x.dtype,
                                                     GEMV_MIN_BYTES if min_bytes is None
                                                     else min_bytes):
        return None
    if _gemv_object("cuda") is None:
        return None
    dtype = x.dtype
    K = w.shape[1] * 8

    def make_inputs():
        xs = mx.random.normal((M, K), key=mx.random.key(2718)).astype(dtype)
        return xs, w, scales, biases

    def reference(xs, w_, s_, b_):
        y = mx.quantized_matmul(xs.astype(mx.float32), w_, s_.astype(mx.float32),
                                b_.astype(mx.float32), transpose=True, group_size=group_size,
                                bits=4)
        return [y.astype(dtype)]

    # float32: summation order only. bf16/fp16: the output's own rounding
    # (~3 significant digits) dominates.
    rtol = 1e-4 if dtype == mx.float32 else 1e-2
    ok = self_checked(
        "quantized_gemv", "cuda", _key(M, w, scales, group_size, dtype, pipe),
        kernel=lambda xs, w_, s_, b_: [quantized_gemv_kernel(xs, w_, s_, b_, group_size,
                                                             pipe=pipe)],
        reference=reference, make_inputs=make_inputs, rtol=rtol)
    return "cuda" if ok else None


def norm_gemv_ready(x: mx.array, norm_weight: mx.array, eps: float, w: mx.array,
                    scales: mx.array, biases: Optional[mx.array], group_size: int,
                    bits: int = 4, mode: str = "affine",
                    pipe: Optional[bool] = None) -> Optional[str]:
    """The backend whose one-launch ``rms_norm(x) @ dequantize(w).T`` may run this call, or None.

    Call it outside ``mx.compile``: the first call per shape class (rows, N,
    K, group size, dtypes, eps) self-checks :func:`norm_gemv_kernel` with
    these very weights on seeded random rows and norm weights, against
    ``mx.fast.rms_norm`` followed by ``mx.quantized_matmul`` on the float32
    copy of the normalised rows. Only shapes and dtypes of ``x`` and
    ``norm_weight`` are read.

    Args:
        x (mx.array): the un-normalised activations ``[..., K]`` (or a
            stand-in of their shape and dtype).
        norm_weight (mx.array): RMSNorm weight ``[K]``.
        eps (float): RMSNorm epsilon.
        w, scales, biases, group_size, bits, mode: the quantized projection.
        pipe (bool | None): the build to check (see
            :func:`quantized_gemv_kernel`), keyed apart.

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, kernels disabled,
        outside :func:`norm_gemv_supported`, the kernel unverified without
        ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also warns).
    """
    if envs.kernels_disabled() or not x.ndim:
        return None
    M = x.size // x.shape[-1]
    if gpu_backend() != "cuda" or not norm_gemv_supported(M, norm_weight, w, scales, biases,
                                                          group_size, bits, mode, x.dtype):
        return None
    if _gemv_object("cuda") is None:
        return None
    dtype = x.dtype
    K = w.shape[1] * 8

    def make_inputs():
        k = mx.random.split(mx.random.key(2719), 2)
        xs = (3.0 * mx.random.normal((M, 1, K), key=k[0])).astype(dtype)
        nw = (1.0 + 0.2 * mx.random.normal((K,), key=k[1])).astype(dtype)
        return xs, nw

    def kernel(xs, nw):
        return [norm_gemv_kernel(xs, nw, eps, w, scales, biases, group_size, pipe=pipe)]

    def reference(xs, nw):
        xn = mx.fast.rms_norm(xs, nw, eps)
        y = mx.quantized_matmul(xn.astype(mx.float32), w, scales.astype(mx.float32),
                                biases.astype(mx.float32), transpose=True,
                                group_size=group_size, bits=4)
        return [y.astype(dtype)]

    # As gemv_ready: float32 summation order only; bf16 / fp16 the output's
    # own rounding. The normalised row is the stock norm's up to the order of
    # the float32 sum of squares (an ulp of the activation dtype, rarely).
    rtol = 1e-4 if dtype == mx.float32 else 1e-2
    ok = self_checked("quantized_gemv", "cuda", ("norm", float(eps))
                      + _key(M, w, scales, group_size, dtype, pipe),
                      kernel=kernel, reference=reference, make_inputs=make_inputs, rtol=rtol)
    return "cuda" if ok else None


def norm_gemv(x: mx.array, norm_weight: mx.array, eps: float, w: mx.array, scales: mx.array,
              biases: Optional[mx.array], *, group_size: int, bits: int, mode: str = "affine",
              backend: Optional[str] = None, pipe: Optional[bool] = None) -> mx.array:
    """``mx.quantized_matmul(mx.fast.rms_norm(x, norm_weight, eps), w, ...)``, in one launch with a backend.

    A decoder layer's input RMSNorm and the projection after it (the
    ``norm-proj`` optimization): on MLX's CUDA backend every launch costs the
    host a near-fixed ~10 us at decode, more than this norm costs the GPU
    inside the GEMV. With ``backend`` (what :func:`norm_gemv_ready` returned
    for this call's shape class) :func:`norm_gemv_kernel` (the ``pipe`` build
    that check passed), no self-check here (safe inside ``mx.compile``); with
    None, the two stock operations.

    Shapes: x ``[..., K]``; norm_weight ``[K]``; w ``[N, K * bits / 32]``;
    returns ``[..., N]`` in ``x``'s dtype.
    """
    if backend is not None:
        return norm_gemv_kernel(x, norm_weight, eps, w, scales, biases, group_size, pipe=pipe)
    return mx.quantized_matmul(mx.fast.rms_norm(x, norm_weight, eps), w, scales, biases,
                               transpose=True, group_size=group_size, bits=bits, mode=mode)


def _verdict(M, w, scales, group_size, dtype) -> bool:
    return self_check_passed("quantized_gemv", "cuda", _key(M, w, scales, group_size, dtype))


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                     *, group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)``, on the GEMV kernel when allowed.

    Takes the kernel only when :func:`gemv_ready` has already passed for this
    shape class (this function never self-checks, so it is safe inside
    ``mx.compile``); otherwise MLX's own quantized matmul.

    Shapes: x ``[..., K]``, w ``[N, K * bits / 32]``; returns ``[..., N]``.
    """
    if (bits == 4 and mode == "affine" and biases is not None and x.ndim
            and x.size // x.shape[-1] <= GEMV_MAX_ROWS
            and _verdict(x.size // x.shape[-1], w, scales, group_size, x.dtype)):
        return quantized_gemv_kernel(x, w, scales, biases, group_size)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size,
                               bits=bits, mode=mode)


def is_plain_quantized_linear(m: Any) -> bool:
    """Exactly MLX's ``nn.QuantizedLinear`` (or the lm_head subclass), no global scale, with biases."""
    # Exactly MLX's QuantizedLinear (or the lm_head subclass of layers.linear):
    # a LoRA wrapper or another subclass has its own __call__.
    return ((type(m) is nn.QuantizedLinear or getattr(type(m), "_qab_gemv", False))
            and getattr(m, "global_scale", None) is None and "biases" in m)


def prepare(x: mx.array, *modules: Any) -> None:
    """Run :func:`gemv_ready` for each plain ``nn.QuantizedLinear`` in ``modules``.

    Call outside ``mx.compile`` (it may run self-checks); a no-op for more than
    :data:`GEMV_MAX_ROWS` rows.
    """
    if not x.ndim or x.size // x.shape[-1] > GEMV_MAX_ROWS:
        return
    for m in modules:
        if is_plain_quantized_linear(m):
            gemv_ready(x, m["weight"], m["scales"], m["biases"], m.group_size, m.bits, m.mode)


def linear(module: Any, x: mx.array) -> mx.array:
    """``module(x)``, with a plain 4-bit ``nn.QuantizedLinear`` on the GEMV kernel when allowed.

    Any other module (``nn.Linear``, LoRA wrappers, other quantization
    modes) is simply called. Safe inside ``mx.compile`` (see
    :func:`quantized_matmul`).
    """
    if not is_plain_quantized_linear(module):
        return module(x)
    y = quantized_matmul(x, module["weight"], module["scales"], module["biases"],
                         group_size=module.group_size, bits=module.bits, mode=module.mode)
    if "bias" in module:
        y = y + module["bias"]
    return y


# --------------------------------------------------------------------------
# The token embedding's rows at decode (kernels/cuda/embedding_dequantize)
# --------------------------------------------------------------------------

#: Most token ids one embedding launch takes; more (a prompt) go to MLX's
#: gathers and dequantize.
EMBED_MAX_ROWS = 64
_EMBED_BLOCK = 256
_EMBED_IDS = (mx.int32, mx.uint32)


def embedding_supported(ids: mx.array, w: mx.array, scales: mx.array,
                        biases: Optional[mx.array], group_size: int, bits: int,
                        mode: str = "affine") -> bool:
    """Whether ``embedding_dequantize_kernel`` covers this lookup (no backend check).

    At most :data:`EMBED_MAX_ROWS` int32 / uint32 ids; a 4- or 8-bit affine
    table with biases: ``w [V, D bits / 32]`` uint32, ``scales`` and
    ``biases [V, D / group_size]`` of one float dtype, ``group_size`` a
    multiple of ``32 / bits``.
    """
    if mode != "affine" or bits not in (4, 8) or biases is None or not group_size:
        return False
    if ids.dtype not in _EMBED_IDS or not 0 < ids.size <= EMBED_MAX_ROWS:
        return False
    if w.ndim != 2 or w.dtype != mx.uint32 or scales.ndim != 2 or scales.dtype not in _DTYPES:
        return False
    V, D = w.shape[0], w.shape[1] * 32 // bits
    return (group_size % (32 // bits) == 0 and D % group_size == 0
            and scales.shape == (V, D // group_size) and biases.shape == scales.shape
            and biases.dtype == scales.dtype)


@functools.lru_cache(maxsize=None)
def _embedding_object(backend: str):
    return build_kernel("embedding_dequantize", backend)


def embedding_dequantize_ops(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                             group_size: int, bits: int) -> mx.array:
    """Portable reference (mlx-lm's ``QuantizedEmbedding.__call__``): the rows
    ``dequantize(w[ids], scales[ids], biases[ids])``, ``[*ids.shape, D]``."""
    return mx.dequantize(w[ids], scales=scales[ids], biases=biases[ids], group_size=group_size,
                         bits=bits)


def embedding_dequantize_kernel(ids: mx.array, w: mx.array, scales: mx.array,
                                biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The rows of a quantized embedding for ``ids`` in one CUDA launch.

    ``kernels/cuda/embedding_dequantize``: one thread per packed word, MLX's
    affine dequantize arithmetic (``scale * T(q) + bias`` in the scales'
    dtype), so the output equals :func:`embedding_dequantize_ops` bit for bit
    where the compiler treats that expression as in MLX's own kernel (the
    self-check, :func:`embedding_ready`, requires it). An id in ``[-V, 0)``
    reads row ``id + V`` (as MLX's gather); others outside ``[0, V)`` are
    clamped to the table. No self-check here.

    Args:
        ids (mx.array): token ids, any shape of at most
            :data:`EMBED_MAX_ROWS` elements, int32 or uint32.
        w (mx.array): the packed table ``[V, D * bits / 32]`` uint32.
        scales, biases (mx.array): ``[V, D / group_size]``, float32 /
            bfloat16 / float16.
        group_size (int): quantization group size.
        bits (int): 4 or 8.

    Returns:
        mx.array: ``[*ids.shape, D]``, the scales' dtype.

    Raises:
        ValueError: outside :func:`embedding_supported`.
        RuntimeError: when this MLX build or the manifest has no CUDA kernel
            (or it is unverified and ``QAB_UNVERIFIED_KERNELS`` is unset).
    """
    if not embedding_supported(ids, w, scales, biases, group_size, bits):
        raise ValueError(
            f"embedding_dequantize: ids {ids.shape} {ids.dtype} (at most {EMBED_MAX_ROWS}, "
            f"int32 / uint32) over a {bits}-bit table w {w.shape} {w.dtype}, scales "
            f"{scales.shape} {scales.dtype}, biases "
            f"{None if biases is None else (biases.shape, biases.dtype)}, group size "
            f"{group_size}: not a 4- or 8-bit affine table with biases")
    obj = _embedding_object("cuda")
    if obj is None:
        raise RuntimeError("no CUDA embedding_dequantize kernel (sources, MLX API or "
                           "verification)")
    V, D = w.shape[0], w.shape[1] * 32 // bits
    words = D * bits // 32
    (out,) = obj(inputs=[ids, w, scales, biases],
                 template=[("T", scales.dtype), ("IdT", ids.dtype), ("BITS", int(bits)),
                           ("G", int(group_size)), ("D", int(D)), ("V", int(V)),
                           ("BLOCK", _EMBED_BLOCK)],
                 grid=(_EMBED_BLOCK * -(-words // _EMBED_BLOCK), ids.size, 1),
                 threadgroup=(_EMBED_BLOCK, 1, 1),
                 output_shapes=[(*ids.shape, D)], output_dtypes=[scales.dtype])
    return out


def embedding_ready(ids: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                    group_size: int, bits: int, mode: str = "affine") -> Optional[str]:
    """The GPU backend whose embedding kernel may run this lookup, or None.

    CUDA only (it exists to cut MLX's per-launch host cost: four launches
    become one). Call it outside ``mx.compile``: on the first call per shape
    class (table shape and dtype, group size, bits, the ids' dtype) it
    self-checks :func:`embedding_dequantize_kernel` against
    :func:`embedding_dequantize_ops` with this table, on seeded random ids
    that include its first and last rows, exactly (rtol 0).

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, kernels disabled,
        outside :func:`embedding_supported`, the kernel unverified without
        ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also warns).
    """
    if envs.kernels_disabled() or gpu_backend() != "cuda":
        return None
    if not embedding_supported(ids, w, scales, biases, group_size, bits, mode):
        return None
    if _embedding_object("cuda") is None:
        return None
    V = w.shape[0]

    def make():
        rand = mx.random.randint(0, V, (EMBED_MAX_ROWS - 2,), key=mx.random.key(4345))
        return (mx.concatenate([mx.array([0, V - 1]), rand]).astype(ids.dtype).reshape(2, -1),)

    key = (tuple(w.shape), str(scales.dtype), int(group_size), int(bits), str(ids.dtype))
    ok = self_checked(
        "embedding_dequantize", "cuda", key,
        kernel=lambda i: [embedding_dequantize_kernel(i, w, scales, biases, group_size, bits)],
        reference=lambda i: [embedding_dequantize_ops(i, w, scales, biases, group_size, bits)],
        make_inputs=make, rtol=0.0)
    return "cuda" if ok else None
