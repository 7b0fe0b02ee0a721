"""`qab` commands end to end: generate (mlx_lm.generate flags), backends, make-checkpoint, demo."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest


def _qab(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_help_lists_every_command():
    out = _qab("--help")
    assert out.returncode == 0
    for cmd in ("generate", "chat", "serve", "backends", "make-checkpoint", "demo"):
        assert cmd in out.stdout


def test_generate_help_shows_backend_and_mlx_lm_flags():
    out = _qab("generate", "--help")
    assert out.returncode == 0
    assert "--backend" in out.stdout and "--max-tokens" in out.stdout and "--temp" in out.stdout


def _generated_text(stdout: str) -> str:
    # mlx_lm.generate prints the text between two "==========" rules.
    parts = stdout.split("==========")
    assert len(parts) >= 3, stdout
    return parts[1].strip()


def test_generate_fused_equals_stock_and_reports(tiny_real_vocab):
    texts = {}
    for backend in ("fused", "stock"):
        out = _qab("generate", "--model", str(tiny_real_vocab), "--prompt", "Hello! 1 + 1 =",
                   "--max-tokens", "8", "--temp", "0", "--backend", backend, "--qab-report")
        assert out.returncode == 0, out.stderr
        assert "Prompt:" in out.stdout and "tokens-per-sec" in out.stdout
        texts[backend] = _generated_text(out.stdout)
        if backend == "fused":
            assert "moe: 4/4 fused" in out.stderr and "gdn: 3/3 fused" in out.stderr
        else:
            assert "backend=stock" in out.stderr
    assert texts["fused"] == texts["stock"]


def test_generate_bad_checkpoint_is_one_clear_error(tmp_path):
    out = _qab("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert out.returncode == 1
    assert "checkpoint directory not found" in out.stderr and "Traceback" not in out.stderr


def test_generate_empty_prompt(tiny_real_vocab):
    # Refused before the model loads (no mlx-lm banner), as a usage error.
    out = _qab("generate", "--model", str(tiny_real_vocab), "--prompt", "",
               "--ignore-chat-template", "--max-tokens", "2")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "qab generate: error: argument --prompt/-p: empty with --ignore-chat-template: "
        "there is no token to generate from")
    assert out.stdout == ""
    # An empty prompt read from stdin (`--prompt -`) is known only once mlx-lm
    # reads it: the stream_generate check names it (exit 1, no traceback).
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate", "--model",
                          str(tiny_real_vocab), "--prompt", "-", "--ignore-chat-template",
                          "--max-tokens", "2"], input="", capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1, out.stderr
    assert "the prompt is empty: give at least one token" in out.stderr
    assert "Traceback" not in out.stderr


def test_backends_json():
    out = _qab("backends", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "qwen" in data["plugins"]
    assert {e["name"] for e in data["backends"]} >= {"stock", "fused"}


def test_demo_runs_on_a_given_model(tiny_real_vocab):
    out = _qab("demo", "--model", str(tiny_real_vocab), "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    assert "fused output:" in out.stdout
    assert "same text as stock: True" in out.stdout
    lines = [l for l in out.stdout.splitlines() if re.match(r"^(fused|stock)\s+\d+\s", l)]
    assert len(lines) == 2


# ----------------------------------------------------------------- bad input, clean exits


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("var, value, message", [
    ("QAB_DISABLE", "foo", "qab: error: QAB_DISABLE: unknown optimization 'foo' (known: moe, "
                           "gdn, attn, all, gdn-kernel"),
    ("QAB_ENABLE", "warp-drive", "qab: error: QAB_ENABLE: unknown optimization 'warp-drive' "
                                 "(known: decode-compile, next-norm, proj-gemv, gemv-pipe, "
                                 "attn-lanes, l2-prefetch, decode-const, attn-merge-split, "
                                 "moe-block-nps, moe-block-rpl)"),
    ("QAB_BACKEND", "turbo", "qab: error: QAB_BACKEND: unknown backend 'turbo' (known: auto, "
                             "fused, stock)"),
    ("QAB_GDN_CHUNK", "abc", "qab: error: QAB_GDN_CHUNK: expected a positive integer, got 'abc'"),
    ("QAB_DISABLE_KERNELS", "maybe", "qab: error: QAB_DISABLE_KERNELS: expected one of "
                                     "1/true/yes/on (on) or 0/false/no/off (off), got 'maybe'"),
])
def test_bad_environment_is_one_line_and_status_2(command, var, value, message, tmp_path):
    # Checked at startup, before the model (here: a missing one) is even looked at.
    out = _qab(command, "--model", str(tmp_path / "missing"), env={var: value})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == message or out.stderr.startswith(message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_bad_environment_stops_demo_and_compare_too(tmp_path):
    for args in (["demo"], ["compare", "--model", str(tmp_path), "--prompt", "x"]):
        out = _qab(*args, env={"QAB_GDN_CHUNK": "0"})
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("qab: error: QAB_GDN_CHUNK: expected a positive integer")


def test_every_subcommand_checks_the_environment_but_help_does_not(tmp_path):
    # backends and make-checkpoint read no QAB_* variable but still report a
    # misspelt one (as typed); help and --version work whatever the variables hold.
    from qwen_apple_backend.envs import FUSABLE_KINDS, OPTIMIZATIONS

    env = {"QAB_DISABLE": "Moe-Blok"}
    message = ("qab: error: QAB_DISABLE: unknown optimization 'Moe-Blok' (known: "
               f"{', '.join([*FUSABLE_KINDS, 'all', *OPTIMIZATIONS])})")
    for args in (["backends"], ["make-checkpoint", str(tmp_path / "ckpt"), "--quiet"],
                 ["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]):
        out = _qab(*args, env=env, timeout=120)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip() == message, (args, out.stderr)
    assert not (tmp_path / "ckpt").exists()
    for args in (["--help"], ["--version"], ["backends", "--help"], ["make-checkpoint", "-h"],
                 ["bench", "--help"], ["generate", "--help"]):
        out = _qab(*args, env=env, timeout=120)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout and "error" not in out.stderr, (args, out.stderr)


def test_unknown_plugin_in_qab_plugins_lists_the_available_ones(tmp_path):
    from importlib.metadata import entry_points

    available = sorted({ep.name for ep in entry_points(group="qwen_apple_backend")} | {"qwen"})
    for value, unknown in (("nonexistent", "plugin 'nonexistent'"),
                           ("qwen,nope,nada", "plugins 'nada', 'nope'")):
        message = (f"qab: error: QAB_PLUGINS: unknown {unknown} "
                   f"(available: {', '.join(available)})")
        for args in (["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
                     ["demo"], ["backends"]):
            out = _qab(*args, env={"QAB_PLUGINS": value})
            assert out.returncode == 2, (args, out.stderr)
            assert out.stderr.strip() == message, (args, out.stderr)


def test_unusable_cache_dir_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    from qwen_apple_backend.demo import ensure_default_model
    from qwen_apple_backend.errors import EnvVarError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"  # cannot be created: its parent is a file (even for root)
    message = (f"QAB_CACHE_DIR: cannot create or write the cache directory {str(cache)!r}: "
               "Not a directory; set QAB_CACHE_DIR to a writable directory")
    for args in (["demo", "--max-tokens", "1"], ["generate", "--prompt", "x"]):
        out = _qab(*args, env={"QAB_CACHE_DIR": str(cache)})
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip() == f"qab: error: {message}", (args, out.stderr)
    monkeypatch.setenv("QAB_CACHE_DIR", str(cache))
    with pytest.raises(EnvVarError) as info:
        ensure_default_model()
    assert str(info.value) == message and not blocker.read_text()


def test_unknown_backend_flag_lists_the_available_ones(tmp_path):
    out = _qab("generate", "--model", str(tmp_path), "--backend", "turbo", "--prompt", "x")
    assert out.returncode == 2
    assert "qab generate: error: --backend: unknown backend 'turbo' (available: auto, fused, " \
           "stock" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["demo", "--max-tokens", "-3"], "argument --max-tokens: must be a positive integer, got -3"),
    (["demo", "--max-tokens", "0"], "argument --max-tokens: must be a positive integer, got 0"),
    (["generate", "--max-tokens", "-3", "--prompt", "x"],
     "argument --max-tokens/-m: must be a positive integer, got -3"),
    (["chat", "-m", "0"], "argument --max-tokens/-m: must be a positive integer, got 0"),
    (["serve", "--max-tokens", "-1"], "argument --max-tokens: must be a positive integer"),
    (["bench", "--preset", "tiny", "--rounds", "0"], "argument --rounds: must be a positive"),
    (["bench", "--preset", "tiny", "--lengths", "512,-4"], "argument --lengths: -4 is too short"),
    (["bench", "--preset", "tiny", "--decode-tokens", "-1"], "argument --decode-tokens: must be"),
    (["compare", "--preset", "tiny", "--max-tokens", "-3"], "argument --max-tokens: must be a "
                                                            "positive integer, got -3"),
    (["compare", "--preset", "tiny", "--warmup", "-1"], "argument --warmup: must be an integer "
                                                        ">= 0, got -1"),
    (["make-checkpoint", "x", "--vocab-size", "0"], "argument --vocab-size: must be a positive"),
])
def test_token_counts_must_be_positive(args, message):
    out = _qab(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", "--temp", "-1", "--prompt", "x"], "argument --temp: must be a number >= 0, "
                                                    "got -1"),
    (["generate", "--temp=nan", "--prompt", "x"], "argument --temp: must be a number >= 0"),
    (["generate", "--top-p", "1.5", "--prompt", "x"], "argument --top-p: must be a number in "
                                                      "[0, 1], got 1.5"),
    (["generate", "--min-p", "-0.1", "--prompt", "x"], "argument --min-p: must be a number in "
                                                       "[0, 1], got -0.1"),
    (["chat", "--temp", "-0.5"], "argument --temp: must be a number >= 0, got -0.5"),
    (["serve", "--top-p", "2"], "argument --top-p: must be a number in [0, 1], got 2"),
])
def test_sampling_settings_are_checked_up_front(args, message):
    out = _qab(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"qab {args[0]}: error: {message}" in out.stderr and "Traceback" not in out.stderr
    assert "no --model given" not in out.stderr  # rejected before anything is loaded


@pytest.mark.parametrize("args, message", [
    # An empty path meant "." to one command and mlx-lm's hub default model to another.
    (["generate", "--model", "", "--prompt", "x"], "argument --model: must be a path, got an "
                                                   "empty string"),
    (["chat", "--model=  "], "argument --model: must be a path, got an empty string"),
    (["serve", "--model", ""], "argument --model: must be a path, got an empty string"),
    (["demo", "--model", ""], "argument --model: must be a path, got an empty string"),
    (["bench", "--model", "", "--lengths", "64"], "argument --model: must be a path"),
    (["compare", "--model", ""], "argument --model: must be a path"),
    # --out "" wrote the bench files into the working directory; --json "" wrote none.
    (["bench", "--preset", "tiny", "--out", ""], "argument --out: must be a path, got an "
                                                  "empty string"),
    (["compare", "--preset", "tiny", "--prompt", "x", "--json", " "],
     "argument --json: must be a path, got an empty string"),
    (["make-checkpoint", ""], "argument out: must be a path, got an empty string"),
    (["compare", "--preset", "tiny"], "give --prompt TEXT (repeatable) or --prompts-file FILE"),
    # Checked before the model loads (it was only checked by the server after loading).
    (["serve", "--port", "99999"], "argument --port: must be a port number from 0 to 65535, "
                                   "got 99999"),
    # No chat template adds tokens: mlx-lm loaded the model, then failed (exit 1).
    (["generate", "--model", "m", "--ignore-chat-template", "--prompt", ""],
     "argument --prompt/-p: empty with --ignore-chat-template: there is no token to generate"),
    (["generate", "--model", "m", "-p=", "--ignore-chat-template"],
     "argument --prompt/-p: empty with --ignore-chat-template"),
])
def test_empty_paths_bad_ports_and_no_prompts_are_refused_up_front(args, message):
    out = _qab(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"qab {args[0]}: error: {message}" in out.stderr and "Traceback" not in out.stderr
    assert "no --model given" not in out.stderr


_KV_BITS = "must be one of 1, 2, 3, 4, 5, 6, 8 (the bit widths MLX quantizes to)"
_KV_GROUP = "must be one of 32, 64, 128 (the group sizes MLX quantizes with)"
_SEED = "must be an integer from 0 to 2**64 - 1 (18446744073709551615)"
_JSON = 'must be a JSON object such as {"enable_thinking": false}'
_SIZE = ("must be a size in bytes >= 0, optionally followed by M, MB, G or GB (10**6, 10**9), "
         "such as 500M or 8GB")


@pytest.mark.parametrize("args, message", [
    # Group size 0 crashed the process (SIGFPE, exit 136) once the cache was quantized;
    # bits 0/7/99 raised in mx.quantize; serve answered every request with an empty reply.
    (["generate", "--prompt", "hi", "--kv-bits", "4", "--kv-group-size", "0",
      "--quantized-kv-start", "0"], f"argument --kv-group-size: {_KV_GROUP}, got 0"),
    (["generate", "--kv-bits", "0"], f"argument --kv-bits: {_KV_BITS}, got 0"),
    (["generate", "--kv-bits", "7"], f"argument --kv-bits: {_KV_BITS}, got 7"),
    (["generate", "--kv-bits=99"], f"argument --kv-bits: {_KV_BITS}, got 99"),
    (["serve", "--kv-bits", "7"], f"argument --kv-bits: {_KV_BITS}, got 7"),
    (["serve", "--kv-group-size", "256"], f"argument --kv-group-size: {_KV_GROUP}, got 256"),
    (["generate", "--quantized-kv-start", "-1"],
     "argument --quantized-kv-start: must be an integer >= 0, got -1"),
    (["serve", "--quantized-kv-start", "x"],
     "argument --quantized-kv-start: must be an integer >= 0, got 'x'"),
    # mx.random.seed takes an unsigned 64-bit integer (else a TypeError traceback).
    (["generate", "--seed", "-1"], f"argument --seed: {_SEED}, got -1"),
    (["generate", "--seed", "99999999999999999999"],
     f"argument --seed: {_SEED}, got 99999999999999999999"),
    (["chat", "--seed=-1"], f"argument --seed: {_SEED}, got -1"),
    # Accepted silently (0, mlx-lm's default, switches top-k off and stays valid).
    (["generate", "--temp", "1", "--top-k", "-5"], "argument --top-k: must be an integer >= 0, "
                                                   "got -5"),
    (["serve", "--top-k", "-5"], "argument --top-k: must be an integer >= 0, got -5"),
    (["generate", "--num-draft-tokens", "-1"],
     "argument --num-draft-tokens: must be a positive integer, got -1"),
    (["serve", "--num-draft-tokens", "0"],
     "argument --num-draft-tokens: must be a positive integer, got 0"),
    # The server caps a request's max_tokens; the flag is the default of requests without one.
    (["serve", "--max-tokens", "5000000"], "argument --max-tokens: must be a positive integer "
                                           "up to 1048576 (the largest max_tokens qab serve "
                                           "accepts in a request), got 5000000"),
    # A JSONDecodeError traceback (generate) / a list that fails every request (serve).
    (["generate", "--chat-template-config", "{bad"],
     f"argument --chat-template-config: {_JSON}, got '{{bad'"),
    (["generate", "--chat-template-config", "[1]"],
     f"argument --chat-template-config: {_JSON}, got [1]"),
    (["serve", "--chat-template-args", "{bad"], f"argument --chat-template-args: {_JSON}, "
                                                "got '{bad'"),
    (["serve", "--chat-template-args", "[1]"], f"argument --chat-template-args: {_JSON}, "
                                               "got [1]"),
    # mx.load's "Could not infer file format from extension" traceback.
    (["generate", "--prompt-cache-file", "/nonexistent"],
     "argument --prompt-cache-file: no such file: '/nonexistent'"),
    # mlx-lm's own size parser: a decimal.InvalidOperation / KeyError traceback.
    (["serve", "--prompt-cache-bytes", "-5"], f"argument --prompt-cache-bytes: {_SIZE}, got '-5'"),
    (["serve", "--prompt-cache-bytes", "abc"],
     f"argument --prompt-cache-bytes: {_SIZE}, got 'abc'"),
    (["serve", "--prompt-cache-bytes=5K"], f"argument --prompt-cache-bytes: {_SIZE}, got '5K'"),
    # Batch sizes: with --prompt-concurrency 0 a batched request never started.
    (["serve", "--decode-concurrency", "0"],
     "argument --decode-concurrency: must be a positive integer, got 0"),
    (["serve", "--prompt-concurrency", "-1"],
     "argument --prompt-concurrency: must be a positive integer, got -1"),
    # mlx-lm's min-p sampler raises for it (only once --min-p is set).
    (["generate", "--min-tokens-to-keep", "-1"],
     "argument --min-tokens-to-keep: must be a positive integer, got -1"),
    # The full preset is written only 4-bit (exit status 1 before).
    (["make-checkpoint", "x", "--preset", "full"],
     "--preset full is written only with --layout mlx-q4: its hf layout would materialise "
     "every parameter unquantized"),
])
def test_flags_mlx_lm_fails_on_later_are_refused_up_front(args, message):
    out = _qab(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"qab {args[0]}: error: {message}", out.stderr
    assert "Traceback" not in out.stderr and "no --model given" not in out.stderr
    assert out.stdout == ""


def _prompt_cache(path, model="some/other-model"):
    """A small prompt cache written by mlx-lm's own save_prompt_cache, as
    mlx_lm.cache_prompt writes it (metadata: the model and its tokenizer_config)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    save_prompt_cache(str(path), [cache], {"model": model, "tokenizer_config": "{}"})
    return path


