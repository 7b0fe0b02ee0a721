"""`qab serve`: mlx-lm's own OpenAI-compatible server with the fused backend, end to end.

Each server is a real `qab serve` subprocess on a free loopback port, started once per
module and spoken to with the `openai` client (and plain http.client for the bad
requests). Greedy replies are compared token for token with `mlx_lm.generate` on the
same checkpoint loaded by `load(..., backend="fused")` in this process.

Tool calls and thinking: a random model never writes `<tool_call>` or `<think>`, so a
second checkpoint of the same layout gets weights that make greedy decoding follow a
fixed chain of tokens: every block's output projection is zero (the residual stream
stays the token embedding) and each script token's embedding is a one-hot vector that
the lm_head maps to the next script token. The chain starts at the "\\n" that ends the
chat prompt and spells Qwen3.5/3.6 output - a think block, a sentence, an XML tool
call - which mlx-lm's own parsers must turn into `reasoning` and `tool_calls`.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

MAX_TOKENS = 12
BODY_LIMIT = 64 * 1024  # --max-request-bytes of the test server
STARTUP_TIMEOUT = 180


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base_url, api_key="not-needed", max_retries=0,
                             timeout=120, **kwargs)

    def raw(self, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(model: Path, workdir: Path, *extra: str) -> Server:
    """Start `qab serve` on a free loopback port (returns at once)."""
    port = _free_port()
    log_path = workdir / f"serve-{port}.log"
    # No Hugging Face cache directory: /v1/models must still answer (stock mlx-lm fails).
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(workdir / "no-hf-cache"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "qwen_apple_backend.cli", "serve", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--backend", "fused", "--qab-report",
           "--max-tokens", "64", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(proc, port, model, log_path)


def _wait_ready(server: Server) -> None:
    """Wait until /v1/models answers and the model is loaded."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if server.proc.poll() is not None:
            pytest.fail(f"qab serve exited with {server.proc.returncode}:\n{server.log()}")
        if time.monotonic() > deadline:
            pytest.fail(f"qab serve not ready after {STARTUP_TIMEOUT} s:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.base_url}/models", timeout=2) as r:
                answered = r.status == 200
        except OSError:
            answered = False
        # qab serve loads the model (and prints --qab-report) before it starts listening.
        if answered and "moe:" in server.log():
            return
        time.sleep(0.2)


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def reference(tiny_real_vocab):
    """The same checkpoint through our load(..., backend="fused"), in this process."""
    from qwen_apple_backend import load

    return load(tiny_real_vocab, backend="fused")


@pytest.fixture(scope="module")
def servers(request, tiny_real_vocab, scripted_checkpoint, tmp_path_factory):
    """Both servers, started together (and the reference loaded) to save wall time."""
    workdir = tmp_path_factory.mktemp("serve")
    started = {}
    try:
        started["main"] = _launch(tiny_real_vocab, workdir, "--max-request-bytes",
                                  str(BODY_LIMIT))
        started["scripted"] = _launch(scripted_checkpoint, workdir)
        request.getfixturevalue("reference")
        for server in started.values():
            _wait_ready(server)
        yield started
    finally:
        for server in started.values():
            _stop(server)


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def scripted_server(servers):
    return servers["scripted"]


def _greedy(reference, prompt_ids: list[int], max_tokens: int = MAX_TOKENS):
    """Greedy text and token ids from mlx-lm's stream_generate (the text is what
    `mlx_lm.generate` returns: it joins these pieces)."""
    from mlx_lm.generate import stream_generate

    model, tokenizer = reference
    text, ids = "", []
    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens):
        text += r.text
        ids.append(r.token)
    return text, ids


def _chat_ids(reference, messages, **kwargs) -> list[int]:
    return reference[1].apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------- basics


def test_models_lists_the_served_checkpoint(server):
    models = server.client().models.list()
    assert str(server.model.resolve()) in [m.id for m in models.data]


def test_server_runs_the_fused_backend(server):
    log = server.log()
    assert "backend=fused architecture=qwen3_5_moe" in log
    assert "attn: 1/1 fused -> FusedGQAAttention" in log
    assert "gdn: 3/3 fused -> FusedGatedDeltaNet" in log
    assert "moe: 4/4 fused -> FusedSparseMoeBlock" in log


