"""Stream generated text piece by piece with the pipeline (``stream=True``).

``pipe(prompt, stream=True)`` returns an iterator of text pieces; joined they
equal the non-streamed ``generated_text``, and once the iterator is exhausted
it carries the final result, the generated token ids and the finish reason.
A ``streamer=`` object (here ``TextStreamer``, which prints) is the
alternative for code that wants the usual list result back.

    python examples/streaming.py --prompt "Once upon a time" --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from qwen_apple_backend.argtypes import positive_int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the demo model, built once)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--prompt", default="The three primary colours are")
    parser.add_argument("--max-new-tokens", type=positive_int, default=24)
    args = parser.parse_args()

    from qwen_apple_backend import pipeline
    from qwen_apple_backend.pipeline import TextStreamer

    if args.model is None:
        from qwen_apple_backend.demo import ensure_default_model

        args.model = str(ensure_default_model())

    pipe = pipeline("text-generation", model=args.model, backend=args.backend,
                    max_new_tokens=args.max_new_tokens)

    # 1. An iterator of text pieces.
    stream = pipe(args.prompt, stream=True)
    pieces = []
    for piece in stream:
        print(piece, end="", flush=True)
        pieces.append(piece)
    print()
    print(f"pieces: {len(pieces)}")
    print(f"tokens: {len(stream.token_ids)}")
    print(f"finish_reason: {stream.finish_reason}")
    print(f"streamed: {''.join(pieces)!r}")

    # 2. A streamer object, called while the ordinary result is built.
    buffer = io.StringIO()
    result = pipe(args.prompt, return_full_text=False, streamer=TextStreamer(buffer))
    text = result[0]["generated_text"]
    # TextStreamer.end() writes a final newline.
    print(f"streamer saw the same text: {buffer.getvalue() == text + chr(10)}")
    print(f"same as non-streamed: {''.join(pieces) == text}")


if __name__ == "__main__":
    from qwen_apple_backend.errors import QABError

    try:
        main()
    except QABError as exc:  # a bad --model: missing, not a checkpoint, no tokenizer, ...
        sys.exit(f"{Path(sys.argv[0]).name}: error: {exc}")
