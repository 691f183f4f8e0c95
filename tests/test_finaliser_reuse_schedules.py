"""A dropped book's late release never frees a request that reuses its owner id.

The schedule exploration of ``veloxquant_mlx.stress.finaliser_schedules``
(the finaliser fired at every line the pool runs under its lock, in every
interleaving of two threads) with a thread that claims the *victim's* id:

- ``freed_behind_its_back``: a server ended the victim's request through the
  pool (``pool.free_all(owner)``) and never released the book; a new request
  reuses the id (thread 0: a book on owner 1, three positions) while the
  victim is dropped and drained (thread 1: reads a free count, drains, reads
  it again). The new request must keep its
  blocks whenever the victim's release comes.
- ``claimed_after_the_drop``: the victim holds its id until it is dropped;
  thread 0 claims the id, thread 1 drains. A claim that starts after the
  drop must succeed, also while thread 1 is in the middle of releasing the
  victim (13 of the issue-8 review: the claim finishes that release).

Both: no deadlock, no finaliser error, and after a final drain every block
is back, the id is free and ``check_invariants()`` passes. Schedules are
enumerated with at most two preemptions (the CHESS bound: the unbounded
enumeration, about 29,000 runs, found nothing more and takes 35 s). Two
planted releases (by owner id, as the first version did; and a claim that
ignores an in-flight release) are caught.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pytest

from veloxquant_mlx.memory.block_pool import (
    BlockPoolAllocator,
    InvariantViolationError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from veloxquant_mlx.memory.deferred_release import (
    BookHolding,
    DeferredReleases,
    deferred_releases_for,
    reclaim_dropped_caches,
)
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.stress.controlled_scheduler import (
    ControlledLock,
    ControlledRun,
    next_choices,
    pool_lock_replaced,
)
from veloxquant_mlx.stress.finaliser_schedules import FinaliserDropper

VICTIM: Final = 1
PREEMPTION_BOUND: Final = 2
SCENARIOS: Final = ("freed_behind_its_back", "claimed_after_the_drop")


class ReuseRun:
    """One fresh pool and victim, thread 0 claiming the victim's id, thread 1 draining."""

    def __init__(self, scenario: str, drop_at: int, choices: Sequence[int]) -> None:
        self.pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=16), history_len=0)
        victim = PooledKVCache(self.pool, VICTIM)
        victim.append(3)
        if scenario == "freed_behind_its_back":
            self.pool.free_all(VICTIM)
        self.control = ControlledRun(2, choices, frozenset())
        self.pool_lock = ControlledLock(self.control)
        self.dropper = FinaliserDropper(victim, self.pool_lock, drop_at)
        self.reuser: PooledKVCache | None = None
        self.refused_after_the_drop = False
        self.unraisable: list[str] = []

    def run(self) -> str | None:
        """Run the schedule; what broke, or ``None``."""
        # Both locks are private and Final: swapped for this run only, for controlled ones.
        releases_vars = vars(deferred_releases_for(self.pool))
        real_claim_lock = releases_vars["_claim_lock"]
        releases_vars["_claim_lock"] = ControlledLock(self.control)
        hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        try:
            with pool_lock_replaced(self.pool, self.pool_lock):
                self.control.run([self._reusing, self._draining], line_points=False)
        finally:
            releases_vars["_claim_lock"] = real_claim_lock
            sys.unraisablehook = hook
            self.dropper.holder.clear()  # a run that never reached its drop point
        return self._judge()

    def _reusing(self) -> None:
        sys.settrace(self.dropper.tracer(0))
        dropped_before = not self.dropper.holder
        try:
            book = PooledKVCache(self.pool, VICTIM)
        except OwnerAlreadyActiveError:
            self.refused_after_the_drop = dropped_before
            return
        book.append(3)
        self.reuser = book

    def _draining(self) -> None:
        sys.settrace(self.dropper.tracer(1))
        self.pool.n_free("k")  # locked lines where the victim can be dropped before the drain
        reclaim_dropped_caches(self.pool)
        self.pool.n_free("k")

    def _unraisable(self, report: Any) -> None:
        self.unraisable.append(f"{report.exc_type.__name__}: {report.exc_value}")

    def _judge(self) -> str | None:
        if self.control.failure is not None:
            return self.control.failure
        if self.unraisable:
            return f"a finaliser raised: {self.unraisable[0]}"
        if self.refused_after_the_drop:
            return "the claim of a dropped book's id was refused"
        reclaim_dropped_caches(self.pool)
        if self.reuser is not None:
            try:
                self.reuser.check_invariants()
            except InvariantViolationError as error:
                return f"the request that reused the id lost its blocks: {error}"
            self.reuser.release()
        pool = self.pool
        if pool.stats.blocks_in_use():
            return f"{pool.stats.blocks_in_use()} blocks still in use after the final drain"
        try:
            pool.register_owner(VICTIM)
        except OwnerAlreadyActiveError:
            return f"owner {VICTIM} is still active after the final drain"
        pool.check_invariants()
        return None


@dataclass(frozen=True)
class Exploration:
    runs: int
    drop_points: int
    exhaustive: bool
    violations: tuple[str, ...]


def explore(scenario: str, *, max_runs: int = 20_000) -> Exploration:
    """Every drop point, every schedule within the preemption bound; stops at the first
    violation."""
    violations: list[str] = []
    runs = drop_points = 0
    drop_at, exhaustive = 1, True
    while exhaustive and not violations:
        reached = False
        choices: list[int] | None = []
        while choices is not None and not violations:
            if runs >= max_runs:
                exhaustive = False
                break
            run = ReuseRun(scenario, drop_at, choices)
            problem = run.run()
            runs += 1
            if run.dropper.fired_by is not None:
                reached, drop_points = True, drop_at
            if problem is not None:
                taken = [decision.chosen for decision in run.control.decisions]
                violations.append(f"drop point {drop_at}, choices {taken}: {problem}")
            choices, _ = next_choices(run.control.decisions, PREEMPTION_BOUND)
        if not reached:
            break
        drop_at += 1
    return Exploration(runs, drop_points, exhaustive, tuple(violations))


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_late_release_is_safe_wherever_the_finaliser_fires(scenario: str) -> None:
    result = explore(scenario)
    assert result.violations == ()
    assert result.exhaustive
    assert result.drop_points >= 10, "the finaliser must have fired in many locked sections"


def _release_by_owner_id(
    self: DeferredReleases, pool: BlockPoolAllocator, book: BookHolding
) -> int:
    """Planted: the first version's release, ``free_all`` of the queued owner id."""
    pool.free_all(book.owner)
    return 1


def _no_in_flight(self: DeferredReleases, owner: int) -> None:
    """Planted: a claim that does not see a release another thread is making."""
    return None


PLANTED: Final[dict[str, tuple[str, str, Callable[..., object], str]]] = {
    "release by owner id": (
        "freed_behind_its_back",
        "_release",
        _release_by_owner_id,
        "lost its blocks",
    ),
    "claim blind to an in-flight release": (
        "claimed_after_the_drop",
        "_in_flight_for",
        _no_in_flight,
        "was refused",
    ),
}


@pytest.mark.parametrize(("scenario", "name", "planted", "message"), PLANTED.values(), ids=PLANTED)
def test_a_planted_unsafe_release_is_caught(
    scenario: str,
    name: str,
    planted: Callable[..., object],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(DeferredReleases, name, planted)
    [violation] = explore(scenario).violations
    assert message in violation