def test_chat_completion_equals_fused_generate(server, reference):
    import mlx_lm

    messages = _chat("Name three primes.")
    prompt = _chat_ids(reference, messages)
    text, ids = _greedy(reference, prompt)
    assert mlx_lm.generate(*reference, prompt=prompt, max_tokens=MAX_TOKENS) == text
    resp = server.client().chat.completions.create(
        model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True)
    choice = resp.choices[0]
    assert choice.message.content == text
    # mlx-lm returns each token's id with its logprob.
    assert [t.model_extra["id"] for t in choice.logprobs.content] == ids
    assert choice.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), MAX_TOKENS)


def test_streamed_chat_completion(server, reference):
    messages = _chat("Count from one to five.")
    text, _ = _greedy(reference, _chat_ids(reference, messages))
    stream = server.client().chat.completions.create(
        model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True)
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert sum(1 for p in pieces if p) > 1  # really streamed, not one block
    assert "".join(pieces) == text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_completion(server, reference, stream):
    prompt = "The capital of France is" + (" known" if stream else "")
    text, _ = _greedy(reference, reference[1].encode(prompt))
    resp = server.client().completions.create(
        model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stream=stream)
    if stream:
        chunks = list(resp)
        assert len(chunks) > 1
        got = "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        got = resp.choices[0].text
        assert resp.choices[0].finish_reason == "length"
    assert got == text


def test_two_concurrent_streams(server, reference):
    n = 16
    prompts = ["Tell me about the sea.", "Write a short poem about mountains and rivers."]
    expected = [_greedy(reference, _chat_ids(reference, _chat(p)), n)[0] for p in prompts]
    client = server.client()
    barrier = threading.Barrier(len(prompts))
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            stream = client.chat.completions.create(
                model="default_model", messages=_chat(prompts[i]), max_tokens=n,
                temperature=0, stream=True)
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == expected


def test_stop_sequence(server, reference):
    messages = _chat("Describe a forest.")
    _, ids = _greedy(reference, _chat_ids(reference, messages), 2 * MAX_TOKENS)
    tok = reference[1]
    # A stop word that is exactly one generated token, tokenizes back to it, and
    # first occurs at k >= 2; the reply is everything before it.
    for k in range(2, len(ids)):
        word = tok.decode([ids[k]])
        if (word.strip() and "\ufffd" not in tok.decode(ids[:k + 1]) and ids[k] not in ids[:k]
                and tok.encode(word, add_special_tokens=False) == [ids[k]]):
            break
    else:
        pytest.fail(f"no usable stop word in {ids}")
    resp = server.client().chat.completions.create(
        model="default_model", messages=messages, max_tokens=2 * MAX_TOKENS, temperature=0,
        stop=[word])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == tok.decode(ids[:k])
    assert resp.usage.completion_tokens == k + 1  # the stop word's token was generated


