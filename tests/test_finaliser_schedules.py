"""The finaliser of a dropped cache fires inside the pool's locked section, on purpose.

``veloxquant_mlx.stress.finaliser_schedules`` runs one scenario under every
interleaving of its lock acquisitions, with the victim book dropped at
every line any thread executes in the pool's module while holding the
pool's lock. The real book passes everywhere; two planted finalisers, one
that frees under the lock it may already hold and one that forgets, are
caught on the first run.
"""

from __future__ import annotations

import pytest

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
    [violation] = explore_finaliser(ForgetsInTheFinaliser).violations
    assert "4 blocks still in use" in violation


def test_a_budget_cut_is_inconclusive_and_the_command_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not explore_finaliser(max_runs=5).exhaustive
    assert main(["--max-runs", "5"]) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_the_command_refuses_a_budget_that_is_not_a_positive_integer(bad: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--max-runs", bad])
    assert exit_.value.code == 2
