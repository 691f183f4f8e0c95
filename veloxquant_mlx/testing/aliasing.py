"""Aliasing replay: apply a trace to a pool, the spec and a store; check the data after each line.

The replay engine (:class:`AliasingReplay`) is the referee for backing
stores. It applies a :mod:`trace <veloxquant_mlx.testing.traces>` line by
line to a fresh pool and a store built by a :class:`StorageBackend`. Pool
calls go through :class:`~veloxquant_mlx.testing.lockstep.Lockstep`, so the
executable spec predicts every outcome (block ids, errors, counts) and which
handles are live; the engine writes a distinct sentinel into every slot of
every block the spec says became live (and into every slot a ``write``
names), keeps a NumPy shadow of what each live block must hold, and after
every line but a query (a pool call that changes nothing, whose outcome is
still checked) checks that:

1. the pool's books are consistent and every live handle is live in the pool
   (and every handle the line freed is not); live handles share an id only
   as the pool's reference count says (``share``, ``fork``), and a handle of
   a shared block starts with that block's contents, not new sentinels;
2. every live block's contents, read back with ``gather``, equal the shadow:
   a write through one id that shows up in another means two ids share storage,
   and every reader of a shared block must see what it saw; a write through
   a handle of a shared block (count above 1) must be refused by the store;
3. every array an earlier ``gather`` returned still holds the values it had
   when it was taken, including ones left unevaluated (``hold``) until after
   later writes: a lazy graph or a donated buffer must not leak a later write in;
4. the store follows the pool: ``id_bound <= capacity`` and ``capacity <
   headroom * id_bound`` unless they are equal, so the retired tail of the id
   range holds nothing beyond that headroom; ``resident_bytes`` is
   proportional to capacity, so it falls when a shrink retires the tail.

The first line that breaks any of these, or whose outcome differs from the
spec's or from the one it records, raises :class:`ReplayError` naming the
line's index, the line, and what broke. So a history recorded from a
concurrent run replays as a linearizability check too.

Command line: ``veloxquant-mlx replay TRACE.jsonl [--on mlx|numpy|...]``
(:mod:`~veloxquant_mlx.testing.replay_command`), or :func:`replay_file`.

Complexity: per line O(live blocks x layers x block slots) for the content
check, plus O(held reads), the pool's O(n) invariant check and one spec
transition (the spec's stale handles are compacted away as the replay goes,
so a long trace costs linear time). Thread safety: an engine is used from
one thread.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program(
        "python -m veloxquant_mlx.testing.aliasing", "veloxquant_mlx.testing.replay_command"
    )

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import numpy as np

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    InvariantViolationError,
    PoolConfig,
)
from veloxquant_mlx.testing.lockstep import Check, ConformanceError, Lockstep
from veloxquant_mlx.testing.storage_backends import (
    TOKEN_DTYPES,
    StorageBackend,
    Values,
    builtin_backend,
    mlx_backend,
    numpy_backend,
)
from veloxquant_mlx.testing.store_operations import Gather, Sync, Write, fits_the_store
from veloxquant_mlx.testing.traces import StoreSpec, Trace, TraceLine, encode_line, load
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.table import (
    Handle,
    Outcome,
    Raised,
    Returned,
    declaration_of,
    handle_names,
    matches,
)

__all__ = [
    "TOKEN_DTYPES",
    "AliasingReplay",
    "ReplayError",
    "StorageBackend",
    "Values",
    "builtin_backend",
    "main",
    "mlx_backend",
    "numpy_backend",
    "replay",
    "replay_file",
    "spec_config",
]

ArrayT = TypeVar("ArrayT")

#: Sentinels count modulo at most this (every such count is exact in float32).
_MAX_MODULUS: Final = 2**24
#: Compact the spec's state once it holds this many stale handles (they change nothing).
_COMPACT_AFTER: Final = 256


def _sentinel_modulus(dtype: str) -> int:
    """What sentinels count modulo in ``dtype``, so that every value is exact there: the
    integers a float type holds exactly (``2 ** (mantissa bits + 1)``), an int type's
    positive range, at most ``2 ** 24`` (float16 2048, bfloat16 256, int8 128, uint16
    65536)."""
    if dtype == "bfloat16":  # not a NumPy dtype: 7 mantissa bits
        return 2**8
    kind = np.dtype(dtype)
    if kind.kind in "iu":
        return min(_MAX_MODULUS, int(np.iinfo(kind).max) + 1)
    exact: int = 2 ** (int(np.finfo(kind).nmant) + 1)
    return min(_MAX_MODULUS, exact)


def spec_config(pool: PoolConfig) -> model.SpecConfig:
    """The spec's twin of a ``PoolConfig``."""
    return model.SpecConfig(
        pool.block_size, pool.n_blocks, pool.separate_kv, pool.grow_on_exhaustion, pool.max_blocks
    )


