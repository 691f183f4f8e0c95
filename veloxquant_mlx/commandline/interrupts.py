"""Ctrl-C and bad input in every command: one line on stderr, and a known exit status.

:func:`run_command` wraps the body of each command's ``main``: a
:class:`~veloxquant_mlx.commandline.bad_input.BadInputError` becomes one error
line and status 2, a ``KeyboardInterrupt`` (Ctrl-C in a single-threaded
command) one ``interrupted`` line and status 130, with no traceback.

A run with worker threads cannot simply let ``KeyboardInterrupt`` unwind the
main thread: the workers would be killed mid-call at exit (MLX then aborts
the process with ``terminate called without an active exception``) and the
files would be left half-written. Such a run uses :class:`InterruptRequest`:
the first Ctrl-C only sets :attr:`InterruptRequest.requested`, which the run
polls to stop its threads, join them and write its files, marked partial,
before the command prints its one line and returns 130. A second Ctrl-C
ends the process at once (status 130), for a run that does not wind down;
a SIGINT within :data:`REPEAT_SECONDS` of the first counts as the same one
(``timeout -s INT`` sends it to the process and to its group: two signals).

Complexity: O(1). Thread safety: :class:`InterruptRequest` installs its
handler only when entered on the main thread (signals are delivered there);
``requested`` is a ``threading.Event``, safe to poll from any thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Final

from veloxquant_mlx.commandline.bad_input import BadInputError, print_bad_input
from veloxquant_mlx.commandline.verdicts import ExitStatus

__all__ = ["REPEAT_SECONDS", "InterruptRequest", "report_interrupt", "run_command"]

#: A SIGINT this soon after the first is the same interrupt, not a second one.
REPEAT_SECONDS: Final = 1.0


def report_interrupt(prog: str, detail: str = "") -> ExitStatus:
    """Print ``PROG: interrupted[: DETAIL]`` on stderr; return :attr:`ExitStatus.INTERRUPTED`."""
    sys.stderr.write(f"{prog}: interrupted{f': {detail}' if detail else ''}\n")
    sys.stderr.flush()
    return ExitStatus.INTERRUPTED


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command's body; its exit status, or 2 on bad input, 130 on Ctrl-C (one line each).

    A ``SystemExit`` (argparse's ``--help`` or usage error) becomes its status,
    returned rather than raised, so that every ``main`` can be called from code.
    """
    try:
        return int(body())
    except BadInputError as error:
        return print_bad_input(prog, error)
    except KeyboardInterrupt:
        return report_interrupt(prog)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)


class InterruptRequest:
    """Turns Ctrl-C into a request that a threaded run polls (see the module docstring).

    Use as a context manager around the run; outside it the previous SIGINT
    handler is back. Invariant: ``requested`` is set iff a SIGINT arrived
    while the handler was installed (or :meth:`request` was called).
    """

    def __init__(self, prog: str) -> None:
        """``prog`` names the command in the line a second Ctrl-C prints."""
        self.prog = prog
        self.requested = threading.Event()
        self._first_at: float | None = None
        self._previous: Callable[[int, FrameType | None], object] | int | None = None
        self._installed = False

    def request(self) -> None:
        """Ask the run to stop, as a first Ctrl-C does."""
        self.requested.set()

    def __enter__(self) -> InterruptRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self.requested.set()
            return
        if now - self._first_at < REPEAT_SECONDS:
            return
        # The run did not wind down after the first Ctrl-C: stop now, without unwinding
        # the worker threads (which is what would crash MLX).
        line = f"{self.prog}: interrupted twice: stopped at once, files left partial\n"
        os.write(2, line.encode())
        os._exit(ExitStatus.INTERRUPTED)
