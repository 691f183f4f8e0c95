"""A decode read without the gather's copy: attention over runs of consecutive blocks.

The store's decode read (``block_gather.gather_by_take``) copies every held
position of a layer out of the slab before attention reads it, at every step;
mlx-lm's ``KVCache`` attends over a slice of its own buffer, with no copy.
A fresh pool hands a prefill consecutive block ids per stream, so most of a
long request's blocks form a few runs that a slice of the slab reads as they
are. This benchmark measures, on one layer (2 KV heads of 64, 8 query heads,
float32, blocks of 16), one decode step's read and attention of a request
laid out by the real pool: a prefill of ``context - decoded`` positions,
then ``decoded`` one at a time beside ``--neighbours`` other requests
decoding on the same fixed pool, whose new blocks interleave with its own
(alone on a fresh fixed pool, a request's blocks are all consecutive):

- ``gather``: the store's read (``gather_by_take``) and MLX's fused SDPA;
- ``buffer_slice``: what ``KVCache`` does, SDPA over a slice of a contiguous
  buffer (the lower bound of a read without a copy);
- ``runs``: a prototype of the idea, not the store's code: runs of at least
  ``--min-run`` consecutive blocks (keys and values both consecutive) are read
  as slices, the other blocks with one ``mx.take``; attention is two matmuls a
  piece and one softmax over the joined scores (no mask: a decode step).

Per context: the median milliseconds of each, the runs found, and the largest
difference of ``runs`` from ``gather`` (the run stops with exit 1 if it is
above 1e-4: a figure of a wrong result would mean nothing). Nothing else
passes or fails; issue 9's note reads these figures.

    python benchmarks/bench_read_by_runs.py                        # 4K and 32K
    python benchmarks/bench_read_by_runs.py --contexts 8192 --decoded 1024

Progress goes to stderr, one JSON document to stdout. Thread safety:
single-threaded.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.memory.block_gather import gather_by_take
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

KV_HEADS, QUERY_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 64, 16
TOLERANCE = 1e-4
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class Layout:
    """One request's blocks in a slab: the slab, its entries and the runs found."""

    slab: mx.array  # (1, KV_HEADS, capacity * BLOCK_SIZE, HEAD_DIM)
    capacity: int
    key_ids: list[int]
    value_ids: list[int]
    n_tokens: int


