"""The public operations of the block pool, each declared once (docs/API.md, docs/CONTRACT.md).

An operation is a frozen value class whose fields are the call's
parameters, decorated with :func:`~veloxquant_mlx_spec.table.operation`:
what it returns, its transition in the spec, the domain of each value
argument, its source (docs/API.md's **R**, **C**, **P**) and the contract
rules it is judged by. A field typed ``HandleRef`` takes a handle, one typed
``HandleList`` a list of them; every other field is a value, which may be
of the wrong type on purpose (bad input is part of the alphabet)::

    Allocate("k", 5, owner=1)                    # pool.allocate("k", 5, 1)
    Free((h(0, 1), h(0, 0)))                     # pool.free([second, first])
    MarkUsed(ForeignBlock(None), 3)              # mark_used on a Block built by hand
    NFree("kv")                                  # a query

Every checker, trace and command derives from these declarations (see
:mod:`~veloxquant_mlx_spec.table`). The pool's typing protocol,
:class:`BlockPool` (and :class:`CheckedBlockPool` with the project's
additions), lists the same calls; ``tests/test_operation_table.py`` checks
that the value classes, the protocol, the spec's transitions and
``BlockPoolAllocator`` agree on every name, parameter and default. Adding an
operation is docs/ADDING_AN_OPERATION.md.

Complexity and thread safety: immutable values, declared at import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias, TypeVar, runtime_checkable

from veloxquant_mlx_spec import model, transitions
from veloxquant_mlx_spec.model import Err, ErrorKind, PoolState, SpecConfig
from veloxquant_mlx_spec.table import (
    Domain,
    HandleList,
    HandleRef,
    Returns,
    operation,
    query,
    stats_values,
)

__all__ = [
    "DEFAULT_PROMETHEUS_PREFIX",
    "OWNER",
    "STREAM",
    "AllLive",
    "Allocate",
    "BlockLike",
    "BlockPool",
    "BlocksFor",
    "CheckInvariants",
    "CheckedBlockPool",
    "ConfigLike",
    "Fork",
    "Free",
    "FreeAll",
    "History",
    "IdBound",
    "IsLive",
    "IsShared",
    "MakeWritable",
    "MarkUsed",
    "NCopyOnWrite",
    "NFree",
    "NShares",
    "Operation",
    "Prometheus",
    "RefCount",
    "RegisterOwner",
    "ReleaseOwner",
    "Share",
    "SharedBlocks",
    "Shrink",
    "Stats",
    "StatsLike",
]

# ---- what the arguments range over ---------------------------------------------------

#: Wrong-typed values for an int argument (bool is not an int here: C-INT-NOT-BOOL).
BAD_INTS: Final[tuple[object, ...]] = (True, 1.0, "1", None)


def _bad_streams(config: SpecConfig) -> tuple[object, ...]:
    unknown = () if not config.separate_kv else ("kv",)  # a stream only of shared pools
    return (*unknown, "K", "", "kv ", 0, None, b"k")


STREAM: Final = Domain(
    "stream", good=model.stream_names, small=model.stream_names, bad=_bad_streams, observed="every"
)
OWNER: Final = Domain(
    "owner",
    good=lambda config: (0, 1, 2),
    small=lambda config: (0, 1),
    bad=lambda config: BAD_INTS,
    observed="named",
)
TOKENS: Final = Domain(
    "n_tokens",
    good=lambda config: tuple(range(1, 3 * config.block_size + 2)),
    small=lambda config: (1, config.block_size + 1),  # one block; two, the second part full
    bad=lambda config: (0, -1, *BAD_INTS),
)
FORMAT: Final = Domain(
    "format",
    good=lambda config: ("fp16", "int4", "int2"),
    small=lambda config: ("fp16", "int4"),
    bad=lambda config: ("", b"fp16", 4, None),
)
TARGET_FREE: Final = Domain(
    "target_free",
    good=lambda config: (0, 1, 2, 3, 4),
    small=lambda config: (0, 1),
    bad=lambda config: (-1, *BAD_INTS),
)
FILL: Final = Domain(
    "n_used",
    good=lambda config: tuple(range(config.block_size + 1)),
    # part full, full, then emptied again (0 last: where one value is tried, it is 1)
    small=lambda config: (*sorted({1, config.block_size}), 0),
    bad=lambda config: (config.block_size + 1, -1, *BAD_INTS),
)
BLOCK_ID: Final = Domain(
    "block_id",
    good=lambda config: tuple(range(config.n_blocks + 2)),  # two past the first growth
    small=lambda config: (0, 1),
    bad=lambda config: (-1, *BAD_INTS),
    # Not observed after every step: a query per id per step would slow every checker
    # (CrossHair most), and a wrong count shows anyway in n_free, blocks_in_use,
    # shared_blocks (observed) and the pool's check_invariants (observed).
    observed="never",
)
DEFAULT_PROMETHEUS_PREFIX: Final = "veloxquant_block_pool"
PREFIX: Final = Domain(
    "prefix",
    good=lambda config: (DEFAULT_PROMETHEUS_PREFIX, "vq:pool_2"),
    small=lambda config: (DEFAULT_PROMETHEUS_PREFIX,),
    bad=lambda config: ("", "9lives", "a b", None, 7),
)


# ---- calls that change the pool ------------------------------------------------------


@operation(
    returns=Returns.NOTHING,
    transition=transitions.register_owner,
    domains={"owner": OWNER},
    source="R",
    rules=("C-OWNER-ACTIVE", "C-REGISTER-ACTIVE-RAISES", "C-INT-NOT-BOOL"),
)
@dataclass(frozen=True, slots=True)
class RegisterOwner:
    """``pool.register_owner(owner)``."""

    owner: object


@operation(
    returns=Returns.NOTHING,
    transition=transitions.release_owner,
    domains={"owner": OWNER},
    source="R",
    rules=("C-RELEASE-REGISTRATION-ONLY", "C-INT-NOT-BOOL"),
)
@dataclass(frozen=True, slots=True)
class ReleaseOwner:
    """``pool.release_owner(owner)``."""

    owner: object


@operation(
    returns=Returns.NEW_HANDLES,
    transition=transitions.allocate,
    domains={"stream": STREAM, "n_tokens": TOKENS, "owner": OWNER, "format": FORMAT},
    counted_errors=frozenset({ErrorKind.EXHAUSTED}),
    source="R",
    rules=(
        "C-ALLOC-SIZE",
        "C-ALLOC-ARGS",
        "C-ARG-ORDER",
        "C-ID-ASCENDING",
        "C-ID-REISSUE",
        "C-LIFO",
        "C-GROWN-LAST",
        "C-GROW-EXACT",
        "C-ALL-OR-NOTHING",
        "C-OWNER-CONTINUES",
        "C-COUNTERS-ALLOC",
        "C-HANDLE-PER-CHECKOUT",
    ),
)
@dataclass(frozen=True, slots=True)
class Allocate:
    """``pool.allocate(stream, n_tokens, owner, format)``; its handles are ``h(call, i)``."""

    stream: object
    n_tokens: object
    owner: object
    format: object = "fp16"


@operation(
    returns=Returns.NOTHING,
    transition=transitions.free,
    source="R",
    rules=(
        "C-FREE-ATOMIC",
        "C-FREE-EMPTY",
        "C-FREED-BLOCK",
        "C-STALE-HANDLE",
        "C-RELEASE-ON-LAST-FREE",
        "C-COUNTERS-NFREES",
        "C-LIFO",
    ),
)
@dataclass(frozen=True, slots=True)
class Free:
    """``pool.free(blocks)``: pushed in list order; all or nothing."""

    blocks: HandleList


@operation(
    returns=Returns.NOTHING,
    transition=transitions.free_all,
    domains={"owner": OWNER},
    source="R",
    rules=("C-FREE-ALL", "C-COUNTERS-NFREES", "C-INT-NOT-BOOL"),
)
@dataclass(frozen=True, slots=True)
class FreeAll:
    """``pool.free_all(owner)``: the owner's blocks in allocation order; always releases it."""

    owner: object


