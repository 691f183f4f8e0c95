"""KV-cache memory management: the block pool allocator, its errors, and backing stores.

Importing this package never imports MLX: the allocator and the storage
protocol are pure Python, so a port to another backend can use them and the
spec alone. The array-backed classes (``MLXBlockStorage``,
``NumpyBlockStorage``, the KV caches) load on first access.

The pool's typing protocol is published here: :class:`BlockPool` (the
reference and contract calls, generic in the handle type; its stats, typed
:class:`StatsLike`, must also have the project's ``n_shares``,
``n_copy_on_write`` and ``shared_blocks()``) and
:class:`CheckedBlockPool` (with the project's additions that stores need),
with :class:`BlockLike`, :class:`StatsLike` and :class:`ConfigLike`. They
are declared beside the operation table in ``veloxquant_mlx_spec.operations``
and load on first access. A port types against them
(``pool: BlockPool[MyBlock] = MyPool(...)``) and ``mypy --strict`` checks it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolError,
    BlockPoolExhaustedError,
    InvalidFreeError,
    InvariantViolationError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.storage import BlockStorage

if TYPE_CHECKING:
    from veloxquant_mlx.memory.deferred_release import reclaim_dropped_caches
    from veloxquant_mlx.memory.kv_cache import PoolBackedKVCache, make_pool_backed_cache
    from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
    from veloxquant_mlx.memory.model_kv_layout import make_pool_backed_storage
    from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage
    from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
    from veloxquant_mlx_spec.operations import (
        BlockLike,
        BlockPool,
        CheckedBlockPool,
        ConfigLike,
        StatsLike,
    )

# Name -> module defining it, imported on first access (MLX or NumPy, or the spec's table).
_LAZY_NAMES = {
    "BlockLike": "veloxquant_mlx_spec.operations",
    "BlockPool": "veloxquant_mlx_spec.operations",
    "CheckedBlockPool": "veloxquant_mlx_spec.operations",
    "ConfigLike": "veloxquant_mlx_spec.operations",
    "StatsLike": "veloxquant_mlx_spec.operations",
    "MLXBlockStorage": "veloxquant_mlx.memory.mlx_storage",
    "NumpyBlockStorage": "veloxquant_mlx.memory.numpy_storage",
    "PoolBackedKVCache": "veloxquant_mlx.memory.kv_cache",
    "PooledKVCache": "veloxquant_mlx.memory.pooled_kv_cache",
    "make_pool_backed_cache": "veloxquant_mlx.memory.kv_cache",
    "make_pool_backed_storage": "veloxquant_mlx.memory.model_kv_layout",
    "reclaim_dropped_caches": "veloxquant_mlx.memory.deferred_release",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


__all__ = [
    "AllocationStats",
    "Block",
    "BlockLike",
    "BlockPool",
    "BlockPoolAllocator",
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "BlockStorage",
    "CheckedBlockPool",
    "ConfigLike",
    "InvalidFreeError",
    "InvariantViolationError",
    "MLXBlockStorage",
    "NumpyBlockStorage",
    "OwnerAlreadyActiveError",
    "PoolBackedKVCache",
    "PoolConfig",
    "PooledKVCache",
    "StatsLike",
    "make_pool_backed_cache",
    "make_pool_backed_storage",
    "reclaim_dropped_caches",
]
