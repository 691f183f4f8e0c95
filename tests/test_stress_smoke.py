"""The stress runner end to end (the smoke profile), and its linearizability checker.

The smoke run goes through the command line exactly as CI runs it and must
finish clean, with every report field filled in; its linearized trace must
replay. The checker is pinned on tiny hand-written histories whose answer
is known: linearizable ones (including one whose next window is decided only
by a later call, and one with a call that never returned) and
non-linearizable ones (two live handles on one block; an order that real
time forbids), with the minimal window reported and a reproducer that
re-checks with one command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx import cli
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.stress import cli as stress_cli
from veloxquant_mlx.stress.checker import LinearizabilityChecker, check_history
from veloxquant_mlx.stress.config import OPERATION_KINDS, OperationMix, profile
from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.stress.linearizability import split_at_quiescent_points
from veloxquant_mlx.stress.recording import EXPECTED_ERRORS
from veloxquant_mlx.stress.reproducer import replay_trace, write_reproducer
from veloxquant_mlx.stress.specstep import compact, initial_checkpoint
from veloxquant_mlx.stress.workload import (
    FOREIGN_OWNER,
    Registry,
    SharedRun,
    Worker,
    named_events,
)
from veloxquant_mlx.testing.aliasing import spec_config
from veloxquant_mlx.testing.traces import Trace, TraceLine, decode_line, encode_line, load
from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.model import SpecConfig
from veloxquant_mlx_spec.operations import Allocate, Free, FreeAll, NFree, Stats
from veloxquant_mlx_spec.table import Outcome, Raised, Returned, h

CONFIG = SpecConfig(block_size=4, n_blocks=8)
POOL = PoolConfig(block_size=4, n_blocks=8)
HISTORY_LEN = 4
SMOKE_BUDGET_SECONDS = 60


def event(  # noqa: PLR0917 -- a timed line's fields, in the order they are read
    op_id: int, thread: int, call: object, start: int, end: int | None, outcome: Outcome | None
) -> TraceLine:
    """A recorded call of ``thread`` from ``start`` to ``end`` (``None``: never returned)."""
    return TraceLine(call, op_id, outcome, thread, start, end)


def ok(value: object = None) -> Returned:
    return Returned(value)


# -- the smoke profile, end to end ---------------------------------------------------------


@dataclass(frozen=True)
class SmokeRun:
    """What ``veloxquant-mlx stress --profile smoke --json`` did."""

    status: int
    report: dict[str, Any]
    out: Path
    seconds: float


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> SmokeRun:
    out = tmp_path_factory.mktemp("smoke")
    stdout = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(stdout):
        status = cli.main(
            ["stress", "--profile", "smoke", "--out", str(out), "--json", "--no-progress"]
        )
    seconds = time.monotonic() - started
    return SmokeRun(status, json.loads(stdout.getvalue()), out, seconds)


@pytest.mark.slow(seconds=8, shares="smoke_run")  # the run, 20 s, is built once
def test_smoke_profile_passes_within_its_budget(smoke_run: SmokeRun) -> None:
    assert smoke_run.status == 0, smoke_run.report["violations"]
    assert smoke_run.report["verdict"] == "ok"
    assert smoke_run.report["ok"] is True
    assert smoke_run.report["violations"] == []
    assert smoke_run.seconds < SMOKE_BUDGET_SECONDS


@pytest.mark.slow(seconds=8, shares="smoke_run")  # the run, 20 s, is built once
def test_smoke_report_counts_every_kind_of_call_and_every_check(smoke_run: SmokeRun) -> None:
    report = smoke_run.report
    assert report["profile"] == "smoke"
    assert report["switch_interval"] == pytest.approx(1e-6)
    assert report["worker_operations"] >= 8_000  # the profile's --ops
    assert report["operations"] > report["worker_operations"]
    for kind in OPERATION_KINDS:
        assert report["operations_by_kind"][kind]["count"] > 0, kind
        assert report["operations_by_kind"][kind]["per_second"] > 0, kind
    for error in EXPECTED_ERRORS:
        assert report["errors_by_kind"].get(error, 0) > 0, error
    assert report["invariant_checks"] > 0
    checked = report["histories_checked"]
    assert checked["events"] == report["operations"]
    assert checked["windows"] > 0
    assert checked["inconclusive_window"] is None
    assert checked["percent_checked"] == 100
    assert report["not_checked"] == []
    assert report["replay"]["backend"] == "mlx"
    assert report["replay"]["ops_replayed"] == report["replay"]["ops_written"] > 0
    assert report["conservation"]["problems"] == []


@pytest.mark.slow(seconds=8, shares="smoke_run")  # the run, 20 s, is built once
def test_smoke_run_leaves_its_reports_and_a_trace_that_replays(
    smoke_run: SmokeRun, capsys: pytest.CaptureFixture[str]
) -> None:
    report, out = smoke_run.report, smoke_run.out
    assert json.loads((out / "report.json").read_text())["operations"] == report["operations"]
    assert "stress smoke: OK" in (out / "summary.txt").read_text()
    # The run replayed all of it already (ops_replayed above); a prefix shows the command.
    header, *calls = (out / "linearized.jsonl").read_text().splitlines()
    prefix = out / "prefix.jsonl"  # a prefix on purpose: its header counts no lines
    uncounted = {key: value for key, value in json.loads(header).items() if key != "lines"}
    prefix.write_text("\n".join([json.dumps(uncounted), *calls[:1000]]) + "\n")
    assert cli.main(["stress", "--replay", str(prefix)]) == 0
    assert "1000 ops replayed on mlx: ok" in capsys.readouterr().out
    # Every call is in the trace, queries and bad arguments included, and replays on the spec.
    assert replay_trace(load(out / "linearized.jsonl"), "spec")[0] is Verdict.OK


def test_python_dash_m_stress_runs_from_the_repository_root() -> None:
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "stress", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--profile" in result.stdout
    assert result.stdout.startswith("usage: python -m stress ")  # its own name, as every alias


def test_stress_rejects_a_bad_mix_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stress", "--mix", "allocate=lots"]) == 2
    assert "allocate=lots" in capsys.readouterr().err


def test_a_mix_of_store_calls_alone_is_refused_it_would_record_no_call() -> None:
    # Writes and gathers use blocks only pool calls hand out: a run of them alone
    # recorded nothing, and one bounded by ops alone never ended.
    store_only = {kind: 0 for kind in OPERATION_KINDS} | {"write": 1, "gather": 1}
    with pytest.raises(ValueError, match="write and gather alone makes no call"):
        OperationMix(store_only)
    assert OperationMix(store_only | {"allocate": 1}).weights["allocate"] == 1


# -- the checker on hand-written histories -------------------------------------------------


@pytest.mark.parametrize("seconds", [-0.5, 3600.5, 1e10, math.inf, math.nan])
def test_a_config_refuses_a_check_interval_outside_0_to_an_hour(seconds: float) -> None:
    # 1e10 s once killed the checker thread (past threading.TIMEOUT_MAX) and the run
    # still said OK.
    with pytest.raises(ValueError, match="check_interval must be from 0 to 3600 seconds"):
        profile("smoke").with_options(check_interval=seconds)


def test_concurrent_allocates_may_take_blocks_in_either_order() -> None:
    history = [
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((1,))),
        event(1, 1, Allocate("k", 4, 2), 1, 11, ok((0,))),
        event(2, 0, Free((h(0, 0),)), 12, 20, ok()),
        event(3, 1, Stats(), 13, 21, ok((8, 2, 1, 0, 0, 0, 0, 2, 1, 0.0))),
    ]
    assert check_history(CONFIG, HISTORY_LEN, history) is None


def test_two_live_handles_on_one_block_are_not_linearizable() -> None:
    history = [
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((0,))),
        event(1, 1, Allocate("k", 4, 2), 1, 11, ok((0,))),
        event(2, 2, Stats(), 2, 5, ok((8, 0, 0, 0, 0, 0, 0, 0, 0, 0.0))),  # fits, before both
        event(3, 0, NFree("k"), 30, 40, ok(2)),
    ]
    violation = check_history(CONFIG, HISTORY_LEN, history)
    assert violation is not None
    # Minimal: the later n_free is cut off in time, the concurrent stats dropped.
    assert [e.call for e in violation.window] == [0, 1]
    assert (
        "allocate('k', 4, 2, 'fp16') -> returned (0,); the spec: returned (1,)" in violation.message
    )


def test_an_order_that_real_time_forbids_is_a_violation() -> None:
    history = [  # A returned before B was invoked, so A took the top block first
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((1,))),
        event(1, 1, Allocate("k", 4, 2), 20, 30, ok((0,))),
    ]
    assert check_history(CONFIG, HISTORY_LEN, history) is not None
    overlapping = [history[0], event(1, 1, Allocate("k", 4, 2), 5, 30, ok((0,)))]
    assert check_history(CONFIG, HISTORY_LEN, overlapping) is None


@pytest.mark.parametrize("reused", [0, 1])
def test_the_order_of_concurrent_frees_is_carried_to_the_next_window(reused: int) -> None:
    """Which block a later allocate gets decides the order of two earlier concurrent frees."""
    history = [
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((0,))),
        event(1, 0, Allocate("k", 4, 2), 20, 30, ok((1,))),
        event(2, 0, Free((h(0, 0),)), 40, 50, ok()),
        event(3, 1, Free((h(1, 0),)), 41, 51, ok()),
        event(4, 0, Allocate("k", 4, 3), 60, 70, ok((reused,))),
    ]
    checker = LinearizabilityChecker(CONFIG, HISTORY_LEN)
    assert checker.check(history) is None
    assert checker.figures.windows == 4  # cut at every quiescent point
    assert checker.figures.max_end_states == 2


def test_a_free_all_that_finds_nothing_first_may_still_come_after_a_concurrent_allocate() -> None:
    """free_all changes nothing at the start, but its order against the allocate matters."""
    history = [
        event(0, 0, Allocate("k", 4, 1), 0, 20, ok((0,))),
        event(1, 1, FreeAll(1), 1, 21, ok()),
        event(2, 0, Stats(), 30, 40, ok((8, 1, 1, 0, 0, 0, 0, 1, 0, 0.0))),  # the block was freed
    ]
    assert check_history(CONFIG, HISTORY_LEN, history) is None


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), spread=st.integers(1, 3))
def test_a_sequential_run_blurred_into_overlapping_calls_stays_linearizable(
    seed: int, spread: int
) -> None:
    """No false alarms: widen each call of a real sequential run around its true moment."""
    pool_config = PoolConfig(block_size=4, n_blocks=8, grow_on_exhaustion=True, max_blocks=12)
    pool = BlockPoolAllocator(pool_config, history_len=HISTORY_LEN)
    foreign = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=2), history_len=0)
    registry: Registry = {}
    shared = SharedRun(
        pool=pool,
        store=None,
        backend=None,
        registry=registry,
        foreign_block=foreign.allocate("k", 1, FOREIGN_OWNER)[0],
        report_violation=_no_violation,
        n_threads=1,
    )
    recorder = ThreadRecorder(0, 1)
    worker = Worker(0, shared, recorder, OperationMix(), seed)
    for _ in range(50):
        worker.step()
    rng = random.Random(seed)
    blurred = [  # call i really happened at 100 * i; the interval only has to contain it
        dataclasses.replace(
            recorded,
            invoke_ns=100 * i - rng.randint(0, 100 * spread),
            return_ns=100 * i + rng.randint(1, 100 * spread),
        )
        for i, recorded in enumerate(named_events(recorder.take(), registry))
    ]
    checker = LinearizabilityChecker(spec_config(pool_config), HISTORY_LEN)
    assert checker.check(blurred) is None
    assert checker.figures.inconclusive_window is None


def _no_violation(kind: str, message: str) -> None:
    raise AssertionError(f"{kind}: {message}")


def test_a_call_that_never_returned_may_or_may_not_have_happened() -> None:
    pending = event(0, 0, Allocate("k", 4, 1), 0, None, None)
    for n in (0, 1):  # allocations seen: without it, then with it
        reader = event(1, 1, Stats(), 5, 9, ok((8, n, 0, 0, 0, 0, 0, n, n, 0.0)))
        assert check_history(CONFIG, HISTORY_LEN, [pending, reader]) is None


def test_a_handle_stale_since_an_earlier_window_is_freed_as_an_invalid_handle() -> None:
    history = [
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((0,))),
        event(1, 0, FreeAll(1), 20, 30, ok()),
        event(2, 1, Free((h(0, 0),)), 40, 50, Raised("InvalidFreeError")),
    ]
    assert check_history(CONFIG, HISTORY_LEN, history) is None
    wrong = [*history[:2], event(2, 1, Free((h(0, 0),)), 40, 50, ok())]
    assert check_history(CONFIG, HISTORY_LEN, wrong) is not None


def test_quiescent_points_split_a_history_only_where_nothing_is_pending() -> None:
    history = [
        event(0, 0, Stats(), 0, 10, ok()),
        event(1, 1, Stats(), 5, 30, ok()),
        event(2, 0, Stats(), 20, 25, ok()),
        event(3, 0, Stats(), 31, 40, ok()),
        event(4, 1, Stats(), 35, None, None),
        event(5, 0, Stats(), 50, 60, ok()),
    ]
    parts = split_at_quiescent_points(history)
    assert [[e.call for e in part] for part in parts] == [[0, 1, 2], [3, 4, 5]]


def test_compaction_drops_stale_handles_and_renumbers_the_live_ones() -> None:
    start = initial_checkpoint(CONFIG, HISTORY_LEN).state
    state, _ = transitions.allocate(start, "k", 8, 1)
    state, _ = transitions.allocate(state, "v", 4, 2)
    state, _ = transitions.free(state, (0,))
    names = (h(10, 0), h(10, 1), h(11, 0))
    compacted = compact(state, names)
    assert compacted.names == (h(10, 1), h(11, 0))
    assert [view.block_id for view in compacted.state.handles] == [1, 4]
    assert transitions.blocks_for(compacted.state, 1) == (0,)


# -- reproducers -----------------------------------------------------------------------------


def _violation_history() -> Sequence[TraceLine]:
    return [
        event(0, 0, Allocate("k", 4, 1), 0, 10, ok((0,))),
        event(1, 1, Allocate("k", 4, 2), 1, 11, ok((0,))),
    ]


def test_a_history_is_trace_lines_and_round_trips_through_json() -> None:
    pending = event(7, 2, Free((h(0, 0), h(3, 1))), 5, None, None)
    for original in [*_violation_history(), pending]:
        assert decode_line(json.dumps(json.loads(encode_line(original)))) == original
    assert '"invoke_ns":5,"return_ns":null' in encode_line(pending)


def test_a_reproducer_is_written_and_still_fails_when_rechecked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    violation = check_history(CONFIG, HISTORY_LEN, _violation_history())
    assert violation is not None
    prefix = tmp_path / "linearized.partial.jsonl"
    header = Trace(POOL, history_len=HISTORY_LEN)
    path = tmp_path / "violation-linearizability.jsonl"
    write_reproducer(path, violation, header, None)
    assert load(path).partial  # without the linearized calls before it
    prefix.write_text('{"trace":"veloxquant-mlx","version":2,"pool":{}}\n')  # no call before
    write_reproducer(path, violation, header, prefix)
    reproducer = load(path)
    assert not reproducer.partial
    assert reproducer.lines == violation.window
    assert replay_trace(reproducer)[0] is Verdict.VIOLATION
    verdict, message = replay_trace(reproducer, "pool")
    assert verdict is Verdict.VIOLATION
    assert "not linearizable" in message
    assert cli.main(["stress", "--replay", str(path)]) == 1
    assert "returned (0,)" in capsys.readouterr().err
    assert cli.main(["replay", str(path), "--on", "spec"]) == 1


def test_runs_that_share_a_default_folder_name_each_write_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the second run of one second was refused: the first's files were in its folder.
    named = tmp_path / "reports" / "stress-smoke-20261202-204149"
    monkeypatch.setattr(stress_cli, "default_out_dir", lambda profile_name: named)
    quick = ["stress", "--ops", "50", "--storage", "none", "--replay-backend", "none"]
    for seed in ("1", "2"):
        assert cli.main([*quick, "--seed", seed, "--no-progress"]) == 0
    reports = [named / "report.json", named.with_name(f"{named.name}-2") / "report.json"]
    assert [json.loads(path.read_text())["seed"] for path in reports] == [1, 2]
