"""``veloxquant-mlx exhaustive``: the small-scope exhaustive check, from the command line.

Explores the chosen scopes (:data:`~veloxquant_mlx.testing.exhaustive.SCOPES`)
to the profile's depth (or ``--depth``), printing one summary line per scope
(or, with ``--json``, one JSON document) and progress on stderr: a line
per depth and, while a depth runs, one at most every
:data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` seconds
(``  separate-4: depth 4: 12,345 of 45,678 states expanded, 1,234,567
states, 40 s``), so that a long depth shows it is alive. With
``--out DIR``, each counterexample is also written there as a trace
(``counterexample-SCOPE.jsonl``), which ``veloxquant-mlx replay`` replays.
``--factory module:callable`` checks a port instead of our allocator
(docs/CONFORMANCE_KIT.md gives the factory contract); ``--driver COMMAND``
one in any language, served by the driver that command starts (split as a
shell would, not run by one; docs/DRIVER_PROTOCOL.md). A driver that cannot
start or says no hello is bad input; so is one that dies, writes junk or
answers late mid-run: the scopes printed before stand, the line names the
request and the scope, and no verdict is given.

Budgets: ``--max-states`` bounds each scope's distinct states (the memory:
about :data:`BYTES_PER_STATE` each; a value that cannot fit in this
machine's memory is refused up front), ``--time-budget`` the whole
command's time. Both have defaults, so that any ``--depth`` ends: at most
:data:`DEFAULT_MAX_STATES` states, or what half the machine's memory holds
if that is fewer (an 8 GB laptop runs the defaults), and the profile's
:data:`DEFAULT_TIME_BUDGETS`. A scope cut by either is inconclusive: its
line says which sequences were not checked and why.

Exit status (:mod:`veloxquant_mlx.commandline.verdicts`): 0 every scope
checked in full, 1 a counterexample, 2 bad input, 3 inconclusive, 130 Ctrl-C.
``python -m veloxquant_mlx.testing.exhaustive`` is the same command.

Complexity: as :func:`~veloxquant_mlx.testing.exhaustive.explore`.
Thread safety: one command per process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from veloxquant_mlx.commandline.bad_input import (
    BadInputError,
    memory_note,
    physical_memory_bytes,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.files import atomic_write_text, out_dir_argument, prepare_out_dir
from veloxquant_mlx.commandline.sizes import PROCESS_BYTES
from veloxquant_mlx.commandline.values import finite_float, int_at_least
from veloxquant_mlx.commandline.verdicts import combined
from veloxquant_mlx.testing.driven import DriverFailure
from veloxquant_mlx.testing.exhaustive import (
    PROFILE_DEPTHS,
    SCOPES,
    Exploration,
    default_factory,
    explore,
    port_scope,
)
from veloxquant_mlx.testing.port import Port
from veloxquant_mlx.testing.port_options import (
    add_port_options,
    port_from_options,
    port_refusal,
)
from veloxquant_mlx.testing.traces import dumps

__all__ = [
    "BYTES_PER_STATE",
    "DEFAULT_MAX_STATES",
    "DEFAULT_TIME_BUDGETS",
    "DESCRIPTION",
    "SUMMARY",
    "add_arguments",
    "default_max_states",
    "main",
    "memory_estimate",
    "run",
    "validate",
]

#: Bytes per distinct state. Measured: about 2,200 with tracemalloc, and 1,850
#: resident (300,000 states of ``separate-4`` at depth 6: 584 MiB, the process included).
BYTES_PER_STATE: Final = 2_200
#: The most states per scope by default: the nightly depth needs up to about a million.
DEFAULT_MAX_STATES: Final = 3_000_000
#: The default time budget of each profile, all scopes together: a ``--depth`` far
#: past the profile's then ends, inconclusive. The ci profile takes about 20 s here.
DEFAULT_TIME_BUDGETS: Final = {"ci": 15 * 60.0, "nightly": 8 * 3600.0}

SUMMARY: Final = "check every call sequence up to a depth on small pools, against the spec"
DESCRIPTION: Final = """\
Explore every sequence of calls (derived from the operation table) up to a
depth on each small pool, in lockstep with the spec; print states and
transitions per scope, and a shortest counterexample if there is one.

