"""The operation alphabet: one value per public call on a block pool.

Every checker in the project speaks it: the Hypothesis conformance machine
draws operations, the small-scope exhaustive checker enumerates them, the
CrossHair drivers decode them from bounded integers, and the stress runner
records concurrent histories in them. An operation's arguments are the raw
values passed to the call (bad ones included), except that a ``Block``
argument is a *reference* the runner resolves against its own handles
(the spec's ``HandleRef``): a checkout serial number, a foreign block, or
something that is not a block at all.

``apply_to_spec`` is the one place that maps an operation to the spec's
transition.

Complexity: construction O(1). Thread safety: immutable values.
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx_spec import model, transitions
from veloxquant_mlx_spec.model import ForeignBlock, NotABlock, NotAList
from veloxquant_mlx_spec.model import HandleArg as HandleRef

__all__ = [
    "Allocate",
    "ForeignBlock",
    "Free",
    "FreeAll",
    "HandleRef",
    "MarkUsed",
    "NotABlock",
    "NotAList",
    "Operation",
    "RegisterOwner",
    "ReleaseOwner",
    "Shrink",
    "apply_to_spec",
]


@dataclass(frozen=True)
class Allocate:
    """``pool.allocate(stream, n_tokens, owner, format)``."""

    stream: object
    n_tokens: object
    owner: object
    format: object = "fp16"


@dataclass(frozen=True)
class Free:
    """``pool.free(blocks)``; ``as_tuple`` passes a tuple instead of a list."""

    blocks: tuple[HandleRef, ...] | NotAList
    as_tuple: bool = False


@dataclass(frozen=True)
class FreeAll:
    """``pool.free_all(owner)``."""

    owner: object


@dataclass(frozen=True)
class RegisterOwner:
    """``pool.register_owner(owner)``."""

    owner: object


@dataclass(frozen=True)
class ReleaseOwner:
    """``pool.release_owner(owner)``."""

    owner: object


@dataclass(frozen=True)
class Shrink:
    """``pool.shrink(stream, target_free)``."""

    stream: object
    target_free: object


@dataclass(frozen=True)
class MarkUsed:
    """``pool.mark_used(block, n_used)``."""

    block: HandleRef
    n_used: object


Operation = Allocate | Free | FreeAll | RegisterOwner | ReleaseOwner | Shrink | MarkUsed


def apply_to_spec(state: model.PoolState, op: Operation) -> tuple[model.PoolState, object]:
    """The spec's transition for ``op``: the state after it, and its result or ``Err``."""
    if isinstance(op, Allocate):
        return transitions.allocate(state, op.stream, op.n_tokens, op.owner, op.format)
    if isinstance(op, Free):
        return transitions.free(state, op.blocks)
    if isinstance(op, FreeAll):
        return transitions.free_all(state, op.owner)
    if isinstance(op, RegisterOwner):
        return transitions.register_owner(state, op.owner)
    if isinstance(op, ReleaseOwner):
        return transitions.release_owner(state, op.owner)
    if isinstance(op, Shrink):
        return transitions.shrink(state, op.stream, op.target_free)
    return transitions.mark_used(state, op.block, op.n_used)
