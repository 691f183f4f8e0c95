"""Spec transitions on inputs the conformance kit never produces.

The kit resolves handle ids through the allocator, so it never passes the
spec a handle id that was not issued; and its random programs rarely grow a
pool that still has several free blocks. The spec is total over its input
types, so these paths are pinned here (mutation testing found each of them
changeable without a failing test).
"""

from __future__ import annotations

from veloxquant_mlx_spec.model import (
    Err,
    ErrorKind,
    PoolState,
    SpecConfig,
    new_pool,
    stats,
)
from veloxquant_mlx_spec.transitions import allocate, is_live, mark_used


def pool(config: SpecConfig) -> PoolState:
    state = new_pool(config)
    assert isinstance(state, PoolState), state
    return state


def holding_two_handles() -> PoolState:
    state, handles = allocate(pool(SpecConfig(block_size=4, n_blocks=4)), "k", 8, 1)
    assert handles == (0, 1)
    return state


def test_is_live_is_false_for_a_handle_id_never_issued() -> None:
    state = holding_two_handles()
    assert not is_live(state, 2)
    assert not is_live(state, -1)


def test_mark_used_of_a_handle_id_never_issued_is_a_value_error_that_changes_nothing() -> None:
    state = holding_two_handles()
    after, result = mark_used(state, 2, 1)
    assert isinstance(result, Err)
    assert result.kind is ErrorKind.VALUE
    assert after == state


def test_growth_hands_out_every_free_block_before_the_grown_ones() -> None:
    state = pool(SpecConfig(block_size=4, n_blocks=4, separate_kv=False, grow_on_exhaustion=True))
    after, handles = allocate(state, "kv", 20, 1)  # 5 blocks: the 4 free ones and 1 grown
    assert not isinstance(handles, Err)
    assert [after.handles[h].block_id for h in handles] == [0, 1, 2, 3, 4]
    assert stats(after).n_grown == 1
