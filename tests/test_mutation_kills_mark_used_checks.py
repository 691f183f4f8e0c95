"""mark_used() behind its per-token fast path: int subclasses and odd hand-built owners.

``mark_used`` accepts a plain ``int`` fill level on an inlined fast path and
sends anything else through the full checks, which accept any ``int`` that
is not a ``bool`` (the contract's meaning of "int"). Only an ``int``
subclass reaches the full checks with a valid value, and only a hand-built
``Block`` with a non-int owner reaches the guard in front of the owner
lookup; no other test sends either (mutation testing found both paths
changeable without a failing test).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from conftest import make_pool

from veloxquant_mlx.memory.block_pool import Block


class FillLevel(int):
    """An ``int`` subclass, like an ``IntEnum`` member or a typed counter."""


@pytest.mark.parametrize("n_used", [0, 4])
def test_mark_used_accepts_an_int_subclass_at_either_end_of_the_range(n_used: int) -> None:
    pool = make_pool(block_size=4)
    block = pool.allocate("k", 2, owner=1)[0]
    pool.mark_used(block, FillLevel(n_used))
    assert block.n_used == n_used
    assert pool.stats._fragmented_count == 0
    pool.check_invariants()


def test_mark_used_of_a_hand_built_block_with_an_unhashable_owner_is_not_live() -> None:
    pool = make_pool(block_size=4)
    pool.allocate("k", 2, owner=1)
    foreign = Block(0, "k", owner=cast(Any, [1]))
    with pytest.raises(ValueError, match="not a live handle of this pool"):
        pool.mark_used(foreign, 1)
