"""What a command's input makes it allocate, estimated before anything is allocated.

The commands refuse input whose estimate exceeds the memory available
(:func:`~veloxquant_mlx.commandline.bad_input.require_fits_in_memory`); the
figures behind the estimates live here, once:

- a pool's books: :data:`POOL_BYTES_PER_BLOCK` per block id (measured with
  ``tracemalloc`` on CPython 3.11: about 41 bytes per idle block, 130 more
  per checked-out one, rounded up);
- a store's slabs: per layer, a capacity of up to twice the ids in use (the
  growth rule of ``next_capacity``) times one block's token slots.

The estimates err high: they exist to refuse ``n_blocks=10**12`` in one
line instead of being killed for memory, not to budget a run to the byte.

Complexity: O(1). Thread safety: pure functions.
"""

from __future__ import annotations

from typing import Final

__all__ = ["POOL_BYTES_PER_BLOCK", "REQUEST_BYTES", "STEP_BYTES", "pool_bytes", "slab_bytes"]

#: Heap bytes of a pool's books per block id, every block checked out (rounded up).
POOL_BYTES_PER_BLOCK: Final = 200
#: Heap bytes of one simulated request (measured: about 195 with tracemalloc).
REQUEST_BYTES: Final = 256
#: Heap bytes the simulator's metrics keep per step (five samples, boxed numbers).
STEP_BYTES: Final = 200


def pool_bytes(n_ids: int) -> int:
    """Bytes of a pool's books for ``n_ids`` block ids."""
    return POOL_BYTES_PER_BLOCK * max(n_ids, 0)


def slab_bytes(
    *, n_layers: int, n_ids: int, block_size: int, slot_values: int, itemsize: int
) -> int:
    """Bytes of a store's slabs covering ``n_ids`` ids: up to twice that capacity, per layer.

    Args:
        n_layers: Slabs, one per layer.
        n_ids: The most ids the pool issues.
        block_size: Token slots per block.
        slot_values: Values per token slot (``n_kv_heads * head_dim``).
        itemsize: Bytes per value.
    """
    return n_layers * 2 * max(n_ids, 0) * block_size * slot_values * itemsize
