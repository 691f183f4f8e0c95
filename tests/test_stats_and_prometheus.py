"""AllocationStats, the stats snapshot, the history, and the Prometheus rendering."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import STATS_COUNTERS, make_pool, stats_view
from prometheus_client.parser import text_string_to_metric_families

from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
)

# ---------------------------------------------------------------- AllocationStats


def test_allocation_stats_defaults_match_the_reference() -> None:
    stats = AllocationStats(n_blocks=5)
    assert stats.n_blocks == 5
    for name in STATS_COUNTERS[1:]:
        assert getattr(stats, name) == 0
    assert stats._fragmented_count == 0


def test_fragmentation_of_a_stats_object_with_no_blocks_is_zero() -> None:
    assert AllocationStats(n_blocks=0).fragmentation() == 0.0


def test_snapshot_is_an_equal_but_independent_copy() -> None:
    stats = AllocationStats(n_blocks=5, n_allocations=3, n_frees=2, peak_blocks_in_use=4)
    copy = stats.snapshot()
    assert copy is not stats
    assert stats_view(copy) == stats_view(stats)
    stats.n_allocations += 1
    assert copy.n_allocations == 3


def test_pool_stats_is_a_new_snapshot_each_time(pool: BlockPoolAllocator) -> None:
    assert pool.stats is not pool.stats


def test_pool_stats_snapshot_does_not_follow_later_calls(pool: BlockPoolAllocator) -> None:
    taken = pool.stats
    view = stats_view(taken)
    pool.allocate("k", 6, owner=1)
    assert stats_view(taken) == view


def test_a_new_pool_has_zero_counters_and_its_block_count() -> None:
    stats = make_pool(n_blocks=6).stats
    assert stats.n_blocks == 6
    for name in STATS_COUNTERS[1:]:
        assert getattr(stats, name) == 0
    assert stats.blocks_in_use() == 0
    assert stats.fragmentation() == 0.0


def test_fragmentation_is_partly_used_checked_out_blocks_over_all_blocks(
    pool: BlockPoolAllocator,
) -> None:
    pool.allocate("k", 6, owner=1)  # 4 + 2
    pool.allocate("v", 1, owner=2)  # 1
    pool.allocate("v", 8, owner=3)  # 4 + 4
    assert pool.stats.fragmentation() == pytest.approx(2 / 8)


# ---------------------------------------------------------------- history


def test_history_records_one_snapshot_per_counting_call_oldest_first(
    pool: BlockPoolAllocator,
) -> None:
    expected = []
    blocks = pool.allocate("k", 6, owner=1)
    expected.append(stats_view(pool.stats))
    pool.free([blocks[0]])
    expected.append(stats_view(pool.stats))
    pool.allocate("v", 4, owner=2)
    expected.append(stats_view(pool.stats))
    pool.free_all(2)
    expected.append(stats_view(pool.stats))
    pool.shrink("v", 2)
    expected.append(stats_view(pool.stats))
    assert [stats_view(entry) for entry in pool.history] == expected


def test_history_records_an_exhausted_allocate(pool: BlockPoolAllocator) -> None:
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=1)
    (entry,) = pool.history
    assert entry.n_exhausted == 1
    assert stats_view(entry) == stats_view(pool.stats)


def test_history_records_a_growing_allocate_once() -> None:
    pool = make_pool(block_size=4, n_blocks=2, grow_on_exhaustion=True)
    pool.allocate("k", 12, owner=1)
    (entry,) = pool.history
    assert (entry.n_allocations, entry.n_grown, entry.n_blocks) == (1, 2, 4)


def test_history_skips_calls_that_change_no_counter(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 6, owner=1)
    pool.free([])
    pool.free_all(2)
    pool.shrink("k", 10)
    pool.mark_used(blocks[0], 1)
    pool.register_owner(3)
    pool.release_owner(3)
    pool.blocks_for(1)
    pool.n_free("k")
    _ = pool.stats
    assert len(pool.history) == 1


def test_history_entries_do_not_follow_later_calls(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 6, owner=1)
    (entry,) = pool.history
    view = stats_view(entry)
    pool.free_all(1)
    assert stats_view(entry) == view
    assert stats_view(pool.history[0]) == view


def test_history_keeps_only_the_newest_history_len_entries() -> None:
    pool = make_pool(block_size=4, n_blocks=16, history_len=3)
    for owner in range(5):
        pool.allocate("k", 1, owner=owner)
    assert [entry.n_allocations for entry in pool.history] == [3, 4, 5]


def test_history_len_zero_disables_history() -> None:
    pool = make_pool(history_len=0)
    pool.allocate("k", 1, owner=1)
    pool.free_all(1)
    assert len(pool.history) == 0


def test_history_is_a_copy(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 1, owner=1)
    history = pool.history
    history.clear()
    assert len(pool.history) == 1
    assert pool.history is not pool.history


def test_history_holds_allocation_stats(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 1, owner=1)
    assert all(type(entry) is AllocationStats for entry in pool.history)


def test_history_copy_keeps_the_bound(pool: BlockPoolAllocator) -> None:
    assert pool.history.maxlen == 1024


def history_of_every_counting_call(history_len: int) -> list[tuple[object, ...]]:
    """The history, sharing's counters included, of a pool taken through every call that
    records: allocate (fresh, reused, grown), free, fork, make_writable, shrink, free_all,
    and an exhausted allocate."""
    pool = make_pool(
        block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=8, history_len=history_len
    )
    first = pool.allocate("k", 6, owner=1)
    pool.free([pool.allocate("k", 1, owner=9)[0]])
    pool.fork(1, 2)
    pool.make_writable(pool.blocks_for(2)[1])
    pool.shrink("v", 1)
    pool.free([first[1]])
    pool.free_all(2)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=5)
    return [
        (*stats_view(entry), entry.shared_blocks(), entry.n_shares, entry.n_copy_on_write)
        for entry in pool.history
    ]


@pytest.mark.parametrize(
    "history_len", [0, 3, 1024], ids=["no-history", "ring-overwritten", "ring-filling"]
)
def test_the_compiled_builds_history_records_what_the_interpreted_one_does(
    history_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Interpreted, the pool appends counter tuples; compiled, it overwrites a ring of stats
    # in place (memory/_history.py), which must never be asked to record at capacity 0.
    # Here both branches run interpreted (under the compiled build, COMPILED is read from
    # the compiled module and this compares it with itself).
    interpreted = history_of_every_counting_call(history_len)
    monkeypatch.setattr(block_pool, "COMPILED", True)
    assert history_of_every_counting_call(history_len) == interpreted
    assert len(interpreted) == min(history_len, 9)


# ---------------------------------------------------------------- Prometheus

GAUGES: dict[str, Callable[[AllocationStats], float]] = {
    "blocks": lambda s: s.n_blocks,
    "blocks_in_use": lambda s: s.blocks_in_use(),
    "peak_blocks_in_use": lambda s: s.peak_blocks_in_use,
    "fragmentation_ratio": lambda s: s.fragmentation(),
}
COUNTERS: dict[str, Callable[[AllocationStats], float]] = {
    "allocations_total": lambda s: s.n_allocations,
    "frees_total": lambda s: s.n_frees,
    "reused_total": lambda s: s.n_reused,
    "exhausted_total": lambda s: s.n_exhausted,
    "grown_total": lambda s: s.n_grown,
    "retired_total": lambda s: s.n_retired,
}
METRIC_TYPES = {**dict.fromkeys(GAUGES, "gauge"), **dict.fromkeys(COUNTERS, "counter")}


def busy_pool_stats() -> AllocationStats:
    """A stats snapshot in which every counter but n_exhausted is non-zero."""
    pool = make_pool(block_size=4, n_blocks=8, grow_on_exhaustion=True)
    pool.allocate("k", 20, owner=1)  # grows 1
    pool.free_all(1)
    pool.allocate("k", 6, owner=2)  # reuses 2
    pool.allocate("v", 4, owner=3)
    pool.free_all(3)
    pool.shrink("v", 1)
    pool.allocate("v", 4, owner=4)
    return pool.stats


def parse_samples(text: str) -> dict[str, tuple[str, float]]:
    """Sample name -> (family type, value), with each sample name seen once."""
    samples: dict[str, tuple[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name not in samples, f"{sample.name} emitted twice"
            samples[sample.name] = (family.type, sample.value)
    return samples


@pytest.mark.parametrize("metric", sorted(METRIC_TYPES))
def test_prometheus_text_has_help_and_type_for_every_metric(metric: str) -> None:
    name = f"veloxquant_block_pool_{metric}"
    lines = busy_pool_stats().to_prometheus().splitlines()
    help_lines = [line for line in lines if line.startswith(f"# HELP {name} ")]
    assert len(help_lines) == 1
    assert help_lines[0][len(f"# HELP {name} ") :].strip()
    assert lines.count(f"# TYPE {name} {METRIC_TYPES[metric]}") == 1
    assert lines.index(help_lines[0]) < lines.index(f"# TYPE {name} {METRIC_TYPES[metric]}")


def test_prometheus_text_parses_to_exactly_the_contract_metrics_with_their_values() -> None:
    stats = busy_pool_stats()
    samples = parse_samples(stats.to_prometheus())
    value_of = {**GAUGES, **COUNTERS}
    prefix = "veloxquant_block_pool_"
    assert {name: kind for name, (kind, _) in samples.items()} == {
        prefix + metric: kind for metric, kind in METRIC_TYPES.items()
    }
    assert {name: value for name, (_, value) in samples.items()} == pytest.approx(
        {prefix + metric: float(value_of[metric](stats)) for metric in METRIC_TYPES}
    )


def test_busy_pool_stats_exercise_every_counter() -> None:
    stats = busy_pool_stats()
    assert all(getattr(stats, name) > 0 for name in STATS_COUNTERS if name != "n_exhausted")
    assert 0.0 < stats.fragmentation() < 1.0


def test_prometheus_text_is_newline_terminated() -> None:
    assert make_pool().stats.to_prometheus().endswith("\n")


def test_prometheus_counts_an_exhausted_allocate(pool: BlockPoolAllocator) -> None:
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=1)
    samples = parse_samples(pool.stats.to_prometheus())
    assert samples["veloxquant_block_pool_exhausted_total"] == ("counter", 1.0)


@pytest.mark.parametrize("prefix", ["vq", "_private", "ns:pool", "a1_b2", "A"])
def test_prometheus_uses_any_valid_prefix(prefix: str) -> None:
    samples = parse_samples(make_pool().stats.to_prometheus(prefix))
    assert set(samples) == {f"{prefix}_{metric}" for metric in METRIC_TYPES}


@pytest.mark.parametrize(
    "prefix", ["", "9lives", "has-dash", "has space", "dot.ted", "new\nline", "caf\u00e9", "{x}"]
)
def test_prometheus_rejects_a_prefix_that_is_not_a_metric_name(prefix: str) -> None:
    with pytest.raises(ValueError):
        make_pool().stats.to_prometheus(prefix)


class _LoudPrefix(str):
    """A ``str`` whose formatting says something else than its characters."""

    def __format__(self, spec: str) -> str:
        return "other name"

    def __str__(self) -> str:
        return "other name"


def test_prometheus_renders_a_str_subclass_prefix_by_its_characters() -> None:
    # Once the prefix went through its own __format__: "other name_blocks_total" etc.
    text = make_pool().stats.to_prometheus(_LoudPrefix("vq"))
    assert set(parse_samples(text)) == {f"vq_{metric}" for metric in METRIC_TYPES}


def test_prometheus_of_an_empty_pool_reports_zero_fragmentation() -> None:
    samples = parse_samples(make_pool(n_blocks=0).stats.to_prometheus())
    assert samples["veloxquant_block_pool_fragmentation_ratio"] == ("gauge", 0.0)


@pytest.mark.parametrize(
    ("stats", "error", "named"),
    [
        (AllocationStats(4, n_allocations=-5), ValueError, r"n_allocations must be .*got -5$"),
        (
            AllocationStats(4, _fragmented_count=9),
            ValueError,
            r"^AllocationStats\._fragmented_count must be at most n_blocks \(4\), got 9: a "
            r"fragmentation ratio is between 0\.0 and 1\.0$",
        ),
    ],
    ids=["a negative counter", "more partly filled than blocks"],
)
def test_prometheus_refuses_hand_built_stats_it_would_render_wrong(
    stats: AllocationStats, error: type[Exception], named: str
) -> None:
    # Rendered as given, True printed "..._blocks True", which the parser refuses, and a
    # fragmentation of 9 partly filled blocks among 4 read 2.25.
    with pytest.raises(error, match=named):
        stats.to_prometheus()


@pytest.mark.parametrize(
    "field", [*STATS_COUNTERS, "_fragmented_count", "n_shares", "n_copy_on_write"]
)
def test_prometheus_names_the_field_of_hand_built_stats_that_is_negative(field: str) -> None:
    stats = AllocationStats(**{"n_blocks": 4, field: -1})
    with pytest.raises(
        ValueError, match=rf"^AllocationStats\.{field} must be an int >= 0, got -1$"
    ):
        stats.to_prometheus()


def test_a_bool_count_is_refused_at_export_or_was_stored_as_an_int() -> None:
    stats = AllocationStats(n_blocks=True)
    if block_pool.COMPILED:  # the compiled class stores an int field as an int: 1
        assert parse_samples(stats.to_prometheus())["veloxquant_block_pool_blocks"] == (
            "gauge",
            1.0,
        )
    else:  # kept as given, it rendered "..._blocks True", which the parser refuses
        with pytest.raises(TypeError, match=r"^AllocationStats\.n_blocks must be an int"):
            stats.to_prometheus()
