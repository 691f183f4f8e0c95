"""A book whose blocks were freed, moved or shared behind its back refuses the step
that would need them, changing nothing, in the book or in the pool, and leaking nothing.

Each case was found by a randomized probe (the book and the pool observed after every
call) and failed before its fix: a trim cut the book and then met the pool's refusal of
a stale handle (a live block leaked); a trim marked the key block and then met a value
block shared behind the back; a fork shared every block of the owner and then could not
find a stale one (the shares leaked to the twin's owner); growth into a shared last block
checked out first, which can grow the pool; a rewrite after a fork moved its blocks and
then met the store's refusal of a stale block elsewhere in the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import mlx.core as mx
import pytest
from conftest import pool_unchanged

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache, StaleBlockTableError
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache

BLOCK_SIZE = 4
BOOK, TWIN, OTHER = 1, 2, 99


def _book(
    n_blocks: int = 16,
    *,
    reserve_tokens: int = 0,
    n_layers: int = 2,
    grow_on_exhaustion: bool = False,
    max_blocks: int | None = None,
) -> tuple[BlockPoolAllocator, PooledKVCache]:
    config = PoolConfig(
        block_size=BLOCK_SIZE,
        n_blocks=n_blocks,
        grow_on_exhaustion=grow_on_exhaustion,
        max_blocks=max_blocks,
    )
    pool = BlockPoolAllocator(config)
    return pool, PooledKVCache(pool, BOOK, n_layers=n_layers, reserve_tokens=reserve_tokens)


def _book_state(book: PooledKVCache) -> tuple[object, ...]:
    return (
        tuple(book.layer_offset(layer) for layer in range(book.n_layers)),
        book.offset,
        [(block.block_id, block.n_used) for block in (*book.key_blocks, *book.value_blocks)],
        book.reserved_blocks,
    )


def _refused_unchanged(
    pool: BlockPoolAllocator,
    book: PooledKVCache,
    step: Callable[[], object],
    error: type[Exception],
    match: str,
) -> None:
    """``step`` raises ``error`` (matching ``match``) and changes neither book nor pool."""
    before = _book_state(book)
    with pool_unchanged(pool, owners=[BOOK, TWIN, OTHER]), pytest.raises(error, match=match):
        step()
    assert _book_state(book) == before


def _tokens(n: int, value: float) -> mx.array:
    return mx.full((1, 1, n, 4), value, dtype=mx.float16)


def _cache_of_eight_ones() -> tuple[BlockPoolAllocator, MLXBlockStorage, PoolBackedPromptCache]:
    """A two-layer request holding 8 positions of ones, on a store with heads of 4."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    store = MLXBlockStorage(pool, 2, 1, 4, mx.float16)
    cache = PoolBackedPromptCache(store, PooledKVCache(pool, BOOK, n_layers=2))
    for layer in cache:
        layer.update_and_fetch(_tokens(8, 1.0), _tokens(8, 1.0))
    return pool, store, cache


def _named(block: Block) -> str:
    return re.escape(f"block {block!r} of owner {BOOK}'s book")


@pytest.mark.parametrize("reserve_tokens", [0, 32])
@pytest.mark.parametrize("stream", ["k", "v"])
def test_a_trim_over_a_block_freed_behind_the_book_is_refused_unchanged(
    reserve_tokens: int, stream: str
) -> None:
    pool, book = _book(reserve_tokens=reserve_tokens)
    book.append(6, layer=0)
    book.append(6, layer=1)
    stale = (book.key_blocks if stream == "k" else book.value_blocks)[1]
    pool.free([stale])
    _refused_unchanged(pool, book, lambda: book.trim(3), StaleBlockTableError, _named(stale))
    book.release()
    assert pool.stats.blocks_in_use() == 0  # the live block of the other stream came back


def test_a_trim_over_a_reserved_block_freed_behind_the_book_is_refused_unchanged() -> None:
    pool, book = _book(reserve_tokens=32)
    book.append(6)
    [stale] = [b for b in pool.blocks_for(BOOK) if b.block_id == book.key_blocks[-1].block_id + 1]
    pool.free([stale])
    match = re.escape(f"reserved block {stale!r}")
    _refused_unchanged(pool, book, lambda: book.trim(3), StaleBlockTableError, match)