def test_good_values_of_the_checked_flags_pass(tmp_path):
    from qwen_apple_backend import cli

    cache = _prompt_cache(tmp_path / "prompt.safetensors")
    common = ["--kv-bits", "8", "--kv-group-size", "128", "--quantized-kv-start", "0",
              "--top-k", "0", "--num-draft-tokens", "1"]
    cli._check_count_flags("generate", [*common, "--seed", str(2**64 - 1), "--prompt-cache-file",
                                        str(cache), "--chat-template-config", "{}",
                                        "--min-tokens-to-keep", "1"])
    cli._check_count_flags("chat", ["--seed", "0"])
    cli._check_count_flags("serve", [*common, "--max-tokens", str(1 << 20),
                                     "--chat-template-args", '{"enable_thinking": false}',
                                     "--decode-concurrency", "1", "--prompt-concurrency", "1",
                                     "--prompt-cache-bytes", "0"])
    for size in ("1000", "1.5GB", "512m", ".5 G"):
        cli._check_count_flags("serve", ["--prompt-cache-bytes", size])
    with pytest.raises(SystemExit) as info:  # a file that is there, but not safetensors
        cli._check_count_flags("generate", ["--prompt-cache-file", str(tmp_path)])
    assert info.value.code == 2


def test_checked_sizes_are_what_mlx_lm_reads():
    # qab serve --prompt-cache-bytes takes exactly the texts mlx-lm's parser reads, with
    # the same value.
    from argparse import ArgumentTypeError

    from mlx_lm.utils import _parse_size

    from qwen_apple_backend.argtypes import byte_size

    for text in ("0", "7", "1.", ".5M", "1.5G", "2 gb", "3mb ", "4\tG", "-5", "abc", "", " 5",
                 "5K", "1e9", "1.2.3", "..5", "+5", "M", "5MBx", "1_000"):
        try:
            expected = _parse_size(text)
        except Exception:  # noqa: BLE001 - decimal.InvalidOperation, KeyError
            expected = None
        try:
            got = byte_size(text)
        except ArgumentTypeError:
            got = None
        assert got == expected, text


