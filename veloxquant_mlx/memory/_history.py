"""The block pool's history: its stats after each of its last N counted calls.

``BlockPoolAllocator`` records one entry per counted call, under its lock, and
``BlockPoolAllocator.history`` reads them back as new ``AllocationStats``,
oldest first. Recording is the part every ``allocate`` and ``free_all`` pays,
so its form depends on the build (``block_pool.COMPILED``):

- interpreted, the caller appends a tuple of the counters to :attr:`StatsHistory.entries`
  itself (a tuple is the cheapest entry to build in Python, and a call into
  this class would cost as much again); until the pool first shares, the
  tuple leaves out sharing's three counters, all 0 then, so that a pool that
  never shares records no more than before sharing existed
  (``AllocationStats._counters``);
- compiled by mypyc, the caller calls :meth:`StatsHistory.record`, which
  overwrites the oldest of a ring of ``AllocationStats`` in place: one
  store per counter, where a tuple would box every int and evict another.

Complexity: ``record`` O(1); ``copy`` O(capacity). Thread safety: none of
its own; the allocator holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from veloxquant_mlx.memory.block_pool import AllocationStats


class StatsHistory:
    """The last ``capacity`` stats entries, in one of two forms (see the module).

    Invariants: at most ``capacity`` entries are held; ``entries`` is used only
    interpreted and ``_ring`` only compiled, so one of them is always empty;
    once the ring is full, ``_oldest`` is the index of its oldest entry.
    """

    def __init__(self, capacity: int) -> None:
        # Interpreted: counter tuples (AllocationStats._counters()), appended by the caller.
        self.entries: Final[deque[tuple[int, ...]]] = deque(maxlen=capacity)
        # Compiled: AllocationStats objects, overwritten in place once there are capacity.
        self._ring: Final[list[AllocationStats]] = []
        self._capacity: Final = capacity
        self._oldest = 0  # the next to be overwritten, once the ring is full

    def record(self, stats: AllocationStats) -> None:
        """Add a copy of ``stats`` as the newest entry, dropping the oldest if full."""
        ring = self._ring
        if len(ring) < self._capacity:  # filling up (a capacity of 0 is never recorded to)
            ring.append(stats.snapshot())
            return
        ring[self._oldest]._copy_from(stats)
        self._oldest += 1
        if self._oldest == self._capacity:
            self._oldest = 0

    @property
    def capacity(self) -> int:
        """How many entries are kept."""
        return self._capacity

    def copy(self) -> list[tuple[int, ...] | AllocationStats]:
        """Every entry, oldest first, safe to read after the lock is released.

        Counter tuples are returned as they are (immutable); ring entries as
        snapshots, since the ring is overwritten in place. Call under the lock.
        """
        if self.entries:
            return list(self.entries)
        ring = self._ring
        return [entry.snapshot() for entry in ring[self._oldest :] + ring[: self._oldest]]
