"""The device block table: O(1) liveness per call, and stale blocks still refused.

Before it, every gather asked the pool about every block of the request, in
every layer of every step (``require_all_live``: 66,944 ``_is_live`` calls in
16 decode tokens at 4K context). Now a request's table asks about each block
once, when it joins, and about all of them again only after a free somewhere
in the pool; a block freed behind the cache's back is still never read or
written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import cast

import mlx.core as mx
import pytest
from threads import in_thread
from wrong_keys_values import wrong_in_one_part

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.block_table import DeviceBlockTable, StaleBlockTableError
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

BLOCK_SIZE = 4
N_LAYERS = 3
HEADS = 2
HEAD_DIM = 8


def _store(n_blocks: int = 256, **options: bool) -> MLXBlockStorage:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))
    return MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, **options)


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, HEAD_DIM), key=mx.random.key(seed))


def _decode(cache: PoolBackedPromptCache, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        keys = _tokens(1, seed + step)
        for layer in cache:
            mx.eval(layer.update_and_fetch(keys, keys))


def _ids(table: DeviceBlockTable) -> tuple[list[int], list[int]]:
    return table.key_ids.tolist(), table.value_ids.tolist()  # type: ignore[return-value]


def test_each_block_is_checked_once_however_long_the_decode() -> None:
    store = _store()
    cache = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    table = cache[0]._table
    assert table is not None
    keys = _tokens(37, 1)
    for layer in cache:
        layer.update_and_fetch(keys, keys)
    _decode(cache, 60)
    n_blocks = len(cache.book.key_blocks)
    assert n_blocks == -(-(37 + 60) // BLOCK_SIZE)
    # One look per key and value block, not one per block per layer per step.
    assert table.handles_checked == 2 * n_blocks
    cache.release()


def test_a_free_elsewhere_in_the_pool_rechecks_the_table_once() -> None:
    store = _store()
    ours = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    other = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    _decode(ours, 9)
    _decode(other, 9)
    table = ours[0]._table
    assert table is not None
    before = table.handles_checked
    other.release()  # a free somewhere in the pool
    _decode(ours, 2)  # stays inside the last block: no new block joins
    assert table.handles_checked == before + 2 * len(ours.book.key_blocks)
    ours.release()


def test_the_table_follows_appends_and_trims() -> None:
    store = _store()
    cache = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    table = cache[0]._table
    assert table is not None
    for n in (5, 1, 1, 9):
        keys = _tokens(n, n)
        for layer in cache:
            layer.update_and_fetch(keys, keys)
        table.require_live()
        assert _ids(table) == (
            [block.block_id for block in cache.book.key_blocks],
            [block.block_id for block in cache.book.value_blocks],
        )
    cache.book.trim(7)
    table.require_live()
    assert len(table.key_ids.tolist()) == len(cache.book.key_blocks) == -(-9 // BLOCK_SIZE)  # type: ignore[arg-type]
    cache.release()
    table.require_live()
    assert _ids(table) == ([], [])


def _alone_then_broken(
    store: MLXBlockStorage, breaker: str
) -> tuple[PoolBackedPromptCache, object]:
    """A request alone for 9 positions (blocks 0..2 and 128..130), then grown by 4 after
    ``breaker`` took the next key and value ids (``"request"``) or only the next value
    id (``"value block"``); and the breaker, to keep it alive."""
    ours = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    table = ours[0]._table
    assert table is not None
    _decode(ours, 9)
    table.require_live()
    assert table.run_starts == (0, 128)
    taker: object
    if breaker == "request":
        taker = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
        _decode(taker, 1)
    else:
        taker = store.pool.allocate("v", BLOCK_SIZE, owner=77)
    _decode(ours, 4)
    table.require_live()
    return ours, taker


@pytest.mark.parametrize("breaker", ["request", "value block"])
def test_run_starts_are_none_once_either_stream_stops_running_on(breaker: str) -> None:
    store = _store()  # 256 blocks: keys on ids 0..127, values on 128..255
    ours, _taker = _alone_then_broken(store, breaker)
    table = ours[0]._table
    assert table is not None
    keys_after = [0, 1, 2, 4] if breaker == "request" else [0, 1, 2, 3]
    assert _ids(table) == (keys_after, [128, 129, 130, 132])
    assert table.run_starts is None
    ours.release()


def test_run_starts_are_found_again_after_a_free_anywhere_a_trim_and_a_release() -> None:
    store = _store()
    ours, _ = _alone_then_broken(store, "value block")
    table = ours[0]._table
    assert table is not None
    store.pool.free_all(77)  # a free anywhere: the table is checked whole again
    table.require_live()
    assert table.run_starts is None
    ours.book.trim(1)  # back to 12 positions, the 3 blocks of each run
    table.require_live()
    assert table.run_starts == (0, 128)
    ours.release()
    table.require_live()
    assert table.run_starts is None


def test_blocks_given_back_run_on_again_for_the_growth_and_the_request_after() -> None:
    """The book frees each stream last position first, so the pool's stacks hand the
    ids out again in position order: a trim, then growth, and a release, then the
    next request, keep runs of ids that a store reads by slicing."""
    store = _store()  # keys on ids 0..127, values on 128..255
    first = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    _decode(first, 13)  # blocks 0..3 and 128..131
    first.book.trim(9)  # back to block 0 and 128: 1..3 and 129..131 go back
    _decode(first, 8, seed=20)  # grows again to 3 blocks
    assert [block.block_id for block in first.book.key_blocks] == [0, 1, 2]
    assert [block.block_id for block in first.book.value_blocks] == [128, 129, 130]
    first.release()
    second = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    table = second[0]._table
    assert table is not None
    _decode(second, 13)
    table.require_live()
    assert _ids(table) == ([0, 1, 2, 3], [128, 129, 130, 131])
    assert table.run_starts == (0, 128)
    second.release()


@pytest.mark.parametrize("how", ["free", "free_all"])
def test_a_block_freed_behind_the_cache_is_never_written_or_read(how: str) -> None:
    store = _store()
    cache = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    _decode(cache, 6)
    pool, book = store.pool, cache.book
    if how == "free":
        pool.free([book.key_blocks[0]])
    else:
        pool.free_all(book.owner)
    thief = pool.allocate("k", BLOCK_SIZE * 4, owner=99)  # the freed id may be reissued
    for block in thief:
        store.write(0, block, 0, mx.full((BLOCK_SIZE, HEADS, HEAD_DIM), 7.0))
    before = store.gather(0, thief, BLOCK_SIZE * 4)
    mx.eval(before)
    keys = _tokens(1, 3)
    with pytest.raises(StaleBlockTableError, match="freed or moved behind the cache's back"):
        cache[0].update_and_fetch(keys, keys)
    with pytest.raises(StaleBlockTableError):
        store.fetch_through_table(1, cache[1]._table, 1)  # type: ignore[arg-type]
    assert mx.array_equal(store.gather(0, thief, BLOCK_SIZE * 4), before)


@pytest.mark.parametrize("frees_elsewhere", [0, 2])
def test_a_block_moved_behind_the_cache_by_make_writable_is_never_written(
    frees_elsewhere: int,
) -> None:
    # Once only a free made the table look again: a fork whose shared blocks another
    # caller moved to copies wrote its next position into the block its parent holds.
    # Two frees elsewhere move the pool's free count as far as the two moves move its
    # copy-on-write count: the table must count both, not their difference.
    store = _store()
    parent = PoolBackedPromptCache(store, PooledKVCache(store.pool, n_layers=N_LAYERS))
    _decode(parent, 2)
    child = parent.fork()
    mx.eval(child[0].state[0])  # the child's table is checked live
    pool, book = store.pool, child.book
    pool.make_writable(book.key_blocks[-1])
    pool.make_writable(book.value_blocks[-1])
    for _ in range(frees_elsewhere):
        pool.free(pool.allocate("k", 1, 99))
    with pytest.raises(StaleBlockTableError, match="make_writable"):
        mx.eval(child[0].state[0])  # a read: the book does not look, the table does
    before = parent[0].state[0]
    mx.eval(before)
    keys = mx.full((1, HEADS, 1, HEAD_DIM), 7.0)
    with pytest.raises(StaleBlockTableError, match="make_writable"):
        child[0].update_and_fetch(keys, keys)
    _decode(parent, 1, seed=5)  # the parent writes its own next position
    assert mx.array_equal(parent[0].state[0][:, :, :2], before)
    assert not mx.any(parent[0].state[0] == 7.0).item()
    parent.release()


def test_a_table_of_another_pool_is_refused() -> None:
    store, other = _store(), _store()
    book = PooledKVCache(other.pool, n_layers=N_LAYERS)
    book.append(3)
    expected = "^the table's blocks come from another pool than this store's$"
    with pytest.raises(ValueError, match=expected):
        store.fetch_through_table(0, DeviceBlockTable(book), 3)
    book.release()


@contextmanager
def _reads_unchanged(
    store: MLXBlockStorage, table: DeviceBlockTable, n_tokens: int
) -> Iterator[None]:
    """The table's first ``n_tokens`` positions of layer 0 read the same after the block."""
    before = store.fetch_through_table(0, table, n_tokens)
    yield
    after = store.fetch_through_table(0, table, n_tokens)
    assert all(mx.array_equal(old, new) for old, new in zip(before, after, strict=True))


