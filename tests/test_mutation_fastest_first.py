"""mutation/fastest_first.py: in mutmut's runs a mutant's tests run fastest first, after
every other reordering, and nothing else changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import load_mutation_script

REPOSITORY = Path(__file__).resolve().parent.parent


plugin = load_mutation_script("fastest_first")

DURATIONS = {
    "tests/test_a.py::slow": 9.0,
    "tests/test_b.py::fast": 0.1,
    "tests/test_c.py::mid": 2.0,
}
COLLECTED = ["tests/test_a.py::slow", "tests/test_x.py::unmeasured", "tests/test_b.py::fast"]
COLLECTED += ["tests/test_c.py::mid", "tests/test_y.py::also_unmeasured"]
FASTEST_FIRST = ["tests/test_b.py::fast", "tests/test_c.py::mid", "tests/test_a.py::slow"]
FASTEST_FIRST += ["tests/test_x.py::unmeasured", "tests/test_y.py::also_unmeasured"]
A_MUTANT = "veloxquant_mlx.memory.block_pool.x_f__mutmut_3"


@dataclass
class FakeItem:
    nodeid: str


def run_hook() -> list[str]:
    """The wrapper around the other implementations' result, as pluggy drives it."""
    items = [FakeItem(nodeid) for nodeid in COLLECTED]
    wrapper = plugin.pytest_collection_modifyitems(items)
    next(wrapper)
    with pytest.raises(StopIteration) as stop:
        wrapper.send(["the others' result"])
    assert stop.value.value == ["the others' result"]  # passed on unchanged
    return [item.nodeid for item in items]


def in_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mutmut_run: str | None) -> None:
    monkeypatch.chdir(tmp_path)
    if mutmut_run is None:
        monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
    else:
        monkeypatch.setenv("MUTANT_UNDER_TEST", mutmut_run)


@pytest.mark.parametrize("mutmut_run", [A_MUTANT, "", "fail"])
def test_in_a_mutants_run_and_the_clean_one_tests_run_fastest_first_unmeasured_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutmut_run: str
) -> None:
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": DURATIONS}))
    in_run(monkeypatch, tmp_path, mutmut_run)
    assert run_hook() == FASTEST_FIRST


@pytest.mark.parametrize("mutmut_run", [None, "stats"])
def test_outside_mutmut_and_in_its_statistics_run_the_order_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutmut_run: str | None
) -> None:
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": DURATIONS}))
    in_run(monkeypatch, tmp_path, mutmut_run)
    assert run_hook() == COLLECTED


@pytest.mark.parametrize(
    "stats_text",
    [None, "{not json", "[1, 2]", '{"other": 1}', '{"duration_by_test": {"t": null}}'],
)
def test_missing_or_unreadable_statistics_leave_the_order_alone_without_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stats_text: str | None
) -> None:
    if stats_text is not None:
        (tmp_path / "mutmut-stats.json").write_text(stats_text)
    in_run(monkeypatch, tmp_path, A_MUTANT)
    assert run_hook() == COLLECTED


CONFTEST_SLOW_FIRST = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.name != "test_slow")  # as tests/conftest.py does
"""
TESTS = "def test_mid(): pass\n\ndef test_slow(): pass\n\ndef test_fast(): pass\n"


@pytest.mark.parametrize(
    ("mutmut_run", "expected"),
    [(A_MUTANT, ["test_fast", "test_mid", "test_slow"]), ("stats", ["test_slow", "test_mid"])],
)
def test_loaded_through_the_spec_names_plugin_it_sorts_after_a_conftests_order(
    tmp_path: Path, mutmut_run: str, expected: list[str]
) -> None:
    """The plugin as mutmut loads it (``-p mutation.mutmut_spec_names``, whose
    ``pytest_plugins`` brings it in), in a pytest process of its own."""
    (tmp_path / "conftest.py").write_text(CONFTEST_SLOW_FIRST)
    (tmp_path / "test_order.py").write_text(TESTS)
    durations = {"test_order.py::test_fast": 0.1, "test_order.py::test_mid": 1.0}
    durations["test_order.py::test_slow"] = 9.0
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": durations}))
    environment = {**os.environ, "MUTANT_UNDER_TEST": mutmut_run}
    environment["PYTHONPATH"] = os.pathsep.join([str(REPOSITORY), str(tmp_path)])
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "mutation.mutmut_spec_names", "-p", "no:xdist", "test_order.py"]
    listed = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    names = [line.rpartition("::")[2] for line in listed if line.startswith("test_order.py::")]
    assert names[: len(expected)] == expected
