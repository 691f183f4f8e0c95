"""Systematic schedules: small concurrent scenarios explored over every thread interleaving.

A stress run samples the interleavings the OS happens to produce, so a race
whose window is a few bytecodes wide may never show. Here a *scenario* (two
or three threads, a few pool calls each) runs under a controlled scheduler
that lets exactly one thread run at a time and decides, at every scheduling
point, which thread goes next. The explorer enumerates those decisions
depth-first (stateless model checking, as in CHESS and VeriSoft): every
interleaving of the scheduling points, up to an optional bound on
preemptions, runs once, from a fresh pool, and a failing one is replayed
exactly from its list of choices.

Scheduling points:

- ``granularity="lock"``: before every acquire of the pool's lock (the
  explorer swaps it for a :class:`ControlledLock` for the length of a
  schedule) and while blocked on it. When every access to shared state is
  made under the lock, the order of the lock acquisitions decides the
  outcome, so these points cover every behaviour of a correct pool, and a
  lock released too early (check-then-act) shows as a second acquire.
- ``granularity="line"``: also at every line executed in the watched source
  files (``sys.settrace``): the pool's module and those of its subclasses.
  This exposes reads and writes made outside the lock.

A thread that is still runnable when another is chosen has been preempted;
``max_preemptions`` bounds that number per schedule (CHESS's preemption
bounding). An exploration is *exhaustive* when the bound cut no branch, and
*complete* when it ran every schedule within the bound: a bound is a stated
scope ("every schedule with at most one preemption"), but running out of
``max_schedules`` is giving up, and makes the verdict inconclusive.

After each schedule the explorer checks that the calls' outcomes and the
pool's final observable state (every handle, and every query the operation
table observes: stats, history, free counts, ``blocks_for``, ``is_live``,
``id_bound``, ``check_invariants``) equal those of SOME sequential order of
the scenario's calls, consistent with each thread's program order, run
through the executable spec; both sides are driven through
:mod:`veloxquant_mlx.testing.sides`, so nothing here knows one call from
another.

``veloxquant-mlx schedules`` (:mod:`~veloxquant_mlx.stress.schedules_command`)
prints each scenario's explored-schedule count and verdict; while a scenario
runs, ``progress`` gets a line at most every
:data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` seconds. The engine is
:mod:`~veloxquant_mlx.stress.controlled_scheduler`; the scenarios live in
:mod:`~veloxquant_mlx.stress.schedule_scenarios` and the spec's side of the
judgement in :mod:`~veloxquant_mlx.stress.schedule_outcomes`.

Complexity: one schedule costs one setup, the scenario's calls and one
observation; the number of schedules grows as (points x threads) to the
power ``max_preemptions``. The spec's sequential outcomes are enumerated once
per scenario: the multinomial number of program-order merges.

Thread safety: an exploration creates and joins its own threads; run one
exploration per thread.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program(
        "python -m veloxquant_mlx.stress.schedules", "veloxquant_mlx.stress.schedules_command"
    )

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from veloxquant_mlx.commandline.progress import ProgressThrottle
from veloxquant_mlx.commandline.verdicts import Gap, Verdict, verdict_of, why_cut_short
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.stress.config import AllocatorFactory, default_allocator
from veloxquant_mlx.stress.controlled_scheduler import (
    ControlledLock,
    ControlledRun,
    RunCutShort,
    next_choices,
    pool_lock_replaced,
)
from veloxquant_mlx.stress.schedule_outcomes import (
    ScheduleOutcome,
    allowed_outcomes,
    final_state,
    label,
    program_orders,
)
from veloxquant_mlx.stress.schedule_scenarios import SCENARIOS, Scenario
from veloxquant_mlx.testing.lockstep import Lockstep
from veloxquant_mlx_spec.table import Outcome

__all__ = [
    "SCENARIOS",
    "Exploration",
    "Granularity",
    "Scenario",
    "ScheduleViolation",
    "explore",
    "replay",
]

Granularity = Literal["lock", "line"]


# ---- running one schedule --------------------------------------------------------


@dataclass(frozen=True)
class ScheduleViolation:
    """A schedule whose outcome no sequential order explains, or that broke an invariant.

    ``choices`` replays it exactly (:func:`replay`); ``trace`` lists its
    calls and context switches in order.
    """

    scenario: str
    choices: tuple[int, ...]
    message: str
    trace: tuple[str, ...]

    def __str__(self) -> str:
        steps = "\n".join(f"  {line}" for line in self.trace)
        return (
            f"scenario {self.scenario!r}: {self.message}\n"
            f"schedule choices {list(self.choices)} ran:\n{steps}"
        )


class _Schedule:
    """One fresh pool, its setup, and the scenario's threads under one ``ControlledRun``."""

    def __init__(self, scenario: Scenario, factory: AllocatorFactory) -> None:
        self.lockstep = Lockstep(factory, scenario.config, scenario.history_len)
        for setup_label, operation in enumerate(scenario.setup):
            self.lockstep.apply(operation, setup_label)
        self.pool: BlockPoolAllocator = self.lockstep.pool
        self.scenario = scenario
        self.results: list[list[Outcome]] = [[] for _ in scenario.threads]

    def run(self, run: ControlledRun, granularity: Granularity) -> ScheduleOutcome | None:
        with pool_lock_replaced(self.pool, ControlledLock(run)):  # for this run only
            bodies = [self._body(run, t) for t in range(len(self.scenario.threads))]
            run.run(bodies, line_points=granularity == "line")
        if run.failure:
            return None
        results = tuple(map(tuple, self.results))
        return ScheduleOutcome(results, final_state(self.scenario, self.lockstep.pool_side))

    def _body(self, run: ControlledRun, thread: int) -> Callable[[], None]:
        pool = self.lockstep.pool_side

        def body() -> None:
            for step, operation in enumerate(self.scenario.threads[thread]):
                run.trace.append(f"t{thread} calls {operation!r}")
                self.results[thread].append(pool.call(operation, label(thread, step)))

        return body


