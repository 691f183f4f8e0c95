"""A stress run says OK only when it checked every call; it is bounded; Ctrl-C is clean.

- A window whose search runs out of budget, or checking that runs out of
  time after the calls, makes the verdict inconclusive (exit status 3), with
  what was not checked and why in ``report.json``; the trace stays
  ``linearized.partial.jsonl`` and its replay is inconclusive too.
- A search that would never end is cut by the checking budget, and says so.
- The calls stop within one call per thread of ``duration``, ``ops`` or
  Ctrl-C, however many calls a window was to hold.
- The progress line moves while a long search runs.
- An interrupted run stops its threads, writes its report (verdict
  "interrupted", partial) and a partial trace that never replays as OK.
- OK names the checks the options left out.

No assertion depends on timing: the facts asserted are counts of calls and
the reasons the run gives.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.stress import checker as checker_module
from veloxquant_mlx.stress.checker import (
    InconclusiveCheckError,
    LinearizabilityChecker,
    check_history,
)
from veloxquant_mlx.stress.checking import CheckingBudget, HistoryChecking, WindowQueue
from veloxquant_mlx.stress.config import MAX_WINDOW_OPS, OperationMix, StressConfig, profile
from veloxquant_mlx.stress.conservation import CONSERVATION_OWNER
from veloxquant_mlx.stress.linearizability import SearchResult
from veloxquant_mlx.stress.replay import LinearizedReplay
from veloxquant_mlx.stress.report import summary_text
from veloxquant_mlx.stress.reproducer import replay_trace
from veloxquant_mlx.stress.runner import run_stress
from veloxquant_mlx.stress.specstep import Checkpoint
from veloxquant_mlx.testing.aliasing import spec_config
from veloxquant_mlx.testing.replay_command import replay_paths
from veloxquant_mlx.testing.traces import Trace, TraceLine, load
from veloxquant_mlx_spec.model import SpecConfig
from veloxquant_mlx_spec.operations import Allocate, Stats
from veloxquant_mlx_spec.table import Returned

CONFIG = SpecConfig(block_size=4, n_blocks=8)
HISTORY_LEN = 4


def two_concurrent_allocates() -> list[TraceLine]:
    """A window whose search needs more than one configuration."""
    return [
        TraceLine(Allocate("k", 4, 1), 0, Returned((1,)), 0, 0, 10),
        TraceLine(Allocate("k", 4, 2), 1, Returned((0,)), 1, 1, 11),
        TraceLine(Stats(), 2, Returned((8, 2, 0, 0, 0, 0, 0, 2, 2, 0.0)), 0, 20, 30),
    ]


def quick_config(tmp_path: Path, **changes: object) -> StressConfig:
    """The smoke profile, small and without the store, writing into ``tmp_path``."""
    options: dict[str, object] = {
        "out_dir": tmp_path,
        "ops": 600,
        "storage": "none",
        "replay_backend": "numpy",
        "progress_interval": 0.0,
    }
    options.update(changes)
    return profile("smoke").with_options(**options)


# -- the linearizability checker gives up honestly -----------------------------------------


def test_a_window_over_its_search_budget_is_not_checked_and_says_why() -> None:
    checker = LinearizabilityChecker(CONFIG, HISTORY_LEN, budget=1)
    assert checker.check(two_concurrent_allocates()) is None
    gap = checker.gap()
    assert gap is not None
    assert gap.what.startswith("3 of 3 calls")  # the window given up, and all after it
    assert "search budget of 1 configurations ran out" in gap.why


def test_check_history_raises_rather_than_calling_an_unchecked_history_linearizable() -> None:
    with pytest.raises(InconclusiveCheckError, match="not checked"):
        check_history(CONFIG, HISTORY_LEN, two_concurrent_allocates(), budget=1)
    assert check_history(CONFIG, HISTORY_LEN, two_concurrent_allocates()) is None


def test_a_reproducer_rechecked_past_its_budget_is_inconclusive_not_linearizable() -> None:
    window = tuple(two_concurrent_allocates()[:2])
    reproducer = Trace(PoolConfig(block_size=4, n_blocks=8), lines=window, history_len=HISTORY_LEN)
    assert replay_trace(reproducer, budget=1)[0] is Verdict.INCONCLUSIVE
    assert replay_trace(reproducer)[0] is Verdict.OK


# -- runs ----------------------------------------------------------------------------------


def test_a_run_whose_search_gives_up_is_inconclusive_with_exit_status_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["stress", "--ops", "400", "--search-budget", "1", "--storage", "none"]
    args += ["--replay-backend", "numpy", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(args) == 3
    out = capsys.readouterr().out
    assert out.startswith("stress smoke: INCONCLUSIVE")
    assert "NOT CHECKED: " in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "inconclusive"
    assert report["ok"] is False
    assert report["histories_checked"]["percent_checked"] < 100
    [gap] = report["not_checked"]
    assert "search budget of 1 configurations ran out" in gap["why"]
    assert not (tmp_path / "linearized.jsonl").exists()
    partial = tmp_path / "linearized.partial.jsonl"
    assert json.loads(partial.read_text().splitlines()[0])["partial"] is True
    assert cli.main(["stress", "--replay", str(partial), "--replay-backend", "numpy"]) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out


def test_checking_that_runs_out_of_time_after_the_calls_is_inconclusive(tmp_path: Path) -> None:
    report = run_stress(quick_config(tmp_path, check_budget=1e-9))
    assert report.verdict is Verdict.INCONCLUSIVE
    assert report.findings == ()
    assert any("checking budget of 1e-09 s" in gap.why for gap in report.gaps), report.gaps
    assert report.timing is not None
    assert report.timing.check_budget_seconds == 1e-9


def endless_search(
    starts: Sequence[Checkpoint], events: Sequence[TraceLine], **options: object
) -> SearchResult:
    """A search that never finishes on its own: only its tick can stop it."""
    tick = options["tick"]
    assert callable(tick)
    while True:
        tick()


def test_a_search_that_never_ends_is_cut_by_the_checking_budget_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checker_module, "search", endless_search)
    report = run_stress(quick_config(tmp_path, ops=200, check_budget=0.5))
    assert report.verdict is Verdict.INCONCLUSIVE
    assert report.percent_checked() == 0
    assert any(
        "checking budget of 0.5 s after the last call ran out" in gap.why for gap in report.gaps
    )
    assert report.timing is not None
    assert report.timing.checking_after_calls_seconds >= 0.5  # it had its whole budget


# -- the calls stop within one call per thread, whatever the window ---------------------------


class CountingPool(BlockPoolAllocator):
    """Counts the workers' allocations (not the audit's); sets ``interrupt`` at the ``at``-th."""

    interrupt: threading.Event | None = None
    at = 0

    def __init__(self, config: PoolConfig, *, history_len: int) -> None:
        super().__init__(config, history_len=history_len)
        self.allocations = self.after_interrupt = 0

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        if owner != CONSERVATION_OWNER:
            interrupt = type(self).interrupt
            if interrupt is not None and interrupt.is_set():
                self.after_interrupt += 1
            self.allocations += 1
            if interrupt is not None and self.allocations == self.at:
                interrupt.set()
        return super().allocate(stream, n_tokens, owner, format)


def counting(pools: list[CountingPool]) -> Callable[[PoolConfig, int], BlockPoolAllocator]:
    def factory(config: PoolConfig, history_len: int) -> BlockPoolAllocator:
        pools.append(CountingPool(config, history_len=history_len))
        return pools[-1]

    return factory


THREADS = 4
BIG_WINDOWS = {"window_ops": MAX_WINDOW_OPS, "threads": THREADS, "replay_backend": "none"}


def test_ops_stop_the_calls_inside_a_window_that_would_hold_more(tmp_path: Path) -> None:
    # Two threads, not four: this one window of ~250 calls is checked whole, and with
    # four threads about one history in eight needs a search longer than the 30-s budget
    # (inconclusive); with two, none in 48 took over a second.
    report = run_stress(quick_config(tmp_path, ops=200, **{**BIG_WINDOWS, "threads": 2}))
    # 200 calls, at most one more per thread (a step may record a blocks_for, then its
    # call); a whole window would be 4,000. The report's operations add the barrier's
    # observations and the audit's calls.
    assert 200 <= report.worker_calls <= 200 + 2
    assert report.worker_calls < report.operations < 400
    assert report.verdict is Verdict.OK


def test_a_duration_that_has_passed_stops_the_calls_before_the_window_fills(
    tmp_path: Path,
) -> None:
    pools: list[CountingPool] = []
    config = quick_config(tmp_path, ops=None, duration=1e-9, **BIG_WINDOWS)
    report = run_stress(config.with_options(allocator_factory=counting(pools)))
    assert pools[0].allocations == 0  # checked before the first call, not at the barrier
    assert report.worker_calls == 0
    # No worker call: an OK would vouch for a pool no thread used.
    assert report.verdict is Verdict.INCONCLUSIVE
    assert [gap.what for gap in report.gaps] == ["the pool under the worker threads"]


def test_a_mix_that_draws_only_store_calls_is_inconclusive(tmp_path: Path) -> None:
    # Once OK: every draw was a write, which makes no call while the thread holds no
    # block, so --ops was never reached and only the barriers' queries were checked.
    heavy_writes = OperationMix.parse("write=9223372036854775807")
    config = quick_config(tmp_path, ops=50, duration=2.0, storage="numpy", mix=heavy_writes)
    report = run_stress(config)
    assert report.worker_calls == 0
    assert report.verdict is Verdict.INCONCLUSIVE
    assert "they made no call" in str(report.gaps[0])


def test_ctrl_c_stops_every_worker_within_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools: list[CountingPool] = []
    interrupt = threading.Event()
    monkeypatch.setattr(CountingPool, "interrupt", interrupt)
    monkeypatch.setattr(CountingPool, "at", 20)
    config = quick_config(tmp_path, ops=None, duration=600.0, **BIG_WINDOWS)
    report = run_stress(config.with_options(allocator_factory=counting(pools)), interrupt=interrupt)
    assert report.verdict is Verdict.INTERRUPTED
    # Each of the other workers may be inside one call; a window would hold thousands more.
    assert pools[0].after_interrupt < THREADS


def test_the_progress_line_moves_while_a_long_search_runs() -> None:
    config = spec_config(PoolConfig(block_size=4, n_blocks=8))
    checking = HistoryChecking(
        LinearizabilityChecker(config, HISTORY_LEN),
        LinearizedReplay(PoolConfig(block_size=4, n_blocks=8), profile("smoke").store, None, None),
        WindowQueue(4),
        CheckingBudget(10.0, threading.Event()),
    )
    before = checking.progress_text()
    checking.tick()
    checking.tick()
    assert checking.progress_text() != before
    assert "+2,048 in the window being searched" in checking.progress_text()


def test_an_interrupted_run_stops_cleanly_and_leaves_a_partial_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    interrupt = threading.Event()
    monkeypatch.setattr(CountingPool, "interrupt", interrupt)
    monkeypatch.setattr(CountingPool, "at", 50)
    before = set(threading.enumerate())
    config = quick_config(tmp_path, ops=None, duration=600.0)
    report = run_stress(config.with_options(allocator_factory=counting([])), interrupt=interrupt)
    assert report.verdict is Verdict.INTERRUPTED
    assert set(threading.enumerate()) <= before  # no thread left running
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["verdict"] == "interrupted"
    assert saved["partial"] is True
    assert {gap["what"] for gap in saved["not_checked"]} >= {"the conservation audit"}
    assert not (tmp_path / "linearized.jsonl").exists()
    assert replay_paths([tmp_path / "linearized.partial.jsonl"], "numpy") == 3


# -- the linearized trace ------------------------------------------------------------------


def allocate_event(op_id: int) -> TraceLine:
    return TraceLine(Allocate("k", 4, 1), op_id, Returned((op_id,)), 0, 10 * op_id, 10 * op_id + 5)


@pytest.mark.parametrize("complete", [True, False])
def test_only_a_complete_linearized_trace_loses_its_partial_mark(
    tmp_path: Path, complete: bool
) -> None:
    pool = PoolConfig(block_size=4, n_blocks=8)
    replay = LinearizedReplay(pool, profile("smoke").store, None, tmp_path)
    replay.feed([allocate_event(0), allocate_event(1)])
    replay.close(complete=complete)
    names = sorted(path.name for path in tmp_path.iterdir())
    if complete:
        assert names == ["linearized.jsonl"]
        trace = load(tmp_path / "linearized.jsonl")
    else:
        assert names == ["linearized.partial.jsonl"]
        trace = load(tmp_path / "linearized.partial.jsonl")
    assert trace.partial is not complete
    assert [line.outcome for line in trace.lines] == [Returned((0,)), Returned((1,))]
    assert not any(line.timed for line in trace.lines)  # linearized: in order, no times


def test_a_replay_stopped_by_the_budget_counts_what_it_did_not_replay(tmp_path: Path) -> None:
    pool = PoolConfig(block_size=4, n_blocks=8)
    replay = LinearizedReplay(pool, profile("smoke").store, None, tmp_path)
    replay.feed([allocate_event(0)])
    replay.stop("the checking budget ran out")
    replay.feed([allocate_event(1), allocate_event(2)])
    replay.close(complete=True)  # asked to publish, but it stopped: stays partial
    assert replay.ops_written == 1
    gap = replay.gap()
    assert gap is not None
    assert str(gap) == "2 linearized calls not checked: not saved: the checking budget ran out"
    assert (tmp_path / "linearized.partial.jsonl").exists()


# -- OK says what it covers ------------------------------------------------------------------


def test_ok_names_the_checks_the_options_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["stress", "--ops", "100", "--no-progress", "--out", str(tmp_path)]
    args += ["--replay-backend", "none", "--check-interval", "0", "--storage", "none"]
    assert cli.main(args) == 0
    headline = capsys.readouterr().out.splitlines()[0]
    assert headline.startswith("stress smoke: OK (left out, as asked: ")
    for option in ("--replay-backend none", "--check-interval 0", "--storage none"):
        assert option in headline
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["checks_off"]) == 3


def test_a_run_with_every_check_says_plain_ok(tmp_path: Path) -> None:
    report = run_stress(quick_config(tmp_path, storage="numpy"))
    assert report.verdict is Verdict.OK
    assert report.checks_off == ()
    assert summary_text(report).splitlines()[0] == "stress smoke: OK"


def test_ops_alone_keeps_the_profiles_duration_as_the_wall_time_bound(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["stress", "--ops", "50", "--no-progress", "--storage", "none", "--out", str(tmp_path)]
    assert cli.main([*args, "--replay-backend", "none"]) == 0
    start = capsys.readouterr().err.splitlines()[0]
    assert "until 50 worker calls or 60 s" in start
    assert "wall time at most 90 s" in start


def test_the_share_checked_is_never_rounded_up_to_all(tmp_path: Path) -> None:
    report = run_stress(quick_config(tmp_path, ops=100))
    almost = dataclasses.replace(
        report,
        histories_checked={**report.histories_checked, "events": 99_999, "events_not_checked": 1},
    )
    assert almost.percent_checked_text() == "99.9%"
    assert almost.percent_checked() == 99.999
    assert "(99.9%)" in summary_text(almost)


def test_a_run_shorter_than_the_check_interval_still_checks_the_invariants_once(
    tmp_path: Path,
) -> None:
    # Once such a run reported "invariant checks: 0" beside its OK.
    report = run_stress(quick_config(tmp_path, ops=100, check_interval=3600.0))
    assert report.ok
    assert report.invariant_checks == 1
