"""Decoder layers whose residual add and post-attention RMSNorm are one kernel (``add-norm``).

mlx-lm's Qwen3.5 decoder layer (``qwen3_5.DecoderLayer``, also built by
``qwen3_5_moe``) and Qwen3-Next's (``qwen3_next.Qwen3NextDecoderLayer``) run

    r = mixer(input_layernorm(x)); h = x + r; out = h + mlp(post_attention_layernorm(h))

They are called by mlx-lm's own model code, so instead of wrapping them the
fused model's instances get a subclass (:func:`install_add_norm`) whose
``__call__`` is that code with ``h = x + r`` and the norm replaced by one
:func:`qwen_apple_backend.ops.norm.add_rms_norm` call when the kernel is ready
for the call's dtype and width: one MLX operation instead of two per layer.
A fused MoE block (``takes_residual``) also gets ``h`` and returns
``h + mlp(...)`` itself, on the GPU decode path from its last kernel; on CUDA
a decode token's block takes ``x`` and ``r`` instead
(``FusedSparseMoeBlock.add_norm_forward``: the add, the norm, the router and
the route in one launch, the ``moe-route`` optimization), and its last kernel
may also apply the next layer's input RMSNorm: the layer hands that result to
the next layer (a per-thread slot holding the output, its norm and the norm
module), which uses it instead of calling its ``input_layernorm`` only when
its input is that very output array and its norm that very module.
Likewise the block's one launch may end with the next layer's input norm
AND its mixer's concatenated input projection (``moe-block-next-proj``): the
next layer then hands that projection to its mixer (``projected=``), under
the same identity checks, and the mixer's own projection launch is skipped.
A fused mixer may also hand the block its output before its output
projection (``defer_out_proj``, ``moe-block-out-proj``), and a fused Gated
DeltaNet its whole decode step (``defer_step``, ``moe-block-gdn``): the
block's launch then runs the step and the projection as its first phases and
stores the mixer's new states.
A fused mixer (``takes_input_norm``: the fused Gated DeltaNet and attention)
gets the un-normalised ``x`` and the layer's ``input_layernorm`` instead
(``norm-proj``): on CUDA a decode call runs the norm in the prologue of its
concatenated input projection's GEMV (``ops.linear.norm_gemv``), one launch
less per layer; elsewhere it applies the norm first, as stock.
Parameters, names and the state dict are the stock ones. Whether the kernel is
ready is decided on a layer's first call per (dtypes, width), outside any
trace, and kept in a small per-layer dict, so each later call (also inside
``mx.compile``) costs one dict lookup. Training mode, another norm class, a
shape that needs broadcasting or a device without the kernel run the stock
code.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next

from ..ops.norm import add_rms_norm, add_rms_norm_ready
from .linear import DEFERRED, ProjectedInput

__all__ = [
    "AddNormDecoderLayer",
    "AddNormQwen3NextDecoderLayer",
    "add_norm_installed",
    "install_add_norm",
    "uninstall_add_norm",
]

# (x dtype, r dtype, weight dtype, D) -> backend or None, per layer instance.
_VERDICTS = "_qab_add_norm_verdicts"
# The next decoder layer's input_layernorm, per layer instance (install_add_norm).
_NEXT_NORM = "_qab_next_input_norm"
# Whether a fused mixer gets the input norm to apply itself (norm-proj), per layer.
_NORM_PROJ = "_qab_norm_proj"
# The next decoder layer (an add-norm layer), per layer instance
# (install_add_norm): its input norm and mixer, read at each call, are what a
# fused MoE block's launch may project for it (moe-block-next-proj).
_NEXT_LAYER = "_qab_next_layer"

# A layer's output and its next layer's input norm of it (or a ProjectedInput:
# that norm and the next mixer's input projection), computed by the output's
# last kernel: (out, out_norm, the norm module). Per thread; the next layer
# takes it only when its input IS that output and its input norm IS that
# module (and a ProjectedInput's mixer IS its mixer), and every layer clears it.
_HANDOFF = threading.local()


def _take_handoff(x: mx.array, norm: Any) -> Optional[Union[mx.array, ProjectedInput]]:
    hand = getattr(_HANDOFF, "value", None)
    if hand is None:
        return None
    _HANDOFF.value = None
    out, out_norm, by = hand
    return out_norm if (out is x and by is norm) else None


def _next_layer_projection(layer: Any, mlp: Any) -> Optional[tuple]:
    """``(input_layernorm, mixer)`` of the next decoder layer ``layer`` when the
    MoE block ``mlp`` may compute that mixer's input projection for it
    (``next_proj_phase``, ``moe-block-next-proj``): ``layer`` is still an
    add-norm layer, its norm an ``nn.RMSNorm`` and its mixer one that takes a
    projected input; else None. Read at each call, so a layer or mixer
    replaced after :func:`install_add_norm` is never projected for."""
    if layer is None or not getattr(mlp, "next_proj_phase", False):
        return None
    if not getattr(type(layer), "_qab_add_norm", False) or layer._training:
        return None
    mixer = dict.get(layer, "linear_attn" if layer.is_linear else "self_attn")
    norm = dict.get(layer, "input_layernorm")
    if (type(norm) is not nn.RMSNorm or not getattr(mixer, "takes_projected", False)
            or not layer.__dict__.get(_NORM_PROJ)):
        return None
    return norm, mixer


class _AddNorm:
    """The ``add-norm`` ``__call__``; mixed into a subclass of each stock decoder layer.

    Never constructed: :func:`install_add_norm` swaps an existing instance's
    class.

    Shapes: x ``[B, T, hidden_size]`` (any T: prefill and decode); returns
    the same.
    """

    _qab_add_norm = True
    _qab_stock_class: type = nn.Module

    def _add_norm_backend(self, x: mx.array, r: mx.array, norm: Any) -> Optional[str]:
        # The per-call cost of this path matters (decode is host-bound): a
        # few attribute reads and one dict lookup once the verdict is known.
        if self._training or type(norm) is not nn.RMSNorm or r.shape != x.shape:
            return None
        w = norm["weight"]
        key = (x.dtype, r.dtype, w.dtype, x.shape[-1])
        verdicts = self.__dict__.get(_VERDICTS)
        if verdicts is None:
            verdicts = {}
            object.__setattr__(self, _VERDICTS, verdicts)
        try:
            return verdicts[key]
        except KeyError:
            pass
        # First call for these dtypes and width: outside any trace (the
        # model's first call is an eager prefill or decode token), so the
        # kernel's self-check may run here.
        D = x.shape[-1]
        backend = None
        if x.dtype == r.dtype == w.dtype and w.shape == (D,):
            backend = add_rms_norm_ready(D, x.dtype, w.dtype, eps=norm.eps)
        verdicts[key] = backend
        return backend

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None,
                 cache: Optional[Any] = None) -> mx.array:
        """The stock ``DecoderLayer.__call__`` of qwen3_5 and qwen3_next, fused.

        ``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``,
        with the residual add and the post-attention norm as one call when
        ready; a fused MoE block may take the whole second half (and the
        mixer's output projection, and the next layer's input norm or input
        projection: see the module doc); a fused mixer may take the input
        norm, or the projection the previous layer's block computed for it.

        Args:
            x (mx.array): hidden states ``[B, T, hidden_size]``.
            mask: the stock layer's mask (attention mask or SSM mask).
            cache: the stock layer's cache entry.

        Returns:
            mx.array: ``[B, T, hidden_size]``, dtype of ``x``.
        """
        # The stock DecoderLayer.__call__ of qwen3_5 and qwen3_next, with the
        # residual add and the post-attention norm as one call when ready.
        mixer = self.linear_attn if self.is_linear else self.self_attn
        mlp = self.mlp
        takes = getattr(mlp, "takes_mixer_output", False) and not self._training
        # A fused MoE block may run the mixer's output projection in its own
        # launch (moe-block-out-proj): the mixer then returns its output
        # before that projection (a DeferredProjection).
        kw = ({"defer_out_proj": True}
              if takes and getattr(mixer, "defers_out_proj", False)
              and getattr(mlp, "takes_out_proj", False) and getattr(mlp, "out_proj_phase", False)
              else {})
        # ... and a Gated DeltaNet's decode step itself before that (moe-block-gdn):
        # the mixer then returns a DeferredGatedDelta.
        if kw and getattr(mixer, "defers_step", False) and getattr(mlp, "gdn_phase", False):
            kw["defer_step"] = True
        xn = _take_handoff(x, self.input_layernorm)
        if isinstance(xn, ProjectedInput) and (xn.mixer is not mixer or self._training):
            xn = None
        if isinstance(xn, ProjectedInput):
            # The previous layer's MoE block ran this layer's input norm and
            # its mixer's input projection (moe-block-next-proj).
            r = mixer(x, mask, cache, input_norm=self.input_layernorm, projected=xn.y, **kw)
        elif xn is not None:
            r = mixer(xn, mask, cache, **kw)
        elif (self.__dict__.get(_NORM_PROJ) and getattr(mixer, "takes_input_norm", False)
              and not self._training):
            # A fused mixer applies the input norm itself: on CUDA a decode
            # call runs it in its input projection's launch (norm-proj).
            r = mixer(x, mask, cache, input_norm=self.input_layernorm, **kw)
        else:
            r = mixer(self.input_layernorm(x), mask, cache, **kw)
        norm = self.post_attention_layernorm
        if takes:
            # A fused MoE block may run the add, the norm and its router in one
            # launch ahead of its expert kernels (decode on CUDA), and the next
            # layer's input norm in its last kernel; None otherwise.
            nxt = self.__dict__.get(_NEXT_NORM)
            nxt_layer = _next_layer_projection(self.__dict__.get(_NEXT_LAYER), mlp)
            got = mlp.add_norm_forward(x, r, norm, nxt, next_layer=nxt_layer)
            if got is not None:
                out, out_norm = got
                if isinstance(out_norm, ProjectedInput):
                    _HANDOFF.value = (out, out_norm, nxt_layer[0])
                elif out_norm is not None:
                    _HANDOFF.value = (out, out_norm, nxt)
                return out
        if isinstance(r, DEFERRED):
            r = r.apply()
        backend = self._add_norm_backend(x, r, norm)
        if backend is None:
            h = x + r
            y = norm(h)
        else:
            h, y = add_rms_norm(x, r, norm["weight"], norm.eps, backend=backend)
        if getattr(self.mlp, "takes_residual", False):
            # The fused MoE block adds h itself (on the GPU decode path in its
            # last kernel: one Add launch less per layer and token).
            return self.mlp(y, residual=h)
        return h + self.mlp(y)

    def to_stock(self) -> nn.Module:
        """Give this layer back its stock mlx-lm class (in place) and return it."""
        self.__dict__.pop(_VERDICTS, None)
        self.__dict__.pop(_NEXT_NORM, None)
        self.__dict__.pop(_NORM_PROJ, None)
        self.__dict__.pop(_NEXT_LAYER, None)
        self.__class__ = self._qab_stock_class
        return self


class AddNormDecoderLayer(_AddNorm, qwen3_5.DecoderLayer):
    """``mlx_lm.models.qwen3_5.DecoderLayer`` with the ``add-norm`` call (see the module doc)."""

    _qab_stock_class = qwen3_5.DecoderLayer


class AddNormQwen3NextDecoderLayer(_AddNorm, qwen3_next.Qwen3NextDecoderLayer):
    """``mlx_lm.models.qwen3_next.Qwen3NextDecoderLayer`` with the ``add-norm`` call."""

    _qab_stock_class = qwen3_next.Qwen3NextDecoderLayer


_CLASSES = {qwen3_5.DecoderLayer: AddNormDecoderLayer,
            qwen3_next.Qwen3NextDecoderLayer: AddNormQwen3NextDecoderLayer}


def _add_norm_class_for(layer: Any) -> Optional[type]:
    # Exactly the stock class (a subclass may have its own __call__), with the
    # attributes the replacement __call__ reads.
    cls = _CLASSES.get(type(layer))
    if cls is None or not all(n in layer for n in ("input_layernorm", "post_attention_layernorm",
                                                   "mlp")):
        return None
    if type(layer["post_attention_layernorm"]) is not nn.RMSNorm:
        return None
    return cls


def install_add_norm(model: Any, next_norm: bool = False, norm_proj: bool = True) -> int:
    """Give each stock decoder layer of ``model`` its ``add-norm`` subclass.

    Args:
        model (nn.Module): an mlx-lm Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model
            (anything with ``layers``: the decoder layers).
        next_norm (bool): tell each layer the next layer's input RMSNorm, so
            that a fused MoE block's last decode kernel may apply it (the
            ``next-norm`` optimization, opt-in: ``QAB_ENABLE=next-norm``).
            Default False.
        norm_proj (bool): a fused mixer (``takes_input_norm``) gets the
            un-normalised input and the layer's input RMSNorm, and on CUDA
            runs the norm in its input projection's launch (the
            ``norm-proj`` optimization). Default True.

    Each swapped layer also records the next one (when that is an add-norm
    layer too), so that its fused MoE block may end with the next layer's
    input norm and mixer projection (``moe-block-next-proj``, the block's
    ``next_proj_phase``); whether it may is decided at each call from the
    next layer's current norm, mixer and class. Calling this again re-records
    it (e.g. after replacing layers), even when it swaps nothing.

    Returns:
        int: the number of layers swapped (0 when none is exactly a stock
        ``qwen3_5.DecoderLayer`` / ``qwen3_next.Qwen3NextDecoderLayer`` with an
        ``nn.RMSNorm`` post-attention norm, or all already were).
    """
    n = 0
    layers = list(getattr(model, "layers", ()))
    for layer in layers:
        cls = _add_norm_class_for(layer)
        if cls is not None:
            layer.__class__ = cls
            object.__setattr__(layer, _VERDICTS, {})
            n += 1
        if getattr(type(layer), "_qab_add_norm", False):
            object.__setattr__(layer, _NORM_PROJ, bool(norm_proj))
    # Each swapped layer knows the next layer's input norm (for the fused MoE
    # block's last kernel to apply it; see FusedSparseMoeBlock.add_norm_forward).
    # And the next layer itself: a block whose next_proj_phase is set (the
    # moe-block-next-proj optimization, on by default) may compute that
    # layer's input norm and its mixer's input projection (checked per call).
    for layer, nxt in zip(layers, layers[1:] + [None]):
        if getattr(type(layer), "_qab_add_norm", False):
            norm = None if nxt is None else dict.get(nxt, "input_layernorm")
            keep = next_norm and type(norm) is nn.RMSNorm
            object.__setattr__(layer, _NEXT_NORM, norm if keep else None)
            add_norm = nxt is not None and getattr(type(nxt), "_qab_add_norm", False)
            object.__setattr__(layer, _NEXT_LAYER, nxt if add_norm else None)
    return n


def uninstall_add_norm(model: Any) -> int:
    """Undo :func:`install_add_norm`: every swapped layer gets its stock class back.

    Returns:
        int: the number of layers restored.
    """
    n = 0
    for layer in getattr(model, "layers", ()):
        if getattr(type(layer), "_qab_add_norm", False):
            layer.to_stock()
            n += 1
    return n


def add_norm_installed(model: Any) -> bool:
    """Whether any decoder layer of ``model`` has its ``add-norm`` subclass."""
    return any(getattr(type(layer), "_qab_add_norm", False)
               for layer in getattr(model, "layers", ()))
