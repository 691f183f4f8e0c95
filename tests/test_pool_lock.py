"""The pool's lock: librt's where librt is installed, ``threading.Lock`` where it is not.

docs/CONTRACT.md (C-THREAD-SAFE) reads the reference's "plain, non-reentrant
``threading.Lock``" as that lock's semantics. These tests pin which lock the
pool takes and two properties a caller could notice: a second acquire by the
holder does not succeed (not reentrant), and another thread may release it.
The fallback test runs only interpreted: the compiled build calls librt's lock
directly, so a compiled wheel requires librt (``build_backend.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import make_pool

from veloxquant_mlx.memory import block_pool


def test_the_pool_takes_librts_lock_where_librt_is_installed() -> None:
    librt_threading = pytest.importorskip("librt.threading", reason="librt is not installed")
    assert type(make_pool()._lock) is librt_threading.Lock


def test_the_pools_lock_is_not_reentrant() -> None:
    lock = make_pool()._lock
    assert lock.acquire()
    assert not lock.acquire(False)  # the holder cannot take it again
    lock.release()


def test_another_thread_may_release_the_pools_lock() -> None:
    pool = make_pool()
    lock = pool._lock
    assert lock.acquire()
    releaser = threading.Thread(target=lock.release)
    releaser.start()
    releaser.join()
    assert not lock.locked()
    assert pool.allocate("k", 4, owner=1)  # and the pool takes it again


WITHOUT_LIBRT = """
import sys
sys.modules["librt.threading"] = None  # as where librt is not installed
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=8))
block = pool.allocate("k", 5, owner=1)[0]
pool.mark_used(block, 3)
pool.free_all(1)
pool.check_invariants()
lock_type = type(vars(pool)["_lock"])
print(lock_type.__module__, lock_type.__name__, pool.n_free("k"))
"""


@pytest.mark.skipif(
    block_pool.COMPILED,
    reason="the compiled build calls librt's lock directly, so a compiled wheel requires librt",
)
def test_without_librt_the_pool_takes_threading_lock_and_serves_every_call() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this suite's package
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIBRT], capture_output=True, text=True, check=False, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["_thread", "lock", "4"]


# -- C-THREAD-SAFE: no caller code runs under the lock ---------------------------------------


class LockWatcher:
    """Caller code that notes whether the pool's lock was held when it ran."""

    def __init__(self, pool: block_pool.BlockPoolAllocator) -> None:
        self.pool = pool
        self.held: list[bool] = []

    def note(self) -> None:
        self.held.append(self.pool._lock.locked())


def watching_iterable(watcher: LockWatcher, items: list[object]) -> Iterator[object]:
    watcher.note()
    yield from items


class WatchingList(list[object]):
    watcher: LockWatcher

    def __iter__(self) -> Iterator[object]:
        self.watcher.note()
        return super().__iter__()


class WatchingRepr:
    def __init__(self, watcher: LockWatcher) -> None:
        self.watcher = watcher

    def __repr__(self) -> str:
        self.watcher.note()
        return "<watching>"


class WatchingInt(int):
    """An int subclass whose hash and equality are the caller's code."""

    watcher: LockWatcher

    def __hash__(self) -> int:
        self.watcher.note()
        return int.__hash__(self)

    def __eq__(self, other: object) -> bool:
        self.watcher.note()
        return int.__eq__(self, other)


class WatchingId(WatchingRepr):
    """A hand-built block's id whose hash, equality and repr are the caller's code."""

    def __hash__(self) -> int:
        self.watcher.note()
        return 0  # the hash of the pool's block id 0

    def __eq__(self, other: object) -> bool:
        self.watcher.note()
        return False


def watching_list(watcher: LockWatcher, items: list[object]) -> WatchingList:
    listed = WatchingList(items)
    listed.watcher = watcher
    return listed


def calls_that_run_caller_code(
    pool: block_pool.BlockPoolAllocator, watcher: LockWatcher
) -> list[Callable[[], object]]:
    """Calls whose arguments run code of the caller's: an iterator, a list subclass's
    ``__iter__``, a foreign item's ``__repr__`` in the error that names it."""
    live = pool.allocate("k", 4, owner=1)
    foreign = WatchingRepr(watcher)
    watching_id: Any = WatchingId(watcher)  # not an int, as the signature wants
    hand_built = block_pool.Block(watching_id, "k", owner=1)
    subclassed_id = WatchingInt(0)
    subclassed_id.watcher = watcher
    untyped: Any = pool  # the arguments are not what the signatures want
    return [
        lambda: pool.all_live(watching_iterable(watcher, [*live])),
        lambda: untyped.share(watching_list(watcher, [*live]), 2),
        lambda: untyped.free(watching_list(watcher, [*live])),
        lambda: untyped.free([foreign]),
        lambda: untyped.share([foreign], 3),
        lambda: untyped.share([], foreign),
        lambda: untyped.make_writable(foreign),
        lambda: pool.mark_used(hand_built, 1),  # its repr in the error: unlocked
        lambda: pool.free([hand_built]),
        lambda: pool.is_live(hand_built),  # no note: refused before its id is hashed
        lambda: pool.ref_count(subclassed_id),  # no note: looked up as a plain int
        lambda: pool.is_shared(subclassed_id),
    ]


def test_no_caller_code_runs_while_the_pool_holds_its_lock() -> None:
    """A callback that calls the pool would deadlock on the non-reentrant lock."""
    pool = make_pool()
    watcher = LockWatcher(pool)
    for call in calls_that_run_caller_code(pool, watcher):
        with contextlib.suppress(TypeError, ValueError):
            call()
    assert watcher.held == [False] * 9


class EmptiesTheListOnRelease:
    """The pool's lock, and a caller's thread that empties ``blocks`` the moment the
    pool lets the lock go (in ``free`` and ``share``: before the refusal is raised)."""

    def __init__(self, lock: Any, blocks: list[object]) -> None:
        self.lock = lock
        self.blocks = blocks

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()
        self.blocks.clear()


@pytest.mark.skipif(block_pool.COMPILED, reason="the compiled pool's lock cannot be replaced")
@pytest.mark.parametrize("call", ["free", "share"])
def test_a_refusal_names_the_item_it_checked_though_the_list_changed_after(call: str) -> None:
    # The error is built with the lock released (a foreign item's repr is caller code);
    # it once read the item from the caller's list there: an IndexError, or another item.
    pool = make_pool()
    live, stale = pool.allocate("k", 8, owner=1)
    pool.free([stale])
    blocks: list[object] = [live, stale]
    object.__setattr__(pool, "_lock", EmptiesTheListOnRelease(pool._lock, blocks))
    untyped: Any = pool
    with pytest.raises(block_pool.InvalidFreeError, match=r"^blocks\[1\] = Block\(") as refused:
        untyped.free(blocks) if call == "free" else untyped.share(blocks, 2)
    assert f"block_id={stale.block_id}" in str(refused.value)
    assert blocks == []  # the list did change before the error was made
