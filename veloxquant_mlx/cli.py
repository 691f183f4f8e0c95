"""The ``veloxquant-mlx`` command line (also ``python -m veloxquant_mlx``).

Each subcommand is one :class:`Subcommand` entry in :data:`SUBCOMMANDS`: a
name, its help texts, and three functions — declare the options, validate the
parsed options as a whole, run. Adding a subcommand (say ``stress``) means
writing those three functions in its own package and adding one entry here;
:func:`main` needs no change.

Usage errors (unknown options, bad values, conflicting options, input too
big for the machine's memory) print one line naming the value and the
expectation on stderr and exit with status 2; so does bad input a
subcommand finds later (:class:`~veloxquant_mlx.commandline.bad_input.BadInputError`,
e.g. an ``--out`` folder that cannot be written). Ctrl-C prints one line and
exits with 130. The exit statuses are those of
:mod:`veloxquant_mlx.commandline.verdicts`. :func:`main` returns the status
rather than raising ``SystemExit``, so it can be called from tests and scripts.
The older ``python -m`` entry points are :func:`run_alias`: one subcommand
under the name it was started by, which its errors, ``--help`` and Ctrl-C
line show.

Complexity: parsing is O(number of arguments).
Thread safety: :func:`main` writes to the process's stdout and stderr.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from veloxquant_mlx import __version__
from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.simulate import command as simulate_command
from veloxquant_mlx.simulate import options as simulate_options
from veloxquant_mlx.stress import cli as stress_command
from veloxquant_mlx.stress import schedules_command
from veloxquant_mlx.testing import driver_command, exhaustive_command, replay_command

PROG = "veloxquant-mlx"


@dataclass(frozen=True)
class Subcommand:
    """One ``veloxquant-mlx`` subcommand.

    Invariant: ``run`` is only called with a namespace that ``add_arguments``
    declared and ``validate`` accepted, plus ``prog``: the command's name as
    it was started (``veloxquant-mlx NAME``, or an alias's), for the lines it prints.
    """

    name: str
    summary: str  # one line, shown in the list of subcommands
    description: str  # shown by ``veloxquant-mlx NAME --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    validate: Callable[[argparse.Namespace], str | None]  # None, or a usage error message
    run: Callable[[argparse.Namespace], int]  # returns the exit status

    @classmethod
    def of_module(cls, name: str, module: ModuleType) -> Subcommand:
        """The subcommand a ``*_command`` module declares by its usual names
        (``SUMMARY``, ``DESCRIPTION``, ``add_arguments``, ``validate``, ``run``)."""
        return cls(
            name=name,
            summary=module.SUMMARY,
            description=module.DESCRIPTION,
            add_arguments=module.add_arguments,
            validate=module.validate,
            run=module.run,
        )


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        name="simulate",
        summary=simulate_command.SUMMARY,
        description=simulate_command.DESCRIPTION,
        add_arguments=simulate_options.add_arguments,
        validate=simulate_options.validate,
        run=simulate_command.run,
    ),
    Subcommand.of_module("stress", stress_command),
    Subcommand.of_module("exhaustive", exhaustive_command),
    Subcommand.of_module("replay", replay_command),
    Subcommand.of_module("schedules", schedules_command),
    Subcommand.of_module("driver", driver_command),
)


def version_text() -> str:
    """What ``--version`` prints: the version, and which build of the allocator runs."""
    build = "compiled by mypyc" if block_pool.COMPILED else "interpreted (pure Python)"
    return f"%(prog)s {__version__}\nblock_pool: {build}, {block_pool.__file__}"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser, by name."""
    parser = OneLineParser(
        prog=PROG,
        description="Tools around the veloxquant_mlx KV-cache block pool.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps --version's two lines
    )
    parser.add_argument("--version", action="version", version=version_text())
    subparsers = parser.add_subparsers(
        title="subcommands", dest="subcommand", required=True, metavar="SUBCOMMAND"
    )
    by_name: dict[str, argparse.ArgumentParser] = {}
    for subcommand in SUBCOMMANDS:
        subparser = subparsers.add_parser(
            subcommand.name,
            help=subcommand.summary,
            description=subcommand.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        subcommand.add_arguments(subparser)
        by_name[subcommand.name] = subparser
    return parser, by_name


def _find(name: str) -> Subcommand:
    return next(subcommand for subcommand in SUBCOMMANDS if subcommand.name == name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 2 on a usage error or bad input, 130 on Ctrl-C,
        otherwise the subcommand's own status.
    """
    return run_command(PROG, lambda: _parse_and_run(argv))


def run_alias(prog: str, name: str, argv: Sequence[str] | None, preset: Sequence[str] = ()) -> int:
    """An older ``python -m`` entry point: subcommand ``name`` as program ``prog``.

    Args:
        prog: The name it was started by (``python -m veloxquant_mlx.testing.exhaustive``).
        name: The subcommand it runs.
        argv: Its arguments (default: ``sys.argv[1:]``).
        preset: Options put before ``argv`` (a scenario the alias stands for).

    Returns:
        The exit status, as :func:`main`'s.
    """
    arguments = [*preset, *(sys.argv[1:] if argv is None else argv)]
    return run_command(prog, lambda: _run_one(prog, _find(name), arguments))


def _run_one(prog: str, subcommand: Subcommand, argv: Sequence[str]) -> int:
    parser = OneLineParser(
        prog=prog,
        description=subcommand.description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subcommand.add_arguments(parser)
    args = parser.parse_args(argv)  # a usage error exits: see run_command
    problem = subcommand.validate(args)
    if problem is not None:
        parser.error(problem)
    args.prog = prog
    return subcommand.run(args)


def _parse_and_run(argv: Sequence[str] | None) -> int:
    parser, subparsers = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    _refuse_options_before_a_subcommand(parser, arguments)
    args, unknown = parser.parse_known_args(arguments)  # a usage error exits: see run_command
    subcommand = _find(args.subcommand)
    # Reported by the subcommand's parser, so that its name is the one shown.
    problem = (
        f"unrecognized arguments: {' '.join(unknown)}" if unknown else subcommand.validate(args)
    )
    if problem is not None:
        subparsers[subcommand.name].error(problem)
    args.prog = f"{PROG} {subcommand.name}"
    return run_command(args.prog, lambda: subcommand.run(args))


def _refuse_options_before_a_subcommand(
    parser: argparse.ArgumentParser, arguments: Sequence[str]
) -> None:
    """Options before the subcommand, other than ``--help`` and ``--version``, are
    refused by name (argparse would say that a subcommand is missing, or that the
    option's value is not one). A first argument that is a word is left to argparse,
    which names it if it is no subcommand."""
    names = {subcommand.name for subcommand in SUBCOMMANDS}
    if not arguments or not arguments[0].startswith("-"):
        return
    before = itertools.takewhile(lambda argument: argument not in names, arguments)
    unknown = [
        argument
        for argument in before
        if argument.startswith("-") and argument not in ("-h", "--help", "--version")
    ]
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}; expected a subcommand first "
            f"({', '.join(subcommand.name for subcommand in SUBCOMMANDS)}), its options after it"
        )
