"""The stress run's monitor thread: a progress line, and a watchdog for deadlocks.

:class:`Watchdog` polls a *heartbeat* (a number that grows while the run
makes progress: calls made plus checker steps). Every ``progress_interval``
seconds it prints the run's progress line. If the heartbeat has not moved
for ``stall_timeout`` seconds it declares a deadlock: it dumps every
thread's stack with :mod:`faulthandler` (to ``stacks.txt`` in the run's
folder, and to the process's stderr), and calls ``on_stall`` with a message
naming what each thread was doing, so the runner can fail the run.

Complexity: O(threads) per poll. Thread safety: ``start``/``stop`` from the
thread that owns the run; the callbacks run on the watchdog's thread.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Final, TextIO

__all__ = ["Watchdog", "thread_stacks"]

_POLL_SECONDS: Final = 0.1


def thread_stacks() -> str:
    """Every Python thread's current stack, as text (the innermost frames)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame, limit=6))
        parts.append(f"thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


class Watchdog:
    """Prints progress and fails a run whose heartbeat stops (see the module docstring).

    Invariant: ``on_stall`` is called at most once.
    """

    def __init__(
        self,
        heartbeat: Callable[[], int],
        progress_line: Callable[[], str],
        *,
        progress_interval: float,
        stall_timeout: float,
        on_stall: Callable[[str], None],
        stacks_path: Path | None,
        stream: TextIO | None,
    ) -> None:
        """Watch ``heartbeat``; print ``progress_line()`` to ``stream`` (``None``: never)."""
        self._heartbeat: Final = heartbeat
        self._progress_line: Final = progress_line
        self._progress_interval: Final = progress_interval
        self._stall_timeout: Final = stall_timeout
        self._on_stall: Final = on_stall
        self._stacks_path: Final = stacks_path
        self._stream: Final = stream
        self._stopped: Final = threading.Event()
        self._thread: Final = threading.Thread(
            target=self._watch, name="stress-watchdog", daemon=True
        )
        self.stalled = False

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and wait for the thread."""
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        last_beat = self._heartbeat()
        last_change = last_print = time.monotonic()
        while not self._stopped.wait(_POLL_SECONDS):
            now = time.monotonic()
            beat = self._heartbeat()
            if beat != last_beat:
                last_beat, last_change = beat, now
            if self._progress_interval > 0 and now - last_print >= self._progress_interval:
                last_print = now
                if self._stream is not None:
                    print(self._progress_line(), file=self._stream, flush=True)
            if not self.stalled and now - last_change >= self._stall_timeout:
                self.stalled = True
                self._on_stall(self._stall_message(now - last_change))

    def _stall_message(self, seconds: float) -> str:
        self._dump_stacks()
        where = f"; every thread's stack is in {self._stacks_path}" if self._stacks_path else ""
        return (
            f"no progress for {seconds:.1f} s (stall timeout {self._stall_timeout} s): "
            f"deadlock or livelock{where}\n{thread_stacks()}"
        )

    def _dump_stacks(self) -> None:
        if self._stacks_path is not None:
            with self._stacks_path.open("w", encoding="utf-8") as file:
                faulthandler.dump_traceback(file, all_threads=True)
        stderr = sys.__stderr__
        if stderr is not None:
            # A captured stderr has no usable file descriptor: the file above must do.
            with contextlib.suppress(OSError, ValueError):
                faulthandler.dump_traceback(stderr, all_threads=True)
