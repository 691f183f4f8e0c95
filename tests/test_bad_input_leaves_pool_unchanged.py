"""Every rejected call leaves the pool exactly as it was.

Each case runs against the ``populated`` fixture (live, partly used, stale,
registered-only and foreign handles) and compares a full observation of the
pool before and after: stats, free counts, owners' blocks, every handle's
fields, the history, and ``check_invariants()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import PopulatedPool, make_pool, pool_unchanged

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolError,
    InvalidFreeError,
    OwnerAlreadyActiveError,
    PoolConfig,
)

# The pool is passed as Any: these calls break the declared types on purpose.
BadCall = Callable[[Any, PopulatedPool], object]


def hand_built_copy(block: Block) -> Block:
    """A Block with every field of ``block`` that is not the pool's handle."""
    return Block(
        block.block_id, block.stream, block.format, block.n_used, block.owner, block.ever_allocated
    )


ALLOCATE_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    ("stream-unknown", lambda p, c: p.allocate("bogus", 1, 9), ValueError),
    ("stream-kv-on-separate-pool", lambda p, c: p.allocate("kv", 1, 9), ValueError),
    ("stream-upper-case", lambda p, c: p.allocate("K", 1, 9), ValueError),
    ("stream-empty", lambda p, c: p.allocate("", 1, 9), ValueError),
    ("stream-none", lambda p, c: p.allocate(None, 1, 9), ValueError),
    ("stream-int", lambda p, c: p.allocate(0, 1, 9), ValueError),
    ("stream-bytes", lambda p, c: p.allocate(b"k", 1, 9), ValueError),
    ("stream-unhashable", lambda p, c: p.allocate(["k"], 1, 9), ValueError),
    ("n_tokens-zero", lambda p, c: p.allocate("k", 0, 9), ValueError),
    ("n_tokens-negative", lambda p, c: p.allocate("k", -4, 9), ValueError),
    ("n_tokens-float", lambda p, c: p.allocate("k", 4.0, 9), TypeError),
    ("n_tokens-str", lambda p, c: p.allocate("k", "4", 9), TypeError),
    ("n_tokens-bool", lambda p, c: p.allocate("k", True, 9), TypeError),
    ("n_tokens-none", lambda p, c: p.allocate("k", None, 9), TypeError),
    ("owner-none", lambda p, c: p.allocate("k", 1, None), TypeError),
    ("owner-str", lambda p, c: p.allocate("k", 1, "9"), TypeError),
    ("owner-bool", lambda p, c: p.allocate("k", 1, True), TypeError),
    ("owner-float", lambda p, c: p.allocate("k", 1, 9.0), TypeError),
    ("format-empty", lambda p, c: p.allocate("k", 1, 9, ""), ValueError),
    ("format-none", lambda p, c: p.allocate("k", 1, 9, None), TypeError),
    ("format-bytes", lambda p, c: p.allocate("k", 1, 9, b"fp16"), TypeError),
    ("format-empty-existing-owner", lambda p, c: p.allocate("k", 1, 1, ""), ValueError),
]

