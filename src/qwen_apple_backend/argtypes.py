"""``argparse`` types shared by the ``qab`` subcommands (standard library only).

Each raises :class:`argparse.ArgumentTypeError`, so a bad value is one line from
argparse (``qab demo: error: argument --max-tokens: must be a positive integer,
got -3``) and exit status 2, before anything is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from decimal import Decimal

__all__ = ["KV_BITS", "KV_GROUP_SIZES", "byte_size", "file_name_part", "json_object", "kv_bits",
           "kv_group_size", "nonempty_path", "nonnegative_float", "nonnegative_int", "port", "positive_float",
           "positive_int", "positive_int_up_to", "prng_seed", "probability", "safetensors_file",
           "token_lengths"]

#: The bit widths and group sizes ``mx.quantize`` accepts (MLX 0.32; tests/test_cli.py
#: checks them against the installed MLX). Another value fails only once the KV cache
#: is quantized: bits 7 raise in ``mx.quantize``, group size 0 kills the process
#: with SIGFPE.
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def _parse(text: str, convert, ok, what: str):
    """``convert(text)`` if it parses and passes ``ok``; else "must be WHAT, got TEXT"."""
    try:
        value = convert(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (token counts, lengths, rounds, sizes)."""
    return _parse(text, int, lambda v: v > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (e.g. warm-up runs, where 0 means none)."""
    return _parse(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, GB/s)."""
    return _parse(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (sampling temperature, where 0 means greedy)."""
    return _parse(text, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def probability(text: str) -> float:
    """A number in [0, 1] (top-p, min-p)."""
    return _parse(text, float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def nonempty_path(text: str) -> str:
    """A path that is not empty or blank (``--model ""`` would otherwise mean "." to one
    command and mlx-lm's hub default to another)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return text


def positive_int_up_to(limit: int, why: str):
    """A type for an integer from 1 to ``limit``; ``why`` says where the limit comes from."""

    def check(text: str) -> int:
        return _parse(text, int, lambda v: 0 < v <= limit,
                      f"a positive integer up to {limit} ({why})")

    return check


def prng_seed(text: str) -> int:
    """A seed ``mx.random.seed`` takes: an integer from 0 to 2**64 - 1 (an unsigned 64-bit
    integer; another raises ``TypeError`` there)."""
    return _parse(text, int, lambda v: 0 <= v < 1 << 64,
                  f"an integer from 0 to 2**64 - 1 ({(1 << 64) - 1})")


def kv_bits(text: str) -> int:
    """A KV-cache quantization bit width, one of :data:`KV_BITS`."""
    return _parse(text, int, lambda v: v in KV_BITS,
                  f"one of {', '.join(map(str, KV_BITS))} (the bit widths MLX quantizes to)")


def kv_group_size(text: str) -> int:
    """A KV-cache quantization group size, one of :data:`KV_GROUP_SIZES`."""
    return _parse(text, int, lambda v: v in KV_GROUP_SIZES,
                  f"one of {', '.join(map(str, KV_GROUP_SIZES))} (the group sizes MLX "
                  "quantizes with)")


def json_object(text: str) -> dict:
    """A JSON object (keyword arguments of a chat template, ``{"enable_thinking": false}``)."""
    # json.JSONDecodeError is a ValueError, so _parse reports it as a bad value.
    return _parse(text, json.loads, lambda v: isinstance(v, dict),
                  'a JSON object such as {"enable_thinking": false}')


def safetensors_file(text: str) -> str:
    """An existing ``.safetensors`` file (a prompt cache that ``mlx_lm.cache_prompt`` wrote:
    ``mx.load`` picks the format from the extension, and only safetensors keep the
    cache's metadata)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(
            f"{'is a directory, not a file' if os.path.isdir(text) else 'no such file'}: "
            f"{text!r}")
    if not text.endswith(".safetensors"):
        raise argparse.ArgumentTypeError(
            f"must be a .safetensors file (as mlx_lm.cache_prompt writes), got {text!r}")
    return text


#: The sizes ``mlx_lm.utils._parse_size`` reads (``qab serve --prompt-cache-bytes``): digits
#: with at most one ``.``, then, after optional blanks, nothing or a unit in any case.
_SIZE = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)\s*(|M|MB|G|GB)\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def byte_size(text: str) -> int:
    """A byte count >= 0 as mlx-lm writes sizes: ``1000000``, ``500M``, ``1.5GB`` (M = 10**6,
    G = 10**9). Exactly the texts ``mlx_lm.utils._parse_size`` reads (another, such as
    ``-5``, raises ``decimal.InvalidOperation`` or ``KeyError`` there), with its value."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise argparse.ArgumentTypeError(
            f"must be a size in bytes >= 0, optionally followed by M, MB, G or GB (10**6, "
            f"10**9), such as 500M or 8GB, got {text!r}")
    return int(Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


_FILE_NAME_PART = re.compile(r"[A-Za-z0-9._-]*")


def file_name_part(text: str) -> str:
    """A part of an output file's name (``qab bench --tag``): ASCII letters, digits, ``.``,
    ``_`` and ``-``, so no ``/`` (``../../x`` wrote outside the output folder)."""
    if not _FILE_NAME_PART.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be ASCII letters, digits, '.', '_' and '-' only (it becomes part of the "
            f"file names), got {text!r}")
    return text


def port(text: str) -> int:
    """A TCP port number, 0 (any free port) to 65535."""
    return _parse(text, int, lambda v: 0 <= v <= 65535, "a port number from 0 to 65535")


def token_lengths(text: str) -> list:
    """Comma-separated token counts, ``K`` = 1,024 (``"256,1K,4K"``), sorted and unique, each >= 2."""
    from .bench.harness import parse_lengths

    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--lengths: ")) from None
