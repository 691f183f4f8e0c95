"""Slot rows: where a request's positions lie in an ``MLXBlockStorage`` slab, as index arrays.

The MLX store keeps each layer's keys and values in one head-major slab
``(1, n_kv_heads, capacity * block_size, head_dim)``: slot ``s`` of block
``b`` is row ``b * block_size + s`` of every head. A decode step of one
layer is then, as for ``KVCache``, two slice updates of one row each (the new
key and value, at start rows that do not depend on the capacity), and one
read. When the request's key blocks hold consecutive ids, and so do its
value blocks, its positions are one run of rows of every head, and the
read is two slices of the slab, as ``KVCache`` reads its buffers: no copy,
the same values (:attr:`StepRows.run_rows`; with ``separate_kv=True`` a
fresh fixed pool hands a request alone its blocks so). Otherwise it is an
``mx.take`` of every held *block* of keys and values at once, from the slab
seen as ``(n_kv_heads * capacity, block_size, head_dim)`` (block ``b`` of
head ``h`` is entry ``h * capacity + b``), which lands in the ``(heads,
tokens, head_dim)`` layout attention reads, cut to the positions held and
split into keys and values. No per-block work on the host, and the device
copies whole blocks: gathering single positions (token rows) or with
``take_along_axis`` moved the same bytes 2.5x slower on the CPU.

:class:`SlotRows` holds the block entries of one request's
:class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable` for one slab
capacity, ``(2, n_kv_heads, n_blocks)`` int32 (keys, then values), built by
a few MLX operations from the table's id arrays when the table or the
capacity changes (once per ``block_size`` steps in a decode), and the
current step's pieces (where to write, which blocks to read), made once per
step and shared by every layer of it.

Users: :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`'s decode
path. Complexity: building O(1) host work, O(blocks) device work;
:meth:`SlotRows.for_step` O(1) host work for a decode step (two one-element
arrays and at most one slice), O(blocks written) for a write of several
positions. Thread safety: a ``SlotRows`` belongs to one request's table,
used from one thread at a time; its step pieces are made per thread (an MLX
graph left lazy on one thread cannot be evaluated on another), and with
``schedule_rows`` the entries themselves are scheduled with
``mx.async_eval`` so another thread may build on them later (not while
the last one's step is still running: two threads looking at one array at
once race inside MLX 0.32, see ``mlx_storage.publish``).
"""

from __future__ import annotations

import threading
from typing import Final, NamedTuple

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.block_table import DeviceBlockTable, schedule

__all__ = ["RowRun", "SlotRows", "StepRows"]


class RowRun(NamedTuple):
    """Positions ``first .. first + length - 1`` of a write, and the slab row of each
    stream where they start (one block holds them all).

    Host integers, so the write is a static slice update: on MLX's CUDA back-end a
    slice update at an ``mx.array`` start index (``DynamicSliceUpdate``) copied the
    whole slab at every write, a cost that grew with the pool. A named tuple, not a
    frozen dataclass: one is made per decode step, and a tuple is built in less than
    half the time.
    """

    first: int
    length: int
    key_row: int
    value_row: int


class StepRows(NamedTuple):
    """One step's pieces: where its new positions go, and which blocks it reads (a
    named tuple for the reason :class:`RowRun` is one).

    Attributes:
        writes: One :class:`RowRun` per block the new positions touch (one for a
            decode step).
        read_blocks: Block entries of the positions read, keys then values:
            ``(2, n_kv_heads, blocks)``, the last block partly held.
        n_read: Positions read, ``start + n``.
        run_rows: The slab rows of position 0 of the keys and of the values when
            each stream's blocks are one run of consecutive ids (the positions
            read are then rows ``row .. row + n_read - 1`` of every head); else
            ``None``.
    """

    writes: tuple[RowRun, ...]
    read_blocks: mx.array
    n_read: int
    run_rows: tuple[int, int] | None


