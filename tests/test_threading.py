"""One pool shared by many threads: conservation, exact counters, whole-call history.

No assertion depends on timing. Threads start together at a barrier, the
switch interval is shortened to force interleavings, and every check is made
after all threads have joined.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from conftest import make_pool

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    InvalidFreeError,
    OwnerAlreadyActiveError,
)

N_THREADS = 8
ROUNDS = 150
RACE_ROUNDS = 1000


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@dataclass
class WorkerTally:
    """What one worker observed; summed over workers it must match the pool's stats."""

    allocations: int = 0
    exhausted: int = 0
    frees: int = 0
    blocks_handed_out: int = 0
    errors: list[BaseException] = field(default_factory=list)


def run_in_threads(worker: Callable[[int, WorkerTally], None]) -> list[WorkerTally]:
    """Run ``worker(index, tally)`` on N_THREADS threads started at one barrier."""
    tallies = [WorkerTally() for _ in range(N_THREADS)]
    barrier = threading.Barrier(N_THREADS)

    def run(index: int) -> None:
        try:
            barrier.wait()
            worker(index, tallies[index])
        except BaseException as error:  # re-raised in the main thread
            tallies[index].errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [error for tally in tallies for error in tally.errors]
    # A broken barrier is the echo of another thread's failure: report the cause.
    errors.sort(key=lambda error: isinstance(error, threading.BrokenBarrierError))
    if errors:
        raise errors[0]
    return tallies


def race_rounds(
    prepare: Callable[[], None], action: Callable[[int, WorkerTally], None]
) -> list[WorkerTally]:
    """Run ``RACE_ROUNDS`` rounds: ``prepare()`` alone, then ``action`` on every thread at once."""
    barrier = threading.Barrier(N_THREADS, action=prepare)

    def worker(index: int, tally: WorkerTally) -> None:
        try:
            for _ in range(RACE_ROUNDS):
                barrier.wait()
                action(index, tally)
        except BaseException:
            barrier.abort()
            raise

    return run_in_threads(worker)


def churn(pool: BlockPoolAllocator, index: int, tally: WorkerTally) -> None:
    """Allocate, fill, partly free and free_all on this worker's own owner id."""
    rng = random.Random(index)
    owner = index
    block_size = pool.config.block_size
    for _ in range(ROUNDS):
        stream = rng.choice(("k", "v"))
        try:
            blocks = pool.allocate(stream, rng.randint(1, 3 * block_size), owner)
        except BlockPoolExhaustedError:
            tally.exhausted += 1
            continue
        tally.allocations += 1
        tally.blocks_handed_out += len(blocks)
        pool.mark_used(blocks[0], rng.randint(0, block_size))
        if len(blocks) > 1 and rng.random() < 0.5:
            pool.free(blocks[1:])
            tally.frees += 1
        if rng.random() < 0.5:
            pool.free_all(owner)
            tally.frees += 1
    if pool.blocks_for(owner):
        pool.free_all(owner)
        tally.frees += 1


def assert_pool_matches_tallies(pool: BlockPoolAllocator, tallies: list[WorkerTally]) -> None:
    stats = pool.stats
    assert stats.n_allocations == sum(t.allocations for t in tallies)
    assert stats.n_exhausted == sum(t.exhausted for t in tallies)
    assert stats.n_frees == sum(t.frees for t in tallies)
    assert stats.blocks_in_use() == 0
    assert pool.n_free("k") + pool.n_free("v") == stats.n_blocks
    assert stats.fragmentation() == 0.0
    pool.check_invariants()


def blocks_no_interleaving_can_exhaust() -> int:
    """Blocks a stream needs so that no interleaving of the churning workers exhausts it.

    Each worker's calls are fixed by its seed, so as long as no call is refused
    it holds at every moment what it held at the same point of a run alone, at
    most that run's peak (every stream counted). The sum of the peaks is then
    enough for either stream whatever the order, so no call is refused.
    Sizing the pool by a guess (8 blocks a thread) was not enough: the peaks sum
    to more, and slow interleavings (under a tracer) met an exhaustion.
    """
    peaks = 0
    for index in range(N_THREADS):
        alone, tally = make_pool(block_size=4, n_blocks=4096, history_len=0), WorkerTally()
        churn(alone, index, tally)
        assert tally.exhausted == 0  # the premise: the alone run was refused nothing
        peaks += alone.stats.peak_blocks_in_use
    return peaks


def test_threads_churning_a_roomy_pool_conserve_blocks_and_count_every_call() -> None:
    n_blocks = 2 * blocks_no_interleaving_can_exhaust()  # each stream gets half
    pool = make_pool(block_size=4, n_blocks=n_blocks, history_len=0)
    tallies = run_in_threads(lambda index, tally: churn(pool, index, tally))
    assert sum(t.exhausted for t in tallies) == 0
    assert_pool_matches_tallies(pool, tallies)
    assert pool.stats.n_blocks == n_blocks


