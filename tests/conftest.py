"""Shared fixtures: small real-layout checkpoints built once per test session."""

from __future__ import annotations

import os

import pytest

# Tests never talk to a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:  # noqa: BLE001
        have_torch = False
    import mlx.core as mx

    metal = mx.metal.is_available()
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    for item in items:
        if "torch" in item.keywords and not have_torch:
            item.add_marker(pytest.mark.skip(reason="torch (CPU build) not installed"))
        if "metal_only" in item.keywords and not metal:
            item.add_marker(pytest.mark.skip(reason="needs an Apple GPU (Metal)"))
        if "cuda_only" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs MLX's CUDA backend and an NVIDIA GPU"))


SMALL_VOCAB = 1024


@pytest.fixture(scope="session")
def tiny_hf_f32(tmp_path_factory):
    """Tiny real-layout HF checkpoint, float32 weights, small vocabulary (fast parity tests)."""
    from qwen_apple_backend.checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-hf-f32"
    return make_checkpoint(out, preset="tiny", layout="hf", seed=0, dtype="float32",
                           vocab_size=SMALL_VOCAB, progress=False)


@pytest.fixture(scope="session")
def tiny_hf_bf16(tmp_path_factory):
    from qwen_apple_backend.checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-hf-bf16"
    return make_checkpoint(out, preset="tiny", layout="hf", seed=0, dtype="bfloat16",
                           vocab_size=SMALL_VOCAB, progress=False)


@pytest.fixture(scope="session")
def tiny_q4(tmp_path_factory):
    from qwen_apple_backend.checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-q4"
    return make_checkpoint(out, preset="tiny", layout="mlx-q4", seed=0, dtype="bfloat16",
                           vocab_size=SMALL_VOCAB, progress=False)


@pytest.fixture(scope="session")
def tiny_real_vocab(tmp_path_factory):
    """Tiny checkpoint with the full 248,320-token vocabulary and the real tokenizer."""
    from qwen_apple_backend.checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-real-vocab"
    return make_checkpoint(out, preset="tiny", layout="hf", seed=0, dtype="float32",
                           progress=False)
