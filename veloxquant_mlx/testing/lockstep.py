"""Run an allocator and the executable spec side by side, comparing everything.

:class:`Lockstep` applies one :mod:`~veloxquant_mlx.testing.operations`
value at a time to an allocator under test and to the spec
(``veloxquant_mlx_spec``), then compares all that a caller can observe:
the call's result or error class, every handle ever handed out (by
identity: the n-th ``Block`` object is the spec's handle n), every stats
counter, ``blocks_in_use()``, ``fragmentation()``, the history, ``n_free``
of each stream, ``blocks_for`` of every owner seen, and, where the
allocator offers them, ``is_live``, ``id_bound`` and ``check_invariants``.
The first difference raises :class:`ConformanceError` with the operations
so far, which replay it exactly.

It is the engine behind the Hypothesis conformance machine, the
small-scope exhaustive checker and the CrossHair replay drivers, and it is
what a port to another backend runs against our spec.

Complexity: O(handles issued + owners seen + history) per operation.
Thread safety: none; one thread drives one ``Lockstep``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from veloxquant_mlx.memory.block_pool import Block, PoolConfig
from veloxquant_mlx.testing.operations import (
    Allocate,
    ForeignBlock,
    Free,
    FreeAll,
    HandleRef,
    MarkUsed,
    NotABlock,
    NotAList,
    Operation,
    RegisterOwner,
    ReleaseOwner,
    Shrink,
    apply_to_spec,
)
from veloxquant_mlx_spec import invariants, model, transitions

#: Counter fields of ``AllocationStats`` compared one by one.
COUNTER_FIELDS = (
    "n_blocks",
    "n_allocations",
    "n_frees",
    "n_reused",
    "n_exhausted",
    "n_grown",
    "n_retired",
    "peak_blocks_in_use",
)


class AllocatorUnderTest(Protocol):
    """What the harness calls: the reference API of ``BlockPoolAllocator``."""

    def allocate(self, stream: Any, n_tokens: Any, owner: Any, format: Any = ...) -> Any: ...
    def free(self, blocks: Any) -> Any: ...
    def free_all(self, owner: Any) -> Any: ...
    def register_owner(self, owner: Any) -> Any: ...
    def release_owner(self, owner: Any) -> Any: ...
    def shrink(self, stream: Any, target_free: Any) -> Any: ...
    def mark_used(self, block: Any, n_used: Any) -> Any: ...
    def blocks_for(self, owner: Any) -> Any: ...
    def n_free(self, stream: Any = ...) -> Any: ...
    @property
    def stats(self) -> Any: ...
    @property
    def history(self) -> Any: ...


#: Builds a fresh allocator for a config and a ``history_len``.
AllocatorFactory = Callable[[PoolConfig, int], AllocatorUnderTest]


class ConformanceError(AssertionError):
    """The allocator and the spec disagree; the message holds a replayable trace."""


class Lockstep:
    """One allocator and one spec state, advanced together.

    Invariants: ``handles[n]`` is the n-th ``Block`` the allocator handed out
    and corresponds to the spec's ``HandleId`` n; ``state`` is the spec's
    state after ``trace``; after every ``apply`` the two agree on everything
    observable (or ``apply`` raised).
    """

    def __init__(
        self,
        factory: AllocatorFactory,
        config: model.SpecConfig,
        history_len: int = 1024,
        *,
        block_type: Callable[..., object] = Block,
    ) -> None:
        """Build the allocator and the spec's initial state.

        Args:
            factory: Makes the allocator under test (and a second, foreign one).
            config: A valid spec config; its ``PoolConfig`` twin is built here.
            history_len: Passed to both.
            block_type: Builds a hand-made block (``ForeignBlock(owner=None)``).
        """
        state = model.new_pool(config, history_len)
        if isinstance(state, model.Err):
            raise ValueError(f"history_len {history_len!r} is rejected by the spec: {state}")
        pool_config = PoolConfig(
            config.block_size,
            config.n_blocks,
            config.separate_kv,
            config.grow_on_exhaustion,
            config.max_blocks,
        )
        self.state = state
        self.pool = factory(pool_config, history_len)
        self.handles: list[Any] = []
        self.trace: list[Operation] = []
        self._factory = factory
        self._block_type = block_type
        self._foreign_pool: AllocatorUnderTest | None = None
        self._foreign_handles: dict[int, object] = {}
        self._last_mark_used_target: object = None
        self._owners_seen: set[int] = set()

    # -- applying operations -----------------------------------------------------

    def apply(self, operation: Operation) -> object:
        """Apply ``operation`` to both sides; compare the outcome and then everything.

        Returns:
            What the allocator returned (``None`` if it raised as predicted).

        Raises:
            ConformanceError: The two sides disagree.
        """
        self.trace.append(operation)
        for owner in _owners_named(operation):
            self._owners_seen.add(owner)
        new_state, predicted = self._predict(operation)
        actual, raised = self._run(operation)
        self._compare_outcome(operation, predicted, actual, raised)
        if isinstance(operation, MarkUsed):
            self._check_hand_made_block(operation, predicted)
        self.state = new_state
        if isinstance(operation, Allocate) and raised is None:
            self.handles.extend(actual)
        self.compare_observations()
        return actual

    def _predict(self, op: Operation) -> tuple[model.PoolState, object]:
        """The spec's side of ``op`` (a seam: the exhaustive checker observes it)."""
        return apply_to_spec(self.state, op)

    def _run(self, op: Operation) -> tuple[Any, BaseException | None]:
        try:
            return self._call(op), None
        except Exception as error:  # every error is compared to the spec
            return None, error

    def _call(self, op: Operation) -> Any:
        pool = self.pool
        if isinstance(op, Allocate):
            return pool.allocate(op.stream, op.n_tokens, op.owner, op.format)
        if isinstance(op, Free):
            return pool.free(self._free_argument(op))
        if isinstance(op, FreeAll):
            return pool.free_all(op.owner)
        if isinstance(op, RegisterOwner):
            return pool.register_owner(op.owner)
        if isinstance(op, ReleaseOwner):
            return pool.release_owner(op.owner)
        if isinstance(op, Shrink):
            return pool.shrink(op.stream, op.target_free)
        block = self.resolve(op.block)
        self._last_mark_used_target = block
        return pool.mark_used(block, op.n_used)

    def _free_argument(self, op: Free) -> object:
        if isinstance(op.blocks, NotAList):
            return self.resolve(ForeignBlock(None))  # a bare Block where a list belongs
        blocks = [self.resolve(ref) for ref in op.blocks]
        return tuple(blocks) if op.as_tuple else blocks

    def resolve(self, ref: HandleRef) -> object:
        """The object a reference stands for: a handle, a foreign block, or junk."""
        if isinstance(ref, NotABlock):
            return "not a block"
        if isinstance(ref, ForeignBlock):
            if ref.owner is None:
                return self._block_type(0)
            return self._foreign_handle(ref.owner)
        if not 0 <= ref < len(self.handles):
            raise ValueError(
                f"handle reference {ref} was never issued ({len(self.handles)} so far)"
            )
        return self.handles[ref]

    def _foreign_handle(self, owner: int) -> object:
        """A live handle of another pool, checked out to ``owner`` (one per owner)."""
        if owner not in self._foreign_handles:
            if self._foreign_pool is None:
                self._foreign_pool = self._factory(PoolConfig(block_size=4, n_blocks=64), 0)
            self._foreign_handles[owner] = self._foreign_pool.allocate("k", 1, owner)[0]
        return self._foreign_handles[owner]

    def _check_hand_made_block(self, op: MarkUsed, predicted: object) -> None:
        """``mark_used`` on a block built by hand sets that object's ``n_used``, only."""
        hand_made = isinstance(op.block, ForeignBlock) and op.block.owner is None
        n_used = getattr(self._last_mark_used_target, "n_used", None)
        if hand_made and not isinstance(predicted, model.Err) and n_used != op.n_used:
            self._fail(f"{op} left the hand-made block's n_used at {n_used}")

    # -- comparing ---------------------------------------------------------------

    def _compare_outcome(
        self, op: Operation, predicted: object, actual: Any, raised: BaseException | None
    ) -> None:
        if isinstance(predicted, model.Err):
            if raised is None:
                self._fail(f"{op} returned {actual!r}; the spec predicts {predicted}")
            elif type(raised).__name__ != predicted.kind.value:
                self._fail(f"{op} raised {raised!r}; the spec predicts {predicted}")
            return
        if raised is not None:
            self._fail(f"{op} raised {raised!r}; the spec predicts success ({predicted!r})")
        if isinstance(op, Allocate):
            self._compare_new_handles(op, predicted, actual)
        elif isinstance(op, Shrink) and actual != predicted:
            self._fail(f"{op} returned {actual!r}; the spec predicts {predicted!r}")
        elif not isinstance(op, (Allocate, Shrink)) and actual is not None:
            self._fail(f"{op} returned {actual!r}; the spec predicts None")

    def _compare_new_handles(self, op: Allocate, predicted: object, actual: Any) -> None:
        if not isinstance(actual, list) or not isinstance(predicted, tuple):
            self._fail(f"{op} returned {actual!r}; the spec predicts a list of handles")
        if len(actual) != len(predicted):
            self._fail(f"{op} returned {len(actual)} blocks; the spec predicts {len(predicted)}")
        known = {id(handle) for handle in self.handles}
        if any(id(block) in known for block in actual) or len({id(b) for b in actual}) != len(
            actual
        ):
            self._fail(f"{op} returned a handle object that was handed out before")

    def compare_observations(self) -> None:
        """Compare everything observable; raise :class:`ConformanceError` on a difference."""
        broken = invariants.broken_invariants(self.state)
        if broken:
            self._fail(f"the spec's own invariants broke: {broken}")
        self._compare_handles()
        self._compare_stats()
        self._compare_free_counts()
        self._compare_owners()
        self._compare_extensions()

    def _compare_handles(self) -> None:
        for handle_id, (handle, view) in enumerate(
            zip(self.handles, self.state.handles, strict=True)
        ):
            actual = (handle.block_id, handle.stream, handle.format, handle.n_used, handle.owner)
            expected = (view.block_id, view.stream, view.format, view.n_used, view.owner)
            if actual != expected or handle.ever_allocated is not True:
                self._fail(
                    f"handle {handle_id} shows {handle!r}; the spec predicts {view} "
                    "with ever_allocated=True"
                )

    def _compare_stats(self) -> None:
        _compare_stats_pair(self, "stats", self.pool.stats, model.stats(self.state))
        history = list(self.pool.history)
        if len(history) != len(self.state.history):
            self._fail(
                f"history has {len(history)} entries; the spec predicts {len(self.state.history)}"
            )
        for index, (actual, expected) in enumerate(zip(history, self.state.history, strict=True)):
            _compare_stats_pair(self, f"history[{index}]", actual, expected)

    def _compare_free_counts(self) -> None:
        for stream in model.stream_names(self.state.config):
            actual, expected = self.pool.n_free(stream), transitions.n_free(self.state, stream)
            if actual != expected:
                self._fail(f"n_free({stream!r}) is {actual}; the spec predicts {expected}")

    def _compare_owners(self) -> None:
        for owner in sorted(self._owners_seen):
            actual = [id(block) for block in self.pool.blocks_for(owner)]
            expected_ids = transitions.blocks_for(self.state, owner)
            assert not isinstance(expected_ids, model.Err), "owners seen are valid ints"
            expected = [id(self.handles[handle_id]) for handle_id in expected_ids]
            if actual != expected:
                self._fail(f"blocks_for({owner}) differs from the spec's handles {expected_ids}")

    def _compare_extensions(self) -> None:
        """Checks of what our allocator offers beyond the reference, where present."""
        is_live = getattr(self.pool, "is_live", None)
        if is_live is not None:
            for handle_id, handle in enumerate(self.handles):
                if is_live(handle) != transitions.is_live(self.state, handle_id):
                    self._fail(f"is_live(handle {handle_id}) disagrees with the spec")
        id_bound = getattr(self.pool, "id_bound", None)
        expected = transitions.id_bound(self.state)
        if id_bound is not None and id_bound() != expected:
            self._fail(f"id_bound() is {id_bound()}; the spec implies {expected}")
        check_invariants = getattr(self.pool, "check_invariants", None)
        if check_invariants is not None:
            try:
                check_invariants()
            except AssertionError as error:
                self._fail(f"check_invariants() failed: {error}")

    def _fail(self, message: str) -> NoReturn:
        trace = "\n".join(f"  {index}: {op!r}" for index, op in enumerate(self.trace))
        raise ConformanceError(
            f"{message}\nconfig: {self.state.config}, history_len={self.state.history_len}\n"
            f"operations so far:\n{trace}"
        )


def _compare_stats_pair(
    runner: Lockstep, where: str, actual: Any, expected: model.StatsView
) -> None:
    for name in COUNTER_FIELDS:
        if getattr(actual, name) != getattr(expected, name):
            runner._fail(
                f"{where}.{name} is {getattr(actual, name)}; the spec predicts "
                f"{getattr(expected, name)}"
            )
    derived = [
        ("blocks_in_use()", actual.blocks_in_use(), expected.blocks_in_use),
        ("_fragmented_count", actual._fragmented_count, expected.fragmented_count),
        ("fragmentation()", actual.fragmentation(), expected.fragmentation()),
    ]
    for name, got, want in derived:
        if got != want:
            runner._fail(f"{where}.{name} is {got}; the spec predicts {want}")


def _owners_named(op: Operation) -> Sequence[int]:
    owner = getattr(op, "owner", None)
    return [owner] if model.is_int(owner) else []
