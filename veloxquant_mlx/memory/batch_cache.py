"""Batched decode over one pool: several requests' caches as one mlx-lm cache list.

A paged pool holds every request's keys and values in one store, so several
requests can go through one forward pass of the model: ``batch_caches(requests)``
returns, per layer, a :class:`PooledBatchLayer` over the requests' own
:class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` of that layer, and
``model(tokens, cache=batch)`` with ``tokens`` of shape ``(B, n)`` decodes all
``B`` rows at once, as mlx-lm's batched models call a ``BatchKVCache``. The
rules are docs/BATCHED_DECODE.md (``BATCH-...``).

Each row stays its request's: its positions are appended to its own book and
written to its own blocks, and the request can leave the batch and go on
alone (or join another batch) at any step, with no copy: a batch holds no
keys or values of its own. Rows may hold different numbers of positions; the
batch then reads them left-padded to the longest row, with a mask that hides
the padding (BATCH-MASK, BATCH-UPDATE). With the attention hook installed
(:func:`~veloxquant_mlx.memory.attention_hook.install_paged_attention`), the
batch computes attention itself, row by row over each row's own positions
(BATCH-ATTEND): the padded arrays are then never computed, and each row is read
as it would be alone.

Why one pass over a layer's slab: rows share it, and a read keeps the slab
version it read from alive; a later row's write to that slab would then copy
the whole slab (every request's rows). So the layer claims every row's
positions first, writes every row's keys and values, and only then reads
(``MLXBlockStorage._decode_rows_through_tables``); and it keeps the reads only
until attention has used them. Before the first layer claims anything, every
row's table is checked and the pool is asked once for every row's blocks
(BATCH-REFUSED), so a step it cannot supply changes nothing; layers are kept
in step (BATCH-LOCKSTEP), so the one mask mlx-lm makes fits every layer.

Complexity (``B`` rows, ``n`` new positions per row, ``T`` the longest row):
``update_and_fetch`` O(B) host work plus O(B * n) device work to write and,
only where the padded arrays are computed, O(B * T) to pad; ``offset`` and
``make_mask`` O(B) host work (``make_mask`` O(B * n * T) device work for an
array mask); ``attend_rows`` O(B) host work; the first layer's look before a
step O(B * layers) host work and O(B) pool calls (O(blocks) after a free
anywhere in the pool, as a request's own first layer). Thread safety: a batch
is used from one thread at a time, as its requests' caches are (with
``lazy_writes``, the store's own thread).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final, NoReturn

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import BlockPoolExhaustedError
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.deferred_release import deferred_releases_for
from veloxquant_mlx.memory.kv_cache import PoolBackedKVCache
from veloxquant_mlx.memory.mlx_lm_protocol import (
    causal_mask,
    kv_bits_of_generation,
    kv_bits_refusal,
)
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage, dtype_name, require_arrays
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.stream_supply import require_supply

__all__ = ["PooledBatchLayer", "batch_caches"]

#: A mask value no step made yet (``None`` is a mask: no mask).
_NO_MASK: Final = object()
#: What a batch's refusals call it.
_BATCH_CLASS: Final = "PooledBatchLayer"


class _BatchStep:
    """What the layers of one batch share within a step: the mask the first layer made
    (attention per row answers for that array, or ``None`` or ``"causal"``, never for
    another array: BATCH-ATTEND), and the one layer that holds its rows' reads until
    attention uses them (a read kept past its layer would make a later write to that
    layer's slab copy it whole)."""

    __slots__ = ("holder", "kv_bits_checked", "mask")

    def __init__(self) -> None:
        self.mask: object = _NO_MASK
        self.holder: PooledBatchLayer | None = None
        # Whether a step looked for the generator's kv_bits (then one-position steps need not).
        self.kv_bits_checked = False

    def hold(self, layer: PooledBatchLayer | None) -> None:
        """Let ``layer`` hold reads (``None``: no layer); the last holder drops its own."""
        if self.holder is not None and self.holder is not layer:
            self.holder._reads = []
        self.holder = layer


class PooledBatchLayer:
    """One layer of a batch of pool-backed requests (mlx-lm's cache protocol, batched).

    Invariants: ``rows`` are the requests' own caches of one layer index, in
    batch order, distinct, all over one ``MLXBlockStorage`` with the block-table
    path, the same requests as the batch's first layer's rows; the layer holds no
    keys or values, only the last update's per-row reads until :meth:`attend_rows`
    uses them, and the rows' offsets as an array.
    """

    def __init__(
        self,
        rows: Sequence[PoolBackedKVCache],
        store: MLXBlockStorage,
        step: _BatchStep,
        first_rows: tuple[PoolBackedKVCache, ...] | None,
    ) -> None:
        """Use :func:`batch_caches`, which checks the rows and their ``store``;
        ``first_rows`` are the batch's first layer's (``None``: this is it)."""
        self._rows: Final = tuple(rows)
        self._store: Final = store
        self._layer: Final = self._rows[0].layer
        self._tables: Final = tuple(_table_of(row) for row in self._rows)
        self._heads, self._head_dim = self._store.slot_shape
        self._dtype: Final = self._store.dtype
        # What the batch's layers share within a step: its mask and the reads' holder.
        self._step: Final = step
        # The rows' offsets as last asked, and as an array (RoPE asks twice per layer).
        self._offsets: tuple[int, ...] = ()
        self._offset_array = mx.array([], dtype=mx.int32)
        # The last update's reads, one (keys, values) per row, until attend_rows uses them
        # or the next layer's update (_BatchStep.hold).
        self._reads: list[tuple[mx.array, mx.array]] = []
        # The positions per row the last update wrote (attend_rows answers only for them).
        self._n_written = 0
        # The batch's first layer's rows: every other layer must hold what they hold.
        self._first_rows: Final = self._rows if first_rows is None else first_rows

    @property
    def rows(self) -> tuple[PoolBackedKVCache, ...]:
        """The requests' own caches of this layer, in batch order."""
        return self._rows

    @property
    def offset(self) -> mx.array:
        """Positions each row holds, ``(B,)`` int32: each row's rotary offset (BATCH-OFFSET)."""
        offsets = tuple(row.offset for row in self._rows)
        if offsets != self._offsets:
            self._offsets = offsets
            self._offset_array = mx.array(offsets, dtype=mx.int32)
        return self._offset_array

    def make_mask(
        self, n_new: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The attention mask of a step of ``n_new`` new positions per row (BATCH-MASK;
        mlx-lm passes it positionally), from the rows' lengths now, before the step.

        Raises:
            TypeError: ``n_new`` is not an int, or ``return_array`` not a bool.
            ValueError: ``n_new`` is below 1, or ``window_size`` is given (full
                attention only).
        """
        if type(n_new) is not int or type(return_array) is not bool:
            raise TypeError(
                f"n_new must be an int and return_array a bool, got {n_new!r} "
                f"({type(n_new).__name__}) and {return_array!r}"
            )
        if n_new < 1:
            raise ValueError(f"n_new must be an int >= 1 (new positions per row), got {n_new}")
        if window_size is not None:
            raise ValueError(
                f"window_size must be None: a pooled batch serves full attention only, "
                f"got {window_size!r}"
            )
        lengths = [row.offset for row in self._rows]
        longest = max(lengths)
        mask: mx.array | str | None
        if min(lengths) == longest and not return_array:
            mask = None if n_new == 1 else "causal"
        else:
            padding = mx.array([longest - length for length in lengths], dtype=mx.int32)
            mask = _causal_mask(n_new, longest, padding)
        self._step.mask = mask
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append each row's ``n`` keys and values to its request; return every row's
        positions, left-padded to the longest (BATCH-UPDATE, BATCH-REFUSED).

        Args:
            keys, values: ``(B, n_kv_heads, n, head_dim)`` of the store's dtype; row
                ``b`` belongs to ``rows[b]``.

        Returns:
            Keys and values, each ``(B, n_kv_heads, T, head_dim)`` with ``T`` the
            longest row's positions after the append; row ``b``'s positions are its
            last ``offset`` entries, zeros before them (lazy: computed only if read).

        Raises:
            TypeError, ValueError: Keys or values of another type, dtype or shape, or
                rows that hold other positions at this layer than at the batch's first
                (BATCH-LOCKSTEP); nothing changes.
            BlockPoolExhaustedError: The pool cannot supply every row's blocks at once
                (asked before any row changes); nothing changes.
            StaleBlockTableError, RuntimeError: As a row's own ``update_and_fetch``;
                the rows appended before it are trimmed back.
        """
        n_new = self._require_batch(keys, values)
        self._reads = []  # this layer's last reads must not outlive its step
        if self._first_rows is self._rows:
            _require_step_supplied(self._store, self._rows, self._tables, self._step, n_new)
        else:
            self._store.require_this_thread()
            self._require_lockstep(n_new)
        starts = _append_all(self._rows, n_new)
        try:
            rows = list(zip(self._tables, starts, _split(keys), _split(values), strict=True))
            reads = self._store._decode_rows_through_tables(self._layer, rows)
        except BaseException:
            _trim_back(self._rows, n_new)
            raise
        self._reads, self._n_written = reads, n_new
        self._step.hold(self)
        return _left_padded([read[0] for read in reads]), _left_padded([r[1] for r in reads])

    def attend_rows(self, queries: mx.array, scale: float, mask: object) -> mx.array | None:
        """Attention of ``queries`` (``(B, n_q_heads, n, head_dim)``) computed row by row
        over each row's own positions, with no padding (BATCH-ATTEND); the last
        update's reads are used once.

        Returns ``None`` (the caller then reads the padded arrays with ``mask``) unless
        the last update of this layer wrote ``n`` positions per row and nothing has
        used its reads yet, the queries have ``B`` rows and the store's dtype, and
        ``mask`` is ``None``, ``"causal"`` or the array the batch made for this step.
        The new positions attend causally among themselves, except under ``None``:
        then each sees all of them, as with no mask.
        """
        reads, self._reads = self._reads, []
        if self._step.holder is self:
            self._step.holder = None
        shape = queries.shape
        if (
            not reads
            or len(shape) != 4
            or shape[0] != len(reads)
            or shape[2] != self._n_written
            or queries.dtype != self._dtype
            or not (mask is None or mask == "causal" or mask is self._step.mask)
        ):
            return None
        # Causal among the new positions, as the batch's mask and "causal" ask; no mask
        # asks for none, as scaled_dot_product_attention reads it (one position: the same).
        row_mask = "causal" if self._n_written > 1 and mask is not None else None
        return mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    row_queries, keys, values, scale=scale, mask=row_mask
                )
                for row_queries, (keys, values) in zip(_split(queries), reads, strict=True)
            ]
        )

    @property
    def to_quantized(self) -> Callable[..., NoReturn]:
        """Refused as soon as it is looked up, as a request's own cache refuses it:
        mlx-lm's generator probes it after every forward pass when it asks for
        ``kv_bits``. So a batch whose earlier steps ran outside a generator, and
        which therefore does not look for ``kv_bits`` again at a one-position step,
        is refused there, after that step's positions were stored (BATCH-REFUSED).

        Raises:
            ValueError: Always, naming ``kv_bits`` and the store's dtype; the look-up
                changes nothing.
        """
        raise kv_bits_refusal(kv_bits_of_generation(), dtype_name(self._dtype), _BATCH_CLASS)

    def _require_lockstep(self, n_new: int) -> None:
        """BATCH-LOCKSTEP at a later layer: the first layer has appended this step's
        ``n_new`` positions to every row, and this one has not (the first layer found
        every row's layers in step, so this holds unless layers are called out of order)."""
        for index, (row, first) in enumerate(zip(self._rows, self._first_rows, strict=True)):
            if row.offset + n_new != first.offset:
                raise ValueError(
                    f"layer {self._layer} of the batch was called with row {index} holding "
                    f"{row.offset} positions there and {first.offset} at the first layer; "
                    f"expected {first.offset - n_new}: call the batch's layers in order in "
                    "each step, the first one first, as a model does"
                )

    def _require_batch(self, keys: mx.array, values: mx.array) -> int:
        """``n`` if keys and values are ``(B, n_kv_heads, n, head_dim)`` of the store's dtype."""
        require_arrays(keys, values)
        if keys.dtype != self._dtype or values.dtype != self._dtype:
            raise TypeError(
                f"keys and values must have the store's dtype {dtype_name(self._dtype)}, got "
                f"{dtype_name(keys.dtype)} and {dtype_name(values.dtype)}; nothing is cast"
            )
        shape, batch = keys.shape, len(self._rows)
        if (
            len(shape) != 4
            or shape != values.shape
            or shape[0] != batch
            or shape[1] != self._heads
            or shape[3] != self._head_dim
        ):
            raise ValueError(
                f"keys and values must both have shape ({batch}, {self._heads}, n, "
                f"{self._head_dim}) (one row per request of the batch), got {tuple(shape)} "
                f"and {tuple(values.shape)}"
            )
        return int(shape[2])


