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

The checker gives up (and the run's verdict can then only be inconclusive)
when a window's search exhausts its configuration budget, or when its
``tick`` raises :class:`SearchStopped` (the runner's checking time ran out,
or Ctrl-C), or when :meth:`LinearizabilityChecker.stop` is called: the set
of possible states is then unknown, so every later call is counted in
:attr:`CheckerFigures.events_not_checked` and :meth:`LinearizabilityChecker.gap`
says how many and why.

Complexity: one search per window (see ``linearizability``), O(window) per
commit. Thread safety: a checker is used from one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from veloxquant_mlx.commandline.verdicts import Gap
from veloxquant_mlx.stress.linearizability import (
    DEFAULT_BUDGET,
    Witness,
    search,
    split_at_quiescent_points,
)
from veloxquant_mlx.stress.minimal import explain, minimal_failing_window
from veloxquant_mlx.stress.specstep import Checkpoint, initial_checkpoint
from veloxquant_mlx.testing.traces import StoreSpec, TraceLine
from veloxquant_mlx_spec.model import SpecConfig

__all__ = [
    "TRACE_DEFAULT_STORE",
    "CheckerFigures",
    "InconclusiveCheckError",
    "LinearizabilityChecker",
    "SearchStopped",
    "Violation",
    "check_history",
]


#: The store a history's store calls went to when its caller names none (a trace's default).
TRACE_DEFAULT_STORE: Final = StoreSpec()


class SearchStopped(Exception):  # noqa: N818 -- a signal to stop, not an error
    """Raised by a search's ``tick`` to stop checking; ``reason`` says why (for the report)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InconclusiveCheckError(Exception):
    """:func:`check_history` gave up before deciding; ``gap`` says what and why."""

    def __init__(self, gap: Gap) -> None:
        super().__init__(str(gap))
        self.gap = gap


@dataclass(frozen=True)
class Violation:
    """A window with no valid order; ``window`` is the minimal one, ``starts`` its start states."""

    window_index: int
    message: str
    window: tuple[TraceLine, ...]
    starts: tuple[Checkpoint, ...]


@dataclass
class _Pending:
    """A checked window whose order is not decided yet (several end states remain)."""

    events: tuple[TraceLine, ...]
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
    largest_search: int = 0  # configurations of the costliest window (against the budget)
    inconclusive_window: int | None = None  # index of the window whose search gave up
    events_not_checked: int = 0
    gave_up_because: str | None = None  # why checking stopped early, if it did


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
        store: StoreSpec = TRACE_DEFAULT_STORE,
        on_commit: Callable[[Sequence[TraceLine]], None] | None = None,
        budget: int | None = DEFAULT_BUDGET,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Start from a new pool with ``config``, ``history_len``; ``tick`` as in :func:`search`.

        ``store`` is the store the history's store calls went to (its layers
        decide which calls it refuses for their shape).
        """
        self._store_layers: Final = store.n_layers
        self.ends: list[Checkpoint] = [initial_checkpoint(config, history_len)]
        self.figures: Final = CheckerFigures()
        self.violation: Violation | None = None
        self._on_commit = on_commit
        self._budget = budget
        self._tick = tick
        self._pending: list[_Pending] = []

    @property
    def stopped(self) -> bool:
        """True once a violation was found or checking gave up: later windows are skipped."""
        return self.violation is not None or self.figures.gave_up_because is not None

    def stop(self, reason: str) -> None:
        """Give up: commit what is pending and count every later call as not checked."""
        if not self.stopped:
            self.figures.gave_up_because = reason
            self.figures.inconclusive_window = self.figures.windows
            self._commit_all()

    def gap(self) -> Gap | None:
        """What was not checked and why, or ``None`` if every call given so far was."""
        figures = self.figures
        if not figures.events_not_checked or self.violation is not None:
            return None
        total = figures.events + figures.events_not_checked
        return Gap(
            f"{figures.events_not_checked:,} of {total:,} calls "
            f"(window {figures.inconclusive_window} and later)",
            f"linearizability {figures.gave_up_because}",
        )

    def check(self, events: Sequence[TraceLine]) -> Violation | None:
        """Check the next window; return the violation if it has no valid order."""
        for part in split_at_quiescent_points(events):
            if self.stopped:
                self.figures.events_not_checked += len(part)
                continue
            self._check_part(part)
        return self.violation

    def _check_part(self, events: Sequence[TraceLine]) -> None:
        starts = tuple(self.ends)
        figures = self.figures
        try:
            result = search(
                starts,
                events,
                store_layers=self._store_layers,
                budget=self._budget,
                tick=self._tick,
            )
        except SearchStopped as stopped:
            self.stop(f"stopped: {stopped.reason}")
            figures.events_not_checked += len(events)
            return
        figures.configurations += result.nodes
        figures.largest_search = max(figures.largest_search, result.nodes)
        if not result.complete:
            self.stop(
                f"gave up: the search budget of {self._budget:,} configurations ran out "
                f"in window {figures.windows} ({len(events)} calls)"
            )
            figures.events_not_checked += len(events)
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

    def _fail(self, starts: tuple[Checkpoint, ...], events: Sequence[TraceLine]) -> None:
        self._commit_all()
        index = self.figures.windows - 1
        try:  # shrinking the window is a courtesy: a stop keeps the whole window
            layers, budget, tick = self._store_layers, self._budget, self._tick
            window = minimal_failing_window(
                starts, events, store_layers=layers, budget=budget, tick=tick
            )
            why = explain(starts, window, store_layers=layers, budget=budget, tick=tick)
        except SearchStopped:
            window, why = list(events), "no order of its calls fits the spec"
        message = f"linearizability violation in window {index}: {why}"
        self.violation = Violation(index, message, tuple(window), starts)

    def finish(self) -> None:
        """Commit the windows still undecided, choosing any one of the end states."""
        self._commit_all()

    def _commit_all(self) -> None:
        """Emit the pending windows' calls in order, along the witnesses of the first end."""
        if not self._pending:
            return
        orders: list[tuple[TraceLine, ...]] = []
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
    events: Sequence[TraceLine],
    *,
    store: StoreSpec = TRACE_DEFAULT_STORE,
    budget: int | None = DEFAULT_BUDGET,
) -> Violation | None:
    """Check a whole history at once (cut at its quiescent points); the violation or ``None``.

    ``None`` means linearizable: every call was checked.

    Raises:
        InconclusiveCheckError: The budget ran out before a verdict.
    """
    checker = LinearizabilityChecker(config, history_len, store=store, budget=budget)
    violation = checker.check(events)
    checker.finish()
    gap = checker.gap()
    if gap is not None:
        raise InconclusiveCheckError(gap)
    return violation
