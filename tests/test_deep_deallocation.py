"""Handles and stats freed deep inside a chain of deallocations leave the heap intact.

CPython defers a deallocation that happens 50 containers deep (the "trashcan")
by linking the object through its garbage-collector header. A class compiled
by mypyc with ``acyclic=True`` has no such header, yet mypyc's deallocator
still enters the trashcan: at that depth it writes 16 bytes in front of the
object, into another allocation. That corrupted the heap of a CI run (a worker
crashed in the dropped-caches thread test, on the compiled build only).

Each case runs in a child interpreter under ``PYTHONMALLOC=debug``, whose
guard bytes around every allocation turn such a write into a fatal error at
the next free, deterministically. Both builds run it; the compiled one is the
build that can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: CPython's _PyTrash_UNWIND_LEVEL is 50; the depths around it, and well past it.
DEPTHS = (48, 49, 50, 51, 120)

CHILD = textwrap.dedent(
    """
    import sys
    from veloxquant_mlx.memory.block_pool import AllocationStats, Block, BlockPoolAllocator

    pool = BlockPoolAllocator()

    def freed(blocks):
        pool.free(blocks)
        return blocks[0]  # stale now: the nested list holds its last reference

    made = {
        "Block": lambda: Block(7),
        "AllocationStats": lambda: pool.stats,
        "freed handle": lambda: freed(pool.allocate("k", 1, owner=1)),
    }[sys.argv[1]]
    for _ in range(200):
        # Two objects: with a mypyc free list of one (free_list_len=1), the first
        # would be parked before the trashcan; the second still goes through it.
        nested = [made(), made()]
        for _ in range(int(sys.argv[2])):
            nested = [nested]
        del nested
    print("intact")
    """
)


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("kind", ["Block", "freed handle", "AllocationStats"])
def test_an_object_freed_at_trashcan_depth_writes_nothing_outside_itself(
    kind: str, depth: int
) -> None:
    env = {**os.environ, "PYTHONMALLOC": "debug", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(depth)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "intact"), result.stderr[-2000:]
