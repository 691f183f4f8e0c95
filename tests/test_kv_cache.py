"""Unit tests of PooledKVCache (the books) and PoolBackedKVCache (the mlx-lm protocol).

Small pools and a block size of 4, so that a few tokens cross block
boundaries; mlx-lm's own ``KVCache`` is the reference every cache
operation is compared with. Decoding through real models lives in
``test_mlx_lm_decode.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import NoReturn

import mlx.core as mx
import numpy as np
import pytest
from conftest import pool_unchanged
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, create_attention_mask
from wrong_keys_values import wrong_in_one_part

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvariantViolationError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.kv_cache import (
    GathersHeadMajor,
    PoolBackedKVCache,
    PoolBackedPromptCache,
    PooledKVCache,
    make_pool_backed_cache,
)
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage

BLOCK_SIZE = 4
HEADS = 2
HEAD_DIM = 8


def _pool(n_blocks: int = 64, *, separate_kv: bool = True) -> BlockPoolAllocator:
    return BlockPoolAllocator(
        PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks, separate_kv=separate_kv)
    )


@pytest.fixture
def pool() -> Iterator[BlockPoolAllocator]:
    shared = _pool()
    yield shared
    shared.check_invariants()


def _storage(pool: BlockPoolAllocator, n_layers: int = 2) -> MLXBlockStorage:
    return MLXBlockStorage(pool, n_layers, HEADS, HEAD_DIM, mx.float32)


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, HEAD_DIM), key=mx.random.key(seed))


def _reference() -> KVCache:
    """mlx-lm's own cache, the reference (mlx-lm leaves its cache methods unannotated)."""
    return KVCache()  # type: ignore[no-untyped-call]


def _update_reference(
    cache: KVCache, keys: mx.array, values: mx.array
) -> tuple[mx.array, mx.array]:
    fetched: tuple[mx.array, mx.array] = cache.update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
    return fetched


def _one_layer(pool: BlockPoolAllocator) -> PoolBackedKVCache:
    return PoolBackedPromptCache(_storage(pool, 1), PooledKVCache(pool))[0]


# -- PooledKVCache: the books ---------------------------------------------------------------


