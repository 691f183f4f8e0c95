"""Pool-backed caches of one store read back exactly what was written, whatever happened.

A request's positions are read by two slices of each slab while its key ids
run on and so do its value ids, and by a gather otherwise; forks share
blocks and copy a shared, partly filled block before writing into it; trims
give blocks back, which later requests take again; a request with a
reservation grows into blocks it checked out ahead. This machine drives
several requests of one small store (some with reservations) through prefills, decode steps, trims
of single layers, forks, releases and exhaustion, and keeps for each request
and layer the positions it should hold, written here as plain numpy arrays.
After every step every layer's ``state`` must be exactly those positions,
and every array a cache returned earlier must still hold what it held then
(a later write, by this request or another, never shows through a read).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

BLOCK_SIZE = 2
N_BLOCKS = 28
N_LAYERS = 2
HEADS = 2
HEAD_DIM = 3
MOST_REQUESTS = 3
READS_KEPT = 6

request_choice = st.integers(min_value=0, max_value=MOST_REQUESTS - 1)
layers = st.integers(min_value=0, max_value=N_LAYERS - 1)
# Positions a request checks out ahead (docs/RESERVATIONS.md); none, half of the time.
reservations = st.sampled_from([0, 0, 0, 3, 8, 20])


@dataclass
class Request:
    """A request's caches and, per layer, the keys and values it should hold."""

    caches: PoolBackedPromptCache
    keys: list[np.ndarray] = field(default_factory=lambda: [_none() for _ in range(N_LAYERS)])
    values: list[np.ndarray] = field(default_factory=lambda: [_none() for _ in range(N_LAYERS)])


def _none() -> np.ndarray:
    return np.zeros((HEADS, 0, HEAD_DIM), dtype=np.float32)


def _as_numpy(array: mx.array) -> np.ndarray:
    """``(1, heads, n, head_dim)`` as a numpy ``(heads, n, head_dim)`` copy."""
    copied: np.ndarray = np.array(array)
    return copied.reshape(copied.shape[1:])


class CachesReadWhatWasWritten(RuleBasedStateMachine):
    """Requests of one store, each with the positions it should hold, checked every step."""

    def __init__(self) -> None:
        super().__init__()
        self.store: MLXBlockStorage | None = None
        self.requests: list[Request] = []
        self.kept_reads: list[tuple[mx.array, np.ndarray]] = []
        self.next_value = 1.0  # every written number is new, so a wrong row shows

    @initialize(separate_kv=st.booleans(), lazy_writes=st.booleans())
    def make_store(self, separate_kv: bool, lazy_writes: bool) -> None:
        config = PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS, separate_kv=separate_kv)
        pool = BlockPoolAllocator(config)
        self.store = MLXBlockStorage(
            pool, N_LAYERS, HEADS, HEAD_DIM, mx.float32, lazy_writes=lazy_writes
        )

    def _store(self) -> MLXBlockStorage:
        assert self.store is not None
        return self.store

    def _fresh(self, n: int) -> np.ndarray:
        size = HEADS * n * HEAD_DIM
        numbers = np.arange(self.next_value, self.next_value + size, dtype=np.float32)
        self.next_value += size
        return numbers.reshape(HEADS, n, HEAD_DIM)

    def _keep(self, array: mx.array, expected: np.ndarray) -> None:
        self.kept_reads = [*self.kept_reads, (array, expected)][-READS_KEPT:]

    @precondition(lambda self: len(self.requests) < MOST_REQUESTS)
    @rule(reserve_tokens=reservations)
    def new_request(self, reserve_tokens: int) -> None:
        store = self._store()
        book = PooledKVCache(store.pool, n_layers=N_LAYERS, reserve_tokens=reserve_tokens)
        self.requests.append(Request(PoolBackedPromptCache(store, book)))

    @precondition(lambda self: self.requests)
    @rule(choice=request_choice, n=st.sampled_from([1, 1, 1, 2, 3, 5]))
    def write_every_layer(self, choice: int, n: int) -> None:
        """A prefill (n > 1) or a decode step (n == 1): each layer in turn, as a model."""
        request = self.requests[choice % len(self.requests)]
        for layer, cache in enumerate(request.caches):
            keys, values = self._fresh(n), -self._fresh(n)
            try:
                got_keys, got_values = cache.update_and_fetch(
                    mx.array(keys[None]), mx.array(values[None])
                )
            except BlockPoolExhaustedError:
                return  # all or nothing: this layer, and those after it, unchanged
            request.keys[layer] = np.concatenate([request.keys[layer], keys], axis=1)
            request.values[layer] = np.concatenate([request.values[layer], values], axis=1)
            assert np.array_equal(_as_numpy(got_keys), request.keys[layer])
            assert np.array_equal(_as_numpy(got_values), request.values[layer])
            self._keep(got_keys, request.keys[layer])
            self._keep(got_values, request.values[layer])

    @precondition(lambda self: self.requests)
    @rule(choice=request_choice, n=st.integers(min_value=0, max_value=5), layer=layers)
    def trim_one_layer(self, choice: int, n: int, layer: int) -> None:
        request = self.requests[choice % len(self.requests)]
        # Refused when a shared last block needs a private copy the pool cannot give.
        with contextlib.suppress(BlockPoolExhaustedError):
            dropped = request.caches[layer].trim(n)
            held = request.keys[layer].shape[1] - dropped
            request.keys[layer] = request.keys[layer][:, :held]
            request.values[layer] = request.values[layer][:, :held]

    @precondition(lambda self: 0 < len(self.requests) < MOST_REQUESTS)
    @rule(choice=request_choice)
    def fork(self, choice: int) -> None:
        parent = self.requests[choice % len(self.requests)]
        twin = Request(parent.caches.fork(), list(parent.keys), list(parent.values))
        self.requests.append(twin)

    @precondition(lambda self: self.requests)
    @rule(choice=request_choice)
    def release(self, choice: int) -> None:
        self.requests.pop(choice % len(self.requests)).caches.release()

    @invariant()
    def every_layer_holds_what_was_written(self) -> None:
        for request in self.requests:
            request.caches.book.check_invariants()
            for layer, cache in enumerate(request.caches):
                keys, values, offset = cache.state
                assert offset == request.keys[layer].shape[1]
                assert np.array_equal(_as_numpy(keys), request.keys[layer])
                assert np.array_equal(_as_numpy(values), request.values[layer])

    @invariant()
    def earlier_reads_are_unchanged(self) -> None:
        for array, expected in self.kept_reads:
            assert np.array_equal(_as_numpy(array), expected)

    def teardown(self) -> None:
        for request in self.requests:
            request.caches.release()
        if self.store is not None:
            self.store.pool.check_invariants()
            assert self.store.pool.stats.blocks_in_use() == 0


TestCachesReadWhatWasWritten = CachesReadWhatWasWritten.TestCase
