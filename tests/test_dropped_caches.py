"""Caches dropped without release() give every block back (deferred release).

mlx-lm code never calls ``release()``; a dropped book's finaliser queues
what it holds (no lock: it may run inside a pool call) and the next book
construction, block-taking append, pool-backed cache update or
``reclaim_dropped_caches`` releases it, by handle: a late release never frees
a request that reused the id. The schedule explorers
(``test_finaliser_schedules.py``, ``test_finaliser_reuse_schedules.py``)
fire the finaliser inside the pool's locked section on purpose; here the same
holds under real threads: 1,000 caches dropped mid-generation by 4 threads,
a third of them in reference cycles that only the garbage collector (running
on whichever thread allocates) finds. Such a cycle often outlives the young
generations, so an append the pool refuses runs a full collection and tries
again; the tests count the collections to show when that happens.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import gc
import random
import sys
import threading
import time
from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from tiny_models import greedy, prompt, tiny_model

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.deferred_release import (
    DeferredReleases,
    deferred_releases_for,
    reclaim_dropped_caches,
)
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


def test_a_drain_counts_every_dropped_book_once(pool: BlockPoolAllocator) -> None:
    books = [PooledKVCache(pool, owner) for owner in (7, 8, 9)]  # a book drains when built
    for book in books:
        book.append(1)
    del book, books
    assert reclaim_dropped_caches(pool) == 3
    assert pool.stats.blocks_in_use() == 0


def test_a_dropped_book_holding_no_block_gives_its_owner_id_back(pool: BlockPoolAllocator) -> None:
    _dropped_book(pool, owner=7, n_tokens=0)  # a registration alone
    assert reclaim_dropped_caches(pool) == 1
    pool.register_owner(7)


def test_a_dropped_book_whose_blocks_went_behind_its_back_still_counts_its_claim(
    pool: BlockPoolAllocator,
) -> None:
    # Nothing of it was live; its claim was still current, so the drain released that.
    book = PooledKVCache(pool, owner=7)
    book.append(3)
    pool.free_all(7)
    del book
    assert reclaim_dropped_caches(pool) == 1


def test_an_automatic_owner_skips_an_id_that_is_already_active(pool: BlockPoolAllocator) -> None:
    probe = PooledKVCache(pool)
    probe.release()
    pool.register_owner(probe.owner + 1)  # the next id the books would try
    assert PooledKVCache(pool).owner == probe.owner + 2


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


@contextlib.contextmanager
def _collections_counted() -> Iterator[list[int]]:
    """Automatic collection off; yields a list that grows by one per collection run."""
    runs: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(count)
    try:
        yield runs
    finally:
        gc.callbacks.remove(count)
        if was_enabled:
            gc.enable()


def _book_dropped_in_a_cycle(pool: BlockPoolAllocator, owner: int, n_tokens: int) -> None:
    book = PooledKVCache(pool, owner)
    book.append(n_tokens)
    book.cycle = book  # type: ignore[attr-defined]


@pytest.mark.parametrize("separate_kv", [True, False])
def test_a_refused_append_collects_a_book_dropped_in_a_cycle_and_succeeds(
    separate_kv: bool,
) -> None:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=16, separate_kv=separate_kv)
    )
    book = PooledKVCache(pool, owner=2)
    with _collections_counted() as runs:
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=8 * BLOCK_SIZE)  # the whole pool
        assert reclaim_dropped_caches(pool) == 0  # the cycle keeps it from its finaliser
        book.append(BLOCK_SIZE)
    assert runs == [2]  # one full collection
    assert (pool.blocks_for(4), len(pool.blocks_for(2))) == ([], 2)
    assert pool.stats.n_exhausted == 1  # the refusal the collection then served
    book.release()


def test_a_refusal_is_tried_again_when_another_threads_collection_gave_blocks_back(
    pool: BlockPoolAllocator,
) -> None:
    # Threads refused at once share one collection: once what came back was counted
    # from after the refusal, so blocks another thread's collection gave back in between
    # did not count, and the second thread was refused with the blocks free.
    book = PooledKVCache(pool, owner=2)
    releases = deferred_releases_for(pool)
    attempts: list[int] = []

    def check_out() -> list[Block]:
        attempts.append(1)
        if len(attempts) > 1:
            return pool.allocate("k", BLOCK_SIZE, owner=2)
        try:
            return pool.allocate("k", BLOCK_SIZE, owner=2)  # refused: nothing is free
        finally:  # meanwhile, another thread's shared collection and drain
            releases._collect_garbage()
            releases.drain()

    with _collections_counted():
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=8 * BLOCK_SIZE)  # the whole pool
        taken = releases.check_out_reclaiming(check_out)
    assert (len(attempts), len(taken)) == (2, 1)
    pool.free(taken)
    book.release()


def test_an_append_the_free_lists_serve_collects_nothing(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=2)
    with _collections_counted() as runs:
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=4 * BLOCK_SIZE)  # half the pool
        book.append(4 * BLOCK_SIZE)  # the other half
    assert runs == []
    assert len(pool.blocks_for(4)) == 8  # still garbage, found by the next collection
    gc.collect()
    assert reclaim_dropped_caches(pool) == 1
    book.release()


def test_a_pool_that_may_grow_grows_instead_of_collecting() -> None:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=4, grow_on_exhaustion=True, max_blocks=6)
    )
    book = PooledKVCache(pool, owner=2)
    with _collections_counted() as runs:
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=2 * BLOCK_SIZE)  # the whole pool
        book.append(BLOCK_SIZE)  # grows to max_blocks
        assert (runs, pool.stats.n_blocks) == ([], 6)
        book.append(BLOCK_SIZE)  # growth is used up: now it collects
    assert runs == [2]
    assert (pool.blocks_for(4), pool.stats.n_blocks) == ([], 6)
    book.release()
    pool.check_invariants()


def test_a_full_pool_of_live_books_still_refuses_after_one_collection(
    pool: BlockPoolAllocator,
) -> None:
    book = PooledKVCache(pool, owner=2)
    holder = PooledKVCache(pool, owner=4)
    holder.append(8 * BLOCK_SIZE)
    with _collections_counted() as runs, pytest.raises(BlockPoolExhaustedError):
        book.append(BLOCK_SIZE)
    assert runs == [2]
    # Counted once: the collection gave nothing back, so the refusal was not tried again.
    assert (len(pool.blocks_for(4)), pool.blocks_for(2), pool.stats.n_exhausted) == (16, [], 1)
    holder.release()
    book.release()


def test_a_lone_book_is_refused_without_a_collection(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=2)
    pool.allocate("k", 8 * BLOCK_SIZE, owner=9)  # held outside any book: no garbage to find
    with _collections_counted() as runs, pytest.raises(BlockPoolExhaustedError):
        book.append(BLOCK_SIZE)
    assert runs == []
    pool.free_all(9)
    book.release()


@pytest.mark.parametrize("change", ["append", "trim"])
def test_a_refused_copy_on_write_collects_a_book_dropped_in_a_cycle_and_succeeds(
    pool: BlockPoolAllocator, change: str
) -> None:
    parent = PooledKVCache(pool, owner=2)
    parent.append(BLOCK_SIZE + 2)  # the last K and V blocks half full: copy-on-write moves them
    child = parent.fork(owner=3)
    copied: list[int] = []
    child.copy_block = lambda old_id, block: copied.append(old_id)
    with _collections_counted() as runs:
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=6 * BLOCK_SIZE)  # every free block
        child.append(1) if change == "append" else child.trim(1)
    assert runs == [2]  # one full collection, for the move of the last K block
    assert pool.blocks_for(4) == []
    assert copied == [parent.key_blocks[-1].block_id, parent.value_blocks[-1].block_id]
    assert [pool.ref_count(block.block_id) for block in child.key_blocks] == [2, 1]
    assert child.size() == (BLOCK_SIZE + 3 if change == "append" else BLOCK_SIZE + 1)
    assert pool.stats.n_exhausted == 1
    child.release()
    parent.release()


def test_a_copy_on_write_retried_after_a_collection_moves_only_what_the_refusal_left(
    pool: BlockPoolAllocator,
) -> None:
    parent = PooledKVCache(pool, owner=2)
    parent.append(BLOCK_SIZE + 2)  # K and V blocks 0 and 1, block 1 half full
    child = parent.fork(owner=3)
    copied: list[int] = []
    child.copy_block = lambda old_id, block: copied.append(old_id)
    pool.allocate("v", BLOCK_SIZE, owner=9)  # one V block held outside the books
    with _collections_counted() as runs:
        _book_dropped_in_a_cycle(pool, owner=4, n_tokens=5 * BLOCK_SIZE)  # 1 K block left free
        child.append(1)  # the K block moves; the V block is refused, then moves
    assert runs == [2]
    assert copied == [parent.key_blocks[-1].block_id, parent.value_blocks[-1].block_id]
    assert [pool.is_shared(block.block_id) for block in child.key_blocks] == [True, False]
    assert [pool.is_shared(block.block_id) for block in child.value_blocks] == [True, False]
    child.check_invariants()
    child.release()
    parent.release()
    pool.free_all(9)


def test_a_trim_whose_copy_on_write_is_refused_changes_nothing(pool: BlockPoolAllocator) -> None:
    parent = PooledKVCache(pool, owner=2)
    parent.append(2 * BLOCK_SIZE)  # two full blocks per stream, both shared after the fork
    child = parent.fork(owner=3)
    child.append(BLOCK_SIZE, layer=0)  # a third, private block per stream
    held = pool.allocate("k", 5 * BLOCK_SIZE, owner=9) + pool.allocate("v", 5 * BLOCK_SIZE, 9)
    before = (child.size(), child.key_blocks, child.value_blocks, child.table_version)
    with pytest.raises(BlockPoolExhaustedError):
        child.trim(BLOCK_SIZE + 1)  # back into block 1, shared: its fill needs a copy
    assert (child.size(), child.key_blocks, child.value_blocks, child.table_version) == before
    child.check_invariants()
    pool.free(held)
    assert child.trim(BLOCK_SIZE + 1) == BLOCK_SIZE + 1  # a block for the copy: it goes through
    assert (child.size(), [pool.is_shared(b.block_id) for b in child.key_blocks]) == (
        2 * BLOCK_SIZE - 1,
        [True, False],
    )
    child.check_invariants()
    child.release()
    parent.release()
    assert pool.stats.blocks_in_use() == 0


def test_a_rewrite_after_a_fork_that_cannot_also_grow_moves_nothing(
    pool: BlockPoolAllocator,
) -> None:
    """Layer 0, trimmed alone, is written again past the extent: its two shared blocks
    per stream must move and a third be checked out. The pool is asked for all of it
    first, so a refusal moves no block; the rewrite alone then goes through."""
    parent = PooledKVCache(pool, owner=2, n_layers=2)
    for layer in (0, 1):
        parent.append(2 * BLOCK_SIZE, layer=layer)  # two full blocks per stream
    child = parent.fork(owner=3)
    child.trim(2 * BLOCK_SIZE, layer=0)  # layer 1 still holds every position
    free = pool.n_free("k")
    held = pool.allocate("k", (free - 2) * BLOCK_SIZE, owner=9)
    held += pool.allocate("v", (free - 2) * BLOCK_SIZE, owner=9)  # two left per stream
    before = (child.key_blocks, child.value_blocks, pool.stats.n_copy_on_write)
    with pytest.raises(BlockPoolExhaustedError):
        child.append(2 * BLOCK_SIZE + 1, layer=0)  # 2 moves + 1 new block, per stream
    assert (child.key_blocks, child.value_blocks, pool.stats.n_copy_on_write) == before
    assert child.layer_offset(0) == 0
    child.check_invariants()
    assert child.append(2 * BLOCK_SIZE, layer=0) == 0  # the moves alone fit
    assert pool.stats.n_copy_on_write == 4
    assert not any(pool.is_shared(b.block_id) for b in child.key_blocks + child.value_blocks)
    child.check_invariants()
    parent.check_invariants()
    child.release()
    parent.release()
    pool.free(held)
    assert pool.stats.blocks_in_use() == 0


def test_reclaim_dropped_caches_refuses_a_non_pool() -> None:
    expected = "pool must be a BlockPoolAllocator, got str"
    with pytest.raises(TypeError, match=expected):
        reclaim_dropped_caches("pool")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=expected):
        deferred_releases_for("pool")  # type: ignore[arg-type]


def test_a_dropped_cache_list_comes_back_at_another_cache_s_next_update() -> None:
    model = tiny_model("llama", seed=1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    storage = make_pool_backed_storage(model, pool)
    cache = make_pool_backed_cache(model, storage)
    other = make_pool_backed_cache(model, storage)
    greedy(model, prompt(seed=2), cache, steps=3)
    held = 2 * len(cache.book.key_blocks)  # one table for every layer: keys and values
    assert pool.stats.blocks_in_use() == held > 0
    del cache
    gc.collect()
    storage.sync()
    assert pool.stats.blocks_in_use() == held  # neither pool nor store calls drain
    keys = mx.zeros((1, *storage.slot_shape[:1], 1, storage.slot_shape[1]))
    other[0].update_and_fetch(keys, keys)  # any update of a cache on the pool does
    assert pool.stats.blocks_in_use() == 2
    other.release()
    pool.check_invariants()


# -- reused owner ids: a late release frees only what the dropped book held --------------


def test_a_late_release_never_frees_a_request_that_reused_the_id(pool: BlockPoolAllocator) -> None:
    old = PooledKVCache(pool, owner=7)
    old.append(3)
    pool.free_all(7)  # a server ends the request through the pool, not release()
    new = PooledKVCache(pool, owner=7)
    new.append(5)
    del old
    assert reclaim_dropped_caches(pool) == 0  # nothing of the old book was live
    new.check_invariants()
    assert len(pool.blocks_for(7)) == 4


def test_a_late_release_of_a_bare_claim_never_releases_the_new_claim(
    pool: BlockPoolAllocator,
) -> None:
    old = PooledKVCache(pool, owner=7)  # holds its id with no block
    pool.release_owner(7)  # ended behind its back
    new = PooledKVCache(pool, owner=7)
    del old
    assert reclaim_dropped_caches(pool) == 0
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(7)  # still the new book's
    new.release()


def test_release_after_the_id_was_reused_frees_only_its_own_blocks(
    pool: BlockPoolAllocator,
) -> None:
    old = PooledKVCache(pool, owner=7)
    old.append(3)
    pool.free_all(7)
    new = PooledKVCache(pool, owner=7)
    new.append(5)
    old.release()
    assert old.released
    new.check_invariants()


def test_a_trim_that_loses_its_id_to_outside_code_leaves_the_book_released(
    pool: BlockPoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    book = PooledKVCache(pool, owner=7)
    book.append(3)
    real_free = pool.free
    outsider: list[Block] = []

    def free_then_outside_code_takes_the_id(blocks: list[Block]) -> None:
        real_free(blocks)
        outsider.extend(pool.allocate("k", 5, owner=7))  # not a book: no claim lock

    monkeypatch.setattr(pool, "free", free_then_outside_code_takes_the_id)
    with pytest.raises(OwnerAlreadyActiveError, match="owner 7 was taken"):
        book.trim(3)
    monkeypatch.undo()
    assert book.released
    del book
    assert reclaim_dropped_caches(pool) == 0  # a released book queues nothing
    assert pool.blocks_for(7) == outsider


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_book_cannot_be_copied(pool: BlockPoolAllocator, copier: object) -> None:
    book = PooledKVCache(pool, owner=7)
    with pytest.raises(TypeError, match="cannot be copied"):
        copier(book)  # type: ignore[operator]
    book.release()


def test_an_interrupted_drain_puts_the_book_back(
    pool: BlockPoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dropped_book(pool, owner=7, n_tokens=3)
    real_free = pool.free

    def interrupted(blocks: list[Block]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pool, "free", interrupted)
    with pytest.raises(KeyboardInterrupt):
        reclaim_dropped_caches(pool)
    monkeypatch.setattr(pool, "free", real_free)
    assert reclaim_dropped_caches(pool) == 1
    assert pool.stats.blocks_in_use() == 0


def test_a_claim_finishes_the_release_another_thread_is_making(
    pool: BlockPoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dropped_book(pool, owner=7, n_tokens=3)
    real_free = pool.free
    drainer_inside, claimed = threading.Event(), threading.Event()

    def paused_on_the_drainer(blocks: list[Block]) -> None:
        if threading.current_thread().name == "drainer":
            drainer_inside.set()  # the book is off the queue, its blocks not yet freed
            assert claimed.wait(JOIN_TIMEOUT_S)
        real_free(blocks)

    monkeypatch.setattr(pool, "free", paused_on_the_drainer)
    drainer = threading.Thread(
        target=reclaim_dropped_caches, args=(pool,), name="drainer", daemon=True
    )
    drainer.start()
    assert drainer_inside.wait(JOIN_TIMEOUT_S)
    try:
        new = PooledKVCache(pool, owner=7)  # not OwnerAlreadyActiveError
    finally:
        claimed.set()
        drainer.join(JOIN_TIMEOUT_S)
    assert not drainer.is_alive()
    new.append(2)
    new.check_invariants()
    new.release()


# -- 1,000 caches, 4 threads ---------------------------------------------------------------

N_THREADS = 4
N_CACHES = 1000
CYCLE_EVERY = 3  # every third cache is only reachable from a cycle of its own
#: A hung thread fails the test after this long (the run takes a few seconds), with
#: every thread's stack on stderr, instead of hanging the suite.
JOIN_TIMEOUT_S = 120.0


def test_a_thousand_caches_dropped_mid_generation_by_four_threads_all_come_back() -> None:
    model = tiny_model("llama", seed=3, n_layers=1, n_kv_heads=1, head_dim=8, vocab=32)
    # Without reclamation the first ~64 requests would exhaust this pool (no growth).
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=256))
    storage = make_pool_backed_storage(model, pool)
    owners: list[int] = []
    positions_at_drop: list[int] = []
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for index in range(N_CACHES // N_THREADS):
                cache = make_pool_backed_cache(model, storage)
                owners.append(cache.book.owner)
                tokens = prompt(rng.randrange(1 << 30), rng.randrange(1, 9), vocab=32)
                steps = generate_step(tokens, model, prompt_cache=cache, max_tokens=16)
                for _ in range(rng.randrange(1, 5)):  # generate, then drop mid-generation
                    next(steps)
                positions_at_drop.append(cache.book.offset)
                if index % CYCLE_EVERY == 0:
                    cache.cycle = cache  # type: ignore[attr-defined]
                del steps, cache
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    thresholds = gc.get_threshold()
    gc.set_threshold(50)  # collections (and so finalisers) inside any call, on any thread
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S, file=sys.stderr)
    try:
        threads = [
            threading.Thread(target=serve, args=(seed,), daemon=True) for seed in range(N_THREADS)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert [thread.is_alive() for thread in threads] == [False] * N_THREADS, "hung"
    finally:
        faulthandler.cancel_dump_traceback_later()
        gc.set_threshold(*thresholds)
    # No request was refused. (A refusal that a collection then served still counts in
    # pool.stats.n_exhausted, so that number is not the measure here.)
    assert errors == []
    assert len(owners) == N_CACHES
    assert min(positions_at_drop) > 0, "every cache must hold blocks when it is dropped"
    gc.collect()
    reclaim_dropped_caches(pool)
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()
    for owner in owners:  # every owner id was released
        pool.register_owner(owner)


def test_a_cache_list_cannot_be_deep_copied() -> None:
    model = tiny_model("llama", seed=1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    cache = make_pool_backed_cache(model, make_pool_backed_storage(model, pool))
    with pytest.raises(TypeError, match="make_pool_backed_cache and copy_from"):
        copy.deepcopy(cache)
    cache.release()


def test_a_dropped_cache_list_needs_no_garbage_collection_to_come_back() -> None:
    model = tiny_model("llama", seed=1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    storage = make_pool_backed_storage(model, pool)
    gc.disable()  # only reference counting: no cycle may hold the book
    try:
        cache = make_pool_backed_cache(model, storage)
        greedy(model, prompt(seed=2), cache, steps=3)  # the decode path: tables, slot rows
        del cache
        assert reclaim_dropped_caches(pool) == 1
    finally:
        gc.enable()
    assert pool.stats.blocks_in_use() == 0


def test_a_pool_and_its_owner_claims_are_collected_together() -> None:
    """The pool keeps its claims registry (no weak reference: a compiled pool has none);
    the cycle between them must not keep either alive."""

    def registries() -> int:
        return sum(isinstance(o, DeferredReleases) for o in gc.get_objects())

    gc.collect()
    before = registries()
    pool = BlockPoolAllocator(PoolConfig(n_blocks=4, block_size=4))
    assert deferred_releases_for(pool) is deferred_releases_for(pool)
    assert registries() == before + 1
    del pool
    gc.collect()
    assert registries() == before
