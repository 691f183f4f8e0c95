"""Concurrent histories of one shared pool: every call, its arguments, times and outcome.

A stress run records, per thread, one :class:`Event` per call it makes on the
pool or its store: the call (:data:`Call`, the stress runner's form of the
operation alphabet in :mod:`veloxquant_mlx.testing.operations`, plus the
read-only queries and the store's reads and writes), the
``time.perf_counter_ns()`` taken just before the call was invoked and just
after it returned, and what it returned or raised. The interval always
contains the call's real execution, so "``a`` returned before ``b`` was
invoked" in the record implies it in reality: the real-time order the
linearizability checker (:mod:`veloxquant_mlx.stress.linearizability`)
relies on is never stronger than the truth.

Handles are named by the call that produced them, not by spec handle ids
(which depend on the linearization order, unknown while recording):
``(op_id, position)`` is the ``position``-th block returned by the
``allocate`` whose :attr:`Event.op_id` is ``op_id``. A name stays valid after
the block is freed (it then names the stale handle), like the names of
:mod:`veloxquant_mlx.testing.traces`, which use the same pairs.

``op_id`` is unique within a run without any coordination between threads:
``seq * stride + thread`` for the ``seq``-th call of thread ``thread``.

Complexity: recording is O(1) per call (plus the size of its arguments);
describing is O(size of the event); JSON is in :mod:`.history_json`. Thread safety: a
:class:`ThreadRecorder` belongs to one thread (the runner swaps its list out
only while that thread waits at a barrier); events are immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Final, TypeAlias

from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList

__all__ = [
    "STATS_FIELDS",
    "Allocate",
    "BlocksFor",
    "Call",
    "Event",
    "Free",
    "FreeAll",
    "HandleName",
    "History",
    "IdBound",
    "IsLive",
    "MarkUsed",
    "NFree",
    "Outcome",
    "Prometheus",
    "Raised",
    "Ref",
    "RegisterOwner",
    "ReleaseOwner",
    "Returned",
    "Shrink",
    "Stats",
    "StoreRead",
    "StoreWrite",
    "ThreadRecorder",
    "describe",
    "describe_ref",
]

HandleName: TypeAlias = tuple[int, int]
"""``(op_id, position)``: the ``position``-th block returned by allocate call ``op_id``."""

UNKNOWN_HANDLE: Final = -1
"""``(UNKNOWN_HANDLE, k)`` names a ``Block`` a query returned that no recorded allocate made."""

Ref: TypeAlias = HandleName | ForeignBlock | NotABlock
"""What a call passes where a ``Block`` is expected: a named handle, a foreign block, junk."""

#: The fields of a stats tuple (the value a ``stats`` query records), in order.
STATS_FIELDS: Final = (
    "n_blocks",
    "n_allocations",
    "n_frees",
    "n_reused",
    "n_exhausted",
    "n_grown",
    "n_retired",
    "peak_blocks_in_use",
    "blocks_in_use",
    "fragmented_count",
)


# -- calls that change the pool ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allocate:
    """``pool.allocate(stream, n_tokens, owner, format)``; returns the block ids."""

    kind: ClassVar[str] = "allocate"
    stream: object
    n_tokens: object
    owner: object
    format: object = "fp16"


@dataclass(frozen=True, slots=True)
class Free:
    """``pool.free(blocks)``; ``NotAList()`` passes a bare ``Block`` instead of a list."""

    kind: ClassVar[str] = "free"
    handles: tuple[Ref, ...] | NotAList


@dataclass(frozen=True, slots=True)
class FreeAll:
    """``pool.free_all(owner)``."""

    kind: ClassVar[str] = "free_all"
    owner: object


@dataclass(frozen=True, slots=True)
class RegisterOwner:
    """``pool.register_owner(owner)``."""

    kind: ClassVar[str] = "register_owner"
    owner: object


@dataclass(frozen=True, slots=True)
class ReleaseOwner:
    """``pool.release_owner(owner)``."""

    kind: ClassVar[str] = "release_owner"
    owner: object


@dataclass(frozen=True, slots=True)
class Shrink:
    """``pool.shrink(stream, target_free)``; returns the number retired."""

    kind: ClassVar[str] = "shrink"
    stream: object
    target_free: object


@dataclass(frozen=True, slots=True)
class MarkUsed:
    """``pool.mark_used(block, n_used)``."""

    kind: ClassVar[str] = "mark_used"
    handle: Ref
    n_used: object


# -- read-only queries -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stats:
    """``pool.stats``; returns a tuple of :data:`STATS_FIELDS`."""

    kind: ClassVar[str] = "stats"


@dataclass(frozen=True, slots=True)
class Prometheus:
    """``pool.stats.to_prometheus()``; returns the parsed ``(sample, value)`` pairs, sorted."""

    kind: ClassVar[str] = "prometheus"


@dataclass(frozen=True, slots=True)
class History:
    """``pool.history``; returns one stats tuple per snapshot, oldest first."""

    kind: ClassVar[str] = "history"


@dataclass(frozen=True, slots=True)
class NFree:
    """``pool.n_free(stream)``."""

    kind: ClassVar[str] = "n_free"
    stream: object


@dataclass(frozen=True, slots=True)
class BlocksFor:
    """``pool.blocks_for(owner)``; returns the handles' names, in order."""

    kind: ClassVar[str] = "blocks_for"
    owner: object


@dataclass(frozen=True, slots=True)
class IsLive:
    """``pool.is_live(block)``."""

    kind: ClassVar[str] = "is_live"
    handle: Ref