def batch_caches(requests: Sequence[PoolBackedPromptCache]) -> list[PooledBatchLayer]:
    """One :class:`PooledBatchLayer` per layer over ``requests``, in order (BATCH-ARG):
    the cache list a batched forward pass takes (``model(tokens, cache=batch)``).

    Raises:
        TypeError: ``requests`` is not a sequence of ``PoolBackedPromptCache``.
        ValueError: No request, one listed twice (or two over one book), a released
            one, requests over different stores or with different numbers of layers, or
            a store other than an ``MLXBlockStorage``. Nothing changes.
    """
    listed = _require_requests(requests)
    first = listed[0]
    store = _mlx_store_of(first[0], "requests[0]")
    for index, request in enumerate(listed):
        if len(request) != len(first):
            raise ValueError(
                f"requests[{index}] has {len(request)} layers, requests[0] {len(first)}; "
                "a batch's requests must come from one model"
            )
        if request.book.released:
            raise ValueError(f"requests[{index}] was released; a batch needs live requests")
        if request[0].storage is not store:
            raise ValueError(
                f"requests[{index}] lives in another store than requests[0] (a "
                f"{type(request[0].storage).__name__}); a batch's requests must share one "
                "MLXBlockStorage"
            )
    step = _BatchStep()
    layers = [PooledBatchLayer([request[0] for request in listed], store, step, None)]
    layers += [
        PooledBatchLayer([request[layer] for request in listed], store, step, layers[0].rows)
        for layer in range(1, len(first))
    ]
    return layers