def test_client_disconnect_mid_stream(server, reference):
    client = server.client()
    stream = client.chat.completions.create(
        model="default_model", messages=_chat("Tell me a long story."), max_tokens=64,
        temperature=0, stream=True)
    got = [next(stream) for _ in range(3)]
    assert any(c.choices[0].delta.content for c in got)
    stream.close()  # hang up with the reply half sent

    # The server notices on its next write and keeps serving.
    deadline = time.monotonic() + 30
    while "disconnected before the response was complete" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    messages = _chat("Name three primes.")
    text, _ = _greedy(reference, _chat_ids(reference, messages))
    resp = client.chat.completions.create(model="default_model", messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == text
    assert server.proc.poll() is None


def test_report_is_printed_once_at_startup(server, reference):
    # One request, so the generation thread has surely run: it must not load (or print) again.
    resp = server.client().chat.completions.create(
        model="default_model", messages=_chat("Hello"), max_tokens=2, temperature=0.0)
    assert resp.choices[0].finish_reason
    log = server.log()
    assert log.count("moe: 4/4 fused") == 1, log
    assert log.index("moe: 4/4 fused") < log.index("Starting httpd"), log


@pytest.mark.parametrize("case", ["missing", "no-tokenizer", "bad-env", "bad-port", "draft"])
def test_serve_fails_at_startup_on_a_bad_model_or_environment(case, tiny_hf_f32, tmp_path):
    model = tmp_path / "missing"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if case == "no-tokenizer":
        model = tmp_path / "ckpt"
        shutil.copytree(tiny_hf_f32, model)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).unlink()
    if case == "bad-env":
        model, env["QAB_DISABLE"] = tiny_hf_f32, "moe,bogus"
    port = 99999 if case == "bad-port" else _free_port()
    if case in ("bad-port", "draft"):
        model = tiny_hf_f32
    # Stock served with a draft model and every request then failed after its status line.
    extra = ["--draft-model", str(tiny_hf_f32)] if case == "draft" else []
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "serve", "--model",
                          str(model), "--host", "127.0.0.1", "--port", str(port), *extra],
                         capture_output=True, text=True, timeout=120, env=env)
    expected = {"missing": (1, "qab serve: error: " + str(model) + ": checkpoint directory "
                               "not found"),
                "no-tokenizer": (1, "tokenizer.json not found"),
                "bad-env": (2, "qab: error: QAB_DISABLE: unknown optimization 'bogus'"),
                # argparse's line, before the model loads.
                "bad-port": (2, "qab serve: error: argument --port: must be a port number "
                                "from 0 to 65535, got 99999"),
                "draft": (1, "qab serve: error: --draft-model (speculative decoding) needs a "
                             "prompt cache that can be trimmed")}[case]
    assert out.returncode == expected[0], out.stderr
    assert expected[1] in out.stderr and "Traceback" not in out.stderr
    assert "Starting httpd" not in out.stderr


def test_serve_fails_at_startup_when_the_port_is_taken(tiny_hf_f32):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "serve",
                              "--model", str(tiny_hf_f32), "--host", "127.0.0.1", "--port",
                              str(port)], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 1, out.stderr
    assert f"qab serve: error: cannot serve on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


# ----------------------------------------------------------------- bad requests


def test_install_wraps_mlx_lm_server_and_uninstall_restores():
    import mlx_lm.server as mlx_server

    from qwen_apple_backend import server as qab_server

    def current():
        return (mlx_server._run_http_server, mlx_server.scan_cache_dir,
                mlx_server.ResponseGenerator.generate, mlx_server.ModelProvider._load)

    before = current()
    qab_server.install(max_body_bytes=1024)
    qab_server.install(max_body_bytes=1024)  # again: each is wrapped once
    try:
        for fn in current():
            assert fn.__qab_patched__
        assert not getattr(qab_server._METHODS[(mlx_server.ModelProvider, "_load")],
                           "__qab_patched__", False)
        handler = qab_server.make_handler_class(max_body_bytes=1024)
        assert issubclass(handler, mlx_server.APIHandler)
        assert handler.do_GET is mlx_server.APIHandler.do_GET  # mlx-lm serves the rest
    finally:
        qab_server.uninstall()
    assert current() == before
    with pytest.raises(ValueError, match="positive"):
        qab_server.install(max_body_bytes=0)


def test_check_checkpoint_reads_no_weights_but_finds_what_load_would(tiny_hf_f32, tmp_path):
    import shutil

    from qwen_apple_backend.errors import CheckpointError, MissingCheckpointFileError
    from qwen_apple_backend.loader import check_checkpoint

    assert check_checkpoint(tiny_hf_f32, "fused") == Path(tiny_hf_f32)
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_f32, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                  if k != "model_type"}))
    with pytest.raises(CheckpointError, match="config.json: missing required field 'model_type'"):
        check_checkpoint(copy)
    (copy / "config.json").write_text(json.dumps(config))
    for f in copy.glob("model*.safetensors"):
        f.unlink()
    with pytest.raises(MissingCheckpointFileError, match="model-00001-of-00002.safetensors: shard "
                                                         "listed in model.safetensors.index.json"):
        check_checkpoint(copy, "fused")


