"""mark_used(): fill levels of live handles, fragmentation, and handles that are not live."""

from __future__ import annotations

import pytest
from conftest import handle_view, make_pool, pool_unchanged

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator


def test_mark_used_sets_the_fill_level_of_a_live_handle(pool: BlockPoolAllocator) -> None:
    block = pool.allocate("k", 4, owner=1)[0]
    pool.mark_used(block, 3)
    assert block.n_used == 3
    assert pool.blocks_for(1)[0].n_used == 3


def test_mark_used_changes_nothing_but_the_fill_level(pool: BlockPoolAllocator) -> None:
    block = pool.allocate("k", 4, owner=1, format="int2")[0]
    pool.mark_used(block, 1)
    assert handle_view(block) == (0, "k", "int2", 1, 1, True)


@pytest.mark.parametrize("n_used", [0, 4])
def test_mark_used_accepts_both_ends_of_the_range(pool: BlockPoolAllocator, n_used: int) -> None:
    block = pool.allocate("k", 2, owner=1)[0]
    pool.mark_used(block, n_used)
    assert block.n_used == n_used


@pytest.mark.parametrize(
    ("n_tokens", "new_n_used", "fragmented_after"),
    [
        (4, 4, 0),  # full stays full
        (4, 3, 1),  # full -> partial
        (4, 0, 0),  # full -> empty: an empty block is not fragmented
        (2, 3, 1),  # partial -> partial
        (2, 4, 0),  # partial -> full
        (2, 0, 0),  # partial -> empty
    ],
)
def test_mark_used_keeps_fragmentation_consistent(
    pool: BlockPoolAllocator, n_tokens: int, new_n_used: int, fragmented_after: int
) -> None:
    block = pool.allocate("k", n_tokens, owner=1)[0]
    pool.mark_used(block, new_n_used)
    stats = pool.stats
    assert stats.fragmentation() == pytest.approx(fragmented_after / 8)
    pool.check_invariants()


def test_fragmentation_counts_blocks_moved_back_and_forth(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 16, owner=1)
    for n_used in (1, 2, 4, 0, 3):
        pool.mark_used(blocks[0], n_used)
    pool.mark_used(blocks[1], 2)
    pool.mark_used(blocks[2], 0)
    pool.mark_used(blocks[2], 4)
    assert pool.stats.fragmentation() == pytest.approx(2 / 8)


def test_freeing_a_block_made_partial_by_mark_used_lowers_fragmentation(
    pool: BlockPoolAllocator,
) -> None:
    blocks = pool.allocate("k", 8, owner=1)
    pool.mark_used(blocks[0], 1)
    pool.free([blocks[0]])
    assert pool.stats.fragmentation() == 0.0
    pool.check_invariants()


def test_mark_used_adds_no_history(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 4, owner=1)
    block = pool.blocks_for(1)[0]
    history_before = len(pool.history)
    pool.mark_used(block, 2)
    assert len(pool.history) == history_before


def test_mark_used_on_a_stale_handle_only_sets_that_object(pool: BlockPoolAllocator) -> None:
    stale = pool.allocate("k", 4, owner=1)[0]
    pool.free([stale])
    live = pool.allocate("k", 4, owner=2)[0]
    assert live.block_id == stale.block_id
    with pool_unchanged(pool, owners=[1, 2], handles=[live]):
        pool.mark_used(stale, 2)
    assert stale.n_used == 2
    assert stale.owner is None


def test_mark_used_on_a_handle_freed_by_free_all_only_sets_that_object(
    pool: BlockPoolAllocator,
) -> None:
    stale = pool.allocate("k", 3, owner=1)[0]
    pool.free_all(1)
    with pool_unchanged(pool, owners=[1]):
        pool.mark_used(stale, 4)
    assert stale.n_used == 4


@pytest.mark.parametrize("stream", ["k", "v", "kv"])
def test_mark_used_on_a_hand_built_free_block_only_sets_that_object(
    pool: BlockPoolAllocator, stream: str
) -> None:
    held = pool.allocate("k", 2, owner=1)
    handmade = Block(block_id=held[0].block_id, stream=stream)
    with pool_unchanged(pool, owners=[1], handles=held):
        pool.mark_used(handmade, 3)
    assert handmade.n_used == 3


def test_shared_pool_mark_used_updates_fragmentation() -> None:
    pool = make_pool(block_size=4, n_blocks=4, separate_kv=False)
    block = pool.allocate("v", 4, owner=1)[0]
    pool.mark_used(block, 1)
    assert pool.stats.fragmentation() == pytest.approx(1 / 4)
