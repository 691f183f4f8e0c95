"""The stress run's history checker thread, and the time it is allowed.

The workers hand each window (the calls between two barriers) to a
:class:`WindowQueue`; :class:`HistoryChecking` takes them in order, checks
each for linearizability (:mod:`~veloxquant_mlx.stress.checker`) and replays
each decided stretch on a store (:mod:`~veloxquant_mlx.stress.replay`).

Bounded wall time. While the calls are made, the queue is bounded: a worker
that closes a window waits while ``max_queued`` windows are unchecked, so
the checker is never far behind and checking costs throughput, not a long
tail. Once the calls end (their ``duration``, their ``ops``, a violation or
Ctrl-C), the workers stop waiting and the checker has the run's checking
budget (:class:`CheckingBudget`, ``check_budget`` seconds) to finish. When
it runs out, or on Ctrl-C, the search in progress is stopped at its next
tick and everything not yet checked is counted as a
:class:`~veloxquant_mlx.commandline.verdicts.Gap`: the run's verdict is then
inconclusive (or interrupted), never OK. So a run takes at most its
``duration`` plus its ``check_budget``, plus the step (one call, or two)
each worker has in flight when ``duration`` passes and the window's closing
observations (a window closes before its next step).

Complexity: that of the checker and the replay. Thread safety: the queue
and the budget are shared (locked and ``threading.Event``-based); everything
else belongs to the checker thread, and its counters are read, unlocked, by
the progress line only.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.stress.checker import LinearizabilityChecker, SearchStopped
from veloxquant_mlx.stress.replay import LinearizedReplay
from veloxquant_mlx.testing.traces import TraceLine

__all__ = ["INTERRUPTED", "CheckingBudget", "HistoryChecking", "WindowQueue"]

#: The reason recorded when Ctrl-C stopped the checking.
INTERRUPTED: Final = "interrupted by Ctrl-C"
_COMMIT_CHUNK: Final = 64  # calls replayed between two heartbeats and budget checks
_WAIT_SECONDS: Final = 0.1


class CheckingBudget:
    """When checking must stop: ``seconds`` after the calls ended, or at once on an interrupt.

    Invariant: ``deadline`` is ``None`` until :meth:`calls_ended`, then fixed.
    """

    def __init__(self, seconds: float, interrupt: threading.Event) -> None:
        """``seconds`` of checking after the calls end; ``interrupt`` is set by Ctrl-C."""
        self.seconds: Final = seconds
        self.interrupt: Final = interrupt
        self.deadline: float | None = None
        self.calls_ended_at: float | None = None

    def calls_ended(self) -> None:
        """Start the clock: the calls are over, checking may take ``seconds`` more."""
        if self.deadline is None:
            self.calls_ended_at = time.monotonic()
            self.deadline = self.calls_ended_at + self.seconds

    def left(self) -> float | None:
        """Seconds of checking left, or ``None`` while the calls go on."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def stop_reason(self) -> str | None:
        """Why checking must stop now, or ``None`` if it may go on."""
        if self.interrupt.is_set():
            return INTERRUPTED
        left = self.left()
        if left is not None and left <= 0:
            return f"the checking budget of {self.seconds:g} s after the last call ran out"
        return None


class WindowQueue:
    """Windows recorded but not yet checked, oldest first; ``None`` marks the end.

    Invariant: at most ``max_queued`` windows wait while ``may_wait()`` holds
    for the producer; past that the queue grows (the calls have ended).
    """

    def __init__(self, max_queued: int) -> None:
        """Make producers wait while ``max_queued`` windows are unchecked."""
        self._max_queued: Final = max_queued
        self._items: Final[collections.deque[list[TraceLine] | None]] = collections.deque()
        self._changed: Final = threading.Condition()
        self.queued_calls = 0  # calls in the windows waiting; read unlocked by progress

    def put(self, events: list[TraceLine], may_wait: Callable[[], bool]) -> None:
        """Queue a window; wait for room while ``may_wait()`` (checked every 0.1 s)."""
        with self._changed:
            while len(self._items) >= self._max_queued and may_wait():
                self._changed.wait(_WAIT_SECONDS)
            self._items.append(events)
            self.queued_calls += len(events)
            self._changed.notify_all()

    def close(self) -> None:
        """Mark the end: :meth:`get` returns ``None`` after the windows queued so far."""
        with self._changed:
            self._items.append(None)
            self._changed.notify_all()

    def get(self) -> list[TraceLine] | None:
        """The oldest window (waiting for one), or ``None`` at the end."""
        with self._changed:
            while not self._items:
                self._changed.wait()
            events = self._items.popleft()
            if events is not None:
                self.queued_calls -= len(events)
            self._changed.notify_all()
            return events

    def __len__(self) -> int:
        with self._changed:
            return sum(1 for item in self._items if item is not None)


