"""Refusing bad input on the command line: one line naming the value, exit status 2.

Every command parses with :class:`OneLineParser`, whose usage errors are one
line (``PROG: error: argument --depth: expected an int >= 0, got '-1' (see
--help)``) instead of argparse's usage block. Checks that need more than
one option, or the contents of a file, raise :class:`BadInputError`, which
:func:`veloxquant_mlx.commandline.interrupts.run_command` prints the same way.

Input that would make a command allocate more than the machine has is
refused before anything is allocated: :func:`require_fits_in_memory`
compares an estimate (the caller's, in bytes: the most the input can make
the command hold) with the machine's physical memory. Only that is refused:
a run that fits but needs more than is free at the moment is allowed (a
busy machine frees memory), and :func:`memory_note` says so in the run's
start line.

Complexity: O(1), except reading ``/proc/meminfo``. Thread safety: pure
functions; the parser is used from one thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Final, NoReturn

from veloxquant_mlx.commandline.verdicts import ExitStatus

__all__ = [
    "BadInputError",
    "OneLineParser",
    "available_memory_bytes",
    "human_bytes",
    "memory_note",
    "physical_memory_bytes",
    "require_fits_in_memory",
]


class BadInputError(ValueError):
    """Input a command refuses before doing anything: the message names the value."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit status 2.

    Subparsers made from it (``add_subparsers``) are of this class too.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2."""
        self.exit(ExitStatus.BAD_INPUT, one_line_error(self.prog, f"{message} (see --help)"))


def one_line_error(prog: str, message: str) -> str:
    """The error line every command prints for bad input (newlines folded)."""
    folded = " ".join(message.split())
    return f"{prog}: error: {folded}\n"


def human_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``: bytes in binary units, three significant figures.

    Any int is shown, in integer arithmetic up to the unit (a count too big
    for a float is an input a command refuses, not a crash); past 1,024
    EiB, as a power of two.
    """
    if count < 1024:
        return f"{count} bytes"
    unit = min((count.bit_length() - 1) // 10, len(_UNITS) - 1)
    whole = count >> 10 * unit
    if whole >= 1024:  # beyond the largest unit: only the order of magnitude matters
        return f"2**{count.bit_length() - 1} bytes"
    value = count / (1 << 10 * unit)  # both ints < 2**70: an exact, finite quotient
    text = f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return f"{text} {_UNITS[unit]}"


_UNITS: Final = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _meminfo_bytes(field: str) -> int | None:
    """A field of Linux ``/proc/meminfo`` in bytes, or ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def physical_memory_bytes() -> int | None:
    """The machine's memory (``MemTotal``, else ``sysconf``); ``None`` where unknown."""
    total = _meminfo_bytes("MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get now without swapping (``MemAvailable``), if known."""
    return _meminfo_bytes("MemAvailable")


def require_fits_in_memory(needed: int, what: str, *, limit: int | None = None) -> None:
    """Refuse input that cannot fit in this machine's memory, whatever else runs on it.

    Only what exceeds the physical memory is refused: input that fits but
    exceeds what is free now may still run once other programs end (see
    :func:`memory_note`).

    Args:
        needed: The caller's estimate, in bytes, of the most the input makes it allocate.
        what: Names the input and its value, e.g. ``"header n_layers=100000000000"``.
        limit: Bytes to compare with (default: :func:`physical_memory_bytes`).

    Raises:
        BadInputError: ``needed`` exceeds ``limit``.
    """
    if limit is None:
        limit = physical_memory_bytes()
    if limit is not None and needed > limit:
        raise BadInputError(
            f"{what} needs about {human_bytes(needed)} of memory, more than this machine's "
            f"{human_bytes(limit)}; expected a smaller value"
        )


def memory_note(needed: int, *, available: int | None = None) -> str:
    """``about 1.2 GiB`` and, when it exceeds the memory free now, a warning saying so."""
    if available is None:
        available = available_memory_bytes()
    text = f"about {human_bytes(needed)}"
    if available is not None and needed > available:
        text += f" (more than the {human_bytes(available)} free now)"
    return text


def print_bad_input(prog: str, error: BadInputError | str) -> ExitStatus:
    """Print the one error line for ``error`` on stderr; return :attr:`ExitStatus.BAD_INPUT`."""
    sys.stderr.write(one_line_error(prog, str(error)))
    return ExitStatus.BAD_INPUT
