"""A port in any language, driven as a child process: the client of docs/DRIVER_PROTOCOL.md.

:func:`driven_port` starts a driver (``veloxquant-mlx driver`` for our pool;
a Rust, C++ or Swift port ships its own) and returns a
:class:`~veloxquant_mlx.testing.port.Port` whose pools, blocks and stats
snapshots are proxies of the driver's objects, so the conformance kit
(``conformance_test_case``, ``conformance_report``) and the exhaustive checker
take it like any Python port::

    port = driven_port(["./target/release/my-pool-driver"])
    TestMyPool = conformance_test_case(port)

Every attribute read and call is one request line and one response line.
A pool's calls are the operation table's names; a port's error comes back as
its contract class name and is raised here as the class of that name
(:data:`ERRORS`, with the contract's bases). A driver that cannot be started, exits,
writes something that is not a response, or does not answer within
``timeout`` seconds raises :class:`DriverFailure`, a ``BaseException``: the
kit records an exception from a pool as the pool's outcome, and a broken
driver must end the run with one clear message instead. The driver's stderr
goes to a temporary file (a pipe nobody reads would block a driver that
logs much); the message quotes its last line.

Complexity: one round trip per attribute read or call (a method's name is asked
once per object: a ``get`` says it is one). Thread safety: none;
one thread drives one :class:`DriverProcess`.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import IO, Any, Final, NoReturn

from veloxquant_mlx.testing.driver import PROTOCOL, PROTOCOL_VERSION, strict_json
from veloxquant_mlx.testing.port import CONFIG_DEFAULTS, Port

__all__ = [
    "ERRORS",
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "DriverFailure",
    "DriverProcess",
    "InvalidFreeError",
    "OwnerAlreadyActiveError",
    "RemoteObject",
    "driven_port",
]


class DriverFailure(BaseException):
    """The driver died, wrote junk or answered late; no pool outcome, the run ends."""


class BlockPoolError(RuntimeError):
    """A contract error a driver named ``BlockPoolError``."""


class BlockPoolExhaustedError(BlockPoolError):
    """A driver named ``BlockPoolExhaustedError``."""


class OwnerAlreadyActiveError(BlockPoolError):
    """A driver named ``OwnerAlreadyActiveError``."""


class InvalidFreeError(BlockPoolError, ValueError):
    """A driver named ``InvalidFreeError``."""


class InvariantViolationError(AssertionError):
    """A driver named ``InvariantViolationError`` (our pool's ``check_invariants``)."""


#: The classes raised for the names a driver may answer with.
ERRORS: Final[dict[str, type[Exception]]] = {
    cls.__name__: cls
    for cls in (
        BlockPoolError,
        BlockPoolExhaustedError,
        OwnerAlreadyActiveError,
        InvalidFreeError,
        TypeError,
        ValueError,
        AssertionError,
        InvariantViolationError,
        AttributeError,  # a name the object does not have: what the kit's name checks read
    )
}
#: Seconds a driver may take to answer one request.
DEFAULT_TIMEOUT: Final = 10.0
#: The longest answer line read (far above any answer the protocol has).
MAX_LINE_BYTES: Final = 16 * 1024 * 1024


class DriverProcess:
    """A running driver: requests in, responses out, in order, each within ``timeout``.

    Invariant: after the hello every request gets exactly one response line with its
    ``id``; ``calls`` are the names the hello offered.
    """

    def __init__(self, command: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.command = list(command)
        self.timeout = timeout
        # A file, not a pipe: a pipe nobody reads blocks a driver that logs much, and the
        # file's last line goes into a failure's message (why the driver stopped).
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _release)
        try:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr
            )
        except OSError as error:
            self._stderr.close()
            raise DriverFailure(f"driver {self._named}: cannot start ({error})") from None
        weakref.finalize(self, _release, self._process, self._stderr)
        assert self._process.stdout is not None and self._process.stdin is not None, "piped"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._process.stdout, selectors.EVENT_READ)
        self._buffer = b""
        self._next_id = 0
        self.dropped: list[int] = []  # pools gone here, told to the driver before the next request
        hello = self._read_line("the hello line")
        if hello.get("protocol") != PROTOCOL or hello.get("version") != PROTOCOL_VERSION:
            self.fail(f"its hello is {hello!r}; expected protocol {PROTOCOL!r} v{PROTOCOL_VERSION}")
        calls = hello.get("calls")
        if not isinstance(calls, list) or not all(isinstance(call, str) for call in calls):
            self.fail(f"its hello is {hello!r}; expected its calls as a list of names")
        self.calls: frozenset[str] = frozenset(calls)

    @property
    def _named(self) -> str:
        return repr(shlex.join(self.command))

    def request(self, op: str, **fields: object) -> object:
        """Send one request; its result, or raise the error it names."""
        while self.dropped:  # told here, never from a finaliser (it may run mid-request)
            self._drop(self.dropped.pop())
        return self._send(op, fields)

    def _drop(self, ref: int) -> None:
        """Tell the driver pool ``ref`` is gone; its answer must be ``null``, or it would be
        taken for the outcome of the request that follows."""
        try:
            answer = self._send("drop", {"ref": ref})
        except Exception as error:  # a class the driver named: no outcome of a pool call
            self.fail(f"it answered {type(error).__name__} ({error}) to the drop of ref {ref}")
        if answer is not None:
            self.fail(f"it answered {answer!r} to the drop of ref {ref}; expected null")

    def _send(self, op: str, fields: dict[str, object]) -> object:
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "op": op, **fields}) + "\n"
        try:
            assert self._process.stdin is not None, "piped"
            self._process.stdin.write(line.encode())
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.fail(f"it stopped reading (request {line.strip()})")
        response = self._read_line(f"the response to {line.strip()}")
        answered_id = response.get("id")
        if type(answered_id) is not int or answered_id != self._next_id:  # true == 1
            self.fail(f"it answered {response!r} to request {self._next_id}")
        if ("result" in response) == ("error" in response):
            self.fail(f"it answered {response!r} to {line.strip()}: expected result or error")
        if "result" in response:
            return response["result"]
        error = response["error"]
        if not isinstance(error, dict) or not isinstance(error.get("class"), str):
            self.fail(
                f"it answered {response!r} to {line.strip()}: expected an error "
                '{"class": NAME, "message": TEXT}'
            )
        message = str(error.get("message", ""))
        cls = ERRORS.get(error["class"])
        if cls is None:  # the kit reports the wrong class: the name shows what it was
            raise RuntimeError(f"{error['class']!r}, not a class of the contract: {message}")
        raise cls(message)

    def _read_line(self, what: str) -> dict[str, Any]:
        """One JSON object line, whole within the timeout (a driver that writes it a byte
        at a time does not restart the clock) and at most :data:`MAX_LINE_BYTES` long."""
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                self.fail(f"it gave no answer within {self.timeout:g} s (waiting for {what})")
            assert self._process.stdout is not None, "piped"
            chunk = os.read(self._process.stdout.fileno(), 65536)
            if not chunk:
                self.fail(self._why_output_ended(what))
            self._buffer += chunk
            if len(self._buffer) > MAX_LINE_BYTES and b"\n" not in self._buffer:
                self.fail(
                    f"it wrote over {MAX_LINE_BYTES:,} bytes with no end of line "
                    f"(waiting for {what})"
                )
        raw, self._buffer = self._buffer.split(b"\n", 1)
        try:
            record = strict_json(raw)
        except RecursionError:
            self.fail(f"it wrote {raw[:200]!r}, nested too deeply to read, for {what}")
        except ValueError as error:  # not JSON, or NaN, Infinity, 1e400
            self.fail(f"it wrote {raw[:200]!r}, not a JSON object ({error}), for {what}")
        if not isinstance(record, dict):
            self.fail(f"it wrote {raw[:200]!r}, not a JSON object, for {what}")
        return dict(record)

    def _why_output_ended(self, what: str) -> str:
        """Its stdout ended: it exited, or it closed its stdout and went on (then it is
        waited for no longer than an answer, so a driver stuck on stdin cannot hang us)."""
        try:
            status = self._process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return f"it closed its stdout but did not exit within {self.timeout:g} s ({what})"
        return f"it exited (status {status}) before {what}"

    def fail(self, why: str) -> NoReturn:
        """Stop the driver and raise :class:`DriverFailure` saying ``why`` (and the last
        line of its stderr): it broke the protocol."""
        _stop(self._process)
        said = _last_line(self._stderr)
        told = f"; its stderr ends: {said}" if said else ""
        raise DriverFailure(f"driver {self._named}: {why}{told}")


