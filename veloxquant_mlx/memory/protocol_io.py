"""A layer's positions written and gathered through the plain storage protocol, block by block.

Users: :class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` over a
store that has only the :class:`~veloxquant_mlx.memory.storage.BlockStorage`
protocol (no block-table decode path, e.g. a port that implements just the
protocol). Every call hands the store ``Block`` handles, which it checks
against the pool: O(blocks) liveness checks per gather, where the block-table
path of ``MLXBlockStorage`` needs O(1).

Complexity (``T`` = positions of the layer, ``n`` = new ones, ``k`` = blocks):
:func:`write_positions` O(n) host work, one store write per block touched;
:func:`gather_positions` O(k) host work (the store's liveness check) and
O(T) device work. Thread safety: as the store's; the book belongs to one
request, used from one thread at a time.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.cache_storage import GathersHeadMajor, MLXStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

__all__ = ["gather_positions", "write_positions"]


def write_positions(
    storage: MLXStorage,
    book: PooledKVCache,
    layer: int,
    start: int,
    *,
    keys: mx.array,
    values: mx.array,
) -> None:
    """Write ``keys`` and ``values`` (``(1, heads, n, head_dim)``) at positions ``start ..``
    of ``layer``, into the book's blocks (already appended), block by block."""
    block_size = book.block_size
    key_blocks, value_blocks = book.key_blocks, book.value_blocks
    # (n, heads, head_dim): the storage's slot layout.
    key_tokens = keys[0].transpose(1, 0, 2)
    value_tokens = values[0].transpose(1, 0, 2)
    n_tokens = key_tokens.shape[0]
    done = 0
    while done < n_tokens:
        index, slot = divmod(start + done, block_size)
        upto = min(done + block_size - slot, n_tokens)
        storage.write(layer, key_blocks[index], slot, key_tokens[done:upto])
        storage.write(layer, value_blocks[index], slot, value_tokens[done:upto])
        done = upto


def gather_positions(
    storage: MLXStorage, book: PooledKVCache, layer: int, n_tokens: int
) -> tuple[mx.array, mx.array]:
    """Keys and values of positions ``0 .. n_tokens - 1`` of ``layer``, each ``(1, heads,
    n_tokens, head_dim)``, in the storage's dtype."""
    heads, head_dim = storage.slot_shape
    if n_tokens == 0:
        empty = mx.zeros((1, heads, 0, head_dim), dtype=storage.dtype)
        return empty, empty
    n_blocks = -(-n_tokens // book.block_size)
    return (
        _gather(storage, book.key_blocks[:n_blocks], layer, n_tokens),
        _gather(storage, book.value_blocks[:n_blocks], layer, n_tokens),
    )


def _gather(storage: MLXStorage, blocks: tuple[Block, ...], layer: int, n: int) -> mx.array:
    if isinstance(storage, GathersHeadMajor):
        return storage.gather_heads(layer, blocks, n)[None]
    tokens = storage.gather(layer, blocks, n)
    # Attention reads (heads, tokens, head_dim); a strided view would make it slower.
    return mx.contiguous(tokens.transpose(1, 0, 2))[None]
