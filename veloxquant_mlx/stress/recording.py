"""Making a call and recording it: the one place where invoke and return times are taken.

:func:`record_call` runs a call, takes ``time.perf_counter_ns()`` just before
and just after it (so the recorded interval contains the call), and appends
the :class:`~veloxquant_mlx.stress.history.Event` with what it returned (as
the plain value the history keeps: block ids, a stats tuple, parsed
Prometheus samples...) or the class of what it raised. The workers, the
runner's observations at barriers and the conservation audit all record
through it.

Complexity: O(1) plus the call and its value's conversion. Thread safety:
each thread records into its own :class:`~veloxquant_mlx.stress.history.ThreadRecorder`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Final, Generic, TypeVar

from veloxquant_mlx.stress.history import Call, Raised, Returned, ThreadRecorder

__all__ = [
    "EXPECTED_ERRORS",
    "Invoked",
    "parse_prometheus",
    "record_call",
    "stats_tuple_of",
]

T = TypeVar("T")

#: Errors the pool raises on purpose; any other is recorded with its message.
EXPECTED_ERRORS: Final = frozenset(
    {
        "TypeError",
        "ValueError",
        "BlockPoolExhaustedError",
        "OwnerAlreadyActiveError",
        "InvalidFreeError",
    }
)


def stats_tuple_of(stats: Any) -> tuple[int, ...]:
    """An ``AllocationStats`` as a tuple in ``history.STATS_FIELDS`` order."""
    return (
        stats.n_blocks,
        stats.n_allocations,
        stats.n_frees,
        stats.n_reused,
        stats.n_exhausted,
        stats.n_grown,
        stats.n_retired,
        stats.peak_blocks_in_use,
        stats.blocks_in_use(),
        stats._fragmented_count,
    )


def parse_prometheus(text: str) -> tuple[tuple[str, float], ...]:
    """The ``(sample, value)`` pairs of exposition text, sorted; with ``prometheus_client``'s
    parser when it is installed, which also rejects malformed text."""
    try:
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    except ImportError:  # pragma: no cover - prometheus_client is a dev dependency
        samples = [line.split() for line in text.splitlines() if line and line[0] != "#"]
        return tuple(sorted((name, float(value)) for name, value in samples))
    return tuple(
        sorted(
            (sample.name, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )
    )


@dataclass(frozen=True, slots=True)
class Invoked(Generic[T]):
    """A recorded call's op id and its result, or the exception it raised."""

    op_id: int
    result: T | Exception


def record_call(
    recorder: ThreadRecorder, call: Call, action: Callable[[], T], value_of: Callable[[T], object]
) -> Invoked[T]:
    """Make a call through ``action`` and record it, with ``value_of(result)`` as its value.

    The invocation time is taken just before ``action`` runs and the return
    time just after, so the recorded interval contains the call.
    """
    op_id = recorder.next_op_id()
    start = perf_counter_ns()
    try:
        result = action()
    except Exception as error:
        end = perf_counter_ns()
        kind = type(error).__name__
        message = "" if kind in EXPECTED_ERRORS else str(error)[:300]
        recorder.add(op_id, call, start, end, Raised(kind, message))
        return Invoked(op_id, error)
    end = perf_counter_ns()
    recorder.add(op_id, call, start, end, Returned(value_of(result)))
    return Invoked(op_id, result)
