"""MLXBlockStorage: the MLX backing store of a block pool, one slab per layer.

Each layer's keys and values live in one ``mx.array`` slab, head-major:
``(1, n_kv_heads, capacity * block_size, head_dim)``, where row ``b *
block_size + s`` of every head is slot ``s`` of block ``b``, the layout of a
``KVCache`` buffer with rows in block order. So a decode write is a slice
update of one row, as ``KVCache``'s is, and any positions of any blocks come
out in the ``(1, heads, tokens, head_dim)`` layout attention reads from one
``mx.take`` of their blocks (of the slab seen as ``(n_kv_heads * capacity,
block_size, head_dim)``), with no transposing copy. Seen as
``(n_kv_heads, capacity, block_size, head_dim)`` (a free reshape) it is the
layout the fused paged-attention kernel reads. Because the head stride is
the capacity, a resize re-lays every slab out (it copies anyway).

Two ways in. The storage protocol's ``write`` / ``gather`` / ``gather_heads``
take ``Block`` handles and check each against the pool (a whole gather with
one ``all_live``). The decode path of a pool-backed cache
(``update_through_table``, ``fetch_through_table``, ``attend_through_table``)
takes a request's :class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`
instead, whose liveness check is O(1) while neither the request's blocks nor
the pool's free count moved, and the request's slot rows
(:class:`~veloxquant_mlx.memory.slot_rows.SlotRows`, rebuilt only when its
table or the capacity changes): one layer's decode step is then two slice
updates (the new key and value rows) and one read: two slices of the slab
where each stream's blocks hold consecutive ids
(:attr:`~veloxquant_mlx.memory.block_table.DeviceBlockTable.run_starts`),
else one gather of every held block, cut to the positions held and split
into keys and values, O(1) host work
whatever the context (from ``block_gather.KERNEL_MIN_TOKENS`` positions on,
on MLX's CUDA back-end, one gather kernel that cuts as it copies:
:mod:`~veloxquant_mlx.memory.block_gather`). Every write is a static slice
at host-integer rows, as ``KVCache``'s are: a ``slice_update`` at an ``mx.array`` start index
copied the whole slab at each write on MLX's CUDA back-end (H200, MLX
0.32.4: 445 against 95-127 us per one-row write to a 128 MiB slab), a cost
that grew with the pool.

MLX semantics this relies on (checked by the storage conformance suite and
the aliasing replay): arrays are values. An update (``slice_update``)
returns a new slab and never changes an array computed earlier,
even one still unevaluated; MLX donates the old slab's buffer to the update
only when nothing else refers to it, so a gather that is still pending, or
a view of the slab (a decode read by slices, evaluated or not), keeps its
own data. The price: while a gather is left unevaluated, or a view of the
slab is alive, the next write to its layer copies the whole slab (every
request's rows). Evaluate gathers and drop views (as a model step does: its
attention consumes what the decode path returned) before writing again, and
writes cost O(slots written). So only the decode path returns views;
``fetch_through_table`` (a cache's ``state``, which a caller may keep)
always returns copies.

Since MLX 0.31.2 streams are per thread: a lazy graph built on one thread
cannot be evaluated on another. So by default every write (``write``, the
decode path, ``copy_block``, a resize) evaluates the slab it produced and
*publishes* it before it returns: :func:`publish` marks it available on
the writing thread, under the store's lock, before any other thread can
see it. MLX marks an evaluated array available lazily, the first time a
thread looks at it, and two threads looking at once race: one detaches
the array's event while the other reads it, a segfault in
``Event::is_signaled`` (MLX 0.32.4; four threads decoding on one store
crashed twice in 250 seconds before this, never in 780 seconds since). A
published slab is only ever read. Any thread may then use the store.
``lazy_writes=True`` leaves writes lazy (no sync point and no evaluation per
write, what a decode loop wants) at the cost of thread affinity: such a
store belongs to the first thread that writes or reads data through it
(``write``, the gathers, the decode path, ``sync``), and such a call from any
other thread raises ``RuntimeError`` naming ``lazy_writes`` and both
threads, before it touches a slab, so the store stays usable from its own
thread. (Unchecked, such a call would leave a slab whose graph no thread can
evaluate, and every later call would fail.) A call that touches no data (a
cache's trim) asks ``refuse_other_thread``, which refuses as that does but
binds nothing. ``capacity()`` and
``resident_bytes()`` never bind the store and answer on any thread; on
another thread than a bound store's own they report without following the
pool (a resize evaluates the slabs, which only the owning thread can).

Written tokens must have the store's dtype: nothing is cast, because a
cast silently changes what a model computed (``TypeError`` otherwise).

Nothing here converts to NumPy or calls ``.item()``: ``write`` and the gathers
only build MLX graphs (and evaluate them as just said), so the module runs
unchanged on Metal or CUDA.

Complexity: ``update_through_table`` O(slots written) plus O(1) host work to
build the read (two slices, no device work, or a gather of O(tokens) device
work), ``fetch_through_table`` O(1) host work to build a gather (O(tokens)
device work), ``attend_through_table`` O(1) host, O(tokens) device; all three
O(blocks) device work once after the request's table or the capacity
changed, and O(blocks) host work once after a free anywhere in the pool;
``write`` O(slots written) (amortised, see above); ``gather_heads``
O(tokens gathered) plus one pool call (``all_live``) that checks the
O(blocks) handles under one lock; ``gather`` the same plus a lazy
transpose; ``sync`` O(1) unless it resizes, then O(capacity) per layer,
amortised O(1) per block grown; ``capacity``, ``resident_bytes`` O(layers).

Thread safety: one ``threading.Lock`` per store guards the slab list and
capacity; every public method holds it while it reads or replaces a slab
(and, by default, while it evaluates a write, see above). With
``lazy_writes`` only the owning thread may use the data (see above).
The pool's own lock is taken only through its public methods. A write that
races a ``free`` of the same handle on another thread is the caller's bug:
liveness is checked once, at the start of the write.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import mlx.core as mx

from veloxquant_mlx.memory import block_gather
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
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    cuda_unavailable_reason,
    paged_decode_attention,
)
from veloxquant_mlx.memory.slot_rows import SlotRows, StepRows

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = ["MLXBlockStorage", "dtype_name", "publish", "require_arrays"]


class MLXBlockStorage:
    """Per-layer MLX slabs of KV-cache token slots, indexed by block id.

    Implements :class:`veloxquant_mlx.memory.storage.BlockStorage` for
    ``mx.array``.

    Invariants (after every public call):

    - every slab has shape ``(1, n_kv_heads, capacity * block_size, head_dim)``
      (head-major; row ``b * block_size + s`` is slot ``s`` of block ``b``) and the
      store's dtype, and ``pool.id_bound() <= capacity`` as of the last sync;
    - ``capacity == next_capacity(capacity, id_bound)`` for the last ``id_bound``
      seen: it never exceeds twice the ids in use unless both are 0;
    - the rows of block ``i`` (every head) are written only through a live handle
      of ``pool`` with ``block_id == i``, or through a table whose handles were
      checked live: distinct ids never share storage;
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
        pool: CheckedBlockPool[Block],
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
                first thread that writes or reads data through it.

        Raises:
            TypeError: ``pool`` is not a ``BlockPoolAllocator``, a size not an int,
                ``dtype`` not an MLX dtype, or ``lazy_writes`` not a bool.
            ValueError: A size is below 1.
        """
        require_store_arguments(pool, n_layers, n_kv_heads, head_dim)
        if not isinstance(dtype, mx.Dtype):
            raise TypeError(f"dtype must be an mlx.core.Dtype, got {dtype!r}")
        if not isinstance(lazy_writes, bool):
            raise TypeError(f"lazy_writes must be a bool, got {lazy_writes!r}")
        self._pool: Final = pool
        self._block_size: Final = pool.config.block_size
        self._heads: Final = n_kv_heads
        self._head_dim: Final = head_dim
        self._slot_shape: Final = (n_kv_heads, head_dim)
        self._dtype: Final = dtype
        # Whether long reads may use the CUDA gather kernel (where it runs): rows fit it.
        self._kernel_gathers: Final = (
            block_gather.kernel_gather_unsupported_reason(head_dim, dtype) is None
        )
        self._lock: Final = threading.Lock()
        # Whether writes may stay unevaluated (then the store is thread-affine).
        self._lazy_writes: Final = lazy_writes
        # With lazy_writes, the ident of the thread that first used the data; None: unbound.
        self._owning_thread: threading.Thread | None = None
        # Block ids each slab covers; only _resize_locked changes it.
        self._capacity = pool.id_bound()
        # One slab per layer; replaced or updated in place (a new value) by writes.
        self._slabs: list[mx.array] = [self._zeros(self._capacity) for _ in range(n_layers)]
        publish(*self._slabs)

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
    def dtype(self) -> mx.Dtype:
        """Element type of every slab; written tokens must have it (nothing is cast)."""
        return self._dtype

    @property
    def lazy_writes(self) -> bool:
        """Whether writes stay lazy, so that one thread alone may use the data."""
        return self._lazy_writes

    def require_this_thread(self) -> None:
        """What every data call checks first: with ``lazy_writes``, bind the store to this
        thread if no thread has used its data yet, else refuse any other thread. A caller
        that changes the pool before its data call (a cache taking blocks) asks first.

        Raises:
            RuntimeError: A ``lazy_writes`` store that belongs to another thread.
        """
        # Once bound, the owner never changes: its own calls need no lock.
        if self._lazy_writes and self._owning_thread is not threading.current_thread():
            with self._lock:
                self._use_data_locked()

    def refuse_other_thread(self) -> None:
        """With ``lazy_writes``, refuse any thread but the store's own, binding none: what
        a call that touches no data checks (a trim, say), so that it never gives the store
        to a thread that may write nothing through it.

        Raises:
            RuntimeError: A ``lazy_writes`` store that belongs to another thread.
        """
        owner = self._owning_thread
        if self._lazy_writes and owner is not None and owner is not threading.current_thread():
            with self._lock:
                self._use_data_locked()  # names both threads

    # -- protocol: data ----------------------------------------------------------------

    def write(self, layer: int, block: Block, start: int, tokens: mx.array) -> None:
        """Store ``tokens`` (``(n, n_kv_heads, head_dim)``) in slots ``start .. start + n``.

        The slab is replaced by a ``slice_update`` of those rows, evaluated before
        returning unless the store has ``lazy_writes``; arrays gathered before keep
        their values.

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
        if not self._lazy_writes:
            mx.eval(tokens)  # this thread's own compute, outside the lock (publish, below)
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_writable(self._pool, block, "write to")
            self._use_data_locked()
            self._sync_locked()
            require_covered(block, self._capacity)
            if n_tokens == 0:
                return
            # (n, heads, dim) -> (1, heads, n, dim): rows first .. of every head.
            first = block.block_id * self._block_size + start
            slab = self._slabs[layer]
            # A static slice (see slot_rows.RowRun): the update is in place of the rows.
            slab[:, :, first : first + n_tokens] = tokens.transpose(1, 0, 2)[None]
            if not self._lazy_writes:
                # Only after the old slab is dropped from the list: MLX then donates its
                # buffer to the update (O(slots written)) unless a pending gather holds it.
                publish(self._slabs[layer])

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
            self._use_data_locked()
            self._sync_locked()
            require_covered(dst, self._capacity)
            size = self._block_size
            # Head-major slabs: block b is rows b * size .. of every head (static slices).
            first, source = dst.block_id * size, src * size
            for index in layers:
                slab = self._slabs[index]
                slab[:, :, first : first + size] = slab[:, :, source : source + size]
                self._slabs[index] = slab
            if not self._lazy_writes:
                publish(*(self._slabs[index] for index in layers))

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
        block_list = block_list_of(blocks)
        require_n_tokens(n_tokens, len(block_list) * self._block_size)
        heads, head_dim = self._slot_shape
        with self._lock:
            require_layer(layer, len(self._slabs))
            require_all_live(self._pool, block_list)
            self._use_data_locked()
            self._sync_locked()
            if block_list:
                require_covered(max(block_list, key=_block_id), self._capacity)
            ids = mx.array([block.block_id for block in block_list], dtype=mx.int32)
            first_rows = mx.arange(heads, dtype=mx.int32)[:, None] * self._capacity
            # (heads, blocks): block b of head h is row h * capacity + b of the slab seen
            # as (heads * capacity, block_size, head_dim).
            flat = self._slabs[layer].reshape(heads * self._capacity, self._block_size, head_dim)
            picked = mx.take(flat, first_rows + ids[None], axis=0)
        by_head = picked.reshape(heads, len(block_list) * self._block_size, head_dim)
        return by_head[:, :n_tokens]

    # -- the decode path: through a request's DeviceBlockTable ------------------------

    def update_through_table(
        self, layer: int, table: DeviceBlockTable, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Store keys and values at positions ``start ..`` of ``table``'s request, then
        return every position ``0 .. start + n - 1`` as :meth:`fetch_through_table` does.

        ``keys`` and ``values`` are ``(1, n_kv_heads, n, head_dim)``, as a model hands
        them to its cache: the decode step of one layer, in one call, as two slice
        updates (two per block for several positions) and one read of the request's
        blocks: two slices of the slab where each stream's ids run on (views: drop
        them before the next write, or it copies the slab), else one gather. Safety
        comes from
        ``table.require_live_this_step()`` (O(1), and one pool call per decode step),
        not from asking the pool about each block. No sync with ``lazy_writes``:
        the slab is left lazy; else it is evaluated and published (:func:`publish`)
        before the call returns, so any thread may use the store after.

        Raises:
            TypeError, ValueError: Tokens of another dtype or shape than the store's,
                positions outside the table's blocks, a layer out of range, a table
                of another pool, or one that is not a ``DeviceBlockTable``. Nothing
                changes.
            StaleBlockTableError: A block of the table was freed or moved behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        dtype = self._dtype
        if (
            type(keys) is not mx.array
            or type(values) is not mx.array
            or keys.dtype != dtype
            or values.dtype != dtype
            or keys.shape != values.shape
        ):  # one test on the decode path; _require_head_tokens sorts out the reason
            self._require_head_tokens(keys, values)
        shape = keys.shape
        if (
            len(shape) != 4
            or shape[0] != 1
            or shape[1] != self._heads
            or shape[3] != self._head_dim
        ):
            self._require_head_tokens(keys, values)
        return self._decode_through_table(layer, table, start, keys, values)

    def _decode_through_table(
        self, layer: int, table: DeviceBlockTable, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """:meth:`update_through_table` without its checks of ``keys`` and ``values``:
        the caller has made them (``mx.array`` s, both of shape ``(1, n_kv_heads, n,
        head_dim)`` in the store's dtype). Unchecked, a wrong shape would broadcast or
        write half, and a wrong dtype would be cast, so only
        :class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` calls it, which
        checks them before its book takes blocks; a decode step calls it once per
        layer, and on a GPU the host time of those calls decides the step (issue 9).

        Raises:
            As :meth:`update_through_table`, but for the checks of ``keys`` and ``values``.
        """
        n_new = keys.shape[2]
        if not self._lazy_writes:
            # This thread's forward pass up to here, outside the lock: under it, publishing
            # the slab then computes only the update.
            mx.eval(keys, values)
        with self._lock:  # keeping and reading the slab inlined: a call costs host time
            step = self._step_locked(layer, table, start, n_new)
            slab = _write_step(self._slabs[layer], step, keys, values)
            if n_new:
                # The list lets go of the old slab: MLX donates its buffer to the update
                # unless a pending gather or a live view still reads it.
                self._slabs[layer] = slab
                if not self._lazy_writes:
                    publish(slab)
            if step.run_rows is not None:
                return block_gather.read_by_slices(slab, step.run_rows, step.n_read)
            return self._copy_out(slab, step)

    def _decode_rows_through_tables(
        self, layer: int, rows: Sequence[tuple[DeviceBlockTable, int, mx.array, mx.array]]
    ) -> list[tuple[mx.array, mx.array]]:
        """:meth:`_decode_through_table` for several requests at once (a batched decode
        step, :mod:`~veloxquant_mlx.memory.batch_cache`): every row's ``(table, start,
        keys, values)`` is written before any row is read, so that no read holds a slab
        that a later row's write would then have to copy whole. The same unchecked
        entry: the caller has made the keys and values (``(1, n_kv_heads, n,
        head_dim)`` each, the store's dtype).

        Raises:
            As :meth:`_decode_through_table`; a refused row leaves every slab as it was.
        """
        if not self._lazy_writes:
            mx.eval(*(keys for _, _, keys, _ in rows), *(values for _, _, _, values in rows))
        with self._lock:
            steps: list[StepRows] = []
            capacity = -1
            while capacity != self._capacity:  # a row's table grew the slabs: all rows again
                capacity = self._capacity
                steps = [
                    self._step_locked(layer, table, start, keys.shape[2])
                    for table, start, keys, _ in rows
                ]
            slab = self._slabs[layer]
            for step, (_, _, keys, values) in zip(steps, rows, strict=True):
                slab = _write_step(slab, step, keys, values)
            self._slabs[layer] = slab  # as in _decode_through_table
            if not self._lazy_writes:
                publish(slab)
            return [self._read_step(slab, step) for step in steps]

    def fetch_through_table(
        self, layer: int, table: DeviceBlockTable, n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``0 .. n_tokens - 1`` of ``table``'s request.

        Returns lazy arrays, each ``(1, n_kv_heads, n_tokens, head_dim)`` (the layout
        attention reads), from one ``mx.take`` of the request's slot rows, which every
        layer of a step shares: copies, never views of the slab, whatever the ids (a
        kept view would make every later write to the layer copy the slab); never
        changed by later writes.

        Raises:
            ValueError: ``n_tokens`` beyond the table's slots, a layer out of range, or
                a table of another pool.
            TypeError: A table that is not a ``DeviceBlockTable``.
            StaleBlockTableError: A block of the table was freed or moved behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        with self._lock:
            rows = self._slot_rows_locked(layer, table, this_step=False)
            require_n_tokens(n_tokens, rows.n_slots)
            return self._copy_out(self._slabs[layer], rows.for_step(n_tokens, 0))

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
            TypeError: Queries that are not an ``mx.array`` of the store's dtype, or a
                table that is not a ``DeviceBlockTable``.
            StaleBlockTableError: A block of the table was freed or moved behind its back.
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        if not isinstance(queries, mx.array):
            raise TypeError(f"queries must be an mlx.core.array, got {type(queries).__name__}")
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
        require_token_dtype(queries.dtype, self._dtype, dtype_name, "queries")
        with self._lock:
            rows = self._slot_rows_locked(layer, table, this_step=True)
            require_n_tokens(n_tokens, rows.n_slots, least=1)  # a position to attend to
            slab = self._by_block(self._slabs[layer])
        paged = PagedKV(slab, table.key_ids, table.value_ids)
        return paged_decode_attention(queries, paged, n_tokens, scale=scale)

    # -- protocol: sizing --------------------------------------------------------------

    def capacity(self) -> int:
        """Number of block ids each slab covers (``>= pool.id_bound()`` after a sync;
        from another thread than a ``lazy_writes`` store's own: as of its last sync)."""
        with self._lock:
            if self._may_resize_here():
                self._sync_locked()
            return self._capacity

    def resident_bytes(self) -> int:
        """Bytes of slab memory held, across all layers (``nbytes`` summed), after a sync
        (from another thread than a ``lazy_writes`` store's own: as of its last sync)."""
        with self._lock:
            if self._may_resize_here():
                self._sync_locked()
            return sum(slab.nbytes for slab in self._slabs)

    def sync(self) -> None:
        """Follow the pool: resize every slab to ``next_capacity(capacity, pool.id_bound())``.

        Raises:
            RuntimeError: A ``lazy_writes`` store called from another thread.
        """
        with self._lock:
            self._use_data_locked()
            self._sync_locked()

    # -- internals ---------------------------------------------------------------------

    def _sync_locked(self) -> None:
        """Follow the pool's id range (the caller checked that it may resize here)."""
        target = next_capacity(self._capacity, self._pool.id_bound())
        if target != self._capacity:
            self._resize_locked(target)

    def _may_resize_here(self) -> bool:
        """Whether this thread may evaluate the slabs (always, unless another thread owns
        a lazy_writes store); checked by the calls that never bind a store."""
        owner = self._owning_thread
        return owner is None or owner is threading.current_thread()

    def _slot_rows_locked(
        self, layer: int, table: DeviceBlockTable, *, this_step: bool
    ) -> SlotRows:
        """What every table method does first, under the lock: check the layer, the
        thread and the table's liveness (O(1); with ``this_step``, one pool call per
        decode step), and find the request's slot rows, rebuilt (after a sync) when
        its table or the capacity moved.
        """
        if type(layer) is not int or not 0 <= layer < len(self._slabs):
            require_layer(layer, len(self._slabs))
        if self._lazy_writes and self._owning_thread is not threading.current_thread():
            _require_table(table)  # first: a refused call must not bind the store
            self._use_data_locked()  # binds the store, or refuses this thread
        if this_step and type(table) is DeviceBlockTable:
            # A later layer of a step already checked: its rows, with no check or lookup.
            rows = table.memo_this_step(self)
            if type(rows) is SlotRows and rows.capacity == self._capacity:
                return rows
        try:
            if this_step:
                table.require_live_this_step()
            else:
                table.require_live()
        except AttributeError:
            _require_table(table)  # a wrong argument is named; a table's own fault is not
            raise
        rows = table.memo(self)
        if type(rows) is not SlotRows or rows.capacity != self._capacity:
            # The table is new to this store, its ids changed, or another request's call
            # resized the slabs.
            rows = table.remember(self, self._new_slot_rows(table))
        return rows

    def _new_slot_rows(self, table: DeviceBlockTable) -> SlotRows:
        if table.pool is not self._pool:
            raise ValueError("the table's blocks come from another pool than this store's")
        self._sync_locked()  # the table's ids changed: cover them, follow a shrink
        return SlotRows(
            table,
            n_kv_heads=self._heads,
            capacity=self._capacity,
            block_size=self._block_size,
            schedule_rows=not self._lazy_writes,
        )

    def _step_locked(self, layer: int, table: DeviceBlockTable, start: int, n_new: int) -> StepRows:
        """Under the lock: the checks of a decode write (layer, thread, table, the range
        of positions) and its step's rows."""
        rows = self._slot_rows_locked(layer, table, this_step=True)
        if type(start) is not int:
            raise TypeError(f"start must be an int, got {start!r} ({type(start).__name__})")
        if start < 0 or start + n_new > rows.n_slots:
            raise ValueError(
                f"positions {start!r}..{start}+{n_new} fall outside the table's "
                f"{rows.n_slots} slots; expected 0 <= start and start + n <= {rows.n_slots}"
            )
        return rows.for_step(start, n_new)

    def _read_step(self, slab: mx.array, step: StepRows) -> tuple[mx.array, mx.array]:
        """A batched step's read of one row (``_decode_through_table`` inlines it): two
        slices where each stream's ids run on, else a copy."""
        if step.run_rows is not None:
            return block_gather.read_by_slices(slab, step.run_rows, step.n_read)
        return self._copy_out(slab, step)

    def _copy_out(self, slab: mx.array, step: StepRows) -> tuple[mx.array, mx.array]:
        """Keys and values of the step's positions, ``(1, heads, n_read, head_dim)`` each,
        copied out of the slab: one take of their blocks, cut to the positions held (at
        long contexts on a CUDA GPU, one gather kernel:
        :mod:`~veloxquant_mlx.memory.block_gather`)."""
        if (
            step.n_read >= block_gather.KERNEL_MIN_TOKENS
            and self._kernel_gathers
            and cuda_unavailable_reason() is None
        ):
            return block_gather.gather_by_kernel(
                slab, step.read_blocks, step.n_read, self._block_size
            )
        heads, head_dim = self._slot_shape
        return block_gather.gather_by_take(
            slab,
            step.read_blocks,
            step.n_read,
            n_kv_heads=heads,
            capacity=self._capacity,
            block_size=self._block_size,
            head_dim=head_dim,
        )

    def _require_head_tokens(self, keys: mx.array, values: mx.array) -> None:
        """Keys and values must both be ``(1, n_kv_heads, n, head_dim)`` arrays of the
        store's dtype (``TypeError`` or ``ValueError`` naming what is not)."""
        require_arrays(keys, values)
        dtype = self._dtype
        if keys.dtype != dtype or values.dtype != dtype:
            require_token_dtype(keys.dtype, dtype, dtype_name, "keys")
            require_token_dtype(values.dtype, dtype, dtype_name, "values")
        shape = keys.shape
        if (
            len(shape) != 4
            or shape != values.shape
            or shape[0] != 1
            or shape[1] != self._heads
            or shape[3] != self._head_dim
        ):
            raise ValueError(
                f"keys and values must both have shape (1, {self._heads}, n, "
                f"{self._head_dim}), got {tuple(shape)} and {tuple(values.shape)}"
            )

    def _use_data_locked(self) -> None:
        """Bind a lazy_writes store to its first data caller; refuse every other thread."""
        if not self._lazy_writes:
            return
        current = threading.current_thread()
        owner = self._owning_thread
        if owner is None:
            self._owning_thread = current
        elif owner is not current:
            raise RuntimeError(
                f"this MLXBlockStorage has lazy_writes=True, so it belongs to thread "
                f"{owner.name!r} (ident {owner.ident}), the first to write or read data "
                f"through it, but it was called from thread {current.name!r} (ident "
                f"{current.ident}); a lazy write leaves an MLX graph on its thread's stream "
                "that no other thread can evaluate, so share a store between threads with "
                "lazy_writes=False"
            )

    def _resize_locked(self, target: int) -> None:
        """Give every slab ``target`` blocks, keeping the first ``min(old, target)`` blocks."""
        old = self._capacity
        by_block = [self._by_block(slab) for slab in self._slabs]
        # Blocks sit on axis 1, so either way every head's rows move: the head stride
        # of the slab is the capacity.
        if target > old:
            extra = self._by_block(self._zeros(target - old))
            resized = [mx.concatenate([slab, extra], axis=1) for slab in by_block]
        else:
            # A real copy (take), not a slice: a slice would keep the whole old buffer alive.
            kept = mx.arange(target, dtype=mx.int32)
            resized = [mx.take(slab, kept, axis=1) for slab in by_block]
        self._slabs = [slab.reshape(1, self._heads, -1, self._head_dim) for slab in resized]
        self._capacity = target
        # Evaluate now so the old buffers are released at once, not at the next step.
        publish(*self._slabs)
        if target < old:
            mx.clear_cache()  # hand the freed buffers back to the system, not MLX's cache

    def _by_block(self, slab: mx.array) -> mx.array:
        """``slab`` seen as ``(n_kv_heads, capacity, block_size, head_dim)`` (no copy)."""
        capacity = slab.shape[2] // self._block_size
        return slab.reshape(self._heads, capacity, self._block_size, self._head_dim)

    def _zeros(self, n_blocks: int) -> mx.array:
        rows = n_blocks * self._block_size
        return mx.zeros((1, self._heads, rows, self._head_dim), dtype=self._dtype)


def _write_step(slab: mx.array, step: StepRows, keys: mx.array, values: mx.array) -> mx.array:
    """``slab`` with the step's new keys and values in their rows: one run of rows per
    block the positions touch (one for a decode step), each a static slice update (see
    :class:`~veloxquant_mlx.memory.slot_rows.RowRun`)."""
    n_new = keys.shape[2]
    for run in step.writes:
        if run.length == n_new:
            key_rows, value_rows = keys, values
        else:
            upto = run.first + run.length
            key_rows = keys[:, :, run.first : upto]
            value_rows = values[:, :, run.first : upto]
        slab[:, :, run.key_row : run.key_row + run.length] = key_rows
        slab[:, :, run.value_row : run.value_row + run.length] = value_rows
    return slab


def _require_table(table: object) -> None:
    """Refuse anything but a :class:`DeviceBlockTable` (or subclass) by name."""
    if not isinstance(table, DeviceBlockTable):
        raise TypeError(f"table must be a DeviceBlockTable, got {table!r} ({type(table).__name__})")


def publish(*arrays: mx.array) -> None:
    """Evaluate ``arrays`` and mark them available on this thread, so that threads
    that read them later only read (module docstring: MLX's lazy "available").

    The first ``mx.eval`` computes them; the second finds them computed and waits
    on each, which is what marks an array available. Call it before another
    thread can reach the arrays (here: under the store's lock, before it is
    released).
    """
    mx.eval(*arrays)
    mx.eval(*arrays)


def _block_id(block: Block) -> int:
    return block.block_id


def require_arrays(keys: object, values: object) -> None:
    """Keys and values written to a store must be ``mx.array``s (named, if not).

    Raises:
        TypeError: Either is not an ``mx.array``.
    """
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise TypeError(
            f"keys and values must be mlx.core.array, got {type(keys).__name__} and "
            f"{type(values).__name__}"
        )


def dtype_name(dtype: mx.Dtype) -> str:
    """``"bfloat16"`` for ``mx.bfloat16``: the name without the module path."""
    return str(dtype).rpartition(".")[2]
