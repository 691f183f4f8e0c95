"""``python -m veloxquant_mlx.stress.finaliser_schedules``: the finaliser fired inside the lock.

Runs :func:`~veloxquant_mlx.stress.finaliser_schedules.explore_finaliser`
(every schedule of the scenario, with the dropped book's finaliser fired at
every line executed under the pool's lock) and prints one line with the
counts and the verdict, then any violation.

``--max-runs`` is a budget: an exploration that reaches it is inconclusive.
Ctrl-C is polled between runs
(:class:`~veloxquant_mlx.commandline.interrupts.InterruptRequest`), never
raised inside one, whose threads hand a baton over semaphores.

Exit status (:mod:`veloxquant_mlx.commandline.verdicts`): 0 OK (every
schedule of every drop point passed), 1 a violation, 2 bad input, 3
inconclusive, 130 Ctrl-C.

Complexity: as :func:`~veloxquant_mlx.stress.finaliser_schedules.explore_finaliser`.
Thread safety: one command per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.interrupts import InterruptRequest, report_interrupt, run_command
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.stress.finaliser_schedules import (
    DEFAULT_MAX_RUNS,
    FinaliserExploration,
    explore_finaliser,
)

__all__ = ["PROG", "main"]

PROG: Final = "python -m veloxquant_mlx.stress.finaliser_schedules"


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Drop a KV cache at every line the pool runs under its lock, in every "
        "schedule of a two-thread scenario, and check that every block comes back. Exit "
        "status: 0 ok, 1 violation, 2 bad input, 3 inconclusive, 130 interrupted.",
    )
    parser.add_argument(
        "--max-runs",
        type=int_at_least(1),
        default=DEFAULT_MAX_RUNS,
        metavar="N",
        help="runs before the exploration stops, inconclusive (default: %(default)s)",
    )
    return parser


def _summary(result: FinaliserExploration) -> str:
    return (
        f"finaliser inside the pool's lock: {result.verdict.label}: {result.drop_points} drop "
        f"points, {result.runs:,} runs, {result.fired_inside_lock:,} fired inside the lock, "
        f"{result.seconds:.2f} s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Explore the scenario; the exit status (module docstring)."""
    return run_command(PROG, lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    with InterruptRequest(PROG) as interrupt:
        print(f"every schedule of every drop point, at most {args.max_runs:,} runs", flush=True)
        result = explore_finaliser(max_runs=args.max_runs, interrupt=interrupt.requested)
    if result.verdict is Verdict.INTERRUPTED:
        return report_interrupt(PROG, f"after {result.runs:,} runs")
    print(_summary(result))
    for violation in result.violations:
        print(violation)
    if result.gap is not None and not result.violations:
        print(f"  NOT CHECKED: {result.gap}")
    return result.verdict.exit_status
