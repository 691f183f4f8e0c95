"""Test mutmut's mutants of MLX-backed modules, each in a fresh pytest process.

mutmut 3.8.1 tests each mutant in a child forked from its own process. The
gate's files (the allocator and the spec) import no MLX, but the caches do,
and MLX does not survive a fork: every mutant of ``batch_cache.py`` then
timed out. This script runs mutants that mutmut has generated under
``mutants/`` one ``python -m pytest -x`` process each, in ``mutants/``, with
mutmut's own switch (``MUTANT_UNDER_TEST``) and the derandomised ``mutation``
Hypothesis profile, so nothing is forked.

It is a measurement beside the gate, not the gate: it has no statistics run,
so every mutant runs every test file named (fastest killer first is up to
the order given), and its verdicts are kept in a JSON file of their own
(``--results``, read again to go on after a stop). mutation/README.md says
how to generate the mutants.

    python mutation/one_process_each.py mutants veloxquant_mlx/memory/batch_cache.py \\
        --tests tests/test_batch_cache.py --results batch.json

The named tests first run once with no mutant switched on; unless they pass,
no mutant is tried (a failing test, a missing file or no test at all would
otherwise count every mutant as killed).

Each pytest runs in a session of its own, so a Ctrl-C reaches only this
driver; a SIGTERM or SIGHUP stops it the same way. It kills the processes
running (their exit would be the stop's, not a mutant's), records no verdict
for them, and keeps the verdicts it had (the results file is replaced whole,
never left half written). A SIGKILL of the driver leaves its tests running.

Exit status: 0 when every mutant has a verdict (killed, survived or timeout);
3 when some were left untried (stopped): inconclusive; 2 for bad input or
tests that do not pass with no mutant.
Complexity: one pytest process per mutant, ``--workers`` at a time. Thread
safety: the worker threads wait on their processes and kill those that time
out; the set of running ones is under a lock; the main thread writes the
results and stops the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, NoReturn

#: A mutant's verdict: pytest's exit status, or "timeout".
Verdict = int | str
#: What a test run stopped by the driver returns: no verdict, never recorded.
STOPPED: Final = "stopped"
#: Results are written, and progress printed, every this many mutants.
REPORT_EVERY = 25


def mutant_names(mutants: Path, source: str) -> list[str]:
    """The mutants mutmut generated for ``source`` (a path below the repository root),
    from its ``.meta`` file under ``mutants``."""
    meta = mutants / f"{source}.meta"
    if not meta.is_file():
        raise FileNotFoundError(
            f"{meta} does not exist; expected mutmut to have generated {source}'s mutants"
        )
    names: dict[str, object] = json.loads(meta.read_text())["exit_code_by_key"]
    return list(names)


class RunningTests:
    """The pytest processes running now, each the leader of a session of its own.

    Invariants: every process in the set was started by :meth:`run` and its worker
    has not yet returned; after :meth:`stop`, :meth:`run` starts no process and
    returns :data:`STOPPED` for those it was waiting on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen[bytes]] = set()
        self._stopped = False

    def run(self, mutants: Path, name: str, tests: list[str], timeout: float) -> Verdict:
        """pytest's exit status for ``tests`` with mutant ``name`` switched on (0: it
        survived), "timeout", or :data:`STOPPED` once :meth:`stop` was called; ``name``
        ``""`` switches none on (the clean run)."""
        with self._lock:
            if self._stopped:
                return STOPPED
            process = _start_pytest(mutants, name, tests)
            self._processes.add(process)
        verdict: Verdict
        try:
            verdict = process.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            verdict = "timeout"
        finally:
            with self._lock:
                self._processes.discard(process)
                stopped = self._stopped
            if process.returncode is None:  # an error (or a stop) in this thread's wait
                _kill_session(process)
        return STOPPED if stopped else verdict

    def stop(self) -> None:
        """Kill every process running (and what it started); start none from now on.

        A process whose worker has just reaped it (and waits for the lock to take it
        out of the set) is killed here by its id: that finds no one, or what the
        process left running, unless the id was given out again, which takes a
        wrap-around of process ids in that moment."""
        with self._lock:
            self._stopped = True
            for process in self._processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)