def test_threads_contending_for_a_tight_pool_count_exhaustion_exactly() -> None:
    pool = make_pool(block_size=4, n_blocks=10, history_len=0)
    tallies = run_in_threads(lambda index, tally: churn(pool, index, tally))
    assert_pool_matches_tallies(pool, tallies)
    assert pool.stats.n_blocks == 10
    assert pool.stats.peak_blocks_in_use <= 10


def test_threads_growing_a_pool_get_distinct_dense_ids() -> None:
    pool = make_pool(block_size=4, n_blocks=0, grow_on_exhaustion=True, history_len=0)
    seen: list[int] = []
    seen_lock = threading.Lock()

    def grow(index: int, tally: WorkerTally) -> None:
        for _ in range(20):
            blocks = pool.allocate("k" if index % 2 else "v", 8, owner=index)
            with seen_lock:
                seen.extend(block.block_id for block in blocks)

    run_in_threads(grow)
    assert sorted(seen) == list(range(N_THREADS * 20 * 2))
    stats = pool.stats
    assert stats.n_grown == stats.n_blocks == N_THREADS * 40
    assert stats.blocks_in_use() == N_THREADS * 40
    pool.check_invariants()


def test_threads_with_a_history_record_one_whole_call_per_entry() -> None:
    pool = make_pool(block_size=4, n_blocks=12, history_len=100_000)
    tallies = run_in_threads(lambda index, tally: churn(pool, index, tally))
    history = list(pool.history)
    calls = sum(t.allocations + t.exhausted + t.frees for t in tallies)
    assert len(history) == calls
    progress = [h.n_allocations + h.n_exhausted + h.n_frees for h in history]
    assert progress == list(range(1, calls + 1))
    assert_pool_matches_tallies(pool, tallies)


def test_concurrent_register_owner_of_one_id_lets_exactly_one_thread_win() -> None:
    pool = make_pool()
    winners: list[int] = []
    losers: list[int] = []
    lock = threading.Lock()

    def register(index: int, tally: WorkerTally) -> None:
        try:
            pool.register_owner(99)
        except OwnerAlreadyActiveError:
            with lock:
                losers.append(index)
        else:
            with lock:
                winners.append(index)

    run_in_threads(register)
    assert len(winners) == 1
    assert len(losers) == N_THREADS - 1


def test_threads_freeing_disjoint_parts_of_one_owner_release_it_once_empty() -> None:
    pool = make_pool(block_size=1, n_blocks=2 * N_THREADS * 4, history_len=0)
    blocks = pool.allocate("k", N_THREADS * 4, owner=7)

    def free_my_share(index: int, tally: WorkerTally) -> None:
        for block in blocks[index::N_THREADS]:
            pool.free([block])

    run_in_threads(free_my_share)
    assert pool.blocks_for(7) == []
    assert pool.stats.n_frees == N_THREADS * 4
    pool.register_owner(7)
    pool.check_invariants()


def assert_history_is_whole_calls(pool: BlockPoolAllocator) -> None:
    """Each history entry is one call later than the one before it, the last one now."""
    progress = [h.n_allocations + h.n_exhausted + h.n_frees for h in pool.history]
    stats = pool.stats
    calls_so_far = stats.n_allocations + stats.n_exhausted + stats.n_frees
    assert progress == list(range(calls_so_far - len(progress) + 1, calls_so_far + 1))


def test_racing_frees_of_one_handle_free_it_exactly_once() -> None:
    pool = make_pool(block_size=1, n_blocks=2)
    current: list[Block] = []

    def prepare() -> None:
        pool.check_invariants()
        current[:] = pool.allocate("k", 1, owner=1)

    def free_the_current_block(index: int, tally: WorkerTally) -> None:
        try:
            pool.free(list(current))
        except InvalidFreeError:
            return
        tally.frees += 1

    tallies = race_rounds(prepare, free_the_current_block)
    assert sum(t.frees for t in tallies) == RACE_ROUNDS
    stats = pool.stats
    assert stats.n_frees == stats.n_allocations == RACE_ROUNDS
    assert pool.n_free("k") == 1
    assert stats.blocks_in_use() == 0
    assert_history_is_whole_calls(pool)
    pool.check_invariants()


def test_racing_free_and_free_all_of_one_owner_free_each_block_once() -> None:
    n_blocks_held = N_THREADS // 2
    pool = make_pool(block_size=1, n_blocks=2 * n_blocks_held)
    current: list[Block] = []

    def prepare() -> None:
        assert pool.blocks_for(1) == []
        assert pool.n_free("k") == n_blocks_held
        pool.check_invariants()
        current[:] = pool.allocate("k", n_blocks_held, owner=1)

    def free_one_or_all(index: int, tally: WorkerTally) -> None:
        if index >= n_blocks_held:
            pool.free_all(1)
            return
        try:
            pool.free([current[index]])
        except InvalidFreeError:
            return

    race_rounds(prepare, free_one_or_all)
    assert pool.blocks_for(1) == []
    assert pool.n_free("k") == n_blocks_held
    assert pool.stats.blocks_in_use() == 0
    assert all(block.owner is None for block in current)
    assert_history_is_whole_calls(pool)
    pool.check_invariants()
