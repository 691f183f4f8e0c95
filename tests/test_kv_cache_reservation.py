"""A KV cache that checks out its blocks ahead: the rules of docs/RESERVATIONS.md.

Each test names the rule it checks. The state machines of
``test_block_table_states.py`` and ``test_cache_reads_states.py`` also build
books with reservations, among everything else they do.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from conftest import book_and_pool_state, leave_free, reserved_blocks
from mlx_lm.models.cache import KVCache
from store_reads import recording_reads
from tiny_models import tiny_model

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvariantViolationError,
    PoolConfig,
)
from veloxquant_mlx.memory.deferred_release import reclaim_dropped_caches
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache, StaleBlockTableError

BLOCK_SIZE = 4


def _pool(n_blocks: int = 64) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))


def _ids(blocks: tuple[Block, ...]) -> list[int]:
    return [block.block_id for block in blocks]


@pytest.mark.parametrize(
    ("reserve_tokens", "error", "named"),
    [
        (True, TypeError, "reserve_tokens must be an int >= 0, got True (bool)"),
        ("8", TypeError, "reserve_tokens must be an int >= 0, got '8' (str)"),
        (2.0, TypeError, "reserve_tokens must be an int >= 0, got 2.0 (float)"),
        (-1, ValueError, "reserve_tokens must be an int >= 0, got -1"),
    ],
)
def test_a_bad_reservation_is_refused_naming_it_and_nothing_is_claimed(
    reserve_tokens: object, error: type[Exception], named: str
) -> None:
    """RES-ARG."""
    pool = _pool()
    with pytest.raises(error, match=named.replace("(", r"\(").replace(")", r"\)")):
        PooledKVCache(pool, owner=5, reserve_tokens=reserve_tokens)  # type: ignore[arg-type]
    with PooledKVCache(pool, owner=5) as book:  # the id was not claimed
        assert book.reserve_tokens == 0
    assert pool.stats.n_allocations == 0


def test_the_first_growth_checks_out_the_whole_reservation_in_one_call_per_stream() -> None:
    """RES-TAKE and RES-FILL: 40 positions are 10 blocks per stream, in one allocate each,
    their ids running on; the 8 not yet written are empty and counted in use."""
    pool = _pool()
    with PooledKVCache(pool, reserve_tokens=40) as book:
        book.append(5)
        assert pool.stats.n_allocations == 2
        assert _ids(book.key_blocks) == [0, 1] and book.reserved_blocks == 8
        reserved = reserved_blocks(book, pool)
        assert sorted(block.block_id for block in reserved if block.block_id < 32) == [
            *range(2, 10)
        ]
        assert all(block.n_used == 0 for block in reserved) and len(reserved) == 16
        assert pool.stats.blocks_in_use() == 20
        assert pool.stats._fragmented_count == 2  # the two last blocks, not the reserved
        assert book.slots_held() == 40 and book.slots_wasted() == 35
        book.check_invariants()


def test_growth_takes_the_reserved_blocks_in_order_then_checks_out_as_before() -> None:
    """RES-USE, then RES-TAKE past the reservation: one more block, not another 10."""
    pool = _pool()
    with PooledKVCache(pool, n_layers=2, reserve_tokens=40) as book:
        for _ in range(40):
            book.append(1, layer=0)
            book.append(1, layer=1)
            book.check_invariants()
        assert _ids(book.key_blocks) == [*range(10)] and book.reserved_blocks == 0
        assert [block.n_used for block in book.key_blocks] == [BLOCK_SIZE] * 10
        book.append(1)
        assert pool.stats.n_allocations == 4 and book.reserved_blocks == 0
        assert pool.stats.blocks_in_use() == 22
        book.check_invariants()


def test_a_reservation_the_pool_cannot_supply_refuses_the_first_append_changing_nothing() -> None:
    """RES-TAKE, all or nothing: 12 free blocks per stream hold the prompt's 2 but not the
    reservation's 13; the append is refused and counted once, and nothing else changes."""
    pool = _pool(n_blocks=24)
    book = PooledKVCache(pool, reserve_tokens=50)
    with pytest.raises(BlockPoolExhaustedError):
        book.append(5)
    assert (book.offset, book.key_blocks, book.reserved_blocks) == (0, (), 0)
    assert pool.stats.blocks_in_use() == 0 and pool.stats.n_exhausted == 1
    assert pool.stats.n_allocations == 0
    book.check_invariants()
    with PooledKVCache(pool) as alone:
        alone.append(5)  # the positions alone fit
    book.release()


