"""Schedules in which a dropped KV cache's finaliser fires inside the pool's locked section.

A :class:`~veloxquant_mlx.memory.pooled_kv_cache.PooledKVCache` dropped
without ``release()`` hands its blocks back from its finaliser
(:mod:`~veloxquant_mlx.memory.deferred_release`). A finaliser runs on
whichever thread drops the last reference or triggers a collection, at any
line, including one inside a pool call that holds the pool's
non-reentrant lock. This explorer makes that happen on purpose, everywhere
it can: one scenario, run under the controlled scheduler
(:mod:`~veloxquant_mlx.stress.controlled_scheduler`) over every
interleaving of its lock acquisitions, and, within each, with the victim
book's last reference dropped at the ``d``-th line that any thread executes
in the pool's module while holding the pool's lock, for every ``d`` that
some schedule reaches.

The scenario: a pool of 16 two-token blocks; a *victim* book (owner 1)
holding two blocks per stream, whose only reference the explorer drops;
thread 0 opens a book (owner 2), appends three positions and releases it;
thread 1 drains the dropped caches (``reclaim_dropped_caches``) and reads a
free count. A schedule is correct when it neither deadlocks nor livelocks
(the scheduler reports both: a finaliser that took the pool's lock would
wait for its own thread), no finaliser raised, and after a final drain on
the main thread every block is back, the victim's owner id is free again
and ``check_invariants()`` passes.

``veloxquant-mlx schedules`` runs it as its last scenario
(``--scenario finaliser_inside_the_lock`` alone); ``python -m
veloxquant_mlx.stress.finaliser_schedules [--max-runs N]`` is that. While
it runs, ``progress`` gets a line at most every
:data:`~veloxquant_mlx.commandline.progress.PROGRESS_INTERVAL_S` seconds.

Complexity: one run per (drop point, schedule): about 80 drop points times
a few dozen schedules, each a fresh pool and two threads. Thread safety: an
exploration creates and joins its own threads, and swaps
``sys.unraisablehook`` while it runs; run one at a time.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program(
        "python -m veloxquant_mlx.stress.finaliser_schedules",
        "veloxquant_mlx.stress.finaliser_schedules",
    )

import inspect
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from veloxquant_mlx.commandline.progress import ProgressThrottle
from veloxquant_mlx.commandline.verdicts import Gap, Verdict, verdict_of, why_cut_short
from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.deferred_release import reclaim_dropped_caches
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.stress.controlled_scheduler import (
    ControlledLock,
    ControlledRun,
    RunCutShort,
    next_choices,
    pool_lock_replaced,
)
from veloxquant_mlx.stress.schedules_command import FINALISER

if TYPE_CHECKING:
    from _typeshed import TraceFunction

__all__ = [
    "DEFAULT_MAX_RUNS",
    "BookFactory",
    "FinaliserDropper",
    "FinaliserExploration",
    "explore_finaliser",
    "main",
]

#: Builds the victim book: ``(pool, owner) -> book``; a planted bug passes a subclass.
BookFactory = Callable[[BlockPoolAllocator, int], PooledKVCache]

_VICTIM, _WORKER = 1, 2  # owner ids
#: Runs an exploration may make by default: the scenario needs a few thousand.
DEFAULT_MAX_RUNS: Final = 20_000
_POOL_FILE: Final = inspect.getsourcefile(block_pool)


@dataclass(frozen=True)
class FinaliserExploration:
    """What one exploration ran and found.

    Attributes:
        runs: Runs made: one per (drop point, schedule).
        drop_points: Drop points reached: the finaliser fired at the 1st, 2nd, ...
            locked line of the pool's module, up to this many, in some schedule (when
            the exploration is exhaustive, no schedule has a further locked line).
        fired_inside_lock: Runs in which the finaliser fired while its thread held
            the pool's lock (every run that reached its drop point).
        exhaustive: Every schedule of every drop point ran (no budget cut, no interrupt).
        violations: What broke, one line per failing run (the first only, by default).
        seconds: Wall-clock time.
        interrupted: Stopped between two runs on a Ctrl-C.
        stopped_at_first: Stopped at the first violation (``stop_at_first``).
    """

    runs: int
    drop_points: int
    fired_inside_lock: int
    exhaustive: bool
    violations: tuple[str, ...]
    seconds: float
    interrupted: bool = False
    stopped_at_first: bool = False

    @property
    def gap(self) -> Gap | None:
        """The runs not made, and why; ``None`` when the exploration was exhaustive."""
        if self.exhaustive:
            return None
        why = why_cut_short(
            interrupted=self.interrupted, stopped_at_first=self.stopped_at_first, budget="max_runs"
        )
        return Gap(f"the schedules after the first {self.runs:,} runs", why)

    @property
    def verdict(self) -> Verdict:
        """Interrupted, violation, inconclusive (a budget cut) or OK."""
        gaps = () if self.gap is None else (self.gap,)
        return verdict_of(violations=len(self.violations), gaps=gaps, interrupted=self.interrupted)


class FinaliserDropper:
    """Drops the victim's last reference at the ``drop_at``-th locked line of the pool module
    (``fired_by``: the controlled thread it fired on, if it did).

    Shared with the owner-reuse exploration in the tests."""

    def __init__(self, victim: PooledKVCache, lock: ControlledLock, drop_at: int) -> None:
        self.holder = [victim]  # the victim's only strong reference
        self.lock = lock
        self.drop_at = drop_at
        self.locked_lines = 0  # only one controlled thread runs at a time: no race
        self.fired_by: int | None = None

    def tracer(self, thread: int) -> TraceFunction:
        """The ``sys.settrace`` function of controlled thread ``thread``."""

        def on_line(frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
            if event == "line" and self.lock.holder == thread and self.holder:
                self.locked_lines += 1
                if self.locked_lines == self.drop_at:
                    self.fired_by = thread
                    self.holder.clear()  # the finaliser runs here, inside the lock
            return on_line

        def on_call(frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
            return on_line if frame.f_code.co_filename == _POOL_FILE else None

        return on_call


class _Run:
    """One fresh pool, the victim, and the scenario's two threads under one schedule."""

    def __init__(
        self,
        factory: BookFactory,
        drop_at: int,
        choices: Sequence[int],
        interrupt: threading.Event | None = None,
    ) -> None:
        self.pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=16), history_len=0)
        victim = factory(self.pool, _VICTIM)
        victim.append(3)
        self.control = ControlledRun(2, choices, frozenset(), interrupt)
        self.lock = ControlledLock(self.control)
        self.dropper = FinaliserDropper(victim, self.lock, drop_at)
        self.unraisable: list[str] = []

    def run(self) -> str | None:
        """Run the schedule; what broke, or ``None``."""
        hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        try:
            with pool_lock_replaced(self.pool, self.lock):  # for this run only
                self.control.run([self._allocating, self._draining], line_points=False)
        finally:
            sys.unraisablehook = hook
            self.dropper.holder.clear()  # a run that never reached its drop point
        return self._judge()

    def _allocating(self) -> None:
        sys.settrace(self.dropper.tracer(0))
        book = PooledKVCache(self.pool, _WORKER)
        book.append(3)
        book.release()

    def _draining(self) -> None:
        sys.settrace(self.dropper.tracer(1))
        reclaim_dropped_caches(self.pool)
        self.pool.n_free("k")

    def _unraisable(self, report: Any) -> None:
        self.unraisable.append(f"{report.exc_type.__name__}: {report.exc_value}")

    def _judge(self) -> str | None:
        if self.control.failure is not None:
            return self.control.failure
        if self.unraisable:
            return f"a finaliser raised: {self.unraisable[0]}"
        reclaim_dropped_caches(self.pool)
        pool = self.pool
        if pool.stats.blocks_in_use() or pool.blocks_for(_VICTIM):
            return f"{pool.stats.blocks_in_use()} blocks still in use after the final drain"
        try:
            pool.register_owner(_VICTIM)  # the dropped book's id must be free again
        except block_pool.OwnerAlreadyActiveError:
            return f"owner {_VICTIM} of the dropped book is still active after the final drain"
        pool.release_owner(_VICTIM)
        try:
            pool.check_invariants()
        except AssertionError as error:
            return f"check_invariants() failed: {error}"
        return None


