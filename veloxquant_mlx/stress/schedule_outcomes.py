"""What a schedule of a scenario shows, and every outcome the spec allows it.

An *outcome* is every call's result plus the pool's final observable state
(stats, history, free counts, every handle's fields and liveness,
``blocks_for`` of every owner named, ``id_bound``), with handles named by
where they were checked out rather than by object, so that outcomes of
different schedules, and of the spec, compare with ``==``.
:func:`allowed_outcomes` runs the scenario's calls through the executable
spec in every merge of the threads' program orders; a schedule is correct
when its outcome is one of those.

Complexity: ``allowed_outcomes`` runs the spec once per merge (the
multinomial of the threads' call counts). Thread safety: pure functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from veloxquant_mlx.memory.block_pool import AllocationStats
from veloxquant_mlx.stress.schedule_scenarios import ReadStats, Scenario, Step
from veloxquant_mlx.testing.operations import (
    Allocate,
    apply_to_spec,
)
from veloxquant_mlx_spec import model, transitions

__all__ = [
    "HandleName",
    "Outcome",
    "Result",
    "allowed_outcomes",
    "owners_named",
    "program_orders",
    "stats_tuple",
    "streams",
]

#: A handle's name, stable across schedules: ``(-1, 0, n)`` for the n-th setup
#: handle, ``(thread, step, position)`` for one a scenario thread checked out.
HandleName = tuple[int, int, int]

#: One call's result, comparable across schedules and with the spec.
Result = tuple[str, object]


@dataclass(frozen=True)
class Outcome:
    """Every call's result and the final observable state, with handles by name."""

    results: tuple[tuple[Result, ...], ...]
    final: tuple[object, ...]


def stats_tuple(stats: AllocationStats | model.StatsView) -> tuple[int, ...]:
    if isinstance(stats, model.StatsView):
        in_use, fragmented = stats.blocks_in_use, stats.fragmented_count
    else:
        in_use, fragmented = stats.blocks_in_use(), stats._fragmented_count
    return (
        stats.n_blocks,
        stats.n_allocations,
        stats.n_frees,
        stats.n_reused,
        stats.n_exhausted,
        stats.n_grown,
        stats.n_retired,
        stats.peak_blocks_in_use,
        in_use,
        fragmented,
    )


def owners_named(scenario: Scenario) -> tuple[int, ...]:
    steps = [*scenario.setup, *itertools.chain.from_iterable(scenario.threads)]
    owners = {getattr(step, "owner", None) for step in steps}
    return tuple(sorted(owner for owner in owners if model.is_int(owner)))


def streams(config: model.SpecConfig) -> tuple[str, ...]:
    return model.stream_names(config)


def spec_step(state: model.PoolState, step: Step) -> tuple[model.PoolState, object]:
    """Apply one step to the spec; ``ReadStats`` reads the spec's stats view."""
    if isinstance(step, ReadStats):
        return state, model.stats(state)
    return apply_to_spec(state, step)


def spec_outcome(scenario: Scenario, base: model.PoolState, order: Sequence[int]) -> Outcome:
    """What the spec shows after running the threads' steps in ``order`` (thread indices)."""
    state = base
    names: dict[int, HandleName] = {h: (-1, 0, h) for h in range(len(base.handles))}
    results: list[list[Result]] = [[] for _ in scenario.threads]
    for thread in order:
        step_index = len(results[thread])
        state, result = spec_step(state, scenario.threads[thread][step_index])
        if isinstance(result, model.Err):
            results[thread].append(("raised", result.kind.value))
        elif isinstance(step := scenario.threads[thread][step_index], Allocate):
            assert isinstance(result, tuple)
            for position, handle in enumerate(result):
                names[handle] = (thread, step_index, position)
            results[thread].append(("blocks", tuple(state.handles[h].block_id for h in result)))
        elif isinstance(step, ReadStats):
            assert isinstance(result, model.StatsView)
            results[thread].append(("stats", stats_tuple(result)))
        else:
            results[thread].append(("returned", result))
    handles = tuple(
        (
            names[h],
            view.block_id,
            view.stream,
            view.format,
            view.n_used,
            view.owner,
            view.owner is not None,
        )
        for h, view in enumerate(state.handles)
    )
    owners = []
    for owner in owners_named(scenario):
        held = transitions.blocks_for(state, owner)
        assert not isinstance(held, model.Err)
        owners.append((owner, tuple(names[h] for h in held)))
    final = (
        stats_tuple(model.stats(state)),
        tuple(stats_tuple(entry) for entry in state.history),
        tuple((s, transitions.n_free(state, s)) for s in streams(state.config)),
        tuple(sorted(handles)),
        tuple(owners),
        transitions.id_bound(state),
    )
    return Outcome(tuple(map(tuple, results)), final)


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


def allowed_outcomes(scenario: Scenario, base: model.PoolState) -> dict[Outcome, tuple[int, ...]]:
    """Each outcome some sequential order allows, with the first order giving it."""
    allowed: dict[Outcome, tuple[int, ...]] = {}
    for order in program_orders([len(steps) for steps in scenario.threads]):
        allowed.setdefault(spec_outcome(scenario, base, order), order)
    return allowed
