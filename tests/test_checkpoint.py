"""Random-weight checkpoints: the published HF layout, the mlx-community 4-bit layout.

The session fixtures ``tiny_hf_f32``, ``tiny_hf_bf16`` and ``tiny_q4`` (conftest.py)
are tiny presets with a 1,024-row vocabulary; the tokenizer is the real one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from qwen_apple_backend.checkpoint import (
    LAYOUTS,
    PRESETS,
    build_random_model,
    hf_config,
    make_checkpoint,
)
from qwen_apple_backend.errors import CheckpointError, UnsupportedConfigError

SMALL_VOCAB = 1024
PROMPT = [[9, 419, 0, 220, 977, 621, 615, 16, 478, 220, 16, 283, 220, 17, 5, 1000]]


def _weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _read(path: Path, name: str) -> mx.array:
    return mx.load(str(path / _weight_map(path)[name]))[name]


def _all_tensors(path: Path) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for shard in sorted(path.glob("model*.safetensors")):
        tensors.update(mx.load(str(shard)))
    return tensors


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------- config


def test_preset_shapes_are_consistent() -> None:
    for preset in PRESETS:
        text = hf_config(preset)["text_config"]
        rope = text["rope_parameters"]
        assert sum(rope["mrope_section"]) == text["head_dim"] * rope["partial_rotary_factor"] / 2
        assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
        if preset != "full":
            # Every input width is a multiple of 64, so 4-bit group-64 applies everywhere.
            widths = [
                text["hidden_size"],
                text["num_attention_heads"] * text["head_dim"],
                text["linear_num_value_heads"] * text["linear_value_head_dim"],
                text["moe_intermediate_size"],
                text["shared_expert_intermediate_size"],
            ]
            assert all(w % 64 == 0 for w in widths), (preset, widths)


def test_full_preset_is_qwen3_6_35b_a3b() -> None:
    config = hf_config("full")
    text = config["text_config"]
    expected = {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "attn_output_gate": True,
        "norm_topk_prob": True,
        "full_attention_interval": 4,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    }
    assert {k: text[k] for k in expected} == expected
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert text["rope_parameters"]["rope_theta"] == 10_000_000
    assert [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"] == list(
        range(3, 40, 4)
    )
    assert config["vision_config"]["depth"] == 27


def test_hf_config_fields(tiny_hf_bf16: Path) -> None:
    config = json.loads((tiny_hf_bf16 / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5_moe"
    assert config["tie_word_embeddings"] is False
    assert (config["image_token_id"], config["video_token_id"]) == (248056, 248057)
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (248053, 248054)
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["vocab_size"] == SMALL_VOCAB
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["full_attention_interval"] == 4
    assert text["rope_parameters"] == {
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10_000_000,
        "rope_type": "default",
    }
    assert text["attn_output_gate"] is True
    assert config["vision_config"]["model_type"] == "qwen3_5_moe_vision"
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]
    generation = json.loads((tiny_hf_bf16 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248046, 248044]


# ---------------------------------------------------------------------- hf layout


def test_hf_file_set(tiny_hf_bf16: Path) -> None:
    names = sorted(p.name for p in tiny_hf_bf16.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert sorted(set(names) - set(shards)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # No hidden staging directories are left beside the checkpoint.
    assert [p.name for p in tiny_hf_bf16.parent.iterdir()] == [tiny_hf_bf16.name]


def test_hf_index_covers_every_key(tiny_hf_bf16: Path) -> None:
    index = json.loads((tiny_hf_bf16 / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded = mx.load(str(tiny_hf_bf16 / shard))
        assert loaded, f"{shard} is empty"
        assert all(index["weight_map"][k] == shard for k in loaded)
        tensors.update(loaded)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())


def test_hf_keys_and_shapes(tiny_hf_bf16: Path) -> None:
    tensors = _all_tensors(tiny_hf_bf16)
    text = hf_config("tiny", SMALL_VOCAB)["text_config"]
    h, e, i = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
    lm = "model.language_model"
    assert tensors[f"{lm}.embed_tokens.weight"].shape == (SMALL_VOCAB, h)
    assert tensors["lm_head.weight"].shape == (SMALL_VOCAB, h)
    for layer in range(text["num_hidden_layers"]):
        p = f"{lm}.layers.{layer}.mlp"
        assert tensors[f"{p}.experts.gate_up_proj"].shape == (e, 2 * i, h)
        assert tensors[f"{p}.experts.down_proj"].shape == (e, h, i)
        assert tensors[f"{p}.gate.weight"].shape == (e, h)
        assert tensors[f"{p}.shared_expert_gate.weight"].shape == (1, h)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"{p}.shared_expert.{proj}.weight" in tensors
    # Experts are fused only: no per-expert keys.
    assert not any(re.search(r"\.experts\.\d+\.", k) for k in tensors)

    gdn = f"{lm}.layers.0.linear_attn"
    conv_dim = 2 * 2 * 32 + 4 * 32
    assert tensors[f"{gdn}.conv1d.weight"].shape == (conv_dim, 1, 4)
    assert tensors[f"{gdn}.in_proj_qkv.weight"].shape == (conv_dim, h)
    assert tensors[f"{gdn}.in_proj_z.weight"].shape == (4 * 32, h)
    assert tensors[f"{gdn}.in_proj_b.weight"].shape == (4, h)
    assert tensors[f"{gdn}.in_proj_a.weight"].shape == (4, h)
    assert tensors[f"{gdn}.A_log"].dtype == mx.float32
    assert tensors[f"{gdn}.dt_bias"].dtype == mx.bfloat16
    a = np.exp(np.array(tensors[f"{gdn}.A_log"]))
    assert ((a >= 1) & (a <= 16)).all()

    attn = f"{lm}.layers.3.self_attn"
    assert tensors[f"{attn}.q_proj.weight"].shape == (2 * 4 * 64, h)  # query + output gate
    assert tensors[f"{attn}.k_proj.weight"].shape == (2 * 64, h)
    assert tensors[f"{attn}.q_norm.weight"].shape == (64,)
    assert f"{lm}.layers.3.linear_attn.conv1d.weight" not in tensors

    # Zero-centred RMSNorms (the model scales by 1 + w); the GDN gated norm is not.
    centred = np.array(tensors[f"{lm}.layers.0.input_layernorm.weight"].astype(mx.float32))
    gated = np.array(tensors[f"{gdn}.norm.weight"].astype(mx.float32))
    assert abs(centred.mean()) < 0.1 and abs(gated.mean() - 1) < 0.1

    assert any(k.startswith("mtp.layers.0.mlp.experts.gate_up_proj") for k in tensors)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"} <= set(tensors)
    assert "model.visual.patch_embed.proj.weight" in tensors
    assert any(k.startswith("model.visual.blocks.0.") for k in tensors)
    assert all(
        t.dtype == mx.bfloat16 for k, t in tensors.items() if not k.endswith("A_log")
    )


def test_hf_optional_parts_and_sharding(tmp_path: Path) -> None:
    out = make_checkpoint(
        tmp_path / "bare",
        vocab_size=SMALL_VOCAB,
        include_mtp=False,
        include_visual=False,
        num_shards=3,
        progress=False,
    )
    weight_map = _weight_map(out)
    assert len(set(weight_map.values())) == 3
    assert not any(k.startswith(("mtp.", "model.visual.")) for k in weight_map)


def test_hf_is_deterministic_by_seed(tmp_path: Path, tiny_hf_bf16: Path) -> None:
    again = make_checkpoint(tmp_path / "again", seed=0, vocab_size=SMALL_VOCAB, progress=False)
    for shard in sorted(tiny_hf_bf16.glob("model-*.safetensors")):
        assert (again / shard.name).read_bytes() == shard.read_bytes(), shard.name

    other = make_checkpoint(tmp_path / "other", seed=1, vocab_size=SMALL_VOCAB, progress=False)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert not mx.array_equal(_read(other, name), _read(tiny_hf_bf16, name)).item()
    # Each tensor depends only on (seed, name), not on which other tensors exist.
    name = "model.language_model.layers.1.linear_attn.in_proj_qkv.weight"
    bare = make_checkpoint(
        tmp_path / "bare",
        vocab_size=SMALL_VOCAB,
        include_mtp=False,
        include_visual=False,
        progress=False,
    )
    assert mx.array_equal(_read(bare, name), _read(tiny_hf_bf16, name)).item()


def test_hf_loads_in_stock_mlx_lm(tiny_hf_f32: Path) -> None:
    from mlx_lm.utils import load

    model, tokenizer = load(str(tiny_hf_f32))
    assert tokenizer.eos_token_id == 248046
    assert set(tokenizer.eos_token_ids) == {248046, 248044}
    logits = model(mx.array(PROMPT))
    assert logits.shape == (1, len(PROMPT[0]), SMALL_VOCAB)
    assert mx.isfinite(logits).all().item()
    # Weights scaled so activations stay O(1): logits neither vanish nor explode.
    assert 0.1 < mx.std(logits).item() < 10


def test_hf_bf16_loads_in_stock_mlx_lm(tiny_hf_bf16: Path) -> None:
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_hf_bf16)
    # mlx's CPU gather_mm (the unquantized MoE) runs in float32 only.
    model.set_dtype(mx.float32)
    assert mx.isfinite(model(mx.array(PROMPT))).all().item()


@pytest.mark.torch
def test_hf_matches_transformers(tiny_hf_f32: Path) -> None:
    """transformers loads every key (mtp.* is its documented ignore) and agrees with mlx-lm."""
    torch = pytest.importorskip("torch")
    import transformers
    from mlx_lm.utils import load_model

    model, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tiny_hf_f32, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert any(
        re.fullmatch(pattern, "mtp.fc.weight")
        for pattern in model._keys_to_ignore_on_load_unexpected or []
    )
    with torch.no_grad():
        reference = model(torch.tensor(PROMPT)).logits.numpy()

    mlx_model, _ = load_model(tiny_hf_f32)
    ours = np.array(mlx_model(mx.array(PROMPT)))
    # Measured: rel-L2 ~4e-7, identical argmax.
    assert _rel_l2(ours, reference) < 1e-4
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


# ----------------------------------------------------------------- mlx-q4 layout


def test_q4_layout(tiny_q4: Path) -> None:
    names = sorted(p.name for p in tiny_q4.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    tensors = _all_tensors(tiny_q4)
    p = "language_model.model.layers.0.mlp"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for part in ("weight", "scales", "biases"):
            assert f"{p}.switch_mlp.{proj}.{part}" in tensors
    assert not any(".experts." in k for k in tensors)
    assert not any(k.startswith(("mtp.", "model.visual", "vision_tower")) for k in tensors)
    assert tensors[f"{p}.switch_mlp.gate_proj.weight"].dtype == mx.uint32
    # 4-bit: 8 values per uint32; 8-bit router: 4 values per uint32.
    assert tensors[f"{p}.switch_mlp.gate_proj.weight"].shape == (8, 64, 64 // 8)
    assert tensors[f"{p}.gate.weight"].shape == (8, 64 // 4)
    assert tensors[f"{p}.shared_expert_gate.weight"].shape == (1, 64 // 4)
    # The conv stays float, in MLX's [C, K, 1] layout.
    assert tensors["language_model.model.layers.0.linear_attn.conv1d.weight"].shape == (256, 4, 1)


def test_q4_config(tiny_q4: Path) -> None:
    config = json.loads((tiny_q4 / "config.json").read_text())
    quant = config["quantization"]
    assert (quant["group_size"], quant["bits"], quant["mode"]) == (64, 4, "affine")
    assert config["quantization_config"] == quant
    for layer in range(4):
        for name in ("mlp.gate", "mlp.shared_expert_gate"):
            entry = quant[f"language_model.model.layers.{layer}.{name}"]
            assert (entry["bits"], entry["group_size"]) == (8, 64)
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text"


def test_q4_loads_in_stock_mlx_lm(tiny_q4: Path, tiny_hf_f32: Path) -> None:
    import mlx.nn as nn
    from mlx_lm.utils import load, load_model

    model, tokenizer = load(str(tiny_q4))
    assert tokenizer.eos_token_id == 248046
    layer = model.language_model.model.layers[0]
    assert isinstance(layer.mlp.gate, nn.QuantizedLinear) and layer.mlp.gate.bits == 8
    assert layer.mlp.switch_mlp.gate_proj.bits == 4
    logits = model(mx.array(PROMPT))
    assert mx.isfinite(logits).all().item()

    # Same seed as the float32 checkpoint: 4-bit logits stay close to it.
    reference, _ = load_model(tiny_hf_f32)
    a = np.array(logits.astype(mx.float32)).ravel()
    b = np.array(reference(mx.array(PROMPT))).ravel()
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert cosine > 0.9  # measured 0.98


# --------------------------------------------------------- build_random_model


def test_build_random_model_equals_hf_checkpoint(tiny_hf_f32: Path) -> None:
    """In memory, unquantized: the very weights the hf layout holds, after mlx-lm's sanitize."""
    from mlx_lm.utils import load_model

    with mx.stream(mx.cpu):
        model = build_random_model("tiny", quantize=False, dtype="float32", vocab_size=SMALL_VOCAB)
    loaded, _ = load_model(tiny_hf_f32)
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not mx.array_equal(ours[k], theirs[k]).item()] == []