def _require_requests(requests: object) -> list[PoolBackedPromptCache]:
    if not isinstance(requests, Sequence) or isinstance(requests, str | bytes):
        raise TypeError(
            f"requests must be a sequence of PoolBackedPromptCache, got {type(requests).__name__}"
        )
    listed = list(requests)
    if not listed:
        raise ValueError("requests must hold at least one PoolBackedPromptCache, got none")
    # id() of each request's book: its first index. The book, not the list: a copy of a
    # request, or a second PoolBackedPromptCache over its book, is the same request.
    seen: dict[int, int] = {}
    for index, request in enumerate(listed):
        if not isinstance(request, PoolBackedPromptCache):
            raise TypeError(
                f"requests[{index}] must be a PoolBackedPromptCache, got {type(request).__name__}"
            )
        earlier = seen.setdefault(id(request.book), index)
        if earlier != index:
            raise ValueError(
                f"requests[{index}] is requests[{earlier}] again (the same book); a request "
                "is one row"
            )
    return listed


def _split(batch: mx.array) -> list[mx.array]:
    """``batch`` (``(B, ...)``) as ``B`` arrays ``(1, ...)``, in one MLX call."""
    return list(mx.split(batch, batch.shape[0])) if batch.shape[0] > 1 else [batch]


def _table_of(cache: PoolBackedKVCache) -> DeviceBlockTable:
    table = cache.table
    if table is None:  # batch_caches checked the store: it serves block tables
        raise ValueError("a pooled batch needs caches with the block-table path")
    return table


