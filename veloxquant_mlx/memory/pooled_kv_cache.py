"""PooledKVCache: one request's KV-cache token slots, kept in block pool blocks.

The backend-free half of a paged KV cache. A request owns a *block table*:
a key block and a value block (pool streams ``"k"`` and ``"v"``, or the one
``"kv"`` list of a shared pool) for every ``block_size`` token positions.
A block id names those positions in *every* layer, as in vLLM: a store
such as ``MLXBlockStorage`` keeps one slab per layer indexed by block id,
so one table serves all layers and the pool counts each block once (a
block is then ``block_size`` positions of every layer). This
class keeps the table and the fill levels (through ``mark_used``, token by
token) but holds no array data, so a server on any backend can use it for
admission and accounting, and :class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache`
builds on it to store MLX keys and values.

Each layer has its own offset (layers of one forward pass append in turn);
the table covers the furthest of them and gives back whole blocks past it
when every layer has been trimmed. Waste is therefore below one block per
stream per request: at most ``block_size - 1`` unused slots per stream in
each layer, besides the blocks a reservation holds (below).

Ownership: the book claims its ``owner`` id in the pool on construction
(``register_owner``, so two live books cannot share an id) and ``release()``
returns its blocks, by handle, and the id. Blocks go back (on release, on a
trim, and when a checkout is undone) in the reverse of the order they were
checked out: values before keys, each stream's last position first. The
pool's stacks (C-LIFO) then hand them out again as they were, so ids that
ran on consecutively run on again for the growth after a trim and for the
next request, which the MLX store then reads by slicing
(:attr:`~veloxquant_mlx.memory.block_table.DeviceBlockTable.run_starts`).
``release()`` is idempotent, and
the book is a context manager, so an aborted generation still returns its
blocks. A book cannot be copied (``copy.copy`` or ``copy.deepcopy`` raise
``TypeError``): two objects releasing one claim would release it twice.

Sharing: ``fork()`` gives a second book holding every block of this one
that holds positions (the pool's ``share`` of the book's own handles, never
every block of its owner id), for parallel sampling or beam search. A shared block
is read-only in the pool, so the first append (or trim) that changes the
fill of a shared last block first moves it to a private one
(``make_writable``) and has the store copy its slots (the ``copy_block``
callback a store-backed cache installs); full shared blocks stay shared.
A layer trimmed alone and written again below the extent (as the ``state``
setter of a store-backed cache does) rewrites positions that other layers
still hold, in blocks no growth or trim moves: each shared one among them
is moved first the same way, all of them or, if the pool cannot supply
them, none and the append is refused.

Blocks changed behind the book's back (a handle freed or moved by a call
on the pool, a block shared by one) never leave a step half done: a
copy-on-write, a fork, or a trim over a stale handle is refused first, by
name (``StaleBlockTableError``), whatever the pool could supply; a fill
mark the pool refuses (a block shared behind the back is read-only) is
made first, for both streams or neither, so growth past it checks nothing
out and a trim cuts nothing. Positions a layer writes again (after a trim
of that layer alone) are refused if their block was shared behind the
book's back; a decode step's later layers write where they stopped, and
make no such look. And a step the pool cannot undo (a checkout, which may
grow the pool; a copy-on-write move, whose copy the store makes) first runs
``before_change``, the device table's liveness check, and a move first
runs ``before_copy``, the store's check that this thread may copy (a
pool-backed cache installs both), so a step the store would refuse changes
nothing.

Reservation (docs/RESERVATIONS.md): a book built with ``reserve_tokens``
checks out the blocks for that many positions at its first growth, in one
call per stream, and grows into them (RES-TAKE, RES-USE); reserved blocks
are its own, unshared, with no fill (RES-FILL). Requests that grow side by
side then keep ids that run on, so the store reads each by slices. A trim
keeps the blocks it frees reserved, up to the reservation (RES-TRIM); a fork
holds no reservation (RES-FORK).

A book dropped without ``release()`` cannot leak: its finaliser queues its
owner id, claim and handles (taking no lock, since it may run inside a pool
call on any thread), and the next book construction, block-taking ``append``
or pool-backed cache update on the pool releases them (an append or a
copy-on-write the pool refuses runs the garbage collector, for books dropped
inside a reference cycle, and tries again if a dropped book came back);
:mod:`~veloxquant_mlx.memory.deferred_release` says exactly when and why a
late release never frees another request's blocks, even one that reuses
the id, and :func:`~veloxquant_mlx.memory.deferred_release.reclaim_dropped_caches`
drains on demand.

Complexity (``L`` = layers, ``n`` = blocks held): ``append`` O(1) when it
stays in the last block, else O(k) for the k blocks it checks out (amortised
O(1) per token), O(r) pool looks for the r blocks a layer writes again,
and O(n) when it copies shared blocks on write after a fork (every held
handle is checked once); ``trim`` O(L + k) for the k blocks it
frees (O(L + n) after a fork, when it copies the new last blocks); ``fork``
and ``release`` O(n); ``check_invariants`` O(n + L).

Thread safety: a book belongs to one request and is used from one thread
at a time; the pool it draws from is shared and locks itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, NoReturn

from veloxquant_mlx.memory._arguments import require_format, require_int
from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    InvariantViolationError,
    OwnerAlreadyActiveError,
)
from veloxquant_mlx.memory.deferred_release import (
    BookHolding,
    deferred_releases_for,
)
from veloxquant_mlx.memory.stream_supply import require_supply

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = ["PooledKVCache", "StaleBlockTableError", "stale_block_error"]


class StaleBlockTableError(ValueError):
    """A block of a book (or of its device table) is no longer a live handle of the pool:
    freed or moved behind its back."""


def stale_block_error(culprit: str, owner: int, holder: str, behind: str) -> StaleBlockTableError:
    """The error for ``culprit`` (a block, or "a block") of ``owner``'s ``holder`` (its
    "book" or "table") gone stale behind ``behind``'s back (the "book", the "cache")."""
    return StaleBlockTableError(
        f"{culprit} of owner {owner}'s {holder} is not a live handle of the pool: it was "
        f"freed or moved behind the {behind}'s back (free or free_all of its owner, or "
        "make_writable of the handle); expected every block of a cache to stay checked "
        "out until the cache frees it"
    )


#: Owner ids handed out when the caller names none: far above typical request ids.
_AUTO_OWNERS: Final = itertools.count(1 << 48)


