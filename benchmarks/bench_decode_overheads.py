"""Where a host-bound decode step's time goes: MLX nodes, a gathered read, our Python.

On a GPU, a small model's decode step is bound by its host: the Python that
builds the step's graph, then ``mx.async_eval``, which walks that graph on
the calling thread and launches its kernels, so every MLX node of a step
costs host time twice. This benchmark decodes the model of
``bench_kv_cache.py`` (one request, pipelined as ``generate_step`` does) with
caches that differ from mlx-lm's ``KVCache`` in one thing each, in one
process, the order of the variants rotating every round:

- ``kv_cache``: mlx-lm's ``KVCache``, the reference;
- ``kv_cache_plus_nodes``: ``KVCache`` whose fetch adds ``--extra-nodes``
  no-op nodes per layer (``mx.stop_gradient`` of its keys and values): what
  one more node costs, with no kernel behind it;
- ``kv_cache_take``: ``KVCache`` that reads its positions with ``mx.take``
  of their rows instead of slices: what a gathered read costs, with no
  paging. Its buffers are separate, so that is two takes a layer, of an
  index shared by the step's layers (ours is one take of keys and values
  together); it still builds the slices it replaces, which costs Python
  time only (they are never scheduled);
- ``pool_backed``: ours, over a ``lazy_writes`` store, gathered attention
  (mlx-lm's attention over what the cache returns), alone in a fixed pool:
  its key ids run on consecutively and so do its value ids, so the store
  reads them as two slices of the slab, as ``KVCache`` reads its buffers;
- ``pool_backed_gathered``: the same over a pool whose stacks hand out ids
  in descending order, so the ids never run on and every read is the
  store's gather (``mx.take`` of the blocks, or the gather kernel from
  ``block_gather.KERNEL_MIN_TOKENS`` positions on a CUDA GPU): what any
  request costs whose blocks are not one run, such as requests that grow
  side by side in one pool.

Per context: tokens/s, the host microseconds per token spent building the
graph and inside ``mx.async_eval`` (as ``bench_kv_cache.decode_round``
measures them: host work on a GPU whose device keeps up; on MLX's CPU
back-end the second also holds computing), and each variant's tokens/s over
``kv_cache``'s (a median of same-round ratios), and how each pool-backed
variant was read (``pool_backed_read_by``: ``slices`` or ``gather``, from its
block ids at the end). Each variant first decodes
one untimed round, so no round pays a first use, and every round starts
from an empty MLX buffer cache (``mx.clear_cache``): otherwise the buffers
that one variant's round leaves cached decide what the next one's
allocations cost. On this CPU at 32K positions, with rounds of 32 steps,
the take variant's row buffers left the cache full, every step of the
gathered variant after it then allocated its outputs afresh, and it measured
0.53x; from an empty cache, 0.87x. Nothing passes or fails; issue 9's note reads these
figures.

    python benchmarks/bench_decode_overheads.py                   # 256, 4K, 32K
    python benchmarks/bench_decode_overheads.py --contexts 256 1024 4096 16384 32768

Progress goes to stderr, one JSON document to stdout; bad input: one line,
exit status 2. Thread safety: single-threaded. Complexity: rounds x variants
x (steps decode steps of 8 layers) per context, and one more round.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import cast

import mlx.core as mx
from _report import print_report, run_benchmark, set_buffer_cache_limit
from bench_kv_cache import (
    BLOCK_SIZE,
    HEAD_DIM,
    N_KV_HEADS,
    N_LAYERS,
    Caches,
    RoundFigures,
    decode_round,
    fill,
    make_model,
    progress,
)
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.block_table import run_start
from veloxquant_mlx.memory.kv_cache import make_pool_backed_cache
from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
from veloxquant_mlx.memory.prompt_cache import PoolBackedPromptCache
from veloxquant_mlx.testing.pool_orders import hand_out_descending

#: The variants, in the order of the report.
VARIANTS = (
    "kv_cache",
    "kv_cache_plus_nodes",
    "kv_cache_take",
    "pool_backed",
    "pool_backed_gathered",
)


class KVCachePlusNodes(KVCache):
    """``KVCache`` whose fetch passes keys and values through ``extra`` no-op nodes."""

    def __init__(self, extra: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._extra_per_array = extra // 2

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        keys, values = super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        for _ in range(self._extra_per_array):
            keys, values = mx.stop_gradient(keys), mx.stop_gradient(values)
        return keys, values


class KVCacheTake(KVCache):
    """``KVCache`` that reads its positions with one ``mx.take`` of rows per buffer."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        rows = rows_up_to(self.offset)
        buffers = cast(tuple[mx.array, mx.array], (self.keys, self.values))  # set by the update
        return mx.take(buffers[0], rows, axis=2), mx.take(buffers[1], rows, axis=2)


@functools.lru_cache(maxsize=2)
def rows_up_to(n_rows: int) -> mx.array:
    """``0 .. n_rows - 1`` as int32: one array per step, shared by its layers, as the
    store shares its block entries."""
    return mx.arange(n_rows, dtype=mx.int32)


