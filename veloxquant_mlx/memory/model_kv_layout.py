"""What an mlx-lm model writes into its KV cache, and a backing store sized to match.

A pool-backed cache is a drop-in for mlx-lm's ``KVCache`` only if its store
holds exactly what the model writes: as many layers, the same number of KV
heads and head dimension, and the same dtype (``KVCache`` keeps whatever
dtype the model produces; a store of another dtype would have to cast, which
changes the model's outputs, so stores refuse it). Rather than trust a
config field per architecture, :func:`kv_layout` asks the model itself: it
runs the forward pass of one token against recording caches and reads the
shape and dtype of the keys and values each layer hands over. MLX is lazy
and nothing is evaluated, so no weight is read and no compute runs; the cost
is building that graph once (Python work, O(layers)).

``make_pool_backed_storage(model, pool)`` builds the ``MLXBlockStorage``
that :func:`~veloxquant_mlx.memory.kv_cache.make_pool_backed_cache` then
serves every request of that model from.

``make_serving_storage(model, memory_bytes)`` is the serving default: a
fixed pool sized from a memory budget, and its store. The store's slabs
cover the pool's ids from the start and never grow, so the memory a server
holds for KV is exactly the pool (at most the budget), known before the
first request; a full pool refuses an append with ``BlockPoolExhaustedError``,
the signal for admission control. (A pool that grows on exhaustion has its
store follow it geometrically, up to twice the ids in use: the price of
amortised O(1) growth.)

Complexity: ``attention_layers`` O(layers); ``kv_layout`` one graph build
of a one-token forward pass, O(layers); ``make_pool_backed_storage`` and
``make_serving_storage`` that plus the store's allocation; ``KVLayout``'s
``block_bytes`` O(1). Thread safety: pure functions of the model,
which they do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from veloxquant_mlx.memory._arguments import require_int
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage, dtype_name

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = [
    "KVLayout",
    "attention_layers",
    "kv_layout",
    "make_pool_backed_storage",
    "make_serving_storage",
]


@dataclass(frozen=True)
class KVLayout:
    """What every layer of a model writes per token: ``n_kv_heads`` slots of ``head_dim``.

    Invariant: the same for keys and values and for every one of ``n_layers``.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    def block_bytes(self, block_size: int) -> int:
        """Bytes one block id takes in a store: ``block_size`` slots of every layer."""
        return self.n_layers * block_size * self.n_kv_heads * self.head_dim * self.dtype.size


def attention_layers(model: object) -> int:
    """Layers of ``model``, after checking that each would use a plain ``KVCache``.

    Like mlx-lm's ``make_prompt_cache``: a model with ``make_cache()`` is
    accepted when every cache it makes is a plain ``KVCache`` (full attention);
    otherwise the count of ``model.layers``.

    Raises:
        TypeError: ``model`` has neither ``make_cache()`` nor a list of layers.
        ValueError: A layer needs another cache (sliding window, state space, ...).
    """
    make_cache = getattr(model, "make_cache", None)
    if make_cache is None:
        layers = getattr(model, "layers", None)
        if not isinstance(layers, Sized):
            raise TypeError(
                f"model must be an mlx-lm model with a list of layers, got {type(model).__name__}"
            )
        return len(layers)
    # mlx-lm is only needed here, for a model that comes from it (it has make_cache()).
    from mlx_lm.models.cache import KVCache  # noqa: PLC0415

    upstream: list[object] = make_cache()
    for index, cache in enumerate(upstream):
        if type(cache) is not KVCache:
            raise ValueError(
                f"layer {index} of the model uses {type(cache).__name__}; "
                "PoolBackedKVCache replaces plain KVCache layers only"
            )
    return len(upstream)


def kv_layout(model: object) -> KVLayout:
    """The heads, head dimension and dtype ``model`` writes, read from a lazy forward pass.

    Raises:
        TypeError, ValueError: As :func:`attention_layers`; or the model is not
            callable as ``model(tokens, cache=...)``.
        ValueError: Layers write different shapes or dtypes, keys and values differ,
            or some layer never writes its cache (a store has one slot shape).
    """
    n_layers = attention_layers(model)
    if not callable(model):
        raise TypeError(f"model must be callable as model(tokens, cache=...), got {model!r}")
    recorders = [_recorder_type()() for _ in range(n_layers)]
    model(mx.array([[0]]), cache=recorders)  # a graph only: never evaluated
    seen = {(shape, dtype_name(dtype)) for recorder in recorders for shape, dtype in recorder.seen}
    if any(not recorder.seen for recorder in recorders) or len(seen) != 1:
        raise ValueError(
            "expected every layer to write keys and values of one shape and dtype; the model "
            f"wrote {sorted(seen)} (shape as (batch, heads, tokens, head_dim), dtype)"
            + (" and some layers wrote nothing" if any(not r.seen for r in recorders) else "")
        )
    (_, n_kv_heads, _, head_dim), _ = seen.pop()
    return KVLayout(n_layers, n_kv_heads, head_dim, recorders[0].seen[0][1])


