"""The invariants of the block pool, as named predicates over `PoolState`.

Every transition preserves all of them. `broken_invariants(state)` names the
ones that fail, so tests and the conformance state machine can assert it is
empty after every step and say which rule broke.
"""

from __future__ import annotations

from collections.abc import Callable

from veloxquant_mlx_spec.model import PoolState, free_list_names, make_config, stats


def config_is_valid(state: PoolState) -> bool:
    """The config is one `PoolConfig` validation accepts, and history_len >= 0."""
    c = state.config
    remade = make_config(
        c.block_size, c.n_blocks, c.separate_kv, c.grow_on_exhaustion, c.max_blocks
    )
    return remade == c and state.history_len >= 0


def free_lists_are_the_streams(state: PoolState) -> bool:
    """Streams "k" and "v" with separate_kv, else the one shared stream "kv"."""
    names = tuple(stream for stream, _ in state.free_lists)
    return names == free_list_names(state.config)


def ids_are_partitioned(state: PoolState) -> bool:
    """Every id ever issued is in exactly one of: a free list, checked out (count >= 1), retired.

    So an id is on a free list iff its count is 0 and it is not retired.
    """
    free = [b for _, stack in state.free_lists for b in stack]
    held = [block_id for block_id, _ in state.ref_counts]
    return sorted([*free, *held, *state.retired]) == list(range(state.next_block_id))


def refcounts_match_handles(state: PoolState) -> bool:
    """An id's count is its live handles (ids ascending, counts >= 1); one handle per owner
    and id; the live handles of one id show the same stream, format and fill."""
    live = [v for v in state.handles if v.owner is not None]
    counts: dict[int, int] = {}
    for view in live:
        counts[view.block_id] = counts.get(view.block_id, 0) + 1
    agreed = {v.block_id: (v.stream, v.format, v.n_used) for v in live}
    return (
        state.ref_counts == tuple(sorted(counts.items()))
        and len({(v.owner, v.block_id) for v in live}) == len(live)
        and all((v.stream, v.format, v.n_used) == agreed[v.block_id] for v in live)
    )


def handles_are_well_formed(state: PoolState) -> bool:
    """Fill levels in [0, block_size]; live handles name a stream and a non-empty format."""
    streams = {stream for stream, _ in state.free_lists}
    return all(
        0 <= v.n_used <= state.config.block_size
        and (v.owner is None or (v.stream in streams and v.format != ""))
        for v in state.handles
    )


def ever_allocated_is_consistent(state: PoolState) -> bool:
    """Held blocks were handed out; retired and never-issued ids were not."""
    held = {block_id for block_id, _ in state.ref_counts}
    existing = set(range(state.next_block_id)) - state.retired
    return held <= state.ever_allocated <= existing


def n_blocks_is_a_recount(state: PoolState) -> bool:
    """initial + n_grown - n_retired == free blocks + checked-out blocks."""
    s = stats(state)
    n_free = sum(len(stack) for _, stack in state.free_lists)
    return s.n_blocks == n_free + s.blocks_in_use


def counters_are_sane(state: PoolState) -> bool:
    """Counters are non-negative and the peak covers the current use."""
    s = stats(state)
    counts = (s.n_allocations, s.n_frees, s.n_reused, s.n_exhausted, s.n_grown, s.n_retired)
    return min(counts) >= 0 and s.peak_blocks_in_use >= s.blocks_in_use


def growth_respects_max_blocks(state: PoolState) -> bool:
    """With growth on and a cap, the pool never holds more than max_blocks."""
    c = state.config
    capped = c.grow_on_exhaustion and c.max_blocks is not None
    return not capped or stats(state).n_blocks <= (c.max_blocks or 0)


def history_is_bounded(state: PoolState) -> bool:
    """At most history_len snapshots are kept."""
    return len(state.history) <= state.history_len


INVARIANTS: tuple[Callable[[PoolState], bool], ...] = (
    config_is_valid,
    free_lists_are_the_streams,
    ids_are_partitioned,
    refcounts_match_handles,
    handles_are_well_formed,
    ever_allocated_is_consistent,
    n_blocks_is_a_recount,
    counters_are_sane,
    growth_respects_max_blocks,
    history_is_bounded,
)


def broken_invariants(state: PoolState) -> tuple[str, ...]:
    """The names of the invariants `state` violates; empty when it is consistent."""
    return tuple(check.__name__ for check in INVARIANTS if not check(state))


def all_invariants_hold(state: PoolState) -> bool:
    """True when `state` satisfies every invariant."""
    return not broken_invariants(state)