def test_build_random_model_quantized_equals_q4(tiny_q4: Path) -> None:
    from mlx_lm.utils import load_model

    with mx.stream(mx.cpu):
        model = build_random_model("tiny", quantize=True, vocab_size=SMALL_VOCAB)
    loaded, _ = load_model(tiny_q4)
    ours, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not mx.array_equal(ours[k], theirs[k]).item()] == []
    # In eval mode throughout, as mlx-lm's loader leaves a model (the layers
    # the quantization made included).
    assert [n for n, m in model.named_modules() if m.training] == []
    assert [n for n, m in loaded.named_modules() if m.training] == []


def test_build_random_model_small() -> None:
    import mlx.nn as nn

    model = build_random_model("small", quantize=True, seed=3, vocab_size=SMALL_VOCAB)
    layers = model.language_model.model.layers
    assert len(layers) == 8 and layers[3].is_linear is False
    assert isinstance(layers[0].mlp.gate, nn.QuantizedLinear) and layers[0].mlp.gate.bits == 8
    assert layers[0].mlp.switch_mlp.down_proj.bits == 4
    assert model.language_model.model.layers[0].linear_attn.A_log.dtype == mx.float32
    logits = model(mx.array(PROMPT))
    assert logits.shape == (1, len(PROMPT[0]), SMALL_VOCAB)
    assert mx.isfinite(logits).all().item()


