"""``lm_head`` on the dense 4-bit decode GEMV (the ``gemv-kernel`` optimization).

The text model's ``lm_head`` is the largest matrix a decode step reads (for
Qwen3.6-35B-A3B 248,320 x 2,048 4-bit weights, ~270 MB with scales and
biases). It is called by mlx-lm's own model code, so instead of wrapping it
the fused model's instance gets the class :class:`DecodeQuantizedLinear`: an
``nn.QuantizedLinear`` subclass with the same parameters and names whose
few-row calls take :func:`qwen_apple_backend.ops.linear.linear`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ..ops import linear as qlinear

__all__ = ["DecodeQuantizedEmbedding", "DecodeQuantizedLinear", "DeferredGatedDelta",
           "DeferredProjection", "ProjectedInput", "install_embedding_kernel",
           "install_gemv_lm_head"]


class DeferredProjection(NamedTuple):
    """A mixer's output with its output projection not yet applied.

    A fused mixer called with ``defer_out_proj=True`` returns this instead of
    ``proj(x)``, so that the decoder layer's fused MoE block may run the
    projection in its own launch (the ``moe-block-out-proj`` optimization,
    ``layers/norm.py``); whoever cannot calls :meth:`apply`, which is exactly
    the mixer's own last step.

    Attributes:
        x (mx.array): the mixer's output before the projection ``[B, T, DO]``.
        proj (nn.Module): the projection (``o_proj`` / ``out_proj``), ``DO -> H``.
    """

    x: mx.array
    proj: nn.Module

    def apply(self) -> mx.array:
        """``proj(x)``: the mixer's output as it would have returned it, ``[B, T, H]``."""
        return self.proj(self.x)


class DeferredGatedDelta:
    """A Gated DeltaNet mixer's decode step not yet run, nor its output projection.

    The fused Gated DeltaNet called with ``defer_out_proj=True`` and
    ``defer_step=True`` returns this for a decode token on CUDA, so that the
    decoder layer's fused MoE block may run the step as the first phase of
    its one launch, ahead of the output projection (the ``moe-block-gdn``
    optimization, ``layers/norm.py``). The mixer has checked the step's
    kernel (its packed build) and advanced the cache; its conv and recurrent
    states are written when the step runs: by :meth:`commit` with the
    block's new states, or by :meth:`deferred` / :meth:`apply`, which run the
    step in its own launch exactly as the mixer would have (once: later
    calls return the same arrays).

    Attributes:
        step (GatedDeltaStep): the step's inputs
            (:class:`~qwen_apple_backend.ops.moe.GatedDeltaStep`: the
            concatenated projection ``[B, 1, GW]``, states, weights, heads).
        proj (nn.Module): the output projection (``out_proj``), ``Hv Dv -> H``.
        cache (Any): the mixer's ``ArraysCache`` (or None): ``cache[0]`` the
            conv state, ``cache[1]`` the recurrent state.
        run (Callable): runs the step in its own launch and returns ``(out
            [B, 1, Hv Dv], conv_state, state)``.
    """

    __slots__ = ("step", "proj", "cache", "run", "_ran")

    def __init__(self, step: Any, proj: nn.Module, cache: Any, run: Callable):
        self.step, self.proj, self.cache, self.run = step, proj, cache, run
        self._ran: Any = None

    def commit(self, conv_state: mx.array, state: mx.array) -> None:
        """Store the step's new states (computed elsewhere) in the mixer's cache."""
        if self.cache is not None:
            self.cache[0] = conv_state
            self.cache[1] = state

    def deferred(self) -> DeferredProjection:
        """Run the step in its own launch (once), store its states; its output unprojected."""
        if self._ran is None:
            out, conv_state, state = self.run()
            self.commit(conv_state, state)
            self._ran = DeferredProjection(out, self.proj)
        return self._ran

    def apply(self) -> mx.array:
        """The mixer's output as it would have returned it, ``[B, 1, H]``."""
        return self.deferred().apply()


#: What a fused mixer returns instead of its output when the decoder layer
#: asks it to defer work to the MoE block (``layers/norm.py``).
DEFERRED = (DeferredProjection, DeferredGatedDelta)


