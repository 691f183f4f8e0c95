"""Owners: register_owner / release_owner / blocks_for, and when an owner is active."""

from __future__ import annotations

import pytest
from conftest import make_pool, pool_unchanged

from veloxquant_mlx.memory.block_pool import (
    BlockPoolAllocator,
    BlockPoolError,
    OwnerAlreadyActiveError,
)


def test_register_owner_then_allocate_does_not_raise(pool: BlockPoolAllocator) -> None:
    pool.register_owner(1)
    assert len(pool.allocate("k", 4, owner=1)) == 1


def test_register_owner_twice_raises_owner_already_active(pool: BlockPoolAllocator) -> None:
    pool.register_owner(1)
    with pool_unchanged(pool, owners=[1]), pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)


def test_register_owner_of_an_owner_holding_blocks_raises(pool: BlockPoolAllocator) -> None:
    held = pool.allocate("k", 4, owner=1)
    with pool_unchanged(pool, owners=[1], handles=held), pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)


def test_owner_already_active_error_is_a_block_pool_error() -> None:
    assert issubclass(OwnerAlreadyActiveError, BlockPoolError)
    assert issubclass(OwnerAlreadyActiveError, RuntimeError)


def test_repeated_allocate_for_an_active_owner_never_raises(pool: BlockPoolAllocator) -> None:
    pool.register_owner(1)
    pool.allocate("k", 4, owner=1)
    pool.allocate("k", 4, owner=1)
    pool.allocate("v", 4, owner=1)
    assert len(pool.blocks_for(1)) == 3


def test_release_owner_clears_a_registration(pool: BlockPoolAllocator) -> None:
    pool.register_owner(1)
    pool.release_owner(1)
    pool.register_owner(1)


def test_release_owner_of_an_owner_holding_blocks_keeps_it_active(
    pool: BlockPoolAllocator,
) -> None:
    held = pool.allocate("k", 8, owner=1)
    pool.release_owner(1)
    assert pool.blocks_for(1) == held
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(1)


def test_release_owner_does_not_free_blocks(pool: BlockPoolAllocator) -> None:
    pool.register_owner(1)
    held = pool.allocate("k", 8, owner=1)
    with pool_unchanged(pool, owners=[1], handles=held):
        pool.release_owner(1)


def test_release_owner_of_an_unknown_owner_is_a_no_op(pool: BlockPoolAllocator) -> None:
    held = pool.allocate("k", 8, owner=1)
    with pool_unchanged(pool, owners=[1, 2], handles=held):
        pool.release_owner(2)


def test_register_and_release_add_no_history(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 4, owner=1)
    with pool_unchanged(pool, owners=[1, 2]):
        pool.register_owner(2)
        pool.release_owner(2)
        pool.release_owner(1)


def test_registered_owner_holding_nothing_has_no_blocks(pool: BlockPoolAllocator) -> None:
    pool.register_owner(3)
    assert pool.blocks_for(3) == []


def test_blocks_for_an_unknown_owner_is_empty(pool: BlockPoolAllocator) -> None:
    assert pool.blocks_for(42) == []


def test_blocks_for_returns_the_handles_allocate_returned(pool: BlockPoolAllocator) -> None:
    first = pool.allocate("k", 8, owner=1)
    second = pool.allocate("v", 4, owner=1)
    listed = pool.blocks_for(1)
    assert len(listed) == 3
    assert all(a is b for a, b in zip(listed, first + second, strict=True))


def test_blocks_for_returns_a_new_list_each_call(pool: BlockPoolAllocator) -> None:
    pool.allocate("k", 8, owner=1)
    listed = pool.blocks_for(1)
    assert listed is not pool.blocks_for(1)
    listed.clear()
    assert len(pool.blocks_for(1)) == 2


def test_mutating_the_list_allocate_returned_does_not_change_the_owner(
    pool: BlockPoolAllocator,
) -> None:
    blocks = pool.allocate("k", 8, owner=1)
    blocks.pop()
    assert len(pool.blocks_for(1)) == 2


def test_owners_are_independent(pool: BlockPoolAllocator) -> None:
    a = pool.allocate("k", 4, owner=1)
    b = pool.allocate("k", 4, owner=2)
    assert pool.blocks_for(1) == a
    assert pool.blocks_for(2) == b


def test_owner_zero_is_an_owner_like_any_other(pool: BlockPoolAllocator) -> None:
    pool.register_owner(0)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(0)
    held = pool.allocate("k", 8, owner=0)
    assert pool.blocks_for(0) == held
    pool.free_all(0)
    assert pool.blocks_for(0) == []
    pool.register_owner(0)


def test_owner_ids_are_per_pool() -> None:
    first, second = make_pool(), make_pool()
    first.register_owner(1)
    second.register_owner(1)
    first.allocate("k", 4, owner=2)
    second.register_owner(2)
