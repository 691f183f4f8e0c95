"""Block handles: the dataclass itself, identity, and stale or foreign handles."""

from __future__ import annotations

import pytest
from conftest import block_ids, handle_view, make_pool, pool_unchanged

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, InvalidFreeError, PoolConfig


def test_block_defaults_match_the_reference() -> None:
    assert handle_view(Block(3)) == (3, "kv", "fp16", 0, None, False)


def test_block_takes_its_fields_in_reference_order() -> None:
    block = Block(5, "v", "int2", 7, 42, True)
    assert handle_view(block) == (5, "v", "int2", 7, 42, True)


def test_blocks_with_equal_fields_are_not_equal() -> None:
    assert Block(1) != Block(1)


def test_a_block_equals_itself() -> None:
    block = Block(1)
    assert block == block  # noqa: PLR0124 - identity equality is the behaviour under test


def test_blocks_are_hashable_by_identity() -> None:
    a, b = Block(1), Block(1)
    assert len({a, b, a}) == 2


def test_each_checkout_hands_out_a_new_handle(pool: BlockPoolAllocator) -> None:
    first = pool.allocate("k", 4, owner=1)[0]
    pool.free([first])
    second = pool.allocate("k", 4, owner=1)[0]
    assert second.block_id == first.block_id
    assert second is not first


def test_handles_of_one_allocation_are_distinct_objects(pool: BlockPoolAllocator) -> None:
    blocks = pool.allocate("k", 16, owner=1)
    assert len({id(block) for block in blocks}) == 4


def test_a_freed_handle_stays_stale_after_its_id_is_handed_out_again(
    pool: BlockPoolAllocator,
) -> None:
    stale = pool.allocate("k", 3, owner=1, format="int2")[0]
    pool.free([stale])
    live = pool.allocate("k", 4, owner=2, format="int4")[0]
    assert live.block_id == stale.block_id
    assert handle_view(stale) == (0, "k", "int2", 0, None, True)
    assert handle_view(live) == (0, "k", "int4", 4, 2, True)


def test_a_stale_handle_is_rejected_after_its_id_is_handed_out_again(
    pool: BlockPoolAllocator,
) -> None:
    stale = pool.allocate("k", 3, owner=1)[0]
    pool.free([stale])
    live = pool.allocate("k", 4, owner=1)[0]
    with pool_unchanged(pool, owners=[1], handles=[stale, live]), pytest.raises(InvalidFreeError):
        pool.free([stale])


def test_a_handle_freed_by_free_all_is_stale(pool: BlockPoolAllocator) -> None:
    stale = pool.allocate("k", 3, owner=1)[0]
    pool.free_all(1)
    pool.allocate("k", 4, owner=2)
    with pool_unchanged(pool, owners=[1, 2], handles=[stale]), pytest.raises(InvalidFreeError):
        pool.free([stale])


def test_a_handle_freed_twice_in_two_calls_is_rejected_the_second_time(
    pool: BlockPoolAllocator,
) -> None:
    block = pool.allocate("k", 3, owner=1)[0]
    pool.free([block])
    with pool_unchanged(pool, owners=[1], handles=[block]), pytest.raises(InvalidFreeError):
        pool.free([block])


def test_a_stale_handle_of_a_retired_block_is_rejected(pool: BlockPoolAllocator) -> None:
    block = pool.allocate("k", 16, owner=1)[3]
    pool.free([block])
    assert pool.shrink("k", 0) == 1
    with pool_unchanged(pool, owners=[1], handles=[block]), pytest.raises(InvalidFreeError):
        pool.free([block])


def test_a_stale_handle_of_a_re_grown_id_is_rejected() -> None:
    pool = make_pool(block_size=4, n_blocks=2, grow_on_exhaustion=True)
    stale = pool.allocate("k", 4, owner=1)[0]
    pool.free([stale])
    pool.shrink("k", 0)
    live = pool.allocate("k", 4, owner=2)
    assert block_ids(live) == [stale.block_id]
    with (
        pool_unchanged(pool, owners=[1, 2], handles=[stale, *live]),
        pytest.raises(InvalidFreeError),
    ):
        pool.free([stale])


def test_a_live_handle_of_another_pool_is_rejected() -> None:
    pool, other = make_pool(), make_pool()
    mine = pool.allocate("k", 4, owner=1)
    theirs = other.allocate("k", 4, owner=1)
    assert handle_view(theirs[0]) == handle_view(mine[0])
    with pool_unchanged(pool, owners=[1], handles=mine + theirs), pytest.raises(InvalidFreeError):
        pool.free(theirs)


def test_the_stale_handle_hole_is_closed(pool: BlockPoolAllocator) -> None:
    """A late free() of a reused block must not free another request's memory."""
    late = pool.allocate("k", 4, owner=1)[0]
    pool.free_all(1)
    victim = pool.allocate("k", 4, owner=2)[0]
    with pytest.raises(InvalidFreeError):
        pool.free([late])
    assert victim.owner == 2
    assert pool.blocks_for(2) == [victim]


def test_a_live_handle_from_blocks_for_can_be_freed(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 8, owner=1)
    pool.free(pool.blocks_for(1))
    assert pool.blocks_for(1) == []
    assert pool.n_free("k") == 4


def test_all_live_is_true_only_when_every_item_is_a_live_handle_of_this_pool() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    other = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    held = pool.allocate("k", 8, owner=1)
    freed = pool.allocate("k", 4, owner=2)
    pool.free_all(2)
    assert pool.all_live(held)
    assert pool.all_live([])
    assert not pool.all_live([*held, *freed])
    assert not pool.all_live([*held, other.allocate("k", 1, owner=1)[0]])
    assert not pool.all_live([*held, "not a block"])


class _ByIndex:
    """Iterable through ``__getitem__`` alone, as Python's older protocol allows."""

    def __init__(self, items: list[Block]) -> None:
        self.items = items

    def __getitem__(self, index: int) -> Block:
        return self.items[index]


def test_all_live_takes_what_iterates_by_index() -> None:
    pool = make_pool()
    held = pool.allocate("k", 8, owner=1)
    assert pool.all_live(_ByIndex(held))  # type: ignore[arg-type]
    pool.free(held)
    assert not pool.all_live(_ByIndex(held))  # type: ignore[arg-type]


@pytest.mark.parametrize("blocks", [None, 5])
def test_all_live_refuses_what_is_not_iterable_naming_it(blocks: object) -> None:
    pool = make_pool()
    shown = f"{type(blocks).__name__}: {blocks}"
    with pytest.raises(
        TypeError, match=f"^blocks must be an iterable of Block handles, got {shown}$"
    ):
        pool.all_live(blocks)  # type: ignore[arg-type]