def _start_pytest(mutants: Path, name: str, tests: list[str]) -> subprocess.Popen[bytes]:
    environment = dict(os.environ, MUTANT_UNDER_TEST=name, VELOXQUANT_HYPOTHESIS_PROFILE="mutation")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.Popen(
        command,
        cwd=mutants,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """Kill the session ``process`` leads (it and what it started), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_all(
    running: RunningTests,
    mutants: Path,
    names: list[str],
    tests: list[str],
    *,
    timeout: float,
    workers: int,
) -> Iterator[tuple[str, Verdict]]:
    """Each mutant's verdict, in the order given, ``workers`` processes at a time; a
    consumer that stops early (Ctrl-C) stops the processes running and starts no
    other (verdicts that ended behind the one awaited are not reported)."""
    pool = ThreadPoolExecutor(workers)
    try:
        yield from zip(
            names,
            pool.map(lambda name: running.run(mutants, name, tests, timeout), names),
            strict=True,
        )
    finally:
        running.stop()
        pool.shutdown(wait=True, cancel_futures=True)


def summary(verdicts: dict[str, Verdict], wanted: list[str]) -> str:
    """One line: killed, survived, timed out and untried among ``wanted``."""
    given = [verdicts[name] for name in wanted if name in verdicts]
    survived = sum(1 for verdict in given if verdict == 0)
    timeouts = sum(1 for verdict in given if verdict == "timeout")
    killed = len(given) - survived - timeouts
    return (
        f"{killed} killed, {timeouts} timeout, {survived} survived, "
        f"{len(wanted) - len(given)} untried, of {len(wanted)}"
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", type=Path, help="mutmut's mutants/ directory")
    parser.add_argument("sources", nargs="+", help="mutated files, as mutmut names them")
    parser.add_argument("--tests", required=True, help="comma-separated test files, in order")
    parser.add_argument("--results", type=Path, required=True, help="JSON file of verdicts")
    parser.add_argument("--workers", type=int, default=2, help="processes at a time")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant")
    args = parser.parse_args(argv)
    try:
        wanted = [name for source in args.sources for name in mutant_names(args.mutants, source)]
        verdicts: dict[str, Verdict] = (
            json.loads(args.results.read_text()) if args.results.exists() else {}
        )
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    if args.workers < 1 or args.timeout <= 0:
        parser.error(f"--workers {args.workers} and --timeout {args.timeout} must be positive")
    return _run(args, wanted, verdicts)


def _run(args: argparse.Namespace, wanted: list[str], verdicts: dict[str, Verdict]) -> int:
    untried = [name for name in wanted if name not in verdicts]
    tests = args.tests.split(",")
    running = RunningTests()
    clean: Verdict | None = None  # None: the clean run did not end
    with _stopped_by_signals() as ignore_signals:
        try:
            # Unless the tests pass alone, every mutant would count as killed by them.
            clean = running.run(args.mutants, "", tests, args.timeout) if untried else 0
            if clean != 0:
                print(
                    f"{Path(sys.argv[0]).name}: the tests do not pass with no mutant switched "
                    f"on (pytest: {clean}); expected a clean run before any verdict",
                    file=sys.stderr,
                )
                return 2
            _try_each(running, args, tests, untried, verdicts)
        except KeyboardInterrupt:
            ignore_signals()  # a second Ctrl-C must not cut the stop short
            print("stopped: the verdicts so far are kept", file=sys.stderr)
        finally:
            running.stop()
            if clean == 0:  # else no verdict was added
                _write_results(args.results, verdicts)
    print(summary(verdicts, wanted))
    complete = all(name in verdicts for name in wanted)
    if not complete:
        print("inconclusive: some mutants were not tried", file=sys.stderr)
    return 0 if complete else 3


def _try_each(
    running: RunningTests,
    args: argparse.Namespace,
    tests: list[str],
    untried: list[str],
    verdicts: dict[str, Verdict],
) -> None:
    """Record each untried mutant's verdict in ``verdicts``, writing them and printing
    progress every ``REPORT_EVERY``."""
    start = time.monotonic()
    mutants = run_all(
        running, args.mutants, untried, tests, timeout=args.timeout, workers=args.workers
    )
    for count, (name, verdict) in enumerate(mutants, 1):
        if verdict == STOPPED:
            continue  # (stop() is called only as the run ends)
        verdicts[name] = verdict
        if count % REPORT_EVERY == 0:
            _write_results(args.results, verdicts)
            elapsed = time.monotonic() - start
            print(f"{count}/{len(untried)} in {elapsed:.0f} s", file=sys.stderr, flush=True)


def _write_results(path: Path, verdicts: dict[str, Verdict]) -> None:
    """Replace ``path`` with ``verdicts`` whole: a stop mid-write leaves the old file."""
    written = path.with_name(f"{path.name}.writing")
    written.write_text(json.dumps(verdicts, indent=0))
    os.replace(written, path)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[Callable[[], None]]:
    """Within it, a SIGTERM or SIGHUP stops the run as a Ctrl-C does; it yields what
    ignores all three from then on. Every handler is restored on leaving. (Only the
    main thread can set handlers: elsewhere, this changes nothing.)"""
    names = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    before = {number: signal.getsignal(number) for number in names}
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.default_int_handler)

    def ignore() -> None:
        for number in names:
            signal.signal(number, signal.SIG_IGN)

    try:
        yield ignore
    finally:
        for number, handler in before.items():
            if handler is not None:  # None: a handler not set from Python, left as is
                signal.signal(number, handler)


if __name__ == "__main__":
    sys.exit(main())
