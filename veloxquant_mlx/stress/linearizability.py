"""Is a recorded concurrent history linearizable against the executable spec?

The algorithm is Wing and Gong's, with Lowe's memoisation: the one behind
Porcupine and Knossos. A history is linearizable if its calls can be put in
one sequential order that (a) keeps every pair ``a`` before ``b`` where ``a``
returned before ``b`` was invoked, and (b) gives, run through the spec from
the start state, exactly the outcome each call recorded. The search extends
a prefix one call at a time, choosing only calls that no unlinearized call
must precede; a configuration is ``(linearized set as a bitmask, spec state,
handle names)`` and is never expanded twice (Lowe's memo), so the cost is the
number of distinct configurations, exponential in the concurrency (threads),
not in the length of the history.

Handle names. A recorded call names a handle ``h(op_id, position)`` after
the call that handed it out; the spec numbers handles in checkout order,
which depends on the order chosen for concurrent calls. So the mapping from
names to spec ids (:class:`~veloxquant_mlx.stress.specstep.Checkpoint.names`)
is part of the configuration: it is extended when a call that hands out
handles is linearized, and a call that uses a name whose call is not
linearized yet cannot go next.

Windows, and why cutting there is sound. A *quiescent point* is a moment
when no call is pending: every call before it returned before every call
after it was invoked, so every linearization of the whole history is a
linearization of the calls before it followed by one of the calls after.
The runner makes one every few calls per thread (a barrier), and
:func:`split_at_quiescent_points` finds any others. The history is checked
one window at a time (:class:`~veloxquant_mlx.stress.checker.LinearizabilityChecker`),
carrying from window to window the *set* of all spec states (with names)
in which some linearization of the history so far can end, not just one:
the order of two concurrent frees, say, decides the free list's order, and
only a later allocate tells which it was. :func:`search` therefore returns
every end state of a window. The history is linearizable iff that set never
becomes empty. Nothing is lost by the cut: the set is exact, so the check
is sound (a reported violation is real) and complete (every violation is
reported), and the memo's bitmask never has more bits than one window has
calls. Each state carried is compacted (stale handles dropped; see
``specstep``), so a state is as big as the pool, not as the history.

Independent parts. Porcupine splits a history into independent
sub-histories (per key of a map). Nothing in a pool splits that way: calls
on different owners or streams still share counters, the history snapshots
and handle numbering, and on a shared pool also the free list. What is
sound is the special case of calls that change no state wherever they are
linearized (:func:`changes_no_state`: queries, and calls that recorded an
error other than exhaustion): if such a call may go next and its outcome
fits, it can be linearized at once, without branching, because moving it
to the front of any valid completion keeps that completion valid and ends
in the same state. The search does exactly that. (A call that merely
changes nothing *here*, like ``free_all`` of an owner that holds nothing
yet, does not qualify: later in the order it may free what a concurrent
allocate handed out.)

Complexity: per window, O(configurations x (window size + one spec
transition)); configurations are bounded by ``budget``. Thread safety: pure
functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from veloxquant_mlx.stress.specstep import Checkpoint, Names, compact, step
from veloxquant_mlx.testing.traces import TraceLine
from veloxquant_mlx_spec.model import PoolState
from veloxquant_mlx_spec.table import declaration_of

__all__ = [
    "DEFAULT_BUDGET",
    "SearchResult",
    "Window",
    "Witness",
    "changes_no_state",
    "search",
    "split_at_quiescent_points",
]

#: Configurations one window's search may expand before it gives up (inconclusive).
DEFAULT_BUDGET: Final = 200_000

_INFINITY: Final = float("inf")


@dataclass(frozen=True, slots=True)
class Witness:
    """How a window reached one end state: from ``starts[start]``, in ``order``."""

    start: int
    order: tuple[int, ...]  # indices into the window's events


@dataclass
class SearchResult:
    """Every end state of one window (each with one witness order), and search figures.

    ``ends`` is empty iff the window is not linearizable from the start
    states, provided ``complete`` (the budget was not exhausted).
    """

    ends: dict[Checkpoint, Witness]
    nodes: int
    complete: bool
    deepest: int  # the most completed calls linearized on any one path
    deepest_state: Checkpoint | None  # where that path stood
    deepest_mask: int


# -- one window ----------------------------------------------------------------------------


class Window:
    """A window's events with the orderings the search needs, computed once.

    ``required`` has a bit for every completed call (pending ones are optional);
    ``issuing`` holds the labels of the window's calls that hand out handles;
    ``inert[i]`` says whether call ``i`` changes no state wherever it goes
    (:func:`changes_no_state`); ``store_layers`` is the layer count of the
    store the store calls went to (:func:`~.specstep.step`).
    """

    def __init__(self, events: Sequence[TraceLine], store_layers: int) -> None:
        self.events: Final = tuple(events)
        self.store_layers: Final = store_layers
        indices = range(len(self.events))
        self._invoked: Final = [e.invoke_ns or 0 for e in self.events]
        self._returned: Final = [e.return_ns or 0 for e in self.events]
        self.by_invoke: Final = sorted(indices, key=self._invoked.__getitem__)
        completed = [i for i in indices if not self.events[i].pending]
        self.by_return: Final = sorted(completed, key=self._returned.__getitem__)
        self.required: Final = sum(1 << i for i in completed)
        self.issuing: Final = frozenset(
            e.call
            for e in self.events
            if e.call is not None and declaration_of(e.op).may_issue_handles
        )
        self.inert: Final = [changes_no_state(e) for e in self.events]

    def candidates(self, mask: int) -> Iterator[int]:
        """Unlinearized calls that no unlinearized call must precede (invoke order)."""
        deadline: float = _INFINITY
        for i in self.by_return:
            if not mask >> i & 1:
                deadline = self._returned[i]
                break
        for i in self.by_invoke:
            if self._invoked[i] > deadline:
                return
            if not mask >> i & 1:
                yield i


def _unroll(path: tuple[int, object] | None) -> tuple[int, ...]:
    order: list[int] = []
    while path is not None:
        index, parent = path
        order.append(index)
        path = parent  # type: ignore[assignment]  # a cons list of (index, parent)
    return tuple(reversed(order))


_Node = tuple[int, PoolState, Names, "tuple[int, object] | None", int]


def search(
    starts: Sequence[Checkpoint],
    events: Sequence[TraceLine],
    *,
    store_layers: int,
    budget: int | None = DEFAULT_BUDGET,
    tick: Callable[[], None] | None = None,
    first_end_only: bool = False,
) -> SearchResult:
    """Every state some valid order of ``events`` can end in, from any of ``starts``.

    Args:
        starts: The possible start states (the previous window's ends).
        events: The window: calls, with pending ones (which may be left out).
        store_layers: Layers of the store the window's store calls went to.
        budget: Give up after expanding this many configurations (``None``: never).
        tick: Called every 1024 configurations (a watchdog's heartbeat).
        first_end_only: Stop at the first end state: enough to know the window
            is linearizable, not enough to carry on to the next window.

    Returns:
        The end states (compacted), each with one witness order; ``complete``
        is False if the budget ran out first.
    """
    window = Window(events, store_layers)
    ends: dict[Checkpoint, Witness] = {}
    visited: set[tuple[int, PoolState, Names]] = set()
    stack: list[_Node] = [
        (0, cp.state, cp.names, None, k) for k, cp in reversed(list(enumerate(starts)))
    ]
    result = SearchResult(ends, 0, True, -1, None, 0)
    while stack:
        mask, state, names, path, start = stack.pop()
        key = (mask, state, names)
        if key in visited:
            continue
        visited.add(key)
        result.nodes += 1
        if tick is not None and not result.nodes & 1023:
            tick()
        if budget is not None and result.nodes > budget:
            result.complete = False
            break
        depth = (mask & window.required).bit_count()
        if depth > result.deepest:
            result.deepest = depth
            result.deepest_state = Checkpoint(state, names)
            result.deepest_mask = mask
        if mask & window.required == window.required:
            end = compact(state, names)
            if end not in ends:
                ends[end] = Witness(start, _unroll(path))
            if first_end_only:
                break
        stack.extend(reversed(_children(window, (mask, state, names, path, start))))
    return result


def _children(window: Window, node: _Node) -> list[_Node]:
    """The configurations one more call leads to (just one if a call changes nothing)."""
    mask, state, names, path, start = node
    children: list[_Node] = []
    for i in window.candidates(mask):
        stepped = step(
            state, names, window.events[i], window.issuing, store_layers=window.store_layers
        )
        if stepped is None:
            continue
        child: _Node = (mask | 1 << i, *stepped, (i, path), start)
        if window.inert[i]:
            return [child]  # changes no state anywhere: take it now, no branching (module doc)
        children.append(child)
    return children


def changes_no_state(event: TraceLine) -> bool:
    """Whether ``event`` leaves the spec state as it was wherever it is validly linearized.

    True for queries, and for a completed call that recorded an error that
    does not count itself (every error but exhaustion): the spec changes
    nothing on such an error, and a valid order must give the call the error
    it recorded. A successful call that happens to change nothing in one
    state (``free_all`` of an owner holding nothing yet) is *not* such a
    call: elsewhere in the order it may change a lot.
    """
    return declaration_of(event.op).changes_no_state(event.outcome)


def split_at_quiescent_points(events: Sequence[TraceLine]) -> list[list[TraceLine]]:
    """``events`` cut wherever every call so far returned before the next was invoked."""
    parts: list[list[TraceLine]] = []
    latest_return: float = -_INFINITY
    for event in sorted(events, key=lambda e: e.invoke_ns or 0):
        if not parts or (event.invoke_ns or 0) > latest_return:
            parts.append([])
        parts[-1].append(event)
        end = _INFINITY if event.return_ns is None else event.return_ns
        latest_return = max(latest_return, end)
    return parts
