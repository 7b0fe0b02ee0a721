"""Fused drop-in for mlx-lm's ``Qwen3NextAttention``.

``Qwen3NextAttention`` is the full-attention layer of ``qwen3_next``,
``qwen3_5`` and ``qwen3_5_moe``: GQA with q/k RMSNorm, partial RoPE and a
per-head sigmoid output gate packed into ``q_proj``. :class:`FusedGQAAttention`
keeps its children, parameter names, attributes and call signature, and runs
q/k preparation as one compiled graph and attention without repeating KV
heads.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from qwen_apple_backend.layers._concat import ConcatProjection
from qwen_apple_backend.layers._watch import compile_watched
from qwen_apple_backend.layers.linear import DeferredProjection
from qwen_apple_backend.ops import attention as attn_ops
from qwen_apple_backend.ops.moe import serial_decode_tracing
from qwen_apple_backend.ops.attention import (
    RUNAHEAD_EVAL_ROWS,
    RopeSpec,
    eval_outside_traces,
    gate_output,
    gqa_attention,
    gqa_attention_split,
    gqa_attention_blocked,
    gqa_decode_attention_gated,
    prep_qk,
    prep_qk_decode,
    score_block_rows,
)

__all__ = ["COMPILE_MAX_TOKENS", "FusedGQAAttention", "rope_spec"]

# Calls with at most this many tokens (B * T: decode, short speculative
# drafts) trace one compiled graph per shape; longer prefills run eagerly so
# prompts of many lengths do not each add a trace of the projections.
COMPILE_MAX_TOKENS = 16


def rope_spec(rope: nn.Module) -> Optional[RopeSpec]:
    """Describe a plain ``nn.RoPE`` module as a :class:`RopeSpec`.

    Args:
        rope (nn.Module): the attention's rope module.

    Returns:
        RopeSpec | None: its parameters, or None for any other rope class
        (YaRN, Llama-3, ...), which then runs as its own module.
    """
    if type(rope) is nn.RoPE:
        return RopeSpec(int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale))
    return None


class FusedGQAAttention(nn.Module):
    """Drop-in for ``Qwen3NextAttention``.

    Children ``q_proj`` (``H -> Hq * 2D``: per head, D query features then D
    gate features), ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm`` and ``rope`` are the stock modules; ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` and ``scale`` are plain attributes
    that mlx-lm's ``shard()`` may rewrite. Build one with :meth:`from_stock`.

    Args:
        q_proj (nn.Module): query + gate projection.
        k_proj (nn.Module): key projection.
        v_proj (nn.Module): value projection.
        o_proj (nn.Module): output projection.
        q_norm (nn.RMSNorm): per-head query RMSNorm.
        k_norm (nn.RMSNorm): per-head key RMSNorm.
        rope (nn.Module): rotary embedding module.
        num_attention_heads (int): Hq.
        num_key_value_heads (int): Hk.
        head_dim (int): D.
        use_kernel (bool): allow GPU attention kernels. Default True.
        compile_decode (bool): run the pre-cache part of decode-sized calls
            (at most ``COMPILE_MAX_TOKENS`` tokens) as one compiled graph.
            Default True.
        block_queries (bool): split a long prompt's attention into blocks of
            query rows whose scores fit ``ops.attention.SCORE_BLOCK_BYTES``,
            each evaluated, and evaluate the output of any call of at least
            ``ops.attention.RUNAHEAD_EVAL_ROWS`` query rows (the
            ``attn-blocks`` optimization: it bounds a long prefill's memory).
            Default True.
        split_keys (bool): on CUDA, run a one-token query over at least
            ``ops.attention.SPLIT_KV_MIN_KEYS`` cached keys as
            ``ops.attention.gqa_attention_split`` (the ``attn-split``
            optimization: ``p v`` split over blocks of keys), where MLX's
            SDPA has no fused kernel for Qwen3.6's head dim of 256 and runs
            as ops. Not on Metal: there MLX's own fused two-pass vector kernel
            (``sdpa_vector_2pass``, split over keys, the query heads of a KV
            head in one threadgroup) runs such a call from 4,096 keys, and the
            split's MLX ops have not been measured against it. Default True.
        decode_kernel (bool): on CUDA, run a one-token query's attention
            (any number of cached keys) and its output gate as
            ``ops.attention.gqa_decode_attention_gated``
            (the ``attn-kernel`` optimization: the split-K kernel pair, two
            launches instead of about eight MLX ops and their views) when its
            self-check passed. Default True.
        prep_kernel (bool): on CUDA or Metal, run a one-token call's q/k
            RMSNorm and RoPE as ``ops.attention.prep_qk_decode`` (the
            ``qk-prep`` optimization: one launch instead of four, and no
            transposes) when its self-check passed. Default True.
        decode_lanes (bool): with ``decode_kernel``, the kernel pair's first
            pass below ``ops.attention._LANES_MAX_KEYS`` cached keys is the
            lane-group build (the opt-in ``attn-lanes``: several lanes per key,
            several warps per key block; H200, 4K decode: 333.6 vs 322.0 tok/s
            in one run, slower in two later ones). Default False.
        decode_step (bool): on CUDA, inside the compiled decode step (whose
            KV cache is written in place), run a one-token call's q/k RMSNorm
            and RoPE, the KV row's write, the attention and its output gate
            as ``ops.attention.gqa_decode_step`` (the ``attn-step``
            optimization: one launch instead of four) when the concatenated
            projection runs (``proj-concat``), ``decode_kernel`` and
            ``prep_kernel`` are on and its self-check passed. Default True.

    Attributes:
        decode_mma (bool): with ``decode_step``, the step's key pass on tensor
            cores where the cache is bf16 / f16 with at most 8 query heads per
            KV head (``ops.attention.gqa_decode_step``'s ``mma``; ``QAB_DISABLE=attn-mma``
            keeps the lane-group pass). Default True.
        decode_merge_split (bool): with ``decode_step``, the step's key blocks
            merged in two levels, groups first (``ops.attention.gqa_decode_step``'s
            ``merge_split``; opt-in: ``QAB_ENABLE=attn-merge-split`` sets it).
            Default False.
        decode_merge_spread (bool): with ``decode_step``, the step's key blocks
            merged by G more thread blocks per KV head, one query head each
            (``ops.attention.gqa_decode_step``'s ``merge_spread``; the same bits;
            ``QAB_DISABLE=attn-merge-spread`` keeps the last key block merging).
            Default True.
        decode_step_long (bool): with ``decode_step``, the step also from
            ``ops.attention.STEP_MAX_KEYS`` (64K) KV buffer rows on, where its
            key pass runs on tensor cores (``decode_mma`` and a cache it takes);
            the lane-group pass keeps the limit (``QAB_DISABLE=attn-step-long``
            keeps it for both; the limit was measured with the lane-group pass,
            before the tensor-core one existed; H100, same run: 64K 230.1 vs
            195.3 tok/s, 128K 225.9 vs 180.6, the same greedy ids). Default True.
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        q_norm: nn.RMSNorm,
        k_norm: nn.RMSNorm,
        rope: nn.Module,
        *,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        use_kernel: bool = True,
        compile_decode: bool = True,
        block_queries: bool = True,
        split_keys: bool = True,
        decode_kernel: bool = True,
        prep_kernel: bool = True,
        decode_lanes: bool = False,
        decode_step: bool = True,
    ):
        super().__init__()
        self.num_key_value_heads = num_key_value_heads
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.o_proj = o_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.rope = rope
        self.use_kernel = use_kernel
        self.compile_decode = compile_decode
        self.block_queries = block_queries
        self.split_keys = split_keys
        self.decode_kernel = decode_kernel
        self.prep_kernel = prep_kernel
        self.decode_lanes = decode_lanes
        self.decode_step = decode_step
        self.decode_mma = True
        self.decode_merge_split = False
        self.decode_merge_spread = True
        self.decode_step_long = True

    @classmethod
    def from_stock(
        cls,
        stock_attn: Qwen3NextAttention,
        *,
        use_kernel: bool = True,
        compile_decode: bool = True,
    ) -> "FusedGQAAttention":
        """Wrap a built (and usually loaded) stock attention layer.

        All children are reused as they are (no copies).

        Args:
            stock_attn (Qwen3NextAttention): the layer to replace.
            use_kernel (bool): allow GPU attention kernels. Default True.
            compile_decode (bool): compile the pre-cache part of
                decode-sized calls. Default True.

        Returns:
            FusedGQAAttention: same outputs, same parameters.

        Raises:
            TypeError: if ``stock_attn`` is not a ``Qwen3NextAttention`` or its
                q/k norms are not ``nn.RMSNorm``.

        Example:
            >>> from types import SimpleNamespace
            >>> from mlx_lm.models.qwen3_next import Qwen3NextAttention
            >>> args = SimpleNamespace(hidden_size=64, num_attention_heads=4,
            ...     num_key_value_heads=2, head_dim=16, attention_bias=False,
            ...     rms_norm_eps=1e-6, partial_rotary_factor=0.25, rope_theta=1e7,
            ...     rope_scaling=None, max_position_embeddings=4096)
            >>> attn = FusedGQAAttention.from_stock(Qwen3NextAttention(args))
            >>> attn(mx.zeros((1, 3, 64)), mask="causal").shape
            (1, 3, 64)
        """
        if not isinstance(stock_attn, Qwen3NextAttention):
            raise TypeError(
                f"expected Qwen3NextAttention, got {type(stock_attn).__name__}"
            )
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(stock_attn, name), nn.RMSNorm):
                raise TypeError(
                    f"{type(stock_attn).__name__}.{name}: expected nn.RMSNorm, "
                    f"got {type(getattr(stock_attn, name)).__name__}"
                )
        out = cls(
            stock_attn.q_proj,
            stock_attn.k_proj,
            stock_attn.v_proj,
            stock_attn.o_proj,
            stock_attn.q_norm,
            stock_attn.k_norm,
            stock_attn.rope,
            num_attention_heads=stock_attn.num_attention_heads,
            num_key_value_heads=stock_attn.num_key_value_heads,
            head_dim=stock_attn.head_dim,
            use_kernel=use_kernel,
            compile_decode=compile_decode,
        )
        out.scale = stock_attn.scale
        out.train(stock_attn.training)
        return out

    def to_stock(self) -> Qwen3NextAttention:
        """An equivalent stock layer sharing this layer's children.

        Returns:
            Qwen3NextAttention: same outputs and parameter names.
        """
        # Assemble without __init__, which needs model args and draws
        # throwaway random weights.
        attn = Qwen3NextAttention.__new__(Qwen3NextAttention)
        nn.Module.__init__(attn)
        attn.num_key_value_heads = self.num_key_value_heads
        attn.num_attention_heads = self.num_attention_heads
        attn.head_dim = self.head_dim
        attn.scale = self.scale
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope"):
            setattr(attn, name, getattr(self, name))
        attn.train(self.training)
        return attn

    #: The decoder layer may hand this module its input RMSNorm with the
    #: un-normalised hidden states (``input_norm=``, the ``norm-proj``
    #: optimization): the norm then runs inside the q/k/v projection's launch.
    takes_input_norm = True
    #: The decoder layer may ask for the output before ``o_proj``
    #: (``defer_out_proj=True``, the ``moe-block-out-proj`` optimization).
    defers_out_proj = True
    #: The decoder layer may pass the input norm and concatenated q/k/v
    #: projection computed by the previous layer's MoE block (``projected=``,
    #: the ``moe-block-next-proj`` optimization).
    takes_projected = True

    def __call__(
        self,
        x: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
        input_norm: Optional[nn.Module] = None,
        defer_out_proj: bool = False,
        projected: Optional[mx.array] = None,
    ) -> Union[mx.array, DeferredProjection]:
        """Gated grouped-query self-attention over ``x`` and the cache.

        Args:
            x (mx.array): hidden states (with ``input_norm``: before that norm).
            mask (None | str | mx.array): mlx-lm attention mask: None,
                ``"causal"`` or an array broadcastable to ``[B, Hq, T, S]``
                (``create_attention_mask`` / ``cache.make_mask``).
            cache (KVCache-like | None): mlx-lm cache with ``offset`` and
                ``update_and_fetch``; a quantized KV cache (``bits``) runs
                mlx-lm's quantized attention, as stock does.
            input_norm (nn.Module | None): the decoder layer's input norm,
                applied here: ``attn(x, input_norm=n)`` equals ``attn(n(x))``
                (on CUDA a decode call with the concatenated projections runs
                it in the projection's launch). Default None.
            defer_out_proj (bool): return the gated attention output before
                ``o_proj`` as a
                :class:`~qwen_apple_backend.layers.linear.DeferredProjection`,
                for the decoder layer's fused MoE block to project in its own
                launch. Default False.
            projected (mx.array | None): ``concat_qkv(input_norm(x))``
                computed already (``[B, T, N]``, N = q/k/v outputs, dtype of
                ``x``; the previous layer's MoE block, ``moe-block-next-proj``);
                used instead of running the projection while the
                concatenation is valid and the module is in eval mode, else
                ignored. Default None.

        Raises:
            ValueError: naming ``projected`` when it is used and its shape or
                dtype is not the projection's.

        Decode-sized calls run projections, q/k norm and RoPE as one
        compiled graph (see ``compile_decode``); attention and the cache
        update stay outside it, since the cache is updated in place.

        Returns:
            mx.array | DeferredProjection: output, dtype of ``x`` (or its
            deferred form).

        Shapes:
            x: ``[B, T, H]``; returns ``[B, T, H]`` (deferred: ``[B, T, Hq * D]``
            and ``o_proj``); S = cache length + T.
        """
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        use_cat = self._use_cat()
        norm_backend = None
        if projected is not None and not (use_cat and not self.training):
            projected = None
        if projected is not None:
            # Checked before any compiled call: an error while tracing would
            # leave the module's arrays replaced by the trace's placeholders.
            self._proj_cat.check_projected(x, projected)
            input_norm = None  # (applied already, as the projection)
        elif input_norm is not None:
            if use_cat and not self.training:
                norm_backend = self._proj_cat.norm_backend(x, input_norm)
            if norm_backend is None:
                x, input_norm = input_norm(x), None
        # The concatenated q/k/v projection on the dense GEMV kernel (proj-gemv).
        gemv = (self._proj_cat.gemv_backend(x)
                if use_cat and norm_backend is None and projected is None and not self.training
                else None)
        spread = self._step_spread(x, cache, use_cat) if L == 1 else None
        if spread is not None:
            # attn-step: everything up to o_proj in one launch, the cache row
            # written in place (the compiled decode step's cache).
            if projected is not None:
                qkv = projected
            elif norm_backend is not None:
                qkv = self._proj_cat.norm_matmul(x, input_norm["weight"], input_norm.eps,
                                                 norm_backend)
            else:
                qkv = self._proj_cat.matmul(x, gemv)
            k_buf, v_buf, position = cache.claim_in_place()
            gated = attn_ops.gqa_decode_step(
                qkv, self.q_norm["weight"], self.k_norm["weight"], k_buf, v_buf, position,
                self._step_counter(B), heads=self.num_attention_heads, q_eps=self.q_norm.eps,
                k_eps=self.k_norm.eps, rope=rope_spec(self.rope), scale=self.scale,
                mma=self.decode_mma, merge_split=self.decode_merge_split,
                merge_spread=spread)
            return DeferredProjection(gated, self.o_proj) if defer_out_proj else self.o_proj(gated)
        if (
            self.compile_decode
            and not self.training
            and B * L <= COMPILE_MAX_TOKENS
            and rope_spec(self.rope) is not None  # other RoPEs may need int offsets
        ):
            if not isinstance(offset, mx.array):
                offset = mx.array(offset, dtype=mx.int32)
            prep = self._prep_kernel_ready(x, offset)
            if projected is not None:
                q, k, v, gate = self._compiled_project(use_cat, prep, pre=True)(projected, offset)
            elif norm_backend is None:
                q, k, v, gate = self._compiled_project(use_cat, prep, gemv=gemv)(x, offset)
            else:
                fn = self._compiled_project(use_cat, prep, norm_backend, input_norm.eps)
                q, k, v, gate = fn(x, offset, input_norm["weight"])
            if use_cat:
                self._proj_cat.refresh()  # a trace re-wraps the module's arrays
        elif projected is not None:
            q, k, v, gate = self._project(projected, offset, use_cat,
                                          self._prep_kernel_ready(x, offset), pre=True)
        else:
            q, k, v, gate = self._project(
                x, offset, use_cat, self._prep_kernel_ready(x, offset),
                None if input_norm is None else input_norm["weight"], norm_backend,
                0.0 if input_norm is None else input_norm.eps, gemv)

        if cache is not None:
            # The compiled decode step's cache may write in place: then its
            # mask must be the one attention reads (see ops.attention.kv_cache_write).
            write = getattr(cache, "write_in_place", None)
            written = write(k, v) if write is not None else None
            if written is not None:
                k, v, mask = written
            else:
                k, v = cache.update_and_fetch(k, v)

        if hasattr(cache, "bits"):
            # Quantized KV cache: mlx-lm's own quantized attention path.
            out = scaled_dot_product_attention(
                q, k, v, cache=cache, scale=self.scale, mask=mask
            )
        else:
            if (self.decode_kernel and self.use_kernel and not self.training
                    and q.shape[2] == 1):
                gated = gqa_decode_attention_gated(q, k, v, self.scale, mask, gate,
                                                   lanes=self.decode_lanes)
                if gated is not None:
                    return (DeferredProjection(gated, self.o_proj) if defer_out_proj
                            else self.o_proj(gated))
            rows = q.shape[2]
            if self.block_queries and not self.training and rows > 1:
                rows = score_block_rows(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            if rows < q.shape[2]:
                out = gqa_attention_blocked(q, k, v, self.scale, mask, rows=rows)
            elif (self.split_keys and not self.training and q.shape[2] == 1
                  and k.shape[2] >= attn_ops.SPLIT_KV_MIN_KEYS
                  and attn_ops.gpu_backend() == "cuda"):
                out = gqa_attention_split(q, k, v, self.scale, mask, use_kernel=False)
            else:
                out = gqa_attention(
                    q, k, v, self.scale, mask, use_kernel=self.use_kernel and not self.training
                )
                if (self.block_queries and not self.training
                        and q.shape[2] >= RUNAHEAD_EVAL_ROWS):
                    eval_outside_traces(out)  # see RUNAHEAD_EVAL_ROWS
        gated = gate_output(out, gate)
        return DeferredProjection(gated, self.o_proj) if defer_out_proj else self.o_proj(gated)

    def concat_projections(self) -> bool:
        """Run ``q_proj``, ``k_proj``, ``v_proj`` as one matmul from now on (``proj-concat``).

        See :class:`~qwen_apple_backend.layers._concat.ConcatProjection`: the
        children keep their names and hold row views of the one matrix.

        Returns:
            bool: False (nothing changed) when they differ in type,
            quantization or dtype.
        """
        cat = ConcatProjection.build(self, ("q_proj", "k_proj", "v_proj"))
        object.__setattr__(self, "_proj_cat", cat)
        return cat is not None

    def _use_cat(self) -> bool:
        cat = getattr(self, "_proj_cat", None)
        return cat is not None and cat.valid(self)

    def _step_spread(self, x: mx.array, cache: Any, use_cat: bool) -> Optional[bool]:
        """None unless this one-token call runs as ``ops.attention.gqa_decode_step``
        (``attn-step``): a cache that lends its buffers for in-place writes (the
        compiled decode step's, inside its serial trace) of fewer than
        ``ops.attention.STEP_MAX_KEYS`` rows, the concatenated
        projection, the kernels it replaces switched on, one dtype throughout,
        and the kernel's self-check passed for the shape (it evaluates only
        arrays of its own: safe while the step traces). Then the step's
        ``merge_spread``: :attr:`decode_merge_spread`, or False where the
        spread merge's build failed its self-check (or did not build) and the
        one-block merge's passed. The setting itself is left as it is; the
        self-checks' verdicts are cached per shape class."""
        if (cache is None or not (self.decode_step and self.decode_kernel and self.prep_kernel
                                  and self.use_kernel and use_cat) or self.training
                or getattr(cache, "in_place", None) is None
                or getattr(cache, "claim_in_place", None) is None
                or not serial_decode_tracing()):
            return None
        qw, kw = self.q_norm["weight"], self.k_norm["weight"]
        kb, vb = cache.keys, cache.values
        D = self.head_dim
        if (qw.shape != (D,) or kw.shape != (D,) or kb.ndim != 4 or vb.shape != kb.shape
                or kb.shape[1] != self.num_key_value_heads or kb.shape[3] != D
                # From 64K cached keys the lane-per-key pass of the kernel pair
                # streams the cache faster than the step's lane-group pass (H200,
                # 128K: 156.2 vs 168.3 tok/s with the step everywhere, same run);
                # with decode_step_long (attn-step-long, on by default) the step's
                # tensor-core build runs there too (H100, 128K: 225.9 vs 180.6).
                or (kb.shape[2] >= attn_ops.STEP_MAX_KEYS
                    and not (self.decode_step_long and attn_ops._step_mma(
                        self.num_attention_heads // self.num_key_value_heads, D, kb.dtype,
                        self.decode_mma)))
                or kb.shape[0] != x.shape[0]
                or not (x.dtype == qw.dtype == kw.dtype == kb.dtype == vb.dtype)):
            return None

        def ready(spread: bool) -> bool:
            return attn_ops.step_kernel_ready(
                x.shape[0], self.num_attention_heads, self.num_key_value_heads, D, x.dtype,
                rope_spec(self.rope), mma=self.decode_mma, merge_split=self.decode_merge_split,
                merge_spread=spread) is not None

        if ready(self.decode_merge_spread):
            return bool(self.decode_merge_spread)
        if self.decode_merge_spread and ready(False):
            # The spread merge's build failed its self-check (or did not build)
            # where the one-block merge's passes: the step without it.
            return False
        return None

    def _step_counter(self, B: int) -> mx.array:
        """This layer's counter for its attention step launches (one per batch size;
        a graph constant, not a parameter: kept in ``__dict__``)."""
        counters = self.__dict__.setdefault("_step_counters", {})
        c = counters.get(B)
        if c is None:
            c = counters[B] = attn_ops.step_counter(B, self.num_key_value_heads)
        return c

    def _prep_kernel_ready(self, x: mx.array, offset) -> Optional[str]:
        """The backend (``"cuda"`` / ``"metal"``) whose kernel runs a one-token
        call's q/k norm and RoPE (``qk-prep``), or None; checked before any
        compiled trace (its self-check evaluates)."""
        if (not (self.prep_kernel and self.use_kernel) or self.training or x.shape[1] != 1
                or (isinstance(offset, mx.array) and offset.ndim != 0)):
            return None
        qw, kw = self.q_norm["weight"], self.k_norm["weight"]
        if qw.dtype != kw.dtype or qw.shape != (self.head_dim,) or kw.shape != qw.shape:
            return None
        return attn_ops.qk_prep_kernel_ready(
            self.num_attention_heads, self.num_key_value_heads, self.head_dim, qw.dtype,
            kw.dtype, rope_spec(self.rope))

    def _project(self, x: mx.array, offset, use_cat: bool = False,
                 prep_kernel: Optional[str] = None,
                 norm_weight: Optional[mx.array] = None, norm_backend: Optional[str] = None,
                 norm_eps: float = 0.0, gemv: Optional[str] = None, pre: bool = False):
        """Projections, q/k norm and RoPE: everything before the KV cache
        (``prep_kernel``: norm and RoPE of a one-token call in one launch on
        that backend, which :meth:`_prep_kernel_ready` returned; ``norm_backend``: ``x`` is
        not yet normalised and the decoder layer's input RMSNorm of weight
        ``norm_weight`` runs in the concatenated projection's launch; ``gemv``:
        the concatenated projection runs on that backend's dense GEMV kernel,
        from :meth:`ConcatProjection.gemv_backend`; ``pre``: ``x`` is that
        projection's output already, ``[B, L, N]``)."""
        B, L, _ = x.shape
        if pre:
            qg, k, v = mx.split(x, self._proj_cat.split_at, axis=-1)
        elif norm_backend is not None:
            cat = self._proj_cat
            qg, k, v = mx.split(cat.norm_matmul(x, norm_weight, norm_eps, norm_backend),
                                cat.split_at, axis=-1)
        elif use_cat:
            qg, k, v = self._proj_cat(x, gemv)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Per head: D query features, then D gate features (stock split).
        q, gate = mx.split(qg.reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
        k = k.reshape(B, L, self.num_key_value_heads, -1)
        v = v.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)

        spec = rope_spec(self.rope)
        qw = self.q_norm["weight"]
        if prep_kernel and q.dtype == qw.dtype and k.dtype == qw.dtype:
            if not isinstance(offset, mx.array):
                offset = mx.array(offset, dtype=mx.int32)
            q, k = prep_qk_decode(q, k, qw, self.k_norm["weight"], q_eps=self.q_norm.eps,
                                  k_eps=self.k_norm.eps, rope=spec, offset=offset,
                                  backend=prep_kernel)
            return q, k, v, gate
        q, k = prep_qk(
            q,
            k,
            self.q_norm["weight"],
            self.k_norm["weight"],
            q_eps=self.q_norm.eps,
            k_eps=self.k_norm.eps,
            rope=spec,
            offset=offset,
        )
        if spec is None:
            q = self.rope(q, offset=offset)
            k = self.rope(k, offset=offset)
        return q, k, v, gate

    def _compiled_project(self, use_cat: bool = False, prep_kernel: Optional[str] = None,
                          norm_backend: Optional[str] = None, norm_eps: float = 0.0,
                          gemv: Optional[str] = None, pre: bool = False):
        fns = self.__dict__.setdefault("_compiled", {})
        key = (use_cat, prep_kernel, norm_backend, norm_eps, gemv, pre)
        fn = fns.get(key)
        if fn is None:
            # The module is the captured input tree, so parameters replaced
            # after fusing (load_weights, update) are read live; one trace
            # per projection path (the concatenated one is taken only while
            # the children still hold its views), q/k preparation and input
            # norm (whose weight, the decoder layer's, is an argument).
            def project(x, offset, norm_weight=None):
                return self._project(x, offset, use_cat, prep_kernel, norm_weight, norm_backend,
                                     norm_eps, gemv, pre)

            fn = compile_watched(self, project)
            fns[key] = fn
        return fn