class _Checker:
    """Runs schedules of one scenario on one kind of pool and judges each against the spec."""

    def __init__(
        self, scenario: Scenario, factory: AllocatorFactory, granularity: Granularity
    ) -> None:
        self.scenario = scenario
        self.factory = factory
        self.granularity = granularity
        first = _Schedule(scenario, factory)
        self.n_orders = sum(1 for _ in program_orders([len(t) for t in scenario.threads]))
        self.allowed = allowed_outcomes(scenario, first.lockstep.spec)
        self.watched = _source_files(type(first.pool)) if granularity == "line" else frozenset()
        self.seen: set[ScheduleOutcome] = set()  # the allowed outcomes some schedule produced

    def run_once(
        self, choices: Sequence[int], interrupt: threading.Event | None = None
    ) -> tuple[ControlledRun, ScheduleViolation | None]:
        """Run the schedule ``choices`` begins; return it and what it broke, if anything.

        Raises:
            RunCutShort: ``interrupt`` was set and the run did not end in time.
        """
        schedule = _Schedule(self.scenario, self.factory)
        run = ControlledRun(len(self.scenario.threads), choices, self.watched, interrupt)
        message = self._judge(schedule, run, schedule.run(run, self.granularity))
        if message is None:
            return run, None
        taken = tuple(d.chosen for d in run.decisions)
        return run, ScheduleViolation(self.scenario.name, taken, message, tuple(run.trace))

    def _judge(
        self, schedule: _Schedule, run: ControlledRun, outcome: ScheduleOutcome | None
    ) -> str | None:
        if outcome is None:
            return run.failure
        if outcome not in self.allowed:
            return (
                "no sequential order of the calls gives these results and this final state; "
                f"results per thread: {outcome.results}; final state: {outcome.final}"
            )
        self.seen.add(outcome)
        try:
            schedule.pool.check_invariants()
        except AssertionError as error:
            return f"check_invariants() failed: {error}"
        return None


def _source_files(pool_type: type) -> frozenset[str]:
    """Source files of a pool class and its bases: where line-level points go."""
    files = set()
    for cls in pool_type.__mro__:
        try:
            files.add(inspect.getsourcefile(cls))
        except TypeError:  # builtins such as object
            continue
    return frozenset(f for f in files if f is not None)


# ---- exploring -------------------------------------------------------------------


