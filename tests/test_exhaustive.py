"""The small-scope exhaustive checker: the allocator passes it, and it has teeth.

Every operation sequence up to the CI depth, on every scope, runs in
lockstep with the spec (one test per scope, so ``pytest -n auto`` spreads
them). Allocators with planted bugs fail it, and the sequence it reports is
a shortest one: exploring one letter less finds nothing shorter.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import pytest
from planted_bugs import (
    AllocateTakesWholeFloats,
    EmptyFreeCountsAFree,
    FreeChecksTypesLate,
    FreeCountsBlocks,
    FreeListIsFifo,
    GrowthIgnoresCap,
    MarkUsedZeroIsIgnored,
    ReleaseRegistersAnUnknownOwner,
    ShrinkRetiresLowestIds,
    factory_of,
)

from veloxquant_mlx.commandline import progress
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.testing import exhaustive_command
from veloxquant_mlx.testing.exhaustive import (
    PROBE_LETTER,
    PROFILE_DEPTHS,
    SCOPES,
    Scope,
    alphabet,
    canonical_key,
    default_factory,
    explore,
    main,
    probe,
)
from veloxquant_mlx.testing.lockstep import ConformanceError, Lockstep
from veloxquant_mlx_spec import model
from veloxquant_mlx_spec.model import NotABlock
from veloxquant_mlx_spec.operations import (
    Allocate,
    Free,
    MarkUsed,
    Operation,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
)
from veloxquant_mlx_spec.table import ArgKind, declaration_of, declarations, h

SEPARATE_4 = next(scope for scope in SCOPES if scope.name == "separate-4")


@pytest.mark.slow(seconds=40)  # 15-72 s by scope
@pytest.mark.parametrize("scope", SCOPES, ids=[scope.name for scope in SCOPES])
def test_every_sequence_up_to_the_ci_depth_conforms(
    scope: Scope, record_property: Callable[[str, object], None]
) -> None:
    result = explore(scope, PROFILE_DEPTHS["ci"])
    print(result.summary())
    record_property("exhaustive", result.summary())
    assert result.counterexample is None, str(result.counterexample)
    assert result.states > 1_000
    assert len(result.new_states_per_depth) == PROFILE_DEPTHS["ci"]


# ---- planted bugs ------------------------------------------------------------------


# Each bug, a pool, and the shortest sequence that exposes the bug there:
# - counting blocks: a two-block free is the first call where blocks != calls;
# - FIFO: two single frees must leave the higher id on top, and only an
#   allocation shows which id is on top (the merge probe shows it too, when
#   that state is merged into one reached without the bug: see below);
# - lowest ids: shrinking "v" (ids 2, 3) to one block must lower id_bound to 3;
# - empty free: free([]) is a no-op, checked on the fresh pool;
# - cap: the pool starts empty with a cap of 3; two 2-block allocations need
#   4 blocks, so the second must be refused.
# Only the wider alphabet and the probe of no-ops catch the last four:
# - junk after a live handle in free()'s list: the live one must stay live;
# - a wrong type: every bad value of every argument is a letter, 1.0 among them;
# - mark_used(block, 0): 0 is one of n_used's small values;
# - a no-op's hidden effect: release_owner(0) changes nothing the spec shows, so
#   it merges into the state it left; the probe after it (register_owner(0),
#   which must succeed) is what shows the registration it left behind.
PLANTED_BUGS: list[tuple[type[BlockPoolAllocator], str, list[Operation]]] = [
    (FreeCountsBlocks, "separate-4", [Allocate("k", 3, 0, "fp16"), Free((h(0, 1), h(0, 0)))]),
    (
        FreeListIsFifo,
        "separate-4",
        [
            Allocate("k", 3, 0, "fp16"),
            Free((h(0, 0),)),
            Free((h(0, 1),)),
            Allocate("k", 1, 0, "fp16"),
        ],
    ),
    (ShrinkRetiresLowestIds, "separate-4", [Shrink("v", 1)]),
    (EmptyFreeCountsAFree, "shared-4", [Free(())]),
    (
        GrowthIgnoresCap,
        "shared-grow-0-to-3",
        [Allocate("k", 3, 0, "fp16"), Allocate("k", 3, 0, "fp16")],
    ),
    (
        FreeChecksTypesLate,
        "separate-4",
        [Allocate("k", 1, 0, "fp16"), Free((h(0, 0), NotABlock()))],
    ),
    (AllocateTakesWholeFloats, "separate-4", [Allocate("k", 1.0, 0, "fp16")]),
    (MarkUsedZeroIsIgnored, "shared-4", [Allocate("k", 1, 0, "fp16"), MarkUsed(h(0, 0), 0)]),
    (ReleaseRegistersAnUnknownOwner, "shared-4", [ReleaseOwner(0), RegisterOwner(0)]),
]


@pytest.mark.slow(seconds=10)  # 1-25 s by bug
@pytest.mark.parametrize(
    ("buggy", "scope_name", "shortest"),
    PLANTED_BUGS,
    ids=[bug.__name__ for bug, _, _ in PLANTED_BUGS],
)
def test_a_planted_bug_is_reported_with_a_shortest_failing_sequence(
    buggy: type[BlockPoolAllocator], scope_name: str, shortest: list[Operation]
) -> None:
    scope = next(scope for scope in SCOPES if scope.name == scope_name)
    factory = factory_of(buggy)
    result = explore(scope, PROFILE_DEPTHS["ci"], factory)
    print(result.summary(), result.counterexample, sep="\n")
    assert result.counterexample is not None, f"{buggy.__name__} passed the exhaustive check"
    assert list(result.counterexample.operations) == shortest
    assert len(result.counterexample.letters) == len(shortest)
    shorter = explore(scope, len(shortest) - 1, factory).counterexample
    # Every sequence one call shorter passes (a probe may still find the same length).
    assert shorter is None or len(shorter.operations) >= len(shortest)


def test_the_sequence_reported_for_the_fifo_bug_replays_to_the_same_failure() -> None:
    # The sequence the exhaustive check reports for this bug, as the planted-bug test
    # above pins it (exploring again here took 40 s of CI for the same answer).
    reported: list[Operation] = next(
        shortest for bug, _, shortest in PLANTED_BUGS if bug is FreeListIsFifo
    )
    factory = factory_of(FreeListIsFifo)
    lockstep = Lockstep(factory, SEPARATE_4.config, SEPARATE_4.history_len)
    *prefix, last = reported
    for operation in prefix:
        lockstep.apply(operation)
    with pytest.raises(
        ConformanceError, match=r"returned \(0,\); the spec predicts it returned \(1,\)"
    ):
        lockstep.apply(last)


def test_the_merge_probe_shows_a_free_list_order_that_no_observation_shows() -> None:
    # free(h0); free(h1) and free(h0); free_all(0) reach one state, and merge; only the
    # first path meets the FIFO bug, and nothing observable differs until an allocation.
    lockstep = Lockstep(factory_of(FreeListIsFifo), SEPARATE_4.config, SEPARATE_4.history_len)
    for operation in [Allocate("k", 3, 0, "fp16"), Free((h(0, 0),)), Free((h(0, 1),))]:
        lockstep.apply(operation)
    calls = probe(lockstep.state)
    assert [declaration_of(call).name for call in calls] == ["register_owner"] * 2 + [
        "allocate"
    ] * 2
    with pytest.raises(
        ConformanceError, match=r"returned \(0, 1\); the spec predicts it returned \(1, 0\)"
    ):
        for call in calls:
            lockstep.apply(call)


def test_a_no_ops_hidden_effect_is_reported_with_the_probe_call_and_replays() -> None:
    factory = factory_of(ReleaseRegistersAnUnknownOwner)
    found = explore(SEPARATE_4, PROFILE_DEPTHS["ci"], factory).counterexample
    assert found is not None
    assert found.letters == ("release_owner(0)", PROBE_LETTER)
    lockstep = Lockstep(factory, SEPARATE_4.config, SEPARATE_4.history_len)
    lockstep.apply(ReleaseOwner(0))  # nothing to see yet
    with pytest.raises(ConformanceError, match=r"raised OwnerAlreadyActiveError"):
        lockstep.apply(RegisterOwner(0))


# ---- the alphabet ------------------------------------------------------------------


def test_the_alphabet_tries_every_bad_value_of_every_argument() -> None:
    config = SEPARATE_4.config
    letters = alphabet(config)
    for declaration in declarations():
        if not declaration.changes_state:
            continue
        for position, parameter in enumerate(declaration.parameters):
            if parameter.kind is not ArgKind.VALUE:
                continue
            for value in declaration.domains[parameter.name].bad(config):
                assert any(
                    letter.declaration is declaration
                    and type(letter.arguments[position]) is type(value)
                    and letter.arguments[position] == value
                    for letter in letters
                ), f"{declaration.name}: no letter passes {parameter.name}={value!r}"


def test_the_alphabet_puts_each_junk_item_after_a_live_handle_in_a_list() -> None:
    shown = {repr(template) for template in alphabet(SEPARATE_4.config)}
    for junk in ("freed last", "ForeignBlock(owner=None)", "ForeignBlock(owner=0)", "NotABlock()"):
        assert f"free([live[0], {junk}])" in shown


# ---- the canonical key -------------------------------------------------------------


def _state_after(operations: list[Operation]) -> model.PoolState:
    lockstep = Lockstep(default_factory, SEPARATE_4.config, SEPARATE_4.history_len)
    for operation in operations:
        lockstep.apply(operation)
    return lockstep.state


def test_the_key_merges_states_that_differ_only_in_stale_handle_numbering() -> None:
    k_then_v = _state_after(
        [Allocate("k", 1, 0), Allocate("v", 1, 0), Free((h(0, 0),)), Free((h(1, 0),))]
    )
    v_then_k = _state_after(
        [Allocate("v", 1, 0), Allocate("k", 1, 0), Free((h(1, 0),)), Free((h(0, 0),))]
    )
    assert k_then_v != v_then_k  # handle 0 is a "k" block in one, a "v" block in the other
    assert canonical_key(k_then_v, 1) == canonical_key(v_then_k, 0)


def test_the_key_keeps_the_checkout_order_of_live_handles() -> None:
    k_then_v = _state_after([Allocate("k", 1, 0), Allocate("v", 1, 0)])
    v_then_k = _state_after([Allocate("v", 1, 0), Allocate("k", 1, 0)])
    assert canonical_key(k_then_v, None) != canonical_key(v_then_k, None)  # blocks_for differs


def test_the_key_ignores_the_registration_of_an_owner_that_holds_blocks() -> None:
    registered_first = _state_after([RegisterOwner(0), Allocate("k", 1, 0)])
    not_registered = _state_after([Allocate("k", 1, 0)])
    assert registered_first != not_registered
    assert canonical_key(registered_first, None) == canonical_key(not_registered, None)


def test_the_key_keeps_which_stale_handle_was_freed_last() -> None:
    state = _state_after(
        [Allocate("k", 1, 0), Allocate("v", 1, 0), Free((h(0, 0),)), Free((h(1, 0),))]
    )
    assert canonical_key(state, 1) != canonical_key(state, 0)


# ---- command line ------------------------------------------------------------------


def test_main_prints_states_and_transitions_per_scope_as_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--depth", "2", "--json", "--scope", "shared-4", "--scope", "separate-4"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [result["scope"] for result in results] == ["separate-4", "shared-4"]
    assert all(result["states"] > 1 and result["transitions"] > 1 for result in results)
    assert all(result["counterexample"] is None for result in results)


def test_main_prints_one_summary_line_per_scope(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--depth", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(SCOPES)
    assert all("distinct states" in line and "transitions" in line for line in lines)


def test_main_prints_a_progress_line_within_a_depth_once_the_interval_passes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no interval and the clock read every state, each state expanded gets a line."""
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(progress, "PROGRESS_CLOCK_EVERY", 1)
    assert main(["--depth", "2", "--scope", "separate-4"]) == 0
    captured = capsys.readouterr()
    shape = re.compile(
        r"  separate-4: depth (\d): (\d+) of (\d+) states expanded, [\d,]+ states, \d+ s"
    )
    within = [shape.fullmatch(line) for line in captured.err.splitlines() if "expanded" in line]
    assert all(within), captured.err
    expanded = [(int(m[1]), int(m[2]), int(m[3])) for m in within if m is not None]
    at_depth_2 = [(2, n, 14) for n in range(1, 15)]  # separate-4 reaches 14 states at depth 1
    assert expanded == [(1, 1, 1), *at_depth_2]
    assert "expanded" not in captured.out  # stdout keeps its summary lines only


