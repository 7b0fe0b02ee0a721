"""Random-weight checkpoints with the exact on-disk layout of Qwen3.6-35B-A3B.

Real Qwen3.6 weights cannot be downloaded everywhere this package is developed and
tested, but their *layout* is public. This module writes checkpoints that have it,
filled with seeded random weights and the real tokenizer, at three sizes
(:data:`PRESETS`) and in two layouts:

``"hf"``
    The published Hugging Face layout: ``config.json`` of a
    ``Qwen3_5MoeForConditionalGeneration`` (text fields under ``text_config``, a
    ``vision_config``), weights sharded into ``model-0000x-of-0000y.safetensors``
    with ``model.safetensors.index.json``, keys ``model.language_model.*`` with
    experts stored fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``), ``mtp.*`` and ``model.visual.*``.
    RMSNorm weights are zero-centred (the model scales by ``1 + w``) except the
    gated norm of the linear-attention block; ``conv1d.weight`` is ``[C, 1, K]``;
    ``A_log`` is stored in float32.

``"mlx-q4"``
    The mlx-community 4-bit layout, produced by mlx-lm itself: the HF checkpoint is
    loaded with ``mlx_lm.utils.load_model``, quantized with
    ``mlx_lm.utils.quantize_model`` (affine, group 64, 4 bits; the model's
    ``quant_predicate`` keeps the routers ``mlp.gate`` and ``shared_expert_gate`` at
    8 bits) and saved with ``save_model`` / ``save_config`` (experts split into
    ``switch_mlp.{gate,up,down}_proj``).

The ``"full"`` preset (35B parameters) is only written as ``"mlx-q4"``: it is built
in memory by :func:`build_random_model`, layer by layer, so peak memory stays near
the 4-bit size.

Weights are a pure function of ``(seed, tensor name)``: each tensor draws from its
own MLX random key, so a tensor's values do not depend on the preset's other
tensors or on ``include_mtp`` / ``include_visual``. Files are drawn on MLX's CPU
backend, so the same seed gives the same bytes whichever GPU is present.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import io
import json
import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import nullcontext, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .errors import CheckpointError, UnsupportedConfigError
from .tokenizer import TOKENIZER_FILES, added_token_ids, write_tokenizer

if TYPE_CHECKING:
    import mlx.nn as nn

__all__ = [
    "LAYOUTS",
    "PRESETS",
    "build_random_model",
    "hf_config",
    "layouts_for",
    "make_checkpoint",
]

logger = logging.getLogger(__name__)

#: Checkpoint layouts :func:`make_checkpoint` can write.
LAYOUTS = ("hf", "mlx-q4")

#: ``text_config`` fields shared by every preset: the published Qwen3.6-35B-A3B
#: values that do not set the model's size.
_TEXT_CONFIG_BASE: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 248320,
}

#: ``text_config`` overrides per preset. ``layer_types`` is derived from
#: ``full_attention_interval`` (3 linear-attention layers, then 1 full-attention
#: layer). Every input width is a multiple of 64 so 4-bit group-64 quantization
#: applies to every linear layer.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        # Sections sum to head_dim * partial_rotary_factor / 2 = 8.
        "rope_parameters": {"mrope_section": [3, 3, 2]},
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "rope_parameters": {"mrope_section": [6, 5, 5]},
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 32,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
    "full": {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"mrope_section": [11, 11, 10]},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
}

#: Presets too large to write unquantized; only ``layout="mlx-q4"`` is offered.
_QUANTIZED_ONLY = frozenset({"full"})


def layouts_for(preset: str) -> tuple[str, ...]:
    """The layouts ``make_checkpoint`` writes ``preset`` in, a subset of ``LAYOUTS``.

    ``"full"`` (35B parameters) is written only as ``"mlx-q4"``: any other layout would
    materialise every parameter unquantized. An unknown preset gets every layout here;
    ``make_checkpoint`` rejects it by name.
    """
    if preset in _QUANTIZED_ONLY:
        return ("mlx-q4",)
    return tuple(LAYOUTS)

#: The published vision tower settings (used by ``"full"``).
_VISION_CONFIG_FULL: dict[str, Any] = {
    "model_type": "qwen3_5_moe_vision",
    "deepstack_visual_indexes": [],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

#: A one-block vision tower for the scaled-down presets; a text backend ignores it,
#: but the keys must exist for the layout to be the published one.
_VISION_CONFIG_SMALL: dict[str, Any] = {
    **_VISION_CONFIG_FULL,
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "num_position_embeddings": 64,
}

#: Generation defaults written to ``generation_config.json``.
_GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
}

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

#: Files a checkpoint directory holds; ``overwrite=True`` replaces exactly these
#: (plus every ``model*.safetensors``) and leaves anything else alone.
_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    *TOKENIZER_FILES,
)

_SHARD_BYTES = 4 * 1024**3


# --------------------------------------------------------------------------- config


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-copy ``base`` with ``overrides`` applied; nested dicts merge one level."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **copy.deepcopy(value)}
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise CheckpointError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")


def _validate_text_config(cfg: dict[str, Any]) -> None:
    """Check the shape relations the Qwen3.5 MoE modules rely on.

    Raises:
        UnsupportedConfigError: naming the first inconsistent field.
    """

    def fail(message: str) -> None:
        raise UnsupportedConfigError(f"text_config: {message}")

    if cfg["vocab_size"] <= 0:
        fail(f"vocab_size must be positive, got {cfg['vocab_size']}")
    rope = cfg["rope_parameters"]
    rotary_half = cfg["head_dim"] * rope["partial_rotary_factor"] / 2
    if sum(rope["mrope_section"]) != rotary_half:
        fail(
            f"rope_parameters.mrope_section {rope['mrope_section']} sums to "
            f"{sum(rope['mrope_section'])}, but head_dim * partial_rotary_factor / 2 = "
            f"{rotary_half:g}"
        )
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        fail(
            f"num_attention_heads ({cfg['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({cfg['num_key_value_heads']})"
        )
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        fail(
            f"linear_num_value_heads ({cfg['linear_num_value_heads']}) must be a multiple "
            f"of linear_num_key_heads ({cfg['linear_num_key_heads']})"
        )
    if not 0 < cfg["num_experts_per_tok"] <= cfg["num_experts"]:
        fail(
            f"num_experts_per_tok ({cfg['num_experts_per_tok']}) must be in "
            f"1..num_experts ({cfg['num_experts']})"
        )
    layer_types = cfg["layer_types"]
    if len(layer_types) != cfg["num_hidden_layers"]:
        fail(
            f"layer_types has {len(layer_types)} entries for "
            f"{cfg['num_hidden_layers']} layers"
        )
    unknown = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if unknown:
        fail(f"unknown layer_types {unknown}")
    interval = cfg["full_attention_interval"]
    periodic = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    if layer_types != periodic:
        # mlx-lm rebuilds the layer pattern from full_attention_interval alone.
        fail(f"layer_types do not follow full_attention_interval={interval}")


def _text_config(preset: str, vocab_size: int | None) -> dict[str, Any]:
    _check_preset(preset)
    cfg = _merge(_TEXT_CONFIG_BASE, PRESETS[preset])
    if vocab_size is not None:
        cfg["vocab_size"] = int(vocab_size)
    interval = cfg["full_attention_interval"]
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    _validate_text_config(cfg)
    return dict(sorted(cfg.items()))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def hf_config(preset: str = "tiny", vocab_size: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a preset, in the published Qwen3.6-35B-A3B format.

    Args:
        preset (str): one of :data:`PRESETS`. Default: ``"tiny"``.
        vocab_size (int, optional): embedding rows instead of the real 248,320
            (small values make CPU tests fast; the tokenizer stays the real one).

    Returns:
        dict[str, Any]: top-level ``Qwen3_5MoeForConditionalGeneration`` config with
        ``text_config`` (``model_type: qwen3_5_moe_text``, ``layer_types``,
        ``rope_parameters`` …), ``vision_config`` and the vision token ids.

    Raises:
        CheckpointError: if ``preset`` is unknown.
        UnsupportedConfigError: if the resulting text config is inconsistent
            (for example a non-positive ``vocab_size``).

    Example:
        >>> cfg = hf_config("full")
        >>> cfg["text_config"]["hidden_size"], cfg["text_config"]["num_experts"]
        (2048, 256)
    """
    text = _text_config(preset, vocab_size)
    vision = copy.deepcopy(_VISION_CONFIG_FULL if preset == "full" else _VISION_CONFIG_SMALL)
    vision["out_hidden_size"] = text["hidden_size"]
    ids = added_token_ids()
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": dict(sorted(vision.items())),
    }
    if (version := _version("transformers")) is not None:
        config["transformers_version"] = version
    return dict(sorted(config.items()))


