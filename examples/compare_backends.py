"""Run the same prompts through several backends side by side (``qab compare`` from Python).

Every backend decodes the same number of greedy tokens from the same prompt
token ids; the report gives time to first token, prefill and decode tokens per
second, each continuation, its token agreement with the reference backend
(``stock``) and the first position where they diverge. The command-line
equivalent is ``qab compare --model M --backends stock,fused --prompt P``.

    python examples/compare_backends.py --backends stock,fused --max-tokens 16
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
    parser.add_argument("--backends", default="stock,fused",
                        help="comma-separated registered backends (see `qab backends`)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each prompt in the chat template")
    args = parser.parse_args()

    from qwen_apple_backend.bench.compare import CompareConfig, format_compare, run_compare

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())
    prompts = args.prompt or ["The three primary colours are", "def fibonacci(n):"]

    result = run_compare(CompareConfig(
        model=args.model, backends=args.backends.split(","), prompts=prompts,
        max_tokens=args.max_tokens, chat_template=args.chat_template, progress=False))
    print(format_compare(result))

    reference = result["compare"]["reference"]
    for p in result["compare"]["prompts"]:
        for name, r in p["backends"].items():
            if name == reference:
                continue
            print(f"prompt {p['index'] + 1}: {name} vs {reference}: "
                  f"agreement {100 * r['agreement_vs_reference']:.1f}%, "
                  f"first divergence {r['first_divergence']}")


if __name__ == "__main__":
    from qwen_apple_backend.errors import QABError

    try:
        main()
    except QABError as exc:  # a bad --model: missing, not a checkpoint, no tokenizer, ...
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
