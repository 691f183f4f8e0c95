"""KV-cache memory management: the block pool allocator and its errors.

Importing this package never imports MLX: the allocator is pure Python, so a
port to another backend can use it and its spec alone.
"""

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

__all__ = [
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "InvalidFreeError",
    "InvariantViolationError",
    "OwnerAlreadyActiveError",
    "PoolConfig",
]
