"""``veloxquant-mlx schedules``: explore every built-in scenario's schedules.

Prints the scope (granularity and preemption bound) and one line per
scenario: its threads, sequential orders, allowed and seen outcomes,
schedules run, whether the exploration was exhaustive, its time and its
verdict; then any violation, with the choices that replay it. The last
scenario, ``finaliser_inside_the_lock``
(:mod:`~veloxquant_mlx.stress.finaliser_schedules`), fires a dropped KV
cache's finaliser at every locked line of every schedule of its own
scenario; its line gives the drop points and runs. While a scenario runs,
a progress line goes to stderr at most every
:data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` seconds
(``  NAME: 24,252 schedules, 31 s``; for the finaliser scenario
``  NAME: drop point 12, 1,234 runs, 31 s``), so that a long run shows it is
alive.

A preemption bound is the stated scope of the check: OK means every
schedule within it ran and matched the spec. ``--max-schedules`` is a
budget (for the finaliser scenario: runs): a scenario that reaches it is
inconclusive.

Exit status (:mod:`veloxquant_mlx.commandline.verdicts`): 0 OK, 1 a
violation, 2 bad input, 3 inconclusive, 130 Ctrl-C. Ctrl-C is polled
between schedules and between the finaliser's runs
(:class:`~veloxquant_mlx.commandline.interrupts.InterruptRequest`), never
raised inside one, whose threads hand a baton over semaphores. ``python -m
veloxquant_mlx.stress.schedules`` is the same command; ``python -m
veloxquant_mlx.stress.finaliser_schedules [--max-runs N]`` runs the
finaliser scenario alone.

Complexity: as :func:`~veloxquant_mlx.stress.schedules.explore`, per
scenario. Thread safety: one command per process.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from veloxquant_mlx.commandline.interrupts import InterruptRequest, report_interrupt
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.commandline.verdicts import Verdict, combined
from veloxquant_mlx.stress.schedule_scenarios import SCENARIOS

if TYPE_CHECKING:
    from veloxquant_mlx.stress.schedules import Granularity

__all__ = ["DESCRIPTION", "FINALISER", "SUMMARY", "add_arguments", "main", "run", "validate"]

#: The name of the finaliser scenario (its own explorer).
FINALISER: Final = "finaliser_inside_the_lock"
_DEFAULT_MAX_SCHEDULES: Final = 100_000

SUMMARY: Final = "run small concurrent scenarios under every thread interleaving"
DESCRIPTION: Final = """\
Run every built-in scenario (a few threads' pool calls) under every
interleaving of its scheduling points, and check each schedule's outcomes
and final state against the sequential orders the spec allows; then fire a
dropped cache's finaliser at every locked line of every schedule of its
scenario.

Exit status: 0 ok, 1 violation, 2 bad input, 3 inconclusive, 130 interrupted.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``schedules``' options."""
    parser.add_argument(
        "--granularity",
        choices=("lock", "line"),
        default=None,  # "lock"; None, so that validate() sees it was given
        help="where a thread may be preempted: at the pool's lock, or at every line "
        "(default: lock)",
    )
    parser.add_argument(
        "--max-preemptions",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="preemptions per schedule (the scope; default: no bound)",
    )
    parser.add_argument(
        "--max-schedules",
        "--max-runs",
        dest="max_schedules",
        type=int_at_least(1),
        default=_DEFAULT_MAX_SCHEDULES,
        metavar="N",
        help="schedules (runs) per scenario before it stops, inconclusive (default: %(default)s)",
    )
    names = [scenario.name for scenario in SCENARIOS] + [FINALISER]
    parser.add_argument(
        "--scenario", action="append", choices=names, help="repeatable (default: all)"
    )


def validate(args: argparse.Namespace) -> str | None:
    """Refused on a compiled allocator, whose lock cannot be replaced nor its lines traced;
    and the scope's options for the finaliser scenario alone, which has no such scope."""
    from veloxquant_mlx.stress.controlled_scheduler import (  # noqa: PLC0415
        compiled_allocator_problem,
    )

    if args.scenario is not None and set(args.scenario) == {FINALISER}:
        for option, value in (
            ("--max-preemptions", args.max_preemptions),
            ("--granularity", args.granularity),
        ):
            if value is not None:
                return (
                    f"{option} {value} has no effect on {FINALISER} alone, which runs every "
                    "drop point of every schedule; expected it left out, or another --scenario"
                )
    return compiled_allocator_problem()


def _row(result: object, threads: int) -> str:
    from veloxquant_mlx.stress.schedules import Exploration  # noqa: PLC0415

    assert isinstance(result, Exploration)
    exhaustive = "yes" if result.exhaustive else "no"
    return (
        f"{result.scenario:<36} {threads:>7} {result.sequential_orders:>6} "
        f"{result.outcomes_allowed:>8} {result.outcomes_seen:>4} {result.schedules:>9} "
        f"{exhaustive:<10} {result.seconds:8.2f}  {result.verdict.label}"
    )


def run(args: argparse.Namespace) -> int:
    """Explore the chosen scenarios; the exit status (module docstring)."""
    with InterruptRequest(args.prog) as interrupt:
        return _explore_all(args, interrupt.requested)


def _explore_all(args: argparse.Namespace, interrupt: threading.Event) -> int:
    from veloxquant_mlx.stress.schedules import explore  # noqa: PLC0415

    chosen = args.scenario
    bound = args.max_preemptions
    granularity: Granularity = "line" if args.granularity == "line" else "lock"
    scenarios = [s for s in SCENARIOS if chosen is None or s.name in chosen]
    if scenarios:
        scope = "every schedule" if bound is None else f"every schedule with <= {bound} preemptions"
        print(f"granularity={granularity} max_preemptions={bound} ({scope})", flush=True)
        print(
            f"{'scenario':<36} {'threads':>7} {'orders':>6} {'outcomes':>8} {'seen':>4} "
            f"{'schedules':>9} exhaustive  seconds  verdict",
            flush=True,
        )
    verdicts: list[Verdict] = []
    for scenario in scenarios:
        result = explore(
            scenario,
            granularity=granularity,
            max_preemptions=bound,
            max_schedules=args.max_schedules,
            interrupt=interrupt,
            progress=_to_stderr,
        )
        verdicts.append(result.verdict)
        print(_row(result, len(scenario.threads)), flush=True)
        for violation in result.violations:
            print(violation)
        if result.gap is not None and not result.violations:
            print(f"  NOT CHECKED: {result.gap}")
        if result.interrupted:
            return report_interrupt(
                args.prog,
                f"in scenario {len(verdicts)} of {len(scenarios)}, after {result.schedules:,} "
                "schedules of it",
            )
    if chosen is None or FINALISER in chosen:
        verdicts.append(_finaliser(args.max_schedules, interrupt))
        if verdicts[-1] is Verdict.INTERRUPTED:
            return report_interrupt(args.prog, f"in {FINALISER}")
    return combined(verdicts).exit_status


def _finaliser(max_runs: int, interrupt: threading.Event) -> Verdict:
    from veloxquant_mlx.stress.finaliser_schedules import explore_finaliser  # noqa: PLC0415

    print(f"{FINALISER}: every schedule of every drop point, at most {max_runs:,} runs", flush=True)
    result = explore_finaliser(max_runs=max_runs, interrupt=interrupt, progress=_to_stderr)
    if result.interrupted:
        return result.verdict
    print(
        f"{FINALISER}: {result.verdict.label}: {result.drop_points} drop points, "
        f"{result.runs:,} runs, {result.fired_inside_lock:,} fired inside the lock, "
        f"{result.seconds:.2f} s",
        flush=True,
    )
    for violation in result.violations:
        print(f"  {violation}")
    if result.gap is not None and not result.violations:
        print(f"  NOT CHECKED: {result.gap}")
    return result.verdict


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.stress.schedules``: the ``schedules`` subcommand."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    return run_alias("python -m veloxquant_mlx.stress.schedules", "schedules", argv)
