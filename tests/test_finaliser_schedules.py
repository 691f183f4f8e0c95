"""The finaliser of a dropped cache fires inside the pool's locked section, on purpose.

``veloxquant_mlx.stress.finaliser_schedules`` runs one scenario under every
interleaving of its lock acquisitions, with the victim book dropped at
every line any thread executes in the pool's module while holding the
pool's lock. The real book passes everywhere; two planted finalisers, one
that frees under the lock it may already hold and one that forgets, are
caught on the first run.
"""

from __future__ import annotations

import os
import signal

import pytest

from veloxquant_mlx.commandline.interrupts import InterruptRequest
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.stress.finaliser_schedules import explore_finaliser, main


class FreesFromTheFinaliser(PooledKVCache):
    """Planted bug: the finaliser calls the pool, which takes the (non-reentrant) lock."""

    def __del__(self) -> None:
        if not self.released:
            self.pool.free_all(self.owner)


class ForgetsInTheFinaliser(PooledKVCache):
    """Planted bug: a dropped book keeps its blocks for ever."""

    def __del__(self) -> None:
        pass


@pytest.mark.slow(seconds=32)
def test_the_finaliser_fired_at_every_locked_line_of_every_schedule_is_safe() -> None:
    result = explore_finaliser()
    assert result.violations == ()
    assert result.exhaustive
    assert result.drop_points > 50  # every line of allocate, free_all, ... under the lock
    assert result.fired_inside_lock > result.runs * 0.9  # the rest ended before their point


def test_a_finaliser_that_frees_under_the_pool_lock_deadlocks_its_own_thread() -> None:
    result = explore_finaliser(FreesFromTheFinaliser)
    assert result.runs == 1
    [violation] = result.violations
    assert "drop point 1" in violation
    assert "deadlock" in violation


def test_a_finaliser_that_forgets_leaves_blocks_in_use() -> None:
    result = explore_finaliser(ForgetsInTheFinaliser)
    [violation] = result.violations
    assert "4 blocks still in use" in violation
    # Once its gap said "the max_runs budget ran out", which it had not.
    assert result.gap is not None
    assert result.gap.why == "it stopped at its first violation"


def test_a_budget_cut_is_inconclusive_and_the_command_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = explore_finaliser(max_runs=5)
    assert not result.exhaustive
    assert result.verdict is Verdict.INCONCLUSIVE
    assert main(["--max-runs", "5"]) == 3
    out = capsys.readouterr().out
    assert "finaliser_inside_the_lock: INCONCLUSIVE: " in out
    assert "NOT CHECKED: the schedules after the first 5 runs not checked: the max_runs" in out


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_the_command_refuses_a_budget_that_is_not_a_positive_integer_in_one_line(
    capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert main(["--max-runs", bad]) == 2
    err = capsys.readouterr().err
    assert err == (
        "python -m veloxquant_mlx.stress.finaliser_schedules: error: argument "
        "--max-schedules/--max-runs: "
        f"expected an int >= 1, got {bad!r} (see --help)\n"
    )


def test_ctrl_c_stops_the_exploration_between_runs_and_raises_nothing() -> None:
    sent: list[bool] = []

    def victim_that_sends_ctrl_c(pool: BlockPoolAllocator, owner: int) -> PooledKVCache:
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return PooledKVCache(pool, owner)

    with InterruptRequest("finaliser") as interrupt:
        result = explore_finaliser(victim_that_sends_ctrl_c, interrupt=interrupt.requested)
    assert (result.runs, result.interrupted, result.exhaustive) == (1, True, False)
    assert result.verdict is Verdict.INTERRUPTED