def lay_out(context: int, decoded: int, neighbours: int) -> Layout:
    """The first of ``1 + neighbours`` requests of ``context`` positions, decoded side by
    side on one fixed pool, as the pool lays it out, over a random slab."""
    n_blocks = (1 + neighbours) * 2 * (-(-context // BLOCK_SIZE) + 1)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))
    books = [PooledKVCache(pool, n_layers=1) for _ in range(1 + neighbours)]
    for book in books:
        book.append(context - decoded)
    for _ in range(decoded):  # a step: one position each, so new blocks interleave
        for book in books:
            book.append(1)
    capacity = pool.id_bound()
    slab = mx.random.normal((1, KV_HEADS, capacity * BLOCK_SIZE, HEAD_DIM), key=mx.random.key(0))
    mx.eval(slab)
    keys = [block.block_id for block in books[0].key_blocks]
    values = [block.block_id for block in books[0].value_blocks]
    for book in books:
        book.release()
    return Layout(slab, capacity, keys, values, context)


def runs_of(layout: Layout, min_run: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs ``(first block index, length)`` of at least ``min_run`` blocks whose key and
    value ids both go up by one, and the indices of the blocks in no such run."""
    runs: list[tuple[int, int]] = []
    rest: list[int] = []
    start = 0
    keys, values = layout.key_ids, layout.value_ids
    for index in range(1, len(keys) + 1):
        ends = (
            index == len(keys)
            or keys[index] != keys[index - 1] + 1
            or values[index] != values[index - 1] + 1
        )
        if ends:
            if index - start >= min_run:
                runs.append((start, index - start))
            else:
                rest.extend(range(start, index))
            start = index
    return runs, rest


def read_by_gather(layout: Layout, queries: mx.array) -> mx.array:
    """The store's read (``gather_by_take``, as the store calls it), then SDPA."""
    entries = mx.array([layout.key_ids, layout.value_ids], dtype=mx.int32)
    heads = mx.arange(KV_HEADS, dtype=mx.int32)[None, :, None] * layout.capacity
    keys, values = gather_by_take(
        layout.slab,
        heads + entries[:, None, :],
        layout.n_tokens,
        n_kv_heads=KV_HEADS,
        capacity=layout.capacity,
        block_size=BLOCK_SIZE,
        head_dim=HEAD_DIM,
    )
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE)


def pieces(layout: Layout, min_run: int) -> tuple[list[mx.array], list[mx.array]]:
    """Keys and values of every position, as slices of runs and one take of the rest."""
    runs, rest = runs_of(layout, min_run)
    keys: list[mx.array] = []
    values: list[mx.array] = []
    for first, length in runs:
        n = min(length * BLOCK_SIZE, layout.n_tokens - first * BLOCK_SIZE)
        key_row = layout.key_ids[first] * BLOCK_SIZE
        value_row = layout.value_ids[first] * BLOCK_SIZE
        keys.append(layout.slab[:, :, key_row : key_row + n])
        values.append(layout.slab[:, :, value_row : value_row + n])
    if rest:
        ids = [[layout.key_ids[i] for i in rest], [layout.value_ids[i] for i in rest]]
        heads = mx.arange(KV_HEADS, dtype=mx.int32)[None, :, None] * layout.capacity
        unused = len(layout.key_ids) * BLOCK_SIZE - layout.n_tokens  # of the last block
        n = len(rest) * BLOCK_SIZE - (unused if rest[-1] == len(layout.key_ids) - 1 else 0)
        got = gather_by_take(
            layout.slab,
            heads + mx.array(ids, dtype=mx.int32)[:, None, :],
            n,
            n_kv_heads=KV_HEADS,
            capacity=layout.capacity,
            block_size=BLOCK_SIZE,
            head_dim=HEAD_DIM,
        )
        keys.append(got[0])
        values.append(got[1])
    return keys, values


def read_by_runs(layout: Layout, queries: mx.array, min_run: int) -> mx.array:
    """Attention over the pieces: one softmax over the joined scores, no copy of a run."""
    keys, values = pieces(layout, min_run)
    grouped = queries.reshape(1, KV_HEADS, QUERY_HEADS // KV_HEADS, HEAD_DIM) * SCALE
    scores = [grouped @ key.swapaxes(-1, -2) for key in keys]
    weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    cuts, at = [], 0
    for key in keys[:-1]:
        at += key.shape[2]
        cuts.append(at)
    parts = mx.split(weights, cuts, axis=-1)
    out = parts[0] @ values[0]
    for part, value in zip(parts[1:], values[1:], strict=True):
        out = out + part @ value
    return out.reshape(1, QUERY_HEADS, 1, HEAD_DIM)


def median_ms(read: Callable[[], mx.array], repeats: int) -> float:
    """Median milliseconds of evaluating ``read()``, after one warm-up."""
    mx.eval(read())  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(read())
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3


def one_context(context: int, options: argparse.Namespace) -> tuple[dict[str, object], float]:
    """The figures at ``context``, and the largest difference of ``runs`` from ``gather``."""
    min_run, repeats = options.min_run, options.repeats
    layout = lay_out(context, options.decoded, options.neighbours)
    queries = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM), key=mx.random.key(1))
    buffer = mx.random.normal((1, KV_HEADS, context + 256, HEAD_DIM), key=mx.random.key(2))
    mx.eval(queries, buffer)
    difference = mx.abs(read_by_runs(layout, queries, min_run) - read_by_gather(layout, queries))
    largest = difference.max().item()
    assert isinstance(largest, float), largest  # a float32 array's item
    runs, rest = runs_of(layout, min_run)
    row: dict[str, object] = {
        "context": context,
        "runs": len(runs),
        "blocks_in_runs": sum(length for _, length in runs),
        "blocks_taken": len(rest),
        "largest_difference": largest,
        "ms": {
            "gather": median_ms(lambda: read_by_gather(layout, queries), repeats),
            "buffer_slice": median_ms(
                lambda: mx.fast.scaled_dot_product_attention(
                    queries, buffer[:, :, :context], buffer[:, :, :context], scale=SCALE
                ),
                repeats,
            ),
            "runs": median_ms(lambda: read_by_runs(layout, queries, min_run), repeats),
        },
    }
    print(f"context {context}: {row}", file=sys.stderr, flush=True)
    return row, largest


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=int_at_least(2), nargs="+", default=[4096, 32768], help="positions"
    )
    parser.add_argument(
        "--decoded",
        type=int_at_least(1),
        default=256,
        help="positions of each context appended one at a time, after its prefill",
    )
    parser.add_argument(
        "--neighbours",
        type=int_at_least(0),
        default=3,
        help="other requests decoding beside the measured one (their blocks interleave)",
    )
    parser.add_argument(
        "--min-run", type=int_at_least(1), default=8, help="fewest blocks read as a slice"
    )
    parser.add_argument("--repeats", type=int_at_least(1), default=15, help="timed reads each")
    options = parser.parse_args(argv)
    short = [c for c in options.contexts if c <= options.decoded]
    if short:
        parser.error(f"every context must exceed --decoded {options.decoded}, got {short[0]}")
    mx.set_cache_limit(8 << 30)  # as bench_kv_cache.py: freed buffers are reused, not faulted in
    measured = [one_context(context, options) for context in options.contexts]
    rows = [row for row, _ in measured]
    document = {
        "benchmark": "read_by_runs",
        "mlx": importlib.metadata.version("mlx"),
        "device": str(mx.default_device()),
        "shape": {
            "kv_heads": KV_HEADS,
            "query_heads": QUERY_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
        },
        "decoded": options.decoded,
        "neighbours": options.neighbours,
        "min_run": options.min_run,
        "by_context": rows,
    }
    print(json.dumps(document, indent=2))
    wrong = [
        c for c, (_, largest) in zip(options.contexts, measured, strict=True) if largest > TOLERANCE
    ]
    if wrong:
        print(f"runs differ from gather by more than {TOLERANCE} at {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
