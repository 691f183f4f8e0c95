"""free() and free_all(): what a freed block looks like, LIFO reuse, counters, releasing."""

from __future__ import annotations

import pytest
from conftest import block_ids, make_pool, pool_unchanged

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, OwnerAlreadyActiveError


def test_freed_block_has_no_owner_and_no_used_slots() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    block = pool.allocate("v", 3, owner=1, format="int4")[0]
    pool.free([block])
    assert (block.owner, block.n_used) == (None, 0)


def test_freed_block_keeps_its_id_stream_format_and_ever_allocated() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    block = pool.allocate("v", 3, owner=1, format="int4")[0]
    pool.free([block])
    assert (block.block_id, block.stream, block.ever_allocated) == (4, "v", True)


def test_free_all_leaves_every_handle_of_the_owner_freed() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 10, owner=1)
    pool.free_all(1)
    assert [(b.owner, b.n_used, b.ever_allocated) for b in blocks] == [(None, 0, True)] * 3


def test_free_returns_blocks_to_their_streams_free_list() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    k_blocks = pool.allocate("k", 8, owner=1)
    v_blocks = pool.allocate("v", 4, owner=1)
    pool.free([v_blocks[0], k_blocks[1]])
    assert (pool.n_free("k"), pool.n_free("v")) == (3, 4)


def test_free_pushes_in_list_order_so_the_last_freed_is_reused_first() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 12, owner=1)
    pool.free([blocks[2], blocks[0]])
    assert block_ids(pool.allocate("k", 4, owner=2)) == [0]
    assert block_ids(pool.allocate("k", 4, owner=2)) == [2]


def test_reused_blocks_come_off_before_never_used_ones() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 8, owner=1)
    pool.free([blocks[0]])
    assert block_ids(pool.allocate("k", 12, owner=2)) == [0, 2, 3]


def test_free_all_pushes_in_allocation_order_so_the_last_allocated_is_reused_first() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 4, owner=1)  # id 0
    pool.allocate("k", 4, owner=2)  # id 1
    pool.allocate("k", 4, owner=1)  # id 2
    pool.free_all(1)
    assert block_ids(pool.allocate("k", 8, owner=3)) == [2, 0]


def test_free_all_allocation_order_follows_allocate_calls_not_block_ids() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    first = pool.allocate("k", 8, owner=1)  # ids 0, 1
    pool.free([first[0]])
    pool.allocate("k", 8, owner=1)  # ids 0 (reused), 2
    # Owner 1 now holds 1, 0, 2 in allocation order.
    assert block_ids(pool.blocks_for(1)) == [1, 0, 2]
    pool.free_all(1)
    assert block_ids(pool.allocate("k", 12, owner=2)) == [2, 0, 1]


def test_shared_pool_free_reuses_blocks_lifo_across_stream_names() -> None:
    pool = make_pool(block_size=4, n_blocks=8, separate_kv=False)
    k_block = pool.allocate("k", 4, owner=1)[0]
    v_block = pool.allocate("v", 4, owner=2)[0]
    pool.free([k_block, v_block])
    assert block_ids(pool.allocate("v", 8, owner=3)) == [1, 0]


@pytest.mark.parametrize("empty", [[], ()])
def test_free_of_an_empty_sequence_is_a_no_op(empty: list[object] | tuple[()]) -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    held = pool.allocate("k", 8, owner=1)
    with pool_unchanged(pool, owners=[1], handles=held):
        pool.free(empty)  # type: ignore[arg-type]


def test_free_accepts_a_tuple() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 8, owner=1)
    pool.free(tuple(blocks))  # type: ignore[arg-type]
    assert pool.blocks_for(1) == []
    assert pool.n_free("k") == 4


def test_n_frees_counts_calls_not_blocks() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 16, owner=1)
    pool.free(blocks[:3])
    pool.free(blocks[3:])
    assert pool.stats.n_frees == 2


def test_free_all_counts_as_one_free_call() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 16, owner=1)
    pool.free_all(1)
    assert pool.stats.n_frees == 1


def test_free_all_of_an_owner_holding_nothing_is_a_no_op() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    held = pool.allocate("k", 8, owner=1)
    with pool_unchanged(pool, owners=[1, 2], handles=held):
        pool.free_all(2)


def test_free_all_leaves_a_registered_owner_holding_nothing_released() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.register_owner(2)
    pool.free_all(2)
    pool.register_owner(2)


def test_free_all_releases_the_owner() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 8, owner=1)
    pool.free_all(1)
    pool.register_owner(1)


def test_free_all_releases_an_explicitly_registered_owner() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.register_owner(1)
    pool.allocate("k", 8, owner=1)
    pool.free_all(1)
    pool.register_owner(1)


def test_free_of_an_owners_last_block_releases_the_owner() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.register_owner(1)
    blocks = pool.allocate("k", 8, owner=1)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.register_owner(1)


def test_partial_free_keeps_the_owner_active() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 8, owner=1)
    pool.free([blocks[0]])
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)


def test_partial_free_keeps_the_remaining_blocks_in_allocation_order() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 16, owner=1)
    pool.free([blocks[2], blocks[0]])
    assert pool.blocks_for(1) == [blocks[1], blocks[3]]


def test_free_of_blocks_of_several_owners_in_one_call() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    a = pool.allocate("k", 4, owner=1)
    b = pool.allocate("v", 8, owner=2)
    pool.free([b[0], a[0]])
    assert pool.blocks_for(1) == []
    assert pool.blocks_for(2) == [b[1]]
    assert pool.stats.n_frees == 1
    pool.register_owner(1)


def test_free_all_touches_only_the_given_owner() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 4, owner=1)
    kept = pool.allocate("k", 8, owner=2)
    pool.free_all(1)
    assert pool.blocks_for(2) == kept
    assert [(b.owner, b.n_used) for b in kept] == [(2, 4), (2, 4)]


def test_free_does_not_lower_the_peak() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    pool.allocate("k", 16, owner=1)
    pool.free_all(1)
    assert pool.stats.peak_blocks_in_use == 4
    assert pool.stats.blocks_in_use() == 0


def test_free_of_a_partly_used_block_lowers_fragmentation() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 6, owner=1)
    assert pool.stats.fragmentation() == pytest.approx(1 / 8)
    pool.free([blocks[1]])
    assert pool.stats.fragmentation() == 0.0


def test_free_leaves_other_counters_alone(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 6, owner=1)
    pool.free(blocks)
    stats = pool.stats
    assert (stats.n_allocations, stats.n_reused, stats.n_exhausted) == (1, 0, 0)
    assert (stats.n_grown, stats.n_retired, stats.n_blocks) == (0, 0, 8)
