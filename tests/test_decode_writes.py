"""Decode writes: none waits for the device with lazy_writes; without, each is published.

A ``lazy_writes`` store builds no evaluation into a decode step and belongs to
its first thread. A store without ``lazy_writes`` serves any thread, so each
write evaluates and publishes its slab before it returns (a sync point per
layer per step): scheduling it with ``mx.async_eval``, as the store did for
a while, let two threads examine one slab at once inside MLX and crash
(:func:`veloxquant_mlx.memory.mlx_storage.publish`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import pytest
from threads import in_thread

from veloxquant_mlx.memory import block_table, mlx_storage, slot_rows
from veloxquant_mlx.memory.batch_cache import PooledBatchLayer, batch_caches
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import PoolBackedKVCache, PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

HEADS = 2
HEAD_DIM = 8
N_LAYERS = 2


def _cache(lazy_writes: bool) -> PoolBackedPromptCache:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))
    store = MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, lazy_writes=lazy_writes)
    return PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, HEAD_DIM), key=mx.random.key(seed))


@pytest.fixture
def eval_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts every ``mx.eval`` call made while the test runs (by anyone)."""
    calls: list[int] = []
    real_eval = mx.eval

    def counting_eval(*arrays: object) -> None:
        calls.append(1)
        real_eval(*arrays)

    monkeypatch.setattr(mx, "eval", counting_eval)
    yield calls


def _decode_nine_steps(cache: PoolBackedPromptCache) -> list[tuple[mx.array, mx.array]]:
    """Nine one-token steps (crossing block boundaries); what the last step read."""
    for step in range(9):
        keys = _tokens(1, step + 1)
        fetched = [layer.update_and_fetch(keys, keys) for layer in cache]
    return fetched


def _read_everything(fetched: list[tuple[mx.array, mx.array]], prompt: mx.array) -> bool:
    reference = mx.concatenate([prompt] + [_tokens(1, step + 1) for step in range(9)], axis=2)
    return all(mx.array_equal(keys, reference) for keys, _ in fetched)


def test_a_lazy_writes_decode_step_makes_no_sync_per_write(eval_calls: list[int]) -> None:
    cache = _cache(lazy_writes=True)
    prompt = _tokens(6, 0)
    for layer in cache:
        layer.update_and_fetch(prompt, prompt)
    eval_calls.clear()
    fetched = _decode_nine_steps(cache)
    assert eval_calls == []
    assert _read_everything(fetched, prompt)
    cache.release()


def test_without_lazy_writes_each_decode_write_publishes_its_slab_once_under_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))
    store = MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32)
    cache = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))
    prompt = _tokens(6, 0)
    for layer in cache:
        layer.update_and_fetch(prompt, prompt)
    published: list[int] = []
    real_publish = mlx_storage.publish

    def counting_publish(*arrays: mx.array) -> None:
        assert store._lock.locked()  # before another thread can take the slab
        published.append(len(arrays))
        real_publish(*arrays)

    monkeypatch.setattr(mlx_storage, "publish", counting_publish)
    fetched = _decode_nine_steps(cache)
    assert published == [1] * (9 * N_LAYERS)  # one slab per layer per step
    assert _read_everything(fetched, prompt)
    cache.release()


def test_publish_evaluates_the_arrays_then_evaluates_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second ``mx.eval`` waits on the computed arrays, which marks them available
    in MLX: without it, threads that read them later race to do that."""
    calls: list[tuple[object, ...]] = []
    real_eval = mx.eval

    def recording_eval(*arrays: object) -> None:
        calls.append(arrays)
        real_eval(*arrays)

    monkeypatch.setattr(mx, "eval", recording_eval)
    slab, other = mx.arange(4) * 2, mx.ones((2,))
    mlx_storage.publish(slab, other)
    assert len(calls) == 2
    assert all(arrays[0] is slab and arrays[1] is other for arrays in calls)


def test_without_lazy_writes_another_thread_decodes_on_the_same_store() -> None:
    cache = _cache(lazy_writes=False)
    first, second = _tokens(3, 0), _tokens(1, 1)
    mx.eval(first, second)
    for layer in cache:
        layer.update_and_fetch(first, first)  # written and published on this thread
    fetched: list[list[float]] = []

    def decode_one_token() -> None:
        for layer in cache:
            keys, _ = layer.update_and_fetch(second, second)
            fetched.append(keys.reshape(-1).tolist())  # type: ignore[arg-type]

    assert in_thread("second", decode_one_token) is None
    expected = mx.concatenate([first, second], axis=2).reshape(-1).tolist()
    assert fetched == [expected] * N_LAYERS
    cache.release()


def test_with_lazy_writes_another_thread_is_refused_by_name_and_nothing_changes() -> None:
    cache = _cache(lazy_writes=True)
    first = _tokens(3, 0)
    mx.eval(first)
    for layer in cache:
        layer.update_and_fetch(first, first)  # a pending graph of this thread
    blocks_before = cache.book.key_blocks
    second = _tokens(1, 1)
    mx.eval(second)
    error = in_thread("second", lambda: cache[0].update_and_fetch(second, second))
    assert isinstance(error, RuntimeError)
    assert "lazy_writes" in str(error) and "'second'" in str(error)
    assert cache[0].offset == 3 and cache.book.key_blocks == blocks_before
    keys, _ = cache[0].update_and_fetch(second, second)  # still usable from its own thread
    assert mx.array_equal(keys, mx.concatenate([first, second], axis=2))
    cache.release()


class _Evaluations:
    """What a store evaluates while a test runs: the arrays of each ``mx.eval`` made
    outside its lock, and the layers of the slabs each ``publish`` covers (which must
    run under the lock, before another thread can take them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: MLXBlockStorage) -> None:
        self.outside_the_lock: list[tuple[mx.array, ...]] = []
        self.published: list[list[int]] = []
        real_eval, real_publish = mx.eval, mlx_storage.publish

        def recording_eval(*arrays: mx.array) -> None:
            if not store._lock.locked():
                self.outside_the_lock.append(arrays)
            real_eval(*arrays)

        def recording_publish(*arrays: mx.array) -> None:
            assert store._lock.locked()
            slabs = store._slabs
            self.published.append(
                [n for n, slab in enumerate(slabs) if any(slab is a for a in arrays)]
            )
            real_publish(*arrays)

        monkeypatch.setattr(mx, "eval", recording_eval)
        monkeypatch.setattr(mlx_storage, "publish", recording_publish)


