"""The allocator conforms to the executable spec, through the shipped conformance kit.

Also shows that the kit has teeth: allocators with planted bugs fail it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planted_bugs import (
    FreeCountsBlocks,
    FreeListIsFifo,
    GrowthIgnoresCap,
    assert_the_conformance_machine_catches,
)

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.testing.conformance import (
    conformance_test_case,
    default_factory,
)
from veloxquant_mlx_spec import model

TestBlockPoolAllocatorConformsToTheSpec = pytest.mark.slow(seconds=15)(
    conformance_test_case(default_factory)
)


@pytest.mark.slow
@pytest.mark.parametrize("buggy", [FreeCountsBlocks, FreeListIsFifo, GrowthIgnoresCap])
def test_the_conformance_machine_catches_a_planted_bug(buggy: type[BlockPoolAllocator]) -> None:
    assert_the_conformance_machine_catches(buggy)


RAW_FIELD_VALUES = st.one_of(
    st.integers(-2, 6), st.booleans(), st.none(), st.sampled_from([1.0, "4", 2**70])
)


@given(
    block_size=RAW_FIELD_VALUES,
    n_blocks=RAW_FIELD_VALUES,
    separate_kv=RAW_FIELD_VALUES,
    grow_on_exhaustion=RAW_FIELD_VALUES,
    max_blocks=RAW_FIELD_VALUES,
)
def test_pool_config_validation_matches_the_spec(
    block_size: object,
    n_blocks: object,
    separate_kv: object,
    grow_on_exhaustion: object,
    max_blocks: object,
) -> None:
    raw = (block_size, n_blocks, separate_kv, grow_on_exhaustion, max_blocks)
    predicted = model.make_config(*raw)
    try:
        PoolConfig(*raw)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        assert isinstance(predicted, model.Err), f"PoolConfig{raw} raised {error!r}"
        assert type(error).__name__ == predicted.kind.value
    else:
        assert not isinstance(predicted, model.Err), f"PoolConfig{raw} accepted; {predicted}"


@given(history_len=st.one_of(st.integers(-3, 3), st.sampled_from([True, 1.5, "2", None])))
def test_history_len_validation_matches_the_spec(history_len: object) -> None:
    predicted = model.new_pool(model.SpecConfig(n_blocks=2), history_len)
    try:
        BlockPoolAllocator(PoolConfig(n_blocks=2), history_len=history_len)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        assert isinstance(predicted, model.Err)
        assert type(error).__name__ == predicted.kind.value
    else:
        assert not isinstance(predicted, model.Err)
