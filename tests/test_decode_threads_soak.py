"""Threads decoding through one shared store for minutes: the nightly soak.

MLX 0.32 can crash the process when two threads examine one shared array at
once (:func:`veloxquant_mlx.memory.mlx_storage.publish` says how and how the
store avoids it). Before the store published its slabs, four threads
decoding on one store crashed about once in two minutes here; the 4-thread
test of ``test_dropped_caches.py`` runs for a few seconds in CI, too short to
catch such a race coming back. This soak runs for
``VELOXQUANT_SOAK_SECONDS`` (``stress/nightly.sh`` sets it, 600 by default):
four threads decode greedily through one pool-backed store, every request's
tokens checked against mlx-lm's ``KVCache`` decoding the same prompt. As in
the CI test, requests stop mid-generation (the generator dropped with a step
still in flight), half the caches are released and half dropped, and the
garbage collector runs often, on whichever thread allocates. A crash ends
the pytest process, which the nightly script reports as a failed run (status
139 for a segfault).
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import threading
import time

import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import greedy, prompt, tiny_model

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.deferred_release import reclaim_dropped_caches
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.model_kv_layout import make_pool_backed_storage

SOAK_VARIABLE = "VELOXQUANT_SOAK_SECONDS"
SOAK_SECONDS = float(os.environ.get(SOAK_VARIABLE, "0"))
N_THREADS = 4
N_PROMPTS = 8
STEPS = 12
PROGRESS_EVERY_S = 60.0

pytestmark = pytest.mark.skipif(
    SOAK_SECONDS <= 0,
    reason=f"the decode-thread soak runs nightly: stress/nightly.sh sets {SOAK_VARIABLE}; "
    "set it (seconds) to run it here",
)


def test_threads_decoding_through_one_store_for_minutes_agree_with_kv_cache_and_leak_nothing() -> (
    None
):
    model = tiny_model("llama", seed=5, n_layers=2, n_kv_heads=1, head_dim=8, vocab=32)
    prompts = [prompt(seed, length=3 + seed % 6, vocab=32) for seed in range(N_PROMPTS)]
    expected = [greedy(model, tokens, make_prompt_cache(model), STEPS)[0] for tokens in prompts]
    pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=2048))
    storage = make_pool_backed_storage(model, pool)
    requests = [0] * N_THREADS
    problems: list[str] = []
    deadline = time.monotonic() + SOAK_SECONDS

    def serve(thread: int) -> None:
        try:
            while time.monotonic() < deadline and not problems:
                index = (thread + requests[thread]) % N_PROMPTS
                cache = make_pool_backed_cache(model, storage)
                steps = generate_step(prompts[index], model, prompt_cache=cache, max_tokens=STEPS)
                n_taken = 1 + requests[thread] % STEPS  # stop mid-generation
                decoded = [int(token) for token, _ in itertools.islice(steps, n_taken)]
                if decoded != expected[index][:n_taken]:
                    problems.append(
                        f"thread {thread}, prompt {index}: {decoded} != {expected[index]}"
                    )
                del steps  # dropped with a step still in flight
                if requests[thread] % 2:
                    cache.release()  # the other half is dropped: deferred release
                requests[thread] += 1
        except BaseException as error:  # reported by the main thread
            problems.append(f"thread {thread}: {error!r}")

    threads = [
        threading.Thread(target=serve, args=(index,), daemon=True) for index in range(N_THREADS)
    ]
    thresholds = gc.get_threshold()
    gc.set_threshold(50)  # collections (so finalisers and frees) inside any call, any thread
    try:
        for thread in threads:
            thread.start()
        _report_progress(threads, requests, deadline)
    finally:
        gc.set_threshold(*thresholds)
    assert problems == []
    gc.collect()
    reclaim_dropped_caches(pool)
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()
    assert min(requests) > 0


def _report_progress(threads: list[threading.Thread], requests: list[int], deadline: float) -> None:
    """Join ``threads``, printing the requests served once a minute (to stderr)."""
    started = time.monotonic()
    for thread in threads:
        while thread.is_alive():
            thread.join(PROGRESS_EVERY_S)
            if thread.is_alive():
                elapsed = time.monotonic() - started
                print(f"soak: {elapsed:.0f} s, {sum(requests):,} requests", file=sys.stderr)
            assert time.monotonic() < deadline + 120.0, "a decode thread hung"
