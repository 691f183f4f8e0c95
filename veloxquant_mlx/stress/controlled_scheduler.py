"""A controlled scheduler: real threads run one at a time, in an order chosen at each point.

The engine under :mod:`veloxquant_mlx.stress.schedules`. A :class:`ControlledRun`
starts one ``threading.Thread`` per body but lets exactly one of them run at a
time; at every *scheduling point* it decides which thread runs next, taking
the decision from a list of choices (to replay a schedule) and, past its end,
the non-preempting default (the running thread goes on if it can, else the
lowest-numbered runnable thread). Every decision where more than one thread
could run is recorded, so :func:`next_choices` can derive the next schedule
of a depth-first enumeration, optionally bounded in preemptions (CHESS).

Scheduling points are: thread start and finish; every acquire of a
:class:`ControlledLock` (and every wake-up while blocked on one); and, with
line points on, every line executed in the watched source files
(``sys.settrace``). A run in which no thread can run but some have not
finished is a deadlock; one past ``STEP_LIMIT`` points a livelock. Both are
reported in ``failure`` and the threads are unwound.

Complexity: O(threads) per scheduling point. Thread safety: one run at a
time per ``ControlledRun``; its threads hand a baton over semaphores, so the
bookkeeping is only ever touched by the one running thread.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from veloxquant_mlx.memory import block_pool

if TYPE_CHECKING:
    from _typeshed import TraceFunction

    from veloxquant_mlx.memory.block_pool import BlockPoolAllocator

__all__ = [
    "INTERRUPT_GRACE_S",
    "STEP_LIMIT",
    "ControlledLock",
    "ControlledRun",
    "Decision",
    "RunCutShort",
    "compiled_allocator_problem",
    "next_choices",
    "pool_lock_replaced",
]

STEP_LIMIT = 100_000  # scheduling points per run before it is called a livelock
#: How long a run may go on once a Ctrl-C was requested before it is left unfinished.
INTERRUPT_GRACE_S = 2.0
_RUN_TIMEOUT_S = 60.0  # wall-clock guard against a harness bug, not a scheduling bound
_WAIT_SLICE_S = 0.05  # how often the main thread looks at the interrupt flag during a run


class _Abort(BaseException):
    """Unwinds a controlled thread whose schedule was abandoned (deadlock, livelock)."""


class RunCutShort(Exception):  # noqa: N818 -- a stop, not an error of the pool
    """A run still going :data:`INTERRUPT_GRACE_S` after a Ctrl-C: left unfinished.

    Its threads are daemons and stay parked; the explorer reports the
    exploration as interrupted and the command ends the process.
    """


class ControlledLock:
    """A stand-in for the pool's lock whose every acquire is a scheduling point.

    Only one controlled thread runs at a time, so the lock needs no atomicity
    of its own: ``holder`` is the index of the thread that holds it.
    """

    def __init__(self, run: ControlledRun) -> None:
        self._run = run
        self.holder: int | None = None  # written by ControlledRun only

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Wait (as a scheduling decision) until the lock is free, then take it."""
        return self._run.acquire(self, blocking)

    def release(self) -> None:
        """Release the lock; the calling thread must hold it."""
        self._run.release(self)

    def locked(self) -> bool:
        """Whether a thread holds the lock."""
        return self.holder is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@contextlib.contextmanager
def pool_lock_replaced(pool: BlockPoolAllocator, lock: ControlledLock) -> Iterator[None]:
    """Make ``lock`` the lock of interpreted ``pool`` inside the block; then the real one again.

    The pool's lock is private and ``Final``, so it is swapped in the instance's
    ``vars``; the pool calls its lock's ``acquire`` and ``release`` by name, so
    any lock with those methods serves. Only ``pool`` is affected.

    Raises:
        RuntimeError: The allocator is compiled (its instances have no ``vars``,
            and it takes librt's lock through C calls, not by name).
    """
    problem = compiled_allocator_problem()
    if problem is not None:
        raise RuntimeError(problem)
    pool_vars = vars(pool)
    real_lock = pool_vars["_lock"]
    try:
        pool_vars["_lock"] = lock
        yield
    finally:
        pool_vars["_lock"] = real_lock


def compiled_allocator_problem() -> str | None:
    """Why the explorers cannot run on this allocator (it is compiled), or ``None``."""
    if not block_pool.COMPILED:
        return None
    return (
        "the schedule explorer needs the interpreted allocator, and this one is compiled "
        "(block_pool.COMPILED is True): it replaces the pool's lock and traces its lines; "
        "run it from the editable install (pip install -e .)"
    )


