"""pytest plugin for mutation runs only: a mutant's tests run fastest first.

mutmut 3.8.1 runs a mutant with ``-x`` on the tests that cover its
function, so a kill comes when the first failing test is reached. The
tests' own ``conftest.py`` starts the slow tests first (to balance
``pytest -n auto``'s workers), so a mutant of a function every test reaches
(``PoolConfig.__post_init__``, ``allocate``) first ran the two half-minute
Hypothesis machines and the other slow tests, 80-140 s here, before the
quick test that kills it.

This plugin sorts the collected tests by the duration mutmut measured in its
stats run (``mutmut-stats.json`` in the working directory, which is
``mutants/`` during a run). The verdict cannot change: the same tests run, a
survivor still runs every one of them, and a killed mutant is killed by
whichever failing test comes first. Only the time to a kill shortens.
Tests without a recorded duration keep their order, after the timed ones.
Outside a mutant's run (the stats run, or a plain ``pytest``) the order is
left alone.

Loaded through ``pytest_plugins`` by ``mutation.mutmut_spec_names``, so that
mutmut's configuration fingerprint, and with it the ledger of verdicts,
stays valid. Sorting is O(n log n) in the number of collected tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path

import pytest

STATS_FILE = Path("mutmut-stats.json")
MUTANT_VARIABLE = "MUTANT_UNDER_TEST"
MUTANT_NAME_MARK = "__mutmut_"


def _durations_by_test() -> dict[str, float]:
    """mutmut's measured seconds per test id, keyed as pytest's node ids here."""
    try:
        stats = json.loads(STATS_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    durations = stats.get("duration_by_test", {})
    return {str(test): float(seconds) for test, seconds in durations.items()}


def _in_a_mutant_run() -> bool:
    """Whether a mutant is switched on (mutmut's other runs set words such as ``stats``)."""
    return MUTANT_NAME_MARK in os.environ.get(MUTANT_VARIABLE, "")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Generator[None, None, None]:
    """Reorder ``items`` in place, fastest measured test first.

    A wrapper, so that it sorts after every other implementation: the tests'
    own ``conftest.py`` puts the slow tests first (for ``pytest -n auto``),
    and as a plain ``trylast`` hook this one ran before it.
    """
    yield
    if not _in_a_mutant_run():
        return
    durations = _durations_by_test()
    if not durations:
        return
    unmeasured = float("inf")
    items.sort(key=lambda item: durations.get(item.nodeid, unmeasured))