def test_install_refuses_token_ids_past_the_embedding(tiny_hf_f32, monkeypatch):
    # install() wraps the server's request tokenizer: a token id past the model's
    # embedding rows (the tiny checkpoint: 1,024 rows, Qwen's full tokenizer) is the
    # request's error, which mlx-lm's generation thread hands back to that request
    # (the gather crashed the whole server on the CPU before), and serving goes on.
    import types

    import mlx_lm.server as mlx_server

    from qwen_apple_backend import load
    from qwen_apple_backend import server as qab_server
    from qwen_apple_backend.errors import PromptError

    prompts = iter([[1, 2, 1023], [1, 248045, 2]])
    monkeypatch.setattr(mlx_server.ResponseGenerator, "_tokenize",
                        lambda self, tokenizer, request, args: (next(prompts), [], [], "", None))
    fake = mlx_server.ResponseGenerator._tokenize
    model, _ = load(tiny_hf_f32, backend="fused")
    me = types.SimpleNamespace(model_provider=types.SimpleNamespace(model=model))
    qab_server.install(max_body_bytes=1024)
    try:
        tokenize = mlx_server.ResponseGenerator._tokenize
        assert tokenize.__qab_patched__
        assert tokenize(me, None, None, None)[0] == [1, 2, 1023]
        with pytest.raises(PromptError, match=r"^the prompt holds token id 248045, outside the "
                                              r"model's 1024 embedding rows"):
            tokenize(me, None, None, None)
    finally:
        qab_server.uninstall()
    assert mlx_server.ResponseGenerator._tokenize is fake


def test_a_request_body_cut_short_is_408_after_the_read_timeout():
    # Stock waits forever for the rest of the body, a thread held per connection. An
    # in-process server with mlx-lm's handler: the 408 comes before any generation.
    import threading
    import types

    from qwen_apple_backend import server as qab_server

    handler = qab_server.make_handler_class(max_body_bytes=1024, read_timeout=0.5)
    stub = types.SimpleNamespace(cli_args=types.SimpleNamespace(allowed_origins=["*"]))
    httpd = qab_server.QABHTTPServer(("127.0.0.1", 0), lambda *a, **k: handler(stub, *a, **k))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(httpd.server_address, timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"prompt": ')
            reply = conn.makefile("rb").read()  # stock: no reply, TimeoutError at 10 s
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 408") or head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"] == (
            "request body: the client sent nothing for 0.5 s before its Content-Length of 100 "
            "bytes had arrived (qab serve --request-timeout)")
        with socket.create_connection(httpd.server_address, timeout=10) as conn:
            # Nothing at all: the connection is closed without a reply.
            assert conn.makefile("rb").read() == b""
    finally:
        httpd.shutdown()
        httpd.server_close()
    with pytest.raises(ValueError, match="read_timeout must be positive"):
        qab_server.make_handler_class(read_timeout=0)