def _generation_config() -> dict[str, Any]:
    ids = added_token_ids()
    config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        **_GENERATION_DEFAULTS,
    }
    if (version := _version("transformers")) is not None:
        config["transformers_version"] = version
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------- tensor specs


@dataclass(frozen=True)
class _Spec:
    """One checkpoint tensor: ``mean + std * N(0, 1)``, or ``log U(1, 16)`` for ``A_log``."""

    name: str
    shape: tuple[int, ...]
    std: float = 0.0
    mean: float = 0.0
    a_log: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> _Spec:
    # 1/sqrt(fan_in) keeps each projection's output at the scale of its input.
    return _Spec(f"{name}.weight", (out_dim, in_dim), std=gain / math.sqrt(in_dim))


def _norm(name: str, dim: int) -> _Spec:
    # Zero-centred: the model multiplies by (1 + weight).
    return _Spec(f"{name}.weight", (dim,), std=0.05)


def _moe_specs(p: str, cfg: dict[str, Any], out_gain: float) -> list[_Spec]:
    h, e = cfg["hidden_size"], cfg["num_experts"]
    i, s = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    return [
        _linear(f"{p}.mlp.gate", e, h),
        _Spec(f"{p}.mlp.experts.gate_up_proj", (e, 2 * i, h), std=1 / math.sqrt(h)),
        _Spec(f"{p}.mlp.experts.down_proj", (e, h, i), std=out_gain / math.sqrt(i)),
        _linear(f"{p}.mlp.shared_expert.gate_proj", s, h),
        _linear(f"{p}.mlp.shared_expert.up_proj", s, h),
        _linear(f"{p}.mlp.shared_expert.down_proj", h, s, out_gain),
        _linear(f"{p}.mlp.shared_expert_gate", 1, h),
    ]


