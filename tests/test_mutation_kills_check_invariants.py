"""check_invariants() on corrupted books raises, naming the invariant that broke.

Every other test calls ``check_invariants()`` on a healthy pool, where it
must stay silent; none showed that it speaks up, or what it says, when the
books are wrong (mutation testing found its message could be dropped
without a failing test). The corruption here is the bug the check exists
for: a checked-out block pushed back onto its free list.
"""

from __future__ import annotations

import pytest
from conftest import make_pool

from veloxquant_mlx.memory.block_pool import InvariantViolationError


def test_check_invariants_names_the_partition_broken_by_a_block_both_free_and_held() -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    held = pool.allocate("k", 4, owner=1)[0]
    pool._free_lists["k"].append(held.block_id)  # planted bug: the id is free and held
    with pytest.raises(InvariantViolationError) as raised:
        pool.check_invariants()
    assert str(raised.value) == "partition: block id 0 is in free list 'k' and in owner 1"
