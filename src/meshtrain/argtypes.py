"""Command-line number types and the one-line argument parser every subcommand uses.

argparse calls a type on the option's text; a :class:`argparse.ArgumentTypeError` becomes "argument
--x: <message>", which :class:`OneLineParser` prints as the single line ``meshtrain CMD: error: ...``
with exit code 2 (no usage block: a user's mistake is one line). Non-finite numbers (``nan``, ``inf``)
are refused everywhere: Python's ``float()`` accepts them, and they would flow into sizes, times and
learning rates.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line on stderr and exit code 2 (``--help`` unchanged)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _number(kind: type, minimum: float | None, strict: bool) -> Callable[[str], float | int]:
    bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
    what = f"{'an integer' if kind is int else 'a finite number'}{bound}"

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or (minimum is not None and (value <= minimum if strict else value < minimum)):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``: the upper bound where a library or the OS cannot take more (a seed of
    torch's generator, processes, a tokenizer's vocabulary)."""
    what = f"an integer in [{low}, {high:,}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value

    parse.__name__ = "int"
    return parse


seed_int = int_in(0, 2**64 - 1)
"""A seed torch's generator takes: 0 .. 2**64 - 1."""
positive_int = _number(int, 0, strict=True)
"""An integer >= 1."""
nonnegative_int = _number(int, 0, strict=False)
"""An integer >= 0."""
positive_float = _number(float, 0, strict=True)
"""A finite number > 0."""
nonnegative_float = _number(float, 0, strict=False)
"""A finite number >= 0."""
