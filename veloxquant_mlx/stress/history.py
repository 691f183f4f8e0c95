"""Concurrent histories of one shared pool: every call, when it ran and what it did.

A stress run records, per thread, one timed
:class:`~veloxquant_mlx.testing.traces.TraceLine` per call it makes on the
pool or its store: the call (an operation of the table, or a store call), a
label (its op id), the ``time.perf_counter_ns()`` taken just before it was
invoked and just after it returned, and what it returned (with the fields of
each handle it handed out, read just after it returned) or raised. The
interval always contains the call's real execution, so "``a`` returned
before ``b`` was invoked" in the record implies it in reality: the real-time
order the linearizability checker (:mod:`veloxquant_mlx.stress.linearizability`)
relies on is never stronger than the truth. A history is therefore a trace:
it is written, read and replayed as one (docs/TRACE_FORMAT.md).

Handles are named by the call that handed them out, as everywhere:
``h(op_id, position)``. ``op_id`` is unique within a run without any
coordination between threads: ``seq * stride + thread`` for the ``seq``-th
call of thread ``thread``.

Complexity: recording is O(1) per call (plus the size of its arguments);
describing is O(size of the line). Thread safety: a :class:`ThreadRecorder`
belongs to one thread (the runner swaps its list out only while that thread
waits at a barrier); lines are immutable.
"""

from __future__ import annotations

from typing import Final

from veloxquant_mlx.testing.sides import describe as describe_outcome
from veloxquant_mlx.testing.traces import Shown, TraceLine
from veloxquant_mlx_spec.table import Outcome, declaration_of

__all__ = ["ThreadRecorder", "describe", "describe_call"]


class ThreadRecorder:
    """The history of one thread: its calls in program order, and its op ids.

    Invariant: ``events`` are in the order the thread made the calls, and
    every label is ``seq * stride + thread`` for a distinct ``seq``.
    """

    def __init__(self, thread: int, stride: int) -> None:
        """Record for thread number ``thread`` of ``stride`` (threads plus observers)."""
        if not 0 <= thread < stride:
            raise ValueError(f"thread must be in 0..{stride - 1}, got {thread}")
        self.thread: Final = thread
        self._stride: Final = stride
        self._next_seq = 0
        # Only the owning thread appends; the runner swaps the list at a barrier.
        self.events: list[TraceLine] = []

    def next_op_id(self) -> int:
        """A new op id, unique in the run."""
        op_id = self._next_seq * self._stride + self.thread
        self._next_seq += 1
        return op_id

    def add(
        self,
        op_id: int,
        op: object,
        invoke_ns: int,
        return_ns: int,
        outcome: Outcome,
        *,
        shows: Shown | None = None,
    ) -> None:
        """Append one finished call (``shows``: what the handles it handed out showed)."""
        self.events.append(TraceLine(op, op_id, outcome, self.thread, invoke_ns, return_ns, shows))

    def take(self) -> list[TraceLine]:
        """Hand over the calls recorded since the last take (call only at a barrier)."""
        taken, self.events = self.events, []
        return taken


def describe_call(op: object) -> str:
    """A call as it would be made: ``allocate('k', 4, 2, 'fp16')``, ``free([h(3, 0)])``."""
    declaration = declaration_of(op)
    shown = [
        "[" + ", ".join(map(repr, value)) + "]" if isinstance(value, tuple) else repr(value)
        for value in declaration.arguments(op)
    ]
    return f"{declaration.name}({', '.join(shown)})"


def describe(event: TraceLine) -> str:
    """A one-line, human-readable form of the call and its outcome."""
    outcome = "(pending)" if event.outcome is None else describe_outcome(event.outcome)
    return f"{describe_call(event.op)} -> {outcome}"
