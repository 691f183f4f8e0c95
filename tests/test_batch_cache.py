"""Batched decode over one pool (docs/BATCHED_DECODE.md): rows of different lengths in
one forward pass give each request's own logits, bit for bit ``KVCache``'s, with the
attention hook and without; refused calls leave every request and the pool as they were."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import KVCache
from tiny_models import prompt, tiny_model

from veloxquant_mlx.memory import CheckedBlockPool
from veloxquant_mlx.memory.attention_hook import (
    install_paged_attention,
    uninstall_paged_attention,
)
from veloxquant_mlx.memory.batch_cache import PooledBatchLayer, batch_caches
from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage

N_LAYERS, N_KV_HEADS, HEAD_DIM, BLOCK_SIZE, VOCAB = 2, 2, 16, 4, 96
#: Prompt lengths of the rows: unequal, across block boundaries.
LENGTHS = (3, 9, 14)


def _model() -> Module:
    return tiny_model("llama", 7, n_layers=N_LAYERS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)


def _store(n_blocks: int = 256, *, lazy_writes: bool = True) -> MLXBlockStorage:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))
    return MLXBlockStorage(
        pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32, lazy_writes=lazy_writes
    )


class Rows:
    """Requests prefilled alone in one store, and the same prompts in ``KVCache``s."""

    def __init__(self, model: Module, store: MLXBlockStorage, lengths: tuple[int, ...]) -> None:
        self.model = model
        self.ours = [make_pool_backed_cache(model, store) for _ in lengths]
        self.theirs = [[KVCache() for _ in range(N_LAYERS)] for _ in lengths]  # type: ignore[no-untyped-call]
        self.next_tokens: list[int] = []
        for seed, (length, ours, theirs) in enumerate(
            zip(lengths, self.ours, self.theirs, strict=True)
        ):
            tokens = prompt(seed, length, VOCAB)[None]
            mine, reference = model(tokens, cache=ours), model(tokens, cache=theirs)
            assert mx.array_equal(mine, reference)
            self.next_tokens.append(int(mx.argmax(reference[0, -1])))

    def step_both(self, batch: list[PooledBatchLayer], order: list[int]) -> None:
        """One batched step of the rows ``order`` against each one's ``KVCache`` alone."""
        tokens = mx.array([[self.next_tokens[row]] for row in order])
        batched = self.model(tokens, cache=batch)
        for position, row in enumerate(order):
            alone = self.model(tokens[position : position + 1], cache=self.theirs[row])
            assert mx.array_equal(batched[position : position + 1], alone), f"row {row}"
            self.next_tokens[row] = int(mx.argmax(alone[0, -1]))

    def release(self) -> None:
        for cache in self.ours:
            cache.release()


@pytest.fixture(params=["padded", "by rows"])
def attention(request: pytest.FixtureRequest) -> Iterator[str]:
    """Whether the model's attention reads the padded arrays or the batch's rows."""
    yield request.param


@pytest.fixture
def model(attention: str) -> Iterator[Module]:
    built = _model()
    if attention == "by rows":
        install_paged_attention(built)
    yield built
    uninstall_paged_attention(built)


@pytest.mark.parametrize("lazy_writes", [True, False])
def test_rows_of_different_lengths_decode_as_each_alone(model: Module, lazy_writes: bool) -> None:
    rows = Rows(model, _store(lazy_writes=lazy_writes), LENGTHS)
    batch = batch_caches(rows.ours)
    for _ in range(6):  # past a block boundary of every row
        rows.step_both(batch, [0, 1, 2])
    assert [cache[0].offset for cache in rows.ours] == [length + 6 for length in LENGTHS]
    for ours in rows.ours:
        ours.book.check_invariants()
    rows.release()


def test_a_chunk_of_positions_per_row_decodes_as_each_alone(model: Module) -> None:
    rows = Rows(model, _store(), LENGTHS)
    batch = batch_caches(rows.ours)
    chunk = mx.random.randint(0, VOCAB, (len(LENGTHS), 3), key=mx.random.key(5))
    batched = model(chunk, cache=batch)
    for row, theirs in enumerate(rows.theirs):
        assert mx.array_equal(batched[row : row + 1], model(chunk[row : row + 1], cache=theirs))
    rows.release()


