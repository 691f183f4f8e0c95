"""The one SIGINT handler of a command's process, and the entry point that installs it first.

This module imports the standard library only, and little of it, so that a
command's entry point (:func:`run_program`, :func:`program_main`) installs
the handler a few milliseconds after the interpreter starts, before the
command's heavy imports (NumPy, MLX: a quarter of a second): a Ctrl-C while
they load is then one line and status 130 like any other, not a traceback.
What the handler does is explained in
:mod:`~veloxquant_mlx.commandline.interrupts`, which builds on it.

Complexity: O(1). Thread safety: the handler's state is written on the main
thread only (by the handler, which Python runs there, and by
:func:`install`); ``requested`` is a ``threading.Event``, safe to poll
from any thread.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Final, NoReturn, cast

__all__ = [
    "INTERRUPTED_STATUS",
    "REPEAT_SECONDS",
    "SigintHandler",
    "active_handler",
    "exit_at_once",
    "exit_process",
    "exits_at_once",
    "install",
    "program_main",
    "run_program",
]

#: The exit status of an interrupted command: 128 + SIGINT, as a shell reports a Ctrl-C.
INTERRUPTED_STATUS: Final = 130
#: A SIGINT this soon after the first is the same interrupt, not a second one.
REPEAT_SECONDS: Final = 1.0

CommandMain = Callable[[Sequence[str] | None], int]
"""A command's ``main(argv)``: its exit status."""


class SigintHandler:
    """Ctrl-C as a flag, a ``KeyboardInterrupt``, or (a second time) an exit at once.

    Invariants: ``requested`` is set iff a SIGINT arrived while installed (or
    code asked for a stop); ``first_at`` is the time of the first SIGINT;
    while ``polling > 0`` the code running polls ``requested`` and no SIGINT
    raises an exception.
    """

    def __init__(self, prog: str) -> None:
        """``prog`` names the command in the line a second Ctrl-C prints."""
        self.prog = prog
        self.requested = threading.Event()
        self.first_at: float | None = None
        self.polling = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            self.requested.set()
            if not self.polling:
                raise KeyboardInterrupt
            return
        if now - self.first_at < REPEAT_SECONDS:
            return  # the same Ctrl-C, delivered twice
        # The run did not wind down: stop now, without unwinding its threads (MLX would abort).
        line = f"{self.prog}: interrupted twice: stopped at once, files left partial\n"
        os.write(2, line.encode())
        os._exit(INTERRUPTED_STATUS)


_active: SigintHandler | None = None  # the installed handler; main thread only


def active_handler() -> SigintHandler | None:
    """The installed handler, if any."""
    return _active


def install(prog: str) -> tuple[SigintHandler | None, Callable[[], None]]:
    """Install a handler unless one is active: ``(the active handler, undo)``.

    Off the main thread nothing can be installed: ``(None, no-op)``. When a
    handler was active already, ``undo`` leaves it.
    """
    global _active  # noqa: PLW0603 -- one handler per process, as there is one SIGINT
    if _active is not None or threading.current_thread() is not threading.main_thread():
        return _active, lambda: None
    handler = SigintHandler(prog)
    previous = signal.signal(signal.SIGINT, handler)
    _active = handler

    def undo() -> None:
        global _active  # noqa: PLW0603
        signal.signal(signal.SIGINT, previous)
        _active = None

    return handler, undo


def program_main(prog: str, module: str, argv: Sequence[str] | None = None) -> int:
    """Run ``module.main(argv)`` as this process's program: its exit status.

    The handler is installed before ``module`` is imported. Once the command
    has returned the process only exits, and SIGINT is ignored from then on:
    the interpreter's shutdown puts back the default action of a handler
    written in Python, and a repeat arriving then (the second signal of
    ``timeout -s INT``) would kill the process by signal instead of letting
    it exit 130.
    """
    install(prog)
    _AT_ONCE.clear()  # a command's own request: not an earlier command's of this process
    try:
        from veloxquant_mlx.commandline.interrupts import run_command  # noqa: PLC0415

        return run_command(prog, lambda: _main_of(module)(argv))
    except KeyboardInterrupt:  # before run_command was entered: its imports are light
        os.write(2, f"{prog}: interrupted\n".encode())
        return INTERRUPTED_STATUS
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_program(prog: str, module: str) -> NoReturn:
    """:func:`program_main` for a ``python -m`` entry point: exit with its status."""
    exit_process(program_main(prog, module))


#: Set by :func:`exit_at_once`: the process must not end through the interpreter's exit.
_AT_ONCE: Final = threading.Event()


def exit_at_once() -> None:
    """Make :func:`exit_process` end this process at once, whatever its status.

    For a command that leaves threads stuck (a stress run that found a
    deadlock): the interpreter's exit with a daemon thread inside MLX aborts
    the process in MLX's C++ teardown (SIGABRT, status 134), losing the status
    the command chose.
    """
    _AT_ONCE.set()


def exits_at_once(status: int) -> bool:
    """Whether :func:`exit_process` ends the process at once for ``status``."""
    return status == INTERRUPTED_STATUS or _AT_ONCE.is_set()


def exit_process(status: int) -> NoReturn:
    """End the process with ``status``; an interrupted run ends at once, streams flushed,
    as does a run that asked for it (:func:`exit_at_once`).

    Why at once: a ``KeyboardInterrupt`` that passed through C code running Python
    with ``PyRun_*`` (an extension's import, MLX's bindings among them) is marked
    unhandled by CPython even though the command caught it, and the interpreter's
    normal exit then kills the process with SIGINT (status -2, not 130). Seen about
    once in 20-40 Ctrl-Cs during imports on a loaded machine (strace: SIG_IGN, then
    SIG_DFL and ``kill(self, SIGINT)`` at exit).
    """
    if not exits_at_once(status):
        raise SystemExit(status)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _main_of(module: str) -> CommandMain:
    return cast(CommandMain, importlib.import_module(module).main)
