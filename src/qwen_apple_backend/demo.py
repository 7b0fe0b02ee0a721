"""``qab demo`` / ``make demo``: the embedded default model on the fused and stock backends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from . import envs

DEMO_PRESET = "tiny"
DEMO_SEED = 0


def default_model_path() -> Path:
    """Cached location of the default demo checkpoint (``QAB_CACHE_DIR``)."""
    # float32: MLX has no bf16 gathered matmul on the CPU, so stock could not run bf16 there.
    return envs.cache_dir() / f"demo-{DEMO_PRESET}-f32-seed{DEMO_SEED}"


def ensure_default_model(rebuild: bool = False) -> Path:
    """Build the default checkpoint once (real layout, real tokenizer, random weights)."""
    from .checkpoint import make_checkpoint

    path = default_model_path()
    if rebuild or not (path / "config.json").is_file():
        print(f"building the default demo checkpoint in {path} (once) ...", file=sys.stderr)
        make_checkpoint(path, preset=DEMO_PRESET, layout="hf", seed=DEMO_SEED,
                        dtype="float32", overwrite=True, progress=True)
    return path


def run_demo(prompt: str, max_tokens: int = 32, model: Optional[str] = None,
             rebuild: bool = False) -> int:
    """Generate ``max_tokens`` greedy tokens for a chat ``prompt`` on fused and stock.

    Prints the fused backend's text and a table of prefill / decode tokens per
    second for both backends, measured in this run on this machine.
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .loader import get_report, load

    path = Path(model) if model else ensure_default_model(rebuild)
    rows = []
    texts = {}
    for backend in ("fused", "stock"):
        m, tok = load(path, backend)
        messages = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                      enable_thinking=False)
        # Warm up once so compile / first-call costs are not in the figures.
        for _ in stream_generate(m, tok, ids, max_tokens=2, sampler=make_sampler(0.0)):
            pass
        text, last = "", None
        for last in stream_generate(m, tok, ids, max_tokens=max_tokens,
                                    sampler=make_sampler(0.0)):
            text += last.text
        texts[backend] = text
        rows.append((backend, last.prompt_tokens, last.prompt_tps, last.generation_tokens,
                     last.generation_tps, last.peak_memory))
        if backend == "fused":
            print(get_report(m).summary())
        del m
        mx.clear_cache()
    print(f"\nprompt: {prompt!r}")
    print(f"fused output: {texts['fused']!r}")
    print(f"same text as stock: {texts['fused'] == texts['stock']}")
    print(f"\n{'backend':<8} {'prompt tok':>10} {'prefill tok/s':>14} {'gen tok':>8} "
          f"{'decode tok/s':>13} {'peak GB':>8}")
    for b, pt, ptps, gt, gtps, mem in rows:
        print(f"{b:<8} {pt:>10} {ptps:>14.1f} {gt:>8} {gtps:>13.1f} {mem:>8.2f}")
    print(f"(device: {mx.default_device()}; random weights: the text is not meaningful)")
    return 0