@operation(
    returns=Returns.VALUE,
    transition=transitions.shrink,
    domains={"stream": STREAM, "target_free": TARGET_FREE},
    source="R",
    rules=("C-SHRINK-HIGHEST-FIRST", "C-SHRINK-ARGS", "C-SHRINK-COUNTS", "C-SHRINK-KEEPS-ORDER"),
)
@dataclass(frozen=True, slots=True)
class Shrink:
    """``pool.shrink(stream, target_free)``; returns how many blocks it retired."""

    stream: object
    target_free: object


@operation(
    returns=Returns.NOTHING,
    transition=transitions.mark_used,
    domains={"n_used": FILL},
    source="R",
    rules=("C-MARK-USED-ARGS", "C-MARK-USED-LIVE", "C-MARK-USED-FREE", "C-MARK-USED-FOREIGN"),
    sets_on_unowned=("block", "n_used"),
)
@dataclass(frozen=True, slots=True)
class MarkUsed:
    """``pool.mark_used(block, n_used)``; on a block with no owner, only that object changes."""

    block: HandleRef
    n_used: object


# ---- sharing (docs/CONTRACT.md#sharing) ----------------------------------------------


@operation(
    returns=Returns.NEW_HANDLES,
    transition=transitions.share,
    domains={"owner": OWNER},
    source="P",
    rules=("C-SHARE", "C-SHARE-ARGS", "C-OWNER-CONTINUES", "C-COUNTERS-SHARE"),
)
@dataclass(frozen=True, slots=True)
class Share:
    """``pool.share(blocks, owner)``: a new handle of each block for ``owner``, in order."""

    blocks: HandleList
    owner: object


