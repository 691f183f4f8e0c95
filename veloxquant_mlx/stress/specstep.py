"""One recorded call, applied to the executable spec: the state after it, or "not allowed".

The linearizability checker tries recorded calls in many orders; each try is
:func:`step`: turn the call's handle names into the spec's serials, apply
the spec's transition (through the operation table), and keep the result
only if the outcome the thread recorded is the one the spec predicts there
(the same value, or the same error class) and, for a call that hands out
handles, each handle showed what the spec's handle shows there. A store
call whose layer, slots or token count the store refuses is refused
wherever it goes: recorded as returning, it is allowed nowhere.

What a handle shows (a line's ``shows``) is read just after its call
returned (:mod:`~veloxquant_mlx.stress.recording`): ``stream``, ``format``
and ``ever_allocated`` never change for a handle, so they must be the
spec's at the linearization point; ``n_used`` and ``owner`` must be too, or
``0`` and ``None``: a call linearized after this one may have freed the
handle before its fields were read (a ``free_all`` of its owner by another
thread), and a freed handle shows exactly that (C-STALE-HANDLE). Read while
the free runs, on a free-threaded CPython, the row may also show the
predicted ``n_used`` beside ``owner`` ``None`` (the free stores ``owner``
first, the row reads ``n_used`` first), which fits too. Values are compared
with their types (``same_value``).

A :class:`Checkpoint` is a spec state plus ``names``: ``names[h]`` is the
name (``h(op_id, position)``) of the spec's handle ``h``. Spec handle ids
are checkout serial numbers, so which name gets which id depends on the
order in which the calls that hand out handles were linearized: the mapping
is part of the search state, and :func:`step` extends it.

:func:`compact` drops the stale handles from a state and renumbers the live
ones, keeping their order. This changes nothing observable: every spec
transition ignores a handle whose ``owner`` is ``None`` (``live_handles``,
``is_active``, ``blocks_for`` and ``stats`` filter on it), and a call that
names a stale handle gets exactly the outcome it would get with a block
built by hand (``ForeignBlock(None)``): ``free`` and ``is_live`` see a
non-live block, ``mark_used`` succeeds with no visible effect. New handles
get ids after the live ones, and ``names`` follows the renumbering. So a
checkpoint stays as small as the pool's live handles, instead of growing
with every handle the run ever made, and states that differ only in stale
handles become equal, which the checker's memo then merges.

Complexity: :func:`step` costs one spec transition, O(live handles + pool
size). Thread safety: pure functions over immutable values.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace
from typing import Final

from veloxquant_mlx.testing.sides import describe
from veloxquant_mlx.testing.store_operations import Gather, Write, fits_the_store
from veloxquant_mlx.testing.traces import SHOWN_FIELDS, TraceLine
from veloxquant_mlx_spec.model import (
    Err,
    ForeignBlock,
    HandleArg,
    HandleView,
    PoolState,
    SpecConfig,
    is_int,
    new_pool,
)
from veloxquant_mlx_spec.table import (
    Handle,
    HandleRef,
    Outcome,
    Raised,
    Returned,
    declaration_of,
    issued,
    matches,
    same_value,
    spec_call,
    spec_outcome,
)

__all__ = [
    "Checkpoint",
    "Names",
    "compact",
    "initial_checkpoint",
    "predicted_outcome",
    "step",
]

Names = tuple[Handle, ...]
"""``names[h]``: the name of the spec's handle ``h``."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A spec state and the names of its handles (see the module docstring)."""

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


class _UnresolvableError(Exception):
    """A handle name whose call is in this window but not linearized yet."""


def _resolver(names: Names, window_calls: Container[int]) -> object:
    def resolve(ref: HandleRef) -> HandleArg:
        """The spec's reference for a recorded one (see the module docstring for stale names)."""
        if not isinstance(ref, Handle):
            return ref
        try:
            return names.index(ref)
        except ValueError:
            if ref.call in window_calls:
                raise _UnresolvableError(ref) from None
            return ForeignBlock(None)  # stale since an earlier checkpoint (or never issued)

    return resolve


def _predict(
    state: PoolState, names: Names, event: TraceLine, window_calls: Container[int]
) -> tuple[PoolState, Outcome, object]:
    """The state after ``event``'s call, its outcome, and its raw result (serials)."""
    after, result = spec_call(state, event.op, _resolver(names, window_calls))  # type: ignore[arg-type]
    return after, spec_outcome(declaration_of(event.op), after, result, names.__getitem__), result


#: Where a freed handle's ``n_used`` and ``owner`` are in a row of ``shows``.
_N_USED: Final = SHOWN_FIELDS.index("n_used")
_OWNER: Final = SHOWN_FIELDS.index("owner")
if SHOWN_FIELDS != ("stream", "format", "n_used", "owner", "ever_allocated"):
    raise ImportError(f"_spec_shows lists a handle's fields in another order than {SHOWN_FIELDS}")


def _spec_shows(view: HandleView) -> tuple[object, ...]:
    """What the spec's handle ``view`` shows, as a row of ``shows`` (always ever allocated)."""
    return (view.stream, view.format, view.n_used, view.owner, True)


