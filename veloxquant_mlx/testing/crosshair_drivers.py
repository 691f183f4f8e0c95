"""Bounded replay drivers: entry points for CrossHair's PEP 316 contract checking.

CrossHair cannot build a consistent ``PoolState`` from nothing (the spec
transitions' ``pre: all_invariants_hold(state)`` is "unable to meet
precondition"), so every driver here starts from ``new_pool`` on one of the
tiny :data:`CONFIGS` and takes only small, bounded integers. The bounds in
the ``pre:`` lines are what make symbolic execution effective: CrossHair
chooses the integers, and each choice is one short, concrete run (a few
tenths of a second under CrossHair: dozens of paths in CI's budget, thousands
in the nightly one).

- :func:`replay_agrees_with_spec` decodes each integer into an operation of
  :data:`ALPHABET` (good calls, stale and foreign handles, junk, bad
  arguments) and runs them through :class:`~veloxquant_mlx.testing.lockstep.
  Lockstep`, which compares ``BlockPoolAllocator`` with the spec after
  every step.
- :func:`allocate_agrees_with_spec` feeds a symbolic ``n_tokens`` and
  ``owner`` straight into a lockstep ``allocate``.
- The ``spec_*`` drivers check properties of the spec alone: replays keep
  every invariant and what each transition promises, ``free_all`` undoes
  ``allocate``, an allocation is ``ceil(n_tokens / block_size)`` blocks
  holding ``n_tokens``, exhaustion changes nothing but ``n_exhausted`` and
  history, and growth re-issues the lowest retired ids first.

Every driver returns ``False`` on a violation instead of raising, and says
nothing about it: with crosshair-tool 0.0.113, a path that ends in an
exception whose message was built by an f-string is usually dropped, not
reported (CrossHair stubs ``repr`` at random and the message contradicts the
stub), so a raised ``ConformanceError`` would hide the bug it found. The
drivers also re-check what the spec's own ``post:`` lines say, because
CrossHair drops, rather than reports, a path on which a *called* function's
postcondition fails.

Run them (with the ``dev`` extra installed, from the repository root)::

    PYTHONPATH=.:spec crosshair check --analysis_kind=PEP316 \\
        --per_condition_timeout=20 veloxquant_mlx.testing.crosshair_drivers

or all of the project's targets within CI's time budget via
``.ci/crosshair`` (``.ci/crosshair --nightly`` for long timeouts). While
editing, ``crosshair watch --analysis_kind=PEP316 <this file>`` re-checks on
every save. CrossHair reports a violation as ``false when calling
replay_agrees_with_spec([1, 8], 3)``; :func:`replay` runs those arguments
concretely and raises the ``ConformanceError`` that says what differed.

Complexity: O(len(codes) * handles issued) per call. Thread safety: each
call builds its own pool and spec state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Final

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.lockstep import AllocatorUnderTest, ConformanceError, Lockstep
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

#: Tiny pools: both stream modes, growth off, capped and uncapped, and a pool
#: that starts empty. Block size 2, so a block can be part full.
CONFIGS: Final = (
    model.SpecConfig(block_size=2, n_blocks=4, separate_kv=True),
    model.SpecConfig(block_size=2, n_blocks=3, separate_kv=False),
    model.SpecConfig(
        block_size=2, n_blocks=3, separate_kv=True, grow_on_exhaustion=True, max_blocks=5
    ),
    model.SpecConfig(block_size=2, n_blocks=0, separate_kv=False, grow_on_exhaustion=True),
)

#: Short enough that a four-step replay overflows it.
HISTORY_LEN: Final = 2

#: Stands for "the newest handle issued so far" in :data:`ALPHABET`.
NEWEST: Final = -1

#: The operations a code decodes to. A handle reference is a checkout serial
#: number, or :data:`NEWEST`; one not yet issued decodes to a hand-made block.
ALPHABET: Final[tuple[Operation, ...]] = (
    Allocate("k", 1, 0),
    Allocate("k", 3, 0, "int4"),
    Allocate("v", 2, 1),
    Allocate("k", 5, 1),  # 3 blocks: exhausts or grows
    Allocate("kv", 1, 1),  # invalid stream unless the pool is shared
    Allocate("k", 0, 0),  # ValueError
    Allocate("v", 1, True),  # TypeError: bool is not an owner
    Free((0,)),
    Free((NEWEST,)),
    Free((NEWEST,), as_tuple=True),
    Free((0, NEWEST)),  # InvalidFreeError when 0 is the newest
    Free(()),
    Free(NotAList()),
    FreeAll(0),
    FreeAll(1),
    Shrink("k", 0),
    Shrink("v", 1),
    MarkUsed(NEWEST, 1),
    MarkUsed(0, 2),
    MarkUsed(NEWEST, 3),  # ValueError: above block_size
    MarkUsed(ForeignBlock(owner=None), 1),
    MarkUsed(ForeignBlock(owner=7), 1),
    MarkUsed(NotABlock(), 0),
    RegisterOwner(0),
    ReleaseOwner(0),
)

#: Stream arguments for the drivers that take a ``stream_code``.
STREAMS: Final = ("k", "v", "kv")


def _allocator(config: PoolConfig, history_len: int) -> AllocatorUnderTest:
    return BlockPoolAllocator(config, history_len=history_len)


def resolve_reference(ref: HandleRef, n_issued: int) -> HandleRef:
    """Bind an alphabet handle reference to one of ``n_issued`` handles.

    post: not isinstance(__return__, int) or 0 <= __return__ < n_issued
    """
    if not isinstance(ref, int):
        return ref
    index = n_issued - 1 if ref == NEWEST else ref
    return index if 0 <= index < n_issued else ForeignBlock(owner=None)


def decode(code: int, n_issued: int) -> Operation:
    """The operation ``code`` stands for, once ``n_issued`` handles exist.

    pre: 0 <= code < len(ALPHABET)
    pre: n_issued >= 0
    post: type(__return__) is type(ALPHABET[code])
    """
    operation = ALPHABET[code]
    if isinstance(operation, Free) and not isinstance(operation.blocks, NotAList):
        blocks = tuple(resolve_reference(ref, n_issued) for ref in operation.blocks)
        return replace(operation, blocks=blocks)
    if isinstance(operation, MarkUsed):
        return replace(operation, block=resolve_reference(operation.block, n_issued))
    return operation


def replay(codes: Sequence[int], config_code: int) -> Lockstep:
    """Replay ``codes`` on ``CONFIGS[config_code]`` concretely, e.g. a reported counterexample.

    Returns:
        The lockstep runner after the last operation, for inspection.

    Raises:
        ConformanceError: The allocator and the spec disagree; says where.
    """
    lockstep = Lockstep(_allocator, CONFIGS[config_code], HISTORY_LEN)
    for code in codes:
        lockstep.apply(decode(code, len(lockstep.handles)))
    return lockstep


def replay_agrees_with_spec(codes: list[int], config_code: int) -> bool:
    """The allocator and the spec agree on everything after each decoded operation.

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 4
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    post: __return__
    """
    try:
        replay(codes, config_code)
    except ConformanceError:
        return False
    return True


def allocate_agrees_with_spec(
    config_code: int, stream_code: int, n_tokens: int, owner: int
) -> bool:
    """A lockstep ``allocate`` of a symbolic token count and owner, then its ``free_all``.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 0 <= stream_code < len(STREAMS)
    pre: -1 <= n_tokens <= 11
    pre: -1 <= owner <= 2
    post: __return__
    """
    lockstep = Lockstep(_allocator, CONFIGS[config_code], HISTORY_LEN)
    try:
        lockstep.apply(Allocate(STREAMS[stream_code], n_tokens, owner))
        lockstep.apply(FreeAll(owner))
    except ConformanceError:
        return False
    return True


# ---- properties of the spec alone ----------------------------------------------


def _fresh(config_code: int) -> model.PoolState:
    state = model.new_pool(CONFIGS[config_code], HISTORY_LEN)
    assert not isinstance(state, model.Err), f"CONFIGS[{config_code}] is rejected"
    return state


def _keeps_its_promise(
    before: model.PoolState, operation: Operation, after: model.PoolState, result: object
) -> bool:
    """What the transition's ``post:`` lines promise beyond the invariants holds."""
    if isinstance(result, model.Err):
        return not isinstance(operation, MarkUsed) or after.history == before.history
    if isinstance(operation, Allocate) and isinstance(result, tuple):
        n_tokens = operation.n_tokens
        return isinstance(n_tokens, int) and len(result) * before.config.block_size >= n_tokens
    if isinstance(operation, Shrink):
        return isinstance(result, int) and result >= 0
    if isinstance(operation, MarkUsed):
        return after.history == before.history
    return True