class PooledKVCache:
    """The block table and per-layer fill levels of one request, with no data.

    Invariants (``check_invariants`` verifies them until ``release()``):

    - ``n_tokens == max(layer offsets)``: the table covers exactly the
      furthest layer.
    - both streams hold ``ceil(n_tokens / block_size)`` live handles of the
      pool, checked out to ``owner``;
    - every block is full except the last of each stream, whose ``n_used``
      is the remainder (``n_tokens - (blocks - 1) * block_size``);
    - reserved blocks (docs/RESERVATIONS.md) are live handles of ``owner``,
      unshared, with ``n_used == 0``, and at most ``max(0, R - blocks)`` per stream
      (``R`` the reservation in blocks): INV-RES-HANDLES, INV-RES-BOUND;
    - the pool lists exactly those handles and the reserved ones for ``owner``
      (none leaks).

    Dropped without ``release()``, a book queues what it holds for release by
    the next drain (module docstring); a released book queues nothing.

    Example::

        with PooledKVCache(pool, owner=request_id) as book:
            book.append(prompt_length)      # prefill
            book.append(1)                  # one decode step
            book.trim(3)                    # speculative rewind
        # every block of request_id is back in the pool
    """

    # What a book whose __init__ failed looks like to __del__: nothing to release.
    _released = True

    def __init__(
        self,
        pool: CheckedBlockPool[Block],
        owner: int | None = None,
        *,
        n_layers: int = 1,
        format: str = "fp16",
        reserve_tokens: int = 0,
    ) -> None:
        """Claim ``owner`` (a fresh id if ``None``) in ``pool``; no block is taken yet.

        Args:
            pool: The pool to draw blocks from.
            owner: Request id recorded on every block; ``None`` picks an unused one.
            n_layers: Number of layers appending to this table.
            format: Compression-format tag recorded on every block.
            reserve_tokens: Positions to check out ahead at the first growth
                (docs/RESERVATIONS.md); ``0``, no reservation.

        Raises:
            TypeError: ``pool`` is not a ``BlockPoolAllocator``, ``owner``,
                ``n_layers`` or ``reserve_tokens`` not an int, ``format`` not a str.
            ValueError: ``n_layers < 1``, ``reserve_tokens < 0`` or ``format`` empty.
            OwnerAlreadyActiveError: ``owner`` holds blocks or is registered.
            MemoryError: ``n_layers`` is too many to hold; nothing is claimed.
        """
        if not isinstance(pool, BlockPoolAllocator):
            raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
        require_int("n_layers", n_layers, minimum=1)
        require_int("reserve_tokens", reserve_tokens, minimum=0)
        require_format(format)
        try:
            offsets = [0] * n_layers
        except (MemoryError, OverflowError):  # 10**20 layers: no list holds them
            raise MemoryError(f"n_layers={n_layers} is more than this process can hold") from None
        self._pool: Final = pool
        self._block_size: Final = pool.config.block_size
        self._format: Final = format
        if owner is not None:
            require_int("owner", owner)
        # The block table, one handle per block_size positions; tuples, rebuilt on change.
        self._key_blocks: tuple[Block, ...] = ()
        self._value_blocks: tuple[Block, ...] = ()
        # The reservation (docs/RESERVATIONS.md): in positions, in blocks per stream,
        # and the blocks checked out ahead, in the order growth takes them.
        self._reserve_tokens: Final = reserve_tokens
        self._reserve_blocks: Final = -(-reserve_tokens // self._block_size)
        self._reserved_keys: tuple[Block, ...] = ()
        self._reserved_values: tuple[Block, ...] = ()
        # Bumped whenever the block tuples change (blocks added, freed, released), so a
        # device copy of the table (block_table.DeviceBlockTable) rebuilds only then.
        self._table_version = 0
        # Bumped whenever n_tokens or the blocks change: once per decode step (the first
        # layer's append), so the table can check liveness once per step, not per layer.
        self._extent_version = 0
        # Positions covered by the table: the furthest layer offset.
        self._n_tokens = 0
        # Per layer, positions appended and not trimmed.
        self._offsets: Final = offsets
        # Whether the last blocks may be shared (set by fork): the next growth checks.
        self._last_may_be_shared = False
        # Whether this book ever forked or was forked: only then can a trim reach a
        # shared block; a book that never shares calls the pool exactly as before.
        self._shares = False
        # How many leading blocks may be shared (set by fork; lowered as writes move
        # them): a layer that writes positions below the extent again, after a trim of
        # that layer alone, must not write into a block another book reads.
        self._maybe_shared = 0
        # Per layer trimmed alone, how far it had written: its writes up to there write
        # positions again, into blocks that may have been shared behind the book's back
        # since, so they look at the pool first (_require_rewritten_private). Empty while
        # no layer is trimmed alone: a decode step's layers write where they stopped.
        self._rewrites: Final[dict[int, int]] = {}
        # Copies a moved block's data: (old block id, new handle); None for a book alone.
        self.copy_block: Callable[[int, Block], None] | None = None
        # The device table's liveness check, run before a step the pool cannot undo: a
        # checkout (it may grow the pool) or a copy-on-write move. So a step the table
        # would refuse changes nothing. This book's own: a fork does not copy it.
        self.before_change: Callable[[], None] | None = None
        # The store's check that this thread may copy (a lazy_writes store's), run just
        # before a copy-on-write move; it goes with copy_block, to a fork too.
        self.before_copy: Callable[[], None] | None = None
        # The pool's owner claims and dropped books; claiming drains them first, so a
        # dropped request's id is free again at once.
        self._releases: Final = deferred_releases_for(pool)
        if owner is None:
            owner, claim = self._releases.claim_first_unused(_AUTO_OWNERS)
        else:
            claim = self._releases.claim(owner)
        # The request id every block is checked out to, and this book's claim of it.
        self._owner: Final = owner
        self._claim: Final = claim
        # Set last: from here on, dropping the book must give the owner back.
        self._released = False

    # -- read-only views -------------------------------------------------------------

    @property
    def pool(self) -> CheckedBlockPool[Block]:
        """The pool the blocks come from."""
        return self._pool

    @property
    def owner(self) -> int:
        """The request id the blocks are checked out to."""
        return self._owner

    @property
    def format(self) -> str:
        """The compression-format tag recorded on every block."""
        return self._format

    @property
    def block_size(self) -> int:
        """Token slots per block (the pool's)."""
        return self._block_size

    @property
    def n_layers(self) -> int:
        """Number of layers appending to this table."""
        return len(self._offsets)

    @property
    def released(self) -> bool:
        """Whether ``release()`` has returned the blocks (the book is then unusable)."""
        return self._released

    @property
    def offset(self) -> int:
        """Positions covered by the table: the furthest layer's offset."""
        return self._n_tokens

    @property
    def key_blocks(self) -> tuple[Block, ...]:
        """The key blocks, in position order; block ``i`` holds positions ``i * block_size ..``."""
        return self._key_blocks

    @property
    def value_blocks(self) -> tuple[Block, ...]:
        """The value blocks, in position order, parallel to :attr:`key_blocks`."""
        return self._value_blocks

    @property
    def reserve_tokens(self) -> int:
        """Positions this book checks out ahead (docs/RESERVATIONS.md); 0 for none."""
        return self._reserve_tokens

    @property
    def reserved_blocks(self) -> int:
        """Blocks per stream checked out ahead and not yet holding positions."""
        return len(self._reserved_keys)

    @property
    def table_version(self) -> int:
        """A counter that changes whenever :attr:`key_blocks` or :attr:`value_blocks`
        changes (blocks checked out, freed or released); equal values mean the same
        table. O(1)."""
        return self._table_version

    @property
    def extent_version(self) -> int:
        """A counter that changes whenever :attr:`offset` or the blocks change (a decode
        step's first append, a trim, a release); equal values mean neither changed. O(1)."""
        return self._extent_version

    def layer_offset(self, layer: int) -> int:
        """Positions ``layer`` has appended and not trimmed.

        Raises:
            TypeError, ValueError: ``layer`` is not an int in ``0 .. n_layers - 1``.
        """
        offsets = self._offsets
        if type(layer) is not int or not 0 <= layer < len(offsets):  # -1 read the last
            self._require_layer(layer)
        return offsets[layer]

    def size(self) -> int:
        """Positions held (mlx-lm's ``size()``): the same as :attr:`offset`."""
        return self._n_tokens

    def empty(self) -> bool:
        """Whether no position is held."""
        return self._n_tokens == 0

    def is_trimmable(self) -> bool:
        """Whether ``trim`` may be called: until ``release()``."""
        return not self._released

    def slots_held(self) -> int:
        """Token slots held per stream per layer: whole blocks, the reserved ones
        included, ``>= offset``."""
        return (len(self._key_blocks) + len(self._reserved_keys)) * self._block_size

    def slots_wasted(self) -> int:
        """Slots held but unused per stream per layer: at most ``block_size - 1``,
        plus the reserved blocks' slots."""
        return self.slots_held() - self._n_tokens

    # -- appending and trimming --------------------------------------------------------

    def append(self, n_tokens: int = 1, *, layer: int = 0) -> int:
        """Append ``n_tokens`` positions to ``layer``, checking out blocks as needed.

        All or nothing: if the pool cannot supply the blocks of both streams,
        nothing changes, in the book or in the pool, whose ``n_exhausted`` counts the
        refusal once (:mod:`~veloxquant_mlx.memory.stream_supply`). After a fork,
        positions written again below the extent first move their shared blocks to
        private copies (module docstring), under the same rule.

        Returns:
            The first appended position (the layer's offset before the call).

        Raises:
            RuntimeError: The book was released.
            TypeError, ValueError: ``n_tokens`` is not an int ``>= 0`` or ``layer``
                is out of range.
            BlockPoolExhaustedError: The pool has too few free blocks.
            StaleBlockTableError: A block the append needs (one to move, a reserved
                one to take) was freed, moved or shared behind the book's back.
            ValueError: The last block, whose fill the append marks, was shared behind
                the book's back (read-only).
        """
        offsets = self._offsets
        if (
            self._released
            or type(n_tokens) is not int
            or n_tokens < 0
            or type(layer) is not int
            or not 0 <= layer < len(offsets)
        ):  # one test on the decode path; the reasons are sorted out here only
            self._require_open()
            require_int("n_tokens", n_tokens, minimum=0)
            self._require_layer(layer)
        start = offsets[layer]
        end = start + n_tokens
        if end > self._n_tokens and self._reserved_keys:  # before any move after a fork
            n_taken = -(-end // self._block_size) - len(self._key_blocks)
            if n_taken > 0:  # growth into the reserve: once a block, not every step
                self._require_reserved_intact(n_taken)
        if self._rewrites and n_tokens:  # a layer trimmed alone: it may write again
            self._require_rewrite_private(layer, start, end)
        if start < self._maybe_shared * self._block_size and start < self._n_tokens and n_tokens:
            if end > self._n_tokens:  # the growth's mark must not be refused after the moves
                self._require_last_markable(rewrites=True)
            self._own_rewritten(start, end)  # after a fork only
        if end > self._n_tokens:
            self._grow_to(end)
        offsets[layer] = end
        if self._rewrites and self._rewrites.get(layer, 0) <= end:
            self._rewrites.pop(layer, None)  # past what it had written: writes are new
        return start

    def append_moves(self, n_tokens: int, layer: int) -> tuple[set[int], set[int], int]:
        """What ``append(n_tokens, layer=layer)`` would take from the pool, were nothing
        else to change it first: the ids of the shared key and value blocks it would move
        to private copies (copy-on-write after a fork: blocks it writes again below the
        extent, and a partly filled last block it grows into), and the blocks per stream
        its growth checks out (RES-TAKE). It first refuses, as the append would, a
        reserved block the growth would take that is no longer the book's alone, and a
        block the append writes again or marks that was shared behind the book's back
        (held blocks freed or moved are the table's to find: ``require_live``). A batch of
        requests (:mod:`~veloxquant_mlx.memory.batch_cache`) asks every row before it
        appends any, so that a step one row would refuse changes no row. O(1) pool looks
        for a decode step.

        Raises:
            RuntimeError: The book was released.
            TypeError, ValueError: ``n_tokens`` is not an int ``>= 0`` or ``layer``
                is out of range.
            StaleBlockTableError: A reserved block the growth would take, named.
            ValueError: A block shared behind the book's back, named.
        """
        self._require_open()
        require_int("n_tokens", n_tokens, minimum=0)
        self._require_layer(layer)
        start, block_size = self._offsets[layer], self._block_size
        end = start + n_tokens
        # append's own refusals, as it meets them (it looks at the last blocks only when
        # a rewrite moves blocks first; else the pool's refused mark is its look).
        if end > self._n_tokens and self._reserved_keys:
            n_taken = -(-end // block_size) - len(self._key_blocks)
            if n_taken > 0:
                self._require_reserved_intact(n_taken)
        if self._rewrites and n_tokens:
            self._require_rewrite_private(layer, start, end)
        rewrites = (
            n_tokens > 0 and start < self._maybe_shared * block_size and start < self._n_tokens
        )
        if end > self._n_tokens and self._key_blocks:
            self._require_last_markable(rewrites=rewrites)
        moved: set[int] = set()
        if rewrites:
            moved.update(self._rewritten_range(start, end))
        growth = 0
        if end > self._n_tokens:
            if self._grows_into_shared_last():
                moved.add(len(self._key_blocks) - 1)
            growth = self._blocks_to_check_out(end)
        shared = self._pool.is_shared
        return (
            {self._key_blocks[i].block_id for i in moved if shared(self._key_blocks[i].block_id)},
            {
                self._value_blocks[i].block_id
                for i in moved
                if shared(self._value_blocks[i].block_id)
            },
            growth,
        )

    def layers_in_step(self) -> bool:
        """Whether every layer holds the same positions (mlx-lm trims all alike). O(layers)."""
        return min(self._offsets) == max(self._offsets)

    def require_rewritable(self, layer: int, end: int) -> None:
        """Refuse, before anything changes, to replace ``layer``'s positions by ``end`` new
        ones (a cache's ``state`` setter does: it trims the layer to nothing, then appends)
        where the trim or the append would be refused after the trim: a held block freed
        or moved behind the book's back, a reserved one the append would take that is no
        longer the book's alone, or a block that would hold some of the positions shared
        behind its back. Only positions the other layers still hold stay in held blocks:
        the trim gives the rest back, and the append writes those into new blocks. Blocks
        a fork shares move on write instead (copy-on-write). Last, the pool is asked
        whether it can supply the blocks both steps check out in all (the growth past the
        extent, and the copies of shared blocks), so that exhaustion, too, is refused with
        nothing changed. O(n + L) plus O(r) pool looks for the r blocks written again and
        the reserved ones.

        Raises:
            TypeError, ValueError: ``layer`` or ``end`` is out of range.
            StaleBlockTableError: A held or reserved block, named.
            ValueError: A block shared behind the book's back, named.
            BlockPoolExhaustedError: The pool cannot supply those blocks (after a
                collection, as ``append``); it counted one exhaustion.
        """
        self._require_layer(layer)
        require_int("end", end, minimum=0)
        self._require_held_live()
        kept = max((o for i, o in enumerate(self._offsets) if i != layer), default=0)
        if end > kept and self._reserved_keys:
            self._require_reserved_intact(len(self._reserved_keys))
        if min(end, kept) > 0:
            self._require_rewritten_private(0, min(end, kept))
        # The demand is worked out inside, after the dropped caches are drained: a dropped
        # fork shares no more.
        self._releases.check_out_reclaiming(
            lambda: require_supply(
                self._pool,
                self._replacement_demand(end, kept),
                self._owner,
                self._format,
                self._free,
            )
        )

    def _replacement_demand(self, end: int, kept: int) -> dict[str, int]:
        """Blocks per stream that trimming a layer to nothing, with ``kept`` positions
        held by the others, then appending ``end`` positions takes from the pool.

        The trim may copy the new last block (a fork shares it, and its fill changes),
        then gives back the blocks past ``kept``: to the pool only those no one else
        holds, or to the reservation (RES-TRIM). The append copies each shared block it
        writes again, then grows. The pool must meet the trim's copy alone, and then
        all of it less what the trim gave back."""
        n_kept = -(-kept // self._block_size)
        shrinks = kept < self._n_tokens
        trim_copies = {n_kept - 1} if shrinks and self._trim_marks_last(kept) else set()
        first_unwritten = min(-(-min(end, kept) // self._block_size), self._maybe_shared)
        rewrite_copies = set(range(first_unwritten)) - trim_copies
        rebuilt = self._reserve_after_trim(n_kept) if shrinks else None
        demand = {}
        for stream, blocks, reserved in (
            ("k", self._key_blocks, self._reserved_keys),
            ("v", self._value_blocks, self._reserved_values),
        ):
            n_reserved, given_back = len(reserved), 0
            if rebuilt is not None:
                n_reserved = rebuilt
                given_back = len(blocks) - n_kept + len(reserved) - n_reserved
            elif shrinks:
                given_back = sum(not self._pool.is_shared(b.block_id) for b in blocks[n_kept:])
            growth = self._checkout_for(end, n_kept, n_reserved) if end > kept else 0
            trim_copy = self._n_shared(blocks, trim_copies)
            rest = self._n_shared(blocks, rewrite_copies) + growth - given_back
            demand[stream] = max(trim_copy, trim_copy + rest)
        return demand

    def _n_shared(self, blocks: tuple[Block, ...], indices: Iterable[int]) -> int:
        return sum(self._pool.is_shared(blocks[index].block_id) for index in indices)

    def trim(self, n: int, *, layer: int | None = None) -> int:
        """Drop the last ``n`` positions of ``layer`` (of every layer if ``None``).

        Whole blocks past the furthest remaining layer offset go back to the
        pool, or stay reserved as far as a reservation lacks them (RES-TRIM); the
        new last blocks are marked with their fill.

        Returns:
            Positions dropped: ``min(n, offset)`` of the layer (of the book if ``None``).

        Raises:
            TypeError, ValueError: ``n`` is not an int ``>= 0`` or ``layer`` is out of range.
            OwnerAlreadyActiveError: The last block went back and, before the book could
                claim its owner id again, code outside the books took it (an id
                collision); the book then holds nothing and counts as released.
            BlockPoolExhaustedError: The new last blocks are shared with a fork, so
                their fill can change only in private copies, and the pool has no
                block for one (after a collection, as ``append``); nothing changes.
                A trim of one layer that the others still hold past makes that copy of
                the layer's new last blocks already, if they are shared, so the later
                layers of a trim layer by layer (as mlx-lm's ``trim_prompt_cache``)
                need no block.
            StaleBlockTableError: Such a block, or a block the trim gives back or keeps
                reserved, was freed or moved behind the book's back; nothing changes.
            ValueError: A new last block whose fill changes was shared behind the book's
                back (the pool refuses to mark it); nothing changes.
        """
        require_int("n", n, minimum=0)
        if self._released:
            return 0
        if layer is None:
            n = min(n, self._n_tokens)
            offsets = [min(offset, self._n_tokens - n) for offset in self._offsets]
        else:
            self._require_layer(layer)
            n = min(n, self._offsets[layer])
            offsets = [*self._offsets]
            offsets[layer] -= n
        furthest = max(offsets)
        if furthest < self._n_tokens:
            self._require_trimmable(furthest)  # the steps that may be refused: first
            self._own_blocks_kept_by(furthest)
            self._shrink_to(furthest)
        elif layer is not None and n:  # other layers still hold these positions
            self._own_shared_kept_by(offsets[layer])
        if layer is not None and n:  # its positions up to here are written again later
            done = min(max(self._rewrites.get(layer, 0), self._offsets[layer]), self._n_tokens)
            if done > offsets[layer]:
                self._rewrites[layer] = done
        self._offsets[:] = offsets
        return n

    def fork(self, owner: int | None = None) -> PooledKVCache:
        """A second book holding every block of this one that holds positions, with the
        same positions.

        Both books then write copy-on-write (module docstring). The new book
        claims ``owner`` (a fresh id if ``None``) and copies the ``copy_block`` and
        ``before_copy`` callbacks (not ``before_change``, this book's table's check);
        it holds no reservation, and this book's reserved blocks are not shared
        (RES-FORK).

        Raises:
            RuntimeError: This book was released.
            OwnerAlreadyActiveError: ``owner`` is in use.
            StaleBlockTableError: A block of this book was freed or moved behind its
                back; nothing changes.
        """
        self._require_open()
        self._require_held_live()  # before the twin claims
        twin = PooledKVCache(self._pool, owner, n_layers=len(self._offsets), format=self._format)
        twin.copy_block, twin.before_copy = self.copy_block, self.before_copy
        # The book's own handles, not every block of the owner id (the pool's fork): not
        # its reserved blocks (RES-FORK), nor blocks checked out to the id behind its back.
        n_keys = len(self._key_blocks)
        handles = self._pool.share([*self._key_blocks, *self._value_blocks], twin._owner)
        twin._key_blocks, twin._value_blocks = tuple(handles[:n_keys]), tuple(handles[n_keys:])
        twin._table_version += 1
        twin._extent_version += 1
        twin._n_tokens = self._n_tokens
        twin._offsets[:] = self._offsets
        twin._rewrites.update(self._rewrites)
        self._last_may_be_shared = twin._last_may_be_shared = bool(self._key_blocks)
        self._shares = twin._shares = True
        self._maybe_shared = twin._maybe_shared = len(self._key_blocks)
        return twin

    def release(self) -> None:
        """Return every block to the pool and release the owner. Idempotent.

        Frees the book's own handles (those still live), never "every block of the
        owner id": blocks freed behind the book's back and checked out again under
        the same id by someone else stay theirs. They go back in the reverse of the
        order they were checked out, so that the pool hands them out again so.
        """
        if self._released:
            return
        self._releases.release_now(self._holding())
        self._abandon()

    def __copy__(self) -> NoReturn:
        raise TypeError(_NO_COPIES)

    def __deepcopy__(self, memo: object) -> NoReturn:
        raise TypeError(_NO_COPIES)

    def __enter__(self) -> PooledKVCache:
        return self

    def __del__(self) -> None:
        # A finaliser: any thread, any moment, maybe inside a pool call holding the
        # pool's lock. So it only queues what the book holds (SimpleQueue.put takes no
        # lock); the next drain releases it.
        if not self._released:
            self._releases.defer(self._holding())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    # -- checking ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the class invariants against the pool. O(blocks held + layers).

        Raises:
            InvariantViolationError: Naming the invariant that is broken and how.
        """
        problem = self._first_violation()
        if problem is not None:
            raise InvariantViolationError(problem)

    def _first_violation(self) -> str | None:
        n_tokens = self._n_tokens
        if self._released:
            held = self._key_blocks or self._reserved_keys
            return None if n_tokens == 0 and not held else "released: still holds"
        if n_tokens != max(self._offsets):
            return f"coverage: n_tokens={n_tokens} but layer offsets are {self._offsets}"
        n_blocks = -(-n_tokens // self._block_size)
        for stream, blocks in (("k", self._key_blocks), ("v", self._value_blocks)):
            if len(blocks) != n_blocks:
                return f"table: {len(blocks)} {stream} blocks for {n_tokens} tokens"
            for index, block in enumerate(blocks):
                fill = min(self._block_size, n_tokens - index * self._block_size)
                if not self._pool.is_live(block) or block.owner != self._owner:
                    return f"handles: {stream} block {index} {block!r} is not live for the owner"
                if block.n_used != fill:
                    return f"fill: {stream} block {index} has n_used={block.n_used}, not {fill}"
        return self._reserve_violation() or self._ownership_violation()

    def _reserve_violation(self) -> str | None:
        """INV-RES-HANDLES and INV-RES-BOUND (docs/RESERVATIONS.md)."""
        bound = max(0, self._reserve_blocks - len(self._key_blocks))
        for stream, blocks in (("k", self._reserved_keys), ("v", self._reserved_values)):
            if len(blocks) > bound or len(blocks) != len(self._reserved_keys):
                return (
                    f"reserve: {len(blocks)} reserved {stream} blocks and "
                    f"{len(self._reserved_keys)} k blocks; expected as many, at most {bound}"
                )
            for index, block in enumerate(blocks):
                if not self._pool.is_live(block) or block.owner != self._owner:
                    return f"reserve: {stream} block {index} {block!r} is not live for the owner"
                if self._pool.is_shared(block.block_id) or block.n_used != 0:
                    return f"reserve: {stream} block {index} {block!r} is shared or not empty"
        return None

    def _ownership_violation(self) -> str | None:
        """Whether the pool lists for the owner exactly the handles the book holds:
        a block checked out and then dropped from the table would leak until the pool
        is gone."""
        held = {id(block) for block in self._all_handles()}
        listed = self._pool.blocks_for(self._owner)
        if len(listed) != len(held) or any(id(block) not in held for block in listed):
            return (
                f"ownership: the pool lists {len(listed)} blocks for owner {self._owner}, "
                f"the book holds {len(held)} (ids {sorted(block.block_id for block in listed)})"
            )
        return None

    # -- internals ---------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._released:
            raise RuntimeError(
                f"the KV cache of owner {self._owner} was released; "
                "expected a cache that still holds its blocks"
            )

    def _require_layer(self, layer: int) -> None:
        if type(layer) is not int or not 0 <= layer < len(self._offsets):
            require_int("layer", layer, minimum=0)
            raise ValueError(f"layer must be in 0..{len(self._offsets) - 1}, got {layer}")

    def _grow_to(self, n_tokens: int) -> None:
        """Cover ``n_tokens`` positions: fill the last blocks, then take new ones."""
        block_size = self._block_size
        if self._last_may_be_shared:  # once, after a fork: the growth writes into it
            if self._grows_into_shared_last():
                growth = self._blocks_to_check_out(n_tokens)
                self._own_blocks_reclaiming(len(self._key_blocks) - 1, growth)
            self._last_may_be_shared = False
        if n_tokens > len(self._key_blocks) * block_size:
            self._grow_by_blocks(n_tokens)
        else:
            self._mark_pair(
                len(self._key_blocks) - 1, n_tokens - (len(self._key_blocks) - 1) * block_size
            )
        self._n_tokens = n_tokens
        self._extent_version += 1

    def _grow_by_blocks(self, n_tokens: int) -> None:
        """Cover ``n_tokens`` positions past the last block: reserved blocks first, then
        checked-out ones, enough for the reservation (RES-TAKE, RES-USE); all or nothing.

        Without a reservation the checkout asks the pool for the positions past the held
        blocks, so the pool fills the new blocks; with one it takes full blocks and marks
        each with its fill, the ones left over empty. The reserved blocks taken were
        checked by ``append`` (``_require_reserved_intact``).
        """
        block_size, n_held = self._block_size, len(self._key_blocks)
        n_new = -(-n_tokens // block_size) - n_held
        keys, values = self._reserved_keys, self._reserved_values
        n_reserved_before = len(keys)
        n_more = self._blocks_to_check_out(n_tokens)
        # First, as the one step the pool may refuse without a checkout: a last block shared
        # behind the book's back is read-only. Before any checkout, which may grow the pool.
        filled_from = self._fill_last()
        if n_more:
            past_held = n_tokens - n_held * block_size  # the positions, when none reserved
            n_tokens_out = n_more * block_size if self._reserve_blocks else past_held
            try:  # a dropped cache's blocks first, even one dropped in a cycle, before exhaustion
                self._check_table()
                new_keys, new_values = self._releases.check_out_reclaiming(
                    lambda: self._check_out(n_tokens_out)
                )
            except BaseException:
                if filled_from is not None:
                    self._mark_pair(n_held - 1, filled_from)
                raise
            keys, values = (*keys, *new_keys), (*values, *new_values)
        last_fill = n_tokens - (n_held + n_new - 1) * block_size
        for index in range(n_new):
            fill = block_size if index < n_new - 1 else last_fill
            self._mark_fill(keys[index], fill)
            self._mark_fill(values[index], fill)
        for index in range(max(n_new, n_reserved_before), len(keys)):  # checked out full
            self._mark_fill(keys[index], 0)
            self._mark_fill(values[index], 0)
        self._key_blocks += keys[:n_new]
        self._value_blocks += values[:n_new]
        self._reserved_keys, self._reserved_values = keys[n_new:], values[n_new:]
        self._table_version += 1

    def _fill_last(self) -> int | None:
        """Mark the last blocks full (``_mark_pair``) before growth past them; the fill
        they had, to undo it with, or ``None`` if they were full (or there are none)."""
        if not self._key_blocks:
            return None
        fill = self._key_blocks[-1].n_used
        if fill == self._block_size:
            return None
        self._mark_pair(len(self._key_blocks) - 1, self._block_size)
        return fill

    def _mark_pair(self, index: int, fill: int) -> None:
        """Mark the key and value blocks at ``index`` with ``fill``, both or neither; a
        block that already has that fill is not marked. The pool refuses a block shared
        (behind the book's back, or with a fork: read-only), and if that is the value
        block, the key block's mark is undone."""
        key, value = self._key_blocks[index], self._value_blocks[index]
        key_fill = key.n_used
        if key_fill != fill:
            self._pool.mark_used(key, fill)
        if value.n_used == fill:
            return
        try:
            self._pool.mark_used(value, fill)
        except BaseException:  # refused, or interrupted between the two marks
            if key_fill != fill:
                self._pool.mark_used(key, key_fill)
            raise

    def _blocks_to_check_out(self, n_tokens: int) -> int:
        """Blocks per stream that growth to ``n_tokens`` positions checks out: none while
        the reserved blocks cover it, else enough for ``max(needed, R)`` (RES-TAKE)."""
        return self._checkout_for(n_tokens, len(self._key_blocks), len(self._reserved_keys))

    def _checkout_for(self, n_tokens: int, n_held: int, n_reserved: int) -> int:
        """``_blocks_to_check_out`` of a book holding ``n_held`` blocks and ``n_reserved``
        reserved ones per stream."""
        n_new = -(-n_tokens // self._block_size) - n_held
        if n_new <= n_reserved:
            return 0
        return max(n_held + n_new, self._reserve_blocks) - n_held - n_reserved

    def _require_reserved_intact(self, n_taken: int) -> None:
        """Before growth takes the first ``n_taken`` (>= 1) reserved blocks of each stream: each
        is still a live handle no one else shares (INV-RES-HANDLES), or the growth is
        refused with nothing changed."""
        pool = self._pool
        taken = (*self._reserved_keys[:n_taken], *self._reserved_values[:n_taken])
        for block in taken:
            if not pool.is_live(block) or pool.is_shared(block.block_id):
                raise StaleBlockTableError(
                    f"reserved block {block!r} of owner {self._owner}'s book is not a live "
                    "handle of the book alone: it was freed, moved or shared behind the "
                    "book's back; expected reserved blocks to stay the book's until it "
                    "takes or frees them"
                )

    def _mark_fill(self, block: Block, fill: int) -> None:
        if block.n_used != fill:
            self._pool.mark_used(block, fill)

    def _check_out(self, n_tokens: int) -> tuple[list[Block], list[Block]]:
        """Key and value blocks for ``n_tokens`` more positions; all or nothing.

        The pool is asked first whether it can supply both streams
        (:func:`~veloxquant_mlx.memory.stream_supply.require_supply`), so a refusal
        grows nothing and counts no checkout; the key blocks are given back only if
        another thread took the value blocks after that look.
        """
        pool = self._pool
        n_blocks = -(-n_tokens // self._block_size)
        require_supply(pool, {"k": n_blocks, "v": n_blocks}, self._owner, self._format, self._free)
        new_keys = pool.allocate("k", n_tokens, self._owner, self._format)
        try:
            new_values = pool.allocate("v", n_tokens, self._owner, self._format)
        except BaseException:
            self._free(new_keys)
            raise
        return new_keys, new_values

    def _shrink_to(self, n_tokens: int) -> None:
        """Keep ``n_tokens`` positions: mark the new last blocks, free the ones past them.

        The pool is asked first, so a refusal changes nothing. A new last block whose
        fill does not change is not marked: at a block boundary it is full, and after
        a fork it may be shared, hence read-only even to a mark of the same fill.
        """
        block_size = self._block_size
        n_kept, n_kept_before = -(-n_tokens // block_size), len(self._key_blocks)
        if n_kept:  # the one step the pool may refuse (a block shared behind the back): first
            self._mark_pair(n_kept - 1, n_tokens - (n_kept - 1) * block_size)
        tail = self._tail_to_free(n_kept)
        self._key_blocks = self._key_blocks[:n_kept]
        self._value_blocks = self._value_blocks[:n_kept]
        self._maybe_shared = min(self._maybe_shared, n_kept)  # blocks grown later are new
        for layer, done in [*self._rewrites.items()]:  # positions past n_tokens are gone
            self._rewrites[layer] = min(done, n_tokens)
        if len(self._key_blocks) != n_kept_before:
            self._table_version += 1
        self._n_tokens = n_tokens
        self._extent_version += 1
        if tail:
            self._free(tail)

    def _tail_to_free(self, n_kept: int) -> list[Block]:
        """The blocks past the first ``n_kept`` that a shrink gives back to the pool (keys,
        then values, each in position order; live: ``_require_trimmable``). With a
        reservation, of those blocks and the reserved ones the first ``max(0, R - n_kept)``
        stay reserved, marked empty (RES-TRIM), unless they may be shared: then all go back."""
        tail_keys, tail_values = self._key_blocks[n_kept:], self._value_blocks[n_kept:]
        n_reserved = self._reserve_after_trim(n_kept)
        if n_reserved is None:
            return [*tail_keys, *tail_values]
        keys, values = (*tail_keys, *self._reserved_keys), (*tail_values, *self._reserved_values)
        for block in (*tail_keys[:n_reserved], *tail_values[:n_reserved]):
            self._mark_fill(block, 0)
        self._reserved_keys, self._reserved_values = keys[:n_reserved], values[:n_reserved]
        return [*keys[n_reserved:], *values[n_reserved:]]

    def _reserve_after_trim(self, n_kept: int) -> int | None:
        """The reserved blocks per stream a shrink to ``n_kept`` blocks keeps, of the tail
        and the reserve (RES-TRIM: ``max(0, R - n_kept)``); ``None`` if it rebuilds no
        reserve (``_trim_reaches_reserve``), or if a tail block may be shared (behind the
        book's back): then the whole tail goes back."""
        if not self._trim_reaches_reserve(n_kept):
            return None
        tail = (*self._key_blocks[n_kept:], *self._value_blocks[n_kept:])
        if any(self._pool.is_shared(block.block_id) for block in tail):
            return None
        return max(0, self._reserve_blocks - n_kept)

    def _trim_reaches_reserve(self, n_kept: int) -> bool:
        """Whether a shrink to ``n_kept`` blocks rebuilds the reserve (RES-TRIM): it frees
        blocks, the reservation lacks some of them, and the book never shared."""
        n_held = len(self._key_blocks)
        return n_kept < n_held and n_kept < self._reserve_blocks and not self._shares

    def _require_trimmable(self, n_tokens: int) -> None:
        """Before a shrink to ``n_tokens`` changes anything: every block it gives back or
        keeps reserved is still the book's handle (a stale one would make the pool refuse
        the free half-way, with the book already cut)."""
        n_kept = -(-n_tokens // self._block_size)
        self._require_held_live(range(n_kept, len(self._key_blocks)))
        if self._trim_reaches_reserve(n_kept):
            reserved = (*self._reserved_keys, *self._reserved_values)
            self._require_not_stale(reserved, "reserved block")

    def _require_rewrite_private(self, layer: int, start: int, end: int) -> None:
        """``_require_rewritten_private`` of the positions ``start .. end - 1`` that
        ``layer`` had written before a trim of it alone, if any."""
        done = self._rewrites.get(layer, 0)
        if start < done:
            self._require_rewritten_private(start, min(end, done))

    def _require_rewritten_private(self, start: int, end: int) -> None:
        """Before positions ``start .. end - 1``, written by an earlier step, are written
        again: their blocks that the book holds as its own (from ``_maybe_shared`` on; the
        ones below move first, copy-on-write) are not shared behind the book's back, or
        the store would write into a block another owner reads."""
        block_size = self._block_size
        first = max(start // block_size, self._maybe_shared)
        for index in range(first, (end - 1) // block_size + 1):
            self._require_unshared(index, "its positions cannot be written again")

    def _require_last_markable(self, *, rewrites: bool) -> None:
        """Before growth marks the last blocks' fill: they are not shared behind the
        book's back, or the pool would refuse the mark (after a rewrite's moves, were
        there any). Blocks moved first need no look: the last one when a fork may share
        it, and, if the append ``rewrites`` held positions, the last one if it is below
        ``_maybe_shared`` (the rewrite reaches it). Nor does a full last block. Without a
        rewrite, a last block below ``_maybe_shared`` is marked where it is (a trim after
        a fork's growth copied it: private, unless shared behind the back since).
        """
        index = len(self._key_blocks) - 1
        last_key = self._key_blocks[index]
        if (
            self._last_may_be_shared
            or last_key.n_used == self._block_size
            or (rewrites and index < self._maybe_shared)
        ):
            return
        self._require_unshared(index, "growth cannot fill it")

    def _require_unshared(self, index: int, consequence: str) -> None:
        """Refuse if the key or value block at ``index``, which the book holds as its own,
        was shared behind its back (read-only then: ``consequence``)."""
        for block in (self._key_blocks[index], self._value_blocks[index]):
            if self._pool.is_shared(block.block_id):
                raise ValueError(
                    f"block {block!r} of owner {self._owner}'s book is shared behind the "
                    f"book's back (pool.share of its handle), so read-only: {consequence} "
                    "(docs/CONTRACT.md#c-shared-read-only); expected the book's blocks to "
                    "stay its own"
                )

    def _own_rewritten(self, start: int, end: int) -> None:
        """Copy-on-write before an append writes positions ``start .. end - 1``, the first
        of them held (by a layer trimmed alone, while another layer still holds them):
        each held block among them that is shared moves to a private one, all or none."""
        indices = self._rewritten_range(start, end)
        growth = self._blocks_to_check_out(end)
        self._releases.check_out_reclaiming(lambda: self._own_range(indices, growth))
        if indices.stop == self._maybe_shared:
            self._maybe_shared = indices.start  # every block from its first on is now private

    def _rewritten_range(self, start: int, end: int) -> range:
        """Indices of the held blocks, below ``_maybe_shared``, that an append writing
        positions ``start .. end - 1`` (the first of them held) writes again."""
        block_size = self._block_size
        last = min((min(end, self._n_tokens) - 1) // block_size, self._maybe_shared - 1)
        return range(start // block_size, last + 1)

    def _grows_into_shared_last(self) -> bool:
        """Whether growth copies the last blocks first (after a fork, a partly filled last
        block is shared: the growth writes into it)."""
        return (
            self._last_may_be_shared
            and bool(self._key_blocks)
            and self._key_blocks[-1].n_used < self._block_size
        )

    def _own_range(self, indices: range, growth: int) -> None:
        """``_own_blocks`` of every index of ``indices``. The pool is asked first for
        them all and for the ``growth`` blocks per stream the append then checks out, so
        a refusal moves none."""
        self._require_held_live()  # before any exhaustion
        moves = {
            "k": self._n_shared(self._key_blocks, indices),
            "v": self._n_shared(self._value_blocks, indices),
        }
        if moves["k"] or moves["v"]:
            self._check_table()
            demand = {stream: count + growth for stream, count in moves.items()}
            require_supply(self._pool, demand, self._owner, self._format, self._free)
            for index in indices:
                self._own_blocks(index)

    def _own_blocks_kept_by(self, n_tokens: int) -> None:
        """Before a shrink to ``n_tokens`` changes anything: copy-on-write the blocks
        that become the last ones, if their fill changes and they may be shared."""
        if self._trim_marks_last(n_tokens):
            self._own_blocks_reclaiming(-(-n_tokens // self._block_size) - 1)

    def _own_shared_kept_by(self, n_tokens: int) -> None:
        """A trim of one layer that others still hold past: copy-on-write now the blocks
        a shrink to ``n_tokens`` would mark, if they are shared. mlx-lm trims a list layer
        by layer, so the last layer's shrink then needs no block, and a refusal comes at
        the first, with every layer as it was. Private blocks cost no further look."""
        if not self._trim_marks_last(n_tokens):
            return
        index = -(-n_tokens // self._block_size) - 1
        pair = (self._key_blocks[index], self._value_blocks[index])
        if any(self._pool.is_shared(block.block_id) for block in pair):
            self._own_blocks_reclaiming(index)

    def _trim_marks_last(self, n_tokens: int) -> bool:
        """Whether a shrink to ``n_tokens`` positions changes the fill of blocks that
        become the last ones and that may be shared (after a fork): then it moves them."""
        n_kept = -(-n_tokens // self._block_size)
        if not (n_kept and self._shares):
            return False
        last_fill = n_tokens - (n_kept - 1) * self._block_size
        return self._key_blocks[n_kept - 1].n_used != last_fill

    def _own_blocks_reclaiming(self, index: int, growth: int = 0) -> None:
        """``_own_blocks``, with a dropped cache's blocks first, as a checkout has.

        A retry after a collection redoes only what the refusal left undone: a
        block already moved has count 1, and ``make_writable`` returns it as it is.
        """
        self._require_held_live()  # before any exhaustion
        self._check_table()
        self._releases.check_out_reclaiming(lambda: self._own_blocks(index, growth))

    def _own_blocks(self, index: int, growth: int = 0) -> None:
        """Copy-on-write: the key and value blocks at ``index``, if shared, move to
        private ones.

        The caller checked every held handle (``_require_held_live``). The pool is
        asked first whether it can supply a private block of each stream that moves,
        and the ``growth`` blocks per stream the append then checks out, so a refusal
        moves neither. Each move is recorded before
        its data is copied, so the table never holds a handle the pool has made
        stale, even if another thread took the value block after that look.
        """
        pool = self._pool
        pair = (("k", self._key_blocks[index]), ("v", self._value_blocks[index]))
        demand = {stream: int(pool.is_shared(block.block_id)) + growth for stream, block in pair}
        require_supply(pool, demand, self._owner, self._format, self._free)
        if self.before_copy is not None and demand["k"] + demand["v"] > 2 * growth:
            self.before_copy()  # a move follows: the store must be able to copy it
        for stream in ("k", "v"):
            blocks = self._key_blocks if stream == "k" else self._value_blocks
            shared = blocks[index]
            own = pool.make_writable(shared)
            if own is shared:
                continue
            moved = (*blocks[:index], own, *blocks[index + 1 :])
            if stream == "k":
                self._key_blocks = moved
            else:
                self._value_blocks = moved
            self._table_version += 1
            self._copy(shared.block_id, own)

    def _require_held_live(self, indices: Sequence[int] | None = None) -> None:
        """Refuse a step if a key or value block at ``indices`` (every held one if
        ``None``) was freed or moved behind the book's back (its handle is stale): that
        fault is named whatever the pool could supply, so it is checked before any supply
        is. A copy-on-write checks every held block: the store's table check after it
        would refuse a stale one, too late to undo the moves."""
        for index in range(len(self._key_blocks)) if indices is None else indices:
            self._require_not_stale((self._key_blocks[index], self._value_blocks[index]))

    def _require_not_stale(self, blocks: Sequence[Block], label: str = "block") -> None:
        """Refuse if a handle of ``blocks`` is stale (freed or moved behind the book's
        back), naming it as ``label``."""
        for block in blocks:
            if block.owner is None:
                raise stale_block_error(f"{label} {block!r}", self._owner, "book", "book")

    def _check_table(self) -> None:
        if self.before_change is not None:
            self.before_change()

    def _copy(self, old_id: int, own: Block) -> None:
        if self.copy_block is not None:
            self.copy_block(old_id, own)

    def _free(self, blocks: list[Block]) -> None:
        """Free ``blocks`` (keys, then values, each in position order, as they were
        checked out), newest first; keep the owner claimed even if they were its last
        ones."""
        blocks = _newest_first(blocks)
        if self._key_blocks or self._reserved_keys:
            self._pool.free(blocks)
            return
        # The pool releases the owner with its last block; claim it again at once (no
        # other book can claim it in between). If code outside the books took the id
        # in that moment, this book no longer holds anything: it counts as released.
        if not self._releases.free_keeping_claim(self._owner, self._claim, blocks):
            self._abandon()
            raise OwnerAlreadyActiveError(
                f"owner {self._owner} was taken by someone else while the KV cache gave "
                "back its last block; the cache is now released, expected an owner id "
                "used by this cache alone until it is released"
            )

    def _holding(self) -> BookHolding:
        return BookHolding(self._owner, self._claim, tuple(_newest_first(self._all_handles())))

    def _all_handles(self) -> list[Block]:
        """Every handle the book holds, as checked out: keys (positions, then reserved),
        then values."""
        return [
            *self._key_blocks,
            *self._reserved_keys,
            *self._value_blocks,
            *self._reserved_values,
        ]

    def _abandon(self) -> None:
        """Forget every block and count as released (whatever held them was given back)."""
        self._released = True
        self._key_blocks = self._value_blocks = ()
        self._reserved_keys = self._reserved_values = ()
        self._table_version += 1
        self._extent_version += 1
        self._n_tokens = 0
        self._offsets[:] = [0] * len(self._offsets)
        self._rewrites.clear()


def _newest_first(blocks: list[Block]) -> list[Block]:
    """Blocks listed as checked out (keys, then values, each in position order) in the
    order the book gives them back: reversed, so values before keys and each stream's
    last position first. The pool's stacks (C-LIFO) then hand them out again as they
    were, keys first, even from one shared list: ids that ran on ``[f, f + 1, ...]``
    do so again for the next request or growth (which a store reads by slicing:
    block_table.DeviceBlockTable.run_starts)."""
    return blocks[::-1]


_NO_COPIES: Final = (
    "a PooledKVCache cannot be copied: it holds a claim on its owner id and the blocks "
    "checked out to it, which only one object can give back; build a new cache "
    "(PooledKVCache(pool), or make_pool_backed_cache) and copy the positions instead"
)
