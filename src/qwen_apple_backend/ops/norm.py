"""Residual add + RMSNorm in one launch (the ``add-norm`` optimization).

Every decoder layer of mlx-lm's Qwen3.5 / Qwen3-Next models ends its mixer
half with ``h = x + r`` and then ``post_attention_layernorm(h)``: two MLX
operations (an Add and an RMSNorm), each of which costs host-side encode time
on MLX's CUDA backend, where decode at batch 1 is bound by that time rather
than by the GPU. The kernel ``kernels/{cuda,metal}/add_rms_norm.*`` produces
both ``h`` and ``rms_norm(h) * w`` in one launch, one block per row, with
the rounding points of MLX's own two operations (see the kernel files): ``h``
is bit-identical to ``x + r``; ``y`` differs from ``mx.fast.rms_norm(h, w,
eps)`` only through the order of the float32 sum of squares.

Like every kernel of this package it is used only after its self-check
against :func:`add_rms_norm_ops` (:mod:`qwen_apple_backend.ops.device`).
That check evaluates arrays, so it cannot run inside ``mx.compile``: callers
run :func:`add_rms_norm_ready` outside any trace and pass its answer to
:func:`add_rms_norm` (``layers.norm`` caches the answer per layer, so a
traced call only looks it up).

This module imports only ``mlx``, the standard library and this package's
``envs`` / ``ops.device``.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import mlx.core as mx

from .. import envs
from .device import build_kernel, f32_scalar, gpu_backend, self_checked

__all__ = [
    "ADD_RMS_NORM_MAX_D",
    "add_rms_norm",
    "add_rms_norm_kernel",
    "add_rms_norm_launch",
    "add_rms_norm_ops",
    "add_rms_norm_ready",
    "add_rms_norm_supported",
]

#: Longest row the kernel takes (16 elements per thread at 1,024 threads).
ADD_RMS_NORM_MAX_D = 16384
_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
# Elements each thread holds when the block is not capped at 1,024 threads.
_PER_THREAD = 8
# Rows of the self-check's random inputs (the kernel is not specialised on N).
_CHECK_ROWS = 3


def add_rms_norm_ops(x: mx.array, r: mx.array, w: mx.array,
                     eps: float) -> Tuple[mx.array, mx.array]:
    """Portable reference: ``h = x + r`` and ``y = mx.fast.rms_norm(h, w, eps)``.

    Exactly the two operations of mlx-lm's decoder layer (``h = x + r``, then
    ``post_attention_layernorm(h)``).

    Args:
        x (mx.array): residual stream, any float dtype.
        r (mx.array): the mixer's output, broadcastable to ``x``.
        w (mx.array): RMSNorm weight.
        eps (float): RMSNorm epsilon.

    Returns:
        Tuple[mx.array, mx.array]: ``(h, y)``, in MLX's promoted dtypes.

    Shapes:
        - x, r, h, y: [..., D]
        - w: [D]
    """
    h = x + r
    return h, mx.fast.rms_norm(h, w, eps)


@functools.lru_cache(maxsize=None)
def _block(D: int) -> int:
    threads = -(-D // _PER_THREAD)
    return min(1024, max(32, -(-threads // 32) * 32))


def add_rms_norm_launch(D: int) -> dict:
    """Launch parameters of the kernel for rows of ``D`` elements.

    Returns:
        dict: ``BLOCK`` (threads per block: a multiple of 32, enough for about
        8 elements per thread, at most 1,024) and ``PER`` (elements per
        thread, ``ceil(D / BLOCK)``). ``D = 2048``: 256 threads, 8 each.
    """
    block = _block(D)
    return {"BLOCK": block, "PER": -(-D // block)}


def add_rms_norm_supported(D: int, dtype: mx.Dtype, w_dtype: Optional[mx.Dtype] = None) -> bool:
    """Whether the kernel's contract covers rows of ``D`` in ``dtype`` (no backend check).

    ``x``, ``r`` and ``w`` in one dtype (float32, bfloat16 or float16),
    ``1 <= D <=`` :data:`ADD_RMS_NORM_MAX_D`.
    """
    return (dtype in _DTYPES and (w_dtype is None or w_dtype == dtype)
            and 0 < D <= ADD_RMS_NORM_MAX_D)


@functools.lru_cache(maxsize=None)
def _kernel_object(backend: str):
    return build_kernel("add_rms_norm", backend)


def _kernel_call(backend: str, x: mx.array, r: mx.array, w: mx.array,
                 eps: float) -> Tuple[mx.array, mx.array]:
    obj = _kernel_object(backend)
    if obj is None:
        raise RuntimeError(f"no add_rms_norm source or MLX API for {backend}")
    D = x.shape[-1]
    N = x.size // D
    block = _block(D)
    # Outputs take x's shape directly: no reshape operations around the launch.
    # MLX caches a CUDA kernel by its template arguments alone: T fixes the
    # dtype of x, r, w, h and y (eps is always float32).
    h, y = obj(inputs=[x, r, w, f32_scalar(float(eps))],
               template=[("T", x.dtype), ("D", D), ("BLOCK", block)],
               grid=(block * N, 1, 1), threadgroup=(block, 1, 1),
               output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y


def _check(x: mx.array, r: mx.array, w: mx.array) -> None:
    if (x.ndim == 0 or r.shape != x.shape or w.shape != (x.shape[-1],)
            or r.dtype != x.dtype or w.dtype != x.dtype):
        raise ValueError(
            f"add_rms_norm kernel: needs x and r of one shape [..., D] and w [D], all of one "
            f"dtype; got x {x.dtype}{list(x.shape)}, r {r.dtype}{list(r.shape)}, "
            f"w {w.dtype}{list(w.shape)}")


def add_rms_norm_kernel(x: mx.array, r: mx.array, w: mx.array,
                        eps: float) -> Tuple[mx.array, mx.array]:
    """``(x + r, rms_norm(x + r) * w)`` on the GPU kernel (no self-check, no fallback).

    Use it after :func:`add_rms_norm_ready` (as :func:`add_rms_norm` does);
    for tests and benchmarks.

    Args:
        x (mx.array): residual stream, float32 / bfloat16 / float16.
        r (mx.array): added to ``x``; same shape and dtype.
        w (mx.array): RMSNorm weight, same dtype.
        eps (float): RMSNorm epsilon.

    Returns:
        Tuple[mx.array, mx.array]: ``(h, y)``, shape and dtype of ``x``.

    Shapes:
        - x, r, h, y: [..., D], D at most :data:`ADD_RMS_NORM_MAX_D`
        - w: [D]

    Raises:
        RuntimeError: when the default device has no kernel for this op (CPU,
            no source or MLX API, or the CUDA kernel is unverified and
            ``QAB_UNVERIFIED_KERNELS`` is unset).
        ValueError: for shapes or dtypes outside the contract.
    """
    backend = gpu_backend()
    if backend is None or _kernel_object(backend) is None:
        raise RuntimeError(f"no add_rms_norm kernel for device {mx.default_device()} "
                           f"(backend {backend or 'cpu'})")
    _check(x, r, w)
    if not add_rms_norm_supported(x.shape[-1], x.dtype):
        raise ValueError(f"add_rms_norm kernel: D = {x.shape[-1]} in {x.dtype} is not "
                         f"supported (float32/bfloat16/float16, D <= {ADD_RMS_NORM_MAX_D})")
    return _kernel_call(backend, x, r, w, eps)


def _self_check_inputs(D: int, dtype: mx.Dtype, eps: float):
    def make():
        k = mx.random.split(mx.random.key(1618), 3)
        # A residual stream several times larger than the update, a weight near 1.
        x = (4.0 * mx.random.normal((_CHECK_ROWS, D), key=k[0])).astype(dtype)
        r = mx.random.normal((_CHECK_ROWS, D), key=k[1]).astype(dtype)
        w = (1.0 + 0.2 * mx.random.normal((D,), key=k[2])).astype(dtype)
        return x, r, w, eps
    return make


def add_rms_norm_ready(D: int, dtype: mx.Dtype, w_dtype: Optional[mx.Dtype] = None,
                       eps: float = 1e-6) -> Optional[str]:
    """The GPU backend whose kernel may run rows of ``D`` in ``dtype``, or None.

    Call it outside ``mx.compile``: the first call per shape class (``D`` and
    dtype) runs the kernel's self-check against :func:`add_rms_norm_ops` on
    seeded random inputs of 3 rows of ``D`` (the kernel is not specialised on
    the number of rows). Later calls only look the verdict up.

    Args:
        D (int): row length (hidden size).
        dtype (mx.Dtype): dtype of ``x`` and ``r``.
        w_dtype (mx.Dtype, optional): dtype of the weight; must equal ``dtype``
            when given. Default: ``dtype``.
        eps (float): epsilon of the self-check's inputs. Default ``1e-6``.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, all kernels
        disabled by ``QAB_DISABLE_KERNELS``, unsupported ``D`` or dtypes, no
        kernel for the backend, e.g. the unverified CUDA kernel without
        ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also warns
        with a :class:`~qwen_apple_backend.ops.device.KernelSelfCheckWarning`).
    """
    if envs.kernels_disabled() or not add_rms_norm_supported(D, dtype, w_dtype):
        return None
    backend = gpu_backend()
    if backend is None or _kernel_object(backend) is None:
        return None
    # h: one rounding of the same sum, so bit-identical. y: the float32 sum
    # of squares in another order moves the normaliser by an ulp or so, which
    # flips the rounding of a few elements by one ulp of the dtype. Measured on
    # the CPU emulation of the CUDA body against mx.fast.rms_norm on these
    # inputs (D = 2048): bf16 rel-L2 0 (bit-identical), fp16 3.3e-5 (9 of
    # 6,144 elements), float32 2.3e-7. A missing rounding point before the
    # weight multiply measured 2.7e-3 (bf16) and 3.6e-4 (fp16).
    rtol = 1e-5 if dtype == mx.float32 else 3e-4
    ok = self_checked(
        "add_rms_norm", backend, (D, str(dtype)),
        kernel=lambda *a: _kernel_call(backend, *a),
        reference=add_rms_norm_ops,
        make_inputs=_self_check_inputs(D, dtype, eps),
        rtol=rtol)
    return backend if ok else None


def add_rms_norm(x: mx.array, r: mx.array, w: mx.array, eps: float,
                 backend: Optional[str] = None) -> Tuple[mx.array, mx.array]:
    """``h = x + r`` and ``y = mx.fast.rms_norm(h, w, eps)``, on the kernel when given a backend.

    ``backend`` is what :func:`add_rms_norm_ready` returned for these rows
    (decide it outside ``mx.compile``); with it the kernel runs (one launch,
    no self-check here, so safe inside ``mx.compile``), with None (or an
    empty ``x``) :func:`add_rms_norm_ops` does.

    Algorithm: ``h = round(x + r)``; ``inv = rsqrt(mean(float32(h)^2) + eps)``
    (float32); ``y = round(w * round(h * inv))``, the rounding points of MLX's
    Add and ``mx.fast.rms_norm``.

    Args:
        x (mx.array): residual stream.
        r (mx.array): added to ``x``; with a backend, same shape and dtype.
        w (mx.array): RMSNorm weight; with a backend, same dtype.
        eps (float): RMSNorm epsilon.
        backend (str, optional): ``"cuda"`` / ``"metal"`` from
            :func:`add_rms_norm_ready`, or None for the portable path.
            Default None.

    Returns:
        Tuple[mx.array, mx.array]: ``(h, y)``; with a backend, both in the
        shape and dtype of ``x``.

    Shapes:
        - x, r, h, y: [..., D]
        - w: [D]

    Raises:
        ValueError: with a backend, for shapes or dtypes outside the kernel's
            contract (the check that said ready was for other arrays).

    Example:
        >>> import mlx.core as mx
        >>> from qwen_apple_backend.ops.norm import add_rms_norm, add_rms_norm_ready
        >>> x, r, w = mx.ones((1, 1, 8)), mx.ones((1, 1, 8)), mx.full((8,), 3.0)
        >>> backend = add_rms_norm_ready(8, x.dtype)  # None on the CPU
        >>> h, y = add_rms_norm(x, r, w, 1e-6, backend=backend)
        >>> h[0, 0, 0].item(), round(y[0, 0, 0].item(), 4)
        (2.0, 3.0)
    """
    if backend is None or x.size == 0:
        return add_rms_norm_ops(x, r, w, eps)
    _check(x, r, w)
    return _kernel_call(backend, x, r, w, eps)