def make_pool_backed_storage(
    model: object, pool: CheckedBlockPool[Block], *, lazy_writes: bool = False
) -> MLXBlockStorage:
    """An ``MLXBlockStorage`` over ``pool`` holding exactly what ``model`` writes.

    Layers, KV heads, head dimension and dtype come from :func:`kv_layout`, so
    caches over this store decode exactly as mlx-lm's ``KVCache`` does.

    Args:
        model: An mlx-lm model whose layers all use a plain ``KVCache``.
        pool: The pool lending the blocks.
        lazy_writes: As for ``MLXBlockStorage`` (the store then serves one thread).

    Raises:
        TypeError, ValueError: As :func:`kv_layout`, or as ``MLXBlockStorage``
            for the pool.
    """
    layout = kv_layout(model)
    return MLXBlockStorage(
        pool,
        layout.n_layers,
        layout.n_kv_heads,
        layout.head_dim,
        layout.dtype,
        lazy_writes=lazy_writes,
    )


def make_serving_storage(
    model: object,
    memory_bytes: int,
    *,
    block_size: int = 16,
    lazy_writes: bool = True,
) -> MLXBlockStorage:
    """A fixed pool that fits ``memory_bytes`` and its store, sized for ``model``.

    The serving default: resident memory is the pool, allocated here and never
    grown, ``floor(memory_bytes / block bytes)`` blocks (even, split evenly between
    the key and value streams). ``storage.pool`` is the pool. Writes are lazy by
    default, for one decode thread (mlx-lm's generators, a server's decode loop):
    no evaluation per write; a call from a second thread is refused by name.

    Args:
        model: An mlx-lm model whose layers all use a plain ``KVCache``.
        memory_bytes: The KV budget; the store holds at most this many bytes.
        block_size: Token slots per block.
        lazy_writes: As for ``MLXBlockStorage``; ``False`` lets any thread decode
            through the store, at the price of evaluating every write.

    Raises:
        TypeError: ``memory_bytes`` or ``block_size`` is not an int.
        ValueError: ``block_size < 1``, or the budget holds fewer than one key and one
            value block; or as :func:`kv_layout`.
    """
    require_int("memory_bytes", memory_bytes, minimum=0)
    require_int("block_size", block_size, minimum=1)
    layout = kv_layout(model)
    per_block = layout.block_bytes(block_size)
    n_blocks = memory_bytes // per_block // 2 * 2
    if n_blocks < 2:
        raise ValueError(
            f"memory_bytes={memory_bytes} holds {memory_bytes // per_block} blocks of "
            f"{per_block} bytes (block_size={block_size}, {layout.n_layers} layers, "
            f"{layout.n_kv_heads} KV heads of {layout.head_dim} {dtype_name(layout.dtype)}); "
            "expected room for at least one key and one value block"
        )
    pool = BlockPoolAllocator(PoolConfig(block_size=block_size, n_blocks=n_blocks))
    return MLXBlockStorage(
        pool,
        layout.n_layers,
        layout.n_kv_heads,
        layout.head_dim,
        layout.dtype,
        lazy_writes=lazy_writes,
    )


class _Recorder(Protocol):
    """A cache that remembers the shape and dtype of every array it was handed."""

    seen: list[tuple[tuple[int, ...], mx.Dtype]]


@functools.cache
def _recorder_type() -> Callable[[], _Recorder]:
    """mlx-lm's ``KVCache``, recording each update (a class built once, when mlx-lm loads)."""
    from mlx_lm.models.cache import KVCache  # noqa: PLC0415

    class RecordingKVCache(KVCache):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.seen: list[tuple[tuple[int, ...], mx.Dtype]] = []

        def update_and_fetch(self, keys: mx.array, values: mx.array) -> object:
            self.seen.append((tuple(keys.shape), keys.dtype))
            self.seen.append((tuple(values.shape), values.dtype))
            return super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]

    return RecordingKVCache
