"""Every command refuses bad input in one line (status 2) and stops on Ctrl-C in one line (130).

The commands: ``veloxquant-mlx simulate`` and ``stress`` (also ``python -m
stress``), ``python -m veloxquant_mlx.testing.aliasing``, ``...testing.exhaustive``
and ``...stress.schedules``. Bad input is refused before anything is
allocated or written: a huge store header, pool or search is refused by its
estimated size, an ``--out`` that cannot be used leaves nothing behind.
Ctrl-C is sent to real processes, in the middle of their work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from veloxquant_mlx import cli
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress import schedules
from veloxquant_mlx.testing import aliasing, exhaustive
from veloxquant_mlx.testing.traces import StoreSpec, Trace, TraceLine, dumps, save
from veloxquant_mlx_spec.operations import Allocate, Free
from veloxquant_mlx_spec.table import Returned, h

ROOT = Path(__file__).resolve().parents[1]
HEADER = {
    "trace": "veloxquant-mlx",
    "version": 1,
    "pool": {
        "block_size": 4,
        "n_blocks": 8,
        "separate_kv": True,
        "grow_on_exhaustion": False,
        "max_blocks": None,
    },
    "store": {"n_layers": 2, "n_kv_heads": 1, "head_dim": 2, "dtype": "float32"},
}

Main = Callable[[Sequence[str]], int]


def header_with(**store: object) -> str:
    return json.dumps({**HEADER, "store": {**HEADER["store"], **store}}) + "\n"  # type: ignore[dict-item]


def refused(
    capsys: pytest.CaptureFixture[str], main: Main, args: Sequence[str], *fragments: str
) -> str:
    """Run ``main(args)``; it must exit 2 with one error line holding every fragment."""
    assert main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert ": error: " in captured.err
    for fragment in fragments:
        assert fragment in captured.err
    return captured.err


# -- the aliasing replay's command line --------------------------------------------------------


@pytest.mark.parametrize(
    ("contents", "fragment"),
    [
        (None, "No such file or directory"),
        ("", "empty trace"),
        (header_with(dtype="float99"), "got 'float99'"),
        (header_with(n_layers="two"), "n_layers must be an int >= 1, got 'two'"),
        (header_with(n_layers=True), "n_layers must be an int >= 1, got True"),
        (header_with(n_layers=100_000_000_000), "n_layers=100000000000"),
        (header_with() + '{"op": "bogus"}\n', "line 2: 'op' must be one of"),
        ('{"trace": "other"}\n', 'expected a header {"trace": "veloxquant-mlx", "version": 2'),
    ],
    ids=[
        "missing",
        "empty",
        "unknown-dtype",
        "n_layers-two",
        "n_layers-bool",
        "n_layers-huge",
        "bad-op",
        "not-a-trace",
    ],
)
def test_the_aliasing_cli_refuses_a_bad_trace_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], contents: str | None, fragment: str
) -> None:
    path = tmp_path / "trace.jsonl"
    if contents is not None:
        path.write_text(contents)
    refused(capsys, aliasing.main, [str(path)], str(path), fragment)


def test_the_aliasing_cli_refuses_a_folder_and_bfloat16_on_numpy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(capsys, aliasing.main, [str(tmp_path)], "Is a directory")
    path = tmp_path / "bf16.jsonl"
    path.write_text(header_with(dtype="bfloat16"))
    refused(capsys, aliasing.main, [str(path), "--backend", "numpy"], "got 'bfloat16'")


def test_a_bad_trace_among_good_ones_is_refused_before_any_is_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.jsonl"
    save(Trace(PoolConfig(block_size=4, n_blocks=8), StoreSpec(1, 1, 2)), good)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(header_with(dtype="float99"))
    refused(capsys, aliasing.main, [str(good), str(bad), "--backend", "numpy"], "bad.jsonl")


def test_the_aliasing_cli_tells_a_violation_from_bad_input_and_a_partial_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = PoolConfig(block_size=4, n_blocks=8)
    violation = tmp_path / "violation.jsonl"
    ops = (
        TraceLine(Allocate("k", 2, 1), 0),
        TraceLine(Free((h(0, 0),))),
        TraceLine(Free((h(0, 0),)), outcome=Returned(None)),
    )
    save(Trace(pool, StoreSpec(1, 1, 2), ops), violation)
    assert aliasing.main([str(violation), "--backend", "numpy"]) == 1
    assert "FAILED" in capsys.readouterr().err
    partial = tmp_path / "partial.jsonl"
    partial.write_text(dumps(Trace(pool, StoreSpec(1, 1, 2), ops[:2], partial=True)))
    assert aliasing.main([str(partial), "--backend", "numpy"]) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out


# -- stress --------------------------------------------------------------------------------------


def stress(*args: str) -> list[str]:
    return ["stress", "--ops", "100", "--no-progress", *args]


def test_stress_refuses_an_empty_out_rather_than_writing_into_the_current_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    refused(capsys, cli.main, stress("--out", ""), "argument --out", "got ''")
    assert list(tmp_path.iterdir()) == []


def test_stress_refuses_an_out_it_cannot_create_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(capsys, cli.main, stress("--out", "/proc/x"), "'/proc/x'", "cannot be created")
    refused(capsys, cli.main, stress("--out", str(blocker / "x" / "y")), "cannot be created")
    refused(capsys, cli.main, stress("--out", str(blocker)), "is a file")
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


def test_stress_refuses_a_reused_out_unless_forced_and_then_keeps_no_stale_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stale = tmp_path / "violation-linearizability.json"
    stale.write_text('{"stale": true}')
    (tmp_path / "notes.txt").write_text("mine")
    refused(capsys, cli.main, stress("--out", str(tmp_path)), "earlier run's files", "--force")
    assert stale.exists()
    assert cli.main(stress("--out", str(tmp_path), "--force", "--storage", "none")) == 0
    capsys.readouterr()
    assert not stale.exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "ok"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--n-blocks", "100000000000", "--no-grow"], "--n-blocks 100000000000"),
        (["--search-budget", "10000000000"], "--search-budget 10000000000"),
        (["--threads", "0"], "argument --threads: expected an int from 1 to 1024, got '0'"),
        (["--threads", "100000"], "got '100000'"),
        (["--check-budget", "0"], "argument --check-budget: expected a number > 0, got '0'"),
        (["--mix", "allocate=lots"], "allocate=lots"),
    ],
)
def test_stress_refuses_bad_options_before_creating_its_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], fragment: str
) -> None:
    out = tmp_path / "run"
    refused(capsys, cli.main, stress("--out", str(out), *args), fragment)
    assert not out.exists()


def test_stress_replay_refuses_what_is_not_a_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    refused(capsys, cli.main, ["stress", "--replay", str(tmp_path / "nope")], "No such file")
    refused(capsys, cli.main, ["stress", "--replay", str(tmp_path)], "Is a directory")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    refused(capsys, cli.main, ["stress", "--replay", str(garbage)], "not a trace")


# -- simulate, exhaustive, schedules ----------------------------------------------------------


@pytest.mark.parametrize(
    ("main", "args", "fragment"),
    [
        (cli.main, ["simulate", "--n-blocks", "100000000000"], "--n-blocks 100000000000"),
        (cli.main, ["simulate", "--requests", "1000000000000"], "--requests 1000000000000"),
        (exhaustive.main, ["--depth", "-1"], "argument --depth: expected an int >= 0, got '-1'"),
        (exhaustive.main, ["--max-states", "100000000000"], "--max-states 100000000000"),
        (exhaustive.main, ["--scope", "nowhere"], "invalid choice: 'nowhere'"),
        (exhaustive.main, ["--factory", "nowhere:Pool"], "cannot import 'nowhere'"),
        (exhaustive.main, ["--factory", "json"], "expected module:callable, got 'json'"),
        (exhaustive.main, ["--factory", "json:nothing"], "'json' has no 'nothing'"),
        (schedules.main, ["--max-preemptions", "-1"], "got '-1'"),
        (schedules.main, ["--max-schedules", "0"], "got '0'"),
    ],
)
def test_every_other_command_refuses_bad_input_in_one_line(
    capsys: pytest.CaptureFixture[str], main: Main, args: list[str], fragment: str
) -> None:
    refused(capsys, main, args, fragment)


# -- Ctrl-C ---------------------------------------------------------------------------------------


def start(args: Sequence[str], tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'spec'}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


def interrupt(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


def long_trace(path: Path) -> None:
    """A trace that takes far longer to replay than the test waits."""
    pool = PoolConfig(block_size=4, n_blocks=64)
    lines: list[TraceLine] = []
    for call in range(40_000):
        lines.append(TraceLine(Allocate("k", 16, 1), call))
        lines.append(TraceLine(Free(tuple(h(call, i) for i in range(4)))))
    save(Trace(pool, StoreSpec(2, 2, 8), tuple(lines)), path)


def test_ctrl_c_in_a_stress_run_is_one_line_130_and_a_partial_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    process = start(["-m", "stress", "--duration", "120", "--out", str(out), "--no-progress"], ROOT)
    wait_for((out / "linearized.partial.jsonl").exists, "the run start")
    time.sleep(0.5)  # let the workers make some calls
    status, _, err = interrupt(process)
    assert status == 130, err
    assert "Traceback" not in err
    assert "terminate called" not in err
    assert err.splitlines()[-1].startswith("veloxquant-mlx stress: interrupted: after ")
    report = json.loads((out / "report.json").read_text())
    assert (report["verdict"], report["partial"]) == ("interrupted", True)
    assert not (out / "linearized.jsonl").exists()
    assert not [path for path in out.iterdir() if path.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "command",
    ["simulate", "exhaustive", "schedules", "aliasing"],
)
def test_ctrl_c_in_every_other_command_is_one_line_and_130(tmp_path: Path, command: str) -> None:
    if command == "simulate":
        args = ["-m", "veloxquant_mlx", "simulate", "--duration", "2000000", "--no-progress"]
        prog = "veloxquant-mlx"
    elif command == "exhaustive":
        args = ["-m", "veloxquant_mlx.testing.exhaustive", "--profile", "nightly"]
        prog = "veloxquant-mlx exhaustive"
    elif command == "schedules":
        args = ["-m", "veloxquant_mlx.stress.schedules", "--granularity", "line"]
        prog = "veloxquant-mlx schedules"
    else:
        long_trace(tmp_path / "long.jsonl")
        args = ["-m", "veloxquant_mlx.testing.aliasing", "long.jsonl", "--backend", "numpy"]
        prog = "veloxquant-mlx replay"
    process = start(args, tmp_path)
    time.sleep(3.0)  # past the imports, into the work (each command runs for minutes)
    assert process.poll() is None, "the command ended before it could be interrupted"
    status, _, err = interrupt(process)
    assert status == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] in (f"{prog}: interrupted", f"{prog} simulate: interrupted")
