"""A second model of the pool, written by hand from the contract: a third party beside the spec.

:class:`PoolModel` is the contract's bookkeeping in plain Python (a stack of
free ids per stream, each owner's ids in allocation order, the retired ids,
the counters), with nothing shared with the spec but the rules it reads.
:class:`PlainModelOracle` lets the lockstep runner ask it about every call
of the operation table: it answers the calls it models (good arguments,
named handles) and shows what it models (stats, history, free counts, every
named owner's handles, every handle's fields), and the runner compares both
with the spec after every step (``tests/test_properties.py``). Two models
written independently agree with each other and with the allocator, or one
of the three is wrong.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.operations import (
    Allocate,
    BlocksFor,
    Free,
    FreeAll,
    History,
    MarkUsed,
    NFree,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
    Stats,
)
from veloxquant_mlx_spec.table import AsTuple, Handle, Outcome, Raised, Returned

COUNTERS = ("n_allocations", "n_frees", "n_reused", "n_exhausted", "n_grown", "n_retired")
StatsTuple = tuple[float, ...]


@dataclass
class PoolModel:
    """The contract's bookkeeping, with nothing optimised."""

    block_size: int
    separate_kv: bool
    grow_on_exhaustion: bool
    max_blocks: int | None
    history_len: int
    free: dict[str, list[int]]  # free list -> free ids, top of the stack last
    owned: dict[int, list[int]] = field(default_factory=dict)  # owner -> ids, allocation order
    fill: dict[int, int] = field(default_factory=dict)  # checked-out id -> n_used
    fmt: dict[int, str] = field(default_factory=dict)  # checked-out id -> format
    stream: dict[int, str] = field(default_factory=dict)  # checked-out id -> its free list
    registered: set[int] = field(default_factory=set)
    ever_allocated: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    highest_issued: int = -1
    n_blocks: int = 0
    peak: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    history: deque[StatsTuple] = field(default_factory=deque)

    @classmethod
    def new(cls, config: model.SpecConfig, history_len: int) -> PoolModel:
        n_blocks, n_k = config.n_blocks, math.ceil(config.n_blocks / 2)
        if config.separate_kv:
            free = {"k": list(range(n_k))[::-1], "v": list(range(n_k, n_blocks))[::-1]}
        else:
            free = {"kv": list(range(n_blocks))[::-1]}
        pool = cls(
            block_size=config.block_size,
            separate_kv=config.separate_kv,
            grow_on_exhaustion=config.grow_on_exhaustion,
            max_blocks=config.max_blocks,
            history_len=history_len,
            free=free,
            highest_issued=n_blocks - 1,
            n_blocks=n_blocks,
        )
        pool.history = deque(maxlen=history_len)
        return pool

    def list_name(self, stream: str) -> str:
        return stream if self.separate_kv else "kv"

    def streams(self) -> tuple[str, ...]:
        return ("k", "v") if self.separate_kv else ("k", "v", "kv")

    def is_active(self, owner: int) -> bool:
        return owner in self.owned or owner in self.registered

    def stats(self) -> StatsTuple:
        """In ``model.STATS_FIELDS`` order."""
        fragmented = sum(1 for n_used in self.fill.values() if 0 < n_used < self.block_size)
        c = self.counters
        return (
            self.n_blocks,
            c["n_allocations"],
            c["n_frees"],
            c["n_reused"],
            c["n_exhausted"],
            c["n_grown"],
            c["n_retired"],
            self.peak,
            len(self.fill),
            fragmented / self.n_blocks if self.n_blocks else 0.0,
        )

    def record(self) -> None:
        if self.history_len:
            self.history.append(self.stats())

    def new_block_ids(self, count: int) -> list[int]:
        """Ids for ``count`` grown blocks: lowest retired first, then above the highest."""
        reissued = sorted(self.retired)[:count]
        first_fresh = self.highest_issued + 1
        fresh = list(range(first_fresh, first_fresh + count - len(reissued)))
        self.retired.difference_update(reissued)
        if fresh:
            self.highest_issued = fresh[-1]
        return reissued + fresh

    def allocate(self, stream: str, n_tokens: int, owner: int, fmt: str) -> list[int] | None:
        """The ids handed out, or None when the call must raise BlockPoolExhaustedError."""
        free = self.free[self.list_name(stream)]
        needed = math.ceil(n_tokens / self.block_size)
        missing = max(0, needed - len(free))
        if missing and not (
            self.grow_on_exhaustion
            and (self.max_blocks is None or self.n_blocks + missing <= self.max_blocks)
        ):
            self.counters["n_exhausted"] += 1
            self.record()
            return None
        ids = [free.pop() for _ in range(needed - missing)] + self.new_block_ids(missing)
        self.n_blocks += missing
        self.counters["n_grown"] += missing
        self.counters["n_allocations"] += 1
        self.counters["n_reused"] += sum(1 for i in ids if i in self.ever_allocated)
        self.ever_allocated.update(ids)
        remainder = n_tokens - self.block_size * (needed - 1)
        for position, block_id in enumerate(ids):
            self.fill[block_id] = remainder if position == len(ids) - 1 else self.block_size
            self.fmt[block_id] = fmt
            self.stream[block_id] = self.list_name(stream)
        self.owned.setdefault(owner, []).extend(ids)
        self.peak = max(self.peak, len(self.fill))
        self.record()
        return ids

    def free_blocks(self, freed: list[tuple[int, int]]) -> None:
        """Free (owner, block id) pairs in order: one free() or free_all() call."""
        for owner, block_id in freed:
            self.free[self.stream.pop(block_id)].append(block_id)
            self.owned[owner].remove(block_id)
            del self.fill[block_id]
            del self.fmt[block_id]
            if not self.owned[owner]:
                del self.owned[owner]
                self.registered.discard(owner)
        if freed:
            self.counters["n_frees"] += 1
            self.record()

    def shrink(self, stream: str, target_free: int) -> int:
        free = self.free[self.list_name(stream)]
        n_retire = max(0, len(free) - target_free)
        if n_retire == 0:
            return 0
        retiring = set(sorted(free)[-n_retire:])
        free[:] = [block_id for block_id in free if block_id not in retiring]
        self.retired |= retiring
        self.ever_allocated -= retiring
        self.n_blocks -= n_retire
        self.counters["n_retired"] += n_retire
        self.record()
        return n_retire