@operation(
    returns=Returns.NEW_HANDLES,
    transition=transitions.fork,
    domains={"src_owner": OWNER, "dst_owner": OWNER},
    source="P",
    rules=("C-FORK", "C-SHARE-ARGS", "C-COUNTERS-SHARE"),
)
@dataclass(frozen=True, slots=True)
class Fork:
    """``pool.fork(src_owner, dst_owner)``: ``share`` of every live handle of the source."""

    src_owner: object
    dst_owner: object


@operation(
    returns=Returns.HANDLE,
    transition=transitions.make_writable,
    counted_errors=frozenset({ErrorKind.EXHAUSTED}),
    source="P",
    rules=("C-MAKE-WRITABLE", "C-GROW-EXACT", "C-ALL-OR-NOTHING", "C-COUNTERS-SHARE"),
)
@dataclass(frozen=True, slots=True)
class MakeWritable:
    """``pool.make_writable(block)``: the handle itself at count 1, else a new block's."""

    block: HandleRef


@operation(
    returns=Returns.VALUE,
    transition=query(transitions.ref_count),
    domains={"block_id": BLOCK_ID},
    source="P",
    changes_state=False,
    rules=("C-REF-COUNT", "INV-REFCOUNT"),
)
@dataclass(frozen=True, slots=True)
class RefCount:
    """``pool.ref_count(block_id)``."""

    block_id: object


@operation(
    returns=Returns.VALUE,
    transition=query(transitions.is_shared),
    domains={"block_id": BLOCK_ID},
    source="P",
    changes_state=False,
    rules=("C-REF-COUNT", "C-SHARED-READ-ONLY"),
)
@dataclass(frozen=True, slots=True)
class IsShared:
    """``pool.is_shared(block_id)``: what a store asks before a write, in O(1)."""

    block_id: object