def _mlx_store_of(cache: PoolBackedKVCache, name: str) -> MLXBlockStorage:
    store = cache.storage
    if not isinstance(store, MLXBlockStorage) or cache.table is None:
        raise ValueError(
            f"{name} lives in a {type(store).__name__}; a pooled batch needs an "
            "MLXBlockStorage (its block-table decode path)"
        )
    return store


def _append_all(rows: tuple[PoolBackedKVCache, ...], n_new: int) -> list[int]:
    """Append ``n_new`` positions to each row's book at its layer, in order; if one is
    refused, the rows before it are trimmed back (every one, even if another's trim
    fails) and the refusal goes up. The checks a request's own update makes first were
    made for the whole batch (``_require_step_supplied``)."""
    starts: list[int] = []
    try:
        for row in rows:
            starts.append(row.book.append(n_new, layer=row.layer))
    except BaseException:
        _trim_back(rows[: len(starts)], n_new)
        raise
    return starts


def _trim_back(rows: Sequence[PoolBackedKVCache], n_new: int) -> None:
    """Undo ``n_new`` claimed positions of every row, newest row first, going on past a
    trim that fails: the caller re-raises its own error, which says what went wrong."""
    for row in reversed(rows):
        try:
            row.book.trim(n_new, layer=row.layer)
        except Exception:  # the step's own error, re-raised by the caller, says what went wrong
            continue