def test_append_marks_the_last_block_token_by_token(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool)
    for n_tokens in range(1, 3 * BLOCK_SIZE + 2):
        assert book.append() == n_tokens - 1
        n_blocks = -(-n_tokens // BLOCK_SIZE)
        assert len(book.key_blocks) == len(book.value_blocks) == n_blocks
        assert book.key_blocks[-1].n_used == n_tokens - (n_blocks - 1) * BLOCK_SIZE
        book.check_invariants()


def test_keys_and_values_come_from_their_own_streams(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, format="int4")
    book.append(2 * BLOCK_SIZE)
    assert {block.stream for block in book.key_blocks} == {"k"}
    assert {block.stream for block in book.value_blocks} == {"v"}
    assert {block.format for block in (*book.key_blocks, *book.value_blocks)} == {"int4"}


def test_a_shared_kv_pool_serves_both_streams() -> None:
    pool = _pool(separate_kv=False)
    book = PooledKVCache(pool)
    book.append(BLOCK_SIZE + 1)
    assert pool.stats.blocks_in_use() == 4
    book.check_invariants()
    book.release()
    assert pool.stats.blocks_in_use() == 0


def test_append_is_all_or_nothing_when_values_run_out() -> None:
    pool = _pool(n_blocks=3)  # "k" gets 2 blocks, "v" only 1
    book = PooledKVCache(pool, owner=5)
    with pytest.raises(BlockPoolExhaustedError):
        book.append(BLOCK_SIZE + 1)
    assert (book.offset, book.key_blocks, pool.stats.blocks_in_use()) == (0, (), 0)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(5)  # the book still claims its owner


def test_growth_refused_leaves_a_partly_filled_last_block_as_it_was() -> None:
    pool = _pool(n_blocks=5)  # "k" gets 3 blocks, "v" 2
    book = PooledKVCache(pool, owner=5)
    book.append(BLOCK_SIZE + 1)  # the last blocks hold 1 position of 4
    with pytest.raises(BlockPoolExhaustedError):
        book.append(BLOCK_SIZE)  # growth marks them full first, then is refused
    assert (book.offset, len(book.key_blocks)) == (BLOCK_SIZE + 1, 2)
    assert [block.n_used for block in (book.key_blocks[-1], book.value_blocks[-1])] == [1, 1]
    book.check_invariants()


def test_trim_frees_whole_blocks_past_the_new_offset(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool)
    book.append(3 * BLOCK_SIZE)
    free_before = pool.n_free("k")
    assert book.trim(BLOCK_SIZE + 1) == BLOCK_SIZE + 1
    assert len(book.key_blocks) == 2
    assert book.key_blocks[-1].n_used == BLOCK_SIZE - 1
    assert pool.n_free("k") == free_before + 1
    book.check_invariants()


def test_check_invariants_names_a_block_the_pool_lists_for_the_owner_but_the_book_lacks(
    pool: BlockPoolAllocator,
) -> None:
    """A block checked out to the book's owner that the book does not hold would leak
    (nothing gives it back): the book's check names it."""
    book = PooledKVCache(pool)
    book.append(BLOCK_SIZE + 1)
    book.check_invariants()
    stray = pool.allocate("k", 1, book.owner, "fp16")
    with pytest.raises(InvariantViolationError, match=r"ownership: the pool lists 5 blocks"):
        book.check_invariants()
    pool.free(stray)
    book.check_invariants()
    book.release()


def test_trim_returns_at_most_the_offset(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool)
    book.append(3)
    assert book.trim(10) == 3
    assert book.empty()
    assert pool.stats.blocks_in_use() == 0


def test_trim_to_zero_keeps_the_owner_claimed(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=9)
    book.append(5)
    book.trim(5)
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(9)


def test_one_layer_trimmed_keeps_the_blocks_others_still_use(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, n_layers=2)
    for layer in (0, 1):
        book.append(2 * BLOCK_SIZE, layer=layer)
    book.trim(BLOCK_SIZE, layer=0)
    assert (book.offset, len(book.key_blocks)) == (2 * BLOCK_SIZE, 2)
    book.trim(BLOCK_SIZE, layer=1)
    assert (book.offset, len(book.key_blocks)) == (BLOCK_SIZE, 1)
    book.check_invariants()


def test_layers_share_one_block_table(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, n_layers=3)
    for layer in range(3):
        book.append(BLOCK_SIZE + 1, layer=layer)
    assert pool.stats.blocks_in_use() == 4


def test_release_returns_every_block_and_the_owner(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool, owner=3, n_layers=2)
    book.append(7, layer=0)
    book.release()
    book.release()  # idempotent
    assert book.released
    assert pool.blocks_for(3) == []
    pool.register_owner(3)  # free again


def test_context_manager_releases_when_the_body_raises(pool: BlockPoolAllocator) -> None:
    with pytest.raises(KeyError), PooledKVCache(pool) as book:
        book.append(9)
        raise KeyError("aborted")
    assert pool.stats.blocks_in_use() == 0


def test_a_released_book_refuses_appends_and_trims_nothing(pool: BlockPoolAllocator) -> None:
    book = PooledKVCache(pool)
    book.release()
    with pytest.raises(RuntimeError, match="released"):
        book.append()
    assert book.trim(1) == 0
    assert not book.is_trimmable()


def test_an_active_owner_is_refused(pool: BlockPoolAllocator) -> None:
    pool.register_owner(7)
    with pytest.raises(OwnerAlreadyActiveError):
        PooledKVCache(pool, owner=7)


def test_too_many_layers_for_the_process_are_refused_naming_the_count(
    pool: BlockPoolAllocator,
) -> None:
    with pool_unchanged(pool), pytest.raises(MemoryError, match=f"n_layers={10**20} "):
        PooledKVCache(pool, owner=7, n_layers=10**20)
    pool.register_owner(7)  # not claimed


def test_automatic_owners_are_distinct(pool: BlockPoolAllocator) -> None:
    assert PooledKVCache(pool).owner != PooledKVCache(pool).owner


@pytest.mark.parametrize(
    ("call", "error", "named"),
    [
        (lambda book: book.append(-1), ValueError, "n_tokens must be an int >= 0, got -1"),
        (lambda book: book.append(True), TypeError, "n_tokens must be an int >= 0, got True"),
        (lambda book: book.append(1, layer=2), ValueError, "layer must be in 0..1, got 2"),
        (lambda book: book.append_moves(-1, 0), ValueError, "n_tokens must be an int >= 0"),
        (lambda book: book.append_moves(1.5, 0), TypeError, "n_tokens must be an int >= 0"),
        (lambda book: book.append_moves(1, 2), ValueError, "layer must be in 0..1, got 2"),
        (lambda book: book.trim(-1), ValueError, "n must be an int >= 0, got -1"),
        (lambda book: book.trim(1, layer=-1), ValueError, "layer must be an int >= 0, got -1"),
        (lambda book: book.layer_offset(-1), ValueError, "got -1"),  # read the last layer's
        (lambda book: book.layer_offset(2), ValueError, "in 0..1, got 2"),  # a bare IndexError
        (lambda book: book.layer_offset(True), TypeError, "got True"),  # read layer 1's
        (lambda book: book.layer_offset("0"), TypeError, "got '0'"),
        (lambda book: book.require_rewritable(0, -1), ValueError, "end must be an int >= 0"),
        (lambda book: book.require_rewritable(0, 2.0), TypeError, "end must be an int >= 0"),
        (lambda book: book.require_rewritable(2, 1), ValueError, "layer must be in 0..1, got 2"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(
    pool: BlockPoolAllocator, call: object, error: type[Exception], named: str
) -> None:
    book = PooledKVCache(pool, n_layers=2)
    book.append(3)
    with pytest.raises(error, match=re.escape(named)):
        call(book)  # type: ignore[operator]
    assert (book.offset, book.layer_offset(0), len(book.key_blocks)) == (3, 3, 1)


def test_appending_no_position_is_a_valid_call_that_changes_nothing(
    pool: BlockPoolAllocator,
) -> None:
    book = PooledKVCache(pool, n_layers=2)
    book.append(3)
    assert book.append_moves(0, 1) == (set(), set(), 0)
    with pool_unchanged(pool, owners=[book.owner]):
        assert book.append(0, layer=1) == 0
        assert book.append(0) == 3
        book.require_rewritable(0, 0)  # replacing a layer by no position is a valid ask
    assert (book.offset, book.layer_offset(1), len(book.key_blocks)) == (3, 0, 1)


@given(
    st.lists(
        st.tuples(st.sampled_from(["append", "trim"]), st.integers(0, 2), st.integers(0, 9)),
        max_size=40,
    )
)
def test_any_append_and_trim_sequence_keeps_the_books_exact(
    operations: list[tuple[str, int, int]],
) -> None:
    pool = _pool(n_blocks=256)
    with PooledKVCache(pool, n_layers=3) as book:
        for operation, layer, n in operations:
            if operation == "append":
                book.append(n, layer=layer)
            else:
                book.trim(n, layer=layer)
            book.check_invariants()
            assert book.offset == max(book.layer_offset(layer) for layer in range(3))
            assert 0 <= book.slots_wasted() < BLOCK_SIZE
            assert pool.stats.blocks_in_use() == 2 * len(book.key_blocks)
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


# -- PoolBackedKVCache: the mlx-lm protocol -------------------------------------------------


@pytest.mark.parametrize("chunks", [[1] * 9, [7, 1, 1, 4], [12], [3, 5, 1]])
def test_update_and_fetch_matches_mlx_lm_kv_cache(
    pool: BlockPoolAllocator, chunks: list[int]
) -> None:
    ours, reference = _one_layer(pool), _reference()
    for seed, n in enumerate(chunks):
        keys, values = _tokens(n, seed), _tokens(n, seed + 100)
        got = ours.update_and_fetch(keys, values)
        expected = _update_reference(reference, keys, values)
        assert ours.offset == reference.offset
        for ours_array, reference_array in zip(got, expected, strict=True):
            assert ours_array.shape == reference_array.shape
            assert mx.array_equal(ours_array, reference_array)
    ours.book.release()


def test_an_empty_update_returns_what_is_held(pool: BlockPoolAllocator) -> None:
    cache = _one_layer(pool)
    for n in (0, 2 * BLOCK_SIZE, 0):
        keys, values = cache.update_and_fetch(_tokens(n, n), _tokens(n, n + 1))
        assert keys.shape == values.shape == (1, HEADS, cache.offset, HEAD_DIM)
    assert cache.offset == 2 * BLOCK_SIZE
    cache.book.release()


def test_trim_then_update_rewrites_like_mlx_lm(pool: BlockPoolAllocator) -> None:
    ours, reference = _one_layer(pool), _reference()
    for cache in (ours, reference):
        cache.update_and_fetch(_tokens(10, 1), _tokens(10, 2))
        assert cache.trim(3) == 3
        got = cache.update_and_fetch(_tokens(2, 3), _tokens(2, 4))
    assert ours.offset == reference.offset == 9
    assert mx.array_equal(got[0], reference.state[0][..., :9, :])
    ours.book.release()


@pytest.mark.parametrize(
    ("n_queries", "offset", "return_array", "window_size"),
    [
        (1, 5, False, None),
        (3, 5, False, None),
        (3, 5, True, None),
        (1, 5, True, None),
        (4, 0, False, None),
        (2, 6, False, 3),
        (1, 6, False, 3),
    ],
)
def test_make_mask_matches_mlx_lm(
    pool: BlockPoolAllocator,
    n_queries: int,
    offset: int,
    return_array: bool,
    window_size: int | None,
) -> None:
    cache = _one_layer(pool)
    if offset:
        cache.update_and_fetch(_tokens(offset, 0), _tokens(offset, 1))
    ours = cache.make_mask(n_queries, return_array=return_array, window_size=window_size)
    expected = create_attention_mask(n_queries, offset, return_array, window_size)
    if isinstance(expected, mx.array):
        assert isinstance(ours, mx.array)
        assert mx.array_equal(ours, expected)
    else:
        assert ours == expected
    cache.book.release()


def test_state_round_trips_into_another_request(pool: BlockPoolAllocator) -> None:
    source, target = _one_layer(pool), _one_layer(pool)
    source.update_and_fetch(_tokens(6, 1), _tokens(6, 2))
    target.update_and_fetch(_tokens(2, 3), _tokens(2, 4))
    target.state = source.state
    assert target.offset == 6
    (target_keys, target_values, offset), (keys, values, _) = target.state, source.state
    assert offset == 6  # (keys, values, offset), as mlx-lm's KVCache.state
    assert mx.array_equal(target_keys, keys)
    assert mx.array_equal(target_values, values)
    assert target.book.slots_held() == 2 * BLOCK_SIZE
    source.book.release()
    target.book.release()


def test_state_accepts_mlx_lm_kv_cache_state(pool: BlockPoolAllocator) -> None:
    reference = _reference()
    _update_reference(reference, _tokens(5, 1), _tokens(5, 2))
    cache = _one_layer(pool)
    cache.state = reference.state  # (padded keys, padded values, offset)
    assert cache.offset == 5
    assert mx.array_equal(cache.state[1], reference.state[1][..., :5, :])
    cache.state = _reference().state  # an empty cache's (None, None, 0)
    assert cache.empty()
    assert pool.stats.blocks_in_use() == 0
    cache.book.release()


@pytest.mark.parametrize(
    "shape", [(HEADS, 5, HEAD_DIM), (1, 1, HEADS, 5, HEAD_DIM)], ids=["3-D", "5-D"]
)
def test_a_state_of_arrays_that_are_not_4d_is_refused_and_changes_nothing(
    pool: BlockPoolAllocator, shape: tuple[int, ...]
) -> None:
    # Such arrays were read as holding no positions: the layer was emptied, no error.
    cache = _one_layer(pool)
    cache.update_and_fetch(_tokens(5, 1), _tokens(5, 2))
    refused = r"\(1, heads, n, head_dim\) arrays, got shapes"
    owners, handles = [cache.book.owner], cache.book.key_blocks
    with pool_unchanged(pool, owners, handles), pytest.raises(ValueError, match=refused):
        cache.state = (mx.ones(shape), mx.ones(shape))
    assert cache.offset == 5
    cache.book.release()


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ((_tokens(3, 3),), r"got a tuple of 1 item \(array\)$"),
        ([_tokens(3, 3)] * 5, r"got a list of 5 items \(array, array, array, array, \.\.\.\)$"),
        (7, r"got 7 \(int\)$"),
    ],
    ids=["one array", "five arrays", "no sequence"],
)
def test_a_state_that_is_no_pair_or_triple_is_refused_naming_its_length_not_its_arrays(
    pool: BlockPoolAllocator, state: object, named: str
) -> None:
    cache = _one_layer(pool)
    cache.update_and_fetch(_tokens(5, 1), _tokens(5, 2))
    expected = r"^state must be \(keys, values\) or \(keys, values, offset\), " + named
    owners, handles = [cache.book.owner], cache.book.key_blocks
    with pool_unchanged(pool, owners, handles), pytest.raises(ValueError, match=expected):
        cache.state = state  # type: ignore[assignment]
    assert cache.offset == 5
    cache.book.release()


@pytest.mark.parametrize(("offset", "error"), [(2.0, TypeError), (9, ValueError)])
def test_a_state_offset_of_the_wrong_type_or_past_the_arrays_is_refused(
    pool: BlockPoolAllocator, offset: object, error: type[Exception]
) -> None:
    cache = _one_layer(pool)
    cache.update_and_fetch(_tokens(5, 1), _tokens(5, 2))
    with pytest.raises(error, match="state's offset must be an int"):
        cache.state = (_tokens(3, 3), _tokens(3, 4), offset)
    assert cache.offset == 5
    cache.book.release()


def test_meta_state_round_trips_the_offset(pool: BlockPoolAllocator) -> None:
    cache = _one_layer(pool)
    cache.update_and_fetch(_tokens(7, 1), _tokens(7, 2))
    assert cache.meta_state == ("7",)
    cache.meta_state = ("5",)
    assert cache.offset == 5
    for bad in (("9",), ("x",), ("1", "2")):
        with pytest.raises(ValueError, match="meta_state"):
            cache.meta_state = bad
    cache.book.release()


def test_sizes_and_nbytes_are_block_granular(pool: BlockPoolAllocator) -> None:
    cache = _one_layer(pool)
    assert (cache.size(), cache.empty(), cache.nbytes) == (0, True, 0)
    cache.update_and_fetch(_tokens(5, 1), _tokens(5, 2))
    slot_bytes = HEADS * HEAD_DIM * mx.float32.size
    assert (cache.size(), cache.empty(), cache.is_trimmable()) == (5, False, True)
    assert cache.nbytes == 2 * (2 * BLOCK_SIZE) * slot_bytes  # keys and values, 2 blocks each
    reference = _reference()
    _update_reference(reference, _tokens(5, 1), _tokens(5, 2))
    assert cache.nbytes < reference.nbytes  # 256-token steps
    cache.book.release()


WRONG_IN_ONE_PART = wrong_in_one_part(HEADS, HEAD_DIM)


@pytest.mark.parametrize(
    ("keys", "values", "error"), WRONG_IN_ONE_PART.values(), ids=WRONG_IN_ONE_PART
)
def test_keys_and_values_wrong_in_one_part_are_refused_before_anything_changes(
    pool: BlockPoolAllocator, keys: object, values: object, error: type[Exception]
) -> None:
    cache = _one_layer(pool)
    with pytest.raises(error):
        cache.update_and_fetch(keys, values)  # type: ignore[arg-type]
    assert (cache.offset, pool.stats.blocks_in_use(), pool.stats.n_allocations) == (0, 0, 0)
    cache.book.release()


def test_a_batch_of_two_is_refused_by_a_store_of_one_head(pool: BlockPoolAllocator) -> None:
    storage = MLXBlockStorage(pool, 1, 1, HEAD_DIM, mx.float32)  # batch and heads alike
    [cache] = PoolBackedPromptCache(storage, PooledKVCache(pool))
    batch_of_two = mx.zeros((2, 1, 1, HEAD_DIM))
    with pytest.raises(ValueError, match="batch size 1"):
        cache.update_and_fetch(batch_of_two, batch_of_two)
    assert (cache.offset, pool.stats.blocks_in_use()) == (0, 0)
    cache.book.release()


def test_a_write_the_store_refuses_gives_the_layer_s_positions_back(
    pool: BlockPoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = PoolBackedPromptCache(_storage(pool), PooledKVCache(pool, n_layers=2))
    caches[0].update_and_fetch(_tokens(3, 1), _tokens(3, 2))
    failure = RuntimeError("the device is gone")

    def fail(*arguments: object) -> NoReturn:
        raise failure

    monkeypatch.setattr(caches[1], "_update_through_table", fail)
    with pool_unchanged(pool, owners=[caches.book.owner]), pytest.raises(RuntimeError) as raised:
        caches[1].update_and_fetch(_tokens(3, 3), _tokens(3, 4))
    assert raised.value is failure
    assert (caches[0].offset, caches[1].offset) == (3, 0)  # layer 0 keeps what it wrote
    assert mx.array_equal(caches[0].state[0], _tokens(3, 1))
    caches.release()


def test_a_layer_cache_built_alone_makes_its_own_table_and_refuses_another_book_s(
    pool: BlockPoolAllocator,
) -> None:
    storage, book, other = _storage(pool, 1), PooledKVCache(pool), PooledKVCache(pool)
    cache = PoolBackedKVCache(storage, book, 0)
    assert cache.attention == "gather"
    keys, _ = cache.update_and_fetch(_tokens(3, 1), _tokens(3, 2))
    assert mx.array_equal(keys, _tokens(3, 1))
    with pytest.raises(ValueError, match=r"^table must follow the same book as the cache$"):
        PoolBackedKVCache(storage, book, 0, table=DeviceBlockTable(other))
    book.release()
    other.release()


class _LooksLikeAnArray:
    """Has an array's shape and the store's dtype, and is no array."""

    shape = (1, HEADS, 1, HEAD_DIM)
    dtype = mx.float32


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (None, "NoneType"),
        (np.zeros((1, HEADS, 1, HEAD_DIM), np.float32), "ndarray"),
        # MLXBlockStorage trusts the cache's check (_decode_through_table): arrays only.
        (_LooksLikeAnArray(), "_LooksLikeAnArray"),
    ],
    ids=["None", "numpy", "duck-typed"],
)
def test_what_is_no_mlx_array_is_refused_by_its_type(
    pool: BlockPoolAllocator, keys: object, named: str
) -> None:
    # Once None gave an AttributeError, and a NumPy array of the store's very dtype was
    # refused as "must have the store's dtype float32, got float32 and float32".
    cache = _one_layer(pool)
    refused = f"keys and values must be mlx.core.array, got {named} and {named}"
    with pytest.raises(TypeError, match=re.escape(refused)):
        cache.update_and_fetch(keys, keys)  # type: ignore[arg-type]
    assert (cache.offset, pool.stats.blocks_in_use(), pool.stats.n_allocations) == (0, 0, 0)
    cache.book.release()


def test_exhaustion_leaves_the_cache_unchanged() -> None:
    pool = _pool(n_blocks=4)
    cache = _one_layer(pool)
    cache.update_and_fetch(_tokens(2 * BLOCK_SIZE, 1), _tokens(2 * BLOCK_SIZE, 2))
    with pytest.raises(BlockPoolExhaustedError):
        cache.update_and_fetch(_tokens(1, 3), _tokens(1, 4))
    assert cache.offset == 2 * BLOCK_SIZE
    cache.book.check_invariants()
    cache.book.release()


def test_book_and_storage_must_share_a_pool(pool: BlockPoolAllocator) -> None:
    with pytest.raises(ValueError, match=r"^book and storage must share one pool; got two diff"):
        PoolBackedKVCache(_storage(_pool()), PooledKVCache(pool), 0)
    in_both = re.escape("layer must be in 0..0 (the book's and the storage's layers), got 1")
    with pytest.raises(ValueError, match=in_both):
        PoolBackedKVCache(_storage(pool, 1), PooledKVCache(pool, n_layers=2), 1)
    with pytest.raises(ValueError, match=in_both):
        PoolBackedKVCache(_storage(pool, 2), PooledKVCache(pool, n_layers=1), 1)
    with pytest.raises(
        TypeError, match=r"layer must be an int, got 0\.0 \(float\)"
    ):  # was a ValueError
        PoolBackedKVCache(_storage(pool, 1), PooledKVCache(pool), 0.0)  # type: ignore[arg-type]


# -- make_pool_backed_cache -----------------------------------------------------------------


def _tiny_llama(**overrides: object) -> llama.Model:
    arguments: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": HEADS * 2 * HEAD_DIM,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_attention_heads": HEADS * 2,
        "num_key_value_heads": HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": 32,
    }
    arguments.update(overrides)
    return llama.Model(llama.ModelArgs(**arguments))  # type: ignore[arg-type]


