"""The ``argparse`` types of every command's numeric options: bounded ints and finite numbers.

Each type refuses a bad value with a message naming it and the range
expected (``expected an int >= 1, got '0'``), which
:class:`~veloxquant_mlx.commandline.bad_input.OneLineParser` prints as one
line with exit status 2. Ints are bounded above by :data:`MAX_INT`
(``2**63 - 1``) as well: a count, a size or a budget beyond it is a typo,
and a bigger one would reach code that converts it to a float (and
overflows) or tries to allocate it. A value too long to quote is shown
shortened, so the error stays one readable line.

Complexity: O(length of the text). Thread safety: pure functions.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Final

__all__ = ["MAX_INT", "any_int", "finite_float", "int_at_least", "int_in", "shown"]

#: The largest int any option takes (a signed 64-bit int).
MAX_INT: Final = 2**63 - 1
_MIN_INT: Final = -(2**63)
_MAX_INT_TEXT: Final = "2**63-1"
#: Longest option text quoted whole in an error message.
_QUOTED_CHARS: Final = 40


def shown(text: str) -> str:
    """``text`` quoted for an error message; shortened, with its length, when it is long."""
    if len(text) <= _QUOTED_CHARS:
        return repr(text)
    return f"{text[: _QUOTED_CHARS // 2]!r}... ({len(text):,} characters)"


def _int_within(text: str, low: int, high: int, expected: str) -> int:
    """``text`` as an int from ``low`` to ``high``, else ``ArgumentTypeError`` naming it."""
    try:
        value = int(text)  # also refuses a text of more than 4,300 digits
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}") from None
    if low <= value <= high:
        return value
    if high == MAX_INT and value > high:  # the bound no option states: say it
        expected = f"{expected} and <= {_MAX_INT_TEXT}"
    if (low, high) == (_MIN_INT, MAX_INT):
        expected = f"an int from -2**63 to {_MAX_INT_TEXT}"
    raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int from ``minimum`` to :data:`MAX_INT`."""
    expected = f"an int >= {minimum}"

    def parse(text: str) -> int:
        return _int_within(text, minimum, MAX_INT, expected)

    parse.__name__ = expected
    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int from ``low`` to ``high`` (at most :data:`MAX_INT`)."""
    expected = f"an int from {low} to {high}"

    def parse(text: str) -> int:
        return _int_within(text, low, min(high, MAX_INT), expected)

    parse.__name__ = expected
    return parse


def any_int(text: str) -> int:
    """An argparse type: any signed 64-bit int (e.g. a seed)."""
    return _int_within(text, _MIN_INT, MAX_INT, "an int")


def finite_float(
    low: float, high: float = math.inf, *, low_inclusive: bool
) -> Callable[[str], float]:
    """An argparse type: a finite float above ``low`` (or equal to it) and at most ``high``."""
    above = f"{'>=' if low_inclusive else '>'} {low:g}"
    # With no upper bound, "inf" meets every bound the message names: name finiteness.
    expected = (
        f"a number {above} and <= {high:g}" if math.isfinite(high) else f"a finite number {above}"
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}") from None
        above_low = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above_low and value <= high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}")
        return value

    parse.__name__ = expected
    return parse
