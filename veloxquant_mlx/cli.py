"""The ``veloxquant-mlx`` command line (also ``python -m veloxquant_mlx``).

Each subcommand is one :class:`Subcommand` entry in :data:`SUBCOMMANDS`: a
name, its help texts, and three functions — declare the options, validate the
parsed options as a whole, run. Adding a subcommand (say ``stress``) means
writing those three functions in its own package and adding one entry here;
:func:`main` needs no change.

Usage errors (unknown options, bad values, conflicting options) print the
usage and a message naming the value and the expectation on stderr and exit
with status 2, as ``argparse`` does; :func:`main` returns that status rather
than raising ``SystemExit``, so it can be called from tests and scripts.

Complexity: parsing is O(number of arguments).
Thread safety: :func:`main` writes to the process's stdout and stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from veloxquant_mlx import __version__
from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.simulate import command as simulate_command
from veloxquant_mlx.simulate import options as simulate_options
from veloxquant_mlx.stress import cli as stress_command

PROG = "veloxquant-mlx"


@dataclass(frozen=True)
class Subcommand:
    """One ``veloxquant-mlx`` subcommand.

    Invariant: ``run`` is only called with a namespace that ``add_arguments``
    declared and ``validate`` accepted.
    """

    name: str
    summary: str  # one line, shown in the list of subcommands
    description: str  # shown by ``veloxquant-mlx NAME --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    validate: Callable[[argparse.Namespace], str | None]  # None, or a usage error message
    run: Callable[[argparse.Namespace], int]  # returns the exit status


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        name="simulate",
        summary=simulate_command.SUMMARY,
        description=simulate_command.DESCRIPTION,
        add_arguments=simulate_options.add_arguments,
        validate=simulate_options.validate,
        run=simulate_command.run,
    ),
    Subcommand(
        name="stress",
        summary=stress_command.SUMMARY,
        description=stress_command.DESCRIPTION,
        add_arguments=stress_command.add_arguments,
        validate=stress_command.validate,
        run=stress_command.run,
    ),
)


def version_text() -> str:
    """What ``--version`` prints: the version, and which build of the allocator runs."""
    build = "compiled by mypyc" if block_pool.COMPILED else "interpreted (pure Python)"
    return f"%(prog)s {__version__}\nblock_pool: {build}, {block_pool.__file__}"


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser, by name."""
    parser = argparse.ArgumentParser(
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


def _exit_status(exit_: SystemExit) -> int:
    if exit_.code is None:
        return 0
    return exit_.code if isinstance(exit_.code, int) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a usage error, otherwise the
        subcommand's own status.
    """
    parser, subparsers = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        subcommand = _find(args.subcommand)
        # Reported by the subcommand's parser, so that its usage is the one shown.
        problem = (
            f"unrecognized arguments: {' '.join(unknown)}" if unknown else subcommand.validate(args)
        )
        if problem is not None:
            subparsers[subcommand.name].error(problem)
    except SystemExit as exit_:
        return _exit_status(exit_)
    return subcommand.run(args)
