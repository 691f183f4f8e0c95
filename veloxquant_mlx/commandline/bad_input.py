"""Refusing bad input on the command line: one line naming the value, exit status 2.

Every command parses with :class:`OneLineParser`, whose usage errors are one
line (``PROG: error: argument --depth: expected an int >= 0, got '-1' (see
--help)``) instead of argparse's usage block. Checks that need more than
one option, or the contents of a file, raise :class:`BadInputError`, which
:func:`veloxquant_mlx.commandline.interrupts.run_command` prints the same way.

Input that would make a command allocate more than the machine has is
refused before anything is allocated: :func:`require_fits_in_memory`
compares an estimate (the caller's, in bytes) with the memory available now.

Complexity: O(1), except reading ``/proc/meminfo``. Thread safety: pure
functions; the parser is used from one thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from veloxquant_mlx.commandline.verdicts import ExitStatus

__all__ = [
    "BadInputError",
    "OneLineParser",
    "available_memory_bytes",
    "human_bytes",
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


def human_bytes(count: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: bytes in binary units, three significant figures."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value, unit = float(count), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} bytes"
    return f"{value:.3g} {units[unit]}" if value < 100 else f"{value:.0f} {units[unit]}"


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get now (Linux ``MemAvailable``), else physical memory.

    ``None`` where neither can be read: the caller then cannot refuse on size.
    """
    meminfo = Path("/proc/meminfo")
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def require_fits_in_memory(needed: int, what: str, *, available: int | None = None) -> None:
    """Refuse input that needs more memory than is available.

    Args:
        needed: The caller's estimate, in bytes, of what the input makes it allocate.
        what: Names the input and its value, e.g. ``"header n_layers=100000000000"``.
        available: Bytes available (default: :func:`available_memory_bytes`).

    Raises:
        BadInputError: ``needed`` exceeds what is available.
    """
    if available is None:
        available = available_memory_bytes()
    if available is not None and needed > available:
        raise BadInputError(
            f"{what} needs about {human_bytes(needed)} of memory, more than the "
            f"{human_bytes(available)} available; expected a smaller value"
        )


def print_bad_input(prog: str, error: BadInputError | str) -> ExitStatus:
    """Print the one error line for ``error`` on stderr; return :attr:`ExitStatus.BAD_INPUT`."""
    sys.stderr.write(one_line_error(prog, str(error)))
    return ExitStatus.BAD_INPUT
