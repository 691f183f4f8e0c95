"""The stress run: N threads on one pool and one store, checked while they run and after.

:func:`run_stress` builds the pool (``config.allocator_factory``) and the
shared store, then runs these threads until ``config.ops`` calls were made
or ``config.duration`` passed, or a violation was found:

- ``threads`` **workers** (:class:`~veloxquant_mlx.stress.workload.Worker`),
  each making ``window_ops`` recorded calls, then meeting the others at a
  barrier. The barrier is a quiescent point: its action (run by the last
  thread to arrive, while the others wait) makes a few recorded observation
  calls (stats, history, ``n_free``, shared owners' ``blocks_for``,
  ``id_bound``), names the ``Block`` objects that ``blocks_for`` calls
  returned, and queues the window for the checker. A full queue makes the
  workers wait, which bounds the memory of a long run;
- the **history checker**: the linearizability checker, window by window,
  feeding each decided stretch of the linearization to the storage replay
  (:mod:`.replay`), which also writes it to ``linearized.jsonl``;
- the **invariant checker**: ``check_invariants()`` every ``check_interval``;
- the **watchdog**: the progress line, and a deadlock alarm with every
  thread's stack when no progress is made for ``stall_timeout`` seconds.

Then the conservation audit (:mod:`.conservation`), recorded like any window;
the report (:mod:`.report`) goes to ``report.json`` and ``summary.txt`` in
``config.out_dir``, with a reproducer file for a linearizability violation.

Complexity: the calls themselves, plus per window the checker's search.
Thread safety: :func:`run_stress` owns every thread it starts; run one at a
time per process (it sets the interpreter's switch interval for the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final, TextIO

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.stress.checker import LinearizabilityChecker
from veloxquant_mlx.stress.config import StressConfig
from veloxquant_mlx.stress.conservation import CONSERVATION_OWNER, check_conservation
from veloxquant_mlx.stress.history import (
    BlocksFor,
    Event,
    History,
    IdBound,
    NFree,
    Raised,
    Stats,
    ThreadRecorder,
)
from veloxquant_mlx.stress.recording import record_call, stats_tuple_of
from veloxquant_mlx.stress.replay import LinearizedReplay, backend_named
from veloxquant_mlx.stress.report import Finding, StressReport, summary_text
from veloxquant_mlx.stress.reproducer import spec_config, write_reproducer
from veloxquant_mlx.stress.workload import (
    FOREIGN_OWNER,
    SHARED_OWNERS,
    Registry,
    SharedRun,
    Worker,
    named_events,
    private_owners,
)

__all__ = ["run_stress"]

_JOIN_AFTER_STALL_SECONDS: Final = 2.0
_COMMIT_CHUNK: Final = 64  # calls replayed between two heartbeats


class _Run:
    """One stress run's threads and shared state (see the module docstring).

    Invariants: ``_stopping`` changes only in the barrier action, while every
    worker waits, so all workers see the same value after a barrier;
    ``_findings`` is appended to under ``_findings_lock`` only.
    """

    def __init__(self, config: StressConfig, progress: TextIO | None) -> None:
        self.config: Final = config
        self.progress: Final = progress
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
        self.windows: Final[queue.Queue[list[Event] | None]] = queue.Queue(
            config.max_queued_windows
        )
        self.calls_by_kind: Final[Counter[str]] = Counter()
        self.errors: Final[dict[str, Counter[str]]] = {}
        self.checker: Final = LinearizabilityChecker(
            spec_config(config.pool),
            config.history_len,
            on_commit=self._commit,
            budget=config.search_budget,
            tick=self._tick,
        )
        self.replay: LinearizedReplay | None = None
        self.invariant_checks = 0
        self.checker_steps = 0
        self.conservation_problems: tuple[str, ...] = ()
        self.started = time.monotonic()
        self._stop_requested: Final = threading.Event()
        self._stopping = False
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
        worker, window_ops = self.workers[index], self.config.window_ops
        try:
            while True:
                for _ in range(window_ops):
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
            self.windows.put(events)  # blocks while the checker is behind
            config = self.config
            elapsed = time.monotonic() - self.started
            self._stopping = (
                self._stop_requested.is_set()
                or (config.ops is not None and sum(self.calls_by_kind.values()) >= config.ops)
                or (config.duration is not None and elapsed >= config.duration)
            )
        except Exception:
            self._violation("crash", f"the barrier action crashed:\n{traceback.format_exc()}")
            self._stopping = True

    def _observe(self) -> None:
        """Recorded queries at the quiescent point: they pin down the state between windows."""
        pool, recorder = self.pool, self.observer
        record_call(recorder, Stats(), lambda: pool.stats, stats_tuple_of)
        record_call(
            recorder, History(), lambda: pool.history, lambda h: tuple(map(stats_tuple_of, h))
        )
        for stream in ("k", "v") if pool.config.separate_kv else ("kv",):
            record_call(recorder, NFree(stream), functools.partial(pool.n_free, stream), int)
        for owner in SHARED_OWNERS:
            record_call(
                recorder, BlocksFor(owner), functools.partial(pool.blocks_for, owner), tuple
            )
        record_call(recorder, IdBound(), pool.id_bound, int)

    def _tally(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = event.call.kind
            self.calls_by_kind[kind] += 1
            if isinstance(event.outcome, Raised):
                self.errors.setdefault(kind, Counter())[event.outcome.kind] += 1

    def _purge_registry(self) -> None:
        """Forget stale handles: no later ``blocks_for`` can return them."""
        stale = [key for key, (_, block) in self.registry.items() if block.owner is None]
        for key in stale:
            del self.registry[key]

    # -- the checker threads ------------------------------------------------------------------

    def check_histories(self) -> None:
        """The history checker's loop: check each window, replay what is decided."""
        config = self.config
        out = config.out_dir
        self.replay = LinearizedReplay(
            config.pool,
            config.store,
            backend_named(config.replay_backend),
            None if out is None else out / "linearized.jsonl",
        )
        try:
            while (events := self.windows.get()) is not None:
                violation = self.checker.check(events)
                self.checker_steps += 1
                if violation is not None and not any(
                    f.kind == "linearizability" for f in self.findings
                ):
                    path = None if out is None else out / "violation-linearizability.json"
                    if path is not None:
                        write_reproducer(path, violation, config.pool, config.history_len)
                    self._violation(
                        "linearizability", violation.message, str(path) if path else None
                    )
            self.checker.finish()
        except Exception:
            self._violation("crash", f"the history checker crashed:\n{traceback.format_exc()}")
            self._drain_queue()
        finally:
            self.replay.close()
            self._report_replay_failure()

    def _drain_queue(self) -> None:
        """Unblock the workers after a crash: take every window without checking it."""
        while self.windows.get() is not None:
            pass

    def _tick(self) -> None:
        self.checker_steps += 1

    def _commit(self, events: Sequence[Event]) -> None:
        """Replay a decided stretch of the linearization, a heartbeat per chunk."""
        assert self.replay is not None, "windows are committed by the history checker only"
        for start in range(0, len(events), _COMMIT_CHUNK):
            self.replay.feed(events[start : start + _COMMIT_CHUNK])
            self.checker_steps += 1
        self._report_replay_failure()

    def _report_replay_failure(self) -> None:
        replay = self.replay
        if replay is not None and replay.failure is not None:
            where = None if replay.path is None else str(replay.path)
            self._violation("replay", str(replay.failure), where)

    def check_invariants(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.check_interval):
            try:
                self.pool.check_invariants()
            except Exception as error:
                self._violation("invariant", f"check_invariants() during the run: {error!r}")
                return
            self.invariant_checks += 1

    # -- progress -----------------------------------------------------------------------------

    def heartbeat(self) -> int:
        return self.calls_made() + self.checker_steps + self.checker.figures.configurations

    def progress_line(self) -> str:
        elapsed = time.monotonic() - self.started
        calls = self.calls_made()
        figures = self.checker.figures
        return (
            f"[stress {self.config.profile}] {elapsed:7.1f}s  {calls:>10,} calls "
            f"({calls / max(elapsed, 1e-9):,.0f}/s)  windows checked {figures.windows:,} "
            f"(queued {self.windows.qsize()})  invariant checks {self.invariant_checks:,}  "
            f"violations {len(self.findings)}"
        )

    def owners(self) -> list[int]:
        mine = [owner for i in range(self.config.threads) for owner in private_owners(i)]
        return [*SHARED_OWNERS, *mine, CONSERVATION_OWNER]


