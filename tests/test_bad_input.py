"""Bad input gets one clear error naming the file, key or field."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from qwen_apple_backend import load
from qwen_apple_backend.errors import (CheckpointError, MissingCheckpointFileError, PromptError,
                                       UnknownBackendError, UnsupportedConfigError)


@pytest.fixture
def hf_copy(tiny_hf_f32, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_f32, dst)
    return dst


@pytest.fixture
def q4_copy(tiny_q4, tmp_path):
    dst = tmp_path / "q4"
    shutil.copytree(tiny_q4, dst)
    return dst


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(MissingCheckpointFileError, match="checkpoint directory not found"):
        load(tmp_path / "nope")


def test_missing_config(hf_copy):
    (hf_copy / "config.json").unlink()
    with pytest.raises(MissingCheckpointFileError, match=r"config\.json not found"):
        load(hf_copy)


def test_invalid_config_json(hf_copy):
    (hf_copy / "config.json").write_text('{"model_type": "qwen3_5_moe",')
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON at line 1"):
        load(hf_copy)


def test_missing_safetensors_shard(hf_copy):
    shard = sorted(hf_copy.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(MissingCheckpointFileError, match=shard.name):
        load(hf_copy)


def test_no_weights_at_all(hf_copy):
    for f in hf_copy.glob("model*.safetensors*"):
        f.unlink()
    with pytest.raises(MissingCheckpointFileError, match="no model.*safetensors"):
        load(hf_copy)


def test_corrupt_safetensors_header(hf_copy):
    shard = sorted(hf_copy.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00garbage-not-json-at-all!!!!!!!!"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: not a valid safetensors file"):
        load(hf_copy)


def test_truncated_safetensors(hf_copy):
    shard = sorted(hf_copy.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor .* past the end of the file"):
        load(hf_copy)


def test_unknown_layer_type(hf_copy):
    _edit_config(hf_copy, lambda c: c["text_config"]["layer_types"].__setitem__(1, "sliding_window"))
    with pytest.raises(UnsupportedConfigError,
                       match=r"text_config\.layer_types\[1\] = 'sliding_window'"):
        load(hf_copy)


def test_layer_types_not_periodic(hf_copy):
    def fn(c):
        lt = c["text_config"]["layer_types"]
        lt[0], lt[3] = "full_attention", "linear_attention"
        lt[1] = "full_attention"
    _edit_config(hf_copy, fn)
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[\d\].*periodic pattern"):
        load(hf_copy)


def test_expert_count_mismatch(hf_copy):
    _edit_config(hf_copy, lambda c: c["text_config"].__setitem__("num_experts", 4))
    with pytest.raises(CheckpointError, match=r"weight key .*experts.* has 8 experts .*num_experts = 4"):
        load(hf_copy)


def test_quantization_group_size_does_not_divide(q4_copy):
    _edit_config(q4_copy, lambda c: c["quantization"].__setitem__("group_size", 48))
    with pytest.raises(CheckpointError, match=r"layer .*: quantization group_size 48 .* "
                                              r"does not divide its input width 64"):
        load(q4_copy)


def test_top_k_above_the_expert_count(hf_copy):
    # Routing 16 of 8 experts: named at load, not a traceback from the router kernel.
    _edit_config(hf_copy, lambda c: c["text_config"].__setitem__("num_experts_per_tok", 16))
    with pytest.raises(CheckpointError, match=r"config\.json: text_config\.num_experts_per_tok "
                                              r"\(16\) must be at most text_config\.num_experts "
                                              r"\(8\)"):
        load(hf_copy)


@pytest.mark.parametrize("edit,message", [
    (lambda q: [1, 2], r"quantization must be an object with group_size and bits, got list "
                       r"\[1, 2\]"),
    (lambda q: {k: v for k, v in q.items() if k != "group_size"},
     r"quantization\.group_size is missing"),
    (lambda q: {**q, "bits": "four"}, r"quantization\.bits must be a positive integer, got "
                                      r"'four'"),
    (lambda q: {**q, "group_size": 0}, r"quantization\.group_size must be a positive integer, "
                                       r"got 0"),
    (lambda q: {**q, "mode": 5}, r"quantization\.mode must be a string, got 5"),
    (lambda q: {**q, "language_model.model.layers.0.mlp.gate": "eight"},
     r"quantization\.language_model\.model\.layers\.0\.mlp\.gate \(a layer's entry\) must "
     r"be true, false or an object"),
    (lambda q: {**q, "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": -8}},
     r"quantization\.language_model\.model\.layers\.0\.mlp\.gate\.bits must be a positive "
     r"integer, got -8"),
], ids=["list", "no-group-size", "bits-text", "group-size-0", "mode-number", "layer-text",
        "layer-bits"])
def test_malformed_quantization_section_names_the_field(q4_copy, edit, message):
    # mlx-lm indexes config.json's quantization section unchecked (AttributeError,
    # KeyError 'group_size'): each mistake is named with the file, before any weight.
    _edit_config(q4_copy, lambda c: c.__setitem__("quantization", edit(c["quantization"])))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(q4_copy))}/config\.json: "
                                              + message):
        load(q4_copy)


def test_token_ids_past_the_embedding_are_a_prompt_error(hf_copy):
    # The tiny checkpoint holds 1,024 embedding rows and Qwen's full tokenizer (as a
    # `qab make-checkpoint --vocab-size` checkpoint does): an id past the last row is
    # named before the model runs (MLX's CPU gather crashed the process on one).
    import mlx_lm

    import qwen_apple_backend as qab

    qab.enable("fused")
    try:
        model, tok = mlx_lm.load(str(hf_copy))
        for prompt, bad in (([1, 2, 1024], 1024), (mx.array([5, 248045, 7]), 248045),
                            ([3, -1], -1)):
            with pytest.raises(PromptError, match=rf"^the prompt holds token id {bad}, outside "
                                                  r"the model's 1024 embedding rows \(config"
                                                  r"\.json vocab_size = 1024\)"):
                mlx_lm.generate(model, tok, prompt=prompt, max_tokens=2)
        # A text prompt: its chat template's ids are Qwen's (248,045 and up).
        with pytest.raises(PromptError, match="outside the model's 1024 embedding rows"):
            mlx_lm.generate(model, tok, prompt=tok.encode("<|im_start|>user"), max_tokens=2)
        assert isinstance(mlx_lm.generate(model, tok, prompt=[1, 2, 1023], max_tokens=2), str)
    finally:
        qab.disable()
    r = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate", "--model",
                        str(hf_copy), "--prompt", "hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(r"^qab generate: error: the prompt holds token id \d+, outside the model's "
                     r"1024 embedding rows", r.stderr, re.M), r.stderr


def test_unknown_backend(hf_copy):
    with pytest.raises(UnknownBackendError, match="unknown backend 'turbo'"):
        load(hf_copy, "turbo")


def test_a_backend_that_is_not_a_name(hf_copy):
    import qwen_apple_backend as qab

    # It was an AttributeError: 'int' object has no attribute 'strip'.
    for call in (lambda: load(hf_copy, 3), lambda: qab.enable(3)):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == "backend must be a backend name (a str) or None, got int 3"


def test_empty_and_too_long_prompts(hf_copy):
    import mlx_lm

    import qwen_apple_backend as qab

    _edit_config(hf_copy, lambda c: c["text_config"].__setitem__("max_position_embeddings", 16))
    qab.enable("fused")
    try:
        model, tok = mlx_lm.load(str(hf_copy))
        with pytest.raises(PromptError, match="empty"):
            mlx_lm.generate(model, tok, prompt=[], max_tokens=2)
        with pytest.raises(PromptError, match="20 tokens.*max_position_embeddings = 16"):
            mlx_lm.generate(model, tok, prompt=list(range(20)), max_tokens=2)
        out = mlx_lm.generate(model, tok, prompt=list(range(5)), max_tokens=2)
        assert isinstance(out, str)
    finally:
        qab.disable()


def test_cli_reports_errors_without_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "make-checkpoint",
                          str(tmp_path / "x"), "--preset", "full", "--layout", "hf"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "error" in out.stderr.lower()


def test_unknown_model_type_names_the_file_and_field(hf_copy):
    def fn(c):
        c["model_type"] = "qwen9_moe"
        c["text_config"]["model_type"] = "qwen9_moe_text"
        c["architectures"] = ["Qwen9MoeForCausalLM"]
    _edit_config(hf_copy, fn)
    with pytest.raises(CheckpointError, match=rf"{hf_copy / 'config.json'}: unsupported "
                                              r"model_type 'qwen9_moe': no installed plugin "
                                              r"claims it \(claimed: .*qwen3_5_moe"):
        load(hf_copy)


@pytest.mark.parametrize("fields", [["hidden_size"], ["vocab_size", "num_experts"]])
def test_missing_required_config_field_names_the_file_and_field(hf_copy, fields):
    _edit_config(hf_copy, lambda c: [c["text_config"].pop(f) for f in fields])
    names = ", ".join(f"'text_config.{f}'" for f in fields)
    with pytest.raises(CheckpointError, match=rf"{hf_copy / 'config.json'}: missing required "
                                              rf"fields? {names} \(needed to build the "
                                              r"qwen3_5_moe model\)"):
        load(hf_copy)


@pytest.mark.parametrize("field, value, what", [
    ("hidden_size", "abc", "a positive integer, got 'abc'"),
    ("hidden_size", 0, "a positive integer, got 0"),
    ("num_attention_heads", -4, "a positive integer, got -4"),
    ("num_hidden_layers", True, "a positive integer, got True"),
    ("head_dim", 64.0, "a positive integer, got 64.0"),
    ("linear_key_head_dim", None, None),  # missing: the required-field error instead
    ("num_experts", 0, "a positive integer, got 0"),
    ("moe_intermediate_size", "64", "a positive integer, got '64'"),
])
def test_config_size_field_of_wrong_type_or_value(hf_copy, field, value, what):
    _edit_config(hf_copy, lambda c: c["text_config"].__setitem__(field, value))
    cfg = re.escape(str(hf_copy / "config.json"))
    if what is None:
        match = rf"^{cfg}: missing required field 'text_config\.{field}'"
    else:
        match = rf"^{cfg}: text_config\.{field} must be {re.escape(what)} \(needed to build"
    with pytest.raises(CheckpointError, match=match):
        load(hf_copy)


def test_config_count_field_may_be_zero_only_where_not_required():
    from qwen_apple_backend.models.qwen3_5 import Adapter

    tc = {"hidden_size": 64, "num_experts": 0, "num_experts_per_tok": 0}
    Adapter().check_field_values({"text_config": tc})  # dense: no experts is fine
    with pytest.raises(CheckpointError, match=r"^config\.json: text_config\.num_experts must "
                                              r"be a non-negative integer, got -1"):
        Adapter().check_field_values({"text_config": dict(tc, num_experts=-1)})
    with pytest.raises(CheckpointError, match=r"^config\.json: intermediate_size must be a "
                                              r"positive integer, got 0"):
        Adapter().check_field_values({"intermediate_size": 0})


def test_missing_config_field_of_a_stock_architecture(tmp_path):
    from ._llama import write_tiny_llama

    path = write_tiny_llama(tmp_path / "llama")
    _edit_config(path, lambda c: c.pop("hidden_size"))
    with pytest.raises(CheckpointError, match=rf"{path / 'config.json'}: missing required "
                                              r"field 'hidden_size' \(needed to build the "
                                              r"llama model\)"):
        load(path)


def test_layer_type_error_names_the_config_file(hf_copy):
    _edit_config(hf_copy, lambda c: c["text_config"]["layer_types"].__setitem__(0, "mamba"))
    with pytest.raises(UnsupportedConfigError, match=rf"^{hf_copy / 'config.json'}: "
                                                     r"text_config\.layer_types\[0\]"):
        load(hf_copy)


def test_an_empty_folder_is_named_by_its_config(tmp_path):
    # Neither config.json nor a tokenizer: the model's own file is the one named.
    with pytest.raises(MissingCheckpointFileError,
                       match=rf"^{tmp_path / 'config.json'}: config.json not found"):
        load(tmp_path)


def test_missing_tokenizer_is_named(hf_copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_copy / name).unlink()
    with pytest.raises(MissingCheckpointFileError,
                       match=rf"{hf_copy / 'tokenizer.json'}: tokenizer.json not found"):
        load(hf_copy)
    # The model alone (benchmarks) needs no tokenizer.
    from qwen_apple_backend.loader import load_model

    load_model(hf_copy, "stock")
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate", "--model",
                          str(hf_copy), "--prompt", "hi"], capture_output=True, text=True)
    assert out.returncode == 1
    assert "tokenizer.json not found" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("content, message", [
    ("{bad", r"invalid JSON at line 1 column 2"),
    ("[1]", r"expected a JSON object at the top level"),
    ("{}", r"the tokenizer could not be loaded from tokenizer\.json"),
])
def test_corrupt_tokenizer_json_is_named(hf_copy, content, message):
    (hf_copy / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match=rf"^{hf_copy / 'tokenizer.json'}: {message}"):
        load(hf_copy)


def test_a_corrupt_tokenizer_is_named_before_the_weights_are_read(hf_copy):
    # Weights gone too: the tokenizer loads (and fails) first, so its file is the one named.
    (hf_copy / "tokenizer.json").write_text("{bad")
    for f in hf_copy.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError,
                       match=rf"^{hf_copy / 'tokenizer.json'}: invalid JSON at line 1 column 2"):
        load(hf_copy)


def test_config_errors_come_before_the_tokenizer_loads(hf_copy, monkeypatch):
    # config.json's fields, the disable names and the QAB_* variables are checked in
    # milliseconds; a real tokenizer takes seconds to load, the weights longer.
    from mlx_lm import utils as mlx_utils

    from qwen_apple_backend.errors import EnvVarError

    loads = []
    monkeypatch.setattr(mlx_utils, "load_tokenizer", lambda *a, **k: loads.append(a) or 1 / 0)
    with pytest.raises(EnvVarError, match=r"turbo"):
        load(hf_copy, "fused", disable=["turbo"])
    with pytest.raises(TypeError, match=r"^disable=: .*got int 3$"):
        load(hf_copy, "fused", disable=3)
    _edit_config(hf_copy, lambda c: c["text_config"].__setitem__("num_experts", 0))
    with pytest.raises(CheckpointError, match=r"text_config\.num_experts must be a positive "
                                              r"integer, got 0"):
        load(hf_copy)

    def unknown_model_type(c):
        c["text_config"]["num_experts"] = 8
        c["model_type"], c["text_config"]["model_type"] = "qwen9_moe", "qwen9_moe_text"
        c["architectures"] = ["Qwen9MoeForCausalLM"]

    _edit_config(hf_copy, unknown_model_type)
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'qwen9_moe'"):
        load(hf_copy)
    assert loads == []


def test_a_good_tokenizer_is_parsed_only_by_the_tokenizer(hf_copy, monkeypatch):
    # The loader's own JSON check runs only when the tokenizer fails to load.
    from qwen_apple_backend import loader

    def check(model_path):
        raise AssertionError(f"check_tokenizer_files({model_path}) on a good tokenizer")

    monkeypatch.setattr(loader, "check_tokenizer_files", check)
    # The end-of-sequence ids as mlx-lm's load() takes them: config.json's, replaced by
    # generation_config.json's, replaced by model_config's (the tokenizer's own
    # eos_token_id is always one of them: mlx-lm's TokenizerWrapper adds it).
    config = json.loads((hf_copy / "config.json").read_text())
    config["eos_token_id"] = 3
    (hf_copy / "config.json").write_text(json.dumps(config))
    (hf_copy / "generation_config.json").unlink(missing_ok=True)
    _, tokenizer = load(hf_copy)
    own = tokenizer._tokenizer.eos_token_id
    assert own not in (3, 5, 6, 7)
    assert set(tokenizer.eos_token_ids) == {3, own}
    (hf_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    _, tokenizer = load(hf_copy)
    assert set(tokenizer.eos_token_ids) == {5, 6, own}
    _, tokenizer = load(hf_copy, model_config={"eos_token_id": [7]})
    assert set(tokenizer.eos_token_ids) == {7, own}


def test_corrupt_tokenizer_json_in_the_cli(hf_copy):
    (hf_copy / "tokenizer.json").write_text("{bad")
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate", "--model",
                          str(hf_copy), "--prompt", "hi"], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "JSONDecodeError" not in out.stderr
    assert f"qab generate: error: {hf_copy / 'tokenizer.json'}: invalid JSON" in out.stderr


def test_bad_environment_fails_at_load_not_at_first_use(hf_copy, monkeypatch):
    from qwen_apple_backend.errors import EnvVarError

    monkeypatch.setenv("QAB_GDN_CHUNK", "sixty-four")
    with pytest.raises(EnvVarError, match=r"^QAB_GDN_CHUNK: expected a positive integer, "
                                          r"got 'sixty-four'$"):
        load(hf_copy, "fused")
    monkeypatch.delenv("QAB_GDN_CHUNK")
    monkeypatch.setenv("QAB_BACKEND", "turbo")
    with pytest.raises(UnknownBackendError, match=r"^QAB_BACKEND: unknown backend 'turbo'"):
        load(hf_copy)


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("YES", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False), (None, False),
])
def test_boolean_environment_variables(monkeypatch, value, expected):
    from qwen_apple_backend import envs

    for var, fn in (("QAB_DISABLE_KERNELS", envs.kernels_disabled),
                    ("QAB_UNVERIFIED_KERNELS", envs.unverified_kernels_allowed)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        assert fn() is expected


def test_bad_boolean_and_list_variables_name_themselves(monkeypatch):
    from qwen_apple_backend import envs
    from qwen_apple_backend.errors import EnvVarError

    monkeypatch.setenv("QAB_DISABLE_KERNELS", "2")
    with pytest.raises(EnvVarError, match=r"^QAB_DISABLE_KERNELS: expected one of "
                                          r"1/true/yes/on \(on\) or 0/false/no/off \(off\), "
                                          r"got '2'$"):
        envs.kernels_disabled()
    monkeypatch.delenv("QAB_DISABLE_KERNELS")
    monkeypatch.setenv("QAB_DISABLE", "moe,foo")
    with pytest.raises(EnvVarError, match=r"^QAB_DISABLE: unknown optimization 'foo' \(known: "
                                          r"moe, gdn, attn, all, gdn-kernel, moe-gemm, "
                                          r"moe-kernel, moe-route, moe-block, attn-blocks, attn-split, attn-kernel, qk-prep, decode-compile, decode-const, "
                                          r"proj-concat, gemv-kernel, embed-kernel, proj-gemv, add-norm, norm-proj, next-norm, kv-in-place, "
                                          r"moe-block-stage, gemv-pipe, attn-lanes, moe-block-early, "
                                          r"l2-prefetch, moe-block-out-proj, moe-block-next-proj, moe-block-gdn, moe-block-pack, "
                                          r"moe-block-unroll, moe-block-npl, moe-block-roll, moe-block-npg, "
                                          r"attn-step, "
                                          r"attn-mma, attn-merge-split, attn-merge-spread, moe-block-nps, "
                                          r"moe-block-rpl, attn-step-long\)$"):
        envs.validate()
    monkeypatch.setenv("QAB_DISABLE", "all")
    assert envs.disabled_kinds() == frozenset({"moe", "gdn", "attn"})


def test_misspelt_names_are_quoted_as_typed(monkeypatch):
    # Names match in any case, but an error quotes the user's spelling, not a
    # lower-cased copy of it.
    from qwen_apple_backend import envs
    from qwen_apple_backend.errors import EnvVarError

    known = ", ".join([*envs.FUSABLE_KINDS, "all", *envs.OPTIMIZATIONS])
    monkeypatch.setenv("QAB_DISABLE", "moe,Moe-Blok")
    with pytest.raises(EnvVarError) as info:
        envs.validate()
    assert str(info.value) == f"QAB_DISABLE: unknown optimization 'Moe-Blok' (known: {known})"
    monkeypatch.setenv("QAB_DISABLE", " MOE-BLOCK, Attn ")
    assert envs.disabled_kinds() == frozenset({"moe-block", "attn"})
    monkeypatch.delenv("QAB_DISABLE")

    monkeypatch.setenv("QAB_ENABLE", "Warp-Drive,L2-Prefetch")
    with pytest.raises(EnvVarError) as info:
        envs.validate()
    assert str(info.value) == ("QAB_ENABLE: unknown optimization 'Warp-Drive' (known: "
                               f"{', '.join(envs.OPT_IN)})")
    monkeypatch.setenv("QAB_ENABLE", "Add-Norm")
    with pytest.raises(EnvVarError) as info:
        envs.enabled_opt_in()
    assert str(info.value) == (f"QAB_ENABLE: 'Add-Norm' is on by default (QAB_ENABLE names "
                               f"only {', '.join(envs.OPT_IN)}; switch others off with "
                               "QAB_DISABLE)")
    monkeypatch.setenv("QAB_ENABLE", " L2-Prefetch ")
    assert envs.enabled_opt_in() == frozenset({"l2-prefetch"})
    monkeypatch.delenv("QAB_ENABLE")

    monkeypatch.setenv("QAB_BACKEND", "Turbo")
    with pytest.raises(EnvVarError) as info:
        envs.backend(envs.MLX_BACKENDS)
    assert str(info.value) == "QAB_BACKEND: unknown backend 'Turbo' (known: auto, fused, stock)"
    monkeypatch.setenv("QAB_BACKEND", "FUSED")
    assert envs.backend(envs.MLX_BACKENDS) == "fused"
    with pytest.raises(EnvVarError) as info:
        envs.check_disable(["Attn_Blocks", "MOE"])
    assert str(info.value) == f"disable=: unknown optimization 'Attn_Blocks' (known: {known})"


def test_disable_argument_is_checked_like_the_variable():
    # load(disable=...) / fuse_in_memory(disable=...) take QAB_DISABLE's names;
    # a misspelt one is an error naming the argument, not a silent no-op.
    from qwen_apple_backend import envs
    from qwen_apple_backend.bench.target import fuse_in_memory
    from qwen_apple_backend.checkpoint import build_random_model, hf_config
    from qwen_apple_backend.errors import EnvVarError

    assert envs.check_disable(["MOE", " attn-blocks "]) == frozenset({"moe", "attn-blocks"})
    assert envs.check_disable(["all", "add-norm"]) == frozenset({"moe", "gdn", "attn", "add-norm"})
    # One string is read as QAB_DISABLE is: comma-separated names, not letters.
    assert envs.check_disable("moe-block-out-proj, qk-prep") == frozenset(
        {"moe-block-out-proj", "qk-prep"})
    # Not names at all: a TypeError naming the argument (was "'int' object is not iterable").
    with pytest.raises(TypeError, match=r"^disable=: expected names .*got int 3$"):
        envs.check_disable(3)
    with pytest.raises(TypeError, match=r"^disable=: .*got NoneType None among them$"):
        envs.check_disable(["moe", None])
    with pytest.raises(EnvVarError, match=r"^disable=: unknown optimizations 'attn_blocks', 'mo' "
                                          r"\(known: moe, gdn, attn, all, "):
        envs.check_disable(["attn_blocks", "mo"])
    model = build_random_model("tiny", vocab_size=64)
    with pytest.raises(ValueError, match="unknown optimization 'add_norm'"):
        fuse_in_memory(model, "fused", config=hf_config("tiny", 64), disable=["add_norm"])


@pytest.mark.parametrize("script,args,message", [
    ("profile_attention_decode.py", ["--lengths", "abc"], "'abc' is not a length (use e.g. 512, 4K)"),
    ("profile_attention_decode.py", ["--step-ctas", "64,0"], "'0' is not a positive thread-block count"),
    # No CUDA here: no step to time (said before any timing).
    ("profile_attention_decode.py", ["--lengths", "256", "--repeats", "1", "--timeline"],
     "--timeline times the step form, which this device does not have"),
    ("profile_attention_decode.py", ["--timeline-warm"], "--timeline-warm goes with --timeline"),
    ("profile_grouped_gemm.py", ["--lengths", "0"], "0 is too short (at least 2 tokens)"),
    ("prefill_memory.py", ["--max-seconds", "nan"], "must be a number >= 0, got nan"),
    ("prefill_memory.py", ["--warmup", "-1"], "must be an integer >= 0, got -1"),
    ("decode_split.py", ["--rounds", "0"], "must be a positive integer, got 0"),
    ("decode_split.py", ["--context", "4K,"], "'4K,' has an empty entry"),
    ("decode_split.py", ["--context", "inf"], "'inf' is not a length"),
    ("decode_split.py", ["--variants", "fused,stock,fused"], "['fused'] named more than once"),
    ("profile_encode.py", ["--ops", "-3"], "must be a positive integer, got -3"),
    ("decode_split.py", ["--variants", "fused,fused-bogus"],
     "--variants 'fused-bogus': unknown optimization 'bogus'"),
    ("profile_decode_gpu.py", ["--context", "4K,8K"], "--context: one length, got 2"),
    ("profile_decode_gpu.py", ["--variant", "fast"],
     "--variant 'fast': expected stock, fused or fused-NAME"),
    ("profile_decode_gpu.py", ["--variant", "fused-warp"],
     "--variant 'fused-warp': unknown optimization 'warp'"),
    ("profile_decode_gpu.py", ["--variant", "fused-"], "--variant 'fused-': an empty optimization"),
    ("profile_decode_gpu.py", ["--summarize", ""], "--summarize: an empty file name"),
    ("decode_split.py", ["--variants", "fused-"], "--variants 'fused-': an empty optimization"),
    ("profile_gemv_gpu.py", ["--shapes", "in_proj=12352x2000"],
     "--shapes: 'in_proj=12352x2000' is not NAME=NxK with K a multiple of 64"),
    ("profile_gemv_gpu.py", ["--candidates", "mlx,fast"], "unknown candidate(s) ['fast']"),
    ("profile_gemv_gpu.py", ["--rpw", "2,x"], "--rpw: '2,x' is not a comma list of integers"),
    ("profile_gemv_gpu.py", ["--reps", "0"], "--reps must be >= 1"),
    ("profile_gemv_gpu.py", ["--eps-array", "small"], "argument --eps-array: invalid choice"),
    ("profile_decode_gpu.py", ["--summarize", "ncu.csv"],
     "profile-decode-gpu-meta-fused.json not found: run the profiled decode into OUT first"),
    ("decode_split.py", ["--preset", "tiny", "--layers", "400"],
     "--layers 400: preset 'tiny' has 4 layers"),
    # QAB_* variables are checked before any model is built, as qab's commands do.
    ("decode_split.py", ["--preset", "tiny", "QAB_ENABLE=bogus"],
     "QAB_ENABLE: unknown optimization 'bogus' (known: decode-compile, next-norm, proj-gemv, "
     "gemv-pipe, attn-lanes, l2-prefetch, decode-const, attn-merge-split, "
     "moe-block-nps, moe-block-rpl)"),
    ("profile_attention_decode.py", ["QAB_DISABLE=warp"], "QAB_DISABLE: unknown optimization"),
    # The warm timeline: with --timeline only, and of 3 to 16 chained launches.
    ("profile_layer_gpu.py", ["--warm", "4"], "--warm goes with --timeline"),
    ("profile_layer_gpu.py", ["--timeline", "--warm", "2"],
     "--warm takes 0 or N from 3 to 16 (fewer layers leave the marked one's weights in the L2 "
     "from the launch before), got 2"),
    ("gpu_session.py", ["--plan", "bench:100", "--timeline-warm", "4"],
     "--timeline-warm goes with a timeline step in --plan"),
    ("gpu_session.py", ["--plan", "timeline:100", "--timeline-warm", "17"],
     "--timeline-warm takes 0 or N from 3 to 16, got 17"),
])
def test_benchmark_scripts_reject_bad_arguments_in_one_line(script, args, message, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env.update(a.split("=", 1) for a in args if a.startswith("QAB_"))
    args = [a for a in args if not a.startswith("QAB_")]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / script), str(tmp_path / "o"),
                        *args], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()  # nothing written


def test_bench_rejects_an_out_file_before_any_work(tmp_path):
    # qab bench checks --out before building a model (it used to fail after
    # the whole sweep with a raw errno message).
    import subprocess
    import sys

    f = tmp_path / "afile"
    f.write_text("x")
    r = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "bench", "--preset", "tiny",
                        "--vocab-size", "64", "--quick", "--out", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"qab bench: error: --out '{f}' exists and is not a folder" in r.stderr
    assert "round 1" not in r.stderr and "Traceback" not in r.stderr


def test_bench_and_compare_check_their_outputs_and_models_before_any_work(tmp_path):
    # A folder that cannot be made (under a file), a --json that is a folder, a column's
    # own model path that does not exist: each named before any model is built (they
    # failed after the whole sweep, or after the stock column had loaded).
    f = tmp_path / "afile"
    f.write_text("x")
    base = ["--preset", "tiny", "--vocab-size", "64"]
    cases = [
        (["bench", *base, "--quick", "--out", str(f / "sub")],
         f"qab bench: error: --out '{f / 'sub'}': cannot create the folder '{f / 'sub'}': Not a "
         "directory"),
        (["compare", *base, "--backends", "stock", "--prompt", "hi", "--json",
          str(f / "x.json")],
         f"qab compare: error: --json '{f / 'x.json'}': cannot create the folder '{f}': File "
         "exists"),
        (["compare", *base, "--backends", "stock", "--prompt", "hi", "--json", str(tmp_path)],
         f"qab compare: error: --json '{tmp_path}' is a folder, not a file"),
        (["compare", *base, "--backends", f"stock,fused={tmp_path / 'missing'}",
          "--prompt", "hi"],
         f"qab compare: error: --backends fused={tmp_path / 'missing'}: no such file or folder"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", *argv],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (argv, r.stderr[-2000:])
        assert r.stderr.rstrip().endswith(message), (argv, r.stderr[-2000:])
        assert "built " not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_quantized_weights_without_a_quantization_section(q4_copy):
    # Without "quantization", mlx-lm reads a legacy "quantization_config" and indexed its
    # quant_method unchecked (KeyError); without either, it builds unquantized layers and
    # listed every .scales / .biases key, one line each (over 100 lines).
    def drop(c, keys):
        for k in keys:
            c.pop(k, None)

    _edit_config(q4_copy, lambda c: (drop(c, ["quantization"]),
                                      c.__setitem__("quantization_config", {"bits": 4})))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config must be an "
                                              r"object with a quant_method string"):
        load(q4_copy)
    _edit_config(q4_copy, lambda c: drop(c, ["quantization_config"]))
    with pytest.raises(CheckpointError) as info:
        load(q4_copy)
    text = str(info.value)
    assert "\n" not in text and len(text) < 600, text
    assert re.search(r"weights do not match the model built from config\.json: Received \d+ "
                     r"parameters not in model: [\w.]+, [\w.]+, [\w.]+, [\w.]+, \.\.\. \(\d+ "
                     r"more\) \(the weights are quantized, \.scales and \.biases, but "
                     r"config\.json has no quantization section", text), text


def test_missing_parameters_are_counted_on_one_line(q4_copy):
    # Eight layers in config.json, four in the weights: the first missing names and a
    # count ("Missing 73 parameters" listed all 73, one line each).
    def grow(c):
        tc = c["text_config"]
        tc["num_hidden_layers"] = 2 * tc["num_hidden_layers"]
        tc["layer_types"] = tc["layer_types"] * 2

    _edit_config(q4_copy, grow)
    with pytest.raises(CheckpointError) as info:
        load(q4_copy)
    text = str(info.value)
    assert "\n" not in text, text
    assert re.search(r"Missing (\d+) parameters: (language_model\.model\.layers\.\d+\.[\w.]+, ){4}"
                     r"\.\.\. \(\d+ more\)$", text), text


def _rewrite_one(ckpt, pick, change):
    """Rewrite the first safetensors key ``pick`` accepts with ``change(array)``; return
    (file name, key)."""
    for shard in sorted(ckpt.glob("model*.safetensors")):
        weights, meta = mx.load(str(shard), return_metadata=True)
        key = next((k for k in sorted(weights) if pick(k, weights)), None)
        if key is not None:
            weights[key] = change(weights[key])
            mx.save_safetensors(str(shard), weights, metadata=meta)
            return shard.name, key
    raise AssertionError("no key to rewrite")


def test_integer_weight_names_its_file_and_key(hf_copy):
    # An int32 projection loaded silently (and an int32 norm, shifted to float by
    # sanitize, too): named before any weight is used.
    name, key = _rewrite_one(hf_copy, lambda k, w: k.endswith("linear_attn.in_proj_qkv.weight"),
                             lambda a: a.astype(mx.int32))
    with pytest.raises(CheckpointError) as info:
        load(hf_copy, backend="stock")
    assert str(info.value) == (f"{hf_copy / name}: weight key {key} has dtype int32, expected a "
                               "floating-point dtype")


def test_integer_tensors_that_sanitize_drops_are_not_checked(hf_copy):
    # The MTP block's (and the vision tower's) keys never reach the model.
    _rewrite_one(hf_copy, lambda k, w: k.startswith("mtp.") and k.endswith(".weight"),
                 lambda a: a.astype(mx.int32))
    model, _ = load(hf_copy, backend="stock")
    assert not any(k.startswith("mtp") for k in model.parameters())


def test_float_packed_quantized_weight_names_its_file_and_key(q4_copy):
    # A quantized layer's packed weight as float32 loaded, then failed at the first forward
    # with MLX's "[gather_qmm] The weight matrix should be uint32 but received float32".
    name, key = _rewrite_one(
        q4_copy, lambda k, w: k.endswith("switch_mlp.up_proj.weight") and w[k].dtype == mx.uint32,
        lambda a: a.astype(mx.float32))
    with pytest.raises(CheckpointError) as info:
        load(q4_copy)
    assert str(info.value) == (f"{q4_copy / name}: weight key {key} has dtype float32, expected "
                               "uint32 (the packed values of a quantized layer)")


def _rewrite_header(shard, change):
    """Rewrite a safetensors header in place with ``change(header)``; return the first
    tensor name (not ``__metadata__``) after sorting, which ``change`` gets to edit."""
    import struct

    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    change(header, name)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return name


@pytest.mark.parametrize("change, message", [
    # MLX's "[safetensor] unsupported dtype XYZ" named neither the file nor the tensor.
    (lambda h, k: h[k].__setitem__("dtype", "XYZ"),
     "has dtype 'XYZ', which MLX cannot load (it reads BOOL, U8, I8, F8_E4M3, F8_E8M0, U16, "
     "I16, F16, BF16, U32, I32, F32, U64, I64, C64)"),
    (lambda h, k: h[k].__setitem__("dtype", "F64"), "has dtype 'F64', which MLX cannot load"),
    # MLX's "[load_safetensors] Tensor ... invalid data offsets" did not name the file.
    (lambda h, k: h[k].__setitem__("shape", [2 * d for d in h[k]["shape"]]),
     "of shape [SHAPE] and dtype F32 needs BYTES bytes, but its data_offsets hold HELD"),
    (lambda h, k: h[k].__setitem__("shape", "big"), "has no valid shape (a list of sizes), "
                                                    "got 'big'"),
])
def test_a_safetensors_tensor_mlx_cannot_read_is_named(hf_copy, change, message):
    shard = sorted(hf_copy.glob("model-*.safetensors"))[0]
    seen = {}

    def record(header, name):
        seen["old"] = dict(header[name])
        change(header, name)
        seen["new"] = header[name]

    name = _rewrite_header(shard, record)
    if "SHAPE" in message:
        start, end = seen["old"]["data_offsets"]
        shape = seen["new"]["shape"]
        need = 4 * int(__import__("math").prod(shape))
        message = (message.replace("SHAPE", ", ".join(map(str, shape)))
                   .replace("BYTES", f"{need:,}").replace("HELD", f"{end - start:,}"))
    with pytest.raises(CheckpointError) as info:
        load(hf_copy)
    assert str(info.value).startswith(f"{shard}: tensor {name!r} {message}"), str(info.value)


def test_a_key_in_two_shards_is_named(hf_copy):
    # mlx-lm reads every shard and kept the last one's copy, silently.
    first, second = sorted(hf_copy.glob("model-*.safetensors"))
    weights = mx.load(str(first))
    key = sorted(weights)[0]
    others, meta = mx.load(str(second), return_metadata=True)
    others[key] = mx.zeros_like(weights[key])
    mx.save_safetensors(str(second), others, metadata=meta)
    with pytest.raises(CheckpointError) as info:
        load(hf_copy)
    assert str(info.value) == (f"{second}: key {key!r} is also in {first.name} (a weight must "
                               "be in one file only)")