def test_requests_leave_and_join_batches(model: Module) -> None:
    rows = Rows(model, _store(), LENGTHS)
    rows.step_both(batch_caches(rows.ours), [0, 1, 2])
    # Row 1 goes on alone for two steps, then rows 2 and 1 are batched in that order.
    for _ in range(2):
        token = mx.array([[rows.next_tokens[1]]])
        mine = model(token, cache=rows.ours[1])
        alone = model(token, cache=rows.theirs[1])
        assert mx.array_equal(mine, alone)
        rows.next_tokens[1] = int(mx.argmax(alone[0, -1]))
    pair = batch_caches([rows.ours[2], rows.ours[1]])
    for _ in range(3):
        rows.step_both(pair, [2, 1])
    rows.release()


def test_the_hook_attends_by_rows_only_for_the_batch_s_own_mask() -> None:
    built = _model()
    install_paged_attention(built)
    try:
        rows = Rows(built, _store(), LENGTHS)
        batch = batch_caches(rows.ours)
        answered: list[bool] = []
        original = PooledBatchLayer.attend_rows

        def spy(layer: PooledBatchLayer, *arguments: object) -> mx.array | None:
            result = original(layer, *arguments)  # type: ignore[arg-type]
            answered.append(result is not None)
            return result

        PooledBatchLayer.attend_rows = spy  # type: ignore[method-assign, assignment]
        try:
            rows.step_both(batch, [0, 1, 2])
        finally:
            PooledBatchLayer.attend_rows = original  # type: ignore[method-assign]
        assert answered == [True] * N_LAYERS
        queries = mx.zeros((len(LENGTHS), 2 * N_KV_HEADS, 1, HEAD_DIM))
        foreign = mx.ones((len(LENGTHS), 1, 1, LENGTHS[-1] + 2), dtype=mx.bool_)
        assert batch[0].attend_rows(queries, 1.0, foreign) is None
        rows.release()
    finally:
        uninstall_paged_attention(built)