def _require_step_supplied(
    store: MLXBlockStorage,
    rows: tuple[PoolBackedKVCache, ...],
    tables: tuple[DeviceBlockTable, ...],
    step: _BatchStep,
    n_new: int,
) -> None:
    """Before the batch's first layer claims anything, what any row's append would
    refuse (BATCH-REFUSED, BATCH-LOCKSTEP), in the order a request alone meets it: the
    store's thread, every row's layers in step, ``kv_bits``, every row's table live (a
    stale block is named), then each row's own look (``append_moves``), and last
    whether the pool can supply every row's copies and growth at once, after the
    dropped caches' blocks came back."""
    store.require_this_thread()
    for index, row in enumerate(rows):
        if not row.book.layers_in_step():
            offsets = [row.book.layer_offset(layer) for layer in range(row.book.n_layers)]
            raise ValueError(
                f"row {index} holds {offsets} positions at its layers; a batch needs every "
                "layer of a row to hold the same positions (trim every layer alike, as "
                "mlx-lm's trim_prompt_cache does)"
            )
    if n_new != 1 or not step.kv_bits_checked:  # a prompt chunk, or the first step
        bits = kv_bits_of_generation()
        if bits is not None:
            raise kv_bits_refusal(bits, dtype_name(store.dtype), _BATCH_CLASS)
        step.kv_bits_checked = True
    for table in tables:
        table.require_live()
    releases = deferred_releases_for(rows[0].book.pool)
    releases.check_out_reclaiming(lambda: _require_supply_of(rows, n_new))


def _require_supply_of(rows: tuple[PoolBackedKVCache, ...], n_new: int) -> None:
    """Refuse unless the pool can supply, per stream, every row's growth and a copy of
    each shared block a row moves; a block that ``k`` rows move and ``r`` handles hold
    is copied ``min(k, r - 1)`` times (its last holder keeps it)."""
    moves = [row.book.append_moves(n_new, row.layer) for row in rows]
    growth = sum(grown for _, _, grown in moves)
    if not growth and not any(keys or values for keys, values, _ in moves):
        return  # most decode steps: every row stays in its last block, which it owns
    moved = {
        "k": Counter(block_id for keys, _, _ in moves for block_id in keys),
        "v": Counter(block_id for _, values, _ in moves for block_id in values),
    }
    book = rows[0].book
    pool = book.pool
    demand = {
        stream: growth + sum(min(n, pool.ref_count(i) - 1) for i, n in counts.items())
        for stream, counts in moved.items()
    }
    if not (demand["k"] or demand["v"]):
        return
    try:
        require_supply(pool, demand, book.owner, book.format, pool.free)
    except BlockPoolExhaustedError as refusal:
        owners = ", ".join(str(row.book.owner) for row in rows)
        raise BlockPoolExhaustedError(
            f"a batched step of {len(rows)} requests (owners {owners}) is refused: {refusal}"
        ) from None


def _causal_mask(n_new: int, longest_before: int, padding: mx.array) -> mx.array:
    """``(B, 1, n_new, longest_before + n_new)``: query ``i`` of row ``b`` sees key ``j``
    iff ``padding[b] <= j <= longest_before + i``."""
    keys = mx.arange(longest_before + n_new)
    return causal_mask(n_new, longest_before) & (padding[:, None, None, None] <= keys)


def _left_padded(arrays: list[mx.array]) -> mx.array:
    """``arrays`` (each ``(1, heads, t, dim)``) as one ``(B, heads, T, dim)``, each padded
    with zeros in front to the longest ``T``."""
    longest = max(array.shape[2] for array in arrays)
    padded = [
        array
        if array.shape[2] == longest
        else mx.pad(array, [(0, 0), (0, 0), (longest - array.shape[2], 0), (0, 0)])
        for array in arrays
    ]
    return padded[0] if len(padded) == 1 else mx.concatenate(padded)
