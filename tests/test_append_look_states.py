"""A book's look at an append (``append_moves``) agrees with the append, after any calls.

A batch of requests asks each row's book what its append would take before any
row appends (BATCH-REFUSED), so the look must say what the append then does:
the same refusal, or the same shared blocks moved to private copies and the same
blocks checked out. This machine drives books of one pool (some forked, some
with a reservation, docs/RESERVATIONS.md) through appends and trims of one layer
or all, forks, releases, and blocks shared behind their backs, and compares
every look with the append that follows it. What the append moved is read from
the book's block ids before and after, and checked against the pool's count of
blocks in use, independently of the look's code.
"""

from __future__ import annotations

from conftest import book_and_pool_state
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

BLOCK_SIZE = 2
N_BLOCKS = 96  # ample: the look does not ask the pool for supply, so no exhaustion
MOST_BOOKS = 4
N_LAYERS = 2
FIRST_OTHER = 10_000  # owners that share blocks behind the books' backs: one per share

book_choice = st.integers(min_value=0, max_value=MOST_BOOKS - 1)
positions = st.integers(min_value=0, max_value=7)
layers = st.integers(min_value=0, max_value=N_LAYERS - 1)
reservations = st.sampled_from([0, 0, 1, 5, 12])


def _ids(blocks: tuple[Block, ...]) -> list[int]:
    return [block.block_id for block in blocks]


def _moved(before: list[int], after: list[int]) -> set[int]:
    """Ids of the blocks that an append replaced in place (copy-on-write)."""
    return {old for old, new in zip(before, after, strict=False) if old != new}


class LookAgreesWithAppend(RuleBasedStateMachine):
    """Books of one pool; each append is looked at first and compared with the look."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE))  # until make_pool
        self.books: list[PooledKVCache] = []
        self.others: list[int] = []

    @initialize(separate_kv=st.booleans())
    def make_pool(self, separate_kv: bool) -> None:
        config = PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS, separate_kv=separate_kv)
        self.pool = BlockPoolAllocator(config)

    def _book(self, choice: int) -> PooledKVCache:
        return self.books[choice % len(self.books)]

    def _state(self, book: PooledKVCache) -> tuple[object, ...]:
        return book_and_pool_state(book, self.pool)

    @precondition(lambda self: len(self.books) < MOST_BOOKS)
    @rule(reserve_tokens=reservations)
    def new_book(self, reserve_tokens: int) -> None:
        self.books.append(
            PooledKVCache(self.pool, n_layers=N_LAYERS, reserve_tokens=reserve_tokens)
        )

    @precondition(lambda self: self.books)
    @rule(choice=book_choice, n=positions, layer=layers)
    def look_then_append(self, choice: int, n: int, layer: int) -> None:
        book = self._book(choice)
        before = self._state(book)
        try:
            look = book.append_moves(n, layer)
        except ValueError as refusal:  # StaleBlockTableError too
            self._append_refused_as(book, n, layer, refusal)
            assert self._state(book) == before
            return
        self._append_does(book, n, layer, look, before)

    def _append_refused_as(
        self, book: PooledKVCache, n: int, layer: int, refusal: ValueError
    ) -> None:
        try:
            book.append(n, layer=layer)
        except ValueError as error:
            assert type(error) is type(refusal), (error, refusal)
            return
        raise AssertionError(f"the look refused ({refusal}) but the append went through")

    def _append_does(
        self,
        book: PooledKVCache,
        n: int,
        layer: int,
        look: tuple[set[int], set[int], int],
        before: tuple[object, ...],
    ) -> None:
        keys, values = _ids(book.key_blocks), _ids(book.value_blocks)
        held = len(keys) + book.reserved_blocks
        in_use = self.pool.stats.blocks_in_use()
        try:
            book.append(n, layer=layer)
        except BlockPoolExhaustedError:  # not the look's to foresee
            assert self._state(book) == before
            return
        moved_keys, moved_values = (
            _moved(keys, _ids(book.key_blocks)),
            _moved(values, _ids(book.value_blocks)),
        )
        checked_out = len(book.key_blocks) + book.reserved_blocks - held
        assert look == (moved_keys, moved_values, checked_out)
        copies = len(moved_keys) + len(moved_values)
        assert self.pool.stats.blocks_in_use() - in_use == 2 * checked_out + copies

    @precondition(lambda self: self.books)
    @rule(choice=book_choice, n=positions, layer=st.none() | layers)
    def trim(self, choice: int, n: int, layer: int | None) -> None:
        book = self._book(choice)
        before = self._state(book)
        try:
            book.trim(n, layer=layer)
        except ValueError:  # a new last block shared behind the back: its fill is fixed
            assert self._state(book) == before

    @precondition(lambda self: 0 < len(self.books) < MOST_BOOKS)
    @rule(choice=book_choice)
    def fork(self, choice: int) -> None:
        self.books.append(self._book(choice).fork())

    @precondition(lambda self: self.books)
    @rule(choice=book_choice)
    def release(self, choice: int) -> None:
        index = choice % len(self.books)
        self.books.pop(index).release()

    @precondition(lambda self: any(book.key_blocks for book in self.books))
    @rule(choice=book_choice, index=st.integers(min_value=0), stream=st.sampled_from("kv"))
    def share_behind_the_books_back(self, choice: int, index: int, stream: str) -> None:
        holders = [book for book in self.books if book.key_blocks]
        book = holders[choice % len(holders)]
        blocks = book.key_blocks if stream == "k" else book.value_blocks
        other = FIRST_OTHER + len(self.others)
        self.pool.share([blocks[index % len(blocks)]], other)
        self.others.append(other)

    def teardown(self) -> None:
        for book in self.books:
            book.release()
        for other in self.others:
            self.pool.free_all(other)
        self.pool.check_invariants()
        assert self.pool.stats.blocks_in_use() == 0


TestLookAgreesWithAppend = LookAgreesWithAppend.TestCase
