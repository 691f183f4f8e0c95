"""The smallest failing piece of a window that is not linearizable, and its explanation.

When the linearizability checker finds a window with no valid order, the
report shows :func:`minimal_failing_window` of it, explained by
:func:`explain`: a timeline of the calls and the point where the search got
stuck, with what the spec says each call that could come next returns.

Why the cuts keep the window failing (a smaller history that fails proves
the whole one fails):

- *Time prefix*: the calls invoked by a cut-off time, those not returned by
  then made pending (they may or may not have happened), is the history as
  it stood at that time; a linearization of the whole history, cut at that
  time, linearizes it. So if the prefix fails, the whole window fails; and
  failing is monotone in the cut-off, so a binary search finds the earliest.
- *Calls that change no state*: queries, and calls that recorded an error
  other than exhaustion (on every other error the spec leaves the state as
  it was). Removing such a call from a valid order leaves a valid order of
  the rest, so if the rest fails, so does the window with it.

When the window fails only because of what handles showed (a line's
``shows``: its calls fit the spec in some order once those are ignored),
:func:`explain` says so and names the handle and field in one such order,
rather than where the search happened to get stuck: there, a call's block
ids may differ too, only because the order is not that one.

Complexity: O(log n) searches for the prefix plus at most one per removable
call, all within one shared budget; :func:`explain` makes one search, two
if the window recorded what handles showed. Thread safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final

from veloxquant_mlx.stress.history import describe
from veloxquant_mlx.stress.linearizability import (
    DEFAULT_BUDGET,
    SearchResult,
    Window,
    changes_no_state,
    search,
)
from veloxquant_mlx.stress.specstep import Checkpoint, predicted_outcome, step
from veloxquant_mlx.testing.traces import TraceLine
from veloxquant_mlx_spec.table import declaration_of

__all__ = ["MINIMIZE_BUDGET", "explain", "minimal_failing_window"]

#: Configurations all the searches of one minimisation may expand together.
MINIMIZE_BUDGET: Final = 20_000


def _cut_at(events: Sequence[TraceLine], cutoff: int) -> list[TraceLine]:
    """The history as it stood at ``cutoff``: calls not returned by then become pending."""
    cut: list[TraceLine] = []
    for event in events:
        if (event.invoke_ns or 0) > cutoff:
            continue
        if event.return_ns is None or event.return_ns > cutoff:
            if declaration_of(event.op).changes_state:  # a pending query changes nothing
                cut.append(replace(event, return_ns=None, outcome=None))
        else:
            cut.append(event)
    return cut


class _Minimizer:
    """Decides whether sub-histories of a failing window fail, within one shared budget."""

    def __init__(
        self,
        starts: Sequence[Checkpoint],
        store_layers: int,
        budget: int | None,
        tick: Callable[[], None] | None,
    ) -> None:
        self.starts: Final = starts
        self.store_layers: Final = store_layers
        self.remaining = budget
        self.tick: Final = tick

    def fails(self, events: Sequence[TraceLine]) -> bool:
        """True if ``events`` has no valid order; False if it has one or the budget ran out."""
        if self.remaining is not None and self.remaining <= 0:
            return False
        result = search(
            self.starts,
            events,
            store_layers=self.store_layers,
            budget=self.remaining,
            tick=self.tick,
            first_end_only=True,
        )
        if self.remaining is not None:
            self.remaining -= result.nodes
        return result.complete and not result.ends


def minimal_failing_window(
    starts: Sequence[Checkpoint],
    events: Sequence[TraceLine],
    *,
    store_layers: int,
    budget: int | None = DEFAULT_BUDGET,
    tick: Callable[[], None] | None = None,
) -> list[TraceLine]:
    """A small sub-history of a failing window that is itself not linearizable.

    The shortest time prefix that fails, then without the calls it does not
    need among those that change no state (see the module docstring for why
    both cuts keep it failing). Every search of the minimisation shares one
    budget (``budget``, at most :data:`MINIMIZE_BUDGET`); when it runs out, the
    smallest window known to fail so far is returned.
    """
    minimizer = _Minimizer(
        starts,
        store_layers,
        MINIMIZE_BUDGET if budget is None else min(budget, MINIMIZE_BUDGET),
        tick,
    )
    cutoffs = sorted({e.return_ns for e in events if e.return_ns is not None})
    low, high = 0, len(cutoffs) - 1
    while low < high:  # the earliest cut-off that fails; failing is monotone in time
        middle = (low + high) // 2
        if minimizer.fails(_cut_at(events, cutoffs[middle])):
            high = middle
        else:
            low = middle + 1
    window = _cut_at(events, cutoffs[low]) if cutoffs else list(events)
    if window != list(events) and not minimizer.fails(window):
        return list(events)  # the budget got in the way: the whole window is known to fail
    removable = [e for e in window if changes_no_state(e)]
    without_all = [e for e in window if not changes_no_state(e)]
    if removable and without_all and minimizer.fails(without_all):
        return without_all
    for event in reversed(removable):
        without = [e for e in window if e is not event]
        if without and minimizer.fails(without):
            window = without
    return window


def explain(
    starts: Sequence[Checkpoint],
    window: Sequence[TraceLine],
    *,
    store_layers: int,
    budget: int | None = DEFAULT_BUDGET,
    tick: Callable[[], None] | None = None,
) -> str:
    """A timeline of ``window`` and where the search got stuck, for a human."""
    ordered = sorted(window, key=lambda e: e.invoke_ns or 0)
    base = (ordered[0].invoke_ns or 0) if ordered else 0
    lines = [
        f"no order of these {len(ordered)} calls is allowed by the spec from the "
        f"window's start state{'s' if len(starts) != 1 else ''} ({len(starts)}); "
        "times in microseconds from the first invocation:"
    ]
    for event in ordered:
        end = "pending" if event.return_ns is None else f"{(event.return_ns - base) / 1e3:9.1f}"
        lines.append(
            f"  thread {event.thread:>2}  [{((event.invoke_ns or 0) - base) / 1e3:9.1f}, "
            f"{end:>9}]  op {event.call:<8} {describe(event)}"
        )
    timeline = Window(ordered, store_layers)
    fields = _fields_only(starts, timeline, budget=budget, tick=tick)
    if fields is not None:
        lines.append(fields)
        return "\n".join(lines)
    result = search(starts, ordered, store_layers=store_layers, budget=budget, tick=tick)
    if result.deepest_state is not None:
        lines.extend(_stuck_lines(result, timeline))
    return "\n".join(lines)


def _fields_only(
    starts: Sequence[Checkpoint],
    window: Window,
    *,
    budget: int | None,
    tick: Callable[[], None] | None,
) -> str | None:
    """If ``window`` fits the spec once what its handles showed is ignored, the first
    handle field that does not fit along such an order; else ``None``."""
    events = window.events
    if all(event.shows is None for event in events):
        return None
    blind = [replace(event, shows=None) for event in events]
    layers = window.store_layers
    found = search(
        starts, blind, store_layers=layers, budget=budget, tick=tick, first_end_only=True
    )
    if not found.ends:
        return None
    witness = next(iter(found.ends.values()))
    state, names = starts[witness.start].state, starts[witness.start].names
    for index in witness.order:
        event = events[index]
        stepped = step(state, names, event, window.issuing, store_layers=layers)
        if stepped is None:
            predicted = predicted_outcome(state, names, event, window.issuing, store_layers=layers)
            return (
                "their ids, errors and values fit the spec in some order, but not what the "
                f"handles they handed out showed; in one such order:\n  op {event.call:<8} "
                f"{describe(event)}; the spec: {predicted}"
            )
        state, names = stepped
    return None


def _stuck_lines(result: SearchResult, window: Window) -> list[str]:
    total = window.required.bit_count()
    lines = [
        f"the search linearized at most {result.deepest} of the {total} completed calls; "
        "after that, none of the calls that could come next has the outcome the spec gives:"
    ]
    deepest = result.deepest_state
    assert deepest is not None, "called with a search that expanded a configuration"
    for i in window.candidates(result.deepest_mask):
        event = window.events[i]
        predicted = predicted_outcome(
            deepest.state, deepest.names, event, window.issuing, store_layers=window.store_layers
        )
        lines.append(f"  op {event.call:<8} {describe(event)}; the spec: {predicted}")
    return lines