def _call_without_a_table(store: MLXBlockStorage, method: str, no_table: object = None) -> object:
    wrong = cast(DeviceBlockTable, no_table)  # what the store is handed instead of a table
    if method == "fetch":
        return store.fetch_through_table(0, wrong, 3)
    if method == "update":
        return store.update_through_table(0, wrong, 0, _tokens(1, 5), _tokens(1, 6))
    return store.attend_through_table(0, wrong, 3, _tokens(1, 7), 1.0)


@pytest.mark.parametrize("no_table", [None, "table"], ids=["None", "a string"])
@pytest.mark.parametrize("method", ["fetch", "update", "attend"])
def test_a_table_argument_that_is_no_table_is_a_type_error_naming_it(
    method: str, no_table: object
) -> None:
    # It used to be a bare AttributeError: 'NoneType' object has no attribute 'require_live'.
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    book.append(3)
    table = DeviceBlockTable(book)
    named = f"{no_table!r} ({type(no_table).__name__})"
    expected = f"^{re.escape(f'table must be a DeviceBlockTable, got {named}')}$"
    with _reads_unchanged(store, table, 3), pytest.raises(TypeError, match=expected):
        _call_without_a_table(store, method, no_table)
    book.release()


def test_a_refused_table_from_another_thread_leaves_a_lazy_store_unbound() -> None:
    # The store used to bind itself to the calling thread before looking at the table.
    store = _store(lazy_writes=True)
    error = in_thread("other", lambda: _call_without_a_table(store, "fetch"))
    assert isinstance(error, TypeError) and "table must be a DeviceBlockTable" in str(error)
    store.sync()  # still this thread's to take: binding it to "other" would refuse this


