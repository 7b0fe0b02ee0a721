"""``argparse`` types shared by the ``qab`` subcommands (standard library only).

Each raises :class:`argparse.ArgumentTypeError`, so a bad value is one line from
argparse (``qab demo: error: argument --max-tokens: must be a positive integer,
got -3``) and exit status 2, before anything is loaded.
"""

from __future__ import annotations

import argparse

__all__ = ["nonnegative_float", "nonnegative_int", "positive_float", "positive_int",
           "probability"]


def positive_int(text: str) -> int:
    """An integer >= 1 (token counts, lengths, rounds, sizes)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (e.g. warm-up runs, where 0 means none)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, GB/s)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (sampling temperature, where 0 means greedy)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in [0, 1] (top-p, min-p)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value