@dataclass(frozen=True)
class Exploration:
    """What one exploration did and found.

    Attributes:
        scenario: The scenario's name.
        granularity: Where the scheduling points were.
        max_preemptions: The preemption bound (``None``: unbounded).
        schedules: Schedules run.
        exhaustive: True if no schedule was cut by the bound or ``max_schedules``.
        sequential_orders: Program-order merges the spec ran to get the allowed outcomes.
        outcomes_allowed: Distinct outcomes (results and final state) those orders give.
        outcomes_seen: How many of them some schedule produced; all of them, when the
            exploration is exhaustive and every call takes the lock.
        violations: The failing schedules found (the first only, by default).
        seconds: Wall-clock time of the exploration.
        complete: True if no schedule within the bound was left (``max_schedules``
            was not reached, no interrupt): what the verdict OK requires.
        interrupted: The exploration stopped between two schedules on a Ctrl-C.
        stopped_at_first: It stopped at its first violation (``stop_at_first``).
    """

    scenario: str
    granularity: Granularity
    max_preemptions: int | None
    schedules: int
    exhaustive: bool
    sequential_orders: int
    outcomes_allowed: int
    outcomes_seen: int
    violations: tuple[ScheduleViolation, ...]
    seconds: float
    complete: bool = True
    interrupted: bool = False
    stopped_at_first: bool = False

    @property
    def gap(self) -> Gap | None:
        """The schedules within the bound that were not run, and why; ``None`` if none."""
        if self.complete:
            return None
        why = why_cut_short(
            interrupted=self.interrupted,
            stopped_at_first=self.stopped_at_first,
            budget="max_schedules",
        )
        return Gap(f"schedules of {self.scenario!r} after the first {self.schedules:,}", why)

    @property
    def verdict(self) -> Verdict:
        """Interrupted, violation, inconclusive (``max_schedules`` ran out) or OK."""
        gaps = () if self.gap is None else (self.gap,)
        return verdict_of(violations=len(self.violations), gaps=gaps, interrupted=self.interrupted)


def explore(
    scenario: Scenario,
    factory: AllocatorFactory = default_allocator,
    *,
    granularity: Granularity = "lock",
    max_preemptions: int | None = None,
    max_schedules: int = 100_000,
    stop_at_first: bool = True,
    interrupt: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
) -> Exploration:
    """Run ``scenario`` under every schedule (DFS), checking each against the spec.

    Args:
        scenario: The threads and their calls.
        factory: Builds the pool under test (a subclass to check, or a planted bug).
        granularity: ``"lock"`` or ``"line"`` scheduling points (module docstring).
        max_preemptions: Preemptions allowed per schedule; ``None`` for no bound.
        max_schedules: Stop after this many schedules (the result is then not exhaustive).
        stop_at_first: Stop at the first violation.
        interrupt: Polled between schedules: once set (by Ctrl-C), the
            exploration stops there, ``interrupted``. A schedule is not cut
            inside, where its threads hand a baton over semaphores, unless it is
            still running ``INTERRUPT_GRACE_S`` later: then it is left
            unfinished, uncounted, and the exploration stops.
        progress: Told a line (schedules so far, seconds) at most every
            ``PROGRESS_INTERVAL_S`` seconds while the exploration runs.

    Returns:
        The counts and any violations; deterministic for a given scenario and pool.
    """
    started, throttle = time.perf_counter(), ProgressThrottle()
    checker = _Checker(scenario, factory, granularity)
    violations: list[ScheduleViolation] = []
    choices: list[int] | None = []
    schedules, any_pruned, interrupted = 0, False, False
    while choices is not None and schedules < max_schedules:
        if interrupt is not None and interrupt.is_set():
            interrupted = True
            break
        try:
            run, violation = checker.run_once(choices, interrupt)
        except RunCutShort:  # a Ctrl-C, and this schedule did not end: it does not count
            interrupted = True
            break
        schedules += 1
        if progress is not None and throttle.due():
            progress(f"  {scenario.name}: {schedules:,} schedules, {throttle.seconds():.0f} s")
        if violation is not None:
            violations.append(violation)
            if stop_at_first:
                break
        choices, pruned = next_choices(run.decisions, max_preemptions)
        any_pruned = any_pruned or pruned
    return Exploration(
        scenario=scenario.name,
        granularity=granularity,
        max_preemptions=max_preemptions,
        schedules=schedules,
        exhaustive=choices is None and not any_pruned,
        sequential_orders=checker.n_orders,
        outcomes_allowed=len(checker.allowed),
        outcomes_seen=len(checker.seen),
        violations=tuple(violations),
        seconds=time.perf_counter() - started,
        complete=choices is None,
        interrupted=interrupted,
        stopped_at_first=bool(violations) and stop_at_first and choices is not None,
    )


def replay(
    scenario: Scenario,
    choices: Sequence[int],
    factory: AllocatorFactory = default_allocator,
    *,
    granularity: Granularity = "lock",
) -> ScheduleViolation | None:
    """Run the one schedule ``choices`` names (a violation's) and judge it again."""
    return _Checker(scenario, factory, granularity).run_once(choices)[1]
