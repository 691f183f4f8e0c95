"""Benchmark of the block pool's hot paths; prints one JSON document.

Every figure is a median over repeated runs, and every scaling claim is a
ratio of two medians measured side by side in the same run, so that a
machine's speed cancels out. The targets (from the project's issue 2) are
printed next to the figures; nothing here passes or fails.

    python benchmarks/bench_block_pool.py            # full run, about a minute
    python benchmarks/bench_block_pool.py --quick    # fewer repeats, smoke only

Thread safety: single-threaded. Complexity: dominated by the 1M-block pools.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig

SMALL_POOL = 1_024
LARGE_POOL = 1_048_576
FREE_ALL_SIZES = (16_384, 32_768)
GROWTH_STEPS = 100_000
GROWTH_WINDOW = 10_000


def _median_ns_per_call(action: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` runs of the mean time of one of ``calls`` calls, in ns."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            action()
        samples.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(samples)


def bench_allocate_free_all_pair(calls: int, repeats: int) -> dict[str, float]:
    """One single-block allocate + free_all pair, on a small and a 1M-block pool."""
    figures = {}
    for n_blocks in (SMALL_POOL, LARGE_POOL):
        pool = BlockPoolAllocator(PoolConfig(n_blocks=n_blocks))

        def pair(pool: BlockPoolAllocator = pool) -> None:
            pool.allocate("k", 16, 1)
            pool.free_all(1)

        figures[f"pair_ns_pool_{n_blocks}"] = _median_ns_per_call(pair, calls, repeats)
    figures["large_over_small_ratio"] = (
        figures[f"pair_ns_pool_{LARGE_POOL}"] / figures[f"pair_ns_pool_{SMALL_POOL}"]
    )
    return figures


def _free_all_ms(n_blocks: int, repeats: int) -> float:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=2 * n_blocks))
    samples = []
    for _ in range(repeats):
        pool.allocate("k", 16 * n_blocks, 1)
        gc.collect()
        start = time.perf_counter_ns()
        pool.free_all(1)
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples)


def bench_free_all(repeats: int) -> dict[str, float]:
    """free_all of one owner holding 16K and 32K blocks: linear, not quadratic."""
    small, large = FREE_ALL_SIZES
    figures = {f"free_all_ms_{n}_blocks": _free_all_ms(n, repeats) for n in FREE_ALL_SIZES}
    figures["double_over_single_ratio"] = (
        figures[f"free_all_ms_{large}_blocks"] / figures[f"free_all_ms_{small}_blocks"]
    )
    return figures


def bench_mark_used_and_stats(calls: int, repeats: int) -> dict[str, float]:
    """mark_used on a live handle, and a stats snapshot read."""
    pool = BlockPoolAllocator(PoolConfig(n_blocks=SMALL_POOL))
    block = pool.allocate("k", 10, 1)[0]
    fills = iter(range(1 << 62))

    def mark() -> None:
        pool.mark_used(block, next(fills) & 15)

    return {
        "mark_used_ns": _median_ns_per_call(mark, calls, repeats),
        "stats_read_ns": _median_ns_per_call(lambda: pool.stats, calls, repeats),
    }


def bench_growth(steps: int, repeats: int) -> dict[str, float]:
    """Allocate one block at a time on an empty growing pool; compare first and last windows."""
    firsts, lasts, means = [], [], []
    for _ in range(repeats):
        pool = BlockPoolAllocator(PoolConfig(n_blocks=0, grow_on_exhaustion=True))
        window_ns = []
        total_start = time.perf_counter_ns()
        for window_start in range(0, steps, GROWTH_WINDOW):
            start = time.perf_counter_ns()
            for owner in range(window_start, window_start + GROWTH_WINDOW):
                pool.allocate("k", 16, owner)
            window_ns.append((time.perf_counter_ns() - start) / GROWTH_WINDOW)
        means.append((time.perf_counter_ns() - total_start) / steps)
        firsts.append(window_ns[0])
        lasts.append(window_ns[-1])
    first, last = statistics.median(firsts), statistics.median(lasts)
    return {
        "growth_ns_per_block": statistics.median(means),
        "growth_first_10k_ns": first,
        "growth_last_10k_ns": last,
        "last_over_first_ratio": last / first,
    }


def bench_memory() -> dict[str, float]:
    """Python heap bytes per managed block (tracemalloc), free and all checked out."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=LARGE_POOL))
    free_bytes = tracemalloc.get_traced_memory()[0] - before
    pool.allocate("k", 16 * (LARGE_POOL // 2), 1)
    pool.allocate("v", 16 * (LARGE_POOL // 2), 1)
    held_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {
        "bytes_per_free_block": free_bytes / LARGE_POOL,
        "bytes_per_checked_out_block": held_bytes / LARGE_POOL,
    }


TARGETS = {
    "pair_ns_pool_1024": "<= 2500",
    "large_over_small_ratio": "<= 1.15",
    "free_all_ms_16384_blocks": "<= 1.5",
    "double_over_single_ratio": "<= 2.2",
    "mark_used_ns": "<= 500",
    "stats_read_ns": "<= 1000",
    "growth_ns_per_block": "<= 3000",
    "last_over_first_ratio": "<= 1.2",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = parser.parse_args(argv)
    calls, repeats = (2_000, 3) if args.quick else (50_000, 9)
    steps = 2 * GROWTH_WINDOW if args.quick else GROWTH_STEPS
    report: dict[str, Any] = {"python": sys.version.split()[0], "quick": args.quick}
    sections: list[tuple[str, Callable[[], dict[str, float]]]] = [
        ("allocate_free_all_pair", lambda: bench_allocate_free_all_pair(calls, repeats)),
        ("free_all", lambda: bench_free_all(repeats)),
        ("mark_used_and_stats", lambda: bench_mark_used_and_stats(calls, repeats)),
        ("growth", lambda: bench_growth(steps, 3 if args.quick else 5)),
        ("memory", bench_memory),
    ]
    for name, run in sections:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        report[name] = {key: round(value, 3) for key, value in run().items()}
    report["targets"] = TARGETS
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
