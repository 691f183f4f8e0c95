"""Behaviour of the capacity-planning simulator (``veloxquant_mlx.simulate``).

The workload generator, the engine's use of the pool (admission, growth with
``mark_used``, completion, abort, preemption, rejection), conservation of
blocks, the report's figures and their consistency with the pool's own
counters, and loud failure when an invariant breaks.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.simulate import (
    Request,
    ServingEngine,
    SimulationInvariantError,
    SimulationReport,
    WorkloadConfig,
    build_report,
    generate_workload,
    run_workload,
    summarize,
)
from veloxquant_mlx.simulate.metrics import Distribution, percentile
from veloxquant_mlx.simulate.runner import Progress, RunTiming
from veloxquant_mlx.simulate.workload import MAX_SIGMA, DecodeDistribution, PromptDistribution

SMALL_MIX = WorkloadConfig(arrival_rate=0.3, prompt_mean=40, decode_mean=24, max_seq_len=512)


def make_engine(
    block_size: int = 8,
    n_blocks: int = 64,
    *,
    separate_kv: bool = True,
    grow: bool = False,
    max_blocks: int | None = None,
) -> ServingEngine:
    config = PoolConfig(
        block_size=block_size,
        n_blocks=n_blocks,
        separate_kv=separate_kv,
        grow_on_exhaustion=grow,
        max_blocks=max_blocks,
    )
    return ServingEngine(BlockPoolAllocator(config))


def simulate(
    engine: ServingEngine,
    requests: list[Request],
    *,
    seed: int = 0,
    mix: WorkloadConfig = SMALL_MIX,
    check_every: int = 0,
) -> SimulationReport:
    """Run ``requests`` through ``engine`` and build the report."""
    timing = run_workload(engine, requests, check_every=check_every)
    return build_report(
        engine,
        seed=seed,
        workload=mix,
        run={},
        total_requests=len(requests),
        arrival_steps=requests[-1].arrival_step + 1 if requests else 0,
        timing=timing,
    )


def present(summary: Distribution | None) -> Distribution:
    """``summary``, which must summarise at least one sample."""
    assert summary is not None, "a series with no sample"
    return summary


def request(
    request_id: int,
    prompt_len: int,
    decode_len: int,
    *,
    arrival_step: int = 0,
    abort_after: int | None = None,
) -> Request:
    return Request(request_id, arrival_step, prompt_len, decode_len, abort_after)


def assert_every_block_free(engine: ServingEngine) -> None:
    pool = engine.pool
    stats = pool.stats
    assert stats.blocks_in_use() == 0
    streams = ("k", "v") if pool.config.separate_kv else ("kv",)
    assert sum(pool.n_free(stream) for stream in streams) == stats.n_blocks
    pool.check_invariants()


def report_without_timings(report: SimulationReport) -> SimulationReport:
    return dataclasses.replace(report, timings=RunTiming(wall_seconds=0, steps_per_second=0))


def fills(engine: ServingEngine, owner: int, stream: str) -> list[int]:
    """``n_used`` of ``owner``'s blocks on ``stream``, in allocation order."""
    return [block.n_used for block in engine.pool.blocks_for(owner) if block.stream == stream]


# -- workload -------------------------------------------------------------------


def test_same_seed_gives_the_same_workload() -> None:
    first = generate_workload(SMALL_MIX, 3, until_step=500)
    second = generate_workload(SMALL_MIX, 3, until_step=500)
    assert first == second
    assert first != generate_workload(SMALL_MIX, 4, until_step=500)


def test_abort_fraction_changes_only_abort_points() -> None:
    calm = generate_workload(dataclasses.replace(SMALL_MIX, abort_fraction=0.0), 1, until_step=300)
    rough = generate_workload(dataclasses.replace(SMALL_MIX, abort_fraction=0.5), 1, until_step=300)
    strip = [dataclasses.replace(item, abort_after=None) for item in rough]
    assert strip == calm
    assert any(item.abort_after is not None for item in rough)


