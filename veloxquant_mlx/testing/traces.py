"""Operation traces of a pool and its backing store, as JSON-lines files.

A *trace* is what the aliasing replay (:mod:`veloxquant_mlx.testing.aliasing`)
applies, op by op, to a fresh pool and store: every pool operation
(``allocate``, ``free``, ``free_all``, ``shrink``, ``mark_used``,
``register_owner``, ``release_owner``; growth happens inside ``allocate``)
and every store operation (``write``, ``read``, ``sync``). Hypothesis, the
stress runner and users' bug reports all produce the same format, so a
failure found anywhere replays exactly.

File format (one JSON object per line, blank lines ignored)::

    {"trace": "veloxquant-mlx", "version": 1,
     "pool": {"block_size": 4, "n_blocks": 8, "separate_kv": true,
              "grow_on_exhaustion": false, "max_blocks": null},
     "store": {"n_layers": 2, "n_kv_heads": 2, "head_dim": 3, "dtype": "float32"}}
    {"op": "allocate", "call": 0, "stream": "k", "n_tokens": 5, "owner": 1}
    {"op": "write", "layer": 0, "handle": [0, 1], "start": 1, "n_tokens": 2}
    {"op": "free", "handles": [[0, 0]], "expect": "ok"}

A header may add ``"partial": true``: the ops are the beginning of a longer
history whose end was never recorded (a stress run that was interrupted, or
whose checking gave up). Every op of a partial trace still replays and is
checked, but a clean replay of it cannot say OK: its verdict is
inconclusive. The store's ``n_layers``, ``n_kv_heads`` and ``head_dim`` are
ints ``>= 1`` and its ``dtype`` a name the replay backend knows.

A handle is named ``[call, position]``: the ``position``-th block returned by
the ``allocate`` op whose ``call`` label is ``call``. Labels are any distinct
ints, so ops can be dropped or reordered without renaming. The name stays
valid after the block is freed: it then denotes the stale handle, which is
how stale frees and stale writes are written down.

Every op may carry ``expect``: ``"ok"``, or the class name of the error the
call must raise (``"InvalidFreeError"``, ``"ValueError"``...); absent means
"not checked". ``allocate`` may carry the ``block_ids`` it must return and
``shrink`` the number it must have ``retired``. Written values are not in the
trace: the replay writes its own sentinels. The op fields, by op:

- ``allocate``: ``call, stream, n_tokens, owner[, format][, block_ids]``
- ``free``: ``handles``; ``free_all``: ``owner``
- ``shrink``: ``stream, target_free[, retired]``
- ``mark_used``: ``handle, n_used``
- ``register_owner`` / ``release_owner``: ``owner``
- ``write``: ``layer, handle, start, n_tokens`` (sentinel tokens into those slots)
- ``read``: ``layer, handles, n_tokens[, hold]`` (a gather, left unevaluated for
  ``hold`` more ops before it is first checked)
- ``sync``: no fields

Complexity: encoding and decoding are O(size of the op). Thread safety: the
functions are pure; a :class:`TraceRecorder` is not locked (feed it from one
thread, in linearization order).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Final

from veloxquant_mlx.commandline.files import atomic_write_text
from veloxquant_mlx.memory.block_pool import Block, PoolConfig

__all__ = [
    "Allocate",
    "Free",
    "FreeAll",
    "HandleRef",
    "MarkUsed",
    "Op",
    "Read",
    "RegisterOwner",
    "ReleaseOwner",
    "Shrink",
    "StoreSpec",
    "Sync",
    "Trace",
    "TraceFormatError",
    "TraceRecorder",
    "Write",
    "decode_op",
    "dumps",
    "encode_header",
    "encode_op",
    "load",
    "loads",
    "save",
]

FORMAT_NAME: Final = "veloxquant-mlx"
FORMAT_VERSION: Final = 1

#: ``(call, position)``: the ``position``-th block returned by allocate call ``call``.
HandleRef = tuple[int, int]


class TraceFormatError(ValueError):
    """A trace file or line is not in the format this module writes; names line and field."""


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Shape of the store a trace runs against: layers, one slot's shape, dtype name.

    Invariant: the three sizes are ints ``>= 1`` (``bool`` excluded) and
    ``dtype`` a non-empty str; whether a backend knows the dtype is the
    backend's to say.
    """

    n_layers: int = 2
    n_kv_heads: int = 2
    head_dim: int = 3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"{name} must be an int >= 1, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise TypeError(f"dtype must be a non-empty str naming a dtype, got {self.dtype!r}")

    def slot_count(self) -> int:
        """Values in one token slot of one layer: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class Allocate:
    """``pool.allocate(stream, n_tokens, owner, format)``; handles named ``[call, i]``."""

    kind: ClassVar[str] = "allocate"
    call: int
    stream: str
    n_tokens: int
    owner: int
    format: str = "fp16"
    block_ids: tuple[int, ...] | None = None
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class Free:
    """``pool.free([handles...])``, in list order; stale or repeated handles allowed."""

    kind: ClassVar[str] = "free"
    handles: tuple[HandleRef, ...]
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class FreeAll:
    """``pool.free_all(owner)``."""

    kind: ClassVar[str] = "free_all"
    owner: int
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class Shrink:
    """``pool.shrink(stream, target_free)``; ``retired`` is the count it must return."""

    kind: ClassVar[str] = "shrink"
    stream: str
    target_free: int
    retired: int | None = None
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class MarkUsed:
    """``pool.mark_used(handle, n_used)``."""

    kind: ClassVar[str] = "mark_used"
    handle: HandleRef
    n_used: int
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class RegisterOwner:
    """``pool.register_owner(owner)``."""

    kind: ClassVar[str] = "register_owner"
    owner: int
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseOwner:
    """``pool.release_owner(owner)``."""

    kind: ClassVar[str] = "release_owner"
    owner: int
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class Write:
    """``store.write(layer, handle, start, tokens)`` with ``n_tokens`` sentinel tokens."""

    kind: ClassVar[str] = "write"
    layer: int
    handle: HandleRef
    start: int
    n_tokens: int
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class Read:
    """``store.gather(layer, handles, n_tokens)``, first checked ``hold`` ops later."""

    kind: ClassVar[str] = "read"
    layer: int
    handles: tuple[HandleRef, ...]
    n_tokens: int
    hold: int = 0
    expect: str | None = None


@dataclass(frozen=True, slots=True)
class Sync:
    """``store.sync()``."""

    kind: ClassVar[str] = "sync"
    expect: str | None = None


Op = (
    Allocate
    | Free
    | FreeAll
    | Shrink
    | MarkUsed
    | RegisterOwner
    | ReleaseOwner
    | Write
    | Read
    | Sync
)

_OP_CLASSES: Final[dict[str, type[Op]]] = {
    cls.kind: cls
    for cls in (
        Allocate,
        Free,
        FreeAll,
        Shrink,
        MarkUsed,
        RegisterOwner,
        ReleaseOwner,
        Write,
        Read,
        Sync,
    )
}
_INT_FIELDS: Final = frozenset(
    {"call", "n_tokens", "owner", "target_free", "n_used", "layer", "start", "hold", "retired"}
)
_STR_FIELDS: Final = frozenset({"stream", "format", "expect"})


@dataclass(frozen=True, slots=True)
class Trace:
    """A pool configuration, a store shape, and the ops to apply, in order.

    ``partial`` marks the beginning of a longer history (module docstring).
    """

    pool: PoolConfig
    store: StoreSpec = StoreSpec()
    ops: tuple[Op, ...] = ()
    partial: bool = False

    def with_ops(self, ops: Iterable[Op]) -> Trace:
        """This trace with its ops replaced."""
        return replace(self, ops=tuple(ops))


# -- encoding -----------------------------------------------------------------------


def encode_op(op: Op) -> str:
    """One op as a JSON line (no newline); ``None`` fields are left out."""
    record: dict[str, object] = {"op": op.kind}
    for op_field in fields(op):
        value = getattr(op, op_field.name)
        if value is not None:
            record[op_field.name] = value
    return json.dumps(record, separators=(",", ":"))


def encode_header(trace: Trace) -> str:
    """The header line of ``trace`` (no newline): format, pool, store, and ``partial`` if set."""
    pool = trace.pool
    store = trace.store
    header: dict[str, object] = {
        "trace": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "pool": {
            "block_size": pool.block_size,
            "n_blocks": pool.n_blocks,
            "separate_kv": pool.separate_kv,
            "grow_on_exhaustion": pool.grow_on_exhaustion,
            "max_blocks": pool.max_blocks,
        },
        "store": {
            "n_layers": store.n_layers,
            "n_kv_heads": store.n_kv_heads,
            "head_dim": store.head_dim,
            "dtype": store.dtype,
        },
    }
    if trace.partial:
        header["partial"] = True
    return json.dumps(header, separators=(",", ":"))


def dumps(trace: Trace) -> str:
    """The whole trace as JSON-lines text: the header, then one line per op."""
    lines = [encode_header(trace), *map(encode_op, trace.ops)]
    return "\n".join(lines) + "\n"


def save(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` to ``path`` as JSON lines (UTF-8), atomically."""
    atomic_write_text(Path(path), dumps(trace))


