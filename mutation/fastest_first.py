"""pytest plugin for mutation runs only: a mutant's tests run fastest first.

mutmut 3.8.1 runs a mutant with ``-x`` on the tests that cover its
function, so a kill comes when the first failing test is reached. The
tests' own ``conftest.py`` starts the slow tests first (to balance
``pytest -n auto``'s workers), so a mutant of a function every test reaches
(``PoolConfig.__post_init__``, ``allocate``) first ran the two half-minute
Hypothesis machines and the other slow tests, 80-140 s here, before the
quick test that kills it.

This plugin sorts the collected tests by the duration mutmut measured in its
statistics run (``mutmut-stats.json`` in the working directory, which is
``mutants/`` during a run), in every run mutmut makes but that statistics
run itself: the mutants' runs, and the clean run before them, which checks
that the tests pass unmutated in the very order the mutants see. The same
tests run, so whether a mutant is caught cannot change; which test catches
it first can, and so can the way it is caught (a mutant that makes one
test hang and another fail may time out rather than fail). Tests without a
recorded duration keep their order, after the timed ones. Unreadable
statistics leave the order alone: an error here would fail every mutant's
run, and mutmut would count each one killed. A plain ``pytest`` never
loads this plugin.

Loaded through ``pytest_plugins`` by ``mutation.mutmut_spec_names``, so that
mutmut's configuration fingerprint, and with it the ledger of verdicts,
stays valid. Sorting is O(n log n) in the number of collected tests, plus
one read of the statistics file per run. Thread safety: pytest calls the
hook once per session, from its main thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path

import pytest

STATS_FILE = Path("mutmut-stats.json")
MUTANT_VARIABLE = "MUTANT_UNDER_TEST"
STATISTICS_RUN = "stats"


def _durations_by_test() -> dict[str, float]:
    """mutmut's measured seconds per test id, keyed as pytest's node ids here; empty if
    the file is missing or not what mutmut 3.8.1 writes."""
    try:
        stats = json.loads(STATS_FILE.read_text(encoding="utf-8"))
        durations = stats["duration_by_test"]
        return {str(test): float(seconds) for test, seconds in durations.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _in_a_run_of_mutmut_but_its_statistics() -> bool:
    """mutmut sets the variable in each of its runs (a mutant's name, ``""`` for the clean
    run, ``stats`` for the statistics run, whose order must stay as it is)."""
    return os.environ.get(MUTANT_VARIABLE, STATISTICS_RUN) != STATISTICS_RUN


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Generator[None, object, object]:
    """Reorder ``items`` in place, fastest measured test first.

    A wrapper, so that it sorts after every implementation that is not one: the
    tests' own ``conftest.py`` puts the slow tests first (for ``pytest -n auto``),
    and as a plain ``trylast`` hook this one ran before it.
    """
    result = yield
    if _in_a_run_of_mutmut_but_its_statistics():
        durations = _durations_by_test()
        if durations:
            unmeasured = float("inf")
            items.sort(key=lambda item: durations.get(item.nodeid, unmeasured))
    return result
