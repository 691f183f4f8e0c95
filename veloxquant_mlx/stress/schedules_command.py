"""``python -m veloxquant_mlx.stress.schedules``: explore every built-in scenario's schedules.

Prints the scope (granularity and preemption bound) and one line per
scenario: its threads, sequential orders, allowed and seen outcomes,
schedules run, whether the exploration was exhaustive, its time and its
verdict; then any violation, with the choices that replay it.

A preemption bound is the stated scope of the check: OK means every
schedule within it ran and matched the spec. ``--max-schedules`` is a
budget: a scenario that reaches it is inconclusive.

Exit status (:mod:`veloxquant_mlx.commandline.verdicts`): 0 OK, 1 a
violation, 2 bad input, 3 inconclusive, 130 Ctrl-C.

Complexity: as :func:`~veloxquant_mlx.stress.schedules.explore`, per
scenario. Thread safety: one command per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.commandline.verdicts import combined
from veloxquant_mlx.simulate.options import int_at_least
from veloxquant_mlx.stress.schedules import SCENARIOS, Exploration, Granularity, explore

__all__ = ["PROG", "main"]

PROG: Final = "python -m veloxquant_mlx.stress.schedules"
_DEFAULT_MAX_SCHEDULES: Final = 100_000


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Run every built-in scenario under every schedule and check each against "
        "the spec. Exit status: 0 ok, 1 violation, 2 bad input, 3 inconclusive, 130 "
        "interrupted.",
    )
    parser.add_argument("--granularity", choices=("lock", "line"), default="lock")
    parser.add_argument(
        "--max-preemptions",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="preemptions per schedule (the scope; default: no bound)",
    )
    parser.add_argument(
        "--max-schedules",
        type=int_at_least(1),
        default=_DEFAULT_MAX_SCHEDULES,
        metavar="N",
        help="schedules per scenario before it stops, inconclusive (default: %(default)s)",
    )
    return parser


def _row(result: Exploration, threads: int) -> str:
    exhaustive = "yes" if result.exhaustive else "no"
    return (
        f"{result.scenario:<36} {threads:>7} {result.sequential_orders:>6} "
        f"{result.outcomes_allowed:>8} {result.outcomes_seen:>4} {result.schedules:>9} "
        f"{exhaustive:<10} {result.seconds:8.2f}  {result.verdict.label}"
    )


def _explore_all(granularity: Granularity, bound: int | None, max_schedules: int) -> int:
    scope = "every schedule" if bound is None else f"every schedule with <= {bound} preemptions"
    print(f"granularity={granularity} max_preemptions={bound} ({scope})")
    print(
        f"{'scenario':<36} {'threads':>7} {'orders':>6} {'outcomes':>8} {'seen':>4} "
        f"{'schedules':>9} exhaustive  seconds  verdict"
    )
    results = []
    for scenario in SCENARIOS:
        result = explore(
            scenario,
            granularity=granularity,
            max_preemptions=bound,
            max_schedules=max_schedules,
        )
        results.append(result)
        print(_row(result, len(scenario.threads)), flush=True)
        for violation in result.violations:
            print(violation)
        if result.gap is not None and not result.violations:
            print(f"  NOT CHECKED: {result.gap}")
    return combined(result.verdict for result in results).exit_status


def main(argv: Sequence[str] | None = None) -> int:
    """Explore every built-in scenario; the exit status (module docstring)."""
    return run_command(PROG, lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    return _explore_all(args.granularity, args.max_preemptions, args.max_schedules)
