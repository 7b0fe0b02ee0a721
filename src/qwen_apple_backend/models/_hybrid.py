"""Shared logic of the Qwen hybrid adapters (qwen3_5_moe, qwen3_5, qwen3_next).

Config fixes for loader gaps in stock mlx-lm, weight validation (run from the
model's ``sanitize``, where the unquantized module shapes are known), and the
module swap itself. This is not an adapter; each ``models/<model_type>.py``
builds on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..envs import FUSABLE_KINDS, OPTIMIZATIONS, enabled_opt_in
from ..errors import CheckpointError, FuseError, UnsupportedConfigError
from ..ops.device import gpu_backend
from ..ops.moe import NPS_MODE
from ..report import FuseReport, ModuleRecord
from .base import Adapter

LINEAR, FULL = "linear_attention", "full_attention"
VALID_LAYER_TYPES = (LINEAR, FULL)

#: Loader context (model path, raw config) for messages raised from sanitize().
_LOAD_CONTEXT: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "qab_load_context", default=None)


@contextlib.contextmanager
def load_context(**values):
    token = _LOAD_CONTEXT.set(values)
    try:
        yield
    finally:
        _LOAD_CONTEXT.reset(token)


def _where() -> str:
    ctx = _LOAD_CONTEXT.get() or {}
    path = ctx.get("model_path")
    return f"{path}: " if path else ""


def text_config_of(config: dict) -> tuple[dict, str]:
    """The text-model fields and the config path prefix used in messages."""
    tc = config.get("text_config")
    if isinstance(tc, dict):
        return tc, "text_config."
    return config, ""


def derive_full_attention_interval(tc: dict, prefix: str) -> Optional[int]:
    """Check ``layer_types`` and return the ``full_attention_interval`` it implies.

    mlx-lm builds layer ``i`` as full attention iff ``(i + 1) % interval == 0``;
    a saved config may carry only ``layer_types``.

    Returns:
        int | None: the interval, or None when the config has no ``layer_types``.

    Raises:
        UnsupportedConfigError: for an unknown layer type, a length that does not
            match ``num_hidden_layers``, or a pattern mlx-lm cannot express.
    """
    layer_types = tc.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list):
        raise UnsupportedConfigError(f"config.json: {prefix}layer_types must be a list")
    for i, t in enumerate(layer_types):
        if t not in VALID_LAYER_TYPES:
            raise UnsupportedConfigError(
                f"config.json: {prefix}layer_types[{i}] = {t!r} is not a supported layer type "
                f"(expected one of {list(VALID_LAYER_TYPES)})")
    n = tc.get("num_hidden_layers")
    if n is not None and len(layer_types) != n:
        raise UnsupportedConfigError(
            f"config.json: {prefix}layer_types has {len(layer_types)} entries but "
            f"{prefix}num_hidden_layers is {n}")
    if FULL not in layer_types:
        raise UnsupportedConfigError(
            f"config.json: {prefix}layer_types has no 'full_attention' layer; mlx-lm's Qwen "
            "hybrid models need at least one")
    interval = layer_types.index(FULL) + 1
    for i, t in enumerate(layer_types):
        if (t == FULL) != ((i + 1) % interval == 0):
            raise UnsupportedConfigError(
                f"config.json: {prefix}layer_types[{i}] = {t!r} breaks the periodic pattern "
                f"(full attention every {interval} layers) that mlx-lm's "
                "full_attention_interval can express")
    declared = tc.get("full_attention_interval")
    if declared is not None and declared != interval:
        raise UnsupportedConfigError(
            f"config.json: {prefix}full_attention_interval = {declared} contradicts "
            f"{prefix}layer_types (full attention every {interval} layers)")
    return interval


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def stack_per_expert_weights(weights: dict, num_experts: int) -> dict:
    """Stack per-expert HF keys into the fused published layout.

    transformers ``save_pretrained`` of a freshly built model writes
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the published checkpoints
    and mlx-lm's sanitize use ``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I].

    Raises:
        CheckpointError: if an expert index is missing or out of range.
    """
    groups: dict[str, dict[str, dict[int, mx.array]]] = {}
    rest = {}
    for k, v in weights.items():
        m = _PER_EXPERT.match(k)
        if m is None:
            rest[k] = v
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = v
    for prefix, projs in groups.items():
        for proj in ("gate", "up", "down"):
            got = projs.get(proj, {})
            missing = [e for e in range(num_experts) if e not in got]
            extra = sorted(e for e in got if e >= num_experts)
            if extra:
                raise CheckpointError(
                    f"{_where()}weight key {prefix}.experts.{extra[0]}.{proj}_proj.weight: "
                    f"expert index out of range for num_experts = {num_experts} (config.json)")
            if missing:
                raise CheckpointError(
                    f"{_where()}weight key {prefix}.experts.{missing[0]}.{proj}_proj.weight is "
                    f"missing ({len(missing)} of {num_experts} experts lack {proj}_proj)")
        gate_up = mx.stack([mx.concatenate([projs["gate"][e], projs["up"][e]], axis=0)
                            for e in range(num_experts)])
        down = mx.stack([projs["down"][e] for e in range(num_experts)])
        rest[f"{prefix}.experts.gate_up_proj"] = gate_up
        rest[f"{prefix}.experts.down_proj"] = down
    return rest


def check_expert_counts(weights: dict, num_experts: int) -> None:
    """Every expert tensor and router must agree with ``num_experts``.

    Raises:
        CheckpointError: naming the first key whose expert axis disagrees.
    """
    if not num_experts:
        return
    for k, v in weights.items():
        n = None
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")) or (
                ".switch_mlp." in k and k.endswith((".weight", ".scales", ".biases"))):
            n = v.shape[0]
        elif k.endswith("mlp.gate.weight"):
            n = v.shape[0]
        if n is not None and n != num_experts:
            raise CheckpointError(
                f"{_where()}weight key {k} has {n} experts (shape {tuple(v.shape)}) but "
                f"config.json num_experts = {num_experts}")


def check_quantization(model: nn.Module, weights: dict) -> None:
    """Each quantized weight must fit the module it loads into.

    Raises:
        CheckpointError: if a layer's input width is not a multiple of the
            group size its scales (or config.json ``quantization``) imply.
    """
    ctx = _LOAD_CONTEXT.get() or {}
    qcfg = (ctx.get("config") or {}).get("quantization") or {}
    modules = dict(model.named_modules())
    for key in weights:
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        module = modules.get(path)
        w = getattr(module, "weight", None) if module is not None else None
        if w is None:
            continue
        in_dims = w.shape[-1]
        groups = weights[key].shape[-1]
        per_layer = qcfg.get(path) if isinstance(qcfg.get(path), dict) else None
        gs = (per_layer or {}).get("group_size", qcfg.get("group_size"))
        if gs and in_dims % gs != 0:
            raise CheckpointError(
                f"{_where()}layer {path}: quantization group_size {gs} (config.json "
                f"'quantization') does not divide its input width {in_dims}")
        if in_dims % groups != 0 or (gs and per_layer and groups * gs != in_dims):
            raise CheckpointError(
                f"{_where()}weight key {key}: {groups} quantization groups do not fit layer "
                f"{path} of input width {in_dims}" + (f" with group_size {gs}" if gs else ""))


#: Key prefixes of the vision tower, which mlx-lm's Qwen3.5 ``sanitize`` drops (as it drops
#: the ``mtp.`` block's keys): their dtypes are never used.
_DROPPED_BY_SANITIZE = ("vision_tower", "model.visual")


def check_weight_dtypes(weights: dict) -> None:
    """Each weight's dtype must be one its layer can compute with, named before MLX meets it.

    Checked on the checkpoint's own keys (before ``sanitize`` renames, stacks or shifts
    them): the ``.weight`` of a quantized layer (one with ``.scales`` beside it) must be
    ``uint32`` (MLX's packed quantized values); ``.scales`` floating point or ``uint8``
    (the microscaling modes); every other tensor floating point. Without this an integer
    norm or projection loaded silently, and a float packed weight failed only at the first
    forward pass with MLX's ``[gather_qmm] The weight matrix should be uint32``. Skipped for
    a legacy Hugging Face ``quantization_config`` with a ``quant_method`` (GPTQ / AWQ /
    FP8 keep integer tensors that mlx-lm converts after ``sanitize``), and for the vision
    tower's and the MTP block's keys, which ``sanitize`` drops.

    Args:
        weights (dict[str, mx.array]): the checkpoint's tensors by key, as read from
            its safetensors files.

    Raises:
        CheckpointError: naming the file (when the loader gave the key -> file map),
            the key, its dtype and the dtype expected.
    """
    ctx = _LOAD_CONTEXT.get() or {}
    legacy = (ctx.get("config") or {}).get("quantization_config")
    if isinstance(legacy, dict) and "quant_method" in legacy:
        return
    files = ctx.get("weight_files") or {}
    for key, value in weights.items():
        dtype = getattr(value, "dtype", None)
        if dtype is None or key.startswith(_DROPPED_BY_SANITIZE) or "mtp." in key:
            continue  # tensors mlx-lm's sanitize drops unused
        base = key.rpartition(".")[0]
        if key.endswith(".weight") and f"{base}.scales" in weights:
            ok, expected = dtype == mx.uint32, "uint32 (the packed values of a quantized layer)"
        elif key.endswith(".scales"):
            ok = mx.issubdtype(dtype, mx.floating) or dtype == mx.uint8
            expected = "a floating-point dtype (or uint8)"
        else:
            ok, expected = mx.issubdtype(dtype, mx.floating), "a floating-point dtype"
        if not ok:
            where = _where()
            if key in files and ctx.get("model_path") is not None:
                where = f"{Path(ctx['model_path']) / files[key][0]}: "
            raise CheckpointError(f"{where}weight key {key} has dtype "
                                  f"{str(dtype).removeprefix('mlx.core.')}, expected {expected}")


def _cuda_only_end() -> str:
    """The end of a CUDA-only opt-in's report note: it says so where the device is not CUDA."""
    return ")" if gpu_backend() == "cuda" else "; no effect on this device, which is not CUDA)"


# What an opt-in switch needs, by name: l2-prefetch, the fused MoE block, the
# one-launch block (and what that needs) in its EARLY build, and the
# concatenated input projections whose arrays it prefetches. The report says
# when one of them is switched off.
_OPT_IN_NEEDS = {"l2-prefetch": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block",
                                 "moe-block-early", "proj-concat"),
                 # The attention step's two-level merge lives inside the step.
                 "attn-merge-split": ("attn", "attn-kernel", "qk-prep", "proj-concat",
                                      "kv-in-place", "decode-compile", "attn-step"),
                 # The early-staged next projection lives in the one-launch block's
                 # next-projection phase.
                 "moe-block-nps": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block",
                                   "moe-block-next-proj", "proj-concat", "norm-proj"),
                 # The route's preloads live in the one-launch block's route items.
                 "moe-block-rpl": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block")}
