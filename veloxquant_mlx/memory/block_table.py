"""DeviceBlockTable: a request's block table as MLX index arrays, proven live in O(1).

A decode step reads every block of a request in every layer. The store
needs the block ids as an ``mx.array`` (to gather, or to hand to a
paged-attention kernel), or, where each stream's ids run on consecutively,
where the runs start (to read two slices: :attr:`DeviceBlockTable.run_starts`),
and the guarantee that each of those blocks is
still a live handle of the pool: a stale or foreign block must never be read
or written. Building that array and asking the pool about every handle in
every layer of every step is O(blocks) host work per layer, which on a GPU
decides the speed of a step. This table keeps both and re-checks only what
can have changed since it last checked:

- the request's own blocks change only through its
  :class:`~veloxquant_mlx.memory.pooled_kv_cache.PooledKVCache`, which bumps
  ``table_version`` when they do; after blocks were added, only the new
  handles are checked (``pool.all_live`` of those) and their ids appended;
- a handle stops being live only when ``free()`` or ``free_all()`` releases
  it or ``make_writable()`` moves it to a copy, and the pool counts every
  such call, in ``stats.n_frees`` (CONTRACT.md: every call that released at
  least one handle) and ``stats.n_copy_on_write`` (every call that moved a
  handle). When their sum moved, some handle somewhere went stale, perhaps
  one of this table's (a foreign ``free_all`` of the request's owner, or a
  ``make_writable`` of one of its shared blocks, say), so every handle is
  checked again, once.

Only the pool's public API is used; the pool needs no version counter.
Growth and shrink of a store's slabs do not concern the table: it holds
ids, and a live id is always inside its store's slabs.

Complexity (``k`` = blocks of the request): :meth:`require_live` O(1)
while neither the book nor the pool's count of such calls moved (two attribute reads
and one ``pool.stats`` snapshot, one pool lock); after the book added ``a``
blocks with no free anywhere, O(a) amortised, since the ids array grows by
concatenation (and whether the ids still run on is decided from the new
ones alone); after any free or move, O(k) once. :meth:`memo`, :meth:`memo_this_step` and
:meth:`remember` O(1); :meth:`check_invariants` O(k).

Thread safety: like the book, a table belongs to one request and is used
from one thread at a time; the pool it asks locks itself. A block freed by
another thread *while* a store reads it is the caller's race, as for the
store's own liveness check: the check runs at the start of each call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, TypeVar, cast

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import Block, InvariantViolationError
from veloxquant_mlx.memory.pooled_kv_cache import (
    PooledKVCache,
    StaleBlockTableError,
    stale_block_error,
)

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = ["DeviceBlockTable", "StaleBlockTableError", "run_start", "schedule"]

MemoT = TypeVar("MemoT")

#: ``mx.async_eval``, typed: start computing arrays without waiting for them. A
#: graph left lazy can only be evaluated by the thread that built it (MLX streams are
#: per thread); one scheduled so may be used by another thread, as long as two threads
#: never look at it at once: MLX 0.32 races there (mlx_storage.publish). A table's
#: arrays belong to one request, used by one thread at a time.
schedule: Final = cast(Callable[..., None], mx.async_eval)


class DeviceBlockTable:
    """The key and value block ids of one book as ``int32`` arrays, checked live.

    Invariants, whenever :meth:`require_live` has returned and until the book
    or the pool's count of frees and moves moves again:

    - ``key_blocks`` / ``value_blocks`` are the book's tuples, every handle in
      them a live handle of the book's pool;
    - ``key_ids[i] == key_blocks[i].block_id`` (likewise for values), one
      entry per block, in position order;
    - ``run_starts`` is ``(key_ids[0], value_ids[0])`` exactly when both id lists
      are runs ``[f, f + 1, ...]``, else ``None``;
    - the memo holds only a value computed from the current ids.

    :meth:`check_invariants` verifies the first three (the memo is the
    store's value, which the table cannot recompute).
    """

    def __init__(self, book: PooledKVCache) -> None:
        """An empty table that follows ``book``; the first check fills it."""
        if not isinstance(book, PooledKVCache):
            raise TypeError(f"book must be a PooledKVCache, got {type(book).__name__}")
        self._book: Final = book
        self._pool: Final = book.pool
        # The book's table_version and the pool's count of calls that made handles stale
        # (n_frees + n_copy_on_write) when last checked; -1: never.
        self._checked_version = -1
        self._checked_releases = -1
        # The book's extent_version at the last check: require_live_this_step's key.
        self._checked_extent = -1
        # The handles checked live, as the book held them then.
        self._keys: tuple[Block, ...] = ()
        self._values: tuple[Block, ...] = ()
        # Their ids on the device, (n_blocks,) int32 each.
        self._key_ids = _NO_IDS
        self._value_ids = _NO_IDS
        # The first key and value ids while each stream's ids are consecutive and
        # ascending (one run of rows in every slab); None otherwise, or for no blocks.
        self._key_run: int | None = None
        self._value_run: int | None = None
        # Handles passed to pool.all_live so far: what the O(1) claim is tested by.
        self._handles_checked = 0
        # One value derived from the ids by a store, and the store (compared by identity);
        # dropped when the ids change.
        self._memo_key: object = None
        self._memo_value: object = None

    @property
    def book(self) -> PooledKVCache:
        """The block table this follows."""
        return self._book

    @property
    def pool(self) -> CheckedBlockPool[Block]:
        """The pool every block comes from."""
        return self._pool

    @property
    def key_blocks(self) -> tuple[Block, ...]:
        """The key handles as of the last :meth:`require_live`."""
        return self._keys

    @property
    def value_blocks(self) -> tuple[Block, ...]:
        """The value handles as of the last :meth:`require_live`."""
        return self._values

    @property
    def key_ids(self) -> mx.array:
        """Key block ids, ``(n_blocks,)`` int32, as of the last :meth:`require_live`."""
        return self._key_ids

    @property
    def value_ids(self) -> mx.array:
        """Value block ids, ``(n_blocks,)`` int32, as of the last :meth:`require_live`."""
        return self._value_ids

    @property
    def run_starts(self) -> tuple[int, int] | None:
        """The first key id and the first value id when the key ids are consecutive and
        ascending and so are the value ids (``[f, f + 1, ...]``), as of the last
        :meth:`require_live`; ``None`` otherwise, and for a table of no blocks.

        Each stream's positions then lie in one run of rows of every slab, which a
        store reads by slicing instead of gathering. With ``separate_kv=True`` a
        fresh fixed pool hands a request alone consecutive ids per stream
        (docs/CONTRACT.md C-ID-SPLIT, C-ID-ASCENDING), and a book gives blocks back
        so that they come out so again. Requests that grow side by side interleave
        their new ids, and ``pool.free_all(owner)`` pushes blocks in allocation
        order, so the next request's ids come out descending: those are gathered.
        """
        if self._key_run is None or self._value_run is None:
            return None
        return self._key_run, self._value_run

    @property
    def handles_checked(self) -> int:
        """How many handles this table has asked the pool about, in all: each block
        once when it joins, every block again after a free or a move anywhere in the pool."""
        return self._handles_checked

    def require_live(self) -> None:
        """Make the table match the book, every handle live; O(1) when nothing moved.

        Raises:
            StaleBlockTableError: A handle of the book is not live in the pool (a
                block was freed or moved behind the book's back); the table is left empty,
                so nothing can read or write through it until the book changes.
        """
        book = self._book
        version, extent = book.table_version, book.extent_version
        stats = self._pool.stats  # one snapshot: both counts as of one moment
        releases = stats.n_frees + stats.n_copy_on_write
        if version == self._checked_version and releases == self._checked_releases:
            self._checked_extent = extent  # this check covers the book's extent as it is now
            return
        keys, values = self._book.key_blocks, self._book.value_blocks
        if releases == self._checked_releases and self._extends_checked(keys, values):
            self._append_checked(keys, values)
        else:
            self._check_all(keys, values)
        # Recorded last, with the count read *before* the check: a free that raced the
        # check moves the count again and forces the next call to look once more. A
        # check that raised leaves the extent unrecorded, so the next layer checks again.
        self._checked_version = version
        self._checked_releases = releases
        self._checked_extent = extent

    def require_live_this_step(self) -> None:
        """:meth:`require_live`, asking the pool once per decode step, not once per layer.

        While the book's extent (its furthest position and its blocks,
        :attr:`PooledKVCache.extent_version`) is what it was at the last check, the
        table is what that check found; a decode step changes the extent with its
        first layer's append, so every step is checked, by the first call that writes
        it. A block freed behind the book's back *during* a step, between two layers'
        calls, is found at the next step (or at the next :meth:`require_live`, which
        every read that is not part of a decode step makes): it is a race with the
        step's own lazy writes and reads either way, which run when the step's graph
        is evaluated, after its last layer.

        Raises:
            StaleBlockTableError: As :meth:`require_live`.
        """
        book = self._book
        if (
            book.extent_version != self._checked_extent
            or book.table_version != self._checked_version
        ):
            self.require_live()

    def memo(self, owner: object) -> object:
        """The value :meth:`remember` last kept for ``owner`` (compared by identity) while
        the ids stayed the same; ``None`` if there is none.

        A store derives index arrays from the ids (its slab rows of every position,
        say); every layer of every step then shares them until the table changes.
        One entry is kept.
        """
        return self._memo_value if owner is self._memo_key else None

    def memo_this_step(self, owner: object) -> object:
        """:meth:`memo`, while :meth:`require_live_this_step` would return at once (the
        book's extent and blocks are what the last check saw); else ``None``.

        The decode path asks it at every layer's call; for every layer of a step after
        the first it answers, and the store needs neither the check nor the lookup.
        On ``None`` the store makes both as usual.
        """
        book = self._book
        if (
            owner is self._memo_key
            and book.extent_version == self._checked_extent
            and book.table_version == self._checked_version
        ):
            return self._memo_value
        return None

    def remember(self, owner: object, value: MemoT) -> MemoT:
        """Keep ``value`` for ``owner`` until the ids change (or another owner's value
        replaces it); return it."""
        self._memo_key, self._memo_value = owner, value
        return value

    def check_invariants(self) -> None:
        """Verify the class invariants. O(blocks), and one wait for the id arrays.

        The ids and the run starts are checked against the handles the table holds,
        always. That those are the book's handles, each live, is checked while the
        book's ``table_version`` and the pool's count of frees and moves are what the
        last :meth:`require_live` saw; after either moved the table is behind by
        design, until the next check.

        Raises:
            InvariantViolationError: Naming the invariant that is broken and how.
        """
        problem = self._first_violation()
        if problem is not None:
            raise InvariantViolationError(problem)

    # -- internals ---------------------------------------------------------------------

    def _first_violation(self) -> str | None:
        if len(self._keys) != len(self._values):
            return f"table: {len(self._keys)} key handles but {len(self._values)} value handles"
        streams = (
            ("key", self._keys, self._key_ids, self._key_run),
            ("value", self._values, self._value_ids, self._value_run),
        )
        for stream, blocks, ids, run in streams:
            problem = _ids_violation(stream, blocks, ids, run)
            if problem is not None:
                return problem
        return self._book_violation() if self._is_current() else None

    def _is_current(self) -> bool:
        """Whether neither the book's blocks nor the pool's frees and moves have moved
        since the last completed :meth:`require_live`."""
        stats = self._pool.stats
        return (
            self._checked_version == self._book.table_version
            and self._checked_releases == stats.n_frees + stats.n_copy_on_write
        )

    def _book_violation(self) -> str | None:
        book = self._book
        for stream, held, booked in (
            ("key", self._keys, book.key_blocks),
            ("value", self._values, book.value_blocks),
        ):
            if len(held) != len(booked) or any(
                a is not b for a, b in zip(held, booked, strict=True)
            ):
                return f"table: the {stream} handles are not the book's, with nothing moved"
        stale = next(
            (block for block in self._keys + self._values if not self._pool.is_live(block)), None
        )
        if stale is not None:
            return f"handles: {stale!r} is not live, with nothing freed or moved since the check"
        return None

    def _extends_checked(self, keys: tuple[Block, ...], values: tuple[Block, ...]) -> bool:
        """Whether the book only appended to the checked handles (O(1): with no free or
        move in the pool, a book can only have grown; the last checked handle confirms it)."""
        n_checked = len(self._keys)
        if len(keys) < n_checked or len(values) != len(keys):
            return False
        return n_checked == 0 or (
            keys[n_checked - 1] is self._keys[-1] and values[n_checked - 1] is self._values[-1]
        )

    def _append_checked(self, keys: tuple[Block, ...], values: tuple[Block, ...]) -> None:
        n_checked = len(self._keys)
        new_keys, new_values = keys[n_checked:], values[n_checked:]
        if not new_keys:
            return
        self._require_all_live(new_keys + new_values)
        self._keys, self._values = keys, values
        self._key_run = _run_after(self._key_run, n_checked, new_keys)
        self._value_run = _run_after(self._value_run, n_checked, new_values)
        self._key_ids = _concat_ids(self._key_ids, new_keys)
        self._value_ids = _concat_ids(self._value_ids, new_values)
        self._schedule_ids()

    def _check_all(self, keys: tuple[Block, ...], values: tuple[Block, ...]) -> None:
        self._require_all_live(keys + values)
        self._keys, self._values = keys, values
        self._key_run = run_start(keys)
        self._value_run = run_start(values)
        self._key_ids = _ids(keys)
        self._value_ids = _ids(values)
        self._schedule_ids()

    def _require_all_live(self, blocks: tuple[Block, ...]) -> None:
        self._handles_checked += len(blocks)
        if self._pool.all_live(blocks):
            return
        stale = next((block for block in blocks if not self._pool.is_live(block)), None)
        self._keys = self._values = ()
        self._key_run = self._value_run = None
        self._key_ids = self._value_ids = _NO_IDS
        self._checked_version = self._checked_releases = self._checked_extent = -1
        self._forget_memo()
        culprit = "a block" if stale is None else f"block {stale!r}"
        raise stale_block_error(culprit, self._book.owner, "table", "cache")

    def _schedule_ids(self) -> None:
        # Scheduled, not left lazy: MLX streams are per thread, and a store without
        # lazy_writes may be called from another thread than the one that built them.
        schedule(self._key_ids, self._value_ids)
        self._forget_memo()

    def _forget_memo(self) -> None:
        self._memo_key = self._memo_value = None


#: The ids of no block: a constant (no graph, so no thread owns it).
_NO_IDS: Final = mx.array([], dtype=mx.int32)


def run_start(blocks: Sequence[Block]) -> int | None:
    """The first id of ``blocks`` when their ids run on ``[f, f + 1, ...]``; ``None``
    otherwise, and for no blocks. O(blocks)."""
    if not blocks:
        return None
    first = blocks[0].block_id
    return first if _ids_run_from(blocks, first) else None


def _run_after(run: int | None, n_held: int, new_blocks: tuple[Block, ...]) -> int | None:
    """The first id of a stream's run once ``new_blocks`` follow its ``n_held`` blocks
    (``run``: their first id, or ``None`` if they were no run); O(new blocks)."""
    if n_held == 0:
        return run_start(new_blocks)
    if run is None or not _ids_run_from(new_blocks, run + n_held):
        return None
    return run


def _ids_run_from(blocks: Sequence[Block], first_id: int) -> bool:
    return all(block.block_id == first_id + offset for offset, block in enumerate(blocks))


def _ids_violation(
    stream: str, blocks: tuple[Block, ...], ids: mx.array, run: int | None
) -> str | None:
    """What is wrong with a stream's id array and run start, given its handles."""
    held = [block.block_id for block in blocks]
    listed = cast(list[int], ids.tolist())
    if ids.dtype != mx.int32 or ids.ndim != 1 or listed != held:
        return f"ids: the {stream} ids {listed} ({ids.dtype}) are not those of its handles {held}"
    runs_on = bool(held) and held == list(range(held[0], held[0] + len(held)))
    expected = held[0] if runs_on else None
    if run != expected:
        return f"runs: the {stream} run starts at {run}, expected {expected} for ids {held}"
    return None


def _ids(blocks: tuple[Block, ...]) -> mx.array:
    return mx.array([block.block_id for block in blocks], dtype=mx.int32)


def _concat_ids(ids: mx.array, new_blocks: tuple[Block, ...]) -> mx.array:
    if ids.size == 0:
        return _ids(new_blocks)
    return mx.concatenate([ids, _ids(new_blocks)])