@pytest.mark.parametrize("stream", ["k", "v"])
def test_a_trim_whose_new_last_block_is_shared_behind_the_book_is_refused_unchanged(
    stream: str,
) -> None:
    pool, book = _book()
    book.append(6, layer=0)
    book.append(6, layer=1)
    shared = (book.key_blocks if stream == "k" else book.value_blocks)[0]
    pool.share([shared], OTHER)
    _refused_unchanged(pool, book, lambda: book.trim(3), ValueError, "shared")
    book.check_invariants()


@pytest.mark.parametrize("reserve_tokens", [0, 32])
@pytest.mark.parametrize("behind", ["free", "make_writable"])
def test_a_fork_of_a_book_with_a_block_freed_or_moved_behind_its_back_is_refused_unchanged(
    reserve_tokens: int, behind: str
) -> None:
    pool, book = _book(32, reserve_tokens=reserve_tokens, n_layers=1)
    book.append(6)
    stale = book.key_blocks[1]
    if behind == "free":
        pool.free([stale])
    else:
        pool.share([book.key_blocks[1]], OTHER)
        pool.make_writable(stale)  # the book's handle moves to a new block
    _refused_unchanged(pool, book, lambda: book.fork(TWIN), StaleBlockTableError, _named(stale))
    assert pool.blocks_for(TWIN) == []  # no share leaked to the twin's owner id


@pytest.mark.parametrize("n_tokens", [0, 6])
def test_a_fork_shares_only_the_books_blocks_not_those_checked_out_to_its_owner_id(
    n_tokens: int,
) -> None:
    """The pool's ``fork`` shares every block of the owner id; the book's shares its own.
    An empty book's twin once lost its owner id when the shares it did not want went
    back, so a second book could claim the id while the twin lived."""
    pool, book = _book(n_layers=1)
    book.append(n_tokens)
    extra = pool.allocate("k", BLOCK_SIZE, owner=BOOK)  # not the book's
    twin = book.fork(TWIN)
    assert not pool.is_shared(extra[0].block_id)
    assert sorted(b.block_id for b in pool.blocks_for(TWIN)) == sorted(
        b.block_id for b in (*twin.key_blocks, *twin.value_blocks)
    )
    with pytest.raises(OwnerAlreadyActiveError):
        PooledKVCache(pool, TWIN)
    twin.check_invariants()
    twin.release()
    book.release()
    pool.free(extra)
    assert pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("reserve_tokens", [0, BLOCK_SIZE])  # growth goes past either
@pytest.mark.parametrize("stream", ["k", "v"])
def test_growth_into_a_last_block_shared_behind_the_book_never_checks_out(
    reserve_tokens: int, stream: str
) -> None:
    """With ``grow_on_exhaustion`` the checkout grew the pool before the pool refused
    to mark the shared last block; giving the blocks back cannot undo growth."""
    pool, book = _book(
        n_blocks=2, reserve_tokens=reserve_tokens, grow_on_exhaustion=True, max_blocks=64
    )
    book.append(2)
    shared = (book.key_blocks if stream == "k" else book.value_blocks)[0]
    pool.share([shared], OTHER)
    _refused_unchanged(pool, book, lambda: book.append(3 * BLOCK_SIZE), ValueError, "shared")


def test_a_rewrite_after_a_fork_refused_for_a_stale_block_elsewhere_moves_nothing() -> None:
    """The rewrite moves the blocks it writes; a stale block it does not write made the
    store's table check refuse the write after the moves, which no undo reverses."""
    pool, _, cache = _cache_of_eight_ones()
    twin = cache.fork(owner=TWIN)
    twin[0].trim(3)  # layer 0 holds 5 positions; the next write rewrites block 1 only
    stale = twin.book.key_blocks[0]
    pool.free([stale])
    before = _book_state(twin.book)
    with (
        pool_unchanged(pool, owners=[BOOK, TWIN]),
        pytest.raises(StaleBlockTableError, match=re.escape(f"block {stale!r}")),
    ):
        twin[0].update_and_fetch(_tokens(3, 1.0), _tokens(3, 1.0))
    assert _book_state(twin.book) == before


