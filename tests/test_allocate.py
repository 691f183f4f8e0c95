"""allocate(): how many blocks, which ids, what each block records, and the counters."""

from __future__ import annotations

import math
from typing import Any

import pytest
from conftest import (
    assert_only_exhaustion_recorded,
    block_ids,
    make_pool,
    observe,
    pool_unchanged,
)
from hypothesis import given
from hypothesis import strategies as st

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolError,
    BlockPoolExhaustedError,
)


@pytest.mark.parametrize(
    ("block_size", "n_tokens", "expected_n_used"),
    [
        (4, 1, [1]),
        (4, 3, [3]),
        (4, 4, [4]),
        (4, 5, [4, 1]),
        (4, 8, [4, 4]),
        (4, 10, [4, 4, 2]),
        (1, 3, [1, 1, 1]),
        (16, 40, [16, 16, 8]),
    ],
)
def test_allocate_hands_out_ceil_blocks_full_except_the_remainder_in_the_last(
    block_size: int, n_tokens: int, expected_n_used: list[int]
) -> None:
    pool = make_pool(block_size=block_size, n_blocks=8)
    blocks = pool.allocate("k", n_tokens, owner=1)
    assert [block.n_used for block in blocks] == expected_n_used


def test_allocate_returns_a_list_of_blocks() -> None:
    blocks = make_pool().allocate("k", 6, owner=1)
    assert type(blocks) is list
    assert all(isinstance(block, Block) for block in blocks)


@pytest.mark.parametrize("stream", ["k", "v"])
def test_allocate_records_owner_format_stream_and_ever_allocated(stream: str) -> None:
    blocks = make_pool().allocate(stream, 6, owner=7, format="int2")
    for block in blocks:
        assert block.owner == 7
        assert block.format == "int2"
        assert block.stream == stream
        assert block.ever_allocated is True


@pytest.mark.parametrize("stream", ["k", "v", "kv"])
def test_shared_pool_blocks_have_stream_kv_whatever_stream_was_asked(stream: str) -> None:
    blocks = make_pool(separate_kv=False).allocate(stream, 6, owner=1)
    assert [block.stream for block in blocks] == ["kv", "kv"]


def test_allocate_defaults_format_to_fp16() -> None:
    assert make_pool().allocate("k", 1, owner=1)[0].format == "fp16"


@pytest.mark.parametrize("fmt", ["fp16", "int2", "int4", "x", "any tag at all"])
def test_allocate_accepts_any_non_empty_format_tag(fmt: str) -> None:
    assert make_pool().allocate("k", 1, owner=1, format=fmt)[0].format == fmt


@pytest.mark.parametrize("owner", [0, -1, -(2**70), 2**70])
def test_allocate_accepts_any_int_owner(owner: int) -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 1, owner=owner)
    assert blocks[0].owner == owner
    assert pool.blocks_for(owner) == blocks


@pytest.mark.parametrize(
    ("stream", "first_id"),
    [("k", 0), ("v", 4)],
)
def test_fresh_blocks_come_off_in_ascending_id_order(stream: str, first_id: int) -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    assert block_ids(pool.allocate(stream, 12, owner=1)) == [first_id, first_id + 1, first_id + 2]


def test_consecutive_allocations_continue_the_ascending_fresh_order() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    assert block_ids(pool.allocate("k", 4, owner=1)) == [0]
    assert block_ids(pool.allocate("k", 8, owner=2)) == [1, 2]
    assert block_ids(pool.allocate("k", 1, owner=1)) == [3]


def test_shared_pool_hands_out_fresh_ids_from_zero_whatever_the_stream() -> None:
    pool = make_pool(block_size=4, n_blocks=6, separate_kv=False)
    assert block_ids(pool.allocate("v", 8, owner=1)) == [0, 1]
    assert block_ids(pool.allocate("k", 4, owner=2)) == [2]
    assert block_ids(pool.allocate("kv", 4, owner=3)) == [3]


def test_separate_streams_have_independent_free_lists() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 16, owner=1)
    assert pool.n_free("k") == 0
    assert pool.n_free("v") == 4
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=2)
    assert block_ids(pool.allocate("v", 4, owner=2)) == [4]


@pytest.mark.parametrize("stream", ["k", "v", "kv"])
def test_shared_pool_streams_all_name_one_free_list(stream: str) -> None:
    pool = make_pool(block_size=4, n_blocks=8, separate_kv=False)
    pool.allocate(stream, 12, owner=1)
    assert pool.n_free("k") == pool.n_free("v") == pool.n_free("kv") == 5