def test_make_pool_backed_cache_refuses_what_is_no_store(pool: BlockPoolAllocator) -> None:
    with pytest.raises(
        TypeError,
        match=r"^storage must be a block store of the pool \(make_pool_backed_storage\(model, "
        r".*, got BlockPoolAllocator$",
    ):
        make_pool_backed_cache(_tiny_llama(), pool)  # type: ignore[arg-type]
    assert (pool.stats.n_allocations, pool.stats.blocks_in_use()) == (0, 0)


def test_make_pool_backed_cache_builds_one_cache_per_layer(pool: BlockPoolAllocator) -> None:
    with make_pool_backed_cache(_tiny_llama(), _storage(pool), owner=42) as caches:
        assert len(caches) == 2
        assert all(isinstance(cache, PoolBackedKVCache) for cache in caches)
        assert caches.book.owner == 42
        assert caches.book.format == "fp32"
        caches[0].update_and_fetch(_tokens(1, 0), _tokens(1, 1))
        assert pool.blocks_for(42) != []
    assert pool.blocks_for(42) == []
    with make_pool_backed_cache(_tiny_llama(), _storage(pool), format="fp32-tagged") as tagged:
        assert tagged.book.format == "fp32-tagged"


def test_make_pool_backed_cache_refuses_sliding_window_layers(pool: BlockPoolAllocator) -> None:
    model = _tiny_llama(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.raises(ValueError, match="RotatingKVCache"):
        make_pool_backed_cache(model, _storage(pool))


def test_make_pool_backed_cache_needs_a_slab_per_layer(pool: BlockPoolAllocator) -> None:
    with pytest.raises(ValueError, match="but the storage only 2; expected a storage with a slab"):
        make_pool_backed_cache(_tiny_llama(num_hidden_layers=3), _storage(pool))


class _HeadMajorView:
    """A store that also gathers in attention layout (delegating), counting those gathers."""

    def __init__(self, storage: MLXBlockStorage) -> None:
        self._storage = storage
        self.pool = storage.pool
        self.n_layers = storage.n_layers
        self.slot_shape = storage.slot_shape
        self.dtype = storage.dtype
        self.write = storage.write
        self.gather = storage.gather
        self.capacity = storage.capacity
        self.resident_bytes = storage.resident_bytes
        self.sync = storage.sync
        self.head_major_gathers = 0

    def gather_heads(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
        self.head_major_gathers += 1
        return self._storage.gather(layer, blocks, n_tokens).transpose(1, 0, 2)


def test_a_store_with_gather_heads_is_used_for_the_fetch(pool: BlockPoolAllocator) -> None:
    store = _HeadMajorView(_storage(pool, 1))
    assert isinstance(store, GathersHeadMajor)
    ours = PoolBackedPromptCache(store, PooledKVCache(pool))[0]
    reference = _reference()
    for seed, n in enumerate([5, 1, 1]):
        keys, values = _tokens(n, seed), _tokens(n, seed + 50)
        got = ours.update_and_fetch(keys, values)
        expected = _update_reference(reference, keys, values)
        assert all(mx.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert store.head_major_gathers == 6  # keys and values, three updates
    ours.book.release()
