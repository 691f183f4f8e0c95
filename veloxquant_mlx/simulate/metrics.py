"""Measurements taken while a simulation runs, and how they are summarised.

The engine feeds a :class:`Recorder` one :class:`StepSample` per simulated
step (pool occupancy, fragmentation, wasted token slots, queue and batch
sizes) and one number per request event (queue wait on first admission,
end-to-end latency on completion). :func:`summarize` turns a series into a
:class:`Distribution` (min, mean, median, p95, max) for the report.

Percentiles use the nearest-rank method (the smallest sample such that at
least p% of samples are at or below it), so every reported p95 is a value
that actually occurred. The median is the usual midpoint median. An empty
series (no request completed, say) has no summary: ``None``, ``null`` in
JSON and a dash in the table, never a figure of 0 that no sample gave.

Complexity: recording is O(1) amortised per sample; :func:`summarize` is
O(n log n) in the series length. Memory is O(steps + requests).
Thread safety: a :class:`Recorder` is owned by one engine and is not
synchronised; the other values here are immutable.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

DECIMALS = 6  # figures are rounded so that reports stay readable and diff cleanly


@dataclass(frozen=True)
class Distribution:
    """Summary of a non-empty series of samples.

    Invariant: ``count >= 1``; ``min <= median <= p95 <= max`` and
    ``min <= mean <= max``.
    """

    min: float
    mean: float
    median: float
    p95: float
    max: float
    count: int  # samples summarised


def percentile(ordered: Sequence[float], percent: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence.

    Args:
        ordered: Samples sorted in ascending order.
        percent: In ``0 .. 100``.

    Returns:
        The smallest sample with at least ``percent`` % of samples at or below it.
    """
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: Sequence[float]) -> Distribution | None:
    """Summarise ``samples`` (any order) as a :class:`Distribution`; ``None`` if empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return Distribution(
        min=round(float(ordered[0]), DECIMALS),
        mean=round(math.fsum(ordered) / len(ordered), DECIMALS),
        median=round(float(statistics.median(ordered)), DECIMALS),
        p95=round(float(percentile(ordered, 95)), DECIMALS),
        max=round(float(ordered[-1]), DECIMALS),
        count=len(ordered),
    )


@dataclass(frozen=True)
class StepSample:
    """The state of the pool and the engine at the end of one step."""

    blocks_in_use: int  # checked-out blocks, as the pool reports them
    fragmentation: float  # pool's fragmentation(): partly-filled blocks / all blocks
    wasted_slots: int  # allocated token slots (blocks * block_size) holding no token
    queue_len: int  # requests waiting for admission
    running: int  # requests holding blocks (the decode batch)


@dataclass
class Recorder:
    """Accumulates per-step samples and per-request timings for one run.

    Invariant: every series grows by exactly one item per recorded
    step (the ``StepSample`` fields) or per request event (lengths at
    arrival, waits, latencies).
    """

    # Typed arrays: 8 bytes a sample, so a million-step run stays small.
    blocks_in_use: array[int] = field(default_factory=lambda: array("q"))
    fragmentation: array[float] = field(default_factory=lambda: array("d"))
    # Floats: with blocks near the largest size a slot count passes 2**63 (its
    # distribution is in floats anyway).
    wasted_slots: array[float] = field(default_factory=lambda: array("d"))
    queue_len: array[int] = field(default_factory=lambda: array("q"))
    running: array[int] = field(default_factory=lambda: array("q"))
    queue_waits: array[int] = field(default_factory=lambda: array("q"))  # at first admission
    latencies: array[int] = field(default_factory=lambda: array("q"))  # arrival to completion
    prompt_lens: array[int] = field(default_factory=lambda: array("q"))  # per arrival
    decode_lens: array[int] = field(default_factory=lambda: array("q"))  # per arrival, as drawn

    def record_step(self, sample: StepSample) -> None:
        """Append one step's sample to every per-step series."""
        self.blocks_in_use.append(sample.blocks_in_use)
        self.fragmentation.append(sample.fragmentation)
        self.wasted_slots.append(sample.wasted_slots)
        self.queue_len.append(sample.queue_len)
        self.running.append(sample.running)

    def record_arrival(self, prompt_len: int, decode_len: int) -> None:
        """Note a request's lengths as drawn (after the context window's cap)."""
        self.prompt_lens.append(prompt_len)
        self.decode_lens.append(decode_len)

    def record_admission(self, waited_steps: int) -> None:
        """Note a request's first admission after ``waited_steps`` in the queue."""
        self.queue_waits.append(waited_steps)

    def record_completion(self, latency_steps: int) -> None:
        """Note a request completing ``latency_steps`` after it arrived."""
        self.latencies.append(latency_steps)
