"""The calls on a pool's backing store that traces record, declared like the pool's own.

Traces and stress histories record store calls beside pool calls, so they
are declared with the same :func:`~veloxquant_mlx_spec.table.operation`
machinery (target ``"store"``): the trace codec, handle renaming and the
linearizability checker treat them like any other call. The store's
arguments are not the pool's: a ``write`` carries the number of tokens, and
whoever replays it writes values of its own (the aliasing replay's
sentinels, a stress thread's marker), and a ``gather`` is checked by its
reader. What the spec says of them is what the pool decides: a store call
is refused (``ValueError``) when a block it names is not a live handle, a
write also when its block is shared (its count is above 1: a shared block is
read-only until ``make_writable``), and it changes no pool state. The shape
rules (layer, slots, token count) are the store's: :func:`fits_the_store`
states them once, for :class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`
and for the linearizability checker, which must place a recorded refusal
where the pool explains it unless the shape alone does.

Complexity and thread safety: immutable values, declared at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.model import Err, ErrorKind, HandleArg, PoolState, is_int, ref_count_of
from veloxquant_mlx_spec.table import (
    AsTuple,
    Domain,
    HandleList,
    HandleRef,
    Returns,
    operation,
    query,
)

__all__ = ["Gather", "StoreOperation", "Sync", "Write", "fits_the_store"]

_BAD_INTS: Final[tuple[object, ...]] = (-1, True, None)
LAYER: Final = Domain("layer", lambda c: (0, 1), lambda c: (0,), lambda c: _BAD_INTS)
SLOT: Final = Domain(
    "start", lambda c: tuple(range(c.block_size)), lambda c: (0,), lambda c: _BAD_INTS
)
TOKENS: Final = Domain(
    "n_tokens",
    lambda c: tuple(range(1, c.block_size + 1)),
    lambda c: (c.block_size,),
    lambda c: (c.block_size + 1, *_BAD_INTS),
)
HOLD: Final = Domain("hold", lambda c: (0, 1, 2, 3), lambda c: (0,), lambda c: (-1,))

_NOT_LIVE: Final = "a block is not a live handle of the store's pool"
_SHARED: Final = "the block is shared by other handles, so read-only until make_writable"


def _written(
    state: PoolState, layer: object, block: HandleArg, start: object, n_tokens: object
) -> Err | None:
    """`write`: refused unless ``block`` is a live handle that holds its block alone.

    The store asks the pool both (``is_live``, ``is_shared``), so a write's
    outcome depends on every concurrent call that changes its block's count.
    """
    if not transitions.is_live(state, block):
        return Err(ErrorKind.VALUE, _NOT_LIVE)
    block_id = state.handles[block].block_id  # type: ignore[index]  # live: a serial
    return Err(ErrorKind.VALUE, _SHARED) if ref_count_of(state, block_id) > 1 else None


def _gathered(
    state: PoolState, layer: object, blocks: object, n_tokens: object, hold: object = 0
) -> Err | None:
    """`gather`: refused unless every block is a live handle."""
    if not isinstance(blocks, tuple):
        return Err(ErrorKind.TYPE, "blocks must be a list of Block handles")
    if all(transitions.is_live(state, block) for block in blocks):
        return None
    return Err(ErrorKind.VALUE, _NOT_LIVE)


def _synced(state: PoolState) -> None:
    """`sync`: always fine."""
    return None


@operation(
    returns=Returns.NOTHING,
    transition=query(_written),
    domains={"layer": LAYER, "start": SLOT, "n_tokens": TOKENS},
    source="P",
    target="store",
    changes_state=False,
    rules=("C-STALE-HANDLE", "C-SHARED-READ-ONLY"),
)
@dataclass(frozen=True, slots=True)
class Write:
    """``store.write(layer, block, start, tokens)`` of ``n_tokens`` values the replayer picks."""

    layer: object
    block: HandleRef
    start: object
    n_tokens: object


@operation(
    returns=Returns.NOTHING,
    transition=query(_gathered),
    domains={"layer": LAYER, "n_tokens": TOKENS, "hold": HOLD},
    source="P",
    target="store",
    changes_state=False,
    rules=("C-STALE-HANDLE",),
)
@dataclass(frozen=True, slots=True)
class Gather:
    """``store.gather(layer, blocks, n_tokens)``; checked ``hold`` calls later by the replay."""

    layer: object
    blocks: HandleList
    n_tokens: object
    hold: object = 0


@operation(
    returns=Returns.NOTHING,
    transition=query(_synced),
    source="P",
    target="store",
    changes_state=False,
    rules=("C-STALE-HANDLE",),
)
@dataclass(frozen=True, slots=True)
class Sync:
    """``store.sync()``: return dropped caches' blocks and follow the pool's id bound."""


StoreOperation = Write | Gather | Sync


def fits_the_store(op: Write | Gather, n_layers: int, block_size: int) -> bool:
    """Whether a store with ``n_layers`` layers accepts ``op``'s layer, slots and token count.

    The store's own rules, beside the spec's (live, unshared). A call whose
    numbers are not all ints is refused with ``TypeError``, never for its
    shape, so it fits here.
    """
    layer, n_tokens = op.layer, op.n_tokens
    if not (is_int(layer) and is_int(n_tokens)):
        return True
    if not 0 <= layer < n_layers or n_tokens < 0:
        return False
    if isinstance(op, Write):
        start = op.start
        return not is_int(start) or (start >= 0 and start + n_tokens <= block_size)
    refs = op.blocks.refs if isinstance(op.blocks, AsTuple) else op.blocks
    if not isinstance(refs, tuple):
        return True  # not a list: a TypeError
    return n_tokens <= len(refs) * block_size
