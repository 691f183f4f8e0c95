"""Fixed-size block allocator for KV-cache storage, in the vLLM/PagedAttention style.

``BlockPoolAllocator`` keeps the books of a pool of fixed-size blocks: which
block ids are free (per stream), which owner (request) holds which, how full
each is, and running statistics. It holds no array data: a backing store
(``MLXBlockStorage``, or any port of the storage protocol) owns the buffers,
indexed by block id. The behaviour is that of the API reference
(``docs/API.md``) with the gaps closed by the project's contract
(``docs/CONTRACT.md``); the executable spec in ``spec/`` states the same rules as
a pure state machine, and the conformance tests check this module against it.

Complexity (``k`` = blocks in the call, ``f`` = free blocks of the stream,
``n`` = blocks ever issued); no operation scans the pool but the checker,
``shrink`` and ``ref_count`` of an unshared id:

- ``allocate``: O(k) amortised, growth included.
- ``free``: O(k); ``free_all``: O(k) for the owner's k blocks.
- ``share``, ``fork``: O(k); ``make_writable``: O(1) amortised; ``is_shared``:
  O(1); ``ref_count``: O(1) for a shared id, O(f) otherwise.
- ``mark_used``, ``n_free``, ``register_owner``, ``release_owner``, ``stats``,
  ``is_live``, ``id_bound``, ``AllocationStats.blocks_in_use`` /
  ``fragmentation``: O(1).
- ``blocks_for``, ``all_live``: O(k).  ``history``: O(history_len).
- ``shrink``: O(f log f), plus O(r) to lower ``id_bound`` over a retired tail.
- ``check_invariants``: O(n), for tests and stress runs only.

Thread safety: every public method of ``BlockPoolAllocator`` that reads or
writes pool state holds one plain, non-reentrant lock with ``threading.Lock``'s
semantics (``librt.threading.Lock``, or ``threading.Lock`` where librt is
not installed; see ``_PoolLock``) for its whole critical section, and no callback
runs under it (save the methods of a value kept as given: docs/CONTRACT.md,
C-THREAD-SAFE). ``Block``, ``AllocationStats`` and ``PoolConfig`` objects
are not locked: a stats object returned to a caller is a private snapshot, and
a ``Block`` handle belongs to the owner it was checked out to.

This module imports no MLX, so a port to another backend can use the
allocator and its spec alone.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Final, TypeAlias, TypeGuard, TypeVar

from veloxquant_mlx.memory import _prometheus
from veloxquant_mlx.memory._arguments import (
    require_bool,
    require_format,
    require_int,
    resolve_stream,
)
from veloxquant_mlx.memory._history import StatsHistory
from veloxquant_mlx.memory._mypyc import AsGiven, mypyc_attr

# The pool's lock: mypyc's run-time library's lock (librt) where it is installed,
# else threading.Lock; the same acquire/release/locked semantics (not reentrant,
# any thread may release it, a waiting thread lets the GIL go and runs signal
# handlers; its acquire takes no timeout, which the pool never uses). Compiled,
# mypyc calls its acquire and release directly: per callgrind about 580
# instructions fewer per locked call than threading.Lock, whose 3.11 acquire parses
# its arguments as keywords; so a compiled wheel requires librt. Interpreted it is
# cheaper too (about 27 against 70 ns an acquire and release here), but a pure
# wheel does not require it (librt has no wheel for a free-threaded 3.13):
# build_backend.install_requirements.
try:
    from librt.threading import Lock as _PoolLock
except ImportError:
    from threading import Lock as _PoolLock  # type: ignore[assignment]  # the same interface

__all__ = [
    "COMPILED",
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

#: Free-list names by stream name, for each value of ``PoolConfig.separate_kv``.
_SEPARATE_STREAMS: Final = {"k": "k", "v": "v"}
_SHARED_STREAMS: Final = {"k": "kv", "v": "kv", "kv": "kv"}
#: Why ``_first_unfreeable`` refused an item: not a live handle of this pool; a
#: second handle of one block id where each id may be listed once (``share``); the
#: same handle listed twice (``free``).
_NOT_LIVE: Final = "not live"
_REPEATED_ID: Final = "repeated id"
_LISTED_TWICE: Final = "listed twice"
#: An item of a caller's list of blocks (a ``Block``, or anything, before it is checked).
_Item = TypeVar("_Item")

DEFAULT_HISTORY_LEN: Final = 1024
#: Length of an interpreted history entry of a pool that has never shared
#: (``AllocationStats._counters``): nine fields and the blocks in use.
_REFERENCE_COUNTERS: Final = 10

#: Whether this module runs compiled by mypyc (``pip install .`` where a C compiler
#: was found) rather than interpreted (the editable install, or no compiler).
COMPILED: Final[bool] = __file__.endswith(tuple(EXTENSION_SUFFIXES))

#: A block id on its way through the free lists, owner maps and handles: an ``int``,
#: kept boxed by mypyc (see ``AsGiven``), so that moving one allocates nothing.
BlockId: TypeAlias = AsGiven[int]


@mypyc_attr(native_class=False)
class BlockPoolError(RuntimeError):
    """Base class of every error the block pool raises on purpose."""


@mypyc_attr(native_class=False)
class BlockPoolExhaustedError(BlockPoolError):
    """An allocation needs more free blocks than the stream has or may grow to."""


@mypyc_attr(native_class=False)
class OwnerAlreadyActiveError(BlockPoolError):
    """``register_owner()`` was called for an owner that is already active."""


@mypyc_attr(native_class=False)
class InvalidFreeError(BlockPoolError, ValueError):
    """``free()`` got something that is not a live handle of this pool, or one twice."""


@mypyc_attr(native_class=False)
class InvariantViolationError(AssertionError):
    """``check_invariants()`` found the pool's books inconsistent; names the invariant."""


#: ``mark_used``'s refusal of a block that has an owner but is no live handle of the pool
#: (any other refusal is a shared block's reference count, >= 2).
_NOT_A_HANDLE: Final = -1


def _mark_used_refusal(block: Block, refusal: int) -> ValueError:
    """The error of ``mark_used`` refusing ``block``: :data:`_NOT_A_HANDLE`, or the
    reference count of a shared, so read-only, block."""
    if refusal == _NOT_A_HANDLE:
        return ValueError(
            f"block {block!r} has an owner but is not a live handle of this pool; "
            "expected a block checked out from this pool"
        )
    return ValueError(
        f"block {block!r} is shared (reference count {refusal}) and so read-only; "
        "expected a block with count 1: call make_writable(block) first"
    )


def _require_block_id(block_id: AsGiven[int]) -> AsGiven[int]:
    """``block_id`` if it is an ``int >= 0`` (``require_int``'s errors otherwise), as a
    plain ``int``: an ``int`` subclass's own ``__hash__``, ``__eq__``, ``__lt__`` or
    ``__int__`` are caller code, which must never run under the lock nor stand in for
    its value, so its value is read and checked again."""
    require_int("block_id", block_id, minimum=0)
    if type(block_id) is int:
        return block_id
    plain = int.__int__(block_id)
    if plain < 0:
        raise ValueError(f"block_id must be an int >= 0, got {plain!r}")
    return plain


