"""The calls on a pool's backing store that traces record, declared like the pool's own.

Traces and stress histories record store calls beside pool calls, so they
are declared with the same :func:`~veloxquant_mlx_spec.table.operation`
machinery (target ``"store"``): the trace codec, handle renaming and the
linearizability checker treat them like any other call. The store's
arguments are not the pool's: a ``write`` carries the number of tokens, and
whoever replays it writes values of its own (the aliasing replay's
sentinels, a stress thread's marker), and a ``gather`` is checked by its
reader. What the spec says of them is what the pool decides: a store call
is refused (``ValueError``) exactly when a block it names is not a live
handle, and it changes no pool state. The shape rules (layer, slots, token
count) are the store's, checked by :class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`.

Complexity and thread safety: immutable values, declared at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from veloxquant_mlx_spec import transitions
from veloxquant_mlx_spec.model import Err, ErrorKind, HandleArg, PoolState
from veloxquant_mlx_spec.table import Domain, HandleList, HandleRef, Returns, operation, query

__all__ = ["Gather", "StoreOperation", "Sync", "Write"]

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


def _written(
    state: PoolState, layer: object, block: HandleArg, start: object, n_tokens: object
) -> Err | None:
    """`write`: refused unless ``block`` is a live handle (the store asks the pool)."""
    return None if transitions.is_live(state, block) else Err(ErrorKind.VALUE, _NOT_LIVE)


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
    rules=("C-STALE-HANDLE",),
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
