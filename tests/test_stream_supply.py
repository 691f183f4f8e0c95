"""A KV cache's checkout of both streams is all or nothing, in the pool too.

Before ``stream_supply``, a book took its key blocks, then asked for the value
blocks, and gave the key blocks back if those were refused. The refused request
left the pool changed: growth for the keys stayed (a later request that a fresh
pool admits was refused), and the counters showed a checkout, a free and a peak
no request held. A copy-on-write of a fork's shared blocks moved the key block
before the value block was refused.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import assert_only_exhaustion_recorded, observe, pool_unchanged

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache, StaleBlockTableError
from veloxquant_mlx.memory.stream_supply import require_supply

BLOCK_SIZE = 4


def refused_append(pool: BlockPoolAllocator, book: PooledKVCache, n_tokens: int) -> str:
    """Append ``n_tokens`` to ``book``; it must be refused, counted once, nothing else changed."""
    before = observe(pool)
    with pytest.raises(BlockPoolExhaustedError) as refused:
        book.append(n_tokens)
    assert_only_exhaustion_recorded(before, observe(pool))
    assert book.offset == 0
    pool.check_invariants()
    return str(refused.value)


def test_a_refused_request_leaves_no_growth_behind() -> None:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=0, grow_on_exhaustion=True, max_blocks=10)
    )
    big = PooledKVCache(pool)
    message = refused_append(pool, big, 6 * BLOCK_SIZE)  # 6 + 6 blocks > max_blocks
    assert "needs 6 k block(s) and 6 v block(s) at once" in message
    assert "growing by 12 would take the pool past max_blocks=10 (it has 0)" in message
    big.release()
    fits = PooledKVCache(pool)
    fits.append(5 * BLOCK_SIZE)  # what a fresh pool admits is still admitted
    assert (pool.n_free("k"), pool.n_free("v"), pool.stats.n_blocks) == (0, 0, 10)
    fits.release()


@pytest.mark.parametrize("separate_kv", [True, False])
def test_a_request_the_free_lists_cannot_serve_takes_no_block(separate_kv: bool) -> None:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=10, separate_kv=separate_kv)
    )
    holder = PooledKVCache(pool)
    holder.append(BLOCK_SIZE)  # one block of each stream in use
    book = PooledKVCache(pool)
    message = refused_append(pool, book, 5 * BLOCK_SIZE)
    assert "growth is off" in message
    assert ("k: 4 free, v: 4 free" if separate_kv else "kv: 8 free") in message
    holder.release()
    book.release()


def test_only_the_value_stream_short_takes_no_key_block() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=8))
    values = pool.allocate("v", BLOCK_SIZE, owner=9)  # the keys have 4 free, the values 3
    book = PooledKVCache(pool)
    refused_append(pool, book, 4 * BLOCK_SIZE)
    pool.free(values)
    book.release()


def test_a_refused_copy_on_write_moves_neither_block() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=5, separate_kv=False))
    parent = PooledKVCache(pool)
    parent.append(BLOCK_SIZE + 2)  # 2 + 2 blocks, the last ones half full: 1 block free
    child = parent.fork()
    keys, values = child.key_blocks, child.value_blocks
    owners = [parent.owner, child.owner]
    before, moved = observe(pool, owners), pool.stats.n_copy_on_write
    wanted = re.escape("needs 1 k block(s) and 1 v block(s)")
    with pytest.raises(BlockPoolExhaustedError, match=wanted):
        child.trim(1)  # the shared last blocks would each need a private copy
    assert_only_exhaustion_recorded(before, observe(pool, owners))
    assert pool.stats.n_copy_on_write == moved
    assert (child.key_blocks, child.value_blocks, child.offset) == (keys, values, BLOCK_SIZE + 2)
    assert all(pool.is_live(block) for block in (*keys, *values))
    child.release()
    parent.release()


class _Understating:
    """A pool that reports fewer free blocks than it has (another thread freed some)."""

    def __init__(self, pool: BlockPoolAllocator) -> None:
        self._pool = pool

    def n_free(self, stream: str = "k") -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def test_blocks_that_came_free_after_the_look_are_given_back() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=8))
    given_back: list[list[Block]] = []
    require_supply(_Understating(pool), {"k": 2, "v": 2}, 7, "fp16", given_back.append)
    assert [len(blocks) for blocks in given_back] == [4]  # what both streams "lacked"
    assert [block.owner for block in given_back[0]] == [7] * 4
    assert pool.stats.n_exhausted == 0


def test_a_demand_the_pool_meets_makes_no_call() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=4))  # 2 per stream
    with pool_unchanged(pool):
        require_supply(pool, {"k": 2, "v": 2}, 7, "fp16", lambda blocks: pytest.fail("no call"))


def test_a_copy_on_write_of_a_block_freed_behind_the_book_names_that_block() -> None:
    # The freed handle is the fault: asking the pool for the other block's copy first
    # reported a full pool, and before that a mark_used of a shared block failed.
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=4, separate_kv=False))
    parent = PooledKVCache(pool)
    parent.append(BLOCK_SIZE + 2)  # 2 + 2 blocks: the pool is full
    child = parent.fork()
    pool.free([child.key_blocks[-1]])  # behind the child's back
    moved = pool.stats.n_copy_on_write
    with (
        pool_unchanged(pool, owners=[parent.owner, child.owner]),
        pytest.raises(StaleBlockTableError, match="freed or moved behind the book's back"),
    ):
        child.trim(1)  # its last blocks would need private copies
    assert (pool.stats.n_copy_on_write, child.offset) == (moved, 6)
    child.release()
    parent.release()


@pytest.mark.parametrize("reserve_tokens", [0, 40])
def test_a_rewrite_over_a_block_freed_behind_the_book_names_that_block(
    reserve_tokens: int,
) -> None:
    # A layer trimmed alone after a fork writes its positions again, which moves their
    # shared blocks: with a value handle freed behind the book's back and a full pool,
    # the rewrite reported the full pool (the range's supply came first), where the
    # copy-on-write of one block names the stale handle whatever the pool could supply.
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=24))
    book = PooledKVCache(pool, n_layers=2, reserve_tokens=reserve_tokens)
    book.append(2 * BLOCK_SIZE, layer=0)
    book.append(2 * BLOCK_SIZE, layer=1)
    twin = book.fork()
    book.trim(BLOCK_SIZE, layer=0)
    stale = book.value_blocks[1]
    pool.free([stale])  # behind the book's back; the twin's handle keeps the block
    for stream in ("k", "v"):
        pool.allocate(stream, pool.n_free(stream) * BLOCK_SIZE, owner=999)
    with (
        pool_unchanged(pool, owners=[book.owner, twin.owner]),
        pytest.raises(StaleBlockTableError, match=re.escape(f"block {stale!r} of owner")),
    ):
        book.append(BLOCK_SIZE, layer=0)
    assert (book.layer_offset(0), book.offset) == (BLOCK_SIZE, 2 * BLOCK_SIZE)
    twin.release()
    book.release()  # its live handles; the stale one is no longer its to free
    assert pool.blocks_for(book.owner) == []
