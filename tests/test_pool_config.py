"""PoolConfig validation, defaults, and the initial layout of a new pool."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import pytest
from conftest import block_ids, make_pool, take_all_free

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig


def test_pool_config_defaults_match_the_reference() -> None:
    config = PoolConfig()
    assert config.block_size == 16
    assert config.n_blocks == 1024
    assert config.separate_kv is True
    assert config.grow_on_exhaustion is False
    assert config.max_blocks is None


def test_pool_config_is_frozen() -> None:
    config = PoolConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", "16"),
        ("block_size", 16.0),
        ("block_size", True),
        ("block_size", None),
        ("n_blocks", "8"),
        ("n_blocks", 8.0),
        ("n_blocks", False),
        ("n_blocks", None),
        ("separate_kv", 1),
        ("separate_kv", "yes"),
        ("separate_kv", None),
        ("grow_on_exhaustion", 0),
        ("grow_on_exhaustion", "no"),
        ("grow_on_exhaustion", None),
        ("max_blocks", "64"),
        ("max_blocks", 64.0),
        ("max_blocks", True),
    ],
)
@pytest.mark.parametrize("grow_on_exhaustion", [True, False])
def test_pool_config_rejects_a_field_of_the_wrong_type(
    field: str, value: Any, grow_on_exhaustion: bool
) -> None:
    kwargs: dict[str, Any] = {"n_blocks": 8, "grow_on_exhaustion": grow_on_exhaustion}
    kwargs[field] = value
    with pytest.raises(TypeError):
        PoolConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -1},
        {"n_blocks": -1},
        {"n_blocks": 8, "grow_on_exhaustion": True, "max_blocks": 7},
        {"n_blocks": 8, "grow_on_exhaustion": True, "max_blocks": 0},
        {"n_blocks": 0, "grow_on_exhaustion": True, "max_blocks": -1},
    ],
    ids=repr,
)
def test_pool_config_rejects_an_out_of_range_value(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PoolConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 1, "n_blocks": 0},
        {"n_blocks": 0, "grow_on_exhaustion": True},
        {"n_blocks": 8, "grow_on_exhaustion": True, "max_blocks": 8},
        {"n_blocks": 8, "grow_on_exhaustion": True, "max_blocks": None},
        {"n_blocks": 8, "grow_on_exhaustion": True, "max_blocks": 100},
    ],
    ids=repr,
)
def test_pool_config_accepts_boundary_values(kwargs: dict[str, Any]) -> None:
    config = PoolConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize("max_blocks", [7, 0, -5])
def test_pool_config_ignores_max_blocks_below_n_blocks_when_not_growing(max_blocks: int) -> None:
    config = PoolConfig(n_blocks=8, grow_on_exhaustion=False, max_blocks=max_blocks)
    assert config.max_blocks == max_blocks


def test_allocator_without_config_uses_the_default_config() -> None:
    pool = BlockPoolAllocator()
    assert pool.config == PoolConfig()
    assert pool.n_free("k") == 512
    assert pool.n_free("v") == 512
    assert pool.stats.n_blocks == 1024


def test_allocator_config_property_returns_the_given_config() -> None:
    config = PoolConfig(block_size=8, n_blocks=6, separate_kv=False)
    assert BlockPoolAllocator(config).config == config


@pytest.mark.parametrize("n_blocks", [0, 1, 2, 3, 7, 8])
def test_separate_pool_gives_k_the_first_half_rounded_up_and_v_the_rest(n_blocks: int) -> None:
    pool = make_pool(block_size=2, n_blocks=n_blocks)
    n_k = math.ceil(n_blocks / 2)
    assert pool.n_free("k") == n_k
    assert pool.n_free("v") == n_blocks - n_k
    assert take_all_free(pool, "k", owner=1) == list(range(n_k))
    assert take_all_free(pool, "v", owner=2) == list(range(n_k, n_blocks))


@pytest.mark.parametrize("n_blocks", [0, 1, 5])
def test_shared_pool_puts_every_block_on_the_kv_list(n_blocks: int) -> None:
    pool = make_pool(block_size=2, n_blocks=n_blocks, separate_kv=False)
    assert pool.n_free("kv") == n_blocks
    assert take_all_free(pool, "kv", owner=1) == list(range(n_blocks))


def test_a_pool_of_zero_blocks_without_growth_is_always_exhausted() -> None:
    pool = make_pool(n_blocks=0)
    assert pool.stats.n_blocks == 0
    assert pool.stats.fragmentation() == 0.0
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, owner=1)


def test_a_pool_of_zero_blocks_with_growth_only_grows() -> None:
    pool = make_pool(n_blocks=0, grow_on_exhaustion=True)
    assert block_ids(pool.allocate("k", 5, owner=1)) == [0, 1]
    assert pool.stats.n_blocks == 2


def test_history_defaults_to_1024_entries() -> None:
    pool = BlockPoolAllocator(PoolConfig(n_blocks=4))
    history = pool.history
    assert isinstance(history, deque)
    assert history.maxlen == 1024
    assert len(history) == 0


@pytest.mark.parametrize("history_len", [0, 1, 5])
def test_history_len_sets_the_history_bound(history_len: int) -> None:
    pool = make_pool(history_len=history_len)
    assert pool.history.maxlen == history_len


@pytest.mark.parametrize("history_len", [1.0, "8", None, True])
def test_allocator_rejects_a_non_int_history_len(history_len: Any) -> None:
    with pytest.raises(TypeError):
        BlockPoolAllocator(PoolConfig(n_blocks=4), history_len=history_len)


def test_allocator_rejects_a_negative_history_len() -> None:
    with pytest.raises(ValueError):
        BlockPoolAllocator(PoolConfig(n_blocks=4), history_len=-1)
