"""shrink() and exhaustion-triggered growth: which ids leave, which ids come back, counters."""

from __future__ import annotations

import pytest
from conftest import (
    assert_only_exhaustion_recorded,
    block_ids,
    make_pool,
    observe,
    pool_unchanged,
    take_all_free,
)
from hypothesis import given
from hypothesis import strategies as st

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, BlockPoolExhaustedError

# ---------------------------------------------------------------- shrink


@pytest.mark.parametrize(
    ("target_free", "expected_retired"),
    [(0, 4), (1, 3), (3, 1), (4, 0), (5, 0), (100, 0)],
)
def test_shrink_returns_how_many_blocks_it_retired(
    pool: BlockPoolAllocator, target_free: int, expected_retired: int
) -> None:
    assert pool.shrink("k", target_free) == expected_retired
    assert pool.n_free("k") == min(4, target_free)


@pytest.mark.parametrize("target_free", [3, 4, 10])
def test_shrink_to_at_least_the_free_count_is_a_no_op(
    pool: BlockPoolAllocator, target_free: int
) -> None:
    held = pool.allocate("k", 4, owner=1)
    with pool_unchanged(pool, owners=[1], handles=held):
        assert pool.shrink("k", target_free) == 0


def test_shrink_retires_the_highest_free_ids_first(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 12, owner=1)  # ids 0, 1, 2; id 3 still free
    pool.free([blocks[0], blocks[2]])  # free: 3, 0, 2
    assert pool.shrink("k", 1) == 2
    assert take_all_free(pool, "k", owner=2) == [0]


def test_shrink_never_touches_blocks_in_use(pool: BlockPoolAllocator) -> None:
    held = pool.allocate("k", 10, owner=1)
    before = [(b.block_id, b.owner, b.n_used) for b in held]
    assert pool.shrink("k", 0) == 1
    assert [(b.block_id, b.owner, b.n_used) for b in held] == before
    assert pool.blocks_for(1) == held
    assert pool.stats.blocks_in_use() == 3


def test_shrink_keeps_the_lifo_order_of_the_blocks_it_keeps(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 12, owner=1)
    pool.free([blocks[0], blocks[2], blocks[1]])  # stack bottom->top: 3, 0, 2, 1
    assert pool.shrink("k", 3) == 1  # retires 3
    assert take_all_free(pool, "k", owner=2) == [1, 2, 0]


def test_shrink_of_one_stream_leaves_the_other_alone(pool: BlockPoolAllocator) -> None:
    pool.shrink("v", 0)
    assert pool.n_free("k") == 4
    assert take_all_free(pool, "k", owner=1) == [0, 1, 2, 3]


def test_shrink_lowers_n_blocks_and_raises_n_retired(pool: BlockPoolAllocator) -> None:
    pool.shrink("v", 1)
    pool.shrink("k", 2)
    stats = pool.stats
    assert (stats.n_blocks, stats.n_retired) == (3, 5)


def test_shrink_leaves_the_other_counters_alone(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 12, owner=1)
    before = pool.stats
    pool.shrink("v", 0)
    after = pool.stats
    for name in ("n_allocations", "n_frees", "n_reused", "n_exhausted", "n_grown"):
        assert getattr(after, name) == getattr(before, name)
    assert after.peak_blocks_in_use == before.peak_blocks_in_use
    assert after.blocks_in_use() == before.blocks_in_use()


def test_shrink_changes_the_fragmentation_denominator(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 2, owner=1)
    assert pool.stats.fragmentation() == pytest.approx(1 / 8)
    pool.shrink("v", 0)
    assert pool.stats.fragmentation() == pytest.approx(1 / 4)


def test_shrinking_every_block_away_leaves_an_empty_pool(pool: BlockPoolAllocator) -> None:
    pool.shrink("k", 0)
    pool.shrink("v", 0)
    stats = pool.stats
    assert stats.n_blocks == 0
    assert stats.fragmentation() == 0.0
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=1)


@pytest.mark.parametrize("stream", ["k", "v", "kv"])
def test_shared_pool_shrinks_its_one_list_under_any_stream_name(stream: str) -> None:
    pool = make_pool(block_size=4, n_blocks=8, separate_kv=False)
    assert pool.shrink(stream, 5) == 3
    assert pool.n_free("kv") == 5
    assert take_all_free(pool, "kv", owner=1) == [0, 1, 2, 3, 4]


def test_shrink_makes_later_allocations_exhaust_sooner(pool: BlockPoolAllocator) -> None:
    pool.shrink("k", 1)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 5, owner=1)
    assert block_ids(pool.allocate("k", 4, owner=1)) == [0]


# ---------------------------------------------------------------- growth


def test_growth_adds_exactly_the_missing_blocks_with_ids_above_the_highest() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True)
    assert block_ids(pool.allocate("k", 16, owner=1)) == [0, 1, 4, 5]
    stats = pool.stats
    assert (stats.n_grown, stats.n_blocks) == (2, 6)
    assert pool.n_free("k") == 0


def test_grown_blocks_are_handed_out_after_every_already_free_block() -> None:
    pool = make_pool(block_size=4, n_blocks=6, grow_on_exhaustion=True)
    first = pool.allocate("k", 8, owner=1)  # ids 0, 1; id 2 still free
    pool.free([first[0]])  # free stack: 2, 0
    assert block_ids(pool.allocate("k", 16, owner=2)) == [0, 2, 6, 7]


def test_growth_re_issues_the_lowest_retired_ids_first_then_goes_above_the_highest() -> None:
    pool = make_pool(block_size=4, n_blocks=6, grow_on_exhaustion=True)
    k_blocks = pool.allocate("k", 12, owner=1)  # ids 0, 1, 2
    pool.free([k_blocks[1]])
    assert pool.shrink("k", 0) == 1  # retires 1
    pool.allocate("v", 8, owner=2)  # ids 3, 4
    assert pool.shrink("v", 0) == 1  # retires 5
    assert block_ids(pool.allocate("k", 12, owner=3)) == [1, 5, 6]
    assert pool.stats.n_blocks == 7


