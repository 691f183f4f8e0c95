"""Forked pool-backed caches: a shared prompt, then independent decodes, copy-on-write.

Two forks of one prompt, fed different tokens, must compute exactly what two
mlx-lm ``KVCache`` runs fed the same tokens compute (bit for bit, on the
gathered attention path); the prompt's full blocks stay held once; releasing
both returns every block.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import pytest
from conftest import assert_only_exhaustion_recorded, leave_free, observe
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from tiny_models import prompt, tiny_model

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.model_kv_layout import make_pool_backed_storage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache

BLOCK_SIZE = 4
N_BLOCKS = 64


def _logits(model: Module, tokens: list[int] | mx.array, cache: Sequence[object]) -> mx.array:
    logits: mx.array = model(mx.array(tokens)[None], cache=cache)
    return logits


def _reference(model: Module, shared: mx.array, steps: list[int]) -> list[mx.array]:
    """A ``KVCache`` run: the prompt, then one token per step; the logits of each call."""
    cache = make_prompt_cache(model)
    outputs = [_logits(model, shared, cache)]
    outputs += [_logits(model, [token], cache) for token in steps]
    return outputs


@pytest.mark.parametrize("prompt_length", [11, 12], ids=["partial-last-block", "full-blocks"])
def test_two_forks_decode_exactly_as_two_kv_cache_runs(prompt_length: int) -> None:
    model = tiny_model("llama", 5)
    shared = prompt(6, length=prompt_length)
    steps_a, steps_b = [3, 17, 42, 5, 9, 60], [88, 1, 2, 77, 31, 4]
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    storage = make_pool_backed_storage(model, pool)
    first = make_pool_backed_cache(model, storage, attention="gather")
    ours_a = [_logits(model, shared, first)]
    second = first.fork()
    ours_b = list(ours_a)
    prompt_blocks = 2 * -(-prompt_length // BLOCK_SIZE)  # keys and values
    assert pool.stats.blocks_in_use() == prompt_blocks  # held once by both
    for token_a, token_b in zip(steps_a, steps_b, strict=True):  # interleaved on purpose
        ours_a.append(_logits(model, [token_a], first))
        ours_b.append(_logits(model, [token_b], second))
    for ours, steps in ((ours_a, steps_a), (ours_b, steps_b)):
        reference = _reference(model, shared, steps)
        assert all(mx.array_equal(a, b) for a, b in zip(ours, reference, strict=True))
    full_prompt_blocks = 2 * (prompt_length // BLOCK_SIZE)
    assert pool.stats.shared_blocks() == full_prompt_blocks
    first.book.check_invariants()
    second.book.check_invariants()
    first.release()
    second.release()
    assert pool.stats.blocks_in_use() == 0
    assert pool.n_free("k") + pool.n_free("v") == N_BLOCKS
    pool.check_invariants()


def test_a_fork_of_a_fork_and_a_trim_keep_every_reader_s_positions() -> None:
    model = tiny_model("qwen2", 7)
    shared = prompt(8, length=10)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    storage = make_pool_backed_storage(model, pool)
    with make_pool_backed_cache(model, storage, attention="gather") as root:
        _logits(model, shared, root)
        with root.fork() as child, child.fork() as grandchild:
            for layer in grandchild:  # back into a shared full block: it is copied first
                layer.trim(3)
            got = _logits(model, [11], grandchild)
            expected = _reference(model, shared[:7], [11])[-1]
            assert mx.array_equal(got, expected)
            ours = _logits(model, [12], child)
            assert mx.array_equal(ours, _reference(model, shared, [12])[-1])
        assert mx.array_equal(_logits(model, [13], root), _reference(model, shared, [13])[-1])
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


@pytest.mark.parametrize("cut", ["fork", "original"])
def test_a_trim_to_a_block_boundary_after_a_fork_keeps_the_full_blocks_shared(cut: str) -> None:
    """A rewind to the end of a full shared block changes no block's fill, so nothing
    is copied. Before, the trim marked that block (read-only while shared) with its
    unchanged fill: the pool refused, and the blocks past it had already left the
    book without going back to the pool."""
    model = tiny_model("llama", 5)
    shared = prompt(6, length=10)  # blocks of 4, 4 and 2 positions
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    storage = make_pool_backed_storage(model, pool)
    with make_pool_backed_cache(model, storage, attention="gather") as root:
        _logits(model, shared, root)
        with root.fork() as twin:
            trimmed, kept = (twin, root) if cut == "fork" else (root, twin)
            for layer in trimmed:
                layer.trim(2)  # to 8 positions: the end of the second block
            assert pool.stats.shared_blocks() == 4  # two full blocks of each stream
            assert pool.stats.blocks_in_use() == 6  # the third pair, now the kept one's alone
            assert pool.stats.n_copy_on_write == 0
            trimmed.book.check_invariants()
            kept.book.check_invariants()
            got = _logits(model, [11], trimmed)
            assert mx.array_equal(got, _reference(model, shared[:8], [11])[-1])
            assert mx.array_equal(_logits(model, [12], kept), _reference(model, shared, [12])[-1])
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


def _forked(
    *, n_layers: int, n_tokens: int
) -> tuple[BlockPoolAllocator, PoolBackedPromptCache, PoolBackedPromptCache, mx.array]:
    """A pool, a request of ``n_layers`` holding ``n_tokens`` random positions (two heads
    of 8), its fork, and the positions."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    store = MLXBlockStorage(pool, n_layers, 2, 8, mx.float32)
    parent = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=n_layers))
    tokens = mx.random.normal((1, 2, n_tokens, 8), key=mx.random.key(n_tokens))
    for layer in parent:
        layer.update_and_fetch(tokens, tokens)
    return pool, parent, parent.fork(), tokens