def _foreign_block(config: PoolConfig) -> Block:
    """A live handle of another pool."""
    other = BlockPoolAllocator(PoolConfig(block_size=config.block_size, n_blocks=2), history_len=0)
    return other.allocate("k", 1, FOREIGN_OWNER)[0]


def run_stress(config: StressConfig, *, progress: TextIO | None = None) -> StressReport:
    """Run the stress test ``config`` describes; see the module docstring.

    Args:
        config: The run's options.
        progress: Where progress lines go (``None``: nowhere).

    Returns:
        The report; also written to ``config.out_dir`` when that is set.
    """
    if config.out_dir is not None:
        config.out_dir.mkdir(parents=True, exist_ok=True)
    previous_interval = sys.getswitchinterval()
    if config.switch_interval is not None:
        sys.setswitchinterval(config.switch_interval)
    try:
        run = _Run(config, progress)
        wall_seconds = _run_threads(run)
    finally:
        sys.setswitchinterval(previous_interval)
    report = _report(run, wall_seconds)
    if config.out_dir is not None:
        import json  # noqa: PLC0415 -- only when writing files

        (config.out_dir / "report.json").write_text(
            json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8"
        )
        (config.out_dir / "summary.txt").write_text(summary_text(report) + "\n", encoding="utf-8")
    return report


