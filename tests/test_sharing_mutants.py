"""Sharing behaviour that mutation testing found unpinned
(mutation/SURVIVORS.md#3-sharing-issue-12-the-new-code).

Each test pins something a caller or operator sees of share, fork and
make_writable that ``test_sharing.py`` and the conformance machine left
open; the mutants each one kills are listed in mutation/SURVIVORS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
from conftest import assert_predicted_error_names, make_pool, stats_view

from veloxquant_mlx.memory._history import StatsHistory
from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
)
from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.invariants import broken_invariants
from veloxquant_mlx_spec.model import Err, ErrorKind, NotAList, PoolState, SpecConfig, new_pool

SHARING_HELP_TEXT = {
    "shared_blocks": "Blocks checked out to more than one owner.",
    "shares_total": "Handles issued by share and fork.",
    "copy_on_write_total": "make_writable calls that moved a handle to a new block.",
}


def every_reading(stats: AllocationStats) -> tuple[object, ...]:
    """What a caller can read of ``stats``: the reference's values and sharing's three."""
    reference = tuple(value for _, value in stats_view(stats))
    return (*reference, stats.shared_blocks(), stats.n_shares, stats.n_copy_on_write)


def busy_sharing_pool() -> BlockPoolAllocator:
    """A pool whose stats have every counter, sharing's included, above 0 and most distinct.

    block_size 4; 2 k and 2 v blocks; growth up to 8 blocks.
    """
    pool = make_pool(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=8)
    first = pool.allocate("k", 6, owner=1)  # ids 0 (4 tokens) and 1 (2 tokens)
    pool.free([pool.allocate("k", 1, owner=9)[0]])  # grows id 4; freed, so reused below
    pool.fork(1, 2)
    pool.fork(1, 3)
    pool.make_writable(pool.blocks_for(3)[0])  # id 0 -> 4: reused
    pool.make_writable(pool.blocks_for(2)[1])  # id 1 -> 5: grown
    pool.make_writable(pool.blocks_for(2)[0])  # id 0 -> 6: grown
    pool.mark_used(pool.blocks_for(2)[0], 3)  # id 5: 3 of 4 tokens
    pool.shrink("v", 1)  # retires one v block
    pool.free([first[1]])  # owner 3 still holds id 1
    pool.fork(3, 4)  # ids 1 and 4 shared again
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 100, owner=5)
    return pool


def test_is_shared_holds_exactly_while_a_block_has_two_live_handles_or_more() -> None:
    pool = make_pool()
    held = pool.allocate("k", 8, owner=1)  # ids 0, 1
    assert [pool.is_shared(i) for i in (0, 1, 2, 1000)] == [False] * 4
    second = pool.share([held[0]], owner=2)
    pool.share(second, owner=3)
    assert [pool.is_shared(i) for i in (0, 1, 2)] == [True, False, False]
    pool.free(second)
    assert pool.is_shared(0)  # owners 1 and 3 still hold it
    pool.free_all(3)
    assert not pool.is_shared(0)


@pytest.mark.parametrize(("sample", "help_text"), sorted(SHARING_HELP_TEXT.items()))
def test_sharing_metrics_help_line_says_what_the_metric_measures(
    sample: str, help_text: str
) -> None:
    pool = make_pool()
    pool.allocate("k", 4, owner=1)
    pool.fork(1, 2)
    lines = pool.stats.to_prometheus().splitlines()
    assert f"# HELP veloxquant_block_pool_{sample} {help_text}" in lines


def test_stats_after_shares_copies_and_frees_count_each_block_once() -> None:
    stats = busy_sharing_pool().stats
    # In use: ids 0, 1, 4, 5, 6 (peak 5), of 4 + 3 grown - 1 retired; partly filled: 1 and 5.
    assert every_reading(stats) == (6, 2, 2, 1, 1, 3, 1, 5, 2, 5, 2 / 6, 2, 6, 3)


def test_a_full_history_ring_keeps_every_counter_of_the_newest_stats() -> None:
    # The compiled build's history overwrites its oldest entry in place once full.
    newest = busy_sharing_pool().stats
    assert 0 not in every_reading(newest)  # so that a counter left behind shows
    history = StatsHistory(1)
    history.record(AllocationStats(n_blocks=1))
    history.record(newest)
    (entry,) = history.copy()
    assert isinstance(entry, AllocationStats)
    assert every_reading(entry) == every_reading(newest)


# Wrong-typed arguments, typed Any so that the calls below type-check.
JUNK: Any = "junk"
ONE_STR: Any = "1"
HOLDER_1 = "Block(block_id=0, stream='k', format='fp16', n_used=4, owner=1, ever_allocated=True)"
HOLDER_2 = HOLDER_1.replace("owner=1", "owner=2")
SharingCall = Callable[[BlockPoolAllocator, list[Block], list[Block]], object]

# (id, call on a pool whose one k block, id 0, owners 1 and 2 share, error, full message)
SHARING_MESSAGES: list[tuple[str, SharingCall, type[Exception], str]] = [
    (
        "share-not-a-list",
        lambda p, held, shared: p.share(cast(Any, held[0]), owner=3),
        TypeError,
        f"blocks must be a list of Block handles, got Block: {HOLDER_1}",
    ),
    (
        "share-one-id-twice",
        lambda p, held, shared: p.share([held[0], shared[0]], owner=3),
        InvalidFreeError,
        f"blocks[1] = {HOLDER_2} repeats block id 0; expected each block once",
    ),
    (
        "share-owner",
        lambda p, held, shared: p.share(held, owner=True),
        TypeError,
        "owner must be an int, got True (bool)",
    ),
    (
        "share-owner-holds-it",
        lambda p, held, shared: p.share(held, owner=2),
        ValueError,
        "owner 2 already holds block id 0; expected an owner holding none of the blocks "
        "it is given",
    ),
    (
        "fork-src_owner",
        lambda p, held, shared: p.fork(ONE_STR, 3),
        TypeError,
        "src_owner must be an int, got '1' (str)",
    ),
    (
        "fork-dst_owner",
        lambda p, held, shared: p.fork(1, JUNK),
        TypeError,
        "dst_owner must be an int, got 'junk' (str)",
    ),
    (
        "fork-to-itself",
        lambda p, held, shared: p.fork(1, 1),
        ValueError,
        "dst_owner must differ from src_owner=1, got 1",
    ),
    (
        "ref_count-type",
        lambda p, held, shared: p.ref_count(cast(Any, 1.0)),
        TypeError,
        "block_id must be an int >= 0, got 1.0 (float)",
    ),
    (
        "ref_count-negative",
        lambda p, held, shared: p.ref_count(-1),
        ValueError,
        "block_id must be an int >= 0, got -1",
    ),
    (
        "is_shared-type",
        lambda p, held, shared: p.is_shared(True),
        TypeError,
        "block_id must be an int >= 0, got True (bool)",
    ),
    (
        "is_shared-negative",
        lambda p, held, shared: p.is_shared(-2),
        ValueError,
        "block_id must be an int >= 0, got -2",
    ),
    (
        "mark_used-shared",
        lambda p, held, shared: p.mark_used(shared[0], 1),
        ValueError,
        f"block {HOLDER_2} is shared (reference count 2) and so read-only; expected a block "
        "with count 1: call make_writable(block) first",
    ),
    (
        "make_writable-not-live",
        lambda p, held, shared: p.make_writable(JUNK),
        InvalidFreeError,
        "block 'junk' is not a live handle of this pool; expected a block checked out from "
        "this pool and not yet freed",
    ),
    (
        "make_writable-exhausted",
        lambda p, held, shared: p.make_writable(shared[0]),
        BlockPoolExhaustedError,
        f"make_writable({HOLDER_2}) needs 1 free block on stream 'k', which has none; "
        "growth is off (PoolConfig.grow_on_exhaustion=False)",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(call, error, message, id=name)
        for name, call, error, message in SHARING_MESSAGES
    ],
)
def test_a_sharing_error_message_names_the_argument_the_expectation_and_the_value(
    call: SharingCall, error: type[Exception], message: str
) -> None:
    pool = make_pool(n_blocks=2)  # one k block: make_writable finds none free
    held = pool.allocate("k", 4, owner=1)
    shared = pool.share(held, owner=2)
    with pytest.raises(error) as raised:
        call(pool, held, shared)
    assert str(raised.value) == message


# ---- the block make_writable takes: reused, or grown up to the cap -------------------------


def test_make_writable_takes_one_handle_off_a_block_shared_three_ways() -> None:
    pool = make_pool()
    held = pool.allocate("k", 4, owner=1)  # id 0
    pool.fork(1, 2)
    third = pool.fork(1, 3)
    pool.make_writable(third[0])
    assert (pool.ref_count(0), pool.stats.shared_blocks()) == (2, 1)
    pool.make_writable(pool.blocks_for(2)[0])
    assert (pool.ref_count(0), pool.stats.shared_blocks()) == (1, 0)
    pool.mark_used(held[0], 2)  # owner 1 alone holds it again: writable
    pool.check_invariants()


@pytest.mark.parametrize(("n_used", "partly_filled"), [(0, 0), (1, 1), (3, 1), (4, 0)])
def test_make_writable_leaves_both_blocks_as_full_as_the_shared_one_was(
    n_used: int, partly_filled: int
) -> None:
    pool = make_pool()  # 8 blocks of 4 tokens
    held = pool.allocate("k", 4, owner=1)
    pool.mark_used(held[0], n_used)
    moved = pool.make_writable(pool.fork(1, 2)[0])
    assert (held[0].n_used, moved.n_used) == (n_used, n_used)
    assert pool.stats.fragmentation() == 2 * partly_filled / 8
    pool.check_invariants()


@pytest.mark.parametrize("n_used", [0, 1, 4])
def test_freeing_a_block_in_a_pool_that_shares_leaves_only_the_partly_filled_shared_one(
    n_used: int,
) -> None:
    pool = make_pool()  # 8 blocks of 4 tokens
    pool.allocate("k", 6, owner=1)  # ids 0 (4 tokens) and 1 (2 tokens)
    pool.fork(1, 2)  # frees now go through the shared path
    other = pool.allocate("k", 4, owner=3)
    pool.mark_used(other[0], n_used)
    pool.free(other)
    assert pool.stats.fragmentation() == 1 / 8  # id 1, counted once
    pool.check_invariants()


def test_make_writable_counts_a_block_handed_out_before_as_reused() -> None:
    pool = make_pool()
    pool.free(pool.allocate("k", 8, owner=9))  # ids 0 and 1 handed out, then freed
    held = pool.allocate("k", 4, owner=1)  # takes 1, from the top: reused
    shared = pool.share(held, owner=2)
    moved = pool.make_writable(shared[0])  # takes 0: reused again
    assert (held[0].block_id, moved.block_id) == (1, 0)
    assert pool.stats.n_reused == 2


def test_make_writable_may_grow_the_pool_to_exactly_max_blocks() -> None:
    pool = make_pool(n_blocks=2, grow_on_exhaustion=True, max_blocks=3)
    pool.allocate("k", 4, owner=1)  # the k stream's one block
    shared = pool.fork(1, 2)
    moved = pool.make_writable(shared[0])  # one more block reaches the cap, not past it
    assert (moved.block_id, pool.stats.n_blocks, pool.stats.n_grown) == (2, 3, 1)


def test_the_spec_lets_make_writable_grow_the_pool_to_exactly_max_blocks() -> None:
    config = SpecConfig(block_size=4, n_blocks=2, grow_on_exhaustion=True, max_blocks=3)
    state = new_pool(config)
    assert isinstance(state, PoolState), state
    state, _ = transitions.allocate(state, "k", 4, 1)  # handle 0: the k stream's one block
    state, _ = transitions.share(state, (0,), 2)  # handle 1
    state, moved = transitions.make_writable(state, 1)
    assert moved == 2, moved
    assert (state.handles[2].block_id, state.next_block_id, state.counters.n_grown) == (2, 3, 1)


# ---- a refused make_writable: what it counts --------------------------------------------


def test_every_refused_make_writable_counts_one_more_exhaustion() -> None:
    pool = make_pool(n_blocks=2)  # one block a stream, no growth
    pool.allocate("k", 4, owner=1)
    shared = pool.fork(1, 2)
    for expected in (1, 2):  # the second from 1: a counter set to 1 would stay there
        with pytest.raises(BlockPoolExhaustedError, match="make_writable"):
            pool.make_writable(shared[0])
        assert pool.stats.n_exhausted == expected


# ---- the spec's sharing errors ---------------------------------------------------------


def spec_shared() -> PoolState:
    """The spec's pool: block_size 4, 2 blocks (one per stream), no growth; owners 1 and 2
    share block 0 through handles 0 and 1."""
    state = new_pool(SpecConfig(block_size=4, n_blocks=2))
    assert isinstance(state, PoolState), state
    state, held = transitions.allocate(state, "k", 4, 1)
    state, shared = transitions.share(state, (0,), 2)
    assert (held, shared) == ((0,), (1,))
    return state


SPEC_ERROR_CASES: list[tuple[str, Callable[[], object], str, str | None]] = [
    ("share-not-a-list", lambda: transitions.share(spec_shared(), NotAList(), 3), "blocks", None),
    ("share-not-live", lambda: transitions.share(spec_shared(), (7,), 3), "blocks", "7"),
    ("share-one-id-twice", lambda: transitions.share(spec_shared(), (0, 1), 3), "blocks", "1"),
    ("share-owner-type", lambda: transitions.share(spec_shared(), (0,), "3"), "owner", "'3'"),
    ("share-owner-holds", lambda: transitions.share(spec_shared(), (0,), 2), "owner", "2"),
    ("fork-src_owner", lambda: transitions.fork(spec_shared(), 1.5, 3), "src_owner", "1.5"),
    ("fork-dst_owner", lambda: transitions.fork(spec_shared(), 1, None), "dst_owner", "None"),
    ("fork-to-itself", lambda: transitions.fork(spec_shared(), 4, 4), "dst_owner", "4"),
    ("mark_used-shared", lambda: transitions.mark_used(spec_shared(), 1, 2), "block", "0"),
    ("make_writable", lambda: transitions.make_writable(spec_shared(), 9), "block", "9"),
    ("make_writable-0-free", lambda: transitions.make_writable(spec_shared(), 1), "block", "'k'"),
    ("ref_count-type", lambda: transitions.ref_count(spec_shared(), "0"), "block_id", "'0'"),
    ("ref_count-value", lambda: transitions.ref_count(spec_shared(), -4), "block_id", "-4"),
    ("is_shared-type", lambda: transitions.is_shared(spec_shared(), 0.0), "block_id", "0.0"),
]


@pytest.mark.parametrize(
    ("call", "argument", "offending"),
    [
        pytest.param(call, argument, offending, id=name)
        for name, call, argument, offending in SPEC_ERROR_CASES
    ],
)
def test_a_sharing_error_the_spec_predicts_names_the_argument_then_the_value(
    call: Callable[[], object], argument: str, offending: str | None
) -> None:
    assert_predicted_error_names(call(), argument, offending)


def test_the_spec_says_a_block_with_two_live_handles_is_shared() -> None:
    state = spec_shared()
    assert (transitions.ref_count(state, 0), transitions.is_shared(state, 0)) == (2, True)
    assert (transitions.ref_count(state, 1), transitions.is_shared(state, 1)) == (0, False)


# ---- the spec's make_writable: the block it takes, and what it counts ------------------


def spec_state(n_blocks: int = 8, *, grow_on_exhaustion: bool = False) -> PoolState:
    """The spec's pool of ``n_blocks`` blocks of 4 tokens, k and v apart."""
    config = SpecConfig(block_size=4, n_blocks=n_blocks, grow_on_exhaustion=grow_on_exhaustion)
    state = new_pool(config)
    assert isinstance(state, PoolState), state
    return state