# Likewise for switches on by default that live inside the one-launch block.
_DEFAULT_NEEDS = {
    "moe-block-out-proj": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block"),
    "moe-block-next-proj": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block",
                            "proj-concat", "norm-proj"),
    # The Gated DeltaNet step ahead of the block's out-projection phase, on the
    # concatenated projection's row that the GDN decode kernel reads.
    "moe-block-gdn": ("moe", "gdn", "gdn-kernel", "moe-kernel", "moe-route", "add-norm",
                      "moe-block", "moe-block-out-proj", "proj-concat"),
    # The packed build of the one-launch block.
    "moe-block-pack": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block"),
    # The unrolled build of the one-launch block's projection phases.
    "moe-block-unroll": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block"),
    # The next-projection phase's blocks taking several items.
    "moe-block-npl": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block",
                      "moe-block-next-proj", "proj-concat", "norm-proj"),
    # The rolled dot loops of the one-launch block.
    "moe-block-roll": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block"),
    # The next-projection phase on the GPU's resident blocks, looping over its items.
    "moe-block-npg": ("moe", "moe-kernel", "moe-route", "add-norm", "moe-block",
                      "moe-block-next-proj", "proj-concat", "norm-proj", "moe-block-npl"),
    # The one-launch attention step replaces the q/k kernel, the KV write and the
    # kernel pair, inside the compiled decode step.
    "attn-step": ("attn", "attn-kernel", "qk-prep", "proj-concat", "kv-in-place",
                  "decode-compile"),
    # The step's tensor-core key pass lives inside the step.
    "attn-mma": ("attn", "attn-kernel", "qk-prep", "proj-concat", "kv-in-place",
                 "decode-compile", "attn-step"),
    # The step's spread merge lives inside the step.
    "attn-merge-spread": ("attn", "attn-kernel", "qk-prep", "proj-concat", "kv-in-place",
                          "decode-compile", "attn-step"),
    # The attention step from 64K keys: its tensor-core build.
    "attn-step-long": ("attn", "attn-kernel", "qk-prep", "proj-concat", "kv-in-place",
                       "decode-compile", "attn-step", "attn-mma"),
}