def test_a_trim_inside_the_last_block_does_not_look_at_the_reserved_blocks() -> None:
    """Only a trim that gives blocks back or keeps them reserved needs them live."""
    pool, book = _book(32, reserve_tokens=32, n_layers=1)
    book.append(6)
    held = {id(block) for block in (*book.key_blocks, *book.value_blocks)}
    reserved = [block for block in pool.blocks_for(BOOK) if id(block) not in held]
    pool.free([reserved[-1]])
    assert book.trim(1) == 1
    assert book.offset == 5


def test_a_rewrite_that_also_grows_into_a_last_block_shared_behind_the_book_moves_nothing() -> None:
    """After a fork, a layer trimmed alone writes its positions again and grows past the
    extent: the rewrite moved its shared blocks before the pool refused to mark the last
    block, shared behind the book's back."""
    pool, book = _book(32)
    for layer in (0, 1):
        book.append(8, layer=layer)
    twin = book.fork(TWIN)
    for layer in (0, 1):
        book.append(2, layer=layer)  # into a new, private block
    book.trim(4, layer=0)  # layer 0 at 6, layer 1 at 10
    shared = book.key_blocks[-1]
    pool.share([shared], OTHER)
    match = re.escape(f"block {shared!r} of owner {BOOK}'s book is shared behind")
    _refused_unchanged(pool, book, lambda: book.append(8, layer=0), ValueError, match)
    twin.release()


@pytest.mark.parametrize("stream", ["k", "v"])
def test_positions_written_again_into_a_block_shared_behind_the_book_are_refused(
    stream: str,
) -> None:
    """A layer trimmed alone and written again (the state setter does so) wrote through
    the table into a block shared behind the book's back, changing what its other owner
    reads; only a fork's shares were looked at."""
    pool, store, cache = _cache_of_eight_ones()
    shared = (cache.book.key_blocks if stream == "k" else cache.book.value_blocks)[0]
    [theirs] = pool.share([shared], OTHER)
    cache[0].trim(8)
    with pytest.raises(ValueError, match=re.escape(f"block {shared!r} of owner {BOOK}'s book")):
        cache[0].update_and_fetch(_tokens(8, 7.0), _tokens(8, 7.0))
    assert (
        store.gather(0, [theirs], BLOCK_SIZE).tolist()
        == _tokens(4, 1.0)[0].transpose(1, 0, 2).tolist()
    )
    assert cache[0].offset == 0  # the refused write took no position


class _LookCounting(BlockPoolAllocator):
    """A pool that counts its ``is_shared`` calls."""

    looks = 0

    def is_shared(self, block_id: int) -> bool:
        _LookCounting.looks += 1
        return super().is_shared(block_id)


def test_a_decode_steps_later_layers_do_not_look_at_the_pool() -> None:
    """Only positions a layer wrote before are looked at: a step's later layers write
    where they stopped, so decoding makes no is_shared call."""
    pool = _LookCounting(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    book = PooledKVCache(pool, BOOK, n_layers=2)
    for _ in range(14):
        for layer in (0, 1):
            book.append(1, layer=layer)
    _LookCounting.looks = 0
    for _ in range(5):
        for layer in (0, 1):
            book.append(1, layer=layer)
    assert _LookCounting.looks == 0
    book.trim(2, layer=0)  # positions 17 and 18, in block 4
    book.append(2, layer=0)  # written again: that block's key and value looked at
    assert _LookCounting.looks == 2


def test_growth_refused_for_a_block_freed_behind_the_cache_grows_neither_pool_nor_store() -> None:
    """The book checked only its last and reserved blocks before a checkout; the store's
    table found the stale block after it, when growth of the pool (and so of the store)
    and the counters of a checkout and its return could no longer be undone."""
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=4, grow_on_exhaustion=True))
    store = MLXBlockStorage(pool, 1, 1, 2, mx.float32)
    cache = PoolBackedPromptCache(store, PooledKVCache(pool, BOOK, n_layers=1))
    ones = mx.ones((1, 1, 4, 2), mx.float32)
    cache[0].update_and_fetch(ones, ones)  # the pool is full
    stale = cache.book.key_blocks[0]
    pool.free([stale])  # behind the cache's back; not its last block
    sizes = (store.capacity(), store.resident_bytes())
    with (
        pool_unchanged(pool, owners=[BOOK]),
        pytest.raises(StaleBlockTableError, match=re.escape(f"block {stale!r}")),
    ):
        cache[0].update_and_fetch(ones[:, :, :1], ones[:, :, :1])
    assert (store.capacity(), store.resident_bytes()) == sizes
    assert cache[0].offset == 4