class _FaultyTable(DeviceBlockTable):
    def require_live(self) -> None:
        raise AttributeError("a fault inside the table")


def test_a_tables_own_attribute_error_is_not_reported_as_a_wrong_argument() -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    book.append(3)
    with pytest.raises(AttributeError, match=r"^a fault inside the table$"):
        store.fetch_through_table(0, _FaultyTable(book), 3)
    book.release()


def test_queries_that_are_not_an_array_are_a_type_error_naming_them() -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    book.append(3)
    with pytest.raises(TypeError, match=r"^queries must be an mlx.core.array, got list$"):
        store.attend_through_table(0, DeviceBlockTable(book), 3, [1.0], 1.0)  # type: ignore[arg-type]
    book.release()


#: Queries of one decode position wrong in one part alone (HEADS = 2 key-value heads).
QUERIES_WRONG_IN_ONE_PART = {
    "3-D": (HEADS, 1, HEAD_DIM),
    "a batch of two": (2, HEADS, 1, HEAD_DIM),
    "two positions": (1, HEADS, 2, HEAD_DIM),
    "another head size": (1, HEADS, 1, HEAD_DIM + 1),
    "heads not a multiple of the store's": (1, HEADS + 1, 1, HEAD_DIM),
}


@pytest.mark.parametrize("shape", QUERIES_WRONG_IN_ONE_PART.values(), ids=QUERIES_WRONG_IN_ONE_PART)
def test_queries_wrong_in_one_part_are_refused_naming_the_shape_expected(
    shape: tuple[int, ...],
) -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    book.append(3)
    expected = f"queries must have shape (1, k * {HEADS}, 1, {HEAD_DIM}), got {shape}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        store.attend_through_table(0, DeviceBlockTable(book), 3, mx.ones(shape), 1.0)
    book.release()


