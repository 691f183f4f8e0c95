"""Caches dropped without release() give every block back (deferred release).

mlx-lm code never calls ``release()``; a dropped book's finaliser queues its
owner (no lock: it may run inside a pool call) and the next store call, book
construction, block-taking append or ``reclaim_dropped_caches`` frees it.
The schedule explorer (``test_finaliser_schedules.py``) fires the finaliser
inside the pool's locked section on purpose; here the same holds under
real threads: 1,000 caches dropped mid-generation by 4 threads, a third of
them in reference cycles that only the garbage collector (running on
whichever thread allocates) finds.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Iterator

import pytest
from mlx_lm.generate import generate_step
from tiny_models import greedy, prompt, tiny_model

from veloxquant_mlx.memory.block_pool import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.deferred_release import reclaim_dropped_caches
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.model_kv_layout import make_pool_backed_storage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

BLOCK_SIZE = 4


@pytest.fixture
def pool() -> Iterator[BlockPoolAllocator]:
    shared = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    yield shared
    shared.check_invariants()


def _dropped_book(pool: BlockPoolAllocator, owner: int, n_tokens: int) -> None:
    PooledKVCache(pool, owner).append(n_tokens)  # the book is unreachable on return


def test_a_dropped_book_holds_its_blocks_until_a_drain(pool: BlockPoolAllocator) -> None:
    _dropped_book(pool, owner=7, n_tokens=BLOCK_SIZE + 1)
    assert pool.stats.blocks_in_use() == 4  # pool calls alone never drain
    assert reclaim_dropped_caches(pool) == 1
    assert (pool.stats.blocks_in_use(), pool.blocks_for(7)) == (0, [])
    pool.register_owner(7)  # the owner id is released too


def test_a_dropped_owner_id_can_be_claimed_again_at_once(pool: BlockPoolAllocator) -> None:
    _dropped_book(pool, owner=7, n_tokens=1)
    reused = PooledKVCache(pool, owner=7)  # construction drains before claiming
    assert reused.owner == 7
    assert pool.stats.blocks_in_use() == 0


def test_an_append_drains_before_it_would_exhaust_the_pool(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=2)
    _dropped_book(pool, owner=4, n_tokens=8 * BLOCK_SIZE)  # every block of the pool
    assert pool.stats.blocks_in_use() == 16
    book.append(BLOCK_SIZE)  # only possible with owner 4's blocks back
    assert pool.blocks_for(4) == []
    book.release()


def test_without_a_drain_the_append_would_have_exhausted(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=2)
    holder = PooledKVCache(pool, owner=4)
    holder.append(8 * BLOCK_SIZE)
    with pytest.raises(BlockPoolExhaustedError):  # the same append, blocks still held
        book.append(BLOCK_SIZE)
    holder.release()
    book.release()


def test_a_released_book_queues_nothing(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=7)
    book.append(3)
    book.release()
    pool.register_owner(7)  # someone else's now: a late finaliser must not free it
    del book
    assert reclaim_dropped_caches(pool) == 0
    pool.allocate("k", 1, owner=7)
    assert len(pool.blocks_for(7)) == 1


def test_a_book_whose_construction_failed_queues_nothing(pool: BlockPoolAllocator) -> None:
    pool.register_owner(7)
    with pytest.raises(OwnerAlreadyActiveError):
        PooledKVCache(pool, owner=7)
    gc.collect()
    assert reclaim_dropped_caches(pool) == 0
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(7)  # still the first registration's


def test_a_book_in_a_reference_cycle_comes_back_after_collection(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=7)
    book.append(1)
    cycle: list[object] = [book]
    cycle.append(cycle)
    del book, cycle
    gc.collect()
    assert reclaim_dropped_caches(pool) == 1
    assert pool.stats.blocks_in_use() == 0


def test_reclaim_dropped_caches_refuses_a_non_pool() -> None:
    with pytest.raises(TypeError, match="BlockPoolAllocator"):
        reclaim_dropped_caches("pool")  # type: ignore[arg-type]


def test_a_dropped_cache_list_comes_back_at_the_next_store_call() -> None:
    model = tiny_model("llama", seed=1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    storage = make_pool_backed_storage(model, pool)
    cache = make_pool_backed_cache(model, storage)
    greedy(model, prompt(seed=2), cache, steps=3)
    held = 2 * len(cache.book.key_blocks)  # one table for every layer: keys and values
    assert pool.stats.blocks_in_use() == held > 0
    del cache
    gc.collect()
    assert pool.stats.blocks_in_use() == held  # pool calls alone do not drain
    storage.sync()
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


# -- 1,000 caches, 4 threads ---------------------------------------------------------------

N_THREADS = 4
N_CACHES = 1000
CYCLE_EVERY = 3  # every third cache is only reachable from a cycle of its own


def test_a_thousand_caches_dropped_mid_generation_by_four_threads_all_come_back() -> None:
    model = tiny_model("llama", seed=3, n_layers=1, n_kv_heads=1, head_dim=8, vocab=32)
    # Without reclamation the first ~64 requests would exhaust this pool (no growth).
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=256))
    storage = make_pool_backed_storage(model, pool)
    owners: list[int] = []
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for index in range(N_CACHES // N_THREADS):
                cache = make_pool_backed_cache(model, storage)
                owners.append(cache.book.owner)
                tokens = prompt(rng.randrange(1 << 30), rng.randrange(1, 9), vocab=32)
                steps = generate_step(tokens, model, prompt_cache=cache, max_tokens=16)
                for _ in range(rng.randrange(4)):  # drop it mid-generation
                    next(steps)
                if index % CYCLE_EVERY == 0:
                    cache.cycle = cache  # type: ignore[attr-defined]
                del steps, cache
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    thresholds = gc.get_threshold()
    gc.set_threshold(50)  # collections (and so finalisers) inside any call, on any thread
    try:
        threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(N_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.set_threshold(*thresholds)
    assert errors == []
    assert len(owners) == N_CACHES
    assert pool.stats.n_exhausted == 0
    gc.collect()
    storage.sync()  # the store's next call: every dropped cache is back
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()
    for owner in owners:  # every owner id was released
        pool.register_owner(owner)
