"""Grouped-query full-attention ops for Qwen3.5 / Qwen3.6 and Qwen3-Next.

* :func:`prep_qk` — per-head q/k RMSNorm, move heads before time, and partial
  RoPE, as one compiled graph per configuration. The position offset is an
  array input, so one graph serves every decode position.
* :func:`gqa_attention` — dispatcher around
  ``mx.fast.scaled_dot_product_attention``, which handles grouped-query
  attention natively: KV heads are never repeated to match query heads.
* :func:`gqa_attention_blocked` — the same attention in blocks of query rows,
  so that a long prompt never holds the whole ``[B, Hq, T, S]`` score matrix.
* :func:`gqa_attention_split` — decode attention over a long KV cache with
  ``p v`` split over fixed blocks of keys (``attn-split``).
* :func:`gate_output` — the per-head sigmoid output gate of Qwen3.5 / Qwen3-Next.

About memory: where MLX has no fused attention kernel for the shape (the CPU;
CUDA for head dims above 128, which cuDNN's SDPA does not take: Qwen3.6's
full-attention head dim is 256), ``mx.fast.scaled_dot_product_attention``
runs as MLX ops and materializes the scores. A 2,048-token prefill chunk at
128K context would hold 16 x 2,048 x 131,072 scores, 8.6 GB per bf16 buffer.
:func:`score_block_rows` picks query blocks that keep it under
:data:`SCORE_BLOCK_BYTES`; each row's softmax is independent, so the blocked
result is the same attention.

About RoPE: Qwen3.5 configs carry ``mrope_section`` (e.g. [11, 11, 10],
interleaved) for multimodal positions. For text, the three position streams
are equal, so every frequency sees the same position and M-RoPE reduces to
plain (non-traditional, "rotate half") RoPE over the first
``head_dim * partial_rotary_factor`` dims; mlx-lm's ``initialize_rope`` builds
exactly that ``nn.RoPE`` for both ``default`` and ``mrope`` types.

Dimension names: B batch, T query tokens, S key/value tokens, Hq query heads,
Hk key/value heads, D head dim, R rotary dims.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Union

import mlx.core as mx

from qwen_apple_backend import envs
from qwen_apple_backend.ops.device import (build_kernel, f32_scalar, gpu_backend, padded_zeros,
                                           self_checked, unpooled_length)

__all__ = [
    "RopeSpec",
    "prep_qk",
    "prep_qk_decode",
    "qk_prep_kernel_ready",
    "gqa_attention_ops",
    "gqa_attention_kernel",
    "gqa_attention",
    "gqa_attention_blocked",
    "gqa_attention_split",
    "gqa_decode_attention_gated",
    "SPLIT_KV_MIN_KEYS",
    "SPLIT_KV_BLOCK",
    "score_block_rows",
    "SCORE_BLOCK_BYTES",
    "gate_output",
    "decode_kv_mask",
    "kv_cache_write",
    "kv_cache_write_ops",
    "kv_write_ready",
    "gqa_decode_step",
    "gqa_decode_step_ops",
    "STEP_MAX_KEYS",
    "step_counter",
    "step_kernel_ready",
]

#: Budget for one attention call's score matrix (float32 bytes of [B, Hq, rows, S]).
SCORE_BLOCK_BYTES = 1 << 29

#: Query rows from which a fused attention layer evaluates its output outside
#: traces even when the scores fit one call (``attn-blocks``): a prefill chunk
#: then runs at most one attention interval (4 layers in Qwen3.5/3.6) ahead of
#: the GPU. Measured on the H200 (128K prompt, 2,048-token chunks): without it
#: the first two chunks, whose scores fit one call, peaked 8.0-8.7 GB above
#: weights + KV cache; the later, blocked chunks 2.8-3.0 GB.
RUNAHEAD_EVAL_ROWS = 512

#: Keys from which a one-token query takes :func:`gqa_attention_split`
#: (``attn-split``, CUDA only: Metal keeps MLX's fused two-pass vector SDPA,
#: which splits over keys itself), and the key block of its split p v product.
#: Measured on the H200, one Qwen3.6 full-attention decode layer (Hq = 16,
#: Hk = 2, D = 256, bf16 KV; ``benchmarks/profile_attention_decode.py``, same
#: run): ``mx.fast.scaled_dot_product_attention`` 0.170 / 0.487 / 0.992 ms at
#: 4K / 32K / 128K keys; its MLX ops q k^T + softmax + p v split over blocks of
#: 1,024 keys 0.067 + 0.054 + 0.135 = 0.256 / 0.081 + 0.072 + 0.144 = 0.297 /
#: 0.147 + 0.113 + 0.179 = 0.439 ms (the split p v timed with the blocks'
#: rows in another order: same shapes and bytes; this order adds a transpose
#: of p, 2 MB at 128K). The single p v matmul (0.094 / 0.166 / 0.328 ms)
#: reduces over all S keys in too few thread blocks; split, each block of
#: keys is its own batch entry. End to end (H200, 128K, compiled step, before
#: the in-place KV write; decode-split-nvidia-h200-128k-split-kernel.json):
#: 43.2 tok/s with SDPA, 47.8 with the split; 16K and the exact switch point
#: are not yet measured.
SPLIT_KV_MIN_KEYS = 32768
SPLIT_KV_BLOCK = 1024

Mask = Union[None, str, mx.array]


class RopeSpec(NamedTuple):
    """Static parameters of a plain ``mx.fast.rope``.

    Attributes:
        dims (int): rotated leading dims R of each head (``D * partial_rotary_factor``).
        traditional (bool): rotate adjacent pairs (True) or halves (False).
        base (float): frequency base (``rope_theta``).
        scale (float): position scale (1 / linear scaling factor).
    """

    dims: int
    traditional: bool
    base: float
    scale: float = 1.0


@functools.lru_cache(maxsize=None)
def _prep_fn(q_eps: float, k_eps: float, rope: Optional[RopeSpec]) -> Callable:
    # One compiled graph per configuration; shapes specialise inside it and the
    # offset is an array argument, so decode steps reuse one trace.
    def prep(q, k, q_weight, k_weight, offset):
        q = mx.fast.rms_norm(q, q_weight, q_eps).transpose(0, 2, 1, 3)
        k = mx.fast.rms_norm(k, k_weight, k_eps).transpose(0, 2, 1, 3)
        if rope is not None:
            q = mx.fast.rope(
                q, rope.dims, traditional=rope.traditional, base=rope.base,
                scale=rope.scale, offset=offset,
            )
            k = mx.fast.rope(
                k, rope.dims, traditional=rope.traditional, base=rope.base,
                scale=rope.scale, offset=offset,
            )
        return q, k

    return mx.compile(prep)


def prep_qk(
    q: mx.array,
    k: mx.array,
    q_weight: mx.array,
    k_weight: mx.array,
    *,
    q_eps: float,
    k_eps: float,
    rope: Optional[RopeSpec],
    offset: Union[int, mx.array] = 0,
) -> tuple[mx.array, mx.array]:
    """RMSNorm each q/k head, put heads before time, apply partial RoPE.

    Same primitives in the same order as stock ``Qwen3NextAttention``
    (``rms_norm`` -> transpose -> ``rope``), so results match it exactly.

    Args:
        q (mx.array): query heads (already split from the output gate).
        k (mx.array): key heads.
        q_weight (mx.array): ``[D]`` weight of the query RMSNorm.
        k_weight (mx.array): ``[D]`` weight of the key RMSNorm.
        q_eps (float): query RMSNorm epsilon.
        k_eps (float): key RMSNorm epsilon.
        rope (RopeSpec | None): rotary parameters; None skips RoPE (the
            caller applies a non-plain RoPE module itself).
        offset (int | mx.array): position of the first token: a scalar, or
            ``[B]`` per-sequence offsets (batched caches). Default 0.

    Returns:
        tuple[mx.array, mx.array]: ``(q, k)`` in the dtype of the inputs.

    Raises:
        ValueError: if q and k disagree on B, T or D.

    Shapes:
        q: ``[B, T, Hq, D]`` -> ``[B, Hq, T, D]``
        k: ``[B, T, Hk, D]`` -> ``[B, Hk, T, D]``
        offset: ``[]`` or ``[B]``
    """
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"prep_qk expects q [B, T, Hq, D] and k [B, T, Hk, D], got {q.shape} and {k.shape}"
        )
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return _prep_fn(float(q_eps), float(k_eps), rope)(q, k, q_weight, k_weight, offset)


# --------------------------------------------------------------------------
# Decode q/k preparation kernel (kernels/{cuda,metal}/qk_norm_rope)
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _qk_prep_object(backend: str):
    # q and k are read through their strides on either backend.
    return build_kernel("qk_norm_rope", backend, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=None)
def _qk_prep_params(q_eps: float, k_eps: float, scale: float, base: float) -> mx.array:
    # MLX's rope takes log2(base) computed in float32 (std::log2 of a float).
    import numpy as np

    log2_base = float(np.log2(np.float32(base), dtype=np.float32))
    return mx.array([q_eps, k_eps, scale, log2_base], dtype=mx.float32)


def _qk_prep_call(backend: str, q, k, q_weight, k_weight, q_eps: float, k_eps: float,
                  rope: RopeSpec, offset: mx.array):
    B, _, Hq, D = q.shape
    Hk = k.shape[2]
    heads = Hq + Hk
    if backend == "metal" and offset.ndim != 1:
        # A 0-d input reaches a CUDA kernel as a pointer, a Metal kernel as a
        # reference: Metal gets the position as [1] (a view, no copy).
        offset = offset.reshape(1)
    return _qk_prep_object(backend)(
        inputs=[q, k, q_weight, k_weight,
                _qk_prep_params(float(q_eps), float(k_eps), float(rope.scale), float(rope.base)),
                offset],
        template=[("InT", q.dtype), ("D", D), ("R", rope.dims), ("TRAD", rope.traditional)],
        grid=(128 * -(-heads // 4), B, 1), threadgroup=(128, 1, 1),
        output_shapes=[(B, Hq, 1, D), (B, Hk, 1, D)], output_dtypes=[q.dtype, q.dtype])


def _qk_rope_fits(D: int, rope: RopeSpec) -> bool:
    """Whether ``qk_norm_rope.cuh``'s warp-per-head row takes a head of ``D`` and
    this RoPE: ``D`` a multiple of 32 up to 256, ``R`` even in ``(0, D]``, and its
    rotated pairs on lanes (``(R / 2) % (D / 32) == 0``; traditional: ``D / 32`` even)."""
    epl = D // 32
    R = rope.dims
    return not (D % 32 or D > 256 or R % 2 or R <= 0 or R > D
                or (epl % 2 if rope.traditional else (R // 2) % epl))


def qk_prep_kernel_ready(Hq: int, Hk: int, D: int, dtype: mx.Dtype, weight_dtype: mx.Dtype,
                         rope: Optional[RopeSpec]) -> Optional[str]:
    """The GPU backend whose decode q/k preparation kernel may run, or None.

    :func:`prep_qk_decode` needs a plain RoPE (``rope`` not None) over R
    even dims with ``(R / 2) % (D / 32) == 0`` (traditional: ``D / 32``
    even), ``D`` a multiple of 32 up to 256, float32 / bf16 / f16 inputs and
    norm weights of the same dtype. CUDA (``kernels/cuda/qk_norm_rope.cu``,
    built only once its manifest entry records a GPU verification or with
    ``QAB_UNVERIFIED_KERNELS=1``) or Metal (``kernels/metal/qk_norm_rope.metal``,
    rounded as MLX's Metal ``rms_norm`` and ``rope``), each self-checked once
    per shape class against :func:`prep_qk` on strided inputs (q as the first
    half of each head of a ``q_proj`` output) at position 4,097; a failing or
    unbuildable kernel leaves :func:`prep_qk`'s ops. Call it outside
    ``mx.compile`` traces: the self-check evaluates.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None.
    """
    if envs.kernels_disabled() or rope is None:
        return None
    backend = gpu_backend()
    if backend not in ("cuda", "metal"):
        return None
    if (not _qk_rope_fits(D, rope) or dtype not in (mx.float32, mx.bfloat16, mx.float16)
            or weight_dtype != dtype):
        return None
    if _qk_prep_object(backend) is None:
        return None
    key = (Hq, Hk, D, str(dtype), rope)

    def make_inputs():
        kq, kk, kw, kx = mx.random.split(mx.random.key(11), 4)
        B = 2
        qg = mx.random.normal((B, 1, Hq, 2 * D), key=kq).astype(dtype)
        q_ = mx.split(qg, 2, axis=-1)[0]
        k_ = mx.random.normal((B, 1, Hk, D), key=kk).astype(dtype)
        w = (1.0 + 0.2 * mx.random.normal((2, D), key=kw)).astype(dtype)
        off = mx.array(4097, dtype=mx.int32)
        return q_, k_, w[0], w[1], off

    def kernel(q_, k_, qw, kw_, off):
        return list(_qk_prep_call(backend, q_, k_, qw, kw_, 1e-6, 1e-5, rope, off))

    def reference(q_, k_, qw, kw_, off):
        return list(prep_qk(q_, k_, qw, kw_, q_eps=1e-6, k_eps=1e-5, rope=rope, offset=off))

    # float32: RoPE at position 4,097 turns a last-bit difference in the angle
    # between two formulas into ~1e-5 (the kernel follows the backend's own
    # rope: CUDA's, or Metal's with its fast cos / sin).
    tol = 1e-4 if dtype == mx.float32 else 1e-2
    ok = self_checked("qk_norm_rope", backend, key, kernel=kernel, reference=reference,
                      make_inputs=make_inputs, rtol=tol)
    return backend if ok else None


def prep_qk_decode(
    q: mx.array, k: mx.array, q_weight: mx.array, k_weight: mx.array, *,
    q_eps: float, k_eps: float, rope: RopeSpec, offset: mx.array, backend: str = "cuda",
) -> tuple[mx.array, mx.array]:
    """:func:`prep_qk` for one token in one GPU launch (``kernels/{cuda,metal}/qk_norm_rope``).

    Per head RMSNorm then RoPE, rounded as ``mx.fast.rms_norm`` and
    ``mx.fast.rope`` on that MLX backend; q and k are read through their
    strides (q is the first half of each head of ``q_proj``'s output), so
    none of :func:`prep_qk`'s 4 launches and 2 transposes runs. Only after
    :func:`qk_prep_kernel_ready` returned ``backend`` for these shapes (the
    caller checks, outside any ``mx.compile`` trace).

    Args:
        q (mx.array): the token's query heads.
        k (mx.array): its key heads.
        q_weight (mx.array): ``[D]`` query RMSNorm weight, dtype of q.
        k_weight (mx.array): ``[D]`` key RMSNorm weight, dtype of q.
        q_eps (float): query RMSNorm epsilon.
        k_eps (float): key RMSNorm epsilon.
        rope (RopeSpec): the plain RoPE's parameters.
        offset (mx.array): the token's position, int32, 0-d.
        backend (str): ``"cuda"`` or ``"metal"``, as the readiness check
            returned. Default ``"cuda"``.

    Returns:
        tuple[mx.array, mx.array]: ``(q, k)``, dtype of q.

    Raises:
        ValueError: for more than one token, 4-D shapes that disagree, dtypes
            other than q's, an offset that is not a 0-d array, or another
            backend.

    Shapes:
        q: ``[B, 1, Hq, D]`` -> ``[B, Hq, 1, D]``; k: ``[B, 1, Hk, D]`` -> ``[B, Hk, 1, D]``
    """
    if (q.ndim != 4 or k.ndim != 4 or q.shape[1] != 1 or k.shape[:2] != q.shape[:2]
            or k.shape[3] != q.shape[3] or q_weight.shape != (q.shape[3],)
            or k_weight.shape != q_weight.shape):
        raise ValueError(f"prep_qk_decode expects q [B, 1, Hq, D], k [B, 1, Hk, D] and [D] "
                         f"weights, got {q.shape}, {k.shape}, {q_weight.shape}, "
                         f"{k_weight.shape}")
    if not (k.dtype == q_weight.dtype == k_weight.dtype == q.dtype):
        raise ValueError(f"prep_qk_decode expects one dtype, got q {q.dtype}, k {k.dtype}, "
                         f"weights {q_weight.dtype} / {k_weight.dtype}")
    if not isinstance(offset, mx.array) or offset.ndim != 0:
        raise ValueError("prep_qk_decode expects the position as a 0-d int32 array")
    if backend not in ("cuda", "metal"):
        raise ValueError(f"prep_qk_decode: backend {backend!r} is not 'cuda' or 'metal'")
    return tuple(_qk_prep_call(backend, q, k, q_weight, k_weight, q_eps, k_eps, rope, offset))


def _check_gqa(q: mx.array, k: mx.array, v: mx.array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"gqa_attention expects 4-D q/k/v, got {q.shape}, {k.shape}, {v.shape}"
        )
    hq, hk = q.shape[1], k.shape[1]
    if v.shape[1] != hk or hk == 0 or hq % hk != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads "
            f"(k {hk}, v {v.shape[1]})"
        )


def gqa_attention_ops(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None
) -> mx.array:
    """Portable grouped-query attention: ``softmax(q k^T * scale + mask) v``.

    ``mx.fast.scaled_dot_product_attention`` accepts Hk < Hq directly and
    shares each KV head among ``Hq / Hk`` query heads; nothing here repeats
    or tiles K or V.

    Args:
        q (mx.array): queries.
        k (mx.array): keys.
        v (mx.array): values.
        scale (float): score scale, usually ``D ** -0.5``.
        mask (None | str | mx.array): mlx-lm mask: None, ``"causal"``
            (lower-right aligned, right for a prefill that follows a cache),
            or a boolean / additive array broadcastable to ``[B, Hq, T, S]``.

    Returns:
        mx.array: attention output, dtype of ``q`` (softmax in float32).

    Raises:
        ValueError: if the head counts do not divide.

    Shapes:
        q: ``[B, Hq, T, D]``; k, v: ``[B, Hk, S, D]``; returns ``[B, Hq, T, D]``
    """
    _check_gqa(q, k, v)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@functools.lru_cache(maxsize=None)
def gqa_attention_kernel() -> Optional[Callable]:
    """Build (once) a GPU GQA attention kernel for the current backend.

    No general GPU attention kernel ships (MLX's fused SDPA runs); a
    returned callable must accept the arguments of :func:`gqa_attention_ops`.
    The split-K decode kernel (GQA-packed, one query row over a long KV
    cache) is reached through :func:`gqa_attention_split` instead.

    Returns:
        Callable | None: the kernel, or None when none is available.
    """
    return None


def gqa_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Mask = None,
    *,
    use_kernel: bool = True,
) -> mx.array:
    """Grouped-query attention, on a GPU kernel when one is available.

    Falls back to :func:`gqa_attention_ops` when ``use_kernel`` is False,
    ``QAB_DISABLE_KERNELS`` is set or no kernel exists for this backend.

    Args:
        q (mx.array): queries.
        k (mx.array): keys.
        v (mx.array): values.
        scale (float): score scale.
        mask (None | str | mx.array): see :func:`gqa_attention_ops`.
        use_kernel (bool): allow the GPU kernel. Default True.

    Returns:
        mx.array: dtype of ``q``.

    Raises:
        ValueError: if the head counts do not divide.

    Shapes:
        q: ``[B, Hq, T, D]``; k, v: ``[B, Hk, S, D]``; returns ``[B, Hq, T, D]``

    Example:
        >>> import mlx.core as mx
        >>> q = mx.random.normal((1, 16, 5, 256))
        >>> k = v = mx.random.normal((1, 2, 5, 256))
        >>> gqa_attention(q, k, v, 256 ** -0.5, "causal").shape
        (1, 16, 5, 256)
    """
    if use_kernel and not envs.kernels_disabled():
        kernel = gqa_attention_kernel()
        if kernel is not None:
            _check_gqa(q, k, v)
            return kernel(q, k, v, scale, mask)
    return gqa_attention_ops(q, k, v, scale, mask)


def gqa_attention_split(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask = None,
    *, block: int = SPLIT_KV_BLOCK, use_kernel: bool = True
) -> mx.array:
    """Grouped-query attention of a few query rows over a long KV cache, split-K in MLX ops.

    ``softmax(q k^T * scale + mask) v`` as three steps: the scores of the
    ``Hq / Hk`` query heads that share a KV head against that head's keys (K
    read once per KV head, never repeated), a float32 softmax, and ``p v``
    as a batched matmul over fixed blocks of ``block`` keys plus a float32
    sum over the blocks (flash-decoding's split over keys, with the softmax
    done once over all keys instead of per block). The probabilities enter
    ``p v`` in the dtype of ``v``, as in FlashAttention's second product.

    Args:
        q (mx.array): queries.
        k (mx.array): keys.
        v (mx.array): values.
        scale (float): score scale.
        mask (None | str | mx.array): None, ``"causal"`` (for one query row
            at the end of the cache: no key masked), or a boolean (True =
            attend) / additive array broadcastable to ``[B, Hq, T, S]``.
        block (int): keys per block of ``p v``. Default
            :data:`SPLIT_KV_BLOCK`.
        use_kernel (bool): run the split-K CUDA kernel pair instead when
            :func:`split_kernel_ready` says so (one query row). Default True.

    Returns:
        mx.array: attention output, dtype of ``q``.

    Raises:
        ValueError: if the head counts do not divide, or for ``"causal"``
            with more than one query row.

    Shapes:
        q: ``[B, Hq, T, D]``; k, v: ``[B, Hk, S, D]``; returns ``[B, Hq, T, D]``
    """
    _check_gqa(q, k, v)
    B, Hq, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    if use_kernel and T == 1:
        backend = split_kernel_ready(q, k, v, mask)
        if backend is not None:
            return _split_kernel_call(backend, q, k, v, scale, _row_mask(mask, B, S)[1])
    if isinstance(mask, str):
        if mask != "causal" or T != 1:
            raise ValueError(f"gqa_attention_split: mask {mask!r} with {T} query rows; "
                             "only 'causal' with one row (no key masked)")
        mask = None
    scores = (q.reshape(B, Hk, G * T, D) @ k.swapaxes(-1, -2)).astype(mx.float32) * scale
    if mask is not None:
        if all(d == 1 for d in mask.shape[-3:-1]):
            # One row of keys for every head and query (the compiled decode
            # step's [1, 1, 1, S]): it broadcasts against the scores as it is.
            # Reshaping its broadcast would copy it, an op and a buffer per
            # layer and token.
            m = mask
        else:
            m = mx.broadcast_to(mask, (B, Hq, T, S)).reshape(B, Hk, G * T, S)
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, -float("inf"))
        else:
            scores = scores + m.astype(mx.float32)
    p = mx.softmax(scores, axis=-1).astype(v.dtype)  # [B, Hk, G T, S]
    n = S // block * block
    out = None
    if n:
        pb = p[..., :n].reshape(B, Hk, G * T, n // block, block).swapaxes(2, 3)
        vb = v[:, :, :n].reshape(B, Hk, n // block, block, v.shape[-1])
        out = (pb @ vb).astype(mx.float32).sum(axis=2)
    if n < S:
        rest = (p[..., n:] @ v[:, :, n:]).astype(mx.float32)
        out = rest if out is None else out + rest
    return out.astype(q.dtype).reshape(B, Hq, T, v.shape[-1])


# --------------------------------------------------------------------------
# Split-K decode attention kernel (kernels/cuda/gqa_decode_{partial,combine})
# --------------------------------------------------------------------------

#: Most warps one split-K launch aims for: keys per warp are the smallest of
#: 32..1024 that keeps ``B * Hk * ceil(S / block)`` within it (about 16 warps
#: per H200 SM: enough loads in flight, few partials for the second pass).
_SPLIT_KERNEL_WARPS = 3072
#: Warps per thread block of the first pass (each its own block of keys).
_SPLIT_CTA_WARPS = 2
#: Warps of the second pass's thread block per query head (at most 16): they
#: share its key blocks' partials, so even 512 blocks are 16 steps of loads.
_COMBINE_WARPS = 16


def _split_kernel_block(B: int, Hk: int, S: int) -> int:
    for block in (32, 64, 128, 256, 512):
        if B * Hk * -(-S // block) <= _SPLIT_KERNEL_WARPS:
            return block
    return 1024


#: The lane-group first pass (``attn-lanes``,
#: ``kernels/cuda/gqa_decode_partial_lanes.cu``): LPK lanes per key, WARPS
#: warps per thread block sharing its key block and merging their partials in
#: shared memory. Thread blocks one launch aims for: about one per H200 SM (132;
#: at 214 registers per thread, the model's build, one block of 8 warps fits an
#: SM), and at 4K keys 64 partials per query head, two steps of loads for the
#: second pass's 16 warps. A reasoned choice, not a measured one (end to end
#: on the H200 the pass measured faster than the lane-per-key one in one run,
#: slower in two later ones).
_LANES_CTAS = 128
_LANES_WARPS = 8
#: Most lanes per key (8: a bf16 K row of 256 elements is 4 16-byte loads per
#: lane and a warp step takes 4 keys).
_LANES_LPK = 8
#: Keys from which the lane-per-key first pass runs even with ``attn-lanes``
#: on: at 64K and more that pass is bandwidth-bound already (about 2,000 warps).
_LANES_MAX_KEYS = 65536


def _lanes_params(B: int, Hk: int, S: int, G: int, D: int,
                  dtype: mx.Dtype) -> Optional[tuple[int, int, int]]:
    """``(BLOCK, LPK, WARPS)`` of the lane-group first pass, or None where it does not build.

    LPK is the most lanes per key, up to :data:`_LANES_LPK`, that split a K
    row's 16-byte pieces evenly; BLOCK (keys per thread block, one partial per
    query head) the smallest value of the ladder ``R x 1, 1.25, 1.5, 1.75, 2,
    2.5, ...`` (R = one round of steps, ``32 / LPK * WARPS`` keys: no idle warp but
    in the last block) that keeps ``B * Hk * ceil(S / BLOCK)`` thread blocks
    within :data:`_LANES_CTAS` (one block of all S keys per (b, KV head) where
    ``B * Hk`` alone is more). BLOCK is a template value, so the ladder keeps a
    growing cache at four builds per doubling. At Qwen3.6's shape (B 1, Hk 2,
    G 8, D 256, bf16) LPK is 8 and BLOCK 64 / 80 / 512 / 2,048 at 4,096 /
    4,352 / 32K / 128K keys: 128, 110, 128, 128 blocks of 8 warps; 32 at 1,000
    keys (64 blocks). None for
    ``G * D > 2048`` (a lane's ``G x D / 32`` float32 o, with the loads in
    flight, would spill).
    """
    if G * D > 2048:
        return None
    pieces = D * dtype.size // 16  # 16-byte pieces per K row
    lpk = next((n for n in (_LANES_LPK, 4, 2) if n <= _LANES_LPK and pieces % n == 0), None)
    if lpk is None:
        return None
    kps = 32 // lpk  # keys per warp step
    per = max(1, _LANES_CTAS // (B * Hk))  # thread blocks per (b, KV head)
    need = max(kps * _LANES_WARPS, kps * -(-S // (per * kps)))
    # BLOCK is a template value (one JIT build each) and a decode cache grows:
    # take it from the ladder round x 1, 1.25, 1.5, 1.75, 2, 2.5, ... (steps of a
    # quarter of the power of two below, all multiples of a step): four builds
    # per doubling of the cache, not one per 256 keys.
    block = kps * _LANES_WARPS
    while block < need:
        block += (1 << (block.bit_length() - 1)) // 4
    return block, lpk, _LANES_WARPS


@functools.lru_cache(maxsize=None)
def _split_objects(backend: str):
    # CUDA only: no Metal source (Metal keeps MLX's fused SDPA for decode).
    part = build_kernel("gqa_decode_partial", backend, ensure_row_contiguous=False)
    comb = build_kernel("gqa_decode_combine", backend, ensure_row_contiguous=False)
    return None if part is None or comb is None else (part, comb)


@functools.lru_cache(maxsize=None)
def _lanes_object(backend: str):
    # The lane-group first pass (attn-lanes); its second pass is gqa_decode_combine.
    return build_kernel("gqa_decode_partial_lanes", backend, ensure_row_contiguous=False)


def _lanes_usable(backend: str, q: mx.array, k: mx.array) -> bool:
    """Whether the lane-group first pass takes this shape and builds here (any S)."""
    B, Hq, _, D = q.shape
    Hk = k.shape[1]
    return (_lanes_params(B, Hk, k.shape[2], Hq // Hk, D, q.dtype) is not None
            and _lanes_object(backend) is not None)


def _row_mask(mask: Mask, B: int, S: int) -> tuple[bool, Optional[mx.array]]:
    """(usable, mask) for the kernel pair: None, or a boolean mask with one row of
    ``S`` keys per batch row (``[1 or B, 1, ..., 1, S]``), read as it is."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True, None  # one query row at the end of the cache: no key masked
    # Rank 4 only: under broadcasting a lower rank's first axis is not the batch.
    if isinstance(mask, str) or mask.dtype != mx.bool_ or mask.ndim != 4:
        return False, None
    if mask.shape[-1] != S or mask.shape[0] not in (1, B) or any(d != 1 for d in mask.shape[1:-1]):
        return False, None
    return True, mask