@pytest.mark.parametrize("flag,value,message", [
    ("--max-request-bytes", "0", "--max-request-bytes: must be a positive integer"),
    ("--request-timeout", "0", "--request-timeout: must be a positive number, got 0"),
    ("--request-timeout", "inf", "--request-timeout: must be a positive number"),
])
def test_serve_rejects_a_non_positive_body_limit_or_timeout(capsys, flag, value, message):
    from qwen_apple_backend.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", flag, value])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _assert_alive(server) -> None:
    status, body = server.raw("GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    resp = server.client().completions.create(model="default_model", prompt="Hi",
                                              max_tokens=2, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_malformed_json_is_400(server):
    status, body = server.raw("POST", "/v1/chat/completions", b'{"messages": [',
                              {"Content-Type": "application/json"})
    assert status == 400
    assert "Invalid JSON" in json.loads(body)["error"]
    _assert_alive(server)


def test_body_that_is_not_utf8_is_400(server):
    # Stock mlx-lm: UnicodeDecodeError escapes its handler, the client gets no reply.
    status, body = server.raw("POST", "/v1/chat/completions", b"\xff\xfe{}",
                              {"Content-Type": "application/json"})
    assert status == 400
    assert "not UTF-8" in json.loads(body)["error"]
    _assert_alive(server)


@pytest.mark.parametrize("path,body,message", [
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "'prompt' must be a non-empty string"),
    ("/v1/completions", {"max_tokens": 4}, "'prompt' must be a non-empty string"),
    ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", [1, 2], "must be a JSON object"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10 ** 20}, "above this server's limit"),
    # A stop of another type: stock's TypeError while it builds the stop sequences.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stop": 5}, "'stop' must be a string or a list of non-empty strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stop": [None]}, "'stop' must be a string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "stream": True, "stop": 3.5}, "'stop' must be a string or a list"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": 7}, "'stop' must be a string"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": ["x", ""]},
     "'stop' must be a string or a list of non-empty strings"),
    # Stock answers these with a template error as a 404 (its thread survives).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"content": "x"}]},
     "'messages[1].role' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": 5}, "'chat_template_kwargs' must be an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "'messages[0].content' must be a string, a list of parts or null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "'messages[0].content[0].text' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]},
     "'messages[0].content[0]' must be an object with a string 'type'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": "x"},
     "'tools' must be a list of tool objects"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "draft_model": 5},
     "'draft_model' must be a string"),
    ("/v1/completions", {"prompt": "Hi", "model": 5}, "'model' must be a string"),
    # A path: stock would load the server's working directory.
    ("/v1/completions", {"prompt": "Hi", "model": ""}, "'model' must be a model name or path"),
    # Stock passes these on: its seed() raised in the generation thread after the status
    # line (the client got no reply); NaN passed its range checks; true passed as 1.
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "seed": -1},
     "'seed' must be in 0..2**64-1"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "seed": 1 << 64},
     "'seed' must be in 0..2**64-1"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": float("nan")},
     "'temperature' must be a finite number, got nan"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_p": float("inf")},
     "'top_p' must be a finite number"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True},
     "'max_tokens' must be an integer, not a boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": None,
                                            "tool_calls": "x"}]},
     "'messages[1].tool_calls' must be a list of tool call objects"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "'messages[0].tool_calls[0]' must be an object with a 'function' object"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]},
     "'messages[0].tool_calls[0].function.arguments' must be a JSON object or its text"),
])
def test_requests_that_would_kill_the_generation_thread_are_400(server, path, body, message):
    # Stock mlx-lm 0.32: an empty prompt raises in its generation thread, which
    # dies; every later request then fails.
    status, reply = server.raw("POST", path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    assert status == 400
    assert message in json.loads(reply)["error"]
    _assert_alive(server)


def test_an_error_past_the_route_check_is_400(server):
    # The chat template rejects the role: stock answers its generator's error 404.
    status, reply = server.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"})
    assert status == 400
    assert "robot" in json.loads(reply)["error"]
    # A route that does not exist keeps its 404.
    assert server.raw("POST", "/v1/nothing", b"{}", {"Content-Type": "application/json"})[0] == 404
    _assert_alive(server)


def test_a_model_that_cannot_be_loaded_is_404_and_the_served_one_stays(server, tmp_path):
    # Stock drops the served model before it tries the request's, so the next request
    # loaded it again (and --qab-report printed its report again).
    (tmp_path / "config.json").write_text("{}")
    loads = server.log().count("moe: 4/4 fused")
    for model, message in [(str(tmp_path / "absent"), "checkpoint directory not found"),
                           (str(tmp_path), "tokenizer.json not found")]:
        status, reply = server.raw("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": "Hi", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"})
        assert status == 404
        assert message in json.loads(reply)["error"]
        _assert_alive(server)
    assert server.log().count("moe: 4/4 fused") == loads


@pytest.mark.parametrize("token", [-1, 248320, 10 ** 9])
def test_a_logit_bias_past_the_vocabulary_is_400(server, token):
    # Stock: an id past the logits crashed the whole server on the CPU (segfault).
    status, reply = server.raw("POST", "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(token): 5}}).encode(),
        {"Content-Type": "application/json"})
    assert status == 400
    assert json.loads(reply)["error"] == (f"'logit_bias' names token id {token}, outside the "
                                          "model's 248320 vocabulary rows (0..248319)")
    _assert_alive(server)


def test_a_request_draft_model_is_refused_without_dropping_the_served_model(server, tmp_path):
    # Stock drops the served model and loads it again with the draft, then fails in the
    # generation thread after the status line (no reply), or, for a draft that cannot be
    # loaded, answers 404 having dropped the served model.
    loads = server.log().count("moe: 4/4 fused")
    status, reply = server.raw("POST", "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 2, "draft_model": str(server.model)}).encode(),
        {"Content-Type": "application/json"})
    assert status == 400
    assert "'draft_model' (speculative decoding) needs a prompt cache that can be trimmed" in (
        json.loads(reply)["error"])
    status, reply = server.raw("POST", "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 2, "draft_model": str(tmp_path / "absent")}).encode(),
        {"Content-Type": "application/json"})
    assert status == 404
    assert "checkpoint directory not found" in json.loads(reply)["error"]
    _assert_alive(server)
    assert server.log().count("moe: 4/4 fused") == loads


def test_well_formed_content_parts_and_tools_still_pass(server):
    # The shape checks above let through what stock accepts: text parts, a null
    # assistant content, tool calls with JSON text or object arguments, a list of
    # tools, string model names, a seed and a logit_bias inside the vocabulary.
    body = {"model": "default_model",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "text", "text": " there"}]},
                         {"role": "assistant", "content": None},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "id": "c1",
                              "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                             {"function": {"name": "g", "arguments": {"b": 2}}}]},
                         {"role": "tool", "content": "3"},
                         {"role": "user", "content": "again"}],
            "tools": [], "max_tokens": 2, "temperature": 0, "stop": ["zz"], "seed": 3,
            "logit_bias": {"5": 1.0, "1023": -1.0}}
    status, reply = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["finish_reason"] in ("length", "stop")


