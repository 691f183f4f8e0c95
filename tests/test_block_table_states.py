"""The device block table agrees with its book after any sequence of book and pool calls.

A table decides incrementally what it can (the ids of blocks added, and
whether each stream's ids still run on, from the new ids alone) and checks
everything again after a free or a move anywhere in the pool. This machine
drives several books of one small pool, two layers each (some with a
reservation, docs/RESERVATIONS.md), through appends,
trims, forks, releases, exhaustion, and frees and copy-on-write moves behind
their backs, brings each table up to
date after every step, and compares it with its book, computed here
independently of the table's code: the same handles and ids, each stream's run
start exactly when its ids are ``[f, f + 1, ...]``, a stale table refused and
left empty, and :meth:`DeviceBlockTable.check_invariants` quiet.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvariantViolationError,
    PoolConfig,
)
from veloxquant_mlx.memory.block_table import DeviceBlockTable, StaleBlockTableError
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

BLOCK_SIZE = 2
N_BLOCKS = 24  # small, so that appends meet exhaustion
MOST_BOOKS = 4
N_LAYERS = 2  # layers append in turn; the table covers the furthest

# Which book a rule acts on: an index, taken modulo the number of books.
book_choice = st.integers(min_value=0, max_value=MOST_BOOKS - 1)
positions = st.integers(min_value=0, max_value=7)
layers = st.integers(min_value=0, max_value=N_LAYERS - 1)
# Positions a new book checks out ahead (docs/RESERVATIONS.md): none, half of the
# time; else from part of a block to two thirds of a stream's 12 blocks.
reservations = st.sampled_from([0, 0, 0, 1, 5, 16])


def expected_run(blocks: tuple[Block, ...]) -> int | None:
    """The first id when the ids are ``[f, f + 1, ...]``; ``None`` otherwise or empty."""
    ids = [block.block_id for block in blocks]
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        return ids[0]
    return None


class TableFollowsBook(RuleBasedStateMachine):
    """Books of one pool, each followed by a device table checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE))  # until make_pool
        self.books: list[PooledKVCache] = []
        self.tables: list[DeviceBlockTable] = []

    @initialize(separate_kv=st.booleans())
    def make_pool(self, separate_kv: bool) -> None:
        config = PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS, separate_kv=separate_kv)
        self.pool = BlockPoolAllocator(config)

    def _follow(self, book: PooledKVCache) -> None:
        self.books.append(book)
        self.tables.append(DeviceBlockTable(book))

    def _state(self, book: PooledKVCache) -> tuple[object, ...]:
        """What a refused call must leave as it was: the book's and the pool's."""
        offsets = tuple(book.layer_offset(layer) for layer in range(N_LAYERS))
        pool = self.pool
        counts = (pool.n_free("k"), pool.n_free("v"), pool.stats.blocks_in_use())
        return (offsets, book.key_blocks, book.value_blocks, book.reserved_blocks, counts)

    def _forget(self, index: int) -> None:
        del self.books[index], self.tables[index]

    @precondition(lambda self: len(self.books) < MOST_BOOKS)
    @rule(reserve_tokens=reservations)
    def new_book(self, reserve_tokens: int) -> None:
        self._follow(PooledKVCache(self.pool, n_layers=N_LAYERS, reserve_tokens=reserve_tokens))

    @precondition(lambda self: self.books)
    @rule(choice=book_choice, n=positions, layer=layers)
    def append(self, choice: int, n: int, layer: int) -> None:
        book = self.books[choice % len(self.books)]
        before = self._state(book)
        try:
            book.append(n, layer=layer)
        except BlockPoolExhaustedError:
            assert self._state(book) == before  # all or nothing

    @precondition(lambda self: self.books)
    @rule(choice=book_choice, n=positions, layer=st.none() | layers)
    def trim(self, choice: int, n: int, layer: int | None) -> None:
        book = self.books[choice % len(self.books)]
        before = self._state(book)
        try:
            book.trim(n, layer=layer)
        except BlockPoolExhaustedError:  # a shared last block's copy had no block
            assert self._state(book) == before

    @precondition(lambda self: 0 < len(self.books) < MOST_BOOKS)
    @rule(choice=book_choice)
    def fork(self, choice: int) -> None:
        self._follow(self.books[choice % len(self.books)].fork())

    @precondition(lambda self: self.books)
    @rule(choice=book_choice)
    def release(self, choice: int) -> None:
        index = choice % len(self.books)
        book, table = self.books[index], self.tables[index]
        book.release()
        table.require_live()  # a released book holds nothing: an empty table, no error
        assert (table.key_blocks, table.value_blocks, table.run_starts) == ((), (), None)
        table.check_invariants()
        self._forget(index)

    @precondition(lambda self: any(book.key_blocks for book in self.books))
    @rule(choice=book_choice)
    def free_behind_the_books_back(self, choice: int) -> None:
        holders = [index for index, book in enumerate(self.books) if book.key_blocks]
        index = holders[choice % len(holders)]
        book, table = self.books[index], self.tables[index]
        self.pool.free_all(book.owner)
        with pytest.raises(StaleBlockTableError):
            table.require_live()
        assert (table.key_blocks, table.value_blocks, table.run_starts) == ((), (), None)
        assert table.key_ids.size == table.value_ids.size == 0
        table.check_invariants()
        book.release()  # gives back the owner claim; its blocks are gone already
        self._forget(index)

    def _shared_blocks(self, book: PooledKVCache) -> list[Block]:
        return [
            block
            for block in (*book.key_blocks, *book.value_blocks)
            if self.pool.is_shared(block.block_id)
        ]

    @precondition(lambda self: any(self._shared_blocks(book) for book in self.books))
    @rule(choice=book_choice)
    def move_a_shared_block_behind_the_books_back(self, choice: int) -> None:
        holders = [index for index, book in enumerate(self.books) if self._shared_blocks(book)]
        index = holders[choice % len(holders)]
        book, table = self.books[index], self.tables[index]
        try:
            moved = self.pool.make_writable(self._shared_blocks(book)[0])
        except BlockPoolExhaustedError:
            return  # no block for the copy: nothing moved
        with pytest.raises(StaleBlockTableError):
            table.require_live()
        assert (table.key_blocks, table.value_blocks, table.run_starts) == ((), (), None)
        table.check_invariants()
        self.pool.free([moved])  # the copy is the owner's, not the book's
        book.release()  # gives back its handles that are still live, and the owner
        self._forget(index)

    @invariant()
    def every_table_matches_its_book(self) -> None:
        for book, table in zip(self.books, self.tables, strict=True):
            book.check_invariants()  # its blocks, and no other, listed for its owner
            table.require_live()
            table.check_invariants()
            assert table.key_blocks == book.key_blocks  # Block compares by identity
            assert table.value_blocks == book.value_blocks
            assert table.key_ids.tolist() == [block.block_id for block in book.key_blocks]
            assert table.value_ids.tolist() == [block.block_id for block in book.value_blocks]
            assert table.key_ids.dtype == table.value_ids.dtype == mx.int32
            key_run, value_run = expected_run(book.key_blocks), expected_run(book.value_blocks)
            both = None if key_run is None or value_run is None else (key_run, value_run)
            assert table.run_starts == both

    def teardown(self) -> None:
        for book in self.books:
            book.release()
        self.pool.check_invariants()
        assert self.pool.stats.blocks_in_use() == 0


