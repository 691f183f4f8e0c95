"""mutation/fastest_first.py: a mutant's tests run fastest first, and nothing else changes."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

MUTATION = Path(__file__).resolve().parent.parent / "mutation"


def load_plugin() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_fastest_first", MUTATION / "fastest_first.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plugin = load_plugin()

DURATIONS = {
    "tests/test_a.py::slow": 9.0,
    "tests/test_b.py::fast": 0.1,
    "tests/test_c.py::mid": 2.0,
}
COLLECTED = ["tests/test_a.py::slow", "tests/test_x.py::unmeasured", "tests/test_b.py::fast"]
COLLECTED += ["tests/test_c.py::mid", "tests/test_y.py::also_unmeasured"]


@dataclass
class FakeItem:
    nodeid: str


def reorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutant: str | None) -> list[str]:
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": DURATIONS}))
    monkeypatch.chdir(tmp_path)
    if mutant is None:
        monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
    else:
        monkeypatch.setenv("MUTANT_UNDER_TEST", mutant)
    return run_hook()


def run_hook() -> list[str]:
    """The wrapper around the other implementations (none here), as pytest drives it."""
    items: list[Any] = [FakeItem(nodeid) for nodeid in COLLECTED]
    wrapper = plugin.pytest_collection_modifyitems(items)
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(None)
    return [item.nodeid for item in items]


def test_a_mutants_tests_run_fastest_first_and_unmeasured_ones_last_in_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = reorder(tmp_path, monkeypatch, "veloxquant_mlx.memory.block_pool.x_f__mutmut_3")
    assert order == [
        "tests/test_b.py::fast",
        "tests/test_c.py::mid",
        "tests/test_a.py::slow",
        "tests/test_x.py::unmeasured",
        "tests/test_y.py::also_unmeasured",
    ]


@pytest.mark.parametrize("run", [None, "stats", "fail", "list_all_tests", ""])
def test_outside_a_mutants_run_the_order_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: str | None
) -> None:
    assert reorder(tmp_path, monkeypatch, run) == COLLECTED


def test_without_readable_statistics_the_order_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mutmut-stats.json").write_text("{not json")
    monkeypatch.setenv("MUTANT_UNDER_TEST", "x_f__mutmut_1")
    assert run_hook() == COLLECTED


def test_the_spec_names_plugin_brings_it_in_without_touching_mutmuts_arguments() -> None:
    source = (MUTATION / "mutmut_spec_names.py").read_text(encoding="utf-8")
    assert 'pytest_plugins = ["mutation.fastest_first"]' in source
