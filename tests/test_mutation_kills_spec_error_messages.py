"""Every error the spec predicts names the argument first, then the offending value.

``model.Err`` documents the rule (``message`` begins with the argument's
name) and the project's style asks errors to name the value received. The
conformance kit compares only ``Err.kind``, so nothing else checks the
spec's messages (mutation testing found messages that could be dropped or
could name the wrong value without a failing test). Text after the name is
informative and deliberately not pinned.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import assert_predicted_error_names

from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.model import (
    ForeignBlock,
    NotABlock,
    NotAList,
    PoolState,
    SpecConfig,
    make_config,
    new_pool,
)


def holding() -> PoolState:
    """block_size 4, 4 blocks, no growth; owner 1 holds handle 0 (block 0)."""
    state = new_pool(SpecConfig(block_size=4, n_blocks=4))
    assert isinstance(state, PoolState), state
    state, handles = transitions.allocate(state, "k", 4, 1)
    assert handles == (0,)
    return state


ERROR_CASES: list[tuple[str, Callable[[], object], str, str | None]] = [
    ("config-type", lambda: make_config(block_size="4"), "block_size", "'4'"),
    ("history_len-type", lambda: new_pool(None, "2"), "history_len", "'2'"),
    ("history_len-value", lambda: new_pool(None, -3), "history_len", "-3"),
    ("register-type", lambda: transitions.register_owner(holding(), "7"), "owner", "'7'"),
    ("register-active", lambda: transitions.register_owner(holding(), 1), "owner", "1"),
    ("release-type", lambda: transitions.release_owner(holding(), 1.5), "owner", "1.5"),
    ("allocate-stream", lambda: transitions.allocate(holding(), "q", 1, 2), "stream", "'q'"),
    ("allocate-n_tokens", lambda: transitions.allocate(holding(), "k", 0, 2), "n_tokens", "0"),
    ("allocate-owner", lambda: transitions.allocate(holding(), "k", 1, "bob"), "owner", "'bob'"),
    ("allocate-format", lambda: transitions.allocate(holding(), "k", 1, 2, 7), "format", "7"),
    ("allocate-exhausted", lambda: transitions.allocate(holding(), "k", 99, 2), "n_tokens", "99"),
    ("free-not-a-list", lambda: transitions.free(holding(), NotAList()), "blocks", None),
    ("free-not-live", lambda: transitions.free(holding(), (5,)), "blocks", "5"),
    ("free-twice", lambda: transitions.free(holding(), (0, 0)), "blocks", "0"),
    ("free_all-type", lambda: transitions.free_all(holding(), "1"), "owner", "'1'"),
    ("shrink-target", lambda: transitions.shrink(holding(), "k", -2), "target_free", "-2"),
    ("mark_used-block", lambda: transitions.mark_used(holding(), NotABlock(), 1), "block", None),
    ("mark_used-n_used", lambda: transitions.mark_used(holding(), 0, 9), "n_used", "9"),
    (
        "mark_used-foreign",
        lambda: transitions.mark_used(holding(), ForeignBlock(3), 1),
        "block",
        "3",
    ),
    ("mark_used-never-issued", lambda: transitions.mark_used(holding(), 8, 1), "block", "8"),
    ("blocks_for-type", lambda: transitions.blocks_for(holding(), 2.0), "owner", "2.0"),
    ("n_free-stream", lambda: transitions.n_free(holding(), 3), "stream", "3"),
]


@pytest.mark.parametrize(
    ("call", "argument", "offending"),
    [
        pytest.param(call, argument, offending, id=name)
        for name, call, argument, offending in ERROR_CASES
    ],
)
def test_a_predicted_error_names_the_argument_first_then_the_offending_value(
    call: Callable[[], object], argument: str, offending: str | None
) -> None:
    assert_predicted_error_names(call(), argument, offending)
