"""A cache layer's ``state`` setter asks the pool for every block it will need before its
trim: a set the pool cannot supply is refused with nothing changed, and one it can
supply exactly goes through.

The setter trims the layer to nothing, then appends the new positions. Before the look,
a refusal of that append (exhaustion) left the layer empty. Each case runs twice: with
exactly the free blocks the set needs (it must succeed, so the look asks for no more
than that), and with one fewer per stream (refused, unchanged, one exhaustion counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import pytest
from conftest import assert_only_exhaustion_recorded, leave_free, observe

from veloxquant_mlx.memory.block_pool import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache, PooledKVCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage

BLOCK_SIZE, HEADS, HEAD_DIM, N_BLOCKS = 4, 2, 8, 64


@dataclass(frozen=True)
class SetCase:
    """A request of ``layers`` layers holding ``held`` positions (reserving ``reserve``
    tokens; its other layers then trimmed by ``others_trimmed`` each; then forked if
    ``fork``, or forked first if ``trims_after_fork``), whose layer 0 is set to ``new``
    positions, which takes ``need`` blocks per stream from the pool."""

    held: int
    new: int
    need: int
    layers: int = 2
    fork: bool = False
    reserve: int = 0
    others_trimmed: int = 0
    trims_after_fork: bool = False


CASES = {
    "growth, one layer": SetCase(held=5, new=13, need=2, layers=1),
    "growth past the other layers": SetCase(held=9, new=13, need=1),
    "fork, copies of the shared blocks": SetCase(held=10, new=10, need=3, fork=True),
    "fork, copies and growth": SetCase(held=10, new=14, need=4, fork=True),
    "fork, fewer positions": SetCase(held=10, new=5, need=2, fork=True),
    "fork, one layer, the trim gives back shared blocks": SetCase(
        held=10, new=14, need=4, layers=1, fork=True
    ),
    "fork, one layer, as many positions": SetCase(held=10, new=10, need=3, layers=1, fork=True),
    "fork, one layer, fewer positions": SetCase(held=10, new=3, need=1, layers=1, fork=True),
    "fork, the trim copies the new last block": SetCase(
        held=10, new=3, need=2, fork=True, others_trimmed=3
    ),
    "fork, the trim copies the new last block, then growth": SetCase(
        held=10, new=17, need=5, fork=True, others_trimmed=3
    ),
    "fork, the other layers' trims copied the block they end in: none by the set": SetCase(
        held=10, new=3, need=1, fork=True, others_trimmed=3, trims_after_fork=True
    ),
    "fork, the other layers' trims copied the block they end in, then growth": SetCase(
        held=10, new=17, need=4, fork=True, others_trimmed=3, trims_after_fork=True
    ),
    "fork, the other layers end on a block boundary: no copy by the trim": SetCase(
        held=10, new=3, need=1, fork=True, others_trimmed=2
    ),
    "reserved, growth past the reservation": SetCase(held=6, new=22, need=4, reserve=8),
    "reserved, growth into the reserve": SetCase(held=6, new=22, need=2, reserve=16),
    "reserved, the trim rebuilds the reserve": SetCase(
        held=10, new=22, need=2, layers=1, reserve=16
    ),
}


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, HEAD_DIM), key=mx.random.key(seed))


def _request(pool: BlockPoolAllocator, case: SetCase) -> PoolBackedPromptCache:
    """The request of ``case``, filled."""
    store = MLXBlockStorage(pool, case.layers, HEADS, HEAD_DIM, mx.float32)
    book = PooledKVCache(pool, n_layers=case.layers, reserve_tokens=case.reserve)
    cache = PoolBackedPromptCache(store, book)
    for layer in cache:
        layer.update_and_fetch(_tokens(case.held, 1), _tokens(case.held, 2))
    return cache


def _cache_to_set(original: PoolBackedPromptCache, case: SetCase) -> PoolBackedPromptCache:
    """The cache whose layer 0 is set: ``original`` or its fork, whose other layers are
    trimmed before the fork or after it (a trim of one layer after a fork copies the
    shared block it ends in at once; before it, the set's own trim is the one that
    copies)."""
    cache = original.fork() if case.trims_after_fork else original
    for layer in list(cache)[1:]:
        layer.trim(case.others_trimmed)
    return original.fork() if case.fork and not case.trims_after_fork else cache


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_state_set_with_exactly_the_blocks_it_needs_goes_through(case: SetCase) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    original = _request(pool, case)
    cache = _cache_to_set(original, case)
    keys, values = _tokens(case.new, 3), _tokens(case.new, 4)
    leave_free(pool, case.need)
    cache[0].state = (keys, values)
    got_keys, got_values, offset = cache[0].state
    assert offset == case.new
    assert mx.array_equal(got_keys, keys) and mx.array_equal(got_values, values)
    cache.book.check_invariants()
    pool.check_invariants()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_state_set_the_pool_cannot_supply_is_refused_and_changes_nothing(
    case: SetCase,
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    original = _request(pool, case)
    cache = _cache_to_set(original, case)
    old_keys, old_values, _ = cache[0].state
    mx.eval(old_keys, old_values)
    leave_free(pool, case.need - 1)
    book = cache.book
    handles = (*book.key_blocks, *book.value_blocks)
    before = observe(pool, [book.owner, original.book.owner], handles)
    with pytest.raises(BlockPoolExhaustedError):
        cache[0].state = (_tokens(case.new, 3), _tokens(case.new, 4))
    after = observe(pool, [book.owner, original.book.owner], handles)
    assert_only_exhaustion_recorded(before, after)
    keys, values, offset = cache[0].state
    assert offset == case.held
    assert mx.array_equal(keys, old_keys) and mx.array_equal(values, old_values)
    book.check_invariants()


def test_a_fork_whose_twin_was_dropped_unreleased_needs_no_copy_for_a_state_set() -> None:
    # The look once counted the dropped twin's blocks as shared (it ran before the drain
    # that gives them back), asked for copies, and refused a set that needed no block.
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    case = SetCase(held=8, new=1, need=0)
    twin = _request(pool, case).fork()  # the original, dropped here without release()
    leave_free(pool, 0)
    twin[0].state = (_tokens(1, 3), _tokens(1, 4))
    assert twin[0].offset == 1
    assert pool.stats.shared_blocks() == 0
