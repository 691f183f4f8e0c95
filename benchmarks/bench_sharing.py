"""Benchmark of shared blocks (issue 12); prints one JSON document.

Every figure is a median of repeated samples, and every ratio compares two
figures measured side by side in the same run (nothing here passes or fails):

- **Cost per block** of ``share`` + ``free_all``, of ``fork`` + ``free_all``
  (K and V), beside ``allocate`` + ``free_all`` of as many blocks, for 1 and
  16 blocks per call.
- **make_writable** of a block shared twice (a new block, the handle's
  share moved to it): the cycle ``share``, ``make_writable``, ``free``
  against ``share``, ``free``; the difference is the copy-on-write's own cost
  in the pool (the store's ``copy_block`` is a separate figure).
- **Memory of 8 forks of a 1,024-token prompt** on the model of
  ``bench_kv_cache.py``: one pool-backed request prefilled, 7 forks, each of
  the 8 then decodes one token; blocks in use and bytes they hold, against 8
  mlx-lm ``KVCache`` copies of the same prompt (``nbytes``). Target: the
  prompt's blocks held once.

The allocate+free pair against the same benchmark before sharing existed:
``python benchmarks/bench_block_pool.py --against REV --callgrind``.

    python benchmarks/bench_sharing.py            # about a minute
    python benchmarks/bench_sharing.py --quick    # smoke only

Thread safety: single-threaded. Complexity: dominated by the prefill.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import bench_kv_cache as kv
import mlx.core as mx

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig, block_pool
from veloxquant_mlx.memory.model_kv_layout import make_pool_backed_storage
from veloxquant_mlx.memory.prompt_cache import make_pool_backed_cache

BLOCKS_PER_CALL = (1, 16)
PROMPT_TOKENS = 1_024
N_FORKS = 8  # requests sharing the prompt, the first included


def median_ns(run: Callable[[int], None], n: int, repeats: int) -> float:
    """Median over ``repeats`` samples of ``run(n)``'s time per iteration, in ns."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        run(n)
        samples.append((time.perf_counter_ns() - started) / n)
    return statistics.median(samples)


def holding(k: int) -> tuple[BlockPoolAllocator, list[block_pool.Block]]:
    """A pool whose owner 0 holds ``k`` K blocks and ``k`` V blocks; the K handles."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4 * k + 8), history_len=0)
    blocks = pool.allocate("k", 16 * k, owner=0)
    pool.allocate("v", 16 * k, owner=0)
    return pool, blocks


def per_block_costs(repeats: int, n: int) -> dict[str, dict[str, float]]:
    return {f"{k}_blocks": costs_for(k, repeats, n) for k in BLOCKS_PER_CALL}


def costs_for(k: int, repeats: int, n: int) -> dict[str, float]:
    """Per block: share, fork and allocate of ``k`` blocks per call, each with its free_all."""
    pool, blocks = holding(k)

    def share(count: int) -> None:
        for _ in range(count):
            pool.share(blocks, 1)
            pool.free_all(1)

    def fork(count: int) -> None:
        for _ in range(count):
            pool.fork(0, 1)
            pool.free_all(1)

    def allocate(count: int) -> None:
        for _ in range(count):
            pool.allocate("k", 16 * k, owner=1)
            pool.free_all(1)

    share_ns, fork_ns, allocate_ns = (median_ns(f, n, repeats) for f in (share, fork, allocate))
    return {
        "share_free_all_ns_per_block": round(share_ns / k, 1),
        "fork_free_all_ns_per_block": round(fork_ns / (2 * k), 1),
        "allocate_free_all_ns_per_block": round(allocate_ns / k, 1),
        "share_over_allocate": round(share_ns / allocate_ns, 3),
    }


def make_writable_cost(repeats: int, n: int) -> dict[str, float]:
    pool, blocks = holding(1)

    def with_copy(count: int) -> None:
        for _ in range(count):
            [shared] = pool.share(blocks, 1)
            pool.free([pool.make_writable(shared)])

    def without_copy(count: int) -> None:
        for _ in range(count):
            pool.free(pool.share(blocks, 1))

    cycle_ns, baseline_ns = median_ns(with_copy, n, repeats), median_ns(without_copy, n, repeats)
    return {
        "share_make_writable_free_ns": round(cycle_ns, 1),
        "share_free_ns": round(baseline_ns, 1),
        "make_writable_ns": round(cycle_ns - baseline_ns, 1),
    }


def fork_memory(prompt_tokens: int) -> dict[str, object]:
    model = kv.make_model()
    pool = BlockPoolAllocator(
        PoolConfig(block_size=kv.BLOCK_SIZE, n_blocks=0, grow_on_exhaustion=True)
    )
    storage = make_pool_backed_storage(model, pool)
    first = make_pool_backed_cache(model, storage)
    kv.fill(first, prompt_tokens)
    requests = [first] + [first.fork() for _ in range(N_FORKS - 1)]
    for request in requests:
        kv.feed(request, 1, 0)  # one decoded token each: a copy only where a block is partial
    prompt_blocks = -(-prompt_tokens // kv.BLOCK_SIZE)
    in_use = pool.stats.blocks_in_use()
    bytes_per_block = storage.resident_bytes() // storage.capacity()
    copies = [kv.kv_cache_list() for _ in range(N_FORKS)]
    for cache in copies:
        kv.fill(cache, prompt_tokens)
        kv.feed(cache, 1, 0)
    ours = in_use * bytes_per_block
    theirs = kv.kv_cache_bytes(copies)
    for request in requests:
        request.release()
    return {
        "requests": N_FORKS,
        "prompt_tokens": prompt_tokens,
        "prompt_blocks": 2 * prompt_blocks,  # K and V; one id spans every layer
        "blocks_in_use": in_use,
        "blocks_if_unshared": N_FORKS * 2 * (prompt_blocks + 1),
        "bytes_in_use": ours,
        "store_resident_bytes": storage.resident_bytes(),
        "kv_cache_copies_bytes": theirs,
        "ours_over_kv_cache": round(ours / theirs, 3),
        "blocks_back_after_release": pool.stats.blocks_in_use() == 0,
        "target": "the prompt's blocks held once",
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller prompt")
    args = parser.parse_args(argv)
    repeats, n = (3, 200) if args.quick else (9, 2_000)
    print("per-block costs ...", file=sys.stderr, flush=True)
    result: dict[str, object] = {
        "build": "compiled" if block_pool.COMPILED else "interpreted",
        "per_block": per_block_costs(repeats, n),
        "make_writable": make_writable_cost(repeats, n),
    }
    print("memory of forks ...", file=sys.stderr, flush=True)
    result["fork_memory"] = fork_memory(128 if args.quick else PROMPT_TOKENS)
    mx.clear_cache()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
