"""Making a call and recording it: the one place where invoke and return times are taken.

:func:`record_call` runs a call, takes ``time.perf_counter_ns()`` just before
and just after it (so the recorded interval contains the call), and appends
the timed line with what it returned, in the form the spec predicts it
(:func:`~veloxquant_mlx.testing.sides.pool_encoder`), or the class of what
it raised. The workers, the runner's observations at barriers and the
conservation audit all record through it.

Complexity: O(1) plus the call and its value's conversion. Thread safety:
each thread records into its own :class:`~veloxquant_mlx.stress.history.ThreadRecorder`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Final, Generic, TypeVar

from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.testing.sides import pool_encoder
from veloxquant_mlx_spec.model import ErrorKind
from veloxquant_mlx_spec.table import Outcome, Raised, Returned, Returns, bind, declaration_of

__all__ = ["EXPECTED_ERRORS", "Invoked", "encoder_of", "record_call", "record_unnamed_call"]

T = TypeVar("T")

#: Errors the pool raises on purpose; any other is recorded with its message.
EXPECTED_ERRORS: Final = frozenset(kind.value for kind in ErrorKind)

#: How each kind of result is recorded; handles a query returned stay objects until the
#: barrier names them (every call that handed them out has registered them by then).
_ENCODERS: Final = {returns: pool_encoder(returns, None) for returns in Returns}


def _done(value: object) -> Outcome:
    return Returned(None)


def encoder_of(op: object) -> Callable[[object], Outcome]:
    """How ``op``'s return value is recorded (a store call's data is its caller's to check)."""
    declaration = declaration_of(op)
    return _done if declaration.target == "store" else _ENCODERS[declaration.returns]


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
    recorder.add(op_id, op, start, end, encode(result))
    return Invoked(op_id, result)


def record_unnamed_call(recorder: ThreadRecorder, pool: object, op: object) -> Invoked[object]:
    """:func:`record_call` of ``op`` on ``pool``, a call that names no handle (a query at a
    barrier, a call of the conservation audit, a worker's look at a shared owner)."""
    return record_call(recorder, op, bind(pool, op, _names_no_handle))


def _names_no_handle(ref: object) -> object:
    raise AssertionError(f"a call that names no handle resolved {ref!r}")