def test_offset_and_masks_follow_the_rules() -> None:
    store = _store()
    rows = Rows(_model(), store, (2, 5))
    [layer, _] = batch_caches(rows.ours)
    assert layer.offset.tolist() == [2, 5]
    assert layer.offset.dtype == mx.int32
    mask = layer.make_mask(2)
    assert isinstance(mask, mx.array)
    assert mask.shape == (2, 1, 2, 7)
    # Row 0 holds 2 of the longest 5: its first 3 keys are padding.
    expected_row_0 = [[False] * 3 + [True] * 3 + [False], [False] * 3 + [True] * 4]
    expected_row_1 = [[True] * 6 + [False], [True] * 7]
    assert mask[:, 0].tolist() == [expected_row_0, expected_row_1]
    twin = rows.ours[1].fork()
    equal = batch_caches([rows.ours[1], twin])
    assert equal[0].make_mask(1) is None
    assert equal[0].make_mask(3) == "causal"
    assert isinstance(equal[0].make_mask(1, return_array=True), mx.array)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"n_new must be an int >= 1"):
            layer.make_mask(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_size must be None"):
        layer.make_mask(1, window_size=4)
    twin.release()
    rows.release()


def _state(rows: Rows, store: MLXBlockStorage) -> tuple[object, ...]:
    pool = store.pool
    return (
        [cache[layer].offset for cache in rows.ours for layer in range(N_LAYERS)],
        [tuple(block.block_id for block in cache.book.key_blocks) for cache in rows.ours],
        pool.stats.blocks_in_use(),
        {stream: pool.n_free(stream) for stream in ("k", "v")},
    )


@pytest.mark.parametrize(
    ("keys_shape", "dtype", "error", "match"),
    [
        ((2, N_KV_HEADS, 1, HEAD_DIM), mx.float32, ValueError, r"shape \(3, 2, n, 16\)"),
        ((3, N_KV_HEADS + 1, 1, HEAD_DIM), mx.float32, ValueError, r"one row per request"),
        ((3, N_KV_HEADS, 1, HEAD_DIM), mx.float16, TypeError, r"store's dtype float32"),
        ((3, N_KV_HEADS, 1), mx.float32, ValueError, r"got \(3, 2, 1\)"),
    ],
)
def test_bad_keys_are_refused_before_any_row_changes(
    keys_shape: tuple[int, ...], dtype: mx.Dtype, error: type[Exception], match: str
) -> None:
    store = _store()
    rows = Rows(_model(), store, LENGTHS)
    [layer, _] = batch_caches(rows.ours)
    before = _state(rows, store)
    keys = mx.zeros(keys_shape, dtype=dtype)
    with pytest.raises(error, match=match):
        layer.update_and_fetch(keys, keys)
    with pytest.raises(TypeError, match=r"must be mlx\.core\.array"):
        layer.update_and_fetch([1], keys)  # type: ignore[arg-type]
    assert _state(rows, store) == before
    rows.release()


def test_a_row_the_pool_cannot_grow_trims_the_rows_before_it_back() -> None:
    # Rows of 4, 4 and 3 positions: the first two need a new block per stream to grow.
    store = _store(n_blocks=8)
    rows = Rows(_model(), store, (4, 4, 3))
    pool = store.pool
    taken = [
        block
        for stream in ("k", "v")
        if pool.n_free(stream) > 1
        for block in pool.allocate(stream, (pool.n_free(stream) - 1) * BLOCK_SIZE, owner=99)
    ]
    assert (pool.n_free("k"), pool.n_free("v")) == (1, 1)
    [layer, _] = batch_caches(rows.ours)
    before = _state(rows, store)
    next_key_id = _next_ids(pool)
    token = mx.zeros((3, N_KV_HEADS, 1, HEAD_DIM))
    with pytest.raises(BlockPoolExhaustedError):
        layer.update_and_fetch(token, token)  # row 0 takes the last blocks, row 1 cannot
    assert _state(rows, store) == before
    assert _next_ids(pool) == next_key_id  # the pool hands out the same ids next
    for cache in rows.ours:
        cache.book.check_invariants()
    if taken:
        pool.free(taken)
    rows.release()
    pool.check_invariants()


def _next_ids(pool: CheckedBlockPool[Block]) -> tuple[int, int]:
    [key] = pool.allocate("k", 1, owner=98)
    [value] = pool.allocate("v", 1, owner=98)
    pool.free([value, key])
    return key.block_id, value.block_id


def test_batch_caches_refuses_what_cannot_be_one_batch() -> None:
    model = _model()
    store = _store()
    first, second = (make_pool_backed_cache(model, store) for _ in range(2))
    other_store = make_pool_backed_cache(model, _store())
    three_layers = make_pool_backed_cache(
        tiny_model("llama", 7, n_layers=3, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM),
        _three_layer_store(store),
    )
    released = make_pool_backed_cache(model, store)
    released.release()
    cases: list[tuple[object, type[Exception], str]] = [
        (first, TypeError, r"must be a PoolBackedPromptCache, got PoolBackedKVCache"),
        ("ab", TypeError, r"got str"),
        (7, TypeError, r"got int"),
        ([], ValueError, r"at least one"),
        ([first, [1]], TypeError, r"requests\[1\] must be a PoolBackedPromptCache, got list"),
        ([first, second, first], ValueError, r"requests\[2\] is requests\[0\] again"),
        ([first, released], ValueError, r"requests\[1\] was released"),
        ([first, other_store], ValueError, r"requests\[1\] lives in another store"),
        ([first, three_layers], ValueError, r"requests\[1\] has 3 layers, requests\[0\] 2"),
    ]
    for requests, error, match in cases:
        with pytest.raises(error, match=match):
            batch_caches(requests)  # type: ignore[arg-type]
    assert [cache[0].offset for cache in (first, second)] == [0, 0]
    for cache in (first, second, other_store, three_layers):
        cache.release()


def _three_layer_store(like: MLXBlockStorage) -> MLXBlockStorage:
    return MLXBlockStorage(like.pool, 3, N_KV_HEADS, HEAD_DIM, mx.float32, lazy_writes=True)
