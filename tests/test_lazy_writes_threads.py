"""A lazy_writes store used from a second thread says so, and keeps serving its own.

MLX streams are per thread, so a lazy write leaves a graph that only its own
thread can evaluate. Unchecked, a second thread's call failed with "There is
no Stream(cpu, 1) in current thread" and left a slab that broke every later
call on the first thread too. Now the store belongs to the first thread that
calls it, and any other thread is refused, naming ``lazy_writes`` and both
threads, before anything changes. A store belongs to the first thread that
writes or reads data through it; ``capacity()`` and ``resident_bytes()``
(a metrics thread's calls) answer on any thread and never bind it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import mlx.core as mx
import pytest
from conftest import pool_unchanged
from threads import in_thread

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

Call = Callable[[MLXBlockStorage, Block], object]

CALLS: dict[str, Call] = {
    "write": lambda store, block: store.write(0, block, 1, mx.full((1, 1, 2), 5.0)),
    "gather": lambda store, block: store.gather(0, [block], 2),
    "gather_heads": lambda store, block: store.gather_heads(0, [block], 2),
    "sync": lambda store, block: store.sync(),
}


def _lazy_store() -> tuple[BlockPoolAllocator, MLXBlockStorage, Block]:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    [block] = pool.allocate("k", 4, owner=1)
    store.write(0, block, 0, mx.ones((1, 1, 2)))  # a pending graph: the main thread's
    return pool, store, block


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_second_thread_is_refused_by_name_and_nothing_changes(call: Call) -> None:
    pool, store, block = _lazy_store()
    with pool_unchanged(pool, owners=[1], handles=[block]):
        error = in_thread("intruder", lambda: call(store, block))
    assert isinstance(error, RuntimeError)
    message = str(error)
    assert "lazy_writes" in message
    assert "'MainThread'" in message
    assert "'intruder'" in message


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_the_store_stays_usable_from_its_own_thread(call: Call) -> None:
    _, store, block = _lazy_store()
    in_thread("intruder", lambda: call(store, block))
    store.write(0, block, 1, mx.full((1, 1, 2), 2.0))
    gathered = store.gather(0, [block], 2)
    assert gathered.reshape(-1).tolist() == [1.0, 1.0, 2.0, 2.0]
    assert store.capacity() == 8


def test_the_first_thread_to_call_owns_the_store() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)  # built on main
    [block] = pool.allocate("k", 4, owner=1)

    decoder: list[int | None] = []

    def decode_loop() -> None:
        decoder.append(threading.current_thread().ident)
        store.write(0, block, 0, mx.ones((1, 1, 2)))
        mx.eval(store.gather(0, [block], 1))

    assert in_thread("decoder", decode_loop) is None
    main = threading.main_thread()
    expected = (
        f"this MLXBlockStorage has lazy_writes=True, so it belongs to thread 'decoder' "
        f"(ident {decoder[0]}), the first to write or read data through it, but it was "
        f"called from thread 'MainThread' (ident {main.ident}); a lazy write leaves an MLX "
        "graph on its thread's stream that no other thread can evaluate, so share a store "
        "between threads with lazy_writes=False"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(expected)}$"):
        store.sync()


def test_a_pool_backed_cache_on_a_second_thread_is_refused_and_keeps_its_positions() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    [cache] = PoolBackedPromptCache(store, PooledKVCache(pool))
    one = mx.ones((1, 1, 1, 2))
    cache.update_and_fetch(one, one)
    error = in_thread("intruder", lambda: cache.update_and_fetch(one, one))
    assert isinstance(error, RuntimeError)
    assert "lazy_writes" in str(error)
    assert cache.offset == 1
    keys, _ = cache.update_and_fetch(one * 2, one * 2)
    assert keys.reshape(-1).tolist() == [1.0, 1.0, 2.0, 2.0]
    cache.book.check_invariants()
    cache.book.release()


def test_a_new_request_on_a_second_thread_is_refused_before_it_takes_a_block() -> None:
    # Once its book took a key and a value block first, then gave them back when the store
    # refused the thread: the pool's counters showed a checkout and a free.
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    [cache] = PoolBackedPromptCache(store, PooledKVCache(pool))
    one = mx.ones((1, 1, 1, 2))
    cache.update_and_fetch(one, one)  # the store is the main thread's
    [other] = PoolBackedPromptCache(store, PooledKVCache(pool))
    with pool_unchanged(pool, owners=[cache.book.owner, other.book.owner]):
        error = in_thread("intruder", lambda: other.update_and_fetch(one, one))
    assert isinstance(error, RuntimeError)
    assert "'intruder'" in str(error)
    assert (other.offset, other.book.key_blocks) == (0, ())
    cache.book.release()
    other.book.release()


@pytest.mark.parametrize(
    "change", ["trim", "state", "book trim", "book's fork's trim", "book growth past a copy"]
)
def test_a_forks_trim_or_state_on_a_second_thread_is_refused_before_it_moves_a_block(
    change: str,
) -> None:
    # Once a trim there moved the fork's shared blocks to copies, then the store refused
    # to copy the data: the fork read zeros where its positions had been.
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=16))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    parent = PoolBackedPromptCache(store, PooledKVCache(pool))
    held = mx.arange(12, dtype=mx.float32).reshape(1, 1, 6, 2) + 1
    parent[0].update_and_fetch(held, held)
    child = parent.fork()
    twin = parent.book.fork()
    calls: dict[str, Callable[[], object]] = {
        "trim": lambda: child[0].trim(1),
        "state": lambda: setattr(child[0], "state", (held[:, :, :2], held[:, :, :2], 2)),
        # The book, as PoolBackedPromptCache.book hands it out: it moved the block, then
        # the store refused the copy (the book asks the store first now: before_copy).
        "book trim": lambda: child.book.trim(1),
        # A fork of the book itself: the check goes with copy_block to the twin.
        "book's fork's trim": lambda: twin.trim(1),
        # Three new blocks and a copy of the shared, partly filled last one.
        "book growth past a copy": lambda: child.book.append(12),
    }
    owners = [parent.book.owner, child.book.owner, twin.owner]
    with pool_unchanged(pool, owners=owners):
        error = in_thread("intruder", calls[change])
    assert isinstance(error, RuntimeError)
    assert (child[0].offset, twin.offset) == (6, 6)
    assert mx.array_equal(child[0].state[0], held)
    twin.release()
    child.book.release()
    parent.book.release()


def test_a_store_without_lazy_writes_serves_every_thread() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32)
    [block] = pool.allocate("k", 4, owner=1)
    assert in_thread("writer", lambda: store.write(0, block, 0, mx.ones((1, 1, 2)))) is None
    assert store.gather(0, [block], 1).reshape(-1).tolist() == [1.0, 1.0]


def test_sizes_answer_on_any_thread_and_never_bind_the_store() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    [block] = pool.allocate("k", 4, owner=1)
    sizes: list[int] = []
    assert (
        in_thread("metrics", lambda: sizes.extend([store.capacity(), store.resident_bytes()]))
        is None
    )
    assert sizes == [8, 8 * 4 * 2 * 4]  # blocks, and bytes of 8 blocks of 4 slots of 2 floats
    store.write(0, block, 0, mx.ones((1, 1, 2)))  # the first data call: main owns the store
    assert in_thread("metrics", store.capacity) is None


def test_another_thread_sees_the_sizes_of_the_last_sync() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8, grow_on_exhaustion=True))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    [block] = pool.allocate("k", 4, owner=1)
    store.write(0, block, 0, mx.ones((1, 1, 2)))
    pool.allocate("k", 4 * 8, owner=2)  # the pool grows past the slabs
    seen: list[int] = []
    assert in_thread("metrics", lambda: seen.append(store.capacity())) is None
    assert seen == [8]  # a resize would evaluate the owner's pending writes: not here
    assert store.capacity() >= pool.id_bound()  # the owning thread follows the pool


@pytest.mark.parametrize("n", [0, 1])
def test_a_trim_on_another_thread_binds_no_store(n: int) -> None:
    # A trim touches no data, yet it gave an unbound store to its thread, which then
    # ended: every later data call, from any thread, was refused.
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    cache = PoolBackedPromptCache(store, PooledKVCache(pool))
    assert in_thread("trimmer", lambda: cache[0].trim(n)) is None
    ones = mx.ones((1, 1, 1, 2), mx.float32)
    cache[0].update_and_fetch(ones, ones)  # this thread may still take the store
    assert in_thread("intruder", lambda: cache[0].trim(1)) is not None  # now it is bound
    cache.release()


def test_a_book_wrapped_again_over_a_store_without_lazy_writes_drops_the_old_check() -> None:
    # It kept the lazy_writes store's thread check: a fork's copy-on-write on another
    # thread was refused for a store it no longer used.
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=16))
    lazy = MLXBlockStorage(pool, 1, 1, 2, mx.float32, lazy_writes=True)
    book = PooledKVCache(pool)
    held = mx.ones((1, 1, 6, 2), mx.float32)
    PoolBackedPromptCache(lazy, book)[0].update_and_fetch(held, held)  # binds it here
    cache = PoolBackedPromptCache(MLXBlockStorage(pool, 1, 1, 2, mx.float32), book)
    twin = cache.fork()
    assert in_thread("other", lambda: twin[0].trim(1)) is None  # a copy-on-write
    twin.release()
    cache.release()