@dataclass
class _ThreadState:
    index: int
    go: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    waiting_for: ControlledLock | None = None
    finished: bool = False

    def runnable(self) -> bool:
        return not self.finished and (self.waiting_for is None or self.waiting_for.holder is None)


@dataclass(frozen=True)
class Decision:
    """A scheduling point where more than one thread could run next."""

    options: tuple[int, ...]  # exploration order: the non-preempting default first
    chosen: int
    preempts: bool  # choosing a non-default option preempts a runnable thread
    preemptions_before: int


class ControlledRun:
    """One schedule: runs thread bodies one at a time, following ``choices`` then defaults."""

    def __init__(
        self,
        n_threads: int,
        choices: Sequence[int],
        watched: frozenset[str],
        interrupt: threading.Event | None = None,
    ) -> None:
        """``interrupt``, once set, bounds how much longer the run is waited for."""
        self.threads = [_ThreadState(index) for index in range(n_threads)]
        self.decisions: list[Decision] = []
        self.trace: list[str] = []
        self.failure: str | None = None
        self._choices = choices
        self._watched = watched
        self._local = threading.local()
        self._preemptions = 0
        self._steps = 0
        self._aborted = False
        self._done = threading.Event()
        self._finishing = threading.Lock()
        self._interrupt = interrupt

    def run(self, bodies: Sequence[Callable[[], None]], line_points: bool) -> None:
        """Run ``bodies`` (one per thread) to completion under this schedule.

        Raises:
            RuntimeError: A choice does not fit (the schedule is another
                scenario's), or the run outlived its wall-clock guard.
            RunCutShort: A Ctrl-C was requested and the run did not end within
                :data:`INTERRUPT_GRACE_S`.
            BaseException: Whatever a body raised that was not a scheduling abort.
        """
        errors: list[BaseException] = []
        threads = [
            # Daemon threads: a harness bug must never keep the interpreter from exiting.
            threading.Thread(
                target=self._thread_main, args=(i, body, line_points, errors), daemon=True
            )
            for i, body in enumerate(bodies)
        ]
        for thread in threads:
            thread.start()
        try:
            self._schedule(None, "start")
        except BaseException:
            self._abandon()
            raise
        self._wait_until_done()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _wait_until_done(self) -> None:
        """Wait for the last thread; a Ctrl-C is honoured within the grace period."""
        started = time.monotonic()
        noticed: float | None = None
        while not self._done.wait(_WAIT_SLICE_S):
            now = time.monotonic()
            if noticed is None and self._interrupt is not None and self._interrupt.is_set():
                noticed = now
            if noticed is not None and now - noticed > INTERRUPT_GRACE_S:
                raise RunCutShort(f"left unfinished {INTERRUPT_GRACE_S} s after a Ctrl-C")
            if now - started > _RUN_TIMEOUT_S:
                raise RuntimeError(self._hang_report())

    def _hang_report(self) -> str:
        """What a run that outlived its guard was doing; every thread's stack goes to stderr."""
        with contextlib.suppress(OSError):  # file descriptor 2 may be closed
            faulthandler.dump_traceback(file=2, all_threads=True)
        states = ", ".join(
            f"t{t.index}: {'finished' if t.finished else 'runnable' if t.runnable() else 'blocked'}"
            for t in self.threads
        )
        return (
            f"a controlled schedule did not finish in {_RUN_TIMEOUT_S} s "
            f"({self._steps} points, {states}; last hand-overs: {self.trace[-4:]})"
        )

    def _abandon(self) -> None:
        """Unwind every thread of a run that cannot go on, and wait until they have."""
        self._aborted = True
        for thread in self.threads:
            thread.go.release()
        self._done.wait(_RUN_TIMEOUT_S)

    def _thread_main(
        self, index: int, body: Callable[[], None], line_points: bool, errors: list[BaseException]
    ) -> None:
        self._local.index = index
        self.threads[index].go.acquire()
        try:
            if not self._aborted:
                if line_points:
                    sys.settrace(self._trace_calls)
                body()
        except _Abort:
            pass
        except BaseException as error:  # a harness bug: re-raised by run()
            errors.append(error)
        finally:
            sys.settrace(None)
            self._finish(index)

    def _finish(self, index: int) -> None:
        with self._finishing:
            self.threads[index].finished = True
        if not self._aborted:
            with contextlib.suppress(_Abort):  # it left the others deadlocked
                self._schedule(index, "finish")
        if self._aborted:  # the unwinding threads run at once: the last one out says so
            with self._finishing:
                if all(t.finished for t in self.threads):
                    self._done.set()

    def point(self, label: str) -> None:
        """A scheduling point of the calling controlled thread (no-op elsewhere)."""
        index: int | None = getattr(self._local, "index", None)
        if index is not None:
            self._schedule(index, label)

    def _schedule(self, me: int | None, label: str) -> None:
        """Choose the thread that runs next and hand over to it; ``me`` waits its turn."""
        if self._aborted:  # unwinding: no more decisions
            return
        self._steps += 1
        runnable = [t.index for t in self.threads if t.runnable()]
        if not runnable and all(t.finished for t in self.threads):
            self._done.set()
            return
        if not runnable or self._steps > STEP_LIMIT:
            self._abort(me, runnable)
        chosen = self._choose(me, runnable)
        if chosen != me:
            self.trace.append(f"t{me} at {label} -> t{chosen}" if me is not None else f"t{chosen}")
            self.threads[chosen].go.release()
            if me is not None and not self.threads[me].finished:
                self.threads[me].go.acquire()
        if self._aborted and me is not None and not self.threads[me].finished:
            raise _Abort

    def _choose(self, me: int | None, runnable: list[int]) -> int:
        me_runnable = me is not None and me in runnable
        default = me if me_runnable and me is not None else runnable[0]
        options = (default, *(i for i in runnable if i != default))
        if len(options) == 1:
            return default
        position = len(self.decisions)
        chosen = self._choices[position] if position < len(self._choices) else default
        if chosen not in options:
            raise RuntimeError(
                f"schedule choice {position} is thread {chosen}, but only {options} can run: "
                "the schedule does not belong to this scenario"
            )
        self.decisions.append(Decision(options, chosen, me_runnable, self._preemptions))
        if me_runnable and chosen != me:
            self._preemptions += 1
        return chosen

    def _abort(self, me: int | None, runnable: list[int]) -> NoReturn:
        """Give up the schedule (deadlock or livelock): wake every thread to unwind."""
        blocked = [t.index for t in self.threads if not t.finished]
        self.failure = (
            f"livelock: over {STEP_LIMIT} scheduling points"
            if runnable
            else f"deadlock: threads {blocked} wait for a lock no runnable thread releases"
        )
        self._aborted = True
        for thread in self.threads:
            if thread.index != me:
                thread.go.release()
        raise _Abort

    # -- the lock's scheduling points --------------------------------------------

    def acquire(self, lock: ControlledLock, blocking: bool) -> bool:
        index: int | None = getattr(self._local, "index", None)
        if index is None:  # setup or observation on the main thread: nothing runs beside it
            if lock.holder is not None:
                raise RuntimeError("the pool's lock is held outside the controlled threads")
            lock.holder = -1
            return True
        self._schedule(index, "acquire")
        while lock.holder is not None:
            if not blocking:
                return False
            self.threads[index].waiting_for = lock
            self._schedule(index, "blocked")
        self.threads[index].waiting_for = None
        lock.holder = index
        return True

    def release(self, lock: ControlledLock) -> None:
        index: int | None = getattr(self._local, "index", None)
        expected = -1 if index is None else index
        if lock.holder != expected:
            raise RuntimeError(f"release of a lock held by {lock.holder}, by {expected}")
        lock.holder = None

    # -- line-level points ---------------------------------------------------------

    def _trace_calls(self, frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
        if event == "call" and frame.f_code.co_filename in self._watched:
            return self._trace_lines
        return None

    def _trace_lines(self, frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
        if event == "line":
            name = os.path.basename(frame.f_code.co_filename)
            self.point(f"{name}:{frame.f_lineno}")
        return self._trace_lines


def next_choices(decisions: Sequence[Decision], bound: int | None) -> tuple[list[int] | None, bool]:
    """The DFS successor of a schedule: ``(choices, pruned)``; ``None`` once all are done."""
    pruned = False
    for position in range(len(decisions) - 1, -1, -1):
        decision = decisions[position]
        later = decision.options[decision.options.index(decision.chosen) + 1 :]
        if not later:
            continue
        cost = 1 if decision.preempts else 0  # every non-default option costs the same
        if bound is not None and decision.preemptions_before + cost > bound:
            pruned = True
            continue
        return [d.chosen for d in decisions[:position]] + [later[0]], pruned
    return None, pruned