# -- decoding -----------------------------------------------------------------------


def _require_int(name: str, value: object) -> int:
    if type(value) is not int:
        raise TraceFormatError(f"field {name!r} must be an int, got {value!r}")
    return value


def _decode_ref(name: str, value: object) -> HandleRef:
    if not isinstance(value, list) or len(value) != 2:
        raise TraceFormatError(f"field {name!r} must be a handle [call, position], got {value!r}")
    return (_require_int(name, value[0]), _require_int(name, value[1]))


def _decode_field(name: str, value: object) -> object:
    """Check one field's JSON value against the kind that field has in every op."""
    if name in _INT_FIELDS:
        return _require_int(name, value)
    if name in _STR_FIELDS:
        if not isinstance(value, str):
            raise TraceFormatError(f"field {name!r} must be a string, got {value!r}")
        return value
    if name == "handle":
        return _decode_ref(name, value)
    if name in ("handles", "block_ids"):
        if not isinstance(value, list):
            raise TraceFormatError(f"field {name!r} must be a list, got {value!r}")
        if name == "handles":
            return tuple(_decode_ref(name, item) for item in value)
        return tuple(_require_int(name, item) for item in value)
    raise TraceFormatError(f"unknown field {name!r}")


def decode_op(line: str) -> Op:
    """Parse one JSON line into its op.

    Raises:
        TraceFormatError: Not JSON, not an object, unknown op or field, a field of
            the wrong type, or a required field missing.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"not JSON: {error}") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"an op must be a JSON object, got {record!r}")
    kind = record.pop("op", None)
    cls = _OP_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceFormatError(f"'op' must be one of {sorted(_OP_CLASSES)}, got {kind!r}")
    allowed = {op_field.name for op_field in fields(cls)}
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise TraceFormatError(f"op {kind!r} has no field(s) {unknown}; it has {sorted(allowed)}")
    values = {name: _decode_field(name, value) for name, value in record.items()}
    try:
        return cls(**values)  # type: ignore[arg-type]  # each value checked by _decode_field
    except TypeError as error:
        raise TraceFormatError(f"op {kind!r}: {error}") from None


_HEADER_KEYS: Final = frozenset({"trace", "version", "pool", "store", "partial"})


def _decode_header(line: str) -> tuple[PoolConfig, StoreSpec, bool]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"header is not JSON: {error}") from None
    if not isinstance(record, dict) or record.get("trace") != FORMAT_NAME:
        raise TraceFormatError(f'expected a header with "trace": {FORMAT_NAME!r}, got {line!r}')
    if record.get("version") != FORMAT_VERSION:
        raise TraceFormatError(
            f"trace version {record.get('version')!r} is not supported; expected {FORMAT_VERSION}"
        )
    unknown = sorted(set(record) - _HEADER_KEYS)
    if unknown:
        raise TraceFormatError(
            f"header has unknown key(s) {unknown}; expected {sorted(_HEADER_KEYS)}"
        )
    pool_fields, store_fields = record.get("pool"), record.get("store")
    if not isinstance(pool_fields, dict) or not isinstance(store_fields, dict):
        raise TraceFormatError('header needs objects "pool" and "store"')
    partial = record.get("partial", False)
    if type(partial) is not bool:
        raise TraceFormatError(f'header "partial" must be true or false, got {partial!r}')
    try:
        return PoolConfig(**pool_fields), StoreSpec(**store_fields), partial
    except (TypeError, ValueError) as error:
        raise TraceFormatError(f"header: {error}") from None


def loads(text: str) -> Trace:
    """Parse JSON-lines text written by :func:`dumps` (or by hand).

    Raises:
        TraceFormatError: Naming the 1-based line that is wrong and why.
    """
    numbered = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not numbered:
        raise TraceFormatError("empty trace: expected a header line")
    header_number, header_line = numbered[0]
    try:
        pool, store, partial = _decode_header(header_line)
    except TraceFormatError as error:
        raise TraceFormatError(f"line {header_number}: {error}") from None
    ops: list[Op] = []
    for number, line in numbered[1:]:
        try:
            ops.append(decode_op(line))
        except TraceFormatError as error:
            raise TraceFormatError(f"line {number}: {error}") from None
    return Trace(pool, store, tuple(ops), partial)


def load(path: str | Path) -> Trace:
    """Read a trace file written by :func:`save`.

    Raises:
        OSError: The file cannot be read (missing, a folder...).
        TraceFormatError: It is not a trace (including text that is not UTF-8).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"not UTF-8 text: {error}") from None
    return loads(text)