def _split_kernel_call(backend: str, q, k, v, scale: float, mask, gate=None,
                       block: Optional[int] = None, lanes: bool = False) -> mx.array:
    # lanes: the lane-group first pass (gqa_decode_partial_lanes; the caller
    # checked _lanes_usable), whose block is its thread block's keys.
    part, comb = _split_objects(backend)
    B, Hq, _, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    has_mask = mask is not None
    m = mask if has_mask else padded_zeros(mx.bool_)  # not read without HAS_MASK
    if lanes:
        lblock, lpk, warps = _lanes_params(B, Hk, S, Hq // Hk, D, q.dtype)
        block = block or lblock
        nb = -(-S // block)
        part, extra, ctas = _lanes_object(backend), [("LPK", lpk), ("WARPS", warps)], nb
    else:
        block = block or _split_kernel_block(B, Hk, S)
        nb = -(-S // block)
        warps, extra, ctas = _SPLIT_CTA_WARPS, [], -(-nb // _SPLIT_CTA_WARPS)
    o, ml = part(inputs=[q, k, v, m, f32_scalar(float(scale))],
                 template=[("InT", q.dtype), ("D", D), ("G", Hq // Hk), ("BLOCK", block),
                           *extra, ("HAS_MASK", has_mask)],
                 grid=(32 * warps * ctas, Hk, B), threadgroup=(32 * warps, 1, 1),
                 output_shapes=[(B, Hq, nb, D), (B, Hq, nb, 2)],
                 output_dtypes=[mx.float32, mx.float32])
    has_gate = gate is not None
    (out,) = comb(inputs=[o, ml, gate if has_gate else padded_zeros(q.dtype)],
                  template=[("OutT", q.dtype), ("D", D), ("HAS_GATE", has_gate)],
                  grid=(32 * _COMBINE_WARPS, Hq, B), threadgroup=(32 * _COMBINE_WARPS, 1, 1),
                  output_shapes=[(B, 1, Hq * D) if has_gate else (B, Hq, 1, D)],
                  output_dtypes=[q.dtype])
    return out


def split_kernel_ready(q: mx.array, k: mx.array, v: mx.array, mask: Mask,
                       gate: Optional[mx.array] = None, lanes: bool = False) -> Optional[str]:
    """The GPU backend whose split-K decode attention kernel may run this call, or None.

    One query row, ``Hq / Hk`` at most 16, ``D`` a multiple of 32 up to 256
    for q, k and v, float32 / bf16 / f16, no mask or a boolean one with one
    row of keys per batch row (``[1 or B, 1, 1, S]``: mlx-lm's decode and the
    compiled step's), and an output ``gate`` (``[B, 1, Hq, D]``, dtype of q)
    or none. CUDA only (``kernels/cuda/gqa_decode_{partial,combine}.cu``),
    built only once its manifest entry records a GPU verification or with
    ``QAB_UNVERIFIED_KERNELS=1``, and self-checked once per (Hq, Hk, D,
    dtype) against :func:`gqa_attention_ops` (and :func:`gate_output`) on a
    KV-cache-like strided view with batch 2: without a mask, with a row per
    batch row, with one row for both and the gate, and with several key tiles
    per warp, so the compiled decode step (masked, gated) never self-checks
    inside its trace after an eager first token (unmasked). A row whose keys
    are all masked gives NaN (MLX's SDPA gives the mean of V); decode never
    has one (the new key is always allowed).

    With ``lanes`` (``attn-lanes``) and where the lane-group first pass
    (``kernels/cuda/gqa_decode_partial_lanes.cu``) takes the shape and builds,
    the self-check also runs that pass on the same inputs (one round of steps
    per warp, and 8 steps per warp), under its own verdict: a call may take
    either first pass (:func:`gqa_decode_attention_gated` keeps the
    lane-per-key one from :data:`_LANES_MAX_KEYS` keys).

    Returns:
        Optional[str]: ``"cuda"``, or None.
    """
    if envs.kernels_disabled():
        return None
    backend = gpu_backend()
    if backend != "cuda" or q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[2] != 1:
        return None
    B, Hq, _, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if (Hq % Hk or Hq // Hk > 16 or D % 32 or D > 256 or k.shape[-1] != D
            or v.shape[-1] != D or q.dtype not in (mx.float32, mx.bfloat16, mx.float16)
            or k.dtype != q.dtype or v.dtype != q.dtype or k.shape[0] != B
            or v.shape[:3] != k.shape[:3]):
        return None
    if not _row_mask(mask, B, S)[0]:
        return None
    if gate is not None and (gate.shape != (B, 1, Hq, D) or gate.dtype != q.dtype):
        return None
    if _split_objects(backend) is None:
        return None
    lanes = lanes and _lanes_usable(backend, q, k)
    key = (Hq, Hk, D, str(q.dtype), lanes)

    def make_inputs():
        kq, kk, kv, km, kg = mx.random.split(mx.random.key(7), 5)
        S_ = 777  # a partial last block; the cache's view: [:, :, :S] of a longer buffer
        q_ = mx.random.normal((2, Hq, 1, D), key=kq).astype(q.dtype)
        k_ = mx.random.normal((2, Hk, S_ + 256, D), key=kk).astype(q.dtype)[:, :, :S_]
        v_ = mx.random.normal((2, Hk, S_ + 256, D), key=kv).astype(q.dtype)[:, :, :S_]
        # A row of keys per batch row, and the compiled step's one row for all.
        m_ = mx.random.uniform(shape=(2, 1, 1, S_), key=km) > 0.2
        # The layer's gate: the second half of each head's q_proj output (strided).
        g_ = mx.split(mx.random.normal((2, 1, Hq, 2 * D), key=kg).astype(q.dtype), 2, axis=-1)[1]
        return q_, k_, v_, m_, g_

    def kernel(q_, k_, v_, m_, g_):
        out = []
        for lane_pass in (False, True) if lanes else (False,):
            out += [_split_kernel_call(backend, q_, k_, v_, D ** -0.5, None, lanes=lane_pass),
                    _split_kernel_call(backend, q_, k_, v_, D ** -0.5, m_, lanes=lane_pass),
                    _split_kernel_call(backend, q_, k_, v_, D ** -0.5, m_[:1], g_,
                                       lanes=lane_pass),
                    # Several 32-key tiles per warp (lanes: 256 keys per thread
                    # block, 8 steps of 4 keys per warp at LPK 8), as long caches run.
                    _split_kernel_call(backend, q_, k_, v_, D ** -0.5, m_,
                                       block=256 if lane_pass else 128, lanes=lane_pass)]
        return out

    def reference(q_, k_, v_, m_, g_):
        masked = gqa_attention_ops(q_, k_, v_, D ** -0.5, m_)
        return [gqa_attention_ops(q_, k_, v_, D ** -0.5, None), masked,
                gate_output(gqa_attention_ops(q_, k_, v_, D ** -0.5, m_[:1]), g_),
                masked] * (2 if lanes else 1)

    tol = 1e-4 if q.dtype == mx.float32 else 2e-2
    ok = self_checked("gqa_decode_attention", backend, key, kernel=kernel, reference=reference,
                      make_inputs=make_inputs, rtol=tol)
    return backend if ok else None


def gqa_decode_attention_gated(q: mx.array, k: mx.array, v: mx.array, scale: float,
                               mask: Mask, gate: mx.array,
                               lanes: bool = False) -> Optional[mx.array]:
    """One decode token's gated attention in two launches, or None where the kernel cannot run.

    ``gate_output(gqa_attention_ops(q, k, v, scale, mask), gate)``, i.e.
    Qwen3-Next's full attention between its projections and ``o_proj``, as
    the split-K kernel pair (``kernels/cuda/gqa_decode_{partial,combine}``):
    the first pass reads each K and V row once for the ``Hq / Hk`` query
    heads sharing it (GQA packing) over blocks of keys, online softmax in
    float32; the second merges the blocks and multiplies by the sigmoid gate,
    rounding as mlx-lm's ``out * mx.sigmoid(gate)``. Inputs are read through
    their strides (the KV cache's views, the gate's half of ``q_proj``), so
    no copy or transpose runs around the two launches. The algorithm is
    flash-decoding (Dao et al., "Flash-Decoding for long-context inference",
    2023) with GQA packing.

    Args:
        q (mx.array): the token's queries after RoPE.
        k (mx.array): cached keys (the new one written).
        v (mx.array): cached values.
        scale (float): score scale.
        mask (None | str | mx.array): None, ``"causal"`` (one row: nothing
            masked) or a boolean row of keys per batch row.
        gate (mx.array): gate logits, dtype of q.
        lanes (bool): the ``attn-lanes`` first pass
            (``kernels/cuda/gqa_decode_partial_lanes.cu``: several lanes per
            key, several warps per key block) below :data:`_LANES_MAX_KEYS`
            keys, where it builds and takes the shape; else the lane-per-key
            one. Default False (the attention layer passes its
            ``decode_lanes``, set by the opt-in ``attn-lanes``).

    Returns:
        mx.array | None: the gated output, dtype of q; None when
        :func:`split_kernel_ready` declines (no CUDA, another mask form,
        shapes or dtypes the kernel does not take, a failed self-check):
        the caller runs the MLX path.

    Shapes:
        q: ``[B, Hq, 1, D]``; k, v: ``[B, Hk, S, D]``; gate: ``[B, 1, Hq, D]``;
        mask: ``[1 or B, 1, 1, S]``; returns ``[B, 1, Hq * D]``
    """
    backend = split_kernel_ready(q, k, v, mask, gate, lanes=lanes)
    if backend is None:
        return None
    lanes = lanes and k.shape[2] < _LANES_MAX_KEYS and _lanes_usable(backend, q, k)
    return _split_kernel_call(backend, q, k, v, scale, _row_mask(mask, q.shape[0], k.shape[2])[1],
                              gate, lanes=lanes)


# --------------------------------------------------------------------------
# In-place KV cache write for the compiled decode step (kernels/*/kv_cache_write)
# --------------------------------------------------------------------------


def decode_kv_mask(S: int, offset: mx.array) -> mx.array:
    """Bool mask ``s <= offset`` over a KV buffer of ``S`` positions, ``[1, 1, 1, S]``: the
    keys a one-token query at position ``offset`` attends (the rows written so far)."""
    return (mx.arange(S) <= offset.reshape(())).reshape(1, 1, 1, -1)


def kv_cache_write_ops(k_new: mx.array, v_new: mx.array, k_buf: mx.array, v_buf: mx.array,
                       offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Portable reference of :func:`kv_cache_write`: new buffers instead of in-place writes.

    Args:
        k_new (mx.array): the token's keys. v_new (mx.array): its values.
        k_buf (mx.array): key buffer. v_buf (mx.array): value buffer.
        offset (mx.array): ``[1]`` int32 position written (``< S``).

    Returns:
        tuple[mx.array, mx.array, mx.array]: ``(k_buf', v_buf', mask)`` with
        row ``offset`` replaced and the bool mask ``s <= offset``.

    Shapes:
        k_new, v_new: ``[B, Hk, 1, D]``; k_buf, v_buf: ``[B, Hk, S, D]``;
        mask: ``[1, 1, 1, S]``
    """
    start = offset.reshape(1)
    kb = mx.slice_update(k_buf, k_new.astype(k_buf.dtype), start, axes=(2,))
    vb = mx.slice_update(v_buf, v_new.astype(v_buf.dtype), start, axes=(2,))
    return kb, vb, decode_kv_mask(k_buf.shape[2], offset)


@functools.lru_cache(maxsize=None)
def _kv_write_object(backend: str):
    return build_kernel("kv_cache_write", backend, ensure_row_contiguous=False)


def kv_write_ready(k_new: mx.array, k_buf: mx.array) -> Optional[str]:
    """The GPU backend whose in-place KV cache write kernel may run, or None.

    Four-dimensional ``[B, Hk, 1, D]`` new rows and ``[B, Hk, S, D]`` buffers
    of one float dtype. CUDA (built once its manifest entry records a GPU
    verification, or with ``QAB_UNVERIFIED_KERNELS=1``) and Metal, each after
    a self-check against :func:`kv_cache_write_ops` on its own buffers (a
    strided view with rows around the written one). Call it outside
    ``mx.compile`` (the check evaluates arrays).

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None.
    """
    if envs.kernels_disabled():
        return None
    backend = gpu_backend()
    if (backend is None or k_new.ndim != 4 or k_buf.ndim != 4 or k_new.shape[2] != 1
            or k_new.shape[:2] != k_buf.shape[:2] or k_new.shape[3] != k_buf.shape[3]
            or k_buf.dtype not in (mx.float32, mx.bfloat16, mx.float16)):
        return None
    if _kv_write_object(backend) is None:
        return None
    dtype = k_buf.dtype

    S = 300  # the buffers' view: [:, :, :S] of a longer buffer (strides not packed)

    def make_inputs():
        kk, kv, kb, vb = mx.random.split(mx.random.key(5), 4)
        B, Hk, D = 2, 2, 64
        # New rows as the layer makes them: slices of one concatenated
        # projection [B, 1, 3 Hk D] (proj-concat), split into heads and
        # transposed; with B = 2 their strides are not the packed ones.
        def rows(key):
            proj = mx.random.normal((B, 1, 3 * Hk * D), key=key).astype(dtype)
            return mx.split(proj, 3, axis=-1)[1].reshape(B, 1, Hk, D).transpose(0, 2, 1, 3)

        k_new, v_new = rows(kk), rows(kv)
        k_full = mx.random.normal((B, Hk, S + 40, D), key=kb).astype(dtype)
        v_full = mx.random.normal((B, Hk, S + 40, D), key=vb).astype(dtype)
        return k_new, v_new, k_full, v_full, mx.array(257, dtype=mx.int32)

    def kernel(k_new, v_new, k_full, v_full, offset):
        # Private copies (the kernel writes its buffers), evaluated first.
        kf, vf = k_full * 1, v_full * 1
        mx.eval(kf, vf)
        kb, vb = kf[:, :, :S], vf[:, :, :S]
        mask = kv_cache_write(backend, k_new, v_new, kb, vb, offset)
        mx.eval(mask)
        return [kb, vb, mask.astype(mx.float32)]

    def reference(k_new, v_new, k_full, v_full, offset):
        kb, vb, mask = kv_cache_write_ops(k_new, v_new, k_full[:, :, :S], v_full[:, :, :S],
                                          offset)
        return [kb, vb, mask.astype(mx.float32)]

    ok = self_checked("kv_cache_write", backend, (str(dtype),), kernel=kernel,
                      reference=reference, make_inputs=make_inputs, rtol=0.0)
    return backend if ok else None


def kv_cache_write(backend: str, k_new: mx.array, v_new: mx.array, k_buf: mx.array,
                   v_buf: mx.array, offset: mx.array) -> mx.array:
    """Write one token's keys and values into the KV cache buffers IN PLACE; return the mask.

    ``k_buf[:, :, offset] = k_new`` and ``v_buf[:, :, offset] = v_new`` with
    no copy of the buffers (``kernels/{cuda,metal}/kv_cache_write``): MLX's
    ``slice_update`` copies a buffer it cannot donate, and in a pipelined
    decode the previous token's attention still holds it, so every token
    copied every full-attention layer's buffers (on the H200 at 128K keys,
    ~1 ms per layer). MLX does not know the buffers change, so:

    * the caller must own ``k_buf`` / ``v_buf`` exclusively (no other array
      may share their memory; ``decode.py`` makes a private copy first), and
    * the returned mask must be an input of every op that reads the buffers
      in this step (the only dependency ordering the reads after the write).

    Call only after :func:`kv_write_ready` returned ``backend``.

    Args:
        backend (str): ``"cuda"`` / ``"metal"``.
        k_new (mx.array): keys, dtype of ``k_buf``, any strides. v_new (mx.array): values.
        k_buf (mx.array): key buffer (written). v_buf (mx.array): value buffer (written).
        offset (mx.array): integer position of the new row (``< S``), one element
            of any shape (a 0-d array in the compiled step).

    Returns:
        mx.array: bool mask ``s <= offset``, ``[1, 1, 1, S]``.
    """
    S = k_buf.shape[2]
    B, Hk, _, D = k_new.shape
    n = max(S, B * Hk * D)
    # Rows and offset go in as they come (the kernel reads through strides):
    # a contiguous copy or reshape would be one more primitive per layer that
    # the host encodes every token. A 0-d offset reaches a CUDA kernel as a
    # pointer, but a Metal kernel as a reference, so Metal gets it as [1].
    offset = offset.astype(mx.int32)
    if backend == "metal" and offset.ndim != 1:
        offset = offset.reshape(1)
    (mask,) = _kv_write_object(backend)(
        inputs=[k_new, v_new, k_buf, v_buf, offset],
        template=[("InT", k_buf.dtype)],
        grid=(-(-n // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(1, 1, 1, S)], output_dtypes=[mx.bool_])
    return mask


# --------------------------------------------------------------------------
# One decode token's full-attention core in one launch (kernels/cuda/gqa_decode_step)
# --------------------------------------------------------------------------


#: KV buffer rows from which the attention layer keeps the kernel pair (its
#: lane-per-key first pass) instead of :func:`gqa_decode_step` where the step's
#: pass is the lane-group one (as ``attn-lanes`` stops at :data:`_LANES_MAX_KEYS`);
#: the step's tensor-core build runs from here on too (``attn-step-long``; H100,
#: same run: 64K 230.1 vs 195.3 tok/s, 128K 225.9 vs 180.6).
STEP_MAX_KEYS = _LANES_MAX_KEYS


def gqa_decode_step_ops(qkv: mx.array, q_weight: mx.array, k_weight: mx.array,
                        k_buf: mx.array, v_buf: mx.array, offset: mx.array, *, heads: int,
                        q_eps: float, k_eps: float, rope: RopeSpec,
                        scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """Portable reference of :func:`gqa_decode_step`: new buffers instead of in-place writes.

    Stock Qwen3-Next attention between its projections and ``o_proj`` for one
    token: the projection row split into query heads with their gates, keys
    and values; q/k RMSNorm and RoPE (:func:`prep_qk`); the row written at
    ``offset`` (:func:`kv_cache_write_ops`); attention over keys
    ``0..offset`` (:func:`gqa_attention_ops`); the sigmoid gate
    (:func:`gate_output`).

    Args:
        qkv (mx.array): the concatenated ``q_proj | k_proj | v_proj`` output of the token.
        q_weight (mx.array): ``[D]`` query RMSNorm weight. k_weight (mx.array): key's.
        k_buf (mx.array): key cache buffer. v_buf (mx.array): value cache buffer.
        offset (mx.array): the token's position (``< S``), int32, one element.
        heads (int): query heads Hq.
        q_eps (float): query RMSNorm epsilon. k_eps (float): key's.
        rope (RopeSpec): the plain RoPE. scale (float): score scale.

    Returns:
        tuple[mx.array, mx.array, mx.array]: ``(out, k_buf', v_buf')``, out
        in the promoted dtype of the inputs.

    Shapes:
        qkv: ``[B, 1, Hq * 2 D + 2 Hk D]``; k_buf, v_buf: ``[B, Hk, S, D]``;
        out: ``[B, 1, Hq * D]``
    """
    B = qkv.shape[0]
    Hk, D = k_buf.shape[1], k_buf.shape[3]
    qg, k, v = mx.split(qkv, [heads * 2 * D, heads * 2 * D + Hk * D], axis=-1)
    q, gate = mx.split(qg.reshape(B, 1, heads, 2 * D), 2, axis=-1)
    q, k = prep_qk(q, k.reshape(B, 1, Hk, D), q_weight, k_weight, q_eps=q_eps, k_eps=k_eps,
                   rope=rope, offset=offset.reshape(()))
    v = v.reshape(B, 1, Hk, D).transpose(0, 2, 1, 3)
    kb, vb, mask = kv_cache_write_ops(k.astype(k_buf.dtype), v.astype(v_buf.dtype), k_buf, v_buf,
                                      offset.reshape(()))
    return gate_output(gqa_attention_ops(q, kb, vb, scale, mask), gate), kb, vb


def _step_mma(G: int, D: int, dtype: mx.Dtype, mma: bool = True) -> bool:
    # Whether the step's build runs its key pass on tensor cores
    # (``kernels/cuda/gqa_mma.cuh``: mma.sync for q k and p v, the probabilities
    # split into two 16-bit parts): asked for (``mma``, the layer's
    # ``decode_mma``), and bf16 / f16 inputs with G <= 8 and D a multiple of 64
    # up to 256; else the lane-group pass of ``attn-lanes``. Measured on the
    # H200 at Qwen3.6's shape (``benchmarks/profile_attention_decode.py
    # --timeline``): see "Inside the step" in benchmarks/PERFORMANCE.md.
    return (mma and dtype in (mx.bfloat16, mx.float16) and G <= 8 and D % 64 == 0
            and D <= 256)


#: Key blocks per (batch row, KV head) above which :func:`gqa_decode_step`
#: merges them in two levels (the kernel's ``PM``): at most this many rows per
#: query head are one round of loads for the single merging block. A reasoned
#: choice, not a measured one.
STEP_PM_MIN_BLOCKS = 16


def _step_groups(nb: int) -> int:
    """Groups of a two-level merge of ``nb`` key blocks (the kernel's NG: groups
    of ``ceil(sqrt(nb))`` key blocks)."""
    gs = max(1, math.isqrt(nb - 1) + 1) if nb > 1 else 1
    return -(-nb // gs)


def _step_pm(nb: int, merge_split: bool = False) -> bool:
    """Whether a :func:`gqa_decode_step` launch of ``nb`` key blocks per
    (batch row, KV head) merges them in two levels (the kernel's ``PM``: the
    last block of each group of ``ceil(sqrt(nb))`` key blocks merges the group,
    the last of those the groups): asked for (``merge_split``, the layer's
    ``decode_merge_split``) and more than :data:`STEP_PM_MIN_BLOCKS` key
    blocks."""
    return bool(merge_split) and nb > STEP_PM_MIN_BLOCKS


def _step_ms(G: int, merge_spread: bool = False, pm: bool = False) -> int:
    """Merging thread blocks per (batch row, KV head) of a :func:`gqa_decode_step`
    launch (the kernel's ``MS``): ``G``, one query head each, where asked for
    (``merge_spread``) and the merge is not in two levels (``pm``); else 0 (the
    last key block to finish merges every head of its KV head)."""
    return G if merge_spread and not pm else 0


@functools.lru_cache(maxsize=None)
def _step_object(backend: str):
    # CUDA only (no Metal source: Metal keeps the separate ops).
    return build_kernel("gqa_decode_step", backend, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=None)
def _step_params(q_eps: float, k_eps: float, rope_scale: float, base: float,
                 scale: float) -> mx.array:
    # [8] float32 (32 bytes: not MLX's small managed pool), evaluated once per value set.
    import numpy as np

    log2_base = float(np.log2(np.float32(base), dtype=np.float32))  # as MLX's rope
    a = mx.array([q_eps, k_eps, rope_scale, log2_base, scale, 0.0, 0.0, 0.0], dtype=mx.float32)
    mx.eval(a)
    return a


def step_counter(B: int, Hk: int) -> mx.array:
    """The counter of :func:`gqa_decode_step`: uint32 zeros, one per (batch row, KV head),
    then one per group of key blocks of its two-level merge (the most a launch
    of ``B`` rows and ``Hk`` KV heads makes, at :data:`_LANES_CTAS`).

    A real, evaluated buffer that each launch reads and leaves at zero (its
    last thread block per (row, head) resets its element, each group's last
    its group's), so launches that share one must not overlap: one per
    attention layer, used inside the compiled decode step (its launches run
    one after another). At least 16 bytes (:func:`ops.device.unpooled_length`).

    Raises:
        ValueError: if ``B`` or ``Hk`` is below 1.
    """
    if B < 1 or Hk < 1:
        raise ValueError(f"a step counter needs B >= 1 and Hk >= 1, got B={B}, Hk={Hk}")
    groups = _step_groups(max(1, _LANES_CTAS // (B * Hk)))
    c = mx.zeros((unpooled_length(B * Hk * (1 + groups), mx.uint32),), dtype=mx.uint32)
    mx.eval(c)
    return c


def _step_launch(qkv: mx.array, k_buf: mx.array, heads: int, rope: RopeSpec,
                 counter: mx.array, mma: bool = True, merge_split: bool = False,
                 merge_spread: bool = False) -> tuple[dict, int]:
    """A :func:`gqa_decode_step` launch's keywords but its inputs (template,
    grid, threadgroup, output shapes and dtypes) and its thread blocks (for a
    caller's extra output, e.g. the timeline build's marks).

    Raises:
        ValueError: if ``counter`` is too short for the launch's counts.
    """
    B = qkv.shape[0]
    Hk, S, D = k_buf.shape[1], k_buf.shape[2], k_buf.shape[3]
    G = heads // Hk
    block, lpk, warps = _lanes_params(B, Hk, S, G, D, qkv.dtype)
    nb = -(-S // block)
    pm = _step_pm(nb, merge_split)
    groups = _step_groups(nb) if pm else 0
    ms = _step_ms(G, merge_spread, pm)
    need = B * Hk * (1 + max(groups, 1 if ms else 0))  # MS: the tickets after the counts
    if counter.size < need:
        raise ValueError(f"gqa_decode_step: {nb} key blocks merged in {groups} groups"
                         f"{' by merging blocks' if ms else ''} need a counter of >= {need} "
                         f"elements (step_counter), got {counter.size}")
    return dict(
        template=[("InT", qkv.dtype), ("D", D), ("G", G), ("R", rope.dims),
                  ("TRAD", rope.traditional), ("BLOCK", block), ("LPK", lpk),
                  ("WARPS", warps), ("MMA", _step_mma(G, D, qkv.dtype, mma)), ("PM", pm),
                  ("MS", ms)],
        grid=(32 * warps * (nb + ms), Hk, B), threadgroup=(32 * warps, 1, 1),
        # The workspace: the key blocks' partials o [B, Hq, nb, D] then (m, l)
        # [B, Hq, nb, 2], one output (MLX's host cost grows per output).
        # With PM the groups' partials o2, (m, l)2 [B, Hq, groups, ...] follow.
        output_shapes=[(B, 1, heads * D), (B * heads * (nb + groups) * (D + 2),)],
        output_dtypes=[qkv.dtype, mx.float32]), (nb + ms) * Hk * B


def _step_call(backend: str, qkv: mx.array, q_weight: mx.array, k_weight: mx.array,
               k_buf: mx.array, v_buf: mx.array, offset: mx.array, heads: int, q_eps: float,
               k_eps: float, rope: RopeSpec, scale: float, counter: mx.array,
               mma: bool = True, merge_split: bool = False,
               merge_spread: bool = False) -> mx.array:
    launch, _ = _step_launch(qkv, k_buf, heads, rope, counter, mma, merge_split, merge_spread)
    params = _step_params(float(q_eps), float(k_eps), float(rope.scale), float(rope.base),
                          float(scale))
    out, _ = _step_object(backend)(
        inputs=[qkv, q_weight, k_weight, params, offset, k_buf, v_buf, counter], **launch)
    return out


def _step_shapes_ok(B: int, Hq: int, Hk: int, D: int, dtype: mx.Dtype,
                    rope: Optional[RopeSpec]) -> bool:
    if (rope is None or B < 1 or Hk < 1 or Hq % Hk or Hq // Hk > 16 or not _qk_rope_fits(D, rope)
            or dtype not in (mx.float32, mx.bfloat16, mx.float16)):
        return False
    # The lane-group pass's build (LPK dividing a K row's 16-byte pieces, its float32 o).
    return _lanes_params(B, Hk, 1, Hq // Hk, D, dtype) is not None


def step_kernel_ready(B: int, Hq: int, Hk: int, D: int, dtype: mx.Dtype,
                      rope: Optional[RopeSpec], mma: bool = True,
                      merge_split: bool = False, merge_spread: bool = False) -> Optional[str]:
    """The GPU backend whose one-launch decode attention step may run, or None.

    :func:`gqa_decode_step` takes a plain RoPE (``rope`` not None) as the
    q/k preparation kernel does (R even, ``(R / 2) % (D / 32) == 0``,
    traditional: ``D / 32`` even), ``D`` a multiple of 32 up to 256,
    ``Hq / Hk`` at most 16 with ``G * D <= 2048`` (the lane-group pass),
    float32 / bf16 / f16 with norm weights and KV buffers of that dtype. CUDA
    only (``kernels/cuda/gqa_decode_step.cu``), built once its manifest entry
    records a GPU verification or with ``QAB_UNVERIFIED_KERNELS=1``, and
    self-checked once per ``(Hq, Hk, D, dtype, rope)`` against
    :func:`gqa_decode_step_ops` (output and both written buffers) on a
    strided cache view of batch 2 with key blocks past the token. The check
    evaluates only arrays of its own, so it may run while a compiled step
    traces. ``mma``: the build :func:`gqa_decode_step` will run with that
    ``mma`` (its key pass on tensor cores where the shapes allow;
    each build is checked on its own) and ``merge_split`` (the two-level merge
    where :func:`_step_pm` allows it: then checked too, on its own, where the
    check's launch has enough key blocks, as it has for any shape here;
    launches with fewer run the one-level build) and ``merge_spread`` (the
    merge in ``G`` merging blocks, :func:`_step_ms`: then checked too, on its
    own, where the two-level merge does not apply).

    Returns:
        Optional[str]: ``"cuda"``, or None.
    """
    if envs.kernels_disabled():
        return None
    backend = gpu_backend()
    if backend != "cuda" or not _step_shapes_ok(B, Hq, Hk, D, dtype, rope):
        return None
    if _step_object(backend) is None:
        return None
    use_mma = _step_mma(Hq // Hk, D, dtype, mma)
    key = (Hq, Hk, D, str(dtype), rope, use_mma)
    S = 777  # the cache's view: [:, :, :S] of a longer buffer
    off = 700  # key blocks past the token, a partial block holding it

    def make_inputs():
        kx, kw, kk, kv = mx.random.split(mx.random.key(13), 4)
        qkv = mx.random.normal((2, 1, Hq * 2 * D + 2 * Hk * D), key=kx).astype(dtype)
        w = (1.0 + 0.2 * mx.random.normal((2, D), key=kw)).astype(dtype)
        k_full = mx.random.normal((2, Hk, S + 40, D), key=kk).astype(dtype)
        v_full = mx.random.normal((2, Hk, S + 40, D), key=kv).astype(dtype)
        return qkv, w[0], w[1], k_full, v_full, mx.array(off, dtype=mx.int32)

    def kernel(qkv, qw, kw_, k_full, v_full, offset, split=False, spread=False):
        kf, vf = k_full * 1, v_full * 1  # private copies: the kernel writes them
        mx.eval(kf, vf)
        kb, vb = kf[:, :, :S], vf[:, :, :S]
        out = _step_call(backend, qkv, qw, kw_, kb, vb, offset, Hq, 1e-6, 1e-5, rope,
                         D ** -0.5, step_counter(2, Hk), mma=use_mma, merge_split=split,
                         merge_spread=spread)
        mx.eval(out)
        return [out, kb, vb]

    def reference(qkv, qw, kw_, k_full, v_full, offset):
        return list(gqa_decode_step_ops(qkv, qw, kw_, k_full[:, :, :S], v_full[:, :, :S],
                                        offset, heads=Hq, q_eps=1e-6, k_eps=1e-5, rope=rope,
                                        scale=D ** -0.5))

    # As the q/k kernel's check (RoPE at position 700) and the split pair's.
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    # The split merge's build where the check's own grid runs it (the rule of
    # _step_pm: where it does not, no launch's larger grid does either).
    block = _lanes_params(2, Hk, S, Hq // Hk, D, dtype)[0]
    pm = _step_pm(-(-S // block), merge_split)
    builds = [(False, False)] + ([(True, False)] if pm else [])
    if _step_ms(Hq // Hk, merge_spread, pm):
        builds.append((False, True))
    for split, spread in builds:
        ok = self_checked("gqa_decode_step", backend,
                          (*key, split) + (("spread",) if spread else ()),
                          kernel=functools.partial(kernel, split=split, spread=spread),
                          reference=reference, make_inputs=make_inputs, rtol=(tol, tol, tol))
        if not ok:
            return None
    return backend


def gqa_decode_step(qkv: mx.array, q_weight: mx.array, k_weight: mx.array, k_buf: mx.array,
                    v_buf: mx.array, offset: mx.array, counter: mx.array, *, heads: int,
                    q_eps: float, k_eps: float, rope: RopeSpec, scale: float,
                    mma: bool = True, merge_split: bool = False,
                    merge_spread: bool = False) -> mx.array:
    """One decode token's gated attention core in one CUDA launch; writes the KV cache IN PLACE.

    :func:`gqa_decode_step_ops` (q/k RMSNorm and RoPE, the KV row written at
    ``offset``, split-K attention over keys ``0..offset`` with GQA packing,
    the sigmoid output gate) as ``kernels/cuda/gqa_decode_step.cu``: four
    launches (``qk_norm_rope``, ``kv_cache_write``, the split-K pair) in
    one. The arithmetic is theirs (the q/k kernel's, the lane-group first
    pass's, the gate's rounding); only the merge of key blocks sums in
    another order. With ``mma``, bf16 / f16 inputs
    with ``Hq / Hk <= 8`` and ``D`` a multiple of 64 run the key pass on
    tensor cores (``kernels/cuda/gqa_mma.cuh``: mma.sync with float32
    accumulation; q k in the inputs' 16-bit type, as the four launches
    round q and k; the probabilities as two 16-bit parts, ~16 bits), which
    sums in yet another order. As :func:`kv_cache_write`, the caller must own ``k_buf``
    / ``v_buf`` exclusively (MLX does not know they change), and no other
    op of the step may read them. Call only after :func:`step_kernel_ready`
    said ``"cuda"`` for these shapes.

    Args:
        qkv (mx.array): the token's concatenated q/k/v projection (dtype of the buffers).
        q_weight (mx.array): ``[D]`` query RMSNorm weight. k_weight (mx.array): key's.
        k_buf (mx.array): key cache buffer (written). v_buf (mx.array): value's (written).
        offset (mx.array): the token's position (``< S``), int32, one element.
        counter (mx.array): :func:`step_counter` of ``(B, Hk)``, owned by the
            call site; launches sharing it must not overlap.
        heads (int): query heads Hq.
        q_eps (float): query RMSNorm epsilon. k_eps (float): key's.
        rope (RopeSpec): the plain RoPE. scale (float): score scale.
        mma (bool): the tensor-core key pass where it applies (default True;
            :func:`step_kernel_ready` must have said ``"cuda"`` with the same).
        merge_split (bool): the two-level merge where :func:`_step_pm` allows
            it (the last block of each group of key blocks merges the group,
            the last of those the groups; default False: the ``attn-merge-split``
            opt-in; ``step_kernel_ready`` with the same).
        merge_spread (bool): the merge in ``G`` more thread blocks per
            (batch row, KV head), one query head each, each row's elements
            spread over a block's warps, where the merge is not in two levels
            (:func:`_step_ms`; the same bits as the one-block merge; default
            False; ``step_kernel_ready`` with the same). The launch's blocks
            then take tickets as they start; a merging block (the last
            tickets) waits on the key blocks' count.

    Returns:
        mx.array: the gated attention output, dtype of ``qkv``.

    Raises:
        ValueError: naming the argument whose shape or dtype does not fit.

    Shapes:
        qkv: ``[B, 1, Hq * 2 D + 2 Hk D]``; weights ``[D]``; k_buf, v_buf:
        ``[B, Hk, S, D]``; counter ``>= B * Hk``; returns ``[B, 1, Hq * D]``
    """
    if k_buf.ndim != 4 or v_buf.shape != k_buf.shape:
        raise ValueError(f"gqa_decode_step: k_buf and v_buf must be one [B, Hk, S, D] shape, "
                         f"got {k_buf.shape} and {v_buf.shape}")
    B, Hk, _, D = k_buf.shape
    width = heads * 2 * D + 2 * Hk * D
    if qkv.shape != (B, 1, width):
        raise ValueError(f"gqa_decode_step: qkv must be [B, 1, Hq * 2 D + 2 Hk D] = "
                         f"{[B, 1, width]}, got {list(qkv.shape)}")
    if not (qkv.dtype == q_weight.dtype == k_weight.dtype == k_buf.dtype == v_buf.dtype):
        raise ValueError(f"gqa_decode_step: one dtype expected, got qkv {qkv.dtype}, weights "
                         f"{q_weight.dtype} / {k_weight.dtype}, buffers {k_buf.dtype} / "
                         f"{v_buf.dtype}")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"gqa_decode_step: norm weights must be [{D}], got "
                         f"{list(q_weight.shape)} / {list(k_weight.shape)}")
    if counter.dtype != mx.uint32 or counter.size < B * Hk:
        raise ValueError(f"gqa_decode_step: counter must be uint32 of >= {B * Hk} elements, "
                         f"got {counter.dtype} of {counter.size}")
    if offset.size != 1:
        raise ValueError(f"gqa_decode_step: offset must be one element, got {offset.shape}")
    return _step_call("cuda", qkv, q_weight, k_weight, k_buf, v_buf, offset.astype(mx.int32),
                      heads, q_eps, k_eps, rope, scale, counter, mma=mma,
                      merge_split=merge_split, merge_spread=merge_spread)


@functools.partial(mx.compile, shapeless=True)
def _sigmoid_gate(out: mx.array, gate: mx.array) -> mx.array:
    return out * mx.sigmoid(gate)


def gate_output(out: mx.array, gate: mx.array) -> mx.array:
    """Merge heads and apply the sigmoid output gate.

    Args:
        out (mx.array): attention output.
        gate (mx.array): gate logits, one per output feature of each head
            (the second half of each head's ``q_proj`` output).

    Returns:
        mx.array: gated output, promoted dtype of ``out`` and ``gate``.

    Shapes:
        out: ``[B, Hq, T, D]``; gate: ``[B, T, Hq * D]`` or ``[B, T, Hq, D]``;
        returns ``[B, T, Hq * D]``
    """
    b, h, t, d = out.shape
    if gate.ndim == 4:
        gate = gate.reshape(b, t, h * d)
    return _sigmoid_gate(out.transpose(0, 2, 1, 3).reshape(b, t, h * d), gate)


def score_block_rows(B: int, Hq: int, T: int, S: int,
                     budget: Optional[int] = None) -> int:
    """Query rows per attention call so that the scores fit the budget.

    Args:
        B (int): batch. Hq (int): query heads. T (int): query tokens.
        S (int): key/value tokens.
        budget (int, optional): bytes for one ``[B, Hq, rows, S]`` float32
            score matrix. Default :data:`SCORE_BLOCK_BYTES`.

    Returns:
        int: ``T`` when the whole matrix fits (one call), else the largest
        multiple of 16 rows that fits (at least 16, or T when T < 16).
    """
    budget = SCORE_BLOCK_BYTES if budget is None else budget
    per_row = max(1, B * Hq * S * 4)
    if T * per_row <= budget:
        return T
    rows = (budget // per_row) // 16 * 16
    return min(T, max(rows, 16))


def gqa_attention_blocked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Mask = None,
    *,
    rows: int,
    evaluate: bool = True,
) -> mx.array:
    """:func:`gqa_attention_ops` over blocks of ``rows`` query rows.

    Each block attends to the keys it may see: for ``"causal"`` (queries are
    the last T of the S positions, as in a chunked prefill after a cache),
    block ``[i, j)`` takes the first ``S - T + j`` keys with a causal mask;
    an array mask is sliced to the block's rows; None keeps every key.
    Softmax is per row, so the result equals one call's up to rounding of
    the matmuls. With ``evaluate`` each block is evaluated before the next is
    built, so the scores alive at once shrink to ``rows / T`` of one call's:
    left lazy, MLX encodes every block (and every layer of the chunk) ahead
    of the GPU and their buffers are all alive together (measured on the
    H200: a 2,048-token chunk at 128K context still peaked 20 GB above the
    weights with lazy blocks). Inside ``mx.compile`` the blocks stay lazy.

    Args:
        q (mx.array): queries. k (mx.array): keys. v (mx.array): values.
        scale (float): score scale.
        mask (None | str | mx.array): as :func:`gqa_attention_ops`.
        rows (int): query rows per block (>= 1).
        evaluate (bool): evaluate each block before building the next (a
            host sync per block). Default True.

    Returns:
        mx.array: ``[B, Hq, T, D]``, dtype of ``q``.

    Raises:
        ValueError: if ``rows < 1``, a string mask other than ``"causal"``, a
            causal mask with ``T > S``, or head counts that do not divide.

    Shapes:
        q: ``[B, Hq, T, D]``; k, v: ``[B, Hk, S, D]``; mask: ``[..., T, S]`` or
        broadcastable; returns ``[B, Hq, T, D]``
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    T, S = q.shape[2], k.shape[2]
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r} (expected None, 'causal' or an array)")
    if isinstance(mask, str) and T > S:
        raise ValueError(f"causal mask with more queries ({T}) than keys ({S})")
    if rows >= T:
        return gqa_attention_ops(q, k, v, scale, mask)
    outs = []
    for i in range(0, T, rows):
        j = min(T, i + rows)
        qb, kb, vb, mb = q[:, :, i:j], k, v, mask
        if isinstance(mask, str):
            end = S - T + j
            kb, vb = k[:, :, :end], v[:, :, :end]
        elif mask is not None and mask.ndim >= 2 and mask.shape[-2] == T:
            mb = mask[..., i:j, :]
        outs.append(gqa_attention_ops(qb, kb, vb, scale, mb))
        if evaluate:
            eval_outside_traces(outs[-1])
    return mx.concatenate(outs, axis=2)


def eval_outside_traces(a: mx.array) -> bool:
    """Evaluate ``a`` now unless a function transformation is tracing it.

    Bounds how far MLX's host runs ahead of the GPU (every buffer of the work
    encoded ahead stays alive until the GPU reaches it). Inside
    ``mx.compile`` / ``mx.vmap`` MLX refuses to evaluate (``ValueError``) and
    ``a`` stays lazy.

    Args:
        a (mx.array): any array.

    Returns:
        bool: True when ``a`` was evaluated, False inside a trace.
    """
    try:
        mx.eval(a)
        return True
    except ValueError:
        return False