@pytest.mark.parametrize(
    ("shared_index", "n_set"),
    [(0, 8), (0, 1), (1, 5)],  # the set's first, only, or last position in the shared block
)
def test_a_state_set_over_a_block_shared_behind_the_book_is_refused_unchanged(
    shared_index: int, n_set: int
) -> None:
    """The setter trims its layer, then appends the new positions: the append's look
    refused, after the trim had emptied the layer (and freed its blocks, had it been
    the longest)."""
    pool, _, cache = _cache_of_eight_ones()
    shared = cache.book.key_blocks[shared_index]
    pool.share([shared], OTHER)
    before = _book_state(cache.book)
    with (
        pool_unchanged(pool, owners=[BOOK, OTHER]),
        pytest.raises(
            ValueError, match=_named(shared) + ".*: its positions cannot be written again \\("
        ),
    ):
        cache[0].state = (_tokens(n_set, 7.0), _tokens(n_set, 7.0), n_set)
    assert _book_state(cache.book) == before
    assert mx.array_equal(cache[0].state[0], _tokens(8, 1.0))


def test_a_state_set_writes_no_held_block_past_the_other_layers_so_it_is_not_refused() -> None:
    """The setter's trim gives back the blocks past the other layers (here: there are
    none), and the append writes new ones: a block shared behind the back there is the
    other owner's alone afterwards, untouched. The look once refused such a set."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    store = MLXBlockStorage(pool, 1, 1, 4, mx.float16)
    cache = PoolBackedPromptCache(store, PooledKVCache(pool, BOOK, n_layers=1))
    cache[0].update_and_fetch(_tokens(8, 1.0), _tokens(8, 1.0))
    [theirs] = pool.share([cache.book.key_blocks[1]], OTHER)
    cache[0].state = (_tokens(8, 7.0), _tokens(8, 7.0), 8)
    assert mx.array_equal(cache[0].state[0], _tokens(8, 7.0))
    assert store.gather(0, [theirs], BLOCK_SIZE).tolist() == [[[1.0] * 4]] * BLOCK_SIZE


def test_a_layer_trimmed_twice_alone_still_refuses_writing_again_into_a_shared_block() -> None:
    """Each trim of one layer alone keeps how far the layer had written, the furthest
    of them: a second, shorter trim must not forget the positions the first dropped,
    or the write goes into a block another owner reads."""
    pool, store, cache = _cache_of_eight_ones()
    cache[0].trim(4)
    cache[0].trim(2)  # layer 1 still holds all 8: no block goes back
    shared = cache.book.key_blocks[1]  # positions 4 .. 7, dropped by the first trim
    [theirs] = pool.share([shared], OTHER)
    with pytest.raises(ValueError, match=_named(shared)):
        cache[0].update_and_fetch(_tokens(6, 7.0), _tokens(6, 7.0))
    assert cache[0].offset == 2
    assert store.gather(0, [theirs], BLOCK_SIZE).tolist() == [[[1.0] * 4]] * BLOCK_SIZE


def test_the_look_refuses_growth_into_a_last_block_a_trim_copied_then_shared_behind() -> None:
    """After a fork, growth to a private block, and a trim back into a block the fork
    shares (its fill changes, so the trim copies it), the last block is private but
    still counted among those a fork may share. The look skipped it as one that moves
    first; without a rewrite it does not move, and the append's mark was refused
    after the look had let a batch go on."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    book = PooledKVCache(pool, BOOK, n_layers=1)
    book.append(8)
    twin = book.fork(TWIN)
    book.append(1)  # a new last block, the book's own
    book.trim(6)  # to 3 positions: the twin's block 0 gets a new fill, so a copy
    copied = book.key_blocks[-1]
    assert copied.block_id not in {block.block_id for block in twin.key_blocks}
    pool.share([copied], OTHER)
    before = _book_state(book)
    with pytest.raises(ValueError, match=_named(copied) + ".*growth cannot fill it"):
        book.append_moves(1, 0)
    with pool_unchanged(pool, owners=[BOOK, TWIN, OTHER]), pytest.raises(ValueError):
        book.append(1)
    assert _book_state(book) == before


