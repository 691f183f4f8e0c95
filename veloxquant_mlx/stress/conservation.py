"""End-of-run conservation: no block was lost or duplicated, every block comes back.

After the workers have stopped, :func:`check_conservation` takes stock of
the pool through its public API, recording every call it makes (so the
linearizability checker and the storage replay see them too):

1. every owner's ``blocks_for``: their sizes must add up to
   ``blocks_in_use()``, and no block id may be held twice;
2. ``n_blocks == free + in use``, per the stats and ``n_free`` of each stream;
3. ``free_all`` of every owner: afterwards nothing is in use and every block
   is free;
4. the drain: each stream's free blocks allocated at once must be exactly
   ``n_free`` distinct ids (a duplicated id on a free list shows here), and
   are then freed again;
5. ``check_invariants()``.

Complexity: O(owners + blocks). Thread safety: call it when no other thread
uses the pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator
from veloxquant_mlx.stress.history import ThreadRecorder
from veloxquant_mlx.stress.recording import record_unnamed_call
from veloxquant_mlx_spec.model import STATS_FIELDS, free_list_names
from veloxquant_mlx_spec.operations import Allocate, BlocksFor, FreeAll, NFree, RefCount, Stats
from veloxquant_mlx_spec.table import stats_values

__all__ = ["CONSERVATION_OWNER", "check_conservation"]

#: The owner the drain allocates to; no worker uses it.
CONSERVATION_OWNER: Final = 999_999

_IN_USE: Final = STATS_FIELDS.index("blocks_in_use")
_N_BLOCKS: Final = STATS_FIELDS.index("n_blocks")


class _Auditor:
    """Makes the recorded calls of the audit and collects the problems it finds."""

    def __init__(self, pool: BlockPoolAllocator, recorder: ThreadRecorder) -> None:
        self.pool: Final = pool
        self.recorder: Final = recorder
        self.problems: list[str] = []

    def call(self, op: object) -> Any:
        """Make and record ``op``; its result (``None`` and a problem if it raised)."""
        result = record_unnamed_call(self.recorder, self.pool, op).result
        if isinstance(result, Exception):
            self.problems.append(f"{op!r} raised {result!r}")
            return None
        return result

    def stats(self) -> tuple[float, ...] | None:
        snapshot = self.call(Stats())
        return None if snapshot is None else stats_values(snapshot)

    def n_free(self, stream: str) -> int:
        return int(self.call(NFree(stream)) or 0)

    def blocks_for(self, owner: int) -> list[Block]:
        return list(self.call(BlocksFor(owner)) or [])


def check_conservation(
    pool: BlockPoolAllocator, recorder: ThreadRecorder, owners: Iterable[int]
) -> list[str]:
    """Audit the pool (module docstring); the problems found, each naming what broke.

    Args:
        pool: The pool, no longer used by any other thread.
        recorder: Where the audit's calls are recorded.
        owners: Every owner the run used.
    """
    audit = _Auditor(pool, recorder)
    owners = sorted(set(owners) | {CONSERVATION_OWNER})
    _check_held(audit, owners)
    for owner in owners:
        audit.call(FreeAll(owner))
    _check_all_free(audit)
    _check_drain(audit)
    try:
        pool.check_invariants()
    except AssertionError as error:
        audit.problems.append(f"check_invariants() after the run: {error}")
    return [f"conservation: {problem}" for problem in audit.problems]


def _check_held(audit: _Auditor, owners: list[int]) -> None:
    """Every block in use has one owner, or as many as its reference count says (shared,
    docs/CONTRACT.md#sharing), once each; free + in use == n_blocks."""
    holders: dict[int, list[int]] = {}
    for owner in owners:
        for block in audit.blocks_for(owner):
            holders.setdefault(block.block_id, []).append(owner)
    held = len(holders)
    for block_id, its_owners in holders.items():
        if len(its_owners) == 1:
            continue
        count = audit.call(RefCount(block_id))
        if count != len(its_owners):
            audit.problems.append(
                f"block id {block_id} is held by owners {its_owners} but the pool counts "
                f"{count} handle(s) of it: a block was handed out twice"
            )
    stats = audit.stats()
    if stats is None:
        audit.problems.append("pool.stats raised")
        return
    if held != stats[_IN_USE]:
        audit.problems.append(
            f"the owners hold {held} blocks but blocks_in_use() is {stats[_IN_USE]}: "
            "blocks were lost or counted twice"
        )
    free = sum(audit.n_free(stream) for stream in free_list_names(audit.pool.config))
    if stats[_N_BLOCKS] != free + stats[_IN_USE]:
        audit.problems.append(
            f"n_blocks is {stats[_N_BLOCKS]} but {free} are free and {stats[_IN_USE]} in use"
        )


def _check_all_free(audit: _Auditor) -> None:
    """After every owner's free_all, nothing is in use and every block is free."""
    stats = audit.stats()
    free = sum(audit.n_free(stream) for stream in free_list_names(audit.pool.config))
    if stats is None:
        return
    if stats[_IN_USE] != 0 or free != stats[_N_BLOCKS]:
        audit.problems.append(
            f"after free_all of every owner, {stats[_IN_USE]} blocks are in use and {free} of "
            f"{stats[_N_BLOCKS]} are free; expected 0 and all"
        )


def _check_drain(audit: _Auditor) -> None:
    """Each stream's free blocks, allocated at once, are n_free distinct ids."""
    pool = audit.pool
    seen: set[int] = set()
    for stream in free_list_names(pool.config):
        n_free = audit.n_free(stream)
        if n_free == 0:
            continue
        n_tokens = n_free * pool.config.block_size
        result = audit.call(Allocate(stream, n_tokens, CONSERVATION_OWNER))
        if result is None:
            continue
        ids = [block.block_id for block in result]
        if len(set(ids)) != len(ids) or seen & set(ids):
            audit.problems.append(
                f"the free blocks of stream {stream!r} hold a duplicated id: {sorted(ids)}"
            )
        seen.update(ids)
    audit.call(FreeAll(CONSERVATION_OWNER))