def test_mlx_lm_s_layer_by_layer_trim_of_a_fork_is_refused_whole_or_done_whole() -> None:
    # trim_prompt_cache trims one layer, then the next. The fork's new last block is
    # shared and its fill changes, so it moves to a private copy: at the first layer's
    # trim. Made at the last layer's (once), a refusal left the layers at [5, 6], and a
    # retry at [4, 5]: every later position off by one.
    pool, parent, fork, tokens = _forked(n_layers=2, n_tokens=6)
    taken = leave_free(pool, 0)
    handles = (*fork.book.key_blocks, *fork.book.value_blocks)
    before = observe(pool, [fork.book.owner, parent.book.owner], handles)
    with pytest.raises(BlockPoolExhaustedError):
        trim_prompt_cache(fork, 1)
    assert_only_exhaustion_recorded(
        before, observe(pool, [fork.book.owner, parent.book.owner], handles)
    )
    assert [layer.offset for layer in fork] == [6, 6]
    pool.free(taken)
    leave_free(pool, 1)  # the one copy per stream the whole trim needs
    trimmed: object = trim_prompt_cache(fork, 1)  # typed list[Any] by mypy's inference
    assert trimmed == 1
    assert [layer.offset for layer in fork] == [5, 5]
    for layer in fork:
        keys, values, _ = layer.state
        assert mx.array_equal(keys, tokens[:, :, :5]) and mx.array_equal(values, tokens[:, :, :5])
    fork.book.check_invariants()
    pool.check_invariants()


def test_after_the_first_layer_s_copy_the_other_layers_trims_look_at_nothing_more() -> None:
    # The copy is asked for only while the block is shared: once the first layer's trim
    # has made it private, the later layers' trims make no table check, drain or supply
    # look (once each did all three: 2.3 ms per rewind of 32 layers at 4K, for 0.2).
    pool, parent, fork, _ = _forked(n_layers=4, n_tokens=10)  # parent held: blocks shared
    book = fork.book
    checks: list[int] = []
    check = book.before_change
    assert check is not None

    def counted() -> None:
        checks.append(1)
        check()

    book.before_change = counted
    made = []
    for layer in list(fork)[:3]:
        layer.trim(3)
        made.append(len(checks))
    assert made == [1, 1, 1]
    assert pool.stats.n_copy_on_write == 2  # the key block and the value block, once
    fork.book.check_invariants()
    parent.release()


