"""Both reference backing stores pass the shipped storage conformance suite.

The suite itself lives in :mod:`veloxquant_mlx.testing.storage_conformance`
(third parties run it on their stores); this module runs it on
``MLXBlockStorage`` and ``NumpyBlockStorage`` and adds the checks that only
make sense for one backend (memory really released, no view of a slab).
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from conftest import pool_unchanged

from veloxquant_mlx.memory._storage_checks import next_capacity
from veloxquant_mlx.memory.block_pool import Block, BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.testing.aliasing import mlx_backend, numpy_backend
from veloxquant_mlx.testing.storage_conformance import (
    StorageConformance,
    ThreadSafeStorageConformance,
)


class TestMLXBlockStorage(ThreadSafeStorageConformance[mx.array]):
    backend = mlx_backend()


class TestMLXBlockStorageWithLazyWrites(StorageConformance[mx.array]):
    backend = mlx_backend(lazy_writes=True)  # single-thread by design: no thread test


class TestNumpyBlockStorage(ThreadSafeStorageConformance[npt.NDArray[np.generic]]):
    backend = numpy_backend()


def _as_protocol_mlx(store: MLXBlockStorage) -> BlockStorage[mx.array]:
    return store  # mypy checks that the class satisfies the protocol


def _as_protocol_numpy(store: NumpyBlockStorage) -> BlockStorage[npt.NDArray[np.generic]]:
    return store


def test_capacity_rule_grows_geometrically_and_shrinks_at_half() -> None:
    assert next_capacity(8, 9) == 16
    assert next_capacity(8, 40) == 40
    assert next_capacity(0, 3) == 3
    assert next_capacity(16, 9) == 16
    assert next_capacity(16, 8) == 8
    assert next_capacity(16, 0) == 0


def test_mlx_shrink_releases_active_memory() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256, separate_kv=False))
    store = MLXBlockStorage(pool, n_layers=2, n_kv_heads=4, head_dim=64, dtype=mx.float32)
    pool.allocate("kv", 16, owner=1)
    gc.collect()
    before = mx.get_active_memory()
    pool.shrink("kv", 0)
    store.sync()
    gc.collect()
    after = mx.get_active_memory()
    slab_bytes = 256 * 16 * 4 * 64 * 4 * 2
    assert store.resident_bytes() == slab_bytes // 256
    assert before - after >= slab_bytes * 255 // 256, (before, after)


@pytest.mark.parametrize("lazy_writes", [False, True])
def test_mlx_write_reuses_the_slab_buffer_unless_a_gather_is_pending(lazy_writes: bool) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1024, separate_kv=False))
    store = MLXBlockStorage(pool, 1, 4, 64, mx.float32, lazy_writes=lazy_writes)
    slab_bytes = store.resident_bytes()
    [block] = pool.allocate("kv", 16, owner=1)
    token = mx.ones((1, 4, 64))
    mx.eval(token)

    def extra_peak_bytes_of_a_write(slot: int) -> int:
        gc.collect()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        store.write(0, block, slot, token)
        mx.eval(store.gather(0, [block], 16))
        return mx.get_peak_memory() - before

    assert extra_peak_bytes_of_a_write(0) < slab_bytes // 100  # donated: O(slots written)
    pending = store.gather(0, [block], 16)
    assert extra_peak_bytes_of_a_write(1) >= slab_bytes  # copied once: `pending` keeps the old
    assert np.array(pending)[1].sum() == 0


def test_numpy_gather_never_returns_a_view_of_a_slab() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=4, separate_kv=False))
    store = NumpyBlockStorage(pool, n_layers=1, n_kv_heads=1, head_dim=2)
    blocks = pool.allocate("kv", 8, owner=1)
    gathered = store.gather(0, blocks, 5)
    assert gathered.base is None or not np.shares_memory(gathered, store._slabs[0])


def test_the_numpy_store_refuses_tokens_of_another_dtype_naming_both() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2, separate_kv=False))
    store = NumpyBlockStorage(pool, n_layers=1, n_kv_heads=1, head_dim=1, dtype=np.float16)
    [block] = pool.allocate("kv", 2, owner=1)
    expected = (
        "tokens must have the store's dtype float16, got float32; a store never casts (a "
        "cast would change the values), so build it with the dtype its writers produce"
    )
    refused = pytest.raises(TypeError, match=f"^{re.escape(expected)}$")
    with pool_unchanged(pool, owners=[1], handles=[block]), refused:
        store.write(0, block, 0, np.ones((1, 1, 1), dtype=np.float32))


def test_the_numpy_store_reads_in_its_own_dtype_written_or_not() -> None:
    # Slabs of numpy's default float64 read a float16 store's positions back as float64.
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2, separate_kv=False))
    store = NumpyBlockStorage(pool, n_layers=1, n_kv_heads=1, head_dim=1, dtype=np.float16)
    [written, fresh] = pool.allocate("kv", 4, owner=1)
    store.write(0, written, 0, np.full((2, 1, 1), 1.5, dtype=np.float16))
    assert [store.gather(0, [block], 2).dtype for block in (written, fresh)] == [np.float16] * 2


# What the store used to cast silently: a bfloat16 model's keys into a float16 store
# (a logit change), ints, and a float32 value that float16 turns into inf.
UNCASTABLE = {
    "bfloat16 keys": mx.full((1, 1, 1), 3.0, dtype=mx.bfloat16),
    "int32 tokens": mx.full((1, 1, 1), 7, dtype=mx.int32),
    "float32 1e6": mx.full((1, 1, 1), 1e6, dtype=mx.float32),
}


@pytest.mark.parametrize("tokens", UNCASTABLE.values(), ids=UNCASTABLE.keys())
def test_mlx_store_refuses_tokens_it_would_have_to_cast(tokens: mx.array) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2, separate_kv=False))
    store = MLXBlockStorage(pool, n_layers=1, n_kv_heads=1, head_dim=1, dtype=mx.float16)
    [block] = pool.allocate("kv", 2, owner=1)
    store.write(0, block, 0, mx.array([[[1.5]], [[2.5]]], dtype=mx.float16))
    name = str(tokens.dtype).rpartition(".")[2]
    refused = pytest.raises(TypeError, match=f"store's dtype float16, got {name}")
    with pool_unchanged(pool, owners=[1], handles=[block]), refused:
        store.write(0, block, 1, tokens)
    assert store.gather(0, [block], 2).reshape(-1).tolist() == [1.5, 2.5]


@pytest.mark.parametrize("store_class", [MLXBlockStorage, NumpyBlockStorage])
@pytest.mark.parametrize("method", ["gather", "gather_heads"])
def test_a_gather_of_no_sequence_is_a_type_error_naming_blocks(
    store_class: type[MLXBlockStorage] | type[NumpyBlockStorage], method: str
) -> None:
    # It used to say only "'NoneType' object is not iterable", naming no argument.
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2, separate_kv=False))
    store = store_class(pool, n_layers=1, n_kv_heads=1, head_dim=1)
    expected = r"^blocks must be a sequence of Block handles, got None \(NoneType\)$"
    with pool_unchanged(pool), pytest.raises(TypeError, match=expected):
        getattr(store, method)(0, None, 0)


#: A constructor argument gone wrong, and the whole refusal; the other arguments are good.
BAD_CONSTRUCTION = {
    "pool a string": (dict(pool="pool"), TypeError, "pool must be a BlockPoolAllocator, got str"),
    "n_layers 0": (dict(n_layers=0), ValueError, "n_layers must be an int >= 1, got 0"),
    "n_kv_heads a float": (
        dict(n_kv_heads=2.0),
        TypeError,
        "n_kv_heads must be an int >= 1, got 2.0",
    ),
    "head_dim a bool": (dict(head_dim=True), TypeError, "head_dim must be an int >= 1, got True"),
    "head_dim -1": (dict(head_dim=-1), ValueError, "head_dim must be an int >= 1, got -1"),
}


@pytest.mark.parametrize("store_class", [MLXBlockStorage, NumpyBlockStorage])
@pytest.mark.parametrize(
    ("mistake", "error", "message"), BAD_CONSTRUCTION.values(), ids=BAD_CONSTRUCTION.keys()
)
def test_a_store_refuses_bad_construction_naming_the_argument_and_value(
    store_class: type[MLXBlockStorage] | type[NumpyBlockStorage],
    mistake: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2))
    arguments: dict[str, object] = dict(pool=pool, n_layers=1, n_kv_heads=1, head_dim=1)
    with pool_unchanged(pool), pytest.raises(error, match=f"^{re.escape(message)}$"):
        store_class(**(arguments | mistake))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("dtype", "float16", "dtype must be an mlx.core.Dtype, got 'float16'"),
        ("lazy_writes", 1, "lazy_writes must be a bool, got 1"),
    ],
    ids=["dtype", "lazy_writes"],
)
def test_the_mlx_store_refuses_a_dtype_or_lazy_writes_of_another_type(
    name: str, value: object, expected: str
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2))
    arguments: dict[str, object] = {name: value}
    with pool_unchanged(pool), pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        MLXBlockStorage(pool, 1, 1, 1, **arguments)  # type: ignore[arg-type]


#: Each reference store's tokens of one slot, and its refusal of a non-array.
TOKENS_OF: dict[type, tuple[Callable[[], object], str]] = {
    MLXBlockStorage: (
        lambda: mx.ones((1, 1, 1), dtype=mx.float16),
        "tokens must be an mlx.core.array, got list",
    ),
    NumpyBlockStorage: (
        lambda: np.ones((1, 1, 1), dtype=np.float16),
        "tokens must be a numpy.ndarray, got list",
    ),
}
READ_ONLY = (
    "its block is shared by other handles and so read-only "
    "(docs/CONTRACT.md#c-shared-read-only); expected a block this handle holds alone: "
    "call pool.make_writable(block) first"
)
NOT_LIVE = (
    "it is not a live handle of this store's pool; expected a block checked out from "
    "the pool and not yet freed"
)
#: A write or copy refused, as (the call, the handle it names, why).
REFUSED_WRITES = {
    "write to a shared block": ("write to", "shared", READ_ONLY),
    "write to a freed block": ("write to", "freed", NOT_LIVE),
    "copy into a shared block": ("copy into", "shared", READ_ONLY),
    "copy into a freed block": ("copy into", "freed", NOT_LIVE),
}


@pytest.mark.parametrize("store_class", [MLXBlockStorage, NumpyBlockStorage])
@pytest.mark.parametrize(("call", "which", "why"), REFUSED_WRITES.values(), ids=REFUSED_WRITES)
def test_a_store_names_the_call_and_the_block_it_refuses_to_write(
    store_class: type[MLXBlockStorage] | type[NumpyBlockStorage], call: str, which: str, why: str
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=3, separate_kv=False))
    store = store_class(pool, n_layers=1, n_kv_heads=1, head_dim=1)
    [shared, freed, source] = pool.allocate("kv", 6, owner=1)
    pool.share([shared], owner=2)
    pool.free([freed])
    block = shared if which == "shared" else freed
    make_tokens, _ = TOKENS_OF[store_class]
    expected = f"^{re.escape(f'cannot {call} {block!r}: {why}')}$"
    with pool_unchanged(pool), pytest.raises(ValueError, match=expected):
        if call == "write to":
            store.write(0, block, 0, make_tokens())  # type: ignore[arg-type]
        else:
            store.copy_block(None, source.block_id, block)


@pytest.mark.parametrize("store_class", [MLXBlockStorage, NumpyBlockStorage])
def test_a_store_refuses_tokens_that_are_no_array_naming_the_type_it_takes(
    store_class: type[MLXBlockStorage] | type[NumpyBlockStorage],
) -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=1, separate_kv=False))
    store = store_class(pool, n_layers=1, n_kv_heads=1, head_dim=1)
    [block] = pool.allocate("kv", 2, owner=1)
    _, expected = TOKENS_OF[store_class]
    refused = pytest.raises(TypeError, match=f"^{re.escape(expected)}$")
    with pool_unchanged(pool, owners=[1], handles=[block]), refused:
        store.write(0, block, 0, [[[1.0]]])  # type: ignore[arg-type]


def _blocks_then_a_fault(block: Block) -> Iterator[Block]:
    yield block
    raise TypeError("the caller's own fault, while its items are read")


class _NotIterable:
    __iter__ = None


def test_a_gather_names_blocks_only_when_they_cannot_be_iterated() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=2, n_blocks=2, separate_kv=False))
    store = MLXBlockStorage(pool, n_layers=1, n_kv_heads=1, head_dim=1)
    [block] = pool.allocate("kv", 2, owner=1)
    with pytest.raises(TypeError, match=r"^the caller's own fault, while its items are read$"):
        store.gather(0, _blocks_then_a_fault(block), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^blocks must be a sequence of Block handles, got <"):
        store.gather(0, _NotIterable(), 0)  # type: ignore[arg-type]
