"""Argument types the benchmarks share, so that an impossible setting (no requests, no concurrency, a rate of zero,
a CPU quota of none) is refused by argparse with the option's name before any model loads or server starts,
instead of hanging on a semaphore of 0 or silently falling back to a default."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """An integer >= 1 (requests, concurrency, tokens, threads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (a request rate, a CPU quota)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
