"""One recorded call, applied to the executable spec: the state after it, or "not allowed".

The linearizability checker tries recorded calls in many orders; each try is
:func:`step`: turn the call's handle names into the spec's ``HandleId``s,
apply the spec's transition (``veloxquant_mlx_spec.transitions``), and keep
the result only if the outcome the thread recorded is the one the spec
predicts there (the same return value, or the same error class).

A :class:`Checkpoint` is a spec state plus ``names``: ``names[h]`` is the
history name (``(op_id, position)``) of the spec's handle ``h``. Spec handle
ids are checkout serial numbers, so which name gets which id depends on the
order in which the allocates were linearized: the mapping is part of the
search state, and :func:`step` extends it when it linearizes an allocate.

:func:`compact` drops the stale handles from a state and renumbers the live
ones, keeping their order. This changes nothing observable: every spec
transition ignores a handle whose ``owner`` is ``None`` (``live_handles``,
``is_active``, ``blocks_for`` and ``stats`` filter on it), and a call that
names a stale handle gets exactly the outcome it would get with a hand-made
free block (``ForeignBlock(None)``): ``free`` and ``is_live`` see a non-live
block, ``mark_used`` succeeds with no visible effect. New handles get ids
after the live ones, and ``names`` follows the renumbering. So a checkpoint
stays as small as the pool's live handles, instead of growing with every
handle the run ever made, and states that differ only in stale handles
become equal, which the checker's memo then merges.

Complexity: :func:`step` costs one spec transition, O(live handles + pool
size). Thread safety: pure functions over immutable values.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace
from typing import Final

from veloxquant_mlx.stress.history import (
    Allocate,
    BlocksFor,
    Call,
    Event,
    Free,
    FreeAll,
    HandleName,
    History,
    IdBound,
    IsLive,
    MarkUsed,
    NFree,
    Outcome,
    Prometheus,
    Raised,
    Ref,
    RegisterOwner,
    ReleaseOwner,
    Returned,
    Shrink,
    Stats,
    StoreRead,
    StoreWrite,
    describe_ref,
)
from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.model import (
    Err,
    ErrorKind,
    ForeignBlock,
    HandleArg,
    NotABlock,
    NotAList,
    PoolState,
    SpecConfig,
    StatsView,
    new_pool,
    stats,
)

__all__ = [
    "PROMETHEUS_PREFIX",
    "Checkpoint",
    "Names",
    "compact",
    "initial_checkpoint",
    "predicted_outcome",
    "prometheus_samples",
    "stats_tuple",
    "step",
]

Names = tuple[HandleName, ...]
"""``names[h]``: the history name of the spec's handle ``h``."""

#: The prefix of the Prometheus text the stress runner reads (the library's default).
PROMETHEUS_PREFIX: Final = "veloxquant_block_pool"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A spec state and the history names of its handles (see the module docstring)."""

    state: PoolState
    names: Names


def initial_checkpoint(config: SpecConfig, history_len: int) -> Checkpoint:
    """The state of a new pool: every block free, no handle.

    Raises:
        ValueError: ``history_len`` is rejected by the spec.
    """
    state = new_pool(config, history_len)
    if isinstance(state, Err):
        raise ValueError(f"history_len {history_len!r} is rejected by the spec: {state.message}")
    return Checkpoint(state, ())


def compact(state: PoolState, names: Names) -> Checkpoint:
    """``state`` without its stale handles, the live ones renumbered in order."""
    live = [h for h, view in enumerate(state.handles) if view.owner is not None]
    if len(live) == len(state.handles):
        return Checkpoint(state, names)
    handles = tuple(state.handles[h] for h in live)
    return Checkpoint(replace(state, handles=handles), tuple(names[h] for h in live))


def stats_tuple(view: StatsView) -> tuple[int, ...]:
    """A spec stats view in the form a ``stats`` query records (``STATS_FIELDS`` order)."""
    return (
        view.n_blocks,
        view.n_allocations,
        view.n_frees,
        view.n_reused,
        view.n_exhausted,
        view.n_grown,
        view.n_retired,
        view.peak_blocks_in_use,
        view.blocks_in_use,
        view.fragmented_count,
    )


def prometheus_samples(view: StatsView) -> tuple[tuple[str, float], ...]:
    """The ``(sample name, value)`` pairs ``to_prometheus()`` must show for ``view``, sorted."""
    values: dict[str, float] = {
        "blocks": view.n_blocks,
        "blocks_in_use": view.blocks_in_use,
        "peak_blocks_in_use": view.peak_blocks_in_use,
        "fragmentation_ratio": view.fragmentation(),
        "allocations_total": view.n_allocations,
        "frees_total": view.n_frees,
        "reused_total": view.n_reused,
        "exhausted_total": view.n_exhausted,
        "grown_total": view.n_grown,
        "retired_total": view.n_retired,
    }
    return tuple(sorted((f"{PROMETHEUS_PREFIX}_{name}", float(v)) for name, v in values.items()))


class _UnresolvableError(Exception):
    """A handle name whose allocate is in this window but not linearized yet."""


def _resolve(ref: Ref, names: Names, window_allocates: Container[int]) -> HandleArg:
    """The spec's reference for a recorded one (see the module docstring for stale names)."""
    if isinstance(ref, (ForeignBlock, NotABlock)):
        return ref
    try:
        return names.index(ref)
    except ValueError:
        if ref[0] in window_allocates:
            raise _UnresolvableError(ref) from None
        return ForeignBlock(None)  # stale since an earlier checkpoint (or never issued)


