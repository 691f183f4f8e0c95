"""Shared blocks: share, fork, ref_count, make_writable and freeing with counts.

Written from docs/CONTRACT.md#sharing, black box: every expectation is what a
caller sees (ids, handles, counts, stats, errors). The planted sharing bugs
and the layers that must catch them are in ``test_sharing_planted_bugs.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import (
    assert_only_exhaustion_recorded,
    block_ids,
    make_pool,
    observe,
    pool_unchanged,
    stats_view,
    take_all_free,
)

from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
    InvariantViolationError,
)


def forked_pool() -> tuple[BlockPoolAllocator, list[Block], list[Block]]:
    """block_size 4, 8 blocks; owner 1 holds ids 0, 1 (6 tokens) and fork(1, 2) shares both."""
    pool = make_pool()
    first = pool.allocate("k", 6, owner=1)
    second = pool.fork(1, 2)
    return pool, first, second


# ---- share and fork ------------------------------------------------------------------


def test_fork_gives_new_handles_of_the_same_blocks_in_allocation_order() -> None:
    pool, first, second = forked_pool()
    assert block_ids(second) == [0, 1]
    assert [(b.stream, b.format, b.n_used, b.owner) for b in second] == [
        ("k", "fp16", 4, 2),
        ("k", "fp16", 2, 2),
    ]
    assert all(a is not b for a, b in zip(first, second, strict=True))
    assert pool.blocks_for(2) == second
    assert all(pool.is_live(block) for block in first + second)


def test_fork_takes_k_and_v_blocks_alike() -> None:
    pool = make_pool()
    pool.allocate("k", 4, owner=1)
    pool.allocate("v", 4, owner=1)
    assert [(b.block_id, b.stream) for b in pool.fork(1, 2)] == [(0, "k"), (4, "v")]


def test_share_gives_one_new_handle_per_block_in_list_order() -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 12, owner=1)
    shared = pool.share([blocks[2], blocks[0]], owner=3)
    assert block_ids(shared) == [2, 0]
    assert [pool.ref_count(i) for i in range(4)] == [2, 1, 2, 0]


def test_blocks_in_use_counts_each_shared_block_once() -> None:
    pool, _, _ = forked_pool()
    stats = pool.stats
    assert stats.blocks_in_use() == 2
    assert stats.shared_blocks() == 2
    assert stats.n_shares == 2
    assert stats.fragmentation() == 1 / 8  # block 1 holds 2 of 4 tokens, counted once
    assert stats.n_allocations == 1


def test_ref_count_is_zero_for_free_retired_and_never_issued_ids() -> None:
    pool, _, _ = forked_pool()
    pool.shrink("v", 2)  # retires 7 and 6
    assert [pool.ref_count(i) for i in (0, 1, 2, 6, 7, 8, 1000)] == [2, 2, 0, 0, 0, 0, 0]


class IdSubclass(int):
    """An int subclass (C-INT-NOT-BOOL accepts it) whose own methods lie about its value:
    the pool reads the value itself."""

    def __int__(self) -> int:
        return -7

    def __lt__(self, other: object) -> bool:
        return False


def test_ref_count_and_is_shared_read_an_int_subclass_as_its_value() -> None:
    pool, _, _ = forked_pool()
    ids = (0, 1, 2, 1000)
    assert [pool.ref_count(IdSubclass(i)) for i in ids] == [pool.ref_count(i) for i in ids]
    assert [pool.ref_count(i) for i in ids] == [2, 2, 0, 0]
    assert [pool.is_shared(IdSubclass(i)) for i in ids] == [True, True, False, False]
    for read in (pool.ref_count, pool.is_shared):  # its __lt__ says it is not below 0
        with pytest.raises(ValueError, match="block_id must be an int >= 0, got -3"):
            read(IdSubclass(-3))


@pytest.mark.parametrize(
    ("block_id", "error"), [(True, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError)]
)
def test_ref_count_rejects_a_bad_block_id(block_id: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="block_id"):
        make_pool().ref_count(block_id)  # type: ignore[arg-type]


def test_share_of_an_empty_list_changes_nothing() -> None:
    pool = make_pool()
    with pool_unchanged(pool, owners=[3]):
        assert pool.share([], owner=3) == []
    pool.register_owner(3)  # owner 3 did not become active


def test_fork_of_an_owner_holding_nothing_changes_nothing() -> None:
    pool = make_pool()
    with pool_unchanged(pool, owners=[1, 2]):
        assert pool.fork(1, 2) == []
    pool.register_owner(2)


def test_share_and_fork_each_add_one_history_snapshot() -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 4, owner=1)
    pool.share(blocks, owner=2)
    pool.fork(1, 3)
    assert [entry.n_shares for entry in pool.history] == [0, 1, 2]


def test_history_holds_every_counter_before_and_after_the_first_share() -> None:
    def sharing_view(stats: AllocationStats) -> tuple[object, ...]:
        counts = (stats.n_shares, stats.n_copy_on_write, stats.shared_blocks())
        return (*stats_view(stats), counts)

    pool = make_pool()
    after_each_call = []
    for call in (
        lambda: pool.allocate("k", 6, owner=1),
        lambda: pool.fork(1, 2),
        lambda: pool.make_writable(pool.blocks_for(2)[1]),
        lambda: pool.allocate("k", 1, owner=3),
        lambda: pool.free_all(1),
        lambda: pool.free_all(2),
    ):
        call()
        after_each_call.append(sharing_view(pool.stats))
    assert [sharing_view(entry) for entry in pool.history] == after_each_call
    assert after_each_call[-1][-1] == (2, 1, 0)


SHARE_ERRORS: list[tuple[str, Callable[[BlockPoolAllocator, list[Block]], object], type]] = [
    ("blocks-not-a-list", lambda p, b: p.share(b[0], owner=3), TypeError),  # type: ignore[arg-type]
    ("stale-handle", lambda p, b: p.share([b[-1]], owner=3), InvalidFreeError),
    ("not-a-block", lambda p, b: p.share([0], owner=3), InvalidFreeError),  # type: ignore[list-item]
    ("one-handle-twice", lambda p, b: p.share([b[0], b[0]], owner=3), InvalidFreeError),
    ("one-id-by-two-handles", lambda p, b: p.share([b[0], b[2]], owner=3), InvalidFreeError),
    ("owner-a-bool", lambda p, b: p.share([b[0]], owner=True), TypeError),
    ("owner-holds-the-id", lambda p, b: p.share([b[1], b[0]], owner=2), ValueError),
    ("owner-is-the-holder", lambda p, b: p.share([b[1]], owner=1), ValueError),
    ("fork-to-itself", lambda p, b: p.fork(1, 1), ValueError),
    ("fork-src-a-bool", lambda p, b: p.fork(True, 3), TypeError),
    ("fork-dst-a-str", lambda p, b: p.fork(1, "3"), TypeError),  # type: ignore[arg-type]
    ("fork-dst-holds-an-id", lambda p, b: p.fork(1, 2), ValueError),
]


@pytest.mark.parametrize(
    ("call", "error"),
    [pytest.param(call, error, id=name) for name, call, error in SHARE_ERRORS],
)
def test_a_rejected_share_or_fork_changes_nothing(
    call: Callable[[BlockPoolAllocator, list[Block]], object], error: type[Exception]
) -> None:
    pool = make_pool()
    held = pool.allocate("k", 8, owner=1)  # ids 0, 1
    stale = pool.allocate("v", 4, owner=1)
    pool.free(stale)
    shared = pool.share([held[0]], owner=2)  # id 0: owner 1 and owner 2
    blocks = [*held, shared[0], stale[0]]
    with pool_unchanged(pool, owners=[1, 2, 3], handles=blocks), pytest.raises(error):
        call(pool, blocks)


def test_share_names_the_repeated_block_id() -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 4, owner=1)
    other = pool.share(blocks, owner=2)
    with pytest.raises(InvalidFreeError, match="repeats block id 0"):
        pool.share([blocks[0], other[0]], owner=3)


# ---- read-only shared blocks -----------------------------------------------------------


def test_mark_used_on_a_shared_block_raises_naming_the_block_and_its_count() -> None:
    pool, first, second = forked_pool()
    with (
        pool_unchanged(pool, owners=[1, 2], handles=first + second),
        pytest.raises(ValueError, match=r"block_id=1.*reference count 2"),
    ):
        pool.mark_used(second[1], 3)


def test_mark_used_is_allowed_again_once_the_block_is_no_longer_shared() -> None:
    pool, first, second = forked_pool()
    pool.free([second[1]])
    pool.mark_used(first[1], 3)
    assert first[1].n_used == 3


# ---- make_writable ---------------------------------------------------------------------


def test_make_writable_of_an_unshared_block_returns_the_same_handle_and_changes_nothing() -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 6, owner=1)
    with pool_unchanged(pool, owners=[1], handles=blocks):
        assert pool.make_writable(blocks[1]) is blocks[1]


def test_make_writable_moves_the_handle_to_the_next_free_block_of_its_stream() -> None:
    pool, first, second = forked_pool()
    moved = pool.make_writable(second[1])
    assert (moved.block_id, moved.stream, moved.format, moved.n_used, moved.owner) == (
        2,
        "k",
        "fp16",
        2,
        2,
    )
    assert (second[1].owner, second[1].n_used) == (None, 0)
    assert [pool.ref_count(i) for i in (0, 1, 2)] == [2, 1, 1]
    assert pool.blocks_for(2) == [second[0], moved]  # the new handle is the owner's newest
    stats = pool.stats
    assert (stats.n_copy_on_write, stats.shared_blocks(), stats.blocks_in_use()) == (1, 1, 3)
    assert stats.n_allocations == 1
    assert pool.history[-1].n_copy_on_write == 1
    pool.mark_used(moved, 3)
    pool.mark_used(first[1], 4)
    pool.check_invariants()


def test_make_writable_reuses_a_freed_block_as_allocate_would() -> None:
    pool = make_pool()
    scratch = pool.allocate("k", 4, owner=9)
    pool.free(scratch)  # id 0 is on top and was handed out before
    blocks = pool.allocate("k", 4, owner=1)  # takes 0 again
    shared = pool.share(blocks, owner=2)
    assert pool.make_writable(shared[0]).block_id == 1
    assert pool.stats.n_reused == 1  # only the allocation of id 0


def test_make_writable_grows_the_pool_when_the_stream_is_empty() -> None:
    pool = make_pool(n_blocks=2, grow_on_exhaustion=True)
    blocks = pool.allocate("k", 4, owner=1)
    shared = pool.fork(1, 2)
    moved = pool.make_writable(shared[0])
    assert (moved.block_id, pool.stats.n_grown, pool.stats.n_blocks) == (2, 1, 3)
    assert pool.ref_count(blocks[0].block_id) == 1
    pool.check_invariants()


def test_make_writable_without_a_free_block_is_exhausted_and_counts_only_that() -> None:
    pool = make_pool(n_blocks=2)
    blocks = pool.allocate("k", 4, owner=1)
    shared = pool.fork(1, 2)
    before = observe(pool, owners=[1, 2], handles=blocks + shared)
    with pytest.raises(BlockPoolExhaustedError, match="make_writable"):
        pool.make_writable(shared[0])
    after = observe(pool, owners=[1, 2], handles=blocks + shared)
    assert_only_exhaustion_recorded(before, after)
    assert pool.ref_count(0) == 2


@pytest.mark.parametrize("which", ["stale", "foreign", "not-a-block"])
def test_make_writable_rejects_anything_but_a_live_handle(which: str) -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 4, owner=1)
    stale = pool.allocate("k", 4, owner=1)
    pool.free(stale)
    candidates = {
        "stale": stale[0],
        "foreign": make_pool().allocate("k", 4, owner=1)[0],
        "not-a-block": "block 0",
    }
    with pool_unchanged(pool, owners=[1], handles=blocks + stale), pytest.raises(InvalidFreeError):
        pool.make_writable(candidates[which])  # type: ignore[arg-type]


# ---- freeing shared blocks -------------------------------------------------------------


def test_a_shared_block_goes_back_only_with_its_last_handle() -> None:
    pool, first, _second = forked_pool()
    pool.free_all(1)
    assert pool.n_free("k") == 2
    assert [pool.ref_count(i) for i in (0, 1)] == [1, 1]
    assert all(b.owner is None for b in first)
    assert pool.stats.n_frees == 1  # the call released handles, though no block went back
    pool.free_all(2)
    assert pool.n_free("k") == 4
    assert pool.stats.blocks_in_use() == 0
    assert sorted(take_all_free(pool, "k", owner=5)) == [0, 1, 2, 3]  # each id once


def test_two_handles_of_one_block_in_one_free_push_it_once_at_the_last() -> None:
    pool = make_pool()
    blocks = pool.allocate("k", 8, owner=1)  # ids 0, 1
    other = pool.share([blocks[0]], owner=2)
    pool.free([other[0], blocks[1], blocks[0]])  # 0 goes back at its last handle, on top
    assert pool.n_free("k") == 4
    assert block_ids(pool.allocate("k", 8, owner=3)) == [0, 1]


def test_freeing_the_same_handle_twice_in_one_list_is_still_rejected() -> None:
    pool, first, second = forked_pool()
    with (
        pool_unchanged(pool, owners=[1, 2], handles=first + second),
        pytest.raises(InvalidFreeError, match="more than once"),
    ):
        pool.free([first[0], second[0], first[0]])


def test_an_owner_whose_last_shared_handle_goes_is_released() -> None:
    pool, _first, second = forked_pool()
    pool.free(second)
    pool.register_owner(2)
    assert pool.ref_count(0) == 1


# ---- stats, Prometheus, check_invariants ----------------------------------------------


def test_the_sharing_metrics_appear_once_the_pool_has_shared() -> None:
    pool = make_pool()
    pool.allocate("k", 4, owner=1)
    assert "shares_total" not in pool.stats.to_prometheus()
    pool.fork(1, 2)
    text = pool.stats.to_prometheus()
    assert "veloxquant_block_pool_shared_blocks 1\n" in text
    assert "veloxquant_block_pool_shares_total 1\n" in text
    assert "veloxquant_block_pool_copy_on_write_total 0\n" in text


def _bump_count(pool: BlockPoolAllocator) -> None:
    pool._shared_counts[0] += 1


def _forget_count(pool: BlockPoolAllocator) -> None:
    del pool._shared_counts[0]


def _count_a_free_id(pool: BlockPoolAllocator) -> None:
    pool._shared_counts[5] = 2


def _miscount_shared_blocks(pool: BlockPoolAllocator) -> None:
    pool._stats._shared_blocks += 1


@pytest.mark.parametrize(
    "corrupt", [_bump_count, _forget_count, _count_a_free_id, _miscount_shared_blocks]
)
def test_check_invariants_checks_the_counts_against_the_handles(
    corrupt: Callable[[BlockPoolAllocator], None],
) -> None:
    pool, _, _ = forked_pool()
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(InvariantViolationError, match=r"^refcount:"):
        pool.check_invariants()


def test_check_invariants_catches_handles_of_one_block_that_disagree() -> None:
    pool, _first, second = forked_pool()
    second[1].n_used = 4  # a direct write, which the contract forbids (C-NO-FIELD-WRITES)
    with pytest.raises(InvariantViolationError, match="disagree"):
        pool.check_invariants()
