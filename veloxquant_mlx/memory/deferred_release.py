"""Deferred release: the blocks of a KV cache dropped without ``release()`` go back to the pool.

mlx-lm code never calls ``release()``: a request's cache list is simply
dropped when generation ends. A dropped :class:`PooledKVCache` (the block
table every pool-backed cache list shares) must then give its blocks back
by itself, from its finaliser. A finaliser runs on whatever thread happens
to drop the last reference or trigger the garbage collector, at any bytecode
of that thread, including one inside the pool's critical section (the pool
creates ``Block`` objects under its lock, and any allocation may start a
collection). The pool's lock is a plain, non-reentrant ``threading.Lock``,
so a finaliser that called ``pool.free_all()`` could deadlock its own
thread. It must not take any lock at all.

So the finaliser only *queues* the dropped book's owner id, with
``queue.SimpleQueue.put``, which CPython documents as reentrant (safe in
``__del__`` and weakref callbacks, even if it interrupts another ``put`` or
``get`` on the same thread). Ordinary code *drains* the queue later, with
``pool.free_all(owner)`` for each queued owner. The queue lives here, in the
memory layer above the pool, one per pool, shared by every book and store
on that pool; the pool's own API is unchanged.

When the blocks of a dropped cache come back (the first of these, on any
thread):

- any method of a backing store on that pool (``MLXBlockStorage``,
  ``NumpyBlockStorage``: each one syncs with the pool first, and the sync
  drains), which includes every ``update_and_fetch`` of a pool-backed cache;
- the construction of a :class:`PooledKVCache` on that pool, and so
  ``make_pool_backed_cache`` (before it claims its owner id, so the id of a
  dropped request can be reused at once);
- a ``PooledKVCache.append`` that checks out new blocks (before it does, so
  that a dropped cache's blocks serve it rather than exhaust the pool);
- :func:`reclaim_dropped_caches`, the explicit drain.

Until then the blocks count as in use and the owner id stays claimed, so no
other book can take the id meanwhile. Calling pool methods alone never
drains: the pool knows nothing of this layer.

Complexity: ``defer`` O(1); ``drain`` O(1) when nothing is queued, else the
cost of ``free_all`` for each queued owner; ``deferred_releases_for`` O(1)
(amortised, a weak dictionary look-up under a module lock).

Thread safety: ``defer`` takes no lock and may run inside any other call,
including a pool call on the same thread. ``drain`` may run on several
threads at once: each queued owner is taken off the queue by exactly one of
them. ``deferred_releases_for`` is never called from a finaliser.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Final

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator

__all__ = ["DeferredReleases", "deferred_releases_for", "reclaim_dropped_caches"]


class DeferredReleases:
    """The owners of one pool whose books were dropped while holding blocks.

    Invariant: every owner id on the queue was claimed by exactly one book,
    that book is unreachable, and the id is still active in the pool (its
    blocks or its registration), so no other book can have claimed it; it
    leaves the queue exactly once, through :meth:`drain`, which frees it.
    """

    def __init__(self, pool: BlockPoolAllocator) -> None:
        # Weak: the registry maps the pool to this object, which must not keep it alive.
        self._pool: Final = weakref.ref(pool)
        # Owner ids queued by finalisers; SimpleQueue because its put() is reentrant.
        self._owners: Final[queue.SimpleQueue[int]] = queue.SimpleQueue()

    def defer(self, owner: int) -> None:
        """Queue ``owner`` for release. Safe in a finaliser: takes no lock, never raises."""
        self._owners.put(owner)

    def pending(self) -> bool:
        """Whether some dropped owner waits for a drain (a snapshot; O(1))."""
        return not self._owners.empty()

    def drain(self) -> int:
        """Free every queued owner's blocks and registration. Never call it from a finaliser.

        Returns:
            How many owners this call released.
        """
        if self._owners.empty():  # the hot path: one O(1) check per store call
            return 0
        pool = self._pool()
        released = 0
        while True:
            try:
                owner = self._owners.get_nowait()
            except queue.Empty:
                return released
            if pool is not None:
                pool.free_all(owner)
                released += 1


#: One queue per live pool; the pool's death removes its entry.
_QUEUES: Final[weakref.WeakKeyDictionary[BlockPoolAllocator, DeferredReleases]] = (
    weakref.WeakKeyDictionary()
)
_QUEUES_LOCK: Final = threading.Lock()


def deferred_releases_for(pool: BlockPoolAllocator) -> DeferredReleases:
    """The queue of dropped owners of ``pool``, shared by every book and store on it.

    Called when a book or a store is built, never from a finaliser (it takes a lock).
    """
    with _QUEUES_LOCK:
        releases = _QUEUES.get(pool)
        if releases is None:
            releases = _QUEUES[pool] = DeferredReleases(pool)
        return releases


def reclaim_dropped_caches(pool: BlockPoolAllocator) -> int:
    """Return to ``pool`` the blocks of every cache dropped without ``release()`` so far.

    Stores and books on the pool do this on their own next call (module
    docstring); call it where none is due, e.g. before reading ``pool.stats``.

    Returns:
        How many dropped caches (owners) were released by this call.

    Raises:
        TypeError: ``pool`` is not a ``BlockPoolAllocator``.
    """
    if not isinstance(pool, BlockPoolAllocator):
        raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
    return deferred_releases_for(pool).drain()
