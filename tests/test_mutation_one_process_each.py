"""mutation/one_process_each.py: each mutant in its own pytest process, its verdict kept,
and a run with mutants left untried is inconclusive."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import load_mutation_script

NAMES = [f"pkg.x_f__mutmut_{index}" for index in (1, 2, 3)]
#: Mutant 1 fails a test (killed), 2 passes (survived), 3 hangs (timeout).
FAKE_TEST = """
import os, time

def test_the_mutant_under_test():
    assert os.environ["VELOXQUANT_HYPOTHESIS_PROFILE"] == "mutation"
    name = os.environ["MUTANT_UNDER_TEST"]
    if name.endswith("_3"):
        time.sleep(60)
    assert not name.endswith("_1")
"""

#: The named runs (mutants, or "" for the clean run) each write their pid, then hang.
HANGING_TEST = """
import os, pathlib, time

def test_the_mutant_under_test():
    name = os.environ["MUTANT_UNDER_TEST"]
    if name in {hangs!r}:
        pathlib.Path(f"hanging-{{name}}.pid").write_text(str(os.getpid()))
        time.sleep(300)
"""

driver = load_mutation_script("one_process_each")
SCRIPT = Path(__file__).resolve().parent.parent / "mutation" / "one_process_each.py"


@pytest.fixture
def mutants(tmp_path: Path) -> Path:
    root = tmp_path / "mutants"
    root.mkdir()
    (root / "pkg.py.meta").write_text(json.dumps({"exit_code_by_key": dict.fromkeys(NAMES)}))
    (root / "test_fake.py").write_text(FAKE_TEST)
    return root


@pytest.mark.slow(seconds=22)  # the hanging mutant runs to its 20 s timeout
def test_each_mutant_gets_its_verdict_and_a_second_run_reruns_none(
    mutants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    # 20 s: the passing mutant's pytest took over 3 s on a loaded CI machine and was
    # called a timeout; the hanging one sleeps 60 s.
    assert driver.main([*argv, "--timeout", "20"]) == 0
    assert json.loads(results.read_text()) == dict(zip(NAMES, [1, 0, "timeout"], strict=True))
    summary = "1 killed, 1 timeout, 1 survived, 0 untried, of 3"
    assert capsys.readouterr().out.strip() == summary
    (mutants / "test_fake.py").write_text("def test_x():\n    raise AssertionError\n")
    assert driver.main(argv) == 0  # every verdict is kept: nothing runs again
    assert capsys.readouterr().out.strip() == summary


def test_mutants_left_untried_make_the_run_inconclusive(
    mutants: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*arguments: object, **options: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_all", interrupted)
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    assert driver.main(argv) == 3
    assert json.loads(results.read_text()) == {}


@pytest.mark.parametrize(
    "tests", ["def test_x():\n    raise AssertionError\n", "def helper():\n    pass\n"]
)
def test_tests_that_do_not_pass_without_a_mutant_try_no_mutant(
    mutants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tests: str
) -> None:
    # A failing test, or none collected, would have counted every mutant as killed.
    (mutants / "test_fake.py").write_text(tests)
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    assert driver.main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "the tests do not pass with no mutant switched on" in line
    assert not results.exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["other.py"], "other.py.meta does not exist"),
        (["pkg.py", "--workers", "0"], "--workers 0 and --timeout 180.0 must be positive"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    mutants: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    named: str,
) -> None:
    argv = [str(mutants), *extra, "--tests", "t.py", "--results", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as ended:
        driver.main(argv)
    assert ended.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert named in line


class StopCase(NamedTuple):
    hangs: tuple[str, ...]  # the runs that hang until stopped
    signal: signal.Signals
    to_the_group: bool  # to the driver's process group (a terminal's), or the driver alone
    workers: int
    kept: dict[str, int] | None  # the verdicts written; None: no results file


STOP_CASES = {
    "ctrl-c at a terminal": StopCase((NAMES[1],), signal.SIGINT, True, 1, {NAMES[0]: 0}),
    "kill -INT of the driver": StopCase((NAMES[1],), signal.SIGINT, False, 1, {NAMES[0]: 0}),
    "kill -TERM of the driver": StopCase((NAMES[1],), signal.SIGTERM, False, 1, {NAMES[0]: 0}),
    "the terminal closed": StopCase((NAMES[1],), signal.SIGHUP, True, 1, {NAMES[0]: 0}),
    "two hanging at once": StopCase(tuple(NAMES[1:]), signal.SIGINT, False, 2, {NAMES[0]: 0}),
    "during the clean run": StopCase(("",), signal.SIGINT, False, 1, None),
}


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("case", STOP_CASES.values(), ids=STOP_CASES)
def test_a_stop_kills_the_tests_running_and_records_no_verdict_for_them(
    mutants: Path, tmp_path: Path, case: StopCase
) -> None:
    # A pytest reached by the Ctrl-C would exit 2, which would have read as a kill; one
    # left running would have kept the driver waiting for its timeout (or, after a
    # SIGTERM or SIGHUP of the driver, run on alone).
    (mutants / "test_fake.py").write_text(HANGING_TEST.format(hangs=case.hangs))
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    command = [sys.executable, str(SCRIPT), *argv, "--workers", str(case.workers)]
    run = subprocess.Popen(
        [*command, "--timeout", "250"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    hanging: list[int] = []
    try:
        hanging += [_pid_written(mutants / f"hanging-{name}.pid", run) for name in case.hangs]
        if case.to_the_group:
            os.killpg(run.pid, case.signal)
        else:
            run.send_signal(case.signal)
        summary, errors = run.communicate(timeout=60)
    finally:
        for pid in [run.pid, *hanging]:  # whatever a failure left running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert run.returncode == 3, errors
    n_kept = len(case.kept or {})
    assert summary == f"0 killed, 0 timeout, {n_kept} survived, {3 - n_kept} untried, of 3\n"
    assert errors.splitlines() == [
        "stopped: the verdicts so far are kept",
        "inconclusive: some mutants were not tried",
    ]
    if case.kept is None:
        assert not results.exists()
    else:
        assert json.loads(results.read_text()) == case.kept
    for pid in hanging:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _pid_written(path: Path, run: subprocess.Popen[str]) -> int:
    """The pid in ``path`` once a test has written it (waits while ``run`` runs)."""
    deadline = time.monotonic() + 120
    while not path.exists() or not path.read_text():
        assert run.poll() is None, "the driver ended before the test hung"
        assert time.monotonic() < deadline, f"no test wrote {path}"
        time.sleep(0.05)
    return int(path.read_text())