def _needs_off(needs, disable) -> str:
    """The end of an "is not used" note for a switch whose prerequisites ``needs``
    are partly in ``disable``, or "" when none is."""
    off = [n for n in needs if n in disable]
    return (f"it needs {' and '.join(off)}, which QAB_DISABLE / disable= switches off"
            if off else "")


def _link_l2_prefetch(model) -> None:
    """``l2-prefetch``: give each decoder layer's fused MoE block the next layer's
    concatenated input projection (Gated DeltaNet in_proj, attention q/k/v),
    whose arrays its one launch asks the L2 to fetch (the last layer's block
    has none: lm_head is far larger than the L2)."""
    from ..layers.moe import FusedSparseMoeBlock

    layers = list(getattr(model, "layers", ()))
    for layer, nxt in zip(layers, layers[1:]):
        mlp = layer.get("mlp") if isinstance(layer, dict) else None
        if not isinstance(mlp, FusedSparseMoeBlock):
            continue
        for name in ("linear_attn", "self_attn"):
            mixer = nxt.get(name) if isinstance(nxt, dict) else None
            cat = getattr(mixer, "_proj_cat", None) if mixer is not None else None
            if cat is not None:
                object.__setattr__(mlp, "l2_next", cat)
                break


class QwenHybridAdapter(Adapter):
    """Adapter for mlx-lm's Qwen hybrid (Gated DeltaNet + attention) models.

    Subclasses set :attr:`stock_module` (the ``mlx_lm.models`` module name)
    and provide :meth:`model_class`.
    """

    name = "qwen-fused"
    stock_module = ""
    text_model_types: dict[str, str] = {}
    #: Text-config fields without which mlx-lm would build the model from its own
    #: defaults (a different model than the weights): a missing one is an error.
    required_fields: tuple[str, ...] = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "linear_num_value_heads", "linear_num_key_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")

    #: Integer size fields the adapters read: each must be a positive int when present
    #: (a required one, ``head_dim``, ``full_attention_interval``) ...
    positive_int_fields: tuple[str, ...] = ("head_dim", "full_attention_interval")
    #: ... or, when this adapter does not require it, may also be 0 (a dense model's
    #: ``num_experts = 0``).
    count_fields: tuple[str, ...] = (
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
        "num_experts", "num_experts_per_tok")

    def check_field_values(self, config: dict) -> None:
        """Raise if an integer size field is not an int (bool is not) or not positive.

        Raises:
            CheckpointError: ``config.json: text_config.X must be a positive integer,
            got 'abc'``.
        """
        tc, prefix = text_config_of(config)
        positive = self.required_fields + self.positive_int_fields
        for field in dict.fromkeys(positive + self.count_fields):
            value = tc.get(field)
            if value is None:
                continue  # a missing required field is check_required_fields()'s error
            lowest = 1 if field in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                what = "a positive integer" if lowest else "a non-negative integer"
                raise CheckpointError(
                    f"config.json: {prefix}{field} must be {what}, got {value!r} (needed to "
                    f"build the {self.name} model)")
        experts, top_k = tc.get("num_experts"), tc.get("num_experts_per_tok")
        if isinstance(experts, int) and isinstance(top_k, int) and 0 < experts < top_k:
            # Top-k routing picks num_experts_per_tok of num_experts per token.
            raise CheckpointError(
                f"config.json: {prefix}num_experts_per_tok ({top_k}) must be at most "
                f"{prefix}num_experts ({experts}): each token is routed to that many of the "
                "experts")

    def check_required_fields(self, config: dict) -> None:
        """Raise if a field of :attr:`required_fields` is missing from the config.

        Raises:
            CheckpointError: ``config.json: missing required field 'text_config.X'``.
        """
        tc, prefix = text_config_of(config)
        missing = [f for f in self.required_fields if tc.get(f) is None]
        if missing:
            names = ", ".join(repr(prefix + f) for f in missing)
            raise CheckpointError(
                f"config.json: missing required field{'s' if len(missing) > 1 else ''} "
                f"{names} (needed to build the {self.name} model)")

    def prepare_config(self, config: dict, report: FuseReport) -> dict:
        self.check_required_fields(config)
        self.check_field_values(config)
        tc, prefix = text_config_of(config)
        interval = derive_full_attention_interval(tc, prefix)
        overrides: dict = {}
        if interval is not None and tc.get("full_attention_interval") is None:
            new_tc = dict(tc, full_attention_interval=interval)
            report.notes.append(
                f"derived {prefix}full_attention_interval = {interval} from {prefix}layer_types")
            if prefix:
                overrides["text_config"] = new_tc
            else:
                overrides["full_attention_interval"] = interval
        return overrides

    def stock_module_for(self, config: dict) -> str:
        return self.stock_module

    def get_model_classes(self, config: dict):
        model_cls = self.model_class(config)
        import importlib

        mod = importlib.import_module(f"mlx_lm.models.{self.stock_module_for(config)}")
        return model_cls, mod.ModelArgs

    def model_class(self, config: dict) -> type:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- fusing -------------------------------------------------------------
    def swaps(self) -> list[tuple[str, str, Callable[[Any], Optional[type]]]]:
        """(attribute, kind, stock-module -> fused class or None) for each layer."""
        from ..layers.attention import FusedGQAAttention
        from ..layers.gated_delta import FusedGatedDeltaNet, FusedQwen3NextGatedDeltaNet
        from ..layers.moe import FusedSparseMoeBlock

        def fused_gdn_class_for(m):
            from mlx_lm.models.qwen3_5 import GatedDeltaNet
            from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

            if isinstance(m, GatedDeltaNet):
                return FusedGatedDeltaNet
            if isinstance(m, Qwen3NextGatedDeltaNet):
                return FusedQwen3NextGatedDeltaNet
            return None

        def moe_cls(m):
            from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

            return FusedSparseMoeBlock if isinstance(m, Qwen3NextSparseMoeBlock) else None

        def attn_cls(m):
            from mlx_lm.models.qwen3_next import Qwen3NextAttention

            return FusedGQAAttention if isinstance(m, Qwen3NextAttention) else None

        return [("linear_attn", "gdn", fused_gdn_class_for),
                ("self_attn", "attn", attn_cls),
                ("mlp", "moe", moe_cls)]

    #: Report note for each optimization of a fused module kind switched off by
    #: ``QAB_DISABLE`` / ``disable=``: what runs instead.
    OFF_NOTES = {
        "attn-blocks": "a long prompt's attention runs as one call over all query rows, not "
                       "in blocks of query rows each evaluated before the next (attn-blocks "
                       "in QAB_DISABLE / disable=)",
        "attn-split": "decode attention over long KV caches runs as one fused SDPA call, not "
                      "with p v split over blocks of keys (attn-split in QAB_DISABLE / disable=)",
        "attn-kernel": "decode attention and its output gate run as MLX ops, not in the "
                       "split-K CUDA kernel pair (attn-kernel in QAB_DISABLE / disable=)",
        "qk-prep": "a decode token's q/k RMSNorm and RoPE run as four MLX ops, not one CUDA "
                   "or Metal launch (qk-prep in QAB_DISABLE / disable=)",
        "attn-step": "on CUDA a decode token's q/k preparation, KV cache write and attention "
                     "run as four launches, not one (attn-step in QAB_DISABLE / disable=)",
        "attn-mma": "on CUDA the one-launch attention step's pass over the cached keys runs "
                    "as the lane-group pass, not on tensor cores (attn-mma in QAB_DISABLE / "
                    "disable=)",
        "attn-merge-spread": "on CUDA the one-launch attention step's last key block per KV "
                             "head merges every key block, not G more thread blocks one query "
                             "head each (attn-merge-spread in QAB_DISABLE / disable=)",
        "attn-step-long": "on CUDA from 64K cached keys a decode token's attention runs as "
                          "four launches, not the one-launch attention step (attn-step-long "
                          "in QAB_DISABLE / disable=)",
        "gdn-kernel": "Gated DeltaNet scans and decode steps run as MLX ops, without the GPU "
                      "gated-delta kernels (gdn-kernel in QAB_DISABLE / disable=)",
        "moe-kernel": "MoE routing and experts run as MLX ops, without the GPU MoE kernels "
                      "for the router, decode GEMVs and grouped 4-bit GEMM (moe-kernel in "
                      "QAB_DISABLE / disable=)",
        "moe-route": "a decode token's residual add, post-attention RMSNorm, router and route "
                     "run as separate launches, not one CUDA launch ahead of the expert kernels "
                     "(moe-route in QAB_DISABLE / disable=)",
        "moe-block": "on CUDA a decode token's MoE layer half runs as three launches (route, "
                     "gate/up, down), not one (moe-block in QAB_DISABLE / disable=)",
        "moe-gemm": "quantized MoE experts' prefill runs MLX's gathered quantized matmul, not "
                    "dequantize-then-GEMM (moe-gemm in QAB_DISABLE / disable=)",
        "moe-block-stage": "on CUDA the one-launch MoE block's down items read the token's "
                           "gate/up activations from L2 chunk by chunk, not staged in shared "
                           "memory (moe-block-stage in QAB_DISABLE / disable=)",
        "moe-block-early": "on CUDA the one-launch MoE block's gate/up items wait for the route "
                           "and read its normed input, not stage it themselves (moe-block-early "
                           "in QAB_DISABLE / disable=)",
        "moe-block-out-proj": "on CUDA each mixer's output projection runs as its own launch, "
                              "not as the first phase of the one-launch MoE block "
                              "(moe-block-out-proj in QAB_DISABLE / disable=)",
        "moe-block-next-proj": "on CUDA each mixer runs its input RMSNorm and input projection "
                               "as its own launch, not the previous layer's one-launch MoE "
                               "block (moe-block-next-proj in QAB_DISABLE / disable=)",
        "moe-block-gdn": "on CUDA each Gated DeltaNet decode step runs as its own launch, not "
                         "as the first phase of the one-launch MoE block (moe-block-gdn in "
                         "QAB_DISABLE / disable=)",
        "moe-block-pack": "on CUDA the one-launch MoE block binds the router's, the shared "
                          "expert's and the routed experts' 21 arrays one by one, not one pack "
                          "(moe-block-pack in QAB_DISABLE / disable=)",
        "moe-block-unroll": "on CUDA the one-launch MoE block's projection phases stage their "
                            "input in a loop, not unrolled (moe-block-unroll in QAB_DISABLE / "
                            "disable=)",
        "moe-block-npl": "on CUDA each of the one-launch MoE block's next-projection items "
                         "starts its own block and stages its input itself (moe-block-npl in "
                         "QAB_DISABLE / disable=)",
        "moe-block-roll": "on CUDA the one-launch MoE block's dot loops are unrolled, not one "
                          "chunk's code in a loop (moe-block-roll in QAB_DISABLE / disable=)",
        "moe-block-npg": "on CUDA the one-launch MoE block's grid holds a block per "
                         "next-projection item, not the GPU's resident blocks looping over "
                         "them (moe-block-npg in QAB_DISABLE / disable=)",
    }

    def fuse(self, model, config, *, disable=frozenset(), use_fallback=True, report):
        names = {id(m): n for n, m in model.named_modules()}
        enabled = enabled_opt_in()
        # Opt-in (QAB_ENABLE=proj-gemv): less GPU time than MLX's qmv at the
        # concatenated projections' shapes, but 4K decode measured slower on the
        # H200 (234.2 vs 243.9 tok/s, same run): a custom launch costs the host
        # more, and 4K decode is host-bound.
        proj_gemv = "proj-gemv" in enabled and "proj-gemv" not in disable
        # Opt-in (QAB_ENABLE=gemv-pipe / attn-lanes): each measured faster on the
        # H200 in one bench run (4K: 333.6 with both vs 324.1 without gemv-pipe and
        # 322.0 without attn-lanes) and slower in two later runs on a noisier
        # machine (e.g. 147.9 vs 171.8 and 161.4), so off until that is resolved.
        pipe_on = "gemv-pipe" in enabled and "gemv-pipe" not in disable
        lanes_on = "attn-lanes" in enabled and "attn-lanes" not in disable
        # Opt-in (QAB_ENABLE=l2-prefetch): under ncu on the H200 the next layer's
        # norm + in_proj GEMV took 16.8 instead of 19.2 us but the block 32.4
        # instead of 30.2; 4K decode 211.7 vs 206.0 tok/s in one run.
        l2_on = "l2-prefetch" in enabled and "l2-prefetch" not in disable
        # Opt-in (QAB_ENABLE=attn-merge-split): verified on the H200, one 4K run
        # there 307.5 tok/s with it against 310.3 without (within its rounds'
        # spread); its kernel-level timing not yet measured.
        merge_on = "attn-merge-split" in enabled and "attn-merge-split" not in disable
        # Opt-in (QAB_ENABLE=moe-block-nps): the block's next-projection rows in
        # shared memory, copied early by a persistent grid's blocks; on the H200
        # 74.0 vs 71.0 us per Gated DeltaNet layer launch (profile_layer_gpu.py).
        nps_on = "moe-block-nps" in enabled and "moe-block-nps" not in disable
        # Opt-in (QAB_ENABLE=moe-block-rpl): the route items' residual row, norm
        # weight and eps loaded before their wait (RPL); H100, the rolled build's
        # warm timeline: its last phase ends at 55.0 vs 56.6 us.
        rpl_on = "moe-block-rpl" in enabled and "moe-block-rpl" not in disable
        switched_off: set[str] = set()  # optimizations off in at least one fused module
        for layer in model.layers:
            base = names.get(id(layer), "layers.?")
            for attr, kind, pick in self.swaps():
                if attr not in layer:
                    continue
                stock = layer[attr]
                path = f"{base}.{attr}"
                kind_here = kind
                fused_cls = pick(stock)
                if fused_cls is None:
                    if attr == "mlp":
                        kind_here = "mlp"
                    report.modules.append(ModuleRecord(
                        path, kind_here, type(stock).__name__, None,
                        "dense MLP (no fused version)" if attr == "mlp"
                        else f"{type(stock).__name__} has no fused version"))
                    continue
                if kind in disable:
                    report.modules.append(ModuleRecord(
                        path, kind, type(stock).__name__, None,
                        f"disabled ({kind} in QAB_DISABLE / disable=)"))
                    continue
                try:
                    fused = fused_cls.from_stock(stock)
                except Exception as exc:  # noqa: BLE001
                    reason = f"{type(exc).__name__}: {exc}"
                    if not use_fallback:
                        raise FuseError(f"cannot fuse {path} ({type(stock).__name__}) on "
                                        f"{mx.default_device()}: {reason}") from exc
                    report.modules.append(ModuleRecord(path, kind, type(stock).__name__, None, reason))
                    continue
                off = sorted(o for o, k in OPTIMIZATIONS.items() if k == kind and o in disable)
                if "gdn-kernel" in off:
                    fused.use_kernel = False
                if "moe-gemm" in off:
                    fused.dequant_gemm = False
                if "moe-kernel" in off:
                    fused.use_kernel = False
                if "moe-route" in off:
                    fused.fused_route = False
                if "moe-block" in off:
                    fused.one_launch = False
                if "moe-block-stage" in off:
                    # On by default: the block's down items stage the gate/up
                    # activations in shared memory (34.3 vs 43 us per launch under
                    # ncu on the H200, two runs; 4K decode 142.0 vs 133.5 tok/s,
                    # one run, same greedy ids).
                    fused.stage_down = False
                if "moe-block-early" in off:
                    # On by default: 29.5 vs 34.6 us per launch under ncu on the H200.
                    fused.early_gate_up = False
                if "moe-block-out-proj" in off:
                    # On by default: the mixer's output projection in the block's launch.
                    fused.out_proj_phase = False
                if "moe-block-next-proj" in off:
                    # On by default: the next layer's input norm + projection at
                    # the end of the block's launch (H200, 4K decode: 195.0 vs
                    # 190.1 and 155.4 vs 140.3 tok/s, same greedy ids).
                    fused.next_proj_phase = False
                if "moe-block-gdn" in off:
                    # On by default (its build verified on the H200): the
                    # Gated DeltaNet decode step in the block's launch.
                    fused.gdn_phase = False
                if "moe-block-pack" in off:
                    # On by default where its builds are ready (verified, or
                    # QAB_UNVERIFIED_KERNELS=1): the router, shared expert and
                    # routed experts as one packed input holding their weights.
                    fused.block_pack = False
                if "moe-block-unroll" in off:
                    # On by default: the block's out- and next-projection phases
                    # stage their input unrolled (H100: 77.4 vs 83.1 us per Gated
                    # DeltaNet layer launch, the same bits).
                    fused.unroll_stage = False
                if "moe-block-npl" in off:
                    # On by default: next-projection blocks take the next items
                    # too, reusing their staged input (H200: 73.7 vs 79.0 us per
                    # Gated DeltaNet layer launch, the same bits).
                    fused.npl_items = False
                if "moe-block-roll" in off:
                    # On by default: the block's dot loops rolled, two thirds of
                    # its code for the SMs' instruction caches (H100, 4K decode:
                    # 326.8 vs 305.0 tok/s, the same greedy ids).
                    fused.roll_dots = False
                if "moe-block-npg" in off:
                    # On by default: the next projection's items on the GPU's
                    # resident blocks (two per SM), looping, so no block starts
                    # only to find no ticket left (H100: 60.99 vs 61.78 us per
                    # Gated DeltaNet layer launch in a warm chain, the same bits).
                    fused.npg_grid = False
                if "attn-blocks" in off:
                    fused.block_queries = False
                if "attn-split" in off:
                    fused.split_keys = False
                if "attn-kernel" in off:
                    fused.decode_kernel = False
                if "qk-prep" in off:
                    fused.prep_kernel = False
                if "attn-step" in off:
                    fused.decode_step = False
                if "attn-mma" in off and hasattr(fused, "decode_mma"):
                    fused.decode_mma = False
                if merge_on and hasattr(fused, "decode_merge_split"):
                    fused.decode_merge_split = True
                if "attn-merge-spread" in off and hasattr(fused, "decode_merge_spread"):
                    fused.decode_merge_spread = False
                if "attn-step-long" in off and hasattr(fused, "decode_step_long"):
                    # On by default: the step from 64K cached keys too (H100, same
                    # run: 64K 230.1 vs 195.3 tok/s, 128K 225.9 vs 180.6, the same
                    # greedy ids).
                    fused.decode_step_long = False
                if nps_on and hasattr(fused, "nps_mode"):
                    fused.nps_mode = NPS_MODE
                if rpl_on and hasattr(fused, "preload_norm"):
                    fused.preload_norm = True
                if lanes_on and hasattr(fused, "decode_lanes"):
                    fused.decode_lanes = True
                switched_off.update(off)
                if "proj-concat" not in disable and hasattr(fused, "concat_projections"):
                    fused.concat_projections()
                    cat = getattr(fused, "_proj_cat", None)
                    if cat is not None:
                        cat.gemv = proj_gemv
                        cat.gemv_pipe = pipe_on
                setattr(layer, attr, fused)
                report.modules.append(ModuleRecord(
                    path, kind, type(stock).__name__, type(fused).__name__,
                    f"without {', '.join(off)} (QAB_DISABLE / disable=)" if off else ""))
        if l2_on:
            _link_l2_prefetch(model)
        report.notes.extend(note for o, note in self.OFF_NOTES.items() if o in switched_off)
        if "proj-concat" in disable:
            report.notes.append("input projections run separately (proj-concat in QAB_DISABLE / "
                                "disable=)")
        for name, what in (("gemv-pipe", "the concatenated input projections' GEMV launches "
                                         "run double-buffered passes"),
                           ("attn-lanes", "decode attention's first pass below 64K keys runs "
                                          "the lane-group kernel, several lanes per key"),
                           ("l2-prefetch", "the one-launch MoE block asks the L2 for the next "
                                           "layer's input projection while its route runs"),
                           ("attn-merge-split", "the one-launch attention step merges its key "
                                                "blocks in two levels, groups first"),
                           ("moe-block-nps", "the one-launch MoE block runs on a persistent grid "
                                             "whose blocks copy their next-projection rows into "
                                             "shared memory early"),
                           ("moe-block-rpl", "the one-launch MoE block's route items load the "
                                             "residual row, norm weight and eps before they "
                                             "wait")):
            if name not in enabled or not any(m.fused for m in report.modules):
                continue
            needs = _needs_off(_OPT_IN_NEEDS.get(name, ()), disable)
            unused = f"{name} from QAB_ENABLE is not used: "
            if needs:
                note = unused + needs
            elif name in disable:
                note = unused + "also in QAB_DISABLE / disable=, which wins"
            elif (name in ("l2-prefetch", "moe-block-nps", "moe-block-rpl")
                  and "next-norm" in enabled
                  and "next-norm" not in disable):
                # next-norm's kernels take the one-launch block's place.
                note = unused + "next-norm, also from QAB_ENABLE, replaces the one-launch MoE block"
            else:
                note = f"on CUDA {what} ({name} from QAB_ENABLE" + _cuda_only_end()
            report.notes.append(note)
        if any(m.fused for m in report.modules):
            # On-by-default phases of the one-launch block, and the attention
            # step, that another switch takes away: say so (their own
            # QAB_DISABLE has its OFF note). Not where a module kind they need
            # stays stock: the module table says so already.
            for name, needs in _DEFAULT_NEEDS.items():
                if name in disable or any(k in disable for k in FUSABLE_KINDS if k in needs):
                    continue
                off = _needs_off(needs, disable)
                unused = f"{name} is not used: "
                if off:
                    report.notes.append(unused + off)
                elif name in ("attn-step", "attn-mma", "attn-merge-spread", "attn-step-long"):
                    continue
                elif "next-norm" in enabled and "next-norm" not in disable:
                    report.notes.append(unused + "next-norm from QAB_ENABLE replaces the "
                                        "one-launch MoE block")
        if "proj-gemv" in enabled and "proj-concat" in disable:
            report.notes.append("proj-gemv from QAB_ENABLE is not used: it needs proj-concat "
                                "(in QAB_DISABLE / disable=)")
        elif "proj-gemv" in enabled:
            report.notes.append(
                "concatenated input projections on MLX's quantized matmul (proj-gemv from "
                "QAB_ENABLE, but also in QAB_DISABLE / disable=, which wins)"
                if "proj-gemv" in disable else
                "on CUDA a decode token's concatenated input projections run on the dense "
                "GEMV kernel (proj-gemv from QAB_ENABLE" + _cuda_only_end())
        if "gemv-kernel" in disable:
            report.notes.append("lm_head on MLX's quantized matmul (gemv-kernel in QAB_DISABLE / "
                                "disable=)")
        elif any(m.fused for m in report.modules):
            from ..layers.linear import install_gemv_lm_head

            install_gemv_lm_head(getattr(model, "language_model", model))
        if "embed-kernel" in disable:
            report.notes.append("the token embedding's decode lookups run as MLX's three gathers "
                                "and dequantize (embed-kernel in QAB_DISABLE / disable=)")
        elif any(m.fused for m in report.modules):
            from ..layers.linear import install_embedding_kernel

            install_embedding_kernel(getattr(model, "language_model", model))
        if "add-norm" in disable:
            report.notes.append("residual add and post-attention RMSNorm run as two MLX ops "
                                "(add-norm in QAB_DISABLE / disable=)")
            if "next-norm" in enabled:
                report.notes.append("next-norm from QAB_ENABLE is not used: it needs add-norm "
                                    "(in QAB_DISABLE / disable=)")
        elif any(m.fused for m in report.modules):
            from ..layers.norm import install_add_norm

            # Opt-in (QAB_ENABLE=next-norm): on the H200 it measured no faster
            # (4K, 8 rounds: 153.9 tok/s with it, 158.0 without).
            asked = "next-norm" in enabled
            # On the H200 its launch takes less GPU time than MLX's RMSNorm + qmv
            # (19.6 vs 21.2 us at in_proj) and saves a launch per layer; 4K decode
            # measured 221.1 tok/s with it, 193.9 without (same run).
            norm_proj = "norm-proj" not in disable
            install_add_norm(model, next_norm=asked and "next-norm" not in disable,
                             norm_proj=norm_proj)
            if not norm_proj:
                report.notes.append("each mixer runs its input RMSNorm as its own operation "
                                    "(norm-proj in QAB_DISABLE / disable=)")
            if asked and "next-norm" in disable:
                report.notes.append("each decoder layer runs its own input RMSNorm, not the "
                                    "previous MoE block's last decode kernel (next-norm in "
                                    "QAB_ENABLE, but also in QAB_DISABLE / disable=, which wins)")
            elif asked:
                report.notes.append("on CUDA a decode token's MoE down kernel also applies the "
                                    "next layer's input RMSNorm (next-norm from QAB_ENABLE; "
                                    "needs add-norm, moe-kernel and moe-route"
                                    + _cuda_only_end())
        const = "decode-const" in enabled and "decode-const" not in disable
        const_unused = ("decode-const from QAB_ENABLE is not used: it needs the compiled decode "
                        "step (decode-compile), which is off here")
        if "decode-compile" in disable:
            report.notes.append("compiled decode step off (decode-compile in QAB_DISABLE / disable=)")
            if const and any(m.fused for m in report.modules):
                report.notes.append(const_unused)
        elif not any(m.fused for m in report.modules):
            pass
        elif "decode-compile" not in enabled and gpu_backend() is None:
            # The CPU: off unless QAB_ENABLE=decode-compile (measured no faster).
            report.notes.append("one-token decode runs eagerly on the CPU (QAB_ENABLE="
                                "decode-compile compiles it; on by default on a GPU)")
            if const:
                report.notes.append(const_unused)
        else:
            from ..decode import install_compiled_decode

            in_place = "kv-in-place" not in disable
            # norm-proj also puts the final RMSNorm in lm_head's GEMV launch
            # (the gemv-kernel lm_head): one launch per token fewer.
            install_compiled_decode(getattr(model, "language_model", model), in_place=in_place,
                                    final_norm="norm-proj" not in disable, const=const)
            report.notes.append("one-token decode runs as a compiled step (decode-compile)")
            if const:
                report.notes.append("the compiled decode step holds the parameters as trace "
                                    "constants, checked by identity before every call; arrays "
                                    "changed in place are not seen (decode-const from "
                                    "QAB_ENABLE)")
            if not in_place:
                report.notes.append("the compiled decode step writes the KV cache with "
                                    "slice_update, a copy of the buffers per token, not in place "
                                    "(kv-in-place in QAB_DISABLE / disable=)")
        return None


def sanitize_checked(model: nn.Module, weights: dict, num_experts: int,
                     stock_sanitize: Callable[[dict], dict]) -> dict:
    """A model's ``sanitize`` with the loader gaps closed and shapes checked.

    Weight dtypes are checked first (:func:`check_weight_dtypes`); per-expert keys are
    stacked and expert counts checked before the stock
    sanitize (which renames keys, splits experts, shifts norms and transposes
    conv weights exactly once); quantized shapes are checked after it.
    """
    check_weight_dtypes(weights)
    if num_experts:
        weights = stack_per_expert_weights(weights, num_experts)
        check_expert_counts(weights, num_experts)
    weights = stock_sanitize(weights)
    check_quantization(model, weights)
    return weights


def iter_layers(model) -> Iterable:
    return model.layers
