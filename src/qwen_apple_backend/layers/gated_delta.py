"""Fused Gated DeltaNet (linear attention) modules for Qwen3.5/3.6 and Qwen3-Next.

:class:`FusedGatedDeltaNet` replaces ``mlx_lm.models.qwen3_5.GatedDeltaNet``
and :class:`FusedQwen3NextGatedDeltaNet` replaces
``mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet``. Both are built with
``from_stock(module)``, which adopts the stock module's children and
parameters under the same names, so ``sanitize``, quantization, checkpoints
and ``shard()`` see the same tree.

What changes against stock:

* prefill (S > 1) runs the chunked gated delta rule
  (:func:`qwen_apple_backend.ops.gated_delta.gated_delta`) instead of a
  per-token loop, with the conv / SiLU / q-k normalisation / gates in one
  compiled function;
* decode (S == 1) runs conv-state update, depthwise conv, SiLU, q/k l2norm,
  gates, the recurrent step and the gated RMSNorm as one ``mx.compile``d
  function whose weights are inputs, so every layer of the same shape reuses
  one compiled graph; on a GPU whose one-launch decode kernel has passed its
  self-check (``ops.gated_delta.decode_kernel_ready``) all of that is one
  kernel (``gated_delta_decode``). The (possibly quantized) projections stay
  outside.

Algorithm: Yang et al., "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025; chunked form from Yang et al., "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", NeurIPS 2024.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients

from ._concat import ConcatProjection
from .linear import DeferredGatedDelta, DeferredProjection
from ..ops import gated_delta as gd_ops
from ..ops.moe import GatedDeltaStep
from ..ops.gated_delta import (
    compute_gates,
    decode_kernel_ready,
    gated_delta,
    gated_delta_decode_kernel,
    kernel_ready,
    l2norm_qk,
)

__all__ = ["FusedGatedDeltaNet", "FusedQwen3NextGatedDeltaNet"]

# q/k l2norm epsilon used by the stock modules.
_QK_EPS = 1e-6

# Plain (non-array) attributes copied from the stock module. Those that
# mlx-lm's ``shard()`` rewrites (head counts, dims, sharding_group) are read
# at call time, never cached.
_SCALAR_ATTRS = (
    "hidden_size",
    "num_v_heads",
    "num_k_heads",
    "head_k_dim",
    "head_v_dim",
    "key_dim",
    "value_dim",
    "conv_kernel_size",
    "layer_norm_epsilon",
    "conv_dim",
)


# --------------------------------------------------------------------------
# Pure functions of arrays (compiled; weights are arguments)
# --------------------------------------------------------------------------


def _split_projections(layout, projs, Hk, Hv, Dk, Dv):
    """Projection outputs -> (qkv [B, S, conv_dim], z [B, S, Hv, Dv], b, a [B, S, Hv])."""
    if layout == "qwen3_5":
        qkv, z, b, a = projs
        B, S = qkv.shape[:2]
        return qkv, z.reshape(B, S, Hv, Dv), b, a
    # Qwen3-Next interleaves the projections per key head:
    # in_proj_qkvz -> [Hk, (q Dk, k Dk, v R*Dv, z R*Dv)], in_proj_ba -> [Hk, (b R, a R)].
    mixed_qkvz, mixed_ba = projs
    B, S = mixed_qkvz.shape[:2]
    R = Hv // Hk
    qkvz = mixed_qkvz.reshape(B, S, Hk, -1)
    ba = mixed_ba.reshape(B, S, Hk, -1)
    q, k, v, z = mx.split(qkvz, [Dk, 2 * Dk, 2 * Dk + R * Dv], axis=-1)
    b, a = mx.split(ba, [R], axis=-1)
    qkv = mx.concatenate(
        [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
    )
    return qkv, z.reshape(B, S, Hv, Dv), b.reshape(B, S, Hv), a.reshape(B, S, Hv)


def _prepare(
    qkv, a, b, conv_state, conv_w, conv_b, A_log, dt_bias, mask, lengths,
    Hk, Hv, Dk, Dv, groups, keep_conv_state,
):
    """Masking, conv-state update, depthwise conv + SiLU, q/k l2norm, gates.

    Returns ``(q, k, v, g, beta, new_conv_state)``; ``new_conv_state`` is None
    unless ``keep_conv_state``.
    """
    B, S, _ = qkv.shape
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    new_conv_state = None
    if keep_conv_state:
        n_keep = conv_state.shape[1]
        if lengths is not None:
            # Batched generation: keep the n_keep inputs before each row's end.
            ends = mx.clip(lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            new_conv_state = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            # A copy, not a slice: a view would keep the whole [B, S + n_keep,
            # C] conv input alive in the cache until the next call.
            new_conv_state = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = mx.conv1d(conv_input, conv_w, 1, 0, 1, groups)
    if conv_b is not None:
        conv_out = conv_out + conv_b
    conv_out = nn.silu(conv_out)
    key_dim = Hk * Dk
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(B, S, Hk, Dk)
    k = k.reshape(B, S, Hk, Dk)
    v = v.reshape(B, S, Hv, Dv)
    q, k = l2norm_qk(q, k, _QK_EPS)
    g, beta = compute_gates(A_log, a, dt_bias, b)
    return q, k, v, g, beta, new_conv_state


def _gated_rms_norm(y, z, weight, eps):
    # Same op order as mlx-lm's RMSNormGated + precise_swiglu: the norm in the
    # input dtype, the SiLU gate product in float32.
    x = mx.fast.rms_norm(y, weight, eps)
    gate = nn.silu(z.astype(mx.float32))
    return (gate * x.astype(mx.float32)).astype(y.dtype)


_prepare_compiled = mx.compile(_prepare)
_gated_rms_norm_compiled = mx.compile(_gated_rms_norm)


@mx.compile
def _decode_step(
    projs, conv_state, state, conv_w, conv_b, A_log, dt_bias, norm_w, mask, lengths,
    layout, Hk, Hv, Dk, Dv, groups, norm_eps, use_kernel,
):
    """One decode token of a whole GDN layer short of the output projection."""
    qkv, z, b, a = _split_projections(layout, projs, Hk, Hv, Dk, Dv)
    q, k, v, g, beta, new_conv_state = _prepare(
        qkv, a, b, conv_state, conv_w, conv_b, A_log, dt_bias, mask, lengths,
        Hk, Hv, Dk, Dv, groups, True,
    )
    y, state = gated_delta(q, k, v, g, beta, state, mask, use_kernel=use_kernel)
    return _gated_rms_norm(y, z, norm_w, norm_eps), new_conv_state, state


@mx.compile
def _decode_step_kernel(
    projs, conv_state, state, conv_w, conv_b, A_log, dt_bias, norm_w, mask, lengths,
    layout, Hk, Hv, Dk, Dv, norm_eps, packed=None,
):
    """:func:`_decode_step` as one GPU launch (``gated_delta_decode_kernel``).

    Only the (Qwen3-Next) reordering of the projections runs before it; call
    it only after ``decode_kernel_ready`` said yes for these shapes (with
    ``packed``, the concatenated projection's unsplit output, after it said
    yes with ``packed=True``).
    """
    # Qwen3.5's four projections go in as they are, [B, 1, ...] (the kernel
    # reads rows flatly; every reshape would be a primitive encoded per token),
    # and out comes back as [B, 1, Hv * Dv] for the output projection.
    qkv, z, b, a = (projs if layout == "qwen3_5"
                    else _split_projections(layout, projs, Hk, Hv, Dk, Dv))
    out, new_conv_state, state = gated_delta_decode_kernel(
        qkv, z, b, a, conv_state, conv_w, conv_b, A_log, dt_bias, norm_w, state,
        mask, lengths, norm_eps=norm_eps, proj=packed,
    )
    return out, new_conv_state, state


# --------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------


class FusedGatedDeltaNet(nn.Module):
    """Drop-in for ``mlx_lm.models.qwen3_5.GatedDeltaNet`` with fused prefill and decode.

    Build it with :meth:`from_stock`; the constructor is not meant to be
    called directly. Children and parameters keep the stock names
    (``conv1d``, ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``), and the
    attributes mlx-lm's ``shard()`` rewrites (``num_k_heads``,
    ``num_v_heads``, ``key_dim``, ``value_dim``, ``conv_dim``,
    ``sharding_group``) are read at call time.

    Shapes:
        - inputs: [B, S, hidden_size]
        - output: [B, S, hidden_size], dtype of ``inputs``
        - cache[0] (conv state): [B, K-1, conv_dim], dtype of ``inputs``
        - cache[1] (recurrent state): [B, Hv, Dv, Dk], float32

    Example:
        >>> import mlx.core as mx
        >>> from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs
        >>> from mlx_lm.models.cache import ArraysCache
        >>> from qwen_apple_backend.layers.gated_delta import FusedGatedDeltaNet
        >>> args = TextModelArgs(hidden_size=64, linear_num_value_heads=4,
        ...     linear_num_key_heads=2, linear_key_head_dim=32,
        ...     linear_value_head_dim=32, num_attention_heads=4)
        >>> fused = FusedGatedDeltaNet.from_stock(GatedDeltaNet(args))
        >>> cache = ArraysCache(size=2)
        >>> out = fused(mx.random.normal((1, 20, 64)), cache=cache)  # prefill
        >>> out = fused(mx.random.normal((1, 1, 64)), cache=cache)   # decode
        >>> out.shape, cache[1].dtype
        ((1, 1, 64), mlx.core.float32)
    """

    # Allow the GPU scan and one-launch decode kernels (the ``gdn-kernel`` optimization).
    use_kernel: bool = True

    # Stock child modules / parameters adopted by from_stock, by name.
    _LAYOUT = "qwen3_5"
    _PROJECTIONS: Tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    _CHILDREN: Tuple[str, ...] = ("conv1d",) + _PROJECTIONS + ("norm", "out_proj")
    _PARAMS: Tuple[str, ...] = ("dt_bias", "A_log")

    def __init__(self):
        super().__init__()
        self.sharding_group = None

    @classmethod
    def from_stock(cls, stock: nn.Module) -> "FusedGatedDeltaNet":
        """Build the fused module around a stock module's weights (no copies).

        Args:
            stock (nn.Module): a built (optionally quantized or sharded) stock
                GDN module of the matching layout.

        Returns:
            FusedGatedDeltaNet: a module sharing the stock children and
            parameters, in the same training mode.

        Raises:
            TypeError: if ``stock`` lacks a child, parameter or attribute of
                this layout (e.g. a Qwen3-Next module given to the Qwen3.5
                class).
        """
        missing = [
            n
            for n in cls._CHILDREN + cls._PARAMS + _SCALAR_ATTRS
            if not hasattr(stock, n)
        ]
        if missing:
            raise TypeError(
                f"{cls.__name__}.from_stock: {type(stock).__module__}."
                f"{type(stock).__name__} has no {missing}; expected the "
                f"{cls._LAYOUT} GatedDeltaNet layout"
            )
        self = cls()
        for name in _SCALAR_ATTRS:
            setattr(self, name, getattr(stock, name))
        self.sharding_group = getattr(stock, "sharding_group", None)
        for name in cls._CHILDREN + cls._PARAMS:
            setattr(self, name, getattr(stock, name))
        # Keep frozen parameters frozen and the training flag.
        self._no_grad = set(n for n in stock._no_grad if n in cls._PARAMS)
        self._training = stock.training
        return self

    def concat_projections(self) -> bool:
        """Run the input projections as one matmul from now on (the ``proj-concat`` optimization).

        Stacks the output rows of ``_PROJECTIONS`` (``in_proj_qkv``,
        ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next:
        ``in_proj_qkvz``, ``in_proj_ba``) into one matrix whose row slices
        become the children's arrays (no second copy); see
        :class:`~qwen_apple_backend.layers._concat.ConcatProjection`.

        Returns:
            bool: False (nothing changed) when the projections differ in
            type, quantization or dtype.
        """
        cat = ConcatProjection.build(self, self._PROJECTIONS)
        object.__setattr__(self, "_proj_cat", cat)
        return cat is not None

    def _projections_packed(self, inputs: mx.array,
                            input_norm: Optional[nn.Module] = None,
                            projected: Optional[mx.array] = None) -> tuple:
        """``(projections, packed)``: the input projections' outputs and, when they ran as
        one concatenated matmul, its unsplit output (else None). The split views
        cost nothing when only ``packed`` is used: MLX encodes what a launch reads.
        With ``input_norm`` (the decoder layer's, ``norm-proj``), ``inputs`` are
        not yet normalised: the norm runs in the concatenated matmul's launch
        when that kernel is ready, else as its own operation first.
        ``projected``: that launch's output computed already (by the previous
        layer's MoE block, ``moe-block-next-proj``), used while the
        concatenation is valid."""
        cat = getattr(self, "_proj_cat", None)
        if cat is not None and cat.valid(self):
            if projected is not None:
                cat.check_projected(inputs, projected)
                return tuple(mx.split(projected, cat.split_at, axis=-1)), projected
            backend = None
            if input_norm is not None and not self.training:
                backend = cat.norm_backend(inputs, input_norm)
            if backend is not None:
                y = cat.norm_matmul(inputs, input_norm["weight"], input_norm.eps, backend)
            else:
                x = inputs if input_norm is None else input_norm(inputs)
                y = cat.matmul(x, None if self.training else cat.gemv_backend(x))
            return tuple(mx.split(y, cat.split_at, axis=-1)), y
        if input_norm is not None:
            inputs = input_norm(inputs)
        return tuple(getattr(self, n)(inputs) for n in self._PROJECTIONS), None

    def _decode_kernel_ready(self, projs, conv_state, conv_b, mask, lengths,
                             packed: bool = False) -> bool:
        """Whether this one-token call may run the one-launch decode kernel
        (with ``packed``: reading the concatenated projection's row itself).

        Called outside ``mx.compile`` (the first call per shape class runs the
        kernel's self-check). Needs the projections, the conv state and the
        conv weight in one dtype and a depthwise conv.
        """
        dtype = projs[0].dtype
        weight = self.conv1d.weight
        if (any(p.dtype != dtype for p in projs) or conv_state.dtype != dtype
                or weight.dtype != dtype or weight.ndim != 3
                or self.conv1d.groups != weight.shape[0]):
            return False
        return decode_kernel_ready(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
            weight.shape[1], dtype, has_bias=conv_b is not None,
            has_mask=mask is not None, has_lengths=lengths is not None, packed=packed,
        ) is not None

    #: The decoder layer may hand this module its input RMSNorm with the
    #: un-normalised hidden states (``input_norm=``, the ``norm-proj``
    #: optimization): the norm then runs inside the input projection's launch.
    takes_input_norm = True
    #: The decoder layer may ask for the output before ``out_proj``
    #: (``defer_out_proj=True``, the ``moe-block-out-proj`` optimization).
    defers_out_proj = True
    #: The decoder layer may pass the input norm and concatenated input
    #: projection computed by the previous layer's MoE block (``projected=``,
    #: the ``moe-block-next-proj`` optimization).
    takes_projected = True
    #: The decoder layer may ask for the decode step itself deferred too
    #: (``defer_step=True`` with ``defer_out_proj=True``, the ``moe-block-gdn``
    #: optimization): a CUDA decode token then returns a
    #: :class:`~qwen_apple_backend.layers.linear.DeferredGatedDelta`.
    defers_step = True

    def __call__(
        self,
        inputs: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
        input_norm: Optional[nn.Module] = None,
        defer_out_proj: bool = False,
        projected: Optional[mx.array] = None,
        defer_step: bool = False,
    ) -> Union[mx.array, DeferredProjection, DeferredGatedDelta]:
        """Run the layer, updating ``cache`` in place like the stock module.

        Args:
            inputs (mx.array): hidden states (with ``input_norm``: before that
                norm).
            mask (Optional[mx.array]): bool SSM mask from mlx-lm's
                ``create_ssm_mask``; False tokens leave both states unchanged
                and produce zero output.
            cache (Optional[Any]): mlx-lm ``ArraysCache(size=2)``; ``cache[0]``
                conv state, ``cache[1]`` recurrent state; ``cache.lengths``
                honoured as stock; advanced by S.
            input_norm (Optional[nn.Module]): the decoder layer's input norm,
                applied here: ``layer(x, input_norm=n)`` equals ``layer(n(x))``
                (on CUDA a decode call with the concatenated projections runs
                it in the projection's launch). Default None.
            defer_out_proj (bool): return the output before ``out_proj`` as a
                :class:`~qwen_apple_backend.layers.linear.DeferredProjection`
                (unsharded layers only), for the decoder layer's fused MoE
                block to project in its own launch. Default False.
            projected (Optional[mx.array]): ``concat_proj(input_norm(inputs))``
                computed already (``[B, S, N]``, N the concatenated
                projections' outputs, dtype of ``inputs``; the previous
                layer's MoE block, ``moe-block-next-proj``); used instead of
                running the projection while the concatenation is valid and
                the layer is unsharded and in eval mode, else ignored.
                Default None.
            defer_step (bool): with ``defer_out_proj``, return a decode
                token's step unrun as a
                :class:`~qwen_apple_backend.layers.linear.DeferredGatedDelta`
                (its cache advanced, its states written when the step runs)
                when it would run the one-launch decode kernel on CUDA with the
                concatenated projection's row, no mask and no ``lengths``: the
                decoder layer's fused MoE block may then run it in its own
                launch (``moe-block-gdn``). Default False.

        Raises:
            ValueError: naming ``projected`` when it is used and its shape or
                dtype is not the projection's.

        Returns:
            mx.array | DeferredProjection | DeferredGatedDelta: layer output,
            dtype of ``inputs`` (or a deferred form).

        Shapes:
            - inputs: [B, S, hidden_size]
            - mask: [B, S]
            - output: [B, S, hidden_size] (deferred: [B, S, Hv * Dv] and out_proj)
        """
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            if input_norm is not None:
                inputs, input_norm = input_norm(inputs), None
            inputs = sum_gradients(self.sharding_group)(inputs)
            projected = None
        if self.training:
            projected = None

        Hk, Hv = self.num_k_heads, self.num_v_heads
        Dk, Dv = self.head_k_dim, self.head_v_dim
        projs, packed = self._projections_packed(inputs, input_norm, projected)

        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype
            )
        state = cache[1] if cache else None
        if state is None:
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        lengths = cache.lengths if cache is not None else None
        conv_b = self.conv1d.bias if "bias" in self.conv1d else None
        # Decided here, outside mx.compile: the first call per shape class runs
        # the kernel's self-check, which evaluates arrays. A decode token runs
        # the one-launch decode kernel when it is ready, else the compiled
        # step below (with the scan kernel when that one is ready).
        allow_kernel = self.use_kernel and not self.training
        decode_kernel = S == 1 and allow_kernel and self._decode_kernel_ready(
            projs, conv_state, conv_b, mask, lengths)
        # Qwen3.5's four projections as one row: the kernel reads it at channel
        # offsets, so the concatenated matmul's Split is not encoded per token.
        if not (decode_kernel and self._LAYOUT == "qwen3_5" and packed is not None
                and self._decode_kernel_ready(projs, conv_state, conv_b, mask, lengths,
                                              packed=True)):
            packed = None
        use_kernel = allow_kernel and not decode_kernel and kernel_ready(
            Hk, Hv, Dk, Dv, inputs.dtype) is not None

        if (decode_kernel and defer_step and defer_out_proj and packed is not None
                and mask is None and lengths is None and self.sharding_group is None
                and gd_ops.gpu_backend() == "cuda"):
            # The step itself for the MoE block's launch (moe-block-gdn);
            # run= is this same kernel call, for when the block cannot.
            run = partial(_decode_step_kernel, projs, conv_state, state, self.conv1d.weight,
                          conv_b, self.A_log, self.dt_bias, self.norm.weight, None, None,
                          self._LAYOUT, Hk, Hv, Dk, Dv, self.norm.eps, packed)
            if cache is not None:
                cache.advance(S)
            return DeferredGatedDelta(
                GatedDeltaStep(packed, conv_state, self.conv1d.weight, conv_b, self.A_log,
                               self.dt_bias, self.norm.weight, self.norm.eps, state,
                               (Hk, Hv, Dk, Dv)),
                self.out_proj, cache, run)
        if decode_kernel:
            out, new_conv_state, state = _decode_step_kernel(
                projs, conv_state, state, self.conv1d.weight, conv_b,
                self.A_log, self.dt_bias, self.norm.weight, mask, lengths,
                self._LAYOUT, Hk, Hv, Dk, Dv, self.norm.eps, packed,
            )
        elif S == 1:
            out, new_conv_state, state = _decode_step(
                projs, conv_state, state, self.conv1d.weight, conv_b,
                self.A_log, self.dt_bias, self.norm.weight, mask, lengths,
                self._LAYOUT, Hk, Hv, Dk, Dv, self.conv1d.groups, self.norm.eps,
                use_kernel,
            )
        else:
            qkv, z, b, a = _split_projections(self._LAYOUT, projs, Hk, Hv, Dk, Dv)
            q, k, v, g, beta, new_conv_state = _prepare_compiled(
                qkv, a, b, conv_state, self.conv1d.weight, conv_b,
                self.A_log, self.dt_bias, mask, lengths,
                Hk, Hv, Dk, Dv, self.conv1d.groups, cache is not None,
            )
            y, state = gated_delta(q, k, v, g, beta, state, mask, use_kernel=use_kernel)
            out = _gated_rms_norm_compiled(y, z, self.norm.weight, self.norm.eps)

        if cache is not None:
            cache[0] = new_conv_state
            cache[1] = state
            cache.advance(S)

        if out.ndim != 3:
            # The decode kernel returns [B, 1, Hv * Dv] already; a reshape to the
            # same shape would still be one more primitive the host encodes per token.
            out = out.reshape(B, S, -1)
        if defer_out_proj and self.sharding_group is None:
            return DeferredProjection(out, self.out_proj)
        out = self.out_proj(out)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


class FusedQwen3NextGatedDeltaNet(FusedGatedDeltaNet):
    """Drop-in for ``mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet``.

    Same as :class:`FusedGatedDeltaNet` but with the two head-interleaved
    projections ``in_proj_qkvz`` and ``in_proj_ba`` (see the stock
    ``fix_query_key_value_ordering``); their reordering runs inside the
    compiled decode step. ``sharding_group`` is honoured when set (stock
    Qwen3-Next has none; it defaults to None).

    Shapes:
        - inputs: [B, S, hidden_size]
        - output: [B, S, hidden_size], dtype of ``inputs``
        - cache[0] (conv state): [B, K-1, conv_dim], dtype of ``inputs``
        - cache[1] (recurrent state): [B, Hv, Dv, Dk], float32

    Example:
        >>> from qwen_apple_backend.layers.gated_delta import (
        ...     FusedQwen3NextGatedDeltaNet)
        >>> fused = FusedQwen3NextGatedDeltaNet.from_stock(stock_module)  # doctest: +SKIP
    """

    _LAYOUT = "qwen3_next"
    _PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")
    _CHILDREN = ("conv1d",) + _PROJECTIONS + ("norm", "out_proj")
