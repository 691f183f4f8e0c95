"""A model's pool-backed caches for one request, and ``make_pool_backed_cache``.

:class:`PoolBackedPromptCache` is the list of per-layer
:class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` that mlx-lm's
generators take as ``prompt_cache``: all its layers share one block table
(:class:`~veloxquant_mlx.memory.pooled_kv_cache.PooledKVCache`) and one
device copy of it; it returns every block on ``release()`` or as a context
manager, and a dropped list still returns them (the book's finaliser);
``save`` writes it as a file that mlx-lm alone loads and ``load`` pages such
a file again. :func:`make_pool_backed_cache` builds one for a model, the way
mlx-lm's ``make_prompt_cache`` does, and in fused mode routes the model's
decode attention to the caches (:mod:`~veloxquant_mlx.memory.attention_hook`).

Complexity: construction O(layers); ``release`` O(blocks held); ``copy_from``,
``save`` and ``load`` O(positions copied). Thread safety: a list belongs to
one request, used from one thread at a time; the pool and the store lock
themselves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, NoReturn

import mlx.core as mx

from veloxquant_mlx.memory.attention_hook import install_paged_attention
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.cache_storage import AttentionMode, MLXStorage, resolve_attention
from veloxquant_mlx.memory.kv_cache import PoolBackedKVCache
from veloxquant_mlx.memory.mlx_lm_protocol import save_kv_caches, split_state
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.model_kv_layout import attention_layers
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.memory.storage import BlockStorage, CopiesBlocks

__all__ = ["PoolBackedPromptCache", "make_pool_backed_cache"]

#: Block format tags for the usual storage dtypes; others use the dtype's name.
_FORMAT_OF_DTYPE: Final = {mx.float16: "fp16", mx.bfloat16: "bf16", mx.float32: "fp32"}


def _table_check(table: DeviceBlockTable) -> Callable[[], None]:
    """What the book asks before a step the pool cannot undo (a checkout, a copy-on-write
    move; ``PooledKVCache.before_change``): that the table's blocks are live, so that the
    store's refusal of a stale one comes before the step, not after it.

    The table is held weakly: it holds the book, which holds this check, and a cycle
    would keep a dropped request's blocks until a garbage collection."""
    table_of = weakref.ref(table)

    def check() -> None:
        live_table = table_of()
        if live_table is not None:  # else no cache reads through it any more
            live_table.require_live()

    return check


