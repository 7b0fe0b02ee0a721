"""Fused drop-in for mlx-lm's ``Qwen3NextSparseMoeBlock``.

``Qwen3NextSparseMoeBlock`` is the MoE block of ``qwen3_next``, ``qwen3_5``
and ``qwen3_5_moe``. :class:`FusedSparseMoeBlock` keeps its interface,
attributes and parameter names except one: the experts' separate
``switch_mlp.gate_proj`` and ``switch_mlp.up_proj`` become a single
``switch_mlp.gate_up_proj`` (``[E, 2I, H]``, gate rows first), so each token
needs one gathered matmul for both.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, sum_gradients
from mlx_lm.models import qwen3_5 as _qwen3_5
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwiGLU,
    SwitchGLU,
    SwitchLinear,
)

from qwen_apple_backend import envs
from qwen_apple_backend.layers._concat import ConcatProjection
from qwen_apple_backend.layers._watch import compile_watched
from qwen_apple_backend.layers.linear import DeferredGatedDelta, DeferredProjection, ProjectedInput
from qwen_apple_backend.ops.linear import GEMV_MAX_ROWS
from qwen_apple_backend.ops.moe import (
    SORT_THRESHOLD,
    ExpertWeights,
    GatedDeltaStep,
    NextProjection,
    OutProjection,
    PackCheckDue,
    SharedExpertWeights,
    add_norm_route,
    add_norm_route_ready,
    decode_block_counter_length,
    decode_block_pack,
    decode_block_pack_arrays,
    decode_block_pack_counter_length,
    decode_block_pack_views,
    decode_block_ready,
    decode_kernel_ready,
    fold_norm_counter,
    gated_delta_step_supported,
    moe_decode_block,
    moe_experts,
    moe_shared_experts_kernel,
    moe_shared_experts_norm_kernel,
    next_projection_supported,
    out_projection_supported,
    pack_check_passing,
    router_kernel_ready,
    serial_counter,
    serial_decode_tracing,
    shared_decode_kernel_ready,
    shared_decode_norm_ready,
    swiglu_experts_ops,
    topk_route,
)

__all__ = ["FusedSwitchGLU", "FusedSparseMoeBlock", "expert_weights", "linear_weights"]

AnySwitchLinear = Union[SwitchLinear, QuantizedSwitchLinear]

# Shared-expert classes whose call is down_proj(swiglu(gate_proj(x), up_proj(x))).
_SWIGLU_MLPS = tuple(c for c in (Qwen3NextMLP, getattr(_qwen3_5, "MLP", None)) if c is not None)


@lru_cache(maxsize=None)
def _logits_stand_in(dtype: mx.Dtype, num_experts: int) -> mx.array:
    # What router_kernel_ready reads of the logits (dtype and E), without
    # running the gate: never evaluated.
    return mx.zeros((1, num_experts), dtype=dtype)


def _child(module: nn.Module, name: str) -> Optional[mx.array]:
    # Optional arrays (biases, bias, global_scale) live in the parameter dict
    # when present and as a None attribute, or not at all, otherwise.
    return module[name] if name in module else getattr(module, name, None)


def _weights_of(module: nn.Module, quantized: bool) -> ExpertWeights:
    """The arrays (not copied) and quantization settings of a (switch) linear module."""
    if not quantized:
        return ExpertWeights(weight=module["weight"], bias=_child(module, "bias"))
    return ExpertWeights(
        weight=module["weight"],
        scales=module["scales"],
        biases=_child(module, "biases"),
        bias=_child(module, "bias"),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
        global_scale=_child(module, "global_scale"),
    )


def expert_weights(module: AnySwitchLinear) -> ExpertWeights:
    """View a ``SwitchLinear`` / ``QuantizedSwitchLinear`` as :class:`ExpertWeights`.

    Args:
        module (SwitchLinear | QuantizedSwitchLinear): stacked expert linear.

    Returns:
        ExpertWeights: the module's arrays (not copied) and quantization
        settings.

    Raises:
        TypeError: if ``module`` is neither type.
    """
    if isinstance(module, (QuantizedSwitchLinear, SwitchLinear)):
        return _weights_of(module, isinstance(module, QuantizedSwitchLinear))
    raise TypeError(
        f"expected SwitchLinear or QuantizedSwitchLinear, got {type(module).__name__}"
    )


def linear_weights(module: nn.Module) -> Optional[ExpertWeights]:
    """View an ``nn.Linear`` / ``nn.QuantizedLinear`` as a 2-D :class:`ExpertWeights`.

    Args:
        module (nn.Module): a linear layer.

    Returns:
        ExpertWeights | None: the module's arrays (not copied), ``weight``
        ``[O, In]`` or packed; None for any other type (a LoRA wrapper, a
        subclass), whose call may not be a plain matmul.
    """
    if type(module) in (nn.QuantizedLinear, nn.Linear):
        return _weights_of(module, type(module) is nn.QuantizedLinear)
    return None


class BlockPack:
    """A sparse MoE block's router, shared expert and routed experts as one uint32
    array (``moe-block-pack``), which then holds the block's weights.

    The one-launch MoE decode block binds about 40 arrays per layer and MLX's
    host cost per launch grows with each bound array
    (``benchmarks/profile_encode.py``); its packed build reads the router's,
    the shared expert's and the routed experts' 21 arrays from one array
    (:func:`~qwen_apple_backend.ops.moe.decode_block_pack`, ``cat["pk"]``:
    a dict, as a concatenation's, so that a compiled function taking
    :attr:`cat` as an input reads the current array).

    The pack is a copy, and the routed experts are most of a layer's bytes
    (Qwen3.6-35B-A3B: ~450 MB of a layer's 4-bit weights), so :meth:`build`
    then puts views of the pack in the modules in place of their arrays
    (:func:`~qwen_apple_backend.ops.moe.decode_block_pack_views`: the same
    values, sharing the pack's memory): the originals are freed unless
    something else holds them (a model sharing them, as the benchmark's
    ``--share-weights`` pair does, keeps both). The shared expert's gate and
    up projections are left as they are while their concatenation
    (``proj-concat``) holds them: the pack copies those two.

    Like :class:`~qwen_apple_backend.layers._concat.ConcatProjection` it is
    used only while every module on :data:`PATHS` is the one it was built from,
    of its type, holding the arrays it was built from (the views); a module
    or array replaced (``load_weights``, ``update``, a LoRA wrapper) switches
    the packed build off until the next decode call (or the compiled decode
    step's next build) builds a new pack from the current arrays. An array
    changed in place (``w *= c``) is not seen (validity is checked by
    identity): the pack keeps the old values. The compiled decode step
    treats it as it treats a concatenation (:attr:`tracing`,
    :meth:`identity_checks`, :meth:`refresh`).
    """

    #: The packed build with the Gated DeltaNet phase writes the mixer's conv
    #: and recurrent states in place (its only outputs are the layer's output
    #: and the next projection's): the compiled decode step gives the caches
    #: private state buffers first while it uses a pack.
    writes_states = True

    #: Module paths from the block, in the pack's order of
    #: :func:`~qwen_apple_backend.ops.moe.decode_block_pack_arrays`: the
    #: router, the shared expert's gate and up projections, the shared
    #: expert's gate, its down projection, the routed experts' fused gate+up
    #: and down projections (weight, scales, biases of each).
    PATHS = (("gate",), ("shared_expert", "gate_proj"), ("shared_expert", "up_proj"),
             ("shared_expert_gate",), ("shared_expert", "down_proj"),
             ("switch_mlp", "gate_up_proj"), ("switch_mlp", "down_proj"))

    def __init__(self, modules: list, cat: mx.array):
        self.modules = modules
        self.types = [type(m) for m in modules]
        self.views = [_pack_views(m) for m in modules]
        self.cat = {"pk": cat}
        #: Set by the compiled decode step while it traces (the arrays are tracers then).
        self.tracing = False
        #: How many times :meth:`refresh` re-recorded :attr:`views`.
        self.refreshes = 0

    @classmethod
    def build(cls, owner: nn.Module) -> Optional["BlockPack"]:
        """The pack of ``owner``'s router, shared expert and experts (evaluated), or None.

        None when a module on :data:`PATHS` is missing or not a plain
        ``nn.QuantizedLinear`` (the experts: ``QuantizedSwitchLinear``),
        the experts' scales are not of the shared expert's dtype, the
        shapes do not fit the packed layout, or the pack would pass
        :data:`~qwen_apple_backend.ops.moe.PACK_MAX_BYTES`
        (:func:`~qwen_apple_backend.ops.moe.decode_block_pack`). Otherwise
        the modules' arrays are replaced by views of the pack (the same
        values; see the class).
        """
        modules = [_walk(owner, path) for path in cls.PATHS]
        if (any(type(m) is not nn.QuantizedLinear for m in modules[:5])
                or any(type(m) is not QuantizedSwitchLinear for m in modules[5:])):
            return None
        shared = owner._shared_weights()
        gate = linear_weights(owner.gate)
        if shared is None or gate is None:
            return None
        try:
            gu, dn = (expert_weights(m) for m in modules[5:])
            cat = decode_block_pack(gate, gu, dn, shared)
            views = decode_block_pack_views(cat, gate, gu, dn, shared)
        except (ValueError, AttributeError, TypeError):
            return None
        arrays = decode_block_pack_arrays(gate, gu, dn, shared)
        mx.eval(cat, views)
        # The shared expert's gate and up projections already hold row views
        # of their concatenation (proj-concat, the one-matmul path of calls
        # outside the block): replacing them would switch that path off for
        # good; the pack keeps a copy of them (~1.2 MB per layer at Qwen3.6's
        # shape).
        shared_cat = owner.__dict__.get("_shared_cat")
        held = ({id(c) for c in shared_cat.children}
                if shared_cat is not None and owner._use_cat() else set())
        for k, (a, v) in enumerate(zip(arrays, views)):
            m, name = modules[k // 3], _PACK_NAMES[k % 3]
            if id(m) not in held and dict.get(m, name) is a:
                m[name] = v
        return cls(modules, cat)

    def valid(self, owner: nn.Module) -> bool:
        """True while ``owner`` still has these modules, of their type, holding their arrays."""
        for path, m, t, views in zip(self.PATHS, self.modules, self.types, self.views):
            if _walk(owner, path) is not m or type(m) is not t:
                return False
            if self.tracing:
                continue
            for name, v in views.items():
                if dict.get(m, name) is not v:
                    return False
        return True

    def identity_checks(self, owner: nn.Module) -> tuple:
        """:meth:`valid`'s checks flattened: ``(containers, keys, expected, children, types)``
        (see :meth:`ConcatProjection.identity_checks`)."""
        containers, keys, expected = [], [], []
        for path, m, views in zip(self.PATHS, self.modules, self.views):
            parent = owner
            for name in path:
                child = dict.get(parent, name)
                containers.append(parent)
                keys.append(name)
                expected.append(child if name != path[-1] else m)
                parent = child
            for name, v in views.items():
                containers.append(m)
                keys.append(name)
                expected.append(v)
        return containers, keys, expected, list(self.modules), list(self.types)

    def refresh(self) -> None:
        """Re-record the modules' arrays after a call that was valid when it started
        (a trace puts back new Python objects for the same arrays)."""
        self.views = [_pack_views(m) for m in self.modules]
        self.refreshes += 1


#: The arrays of each module in a :class:`BlockPack`, in the pack's order.
_PACK_NAMES = ("weight", "scales", "biases")


def _walk(owner: nn.Module, path: tuple):
    m = owner
    for name in path:
        m = dict.get(m, name) if isinstance(m, dict) else None
    return m


def _pack_views(m: nn.Module) -> dict:
    return {n: dict.get(m, n) for n in _PACK_NAMES}


def _new_switch_linear(like: AnySwitchLinear, arrays: dict) -> AnySwitchLinear:
    """A module of ``like``'s type holding ``arrays``, without running ``__init__``.

    ``__init__`` would draw random weights (advancing MLX's global RNG, which
    users seed for sampling) only to throw them away.
    """
    cls = type(like)
    out = cls.__new__(cls)
    nn.Module.__init__(out)
    if isinstance(like, QuantizedSwitchLinear):
        out.group_size = like.group_size
        out.bits = like.bits
        out.mode = like.mode
        out.global_scale = None
        out.biases = None
    for name, value in arrays.items():
        if value is not None:
            setattr(out, name, value)
    if isinstance(like, QuantizedSwitchLinear):
        out.freeze()  # stock quantized layers are frozen
    return out


def _concat_gate_up(
    gate: AnySwitchLinear, up: AnySwitchLinear, where: str
) -> AnySwitchLinear:
    """Concatenate two expert projections along their output axis.

    Valid for packed weights too: quantization groups run along the input
    axis, so output rows (and their scale/bias rows) are independent.
    """
    if type(gate) is not type(up):
        raise ValueError(
            f"{where}: gate_proj is {type(gate).__name__} but up_proj is "
            f"{type(up).__name__}; both must be quantized the same way to fuse"
        )
    g, u = expert_weights(gate), expert_weights(up)
    if g.quantized:
        if (g.bits, g.group_size, g.mode) != (u.bits, u.group_size, u.mode):
            raise ValueError(
                f"{where}: gate_proj (bits={g.bits}, group_size={g.group_size}, "
                f"mode={g.mode!r}) and up_proj (bits={u.bits}, "
                f"group_size={u.group_size}, mode={u.mode!r}) are quantized "
                "differently and cannot share one fused gate_up_proj"
            )
        if (g.biases is None) != (u.biases is None):
            raise ValueError(f"{where}: only one of gate_proj/up_proj has biases")
        if (g.global_scale is None) != (u.global_scale is None) or (
            g.global_scale is not None
            and not mx.array_equal(g.global_scale, u.global_scale).item()
        ):
            raise ValueError(
                f"{where}: gate_proj and up_proj have different per-expert global "
                "scales and cannot share one fused gate_up_proj"
            )
    if g.weight.shape != u.weight.shape or g.weight.dtype != u.weight.dtype:
        raise ValueError(
            f"{where}: gate_proj {g.weight.shape} {g.weight.dtype} and up_proj "
            f"{u.weight.shape} {u.weight.dtype} differ in shape or dtype"
        )
    if (g.bias is None) != (u.bias is None):
        raise ValueError(f"{where}: only one of gate_proj/up_proj has a bias")

    def cat(a, b, axis=1):
        return None if a is None else mx.concatenate([a, b], axis=axis)

    arrays = {"weight": cat(g.weight, u.weight), "bias": cat(g.bias, u.bias)}
    if g.quantized:
        arrays.update(
            scales=cat(g.scales, u.scales),
            biases=cat(g.biases, u.biases),
            global_scale=g.global_scale,
        )
    return _new_switch_linear(gate, arrays)


def _split_gate_up(gate_up: AnySwitchLinear) -> tuple[AnySwitchLinear, AnySwitchLinear]:
    w = expert_weights(gate_up)
    half = w.weight.shape[1] // 2

    def part(a, i, axis=1):
        if a is None:
            return None
        lo, hi = (0, half) if i == 0 else (half, 2 * half)
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(lo, hi)
        return mx.contiguous(a[tuple(idx)])

    out = []
    for i in (0, 1):
        arrays = {"weight": part(w.weight, i), "bias": part(w.bias, i)}
        if w.quantized:
            arrays.update(
                scales=part(w.scales, i),
                biases=part(w.biases, i),
                global_scale=w.global_scale,
            )
        out.append(_new_switch_linear(gate_up, arrays))
    return out[0], out[1]


class FusedSwitchGLU(nn.Module):
    """Experts with one fused gate+up projection; replaces ``SwitchGLU``.

    Args:
        gate_up_proj (SwitchLinear | QuantizedSwitchLinear): ``[E, 2I, H]``,
            gate rows first, up rows second.
        down_proj (SwitchLinear | QuantizedSwitchLinear): ``[E, H, I]``.
    """

    def __init__(self, gate_up_proj: AnySwitchLinear, down_proj: AnySwitchLinear):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Per-slot expert outputs, like ``SwitchGLU.__call__``.

        Args:
            x (mx.array): token activations.
            indices (mx.array): expert indices.

        Returns:
            mx.array: unweighted expert outputs, dtype of ``x``.

        Shapes:
            x: ``[..., H]``; indices: ``[..., K]``; returns ``[..., K, H]``
        """
        return swiglu_experts_ops(
            x, indices, expert_weights(self.gate_up_proj), expert_weights(self.down_proj)
        )


def _next_projection(x: mx.array, norm: nn.Module, mixer: nn.Module) -> Optional[NextProjection]:
    """The next decoder layer's input RMSNorm and its mixer's concatenated
    4-bit input projection as a
    :class:`~qwen_apple_backend.ops.moe.NextProjection` for the one-launch
    block's ``NP`` phase, or None (a norm other than ``nn.RMSNorm``, a mixer
    without a valid concatenation or that does not take a projected input, a
    projection the phase does not take: see
    :func:`~qwen_apple_backend.ops.moe.next_projection_supported`; more token
    rows than the mixer's own norm + GEMV launch takes,
    :data:`~qwen_apple_backend.ops.linear.GEMV_MAX_ROWS`)."""
    cat = getattr(mixer, "_proj_cat", None)
    if (x.ndim == 0 or x.size // x.shape[-1] > GEMV_MAX_ROWS or type(norm) is not nn.RMSNorm
            or cat is None or not getattr(mixer, "takes_projected", False)
            or getattr(mixer, "training", True) or not cat._quantized_with_biases()
            or cat.kind[2] != 4 or cat.kind[3] != "affine" or not cat.valid(mixer)):
        return None
    c = cat.cat
    np_ = NextProjection(norm["weight"], norm.eps,
                         ExpertWeights(c["weight"], c["scales"], c["biases"],
                                       group_size=cat.kind[1], bits=4))
    return np_ if next_projection_supported(x, np_) else None


class FusedSparseMoeBlock(nn.Module):
    """Drop-in for ``Qwen3NextSparseMoeBlock`` with fused routing and experts.

    Children: ``gate`` (router), ``switch_mlp.gate_up_proj``,
    ``switch_mlp.down_proj``, ``shared_expert``, ``shared_expert_gate``.
    Attributes ``norm_topk_prob``, ``num_experts``, ``top_k`` and
    ``sharding_group`` mean what they mean on the stock block. Build one with
    :meth:`from_stock`.

    Args:
        gate (nn.Module): router, ``H -> E`` (plain or quantized linear).
        switch_mlp (FusedSwitchGLU): the routed experts.
        shared_expert (nn.Module): shared SwiGLU MLP.
        shared_expert_gate (nn.Module): ``H -> 1`` linear of the shared gate.
        top_k (int): experts per token.
        norm_topk_prob (bool): renormalise the kept routing probabilities.
        use_kernel (bool): allow GPU expert kernels. Default True.
        compile_decode (bool): run decode-sized calls as one compiled graph.
            Default True.

    Attribute ``fused_route`` (default True; the ``moe-route`` optimization)
    lets :meth:`add_norm_forward` run a decode token's residual add,
    post-attention RMSNorm, router and route as one CUDA launch ahead of the
    two expert kernels
    (:func:`~qwen_apple_backend.ops.moe.add_norm_route`). Attribute
    ``one_launch`` (default True; the ``moe-block`` optimization) runs that
    launch and the two expert kernels as one
    (:func:`~qwen_apple_backend.ops.moe.moe_decode_block`, CUDA; same outputs).
    Attribute ``stage_down`` (default True; the ``moe-block-stage``
    optimization) builds that launch with its down items staging the token's
    gate/up activations in shared memory (``STAGE``; same outputs).
    Attribute ``early_gate_up`` (default True; the ``moe-block-early``
    optimization) builds it with gate/up items that stage the token's norm
    themselves and wait for the route only for routed rows (``EARLY``; same
    outputs). Attribute ``unroll_stage`` (default True; the
    ``moe-block-unroll`` optimization) builds it with its out- and
    next-projection phases staging their input row in loops unrolled over the
    block size (``UNROLL``; same outputs). Attribute ``npl_items`` (default
    True; the ``moe-block-npl`` optimization) builds it with next-projection
    blocks that take the next tickets too and reuse the input row they
    staged (``NPL``; same outputs). Attribute ``roll_dots`` (default True;
    the ``moe-block-roll`` optimization) builds it with its items' dot loops
    running one chunk's code in a loop instead of unrolled (``ROLL``; same
    outputs, less code for the SMs' instruction caches). Attribute
    ``npg_grid`` (default True; the ``moe-block-npg`` optimization) launches
    it with as many next-projection blocks as the GPU keeps resident, which
    loop over the phase's items, instead of one block per item (``NPG``; same
    outputs). Attribute ``nps_mode`` (default 0; the
    opt-in ``moe-block-nps`` sets
    :data:`~qwen_apple_backend.ops.moe.NPS_MODE`) builds it on a persistent
    grid whose blocks copy their next-projection rows into shared memory
    early, at their start (1) or after their first item (2) (``NPS``; same
    outputs). Attribute ``preload_norm`` (default False; the opt-in
    ``moe-block-rpl`` sets it) builds it with route items (and the gate/up
    items that stage the norm themselves) that load the token's residual row,
    the norm weight and eps before they wait for the mixer's output (``RPL``;
    same outputs). :meth:`_block_overrides` gives these seven attributes as the
    launch's build overrides (``DECODE_BLOCK_OPTIONS`` flags STAGE, EARLY,
    UNROLL, NPL, ROLL, RPL and the value NPS). Attribute ``l2_next`` (default
    None; set by the fusing code with the opt-in ``l2-prefetch``): the next
    decoder layer's concatenated input projection, whose arrays that launch
    asks the L2 to fetch while its route runs (``PF``; same outputs).
    Attribute ``out_proj_phase`` (default
    True; the ``moe-block-out-proj`` optimization): when the decoder layer
    hands :meth:`add_norm_forward` the mixer's output before its 4-bit
    output projection (a
    :class:`~qwen_apple_backend.layers.linear.DeferredProjection`), that
    launch computes the projection as its first phase (``OP``; the
    projection's arithmetic is this package's GEMV kernel's). Attribute
    ``next_proj_phase`` (default True; the ``moe-block-next-proj`` optimization):
    when the decoder layer names the next layer's input norm and mixer, that
    launch also computes the next layer's input RMSNorm and the mixer's
    concatenated 4-bit input projection as its last phase (``NP``; the
    arithmetic of this package's norm GEMV kernel), which the next layer hands
    its mixer (a :class:`~qwen_apple_backend.layers.linear.ProjectedInput`).
    Attribute ``gdn_phase`` (default True; the ``moe-block-gdn``
    optimization): when the decoder layer hands it a Gated DeltaNet's decode
    step not yet run (a
    :class:`~qwen_apple_backend.layers.linear.DeferredGatedDelta`), that
    launch runs the step as its first phase, ahead of the output projection
    (``GD``, op ``moe_decode_block_gdn``; gated_delta_decode's per-head code),
    and stores the mixer's new states; else the step runs in its own launch
    first. Attribute ``block_pack`` (default True; the ``moe-block-pack``
    optimization): that launch reads the router's, the shared expert's and
    the routed experts' arrays from one pack that then holds them
    (:class:`BlockPack`, built on the first decode call that can use it or
    by the compiled decode step; the same output) where that build is ready.

    Attribute ``dequant_gemm`` (default True; the ``moe-gemm`` optimization)
    lets prefill-sized calls on quantized experts dequantize them and run a
    grouped GEMM (:func:`~qwen_apple_backend.ops.moe.moe_experts_dequant_gemm`).

    With ``use_kernel`` (the ``moe-kernel`` optimization) on a GPU, decode
    runs the routed experts in two kernels; when the shared expert and its
    gate are plain 4-bit (gate: 4- or 8-bit) linears of the routed experts'
    size and quantization, they are folded into those same two kernels
    (:func:`~qwen_apple_backend.ops.moe.shared_decode_kernel_ready`), each
    path only after its self-check passed. Prefill on the grouped GEMM
    kernel adds the gated shared expert in its combine kernel. Routing (any
    number of tokens) is one kernel launch instead of about six once
    :func:`~qwen_apple_backend.ops.moe.router_kernel_ready` passed for the
    logits' dtype; it picks the experts the stock route picks on the GPU.
    """

    #: ``__call__`` takes the decoder layer's residual (``layers/norm.py``).
    takes_residual = True
    #: :meth:`add_norm_forward` may run the decoder layer's residual add and
    #: post-attention norm with the block (``layers/norm.py``).
    takes_mixer_output = True
    #: :meth:`add_norm_forward` takes the mixer's output before its output
    #: projection (a DeferredProjection; ``layers/norm.py``).
    takes_out_proj = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass with its own __call__ may not take ``residual``, nor
        # compute what its __call__ computes through add_norm_forward.
        if "__call__" in cls.__dict__:
            if "takes_residual" not in cls.__dict__:
                cls.takes_residual = False
            if "takes_mixer_output" not in cls.__dict__:
                cls.takes_mixer_output = False
            if "takes_out_proj" not in cls.__dict__:
                cls.takes_out_proj = False

    dequant_gemm: bool = True
    fused_route: bool = True
    one_launch: bool = True
    stage_down: bool = True
    early_gate_up: bool = True
    unroll_stage: bool = True
    npl_items: bool = True
    roll_dots: bool = True
    npg_grid: bool = True
    preload_norm: bool = False
    nps_mode: int = 0
    out_proj_phase: bool = True
    next_proj_phase: bool = True
    gdn_phase: bool = True
    block_pack: bool = True
    l2_next = None

    def __init__(
        self,
        gate: nn.Module,
        switch_mlp: FusedSwitchGLU,
        shared_expert: nn.Module,
        shared_expert_gate: nn.Module,
        *,
        top_k: int,
        norm_topk_prob: bool,
        use_kernel: bool = True,
        compile_decode: bool = True,
    ):
        super().__init__()
        self.norm_topk_prob = norm_topk_prob
        self.num_experts = expert_weights(switch_mlp.gate_up_proj).weight.shape[0]
        self.top_k = top_k
        self.gate = gate
        self.switch_mlp = switch_mlp
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.sharding_group = None
        self.use_kernel = use_kernel
        self.compile_decode = compile_decode

    @classmethod
    def from_stock(
        cls,
        stock_block: Qwen3NextSparseMoeBlock,
        *,
        use_kernel: bool = True,
        compile_decode: bool = True,
        materialize: bool = True,
        name: Optional[str] = None,
    ) -> "FusedSparseMoeBlock":
        """Fuse a built (and usually loaded) stock MoE block.

        The router, shared expert, shared gate and ``down_proj`` modules are
        reused as they are; ``gate_proj`` and ``up_proj`` are concatenated
        into ``gate_up_proj``. The new block holds no reference to the two
        separate arrays: once the caller drops the stock block, they are freed.

        Args:
            stock_block (Qwen3NextSparseMoeBlock): the block to replace.
            use_kernel (bool): allow GPU expert kernels. Default True.
            compile_decode (bool): compile decode-sized calls. Default True.
            materialize (bool): evaluate the concatenation now, so the lazy
                graph stops pinning the separate arrays and peak memory grows
                by one layer's gate+up at most. Default True.
            name (str | None): the block's path in the model (e.g.
                ``"model.layers.3.mlp"``), used in error messages.
                Default: the class name.

        Returns:
            FusedSparseMoeBlock: same outputs, same ``sharding_group``.

        Raises:
            TypeError: if ``stock_block`` is not a ``Qwen3NextSparseMoeBlock``
                or its experts are not a ``SwitchGLU`` with ``SwiGLU``.
            ValueError: if gate_proj and up_proj are quantized differently
                (bits, group size, mode) or differ in shape or dtype.

        Example:
            >>> from types import SimpleNamespace
            >>> from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
            >>> args = SimpleNamespace(hidden_size=16, moe_intermediate_size=8,
            ...     shared_expert_intermediate_size=8, norm_topk_prob=True,
            ...     num_experts=4, num_experts_per_tok=2)
            >>> stock = Qwen3NextSparseMoeBlock(args)
            >>> fused = FusedSparseMoeBlock.from_stock(stock)
            >>> fused(mx.zeros((1, 3, 16))).shape
            (1, 3, 16)
        """
        if not isinstance(stock_block, Qwen3NextSparseMoeBlock):
            raise TypeError(
                f"expected Qwen3NextSparseMoeBlock, got {type(stock_block).__name__}"
            )
        sw = stock_block.switch_mlp
        where = f"{name or type(stock_block).__name__}.switch_mlp"
        if not isinstance(sw, SwitchGLU) or not isinstance(sw.activation, SwiGLU):
            raise TypeError(f"{where}: expected SwitchGLU with SwiGLU activation")
        gate_up = _concat_gate_up(sw.gate_proj, sw.up_proj, where)
        if materialize:
            mx.eval(gate_up.parameters())
        block = cls(
            stock_block.gate,
            FusedSwitchGLU(gate_up, sw.down_proj),
            stock_block.shared_expert,
            stock_block.shared_expert_gate,
            top_k=stock_block.top_k,
            norm_topk_prob=stock_block.norm_topk_prob,
            use_kernel=use_kernel,
            compile_decode=compile_decode,
        )
        block.sharding_group = stock_block.sharding_group
        block.train(stock_block.training)
        return block

    def to_stock(self) -> Qwen3NextSparseMoeBlock:
        """An equivalent stock block, with gate_up_proj split back.

        Use it to save checkpoints in the stock (mlx-community) layout.
        Other children are shared with this block, not copied.

        Returns:
            Qwen3NextSparseMoeBlock: same outputs and parameters
            (``switch_mlp.gate_proj`` / ``up_proj`` instead of ``gate_up_proj``).
        """
        gate_proj, up_proj = _split_gate_up(self.switch_mlp.gate_up_proj)
        # Assemble without __init__, which needs model args and draws
        # throwaway random weights.
        sw = SwitchGLU.__new__(SwitchGLU)
        nn.Module.__init__(sw)
        sw.gate_proj = gate_proj
        sw.up_proj = up_proj
        sw.down_proj = self.switch_mlp.down_proj
        sw.activation = SwiGLU()
        blk = Qwen3NextSparseMoeBlock.__new__(Qwen3NextSparseMoeBlock)
        nn.Module.__init__(blk)
        blk.norm_topk_prob = self.norm_topk_prob
        blk.num_experts = self.num_experts
        blk.top_k = self.top_k
        blk.gate = self.gate
        blk.switch_mlp = sw
        blk.shared_expert = self.shared_expert
        blk.shared_expert_gate = self.shared_expert_gate
        blk.sharding_group = self.sharding_group
        blk.train(self.training)
        return blk

    def shard(self, group: Optional[mx.distributed.Group] = None) -> None:
        """Tensor-parallel sharding in place, as mlx-lm's ``shard()`` does for stock.

        Experts and the shared expert are split along I; outputs are summed
        over ``group`` in :meth:`__call__`. ``gate_up_proj`` is sharded as two
        segments so each rank keeps matching gate and up rows.

        Args:
            group (mx.distributed.Group | None): default ``mx.distributed.init()``.
        """
        group = group or mx.distributed.init()
        self.sharding_group = group
        shard_inplace(self.shared_expert.gate_proj, "all-to-sharded", group=group)
        shard_inplace(self.shared_expert.down_proj, "sharded-to-all", group=group)
        shard_inplace(self.shared_expert.up_proj, "all-to-sharded", group=group)
        shard_inplace(
            self.switch_mlp.gate_up_proj, "all-to-sharded", segments=2, group=group
        )
        shard_inplace(self.switch_mlp.down_proj, "sharded-to-all", group=group)

    def concat_projections(self) -> bool:
        """Run the shared expert's ``gate_proj`` and ``up_proj`` as one matmul (``proj-concat``).

        Only for mlx-lm's SwiGLU MLP classes (``Qwen3NextMLP``, ``qwen3_5.MLP``:
        ``down_proj(swiglu(gate_proj(x), up_proj(x)))``); the children keep
        their names and hold row views of the one matrix (see
        :class:`~qwen_apple_backend.layers._concat.ConcatProjection`). The
        router is left alone so routing stays bit-identical to stock.

        Returns:
            bool: False (nothing changed) for another shared-expert class or
            when the two projections differ in type, quantization or dtype.
        """
        cat = None
        if type(self.shared_expert) in _SWIGLU_MLPS:
            cat = ConcatProjection.build(self.shared_expert, ("gate_proj", "up_proj"))
        object.__setattr__(self, "_shared_cat", cat)
        return cat is not None

    def _use_cat(self) -> bool:
        cat = getattr(self, "_shared_cat", None)
        return (cat is not None and type(self.shared_expert) in _SWIGLU_MLPS
                and cat.valid(self.shared_expert))

    def _shared(self, x: mx.array, use_cat: bool) -> mx.array:
        if use_cat:
            g, u = self._shared_cat(x)
            return self.shared_expert.down_proj(swiglu(g, u))
        return self.shared_expert(x)

    def _shared_weights(self) -> Optional[SharedExpertWeights]:
        """The shared expert and its gate as arrays, or None when they are not plain linears."""
        se = self.shared_expert
        if type(se) not in _SWIGLU_MLPS:
            return None
        parts = [linear_weights(m) for m in (getattr(se, "gate_proj", None),
                                             getattr(se, "up_proj", None),
                                             getattr(se, "down_proj", None),
                                             self.shared_expert_gate)]
        return None if any(p is None for p in parts) else SharedExpertWeights(*parts)

    def _fold_ready(self, x: mx.array) -> Optional[str]:
        """The backend whose decode kernels take the shared expert too, or None.

        Checks (and on first use self-checks) the fold kernels, else the
        routed-only decode kernels, so that neither check runs inside a trace.
        """
        gu = expert_weights(self.switch_mlp.gate_up_proj)
        dn = expert_weights(self.switch_mlp.down_proj)
        probe = mx.zeros((*x.shape[:-1], self.top_k), dtype=mx.uint32)
        shared = self._shared_weights()
        fold = None
        if shared is not None:
            fold = shared_decode_kernel_ready(x, probe, gu, dn, shared)
        if fold is None:
            decode_kernel_ready(x, probe, gu, dn)
        return fold

    def _router_ready(self, x: mx.array) -> Optional[str]:
        """The backend whose router kernel may route this call, or None.

        Checked (and on first use self-checked) for logits of ``x``'s dtype,
        which is what the gate returns for every mlx-lm checkpoint layout
        (plain or quantized weights of the activations' dtype); ``_forward``
        routes the portable way when the logits turn out otherwise.
        """
        return router_kernel_ready(_logits_stand_in(x.dtype, self.num_experts), self.top_k,
                                   self.norm_topk_prob)

    def _weights_signature(self) -> tuple:
        """Identity, shape and dtype of every array the kernel choice depends on."""
        # Plain dict reads (an nn.Module is a dict of its children and
        # arrays): this runs on every call, and Module.__getattr__ would
        # double its cost.
        get = dict.get
        sm, se = get(self, "switch_mlp", {}), get(self, "shared_expert", {})
        sig = []
        for m in (get(self, "gate"), get(sm, "gate_up_proj"), get(sm, "down_proj"),
                  get(self, "shared_expert_gate"), get(se, "gate_proj"), get(se, "up_proj"),
                  get(se, "down_proj")):
            if not isinstance(m, dict):
                sig.append(type(m))
                continue
            for name in ("weight", "scales"):
                a = get(m, name)
                sig.append(None if a is None else (id(a), a.shape, a.dtype))
            sig.append(type(m))
        return tuple(sig)

    def _kernel_choice(self, x: mx.array, decode: bool, norm: Optional[nn.Module] = None,
                       next_norm: Optional[nn.Module] = None,
                       out_proj: Optional[OutProjection] = None,
                       next_proj: Optional[NextProjection] = None,
                       gdn_step: Optional[GatedDeltaStep] = None,
                       pack: Optional["BlockPack"] = None) -> tuple:
        """``(router, fold, route, down_norm, block)`` backends for this call.

        ``router`` and ``fold``: see :meth:`_router_ready` and
        :meth:`_fold_ready`; ``route``: the backend of the fused residual
        add, norm and route (:func:`~qwen_apple_backend.ops.moe.add_norm_route_ready`)
        for a decode call given the layer's post-attention ``norm`` when the
        fold is ready too (the two kernels that follow it), else None;
        ``down_norm``: the backend of the fold's down kernel with the next
        layer's input norm ``next_norm`` in its epilogue
        (:func:`~qwen_apple_backend.ops.moe.shared_decode_norm_ready`), when
        ``route`` is ready, else None; ``block``: the backend of the one-launch
        MoE half (:func:`~qwen_apple_backend.ops.moe.decode_block_ready`, the
        ``moe-block`` optimization) when ``route`` is ready, ``one_launch`` is
        set and no ``down_norm`` applies, else None; with ``out_proj`` /
        ``next_proj``, the backend of that launch's build with the
        out-projection / next-projection phase; with ``gdn_step`` (and
        ``out_proj``, whose ``x`` is then None), of its build with the Gated
        DeltaNet phase; with ``pack``, of the packed build
        (``decode_block_ready(..., pack=pack.cat["pk"])``: the router, the
        shared expert and the routed experts read from that pack).

        Decode is bound by the host, and building the weight descriptions
        for the readiness checks cost more Python than the rest of the
        block's call. The answer depends only on the call's shape class, the
        kernel switches in the environment and the weights' identity, shape
        and dtype, so it is kept per module under that key (at most 64
        entries) and recomputed when a weight array is replaced.
        """
        def norm_key(m):
            if m is None:
                return None
            w = dict.get(m, "weight")
            return (None if w is None else (id(w), w.shape, w.dtype), m.eps)

        nkey, next_key = norm_key(norm), norm_key(next_norm)
        okey = None
        if out_proj is not None:
            ow = out_proj.weights
            ox = out_proj.x
            okey = (None if ox is None else (ox.shape, ox.dtype), id(ow.weight), ow.weight.shape,
                    id(ow.scales), id(ow.biases), ow.scales.dtype, ow.group_size, ow.bits)
        gkey = None
        if gdn_step is not None:
            g = gdn_step
            gkey = (tuple(g.heads), g.proj.shape, g.conv_state.shape, g.state.shape,
                    g.proj.dtype, g.conv_state.dtype, g.state.dtype, float(g.eps)) + tuple(
                        None if a is None else (id(a), a.shape, a.dtype)
                        for a in (g.conv_w, g.conv_b, g.A_log, g.dt_bias, g.norm_weight))
        pkey = None
        if next_proj is not None:
            pw = next_proj.weights
            nw = next_proj.norm_weight
            pkey = ((id(nw), nw.shape, nw.dtype, next_proj.eps), id(pw.weight), pw.weight.shape,
                    id(pw.scales), id(pw.biases), pw.scales.dtype, pw.group_size, pw.bits)
        overrides = self._block_overrides()
        key = (x.shape, x.dtype, decode, envs.kernels_disabled(),
               envs.unverified_kernels_allowed(), self._weights_signature(), nkey, next_key,
               self.one_launch, tuple(overrides.items()),
               bool(self._l2_prefetch_arrays()), okey, pkey) + (
                   (gkey,) if gkey is not None else ()) + (
                   (("pack",),) if pack is not None else ())
        cache = self.__dict__.get("_choices")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_choices", cache)
        hit = cache.get(key)
        if hit is None:
            router = self._router_ready(x)
            fold = self._fold_ready(x) if decode else None
            route = down_norm = block = None
            if fold is not None and nkey is not None and nkey[0] is not None:
                route = add_norm_route_ready(x, norm["weight"], norm.eps, linear_weights(self.gate),
                                             self.top_k, self.norm_topk_prob)
            if route is not None and next_key is not None and next_key[0] is not None:
                probe = mx.zeros((*x.shape[:-1], self.top_k), dtype=mx.uint32)
                down_norm = shared_decode_norm_ready(
                    x, probe, expert_weights(self.switch_mlp.gate_up_proj),
                    expert_weights(self.switch_mlp.down_proj), self._shared_weights(),
                    next_norm["weight"], next_norm.eps)
            if route is not None and down_norm is None and self.one_launch:
                block = decode_block_ready(
                    x, norm["weight"], norm.eps, linear_weights(self.gate), self.top_k,
                    self.norm_topk_prob, expert_weights(self.switch_mlp.gate_up_proj),
                    expert_weights(self.switch_mlp.down_proj), self._shared_weights(),
                    overrides=overrides,
                    prefetch=bool(self._l2_prefetch_arrays()), out_proj=out_proj,
                    next_proj=next_proj, **({"gdn_step": gdn_step} if gdn_step is not None
                                           else {}), **({"pack": pack.cat["pk"]}
                                                        if pack is not None else {}))
            hit = (router, fold, route, down_norm, block)
            if len(cache) >= 64:
                cache.clear()
            cache[key] = hit
        return hit

    def _forward(self, x: mx.array, residual: Optional[mx.array] = None, use_cat: bool = False,
                 fold: Optional[str] = None, router: Optional[str] = None) -> mx.array:
        logits = self.gate(x)
        if router is not None and logits.dtype != x.dtype:
            router = None  # not the dtype the router kernel was checked for
        inds, scores = topk_route(logits, self.top_k, self.norm_topk_prob, kernel=router)
        gate_up = expert_weights(self.switch_mlp.gate_up_proj)
        down = expert_weights(self.switch_mlp.down_proj)
        shared = self._shared_weights() if fold is not None else None
        if shared is not None:
            # Routed and shared experts and the shared gate: two kernels, the
            # residual added in the second one's epilogue.
            return moe_shared_experts_kernel(fold)(x, inds, scores, gate_up, down, shared,
                                                   residual=residual)
        y = moe_experts(
            x,
            inds,
            scores,
            gate_up,
            down,
            use_kernel=self.use_kernel and not self.training,
            dequant_gemm=self.dequant_gemm,
            shared=(self._shared(x, use_cat), self.shared_expert_gate(x)),
        )
        return y if residual is None else residual + y

    def _compiled_forward(self, use_cat: bool = False, fold: Optional[str] = None,
                          router: Optional[str] = None, residual: bool = False):
        fns = self.__dict__.setdefault("_compiled", {})
        key = (use_cat, fold, router, residual)
        fn = fns.get(key)
        if fn is None:
            # The module itself is the captured input tree, so parameters
            # replaced after fusing (load_weights, update) are read live;
            # one trace per shared-expert and routing path.
            fn = compile_watched(self, partial(self._forward, use_cat=use_cat, fold=fold,
                                               router=router))
            fns[key] = fn
        return fn

    def __call__(self, x: mx.array, residual: Optional[mx.array] = None) -> mx.array:
        """Routed experts plus the gated shared expert (plus ``residual`` when given).

        Decode-sized inputs (fewer than ``SORT_THRESHOLD`` token-expert rows)
        run as one shape-specialised compiled graph when ``compile_decode``
        is set and the block is in eval mode: graph building, not arithmetic,
        dominates there. Larger inputs run eagerly, so prompts of many
        different lengths do not each trigger a trace.

        Args:
            x (mx.array): hidden states.
            residual (mx.array | None): the decoder layer's residual stream.
                When given, returns ``residual + block(x)`` as the stock layer
                computes it; on the GPU decode path with the shared expert
                folded in, the sum happens in the last kernel's epilogue (one
                Add launch less per layer and token). Default None.

        Returns:
            mx.array: block output, dtype of ``x``.

        Shapes:
            x: ``[B, T, H]`` (any leading axes); residual: same; returns the same shape.
        """
        if self.sharding_group is not None:
            x = sum_gradients(self.sharding_group)(x)

        rows = (x.size // x.shape[-1]) * self.top_k
        fold = router = None
        if self.use_kernel and not self.training:
            # Decided here, outside mx.compile: the first call per shape class
            # self-checks the kernels, which evaluates arrays.
            router, fold, _, _, _ = self._kernel_choice(x, rows < SORT_THRESHOLD)
        # The residual goes inside only where nothing happens after the block
        # (no cross-rank sum) and it needs no broadcast or promotion.
        inner = residual if (residual is not None and self.sharding_group is None
                             and residual.shape == x.shape
                             and residual.dtype == x.dtype) else None
        use_cat = self._use_cat()
        # A pack (moe-block-pack) no longer valid (an array or module
        # replaced) is dropped here, so a prefill after load_weights does not
        # hold a copy of the old experts; the next decode call packs anew.
        pack = self.__dict__.get("_block_pack")
        if pack is not None and not pack.valid(self):
            self.__dict__.pop("_block_pack", None)
            pack = None
        if self.compile_decode and not self.training and rows < SORT_THRESHOLD:
            fn = self._compiled_forward(use_cat, fold, router, inner is not None)
            # A trace re-wraps the module's arrays in new objects: the pack
            # valid before the call is re-recorded after it, so a short prompt
            # of a new length does not make the next decode token pack the
            # experts again.
            y = fn(x) if inner is None else fn(x, inner)
            if use_cat:
                self._shared_cat.refresh()  # a trace re-wraps the module's arrays
            if pack is not None and not serial_decode_tracing():
                pack.refresh()
        else:
            y = self._forward(x, inner, use_cat=use_cat, fold=fold, router=router)

        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        if residual is not None and inner is None:
            y = residual + y
        return y

    def _block_overrides(self) -> dict:
        """The one-launch block's build overrides
        (:func:`~qwen_apple_backend.ops.moe.moe_decode_block`'s and
        :func:`~qwen_apple_backend.ops.moe.decode_block_ready`'s ``overrides``):
        each ``DECODE_BLOCK_OPTIONS`` flag that a switch of this block sets, to
        the value of the attribute that holds it (STAGE: ``stage_down``, EARLY:
        ``early_gate_up``, UNROLL: ``unroll_stage``, NPL: ``npl_items``, ROLL:
        ``roll_dots``, NPG: ``npg_grid``, RPL: ``preload_norm``, NPS: ``nps_mode``). The
        readiness and compiled calls' cache keys hold them (the kernel choice's
        as one element, its items). A new build switch's attribute needs only
        its entry here."""
        return {"STAGE": self.stage_down, "EARLY": self.early_gate_up,
                "UNROLL": self.unroll_stage, "NPL": self.npl_items, "ROLL": self.roll_dots,
                "NPG": self.npg_grid, "RPL": self.preload_norm, "NPS": self.nps_mode}

    def _l2_prefetch_arrays(self) -> tuple:
        """The arrays the one-launch block prefetches into L2 (``l2-prefetch``):
        :attr:`l2_next`'s concatenated weight, scales and biases, or () (no
        next projection, or not one quantized with biases)."""
        cat = self.l2_next
        if cat is None or not cat._quantized_with_biases():
            return ()
        c = cat.cat
        return (c["weight"], c["scales"], c["biases"])

    def _add_norm_route_forward(self, x: mx.array, r: mx.array, norm_weight: mx.array,
                                *extra: mx.array, eps: float,
                                route: str, fold: str, down_norm: Optional[str] = None,
                                next_eps: float = 0.0, counter: Optional[mx.array] = None,
                                block: Optional[str] = None, out_group: int = 0,
                                proj_group: int = 0, proj_eps: float = 0.0,
                                gdn: Optional[tuple] = None, pack: bool = False,
                                prefetch: int = 0):
        # extra: the next norm's weight (with down_norm); with out_group the
        # mixer's output projection (weight, scales, biases; r is then its
        # input); then with proj_group the next layer's input norm weight and
        # its mixer's concatenated projection (weight, scales, biases); then
        # with gdn = (heads, eps, has_bias) the Gated DeltaNet step's conv
        # state, conv weight (and bias), A_log, dt_bias, norm weight and state
        # (r is then its concatenated projection's row), then the prefetch
        # build's `prefetch` arrays (l2-prefetch), and last with pack
        # the BlockPack's array: arrays, so that a compiled call takes them as
        # inputs. With gdn it returns (out, conv state, state), or (out, po,
        # conv state, state) with proj_group.
        gate = linear_weights(self.gate)
        if block is not None:
            op = np_ = gs = pk = None
            pf: tuple = ()
            if pack:
                pk, extra = extra[-1], extra[:-1]
            if prefetch:
                pf, extra = tuple(extra[-prefetch:]), extra[:-prefetch]
            if gdn is not None:
                heads, geps, has_bias = gdn
                n = 7 if has_bias else 6
                tail, extra = extra[-n:], extra[:-n]
                cs, cw = tail[0], tail[1]
                cb = tail[2] if has_bias else None
                A_log, dt_bias, gnw, st = tail[-4:]
                gs = GatedDeltaStep(r, cs, cw, cb, A_log, dt_bias, gnw, geps, st, heads)
            if out_group:
                op = OutProjection(None if gs is not None else r,
                                   ExpertWeights(*extra[:3], group_size=out_group, bits=4))
                r, extra = None, extra[3:]
            if proj_group:
                np_ = NextProjection(extra[0], proj_eps,
                                     ExpertWeights(*extra[1:4], group_size=proj_group, bits=4))
            got = moe_decode_block(x, r, norm_weight, eps, gate, self.top_k,
                                   self.norm_topk_prob,
                                   expert_weights(self.switch_mlp.gate_up_proj),
                                   expert_weights(self.switch_mlp.down_proj),
                                   self._shared_weights(), block, counter=counter,
                                   overrides=self._block_overrides(),
                                   prefetch=pf, out_proj=op, next_proj=np_,
                                   **({"gdn_step": gs} if gs is not None else {}),
                                   **({"pack": pk} if pk is not None else {}))
            if gs is not None:
                out, po, ncs, nst = got
                return (out, ncs, nst) if po is None else (out, po, ncs, nst)
            return got
        h, y, _, inds, scores = add_norm_route(x, r, norm_weight, eps, gate, self.top_k,
                                               self.norm_topk_prob, backend=route,
                                               counter=counter)
        args = (y, inds, scores, expert_weights(self.switch_mlp.gate_up_proj),
                expert_weights(self.switch_mlp.down_proj), self._shared_weights())
        if down_norm is not None:
            return moe_shared_experts_norm_kernel(down_norm)(*args, h, extra[0], next_eps,
                                                             counter)
        return moe_shared_experts_kernel(fold)(*args, residual=h)

    def _block_pack_for(self, gdn: bool) -> Optional[BlockPack]:
        """This block's :class:`BlockPack` if valid, else None.

        Called inside the compiled decode step's trace (the packed builds run
        nowhere else) and in its eager check pass (``pack_check_pass``, where
        the packed builds' self-checks run). The step builds or rebuilds the
        packs before either (:meth:`prepare_block_pack`: a pack is never
        built inside a trace, whose arrays are tracers). None where the
        packed build does not exist for CUDA (verified, or
        ``QAB_UNVERIFIED_KERNELS``).
        """
        from qwen_apple_backend.ops.moe import _decode_block_pack_object

        pack = self.__dict__.get("_block_pack")
        if pack is None or not pack.valid(self) or _decode_block_pack_object("cuda", gdn) is None:
            return None
        return pack

    def _new_block_pack(self) -> Optional[BlockPack]:
        """Build this block's :class:`BlockPack` (or None) and keep it."""
        pack = BlockPack.build(self)
        object.__setattr__(self, "_block_pack", pack)
        return pack

    def prepare_block_pack(self) -> Optional[BlockPack]:
        """Make sure a decode step traced next can read a valid :class:`BlockPack`.

        The compiled decode step calls this before it traces (a pack is
        never built inside a trace, where the module's arrays are tracers):
        with ``block_pack`` and the one-launch block on, in eval mode, on
        CUDA where a packed build exists, it builds the pack, or builds it
        anew when an array or module it was made from was replaced.

        Returns:
            BlockPack | None: the pack, or None where none applies.
        """
        from qwen_apple_backend.ops import moe as moe_ops

        if (not (self.block_pack and self.one_launch and self.fused_route and self.use_kernel)
                or self.training or self.sharding_group is not None
                or moe_ops.gpu_backend() != "cuda"):
            return None
        if (moe_ops._decode_block_pack_object("cuda", False) is None
                and moe_ops._decode_block_pack_object("cuda", True) is None):
            return None
        pack = self.__dict__.get("_block_pack")
        return pack if pack is not None and pack.valid(self) else self._new_block_pack()

    def add_norm_forward(self, x: mx.array,
                         r: Union[mx.array, DeferredProjection, DeferredGatedDelta],
                         norm: nn.Module,
                         next_norm: Optional[nn.Module] = None,
                         next_layer: Optional[tuple] = None) -> Optional[tuple]:
        """``h + block(norm(h))`` with ``h = x + r``, in one or three launches, or None.

        The decoder layer's second half (``layers/norm.py``) for a decode
        token on CUDA: the residual add, the post-attention RMSNorm, the
        router GEMV and the route in one launch
        (:func:`~qwen_apple_backend.ops.moe.add_norm_route`, the ``moe-route``
        optimization), then the two expert kernels with the shared expert
        folded in and ``h`` added in the last one's epilogue: 3 launches
        where the stock layer runs about 20 and the unfused path 5; with
        ``one_launch`` (``moe-block``) all three as one
        (:func:`~qwen_apple_backend.ops.moe.moe_decode_block`, same output). Given the
        NEXT decoder layer's input norm, the last kernel also applies it to
        the output (:func:`~qwen_apple_backend.ops.moe.moe_shared_experts_norm_kernel`),
        so that layer's norm is no launch of its own. Given the mixer's output
        before its output projection (``r`` a
        :class:`~qwen_apple_backend.layers.linear.DeferredProjection`), the one
        launch computes the projection as its first phase when
        ``out_proj_phase`` is set and that build is ready
        (``moe-block-out-proj``), else the projection runs first, as the
        mixer would have run it. Given the next layer's input norm and mixer
        (``next_layer``) and with ``next_proj_phase`` set, the one launch also
        computes that mixer's concatenated 4-bit input projection of the
        normalised output as its last phase, when that build is ready
        (``moe-block-next-proj``). Returns None (the caller runs its usual
        path, applying a deferred ``r`` itself) when any part does not apply: training,
        ``fused_route`` or ``use_kernel`` off, a sharded block, a norm other
        than ``nn.RMSNorm``, a prefill-sized call, ``x`` and ``r`` of
        different shapes or dtypes, or a kernel that is not ready (see
        :meth:`_kernel_choice`). Decode-sized calls run as one compiled graph
        when ``compile_decode`` is set.

        Args:
            x (mx.array): the residual stream entering the layer.
            r (mx.array | DeferredProjection | DeferredGatedDelta): the
                mixer's output, or its output before the output projection,
                or (a Gated DeltaNet) its decode step not yet run: the one
                launch then runs the step as its first phase when
                ``gdn_phase`` is set and that build is ready
                (``moe-block-gdn``) and stores the mixer's new states, else
                the step runs first (its own launch; also when None is
                returned, the caller's ``apply`` runs it only once).
            norm (nn.Module): the layer's ``post_attention_layernorm``.
            next_norm (nn.Module | None): the next layer's ``input_layernorm``
                (an ``nn.RMSNorm``), or None.
            next_layer (tuple | None): ``(input_layernorm, mixer)`` of the
                next decoder layer, whose mixer has a concatenated input
                projection (``_proj_cat``) and ``takes_projected``; or None.
                Not used together with ``next_norm``.

        Returns:
            tuple | None: ``(out, out_next)``: the layer's output (shape and
            dtype of ``x``) and ``next_norm(out)``, or a
            :class:`~qwen_apple_backend.layers.linear.ProjectedInput` of
            ``next_layer``'s mixer, or None in its place when neither was
            applied.

        Shapes:
            x, r (an array), out, out_next (an array): ``[B, T, H]``; a
            DeferredProjection's ``x``: ``[B, T, DO]``; a ProjectedInput's
            ``y``: ``[B, T, N]``.
        """
        if (not self.fused_route or not self.use_kernel or self.training
                or self.sharding_group is not None or type(norm) is not nn.RMSNorm
                or x.ndim == 0 or (x.size // x.shape[-1]) * self.top_k >= SORT_THRESHOLD):
            return None
        if next_norm is not None and type(next_norm) is not nn.RMSNorm:
            next_norm = None
        np_ = None
        if next_layer is not None and next_norm is None and self.next_proj_phase \
                and self.one_launch:
            np_ = _next_projection(x, *next_layer)
        op = choice = gd = None
        if isinstance(r, DeferredGatedDelta):
            # The block with the Gated DeltaNet step as its first phase
            # (moe-block-gdn), with NP, else without; else the step runs first.
            ow = (linear_weights(r.proj)
                  if self.gdn_phase and self.out_proj_phase and self.one_launch else None)
            if ow is not None and gated_delta_step_supported(x, r.step, ow):
                gop = OutProjection(None, ow)
                choice = self._kernel_choice(x, True, norm, next_norm, gop, np_,
                                             gdn_step=r.step)
                if choice[4] is None and np_ is not None:
                    choice = self._kernel_choice(x, True, norm, next_norm, gop,
                                                 gdn_step=r.step)
                    if choice[4] is not None:
                        np_ = None
                if choice[4] is not None:
                    gd, op = r, gop
            if gd is None:
                choice = None
                r = r.deferred()  # the step in its own launch; its output unprojected
        if gd is None:
            if isinstance(r, DeferredProjection) and self.out_proj_phase and self.one_launch:
                # (linear_weights gives None for a module that is not a plain linear.)
                op = OutProjection(r.x, linear_weights(r.proj))
                if not out_projection_supported(x, op):
                    op = None
            if op is not None or np_ is not None:
                # The block with its projection phases, else without NP, else none.
                choice = self._kernel_choice(x, True, norm, next_norm, op, np_)
                if choice[4] is None and np_ is not None and op is not None:
                    np_ = None
                    choice = self._kernel_choice(x, True, norm, next_norm, op)
                if choice[4] is None:
                    choice = np_ = op = None
            if op is None:
                if isinstance(r, DeferredProjection):
                    # No one-launch block with the projection in it: project first.
                    r = r.apply()
                if r.shape != x.shape or r.dtype != x.dtype:
                    return None
        if choice is None:
            choice = self._kernel_choice(x, True, norm, next_norm)
        _, fold, route, down_norm, block = choice
        if route is None:
            return None
        pack = None
        serial = serial_decode_tracing()
        if block is not None and self.block_pack and (serial or pack_check_passing()):
            # The same build reading the router, shared expert and experts from one
            # packed copy (moe-block-pack), where that build is ready: inside the
            # compiled decode step only, whose launches never overlap (the
            # packed build keeps its workspace in a counter of this module's)
            # and which gives the Gated DeltaNet states private buffers (the
            # packed GD build writes them in place). Its self-check cannot run
            # inside the step's trace: the step's eager check pass
            # (pack_check_pass) runs it first, and a trace that meets an
            # unchecked shape class runs the unpacked build (PackCheckDue).
            pack = self._block_pack_for(gd is not None)
            if pack is not None:
                # (The arguments of the choice made above.)
                try:
                    pchoice = self._kernel_choice(
                        x, True, norm, next_norm, op, np_,
                        **({"gdn_step": gd.step} if gd is not None else {}), pack=pack)
                except PackCheckDue:
                    pchoice = (None,) * 5
                if pchoice[4] is None or not serial:
                    pack = None  # (the check pass: eager, unpacked)
        w = norm["weight"]
        # The counting kernels' counter input: in the compiled decode step's
        # trace (launches never overlap) this block's own buffer, read in
        # place; elsewhere a view that each launch copies (a copy kernel).
        # The one-launch block counts in a longer buffer (its phases' counters
        # before the route's per-row ones).
        rows = decode_block_counter_length() if block is not None else None
        if pack is not None:
            # The packed build's counter holds its workspace too (no output).
            rows = decode_block_pack_counter_length(
                x.size // x.shape[-1], x.shape[-1], self.gate.weight.shape[0], self.top_k,
                self.switch_mlp.gate_up_proj.weight.shape[1] // 2, x.dtype, op is not None,
                None if gd is None else gd.step)
        if serial:
            name = ("_serial_pack_counter" if pack is not None else
                    "_serial_block_counter" if block is not None else "_serial_counter")
            counter = self.__dict__.get(name)
            if counter is None or (rows is not None and counter.size < rows):
                counter = self.__dict__[name] = (serial_counter(rows) if rows
                                                 else serial_counter())
        else:
            counter = fold_norm_counter(rows) if rows else fold_norm_counter()
        kw = dict(eps=norm.eps, route=route, fold=fold, counter=counter, block=block)
        args = (x, r, w)
        if down_norm is not None:
            kw.update(down_norm=down_norm, next_eps=next_norm.eps)
            args = (x, r, w, next_norm["weight"])
        elif op is not None:
            # The projection's input (with gd: the step's projection row) in
            # r's place, its arrays as arguments.
            ow = op.weights
            kw.update(out_group=int(ow.group_size))
            args = (x, op.x if gd is None else gd.step.proj, w, ow.weight, ow.scales,
                    ow.biases)
        if np_ is not None:
            pw = np_.weights
            kw.update(proj_group=int(pw.group_size), proj_eps=float(np_.eps))
            args = args + (np_.norm_weight, pw.weight, pw.scales, pw.biases)
        gdn_key = None
        if gd is not None:
            g = gd.step
            gdn_key = kw["gdn"] = (tuple(int(v) for v in g.heads), float(g.eps),
                                   g.conv_b is not None)
            args = args + (g.conv_state, g.conv_w) + (() if g.conv_b is None else (g.conv_b,)) \
                + (g.A_log, g.dt_bias, g.norm_weight, g.state)
        # The arrays the prefetch build asks the L2 for (the next layer's
        # projection): arguments, since they live outside this module's tree
        # (a compiled call refuses arrays it did not capture).
        pf = self._l2_prefetch_arrays() if block is not None else ()
        if pf:
            kw["prefetch"] = len(pf)
            args = args + tuple(pf)
        if pack is not None:
            kw["pack"] = True
            args = args + (pack.cat["pk"],)
        if not self.compile_decode:
            fn = partial(self._add_norm_route_forward, **kw)
        else:
            fns = self.__dict__.setdefault("_compiled", {})
            key = ("add_norm_route", route, fold, norm.eps, down_norm,
                   None if down_norm is None else next_norm.eps, serial, block,
                   *(block is not None and v for v in self._block_overrides().values()),
                   bool(pf),
                   0 if op is None else int(op.weights.group_size),
                   None if np_ is None else (int(np_.weights.group_size), float(np_.eps)),
                   gdn_key, pack is not None)
            fn = fns.get(key)
            if fn is None:
                # The module is the captured input tree (parameters replaced
                # after fusing are read live); the norm weights are arguments,
                # the counter a constant of the graph.
                fn = compile_watched(self, partial(self._add_norm_route_forward, **kw))
                fns[key] = fn
        held = None
        if self.compile_decode:
            # A pack valid now stays valid: a trace of fn re-wraps the
            # module's arrays (the pack's views) in new objects. (Inside the
            # compiled decode step's trace, which skips the arrays' identity
            # while tracing, the step refreshes its packs again after.)
            held = self.__dict__.get("_block_pack")
            if held is not None and not held.valid(self):
                held = None
        out = fn(*args)
        if held is not None:
            held.refresh()
        if gd is not None:
            # The block ran the mixer's step: its new states go to its cache.
            out, po, ncs, nst = out if np_ is not None else (out[0], None, *out[1:])
            gd.commit(ncs, nst)
            return out, (None if po is None else ProjectedInput(po, next_layer[1]))
        if np_ is not None:
            out, po = out
            return out, ProjectedInput(po, next_layer[1])
        return tuple(out) if down_norm is not None else (out, None)
