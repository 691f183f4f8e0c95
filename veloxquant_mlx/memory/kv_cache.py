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
finaliser queues the release and the pool gets the blocks back at the next
store call (:mod:`~veloxquant_mlx.memory.deferred_release` says exactly when).

Drop-in, exactly: a store sized from the model
(:func:`~veloxquant_mlx.memory.model_kv_layout.make_pool_backed_storage`)
holds the very keys and values ``KVCache`` would, so decoding gives the same
tokens and logits; keys or values of another dtype or shape than the
store's are refused before anything changes (a cast would change the
model's outputs). ``generate_step(..., kv_bits=...)`` is refused with a
``ValueError`` (once mlx-lm asks for it, at ``quantized_kv_start``
positions): quantized keys would leave the pool. A cache saved with
``save_prompt_cache`` loads with ``load_prompt_cache`` as ``KVCache``
layers, which :meth:`PoolBackedPromptCache.copy_from` pages again;
:mod:`~veloxquant_mlx.memory.mlx_lm_protocol` explains both.

The decode step over a store with the block-table path
(:class:`~veloxquant_mlx.memory.cache_storage.ServesBlockTables`,
``MLXBlockStorage``): the layers of a request share one
:class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`, the block ids
as ``mx.array`` s checked live once per change of the table (and again
after any free in the pool), so a step costs O(layers) host work whatever
the context, and a stale or foreign block is still never read or written.
Attention then reads the positions either through a gathered copy
(``attention="gather"``, the default: exact, bit for bit ``KVCache``'s
output) or in place with the fused CUDA kernel (``"fused"``: logits within
float tolerance; faster per call, slower per step on the models measured so
far, see :data:`~veloxquant_mlx.memory.cache_storage.AUTO_PREFERS_FUSED`).

Complexity (``T`` = positions of the layer, ``n`` = new ones, ``k`` =
blocks of the request): ``update_and_fetch`` O(n) host work to write plus
O(1) to build the gather (one ``mx.take`` of rows every layer of a step
shares), O(T) device work for it; O(k) once after the table changed by a
free. ``KVCache`` returns a slice of its buffer instead, so its fetch is free
on the device; the gather is the price of paging without the kernel.
``attend_in_place`` O(1) host, O(T) device, no copy. ``trim`` O(layers +
blocks freed); ``state`` O(T); ``make_mask`` O(1), O(n * T) for an array
mask; ``offset``, ``size``, ``nbytes`` O(1).

Running it well: a single-threaded decode loop wants
``MLXBlockStorage(..., lazy_writes=True)`` (no evaluation inside the
forward pass; the store then serves only the first thread that calls it);
without it every write is scheduled with ``mx.async_eval`` (no sync, but
host work per write). Schedule (``mx.async_eval``) or evaluate each
request's step before building the next request's: a write to a layer whose
slab another request's pending gather still reads copies the slab. On MLX's
CPU backend the buffer cache is capped at 32 MB by default, below a long
context's per-step gathers: raise it (``mx.set_cache_limit``) or steps
page-fault fresh memory.

Limits: batch size 1 (one request per cache; run concurrent requests with
one cache list each over the shared pool and storage); keys and values of
the same head dimension; full attention only (no sliding window).

Nothing here converts to NumPy or calls ``.item()``: the module builds MLX
graphs only, so it runs unchanged on Metal or CUDA.

Thread safety: a cache list belongs to one request and is used from one
thread at a time; the pool and the storage are shared and lock themselves.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NoReturn

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.cache_storage import (
    AttentionMode,
    GathersHeadMajor,
    MLXStorage,
    ServesBlockTables,
    resolve_attention,
)
from veloxquant_mlx.memory.mlx_lm_protocol import (
    MaskT,
    causal_mask,
    kv_cache_from_state,
    register_for_loading,
    split_state,
)
from veloxquant_mlx.memory.mlx_storage import dtype_name
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

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


class PoolBackedKVCache:
    """One layer's view of a request's paged keys and values (mlx-lm cache protocol).

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
            ValueError: ``book`` draws from another pool than ``storage`` follows,
                ``layer`` is outside both the storage's and the book's layers, ``table``
                follows another book, or ``attention`` is not a mode the store serves.
        """
        if book.pool is not storage.pool:
            raise ValueError("book and storage must share one pool; got two different pools")
        if type(layer) is not int or not 0 <= layer < min(book.n_layers, storage.n_layers):
            raise ValueError(
                f"layer must be in 0..{min(book.n_layers, storage.n_layers) - 1} "
                f"(the book's and the storage's layers), got {layer!r}"
            )
        # The shared store: row `layer` of its slabs holds this layer's positions.
        self._storage: Final = storage
        # The request's block table and per-layer offsets, shared with its other layers.
        self._book: Final = book
        self._layer: Final = layer
        self._block_size: Final = book.block_size
        # Shape of one token slot, (n_kv_heads, head_dim): what every update must match.
        self._heads, self._head_dim = storage.slot_shape
        # The store's attention-layout gather if it has one: it saves a copy per step.
        self._gather_heads = storage.gather_heads if isinstance(storage, GathersHeadMajor) else None
        self._dtype: Final = storage.dtype
        if table is not None and table.book is not book:
            raise ValueError("table must follow the same book as the cache")
        # The store again, if it has the decode path through a block table; else None,
        # and each call hands the store the blocks (O(blocks) liveness checks).
        self._table_store: Final = storage if isinstance(storage, ServesBlockTables) else None
        # The book's ids on the device, checked live in O(1) per call (table path only).
        self._table: Final = (
            (table if table is not None else DeviceBlockTable(book))
            if self._table_store is not None
            else None
        )
        # Whether attend_in_place() answers (fused mode) or defers to the gathered path.
        self._fused: Final = resolve_attention(storage, attention) == "fused"

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
            ValueError: A shape is not ``(1, heads, n, head_dim)`` of the storage.
            TypeError: Keys or values are not of the storage's dtype (nothing is cast).
            RuntimeError: The cache was released.
            BlockPoolExhaustedError: The pool has too few free blocks; nothing changed.
        """
        n_tokens = self._require_update(keys, values)
        store, table = self._table_store, self._table
        if store is not None and table is not None:
            start = self._book.append(n_tokens, layer=self._layer) if n_tokens else self.offset
            try:
                return store.update_through_table(self._layer, table, start, keys, values)
            except BaseException:
                self._book.trim(n_tokens, layer=self._layer)
                raise
        if n_tokens:
            start = self._book.append(n_tokens, layer=self._layer)
            try:
                self._write(start, keys, values)
            except BaseException:
                self._book.trim(n_tokens, layer=self._layer)
                raise
        return self._fetch()

    def make_mask(
        self,
        N: int,  # noqa: N803 (mlx-lm's keyword)
        return_array: bool = False,
        window_size: int | None = None,
    ) -> MaskT:
        """The attention mask for ``N`` new queries, exactly as mlx-lm's ``KVCache`` makes it.

        ``None`` for one query, ``"causal"`` for several, a boolean ``(N, offset + N)``
        array when ``return_array`` or a ``window_size`` asks for one.
        """
        if window_size is None and not (return_array and N > 1):
            return None if N == 1 else "causal"
        return causal_mask(N, self.offset, window_size)

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
        keys, values = self._fetch()
        return keys, values, self.offset

    @state.setter
    def state(self, state: Sequence[object]) -> None:
        """Replace this layer's contents by ``(keys, values, offset)`` (or ``(keys,
        values)``), written into the request's blocks.

        Raises:
            TypeError, ValueError: Not such a tuple, or arrays of another shape or dtype
                than the storage's; nothing changes.
            BlockPoolExhaustedError: Too few free blocks; the layer is left empty.
        """
        keys, values, offset = split_state(state)
        if offset:
            keys, values = keys[..., :offset, :], values[..., :offset, :]
            self._require_update(keys, values)
        self._book.trim(self.offset, layer=self._layer)
        if offset:
            self.update_and_fetch(keys, values)

    @property
    def meta_state(self) -> tuple[str]:
        """The scalar part of the state, as strings: ``(str(offset),)``."""
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, meta_state: Sequence[str]) -> None:
        """Set the offset from ``(str(offset),)``: positions past it are dropped.

        Raises:
            ValueError: Not one decimal string, or an offset above the one held.
        """
        if len(meta_state) != 1 or not str(meta_state[0]).isdecimal():
            raise ValueError(f"meta_state must be (str(offset),), got {meta_state!r}")
        offset = int(meta_state[0])
        if offset > self.offset:
            raise ValueError(f"meta_state offset must be <= {self.offset} (held), got {offset}")
        self.trim(self.offset - offset)

    def is_trimmable(self) -> bool:
        """Whether ``trim`` may be called: until the request is released."""
        return self._book.is_trimmable()

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of this layer; whole blocks past every layer go back.

        Returns:
            Positions dropped: ``min(n, offset)``.
        """
        return self._book.trim(n, layer=self._layer)

    def size(self) -> int:
        """Positions held by this layer (mlx-lm's ``size()``)."""
        return self.offset

    def empty(self) -> bool:
        """Whether this layer holds no position."""
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's rows of the request's blocks (whole blocks, keys and values)."""
        slots = len(self._book.key_blocks) + len(self._book.value_blocks)
        return slots * self._block_size * self._heads * self._head_dim * self._storage.dtype.size

    @property
    def book(self) -> PooledKVCache:
        """The request's block table, shared by all its layers."""
        return self._book

    # -- mlx-lm protocol: quantization and loading -------------------------------------

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> NoReturn:
        """Refuse: mlx-lm calls this for ``generate_step(..., kv_bits=bits)``.

        mlx-lm's ``KVCache`` would turn into a ``QuantizedKVCache`` outside any
        pool; a pool-backed cache keeps its keys and values in the store, so it
        says so instead of silently staying unquantized.

        Raises:
            ValueError: Always, naming ``kv_bits`` and the store's dtype; nothing changes.
        """
        raise ValueError(
            f"kv_bits={bits} (kv_group_size={group_size}) cannot quantize a PoolBackedKVCache: "
            f"its keys and values stay in the pool's store as {dtype_name(self._storage.dtype)}; "
            "generate without kv_bits, or use mlx-lm's make_prompt_cache for a quantized cache"
        )

    @classmethod
    def from_state(cls, state: Sequence[object], meta_state: object = None) -> KVCache:
        """An mlx-lm ``KVCache`` holding ``state``: what ``load_prompt_cache`` builds for a
        saved pool-backed cache (a store is not saved; see
        :meth:`PoolBackedPromptCache.copy_from` to page it again).

        Raises:
            TypeError, ValueError: ``state`` is not ``(keys, values[, offset])``.
        """
        return kv_cache_from_state(state)

    # -- internals ---------------------------------------------------------------------

    def _require_update(self, keys: mx.array, values: mx.array) -> int:
        """The number of positions in ``keys`` and ``values``, if the storage can hold them."""
        expected = (1, self._heads, keys.shape[2] if keys.ndim == 4 else -1, self._head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(
                f"keys and values must both have shape (1, {self._heads}, n, {self._head_dim}) "
                f"(batch size 1), got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        dtype = self._storage.dtype
        if keys.dtype != dtype or values.dtype != dtype:
            raise TypeError(
                f"keys and values must have the store's dtype {dtype_name(dtype)}, got "
                f"{dtype_name(keys.dtype)} and {dtype_name(values.dtype)}; a cast would change "
                "the model's outputs, so size the store from the model "
                "(make_pool_backed_storage(model, pool))"
            )
        return int(expected[2])

    def _write(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Write positions ``start ..`` of ``keys`` and ``values`` block by block."""
        block_size, layer, write = self._block_size, self._layer, self._storage.write
        key_blocks, value_blocks = self._book.key_blocks, self._book.value_blocks
        # (n, heads, head_dim): the storage's slot layout.
        key_tokens = keys[0].transpose(1, 0, 2)
        value_tokens = values[0].transpose(1, 0, 2)
        n_tokens = key_tokens.shape[0]
        index, slot = divmod(start, block_size)
        if slot + n_tokens <= block_size:  # the decode step: one block, no slicing
            write(layer, key_blocks[index], slot, key_tokens)
            write(layer, value_blocks[index], slot, value_tokens)
            return
        done = 0
        while done < n_tokens:
            index, slot = divmod(start + done, block_size)
            upto = min(done + block_size - slot, n_tokens)
            write(layer, key_blocks[index], slot, key_tokens[done:upto])
            write(layer, value_blocks[index], slot, value_tokens[done:upto])
            done = upto

    def _fetch(self) -> tuple[mx.array, mx.array]:
        """Gather this layer's positions into ``(1, heads, offset, head_dim)`` arrays."""
        n_tokens = self.offset
        if self._table_store is not None and self._table is not None:
            return self._table_store.fetch_through_table(self._layer, self._table, n_tokens)
        n_blocks = -(-n_tokens // self._block_size)
        return (
            self._gather(self._book.key_blocks, n_blocks, n_tokens),
            self._gather(self._book.value_blocks, n_blocks, n_tokens),
        )

    def _gather(self, blocks: tuple[Block, ...], n_blocks: int, n_tokens: int) -> mx.array:
        if n_tokens == 0:
            return mx.zeros((1, self._heads, 0, self._head_dim), dtype=self._storage.dtype)
        if n_blocks < len(blocks):
            blocks = blocks[:n_blocks]
        if self._gather_heads is not None:
            return self._gather_heads(self._layer, blocks, n_tokens)[None]
        tokens = self._storage.gather(self._layer, blocks, n_tokens)
        # Attention reads (heads, tokens, head_dim); a strided view would make it slower.
        return mx.contiguous(tokens.transpose(1, 0, 2))[None]


register_for_loading(PoolBackedKVCache)


def __getattr__(name: str) -> object:
    if name in _IN_PROMPT_CACHE:
        return getattr(importlib.import_module("veloxquant_mlx.memory.prompt_cache"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
