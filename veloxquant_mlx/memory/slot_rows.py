"""Slot rows: where a request's positions lie in an ``MLXBlockStorage`` slab, as index arrays.

The MLX store keeps each layer's keys and values in one head-major slab
``(1, n_kv_heads, capacity * block_size, head_dim)``: slot ``s`` of block
``b`` is row ``b * block_size + s`` of every head, whatever the capacity. A
decode step of one layer is then, as for ``KVCache``, two slice updates (the
new key and value rows) and one read: a ``take_along_axis`` of every held
row of keys and values at once, in the ``(heads, tokens, head_dim)`` layout
attention reads, split into keys and values. No per-block work on the host.

:class:`SlotRows` holds those rows for one request's
:class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`: ``(2, 1,
n_blocks * block_size, 1)`` int32 (keys, then values), built by a few MLX
operations from the table's id arrays when the table changes (once per
``block_size`` steps in a decode); and the current step's pieces (where to
write, what to read), made once per step and shared by every layer of it.

Users: :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`'s decode
path. Complexity: building O(1) host work, O(blocks * block_size) device
work; :meth:`SlotRows.for_step` O(1) host work (two small arrays and one
slice per step; O(n) for a write of n > 1 positions). Thread safety: a
``SlotRows`` belongs to one request's table, used from one thread at a
time; its step pieces are made per thread (an MLX graph left lazy on one
thread cannot be evaluated on another), and with ``schedule_rows`` the rows
themselves are scheduled with ``mx.async_eval`` so any thread may build on
them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Final

import mlx.core as mx

from veloxquant_mlx.memory.block_table import DeviceBlockTable, schedule

__all__ = ["SlotRows", "StepRows"]


@dataclass(frozen=True)
class StepRows:
    """One step's pieces: where its ``n`` new positions go, and every row it reads.

    Attributes:
        key_write, value_write: For one position, the row as a ``(1,)`` start index
            (a slice update); for several, their rows as ``(1, 1, n, 1)`` (a scatter).
        read: The rows of positions ``0 .. start + n - 1``, keys then values:
            ``(2, 1, start + n, 1)``.
    """

    key_write: mx.array
    value_write: mx.array
    read: mx.array


class SlotRows:
    """The slab rows of every position of one table's blocks, and one step's pieces.

    Invariants: ``rows[s, 0, p, 0]`` is the row of position ``p`` of stream ``s``
    (0 keys, 1 values) for the ids the table had when this was built; the step
    pieces are those of the last step asked for, on the thread that asked.
    """

    def __init__(self, table: DeviceBlockTable, *, block_size: int, schedule_rows: bool) -> None:
        """Build the rows from ``table``'s id arrays (lazily; scheduled if ``schedule_rows``)."""
        # The table's handles as checked live (not the table: it keeps this in its memo,
        # and a cycle would keep a dropped request's book, so its blocks, until a collection).
        self._key_blocks: Final = table.key_blocks
        self._value_blocks: Final = table.value_blocks
        self._block_size: Final = block_size
        n_blocks = table.key_ids.size
        # Positions the table's blocks hold: the longest read a step may ask for.
        self.n_slots: Final = n_blocks * block_size
        ids = mx.stack([table.key_ids, table.value_ids])  # (2, blocks)
        rows = ids[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)
        self.rows: Final = rows.reshape(2, 1, self.n_slots, 1)
        if schedule_rows:
            schedule(self.rows)
        # The last step's key (start, n, thread ident) and its pieces.
        self._step: tuple[int, int, int] = (-1, -1, -1)
        self._pieces = StepRows(self.rows, self.rows, self.rows)

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
        rows = self.rows
        read = rows if end == self.n_slots else rows[:, :, :end]
        if n_new == 1:  # the decode step: two start rows, made on the host
            index, slot = divmod(start, self._block_size)
            key_row = self._key_blocks[index].block_id * self._block_size + slot
            value_row = self._value_blocks[index].block_id * self._block_size + slot
            return StepRows(
                mx.array([key_row], dtype=mx.int32), mx.array([value_row], dtype=mx.int32), read
            )
        return StepRows(rows[0:1, :, start:end], rows[1:2, :, start:end], read)