class ReplayError(AssertionError):
    """The first line of a replay after which a check failed; names the line and what broke."""

    def __init__(self, op_index: int, line: TraceLine, detail: str) -> None:
        super().__init__(f"op #{op_index} {encode_line(line)}: {detail}")
        self.op_index = op_index
        self.line = line
        self.detail = detail


class _CheckError(Exception):
    """Raised inside a line's application; the engine turns it into a ReplayError."""


@dataclass
class _HeldRead(Generic[ArrayT]):
    """An array a ``gather`` returned, and the values it must keep holding."""

    op_index: int
    array: ArrayT
    expected: Values
    first_check: int  # line index at whose end it is first evaluated


class AliasingReplay(Generic[ArrayT]):
    """Applies lines to a fresh pool, the spec and a store, and checks the store after each.

    Invariants: ``_shadow`` holds exactly the handles the spec says are live,
    each with the sentinels last written to it, of shape ``(n_layers,
    block_size, n_kv_heads, head_dim)``; the lockstep runner names every
    handle ever handed out.
    """

    def __init__(
        self,
        pool_config: PoolConfig,
        store_spec: StoreSpec,
        backend: StorageBackend[ArrayT],
        *,
        history_len: int = 0,
        max_held_reads: int = 8,
        pool_type: type[BlockPoolAllocator] = BlockPoolAllocator,
    ) -> None:
        """Build the pool (a ``pool_type``: a subclass plants a bug), the spec and the store
        under test (nothing applied yet)."""
        pools: list[BlockPoolAllocator] = []

        def make(config: PoolConfig, history: int) -> BlockPoolAllocator:
            pools.append(pool_type(config, history_len=history))
            return pools[-1]

        self.lockstep: Final = Lockstep(
            make, spec_config(pool_config), history_len, check=Check.OUTCOMES
        )
        self.pool: Final = pools[0]
        self.backend: Final = backend
        self.store: Final = backend.make_storage(self.pool, store_spec)
        self.spec: Final = store_spec
        self._block_size: Final = pool_config.block_size
        self._max_held_reads: Final = max_held_reads
        self._modulus: Final = _sentinel_modulus(store_spec.dtype)
        self._shadow: Final[dict[Handle, Values]] = {}
        self._held: Final[list[_HeldRead[ArrayT]]] = []
        self._next_sentinel = 0
        self._bytes_per_block: float | None = None
        self._applied: Final[list[TraceLine]] = []
        self._history_len: Final = history_len

    # -- public ------------------------------------------------------------------------

    def apply(self, line: TraceLine) -> TraceLine:
        """Apply one line, run every check, and return it with its outcome filled in.

        Raises:
            ReplayError: The line's outcome differs from the spec's or the one it
                records, or a check failed after it.
        """
        index = len(self._applied)
        declaration = declaration_of(line.op)
        try:
            recorded, touched = self._execute(index, line)
            if declaration.changes_state or declaration.target == "store":
                self._check_state(index, touched)  # a query changes neither pool nor store
        except _CheckError as broken:
            self._applied.append(line)
            raise ReplayError(index, line, str(broken)) from broken.__cause__
        except Exception as error:  # a store's own bug (IndexError, a backend error...)
            self._applied.append(line)
            raise ReplayError(
                index, line, f"raised {type(error).__name__} unexpectedly: {error}"
            ) from error
        self._applied.append(recorded)
        return recorded

    def run(self, lines: Iterable[TraceLine]) -> None:
        """Apply ``lines`` in order, stopping at the first failure, then :meth:`finish`."""
        for line in lines:
            self.apply(line)
        self.finish()

    def finish(self) -> None:
        """Check every read still held: the lines ended before its ``hold`` ran out, and a
        write after it must not have changed it all the same.

        Raises:
            ReplayError: Naming the last line applied, if a held read changed.
        """
        last = len(self._applied) - 1
        try:
            for read in self._held:
                self._check_read(read)
        except _CheckError as broken:
            raise ReplayError(last, self._applied[last], f"at the end: {broken}") from None
        except Exception as error:  # the backend failed to evaluate a held read
            raise ReplayError(
                last,
                self._applied[last],
                f"at the end: evaluating a held read raised {type(error).__name__}: {error}",
            ) from error
        self._held.clear()

    def trace(self) -> Trace:
        """The lines applied so far (with outcomes; a failing line as given), as a trace."""
        return Trace(self.pool.config, self.spec, tuple(self._applied), self._history_len)

    def known_refs(self) -> list[Handle]:
        """Names of every handle handed out so far, live or stale, in hand-out order."""
        return list(self.lockstep.pool_side.objects)

    def live_refs(self) -> list[Handle]:
        """Names of the handles currently checked out, in hand-out order."""
        return list(self._shadow)

    def next_call(self) -> int:
        """A call label no line has used yet."""
        return 1 + max((label for label, _ in self.lockstep.trace), default=-1)

    # -- applying lines ----------------------------------------------------------------

    def _execute(self, index: int, line: TraceLine) -> tuple[TraceLine, list[Handle]]:
        """Apply ``line``; return it with its outcome, and the handles it may have freed."""
        if declaration_of(line.op).target == "store":
            outcome = self._store_call(index, line)
            return replace(line, outcome=outcome), list(handle_names(line.op))
        label = index if line.call is None else line.call
        spec = self.lockstep.spec
        before = spec.live_names()
        try:
            outcome = self.lockstep.apply(line.op, label, expect=line.outcome)
        except ConformanceError as error:
            first = str(error).split("\n", 1)[0]
            raise _CheckError(first.replace("malformed sequence", "malformed trace")) from None
        after = spec.live_names()
        gone = [name for name in before if name not in set(after)]
        for name in gone:
            del self._shadow[name]
        for name in after:
            if name not in self._shadow:
                self._give_contents(name)
        if len(spec.state.handles) - len(after) > _COMPACT_AFTER:
            spec.compact()
        if isinstance(outcome, Raised):
            outcome = Raised(outcome.kind)
        # An unlabelled line (one that hands out no handle) stays unlabelled: its position,
        # the lockstep's label for it, may be another line's label in the file.
        return replace(line, outcome=outcome), [*handle_names(line.op), *gone]

    def _give_contents(self, name: Handle) -> None:
        """A handle the spec says became live: a share of a block already live reads its
        contents (one shadow for both); a block new to the live set gets sentinels."""
        holders = self._sharers(name)
        if holders:
            self._shadow[name] = self._shadow[holders[0]]  # one block: one content, read by both
        else:
            self._give_sentinels(name)

    def _sharers(self, name: Handle) -> list[Handle]:
        """The live handles that show ``name``'s block id (``name`` too, once it is live)."""
        block_id = self._block_id(name)
        return [other for other in self._shadow if self._block_id(other) == block_id]

    def _give_sentinels(self, name: Handle) -> None:
        """A block the spec says became live: its shadow, and sentinels in every slot."""
        spec = self.spec
        shape = (spec.n_layers, self._block_size, spec.n_kv_heads, spec.head_dim)
        self._shadow[name] = np.zeros(shape, dtype=np.float32)
        for layer in range(spec.n_layers):
            self._write_sentinels(name, layer, 0, self._block_size, "the sentinel write")

    def _store_call(self, index: int, line: TraceLine) -> Outcome:
        op = line.op
        if isinstance(op, Write):
            outcome = self._write(op)
        elif isinstance(op, Gather):
            outcome = self._gather(index, op)
        else:
            assert isinstance(op, Sync), f"the store calls are write, gather and sync: {op!r}"
            outcome = self._attempt(self.store.sync)
            self._require(None, outcome, valid=True)
        self._require(line.outcome, outcome)
        return Raised(outcome.kind) if isinstance(outcome, Raised) else outcome

    def _write(self, op: Write) -> Outcome:
        layer, start, n_tokens = _ints(op.layer, op.start, op.n_tokens)
        block = self._object(op.block)
        if n_tokens < 0:
            raise _CheckError(f"malformed trace: a write of {n_tokens} tokens")
        valid = (
            op.block in self._shadow
            and len(self._sharers(op.block)) == 1  # a shared block is read-only
            and fits_the_store(op, self.spec.n_layers, self._block_size)
        )
        if not valid:
            tokens = self.backend.tokens(self._sentinels(n_tokens), self.spec.dtype)
            outcome = self._attempt(lambda: self.store.write(layer, block, start, tokens))
            self._require(None, outcome, valid=False)
            return outcome
        assert isinstance(op.block, Handle), "checked by _object"
        self._write_sentinels(op.block, layer, start, n_tokens, "a valid write")
        return Returned(None)

    def _write_sentinels(
        self, name: Handle, layer: int, start: int, n_tokens: int, what: str
    ) -> None:
        values = self._sentinels(n_tokens)
        tokens = self.backend.tokens(values, self.spec.dtype)
        block = self._object(name)
        outcome = self._attempt(lambda: self.store.write(layer, block, start, tokens))
        if isinstance(outcome, Raised):
            raise _CheckError(
                f"the store refused {what} to live handle {name!r} layer {layer} "
                f"slots {start}..{start + n_tokens}: {outcome.kind}({outcome.text()})"
            )
        self._shadow[name][layer, start : start + n_tokens] = values

    def _gather(self, index: int, op: Gather) -> Outcome:
        layer, n_tokens, hold = _ints(op.layer, op.n_tokens, op.hold)
        names = handle_names(op)
        blocks = [self._object(name) for name in names]
        valid = all(name in self._shadow for name in names) and fits_the_store(
            op, self.spec.n_layers, self._block_size
        )
        result: list[ArrayT] = []
        outcome = self._attempt(lambda: result.append(self.store.gather(layer, blocks, n_tokens)))
        self._require(None, outcome, valid=valid)
        if result:
            expected = self._expected_tokens(layer, names)[:n_tokens]
            self._hold(_HeldRead(index, result[0], expected, index + max(hold, 0)))
        return outcome

    def _hold(self, read: _HeldRead[ArrayT]) -> None:
        self._held.append(read)
        if len(self._held) > self._max_held_reads:
            self._check_read(self._held.pop(0))

    # -- checks ------------------------------------------------------------------------

    def _check_state(self, index: int, touched: Sequence[Handle]) -> None:
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

    def _check_liveness(self, touched: Sequence[Handle]) -> None:
        objects = self.lockstep.pool_side.objects
        ids: dict[int, list[Handle]] = {}
        for name in self._shadow:
            block = self._object(name)
            if not self.pool.is_live(block):
                raise _CheckError(f"handle {name!r} should be live but the pool says it is not")
            ids.setdefault(block.block_id, []).append(name)
        for block_id, names in ids.items():
            count = self.pool.ref_count(block_id)
            if count != len(names):
                raise _CheckError(
                    f"live handles {names!r} share block id {block_id}, but the pool counts "
                    f"{count} handle(s) of it"
                )
        for name in touched:
            if name not in self._shadow and name in objects and self.pool.is_live(objects[name]):
                raise _CheckError(f"handle {name!r} was freed but the pool says it is live")

    def _check_contents(self, layer: int) -> None:
        names = list(self._shadow)
        if not names:
            return
        blocks = [self._object(name) for name in names]
        got = self.backend.to_numpy(
            self.store.gather(layer, blocks, len(blocks) * self._block_size)
        )
        expected = self._expected_tokens(layer, names)
        if got.shape != expected.shape:
            raise _CheckError(
                f"gather of every live block in layer {layer} has shape "
                f"{got.shape}, expected {expected.shape}"
            )
        for position, name in enumerate(names):
            for slot in range(self._block_size):
                row = position * self._block_size + slot
                if not np.array_equal(got[row], expected[row]):
                    raise _CheckError(self._describe_mismatch(name, layer, slot, got[row]))

    def _block_id(self, name: Handle) -> object:
        return getattr(self.lockstep.pool_side.objects[name], "block_id", None)

    def _describe_mismatch(self, name: Handle, layer: int, slot: int, got: Values) -> str:
        where = f"live handle {name!r} (block id {self._block_id(name)}) layer {layer} slot {slot}"
        for other, shadow in self._shadow.items():
            for other_slot in range(self._block_size):
                if other != name and np.array_equal(shadow[layer, other_slot], got):
                    return (
                        f"{where} holds the values written to live handle {other!r} "
                        f"(block id {self._block_id(other)}) slot {other_slot}: the two ids "
                        "share storage"
                    )
        expected = self._shadow[name][layer, slot]
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

    @staticmethod
    def _attempt(call: Any) -> Outcome:
        """Run a store call; its outcome (the error kind it raised, if any)."""
        try:
            call()
        except (ValueError, TypeError) as error:
            return Raised(type(error).__name__, str(error))
        return Returned(None)

    @staticmethod
    def _require(recorded: Outcome | None, outcome: Outcome, *, valid: bool | None = None) -> None:
        """The outcome must be the recorded one, and ok iff the engine says the call is valid."""
        if recorded is not None and not matches(recorded, outcome):
            shown = recorded.kind if isinstance(recorded, Raised) else "ok"
            got = outcome.kind if isinstance(outcome, Raised) else "ok"
            raise _CheckError(f"outcome {got}, the trace expects {shown}")
        if valid is True and isinstance(outcome, Raised):
            raise _CheckError(f"a valid call raised {outcome.kind}({outcome.text()})")
        if valid is False and not isinstance(outcome, Raised):
            raise _CheckError("the call should have raised ValueError but succeeded")
        if valid is False and isinstance(outcome, Raised) and outcome.kind != "ValueError":
            raise _CheckError(f"the call should have raised ValueError, raised {outcome.kind}")

    def _object(self, ref: object) -> Block:
        if not isinstance(ref, Handle):
            raise _CheckError(f"malformed trace: a store call names handles, got {ref!r}")
        block = self.lockstep.pool_side.objects.get(ref)
        if block is None:
            raise _CheckError(f"malformed trace: no call handed out a handle {ref!r}")
        assert isinstance(block, Block), "our pool hands out Blocks"
        return block

    def _expected_tokens(self, layer: int, names: Sequence[Handle]) -> Values:
        """The shadow's slots of ``names`` in ``layer``, concatenated: ``(k * bs, H, D)``."""
        spec = self.spec
        if not names:
            return np.zeros((0, spec.n_kv_heads, spec.head_dim), dtype=np.float32)
        return np.concatenate([self._shadow[name][layer] for name in names])

    def _sentinels(self, n_tokens: int) -> Values:
        """``n_tokens`` slots of values never written before (modulo the dtype's exact range)."""
        spec = self.spec
        count = n_tokens * spec.n_kv_heads * spec.head_dim
        serial = np.arange(self._next_sentinel, self._next_sentinel + count, dtype=np.int64)
        self._next_sentinel += count
        values = (serial % (self._modulus - 1) + 1).astype(np.float32)
        return values.reshape(n_tokens, spec.n_kv_heads, spec.head_dim)


