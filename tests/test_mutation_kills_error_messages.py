"""Every error the allocator raises on purpose reads exactly as written.

The README promises errors that name the argument, what was expected, and
the value received; the existing tests check the error class and that the
offending value appears. The rest of the text (the argument's name, the
expectation, why an exhausted allocate could not grow) was free to change
or vanish without a failing test (mutation testing found each such
mutant alive), so the full messages are pinned here, one row per raise site.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
    OwnerAlreadyActiveError,
    PoolConfig,
)

Call = Callable[[BlockPoolAllocator, Block], object]

# Wrong-typed arguments, typed Any so that the calls below type-check.
BOB: Any = "bob"
X: Any = "x"
JUNK: Any = "junk"
SEVEN: Any = 7


def capped_pool_allocate() -> object:
    pool = BlockPoolAllocator(
        PoolConfig(block_size=4, n_blocks=2, grow_on_exhaustion=True, max_blocks=3)
    )
    return pool.allocate("k", 12, owner=1)


HELD = "Block(block_id=0, stream='k', format='fp16', n_used=4, owner=1, ever_allocated=True)"
GROWTH_OFF = "growth is off (PoolConfig.grow_on_exhaustion=False)"

# (id, call on a block_size-4, 8-block pool where owner 1 holds block 0, error, message)
MESSAGES: list[tuple[str, Call, type[Exception], str]] = [
    (
        "allocate-stream",
        lambda p, b: p.allocate("q", 1, 2),
        ValueError,
        "stream must be one of 'k', 'v', got 'q'",
    ),
    (
        "allocate-n_tokens",
        lambda p, b: p.allocate("k", 0, 2),
        ValueError,
        "n_tokens must be an int >= 1, got 0",
    ),
    (
        "allocate-owner",
        lambda p, b: p.allocate("k", 1, BOB),
        TypeError,
        "owner must be an int, got 'bob' (str)",
    ),
    (
        "allocate-format",
        lambda p, b: p.allocate("k", 1, 2, SEVEN),
        TypeError,
        "format must be a non-empty str, got 7 (int)",
    ),
    (
        "allocate-exhausted",
        lambda p, b: p.allocate("k", 99, 2),
        BlockPoolExhaustedError,
        "allocate(stream='k', n_tokens=99) needs 22 more free blocks than the stream has; "
        + GROWTH_OFF,
    ),
    (
        "allocate-capped",
        lambda p, b: capped_pool_allocate(),
        BlockPoolExhaustedError,
        "allocate(stream='k', n_tokens=12) needs 2 more free blocks than the stream has; "
        "growing would take the pool past max_blocks=3 (it has 2)",
    ),
    (
        "free-not-a-list",
        lambda p, b: p.free(cast(Any, b)),
        TypeError,
        f"blocks must be a list of Block handles, got Block: {HELD}",
    ),
    (
        "free-twice",
        lambda p, b: p.free([b, b]),
        InvalidFreeError,
        f"blocks[1] = {HELD} appears more than once in the list; expected each block once",
    ),
    (
        "free-not-live",
        lambda p, b: p.free([Block(5, "v")]),
        InvalidFreeError,
        "blocks[0] = Block(block_id=5, stream='v', format='fp16', n_used=0, owner=None, "
        "ever_allocated=False) is not a live handle of this pool; "
        "expected a block checked out from this pool and not yet freed",
    ),
    (
        "free_all-owner",
        lambda p, b: p.free_all(BOB),
        TypeError,
        "owner must be an int, got 'bob' (str)",
    ),
    (
        "mark_used-block",
        lambda p, b: p.mark_used(JUNK, 1),
        TypeError,
        "block must be a Block, got str: 'junk'",
    ),
    (
        "mark_used-too-full",
        lambda p, b: p.mark_used(b, 9),
        ValueError,
        "n_used must be an int in 0..4, got 9",
    ),
    (
        "mark_used-negative",
        lambda p, b: p.mark_used(b, -1),
        ValueError,
        "n_used must be an int >= 0, got -1",
    ),
    (
        "mark_used-not-live",
        lambda p, b: p.mark_used(Block(0, "k", owner=1), 1),
        ValueError,
        "block Block(block_id=0, stream='k', format='fp16', n_used=0, owner=1, "
        "ever_allocated=False) has an owner but is not a live handle of this pool; "
        "expected a block checked out from this pool",
    ),
    (
        "shrink-target_free",
        lambda p, b: p.shrink("k", -1),
        ValueError,
        "target_free must be an int >= 0, got -1",
    ),
    (
        "blocks_for-owner",
        lambda p, b: p.blocks_for(X),
        TypeError,
        "owner must be an int, got 'x' (str)",
    ),
    (
        "register-owner",
        lambda p, b: p.register_owner(X),
        TypeError,
        "owner must be an int, got 'x' (str)",
    ),
    (
        "register-active",
        lambda p, b: p.register_owner(1),
        OwnerAlreadyActiveError,
        "owner 1 is already active (holds blocks or is registered); "
        "expected an owner id that is not in use",
    ),
    (
        "release-owner",
        lambda p, b: p.release_owner(X),
        TypeError,
        "owner must be an int, got 'x' (str)",
    ),
    (
        "config",
        lambda p, b: BlockPoolAllocator(cast(Any, "cfg")),
        TypeError,
        "config must be a PoolConfig or None, got 'cfg'",
    ),
    (
        "config-block_size-type",
        lambda p, b: PoolConfig(block_size=cast(Any, "4")),
        TypeError,
        "block_size must be an int, got '4' (str)",
    ),
    (
        "config-n_blocks-type",
        lambda p, b: PoolConfig(n_blocks=cast(Any, 1.5)),
        TypeError,
        "n_blocks must be an int, got 1.5 (float)",
    ),
    (
        "config-separate_kv-type",
        lambda p, b: PoolConfig(separate_kv=cast(Any, 1)),
        TypeError,
        "separate_kv must be a bool, got 1 (int)",
    ),
    (
        "config-grow_on_exhaustion-type",
        lambda p, b: PoolConfig(grow_on_exhaustion=cast(Any, None)),
        TypeError,
        "grow_on_exhaustion must be a bool, got None (NoneType)",
    ),
    (
        "config-max_blocks-type",
        lambda p, b: PoolConfig(max_blocks=cast(Any, "8")),
        TypeError,
        "max_blocks must be an int, got '8' (str)",
    ),
    (
        "config-block_size-value",
        lambda p, b: PoolConfig(block_size=0),
        ValueError,
        "block_size must be an int >= 1, got 0",
    ),
    (
        "config-n_blocks-value",
        lambda p, b: PoolConfig(n_blocks=-1),
        ValueError,
        "n_blocks must be an int >= 0, got -1",
    ),
    (
        "config-max_blocks-value",
        lambda p, b: PoolConfig(n_blocks=8, grow_on_exhaustion=True, max_blocks=4),
        ValueError,
        "max_blocks must be an int >= 8, got 4",
    ),
    (
        "history_len",
        lambda p, b: BlockPoolAllocator(history_len=-1),
        ValueError,
        "history_len must be an int >= 0, got -1",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [pytest.param(call, error, message, id=name) for name, call, error, message in MESSAGES],
)
def test_error_message_names_the_argument_the_expectation_and_the_value(
    call: Call, error: type[Exception], message: str
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    held = pool.allocate("k", 4, owner=1)[0]
    with pytest.raises(error) as raised:
        call(pool, held)
    assert str(raised.value) == message
