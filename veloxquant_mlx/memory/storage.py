"""The backend-neutral contract of a block pool's backing store.

A :class:`BlockPoolAllocator` only keeps books; a *backing store* holds the
data. This module states what every store implements, whatever the array
library (MLX here, NumPy as the second reference backend, CUDA or Metal in a
port), so that KV caches and the aliasing replay work with any of them.

The model: per layer, one slab of ``capacity`` blocks indexed by block id,
each block ``block_size`` token slots of shape ``(n_kv_heads, head_dim)``.
A block id holds keys or values according to the stream its handle came
from; the store does not care which. The store is paired with one pool and
follows it: it covers every id below ``pool.id_bound()``, grows its
capacity geometrically (never moving or changing existing data) when the
pool issues higher ids, and gives memory back when ``shrink()`` retires the
top of the id range. How a slab is laid out in memory (block-major,
head-major, ...) is the store's choice; the protocol fixes only what the
gathers return: ``gather`` token-major ``(n_tokens, n_kv_heads, head_dim)``
and ``gather_heads`` head-major ``(n_kv_heads, n_tokens, head_dim)``, the
layout attention reads. A store whose slab is head-major serves
``gather_heads`` with a single take and no transposing copy, which is
what a decode step calls for every layer.

Rules every implementation keeps (the storage conformance suite in
``veloxquant_mlx.testing`` checks them):

1. ``write`` accepts only a live handle of the paired pool (``pool.is_live``),
   slots inside ``0 .. block_size`` and tokens of the store's own dtype;
   anything else raises ``ValueError`` (``TypeError`` for a non-``Block`` or
   tokens of another dtype: a store never casts, since a cast would change
   what a model computed) and changes nothing.
2. Distinct ids never share storage: a write to one block never changes what
   any other block holds.
3. An array returned by ``gather`` or ``gather_heads`` never changes
   afterwards, whatever is written, freed, grown or shrunk later (including
   arrays whose evaluation a lazy backend defers).
4. ``gather_heads`` returns exactly ``gather`` transposed to
   ``(n_kv_heads, n_tokens, head_dim)``. Both refuse a handle that is not
   live (``ValueError``) or not a ``Block`` (``TypeError``); a store checks
   a whole gather with one ``pool.all_live`` call (one pool lock, not one
   per block) and looks for the culprit only when that says no.
5. ``resident_bytes`` is what the store holds now; after the pool's id range
   shrinks, ``sync()`` (called by every operation) brings it down.
6. A store that offers :class:`CopiesBlocks` (both of ours do) copies a block
   the pool moved with ``make_writable`` (docs/CONTRACT.md#c-make-writable):
   ``copy_block`` reads an id that is still checked out and writes only
   through a live handle, under the same checks as ``write``. Both refuse a
   handle whose block is shared (``pool.is_shared``): a shared block is
   read-only (docs/CONTRACT.md#c-shared-read-only).

A store knows nothing of KV caches: the blocks of a cache dropped without
``release()`` come back through the cache layer
(:mod:`~veloxquant_mlx.memory.deferred_release`), never through a store.

Thread safety: implementations must be safe to share between threads in the
same way as the pool (the MLX and NumPy stores hold a lock around slab
updates). Complexity: ``write`` O(slots written); ``gather`` and
``gather_heads`` O(tokens gathered); growth amortised O(1) per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from veloxquant_mlx.memory.block_pool import Block

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

ArrayT = TypeVar("ArrayT")


@runtime_checkable
class BlockStorage(Protocol[ArrayT]):
    """A backing store for one pool: slabs of token slots indexed by block id."""

    @property
    def pool(self) -> CheckedBlockPool[Block]:
        """The pool whose block ids this store covers."""
        ...

    @property
    def n_layers(self) -> int:
        """Number of layers (one slab each)."""
        ...

    @property
    def slot_shape(self) -> tuple[int, int]:
        """Shape of one token slot: ``(n_kv_heads, head_dim)``."""
        ...

    def write(self, layer: int, block: Block, start: int, tokens: ArrayT) -> None:
        """Store ``tokens`` (shape ``(n, n_kv_heads, head_dim)``) into slots ``start ..
        start + n`` of ``block`` in ``layer``.

        Raises:
            TypeError: ``block`` is not a ``Block``, or ``tokens`` not of the store's dtype.
            ValueError: ``block`` is not a live handle of the paired pool, the slots
                fall outside ``0 .. block_size``, ``layer`` is out of range, or
                ``tokens`` has the wrong shape.
        """
        ...

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> ArrayT:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer``, in order, as one array
        of shape ``(n_tokens, n_kv_heads, head_dim)``; never changed by later writes.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``Block`` handles, or ``n_tokens``
                not an int.
            ValueError: A block is not a live handle of the pool, ``layer`` is out of
                range, or ``n_tokens`` is outside ``0 .. len(blocks) * block_size``.
        """
        ...

    def gather_heads(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> ArrayT:
        """The same slots as :meth:`gather`, head-major: shape ``(n_kv_heads, n_tokens,
        head_dim)``, equal to ``gather(...)`` transposed; never changed by later writes.

        The layout attention reads, so a KV cache can hand it over without a copy.
        Raises as :meth:`gather` does.
        """
        ...

    def capacity(self) -> int:
        """Number of block ids each slab currently covers (``>= pool.id_bound()``)."""
        ...

    def resident_bytes(self) -> int:
        """Bytes of slab memory held now, across all layers."""
        ...

    def sync(self) -> None:
        """Follow the pool: grow to cover new ids, give back a retired tail."""
        ...


@runtime_checkable
class CopiesBlocks(Protocol):
    """A store that copies one block's slots into another (optional; copy-on-write).

    After ``dst = pool.make_writable(handle)`` moved a shared block's handle,
    ``copy_block(None, handle.block_id, dst)`` gives the writer its own copy
    of every layer, and the block's other holders keep reading theirs.
    """

    def copy_block(self, layer: int | None, src: int, dst: Block) -> None:
        """Copy every slot of block id ``src`` into ``dst`` in ``layer`` (``None``: all).

        Raises:
            TypeError: ``layer`` is not an int or ``None``, ``src`` not an int, or
                ``dst`` not a ``Block``.
            ValueError: ``src`` is not checked out (``pool.ref_count(src) == 0``),
                ``dst`` is not a live handle, or ``layer`` is out of range. Nothing
                changes.
        """
        ...
