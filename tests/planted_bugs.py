"""Allocators with planted bugs, shared by the tests that must catch them.

A check that cannot fail proves nothing: the conformance machine, the
exhaustive checker and others are each run against these and must report
a counterexample. Each class plants one bug the contract forbids.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    InvariantViolationError,
)
from veloxquant_mlx.testing.conformance import PoolConformanceMachine
from veloxquant_mlx.testing.lockstep import AllocatorFactory, ConformanceError


class FreeCountsBlocks(BlockPoolAllocator):
    """Planted bug: n_frees counts blocks instead of calls (the upstream's bug)."""

    def free(self, blocks: list[Block]) -> None:
        super().free(blocks)
        with self._lock:
            self._stats.n_frees += max(0, len(blocks) - 1)


def not_a_pool(config: object, history_len: int) -> object:
    """A factory whose "pool" has none of the API: every call raises AttributeError."""
    return object()


class NFreeCountsOneMore(BlockPoolAllocator):
    """``n_free`` says one block more than the stream has: wrong on a fresh pool already."""

    def n_free(self, stream: str = "k") -> int:
        return super().n_free(stream) + 1


class FreeListIsFifo(BlockPoolAllocator):
    """Planted bug: after free(), the lowest free id is reused first, not the last freed."""

    def free(self, blocks: list[Block]) -> None:
        streams = {block.stream for block in blocks if isinstance(block, Block)}
        super().free(blocks)
        with self._lock:
            for stream in streams & set(self._free_lists):
                free_list = self._free_lists[stream]
                free_list[:] = sorted(free_list, reverse=True)


class ShrinkRetiresLowestIds(BlockPoolAllocator):
    """Planted bug: shrink() retires the lowest free ids, so the slab cannot shrink."""

    def shrink(self, stream: str, target_free: int) -> int:
        valid = type(target_free) is int and target_free >= 0 and stream in self._stream_names
        with self._lock:
            free_list = self._free_lists[self._stream_names[stream]] if valid else []
            n_to_retire = len(free_list) - target_free
            if not valid or n_to_retire <= 0:
                return 0 if valid else super().shrink(stream, target_free)  # raises
            retiring = set(heapq.nsmallest(n_to_retire, free_list))
            free_list[:] = [block_id for block_id in free_list if block_id not in retiring]
            for block_id in retiring:
                heapq.heappush(self._retired_ids, block_id)
            self._retired_set.update(retiring)
            while self._id_bound and self._id_bound - 1 in self._retired_set:
                self._id_bound -= 1
            self._stats.n_blocks -= n_to_retire
            self._stats.n_retired += n_to_retire
            self._record_history()
            return n_to_retire


class EmptyFreeCountsAFree(BlockPoolAllocator):
    """Planted bug: free([]) counts as a free, though it frees nothing."""

    def free(self, blocks: list[Block]) -> None:
        super().free(blocks)
        if isinstance(blocks, list | tuple) and not blocks:
            with self._lock:
                self._stats.n_frees += 1


class GrowthIgnoresCap(BlockPoolAllocator):
    """Planted bug: max_blocks is off by one (as in test_conformance)."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        config = self.config
        if config.grow_on_exhaustion and config.max_blocks is not None:
            object.__setattr__(config, "max_blocks", config.max_blocks + 1)
            try:
                return super().allocate(stream, n_tokens, owner, format)
            finally:
                object.__setattr__(config, "max_blocks", config.max_blocks - 1)
        return super().allocate(stream, n_tokens, owner, format)


class IsLiveAnswersAnInt(BlockPoolAllocator):
    """Planted bug: ``is_live`` answers 1 or 0, equal to the spec's bool but an int."""

    def is_live(self, block: object) -> int:  # type: ignore[override]  # the bug
        return int(super().is_live(block))


class NFreeAnswersAFloat(BlockPoolAllocator):
    """Planted bug: ``n_free`` answers a float, equal to the spec's int."""

    def n_free(self, stream: str = "k") -> float:  # type: ignore[override]  # the bug
        return float(super().n_free(stream))


class ShrinkAnswersAFloat(BlockPoolAllocator):
    """Planted bug: ``shrink`` answers how many blocks it retired as a float."""

    def shrink(self, stream: str, target_free: int) -> float:  # type: ignore[override]  # the bug
        return float(super().shrink(stream, target_free))


class HandlesShowEverAllocatedAsAnInt(BlockPoolAllocator):
    """Planted bug: the handles ``allocate`` returns show ``ever_allocated`` as 1, not True."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        blocks = super().allocate(stream, n_tokens, owner, format)
        for block in blocks:
            block.ever_allocated = 1  # type: ignore[assignment]  # the bug
        return blocks


class _FreesAsAFloat:
    """A stats snapshot that shows ``n_frees`` as a float and every other field as it is."""

    def __init__(self, stats: AllocationStats) -> None:
        self._stats = stats

    def __getattr__(self, name: str) -> object:
        return getattr(self._stats, name)

    @property
    def n_frees(self) -> float:
        return float(self._stats.n_frees)


class StatsCountFreesAsAFloat(BlockPoolAllocator):
    """Planted bug: ``stats.n_frees`` is a float, equal to the spec's int."""

    @property
    def stats(self) -> AllocationStats:
        return _FreesAsAFloat(super().stats)  # type: ignore[return-value]  # the bug


def factory_of(cls: type[BlockPoolAllocator]) -> AllocatorFactory:
    return lambda config, history_len: cls(config, history_len=history_len)


def assert_the_conformance_machine_catches(
    buggy: type[BlockPoolAllocator], *, max_examples: int = 500
) -> None:
    """Run the kit's lockstep machine on ``buggy``: it must raise ``ConformanceError``
    within ``max_examples`` derandomized examples of 30 steps (the same examples every
    run, so a catch is not luck; no shrinking, since any counterexample will do)."""
    machine = type("Buggy", (PoolConformanceMachine,), {"allocator_factory": factory_of(buggy)})
    with pytest.raises(ConformanceError):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=30,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            ),
        )


