"""Ctrl-C and bad input in every command: one line on stderr, and a known exit status.

:func:`run_command` wraps the body of each command's ``main``: a
:class:`~veloxquant_mlx.commandline.bad_input.BadInputError` becomes one error
line and status 2, a Ctrl-C one ``interrupted`` line and status 130, with
no traceback.

One SIGINT handler serves every command
(:class:`~veloxquant_mlx.commandline.sigint.SigintHandler`, installed by
:func:`run_command` on the main thread, where signals are delivered):

- the first SIGINT sets a flag, :attr:`InterruptRequest.requested`. Code
  that runs threads, or hands a baton between them (a stress run, the
  schedule and finaliser explorers), works inside :class:`InterruptRequest`: it polls the
  flag between units of work, stops its threads, joins them and writes its
  files, marked partial, and the command then prints its one line and
  returns 130. No exception is raised in the main thread there, so none can
  land inside a threading primitive (a ``Semaphore.release`` cut half-way
  leaves its lock held, and the next run hangs on it). Outside it, in
  single-threaded code, the handler raises ``KeyboardInterrupt``, which
  :func:`run_command` turns into the one line;
- a SIGINT within :data:`REPEAT_SECONDS` of the first is the same Ctrl-C
  and is ignored: ``timeout -s INT`` sends the signal to the process and
  to its group, two signals a few microseconds apart, and a key held down
  repeats;
- a later one ends the process at once (status 130, one line), for a run
  that does not wind down: without unwinding the worker threads, which is
  what would crash MLX (``terminate called without an active exception``).

Commands started as programs (``python -m ...``, the ``veloxquant-mlx``
script) enter through :func:`~veloxquant_mlx.commandline.sigint.run_program`,
which installs the handler before their heavy imports, so a Ctrl-C while
NumPy or MLX loads is handled like any other, and ignores SIGINT once the
command has returned, so a repeat that arrives as the process exits cannot
kill it by signal.

Complexity: O(1). Thread safety: the handler's state is written by the
signal handler and by :func:`run_command` on the main thread only;
``requested`` is a ``threading.Event``, safe to poll from any thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType

from veloxquant_mlx.commandline.bad_input import BadInputError, print_bad_input
from veloxquant_mlx.commandline.sigint import REPEAT_SECONDS, SigintHandler, install
from veloxquant_mlx.commandline.verdicts import ExitStatus

__all__ = ["REPEAT_SECONDS", "InterruptRequest", "report_interrupt", "run_command"]


def report_interrupt(prog: str, detail: str = "") -> ExitStatus:
    """Print ``PROG: interrupted[: DETAIL]`` on stderr; return :attr:`ExitStatus.INTERRUPTED`."""
    sys.stderr.write(f"{prog}: interrupted{f': {detail}' if detail else ''}\n")
    sys.stderr.flush()
    return ExitStatus.INTERRUPTED


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command's body; its exit status, or 2 on bad input, 130 on Ctrl-C (one line each).

    The SIGINT handler is installed for the call unless one already is (a
    command run inside another, or a program's). A ``SystemExit``
    (argparse's ``--help`` or usage error) becomes its status, returned
    rather than raised, so that every ``main`` can be called from code.
    """
    _, undo = install(prog)
    try:
        return int(body())
    except BadInputError as error:
        return print_bad_input(prog, error)
    except KeyboardInterrupt:
        return report_interrupt(prog)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        undo()


class InterruptRequest:
    """While entered, Ctrl-C only sets ``requested``, which the code inside polls.

    Use as a context manager around work that runs threads (see the module
    docstring); outside it, Ctrl-C raises ``KeyboardInterrupt`` again.
    Entered outside :func:`run_command` (from code, or a test), it installs
    the handler itself and restores the previous one on exit.
    """

    def __init__(self, prog: str) -> None:
        """``prog`` names the command in the line a second Ctrl-C prints."""
        self.prog = prog
        self._handler: SigintHandler | None = None
        self._undo: Callable[[], None] = lambda: None
        self._local = threading.Event()  # the flag when no handler can be installed

    @property
    def requested(self) -> threading.Event:
        """Set by the first Ctrl-C (or :meth:`request`); safe to poll from any thread."""
        return self._local if self._handler is None else self._handler.requested

    def request(self) -> None:
        """Ask the run to stop, as a first Ctrl-C does."""
        self.requested.set()

    def __enter__(self) -> InterruptRequest:
        self._handler, self._undo = install(self.prog)
        if self._handler is not None:
            self._handler.polling += 1
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handler is not None:
            self._handler.polling -= 1
        self._undo()
