"""Load a checkpoint with fused Qwen modules and generate with mlx-lm's own ``generate``.

``qwen_apple_backend.load`` is a drop-in for ``mlx_lm.load``: it returns the same
``(model, tokenizer)`` pair, with fused MoE / Gated DeltaNet / attention modules
swapped in where a plugin claims the architecture. Everything after loading is
plain mlx-lm.

    python examples/load_and_generate.py --prompt "Hello" --max-tokens 32
    python examples/load_and_generate.py --model path/to/Qwen3.6-35B-A3B-4bit --backend stock
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwen_apple_backend.argtypes import positive_int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the demo model, built once)")
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "stock"])
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--max-tokens", type=positive_int, default=24)
    args = parser.parse_args()

    from mlx_lm import generate

    from qwen_apple_backend import get_report, load

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())

    model, tokenizer = load(args.model, backend=args.backend)
    print(get_report(model).summary())  # what was fused, what stayed stock and why
    # Greedy decoding (mlx-lm's default sampler), so the output is reproducible.
    text = generate(model, tokenizer, prompt=args.prompt, max_tokens=args.max_tokens)
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {text!r}")


if __name__ == "__main__":
    from qwen_apple_backend.errors import QABError

    try:
        main()
    except QABError as exc:  # a bad --model: missing, not a checkpoint, no tokenizer, ...
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
