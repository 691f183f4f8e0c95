"""The pool's lock: librt's where librt is installed, ``threading.Lock`` where it is not.

docs/CONTRACT.md (C-THREAD-SAFE) reads the reference's "plain, non-reentrant
``threading.Lock``" as that lock's semantics. These tests pin which lock the
pool takes and two properties a caller could notice: a second acquire by the
holder does not succeed (not reentrant), and another thread may release it.
The fallback test runs only interpreted: the compiled build calls librt's lock
directly, so a compiled wheel requires librt (``build_backend.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

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