def make_variants(model: Module, positions: int, extra_nodes: int) -> dict[str, Caches]:
    """One request's caches per variant, each pool-backed one on its own pool and store."""

    def store(
        order: Callable[[BlockPoolAllocator], BlockPoolAllocator] = lambda pool: pool,
    ) -> MLXBlockStorage:
        n_blocks = 2 * (positions // BLOCK_SIZE + 2)
        pool = order(BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks)))
        return MLXBlockStorage(pool, N_LAYERS, N_KV_HEADS, HEAD_DIM, mx.float32, lazy_writes=True)

    makers: dict[str, Callable[[], Caches]] = {
        "kv_cache": lambda: [KVCache() for _ in range(N_LAYERS)],  # type: ignore[no-untyped-call]
        "kv_cache_plus_nodes": lambda: [KVCachePlusNodes(extra_nodes) for _ in range(N_LAYERS)],
        "kv_cache_take": lambda: [KVCacheTake() for _ in range(N_LAYERS)],  # type: ignore[no-untyped-call]
        "pool_backed": lambda: make_pool_backed_cache(model, store(), attention="gather"),
        "pool_backed_gathered": lambda: make_pool_backed_cache(
            model, store(hand_out_descending), attention="gather"
        ),
    }
    return {name: makers[name]() for name in VARIANTS}


def bench_context(
    model: Module, context: int, rounds: int, steps: int, extra_nodes: int
) -> dict[str, object]:
    """Every variant's figures at ``context``, rounds rotating the variants."""
    requests = make_variants(model, context + (rounds + 1) * steps + 1, extra_nodes)
    for caches in requests.values():
        fill(caches, context)
        decode_round(model, [caches], steps)  # untimed: first uses (kernels, buffers)
    samples: dict[str, list[RoundFigures]] = {name: [] for name in VARIANTS}
    for round_index in range(rounds):
        shift = round_index % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            mx.clear_cache()  # no round allocates from buffers another variant left
            samples[name].append(decode_round(model, [requests[name]], steps))
    runs = {name: ids_run_on(caches) for name, caches in requests.items()}
    for caches in requests.values():
        if isinstance(caches, PoolBackedPromptCache):
            caches.release()
    read_by = {name: "slices" if run else "gather" for name, run in runs.items() if run is not None}
    return {"context": context, "pool_backed_read_by": read_by, **figures_of(samples)}


def ids_run_on(caches: Caches) -> bool | None:
    """Whether a pool-backed request's key ids run on consecutively and so do its value
    ids (then the store read it by slicing); ``None`` for a ``KVCache``."""
    if not isinstance(caches, PoolBackedPromptCache):
        return None
    book = caches.book
    return run_start(book.key_blocks) is not None and run_start(book.value_blocks) is not None


def figures_of(samples: dict[str, list[RoundFigures]]) -> dict[str, object]:
    """Each variant's median of every figure of :class:`RoundFigures`, and its tokens/s
    over KVCache's (the median of same-round ratios)."""
    figures: dict[str, object] = {
        field: {
            name: round(statistics.median(getattr(sample, field) for sample in runs), 1)
            for name, runs in samples.items()
        }
        for field in RoundFigures._fields
    }
    reference = samples["kv_cache"]
    figures["over_kv_cache"] = {
        name: round(
            statistics.median(
                ours.tokens_per_s / theirs.tokens_per_s
                for ours, theirs in zip(runs, reference, strict=True)
            ),
            3,
        )
        for name, runs in samples.items()
        if name != "kv_cache"
    }
    return figures


def bench_and_report(
    model: Module, context: int, arguments: argparse.Namespace
) -> dict[str, object]:
    """:func:`bench_context` with the run's options, and one line of progress."""
    started = time.perf_counter()
    row = bench_context(model, context, arguments.rounds, arguments.steps, arguments.extra_nodes)
    progress(
        f"context {context}: over kv_cache {json.dumps(row['over_kv_cache'])} "
        f"({time.perf_counter() - started:.0f} s)"
    )
    return row


#: The options whose values size the pool: what a refusal for memory names.
SIZE_OPTIONS = "--contexts"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts",
        type=int_at_least(1),
        nargs="+",
        default=[256, 4096, 32768],
        help="context lengths to decode at (default: 256 4096 32768)",
    )
    parser.add_argument(
        "--rounds", type=int_at_least(1), default=10, help="rounds per context (default: 10)"
    )
    parser.add_argument(
        "--steps", type=int_at_least(1), default=64, help="tokens per round (default: 64)"
    )
    parser.add_argument(
        "--extra-nodes",
        type=int_at_least(2),
        default=4,
        help="no-op nodes per layer of kv_cache_plus_nodes, an even count (default: 4)",
    )
    arguments = parser.parse_args(argv)
    if arguments.extra_nodes % 2:
        parser.error(f"--extra-nodes must be even, got {arguments.extra_nodes} (keys and values)")
    started = time.perf_counter()
    model = make_model()
    default_limit = set_buffer_cache_limit()
    try:
        rows = [bench_and_report(model, context, arguments) for context in arguments.contexts]
    finally:
        mx.set_cache_limit(default_limit)
    figures = {
        "rounds": arguments.rounds,
        "steps_per_round": arguments.steps,
        "extra_nodes_per_layer": arguments.extra_nodes,
        "by_context": rows,
        "seconds": time.perf_counter() - started,
    }
    print_report("decode_overheads", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_benchmark("bench_decode_overheads.py", main, SIZE_OPTIONS))
