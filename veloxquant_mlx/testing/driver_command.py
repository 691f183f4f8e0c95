"""``veloxquant-mlx driver [--factory module:callable]``: serve a pool over the driver protocol.

Serves one port on stdin and stdout, as docs/DRIVER_PROTOCOL.md says: the
hello line, then one response line per request line, until stdin ends
(status 0). The port is our ``BlockPoolAllocator``, or the Python port that
``--factory`` names (the factory contract of docs/CONFORMANCE_KIT.md; the
module is imported from the current directory). The kit starts it through
:func:`~veloxquant_mlx.testing.driven.driven_port`, and
``veloxquant-mlx exhaustive --driver "veloxquant-mlx driver"`` explores it.

Stdout carries the protocol only; every other line goes to stderr. A
factory that cannot be imported, or text that is not ``module:callable``,
is one line on stderr and status 2, before the hello. Ctrl-C: one line on
stderr, status 130. ``python -m veloxquant_mlx.testing.driver`` is the same
command.

Complexity: as :class:`~veloxquant_mlx.testing.driver.Driver`, per line.
Thread safety: one command per process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Final

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.testing.driver import serve_lines
from veloxquant_mlx.testing.port import Port, port_argument

__all__ = ["DESCRIPTION", "SUMMARY", "add_arguments", "main", "run", "validate"]

SUMMARY: Final = "serve a pool over the JSON-lines driver protocol on stdin and stdout"
DESCRIPTION: Final = """\
Serve our pool (or --factory's) over the JSON-lines driver protocol of
docs/DRIVER_PROTOCOL.md: a hello line, then one response per request line on
stdin, until stdin ends. The conformance kit and `veloxquant-mlx exhaustive
--driver` drive a port through such a driver; a port in another language
ships its own.

Exit status: 0 stdin ended, 2 bad input, 130 interrupted.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``driver``'s options."""
    parser.add_argument(
        "--factory",
        type=port_argument,
        metavar="MODULE:CALLABLE",
        help="serve this pool instead of ours: a factory taking a config "
        "(docs/CONFORMANCE_KIT.md); MODULE is imported from the current directory",
    )


def validate(args: argparse.Namespace) -> str | None:
    """Nothing to check beyond each option's own type."""
    return None


def run(args: argparse.Namespace) -> int:
    """Serve stdin until it ends; status 0."""
    port: Port = args.factory or Port(BlockPoolAllocator)
    serve_lines(port, sys.stdin.buffer, sys.stdout)  # bytes: each line decoded alone
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.testing.driver``: the ``driver`` subcommand."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    return run_alias("python -m veloxquant_mlx.testing.driver", "driver", argv)
