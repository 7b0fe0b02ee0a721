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

This module imports only ``mlx.core``, the standard library, ``envs`` and
the kernel plumbing in ``ops.device``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import mlx.core as mx

from .. import envs
from .device import build_kernel, gpu_backend, self_checked

__all__ = [
    "SEQUENTIAL_MAX_T",
    "compute_gates",
    "gated_delta",
    "gated_delta_chunked_ops",
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
