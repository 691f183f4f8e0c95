"""mlx-lm as the real client: greedy decoding with pool-backed caches.

Small models of two architectures (llama, and qwen2 with its biased
projections) are built in code with seeded random weights, nothing
downloaded. Each test decodes with mlx-lm's own generators
(``generate_step``, ``speculative_generate_step``) once with mlx-lm's
``KVCache`` and once with :func:`make_pool_backed_cache`, and asserts the
same tokens, log-probabilities within float32 noise, and every block back
in the pool at the end. A block size of 4 makes a 64-step decode cross
many block boundaries. The caches use gathered attention, the exact drop-in
path (the fused kernel's decode is checked in test_paged_attention).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import Decode, greedy, prompt, tiny_model

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage

N_LAYERS = 2
N_KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 96
BLOCK_SIZE = 4
DECODE_STEPS = 64
LOGPROB_TOLERANCE = 1e-4


def _llama(seed: int) -> Module:
    return tiny_model("llama", seed, n_layers=N_LAYERS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)


def _qwen2(seed: int) -> Module:
    return tiny_model("qwen2", seed, n_layers=N_LAYERS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)


ARCHITECTURES = {"llama": _llama, "qwen2": _qwen2}


@dataclass
class Paging:
    """One pool and one storage, shared by every request of a test."""

    pool: BlockPoolAllocator
    storage: MLXBlockStorage

    def assert_all_blocks_back(self) -> None:
        assert self.pool.stats.blocks_in_use() == 0
        self.pool.check_invariants()


@pytest.fixture
def paging() -> Iterator[Paging]:
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=512))
    shared = Paging(pool, MLXBlockStorage(pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32))
    yield shared
    shared.assert_all_blocks_back()


def _prompt(seed: int, length: int = 11) -> mx.array:
    return prompt(seed, length, VOCAB)


def _greedy(model: Module, tokens: mx.array, cache: Sequence[object], steps: int) -> Decode:
    return greedy(model, tokens, cache, steps)


def _assert_same_decode(
    ours: tuple[list[int], list[mx.array]], reference: tuple[list[int], list[mx.array]]
) -> None:
    assert ours[0] == reference[0]
    assert mx.allclose(mx.stack(ours[1]), mx.stack(reference[1]), atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_greedy_decode_matches_mlx_lm_kv_cache(architecture: str, paging: Paging) -> None:
    model = ARCHITECTURES[architecture](seed=1)
    prompt = _prompt(seed=2)
    upstream = make_prompt_cache(model)
    reference = _greedy(model, prompt, upstream, DECODE_STEPS)
    with make_pool_backed_cache(model, paging.storage, attention="gather") as cache:
        ours = _greedy(model, prompt, cache, DECODE_STEPS)
        assert [layer.offset for layer in cache] == [layer.offset for layer in upstream]
        cache.book.check_invariants()
    assert len(ours[0]) == DECODE_STEPS
    assert len(set(reference[0])) > 8, "the reference decode is degenerate; the test would be weak"
    _assert_same_decode(ours, reference)


def test_four_concurrent_requests_share_one_pool(paging: Paging) -> None:
    model = _llama(seed=3)
    prompts = [_prompt(seed, length) for seed, length in ((10, 5), (11, 9), (12, 14), (13, 3))]
    steps = 32
    references = [_greedy(model, prompt, make_prompt_cache(model), steps) for prompt in prompts]
    caches = [
        make_pool_backed_cache(model, paging.storage, owner=100 + i, attention="gather")
        for i in range(4)
    ]
    generators = [
        generate_step(prompt, model, prompt_cache=cache, max_tokens=steps)
        for prompt, cache in zip(prompts, caches, strict=True)
    ]
    results: list[tuple[list[int], list[mx.array]]] = [([], []) for _ in prompts]
    try:
        for step in zip(*generators, strict=True):  # one decode step of each request in turn
            for (token, logprob), (tokens, logprobs) in zip(step, results, strict=True):
                tokens.append(int(token))
                logprobs.append(logprob)
            held = sum(2 * len(cache.book.key_blocks) for cache in caches)
            assert paging.pool.stats.blocks_in_use() == held
    finally:
        for cache in caches:
            cache.release()
    for ours, reference in zip(results, references, strict=True):
        _assert_same_decode(ours, reference)


def test_speculative_decoding_rewinds_by_trim(paging: Paging) -> None:
    model, draft = _llama(seed=4), _llama(seed=5)  # unrelated weights: most drafts rejected
    prompt = _prompt(seed=6)

    def speculate(cache: Sequence[object]) -> tuple[list[int], list[mx.array]]:
        tokens: list[int] = []
        logprobs: list[mx.array] = []
        for token, logprob, _ in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=3, prompt_cache=cache, max_tokens=40
        ):
            tokens.append(int(token))
            logprobs.append(logprob)
        return tokens, logprobs

    reference = speculate(make_prompt_cache(model) + make_prompt_cache(draft))
    with (
        make_pool_backed_cache(model, paging.storage, attention="gather") as ours,
        make_pool_backed_cache(draft, paging.storage, attention="gather") as drafts,
    ):
        result = speculate([*ours, *drafts])
        assert paging.pool.stats.n_frees > 0  # rewinds gave whole blocks back on the way
        for cache in (ours, drafts):
            cache.book.check_invariants()
            assert cache.book.slots_wasted() < BLOCK_SIZE
    _assert_same_decode(result, reference)


def test_abort_mid_generation_returns_every_block(paging: Paging) -> None:
    model = _qwen2(seed=7)

    class AbortError(Exception):
        pass

    with (
        pytest.raises(AbortError),
        make_pool_backed_cache(model, paging.storage, attention="gather") as cache,
    ):
        for step, _ in enumerate(
            generate_step(_prompt(seed=8), model, prompt_cache=cache, max_tokens=50)
        ):
            if step == 20:
                assert paging.pool.stats.blocks_in_use() > 0
                raise AbortError
    assert cache.book.released
    paging.assert_all_blocks_back()
