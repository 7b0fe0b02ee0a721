"""Every script in ``examples/`` runs on the tiny checkpoint and prints the values it promises.

Each example runs as a subprocess with ``--model`` pointing at the tiny real-layout
checkpoint (full vocabulary, real tokenizer, random weights), and the test reads
the ``key: value`` lines it prints. The subprocesses are started together, a few
at a time, by one fixture (most of each run is start-up: imports, tokenizer).
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["load_and_generate", "pipeline_chat", "streaming", "server_openai_client",
           "compare_backends", "write_your_own_plugin"]


PROMPT = "The three primary colours are"


def _free_loopback_port():
    """A free port on 127.0.0.1, or None where loopback sockets cannot bind."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError:
        return None


def _argv(model: str, port) -> dict:
    runs = {
        "load_and_generate": ["--prompt", PROMPT, "--max-tokens", "10"],
        "streaming": ["--prompt", PROMPT, "--max-new-tokens", "10"],
        "pipeline_chat": ["--max-new-tokens", "6"],
        "compare_backends": ["--max-tokens", "6", "--prompt", "Hello", "--prompt", "1, 2, 3,"],
        "write_your_own_plugin": [],
    }
    if port is not None:
        runs["server_openai_client"] = ["--port", str(port), "--max-tokens", "5"]
    return {name: ["--model", model, *args] for name, args in runs.items()}


@pytest.fixture(scope="module")
def outputs(tiny_real_vocab):
    """name -> CompletedProcess of each example run (the server one only with a free port)."""
    port = _free_loopback_port()
    argv = _argv(str(tiny_real_vocab), port)

    def run(name):
        return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *argv[name]],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run, name) for name in argv}
    results = {name: f.result() for name, f in futures.items()}
    results["_port"] = port
    return results


def _stdout(outputs, name: str) -> str:
    out = outputs[name]
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _value(stdout: str, key: str) -> str:
    found = re.findall(rf"^{re.escape(key)}: (.*)$", stdout, flags=re.M)
    assert found, f"no '{key}:' line in:\n{stdout}"
    return found[-1]


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_has_a_docstring_and_a_model_flag(name):
    source = (EXAMPLES / f"{name}.py").read_text(encoding="utf-8")
    assert ast.get_docstring(ast.parse(source))
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--model" in out.stdout and "demo model" in out.stdout


def test_every_example_is_tested_and_listed_in_the_readme():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    for name in SCRIPTS:
        assert f"examples/{name}.py" in readme


def test_load_and_generate_and_streaming_agree(outputs):
    out = _stdout(outputs, "load_and_generate")
    assert "moe: 4/4 fused" in out and "gdn: 3/3 fused" in out
    assert _value(out, "prompt") == repr(PROMPT)
    generated = _value(out, "generated")
    assert len(ast.literal_eval(generated)) > 0

    out = _stdout(outputs, "streaming")
    # The pipeline's stream is token for token what mlx_lm.generate printed above.
    assert _value(out, "streamed") == generated
    assert _value(out, "tokens") == "10"
    assert _value(out, "finish_reason") == "length"
    assert int(_value(out, "pieces")) >= 2
    assert _value(out, "streamer saw the same text") == "True"
    assert _value(out, "same as non-streamed") == "True"


def test_pipeline_chat(outputs):
    out = _stdout(outputs, "pipeline_chat")
    replies = re.findall(r"^assistant: (.*)$", out, flags=re.M)
    assert len(replies) == 2 and all(ast.literal_eval(r) for r in replies)
    assert re.findall(r"^user: (.*)$", out, flags=re.M)[1] == repr("And one more?")
    assert _value(out, "messages") == "5"  # system, user, assistant, user, assistant
    assert _value(out, "backend") == "auto"


def test_compare_backends(outputs):
    out = _stdout(outputs, "compare_backends")
    assert "TTFT ms" in out and "first divergence" in out
    # float32 weights: fused and stock pick the same greedy tokens.
    for i in (1, 2):
        assert f"prompt {i}: fused vs stock: agreement 100.0%, first divergence None" in out


def test_write_your_own_plugin(outputs):
    out = _stdout(outputs, "write_your_own_plugin")
    lines = out.splitlines()
    builtin = "qwen3_5_moe -> qwen_apple_backend.models.qwen3_5_moe:Adapter (plugin qwen)"
    assert f"before: qwen3_5_moe resolves to {builtin}" in lines
    assert _value(out, "registered plugin") == "my-plugin"
    assert "my_toy_arch resolves to my_toy_arch -> __main__:ToyAdapter (plugin my-plugin)" \
        in lines
    assert "after: qwen3_5_moe resolves to qwen3_5_moe -> __main__:ObservingAdapter " \
        "(plugin my-plugin)" in lines
    assert "loaded with adapter __main__:ObservingAdapter from plugin my-plugin" in lines
    assert _value(out, "ObservingAdapter.fuse calls") == "1"
    assert "moe: 4/4 fused" in out  # the displaced adapter still fused the model
    assert f"unregistered: qwen3_5_moe resolves to {builtin}" in lines


def test_server_openai_client(outputs):
    pytest.importorskip("openai")
    port = outputs["_port"]
    if port is None:
        pytest.skip("cannot bind a port on 127.0.0.1 here")
    out = _stdout(outputs, "server_openai_client")
    assert f"--port {port}" in _value(out, "starting")
    assert ast.literal_eval(_value(out, "reply"))
    assert _value(out, "finish_reason") == "length"
    assert _value(out, "completion_tokens") == "5"
    assert out.rstrip().endswith("server stopped")


def test_a_bad_model_path_is_one_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")

    def run(name):
        return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--model", missing],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(SCRIPTS, pool.map(run, SCRIPTS)))
    for name, out in results.items():
        assert out.returncode == 1, f"{name}:\n{out.stderr}"
        assert "Traceback" not in out.stderr, f"{name}:\n{out.stderr}"
        assert f"{missing}: checkpoint directory not found" in out.stderr, name
        assert f"{name}.py: error:" in out.stderr, name


@pytest.mark.parametrize("name,argv,message", [
    ("load_and_generate", ["--max-tokens", "0"], "argument --max-tokens: must be a positive "
                                                 "integer, got 0"),
    ("streaming", ["--max-new-tokens", "-5"], "argument --max-new-tokens: must be a positive "
                                              "integer, got -5"),
    ("pipeline_chat", ["--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive "
                                                 "integer, got 0"),
    ("compare_backends", ["--max-tokens", "0"], "argument --max-tokens: must be a positive "
                                                "integer, got 0"),
    ("server_openai_client", ["--max-tokens", "0"], "argument --max-tokens: must be a positive "
                                                    "integer, got 0"),
    ("server_openai_client", ["--port", "70000"], "argument --port: must be a port number from "
                                                  "0 to 65535, got 70000"),
])
def test_bad_counts_are_usage_errors_before_any_work(name, argv, message):
    # (--max-tokens -5 generated without a limit; 0 ended in mlx-lm's traceback.)
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.rstrip().endswith(f"{name}.py: error: {message}"), out.stderr
