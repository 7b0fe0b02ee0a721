"""Shared fixtures: small real-layout checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never talk to a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# MLX computes float32 matmuls in TF32 on CUDA (and on Metal GPUs with tensor
# units) unless MLX_ENABLE_TF32=0, read once per process. Tests that hold the
# fused path to stock mlx-lm's float32 tokens need true float32 on both sides:
# on the H200 with TF32, stock's gathered expert matmuls alone moved the tiny
# float32 model's first greedy token (the fused MoE kernels are float32).
os.environ.setdefault("MLX_ENABLE_TF32", "0")


# Python subprocesses of the tests start without torch and share transformers' import
# structure (see _subprocess_site/sitecustomize.py).
SUBPROCESS_SITE = Path(__file__).parent / "_subprocess_site"


@pytest.fixture(scope="session", autouse=True)
def _subprocess_site(tmp_path_factory):
    """PYTHONPATH starts with ``_subprocess_site`` in the test process's environment, which
    subprocesses inherit (the test process itself started before, with torch), and
    ``QAB_TEST_IMPORT_STRUCTURE_DIR`` names a folder of this session for its cache."""
    before = {k: os.environ.get(k) for k in ("PYTHONPATH", "QAB_TEST_IMPORT_STRUCTURE_DIR")}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SUBPROCESS_SITE), before["PYTHONPATH"]) if p)
    os.environ["QAB_TEST_IMPORT_STRUCTURE_DIR"] = str(
        tmp_path_factory.mktemp("transformers-import-structure"))
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:  # noqa: BLE001
        have_torch = False
    import mlx.core as mx

    metal = mx.metal.is_available()
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    # The slowest tests (marked slow, each 18-240 s on 2 cores) run first, in
    # their collected order, so that pytest-xdist hands them out before the
    # short ones and its workers finish together: at the end of the order one
    # worker ran them alone while the other sat idle. (Marked only where a
    # test uses no module-scoped fixture, which moving it would set up twice.)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        if "torch" in item.keywords and not have_torch:
            item.add_marker(pytest.mark.skip(reason="torch (CPU build) not installed"))
        if "metal_only" in item.keywords and not metal:
            item.add_marker(pytest.mark.skip(reason="needs an Apple GPU (Metal)"))
        if "cuda_only" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs MLX's CUDA backend and an NVIDIA GPU"))
        if "gpu" in item.keywords and not (cuda or metal):
            item.add_marker(pytest.mark.skip(reason="needs a GPU (MLX CUDA or Metal backend)"))


SMALL_VOCAB = 1024


def _tiny(tmp_path_factory, name, **kwargs):
    from qwen_apple_backend.checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / name
    return make_checkpoint(out, preset="tiny", seed=0, progress=False, **kwargs)


@pytest.fixture(scope="session")
def tiny_hf_f32(tmp_path_factory):
    """Tiny real-layout HF checkpoint, float32 weights, small vocabulary (fast parity tests)."""
    return _tiny(tmp_path_factory, "tiny-hf-f32", layout="hf", dtype="float32",
                 vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def tiny_hf_bf16(tmp_path_factory):
    return _tiny(tmp_path_factory, "tiny-hf-bf16", layout="hf", dtype="bfloat16",
                 vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def tiny_q4(tmp_path_factory):
    return _tiny(tmp_path_factory, "tiny-q4", layout="mlx-q4", dtype="bfloat16",
                 vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def tiny_real_vocab(tmp_path_factory):
    """Tiny checkpoint with the full 248,320-token vocabulary and the real tokenizer."""
    return _tiny(tmp_path_factory, "tiny-real-vocab", layout="hf", dtype="float32")


def _tokenizer_files_key(model_path) -> tuple:
    """What a tokenizer loaded from ``model_path`` depends on: the directory and
    each file's name, size and modification time (a test that rewrites a file
    gets a fresh load)."""
    from pathlib import Path

    root = Path(model_path).resolve()
    files = []
    for p in sorted(root.iterdir()) if root.is_dir() else ():
        if p.is_file() and p.suffix not in (".safetensors", ".gguf"):
            st = p.stat()
            files.append((p.name, st.st_size, st.st_mtime_ns))
    return str(root), tuple(files)


@pytest.fixture(scope="session", autouse=True)
def _load_each_tokenizer_once():
    """Each checkpoint's tokenizer loaded once per worker process.

    A ``load()`` of a tiny checkpoint with the real Qwen tokenizer (248,320
    tokens) takes 4-5 s on 2 cores, nearly all of it
    ``mlx_lm.utils.load_tokenizer``'s (two parses of the 15 MB
    ``tokenizer.json`` and building it); the model, its fusing and its report
    take tens of ms. The suite loads the same few checkpoints over a hundred
    times, mostly to look at the model. So here, per worker,
    ``load_tokenizer`` runs once per checkpoint and arguments; each call gets
    its own shallow copy of that first ``TokenizerWrapper`` (its attributes
    copied, so an added EOS id or a detokenizer's state stays with the test
    that made it), sharing only the Hugging Face tokenizer, which nothing here
    mutates. It is keyed on the directory's files (name, size, modification
    time), so a test that writes or corrupts a file gets the real load and its
    real error (a failing load is not kept). A test that replaces
    ``load_tokenizer`` itself (monkeypatch) bypasses this.
    """
    import copy

    from mlx_lm import utils as mlx_utils

    real_load = mlx_utils.load_tokenizer
    loaded = {}

    def load_tokenizer(model_path, tokenizer_config_extra=None, eos_token_ids=None):
        try:
            key = (_tokenizer_files_key(model_path), repr(tokenizer_config_extra),
                   repr(eos_token_ids))
        except OSError:
            return real_load(model_path, tokenizer_config_extra, eos_token_ids=eos_token_ids)
        if key not in loaded:
            loaded[key] = real_load(model_path, tokenizer_config_extra,
                                    eos_token_ids=eos_token_ids)
        first = loaded[key]
        wrapper = copy.copy(first)
        for name, value in vars(first).items():
            if name != "_tokenizer":
                setattr(wrapper, name, copy.copy(value))
        return wrapper

    mp = pytest.MonkeyPatch()
    mp.setattr(mlx_utils, "load_tokenizer", load_tokenizer)
    yield
    mp.undo()
