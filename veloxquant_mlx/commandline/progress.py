"""When a long loop prints its next progress line: at most one every so many seconds.

A command that explores (``exhaustive``'s depths, ``schedules``' scenarios)
asks :class:`ProgressThrottle` once per iteration whether a line is due, so
that an operator in CI sees a long run is alive without a line per state.

Complexity: O(1) per call, and a clock read only every
:data:`PROGRESS_CLOCK_EVERY` calls. Thread safety: a throttle serves one loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PROGRESS_CLOCK_EVERY", "PROGRESS_INTERVAL_S", "ProgressThrottle"]

#: Seconds of wall time between two progress lines while one loop runs (a depth of
#: ``veloxquant-mlx exhaustive``, a scenario of ``veloxquant-mlx schedules``). Read when a
#: :class:`ProgressThrottle` is made, so that a test may set it to 0.
PROGRESS_INTERVAL_S = 10.0
#: Iterations between two reads of the clock. An iteration (a state expanded, a
#: schedule run) takes a millisecond or more, so these reads cost nothing measurable.
PROGRESS_CLOCK_EVERY = 16


class ProgressThrottle:
    """Says when a long loop is due a progress line: at most one per ``interval`` seconds.

    The loop calls :meth:`due` once per iteration; only every ``clock_every``-th
    call reads the clock, so a call is otherwise an increment and a test.
    Thread safety: one loop's.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = PROGRESS_INTERVAL_S  # seconds; 0: a line at every clock read
        self.clock_every = PROGRESS_CLOCK_EVERY  # >= 1
        self._clock = clock
        self.started = clock()  # what seconds() counts from
        self._last_line = self.started  # when the last line was due, or the start
        self._iterations = 0  # due() calls so far

    def due(self) -> bool:
        """Count one iteration; True when ``interval`` has passed since the last line."""
        self._iterations += 1
        if self._iterations % self.clock_every:
            return False
        now = self._clock()
        if now - self._last_line < self.interval:
            return False
        self._last_line = now
        return True

    def printed(self) -> None:
        """A line was printed by other means (a depth's): the interval starts again."""
        self._last_line = self._clock()

    def seconds(self) -> float:
        """Seconds since this throttle was made."""
        return self._clock() - self.started