def _shared_blocks(state: PoolState) -> int:
    """`stats.shared_blocks()`: blocks checked out with a count above 1."""
    return model.sharing_stats(state)[0]


def _n_shares(state: PoolState) -> int:
    """`stats.n_shares`: handles issued by share and fork."""
    return model.sharing_stats(state)[1]


def _n_copy_on_write(state: PoolState) -> int:
    """`stats.n_copy_on_write`: make_writable calls that moved a handle."""
    return model.sharing_stats(state)[2]


@operation(
    returns=Returns.VALUE,
    transition=query(_shared_blocks),
    path=("stats", "shared_blocks"),
    source="P",
    changes_state=False,
    rules=("C-COUNTERS-SHARE", "INV-REFCOUNT"),
)
@dataclass(frozen=True, slots=True)
class SharedBlocks:
    """``pool.stats.shared_blocks()``."""


@operation(
    returns=Returns.VALUE,
    transition=query(_n_shares),
    path=("stats", "n_shares"),
    source="P",
    is_property=True,
    changes_state=False,
    rules=("C-COUNTERS-SHARE",),
)
@dataclass(frozen=True, slots=True)
class NShares:
    """``pool.stats.n_shares``."""


@operation(
    returns=Returns.VALUE,
    transition=query(_n_copy_on_write),
    path=("stats", "n_copy_on_write"),
    source="P",
    is_property=True,
    changes_state=False,
    rules=("C-COUNTERS-SHARE",),
)
@dataclass(frozen=True, slots=True)
class NCopyOnWrite:
    """``pool.stats.n_copy_on_write``."""


# ---- queries -------------------------------------------------------------------------


@operation(
    returns=Returns.HANDLES,
    transition=query(transitions.blocks_for),
    domains={"owner": OWNER},
    source="R",
    changes_state=False,
    rules=("C-BLOCKS-FOR", "C-INT-NOT-BOOL"),
)
@dataclass(frozen=True, slots=True)
class BlocksFor:
    """``pool.blocks_for(owner)``: the owner's live handles, in allocation order."""

    owner: object


@operation(
    returns=Returns.VALUE,
    transition=query(transitions.n_free),
    domains={"stream": STREAM},
    source="R",
    changes_state=False,
    rules=("C-STREAM-NAMES", "C-STREAM-SHARED"),
)
@dataclass(frozen=True, slots=True)
class NFree:
    """``pool.n_free(stream)``."""

    stream: object = "k"


@operation(
    returns=Returns.STATS,
    transition=query(model.stats),
    source="C",
    is_property=True,
    changes_state=False,
    rules=(
        "C-STATS-SNAPSHOT",
        "C-STATS-NBLOCKS",
        "C-STATS-IN-USE",
        "C-STATS-FRAGMENTATION",
        "INV-COUNTERS",
    ),
)
@dataclass(frozen=True, slots=True)
class Stats:
    """``pool.stats``: a snapshot."""


def _history(state: PoolState) -> tuple[model.StatsView, ...]:
    """`history`: the snapshots kept, oldest first."""
    return state.history


@operation(
    returns=Returns.HISTORY,
    transition=query(_history),
    source="R",
    is_property=True,
    changes_state=False,
    rules=("C-HISTORY", "INV-HISTORY-BOUND"),
)
@dataclass(frozen=True, slots=True)
class History:
    """``pool.history``: snapshots after each counted call, oldest first."""