def test_the_spec_counts_a_block_make_writable_takes_that_was_handed_out_before_as_reused() -> None:
    state, first = transitions.allocate(spec_state(), "k", 8, 9)  # ids 0 and 1
    assert isinstance(first, tuple), first
    state, _ = transitions.free(state, first)
    state, held = transitions.allocate(state, "k", 4, 1)  # takes 1, from the top: reused
    assert isinstance(held, tuple), held
    state, shared = transitions.share(state, held, 2)
    assert isinstance(shared, tuple), shared
    state, moved = transitions.make_writable(state, shared[0])  # takes 0: reused again
    assert isinstance(moved, int), moved
    assert (state.handles[held[0]].block_id, state.handles[moved].block_id) == (1, 0)
    assert state.counters.n_reused == 2
    assert transitions.free_list_for(state, "k") == (3, 2)  # only the block it took is gone


def test_the_spec_takes_the_id_make_writable_grows_onto_off_the_retired_set() -> None:
    state, held = transitions.allocate(spec_state(n_blocks=2, grow_on_exhaustion=True), "k", 4, 1)
    state, n_retired = transitions.shrink(state, "v", 0)  # retires id 1, the v stream's one
    assert (n_retired, state.retired) == (1, frozenset({1}))
    assert isinstance(held, tuple), held
    state, shared = transitions.share(state, held, 2)
    assert isinstance(shared, tuple), shared
    state, moved = transitions.make_writable(state, shared[0])  # k has none free: grows
    assert isinstance(moved, int), moved
    assert (state.handles[moved].block_id, state.retired) == (1, frozenset())
    assert broken_invariants(state) == ()


def test_the_spec_counts_every_refused_make_writable_as_one_more_exhaustion() -> None:
    state = spec_shared()  # the k stream's one block, shared by handles 0 and 1
    for expected in (1, 2):
        state, refused = transitions.make_writable(state, 1)
        assert isinstance(refused, Err) and refused.kind is ErrorKind.EXHAUSTED, refused
        assert state.counters.n_exhausted == expected
