"""The block pool's invariants, checked by a full recount of its books.

``BlockPoolAllocator.check_invariants()`` hands its private structures to
:func:`first_violation` (under its lock) and raises if a message comes back.
Each check is a small function named for the invariant it verifies, and
each message starts with that name, so a failure in a test or a stress run
says at once what broke.

Complexity: O(n) in the number of block ids ever issued. Thread safety: the
caller must hold the pool's lock for the whole call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from veloxquant_mlx.memory.block_pool import AllocationStats, Block, PoolConfig


class PoolBooks(NamedTuple):
    """Read-only views of an allocator's private state, for checking."""

    config: PoolConfig
    free_lists: Mapping[str, Sequence[int]]
    owner_blocks: Mapping[int, Mapping[int, Block]]
    shared_counts: Mapping[int, int]
    retired_ids: Sequence[int]
    retired_set: AbstractSet[int]
    id_bound: int
    next_new_id: int
    ever_allocated: Sequence[bool]
    stats: AllocationStats


def _where_each_id_is(books: PoolBooks) -> tuple[dict[int, str], str | None]:
    """Map every id to the one place holding it, or report an id held twice."""
    places: dict[int, str] = {}
    holders: list[tuple[str, Sequence[int]]] = [
        (f"free list {name!r}", ids) for name, ids in books.free_lists.items()
    ]
    holders += [(f"owner {owner!r}", list(owned)) for owner, owned in books.owner_blocks.items()]
    holders.append(("the retired set", books.retired_ids))
    for place, ids in holders:
        for block_id in ids:
            shared = place.startswith("owner") and places.get(block_id, "").startswith("owner")
            if block_id in places and not shared:  # several owners: one shared id (refcount)
                return places, (
                    f"partition: block id {block_id} is in {places[block_id]} and in {place}"
                )
            places[block_id] = place
    return places, None


def _holders_of_each_id(books: PoolBooks) -> dict[int, int]:
    """Per checked-out id, how many owner maps hold a handle of it."""
    holders: dict[int, int] = {}
    for owned in books.owner_blocks.values():
        for block_id in owned:
            holders[block_id] = holders.get(block_id, 0) + 1
    return holders


def _one_handle_per_id(books: PoolBooks) -> dict[int, Block]:
    return {
        block_id: block
        for owned in books.owner_blocks.values()
        for block_id, block in owned.items()
    }


def check_refcounts(books: PoolBooks) -> str | None:
    """A shared id's count is its handles; the handles of one id agree; shared_blocks exact."""
    holders = _holders_of_each_id(books)
    shared = {block_id: n for block_id, n in holders.items() if n > 1}
    if dict(books.shared_counts) != shared:
        return f"refcount: counts {dict(books.shared_counts)} != handles per shared id {shared}"
    first = _one_handle_per_id(books)
    for owned in books.owner_blocks.values():
        for block_id, block in owned.items():
            one = first[block_id]
            if (block.stream, block.format, block.n_used) != (one.stream, one.format, one.n_used):
                return f"refcount: handles {one!r} and {block!r} of one id disagree"
    if books.stats.shared_blocks() != len(shared):
        return f"refcount: shared_blocks() is {books.stats.shared_blocks()}, expected {len(shared)}"
    return None


def check_partition(books: PoolBooks) -> str | None:
    """Every id ever issued is in exactly one of: a free list, an owner's map, retired."""
    places, duplicate = _where_each_id_is(books)
    if duplicate is not None:
        return duplicate
    stray = sorted(set(places) - set(range(books.next_new_id)))
    if stray:
        return f"partition: ids {stray[:5]} were never issued (next new id {books.next_new_id})"
    missing = sorted(set(range(books.next_new_id)) - set(places))
    if missing:
        return f"partition: ids {missing[:5]} are neither free, held nor retired (lost)"
    return None