def _freed_since(row: tuple[object, ...], predicted: tuple[object, ...]) -> bool:
    """``row`` is ``predicted`` but freed, or being freed: ``owner`` ``None`` and ``n_used``
    0, or still the predicted count (module doc). A free stores ``owner`` and then
    ``n_used``, and the row reads ``n_used`` first, so on a free-threaded CPython the
    row may see the count from before the free beside the owner from after it."""
    freed = list(predicted)
    freed[_OWNER] = None
    if same_value(row, tuple(freed)):
        return True
    freed[_N_USED] = 0
    return same_value(row, tuple(freed))


def _shown_misfit(
    event: TraceLine, state: PoolState, names: Names, after: PoolState, result: object
) -> str | None:
    """Where what ``event``'s handles showed differs from the spec's handles, or ``None``.

    ``result`` is the spec's raw result of the call at ``state`` (the serials
    of the handles it returned), ``after`` the state it leads to. A line that
    recorded no ``shows``, or no return, fits.
    """
    shows = event.shows
    if shows is None or not isinstance(event.outcome, Returned) or isinstance(result, Err):
        return None
    serials = result if isinstance(result, tuple) else (result,)
    if len(shows) != len(serials):
        return f"it shows {len(shows)} handle(s) where the spec returns {len(serials)}"
    for position, (row, serial) in enumerate(zip(shows, serials, strict=True)):
        assert is_int(serial), "a returned handle is a serial"
        predicted = _spec_shows(after.handles[serial])
        if same_value(row, predicted) or _freed_since(row, predicted):
            continue
        issued_here = serial >= len(state.handles)
        name = Handle(event.call or 0, position) if issued_here else names[serial]
        differ = [
            (field, got, want)
            for field, got, want in zip(SHOWN_FIELDS, row, predicted, strict=True)
            if not same_value(got, want)
        ]
        shown = ", ".join(f"{field}={got!r}" for field, got, _ in differ)
        spec = ", ".join(f"{field}={want!r}" for field, _, want in differ)
        return f"{name!r} shows {shown} as the call returns; the spec predicts {spec}"
    return None


def _refused_for_its_shape(event: TraceLine, store_layers: int, block_size: int) -> bool:
    """A store call refused for its layer, slots or token count: the store's rule, not the spec's.

    The spec decides whether the blocks are live (and a write's unshared); a
    store also refuses a call whose shape does not fit it, wherever the call
    is linearized. Only then is a recorded ``ValueError`` excused where the
    spec predicts success: excusing it anywhere would let the search place a
    write refused for sharing where its block is not shared, an order the
    storage replay then contradicts.
    """
    return event.outcome == Raised("ValueError") and _misfit(event, store_layers, block_size)


def _returned_though_misfit(event: TraceLine, store_layers: int, block_size: int) -> bool:
    """A store call recorded as returning whose layer, slots or token count the store
    refuses: no order makes it so, and no spec state excuses it."""
    return isinstance(event.outcome, Returned) and _misfit(event, store_layers, block_size)


def _misfit(event: TraceLine, store_layers: int, block_size: int) -> bool:
    """A store call whose layer, slots or token count the store refuses, wherever it goes."""
    op = event.op
    return isinstance(op, Write | Gather) and not fits_the_store(op, store_layers, block_size)


def step(
    state: PoolState,
    names: Names,
    event: TraceLine,
    window_calls: Container[int],
    *,
    store_layers: int,
) -> tuple[PoolState, Names] | None:
    """Linearize ``event`` at ``state``: the next state and names, or ``None`` if not allowed.

    Args:
        state: The spec state before the call.
        names: The names of ``state``'s handles.
        event: The recorded call and outcome (a pending one allows any outcome).
        window_calls: Labels of the window's calls that hand out handles; a name
            made by one of them that is not in ``names`` yet cannot be used.
        store_layers: The layers of the store the history's store calls went to
            (a call refused for its shape is refused wherever it goes).

    Returns:
        ``(state after, names after)``, or ``None``: the spec predicts another
        outcome here (or other fields of a handle it hands out), or the call
        names a handle not handed out yet.
    """
    if _returned_though_misfit(event, store_layers, state.config.block_size):
        return None
    try:
        after, predicted, result = _predict(state, names, event, window_calls)
    except _UnresolvableError:
        return None
    if not matches(event.outcome, predicted) and not _refused_for_its_shape(
        event, store_layers, state.config.block_size
    ):
        return None
    if event.shows is not None and _shown_misfit(event, state, names, after, result):
        return None
    if isinstance(predicted, Raised) or event.call is None:
        return after, names
    new = tuple(Handle(event.call, i) for i in range(len(issued(state, after))))
    return after, names + new


def predicted_outcome(
    state: PoolState,
    names: Names,
    event: TraceLine,
    window_calls: Container[int],
    *,
    store_layers: int,
) -> str:
    """What the spec says ``event``'s call returns or raises at ``state``, as text; a
    store call recorded as returning that a store of ``store_layers`` refuses says so."""
    block_size = state.config.block_size
    if _returned_though_misfit(event, store_layers, block_size):
        return (
            f"a store of {store_layers} layer(s) and blocks of {block_size} slots refuses its "
            "layer, slots or token count, wherever it goes"
        )
    try:
        after, predicted, result = _predict(state, names, event, window_calls)
    except _UnresolvableError as unresolvable:
        return f"names handle {unresolvable.args[0]!r}, whose call has not happened yet"
    said = describe(predicted)
    misfit = _shown_misfit(event, state, names, after, result)
    if misfit is not None and matches(event.outcome, predicted):
        return f"{said} too, but {misfit}"
    return said
