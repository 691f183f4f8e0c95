"""A decode read without the gather's copy: attention over runs of consecutive blocks.

Where a request's key ids (and its value ids) are not one run, the store's
decode read (``block_gather.gather_by_take``) copies every held position of
a layer out of the slab before attention reads it, at every step (a request
whose ids are one run is read as two slices: ``block_gather.read_by_slices``);
mlx-lm's ``KVCache`` attends over a slice of its own buffer, with no copy.
A fresh pool hands a prefill consecutive block ids per stream, so most of a
long request's blocks form a few runs that a slice of the slab reads as they
are. This benchmark measures, on one layer (2 KV heads of 64, 8 query heads,
float32, blocks of 16), one decode step's read and attention of a request
laid out by the real pool: a prefill of ``context - decoded`` positions,
then ``decoded`` one at a time beside ``--neighbours`` other requests
decoding on the same fixed pool, whose new blocks interleave with its own
(alone on a fresh fixed pool, a request's blocks are all consecutive):

- ``gather``: the store's take path (``gather_by_take``; on CUDA at 8K
  positions and more the store uses its gather kernel instead) and MLX's
  ``scaled_dot_product_attention`` (on the CPU, MLX's unfused fallback);
- ``buffer_slice``: what ``KVCache`` does, SDPA over a slice of a contiguous
  buffer (the lower bound of a read without a copy);
- ``runs``: a prototype of the idea, not the store's code: runs of at least
  ``--min-run`` consecutive blocks (keys and values both consecutive) are read
  as slices, the other blocks with one ``mx.take``; attention is two matmuls a
  piece and one softmax over the joined scores (no mask: a decode step).

Per context: the median milliseconds of each (the block entries and runs
are built once, outside the timing, as the store keeps them between steps),
the runs found, and the relative error ``|runs - gather| / |gather|``.
Before any timing, a relative error of 1e-5 or more (NaN included; one
position left out is 1e-3 or more at 32K and 128K) stops the run: a figure
of a wrong result would mean nothing. The default contexts are not whole
blocks, so the last block is cut. Nothing else passes or fails; issue 9's
note reads these figures.

    python benchmarks/bench_read_by_runs.py                        # about 4K and 32K
    python benchmarks/bench_read_by_runs.py --contexts 8200 --decoded 1024

Progress goes to stderr, one JSON document to stdout. Exit status: 0
figures printed, 1 the prototype's result is wrong (no figures), 2 bad
input. Thread safety: single-threaded.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from _accuracy import relative_error
from _report import print_report, run_benchmark, set_buffer_cache_limit

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.memory.block_gather import gather_by_take
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

KV_HEADS, QUERY_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 64, 16
#: Largest relative error of a correct read (float32 sums in another order: about 4e-7).
TOLERANCE = 1e-5
SCALE = HEAD_DIM**-0.5


@dataclass(frozen=True)
class Layout:
    """One request's blocks in a slab: the slab, its key and value block ids, its positions."""

    slab: mx.array  # (1, KV_HEADS, capacity * BLOCK_SIZE, HEAD_DIM)
    capacity: int
    key_ids: list[int]
    value_ids: list[int]
    n_tokens: int


@dataclass(frozen=True)
class RunPlan:
    """How ``read_by_runs`` reads a layout: its runs ``(first block, length)``, the other
    blocks (in block order) and their slab entries."""

    runs: list[tuple[int, int]]
    rest: list[int]
    rest_entries: mx.array | None


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


def slab_entries(layout: Layout, blocks: list[int]) -> mx.array:
    """The slab entries ``(2, KV_HEADS, len(blocks))`` of the request's blocks at indices
    ``blocks``, keys then values, as ``SlotRows`` keeps them (evaluated)."""
    ids = [[layout.key_ids[i] for i in blocks], [layout.value_ids[i] for i in blocks]]
    heads = mx.arange(KV_HEADS, dtype=mx.int32)[None, :, None] * layout.capacity
    entries = heads + mx.array(ids, dtype=mx.int32)[:, None, :]
    mx.eval(entries)
    return entries


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


def plan_runs(layout: Layout, min_run: int) -> RunPlan:
    """The runs of ``layout`` and the entries of its other blocks, built once."""
    runs, rest = runs_of(layout, min_run)
    return RunPlan(runs, rest, slab_entries(layout, rest) if rest else None)