def test_a_trim_keeps_the_blocks_it_frees_reserved_and_the_growth_after_takes_them_again() -> None:
    """RES-TRIM: a rewind from 30 positions to 10 keeps blocks 3..7 reserved (emptied),
    so the growth after it holds ids 0..7 again, running on."""
    pool = _pool()
    with PooledKVCache(pool, reserve_tokens=40) as book:
        book.append(30)
        book.trim(20)
        assert _ids(book.key_blocks) == [0, 1, 2] and book.reserved_blocks == 7
        assert all(block.n_used == 0 for block in reserved_blocks(book, pool))
        assert pool.stats.blocks_in_use() == 20 and pool.stats.n_frees == 0
        book.check_invariants()
        book.append(20)
        assert _ids(book.key_blocks) == [*range(8)]
        book.check_invariants()


def test_a_trim_past_the_reservation_gives_back_what_the_reservation_does_not_lack() -> None:
    """RES-TRIM: reservation 2 blocks, 10 held, trimmed to 1: one stays reserved, 8 go."""
    pool = _pool()
    with PooledKVCache(pool, reserve_tokens=2 * BLOCK_SIZE) as book:
        book.append(10 * BLOCK_SIZE)
        book.trim(9 * BLOCK_SIZE)
        assert _ids(book.key_blocks) == [0] and book.reserved_blocks == 1
        assert pool.stats.blocks_in_use() == 4
        book.check_invariants()


def test_a_fork_shares_only_the_positions_and_holds_no_reservation() -> None:
    """RES-FORK, and RES-TRIM after a fork: trimmed blocks go back to the pool."""
    pool = _pool()
    with PooledKVCache(pool, reserve_tokens=40) as book:
        book.append(6)
        with book.fork() as twin:
            assert (twin.reserve_tokens, twin.reserved_blocks) == (0, 0)
            assert pool.stats.n_shares == 4 and pool.stats.shared_blocks() == 4
            assert not any(pool.is_shared(block.block_id) for block in reserved_blocks(book, pool))
            twin.append(3)  # moves the shared last block, then checks out as before
            book.trim(6)
            assert book.reserved_blocks == 8  # the shared blocks went back (to the twin)
            for each in (book, twin):
                each.check_invariants()
        book.append(1)
        book.check_invariants()
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


def test_release_and_a_dropped_book_give_the_reserved_blocks_back() -> None:
    """RES-RELEASE."""
    pool = _pool()
    book = PooledKVCache(pool, reserve_tokens=40)
    book.append(5)
    book.release()
    assert pool.stats.blocks_in_use() == 0
    dropped = PooledKVCache(pool, reserve_tokens=40)
    dropped.append(5)
    del dropped
    gc.collect()
    reclaim_dropped_caches(pool)
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("filled", r"reserve: k block 0 .* is shared or not empty"),
        ("shared", r"reserve: k block 0 .* is shared or not empty"),
        ("freed", r"reserve: v block 0 .* is not live for the owner"),
    ],
)
def test_the_invariants_name_a_reserved_block_changed_behind_the_books_back(
    change: str, named: str
) -> None:
    """INV-RES-HANDLES."""
    pool = _pool()
    book = PooledKVCache(pool, reserve_tokens=40)
    book.append(5)
    reserved = sorted(reserved_blocks(book, pool), key=lambda block: block.block_id)
    first_key, first_value = reserved[0], reserved[8]
    if change == "filled":
        pool.mark_used(first_key, 1)
    elif change == "shared":
        pool.share([first_key], 77)
    else:
        pool.free([first_value])
    with pytest.raises(InvariantViolationError, match=named):
        book.check_invariants()


