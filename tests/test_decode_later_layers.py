"""A decode step's later layers reuse what its first layer checked, and nothing else.

The first layer's call of a step checks the table live and finds the request's
slot rows; every later layer of the step asks the table once
(``memo_this_step``) and skips both. These tests pin that the skip happens, and
that every check the first layer did not make for the later ones still runs:
the layer, the store's thread, and a resize of the slabs between two layers.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from threads import in_thread

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.testing.pool_orders import hand_out_descending

BLOCK_SIZE = 4
N_LAYERS = 3
HEADS = 2
HEAD_DIM = 8


def _store(pool: BlockPoolAllocator | None = None, **options: bool) -> MLXBlockStorage:
    pool = pool or BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=64))
    return MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, **options)


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, HEAD_DIM), key=mx.random.key(seed))


def _held(cache: PoolBackedPromptCache, layer: int) -> mx.array:
    keys, _, _ = cache[layer].state
    return keys


def test_only_the_first_layer_of_a_step_looks_up_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    cache = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    looked_up = []
    full_lookup = DeviceBlockTable.require_live_this_step

    def counted(self: DeviceBlockTable) -> None:
        looked_up.append(self.book.extent_version)
        full_lookup(self)

    monkeypatch.setattr(DeviceBlockTable, "require_live_this_step", counted)
    for step in range(5):
        keys = _tokens(1, step)
        mx.eval([layer.update_and_fetch(keys, keys) for layer in cache])
    assert len(looked_up) == len(set(looked_up)) == 5  # once a step: layers 1, 2 reuse 0's
    cache.release()


@pytest.mark.parametrize("ids", ["running on", "descending"])
def test_a_resize_between_two_layers_of_a_step_is_followed(ids: str) -> None:
    # Another request's growth resizes every slab after this request's layer 0 and
    # before its layer 1: the rows layer 0 found are for the old capacity. Blocks that
    # run on are read by slices, the same at any capacity; others by a gather of rows
    # that move with it.
    pool = BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=4, grow_on_exhaustion=True)
    )
    if ids == "descending":
        hand_out_descending(pool)
    store = _store(pool)
    this = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))
    other = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))
    written = [_tokens(BLOCK_SIZE + 1, layer) for layer in range(N_LAYERS)]
    mx.eval([layer.update_and_fetch(keys, keys) for layer, keys in zip(this, written, strict=True)])
    key_ids = [block.block_id for block in this.book.key_blocks]
    assert (key_ids[1] == key_ids[0] + 1) == (ids == "running on")
    capacity = store.capacity()
    step = [_tokens(1, 10 + layer) for layer in range(N_LAYERS)]
    mx.eval(this[0].update_and_fetch(step[0], step[0]))
    grown = _tokens(30 * BLOCK_SIZE, 99)
    mx.eval(other[0].update_and_fetch(grown, grown))
    assert store.capacity() > capacity
    keys, _ = this[1].update_and_fetch(step[1], step[1])
    assert mx.array_equal(keys, mx.concatenate([written[1], step[1]], axis=2))
    this.release()
    other.release()


def test_a_write_across_a_block_boundary_lands_in_the_requests_own_blocks() -> None:
    # The request's second block is not next to its first: another request took the
    # block in between. A write from the last slot of one block into the next must
    # not spill into the neighbour's.
    store = _store()
    this = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=1))
    neighbour = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=1))
    first, theirs, second = _tokens(3, 1), _tokens(BLOCK_SIZE, 2), _tokens(2, 3)
    mx.eval(this[0].update_and_fetch(first, first))
    mx.eval(neighbour[0].update_and_fetch(theirs, theirs))
    mx.eval(this[0].update_and_fetch(second, second))
    ids = [block.block_id for block in this.book.key_blocks]
    assert ids[1] != ids[0] + 1  # the blocks are apart, as the test needs
    assert mx.array_equal(_held(this, 0), mx.concatenate([first, second], axis=2))
    assert mx.array_equal(_held(neighbour, 0), theirs)
    this.release()
    neighbour.release()


@pytest.mark.parametrize(
    ("layer", "error"), [(-1, ValueError), (N_LAYERS, ValueError), (True, TypeError)]
)
def test_a_bad_layer_is_refused_in_a_step_already_checked(
    layer: object, error: type[Exception]
) -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    table = DeviceBlockTable(book)
    start = book.append(1, layer=0)
    keys = _tokens(1, 0)
    mx.eval(store.update_through_table(0, table, start, keys, keys))
    before = [store.fetch_through_table(n, table, 1) for n in range(N_LAYERS)]
    mx.eval(before)
    with pytest.raises(error, match="layer"):
        store.update_through_table(layer, table, start, _tokens(1, 1), _tokens(1, 1))  # type: ignore[arg-type]
    after = [store.fetch_through_table(n, table, 1) for n in range(N_LAYERS)]
    for old, new in zip(before, after, strict=True):
        assert all(mx.array_equal(a, b) for a, b in zip(old, new, strict=True))
    book.release()


def test_another_thread_is_refused_in_a_step_already_checked() -> None:
    store = _store(lazy_writes=True)
    cache = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    keys = _tokens(1, 0)
    mx.eval(cache[0].update_and_fetch(keys, keys))
    table = cache[0]._table
    assert table is not None

    def later_layer_elsewhere() -> object:
        return store.update_through_table(1, table, 0, keys, keys)

    error = in_thread("other", later_layer_elsewhere)
    assert isinstance(error, RuntimeError) and "lazy_writes=True" in str(error)
    cache.release()