def _run_threads(run: _Run) -> float:
    """Start every thread, wait for the end, audit; the wall time of the run."""
    config = run.config
    from veloxquant_mlx.stress.watchdog import Watchdog  # noqa: PLC0415

    stalled = threading.Event()

    def on_stall(message: str) -> None:
        stalled.set()
        run._violation("deadlock", message)
        run.barrier.abort()  # releases the workers that wait there
        with contextlib.suppress(queue.Full):  # and the history checker, if it is idle
            run.windows.put_nowait(None)

    watchdog = Watchdog(
        run.heartbeat,
        run.progress_line,
        progress_interval=config.progress_interval if run.progress is not None else 0,
        stall_timeout=config.stall_timeout,
        on_stall=on_stall,
        stacks_path=None if config.out_dir is None else config.out_dir / "stacks.txt",
        stream=run.progress,
    )
    stop_invariants = threading.Event()
    threads = [
        threading.Thread(target=run.check_histories, name="stress-history-checker", daemon=True)
    ]
    if config.check_interval > 0:
        threads.append(
            threading.Thread(
                target=run.check_invariants,
                args=(stop_invariants,),
                name="stress-invariants",
                daemon=True,
            )
        )
    workers = [
        threading.Thread(target=run.work, args=(i,), name=f"stress-worker-{i}", daemon=True)
        for i in range(config.threads)
    ]
    run.started = time.monotonic()
    watchdog.start()
    for thread in [*threads, *workers]:
        thread.start()
    for worker in workers:
        while worker.is_alive() and not stalled.is_set():
            worker.join(0.2)
    if stalled.is_set():  # give the workers the barrier released a moment to leave
        deadline = time.monotonic() + _JOIN_AFTER_STALL_SECONDS
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
    wall_seconds = time.monotonic() - run.started
    stop_invariants.set()
    if not stalled.is_set():
        problems = check_conservation(run.pool, run.observer, run.owners())
        for problem in problems:
            run._violation("conservation", problem)
        run.conservation_problems = tuple(problems)
        final = named_events(run.observer.take(), run.registry)
        run._tally(final)
        run.windows.put(final)
        run.windows.put(None)
    for thread in threads:
        while thread.is_alive() and not stalled.is_set():
            thread.join(0.2)
    watchdog.stop()
    return wall_seconds


def _report(run: _Run, wall_seconds: float) -> StressReport:
    config = run.config
    figures = run.checker.figures
    replay = run.replay
    return StressReport(
        profile=config.profile,
        seed=config.seed,
        threads=config.threads,
        pool=config.pool,
        history_len=config.history_len,
        mix=config.mix.text(),
        window_ops=config.window_ops,
        switch_interval=config.switch_interval,
        wall_seconds=wall_seconds,
        calls_by_kind=dict(run.calls_by_kind),
        errors_by_call_kind={kind: dict(errors) for kind, errors in run.errors.items()},
        invariant_checks=run.invariant_checks,
        histories_checked=dataclasses.asdict(figures),
        replay={
            "backend": "none" if replay is None else replay.backend_name,
            "ops_replayed": 0 if replay is None else replay.ops_replayed,
            "ops_written": 0 if replay is None else replay.ops_written,
            "trace": None if replay is None or replay.path is None else str(replay.path),
        },
        conservation_problems=run.conservation_problems,
        findings=run.findings,
    )