_METRIC_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def prometheus_samples(
    state: PoolState, prefix: object = DEFAULT_PROMETHEUS_PREFIX
) -> tuple[tuple[str, float], ...] | Err:
    """`stats.to_prometheus(prefix)`: its ``(sample, value)`` pairs, sorted (C-PROMETHEUS)."""
    if not isinstance(prefix, str) or _METRIC_NAME.fullmatch(prefix) is None:
        message = f"prefix must be a valid Prometheus metric name, got {prefix!r}"
        return Err(ErrorKind.VALUE, message)
    samples = (model.STATS_SAMPLES[name] for name in model.STATS_FIELDS)
    values: dict[str, float] = dict(zip(samples, stats_values(model.stats(state)), strict=True))
    shared_blocks, n_shares, n_copy_on_write = model.sharing_stats(state)
    if n_shares:  # C-NEVER-SHARED: a pool that never shared shows the ten metrics only
        sharing = (shared_blocks, n_shares, n_copy_on_write)
        values |= dict(zip(model.SHARING_SAMPLES, sharing, strict=True))
    return tuple(sorted((f"{prefix}_{name}", float(value)) for name, value in values.items()))


@operation(
    returns=Returns.METRICS,
    transition=query(prometheus_samples),
    domains={"prefix": PREFIX},
    path=("stats", "to_prometheus"),
    source="R",  # the method is the reference's; what it renders is the contract's
    changes_state=False,
    rules=("C-PROMETHEUS",),
)
@dataclass(frozen=True, slots=True)
class Prometheus:
    """``pool.stats.to_prometheus(prefix)``: the exposition text, compared as its samples."""

    prefix: object = DEFAULT_PROMETHEUS_PREFIX


@operation(
    returns=Returns.VALUE,
    transition=query(transitions.is_live),
    source="P",
    changes_state=False,
    rules=("C-STALE-HANDLE",),
)
@dataclass(frozen=True, slots=True)
class IsLive:
    """``pool.is_live(block)``."""

    block: HandleRef


def _all_live(state: PoolState, blocks: object) -> bool | Err:
    """`all_live(blocks)`: every item is a live handle (an iterable is required)."""
    if not isinstance(blocks, tuple):
        return Err(ErrorKind.TYPE, "blocks must be an iterable of Block")
    return all(transitions.is_live(state, block) for block in blocks)


@operation(
    returns=Returns.VALUE,
    transition=query(_all_live),
    source="P",
    changes_state=False,
    rules=("C-STALE-HANDLE",),
)
@dataclass(frozen=True, slots=True)
class AllLive:
    """``pool.all_live(blocks)``."""

    blocks: HandleList


@operation(
    returns=Returns.VALUE,
    transition=query(transitions.id_bound),
    source="P",
    changes_state=False,
    rules=("INV-ID-BOUND",),
)
@dataclass(frozen=True, slots=True)
class IdBound:
    """``pool.id_bound()``."""


def _books_are_consistent(state: PoolState) -> None:
    """`check_invariants()`: returns, since every state the spec reaches is consistent."""
    return None


@operation(
    returns=Returns.NOTHING,
    transition=query(_books_are_consistent),
    source="P",
    changes_state=False,
    rules=("INV-PARTITION", "INV-HANDLES", "INV-COUNTERS", "INV-EVER-ALLOCATED"),
)
@dataclass(frozen=True, slots=True)
class CheckInvariants:
    """``pool.check_invariants()``."""


Operation: TypeAlias = (
    RegisterOwner
    | ReleaseOwner
    | Allocate
    | Free
    | FreeAll
    | Shrink
    | MarkUsed
    | Share
    | Fork
    | MakeWritable
    | RefCount
    | IsShared
    | SharedBlocks
    | NShares
    | NCopyOnWrite
    | BlocksFor
    | NFree
    | Stats
    | History
    | Prometheus
    | IsLive
    | AllLive
    | IdBound
    | CheckInvariants
)
"""Every public call of the pool, as a value."""


# ---- the pool's typing protocol (the same calls; a port types against it) ------------


class BlockLike(Protocol):
    """What a handle shows (docs/API.md, Block); a port's own frozen class satisfies it."""

    @property
    def block_id(self) -> int: ...
    @property
    def stream(self) -> str: ...
    @property
    def format(self) -> str: ...
    @property
    def n_used(self) -> int: ...
    @property
    def owner(self) -> int | None: ...
    @property
    def ever_allocated(self) -> bool: ...


