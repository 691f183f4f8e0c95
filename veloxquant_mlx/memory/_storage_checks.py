"""Argument checks and the sizing rule shared by every backing store.

Both reference stores (MLX and NumPy) validate their constructor's,
``write``'s and ``gather``'s arguments the same way and resize their slabs by
the same rule; a port to another backend can reuse them too. Pure Python: no
array library here.

Complexity: O(1) per check, except ``require_all_live`` (O(k) for k blocks,
one pool lock). Thread safety: pure functions; the liveness checks take the
pool's lock through its public methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

DtypeT = TypeVar("DtypeT")


def next_capacity(capacity: int, id_bound: int) -> int:
    """The slab capacity a store resizes to when the pool's ``id_bound`` is as given.

    Grow geometrically, to ``max(2 * capacity, id_bound)``, when ``id_bound``
    exceeds it; shrink exactly to ``id_bound`` once that is at most half the
    capacity; otherwise keep it. After a resize ``id_bound <= capacity < 2 *
    id_bound`` (or both are 0), so a slab never holds more than twice what
    the pool's ids need, and alternating growth and shrinkage costs amortised
    O(1) per block.
    """
    if id_bound > capacity:
        return max(2 * capacity, id_bound)
    if 2 * id_bound <= capacity:
        return id_bound
    return capacity


def require_store_arguments(pool: object, n_layers: int, n_kv_heads: int, head_dim: int) -> None:
    """A store's constructor arguments: ``pool`` a ``BlockPoolAllocator``, each size an
    ``int >= 1`` (``TypeError`` for the wrong type, ``ValueError`` below 1)."""
    if not isinstance(pool, BlockPoolAllocator):
        raise TypeError(f"pool must be a BlockPoolAllocator, got {type(pool).__name__}")
    for name, value in (
        ("n_layers", n_layers),
        ("n_kv_heads", n_kv_heads),
        ("head_dim", head_dim),
    ):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value}")


def require_token_shape(shape: tuple[int, ...], slot_shape: tuple[int, int]) -> int:
    """Return ``n`` if ``shape`` is ``(n, n_kv_heads, head_dim)``; raise ``ValueError``."""
    if len(shape) != 3 or shape[1:] != slot_shape:
        raise ValueError(
            f"tokens must have shape (n, {slot_shape[0]}, {slot_shape[1]}), got {shape}"
        )
    return shape[0]


def require_token_dtype(
    dtype: DtypeT, store_dtype: DtypeT, name: Callable[[DtypeT], str], what: str = "tokens"
) -> None:
    """Written tokens (or keys, values, queries: ``what``) must already have the store's
    element type: nothing is cast.

    A silent cast would change what a model computed (bfloat16 keys in a
    float16 store lose range; 1e6 becomes inf; ints become floats), so a
    mismatch is the caller's error, named with both types (``name`` formats
    them; called only then, so the check costs one comparison).
    """
    if dtype != store_dtype:
        raise TypeError(
            f"{what} must have the store's dtype {name(store_dtype)}, got {name(dtype)}; a "
            "store never casts (a cast would change the values), so build it with the dtype "
            "its writers produce"
        )


def require_layer(layer: int, n_layers: int) -> None:
    """``layer`` must be an int in ``0 .. n_layers - 1``."""
    if type(layer) is not int:
        raise TypeError(f"layer must be an int, got {layer!r}")
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer must be in 0..{n_layers - 1}, got {layer}")


def require_live(pool: CheckedBlockPool[Block], block: Block, action: str) -> None:
    """``block`` must be a live handle of ``pool``; ``action`` words the error."""
    if not isinstance(block, Block):
        raise TypeError(f"block must be a Block, got {type(block).__name__}: {block!r}")
    if not pool.is_live(block):
        raise ValueError(
            f"cannot {action} {block!r}: it is not a live handle of this store's pool; "
            "expected a block checked out from the pool and not yet freed"
        )


def require_writable(pool: CheckedBlockPool[Block], block: Block, action: str) -> None:
    """``block`` must be a live handle of ``pool`` that no other handle shares."""
    require_live(pool, block, action)
    if pool.is_shared(block.block_id):
        raise ValueError(
            f"cannot {action} {block!r}: its block is shared by other handles and so "
            "read-only (docs/CONTRACT.md#c-shared-read-only); expected a block this handle "
            "holds alone: call pool.make_writable(block) first"
        )


def block_list_of(blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` as a list (its items as given); a ``TypeError`` naming the argument if
    iterating it cannot start (a ``None`` where a sequence of blocks belongs, say). An
    error raised while its items are read is the caller's own and passes unchanged."""
    try:
        items = iter(blocks)
    except TypeError:
        raise TypeError(
            f"blocks must be a sequence of Block handles, got {blocks!r} ({type(blocks).__name__})"
        ) from None
    return list(items)


def require_all_live(pool: CheckedBlockPool[Block], blocks: Sequence[Block]) -> None:
    """Refuse unless every item of ``blocks`` is a live handle: one pool lock, not one each."""
    if pool.all_live(blocks):
        return
    for block in blocks:
        require_live(pool, block, "gather from")
    # Every block was live when asked again: one was freed or reissued meanwhile.
    raise ValueError(
        "cannot gather from blocks that were not all live handles of this store's pool "
        "when checked; was one freed concurrently?"
    )


def copy_layers(pool: CheckedBlockPool[Block], layer: int | None, n_layers: int, src: int) -> range:
    """The layers ``copy_block(layer, src, ...)`` copies, once its arguments are checked.

    ``layer`` is one layer or ``None`` (every one); ``src`` a block id that is
    checked out, so its slots hold some request's data.
    """
    if layer is not None:
        require_layer(layer, n_layers)
    if type(src) is not int:
        raise TypeError(f"src must be a block id (an int), got {src!r}")
    if src < 0 or pool.ref_count(src) == 0:
        raise ValueError(
            f"src must be the id of a checked-out block, got {src}, which holds no data of "
            "any request (free, retired or never issued)"
        )
    return range(n_layers) if layer is None else range(layer, layer + 1)


def require_covered(block: Block, capacity: int) -> None:
    """The block's id is inside the slab (fails only if freed and retired concurrently)."""
    if block.block_id >= capacity:
        raise ValueError(
            f"block id {block.block_id} is outside the store's capacity "
            f"{capacity}; was it freed and retired concurrently?"
        )


def require_slots(start: int, n_tokens: int, block_size: int) -> None:
    """Slots ``start .. start + n_tokens`` must lie inside one block."""
    if type(start) is not int:
        raise TypeError(f"start must be an int, got {start!r}")
    if start < 0 or start + n_tokens > block_size:
        raise ValueError(
            f"slots {start}..{start + n_tokens} fall outside the block; "
            f"expected 0 <= start and start + n_tokens <= block_size = {block_size}"
        )


def require_n_tokens(n_tokens: int, available: int, least: int = 0) -> None:
    """``n_tokens`` must be an int in ``least .. available``."""
    if type(n_tokens) is not int:
        raise TypeError(f"n_tokens must be an int, got {n_tokens!r}")
    if not least <= n_tokens <= available:
        raise ValueError(
            f"n_tokens must be in {least}..{available} (the blocks' slots), got {n_tokens}"
        )
