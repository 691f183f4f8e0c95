"""Owner claims and deferred release: a book's owner id, from claim to release, even when dropped.

A :class:`~veloxquant_mlx.memory.pooled_kv_cache.PooledKVCache` (the block
table every pool-backed cache list shares) *claims* an owner id of its pool
when it is built and gives the id and its blocks back on ``release()``.
mlx-lm code never calls ``release()``: a request's cache list is simply
dropped when generation ends, so a dropped book must give its blocks back by
itself, from its finaliser. A finaliser runs on whatever thread drops the
last reference or triggers the garbage collector, at any bytecode of that
thread, including one inside the pool's critical section (the pool creates
``Block`` objects under its lock, and any allocation may start a
collection). The pool's lock is plain and non-reentrant, so
a finaliser that called the pool could deadlock its own thread. It takes no
lock at all: it only *queues* what the book held, with
``queue.SimpleQueue.put``, which CPython documents as reentrant (safe in
``__del__``, even if it interrupts another ``put`` or ``get`` of the queue
on the same thread). Ordinary code *drains* the queue later.

What a release frees, and why it is safe when ids are reused. An owner id
is only a number: once a book's blocks were freed behind its back (a server
that ends a request with ``pool.free_all(owner)``), a new request may claim
the same id, and freeing "the owner" would free the new request's blocks.
So a release never frees by owner id:

- blocks are freed *by handle*: the queued (or released) book's own handles,
  those that are still live. A handle is the pool's proof of one checkout
  (CONTRACT.md: a freed handle stays stale for ever), so another request's
  blocks, under the same id or not, are never touched; the pool releases the
  id with the book's last block;
- a book that held its id with no block (built and never appended to, or
  trimmed to nothing) holds only a registration, which has no identity in
  the pool. Each claim therefore records a fresh *claim token* for its id,
  and a bare registration is released only while the id's current token is
  the book's own. Registering an id and releasing a bare registration both
  happen under this module's claim lock, so no claim slips between the check
  and the release.

When the blocks of a dropped book come back (the first of these, on any
thread): the construction of a book on that pool (before it claims its id,
so the id of a dropped request can be reused at once, even while another
thread is still releasing it: the claim finishes that release itself); a
book ``append`` that checks out new blocks (so that a dropped cache's blocks
serve it rather than exhaust the pool); every ``update_and_fetch`` of a
pool-backed cache (:mod:`~veloxquant_mlx.memory.kv_cache`); and
:func:`reclaim_dropped_caches`, the explicit drain. Until then the blocks
count as in use and the id stays claimed. Pool methods and backing stores
never drain: they know nothing of this layer, so a third-party store has
nothing to do for it.

Books dropped inside a reference cycle. Their finaliser runs only when the
garbage collector finds the cycle, which for a cycle that lived through a
few collections means a full collection: CPython runs those rarely, so
without help such blocks could stay in use long enough to exhaust the pool.
So when the pool refuses a book's checkout (new blocks for an append, or
the private block of a copy-on-write: too few free blocks, growth off or
at ``max_blocks``) while another book holds a claim on the pool (so
there may be garbage), the book runs one full collection, drains again and,
if that gave blocks back, tries once more
(:meth:`DeferredReleases.check_out_reclaiming`; a refusal is counted once in
``n_exhausted`` unless it is tried again). Only that
path collects: a checkout the free lists serve never does, a pool that may
grow grows instead, and threads refused at once share one collection. The
refusal that a collection then serves still counts in the pool's
``n_exhausted``; a pool that is truly full pays one collection per refused
append, even where ``gc.disable()`` is in force.

Complexity: ``defer`` O(1); ``drain`` O(1) when nothing is queued, else
O(k) for the k handles of each queued book; ``check_out_reclaiming`` a
drain and the checkout, plus, if the pool refuses it, a full garbage
collection (O(objects alive)), a drain and a second checkout; ``claim`` O(1) plus a drain;
``release_now`` O(k); ``deferred_releases_for`` O(1) (an attribute the pool
keeps for this module, read under a module lock).

Thread safety: ``defer`` takes no lock and may run inside any other call,
including a pool call on the same thread. ``drain`` may run on several
threads at once: each queued book is taken by exactly one of them, and an
exception (``KeyboardInterrupt`` included) that interrupts its release puts
it back on the queue. No lock of this module is ever held by a finaliser or
around a pool call that a finaliser could interrupt with a call back into
this module; the pool's lock is never taken here except through the pool's
public methods. The collection lock is held around ``gc.collect()`` alone:
a second refused thread waits for the first one's collection (whose
finalisers queue their books before it ends) and then skips its own. A
collection that CPython itself is running on another thread at that moment
makes ``gc.collect()`` return at once, so that retry may still be refused.
``deferred_releases_for`` is never called from a finaliser.
"""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
    OwnerAlreadyActiveError,
)

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = [
    "BookHolding",
    "ClaimToken",
    "DeferredReleases",
    "deferred_releases_for",
    "reclaim_dropped_caches",
]

#: What a book's checkout returns (:meth:`DeferredReleases.check_out_reclaiming`).
CheckedOut = TypeVar("CheckedOut")