class ProjectedInput(NamedTuple):
    """A decoder layer's input already normalised and projected by the layer before.

    The fused MoE block's one launch may end with the NEXT layer's input
    RMSNorm and its mixer's concatenated 4-bit input projection (the
    ``moe-block-next-proj`` optimization, ``layers/norm.py``); the next layer
    passes ``y`` to that mixer (``projected=``), which then skips its own
    projection launch. Only the mixer it was computed for may take it.

    Attributes:
        y (mx.array): ``concat_proj(rms_norm(x))``, unsplit: ``[B, T, N]``
            (N: the sum of the mixer's input projections' outputs), dtype of
            ``x``.
        mixer (nn.Module): the mixer whose concatenated projection ``y`` is.
    """

    y: mx.array
    mixer: nn.Module


class DecodeQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose decode-sized calls run the dense GEMV kernel when ready.

    Never constructed: :func:`install_gemv_lm_head` swaps an existing
    instance's class. Larger inputs, other quantization modes and devices
    without the kernel run ``nn.QuantizedLinear.__call__`` unchanged.

    Shapes: x ``[..., K]``; returns ``[..., N]``.
    """

    _qab_gemv = True

    def __call__(self, x: mx.array) -> mx.array:
        if qlinear.is_plain_quantized_linear(self):
            qlinear.prepare(x, self)
            return qlinear.linear(self, x)
        return super().__call__(x)


def install_gemv_lm_head(text_model: Any) -> bool:
    """Give ``text_model.lm_head`` the class :class:`DecodeQuantizedLinear`.

    Args:
        text_model (nn.Module): the module holding ``lm_head`` (mlx-lm's
            Qwen3.5 / Qwen3-Next text model).

    Returns:
        bool: True when installed; False when there is no ``lm_head`` (tied
        embeddings), or it is not exactly a 4-bit affine ``nn.QuantizedLinear``
        with biases.
    """
    head = getattr(text_model, "lm_head", None) if "lm_head" in text_model else None
    if type(head) is not nn.QuantizedLinear or not qlinear.is_plain_quantized_linear(head):
        return False
    if head.bits != 4 or head.mode != "affine":
        return False
    head.__class__ = DecodeQuantizedLinear
    return True


class DecodeQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose decode-sized lookups run one CUDA launch when ready.

    Never constructed: :func:`install_embedding_kernel` swaps an existing
    instance's class (the ``embed-kernel`` optimization). Up to
    :data:`~qwen_apple_backend.ops.linear.EMBED_MAX_ROWS` int32 / uint32 ids
    of a 4- or 8-bit affine table take
    :func:`~qwen_apple_backend.ops.linear.embedding_dequantize_kernel` (one
    launch instead of three gathers and a dequantize, the same values) once
    :func:`~qwen_apple_backend.ops.linear.embedding_ready` said yes for the
    shape class (decided on the first such call, outside any trace, and kept
    per instance); everything else runs ``nn.QuantizedEmbedding.__call__``
    unchanged, as does :meth:`as_linear` (a tied ``lm_head``).

    Shapes: x ``[...]`` ids; returns ``[..., D]``, the scales' dtype.
    """

    _qab_embed = True

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        if not self.training and 0 < x.size <= qlinear.EMBED_MAX_ROWS and biases is not None:
            w, scales = self["weight"], self["scales"]
            # The self-check's shape class (not the arrays' identity: inside
            # the compiled decode step's trace they are placeholders).
            key = (x.dtype, w.shape, w.dtype, scales.shape, scales.dtype, self.group_size,
                   self.bits, self.mode)
            verdicts = self.__dict__.get("_qab_embed_verdicts")
            if verdicts is None:
                verdicts = {}
                object.__setattr__(self, "_qab_embed_verdicts", verdicts)
            backend = verdicts.get(key, False)
            if backend is False:
                backend = verdicts[key] = qlinear.embedding_ready(
                    x, w, scales, biases, self.group_size, self.bits, self.mode)
            if backend is not None:
                return qlinear.embedding_dequantize_kernel(x, w, scales, biases,
                                                           self.group_size, self.bits)
        return super().__call__(x)


def install_embedding_kernel(text_model: Any) -> bool:
    """Give the token embedding (``model.embed_tokens``) the class :class:`DecodeQuantizedEmbedding`.

    Args:
        text_model (nn.Module): the module holding ``model.embed_tokens``
            (mlx-lm's Qwen3.5 / Qwen3-Next text model).

    Returns:
        bool: True when installed; False when the embedding is not exactly an
        ``nn.QuantizedEmbedding`` (a float table has no dequantize to fuse).
    """
    inner = text_model.get("model") if isinstance(text_model, dict) else None
    emb = inner.get("embed_tokens") if isinstance(inner, dict) else None
    if type(emb) is not nn.QuantizedEmbedding:
        return False
    emb.__class__ = DecodeQuantizedEmbedding
    return True
