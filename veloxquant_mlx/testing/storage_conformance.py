"""The storage conformance suite: tests every backing store of a block pool must pass.

A store for another backend (CUDA, Metal, a Rust extension...) proves that
it keeps the storage protocol (:mod:`veloxquant_mlx.memory.storage`) with a
few lines of its own, the way ``zarr.testing`` serves store authors::

    from veloxquant_mlx.testing.aliasing import StorageBackend
    from veloxquant_mlx.testing.storage_conformance import (
        StorageConformance, random_trace_test)

    MINE = StorageBackend(
        "mine",
        make_storage=lambda pool, spec: MyStore(
            pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype),
        from_numpy=my_array_from_numpy,     # float32 ndarray -> your array
        to_numpy=my_array_to_numpy,         # your array -> float32 ndarray (evaluates)
        cast=my_array_astype,               # (your array, "float16") -> converted array
    )

    class TestMyStore(StorageConformance[MyArray]):
        backend = MINE

    test_my_store_replays_random_traces = random_trace_test(MINE)

:class:`StorageConformance` holds one test per rule of the protocol (round
trips, distinct ids never sharing storage, gathered arrays never changing,
lazy ones included, ``gather_heads`` agreeing with ``gather``, bad writes
(tokens of another dtype included) refused without effect, a dropped
cache's blocks returned by the next store call, geometric growth that keeps
data, shrinkage that gives memory back, concurrent writers, and canned
traces through the aliasing replay). :func:`random_trace_test` builds
a Hypothesis test that replays random traces of every pool and store
operation through :class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`;
a failing example is printed as a JSON-lines trace (and saved when the
environment variable ``VELOXQUANT_TRACE_DIR`` names a directory), so
``replay_file`` reproduces it exactly.

Requires the ``dev`` extra (pytest and Hypothesis), unlike the replay engine.
Complexity: each test is small (a few blocks, at most 64 ids); the random
trace test costs O(examples x ops x live blocks). Thread safety: each test
builds its own pool and store.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.testing.aliasing import (
    AliasingReplay,
    ReplayError,
    StorageBackend,
    Values,
    replay,
)
from veloxquant_mlx.testing.traces import (
    Allocate,
    Free,
    FreeAll,
    MarkUsed,
    Op,
    Read,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
    StoreSpec,
    Sync,
    Trace,
    Write,
    dumps,
    save,
)

__all__ = ["CANNED_TRACES", "StorageConformance", "drive_random_trace", "random_trace_test"]

ArrayT = TypeVar("ArrayT")
T = TypeVar("T")

TRACE_DIR_VARIABLE = "VELOXQUANT_TRACE_DIR"


# -- canned traces ---------------------------------------------------------------------------

_GROWING = PoolConfig(block_size=2, n_blocks=2, separate_kv=True, grow_on_exhaustion=True)
_SMALL = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=2)

#: Short traces through every op type, each aimed at one way a store can go wrong.
CANNED_TRACES: dict[str, Trace] = {
    "grow-shrink-regrow": Trace(
        _GROWING,
        _SMALL,
        (
            Allocate(0, "k", 2, owner=1),
            Allocate(1, "v", 10, owner=2),  # grows the "v" stream: ids 1..5
            Write(1, (1, 4), 1, 1),
            FreeAll(2),
            Shrink("v", 0, retired=5),  # id_bound 6 -> 1: the store must give memory back
            Sync(),
            Allocate(2, "v", 12, owner=3),  # regrows on the retired ids
            Read(0, ((0, 0), (2, 5)), 4),
        ),
    ),
    "stale-handles": Trace(
        _GROWING,
        _SMALL,
        (
            Allocate(0, "k", 2, owner=1),
            Free(((0, 0),)),
            Allocate(1, "k", 2, owner=2),  # same id, new handle
            Write(0, (0, 0), 0, 1, expect="ValueError"),
            Free(((0, 0),), expect="InvalidFreeError"),
            MarkUsed((0, 0), 1),
            MarkUsed((1, 0), 1),
            RegisterOwner(5),
            RegisterOwner(5, expect="OwnerAlreadyActiveError"),
            ReleaseOwner(5),
            Read(1, ((1, 0),), 3, expect="ValueError"),
            Write(1, (1, 0), 1, 2, expect="ValueError"),
        ),
    ),
    "lazy-reads-across-resizes": Trace(
        _GROWING,
        _SMALL,
        (
            Allocate(0, "k", 2, owner=1),
            Read(0, ((0, 0),), 2, hold=6),
            Read(1, ((0, 0),), 1, hold=3),
            Write(0, (0, 0), 0, 2),
            Allocate(1, "k", 16, owner=2),  # growth
            Write(1, (0, 0), 1, 1),
            FreeAll(2),
            Shrink("k", 0),  # shrink
            Write(0, (0, 0), 1, 1),
        ),
    ),
}


class StorageConformance(Generic[ArrayT]):
    """Base class of a store's conformance tests; subclass it as ``Test...`` and set ``backend``.

    ``spec`` is the store shape the tests use (override it to test another
    dtype); token values stay small integers, exact in ``float16``.
    A store that is documented as safe to share between threads subclasses
    :class:`ThreadSafeStorageConformance` instead, which adds the
    concurrent-writer test.
    """

    backend: StorageBackend[ArrayT]
    spec: ClassVar[StoreSpec] = StoreSpec(n_layers=2, n_kv_heads=2, head_dim=3, dtype="float16")

    # -- helpers ------------------------------------------------------------------------

    def make(
        self, block_size: int = 4, n_blocks: int = 8, *, grow: bool = False
    ) -> tuple[BlockPoolAllocator, BlockStorage[ArrayT]]:
        """A pool with one shared stream and a store for it, built by the backend."""
        config = PoolConfig(
            block_size=block_size, n_blocks=n_blocks, separate_kv=False, grow_on_exhaustion=grow
        )
        pool = BlockPoolAllocator(config)
        return pool, self.backend.make_storage(pool, self.spec)

    def tokens(self, n_tokens: int, first: int = 1) -> Values:
        """``n_tokens`` slots of distinct values ``first, first + 1, ...``."""
        count = n_tokens * self.spec.n_kv_heads * self.spec.head_dim
        values = np.arange(first, first + count, dtype=np.float32)
        return values.reshape(n_tokens, self.spec.n_kv_heads, self.spec.head_dim)

    def as_tokens(self, values: Values) -> ArrayT:
        """``values`` as the backend's array in the store's dtype: what a write takes."""
        return self.backend.tokens(values, self.spec.dtype)

    def write(self, store: BlockStorage[ArrayT], layer: int, block: Block, values: Values) -> None:
        """Write ``values`` into ``block`` from slot 0."""
        store.write(layer, block, 0, self.as_tokens(values))

    def read(
        self, store: BlockStorage[ArrayT], layer: int, blocks: Sequence[Block], n: int = -1
    ) -> Values:
        """Gather (all slots when ``n < 0``) and evaluate to NumPy."""
        if n < 0:
            n = len(blocks) * store.pool.config.block_size
        return self.backend.to_numpy(store.gather(layer, blocks, n))

    def read_heads(
        self, store: BlockStorage[ArrayT], layer: int, blocks: Sequence[Block], n: int
    ) -> Values:
        """``gather_heads`` evaluated to NumPy: ``(n_kv_heads, n, head_dim)``."""
        return self.backend.to_numpy(store.gather_heads(layer, blocks, n))

    def fill(self, store: BlockStorage[ArrayT], blocks: Sequence[Block]) -> dict[int, Values]:
        """Write distinct values into every slot of ``blocks`` in layer 0; return them by id."""
        block_size = store.pool.config.block_size
        written = {}
        for index, block in enumerate(blocks):
            values = self.tokens(block_size, first=1 + index * 100)
            self.write(store, 0, block, values)
            written[block.block_id] = values
        return written

    def assert_holds(self, store: BlockStorage[ArrayT], written: dict[int, Values]) -> None:
        """Every live block of ``store``'s pool whose id is in ``written`` holds those values."""
        for block in _live_blocks(store.pool):
            if block.block_id in written:
                np.testing.assert_array_equal(
                    self.read(store, 0, [block]),
                    written[block.block_id],
                    err_msg=f"block {block.block_id}",
                )

    # -- the protocol's shape -----------------------------------------------------------

    def test_is_a_block_storage_of_its_pool(self) -> None:
        pool, store = self.make()
        assert isinstance(store, BlockStorage)
        assert store.pool is pool
        assert store.n_layers == self.spec.n_layers
        assert store.slot_shape == (self.spec.n_kv_heads, self.spec.head_dim)

    def test_capacity_covers_the_pools_ids(self) -> None:
        pool, store = self.make(n_blocks=8)
        assert store.capacity() >= pool.id_bound() == 8
        assert store.resident_bytes() > 0

    # -- data ---------------------------------------------------------------------------

    def test_write_then_gather_returns_the_tokens(self) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        store.write(1, block, 1, self.as_tokens(self.tokens(2)))
        np.testing.assert_array_equal(self.read(store, 1, [block], 3)[1:], self.tokens(2))

    def test_gather_concatenates_blocks_in_order_and_stops_at_n_tokens(self) -> None:
        pool, store = self.make()
        blocks = pool.allocate("kv", 12, owner=1)
        written = self.fill(store, blocks)
        order = [blocks[2], blocks[0]]
        expected = np.concatenate([written[block.block_id] for block in order])[:6]
        np.testing.assert_array_equal(self.read(store, 0, order, 6), expected)

    def test_gather_of_no_tokens_is_empty(self) -> None:
        pool, store = self.make()
        blocks = pool.allocate("kv", 4, owner=1)
        assert self.read(store, 0, blocks, 0).shape == (0, *store.slot_shape)
        assert self.read(store, 0, [], 0).shape == (0, *store.slot_shape)

    def test_layers_are_independent(self) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        self.write(store, 0, block, self.tokens(4, first=1))
        self.write(store, 1, block, self.tokens(4, first=500))
        np.testing.assert_array_equal(self.read(store, 0, [block]), self.tokens(4, first=1))

    def test_distinct_ids_never_share_storage(self) -> None:
        pool, store = self.make()
        blocks = pool.allocate("kv", 32, owner=1)
        written = self.fill(store, blocks)
        for index, block in enumerate(blocks):
            written[block.block_id] = self.tokens(4, first=1000 + index * 10)
            self.write(store, 0, block, written[block.block_id])
            self.assert_holds(store, written)

    def test_gathered_array_never_changes_after_later_writes(self) -> None:
        pool, store = self.make()
        blocks = pool.allocate("kv", 8, owner=1)
        written = self.fill(store, blocks)
        early = store.gather(0, blocks, 8)
        before = self.backend.to_numpy(early)
        self.write(store, 0, blocks[0], self.tokens(4, first=900))
        np.testing.assert_array_equal(self.backend.to_numpy(early), before)
        np.testing.assert_array_equal(before[:4], written[blocks[0].block_id])

    def test_lazy_gather_keeps_its_values_through_writes_frees_growth_and_shrink(self) -> None:
        pool, store = self.make(n_blocks=2, grow=True)
        blocks = pool.allocate("kv", 8, owner=1)
        written = self.fill(store, blocks)
        lazy = store.gather(0, blocks, 8)  # not evaluated until the very end
        self.write(store, 0, blocks[1], self.tokens(4, first=700))
        grown = pool.allocate("kv", 16, owner=2)
        self.fill(store, grown)
        pool.free_all(2)
        pool.shrink("kv", 0)
        store.sync()
        self.write(store, 0, blocks[0], self.tokens(4, first=800))
        expected = np.concatenate([written[block.block_id] for block in blocks])
        np.testing.assert_array_equal(self.backend.to_numpy(lazy), expected)

    # -- head-major gathers -------------------------------------------------------------

    @pytest.mark.parametrize("n_tokens", [0, 1, 5, 12])
    def test_gather_heads_is_gather_transposed(self, n_tokens: int) -> None:
        pool, store = self.make(block_size=4)
        blocks = pool.allocate("kv", 12, owner=1)
        self.fill(store, blocks)
        for layer, order in ((0, [blocks[2], blocks[0], blocks[1]]), (1, blocks)):
            heads = self.read_heads(store, layer, order, n_tokens)
            assert heads.shape == (self.spec.n_kv_heads, n_tokens, self.spec.head_dim)
            np.testing.assert_array_equal(
                heads, self.read(store, layer, order, n_tokens).transpose(1, 0, 2)
            )

    def test_gather_heads_of_no_blocks_is_empty(self) -> None:
        _, store = self.make()
        heads, head_dim = store.slot_shape
        assert self.read_heads(store, 0, [], 0).shape == (heads, 0, head_dim)

    def test_gather_heads_keeps_its_values_through_writes_frees_growth_and_shrink(self) -> None:
        pool, store = self.make(n_blocks=2, grow=True)
        blocks = pool.allocate("kv", 8, owner=1)
        written = self.fill(store, blocks)
        lazy = store.gather_heads(0, blocks, 7)  # not evaluated until the very end
        self.write(store, 0, blocks[1], self.tokens(4, first=700))
        grown = pool.allocate("kv", 16, owner=2)  # growth re-lays out a head-major slab
        self.fill(store, grown)
        pool.free_all(2)
        pool.shrink("kv", 0)
        store.sync()
        self.write(store, 0, blocks[0], self.tokens(4, first=800))
        expected = np.concatenate([written[block.block_id] for block in blocks])[:7]
        np.testing.assert_array_equal(self.backend.to_numpy(lazy), expected.transpose(1, 0, 2))

    def test_gather_heads_after_growth_and_shrink_matches_what_was_written(self) -> None:
        pool, store = self.make(n_blocks=2, grow=True)
        kept = pool.allocate("kv", 8, owner=1)
        written = self.fill(store, kept)
        written.update(self.fill(store, pool.allocate("kv", 24, owner=2)))
        everything = _live_blocks(pool)
        expected = np.concatenate([written[block.block_id] for block in everything])
        np.testing.assert_array_equal(
            self.read_heads(store, 0, everything, len(expected)), expected.transpose(1, 0, 2)
        )
        pool.free_all(2)
        pool.shrink("kv", 0)
        expected = np.concatenate([written[block.block_id] for block in kept])
        np.testing.assert_array_equal(
            self.read_heads(store, 0, kept, 8), expected.transpose(1, 0, 2)
        )

    @pytest.mark.parametrize("method", ["gather", "gather_heads"])
    def test_gathers_reject_a_freed_handle_among_live_ones(self, method: str) -> None:
        pool, store = self.make()
        live, freed = pool.allocate("kv", 8, owner=1)
        pool.free([freed])
        with pytest.raises(ValueError):
            getattr(store, method)(0, [live, freed], 5)

    @pytest.mark.parametrize("method", ["gather", "gather_heads"])
    def test_gathers_reject_a_non_block(self, method: str) -> None:
        pool, store = self.make()
        [live] = pool.allocate("kv", 4, owner=1)
        with pytest.raises(TypeError):
            getattr(store, method)(0, [live, live.block_id], 5)

    @pytest.mark.parametrize("n_tokens", [-1, 9])
    def test_gather_heads_rejects_n_tokens_outside_the_blocks(self, n_tokens: int) -> None:
        pool, store = self.make(block_size=4)
        blocks = pool.allocate("kv", 8, owner=1)
        with pytest.raises(ValueError):
            store.gather_heads(0, blocks, n_tokens)

    # -- refused writes and reads --------------------------------------------------------

    def assert_write_refused(
        self, store: BlockStorage[ArrayT], error: type[Exception], call: Callable[[], None]
    ) -> None:
        """``call`` raises ``error`` and leaves every live block's data as it was."""
        blocks = _live_blocks(store.pool)
        before = [self.read(store, layer, blocks) for layer in range(store.n_layers)]
        with pytest.raises(error):
            call()
        after = [self.read(store, layer, blocks) for layer in range(store.n_layers)]
        for layer, (old, new) in enumerate(zip(before, after, strict=True)):
            np.testing.assert_array_equal(new, old, err_msg=f"layer {layer} changed")

    def test_write_rejects_a_freed_handle_even_after_its_id_is_reused(self) -> None:
        pool, store = self.make(n_blocks=1)
        [stale] = pool.allocate("kv", 4, owner=1)
        pool.free([stale])
        [reused] = pool.allocate("kv", 4, owner=2)
        assert reused.block_id == stale.block_id
        self.fill(store, [reused])
        values = self.as_tokens(self.tokens(1, first=999))
        self.assert_write_refused(store, ValueError, lambda: store.write(0, stale, 0, values))

    def test_write_rejects_another_pools_handle(self) -> None:
        pool, store = self.make()
        self.fill(store, pool.allocate("kv", 4, owner=1))
        other_pool, _ = self.make()
        [foreign] = other_pool.allocate("kv", 4, owner=1)
        values = self.as_tokens(self.tokens(1, first=999))
        self.assert_write_refused(store, ValueError, lambda: store.write(0, foreign, 0, values))

    def test_write_rejects_a_hand_built_block(self) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        self.fill(store, [block])
        forged = Block(block.block_id, "kv", "fp16", 4, owner=1, ever_allocated=True)
        values = self.as_tokens(self.tokens(1, first=999))
        self.assert_write_refused(store, ValueError, lambda: store.write(0, forged, 0, values))

    def test_write_rejects_a_non_block(self) -> None:
        _, store = self.make()
        values = self.as_tokens(self.tokens(1))
        self.assert_write_refused(
            store,
            TypeError,
            lambda: store.write(0, 0, 0, values),  # type: ignore[arg-type]
        )

    @pytest.mark.parametrize(("start", "n_tokens"), [(-1, 1), (4, 1), (3, 2), (0, 5)])
    def test_write_rejects_slots_outside_the_block(self, start: int, n_tokens: int) -> None:
        pool, store = self.make(block_size=4)
        [block] = pool.allocate("kv", 4, owner=1)
        self.fill(store, [block])
        values = self.as_tokens(self.tokens(n_tokens, first=999))
        self.assert_write_refused(store, ValueError, lambda: store.write(0, block, start, values))

    @pytest.mark.parametrize("past_the_end", [False, True])
    def test_write_rejects_a_layer_out_of_range(self, past_the_end: bool) -> None:
        pool, store = self.make()
        layer = store.n_layers if past_the_end else -1
        [block] = pool.allocate("kv", 4, owner=1)
        values = self.as_tokens(self.tokens(1))
        self.assert_write_refused(store, ValueError, lambda: store.write(layer, block, 0, values))

    @pytest.mark.parametrize("mistake", ["extra head", "no token axis", "extra axis", "short"])
    def test_write_rejects_tokens_of_the_wrong_shape(self, mistake: str) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        heads, dim = store.slot_shape
        shape = {
            "extra head": (1, heads + 1, dim),
            "no token axis": (heads, dim),
            "extra axis": (1, heads, dim, 1),
            "short": (2, heads, dim - 1) if dim > 1 else (2, heads, dim + 1),
        }[mistake]
        values = self.as_tokens(np.ones(shape, dtype=np.float32))
        self.assert_write_refused(store, ValueError, lambda: store.write(0, block, 0, values))

    def test_write_rejects_tokens_of_another_dtype(self) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        self.fill(store, [block])
        other = "float16" if self.spec.dtype == "float32" else "float32"
        values = self.backend.tokens(self.tokens(1, first=999), other)
        self.assert_write_refused(store, TypeError, lambda: store.write(0, block, 0, values))

    def test_gather_rejects_a_freed_handle(self) -> None:
        pool, store = self.make()
        [block] = pool.allocate("kv", 4, owner=1)
        pool.free([block])
        with pytest.raises(ValueError):
            store.gather(0, [block], 1)

    def test_gather_rejects_more_tokens_than_the_blocks_hold(self) -> None:
        pool, store = self.make(block_size=4)
        blocks = pool.allocate("kv", 8, owner=1)
        with pytest.raises(ValueError):
            store.gather(0, blocks, 9)

    # -- following the pool -------------------------------------------------------------

    @pytest.mark.parametrize("call", ["sync", "capacity", "resident_bytes", "gather", "write"])
    def test_a_dropped_cache_gives_its_blocks_back_at_the_next_store_call(self, call: str) -> None:
        pool, store = self.make(block_size=4)
        [block] = pool.allocate("kv", 4, owner=1)
        dropped = PooledKVCache(pool, owner=2)
        dropped.append(5)  # two blocks per stream
        del dropped  # its finaliser only queues the release: no pool call drains it
        assert pool.stats.blocks_in_use() == 5
        calls: dict[str, Callable[[], object]] = {
            "sync": store.sync,
            "capacity": store.capacity,
            "resident_bytes": store.resident_bytes,
            "gather": lambda: store.gather(0, [block], 4),
            "write": lambda: store.write(0, block, 0, self.as_tokens(self.tokens(1))),
        }
        calls[call]()
        assert pool.stats.blocks_in_use() == 1
        assert pool.blocks_for(2) == []
        pool.register_owner(2)  # the dropped cache's owner id is free again
        pool.check_invariants()

    def test_growth_keeps_existing_data_and_covers_new_ids(self) -> None:
        pool, store = self.make(n_blocks=2, grow=True)
        first = pool.allocate("kv", 8, owner=1)
        written = self.fill(store, first)
        grown = pool.allocate("kv", 12, owner=2)
        assert store.capacity() >= pool.id_bound() == 5
        self.assert_holds(store, written)
        written.update(self.fill(store, grown))
        self.assert_holds(store, written)

    def test_growth_is_geometric(self) -> None:
        pool, store = self.make(block_size=1, n_blocks=1, grow=True)
        capacities = {store.capacity()}
        for owner in range(64):
            pool.allocate("kv", 1, owner=owner)
            capacities.add(store.capacity())
        assert store.capacity() >= 64
        assert len(capacities) <= 8, f"capacity changed at every step: {sorted(capacities)}"

    def test_shrink_gives_memory_back_and_keeps_live_data(self) -> None:
        pool, store = self.make(n_blocks=32)
        kept = pool.allocate("kv", 8, owner=1)  # ids 0 and 1
        written = self.fill(store, kept)
        before = store.resident_bytes()
        assert pool.shrink("kv", 0) == 30
        assert pool.id_bound() == 2
        after = store.resident_bytes()
        assert store.capacity() < 32
        assert after < before, f"resident bytes did not fall: {before} -> {after}"
        self.assert_holds(store, written)

    def test_regrowth_after_a_shrink_keeps_data(self) -> None:
        pool, store = self.make(n_blocks=16, grow=True)
        kept = pool.allocate("kv", 4, owner=1)
        written = self.fill(store, kept)
        pool.shrink("kv", 0)
        store.sync()
        regrown = pool.allocate("kv", 40, owner=2)
        written.update(self.fill(store, regrown))
        self.assert_holds(store, written)

    # -- threads and traces -------------------------------------------------------------

    @pytest.mark.parametrize("name", sorted(CANNED_TRACES))
    def test_canned_trace_replays_cleanly(self, name: str) -> None:
        replay(CANNED_TRACES[name], self.backend)


