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
(tokens of another dtype included) refused without effect, geometric growth
that keeps data, shrinkage that gives memory back, concurrent writers, and
canned traces through the aliasing replay). :func:`random_trace_test`
(:mod:`~veloxquant_mlx.testing.store_traces`) builds a Hypothesis test that
replays random traces of every pool and store call through
:class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`; a failing example
is printed as a JSON-lines trace (and saved when the environment variable
``VELOXQUANT_TRACE_DIR`` names a directory), so ``veloxquant-mlx replay``
reproduces it exactly.

Requires the ``dev`` extra (pytest and Hypothesis), unlike the replay engine.
Complexity: each test is small (a few blocks, at most 64 ids); the random
trace test costs O(examples x ops x live blocks). Thread safety: each test
builds its own pool and store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, TypeVar

import numpy as np
import pytest

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.storage import BlockStorage, CopiesBlocks
from veloxquant_mlx.testing.aliasing import StorageBackend, Values, replay
from veloxquant_mlx.testing.store_traces import (
    CANNED_TRACES,
    drive_random_trace,
    random_trace_test,
)
from veloxquant_mlx.testing.traces import StoreSpec
from veloxquant_mlx_spec.operations import BlockPool

__all__ = [
    "CANNED_TRACES",
    "StorageConformance",
    "ThreadSafeStorageConformance",
    "drive_random_trace",
    "random_trace_test",
]

ArrayT = TypeVar("ArrayT")


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

    def disturb(
        self, pool: BlockPoolAllocator, store: BlockStorage[ArrayT], blocks: Sequence[Block]
    ) -> None:
        """What an array gathered from ``blocks`` must outlast: writes to two of them, growth
        (which re-lays out a head-major slab), frees, a shrink and a sync."""
        self.write(store, 0, blocks[1], self.tokens(4, first=700))
        self.fill(store, pool.allocate("kv", 16, owner=2))
        pool.free_all(2)
        pool.shrink("kv", 0)
        store.sync()
        self.write(store, 0, blocks[0], self.tokens(4, first=800))

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
        self.disturb(pool, store, blocks)
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
        self.disturb(pool, store, blocks)
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

    # -- copy-on-write (storage.CopiesBlocks) ---------------------------------------------

    def copier(self, store: BlockStorage[ArrayT]) -> CopiesBlocks:
        """``store`` as a block copier; a store without the capability skips these tests."""
        if not isinstance(store, CopiesBlocks):
            pytest.skip(f"{type(store).__name__} does not offer copy_block (optional)")
        return store

    def shared_then_moved(self) -> tuple[BlockPoolAllocator, BlockStorage[ArrayT], Block, Block]:
        """A block written in both layers, shared, and one handle moved by make_writable."""
        pool, store = self.make()
        (block,) = pool.allocate("kv", 4, owner=1)
        for layer in (0, 1):
            self.write(store, layer, block, self.tokens(4, first=1 + 100 * layer))
        (other,) = pool.share([block], owner=2)
        return pool, store, block, pool.make_writable(other)

    def test_copy_block_of_every_layer_gives_the_writer_the_same_slots(self) -> None:
        _pool, store, block, moved = self.shared_then_moved()
        self.copier(store).copy_block(None, block.block_id, moved)
        for layer in (0, 1):
            np.testing.assert_array_equal(
                self.read(store, layer, [moved]), self.tokens(4, first=1 + 100 * layer)
            )

    def test_copy_block_of_one_layer_leaves_the_others(self) -> None:
        _pool, store, block, moved = self.shared_then_moved()
        self.copier(store).copy_block(1, block.block_id, moved)
        np.testing.assert_array_equal(self.read(store, 1, [moved]), self.tokens(4, first=101))
        assert not np.array_equal(self.read(store, 0, [moved]), self.tokens(4, first=1))

    def test_writes_after_a_copy_never_reach_the_other_holders(self) -> None:
        _pool, store, block, moved = self.shared_then_moved()
        self.copier(store).copy_block(None, block.block_id, moved)
        self.write(store, 0, moved, self.tokens(4, first=500))
        np.testing.assert_array_equal(self.read(store, 0, [block]), self.tokens(4, first=1))

    @pytest.mark.parametrize("mistake", ["free-src", "stale-dst", "layer", "src-type"])
    def test_copy_block_refuses_bad_arguments_and_changes_nothing(self, mistake: str) -> None:
        pool, store, block, moved = self.shared_then_moved()
        (spare,) = pool.allocate("kv", 4, owner=3)
        pool.free([spare])
        copier = self.copier(store)
        calls: dict[str, tuple[Callable[[], None], type[Exception]]] = {
            "free-src": (lambda: copier.copy_block(None, spare.block_id, moved), ValueError),
            "stale-dst": (lambda: copier.copy_block(None, block.block_id, spare), ValueError),
            "layer": (lambda: copier.copy_block(2, block.block_id, moved), ValueError),
            "src-type": (lambda: copier.copy_block(None, block, moved), TypeError),  # type: ignore[arg-type]
        }
        before = self.read(store, 0, [moved])
        call, error = calls[mistake]
        with pytest.raises(error):
            call()
        np.testing.assert_array_equal(self.read(store, 0, [moved]), before)

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


def _live_blocks(pool: BlockPool[Block]) -> list[Block]:
    """Every live handle of ``pool`` for owners 0..63 (the owners these tests use)."""
    return [block for owner in range(64) for block in pool.blocks_for(owner)]
