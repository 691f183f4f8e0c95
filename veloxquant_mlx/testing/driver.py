"""The driver for our own pool: the JSON-lines protocol of docs/DRIVER_PROTOCOL.md, served.

``veloxquant-mlx driver [--factory module:callable]`` (also ``python -m
veloxquant_mlx.testing.driver``; :mod:`~veloxquant_mlx.testing.driver_command`)
reads one request per line on stdin and writes one response per line on
stdout, after a hello line (:func:`serve_lines`). It serves any Python port
the factory contract takes (docs/CONFORMANCE_KIT.md; default: our
``BlockPoolAllocator``): a port in another language ships its own driver
that speaks the same lines, and the kit drives it through
:mod:`~veloxquant_mlx.testing.driven`.

Nothing here knows one call from another: a request names an attribute of
an object the driver handed out (a pool, a block, a stats snapshot) by its
opaque ``ref``, and the names a pool offers are the operation table's
(:func:`~veloxquant_mlx_spec.table.declarations`). Objects are kept per
pool and dropped with it (``"drop"``).

Complexity: O(size of the request) per line, plus the call. Thread safety:
one thread serves one stream of requests, in order.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: Ctrl-C while the imports below load is one line too
    from veloxquant_mlx.commandline.sigint import run_program

    run_program("python -m veloxquant_mlx.testing.driver", "veloxquant_mlx.testing.driver_command")

import json
from collections.abc import Iterable, Sequence
from typing import IO, Any, Final, NoReturn

from veloxquant_mlx.commandline.bad_input import BadInputError
from veloxquant_mlx.testing.port import Port
from veloxquant_mlx.testing.sides import error_outcome
from veloxquant_mlx.testing.traces import finite_json_number

__all__ = ["PROTOCOL", "PROTOCOL_VERSION", "Driver", "serve_lines", "strict_json"]

PROTOCOL: Final = "veloxquant-mlx-driver"
PROTOCOL_VERSION: Final = 1
#: Values sent as they are (JSON's own); anything else is an object, sent as a ref.
_PLAIN: Final = (bool, int, float, str, type(None))


class Driver:
    """Serves requests on one port; ``objects`` holds every object handed out, by ref.

    Invariant: ``objects[ref]`` is the object a response named ``ref``, until the pool
    it belongs to (``owner_of[ref]``) is dropped.
    """

    def __init__(self, port: Port) -> None:
        self.port = port
        self.objects: dict[int, object] = {}
        self.owner_of: dict[int, int] = {}  # ref -> the ref of the pool it came from
        self.ref_of: dict[int, int] = {}  # id(object) -> its ref: one object, one ref
        self._next_ref = 1
        # The port's error classes -> the contract's names, if it gave them (else each
        # error is named by its own class, as the in-process kit names it).
        self._error_names = None if port.errors is None else port.error_names(None)

    def hello(self) -> dict[str, object]:
        """The first line: protocol, version and the calls this port offers."""
        offered = sorted(self.port.offered)
        return {"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "calls": offered}

    def _ref(self, value: object, pool: int) -> int:
        known = self.ref_of.get(id(value))
        if known is not None:
            return known
        ref, self._next_ref = self._next_ref, self._next_ref + 1
        self.objects[ref] = value
        self.owner_of[ref] = pool or ref
        self.ref_of[id(value)] = ref
        return ref

    def encode(self, value: object, pool: int) -> object:
        """A result as JSON: plain values as they are, lists as lists, objects as refs."""
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, Sequence):  # a list, or a history view: its items, in order
            return [self.encode(item, pool) for item in value]
        return {"ref": self._ref(value, pool)}

    def decode(self, value: object) -> object:
        """An argument from JSON: refs to their objects; ``tuple``/``bytes`` wrappers undone."""
        if isinstance(value, list):
            return [self.decode(item) for item in value]
        if isinstance(value, dict):
            if "ref" in value:
                return self.objects[value["ref"]]
            if "tuple" in value:
                return tuple(self.decode(item) for item in value["tuple"])
            if "bytes" in value:
                return bytes.fromhex(value["bytes"])
        return value

    def unknown_refs(self, request: dict[str, Any]) -> list[object]:
        """The refs ``request`` names (its ``on``, and in its ``args``) that this driver
        never handed out or has dropped."""
        named = [request["on"]] if "on" in request else []
        pending = list(request.get("args", []))
        while pending:
            item = pending.pop()
            if isinstance(item, list):
                pending += item
            elif isinstance(item, dict):
                if "ref" in item:
                    named.append(item["ref"])
                pending += item.get("tuple", []) if isinstance(item.get("tuple"), list) else []
        return [ref for ref in named if not isinstance(ref, int) or ref not in self.objects]

    def serve(self, request: dict[str, Any]) -> object:
        """The result of one request (see docs/DRIVER_PROTOCOL.md)."""
        op = request["op"]
        if op == "pool":
            config = self.port.make_config(**request["config"])
            made = self.port.build(config, request.get("history_len"))
            return {"ref": self._ref(made, 0)}
        if op == "block":
            ref = self._ref(self.port.block_class(request["block_id"]), 0)
            return {"ref": ref}
        if op == "drop":
            dropped = request["ref"]
            for ref in [r for r, owner in self.owner_of.items() if owner == dropped]:
                del self.ref_of[id(self.objects.pop(ref))], self.owner_of[ref]
            return None
        target, pool = self.objects[request["on"]], self.owner_of[request["on"]]
        if op == "get":
            value = getattr(target, request["name"])
            if callable(value) and not isinstance(value, _PLAIN):
                return {"callable": True}  # a method: called with "call"
            return self.encode(value, pool)
        if op == "call":
            arguments = [self.decode(argument) for argument in request.get("args", [])]
            return self.encode(getattr(target, request["name"])(*arguments), pool)
        raise ValueError(f"unknown op {op!r}; expected pool, block, drop, get or call")

    def respond(self, request: dict[str, Any]) -> dict[str, object]:
        """The response to one request; a port's error is named as the in-process kit
        names it: its class's name, or the contract name the port's ``errors`` map gives."""
        answer: dict[str, object] = {"id": request.get("id")}
        try:
            answer["result"] = self.serve(request)
        except Exception as error:  # every error is an answer; the kit compares its class
            kind = error_outcome(error, self._error_names).kind
            answer["error"] = {"class": kind, "message": str(error)}
        return answer


def serve_lines(port: Port, lines: Iterable[bytes], out: IO[str]) -> None:
    """Serve ``lines`` (raw bytes, one request each) until they end: the hello, then one
    response per request.

    Raises:
        BadInputError: A line is not UTF-8 text or not a JSON object (the client does
            not speak the protocol); the responses before it were sent.
    """
    driver = Driver(port)
    out.write(json.dumps(driver.hello()) + "\n")
    out.flush()
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            request = _request(raw, number)
            _require_protocol_fields(request, number)
            unknown = driver.unknown_refs(request)
            if unknown:
                raise BadInputError(
                    f"request line {number} ({request['op']}) names ref(s) {unknown}, which "
                    "this driver never handed out or has dropped"
                )
            out.write(json.dumps(driver.respond(request)) + "\n")
            out.flush()


#: The fields each op's request must carry, with their JSON types (docs/DRIVER_PROTOCOL.md).
_REQUEST_FIELDS: Final[dict[str, dict[str, type]]] = {
    "pool": {"config": dict},
    "block": {"block_id": int},
    "drop": {"ref": int},
    "get": {"on": int, "name": str},
    "call": {"on": int, "name": str, "args": list},
}


#: The underscored names of the API (docs/API.md): the reference's stats field.
_PRIVATE_API: Final = frozenset({"_fragmented_count"})
#: How docs/DRIVER_PROTOCOL.md names the JSON types of the fields.
_JSON_NAMES: Final = {dict: "object", int: "int", str: "string", list: "list"}


def _require_protocol_fields(request: dict[str, Any], number: int) -> None:
    """Refuse a request the protocol has no answer for: an unknown op, a field missing or
    of the wrong type, or a private or special name (``_lock``, ``__init__``) to get or
    call; the reference's one underscored name, ``_fragmented_count``, is served."""
    request_id = request.get("id")
    if type(request_id) is not int:  # the response carries it back; true is not 1 here
        raise BadInputError(f"request line {number} has id {request_id!r}; expected a JSON int")
    op = request.get("op")
    fields = _REQUEST_FIELDS.get(op) if isinstance(op, str) else None
    if fields is None:
        raise BadInputError(
            f"request line {number} has op {op!r}; expected one of {', '.join(_REQUEST_FIELDS)}"
        )
    for name, kind in fields.items():
        value = request.get(name, [] if name == "args" else None)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadInputError(
                f"request line {number} ({op}) has {name} {value!r}; expected a JSON "
                f"{_JSON_NAMES[kind]}"
            )
    history_len = request.get("history_len")
    if op == "pool" and history_len is not None and type(history_len) is not int:
        raise BadInputError(
            f"request line {number} (pool) has history_len {history_len!r}; expected a "
            "JSON int or null"
        )
    name = str(request.get("name", ""))
    if name.startswith("_") and name not in _PRIVATE_API:
        raise BadInputError(
            f"request line {number} ({op}) names {name!r}; expected an attribute of the "
            "pool API, not a private or special one"
        )


