"""Mixture-of-experts ops for Qwen3.5 / Qwen3.6 MoE and Qwen3-Next.

The pieces, following the kernel / reference / dispatcher pattern:

* :func:`topk_route` — router softmax and top-k selection as one compiled
  graph that picks exactly the experts stock mlx-lm picks; with ``kernel``,
  one GPU kernel for the whole route (``kernels/{cuda,metal}/moe_router_topk``)
  that repeats the stock route's GPU arithmetic step for step, used after
  :func:`router_kernel_ready`.
* :func:`add_norm_route` — decode on CUDA: the decoder layer's residual
  add, post-attention RMSNorm, 8-bit router GEMV and route in one launch
  (``kernels/cuda/moe_add_norm_route``), used after
  :func:`add_norm_route_ready`; reference :func:`add_norm_route_ops`.
* :func:`moe_experts_ops` — the portable gathered SwiGLU expert computation:
  one gathered matmul over the concatenated gate+up weights ``[E, 2I, H]``,
  SiLU(gate) * up, the down projection and the score-weighted sum over K.
* :func:`moe_experts_dequant_gemm` — the prefill form for quantized experts:
  every expert's weights dequantized once per call to the activation dtype,
  then the same gathered SwiGLU as a floating-point grouped GEMM (rows sorted
  by expert), which MLX runs on its matrix units; the gathered 4-bit matmul
  does not.
* :func:`moe_experts_kernel` — decode on the GPU: two kernels, the K experts'
  4-bit gate+up rows with the SiLU gate in the epilogue, then the weighted
  down projections summed over K (``kernels/{cuda,metal}/moe_*_gemv``).
* :func:`moe_experts` — dispatcher: the decode kernels when they passed
  their self-check on this device (:func:`decode_kernel_ready`); else, for
  prefill, the grouped 4-bit GEMM kernel over rows sorted by expert
  (``kernels/{cuda,metal}/moe_grouped_gemm``) when it passed its self-check
  (:func:`grouped_gemm_ready`); else the dequantize-then-GEMM form for many
  rows of quantized experts; else :func:`moe_experts_ops`. Given the shared
  expert's output and gate logit it adds them too; after the grouped GEMM
  kernel, in one combine kernel with the un-sort and the weighted sum over K
  (``kernels/{cuda,metal}/moe_combine``, :func:`combine_kernel_ready`;
  reference :func:`moe_combine_ops`).
* :func:`moe_shared_experts_kernel` — decode with the shared expert folded
  in: the shared expert as the (K+1)-th expert of the two decode kernels and
  its gate logit in the first (``kernels/{cuda,metal}/moe_*_shared_gemv``),
  used after :func:`shared_decode_kernel_ready`; reference
  :func:`moe_shared_experts_ops` (:func:`moe_experts_ops` plus
  :func:`shared_expert_ops` and :func:`add_gated_shared`). On CUDA its second
  kernel may also apply the next decoder layer's input RMSNorm
  (:func:`moe_shared_experts_norm_kernel`, after :func:`shared_decode_norm_ready`).

Dimension names: B batch, T tokens, H hidden size, I expert FFN size,
E experts, K experts per token. ``...`` stands for any leading token axes
(usually ``B, T``); N is their product.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import mlx.core as mx

from qwen_apple_backend import envs

from .device import (build_kernel, cuda_sm_count, f32_scalar, gpu_backend, padded_zeros,
                     self_check_known, self_checked, unpooled_length)
from .norm import add_rms_norm_ops

__all__ = [
    "SORT_THRESHOLD",
    "ExpertWeights",
    "SortedTokens",
    "topk_route",
    "router_kernel_ready",
    "add_norm_route",
    "add_norm_route_ops",
    "add_norm_route_ready",
    "add_norm_route_supported",
    "ADD_NORM_ROUTE_MAX_ROWS",
    "ADD_NORM_ROUTE_MAX_D",
    "ROUTER_MAX_E",
    "ROUTER_MAX_K",
    "sort_by_expert",
    "gathered_matmul",
    "swiglu_experts_ops",
    "moe_experts_ops",
    "moe_experts_dequant_gemm",
    "dequantize_experts",
    "DEQUANT_GEMM_MIN_ROWS",
    "moe_experts_kernel",
    "decode_kernel_ready",
    "grouped_gemm_ready",
    "grouped_gemm_block_map",
    "moe_experts",
    "SharedExpertWeights",
    "shared_expert_ops",
    "add_gated_shared",
    "moe_shared_experts_ops",
    "moe_shared_experts_kernel",
    "moe_shared_experts_norm_kernel",
    "shared_decode_norm_ready",
    "fold_norm_counter",
    "serial_counter",
    "serial_decode_trace",
    "serial_decode_tracing",
    "serial_decode_compiling",
    "PackCheckDue",
    "pack_check_pass",
    "pack_check_passing",
    "pack_checks_due",
    "FOLD_NORM_MAX_ROWS",
    "shared_decode_kernel_ready",
    "moe_decode_block",
    "decode_block_ready",
    "decode_block_pack",
    "decode_block_pack_arrays",
    "decode_block_pack_bytes",
    "decode_block_pack_offsets",
    "decode_block_pack_segments",
    "decode_block_pack_views",
    "PACK_MAX_BYTES",
    "PACK_SEGMENTS",
    "decode_block_supported",
    "decode_block_counter_length",
    "DECODE_BLOCK_OPTIONS",
    "OutProjection",
    "out_projection_supported",
    "NextProjection",
    "next_projection_supported",
    "moe_combine_ops",
    "combine_kernel_ready",
]

# Stock SwitchGLU sorts (token, slot) rows by expert once there are at least
# this many of them (``indices.size``); kept equal so both pick the same path.
SORT_THRESHOLD = 64

# From this many (token, slot) rows (N * K) quantized experts run as
# dequantize-then-GEMM. Measured on an H200 (MLX 0.32.4 CUDA) at the
# Qwen3.6-35B-A3B shape (E=256, H=2048, I=512, K=8, 4-bit g64, bf16), experts
# only: 4096 tokens: gathered 4-bit matmul 44.0 ms, dequantize all experts
# 1.7 ms + bf16 gathered GEMM 4.6 ms (89 TFLOP/s); 512 tokens: 6.0 ms vs
# 1.9 + 3.4 ms. Memory: one layer's float experts are 1.6 GB at that shape,
# but the measured working memory of a whole-model 4K prefill is ~24 GB with
# this path against ~6 GB without (benchmarks/results/*mem-fix*): something
# inside MLX's CUDA gathered GEMM, not yet understood.
DEQUANT_GEMM_MIN_ROWS = 4096

# Where that path was measured to win: CUDA only. Metal's gathered 4-bit
# matmul is MLX's tuned kernel there, and dequantizing 0.8 G parameters per
# layer would cost more at Apple memory bandwidths; not measured, so not used.
DEQUANT_GEMM_BACKENDS = frozenset({"cuda"})


class ExpertWeights(NamedTuple):
    """One stacked per-expert linear projection, plain or quantized.

    Plain: ``weight`` is ``[E, O, In]`` floating point. Quantized: ``weight``
    is the packed ``[E, O, In * bits / 32]`` uint32 array with ``scales``
    (and, for affine mode, ``biases``) of shape ``[E, O, In / group_size]``,
    exactly as ``mx.quantize`` lays them out. Output features ``O`` are
    rows, so two projections with equal quantization settings concatenate
    along axis 1.

    Attributes:
        weight (mx.array): ``[E, O, In]`` weight or its packed form.
        scales (mx.array | None): quantization scales, None when plain.
        biases (mx.array | None): affine quantization biases.
        bias (mx.array | None): additive output bias ``[E, O]``.
        group_size (int | None): quantization group size along ``In``.
        bits (int | None): bits per quantized element.
        mode (str): quantization mode, ``"affine"`` by default.
        global_scale (mx.array | None): per-expert scale of ``nvfp4``.
    """

    weight: mx.array
    scales: Optional[mx.array] = None
    biases: Optional[mx.array] = None
    bias: Optional[mx.array] = None
    group_size: Optional[int] = None
    bits: Optional[int] = None
    mode: str = "affine"
    global_scale: Optional[mx.array] = None

    @property
    def quantized(self) -> bool:
        """Whether ``weight`` is packed (``scales`` present)."""
        return self.scales is not None


class SortedTokens(NamedTuple):
    """(token, slot) rows regrouped so rows of one expert are contiguous.

    Attributes:
        x (mx.array): ``[N*K, 1, H]`` token rows in expert order.
        inds (mx.array): ``[N*K]`` expert index of each row, ascending.
        order (mx.array): ``[N*K]`` flat (token, slot) position of each row.
        inv_order (mx.array): ``[N*K]`` inverse permutation of ``order``.
    """

    x: mx.array
    inds: mx.array
    order: mx.array
    inv_order: mx.array


# --------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _route_fn(top_k: int, norm_topk_prob: bool) -> Callable:
    # One compiled graph per (K, renormalise) pair; shapes specialise inside.
    def route(logits: mx.array):
        # The same primitives, in the same order, as the stock block: softmax
        # computed in float32 (precise) and rounded to the logits dtype, then
        # argpartition. Identical inputs to identical ops give the same
        # experts, including how near-ties and exact ties are broken, and the
        # same slot order, so the weighted sum over K adds in the same order.
        gates = mx.softmax(logits, axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-top_k, axis=-1)[..., -top_k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores

    return mx.compile(route)


def topk_route(
    logits: mx.array, top_k: int, norm_topk_prob: bool, kernel: Optional[str] = None
) -> tuple[mx.array, mx.array]:
    """Select the top-k experts per token from router logits.

    Softmax over experts (accumulated in float32, rounded to the logits
    dtype), top-k by argpartition, and renormalisation of the k kept
    probabilities when ``norm_topk_prob``. Matches ``Qwen3NextSparseMoeBlock``
    bit for bit, including the order of the K slots.

    With ``kernel`` (a backend that :func:`router_kernel_ready` returned for
    this dtype, E, K and ``norm_topk_prob``) the route is one launch of
    ``kernels/<backend>/moe_router_topk`` instead of about six MLX kernels.
    It repeats what the stock route computes with MLX's GPU kernels, as
    read from MLX's sources (see the kernel file), to give the same experts,
    the same slot order (ascending probability; of equal probabilities the
    higher expert index is kept and comes later, as the last K of MLX's
    stable GPU sort) and the same scores, except where its float32 softmax
    rounds a probability differently in the last bit
    (``tests/test_kernels_gpu.py`` measures how often on a GPU). No
    self-check and no host synchronisation happen here, so the call may sit
    inside ``mx.compile``; the kernel has no gradient.

    Args:
        logits (mx.array): router logits (float32, bfloat16 or float16 for
            the kernel).
        top_k (int): experts per token, ``1 <= top_k <= E``
            (``<= ROUTER_MAX_K`` for the kernel).
        norm_topk_prob (bool): renormalise the kept probabilities to sum 1.
        kernel (str | None): ``"cuda"`` / ``"metal"`` to route with the GPU
            kernel; None (default) for the portable compiled graph.

    Returns:
        tuple[mx.array, mx.array]: ``(inds, scores)``. ``inds`` uint32 expert
        indices (slot order: as stock; on the GPU ascending probability);
        ``scores`` routing weights in the dtype of ``logits``.

    Raises:
        ValueError: if ``top_k`` is outside ``[1, E]``.
        RuntimeError: if ``kernel`` names a backend without a router kernel
            (no source, no MLX API, or an unverified CUDA kernel without
            ``QAB_UNVERIFIED_KERNELS=1``).

    Shapes:
        logits: ``[..., E]``
        inds, scores: ``[..., K]``
    """
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if kernel is not None and logits.size > 0:
        inds, scores = _router_kernel_call(kernel, logits, int(top_k), bool(norm_topk_prob))
    else:
        inds, scores = _route_fn(int(top_k), bool(norm_topk_prob))(logits)
    return mx.stop_gradient(inds), scores


# --------------------------------------------------------------------------
# Router kernel (kernels/*/moe_router_topk)
# --------------------------------------------------------------------------

# Largest E and K of the router kernel: one warp / SIMD group per row holds
# E / 32 logits per lane in registers, and lane r keeps the r-th expert.
ROUTER_MAX_E = 1024
ROUTER_MAX_K = 32

# Rows (one warp / SIMD group each) per threadgroup of the router kernel.
_ROUTER_ROWS = 4

# Token rows of the router self-check: odd, so the last threadgroup is partial.
_ROUTER_CHECK_ROWS = 37


@functools.lru_cache(maxsize=None)
def _router_object(backend: str):
    return build_kernel("moe_router_topk", backend)


def _router_kernel_call(backend: str, logits: mx.array, top_k: int,
                        norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    obj = _router_object(backend)
    if obj is None:
        raise RuntimeError(f"no moe_router_topk source or MLX API for {backend}")
    E = logits.shape[-1]
    lead = logits.shape[:-1]
    N = logits.size // E
    rows = -(-N // _ROUTER_ROWS) * _ROUTER_ROWS
    # The kernel counts rows over the leading axes itself, so the logits go in
    # and the routes come out in their own shapes: no reshape primitives
    # (each costs the host ~5 us per decode token on MLX's CUDA backend).
    inds, scores = obj(
        inputs=[logits],
        template=[("InT", logits.dtype), ("E", E), ("K", top_k), ("NORM", norm_topk_prob)],
        grid=(32 * rows, 1, 1), threadgroup=(32 * _ROUTER_ROWS, 1, 1),
        output_shapes=[(*lead, top_k), (*lead, top_k)], output_dtypes=[mx.uint32, logits.dtype])
    return inds, scores


def _route_by_expert(inds: mx.array, scores: mx.array, num_experts: int) -> list[mx.array]:
    """A route in a form independent of slot order: ``[N, E]`` float32 membership
    (1 for each chosen expert) and the scores scattered to their experts."""
    K = inds.shape[-1]
    ind = inds.reshape(-1, K).astype(mx.uint32)
    zeros = mx.zeros((ind.shape[0], num_experts), dtype=mx.float32)
    member = mx.put_along_axis(zeros, ind, mx.ones(ind.shape, dtype=mx.float32), axis=-1)
    dense = mx.put_along_axis(zeros, ind, scores.reshape(-1, K).astype(mx.float32), axis=-1)
    return [member, dense]


def _router_check_logits(T: int, E: int, dtype: mx.Dtype) -> mx.array:
    """Self-check logits whose K largest rounded probabilities are far apart.

    Each row gives its experts the ranks of a random permutation, logit
    ``offset - rank * step`` with ``step`` in {1/16, 1/8, 1/4, 1}: adjacent
    ranks' probabilities differ by at least 6 %, far above a bf16 rounding
    step, and the logits of the top ranks are exact in every dtype. So any
    correct top-K picks the same experts whatever its tie rule or the last
    bits of its softmax, and a wrong pick shows as a wrong expert.
    """
    perm = mx.argsort(mx.random.uniform(shape=(T, E), key=mx.random.key(E * 37 + T)), axis=-1)
    steps = mx.array([0.0625, 0.125, 0.25, 1.0])[mx.arange(T) % 4][:, None]
    offsets = mx.array([0.0, 3.0, -5.0, 1.5, 0.0])[mx.arange(T) % 5][:, None]
    return (offsets - perm.astype(mx.float32) * steps).astype(dtype)


def router_kernel_ready(logits: mx.array, top_k: int, norm_topk_prob: bool) -> Optional[str]:
    """The GPU backend whose router kernel may route these logits, or None.

    ``kernels/{cuda,metal}/moe_router_topk``: softmax, top-K and optional
    renormalisation of each row in one launch (one warp / SIMD group per
    row), replacing the ~6 kernels of the portable route; see
    :func:`topk_route`. Eligible: float32 / bfloat16 / float16 logits,
    ``1 <= E <= ROUTER_MAX_E`` and ``1 <= K <= min(E, ROUTER_MAX_K)``. On the
    first call per shape class (dtype, E, K, ``norm_topk_prob``) the kernel
    is self-checked against the portable route on seeded random logits of
    that class: the same SET of experts in every row exactly (inputs built
    so that no two of the top ranks are close: the check does not depend on
    tie rules) and the scores, compared per expert, within a dtype tolerance.
    Only ``logits.dtype`` and ``logits.shape[-1]`` are read (nothing is
    evaluated), so a stand-in of the same dtype and E will do; call it
    outside ``mx.compile``, as ``FusedSparseMoeBlock`` does. CUDA: built only
    once its manifest entry records a GPU verification, or with
    ``QAB_UNVERIFIED_KERNELS=1``.

    Args:
        logits (mx.array): router logits ``[..., E]`` (or a stand-in).
        top_k (int): experts per token (K).
        norm_topk_prob (bool): renormalise the kept probabilities.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled, unsupported dtype, E or K, no kernel for the backend, or a
        failed self-check, which also warns).
    """
    if envs.kernels_disabled():
        return None
    backend = gpu_backend()
    E, K, dtype = logits.shape[-1], int(top_k), logits.dtype
    if (backend is None or dtype not in (mx.float32, mx.bfloat16, mx.float16)
            or not 1 <= E <= ROUTER_MAX_E or not 1 <= K <= min(E, ROUTER_MAX_K)
            or _router_object(backend) is None):
        return None
    norm = bool(norm_topk_prob)

    # Outputs in slot-order-free form; a wrong expert in one row moves the
    # membership's relative L2 by >= sqrt(2 / (T * K)) >= 0.041 (T = 37,
    # K <= 32), above every tolerance here, so the expert sets must match.
    # Scores: float32 differs only in summation order and exp's last bits;
    # bf16 / fp16 probabilities are the same rounding, but with
    # renormalisation a reference that adds the K scores in another order
    # or precision (MLX's CPU route: float32) may see a sum one ulp apart.
    # Measured with the CUDA body on the CPU emulator against the CPU route,
    # E in {8, 16, 64, 256, 300, 1024}: bf16 <= 3.0e-3, fp16 <= 3.9e-4,
    # float32 <= 1.7e-7 rel-L2.
    rtol = {mx.float32: 1e-5, mx.bfloat16: 1e-2, mx.float16: 2e-3}[dtype]
    ok = self_checked(
        "moe_router_topk", backend, (E, K, norm, str(dtype)),
        kernel=lambda lg: _route_by_expert(*_router_kernel_call(backend, lg, K, norm), E),
        reference=lambda lg: _route_by_expert(*_route_fn(K, norm)(lg), E),
        # [N, 1, E]: the kernel counts rows over the leading axes, as decode passes them.
        make_inputs=lambda: (_router_check_logits(_ROUTER_CHECK_ROWS, E, dtype)
                             .reshape(_ROUTER_CHECK_ROWS, 1, E),), rtol=rtol)
    return backend if ok else None


# --------------------------------------------------------------------------
# Residual add + RMSNorm + router GEMV + route in one launch
# (kernels/cuda/moe_add_norm_route)
# --------------------------------------------------------------------------

# Most token rows the fused route takes (decode-sized calls).
ADD_NORM_ROUTE_MAX_ROWS = SORT_THRESHOLD
# Largest hidden size: the block keeps the normalised row in shared memory.
ADD_NORM_ROUTE_MAX_D = 16384
# Threads per block and expert rows per warp: 8 experts per block, so the
# 8-bit router of Qwen3.6 (256 x 2048, 512 KB) streams through 32 SMs. (One
# block per token row reading all of it was measured slower end to end on the
# H200 than the three launches it replaces: 149.6 vs 191.1 tok/s at 4K.)
_ANR_BLOCK = 256
_ANR_RB = 1
# Token rows of the self-check (odd: the kernel is not specialised on N).
_ANR_CHECK_ROWS = 5


def add_norm_route_supported(x: mx.array, norm_weight: mx.array,
                             gate: Optional["ExpertWeights"], top_k: int) -> bool:
    """Whether the fused route's contract covers this call (no backend check).

    ``x`` bfloat16 / float16 with ``N <=`` :data:`ADD_NORM_ROUTE_MAX_ROWS`
    rows of ``D`` (a multiple of 256, at most :data:`ADD_NORM_ROUTE_MAX_D`),
    the norm weight ``[D]`` of ``x``'s dtype, and the router an 8-bit affine
    quantized ``[E, D]`` linear with biases, no bias term and no global scale,
    scales and biases of ``x``'s dtype, group size 32 / 64 / 128 (what mlx-lm
    gives the Qwen MoE routers), ``1 <= E <= ROUTER_MAX_E``, ``1 <= top_k <=
    min(E, ROUTER_MAX_K)``.
    """
    if gate is None or x.ndim == 0 or x.dtype not in (mx.bfloat16, mx.float16):
        return False
    D = x.shape[-1]
    N = x.size // D if D else 0
    if not (0 < N <= ADD_NORM_ROUTE_MAX_ROWS and 0 < D <= ADD_NORM_ROUTE_MAX_D and D % 256 == 0):
        return False
    if norm_weight.shape != (D,) or norm_weight.dtype != x.dtype:
        return False
    g = gate
    if not (g.quantized and g.bits == 8 and g.mode == "affine" and g.group_size in (32, 64, 128)
            and g.biases is not None and g.bias is None and g.global_scale is None):
        return False
    E = g.weight.shape[0]
    return (g.weight.ndim == 2 and g.weight.dtype == mx.uint32 and g.weight.shape[1] * 4 == D
            and g.scales.shape == (E, D // g.group_size) and g.biases.shape == g.scales.shape
            and g.scales.dtype == x.dtype and g.biases.dtype == x.dtype
            and 1 <= E <= ROUTER_MAX_E and 1 <= top_k <= min(E, ROUTER_MAX_K))


@functools.lru_cache(maxsize=None)
def _add_norm_route_object(backend: str):
    return build_kernel("moe_add_norm_route", backend)


def _add_norm_route_launch(E: int) -> tuple[int, int, int]:
    """``(BLOCK, RB, NB)``: threads per block, expert rows per warp, blocks per token row."""
    rows = _ANR_BLOCK // 32 * _ANR_RB
    return _ANR_BLOCK, _ANR_RB, -(-E // rows)


def _add_norm_route_call(backend: str, x: mx.array, r: mx.array, norm_weight: mx.array,
                         eps: float, gate: "ExpertWeights", top_k: int,
                         norm_topk_prob: bool, counter: mx.array) -> tuple:
    obj = _add_norm_route_object(backend)
    if obj is None:
        raise RuntimeError(f"no moe_add_norm_route source or MLX API for {backend}")
    D = x.shape[-1]
    N = x.size // D
    if N > counter.size:
        raise ValueError(f"{N} token rows but a counter of {counter.size}")
    E = gate.weight.shape[0]
    block, rb, nb = _add_norm_route_launch(E)
    lead = x.shape[:-1]
    # Outputs in the callers' shapes: no reshape primitives around the launch.
    # MLX caches a CUDA kernel by its template arguments alone: T fixes the
    # dtype of every float array but eps.
    h, y, logits, inds, scores = obj(
        inputs=[x, r, norm_weight, f32_scalar(float(eps)), gate.weight, gate.scales,
                gate.biases, counter],
        template=[("T", x.dtype), ("D", D), ("E", E), ("K", int(top_k)),
                  ("G", int(gate.group_size)), ("NORM", bool(norm_topk_prob)),
                  ("BLOCK", block), ("RB", rb)],
        grid=(block * nb, N, 1), threadgroup=(block, 1, 1),
        output_shapes=[x.shape, x.shape, (*lead, E), (*lead, top_k), (*lead, top_k)],
        output_dtypes=[x.dtype, x.dtype, x.dtype, mx.uint32, x.dtype])
    return h, y, logits, inds, scores


def add_norm_route_ops(x: mx.array, r: mx.array, norm_weight: mx.array, eps: float,
                       gate: "ExpertWeights", top_k: int, norm_topk_prob: bool) -> tuple:
    """Portable reference: the stock decoder layer's operations, in its order.

    ``h = x + r``; ``y = mx.fast.rms_norm(h, norm_weight, eps)``; the router
    logits ``y @ gate^T`` as ``nn.QuantizedLinear`` / ``nn.Linear`` computes
    them; then :func:`topk_route`.

    Returns:
        tuple: ``(h, y, logits, inds, scores)``.

    Shapes: x, r, h, y ``[..., D]``; logits ``[..., E]``; inds, scores ``[..., K]``.
    """
    h, y = add_rms_norm_ops(x, r, norm_weight, eps)
    logits = _linear(y, gate)
    inds, scores = topk_route(logits, top_k, norm_topk_prob)
    return h, y, logits, inds, scores


def _add_norm_route_check_inputs(D: int, dtype: mx.Dtype):
    def make():
        k = mx.random.split(mx.random.key(4242), 3)
        x = (4.0 * mx.random.normal((_ANR_CHECK_ROWS, 1, D), key=k[0])).astype(dtype)
        r = mx.random.normal((_ANR_CHECK_ROWS, 1, D), key=k[1]).astype(dtype)
        w = (1.0 + 0.2 * mx.random.normal((D,), key=k[2])).astype(dtype)
        return x, r, w
    return make


def add_norm_route_ready(x: mx.array, norm_weight: mx.array, eps: float,
                         gate: Optional["ExpertWeights"], top_k: int,
                         norm_topk_prob: bool) -> Optional[str]:
    """The GPU backend whose fused route may run this call, or None.

    ``kernels/cuda/moe_add_norm_route``: ``h = x + r``, the RMSNorm of ``h``,
    the 8-bit router GEMV and :func:`topk_route`'s route in one launch (see
    :func:`add_norm_route`). CUDA only: it exists to cut MLX's per-launch
    host cost, which bounds decode on MLX's CUDA backend.

    Call it outside ``mx.compile``: the first call per shape class (dtype,
    D, the router's E, group size, K, ``norm_topk_prob``, eps) self-checks
    the kernel with these router weights on seeded random rows against the
    stock add and norm, float32 logits over the dequantized router, and the
    portable route of those logits: ``h``, ``y``, the logits, and the
    experts' membership and scores, each within its own tolerance. Later
    calls only look the verdict up. Only shapes, dtypes and the router's
    arrays are read (nothing of ``x`` is evaluated).

    Args:
        x (mx.array): the residual stream ``[..., D]`` (or a stand-in of its
            shape and dtype).
        norm_weight (mx.array): the post-attention RMSNorm weight ``[D]``.
        eps (float): the norm's epsilon.
        gate (ExpertWeights | None): the router (``mlp.gate``).
        top_k (int): experts per token (K).
        norm_topk_prob (bool): renormalise the kept probabilities.

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, kernels disabled,
        outside :func:`add_norm_route_supported`, the kernel unverified
        without ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also
        warns).
    """
    if envs.kernels_disabled() or gpu_backend() != "cuda":
        return None
    if not add_norm_route_supported(x, norm_weight, gate, top_k):
        return None
    if _add_norm_route_object("cuda") is None:
        return None
    D, dtype, E = x.shape[-1], x.dtype, gate.weight.shape[0]
    K, norm = int(top_k), bool(norm_topk_prob)

    def kernel(xs, rs, ws):
        h, y, logits, inds, scores = _add_norm_route_call("cuda", xs, rs, ws, eps, gate, K, norm,
                                                          fold_norm_counter())
        return [h, y, logits, *_route_by_expert(inds, scores, E)]

    def reference(xs, rs, ws):
        # The logits from float32 arithmetic over the dequantized router (MLX's
        # CPU quantized matmul is not a usable reference: at the Qwen shape its
        # bf16 8-bit logits were measured 0.50 off the float64 product, the
        # kernel's 0.015), routed by the portable route.
        h, y = add_rms_norm_ops(xs, rs, ws, eps)
        wf = mx.dequantize(gate.weight, gate.scales, gate.biases, group_size=gate.group_size,
                           bits=8).astype(mx.float32)
        logits = (y.astype(mx.float32) @ wf.T).astype(dtype)
        inds, scores = topk_route(logits, K, norm)
        return [h, y, logits, *_route_by_expert(inds, scores, E)]

    # h: one rounding of the same sum (bit-identical). y: the add_rms_norm
    # kernel's bound (another order of the float32 sum of squares; bf16
    # measured bit-identical, fp16 3.3e-5). logits: each weight dequantized in
    # the activation dtype (as MLX's GPU kernel does) against float32 weights:
    # measured (CPU emulation, MLX-quantized random routers, D 256-4096)
    # <= 9.6e-5 bf16, <= 5.7e-5 fp16, but 5.3e-3 on the H200 with the bench's
    # full-preset bf16 router (its affine biases are large against q * scale,
    # so rounding q * scale + bias to bf16 costs more): 2e-2 leaves room and
    # still rejects a wrong GEMV (errors of order 1).
    # The route: logits that close can still swap an expert where two
    # probabilities are that close; the bound admits a few swaps in the 5
    # rows (one at K = 8: membership rel-L2 0.22) and still rejects a wrong
    # GEMV or route (random experts: ~1.4).
    rtol = [1e-6, 3e-4, 2e-2, 0.5, 0.5]
    ok = self_checked(
        "moe_add_norm_route", "cuda",
        (D, str(dtype), E, gate.group_size, K, norm, float(eps)),
        kernel=kernel, reference=reference,
        make_inputs=_add_norm_route_check_inputs(D, dtype), rtol=rtol)
    return "cuda" if ok else None


def add_norm_route(x: mx.array, r: mx.array, norm_weight: mx.array, eps: float,
                   gate: "ExpertWeights", top_k: int, norm_topk_prob: bool,
                   backend: Optional[str] = None, counter: Optional[mx.array] = None) -> tuple:
    """The residual add, the RMSNorm, the router and the route of a decoder layer.

    With ``backend`` (what :func:`add_norm_route_ready` returned for this
    call's shape class) one launch of ``kernels/cuda/moe_add_norm_route``
    per call: no self-check here, so it may sit inside ``mx.compile``. With
    None, :func:`add_norm_route_ops`.

    Algorithm (the kernel; without a backend the stock operations, whose
    logits are MLX's quantized matmul on that device): ``h = round(x + r)``;
    ``y = round(w * round(h * rsqrt(mean(h^2) + eps)))`` (float32 statistics;
    the rounding points of MLX's Add and ``mx.fast.rms_norm``); logits as
    MLX's CUDA 8-bit ``qmv`` source computes
    them (weights dequantized in the activation dtype, float32 fma
    accumulation, one rounding; against the installed MLX 0.32.4 on the H200
    ~30 % bit-identical, the route the same); the route of
    :func:`topk_route`'s kernel (softmax, top-K, renormalisation as MLX's
    GPU kernels compute them).

    Args:
        x (mx.array): residual stream, bfloat16 / float16 with a backend.
        r (mx.array): the mixer's output, same shape and dtype.
        norm_weight (mx.array): RMSNorm weight ``[D]``.
        eps (float): RMSNorm epsilon.
        gate (ExpertWeights): the router, ``[E, D]`` (8-bit affine with a
            backend).
        top_k (int): experts per token (K).
        norm_topk_prob (bool): renormalise the kept probabilities to sum 1.
        backend (str | None): ``"cuda"`` from :func:`add_norm_route_ready`,
            or None for the portable path. Default None.
        counter (mx.array | None): with a backend, the kernel's counter
            input from :func:`fold_norm_counter` (each launch counts in its
            own copy of it); None: ``fold_norm_counter()``.

    Returns:
        tuple: ``(h, y, logits, inds, scores)``: ``h = x + r`` and ``y`` its
        norm, in ``x``'s shape and dtype; the router logits (``x``'s dtype);
        ``inds`` uint32 expert indices and ``scores`` their weights (``x``'s
        dtype), slot order as :func:`topk_route`.

    Shapes:
        x, r, h, y: ``[..., D]``; norm_weight: ``[D]``; logits: ``[..., E]``;
        inds, scores: ``[..., K]``.

    Raises:
        RuntimeError: with a backend that has no kernel (no source or MLX API,
            or an unverified CUDA kernel without ``QAB_UNVERIFIED_KERNELS=1``).
        ValueError: with a backend, for more token rows than ``counter`` has.
    """
    if backend is None or x.size == 0:
        return add_norm_route_ops(x, r, norm_weight, eps, gate, top_k, norm_topk_prob)
    h, y, logits, inds, scores = _add_norm_route_call(
        backend, x, r, norm_weight, eps, gate, top_k, norm_topk_prob,
        fold_norm_counter() if counter is None else counter)
    return h, y, logits, mx.stop_gradient(inds), scores


# --------------------------------------------------------------------------
# Gathered expert matmuls
# --------------------------------------------------------------------------


def sort_by_expert(x: mx.array, inds: mx.array) -> SortedTokens:
    """Regroup (token, slot) rows so that rows sent to one expert are adjacent.

    With many tokens the gathered matmul then walks each expert's weights
    once, in order, instead of once per row (``sorted_indices=True``).

    Args:
        x (mx.array): token activations.
        inds (mx.array): expert index per token and slot.

    Returns:
        SortedTokens: rows, their expert indices, the permutation and its
        inverse. ``x`` keeps its dtype; ``inds`` keeps its dtype;
        ``order``/``inv_order`` are uint32.

    Shapes:
        x: ``[..., H]``; inds: ``[..., K]``
        returned x: ``[N*K, 1, H]``; inds, order, inv_order: ``[N*K]``
    """
    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    rows = x.reshape(-1, 1, x.shape[-1])[order // k]
    return SortedTokens(rows, flat[order], order, inv_order)


def gathered_matmul(
    x: mx.array,
    w: ExpertWeights,
    inds: mx.array,
    sorted_indices: bool = False,
) -> mx.array:
    """``x @ w[inds].T`` with one expert matrix gathered per row.

    Args:
        x (mx.array): activations; the second-to-last axis is the row axis.
        w (ExpertWeights): stacked expert weights ``[E, O, In]``.
        inds (mx.array): expert index per batch entry of ``x``.
        sorted_indices (bool): ``inds`` is flat and ascending. Default False.

    Returns:
        mx.array: projected activations in the promoted dtype of ``x`` and
        the weights (the scales' dtype for quantized weights).

    Shapes:
        x: ``[..., 1, In]`` broadcast against inds ``[...]``
        returns: ``[..., 1, O]``
    """
    if w.quantized:
        y = mx.gather_qmm(
            x,
            w.weight,
            w.scales,
            w.biases,
            rhs_indices=inds,
            transpose=True,
            group_size=w.group_size,
            bits=w.bits,
            mode=w.mode,
            global_scale=w.global_scale,
            sorted_indices=sorted_indices,
        )
    else:
        y = mx.gather_mm(
            x, w.weight.swapaxes(-1, -2), rhs_indices=inds, sorted_indices=sorted_indices
        )
    if w.bias is not None:
        y = y + mx.expand_dims(w.bias[inds], -2)
    return y


@functools.partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return (gate * mx.sigmoid(gate)) * up


def _split_swiglu(gate_up: mx.array) -> mx.array:
    # gate is the first half of the fused output, up the second (HF layout).
    # The split stays outside the shapeless graph: split needs static shapes.
    gate, up = mx.split(gate_up, 2, axis=-1)
    return _swiglu(gate, up)


def swiglu_experts_ops(
    x: mx.array,
    inds: mx.array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    sort: Optional[bool] = None,
) -> mx.array:
    """Per-slot SwiGLU expert outputs, before the weighted sum over K.

    One gathered matmul over the concatenated gate+up weights, split,
    ``silu(gate) * up``, then the gathered down projection. Equivalent to
    stock ``SwitchGLU.__call__``.

    Args:
        x (mx.array): token activations.
        inds (mx.array): expert indices from :func:`topk_route`.
        gate_up (ExpertWeights): ``[E, 2I, H]``, gate rows first, up rows second.
        down (ExpertWeights): ``[E, H, I]``.
        sort (bool | None): sort rows by expert first; None sorts when
            ``inds.size >= SORT_THRESHOLD``, as stock does. Default None.

    Returns:
        mx.array: expert outputs in the compute dtype (that of ``x`` for
        float weights of the same dtype).

    Shapes:
        x: ``[..., H]``; inds: ``[..., K]``
        returns: ``[..., K, H]``
    """
    inds = mx.stop_gradient(inds)
    if sort is None:
        # Prefill: grouping rows by expert lets the gathered matmul stream each
        # expert's weights once; for a few decode rows the argsorts cost more.
        sort = inds.size >= SORT_THRESHOLD
    if sort:
        st = sort_by_expert(x, inds)
        h = gathered_matmul(st.x, gate_up, st.inds, sorted_indices=True)
        h = _split_swiglu(h)
        y = gathered_matmul(h, down, st.inds, sorted_indices=True)
        # [N*K, 1, H] back to token order, then [..., K, H].
        return y[st.inv_order].reshape(*inds.shape, y.shape[-1])
    xe = mx.expand_dims(x, (-2, -3))  # [..., 1, 1, H] broadcasts against K
    h = _split_swiglu(gathered_matmul(xe, gate_up, inds))
    y = gathered_matmul(h, down, inds)  # [..., K, 1, H]
    return y.squeeze(-2)


def moe_experts_ops(
    x: mx.array,
    inds: mx.array,
    scores: mx.array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    sort: Optional[bool] = None,
) -> mx.array:
    """Portable routed-expert output: SwiGLU experts weighted by routing scores.

    Args:
        x (mx.array): token activations.
        inds (mx.array): expert indices.
        scores (mx.array): routing weights of those experts.
        gate_up (ExpertWeights): ``[E, 2I, H]`` fused gate+up projection.
        down (ExpertWeights): ``[E, H, I]`` down projection.
        sort (bool | None): see :func:`swiglu_experts_ops`. Default None.

    Returns:
        mx.array: the promoted dtype of the expert outputs and ``scores``
        (the dtype of ``x`` in the model).

    Shapes:
        x: ``[..., H]``; inds, scores: ``[..., K]``
        returns: ``[..., H]``
    """
    y = swiglu_experts_ops(x, inds, gate_up, down, sort=sort)
    return _weighted_sum(y, scores)


def dequantize_experts(w: ExpertWeights, dtype: mx.Dtype,
                       after: Optional[mx.array] = None) -> ExpertWeights:
    """Float copy of quantized expert weights (plain weights pass through).

    Args:
        w (ExpertWeights): stacked expert projection.
        dtype (mx.Dtype): dtype of the dequantized weight.
        after (mx.array | None): an activation the dequantization must wait
            for (``mx.depends``). The weights depend on nothing computed, so
            without it MLX is free to make every layer's float copy before
            the first layer runs; with it the copies are made in layer order.

    Returns:
        ExpertWeights: plain ``[E, O, In]`` weight in ``dtype``, same ``bias``.
    """
    if not w.quantized:
        return w
    arrays = [w.weight, w.scales] + ([w.biases] if w.biases is not None else [])
    if after is not None:
        arrays = mx.depends(arrays, [after])
    weight, scales = arrays[0], arrays[1]
    biases = arrays[2] if w.biases is not None else None
    kwargs = {}
    if w.global_scale is not None:
        kwargs["global_scale"] = w.global_scale
    weight = mx.dequantize(weight, scales, biases, group_size=w.group_size,
                           bits=w.bits, mode=w.mode, dtype=dtype, **kwargs)
    return ExpertWeights(weight, bias=w.bias)


def moe_experts_dequant_gemm(
    x: mx.array,
    inds: mx.array,
    scores: mx.array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
) -> mx.array:
    """Routed-expert output for many rows: dequantize the experts, then a grouped GEMM.

    The same function as :func:`moe_experts_ops` (rows sorted by expert, one
    gathered matmul over the concatenated gate+up weights, SiLU gate, the
    down projection, the score-weighted sum) with the weights dequantized to
    ``x.dtype`` first, so the gathered matmuls run as floating-point GEMMs.
    Results differ from the gathered quantized matmul only by rounding (the
    weights' dequantized values are the same). The gate+up copy is made after
    routing and the down copy after the gate+up GEMM, so at most one float
    copy is alive per layer.

    Args:
        x (mx.array): token activations (float32 on the CPU, whose gathered
            matmul supports only float32 in MLX 0.32).
        inds (mx.array): expert indices from :func:`topk_route`.
        scores (mx.array): routing weights from :func:`topk_route`.
        gate_up (ExpertWeights): ``[E, 2I, H]`` fused gate+up projection.
        down (ExpertWeights): ``[E, H, I]`` down projection.

    Returns:
        mx.array: dtype of ``x`` (promoted with ``scores``).

    Shapes:
        x: ``[..., H]``; inds, scores: ``[..., K]``; returns ``[..., H]``
    """
    inds = mx.stop_gradient(inds)
    st = sort_by_expert(x, inds)
    h = gathered_matmul(st.x, dequantize_experts(gate_up, x.dtype, after=st.inds), st.inds,
                        sorted_indices=True)
    h = _split_swiglu(h)
    y = gathered_matmul(h, dequantize_experts(down, x.dtype, after=h), st.inds,
                        sorted_indices=True)
    y = y[st.inv_order].reshape(*inds.shape, y.shape[-1])
    return _weighted_sum(y, scores)


def _dequant_gemm_runs(x: mx.array) -> bool:
    backend = gpu_backend() or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    if backend not in DEQUANT_GEMM_BACKENDS:
        return False
    # MLX 0.32's CPU gathered matmul is float32-only.
    return backend != "cpu" or x.dtype == mx.float32


# Shape-specialised on purpose: in MLX 0.32.4 a shapeless compiled sum over an
# axis of size 1 (K = 1 here) segfaults on the CPU.
@mx.compile
def _weighted_sum(y: mx.array, scores: mx.array) -> mx.array:
    return (y * scores[..., None]).sum(axis=-2)


# --------------------------------------------------------------------------
# Shared expert (Qwen3-Next / Qwen3.5 MoE): portable reference
# --------------------------------------------------------------------------


class SharedExpertWeights(NamedTuple):
    """A block's shared SwiGLU expert and its sigmoid gate, as single linears.

    Each field is an :class:`ExpertWeights` without the expert axis: ``weight``
    is ``[O, In]`` (or its packed form, with ``scales`` / ``biases`` of shape
    ``[O, In / group_size]``), exactly the arrays of an ``nn.Linear`` /
    ``nn.QuantizedLinear``.

    Attributes:
        gate_proj (ExpertWeights): ``[I, H]``.
        up_proj (ExpertWeights): ``[I, H]``.
        down_proj (ExpertWeights): ``[H, I]``.
        gate (ExpertWeights): ``[1, H]``, the shared expert's gate
            (``shared_expert_gate``; 8-bit in mlx-lm's Qwen quantization).
    """

    gate_proj: ExpertWeights
    up_proj: ExpertWeights
    down_proj: ExpertWeights
    gate: ExpertWeights


def _linear(x: mx.array, w: ExpertWeights) -> mx.array:
    # The same primitives as nn.QuantizedLinear / nn.Linear.__call__.
    if w.quantized:
        y = mx.quantized_matmul(x, w.weight, w.scales, w.biases, transpose=True,
                                group_size=w.group_size, bits=w.bits, mode=w.mode)
        return y if w.bias is None else y + w.bias
    if w.bias is not None:
        return mx.addmm(w.bias, x, w.weight.T)
    return x @ w.weight.T


def shared_expert_ops(x: mx.array, shared: SharedExpertWeights) -> tuple[mx.array, mx.array]:
    """Portable shared expert: its SwiGLU output and its gate logit.

    ``down(silu(gate_proj(x)) * up_proj(x))`` and ``gate(x)``, with the
    primitives of mlx-lm's ``Qwen3NextMLP`` and ``nn.(Quantized)Linear``.

    Args:
        x (mx.array): token activations.
        shared (SharedExpertWeights): the shared expert and its gate.

    Returns:
        tuple[mx.array, mx.array]: ``(shared_y, gate_logit)`` in the promoted
        dtype of ``x`` and the weights (the scales' for quantized ones).

    Shapes:
        x: ``[..., H]``; shared_y: ``[..., H]``; gate_logit: ``[..., 1]``
    """
    h = _swiglu(_linear(x, shared.gate_proj), _linear(x, shared.up_proj))
    return _linear(h, shared.down_proj), _linear(x, shared.gate)


@functools.partial(mx.compile, shapeless=True)
def add_gated_shared(y: mx.array, shared_y: mx.array, gate_logit: mx.array) -> mx.array:
    """``y + sigmoid(gate_logit) * shared_y``, as the stock block adds its shared expert.

    Shapes:
        y, shared_y: ``[..., H]``; gate_logit: ``[..., 1]``; returns ``[..., H]``
    """
    return y + mx.sigmoid(gate_logit) * shared_y


def moe_shared_experts_ops(
    x: mx.array,
    inds: mx.array,
    scores: mx.array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    shared: SharedExpertWeights,
    sort: Optional[bool] = None,
) -> mx.array:
    """Portable MoE block output: routed experts plus the sigmoid-gated shared expert.

    Today's composition: :func:`moe_experts_ops`, :func:`shared_expert_ops`,
    then :func:`add_gated_shared` (the reference of the decode fold kernels).

    Args:
        x (mx.array): token activations.
        inds (mx.array): expert indices.
        scores (mx.array): routing weights.
        gate_up (ExpertWeights): ``[E, 2I, H]``.
        down (ExpertWeights): ``[E, H, I]``.
        shared (SharedExpertWeights): the shared expert and its gate.
        sort (bool | None): see :func:`swiglu_experts_ops`. Default None.

    Returns:
        mx.array: the promoted dtype of the routed and shared outputs.

    Shapes:
        x: ``[..., H]``; inds, scores: ``[..., K]``; returns ``[..., H]``
    """
    y = moe_experts_ops(x, inds, scores, gate_up, down, sort=sort)
    return add_gated_shared(y, *shared_expert_ops(x, shared))


def moe_combine_ops(y_sorted: mx.array, pos: mx.array, scores: mx.array, shared_y: mx.array,
                    gate_logit: mx.array) -> mx.array:
    """Portable prefill epilogue: un-sort, weight, sum over K, add the gated shared expert.

    ``sum_k scores[n, k] * y_sorted[pos[n, k]] + sigmoid(gate_logit[n]) *
    shared_y[n]``, as the sorted prefill path composes it today (the
    reference of ``kernels/*/moe_combine``).

    Args:
        y_sorted (mx.array): expert output rows in expert order.
        pos (mx.array): row of ``y_sorted`` holding each (token, slot)
            (``SortedTokens.inv_order`` reshaped).
        scores (mx.array): routing weights.
        shared_y (mx.array): shared expert output.
        gate_logit (mx.array): shared expert gate logit.

    Returns:
        mx.array: the promoted dtype of the inputs.

    Shapes:
        y_sorted: ``[N*K, H]``; pos, scores: ``[..., K]``;
        shared_y: ``[..., H]``; gate_logit: ``[..., 1]``; returns ``[..., H]``
    """
    return add_gated_shared(_weighted_sum(y_sorted[pos], scores), shared_y, gate_logit)


# --------------------------------------------------------------------------
# Kernel slot and dispatcher
# --------------------------------------------------------------------------


# Thread-block size and rows per warp of the decode kernels (kernels/*/moe_*_gemv).
_GEMV_BLOCK = 256
_GEMV_RPW = 2


def _gemv_shapes_supported(H: int, gate_up: ExpertWeights, down: ExpertWeights) -> bool:
    if not (gate_up.quantized and down.quantized):
        return False
    for w in (gate_up, down):
        if (w.bits != 4 or w.mode != "affine" or w.biases is None or w.bias is not None
                or w.global_scale is not None or not w.group_size or w.group_size % 32):
            return False
    E, two_i, packed = gate_up.weight.shape
    I = two_i // 2
    return (H % 1024 == 0 and packed * 8 == H and I % 32 == 0 and I % _GEMV_RPW == 0
            and H % _GEMV_RPW == 0 and down.weight.shape == (E, H, I // 8))


@functools.lru_cache(maxsize=None)
def _gemv_objects(backend: str):
    gu, dn = build_kernel("moe_gate_up_gemv", backend), build_kernel("moe_down_gemv", backend)
    return None if gu is None or dn is None else (gu, dn)


def _decode_rows(x: mx.array, inds: mx.array, scores: mx.array):
    """The decode kernels' routes as they come, ``inds [..., K]`` uint32 and
    ``scores [..., K]`` (any float dtype, read as float32 by the down kernel),
    and ``N``, the number of token rows of ``x [..., H]`` (passed unchanged).

    The kernels index rows flatly, so nothing is reshaped or cast here: on
    MLX's CUDA backend each view or cast is a primitive the host encodes
    every decode token (~5 us each, measured on the H200). Casting the
    router's bf16 scores to float32 and the reshapes to [N, ...] and back
    cost Qwen3.6-35B-A3B 40 casts and ~160 views per token.
    """
    H, K = x.shape[-1], inds.shape[-1]
    N = x.size // H
    if inds.size != N * K or scores.size != N * K:
        raise ValueError(f"inds {inds.shape} and scores {scores.shape} must have the rows of "
                         f"x {x.shape} and K = {K} slots")
    if not mx.issubdtype(scores.dtype, mx.floating):
        scores = scores.astype(mx.float32)
    return inds.astype(mx.uint32), scores, N


def _moe_decode_kernel_call(backend: str, x, inds, scores, gate_up: ExpertWeights,
                            down: ExpertWeights) -> mx.array:
    ind, sc, N = _decode_rows(x, inds, scores)
    H, K = x.shape[-1], ind.shape[-1]
    I = gate_up.weight.shape[1] // 2
    objects = _gemv_objects(backend)
    if objects is None:
        raise RuntimeError(f"no MoE decode kernel sources or MLX API for {backend}")
    gu_kernel, dn_kernel = objects
    (h,) = gu_kernel(
        inputs=[x, ind, gate_up.weight, gate_up.scales, gate_up.biases],
        template=[("OutT", x.dtype), ("H", H), ("I", I), ("K", K), ("G", gate_up.group_size)],
        grid=(32 * K * I // _GEMV_RPW, N, 1), threadgroup=(_GEMV_BLOCK, 1, 1),
        output_shapes=[(N, K, I)], output_dtypes=[x.dtype])
    (y,) = dn_kernel(
        inputs=[h, ind, sc, down.weight, down.scales, down.biases],
        template=[("OutT", x.dtype), ("H", H), ("I", I), ("K", K), ("G", down.group_size),
                  ("ST", sc.dtype)],
        grid=(_down_grid_x(H), N, 1), threadgroup=(_GEMV_BLOCK, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype])
    return y


def decode_kernel_ready(x: mx.array, inds: mx.array, gate_up: ExpertWeights,
                        down: ExpertWeights) -> Optional[str]:
    """The GPU backend whose MoE decode kernels may run this call, or None.

    Decode-sized calls only (fewer than :data:`SORT_THRESHOLD` (token, slot)
    rows) on 4-bit affine experts with ``H % 1024 == 0`` and ``I % 32 == 0``.
    On the first call per shape class the kernels are self-checked against
    :func:`moe_experts_ops` on random activations and routings with these
    very expert weights (see :mod:`qwen_apple_backend.ops.device`); call it
    outside ``mx.compile`` first, as ``FusedSparseMoeBlock`` does.

    Args:
        x (mx.array): token activations ``[..., H]``.
        inds (mx.array): expert indices ``[..., K]``.
        gate_up (ExpertWeights): ``[E, 2I, H]``.
        down (ExpertWeights): ``[E, H, I]``.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled, unsupported shapes or quantization, too many rows, or a
        failed self-check, which also warns).
    """
    if envs.kernels_disabled() or inds.size >= SORT_THRESHOLD:
        return None
    backend = gpu_backend()
    H, K = x.shape[-1], inds.shape[-1]
    if (backend is None or x.dtype not in (mx.float32, mx.bfloat16, mx.float16)
            or not _gemv_shapes_supported(H, gate_up, down) or _gemv_objects(backend) is None):
        return None
    E = gate_up.weight.shape[0]
    I = gate_up.weight.shape[1] // 2
    dtype = x.dtype

    def make_inputs():
        key = mx.random.key(4321)
        k1, k2, k3 = mx.random.split(key, 3)
        # Three tokens as [3, 1, H]: rows over leading axes, as decode passes them.
        xs = mx.random.normal((3, 1, H), key=k1).astype(dtype)
        ind = mx.argsort(mx.random.uniform(shape=(3, 1, E), key=k2), axis=-1)[..., :K]
        ind = ind.astype(mx.uint32)
        sc = mx.softmax(mx.random.normal((3, 1, K), key=k3), axis=-1).astype(dtype)
        return xs, ind, sc, gate_up, down

    # Scores in the activations' dtype (the router's) and in float32: the
    # down kernel is built per scores dtype, and both builds are checked.
    def kernel(xs, ind, sc, gu, dn):
        return [_moe_decode_kernel_call(backend, xs, ind, s, gu, dn)
                for s in (sc, sc.astype(mx.float32))]

    def reference(xs, ind, sc, gu, dn):
        y = moe_experts_ops(xs, ind, sc.astype(mx.float32), gu, dn, sort=False).astype(dtype)
        return [y, y]

    # bf16 / fp16 outputs round to ~3 significant digits; float32 differs
    # from the reference only in summation order.
    rtol = 1e-4 if dtype == mx.float32 else 2e-2
    ok = self_checked(
        "moe_decode_gemv", backend, (E, H, I, K, gate_up.group_size, down.group_size, str(dtype)),
        kernel=kernel, reference=reference, make_inputs=make_inputs, rtol=rtol)
    return backend if ok else None


# --------------------------------------------------------------------------
# Decode with the shared expert folded in (kernels/*/moe_*_shared_gemv)
# --------------------------------------------------------------------------


def _q4_like(w: ExpertWeights, like: ExpertWeights, shape: tuple) -> bool:
    # A shared-expert linear the fold kernels can read with the routed
    # experts' code: 4-bit affine, same group size and scale/bias dtypes.
    return (w.quantized and w.bits == 4 and w.mode == "affine" and w.biases is not None
            and w.bias is None and w.global_scale is None and w.group_size == like.group_size
            and w.weight.dtype == mx.uint32 and tuple(w.weight.shape) == shape
            and w.scales.dtype == like.scales.dtype and w.biases.dtype == like.biases.dtype)


def _fold_shapes_supported(H: int, gate_up: ExpertWeights, down: ExpertWeights,
                           shared: SharedExpertWeights) -> bool:
    if not _gemv_shapes_supported(H, gate_up, down):
        return False
    I = gate_up.weight.shape[1] // 2
    g = shared.gate
    return (_q4_like(shared.gate_proj, gate_up, (I, H // 8))
            and _q4_like(shared.up_proj, gate_up, (I, H // 8))
            and _q4_like(shared.down_proj, down, (H, I // 8))
            and g.quantized and g.bits in (4, 8) and g.mode == "affine"
            and g.biases is not None and g.bias is None and g.global_scale is None
            and bool(g.group_size) and g.group_size % 32 == 0 and H % g.group_size == 0
            and g.weight.dtype == mx.uint32 and tuple(g.weight.shape) == (1, H * g.bits // 32))


@functools.lru_cache(maxsize=None)
def _fold_objects(backend: str):
    gu = build_kernel("moe_gate_up_shared_gemv", backend)
    dn = build_kernel("moe_down_shared_gemv", backend)
    return None if gu is None or dn is None else (gu, dn)


def _fold_grid_x(K: int, I: int, rpw: int = _GEMV_RPW) -> int:
    # (K + 1) * I / RPW row-pair warps and one gate-logit warp per token,
    # rounded up to whole threadgroups (the kernels' spare warps exit); rpw:
    # the row pairs per warp (moe_decode_block's GRPW).
    threads = 32 * ((K + 1) * I // rpw + 1)
    return -(-threads // _GEMV_BLOCK) * _GEMV_BLOCK


def _down_grid_x(H: int) -> int:
    # The down kernels: one warp per _GEMV_RPW output rows, in threads.
    return 32 * H // _GEMV_RPW


def _fold_gate_up_launch(gu_kernel, x, ind, gate_up: ExpertWeights, shared: SharedExpertWeights,
                         N: int, H: int, I: int, K: int) -> tuple:
    # The fold's first kernel: the K routed experts' and the shared expert's
    # SiLU-gated rows [N, K + 1, I] and the shared gate's float32 logit, element
    # n for token row n of a buffer of at least 16 bytes (ops.device.unpooled_length:
    # a [1] logit sat in MLX's small host-shared pool at decode).
    sg, su, _, gate = shared
    return gu_kernel(
        inputs=[x, ind, gate_up.weight, gate_up.scales, gate_up.biases,
                sg.weight, sg.scales, sg.biases, su.weight, su.scales, su.biases,
                gate.weight, gate.scales, gate.biases],
        template=[("OutT", x.dtype), ("H", H), ("I", I), ("K", K), ("G", gate_up.group_size),
                  ("SGB", gate.bits), ("SGG", gate.group_size)],
        grid=(_fold_grid_x(K, I), N, 1), threadgroup=(_GEMV_BLOCK, 1, 1),
        output_shapes=[(N, K + 1, I), (unpooled_length(N, mx.float32),)],
        output_dtypes=[x.dtype, mx.float32])


def _moe_shared_decode_kernel_call(backend: str, x, inds, scores, gate_up: ExpertWeights,
                                   down: ExpertWeights, shared: SharedExpertWeights,
                                   residual: Optional[mx.array] = None) -> mx.array:
    ind, sc, N = _decode_rows(x, inds, scores)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.shape} {residual.dtype} must have x's shape "
                         f"{x.shape} and dtype {x.dtype}")
    H, K = x.shape[-1], ind.shape[-1]
    I = gate_up.weight.shape[1] // 2
    objects = _fold_objects(backend)
    if objects is None:
        raise RuntimeError(f"no MoE shared-expert decode kernel sources or MLX API for {backend}")
    gu_kernel, dn_kernel = objects
    sd = shared.down_proj
    h, logit = _fold_gate_up_launch(gu_kernel, x, ind, gate_up, shared, N, H, I, K)
    # Without a residual, h stands in for the unread input (any OutT array).
    (y,) = dn_kernel(
        inputs=[h, ind, sc, down.weight, down.scales, down.biases,
                sd.weight, sd.scales, sd.biases, logit, h if residual is None else residual],
        template=[("OutT", x.dtype), ("H", H), ("I", I), ("K", K), ("G", down.group_size),
                  ("ST", sc.dtype), ("HAS_RES", residual is not None)],
        grid=(_down_grid_x(H), N, 1), threadgroup=(_GEMV_BLOCK, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype])
    return y


@functools.lru_cache(maxsize=None)
def _fold_norm_object(backend: str):
    return build_kernel("moe_down_shared_norm_gemv", backend)


#: Token rows a fold-with-next-norm call may have: the length of its counter.
FOLD_NORM_MAX_ROWS = SORT_THRESHOLD


@functools.lru_cache(maxsize=None)
def fold_norm_counter(rows: int = FOLD_NORM_MAX_ROWS) -> mx.array:
    """The counter input of the counting kernels, evaluated (one per ``rows``).

    :func:`moe_shared_experts_norm_kernel` and :func:`add_norm_route` count
    their blocks per token row in a ``[rows]`` uint32 buffer of zeros
    (default :data:`FOLD_NORM_MAX_ROWS` rows) that the launch writes. This is
    a zero-strided view of one zero: MLX hands a custom kernel its inputs
    row-contiguous, so every launch gets its own zeroed copy (a copy inside
    the launch, no extra MLX operation), and no two launches ever share a
    counter, even two independent calls of one module that a CUDA graph runs
    at the same time. (A shared buffer did not survive that: measured on the
    H200, two such calls evaluated together corrupted its counts, the route
    read unwritten expert indices and the GPU faulted.) So one view serves
    every caller: it is created once per ``rows`` and kept.

    Args:
        rows (int): token rows it covers (a launch with more rows raises
            ``ValueError``). Default :data:`FOLD_NORM_MAX_ROWS`.

    Returns:
        mx.array: ``[rows]`` uint32 zeros (a zero-strided view).

    Raises:
        ValueError: if ``rows < 1``.
    """
    if rows < 1:
        raise ValueError(f"a counter needs at least one row, got rows={rows}")
    # The zero is element 0 of a 16-byte array (ops.device.padded_zeros): a
    # buffer of <= 8 bytes would sit in MLX's small managed pool, which the
    # per-launch copy would read from host memory.
    c = mx.broadcast_to(padded_zeros(mx.uint32)[:1], (rows,))
    mx.eval(c)
    return c


_SERIAL_TRACE: contextvars.ContextVar[int] = contextvars.ContextVar("qab_serial_decode_trace",
                                                                    default=0)


@contextlib.contextmanager
def serial_decode_trace(compiled: bool = False) -> Iterator[None]:
    """Marks a trace whose counting-kernel launches never overlap: :func:`serial_counter` applies.

    For the compiled decode step (``decode.py``) while it traces: there every
    MoE block runs once per step, each block's launches depend on the one
    before (the residual stream), and a step depends on the previous step's
    token, so launches that share a counter run one after the other.

    Args:
        compiled (bool): the calls inside are traced by ``mx.compile``
            (:func:`serial_decode_compiling`), where no self-check can run
            (MLX evaluates nothing inside a trace): a packed MoE block
            whose self-check has not run for its shape class is then left
            out (:class:`PackCheckDue`). False: eager calls made as the step
            would trace them (tests).
    """
    token = _SERIAL_TRACE.set(2 if compiled else 1)
    try:
        yield
    finally:
        _SERIAL_TRACE.reset(token)


def serial_decode_tracing() -> bool:
    """True inside :func:`serial_decode_trace`."""
    return _SERIAL_TRACE.get() > 0


def serial_decode_compiling() -> bool:
    """True inside ``serial_decode_trace(compiled=True)`` (an ``mx.compile`` trace)."""
    return _SERIAL_TRACE.get() == 2


class PackCheckDue(Exception):
    """A packed MoE block build was asked for inside ``mx.compile``'s trace
    (:func:`serial_decode_compiling`) before its self-check ran for this
    shape class; the check cannot run there. The caller runs the unpacked
    build and has the check run outside the trace (:func:`pack_check_pass`;
    ``decode.py`` does both). Counted by :func:`pack_checks_due`."""


_PACK_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("qab_pack_check_pass",
                                                                   default=False)
_PACK_CHECKS_DUE = [0]


@contextlib.contextmanager
def pack_check_pass() -> Iterator[None]:
    """Marks eager decode calls that also self-check the MoE blocks' packed builds.

    Inside, a block that would run its packed build in the compiled decode
    step (a valid :class:`~qwen_apple_backend.layers.moe.BlockPack`, the
    one-launch block ready) runs :func:`decode_block_ready` with its pack for
    the call's shape class, outside any trace, and then runs its unpacked
    build as any eager call does (the same bits). The compiled decode step
    makes one such call after it builds new packs, and after a trace that
    left a pack out (:class:`PackCheckDue`).
    """
    token = _PACK_CHECK.set(True)
    try:
        yield
    finally:
        _PACK_CHECK.reset(token)


def pack_check_passing() -> bool:
    """True inside :func:`pack_check_pass`."""
    return _PACK_CHECK.get()


def pack_checks_due() -> int:
    """How many times a packed build was left out of a compiled trace for want of
    its self-check (:class:`PackCheckDue`), in this process."""
    return _PACK_CHECKS_DUE[0]


def serial_counter(rows: int = FOLD_NORM_MAX_ROWS) -> mx.array:
    """A counting kernel's counter for launches that never overlap: uint32 zeros, >= ``rows``.

    A real (contiguous, evaluated) buffer, which the launch reads in place:
    no copy before each launch, unlike :func:`fold_norm_counter`'s view (the
    copy was one more kernel per MoE layer and token, ``copy_g_nd``: 40 per
    token for Qwen3.6, each a launch for the host to encode). Each counting
    kernel resets its row to 0 when done, so the next launch finds zeros. Two
    launches that overlap would corrupt it (measured: the route read unwritten
    expert indices and the GPU faulted), so a caller owns one per call site
    and uses it only inside :func:`serial_decode_trace`. ``max(rows, 4)`` elements,
    at least 16 bytes (:func:`ops.device.unpooled_length`: not MLX's small
    pool); 32 bytes at the default size.

    Raises:
        ValueError: if ``rows < 1``.
    """
    if rows < 1:
        raise ValueError(f"a counter needs at least one row, got rows={rows}")
    c = mx.zeros((unpooled_length(rows, mx.uint32),), dtype=mx.uint32)
    mx.eval(c)
    return c


def _moe_shared_decode_norm_call(backend: str, x, inds, scores, gate_up: ExpertWeights,
                                 down: ExpertWeights, shared: SharedExpertWeights,
                                 residual: mx.array, norm_weight: mx.array, eps: float,
                                 counter: mx.array) -> tuple:
    ind, sc, N = _decode_rows(x, inds, scores)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.shape} {residual.dtype} must have x's shape "
                         f"{x.shape} and dtype {x.dtype}")
    if N > counter.size:
        raise ValueError(f"{N} token rows but a counter of {counter.size}")
    H, K = x.shape[-1], ind.shape[-1]
    I = gate_up.weight.shape[1] // 2
    objects, dn_kernel = _fold_objects(backend), _fold_norm_object(backend)
    if objects is None or dn_kernel is None:
        raise RuntimeError(f"no MoE fold-with-norm decode kernel sources or MLX API for {backend}")
    sd = shared.down_proj
    h, logit = _fold_gate_up_launch(objects[0], x, ind, gate_up, shared, N, H, I, K)
    y, yn = dn_kernel(
        inputs=[h, ind, sc, down.weight, down.scales, down.biases,
                sd.weight, sd.scales, sd.biases, logit, residual, norm_weight,
                f32_scalar(float(eps)), counter],
        template=[("OutT", x.dtype), ("H", H), ("I", I), ("K", K), ("G", down.group_size),
                  ("ST", sc.dtype), ("BLOCK", _GEMV_BLOCK)],
        grid=(_down_grid_x(H), N, 1), threadgroup=(_GEMV_BLOCK, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return y, yn


def shared_decode_norm_ready(x: mx.array, inds: mx.array, gate_up: ExpertWeights,
                             down: ExpertWeights, shared: SharedExpertWeights,
                             norm_weight: mx.array, eps: float) -> Optional[str]:
    """The backend whose fold may also apply the next layer's input RMSNorm, or None.

    ``kernels/cuda/moe_down_shared_norm_gemv``: the fold's down kernel with
    the residual added and, in its epilogue, ``rms_norm(y, norm_weight,
    eps)`` of the finished row (by the last block to finish it), so the next
    decoder layer's input norm is not a launch of its own
    (:func:`moe_shared_experts_norm_kernel`). CUDA only. Eligible: what
    :func:`shared_decode_kernel_ready` accepts (and it must have passed for
    this call: it is asked first), at most :data:`FOLD_NORM_MAX_ROWS` rows,
    and a norm weight ``[H]`` of ``x``'s dtype. On the first call per shape
    class the kernel is self-checked against the portable fold plus
    ``mx.fast.rms_norm``; call it outside ``mx.compile``.

    Args:
        x (mx.array): token activations ``[..., H]`` (or a stand-in).
        inds (mx.array): expert indices ``[..., K]`` uint32 (or a stand-in).
        gate_up (ExpertWeights): ``[E, 2I, H]``, 4-bit.
        down (ExpertWeights): ``[E, H, I]``, 4-bit.
        shared (SharedExpertWeights): the shared expert and its gate.
        norm_weight (mx.array): the next layer's input norm weight ``[H]``.
        eps (float): that norm's epsilon.

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, kernels disabled,
        outside the contract, the kernel unverified without
        ``QAB_UNVERIFIED_KERNELS``, or a failed self-check, which also warns).
    """
    if envs.kernels_disabled() or gpu_backend() != "cuda" or x.ndim == 0:
        return None
    H = x.shape[-1]
    N = x.size // H if H else 0
    if (N > FOLD_NORM_MAX_ROWS or norm_weight.shape != (H,) or norm_weight.dtype != x.dtype
            or _fold_norm_object("cuda") is None):
        return None
    if shared_decode_kernel_ready(x, inds, gate_up, down, shared) != "cuda":
        return None
    E, K = gate_up.weight.shape[0], inds.shape[-1]
    I = gate_up.weight.shape[1] // 2
    dtype = x.dtype

    def make_inputs():
        k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(8765), 5)
        xs = mx.random.normal((3, 1, H), key=k1).astype(dtype)
        ind = mx.argsort(mx.random.uniform(shape=(3, 1, E), key=k2), axis=-1)[..., :K]
        sc = mx.softmax(mx.random.normal((3, 1, K), key=k3), axis=-1).astype(dtype)
        res = (4.0 * mx.random.normal((3, 1, H), key=k4)).astype(dtype)
        w = (1.0 + 0.2 * mx.random.normal((H,), key=k5)).astype(dtype)
        return xs, ind.astype(mx.uint32), sc, res, w

    def kernel(xs, ind, sc, res, w):
        y, yn = _moe_shared_decode_norm_call("cuda", xs, ind, sc, gate_up, down, shared, res,
                                             w, eps, fold_norm_counter())
        return [y, yn]

    def reference(xs, ind, sc, res, w):
        y = res + moe_shared_experts_ops(xs.astype(mx.float32), ind, sc.astype(mx.float32),
                                         gate_up, down, shared, sort=False).astype(dtype)
        return [y, mx.fast.rms_norm(y, w, eps)]

    # The fold's own budget (shared_decode_kernel_ready) for y, and for yn,
    # the norm of y.
    rtol = 1e-4 if dtype == mx.float32 else 2e-2
    g = shared.gate
    key = (E, H, I, K, gate_up.group_size, down.group_size, g.bits, g.group_size,
           str(gate_up.scales.dtype), str(g.scales.dtype), str(dtype), float(eps))
    ok = self_checked(
        "moe_down_shared_norm_gemv", "cuda", key,
        kernel=kernel, reference=reference, make_inputs=make_inputs, rtol=rtol)
    return "cuda" if ok else None


def moe_shared_experts_norm_kernel(backend: Optional[str] = None) -> Optional[Callable]:
    """The fold with the next layer's input RMSNorm in its last kernel, as one function.

    No self-check here: call it only after :func:`shared_decode_norm_ready`
    returned ``backend``.

    Returns:
        Callable | None: ``f(x, inds, scores, gate_up, down, shared, residual,
        norm_weight, eps, counter) -> (y, yn)``: ``y = residual + block`` as
        :func:`moe_shared_experts_kernel` returns it with a residual, ``yn =
        rms_norm(y) * norm_weight`` (rounding points of ``mx.fast.rms_norm``);
        ``counter`` from :func:`fold_norm_counter` (each launch counts in its
        own copy). None when the backend has no such kernel (only CUDA has
        one).

    Shapes:
        x, residual, y, yn: ``[..., H]`` (at most :data:`FOLD_NORM_MAX_ROWS`
        rows); norm_weight: ``[H]``.
    """
    backend = backend or gpu_backend()
    if backend != "cuda" or _fold_objects(backend) is None or _fold_norm_object(backend) is None:
        return None
    return functools.partial(_moe_shared_decode_norm_call, backend)


def shared_decode_kernel_ready(x: mx.array, inds: mx.array, gate_up: ExpertWeights,
                               down: ExpertWeights,
                               shared: SharedExpertWeights) -> Optional[str]:
    """The GPU backend whose shared-expert decode kernels may run this call, or None.

    The fold: ``moe_gate_up_shared_gemv`` computes the K routed experts' and
    the shared expert's SiLU-gated rows (the shared one as slot K) and the
    shared gate's logit; ``moe_down_shared_gemv`` adds ``sigmoid(logit) *
    down(h_shared)`` to the score-weighted routed sum. Two launches for the
    whole block after routing. Eligible: what :func:`decode_kernel_ready`
    accepts, plus a shared expert of the routed experts' size
    (``I``), 4-bit affine with their group size and scale dtype, and a 4- or
    8-bit affine shared gate with groups a multiple of 32. On the first call
    per shape class both kernels are self-checked against
    :func:`moe_shared_experts_ops` with these very weights; call it outside
    ``mx.compile`` first, as ``FusedSparseMoeBlock`` does. CUDA: built only
    once its manifest entry records a GPU verification, or with
    ``QAB_UNVERIFIED_KERNELS=1``.

    Args:
        x (mx.array): token activations ``[..., H]``.
        inds (mx.array): expert indices ``[..., K]``.
        gate_up (ExpertWeights): ``[E, 2I, H]``.
        down (ExpertWeights): ``[E, H, I]``.
        shared (SharedExpertWeights): the shared expert and its gate.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled, unsupported shapes or quantization, too many rows, or a
        failed self-check, which also warns).
    """
    if envs.kernels_disabled() or inds.size >= SORT_THRESHOLD:
        return None
    backend = gpu_backend()
    H, K = x.shape[-1], inds.shape[-1]
    if (backend is None or x.dtype not in (mx.float32, mx.bfloat16, mx.float16)
            or not _fold_shapes_supported(H, gate_up, down, shared)
            or _fold_objects(backend) is None):
        return None
    E = gate_up.weight.shape[0]
    I = gate_up.weight.shape[1] // 2
    dtype = x.dtype

    def make_inputs():
        k1, k2, k3, k4 = mx.random.split(mx.random.key(4321), 4)
        # Three tokens as [3, 1, H]: rows over leading axes, as decode passes them.
        xs = mx.random.normal((3, 1, H), key=k1).astype(dtype)
        ind = mx.argsort(mx.random.uniform(shape=(3, 1, E), key=k2), axis=-1)[..., :K]
        sc = mx.softmax(mx.random.normal((3, 1, K), key=k3), axis=-1).astype(dtype)
        res = mx.random.normal((3, 1, H), key=k4).astype(dtype)
        return xs, ind.astype(mx.uint32), sc, gate_up, down, shared, res

    # Every build the layers use: scores in the activations' dtype (the
    # router's) and in float32 (the down kernel is built per scores dtype),
    # and with the decoder layer's residual added in the epilogue.
    def kernel(xs, ind, sc, gu, dn, sw, res):
        return [_moe_shared_decode_kernel_call(backend, xs, ind, s, gu, dn, sw, residual=r)
                for r in (None, res) for s in (sc, sc.astype(mx.float32))]

    # Reference with float32 activations, rounded once: what is measured is
    # the kernels' own error. float32: summation order only. bf16 / fp16: h
    # and the output are rounded to ~3 significant digits (the routed
    # kernels' budget). The residual is added as the stock layer adds it.
    def reference(xs, ind, sc, gu, dn, sw, res):
        y = moe_shared_experts_ops(xs.astype(mx.float32), ind, sc.astype(mx.float32), gu, dn, sw,
                                   sort=False).astype(dtype)
        return [y, y, res + y, res + y]

    rtol = 1e-4 if dtype == mx.float32 else 2e-2
    g = shared.gate
    key = (E, H, I, K, gate_up.group_size, down.group_size, g.bits, g.group_size,
           str(gate_up.scales.dtype), str(g.scales.dtype), str(dtype))
    ok = self_checked(
        "moe_shared_decode_gemv", backend, key,
        kernel=kernel, reference=reference, make_inputs=make_inputs, rtol=rtol)
    return backend if ok else None


def moe_shared_experts_kernel(backend: Optional[str] = None) -> Optional[Callable]:
    """The fused GPU decode kernels with the shared expert folded in, as one function.

    No self-check here: call it only after :func:`shared_decode_kernel_ready`
    returned ``backend``.

    Args:
        backend (str | None): ``"cuda"`` / ``"metal"``; default the live GPU backend.

    Returns:
        Callable | None: ``f(x, inds, scores, gate_up, down, shared,
        residual=None) -> y`` (``x``'s dtype and shape; with ``residual``, of
        ``x``'s shape and dtype, ``residual + y`` added in the down kernel's
        epilogue exactly as the stock decoder layer adds it), or None when
        there is no GPU backend or no kernel source for it.
    """
    backend = backend or gpu_backend()
    if backend is None or _fold_objects(backend) is None:
        return None
    return functools.partial(_moe_shared_decode_kernel_call, backend)


# --------------------------------------------------------------------------
# The whole MoE half of a decode layer in one launch (CUDA)
# --------------------------------------------------------------------------

#: moe_decode_block's build choices (template values; see the kernel's
#: source): CS, the stride in uint32 elements between its four launch-wide
#: counters; PERSIST, whether a block keeps taking tickets (then GRID blocks,
#: None: one per ticket); PREFETCH, whether a down item loads its weights
#: before it waits for the gate/up items; STAGE, whether a down item copies
#: the token's gate/up activations into shared memory once (cp.async) instead
#: of each lane reading its chunks from L2 one after another (the default of
#: :func:`moe_decode_block`'s ``stage``; the ``moe-block-stage`` switch sets it
#: per model); GRPW, (gate, up) row pairs per gate/up warp (2 as the
#: standalone kernel; 4 halves the gate/up blocks: slower, 38.1 against 34.6
#: us per launch); EARLY, whether a gate/up item stages the token's norm
#: itself and waits for the route only when it holds routed rows (the shared
#: expert's rows then run during the route; the default of
#: :func:`moe_decode_block`'s ``early``). The defaults were the fastest of
#: benchmarks/profile_moe_block_gpu.py's variants on the H200 (STAGE: 34.3
#: against 43 us per launch there, two runs; EARLY: 29.5 / 29.3 against 34.6
#: / 35.4, two runs). PRW, the next projection's rows per warp (registers);
#: PSM, 0 or the next projection's rows per block staged in dynamic shared
#: memory by cp.async (:func:`decode_block_dynamic_shared_bytes`; then PRW is
#: not used): fewer, larger next-projection blocks, the same bits. GDS, the
#: Gated DeltaNet phase's items per value head (GD builds), each covering
#: Dv / GDS state rows with all of its state loads in flight; the
#: out-projection items then apply the gated RMSNorm: the same bits. UNROLL,
#: whether the out- and next-projection phases stage their input row in loops
#: unrolled over the block's compile-time size (a thread's L2 reads out
#: together; the same values; the default of :func:`moe_decode_block`'s
#: ``unroll``; the ``moe-block-unroll`` switch sets it per model): on;
#: measured 77.4 against 83.1 us per Gated DeltaNet layer launch on an H100,
#: the same bits (benchmarks/profile_layer_gpu.py). NPL, whether a block that
#: ran a next-projection item takes the next ticket too, reusing the input
#: row it staged (no wait, norm or staging for later items of that row, the
#: next ticket taken while the current item's weights load; NP builds
#: without PSM; the same bits; the default of :func:`moe_decode_block`'s
#: ``npl``; the ``moe-block-npl`` switch sets it per model): on; measured
#: 73.7 against 79.0 us per Gated DeltaNet layer launch on an H200. RPL,
#: whether the route items and the EARLY gate/up items load the token's
#: residual row, the norm weight and eps before they wait for the mixer's
#: output (their trips to memory overlapping the wait; the same bits). GSR,
#: whether a gate/up item of routed rows (EARLY builds) routes its token row
#: itself from the router logits once every route block has counted them,
#: instead of waiting for the route's last block to route, write and count
#: the row (the same routing code: the same bits). Both off: measured slower
#: on an H200 (benchmarks/profile_layer_gpu.py, one run: 73.4 us per Gated
#: DeltaNet layer launch with both, 74.3 with GSR alone, 72.8 with RPL alone,
#: 70.5 with neither; end to end at 4K 307.5 against 310.2 tok/s without them).
#: NPS (0, 1 or 2; :func:`_nps_build` completes the build): a persistent grid
#: whose blocks copy their next-projection rows into shared memory at their
#: start (1) or after their first item (2) and run those rows after their
#: tickets (the same bits); off (the opt-in ``moe-block-nps`` sets
#: :data:`NPS_MODE`): measured slower on an H200, 74.0 (1) and 74.3 (2) against
#: 71.0 us per Gated DeltaNet layer launch (benchmarks/profile_layer_gpu.py).
#: ROLL, whether the items' dot loops (out- and next-projection without PSM,
#: route logits, gate/up, down) run one chunk's (step's, task's) code in a
#: loop, their loaded weights shifted down a register array after each,
#: instead of unrolled straight-line code: the same arithmetic in the same
#: order, so the same bits, in about two thirds of the kernel's code (nvcc 13,
#: sm_90, the packed GD build: 121 against 176 KiB of SASS,
#: benchmarks/results/moe-block-code-size-s39.txt). A phase's first block on
#: an SM fetches its code through the SM's instruction cache, which the
#: launch's code overflows (Nsight Compute: "no instruction" the largest stall
#: of the down and out-projection items' dots). The default of
#: :func:`moe_decode_block`'s ``roll``; the ``moe-block-roll`` switch sets it
#: per model: on; on an H100, in the last of 4 chained launches
#: (benchmarks/profile_layer_gpu.py --timeline --warm 4), the launch's last
#: phase ends at 56.6 against 62.2 us, and end to end at 4K 326.8 against
#: 305.0 tok/s.
#: NPG: with NPL's looping next-projection items (NP, NPL, no PSM, not
#: PERSIST), the launch's grid holds as many blocks for the next projection as
#: the GPU keeps resident (:func:`_resident_blocks`: two per SM) instead of
#: one per item: the blocks that take its tickets run them in a loop (NPL)
#: until none is left, so the blocks a full grid would start after that, each
#: only to take a ticket past the last and leave, are not launched; the same
#: bits. On by default (the ``moe-block-npg`` switch sets it per model); on an
#: H100, the warm chain of Gated DeltaNet layer launches
#: (benchmarks/profile_layer_gpu.py --timeline --warm 8): 60.99 against 61.78 us
#: per launch, the gap between launches 4.34 against 5.06 us. Where the SM
#: count is unknown, the grid is one block per item.
DECODE_BLOCK_OPTIONS = {"CS": 32, "PERSIST": False, "PREFETCH": True, "GRID": None,
                        "STAGE": True, "GRPW": 2, "EARLY": True, "PRW": 2, "PSM": 0, "GDS": 1,
                        "UNROLL": True, "NPL": True, "RPL": False, "GSR": False, "NPS": 0,
                        "ROLL": True, "NPG": True}
#: The blocks of 256 threads at <= 128 registers that an SM keeps resident (the
#: packed builds' launch bounds): NPS's persistent grid and NPG's next-projection
#: blocks per SM.
RESIDENT_BLOCKS_PER_SM = 2


def _resident_blocks(backend: str) -> int:
    """The one-launch MoE block's blocks the GPU keeps resident at once
    (:data:`RESIDENT_BLOCKS_PER_SM` per SM, :func:`~qwen_apple_backend.ops.device.cuda_sm_count`),
    or 0 off CUDA or where the SM count is unknown."""
    return RESIDENT_BLOCKS_PER_SM * (cuda_sm_count() if backend == "cuda" else 0)

#: The values of DECODE_BLOCK_OPTIONS' row counts a launch accepts (PRW 8
#: spills registers at the two blocks per SM the block is built for; PSM
#: above 64 would leave room for only one block per SM).
DECODE_BLOCK_CHOICES = {"GRPW": (1, 2, 4), "PRW": (1, 2, 4), "PSM": (0, 16, 32, 48, 64),
                        "GDS": (1, 2, 4), "NPS": (0, 1, 2)}


def decode_block_dynamic_shared_bytes(psm: int, H: int, group_size: int, dtype: mx.Dtype) -> int:
    """Bytes of dynamic shared memory a :func:`moe_decode_block` launch with
    the next-projection phase requests at ``DECODE_BLOCK_OPTIONS["PSM"] ==
    psm``: ``psm`` rows of the ``[PN, H]`` 4-bit projection (``H / 2`` bytes
    each) and their scales and biases (``H / group_size`` values of ``dtype``
    each; the kernel's ``qab_q4_gemv_rows_staged``), at least
    :data:`_MLX_DYNAMIC_SHARED_FLOOR`; 0 when ``psm`` is 0."""
    if not psm:
        return 0
    return max(int(psm) * (H // 2 + 2 * (H // int(group_size)) * dtype.size),
               _MLX_DYNAMIC_SHARED_FLOOR)


#: MLX raises a CUDA kernel's dynamic shared-memory limit (the driver's
#: default: 48 KB with the static bytes) only for requests above 48,000 bytes;
#: the block's static shared memory (~41 KB) plus a smaller request exceeds
#: the default, and the launch fails ("cuGraphAddKernelNode ... invalid
#: argument", seen on an H100 at PSM 32). Smaller requests are raised to this.
_MLX_DYNAMIC_SHARED_FLOOR = 48 * 1024


def decode_block_counter_length(rows: int = FOLD_NORM_MAX_ROWS) -> int:
    """Elements of the counter a :func:`moe_decode_block` launch needs for ``rows`` token rows:
    its six launch-wide counters ``CS`` elements apart (seven with the GDN
    phase), then one per row."""
    return 7 * DECODE_BLOCK_OPTIONS["CS"] + rows


def decode_block_pack_workspace_offset() -> int:
    """Word of the packed build's counter at which its workspace starts (the kernel's ``WSO``):
    :func:`decode_block_counter_length` of :data:`FOLD_NORM_MAX_ROWS` rows, rounded
    up to 32 words (128 bytes). One value, so one build."""
    return -(-decode_block_counter_length() // 32) * 32


def decode_block_pack_counter_length(rows: int, H: int, E: int, K: int, I: int,
                                     dtype: mx.Dtype, out_proj: bool,
                                     gdn: Optional["GatedDeltaStep"] = None) -> int:
    """uint32 elements of the counter a packed :func:`moe_decode_block` launch needs.

    The packed build (``moe-block-pack``) has no workspace output: its
    counters, then from word :func:`decode_block_pack_workspace_offset` on the
    workspace of :func:`decode_block_workspace_words` (with ``gdn``, the GD
    build, also the Gated DeltaNet step's output and its new conv state
    before the in-place copy). MLX's host cost grows with every output of a
    launch (``benchmarks/profile_encode.py``: a custom kernel with 10 outputs
    against one, about 2 us more to build and 3 us more to encode per output
    on the H200's host). The counter must be a :func:`serial_counter` used
    only inside :func:`serial_decode_trace` (the workspace is then kept
    between launches that never overlap).

    Args:
        rows (int): token rows of the launch (at most :data:`FOLD_NORM_MAX_ROWS`).
        H, E, K, I (int): hidden size, experts, experts per token, expert
            intermediate size.
        dtype (mx.Dtype): the activations' dtype.
        out_proj (bool): the build with the out-projection phase.
        gdn (GatedDeltaStep | None): the GD build's step (its heads and conv
            width size the extra segments).

    Returns:
        int: elements.
    """
    gdn_outputs = gdn_conv = 0
    if gdn is not None:
        Hk, Hv, Dk, Dv = (int(v) for v in gdn.heads)
        gdn_outputs = Hv * Dv
        gdn_conv = (gdn.conv_w.shape[1] - 1) * (2 * Hk * Dk + Hv * Dv)
    return decode_block_pack_workspace_offset() + decode_block_workspace_words(
        rows, H, E, K, I, dtype, out_proj, gdn_outputs, gdn_conv)


#: Output rows per warp of moe_decode_block's out-projection items (the
#: kernel's QAB_OUT_RPW).
_OUT_PROJ_RPW = 2


class OutProjection(NamedTuple):
    """A mixer's output projection, handed to :func:`moe_decode_block` to run
    as its first phase (``r = x @ dequantize(weights).T``; the ``OP`` build).

    Attributes:
        x (mx.array): the mixer's output before its projection ``[..., DO]``
            (the attention's gated heads, the Gated DeltaNet's normed heads),
            the dtype of the block's activations.
        weights (ExpertWeights): the projection ``[H, DO]``, 4-bit affine
            (:func:`~qwen_apple_backend.layers.moe.linear_weights` of the
            mixer's ``o_proj`` / ``out_proj``); the limits on its shape and
            group size: :func:`out_projection_supported`.
    """

    x: mx.array
    weights: ExpertWeights


def out_projection_supported(x: mx.array, out_proj: OutProjection) -> bool:
    """Whether moe_decode_block's out-projection phase covers ``out_proj`` (no backend check).

    4-bit affine weights ``[H, DO / 8]`` uint32 (``H`` = ``x.shape[-1]``)
    with scales and biases ``[H, DO / group_size]`` of ``x``'s dtype, no
    additive bias, ``DO % 1024 == 0``, ``group_size % 32 == 0``, and the
    projection's input ``[..., DO]`` with ``x``'s rows and dtype.

    Args:
        x (mx.array): the block's residual stream ``[..., H]``.
        out_proj (OutProjection): the projection's input and weights
            (``weights`` None, e.g. ``linear_weights`` of a LoRA wrapper:
            not covered).

    Returns:
        bool: whether the ``OP`` build can run it.
    """
    px = out_proj.x
    if px is None or px.ndim == 0:
        return False
    H, DO = x.shape[-1], px.shape[-1]
    return (DO % 1024 == 0 and px.dtype == x.dtype and px.size // DO == x.size // H
            and _q4_affine_matrix(out_proj.weights, H, DO, x.dtype))


def _q4_affine_matrix(w: Optional[ExpertWeights], rows: int, cols: int, dtype: mx.Dtype) -> bool:
    """Whether ``w`` is a 4-bit affine ``[rows, cols]`` matrix as the block's
    projection phases read it: packed ``[rows, cols / 8]`` uint32, scales and
    biases ``[rows, cols / group_size]`` of ``dtype``, ``group_size % 32 ==
    0``, no additive bias."""
    return (w is not None and w.bits == 4 and w.mode == "affine" and w.biases is not None
            and w.bias is None and w.scales is not None and bool(w.group_size)
            and w.group_size % 32 == 0 and cols % w.group_size == 0
            and w.weight.dtype == mx.uint32 and w.weight.shape == (rows, cols // 8)
            and w.scales.shape == (rows, cols // w.group_size)
            and w.biases.shape == w.scales.shape
            and w.scales.dtype == dtype and w.biases.dtype == dtype)


def _proj_phase_blocks(rows: int, rpw: int = _OUT_PROJ_RPW, psm: int = 0) -> int:
    """Blocks per token row of a moe_decode_block projection phase with
    ``rows`` output rows (OP: H; NP: the next projection's rows) and ``rpw``
    rows per warp (OP: 2; NP: ``DECODE_BLOCK_OPTIONS["PRW"]``), or ``psm``
    rows per block when nonzero (NP: ``DECODE_BLOCK_OPTIONS["PSM"]``)."""
    per_block = int(psm) or (_GEMV_BLOCK // 32) * int(rpw)
    return -(-rows // per_block)


class NextProjection(NamedTuple):
    """The NEXT decoder layer's input RMSNorm and 4-bit input projection, handed
    to :func:`moe_decode_block` to run as its last phase
    (``po = rms_norm(out, norm_weight, eps) @ dequantize(weights).T``; the
    ``NP`` build).

    Attributes:
        norm_weight (mx.array): the next layer's input RMSNorm weight ``[H]``,
            the dtype of the block's activations.
        eps (float): that norm's epsilon.
        weights (ExpertWeights): the next mixer's (concatenated) input
            projection ``[PN, H]``, 4-bit affine.
    """

    norm_weight: mx.array
    eps: float
    weights: ExpertWeights


def next_projection_supported(x: mx.array, next_proj: NextProjection) -> bool:
    """Whether moe_decode_block's next-projection phase covers ``next_proj`` (no backend check).

    4-bit affine weights ``[PN, H / 8]`` uint32 (``H`` = ``x.shape[-1]``, a
    multiple of 1,024) with scales and biases ``[PN, H / group_size]`` of
    ``x``'s dtype, no additive bias, ``group_size % 32 == 0``, ``PN >= 1``,
    and a norm weight ``[H]`` of ``x``'s dtype.
    """
    w, H = next_proj.weights, x.shape[-1]
    if w is None or w.weight.ndim != 2 or H % 1024:
        return False
    PN = w.weight.shape[0]
    return (PN >= 1 and _q4_affine_matrix(w, PN, H, x.dtype)
            and next_proj.norm_weight.shape == (H,) and next_proj.norm_weight.dtype == x.dtype)


class GatedDeltaStep(NamedTuple):
    """A decoder layer's Gated DeltaNet decode step, handed to :func:`moe_decode_block`
    to run as its first phase (the ``GD`` build, op ``moe_decode_block_gdn``):
    ``gated_delta_decode_kernel``'s arithmetic on the mixer's concatenated
    input projection, whose output is the out-projection phase's input.

    Attributes:
        proj (mx.array): the concatenated input projection's output ``[B, 1,
            GW]`` (or ``[B, GW]``), channels q | k | v | z | b | a, ``GW = 2 Hk
            Dk + 2 Hv Dv + 2 Hv``, the block's activation dtype.
        conv_state (mx.array): ``[B, Kc - 1, 2 Hk Dk + Hv Dv]``, that dtype.
        conv_w (mx.array): the depthwise conv weight ``[conv_dim, Kc, 1]``, that dtype.
        conv_b (mx.array | None): its bias ``[conv_dim]``, that dtype.
        A_log (mx.array): ``[Hv]`` (read as float32).
        dt_bias (mx.array): ``[Hv]``, that dtype.
        norm_weight (mx.array): the gated RMSNorm weight ``[Dv]``, that dtype.
        eps (float): that norm's epsilon.
        state (mx.array): the recurrent state ``[B, Hv, Dv, Dk]`` float32.
        heads (tuple): ``(Hk, Hv, Dk, Dv)``.
    """

    proj: mx.array
    conv_state: mx.array
    conv_w: mx.array
    conv_b: Optional[mx.array]
    A_log: mx.array
    dt_bias: mx.array
    norm_weight: mx.array
    eps: float
    state: mx.array
    heads: tuple


def gated_delta_step_supported(x: mx.array, step: GatedDeltaStep,
                               out_weights: Optional[ExpertWeights]) -> bool:
    """Whether moe_decode_block's Gated DeltaNet phase covers ``step`` (no backend check).

    ``x``'s rows and dtype for the projection row and the conv state, float32
    state, a depthwise conv weight of the activations' dtype (as its bias,
    ``dt_bias`` and the norm weight), heads within the GDN decode kernel's
    limits (``Dk % 32 == 0``, at most 64 state floats per lane, ``Hv % Hk ==
    0``), and ``out_weights`` (the mixer's output projection, run by the
    ``OP`` phase) a 4-bit affine ``[H, Hv Dv]`` matrix with ``Hv Dv % 1024 ==
    0``.
    """
    from .gated_delta import _decode_supported

    Hk, Hv, Dk, Dv = (int(v) for v in step.heads)
    H, dtype = x.shape[-1], x.dtype
    rows = x.size // H
    w = step.conv_w
    if Hk < 1 or Hv % Hk or w.ndim != 3 or w.shape[2] != 1:
        return False
    Kc, C = w.shape[1], 2 * Hk * Dk + Hv * Dv
    GW = C + Hv * Dv + 2 * Hv
    p, cs, st = step.proj, step.conv_state, step.state
    DO = Hv * Dv
    # (The GDN per-head code runs with the block's threadgroup.)
    return (_decode_supported(Dk, Dv, Kc, dtype, block=_GEMV_BLOCK)
            and p.dtype == dtype and p.ndim >= 1 and p.shape[-1] == GW and p.size == rows * GW
            and cs.shape == (rows, Kc - 1, C) and cs.dtype == dtype
            and w.shape[0] == C and w.dtype == dtype
            and (step.conv_b is None or (step.conv_b.shape == (C,)
                                         and step.conv_b.dtype == dtype))
            and step.A_log.shape == (Hv,) and step.dt_bias.shape == (Hv,)
            and step.dt_bias.dtype == dtype
            and step.norm_weight.shape == (Dv,) and step.norm_weight.dtype == dtype
            and st.shape == (rows, Hv, Dv, Dk) and st.dtype == mx.float32
            and DO % 1024 == 0 and _q4_affine_matrix(out_weights, H, DO, dtype))


# shared_memory: the dynamic shared memory a launch requests (PSM's staged
# rows; MLX sets it when it builds the kernel object), 0 for none.
@functools.lru_cache(maxsize=None)
def _decode_block_object(backend: str, shared_memory: int = 0):
    return build_kernel("moe_decode_block", backend,
                        **({"shared_memory": shared_memory} if shared_memory else {}))


@functools.lru_cache(maxsize=None)
def _decode_block_gdn_object(backend: str, shared_memory: int = 0):
    return build_kernel("moe_decode_block_gdn", backend,
                        **({"shared_memory": shared_memory} if shared_memory else {}))


@functools.lru_cache(maxsize=None)
def _decode_block_pack_object(backend: str, gdn: bool = False, shared_memory: int = 0):
    return build_kernel("moe_decode_block_gdn_pack" if gdn else "moe_decode_block_pack", backend,
                        **({"shared_memory": shared_memory} if shared_memory else {}))


#: Byte alignment of each segment of :func:`decode_block_pack` (the kernel's ``pk_take``).
PACK_ALIGN = 128


def decode_block_pack_segments(gate: "ExpertWeights", gate_up: ExpertWeights,
                               shared: SharedExpertWeights) -> tuple:
    """Byte sizes of the packed block's segments, in the kernel's order.

    ``kernels/cuda/moe_decode_block.cu`` built with ``QAB_BLOCK_PACK`` (ops
    ``moe_decode_block_pack``, ``moe_decode_block_gdn_pack``) reads the
    router's, the shared expert's and the routed experts' arrays from one
    uint32 input, 128-byte aligned segments in this order: the 8-bit
    router's weight ``[E, H / 4]`` uint32, scales, biases ``[E, H / RG]``;
    the shared expert's gate and up projections' weight ``[I, H / 8]``
    uint32, scales, biases ``[I, H / G]`` each; the shared gate's weight
    ``[1, H SGB / 32]`` uint32, scales, biases ``[1, H / SGG]``; the shared
    expert's down projection's weight ``[H, I / 8]`` uint32, scales, biases
    ``[H, I / G]``; the routed experts' fused gate+up weight
    ``[E, 2I, H / 8]`` uint32, scales, biases ``[E, 2I, H / G]``; their down
    projection's weight ``[E, H, I / 8]`` uint32, scales, biases
    ``[E, H, I / G]`` (scales and biases of the activations' dtype, which
    the kernel reads them as; ``I``, ``G`` the routed experts' intermediate
    size and group size, ``H`` the hidden size). The sizes follow from the
    routed experts' and the router's shapes, as the kernel derives them from
    its template; :func:`decode_block_pack` checks every array against them.

    Returns:
        tuple: 21 byte counts.
    """
    E = gate_up.weight.shape[0]
    I = gate_up.weight.shape[1] // 2
    H = gate_up.weight.shape[2] * 32 // int(gate_up.bits)
    RG, G = int(gate.group_size), int(gate_up.group_size)
    SGB, SGG = int(shared.gate.bits), int(shared.gate.group_size)
    t = gate_up.scales.dtype.size
    q = (I * H // 2, I * (H // G) * t, I * (H // G) * t)
    return ((E * H, E * (H // RG) * t, E * (H // RG) * t) + q + q
            + (H * SGB // 8, (H // SGG) * t, (H // SGG) * t)
            + (H * I // 2, H * (I // G) * t, H * (I // G) * t)
            + (E * 2 * I * H // 2, E * 2 * I * (H // G) * t, E * 2 * I * (H // G) * t)
            + (E * H * I // 2, E * H * (I // G) * t, E * H * (I // G) * t))


#: Largest :func:`decode_block_pack` in bytes: MLX's shapes are 32-bit, and the
#: pack's byte view (:func:`decode_block_pack_views`) must have a valid length.
PACK_MAX_BYTES = 2**31 - 1

#: What each segment of :func:`decode_block_pack` holds, in order (its errors name them).
PACK_SEGMENTS = ("router weight", "router scales", "router biases",
                 "shared gate_proj weight", "shared gate_proj scales", "shared gate_proj biases",
                 "shared up_proj weight", "shared up_proj scales", "shared up_proj biases",
                 "shared_expert_gate weight", "shared_expert_gate scales",
                 "shared_expert_gate biases", "shared down_proj weight",
                 "shared down_proj scales", "shared down_proj biases",
                 "experts gate_up_proj weight", "experts gate_up_proj scales",
                 "experts gate_up_proj biases", "experts down_proj weight",
                 "experts down_proj scales", "experts down_proj biases")


def decode_block_pack_arrays(gate: "ExpertWeights", gate_up: ExpertWeights,
                             down: ExpertWeights, shared: SharedExpertWeights) -> list:
    """The 21 arrays :func:`decode_block_pack` lays out, in its order (:data:`PACK_SEGMENTS`)."""
    sg, su, sd, sgate = shared
    return [a for w in (gate, sg, su, sgate, sd, gate_up, down)
            for a in (w.weight, w.scales, w.biases)]


def decode_block_pack_offsets(gate: "ExpertWeights", gate_up: ExpertWeights,
                              shared: SharedExpertWeights) -> list:
    """``(start, bytes)`` of each segment of :func:`decode_block_pack`, in bytes from its start."""
    out, at = [], 0
    for nbytes in decode_block_pack_segments(gate, gate_up, shared):
        out.append((at, nbytes))
        at += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
    return out


def decode_block_pack_bytes(gate: "ExpertWeights", gate_up: ExpertWeights,
                            shared: SharedExpertWeights) -> int:
    """Bytes of :func:`decode_block_pack` (its last segment padded, as every one)."""
    at, nbytes = decode_block_pack_offsets(gate, gate_up, shared)[-1]
    return at + -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def decode_block_pack(gate: "ExpertWeights", gate_up: ExpertWeights, down: ExpertWeights,
                      shared: SharedExpertWeights) -> mx.array:
    """The router's, the shared expert's and the routed experts' arrays as one
    uint32 array: ``pk`` of the packed block.

    A decode token's one-launch MoE block binds about 40 arrays per layer,
    and MLX's host cost per launch grows with each
    (``benchmarks/profile_encode.py``); the packed build (``moe-block-pack``)
    takes these 21 as one. Layout: :func:`decode_block_pack_segments`, each
    segment the array's bytes (row-major) padded with zeros to
    :data:`PACK_ALIGN` bytes. A copy (the routed experts are most of a
    layer's weights): :class:`~qwen_apple_backend.layers.moe.BlockPack`
    makes the module's arrays views of it, so that the block's weights are
    held once, and rebuilds it when an array is replaced.

    Args:
        gate (ExpertWeights): the router, 8-bit affine ``[E, H]``.
        gate_up (ExpertWeights): the routed experts' 4-bit gate+up ``[E, 2I, H]``.
        down (ExpertWeights): the routed experts' 4-bit down ``[E, H, I]``.
        shared (SharedExpertWeights): the shared expert and its gate, affine
            with biases, of the experts' scales dtype.

    Returns:
        mx.array: ``[words]`` uint32 (not evaluated).

    Raises:
        ValueError: naming the array whose byte size or dtype does not
            match its segment, or for a pack of more than
            :data:`PACK_MAX_BYTES` (a layer of Qwen3.5-397B-A17B's experts).
    """
    sizes = decode_block_pack_segments(gate, gate_up, shared)
    total = decode_block_pack_bytes(gate, gate_up, shared)
    if total > PACK_MAX_BYTES:
        raise ValueError(f"decode_block_pack: {total} bytes of segments exceed the "
                         f"{PACK_MAX_BYTES} an MLX array's 32-bit shape holds as bytes")
    parts = []
    arrays = decode_block_pack_arrays(gate, gate_up, down, shared)
    for i, (name, a, nbytes) in enumerate(zip(PACK_SEGMENTS, arrays, sizes)):
        want = mx.uint32 if i % 3 == 0 else gate_up.scales.dtype
        if a is None or a.dtype != want or a.nbytes != nbytes:
            got = None if a is None else (tuple(a.shape), str(a.dtype), a.nbytes)
            raise ValueError(f"decode_block_pack: {name} {got} does not fill its segment of "
                             f"{nbytes} bytes of {want}")
        parts.append(mx.view(a.reshape(-1), mx.uint8))
        pad = -nbytes % PACK_ALIGN
        if pad:
            parts.append(mx.zeros((pad,), dtype=mx.uint8))
    return mx.view(mx.concatenate(parts), mx.uint32)


def decode_block_pack_views(pack: mx.array, gate: "ExpertWeights", gate_up: ExpertWeights,
                            down: ExpertWeights, shared: SharedExpertWeights) -> list:
    """The 21 arrays of :func:`decode_block_pack` as views of ``pack`` (not evaluated).

    Each is ``pack``'s segment reinterpreted as the original's dtype and
    shape: once evaluated it shares ``pack``'s memory (MLX slices, dtype
    views and reshapes of contiguous data do not copy), so a module holding
    these instead of the originals holds its weights once.

    Args:
        pack (mx.array): ``decode_block_pack(gate, gate_up, down, shared)``.
        gate, gate_up, down, shared: the arrays it was made of (their shapes
            and dtypes are read).

    Returns:
        list[mx.array]: in :data:`PACK_SEGMENTS`' order.
    """
    out = []
    # By bytes: a segment may hold fewer than 4 (a shared gate's one scale).
    raw = mx.view(pack, mx.uint8)
    arrays = decode_block_pack_arrays(gate, gate_up, down, shared)
    for a, (at, nbytes) in zip(arrays, decode_block_pack_offsets(gate, gate_up, shared)):
        out.append(mx.view(raw[at:at + nbytes], a.dtype).reshape(a.shape))
    return out


#: The keywords of :func:`moe_decode_block` and :func:`decode_block_ready`
#: that override a ``DECODE_BLOCK_OPTIONS`` flag, by the flag each sets.
_OVERRIDE_KEYWORDS = {"stage": "STAGE", "early": "EARLY", "unroll": "UNROLL", "npl": "NPL",
                      "roll": "ROLL"}


#: The DECODE_BLOCK_OPTIONS that are not flags but may be build overrides
#: (their values an int of DECODE_BLOCK_CHOICES).
_INT_OVERRIDES = ("NPS",)


def _check_override_flags(overrides: Mapping[str, object]) -> None:
    """Refuses build overrides keyed by anything but a ``DECODE_BLOCK_OPTIONS``
    flag (an option whose default is a bool) or one of :data:`_INT_OVERRIDES`,
    or valued other than a flag's True / False / 1 / 0 (None: the default) or
    one of an int option's ``DECODE_BLOCK_CHOICES``, naming the key.

    Raises:
        ValueError: "build overrides: ... is not a DECODE_BLOCK_OPTIONS flag ..."
            or "build overrides: KEY=VALUE ...".
    """
    for key, value in overrides.items():
        if key not in _INT_OVERRIDES and not isinstance(DECODE_BLOCK_OPTIONS.get(key), bool):
            flags = sorted(k for k, v in DECODE_BLOCK_OPTIONS.items() if isinstance(v, bool))
            ints = [f"{k} ({', '.join(map(str, DECODE_BLOCK_CHOICES[k]))})"
                    for k in _INT_OVERRIDES]
            raise ValueError(f"build overrides: {key!r} is not a DECODE_BLOCK_OPTIONS flag "
                             f"(the flags: {', '.join(flags)}) or {' or '.join(ints)}")
        if value is None:
            continue
        allowed = DECODE_BLOCK_CHOICES[key] if key in _INT_OVERRIDES else (False, True)
        # (bool is an int: True == 1, so a flag also takes 1 / 0, NPS True / False.)
        if not isinstance(value, int) or value not in allowed:
            shown = (", ".join(map(str, allowed)) if key in _INT_OVERRIDES
                     else "True, False, 1 or 0")
            raise ValueError(f"build overrides: {key}={value!r} is not one of {shown}")


def _build_overrides(overrides: Optional[Mapping[str, object]] = None,
                     **keywords: Optional[bool]) -> dict:
    """The build overrides of a public call, the one mapping its helpers pass
    on: ``overrides`` (``DECODE_BLOCK_OPTIONS`` flag -> bool, or NPS -> int) with each of
    ``keywords`` (``stage``, ``early``, ``unroll``, ``npl``, ``roll``: see
    ``_OVERRIDE_KEYWORDS``) put in under its flag; None (a keyword's or a
    value's) leaves the flag at its default, so it is dropped.

    Raises:
        ValueError: for a key that is not a ``DECODE_BLOCK_OPTIONS`` flag or NPS,
            a value a key does not take, or a keyword that disagrees with
            ``overrides``' value for its flag.
    """
    out = {} if overrides is None else {k: v for k, v in overrides.items() if v is not None}
    _check_override_flags(out)
    for name, value in keywords.items():
        if value is None:
            continue
        flag = _OVERRIDE_KEYWORDS[name]
        if flag in out and bool(out[flag]) != bool(value):
            raise ValueError(f"build overrides: {name}={value!r} disagrees with "
                             f"overrides[{flag!r}]={out[flag]!r}")
        out[flag] = value
    return out


def _decode_block_build(overrides: Optional[Mapping[str, object]] = None,
                        prefetch: bool = False,
                        out_proj: bool = False, next_proj: bool = False) -> dict:
    """The build a :func:`moe_decode_block` call runs: ``DECODE_BLOCK_OPTIONS``
    with the ``overrides`` given (a ``DECODE_BLOCK_OPTIONS`` flag -> bool
    mapping, e.g. ``{"STAGE": False}``: STAGE, EARLY, UNROLL, NPL, the flags
    :func:`moe_decode_block`'s ``stage``, ``early``, ``unroll`` and ``npl``
    set, or any other flag such as RPL and GSR; or NPS -> 0, 1 or 2; an absent
    key or a None value keeps the default) put in, PF (the L2
    prefetch of the arrays given, which needs EARLY), OP (the out-projection
    phase) and NP (the next-projection phase) set.

    Raises:
        ValueError: for an ``overrides`` key that is not a
            ``DECODE_BLOCK_OPTIONS`` flag (an option whose default is a bool)
            or NPS, or a value it does not take, naming it.
    """
    opts = dict(DECODE_BLOCK_OPTIONS)
    if overrides:
        _check_override_flags(overrides)
        for flag, value in overrides.items():
            if value is not None:
                opts[flag] = int(value) if flag in _INT_OVERRIDES else bool(value)
    opts["PF"] = bool(prefetch and opts["EARLY"])
    opts["OP"] = bool(out_proj)
    opts["NP"] = bool(next_proj)
    return opts


def _check_decode_block_build(opts: dict, I: int, gdn_dv: Optional[int]) -> None:
    """Refuses a build (:func:`_decode_block_build`'s ``opts``) the kernel cannot
    run, naming the option: ``I`` the experts' intermediate size, ``gdn_dv``
    the Gated DeltaNet step's Dv for a GD build (None otherwise: GDS is then
    not used).

    Raises:
        ValueError: "DECODE_BLOCK_OPTIONS: ..." for CS, GRID, GRPW, PRW, PSM, GDS or NPS.
    """
    if int(opts["CS"]) < 1 or (opts["GRID"] is not None and int(opts["GRID"]) < 1):
        raise ValueError(f"DECODE_BLOCK_OPTIONS: CS must be >= 1 and GRID None or >= 1, got "
                         f"CS={opts['CS']!r}, GRID={opts['GRID']!r}")
    if int(opts["GRPW"]) not in DECODE_BLOCK_CHOICES["GRPW"] or I % int(opts["GRPW"]):
        raise ValueError(f"DECODE_BLOCK_OPTIONS: GRPW must be 1, 2 or 4 and divide the "
                         f"experts' intermediate size {I}, got GRPW={opts['GRPW']!r}")
    if int(opts["PRW"]) not in DECODE_BLOCK_CHOICES["PRW"]:
        raise ValueError(f"DECODE_BLOCK_OPTIONS: PRW (the next projection's rows per warp) "
                         f"must be 1, 2 or 4, got PRW={opts['PRW']!r}")
    if int(opts["PSM"]) not in DECODE_BLOCK_CHOICES["PSM"]:
        raise ValueError(f"DECODE_BLOCK_OPTIONS: PSM (the next projection's rows per block "
                         f"staged in shared memory) must be one of "
                         f"{', '.join(map(str, DECODE_BLOCK_CHOICES['PSM']))}, "
                         f"got PSM={opts['PSM']!r}")
    if int(opts["NPS"]) not in DECODE_BLOCK_CHOICES["NPS"]:
        raise ValueError(f"DECODE_BLOCK_OPTIONS: NPS (when a persistent block copies its "
                         f"next-projection rows into shared memory) must be 0, 1 or 2, got "
                         f"NPS={opts['NPS']!r}")
    gds = int(opts["GDS"])
    if gdn_dv is not None and (gds not in DECODE_BLOCK_CHOICES["GDS"] or gdn_dv % gds):
        raise ValueError(f"DECODE_BLOCK_OPTIONS: GDS (Gated DeltaNet items per value head) "
                         f"must be 1, 2 or 4 and divide the heads' Dv {gdn_dv}, got GDS={gds!r}")


#: The next projection's rows per block that an NPS build stages when
#: ``DECODE_BLOCK_OPTIONS["PSM"]`` is 0: Qwen3.6's 12,352 rows in 258 units,
#: within the 264 blocks two per SM of its GPUs' 132 keep resident, and 9,216
#: (the attention layers') in 192.
NPS_ROWS = 48

#: The NPS mode the opt-in ``moe-block-nps`` builds: 1, each block copies its
#: next-projection rows at its start; 2, after its first item.
NPS_MODE = 1


def _nps_build(opts: dict, backend: str) -> None:
    """Completes an NPS build in place (``opts`` as :func:`_decode_block_build`
    gives it): with NPS and the next-projection phase, a persistent grid
    (PERSIST) of GRID blocks (None: the blocks the GPU keeps resident at once,
    :func:`_resident_blocks`)
    whose next-projection units stage PSM rows (0: :data:`NPS_ROWS`); NPS 2
    with its dot loops unrolled (ROLL off: rolled, nvcc 13 spills 124 bytes of
    that build's registers under the two-blocks-per-SM cap, unrolled 60).
    Without the next-projection phase, or on a GPU whose SM count is unknown,
    NPS is dropped (the build it would change is the plain one)."""
    if not opts["NPS"]:
        return
    resident = _resident_blocks(backend)
    if not opts["NP"] or (opts["GRID"] is None and resident <= 0):
        opts["NPS"] = 0
        return
    opts["PERSIST"] = True
    opts["PSM"] = int(opts["PSM"]) or NPS_ROWS
    if opts["GRID"] is None:
        opts["GRID"] = resident
    if int(opts["NPS"]) == 2:
        opts["ROLL"] = False


def _decode_block_phase_blocks(E: int, H: int, I: int, K: int,
                               grpw: Optional[int] = None) -> tuple[int, int, int]:
    """Blocks per token row of each :func:`moe_decode_block` phase: ``(route,
    gate/up, down)``, as the kernel derives them (``grpw`` gate/up row pairs
    per warp; None: ``DECODE_BLOCK_OPTIONS["GRPW"]``)."""
    _, _, route_blocks = _add_norm_route_launch(E)
    grpw = int(DECODE_BLOCK_OPTIONS["GRPW"] if grpw is None else grpw)
    gate_up_blocks = _fold_grid_x(K, I, grpw) // _GEMV_BLOCK
    down_blocks = -(-_down_grid_x(H) // _GEMV_BLOCK)
    return route_blocks, gate_up_blocks, down_blocks


def _decode_block_launch(E: int, H: int, I: int, K: int, grpw: Optional[int] = None,
                         out_proj: bool = False, next_rows: int = 0,
                         gdn_heads: int = 0, prw: Optional[int] = None,
                         psm: Optional[int] = None,
                         gds: Optional[int] = None) -> tuple[int, int, int]:
    """``(BLOCK, RB, blocks per token row)`` of a moe_decode_block launch: with
    ``gdn_heads`` (the GDN step's value heads) the GDN step's, with
    ``out_proj`` the out-projection's, then the route's, the fold's gate/up and
    the fold's down blocks, one after the other, then with ``next_rows`` (the
    next projection's rows, ``prw`` per warp or ``psm`` per block; None:
    ``DECODE_BLOCK_OPTIONS["PRW"]``, ``["PSM"]``) the next-projection's;
    ``gds`` (None: ``DECODE_BLOCK_OPTIONS["GDS"]``) GDN items per head."""
    prw = int(DECODE_BLOCK_OPTIONS["PRW"] if prw is None else prw)
    psm = int(DECODE_BLOCK_OPTIONS["PSM"] if psm is None else psm)
    gds = int(DECODE_BLOCK_OPTIONS["GDS"] if gds is None else gds)
    block, rb, _ = _add_norm_route_launch(E)
    # The kernel derives every phase's block count from its one BLOCK.
    if block != _GEMV_BLOCK:
        raise RuntimeError(f"moe_decode_block needs the route's and the fold's threadgroups "
                           f"equal, got {block} and {_GEMV_BLOCK}")
    return block, rb, (sum(_decode_block_phase_blocks(E, H, I, K, grpw)) + int(gdn_heads) * gds
                       + (_proj_phase_blocks(H) if out_proj else 0)
                       + (_proj_phase_blocks(next_rows, prw, psm) if next_rows else 0))


def _moe_decode_block_call(backend: str, x: mx.array, r: Optional[mx.array],
                           norm_weight: mx.array,
                           eps: float, gate: "ExpertWeights", top_k: int, norm_topk_prob: bool,
                           gate_up: ExpertWeights, down: ExpertWeights,
                           shared: SharedExpertWeights, counter: mx.array,
                           overrides: Optional[Mapping[str, bool]] = None,
                           prefetch: Sequence[mx.array] = (),
                           out_proj: Optional[OutProjection] = None,
                           next_proj: Optional[NextProjection] = None,
                           gdn_step: Optional[GatedDeltaStep] = None,
                           pack: Optional[mx.array] = None):
    H = x.shape[-1]
    N = x.size // H
    if decode_block_counter_length(N) > counter.size:
        raise ValueError(f"{N} token rows need a counter of {decode_block_counter_length(N)} "
                         f"elements, got {counter.size}")
    if gdn_step is not None:
        # The GDN phase computes the out-projection's input itself.
        ow = None if out_proj is None else out_proj.weights
        if ow is None or not gated_delta_step_supported(x, gdn_step, ow):
            raise ValueError(
                f"gdn_step: heads (Hk, Hv, Dk, Dv) = {tuple(gdn_step.heads)}, proj "
                f"{gdn_step.proj.shape} {gdn_step.proj.dtype}, conv_state "
                f"{gdn_step.conv_state.shape}, conv_w {gdn_step.conv_w.shape} "
                f"{gdn_step.conv_w.dtype}, state {gdn_step.state.shape} "
                f"{gdn_step.state.dtype} with out_proj weights "
                f"{None if ow is None else (ow.weight.shape, ow.bits, ow.group_size)} is "
                f"outside gated_delta_step_supported for x {x.shape} {x.dtype} (the GDN "
                f"phase needs the out-projection phase over its Hv * Dv outputs)")
    elif out_proj is not None and not out_projection_supported(x, out_proj):
        w = out_proj.weights
        raise ValueError(
            f"out_proj: {w.bits}-bit {w.mode} weight {w.weight.shape} (group size "
            f"{w.group_size}) over input {out_proj.x.shape} {out_proj.x.dtype} is not a 4-bit "
            f"affine [{H}, DO / 8] projection with DO % 1024 == 0 for x {x.shape} {x.dtype}")
    if out_proj is not None:
        if r is not None:
            raise ValueError("r must be None with out_proj (the launch computes it), got an "
                             f"array {r.shape} {r.dtype}")
        r = x  # not read: the launch computes r itself
    if next_proj is not None and not next_projection_supported(x, next_proj):
        w = next_proj.weights
        raise ValueError(
            f"next_proj: {w.bits}-bit {w.mode} weight {w.weight.shape} (group size "
            f"{w.group_size}) with norm weight {next_proj.norm_weight.shape} is not a 4-bit "
            f"affine [PN, {H} / 8] projection for x {x.shape} {x.dtype} (H % 1024 == 0)")
    if out_proj is None and (r is None or r.shape != x.shape or r.dtype != x.dtype):
        raise ValueError(f"r {None if r is None else (r.shape, r.dtype)} must have x's shape "
                         f"{x.shape} and dtype {x.dtype}")
    E, K = gate.weight.shape[0], int(top_k)
    I = gate_up.weight.shape[1] // 2
    op_name = "moe_decode_block" if gdn_step is None else "moe_decode_block_gdn"
    opts = _decode_block_build(overrides, bool(prefetch), out_proj is not None,
                               next_proj is not None)
    _check_decode_block_build(opts, I, None if gdn_step is None else int(gdn_step.heads[3]))
    _nps_build(opts, backend)
    smem = (decode_block_dynamic_shared_bytes(int(opts["PSM"]), H,
                                              next_proj.weights.group_size, x.dtype)
            if next_proj is not None else 0)
    if pack is not None:
        words = decode_block_pack_bytes(gate, gate_up, shared) // 4
        if pack.dtype != mx.uint32 or pack.shape != (words,):
            raise ValueError(f"pack {pack.shape} {pack.dtype} is not the [{words}] uint32 "
                             f"array decode_block_pack makes of these weights")
        if gate_up.scales.dtype != x.dtype or down.scales.dtype != x.dtype:
            raise ValueError(f"pack: the experts' scales ({gate_up.scales.dtype}, "
                             f"{down.scales.dtype}) must be of x's dtype {x.dtype}: the packed "
                             f"build reads every segment's scales as x's dtype")
        need = decode_block_pack_counter_length(N, H, gate.weight.shape[0], int(top_k),
                                                gate_up.weight.shape[1] // 2, x.dtype,
                                                out_proj is not None, gdn_step)
        if N > FOLD_NORM_MAX_ROWS:
            raise ValueError(f"pack: {N} token rows; the packed build's counters cover at most "
                             f"{FOLD_NORM_MAX_ROWS} (its workspace follows them)")
        if counter.size < need or counter.dtype != mx.uint32 or counter.ndim != 1:
            raise ValueError(f"pack: the packed build keeps its workspace in the counter: "
                             f"a [{need}] uint32 serial_counter "
                             f"(decode_block_pack_counter_length), got {counter.shape} "
                             f"{counter.dtype}")
        op_name += "_pack"
        obj = _decode_block_pack_object(backend, gdn_step is not None, smem)
    else:
        obj = (_decode_block_object if gdn_step is None else _decode_block_gdn_object)(backend,
                                                                                        smem)
    if obj is None:
        raise RuntimeError(f"no {op_name} source or MLX API for {backend}")
    if len(prefetch) > 3:
        raise ValueError(f"moe_decode_block prefetches at most 3 arrays, got {len(prefetch)}")
    PN = next_proj.weights.weight.shape[0] if next_proj is not None else 0
    gdn_heads = 0 if gdn_step is None else int(gdn_step.heads[1])
    block, rb, blocks = _decode_block_launch(E, H, I, K, int(opts["GRPW"]), opts["OP"], PN,
                                             gdn_heads, int(opts["PRW"]), int(opts["PSM"]),
                                             int(opts["GDS"]))
    grid_blocks = blocks * N
    if opts["PERSIST"] and opts["GRID"]:
        grid_blocks = min(grid_blocks, int(opts["GRID"]))
    elif opts["NPG"] and next_proj is not None and opts["NPL"] and not int(opts["PSM"]):
        # NPG: the next projection's items on the GPU's resident blocks, looping (NPL).
        np_blocks = _proj_phase_blocks(PN, int(opts["PRW"]), 0) * N
        resident = _resident_blocks(backend)
        if resident > 0:
            grid_blocks -= np_blocks - min(np_blocks, resident)
    sg, su, sd, sgate = shared
    lead = x.shape[:-1]
    if out_proj is not None:
        ow = out_proj.weights
        # With the GDN phase ox is that phase's output in the workspace (not read).
        ox = x if gdn_step is not None else out_proj.x
        DO = ow.weight.shape[1] * 8
        op_inputs = [ox, ow.weight, ow.scales, ow.biases]
        OG = int(ow.group_size)
    else:
        # Not read; of the dtypes an OP build reads (MLX caches a CUDA kernel
        # by its template arguments, which include OP).
        op_inputs, DO, OG = [x, counter, x, x], 1024, 32
    if next_proj is not None:
        pw = next_proj.weights
        np_inputs = [next_proj.norm_weight, f32_scalar(float(next_proj.eps)), pw.weight,
                     pw.scales, pw.biases]
        PG = int(pw.group_size)
    else:
        # Not read; of the dtypes an NP build reads (see op_inputs).
        np_inputs, PG = [x, f32_scalar(0.0), counter, x, x], 32
    template = [("T", x.dtype), ("H", H), ("E", E), ("K", K), ("I", I),
                ("G", int(gate_up.group_size)), ("RG", int(gate.group_size)),
                ("SGB", int(sgate.bits)), ("SGG", int(sgate.group_size)),
                ("NORM", bool(norm_topk_prob)), ("BLOCK", block), ("RB", rb),
                ("CS", int(opts["CS"])), ("PERSIST", bool(opts["PERSIST"])),
                ("PREFETCH", bool(opts["PREFETCH"])),
                ("STAGE", bool(opts["STAGE"])), ("GRPW", int(opts["GRPW"])),
                ("EARLY", bool(opts["EARLY"])), ("PF", bool(opts["PF"])),
                ("OP", bool(opts["OP"])), ("DO", int(DO)), ("OG", OG),
                ("NP", bool(opts["NP"])), ("PN", max(int(PN), 1)), ("PG", PG),
                ("PRW", int(opts["PRW"])), ("PSM", int(opts["PSM"])),
                ("UNROLL", bool(opts["UNROLL"])), ("NPL", bool(opts["NPL"])),
                ("RPL", bool(opts["RPL"])), ("GSR", bool(opts["GSR"])),
                ("NPS", int(opts["NPS"])), ("ROLL", bool(opts["ROLL"]))]
    if pack is not None:
        template.append(("WSO", decode_block_pack_workspace_offset()))
    gd_inputs, gd_shapes, gd_dtypes = [], [], []
    if gdn_step is not None:
        Hk, Hv, Dk, Dv = (int(v) for v in gdn_step.heads)
        Kc = gdn_step.conv_w.shape[1]
        has_bias = gdn_step.conv_b is not None
        # gated_delta_decode's inputs (the packed build, no mask, no lengths);
        # an absent bias is stood in for by the conv weight (same dtype).
        gd_inputs = [gdn_step.proj, gdn_step.conv_state, gdn_step.conv_w,
                     gdn_step.conv_b if has_bias else gdn_step.conv_w,
                     gdn_step.A_log.astype(mx.float32), gdn_step.dt_bias,
                     gdn_step.norm_weight, f32_scalar(float(gdn_step.eps)), gdn_step.state]
        gds = int(opts["GDS"])
        template += [("GHk", Hk), ("GHv", Hv), ("GDk", Dk), ("GDv", Dv), ("GKc", int(Kc)),
                     ("GBIAS", has_bias), ("GW", int(gdn_step.proj.shape[-1])), ("GDS", gds)]
        gd_shapes = [gdn_step.conv_state.shape, gdn_step.state.shape]
        gd_dtypes = [x.dtype, mx.float32]
    if pack is not None:
        # The packed build: the 21 arrays of decode_block_pack_arrays as one
        # (its signature's pk).
        weights = [pack]
    else:
        weights = [gate.weight, gate.scales, gate.biases,
                   gate_up.weight, gate_up.scales, gate_up.biases, sg.weight, sg.scales,
                   sg.biases, su.weight, su.scales, su.biases, sgate.weight, sgate.scales,
                   sgate.biases, down.weight, down.scales, down.biases, sd.weight, sd.scales,
                   sd.biases]
    inputs = [x, r, norm_weight, f32_scalar(float(eps)), *weights, counter,
              *(list(prefetch) + [counter] * (3 - len(prefetch))), *op_inputs, *np_inputs,
              *gd_inputs]
    po_shape = (*lead, PN) if next_proj is not None else (1,)
    launch = dict(template=template, grid=(block * grid_blocks, 1, 1),
                  threadgroup=(block, 1, 1))
    if pack is not None:
        # The packed build: out and po only (the workspace in the counter,
        # the GDN states written in place into gdn_step's own arrays).
        out, po = obj(inputs=inputs, output_shapes=[x.shape, po_shape],
                      output_dtypes=[x.dtype, x.dtype], **launch)
        po = po if next_proj is not None else None
        if gdn_step is not None:
            return out, po, gdn_step.conv_state, gdn_step.state
        return (out, po) if next_proj is not None else out
    outs = obj(
        inputs=inputs,
        output_shapes=[x.shape,
                       (decode_block_workspace_words(N, H, E, K, I, x.dtype,
                                                     out_proj is not None,
                                                     DO if gdn_step is not None else 0),),
                       po_shape, *gd_shapes],
        output_dtypes=[x.dtype, mx.uint32, x.dtype, *gd_dtypes], **launch)
    if gdn_step is not None:
        return outs[0], (outs[2] if next_proj is not None else None), outs[3], outs[4]
    return (outs[0], outs[2]) if next_proj is not None else outs[0]


def decode_block_workspace_words(rows: int, H: int, E: int, K: int, I: int, dtype: mx.Dtype,
                                 out_proj: bool, gdn_outputs: int = 0, gdn_conv: int = 0) -> int:
    """uint32 words of ``moe_decode_block``'s workspace output for ``rows`` token rows.

    The launch's intermediates, in 128-byte aligned segments in this order
    (the kernel carves them the same way): the residual sum ``h`` and the
    normed row ``y`` ``[rows, H]``, the router logits ``[rows, E]``, the
    routed experts ``[rows, K]`` uint32 and their scores ``[rows, K]``, the
    gate/up activations ``[rows, K + 1, I]`` (``dtype``), the shared gate's
    logit ``[max(rows, 4)]`` float32 and, with ``out_proj``, the projected
    mixer output ``[rows, H]`` (else 16 bytes), then with ``gdn_outputs``
    (the GD build: the GDN step's ``Hv * Dv`` outputs per row) its output
    ``[rows, gdn_outputs]``, and with ``gdn_conv`` (the packed GD build: the
    conv state's ``(Kc - 1) * conv_dim`` elements per row) the new conv state
    ``[rows, gdn_conv]`` before its in-place copy. One output instead of eight:
    MLX's host cost per launch grows by about 1.5 us per output on the H200
    (``benchmarks/profile_encode.py``: a custom kernel with 10 outputs 16.8 us
    to encode against 3.7 us with one).
    """
    t = dtype.size

    def seg(nbytes: int) -> int:
        return -(-int(nbytes) // 128) * 128

    total = (2 * seg(rows * H * t) + seg(rows * E * t) + seg(rows * K * 4) + seg(rows * K * t)
             + seg(rows * (K + 1) * I * t) + seg(max(rows, 4) * 4)
             + seg(rows * H * t if out_proj else 16)
             + (seg(rows * gdn_outputs * t) if gdn_outputs else 0)
             + (seg(rows * gdn_conv * t) if gdn_conv else 0))
    return total // 4


def decode_block_supported(x: mx.array, norm_weight: mx.array, gate: Optional["ExpertWeights"],
                           top_k: int, gate_up: ExpertWeights, down: ExpertWeights,
                           shared: SharedExpertWeights) -> bool:
    """Whether :func:`moe_decode_block`'s contract covers this call (no backend check).

    What both :func:`add_norm_route_supported` and the shared-expert fold
    accept (so bfloat16 / float16 activations), with fewer than
    :data:`SORT_THRESHOLD` (token row, expert) pairs.
    """
    if not add_norm_route_supported(x, norm_weight, gate, top_k):
        return False
    H = x.shape[-1]
    return (x.size // H * top_k < SORT_THRESHOLD
            and _fold_shapes_supported(H, gate_up, down, shared))


def decode_block_ready(x: mx.array, norm_weight: mx.array, eps: float,
                       gate: Optional["ExpertWeights"], top_k: int, norm_topk_prob: bool,
                       gate_up: ExpertWeights, down: ExpertWeights,
                       shared: SharedExpertWeights,
                       stage: Optional[bool] = None,
                       early: Optional[bool] = None, unroll: Optional[bool] = None,
                       npl: Optional[bool] = None, roll: Optional[bool] = None,
                       prefetch: bool = False,
                       out_proj: Optional[OutProjection] = None,
                       next_proj: Optional[NextProjection] = None,
                       gdn_step: Optional[GatedDeltaStep] = None,
                       pack: Union[bool, mx.array] = False,
                       overrides: Optional[Mapping[str, Optional[bool]]] = None
                       ) -> Optional[str]:
    """The GPU backend whose one-launch MoE decode block may run this call, or None.

    ``kernels/cuda/moe_decode_block``: :func:`add_norm_route` and the
    shared-expert fold (:func:`moe_shared_experts_kernel` with the residual)
    as one launch whose three ticketed phases run those kernels' own per-block
    code, so its output equals theirs bit for bit. It needs both of them
    ready (:func:`add_norm_route_ready`, :func:`shared_decode_kernel_ready`)
    and self-checks, on the first call per shape class, on seeded random rows
    with these weights against the three launches: the layer output must
    match exactly (rtol 0). CUDA only: it exists to cut MLX's per-launch host
    cost, which bounds decode on MLX's CUDA backend. Call it outside
    ``mx.compile``.

    Args:
        x (mx.array): the residual stream ``[..., H]`` (or a stand-in of its
            shape and dtype).
        norm_weight (mx.array): the post-attention RMSNorm weight ``[H]``.
        eps (float): the norm's epsilon.
        gate (ExpertWeights | None): the router.
        top_k (int): experts per token (K).
        norm_topk_prob (bool): renormalise the kept probabilities.
        gate_up (ExpertWeights): ``[E, 2I, H]``.
        down (ExpertWeights): ``[E, H, I]``.
        shared (SharedExpertWeights): the shared expert and its gate.
        stage (bool | None): the build with the down items' activations staged
            in shared memory (``STAGE``), checked on its own; None:
            ``DECODE_BLOCK_OPTIONS["STAGE"]``.
        early (bool | None): the build whose gate/up items stage the norm
            themselves (``EARLY``), checked on its own; None:
            ``DECODE_BLOCK_OPTIONS["EARLY"]``.
        unroll (bool | None): the build whose out- and next-projection phases
            stage their input row in loops unrolled over the block size
            (``UNROLL``), checked on its own; None:
            ``DECODE_BLOCK_OPTIONS["UNROLL"]``.
        npl (bool | None): the build whose next-projection blocks take the
            next tickets too, reusing their staged input (``NPL``), checked on
            its own; None: ``DECODE_BLOCK_OPTIONS["NPL"]``.
        roll (bool | None): the build whose items' dot loops run one chunk's
            code in a loop (``ROLL``), checked on its own; None:
            ``DECODE_BLOCK_OPTIONS["ROLL"]``.
        prefetch (bool): the build that prefetches arrays into L2 (``PF``;
            with ``early`` only), checked on its own.
        out_proj (OutProjection | None): the build that computes the mixer's
            output projection as its first phase (``OP``), checked on its own
            against this package's GEMV kernel
            (:func:`~qwen_apple_backend.ops.linear.quantized_gemv_kernel`, the
            same arithmetic) followed by the three launches; it needs
            :func:`out_projection_supported` and that kernel. Only the shapes,
            dtypes and weights of ``out_proj`` matter (its ``x`` may be a
            stand-in).
        next_proj (NextProjection | None): the build that also runs the next
            layer's input RMSNorm and input projection as its last phase
            (``NP``), checked on its own against the three launches followed
            by :func:`~qwen_apple_backend.ops.linear.norm_gemv_kernel` (the
            same arithmetic): both outputs bit for bit; it needs
            :func:`next_projection_supported` and that kernel.
        gdn_step (GatedDeltaStep | None): the build that runs the decoder
            layer's Gated DeltaNet decode step as its first phase, whose
            output the out-projection phase reads (``GD``, op
            ``moe_decode_block_gdn``; needs ``out_proj``, whose ``x`` is then
            not read and may be None), checked on its own on seeded random
            projection rows and states with these weights against
            :func:`~qwen_apple_backend.ops.gated_delta.gated_delta_decode_kernel`
            (its packed build) followed by this block with ``out_proj``: every
            output bit for bit (the same per-head code); it needs
            :func:`gated_delta_step_supported` and that kernel ready.
        pack (bool): the packed build (ops ``moe_decode_block_pack``,
            ``moe_decode_block_gdn_pack``: the router's, the shared
            expert's and the routed experts' arrays as one input,
            :func:`decode_block_pack`, which needs the experts' scales of
            ``x``'s dtype), checked on its own after the same call without
            it: every output bit for bit against that build (the same code
            reading the same bytes). Given as an array (the block's own
            :func:`decode_block_pack` of these weights), the check reads it;
            given as True, it packs these weights itself once per shape class
            (a transient copy of one layer's experts).
        overrides (Mapping[str, bool | None] | None): build flags by their
            ``DECODE_BLOCK_OPTIONS`` name (``{"STAGE": False}`` is
            ``stage=False``; the same for ``EARLY``, ``UNROLL``, ``NPL`` and
            any other flag of a bool default), each build checked on its own;
            an absent key or None: the default. Check a
            :func:`moe_decode_block` call with the same overrides.

    Returns:
        Optional[str]: ``"cuda"``, or None (not CUDA, kernels disabled,
        outside :func:`decode_block_supported`,
        :func:`out_projection_supported`, :func:`next_projection_supported`
        or :func:`gated_delta_step_supported`,
        a part not ready, the kernel
        unverified without ``QAB_UNVERIFIED_KERNELS``, or a failed self-check,
        which also warns).

    Raises:
        ValueError: for an ``overrides`` key that is not a
            ``DECODE_BLOCK_OPTIONS`` flag, or a keyword (``stage``, ``early``,
            ``unroll``, ``npl``, ``roll``) that disagrees with ``overrides``.
    """
    return _decode_block_ready(
        x, norm_weight, eps, gate, top_k, norm_topk_prob, gate_up, down, shared,
        _build_overrides(overrides, stage=stage, early=early, unroll=unroll, npl=npl,
                         roll=roll),
        prefetch, out_proj, next_proj, gdn_step, pack)


def _decode_block_ready(x: mx.array, norm_weight: mx.array, eps: float,
                        gate: Optional["ExpertWeights"], top_k: int, norm_topk_prob: bool,
                        gate_up: ExpertWeights, down: ExpertWeights,
                        shared: SharedExpertWeights, overrides: Mapping[str, bool],
                        prefetch: bool = False,
                        out_proj: Optional[OutProjection] = None,
                        next_proj: Optional[NextProjection] = None,
                        gdn_step: Optional[GatedDeltaStep] = None,
                        pack: Union[bool, mx.array] = False) -> Optional[str]:
    """:func:`decode_block_ready` with its build overrides as one mapping
    (:func:`_build_overrides`; see :func:`_decode_block_build`)."""
    if envs.kernels_disabled() or gpu_backend() != "cuda":
        return None
    if pack is not False:
        return _pack_ready(x, norm_weight, eps, gate, top_k, norm_topk_prob, gate_up, down,
                           shared, overrides, prefetch, out_proj, next_proj,
                           gdn_step, None if pack is True else pack)
    if not decode_block_supported(x, norm_weight, gate, top_k, gate_up, down, shared):
        return None
    if _decode_block_object("cuda") is None:
        return None
    if gdn_step is not None:
        if (out_proj is None or _decode_block_gdn_object("cuda") is None
                or not gated_delta_step_supported(x, gdn_step, out_proj.weights)):
            return None
    if add_norm_route_ready(x, norm_weight, eps, gate, top_k, norm_topk_prob) != "cuda":
        return None
    probe = mx.zeros((*x.shape[:-1], int(top_k)), dtype=mx.uint32)
    if shared_decode_kernel_ready(x, probe, gate_up, down, shared) != "cuda":
        return None
    H, dtype, E, K = x.shape[-1], x.dtype, gate.weight.shape[0], int(top_k)
    norm = bool(norm_topk_prob)
    from .linear import _gemv_object, norm_gemv_kernel, quantized_gemv_kernel

    if (out_proj is not None or next_proj is not None) and _gemv_object("cuda") is None:
        return None
    ow = None
    if out_proj is not None:
        if gdn_step is None and not out_projection_supported(x, out_proj):
            return None
        ow = out_proj.weights
    if next_proj is not None and not next_projection_supported(x, next_proj):
        return None
    build = _decode_block_build(overrides, prefetch, ow is not None, next_proj is not None)
    # The prefetch build's check prefetches arrays of three dtypes.
    pf = (gate_up.weight, gate_up.scales, norm_weight) if build["PF"] else ()

    def r_of(rs):
        # With OP the check's second input is the projection's input.
        # One row per GEMV launch: quantized_gemv's contract holds up to
        # GEMV_MAX_ROWS rows of 32 KB of input, less than the check's rows;
        # its per-row arithmetic does not depend on the row count.
        if ow is None:
            return rs
        return mx.concatenate([
            quantized_gemv_kernel(rs[i:i + 1], ow.weight, ow.scales, ow.biases,
                                  int(ow.group_size), pipe=False)
            for i in range(rs.shape[0])])

    def kernel(xs, rs, ws):
        counter = fold_norm_counter(decode_block_counter_length())
        op = None if ow is None else OutProjection(rs, ow)
        out = _moe_decode_block_call("cuda", xs, None if op else rs, ws, eps, gate, K, norm,
                                     gate_up, down, shared, counter, overrides, pf, op,
                                     next_proj)
        return list(out) if next_proj is not None else [out]

    def reference(xs, rs, ws):
        h, y, _, inds, scores = _add_norm_route_call("cuda", xs, r_of(rs), ws, eps, gate, K,
                                                     norm, fold_norm_counter())
        out = _moe_shared_decode_kernel_call("cuda", y, inds, scores, gate_up, down, shared,
                                             residual=h)
        if next_proj is None:
            return [out]
        pw = next_proj.weights
        return [out, mx.concatenate([  # one row per launch, as r_of
            norm_gemv_kernel(out[i:i + 1], next_proj.norm_weight, next_proj.eps, pw.weight,
                             pw.scales, pw.biases, int(pw.group_size), pipe=False)
            for i in range(out.shape[0])])]

    # The same per-block code as the three launches (and, with OP, the same
    # GEMV arithmetic as quantized_gemv): bit-identical.
    key = (H, str(dtype), E, gate.group_size, K, norm, float(eps),
           tuple(gate_up.weight.shape), gate_up.group_size, down.group_size,
           shared.gate.bits, shared.gate.group_size,
           tuple(sorted(build.items())),
           None if ow is None else (tuple(ow.weight.shape), int(ow.group_size)),
           None if next_proj is None else (tuple(next_proj.weights.weight.shape),
                                           int(next_proj.weights.group_size),
                                           float(next_proj.eps)))
    make = _add_norm_route_check_inputs(H, dtype)
    if gdn_step is not None:
        return _gdn_block_ready(x, norm_weight, eps, gate, K, norm, gate_up, down, shared,
                                overrides, pf, ow, next_proj, gdn_step, key, make)
    if ow is not None:
        make = _out_proj_check_inputs(make, ow.weight.shape[1] * 8, dtype)
    ok = self_checked("moe_decode_block", "cuda", key, kernel=kernel, reference=reference,
                      make_inputs=make, rtol=0.0)
    return "cuda" if ok else None


def _gdn_block_ready(x, norm_weight, eps, gate, K, norm, gate_up, down, shared, overrides, pf,
                     ow, next_proj, gdn_step, key, make) -> Optional[str]:
    """:func:`decode_block_ready`'s part for the ``GD`` build (see there);
    ``overrides``: the build overrides (:func:`_decode_block_build`)."""
    from . import gated_delta as gd

    Hk, Hv, Dk, Dv = (int(v) for v in gdn_step.heads)
    Kc, dtype = gdn_step.conv_w.shape[1], x.dtype
    has_bias = gdn_step.conv_b is not None
    if gd.decode_kernel_ready(Hk, Hv, Dk, Dv, Kc, dtype, has_bias=has_bias,
                              packed=True) != "cuda":
        return None
    # The reference below runs the block with the out-projection phase: that
    # build must have passed its own check (against quantized_gemv) first.
    stand_in = OutProjection(mx.zeros((*x.shape[:-1], Hv * Dv), dtype=dtype), ow)
    if _decode_block_ready(x, norm_weight, eps, gate, K, norm, gate_up, down, shared, overrides,
                           bool(pf), stand_in, next_proj) != "cuda":
        return None
    C = 2 * Hk * Dk + Hv * Dv
    split_at = [C, C + Hv * Dv, C + Hv * Dv + Hv]
    make_gd = _gdn_check_inputs(make, gdn_step, dtype)

    def kernel(xs, gp, ws, cs, st):
        counter = fold_norm_counter(decode_block_counter_length())
        step = gdn_step._replace(proj=gp, conv_state=cs, state=st)
        out, po, ncs, nst = _moe_decode_block_call(
            "cuda", xs, None, ws, eps, gate, K, norm, gate_up, down, shared, counter, overrides,
            pf, OutProjection(None, ow), next_proj, step)
        return [out, ncs, nst] + ([] if po is None else [po])

    def reference(xs, gp, ws, cs, st):
        qkv, z, b, a = mx.split(gp, split_at, axis=-1)
        go, ncs, nst = gd._decode_kernel_call(
            "cuda", qkv, z, b, a, cs, gdn_step.conv_w, gdn_step.conv_b, gdn_step.A_log,
            gdn_step.dt_bias, gdn_step.norm_weight, st, norm_eps=float(gdn_step.eps), proj=gp)
        counter = fold_norm_counter(decode_block_counter_length())
        got = _moe_decode_block_call(
            "cuda", xs, None, ws, eps, gate, K, norm, gate_up, down, shared, counter, overrides,
            pf, OutProjection(go.reshape(*xs.shape[:-1], Hv * Dv), ow), next_proj)
        out, po = got if next_proj is not None else (got, None)
        return [out, ncs, nst] + ([] if po is None else [po])

    key = key + ((Hk, Hv, Dk, Dv, int(Kc), has_bias, float(gdn_step.eps)),)
    ok = self_checked("moe_decode_block_gdn", "cuda", key, kernel=kernel, reference=reference,
                      make_inputs=make_gd, rtol=0.0)
    return "cuda" if ok else None


def _gdn_check_inputs(make, gdn_step: GatedDeltaStep, dtype: mx.Dtype):
    """The GD self-check's inputs: x, a projection row, the norm weight, conv and recurrent states."""
    Hk, Hv, Dk, Dv = (int(v) for v in gdn_step.heads)
    Kc, C = gdn_step.conv_w.shape[1], 2 * Hk * Dk + Hv * Dv

    def make_gd():
        xs, _, ws = make()
        k = mx.random.split(mx.random.key(4344), 3)
        rows = xs.shape[:-1]
        gp = mx.random.normal((*rows, gdn_step.proj.shape[-1]), key=k[0]).astype(dtype)
        cs = mx.random.normal((xs.size // xs.shape[-1], Kc - 1, C), key=k[1]).astype(dtype)
        st = 0.1 * mx.random.normal((cs.shape[0], Hv, Dv, Dk), key=k[2])
        return xs, gp, ws, cs, st
    return make_gd


def _pack_ready(x, norm_weight, eps, gate, top_k, norm_topk_prob, gate_up, down, shared,
                overrides, prefetch, out_proj, next_proj, gdn_step,
                pk: Optional[mx.array] = None) -> Optional[str]:
    """:func:`decode_block_ready`'s part for the packed build (see there); ``pk``:
    the pack of these weights to check with, or None to make one; ``overrides``:
    the build overrides (:func:`_decode_block_build`)."""
    if _decode_block_ready(x, norm_weight, eps, gate, top_k, norm_topk_prob, gate_up, down,
                           shared, overrides, prefetch, out_proj, next_proj,
                           gdn_step) != "cuda":
        return None
    if _decode_block_pack_object("cuda", gdn_step is not None) is None:
        return None
    if gate_up.scales.dtype != x.dtype or down.scales.dtype != x.dtype:
        return None
    if pk is None:
        try:
            pk = decode_block_pack(gate, gate_up, down, shared)
        except ValueError:
            return None
    H, dtype, K, norm = x.shape[-1], x.dtype, int(top_k), bool(norm_topk_prob)
    build = _decode_block_build(overrides, prefetch, out_proj is not None,
                                next_proj is not None)
    pf = (gate_up.weight, gate_up.scales, norm_weight) if build["PF"] else ()
    ow = None if out_proj is None else out_proj.weights
    make = _add_norm_route_check_inputs(H, dtype)
    if gdn_step is not None:
        make = _gdn_check_inputs(make, gdn_step, dtype)
    elif ow is not None:
        make = _out_proj_check_inputs(make, ow.weight.shape[1] * 8, dtype)

    def run(packed: Optional[mx.array]):
        def fn(*a):
            step = r = op = None
            if gdn_step is not None:
                xs, gp, ws, cs, st = a
                if packed is not None:
                    # The packed build writes the states in place: private copies.
                    cs, st = cs + 0, st + 0
                    mx.eval(cs, st)
                step = gdn_step._replace(proj=gp, conv_state=cs, state=st)
                op = OutProjection(None, ow)
            else:
                xs, rs, ws = a
                if ow is None:
                    r = rs
                else:
                    op = OutProjection(rs, ow)
            if packed is None:
                counter = fold_norm_counter(decode_block_counter_length())
            else:
                # Its workspace lives in its own counter (a real buffer).
                counter = serial_counter(decode_block_pack_counter_length(
                    xs.size // H, H, gate.weight.shape[0], K, gate_up.weight.shape[1] // 2,
                    dtype, ow is not None, step))
            out = _moe_decode_block_call("cuda", xs, r, ws, eps, gate, K, norm, gate_up, down,
                                         shared, counter, overrides, pf, op, next_proj, step,
                                         packed)
            out = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
            if packed is not None:
                # The states written in place are read after the launch ran.
                mx.eval(out)
            return out
        return fn

    key = (H, str(dtype), tuple(gate.weight.shape), gate.group_size, K, norm, float(eps),
           tuple(gate_up.weight.shape), gate_up.group_size, down.group_size,
           shared.gate.bits, shared.gate.group_size, tuple(sorted(build.items())),
           None if ow is None else (tuple(ow.weight.shape), int(ow.group_size)),
           None if next_proj is None else (tuple(next_proj.weights.weight.shape),
                                           int(next_proj.weights.group_size),
                                           float(next_proj.eps)),
           None if gdn_step is None else (tuple(int(v) for v in gdn_step.heads),
                                          int(gdn_step.conv_w.shape[1]),
                                          gdn_step.conv_b is not None, float(gdn_step.eps)))
    name = "moe_decode_block_gdn_pack" if gdn_step is not None else "moe_decode_block_pack"
    if serial_decode_compiling() and not self_check_known(name, "cuda", key):
        # Inside mx.compile's trace: the check would evaluate arrays.
        _PACK_CHECKS_DUE[0] += 1
        raise PackCheckDue(f"{name}: not self-checked for this shape class")
    ok = self_checked(name, "cuda", key, kernel=run(pk), reference=run(None),
                      make_inputs=make, rtol=0.0)
    return "cuda" if ok else None


def _out_proj_check_inputs(make, DO: int, dtype: mx.Dtype):
    """The self-check's inputs with the mixer's un-projected output in r's place."""
    def make_op():
        x, r, w = make()
        k = mx.random.key(4343)
        return x, mx.random.normal((*r.shape[:-1], DO), key=k).astype(dtype), w
    return make_op


def moe_decode_block(x: mx.array, r: Optional[mx.array], norm_weight: mx.array, eps: float,
                     gate: "ExpertWeights", top_k: int, norm_topk_prob: bool,
                     gate_up: ExpertWeights, down: ExpertWeights, shared: SharedExpertWeights,
                     backend: str, counter: Optional[mx.array] = None,
                     stage: Optional[bool] = None, early: Optional[bool] = None,
                     unroll: Optional[bool] = None, npl: Optional[bool] = None,
                     roll: Optional[bool] = None,
                     prefetch: Sequence[mx.array] = (),
                     out_proj: Optional[OutProjection] = None,
                     next_proj: Optional[NextProjection] = None,
                     gdn_step: Optional[GatedDeltaStep] = None,
                     pack: Optional[mx.array] = None,
                     overrides: Optional[Mapping[str, Optional[bool]]] = None):
    """A decode token's MoE layer half in one launch: ``h + moe(rms_norm(h))``, ``h = x + r``.

    One launch of ``kernels/cuda/moe_decode_block``: the residual add, the
    post-attention RMSNorm, the 8-bit router and route
    (:func:`add_norm_route`), the K routed experts' and the shared expert's
    SiLU-gated gate/up rows and their down projections weighted by the
    routing scores and the sigmoid of the shared gate, summed, plus ``h``
    (:func:`moe_shared_experts_kernel` with the residual). Phases of one grid
    ordered by tickets (each block waits only on blocks that took earlier
    tickets), running the three kernels' per-block code: the output is
    bit-identical to theirs (the algorithm and its rounding points: see those
    functions). No self-check here (call :func:`decode_block_ready` first), so
    it may sit inside ``mx.compile``.

    Args:
        x (mx.array): residual stream ``[..., H]``, bfloat16 / float16.
        r (mx.array | None): the mixer's output, same shape and dtype (None
            with ``out_proj``).
        norm_weight (mx.array): post-attention RMSNorm weight ``[H]``.
        eps (float): RMSNorm epsilon.
        gate (ExpertWeights): the 8-bit router ``[E, H]``.
        top_k (int): experts per token (K).
        norm_topk_prob (bool): renormalise the kept probabilities.
        gate_up (ExpertWeights): the experts' fused gate+up ``[E, 2I, H]``, 4-bit.
        down (ExpertWeights): the experts' down ``[E, H, I]``, 4-bit.
        shared (SharedExpertWeights): the shared expert and its gate.
        backend (str): ``"cuda"`` (from :func:`decode_block_ready`).
        counter (mx.array | None): uint32 zeros of at least
            :func:`decode_block_counter_length` elements, left zero by the
            launch: a :func:`serial_counter` inside :func:`serial_decode_trace`,
            else (None) a :func:`fold_norm_counter` view that MLX copies for
            each launch.
        stage (bool | None): down items stage the token's gate/up activations
            in shared memory (the ``STAGE`` build, same output); None:
            ``DECODE_BLOCK_OPTIONS["STAGE"]``. Check it with the same
            ``stage`` in :func:`decode_block_ready`.
        early (bool | None): gate/up items stage the token's norm themselves
            and wait for the route only for routed rows (the ``EARLY`` build,
            same output); None: ``DECODE_BLOCK_OPTIONS["EARLY"]``. Check it
            with the same ``early`` in :func:`decode_block_ready`.
        unroll (bool | None): the out- and next-projection phases stage their
            input row in loops unrolled over the block size (the ``UNROLL``
            build, same output); None: ``DECODE_BLOCK_OPTIONS["UNROLL"]``.
            Check it with the same ``unroll`` in :func:`decode_block_ready`.
        npl (bool | None): a block that ran a next-projection item takes the
            next tickets too and reuses its staged input row (the ``NPL``
            build, same output); None: ``DECODE_BLOCK_OPTIONS["NPL"]``. Check
            it with the same ``npl`` in :func:`decode_block_ready`.
        roll (bool | None): the items' dot loops run one chunk's code in a
            loop, not unrolled (the ``ROLL`` build, same output; less code
            for the SMs' instruction caches); None:
            ``DECODE_BLOCK_OPTIONS["ROLL"]``. Check it with the same ``roll``
            in :func:`decode_block_ready`.
        prefetch (Sequence[mx.array]): up to 3 arrays (any shapes and dtypes:
            the next decoder layer's input projection weight, scales, biases)
            that the gate/up items which wait for nothing ask the L2 to fetch
            while the route runs (the ``PF`` build, with ``early`` only; same
            output). Check it with ``prefetch=True`` in
            :func:`decode_block_ready`.
        out_proj (OutProjection | None): compute ``r`` in the launch, as its
            first phase: ``r = out_proj.x @ dequantize(out_proj.weights).T``
            (the mixer's 4-bit output projection, ``o_proj`` / ``out_proj``,
            with the arithmetic of this package's GEMV kernel: one launch less
            per decoder layer; the ``OP`` build). Check it with the same
            ``out_proj`` in :func:`decode_block_ready`.
        next_proj (NextProjection | None): also compute, as the launch's last
            phase, the next decoder layer's normed and projected input
            ``po = rms_norm(out, next_proj.norm_weight, next_proj.eps) @
            dequantize(next_proj.weights).T`` (that layer's input norm and
            concatenated input projection, with the arithmetic of this
            package's GEMV kernel's norm build; the ``NP`` build); its blocks
            issue their weight loads before they wait for the down items.
            Check it with the same ``next_proj`` in :func:`decode_block_ready`.
        gdn_step (GatedDeltaStep | None): run the decoder layer's Gated
            DeltaNet decode step first, in the launch, and project ITS output
            with ``out_proj`` (whose ``x`` is then not read and may be None):
            the GDN launch and its host cost are gone (the ``GD`` build, op
            ``moe_decode_block_gdn``; ``moe-block-gdn``). Check it with the
            same ``gdn_step`` in :func:`decode_block_ready`.
        pack (mx.array | None): :func:`decode_block_pack` of these ``gate``,
            ``gate_up``, ``down`` and ``shared``: the launch reads the
            router's, the shared expert's and the routed experts' arrays
            from it (the packed build, op ``moe_decode_block_pack`` /
            ``moe_decode_block_gdn_pack``; the same output;
            ``moe-block-pack``); ``gate``, ``gate_up``, ``down`` and
            ``shared`` then give only shapes, dtypes and group sizes. The
            experts' scales must be of ``x``'s dtype. Check it with
            ``pack=True`` in :func:`decode_block_ready`. Its only outputs are
            ``out`` and ``po`` (MLX's host cost grows with every output): its
            workspace lives in ``counter``, which must be a
            :func:`serial_counter` of :func:`decode_block_pack_counter_length`
            elements, used inside :func:`serial_decode_trace` only; with
            ``gdn_step`` the step's conv and recurrent states are written IN
            PLACE into ``gdn_step.conv_state`` and ``gdn_step.state``, which
            must be buffers the caller owns (no other array shares their
            memory) and reads only after ``out`` is evaluated.
        overrides (Mapping[str, bool | None] | None): build flags by their
            ``DECODE_BLOCK_OPTIONS`` name (``{"STAGE": False}`` is
            ``stage=False``; the same for ``EARLY``, ``UNROLL``, ``NPL`` and
            any other flag of a bool default); an absent key or None: the
            default. Check it with the same ``overrides`` in
            :func:`decode_block_ready`.

    Returns:
        mx.array | tuple: the layer's output, ``x``'s shape and dtype; with
        ``next_proj`` ``(out, po)``, ``po`` of shape ``[..., PN]``; with
        ``gdn_step`` ``(out, po, conv_state, state)`` (``po`` None without
        ``next_proj``): the GDN step's new conv state (``gdn_step.conv_state``'s
        shape and dtype) and recurrent state (float32); with ``pack`` these
        are ``gdn_step``'s own two arrays, written in place.

    Raises:
        RuntimeError: with no kernel for ``backend`` (no source or MLX API,
            or unverified without ``QAB_UNVERIFIED_KERNELS=1``).
        ValueError: for ``r`` of another shape or dtype than ``x`` (or
            None without ``out_proj``, or given with it), an ``out_proj`` outside
            :func:`out_projection_supported`, a ``next_proj`` outside
            :func:`next_projection_supported`, a ``gdn_step`` outside
            :func:`gated_delta_step_supported` or without ``out_proj``, more
            token rows than ``counter`` covers, more than 3 ``prefetch``
            arrays, or a ``pack`` of another size or dtype than
            :func:`decode_block_pack` makes of these weights (or with the
            experts' scales of another dtype than ``x``), or with ``pack`` a
            counter shorter than :func:`decode_block_pack_counter_length`,
            an ``overrides`` key that is not a ``DECODE_BLOCK_OPTIONS`` flag,
            or a keyword (``stage``, ``early``, ``unroll``, ``npl``, ``roll``) that
            disagrees with ``overrides``.
    """
    build = _build_overrides(overrides, stage=stage, early=early, unroll=unroll, npl=npl,
                             roll=roll)
    if counter is None:
        counter = fold_norm_counter(decode_block_counter_length())
    return _moe_decode_block_call(backend, x, r, norm_weight, eps, gate, top_k, norm_topk_prob,
                                  gate_up, down, shared, counter, build, tuple(prefetch),
                                  out_proj, next_proj, gdn_step, pack)


# Tile heights of the grouped GEMM kernel (kernels/{cuda,metal}/moe_grouped_gemm):
# each expert's tiles are the smallest of these that holds its rows, or the
# largest (its row count by expert load, ``grouped_gemm_block_map``).
GROUPED_GEMM_TILE_ROWS = (16, 32, 64)
# The largest tile height: the launch bound is M // GROUPED_GEMM_BM + E tiles.
GROUPED_GEMM_BM = max(GROUPED_GEMM_TILE_ROWS)
# Heights by load are used when the mean rows per expert (M / E) is at most
# this; above it every tile is 64 rows. Measured on the H200, Qwen3.6 MoE
# layer (E = 256, K = 8), by-load vs 64-row tiles, same run
# (benchmarks/profile_grouped_gemm.py): uniform routing T = 256 / 512 (8 / 16
# rows per expert) 1.175x / 1.135x faster; T = 1K..4K 0.97-1.00x; a skewed
# routing (a quarter of the experts take most rows) 0.89-0.98x at every T.
GROUPED_GEMM_BY_LOAD_MAX_MEAN_ROWS = 16

# Backends with a grouped GEMM kernel source (kernels/MANIFEST.toml).
GROUPED_GEMM_BACKENDS = frozenset({"cuda", "metal"})


def grouped_gemm_block_map(sorted_inds: mx.array, num_experts: int,
                           tile_rows: Sequence[int] = GROUPED_GEMM_TILE_ROWS
                           ) -> tuple[mx.array, mx.array, mx.array]:
    """Row offsets, tile offsets and tile height of each expert, computed on the device.

    A per-expert histogram (scatter-add), then each expert's tile height by
    its load: the smallest of ``tile_rows`` that holds all its rows, else the
    largest (so an expert with 5 rows runs one 16-row tile, not a 64-row tile
    of mostly zero rows, and a busy expert keeps the 64-row tiles that reuse
    each dequantized weight tile most), and exclusive prefix sums of the row
    counts and of the tile counts ``ceil(rows_e / height_e)``. No host
    synchronisation: the kernel launches ``M // max(tile_rows) + E`` tiles
    (an upper bound: an expert up to the largest height has one tile) and
    each finds its expert by binary search in ``tile_offsets``.

    Args:
        sorted_inds (mx.array): expert of each row, ascending.
        num_experts (int): E.
        tile_rows (Sequence[int]): the tile heights the kernel has, ascending
            (default :data:`GROUPED_GEMM_TILE_ROWS`; ``(64,)`` gives every
            expert 64-row tiles, for comparison).

    Returns:
        tuple[mx.array, mx.array, mx.array]: ``(row_offsets, tile_offsets,
        tile_height)``, int32.

    Shapes:
        sorted_inds: ``[M]``; returns ``[E + 1]``, ``[E + 1]`` and ``[E]``.
    """
    counts = mx.zeros((num_experts,), dtype=mx.int32).at[sorted_inds].add(1)
    zero = mx.zeros((1,), dtype=mx.int32)
    rows = mx.concatenate([zero, mx.cumsum(counts)])
    height = mx.full((num_experts,), tile_rows[-1], dtype=mx.int32)
    for h in reversed(tile_rows[:-1]):
        height = mx.where(counts <= h, h, height)
    tiles = (counts + height - 1) // height
    return (rows.astype(mx.int32), mx.concatenate([zero, mx.cumsum(tiles)]).astype(mx.int32),
            height.astype(mx.int32))


@functools.lru_cache(maxsize=None)
def _grouped_gemm_object(backend: str):
    return build_kernel("moe_grouped_gemm", backend)


def _grouped_gemm_call(backend: str, xs: mx.array, w: ExpertWeights, glu: bool,
                       row_offsets: mx.array, tile_offsets: mx.array,
                       tile_height: mx.array, max_height: int = GROUPED_GEMM_BM) -> mx.array:
    obj = _grouped_gemm_object(backend)
    if obj is None:
        raise RuntimeError(f"no moe_grouped_gemm source or MLX API for {backend}")
    M, kdim = xs.shape
    E, R = w.weight.shape[:2]
    nout = R // 2 if glu else R
    n_tiles = M // max_height + E  # upper bound (grouped_gemm_block_map)
    # One launch configuration for both backends: mx.fast.cuda_kernel and
    # mx.fast.metal_kernel both count the grid in threads, so this is
    # n_tiles x (nout / 64) threadgroups of 128 threads (4 warps / SIMD groups).
    (y,) = obj(inputs=[xs, w.weight, w.scales, w.biases, row_offsets, tile_offsets,
                       tile_height],
               template=[("KDIM", kdim), ("NOUT", nout), ("E", E), ("GLU", glu)],
               grid=(128 * n_tiles, nout // 64, 1), threadgroup=(128, 1, 1),
               output_shapes=[(M, nout)], output_dtypes=[mx.bfloat16])
    return y


def _moe_grouped_gemm_experts(backend: str, x, inds, scores, gate_up: ExpertWeights,
                              down: ExpertWeights, shared=None,
                              tile_rows: Optional[Sequence[int]] = None) -> mx.array:
    if tile_rows is None:
        light = inds.size <= GROUPED_GEMM_BY_LOAD_MAX_MEAN_ROWS * gate_up.weight.shape[0]
        tile_rows = GROUPED_GEMM_TILE_ROWS if light else (GROUPED_GEMM_BM,)
    elif not tile_rows or list(tile_rows) != sorted(set(tile_rows)) or not set(tile_rows) <= set(
            GROUPED_GEMM_TILE_ROWS):
        raise ValueError(f"tile_rows {tuple(tile_rows)}: ascending heights out of "
                         f"{GROUPED_GEMM_TILE_ROWS}")
    H = x.shape[-1]
    E = gate_up.weight.shape[0]
    inds = mx.stop_gradient(inds)
    st = sort_by_expert(x, inds)
    rows, tiles, height = grouped_gemm_block_map(st.inds, E, tile_rows)
    top = tile_rows[-1]
    h = _grouped_gemm_call(backend, st.x.reshape(-1, H), gate_up, True, rows, tiles, height, top)
    y = _grouped_gemm_call(backend, h, down, False, rows, tiles, height, top)
    pos = st.inv_order.reshape(inds.shape)
    if shared is not None:
        if combine_kernel_ready(backend, y, pos, scores, *shared):
            return _combine_kernel_call(backend, y, pos, scores, *shared)
        return moe_combine_ops(y, pos, scores, *shared)
    return _weighted_sum(y[pos], scores)


# --------------------------------------------------------------------------
# Prefill epilogue: un-sort, weight, sum over K, gated shared expert
# (kernels/*/moe_combine)
# --------------------------------------------------------------------------

# Threads per threadgroup of the combine kernel (one per output column).
_COMBINE_BLOCK = 256


@functools.lru_cache(maxsize=None)
def _combine_object(backend: str):
    return build_kernel("moe_combine", backend)


def _combine_dtype(y_sorted, scores, shared_y, gate_logit) -> mx.Dtype:
    # The dtype today's composition (moe_combine_ops) returns.
    return mx.result_type(y_sorted, scores, shared_y, gate_logit)


def _combine_kernel_call(backend: str, y_sorted: mx.array, pos: mx.array, scores: mx.array,
                         shared_y: mx.array, gate_logit: mx.array) -> mx.array:
    obj = _combine_object(backend)
    if obj is None:
        raise RuntimeError(f"no moe_combine source or MLX API for {backend}")
    H = y_sorted.shape[-1]
    K = pos.shape[-1]
    N = pos.size // K
    dtype = _combine_dtype(y_sorted, scores, shared_y, gate_logit)
    (out,) = obj(
        inputs=[y_sorted, pos.reshape(N, K).astype(mx.uint32), scores.reshape(N, K),
                shared_y.reshape(N, H), gate_logit.reshape(N)],
        template=[("OutT", dtype), ("H", H), ("K", K)],
        grid=(-(-H // _COMBINE_BLOCK) * _COMBINE_BLOCK, N, 1),
        threadgroup=(_COMBINE_BLOCK, 1, 1),
        output_shapes=[(N, H)], output_dtypes=[dtype])
    return out.reshape(*pos.shape[:-1], H)


_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def combine_kernel_ready(backend: Optional[str], y_sorted: mx.array, pos: mx.array,
                         scores: mx.array, shared_y: mx.array,
                         gate_logit: mx.array) -> bool:
    """Whether the combine kernel may finish this prefill call on ``backend``.

    ``kernels/*/moe_combine`` computes :func:`moe_combine_ops` in one launch
    (float32 accumulation, one rounding). Used after the grouped GEMM kernel
    (the GPU prefill path) when kernels are enabled, the arrays are float and
    of the block's shapes, and the kernel passed its self-check for this
    shape class (against the float32 composition, on the first call). CUDA:
    built only once its manifest entry records a GPU verification, or with
    ``QAB_UNVERIFIED_KERNELS=1``.

    Args:
        backend (str | None): the live GPU backend.
        y_sorted (mx.array): ``[N*K, H]`` expert output rows in expert order.
        pos (mx.array): ``[..., K]`` row of each (token, slot).
        scores (mx.array): ``[..., K]`` routing weights.
        shared_y (mx.array): ``[..., H]`` shared expert output.
        gate_logit (mx.array): ``[..., 1]`` shared gate logit.

    Returns:
        bool: True when the kernel may run (a failed self-check also warns).
    """
    if backend is None or envs.kernels_disabled() or _combine_object(backend) is None:
        return False
    K, H = pos.shape[-1], y_sorted.shape[-1]
    lead = pos.shape[:-1]
    arrays = (y_sorted, scores, shared_y, gate_logit)
    if (any(a.dtype not in _FLOATS for a in arrays) or y_sorted.ndim != 2
            or y_sorted.shape[0] != pos.size or tuple(scores.shape) != tuple(pos.shape)
            or tuple(shared_y.shape) != (*lead, H)
            or tuple(gate_logit.shape) != (*lead, 1)):
        return False
    dtypes = tuple(a.dtype for a in arrays)
    out_dtype = _combine_dtype(*arrays)

    def make_inputs():
        k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(77), 5)
        T = 37  # odd: no token count the kernel could tile on
        y = mx.random.normal((T * K, H), key=k1).astype(dtypes[0])
        ps = mx.argsort(mx.random.uniform(shape=(T * K,), key=k2)).reshape(T, K)
        sc = mx.softmax(mx.random.normal((T, K), key=k3), axis=-1).astype(dtypes[1])
        sy = mx.random.normal((T, H), key=k4).astype(dtypes[2])
        lg = mx.random.normal((T, 1), key=k5).astype(dtypes[3])
        return y, ps.astype(mx.uint32), sc, sy, lg

    def reference(y, ps, sc, sy, lg):
        f32 = mx.float32
        out = moe_combine_ops(y.astype(f32), ps, sc.astype(f32), sy.astype(f32), lg.astype(f32))
        return [out.astype(out_dtype)]

    # float32: summation order only. bf16 / fp16 outputs are rounded once to
    # ~3 significant digits (rel-L2 ~2e-3).
    rtol = 1e-5 if out_dtype == mx.float32 else 1e-2
    return self_checked(
        "moe_combine", backend, (H, K, *map(str, dtypes)),
        kernel=lambda *a: [_combine_kernel_call(backend, *a)],
        reference=reference, make_inputs=make_inputs, rtol=rtol)


def grouped_gemm_ready(x: mx.array, inds: mx.array, gate_up: ExpertWeights,
                       down: ExpertWeights) -> Optional[str]:
    """The GPU backend whose grouped 4-bit GEMM kernel may run this prefill call, or None.

    CUDA or Metal (:data:`GROUPED_GEMM_BACKENDS`); bf16 activations, 4-bit
    affine g64 experts with ``H`` and ``I`` multiples of 64; at least
    :data:`SORT_THRESHOLD` (token, slot) rows. On either backend the kernel
    is self-checked against :func:`moe_experts_ops` on the first call per
    shape class and used only if it passes. CUDA: built only once its
    manifest entry records a GPU verification, or with
    ``QAB_UNVERIFIED_KERNELS=1``. Metal: never run where it was written,
    so the self-check alone decides (a kernel that fails to compile, raises
    or disagrees is never used); its speed against MLX's gathered 4-bit
    matmul is not measured.

    Returns:
        Optional[str]: ``"cuda"`` / ``"metal"``, or None (CPU, kernels
        disabled, unsupported dtype, shapes or quantization, too few rows, or
        a failed self-check, which also warns).
    """
    if envs.kernels_disabled() or inds.size < SORT_THRESHOLD or x.dtype != mx.bfloat16:
        return None
    backend = gpu_backend()
    if backend not in GROUPED_GEMM_BACKENDS or _grouped_gemm_object(backend) is None:
        return None
    H, K = x.shape[-1], inds.shape[-1]
    for w in (gate_up, down):
        if (not w.quantized or w.bits != 4 or w.group_size != 64 or w.mode != "affine"
                or w.biases is None or w.bias is not None or w.scales.dtype != mx.bfloat16):
            return None
    E, two_i = gate_up.weight.shape[:2]
    I = two_i // 2
    if H % 64 or I % 64 or down.weight.shape[:2] != (E, H):
        return None

    def make_inputs():
        k1, k2, k3 = mx.random.split(mx.random.key(2024), 3)
        # Every tile height the kernel has: expert 0 takes every token (80
        # rows: two 64-row tiles, the second partial), expert 1 too (K >= 2),
        # expert 2 the first 24 tokens and a few more (a 32-row tile, K >= 3),
        # the rest a few rows each (16-row tiles) or none.
        T = 80
        xs = mx.random.normal((T, H), key=k1).astype(mx.bfloat16)
        e, t = mx.arange(E)[None, :], mx.arange(T)[:, None]
        first = 3 * (e == 0) + 2 * (e == 1) + (e == 2) * (t < 24)
        ind = mx.argsort(-(first + 0.5 * mx.random.uniform(shape=(T, E), key=k2)),
                         axis=-1)[:, :K]
        sc = mx.softmax(mx.random.normal((T, K), key=k3), axis=-1).astype(mx.bfloat16)
        return xs, ind.astype(mx.uint32), sc, gate_up, down

    # Reference in float32 activations, rounded once to bf16: the bf16
    # portable path rounds at every step and was measured ~3e-2 (rel-L2) off
    # float64 at small test shapes on the CPU, as far off as the tolerance;
    # the kernel (float32 accumulation, bf16 h) ~6e-3.
    def reference(xs, ind, sc, gu, dn):
        y = moe_experts_ops(xs.astype(mx.float32), ind, sc.astype(mx.float32), gu, dn,
                            sort=True)
        return [y.astype(mx.bfloat16)]

    ok = self_checked(
        "moe_grouped_gemm", backend, (E, H, I, K),
        kernel=lambda *a: [_moe_grouped_gemm_experts(backend, *a)],
        reference=reference, make_inputs=make_inputs, rtol=3e-2)
    return backend if ok else None


def moe_experts_kernel(backend: Optional[str] = None) -> Optional[Callable]:
    """The fused GPU decode kernels for ``backend`` as one function, or None.

    Two kernels (``kernels/*/moe_gate_up_gemv``, ``kernels/*/moe_down_gemv``):
    the K experts' 4-bit gate+up rows with SiLU(gate) * up in the epilogue,
    then the K down projections weighted by the routing scores and summed
    over K. No self-check here: :func:`moe_experts` runs them only after
    :func:`decode_kernel_ready`.

    Args:
        backend (str | None): ``"cuda"`` / ``"metal"``; default the live GPU backend.

    Returns:
        Callable | None: ``f(x, inds, scores, gate_up, down) -> y``, or None
        when there is no GPU backend or no kernel source for it.
    """
    backend = backend or gpu_backend()
    if backend is None or _gemv_objects(backend) is None:
        return None
    return functools.partial(_moe_decode_kernel_call, backend)


def moe_experts(
    x: mx.array,
    inds: mx.array,
    scores: mx.array,
    gate_up: ExpertWeights,
    down: ExpertWeights,
    *,
    use_kernel: bool = True,
    dequant_gemm: bool = True,
    shared: Optional[tuple[mx.array, mx.array]] = None,
) -> mx.array:
    """Routed-expert output, on the fastest path for the row count.

    The GPU decode kernels (:func:`moe_experts_kernel`) when ``use_kernel``
    is true and :func:`decode_kernel_ready` says so; else, for prefill, the
    grouped 4-bit GEMM kernel when :func:`grouped_gemm_ready` says so.
    Otherwise, for quantized experts with at least
    :data:`DEQUANT_GEMM_MIN_ROWS` (token, slot) rows and ``dequant_gemm``
    true, :func:`moe_experts_dequant_gemm`; else :func:`moe_experts_ops`.

    With ``shared``, the block's gated shared expert is added:
    ``y + sigmoid(gate_logit) * shared_y``. On the grouped GEMM path that
    happens in the combine kernel together with the un-sort and the weighted
    sum over K, when :func:`combine_kernel_ready` says so. (Decode with the
    shared expert's weights folded into the kernels is
    :func:`moe_shared_experts_kernel`.)

    Args:
        x (mx.array): token activations.
        inds (mx.array): expert indices from :func:`topk_route`.
        scores (mx.array): routing weights from :func:`topk_route`.
        gate_up (ExpertWeights): ``[E, 2I, H]`` fused gate+up projection.
        down (ExpertWeights): ``[E, H, I]`` down projection.
        use_kernel (bool): allow the GPU kernels. Default True.
        dequant_gemm (bool): allow the dequantize-then-GEMM prefill form.
            Default True.
        shared (tuple[mx.array, mx.array] | None): ``(shared_y, gate_logit)``
            of the block's shared expert, or None. Default None.

    Returns:
        mx.array: dtype of ``x`` (promoted with ``scores`` and ``shared``).

    Shapes:
        x: ``[..., H]``; inds, scores: ``[..., K]``
        shared: ``([..., H], [..., 1])``
        returns: ``[..., H]``

    Example:
        >>> import mlx.core as mx
        >>> E, H, I, K = 4, 8, 6, 2
        >>> gu = ExpertWeights(mx.random.normal((E, 2 * I, H)))
        >>> dn = ExpertWeights(mx.random.normal((E, H, I)))
        >>> x = mx.random.normal((1, 3, H))
        >>> inds, scores = topk_route(mx.random.normal((1, 3, E)), K, True)
        >>> moe_experts(x, inds, scores, gu, dn).shape
        (1, 3, 8)
    """
    if use_kernel:
        backend = decode_kernel_ready(x, inds, gate_up, down)
        if backend is not None:
            y = _moe_decode_kernel_call(backend, x, inds, scores, gate_up, down)
            return y if shared is None else add_gated_shared(y, *shared)
        backend = grouped_gemm_ready(x, inds, gate_up, down)
        if backend is not None:
            return _moe_grouped_gemm_experts(backend, x, inds, scores, gate_up, down,
                                             shared=shared)
    if (dequant_gemm and gate_up.quantized and inds.size >= DEQUANT_GEMM_MIN_ROWS
            and _dequant_gemm_runs(x)):
        y = moe_experts_dequant_gemm(x, inds, scores, gate_up, down)
    else:
        y = moe_experts_ops(x, inds, scores, gate_up, down)
    return y if shared is None else add_gated_shared(y, *shared)
