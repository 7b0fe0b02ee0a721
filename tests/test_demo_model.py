"""The shipped trained demo model: size, loading, fused-vs-stock agreement, perplexity gate.

The held-out sample (``tests/data/demo_heldout_sample.txt``) is the opening of
``library/json.rst.txt`` from Debian's ``python3.11-doc`` 3.11.2-6+deb12u8, a document
the model never saw in training (Python documentation, PSF License Agreement v2).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from ._metrics import perplexity, to_np, top1_agreement

SAMPLE = Path(__file__).parent / "data" / "demo_heldout_sample.txt"
MAX_BYTES = 25 * 10**6
POSITIONS = 192


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    from qwen_apple_backend import envs
    from qwen_apple_backend.demo import ensure_default_model

    old = os.environ.get("QAB_CACHE_DIR")
    os.environ["QAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("qab-cache"))
    try:
        path = ensure_default_model()
        assert path.parent == envs.cache_dir()
        yield path
    finally:
        if old is None:
            os.environ.pop("QAB_CACHE_DIR", None)
        else:
            os.environ["QAB_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def runs(demo_path):
    """Teacher-forced logits of the held-out sample on both backends, and the models."""
    from qwen_apple_backend import get_report, load

    out = {}
    for backend in ("stock", "fused"):
        model, tok = load(demo_path, backend)
        ids = tok.encode(SAMPLE.read_text(encoding="utf-8"), add_special_tokens=False)
        assert len(ids) > POSITIONS
        logits = to_np(model(mx.array([ids[:-1]]))[0])
        out[backend] = {"model": model, "tok": tok, "ids": ids, "logits": logits,
                        "report": get_report(model)}
    return out


def recorded_sample_ppl() -> float:
    from qwen_apple_backend.demo import shipped_model_dir

    card = (shipped_model_dir() / "MODEL_CARD.md").read_text()
    match = re.search(r"q4_sample_ppl = ([0-9.]+)", card)
    assert match, "MODEL_CARD.md lost its q4_sample_ppl line"
    return float(match.group(1))


def test_shipped_model_is_small_4bit_and_real_vocab():
    from qwen_apple_backend.demo import DEMO_FILES, shipped_model_dir

    src = shipped_model_dir()
    size = sum((src / n).stat().st_size for n in DEMO_FILES)
    assert size <= MAX_BYTES, f"{size / 1e6:.1f} MB"
    config = json.loads((src / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    text = config["text_config"]
    assert text["vocab_size"] == 248320 and config["tie_word_embeddings"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["num_experts"] > text["num_experts_per_tok"] > 0
    assert text["shared_expert_intermediate_size"] > 0


def test_loads_on_both_backends_with_every_kind_fused(runs):
    assert runs["stock"]["report"] is None or not runs["stock"]["report"].fused
    counts = runs["fused"]["report"].counts()
    for kind in ("moe", "gdn", "attn"):
        fused, total = counts[kind]
        assert total > 0 and fused == total, counts


def test_fused_agrees_with_stock_teacher_forced(runs):
    ids = runs["stock"]["ids"]
    targets = ids[1:]
    stock, fused = runs["stock"]["logits"], runs["fused"]["logits"]
    assert stock.shape[0] >= POSITIONS
    assert top1_agreement(fused, stock) >= 0.995
    p_stock, p_fused = perplexity(stock, targets), perplexity(fused, targets)
    assert abs(p_fused / p_stock - 1) <= 5e-4, (p_fused, p_stock)


def test_heldout_perplexity_matches_model_card(runs):
    """Fails when the weights change (or break): the card's figure + 5% is the ceiling."""
    ids = runs["stock"]["ids"]
    ppl = perplexity(runs["stock"]["logits"], ids[1:])
    recorded = recorded_sample_ppl()
    assert ppl <= recorded * 1.05, (ppl, recorded)
    # Far from a flat distribution over the 248,320 ids: the model is trained.
    assert ppl < 0.01 * 248320


def test_greedy_generation_identical(runs):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tok = runs["stock"]["tok"]
    prompt = mx.array(tok.encode("The :mod:`os` module provides", add_special_tokens=False))
    tokens = {}
    for backend in ("stock", "fused"):
        steps = generate_step(prompt, runs[backend]["model"], max_tokens=32,
                              sampler=make_sampler(0.0))
        tokens[backend] = [int(t) for t, _ in steps]
    assert len(tokens["stock"]) == 32
    assert tokens["fused"] == tokens["stock"]
    # Recognisably text, not one token repeated.
    assert len(set(tokens["stock"])) > 4


def test_qab_generate_defaults_to_demo_model(demo_path):
    env = dict(os.environ, QAB_CACHE_DIR=str(demo_path.parent))
    out = subprocess.run([sys.executable, "-m", "qwen_apple_backend.cli", "generate",
                          "--prompt", "What is a list?", "--max-tokens", "8", "--temp", "0"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert "using the demo model" in out.stderr
    assert "tokens-per-sec" in out.stdout
    assert math.isfinite(recorded_sample_ppl())
