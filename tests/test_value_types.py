"""A value of another type than the spec's is a deviation, in every checker.

docs/API.md types what each call returns (``is_live`` a bool, ``n_free`` an
int) and C-NAMES holds a port to it. Python's ``==`` does not: ``1 == True
== 1.0``, so a port answering 1 where the spec answers True once passed
every layer. Outcomes and observations are compared with ``same_value``
(``Returned``'s own ``==``); each planted port here answers the spec's value
in another type, and each checker must say so, naming both types.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from planted_bugs import (
    HandlesShowEverAllocatedAsAnInt,
    IsLiveAnswersAnInt,
    NFreeAnswersAFloat,
    ShrinkAnswersAFloat,
    StatsCountFreesAsAFloat,
    factory_of,
)

from veloxquant_mlx import cli
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory import block_pool
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.stress.reproducer import replay_trace
from veloxquant_mlx.testing.exhaustive import SCOPES, explore
from veloxquant_mlx.testing.port import ALL_CALLS, Port
from veloxquant_mlx.testing.report import conformance_report
from veloxquant_mlx_spec.table import Raised, Returned, same_value

SEPARATE_4 = next(scope for scope in SCOPES if scope.name == "separate-4")
PLANTED = [sys.executable, "-m", "veloxquant_mlx", "driver", "--factory"]

#: Each planted port, and what the exhaustive checker must say about it.
LOOSELY_TYPED = [
    (IsLiveAnswersAnInt, "returned 1 (int); the spec predicts it returned True (bool)"),
    (NFreeAnswersAFloat, "returned 2.0 (float); the spec predicts it returned 2 (int)"),
    (ShrinkAnswersAFloat, "returned 2.0 (float); the spec predicts it returned 2 (int)"),
    (
        HandlesShowEverAllocatedAsAnInt,
        "shows ever_allocated=1 (int); the spec predicts ever_allocated=True (bool)",
    ),
    (StatsCountFreesAsAFloat, "(stats.n_frees is 0.0 (float); the spec predicts 0 (int))"),
]


@pytest.mark.parametrize(
    ("value", "other"),
    [(1, True), (0, False), (1, 1.0), ((0, 1), (0, 1.0)), (((2, True),), ((2, 1),))],
)
def test_equal_values_of_two_types_are_two_outcomes(value: object, other: object) -> None:
    assert value == other  # what Python's == says, and the checkers once said
    assert not same_value(value, other)
    assert Returned(value) != Returned(other)


@pytest.mark.parametrize("value", [True, 3, 0.25, None, "k", (1, (True, 0.0)), [2, (3,)]])
def test_a_value_is_the_same_as_an_equal_value_of_its_own_type(value: object) -> None:
    copy = type(value)(value) if isinstance(value, list | tuple) else value
    assert same_value(value, copy)
    assert Returned(value) == Returned(copy)


def test_an_error_is_still_compared_by_its_class_only() -> None:
    assert Raised("ValueError", "one message") == Raised("ValueError", "another")
    assert Returned(None) != Raised("ValueError")


@pytest.mark.parametrize(
    ("port", "said"), LOOSELY_TYPED, ids=[port.__name__ for port, _ in LOOSELY_TYPED]
)
def test_the_exhaustive_checker_reports_a_value_of_another_type(
    port: type[BlockPoolAllocator], said: str
) -> None:
    found = explore(SEPARATE_4, 2, factory_of(port)).counterexample
    assert found is not None, f"{port.__name__} passed the exhaustive check"
    assert said in found.message


def test_the_conformance_report_files_a_value_of_another_type_under_c_names() -> None:
    report = conformance_report(
        IsLiveAnswersAnInt, errors=block_pool, depth=1, scopes=[SEPARATE_4], examples=5
    )
    assert report.verdict == "deviates"
    assert {(f.rule, f.call, f.field) for f in report.findings} == {
        ("C-NAMES", "is_live", "returned type")
    }
    assert "is_live: returned type: pool 1 (int), spec True (bool)" in report.render()


def test_a_counterexample_of_another_type_fails_its_replay_on_the_port() -> None:
    found = explore(SEPARATE_4, 1, factory_of(ShrinkAnswersAFloat)).counterexample
    assert found is not None
    port = Port(factory_of(ShrinkAnswersAFloat), capabilities=ALL_CALLS)
    verdict, why = replay_trace(found.trace, "pool", port=port)
    assert verdict is Verdict.VIOLATION
    assert "returned 2.0 (float); the spec predicts it returned 2 (int)" in why


@pytest.mark.parametrize(
    ("port", "said"),
    [
        ("IsLiveAnswersAnInt", "returned 1 (int); the spec predicts it returned True (bool)"),
        ("NFreeAnswersAFloat", "returned 2.0 (float); the spec predicts it returned 2 (int)"),
    ],
)
def test_json_keeps_the_type_through_a_driver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], port: str, said: str
) -> None:
    # true is not 1 and 2.0 is not 2 in JSON: the client must not blur what the port said.
    monkeypatch.chdir(Path(__file__).parent)  # the driver imports planted_bugs from here
    driver = shlex.join([*PLANTED, f"planted_bugs:{port}"])
    scope = ["--depth", "1", "--scope", SEPARATE_4.name]
    assert cli.main(["exhaustive", "--driver", driver, *scope]) == 1
    assert said in capsys.readouterr().out
