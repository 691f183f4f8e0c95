"""Making a call and recording it: the one place where invoke and return times are taken.

:func:`record_call` runs a call, takes ``time.perf_counter_ns()`` just before
and just after it (so the recorded interval contains the call), and appends
the timed line with what it returned, in the form the spec predicts it
(:func:`~veloxquant_mlx.testing.sides.pool_encoder`), or the class of what
it raised. The workers, the runner's observations at barriers and the
conservation audit all record through it.

A call that hands out handles (``allocate``, ``share``, ``fork``,
``make_writable``) also records what each handle shows (its ``stream``,
``format``, ``n_used``, ``owner`` and ``ever_allocated``: the line's
``shows``), read with the block ids just after the return time is taken,
so that the checker compares them with the spec's handle at the call's
linearization point. Other threads learn a new handle's name only after
this returns, and a worker makes no call that changes another thread's
handle but ``free`` and ``free_all`` (``mark_used`` and ``make_writable``
take only handles it holds): so the one change the fields can have seen
since that point is a free (``owner`` ``None``, ``n_used`` 0) by a call
linearized after this one, which the check allows
(:func:`~veloxquant_mlx.stress.specstep.step`).

Complexity: O(1) plus the call and its value's conversion (one attribute
read per field of each handle handed out). Thread safety: each thread
records into its own :class:`~veloxquant_mlx.stress.history.ThreadRecorder`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Final, Generic, TypeVar

from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.testing.sides import pool_encoder
from veloxquant_mlx.testing.traces import SHOWN_FIELDS, Shown
from veloxquant_mlx_spec.model import ErrorKind
from veloxquant_mlx_spec.table import Outcome, Raised, Returned, Returns, bind, declaration_of

__all__ = [
    "EXPECTED_ERRORS",
    "Invoked",
    "Recorded",
    "encoder_of",
    "record_call",
    "record_unnamed_call",
]

T = TypeVar("T")

#: Errors the pool raises on purpose; any other is recorded with its message.
EXPECTED_ERRORS: Final = frozenset(kind.value for kind in ErrorKind)

#: How each kind of result is recorded; handles a query returned stay objects until the
#: barrier names them (every call that handed them out has registered them by then).
_ENCODERS: Final = {returns: pool_encoder(returns, None) for returns in Returns}


#: A handle's block id, and what it shows (:data:`SHOWN_FIELDS`), each read in one C call.
_BLOCK_ID: Final = operator.attrgetter("block_id")
_SHOWN: Final = operator.attrgetter(*SHOWN_FIELDS)

Recorded = tuple[Outcome, Shown | None]
"""A call's outcome, and what the handles it handed out show (``None``: it handed out none)."""


def _done(value: object) -> Recorded:
    return Returned(None), None


def _new_handles(value: object) -> Recorded:
    """A list of new handles: their block ids, and what each shows."""
    if not isinstance(value, list):
        return _ENCODERS[Returns.NEW_HANDLES](value), None
    try:  # map, not a comprehension: the loops run in C (this is every allocate's cost)
        return Returned(tuple(map(_BLOCK_ID, value))), tuple(map(_SHOWN, value))
    except AttributeError:  # not a list of blocks: recorded as it is, which the spec refuses
        return _ENCODERS[Returns.NEW_HANDLES](value), None


def _one_handle(value: object) -> Recorded:
    """One handle (``make_writable``'s): its block id, and what it shows."""
    try:
        return Returned(_BLOCK_ID(value)), (_SHOWN(value),)
    except AttributeError:
        return _ENCODERS[Returns.HANDLE](value), None


def _outcome_only(returns: Returns) -> Callable[[object], Recorded]:
    encode = _ENCODERS[returns]
    return lambda value: (encode(value), None)


#: How a successful call of each kind of result is recorded.
_RECORDERS: Final[dict[Returns, Callable[[object], Recorded]]] = {
    returns: _outcome_only(returns) for returns in Returns
} | {Returns.NEW_HANDLES: _new_handles, Returns.HANDLE: _one_handle}


def encoder_of(op: object) -> Callable[[object], Recorded]:
    """How ``op``'s return value is recorded: its outcome, and what the handles it handed out
    show (a store call's data is its caller's to check)."""
    declaration = declaration_of(op)
    return _done if declaration.target == "store" else _RECORDERS[declaration.returns]


@dataclass(frozen=True, slots=True)
class Invoked(Generic[T]):
    """A recorded call's op id and its result, or the exception it raised."""

    op_id: int
    result: T | Exception


def record_call(recorder: ThreadRecorder, op: object, action: Callable[[], T]) -> Invoked[T]:
    """Make ``op`` through ``action`` (which makes exactly that call) and record it.

    The invocation time is taken just before ``action`` runs and the return
    time just after, so the recorded interval contains the call.
    """
    encode = encoder_of(op)
    op_id = recorder.next_op_id()
    start = perf_counter_ns()
    try:
        result = action()
    except Exception as error:
        end = perf_counter_ns()
        kind = type(error).__name__
        message = "" if kind in EXPECTED_ERRORS else str(error)[:300]
        recorder.add(op_id, op, start, end, Raised(kind, message))
        return Invoked(op_id, error)
    end = perf_counter_ns()
    outcome, shows = encode(result)
    recorder.add(op_id, op, start, end, outcome, shows=shows)
    return Invoked(op_id, result)


def record_unnamed_call(recorder: ThreadRecorder, pool: object, op: object) -> Invoked[object]:
    """:func:`record_call` of ``op`` on ``pool``, a call that names no handle (a query at a
    barrier, a call of the conservation audit, a worker's look at a shared owner)."""
    return record_call(recorder, op, bind(pool, op, _names_no_handle))


def _names_no_handle(ref: object) -> object:
    raise AssertionError(f"a call that names no handle resolved {ref!r}")
