"""Run a workload through a :class:`ServingEngine` until every request is done.

:func:`run_workload` feeds each request to the engine at its arrival step,
keeps stepping after the last arrival until the queue and the batch are
empty (the *drain*), checks invariants along the way and at the end, and
reports progress through an optional callback so that the caller chooses how
(or whether) to show it.

Complexity: O(steps + requests) engine steps and callbacks.
Thread safety: single-threaded, like the engine it drives; the callback runs
on the calling thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from veloxquant_mlx.simulate.engine import ServingEngine
from veloxquant_mlx.simulate.workload import Request


@dataclass(frozen=True)
class Progress:
    """What a progress display needs, passed to the progress callback."""

    step: int  # steps simulated so far
    finished: int  # requests completed, aborted or rejected so far
    total: int  # requests in the workload


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class RunTiming:
    """Wall-clock cost of a run; the only non-deterministic output."""

    wall_seconds: float  # time spent in run_workload
    steps_per_second: float  # simulated steps per wall-clock second


def _finished(engine: ServingEngine) -> int:
    counters = engine.counters
    return counters.completed + counters.aborted + counters.rejected


def _arrivals_at(requests: Sequence[Request], start: int, step: int) -> int:
    """Index just past the requests arriving at ``step``, scanning from ``start``."""
    end = start
    while end < len(requests) and requests[end].arrival_step <= step:
        end += 1
    return end


def run_workload(
    engine: ServingEngine,
    requests: Sequence[Request],
    *,
    min_steps: int = 0,
    check_every: int = 0,
    on_progress: ProgressCallback | None = None,
    progress_every: int = 50,
) -> RunTiming:
    """Step ``engine`` through ``requests`` and drain it.

    Args:
        engine: A fresh, idle engine.
        requests: Sorted by ``arrival_step`` (as :func:`generate_workload` returns them).
        min_steps: Keep stepping at least this long even if idle (the arrival window).
        check_every: Also run :meth:`ServingEngine.check` every this many steps; 0 never.
        on_progress: Called every ``progress_every`` steps and once at the end.
        progress_every: Steps between progress callbacks (>= 1).

    Returns:
        The run's wall-clock timing.

    Raises:
        SimulationInvariantError: A periodic check or the final drain check failed.
    """
    started = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(requests) or not engine.idle or engine.step_index < min_steps:
        end = _arrivals_at(requests, next_arrival, engine.step_index)
        engine.step(requests[next_arrival:end])
        next_arrival = end
        if check_every and engine.step_index % check_every == 0:
            engine.check()
        if on_progress is not None and engine.step_index % progress_every == 0:
            on_progress(Progress(engine.step_index, _finished(engine), len(requests)))
    engine.check_drained()
    if on_progress is not None:
        on_progress(Progress(engine.step_index, _finished(engine), len(requests)))
    elapsed = time.perf_counter() - started
    rate = engine.step_index / elapsed if elapsed > 0 else 0.0
    return RunTiming(wall_seconds=round(elapsed, 3), steps_per_second=round(rate, 1))
