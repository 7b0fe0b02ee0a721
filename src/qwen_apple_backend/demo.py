"""``qab demo`` / ``make demo``: the embedded default model on the fused and stock backends.

The default model is the small trained demo model shipped in
``qwen_apple_backend/demo_model/`` (Qwen3.6 architecture, 4-bit, trained on the Python
documentation; see its ``MODEL_CARD.md`` and ``training/``). Its 15 MB
``tokenizer.json`` is not shipped: :func:`ensure_default_model` copies the weights into
the cache directory once and writes the real Qwen3.6 tokenizer beside them with
:func:`qwen_apple_backend.tokenizer.write_tokenizer`.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import uuid
from pathlib import Path
from typing import Optional

from . import envs
from .errors import EnvVarError

#: Files of the shipped demo model that make up a loadable checkpoint (with the tokenizer).
DEMO_FILES = ("config.json", "model.safetensors", "generation_config.json")


def shipped_model_dir() -> Path:
    """Directory of the demo model inside the installed package (no tokenizer files)."""
    return Path(__file__).resolve().parent / "demo_model"


def _fingerprint(src: Path) -> str:
    h = hashlib.sha256()
    for name in DEMO_FILES:
        with open(src / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def default_model_path() -> Path:
    """Cached, loadable copy of the shipped demo model (``QAB_CACHE_DIR``).

    The directory name carries a hash of the shipped files, so a new model gets a new
    cache entry.

    Raises:
        FileNotFoundError: if the package was installed without its demo model.
    """
    src = shipped_model_dir()
    missing = [n for n in DEMO_FILES if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model is missing from this installation ({src}: no "
            f"{', '.join(missing)}); reinstall qwen-apple-backend or pass --model")
    return envs.cache_dir() / f"demo-model-{_fingerprint(src)}"


def ensure_default_model(rebuild: bool = False) -> Path:
    """Materialize the default demo model once: weights + config + real tokenizer.

    Args:
        rebuild (bool): write the cached copy again. Default: ``False``.

    Returns:
        Path: a checkpoint directory that ``mlx_lm.load`` and
        :func:`qwen_apple_backend.load` accept.

    Raises:
        FileNotFoundError: if the package was installed without its demo model.
        EnvVarError: (a ``ValueError``) naming ``QAB_CACHE_DIR``, the directory and
            the reason, if the cache directory cannot be created or written.

    Example:
        >>> from qwen_apple_backend import load
        >>> model, tokenizer = load(ensure_default_model(), backend="fused")
    """
    from .tokenizer import TOKENIZER_FILES, write_tokenizer

    path = default_model_path()
    complete = all((path / n).is_file() for n in (*DEMO_FILES, *TOKENIZER_FILES))
    if complete and not rebuild:
        return path
    staging = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise EnvVarError(
            f"QAB_CACHE_DIR: cannot create or write the cache directory {str(path.parent)!r}: "
            f"{exc.strerror or exc}; set QAB_CACHE_DIR to a writable directory") from None
    print(f"preparing the demo model in {path} (once) ...", file=sys.stderr)
    try:
        for name in DEMO_FILES:
            shutil.copy2(shipped_model_dir() / name, staging / name)
        write_tokenizer(staging)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not path.exists() or not (path / "config.json").is_file():
            raise
        # Another process finished the same copy first.
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
    note = ("the trained demo model (Python docs, 4-bit; see demo_model/MODEL_CARD.md)"
            if not model else str(path))
    print(f"(device: {mx.default_device()}; model: {note})")
    return 0