class ClaimToken:
    """One claim of an owner id by one book: compared by identity, never equal to another."""

    __slots__ = ()


@dataclass(frozen=True)
class BookHolding:
    """What a book holds: its owner id, its claim of the id and its block handles.

    Queued when the book is dropped unreleased; handed to
    :meth:`DeferredReleases.release_now` by ``release()``.
    """

    owner: int
    claim: ClaimToken
    handles: tuple[Block, ...]


class DeferredReleases:
    """The owner claims of one pool's books, and the books dropped while holding them.

    Invariants:

    - ``claims[owner]`` is the token of the last book that claimed ``owner`` and has
      not released it (released, or dropped and drained, removes it; a later claim
      of the id replaces it);
    - every queued or in-flight :class:`BookHolding` leaves the queue exactly once,
      through a drain, which releases it (or, interrupted, puts it back);
    - a release frees only the book's own handles that are still live, and releases
      a bare registration only while ``claims[owner]`` is the book's token.
    """

    def __init__(self, pool: BlockPoolAllocator) -> None:
        # Strong: the pool holds this object too (deferred_releases_for); the cycle is
        # the garbage collector's, as a compiled pool cannot be weakly referenced.
        self._pool: Final = pool
        # Books dropped unreleased, queued by finalisers; SimpleQueue: put() is reentrant.
        self._dropped: Final[queue.SimpleQueue[BookHolding]] = queue.SimpleQueue()
        # Guards claims and in_flight; held for a few dict operations, never around a
        # pool call (so the schedule explorers' threads can never block on it).
        self._guard: Final = threading.Lock()
        # Held while an id is registered for a claim and while a bare registration is
        # released: no claim happens between a release's check and its release.
        self._claim_lock: Final = threading.Lock()
        # Owner id -> token of the book that claims it (module docstring).
        self._claims: Final[dict[int, ClaimToken]] = {}
        # Dropped books a drain took off the queue and has not finished releasing.
        self._in_flight: Final[list[BookHolding]] = []
        # Dropped books drains have finished with, ever (under the guard): whether any
        # came back while a checkout was refused, without asking the pool.
        self._n_drained = 0
        # Held around gc.collect() alone (module docstring: books dropped in a cycle).
        self._collect_lock: Final = threading.Lock()

    # -- claims --------------------------------------------------------------------------

    def claim(self, owner: int) -> ClaimToken:
        """Register ``owner`` for a new book (after a drain); return the book's token.

        If ``owner`` is still held by a dropped book (queued, or being released by
        another thread right now), this call finishes that release and claims it.

        Raises:
            OwnerAlreadyActiveError: ``owner`` holds blocks or is registered (not
                by a dropped book).
        """
        pool = self._pool
        self.drain()
        try:
            return self._register(pool, owner)
        except OwnerAlreadyActiveError:
            pass
        # Held: by a book dropped since that drain, by one another thread is releasing
        # (finish it here), or by a live book (then the second try raises).
        self.drain()
        in_flight = self._in_flight_for(owner)
        if in_flight is not None:
            self._release(pool, in_flight)
        return self._register(pool, owner)

    def claim_first_unused(self, candidates: Iterator[int]) -> tuple[int, ClaimToken]:
        """Claim the first id of ``candidates`` that is not active (after a drain)."""
        pool = self._pool
        self.drain()
        for owner in candidates:
            try:
                return owner, self._register(pool, owner)
            except OwnerAlreadyActiveError:
                continue
        raise ValueError("candidates ran out before an unused owner id was found")

    def free_keeping_claim(self, owner: int, claim: ClaimToken, blocks: list[Block]) -> bool:
        """Free a book's *last* blocks and register its id again at once.

        The pool releases an owner with its last block; under the claim lock no
        other book can claim the id in between. Code outside the books can
        (``pool.register_owner``, ``pool.allocate``): then the claim is dropped and
        this returns ``False``; the book must count itself released.

        Raises:
            InvalidFreeError: As ``pool.free``; nothing changes.
        """
        pool = self._pool
        with self._claim_lock:
            pool.free(blocks)
            try:
                pool.register_owner(owner)
            except OwnerAlreadyActiveError:
                self._forget(owner, claim)
                return False
        return True

    def release_now(self, book: BookHolding) -> None:
        """Release what ``book`` holds, as a drain would: its live handles, and its bare
        registration while its claim is current. For ``release()``."""
        self._release(self._pool, book)

    # -- dropped books -------------------------------------------------------------------

    def defer(self, book: BookHolding) -> None:
        """Queue ``book`` for release. Safe in a finaliser: takes no lock, never raises."""
        self._dropped.put(book)

    def drain(self) -> int:
        """Release every queued book. Never call it from a finaliser.

        Books that another thread's drain took are released there (a claim of one
        of their ids finishes that release itself: see :meth:`claim`).

        Returns:
            How many dropped books this call released (a book whose blocks were
            freed and whose claim was replaced behind its back counts as none).
        """
        if self._dropped.empty():  # the hot path: one O(1) check
            return 0
        released = 0
        while (book := self._take()) is not None:
            try:
                released += self._release(self._pool, book)
            except BaseException:
                self._dropped.put(book)  # interrupted: the next drain releases it
                raise
            finally:
                with self._guard:
                    self._in_flight.remove(book)
                    self._n_drained += 1
        return released

    def check_out_reclaiming(self, check_out: Callable[[], CheckedOut]) -> CheckedOut:
        """Drain, then run ``check_out`` (a book taking blocks); if the pool refuses it
        while another book held a claim, collect garbage, drain, and if any dropped
        book came back since the checkout began (by this collection, or another
        thread's drain), run it once more.

        A book dropped inside a reference cycle is queued only when the garbage
        collector finds it (module docstring). Never call it from a finaliser. A
        refusal no dropped book came back for is not tried again, so the pool counts
        it once in ``n_exhausted``. No pool call is added to a checkout.

        Raises:
            BlockPoolExhaustedError: Refused again after the collection, refused with
                no other book to collect, or refused with no block given back.
        """
        self.drain()
        # Snapshots without the guard, on purpose: they only decide whether to try again.
        # The count is read before the checkout, so that books another thread's
        # collection gave back after this refusal still count as given back.
        drained = self._n_drained if len(self._claims) > 1 else None
        try:
            return check_out()
        except BlockPoolExhaustedError:
            if drained is None:  # no other book held a claim: nothing to collect
                raise
            self._collect_garbage()
            self.drain()
            if self._n_drained == drained:
                raise
        return check_out()

    # -- internals -----------------------------------------------------------------------

    def _collect_garbage(self) -> None:
        """One full collection, unless one finished while this thread waited its turn."""
        full_collections = gc.get_stats()[2]["collections"]
        with self._collect_lock:
            if gc.get_stats()[2]["collections"] == full_collections:
                gc.collect()

    def _register(self, pool: BlockPoolAllocator, owner: int) -> ClaimToken:
        with self._claim_lock:
            pool.register_owner(owner)
            claim = ClaimToken()
            with self._guard:
                self._claims[owner] = claim
        return claim

    def _forget(self, owner: int, claim: ClaimToken) -> bool:
        """Drop ``owner``'s claim if it is still ``claim``; whether it was."""
        with self._guard:
            current = self._claims.get(owner) is claim
            if current:
                del self._claims[owner]
        return current

    def _take(self) -> BookHolding | None:
        """The next queued book, recorded as in flight in the same step."""
        with self._guard:
            try:
                book = self._dropped.get_nowait()
            except queue.Empty:
                return None
            self._in_flight.append(book)
        return book

    def _in_flight_for(self, owner: int) -> BookHolding | None:
        with self._guard:
            return next((book for book in self._in_flight if book.owner == owner), None)

    def _release(self, pool: BlockPoolAllocator, book: BookHolding) -> int:
        """Free the book's live handles; release its bare registration if its claim is
        current. Idempotent, and safe on several threads at once. 1 if it did either."""
        if book.handles:
            freed = _free_live(pool, book.handles)
            return int(self._forget(book.owner, book.claim) or freed)
        with self._claim_lock:
            current = self._forget(book.owner, book.claim)
            if current:
                pool.release_owner(book.owner)
        return int(current)


