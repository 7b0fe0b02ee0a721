"""``qab-llamacpp``: the plugin's own commands.

``qab-llamacpp convert-gguf MODEL.gguf OUT [--dtype float32|float16|bfloat16]``
    dequantize a GGUF into an MLX / Hugging Face checkpoint that stock mlx-lm loads.
``qab-llamacpp find-gguf PATH``
    print the GGUF file the ``llama.cpp`` backend would load for PATH.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="qab-llamacpp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert-gguf", help="GGUF -> checkpoint for stock mlx-lm "
                       "(config.json, model.safetensors, tokenizer)")
    p.add_argument("gguf", help="a .gguf file, or a directory holding exactly one")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weight dtype written (default float32: dequantized values are exact)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    p = sub.add_parser("find-gguf", help="the GGUF file the llama.cpp backend loads for PATH")
    p.add_argument("path")
    args = parser.parse_args(argv)

    from .backend import find_gguf

    try:
        if args.command == "find-gguf":
            print(find_gguf(args.path))
            return 0
        from .convert import gguf_to_mlx

        out = gguf_to_mlx(find_gguf(args.gguf), args.out, dtype=args.dtype,
                          overwrite=args.overwrite)
    except (OSError, ValueError) as exc:
        # Exit 1 like qab's own commands for a missing or broken file; 2 is argparse's,
        # for usage errors.
        print(f"qab-llamacpp: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
