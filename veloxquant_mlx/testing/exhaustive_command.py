"""``python -m veloxquant_mlx.testing.exhaustive``: the small-scope exhaustive check.

Explores the chosen scopes (:data:`~veloxquant_mlx.testing.exhaustive.SCOPES`)
to the profile's depth (or ``--depth``), printing one summary line per scope
(or, with ``--json``, one JSON document) and progress on stderr.

Budgets: ``--max-states`` bounds each scope's distinct states (the memory:
about :data:`BYTES_PER_STATE` each; a value that cannot fit in the memory
available is refused up front), ``--time-budget`` the whole command's time.
A scope cut by either is inconclusive: its line says which sequences were
not checked and why.

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

from veloxquant_mlx.commandline.bad_input import OneLineParser, require_fits_in_memory
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.commandline.verdicts import combined
from veloxquant_mlx.simulate.options import finite_float, int_at_least
from veloxquant_mlx.testing.exhaustive import PROFILE_DEPTHS, SCOPES, Exploration, explore

__all__ = ["BYTES_PER_STATE", "DEFAULT_MAX_STATES", "PROG", "main"]

PROG: Final = "python -m veloxquant_mlx.testing.exhaustive"
#: Heap bytes per distinct state (measured with tracemalloc: about 2,200), rounded up.
BYTES_PER_STATE: Final = 3_000
#: The default state budget per scope: the nightly depth needs about a million.
DEFAULT_MAX_STATES: Final = 3_000_000


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Check every operation sequence up to a depth against the spec. Exit "
        "status: 0 ok, 1 counterexample, 2 bad input, 3 inconclusive (a budget ran out), "
        "130 interrupted.",
    )
    parser.add_argument("--profile", choices=sorted(PROFILE_DEPTHS), default="ci")
    parser.add_argument(
        "--depth", type=int_at_least(0), help="overrides the profile's depth (ci 4, nightly 6)"
    )
    names = [scope.name for scope in SCOPES]
    parser.add_argument("--scope", action="append", choices=names, help="repeatable")
    parser.add_argument(
        "--max-states",
        type=int_at_least(1),
        default=DEFAULT_MAX_STATES,
        metavar="N",
        help="distinct states per scope before it stops, inconclusive (default: %(default)s)",
    )
    parser.add_argument(
        "--time-budget",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="stop (inconclusive) after this long, all scopes together (default: no limit)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _explore_all(
    depth: int, names: Sequence[str] | None, max_states: int, seconds: float | None, as_json: bool
) -> int:
    deadline = None if seconds is None else time.monotonic() + seconds
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


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    depth: int = PROFILE_DEPTHS[args.profile] if args.depth is None else args.depth
    require_fits_in_memory(args.max_states * BYTES_PER_STATE, f"--max-states {args.max_states}")
    return _explore_all(depth, args.scope, args.max_states, args.time_budget, args.json)