def _free_live(pool: BlockPoolAllocator, handles: tuple[Block, ...]) -> bool:
    """Free those of ``handles`` that are live; whether any was.

    ``pool.free`` is all or nothing: if another thread freed one of them between
    the look and the free, look again (handles only ever go stale, so this ends).
    """
    while True:
        live = list(handles) if pool.all_live(handles) else [h for h in handles if pool.is_live(h)]
        if not live:
            return False
        try:
            pool.free(live)
        except InvalidFreeError:
            continue
        return True


#: Serialises the first look-up of a pool, so that its books share one registry.
_RELEASES_LOCK: Final = threading.Lock()


def deferred_releases_for(pool: CheckedBlockPool[Block]) -> DeferredReleases:
    """The owner claims and dropped books of ``pool``, shared by every book on it.

    Called when a book or a cache is built, never from a finaliser (it takes a lock).

    Raises:
        TypeError: ``pool`` is not a ``BlockPoolAllocator`` (the registry lives in it).
    """
    if not isinstance(pool, BlockPoolAllocator):
        raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
    with _RELEASES_LOCK:
        releases = pool._deferred_releases  # the slot the pool keeps for us
        if not isinstance(releases, DeferredReleases):
            releases = DeferredReleases(pool)
            pool._deferred_releases = releases
        return releases


def reclaim_dropped_caches(pool: BlockPoolAllocator) -> int:
    """Return to ``pool`` the blocks of every cache dropped without ``release()`` so far.

    Books and pool-backed caches do this on their own (module docstring); call
    it where none is due, e.g. before reading ``pool.stats``. A dropped cache
    that another thread is releasing at this moment comes back when that
    thread's call returns.

    Returns:
        How many dropped caches were released by this call.

    Raises:
        TypeError: ``pool`` is not a ``BlockPoolAllocator``.
    """
    if not isinstance(pool, BlockPoolAllocator):
        raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
    return deferred_releases_for(pool).drain()
