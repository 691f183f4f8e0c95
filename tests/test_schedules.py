"""Systematic schedules: every interleaving of small scenarios, and planted races found.

The explorer (``veloxquant_mlx.stress.schedules``) runs each scenario under
every schedule of its scheduling points and checks each against the spec's
sequential orders. Here: the real allocator passes every scenario; two
planted races, one per granularity, are found on every run with the same
failing schedule, which replays; and the scheduler itself finds a textbook
lost update and a lock-order deadlock.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Callable, Sequence

import pytest

from veloxquant_mlx.commandline import progress
from veloxquant_mlx.commandline.interrupts import InterruptRequest
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.memory.block_pool import AllocationStats, Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.stress.controlled_scheduler import (
    ControlledLock,
    ControlledRun,
    next_choices,
    pool_lock_replaced,
)
from veloxquant_mlx.stress.schedules import (
    SCENARIOS,
    Exploration,
    Scenario,
    explore,
    replay,
)
from veloxquant_mlx.stress.schedules_command import FINALISER
from veloxquant_mlx.stress.schedules_command import main as schedules_main


class CheckThenActAllocator(BlockPoolAllocator):
    """Planted race: counts the free blocks under the lock, drops it, then pops them."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        simple = stream in ("k", "v") and type(n_tokens) is int and n_tokens > 0
        n_needed = -(-n_tokens // self.config.block_size) if simple else 0
        if not simple or self.n_free(stream) < n_needed:
            return super().allocate(stream, n_tokens, owner, format)
        with self._lock:  # the bug: the blocks counted above may be gone by now
            free_list = self._free_lists[stream]
            block_ids = [free_list.pop() for _ in range(n_needed)]
            return self._check_out(block_ids, stream, owner, format, n_tokens)


class UnlockedStatsAllocator(BlockPoolAllocator):
    """Planted race: ``stats`` copies the live counters without taking the lock."""

    @property
    def stats(self) -> AllocationStats:
        return self._stats.snapshot()


def check_then_act(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
    return CheckThenActAllocator(config, history_len=history_len)


def unlocked_stats(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
    return UnlockedStatsAllocator(config, history_len=history_len)


def scenario(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)


def test_scenarios_have_two_or_three_threads_of_a_few_calls() -> None:
    assert len(SCENARIOS) >= 5
    for each in SCENARIOS:
        assert 2 <= len(each.threads) <= 3
        assert all(1 <= len(steps) <= 3 for steps in each.threads)


@pytest.mark.parametrize("each", SCENARIOS, ids=lambda s: s.name)
def test_every_lock_level_schedule_of_a_scenario_matches_a_sequential_order(
    each: Scenario,
) -> None:
    result = explore(each)
    assert result.violations == ()
    assert result.exhaustive
    assert result.outcomes_seen == result.outcomes_allowed, "some sequential order was never run"


LINE_LEVEL = ("two_threads_take_the_last_block", "free_vs_shrink", "stats_read_during_allocate")


@pytest.mark.parametrize("name", LINE_LEVEL)
def test_line_level_schedules_with_one_preemption_match_a_sequential_order(name: str) -> None:
    result = explore(scenario(name), granularity="line", max_preemptions=1)
    assert result.violations == ()
    assert result.schedules > explore(scenario(name)).schedules


def assert_found(result: Exploration) -> tuple[int, ...]:
    assert len(result.violations) == 1, "the explorer stops at the first violation"
    return result.violations[0].choices


def test_planted_check_then_act_race_is_found_on_every_run_by_the_same_schedule() -> None:
    race = scenario("two_threads_take_the_last_block")
    first, second = explore(race, check_then_act), explore(race, check_then_act)
    assert assert_found(first) == assert_found(second)
    assert first.schedules == second.schedules
    violation = first.violations[0]
    assert "IndexError" in violation.message  # the loser popped an empty free list
    assert any("at acquire" in line for line in violation.trace)
    assert replay(race, violation.choices, check_then_act) == violation


def test_an_exploration_stopped_at_its_first_violation_says_so_not_a_budget() -> None:
    # Once its gap said "the max_schedules budget ran out", which it had not.
    result = explore(scenario("two_threads_take_the_last_block"), check_then_act)
    assert result.gap is not None
    assert result.gap.why == "it stopped at its first violation"


def test_the_check_then_act_schedule_is_harmless_on_the_real_allocator() -> None:
    race = scenario("two_threads_take_the_last_block")
    choices = assert_found(explore(race, check_then_act))
    assert replay(race, choices) is None


def test_planted_unlocked_stats_read_is_found_at_line_granularity_every_run() -> None:
    race = scenario("stats_read_during_allocate")
    runs = [explore(race, unlocked_stats, granularity="line", max_preemptions=1) for _ in "ab"]
    assert assert_found(runs[0]) == assert_found(runs[1])
    violation = runs[0].violations[0]
    assert "no sequential order" in violation.message  # a torn snapshot, not a crash
    assert replay(race, violation.choices, unlocked_stats, granularity="line") == violation


def test_unlocked_stats_read_is_invisible_at_lock_granularity() -> None:
    result = explore(scenario("stats_read_during_allocate"), unlocked_stats)
    assert result.violations == ()
    assert result.exhaustive


def test_a_preemption_bound_cuts_the_exploration_and_says_so() -> None:
    each = scenario("register_owner_race")
    bounded, full = explore(each, max_preemptions=0), explore(each)
    assert not bounded.exhaustive
    assert full.exhaustive
    assert bounded.schedules < full.schedules
    # The bound is the check's stated scope: every schedule within it ran.
    assert bounded.complete
    assert bounded.verdict is Verdict.OK


def test_running_out_of_max_schedules_is_inconclusive_not_ok() -> None:
    result = explore(scenario("register_owner_race"), max_schedules=3)
    assert result.schedules == 3
    assert result.violations == ()
    assert not result.complete
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.gap is not None
    assert "max_schedules budget ran out" in result.gap.why


def test_the_command_exits_3_when_a_scenario_ran_out_of_schedules(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert schedules_main(["--max-schedules", "3"]) == 3
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out
    assert "NOT CHECKED: schedules of " in out


def test_the_command_refuses_a_compiled_allocator_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_pool, "COMPILED", True)
    assert schedules_main(["--scenario", "register_owner_race"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert "needs the interpreted allocator" in line
    assert "block_pool.COMPILED is True" in line


@pytest.mark.parametrize(
    "option", [["--max-preemptions", "0"], ["--granularity", "line"], ["--granularity", "lock"]]
)
def test_the_scope_options_are_refused_for_the_finaliser_scenario_alone(
    capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    # It runs every drop point of every schedule whatever they say: once silently ignored.
    assert schedules_main(["--scenario", "finaliser_inside_the_lock", *option]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert f"{option[0]} {option[1]} has no effect on finaliser_inside_the_lock alone" in line


def progress_counts(err: str, shape: str) -> list[int]:
    """Each stderr line's count (group 1 of ``shape``); every line must have that shape."""
    matches = [re.fullmatch(shape, line) for line in err.splitlines()]
    assert all(matches), err
    return [int(match[1].replace(",", "")) for match in matches if match is not None]


def test_the_command_prints_a_progress_line_on_stderr_once_the_interval_passes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    name = "allocate_vs_free_all_of_one_owner"  # 90 schedules
    assert schedules_main(["--scenario", name]) == 0
    captured = capsys.readouterr()
    every = progress.PROGRESS_CLOCK_EVERY
    counts = progress_counts(captured.err, rf"  {name}: ([\d,]+) schedules, \d+ s")
    assert counts == list(range(every, 91, every))
    assert " schedules, " not in captured.out  # stdout keeps its rows only


def test_the_finaliser_scenario_prints_a_progress_line_once_the_interval_passes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    assert schedules_main(["--scenario", FINALISER, "--max-runs", "40"]) == 3
    captured = capsys.readouterr()
    every = progress.PROGRESS_CLOCK_EVERY
    shape = rf"  {FINALISER}: drop point \d+, ([\d,]+) runs, \d+ s"
    assert progress_counts(captured.err, shape) == list(range(every, 41, every))
    assert " runs, 0 s" not in captured.out


@pytest.mark.slow(seconds=4)
def test_the_command_exits_0_when_every_schedule_within_the_bound_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Every lock-level scenario, named: by default the command also explores the finaliser
    # scenario to the end (over a minute here), which test_finaliser_schedules.py does.
    named = [option for each in SCENARIOS for option in ("--scenario", each.name)]
    assert schedules_main([*named, "--max-preemptions", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == [each.name for each in SCENARIOS], out
    assert "every schedule with <= 1 preemptions" in out


def test_a_schedule_that_does_not_fit_the_scenario_is_refused() -> None:
    with pytest.raises(RuntimeError, match="does not belong to this scenario"):
        replay(scenario("free_vs_shrink"), [2])


# ---- the scheduler alone ---------------------------------------------------------


def explore_bodies(
    make_bodies: Callable[[ControlledRun], Sequence[Callable[[], None]]],
    n_threads: int,
) -> list[ControlledRun]:
    """Run every schedule of some thread bodies (fresh bodies per schedule)."""
    runs: list[ControlledRun] = []
    choices: list[int] | None = []
    while choices is not None:
        run = ControlledRun(n_threads, choices, frozenset())
        run.run(make_bodies(run), line_points=False)
        runs.append(run)
        choices, _ = next_choices(run.decisions, None)
    return runs


def test_scheduler_finds_the_lost_update_of_a_read_then_write_increment() -> None:
    finals: set[int] = set()

    def make_bodies(run: ControlledRun) -> list[Callable[[], None]]:
        lock, counter = ControlledLock(run), [0]

        def increment() -> None:
            with lock:
                seen = counter[0]
            with lock:
                counter[0] = seen + 1
                finals.add(counter[0]) if len(finals) < 10 else None

        return [increment, increment]

    runs = explore_bodies(make_bodies, 2)
    assert all(run.failure is None for run in runs)
    assert 1 in finals, "some schedule loses one of the two updates"


def test_a_replaced_pool_lock_serves_the_hot_paths_and_is_put_back_after_an_error() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    real_lock = vars(pool)["_lock"]
    taken: list[str] = []

    class CountingLock(ControlledLock):
        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            taken.append("acquire")
            return True

        def release(self) -> None:
            taken.append("release")

    counting = CountingLock(ControlledRun(1, [], frozenset()))
    with pytest.raises(KeyError), pool_lock_replaced(pool, counting):
        pool.mark_used(pool.allocate("k", 3, owner=1)[0], 2)
        pool.free_all(1)
        raise KeyError("a run that fails")
    assert taken == ["acquire", "release"] * 3  # allocate, mark_used, free_all
    assert vars(pool)["_lock"] is real_lock
    assert pool.allocate("k", 3, owner=2)  # the real lock again
    assert not real_lock.locked()


def test_two_pools_locks_replaced_at_once_each_go_back_to_their_own_lock() -> None:
    first, second = (BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8)) for _ in "ab")
    real_locks = [vars(first)["_lock"], vars(second)["_lock"]]
    stand_ins = [ControlledLock(ControlledRun(1, [], frozenset())) for _ in "ab"]
    with pool_lock_replaced(first, stand_ins[0]), pool_lock_replaced(second, stand_ins[1]):
        assert [vars(first)["_lock"], vars(second)["_lock"]] == stand_ins
    assert [vars(first)["_lock"], vars(second)["_lock"]] == real_locks


def test_a_compiled_allocator_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
    real_lock = vars(pool)["_lock"]
    monkeypatch.setattr(block_pool, "COMPILED", True)
    stand_in = ControlledLock(ControlledRun(1, [], frozenset()))
    with (
        pytest.raises(RuntimeError, match=r"block_pool\.COMPILED is True"),
        pool_lock_replaced(pool, stand_in),
    ):
        pass
    assert vars(pool)["_lock"] is real_lock


def test_scheduler_reports_a_lock_order_deadlock() -> None:
    def make_bodies(run: ControlledRun) -> list[Callable[[], None]]:
        first, second = ControlledLock(run), ControlledLock(run)

        def nested(outer: ControlledLock, inner: ControlledLock) -> Callable[[], None]:
            def body() -> None:
                with outer, inner:
                    pass

            return body

        return [nested(first, second), nested(second, first)]

    failures = [run.failure for run in explore_bodies(make_bodies, 2) if run.failure]
    assert failures
    assert all(failure.startswith("deadlock") for failure in failures)


class SendsCtrlC(BlockPoolAllocator):
    """Sends the process a SIGINT from its first allocate: inside a controlled thread's call."""

    sent = False

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        if not SendsCtrlC.sent:
            SendsCtrlC.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return super().allocate(stream, n_tokens, owner, format)


def test_ctrl_c_inside_a_schedule_stops_the_exploration_after_it_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flag is polled between schedules: no KeyboardInterrupt lands in a semaphore."""
    monkeypatch.setattr(SendsCtrlC, "sent", False)
    scenario = next(s for s in SCENARIOS if s.name == "two_threads_take_the_last_block")
    assert not scenario.setup  # the first allocate is a controlled thread's
    with InterruptRequest("schedules") as interrupt:
        result = explore(
            scenario,
            lambda config, history_len: SendsCtrlC(config, history_len=history_len),
            interrupt=interrupt.requested,
        )
    assert SendsCtrlC.sent
    assert result.interrupted
    assert result.schedules == 1  # the schedule in flight ran to its end
    assert result.verdict is Verdict.INTERRUPTED
    assert result.gap is not None
    assert result.gap.why == "interrupted by Ctrl-C"


def test_a_schedule_that_cannot_end_after_ctrl_c_is_left_unfinished_and_uncounted() -> None:
    """Ctrl-C is honoured within INTERRUPT_GRACE_S, not after the 60 s guard's RuntimeError.

    The pool's first allocate sends the SIGINT and then blocks on a real event:
    a thread blocked outside the scheduler never hands the baton on, so the
    schedule in flight cannot end, as in a harness hang.
    """
    sent, unblock = threading.Event(), threading.Event()

    class StuckAfterCtrlC(BlockPoolAllocator):
        def allocate(
            self, stream: str, n_tokens: int, owner: int, format: str = "fp16"
        ) -> list[Block]:
            if not sent.is_set():
                sent.set()
                os.kill(os.getpid(), signal.SIGINT)
                unblock.wait()
            return super().allocate(stream, n_tokens, owner, format)

    scenario = next(s for s in SCENARIOS if s.name == "two_threads_take_the_last_block")
    try:
        with InterruptRequest("schedules") as interrupt:
            result = explore(
                scenario,
                lambda config, history_len: StuckAfterCtrlC(config, history_len=history_len),
                interrupt=interrupt.requested,
            )
    finally:
        unblock.set()  # the parked thread may finish its abandoned run
    assert (result.interrupted, result.schedules) == (True, 0)
    assert result.verdict is Verdict.INTERRUPTED