def require_freeable(pool: BlockPoolAllocator, blocks: Sequence[object]) -> None:
    """What ``free`` checks before it frees anything: every item a live handle, listed once.

    For planted bugs that split ``free``'s check from its act.

    Raises:
        InvalidFreeError: The first item that is not, named as ``free`` names it.
    """
    refusal = pool._first_unfreeable(blocks)
    if refusal is not None:
        raise pool._unfreeable_error(blocks[refusal[0]], *refusal)


# ---- deviations only a wider alphabet or a probe of no-ops shows (the exhaustive checker) ----


class FreeChecksTypesLate(BlockPoolAllocator):
    """Planted bug: free() checks up front only the items that are Blocks, so a list with
    junk after a live handle frees that handle before it raises (C-FREE-ATOMIC)."""

    def free(self, blocks: list[Block]) -> None:
        if isinstance(blocks, list | tuple) and not all(isinstance(b, Block) for b in blocks):
            handles = [block for block in blocks if isinstance(block, Block)]
            prefix = list(itertools.takewhile(lambda b: isinstance(b, Block), blocks))
            require_freeable(self, handles)  # the blocks are checked; the junk is not
            super().free(prefix)
            super().free(blocks[len(prefix) :])  # raises at the junk
        super().free(blocks)


class InvariantsAlwaysViolated(BlockPoolAllocator):
    """Planted bug: ``check_invariants()`` reports a broken partition on any pool."""

    def check_invariants(self) -> None:
        raise InvariantViolationError("partition: planted")


class AllocateTakesWholeFloats(BlockPoolAllocator):
    """Planted bug: allocate() takes n_tokens=2.0 as 2 (C-ALLOC-ARGS wants a TypeError)."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        given: object = n_tokens  # typed int, but a caller may pass anything
        if isinstance(given, float) and given.is_integer():
            n_tokens = int(given)
        return super().allocate(stream, n_tokens, owner, format)


class OwnTypeError(TypeError):
    """A TypeError of the port's own: C-ERROR-CLASSES wants the built-in class itself."""