class SlotRows:
    """The slab entries of one table's blocks, and one step's pieces.

    Invariants: ``blocks[s, h, i]`` is the entry of block ``i`` of stream ``s`` (0
    keys, 1 values) of head ``h`` in a slab of ``capacity`` blocks seen as
    ``(n_kv_heads * capacity, block_size, head_dim)``, for the ids the table had
    when this was built; the step pieces are those of the last step asked for, on
    the thread that asked.
    """

    def __init__(
        self,
        table: DeviceBlockTable,
        *,
        n_kv_heads: int,
        capacity: int,
        block_size: int,
        schedule_rows: bool,
    ) -> None:
        """Build the entries from ``table``'s id arrays (lazily; scheduled if
        ``schedule_rows``)."""
        # The slab capacity the entries are computed for: a resize makes them wrong.
        self.capacity: Final = capacity
        # The table's handles as checked live (not the table: it keeps this in its memo,
        # and a cycle would keep a dropped request's book, so its blocks, until a collection).
        self._key_blocks: Final = table.key_blocks
        self._value_blocks: Final = table.value_blocks
        self._block_size: Final = block_size
        self._n_blocks: Final = table.key_ids.size
        # Positions the table's blocks hold: the longest read a step may ask for.
        self.n_slots: Final = self._n_blocks * block_size
        starts = table.run_starts
        # Where each stream's one run of rows starts, if its ids run on (StepRows.run_rows).
        self._run_rows: Final = (
            None if starts is None else (starts[0] * block_size, starts[1] * block_size)
        )
        ids = mx.stack([table.key_ids, table.value_ids])  # (2, blocks)
        first_entries = mx.arange(n_kv_heads, dtype=mx.int32) * capacity
        self.blocks: Final = first_entries[None, :, None] + ids[:, None, :]  # (2, heads, blocks)
        if schedule_rows:
            schedule(self.blocks)
        # The last step's key (start, n, thread ident) and its pieces.
        self._step: tuple[int, int, int] = (-1, -1, -1)
        self._pieces = StepRows((), self.blocks, 0, self._run_rows)

    def for_step(self, start: int, n_new: int) -> StepRows:
        """The pieces of writing positions ``start .. start + n_new - 1`` and reading
        ``0 .. start + n_new - 1``; the caller checked the range (within ``n_slots``)."""
        step = (start, n_new, threading.get_ident())
        if step != self._step:
            self._pieces = self._make_step(start, n_new)
            self._step = step
        return self._pieces

    def _make_step(self, start: int, n_new: int) -> StepRows:
        end = start + n_new
        n_blocks = -(-end // self._block_size)
        last = self._pieces
        if last.read_blocks.shape[2] == n_blocks and self._step[2] == threading.get_ident():
            read = last.read_blocks  # the last step's blocks (made on this thread): reused
        elif n_blocks == self._n_blocks:
            read = self.blocks
        else:
            read = self.blocks[:, :, :n_blocks]
        return StepRows(self._runs(start, n_new), read, end, self._run_rows)

    def _runs(self, start: int, n_new: int) -> tuple[RowRun, ...]:
        block_size = self._block_size
        index, slot = divmod(start, block_size)
        if 0 < n_new <= block_size - slot:  # in one block, as every decode step
            key_row = _start_row(self._key_blocks[index], slot, block_size)
            return (
                RowRun(0, n_new, key_row, _start_row(self._value_blocks[index], slot, block_size)),
            )
        runs: list[RowRun] = []
        done = 0
        while done < n_new:
            index, slot = divmod(start + done, self._block_size)
            length = min(self._block_size - slot, n_new - done)
            runs.append(
                RowRun(
                    done,
                    length,
                    _start_row(self._key_blocks[index], slot, self._block_size),
                    _start_row(self._value_blocks[index], slot, self._block_size),
                )
            )
            done += length
        return tuple(runs)


def _start_row(block: Block, slot: int, block_size: int) -> int:
    return block.block_id * block_size + slot
