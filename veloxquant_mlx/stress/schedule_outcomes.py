"""What a schedule of a scenario shows, and every outcome the spec allows it.

An *outcome* is every call's outcome plus the pool's final observable state
(every handle's fields and every query the table observes: stats, history,
free counts, ``blocks_for`` of every owner named, ``is_live``, ``id_bound``),
as :mod:`veloxquant_mlx.testing.sides` gives them for the pool and the spec
alike, with handles named by the call that returned them: setup call ``i``
is labelled ``i``, step ``s`` of thread ``t`` :func:`label` ``(t, s)``. So
outcomes of different schedules, and of the spec, compare with ``==``.
:func:`allowed_outcomes` runs the scenario's calls through the executable
spec in every merge of the threads' program orders; a schedule is correct
when its outcome is one of those.

Complexity: ``allowed_outcomes`` runs the spec once per merge (the
multinomial of the threads' call counts). Thread safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from veloxquant_mlx.stress.schedule_scenarios import Scenario
from veloxquant_mlx.testing.sides import PoolSide, SpecSide, observe, query_plan
from veloxquant_mlx_spec.table import Outcome, named_values, observation_ops

__all__ = ["ScheduleOutcome", "allowed_outcomes", "final_state", "label", "program_orders"]


def label(thread: int, step: int) -> int:
    """The label of step ``step`` of thread ``thread`` (the setup's calls are 0, 1, ...)."""
    return 1000 * (thread + 1) + step


@dataclass(frozen=True)
class ScheduleOutcome:
    """Every call's outcome, per thread, and the final observable state."""

    results: tuple[tuple[Outcome, ...], ...]
    final: tuple[object, ...]


def owners_named(scenario: Scenario) -> tuple[int, ...]:
    """The owners the scenario's calls name (their ``blocks_for`` is observed at the end)."""
    steps = [*scenario.setup, *(step for steps in scenario.threads for step in steps)]
    return tuple(sorted({value for op in steps for value in named_values(op)}))


def final_state(scenario: Scenario, side: SpecSide | PoolSide[Any]) -> tuple[object, ...]:
    """What ``side`` shows at the end: every named handle, every observed query."""
    names = sorted(side.names if isinstance(side, SpecSide) else side.objects)
    queries = observation_ops(scenario.config, owners_named(scenario), names)
    return tuple(observe(side, list(map(query_plan, queries)), names))


def spec_outcome(scenario: Scenario, base: SpecSide, order: Sequence[int]) -> ScheduleOutcome:
    """What the spec shows after running the threads' steps in ``order`` (thread indices)."""
    spec = base.copy()
    results: list[list[Outcome]] = [[] for _ in scenario.threads]
    for thread in order:
        step = len(results[thread])
        results[thread].append(spec.call(scenario.threads[thread][step], label(thread, step)))
    return ScheduleOutcome(tuple(map(tuple, results)), final_state(scenario, spec))


def program_orders(lengths: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every merge of the threads' step sequences, as the thread index of each step."""
    if not any(lengths):
        yield ()
        return
    for thread, remaining in enumerate(lengths):
        if remaining:
            rest = [*lengths[:thread], remaining - 1, *lengths[thread + 1 :]]
            for tail in program_orders(rest):
                yield (thread, *tail)


def allowed_outcomes(scenario: Scenario, base: SpecSide) -> dict[ScheduleOutcome, tuple[int, ...]]:
    """Each outcome some sequential order allows, with the first order giving it."""
    allowed: dict[ScheduleOutcome, tuple[int, ...]] = {}
    for order in program_orders([len(steps) for steps in scenario.threads]):
        allowed.setdefault(spec_outcome(scenario, base, order), order)
    return allowed