@pytest.mark.parametrize("lazy_writes", [False, True], ids=["eager", "lazy_writes"])
def test_a_store_write_and_a_block_copy_publish_under_the_lock_unless_lazy(
    monkeypatch: pytest.MonkeyPatch, lazy_writes: bool
) -> None:
    # The writes and copies of prefill and copy-on-write, outside the decode path.
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=4, separate_kv=False))
    store = MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, lazy_writes=lazy_writes)
    [source, copy] = pool.allocate("kv", 8, owner=1)
    tokens = mx.random.normal((4, HEADS, HEAD_DIM), key=mx.random.key(0))
    evaluations = _Evaluations(monkeypatch, store)
    store.write(1, source, 0, tokens)
    store.copy_block(None, source.block_id, copy)
    monkeypatch.undo()
    if lazy_writes:
        assert (evaluations.outside_the_lock, evaluations.published) == ([], [])
    else:  # the tokens before the lock; then the slab written, and every slab copied into
        [(evaluated,)] = evaluations.outside_the_lock
        assert evaluated is tokens
        assert evaluations.published == [[1], list(range(N_LAYERS))]
    assert mx.array_equal(store.gather(1, [copy], 4), tokens)


@pytest.mark.parametrize("lazy_writes", [False, True], ids=["eager", "lazy_writes"])
@pytest.mark.parametrize("n_rows", [1, 2], ids=["one request", "a batch of two"])
def test_a_decode_step_evaluates_its_input_outside_the_lock_unless_lazy(
    monkeypatch: pytest.MonkeyPatch, lazy_writes: bool, n_rows: int
) -> None:
    # The forward pass up to a layer is this thread's compute: evaluated under the lock,
    # it would hold every other thread of the store back for it.
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=64))
    store = MLXBlockStorage(pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, lazy_writes=lazy_writes)
    requests = [PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))]
    requests += [PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=N_LAYERS))]
    for request in requests:
        for layer in request:
            mx.eval(layer.update_and_fetch(_tokens(3, 0), _tokens(3, 0)))
    step: Sequence[PoolBackedKVCache | PooledBatchLayer]
    step = requests[0] if n_rows == 1 else batch_caches(requests)
    keys = mx.random.normal((n_rows, HEADS, 1, HEAD_DIM), key=mx.random.key(1))
    values = keys + 1
    evaluations = _Evaluations(monkeypatch, store)
    for step_layer in step:
        step_layer.update_and_fetch(keys, values)
    monkeypatch.undo()
    if lazy_writes:
        assert (evaluations.outside_the_lock, evaluations.published) == ([], [])
        return
    # Once per layer, outside the lock: the rows' keys, then their values; then, under
    # it, that layer's slab.
    assert evaluations.published == [[layer] for layer in range(N_LAYERS)]
    assert len(evaluations.outside_the_lock) == N_LAYERS
    expected = [keys[row : row + 1] for row in range(n_rows)]
    expected += [values[row : row + 1] for row in range(n_rows)]
    for arrays in evaluations.outside_the_lock:
        assert len(arrays) == len(expected)
        assert all(mx.array_equal(a, b) for a, b in zip(arrays, expected, strict=True))


@pytest.mark.parametrize("lazy_writes", [False, True], ids=["eager", "lazy_writes"])
def test_slot_rows_are_scheduled_for_other_threads_unless_the_store_is_lazy(
    monkeypatch: pytest.MonkeyPatch, lazy_writes: bool
) -> None:
    # A store without lazy_writes serves any thread: the rows one thread builds are
    # scheduled, so another can build on them. A lazy store schedules nothing.
    scheduled: list[object] = []

    def recording_schedule(*arrays: mx.array) -> None:
        scheduled.extend(arrays)
        block_table.schedule(*arrays)  # what slot_rows imports

    monkeypatch.setattr(slot_rows, "schedule", recording_schedule)
    cache = _cache(lazy_writes)
    for layer in cache:
        mx.eval(layer.update_and_fetch(_tokens(3, 0), _tokens(3, 0)))
    assert (scheduled != []) == (not lazy_writes)
    # What is scheduled is the rows' block entries: (keys and values, heads, blocks).
    assert all(
        isinstance(rows, mx.array) and rows.dtype == mx.int32 and rows.shape[:2] == (2, HEADS)
        for rows in scheduled
    )
    cache.release()
