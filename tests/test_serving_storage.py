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
from veloxquant_mlx.memory.model_kv_layout import kv_layout, make_serving_storage

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


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (1, ValueError, "at least one key and one value block"),
        (-1, ValueError, "memory_bytes"),
        (2.5, TypeError, "memory_bytes"),
    ],
)
def test_a_budget_too_small_or_not_an_int_is_refused(
    budget: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make_serving_storage(_model(), budget)  # type: ignore[arg-type]