def _two_layers_of_four_ones_reserving_more() -> tuple[
    BlockPoolAllocator, PooledKVCache, PoolBackedPromptCache
]:
    """A request of two layers holding 4 positions of ones, reserving 16."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=32))
    store = MLXBlockStorage(pool, 2, 1, 4, mx.float16)
    book = PooledKVCache(pool, BOOK, n_layers=2, reserve_tokens=16)
    cache = PoolBackedPromptCache(store, book)
    for layer in cache:
        layer.update_and_fetch(_tokens(4, 1.0), _tokens(4, 1.0))
    return pool, book, cache


def _share_a_reserved_block(pool: BlockPoolAllocator, book: PooledKVCache) -> None:
    held = {id(block) for block in (*book.key_blocks, *book.value_blocks)}
    pool.share([b for b in pool.blocks_for(BOOK) if id(b) not in held][:1], OTHER)


def test_a_state_set_within_the_other_layers_takes_no_reserved_block_so_is_not_refused() -> None:
    """Reserved blocks are looked at only when the set reaches past what the other layers
    hold: within it, the append takes none, so one shared behind the back is no matter."""
    pool, book, cache = _two_layers_of_four_ones_reserving_more()
    _share_a_reserved_block(pool, book)
    cache[0].state = (_tokens(4, 7.0), _tokens(4, 7.0), 4)  # as far as layer 1 holds
    assert mx.array_equal(cache[0].state[0], _tokens(4, 7.0))


@pytest.mark.parametrize("fault", ["a held block freed", "a reserved block shared"])
def test_a_state_set_that_would_be_refused_after_its_trim_is_refused_before_it(
    fault: str,
) -> None:
    """The refusal came from the append, after the trim had emptied the layer."""
    pool, book, cache = _two_layers_of_four_ones_reserving_more()
    if fault == "a held block freed":
        pool.free([book.key_blocks[0]])
    else:
        _share_a_reserved_block(pool, book)
    before = _book_state(book)
    with pytest.raises(StaleBlockTableError):
        cache[0].state = (_tokens(8, 7.0), _tokens(8, 7.0), 8)
    assert _book_state(book) == before


class _InterruptedOnValueMarks(BlockPoolAllocator):
    """A pool whose ``mark_used`` of a value block is interrupted (Ctrl-C) once armed."""

    armed = False

    def mark_used(self, block: Block, n_used: int) -> None:
        if _InterruptedOnValueMarks.armed and block.stream == "v":
            raise KeyboardInterrupt
        super().mark_used(block, n_used)


def test_an_interrupt_between_the_two_marks_of_a_growth_leaves_neither() -> None:
    # The undo of the key block's mark ran only for the pool's ValueError.
    pool = _InterruptedOnValueMarks(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    book = PooledKVCache(pool, BOOK)
    book.append(2)
    fills = [block.n_used for block in (*book.key_blocks, *book.value_blocks)]
    _InterruptedOnValueMarks.armed = True
    try:
        with pytest.raises(KeyboardInterrupt):
            book.append(1)
    finally:
        _InterruptedOnValueMarks.armed = False
    assert [block.n_used for block in (*book.key_blocks, *book.value_blocks)] == fills
    book.check_invariants()
