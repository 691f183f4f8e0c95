"""The figures a serving engineer needs to size a block pool, from one run.

:func:`build_report` condenses a finished :class:`ServingEngine` (its pool's
counters, its own event counts and its recorded samples) into an immutable
:class:`SimulationReport`; :func:`report_to_json` turns that into plain JSON
data. Everything in a report is a pure function of the seed and the options,
except :attr:`SimulationReport.timings`, which is kept apart so that
deterministic outputs can be compared with it removed.

Definitions:

* *peak_pct_of_pool*: peak blocks in use over the configured pool size
  (``--n-blocks``), in percent; above 100 when a growing pool had to grow,
  ``None`` for a pool configured with no blocks.
* *reuse_ratio*: the pool's ``n_reused`` over the blocks handed out by
  successful allocations (0 when none were).
* *wasted slots*: token slots in checked-out blocks that hold no token,
  ``blocks_in_use * block_size - tokens held`` (both streams), per step;
  ``mean_pct_of_allocated`` is the run's total waste over its total allocated
  slots.
* *decode_tokens_per_step*: generated tokens over all steps, drain included.
* a series (``Distribution``) is ``None`` when it has no sample: no request
  was admitted, or none completed.
* *prompt_len*, *decode_len*: the lengths the requests were drawn with,
  after the context window's cap (``--max-seq-len``), so their means can be
  below the means asked for.

Complexity: O(steps log steps) for the percentiles.
Thread safety: pure functions over immutable values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.simulate.engine import ServingEngine
from veloxquant_mlx.simulate.metrics import DECIMALS, Distribution, summarize
from veloxquant_mlx.simulate.runner import RunTiming
from veloxquant_mlx.simulate.workload import WorkloadConfig

#: Bump when a key of report_to_json changes meaning or goes away. 2: a series with no
#: sample is null (it was all zeros), and every series has its ``count``.
SCHEMA_VERSION = 2

ConfigValue = int | float | str | bool | None


@dataclass(frozen=True)
class PoolFigures:
    """How big the pool had to be and how it was used."""

    initial_blocks: int  # PoolConfig.n_blocks
    final_blocks: int  # stats.n_blocks at the end (initial + grown)
    peak_blocks_in_use: int
    peak_pct_of_pool: float | None  # peak over initial_blocks, percent
    blocks_in_use: Distribution | None  # sampled at the end of every step
    blocks_in_use_at_end: int  # 0 unless blocks leaked
    allocations: int  # successful allocate() calls
    frees: int  # free()/free_all() calls that freed something
    exhausted: int  # allocate() calls that raised BlockPoolExhaustedError
    grown: int  # blocks added by growth
    reused: int  # handed-out blocks that had been handed out before
    blocks_handed_out: int
    reuse_ratio: float  # reused / blocks_handed_out


@dataclass(frozen=True)
class RequestFigures:
    """What happened to the requests. ``completed + aborted + rejected == total``."""

    total: int
    completed: int
    aborted: int
    rejected: int  # could not fit in the pool even alone
    preemptions: int  # evictions to let an older request grow
    admission_failures: int  # admission attempts refused for lack of blocks
    delayed_admissions: int  # requests first admitted after their arrival step
    queue_len: Distribution | None  # waiting requests, per step
    queue_wait_steps: Distribution | None  # arrival to first admission, per admitted request
    latency_steps: Distribution | None  # arrival to completion, per completed request
    prompt_len: Distribution | None  # per arrived request, after the context window's cap
    decode_len: Distribution | None  # as prompt_len: tokens to generate, aborts not cut


@dataclass(frozen=True)
class WasteFigures:
    """Allocated token slots that hold no token (internal fragmentation)."""

    slots: Distribution | None  # per step; .max is the peak
    mean_pct_of_allocated: float


@dataclass(frozen=True)
class ThroughputFigures:
    """Work done per simulated step (a step is one decode iteration)."""

    steps: int  # all steps, drain included
    arrival_steps: int  # steps during which requests could arrive
    decode_tokens: int
    prefill_tokens: int
    recomputed_tokens: int  # prefill redone after preemption
    decode_tokens_per_step: float
    completed_per_1k_steps: float
    batch_size: Distribution | None  # running requests, per step


@dataclass(frozen=True)
class SimulationReport:
    """Everything one run produced. Only ``timings`` varies between identical runs."""

    schema_version: int
    seed: int
    pool_config: dict[str, ConfigValue]
    workload: dict[str, ConfigValue]
    run: dict[str, ConfigValue]  # how long the run was and how it was checked
    pool: PoolFigures
    requests: RequestFigures
    fragmentation: Distribution | None  # pool.fragmentation(), per step
    wasted_slots: WasteFigures
    throughput: ThroughputFigures
    prometheus: str  # pool.stats.to_prometheus() at the end
    timings: RunTiming


def _ratio(numerator: float, denominator: float, scale: float = 1.0) -> float:
    return round(scale * numerator / denominator, DECIMALS) if denominator else 0.0


def _percent_of_pool(blocks: int, config: PoolConfig) -> float | None:
    return _ratio(blocks, config.n_blocks, 100) if config.n_blocks else None


def pool_config_dict(config: PoolConfig) -> dict[str, ConfigValue]:
    """The pool configuration as JSON-ready data."""
    return {
        "block_size": config.block_size,
        "n_blocks": config.n_blocks,
        "separate_kv": config.separate_kv,
        "grow_on_exhaustion": config.grow_on_exhaustion,
        "max_blocks": config.max_blocks,
    }


def _pool_figures(engine: ServingEngine) -> PoolFigures:
    stats = engine.pool.stats
    handed_out = engine.counters.blocks_handed_out
    return PoolFigures(
        initial_blocks=engine.pool.config.n_blocks,
        final_blocks=stats.n_blocks,
        peak_blocks_in_use=stats.peak_blocks_in_use,
        peak_pct_of_pool=_percent_of_pool(stats.peak_blocks_in_use, engine.pool.config),
        blocks_in_use=summarize(engine.recorder.blocks_in_use),
        blocks_in_use_at_end=stats.blocks_in_use(),
        allocations=stats.n_allocations,
        frees=stats.n_frees,
        exhausted=stats.n_exhausted,
        grown=stats.n_grown,
        reused=stats.n_reused,
        blocks_handed_out=handed_out,
        reuse_ratio=_ratio(stats.n_reused, handed_out),
    )


def _request_figures(engine: ServingEngine, total: int) -> RequestFigures:
    counters = engine.counters
    return RequestFigures(
        total=total,
        completed=counters.completed,
        aborted=counters.aborted,
        rejected=counters.rejected,
        preemptions=counters.preemptions,
        admission_failures=counters.admission_failures,
        delayed_admissions=counters.delayed_admissions,
        queue_len=summarize(engine.recorder.queue_len),
        queue_wait_steps=summarize(engine.recorder.queue_waits),
        latency_steps=summarize(engine.recorder.latencies),
        prompt_len=summarize(engine.recorder.prompt_lens),
        decode_len=summarize(engine.recorder.decode_lens),
    )


def _waste_figures(engine: ServingEngine) -> WasteFigures:
    recorder = engine.recorder
    allocated = math.fsum(recorder.blocks_in_use) * engine.block_size
    return WasteFigures(
        slots=summarize(recorder.wasted_slots),
        mean_pct_of_allocated=_ratio(math.fsum(recorder.wasted_slots), allocated, 100),
    )


def _throughput_figures(engine: ServingEngine, arrival_steps: int) -> ThroughputFigures:
    counters = engine.counters
    steps = engine.step_index
    return ThroughputFigures(
        steps=steps,
        arrival_steps=arrival_steps,
        decode_tokens=counters.decode_tokens,
        prefill_tokens=counters.prefill_tokens,
        recomputed_tokens=counters.recomputed_tokens,
        decode_tokens_per_step=_ratio(counters.decode_tokens, steps),
        completed_per_1k_steps=_ratio(counters.completed, steps, 1000),
        batch_size=summarize(engine.recorder.running),
    )


def build_report(
    engine: ServingEngine,
    *,
    seed: int,
    workload: WorkloadConfig,
    run: dict[str, ConfigValue],
    total_requests: int,
    arrival_steps: int,
    timing: RunTiming,
) -> SimulationReport:
    """Condense a drained engine into a report.

    Args:
        engine: The engine after :func:`run_workload` returned.
        seed: The workload's seed.
        workload: The request mix the workload was drawn from.
        run: The run options, echoed into the report as given.
        total_requests: How many requests the workload had.
        arrival_steps: Length of the arrival window, in steps.
        timing: What :func:`run_workload` returned.
    """
    return SimulationReport(
        schema_version=SCHEMA_VERSION,
        seed=seed,
        pool_config=pool_config_dict(engine.pool.config),
        workload=dataclasses.asdict(workload),
        run=run,
        pool=_pool_figures(engine),
        requests=_request_figures(engine, total_requests),
        fragmentation=summarize(engine.recorder.fragmentation),
        wasted_slots=_waste_figures(engine),
        throughput=_throughput_figures(engine, arrival_steps),
        prometheus=engine.pool.stats.to_prometheus(),
        timings=timing,
    )


def report_to_json(report: SimulationReport) -> dict[str, object]:
    """The report as JSON-ready data, keys in a stable order; timings last."""
    return dataclasses.asdict(report)
