"""Properties: a Hypothesis state machine against a plain model, and check_invariants().

The model below is the contract written as plain Python: a stack of free ids
per stream, each owner's ids in allocation order, the retired ids, and the
counters. Every step compares the pool with it (exact ids, every handle's
fields, every counter, the history) and calls ``check_invariants()``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import (
    STATS_COUNTERS,
    StatsView,
    block_ids,
    handle_view,
    make_pool,
    stats_view,
    stream_names,
)
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
    InvariantViolationError,
    OwnerAlreadyActiveError,
)

OWNERS = (0, 1, 2, 3)
STREAMS = ("k", "v", "kv")


@dataclass
class PoolModel:
    """The contract's bookkeeping, with nothing optimised."""

    block_size: int
    separate_kv: bool
    grow_on_exhaustion: bool
    max_blocks: int | None
    history_len: int
    free: dict[str, list[int]]  # stream -> free ids, top of the stack last
    owned: dict[int, list[int]] = field(default_factory=dict)  # owner -> ids, allocation order
    fill: dict[int, int] = field(default_factory=dict)  # checked-out id -> n_used
    fmt: dict[int, str] = field(default_factory=dict)  # checked-out id -> format
    stream: dict[int, str] = field(default_factory=dict)  # checked-out id -> its free list
    registered: set[int] = field(default_factory=set)
    ever_allocated: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    highest_issued: int = -1
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS_COUNTERS, 0))
    history: deque[StatsView] = field(default_factory=deque)

    @classmethod
    def new(
        cls,
        *,
        block_size: int,
        n_blocks: int,
        separate_kv: bool,
        grow_on_exhaustion: bool,
        max_blocks: int | None,
        history_len: int,
    ) -> PoolModel:
        n_k = math.ceil(n_blocks / 2)
        if separate_kv:
            free = {"k": list(range(n_k))[::-1], "v": list(range(n_k, n_blocks))[::-1]}
        else:
            free = {"kv": list(range(n_blocks))[::-1]}
        model = cls(
            block_size=block_size,
            separate_kv=separate_kv,
            grow_on_exhaustion=grow_on_exhaustion,
            max_blocks=max_blocks,
            history_len=history_len,
            free=free,
        )
        model.history = deque(maxlen=history_len)
        model.highest_issued = n_blocks - 1
        model.counters["n_blocks"] = n_blocks
        return model

    def list_name(self, stream: str) -> str:
        return stream if self.separate_kv else "kv"

    def is_active(self, owner: int) -> bool:
        return owner in self.owned or owner in self.registered

    def in_use(self) -> int:
        return len(self.fill)

    def fragmented(self) -> int:
        return sum(1 for n_used in self.fill.values() if 0 < n_used < self.block_size)

    def expected_stats(self) -> StatsView:
        values: list[tuple[str, float]] = [(name, self.counters[name]) for name in STATS_COUNTERS]
        n_blocks = self.counters["n_blocks"]
        values.append(("_fragmented_count", self.fragmented()))
        values.append(("blocks_in_use()", self.in_use()))
        values.append(("fragmentation()", self.fragmented() / n_blocks if n_blocks else 0.0))
        return tuple(values)

    def record(self) -> None:
        self.history.append(self.expected_stats())

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
        total = self.counters["n_blocks"]
        if missing and not (
            self.grow_on_exhaustion
            and (self.max_blocks is None or total + missing <= self.max_blocks)
        ):
            self.counters["n_exhausted"] += 1
            self.record()
            return None
        ids = [free.pop() for _ in range(needed - missing)] + self.new_block_ids(missing)
        self.counters["n_blocks"] += missing
        self.counters["n_grown"] += missing
        self.counters["n_allocations"] += 1
        self.counters["n_reused"] += sum(1 for i in ids if i in self.ever_allocated)
        self.ever_allocated.update(ids)
        remainder = n_tokens - self.block_size * (needed - 1)
        for position, block_id in enumerate(ids):
            last = position == len(ids) - 1
            self.fill[block_id] = remainder if last else self.block_size
            self.fmt[block_id] = fmt
            self.stream[block_id] = self.list_name(stream)
        self.owned.setdefault(owner, []).extend(ids)
        peak = max(self.counters["peak_blocks_in_use"], self.in_use())
        self.counters["peak_blocks_in_use"] = peak
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
        self.counters["n_blocks"] -= n_retire
        self.counters["n_retired"] += n_retire
        self.record()
        return n_retire


