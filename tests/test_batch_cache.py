"""Batched decode over one pool (docs/BATCHED_DECODE.md): rows of different lengths in
one forward pass give each request's own logits, as ``KVCache`` decoding it alone does,
with the attention hook and without; refused calls leave every request and the pool as
they were.

On the CPU the logits are equal bit for bit. On MLX's CUDA back-end the model's linear
layers compute a batch of rows with other kernels than a single row, and float32
results differ there in the last bits (the prefills, one row each, agree bit for
bit): the keys and values a batched step stores differ as much, and so do the logits
of every later step, by up to a few thousandths of their largest magnitude on an
H200. So on a GPU the logits must agree within ``GPU_TOLERANCE`` of their largest
magnitude; a cache that read another row's positions or a padded one misses that by
far."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import NoReturn

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    assert_only_exhaustion_recorded,
    book_and_pool_state,
    leave_free,
    observe,
    pool_unchanged,
    reserved_blocks,
)
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import KVCache
from threads import in_thread
from tiny_models import greedy, prompt, tiny_model

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
from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import StaleBlockTableError
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache

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


#: On a GPU: how far logits may differ, as a fraction of their largest magnitude.
GPU_TOLERANCE = 0.05


def assert_same_logits(batched: mx.array, alone: mx.array, what: str) -> None:
    """Bit for bit on the CPU; on a GPU within ``GPU_TOLERANCE`` of the largest logit
    (the module docstring says why)."""
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(batched, alone), what
        return
    tolerance = GPU_TOLERANCE * mx.abs(alone).max()
    assert (mx.abs(batched - alone).max() <= tolerance).item(), what


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
            assert_same_logits(batched[position : position + 1], alone, f"row {row}")
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


@pytest.mark.parametrize("n_positions", [2, 3])
def test_a_chunk_of_positions_per_row_decodes_as_each_alone(
    model: Module, n_positions: int
) -> None:
    rows = Rows(model, _store(), LENGTHS)
    batch = batch_caches(rows.ours)
    chunk = mx.random.randint(0, VOCAB, (len(LENGTHS), n_positions), key=mx.random.key(5))
    batched = model(chunk, cache=batch)
    for row, theirs in enumerate(rows.theirs):
        alone = model(chunk[row : row + 1], cache=theirs)
        assert_same_logits(batched[row : row + 1], alone, f"row {row}")
    rows.release()


def test_requests_leave_and_join_batches(model: Module) -> None:
    rows = Rows(model, _store(), LENGTHS)
    rows.step_both(batch_caches(rows.ours), [0, 1, 2])
    # Row 1 goes on alone for two steps, then rows 2 and 1 are batched in that order.
    for _ in range(2):
        token = mx.array([[rows.next_tokens[1]]])
        mine = model(token, cache=rows.ours[1])
        alone = model(token, cache=rows.theirs[1])
        assert_same_logits(mine, alone, "row 1 alone")  # its batched step's keys are in it
        rows.next_tokens[1] = int(mx.argmax(alone[0, -1]))
    pair = batch_caches([rows.ours[2], rows.ours[1]])
    for _ in range(3):
        rows.step_both(pair, [2, 1])
    rows.release()


@pytest.mark.parametrize("attention", ["by rows"])
def test_the_hook_attends_by_rows_only_for_the_batch_s_own_mask(
    model: Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = Rows(model, _store(), LENGTHS)
    batch = batch_caches(rows.ours)
    answered: list[bool] = []
    original = PooledBatchLayer.attend_rows

    def spy(layer: PooledBatchLayer, *arguments: object) -> mx.array | None:
        result = original(layer, *arguments)  # type: ignore[arg-type]
        answered.append(result is not None)
        return result

    with monkeypatch.context() as patched:
        patched.setattr(PooledBatchLayer, "attend_rows", spy)
        rows.step_both(batch, [0, 1, 2])
    assert answered == [True] * N_LAYERS
    # Both layers hold fresh reads: only the batch's own mask is answered.
    token = mx.zeros((len(LENGTHS), N_KV_HEADS, 1, HEAD_DIM))
    queries = mx.zeros((len(LENGTHS), 2 * N_KV_HEADS, 1, HEAD_DIM))
    own = batch[0].make_mask(1)
    foreign = mx.ones((len(LENGTHS), 1, 1, LENGTHS[-1] + 2), dtype=mx.bool_)
    batch[0].update_and_fetch(token, token)
    assert batch[0].attend_rows(queries, 1.0, foreign) is None
    batch[1].update_and_fetch(token, token)
    assert batch[1].attend_rows(queries, 1.0, own) is not None
    rows.release()


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
    decode_mask = layer.make_mask(1)  # a decode step hides the padding too
    assert isinstance(decode_mask, mx.array)
    assert decode_mask[:, 0].tolist() == [[[False] * 3 + [True] * 3], [[True] * 6]]
    twin = rows.ours[1].fork()
    equal = batch_caches([rows.ours[1], twin])
    assert equal[0].make_mask(1) is None
    assert equal[0].make_mask(3) == "causal"
    assert isinstance(equal[0].make_mask(1, return_array=True), mx.array)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"n_new must be an int >= 1 .*, got {bad}"):
            layer.make_mask(bad)
    for wrong in (1.0, True, "1"):
        with pytest.raises(TypeError, match=r"n_new must be an int and return_array a bool"):
            layer.make_mask(wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 1 \(int\) and 'no'"):
        layer.make_mask(1, return_array="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_size must be None"):
        layer.make_mask(1, window_size=4)
    twin.release()
    rows.release()


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
    before = _pool_and_rows(store.pool, rows.ours)
    keys = mx.zeros(keys_shape, dtype=dtype)
    with pytest.raises(error, match=match):
        layer.update_and_fetch(keys, keys)
    with pytest.raises(TypeError, match=r"must be mlx\.core\.array"):
        layer.update_and_fetch([1], keys)  # type: ignore[arg-type]
    good = mx.zeros((len(LENGTHS), N_KV_HEADS, 1, HEAD_DIM))
    with pytest.raises(TypeError, match=r"store's dtype float32, got float32 and float16"):
        layer.update_and_fetch(good, good.astype(mx.float16))
    assert _pool_and_rows(store.pool, rows.ours) == before
    rows.release()


def test_a_step_that_grows_two_rows_with_one_free_block_changes_nothing() -> None:
    # Rows of 4, 4 and 3 positions: the first two need a new block per stream to grow.
    store = _store(n_blocks=8)
    rows = Rows(_model(), store, (4, 4, 3))
    pool = store.pool
    leave_free(pool, 1)  # the rows hold 3 of the 4 blocks per stream: takes none
    assert (pool.n_free("k"), pool.n_free("v")) == (1, 1)
    [layer, _] = batch_caches(rows.ours)
    before = _pool_and_rows(store.pool, rows.ours)
    next_key_id = _next_ids(pool)
    token = mx.zeros((3, N_KV_HEADS, 1, HEAD_DIM))
    assert isinstance(pool, BlockPoolAllocator)
    owners = [row.book.owner for row in rows.ours]
    observed = observe(pool, owners)
    with pytest.raises(BlockPoolExhaustedError):
        layer.update_and_fetch(token, token)  # row 0 alone could grow, not rows 0 and 1
    assert_only_exhaustion_recorded(observed, observe(pool, owners))
    assert _pool_and_rows(store.pool, rows.ours) == before
    assert _next_ids(pool) == next_key_id  # the pool hands out the same ids next
    for cache in rows.ours:
        cache.book.check_invariants()
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
    # A store without the block-table decode path (typed for NumPy dtypes: a misuse).
    numpy_pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    numpy_store = NumpyBlockStorage(numpy_pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, np.float32)
    in_numpy = make_pool_backed_cache(model, numpy_store)  # type: ignore[arg-type]
    cases: list[tuple[object, type[Exception], str]] = [
        (first, TypeError, r"must be a PoolBackedPromptCache, got PoolBackedKVCache"),
        ("ab", TypeError, r"got str"),
        (7, TypeError, r"got int"),
        ([], ValueError, r"at least one"),
        ([first, [1]], TypeError, r"requests\[1\] must be a PoolBackedPromptCache, got list"),
        ([first, second, first], ValueError, r"requests\[2\] is requests\[0\] again"),
        # Another list over the same book is the same request: its layers would append twice.
        ([first, copy.copy(first)], ValueError, r"requests\[1\] is requests\[0\] again \(the"),
        (
            [second, PoolBackedPromptCache(store, second.book)],
            ValueError,
            r"\[1\] is requests\[0\]",
        ),
        ([first, released], ValueError, r"requests\[1\] was released"),
        ([first, other_store], ValueError, r"requests\[1\] lives in another store"),
        ([first, three_layers], ValueError, r"requests\[1\] has 3 layers, requests\[0\] 2"),
        ([in_numpy, first], ValueError, r"requests\[0\] lives in a NumpyBlockStorage; a pooled"),
    ]
    for requests, error, match in cases:
        with pytest.raises(error, match=match):
            batch_caches(requests)  # type: ignore[arg-type]
    assert [cache[0].offset for cache in (first, second)] == [0, 0]
    for cache in (first, second, other_store, three_layers, in_numpy):
        cache.release()


def _three_layer_store(like: MLXBlockStorage) -> MLXBlockStorage:
    return MLXBlockStorage(like.pool, 3, N_KV_HEADS, HEAD_DIM, mx.float32, lazy_writes=True)


@pytest.mark.parametrize("case", ["fork shares the last block", "reservation", "a row forked"])
def test_a_step_the_pool_cannot_supply_is_refused_before_any_row_changes(case: str) -> None:
    # Every row's copies and growth are asked for at once, before any row appends: a row
    # that would copy a shared block or take its reservation, then a row that is refused,
    # must leave no copy or reservation behind (BATCH-REFUSED).
    model, store = _model(), _store(n_blocks=16)
    pool = store.pool
    reserving = case == "reservation"
    first = make_pool_backed_cache(model, store, reserve_tokens=16 if reserving else 0)
    if not reserving:
        model(prompt(1, 6, VOCAB)[None], cache=first)  # two blocks, the last half full
    twin = first.fork() if case != "reservation" else None
    full = make_pool_backed_cache(model, store)
    model(prompt(2, 4, VOCAB)[None], cache=full)  # one full block: grows next step
    rows = [first, twin, full] if case == "a row forked" else [first, full]
    assert all(row is not None for row in rows)
    leave_free(pool, 1 if not reserving else 4)
    layer = batch_caches(rows)[0]  # type: ignore[arg-type]
    before = _pool_and_rows(pool, rows)  # type: ignore[arg-type]
    token = mx.zeros((len(rows), N_KV_HEADS, 1, HEAD_DIM))
    assert isinstance(pool, BlockPoolAllocator)
    owners = [row.book.owner for row in rows if row is not None]
    observed = observe(pool, owners)
    with pytest.raises(BlockPoolExhaustedError, match=r"a batched step of \d requests"):
        layer.update_and_fetch(token, token)
    assert_only_exhaustion_recorded(observed, observe(pool, owners))
    assert _pool_and_rows(pool, rows) == before  # type: ignore[arg-type]
    model(mx.array([[3]]), cache=full)  # the row that had room alone still has it
    for cache in (first, twin, full):
        if cache is not None:
            cache.release()


@pytest.mark.parametrize("short", ["k", "v", "both"])
def test_a_step_of_copies_alone_the_pool_cannot_supply_changes_nothing(short: str) -> None:
    # Both rows grow into the half-full last block that a third book shares too: the step
    # takes no new block, but copies it twice per stream (min(k, r - 1) = 2); the short
    # stream has one free block, any other two.
    model, store = _model(), _store(n_blocks=16)
    pool = store.pool
    first = make_pool_backed_cache(model, store)
    model(prompt(1, 6, VOCAB)[None], cache=first)
    twin, outside = first.fork(), first.fork()
    leave_free(pool, 2)
    for stream in ("k", "v") if short == "both" else (short,):
        pool.allocate(stream, BLOCK_SIZE, owner=999)
    layer = batch_caches([first, twin])[0]
    before = _pool_and_rows(pool, [first, twin, outside])
    token = mx.zeros((2, N_KV_HEADS, 1, HEAD_DIM))
    assert isinstance(pool, BlockPoolAllocator)
    owners = [cache.book.owner for cache in (first, twin, outside)]
    observed = observe(pool, owners)
    named = rf"a batched step of 2 requests \(owners {owners[0]}, {owners[1]}\) is refused: "
    with pytest.raises(BlockPoolExhaustedError, match=named + rf"owner {owners[0]} needs 2 k"):
        layer.update_and_fetch(token, token)
    assert_only_exhaustion_recorded(observed, observe(pool, owners))
    assert _pool_and_rows(pool, [first, twin, outside]) == before
    for cache in (first, twin, outside):
        cache.release()
    pool.check_invariants()


@pytest.mark.parametrize("forks", ["a row and its fork", "two forks outside the batch"])
@pytest.mark.parametrize("spare", [0, -1], ids=["exactly enough", "one block short"])
def test_a_shared_last_block_is_copied_once_per_holder_but_its_last(forks: str, spare: int) -> None:
    # A 6-position request's half-full last block is shared: the step copies it once for
    # the rows that grow into it, however many of them, but never for its last holder
    # (min(k, r - 1) copies), and the 4-position row takes one new block: 2 per stream.
    model, store = _model(), _store(n_blocks=16)
    pool = store.pool
    first = make_pool_backed_cache(model, store)
    model(prompt(1, 6, VOCAB)[None], cache=first)
    twins = [first.fork() for _ in range(1 if forks == "a row and its fork" else 2)]
    full = make_pool_backed_cache(model, store)
    model(prompt(2, 4, VOCAB)[None], cache=full)
    rows = [first, twins[0], full] if forks == "a row and its fork" else [first, full]
    leave_free(pool, 2 + spare)
    token = mx.zeros((len(rows), N_KV_HEADS, 1, HEAD_DIM))
    if spare:
        with pytest.raises(BlockPoolExhaustedError, match=r"a batched step"):
            batch_caches(rows)[0].update_and_fetch(token, token)
    else:
        for layer in batch_caches(rows):
            layer.update_and_fetch(token, token)
        assert [row[0].offset for row in rows] == [7] * (len(rows) - 1) + [5]
    pool.check_invariants()
    for cache in (first, *twins, full):
        cache.release()


def _pool_and_rows(
    pool: CheckedBlockPool[Block], rows: list[PoolBackedPromptCache]
) -> tuple[object, ...]:
    return tuple(book_and_pool_state(row.book, pool) for row in rows)


@pytest.mark.parametrize("stale_row", [0, 2])
def test_a_row_with_a_stale_block_is_refused_before_any_row_changes(stale_row: int) -> None:
    store = _store()
    lengths = (4, 9, 14)  # row 0 takes a block at the step: a claim undone would show
    rows = Rows(_model(), store, lengths)
    stale = rows.ours[stale_row].book.key_blocks[0]
    pool = store.pool
    pool.free([stale])  # behind the book's back
    [layer, _] = batch_caches(rows.ours)
    before = [cache[0].offset for cache in rows.ours]
    token = mx.zeros((len(lengths), N_KV_HEADS, 1, HEAD_DIM))
    assert isinstance(pool, BlockPoolAllocator)
    owners = [row.book.owner for row in rows.ours]
    with (
        pool_unchanged(pool, owners),
        pytest.raises(StaleBlockTableError, match=rf"block_id={stale.block_id}\b"),
    ):
        layer.update_and_fetch(token, token)
    assert [cache[0].offset for cache in rows.ours] == before
    healthy = [row for row in range(len(lengths)) if row != stale_row]
    pair = batch_caches([rows.ours[row] for row in healthy])  # they go on, as if nothing happened
    for _ in range(2):
        rows.step_both(pair, healthy)


def test_a_fork_with_a_stale_shared_block_leaves_the_other_rows_as_they_were() -> None:
    # The fork's own append (into its private last block) would go through; only its
    # table finds the stale handle. No row may keep a position that was never written.
    store = _store()
    rows = Rows(_model(), store, (5, 8))
    fork = rows.ours[1].fork()
    rows.model(mx.array([[1]]), cache=fork)  # a private third block, one position in it
    store.pool.free([fork.book.key_blocks[1]])  # a shared handle, behind the book's back
    batch = batch_caches([rows.ours[0], fork])
    with pytest.raises(StaleBlockTableError):
        rows.model(mx.array([[rows.next_tokens[0]], [1]]), cache=batch)
    assert [layer.offset for layer in rows.ours[0]] == [5, 5]
    rows.step_both(batch_caches([rows.ours[0]]), [0])  # bit for bit as before
    fork.release()
    rows.release()


def test_layers_out_of_step_are_refused_before_any_row_changes(model: Module) -> None:
    rows = Rows(model, _store(), LENGTHS)
    rows.ours[1][1].trim(2)  # layer 1 of row 1 alone: the first layer's mask misfits it
    batch = batch_caches(rows.ours)
    tokens = mx.array([[rows.next_tokens[row]] for row in range(len(LENGTHS))])
    with pytest.raises(ValueError, match=r"row 1 holds \[9, 7\] positions at its layers"):
        model(tokens, cache=batch)
    assert [[layer.offset for layer in cache] for cache in rows.ours] == [[3, 3], [9, 7], [14, 14]]
    in_step = [0, 2]  # the rows in step go on, unchanged by the refusal
    pair = batch_caches([rows.ours[row] for row in in_step])
    rows.step_both(pair, in_step)
    with pytest.raises(ValueError, match=r"4 at the first layer; expected 3: call the batch's"):
        pair[1].update_and_fetch(*(mx.zeros((2, N_KV_HEADS, 1, HEAD_DIM)),) * 2)
    assert [[layer.offset for layer in rows.ours[row]] for row in in_step] == [[4, 4], [15, 15]]
    rows.release()


@pytest.mark.parametrize("fault", ["reserved block freed", "last block shared"])
def test_a_later_row_s_own_refusal_leaves_an_earlier_fork_unmoved(fault: str) -> None:
    # Row 0 is a fork whose partly filled last block the step would copy; row 1's append
    # alone would be refused with nothing changed, so the batch must be too (no copy).
    model, store = _model(), _store()
    pool = store.pool
    parent = make_pool_backed_cache(model, store)
    model(prompt(1, 6, VOCAB)[None], cache=parent)  # the last block half full
    fork = parent.fork()
    reserving = fault == "reserved block freed"
    other = make_pool_backed_cache(model, store, reserve_tokens=16 if reserving else 0)
    model(prompt(2, 4 if reserving else 5, VOCAB)[None], cache=other)
    if reserving:  # the reserved block the next growth takes, freed behind the book's back
        [reserved, *_] = [b for b in reserved_blocks(other.book, pool) if b.stream == "k"]
        pool.free([reserved])
    else:  # the partly filled last block, shared behind the book's back
        pool.share([other.book.key_blocks[-1]], 777)
    batch = batch_caches([fork, other])
    before = _pool_and_rows(pool, [parent, fork, other])
    tokens = mx.array([[3], [4]])
    with pytest.raises(ValueError, match=r"behind the book's back"):
        model(tokens, cache=batch)
    assert _pool_and_rows(pool, [parent, fork, other]) == before  # no copy-on-write either
    for cache in (parent, fork):
        cache.release()


@pytest.mark.parametrize("n_prompt", [4, 1])
def test_kv_bits_is_refused_before_any_row_changes(n_prompt: int) -> None:
    # mlx-lm's generator asks for kv_bits: a batch's first layer refuses it before it
    # claims anything, as a request's own cache does (a one-position prompt included).
    store = _store()
    assert isinstance(store.pool, BlockPoolAllocator)
    rows = Rows(_model(), store, (5,))
    batch = batch_caches(rows.ours)
    refused = pytest.raises(
        ValueError, match=r"kv_bits=4 cannot quantize a PooledBatchLayer: .* float32"
    )
    with pool_unchanged(store.pool, owners=[rows.ours[0].book.owner]), refused:
        greedy(rows.model, prompt(3, n_prompt, VOCAB), batch, 2, kv_bits=4, kv_group_size=8)
    assert [layer.offset for layer in rows.ours[0]] == [5, 5]
    rows.step_both(batch, [0])  # outside the generator the same batch goes on
    rows.release()


def test_kv_bits_after_steps_outside_the_generator_is_refused_at_its_probe() -> None:
    # The first layer does not look for kv_bits again at a one-position step; the
    # generator's to_quantized probe after the forward pass refuses instead, with that
    # step's position stored (BATCH-REFUSED), as a request's own cache does.
    store = _store()
    rows = Rows(_model(), store, (5,))
    batch = batch_caches(rows.ours)
    rows.step_both(batch, [0])
    with pytest.raises(ValueError, match=r"kv_bits=4 cannot quantize a PooledBatchLayer"):
        greedy(rows.model, prompt(3, 1, VOCAB), batch, 2, kv_bits=4, kv_group_size=8)
    assert [layer.offset for layer in rows.ours[0]] == [7, 7]
    store.pool.check_invariants()
    rows.release()


def test_another_thread_is_refused_before_the_pool_is_asked() -> None:
    store = _store(n_blocks=8)
    rows = Rows(_model(), store, (4, 4))  # both grow next step; the pool has too few
    leave_free(store.pool, 1)
    batch = batch_caches(rows.ours)
    token = mx.zeros((2, N_KV_HEADS, 1, HEAD_DIM))
    exhausted = store.pool.stats.n_exhausted
    error = in_thread("other", lambda: batch[0].update_and_fetch(token, token))
    assert type(error) is RuntimeError
    assert "lazy_writes" in str(error)
    assert store.pool.stats.n_exhausted == exhausted


def test_without_the_hook_one_layer_at_most_holds_reads() -> None:
    built = _model()  # no hook: no attention call uses the reads
    rows = Rows(built, _store(), LENGTHS)
    batch = batch_caches(rows.ours)
    rows.step_both(batch, [0, 1, 2])
    assert [bool(layer._reads) for layer in batch] == [False] * (N_LAYERS - 1) + [True]
    rows.step_both(batch, [0, 1, 2])
    assert sum(bool(layer._reads) for layer in batch) == 1
    rows.release()


def test_attend_rows_answers_once_and_only_for_what_was_written() -> None:
    rows = Rows(_model(), _store(), LENGTHS)
    [first, second] = batch_caches(rows.ours)
    token = mx.zeros((len(LENGTHS), N_KV_HEADS, 1, HEAD_DIM))
    queries = mx.zeros((len(LENGTHS), 2 * N_KV_HEADS, 1, HEAD_DIM))
    mask = first.make_mask(1)
    first.update_and_fetch(token, token)
    two_positions = mx.zeros((len(LENGTHS), 2 * N_KV_HEADS, 2, HEAD_DIM))
    assert first.attend_rows(two_positions, 1.0, mask) is None  # one position was written
    second.update_and_fetch(token, token)
    assert second.attend_rows(queries, 1.0, mask) is not None
    assert second.attend_rows(queries, 1.0, mask) is None  # its reads are used once
    rows.release()


@pytest.mark.parametrize("mask", ["causal", None])
def test_attend_rows_answers_a_chunk_as_the_padded_read_does_with_the_same_mask(
    mask: str | None,
) -> None:
    # Rows of one length need no array mask: mlx-lm passes "causal" for a chunk; a
    # caller that passes None asks for no mask, and gets none row by row either.
    rows = Rows(_model(), _store(), (5, 5))
    [first, _] = batch_caches(rows.ours)
    chunk = mx.random.normal((2, N_KV_HEADS, 2, HEAD_DIM), key=mx.random.key(1))
    queries = mx.random.normal((2, 2 * N_KV_HEADS, 2, HEAD_DIM), key=mx.random.key(2))
    keys, values = first.update_and_fetch(chunk, chunk)
    padded = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    by_rows = first.attend_rows(queries, 0.25, mask)
    assert by_rows is not None
    assert mx.allclose(by_rows, padded, atol=1e-5).item()
    rows.release()


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((len(LENGTHS) - 1, 2 * N_KV_HEADS, 1, HEAD_DIM), mx.float32),  # a row short
        ((len(LENGTHS), 2 * N_KV_HEADS, HEAD_DIM), mx.float32),  # not (B, heads, n, dim)
        ((len(LENGTHS), 2 * N_KV_HEADS, 1, HEAD_DIM), mx.float16),  # not the store's dtype
    ],
)
def test_attend_rows_declines_queries_that_do_not_fit_the_rows(
    shape: tuple[int, ...], dtype: mx.Dtype
) -> None:
    rows = Rows(_model(), _store(), LENGTHS)
    [first, _] = batch_caches(rows.ours)
    token = mx.zeros((len(LENGTHS), N_KV_HEADS, 1, HEAD_DIM))
    first.update_and_fetch(token, token)
    assert first.attend_rows(mx.zeros(shape, dtype=dtype), 1.0, None) is None
    rows.release()


@pytest.mark.parametrize("refused", ["a later row's append", "the store's write"])
def test_a_refusal_after_the_look_trims_back_every_row_appended(
    refused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the look cannot see (another thread taking the last free block, a store
    # failing) refuses after rows appended: each is trimmed back, its new block freed.
    store = _store()
    rows = Rows(_model(), store, (4, 9, 13))  # row 0 takes a block at the next step
    [layer, _] = batch_caches(rows.ours)
    before = _pool_and_rows(store.pool, rows.ours)
    failure = RuntimeError(f"{refused} failed")

    def fail(*arguments: object, **keywords: object) -> NoReturn:
        raise failure

    if refused == "the store's write":
        monkeypatch.setattr(store, "_decode_rows_through_tables", fail)
    else:
        monkeypatch.setattr(rows.ours[2].book, "append", fail)
    token = mx.zeros((3, N_KV_HEADS, 1, HEAD_DIM))
    with pytest.raises(RuntimeError) as raised:
        layer.update_and_fetch(token, token)
    assert raised.value is failure
    assert _pool_and_rows(store.pool, rows.ours) == before
    monkeypatch.undo()
    rows.step_both(batch_caches(rows.ours), [0, 1, 2])  # the rows go on as before
    rows.release()
    store.pool.check_invariants()


def test_a_trim_that_fails_in_the_undo_does_not_stop_the_other_rows_undo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The undo trims the newest row first; a trim that fails there (the step's own error
    # is what the caller re-raises) must not leave the earlier rows appended.
    store = _store()
    rows = Rows(_model(), store, (4, 9, 13))  # row 0 takes a block at the next step
    [layer, _] = batch_caches(rows.ours)
    before = _pool_and_rows(store.pool, rows.ours)
    failure = RuntimeError("the store's write failed")

    def fail_write(*arguments: object, **keywords: object) -> NoReturn:
        raise failure

    def fail_trim(*arguments: object, **keywords: object) -> NoReturn:
        raise RuntimeError("the newest row's trim failed")

    monkeypatch.setattr(store, "_decode_rows_through_tables", fail_write)
    monkeypatch.setattr(rows.ours[2].book, "trim", fail_trim)
    token = mx.zeros((3, N_KV_HEADS, 1, HEAD_DIM))
    with pytest.raises(RuntimeError) as raised:
        layer.update_and_fetch(token, token)
    assert raised.value is failure
    assert _pool_and_rows(store.pool, rows.ours)[:2] == before[:2]
    assert rows.ours[2][0].offset == 14  # its own trim failed: it alone keeps the position
    monkeypatch.undo()
    rows.release()
    store.pool.check_invariants()