class PoolBackedPromptCache(list[PoolBackedKVCache]):
    """A model's per-layer caches for one request, which returns its blocks on release.

    A plain list to mlx-lm (``generate_step(prompt_cache=...)``,
    ``trim_prompt_cache``); also a context manager. Dropped without
    ``release()``, its blocks still come back (module docstring). Save it with
    :meth:`save` rather than mlx-lm's ``save_prompt_cache``: that one records
    the class name ``PoolBackedKVCache``, which a process without this package
    cannot load.
    """

    def __init__(
        self, storage: MLXStorage, book: PooledKVCache, *, attention: AttentionMode = "gather"
    ) -> None:
        """One :class:`PoolBackedKVCache` per layer of ``book``, all over ``storage``, all
        sharing one :class:`DeviceBlockTable` and the ``attention`` mode."""
        table = DeviceBlockTable(book)
        super().__init__(
            PoolBackedKVCache(storage, book, layer, table=table, attention=attention)
            for layer in range(book.n_layers)
        )
        # The one block table every cache of the list appends to; release() frees it.
        self._book: Final = book
        # Kept for fork(): the twin reads and writes the same store the same way.
        self._storage: Final = storage
        self._attention: Final = attention
        if isinstance(storage, CopiesBlocks):  # copy-on-write copies every layer's slots
            book.copy_block = lambda old_id, own: storage.copy_block(None, old_id, own)
        # A lazy_writes store refuses a copy on another thread: asked before the move
        # (binding the store, whose data the copy then writes; a no-op without lazy_writes).
        # Set for every store, so a book that served a lazy one before drops its check.
        book.before_copy = (
            storage.require_this_thread if isinstance(storage, MLXBlockStorage) else None
        )
        book.before_change = _table_check(table)

    @property
    def book(self) -> PooledKVCache:
        """The request's block table."""
        return self._book

    def release(self) -> None:
        """Return every block of the request to the pool. Idempotent."""
        self._book.release()

    def fork(self, *, owner: int | None = None) -> PoolBackedPromptCache:
        """A second request sharing every block of this one (parallel sampling, beam search).

        Both lists decode on independently: the first write into a shared,
        partly filled block gives the writer a copy of it (``make_writable``,
        then the store's ``copy_block``); full blocks stay shared, so the
        common prefix is held once. Release each list on its own.

        Raises:
            TypeError: The store cannot copy blocks (``storage.CopiesBlocks``).
            RuntimeError: This list was released.
            OwnerAlreadyActiveError: ``owner`` is in use.
        """
        if not isinstance(self._storage, CopiesBlocks):
            raise TypeError(
                f"fork needs a store with copy_block, got {type(self._storage).__name__}"
            )
        return PoolBackedPromptCache(
            self._storage, self._book.fork(owner), attention=self._attention
        )

    def copy_from(self, caches: Sequence[object]) -> None:
        """Fill this empty list with the positions of ``caches``, one mlx-lm cache per layer.

        For instance the ``KVCache`` list that ``load_prompt_cache`` returns for a
        saved cache: decoding then goes on exactly as from ``caches``. Every layer's
        state is checked before any block is taken.

        Raises:
            ValueError: This list already holds positions, ``caches`` has another number
                of layers, or a state's shape is not the storage's; nothing changes.
            TypeError: A state is not ``(keys, values[, offset])`` of the storage's dtype;
                nothing changes.
            BlockPoolExhaustedError: Too few free blocks; the list is left empty.
        """
        if not self._book.empty():
            raise ValueError(
                f"copy_from fills an empty cache list; this one holds {self._book.offset} positions"
            )
        if len(caches) != len(self):
            raise ValueError(f"expected one cache per layer ({len(self)}), got {len(caches)}")
        states = [split_state(getattr(cache, "state", None)) for cache in caches]
        slices = [(keys[..., :end, :], values[..., :end, :]) for keys, values, end in states]
        for layer, (keys, values) in zip(self, slices, strict=True):
            if keys.size:
                layer._require_update(keys, values)
        try:
            for layer, (keys, values) in zip(self, slices, strict=True):
                if keys.size:
                    layer.update_and_fetch(keys, values)
        except BaseException:
            self._book.trim(self._book.offset)
            raise

    def save(self, file_name: str, metadata: dict[str, str] | None = None) -> None:
        """Save every layer's positions as mlx-lm ``KVCache`` layers (``.safetensors``).

        ``mlx_lm.models.cache.load_prompt_cache(file_name)`` loads the file in any
        process, this package imported or not, and decodes on exactly as this list
        would; :meth:`load` pages it into a pool again.

        Raises:
            ValueError: As mlx-lm's ``save_prompt_cache`` for the file or metadata.
        """
        save_kv_caches(file_name, [layer.state for layer in self], metadata)

    def load(self, file_name: str) -> dict[str, str]:
        """Fill this empty list from a file of ``KVCache`` layers (:meth:`save`'s, or any
        saved with mlx-lm's ``save_prompt_cache`` for the same model); return its metadata.

        Raises:
            As :meth:`copy_from`; nothing changes. And as mlx-lm's ``load_prompt_cache``
            for the file.
        """
        from mlx_lm.models.cache import load_prompt_cache  # noqa: PLC0415

        caches, metadata = load_prompt_cache(file_name, return_metadata=True)  # type: ignore[no-untyped-call]
        self.copy_from(caches)
        return dict(metadata)

    def __deepcopy__(self, memo: object) -> NoReturn:
        # mlx-lm's LRUPromptCache deep-copies prompt caches; say what to do instead of
        # failing deep inside the store (a lock cannot be copied) or the book.
        raise TypeError(
            "a pool-backed cache list cannot be deep-copied: its blocks belong to one "
            "request; build another with make_pool_backed_cache and copy_from(this list)"
        )

    def __enter__(self) -> PoolBackedPromptCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def make_pool_backed_cache(
    model: object,
    storage: MLXStorage,
    *,
    owner: int | None = None,
    format: str | None = None,
    attention: AttentionMode = "auto",
    reserve_tokens: int = 0,
) -> PoolBackedPromptCache:
    """Build ``model``'s caches for one request, paged in ``storage``'s pool.

    Like mlx-lm's ``make_prompt_cache``: one cache per layer of
    ``model.layers``; a model with ``make_cache()`` is accepted when every
    cache it makes is a plain ``KVCache`` (its full-attention layers).

    The caches cannot be quantized: ``generate_step(..., kv_bits=...)`` with
    them raises ``ValueError`` at the prompt's first chunk, before any block
    is taken, whatever ``quantized_kv_start`` says (quantized keys would
    leave the pool); so does any later ``to_quantized`` look-up.

    Args:
        model: An mlx-lm model.
        storage: The shared store; its pool lends the blocks.
        owner: Request id for the blocks; ``None`` picks an unused one.
        format: Format tag on the blocks; by default from the storage dtype
            (``"fp16"``, ``"bf16"``, ``"fp32"``).
        attention: How attention reads the positions (:func:`resolve_attention`). In
            fused mode the model's decode attention is routed to the caches
            (:func:`~veloxquant_mlx.memory.attention_hook.install_paged_attention`).
        reserve_tokens: Positions whose blocks the first growth checks out ahead
            (docs/RESERVATIONS.md), e.g. the prompt's length plus ``max_tokens``: a
            request growing beside others then keeps ids that run on, and is read by
            slices. ``0`` (the default): no reservation.

    Raises:
        TypeError: ``storage`` is not a block store, or ``reserve_tokens`` not an int.
        ValueError: The model has more layers than the storage, a layer needs
            a cache other than ``KVCache`` (sliding window, state space, ...), or
            ``attention`` is not a mode the storage serves, or ``reserve_tokens < 0``.
        OwnerAlreadyActiveError: ``owner`` is in use.
    """
    if not isinstance(storage, BlockStorage):
        raise TypeError(
            "storage must be a block store of the pool (make_pool_backed_storage(model, "
            f"pool), MLXBlockStorage...), got {type(storage).__name__}"
        )
    n_layers = attention_layers(model)
    if n_layers > storage.n_layers:
        raise ValueError(
            f"the model has {n_layers} layers but the storage only {storage.n_layers}; "
            "expected a storage with a slab per layer"
        )
    mode = resolve_attention(storage, attention)
    tag = format if format is not None else _FORMAT_OF_DTYPE.get(storage.dtype, str(storage.dtype))
    book = PooledKVCache(
        storage.pool, owner, n_layers=n_layers, format=tag, reserve_tokens=reserve_tokens
    )
    if mode == "fused":
        install_paged_attention(model)
    return PoolBackedPromptCache(storage, book, attention=mode)