def strict_json(text: str | bytes) -> Any:
    """``json.loads`` of JSON alone: ``NaN``, ``Infinity`` and numbers past a float's
    range (``1e400`` would read as ``inf``) are refused, as JSON does not have them.

    Raises:
        ValueError: Not JSON (``json.JSONDecodeError``), or one of those values.
        RecursionError: Arrays or objects nested past the parser.
    """
    return json.loads(text, parse_constant=_refuse_constant, parse_float=finite_json_number)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _request(raw: bytes, number: int) -> dict[str, Any]:
    """Request line ``number`` as a JSON object, or the bad input it is."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        why = f"request line {number} is not UTF-8 text ({error.reason}): {raw.strip()[:80]!r}"
        raise BadInputError(why) from None
    shown = repr(text.strip()[:80])
    try:
        request = strict_json(text)
    except RecursionError:
        raise BadInputError(f"request line {number} is nested too deeply to read") from None
    except json.JSONDecodeError as error:
        raise BadInputError(f"request line {number} is not JSON ({error.msg}): {shown}") from None
    except ValueError as error:  # an int of over 4,300 digits, NaN, Infinity, 1e400
        raise BadInputError(f"request line {number} cannot be read ({error})") from None
    if not isinstance(request, dict):
        raise BadInputError(
            f"request line {number} must be a JSON object, got {type(request).__name__}: {shown}"
        )
    return request
