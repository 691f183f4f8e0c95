"""The aliasing replay with shared blocks: sharing is accepted, writing through one is not.

Two live handles of one id are fine when the pool counts them; a handle of
a shared block reads that block's contents; a write through it must be
refused by the store; and a pool that puts a shared block back on the free
list while another handle holds it (vLLM #42571, planted) is caught on MLX
storage.
"""

from __future__ import annotations

import pytest
from planted_bugs import SharedBlockPushedWhileHeld

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.aliasing import AliasingReplay, ReplayError, mlx_backend
from veloxquant_mlx.testing.store_operations import Gather, Write
from veloxquant_mlx.testing.traces import StoreSpec, TraceLine
from veloxquant_mlx_spec.operations import Allocate, Fork, Free, FreeAll, MakeWritable, Share
from veloxquant_mlx_spec.table import Raised, h

SPEC = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=2)
CONFIG = PoolConfig(block_size=2, n_blocks=4, separate_kv=False)


def _engine(pool_type: type[BlockPoolAllocator] = BlockPoolAllocator) -> AliasingReplay[object]:
    engine: AliasingReplay[object] = AliasingReplay(
        CONFIG,
        SPEC,
        mlx_backend(),  # type: ignore[arg-type]
        pool_type=pool_type,
    )
    return engine


def _lines(*ops: object) -> list[TraceLine]:
    return [TraceLine(op, call) for call, op in enumerate(ops)]


def test_a_fork_a_copy_on_write_and_both_frees_replay_cleanly() -> None:
    engine = _engine()
    engine.run(
        _lines(
            Allocate("kv", 3, 0),  # ids 0, 1
            Fork(0, 1),  # h(1, 0), h(1, 1): the same ids
            Gather(0, (h(1, 0), h(1, 1)), 3),  # the fork reads what owner 0 holds
            MakeWritable(h(1, 1)),  # h(3, 0): a block of its own
            Write(0, h(3, 0), 0, 2),
            Gather(0, (h(0, 0), h(0, 1)), 4),  # owner 0 reads what it read before
            FreeAll(0),
            FreeAll(1),
        )
    )
    assert engine.pool.stats.blocks_in_use() == 0


def test_a_write_through_a_shared_handle_is_refused_by_the_store() -> None:
    engine = _engine()
    engine.run(_lines(Allocate("kv", 2, 0), Share((h(0, 0),), 1)))
    refused = engine.apply(TraceLine(Write(0, h(1, 0), 0, 1), 2))
    assert refused.outcome == Raised("ValueError")
    refused = engine.apply(TraceLine(Write(1, h(0, 0), 1, 1), 3))  # the first holder too
    assert refused.outcome == Raised("ValueError")


def test_a_block_freed_while_another_handle_holds_it_is_caught_on_mlx() -> None:
    engine = _engine(SharedBlockPushedWhileHeld)
    engine.run(_lines(Allocate("kv", 2, 0), Share((h(0, 0),), 1)))
    # Caught at the free itself, before any write could land: the replay checks the books.
    with pytest.raises(ReplayError, match=r"op #2 .*partition: block id 0 is in free list"):
        engine.apply(TraceLine(Free((h(0, 0),)), 2))