def _matches(outcome: Outcome | None, predicted: object) -> bool:
    """Whether a recorded outcome is the predicted value or error (pending: anything)."""
    if outcome is None:
        return True
    if isinstance(predicted, Err):
        return isinstance(outcome, Raised) and outcome.kind == predicted.kind.value
    return isinstance(outcome, Returned) and outcome.value == predicted


def step(
    state: PoolState, names: Names, event: Event, window_allocates: Container[int]
) -> tuple[PoolState, Names] | None:
    """Linearize ``event`` at ``state``: the next state and names, or ``None`` if not allowed.

    Args:
        state: The spec state before the call.
        names: The history names of ``state``'s handles.
        event: The recorded call and outcome (a pending event allows any outcome).
        window_allocates: Op ids of the allocates of the window being checked; a
            name made by one of them that is not in ``names`` yet cannot be used.

    Returns:
        ``(state after, names after)``, or ``None``: the spec predicts another
        outcome here, or the call names a handle not handed out yet.
    """
    try:
        return _step(state, names, event, window_allocates)
    except _UnresolvableError:
        return None


def _step(
    state: PoolState, names: Names, event: Event, window_allocates: Container[int]
) -> tuple[PoolState, Names] | None:
    call, outcome = event.call, event.outcome
    if isinstance(call, Allocate):
        return _allocate(state, names, event)
    after, predicted = _transition(state, names, call, window_allocates)
    return (after, names) if _matches(outcome, predicted) else None


def _allocate(state: PoolState, names: Names, event: Event) -> tuple[PoolState, Names] | None:
    call = event.call
    assert isinstance(call, Allocate), "only called for allocate events"
    after, result = transitions.allocate(state, call.stream, call.n_tokens, call.owner, call.format)
    if isinstance(result, Err):
        return (after, names) if _matches(event.outcome, result) else None
    block_ids = tuple(after.handles[h].block_id for h in result)
    if not _matches(event.outcome, block_ids):
        return None
    return after, names + tuple((event.op_id, position) for position in range(len(result)))


def _transition(
    state: PoolState, names: Names, call: Call, window_allocates: Container[int]
) -> tuple[PoolState, object]:
    """Every call but allocate: the state after it and its predicted value or error."""
    if isinstance(call, Free):
        if isinstance(call.handles, NotAList):
            return transitions.free(state, call.handles)
        refs = tuple(_resolve(ref, names, window_allocates) for ref in call.handles)
        return transitions.free(state, refs)
    if isinstance(call, FreeAll):
        return transitions.free_all(state, call.owner)
    if isinstance(call, RegisterOwner):
        return transitions.register_owner(state, call.owner)
    if isinstance(call, ReleaseOwner):
        return transitions.release_owner(state, call.owner)
    if isinstance(call, Shrink):
        return transitions.shrink(state, call.stream, call.target_free)
    if isinstance(call, MarkUsed):
        ref = _resolve(call.handle, names, window_allocates)
        return transitions.mark_used(state, ref, call.n_used)
    return state, _query(state, names, call, window_allocates)


def _query(state: PoolState, names: Names, call: Call, window_allocates: Container[int]) -> object:
    """The value (or error) a read-only call must return at ``state``."""
    if isinstance(call, Stats):
        return stats_tuple(stats(state))
    if isinstance(call, Prometheus):
        return prometheus_samples(stats(state))
    if isinstance(call, History):
        return tuple(stats_tuple(view) for view in state.history)
    if isinstance(call, NFree):
        return transitions.n_free(state, call.stream)
    if isinstance(call, BlocksFor):
        handles = transitions.blocks_for(state, call.owner)
        return handles if isinstance(handles, Err) else tuple(names[h] for h in handles)
    if isinstance(call, IsLive):
        return transitions.is_live(state, _resolve(call.handle, names, window_allocates))
    if isinstance(call, IdBound):
        return transitions.id_bound(state)
    if isinstance(call, StoreWrite):
        refs: tuple[HandleArg, ...] = (_resolve(call.handle, names, window_allocates),)
    else:
        assert isinstance(call, StoreRead), f"unknown call {call!r}"
        refs = tuple(_resolve(ref, names, window_allocates) for ref in call.handles)
    # The store checks liveness through the pool: it writes (reads) iff every block is live.
    if all(transitions.is_live(state, ref) for ref in refs):
        return None
    return Err(ErrorKind.VALUE, "a block is not a live handle of the store's pool")


def predicted_outcome(
    state: PoolState, names: Names, event: Event, window_allocates: Container[int]
) -> str:
    """What the spec says ``event``'s call returns or raises at ``state``, as text."""
    call = event.call
    try:
        if isinstance(call, Allocate):
            after, result = transitions.allocate(
                state, call.stream, call.n_tokens, call.owner, call.format
            )
            if isinstance(result, Err):
                return f"raises {result.kind.value}"
            return f"block ids {[after.handles[h].block_id for h in result]}"
        predicted = _transition(state, names, call, window_allocates)[1]
    except _UnresolvableError as unresolvable:
        return f"names handle {unresolvable.args[0]}, whose allocate has not happened yet"
    if isinstance(predicted, Err):
        return f"raises {predicted.kind.value}"
    if isinstance(call, BlocksFor) and isinstance(predicted, tuple):
        return "[" + ", ".join(describe_ref(ref) for ref in predicted) + "]"
    return "ok" if predicted is None else repr(predicted)