@dataclass(frozen=True, slots=True)
class IdBound:
    """``pool.id_bound()``."""

    kind: ClassVar[str] = "id_bound"


# -- the shared store --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreWrite:
    """``store.write(layer, block, 0, tokens)`` of a whole block; the store checks liveness."""

    kind: ClassVar[str] = "write"
    handle: HandleName
    layer: int


@dataclass(frozen=True, slots=True)
class StoreRead:
    """``store.gather(layer, blocks, n)``, compared by the reader with what it wrote."""

    kind: ClassVar[str] = "read"
    handles: tuple[HandleName, ...]
    layer: int


Call: TypeAlias = (
    Allocate
    | Free
    | FreeAll
    | RegisterOwner
    | ReleaseOwner
    | Shrink
    | MarkUsed
    | Stats
    | Prometheus
    | History
    | NFree
    | BlocksFor
    | IsLive
    | IdBound
    | StoreWrite
    | StoreRead
)

#: Calls that never change the pool's state, whatever it is.
QUERY_KINDS: Final = frozenset(
    {"stats", "prometheus", "history", "n_free", "blocks_for", "is_live", "id_bound"}
    | {"write", "read"}
)

#: Every call class, by its ``kind``.
CALL_CLASSES: Final[dict[str, type[Call]]] = {
    cls.kind: cls
    for cls in (
        Allocate,
        Free,
        FreeAll,
        RegisterOwner,
        ReleaseOwner,
        Shrink,
        MarkUsed,
        Stats,
        Prometheus,
        History,
        NFree,
        BlocksFor,
        IsLive,
        IdBound,
        StoreWrite,
        StoreRead,
    )
}


# -- outcomes and events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Returned:
    """The call returned ``value`` (ints, bools, names and tuples of them; ``None``)."""

    value: object = None


@dataclass(frozen=True, slots=True)
class Raised:
    """The call raised an exception of class ``kind`` (its ``__name__``)."""

    kind: str
    message: str = ""


Outcome: TypeAlias = Returned | Raised


@dataclass(frozen=True, slots=True)
class Event:
    """One call of one thread, from invocation to return.

    ``return_ns`` and ``outcome`` are ``None`` for a call still pending when
    the history was cut (a deadlocked run, or a truncated window): such a call
    may or may not have taken effect.
    """

    op_id: int
    thread: int
    call: Call
    invoke_ns: int
    return_ns: int | None
    outcome: Outcome | None

    @property
    def pending(self) -> bool:
        """Whether the call never returned (in this history)."""
        return self.return_ns is None


class ThreadRecorder:
    """The history of one thread: its events in program order, and its op ids.

    Invariant: ``events`` are in the order the thread made the calls, and
    every ``op_id`` is ``seq * stride + thread`` for a distinct ``seq``.
    """

    def __init__(self, thread: int, stride: int) -> None:
        """Record for thread number ``thread`` of ``stride`` (threads plus observers)."""
        if not 0 <= thread < stride:
            raise ValueError(f"thread must be in 0..{stride - 1}, got {thread}")
        self.thread: Final = thread
        self._stride: Final = stride
        self._next_seq = 0
        # Only the owning thread appends; the runner swaps the list at a barrier.
        self.events: list[Event] = []

    def next_op_id(self) -> int:
        """A new op id, unique in the run."""
        op_id = self._next_seq * self._stride + self.thread
        self._next_seq += 1
        return op_id

    def add(self, op_id: int, call: Call, invoke_ns: int, return_ns: int, outcome: Outcome) -> None:
        """Append one finished call."""
        self.events.append(Event(op_id, self.thread, call, invoke_ns, return_ns, outcome))

    def take(self) -> list[Event]:
        """Hand over the events recorded since the last take (call only at a barrier)."""
        taken, self.events = self.events, []
        return taken


# -- text for people ---------------------------------------------------------------------


def describe(event: Event) -> str:
    """A one-line, human-readable form of the call and its outcome (handles as ``hOP.POS``)."""
    arguments = []
    for call_field in fields(event.call):
        value = getattr(event.call, call_field.name)
        if call_field.name == "handle":
            arguments.append(describe_ref(value))
        elif call_field.name == "handles" and isinstance(value, tuple):
            arguments.append("[" + ", ".join(describe_ref(ref) for ref in value) + "]")
        elif isinstance(value, NotAList):
            arguments.append("<a Block, not a list>")
        else:
            arguments.append(repr(value))
    text = f"{event.call.kind}({', '.join(arguments)})"
    outcome = event.outcome
    if outcome is None:
        return f"{text} -> (pending)"
    if isinstance(outcome, Raised):
        return f"{text} -> raised {outcome.kind}"
    if isinstance(event.call, BlocksFor) and isinstance(outcome.value, tuple):
        return f"{text} -> [" + ", ".join(describe_ref(ref) for ref in outcome.value) + "]"
    if isinstance(event.call, Allocate) and isinstance(outcome.value, tuple):
        return f"{text} -> block ids {list(outcome.value)}"
    return f"{text} -> ok" if outcome.value is None else f"{text} -> {outcome.value!r}"


def describe_ref(ref: object) -> str:
    """A handle reference as text: ``h12.0``, ``<foreign block owner=7>``..."""
    if isinstance(ref, ForeignBlock):
        return "<hand-made block>" if ref.owner is None else f"<foreign block owner={ref.owner}>"
    if isinstance(ref, NotABlock):
        return "<not a block>"
    if isinstance(ref, tuple) and len(ref) == 2:
        if ref[0] == UNKNOWN_HANDLE:
            return f"<unknown handle #{ref[1]}>"
        return f"h{ref[0]}.{ref[1]}"
    return repr(ref)
