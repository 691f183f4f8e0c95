"""The command-line options that name a port: ``--factory MODULE:CALLABLE`` or ``--driver COMMAND``
(with ``--driver-timeout SECONDS``).

``veloxquant-mlx exhaustive`` checks the port they name instead of our
allocator, and ``veloxquant-mlx replay`` replays a trace on it: the same two
options, declared and read here once. ``--factory`` imports a Python factory
(docs/CONFORMANCE_KIT.md; the module from the current directory);
``--driver`` starts a driver of any language (docs/DRIVER_PROTOCOL.md), its
command split as a shell would, not run by one.

Complexity: O(1) beyond importing the module or starting the driver. Thread
safety: one command per process.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Final

from veloxquant_mlx.commandline.bad_input import BadInputError
from veloxquant_mlx.commandline.values import finite_float
from veloxquant_mlx.testing.driven import DEFAULT_TIMEOUT, DriverFailure, driven_port
from veloxquant_mlx.testing.port import Port, port_argument

__all__ = [
    "MAX_DRIVER_TIMEOUT",
    "add_port_options",
    "command_line",
    "port_from_options",
    "port_refusal",
]

#: The longest --driver-timeout: a day (far past it, the wait on the pipe overflowed).
MAX_DRIVER_TIMEOUT: Final = 86400.0


def add_port_options(parser: argparse.ArgumentParser, verb: str) -> None:
    """Declare ``--factory`` and ``--driver`` (one or the other); ``verb`` says what is done
    with the port (``"check"``, ``"replay on"``)."""
    port = parser.add_mutually_exclusive_group()
    port.add_argument(
        "--factory",
        type=port_argument,
        metavar="MODULE:CALLABLE",
        help=f"{verb} this pool instead of ours: a factory taking a config, or a Port "
        "naming the port's own classes (docs/CONFORMANCE_KIT.md); MODULE is imported from "
        "the current directory",
    )
    port.add_argument(
        "--driver",
        type=command_line,
        metavar="COMMAND",
        help=f"{verb} the pool this command serves over the driver protocol "
        "(docs/DRIVER_PROTOCOL.md; a port in any language), e.g. 'veloxquant-mlx driver'",
    )
    parser.add_argument(
        "--driver-timeout",
        type=finite_float(0, MAX_DRIVER_TIMEOUT, low_inclusive=False),
        metavar="SECONDS",
        help="with --driver: the seconds it may take to say hello and to answer each "
        f"request (default: {DEFAULT_TIMEOUT:g}, at most {MAX_DRIVER_TIMEOUT:g}); a driver "
        "that starts slowly (a GPU context) may need more",
    )


def command_line(text: str) -> list[str]:
    """``text`` split into words as a shell would (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: The text cannot be split, or holds no word.
    """
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into words: {error}") from None
    if not words:
        raise argparse.ArgumentTypeError(f"expected a command line, got {text!r}")
    return words


def port_from_options(args: argparse.Namespace) -> Port | None:
    """The port ``--factory`` or ``--driver`` names (the driver started); ``None``: ours.

    Raises:
        BadInputError: The driver did not start, or did not say the protocol's hello;
            or ``--driver-timeout`` came without ``--driver``.
    """
    if args.driver is None:
        if args.driver_timeout is not None:
            raise BadInputError("--driver-timeout has no effect without --driver; leave it out")
        port: Port | None = args.factory
        return port
    timeout = DEFAULT_TIMEOUT if args.driver_timeout is None else args.driver_timeout
    try:
        return driven_port(args.driver, timeout=timeout, name=shlex.join(args.driver))
    except DriverFailure as failure:
        raise BadInputError(str(failure)) from None


def port_refusal(port: Port, error: Exception, when: str, config: object) -> BadInputError:
    """What a command says when ``port`` raised outside any pool call (its factory, while
    ``when``): bad input, naming the port, the error and the config it must build."""
    return BadInputError(
        f"the port {port.name!r} raised {type(error).__name__}: {error} {when}; a factory "
        f"must build a pool of {config}"
    )