def read_by_gather(layout: Layout, entries: mx.array, queries: mx.array) -> mx.array:
    """The store's take path (``gather_by_take``, as the store calls it), then SDPA."""
    keys, values = gather_by_take(
        layout.slab,
        entries,
        layout.n_tokens,
        n_kv_heads=KV_HEADS,
        capacity=layout.capacity,
        block_size=BLOCK_SIZE,
        head_dim=HEAD_DIM,
    )
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE)


def pieces(layout: Layout, plan: RunPlan) -> tuple[list[mx.array], list[mx.array]]:
    """Keys and values of every position, as slices of runs and one take of the rest."""
    keys: list[mx.array] = []
    values: list[mx.array] = []
    for first, length in plan.runs:
        n = min(length * BLOCK_SIZE, layout.n_tokens - first * BLOCK_SIZE)
        key_row = layout.key_ids[first] * BLOCK_SIZE
        value_row = layout.value_ids[first] * BLOCK_SIZE
        keys.append(layout.slab[:, :, key_row : key_row + n])
        values.append(layout.slab[:, :, value_row : value_row + n])
    if plan.rest_entries is not None:
        unused = len(layout.key_ids) * BLOCK_SIZE - layout.n_tokens  # of the last block
        last_is_rest = plan.rest[-1] == len(layout.key_ids) - 1
        n = len(plan.rest) * BLOCK_SIZE - (unused if last_is_rest else 0)
        rest_keys, rest_values = gather_by_take(
            layout.slab,
            plan.rest_entries,
            n,
            n_kv_heads=KV_HEADS,
            capacity=layout.capacity,
            block_size=BLOCK_SIZE,
            head_dim=HEAD_DIM,
        )
        keys.append(rest_keys)
        values.append(rest_values)
    return keys, values


def read_by_runs(layout: Layout, plan: RunPlan, queries: mx.array) -> mx.array:
    """Attention over the pieces: one softmax over the joined scores, no copy of a run.

    Query head ``i`` reads KV head ``i // (QUERY_HEADS // KV_HEADS)``, as MLX's
    attention does; the order of the pieces does not matter (no mask)."""
    keys, values = pieces(layout, plan)
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


def one_context(context: int, options: argparse.Namespace) -> dict[str, object] | None:
    """The figures at ``context``; ``None`` (after saying why) if ``runs`` reads wrong."""
    layout = lay_out(context, options.decoded, options.neighbours)
    entries = slab_entries(layout, list(range(len(layout.key_ids))))
    plan = plan_runs(layout, options.min_run)
    queries = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM), key=mx.random.key(1))
    # A KVCache-like buffer, with room for the 256 positions KVCache grows by.
    buffer = mx.random.normal((1, KV_HEADS, context + 256, HEAD_DIM), key=mx.random.key(2))
    mx.eval(queries, buffer)
    error = relative_error(
        read_by_runs(layout, plan, queries), read_by_gather(layout, entries, queries)
    )
    if math.isnan(error) or error >= TOLERANCE:
        print(
            f"context {context}: the runs read differs from the gather by {error:.3g} "
            f"(relative; expected < {TOLERANCE:g}), so no figures",
            file=sys.stderr,
        )
        return None
    repeats = options.repeats
    held = buffer[:, :, :context]
    row: dict[str, object] = {
        "context": context,
        "runs": len(plan.runs),
        "blocks_in_runs": sum(length for _, length in plan.runs),
        "blocks_taken": len(plan.rest),
        "relative_error": error,
        "ms": {
            "gather": median_ms(lambda: read_by_gather(layout, entries, queries), repeats),
            "buffer_slice": median_ms(
                lambda: mx.fast.scaled_dot_product_attention(queries, held, held, scale=SCALE),
                repeats,
            ),
            "runs": median_ms(lambda: read_by_runs(layout, plan, queries), repeats),
        },
    }
    print(f"context {context}: {row}", file=sys.stderr, flush=True)
    return row


#: The options whose values size the pool: what a refusal for memory names.
SIZE_OPTIONS = "--contexts, --decoded or --neighbours"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=int_at_least(1), nargs="+", default=[4100, 32770], help="positions"
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
        parser.error(
            f"--contexts: every context must exceed --decoded {options.decoded}, got {short[0]}"
        )
    set_buffer_cache_limit()
    rows = []
    for context in options.contexts:
        row = one_context(context, options)
        if row is None:
            return 1
        rows.append(row)
    figures = {
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
    print_report("read_by_runs", figures)
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("bench_read_by_runs.py", main, SIZE_OPTIONS))
