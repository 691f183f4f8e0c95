"""The decode read of a request's blocks: MLX's take against the CUDA gather kernel.

Both read every held position of 8 layers out of their slabs through one
shuffled block table, as ``MLXBlockStorage``'s decode step does, for the
shape of ``bench_kv_cache.py``'s model (2 KV heads of 64, float32, blocks of
16). Per context, alternating the two ways in every round: host microseconds
to build one layer's read, and milliseconds to evaluate the 8 reads (device
time plus launches; nothing else in the graph). Medians over rounds, and the
take/kernel ratio of the device time. Each context first checks that both
give the same bits. ``block_gather.KERNEL_MIN_TOKENS`` is set from these
figures: the kernel is used from there on.

    python benchmarks/bench_block_gather.py [--rounds N] [--contexts 256 4096 ...]

Without MLX's CUDA back-end it says why and exits 0. Prints one JSON
document. Thread safety: single-threaded.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import mlx.core as mx
from _report import print_report, set_buffer_cache_limit

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.memory.block_gather import (
    KERNEL_MIN_TOKENS,
    gather_by_kernel,
    gather_by_take,
)
from veloxquant_mlx.memory.paged_attention import cuda_unavailable_reason

N_LAYERS = 8
N_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 16
CONTEXTS = (256, 1024, 4096, 8192, 16384, 32768)

Read = Callable[[mx.array], tuple[mx.array, mx.array]]


def one_context(n_tokens: int, rounds: int) -> dict[str, float]:
    n_blocks = -(-n_tokens // BLOCK_SIZE)
    capacity = 2 * n_blocks + 8
    slabs = [
        mx.random.normal((1, N_KV_HEADS, capacity * BLOCK_SIZE, HEAD_DIM)) for _ in range(N_LAYERS)
    ]
    ids = mx.random.permutation(capacity)[: 2 * n_blocks].astype(mx.int32)
    first_entries = mx.arange(N_KV_HEADS, dtype=mx.int32)[None, :, None] * capacity
    read_blocks = first_entries + ids.reshape(2, 1, n_blocks)
    mx.eval(slabs, read_blocks)
    ways: dict[str, Read] = {
        "take": lambda slab: gather_by_take(
            slab,
            read_blocks,
            n_tokens,
            n_kv_heads=N_KV_HEADS,
            capacity=capacity,
            block_size=BLOCK_SIZE,
            head_dim=HEAD_DIM,
        ),
        "kernel": lambda slab: gather_by_kernel(slab, read_blocks, n_tokens, BLOCK_SIZE),
    }
    for slab in slabs[:1]:
        want, got = ways["take"](slab), ways["kernel"](slab)
        if not all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True)):
            raise SystemExit(f"the kernel's read differs from take's at {n_tokens} positions")
    host: dict[str, list[float]] = {name: [] for name in ways}
    device: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, read in ways.items():
            mx.synchronize()
            started = time.perf_counter()
            reads = [read(slab) for slab in slabs]
            built = time.perf_counter()
            mx.eval(reads)
            mx.synchronize()
            host[name].append((built - started) / N_LAYERS * 1e6)
            device[name].append((time.perf_counter() - built) * 1e3)
    row = {f"{name}_host_us": statistics.median(values) for name, values in host.items()}
    row |= {f"{name}_eval_ms": statistics.median(values) for name, values in device.items()}
    row["take_over_kernel_eval"] = row["take_eval_ms"] / row["kernel_eval_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds per context (default 40)")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    options = parser.parse_args(argv)
    if options.rounds < 1 or min(options.contexts) < 1:
        parser.error("--rounds and every context must be >= 1")
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"bench_block_gather: nothing to measure: {reason}", file=sys.stderr)
        return 0
    set_buffer_cache_limit()
    rows = {}
    for n_tokens in options.contexts:
        rows[n_tokens] = one_context(n_tokens, options.rounds)
        figures = rows[n_tokens]
        print(
            f"{n_tokens} positions: 8 reads take {figures['take_eval_ms']:.3f} ms, kernel "
            f"{figures['kernel_eval_ms']:.3f} ms (x{figures['take_over_kernel_eval']:.2f})",
            file=sys.stderr,
            flush=True,
        )
    summary: dict[str, object] = {
        "shape": {"layers": N_LAYERS, "kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM},
        "kernel_min_tokens": KERNEL_MIN_TOKENS,
        "rounds": options.rounds,
        "by_context": rows,
    }
    print_report("block_gather", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
