"""Gated delta rule (Gated DeltaNet linear attention) in plain MLX.

The recurrence, per batch row and value head (Yang et al., "Gated Delta
Networks: Improving Mamba2 with Delta Rule", ICLR 2025)::

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T
    y_t = S_t q_t

with the state ``S`` stored as ``[Dv, Dk]`` in float32. The contract is the
one of mlx-lm's ``mlx_lm/models/gated_delta.py``: ``q`` and ``k`` arrive
L2-normalised with the ``Dk**-0.5`` readout scale already folded into ``q``
(see :func:`l2norm_qk`), ``g`` is the per-head decay in (0, 1) and ``beta``
the per-head write strength (see :func:`compute_gates`). Value head ``hv``
reads key head ``hv // (Hv // Hk)``.

Three implementations share that contract:

* :func:`gated_delta_step_ops` -- one token (decode).
* :func:`gated_delta_sequential_ops` -- a loop of steps (the reference).
* :func:`gated_delta_chunked_ops` -- chunked prefill in the WY / UT-transform
  form of Yang et al., "Parallelizing Linear Transformers with the Delta Rule
  over Sequence Length", NeurIPS 2024, with the gate folded in as in the
  Gated DeltaNet paper.

and :func:`gated_delta` picks one, or the GPU scan kernel
(:func:`gated_delta_kernel`, ``kernels/{cuda,metal}/gated_delta_scan``) once it
has passed its self-check on this device.

One decode token of a whole GDN layer short of its projections (conv-state
update, depthwise conv + SiLU, q/k l2norm, gates, one recurrent step, gated
RMSNorm) has the same three parts: :func:`gated_delta_decode_ops` (plain MLX,
the fused layer's decode path), :func:`gated_delta_decode_kernel` (one launch,
``kernels/{cuda,metal}/gated_delta_decode``) and :func:`gated_delta_decode`,
which uses the kernel after :func:`decode_kernel_ready`.

This module imports only ``mlx.core``, the standard library, ``envs`` and
the kernel plumbing in ``ops.device``.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Tuple

import mlx.core as mx

from .. import envs
from .device import build_kernel, f32_scalar, gpu_backend, self_checked

__all__ = [
    "DECODE_QK_EPS",
    "SEQUENTIAL_MAX_T",
    "compute_gates",
    "decode_kernel_ready",
    "gated_delta",
    "gated_delta_chunked_ops",
    "gated_delta_decode",
    "gated_delta_decode_kernel",
    "gated_delta_decode_ops",
    "gated_delta_kernel",
    "gated_delta_sequential_ops",
    "gated_delta_step_ops",
    "kernel_ready",
    "l2norm_qk",
    "staged_kernel_ready",
]

# Up to this many tokens the dispatcher runs the per-token loop: the chunked
# path has a fixed cost (padding to a whole chunk, the triangular solve).
# Measured on the CPU at Hk=16, Hv=32, Dk=Dv=128: 4 tokens 19 ms sequential
# vs 25 ms chunked, 8 tokens 41 vs 39 ms, 16 tokens 83 vs 40 ms.
SEQUENTIAL_MAX_T = 8

# Smallest chunk the dispatcher shrinks to for a sequence shorter than one
# chunk (it pads to the next power of two, not to a whole 64-token chunk).
_MIN_CHUNK = 16

# Side of the diagonal blocks inverted by forward substitution inside the
# blocked triangular solve; larger blocks are merged by 2x2 block inversion.
# Measured on the CPU for 1024 chunks of 64: 0.12 s with 16-row blocks,
# 0.17 s with 8, 0.40 s for plain forward substitution over all 64 rows.
_SOLVE_BLOCK = 16

# Floor of log(g). g can underflow to 0 in float32 (exp(-exp(A_log) * dt)
# with A up to 16); a finite floor keeps every log-gate sum finite, so no
# inf arithmetic (inf - inf, 0 * inf) reaches the chunk math. exp(-80) ~ 2e-35
# is zero at float32 precision.
_LOG_G_MIN = -80.0


# --------------------------------------------------------------------------
# Gates and q/k normalisation
# --------------------------------------------------------------------------


@functools.partial(mx.compile, shapeless=True)
def _gates(A_log, a, dt_bias, b):
    # softplus(x) = log(1 + exp(x)) = logaddexp(x, 0), as mlx.nn.softplus.
    g = mx.exp(-mx.exp(A_log.astype(mx.float32)) * mx.logaddexp(a + dt_bias, 0))
    return g, mx.sigmoid(b)


def compute_gates(
    A_log: mx.array, a: mx.array, dt_bias: mx.array, b: mx.array
) -> Tuple[mx.array, mx.array]:
    """Decay and write strength of the gated delta rule.

    ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``,
    the same formulas (and op order) as mlx-lm's ``compute_g`` and
    ``gated_delta_update``.

    Args:
        A_log (mx.array): log of the per-head decay rate, any float dtype
            (used in float32).
        a (mx.array): decay input from ``in_proj_a``.
        dt_bias (mx.array): per-head bias added to ``a``.
        b (mx.array): write-strength logits from ``in_proj_b``.

    Returns:
        Tuple[mx.array, mx.array]: ``(g, beta)``; ``g`` is float32 in (0, 1],
        ``beta`` has the dtype of ``b``.

    Shapes:
        - A_log, dt_bias: [Hv]
        - a, b: [B, T, Hv]
        - g, beta: [B, T, Hv]
    """
    return _gates(A_log, a, dt_bias, b)


def l2norm_qk(
    q: mx.array, k: mx.array, eps: float = 1e-6
) -> Tuple[mx.array, mx.array]:
    """L2-normalise q and k and fold the ``Dk**-0.5`` readout scale into q.

    ``eps`` is added to ``sum(x**2)`` (the reference l2norm). The function
    uses ``mx.fast.rms_norm``, which adds its eps to ``mean(x**2)``, so eps
    is rescaled by ``1 / Dk``; the result equals mlx-lm's ``normalize_qk``.

    Args:
        q (mx.array): queries.
        k (mx.array): keys.
        eps (float): l2norm epsilon. Default ``1e-6``.

    Returns:
        Tuple[mx.array, mx.array]: ``(q, k)`` in the input dtype; ``k`` has
        unit norm, ``q`` norm ``Dk**-0.5``.

    Shapes:
        - q, k: [B, T, Hk, Dk]
    """
    inv_scale = q.shape[-1] ** -0.5
    rms_eps = eps * inv_scale**2
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)
    k = inv_scale * mx.fast.rms_norm(k, None, rms_eps)
    return q, k


# --------------------------------------------------------------------------
# One recurrent step and the sequential reference
# --------------------------------------------------------------------------


@mx.compile
def _step(q, k, v, g, beta, state, mask=None):
    B, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    R = Hv // Hk
    f32 = mx.float32
    # Value heads grouped by key head, [B, Hk, R, ...]: k and q broadcast over
    # R instead of being repeated. Multiply-and-sum rather than matmul: the
    # products are matrix-vector, where the fused elementwise form measured
    # ~2x faster on the CPU, and it is bit-identical to mlx-lm's ops step.
    old = state
    S = state.reshape(B, Hk, R, Dv, Dk)
    kc = k.astype(f32).reshape(B, Hk, 1, 1, Dk)
    qc = q.astype(f32).reshape(B, Hk, 1, 1, Dk)
    S = S * g.astype(f32).reshape(B, Hk, R, 1, 1)
    kv_mem = (S * kc).sum(axis=-1)
    delta = (v.astype(f32).reshape(B, Hk, R, Dv) - kv_mem) * beta.astype(
        f32
    ).reshape(B, Hk, R, 1)
    S = S + delta[..., None] * kc
    y = (S * qc).sum(axis=-1).reshape(B, Hv, Dv)
    S = S.reshape(B, Hv, Dv, Dk)
    if mask is not None:
        S = mx.where(mask[:, None, None, None], S, old)
        y = mx.where(mask[:, None, None], y, 0.0)
    return y.astype(q.dtype), S


def gated_delta_step_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """One token of the gated delta rule (compiled, plain MLX ops).

    Args:
        q (mx.array): normalised, scaled query of this token.
        k (mx.array): normalised key of this token.
        v (mx.array): value of this token.
        g (mx.array): decay in (0, 1], float32.
        beta (mx.array): write strength.
        state (mx.array): recurrent state, float32.
        mask (Optional[mx.array]): bool; where False the state is returned
            unchanged and the output is zero. Default ``None`` (all True).

    Returns:
        Tuple[mx.array, mx.array]: ``(y, state)``; ``y`` in ``q.dtype``,
        ``state`` float32.

    Shapes:
        - q, k: [B, Hk, Dk]
        - v: [B, Hv, Dv]
        - g, beta: [B, Hv]
        - state: [B, Hv, Dv, Dk]
        - mask: [B]
        - y: [B, Hv, Dv]
    """
    return _step(q, k, v, g, beta, state.astype(mx.float32), mask)


def gated_delta_sequential_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule over a sequence, one :func:`gated_delta_step_ops` per token.

    The reference the chunked form is tested against; also the fastest path
    for a handful of tokens.

    Args:
        q (mx.array): normalised, scaled queries.
        k (mx.array): normalised keys.
        v (mx.array): values.
        g (mx.array): decays in (0, 1], float32.
        beta (mx.array): write strengths.
        state (Optional[mx.array]): initial state, float32; zeros if None.
        mask (Optional[mx.array]): bool; False positions leave the state
            unchanged and output zeros. Default ``None``.

    Returns:
        Tuple[mx.array, mx.array]: ``(y, state)``; ``y`` in ``q.dtype``,
        final ``state`` float32.

    Raises:
        ValueError: if the shapes disagree (see :func:`gated_delta`).

    Shapes:
        - q, k: [B, T, Hk, Dk]
        - v: [B, T, Hv, Dv]
        - g, beta: [B, T, Hv]
        - state: [B, Hv, Dv, Dk]
        - mask: [B, T]
        - y: [B, T, Hv, Dv]
    """
    state = _check_and_init(q, k, v, g, beta, state, mask)
    ys = []
    for t in range(q.shape[1]):
        y, state = _step(
            q[:, t],
            k[:, t],
            v[:, t],
            g[:, t],
            beta[:, t],
            state,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
    return mx.stack(ys, axis=1), state


# --------------------------------------------------------------------------
# Chunked form
# --------------------------------------------------------------------------


def _forward_substitution(A: mx.array) -> mx.array:
    """``(I + A)^-1`` for strictly lower triangular ``A`` [..., n, n].

    Row i of ``N = (I + A)^-1 - I`` is ``-(A_i + A_i N)``, which only reads
    rows < i of ``N``, all final by then.
    """
    n = A.shape[-1]
    N = mx.zeros_like(A)
    for i in range(1, n):
        a_i = A[..., i : i + 1, :]
        N[..., i : i + 1, :] = -(a_i + a_i @ N)
    return N + mx.eye(n, dtype=A.dtype)


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """``(I + A)^-1`` for strictly lower triangular ``A`` [..., n, n], blocked.

    Splits into halves, inverts both diagonal blocks in one batched call and
    fills the off-diagonal block with ``-L22^-1 A21 L11^-1``; blocks of at
    most ``_SOLVE_BLOCK`` rows (or odd sizes) use forward substitution.
    """
    n = A.shape[-1]
    if n <= _SOLVE_BLOCK or n % 2:
        return _forward_substitution(A)
    h = n // 2
    diag = _unit_lower_inverse(mx.stack([A[..., :h, :h], A[..., h:, h:]], axis=-3))
    inv11, inv22 = diag[..., 0, :, :], diag[..., 1, :, :]
    inv21 = -(inv22 @ (A[..., h:, :h] @ inv11))
    top = mx.concatenate([inv11, mx.zeros_like(inv11)], axis=-1)
    bottom = mx.concatenate([inv21, inv22], axis=-1)
    return mx.concatenate([top, bottom], axis=-2)


@mx.compile
def _chunk_prepare(q, k, v, g, beta, mask, C):
    """Everything of the chunked form that does not depend on the carried state.

    Layout: chunk index first, then value heads grouped by key head,
    ``[N, B, Hk, R, C, ...]``; key-head tensors keep a size-1 R axis and
    broadcast, so repeated KV heads are never materialised.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    R = Hv // Hk
    f32 = mx.float32
    pad = (-T) % C
    N = (T + pad) // C

    lg = mx.maximum(mx.log(g.astype(f32)), _LOG_G_MIN)
    beta = beta.astype(f32)
    if mask is not None:
        # A masked token keeps the state: decay 1 (log 0) and no write.
        lg = mx.where(mask[..., None], lg, 0.0)
        beta = mx.where(mask[..., None], beta, 0.0)
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    if pad:
        # Padding tokens are masked tokens with zero q, k, v.
        q = mx.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
        k = mx.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v = mx.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)])
        lg = mx.pad(lg, [(0, 0), (0, pad), (0, 0)])
        beta = mx.pad(beta, [(0, 0), (0, pad), (0, 0)])

    q = q.reshape(B, N, C, Hk, 1, Dk).transpose(1, 0, 3, 4, 2, 5)
    k = k.reshape(B, N, C, Hk, 1, Dk).transpose(1, 0, 3, 4, 2, 5)
    v = v.reshape(B, N, C, Hk, R, Dv).transpose(1, 0, 3, 4, 2, 5)
    lg = lg.reshape(B, N, C, Hk, R).transpose(1, 0, 3, 4, 2)
    beta = beta.reshape(B, N, C, Hk, R).transpose(1, 0, 3, 4, 2)

    # seg[t, s] = sum_{s < j <= t} log g_j, summed directly rather than as a
    # difference of cumulative sums, which would cancel catastrophically once
    # the cumulative log-gate is large.
    idx = mx.arange(C)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    seg = mx.cumsum(mx.where(strict, lg[..., :, None], 0.0), axis=-2)
    decay = mx.exp(mx.where(causal, seg, -mx.inf))  # [N, B, Hk, R, C, C]
    gamma = mx.exp(mx.cumsum(lg, axis=-1))  # decay from chunk start to t
    to_end = decay[..., -1, :]  # decay from s to chunk end
    gamma_end = gamma[..., -1:, None]  # [N, B, Hk, R, 1, 1]

    kt = k.swapaxes(-1, -2)
    # UT transform: (I + A) delta = beta (v - gamma S0 k), with A strictly
    # lower: A[t, s] = beta_t * decay[t, s] * <k_t, k_s>.
    A = mx.where(strict, (beta[..., None] * decay) * (k @ kt), 0.0)
    Tinv = _unit_lower_inverse(A)
    W = Tinv @ ((beta * gamma)[..., None] * k)  # [N, B, Hk, R, C, Dk]
    U = Tinv @ (beta[..., None] * v)  # [N, B, Hk, R, C, Dv]
    # delta = U - W S0^T; y = gamma q S0^T + P delta with P the causal,
    # decayed q.k scores, so y = (gamma q - P W) S0^T + P U.
    P = decay * (q @ kt)
    Qeff = gamma[..., None] * q - P @ W
    Ypart = P @ U
    Kend = (to_end[..., None] * k).swapaxes(-1, -2)  # [N, B, Hk, R, Dk, C]
    return W, U, Kend, gamma_end, Qeff, Ypart


@mx.compile
def _chunk_scan_step(St, W, U, Kend, gamma_end, Qeff, Ypart):
    # St is the transposed state [.., Dk, Dv] so every product is a plain
    # matmul without transposes.
    y = Qeff @ St + Ypart
    delta = U - W @ St
    return y, gamma_end * St + Kend @ delta


@mx.compile
def _chunk_finish(ys, St, T):
    N, B, Hk, R, C, Dv = ys.shape
    Dk = St.shape[-2]
    y = ys.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hk * R, Dv)[:, :T]
    return y, St.swapaxes(-1, -2).reshape(B, Hk * R, Dv, Dk)


def gated_delta_chunked_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    chunk_size: int = 64,
) -> Tuple[mx.array, mx.array]:
    """Chunked gated delta rule for prefill (plain MLX ops, float32 math).

    T is padded to a multiple of ``chunk_size`` with tokens that keep the
    state. Within each chunk the delta-rule writes are decoupled by the
    WY / UT transform (Yang et al., NeurIPS 2024): with cumulative decays
    ``gamma`` and the decayed key-key products ``A`` (strictly lower), the
    unit-lower-triangular system ``(I + A) delta = beta (v - gamma S0 k)`` is
    solved by a blocked inverse (forward substitution on 16-row blocks); the
    outputs are attention-like matmuls. Only the carry of the state from one
    chunk to the next is sequential: one step per chunk. Gating follows the
    Gated DeltaNet paper (Yang et al., ICLR 2025). All math is float32.

    Args:
        q (mx.array): normalised, scaled queries.
        k (mx.array): normalised keys.
        v (mx.array): values.
        g (mx.array): decays in (0, 1], float32.
        beta (mx.array): write strengths.
        state (Optional[mx.array]): initial state, float32; zeros if None.
        mask (Optional[mx.array]): bool; False positions leave the state
            unchanged and output zeros. Default ``None``.
        chunk_size (int): tokens per chunk. Default 64.

    Returns:
        Tuple[mx.array, mx.array]: ``(y, state)``; ``y`` in ``q.dtype``,
        final ``state`` float32.

    Raises:
        ValueError: if the shapes disagree or ``chunk_size < 1``.

    Shapes:
        - q, k: [B, T, Hk, Dk]
        - v: [B, T, Hv, Dv]
        - g, beta: [B, T, Hv]
        - state: [B, Hv, Dv, Dk]
        - mask: [B, T]
        - y: [B, T, Hv, Dv]
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    state = _check_and_init(q, k, v, g, beta, state, mask)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    W, U, Kend, gamma_end, Qeff, Ypart = _chunk_prepare(
        q, k, v, g, beta, mask, chunk_size
    )
    St = state.reshape(B, Hk, Hv // Hk, Dv, Dk).swapaxes(-1, -2)
    ys = []
    for n in range(W.shape[0]):
        y, St = _chunk_scan_step(
            St, W[n], U[n], Kend[n], gamma_end[n], Qeff[n], Ypart[n]
        )
        ys.append(y)
    y, state = _chunk_finish(mx.stack(ys), St, T)
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0.0)
    return y.astype(q.dtype), state


# --------------------------------------------------------------------------
# Kernel slot and dispatcher
# --------------------------------------------------------------------------


# Kernel limits: each lane holds Dk / 32 state floats in registers.
_KERNEL_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
_KERNEL_MAX_DK = 256
# Rows of the state per thread block (one warp / SIMD group per row).
_KERNEL_ROWS = 4
# Tokens in the self-check's random problem: odd, so no tile size divides it.
_SELF_CHECK_T = 19


@functools.lru_cache(maxsize=None)
def _scan_kernel_object(backend: str):
    return build_kernel("gated_delta_scan", backend)


def _kernel_supported(Dk: int, Dv: int, dtype: mx.Dtype) -> bool:
    return Dk % 32 == 0 and 0 < Dk <= _KERNEL_MAX_DK and Dv > 0 and dtype in _KERNEL_DTYPES


def _scan_kernel_call(backend: str, q, k, v, g, beta, state, mask=None):
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    obj = _scan_kernel_object(backend)
    if obj is None:
        raise RuntimeError(f"no gated_delta_scan source or MLX API for {backend}")
    dt = q.dtype
    has_mask = mask is not None
    m = mask.astype(mx.bool_) if has_mask else mx.ones((1,), dtype=mx.bool_)
    rows = _KERNEL_ROWS if Dv % _KERNEL_ROWS == 0 else 1
    y, new_state = obj(
        inputs=[q, k.astype(dt), v.astype(dt), g.astype(mx.float32),
                beta.astype(mx.float32), state.astype(mx.float32), m],
        template=[("InT", dt), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("HAS_MASK", has_mask)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, rows, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[dt, mx.float32],
    )
    return y, new_state


# The staged prefill scan (kernels/cuda/gated_delta_scan_staged.cu): lanes per
# state row, threads per block, and the shared-memory budget of its
# double-buffered k/q tiles (static shared memory is capped at 48 KB).
STAGED_LPR = 8
_STAGED_BLOCK = 128
_STAGED_SMEM_BYTES = 40 * 1024
# From this many tokens the dispatcher prefers the staged scan (when its
# self-check passed); shorter calls (decode) run gated_delta_scan.
STAGED_MIN_T = 2


@functools.lru_cache(maxsize=None)
def _staged_kernel_object(backend: str):
    return build_kernel("gated_delta_scan_staged", backend)


def _staged_tile(Dk: int, Dv: int, dtype: mx.Dtype, lpr: int) -> Optional[int]:
    """Tokens per staged chunk (TC) for these shapes, or None if unsupported."""
    rows = _STAGED_BLOCK // lpr
    if Dk % lpr or Dv % rows or (Dk * dtype.size) % 16 or lpr not in (4, 8, 16, 32):
        return None
    tc = 32
    while tc > 1 and 4 * tc * Dk * dtype.size > _STAGED_SMEM_BYTES:
        tc //= 2
    return tc if Dk // lpr <= 32 else None


def _staged_kernel_call(backend: str, q, k, v, g, beta, state, mask=None, lpr: int = 0):
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    obj = _staged_kernel_object(backend)
    if obj is None:
        raise RuntimeError(f"no gated_delta_scan_staged source or MLX API for {backend}")
    lpr = lpr or STAGED_LPR
    dt = q.dtype
    tc = _staged_tile(Dk, Dv, dt, lpr)
    if tc is None:
        raise ValueError(f"gated_delta_scan_staged: unsupported Dk={Dk}, Dv={Dv}, "
                         f"{dt}, {lpr} lanes per row")
    has_mask = mask is not None
    m = mask.astype(mx.bool_) if has_mask else mx.ones((1,), dtype=mx.bool_)
    rows = _STAGED_BLOCK // lpr
    y, new_state = obj(
        inputs=[q, k.astype(dt), v.astype(dt), g.astype(mx.float32),
                beta.astype(mx.float32), state.astype(mx.float32), m],
        template=[("InT", dt), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("HAS_MASK", has_mask), ("LPR", lpr), ("BLOCK", _STAGED_BLOCK),
                  ("TC", tc)],
        grid=(_STAGED_BLOCK * (Dv // rows), B * Hv, 1),
        threadgroup=(_STAGED_BLOCK, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[dt, mx.float32],
    )
    return y, new_state


def staged_kernel_ready(Hk: int, Hv: int, Dk: int, Dv: int, dtype: mx.Dtype) -> Optional[str]:
    """The GPU backend whose staged prefill scan may run these shapes, or None.

    Like :func:`kernel_ready`, for ``kernels/cuda/gated_delta_scan_staged.cu``
    (CUDA only): self-checked on the first call per shape class against
    :func:`gated_delta_sequential_ops` on a problem of two whole chunks and a
    partial one, so the double buffering is exercised.

    Returns:
        Optional[str]: ``"cuda"`` or None.
    """
    if envs.kernels_disabled() or dtype not in _KERNEL_DTYPES:
        return None
    backend = gpu_backend()
    if backend != "cuda" or _staged_kernel_object(backend) is None:
        return None
    tc = _staged_tile(Dk, Dv, dtype, STAGED_LPR)
    if tc is None:
        return None
    rtol = 1e-4 if dtype == mx.float32 else 2e-2
    ok = self_checked(
        "gated_delta_scan_staged", backend, (Hk, Hv, Dk, Dv, str(dtype), STAGED_LPR),
        kernel=lambda *a: _staged_kernel_call(backend, *a),
        reference=gated_delta_sequential_ops,
        make_inputs=_self_check_inputs(Hk, Hv, Dk, Dv, dtype, T=2 * tc + 3),
        rtol=rtol,
    )
    return backend if ok else None


def _self_check_inputs(Hk, Hv, Dk, Dv, dtype, T=_SELF_CHECK_T):
    def make():
        key = mx.random.key(1234)
        kq, kk, kv, ka, kb, ks = mx.random.split(key, 6)
        B = 1
        q, k = l2norm_qk(mx.random.normal((B, T, Hk, Dk), key=kq).astype(dtype),
                         mx.random.normal((B, T, Hk, Dk), key=kk).astype(dtype))
        v = mx.random.normal((B, T, Hv, Dv), key=kv).astype(dtype)
        g = mx.random.uniform(0.5, 1.0, (B, T, Hv), key=ka)
        beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=kb).astype(dtype)
        state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=ks)
        return q * (Dk ** -0.5), k, v, g, beta, state
    return make


def kernel_ready(Hk: int, Hv: int, Dk: int, Dv: int, dtype: mx.Dtype) -> Optional[str]:
    """The GPU backend whose gated delta kernel may run these shapes, or None.

    Call it outside ``mx.compile``: on the first call per shape class it runs
    the kernel's self-check (see :mod:`qwen_apple_backend.ops.device`) against
    :func:`gated_delta_sequential_ops` on random inputs of these head sizes.

    Args:
        Hk (int): key heads. Hv (int): value heads. Dk (int): key head dim.
        Dv (int): value head dim. dtype (mx.Dtype): dtype of q, k, v.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled by ``QAB_DISABLE_KERNELS``, unsupported shapes, or a failed
        self-check, which also warns).
    """
    if envs.kernels_disabled():
        return None
    backend = gpu_backend()
    if backend is None or not _kernel_supported(Dk, Dv, dtype):
        return None
    if _scan_kernel_object(backend) is None:
        return None
    # bf16/fp16 outputs round to ~3 significant digits; state math is float32.
    rtol = 1e-4 if dtype == mx.float32 else 2e-2
    ok = self_checked(
        "gated_delta_scan", backend, (Hk, Hv, Dk, Dv, str(dtype)),
        kernel=lambda *a: _scan_kernel_call(backend, *a),
        reference=gated_delta_sequential_ops,
        make_inputs=_self_check_inputs(Hk, Hv, Dk, Dv, dtype),
        rtol=rtol,
    )
    return backend if ok else None


@functools.lru_cache(maxsize=None)
def _kernel_factory(backend: str) -> Optional[Callable[..., Tuple[mx.array, mx.array]]]:
    """The fused GPU scan for ``backend`` as a function, or None if it has no source.

    Args:
        backend (str): ``"metal"`` or ``"cuda"``.

    Returns:
        Optional[Callable]: a function with the signature of
        :func:`gated_delta_kernel` (no self-check: see :func:`kernel_ready`).
    """
    if _scan_kernel_object(backend) is None:
        return None
    return functools.partial(_scan_kernel_call, backend)


def gated_delta_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule on the backend's fused GPU kernel (``kernels/*/gated_delta_scan``).

    One warp (CUDA) or SIMD group (Metal) owns one ``Dk``-long state row for
    the whole sequence, in registers: the state is read once and written once,
    in float32, and each token costs two warp reductions. No self-check runs
    here; :func:`gated_delta` uses the kernel only after :func:`kernel_ready`.

    Args and Shapes: as :func:`gated_delta_sequential_ops` (``state``
    required; ``Dk`` a multiple of 32, at most 256; q/k/v float32, bfloat16
    or float16).

    Returns:
        Tuple[mx.array, mx.array]: ``(y, state)``; ``y`` in ``q.dtype``,
        ``state`` float32.

    Raises:
        RuntimeError: if the default device has no kernel for this op.
    """
    backend = gpu_backend()
    kernel = _kernel_factory(backend) if backend is not None else None
    if kernel is None:
        raise RuntimeError(
            f"no gated_delta kernel for device {mx.default_device()} "
            f"(backend {backend or 'cpu'})"
        )
    return kernel(q, k, v, g, beta, state, mask)


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    chunk_size: Optional[int] = None,
    use_kernel: bool = True,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule: the one entry point, choosing kernel or ops path.

    The GPU scan kernel runs for every T when ``use_kernel`` is true and
    :func:`kernel_ready` says so (a Metal or CUDA device, ``QAB_DISABLE_KERNELS``
    unset, supported shapes, self-check passed); otherwise the portable path:
    T == 1 runs :func:`gated_delta_step_ops`, ``T <= SEQUENTIAL_MAX_T``
    :func:`gated_delta_sequential_ops`, longer sequences
    :func:`gated_delta_chunked_ops` (with the chunk cut to the next power of
    two, at least 16, when T is shorter than one chunk).

    Args:
        q (mx.array): L2-normalised queries with ``Dk**-0.5`` folded in.
        k (mx.array): L2-normalised keys.
        v (mx.array): values.
        g (mx.array): decays in (0, 1], float32.
        beta (mx.array): write strengths.
        state (Optional[mx.array]): initial state, float32; zeros if None.
        mask (Optional[mx.array]): bool; False positions leave the state
            unchanged and output zeros. Default ``None``.
        chunk_size (Optional[int]): chunk of the chunked path; default
            ``envs.gdn_chunk_size()`` (``QAB_GDN_CHUNK``, 64).
        use_kernel (bool): allow a backend kernel. Default True.

    Returns:
        Tuple[mx.array, mx.array]: ``(y, state)``; ``y`` in ``q.dtype``,
        final ``state`` float32.

    Raises:
        ValueError: if the shapes disagree (``Hv`` not a multiple of ``Hk``,
            mismatched B/T/Dk, wrong state or mask shape).

    Shapes:
        - q, k: [B, T, Hk, Dk]
        - v: [B, T, Hv, Dv]
        - g, beta: [B, T, Hv]
        - state: [B, Hv, Dv, Dk]
        - mask: [B, T]
        - y: [B, T, Hv, Dv]

    Example:
        >>> import mlx.core as mx
        >>> from qwen_apple_backend.ops.gated_delta import (
        ...     compute_gates, gated_delta, l2norm_qk)
        >>> B, T, Hk, Hv, D = 1, 100, 2, 4, 128
        >>> q, k = l2norm_qk(mx.random.normal((B, T, Hk, D)),
        ...                  mx.random.normal((B, T, Hk, D)))
        >>> v = mx.random.normal((B, T, Hv, D))
        >>> g, beta = compute_gates(mx.zeros(Hv), mx.zeros((B, T, Hv)),
        ...                         mx.ones(Hv), mx.zeros((B, T, Hv)))
        >>> y, state = gated_delta(q, k, v, g, beta)
        >>> y.shape, state.shape, state.dtype
        ((1, 100, 4, 128), (1, 4, 128, 128), mlx.core.float32)
    """
    state = _check_and_init(q, k, v, g, beta, state, mask)
    if use_kernel and q.shape[1] >= STAGED_MIN_T:
        backend = staged_kernel_ready(q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype)
        if backend is not None:
            return _staged_kernel_call(backend, q, k, v, g, beta, state, mask)
    if use_kernel:
        backend = kernel_ready(q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype)
        if backend is not None:
            return _scan_kernel_call(backend, q, k, v, g, beta, state, mask)
    T = q.shape[1]
    if T == 1:
        y, state = gated_delta_step_ops(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            g[:, 0],
            beta[:, 0],
            state,
            None if mask is None else mask[:, 0],
        )
        return y[:, None], state
    if T <= SEQUENTIAL_MAX_T:
        return gated_delta_sequential_ops(q, k, v, g, beta, state, mask)
    if chunk_size is None:
        chunk_size = envs.gdn_chunk_size()
    if T < chunk_size:
        # Shorter than one chunk: pad to the next power of two only.
        chunk_size = min(chunk_size, max(_MIN_CHUNK, 1 << (T - 1).bit_length()))
    return gated_delta_chunked_ops(q, k, v, g, beta, state, mask, chunk_size)


def _check_and_init(q, k, v, g, beta, state, mask) -> mx.array:
    """Validate shapes; return the float32 state (zeros when None)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, Dk]; got {q.shape}, {k.shape}")
    B, T, Hk, Dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, Hv, Dv]; got {v.shape}")
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"Hv ({Hv}) must be a multiple of Hk ({Hk})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)}; got {x.shape}")
    if mask is not None and mask.shape != (B, T):
        raise ValueError(f"mask must be [B, T] = {(B, T)}; got {mask.shape}")
    if state is None:
        return mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if state.shape != (B, Hv, Dv, Dk):
        raise ValueError(f"state must be [B, Hv, Dv, Dk] = {(B, Hv, Dv, Dk)}; got {state.shape}")
    return state.astype(mx.float32)


# --------------------------------------------------------------------------
# One decode token of a whole GDN layer (kernels/*/gated_delta_decode)
# --------------------------------------------------------------------------

# q/k l2norm epsilon of the stock modules (a constant in the decode kernels).
DECODE_QK_EPS = 1e-6
# Threads per block of the decode kernel (8 warps / SIMD groups). On CUDA a
# 256-thread block can never fail to launch for register pressure (256 x 255
# registers fit the 64K register file); each warp owns ceil(Dv / 8) state rows.
_DECODE_BLOCK = 256
# Most state floats one lane keeps in registers (rows per warp x Dk / 32); 64
# at Dk = Dv = 128.
_DECODE_MAX_STATE_PER_LANE = 64


def _token_rows(x: mx.array, B: int, width: int) -> bool:
    # [B, width], or [B, 1, ...] whose trailing axes flatten to width (the
    # layer's projections with their token axis: the same memory, no reshape).
    if x.ndim == 2:
        return tuple(x.shape) == (B, width)
    return (x.ndim >= 3 and x.shape[0] == B and x.shape[1] == 1
            and math.prod(x.shape[2:]) == width)


def _check_decode(qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, state,
                  mask, lengths, token_axis: bool = False) -> Tuple[int, int, int, int, int]:
    """Validate the decode-step shapes; return ``(Hk, Hv, Dk, Dv, Kc)``.

    With ``token_axis`` (the kernel path), ``qkv``, ``z``, ``b``, ``a`` may
    also come as ``[B, 1, ...]`` and ``mask`` as ``[B, 1]``.
    """
    if state.ndim != 4:
        raise ValueError(f"state must be [B, Hv, Dv, Dk]; got {state.shape}")
    B, Hv, Dv, Dk = state.shape
    if token_axis and qkv.ndim == 3 and qkv.shape[:2] == (B, 1):
        C = qkv.shape[2]
    elif qkv.ndim != 2 or qkv.shape[0] != B:
        raise ValueError(f"qkv must be [B={B}, conv_dim]; got {qkv.shape}")
    else:
        C = qkv.shape[1]
    key2 = C - Hv * Dv
    if key2 <= 0 or key2 % (2 * Dk) or Hv % (key2 // (2 * Dk)):
        raise ValueError(f"qkv width {C} is not 2 * Hk * Dk + Hv * Dv with Hv ({Hv}) a "
                         f"multiple of Hk (Dk={Dk}, Dv={Dv})")
    Hk = key2 // (2 * Dk)
    if (conv_w.ndim not in (2, 3) or conv_w.shape[0] != C
            or (conv_w.ndim == 3 and conv_w.shape[2] != 1)):
        raise ValueError(f"conv_w must be [conv_dim={C}, Kc, 1]; got {conv_w.shape}")
    Kc = conv_w.shape[1]
    if Kc < 2:
        raise ValueError(f"conv kernel size must be at least 2; got {Kc}")
    token_rows = [("z", z, Hv * Dv), ("b", b, Hv), ("a", a, Hv)]
    if mask is not None and mask.ndim != 1:
        token_rows.append(("mask", mask, 1))
    expected = [("conv_state", conv_state, (B, Kc - 1, C)), ("A_log", A_log, (Hv,)),
                ("dt_bias", dt_bias, (Hv,)), ("norm_w", norm_w, (Dv,)),
                ("conv_b", conv_b, (C,)), ("lengths", lengths, (B,))]
    if mask is not None and mask.ndim == 1:
        expected.append(("mask", mask, (B,)))
    if token_axis:
        for name, x, width in token_rows:
            if not _token_rows(x, B, width):
                raise ValueError(f"{name} must be [{B}, {width}] or [{B}, 1, ...] of "
                                 f"{width} values; got {list(x.shape)}")
    else:
        expected += [(name, x, (B, width) if name != "mask" else (B,))
                     for name, x, width in token_rows]
    for name, x, shape in expected:
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}; got {list(x.shape)}")
    return Hk, Hv, Dk, Dv, Kc


def _decode_ops(qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, state,
                mask, lengths, Hk, norm_eps):
    # The op order of the fused layer's compiled decode step
    # (layers/gated_delta.py: _prepare, gated_delta at T = 1, _gated_rms_norm),
    # which is mlx-lm's.
    B, C = qkv.shape
    _, Hv, Dv, Dk = state.shape
    Kc = conv_w.shape[1]
    qkv = qkv[:, None]
    if mask is not None:
        qkv = mx.where(mask[:, None, None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    n_keep = Kc - 1
    if lengths is not None:
        # A row whose length is used up keeps its conv state.
        ends = mx.clip(lengths, 0, 1)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        new_conv_state = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        new_conv_state = conv_input[:, -n_keep:, :]
    conv_out = mx.conv1d(conv_input, conv_w.reshape(C, Kc, 1), 1, 0, 1, C)
    if conv_b is not None:
        conv_out = conv_out + conv_b
    conv_out = conv_out * mx.sigmoid(conv_out)  # SiLU, as mlx.nn.silu
    key_dim = Hk * Dk
    q, k, v = mx.split(conv_out[:, 0], [key_dim, 2 * key_dim], axis=-1)
    q, k = l2norm_qk(q.reshape(B, Hk, Dk), k.reshape(B, Hk, Dk), DECODE_QK_EPS)
    g, beta = compute_gates(A_log, a, dt_bias, b)
    y, state = gated_delta_step_ops(q, k, v.reshape(B, Hv, Dv), g, beta, state, mask)
    # Gated RMSNorm: the norm in the input dtype, the SiLU gate in float32
    # (mlx-lm's RMSNormGated + precise_swiglu).
    x = mx.fast.rms_norm(y, norm_w, norm_eps)
    zf = z.reshape(B, Hv, Dv).astype(mx.float32)
    out = (zf * mx.sigmoid(zf) * x.astype(mx.float32)).astype(y.dtype)
    return out, new_conv_state, state


_decode_ops_compiled = mx.compile(_decode_ops)


def gated_delta_decode_ops(
    qkv: mx.array,
    z: mx.array,
    b: mx.array,
    a: mx.array,
    conv_state: mx.array,
    conv_w: mx.array,
    conv_b: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
    lengths: Optional[mx.array] = None,
    *,
    norm_eps: float = 1e-6,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode token of a Gated DeltaNet layer short of its projections (plain MLX ops).

    The portable reference of :func:`gated_delta_decode_kernel`, composed of
    the functions the fused layer's decode step uses, in the same order:

    1. the token's ``qkv`` (zeroed where ``mask`` is False) is appended to
       ``conv_state``; the new conv state is the last ``Kc - 1`` rows (the
       old one where ``lengths <= 0``);
    2. depthwise conv1d over those ``Kc`` rows (+ ``conv_b``), SiLU; split
       into q | k | v;
    3. :func:`l2norm_qk` (eps 1e-6, ``Dk**-0.5`` folded into q) and
       :func:`compute_gates`;
    4. one step of the gated delta rule (:func:`gated_delta_step_ops`; Yang et
       al., "Gated Delta Networks", ICLR 2025); where ``mask`` is False the
       state is unchanged and y is zero;
    5. gated RMSNorm: ``silu(z) * rms_norm(y, norm_w, norm_eps)``, the norm in
       the input dtype and the gate product in float32.

    Args:
        qkv (mx.array): in_proj_qkv output of the token, channels q | k | v.
        z (mx.array): in_proj_z output (the output gate).
        b (mx.array): in_proj_b output (write-strength logits).
        a (mx.array): in_proj_a output (decay input).
        conv_state (mx.array): the previous ``Kc - 1`` conv inputs.
        conv_w (mx.array): depthwise conv weight, MLX layout.
        conv_b (Optional[mx.array]): conv bias, or None (stock Qwen3.5).
        A_log (mx.array): log decay rates.
        dt_bias (mx.array): decay input bias.
        norm_w (mx.array): RMSNorm weight.
        state (mx.array): recurrent state, float32.
        mask (Optional[mx.array]): bool SSM mask; False rows keep their
            recurrent state and output zeros. Default None.
        lengths (Optional[mx.array]): ``cache.lengths`` of a batched
            generation; rows with ``lengths <= 0`` keep their conv state.
            Default None.
        norm_eps (float): RMSNorm epsilon. Default ``1e-6``.

    Returns:
        Tuple[mx.array, mx.array, mx.array]: ``(out, conv_state, state)``;
        ``out`` and ``conv_state`` in the promoted input dtype (that of
        ``qkv`` when the inputs share one), ``state`` float32.

    Raises:
        ValueError: if the shapes disagree (see Shapes).

    Shapes:
        - qkv: [B, 2 * Hk * Dk + Hv * Dv]
        - z: [B, Hv * Dv]
        - b, a: [B, Hv]
        - conv_state: [B, Kc - 1, 2 * Hk * Dk + Hv * Dv]
        - conv_w: [2 * Hk * Dk + Hv * Dv, Kc, 1]
        - conv_b: [2 * Hk * Dk + Hv * Dv]
        - A_log, dt_bias: [Hv]
        - norm_w: [Dv]
        - state: [B, Hv, Dv, Dk]
        - mask, lengths: [B]
        - out: [B, Hv, Dv]
    """
    Hk = _check_decode(qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w,
                       state, mask, lengths)[0]
    return _decode_ops_compiled(qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias,
                                norm_w, state.astype(mx.float32), mask, lengths, Hk,
                                float(norm_eps))


@functools.lru_cache(maxsize=None)
def _decode_kernel_object(backend: str):
    return build_kernel("gated_delta_decode", backend)


def _decode_supported(Dk: int, Dv: int, Kc: int, dtype: mx.Dtype, block: int = 0) -> bool:
    block = block or _DECODE_BLOCK
    rows_per_warp = -(-Dv // (block // 32))
    return (Dk % 32 == 0 and 0 < Dk <= _KERNEL_MAX_DK and Dv > 0 and Kc >= 2
            and dtype in _KERNEL_DTYPES
            and rows_per_warp * (Dk // 32) <= _DECODE_MAX_STATE_PER_LANE)


def _decode_kernel_call(backend: str, qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias,
                        norm_w, state, mask=None, lengths=None, *, norm_eps: float = 1e-6,
                        block: int = 0, proj=None):
    Hk, Hv, Dk, Dv, Kc = _check_decode(qkv, z, b, a, conv_state, conv_w, conv_b, A_log,
                                       dt_bias, norm_w, state, mask, lengths, token_axis=True)
    proj_w = 0
    if proj is not None:
        # The concatenated input projection's row, read at channel offsets:
        # qkv, z, b and a are only checked (views never passed: not encoded).
        proj_w = qkv.shape[-1] + Hv * Dv + 2 * Hv
        B = state.shape[0]
        if not (_token_rows(proj, B, proj_w) and proj.dtype == qkv.dtype):
            raise ValueError(f"proj must be [{B}, {proj_w}] or [{B}, 1, {proj_w}] of "
                             f"{qkv.dtype} (qkv | z | b | a); got {list(proj.shape)} "
                             f"{proj.dtype}")
        qkv = z = b = a = proj
    obj = _decode_kernel_object(backend)
    if obj is None:
        raise RuntimeError(f"no gated_delta_decode source or MLX API for {backend}")
    block = block or _DECODE_BLOCK
    B, C = state.shape[0], conv_state.shape[-1]
    # The kernel reads rows flatly: [B, 1, ...] inputs (the layer's projections)
    # go in without a reshape, and then out comes as [B, 1, Hv * Dv], the
    # shape the output projection takes (each reshape is a primitive the host
    # encodes every decode token).
    out_shape = (B, 1, Hv * Dv) if qkv.ndim == 3 else (B, Hv, Dv)
    dt, wt = qkv.dtype, conv_w.dtype
    f32 = mx.float32
    # Absent optional inputs are stood in for by an array of a fixed dtype:
    # MLX caches a CUDA kernel by its template arguments alone, so the dtype
    # of every input must follow from them.
    A = A_log.astype(f32)
    has_bias, has_mask, has_lengths = conv_b is not None, mask is not None, lengths is not None
    out, new_conv_state, new_state = obj(
        inputs=[qkv, z.astype(dt), b.astype(dt), a.astype(dt), conv_state.astype(dt), conv_w,
                conv_b.astype(wt) if has_bias else conv_w, A, dt_bias.astype(wt),
                norm_w.astype(wt), f32_scalar(float(norm_eps)), state.astype(f32),
                mask.astype(mx.bool_) if has_mask else A,
                lengths.astype(mx.int32) if has_lengths else A],
        template=[("InT", dt), ("WT", wt), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv),
                  ("Kc", Kc), ("BLOCK", block), ("HAS_BIAS", has_bias),
                  ("HAS_MASK", has_mask), ("HAS_LENGTHS", has_lengths), ("PROJ_W", proj_w)],
        grid=(block, B * Hv, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[out_shape, (B, Kc - 1, C), (B, Hv, Dv, Dk)],
        output_dtypes=[dt, dt, f32],
    )
    return out, new_conv_state, new_state


def _decode_self_check_inputs(Hk, Hv, Dk, Dv, Kc, dtype, has_bias, has_mask, has_lengths):
    def make():
        keys = mx.random.split(mx.random.key(4321), 11)
        # Masked or length-limited calls: a live row, a masked row whose conv
        # state still shifts (left padding), a finished row that keeps it.
        B = 3 if has_mask or has_lengths else 1
        C = 2 * Hk * Dk + Hv * Dv
        qkv = mx.random.normal((B, C), key=keys[0]).astype(dtype)
        z = mx.random.normal((B, Hv * Dv), key=keys[1]).astype(dtype)
        b = mx.random.normal((B, Hv), key=keys[2]).astype(dtype)
        a = mx.random.normal((B, Hv), key=keys[3]).astype(dtype)
        conv_state = mx.random.normal((B, Kc - 1, C), key=keys[4]).astype(dtype)
        conv_w = (0.5 * mx.random.normal((C, Kc, 1), key=keys[5])).astype(dtype)
        conv_b = (0.1 * mx.random.normal((C,), key=keys[6])).astype(dtype) if has_bias else None
        # Decay rates in (0.05, 2): decays from ~0.2 to ~1, long and short memories.
        A_log = mx.log(mx.random.uniform(0.05, 2.0, (Hv,), key=keys[7]))
        dt_bias = (1.0 + 0.5 * mx.random.normal((Hv,), key=keys[8])).astype(dtype)
        norm_w = (1.0 + 0.1 * mx.random.normal((Dv,), key=keys[9])).astype(dtype)
        state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[10])
        mask = mx.array([True, False, False]) if has_mask else None
        lengths = mx.array([1, 1, 0], dtype=mx.int32) if has_lengths else None
        return (qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, state,
                mask, lengths)
    return make


def decode_kernel_ready(
    Hk: int,
    Hv: int,
    Dk: int,
    Dv: int,
    Kc: int,
    dtype: mx.Dtype,
    *,
    has_bias: bool = False,
    has_mask: bool = False,
    has_lengths: bool = False,
    packed: bool = False,
) -> Optional[str]:
    """The GPU backend whose fused decode-step kernel may run these shapes, or None.

    Call it outside ``mx.compile``: on the first call per shape class (head
    sizes, conv kernel, dtype and which optional inputs are given) it runs the
    kernel's self-check (see :mod:`qwen_apple_backend.ops.device`) against
    :func:`gated_delta_decode_ops` on seeded random inputs of these sizes,
    comparing ``out``, the conv state and the recurrent state.

    Args:
        Hk (int): key heads. Hv (int): value heads. Dk (int): key head dim.
        Dv (int): value head dim. Kc (int): conv kernel size.
        dtype (mx.Dtype): dtype of the activations (``qkv``, ``z``, ``b``,
            ``a``, ``conv_state``) and of the weights.
        has_bias (bool): a conv bias is given. Default False.
        has_mask (bool): an SSM mask is given. Default False.
        has_lengths (bool): ``lengths`` are given. Default False.
        packed (bool): the projections come as one concatenated row (``proj=`` of
            :func:`gated_delta_decode_kernel`); checked on its own. Default False.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled by ``QAB_DISABLE_KERNELS``, unsupported shapes or dtype, no
        kernel for the backend, e.g. the unverified CUDA kernel without
        ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also warns).
    """
    if envs.kernels_disabled() or not _decode_supported(Dk, Dv, Kc, dtype):
        return None
    backend = gpu_backend()
    if backend is None or _decode_kernel_object(backend) is None:
        return None
    # float32: the same math in another summation order (2.7e-7 measured on
    # the CPU emulation of the CUDA body); the bound leaves room for a TF32
    # conv1d in the GPU reference (~5e-4 relative). bf16/fp16: both round the
    # intermediates (conv, SiLU, normalised q/k, beta, y) to the input dtype
    # at the same points, in different elementwise implementations: measured
    # rel-L2 3.4e-3 on out and 1.5e-3 on the state at Hk=16, Hv=32, Dk=Dv=128.
    rtol = 2e-3 if dtype == mx.float32 else 2e-2
    def packed_call(qkv, z, b, a, *rest):
        return _decode_kernel_call(backend, qkv, z, b, a, *rest,
                                   proj=mx.concatenate([qkv, z, b, a], axis=-1))

    ok = self_checked(
        "gated_delta_decode", backend,
        (Hk, Hv, Dk, Dv, Kc, str(dtype), has_bias, has_mask, has_lengths)
        + (("packed",) if packed else ()),
        kernel=packed_call if packed else (lambda *args: _decode_kernel_call(backend, *args)),
        reference=gated_delta_decode_ops,
        make_inputs=_decode_self_check_inputs(Hk, Hv, Dk, Dv, Kc, dtype, has_bias, has_mask,
                                              has_lengths),
        rtol=rtol,
    )
    return backend if ok else None


def gated_delta_decode_kernel(
    qkv: mx.array,
    z: mx.array,
    b: mx.array,
    a: mx.array,
    conv_state: mx.array,
    conv_w: mx.array,
    conv_b: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
    lengths: Optional[mx.array] = None,
    *,
    norm_eps: float = 1e-6,
    proj: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode token of a GDN layer in one GPU launch (``kernels/*/gated_delta_decode``).

    One thread block (CUDA) / threadgroup (Metal) of 256 threads per
    (batch row, value head) runs the conv-state update, conv + SiLU, q/k
    l2norm, gates, the recurrent step (state rows in registers, float32) and
    the gated RMSNorm; see the kernel files' header comments. No self-check
    runs here: use it after :func:`decode_kernel_ready` (as
    :func:`gated_delta_decode` and the fused layer do). ``z``, ``b``, ``a``
    and ``conv_state`` are read in ``qkv.dtype``; ``conv_b``, ``dt_bias`` and
    ``norm_w`` in ``conv_w.dtype``.

    Args, Shapes and algorithm: as :func:`gated_delta_decode_ops` (``Dk`` a
    multiple of 32, at most 256; ``ceil(Dv / 8) * Dk / 32 <= 64``; ``Kc >= 2``;
    float32, bfloat16 or float16). Also accepted, with no reshape: ``qkv``,
    ``z``, ``b``, ``a`` with their token axis, ``[B, 1, ...]`` (``z`` e.g.
    ``[B, 1, Hv, Dv]``), and ``mask`` ``[B, 1]``; then ``out`` is
    ``[B, 1, Hv * Dv]``. With ``proj`` (the concatenated input projection's
    output, ``[B, 2 Hk Dk + 2 Hv Dv + 2 Hv]`` or with its token axis: channels
    q | k | v | z | b | a) the kernel reads that one array at channel offsets
    and ``qkv``, ``z``, ``b``, ``a`` (its split views) are only checked: split
    views that no launch takes are never encoded. Use it after
    ``decode_kernel_ready(..., packed=True)``.

    Returns:
        Tuple[mx.array, mx.array, mx.array]: ``(out, conv_state, state)``;
        ``out`` and ``conv_state`` in ``qkv.dtype``, ``state`` float32.

    Raises:
        RuntimeError: if the default device has no kernel for this op.
        ValueError: if the shapes disagree.
    """
    backend = gpu_backend()
    if backend is None or _decode_kernel_object(backend) is None:
        raise RuntimeError(
            f"no gated_delta_decode kernel for device {mx.default_device()} "
            f"(backend {backend or 'cpu'})"
        )
    return _decode_kernel_call(backend, qkv, z, b, a, conv_state, conv_w, conv_b, A_log,
                               dt_bias, norm_w, state, mask, lengths, norm_eps=norm_eps,
                               proj=proj)


def gated_delta_decode(
    qkv: mx.array,
    z: mx.array,
    b: mx.array,
    a: mx.array,
    conv_state: mx.array,
    conv_w: mx.array,
    conv_b: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    norm_w: mx.array,
    state: mx.array,
    mask: Optional[mx.array] = None,
    lengths: Optional[mx.array] = None,
    *,
    norm_eps: float = 1e-6,
    use_kernel: bool = True,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode token of a GDN layer: the fused kernel when ready, else the ops path.

    The kernel (:func:`gated_delta_decode_kernel`) runs when ``use_kernel``
    is true, the activations, ``conv_state`` and ``conv_w`` share one dtype
    and :func:`decode_kernel_ready` says so (call this outside ``mx.compile``
    the first time: that runs the self-check); otherwise
    :func:`gated_delta_decode_ops`.

    Args, Returns, Raises, Shapes: as :func:`gated_delta_decode_ops`, plus
        ``use_kernel`` (bool): allow the GPU kernel. Default True.

    Example:
        >>> import mlx.core as mx
        >>> from qwen_apple_backend.ops.gated_delta import gated_delta_decode
        >>> B, Hk, Hv, Dk, Dv, Kc = 1, 2, 4, 32, 32, 4
        >>> C = 2 * Hk * Dk + Hv * Dv
        >>> out, conv_state, state = gated_delta_decode(
        ...     mx.random.normal((B, C)), mx.random.normal((B, Hv * Dv)),
        ...     mx.zeros((B, Hv)), mx.zeros((B, Hv)), mx.zeros((B, Kc - 1, C)),
        ...     mx.random.normal((C, Kc, 1)), None, mx.zeros(Hv), mx.ones(Hv),
        ...     mx.ones(Dv), mx.zeros((B, Hv, Dv, Dk)))
        >>> out.shape, conv_state.shape, state.dtype
        ((1, 4, 32), (1, 3, 256), mlx.core.float32)
    """
    Hk, Hv, Dk, Dv, Kc = _check_decode(qkv, z, b, a, conv_state, conv_w, conv_b, A_log,
                                       dt_bias, norm_w, state, mask, lengths)
    dt = qkv.dtype
    if use_kernel and all(x.dtype == dt for x in (z, b, a, conv_state, conv_w)):
        backend = decode_kernel_ready(Hk, Hv, Dk, Dv, Kc, dt, has_bias=conv_b is not None,
                                      has_mask=mask is not None,
                                      has_lengths=lengths is not None)
        if backend is not None:
            return _decode_kernel_call(backend, qkv, z, b, a, conv_state, conv_w, conv_b,
                                       A_log, dt_bias, norm_w, state, mask, lengths,
                                       norm_eps=norm_eps)
    return gated_delta_decode_ops(qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias,
                                  norm_w, state, mask, lengths, norm_eps=norm_eps)
