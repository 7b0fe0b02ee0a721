"""Light modules must not pull in MLX or mlx-lm (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT = ["qwen_apple_backend", "qwen_apple_backend.hookspecs", "qwen_apple_backend.registry",
         "qwen_apple_backend.envs", "qwen_apple_backend.errors", "qwen_apple_backend.plugins",
         "qwen_apple_backend._builtin", "qwen_apple_backend.report", "qwen_apple_backend.cli",
         "qwen_apple_backend.loader"]


@pytest.mark.parametrize("module", LIGHT)
def test_light_module_imports_no_mlx(module):
    code = (f"import sys, json, {module}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_registry_resolution_imports_no_mlx():
    code = ("import sys, json\nfrom qwen_apple_backend import plugins\n"
            "plugins.resolve_architecture({'model_type': 'qwen3_5_moe'})\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('mlx', 'mlx_lm')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_ops_do_not_import_mlx_lm():
    code = ("import sys, json\nimport qwen_apple_backend.ops.gated_delta, qwen_apple_backend.ops.moe, "
            "qwen_apple_backend.ops.attention\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('mlx_lm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
