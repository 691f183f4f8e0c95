"""MLXBlockStorage: the MLX backing store of a block pool, one slab per layer.

Each layer's keys or values live in one ``mx.array`` slab of shape
``(n_kv_heads, capacity, block_size, head_dim)``: head-major, so that head
``h`` of block ``b`` is row ``h * capacity + b`` of the slab seen as
``(n_kv_heads * capacity, block_size, head_dim)``. A paged
:meth:`~MLXBlockStorage.gather_heads` is then a single ``mx.take`` of those
rows that lands in ``(n_kv_heads, tokens, head_dim)``, the layout attention
reads, with no transposing copy (on CPU, at 4K tokens, measured about 2.5x
cheaper than a block-major take plus that copy); a write is a single
``mx.slice_update``.
Because the row stride is the capacity, a resize re-lays every slab out
(it copies anyway).
The store follows its pool through :meth:`MLXBlockStorage.sync`, which every
public method calls first (the rule is spelled out in the class docstring).

Two ways in. The storage protocol's ``write`` / ``gather`` / ``gather_heads``
take ``Block`` handles and check each against the pool (a whole gather with
one ``all_live``). The decode path of a pool-backed cache
(``update_through_table``, ``fetch_through_table``, ``attend_through_table``)
takes a request's :class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`
instead, whose liveness check is O(1) while neither the request's blocks nor
the pool's free count moved: a decode step then costs O(1) host work per
layer, not O(blocks). Its writes are static slices, as ``KVCache``'s are.

MLX semantics this relies on (checked by the storage conformance suite and
the aliasing replay): arrays are values. ``slice_update`` returns a new slab
and never changes an array computed earlier, even one still unevaluated;
MLX donates the old slab's buffer to the update only when nothing else
refers to it, so a gather that is still pending (or a view of the slab)
keeps its own data. The price: while a gather is left unevaluated, the next
write to its layer copies the slab once. Evaluate gathers (as a model step
does) before writing again and writes cost O(slots written).

Since MLX 0.31.2 streams are per thread: a lazy graph built on one thread
cannot be evaluated on another. So by default every ``write`` evaluates the
slab it produced before it returns, and the decode path's writes schedule
it (``mx.async_eval``: no sync point, but host work per write); any thread
may then use the store.
``lazy_writes=True`` leaves writes lazy (no sync point per write, which a
GPU decode loop may want) at the cost of thread affinity: such a store
belongs to the first thread that calls one of its methods, and a call from
any other thread raises ``RuntimeError`` naming ``lazy_writes`` and both
threads, before it touches a slab, so the store stays usable from its own
thread. (Unchecked, such a call would leave a slab whose graph no thread
can evaluate, and every later call would fail.)

Written tokens must have the store's dtype: nothing is cast, because a
cast silently changes what a model computed (``TypeError`` otherwise).

Nothing here converts to NumPy or calls ``.item()``: ``write`` and the gathers
only build MLX graphs (and evaluate them as just said), so the module runs
unchanged on Metal or CUDA.

Complexity: ``update_through_table`` O(slots written) plus O(1) host work
to build the gather (O(blocks) device work), ``fetch_through_table`` the
latter, ``attend_through_table`` O(1) host, O(tokens) device; all three
O(blocks) once after the request's table changed by a free;
``write`` O(slots written) (amortised, see above);
``gather_heads`` O(tokens gathered) plus one pool call (``all_live``) that
checks the O(blocks) handles under one lock; ``gather`` the same plus a
lazy transpose; ``sync`` O(1) unless it resizes, then O(capacity) per
layer, amortised O(1) per block grown; ``capacity``, ``resident_bytes``
O(layers).

Thread safety: one ``threading.Lock`` per store guards the slab list and
capacity; every public method holds it while it reads or replaces a slab
(and, by default, while it evaluates a write, see above). With
``lazy_writes`` only the owning thread may call (see above).
The pool's own lock is taken only through its public methods. A write that
races a ``free`` of the same handle on another thread is the caller's bug:
liveness is checked once, at the start of the write.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final

import mlx.core as mx

from veloxquant_mlx.memory._storage_checks import (
    copy_layers,
    next_capacity,
    require_all_live,
    require_covered,
    require_layer,
    require_n_tokens,
    require_slots,
    require_token_dtype,
    require_token_shape,
    require_writable,
)
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.memory.block_table import DeviceBlockTable, schedule
from veloxquant_mlx.memory.deferred_release import deferred_releases_for
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    gather_kv_heads,
    kv_slab_rows,
    paged_decode_attention,
)

__all__ = ["MLXBlockStorage"]


class MLXBlockStorage:
    """Per-layer MLX slabs of KV-cache token slots, indexed by block id.

    Implements :class:`veloxquant_mlx.memory.storage.BlockStorage` for
    ``mx.array``.

    Invariants (after every public call):

    - every slab has shape ``(n_kv_heads, capacity, block_size, head_dim)`` (head-major)
      and the store's dtype, and ``pool.id_bound() <= capacity`` as of the last sync;
    - ``capacity == next_capacity(capacity, id_bound)`` for the last ``id_bound``
      seen: it never exceeds twice the ids in use unless both are 0;
    - ``slab[:, i]`` (block ``i``, every head) is written only through a live handle
      of ``pool`` with ``block_id == i``: distinct ids never share storage;
    - ``_head_rows`` is ``[[0], [capacity], [2 * capacity], ...]``, one row per head:
      adding a block id gives that block's rows in the flattened slab;
    - growth keeps blocks ``0 .. old capacity - 1`` as they were; a shrink keeps
      blocks ``0 .. new capacity - 1``.

    Example::

        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
        store = MLXBlockStorage(pool, n_layers=32, n_kv_heads=8, head_dim=128)
        [block] = pool.allocate("k", 16, owner=1)
        store.write(0, block, 0, keys)                 # keys: (16, 8, 128)
        past = store.gather(0, [block], n_tokens=16)   # (16, 8, 128), lazy
        heads = store.gather_heads(0, [block], 16)     # (8, 16, 128), lazy
    """

    def __init__(
        self,
        pool: BlockPoolAllocator,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float16,
        *,
        lazy_writes: bool = False,
    ) -> None:
        """Allocate (and evaluate) slabs covering the pool's current ids.

        Args:
            pool: The pool to follow.
            n_layers: Slabs to keep, one per layer.
            n_kv_heads: Heads per token slot.
            head_dim: Values per head.
            dtype: Element type of the slabs.
            lazy_writes: Leave writes unevaluated; the store then serves only the
                first thread that calls it.

        Raises:
            TypeError: ``pool`` is not a ``BlockPoolAllocator``, a size not an int,
                or ``dtype`` not an MLX dtype.
            ValueError: A size is below 1.
        """
        if not isinstance(pool, BlockPoolAllocator):
            raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
        for name, value in (
            ("n_layers", n_layers),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            if type(value) is not int:
                raise TypeError(f"{name} must be an int >= 1, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value}")
        if not isinstance(dtype, mx.Dtype):
            raise TypeError(f"dtype must be an mlx.core.Dtype, got {dtype!r}")
        if not isinstance(lazy_writes, bool):
            raise TypeError(f"lazy_writes must be a bool, got {lazy_writes!r}")
        self._pool: Final = pool
        self._block_size: Final = pool.config.block_size
        self._slot_shape: Final = (n_kv_heads, head_dim)
        self._dtype: Final = dtype
        self._lock: Final = threading.Lock()
        # Owners of caches dropped on this pool, freed by every sync (deferred_release).
        self._releases: Final = deferred_releases_for(pool)
        # Whether write() may leave its slab unevaluated (then the store is thread-affine).
        self._lazy_writes: Final = lazy_writes
        # With lazy_writes, the thread that called first: the only one allowed after.
        self._owning_thread: threading.Thread | None = None
        # Block ids each slab covers; only _resize_locked changes it.
        self._capacity = pool.id_bound()
        # One slab per layer; replaced (never mutated) by write and resize.
        self._slabs: list[mx.array] = [self._zeros(self._capacity) for _ in range(n_layers)]
        # First row of each head in a flattened slab, (n_kv_heads, 1); follows the capacity.
        self._head_rows = self._first_rows(self._capacity)
        mx.eval(self._slabs, self._head_rows)

    # -- protocol: shape ---------------------------------------------------------------

    @property
    def pool(self) -> BlockPoolAllocator:
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
    def dtype(self) -> mx.Dtype:
        """Element type of every slab; written tokens must have it (nothing is cast)."""
        return self._dtype

    # -- protocol: data ----------------------------------------------------------------

    def write(self, layer: int, block: Block, start: int, tokens: mx.array) -> None:
        """Store ``tokens`` (``(n, n_kv_heads, head_dim)``) in slots ``start .. start + n``.

        The slab is replaced by a ``slice_update``, evaluated before returning
        unless the store has ``lazy_writes``; arrays gathered before keep their
        values.

        Raises:
            TypeError: ``block`` is not a ``Block``, ``tokens`` not an ``mx.array`` of
                the store's dtype, ``layer`` or ``start`` not an int.
            ValueError: ``block`` is not a live handle of the pool, the slots fall
                outside ``0 .. block_size``, ``layer`` is out of range, or ``tokens``
                has the wrong shape. Nothing changes.
            RuntimeError: A ``lazy_writes`` store called from another thread than its
                own. Nothing changes.
        """
        if not isinstance(tokens, mx.array):
            raise TypeError(f"tokens must be an mlx.core.array, got {type(tokens).__name__}")
        require_token_dtype(tokens.dtype, self._dtype, dtype_name)
        n_tokens = require_token_shape(tuple(tokens.shape), self._slot_shape)
        require_slots(start, n_tokens, self._block_size)
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_writable(self._pool, block, "write to")
            self._sync_locked()
            require_covered(block, self._capacity)
            if n_tokens == 0:
                return
            # (n, heads, dim) -> (heads, 1 block, n, dim): slots of every head of one block.
            update = tokens.transpose(1, 0, 2)[:, None]
            where = mx.array([block.block_id, start], dtype=mx.int32)
            self._slabs[layer] = mx.slice_update(self._slabs[layer], update, where, (1, 2))
            if not self._lazy_writes:
                # Only after the old slab is dropped from the list: MLX then donates its
                # buffer to the update (O(slots written)) unless a pending gather holds it.
                mx.eval(self._slabs[layer])

    def copy_block(self, layer: int | None, src: int, dst: Block) -> None:
        """Copy every slot of block id ``src`` into ``dst``, in ``layer`` or every layer.

        The copy-on-write step after ``pool.make_writable`` (storage.CopiesBlocks);
        evaluated before returning unless the store has ``lazy_writes``.

        Raises:
            TypeError, ValueError: As :class:`~veloxquant_mlx.memory.storage.CopiesBlocks`
                says; nothing changes.
        """
        with self._lock:
            layers = copy_layers(self._pool, layer, len(self._slabs), src)
            require_writable(self._pool, dst, "copy into")
            self._sync_locked()
            require_covered(dst, self._capacity)
            target = dst.block_id
            for index in layers:
                slab = self._slabs[index]
                slab[:, target : target + 1] = slab[:, src : src + 1]
                self._slabs[index] = slab
            if not self._lazy_writes:
                mx.eval(*(self._slabs[index] for index in layers))

    def gather(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer``, in order.

        Returns a lazy array of shape ``(n_tokens, n_kv_heads, head_dim)`` (a
        transposed view of :meth:`gather_heads`) that no later write, free,
        growth or shrink changes.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``Block``; ``n_tokens`` not an int.
            ValueError: A block is not a live handle of the pool, ``layer`` is out of
                range, or ``n_tokens`` is outside ``0 .. len(blocks) * block_size``.
        """
        return self.gather_heads(layer, blocks, n_tokens).transpose(1, 0, 2)

    def gather_heads(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer``, head-major: one ``mx.take``.

        Returns a lazy array of shape ``(n_kv_heads, n_tokens, head_dim)``, the
        layout attention reads, equal to ``gather(...).transpose(1, 0, 2)`` and
        never changed by later writes, frees, growth or shrink.

        Raises:
            TypeError: ``blocks`` is not a sequence of ``Block``; ``n_tokens`` not an int.
            ValueError: A block is not a live handle of the pool, ``layer`` is out of
                range, or ``n_tokens`` is outside ``0 .. len(blocks) * block_size``.
        """
        block_list = list(blocks)
        require_n_tokens(n_tokens, len(block_list) * self._block_size)
        heads, head_dim = self._slot_shape
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_all_live(self._pool, block_list)
            self._sync_locked()
            if block_list:
                require_covered(max(block_list, key=_block_id), self._capacity)
            ids = mx.array([block.block_id for block in block_list], dtype=mx.int32)
            rows = self._head_rows + ids[None]  # (heads, blocks): row h * capacity + b
            flat = self._slabs[layer].reshape(heads * self._capacity, self._block_size, head_dim)
            picked = mx.take(flat, rows, axis=0)  # (heads, blocks, block_size, head_dim)
        by_head = picked.reshape(heads, len(block_list) * self._block_size, head_dim)
        return by_head[:, :n_tokens]

    # -- the decode path: through a request's DeviceBlockTable ------------------------

    def update_through_table(
        self, layer: int, table: DeviceBlockTable, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Store keys and values at positions ``start ..`` of ``table``'s request, then
        return every position ``0 .. start + n - 1`` as :meth:`fetch_through_table` does.

        ``keys`` and ``values`` are ``(1, n_kv_heads, n, head_dim)``, as a model hands
        them to its cache: the decode step of one layer, in one call. Safety comes from
        ``table.require_live()`` (O(1) while nothing changed), not from asking the
        pool about each block. No sync: the slab is left lazy with ``lazy_writes``,
        else scheduled with ``mx.async_eval`` (any thread may use the store after).

        Raises:
            TypeError, ValueError: Tokens of another dtype or shape than the store's,
                positions outside the table's blocks, a layer out of range, or a
                table of another pool. Nothing changes.
            StaleBlockTableError: A block of the table was freed behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        n_tokens = self._require_head_tokens(keys, values)
        with self._lock:
            self._open_table_locked(layer, table)
            held = len(table.key_blocks) * self._block_size
            if type(start) is not int or start < 0 or start + n_tokens > held:
                raise ValueError(
                    f"positions {start!r}..{start}+{n_tokens} fall outside the table's "
                    f"{held} slots; expected 0 <= start and start + n <= {held}"
                )
            if n_tokens:
                self._write_locked(layer, table, start, keys, values)
            return self._fetch_locked(layer, table, start + n_tokens)

    def fetch_through_table(
        self, layer: int, table: DeviceBlockTable, n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``0 .. n_tokens - 1`` of ``table``'s request.

        Returns lazy arrays, each ``(1, n_kv_heads, n_tokens, head_dim)`` (the layout
        attention reads), from one ``mx.take`` whose row indices every layer of a step
        shares (``table.memo``); never changed by later writes.

        Raises:
            ValueError: ``n_tokens`` beyond the table's slots, a layer out of range, or
                a table of another pool.
            StaleBlockTableError: A block of the table was freed behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        with self._lock:
            self._open_table_locked(layer, table)
            require_n_tokens(n_tokens, len(table.key_blocks) * self._block_size)
            return self._fetch_locked(layer, table, n_tokens)

    def attend_through_table(
        self, layer: int, table: DeviceBlockTable, n_tokens: int, queries: mx.array, scale: float
    ) -> mx.array:
        """Decode attention of ``queries`` over positions ``0 .. n_tokens - 1``, read in
        place (:func:`~veloxquant_mlx.memory.paged_attention.paged_decode_attention`:
        the fused CUDA kernel where it runs, the gathered reference elsewhere).

        Args:
            queries: ``(1, n_q_heads, 1, head_dim)`` of the store's dtype.

        Raises:
            ValueError: ``n_tokens`` not in ``1 ..`` the table's slots, queries of
                another shape, a layer out of range, or a table of another pool.
            TypeError: Queries of another dtype than the store's.
            StaleBlockTableError: A block of the table was freed behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        heads, head_dim = self._slot_shape
        shape = tuple(queries.shape)
        if (
            len(shape) != 4
            or shape[0] != 1
            or shape[2] != 1
            or shape[3] != head_dim
            or (shape[1] % heads)
        ):
            raise ValueError(
                f"queries must have shape (1, k * {heads}, 1, {head_dim}), got {shape}"
            )
        require_token_dtype(queries.dtype, self._dtype, dtype_name)
        with self._lock:
            self._open_table_locked(layer, table)
            require_n_tokens(n_tokens, len(table.key_blocks) * self._block_size)
            if n_tokens == 0:
                raise ValueError("n_tokens must be >= 1: attention needs a position to attend to")
            slab = self._slabs[layer]
        paged = PagedKV(slab, table.key_ids, table.value_ids)
        return paged_decode_attention(queries, paged, n_tokens, scale=scale)

    # -- protocol: sizing --------------------------------------------------------------

    def capacity(self) -> int:
        """Number of block ids each slab covers after a sync (``>= pool.id_bound()``)."""
        with self._lock:
            self._sync_locked()
            return self._capacity

    def resident_bytes(self) -> int:
        """Bytes of slab memory held after a sync, across all layers (``nbytes`` summed)."""
        with self._lock:
            self._sync_locked()
            return sum(slab.nbytes for slab in self._slabs)

    def sync(self) -> None:
        """Follow the pool: resize every slab to ``next_capacity(capacity, pool.id_bound())``."""
        with self._lock:
            self._sync_locked()

    # -- internals ---------------------------------------------------------------------

    def _sync_locked(self) -> None:
        """What every public method does first under the lock: refuse a foreign thread
        (lazy_writes), return dropped caches' blocks, follow the pool's id range."""
        if self._lazy_writes:
            self._require_owning_thread()
        self._releases.drain()  # blocks of caches dropped without release() go back first
        target = next_capacity(self._capacity, self._pool.id_bound())
        if target != self._capacity:
            self._resize_locked(target)

    def _write_locked(
        self, layer: int, table: DeviceBlockTable, start: int, keys: mx.array, values: mx.array
    ) -> None:
        """Write positions ``start ..`` (checked) into the table's blocks, block by block.

        Static slices, as ``KVCache`` writes: no index array per write. The slab
        object is updated in place (``__setitem__``), which rebinds it to a new
        value; arrays computed from the old value keep it.
        """
        slab = self._slabs[layer]
        # (1, heads, n, dim) -> (heads, 1 block, n, dim): the slab's axes.
        key_heads, value_heads = keys.swapaxes(0, 1), values.swapaxes(0, 1)
        n_tokens, done = keys.shape[2], 0
        while done < n_tokens:
            index, slot = divmod(start + done, self._block_size)
            upto = min(done + self._block_size - slot, n_tokens)
            key_id = table.key_blocks[index].block_id
            value_id = table.value_blocks[index].block_id
            whole = upto - done == n_tokens
            slab[:, key_id : key_id + 1, slot : slot + upto - done] = (
                key_heads if whole else key_heads[:, :, done:upto]
            )
            slab[:, value_id : value_id + 1, slot : slot + upto - done] = (
                value_heads if whole else value_heads[:, :, done:upto]
            )
            done = upto
        if not self._lazy_writes:
            schedule(slab)

    def _fetch_locked(
        self, layer: int, table: DeviceBlockTable, n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        if n_tokens == 0:
            heads, head_dim = self._slot_shape
            empty = mx.zeros((1, heads, 0, head_dim), dtype=self._dtype)
            return empty, empty
        n_blocks = -(-n_tokens // self._block_size)
        capacity = self._capacity
        rows = table.memo(
            (id(self), capacity, n_blocks), lambda: self._kv_rows(table, n_blocks, capacity)
        )
        return gather_kv_heads(self._slabs[layer], rows, n_tokens)

    def _open_table_locked(self, layer: int, table: DeviceBlockTable) -> None:
        """What every table method does first, under the lock: O(1) while nothing moved."""
        require_layer(layer, len(self._slabs))
        if table.pool is not self._pool:
            raise ValueError("the table's blocks come from another pool than this store's")
        self._sync_locked()
        table.require_live()

    def _kv_rows(self, table: DeviceBlockTable, n_blocks: int, capacity: int) -> mx.array:
        """The slab rows of the table's first ``n_blocks`` (every layer of a step shares
        them through ``table.memo``); scheduled unless lazy_writes, as a write is."""
        rows = kv_slab_rows(table.key_ids, table.value_ids, n_blocks, self._slot_shape[0], capacity)
        if not self._lazy_writes:
            schedule(rows)
        return rows

    def _require_head_tokens(self, keys: mx.array, values: mx.array) -> int:
        """``n`` if keys and values are ``(1, n_kv_heads, n, head_dim)`` of the store's dtype."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError(
                f"keys and values must be mlx.core.array, got {type(keys).__name__} and "
                f"{type(values).__name__}"
            )
        require_token_dtype(keys.dtype, self._dtype, dtype_name)
        require_token_dtype(values.dtype, self._dtype, dtype_name)
        heads, head_dim = self._slot_shape
        shape = tuple(keys.shape)
        if (
            len(shape) != 4
            or shape != tuple(values.shape)
            or shape[:2] != (1, heads)
            or (shape[3] != head_dim)
        ):
            raise ValueError(
                f"keys and values must both have shape (1, {heads}, n, {head_dim}), got "
                f"{shape} and {tuple(values.shape)}"
            )
        return shape[2]

    def _require_owning_thread(self) -> None:
        """Bind a lazy_writes store to its first caller; refuse every other thread."""
        current = threading.current_thread()
        owner = self._owning_thread
        if owner is None:
            self._owning_thread = current
        elif owner is not current:
            raise RuntimeError(
                f"this MLXBlockStorage has lazy_writes=True, so it belongs to thread "
                f"{owner.name!r} (ident {owner.ident}), the first to call it, but it was "
                f"called from thread {current.name!r} (ident {current.ident}); a lazy write "
                "leaves an MLX graph on its thread's stream that no other thread can "
                "evaluate, so share a store between threads with lazy_writes=False"
            )

    def _resize_locked(self, target: int) -> None:
        """Give every slab ``target`` blocks, keeping the first ``min(old, target)`` blocks."""
        old = self._capacity
        # Blocks sit on axis 1, so either way every head's rows move: the row stride
        # of the flattened slab is the capacity.
        if target > old:
            extra = self._zeros(target - old)
            self._slabs = [mx.concatenate([slab, extra], axis=1) for slab in self._slabs]
        else:
            # A real copy (take), not a slice: a slice would keep the whole old buffer alive.
            kept = mx.arange(target, dtype=mx.int32)
            self._slabs = [mx.take(slab, kept, axis=1) for slab in self._slabs]
        self._capacity = target
        self._head_rows = self._first_rows(target)
        # Evaluate now so the old buffers are released at once, not at the next step.
        mx.eval(self._slabs, self._head_rows)
        if target < old:
            mx.clear_cache()  # hand the freed buffers back to the system, not MLX's cache

    def _zeros(self, n_blocks: int) -> mx.array:
        heads, head_dim = self._slot_shape
        return mx.zeros((heads, n_blocks, self._block_size, head_dim), dtype=self._dtype)

    def _first_rows(self, capacity: int) -> mx.array:
        """``[[0], [capacity], ...]``: row of block 0 of each head in a flattened slab."""
        return (mx.arange(self._slot_shape[0], dtype=mx.int32) * capacity)[:, None]


def _block_id(block: Block) -> int:
    return block.block_id


def dtype_name(dtype: mx.Dtype) -> str:
    """``"bfloat16"`` for ``mx.bfloat16``: the name without the module path."""
    return str(dtype).rpartition(".")[2]