def test_a_file_that_is_not_a_prompt_cache_is_refused_up_front(tmp_path):
    # A junk .safetensors file ("[read] Unable to read 3 bytes") or a model's weights
    # ("not enough values to unpack") failed in mlx-lm with a traceback.
    import mlx.core as mx

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"abc")
    weights = tmp_path / "model.safetensors"
    mx.save_safetensors(str(weights), {"model.embed_tokens.weight": mx.zeros((4, 2))})
    head = "qab generate: error: argument --prompt-cache-file: "
    for path, why in ((junk, "not a valid safetensors file (file shorter than the 8-byte "
                             "header length)"),
                      (weights, "its safetensors metadata has no 0.model, "
                                "0.tokenizer_config, 1.0, 2.0 entries")):
        out = _qab("generate", "--prompt-cache-file", str(path), "--prompt", "hi", timeout=120)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1] == (
            f"{head}{str(path)!r} is not a prompt cache written by mlx-lm "
            f"(mlx_lm.cache_prompt): {why}"), out.stderr
        assert "Traceback" not in out.stderr and "no --model given" not in out.stderr


def test_mlx_lm_refusing_its_input_is_one_line(tmp_path):
    # mlx_lm.generate's ValueErrors ended in a traceback.
    cache = _prompt_cache(tmp_path / "prompt.safetensors", model="some/other-model")
    out = _qab("generate", "--prompt-cache-file", str(cache), "--model", str(tmp_path),
               "--prompt", "hi", timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"qab generate: error: Providing a different model ({tmp_path}) than that used to "
        "create the prompt cache (some/other-model) is an error.")
    assert "Traceback" not in out.stderr
    out = _qab("generate", "--prompt", "hi", "--image", str(tmp_path / "a.png"))
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("qab generate: error: The model ") and \
        last.endswith(" does not take images."), out.stderr
    assert "Traceback" not in out.stderr


