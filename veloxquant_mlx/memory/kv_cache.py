"""PoolBackedKVCache: an mlx-lm KV cache whose keys and values live in pool blocks.

Drop-in for mlx-lm's ``KVCache`` in any model that calls
``cache.update_and_fetch(keys, values)`` and reads ``cache.offset``
(llama, qwen2, mistral, phi3, ...). It is truly paged: a request's keys and
values are written into the blocks of its
:class:`~veloxquant_mlx.memory.pooled_kv_cache.PooledKVCache` (one block
table per request, shared by all its layers) inside one backing store
(``MLXBlockStorage``: a slab per layer indexed by block id) that serves
every layer of every concurrent request. No per-request buffer exists, so
a request holds whole blocks only: at most ``block_size - 1`` idle slots
per stream per layer, against up to 255 for ``KVCache``'s 256-token steps.

``make_pool_backed_cache(model, storage)`` (in
:mod:`~veloxquant_mlx.memory.prompt_cache`, re-exported here) builds a
model's list of caches the way ``make_prompt_cache`` does; the list
releases every block on ``release()`` or when used as a context manager,
also when generation is aborted by an exception. A list that is simply
dropped, as mlx-lm code does, cannot leak either: its block table's
finaliser queues the release, and the next update of any pool-backed cache
on that pool (or the next cache built there) gives the blocks back
(:mod:`~veloxquant_mlx.memory.deferred_release` says exactly when).

Drop-in, exactly: a store sized from the model
(:func:`~veloxquant_mlx.memory.model_kv_layout.make_pool_backed_storage`)
holds the very keys and values ``KVCache`` would, so decoding gives the same
tokens and logits; keys or values of another dtype or shape than the
store's are refused before anything changes (a cast would change the
model's outputs). ``generate_step(..., kv_bits=...)`` is refused with a
``ValueError`` at the prompt's first chunk, before any block is taken, and
for any other caller at the first step that asks whether the cache can
quantize (:mod:`~veloxquant_mlx.memory.mlx_lm_protocol`): quantized keys
would leave the pool. ``PoolBackedPromptCache.save`` writes a file that
mlx-lm's ``load_prompt_cache`` alone loads, as ``KVCache`` layers, and
``.load`` pages such a file again.

The decode step over a store with the block-table path
(:class:`~veloxquant_mlx.memory.cache_storage.ServesBlockTables`,
``MLXBlockStorage``): the layers of a request share one
:class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`, the block ids
as ``mx.array`` s checked live once per change of the table and once per
decode step after any free in the pool, so a step costs O(layers) host
work whatever the context, and a stale or foreign block is still never read
or written. Each layer's call is one scatter of the new keys and values and
one read of every held position: two slices of the slab where the request's
key ids run on consecutively and so do its value ids
(:attr:`~veloxquant_mlx.memory.block_table.DeviceBlockTable.run_starts`), as
``KVCache`` reads its buffers, else one take of its blocks (at long contexts
on a CUDA GPU, one gather kernel: :mod:`~veloxquant_mlx.memory.block_gather`).
Attention then reads what the call returned (``attention="gather"``, the
default: exact, bit for bit ``KVCache``'s output) or the slab in place
with the fused CUDA kernel (``"fused"``: logits within float tolerance;
faster per call, slower per step on the models measured so far, see
:data:`~veloxquant_mlx.memory.cache_storage.AUTO_PREFERS_FUSED`). A store
with only the storage protocol is read and written block by block
(:mod:`~veloxquant_mlx.memory.protocol_io`).

Complexity (``T`` = positions of the layer, ``n`` = new ones, ``k`` =
blocks of the request): ``update_and_fetch`` O(n) host work to write plus
O(1) to build the read, which is free on the device where the ids run on
(slices, as ``KVCache``'s fetch is) and O(T) device work where it gathers
(the price of paging a request whose blocks are scattered); O(k) once after
the table changed.
``attend_in_place`` O(1) host, O(T) device, no copy. ``trim`` O(layers +
blocks freed); ``state`` O(T); ``make_mask`` O(1), O(n * T) for an array
mask; ``offset``, ``size``, ``nbytes`` O(1).

Running it well: a single-threaded decode loop wants
``MLXBlockStorage(..., lazy_writes=True)`` (no evaluation inside the
forward pass; the store then serves only the first thread that uses its
data); without it every write is evaluated and published before it returns
(one sync point per layer and step; :func:`~veloxquant_mlx.memory.mlx_storage.publish`
says why). Schedule (``mx.async_eval``) or evaluate each
request's step before building the next request's: a write to a layer whose
slab another request's pending gather still reads copies the slab. On MLX's
CPU backend the buffer cache is capped at 32 MB by default, below a long
context's per-step gathers: raise it (``mx.set_cache_limit``) or steps
page-fault fresh memory.

Limits: batch size 1 (one request per cache; run concurrent requests with
one cache list each over the shared pool and storage, one after the other
or in one forward pass through :func:`~veloxquant_mlx.memory.batch_cache.batch_caches`,
docs/BATCHED_DECODE.md); keys and values of
the same head dimension; full attention only (no sliding window).

Nothing here converts to NumPy or calls ``.item()``: the module builds MLX
graphs only, so it runs unchanged on Metal or CUDA.

Thread safety: a cache list belongs to one request and is used from one
thread at a time; the pool and the storage are shared and lock themselves.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import mlx.core as mx

from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.cache_storage import (
    AttentionMode,
    GathersHeadMajor,
    MLXStorage,
    ServesBlockTables,
    resolve_attention,
)
from veloxquant_mlx.memory.deferred_release import deferred_releases_for
from veloxquant_mlx.memory.mlx_lm_protocol import (
    KVCacheConventions,
    causal_mask,
    kv_bits_of_generation,
    kv_bits_refusal,
    register_for_loading,
    split_state,
)
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage, dtype_name, require_arrays
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.memory.protocol_io import gather_positions, write_positions

if TYPE_CHECKING:
    from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache, make_pool_backed_cache

__all__ = [
    "AttentionMode",
    "GathersHeadMajor",
    "MLXStorage",
    "PoolBackedKVCache",
    "PoolBackedPromptCache",
    "PooledKVCache",
    "ServesBlockTables",
    "causal_mask",
    "make_pool_backed_cache",
    "resolve_attention",
]

#: Names this module has always offered that now live in prompt_cache (which imports
#: this module, so they are looked up on first use rather than imported here).
_IN_PROMPT_CACHE: Final = ("PoolBackedPromptCache", "make_pool_backed_cache")


class PoolBackedKVCache(KVCacheConventions):
    """One layer's view of a request's paged keys and values (mlx-lm cache protocol;
    masks, ``meta_state``, ``size`` and the ``kv_bits`` refusal come from
    :class:`~veloxquant_mlx.memory.mlx_lm_protocol.KVCacheConventions`).

    Invariants: ``offset`` is the book's offset for this layer; positions
    ``0 .. offset - 1`` of this layer live in slots of the book's key and
    value blocks, in order, in row ``layer`` of the storage; the cache holds
    no array of its own.
    """

    def __init__(
        self,
        storage: MLXStorage,
        book: PooledKVCache,
        layer: int,
        *,
        table: DeviceBlockTable | None = None,
        attention: AttentionMode = "gather",
    ) -> None:
        """Bind ``layer`` of ``storage`` to the block table ``book``.

        Args:
            storage: The shared store.
            book: The request's block table.
            layer: Which layer of both this cache serves.
            table: The device copy of ``book`` that every layer of the request shares
                (made here if ``None``); used when the store serves block tables.
            attention: As :func:`resolve_attention`; ``"fused"`` answers
                :meth:`attend_in_place` (once :mod:`~veloxquant_mlx.memory.attention_hook`
                routes the model's attention here).

        Raises:
            TypeError: ``layer`` is not an int.
            ValueError: ``book`` draws from another pool than ``storage`` follows,
                ``layer`` is outside both the storage's and the book's layers, ``table``
                follows another book, or ``attention`` is not a mode the store serves.
        """
        if book.pool is not storage.pool:
            raise ValueError("book and storage must share one pool; got two different pools")
        if type(layer) is not int:
            raise TypeError(f"layer must be an int, got {layer!r} ({type(layer).__name__})")
        if not 0 <= layer < min(book.n_layers, storage.n_layers):
            raise ValueError(
                f"layer must be in 0..{min(book.n_layers, storage.n_layers) - 1} "
                f"(the book's and the storage's layers), got {layer!r}"
            )
        if table is not None and table.book is not book:
            raise ValueError("table must follow the same book as the cache")
        # The shared store: row `layer` of its slabs holds this layer's positions.
        self._storage: Final = storage
        # The request's block table and per-layer offsets, shared with its other layers.
        self._book: Final = book
        self._layer: Final = layer
        # Shape of one token slot and the dtype: what every update must match.
        self._heads, self._head_dim = storage.slot_shape
        self._dtype = storage.dtype
        # The store again, if it has the decode path through a block table; else None,
        # and each call hands the store the blocks (O(blocks) liveness checks).
        self._table_store: Final = storage if isinstance(storage, ServesBlockTables) else None
        # The book's ids on the device, shared by the request's layers (table path only).
        self._table: Final = (
            (table if table is not None else DeviceBlockTable(book))
            if self._table_store is not None
            else None
        )
        # The table path's write-and-read: MLXBlockStorage's entry that skips the checks of
        # keys and values this cache has made (the same package's store: a friend call),
        # another store's checked update_through_table; None without the table path.
        self._update_through_table: Final = (
            None
            if self._table_store is None
            else storage._decode_through_table
            if isinstance(storage, MLXBlockStorage)
            else self._table_store.update_through_table
        )
        # Whether attend_in_place() answers (fused mode) or defers to the gathered path.
        self._fused: Final = resolve_attention(storage, attention) == "fused"
        # The pool's dropped books: every update releases them first (O(1) if none).
        self._releases: Final = deferred_releases_for(book.pool)
        # A lazy_writes store refuses other threads: asked before the book takes blocks
        # (binding the store, as its data is written next), or before a trim (binding none).
        lazy = storage if isinstance(storage, MLXBlockStorage) and storage.lazy_writes else None
        self._thread_check: Final = None if lazy is None else lazy.require_this_thread
        self._thread_refusal: Final = None if lazy is None else lazy.refuse_other_thread
        # Whether a call has looked for the generator's kv_bits (a prompt of one or two
        # tokens reaches the cache as one-position calls only).
        self._kv_bits_checked = False

    # -- mlx-lm protocol: the hot path -------------------------------------------------

    @property
    def offset(self) -> int:
        """Positions this layer holds; the rotary offset of the next token."""
        return self._book.layer_offset(self._layer)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys`` and ``values`` (``(1, heads, n, head_dim)``); return all positions.

        Returns:
            Keys and values of positions ``0 .. offset`` after the append, each of shape
            ``(1, heads, offset, head_dim)`` in the storage's dtype.

        Raises:
            ValueError: A shape is not ``(1, heads, n, head_dim)`` of the storage, or
                mlx-lm's generator asks for ``kv_bits``.
            TypeError: Keys or values are not of the storage's dtype (nothing is cast).
            RuntimeError: The cache was released.
            BlockPoolExhaustedError: The pool has too few free blocks; nothing changed.
        """
        dtype = self._dtype
        if type(keys) is mx.array and type(values) is mx.array:
            shape = keys.shape
            fits = (
                len(shape) == 4
                and shape == values.shape
                and shape[1] == self._heads
                and shape[3] == self._head_dim
                and shape[0] == 1
                and keys.dtype == dtype
                and values.dtype == dtype
            )  # the decode path: one test; _require_update says what is wrong otherwise
        else:
            fits = False
        if fits:
            n_tokens: int = shape[2]
        else:
            n_tokens = self._require_update(keys, values)
        if self._thread_check is not None:  # _require_store_thread, inlined: the decode path
            self._thread_check()
        self._releases.drain()  # blocks of caches dropped without release() come back
        if n_tokens != 1 or not self._kv_bits_checked:
            # A prompt chunk, or this cache's first call: refuse kv_bits before any block
            # is taken.
            bits = kv_bits_of_generation()
            if bits is not None:
                raise kv_bits_refusal(bits, dtype_name(self._dtype))
            self._kv_bits_checked = True
        book, layer = self._book, self._layer
        start = book.append(n_tokens, layer=layer)
        try:
            update, table = self._update_through_table, self._table
            if update is not None and table is not None:
                return update(layer, table, start, keys, values)
            if n_tokens:
                write_positions(self._storage, book, layer, start, keys=keys, values=values)
            return gather_positions(self._storage, book, layer, start + n_tokens)
        except BaseException:
            book.trim(n_tokens, layer=layer)
            raise

    def attend_in_place(self, queries: mx.array, scale: float) -> mx.array | None:
        """Decode attention over every held position, read in place (fused mode).

        Called by the dispatcher of :mod:`~veloxquant_mlx.memory.attention_hook`
        after ``update_and_fetch``, for one query position with no mask.

        Returns:
            ``(1, n_q_heads, 1, head_dim)``; ``None`` when this cache is in gather mode
            or the call is not a one-position decode of the store's dtype (the model's
            attention then reads what ``update_and_fetch`` returned).
        """
        store, table, shape = self._table_store, self._table, queries.shape
        if not self._fused or store is None or table is None:
            return None
        if shape[0] != 1 or shape[2] != 1 or queries.dtype != self._dtype:
            return None
        return store.attend_through_table(self._layer, table, self.offset, queries, scale)

    @property
    def attention(self) -> str:
        """``"fused"`` or ``"gather"``: how this cache's attention reads its positions."""
        return "fused" if self._fused else "gather"

    # -- mlx-lm protocol: state and sizes ----------------------------------------------

    @property
    def state(self) -> tuple[mx.array, mx.array, int]:
        """``(keys, values, offset)`` as mlx-lm's ``KVCache`` has it: keys and values of
        every held position, each ``(1, heads, offset, head_dim)``."""
        offset = self.offset
        store, table = self._table_store, self._table
        if store is not None and table is not None:
            keys, values = store.fetch_through_table(self._layer, table, offset)
        else:
            keys, values = gather_positions(self._storage, self._book, self._layer, offset)
        return keys, values, offset

    @state.setter
    def state(self, state: Sequence[object]) -> None:
        """Replace this layer's contents by ``(keys, values, offset)`` (or ``(keys,
        values)``), written into the request's blocks.

        Raises:
            TypeError, ValueError: Not such a tuple, arrays of another shape or dtype
                than the storage's, or blocks changed behind the book's back (freed,
                moved or shared: ``PooledKVCache.require_rewritable``); nothing changes.
            BlockPoolExhaustedError: Too few free blocks, looked for before the trim;
                nothing changes but what ``update_and_fetch`` also does first: the
                blocks of caches dropped without ``release()`` go back. Only if another
                thread takes blocks between that look and the append is the layer left
                empty.
            RuntimeError: A ``lazy_writes`` store called from another thread; nothing
                changes.
        """
        self._require_store_thread()
        keys, values, offset = split_state(state)
        if offset:
            keys, values = keys[..., :offset, :], values[..., :offset, :]
            self._require_update(keys, values)
            self._book.require_rewritable(self._layer, offset)  # before the trim empties it
        self._book.trim(self.offset, layer=self._layer)
        if offset:
            self.update_and_fetch(keys, values)

    def is_trimmable(self) -> bool:
        """Whether ``trim`` may be called: until the request is released."""
        return self._book.is_trimmable()

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of this layer; whole blocks past every layer go back.

        Unlike ``KVCache.trim``, it can be refused: after a fork, the block that
        becomes this layer's last may be shared, and its fill can change only in a
        private copy. The copy is made at the first layer trimmed into it, so of a
        list whose layers are in step (as mlx-lm keeps them) trimmed layer by layer
        (``trim_prompt_cache``), either the first layer's trim is refused, with every
        layer as it was, or none is. (So a trim of one layer alone may take a block
        that later trims, ending on a block boundary, would not have needed.)

        Returns:
            Positions dropped: ``min(n, offset)``.

        Raises:
            RuntimeError: A ``lazy_writes`` store called from another thread (a trim
                of a fork may copy blocks in the store); nothing changes.
            TypeError, ValueError, BlockPoolExhaustedError, StaleBlockTableError: As
                :meth:`PooledKVCache.trim`: a bad ``n``; no block for that copy; a block
                freed or moved behind the book's back (stale), or a new last block
                shared behind it (``ValueError``); nothing changes.
        """
        self._require_store_thread()
        return self._book.trim(n, layer=self._layer)

    def _require_store_thread(self) -> None:
        """Refuse another thread than a ``lazy_writes`` store's, before the book changes,
        binding no store: a trim touches no data (a copy-on-write it makes binds the store
        through the book's ``before_copy``, before the move)."""
        if self._thread_refusal is not None:
            self._thread_refusal()

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's rows of the request's blocks, keys and values: whole
        blocks, the reserved ones included (RES-ACCOUNT), as ``KVCache.nbytes`` counts
        its buffers' room not yet written."""
        slots = 2 * self._book.slots_held()  # per stream
        return slots * self._heads * self._head_dim * self._dtype.size

    @property
    def book(self) -> PooledKVCache:
        """The request's block table, shared by all its layers."""
        return self._book

    @property
    def layer(self) -> int:
        """Which layer of the book and of the store this cache serves."""
        return self._layer

    @property
    def storage(self) -> MLXStorage:
        """The store this layer's positions live in."""
        return self._storage

    @property
    def table(self) -> DeviceBlockTable | None:
        """The device block table the request's layers share; ``None`` where the store
        has no block-table path (it is then read and written block by block)."""
        return self._table

    # -- internals ---------------------------------------------------------------------

    def _require_update(self, keys: mx.array, values: mx.array) -> int:
        """The number of positions in ``keys`` and ``values``, if the storage can hold them."""
        require_arrays(keys, values)
        shape, dtype = keys.shape, self._dtype
        if (
            len(shape) == 4
            and shape == values.shape
            and shape[0] == 1
            and shape[1] == self._heads
            and shape[3] == self._head_dim
            and keys.dtype == dtype
            and values.dtype == dtype
        ):
            return int(shape[2])
        expected = (1, self._heads, shape[2] if len(shape) == 4 else -1, self._head_dim)
        if tuple(shape) != expected or tuple(values.shape) != expected:
            raise ValueError(
                f"keys and values must both have shape (1, {self._heads}, n, {self._head_dim}) "
                f"(batch size 1), got {tuple(shape)} and {tuple(values.shape)}"
            )
        raise TypeError(
            f"keys and values must have the store's dtype {dtype_name(dtype)}, got "
            f"{dtype_name(keys.dtype)} and {dtype_name(values.dtype)}; a cast would change "
            "the model's outputs, so size the store from the model "
            "(make_pool_backed_storage(model, pool))"
        )


register_for_loading(PoolBackedKVCache)  # the fallback for files saved by mlx-lm directly


def __getattr__(name: str) -> object:
    if name in _IN_PROMPT_CACHE:
        return getattr(importlib.import_module("veloxquant_mlx.memory.prompt_cache"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