# --------------------------------------------------------------------- errors


def test_layouts_for_offers_full_only_quantized() -> None:
    from qwen_apple_backend.checkpoint import LAYOUTS, PRESETS, layouts_for

    assert layouts_for("full") == ("mlx-q4",)
    assert {p: layouts_for(p) for p in PRESETS if p != "full"} == {
        p: LAYOUTS for p in PRESETS if p != "full"}
    assert layouts_for("huge") == LAYOUTS  # make_checkpoint names the unknown preset


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"preset": "huge"}, CheckpointError, "unknown preset 'huge'"),
        ({"layout": "gguf"}, CheckpointError, "unknown layout 'gguf'"),
        ({"dtype": "int8"}, CheckpointError, "dtype must be one of"),
        ({"preset": "full", "layout": "hf"}, UnsupportedConfigError, "only written as layout='mlx-q4'"),
        ({"vocab_size": 0}, UnsupportedConfigError, "vocab_size must be positive"),
        ({"num_shards": 10_000}, CheckpointError, "num_shards=10000 exceeds"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, error: type, message: str) -> None:
    out = tmp_path / "ckpt"
    with pytest.raises(error, match=re.escape(message)):
        make_checkpoint(out, **{"vocab_size": SMALL_VOCAB, "progress": False, **kwargs})
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind


