"""The transformers PyTorch `qwen3_5_moe` implementation as an independent oracle.

Same HF-layout weights, float32: fused logits within rel-L2 1e-4 of transformers
(stock mlx-lm reaches ~1e-6 on such a checkpoint).
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen_apple_backend import load

from ._metrics import rel_l2, to_np, top1_agreement
from .conftest import SMALL_VOCAB

pytestmark = pytest.mark.torch


def _hf_logits(path, ids):
    import torch
    import transformers

    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]))
    return out.logits[0].double().numpy()


def test_fused_and_stock_match_transformers_float32(tiny_hf_f32):
    import mlx.core as mx

    ids = np.random.default_rng(11).integers(0, SMALL_VOCAB, size=96).tolist()
    ref = _hf_logits(tiny_hf_f32, ids)
    results = {}
    for backend in ("stock", "fused"):
        model, _ = load(tiny_hf_f32, backend)
        got = to_np(model(mx.array([ids]))[0])
        results[backend] = (rel_l2(got, ref), top1_agreement(got, ref), np.abs(got - ref).max())
    print("\nvs transformers float32: " + ", ".join(
        f"{b}: rel-L2 {r:.2e} top-1 {a:.2%} max|d| {m:.2e}" for b, (r, a, m) in results.items()))
    assert results["stock"][0] <= 1e-4
    assert results["fused"][0] <= 1e-4
    assert results["fused"][1] == 1.0
