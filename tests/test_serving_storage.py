"""The serving default: a fixed pool sized from a memory budget, resident exactly once.

A growing store follows its pool geometrically and may hold up to twice the
blocks in use (226 MB resident for 121 MB in use, in the 32-request
benchmark). ``make_serving_storage`` allocates the whole pool up front from
a budget instead: resident bytes are the pool, never more than the budget,
and never grow; a full pool refuses with ``BlockPoolExhaustedError``.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_models import tiny_model

from veloxquant_mlx.memory.block_pool import BlockPoolExhaustedError
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.model_kv_layout import (
    kv_layout,
    make_pool_backed_storage,
    make_serving_storage,
)

N_LAYERS = 2
HEADS = 2
HEAD_DIM = 16


def _model() -> object:
    return tiny_model("llama", 0, n_layers=N_LAYERS, n_kv_heads=HEADS, head_dim=HEAD_DIM)


@pytest.mark.parametrize("blocks_in_budget", [2, 7, 64])
def test_resident_bytes_are_the_pool_and_fit_the_budget(blocks_in_budget: int) -> None:
    model = _model()
    block_bytes = kv_layout(model).block_bytes(8)
    budget = blocks_in_budget * block_bytes + block_bytes // 2
    store = make_serving_storage(model, budget, block_size=8)
    n_blocks = store.pool.stats.n_blocks
    assert n_blocks == blocks_in_budget // 2 * 2
    assert store.resident_bytes() == n_blocks * block_bytes <= budget


def test_the_store_never_grows_and_a_full_pool_refuses() -> None:
    model = _model()
    store = make_serving_storage(model, 8 * kv_layout(model).block_bytes(4), block_size=4)
    resident = store.resident_bytes()
    cache = make_pool_backed_cache(model, store, attention="gather")
    chunk = mx.ones((1, HEADS, 4, HEAD_DIM))
    for _ in range(4):  # four key and four value blocks: the whole pool
        for layer in cache:
            layer.update_and_fetch(chunk, chunk)
    assert store.resident_bytes() == resident
    with pytest.raises(BlockPoolExhaustedError):
        cache[0].update_and_fetch(chunk[:, :, :1], chunk[:, :, :1])
    assert cache[0].offset == 16 and store.resident_bytes() == resident
    cache.release()


#: Bytes of one block of 16 slots of the model's two layers (two float32 heads of 16).
BLOCK_BYTES = N_LAYERS * 16 * HEADS * HEAD_DIM * 4
TOO_SMALL = (
    f"blocks of {BLOCK_BYTES} bytes (block_size=16, 2 layers, 2 KV heads of 16 float32); "
    "expected room for at least one key and one value block"
)


@pytest.mark.parametrize(
    ("budget", "error", "message"),
    [
        (1, ValueError, f"memory_bytes=1 holds 0 {TOO_SMALL}"),
        (
            3 * BLOCK_BYTES // 2,
            ValueError,
            f"memory_bytes={3 * BLOCK_BYTES // 2} holds 1 {TOO_SMALL}",
        ),
        (-1, ValueError, "memory_bytes must be an int >= 0, got -1"),
        (2.5, TypeError, "memory_bytes must be an int >= 0, got 2.5 (float)"),
    ],
    ids=["no block", "one block", "negative", "float"],
)
def test_a_budget_too_small_or_not_an_int_is_refused(
    budget: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as refused:
        make_serving_storage(_model(), budget)  # type: ignore[arg-type]
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("block_size", "error", "message"),
    [
        (0, ValueError, "block_size must be an int >= 1, got 0"),
        ("4", TypeError, "block_size must be an int >= 1, got '4' (str)"),
    ],
)
def test_a_block_size_that_is_no_int_above_zero_is_refused(
    block_size: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as refused:
        make_serving_storage(_model(), 64 * BLOCK_BYTES, block_size=block_size)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_the_serving_default_is_blocks_of_16_slots_and_lazy_writes() -> None:
    store = make_serving_storage(_model(), 4 * BLOCK_BYTES)
    assert (store.pool.config.block_size, store.pool.stats.n_blocks, store.lazy_writes) == (
        16,
        4,
        True,
    )


@pytest.mark.parametrize("lazy_writes", [True, False])
def test_both_stores_made_for_a_model_take_lazy_writes_as_asked(lazy_writes: bool) -> None:
    model = _model()
    serving = make_serving_storage(model, 4 * BLOCK_BYTES, lazy_writes=lazy_writes)
    pooled = make_pool_backed_storage(model, serving.pool, lazy_writes=lazy_writes)
    assert (serving.lazy_writes, pooled.lazy_writes) == (lazy_writes, lazy_writes)