def test_oversized_request_is_413(server):
    big = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1}).encode()
    status, body = server.raw("POST", "/v1/completions", big,
                              {"Content-Type": "application/json"})
    assert status == 413
    assert f"limit of {BODY_LIMIT} bytes" in json.loads(body)["error"]

    # A declared size far beyond memory is refused before reading (stock: MemoryError).
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: 1000000000000\r\n\r\n{\"prompt\": ")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 413 ")

    status, _ = server.raw("POST", "/v1/completions", b"{}", {"Content-Length": "-1"})
    assert status == 400

    # The openai client sees the same 413 as an APIStatusError.
    with pytest.raises(openai.APIStatusError) as info:
        server.client().chat.completions.create(
            model="default_model", messages=_chat("y" * BODY_LIMIT), max_tokens=1)
    assert info.value.status_code == 413
    _assert_alive(server)


# ------------------------------------------------------- tool calls and thinking

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}, "hours": {"type": "array"}},
            "required": ["city"],
        },
    },
}]


def test_mlx_lm_parses_the_chat_templates_tool_calls(reference):
    """mlx-lm picks its Qwen3.5/3.6 XML tool parser from our chat template, and that
    parser reads back exactly the calls the template writes."""
    tok = reference[1]  # mlx-lm's TokenizerWrapper, from mlx_lm.utils.load_tokenizer
    assert tok.tool_parser.__module__ == "mlx_lm.tool_parsers.qwen3_coder"
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert (tok.think_start, tok.think_end) == ("<think>", "</think>")
    assert (tok.think_start_id, tok.think_end_id) == (248068, 248069)

    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
             {"name": "get_weather",
              "arguments": {"city": "New\nYork", "metric": True, "hours": [6, 12]}}]
    messages = [*_chat("Weather?"), {"role": "assistant", "content": "",
                                     "tool_calls": [{"type": "function", "function": c}
                                                    for c in calls]}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" in text
    reply = text.split("<|im_start|>assistant\n")[-1]  # past the format example
    bodies = [b.split(tok.tool_call_end)[0] for b in reply.split(tok.tool_call_start)[1:]]
    assert [tok.tool_parser(b, TOOLS) for b in bodies] == calls


SCRIPT_PIECES = (
    # One token each, none repeated: the chain is keyed by the current token only.
    "<think>", "The", " user", " wants", " the", " Paris", " forecast", ".", "</think>",
    "\n\n", "Let", " me", " check", "<tool_call>",
    "<", "function", "=get", "_weather", "><", "parameter", "=", "city", ">P", "aris", "</",
    "param", "eter", "></", "func", "tion", ">", "</tool_call>",
)
SCRIPT_REASONING = "The user wants the Paris forecast."
SCRIPT_CONTENT = "\n\nLet me check"


@pytest.fixture(scope="module")
def scripted_checkpoint(tiny_real_vocab, tmp_path_factory):
    """tiny_real_vocab with weights that make greedy decoding spell SCRIPT_PIECES."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("scripted") / "ckpt"
    shutil.copytree(tiny_real_vocab, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    # Byte-level BPE spells " " and "\n" as "Ġ" and "Ċ"; the pieces are otherwise ASCII.
    ids = [tok.token_to_id(p.replace(" ", "\u0120").replace("\n", "\u010a"))
           for p in SCRIPT_PIECES]
    start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids[-1]
    chain = [start, *ids, tok.token_to_id("<|im_end|>")]
    assert None not in chain and len(set(chain[:-1])) == len(chain) - 1, chain
    config = json.loads((out / "config.json").read_text())["text_config"]
    hidden = config["hidden_size"]
    assert len(chain) - 1 <= hidden

    zero_suffixes = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight",
                     "mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight")
    for path in sorted(tiny_real_vocab.glob("model*.safetensors")):
        weights, metadata = mx.load(str(path), return_metadata=True)
        for name in list(weights):
            if name.startswith("model.language_model.") and name.endswith(zero_suffixes):
                weights[name] = mx.zeros_like(weights[name])
        if "model.language_model.embed_tokens.weight" in weights:
            emb = weights["model.language_model.embed_tokens.weight"]
            rows = mx.array(chain[:-1])
            emb[rows] = mx.eye(hidden, dtype=emb.dtype)[: len(chain) - 1]
            weights["model.language_model.embed_tokens.weight"] = emb
        if "model.language_model.norm.weight" in weights:  # zero-centred: scale 1
            weights["model.language_model.norm.weight"] = mx.zeros((hidden,))
        if "lm_head.weight" in weights:
            head = mx.zeros_like(weights["lm_head.weight"])
            head[mx.array(chain[1:])] = mx.eye(hidden, dtype=head.dtype)[: len(chain) - 1]
            weights["lm_head.weight"] = head
        mx.save_safetensors(str(out / path.name), weights, metadata=metadata)
    return out


def _tool_request(**kwargs):
    return dict(model="default_model", messages=_chat("What's the weather in Paris?"),
                tools=TOOLS, max_tokens=64, temperature=0, **kwargs)


def test_scripted_model_writes_the_raw_tags(scripted_server, reference):
    """Control: the model really writes the Qwen tags, token by token."""
    prompt = reference[1].apply_chat_template(_chat("What's the weather in Paris?"),
                                              tools=TOOLS, tokenize=False,
                                              add_generation_prompt=True)
    body = json.dumps({"prompt": prompt, "max_tokens": 64, "temperature": 0,
                       "logprobs": True}).encode()
    status, raw = scripted_server.raw("POST", "/v1/completions", body,
                                      {"Content-Type": "application/json"})
    assert status == 200, raw
    ids = [t["id"] for t in json.loads(raw)["choices"][0]["logprobs"]["content"]]
    assert reference[1].decode(ids) == "".join(SCRIPT_PIECES) + "<|im_end|>"


def test_tool_call_and_reasoning_in_openai_fields(scripted_server):
    resp = scripted_server.client().chat.completions.create(**_tool_request())
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.model_extra["reasoning"] == SCRIPT_REASONING
    assert msg.content == SCRIPT_CONTENT
    assert [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in msg.tool_calls] == [("function", "get_weather", {"city": "Paris"})]


def test_streamed_tool_call_and_reasoning(scripted_server):
    stream = scripted_server.client().chat.completions.create(**_tool_request(stream=True))
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == SCRIPT_REASONING
    assert content == SCRIPT_CONTENT
    for tag in ("<think>", "</think>", "<tool_call>", "<function=", "<parameter="):
        assert tag not in content
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"