Exit status: 0 ok, 1 counterexample, 2 bad input, 3 inconclusive (a budget
ran out), 130 interrupted.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``exhaustive``'s options."""
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILE_DEPTHS),
        default="ci",
        help="the depth and time budget (ci: 4 and 15 min, nightly: 6 and 8 h; default: ci)",
    )
    parser.add_argument(
        "--depth", type=int_at_least(0), help="overrides the profile's depth (ci 4, nightly 6)"
    )
    names = [scope.name for scope in SCOPES]
    parser.add_argument("--scope", action="append", choices=names, help="repeatable")
    parser.add_argument(
        "--max-states",
        type=int_at_least(1),
        metavar="N",
        help="distinct states per scope after which it stops, inconclusive (the state it "
        "is expanding finishes first, so a few more may be known; default: "
        f"{DEFAULT_MAX_STATES:,}, or what half this machine's memory holds if fewer)",
    )
    parser.add_argument(
        "--time-budget",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="stop (inconclusive) after this long, all scopes together (default: the profile's)",
    )
    add_port_options(parser, "check")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--out", type=out_dir_argument, metavar="DIR", help="write counterexamples here as traces"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an earlier run's counterexamples in --out"
    )


def validate(args: argparse.Namespace) -> str | None:
    """Refuse ``--force`` without ``--out``, and a state budget this machine cannot hold."""
    if args.force and args.out is None:
        return "--force has no effect without --out (it replaces the counterexamples there)"
    if args.max_states is None:
        return None
    try:
        require_fits_in_memory(memory_estimate(args.max_states), f"--max-states {args.max_states}")
    except ValueError as error:
        return str(error)
    return None


def default_max_states(physical: int | None) -> int:
    """:data:`DEFAULT_MAX_STATES`, or fewer: what half of ``physical`` bytes holds."""
    if physical is None:
        return DEFAULT_MAX_STATES
    return max(1, min(DEFAULT_MAX_STATES, (physical // 2 - PROCESS_BYTES) // BYTES_PER_STATE))


def memory_estimate(max_states: int) -> int:
    """The most bytes a run of ``max_states`` states per scope holds (one scope at a time)."""
    return PROCESS_BYTES + max_states * BYTES_PER_STATE


def _is_counterexample(name: str) -> bool:
    return name.startswith("counterexample-") and name.endswith(".jsonl")


def run(args: argparse.Namespace) -> int:
    """Explore the chosen scopes; the exit status (module docstring)."""
    port = port_from_options(args)  # first: a driver that cannot start leaves nothing written
    if args.out is not None:
        prepare_out_dir(args.out, force=args.force, is_run_file=_is_counterexample)
    depth: int = PROFILE_DEPTHS[args.profile] if args.depth is None else args.depth
    max_states: int = args.max_states
    if max_states is None:
        max_states = default_max_states(physical_memory_bytes())
    seconds: float = (
        DEFAULT_TIME_BUDGETS[args.profile] if args.time_budget is None else args.time_budget
    )
    print(
        f"exploring to depth {depth}, at most {max_states:,} states per scope (memory "
        f"{memory_note(memory_estimate(max_states))} if all are reached) and {seconds:g} s "
        "in all",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + seconds
    results = _explore_scopes(args, port, depth, max_states, deadline)
    if args.json:
        print(json.dumps([result.to_json() for result in results], indent=2))
    return combined(result.verdict for result in results).exit_status


def _explore_scopes(
    args: argparse.Namespace, port: Port | None, depth: int, max_states: int, deadline: float
) -> list[Exploration]:
    """Explore each chosen scope in turn, printing its lines unless ``--json``.

    Raises:
        BadInputError: A driver broke the protocol (died, wrote junk, answered late),
            or a port raised outside a pool call (its factory); the scopes printed
            before stand, and no verdict is given.
    """
    results: list[Exploration] = []
    for scope in SCOPES:
        if args.scope is not None and scope.name not in args.scope:
            continue
        try:
            result = explore(
                scope if port is None else port_scope(port, scope),
                depth,
                port or default_factory,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
                max_states=max_states,
                deadline=deadline,
            )
        except DriverFailure as failure:
            notes = "".join(f"; {note}" for note in getattr(failure, "__notes__", ()))
            raise BadInputError(f"{failure} (exploring {scope.name}{notes})") from None
        except Exception as error:
            if port is None:
                raise  # our own pool: a bug of ours, shown whole
            # A pool call's error is an outcome the checker compares; this escaped one
            # came from building a pool (the factory, or the driver's answer to "pool").
            when = f"while a pool was built or set up (exploring {scope.name})"
            raise port_refusal(port, error, when, scope.config) from None
        results.append(result)
        _save(result, scope.name, args.out)
        if not args.json:
            print(result.summary(), flush=True)
            if result.counterexample is not None:
                print(result.counterexample, flush=True)
    return results


def _save(result: Exploration, scope: str, folder: Path | None) -> None:
    found = result.counterexample
    if folder is not None and found is not None:
        atomic_write_text(folder / f"counterexample-{scope}.jsonl", dumps(found.trace))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.testing.exhaustive``: the ``exhaustive`` subcommand."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    return run_alias("python -m veloxquant_mlx.testing.exhaustive", "exhaustive", argv)