def check_free_list_names(books: PoolBooks) -> str | None:
    """The free lists are exactly those of the pool's stream mode."""
    expected = {"k", "v"} if books.config.separate_kv else {"kv"}
    if set(books.free_lists) != expected:
        return f"free lists: expected {sorted(expected)}, found {sorted(books.free_lists)}"
    return None


def _handle_problem(owner: int, block_id: int, block: Block, books: PoolBooks) -> str | None:
    if block.block_id != block_id or block.owner != owner:
        return f"handle of id {block_id} under owner {owner} reads {block!r}"
    if block.stream not in books.free_lists:
        return f"handle {block!r} names stream {block.stream!r}, not one of this pool"
    if not 0 <= block.n_used <= books.config.block_size:
        return f"handle {block!r} has n_used outside 0..{books.config.block_size}"
    if not (block.ever_allocated and books.ever_allocated[block_id]):
        return f"ever_allocated: checked-out id {block_id} is not marked ever allocated"
    return None


def check_handles(books: PoolBooks) -> str | None:
    """Each owner map is non-empty and holds, per id, a consistent live handle."""
    for owner, owned in books.owner_blocks.items():
        if not owned:
            return f"handles: owner {owner} has an empty block map (should be released)"
        for block_id, block in owned.items():
            problem = _handle_problem(owner, block_id, block, books)
            if problem is not None:
                return f"handles: {problem}"
    return None


def check_retired_heap(books: PoolBooks) -> str | None:
    """The retired ids form a min-heap, so that growth re-issues the lowest first."""
    ids = books.retired_ids
    for child in range(1, len(ids)):
        if ids[(child - 1) // 2] > ids[child]:
            return f"retired heap: {ids[(child - 1) // 2]} sits above {ids[child]}"
    if set(ids) != books.retired_set:
        return "retired heap: the heap and the retired set hold different ids"
    if len(books.ever_allocated) != books.next_new_id:
        return (
            f"ever_allocated: tracks {len(books.ever_allocated)} ids, expected {books.next_new_id}"
        )
    return None


def check_counters(books: PoolBooks) -> str | None:
    """The counters equal a recount of the books."""
    stats, config = books.stats, books.config
    held = list(_one_handle_per_id(books).values())  # a shared block counts once
    n_free = sum(len(ids) for ids in books.free_lists.values())
    fragmented = sum(1 for block in held if 0 < block.n_used < config.block_size)
    expected_total = config.n_blocks + stats.n_grown - stats.n_retired
    comparisons = [
        ("n_blocks == free + in use", stats.n_blocks, n_free + len(held)),
        ("n_blocks == initial + grown - retired", stats.n_blocks, expected_total),
        ("blocks_in_use == recount", stats.blocks_in_use(), len(held)),
        ("_fragmented_count == recount", stats._fragmented_count, fragmented),
    ]
    for name, actual, expected in comparisons:
        if actual != expected:
            return f"counters: {name} fails: {actual} != {expected}"
    if stats.peak_blocks_in_use < len(held):
        return f"counters: peak_blocks_in_use {stats.peak_blocks_in_use} < in use {len(held)}"
    return None


def check_id_bound(books: PoolBooks) -> str | None:
    """``id_bound`` is one more than the highest id that is free or checked out."""
    in_pool = [i for i in range(books.next_new_id) if i not in books.retired_set]
    expected = max(in_pool) + 1 if in_pool else 0
    if books.id_bound != expected:
        return f"id bound: id_bound is {books.id_bound}, expected {expected}"
    return None


CHECKS: tuple[Callable[[PoolBooks], str | None], ...] = (
    check_free_list_names,
    check_partition,
    check_handles,
    check_refcounts,
    check_retired_heap,
    check_id_bound,
    check_counters,
)


def first_violation(books: PoolBooks) -> str | None:
    """Run every check in order; return the first failure's message, or ``None``."""
    for check in CHECKS:
        problem = check(books)
        if problem is not None:
            return problem
    return None
