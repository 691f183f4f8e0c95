"""Pools whose free stacks hand out ids in descending order: every read a gather.

An ``MLXBlockStorage`` reads a request whose key ids run on consecutively
(and whose value ids do) as two slices of its slabs, and any other request
by a gather (:attr:`~veloxquant_mlx.memory.block_table.DeviceBlockTable.run_starts`).
A fresh pool hands a request alone consecutive ids, so tests and benchmarks
that mean to exercise or measure the gather start from a pool reordered by
:func:`hand_out_descending`.

Complexity: O(blocks of the pool). Thread safety: call it before the pool
is shared (it checks out and frees every free block, as one owner).
"""

from __future__ import annotations

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator

__all__ = ["hand_out_descending"]


def hand_out_descending(pool: BlockPoolAllocator, owner: int = 0) -> BlockPoolAllocator:
    """Reorder ``pool``'s free stacks to hand out ids in descending order; return it.

    Every free block of each stream is checked out to ``owner`` and freed in
    ascending order, so the highest comes off first (docs/CONTRACT.md C-LIFO).
    The counters record those checkouts and frees; ``owner`` ends up holding what
    it held before.
    """
    block_size = pool.config.block_size
    for stream in ("k", "v") if pool.config.separate_kv else ("kv",):
        free = pool.n_free(stream)
        if free:
            pool.free(pool.allocate(stream, free * block_size, owner=owner))
    return pool