@given(
    seed=st.integers(min_value=0, max_value=2**32),
    prompt_dist=st.sampled_from(get_args(PromptDistribution)),
    decode_dist=st.sampled_from(get_args(DecodeDistribution)),
    max_seq_len=st.integers(min_value=2, max_value=300),
    abort_fraction=st.floats(min_value=0, max_value=1),
)
def test_workload_respects_every_bound(
    seed: int,
    prompt_dist: PromptDistribution,
    decode_dist: DecodeDistribution,
    max_seq_len: int,
    abort_fraction: float,
) -> None:
    mix = WorkloadConfig(
        arrival_rate=2.0,
        prompt_mean=100,
        prompt_dist=prompt_dist,
        decode_mean=50,
        decode_dist=decode_dist,
        abort_fraction=abort_fraction,
        max_seq_len=max_seq_len,
    )
    requests = generate_workload(mix, seed, until_step=20)
    assert [item.request_id for item in requests] == list(range(len(requests)))
    assert [item.arrival_step for item in requests] == sorted(
        item.arrival_step for item in requests
    )
    for item in requests:
        assert 0 <= item.arrival_step < 20
        assert item.prompt_len >= 1
        assert item.decode_len >= 1
        assert item.prompt_len + item.decode_len <= max_seq_len
        assert item.abort_after is None or 0 <= item.abort_after < item.decode_len


@pytest.mark.parametrize(
    ("prompt_dist", "decode_dist"),
    [("lognormal", "geometric"), ("uniform", "lognormal"), ("fixed", "fixed")],
)
def test_lengths_have_the_configured_means(
    prompt_dist: PromptDistribution, decode_dist: DecodeDistribution
) -> None:
    mix = WorkloadConfig(
        arrival_rate=1.0,
        prompt_mean=200,
        prompt_dist=prompt_dist,
        decode_mean=80,
        decode_dist=decode_dist,
        max_seq_len=100_000,
    )
    requests = generate_workload(mix, 0, max_requests=20_000)
    assert statistics.fmean(item.prompt_len for item in requests) == pytest.approx(200, rel=0.05)
    assert statistics.fmean(item.decode_len for item in requests) == pytest.approx(80, rel=0.05)


def test_arrivals_are_poisson_with_the_configured_rate() -> None:
    requests = generate_workload(WorkloadConfig(arrival_rate=0.5), 0, until_step=20_000)
    assert len(requests) == pytest.approx(10_000, rel=0.03)
    per_step = [0] * 20_000
    for item in requests:
        per_step[item.arrival_step] += 1
    # A Poisson count has variance equal to its mean.
    assert statistics.pvariance(per_step) == pytest.approx(0.5, rel=0.1)


def test_a_rate_so_small_that_no_request_arrives_gives_an_empty_workload() -> None:
    # The gap to the first arrival is inf: math.floor(inf) raised OverflowError.
    assert generate_workload(WorkloadConfig(arrival_rate=1e-309), 0, until_step=5) == []