# -- recording a live history -------------------------------------------------------


def outcome_name(error: BaseException | None) -> str:
    """The ``expect`` value that records an outcome: ``"ok"`` or the error's class name."""
    return "ok" if error is None else type(error).__name__


@dataclass
class TraceRecorder:
    """Builds a trace from calls made on a real pool (e.g. by a stress run).

    Feed it each call with its outcome, in linearization order; it names every
    handle an ``allocate`` returned (by object identity, so stale handles keep
    their name) and writes the outcome into ``expect``, so that the replay
    checks that a sequential run reproduces it.

    Invariant: every handle named in a recorded op was returned by a recorded
    ``allocate``; ``call`` labels are 0, 1, 2... in recording order.
    """

    pool: PoolConfig
    store: StoreSpec = StoreSpec()
    ops: list[Op] = field(default_factory=list)
    # id(handle) -> (its name, the handle): the handle is kept so its id is never reused.
    _names: dict[int, tuple[HandleRef, Block]] = field(default_factory=dict, repr=False)
    _next_call: int = 0

    def trace(self) -> Trace:
        """The ops recorded so far, as a trace."""
        return Trace(self.pool, self.store, tuple(self.ops))

    def name_of(self, block: Block) -> HandleRef:
        """The trace name of ``block``.

        Raises:
            ValueError: ``block`` was not returned by a recorded ``allocate``.
        """
        entry = self._names.get(id(block))
        if entry is None or entry[1] is not block:
            raise ValueError(f"{block!r} was not returned by a recorded allocate")
        return entry[0]

    def allocate(
        self,
        stream: str,
        n_tokens: int,
        owner: int,
        format: str = "fp16",
        *,
        result: Sequence[Block] | BaseException,
    ) -> None:
        """Record ``allocate``; ``result`` is the returned list or the raised error."""
        call = self._next_call
        self._next_call += 1
        if isinstance(result, BaseException):
            self.ops.append(
                Allocate(call, stream, n_tokens, owner, format, expect=outcome_name(result))
            )
            return
        for position, block in enumerate(result):
            self._names[id(block)] = ((call, position), block)
        block_ids = tuple(block.block_id for block in result)
        self.ops.append(Allocate(call, stream, n_tokens, owner, format, block_ids, "ok"))

    def record(self, op: Op) -> None:
        """Record an op built by hand (use :meth:`name_of` for its handles)."""
        self.ops.append(op)

    def free(self, blocks: Sequence[Block], *, error: BaseException | None = None) -> None:
        """Record ``free(blocks)`` and its outcome (``error`` if it raised)."""
        handles = tuple(self.name_of(block) for block in blocks)
        self.ops.append(Free(handles, outcome_name(error)))

    def write(
        self,
        layer: int,
        block: Block,
        start: int,
        n_tokens: int,
        *,
        error: BaseException | None = None,
    ) -> None:
        """Record ``store.write`` of ``n_tokens`` tokens and its outcome."""
        self.ops.append(Write(layer, self.name_of(block), start, n_tokens, outcome_name(error)))
