"""Properties: the allocator, the spec and a second model by hand agree; check_invariants().

The plain model (``plain_model.PoolModel``) is the contract written as plain
Python by hand, independently of the spec. It runs as a third party in the
conformance machine (``veloxquant_mlx.testing.conformance``): after every
call, the allocator, the executable spec and the plain model must agree on
its outcome and on everything each of them shows (exact ids, every handle's
fields, every counter, the history, free counts, every owner's handles). No
model runs alone. The rest pins ``check_invariants()`` on corrupted pools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from conftest import make_pool
from plain_model import PlainModelOracle

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    InvariantViolationError,
)
from veloxquant_mlx.testing.conformance import PoolConformanceMachine
from veloxquant_mlx.testing.lockstep import Oracle
from veloxquant_mlx_spec import model


class ThreeWayAgreement(PoolConformanceMachine):
    """The conformance machine with the plain model beside the spec: three parties agree."""

    def oracles(self, config: model.SpecConfig, history_len: int) -> Sequence[Oracle]:
        return (PlainModelOracle(config, history_len),)


TestAllocatorSpecAndPlainModelAgree = pytest.mark.slow(seconds=16)(ThreeWayAgreement.TestCase)


# ---------------------------------------------------------------- check_invariants


def private(pool: BlockPoolAllocator, name: str) -> Any:
    """A private attribute the corruption tests poke at, or a skip naming it."""
    if not hasattr(pool, name):
        pytest.skip(f"BlockPoolAllocator has no {name}; corruption test needs the lead's name")
    return getattr(pool, name)


def bump_stat(name: str) -> Callable[[BlockPoolAllocator, list[Block]], None]:
    def corrupt(pool: BlockPoolAllocator, blocks: list[Block]) -> None:
        stats = private(pool, "_stats")
        setattr(stats, name, getattr(stats, name) + 1)

    return corrupt


CORRUPTIONS: list[tuple[str, Callable[[BlockPoolAllocator, list[Block]], None]]] = [
    ("in-use-id-on-free-list", lambda p, b: private(p, "_free_lists")["k"].append(0)),
    ("free-id-on-free-list-twice", lambda p, b: private(p, "_free_lists")["k"].append(3)),
    ("free-id-lost", lambda p, b: private(p, "_free_lists")["v"].pop()),
    ("owned-id-lost", lambda p, b: private(p, "_owner_blocks")[1].pop(0)),
    ("n_blocks-off-by-one", bump_stat("n_blocks")),
    ("fragmented-count-off-by-one", bump_stat("_fragmented_count")),
    ("fill-level-written-directly", lambda p, b: setattr(b[1], "n_used", 4)),
    ("owner-written-directly", lambda p, b: setattr(b[0], "owner", 2)),
]


def test_check_invariants_passes_on_a_fresh_pool() -> None:
    for separate_kv in (True, False):
        make_pool(n_blocks=7, separate_kv=separate_kv).check_invariants()


@pytest.mark.parametrize(
    "corrupt", [pytest.param(corrupt, id=name) for name, corrupt in CORRUPTIONS]
)
def test_check_invariants_catches_corruption(
    corrupt: Callable[[BlockPoolAllocator, list[Block]], None],
) -> None:
    pool = make_pool(block_size=4, n_blocks=8)
    blocks = pool.allocate("k", 6, owner=1)  # ids 0 (full) and 1 (n_used 2); k free: 2, 3
    pool.check_invariants()
    corrupt(pool, blocks)
    with pytest.raises(InvariantViolationError) as excinfo:
        pool.check_invariants()
    assert str(excinfo.value)


def test_invariant_violation_error_is_an_assertion_error() -> None:
    assert issubclass(InvariantViolationError, AssertionError)
