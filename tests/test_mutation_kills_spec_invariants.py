"""Each invariant of the spec rejects a state that breaks it, and only its own rule.

The conformance kit asserts ``broken_invariants(state) == ()`` after every
step, so an invariant that can never fail would let a broken spec through
unnoticed. Every state the transitions build is valid; these tests corrupt
one clause at a time by hand (mutation testing found the clauses below
weakened without any test failing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from veloxquant_mlx_spec.invariants import all_invariants_hold, broken_invariants
from veloxquant_mlx_spec.model import (
    Counters,
    Err,
    HandleView,
    PoolState,
    SpecConfig,
    make_config,
    new_pool,
)
from veloxquant_mlx_spec.transitions import allocate, free, share


def pool(**config: object) -> PoolState:
    spec_config = make_config(**{"block_size": 4, "n_blocks": 4, **config})
    assert isinstance(spec_config, SpecConfig), spec_config
    state = new_pool(spec_config)
    assert isinstance(state, PoolState), state
    return state


def holding_one_block() -> PoolState:
    """A 4-block pool (block_size 4) where owner 1 holds block 0 with 2 of 4 slots used."""
    state, handles = allocate(pool(), "k", 2, 1)
    assert not isinstance(handles, Err)
    return state


def with_first_handle(state: PoolState, view: HandleView) -> PoolState:
    return replace(state, handles=(view, *state.handles[1:]))


def negative_history_len() -> PoolState:
    return replace(pool(), history_len=-1)


def stale_handle_overfilled() -> PoolState:
    state = holding_one_block()
    state, result = free(state, (0,))
    assert result is None
    return with_first_handle(state, replace(state.handles[0], n_used=5))


def live_handle_without_format() -> PoolState:
    state = holding_one_block()
    return with_first_handle(state, replace(state.handles[0], format=""))


def live_handle_on_an_unknown_stream() -> PoolState:
    state = holding_one_block()
    return with_first_handle(state, replace(state.handles[0], stream="kv"))


def peak_below_current_use() -> PoolState:
    state = holding_one_block()
    return replace(state, counters=replace(state.counters, peak_blocks_in_use=0))


def grown_past_a_cap_of_zero() -> PoolState:
    """A pool capped at max_blocks=0 that nevertheless grew one free block."""
    state = pool(n_blocks=0, separate_kv=False, grow_on_exhaustion=True, max_blocks=0)
    return replace(
        state,
        free_lists=(("kv", (0,)),),
        next_block_id=1,
        counters=Counters(n_grown=1),
    )


def shared_by_owners_1_and_2() -> PoolState:
    """``holding_one_block`` with block 0 shared to owner 2 (handle 1): count 2."""
    state, handles = share(holding_one_block(), (0,), 2)
    assert handles == (1,), handles
    return state


def shared_with_a_wrong_count() -> PoolState:
    return replace(shared_by_owners_1_and_2(), ref_counts=((0, 3),))


def one_owner_holding_two_handles_of_one_block() -> PoolState:
    state = shared_by_owners_1_and_2()
    return replace(state, handles=(*state.handles[:1], replace(state.handles[1], owner=1)))


@pytest.mark.parametrize(
    ("corrupt", "broken"),
    [
        (negative_history_len, {"config_is_valid", "history_is_bounded"}),
        (stale_handle_overfilled, {"handles_are_well_formed"}),
        (live_handle_without_format, {"handles_are_well_formed"}),
        (live_handle_on_an_unknown_stream, {"handles_are_well_formed"}),
        (peak_below_current_use, {"counters_are_sane"}),
        (grown_past_a_cap_of_zero, {"growth_respects_max_blocks"}),
        (shared_with_a_wrong_count, {"refcounts_match_handles"}),
        (one_owner_holding_two_handles_of_one_block, {"refcounts_match_handles"}),
    ],
)
def test_a_state_breaking_one_rule_is_reported_under_that_invariant_only(
    corrupt: Callable[[], PoolState], broken: set[str]
) -> None:
    assert set(broken_invariants(corrupt())) == broken


@pytest.mark.parametrize(
    ("state", "holds"),
    [(holding_one_block(), True), (peak_below_current_use(), False)],
)
def test_all_invariants_hold_is_true_exactly_when_none_is_broken(
    state: PoolState, holds: bool
) -> None:
    assert all_invariants_hold(state) is holds


def test_the_corruptions_start_from_a_valid_state() -> None:
    assert broken_invariants(holding_one_block()) == ()
    assert broken_invariants(shared_by_owners_1_and_2()) == ()
    assert HandleView(0, "k", "fp16", 2, 1) == holding_one_block().handles[0]
