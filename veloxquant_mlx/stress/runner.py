"""The stress run: N threads on one pool and one store, checked while they run and after.

:func:`run_stress` builds the pool (``config.allocator_factory``) and the
shared store, then runs these threads until the workers made ``config.ops``
calls or ``config.duration`` passed, or a violation was found:

- ``threads`` **workers** (:class:`~veloxquant_mlx.stress.workload.Worker`),
  each making ``window_ops`` recorded calls, then meeting the others at a
  barrier. A window closes early once the calls must end (``duration``
  passed, a violation, Ctrl-C), and the last windows are shortened so that
  the calls stop at ``ops``: every stop condition is seen within one call
  per thread, whatever ``window_ops`` is. The barrier is a quiescent
  point: its action (run by the last thread to arrive, while the others
  wait) makes a few recorded observation calls (stats, history,
  ``n_free``, shared owners' ``blocks_for``, ``id_bound``), names the
  ``Block`` objects that ``blocks_for`` calls returned, and queues the
  window for the checker. A full queue makes the
  workers wait, which bounds the memory of a long run;
- the **history checker**: the linearizability checker, window by window,
  feeding each decided stretch of the linearization to the storage replay
  (:mod:`.replay`), which also writes it to ``linearized.jsonl``;
- the **invariant checker**: ``check_invariants()`` every ``check_interval``, and
  once more when the calls end;
- the **watchdog**: the progress line, and a deadlock alarm with every
  thread's stack when no progress is made for ``stall_timeout`` seconds.

Then the conservation audit (:mod:`.conservation`), recorded like any window;
the report (:mod:`.report`) goes to ``report.json`` and ``summary.txt`` in
``config.out_dir`` (each written atomically), with a reproducer file for a
linearizability violation. The report's verdict is OK only if every call was
checked; what was not, and why, is listed as gaps (verdict inconclusive).

Ctrl-C: the command passes an ``interrupt`` event (set by its SIGINT
handler). The workers stop at their next barrier, the checker at its next
tick, the threads are joined (none is left inside MLX), the conservation
audit is skipped, and the report is written with the verdict "interrupted";
the trace stays ``linearized.partial.jsonl``.

Complexity: the calls themselves, plus per window the checker's search.
Thread safety: :func:`run_stress` owns every thread it starts; run one at a
time per process (it sets the interpreter's switch interval for the run).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO

from veloxquant_mlx.commandline.files import atomic_write_text
from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.stress.checker import LinearizabilityChecker
from veloxquant_mlx.stress.checking import (
    INTERRUPTED,
    CheckingBudget,
    HistoryChecking,
    WindowQueue,
)
from veloxquant_mlx.stress.config import StressConfig
from veloxquant_mlx.stress.conservation import CONSERVATION_OWNER, check_conservation
from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.stress.recording import record_unnamed_call
from veloxquant_mlx.stress.replay import LinearizedReplay, backend_named
from veloxquant_mlx.stress.report import (
    REPORT_NAME,
    REPRODUCER_NAME,
    STACKS_NAME,
    SUMMARY_NAME,
    Finding,
    StressReport,
    Timing,
    summary_text,
)
from veloxquant_mlx.stress.reproducer import write_reproducer
from veloxquant_mlx.stress.workload import (
    FOREIGN_OWNER,
    SHARED_OWNERS,
    Registry,
    SharedRun,
    Worker,
    named_events,
    private_owners,
)
from veloxquant_mlx.testing.aliasing import spec_config
from veloxquant_mlx.testing.traces import Trace, TraceLine
from veloxquant_mlx_spec.table import Raised, declaration_of, observation_ops

__all__ = ["run_stress"]

_JOIN_AFTER_STALL_SECONDS: Final = 2.0
_JOIN_POLL_SECONDS: Final = 0.2


class _Run:
    """One stress run's threads and shared state (see the module docstring).

    Invariants: ``_stopping`` and ``_window_calls`` change only in the barrier
    action (or before the workers start), while every worker waits, so all
    workers see the same values after a barrier; ``_findings`` is appended
    to under ``_findings_lock`` only.
    """

    def __init__(
        self, config: StressConfig, progress: TextIO | None, interrupt: threading.Event
    ) -> None:
        self.config: Final = config
        self.progress: Final = progress
        self.interrupt: Final = interrupt
        self.pool: Final = config.allocator_factory(config.pool, config.history_len)
        backend = backend_named(config.storage)
        store: BlockStorage[Any] | None = (
            None if backend is None else backend.make_storage(self.pool, config.store)
        )
        self.registry: Final[Registry] = {}
        self.recorders: Final = [
            ThreadRecorder(i, config.threads + 1) for i in range(config.threads + 1)
        ]
        self.observer: Final = self.recorders[-1]  # the barrier action's and the audit's calls
        self.shared: Final = SharedRun(
            pool=self.pool,
            store=store,
            backend=backend,
            registry=self.registry,
            foreign_block=_foreign_block(config.pool),
            report_violation=self._violation,
            n_threads=config.threads,
        )
        self.workers: Final = [
            Worker(i, self.shared, self.recorders[i], config.mix, config.seed)
            for i in range(config.threads)
        ]
        self.barrier: Final = threading.Barrier(config.threads, action=self._close_window)
        self.windows: Final = WindowQueue(config.max_queued_windows)
        self.budget: Final = CheckingBudget(config.check_budget, interrupt)
        self.calls_by_kind: Final[Counter[str]] = Counter()
        # The workers' calls, what --ops bounds: calls_by_kind adds the observations made
        # at each barrier and the audit's calls.
        self.worker_calls = 0
        self.errors: Final[dict[str, Counter[str]]] = {}
        self.checker: Final = LinearizabilityChecker(
            spec_config(config.pool),
            config.history_len,
            store=config.store,
            on_commit=self._commit,
            budget=config.search_budget,
            tick=self._tick,
        )
        self.checking: HistoryChecking | None = None  # built on the checker's thread
        self.observed: Final = observation_ops(spec_config(config.pool), SHARED_OWNERS, ())
        self.invariant_checks = 0
        self.conservation_problems: tuple[str, ...] = ()
        self.audit_skipped: str | None = None  # why the conservation audit did not run
        self.started = time.monotonic()
        self._stop_requested: Final = threading.Event()
        self._stopping = False
        self._window_calls = self._next_window_calls()  # calls per worker in this window
        self._findings: Final[list[Finding]] = []
        self._findings_lock: Final = threading.Lock()

    # -- findings and stopping ----------------------------------------------------------------

    def _violation(self, kind: str, message: str, path: str | None = None) -> None:
        finding = Finding(kind, message, path)
        with self._findings_lock:
            if finding not in self._findings:
                self._findings.append(finding)
        self._stop_requested.set()

    @property
    def findings(self) -> tuple[Finding, ...]:
        with self._findings_lock:
            return tuple(self._findings)

    def calls_made(self) -> int:
        return sum(len(recorder.events) for recorder in self.recorders) + sum(
            self.calls_by_kind.values()
        )

    # -- workers and the barrier ------------------------------------------------------------

    def work(self, index: int) -> None:
        worker, recorded = self.workers[index], self.recorders[index]
        try:
            while True:
                # At most window_calls steps, and no step once window_calls calls are
                # recorded: a step records one call, two (a blocks_for first) or none (a
                # write with nothing held). The barrier action takes the events.
                for _ in range(self._window_calls):
                    # every worker sees a window that must close: its condition never clears
                    if self._window_must_close() or len(recorded.events) >= self._window_calls:
                        break
                    worker.step()
                self.barrier.wait()
                if self._stopping:
                    return
        except threading.BrokenBarrierError:
            return
        except Exception:
            self._violation("crash", f"worker {index} crashed:\n{traceback.format_exc()}")
            self.barrier.abort()

    def _close_window(self) -> None:
        """The barrier action: observe, name, tally and queue the window; decide to stop."""
        try:
            self._observe()
            events = [event for recorder in self.recorders for event in recorder.take()]
            events = named_events(events, self.registry)
            self._tally(events)
            self._purge_registry()
            self.windows.put(events, may_wait=lambda: not self._calls_should_end())
            self._stopping = self._calls_should_end()
            self._window_calls = self._next_window_calls()
        except Exception:
            self._violation("crash", f"the barrier action crashed:\n{traceback.format_exc()}")
            self._stopping = True

    def _calls_should_end(self) -> bool:
        """A violation, Ctrl-C, or the run's ``ops`` or ``duration`` reached."""
        config = self.config
        return self._window_must_close() or (
            config.ops is not None and self.worker_calls >= config.ops
        )

    def _window_must_close(self) -> bool:
        """A violation, Ctrl-C, or ``duration`` reached: checked before every call."""
        duration = self.config.duration
        return (
            self._stop_requested.is_set()
            or self.interrupt.is_set()
            or (duration is not None and time.monotonic() - self.started >= duration)
        )

    def _next_window_calls(self) -> int:
        """Calls per worker in the next window: ``window_ops``, fewer to stop at ``ops``."""
        config = self.config
        if config.ops is None:
            return config.window_ops
        left = max(config.ops - self.worker_calls, 1)
        return min(config.window_ops, -(-left // config.threads))

    def _observe(self) -> None:
        """Recorded queries at the quiescent point: they pin down the state between windows.

        The queries the table observes (stats, history, free counts, the shared
        owners' handles, ``id_bound``, ``check_invariants``), as the lockstep
        runner compares them after every call.
        """
        for op in self.observed:
            record_unnamed_call(self.observer, self.pool, op)

    def _tally(self, events: Sequence[TraceLine]) -> None:
        observer = self.observer.thread
        for event in events:
            kind = declaration_of(event.op).name
            self.calls_by_kind[kind] += 1
            if event.thread != observer:
                self.worker_calls += 1
            if isinstance(event.outcome, Raised):
                self.errors.setdefault(kind, Counter())[event.outcome.kind] += 1

    def _purge_registry(self) -> None:
        """Forget stale handles: no later ``blocks_for`` can return them."""
        stale = [key for key, (_, block) in self.registry.items() if block.owner is None]
        for key in stale:
            del self.registry[key]

    # -- the checker threads ------------------------------------------------------------------

    def check_histories(self) -> None:
        """The history checker's thread: see :class:`~.checking.HistoryChecking`."""
        config = self.config
        replay = LinearizedReplay(
            config.pool,
            config.store,
            backend_named(config.replay_backend),
            config.out_dir,
            config.history_len,
        )
        checking = HistoryChecking(self.checker, replay, self.windows, self.budget)
        self.checking = checking
        try:
            checking.run(self._linearizability_violation)
        except Exception:
            self._violation("crash", f"the history checker crashed:\n{traceback.format_exc()}")
            self.checker.stop("stopped: the history checker crashed")
            self._drain_queue()
        finally:
            # After a deadlock the stuck calls never ended: the history has no end either.
            stalled = any(finding.kind == "deadlock" for finding in self.findings)
            if checking.complete and not self.interrupt.is_set():
                replay.finish()
            whole = checking.complete and replay.failure is None and not self.interrupt.is_set()
            replay.close(complete=whole and not stalled)
            self._report_replay_failure()

    def _linearizability_violation(self, checker: LinearizabilityChecker) -> None:
        violation = checker.violation
        assert violation is not None, "called at a violation"
        config, out = self.config, self.config.out_dir
        path = None if out is None else out / REPRODUCER_NAME
        if path is not None:
            replay = None if self.checking is None else self.checking.replay
            prefix = replay.path if replay is not None and replay.complete else None
            header = Trace(config.pool, config.store, history_len=config.history_len)
            write_reproducer(path, violation, header, prefix)
        self._violation("linearizability", violation.message, str(path) if path else None)

    def _drain_queue(self) -> None:
        """Unblock the workers after a crash: take every window without checking it."""
        while (events := self.windows.get()) is not None:
            self.checker.figures.events_not_checked += len(events)

    def _tick(self) -> None:
        assert self.checking is not None, "searches run on the checker's thread"
        self.checking.tick()

    def _commit(self, events: Sequence[TraceLine]) -> None:
        assert self.checking is not None, "windows are committed by the history checker only"
        self.checking.commit(events)
        self._report_replay_failure()

    def _report_replay_failure(self) -> None:
        replay = None if self.checking is None else self.checking.replay
        if replay is not None and replay.failure is not None:
            where = None if replay.path is None else str(replay.path)
            self._violation("replay", str(replay.failure), where)

    def check_invariants(self, stop: threading.Event) -> None:
        """``check_invariants()`` every ``check_interval`` while the calls run, and once more
        when they end: a run shorter than the interval is still checked."""
        ended = False
        while not ended:
            ended = stop.wait(self.config.check_interval)
            try:
                self.pool.check_invariants()
            except Exception as error:
                when = "after the calls ended" if ended else "during the run"
                self._violation("invariant", f"check_invariants() {when}: {error!r}")
                return
            self.invariant_checks += 1

    # -- progress -----------------------------------------------------------------------------

    def heartbeat(self) -> int:
        checking = self.checking
        return self.calls_made() + (0 if checking is None else checking.heartbeats)

    def progress_line(self) -> str:
        elapsed = time.monotonic() - self.started
        calls = self.calls_made()
        checking = "checker starting" if self.checking is None else self.checking.progress_text()
        phase = "calls" if self.budget.deadline is None else "checking"
        return (
            f"[stress {self.config.profile}] {elapsed:7.1f}s {phase}: {calls:,} calls "
            f"({calls / max(elapsed, 1e-9):,.0f}/s), {checking}; invariant checks "
            f"{self.invariant_checks:,}, violations {len(self.findings)}"
        )

    def owners(self) -> list[int]:
        mine = [owner for i in range(self.config.threads) for owner in private_owners(i)]
        return [*SHARED_OWNERS, *mine, CONSERVATION_OWNER]


def _foreign_block(config: PoolConfig) -> Block:
    """A live handle of another pool."""
    other = BlockPoolAllocator(PoolConfig(block_size=config.block_size, n_blocks=2), history_len=0)
    return other.allocate("k", 1, FOREIGN_OWNER)[0]


def run_stress(
    config: StressConfig,
    *,
    progress: TextIO | None = None,
    interrupt: threading.Event | None = None,
) -> StressReport:
    """Run the stress test ``config`` describes; see the module docstring.

    Args:
        config: The run's options. ``config.out_dir`` must exist and be
            writable (the command line prepares it).
        progress: Where progress lines go (``None``: nowhere).
        interrupt: Set (by a SIGINT handler) to stop the run early, cleanly.

    Returns:
        The report; also written to ``config.out_dir`` when that is set.
    """
    previous_interval = sys.getswitchinterval()
    if config.switch_interval is not None:
        sys.setswitchinterval(config.switch_interval)
    started = time.monotonic()
    try:
        run = _Run(config, progress, interrupt or threading.Event())
        calls_seconds = _run_threads(run)
    finally:
        sys.setswitchinterval(previous_interval)
    finished = time.monotonic()
    report = _report(run, calls_seconds, finished - started, finished)
    if config.out_dir is not None:
        atomic_write_text(
            config.out_dir / REPORT_NAME, json.dumps(report.to_json(), indent=2) + "\n"
        )
        atomic_write_text(config.out_dir / SUMMARY_NAME, summary_text(report) + "\n")
    return report


def _run_threads(run: _Run) -> float:
    """Start every thread, wait for the calls to end, audit, let the checker finish.

    Returns:
        The seconds the calls took (the checking after them excluded).
    """
    config = run.config
    from veloxquant_mlx.stress.watchdog import Watchdog  # noqa: PLC0415

    stalled = threading.Event()

    def on_stall(message: str) -> None:
        stalled.set()
        run._violation("deadlock", message)
        run.barrier.abort()  # releases the workers that wait there
        run.windows.close()  # and the history checker, if it is idle

    watchdog = Watchdog(
        run.heartbeat,
        run.progress_line,
        progress_interval=config.progress_interval if run.progress is not None else 0,
        stall_timeout=config.stall_timeout,
        on_stall=on_stall,
        stacks_path=None if config.out_dir is None else config.out_dir / STACKS_NAME,
        stream=run.progress,
    )
    stop_invariants = threading.Event()
    checkers = [_daemon("stress-history-checker", run.check_histories)]
    if config.check_interval > 0:
        checkers.append(_daemon("stress-invariants", run.check_invariants, stop_invariants))
    workers = [_daemon(f"stress-worker-{i}", run.work, i) for i in range(config.threads)]
    run.started = time.monotonic()
    watchdog.start()
    for thread in [*checkers, *workers]:
        thread.start()
    _join(workers, stalled)
    calls_seconds = time.monotonic() - run.started
    stop_invariants.set()
    if not stalled.is_set():
        run.budget.calls_ended()  # the audit's few calls count against the checking budget
        _audit(run)
        run.windows.close()
    _join(checkers, stalled)
    watchdog.stop()
    return calls_seconds


def _daemon(name: str, target: Callable[..., None], *args: object) -> threading.Thread:
    """A daemon thread, so that a stuck thread cannot keep the interpreter from exiting."""
    return threading.Thread(target=target, args=args, name=name, daemon=True)


def _join(threads: Sequence[threading.Thread], stalled: threading.Event) -> None:
    """Wait for ``threads``; after a stall, give them a moment to leave, then stop waiting."""
    for thread in threads:
        while thread.is_alive() and not stalled.is_set():
            thread.join(_JOIN_POLL_SECONDS)
    if stalled.is_set():
        deadline = time.monotonic() + _JOIN_AFTER_STALL_SECONDS
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _audit(run: _Run) -> None:
    """The conservation audit, its calls queued as the last window; skipped after Ctrl-C."""
    if run.interrupt.is_set():
        run.audit_skipped = INTERRUPTED
        return
    problems = check_conservation(run.pool, run.observer, run.owners())
    for problem in problems:
        run._violation("conservation", problem)
    run.conservation_problems = tuple(problems)
    final = named_events(run.observer.take(), run.registry)
    run._tally(final)
    run.windows.put(final, may_wait=lambda: False)


def _gaps(run: _Run) -> tuple[Gap, ...]:
    gaps = [] if run.checking is None else run.checking.gaps()
    if run.worker_calls == 0 and not run.interrupt.is_set():
        gaps.append(  # OK would then say only that the barriers' queries agreed
            Gap(
                "the pool under the worker threads",
                "they made no call: the calls stopped before the first (--duration), or "
                "every kind drawn was a store call (write, gather), which needs a block no "
                "pool call had handed out (give the pool's calls more weight in --mix)",
            )
        )
    if run.audit_skipped is not None:
        gaps.append(Gap("the conservation audit", f"not run: {run.audit_skipped}"))
    return tuple(gaps)


def _report(run: _Run, calls_seconds: float, total_seconds: float, finished: float) -> StressReport:
    config = run.config
    checking = run.checking
    replay = None if checking is None else checking.replay
    ended = run.budget.calls_ended_at
    return StressReport(
        config=config,
        wall_seconds=calls_seconds,
        calls_by_kind=dict(run.calls_by_kind),
        worker_calls=run.worker_calls,
        errors_by_call_kind={kind: dict(errors) for kind, errors in run.errors.items()},
        invariant_checks=run.invariant_checks,
        histories_checked=dataclasses.asdict(run.checker.figures),
        replay={
            "backend": "none" if replay is None else replay.backend_name,
            "ops_replayed": 0 if replay is None else replay.ops_replayed,
            "ops_written": 0 if replay is None else replay.ops_written,
            "trace": None if replay is None or replay.path is None else str(replay.path),
        },
        conservation_problems=run.conservation_problems,
        findings=run.findings,
        gaps=_gaps(run),
        interrupted=run.interrupt.is_set(),
        timing=Timing(
            total_seconds=total_seconds,
            checking_seconds=0.0 if checking is None else checking.seconds_busy,
            checking_after_calls_seconds=0.0 if ended is None else finished - ended,
            check_budget_seconds=config.check_budget,
        ),
    )