def _last_line(file: IO[bytes], tail: int = 4096) -> str:
    """The last non-empty line of ``file`` (at most ``tail`` bytes are read)."""
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - tail))
    lines = file.read().decode(errors="replace").splitlines()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")[:300]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _release(process: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
    _stop(process)
    stderr.close()


class RemoteObject:
    """An object of the driver (a pool, a block, a stats snapshot), by its ``ref``.

    An attribute read is a ``get``; a method is called with ``call``. The same ref
    is always the same proxy (:meth:`DrivenObjects.proxy`), so identity holds.
    """

    def __init__(self, objects: DrivenObjects, ref: int) -> None:
        self._objects = objects
        self._ref = ref
        self._methods: dict[str, Callable[..., Any]] = {}  # names the driver said are methods

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        method = self._methods.get(name)
        if method is not None:  # a method stays one: no second get before each call
            return method
        value = self._objects.driver.request("get", on=self._ref, name=name)
        if isinstance(value, dict) and value.get("callable"):
            method = self._methods[name] = self._objects.method(self._ref, name)
            return method
        return self._objects.decode(value)

    def __repr__(self) -> str:
        return f"<driven object {self._ref}>"


class DrivenObjects:
    """The proxies of one driver's objects, one per ref, and the argument encoding."""

    def __init__(self, driver: DriverProcess) -> None:
        self.driver = driver
        # Weak: a pool nobody holds is collected, and then dropped by the driver too.
        self._proxies: weakref.WeakValueDictionary[int, RemoteObject] = (
            weakref.WeakValueDictionary()
        )

    def proxy(self, ref: int) -> RemoteObject:
        """The one proxy of ``ref``."""
        found = self._proxies.get(ref)
        if found is None:
            found = self._proxies[ref] = RemoteObject(self, ref)
        return found

    def decode(self, value: object) -> Any:
        """A result: refs become proxies, lists stay lists."""
        if isinstance(value, list):
            return [self.decode(item) for item in value]
        if isinstance(value, dict) and "ref" in value:
            ref = value["ref"]
            if type(ref) is not int:
                self.driver.fail(f"it sent {value!r}: a ref must be an int")
            return self.proxy(ref)
        return value

    def decode_ref(self, value: object, what: str) -> RemoteObject:
        """A result that must be a ref (a new pool or block): its proxy."""
        decoded = self.decode(value)
        if not isinstance(decoded, RemoteObject):
            self.driver.fail(f"it answered {value!r} to a {what} request; expected a ref")
        return decoded

    def encode(self, value: object) -> object:
        """An argument: proxies as refs, tuples and bytes wrapped, anything else as JSON."""
        if isinstance(value, RemoteObject):
            return {"ref": value._ref}
        if isinstance(value, list):
            return [self.encode(item) for item in value]
        if isinstance(value, tuple):
            return {"tuple": [self.encode(item) for item in value]}
        if isinstance(value, bytes):
            return {"bytes": value.hex()}
        if isinstance(value, bool | int | float | str | type(None)):
            return value
        return repr(value)  # an object the driver cannot know: passed as text

    def method(self, ref: int, name: str) -> Callable[..., Any]:
        """A method of the object ``ref``, called remotely."""

        def call(*arguments: object) -> Any:
            encoded = [self.encode(argument) for argument in arguments]
            return self.decode(self.driver.request("call", on=ref, name=name, args=encoded))

        return call


def driven_port(
    command: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT, name: str = "driven"
) -> Port:
    """A port whose pools live in the driver ``command`` starts (one process for all).

    Args:
        command: The driver's command line.
        timeout: Seconds each answer may take.
        name: How reports call the factory.

    Raises:
        DriverFailure: The driver did not start and say hello.
    """
    objects = DrivenObjects(DriverProcess(command, timeout=timeout))

    def factory(**fields: object) -> Any:
        history_len = fields.pop("history_len", None)
        config = {**CONFIG_DEFAULTS, **fields}  # the protocol's config has all five fields
        result = objects.driver.request("pool", config=config, history_len=history_len)
        pool = objects.decode_ref(result, "pool")
        weakref.finalize(pool, objects.driver.dropped.append, pool._ref)
        return pool

    def block_class(block_id: int) -> object:
        return objects.decode_ref(objects.driver.request("block", block_id=block_id), "block")

    factory.__name__ = name
    try:
        return Port(
            factory,
            config_class=None,
            block_class=block_class,
            errors=ERRORS,
            capabilities=objects.driver.calls,
            name=name,
        )
    except ValueError as error:  # calls the table does not have, or too few
        objects.driver.fail(f"its hello's calls: {error}")
