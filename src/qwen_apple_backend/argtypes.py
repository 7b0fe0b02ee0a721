"""``argparse`` types shared by the ``qab`` subcommands (standard library only).

Each raises :class:`argparse.ArgumentTypeError`, so a bad value is one line from
argparse (``qab demo: error: argument --max-tokens: must be a positive integer,
got -3``) and exit status 2, before anything is loaded.
"""

from __future__ import annotations

import argparse

__all__ = ["nonempty_path", "nonnegative_float", "nonnegative_int", "port", "positive_float",
           "positive_int", "probability", "token_lengths"]


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