def test_only_mlx_lm_s_own_value_errors_lose_their_traceback():
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p

    from qwen_apple_backend.cli import _raised_by_mlx_lm

    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError("no exception")

    assert _raised_by_mlx_lm(raised(lambda: apply_min_p(mx.zeros((1, 4)), 0.5, 0)))
    assert not _raised_by_mlx_lm(raised(lambda: int("x")))  # a ValueError of ours
    assert not _raised_by_mlx_lm(RuntimeError("not a ValueError"))


def test_quantize_activations_on_an_affine_checkpoint_names_the_modes():
    # It was reported as "weights do not match the model built from config.json: Mode
    # ({m.mode}) does not support activation quantization".
    out = _qab("generate", "--prompt", "hi", "--quantize-activations")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("qab generate: error: ") and last.endswith(
        ": activation quantization (--quantize-activations; quantize_activations in "
        "model_config) is supported only for checkpoints quantized in mode nvfp4 or mxfp8; "
        "this one is quantized in mode 'affine' (config.json)"), out.stderr
    assert "weights do not match" not in last and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_usage_lines_name_the_backend_flag_alike(command):
    # A missing --backend value printed "[--backend BACKEND]", a bad value of an mlx-lm
    # flag "[--backend NAME]".
    import contextlib
    import io

    from qwen_apple_backend.cli import _backend_parser, _check_count_flags

    lines = []
    for call in (lambda: _backend_parser(command).parse_known_args(["--backend"]),
                 lambda: _check_count_flags(command, ["--prefill-step-size", "0"])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            call()
        lines.append(err.getvalue().splitlines()[0])
    serve = " [--max-request-bytes N] [--request-timeout SECONDS]" if command == "serve" else ""
    module = {"generate": "mlx_lm.generate", "chat": "mlx_lm.chat", "serve": "mlx_lm.server"}
    assert lines == [f"usage: qab {command} [--backend NAME] [--qab-report]{serve} "
                     f"[flags of {module[command]}]"] * 2


def test_checked_kv_bits_group_sizes_and_seeds_are_what_mlx_accepts():
    import mlx.core as mx

    from qwen_apple_backend.argtypes import KV_BITS, KV_GROUP_SIZES

    def quantizes(bits, group_size):
        try:
            with mx.stream(mx.cpu):
                mx.eval(mx.quantize(mx.ones((2, 256)), group_size=group_size, bits=bits))
            return True
        except ValueError:
            return False

    assert tuple(b for b in range(1, 10) if quantizes(b, 64)) == KV_BITS
    # Not group size 0: mx.quantize divides by it (SIGFPE), which is why it is checked.
    assert tuple(g for g in (16, 32, 64, 128, 256) if quantizes(4, g)) == KV_GROUP_SIZES
    # In a child process: seeding here would change this worker's random state.
    code = ("import mlx.core as mx\nfor s in (-1, 0, 2**64 - 1, 2**64):\n"
            "    try:\n        mx.random.seed(s); print(s, 'ok')\n"
            "    except TypeError:\n        print(s, 'TypeError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split("\n")[:4] == [
        "-1 TypeError", "0 ok", f"{2**64 - 1} ok", f"{2**64} TypeError"], out.stderr


def test_draft_model_on_an_untrimmable_cache_is_one_clear_error(tiny_hf_f32):
    out = _qab("generate", "--model", str(tiny_hf_f32), "--draft-model", str(tiny_hf_f32),
               "--prompt", "a b", "--ignore-chat-template", "--max-tokens", "2")
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "qab generate: error: Speculative decoding requires a trimmable prompt cache (got "
        "{'ArraysCache'}): this model family's recurrent (Gated DeltaNet) layers keep a cache "
        "that cannot be trimmed, so --draft-model (speculative decoding) does not apply to it; "
        "leave --draft-model out")
    assert "Traceback" not in out.stderr


