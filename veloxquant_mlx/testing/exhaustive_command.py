"""``python -m veloxquant_mlx.testing.exhaustive``: the small-scope exhaustive check.

Explores the chosen scopes (:data:`~veloxquant_mlx.testing.exhaustive.SCOPES`)
to the profile's depth (or ``--depth``), printing one summary line per scope
(or, with ``--json``, one JSON document) and progress on stderr.

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

Complexity: as :func:`~veloxquant_mlx.testing.exhaustive.explore`.
Thread safety: one command per process.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Final

from veloxquant_mlx.commandline.bad_input import (
    OneLineParser,
    memory_note,
    physical_memory_bytes,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.commandline.sizes import PROCESS_BYTES
from veloxquant_mlx.commandline.values import finite_float, int_at_least
from veloxquant_mlx.commandline.verdicts import combined
from veloxquant_mlx.testing.exhaustive import PROFILE_DEPTHS, SCOPES, Exploration, explore

__all__ = [
    "BYTES_PER_STATE",
    "DEFAULT_MAX_STATES",
    "DEFAULT_TIME_BUDGETS",
    "PROG",
    "default_max_states",
    "main",
    "memory_estimate",
]

PROG: Final = "python -m veloxquant_mlx.testing.exhaustive"
#: Bytes per distinct state. Measured: about 2,200 with tracemalloc, and 1,850
#: resident (300,000 states of ``separate-4`` at depth 6: 584 MiB, the process included).
BYTES_PER_STATE: Final = 2_200
#: The most states per scope by default: the nightly depth needs up to about a million.
DEFAULT_MAX_STATES: Final = 3_000_000
#: The default time budget of each profile, all scopes together: a ``--depth`` far
#: past the profile's then ends, inconclusive. The ci profile takes about 20 s here.
DEFAULT_TIME_BUDGETS: Final = {"ci": 15 * 60.0, "nightly": 8 * 3600.0}


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Check every operation sequence up to a depth against the spec. Exit "
        "status: 0 ok, 1 counterexample, 2 bad input, 3 inconclusive (a budget ran out), "
        "130 interrupted.",
    )
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
        help=f"distinct states per scope before it stops, inconclusive (default: "
        f"{DEFAULT_MAX_STATES:,}, or what half this machine's memory holds if fewer)",
    )
    parser.add_argument(
        "--time-budget",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="stop (inconclusive) after this long, all scopes together (default: the profile's)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _explore_all(
    depth: int, names: Sequence[str] | None, max_states: int, seconds: float, as_json: bool
) -> int:
    deadline = time.monotonic() + seconds
    results: list[Exploration] = []
    for scope in SCOPES:
        if names is not None and scope.name not in names:
            continue
        result = explore(
            scope,
            depth,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            max_states=max_states,
            deadline=deadline,
        )
        results.append(result)
        if not as_json:
            print(result.summary(), flush=True)
            if result.counterexample is not None:
                print(result.counterexample, flush=True)
    if as_json:
        print(json.dumps([result.to_json() for result in results], indent=2))
    return combined(result.verdict for result in results).exit_status


def main(argv: Sequence[str] | None = None) -> int:
    """Explore the chosen scopes; the exit status (module docstring)."""
    return run_command(PROG, lambda: _run(argv))


def default_max_states(physical: int | None) -> int:
    """:data:`DEFAULT_MAX_STATES`, or fewer: what half of ``physical`` bytes holds."""
    if physical is None:
        return DEFAULT_MAX_STATES
    return max(1, min(DEFAULT_MAX_STATES, (physical // 2 - PROCESS_BYTES) // BYTES_PER_STATE))


def memory_estimate(max_states: int) -> int:
    """The most bytes a run of ``max_states`` states per scope holds (one scope at a time)."""
    return PROCESS_BYTES + max_states * BYTES_PER_STATE


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    depth: int = PROFILE_DEPTHS[args.profile] if args.depth is None else args.depth
    max_states: int = args.max_states
    if max_states is None:
        max_states = default_max_states(physical_memory_bytes())
    else:
        require_fits_in_memory(memory_estimate(max_states), f"--max-states {max_states}")
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
    return _explore_all(depth, args.scope, max_states, seconds, args.json)