def _free_counts(state: model.PoolState) -> tuple[int, ...]:
    return tuple(len(stack) for _, stack in state.free_lists)


def spec_replay_keeps_invariants(codes: list[int], config_code: int) -> bool:
    """Every state a decoded replay reaches satisfies every invariant of the spec.

    Each step also keeps what its transition's ``post:`` lines promise (an
    allocation covers its tokens, shrink returns a count, mark_used leaves
    history alone).

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 5
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    post: __return__
    """
    state = _fresh(config_code)
    for code in codes:
        operation = decode(code, len(state.handles))
        after, result = apply_to_spec(state, operation)
        if not invariants.all_invariants_hold(after):
            return False
        if not _keeps_its_promise(state, operation, after, result):
            return False
        state = after
    return True


def spec_free_all_undoes_allocate(config_code: int, stream_code: int, n_tokens: int) -> bool:
    """``allocate`` then ``free_all`` of its owner frees every block, grown ones too.

    A refused allocation leaves the handles and free lists as they were.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 0 <= stream_code < len(STREAMS)
    pre: 1 <= n_tokens <= 12
    post: __return__
    """
    before = _fresh(config_code)
    allocated, handles = transitions.allocate(before, STREAMS[stream_code], n_tokens, 5)
    if isinstance(handles, model.Err):
        unchanged = allocated.handles == before.handles
        return unchanged and _free_counts(allocated) == _free_counts(before)
    after, error = transitions.free_all(allocated, 5)
    return (
        error is None
        and sum(_free_counts(after)) == sum(_free_counts(before)) + after.counters.n_grown
        and model.live_handles(after) == ()
        and 5 not in after.registered
    )