def test_nbytes_counts_the_reserved_blocks_the_request_holds() -> None:
    """RES-ACCOUNT: what mlx-lm sums as a cache's memory (``nbytes``) counts the reserved
    blocks, as ``slots_held`` and the pool do: 32 reserved slots, not the 8 written."""
    store = MLXBlockStorage(_pool(), 2, 2, 8, mx.float32)
    with make_pool_backed_cache(
        tiny_model("llama", 11, n_layers=2), store, reserve_tokens=32
    ) as cache:
        cache[0].update_and_fetch(mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)))
        assert cache.book.reserved_blocks == 6
        slot_bytes = 2 * 8 * mx.float32.size  # heads, head size
        assert [layer.nbytes for layer in cache] == [2 * 32 * slot_bytes] * 2


def test_requests_growing_side_by_side_are_read_by_slices_with_a_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three requests of one store, prefilled in turn and then decoded side by side:
    with ``reserve_tokens`` each keeps ids that run on, so every read is two slices
    (without, their decode blocks interleave and every read after the prefill's is a
    take), and every layer returns, bit for bit, what ``KVCache`` returns."""
    model = tiny_model("llama", 11, n_layers=2)
    for reserve_tokens, read_by in [(7 + 12, {"slices"}), (0, {"slices", "take"})]:
        store = MLXBlockStorage(_pool(n_blocks=128), 2, 2, 16, mx.float32, lazy_writes=True)
        reads = recording_reads(monkeypatch)
        ours = [make_pool_backed_cache(model, store, reserve_tokens=reserve_tokens) for _ in "abc"]
        theirs = [[KVCache() for _ in range(2)] for _ in "abc"]  # type: ignore[no-untyped-call]
        for step, n_new in enumerate([7] * 3 + [1] * 36):
            request = step if step < 3 else step % 3
            for layer in range(2):
                keys, values = mx.split(mx.random.normal((2, 2, n_new, 16)), 2)
                got = ours[request][layer].update_and_fetch(keys, values)
                want = theirs[request][layer].update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
                assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))
        assert set(reads) == read_by and reads[:6] == ["slices"] * 6
        for caches in ours:
            caches.book.check_invariants()
            caches.release()
        monkeypatch.undo()


def test_a_rewrite_after_a_fork_refused_for_the_reservations_top_up_moves_nothing() -> None:
    """RES-USE after a fork: the rewrite must move shared block 0 and grow past the
    reserved blocks, which checks out up to the reservation (3 blocks): 4 of the 2
    free. Refused, and the move is not made."""
    pool = _pool(n_blocks=24)
    book = PooledKVCache(pool, n_layers=2, reserve_tokens=16)
    book.append(16, layer=0)
    book.append(16, layer=1)
    twin = book.fork()
    book.trim(12)
    book.trim(4, layer=0)
    leave_free(pool, 2)
    before = book_and_pool_state(book, pool)
    with pytest.raises(BlockPoolExhaustedError):
        book.append(8, layer=0)
    assert book_and_pool_state(book, pool) == before
    book.check_invariants()
    twin.release()
    book.release()


def test_a_rewrite_after_a_fork_asks_no_block_for_growth_the_reservation_covers() -> None:
    """RES-USE after a fork: one shared block to move, the growth in reserved blocks;
    one free block per stream is enough."""
    pool = _pool(n_blocks=24)
    book = PooledKVCache(pool, n_layers=2, reserve_tokens=40)
    book.append(8, layer=0)
    book.append(8, layer=1)
    twin = book.fork()
    book.trim(4, layer=0)
    leave_free(pool, 1)
    book.append(8, layer=0)
    assert book.offset == 12 and pool.n_free("k") == 0
    book.check_invariants()
    twin.check_invariants()
    twin.release()
    book.release()


def test_growth_after_a_fork_refused_for_its_new_block_moves_nothing() -> None:
    """Without a reservation too: growth after a fork moves the shared, partly filled
    last block and checks out a new one, asked together; one free block per stream
    is refused before the move."""
    pool = _pool(n_blocks=24)
    book = PooledKVCache(pool)
    book.append(6)
    twin = book.fork()
    leave_free(pool, 1)
    before = book_and_pool_state(book, pool)
    with pytest.raises(BlockPoolExhaustedError):
        book.append(4)
    assert book_and_pool_state(book, pool) == before
    book.check_invariants()
    twin.release()
    book.release()


def test_a_reserved_block_shared_behind_the_books_back_refuses_the_growth_unchanged() -> None:
    """RES-USE: growth would take a reserved block that another owner now shares."""
    pool = _pool()
    book = PooledKVCache(pool, reserve_tokens=16)
    book.append(5)
    reserved = sorted(reserved_blocks(book, pool), key=lambda block: block.block_id)
    handle = pool.share([reserved[0]], 77)
    before = book_and_pool_state(book, pool)
    with pytest.raises(StaleBlockTableError, match=r"reserved block .* behind the book's back"):
        book.append(20)
    assert book_and_pool_state(book, pool) == before
    pool.free(handle)
    book.check_invariants()
    book.release()
    assert pool.stats.blocks_in_use() == 0


def test_growth_looks_only_at_the_reserved_blocks_it_takes() -> None:
    """RES-USE: a reserved block shared behind the book's back refuses the growth that
    would take it, not the growth before it."""
    pool = _pool()
    book = PooledKVCache(pool, reserve_tokens=16)  # 4 blocks per stream
    book.append(5)
    last_reserved = max(
        (block for block in reserved_blocks(book, pool) if block.stream == "k"),
        key=lambda block: block.block_id,
    )
    handle = pool.share([last_reserved], 77)
    assert book.append_moves(7, 0) == (set(), set(), 0)  # a batch's look agrees
    book.append(7)  # takes the third reserved block, not the fourth
    assert (book.offset, len(book.key_blocks), book.reserved_blocks) == (12, 3, 1)
    before = book_and_pool_state(book, pool)
    stale = pytest.raises(StaleBlockTableError, match=r"reserved block .* behind the book's back")
    with stale:
        book.append_moves(1, 0)
    with stale:
        book.append(1)
    assert book_and_pool_state(book, pool) == before
    pool.free(handle)
    book.release()
    assert pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("append", ["growth", "rewrite of a layer"])
def test_after_a_fork_a_tampered_reserved_block_refuses_the_append_before_any_move(
    append: str,
) -> None:
    """RES-USE, nothing changes: the shared block the append would move first stays."""
    pool = _pool()
    book = PooledKVCache(pool, n_layers=2, reserve_tokens=16)
    book.append(5 if append == "growth" else 8, layer=0)
    book.append(5 if append == "growth" else 8, layer=1)
    twin = book.fork()
    if append != "growth":
        book.trim(4, layer=0)
    pool.share([sorted(reserved_blocks(book, pool), key=lambda block: block.block_id)[0]], 77)
    before = book_and_pool_state(book, pool)
    with pytest.raises(StaleBlockTableError):
        book.append(8, layer=0)
    assert book_and_pool_state(book, pool) == before
    twin.release()


@pytest.mark.parametrize("reserve_tokens", [0, 16])
@pytest.mark.parametrize("stream", ["k", "v"])
@pytest.mark.parametrize("n_new", [1, 8, 20])
def test_a_last_block_shared_behind_the_books_back_refuses_growth_with_nothing_changed(
    reserve_tokens: int, stream: str, n_new: int
) -> None:
    """The pool refuses to mark the shared last block; growth within it, into the
    reserved blocks, or past them (a checkout, given back) changes nothing and leaks
    nothing."""
    pool = _pool()
    book = PooledKVCache(pool, reserve_tokens=reserve_tokens)
    book.append(5)
    last = (book.key_blocks if stream == "k" else book.value_blocks)[-1]
    handle = pool.share([last], 77)
    before = book_and_pool_state(book, pool)
    fills = [block.n_used for block in (*book.key_blocks, *book.value_blocks)]
    with pytest.raises(ValueError, match="shared"):
        book.append(n_new)
    assert book_and_pool_state(book, pool) == before
    assert [block.n_used for block in (*book.key_blocks, *book.value_blocks)] == fills
    pool.free(handle)
    book.check_invariants()
    book.release()
    assert pool.stats.blocks_in_use() == 0
