"""Capacity-planning simulator for the KV-cache block pool.

Pushes a seeded stream of requests through a
:class:`~veloxquant_mlx.memory.block_pool.BlockPoolAllocator` the way a
continuous-batching server would, and reports what a serving engineer needs
to size the pool: peak occupancy, exhaustion, queueing and preemption,
fragmentation and wasted token slots over time, block reuse, throughput.
Used by ``veloxquant-mlx simulate``; usable as a library:

    requests = generate_workload(WorkloadConfig(), seed=0, until_step=1000)
    engine = ServingEngine(BlockPoolAllocator(PoolConfig(n_blocks=512)))
    timing = run_workload(engine, requests, min_steps=1000)
    report = build_report(engine, seed=0, workload=WorkloadConfig(), run={},
                          total_requests=len(requests), arrival_steps=1000,
                          timing=timing)

One module per concept: :mod:`.workload` (the request stream),
:mod:`.engine` (the scheduler and its pool policies), :mod:`.runner` (the
step loop), :mod:`.metrics` (samples and percentiles), :mod:`.report` (the
figures), :mod:`.render` (terminal output), :mod:`.options` and
:mod:`.command` (the command line).

Complexity: see each module; a run is O(steps + requests) pool calls.
Thread safety: a simulation is single-threaded and owns its pool.
"""

from veloxquant_mlx.simulate.engine import (
    EngineCounters,
    ServingEngine,
    SimulationInvariantError,
)
from veloxquant_mlx.simulate.metrics import Distribution, Recorder, summarize
from veloxquant_mlx.simulate.report import SimulationReport, build_report, report_to_json
from veloxquant_mlx.simulate.runner import Progress, RunTiming, run_workload
from veloxquant_mlx.simulate.workload import Request, WorkloadConfig, generate_workload

__all__ = [
    "Distribution",
    "EngineCounters",
    "Progress",
    "Recorder",
    "Request",
    "RunTiming",
    "ServingEngine",
    "SimulationInvariantError",
    "SimulationReport",
    "WorkloadConfig",
    "build_report",
    "generate_workload",
    "report_to_json",
    "run_workload",
    "summarize",
]