class AllocateRaisesItsOwnTypeError(BlockPoolAllocator):
    """Planted bug: allocate() raises a subclass of TypeError for a bad argument's type."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        try:
            return super().allocate(stream, n_tokens, owner, format)
        except TypeError as error:
            raise OwnTypeError(str(error)) from None


class MarkUsedZeroIsIgnored(BlockPoolAllocator):
    """Planted bug: mark_used(block, 0) is taken as "nothing to record" and changes nothing."""

    def mark_used(self, block: Block, n_used: int) -> None:
        if n_used == 0 and type(n_used) is int:
            return
        super().mark_used(block, n_used)


class ReleaseRegistersAnUnknownOwner(BlockPoolAllocator):
    """Planted bug: release_owner() of an owner it never saw leaves it registered (a
    setdefault where a discard belongs), so a later register_owner() of it is refused.
    Nothing a query shows changes: only the next register_owner() tells."""

    def release_owner(self, owner: int) -> None:
        with self._lock:
            unknown = owner not in self._owner_blocks and owner not in self._registered_owners
        super().release_owner(owner)
        if unknown and type(owner) is int:
            with self._lock:
                self._registered_owners.add(owner)


# ---- sharing (docs/CONTRACT.md#sharing): the bugs engines that share have shipped ----


class SharedBlockPushedWhileHeld(BlockPoolAllocator):
    """Planted bug (vLLM #42571): freeing one handle of a shared block pushes the block,
    though another handle still holds it; freeing that one pushes it again."""

    def _release_shared(self, blocks: Iterable[Block]) -> None:
        blocks = list(blocks)
        super()._release_shared(blocks)
        held = {block_id for owned in self._owner_blocks.values() for block_id in owned}
        for block in blocks:
            if block.block_id in held:
                self._push_onto[block.stream](block.block_id)


class FreeAllIgnoresSharing(BlockPoolAllocator):
    """Planted bug (vLLM #3347): free_all() returns every block of the owner as if it held
    it alone, so after a fork both owners' free_all() free each shared block."""

    def free_all(self, owner: int) -> None:
        with self._lock:
            owned = self._owner_blocks.get(owner, {}) if type(owner) is int else {}
            for block_id in owned:
                self._shared_counts.pop(block_id, None)
            self._stats._shared_blocks = len(self._shared_counts)
        super().free_all(owner)


class InUseCountsHandles(BlockPoolAllocator):
    """Planted bug (SGLang #35270): blocks_in_use counts handles, so a shared block twice."""

    def _issue_shares(self, blocks: Sequence[Block], owner: int) -> list[Block]:
        handles = super()._issue_shares(blocks, owner)
        self._stats._blocks_in_use += len(handles)
        return handles


class SharedCountDecrementedOutsideTheLock(BlockPoolAllocator):
    """Planted race: freeing a handle of a shared block reads the block's count under the
    lock, lets the lock go, and writes back that count minus one under the lock again.

    Two threads releasing handles of one block (``free`` or ``free_all``) both
    read the same count and both write back one less: a release is lost. At
    count 2 both see "one handle left", so the block is never pushed although
    no handle holds it; at a higher count it stays "shared" with one handle.
    :meth:`_window` is the moment the lock is let go: ``time.sleep(0)`` makes
    another thread run there under the GIL (as teeth do); a free-threaded
    build needs no help (:class:`SharedCountDecrementedOutsideTheLockNoYield`).
    """

    @staticmethod
    def _window() -> None:
        time.sleep(0)

    def _release_shared(self, blocks: Iterable[Block]) -> None:
        blocks = list(blocks)
        read = {block.block_id: self._shared_counts.get(block.block_id) for block in blocks}
        self._lock.release()  # held by free / free_all, which called us
        try:
            self._window()
        finally:
            self._lock.acquire()
        shared = self._shared_counts
        for block in blocks:  # act on the counts read before the window
            count = read[block.block_id]
            if count is None:
                self._push_onto[block.stream](block.block_id)
                self._stats._blocks_in_use -= 1
                self._stats._fragmented_count -= 0 < block.n_used < self._block_size
            elif count == 2:  # one handle left after this one
                shared.pop(block.block_id, None)
                read[block.block_id] = None  # two handles of one id in one list: still right
            else:
                shared[block.block_id] = read[block.block_id] = count - 1
            block.owner = None
            block.n_used = 0
        self._stats._shared_blocks = len(shared)
        self._stats.n_frees += 1
        self._record_history()


class SharedCountDecrementedOutsideTheLockNoYield(SharedCountDecrementedOutsideTheLock):
    """The same race with nothing in the window: only truly parallel threads land in it."""

    @staticmethod
    def _window() -> None:
        return None


# ---- counts above 2: a block held by three owners or more ----------------------------


class CopyOnWriteKeepsACountAboveTwo(BlockPoolAllocator):
    """Planted bug: make_writable() of a handle of a block with 3 or more handles moves
    the handle but leaves the block's count as it was; at count 2 it is right."""

    # The public method, not _copy_on_write: the compiled pool calls its own private
    # methods directly, so an override of one is never run there.
    def make_writable(self, block: Block) -> Block:
        count = self._shared_counts.get(block.block_id) if self.is_live(block) else None
        moved = super().make_writable(block)
        if count is not None and count > 2:
            self._shared_counts[block.block_id] = count  # the stale handle keeps its id
        return moved


class FreeKeepsACountAboveTwo(BlockPoolAllocator):
    """Planted bug: freeing a handle (free or free_all) of a block with 3 or more handles
    leaves the block's count as it was; at count 2 it is right."""

    def _release_shared(self, blocks: Iterable[Block]) -> None:
        blocks = list(blocks)
        shared = self._shared_counts
        above_two = {
            b.block_id: shared[b.block_id] for b in blocks if shared.get(b.block_id, 0) > 2
        }
        super()._release_shared(blocks)
        shared.update(above_two)


class ShareOfASharedBlockKeepsItsCount(BlockPoolAllocator):
    """Planted bug: share() or fork() of a block that is already shared gives the new
    owner a handle but leaves the count at 2; the first share is right."""

    def _issue_shares(self, blocks: Sequence[Block], owner: int) -> list[Block]:
        shared = self._shared_counts
        already = {
            block.block_id: shared[block.block_id] for block in blocks if block.block_id in shared
        }
        handles = super()._issue_shares(blocks, owner)
        shared.update(already)
        return handles
