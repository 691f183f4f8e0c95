"""The spec's default arguments are the allocator's.

A port reads the spec's signatures as the API; a default that drifts from
``PoolConfig()``, ``BlockPoolAllocator()`` or ``n_free()`` would mislead it
without any conformance step noticing, because the conformance kit always
passes every argument explicitly (mutation testing found all three
defaults unpinned).
"""

from __future__ import annotations

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx_spec.model import PoolState, SpecConfig, make_config, new_pool
from veloxquant_mlx_spec.transitions import n_free


def test_make_config_without_arguments_is_the_default_pool_config() -> None:
    default = PoolConfig()
    assert make_config() == SpecConfig(
        default.block_size,
        default.n_blocks,
        default.separate_kv,
        default.grow_on_exhaustion,
        default.max_blocks,
    )


def test_new_pool_without_arguments_has_the_default_config_and_history_len() -> None:
    state = new_pool()
    assert isinstance(state, PoolState), state
    assert state.config == make_config()
    assert state.history_len == BlockPoolAllocator().history.maxlen


def test_n_free_without_a_stream_counts_the_k_stream() -> None:
    state = new_pool(SpecConfig(block_size=4, n_blocks=3))  # "k" holds 2 ids, "v" 1
    assert isinstance(state, PoolState), state
    assert n_free(state) == 2
    assert BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=3)).n_free() == 2