def test_workload_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="until_step or max_requests"):
        generate_workload(SMALL_MIX, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("arrival_rate", 0.0, "arrival_rate must be > 0, got 0.0"),
        ("abort_fraction", 1.5, "abort_fraction must be between 0 and 1, got 1.5"),
        ("max_seq_len", 1, "max_seq_len must be >= 2, got 1"),
        ("prompt_dist", "pareto", "prompt_dist must be one of"),
        ("prompt_sigma", -0.5, "prompt_sigma must be between 0 and 10, got -0.5"),
        ("decode_sigma", 10.5, "decode_sigma must be between 0 and 10, got 10.5"),
    ],
)
def test_workload_config_rejects_bad_values(
    field: str,
    value: Any,  # deliberately of any type: the check under test is the runtime one
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(WorkloadConfig(), **{field: value})


@pytest.mark.parametrize("dist", ["prompt", "decode"])
def test_the_widest_lognormal_shape_still_draws_lengths_in_bounds(dist: str) -> None:
    lognormal = WorkloadConfig(prompt_dist="lognormal", decode_dist="lognormal")
    config = (
        dataclasses.replace(lognormal, prompt_sigma=MAX_SIGMA)
        if dist == "prompt"
        else dataclasses.replace(lognormal, decode_sigma=MAX_SIGMA)
    )
    requests = generate_workload(config, seed=3, max_requests=500)
    assert all(r.prompt_len >= 1 and r.decode_len >= 1 for r in requests)
    assert all(r.prompt_len + r.decode_len <= config.max_seq_len for r in requests)


# -- engine: how it uses the pool ----------------------------------------------------


@pytest.mark.parametrize("separate_kv", [True, False])
def test_every_block_is_free_after_all_requests_finish(separate_kv: bool) -> None:
    engine = make_engine(n_blocks=40, separate_kv=separate_kv)
    requests = generate_workload(SMALL_MIX, 5, until_step=400)
    report = simulate(engine, requests, check_every=7)
    assert_every_block_free(engine)
    figures = report.requests
    assert figures.completed + figures.aborted + figures.rejected == len(requests)
    assert report.pool.blocks_in_use_at_end == 0


@given(
    seed=st.integers(min_value=0, max_value=1000),
    block_size=st.integers(min_value=1, max_value=16),
    n_blocks=st.integers(min_value=1, max_value=60),
    separate_kv=st.booleans(),
    grow=st.booleans(),
)
def test_any_pool_drains_and_accounts_for_every_request(
    seed: int, block_size: int, n_blocks: int, separate_kv: bool, grow: bool
) -> None:
    engine = make_engine(block_size, n_blocks, separate_kv=separate_kv, grow=grow)
    mix = WorkloadConfig(arrival_rate=0.5, prompt_mean=12, decode_mean=10, max_seq_len=96)
    requests = generate_workload(mix, seed, until_step=40)
    report = simulate(engine, requests, mix=mix, check_every=5)
    assert_every_block_free(engine)
    figures = report.requests
    assert figures.completed + figures.aborted + figures.rejected == len(requests)
    assert report.pool.exhausted == engine.counters.exhaustion_events


def test_blocks_track_fill_token_by_token() -> None:
    engine = make_engine(block_size=4, n_blocks=16)
    engine.step([request(0, prompt_len=5, decode_len=20)])  # admitted: 5 tokens
    for _ in range(6):  # 6 decode steps: 11 tokens per stream
        engine.step([])
    assert fills(engine, 0, "k") == [4, 4, 3]
    assert fills(engine, 0, "v") == [4, 4, 3]
    # One partly filled block per stream, out of 16.
    assert engine.pool.stats.fragmentation() == pytest.approx(2 / 16)


def test_shared_kv_gives_each_stream_its_own_blocks() -> None:
    engine = make_engine(block_size=4, n_blocks=16, separate_kv=False)
    engine.step([request(0, prompt_len=6, decode_len=20)])
    engine.step([])  # 7 tokens per stream
    assert fills(engine, 0, "kv") == [4, 3, 4, 3]  # K's two blocks, then V's
    assert engine.pool.stats.n_allocations == 1


def test_request_grows_one_block_per_stream_when_its_last_block_fills() -> None:
    engine = make_engine(block_size=4, n_blocks=16)
    engine.step([request(0, prompt_len=4, decode_len=20)])
    assert engine.pool.stats.blocks_in_use() == 2
    engine.step([])
    assert engine.pool.stats.blocks_in_use() == 4
    assert fills(engine, 0, "k") == [4, 1]
    assert fills(engine, 0, "v") == [4, 1]


def test_completion_frees_the_request_blocks() -> None:
    engine = make_engine()
    report = simulate(engine, [request(0, prompt_len=10, decode_len=3)])
    assert report.requests.completed == 1
    assert report.throughput.decode_tokens == 3
    assert present(report.requests.latency_steps).max == 3
    assert_every_block_free(engine)


def test_abort_frees_blocks_mid_decode() -> None:
    engine = make_engine()
    report = simulate(engine, [request(0, prompt_len=10, decode_len=50, abort_after=4)])
    assert report.requests.aborted == 1
    assert report.requests.completed == 0
    assert report.throughput.decode_tokens == 4
    assert_every_block_free(engine)


def test_request_waits_in_queue_when_pool_is_full() -> None:
    # 4 blocks per stream of 4 tokens: one 13-token request fills a stream.
    engine = make_engine(block_size=4, n_blocks=8)
    first = request(0, prompt_len=13, decode_len=3)
    second = request(1, prompt_len=13, decode_len=3)
    report = simulate(engine, [first, second])
    assert report.requests.completed == 2
    assert report.requests.delayed_admissions == 1
    assert present(report.requests.queue_wait_steps).max == 3
    assert report.pool.exhausted >= 1
    assert report.requests.preemptions == 0


def test_newest_request_is_preempted_when_an_older_one_cannot_grow() -> None:
    engine = make_engine(block_size=4, n_blocks=8)
    older = request(0, prompt_len=8, decode_len=6)  # needs 4 blocks per stream at the end
    newer = request(1, prompt_len=7, decode_len=2)  # takes the remaining 2 blocks per stream
    report = simulate(engine, [older, newer])
    assert report.requests.preemptions >= 1
    assert report.requests.completed == 2
    assert report.throughput.recomputed_tokens > 0
    assert_every_block_free(engine)


@pytest.mark.parametrize(
    ("prompt_len", "decode_len"),
    [(100, 5), (10, 40)],
    ids=["prompt-too-large", "grows-beyond-pool"],
)
def test_request_that_cannot_fit_alone_is_rejected(prompt_len: int, decode_len: int) -> None:
    engine = make_engine(block_size=4, n_blocks=8)
    fits = request(1, prompt_len=4, decode_len=2, arrival_step=1)
    report = simulate(engine, [request(0, prompt_len, decode_len), fits])
    assert report.requests.rejected == 1
    assert report.requests.completed == 1
    assert_every_block_free(engine)


def test_tiny_pool_counts_exhaustion() -> None:
    engine = make_engine(n_blocks=8)
    requests = generate_workload(SMALL_MIX, 0, until_step=200)
    report = simulate(engine, requests)
    assert report.pool.exhausted > 0
    assert report.pool.exhausted == engine.counters.exhaustion_events
    assert report.requests.delayed_admissions > 0
    assert report.pool.peak_blocks_in_use == 8


def test_growing_pool_grows_instead_of_queueing() -> None:
    engine = make_engine(n_blocks=8, grow=True)
    requests = generate_workload(SMALL_MIX, 0, until_step=200)
    report = simulate(engine, requests)
    pool = report.pool
    assert pool.grown > 0
    assert pool.exhausted == 0
    assert report.requests.preemptions == 0
    assert report.requests.delayed_admissions == 0
    assert pool.final_blocks == pool.initial_blocks + pool.grown
    assert pool.peak_blocks_in_use == pool.final_blocks
    assert pool.peak_pct_of_pool is not None
    assert pool.peak_pct_of_pool > 100


def test_growth_stops_at_max_blocks() -> None:
    engine = make_engine(n_blocks=8, grow=True, max_blocks=24)
    requests = generate_workload(SMALL_MIX, 0, until_step=200)
    report = simulate(engine, requests)
    assert report.pool.final_blocks <= 24
    assert report.pool.grown > 0
    assert report.pool.exhausted > 0


# -- report ---------------------------------------------------------------------------


def test_report_is_deterministic_for_a_seed() -> None:
    requests = generate_workload(SMALL_MIX, 9, until_step=300)
    first = simulate(make_engine(n_blocks=30), requests, seed=9)
    second = simulate(make_engine(n_blocks=30), generate_workload(SMALL_MIX, 9, until_step=300))
    assert report_without_timings(first) == dataclasses.replace(
        report_without_timings(second), seed=9
    )


def test_report_figures_agree_with_each_other() -> None:
    engine = make_engine(n_blocks=24)
    report = simulate(engine, generate_workload(SMALL_MIX, 2, until_step=300))
    pool = report.pool
    assert pool.reuse_ratio == pytest.approx(pool.reused / pool.blocks_handed_out, abs=1e-6)
    assert pool.allocations <= pool.blocks_handed_out
    assert present(pool.blocks_in_use).max <= pool.peak_blocks_in_use  # at step ends
    assert pool.peak_pct_of_pool == pytest.approx(100 * pool.peak_blocks_in_use / 24)
    for summary in (report.fragmentation, report.wasted_slots.slots, pool.blocks_in_use):
        series = present(summary)
        assert series.min <= series.median <= series.p95 <= series.max
        assert series.min <= series.mean <= series.max
    assert report.throughput.decode_tokens_per_step == pytest.approx(
        report.throughput.decode_tokens / report.throughput.steps, abs=1e-6
    )


def test_wasted_slots_are_less_than_one_block_per_stream() -> None:
    engine = make_engine(block_size=8, n_blocks=40)
    run_workload(engine, generate_workload(SMALL_MIX, 4, until_step=300))
    recorder = engine.recorder
    for wasted, running in zip(recorder.wasted_slots, recorder.running, strict=True):
        assert 0 <= wasted <= 2 * (8 - 1) * running


def test_the_largest_block_size_reports_wasted_slots_past_2_63() -> None:
    largest = 2**63 - 1  # the bound of every int the pool takes
    engine = make_engine(block_size=largest, n_blocks=40)
    report = simulate(engine, generate_workload(SMALL_MIX, 4, until_step=50))
    assert (
        present(report.wasted_slots.slots).max > 2**63
    )  # two such blocks: more slots than an int64
    assert report.wasted_slots.mean_pct_of_allocated == pytest.approx(100, abs=1e-6)


def test_prometheus_text_matches_the_report() -> None:
    engine = make_engine(n_blocks=24)
    report = simulate(engine, generate_workload(SMALL_MIX, 2, until_step=200))
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(report.prometheus)
        for sample in family.samples
    }
    prefix = "veloxquant_block_pool"
    assert samples[f"{prefix}_allocations_total"] == report.pool.allocations
    assert samples[f"{prefix}_exhausted_total"] == report.pool.exhausted
    assert samples[f"{prefix}_reused_total"] == report.pool.reused
    assert samples[f"{prefix}_peak_blocks_in_use"] == report.pool.peak_blocks_in_use
    assert samples[f"{prefix}_blocks_in_use"] == 0


