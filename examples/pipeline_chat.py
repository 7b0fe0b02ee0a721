"""A two-turn chat through the transformers-style ``pipeline("text-generation")``.

The pipeline takes chat messages, applies the model's chat template (with
Qwen's ``enable_thinking`` switch) and returns the conversation with the
assistant's reply appended, ready for the next turn.

    python examples/pipeline_chat.py
    python examples/pipeline_chat.py --model path/to/checkpoint --backend fused --thinking
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
    parser.add_argument("--backend", default="auto",
                        help="auto, fused, stock or a plugin's backend (see `qab backends`)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=24)
    parser.add_argument("--thinking", action="store_true",
                        help="let the model think first (enable_thinking=True)")
    args = parser.parse_args()

    from qwen_apple_backend import pipeline

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())

    # Settings given here are the defaults of every call; a call can override them.
    chat = pipeline("text-generation", model=args.model, backend=args.backend,
                    max_new_tokens=args.max_new_tokens, enable_thinking=args.thinking)
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name one planet of the solar system."}]
    for question in (None, "And one more?"):
        if question is not None:
            messages.append({"role": "user", "content": question})
        messages = chat(messages)[0]["generated_text"]  # the messages plus the reply
        print(f"user: {messages[-2]['content']!r}")
        print(f"assistant: {messages[-1]['content']!r}")
    print(f"backend: {chat.backend}")
    print(f"messages: {len(messages)}")


if __name__ == "__main__":
    from qwen_apple_backend.errors import QABError

    try:
        main()
    except QABError as exc:  # a bad --model: missing, not a checkpoint, no tokenizer, ...
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