def spec_allocate_covers_n_tokens(config_code: int, n_tokens: int, owner: int) -> bool:
    """A successful allocation is ``ceil(n_tokens / block_size)`` blocks holding ``n_tokens``.

    Every block but the last is full; all are distinct and belong to ``owner``.

    pre: 0 <= config_code < len(CONFIGS)
    pre: 1 <= n_tokens <= 12
    pre: 0 <= owner <= 3
    post: __return__
    """
    state = _fresh(config_code)
    size = state.config.block_size
    after, handles = transitions.allocate(state, "k", n_tokens, owner)
    if isinstance(handles, model.Err):
        return handles.kind is model.ErrorKind.EXHAUSTED
    views = [after.handles[h] for h in handles]
    return (
        len(views) == -(-n_tokens // size)
        and sum(v.n_used for v in views) == n_tokens
        and all(v.n_used == size for v in views[:-1])
        and all(v.owner == owner for v in views)
        and len({v.block_id for v in views}) == len(views)
    )


def spec_exhaustion_changes_only_its_counter(codes: list[int], config_code: int) -> bool:
    """An exhausted ``allocate`` leaves the state as it was but for ``n_exhausted`` and history.

    pre: 0 <= config_code < len(CONFIGS)
    pre: len(codes) <= 3
    pre: all(0 <= c < len(ALPHABET) for c in codes)
    post: __return__
    """
    state = _fresh(config_code)
    for code in codes:
        state = apply_to_spec(state, decode(code, len(state.handles)))[0]
    after, result = transitions.allocate(state, "k", 7, 0)
    if not (isinstance(result, model.Err) and result.kind is model.ErrorKind.EXHAUSTED):
        return True
    counters = replace(state.counters, n_exhausted=state.counters.n_exhausted + 1)
    return replace(after, history=state.history) == replace(state, counters=counters)


def spec_growth_reissues_lowest_retired_first(retire_count: int, n_tokens: int) -> bool:
    """After ``shrink``, growth hands out the lowest retired ids, then ids above every issued one.

    pre: 0 <= retire_count <= 2
    pre: 1 <= n_tokens <= 10
    post: __return__
    """
    state = _fresh(2)  # "k" holds ids 0 and 1, "v" id 2; growth capped at 5 blocks
    shrunk, retired = transitions.shrink(state, "k", 2 - retire_count)
    after, handles = transitions.allocate(shrunk, "k", n_tokens, 0)
    if isinstance(handles, model.Err):
        return True
    ids = [after.handles[h].block_id for h in handles]
    grown = ids[len(transitions.free_list_for(shrunk, "k")) :]
    reissued = sorted(shrunk.retired)[: len(grown)]
    start = shrunk.next_block_id
    fresh = range(start, start + len(grown) - len(reissued))
    return retired == retire_count and grown == [*reissued, *fresh]
