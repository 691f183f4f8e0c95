"""The streaming linearizability check of a whole stress run, window by window.

:class:`LinearizabilityChecker` takes the history one window at a time (the
runner cuts it at barriers; :func:`~veloxquant_mlx.stress.linearizability.split_at_quiescent_points`
cuts it further) and carries between windows the exact set of spec states a
linearization of the history so far can end in (see
:mod:`veloxquant_mlx.stress.linearizability` for why that is sound and
complete). When only one state is left, the order that led to it is decided:
the checker hands those calls, in that order, to ``on_commit`` (the storage
replay). A window with no valid order becomes a :class:`Violation`, with the
minimal failing window (:mod:`veloxquant_mlx.stress.minimal`).

Complexity: one search per window (see ``linearizability``), O(window) per
commit. Thread safety: a checker is used from one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from veloxquant_mlx.stress.history import Event
from veloxquant_mlx.stress.linearizability import (
    DEFAULT_BUDGET,
    Witness,
    search,
    split_at_quiescent_points,
)
from veloxquant_mlx.stress.minimal import explain, minimal_failing_window
from veloxquant_mlx.stress.specstep import Checkpoint, initial_checkpoint
from veloxquant_mlx_spec.model import SpecConfig

__all__ = ["CheckerFigures", "LinearizabilityChecker", "Violation", "check_history"]


@dataclass(frozen=True)
class Violation:
    """A window with no valid order; ``window`` is the minimal one, ``starts`` its start states."""

    window_index: int
    message: str
    window: tuple[Event, ...]
    starts: tuple[Checkpoint, ...]


@dataclass
class _Pending:
    """A checked window whose order is not decided yet (several end states remain)."""

    events: tuple[Event, ...]
    starts: tuple[Checkpoint, ...]
    ends: dict[Checkpoint, Witness]


@dataclass
class CheckerFigures:
    """What the checker did, for the report."""

    windows: int = 0
    events: int = 0
    configurations: int = 0
    max_end_states: int = 1
    largest_window: int = 0  # calls in the largest window between quiescent points
    inconclusive_window: int | None = None  # index of the window whose search gave up
    events_not_checked: int = 0


class LinearizabilityChecker:
    """Checks a history window by window, carrying the set of possible states between them.

    Feed it each window (all of a window's calls return before the next
    window's are invoked) with :meth:`check`; call :meth:`finish` at the end.
    ``on_commit`` receives the calls of the history in one valid linearization
    order, window by window, as soon as that order is decided (when one end
    state is left), and at :meth:`finish`.

    Invariants: ``ends`` is exactly the set of states (with names) in which
    a linearization of every window checked so far can end; the ``_pending``
    windows are those whose order is not yet committed, oldest first.
    """

    def __init__(
        self,
        config: SpecConfig,
        history_len: int,
        *,
        on_commit: Callable[[Sequence[Event]], None] | None = None,
        budget: int | None = DEFAULT_BUDGET,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Start from a new pool with ``config``, ``history_len``; ``tick`` as in :func:`search`."""
        self.ends: list[Checkpoint] = [initial_checkpoint(config, history_len)]
        self.figures: Final = CheckerFigures()
        self.violation: Violation | None = None
        self._on_commit = on_commit
        self._budget = budget
        self._tick = tick
        self._pending: list[_Pending] = []

    @property
    def stopped(self) -> bool:
        """True once a violation was found or a search gave up: later windows are skipped."""
        return self.violation is not None or self.figures.inconclusive_window is not None

    def check(self, events: Sequence[Event]) -> Violation | None:
        """Check the next window; return the violation if it has no valid order."""
        for part in split_at_quiescent_points(events):
            if self.stopped:
                self.figures.events_not_checked += len(part)
                continue
            self._check_part(part)
        return self.violation

    def _check_part(self, events: Sequence[Event]) -> None:
        starts = tuple(self.ends)
        result = search(starts, events, budget=self._budget, tick=self._tick)
        figures = self.figures
        figures.configurations += result.nodes
        if not result.complete:
            figures.inconclusive_window = figures.windows
            figures.events_not_checked += len(events)
            self._commit_all()
            return
        figures.windows += 1
        figures.events += len(events)
        figures.largest_window = max(figures.largest_window, len(events))
        if not result.ends:
            self._fail(starts, events)
            return
        figures.max_end_states = max(figures.max_end_states, len(result.ends))
        self._pending.append(_Pending(tuple(events), starts, result.ends))
        self.ends = list(result.ends)
        if len(self.ends) == 1:
            self._commit_all()

    def _fail(self, starts: tuple[Checkpoint, ...], events: Sequence[Event]) -> None:
        self._commit_all()
        window = minimal_failing_window(starts, events, budget=self._budget, tick=self._tick)
        index = self.figures.windows - 1
        message = f"linearizability violation in window {index}: " + explain(
            starts, window, budget=self._budget, tick=self._tick
        )
        self.violation = Violation(index, message, tuple(window), starts)

    def finish(self) -> None:
        """Commit the windows still undecided, choosing any one of the end states."""
        self._commit_all()

    def _commit_all(self) -> None:
        """Emit the pending windows' calls in order, along the witnesses of the first end."""
        if not self._pending:
            return
        orders: list[tuple[Event, ...]] = []
        end = next(iter(self._pending[-1].ends))
        for pending in reversed(self._pending):
            witness = pending.ends[end]
            orders.append(tuple(pending.events[i] for i in witness.order))
            end = pending.starts[witness.start]
        self._pending.clear()
        if self._on_commit is not None:
            for order in reversed(orders):
                self._on_commit(order)


def check_history(
    config: SpecConfig,
    history_len: int,
    events: Sequence[Event],
    *,
    budget: int | None = DEFAULT_BUDGET,
) -> Violation | None:
    """Check a whole history at once (cut at its quiescent points); the violation or ``None``."""
    checker = LinearizabilityChecker(config, history_len, budget=budget)
    violation = checker.check(events)
    checker.finish()
    return violation
