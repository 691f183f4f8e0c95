"""mutation/one_process_each.py: each mutant in its own pytest process, its verdict kept,
and a run with mutants left untried is inconclusive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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

#: The named run (a mutant, or "" for the clean run) writes its pid, then hangs.
HANGING_TEST = """
import os, pathlib, time

def test_the_mutant_under_test():
    name = os.environ["MUTANT_UNDER_TEST"]
    if name == {hangs!r}:
        pathlib.Path("hanging.pid").write_text(str(os.getpid()))
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


def test_each_mutant_gets_its_verdict_and_a_second_run_reruns_none(
    mutants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    assert driver.main([*argv, "--timeout", "3"]) == 0
    assert json.loads(results.read_text()) == dict(zip(NAMES, [1, 0, "timeout"], strict=True))
    summary = "1 killed, 1 timeout, 1 survived, 0 untried, of 3"
    assert capsys.readouterr().out.strip() == summary
    (mutants / "test_fake.py").write_text("def test_x():\n    raise AssertionError\n")
    assert driver.main(argv) == 0  # every verdict is kept: nothing runs again
    assert capsys.readouterr().out.strip() == summary


def test_mutants_left_untried_make_the_run_inconclusive(
    mutants: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*arguments: object) -> object:
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


@pytest.mark.parametrize(
    ("hangs", "to_the_group", "kept"),
    [
        (NAMES[1], True, {NAMES[0]: 0}),  # Ctrl-C at a terminal: its whole process group
        (NAMES[1], False, {NAMES[0]: 0}),  # kill -INT of the driver alone
        ("", False, {}),  # during the clean run
    ],
    ids=["at-a-terminal", "to-the-driver-alone", "during-the-clean-run"],
)
def test_ctrl_c_stops_the_tests_running_and_records_no_verdict_for_them(
    mutants: Path, tmp_path: Path, hangs: str, to_the_group: bool, kept: dict[str, int]
) -> None:
    # A pytest reached by the Ctrl-C would exit 2, which would have read as a kill; one
    # left running would have kept the driver waiting for its timeout.
    (mutants / "test_fake.py").write_text(HANGING_TEST.format(hangs=hangs))
    results = tmp_path / "verdicts.json"
    argv = [str(mutants), "pkg.py", "--tests", "test_fake.py", "--results", str(results)]
    command = [sys.executable, str(SCRIPT), *argv, "--workers", "1", "--timeout", "250"]
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        hanging = _pid_written(mutants / "hanging.pid", run)
        if to_the_group:
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.send_signal(signal.SIGINT)
        summary, errors = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 3
    assert summary == f"0 killed, 0 timeout, {len(kept)} survived, {3 - len(kept)} untried, of 3\n"
    assert errors.splitlines() == [
        "stopped: the verdicts so far are kept",
        "inconclusive: some mutants were not tried",
    ]
    assert json.loads(results.read_text()) == kept
    with pytest.raises(ProcessLookupError):
        os.kill(hanging, 0)


def _pid_written(path: Path, run: subprocess.Popen[str]) -> int:
    """The pid in ``path`` once a test has written it (waits while ``run`` runs)."""
    deadline = time.monotonic() + 120
    while not path.exists() or not path.read_text():
        assert run.poll() is None, "the driver ended before the test hung"
        assert time.monotonic() < deadline, f"no test wrote {path}"
        time.sleep(0.05)
    return int(path.read_text())
