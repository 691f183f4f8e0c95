"""Unit tests of the executable spec alone: hand-worked examples from docs/CONTRACT.md.

Each test pins one rule of the contract by predicting exact block ids,
handle views and counters; none of them touches the implementation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import pytest

from veloxquant_mlx_spec.invariants import broken_invariants
from veloxquant_mlx_spec.model import (
    STATS_FIELDS,
    Err,
    ErrorKind,
    ForeignBlock,
    HandleArg,
    HandleView,
    NotABlock,
    NotAList,
    PoolState,
    SpecConfig,
    StatsView,
    free_list_names,
    make_config,
    new_pool,
    stats,
    stream_names,
)
from veloxquant_mlx_spec.transitions import (
    allocate,
    blocks_for,
    free,
    free_all,
    free_list_for,
    id_bound,
    is_active,
    is_live,
    mark_used,
    n_free,
    register_owner,
    release_owner,
    shrink,
)

R = TypeVar("R")


def ok(outcome: tuple[PoolState, R | Err]) -> tuple[PoolState, R]:
    """Unwrap a transition that must succeed, checking the invariants after it."""
    state, result = outcome
    assert not isinstance(result, Err), result
    assert broken_invariants(state) == ()
    return state, result


def fails(outcome: tuple[PoolState, object], before: PoolState, kind: ErrorKind) -> Err:
    """Unwrap a transition that must fail with `kind` and leave the state unchanged."""
    state, result = outcome
    assert isinstance(result, Err), result
    assert result.kind is kind, result
    assert state == before
    return result


def pool(history_len: int = 1024, **config: object) -> PoolState:
    spec_config = make_config(**config)
    assert isinstance(spec_config, SpecConfig), spec_config
    state = new_pool(spec_config, history_len=history_len)
    assert isinstance(state, PoolState), state
    return state


# ---- PoolConfig and construction -----------------------------------------------


@pytest.mark.parametrize(
    ("fields", "kind", "named"),
    [
        ({"block_size": True}, ErrorKind.TYPE, "block_size"),
        ({"n_blocks": 1.0}, ErrorKind.TYPE, "n_blocks"),
        ({"separate_kv": 1}, ErrorKind.TYPE, "separate_kv"),
        ({"grow_on_exhaustion": None}, ErrorKind.TYPE, "grow_on_exhaustion"),
        ({"max_blocks": True}, ErrorKind.TYPE, "max_blocks"),
        ({"block_size": 0}, ErrorKind.VALUE, "block_size"),
        ({"n_blocks": -1}, ErrorKind.VALUE, "n_blocks"),
        ({"grow_on_exhaustion": True, "n_blocks": 4, "max_blocks": 3}, ErrorKind.VALUE, "max"),
        ({"block_size": 0, "max_blocks": "x"}, ErrorKind.TYPE, "max_blocks"),
    ],
)
def test_config_checks_all_types_before_values(
    fields: dict[str, object], kind: ErrorKind, named: str
) -> None:
    result = make_config(**fields)
    assert isinstance(result, Err)
    assert result.kind is kind
    assert result.message.startswith(named)


def test_config_ignores_max_blocks_without_growth() -> None:
    assert make_config(n_blocks=4, max_blocks=1) == SpecConfig(n_blocks=4, max_blocks=1)


@pytest.mark.parametrize(("history_len", "kind"), [(True, ErrorKind.TYPE), (-1, ErrorKind.VALUE)])
def test_history_len_is_validated(history_len: object, kind: ErrorKind) -> None:
    result = new_pool(SpecConfig(), history_len=history_len)
    assert isinstance(result, Err)
    assert result.kind is kind


def test_separate_pool_splits_ids_with_k_taking_the_odd_one() -> None:
    state = pool(n_blocks=5)
    assert free_list_for(state, "k") == (2, 1, 0)
    assert free_list_for(state, "v") == (4, 3)
    assert (n_free(state, "k"), n_free(state, "v")) == (3, 2)


# ---- streams and allocate ------------------------------------------------------


@pytest.mark.parametrize(
    ("separate_kv", "streams", "free_lists"),
    [(True, ("k", "v"), ("k", "v")), (False, ("k", "v", "kv"), ("kv",))],
)
def test_stream_names_and_free_lists_follow_separate_kv(
    separate_kv: bool, streams: tuple[str, ...], free_lists: tuple[str, ...]
) -> None:
    state = pool(n_blocks=3, separate_kv=separate_kv)
    assert stream_names(state.config) == streams
    assert free_list_names(state.config) == free_lists
    assert tuple(name for name, _ in state.free_lists) == free_lists


def test_stats_fields_name_every_public_value_of_a_snapshot() -> None:
    view = stats(pool(n_blocks=3))
    values = {name: getattr(view, name) for name in STATS_FIELDS}
    assert values["n_blocks"] == 3
    assert callable(values.pop("fragmentation"))
    assert set(values) | {"fragmented_count"} == set(StatsView.__dataclass_fields__)


def test_allocate_hands_out_ascending_ids_with_the_remainder_last() -> None:
    state, handles = ok(allocate(pool(n_blocks=8), "k", 40, 7, "int2"))
    assert handles == (0, 1, 2)
    assert state.handles == (
        HandleView(0, "k", "int2", 16, 7),
        HandleView(1, "k", "int2", 16, 7),
        HandleView(2, "k", "int2", 8, 7),
    )
    state, handles = ok(allocate(state, "v", 1, 8))
    assert state.handles[handles[0]] == HandleView(4, "v", "fp16", 1, 8)


@pytest.mark.parametrize(
    ("args", "kind", "named"),
    [
        (("x", 0, True, ""), ErrorKind.VALUE, "stream"),
        ((None, 0, True, ""), ErrorKind.VALUE, "stream"),
        (("kv", 1, 1, "fp16"), ErrorKind.VALUE, "stream"),
        (("k", "3", True, 5), ErrorKind.TYPE, "n_tokens"),
        (("k", True, 1, "fp16"), ErrorKind.TYPE, "n_tokens"),
        (("k", 0, True, ""), ErrorKind.VALUE, "n_tokens"),
        (("k", 3, True, 5), ErrorKind.TYPE, "owner"),
        (("k", 3, "1", ""), ErrorKind.TYPE, "owner"),
        (("k", 3, 1, 5), ErrorKind.TYPE, "format"),
        (("k", 3, 1, ""), ErrorKind.VALUE, "format"),
    ],
)
def test_allocate_checks_stream_then_n_tokens_then_owner_then_format(
    args: tuple[object, object, object, object], kind: ErrorKind, named: str
) -> None:
    before = pool(n_blocks=4)
    assert fails(allocate(before, *args), before, kind).message.startswith(named)


def test_shared_pool_maps_every_stream_name_to_kv() -> None:
    state = pool(n_blocks=3, separate_kv=False)
    state, handles = ok(allocate(state, "v", 16, 1))
    assert state.handles[handles[0]].stream == "kv"
    assert n_free(state, "k") == n_free(state, "v") == n_free(state, "kv") == 2


@pytest.mark.parametrize("stream", ["kv", "K", b"k", None, 0])
def test_n_free_rejects_invalid_streams(stream: object) -> None:
    result = n_free(pool(n_blocks=2), stream)
    assert isinstance(result, Err)
    assert result.kind is ErrorKind.VALUE


# ---- free lists are stacks -----------------------------------------------------


def test_free_pushes_in_list_order_so_the_last_freed_is_reused_first() -> None:
    state, (h0, h1) = ok(allocate(pool(n_blocks=4), "k", 32, 1))
    state, _ = ok(free(state, (h1, h0)))
    state, (h2,) = ok(allocate(state, "k", 1, 2))
    state, (h3,) = ok(allocate(state, "k", 1, 2))
    assert (state.handles[h2].block_id, state.handles[h3].block_id) == (0, 1)
    assert stats(state).n_reused == 2


def test_free_all_pushes_in_allocation_order() -> None:
    state, _ = ok(allocate(pool(n_blocks=6), "k", 48, 1))
    state, _ = ok(free_all(state, 1))
    state, handles = ok(allocate(state, "k", 48, 2))
    assert [state.handles[h].block_id for h in handles] == [2, 1, 0]
    assert stats(state).n_reused == 3


def test_a_freed_handle_is_stale_even_after_its_id_is_reused() -> None:
    state, (h0,) = ok(allocate(pool(n_blocks=2), "k", 5, 1))
    state, _ = ok(free(state, (h0,)))
    state, (h1,) = ok(allocate(state, "k", 9, 2))
    assert state.handles[h0] == HandleView(0, "k", "fp16", 0, None)
    assert state.handles[h1] == HandleView(0, "k", "fp16", 9, 2)
    fails(free(state, (h0,)), state, ErrorKind.INVALID_FREE)


@pytest.mark.parametrize(
    "items", [(0, 0), (0, ForeignBlock(1)), (0, ForeignBlock(None)), (0, NotABlock()), (0, 7)]
)
def test_free_is_all_or_nothing_on_any_bad_item(items: tuple[HandleArg, ...]) -> None:
    before, _ = ok(allocate(pool(n_blocks=4), "k", 32, 1))
    fails(free(before, items), before, ErrorKind.INVALID_FREE)


def test_free_of_something_not_a_list_is_a_type_error() -> None:
    before = pool(n_blocks=2)
    fails(free(before, NotAList()), before, ErrorKind.TYPE)


def test_free_of_nothing_changes_nothing() -> None:
    before, _ = ok(allocate(pool(n_blocks=2), "k", 1, 1))
    assert free(before, ()) == (before, None)


# ---- growth, exhaustion, shrink ------------------------------------------------


def test_exhaustion_without_growth_only_counts_itself() -> None:
    before = pool(n_blocks=2)
    state, result = allocate(before, "k", 17, 1)
    assert isinstance(result, Err)
    assert result.kind is ErrorKind.EXHAUSTED
    assert stats(state) == replace(stats(before), n_exhausted=1)
    assert state == replace(before, counters=state.counters, history=(stats(state),))
    assert not is_active(state, 1)


def test_growth_adds_the_missing_blocks_after_the_free_ones_up_to_max_blocks() -> None:
    state = pool(n_blocks=4, separate_kv=False, grow_on_exhaustion=True, max_blocks=6)
    state, (_, h1, _) = ok(allocate(state, "kv", 48, 1))
    state, _ = ok(free(state, (h1,)))
    state, handles = ok(allocate(state, "kv", 64, 2))
    assert [state.handles[h].block_id for h in handles] == [1, 3, 4, 5]
    assert stats(state) == StatsView(
        n_allocations=2,
        n_frees=1,
        n_reused=1,
        n_grown=2,
        peak_blocks_in_use=6,
        n_blocks=6,
        blocks_in_use=6,
    )
    after, result = allocate(state, "kv", 1, 3)
    assert isinstance(result, Err)
    assert result.kind is ErrorKind.EXHAUSTED
    assert stats(after) == replace(stats(state), n_exhausted=1)


def test_shrink_retires_highest_free_ids_and_growth_reissues_lowest_retired() -> None:
    state = pool(n_blocks=6, separate_kv=False, grow_on_exhaustion=True)
    state, _ = ok(allocate(state, "kv", 16, 1))
    state, _ = ok(free_all(state, 1))
    state, retired = ok(shrink(state, "kv", 2))
    assert retired == 4
    assert free_list_for(state, "kv") == (1, 0)
    assert (stats(state).n_blocks, stats(state).n_retired) == (2, 4)
    state, handles = ok(allocate(state, "kv", 80, 2))
    assert [state.handles[h].block_id for h in handles] == [0, 1, 2, 3, 4]
    assert (stats(state).n_reused, stats(state).n_grown) == (1, 3)
    state, handles = ok(allocate(state, "kv", 17, 3))
    assert [state.handles[h].block_id for h in handles] == [5, 6]
    assert (stats(state).n_blocks, stats(state).n_reused) == (7, 1)


def test_id_bound_covers_every_free_or_checked_out_id_and_falls_with_a_retired_tail() -> None:
    state = pool(n_blocks=6, separate_kv=False, grow_on_exhaustion=True)
    assert id_bound(state) == 6
    state, _ = ok(shrink(state, "kv", 2))
    assert id_bound(state) == 2
    state, _ = ok(allocate(state, "kv", 16 * 3, 1))  # regrows id 2
    assert id_bound(state) == 3
    state, _ = ok(free_all(state, 1))
    state, _ = ok(shrink(state, "kv", 0))
    assert id_bound(state) == 0


def test_is_live_only_for_an_issued_handle_still_checked_out() -> None:
    state = pool(n_blocks=4)
    state, (first, second) = ok(allocate(state, "k", 17, 1))
    state, _ = ok(free(state, (first,)))
    assert [is_live(state, h) for h in (first, second, 2, -1)] == [False, True, False, False]
    assert not is_live(state, ForeignBlock(1))
    assert not is_live(state, NotABlock())


def test_a_reissued_id_is_new_until_handed_out_again() -> None:
    state = pool(n_blocks=1, separate_kv=False, grow_on_exhaustion=True)
    state, _ = ok(allocate(state, "kv", 1, 1))
    state, _ = ok(free_all(state, 1))
    state, _ = ok(shrink(state, "kv", 0))
    state, (h,) = ok(allocate(state, "kv", 1, 2))
    assert state.handles[h].block_id == 0
    assert stats(state).n_reused == 0
    state, _ = ok(free_all(state, 2))
    state, _ = ok(allocate(state, "kv", 1, 3))
    assert stats(state).n_reused == 1


def test_an_empty_pool_only_grows() -> None:
    state = pool(n_blocks=0, grow_on_exhaustion=True)
    assert stats(state).fragmentation() == 0.0
    state, (h,) = ok(allocate(state, "v", 3, 1))
    assert state.handles[h] == HandleView(0, "v", "fp16", 3, 1)
    assert stats(state).fragmentation() == 1.0


@pytest.mark.parametrize(
    ("stream", "target_free", "kind", "named"),
    [
        ("x", True, ErrorKind.VALUE, "stream"),
        ("k", True, ErrorKind.TYPE, "target_free"),
        ("k", 1.0, ErrorKind.TYPE, "target_free"),
        ("k", -1, ErrorKind.VALUE, "target_free"),
    ],
)
def test_shrink_checks_stream_then_target_free(
    stream: object, target_free: object, kind: ErrorKind, named: str
) -> None:
    before = pool(n_blocks=4)
    assert fails(shrink(before, stream, target_free), before, kind).message.startswith(named)


def test_shrink_to_more_than_is_free_retires_nothing() -> None:
    before = pool(n_blocks=4)
    assert shrink(before, "v", 2) == (before, 0)


# ---- owners --------------------------------------------------------------------


def test_register_owner_rejects_an_active_owner() -> None:
    state, _ = ok(register_owner(pool(n_blocks=4), 1))
    fails(register_owner(state, 1), state, ErrorKind.OWNER_ACTIVE)
    state, _ = ok(allocate(state, "k", 1, 2))
    fails(register_owner(state, 2), state, ErrorKind.OWNER_ACTIVE)


def test_release_owner_keeps_an_owner_with_blocks_active() -> None:
    state, _ = ok(register_owner(pool(n_blocks=4), 1))
    state, (h,) = ok(allocate(state, "k", 1, 1))
    state, _ = ok(release_owner(state, 1))
    assert is_active(state, 1)
    state, _ = ok(free(state, (h,)))
    assert not is_active(state, 1)


def test_freeing_an_owners_last_block_releases_its_registration() -> None:
    state, _ = ok(register_owner(pool(n_blocks=4), 1))
    state, (h0, h1) = ok(allocate(state, "k", 17, 1))
    state, _ = ok(free(state, (h0,)))
    assert 1 in state.registered
    state, _ = ok(free(state, (h1,)))
    ok(register_owner(state, 1))


def test_free_all_of_an_owner_holding_nothing_only_releases_it() -> None:
    state, _ = ok(register_owner(pool(n_blocks=4), 1))
    state, _ = ok(free_all(state, 1))
    assert not is_active(state, 1)
    assert (stats(state).n_frees, state.history) == (0, ())


@pytest.mark.parametrize("owner", [True, "1", 1.0, None])
def test_every_owner_argument_must_be_a_non_bool_int(owner: object) -> None:
    before = pool(n_blocks=2)
    fails(register_owner(before, owner), before, ErrorKind.TYPE)
    fails(release_owner(before, owner), before, ErrorKind.TYPE)
    fails(free_all(before, owner), before, ErrorKind.TYPE)
    result = blocks_for(before, owner)
    assert isinstance(result, Err)
    assert result.kind is ErrorKind.TYPE


def test_blocks_for_lists_live_handles_in_allocation_order() -> None:
    state, (h0, h1) = ok(allocate(pool(n_blocks=8), "k", 17, 1))
    state, (h2,) = ok(allocate(state, "v", 1, 1))
    state, _ = ok(free(state, (h1,)))
    assert blocks_for(state, 1) == (h0, h2)
    assert blocks_for(state, 99) == ()


# ---- mark_used, stats, history -------------------------------------------------


def test_mark_used_on_a_live_handle_moves_fragmentation() -> None:
    state, (h0, h1) = ok(allocate(pool(n_blocks=4), "k", 20, 1))
    assert stats(state).fragmented_count == 1
    state, _ = ok(mark_used(state, h1, 16))
    state, _ = ok(mark_used(state, h0, 3))
    assert state.handles[h0].n_used == 3
    assert (stats(state).fragmented_count, stats(state).fragmentation()) == (1, 0.25)


def test_mark_used_on_a_stale_handle_changes_only_that_handle() -> None:
    state, (h,) = ok(allocate(pool(n_blocks=4), "k", 20 - 16, 1))
    state, _ = ok(free(state, (h,)))
    before = stats(state)
    state, _ = ok(mark_used(state, h, 5))
    assert state.handles[h] == HandleView(0, "k", "fp16", 5, None)
    assert stats(state) == before


@pytest.mark.parametrize(
    ("block", "n_used", "kind", "named"),
    [
        (NotABlock(), True, ErrorKind.TYPE, "block"),
        (ForeignBlock(None), True, ErrorKind.TYPE, "n_used"),
        (ForeignBlock(3), 17, ErrorKind.VALUE, "n_used"),
        (0, -1, ErrorKind.VALUE, "n_used"),
        (ForeignBlock(3), 1, ErrorKind.VALUE, "block"),
    ],
)
def test_mark_used_checks_block_then_n_used_then_ownership(
    block: HandleArg, n_used: object, kind: ErrorKind, named: str
) -> None:
    before, _ = ok(allocate(pool(n_blocks=4), "k", 1, 1))
    assert fails(mark_used(before, block, n_used), before, kind).message.startswith(named)


def test_mark_used_on_a_hand_built_free_block_changes_no_pool_state() -> None:
    before = pool(n_blocks=4)
    assert mark_used(before, ForeignBlock(None), 4) == (before, None)


def test_history_has_one_snapshot_per_counter_changing_call() -> None:
    state, _ = ok(register_owner(pool(n_blocks=4), 1))
    state, (h0, h1) = ok(allocate(state, "k", 20, 1))
    state, _ = ok(mark_used(state, h1, 16))
    state, _ = allocate(state, "k", 1, 2)  # exhausted: still one snapshot
    state, _ = ok(free(state, ()))
    state, _ = ok(free_all(state, 9))
    state, _ = ok(shrink(state, "v", 5))
    state, _ = ok(free(state, (h0,)))
    state, _ = ok(shrink(state, "v", 0))
    state, _ = ok(free_all(state, 1))
    base = StatsView(n_allocations=1, peak_blocks_in_use=2, n_blocks=4, blocks_in_use=2)
    assert state.history == (
        replace(base, fragmented_count=1),
        replace(base, n_exhausted=1),
        replace(base, n_exhausted=1, n_frees=1, blocks_in_use=1),
        replace(base, n_exhausted=1, n_frees=1, blocks_in_use=1, n_retired=2, n_blocks=2),
        replace(base, n_exhausted=1, n_frees=2, blocks_in_use=0, n_retired=2, n_blocks=2),
    )


@pytest.mark.parametrize("history_len", [0, 2])
def test_history_keeps_only_the_newest_history_len_snapshots(history_len: int) -> None:
    state = pool(history_len=history_len, n_blocks=6)
    for owner in range(3):
        state, _ = ok(allocate(state, "k", 1, owner))
    assert [s.n_allocations for s in state.history] == [1, 2, 3][3 - history_len :]


def test_a_corrupted_state_names_the_broken_invariant() -> None:
    state, _ = ok(allocate(pool(n_blocks=4), "k", 1, 1))
    corrupted = replace(state, free_lists=(("k", (1, 0)), ("v", (3, 2))))
    assert "ids_are_partitioned" in broken_invariants(corrupted)