def test_progress_callback_reports_every_request_finished_at_the_end() -> None:
    seen: list[Progress] = []
    requests = generate_workload(SMALL_MIX, 0, until_step=200)
    engine = make_engine(n_blocks=64)
    run_workload(engine, requests, on_progress=seen.append, progress_every=10)
    assert seen[-1] == Progress(engine.step_index, len(requests), len(requests))
    assert [item.step for item in seen[:-1]] == list(range(10, engine.step_index + 1, 10))


def test_min_steps_keeps_an_idle_engine_stepping() -> None:
    engine = make_engine()
    run_workload(engine, [], min_steps=25)
    assert engine.step_index == 25
    assert len(engine.recorder.blocks_in_use) == 25


# -- failing loudly ---------------------------------------------------------------------


class BrokenAfter(BlockPoolAllocator):
    """A pool whose ``check_invariants`` fails from its n-th call on."""

    def __init__(self, config: PoolConfig, fail_from_call: int) -> None:
        super().__init__(config)
        self.calls = 0
        self.fail_from_call = fail_from_call

    def check_invariants(self) -> None:
        self.calls += 1
        if self.calls >= self.fail_from_call:
            raise AssertionError("partition: block 3 is free and owned")
        super().check_invariants()


def test_broken_pool_invariant_stops_the_run_naming_the_step() -> None:
    pool = BrokenAfter(PoolConfig(block_size=8, n_blocks=64), fail_from_call=3)
    engine = ServingEngine(pool)
    with pytest.raises(SimulationInvariantError, match=r"at step 30: .*partition") as caught:
        run_workload(engine, generate_workload(SMALL_MIX, 0, until_step=200), check_every=10)
    assert caught.value.step == 30


