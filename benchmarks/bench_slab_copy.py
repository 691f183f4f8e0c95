"""Slab copies in a pipelined decode: what a write costs while a gather of its slab waits.

MLX updates an array in place only if nothing else holds its buffer when the
update runs. A decode write into an ``MLXBlockStorage`` slab therefore copies
the whole slab, every request's rows, whenever a gather of that slab has been
built or scheduled but has not run yet: the last step's, in a loop pipelined
as mlx-lm's ``generate_step`` is, or another request's of the same step.
Scheduling a step (``mx.async_eval``) does not prevent it; only the gather
having run does. (A request whose ids run on is read by slices, views of
the slab, which hold its buffer while pending and for as long as they are
kept: the same copy.) This benchmark shows it on one layer of a
``lazy_writes`` store (2 KV heads of 64, float32, blocks of 16) whose pool
hands out ids in descending order, so every read is a gather, for one and
for several requests of ``--context`` positions each, decoding ``--steps``
tokens in three ways:

- ``evaluated``: each request's step is evaluated before the next is built
  (no overlap of host and device; no copy);
- ``scheduled``: each request's step is scheduled as soon as it is built and
  the step waits for all of them at its end;
- ``pipelined``: as ``scheduled``, but the step waits for the previous step's
  results only, as ``generate_step`` does.

Per way: the median milliseconds of a step, and the peak memory above what was
in use when the timed steps began. The ``evaluated`` way's peak is the
gathers' own output; what another way holds beyond it is slab copies (the
slab's size is ``slab_mb``). Nothing passes or fails; issue 9's note reads
these figures.

    python benchmarks/bench_slab_copy.py                     # 32K positions, 1 and 4 requests
    python benchmarks/bench_slab_copy.py --context 4096 --requests 1 2 8

Progress goes to stderr, one JSON document to stdout. Thread safety:
single-threaded.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from _report import print_report, run_benchmark, set_buffer_cache_limit

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.block_table import schedule
from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx.testing.pool_orders import hand_out_descending

KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 64, 16
WAYS = ("evaluated", "scheduled", "pipelined")
WARM_UP_STEPS = 3


class Requests:
    """``n`` requests of ``context`` positions on one layer of one lazy_writes store."""

    def __init__(self, n: int, context: int, steps: int) -> None:
        blocks_each = 2 * (-(-(context + steps + WARM_UP_STEPS) // BLOCK_SIZE) + 1)
        pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n * blocks_each))
        hand_out_descending(pool)  # no request's ids run on: every read is a gather
        self.store = MLXBlockStorage(pool, 1, KV_HEADS, HEAD_DIM, mx.float32, lazy_writes=True)
        self.caches = [
            PoolBackedPromptCache(self.store, PooledKVCache(pool, n_layers=1)) for _ in range(n)
        ]
        prompt = mx.zeros((1, KV_HEADS, context, HEAD_DIM))
        for cache in self.caches:
            mx.eval(cache[0].update_and_fetch(prompt, prompt))
        self.token = mx.ones((1, KV_HEADS, 1, HEAD_DIM))
        mx.eval(self.token)

    def read_one(self, index: int) -> mx.array:
        """Request ``index``'s decode step: its write, its gather, and a sum of what it read."""
        keys, values = self.caches[index][0].update_and_fetch(self.token, self.token)
        return keys.sum() + values.sum()

    def release(self) -> None:
        for cache in self.caches:
            cache.release()


def decode_step(way: str, requests: Requests, previous: list[mx.array]) -> list[mx.array]:
    """One step of every request, decoded ``way``; what a pipelined step leaves pending."""
    results = []
    for index in range(len(requests.caches)):
        result = requests.read_one(index)
        if way == "evaluated":
            mx.eval(result)
        else:
            schedule(result)
        results.append(result)
    if way == "pipelined":
        mx.eval(previous)
        return results
    mx.eval(results)
    return []


def one_way(way: str, requests: Requests, steps: int) -> dict[str, float]:
    """Median milliseconds a step and peak megabytes above the start, decoding ``way``."""
    pending: list[mx.array] = []
    for _ in range(WARM_UP_STEPS):
        pending = decode_step(way, requests, pending)
    mx.eval(pending)
    mx.reset_peak_memory()
    in_use = mx.get_active_memory()
    seconds: list[float] = []
    for _ in range(steps):
        started = time.perf_counter()
        pending = decode_step(way, requests, pending)
        seconds.append(time.perf_counter() - started)
    mx.eval(pending)
    return {
        "ms_per_step": statistics.median(seconds) * 1e3,
        "peak_mb_above_start": (mx.get_peak_memory() - in_use) / 1e6,
    }


def one_count(n_requests: int, context: int, steps: int) -> dict[str, object]:
    """Every way for ``n_requests`` requests, each on a fresh store (all of one size)."""
    row: dict[str, object] = {"requests": n_requests}
    for way in WAYS:
        requests = Requests(n_requests, context, steps)
        row.setdefault("slab_mb", requests.store.resident_bytes() / 1e6)
        figures = one_way(way, requests, steps)
        requests.release()
        row[way] = figures
        print(
            f"{n_requests} request(s), {way}: {figures['ms_per_step']:.1f} ms a step, "
            f"peak +{figures['peak_mb_above_start']:.0f} MB",
            file=sys.stderr,
            flush=True,
        )
    return row


#: The options whose values size the pool: what a refusal for memory names.
SIZE_OPTIONS = "--context or --requests"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--context", type=int_at_least(1), default=32768, help="positions of each request"
    )
    parser.add_argument(
        "--requests", type=int_at_least(1), nargs="+", default=[1, 4], help="request counts"
    )
    parser.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps per way")
    options = parser.parse_args(argv)
    set_buffer_cache_limit()
    rows = [one_count(n, options.context, options.steps) for n in options.requests]
    figures = {
        "shape": {"kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
        "context": options.context,
        "steps": options.steps,
        "by_requests": rows,
    }
    print_report("slab_copy", figures)
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("bench_slab_copy.py", main, SIZE_OPTIONS))