TestTableFollowsBook = TableFollowsBook.TestCase


def _grown_table(n_positions: int) -> tuple[PooledKVCache, DeviceBlockTable]:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    book = PooledKVCache(pool)
    book.append(n_positions)
    table = DeviceBlockTable(book)
    table.require_live()
    return book, table


@pytest.mark.parametrize(
    ("attribute", "wrong", "named"),
    [
        ("_key_run", 5, "runs: the key run starts at 5"),
        ("_value_run", None, "runs: the value run starts at None"),
        ("_key_ids", mx.array([0, 1, 3], dtype=mx.int32), "ids: the key ids [0, 1, 3]"),
        (
            "_value_ids",
            mx.array([12, 13, 14], dtype=mx.int64),
            "ids: the value ids [12, 13, 14] (mlx.core.int64",
        ),
        ("_values", (), "table: 3 key handles but 0 value handles"),
    ],
)
def test_check_invariants_names_a_table_that_disagrees_with_its_handles(
    attribute: str, wrong: object, named: str
) -> None:
    book, table = _grown_table(6)  # keys 0..2, values 12..14: both run on
    assert table.run_starts == (0, 12)
    setattr(table, attribute, wrong)
    with pytest.raises(InvariantViolationError) as caught:
        table.check_invariants()
    assert str(caught.value).startswith(named)
    book.release()


def test_check_invariants_names_handles_that_are_not_the_books_while_current() -> None:
    book, table = _grown_table(6)
    other, _ = _grown_table(6)
    table._keys = other.key_blocks  # ids and runs agree with these: only the book check sees it
    with pytest.raises(InvariantViolationError, match="table: the key handles are not the book's"):
        table.check_invariants()
    book.release()
    other.release()


def test_a_table_behind_its_book_is_not_a_violation_until_it_claims_to_be_current() -> None:
    book, table = _grown_table(6)
    book.append(4)  # two more blocks: the table has not looked yet
    table.check_invariants()
    table.require_live()
    table.check_invariants()
    assert len(table.key_blocks) == 5
    book.release()