def test_growth_ids_are_shared_across_streams() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True)
    assert block_ids(pool.allocate("k", 12, owner=1)) == [0, 1, 4]
    assert block_ids(pool.allocate("v", 12, owner=2)) == [2, 3, 5]


def test_a_retired_id_of_one_stream_can_be_re_issued_to_the_other() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True)
    pool.shrink("v", 0)  # retires 3, 2
    blocks = pool.allocate("k", 16, owner=1)
    assert block_ids(blocks) == [0, 1, 2, 3]
    assert [b.stream for b in blocks] == ["k"] * 4


def test_a_grown_block_on_a_re_issued_id_is_new() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True)
    pool.allocate("k", 8, owner=1)
    pool.free_all(1)
    assert pool.shrink("k", 0) == 2  # ids 0 and 1 were allocated, now retired
    blocks = pool.allocate("k", 4, owner=2)
    assert block_ids(blocks) == [0]
    assert blocks[0].ever_allocated is True
    stats = pool.stats
    assert (stats.n_reused, stats.n_grown) == (0, 1)


def test_growth_from_an_empty_pool_issues_ids_from_zero() -> None:
    pool = make_pool(block_size=4, n_blocks=0, grow_on_exhaustion=True)
    assert block_ids(pool.allocate("k", 8, owner=1)) == [0, 1]
    assert block_ids(pool.allocate("v", 4, owner=1)) == [2]


def test_shared_pool_grows_its_one_list() -> None:
    pool = make_pool(block_size=4, n_blocks=2, separate_kv=False, grow_on_exhaustion=True)
    blocks = pool.allocate("v", 12, owner=1)
    assert block_ids(blocks) == [0, 1, 2]
    assert [b.stream for b in blocks] == ["kv"] * 3


def test_growth_counts_the_allocation_and_the_fresh_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=2, grow_on_exhaustion=True)
    pool.allocate("k", 12, owner=1)
    stats = pool.stats
    assert (stats.n_allocations, stats.n_exhausted, stats.n_reused) == (1, 0, 0)
    assert stats.peak_blocks_in_use == 3


def test_growth_block_by_block_counts_each_grown_block_as_new_until_it_comes_back() -> None:
    pool = make_pool(block_size=4, n_blocks=0, grow_on_exhaustion=True)
    for owner in range(3):  # one missing block each time: the decode loop's growth
        pool.allocate("k", 4, owner=owner)
    assert (pool.stats.n_grown, pool.stats.n_reused) == (3, 0)
    pool.free_all(1)
    pool.allocate("k", 4, owner=9)
    assert (pool.stats.n_grown, pool.stats.n_reused) == (3, 1)


def test_growth_up_to_exactly_max_blocks_succeeds() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=6)
    assert block_ids(pool.allocate("k", 16, owner=1)) == [0, 1, 4, 5]
    assert pool.stats.n_blocks == 6


def test_growth_past_max_blocks_raises_and_changes_nothing_else() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=5)
    held = pool.allocate("k", 4, owner=1)
    before = observe(pool, owners=[1, 2], handles=held)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 12, owner=2)
    assert_only_exhaustion_recorded(before, observe(pool, owners=[1, 2], handles=held))
    pool.check_invariants()


def test_failed_growth_does_not_consume_ids() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=5)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 16, owner=1)
    assert block_ids(pool.allocate("k", 12, owner=1)) == [0, 1, 4]


def test_max_blocks_counts_blocks_across_all_streams() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=6)
    pool.allocate("k", 12, owner=1)  # grows to 5
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("v", 16, owner=2)  # would grow to 7
    assert block_ids(pool.allocate("v", 12, owner=2)) == [2, 3, 5]


def test_shrink_makes_room_under_max_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=4)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 12, owner=1)
    pool.shrink("v", 0)  # retires 3, 2
    assert block_ids(pool.allocate("k", 16, owner=1)) == [0, 1, 2, 3]


def test_no_growth_when_grow_on_exhaustion_is_off_even_with_max_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=False, max_blocks=100)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 12, owner=1)
    assert pool.stats.n_grown == 0


def test_n_blocks_is_always_initial_plus_grown_minus_retired() -> None:
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True)
    pool.allocate("k", 16, owner=1)  # grows 2
    pool.shrink("v", 1)  # retires 1
    pool.free_all(1)
    pool.shrink("k", 1)  # retires 3
    stats = pool.stats
    assert (stats.n_grown, stats.n_retired) == (2, 4)
    assert stats.n_blocks == 4 + 2 - 4


# ---------------------------------------------------------------- properties


@given(
    n_blocks=st.integers(0, 40),
    in_use=st.integers(0, 20),
    target_free=st.integers(0, 40),
)
def test_shrink_retires_the_free_surplus_and_keeps_the_lowest_free_ids(
    n_blocks: int, in_use: int, target_free: int
) -> None:
    pool = make_pool(block_size=1, n_blocks=n_blocks, separate_kv=False)
    in_use = min(in_use, n_blocks)
    if in_use:
        pool.allocate("kv", in_use, owner=1)
    free_before = n_blocks - in_use
    retired = pool.shrink("kv", target_free)
    assert retired == max(0, free_before - target_free)
    assert pool.stats.n_blocks == n_blocks - retired
    remaining = pool.n_free("kv")
    if remaining:
        assert sorted(block_ids(pool.allocate("kv", remaining, owner=2))) == list(
            range(in_use, in_use + remaining)
        )
    pool.check_invariants()
