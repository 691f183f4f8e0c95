"""Events as JSON, for reproducer files: :func:`event_to_json` and :func:`event_from_json`.

A call is ``{"op": kind, field: value...}``; a handle reference is
``[op_id, position]``, ``{"foreign": owner}`` or ``{"not_a_block": true}``;
``NotAList`` is ``{"not_a_list": true}``; tuples become lists and come back
as tuples (the form every recorded value has). An outcome is ``null``
(pending), ``{"returned": value}`` or ``{"raised": kind, "message": text}``.

Complexity: O(size of the event). Thread safety: pure functions.
"""

from __future__ import annotations

from dataclasses import fields

from veloxquant_mlx.stress.history import (
    CALL_CLASSES,
    Call,
    Event,
    Outcome,
    Raised,
    Ref,
    Returned,
)
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList

__all__ = ["event_from_json", "event_to_json"]


def _ref_to_json(ref: Ref) -> object:
    if isinstance(ref, ForeignBlock):
        return {"foreign": ref.owner}
    if isinstance(ref, NotABlock):
        return {"not_a_block": True}
    return list(ref)


def _ref_from_json(value: object) -> Ref:
    if isinstance(value, dict):
        if "foreign" in value:
            owner = value["foreign"]
            if owner is not None and type(owner) is not int:
                raise ValueError(f"a foreign block's owner must be an int or null, got {owner!r}")
            return ForeignBlock(owner)
        if value.get("not_a_block") is True:
            return NotABlock()
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        return (value[0], value[1])
    raise ValueError(f"expected a handle [op_id, position] or a foreign/junk marker, got {value!r}")


def _to_json(value: object) -> object:
    """Tuples (of tuples...) become lists; everything else is already JSON."""
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    return value


def _from_json(value: object) -> object:
    """Lists (of lists...) become tuples, the form every recorded value has."""
    if isinstance(value, list):
        return tuple(_from_json(item) for item in value)
    return value


def _call_to_json(call: Call) -> dict[str, object]:
    record: dict[str, object] = {"op": call.kind}
    for call_field in fields(call):
        value = getattr(call, call_field.name)
        if call_field.name == "handle":
            record["handle"] = _ref_to_json(value)
        elif call_field.name == "handles":
            if isinstance(value, NotAList):
                record["handles"] = {"not_a_list": True}
            else:
                record["handles"] = [_ref_to_json(ref) for ref in value]
        else:
            record[call_field.name] = _to_json(value)
    return record


def _call_from_json(record: dict[str, object]) -> Call:
    values = dict(record)
    kind = values.pop("op", None)
    cls = CALL_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"'op' must be one of {sorted(CALL_CLASSES)}, got {kind!r}")
    arguments: dict[str, object] = {}
    for name, value in values.items():
        if name == "handle":
            arguments[name] = _ref_from_json(value)
        elif name == "handles":
            if isinstance(value, dict) and value.get("not_a_list") is True:
                arguments[name] = NotAList()
            elif isinstance(value, list):
                arguments[name] = tuple(_ref_from_json(item) for item in value)
            else:
                raise ValueError(f"'handles' must be a list, got {value!r}")
        else:
            arguments[name] = _from_json(value)
    try:
        # Field kinds are checked where they matter: refs above, argument values by the spec.
        return cls(**arguments)  # type: ignore[arg-type]
    except TypeError as error:
        raise ValueError(f"op {kind!r}: {error}") from None


def event_to_json(event: Event) -> dict[str, object]:
    """One event as a JSON object (``call``, times, ``outcome``)."""
    outcome: object = None
    if isinstance(event.outcome, Returned):
        outcome = {"returned": _to_json(event.outcome.value)}
    elif isinstance(event.outcome, Raised):
        outcome = {"raised": event.outcome.kind, "message": event.outcome.message}
    return {
        "op_id": event.op_id,
        "thread": event.thread,
        "call": _call_to_json(event.call),
        "invoke_ns": event.invoke_ns,
        "return_ns": event.return_ns,
        "outcome": outcome,
    }


def _outcome_from_json(value: object) -> Outcome | None:
    if value is None:
        return None
    if isinstance(value, dict) and "returned" in value:
        return Returned(_from_json(value["returned"]))
    if isinstance(value, dict) and isinstance(value.get("raised"), str):
        message = value.get("message", "")
        return Raised(str(value["raised"]), message if isinstance(message, str) else "")
    raise ValueError(f"an outcome must be null, a 'returned' or a 'raised' object; got {value!r}")


def event_from_json(record: object) -> Event:
    """Parse what :func:`event_to_json` wrote.

    Raises:
        ValueError: Naming the field that is missing or malformed.
    """
    if not isinstance(record, dict):
        raise ValueError(f"an event must be a JSON object, got {record!r}")
    call = record.get("call")
    if not isinstance(call, dict):
        raise ValueError(f"an event needs a 'call' object, got {call!r}")
    ints = {name: record.get(name) for name in ("op_id", "thread", "invoke_ns")}
    for name, value in ints.items():
        if type(value) is not int:
            raise ValueError(f"event field {name!r} must be an int, got {value!r}")
    return_ns = record.get("return_ns")
    if return_ns is not None and type(return_ns) is not int:
        raise ValueError(f"event field 'return_ns' must be an int or null, got {return_ns!r}")
    return Event(
        op_id=int(record["op_id"]),
        thread=int(record["thread"]),
        call=_call_from_json(call),
        invoke_ns=int(record["invoke_ns"]),
        return_ns=return_ns,
        outcome=_outcome_from_json(record.get("outcome")),
    )