def _attending() -> tuple[MLXBlockStorage, PooledKVCache, DeviceBlockTable]:
    """A store, and a book of one position written in layer 0 (keys of seed 5, values of
    seed 6), with its table."""
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    start = book.append(1)
    table = DeviceBlockTable(book)
    store.update_through_table(0, table, start, _tokens(1, 5), _tokens(1, 6))
    return store, book, table


QUERIES = mx.ones((1, 2 * HEADS, 1, HEAD_DIM))


def test_attention_over_one_position_reads_its_value_in_every_query_head() -> None:
    store, book, table = _attending()
    attended = store.attend_through_table(0, table, 1, QUERIES, 1.0)
    assert mx.allclose(attended, mx.repeat(_tokens(1, 6), 2, axis=1)).item()
    book.release()


@pytest.mark.parametrize("n_tokens", [0, -1, BLOCK_SIZE + 1])
def test_attention_over_no_position_or_past_the_tables_slots_is_refused(n_tokens: int) -> None:
    store, book, table = _attending()
    expected = f"n_tokens must be in 1..{BLOCK_SIZE} (the blocks' slots), got {n_tokens}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        store.attend_through_table(0, table, n_tokens, QUERIES, 1.0)
    book.release()


def test_queries_of_another_dtype_are_refused_naming_them() -> None:
    store, book, table = _attending()
    expected = "queries must have the store's dtype float32, got float16; a store never casts"
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}"):
        store.attend_through_table(0, table, 1, QUERIES.astype(mx.float16), 1.0)
    book.release()


OUTSIDE_THE_SLOTS = "fall outside the table's 4 slots; expected 0 <= start and start + n <= 4"


@pytest.mark.parametrize(
    ("start", "error", "expected"),
    [
        (1.0, TypeError, "start must be an int, got 1.0 (float)"),
        (True, TypeError, "start must be an int, got True (bool)"),
        (-1, ValueError, f"positions -1..-1+1 {OUTSIDE_THE_SLOTS}"),
        (BLOCK_SIZE, ValueError, f"positions 4..4+1 {OUTSIDE_THE_SLOTS}"),
        (9, ValueError, f"positions 9..9+1 {OUTSIDE_THE_SLOTS}"),
    ],
)
def test_a_start_of_the_wrong_type_or_outside_the_table_is_refused(
    start: object, error: type[Exception], expected: str
) -> None:
    # C-TYPE-VS-VALUE: a float start was a ValueError here (store.write: a TypeError).
    refused = pytest.raises(error, match=f"^{re.escape(expected)}$")
    _update_refused(3, start, _tokens(1, 5), _tokens(1, 6), refused)