class HistoryChecking:
    """The checker thread's work: windows in, linearizability and replay, gaps out.

    Invariants: every call put in the queue is, by the end of :meth:`run`,
    either checked (``checker.figures.events``) or counted as not checked
    (``checker.figures.events_not_checked``); ``seconds_busy`` is the time
    spent checking and replaying, waits excluded.
    """

    def __init__(
        self,
        checker: LinearizabilityChecker,
        replay: LinearizedReplay,
        windows: WindowQueue,
        budget: CheckingBudget,
    ) -> None:
        """Check ``windows`` with ``checker``, replay with ``replay``, within ``budget``."""
        self.checker: Final = checker
        self.replay: Final = replay
        self.windows: Final = windows
        self.budget: Final = budget
        self.seconds_busy = 0.0
        self.heartbeats = 0
        self._ticks_this_window = 0  # a long search's progress, 1,024 configurations a tick

    def tick(self) -> None:
        """Called by a search every 1,024 configurations: a heartbeat and a budget check."""
        self.heartbeats += 1
        self._ticks_this_window += 1
        reason = self.budget.stop_reason()
        if reason is not None:
            raise SearchStopped(reason)

    def commit(self, events: Sequence[TraceLine]) -> None:
        """Replay a decided stretch of the linearization, a heartbeat per chunk."""
        for start in range(0, len(events), _COMMIT_CHUNK):
            reason = self.budget.stop_reason()
            if reason is not None:
                self.replay.stop(reason)
            self.replay.feed(events[start : start + _COMMIT_CHUNK])
            self.heartbeats += 1

    def run(self, on_violation: Callable[[LinearizabilityChecker], None]) -> None:
        """Check every window until the end mark; ``on_violation`` at the first violation."""
        reported = False
        while (events := self.windows.get()) is not None:
            reason = self.budget.stop_reason()
            if reason is not None:
                self.checker.stop(f"stopped: {reason}")
            started = time.monotonic()
            self.checker.check(events)
            self.seconds_busy += time.monotonic() - started
            self.heartbeats += 1
            self._ticks_this_window = 0
            if self.checker.violation is not None and not reported:
                reported = True
                on_violation(self.checker)
        started = time.monotonic()
        self.checker.finish()
        self.seconds_busy += time.monotonic() - started

    def gaps(self) -> list[Gap]:
        """What the checking left out, and why."""
        return [gap for gap in (self.checker.gap(), self.replay.gap()) if gap is not None]

    @property
    def complete(self) -> bool:
        """Whether every call was checked and every linearized call replayed (or saved)."""
        return not self.gaps() and self.checker.violation is None

    def progress_text(self) -> str:
        """The checking part of the progress line."""
        figures = self.checker.figures
        text = (
            f"checked {figures.events:,} calls in {figures.windows:,} windows, "
            f"{len(self.windows)} windows ({self.windows.queued_calls:,} calls) queued, "
            f"{figures.configurations:,} configurations"
        )
        if self._ticks_this_window:
            text += f" (+{self._ticks_this_window * 1024:,} in the window being searched)"
        left = self.budget.left()
        if left is not None:
            text += f", {max(left, 0.0):.0f} s of {self.budget.seconds:g} s checking budget left"
        return text