def test_n_free_defaults_to_stream_k() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 4, owner=1)
    assert pool.n_free() == 3


def test_allocate_can_take_exactly_every_free_block() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    assert block_ids(pool.allocate("k", 16, owner=1)) == [0, 1, 2, 3]
    assert pool.n_free("k") == 0


def test_exhaustion_raises_block_pool_exhausted_error() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    with pytest.raises(BlockPoolExhaustedError) as excinfo:
        pool.allocate("k", 17, owner=1)
    assert isinstance(excinfo.value, BlockPoolError)
    assert isinstance(excinfo.value, RuntimeError)


def test_exhaustion_changes_nothing_but_n_exhausted_and_history() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    held = pool.allocate("k", 9, owner=1)
    before = observe(pool, owners=[1, 2], handles=held)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 8, owner=2)
    assert_only_exhaustion_recorded(before, observe(pool, owners=[1, 2], handles=held))
    pool.check_invariants()


def test_exhaustion_does_not_consume_free_block_ids() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 20, owner=1)
    assert block_ids(pool.allocate("k", 16, owner=1)) == [0, 1, 2, 3]


def test_exhausted_allocate_for_a_new_owner_leaves_it_inactive() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=5)
    assert pool.blocks_for(5) == []
    pool.register_owner(5)


def test_exhausted_allocate_for_an_active_owner_keeps_its_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    held = pool.allocate("k", 4, owner=5)
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=5)
    assert pool.blocks_for(5) == held


def test_repeated_allocate_for_one_owner_extends_its_blocks_in_allocation_order() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    first = pool.allocate("k", 8, owner=1)
    second = pool.allocate("v", 4, owner=1)
    third = pool.allocate("k", 4, owner=1)
    assert pool.blocks_for(1) == first + second + third


def test_successful_allocate_counts_one_allocation_per_call() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 12, owner=1)
    pool.allocate("v", 1, owner=2)
    assert pool.stats.n_allocations == 2


def test_fresh_blocks_are_not_counted_as_reused() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 16, owner=1)
    assert pool.stats.n_reused == 0


def test_n_reused_counts_handed_out_blocks_that_were_allocated_before() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 8, owner=1)
    pool.free_all(1)
    # The stack now holds 1 and 0 on top of fresh 3 and 2: taking three
    # blocks reuses two and takes one fresh one.
    assert block_ids(pool.allocate("k", 12, owner=2)) == [1, 0, 2]
    assert pool.stats.n_reused == 2


def test_peak_blocks_in_use_is_the_high_water_mark() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 12, owner=1)
    pool.allocate("v", 8, owner=2)
    pool.free_all(1)
    pool.allocate("k", 4, owner=3)
    stats = pool.stats
    assert stats.blocks_in_use() == 3
    assert stats.peak_blocks_in_use == 5


def test_blocks_in_use_counts_checked_out_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 12, owner=1)
    pool.allocate("v", 1, owner=2)
    assert pool.stats.blocks_in_use() == 4


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("bogus", "x", None, 5), ValueError),
        (("bogus", 0, None, ""), ValueError),
        (("k", "x", None, ""), TypeError),
        (("k", 0, None, 5), ValueError),
        (("k", -3, "me", ""), ValueError),
        (("k", 1, None, ""), TypeError),
        (("k", 1, "me", 5), TypeError),
        (("k", 1, 1, ""), ValueError),
        (("k", 1000, None, "fp16"), TypeError),
        (("k", 1000, 1, ""), ValueError),
    ],
    ids=repr,
)
def test_allocate_validates_stream_then_n_tokens_then_owner_then_format(
    pool: BlockPoolAllocator, args: tuple[Any, Any, Any, Any], error: type[Exception]
) -> None:
    stream, n_tokens, owner, fmt = args
    with pool_unchanged(pool, owners=[1]), pytest.raises(error):
        pool.allocate(stream, n_tokens, owner, fmt)


@given(block_size=st.integers(1, 64), n_tokens=st.integers(1, 2000))
def test_allocate_covers_n_tokens_with_the_fewest_blocks(block_size: int, n_tokens: int) -> None:
    pool = make_pool(block_size=block_size, n_blocks=0, grow_on_exhaustion=True)
    blocks = pool.allocate("k", n_tokens, owner=1)
    assert len(blocks) == math.ceil(n_tokens / block_size)
    assert sum(b.n_used for b in blocks) == n_tokens
    assert all(b.n_used == block_size for b in blocks[:-1])
    assert 1 <= blocks[-1].n_used <= block_size
