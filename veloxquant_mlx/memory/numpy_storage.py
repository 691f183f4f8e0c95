"""NumpyBlockStorage: the second reference backend of the storage protocol.

The same model as :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`
in plain NumPy, written to be read and ported: per layer one ``ndarray`` slab
of shape ``(capacity, block_size, n_kv_heads, head_dim)`` indexed by block id,
updated in place. It serves three purposes: it shows that the storage
protocol and its conformance suite are not MLX-specific; it is the template
for a CUDA, Metal or Rust port (each rule below maps to a line of code); and
it runs where MLX does not.

NumPy is eager and mutable, so the protocol's "a gathered array never
changes" rule is kept by copying: ``gather`` and ``gather_heads`` use fancy
indexing, which always copies, and never return a view of a slab.

The slab stays block-major, the plainest layout to read and port: the
head-major order attention wants is a store's own choice (the MLX store
makes it to save a copy per decode step), so ``gather_heads`` here
reorders its copy, which costs one more copy of the gathered tokens.

Capacity follows the pool exactly as the MLX store does (see
:func:`next_capacity`): geometric growth, and a shrink to ``pool.id_bound()``
once that falls to half the capacity or less; the shrunk slab is a fresh
copy, so the old buffer is freed.

Complexity: ``write`` O(slots written); ``gather`` and ``gather_heads``
O(tokens gathered) plus one pool call (``all_live``) checking the O(blocks)
handles under one lock; ``sync`` O(1) unless it resizes, then O(capacity)
per layer, amortised O(1) per block; ``capacity``, ``resident_bytes``
O(layers).

Thread safety: one ``threading.Lock`` per store guards the slabs; every
public method holds it while it reads, writes or replaces a slab. A write
that races a ``free`` of the same handle on another thread is the caller's
bug: liveness is checked once, at the start of the write.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from veloxquant_mlx.memory._storage_checks import (
    block_list_of,
    copy_layers,
    next_capacity,
    require_all_live,
    require_covered,
    require_layer,
    require_n_tokens,
    require_slots,
    require_store_arguments,
    require_token_dtype,
    require_token_shape,
    require_writable,
)
from veloxquant_mlx.memory.block_pool import Block

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = ["NumpyBlockStorage"]


class NumpyBlockStorage:
    """Per-layer NumPy slabs of KV-cache token slots, indexed by block id.

    Implements :class:`veloxquant_mlx.memory.storage.BlockStorage` for
    ``numpy.ndarray``.

    Invariants (after every public call):

    - every slab has shape ``(capacity, block_size, n_kv_heads, head_dim)`` and
      the store's dtype, and ``pool.id_bound() <= capacity`` as of the last sync;
    - ``capacity == next_capacity(capacity, id_bound)`` for the last ``id_bound``
      seen;
    - row ``i`` of a slab is written only through a live handle of ``pool`` with
      ``block_id == i``, and no array handed out shares memory with a slab;
    - growth keeps rows ``0 .. old capacity - 1``; a shrink keeps rows
      ``0 .. new capacity - 1``.
    """

    def __init__(
        self,
        pool: CheckedBlockPool[Block],
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: npt.DTypeLike = np.float16,
    ) -> None:
        """Allocate zeroed slabs covering the pool's current ids.

        Raises:
            TypeError: ``pool`` is not a ``BlockPoolAllocator`` or a size not an int.
            ValueError: A size is below 1.
        """
        require_store_arguments(pool, n_layers, n_kv_heads, head_dim)
        self._pool: Final = pool
        self._block_size: Final = pool.config.block_size
        self._slot_shape: Final = (n_kv_heads, head_dim)
        self._dtype: Final = np.dtype(dtype)
        self._lock: Final = threading.Lock()
        # Block ids each slab covers; only _resize_locked changes it.
        self._capacity = pool.id_bound()
        # One slab per layer, written in place; replaced only by a resize.
        self._slabs: list[npt.NDArray[np.generic]] = [
            self._zeros(self._capacity) for _ in range(n_layers)
        ]

    # -- protocol: shape ---------------------------------------------------------------

    @property
    def pool(self) -> CheckedBlockPool[Block]:
        """The pool whose block ids this store covers."""
        return self._pool

    @property
    def n_layers(self) -> int:
        """Number of layers (one slab each)."""
        return len(self._slabs)

    @property
    def slot_shape(self) -> tuple[int, int]:
        """Shape of one token slot: ``(n_kv_heads, head_dim)``."""
        return self._slot_shape

    @property
    def dtype(self) -> np.dtype[np.generic]:
        """Element type of every slab; written tokens must have it (nothing is cast)."""
        return self._dtype

    # -- protocol: data ----------------------------------------------------------------

    def write(self, layer: int, block: Block, start: int, tokens: npt.NDArray[np.generic]) -> None:
        """Store ``tokens`` (``(n, n_kv_heads, head_dim)``) in slots ``start .. start + n``.

        Raises:
            TypeError: ``block`` is not a ``Block``, ``tokens`` not an ``ndarray`` of
                the store's dtype, ``layer`` or ``start`` not an int.
            ValueError: ``block`` is not a live handle of the pool, the slots fall
                outside ``0 .. block_size``, ``layer`` is out of range, or ``tokens``
                has the wrong shape. Nothing changes.
        """
        if not isinstance(tokens, np.ndarray):
            raise TypeError(f"tokens must be a numpy.ndarray, got {type(tokens).__name__}")
        require_token_dtype(tokens.dtype, self._dtype, _dtype_name)
        n_tokens = require_token_shape(tokens.shape, self._slot_shape)
        require_slots(start, n_tokens, self._block_size)
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_writable(self._pool, block, "write to")
            self._sync_locked()
            require_covered(block, self._capacity)
            self._slabs[layer][block.block_id, start : start + n_tokens] = tokens

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> npt.NDArray[np.generic]:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer``, in order, as a new array.

        Returns an array of shape ``(n_tokens, n_kv_heads, head_dim)`` that owns
        its memory (fancy indexing copies), so later writes never reach it.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``Block``; ``n_tokens`` not an int.
            ValueError: A block is not a live handle of the pool, ``layer`` is out of
                range, or ``n_tokens`` is outside ``0 .. len(blocks) * block_size``.
        """
        picked = self._take(layer, blocks, n_tokens)  # (blocks, block_size, heads, dim)
        flat = picked.reshape(picked.shape[0] * self._block_size, *self._slot_shape)
        return flat[:n_tokens]

    def gather_heads(
        self, layer: int, blocks: Sequence[Block], n_tokens: int
    ) -> npt.NDArray[np.generic]:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer``, head-major, as a new array.

        Returns a C-contiguous array of shape ``(n_kv_heads, n_tokens, head_dim)``
        equal to ``gather(...).transpose(1, 0, 2)``; it shares no memory with a
        slab, so later writes never reach it.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``Block``; ``n_tokens`` not an int.
            ValueError: A block is not a live handle of the pool, ``layer`` is out of
                range, or ``n_tokens`` is outside ``0 .. len(blocks) * block_size``.
        """
        picked = self._take(layer, blocks, n_tokens)  # (blocks, block_size, heads, dim)
        heads, head_dim = self._slot_shape
        by_head = picked.transpose(2, 0, 1, 3)  # a view of the copy, not of the slab
        flat = by_head.reshape(heads, picked.shape[0] * self._block_size, head_dim)
        return np.ascontiguousarray(flat[:, :n_tokens])

    def copy_block(self, layer: int | None, src: int, dst: Block) -> None:
        """Copy every slot of block id ``src`` into ``dst``, in ``layer`` or every layer.

        The copy-on-write step after ``pool.make_writable`` (storage.CopiesBlocks).

        Raises:
            TypeError, ValueError: As :class:`~veloxquant_mlx.memory.storage.CopiesBlocks`
                says; nothing changes.
        """
        with self._lock:
            layers = copy_layers(self._pool, layer, len(self._slabs), src)
            require_writable(self._pool, dst, "copy into")
            self._sync_locked()
            require_covered(dst, self._capacity)
            for index in layers:
                self._slabs[index][dst.block_id] = self._slabs[index][src]

    # -- protocol: sizing --------------------------------------------------------------

    def capacity(self) -> int:
        """Number of block ids each slab covers after a sync (``>= pool.id_bound()``)."""
        with self._lock:
            self._sync_locked()
            return self._capacity

    def resident_bytes(self) -> int:
        """Bytes of slab memory held after a sync, across all layers."""
        with self._lock:
            self._sync_locked()
            return sum(slab.nbytes for slab in self._slabs)

    def sync(self) -> None:
        """Follow the pool: resize every slab to ``next_capacity(capacity, pool.id_bound())``."""
        with self._lock:
            self._sync_locked()

    # -- internals ---------------------------------------------------------------------

    def _take(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> npt.NDArray[np.generic]:
        """Check a gather's arguments; a copy of ``blocks``' rows of ``layer``, in order."""
        block_list = block_list_of(blocks)
        require_n_tokens(n_tokens, len(block_list) * self._block_size)
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_all_live(self._pool, block_list)
            self._sync_locked()
            ids = np.fromiter((block.block_id for block in block_list), np.intp, len(block_list))
            if block_list:
                require_covered(block_list[int(ids.argmax())], self._capacity)
            return self._slabs[layer][ids]  # fancy indexing: a copy, never a view

    def _sync_locked(self) -> None:
        target = next_capacity(self._capacity, self._pool.id_bound())
        if target != self._capacity:
            self._resize_locked(target)

    def _resize_locked(self, target: int) -> None:
        """Give every slab ``target`` rows, keeping the first ``min(old, target)`` rows."""
        kept = min(self._capacity, target)
        resized = []
        for slab in self._slabs:
            new_slab = self._zeros(target)
            new_slab[:kept] = slab[:kept]  # a copy either way: the old buffer can go
            resized.append(new_slab)
        self._slabs = resized
        self._capacity = target

    def _zeros(self, n_blocks: int) -> npt.NDArray[np.generic]:
        return np.zeros((n_blocks, self._block_size, *self._slot_shape), dtype=self._dtype)


def _dtype_name(dtype: np.dtype[np.generic]) -> str:
    return dtype.name