def _attention_specs(p: str, cfg: dict[str, Any], out_gain: float) -> list[_Spec]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return [
        # Query and output gate, interleaved per head: [q_0, g_0, q_1, g_1, ...].
        _linear(f"{p}.self_attn.q_proj", 2 * hq * d, h),
        _linear(f"{p}.self_attn.k_proj", hkv * d, h),
        _linear(f"{p}.self_attn.v_proj", hkv * d, h),
        _linear(f"{p}.self_attn.o_proj", h, hq * d, out_gain),
        _norm(f"{p}.self_attn.q_norm", d),
        _norm(f"{p}.self_attn.k_norm", d),
    ]


def _linear_attention_specs(p: str, cfg: dict[str, Any], out_gain: float) -> list[_Spec]:
    h = cfg["hidden_size"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kernel = cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    q = f"{p}.linear_attn"
    return [
        _linear(f"{q}.in_proj_qkv", conv_dim, h),
        _linear(f"{q}.in_proj_z", hv * dv, h),
        _linear(f"{q}.in_proj_b", hv, h),
        _linear(f"{q}.in_proj_a", hv, h),
        _Spec(f"{q}.conv1d.weight", (conv_dim, 1, kernel), std=1 / math.sqrt(kernel)),
        _Spec(f"{q}.dt_bias", (hv,), std=0.1, mean=1.0),
        _Spec(f"{q}.A_log", (hv,), a_log=True),
        # The gated norm multiplies by its weight directly (no 1 + w).
        _Spec(f"{q}.norm.weight", (dv,), std=0.05, mean=1.0),
        _linear(f"{q}.out_proj", h, hv * dv, out_gain),
    ]


def _decoder_layer_specs(
    p: str, cfg: dict[str, Any], layer_type: str, out_gain: float
) -> list[_Spec]:
    h = cfg["hidden_size"]
    if layer_type == "linear_attention":
        mixer = _linear_attention_specs(p, cfg, out_gain)
    else:
        mixer = _attention_specs(p, cfg, out_gain)
    return [
        _norm(f"{p}.input_layernorm", h),
        *mixer,
        _norm(f"{p}.post_attention_layernorm", h),
        *_moe_specs(p, cfg, out_gain),
    ]


def _mtp_specs(cfg: dict[str, Any], out_gain: float) -> list[_Spec]:
    h = cfg["hidden_size"]
    specs = [
        _linear("mtp.fc", h, 2 * h),
        _norm("mtp.pre_fc_norm_embedding", h),
        _norm("mtp.pre_fc_norm_hidden", h),
        _norm("mtp.norm", h),
    ]
    for i in range(cfg["mtp_num_hidden_layers"]):
        specs += _decoder_layer_specs(f"mtp.layers.{i}", cfg, "full_attention", out_gain)
    return specs


def _visual_specs(vision: dict[str, Any]) -> list[_Spec]:
    d, inter = vision["hidden_size"], vision["intermediate_size"]
    patch, temporal = vision["patch_size"], vision["temporal_patch_size"]
    merged = d * vision["spatial_merge_size"] ** 2
    v = "model.visual"

    def dense(name: str, out_dim: int, in_dim: int) -> list[_Spec]:
        return [_linear(name, out_dim, in_dim), _Spec(f"{name}.bias", (out_dim,), std=0.02)]

    def layer_norm(name: str, dim: int) -> list[_Spec]:
        return [
            _Spec(f"{name}.weight", (dim,), std=0.05, mean=1.0),
            _Spec(f"{name}.bias", (dim,), std=0.02),
        ]

    specs = [
        _Spec(
            f"{v}.patch_embed.proj.weight",
            (d, vision["in_channels"], temporal, patch, patch),
            std=0.02,
        ),
        _Spec(f"{v}.patch_embed.proj.bias", (d,), std=0.02),
        _Spec(f"{v}.pos_embed.weight", (vision["num_position_embeddings"], d), std=0.02),
    ]
    for i in range(vision["depth"]):
        b = f"{v}.blocks.{i}"
        specs += layer_norm(f"{b}.norm1", d)
        specs += layer_norm(f"{b}.norm2", d)
        specs += dense(f"{b}.attn.qkv", 3 * d, d)
        specs += dense(f"{b}.attn.proj", d, d)
        specs += dense(f"{b}.mlp.linear_fc1", inter, d)
        specs += dense(f"{b}.mlp.linear_fc2", d, inter)
    specs += layer_norm(f"{v}.merger.norm", d)
    specs += dense(f"{v}.merger.linear_fc1", merged, merged)
    specs += dense(f"{v}.merger.linear_fc2", vision["out_hidden_size"], merged)
    return specs


def _hf_specs(
    config: dict[str, Any], *, include_mtp: bool = True, include_visual: bool = True
) -> list[_Spec]:
    """Every tensor of the HF layout, in file order."""
    cfg = config["text_config"]
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    # Output projections are scaled down so the residual stream stays O(1) over
    # 2 * num_layers residual additions.
    out_gain = 1 / math.sqrt(2 * cfg["num_hidden_layers"])
    lm = "model.language_model"
    specs = [_Spec(f"{lm}.embed_tokens.weight", (vocab, h), std=1.0)]
    for i, layer_type in enumerate(cfg["layer_types"]):
        specs += _decoder_layer_specs(f"{lm}.layers.{i}", cfg, layer_type, out_gain)
    specs.append(_norm(f"{lm}.norm", h))
    if not cfg["tie_word_embeddings"]:
        specs.append(_linear("lm_head", vocab, h))
    if include_mtp:
        specs += _mtp_specs(cfg, out_gain)
    if include_visual:
        specs += _visual_specs(config["vision_config"])
    return specs


# -------------------------------------------------------------------------- sampling


def _tensor_key(seed: int, name: str) -> mx.array:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


def _sample(spec: _Spec, seed: int, dtype: mx.Dtype, device: mx.Device | None) -> mx.array:
    """Lazily draw one tensor; ``A_log`` stays float32 whatever ``dtype`` is."""
    with mx.stream(device) if device is not None else nullcontext():
        key = _tensor_key(seed, spec.name)
        if spec.a_log:
            return mx.log(mx.random.uniform(1.0, 16.0, spec.shape, key=key))
        x = mx.random.normal(spec.shape, key=key)
        if spec.std != 1.0:
            x = x * spec.std
        if spec.mean != 0.0:
            x = x + spec.mean
        return x.astype(dtype)


def gpu_available() -> bool:
    """Whether MLX has a GPU backend here (Metal or CUDA)."""
    try:
        if mx.metal.is_available():
            return True
    except Exception:  # noqa: BLE001 - a build without Metal
        pass
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def default_dtype(layout: str = "hf") -> str:
    """The float dtype ``dtype="auto"`` picks: one this machine can run.

    ``bfloat16`` (the published checkpoints' dtype) when MLX has a GPU backend, or
    for the 4-bit ``mlx-q4`` layout (MLX's quantized expert GEMM runs bfloat16 on
    the CPU too); ``float32`` for the unquantized ``hf`` layout on a CPU-only MLX,
    whose expert GEMM (``GatherMM``) supports only float32.
    """
    if layout == "mlx-q4" or gpu_available():
        return "bfloat16"
    return "float32"


def _as_dtype(dtype: str | mx.Dtype) -> mx.Dtype:
    if isinstance(dtype, mx.Dtype):
        if dtype not in _DTYPES.values():
            raise CheckpointError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise CheckpointError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


def _progress(iterable: Iterable[Any], enabled: bool, **kwargs: Any) -> Iterable[Any]:
    """Wrap ``iterable`` in a tqdm progress bar when ``enabled``."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


# ------------------------------------------------------------------------ hf writing


def _split_shards(specs: list[_Spec], sizes: list[int], num_shards: int) -> list[list[int]]:
    """Split spec indices, in order, into ``num_shards`` non-empty runs of similar bytes."""
    if num_shards > len(specs):
        raise CheckpointError(f"num_shards={num_shards} exceeds the {len(specs)} tensors")
    target = sum(sizes) / num_shards
    shards: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        shards_left = num_shards - len(shards)
        tensors_left = len(specs) - index
        if shards[-1] and shards_left > 0 and (filled >= target or tensors_left <= shards_left):
            shards.append([])
            filled = 0
        shards[-1].append(index)
        filled += size
    return shards


def _write_hf(
    out_dir: Path,
    config: dict[str, Any],
    *,
    seed: int,
    dtype: mx.Dtype,
    num_shards: int | None,
    include_mtp: bool,
    include_visual: bool,
    progress: bool,
) -> None:
    specs = _hf_specs(config, include_mtp=include_mtp, include_visual=include_visual)
    sizes = [s.numel * (4 if s.a_log else dtype.size) for s in specs]
    total = sum(sizes)
    if num_shards is None:
        num_shards = max(2, math.ceil(total / _SHARD_BYTES))
    elif num_shards < 1:
        raise CheckpointError(f"num_shards must be at least 1, got {num_shards}")
    shards = _split_shards(specs, sizes, num_shards)

    weight_map: dict[str, str] = {}
    numbered = _progress(
        list(enumerate(shards, start=1)), progress, desc="writing shards", unit="shard"
    )
    for number, indices in numbered:
        file_name = f"model-{number:05d}-of-{num_shards:05d}.safetensors"
        # Files are always drawn on the CPU so the bytes do not depend on the machine.
        tensors = {specs[i].name: _sample(specs[i], seed, dtype, mx.cpu) for i in indices}
        mx.eval(*tensors.values())
        mx.save_safetensors(str(out_dir / file_name), tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        del tensors

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out_dir / "model.safetensors.index.json", index)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config())
    write_tokenizer(out_dir)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ------------------------------------------------------------------ mlx-lm building


def _quantize(model: nn.Module, config: dict[str, Any]) -> dict[str, Any]:
    """Quantize with mlx-lm's own recipe; returns the config with ``quantization``."""
    from mlx_lm.utils import quantize_model

    # quantize_model prints a bits-per-weight line; keep it out of library output.
    with redirect_stdout(io.StringIO()) as captured:
        _, quantized_config = quantize_model(
            model,
            config,
            group_size=64,
            bits=4,
            mode="affine",
            quant_predicate=getattr(model, "quant_predicate", None),
        )
    logger.debug(captured.getvalue().strip())
    return quantized_config


def _module_groups(model: nn.Module) -> Iterator[nn.Module]:
    """The text model's modules in evaluation order: embedding, layers, norm, head."""
    text = model.language_model
    yield text.model.embed_tokens
    yield from text.model.layers
    yield text.model.norm
    if hasattr(text, "lm_head"):
        yield text.lm_head


def _random_model_and_config(
    preset: str,
    *,
    quantize: bool,
    seed: int,
    dtype: mx.Dtype,
    vocab_size: int | None,
    progress: bool,
) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`build_random_model`, also returning the (quantized) config to save."""
    from mlx_lm.models import qwen3_5_moe

    config = hf_config(preset, vocab_size)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    model.eval()

    # Everything below is lazy: the HF tensors, mlx-lm's own HF -> MLX conversion
    # (sanitize: split experts, move the conv axis, add 1 to the norms) and the
    # quantization only record a graph. Nothing is computed until the per-module
    # mx.eval calls, so at most one module's float weights exist at a time.
    specs = _hf_specs(config, include_mtp=False, include_visual=False)
    weights = model.sanitize({s.name: _sample(s, seed, dtype, None) for s in specs})
    model.load_weights(list(weights.items()), strict=True)
    del weights
    if quantize:
        config = _quantize(model, config)
        # The quantized layers are new modules (in training mode); mlx-lm's own
        # loader puts the whole model in eval mode after quantizing, as here.
        model.eval()

    groups = list(_module_groups(model))
    for module in _progress(groups, progress, desc=f"building {preset}", unit="module"):
        mx.eval(module.parameters())
    mx.eval(model.parameters())  # no-op unless a parameter lives outside the groups
    return model, config


def build_random_model(
    preset: str,
    quantize: bool = True,
    seed: int = 0,
    dtype: str | mx.Dtype = mx.bfloat16,
    *,
    vocab_size: int | None = None,
    progress: bool = False,
) -> nn.Module:
    """Build a stock mlx-lm Qwen3.5 MoE model with random weights, in memory.

    The weights are the HF-layout tensors :func:`make_checkpoint` would write for
    the same ``seed`` (drawn on the default device rather than the CPU, so on a GPU
    they may differ from the files in the last bits), converted by mlx-lm's own
    ``sanitize`` and, when ``quantize`` is true, quantized by mlx-lm's
    ``quantize_model`` exactly as ``layout="mlx-q4"`` does. Generation is lazy and
    evaluated module by module, so building ``"full"`` peaks near its 4-bit size
    (about 19 GB) plus one layer of float weights.

    Args:
        preset (str): one of :data:`PRESETS`.
        quantize (bool): 4-bit affine, group 64, routers at 8 bits. Default: ``True``.
        seed (int): random seed. Default: ``0``.
        dtype (str | mx.Dtype): float dtype of the weights (and of the quantization
            scales). ``A_log`` stays float32. Default: ``mx.bfloat16``.
        vocab_size (int, optional): embedding rows instead of the real 248,320.
        progress (bool): show a progress bar. Default: ``False``.

    Returns:
        nn.Module: an evaluated ``mlx_lm.models.qwen3_5_moe.Model``, in eval mode.

    Raises:
        CheckpointError: if ``preset`` or ``dtype`` is unknown.
        UnsupportedConfigError: if ``vocab_size`` is not positive.

    Example:
        >>> import mlx.core as mx
        >>> model = build_random_model("tiny", vocab_size=1024)
        >>> model(mx.array([[1, 2, 3]])).shape
        (1, 3, 1024)
    """
    model, _ = _random_model_and_config(
        preset,
        quantize=quantize,
        seed=seed,
        dtype=_as_dtype(dtype),
        vocab_size=vocab_size,
        progress=progress,
    )
    return model


def _write_mlx_q4_from_hf(out_dir: Path, hf_dir: Path) -> None:
    """Convert an HF checkpoint the way ``mlx_lm.convert -q`` does."""
    from mlx_lm.utils import load_model, save_config, save_model

    model, config = load_model(hf_dir)
    config = _quantize(model, config)
    save_model(out_dir, model, donate_model=True)
    save_config(config, config_path=out_dir / "config.json")
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy2(hf_dir / name, out_dir / name)


def _write_mlx_q4_in_memory(
    out_dir: Path,
    preset: str,
    *,
    seed: int,
    dtype: mx.Dtype,
    vocab_size: int | None,
    progress: bool,
) -> None:
    from mlx_lm.utils import save_config, save_model

    model, config = _random_model_and_config(
        preset, quantize=True, seed=seed, dtype=dtype, vocab_size=vocab_size, progress=progress
    )
    # Match what mlx_lm.utils.load_config reports for an HF checkpoint.
    config["eos_token_id"] = _generation_config()["eos_token_id"]
    save_model(out_dir, model, donate_model=True)
    save_config(config, config_path=out_dir / "config.json")
    _write_json(out_dir / "generation_config.json", _generation_config())
    write_tokenizer(out_dir)


# ---------------------------------------------------------------------- entry point


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors.index.json").is_file()
        or any(path.glob("model*.safetensors"))
    )


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is not a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        if _is_checkpoint(out_dir):
            raise CheckpointError(
                f"{out_dir} already holds a checkpoint; pass --overwrite (overwrite=True in Python) to replace it"
            )
        raise CheckpointError(
            f"{out_dir} is not empty and does not look like a checkpoint; refusing to "
            "write into it (pass --overwrite (overwrite=True in Python) to add the checkpoint "
            "files anyway)"
        )


def _install(staging: Path, out_dir: Path) -> None:
    """Move a finished checkpoint into ``out_dir``, replacing only checkpoint files."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    stale = [out_dir / name for name in _CHECKPOINT_FILES]
    stale += list(out_dir.glob("model*.safetensors"))
    for path in stale:
        if path.is_file() or path.is_symlink():
            path.unlink()
    for path in staging.iterdir():
        path.rename(out_dir / path.name)
    staging.rmdir()


def make_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    layout: str = "hf",
    seed: int = 0,
    dtype: str | mx.Dtype = "bfloat16",
    vocab_size: int | None = None,
    num_shards: int | None = None,
    include_mtp: bool = True,
    include_visual: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight checkpoint with the Qwen3.6-35B-A3B on-disk layout.

    Besides the weights and ``config.json`` the directory gets the real tokenizer
    (``tokenizer.json``, ``tokenizer_config.json``) and a ``generation_config.json``
    whose ``eos_token_id`` is ``[248046, 248044]``. The checkpoint is assembled in a
    sibling temporary directory and moved into place only when complete.

    Args:
        out_dir (str | Path): target directory; created if missing.
        preset (str): ``"tiny"``, ``"small"`` or ``"full"`` (see :data:`PRESETS`).
            Default: ``"tiny"``.
        layout (str): ``"hf"`` (published HF layout) or ``"mlx-q4"`` (mlx-community
            4-bit layout). ``"full"`` supports only ``"mlx-q4"``. Default: ``"hf"``.
        seed (int): random seed; the same seed gives byte-identical files.
            Default: ``0``.
        dtype (str | mx.Dtype): ``"bfloat16"``, ``"float16"`` or ``"float32"``: the
            stored float dtype (``A_log`` is always float32); ``"auto"`` picks
            :func:`default_dtype` (float32 for the ``"hf"`` layout on a CPU-only MLX,
            else bfloat16). Default: ``"bfloat16"``.
        vocab_size (int, optional): embedding rows instead of the real 248,320, for
            fast CPU tests; the tokenizer stays the real one. Default: ``None``.
        num_shards (int, optional): number of ``model-*.safetensors`` files of the
            ``"hf"`` layout. Default: ``None`` = at least 2, about 4 GiB each.
        include_mtp (bool): write the ``mtp.*`` tensors (``"hf"`` only; mlx-lm drops
            them). Default: ``True``.
        include_visual (bool): write the ``model.visual.*`` tensors (``"hf"`` only).
            Default: ``True``.
        progress (bool): show a tqdm progress bar. Default: ``True``.
        overwrite (bool): allow writing into a non-empty directory. Existing
            checkpoint files (config, tokenizer, every ``model*.safetensors``) are
            replaced; other files are left alone. Default: ``False``.

    Returns:
        Path: ``out_dir``.

    Raises:
        CheckpointError: if ``preset``, ``layout`` or ``dtype`` is unknown,
            ``num_shards`` is impossible, ``out_dir`` is a file or a non-empty
            directory and ``overwrite`` is false, or it cannot be written (the
            message names ``out_dir`` and the reason).
        UnsupportedConfigError: if ``preset="full"`` is asked for in the ``"hf"``
            layout (35B bfloat16 parameters), or ``vocab_size`` is not positive.

    Example:
        >>> from mlx_lm import load
        >>> path = make_checkpoint("qwen-tiny", preset="tiny", vocab_size=1024)
        >>> model, tokenizer = load(str(path))
    """
    out_dir = Path(out_dir)
    _check_preset(preset)
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)}")
    layouts = layouts_for(preset)
    if layout not in layouts:
        raise UnsupportedConfigError(
            f"preset {preset!r} is only written as "
            f"{' or '.join(f'layout={ok!r}' for ok in layouts)}: its {layout!r} layout "
            "would materialise every parameter unquantized"
        )
    if isinstance(dtype, str) and dtype == "auto":
        dtype = default_dtype(layout)
    mx_dtype = _as_dtype(dtype)
    config = hf_config(preset, vocab_size)  # validates vocab_size early
    _prepare_out_dir(out_dir, overwrite)
    # A sibling, so the final move is a rename; mkdir (unlike mkdtemp) honours the
    # umask, so the finished checkpoint gets ordinary permissions.
    staging = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        # Name the directory asked for, not the internal staging one.
        raise _write_error(out_dir, exc) from exc
    try:
        if layout == "hf":
            _write_hf(
                staging,
                config,
                seed=seed,
                dtype=mx_dtype,
                num_shards=num_shards,
                include_mtp=include_mtp,
                include_visual=include_visual,
                progress=progress,
            )
        elif preset in _QUANTIZED_ONLY:
            _write_mlx_q4_in_memory(
                staging,
                preset,
                seed=seed,
                dtype=mx_dtype,
                vocab_size=vocab_size,
                progress=progress,
            )
        else:
            hf_staging = tempfile.TemporaryDirectory(
                prefix=f".{out_dir.name}.hf.", dir=out_dir.parent
            )
            with hf_staging as hf:
                _write_hf(
                    Path(hf),
                    config,
                    seed=seed,
                    dtype=mx_dtype,
                    num_shards=num_shards,
                    include_mtp=False,
                    include_visual=False,
                    progress=progress,
                )
                _write_mlx_q4_from_hf(staging, Path(hf))
        _install(staging, out_dir)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _write_error(out_dir, exc) from exc
        raise
    return out_dir


def _write_error(out_dir: Path, exc: OSError) -> CheckpointError:
    """A CheckpointError naming the requested output directory (the OSError names the
    internal staging directory beside it)."""
    why = exc.strerror or str(exc)
    return CheckpointError(f"{out_dir}: cannot write the checkpoint there: {why}")