def _update_refused(
    n_held: int,
    start: object,
    keys: object,
    values: object,
    refused: AbstractContextManager[object],
) -> None:
    """``update_through_table`` at ``start`` of a book holding ``n_held`` positions is
    ``refused`` (a ``pytest.raises``), and every position reads as before."""
    store = _store()
    book = PooledKVCache(store.pool, n_layers=N_LAYERS)
    book.append(n_held)
    table = DeviceBlockTable(book)
    with _reads_unchanged(store, table, n_held), refused:
        store.update_through_table(0, table, start, keys, values)  # type: ignore[arg-type]
    book.release()


SHAPES = f"keys and values must both have shape (1, {HEADS}, n, {HEAD_DIM}), got"
DTYPES = "must have the store's dtype float32, got float16; a store never casts"
#: The store's refusal of each case that is not about a shape (those name both shapes).
NOT_ABOUT_A_SHAPE = {
    "keys of another dtype": f"keys {DTYPES}",
    "values of another dtype": f"values {DTYPES}",
    "values no mlx array": "keys and values must be mlx.core.array, got array and NoneType",
    "keys no mlx array": "keys and values must be mlx.core.array, got NoneType and array",
}
WRONG_IN_ONE_PART = wrong_in_one_part(HEADS, HEAD_DIM)


@pytest.mark.parametrize("case", WRONG_IN_ONE_PART)
def test_the_store_refuses_keys_and_values_wrong_in_one_part_and_writes_nothing(
    case: str,
) -> None:
    # update_through_table's one fast check with any part flipped let such input through
    # (cast, broadcast or half-written) with no test failing: its callers in the package
    # check first, so only a direct call reaches it.
    keys, values, error = WRONG_IN_ONE_PART[case]
    if case in NOT_ABOUT_A_SHAPE:
        message = NOT_ABOUT_A_SHAPE[case]
    else:
        shapes = [tuple(cast(mx.array, array).shape) for array in (keys, values)]
        message = f"{SHAPES} {shapes[0]} and {shapes[1]}"
    _update_refused(2, 1, keys, values, pytest.raises(error, match=f"^{re.escape(message)}"))


def test_a_batch_of_two_is_refused_by_a_store_of_one_head() -> None:
    # (2, 1, n, d) has the one head in the heads' place: only the batch is wrong.
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=8))
    store = MLXBlockStorage(pool, 1, 1, HEAD_DIM, mx.float32)
    book = PooledKVCache(pool)
    start = book.append(1)
    batch_of_two = mx.ones((2, 1, 1, HEAD_DIM))
    expected = f"keys and values must both have shape (1, 1, n, {HEAD_DIM}), got (2, 1, 1, 8)"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
        store.update_through_table(0, DeviceBlockTable(book), start, batch_of_two, batch_of_two)
    book.release()


def test_the_memo_is_dropped_when_the_ids_change() -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=1)
    table = DeviceBlockTable(book)
    book.append(BLOCK_SIZE)
    table.require_live()
    owner, other_owner = object(), object()
    assert table.remember(owner, 1) == 1
    assert (table.memo(owner), table.memo(other_owner)) == (1, None)
    book.append(1)  # a new block joins
    table.require_live()
    assert table.memo(owner) is None
    book.release()


def test_the_step_memo_is_given_only_while_the_step_is_checked() -> None:
    store = _store()
    book = PooledKVCache(store.pool, n_layers=2)
    table = DeviceBlockTable(book)
    book.append(1, layer=0)
    table.require_live_this_step()
    owner = object()
    table.remember(owner, "rows")
    assert (table.memo_this_step(owner), table.memo_this_step(object())) == ("rows", None)
    book.append(1, layer=1)  # a later layer of the same step: the extent stays
    assert table.memo_this_step(owner) == "rows"
    book.append(1, layer=0)  # the next step: unchecked until require_live_this_step
    assert (table.memo_this_step(owner), table.memo(owner)) == (None, "rows")
    table.require_live_this_step()
    assert table.memo_this_step(owner) == "rows"
    book.release()
