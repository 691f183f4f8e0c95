"""Ctrl-C stops every command with one line and status 130: real processes, real signals.

Each command is started as a user starts it (``python -m ...``), and is
interrupted only once a line it prints says that it is at work (a progress
line, a table's header, a first result): no sleeps. The signal is sent as
``timeout -s INT`` sends it, to the process and to its group, two signals a
few microseconds apart, which once made commands print a traceback or die
by signal. A Ctrl-C while NumPy loads is one line too, and a second Ctrl-C
well after the first stops a command that does not wind down. Every child is
killed in a ``finally``, whatever the test's outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.traces import StoreSpec, Trace, TraceLine, save
from veloxquant_mlx_spec.operations import Allocate, Free
from veloxquant_mlx_spec.table import h

ROOT = Path(__file__).resolve().parents[1]
#: The longest a command may take to print its readiness line or to end: a hang, not a bound.
PATIENCE_SECONDS = 120.0

Ready = Callable[[str], bool]
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's colours and cursor moves


@dataclass
class Running:
    """A command's process and what it printed so far, line by line (or chunk, on a terminal)."""

    process: subprocess.Popen[bytes]
    printed: queue.Queue[str | None] = field(default_factory=queue.Queue)  # None: a stream ended
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def read(self, stream: IO[bytes] | int, into: list[str]) -> None:
        """Collect ``stream`` (a pipe, or a terminal's file descriptor) on a thread."""

        def pump() -> None:
            chunks = iter(stream.readline, b"") if not isinstance(stream, int) else _tty(stream)
            for chunk in chunks:
                text = _ANSI_ESCAPE.sub("", chunk.decode(errors="replace"))
                into.append(text)
                self.printed.put(text)
            self.printed.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        self.readers.append(reader)

    def wait_until_printed(self, ready: Ready, what: str) -> None:
        """Block until a line satisfies ``ready``; fail if the process ends or hangs first."""
        ended = 0
        while ended < len(self.readers):
            try:
                text = self.printed.get(timeout=PATIENCE_SECONDS)
            except queue.Empty:
                pytest.fail(f"never printed {what}: hung")
            if text is None:
                ended += 1
            elif ready(text):
                return
        pytest.fail(f"ended without printing {what}:\n{''.join(self.out + self.err)}")

    def end(self) -> tuple[int, str, str]:
        """Wait for the process to exit: its status, stdout and stderr."""
        status = self.process.wait(timeout=PATIENCE_SECONDS)
        for reader in self.readers:
            reader.join(timeout=PATIENCE_SECONDS)
        return status, "".join(self.out), "".join(self.err)


