"""Decode writes never wait for the device, and keep the lazy_writes thread rule.

A store without ``lazy_writes`` used to evaluate every write (``mx.eval``, a
sync point per layer per step: on a GPU about half the speed of lazy
writes). The decode path now schedules the write with ``mx.async_eval``
instead, which any thread may then build on; a ``lazy_writes`` store builds
no evaluation at all and still belongs to its first thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from threads import in_thread

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
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


@pytest.mark.parametrize("lazy_writes", [False, True], ids=["default", "lazy_writes"])
def test_a_decode_step_makes_no_sync_per_write(eval_calls: list[int], lazy_writes: bool) -> None:
    cache = _cache(lazy_writes)
    prompt = _tokens(6, 0)
    for layer in cache:
        layer.update_and_fetch(prompt, prompt)
    eval_calls.clear()
    for step in range(9):  # crosses block boundaries
        keys = _tokens(1, step + 1)
        fetched = [layer.update_and_fetch(keys, keys) for layer in cache]
    assert eval_calls == []
    reference = mx.concatenate([prompt] + [_tokens(1, step + 1) for step in range(9)], axis=2)
    assert all(mx.array_equal(keys, reference) for keys, _ in fetched)
    cache.release()


def test_without_lazy_writes_another_thread_decodes_on_the_same_store() -> None:
    cache = _cache(lazy_writes=False)
    first, second = _tokens(3, 0), _tokens(1, 1)
    mx.eval(first, second)
    for layer in cache:
        layer.update_and_fetch(first, first)  # scheduled on this thread, not waited for
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
