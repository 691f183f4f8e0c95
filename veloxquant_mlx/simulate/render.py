"""Terminal output of the simulator: the live progress bar and the final table.

:func:`live_progress` is a context manager that shows a ``rich`` progress bar
(requests finished out of the workload, plus the current step) and yields the
callback that :func:`run_workload` calls; on a stream that is not a terminal
(a CI log) it writes a line at most every 10 s instead (:func:`progress_lines`),
and when disabled it yields a no-op and draws nothing. :func:`print_report`
renders a :class:`SimulationReport` as two tables (the single-valued sizing
figures, then every per-step series with its min/mean/median/p95/max)
followed by the pool's Prometheus exposition text.

Complexity: O(1) per progress update; O(size of the report) to print it.
Thread safety: each call owns the console it writes to; do not share a live
progress bar between threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table

from veloxquant_mlx.commandline.progress import ProgressThrottle
from veloxquant_mlx.simulate.metrics import Distribution
from veloxquant_mlx.simulate.report import SimulationReport
from veloxquant_mlx.simulate.runner import Progress, ProgressCallback


def _ignore_progress(progress: Progress) -> None:
    del progress


def progress_lines(stream: TextIO) -> ProgressCallback:
    """A callback that writes a progress line to ``stream`` at most every
    ``PROGRESS_INTERVAL_S`` seconds: the progress of a run whose stderr is a log."""
    throttle = ProgressThrottle()
    throttle.clock_every = 1  # a callback comes every 50 steps, not every step

    def line(progress: Progress) -> None:
        if throttle.due():
            print(
                f"simulate: step {progress.step:,}, {progress.finished:,} of "
                f"{progress.total:,} requests, {throttle.seconds():.0f} s",
                file=stream,
                flush=True,
            )

    return line


@contextmanager
def live_progress(total: int, *, enabled: bool, stream: TextIO) -> Iterator[ProgressCallback]:
    """Show a progress bar on ``stream`` while the block runs, if ``enabled``.

    Args:
        total: Requests in the workload (the bar's 100%).
        enabled: Draw the bar if ``stream`` is a terminal, else write a line now
            and then (:func:`progress_lines`); otherwise yield a callback that
            does nothing.
        stream: Where to draw (normally stderr, so that stdout stays clean).

    Yields:
        The callback to pass to :func:`run_workload` as ``on_progress``.
    """
    if not enabled:
        yield _ignore_progress
        return
    if not stream.isatty():
        yield progress_lines(stream)
        return
    bar = RichProgress(
        TextColumn("[bold]simulate[/] step {task.fields[step]:>7,}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
    )
    task = bar.add_task("simulate", total=total, step=0)

    def update(progress: Progress) -> None:
        bar.update(task, completed=progress.finished, step=progress.step)

    with bar:
        yield update


def _count(value: int) -> str:
    return f"{value:,}"


def _pool_layout(report: SimulationReport) -> str:
    config = report.pool_config
    layout = "separate K/V" if config["separate_kv"] else "shared K/V"
    growth = "growable" if config["grow_on_exhaustion"] else "fixed"
    return f"{config['block_size']} tokens/block, {layout}, {growth}"


def _peak(blocks: int, percent: float | None) -> str:
    if percent is None:
        return _count(blocks)
    return f"{_count(blocks)} ({percent:.1f}% of configured pool)"


def _pool_rows(report: SimulationReport) -> list[tuple[str, str]]:
    pool = report.pool
    size = _count(pool.initial_blocks)
    if pool.grown:
        size += f" → {_count(pool.final_blocks)} (+{_count(pool.grown)} grown)"
    return [
        ("pool size (blocks)", size),
        ("layout", _pool_layout(report)),
        (
            "peak blocks in use (within a step)",
            _peak(pool.peak_blocks_in_use, pool.peak_pct_of_pool),
        ),
        ("exhaustion events", _count(pool.exhausted)),
        ("reuse ratio (reused / handed out)", f"{pool.reuse_ratio:.3f}"),
        ("blocks handed out / reused", f"{_count(pool.blocks_handed_out)} / {_count(pool.reused)}"),
        (
            "wasted token slots",
            f"{report.wasted_slots.mean_pct_of_allocated:.2f}% of allocated slots",
        ),
    ]


def _request_rows(report: SimulationReport) -> list[tuple[str, str]]:
    requests = report.requests
    return [
        ("requests", _count(requests.total)),
        ("mean prompt / generated length", _mean_lengths(report)),
        (
            "completed / aborted / rejected",
            (
                f"{_count(requests.completed)} / {_count(requests.aborted)} / "
                f"{_count(requests.rejected)}"
            ),
        ),
        ("admissions delayed (queued)", _count(requests.delayed_admissions)),
        ("admission attempts refused", _count(requests.admission_failures)),
        ("preemptions", _count(requests.preemptions)),
    ]


def _mean_lengths(report: SimulationReport) -> str:
    """The lengths' means as drawn beside those asked: the context window caps the tail."""
    prompt, decode = report.requests.prompt_len, report.requests.decode_len
    asked = f"(asked {report.workload['prompt_mean']:,} / {report.workload['decode_mean']:,})"
    if prompt is None or decode is None:
        return f"— {asked}"
    return f"{prompt.mean:,.1f} / {decode.mean:,.1f} {asked}"


def _throughput_rows(report: SimulationReport) -> list[tuple[str, str]]:
    throughput = report.throughput
    drain = throughput.steps - throughput.arrival_steps
    return [
        (
            "steps (arrival + drain)",
            f"{_count(throughput.steps)} ({_count(throughput.arrival_steps)} + {_count(drain)})",
        ),
        ("decode tokens per step (drain in)", f"{throughput.decode_tokens_per_step:,.2f}"),
        ("completed per 1k steps (drain in)", f"{throughput.completed_per_1k_steps:,.1f}"),
        (
            "prefill / recomputed tokens",
            f"{_count(throughput.prefill_tokens)} / {_count(throughput.recomputed_tokens)}",
        ),
        (
            "wall time",
            f"{report.timings.wall_seconds:.2f} s ({report.timings.steps_per_second:,.0f} steps/s)",
        ),
    ]


def _caption(report: SimulationReport) -> str | None:
    """Why the peak may be below the demand: the pool refused an allocation at its limit."""
    if not report.pool.exhausted:
        return None
    if not report.pool_config["grow_on_exhaustion"]:
        return "Peak capped by the pool size; rerun with --grow for unconstrained demand."
    if report.pool_config["max_blocks"] is not None:
        return "Peak capped by --max-blocks; raise it, or leave it out, for unconstrained demand."
    return None


def figures_table(report: SimulationReport) -> Table:
    """The single-valued sizing figures of ``report``, in three sections."""
    table = Table(title=f"Block pool simulation (seed {report.seed})", caption=_caption(report))
    table.add_column("figure", style="bold")
    table.add_column("value", overflow="fold")  # wrapped, never cut
    sections = (
        ("Pool", _pool_rows(report)),
        ("Requests", _request_rows(report)),
        ("Throughput", _throughput_rows(report)),
    )
    for index, (title, rows) in enumerate(sections):
        if index:
            table.add_section()
        table.add_row(f"[underline]{title}[/]", "")
        for figure, value in rows:
            table.add_row(figure, value)
    return table


def _distribution_rows(report: SimulationReport) -> list[tuple[str, Distribution | None, int]]:
    """(label, distribution, decimals) for every series the report summarises."""
    return [
        ("blocks in use", report.pool.blocks_in_use, 0),
        ("fragmentation ¹", report.fragmentation, 3),
        ("wasted token slots", report.wasted_slots.slots, 0),
        ("queue length", report.requests.queue_len, 0),
        ("batch size (running)", report.throughput.batch_size, 0),
        ("queue wait, steps ²", report.requests.queue_wait_steps, 0),
        ("latency, steps ³", report.requests.latency_steps, 0),
        ("prompt length ⁴", report.requests.prompt_len, 0),
        ("generated length ⁴", report.requests.decode_len, 0),
    ]


def _summary_cells(distribution: Distribution | None, decimals: int) -> list[str]:
    """min, mean, median, p95, max and the sample count; dashes for a series with no sample."""
    if distribution is None:
        return ["—"] * 5 + ["0"]
    values = (
        distribution.min,
        distribution.mean,
        distribution.median,
        distribution.p95,
        distribution.max,
    )
    mean_decimals = max(decimals, 1)
    cells = [
        f"{value:,.{mean_decimals if column == 1 else decimals}f}"
        for column, value in enumerate(values)
    ]
    return [*cells, f"{distribution.count:,}"]


def distributions_table(report: SimulationReport) -> Table:
    """Every sampled series of ``report`` with its min, mean, median, p95, max and count."""
    table = Table(
        title="Over the run (sampled at the end of every step)",
        caption="¹ partly filled blocks over all the pool's blocks (pool.fragmentation()), "
        "so a larger pool shows less; the wasted token slots are the requests' own waste; "
        "² per admitted request, arrival to first admission; "
        "³ per completed request, arrival to completion; "
        "⁴ per request as drawn, after --max-seq-len's cap (aborts stop some earlier)",
    )
    table.add_column("series", style="bold", overflow="fold")
    for column in ("min", "mean", "median", "p95", "max", "samples"):
        table.add_column(column, justify="right", overflow="fold")  # wrapped, never cut
    for label, distribution, decimals in _distribution_rows(report):
        table.add_row(label, *_summary_cells(distribution, decimals))
    return table


def print_report(report: SimulationReport, stream: TextIO) -> None:
    """Print the sizing tables, then the Prometheus text of ``report`` verbatim."""
    console = Console(file=stream)
    console.print(figures_table(report))
    console.print(distributions_table(report))
    console.rule("Prometheus exposition (pool.stats.to_prometheus())")
    # Written raw: a console would wrap long HELP lines and break the format.
    stream.write(report.prometheus)
