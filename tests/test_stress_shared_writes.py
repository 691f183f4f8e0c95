"""A store write races a pool call that changes whether its block is shared.

A store refuses a write to a shared block (``ValueError``; the block is
read-only until ``make_writable``). Whether a write succeeds therefore
depends on every concurrent call that changes its block's count: another
thread's ``free_all`` of an owner that shares the block makes it writable,
another thread's ``fork`` of such an owner makes it read-only again. The
linearizability checker must put a recorded write where its outcome holds,
so that the storage replay of the linearization (which refuses writes to
shared blocks too) gives the outcome that was recorded.

Each history below is one a stress run can record (thread 0 writes to its
private owner's block; thread 1 calls only on the shared owner 0 and on its
own private owner), with the write's interval overlapping the call that
changed the count, in both orders of invocation.
"""

from __future__ import annotations

import pytest

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress.checker import LinearizabilityChecker
from veloxquant_mlx.stress.replay import LinearizedReplay
from veloxquant_mlx.testing.aliasing import spec_config
from veloxquant_mlx.testing.storage_backends import numpy_backend
from veloxquant_mlx.testing.store_operations import Write
from veloxquant_mlx.testing.traces import StoreSpec, TraceLine
from veloxquant_mlx_spec.operations import Allocate, FreeAll, Share
from veloxquant_mlx_spec.table import Outcome, Raised, Returned, h

POOL = PoolConfig(block_size=4, n_blocks=8)
STORE = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=2, dtype="float32")
HISTORY_LEN = 4
PRIVATE, SHARED, OTHER_PRIVATE = 1000, 0, 2000
REFUSED = Raised("ValueError")


def line(  # noqa: PLR0917 -- a timed line's fields, in the order they are read
    op_id: int, thread: int, call: object, start: int, end: int, outcome: Outcome
) -> TraceLine:
    return TraceLine(call, op_id, outcome, thread, start, end)


def shared_with_owner_0() -> list[TraceLine]:
    """Thread 0 allocates to its owner, then shares that block with the shared owner."""
    return [
        line(0, 0, Allocate("k", 4, PRIVATE), 0, 10, Returned((0,))),
        line(2, 0, Share((h(0, 0),), SHARED), 20, 30, Returned((0,))),
    ]


def linearize_and_replay(history: list[TraceLine]) -> LinearizedReplay:
    """Check ``history`` and replay its linearization on a NumPy store, as a stress run does."""
    replay = LinearizedReplay(POOL, STORE, numpy_backend(), None, HISTORY_LEN)
    checker = LinearizabilityChecker(
        spec_config(POOL), HISTORY_LEN, store=STORE, on_commit=replay.feed
    )
    assert checker.check(history) is None, checker.violation
    checker.finish()
    return replay


@pytest.mark.parametrize("write_invoked_first", [False, True])
def test_a_write_that_succeeded_goes_after_the_free_that_unshared_its_block(
    write_invoked_first: bool,
) -> None:
    """free_all(0) released the other handle, then the write went through."""
    write_start, free_start = (40, 41) if write_invoked_first else (41, 40)
    history = [
        *shared_with_owner_0(),
        line(4, 0, Write(0, h(0, 0), 0, 4), write_start, 60, Returned(None)),
        line(5, 1, FreeAll(SHARED), free_start, 50, Returned(None)),
    ]
    replay = linearize_and_replay(history)
    assert replay.failure is None, replay.failure
    assert replay.ops_replayed == len(history)


@pytest.mark.parametrize("write_invoked_first", [False, True])
def test_a_write_that_was_refused_goes_after_the_share_that_shared_its_block(
    write_invoked_first: bool,
) -> None:
    """Thread 1 shared thread 0's block (it can name the handle), then the write was refused."""
    write_start, share_start = (40, 41) if write_invoked_first else (41, 40)
    history = [
        line(0, 0, Allocate("k", 4, PRIVATE), 0, 10, Returned((0,))),
        line(2, 0, Write(0, h(0, 0), 0, 4), write_start, 60, REFUSED),
        line(3, 1, Share((h(0, 0),), OTHER_PRIVATE), share_start, 50, Returned((0,))),
    ]
    replay = linearize_and_replay(history)
    assert replay.failure is None, replay.failure
    assert replay.ops_replayed == len(history)