def _ints(*values: object) -> tuple[int, ...]:
    """A store call's numbers, which must be ints (the engine writes its own values)."""
    if not all(model.is_int(value) for value in values):
        raise _CheckError(f"malformed trace: a store call's numbers must be ints, got {values}")
    return values  # type: ignore[return-value]


def replay(trace: Trace, backend: StorageBackend[ArrayT]) -> AliasingReplay[ArrayT]:
    """Apply every line of ``trace`` to a fresh pool, spec and store; return the engine.

    Timed lines are applied in file order (a linearized history); the
    ``replay`` command linearizes concurrent windows first.

    Raises:
        ReplayError: At the first line after which a check fails.
    """
    engine = AliasingReplay(trace.pool, trace.store, backend, history_len=trace.history_len)
    engine.run(trace.lines)
    return engine


def replay_file(path: str | Path, backend: str | StorageBackend[ArrayT] = "mlx") -> int:
    """Replay the trace file at ``path`` on ``backend``: ``"mlx"``, ``"numpy"`` or any backend.

    This only replays: a clean replay of a partial trace (``trace.partial``)
    is not a pass; :func:`veloxquant_mlx.testing.replay_command.replay_verdict`
    gives the verdict.

    Returns:
        The number of lines replayed.

    Raises:
        ReplayError: At the first line after which a check fails.
        TraceFormatError: The file is not a trace.
        ValueError: ``backend`` names no built-in backend.
    """
    trace = load(path)
    replay(trace, backend if isinstance(backend, StorageBackend) else builtin_backend(backend))
    return len(trace.lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.testing.aliasing``: ``veloxquant-mlx replay``'s old name."""
    from veloxquant_mlx.testing.replay_command import main as command_main  # noqa: PLC0415

    return command_main(argv)
