"""Architectures no plugin claims load exactly as `mlx_lm.load` loads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from qwen_apple_backend import get_report, load, plugins

from ._llama import write_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(autouse=True)
def fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


@pytest.mark.parametrize("backend", ["auto", "fused", "stock"])
def test_unclaimed_architecture_is_exactly_mlx_lm(llama_dir, backend):
    import mlx_lm

    ref_model, ref_tok = mlx_lm.load(str(llama_dir))
    model, tok = load(llama_dir, backend)
    assert type(model) is type(ref_model)
    assert [type(m).__name__ for _, m in model.named_modules()] == \
        [type(m).__name__ for _, m in ref_model.named_modules()]
    ids = mx.array([[1, 5, 9, 17, 33, 64, 100, 2]])
    a, b = ref_model(ids), model(ids)
    assert mx.array_equal(a, b).item(), "logits differ from mlx_lm.load"
    assert tok.encode("w1 w2 w3") == ref_tok.encode("w1 w2 w3")
    report = get_report(model)
    assert report.architecture is None
    # Every layer's attention and MLP is listed, stock, with the reason.
    assert [(m.path, m.kind, m.stock, m.fused) for m in report.modules] == [
        (f"model.layers.{i}.{attr}", kind, cls, None)
        for i in range(2) for attr, kind, cls in (("self_attn", "attn", "Attention"),
                                                  ("mlp", "mlp", "MLP"))]
    assert {m.reason for m in report.modules} == {"no plugin claims architecture 'llama'"}
    summary = report.summary()
    assert "attn: 0/2 fused; stock because: no plugin claims architecture 'llama'" in summary
    assert "mlp: 0/2 fused" in summary


def test_report_of_a_model_loaded_by_plain_mlx_lm(llama_dir):
    import mlx_lm

    model, _ = mlx_lm.load(str(llama_dir))
    report = get_report(model)
    assert report is not None and report.backend == "stock" and not report.fused
    assert report.counts() == {"attn": (0, 2), "mlp": (0, 2)}
    assert "not loaded through qwen_apple_backend" in report.summary()
    assert get_report(object()) is None  # not an MLX model


def test_example_plugin_claims_llama_and_keeps_logits(llama_dir, tmp_path):
    from .test_plugins import _install_example

    site = tmp_path / "site"
    _install_example(site)
    code = f"""
        import json, mlx.core as mx, mlx_lm
        from qwen_apple_backend import load, get_report
        from qab_example_plugin.adapter import CountingMLP
        ref, _ = mlx_lm.load({str(llama_dir)!r})
        model, _ = load({str(llama_dir)!r})
        ids = mx.array([[1, 5, 9, 17]])
        same = mx.array_equal(ref(ids), model(ids)).item()
        r = get_report(model)
        print(json.dumps({{"same": same, "plugin": r.plugin, "calls": CountingMLP.calls,
                          "fused": [m.fused for m in r.modules]}}))
    """
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data == {"same": True, "plugin": "example", "calls": 2,
                    "fused": ["CountingMLP", "CountingMLP"]}
