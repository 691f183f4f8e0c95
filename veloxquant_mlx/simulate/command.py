"""The ``veloxquant-mlx simulate`` subcommand: options in, report out.

:func:`run` builds the pool and the workload from parsed options, runs the
simulation with progress on stderr unless ``--no-progress`` (a bar on a
terminal, else a line every 10 s for a log), and prints either the sizing table with the
Prometheus text or, with ``--json``, one JSON document on stdout.

Exit codes: 0 on success; 1 if an invariant check failed (the message, on
stderr, names the step and the broken invariant); 2 if the run ran out of
memory (one line naming the step and the pool's size: options the memory
estimate let through, such as a pool that grows without a cap). Rejected
requests (too large for the pool even alone) get a warning line on stderr,
status still 0: the report is what was asked for. Usage errors exit with 2
before :func:`run` is called (see :mod:`veloxquant_mlx.cli`).

Complexity: that of the simulation, O(steps + requests) pool calls.
Thread safety: runs on the calling thread; writes to ``sys.stdout``/``sys.stderr``.
"""

from __future__ import annotations

import argparse
import json
import sys

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.simulate.engine import (
    ServingEngine,
    SimulationInvariantError,
    SimulationOutOfMemoryError,
)
from veloxquant_mlx.simulate.options import (
    DEFAULT_DURATION,
    pool_config_from,
    workload_config_from,
)
from veloxquant_mlx.simulate.render import live_progress, print_report
from veloxquant_mlx.simulate.report import (
    ConfigValue,
    SimulationReport,
    build_report,
    report_to_json,
)
from veloxquant_mlx.simulate.runner import run_workload
from veloxquant_mlx.simulate.workload import Request, generate_workload

SUMMARY = "simulate a request stream through a block pool, to size the pool"

DESCRIPTION = """\
Push a seeded stream of requests through a BlockPoolAllocator the way a
continuous-batching server does, and report what is needed to size the pool.

A step is one decode iteration. Requests arrive as a Poisson process, are
admitted first-come first-served when their prompt's blocks fit on both the
K and the V stream (otherwise they wait in the queue), grow by one block per
stream whenever their last block fills, and free all their blocks when they
complete or their client aborts. When a running request cannot grow, the most
recently admitted request is preempted (its blocks freed, its tokens
recomputed on re-admission). A request that cannot fit even in an otherwise
empty pool is rejected.

Prompt lengths are lognormal by default (a long tail of huge prompts), decode
lengths geometric (a constant chance of stopping at each token). Output is
deterministic for a seed, apart from the timings (the "timings" key of
--json, the wall-time row of the table).

Exit status: 0 ok (requests too large for the pool even alone, or no request
at all, get a warning line), 1 an invariant check failed, 2 bad input (also options that run the
machine out of memory), 130 interrupted.
"""


def _run_options(args: argparse.Namespace, arrival_steps: int) -> dict[str, ConfigValue]:
    return {
        "duration": arrival_steps,
        "requests": args.requests,
        "check_invariants_every": args.check_invariants,
    }


def _workload(args: argparse.Namespace) -> tuple[list[Request], int]:
    """The requests to simulate and the length of the arrival window, in steps."""
    config = workload_config_from(args)
    if args.requests is not None:
        requests = generate_workload(config, args.seed, max_requests=args.requests)
        return requests, requests[-1].arrival_step + 1
    duration = args.duration if args.duration is not None else DEFAULT_DURATION
    return generate_workload(config, args.seed, until_step=duration), duration


def simulate(args: argparse.Namespace, *, show_progress: bool) -> SimulationReport:
    """Run the simulation the options describe and return its report.

    Raises:
        SimulationInvariantError: An invariant check failed.
        SimulationOutOfMemoryError: The machine ran out of memory.
    """
    requests, arrival_steps = _workload(args)
    engine = ServingEngine(BlockPoolAllocator(pool_config_from(args)))
    with live_progress(len(requests), enabled=show_progress, stream=sys.stderr) as progress:
        try:
            timing = run_workload(
                engine,
                requests,
                min_steps=arrival_steps,
                check_every=args.check_invariants,
                on_progress=progress,
            )
        except MemoryError:
            raise SimulationOutOfMemoryError(
                engine.step_index, engine.pool.stats.n_blocks
            ) from None
    return build_report(
        engine,
        seed=args.seed,
        workload=workload_config_from(args),
        run=_run_options(args, arrival_steps),
        total_requests=len(requests),
        arrival_steps=arrival_steps,
        timing=timing,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand; returns the process exit code."""
    show_progress = not args.no_progress
    try:
        report = simulate(args, show_progress=show_progress)
    except SimulationInvariantError as error:
        print(f"veloxquant-mlx simulate: error: {error}", file=sys.stderr)
        return 1
    except SimulationOutOfMemoryError as error:
        print(f"veloxquant-mlx simulate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report_to_json(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report, sys.stdout)
    for warning in (idle_warning(report), rejection_warning(report)):
        if warning is not None:
            print(f"veloxquant-mlx simulate: warning: {warning}", file=sys.stderr)
    return 0


def idle_warning(report: SimulationReport) -> str | None:
    """One line for stderr when no request arrived, so an idle pool's zeros are not taken
    for a sizing; ``None`` when some did."""
    if report.requests.total:
        return None
    steps, rate = report.throughput.arrival_steps, report.workload["arrival_rate"]
    return (
        f"no request arrived in {steps:,} steps at --arrival-rate {rate:g}: the figures "
        "are those of an idle pool; raise --duration or --arrival-rate"
    )


def rejection_warning(report: SimulationReport) -> str | None:
    """One line for stderr when requests were rejected (they could not fit in the pool
    even alone), so a pool sized too small is not missed; ``None`` when none were."""
    figures, config = report.requests, report.pool_config
    if not figures.rejected:
        return None
    cap = config["max_blocks"] if config["grow_on_exhaustion"] else config["n_blocks"]
    return (
        f"{figures.rejected} of {figures.total} requests were rejected: each needs more "
        f"blocks than the pool's {cap} can hold with no other request in it; "
        "raise --n-blocks, or --max-blocks with --grow"
    )
