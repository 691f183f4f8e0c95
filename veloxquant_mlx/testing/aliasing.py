"""Aliasing replay: apply a trace to a pool and its store, checking the data after every op.

The replay engine (:class:`AliasingReplay`) is the referee for backing
stores. It applies a :mod:`trace <veloxquant_mlx.testing.traces>` op by op to
a fresh pool and a store built by a :class:`StorageBackend`, writes a
distinct sentinel into every slot of every block it allocates (and into
every slot a ``write`` op names), keeps a NumPy shadow of what each live
block must hold, and after every single op checks that:

1. the pool's books are consistent and every live handle is live in the pool
   (and every handle the op freed is not); no two live handles share an id;
2. every live block's contents, read back with ``gather``, equal the shadow:
   a write through one id that shows up in another means two ids share storage;
3. every array an earlier ``read`` returned still holds the values it had when
   it was taken, including reads left unevaluated (``hold``) until after later
   writes: a lazy graph or a donated buffer must not leak a later write in;
4. the store follows the pool: ``id_bound <= capacity`` and ``capacity <
   headroom * id_bound`` unless they are equal, so the retired tail of the id
   range holds nothing beyond that headroom; ``resident_bytes`` is
   proportional to capacity, so it falls when a shrink retires the tail.

The first op that breaks any of these raises :class:`ReplayError` naming
the op's index in the trace, the op, and what broke. Every op may record the
outcome it must have (``expect``, ``block_ids``, ``retired``); the replay
checks those too, so a history recorded from a concurrent run replays as a
linearizability check.

Command line: ``python -m veloxquant_mlx.testing.aliasing TRACE.jsonl
[--backend mlx|numpy]`` (:mod:`~veloxquant_mlx.testing.replay_command`: it
refuses bad input first, and gives a partial trace the verdict
inconclusive), or :func:`replay_file` from code.

Complexity: per op O(live blocks x layers x block slots) for the content
check, plus O(held reads) and the pool's O(n) invariant check; this is a test
tool. Thread safety: an engine is used from one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolError,
    InvariantViolationError,
    PoolConfig,
)
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.testing.traces import (
    Allocate,
    Free,
    FreeAll,
    HandleRef,
    MarkUsed,
    Op,
    Read,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
    StoreSpec,
    Sync,
    Trace,
    Write,
    encode_op,
    load,
    outcome_name,
)

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "TOKEN_DTYPES",
    "AliasingReplay",
    "ReplayError",
    "StorageBackend",
    "builtin_backend",
    "main",
    "mlx_backend",
    "numpy_backend",
    "replay",
    "replay_file",
]

ArrayT = TypeVar("ArrayT")
Values = npt.NDArray[np.float32]

#: Sentinels count modulo this per dtype, so that every value is exact in it.
_SENTINEL_MODULUS: Final = {
    "float16": 2**11,
    "bfloat16": 2**8,
    "int8": 2**7,
    "uint8": 2**8,
    "int16": 2**15,
}
_DEFAULT_MODULUS: Final = 2**24
#: Dtypes a replayed store may have: numbers in which every sentinel is exact.
TOKEN_DTYPES: Final = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)


@dataclass(frozen=True)
class StorageBackend(Generic[ArrayT]):
    """What the replay and the conformance suite need to drive one kind of store.

    Attributes:
        name: Shown in messages (``"mlx"``, ``"numpy"``, ``"my-cuda-store"``).
        make_storage: Builds the store under test for a pool and a store shape.
        from_numpy: Turns float32 token values into the store's array type.
        to_numpy: Evaluates an array of the store's type and returns it as float32.
        headroom: The store's capacity stays below ``headroom * pool.id_bound()``
            (unless equal to it): the most its growth rule over-allocates.
        cast: Converts an array made by ``from_numpy`` to a ``StoreSpec.dtype`` name;
            stores refuse tokens of another dtype than theirs. ``None`` for a backend
            whose stores only hold float32.
        dtype_size: Bytes per value of a dtype name; raises ``ValueError`` for a
            name this backend cannot store. ``None``: the backend does not say
            (a command then cannot refuse a trace's store up front).
    """

    name: str
    make_storage: Callable[[BlockPoolAllocator, StoreSpec], BlockStorage[ArrayT]]
    from_numpy: Callable[[Values], ArrayT]
    to_numpy: Callable[[ArrayT], Values]
    headroom: int = 2
    cast: Callable[[ArrayT, str], ArrayT] | None = None
    dtype_size: Callable[[str], int] | None = None

    def tokens(self, values: Values, dtype: str) -> ArrayT:
        """``values`` as the store's array type in ``dtype``: what a write must be given."""
        array = self.from_numpy(values)
        return array if self.cast is None else self.cast(array, dtype)


def _unknown_dtype(backend: str, name: str) -> ValueError:
    known = [dtype for dtype in TOKEN_DTYPES if not (backend == "numpy" and dtype == "bfloat16")]
    return ValueError(f"store dtype must be one of {known} for the {backend} backend, got {name!r}")


def numpy_backend() -> StorageBackend[npt.NDArray[np.generic]]:
    """The backend of :class:`~veloxquant_mlx.memory.numpy_storage.NumpyBlockStorage`."""
    from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage  # noqa: PLC0415

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> NumpyBlockStorage:
        return NumpyBlockStorage(
            pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, np.dtype(spec.dtype)
        )

    def dtype_size(name: str) -> int:
        if name not in TOKEN_DTYPES or name == "bfloat16":  # NumPy has no bfloat16
            raise _unknown_dtype("numpy", name)
        return np.dtype(name).itemsize

    return StorageBackend(
        "numpy",
        make,
        lambda values: values,
        lambda array: np.array(array, dtype=np.float32),
        cast=lambda array, dtype: array.astype(np.dtype(dtype)),
        dtype_size=dtype_size,
    )


def mlx_backend(*, lazy_writes: bool = False) -> StorageBackend[mx.array]:
    """The backend of :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`.

    ``lazy_writes`` builds stores that leave writes unevaluated (named ``"mlx-lazy"``).
    """
    import mlx.core as mx  # noqa: PLC0415

    from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage  # noqa: PLC0415

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> MLXBlockStorage:
        dtype = getattr(mx, spec.dtype, None)
        if not isinstance(dtype, mx.Dtype):
            raise ValueError(f"store dtype must name an mlx.core dtype, got {spec.dtype!r}")
        return MLXBlockStorage(
            pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, dtype, lazy_writes=lazy_writes
        )

    def to_numpy(array: mx.array) -> Values:
        return np.array(array.astype(mx.float32), dtype=np.float32)

    def cast(array: mx.array, dtype: str) -> mx.array:
        return array.astype(getattr(mx, dtype))

    def dtype_size(name: str) -> int:
        dtype = getattr(mx, name, None)
        if name not in TOKEN_DTYPES or not isinstance(dtype, mx.Dtype):
            raise _unknown_dtype("mlx", name)
        return int(dtype.size)

    name = "mlx-lazy" if lazy_writes else "mlx"
    return StorageBackend(name, make, mx.array, to_numpy, cast=cast, dtype_size=dtype_size)


def builtin_backend(name: str) -> StorageBackend[Any]:
    """The backend ``"mlx"`` or ``"numpy"``.

    Raises:
        ValueError: Any other name.
    """
    if name == "mlx":
        return mlx_backend()
    if name == "numpy":
        return numpy_backend()
    raise ValueError(f"backend must be 'mlx' or 'numpy', got {name!r}")


class ReplayError(AssertionError):
    """The first op of a replay after which a check failed; names the op and what broke."""

    def __init__(self, op_index: int, op: Op, detail: str) -> None:
        super().__init__(f"op #{op_index} {encode_op(op)}: {detail}")
        self.op_index = op_index
        self.op = op
        self.detail = detail


class _CheckError(Exception):
    """Raised inside an op's application; the engine turns it into a ReplayError."""


@dataclass
class _HeldRead(Generic[ArrayT]):
    """An array a ``read`` op returned, and the values it must keep holding."""

    op_index: int
    array: ArrayT
    expected: Values
    first_check: int  # op index at whose end it is first evaluated


class AliasingReplay(Generic[ArrayT]):
    """Applies ops to a fresh pool and store and checks the store's data after each one.

    Invariants of the engine's own state, which the checks compare the pool and
    store against: ``_live`` holds exactly the handles that the ops so far left
    checked out, each with a shadow of shape ``(n_layers, block_size,
    n_kv_heads, head_dim)`` equal to the sentinels last written to it;
    ``_handles`` holds every handle ever handed out, live or stale.
    """

    def __init__(
        self,
        pool_config: PoolConfig,
        store_spec: StoreSpec,
        backend: StorageBackend[ArrayT],
        *,
        max_held_reads: int = 8,
    ) -> None:
        """Build the pool and the store under test (nothing applied yet)."""
        self.backend: Final = backend
        self.pool: Final = BlockPoolAllocator(pool_config, history_len=0)
        self.store: Final = backend.make_storage(self.pool, store_spec)
        self.spec: Final = store_spec
        self._block_size: Final = pool_config.block_size
        self._max_held_reads: Final = max_held_reads
        self._modulus: Final = _SENTINEL_MODULUS.get(store_spec.dtype, _DEFAULT_MODULUS)
        self._handles: Final[dict[HandleRef, Block]] = {}
        self._calls: Final[set[int]] = set()  # every allocate call label seen
        self._owner_of: Final[dict[HandleRef, int]] = {}
        self._live: Final[dict[HandleRef, Block]] = {}
        self._shadow: Final[dict[HandleRef, Values]] = {}
        self._held: Final[list[_HeldRead[ArrayT]]] = []
        self._next_sentinel = 0
        self._bytes_per_block: float | None = None
        self._applied: Final[list[Op]] = []

    # -- public ------------------------------------------------------------------------

    def apply(self, op: Op) -> Op:
        """Apply one op, run every check, and return it with its outcome filled in.

        Raises:
            ReplayError: The op's outcome differs from what it records or what the
                engine predicts, or a check failed after it.
        """
        index = len(self._applied)
        try:
            recorded, touched = self._execute(index, op)
            self._check_state(index, touched)
        except _CheckError as broken:
            self._applied.append(op)
            raise ReplayError(index, op, str(broken)) from broken.__cause__
        except Exception as error:  # a store's own bug (IndexError, a backend error...)
            self._applied.append(op)
            raise ReplayError(
                index, op, f"raised {type(error).__name__} unexpectedly: {error}"
            ) from error
        self._applied.append(recorded)
        return recorded

    def run(self, ops: Iterable[Op]) -> None:
        """Apply ``ops`` in order, stopping at the first failure."""
        for op in ops:
            self.apply(op)

    def trace(self) -> Trace:
        """The ops applied so far (with outcomes; a failing op as given), as a trace."""
        return Trace(self.pool.config, self.spec, tuple(self._applied))

    def known_refs(self) -> list[HandleRef]:
        """Names of every handle handed out so far, live or stale, in hand-out order."""
        return list(self._handles)

    def live_refs(self) -> list[HandleRef]:
        """Names of the handles currently checked out, in hand-out order."""
        return list(self._live)

    def next_call(self) -> int:
        """A ``call`` label no ``allocate`` op has used yet."""
        return 1 + max(self._calls, default=-1)

    # -- executing ops -----------------------------------------------------------------

    def _execute(self, index: int, op: Op) -> tuple[Op, list[HandleRef]]:
        """Apply ``op``; return it with its outcome, and the handles it may have freed."""
        match op:
            case Allocate():
                return self._allocate(op), []
            case Free(handles=refs):
                blocks = [self._block(ref) for ref in refs]
                all_live = all(ref in self._live for ref in refs) and len(set(refs)) == len(refs)
                error = _attempt(lambda: self.pool.free(blocks))
                self._require_outcome(op.expect, error, "InvalidFreeError", ok=all_live)
                if error is None:
                    self._forget(refs)
                return replace(op, expect=outcome_name(error)), list(refs)
            case FreeAll(owner=owner):
                owned = [ref for ref in self._live if self._owner_of[ref] == owner]
                error = _attempt(lambda: self.pool.free_all(owner))
                self._require_outcome(op.expect, error)
                if error is None:
                    self._forget(owned)
                return replace(op, expect=outcome_name(error)), owned
            case Shrink():
                return self._shrink(op), []
            case MarkUsed(handle=ref, n_used=n_used):
                block = self._block(ref)
                error = _attempt(lambda: self.pool.mark_used(block, n_used))
                self._require_outcome(op.expect, error)
                return replace(op, expect=outcome_name(error)), [ref]
            case RegisterOwner(owner=owner):
                error = _attempt(lambda: self.pool.register_owner(owner))
                self._require_outcome(op.expect, error)
                return replace(op, expect=outcome_name(error)), []
            case ReleaseOwner(owner=owner):
                error = _attempt(lambda: self.pool.release_owner(owner))
                self._require_outcome(op.expect, error)
                return replace(op, expect=outcome_name(error)), []
            case Write():
                return self._write(op), [op.handle]
            case Read():
                return self._read(index, op), list(op.handles)
            case Sync():
                error = _attempt(self.store.sync)
                self._require_outcome(op.expect, error, ok=True)
                return replace(op, expect=outcome_name(error)), []
        raise _CheckError(f"malformed trace: {op!r} is not an op")

    def _allocate(self, op: Allocate) -> Allocate:
        if op.call in self._calls:
            raise _CheckError(f"malformed trace: allocate call label {op.call} is used twice")
        self._calls.add(op.call)
        blocks: list[Block] = []

        def allocate() -> None:
            blocks.extend(self.pool.allocate(op.stream, op.n_tokens, op.owner, op.format))

        error = _attempt(allocate)
        self._require_outcome(op.expect, error)
        block_ids = tuple(block.block_id for block in blocks)
        if error is None and op.block_ids is not None and op.block_ids != block_ids:
            raise _CheckError(
                f"allocate returned block ids {list(block_ids)}, the trace "
                f"records {list(op.block_ids)}"
            )
        live_ids = {block.block_id: ref for ref, block in self._live.items()}
        for position, block in enumerate(blocks):
            if block.block_id in live_ids:
                raise _CheckError(
                    f"the pool handed out block id {block.block_id}, which live "
                    f"handle {list(live_ids[block.block_id])} still holds"
                )
            ref = (op.call, position)
            self._handles[ref] = block
            self._owner_of[ref] = op.owner
            self._live[ref] = block
            self._shadow[ref] = np.zeros(self._block_shape(), dtype=np.float32)
            for layer in range(self.spec.n_layers):
                self._write_sentinels(ref, layer, 0, self._block_size, "the sentinel write")
        recorded = replace(op, expect=outcome_name(error))
        return replace(recorded, block_ids=block_ids) if error is None else recorded

    def _shrink(self, op: Shrink) -> Shrink:
        retired: list[int] = []
        error = _attempt(lambda: retired.append(self.pool.shrink(op.stream, op.target_free)))
        self._require_outcome(op.expect, error)
        if error is not None:
            return replace(op, expect=outcome_name(error))
        if op.retired is not None and op.retired != retired[0]:
            raise _CheckError(f"shrink retired {retired[0]} blocks, the trace records {op.retired}")
        return replace(op, retired=retired[0], expect="ok")

    def _write(self, op: Write) -> Write:
        block = self._block(op.handle)
        if op.n_tokens < 0:
            raise _CheckError(f"malformed trace: a write of {op.n_tokens} tokens")
        valid = (
            op.handle in self._live
            and 0 <= op.layer < self.spec.n_layers
            and op.start >= 0
            and op.start + op.n_tokens <= self._block_size
        )
        if not valid:
            tokens = self.backend.tokens(self._sentinels(op.n_tokens), self.spec.dtype)
            error = _attempt(lambda: self.store.write(op.layer, block, op.start, tokens))
            self._require_outcome(op.expect, error, "ValueError", ok=False)
            return replace(op, expect=outcome_name(error))
        self._write_sentinels(op.handle, op.layer, op.start, op.n_tokens, "a valid write")
        self._require_outcome(op.expect, None)
        return replace(op, expect="ok")

    def _write_sentinels(
        self, ref: HandleRef, layer: int, start: int, n_tokens: int, what: str
    ) -> None:
        values = self._sentinels(n_tokens)
        tokens = self.backend.tokens(values, self.spec.dtype)
        error = _attempt(lambda: self.store.write(layer, self._live[ref], start, tokens))
        if error is not None:
            raise _CheckError(
                f"the store refused {what} to live handle {list(ref)} layer {layer} "
                f"slots {start}..{start + n_tokens}: {error!r}"
            )
        self._shadow[ref][layer, start : start + n_tokens] = values

    def _read(self, index: int, op: Read) -> Read:
        blocks = [self._block(ref) for ref in op.handles]
        available = len(blocks) * self._block_size
        valid = (
            all(ref in self._live for ref in op.handles)
            and 0 <= op.layer < self.spec.n_layers
            and 0 <= op.n_tokens <= available
        )
        result: list[ArrayT] = []
        error = _attempt(lambda: result.append(self.store.gather(op.layer, blocks, op.n_tokens)))
        self._require_outcome(op.expect, error, "ValueError", ok=valid)
        if error is None:
            expected = self._expected_tokens(op.layer, op.handles)[: op.n_tokens]
            self._hold(_HeldRead(index, result[0], expected, index + max(op.hold, 0)))
        return replace(op, expect=outcome_name(error))

    def _hold(self, read: _HeldRead[ArrayT]) -> None:
        self._held.append(read)
        if len(self._held) > self._max_held_reads:
            self._check_read(self._held.pop(0))

    # -- checks ------------------------------------------------------------------------

    def _check_state(self, index: int, touched: Sequence[HandleRef]) -> None:
        try:
            self.pool.check_invariants()
        except InvariantViolationError as error:
            raise _CheckError(f"the pool's books broke: {error}") from error
        self._check_liveness(touched)
        for layer in range(self.spec.n_layers):
            self._check_contents(layer)
        for read in self._held:
            if read.first_check <= index:
                self._check_read(read)
        self._check_capacity()

    def _check_liveness(self, touched: Sequence[HandleRef]) -> None:
        ids: dict[int, HandleRef] = {}
        for ref, block in self._live.items():
            if not self.pool.is_live(block):
                raise _CheckError(f"handle {list(ref)} should be live but the pool says it is not")
            if block.block_id in ids:
                raise _CheckError(
                    f"live handles {list(ids[block.block_id])} and {list(ref)} "
                    f"share block id {block.block_id}"
                )
            ids[block.block_id] = ref
        for ref in touched:
            if ref not in self._live and self.pool.is_live(self._handles[ref]):
                raise _CheckError(f"handle {list(ref)} was freed but the pool says it is live")

    def _check_contents(self, layer: int) -> None:
        refs = list(self._live)
        if not refs:
            return
        blocks = [self._live[ref] for ref in refs]
        got = self.backend.to_numpy(
            self.store.gather(layer, blocks, len(blocks) * self._block_size)
        )
        expected = self._expected_tokens(layer, refs)
        if got.shape != expected.shape:
            raise _CheckError(
                f"gather of every live block in layer {layer} has shape "
                f"{got.shape}, expected {expected.shape}"
            )
        for position, ref in enumerate(refs):
            for slot in range(self._block_size):
                row = position * self._block_size + slot
                if not np.array_equal(got[row], expected[row]):
                    raise _CheckError(self._describe_mismatch(ref, layer, slot, got[row]))

    def _describe_mismatch(self, ref: HandleRef, layer: int, slot: int, got: Values) -> str:
        block_id = self._live[ref].block_id
        where = f"live handle {list(ref)} (block id {block_id}) layer {layer} slot {slot}"
        for other_ref, shadow in self._shadow.items():
            for other_slot in range(self._block_size):
                if other_ref != ref and np.array_equal(shadow[layer, other_slot], got):
                    other_id = self._live[other_ref].block_id
                    return (
                        f"{where} holds the values written to live handle {list(other_ref)} "
                        f"(block id {other_id}) slot {other_slot}: the two ids share storage"
                    )
        expected = self._shadow[ref][layer, slot]
        if not got.any():
            return f"{where} holds zeros, expected {expected.ravel().tolist()}: its data was lost"
        return (
            f"{where} holds {got.ravel().tolist()}, expected {expected.ravel().tolist()}: "
            "a write was lost or landed elsewhere"
        )

    def _check_read(self, read: _HeldRead[ArrayT]) -> None:
        got = self.backend.to_numpy(read.array)
        if got.shape != read.expected.shape or not np.array_equal(got, read.expected):
            raise _CheckError(
                f"the array returned by read op #{read.op_index} changed after it was taken "
                f"(holds {got.ravel().tolist()[:8]}..., held "
                f"{read.expected.ravel().tolist()[:8]}...): a later write leaked into an "
                "earlier read (a view of the slab, or a reused buffer)"
            )

    def _check_capacity(self) -> None:
        id_bound = self.pool.id_bound()
        capacity = self.store.capacity()
        resident = self.store.resident_bytes()
        headroom = self.backend.headroom
        if not id_bound <= capacity or (capacity != id_bound and capacity >= headroom * id_bound):
            raise _CheckError(
                f"store capacity {capacity} does not follow the pool's id_bound {id_bound}: "
                f"expected id_bound <= capacity < {headroom} * id_bound (or equal), so that a "
                "retired tail is given back"
            )
        if capacity == 0:
            if resident != 0:
                raise _CheckError(f"store holds {resident} bytes at capacity 0")
            return
        per_block = resident / capacity
        if self._bytes_per_block is None:
            self._bytes_per_block = per_block
        elif per_block != self._bytes_per_block:
            raise _CheckError(
                f"resident_bytes {resident} at capacity {capacity} is {per_block} bytes per "
                f"block, was {self._bytes_per_block}: resident bytes must follow capacity"
            )

    # -- helpers -----------------------------------------------------------------------

    def _require_outcome(
        self,
        expect: str | None,
        error: BaseException | None,
        error_name: str | None = None,
        *,
        ok: bool | None = None,
    ) -> None:
        """Compare the outcome with the trace's ``expect`` and the engine's prediction.

        ``ok`` is the engine's prediction (``None``: none); when it predicts a
        failure, ``error_name`` is the error class it expects.
        """
        got = outcome_name(error)
        if expect is not None and expect != got:
            raise _CheckError(f"outcome {got} ({error}), the trace expects {expect}")
        if ok is True and error is not None:
            raise _CheckError(f"a valid call raised {error!r}")
        if ok is False and error is None:
            raise _CheckError(f"the call should have raised {error_name} but succeeded")
        if ok is False and error_name == "ValueError" and not isinstance(error, ValueError):
            raise _CheckError(f"the call should have raised ValueError, raised {error!r}")

    def _block(self, ref: HandleRef) -> Block:
        block = self._handles.get(ref)
        if block is None:
            raise _CheckError(f"malformed trace: no allocate handed out a handle {list(ref)}")
        return block

    def _forget(self, refs: Iterable[HandleRef]) -> None:
        for ref in refs:
            del self._live[ref]
            del self._shadow[ref]

    def _block_shape(self) -> tuple[int, int, int, int]:
        spec = self.spec
        return (spec.n_layers, self._block_size, spec.n_kv_heads, spec.head_dim)

    def _expected_tokens(self, layer: int, refs: Sequence[HandleRef]) -> Values:
        """The shadow's slots of ``refs`` in ``layer``, concatenated: ``(k * bs, H, D)``."""
        spec = self.spec
        if not refs:
            return np.zeros((0, spec.n_kv_heads, spec.head_dim), dtype=np.float32)
        return np.concatenate([self._shadow[ref][layer] for ref in refs])

    def _sentinels(self, n_tokens: int) -> Values:
        """``n_tokens`` slots of values never written before (modulo the dtype's exact range)."""
        spec = self.spec
        count = n_tokens * spec.n_kv_heads * spec.head_dim
        serial = np.arange(self._next_sentinel, self._next_sentinel + count, dtype=np.int64)
        self._next_sentinel += count
        values = (serial % (self._modulus - 1) + 1).astype(np.float32)
        return values.reshape(n_tokens, spec.n_kv_heads, spec.head_dim)


def _attempt(call: Callable[[], object]) -> BaseException | None:
    """Run ``call``; return the pool or argument error it raised, or ``None``."""
    try:
        call()
    except (BlockPoolError, ValueError, TypeError) as error:
        return error
    return None


def replay(trace: Trace, backend: StorageBackend[ArrayT]) -> AliasingReplay[ArrayT]:
    """Apply every op of ``trace`` to a fresh pool and store; return the engine.

    Raises:
        ReplayError: At the first op after which a check fails.
    """
    engine = AliasingReplay(trace.pool, trace.store, backend)
    engine.run(trace.ops)
    return engine


def replay_file(path: str | Path, backend: str | StorageBackend[ArrayT] = "mlx") -> int:
    """Replay the trace file at ``path`` on ``backend``: ``"mlx"``, ``"numpy"`` or any backend.

    This only replays: a clean replay of a partial trace (``trace.partial``)
    is not a pass; :func:`veloxquant_mlx.testing.replay_command.replay_verdict`
    gives the verdict.

    Returns:
        The number of ops replayed.

    Raises:
        ReplayError: At the first op after which a check fails.
        TraceFormatError: The file is not a trace.
        ValueError: ``backend`` names no built-in backend.
    """
    trace = load(path)
    replay(trace, backend if isinstance(backend, StorageBackend) else builtin_backend(backend))
    return len(trace.ops)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see :mod:`veloxquant_mlx.testing.replay_command`."""
    from veloxquant_mlx.testing.replay_command import main as command_main  # noqa: PLC0415

    return command_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