def explore_finaliser(
    factory: BookFactory = PooledKVCache,
    *,
    max_runs: int = DEFAULT_MAX_RUNS,
    stop_at_first: bool = True,
    interrupt: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
) -> FinaliserExploration:
    """Run the scenario for every drop point and every schedule; judge each run.

    Args:
        factory: Builds the victim book (``PooledKVCache``, or a planted bug).
        max_runs: Stop after this many runs (the result is then not exhaustive).
        stop_at_first: Stop at the first violation.
        interrupt: Polled between runs: once set (by Ctrl-C), the exploration
            stops there, ``interrupted``. A run is not cut inside, where its
            threads hand a baton over semaphores, unless it is still running
            ``INTERRUPT_GRACE_S`` later: then it is left unfinished, uncounted.
        progress: Told a line (drop point, runs so far, seconds) at most every
            ``PROGRESS_INTERVAL_S`` seconds while the exploration runs.
    """
    started, throttle = time.perf_counter(), ProgressThrottle()
    violations: list[str] = []
    runs = fired = drop_points = 0
    drop_at, exhaustive, interrupted = 1, True, False
    while True:
        reached = False
        choices: list[int] | None = []
        while choices is not None:
            interrupted = interrupt is not None and interrupt.is_set()
            if interrupted or runs >= max_runs or (violations and stop_at_first):
                exhaustive = False
                break
            run = _Run(factory, drop_at, choices, interrupt)
            try:
                problem = run.run()
            except RunCutShort:  # a Ctrl-C, and this run did not end: it does not count
                interrupted, exhaustive = True, False
                break
            runs += 1
            if progress is not None and throttle.due():
                progress(
                    f"  {FINALISER}: drop point {drop_at}, {runs:,} runs, "
                    f"{throttle.seconds():.0f} s"
                )
            if run.dropper.fired_by is not None:
                reached, fired, drop_points = True, fired + 1, drop_at
            if problem is not None:
                taken = [d.chosen for d in run.control.decisions]
                violations.append(f"drop point {drop_at}, schedule choices {taken}: {problem}")
            choices, _ = next_choices(run.control.decisions, None)
        if not exhaustive or not reached:
            break
        drop_at += 1
    return FinaliserExploration(
        runs=runs,
        drop_points=drop_points,
        fired_inside_lock=fired,
        exhaustive=exhaustive,
        violations=tuple(violations),
        seconds=time.perf_counter() - started,
        interrupted=interrupted,
        stopped_at_first=bool(violations) and stop_at_first and not exhaustive,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ...finaliser_schedules [--max-runs N]``: ``veloxquant-mlx schedules`` with
    only this scenario (exit status 0 OK, 1 violation, 2 bad input, 3 inconclusive, 130)."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    prog = "python -m veloxquant_mlx.stress.finaliser_schedules"
    return run_alias(prog, "schedules", argv, preset=("--scenario", FINALISER))