def test_help_says_which_model_and_seed_are_used():
    from qwen_apple_backend.cli import PASSTHROUGH

    # Without --model qab uses its demo model, not mlx_lm.generate's hub default.
    for cmd in ("generate", "chat", "serve"):
        out = _qab(cmd, "--help")
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert "Llama-3.2-3B-Instruct-4bit" not in text, cmd
        assert (f"Flags of {PASSTHROUGH[cmd][0]} follow. Without --model, qab uses its "
                "shipped demo model, not mlx-lm's hub default.") in text, cmd
        if cmd != "serve":  # mlx_lm.server's --model help names no default
            assert ("--model MODEL The path to the local model directory or Hugging Face "
                    "repo. Without --model, qab uses its shipped demo model (not mlx-lm's hub "
                    "default).") in text, cmd
    compare = " ".join(_qab("compare", "--help").stdout.split())
    assert ("--seed SEED weights seed of --preset (default 0); no effect with --model, since "
            "the prompts are text and decoding is greedy --dtype") in compare
    bench = " ".join(_qab("bench", "--help").stdout.split())
    assert ("--seed SEED weights seed of --preset, seed of the prompt token ids and of "
            "--synthetic-context's cache values (default 0)") in bench


def test_backends_json_into_a_closed_pipe_exits_quietly():
    # The reader is gone before qab writes (`qab backends --json | head -0`).
    proc = subprocess.Popen([sys.executable, "-m", "qwen_apple_backend.cli", "backends", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_chat_ends_cleanly_on_end_of_input(tiny_hf_f32):
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "chat", "--model",
                          str(tiny_hf_f32), "--max-tokens", "2"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "EOFError" not in out.stderr


def test_chat_ends_cleanly_on_ctrl_c(tiny_hf_f32):
    import signal
    import time

    # Ctrl-C raising KeyboardInterrupt in the chat process, as in a terminal:
    # a test run started in the background of a non-interactive shell
    # inherits SIGINT ignored (seen in a CI run: the chat then ended only at
    # EOF, status 0), so the child installs Python's handler itself.
    boot = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv = ['qab'] + sys.argv[1:]; "
            "runpy.run_module('qwen_apple_backend.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", boot, "chat", "--model", str(tiny_hf_f32)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Wait for the input prompt (the model is loaded), then interrupt.
    deadline, seen = time.monotonic() + 300, b""
    while "›".encode() not in seen and time.monotonic() < deadline:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    assert "›".encode() in seen, seen
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err


def test_bf16_moe_on_the_cpu_is_one_clear_error(tiny_hf_bf16):
    import mlx.core as mx

    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("a GPU runs bfloat16 experts")
    # Without the chat template: its special-token ids lie past this small-vocabulary
    # model's 1,024 embedding rows, which the loader now refuses before the experts run.
    out = _qab("generate", "--model", str(tiny_hf_bf16), "--prompt", "a b",
               "--ignore-chat-template", "--max-tokens", "2")
    assert out.returncode == 1
    assert "only in float32" in out.stderr and "--dtype float32" in out.stderr
    assert "Traceback" not in out.stderr


def test_make_checkpoint_default_dtype_runs_here(tmp_path):
    import mlx.core as mx

    from qwen_apple_backend.checkpoint import default_dtype

    gpu = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    assert default_dtype("hf") == ("bfloat16" if gpu else "float32")
    assert default_dtype("mlx-q4") == "bfloat16"
    help_text = _qab("make-checkpoint", "--help").stdout
    assert "--dtype {auto,bfloat16,float16,float32}" in help_text and "(default: auto)" in \
        help_text
    out = _qab("make-checkpoint", str(tmp_path / "ckpt"), "--vocab-size", "1024", "--quiet")
    assert out.returncode == 0, out.stderr
    assert f"(tiny, {default_dtype('hf')})" in out.stdout
    header = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "ckpt" / sorted(set(header["weight_map"].values()))[0]
    from qwen_apple_backend.loader import read_safetensors_header

    dtypes = {v["dtype"] for k, v in read_safetensors_header(shard).items()
              if k != "__metadata__" and "A_log" not in k}
    assert dtypes == {"F32" if not gpu else "BF16"}


_NO_TORCH = "import sys; sys.modules['torch'] = None  # transformers then finds no torch\n"


@pytest.mark.parametrize("code", [
    "import qwen_apple_backend.tokenizer, mlx_lm.utils, transformers",
    "from qwen_apple_backend.cli import main; main(['backends'])",
])
def test_no_transformers_torch_advisory_without_torch(code):
    # mlx_lm's import sets TRANSFORMERS_NO_ADVISORY_WARNINGS=1 in this process
    # (once any earlier test imported it); the children must not inherit it.
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run([sys.executable, "-c", _NO_TORCH + code], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    # Only that one advisory is dropped: transformers' other messages still print.
    out = subprocess.run([sys.executable, "-c", _NO_TORCH + "import qwen_apple_backend\n"
                          "from transformers.utils import logging\n"
                          "logging.get_logger('transformers').warning_advice('other advice')"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "other advice" in out.stderr, out.stderr


def test_help_strings_are_current_and_say_each_default_once():
    from qwen_apple_backend.envs import FUSABLE_KINDS, OPT_IN, OPTIMIZATIONS

    for cmd in ("bench", "compare"):
        out = _qab(cmd, "--help")
        assert out.returncode == 0, out.stderr
        # Names are wrapped whole (at spaces, never at a name's hyphen).
        assert not re.search(r"[a-z]-\n", out.stdout), out.stdout
        text = " ".join(out.stdout.split())
        ablate = text.split("--ablate NAMES comma-separated", 1)[1].split("--prefill-step")[0]
        for name in (*FUSABLE_KINDS, *OPTIMIZATIONS):
            assert name in ablate, (cmd, name)
        # The opt-in ones are named as such: every QAB_ENABLE name but decode-compile.
        opt_in = ablate.split("(the opt-in ones, ", 1)[1].split(", are on in")[0]
        assert opt_in == ", ".join(OPT_IN[1:-1]) + " and " + OPT_IN[-1], opt_in
        assert not re.search(r"\S {3,}--", out.stdout), out.stdout  # no runs of stray spaces
    for cmd in ("demo", "make-checkpoint"):
        out = _qab(cmd, "--help")
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        assert "(default: None)" not in text
        for option in text.split(" --")[1:]:
            assert option.count("default:") <= 1, option
    demo = " ".join(_qab("demo", "--help").stdout.split())
    assert "instead of the demo model (default: the demo model) --rebuild" in demo
    make = " ".join(_qab("make-checkpoint", "--help").stdout.split())
    assert "(small, fast test models; default: the real vocabulary) --overwrite" in make
    assert 'llama.cpp=model.gguf \\ --chat-template' in " ".join(
        _qab("compare", "--help").stdout.split())
    bench = " ".join(_qab("bench", "--help").stdout.split())
    assert "--shared-prefill LABEL build each length's decode context once with LABEL's" in bench
    assert "qab bench --preset full --lengths 256,4K,128K --shared-prefill fused" in bench


def test_demo_help_describes_every_option():
    out = _qab("demo", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for piece in ("--prompt PROMPT user message", "(default: Write a haiku about fast "
                  "inference.)", "--max-tokens MAX_TOKENS tokens to generate on each backend",
                  "(default: 32)", "--model PATH checkpoint directory", "--rebuild write the "
                  "cached copy", "fused and on the stock backend"):
        assert piece in text, piece


@pytest.mark.parametrize("argv,message", [
    (["bench", "--preset", "tiny", "--quick", "--ablate", "foo"],
     "qab bench: error: --ablate: unknown module kind or optimization 'foo'"),
    (["bench", "--preset", "tiny", "--quick", "--ablate", "moe", "--shared-prefill", "fast"],
     "qab bench: error: --shared-prefill: 'fast' is not a backend of this run (labels: stock, "
     "fused, fused-no-moe)"),
    (["compare", "--preset", "tiny", "--backends", "stock,nope", "--prompt", "hi"],
     "qab compare: error: unknown backend 'nope'"),
    (["compare", "--preset", "tiny", "--prompt", " "],
     "qab compare: error: --prompt: empty prompt"),
])
def test_bench_and_compare_usage_errors_exit_2_before_building_models(argv, message):
    out = _qab(*argv)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert "loaded" not in out.stderr and "building" not in out.stderr


@pytest.mark.parametrize("command", ["backends", "demo", "bench", "compare"])
def test_an_unknown_flag_gets_the_subcommands_usage(command, capsys):
    # (argparse reported it with the top-level usage, "usage: qab [-h] ...".)
    from qwen_apple_backend.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: qab {command} "), err
    assert err.rstrip().endswith(f"qab {command}: error: unrecognized arguments: --bogus"), err


def test_generate_from_a_prompt_cache_takes_the_caches_model(tiny_real_vocab, tmp_path):
    # Without --model, qab passes its demo model, which mlx-lm refused against a prompt
    # cache made with another model (a ValueError traceback); with --prompt-cache-file,
    # mlx-lm's own choice stands: the model the cache records.
    cache = tmp_path / "prompt.safetensors"
    made = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model",
                           str(tiny_real_vocab), "--prompt-cache-file", str(cache), "--prompt",
                           "You are a helpful assistant."],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and cache.is_file(), made.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate",
                        "--prompt-cache-file", str(cache), "--prompt", "hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "using the demo model" not in r.stderr and "Generation: 2 tokens" in r.stdout, (
        r.stdout + r.stderr)
