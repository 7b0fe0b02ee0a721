"""Agreement metrics shared by the parity tests (float64 numpy on the host)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def to_np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kl(p_logits, q_logits) -> float:
    """Mean KL(P || Q) over positions, P the reference."""
    lp, lq = log_softmax(np.asarray(p_logits)), log_softmax(np.asarray(q_logits))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def top1_agreement(a, b) -> float:
    return float((np.asarray(a).argmax(-1) == np.asarray(b).argmax(-1)).mean())


def perplexity(logits, targets) -> float:
    lp = log_softmax(np.asarray(logits))
    nll = -np.take_along_axis(lp, np.asarray(targets)[..., None], -1)[..., 0]
    return float(np.exp(nll.mean()))


def first_mismatch(a, b, atol, rtol, n=5) -> str:
    a, b = np.asarray(a), np.asarray(b)
    bad = np.argwhere(~np.isclose(a, b, atol=atol, rtol=rtol))
    rows = [f"{tuple(i)}: {a[tuple(i)]!r} vs {b[tuple(i)]!r}" for i in bad[:n]]
    return f"{len(bad)} mismatches; first: " + "; ".join(rows)


def mx_rel_l2(a, b) -> float:
    """rel-L2 of two mx arrays (float64 on the host; a zero reference counts as 1)."""
    a = np.array(a.astype(mx.float32), dtype=np.float64)
    b = np.array(b.astype(mx.float32), dtype=np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


def assert_close(actual, expected, *, rtol, atol, name="output", max_report=5):
    """allclose on mx arrays that reports the first mismatching indices and values."""
    import pytest

    a = np.array(actual.astype(mx.float32))
    b = np.array(expected.astype(mx.float32))
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    bad = ~np.isclose(a, b, rtol=rtol, atol=atol)
    if bad.any():
        idx = np.argwhere(bad)[:max_report]
        rows = ", ".join(f"{tuple(i)}: {a[tuple(i)]:.6g} vs {b[tuple(i)]:.6g}" for i in idx)
        pytest.fail(
            f"{name}: {int(bad.sum())}/{bad.size} mismatches "
            f"(rtol={rtol}, atol={atol}, rel-L2={mx_rel_l2(actual, expected):.3g}); first: {rows}"
        )
