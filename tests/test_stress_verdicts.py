"""A stress run says OK only when it checked every call; it is bounded; Ctrl-C is clean.

- A window whose search runs out of budget, or checking that runs out of
  time after the calls, makes the verdict inconclusive (exit status 3), with
  what was not checked and why in ``report.json``; the trace stays
  ``linearized.partial.jsonl`` and its replay is inconclusive too.
- A search that would never end is cut by the checking budget: the run
  ends about ``duration + check_budget`` after it started.
- The progress line moves while a long search runs.
- An interrupted run stops its threads, writes its report (verdict
  "interrupted", partial) and a partial trace that never replays as OK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress import checker as checker_module
from veloxquant_mlx.stress.checker import (
    InconclusiveCheckError,
    LinearizabilityChecker,
    check_history,
)
from veloxquant_mlx.stress.checking import CheckingBudget, HistoryChecking, WindowQueue
from veloxquant_mlx.stress.config import StressConfig, profile
from veloxquant_mlx.stress.history import Allocate, Event, Returned, Stats
from veloxquant_mlx.stress.linearizability import SearchResult
from veloxquant_mlx.stress.replay import LinearizedReplay
from veloxquant_mlx.stress.reproducer import Reproducer, recheck, replay_path, spec_config
from veloxquant_mlx.stress.runner import run_stress
from veloxquant_mlx.stress.specstep import Checkpoint, initial_checkpoint
from veloxquant_mlx.testing.traces import Allocate as TraceAllocate
from veloxquant_mlx.testing.traces import load
from veloxquant_mlx_spec.model import SpecConfig

CONFIG = SpecConfig(block_size=4, n_blocks=8)
HISTORY_LEN = 4


def two_concurrent_allocates() -> list[Event]:
    """A window whose search needs more than one configuration."""
    return [
        Event(0, 0, Allocate("k", 4, 1), 0, 10, Returned((1,))),
        Event(1, 1, Allocate("k", 4, 2), 1, 11, Returned((0,))),
        Event(2, 0, Stats(), 20, 30, Returned((8, 2, 0, 0, 0, 0, 0, 2, 2, 0))),
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
    starts: tuple[Checkpoint, ...] = (initial_checkpoint(CONFIG, HISTORY_LEN),)
    window = tuple(two_concurrent_allocates()[:2])
    reproducer = Reproducer(PoolConfig(block_size=4, n_blocks=8), HISTORY_LEN, starts, window, "")
    assert recheck(reproducer, budget=1)[0] is Verdict.INCONCLUSIVE
    assert recheck(reproducer)[0] is Verdict.OK


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
    starts: Sequence[Checkpoint], events: Sequence[Event], **options: object
) -> SearchResult:
    """A search that never finishes on its own: only its tick can stop it."""
    tick = options["tick"]
    assert callable(tick)
    while True:
        tick()
        time.sleep(0.001)


def test_a_search_that_never_ends_is_cut_so_the_run_ends_within_its_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checker_module, "search", endless_search)
    duration, check_budget = 1.0, 1.0
    config = quick_config(tmp_path, ops=None, duration=duration, check_budget=check_budget)
    started = time.monotonic()
    report = run_stress(config)
    elapsed = time.monotonic() - started
    assert report.verdict is Verdict.INCONCLUSIVE
    assert report.percent_checked() == 0
    # The bound the run promises, with room for one barrier and the thread joins.
    assert elapsed < duration + check_budget + 5.0
    assert report.timing is not None
    assert report.timing.checking_after_calls_seconds >= check_budget


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


def test_an_interrupted_run_stops_cleanly_and_leaves_a_partial_report(tmp_path: Path) -> None:
    interrupt = threading.Event()
    timer = threading.Timer(0.5, interrupt.set)
    timer.start()
    before = set(threading.enumerate())
    report = run_stress(quick_config(tmp_path, ops=None, duration=60.0), interrupt=interrupt)
    timer.join()
    assert report.verdict is Verdict.INTERRUPTED
    assert report.wall_seconds < 30
    assert set(threading.enumerate()) <= before | {timer}  # no thread left running
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["verdict"] == "interrupted"
    assert saved["partial"] is True
    assert {gap["what"] for gap in saved["not_checked"]} >= {"the conservation audit"}
    assert not (tmp_path / "linearized.jsonl").exists()
    verdict, _ = replay_path(tmp_path / "linearized.partial.jsonl", "numpy")
    assert verdict is Verdict.INCONCLUSIVE


# -- the linearized trace ------------------------------------------------------------------


def allocate_event(op_id: int) -> Event:
    return Event(op_id, 0, Allocate("k", 4, 1), 10 * op_id, 10 * op_id + 5, Returned((op_id,)))


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
    assert [op.block_ids for op in trace.ops if isinstance(op, TraceAllocate)] == [(0,), (1,)]


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
