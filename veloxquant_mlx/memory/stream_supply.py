"""Whether a pool can supply blocks of several streams at once, refused as the pool refuses.

A KV cache takes a key block and a value block per ``block_size`` positions
(and a copy-on-write moves a shared key block and its value block), in one
pool call per stream: the pool checks out one stream per call. Were the
second call refused, giving back what the first one took would still leave
traces: growth the first call made stays (one list longer, the room under
``max_blocks`` spent, so a request a fresh pool admits can be refused), and
the counters would record an allocation, a free and perhaps a peak that no
request ever held.

:func:`require_supply` looks first. From the pool's public counts and the
contract's admission rule (docs/CONTRACT.md C-GROW-EXACT: a stream short of
blocks grows by exactly the missing number, unless that takes
``stats.n_blocks`` past ``max_blocks``; in a pool with one shared list both
streams draw on it) it decides whether every stream's demand can be met at
once. If not, it makes the one pool call the pool must refuse: a stream that
lacks blocks asks for what all the streams lack together. The refusal counts
once in ``n_exhausted`` and changes nothing else (C-ALL-OR-NOTHING), and
the error names the whole demand.

Complexity: O(streams) pool reads, each O(1). Thread safety: the pool locks
each call, but the look and the calls after it are not one atomic step.
Another thread may take blocks in between, so a caller keeps its own undo for
a refusal after the look; or it may free blocks, so the call meant to be
refused can succeed, and its blocks are handed to ``give_back``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from veloxquant_mlx.memory.block_pool import Block, BlockPoolExhaustedError

if TYPE_CHECKING:
    from veloxquant_mlx_spec.operations import CheckedBlockPool

__all__ = ["require_supply"]

#: The one list of a pool built with ``separate_kv=False``.
SHARED_LIST = "kv"


def require_supply(
    pool: CheckedBlockPool[Block],
    demand: Mapping[str, int],
    owner: int,
    format: str,
    give_back: Callable[[list[Block]], None],
) -> None:
    """Return if ``pool`` can check out ``demand[stream]`` blocks of each stream at once.

    Args:
        pool: The pool the blocks come from.
        demand: Blocks wanted per stream (``"k"``, ``"v"``), each ``>= 0``.
        owner: The owner the refused call names (a refused call registers nothing).
        format: The format tag it names.
        give_back: Frees blocks of a call that was meant to be refused but met
            (another thread freed blocks after the look).

    Raises:
        BlockPoolExhaustedError: The demand cannot be met; the pool counted one
            exhaustion and changed nothing else.
    """
    short = _shortfall(pool, demand)
    if short is None:
        return
    stream, n_blocks, why = short
    wanted = " and ".join(f"{n} {name} block(s)" for name, n in demand.items() if n)
    try:
        met = pool.allocate(stream, n_blocks * pool.config.block_size, owner, format)
    except BlockPoolExhaustedError:
        raise BlockPoolExhaustedError(f"owner {owner} needs {wanted} at once; {why}") from None
    give_back(met)  # blocks came free since the look: the caller's own calls decide


def _shortfall(
    pool: CheckedBlockPool[Block], demand: Mapping[str, int]
) -> tuple[str, int, str] | None:
    """``None`` if the demand can be met; else the call to refuse (a stream, how many
    blocks it asks for) and why the demand cannot be met."""
    config = pool.config
    lists = dict(demand) if config.separate_kv else {SHARED_LIST: sum(demand.values())}
    free = {name: pool.n_free("k" if name == SHARED_LIST else name) for name in lists}
    missing = sum(max(0, need - free[name]) for name, need in lists.items())
    if missing == 0:
        return None
    n_blocks = pool.stats.n_blocks
    if config.grow_on_exhaustion:
        cap = config.max_blocks
        if cap is None or n_blocks + missing <= cap:
            return None
        past = f"max_blocks={cap} (it has {n_blocks})"
        limit = f"growing by {missing} would take the pool past {past}"
    else:
        limit = "growth is off (PoolConfig.grow_on_exhaustion=False)"
    short = next(name for name, need in lists.items() if need > free[name])
    held = ", ".join(f"{name}: {free[name]} free" for name in lists)
    stream = "k" if short == SHARED_LIST else short
    return stream, free[short] + missing, f"{held}; {limit}"