def test_errors_are_value_errors() -> None:
    assert issubclass(CheckpointError, ValueError)
    assert LAYOUTS == ("hf", "mlx-q4")
    with pytest.raises(CheckpointError, match="unknown preset"):
        build_random_model("nope")


def test_refuses_non_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty and does not look like a checkpoint"):
        make_checkpoint(out, vocab_size=SMALL_VOCAB, progress=False)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    file_target = tmp_path / "file"
    file_target.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        make_checkpoint(file_target, vocab_size=SMALL_VOCAB, progress=False)


def test_overwrite_replaces_checkpoint_files_only(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path / "ckpt", vocab_size=SMALL_VOCAB, num_shards=3, progress=False)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        make_checkpoint(out, vocab_size=SMALL_VOCAB, progress=False)

    make_checkpoint(out, vocab_size=SMALL_VOCAB, num_shards=2, seed=1, overwrite=True, progress=False)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(_weight_map(out).values()) == set(shards)
    assert (out / "notes.txt").read_text() == "mine"


def test_in_memory_q4_path_matches_hf_path(tmp_path: Path, tiny_q4: Path) -> None:
    """The path "full" takes (build in memory, save) writes the same files as HF -> mlx-lm."""
    from qwen_apple_backend.checkpoint import _write_mlx_q4_in_memory

    out = tmp_path / "in-memory"
    out.mkdir()
    with mx.stream(mx.cpu):
        _write_mlx_q4_in_memory(
            out, "tiny", seed=0, dtype=mx.bfloat16, vocab_size=SMALL_VOCAB, progress=False
        )
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tiny_q4.iterdir())
    for path in tiny_q4.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_unwritable_output_names_the_requested_path_not_the_staging_one(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [blocker / "ckpt"]  # parent is a file
    if Path("/proc/self").is_dir():
        cases.append(Path("/proc/qab-ckpt"))  # a directory nothing can be created in
    for out in cases:
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(out))}: cannot write the "
                                                  r"checkpoint there: ") as info:
            make_checkpoint(out, preset="tiny", vocab_size=64, progress=False)
        assert ".tmp" not in str(info.value)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "make-checkpoint",
                          str(blocker / "ckpt"), "--vocab-size", "64", "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.startswith(f"qab make-checkpoint: error: {blocker / 'ckpt'}: cannot "
                                 "write the checkpoint there: ") and ".tmp" not in out.stderr