def _tty(descriptor: int) -> Iterator[bytes]:
    while True:
        try:
            chunk = os.read(descriptor, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            return
        if not chunk:
            return
        yield chunk


@contextlib.contextmanager
def started(
    args: Sequence[str], cwd: Path, *, stderr_on_a_terminal: bool = False
) -> Iterator[Running]:
    """Start ``python ARGS`` in its own process group; kill it on the way out, whatever happened."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "spec")])
    terminal, child_end = pty.openpty() if stderr_on_a_terminal else (-1, -1)
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,  # never written: a command reading stdin (the driver) waits
        stdout=subprocess.PIPE,
        stderr=child_end if stderr_on_a_terminal else subprocess.PIPE,
        start_new_session=True,  # its own group: the signal to the group spares pytest
    )
    running = Running(process)
    try:
        assert process.stdout is not None
        running.read(process.stdout, running.out)
        if stderr_on_a_terminal:
            os.close(child_end)
            running.read(terminal, running.err)
        else:
            assert process.stderr is not None
            running.read(process.stderr, running.err)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stdin is not None
        process.stdin.close()
        if stderr_on_a_terminal:
            os.close(terminal)


def interrupt_as_timeout_does(process: subprocess.Popen[bytes]) -> None:
    """SIGINT to the process, then to its group: what ``timeout -s INT`` sends."""
    os.kill(process.pid, signal.SIGINT)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)


def assert_one_interrupted_line(status: int, err: str, prog: str) -> str:
    """Status 130, no traceback, and exactly one ``PROG: interrupted`` line (returned)."""
    assert status == 130, err
    assert "Traceback" not in err
    assert "terminate called" not in err
    lines = [line for line in err.replace("\r", "\n").splitlines() if "interrupted" in line]
    assert len(lines) == 1, err
    [line] = lines
    assert line.startswith(f"{prog}: interrupted"), err
    return line


def long_trace(path: Path) -> None:
    """A trace that takes far longer to replay than any test waits."""
    pool = PoolConfig(block_size=4, n_blocks=64)
    lines: list[TraceLine] = []
    for call in range(40_000):
        lines.append(TraceLine(Allocate("k", 16, 1), call))
        lines.append(TraceLine(Free(tuple(h(call, i) for i in range(4)))))
    save(Trace(pool, StoreSpec(2, 2, 8), tuple(lines)), path)


@dataclass(frozen=True)
class Command:
    """How to start a command, the prog its lines name, and the line that says it is at work."""

    args: tuple[str, ...]
    prog: str
    ready: Ready
    what: str
    stderr_on_a_terminal: bool = False


COMMANDS = {
    "stress": Command(
        ("-m", "stress", "--duration", "120", "--out", "run"),
        "python -m stress",
        lambda text: " calls: " in text,
        "a progress line",
    ),
    "simulate": Command(
        ("-m", "veloxquant_mlx", "simulate", "--duration", "2000000"),
        "veloxquant-mlx simulate",
        lambda text: "simulate step" in text,
        "its progress bar",
        stderr_on_a_terminal=True,  # the bar is drawn on a terminal only, by a thread of rich's
    ),
    "exhaustive": Command(
        ("-m", "veloxquant_mlx.testing.exhaustive", "--profile", "nightly"),
        "python -m veloxquant_mlx.testing.exhaustive",
        lambda text: ": depth 1:" in text,
        "the first depth's progress line",
    ),
    "schedules": Command(
        ("-m", "veloxquant_mlx.stress.schedules", "--granularity", "line"),
        "python -m veloxquant_mlx.stress.schedules",
        lambda text: text.startswith("scenario "),
        "the table's header",
    ),
    "finaliser": Command(
        ("-m", "veloxquant_mlx.stress.finaliser_schedules"),
        "python -m veloxquant_mlx.stress.finaliser_schedules",
        lambda text: "every schedule of every drop point" in text,
        "its scope line",
    ),
    "driver": Command(
        ("-m", "veloxquant_mlx", "driver"),
        "veloxquant-mlx driver",
        lambda text: text.startswith('{"protocol": '),
        "its hello line",
    ),
    "aliasing": Command(
        (
            "-m",
            "veloxquant_mlx.testing.aliasing",
            "short.jsonl",
            "long.jsonl",
            "--backend",
            "numpy",
        ),
        "python -m veloxquant_mlx.testing.aliasing",
        lambda text: text.startswith("short.jsonl") and text.rstrip().endswith("ok"),
        "the first trace's result",
    ),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the aliasing command's two traces, a quick one and a long one."""
    folder = tmp_path_factory.mktemp("commands")
    save(Trace(PoolConfig(block_size=4, n_blocks=8), StoreSpec(1, 1, 2)), folder / "short.jsonl")
    long_trace(folder / "long.jsonl")
    return folder


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_sent_as_timeout_sends_it_is_one_line_and_130_in_every_command(
    workdir: Path, name: str
) -> None:
    command = COMMANDS[name]
    with started(
        command.args, workdir, stderr_on_a_terminal=command.stderr_on_a_terminal
    ) as running:
        running.wait_until_printed(command.ready, command.what)
        interrupt_as_timeout_does(running.process)
        status, _, err = running.end()
    assert_one_interrupted_line(status, err, command.prog)


def test_ctrl_c_in_a_stress_run_leaves_a_partial_report_and_no_temporary_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    with started(["-m", "stress", "--duration", "120", "--out", str(out)], ROOT) as running:
        running.wait_until_printed(lambda text: " calls: " in text, "a progress line")
        running.process.send_signal(signal.SIGINT)
        status, _, err = running.end()
    line = assert_one_interrupted_line(status, err, "python -m stress")
    assert line.startswith("python -m stress: interrupted: after ")
    report = json.loads((out / "report.json").read_text())
    assert (report["verdict"], report["partial"]) == ("interrupted", True)
    assert not (out / "linearized.jsonl").exists()
    assert not [path for path in out.iterdir() if path.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("args", "module", "prog"),
    [
        (
            ("-m", "veloxquant_mlx.testing.aliasing", "long.jsonl", "--backend", "numpy"),
            "numpy.",
            "python -m veloxquant_mlx.testing.aliasing",
        ),
        (("-m", "veloxquant_mlx", "stress"), "veloxquant_mlx.memory.", "veloxquant-mlx"),
    ],
    ids=["aliasing-while-numpy-loads", "cli-while-the-pool-loads"],
)
def test_ctrl_c_while_a_command_still_imports_is_one_line_and_130(
    workdir: Path, args: tuple[str, ...], module: str, prog: str
) -> None:
    def importing(text: str) -> bool:  # -X importtime: a line as each module is loaded
        return text.startswith("import time:") and f"| {module}" in " ".join(text.split())

    with started(("-X", "importtime", *args), workdir) as running:
        running.wait_until_printed(importing, f"an import of {module}")
        interrupt_as_timeout_does(running.process)
        status, _, err = running.end()
    err = "".join(line for line in err.splitlines(True) if not line.startswith("import time:"))
    assert_one_interrupted_line(status, err, prog)


SLOW_TO_WIND_DOWN = """
import os, signal, sys, time
from veloxquant_mlx.commandline import sigint
from veloxquant_mlx.commandline.interrupts import InterruptRequest

with InterruptRequest("tool") as request:
    print("polling", flush=True)
    request.requested.wait()           # the first Ctrl-C: a run would start winding down
    handler = sigint.active_handler()
    handler.first_at -= 2 * sigint.REPEAT_SECONDS  # ... and not be done long after
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
    time.sleep(60)
print("not stopped", flush=True)
"""


def test_a_second_ctrl_c_long_after_the_first_stops_at_once(tmp_path: Path) -> None:
    with started(["-c", SLOW_TO_WIND_DOWN], tmp_path) as running:
        running.wait_until_printed(lambda text: text.startswith("polling"), "its first line")
        running.process.send_signal(signal.SIGINT)
        status, out, err = running.end()
    assert status == 130
    assert err == "tool: interrupted twice: stopped at once, files left partial\n"
    assert "not stopped" not in out