@pytest.mark.parametrize("length", [10, 12], ids=["partial-last-block", "full-blocks"])
def test_setting_one_layer_s_state_on_a_fork_leaves_the_other_request_s_layer_alone(
    length: int,
) -> None:
    """The state setter trims its layer alone and writes it again, while the other
    layers still hold those positions, so no growth or trim of the table moves the
    shared blocks first. Before, the write went into them, and the original request
    read the fork's keys and values from then on."""
    model = tiny_model("llama", 5)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=N_BLOCKS))
    storage = make_pool_backed_storage(model, pool)
    with make_pool_backed_cache(model, storage, attention="gather") as root:
        _logits(model, prompt(6, length=length), root)
        keys, values, _ = root[0].state
        before = [mx.array(array) for array in (keys, values)]
        with root.fork() as twin:
            twin[0].state = (keys + 1, values - 1)
            twin_keys, twin_values, offset = twin[0].state
            assert offset == length
            assert mx.array_equal(twin_keys, keys + 1)
            assert mx.array_equal(twin_values, values - 1)
            root_keys, root_values, _ = root[0].state
            assert mx.array_equal(root_keys, before[0])
            assert mx.array_equal(root_values, before[1])
            assert pool.stats.n_copy_on_write == 2 * -(-length // BLOCK_SIZE)
            twin.book.check_invariants()
            root.book.check_invariants()
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


def test_a_book_alone_forks_without_a_store() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    with PooledKVCache(pool, owner=1) as book:
        book.append(6)
        with book.fork(owner=2) as twin:
            twin.append(1)  # the shared last block (2 of 4) moves: nothing to copy
            book.append(1)
            assert pool.stats.n_copy_on_write == 2  # keys and values of the twin
            assert pool.stats.shared_blocks() == 2  # the first, full block of each stream
            book.check_invariants()
            twin.check_invariants()
    assert pool.stats.blocks_in_use() == 0


def test_a_fork_keeps_the_book_s_format_for_the_blocks_it_takes() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    with PooledKVCache(pool, owner=1, format="int4") as book:
        book.append(6)
        with book.fork(owner=2) as twin:
            assert twin.format == "int4"
            twin.append(3)  # a copy of the shared last block, and a new block
            assert {block.format for block in pool.blocks_for(2)} == {"int4"}
    assert pool.stats.blocks_in_use() == 0


def test_a_fork_trimmed_to_nothing_grows_again_on_its_own_blocks() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    with PooledKVCache(pool, owner=1) as book, book.fork(owner=2) as twin:
        book.append(6)  # nothing shared yet: the fork was empty
        twin.append(3)
        fork = book.fork(owner=3)
        fork.trim(6)
        fork.append(2)
        fork.check_invariants()
        book.check_invariants()
        fork.release()
    assert pool.stats.blocks_in_use() == 0


def test_a_fork_takes_the_owner_asked_for_and_keeps_the_attention_mode() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    store = MLXBlockStorage(pool, 2, 1, 4, mx.float32)
    root = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=2), attention="fused")
    with root, root.fork(owner=42) as twin:
        assert twin.book.owner == 42
        assert [cache.attention for cache in twin] == ["fused", "fused"]


class _StoreThatCannotCopy(MLXBlockStorage):
    copy_block = None  # type: ignore[assignment]  # storage.CopiesBlocks: not implemented


def test_a_list_over_a_store_that_cannot_copy_refuses_to_fork_naming_it() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=16))
    store = _StoreThatCannotCopy(pool, 1, 1, 4, mx.float32)
    with PoolBackedPromptCache(store, PooledKVCache(pool)) as root:
        with pytest.raises(TypeError, match=r"^fork needs a store with copy_block, got _StoreThat"):
            root.fork()
        assert pool.stats.blocks_in_use() == 0