@st.composite
def pool_settings(draw: st.DrawFn) -> dict[str, Any]:
    n_blocks = draw(st.integers(0, 8))
    grow = draw(st.booleans())
    max_blocks = draw(st.none() | st.integers(n_blocks, n_blocks + 6)) if grow else None
    return {
        "block_size": draw(st.integers(1, 4)),
        "n_blocks": n_blocks,
        "separate_kv": draw(st.booleans()),
        "grow_on_exhaustion": grow,
        "max_blocks": max_blocks,
        "history_len": draw(st.sampled_from([0, 3, 1024])),
    }


class BlockPoolMachine(RuleBasedStateMachine):
    """Random call sequences on one pool, checked step by step against PoolModel."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool()
        self.model = PoolModel.new(
            block_size=4,
            n_blocks=8,
            separate_kv=True,
            grow_on_exhaustion=False,
            max_blocks=None,
            history_len=1024,
        )
        self.live: dict[int, list[Block]] = {}  # owner -> handles, allocation order
        self.stale: list[tuple[Block, int]] = []  # handle, the n_used it must show

    @initialize(settings=pool_settings())
    def build_pool(self, settings: dict[str, Any]) -> None:
        self.pool = make_pool(**settings)
        self.model = PoolModel.new(**settings)

    def live_handles(self) -> list[Block]:
        return [block for blocks in self.live.values() for block in blocks]

    def owner_of(self, handle: Block) -> int:
        return next(o for o, blocks in self.live.items() if any(b is handle for b in blocks))

    def stream_is_valid(self, stream: str) -> bool:
        return stream in stream_names(self.pool)

    def retire_handles(self, handles: list[Block]) -> None:
        for owner, blocks in list(self.live.items()):
            self.live[owner] = [b for b in blocks if all(b is not h for h in handles)]
            if not self.live[owner]:
                del self.live[owner]
        self.stale = [*self.stale, *((handle, 0) for handle in handles)][-12:]

    @rule(
        stream=st.sampled_from(STREAMS),
        n_tokens=st.integers(1, 14),
        owner=st.sampled_from(OWNERS),
        fmt=st.sampled_from(["fp16", "int2"]),
    )
    def allocate(self, stream: str, n_tokens: int, owner: int, fmt: str) -> None:
        if not self.stream_is_valid(stream):
            with pytest.raises(ValueError):
                self.pool.allocate(stream, n_tokens, owner, fmt)
            return
        expected = self.model.allocate(stream, n_tokens, owner, fmt)
        if expected is None:
            with pytest.raises(BlockPoolExhaustedError):
                self.pool.allocate(stream, n_tokens, owner, fmt)
            return
        blocks = self.pool.allocate(stream, n_tokens, owner, fmt)
        assert block_ids(blocks) == expected
        assert all(b.stream == self.model.list_name(stream) for b in blocks)
        self.live.setdefault(owner, []).extend(blocks)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        handles = data.draw(st.permutations(self.live_handles()))
        chosen = handles[: data.draw(st.integers(0, len(handles)))]
        self.model.free_blocks([(self.owner_of(b), b.block_id) for b in chosen])
        self.pool.free(chosen)
        self.retire_handles(chosen)

    @rule(owner=st.sampled_from(OWNERS))
    def free_all(self, owner: int) -> None:
        handles = self.live.get(owner, [])
        self.pool.free_all(owner)
        self.model.registered.discard(owner)
        self.model.free_blocks([(owner, b.block_id) for b in handles])
        self.retire_handles(handles)

    @rule(stream=st.sampled_from(STREAMS), target_free=st.integers(0, 5))
    def shrink(self, stream: str, target_free: int) -> None:
        if not self.stream_is_valid(stream):
            with pytest.raises(ValueError):
                self.pool.shrink(stream, target_free)
            return
        assert self.pool.shrink(stream, target_free) == self.model.shrink(stream, target_free)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def mark_used(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.live_handles()))
        n_used = data.draw(st.integers(0, self.model.block_size))
        self.pool.mark_used(block, n_used)
        self.model.fill[block.block_id] = n_used

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def mark_used_on_a_stale_handle(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.stale) - 1))
        n_used = data.draw(st.integers(0, self.model.block_size))
        block, _ = self.stale[index]
        self.pool.mark_used(block, n_used)
        self.stale[index] = (block, n_used)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def free_a_stale_handle(self, data: st.DataObject) -> None:
        block, _ = data.draw(st.sampled_from(self.stale))
        live = self.live_handles()
        with pytest.raises(InvalidFreeError):
            self.pool.free([*live[:1], block])

    @rule(owner=st.sampled_from(OWNERS))
    def register_owner(self, owner: int) -> None:
        if self.model.is_active(owner):
            with pytest.raises(OwnerAlreadyActiveError):
                self.pool.register_owner(owner)
        else:
            self.pool.register_owner(owner)
            self.model.registered.add(owner)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: int) -> None:
        self.pool.release_owner(owner)
        self.model.registered.discard(owner)

    @invariant()
    def invariants_hold(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def stats_match_the_model(self) -> None:
        assert stats_view(self.pool.stats) == self.model.expected_stats()

    @invariant()
    def history_matches_the_model(self) -> None:
        assert [stats_view(entry) for entry in self.pool.history] == list(self.model.history)

    @invariant()
    def free_counts_match_the_model(self) -> None:
        for stream in stream_names(self.pool):
            assert self.pool.n_free(stream) == len(self.model.free[self.model.list_name(stream)])

    @invariant()
    def owners_hold_exactly_their_live_handles(self) -> None:
        for owner in OWNERS:
            listed = self.pool.blocks_for(owner)
            held = self.live.get(owner, [])
            assert [id(b) for b in listed] == [id(b) for b in held]
            assert block_ids(listed) == self.model.owned.get(owner, [])

    @invariant()
    def live_handles_show_their_state(self) -> None:
        for owner, blocks in self.live.items():
            for block in blocks:
                assert handle_view(block) == (
                    block.block_id,
                    self.model.stream[block.block_id],
                    self.model.fmt[block.block_id],
                    self.model.fill[block.block_id],
                    owner,
                    True,
                )

    @invariant()
    def stale_handles_stay_stale(self) -> None:
        for block, n_used in self.stale:
            assert (block.owner, block.n_used, block.ever_allocated) == (None, n_used, True)


TestBlockPoolMachine = BlockPoolMachine.TestCase


# ---------------------------------------------------------------- check_invariants


def private(pool: BlockPoolAllocator, name: str) -> Any:
    """A private attribute the corruption tests poke at, or a skip naming it."""
    if not hasattr(pool, name):
        pytest.skip(f"BlockPoolAllocator has no {name}; corruption test needs the lead's name")
    return getattr(pool, name)


def bump_stat(name: str) -> Callable[[BlockPoolAllocator, list[Block]], None]:
    def corrupt(pool: BlockPoolAllocator, blocks: list[Block]) -> None:
        stats = private(pool, "_stats")
        setattr(stats, name, getattr(stats, name) + 1)

    return corrupt


CORRUPTIONS: list[tuple[str, Callable[[BlockPoolAllocator, list[Block]], None]]] = [
    ("in-use-id-on-free-list", lambda p, b: private(p, "_free_lists")["k"].append(0)),
    ("free-id-on-free-list-twice", lambda p, b: private(p, "_free_lists")["k"].append(3)),
    ("free-id-lost", lambda p, b: private(p, "_free_lists")["v"].pop()),
    ("owned-id-lost", lambda p, b: private(p, "_owner_blocks")[1].pop(0)),
    ("n_blocks-off-by-one", bump_stat("n_blocks")),
    ("fragmented-count-off-by-one", bump_stat("_fragmented_count")),
    ("fill-level-written-directly", lambda p, b: setattr(b[1], "n_used", 4)),
    ("owner-written-directly", lambda p, b: setattr(b[0], "owner", 2)),
]


def test_check_invariants_passes_on_a_fresh_pool() -> None:
    for separate_kv in (True, False):
        make_pool(n_blocks=7, separate_kv=separate_kv).check_invariants()


@pytest.mark.parametrize(
    "corrupt", [pytest.param(corrupt, id=name) for name, corrupt in CORRUPTIONS]
)
def test_check_invariants_catches_corruption(
    corrupt: Callable[[BlockPoolAllocator, list[Block]], None],
) -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 6, owner=1)  # ids 0 (full) and 1 (n_used 2); k free: 2, 3
    pool.check_invariants()
    corrupt(pool, blocks)
    with pytest.raises(InvariantViolationError) as excinfo:
        pool.check_invariants()
    assert str(excinfo.value)


def test_invariant_violation_error_is_an_assertion_error() -> None:
    assert issubclass(InvariantViolationError, AssertionError)
