"""The one trace format: JSON lines of operation-table calls, with what each did.

A Hypothesis failure, an exhaustive counterexample, a stress history (its
linearized trace and its reproducers) and an aliasing-replay input are all
a :class:`Trace`: a pool configuration, a store shape, and lines, each one
call of the operation table (``veloxquant_mlx_spec.operations``, or a store
call of :mod:`~veloxquant_mlx.testing.store_operations`) with its label and,
if recorded, its outcome and timing. Any of them replays with one command on
the spec, on a pool or on a store (``veloxquant-mlx replay``). The codec derives every line from
the call's declaration: it has no per-call code.

The grammar is docs/TRACE_FORMAT.md: a header line (``"trace":
"veloxquant-mlx", "version": 2``, the pool's config, ``history_len``, the
store's shape, ``"partial"``), then one JSON object per call: ``op``, its
parameters by name (a handle is ``[call, position]``; ``{"foreign": owner}``,
``{"hand_made": true}``, ``{"not_a_block": true}``, ``{"tuple": [...]}``,
``{"not_a_list": true}`` and ``{"bytes": hex}`` encode the rest), ``call``,
``expect``/``returned``/``message``, ``shows`` (what each handle a call handed
out showed when it returned), and ``thread``/``invoke_ns``/``return_ns`` on a
timed line. Version 1 traces load, upgraded; any other JSON (a v1
stress reproducer, an ``exhaustive --json`` report) is refused with the
format expected.

Complexity: O(size of the line) to encode or decode. Thread safety: the
functions are pure; a :class:`TraceRecorder` is not locked (feed it from one
thread, in linearization order).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, BinaryIO, Final

import veloxquant_mlx.testing.store_operations  # noqa: F401 -- declares the store calls
from veloxquant_mlx.commandline.files import atomic_write_text
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.testing.sides import HANDLE_FIELDS, error_outcome, pool_outcome
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.table import (
    ANY_VALUE,
    ArgKind,
    AsTuple,
    Declaration,
    Handle,
    HandleRef,
    Outcome,
    Raised,
    Returned,
    Returns,
    declaration_named,
    declaration_of,
    declarations,
    handle_names,
    returned_blocks,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "SHOWN_FIELDS",
    "Shown",
    "StoreSpec",
    "Trace",
    "TraceFormatError",
    "TraceLine",
    "TraceRecorder",
    "TraceTooLongError",
    "decode_line",
    "dumps",
    "encode_header",
    "encode_line",
    "finite_json_number",
    "load",
    "loads",
    "save",
]

FORMAT_NAME: Final = "veloxquant-mlx"
FORMAT_VERSION: Final = 2
_V1_RENAMES: Final = {"handles": "blocks", "handle": "block"}
#: What a line's ``shows`` holds per handle it handed out, in this order: every field of a
#: ``Block`` but ``block_id`` (which ``returned`` holds).
SHOWN_FIELDS: Final = HANDLE_FIELDS[1:]
Shown = tuple[tuple[object, ...], ...]
"""Per handle a call handed out (in ``returned``'s order), its :data:`SHOWN_FIELDS` values."""


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
class TraceLine:
    """One call: the operation, its label, what it did (or must do), and when, if timed.

    ``outcome`` ``None``: not recorded (so not checked), or, on a timed line
    with ``return_ns`` ``None``, a call that never returned (it may or may
    not have taken effect). ``shows``: with a ``Returned`` outcome of a call
    that hands out handles, what each handle it returned showed just after it
    returned (:data:`SHOWN_FIELDS`); ``None``: not recorded.
    """

    op: object
    call: int | None = None
    outcome: Outcome | None = None
    thread: int | None = None
    invoke_ns: int | None = None
    return_ns: int | None = None
    shows: Shown | None = None

    @property
    def timed(self) -> bool:
        """Whether the line has an interval (it belongs to a concurrent window)."""
        return self.invoke_ns is not None

    @property
    def pending(self) -> bool:
        """Whether the call never returned (in this history)."""
        return self.invoke_ns is not None and self.return_ns is None

    def untimed(self) -> TraceLine:
        """This line without its thread and interval: a call of a sequential replay."""
        return TraceLine(self.op, self.call, self.outcome, shows=self.shows)


@dataclass(frozen=True, slots=True)
class Trace:
    """A pool configuration, a store shape, and the lines to apply, in order.

    ``partial`` marks the beginning of a longer history (module docstring).
    ``file_lines``: the line of its file each of ``lines`` was read from, for
    messages; empty for a trace not read from a file.
    """

    pool: PoolConfig
    store: StoreSpec = StoreSpec()
    lines: tuple[TraceLine, ...] = ()
    history_len: int = 0
    partial: bool = False
    file_lines: tuple[int, ...] = field(default=(), compare=False)

    def with_lines(self, lines: Iterable[TraceLine]) -> Trace:
        """This trace with its lines replaced (and so no file lines)."""
        return replace(self, lines=tuple(lines), file_lines=())

    def file_line(self, position: int) -> int:
        """The file line of ``lines[position]``: where it was read, or where
        :func:`save` writes it (after the header, one a line)."""
        return self.file_lines[position] if self.file_lines else position + 2


# -- values, references, outcomes -----------------------------------------------------------


def _value_to_json(value: object) -> object:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceFormatError(f"a value must be finite to be written, got {value!r}")
    if isinstance(value, tuple):
        return [_value_to_json(item) for item in value]
    return value


def _value_from_json(name: str, value: object) -> object:
    if isinstance(value, dict):
        if set(value) == {"bytes"} and isinstance(value["bytes"], str):
            try:
                return bytes.fromhex(value["bytes"])
            except ValueError:
                pass
        raise TraceFormatError(f"field {name!r}: expected a JSON value or bytes, got {value!r}")
    if isinstance(value, list):
        return tuple(_value_from_json(name, item) for item in value)
    return value


def _ref_to_json(ref: object) -> object:
    if isinstance(ref, Handle):
        return [ref.call, ref.position]
    if isinstance(ref, ForeignBlock):
        return {"hand_made": True} if ref.owner is None else {"foreign": ref.owner}
    if isinstance(ref, NotABlock):
        return {"not_a_block": True}
    raise TraceFormatError(f"{ref!r} is not a handle reference")


def _int(name: str, value: object) -> int:
    if type(value) is not int:
        raise TraceFormatError(f"field {name!r} must be an int, got {value!r}")
    return value


def _ref_from_json(name: str, value: object) -> HandleRef:
    if isinstance(value, list) and len(value) == 2:
        return Handle(_int(name, value[0]), _int(name, value[1]))
    if value in ({"hand_made": True}, {"foreign": None}):
        return ForeignBlock(None)
    if isinstance(value, dict) and set(value) == {"foreign"}:
        return ForeignBlock(_int(name, value["foreign"]))
    if value == {"not_a_block": True}:
        return NotABlock()
    raise TraceFormatError(
        f'field {name!r} must be a handle [call, position], {{"foreign": owner}}, '
        f'{{"hand_made": true}} or {{"not_a_block": true}}, got {value!r}'
    )


def _refs_to_json(value: object) -> object:
    if isinstance(value, NotAList):
        return {"not_a_list": True}
    if isinstance(value, AsTuple):
        return {"tuple": [_ref_to_json(ref) for ref in value.refs]}
    assert isinstance(value, tuple), "a list of handles is a tuple of references"
    return [_ref_to_json(ref) for ref in value]


def _refs_from_json(name: str, value: object) -> object:
    if value == {"not_a_list": True}:
        return NotAList()
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return AsTuple(tuple(_ref_from_json(name, item) for item in value["tuple"]))
    if isinstance(value, list):
        return tuple(_ref_from_json(name, item) for item in value)
    raise TraceFormatError(
        f'field {name!r} must be a list of handles, {{"tuple": [...]}} or '
        f'{{"not_a_list": true}}, got {value!r}'
    )


#: How an argument of each kind is written, and read back (the field's name is for errors).
_Codec = tuple[Callable[[object], object], Callable[[str, object], object]]
_ARGUMENT_JSON: Final[dict[ArgKind, _Codec]] = {
    ArgKind.VALUE: (_value_to_json, _value_from_json),
    ArgKind.HANDLE: (_ref_to_json, _ref_from_json),
    ArgKind.HANDLES: (_refs_to_json, _refs_from_json),
}


def _returned_to_json(value: object) -> object:
    if isinstance(value, Handle):
        return [value.call, value.position]
    if isinstance(value, tuple):
        return [_returned_to_json(item) for item in value]
    return _value_to_json(value)  # as a value: bytes as hex, a NaN refused (unloadable)


def _returned_from_json(declaration: Declaration, value: object) -> object:
    """A ``returned`` field, in the form ``Returns`` gives it (tuples, names)."""
    returns = declaration.returns
    if returns is Returns.HANDLES and isinstance(value, list):
        return tuple(_ref_from_json("returned", item) for item in value)
    if returns is Returns.METRICS and isinstance(value, list):
        return tuple((str(pair[0]), float(pair[1])) for pair in value if isinstance(pair, list))
    return _value_from_json("returned", value)


def _outcome_to_json(declaration: Declaration, outcome: Outcome, record: dict[str, object]) -> None:
    if isinstance(outcome, Raised):
        record["expect"] = outcome.kind
        if outcome.message:
            record["message"] = outcome.message
        return
    record["expect"] = "ok"
    if outcome.value is not ANY_VALUE and declaration.returns is not Returns.NOTHING:
        record["returned"] = _returned_to_json(outcome.value)


def _outcome_from_json(declaration: Declaration, record: dict[str, Any]) -> Outcome | None:
    expect = record.pop("expect", None)
    returned = record.pop("returned", ANY_VALUE)
    message = record.pop("message", "")
    if expect is None:
        if returned is not ANY_VALUE:
            raise TraceFormatError('field \'returned\' needs "expect": "ok"')
        return None
    if not isinstance(expect, str):
        raise TraceFormatError(f"field 'expect' must be a string, got {expect!r}")
    if expect != "ok":
        if returned is not ANY_VALUE:
            raise TraceFormatError(f"field 'returned' contradicts \"expect\": {expect!r}")
        return Raised(expect, message if isinstance(message, str) else "")
    if declaration.returns is Returns.NOTHING:
        return Returned(None)
    if returned is ANY_VALUE:
        return Returned(ANY_VALUE)
    return Returned(_returned_from_json(declaration, returned))


# -- lines ----------------------------------------------------------------------------------

_TIMING: Final = ("thread", "invoke_ns", "return_ns")


def encode_line(line: TraceLine) -> str:
    """One line as JSON (no newline); absent fields are left out."""
    declaration = declaration_of(line.op)
    record: dict[str, object] = {"op": declaration.name}
    if line.call is not None:
        record["call"] = line.call
    arguments = declaration.arguments(line.op)
    for parameter, value in zip(declaration.parameters, arguments, strict=True):
        record[parameter.name] = _ARGUMENT_JSON[parameter.kind][0](value)
    if line.outcome is not None:
        _outcome_to_json(declaration, line.outcome, record)
    if line.shows is not None and isinstance(line.outcome, Returned):
        record["shows"] = [[_value_to_json(value) for value in row] for row in line.shows]
    if line.timed:
        record.update(thread=line.thread, invoke_ns=line.invoke_ns, return_ns=line.return_ns)
    return json.dumps(record, separators=(",", ":"))


def _op_from_json(declaration: Declaration, record: dict[str, Any]) -> object:
    arguments: list[object] = []
    for parameter in declaration.parameters:
        if parameter.name not in record:
            if parameter.default is MISSING:
                raise TraceFormatError(f"op {declaration.name!r} needs field {parameter.name!r}")
            arguments.append(parameter.default)
            continue
        value = record.pop(parameter.name)
        arguments.append(_ARGUMENT_JSON[parameter.kind][1](parameter.name, value))
    return declaration.op(*arguments)


def _upgrade_v1(record: dict[str, Any]) -> None:
    """A version 1 line in place: ``read`` is ``gather``, fields take the API's names."""
    if record.get("op") == "read":
        record["op"] = "gather"
    for old, new in _V1_RENAMES.items():
        if old in record:
            record[new] = record.pop(old)
    for recorded in ("block_ids", "retired"):
        if recorded in record:
            record["returned"] = record.pop(recorded)
            record.setdefault("expect", "ok")


def decode_line(text: str, *, version: int = FORMAT_VERSION) -> TraceLine:
    """Parse one JSON line (of a trace of ``version``) into a :class:`TraceLine`.

    Raises:
        TraceFormatError: Not JSON, not an object, unknown op or field, a field of
            the wrong type, or a required field missing.
    """
    record = _parse_json(text, "not JSON")
    if not isinstance(record, dict):
        raise TraceFormatError(f"a line must be a JSON object, got {record!r}")
    if version == 1:
        _upgrade_v1(record)
    name = record.pop("op", None)
    declaration = declaration_named(name) if isinstance(name, str) else None
    if declaration is None:
        known = sorted(d.name for d in declarations(None))
        raise TraceFormatError(f"'op' must be one of {known}, got {name!r}")
    call = record.pop("call", None)
    if call is not None:
        _int("call", call)
    elif declaration.may_issue_handles:
        raise TraceFormatError(f"op {name!r} hands out handles: it needs a 'call' label")
    op = _op_from_json(declaration, record)
    outcome = _outcome_from_json(declaration, record)
    shows = _shows_from_json(declaration, outcome, record) if "shows" in record else None
    timing = {key: record.pop(key) for key in _TIMING if key in record}
    if record:
        allowed = sorted(
            {"op", "call", "expect", "returned", "message", *_TIMING}
            | ({"shows"} if declaration.may_issue_handles else set())
            | {p.name for p in declaration.parameters}
        )
        raise TraceFormatError(f"op {name!r} has no field(s) {sorted(record)}; it has {allowed}")
    return TraceLine(op, call, outcome, shows=shows, **_timing(timing))


def _shows_from_json(
    declaration: Declaration, outcome: Outcome | None, record: dict[str, Any]
) -> Shown | None:
    """A line's ``shows``: one row of :data:`SHOWN_FIELDS` per handle ``returned`` holds."""
    if not declaration.may_issue_handles:
        return None  # left in the record: refused as a field the call does not have
    value = record.pop("shows")
    if not isinstance(outcome, Returned):
        raise TraceFormatError('field \'shows\' needs "expect": "ok"')
    expected = f"[{', '.join(SHOWN_FIELDS)}]"
    if not isinstance(value, list) or not all(
        isinstance(row, list) and len(row) == len(SHOWN_FIELDS) for row in value
    ):
        raise TraceFormatError(
            f"field 'shows' must be a list of {expected}, one per handle returned, "
            f"got {str(value)[:120]}"
        )
    returned = outcome.value
    count = len(returned) if isinstance(returned, tuple) else 1 if type(returned) is int else None
    if count is not None and count != len(value):
        raise TraceFormatError(
            f"field 'shows' has {len(value)} row(s), 'returned' {count} handle(s); expected "
            f"one {expected} per handle returned"
        )
    return tuple(tuple(_value_from_json("shows", item) for item in row) for row in value)


def _timing(fields: dict[str, object]) -> dict[str, int | None]:
    if not fields:
        return {}
    if set(fields) != set(_TIMING):
        raise TraceFormatError(f"a timed line needs all of {list(_TIMING)}, got {sorted(fields)}")
    invoke_ns = _int("invoke_ns", fields["invoke_ns"])
    return_ns = None if fields["return_ns"] is None else _int("return_ns", fields["return_ns"])
    if return_ns is not None and return_ns < invoke_ns:
        raise TraceFormatError(
            f"return_ns must be >= invoke_ns ({invoke_ns}): a call returns after it starts, "
            f"got {return_ns}"
        )
    return {
        "thread": _int("thread", fields["thread"]),
        "invoke_ns": invoke_ns,
        "return_ns": return_ns,
    }


# -- headers and files ------------------------------------------------------------------------

_HEADER_KEYS: Final = frozenset(
    {"trace", "version", "pool", "store", "history_len", "partial", "lines"}
)


def encode_header(trace: Trace, *, n_lines: int | None = None) -> str:
    """The header line of ``trace`` (no newline); with ``n_lines``, the number of call
    lines that follow it, so that a file cut short at a line's end is refused."""
    header: dict[str, object] = {
        "trace": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "pool": {f.name: getattr(trace.pool, f.name) for f in fields(trace.pool)},
        "history_len": trace.history_len,
        "store": {f.name: getattr(trace.store, f.name) for f in fields(trace.store)},
    }
    if trace.partial:
        header["partial"] = True
    if n_lines is not None:
        header["lines"] = n_lines
    return json.dumps(header, separators=(",", ":"))


def dumps(trace: Trace) -> str:
    """The whole trace as JSON-lines text: the header (with the count of lines), then one
    line per call."""
    header = encode_header(trace, n_lines=len(trace.lines))
    return "\n".join([header, *map(encode_line, trace.lines)]) + "\n"


def save(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` to ``path`` as JSON lines (UTF-8), atomically."""
    atomic_write_text(Path(path), dumps(trace))


def _parse_json(text: str, what: str) -> object:
    """``json.loads(text)``; whatever it refuses is a :class:`TraceFormatError` saying ``what``.

    Besides malformed JSON, that is an integer of more digits than Python
    converts (``ValueError``), a number that is not finite (``NaN``,
    ``Infinity`` or ``1e400``: the writer never writes one), and arrays nested
    deeper than the parser recurses (``RecursionError``): bad input, never a
    traceback.
    """
    try:
        return json.loads(text, parse_float=finite_json_number, parse_constant=finite_json_number)
    except _NotFiniteError as error:  # JSON, but not a number a trace can hold
        raise TraceFormatError(str(error)) from None
    except RecursionError:
        raise TraceFormatError(f"{what}: nested too deeply to read") from None
    except ValueError as error:  # JSONDecodeError, or an int of over 4,300 digits
        raise TraceFormatError(f"{what}: {error}") from None


class _NotFiniteError(ValueError):
    """A number that is not finite, met while parsing."""


def finite_json_number(text: str) -> float:
    """A JSON number's text with a fraction or an exponent (or ``NaN``, ``Infinity``) as
    a float, for ``json.loads``; refused unless finite (``1e400`` reads as ``inf``).

    Raises:
        ValueError: It is not finite (named, as ``a number must be finite, got TEXT``).
    """
    value = float(text)
    if not math.isfinite(value):
        raise _NotFiniteError(f"a number must be finite, got {text}")
    return value


def _not_a_trace(record: object, line: str) -> TraceFormatError:
    expected = f'a header {{"trace": "{FORMAT_NAME}", "version": {FORMAT_VERSION}, ...}}'
    if isinstance(record, dict) and record.get("reproducer") == "veloxquant-mlx-linearizability":
        return TraceFormatError(
            "a veloxquant-mlx-linearizability v1 reproducer: this version replays trace "
            f"files (JSON lines, first line {expected}); rerun the stress run that wrote it"
        )
    if isinstance(record, list):
        return TraceFormatError(f"a JSON array (an exhaustive --json report?), expected {expected}")
    return TraceFormatError(f"expected {expected}, got {line[:120]!r}")


def _decode_header(line: str) -> tuple[Trace, int, int | None]:
    """The header's trace (no lines yet), its format version, and its count of lines."""
    record = _parse_json(line, "header is not JSON")
    if not isinstance(record, dict) or record.get("trace") != FORMAT_NAME:
        raise _not_a_trace(record, line)
    version = record.get("version")
    if version not in (1, FORMAT_VERSION):
        raise TraceFormatError(
            f"trace version {version!r} is not supported; expected {FORMAT_VERSION} (or 1)"
        )
    unknown = sorted(set(record) - _HEADER_KEYS)
    if unknown:
        raise TraceFormatError(
            f"header has unknown key(s) {unknown}; expected {sorted(_HEADER_KEYS)}"
        )
    pool_fields, store_fields = record.get("pool"), record.get("store", {})
    if not isinstance(pool_fields, dict) or not isinstance(store_fields, dict):
        raise TraceFormatError('header needs an object "pool" (and "store", if given)')
    partial, history_len = record.get("partial", False), record.get("history_len", 0)
    if type(partial) is not bool:
        raise TraceFormatError(f'header "partial" must be true or false, got {partial!r}')
    if type(history_len) is not int or not 0 <= history_len <= sys.maxsize:
        raise TraceFormatError(  # past sys.maxsize no pool can keep a history that long
            f'header "history_len" must be an int from 0 to {sys.maxsize}, got {history_len!r}'
        )
    n_lines = record.get("lines")
    if n_lines is not None and (type(n_lines) is not int or n_lines < 0):
        raise TraceFormatError(f'header "lines" must be an int >= 0, got {n_lines!r}')
    try:
        pool, store = PoolConfig(**pool_fields), StoreSpec(**store_fields)
    except (TypeError, ValueError) as error:
        raise TraceFormatError(f"header: {error}") from None
    return Trace(pool, store, (), history_len, partial), version, n_lines


def loads(text: str) -> Trace:
    """Parse JSON-lines text written by :func:`dumps` (or by hand, or of version 1).

    Raises:
        TraceFormatError: Naming the 1-based line that is wrong and why.
    """
    numbered = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not numbered:
        raise TraceFormatError("empty trace: expected a header line")
    header_number, header_line = numbered[0]
    try:
        trace, version, n_lines = _decode_header(header_line)
    except TraceFormatError as error:
        raise _one_document(text) or TraceFormatError(f"line {header_number}: {error}") from None
    lines: list[TraceLine] = []
    labelled: dict[int, int] = {}  # call label -> the line that has it
    for number, line in numbered[1:]:
        try:
            decoded = decode_line(line, version=version)
        except TraceFormatError as error:
            raise TraceFormatError(f"line {number}: {error}") from None
        if decoded.call is not None:
            first = labelled.setdefault(decoded.call, number)
            if first != number:
                raise TraceFormatError(
                    f"line {number}: call label {decoded.call} is already line {first}'s; "
                    "expected labels distinct in the file"
                )
        lines.append(decoded)
    numbers = tuple(number for number, _ in numbered[1:])
    if n_lines is not None and n_lines != len(lines):
        raise TraceFormatError(
            f"line {header_number}: the header counts {n_lines:,} call lines, the file holds "
            f"{len(lines):,}; expected the whole file (cut short, or written to after?). To "
            'replay the lines it holds, take "lines" out of the header'
        )
    if not trace.partial:  # a partial trace may name handles of calls it does not hold
        _require_issued_names(numbers, lines)
    return replace(trace.with_lines(lines), file_lines=numbers)


def _require_issued_names(numbers: Sequence[int], lines: Sequence[TraceLine]) -> None:
    """Refuse a line that names a handle no line of the trace can have handed out.

    The label must be a line's whose call hands out handles and did not raise,
    and that comes before: before the line itself if it is untimed (untimed
    lines apply in file order), before or inside its window if it is timed (a
    concurrent window's timed lines come in no particular order).
    """
    issuers = {
        line.call: index
        for index, line in enumerate(lines)
        if line.call is not None
        and declaration_of(line.op).may_issue_handles
        and not isinstance(line.outcome, Raised)
    }
    for index, (line, end) in enumerate(zip(lines, _window_ends(lines), strict=True)):
        for name in handle_names(line.op):
            issuer = issuers.get(name.call)
            if issuer is None or issuer >= end:
                where = "its window or an earlier line" if line.timed else "an earlier line"
                raise TraceFormatError(
                    f"line {numbers[index]}: names handle {name!r} (call {name.call}, "
                    f"block {name.position}), but no call of the trace handed it out before; "
                    f"expected the label of {where} whose call hands out handles"
                )


def _window_ends(lines: Sequence[TraceLine]) -> list[int]:
    """Per line, the index its issuers must come before: its own for an untimed line, the
    end of its window (the maximal run of timed lines holding it) for a timed one."""
    ends = list(range(len(lines)))
    end = len(lines)
    for index in reversed(range(len(lines))):
        if not lines[index].timed:
            end = index
        else:
            ends[index] = end
    return ends


def _one_document(text: str) -> TraceFormatError | None:
    """Why ``text``, read as one JSON document, is another kind of file; ``None`` if it is not.

    A version 1 reproducer or an ``exhaustive --json`` report is one document,
    indented over many lines or compact on one: whichever, it is named.
    """
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(record, dict) and record.get("trace") == FORMAT_NAME:
        return None  # a trace's own header: its error is the line's
    if isinstance(record, list) or (isinstance(record, dict) and "reproducer" in record):
        return _not_a_trace(record, text)
    return None


class TraceTooLongError(ValueError):
    """A trace file holds more than the bytes :func:`load` was allowed to read."""


def load(path: str | Path, *, max_bytes: int | None = None) -> Trace:
    """Read a trace file written by :func:`save`, reading at most ``max_bytes`` + 1 bytes
    if given (a pipe or a device has no size to check first).

    Raises:
        OSError: The file cannot be read (missing, a folder...).
        TraceFormatError: It is not a trace (including text that is not UTF-8).
        TraceTooLongError: It holds more than ``max_bytes`` bytes.
    """
    with Path(path).open("rb") as file:
        data = file.read() if max_bytes is None else _read_at_most(file, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"not UTF-8 text: {error}") from None
    return loads(text)


#: Bytes per read of a bounded load: ``read(n)`` reserves all ``n`` bytes at once.
_CHUNK_BYTES: Final = 1 << 20


def _read_at_most(file: BinaryIO, max_bytes: int) -> bytes:
    """The file's bytes, a chunk at a time (so a small file costs small reads).

    Raises:
        TraceTooLongError: It holds more than ``max_bytes`` (one byte past is read).
    """
    chunks: list[bytes] = []
    total = 0
    while chunk := file.read(min(_CHUNK_BYTES, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise TraceTooLongError(f"more than {max_bytes:,} bytes")
    return b"".join(chunks)


# -- recording a live session --------------------------------------------------------------


@dataclass
class TraceRecorder:
    """Builds a trace from calls made on a real pool (a session, a stress run).

    Feed it each call with what it returned or raised, in linearization
    order; it labels the calls 0, 1, 2..., names every handle a call handed
    out (by object identity, so stale handles keep their name), and records
    the outcome, so that a replay checks that a sequential run reproduces it.

    Invariant: every handle named in a recorded line was handed out by a
    recorded call.
    """

    pool: PoolConfig
    store: StoreSpec = StoreSpec()
    history_len: int = 0
    lines: list[TraceLine] = field(default_factory=list)
    # id(handle) -> (its name, the handle): the handle is kept so its id is never reused.
    _names: dict[int, tuple[Handle, object]] = field(default_factory=dict, repr=False)

    def trace(self) -> Trace:
        """The lines recorded so far, as a trace."""
        return Trace(self.pool, self.store, tuple(self.lines), self.history_len)

    def name_of(self, block: object) -> Handle:
        """The trace name of ``block``.

        Raises:
            ValueError: ``block`` was not handed out by a recorded call.
        """
        if not self._named(block):
            raise ValueError(f"{block!r} was not handed out by a recorded call")
        return self._names[id(block)][0]

    def record(
        self, op: object, result: object = None, *, error: BaseException | None = None
    ) -> None:
        """Record ``op`` (its handles named with :meth:`name_of`) and what it did."""
        call = len(self.lines)
        if error is not None:
            outcome: Outcome = Raised(error_outcome(error).kind)
        else:
            outcome = pool_outcome(op, result, self.name_of)
            declaration = declaration_of(op)
            handed_out = returned_blocks(declaration, result)
            if declaration.returns is Returns.HANDLE and self._named(result):
                handed_out = []  # make_writable returned its argument: it keeps its name
            for position, block in enumerate(handed_out):
                self._names[id(block)] = (Handle(call, position), block)
        self.lines.append(TraceLine(op, call, outcome))

    def _named(self, block: object) -> bool:
        entry = self._names.get(id(block))
        return entry is not None and entry[1] is block

    def call(self, make: Callable[[], object], op: object) -> object:
        """Make a call (``make()``) and record it as ``op``; its result, or it re-raises."""
        try:
            result = make()
        except Exception as error:
            self.record(op, error=error)
            raise
        self.record(op, result)
        return result

    def names(self, blocks: Sequence[object]) -> tuple[Handle, ...]:
        """The names of ``blocks``, for a call to record that takes them."""
        return tuple(map(self.name_of, blocks))