def _int(value: object) -> int | None:
    """``value`` if it is an int (not a bool), else None."""
    return value if model.is_int(value) else None


@dataclass
class _Handle:
    """What the model knows of one handle it named: its owner (None: freed), id, n_used."""

    owner: int | None
    block_id: int
    stream: str
    fmt: str
    n_used: int


class PlainModelOracle:
    """:class:`PoolModel` as a lockstep oracle: it answers what it models, declines the rest.

    It declines calls with a bad argument (all of which change nothing but an
    exhaustion count, which it does model) and references that are not names.
    """

    def __init__(self, config: model.SpecConfig, history_len: int) -> None:
        self.pool = PoolModel.new(config, history_len)
        self.handles: dict[Handle, _Handle] = {}
        self.owners: set[int] = set()

    def __repr__(self) -> str:
        return "the plain model"

    def _live(self, owner: int) -> list[Handle]:
        return [name for name, handle in self.handles.items() if handle.owner == owner]

    def apply(self, op: object, label: int) -> Outcome | None:
        owner = _int(getattr(op, "owner", None))
        if owner is not None:
            self.owners.add(owner)
        if isinstance(op, Allocate):
            return self._allocate(op, label)
        if isinstance(op, Free):
            return self._free(op)
        if isinstance(op, MarkUsed):
            return self._mark_used(op)
        if isinstance(op, Shrink):
            return self._shrink(op)
        if owner is not None:
            return self._owner_call(op, owner)
        return self._query(op)

    def _allocate(self, op: Allocate, label: int) -> Outcome | None:
        pool, n_tokens, owner = self.pool, _int(op.n_tokens), _int(op.owner)
        stream, fmt = op.stream, op.format
        if not (isinstance(stream, str) and stream in pool.streams()):
            return None
        if n_tokens is None or n_tokens < 1 or owner is None:
            return None
        if not (isinstance(fmt, str) and fmt):
            return None
        ids = pool.allocate(stream, n_tokens, owner, fmt)
        if ids is None:
            return Raised("BlockPoolExhaustedError")
        for position, block_id in enumerate(ids):
            fill, free_list = pool.fill[block_id], pool.stream[block_id]
            self.handles[Handle(label, position)] = _Handle(owner, block_id, free_list, fmt, fill)
        return Returned(tuple(ids))

    def _free(self, op: Free) -> Outcome | None:
        refs = op.blocks.refs if isinstance(op.blocks, AsTuple) else op.blocks
        if not isinstance(refs, tuple):
            return None
        names = [ref for ref in refs if isinstance(ref, Handle)]
        if len(names) != len(refs):
            return None
        held = [self.handles.get(name) for name in names]
        live = [h for h in held if h is not None and h.owner is not None]
        if len(set(names)) != len(names) or len(live) != len(names):
            return Raised("InvalidFreeError")
        self.pool.free_blocks([(h.owner, h.block_id) for h in live if h.owner is not None])
        for handle in live:
            handle.owner, handle.n_used = None, 0
        return Returned(None)

    def _mark_used(self, op: MarkUsed) -> Outcome | None:
        handle = self.handles.get(op.block) if isinstance(op.block, Handle) else None
        n_used = _int(op.n_used)
        if handle is None or n_used is None or not 0 <= n_used <= self.pool.block_size:
            return None
        handle.n_used = n_used
        if handle.owner is not None:
            self.pool.fill[handle.block_id] = n_used
        return Returned(None)

    def _shrink(self, op: Shrink) -> Outcome | None:
        stream, target_free = op.stream, _int(op.target_free)
        if not (isinstance(stream, str) and stream in self.pool.streams()):
            return None
        if target_free is None or target_free < 0:
            return None
        return Returned(self.pool.shrink(stream, target_free))

    def _owner_call(self, op: object, owner: int) -> Outcome | None:
        pool = self.pool
        if isinstance(op, FreeAll):
            mine = self._live(owner)
            pool.registered.discard(owner)
            pool.free_blocks([(owner, self.handles[name].block_id) for name in mine])
            for name in mine:
                self.handles[name].owner, self.handles[name].n_used = None, 0
            return Returned(None)
        if isinstance(op, RegisterOwner):
            if pool.is_active(owner):
                return Raised("OwnerAlreadyActiveError")
            pool.registered.add(owner)
            return Returned(None)
        if isinstance(op, ReleaseOwner):
            pool.registered.discard(owner)
            return Returned(None)
        return self._query(op)

    def _query(self, op: object) -> Outcome | None:
        pool = self.pool
        if isinstance(op, NFree) and isinstance(op.stream, str) and op.stream in pool.streams():
            return Returned(len(pool.free[pool.list_name(op.stream)]))
        owner = _int(getattr(op, "owner", None))
        if isinstance(op, BlocksFor) and owner is not None:
            return Returned(tuple(self._live(owner)))
        if isinstance(op, Stats):
            return Returned(pool.stats())
        return None

    def observe(self) -> Mapping[str, object]:
        pool = self.pool
        shown: dict[str, object] = {
            repr(Stats()): Returned(pool.stats()),
            repr(History()): Returned(tuple(pool.history)),
        }
        for stream in pool.streams():
            shown[repr(NFree(stream))] = self._query(NFree(stream))
        for owner in self.owners:
            shown[repr(BlocksFor(owner))] = self._query(BlocksFor(owner))
        for name, handle in self.handles.items():
            shown[repr(name)] = (
                handle.block_id,
                handle.stream,
                handle.fmt,
                handle.n_used,
                handle.owner,
                True,
            )
        return shown
