"""Start ``qab serve`` (mlx-lm's OpenAI server, backend on) and query it with ``openai``.

The server is ``mlx_lm.server`` itself with the qwen-apple-backend registry
enabled, started here as a subprocess on the loopback interface. Once its
``/health`` endpoint answers, the official ``openai`` client sends one chat
completion; the server is stopped at the end.

    python examples/server_openai_client.py
    python examples/server_openai_client.py --model path/to/checkpoint --port 8080

Needs ``pip install openai``.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qwen_apple_backend.argtypes import port as tcp_port
from qwen_apple_backend.argtypes import positive_float, positive_int


def free_port() -> int:
    """A port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """``qab serve`` ended before answering (a bad --model, a taken port, ...)."""


def wait_until_up(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerExited(f"qab serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server did not answer {url} within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the demo model, built once)")
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "stock"])
    parser.add_argument("--port", type=tcp_port, default=0, help="default: any free port")
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds to wait for the server to start")
    args = parser.parse_args()

    try:
        from openai import OpenAI
    except ImportError:
        parser.error("this example needs the openai client: pip install openai")

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())
    port = args.port or free_port()

    # `qab serve ...`; run through this interpreter so the example works inside any venv.
    command = [sys.executable, "-m", "qwen_apple_backend.cli", "serve", "--model", args.model,
               "--backend", args.backend, "--host", "127.0.0.1", "--port", str(port)]
    print("starting: qab " + " ".join(command[3:]), flush=True)
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: the server never blocks on it
    server = subprocess.Popen(command, stdout=log, stderr=log, text=True)
    try:
        wait_until_up(server, f"http://127.0.0.1:{port}/health", args.timeout)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed")
        reply = client.chat.completions.create(
            model="default_model",  # mlx-lm's name for the model given with --model
            messages=[{"role": "user", "content": "Name one planet of the solar system."}],
            max_tokens=args.max_tokens, temperature=0.0)
        choice = reply.choices[0]
        print(f"reply: {choice.message.content!r}")
        print(f"finish_reason: {choice.finish_reason}")
        print(f"completion_tokens: {reply.usage.completion_tokens}")
    except ServerExited as exc:
        log.seek(0)  # the server's own error line(s), e.g. a bad --model
        print(log.read()[-4000:].rstrip(), file=sys.stderr)
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
    except Exception:
        log.seek(0)  # show what the server said
        print(log.read()[-4000:], file=sys.stderr)
        raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    print("server stopped")


if __name__ == "__main__":
    main()