def test_progress_is_due_once_per_interval_and_reads_the_clock_every_few_iterations() -> None:
    now, reads = [0.0], [0]

    def clock() -> float:
        reads[0] += 1
        return now[0]

    throttle = progress.ProgressThrottle(clock)
    every = throttle.clock_every
    assert every > 1
    assert not any(throttle.due() for _ in range(every))  # the interval has not passed
    now[0] = progress.PROGRESS_INTERVAL_S
    assert [throttle.due() for _ in range(every)] == [False] * (every - 1) + [True]
    assert not any(throttle.due() for _ in range(every))  # a line was just due
    assert reads[0] == 1 + 3  # made, then once every ``every`` iterations
    assert throttle.seconds() == progress.PROGRESS_INTERVAL_S


# ---- budgets: cut short is inconclusive, never OK ---------------------------------------


def test_a_state_budget_that_runs_out_makes_the_exploration_inconclusive() -> None:
    result = explore(SEPARATE_4, PROFILE_DEPTHS["ci"], max_states=50)
    assert result.counterexample is None
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.gap is not None
    assert "the budget of 50 distinct states ran out" in result.gap.why
    assert result.gap.what.startswith("sequences of length ")
    assert result.to_json()["verdict"] == "inconclusive"


def test_a_deadline_already_past_checks_nothing_and_says_so() -> None:
    result = explore(SEPARATE_4, 2, deadline=time.monotonic() - 1.0)
    assert result.transitions == 0
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.gap is not None
    assert result.gap.why == "the time budget ran out"


def test_a_budget_large_enough_changes_nothing() -> None:
    assert explore(SEPARATE_4, 2, max_states=10**6).verdict is Verdict.OK


def test_a_bug_found_before_the_budget_runs_out_is_still_a_violation() -> None:
    result = explore(SEPARATE_4, PROFILE_DEPTHS["ci"], factory_of(FreeCountsBlocks), max_states=200)
    assert result.verdict is Verdict.VIOLATION


def test_main_exits_3_when_a_budget_cut_a_scope(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--depth", "3", "--scope", "separate-4", "--max-states", "20"]) == 3
    assert "INCONCLUSIVE (sequences of length" in capsys.readouterr().out


def test_a_huge_depth_ends_at_the_profiles_default_time_budget_inconclusive(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --time-budget given: the profile's default still bounds the search."""
    monkeypatch.setitem(exhaustive_command.DEFAULT_TIME_BUDGETS, "ci", 0.5)
    assert main(["--depth", "99999999", "--scope", "shared-4"]) == 3
    captured = capsys.readouterr()
    assert "and 0.5 s in all" in captured.err  # the budget is stated up front
    assert "INCONCLUSIVE" in captured.out
    assert "the time budget ran out" in captured.out