FREE_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    ("bare-block", lambda p, c: p.free(c.owner1[0]), TypeError),
    ("none", lambda p, c: p.free(None), TypeError),
    ("set", lambda p, c: p.free({c.owner1[0]}), TypeError),
    ("iterator", lambda p, c: p.free(iter(c.owner1)), TypeError),
    ("generator", lambda p, c: p.free(b for b in c.owner1), TypeError),
    ("dict", lambda p, c: p.free({c.owner1[0]: 1}), TypeError),
    ("str", lambda p, c: p.free("ab"), TypeError),
    ("int-item", lambda p, c: p.free([c.owner1[0], 3]), InvalidFreeError),
    ("none-item", lambda p, c: p.free([c.owner1[0], None]), InvalidFreeError),
    ("double-free-in-one-list", lambda p, c: p.free([c.owner1[0], c.owner1[0]]), InvalidFreeError),
    (
        "double-free-apart-in-one-list",
        lambda p, c: p.free([c.owner1[1], c.owner2[0], c.owner1[1]]),
        InvalidFreeError,
    ),
    ("stale-alone", lambda p, c: p.free([c.stale]), InvalidFreeError),
    ("stale-after-live", lambda p, c: p.free([c.owner1[0], c.stale]), InvalidFreeError),
    ("stale-before-live", lambda p, c: p.free([c.stale, c.owner2[0]]), InvalidFreeError),
    ("foreign-alone", lambda p, c: p.free([c.foreign]), InvalidFreeError),
    ("foreign-after-live", lambda p, c: p.free([c.owner2[1], c.foreign]), InvalidFreeError),
    (
        "hand-built-copy-of-live",
        lambda p, c: p.free([hand_built_copy(c.owner1[0])]),
        InvalidFreeError,
    ),
    (
        "hand-built-copy-after-live",
        lambda p, c: p.free([c.owner1[1], hand_built_copy(c.owner1[2])]),
        InvalidFreeError,
    ),
    ("hand-built-free-block", lambda p, c: p.free([Block(11, "v")]), InvalidFreeError),
]


def call_with_owner(method: str, owner: object) -> BadCall:
    return lambda p, c: getattr(p, method)(owner)


OWNER_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    (f"{method}-{label}", call_with_owner(method, value), TypeError)
    for method in ("register_owner", "release_owner", "free_all", "blocks_for")
    for label, value in (("str", "1"), ("bool", True), ("none", None), ("float", 1.0))
] + [
    ("register-owner-holding-blocks", lambda p, c: p.register_owner(1), OwnerAlreadyActiveError),
    ("register-registered-owner", lambda p, c: p.register_owner(4), OwnerAlreadyActiveError),
]

STREAM_QUERY_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    ("n_free-unknown", lambda p, c: p.n_free("bogus"), ValueError),
    ("n_free-kv-on-separate-pool", lambda p, c: p.n_free("kv"), ValueError),
    ("n_free-none", lambda p, c: p.n_free(None), ValueError),
    ("n_free-int", lambda p, c: p.n_free(1), ValueError),
    ("n_free-unhashable", lambda p, c: p.n_free(["k"]), ValueError),
]

SHRINK_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    ("stream-unknown", lambda p, c: p.shrink("bogus", 0), ValueError),
    ("stream-kv-on-separate-pool", lambda p, c: p.shrink("kv", 0), ValueError),
    ("stream-none", lambda p, c: p.shrink(None, 0), ValueError),
    ("stream-unhashable", lambda p, c: p.shrink({"k": 1}, 0), ValueError),
    ("target-negative", lambda p, c: p.shrink("k", -1), ValueError),
    ("target-float", lambda p, c: p.shrink("k", 0.0), TypeError),
    ("target-str", lambda p, c: p.shrink("k", "0"), TypeError),
    ("target-bool", lambda p, c: p.shrink("k", False), TypeError),
    ("target-none", lambda p, c: p.shrink("k", None), TypeError),
]

MARK_USED_CASES: list[tuple[str, BadCall, type[Exception]]] = [
    ("negative", lambda p, c: p.mark_used(c.owner1[2], -1), ValueError),
    ("above-block-size", lambda p, c: p.mark_used(c.owner1[2], 5), ValueError),
    ("stale-above-block-size", lambda p, c: p.mark_used(c.stale, 5), ValueError),
    ("stale-negative", lambda p, c: p.mark_used(c.stale, -1), ValueError),
    ("n_used-float", lambda p, c: p.mark_used(c.owner1[2], 3.0), TypeError),
    ("n_used-str", lambda p, c: p.mark_used(c.owner1[2], "3"), TypeError),
    ("n_used-none", lambda p, c: p.mark_used(c.owner1[2], None), TypeError),
    ("n_used-bool", lambda p, c: p.mark_used(c.owner1[2], True), TypeError),
    ("block-int", lambda p, c: p.mark_used(0, 1), TypeError),
    ("block-none", lambda p, c: p.mark_used(None, 1), TypeError),
    ("block-list", lambda p, c: p.mark_used([c.owner1[0]], 1), TypeError),
    ("foreign-live-handle", lambda p, c: p.mark_used(c.foreign, 1), ValueError),
    (
        "hand-built-copy-of-live",
        lambda p, c: p.mark_used(hand_built_copy(c.owner1[0]), 1),
        ValueError,
    ),
]


