"""mutation/one_process_each.py: each mutant in its own pytest process, its verdict kept,
and a run with mutants left untried is inconclusive."""

from __future__ import annotations

import json
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


driver = load_mutation_script("one_process_each")


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
