"""The outcome of a stress run: a JSON report for machines and a summary for people.

:class:`StressReport` holds what the run did (calls per kind, per second,
errors by kind), what was checked (invariant checks, windows and calls of
the history checked for linearizability, calls replayed on storage, the
conservation audit), every :class:`Finding` and every
:class:`~veloxquant_mlx.commandline.verdicts.Gap` (what was not checked, and
why). :attr:`StressReport.verdict` is "violation" iff there is a finding,
"inconclusive" iff there is a gap and no finding, "interrupted" after
Ctrl-C, else "ok"; the command's exit status follows it.

JSON keys (``to_json``; ``schema`` is bumped when one changes meaning):
``schema, verdict, ok, partial, profile, seed, threads, python, pool,
history_len, mix, window_ops, switch_interval, wall_seconds, timing{
total_seconds, checking_seconds, checking_after_calls_seconds,
check_budget_seconds}, operations, worker_operations, operations_per_second,
operations_by_kind{kind: {count, per_second, errors{kind: n}}},
errors_by_kind, invariant_checks, histories_checked{windows, events,
configurations, max_end_states, largest_window, largest_search,
inconclusive_window, events_not_checked, gave_up_because, percent_checked},
replay{backend, ops_replayed, ops_written, trace}, conservation{problems},
not_checked[{what, why}], checks_off[...], violations[{kind, message, path}]``.
``ok`` is ``verdict == "ok"``: every check that was asked for was made on
every call; ``checks_off`` names the checks the options left out (e.g.
``--replay-backend none``), which the summary's verdict line repeats.
``partial`` is true when the run was interrupted. ``wall_seconds`` is the
time the calls took; ``timing`` adds the checking. ``operations`` counts
every recorded call, ``worker_operations`` those of the worker threads
(what ``--ops`` bounds): the rest are the queries recorded at each barrier
and the conservation audit's calls.

Complexity: O(kinds + findings). Thread safety: immutable once built.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from veloxquant_mlx.commandline.verdicts import Gap, Verdict, percent_text, verdict_of
from veloxquant_mlx.stress.config import StressConfig

__all__ = [
    "PARTIAL_TRACE_NAME",
    "REPORT_NAME",
    "REPRODUCER_NAME",
    "RUN_FILE_NAMES",
    "SCHEMA_VERSION",
    "STACKS_NAME",
    "SUMMARY_NAME",
    "TRACE_NAME",
    "Finding",
    "StressReport",
    "Timing",
    "is_run_file",
    "python_description",
    "summary_text",
]

SCHEMA_VERSION: Final = 2
# The files a run writes into its folder, declared here once: the writers use these names
# and --out/--force derive what an earlier run left from them.
REPORT_NAME: Final = "report.json"
SUMMARY_NAME: Final = "summary.txt"
#: The linearized trace of a run whose every call was checked and replayed.
TRACE_NAME: Final = "linearized.jsonl"
#: The trace while it is written, and what an interrupted or inconclusive run leaves.
PARTIAL_TRACE_NAME: Final = "linearized.partial.jsonl"
#: A linearizability violation's reproducer (a trace).
REPRODUCER_NAME: Final = "violation-linearizability.jsonl"
#: Every thread's stack, dumped by the watchdog when the run hangs.
STACKS_NAME: Final = "stacks.txt"
RUN_FILE_NAMES: Final = frozenset(
    (REPORT_NAME, SUMMARY_NAME, TRACE_NAME, PARTIAL_TRACE_NAME, REPRODUCER_NAME, STACKS_NAME)
)
#: What earlier versions wrote and no longer do: the version 1 reproducer.
_FORMER_RUN_FILE_NAMES: Final = frozenset({"violation-linearizability.json"})


def is_run_file(name: str) -> bool:
    """Whether a stress run writes a file of this name (an earlier run's report, trace...)."""
    return name in RUN_FILE_NAMES or name in _FORMER_RUN_FILE_NAMES


@dataclass(frozen=True)
class Timing:
    """Where a run's wall time went: the calls, then the checking after them.

    ``total_seconds <= calls + check_budget_seconds`` (plus one window), the
    run's promise; ``checking_seconds`` is the checker's busy time, most of
    it overlapping the calls.
    """

    total_seconds: float
    checking_seconds: float
    checking_after_calls_seconds: float
    check_budget_seconds: float

    def to_json(self) -> dict[str, float]:
        """The fields, rounded to milliseconds."""
        return {name: round(value, 3) for name, value in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Finding:
    """One violation: its kind (``linearizability``, ``invariant``, ``storage``,
    ``replay``, ``conservation``, ``deadlock``, ``crash``), what broke, and the
    reproducer file, if one was written."""

    kind: str
    message: str
    path: str | None = None


def python_description() -> dict[str, object]:
    """The interpreter: version, implementation, and whether the GIL is on."""
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "gil_enabled": True if is_gil_enabled is None else bool(is_gil_enabled()),
    }


@dataclass(frozen=True)
class StressReport:
    """Everything a finished run reports (see the module docstring for the JSON keys)."""

    config: StressConfig  # what the run was asked to do
    wall_seconds: float
    calls_by_kind: Mapping[str, int]
    worker_calls: int  # of them, by the workers (what --ops bounds)
    errors_by_call_kind: Mapping[str, Mapping[str, int]]
    invariant_checks: int
    histories_checked: Mapping[str, int | None]
    replay: Mapping[str, object]
    conservation_problems: tuple[str, ...]
    findings: tuple[Finding, ...]
    gaps: tuple[Gap, ...] = ()
    interrupted: bool = False
    timing: Timing | None = None
    python: Mapping[str, object] = field(default_factory=python_description)

    @property
    def verdict(self) -> Verdict:
        """Interrupted, violation, inconclusive (a gap) or OK; see the module docstring."""
        return verdict_of(
            violations=len(self.findings), gaps=self.gaps, interrupted=self.interrupted
        )

    @property
    def checks_off(self) -> tuple[str, ...]:
        """The checks left out as asked: not gaps, but named beside OK."""
        return self.config.checks_off()

    @property
    def ok(self) -> bool:
        """True iff every call was checked and nothing was found."""
        return self.verdict is Verdict.OK

    def calls_checked(self) -> tuple[int, int]:
        """``(checked, recorded)``: calls checked for linearizability, of those recorded."""
        checked = int(self.histories_checked.get("events") or 0)
        missed = int(self.histories_checked.get("events_not_checked") or 0)
        return checked, checked + missed

    def percent_checked(self) -> float:
        """Calls checked for linearizability, as a percentage of the calls recorded.

        Three decimals, rounded down: 100 only when every call was checked.
        """
        checked, total = self.calls_checked()
        return 100.0 if total == 0 else 100_000 * checked // total / 1000

    def percent_checked_text(self) -> str:
        """:meth:`percent_checked` as a person reads it: one decimal, ``'62.1%'``."""
        return percent_text(*self.calls_checked())

    @property
    def operations(self) -> int:
        """Calls made on the pool and the store, all threads."""
        return sum(self.calls_by_kind.values())

    def errors_by_kind(self) -> dict[str, int]:
        """How many calls raised each error class, whatever the call."""
        totals: Counter[str] = Counter()
        for errors in self.errors_by_call_kind.values():
            totals.update(errors)
        return dict(sorted(totals.items()))

    def per_second(self, count: int) -> float:
        """``count`` over the run's wall time."""
        return round(count / self.wall_seconds, 1) if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """The report as plain JSON data."""
        return {
            "schema": SCHEMA_VERSION,
            "verdict": self.verdict.value,
            "ok": self.ok,
            "partial": self.interrupted,
            "profile": self.config.profile,
            "seed": self.config.seed,
            "threads": self.config.threads,
            "python": dict(self.python),
            "pool": dataclasses.asdict(self.config.pool),
            "history_len": self.config.history_len,
            "mix": self.config.mix.text(),
            "window_ops": self.config.window_ops,
            "switch_interval": self.config.switch_interval,
            "wall_seconds": round(self.wall_seconds, 3),
            "timing": None if self.timing is None else self.timing.to_json(),
            "operations": self.operations,
            "worker_operations": self.worker_calls,
            "operations_per_second": self.per_second(self.operations),
            "operations_by_kind": {
                kind: {
                    "count": count,
                    "per_second": self.per_second(count),
                    "errors": dict(sorted(self.errors_by_call_kind.get(kind, {}).items())),
                }
                for kind, count in sorted(self.calls_by_kind.items())
            },
            "errors_by_kind": self.errors_by_kind(),
            "invariant_checks": self.invariant_checks,
            "histories_checked": {
                **self.histories_checked,
                "percent_checked": self.percent_checked(),
            },
            "replay": dict(self.replay),
            "conservation": {"problems": list(self.conservation_problems)},
            "not_checked": [gap.to_json() for gap in self.gaps],
            "checks_off": list(self.checks_off),
            "violations": [dataclasses.asdict(finding) for finding in self.findings],
        }


def summary_text(report: StressReport) -> str:
    """A few lines for a person: what ran, what was checked, and any violation."""
    python, config = report.python, report.config
    gil = "GIL" if python.get("gil_enabled") else "free-threaded"
    checked = report.histories_checked
    off = f" (left out, as asked: {'; '.join(report.checks_off)})" if report.checks_off else ""
    lines = [
        f"stress {config.profile}: {report.verdict.label}{off}",
        f"  Python {python.get('version')} ({gil}), {config.threads} threads, seed "
        f"{config.seed}, calls for {report.wall_seconds:.1f} s",
        f"  pool: {config.pool}",
        f"  calls: {report.operations:,} ({report.per_second(report.operations):,.0f}/s); "
        f"{report.worker_calls:,} by the workers, the rest observed at the barriers "
        "and by the audit",
    ]
    for kind, count in sorted(report.calls_by_kind.items(), key=lambda item: -item[1]):
        errors = report.errors_by_call_kind.get(kind, {})
        error_text = ", ".join(f"{name} {n}" for name, n in sorted(errors.items()))
        lines.append(
            f"    {kind:<15}{count:>9,}  {report.per_second(count):>9,.0f}/s"
            + (f"   errors: {error_text}" if error_text else "")
        )
    lines += [
        f"  invariant checks: {report.invariant_checks:,}",
        f"  linearizability: {checked.get('windows', 0):,} windows, "
        f"{checked.get('events', 0):,} calls checked ({report.percent_checked_text()}), "
        f"{checked.get('configurations', 0):,} configurations; largest window "
        f"{checked.get('largest_window', 0)} calls, costliest "
        f"{checked.get('largest_search', 0):,} configurations, at most "
        f"{checked.get('max_end_states', 0)} possible states at a cut",
    ]
    if report.timing is not None:
        timing = report.timing
        lines.append(
            f"  time: {timing.total_seconds:.1f} s in all; checking busy "
            f"{timing.checking_seconds:.1f} s; {timing.checking_after_calls_seconds:.1f} s "
            f"from the last call to the end (budget {timing.check_budget_seconds:g} s)"
        )
    replay = report.replay
    lines.append(
        f"  replay on {replay.get('backend')}: {replay.get('ops_replayed', 0):,} ops replayed, "
        f"{replay.get('ops_written', 0):,} written to {replay.get('trace') or '(no file)'}"
    )
    n_problems = len(report.conservation_problems)
    lines.append(f"  conservation: {n_problems} problems" if n_problems else "  conservation: ok")
    lines += [f"NOT CHECKED: {gap}" for gap in report.gaps]
    for finding in report.findings:
        where = f" (reproducer: {finding.path})" if finding.path else ""
        lines.append(f"VIOLATION [{finding.kind}]{where}: {finding.message}")
    return "\n".join(lines)