def cases(group: str, table: list[tuple[str, BadCall, type[Exception]]]) -> list[Any]:
    return [pytest.param(call, error, id=f"{group}-{name}") for name, call, error in table]


@pytest.mark.parametrize(
    ("call", "error"),
    cases("allocate", ALLOCATE_CASES)
    + cases("free", FREE_CASES)
    + cases("owner", OWNER_CASES)
    + cases("stream", STREAM_QUERY_CASES)
    + cases("shrink", SHRINK_CASES)
    + cases("mark_used", MARK_USED_CASES),
)
def test_bad_input_raises_and_leaves_pool_unchanged(
    populated: PopulatedPool, call: BadCall, error: type[Exception]
) -> None:
    with populated.unchanged(), pytest.raises(error):
        call(populated.pool, populated)


def test_free_is_all_or_nothing_on_double_free(populated: PopulatedPool) -> None:
    block = populated.owner1[0]
    with populated.unchanged(), pytest.raises(InvalidFreeError):
        populated.pool.free([block, populated.owner1[1], block])
    assert block.owner == 1


def test_invalid_free_error_is_a_value_error(populated: PopulatedPool) -> None:
    with pytest.raises(ValueError):
        populated.pool.free([populated.stale])


def test_allocate_with_a_bad_format_does_not_register_a_new_owner(
    populated: PopulatedPool,
) -> None:
    with pytest.raises(ValueError):
        populated.pool.allocate("k", 1, 9, "")
    populated.pool.register_owner(9)


def test_bad_input_leaves_a_foreign_pool_unchanged_too(populated: PopulatedPool) -> None:
    other = populated.other_pool
    with pool_unchanged(other, owners=[1], handles=[populated.foreign]):
        with pytest.raises(InvalidFreeError):
            populated.pool.free([populated.foreign])
        with pytest.raises(ValueError):
            populated.pool.mark_used(populated.foreign, 2)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        pytest.param(lambda p: p.allocate("x", 1, 1), ValueError, id="allocate-unknown-stream"),
        pytest.param(lambda p: p.allocate(None, 1, 1), ValueError, id="allocate-none-stream"),
        pytest.param(lambda p: p.n_free("x"), ValueError, id="n_free-unknown-stream"),
        pytest.param(lambda p: p.shrink("x", 0), ValueError, id="shrink-unknown-stream"),
        pytest.param(lambda p: p.free([Block(0, "kv")]), InvalidFreeError, id="free-hand-built"),
    ],
)
def test_shared_pool_bad_input_leaves_pool_unchanged(
    call: Callable[[Any], object], error: type[Exception]
) -> None:
    pool: BlockPoolAllocator = make_pool(block_size=4, n_blocks=8, separate_kv=False)
    held = pool.allocate("kv", 6, owner=1)
    with pool_unchanged(pool, owners=[1], handles=held), pytest.raises(error):
        call(pool)