class StatsLike(Protocol):
    """What a stats snapshot shows (docs/API.md, AllocationStats).

    The reference's fields and methods, plus the project's ``n_shares``,
    ``n_copy_on_write`` and ``shared_blocks()`` (**P**), which every
    :class:`BlockPool` port must therefore have.
    """

    @property
    def n_blocks(self) -> int: ...
    @property
    def n_allocations(self) -> int: ...
    @property
    def n_frees(self) -> int: ...
    @property
    def n_reused(self) -> int: ...
    @property
    def n_exhausted(self) -> int: ...
    @property
    def n_grown(self) -> int: ...
    @property
    def n_retired(self) -> int: ...
    @property
    def peak_blocks_in_use(self) -> int: ...
    @property
    def n_shares(self) -> int: ...
    @property
    def n_copy_on_write(self) -> int: ...
    def blocks_in_use(self) -> int: ...
    def shared_blocks(self) -> int: ...
    def fragmentation(self) -> float: ...
    def to_prometheus(self, prefix: str = DEFAULT_PROMETHEUS_PREFIX) -> str: ...


class ConfigLike(Protocol):
    """What a pool's configuration shows (docs/API.md, PoolConfig)."""

    @property
    def block_size(self) -> int: ...
    @property
    def n_blocks(self) -> int: ...
    @property
    def separate_kv(self) -> bool: ...
    @property
    def grow_on_exhaustion(self) -> bool: ...
    @property
    def max_blocks(self) -> int | None: ...


BlockT = TypeVar("BlockT", bound=BlockLike)


@runtime_checkable
class BlockPool(Protocol[BlockT]):
    """The reference and contract calls of a block pool (docs/API.md **R** and **C**).

    Generic in the handle type: ``BlockPoolAllocator`` is a ``BlockPool[Block]``, a
    port with its own handle class a ``BlockPool[PortBlock]``.

    Not the reference API alone: ``stats`` and ``history`` are typed as
    :class:`StatsLike`, which also requires three project additions (**P**),
    the properties ``n_shares`` and ``n_copy_on_write`` and the method
    ``shared_blocks()``. A port's stats must have them to type-check; a port
    without sharing can return 0 from each.
    """

    @property
    def config(self) -> ConfigLike: ...
    @property
    def stats(self) -> StatsLike: ...
    @property
    def history(self) -> Sequence[StatsLike]: ...
    def register_owner(self, owner: int) -> None: ...
    def release_owner(self, owner: int) -> None: ...
    def allocate(
        self, stream: str, n_tokens: int, owner: int, format: str = "fp16"
    ) -> list[BlockT]: ...
    def free(self, blocks: list[BlockT]) -> None: ...
    def free_all(self, owner: int) -> None: ...
    def shrink(self, stream: str, target_free: int) -> int: ...
    def mark_used(self, block: BlockT, n_used: int) -> None: ...
    def blocks_for(self, owner: int) -> list[BlockT]: ...
    def n_free(self, stream: str = "k") -> int: ...


@runtime_checkable
class CheckedBlockPool(BlockPool[BlockT], Protocol[BlockT]):
    """A :class:`BlockPool` with the project's additions (docs/API.md **P**).

    The backing stores and the stress runner need these; the conformance kit
    checks them when a pool has them.
    """

    def share(self, blocks: list[BlockT], owner: int) -> list[BlockT]: ...
    def fork(self, src_owner: int, dst_owner: int) -> list[BlockT]: ...
    def make_writable(self, block: BlockT) -> BlockT: ...
    def ref_count(self, block_id: int) -> int: ...
    def is_shared(self, block_id: int) -> bool: ...
    def is_live(self, block: object) -> bool: ...
    def all_live(self, blocks: Iterable[object]) -> bool: ...
    def id_bound(self) -> int: ...
    def check_invariants(self) -> None: ...