def test_final_check_runs_even_without_periodic_checks() -> None:
    pool = BrokenAfter(PoolConfig(block_size=8, n_blocks=64), fail_from_call=1)
    with pytest.raises(SimulationInvariantError, match="partition"):
        run_workload(ServingEngine(pool), generate_workload(SMALL_MIX, 0, until_step=50))


class LeakyPool(BlockPoolAllocator):
    """A pool whose ``free_all`` forgets to free anything."""

    def free_all(self, owner: int) -> None:
        del owner


def test_leaked_blocks_are_detected() -> None:
    engine = ServingEngine(LeakyPool(PoolConfig(block_size=8, n_blocks=64)))
    with pytest.raises(SimulationInvariantError, match="blocks in use, engine holds"):
        run_workload(engine, [request(0, prompt_len=10, decode_len=2)])


# -- summaries --------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    ordered = [float(value) for value in range(1, 21)]
    assert percentile(ordered, 95) == 19
    assert percentile(ordered, 100) == 20
    assert percentile(ordered, 0) == 1


def test_an_empty_series_has_no_summary_not_zeros() -> None:
    # Once all zeros: a run where nothing completed showed a latency of 0 steps.
    assert summarize([]) is None
    assert summarize([0.0]) == Distribution(0.0, 0.0, 0.0, 0.0, 0.0, count=1)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1))
def test_summary_is_ordered(samples: list[float]) -> None:
    summary = present(summarize(samples))
    assert summary.count == len(samples)
    assert summary.min <= summary.median <= summary.p95 <= summary.max
    assert summary.min <= summary.mean <= summary.max
    assert summary.max == pytest.approx(max(samples), abs=1e-6)
    assert math.isfinite(summary.mean)


def test_a_request_refused_for_its_value_blocks_leaves_no_peak_and_no_growth() -> None:
    # 7 blocks: 4 key and 3 value. A prompt of 16 positions needs 4 of each: the key
    # blocks were checked out, then given back when the value list fell short, and the
    # pool's peak and blocks_handed_out counted blocks no request ever held.
    engine = make_engine(block_size=4, n_blocks=7)
    report = simulate(engine, [request(0, 16, 1)])
    stats = engine.pool.stats
    assert (stats.peak_blocks_in_use, stats.n_allocations) == (0, 0)
    assert engine.counters.blocks_handed_out == 0
    assert report.requests.rejected == 1
    # Growth room for one block: the key list grew by it, and growth is never undone.
    grown = make_engine(block_size=4, n_blocks=7, grow=True, max_blocks=8)
    assert simulate(grown, [request(0, 20, 1)]).requests.rejected == 1
    assert (grown.pool.stats.n_grown, grown.pool.stats.peak_blocks_in_use) == (0, 0)
