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
    out = _qab("generate", "--model", str(tiny_real_vocab), "--prompt", "",
               "--ignore-chat-template", "--max-tokens", "2")
    assert out.returncode == 1
    assert "prompt is empty" in out.stderr


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