@pytest.mark.parametrize(
    ("call", "offending"),
    [
        pytest.param(lambda p, c: p.allocate("bogus-stream", 1, 9), "bogus-stream", id="stream"),
        pytest.param(lambda p, c: p.allocate("k", -13, 9), "-13", id="n_tokens"),
        pytest.param(lambda p, c: p.allocate("k", 1, "alice"), "alice", id="owner"),
        pytest.param(lambda p, c: p.allocate("k", 1, 9, 12345), "12345", id="format"),
        pytest.param(lambda p, c: p.shrink("k", -5), "-5", id="target_free"),
        pytest.param(lambda p, c: p.mark_used(c.owner1[0], 99), "99", id="n_used"),
        pytest.param(lambda p, c: p.register_owner(4), "4", id="active-owner"),
        pytest.param(lambda p, c: p.free_all("bob"), "bob", id="free_all-owner"),
        pytest.param(lambda p, c: p.stats.to_prometheus("bad-prefix"), "bad-prefix", id="prefix"),
        pytest.param(lambda p, c: BlockPoolAllocator(history_len=-3), "-3", id="history_len"),
        pytest.param(lambda p, c: PoolConfig(block_size=-7), "-7", id="block_size"),
        pytest.param(lambda p, c: PoolConfig(n_blocks=-11), "-11", id="n_blocks"),
    ],
)
def test_error_message_names_the_offending_value(
    populated: PopulatedPool, call: BadCall, offending: str
) -> None:
    with pytest.raises((TypeError, ValueError, BlockPoolError)) as excinfo:
        call(populated.pool, populated)
    assert offending in str(excinfo.value)


# -- C-GROW-MEMORY: a growth no process can hold ----------------------------------------


# 2**60 ids: a list that large is refused by its size alone (MemoryError), so no host's
# overcommit setting turns the test into a real allocation; 10**30 cannot even be a size.
@pytest.mark.parametrize("n_tokens", [2**60, 10**30], ids=["past-memory", "past-a-list"])
@pytest.mark.parametrize("separate_kv", [True, False], ids=["separate", "shared"])
def test_a_growth_too_large_for_memory_changes_nothing(n_tokens: int, separate_kv: bool) -> None:
    # It once took the retired ids off their heap before the new ids failed to build:
    # the ids were lost for good (check_invariants: the partition).
    pool: BlockPoolAllocator = make_pool(
        block_size=1, n_blocks=8, separate_kv=separate_kv, grow_on_exhaustion=True
    )
    stream = "k" if separate_kv else "kv"
    held = pool.allocate(stream, 1, owner=1)
    pool.shrink(stream, 0)  # retires every free id of the stream
    with pool_unchanged(pool, owners=[1], handles=held), pytest.raises(MemoryError) as refused:
        pool.allocate(stream, n_tokens, owner=2)
    assert str(refused.value) == (
        f"allocate(stream={stream!r}, n_tokens={n_tokens}) needs {n_tokens} new blocks, "
        "more than this process can hold; nothing changed"
    )
    assert len(pool.allocate(stream, 3, owner=2)) == 3  # the retired ids come back first


@pytest.mark.parametrize(
    ("n_blocks", "history_len"), [(10**30, 8), (8, 2**63)], ids=["n_blocks", "history_len"]
)
def test_a_pool_too_large_for_the_process_is_refused_naming_its_size(
    n_blocks: int, history_len: int
) -> None:
    with pytest.raises(MemoryError) as refused:
        BlockPoolAllocator(PoolConfig(n_blocks=n_blocks), history_len=history_len)
    assert str(refused.value) == (
        f"a pool of n_blocks={n_blocks} with history_len={history_len} is more than this "
        "process can hold"
    )


def test_a_hand_built_block_with_an_unhashable_id_is_refused_as_no_handle(
    populated: PopulatedPool,
) -> None:
    # Its id was hashed for the lookup: a bare TypeError, where the contract says no handle.
    untyped: Any = populated.pool
    bad = Block([], "k", owner=1)  # type: ignore[arg-type]
    with populated.unchanged():
        assert not untyped.is_live(bad)
        assert not untyped.all_live([bad])
        with pytest.raises(InvalidFreeError, match=r"blocks\[0\] = Block\(block_id=\[\]"):
            untyped.free([bad])
        with pytest.raises(InvalidFreeError):
            untyped.share([bad], 5)
        with pytest.raises(InvalidFreeError):
            untyped.make_writable(bad)
        with pytest.raises(ValueError, match="not a live handle"):
            untyped.mark_used(bad, 1)