class ThreadSafeStorageConformance(StorageConformance[ArrayT]):
    """The conformance tests plus concurrency, for stores shared between threads."""

    def test_concurrent_writers_on_distinct_blocks_each_keep_their_data(self) -> None:
        pool, store = self.make(block_size=4, n_blocks=8)
        blocks = pool.allocate("kv", 16, owner=1)
        finals = [self.tokens(4, first=1 + index * 100) for index in range(len(blocks))]

        def writer(index: int) -> None:
            for round_ in range(20):
                values = self.tokens(1, first=1000 + round_)
                store.write(0, blocks[index], round_ % 4, self.as_tokens(values))
            self.write(store, 0, blocks[index], finals[index])

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(blocks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for block, values in zip(blocks, finals, strict=True):
            np.testing.assert_array_equal(self.read(store, 0, [block]), values)


def _live_blocks(pool: BlockPoolAllocator) -> list[Block]:
    """Every live handle of ``pool`` for owners 0..63 (the owners these tests use)."""
    return [block for owner in range(64) for block in pool.blocks_for(owner)]


# -- random traces ---------------------------------------------------------------------------

_OP_KINDS = (
    "allocate",
    "allocate",
    "allocate",
    "free",
    "free",
    "free_all",
    "shrink",
    "mark_used",
    "register_owner",
    "release_owner",
    "write",
    "write",
    "write",
    "read",
    "read",
    "sync",
)


@st.composite
def pool_configs(draw: st.DrawFn) -> PoolConfig:
    """Small pools of every kind: both stream modes, growth on and off, capped or not."""
    n_blocks = draw(st.integers(0, 8))
    grow = draw(st.booleans())
    cap = draw(st.none() | st.integers(n_blocks, n_blocks + 8)) if grow else None
    return PoolConfig(
        block_size=draw(st.integers(1, 4)),
        n_blocks=n_blocks,
        separate_kv=draw(st.booleans()),
        grow_on_exhaustion=grow,
        max_blocks=cap,
    )


def store_specs() -> st.SearchStrategy[StoreSpec]:
    """Small store shapes, in float32 (exact sentinels) or float16 (a real KV dtype)."""
    return st.builds(
        StoreSpec,
        n_layers=st.integers(1, 2),
        n_kv_heads=st.integers(1, 2),
        head_dim=st.integers(1, 2),
        dtype=st.sampled_from(["float32", "float16"]),
    )


def _pick(data: st.DataObject, items: Sequence[T]) -> T:
    """One of ``items`` (drawn as an index: cheaper than a new ``sampled_from`` per draw)."""
    return items[data.draw(st.integers(0, len(items) - 1))]


def _odd(data: st.DataObject) -> bool:
    """True one time in five: use a bad argument this time."""
    return data.draw(st.integers(0, 4)) == 0


def _draw_op(data: st.DataObject, engine: AliasingReplay[ArrayT]) -> Op:
    """One op for the engine's current state; handles come from those it has handed out.

    Arguments are valid most of the time (so that blocks get allocated, written,
    grown and retired) and wrong otherwise (stale handles, bad slots, layers,
    streams), so that refusals are exercised too.
    """
    block_size = engine.pool.config.block_size
    n_layers = engine.spec.n_layers
    streams = ("k", "v") if engine.pool.config.separate_kv else ("kv", "k", "v")
    known, live = engine.known_refs(), engine.live_refs()
    kind = _pick(data, _OP_KINDS)
    if kind in ("free", "mark_used", "write", "read") and not known:
        kind = "allocate"
    handles = live if live and not _odd(data) else known  # a stale handle now and then
    owner = data.draw(st.integers(0, 3))
    match kind:
        case "allocate":
            stream, n_tokens = _pick(data, streams), data.draw(st.integers(1, 2 * block_size))
            if data.draw(st.integers(0, 9)) == 0:  # one bad argument, one time in ten
                stream, n_tokens = _pick(data, (("x", n_tokens), (stream, 0)))
            return Allocate(engine.next_call(), stream, n_tokens, owner)
        case "free":
            return Free(tuple(_pick(data, handles) for _ in range(data.draw(st.integers(0, 3)))))
        case "free_all":
            return FreeAll(owner)
        case "shrink":
            target_free = data.draw(st.integers(1, 3)) if _odd(data) else 0
            return Shrink(_pick(data, streams[:2]), target_free)
        case "mark_used":
            return MarkUsed(_pick(data, handles), data.draw(st.integers(0, block_size)))
        case "register_owner":
            return RegisterOwner(owner)
        case "release_owner":
            return ReleaseOwner(owner)
        case "write":
            bad = _pick(data, ("layer", "start", "n_tokens")) if _odd(data) else ""
            layer = n_layers if bad == "layer" else data.draw(st.integers(0, n_layers - 1))
            start = (
                _pick(data, (-1, block_size)) if bad == "start" else _pick(data, range(block_size))
            )
            room = block_size - max(start, 0)
            n_tokens = room + 1 if bad == "n_tokens" else data.draw(st.integers(min(room, 1), room))
            return Write(layer, _pick(data, handles), start, n_tokens)
        case "read":
            refs = tuple(_pick(data, handles) for _ in range(data.draw(st.integers(1, 3))))
            bad = _pick(data, ("layer", "n_tokens")) if _odd(data) else ""
            layer = n_layers if bad == "layer" else data.draw(st.integers(0, n_layers - 1))
            available = len(refs) * block_size
            n_tokens = available + 1 if bad == "n_tokens" else data.draw(st.integers(0, available))
            return Read(layer, refs, n_tokens, hold=data.draw(st.integers(0, 3)))
    return Sync()


def drive_random_trace(
    backend: StorageBackend[ArrayT], data: st.DataObject, max_ops: int = 30
) -> Trace:
    """Draw a pool, a store shape and up to ``max_ops`` ops; apply each as it is drawn.

    On a failure the trace so far is attached to the Hypothesis report (and
    saved under ``$VELOXQUANT_TRACE_DIR`` if set) before the error propagates.

    Returns:
        The trace applied, with outcomes.

    Raises:
        ReplayError: The first op after which a check failed.
    """
    engine = AliasingReplay(data.draw(pool_configs()), data.draw(store_specs()), backend)
    try:
        for _ in range(data.draw(st.integers(1, max_ops))):
            engine.apply(_draw_op(data, engine))
    except ReplayError:
        _report(engine.trace(), backend.name)
        raise
    return engine.trace()


def _report(trace: Trace, backend_name: str) -> None:
    note(f"failing trace ({backend_name}); save it and run replay_file on it:\n{dumps(trace)}")
    directory = os.environ.get(TRACE_DIR_VARIABLE)
    if directory:
        path = Path(directory) / f"failing-{backend_name}-{abs(hash(dumps(trace)))}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        save(trace, path)
        note(f"saved to {path}")


def random_trace_test(
    backend: StorageBackend[ArrayT], *, max_examples: int = 40, max_ops: int = 30
) -> Callable[[], None]:
    """A Hypothesis test (assign it to a ``test_...`` name) replaying random traces on ``backend``.

    ``max_examples`` overrides the active profile's count, keeping this test
    fast by default; raise it for a nightly run.
    """

    @settings(max_examples=max_examples, deadline=None)
    @given(data=st.data())
    def test_random_traces_replay_cleanly(data: st.DataObject) -> None:
        drive_random_trace(backend, data, max_ops)

    return test_random_traces_replay_cleanly