def _items_of(blocks: Iterable[_Item]) -> Sequence[_Item]:
    """``blocks`` itself if an exact list or tuple, else a tuple of its items.

    Iterating anything else (a subclass, a generator) may run the caller's
    code, which must never run under the pool's lock (C-THREAD-SAFE): call
    this before taking it.
    """
    if type(blocks) is list or type(blocks) is tuple:
        return blocks
    try:  # all_live's; free and share checked the type
        items = iter(blocks)
    except TypeError:
        raise TypeError(
            f"blocks must be an iterable of Block handles, got {type(blocks).__name__}: {blocks!r}"
        ) from None
    return tuple(items)


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Configuration of a :class:`BlockPoolAllocator`; validated on construction.

    Frozen, because the pool relies on it never changing after validation.

    Attributes:
        block_size: Token slots per block, ``>= 1``.
        n_blocks: Blocks the pool manages initially, ``>= 0``. With
            ``separate_kv`` stream ``"k"`` gets ids ``0 .. ceil(n/2) - 1`` and
            ``"v"`` the rest.
        separate_kv: Keys and values on independent free lists (``"k"``,
            ``"v"``) if true, else one shared list (``"kv"``).
        grow_on_exhaustion: Grow the exhausted stream just enough instead of
            raising :class:`BlockPoolExhaustedError`.
        max_blocks: Cap on the pool's total once grown, ``>= n_blocks``;
            ``None`` is unbounded. Ignored when not growing.
    """

    # AsGiven: mypyc must not convert or refuse a value before __post_init__ checks it.
    block_size: AsGiven[int] = 16
    n_blocks: AsGiven[int] = 1024
    separate_kv: AsGiven[bool] = True
    grow_on_exhaustion: AsGiven[bool] = False
    max_blocks: AsGiven[int | None] = None

    def __post_init__(self) -> None:
        block_size = _as_given(self, "block_size")
        n_blocks = _as_given(self, "n_blocks")
        max_blocks = _as_given(self, "max_blocks")
        require_int("block_size", block_size)
        require_int("n_blocks", n_blocks)
        require_bool("separate_kv", _as_given(self, "separate_kv"))
        grow_on_exhaustion = require_bool(
            "grow_on_exhaustion", _as_given(self, "grow_on_exhaustion")
        )
        if max_blocks is not None:
            require_int("max_blocks", max_blocks)
        require_int("block_size", block_size, minimum=1)
        minimum_cap = require_int("n_blocks", n_blocks, minimum=0)
        if grow_on_exhaustion and max_blocks is not None:
            require_int("max_blocks", max_blocks, minimum=minimum_cap)


# Never acyclic=True here or on AllocationStats: mypyc's deallocator still enters
# CPython's trashcan, which at 50 nested deallocations links the object through a
# garbage-collector header that an acyclic instance lacks, writing into the heap
# in front of it (tests/test_deep_deallocation.py).
@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True, eq=False, init=False)
class Block:
    """A handle of one fixed-size block of KV-cache storage, for one checkout.

    Every checkout creates a new handle; once its block is freed the handle is
    stale (``owner is None``, ``n_used == 0``) even if the same ``block_id`` is
    later handed out again. Handles compare by identity: two checkouts of one
    block id are different handles. Write no field directly; use
    :meth:`BlockPoolAllocator.mark_used` to change a fill level.

    Attributes:
        block_id: Index into the backing storage; stable for the pool's life.
        stream: ``"k"`` or ``"v"``, or ``"kv"`` in a pool with one shared list.
        format: Compression-format tag of the data stored (``"fp16"``, ``"int4"``...).
        n_used: Token slots occupied, ``0 <= n_used <= block_size``.
        owner: Request id the block is checked out to; ``None`` once free.
        ever_allocated: Whether this block id had been handed out by
            ``allocate()`` (true on every handle ``allocate()`` returns).
    """

    # AsGiven, and no defaults here (they are __init__'s): compiled by mypyc, a
    # field then holds and reads back whatever it was given, as in Python, so a
    # handle built by hand reaches the contract's checks unconverted.
    block_id: AsGiven[int]
    stream: AsGiven[str]
    format: AsGiven[str]
    n_used: AsGiven[int]
    owner: AsGiven[int | None]
    ever_allocated: AsGiven[bool]

    # Written out rather than generated by @dataclass: mypyc compiles a written
    # __init__ (a generated one stays interpreted) and every checkout calls it.
    def __init__(  # noqa: PLR0917 (the reference's positional signature)
        self,
        block_id: AsGiven[int],
        stream: AsGiven[str] = "kv",
        format: AsGiven[str] = "fp16",
        n_used: AsGiven[int] = 0,
        owner: AsGiven[int | None] = None,
        ever_allocated: AsGiven[bool] = False,
    ) -> None:
        self.block_id = block_id
        self.stream = stream
        self.format = format
        self.n_used = n_used
        self.owner = owner
        self.ever_allocated = ever_allocated


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True, init=False)
class AllocationStats:
    """Running counters of a :class:`BlockPoolAllocator`, cumulative since construction.

    Invariants (for the allocator's live object; ``check_invariants`` verifies them):
    ``n_blocks == initial + n_grown - n_retired``; ``0 <= blocks_in_use() <=
    n_blocks``; ``_fragmented_count <= blocks_in_use() <= peak_blocks_in_use``.

    Attributes:
        n_blocks: Current total of blocks managed by the pool.
        n_allocations: Successful ``allocate()`` calls.
        n_frees: ``free()`` and ``free_all()`` calls that released at least one
            live handle (freed a block, unless the pool shares it: C-FREE-SHARED).
        n_reused: Blocks handed out whose id had been handed out before.
        n_exhausted: ``allocate()`` and ``make_writable()`` calls refused for lack of
            blocks.
        n_grown: Blocks created by exhaustion-triggered growth.
        n_retired: Blocks removed from the pool by ``shrink()``.
        peak_blocks_in_use: High-water mark of blocks checked out at once.
        _fragmented_count: Checked-out blocks with ``0 < n_used < block_size``.
        n_shares: Handles issued by ``share()`` and ``fork()`` (keyword only).
        n_copy_on_write: ``make_writable()`` calls that moved a handle (keyword only).

    A block held through several handles counts once in ``blocks_in_use()``,
    ``_fragmented_count`` and ``shared_blocks()`` (docs/CONTRACT.md#sharing).
    """

    n_blocks: int
    n_allocations: int
    n_frees: int
    n_reused: int
    n_exhausted: int
    n_grown: int
    n_retired: int
    peak_blocks_in_use: int
    _fragmented_count: int
    # Sharing's counters, read through the properties of the same names (kept by the pool).
    _n_shares: int
    _n_copy_on_write: int
    # Kept by the allocator only, so that blocks_in_use() is O(1).
    _blocks_in_use: int = field(init=False, repr=False)
    # Kept by the allocator only: checked-out ids with a reference count above 1.
    _shared_blocks: int = field(init=False, repr=False)

    # Written out for mypyc, as Block's: every stats read and history entry calls it.
    def __init__(  # noqa: PLR0917 (the reference's positional signature)
        self,
        n_blocks: int,
        n_allocations: int = 0,
        n_frees: int = 0,
        n_reused: int = 0,
        n_exhausted: int = 0,
        n_grown: int = 0,
        n_retired: int = 0,
        peak_blocks_in_use: int = 0,
        _fragmented_count: int = 0,
        *,
        n_shares: int = 0,
        n_copy_on_write: int = 0,
    ) -> None:
        self.n_blocks = n_blocks
        self.n_allocations = n_allocations
        self.n_frees = n_frees
        self.n_reused = n_reused
        self.n_exhausted = n_exhausted
        self.n_grown = n_grown
        self.n_retired = n_retired
        self.peak_blocks_in_use = peak_blocks_in_use
        self._fragmented_count = _fragmented_count
        self._n_shares = n_shares
        self._n_copy_on_write = n_copy_on_write
        self._blocks_in_use = 0
        self._shared_blocks = 0

    def blocks_in_use(self) -> int:
        """Number of blocks currently checked out, between 0 and ``n_blocks``."""
        return self._blocks_in_use

    @property
    def n_shares(self) -> int:
        """Handles issued by ``share()`` and ``fork()``."""
        return self._n_shares

    @property
    def n_copy_on_write(self) -> int:
        """``make_writable()`` calls that moved a handle to a new block."""
        return self._n_copy_on_write

    def shared_blocks(self) -> int:
        """Number of blocks checked out with a reference count above 1, between 0 and
        ``blocks_in_use()``."""
        return self._shared_blocks

    def fragmentation(self) -> float:
        """Fraction of managed blocks that are checked out but neither empty nor full.

        Between 0.0 and 1.0; 0.0 for a pool with no blocks.
        """
        if self.n_blocks == 0:
            return 0.0
        return self._fragmented_count / self.n_blocks

    def snapshot(self) -> AllocationStats:
        """Return an independent copy of these stats, for history or export."""
        copy = AllocationStats(
            self.n_blocks,
            self.n_allocations,
            self.n_frees,
            self.n_reused,
            self.n_exhausted,
            self.n_grown,
            self.n_retired,
            self.peak_blocks_in_use,
            self._fragmented_count,
            n_shares=self.n_shares,
            n_copy_on_write=self.n_copy_on_write,
        )
        copy._blocks_in_use = self._blocks_in_use
        copy._shared_blocks = self._shared_blocks
        return copy

    def _copy_from(self, other: AllocationStats) -> None:
        """Overwrite every field with ``other``'s (a compiled history reuses its entries)."""
        self.n_blocks = other.n_blocks
        self.n_allocations = other.n_allocations
        self.n_frees = other.n_frees
        self.n_reused = other.n_reused
        self.n_exhausted = other.n_exhausted
        self.n_grown = other.n_grown
        self.n_retired = other.n_retired
        self.peak_blocks_in_use = other.peak_blocks_in_use
        self._fragmented_count = other._fragmented_count
        self._n_shares = other._n_shares
        self._n_copy_on_write = other._n_copy_on_write
        self._blocks_in_use = other._blocks_in_use
        self._shared_blocks = other._shared_blocks

    def to_prometheus(self, prefix: AsGiven[str] = "veloxquant_block_pool") -> str:
        """Render these stats as Prometheus text-exposition gauges and counters.

        Args:
            prefix: Metric name prefix; must be a valid Prometheus metric name.

        Returns:
            Newline-terminated exposition text, ready for a ``/metrics`` response.

        Raises:
            ValueError: ``prefix`` is not a valid metric name; a count is negative, or
                more blocks are partly filled than there are (stats built by hand).
            TypeError: A count is not an ``int`` (a ``bool`` included), so its sample
                would not parse.
        """
        prefix = _prometheus.require_metric_prefix(prefix)
        self._require_counts()
        return _prometheus.render(prefix, self._metrics())

    def _require_counts(self) -> None:
        """Refuse stats whose fields are not counts before rendering them: the pool
        keeps them so, but stats built by hand (say, summed over pools) may not be."""
        counts = {
            "n_blocks": self.n_blocks,
            "n_allocations": self.n_allocations,
            "n_frees": self.n_frees,
            "n_reused": self.n_reused,
            "n_exhausted": self.n_exhausted,
            "n_grown": self.n_grown,
            "n_retired": self.n_retired,
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "_fragmented_count": self._fragmented_count,
            "n_shares": self._n_shares,
            "n_copy_on_write": self._n_copy_on_write,
        }
        for name, value in counts.items():
            require_int(f"AllocationStats.{name}", value, minimum=0)
        if self._fragmented_count > self.n_blocks:
            raise ValueError(
                f"AllocationStats._fragmented_count must be at most n_blocks "
                f"({self.n_blocks}), got {self._fragmented_count}: a fragmentation "
                "ratio is between 0.0 and 1.0"
            )

    def _metrics(self) -> list[_prometheus.Metric]:
        metrics = self._reference_metrics()
        if self.n_shares:  # a pool that never shared shows exactly the reference's ten
            metrics += self._sharing_metrics()
        return metrics

    def _sharing_metrics(self) -> list[_prometheus.Metric]:
        metric = _prometheus.Metric
        return [
            metric(
                "shared_blocks",
                "gauge",
                "Blocks checked out to more than one owner.",
                self.shared_blocks(),
            ),
            metric("shares", "counter", "Handles issued by share and fork.", self.n_shares),
            metric(
                "copy_on_write",
                "counter",
                "make_writable calls that moved a handle to a new block.",
                self.n_copy_on_write,
            ),
        ]

    def _reference_metrics(self) -> list[_prometheus.Metric]:
        metric = _prometheus.Metric
        return [
            metric("blocks", "gauge", "Blocks managed by the pool.", self.n_blocks),
            metric("blocks_in_use", "gauge", "Blocks checked out.", self.blocks_in_use()),
            metric(
                "peak_blocks_in_use",
                "gauge",
                "High-water mark of blocks checked out.",
                self.peak_blocks_in_use,
            ),
            metric(
                "fragmentation_ratio",
                "gauge",
                "Fraction of blocks checked out but partly filled.",
                self.fragmentation(),
            ),
            metric("allocations", "counter", "Successful allocate calls.", self.n_allocations),
            metric(
                "frees",
                "counter",
                "free and free_all calls that released a block handle.",
                self.n_frees,
            ),
            metric("reused", "counter", "Blocks handed out again after a free.", self.n_reused),
            metric(
                "exhausted",
                "counter",
                "allocate and make_writable calls refused for lack of blocks.",
                self.n_exhausted,
            ),
            metric("grown", "counter", "Blocks created by growth on exhaustion.", self.n_grown),
            metric("retired", "counter", "Blocks retired by shrink.", self.n_retired),
        ]

    def _counters(self) -> tuple[int, ...]:
        """Every counter, as interpreted history keeps it: the fields in declaration
        order and ``_blocks_in_use``, then sharing's three once the pool has shared.

        Until the first share ``n_shares`` is 0 and so are ``n_copy_on_write`` and
        ``_shared_blocks`` (a copy or a shared block needs a share first), so the
        short form loses nothing and a pool that never shares pays for no more than
        it did before sharing existed; ``_from_counters`` puts the zeros back.
        """
        counters = (
            self.n_blocks,
            self.n_allocations,
            self.n_frees,
            self.n_reused,
            self.n_exhausted,
            self.n_grown,
            self.n_retired,
            self.peak_blocks_in_use,
            self._fragmented_count,
            self._blocks_in_use,
        )
        if self._n_shares:
            return (*counters, self._n_shares, self._n_copy_on_write, self._shared_blocks)
        return counters

    @staticmethod
    def _from_counters(counters: tuple[int, ...]) -> AllocationStats:
        """The stats ``_counters()`` returned ``counters`` for, in either form."""
        stats = AllocationStats(*counters[:9])
        stats._blocks_in_use = counters[9]
        if len(counters) > _REFERENCE_COUNTERS:
            stats._n_shares, stats._n_copy_on_write, stats._shared_blocks = counters[10:]
        return stats


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPoolAllocator:
    """Thread-safe bookkeeping for a pool of fixed-size KV-cache blocks.

    Pre-allocates ``config.n_blocks`` block ids and hands them out per owner
    and stream; freed blocks go back on their stream's free list, a stack
    (LIFO: a just-freed block is cache-hot). With growth on, an exhausted
    stream grows by exactly the missing blocks; ``shrink`` retires free
    blocks. Ids stay dense: growth re-issues the lowest retired ids first.

    Invariants (``check_invariants`` verifies each and names the one broken):

    - *partition*: every id below ``_next_new_id`` is in exactly one of: one
      stream's free list, the owners' block maps (one, or several if shared),
      the retired set.
    - *handles*: each owner's map holds, per id, that owner's one live handle
      of that id; the handle names that owner, that id, a stream of this pool, and
      ``0 <= n_used <= block_size``. Every owner map is non-empty.
    - *counters*: ``n_blocks`` equals free + checked out, and initial +
      grown - retired; ``blocks_in_use`` and ``_fragmented_count`` equal a
      recount; ``peak_blocks_in_use >= blocks_in_use``.
    - *ever_allocated*: every checked-out id is marked ever allocated.
    - *retired*: the retired heap and set hold the same ids, in heap order.
    - *id bound*: ``id_bound()`` is one more than the highest id that is free
      or checked out.
    - *refcount*: an id held by several owners (``share``, ``fork``) has its
      count, the number of its live handles, in ``_shared_counts`` (and only
      such ids are there); its handles show the same stream, format and
      fill; ``shared_blocks()`` is the number of such ids. A shared block is
      read-only and goes back to its free list with its last handle.

    Example::

        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
        blocks = pool.allocate(stream="k", n_tokens=40, owner=request_id, format="int2")
        ...
        pool.free_all(owner=request_id)
    """

    def __init__(
        self,
        config: AsGiven[PoolConfig | None] = None,
        *,
        history_len: AsGiven[int] = DEFAULT_HISTORY_LEN,
    ) -> None:
        """Build a pool with every initial block free.

        Args:
            config: Pool sizing and behaviour; ``PoolConfig()`` if ``None``.
            history_len: How many stats snapshots ``history`` keeps; 0 disables it.

        Raises:
            TypeError: ``config`` is not a ``PoolConfig``, or ``history_len`` not an int.
            ValueError: ``history_len`` is negative.
            MemoryError: The initial ids or the history do not fit in this process
                (C-GROW-MEMORY).
        """
        if config is None:
            config = PoolConfig()
        if not isinstance(config, PoolConfig):
            raise TypeError(f"config must be a PoolConfig or None, got {config!r}")
        history_len = require_int("history_len", history_len, minimum=0)
        try:  # what may not fit, built first
            free_lists = _initial_free_lists(config)
            ever_allocated = [False] * config.n_blocks
            history = StatsHistory(history_len)
        except (MemoryError, OverflowError):
            raise MemoryError(
                f"a pool of n_blocks={config.n_blocks} with history_len={history_len} is "
                "more than this process can hold"
            ) from None
        self._config: Final = config
        self._block_size: Final[int] = config.block_size
        self._lock: Final = _PoolLock()
        # Stream name accepted from callers -> name of the free list serving it.
        self._stream_names: Final = _SEPARATE_STREAMS if config.separate_kv else _SHARED_STREAMS
        # Per free list, a stack of block ids: the top (next handed out) is the end.
        self._free_lists: Final = free_lists
        # Stream name accepted from callers -> its free list's name and that list, so that
        # allocate finds both in one lookup.
        self._free_list_routes: Final = {
            stream: (name, self._free_lists[name]) for stream, name in self._stream_names.items()
        }
        # Owner -> {block_id: live handle}, in allocation order; never empty.
        self._owner_blocks: Final[dict[int, dict[BlockId, Block]]] = {}
        # Block id -> reference count, for shared ids only (count >= 2): a checked-out
        # id not in it has one handle. Empty in a pool that never shares, which is
        # what keeps allocate and free as fast as before sharing existed.
        self._shared_counts: Final[dict[BlockId, int]] = {}
        # Owners registered by register_owner() and not released since.
        self._registered_owners: Final[set[int]] = set()
        # Min-heap of retired ids, re-issued lowest first by growth.
        self._retired_ids: Final[list[BlockId]] = []
        # The same ids as a set, to find the retired tail of the id range.
        self._retired_set: Final[set[int]] = set()
        # 1 + the highest id that is free or checked out: what a slab must cover.
        self._id_bound: int = config.n_blocks
        # Every id below this has been issued at some point.
        self._next_new_id: int = config.n_blocks
        # Per id ever issued: True once handed out by allocate(), reset when re-issued by
        # growth. A list, not a bytearray: compiled, a list is indexed by a native int
        # without boxing it (the checkout loop's costliest step), for 8 bytes an id.
        self._ever_allocated: Final[list[bool]] = ever_allocated
        # The live counters; callers only ever see snapshots.
        self._stats: Final = AllocationStats(n_blocks=config.n_blocks)
        # The stats after each counted call; recorded by the build's cheapest means.
        self._history: Final = history
        self._history_on: Final = history_len > 0
        # Bound push of each free list (stable: free lists are only ever changed in place).
        self._push_onto: Final = {name: ids.append for name, ids in self._free_lists.items()}
        # Kept here for the cache layer (memory/deferred_release.py), never read by the
        # pool: a compiled pool takes no weak references, so no registry can key on it.
        self._deferred_releases: object = None

    # -- read-only views ---------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The pool's configuration."""
        return self._config

    @property
    def stats(self) -> AllocationStats:
        """A consistent snapshot of the running counters."""
        self._lock.acquire()
        try:
            return self._stats.snapshot()
        finally:
            self._lock.release()

    @property
    def history(self) -> deque[AllocationStats]:
        """Stats snapshots after each counted call, oldest first (a new deque).

        One per completed ``allocate`` (successful or exhausted), ``free``,
        ``free_all`` and ``shrink`` call that changed a counter.
        """
        with self._lock:
            entries = self._history.copy()
        return deque(map(_stats_from_history, entries), maxlen=self._history.capacity)

    def n_free(self, stream: AsGiven[str] = "k") -> int:
        """Number of free blocks of ``stream`` (``"k"``/``"v"``, or any in a shared pool).

        Raises:
            ValueError: ``stream`` is not a stream of this pool.
        """
        free_list_name = resolve_stream(stream, self._stream_names)
        with self._lock:
            return len(self._free_lists[free_list_name])

    def blocks_for(self, owner: AsGiven[int]) -> list[Block]:
        """The live handles checked out to ``owner``, in allocation order (a new list).

        Raises:
            TypeError: ``owner`` is not an int.
        """
        require_int("owner", owner)
        with self._lock:
            return list(self._owner_blocks.get(owner, {}).values())

    def is_live(self, block: object) -> bool:
        """Whether ``block`` is the current handle of a block checked out from this pool.

        False for stale handles, other pools' handles and non-``Block`` objects.
        O(1). Backing stores use it to refuse writes through a dead handle.
        """
        with self._lock:
            return self._is_live(block)

    def all_live(self, blocks: Iterable[object]) -> bool:
        """Whether every item of ``blocks`` is a live handle of this pool (one lock, O(k)).

        The batched form of :meth:`is_live`, for a store that checks a whole
        gather's blocks at once.

        Raises:
            TypeError: ``blocks`` is not iterable.
        """
        items = _items_of(blocks)  # a caller's iterator runs here, never under the lock
        with self._lock:
            return all(self._is_live(block) for block in items)

    def id_bound(self) -> int:
        """One more than the highest block id that is free or checked out (0 if none).

        A slab-backed store must cover ids ``0 .. id_bound() - 1``; it falls when
        ``shrink()`` retires the top of the id range, so the store can give its
        tail back, and rises when growth issues higher ids. O(1).
        """
        with self._lock:
            return self._id_bound

    # -- owners ------------------------------------------------------------------

    def register_owner(self, owner: AsGiven[int]) -> None:
        """Mark ``owner`` active, so that a second registration of it raises.

        Raises:
            TypeError: ``owner`` is not an int.
            OwnerAlreadyActiveError: ``owner`` holds blocks, or was registered
                and not released since.
        """
        require_int("owner", owner)
        with self._lock:
            if owner in self._owner_blocks or owner in self._registered_owners:
                raise OwnerAlreadyActiveError(
                    f"owner {owner!r} is already active (holds blocks or is registered); "
                    "expected an owner id that is not in use"
                )
            self._registered_owners.add(owner)

    def release_owner(self, owner: AsGiven[int]) -> None:
        """Clear ``owner``'s registration without freeing its blocks.

        Raises:
            TypeError: ``owner`` is not an int.
        """
        require_int("owner", owner)
        with self._lock:
            self._registered_owners.discard(owner)

    # -- allocation --------------------------------------------------------------

    def allocate(
        self,
        stream: AsGiven[str],
        n_tokens: AsGiven[int],
        owner: AsGiven[int],
        format: AsGiven[str] = "fp16",
    ) -> list[Block]:
        """Check out ``ceil(n_tokens / block_size)`` blocks of ``stream`` to ``owner``.

        Every block is full except the last, which holds the remainder. All or
        nothing: on failure no block is handed out and no block is grown.

        Args:
            stream: ``"k"`` or ``"v"``; any of ``"k"``, ``"v"``, ``"kv"`` in a shared pool.
            n_tokens: Token slots needed, ``> 0``.
            owner: Request id; an owner already active simply grows.
            format: Compression-format tag recorded on each block.

        Returns:
            The new handles, in order.

        Raises:
            ValueError: ``stream`` is invalid, ``n_tokens <= 0`` or ``format`` empty.
            TypeError: ``n_tokens`` or ``owner`` not an int, ``format`` not a str.
            BlockPoolExhaustedError: Too few free blocks and growth is off or capped.
        """
        route = self._free_list_routes.get(stream) if type(stream) is str else None
        if route is None:  # not an exact str, or no stream: the helper names the error
            route = self._free_list_routes[resolve_stream(stream, self._stream_names)]
        free_list_name, free_list = route
        # Exact-type fast paths; the helpers raise the errors (and accept int subclasses).
        if type(n_tokens) is not int or n_tokens < 1:
            n_tokens = require_int("n_tokens", n_tokens, minimum=1)
        if type(owner) is not int:
            require_int("owner", owner)  # owner and format stay as given (AsGiven)
        if type(format) is not str or not format:
            require_format(format)
        n_needed = -(-n_tokens // self._block_size)
        # acquire/try/finally rather than `with`: measurably cheaper on this hot path.
        self._lock.acquire()
        try:
            if n_needed == 1 and free_list:  # the decode loop's case, worth its own path
                block_ids = [free_list.pop()]
            elif n_needed <= len(free_list):
                block_ids = free_list[: -n_needed - 1 : -1]  # the top n_needed, top first
                del free_list[-n_needed:]
            else:
                block_ids = self._grow_or_raise(n_needed - len(free_list), stream, n_tokens)
                if free_list:  # every free id, top first, then the grown ones
                    block_ids[:0] = free_list[::-1]
                    free_list.clear()
            return self._check_out(block_ids, free_list_name, owner, format, n_tokens)
        finally:
            self._lock.release()

    def _grow_or_raise(self, n_missing: int, stream: str, n_tokens: int) -> list[BlockId]:
        """Create ``n_missing`` new block ids (ascending), or record exhaustion and raise."""
        if not self._may_grow_by(n_missing):
            self._stats.n_exhausted += 1
            self._record_history()
            raise BlockPoolExhaustedError(
                f"allocate(stream={stream!r}, n_tokens={n_tokens}) needs {n_missing} more "
                f"free blocks than the stream has; {self._growth_limit_text()}"
            )
        try:
            return self._issue_new_ids(n_missing)
        except (MemoryError, OverflowError):
            raise MemoryError(
                f"allocate(stream={stream!r}, n_tokens={n_tokens}) needs {n_missing} new "
                "blocks, more than this process can hold; nothing changed"
            ) from None

    def _may_grow_by(self, n_missing: int) -> bool:
        """Whether growth is on and ``n_missing`` more blocks stay within ``max_blocks``."""
        config = self._config
        cap = config.max_blocks  # read at each call: a planted-bug test moves it
        total_after = self._stats.n_blocks + n_missing
        return config.grow_on_exhaustion and (cap is None or total_after <= cap)

    def _growth_limit_text(self) -> str:
        if not self._config.grow_on_exhaustion:
            return "growth is off (PoolConfig.grow_on_exhaustion=False)"
        return (
            f"growing would take the pool past max_blocks={self._config.max_blocks} "
            f"(it has {self._stats.n_blocks})"
        )

    def _issue_new_ids(self, count: int) -> list[BlockId]:
        """Issue ``count`` ids, ascending: lowest retired first, then above all ever issued.

        Raises:
            MemoryError, OverflowError: The new ids do not fit in memory (or in a list);
                raised before anything changes (C-GROW-MEMORY).
        """
        retired = self._retired_ids
        n_fresh = count - min(count, len(retired))
        fresh_start = self._next_new_id
        fresh_end = fresh_start + n_fresh
        if n_fresh == 1:  # growth block by block, worth its own path
            fresh_ids = [fresh_start]
            self._ever_allocated.append(False)
        else:  # the lists that may not fit are built before any book changes
            fresh_ids = list(range(fresh_start, fresh_end))
            self._ever_allocated.extend([False] * n_fresh)
        new_ids: list[BlockId] = []
        while retired and len(new_ids) < count:
            block_id = heapq.heappop(retired)
            self._retired_set.remove(block_id)
            self._ever_allocated[block_id] = False
            new_ids.append(block_id)
        new_ids += fresh_ids
        self._next_new_id = fresh_end
        top: int = new_ids[-1]  # ascending: the last is the highest
        if top >= self._id_bound:
            self._id_bound = top + 1
        self._stats.n_blocks += count
        self._stats.n_grown += count
        return new_ids

    def _check_out(
        self,
        block_ids: list[BlockId],
        stream: str,
        owner: AsGiven[int],
        format: AsGiven[str],
        n_tokens: int,
    ) -> list[Block]:
        """Hand ``block_ids`` to ``owner`` as new handles holding ``n_tokens``; count it."""
        owned = self._owner_blocks.get(owner)
        if owned is None:
            owned = self._owner_blocks[owner] = {}
        ever_allocated = self._ever_allocated
        block_size = self._block_size
        full: AsGiven[int] = block_size  # compiled: boxed once here, not once per handle
        blocks = []
        n_reused = 0
        for block_id in block_ids:
            index: int = block_id  # compiled: a native int indexes the list without boxing
            if ever_allocated[index]:
                n_reused += 1
            else:
                ever_allocated[index] = True
            block = Block(block_id, stream, format, full, owner, True)
            owned[block_id] = block
            blocks.append(block)
        last_n_used = n_tokens - (len(blocks) - 1) * block_size
        block.n_used = last_n_used
        stats = self._stats
        stats.n_allocations += 1
        stats.n_reused += n_reused
        stats._fragmented_count += last_n_used < block_size
        in_use = stats._blocks_in_use = stats._blocks_in_use + len(blocks)
        if in_use > stats.peak_blocks_in_use:  # noqa: PLR1730 (an if is cheaper than max())
            stats.peak_blocks_in_use = in_use
        if not self._history_on:
            pass
        elif COMPILED:
            self._history.record(stats)
        else:  # inline, not _record_history(): interpreted, the call costs as much as this
            self._history.entries.append(stats._counters())
        return blocks

    # -- freeing -----------------------------------------------------------------

    def free(self, blocks: AsGiven[list[Block]]) -> None:
        """Return ``blocks`` to their streams' free lists, pushed in list order.

        The whole list is checked before anything changes. An owner whose last
        block is freed is released.

        Raises:
            TypeError: ``blocks`` is not a list or tuple.
            InvalidFreeError: An item is not a live handle of this pool (stale,
                foreign, not a ``Block``) or appears twice; nothing is freed.
        """
        if not isinstance(blocks, (list, tuple)):
            raise TypeError(
                f"blocks must be a list of Block handles, got {type(blocks).__name__}: {blocks!r}"
            )
        items = _items_of(blocks)  # a subclass's __iter__ runs here, never under the lock
        with self._lock:
            refusal = self._first_unfreeable(items)
            if refusal is None:
                self._free_checked(items)
                return
            culprit = items[refusal[0]]  # the item checked, whatever the list holds later
        raise self._unfreeable_error(culprit, *refusal)  # a foreign item's repr: unlocked

    def _free_checked(self, blocks: Sequence[Block]) -> None:
        """``free``'s work, on live handles listed once; the caller holds the lock."""
        if blocks:
            for block in blocks:
                owner = block.owner
                assert owner is not None, "_first_unfreeable let a free handle through"
                owned = self._owner_blocks[owner]
                del owned[block.block_id]
                if not owned:
                    del self._owner_blocks[owner]
                    self._registered_owners.discard(owner)
            self._return_to_free_lists(blocks)

    def _first_unfreeable(
        self, blocks: Sequence[object], *, one_per_id: bool = False
    ) -> tuple[int, str] | None:
        """The position of the first item that is not a live handle listed once, and
        why (:data:`_NOT_LIVE`, :data:`_REPEATED_ID` or :data:`_LISTED_TWICE`); ``None``
        if there is none. Calls nothing of the caller's: safe under the lock."""
        seen_ids: set[BlockId] = set()
        for position, block in enumerate(blocks):
            if not self._is_live(block):
                return position, _NOT_LIVE
            block_id = block.block_id  # a live handle: its fields are the pool's
            if block_id in seen_ids:
                if one_per_id:
                    return position, _REPEATED_ID
                if any(other is block for other in blocks[:position]):
                    return position, _LISTED_TWICE
            seen_ids.add(block_id)
        return None

    @staticmethod
    def _unfreeable_error(block: object, position: int, why: str) -> InvalidFreeError:
        """The error naming ``block``, the item at ``position`` that
        :meth:`_first_unfreeable` refused (taken from the list under the lock: a
        caller's thread may change the list once it is released)."""
        if why == _NOT_LIVE:
            return InvalidFreeError(
                f"blocks[{position}] = {block!r} is not a live handle of this pool; "
                "expected a block checked out from this pool and not yet freed"
            )
        if why == _REPEATED_ID:
            return InvalidFreeError(
                f"blocks[{position}] = {block!r} repeats block id "
                f"{getattr(block, 'block_id', None)}; expected each block once"
            )
        return InvalidFreeError(
            f"blocks[{position}] = {block!r} appears more than once in the list; "
            "expected each block once"
        )

    def _is_live(self, block: object) -> TypeGuard[Block]:
        """Whether ``block`` is the current handle of a block checked out from this pool.

        A handle's ``block_id`` is an exact ``int`` (the pool made it): any other is
        refused before the lookup, which would hash it (caller code, under the lock).
        """
        if (
            not isinstance(block, Block)
            or not isinstance(block.owner, int)
            or type(block.block_id) is not int
        ):
            return False
        owned = self._owner_blocks.get(block.owner)
        return owned is not None and owned.get(block.block_id) is block

    def free_all(self, owner: AsGiven[int]) -> None:
        """Free every block checked out to ``owner`` and release it.

        A no-op (apart from the release) for an owner holding nothing.

        Raises:
            TypeError: ``owner`` is not an int.
        """
        if type(owner) is not int:
            require_int("owner", owner)
        self._lock.acquire()
        try:
            registered = self._registered_owners
            if registered:  # most pools register no owner: skip the hash and the probe
                registered.discard(owner)
            owned = self._owner_blocks.pop(owner, None)
            if owned:
                self._return_to_free_lists(owned.values())
        finally:
            self._lock.release()

    def _return_to_free_lists(self, blocks: Iterable[Block]) -> None:
        """Push ``blocks`` (already off their owner's map) in order; stale their handles."""
        if self._shared_counts:
            self._release_shared(blocks)
            return
        push_onto = self._push_onto
        block_size = self._block_size
        n_freed = 0
        n_fragmented = 0
        stream = ""  # no free list's name: the first block looks its push up
        for block in blocks:
            if block.stream is not stream:  # once per run of blocks of one stream
                stream = block.stream
                push = push_onto[stream]
            push(block.block_id)
            n_used: int = block.n_used
            if 0 < n_used < block_size:
                n_fragmented += 1
            block.owner = None
            block.n_used = 0
            n_freed += 1
        stats = self._stats
        stats._blocks_in_use -= n_freed
        stats._fragmented_count -= n_fragmented
        stats.n_frees += 1
        if not self._history_on:
            pass
        elif COMPILED:
            self._history.record(stats)
        else:  # inline, not _record_history(): interpreted, the call costs as much as this
            self._history.entries.append(stats._counters())

    # -- fill level and shrinking ------------------------------------------------

    def mark_used(self, block: AsGiven[Block], n_used: AsGiven[int]) -> None:
        """Set ``block.n_used`` and keep the fragmentation count exact.

        On a handle whose ``owner`` is ``None`` (free, stale or hand-built) it
        only sets that object's ``n_used``.

        Raises:
            TypeError: ``block`` is not a ``Block`` or ``n_used`` not an int.
            ValueError: ``n_used`` outside ``0 .. block_size``, or ``block`` has an
                owner but is not a live handle of this pool.
        """
        if not isinstance(block, Block):
            raise TypeError(f"block must be a Block, got {type(block).__name__}: {block!r}")
        handle: Block = block  # typed from here on: mypyc reads its fields directly
        block_size = self._block_size
        if type(n_used) is not int or not 0 <= n_used <= block_size:
            require_int("n_used", n_used, minimum=0)
            if n_used > block_size:
                raise ValueError(f"n_used must be an int in 0..{block_size}, got {n_used}")
        new_fill: int = n_used  # for the count; the handle keeps n_used as given
        self._lock.acquire()
        try:
            owner = handle.owner
            if owner is None:
                handle.n_used = n_used
                return
            # _is_live(), inlined: this is the per-token decode path.
            owned = self._owner_blocks.get(owner) if isinstance(owner, int) else None
            block_id = handle.block_id  # an exact int, or no handle: hashed by no caller
            if owned is None or type(block_id) is not int or owned.get(block_id) is not handle:
                refusal = _NOT_A_HANDLE
            elif self._shared_counts and block_id in self._shared_counts:
                refusal = self._shared_counts[block_id]
            else:
                old_fill: int = handle.n_used  # a live handle: the pool wrote it
                self._stats._fragmented_count += (0 < new_fill < block_size) - (
                    0 < old_fill < block_size
                )
                handle.n_used = n_used
                return
        finally:
            self._lock.release()
        raise _mark_used_refusal(handle, refusal)  # a hand-built block's repr is caller code

    def shrink(self, stream: AsGiven[str], target_free: AsGiven[int]) -> int:
        """Retire free blocks of ``stream``, highest ids first, until ``target_free`` remain.

        In-use blocks are never touched. Retired ids leave every count and may
        be re-issued by growth later.

        Returns:
            How many blocks were retired (0 if the stream had ``target_free`` or fewer).

        Raises:
            ValueError: ``stream`` is invalid or ``target_free < 0``.
            TypeError: ``target_free`` is not an int.
        """
        free_list_name = resolve_stream(stream, self._stream_names)
        require_int("target_free", target_free, minimum=0)
        with self._lock:
            free_list = self._free_lists[free_list_name]
            n_to_retire = len(free_list) - target_free
            if n_to_retire <= 0:
                return 0
            retiring = set(heapq.nlargest(n_to_retire, free_list))
            kept = [block_id for block_id in free_list if block_id not in retiring]
            free_list[:] = kept
            for block_id in retiring:
                heapq.heappush(self._retired_ids, block_id)
            self._retired_set.update(retiring)
            while self._id_bound and self._id_bound - 1 in self._retired_set:
                self._id_bound -= 1
            self._stats.n_blocks -= n_to_retire
            self._stats.n_retired += n_to_retire
            self._record_history()
            return n_to_retire

    # -- sharing (docs/CONTRACT.md#sharing) ------------------------------------------

    def share(self, blocks: AsGiven[list[Block]], owner: AsGiven[int]) -> list[Block]:
        """Give ``owner`` a new handle of each block, in order; each count goes up by one.

        A shared block is read-only (``mark_used`` raises) until ``make_writable``.

        Returns:
            The new handles: same ``block_id``, ``stream``, ``format``, ``n_used``.

        Raises:
            TypeError: ``blocks`` is not a list or tuple, or ``owner`` not an int.
            InvalidFreeError: An item is not a live handle of this pool, or two
                items name one block id; nothing changes.
            ValueError: ``owner`` already holds a handle of one of the blocks.
        """
        if not isinstance(blocks, (list, tuple)):
            raise TypeError(
                f"blocks must be a list of Block handles, got {type(blocks).__name__}: {blocks!r}"
            )
        items = _items_of(blocks)  # a subclass's __iter__ runs here, never under the lock
        with self._lock:
            refusal = self._first_unfreeable(items, one_per_id=True)
            if refusal is None and isinstance(owner, int) and not isinstance(owner, bool):
                return self._issue_shares(items, owner)
            culprit = None if refusal is None else items[refusal[0]]
        # Refused, in C-SHARE-ARGS's order, with the lock released: the error's repr of
        # a foreign object is caller code.
        if refusal is not None:
            raise self._unfreeable_error(culprit, *refusal)
        require_int("owner", owner)  # not an int, or it was shared above: raises
        raise AssertionError(f"share refused owner {owner!r}, which require_int took")

    def fork(self, src_owner: AsGiven[int], dst_owner: AsGiven[int]) -> list[Block]:
        """``share(blocks_for(src_owner), dst_owner)`` in one step: every block, K and V.

        Returns:
            ``dst_owner``'s new handles, in ``src_owner``'s allocation order.

        Raises:
            TypeError: An owner is not an int.
            ValueError: The owners are equal, or ``dst_owner`` already holds one
                of ``src_owner``'s blocks.
        """
        require_int("src_owner", src_owner)
        require_int("dst_owner", dst_owner)
        if src_owner == dst_owner:
            raise ValueError(
                f"dst_owner must differ from src_owner={src_owner!r}, got {dst_owner!r}"
            )
        with self._lock:
            source = self._owner_blocks.get(src_owner)
            return self._issue_shares(list(source.values()) if source else [], dst_owner)

    def _issue_shares(self, blocks: Sequence[Block], owner: int) -> list[Block]:
        """New handles of live ``blocks`` for ``owner``, unless it holds one already."""
        owned = self._owner_blocks.get(owner)
        for block in blocks if owned is not None else ():
            if block.block_id in owned:  # type: ignore[operator]  # not None: tested above
                raise ValueError(
                    f"owner {owner!r} already holds block id {block.block_id}; expected an "
                    "owner holding none of the blocks it is given"
                )
        if not blocks:
            return []
        if owned is None:
            owned = self._owner_blocks[owner] = {}
        shared = self._shared_counts
        handles = []
        for block in blocks:
            block_id = block.block_id
            shared[block_id] = shared.get(block_id, 1) + 1
            handle = Block(block_id, block.stream, block.format, block.n_used, owner, True)
            owned[block_id] = handle
            handles.append(handle)
        stats = self._stats
        stats._n_shares += len(handles)
        stats._shared_blocks = len(shared)
        self._record_history()
        return handles

    def ref_count(self, block_id: AsGiven[int]) -> int:
        """How many live handles ``block_id`` has: 0 if free, retired or never issued.

        O(1) for a shared id, O(f) otherwise (the free lists are searched).

        Raises:
            TypeError: ``block_id`` is not an int.
            ValueError: ``block_id`` is negative.
        """
        block_id = _require_block_id(block_id)
        with self._lock:
            count = self._shared_counts.get(block_id)
            if count is not None:
                return count
            issued = block_id < self._next_new_id and block_id not in self._retired_set
            free = any(block_id in ids for ids in self._free_lists.values())
            return 1 if issued and not free else 0

    def is_shared(self, block_id: AsGiven[int]) -> bool:
        """Whether ``block_id``'s reference count is above 1 (read-only). O(1).

        What a store asks before a write, where ``ref_count`` could cost O(f).

        Raises:
            TypeError: ``block_id`` is not an int.
            ValueError: ``block_id`` is negative.
        """
        block_id = _require_block_id(block_id)
        with self._lock:
            return block_id in self._shared_counts

    def make_writable(self, block: AsGiven[Block]) -> Block:
        """A handle of ``block``'s content that this owner alone holds, to write through.

        At count 1, ``block`` itself. Otherwise a new block of the same stream
        (taken as ``allocate`` takes one: top of the free list, else growth)
        gets a new handle with ``block``'s owner, format and n_used; ``block``
        goes stale and its block's count goes down by one. The caller copies
        the content (``copy_block`` on the stores).

        Raises:
            InvalidFreeError: ``block`` is not a live handle of this pool.
            BlockPoolExhaustedError: No block is free and growth is off or
                capped; counted in ``n_exhausted``, nothing else changes.
        """
        with self._lock:
            if self._is_live(block):
                handle: Block = block
                count = self._shared_counts.get(handle.block_id)
                if count is None:
                    return handle
                return self._copy_on_write(handle, count)
        raise InvalidFreeError(  # after the lock: the repr of a foreign object is caller code
            f"block {block!r} is not a live handle of this pool; expected a block "
            "checked out from this pool and not yet freed"
        )

    def _copy_on_write(self, handle: Block, count: int) -> Block:
        """Move ``handle``'s share of its block (count ``count`` > 1) to a new block."""
        free_list = self._free_lists[handle.stream]
        if free_list:
            new_id: BlockId = free_list.pop()
        elif self._may_grow_by(1):
            new_id = self._issue_new_ids(1)[0]
        else:
            self._stats.n_exhausted += 1
            self._record_history()
            raise BlockPoolExhaustedError(
                f"make_writable({handle!r}) needs 1 free block on stream "
                f"{handle.stream!r}, which has none; {self._growth_limit_text()}"
            )
        stats = self._stats
        if self._ever_allocated[new_id]:
            stats.n_reused += 1
        else:
            self._ever_allocated[new_id] = True
        old_id, owner, n_used = handle.block_id, handle.owner, handle.n_used
        assert owner is not None, "make_writable checked the handle is live"
        shared = self._shared_counts
        if count == 2:
            del shared[old_id]
        else:
            shared[old_id] = count - 1
        owned = self._owner_blocks[owner]
        del owned[old_id]
        moved = owned[new_id] = Block(new_id, handle.stream, handle.format, n_used, owner, True)
        handle.owner = None
        handle.n_used = 0
        stats._fragmented_count += 0 < n_used < self._block_size
        stats._blocks_in_use += 1
        if stats._blocks_in_use > stats.peak_blocks_in_use:  # noqa: PLR1730
            stats.peak_blocks_in_use = stats._blocks_in_use
        stats._n_copy_on_write += 1
        stats._shared_blocks = len(shared)
        self._record_history()
        return moved

    def _release_shared(self, blocks: Iterable[Block]) -> None:
        """``_return_to_free_lists`` in a pool holding shared blocks: a block whose
        count stays above 0 is not pushed (docs/CONTRACT.md#c-free-shared)."""
        shared = self._shared_counts
        stats = self._stats
        block_size = self._block_size
        for block in blocks:
            block_id = block.block_id
            count = shared.get(block_id)
            if count is None:  # its last handle: back on the free list
                self._push_onto[block.stream](block_id)
                stats._blocks_in_use -= 1
                stats._fragmented_count -= 0 < block.n_used < block_size
            elif count == 2:
                del shared[block_id]
            else:
                shared[block_id] = count - 1
            block.owner = None
            block.n_used = 0
        stats._shared_blocks = len(shared)
        stats.n_frees += 1
        self._record_history()

    # -- history and checks ------------------------------------------------------

    def _record_history(self) -> None:
        if not self._history_on:
            return
        if COMPILED:
            self._history.record(self._stats)
        else:
            self._history.entries.append(self._stats._counters())

    def check_invariants(self) -> None:
        """Verify every invariant of the class docstring by a full recount. O(n).

        Raises:
            InvariantViolationError: Naming the invariant that is broken and how.
        """
        # Imported here, not at the top: _invariants names this module's classes, and
        # compiled by mypyc its PoolBooks needs them to exist when it is imported.
        from veloxquant_mlx.memory import _invariants  # noqa: PLC0415

        with self._lock:
            problem = _invariants.first_violation(
                _invariants.PoolBooks(
                    config=self._config,
                    free_lists=self._free_lists,
                    owner_blocks=self._owner_blocks,
                    shared_counts=self._shared_counts,
                    retired_ids=self._retired_ids,
                    retired_set=self._retired_set,
                    id_bound=self._id_bound,
                    next_new_id=self._next_new_id,
                    ever_allocated=self._ever_allocated,
                    stats=self._stats,
                )
            )
        if problem is not None:
            raise InvariantViolationError(problem)


def _stats_from_history(entry: tuple[int, ...] | AllocationStats) -> AllocationStats:
    """An entry of ``StatsHistory.copy()`` as the AllocationStats it stands for."""
    if isinstance(entry, AllocationStats):
        return entry  # already a copy
    return AllocationStats._from_counters(entry)


def _as_given(record: object, field_name: str) -> object:
    """``record.field_name`` exactly as stored, whatever its type.

    Compiled by mypyc, a dataclass field with a default (``PoolConfig``'s) is
    converted to its declared type on the way out, and refused with mypyc's own
    ``TypeError`` if it is anything else; ``__post_init__`` must see the value
    as given to name it in the contract's error.
    """
    return getattr(record, field_name)


def _initial_free_lists(config: PoolConfig) -> dict[str, list[BlockId]]:
    """Free stacks holding every initial id, so that the lowest id is on top."""
    # Plain lists, not array("q"): pushes and pops are ~30% cheaper, which is
    # the difference that keeps a 16K-block free_all() under its budget.
    if not config.separate_kv:
        return {"kv": list(range(config.n_blocks - 1, -1, -1))}
    n_keys = -(-config.n_blocks // 2)
    return {
        "k": list(range(n_keys - 1, -1, -1)),
        "v": list(range(config.n_blocks - 1, n_keys - 1, -1)),
    }
