"""What a decode step's slab write costs the fused kernel that reads it next (CUDA only).

The fused paged-attention kernel is faster per call than gather + MLX's
attention (``bench_paged_attention.py``), yet a decode step through it is
slower end to end (``bench_kv_cache.py``). This benchmark takes the model and
the cache away and times only the device side. It runs a graph of 8 layers,
each a small matmul followed by one of these:

- ``matmul_only``: nothing more (the baseline);
- ``slab_writes``: the decode step's two one-row writes into a slab;
- ``fused``: the fused kernel over the slab, with no write;
- ``fused_after_writes``: both, the kernel reading what was just written;
- ``kv_cache_like``: two one-row writes into per-layer buffers, then
  ``mx.fast.scaled_dot_product_attention`` over a slice of them, as mlx-lm's
  ``KVCache`` does.

Each step is scheduled as soon as it is built, as a decode loop would, with
every slab and buffer it wrote (a write that nothing reads would otherwise
never run); the figure is the wall time per 8-layer step. ``interaction_us_per_layer`` is
what the write-then-read pair costs beyond its parts, per layer:
``(fused_after_writes - fused - slab_writes + matmul_only) / 8``.

    python benchmarks/bench_write_then_read.py [--quick]

Prints one JSON document. Without MLX's CUDA back-end it says why and exits 0
(a benchmark reports; it never fails). Thread safety: single-threaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from veloxquant_mlx.memory.block_table import schedule
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    cuda_paged_decode_attention,
    cuda_unavailable_reason,
)

LAYERS = 8
KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 64, 16
CONTEXTS = (256, 4096, 32768)
MODES = ("matmul_only", "slab_writes", "fused", "fused_after_writes", "kv_cache_like")
STEPS_PER_SAMPLE = 30


@dataclass
class Layers:
    """Per-layer arrays for one context: slabs (head-major, as ``MLXBlockStorage`` holds
    them), ``KVCache``-like key and value buffers, and the block table."""

    context: int
    n_blocks: int
    capacity: int
    slabs: list[mx.array]
    keys: list[mx.array]
    values: list[mx.array]
    key_ids: mx.array
    value_ids: mx.array
    weight: mx.array

    @classmethod
    def make(cls, context: int) -> Layers:
        n_blocks = context // BLOCK_SIZE + 8  # room for the positions a run writes
        capacity = 2 * n_blocks
        rows = capacity * BLOCK_SIZE
        layers = cls(
            context=context,
            n_blocks=n_blocks,
            capacity=capacity,
            slabs=[mx.random.normal((1, KV_HEADS, rows, HEAD_DIM)) for _ in range(LAYERS)],
            keys=[mx.random.normal((1, KV_HEADS, context + 512, HEAD_DIM)) for _ in range(LAYERS)],
            values=[
                mx.random.normal((1, KV_HEADS, context + 512, HEAD_DIM)) for _ in range(LAYERS)
            ],
            key_ids=mx.arange(0, n_blocks, dtype=mx.int32),
            value_ids=mx.arange(n_blocks, 2 * n_blocks, dtype=mx.int32),
            weight=mx.random.normal((Q_HEADS * HEAD_DIM, Q_HEADS * HEAD_DIM)) * 0.01,
        )
        mx.eval(layers.slabs, layers.keys, layers.values, layers.key_ids, layers.value_ids)
        mx.eval(layers.weight)
        return layers

    def step(self, mode: str, x: mx.array, position: int) -> mx.array:
        """One 8-layer step at ``position`` (the new token's), in ``mode``."""
        for layer in range(LAYERS):
            queries = (x @ self.weight).reshape(1, Q_HEADS, 1, HEAD_DIM)
            row = mx.broadcast_to(
                x[:, :HEAD_DIM].reshape(1, 1, 1, HEAD_DIM), (1, KV_HEADS, 1, HEAD_DIM)
            )
            attended = queries
            if mode == "kv_cache_like":
                attended = self._kv_cache_like(layer, queries, row, position)
            elif mode != "matmul_only":
                slab = self.slabs[layer]
                if mode in ("slab_writes", "fused_after_writes"):
                    slab = self._write_row(layer, row, position)
                if mode in ("fused", "fused_after_writes"):
                    by_block = slab.reshape(KV_HEADS, self.capacity, BLOCK_SIZE, HEAD_DIM)
                    paged = PagedKV(by_block, self.key_ids, self.value_ids)
                    attended = cuda_paged_decode_attention(
                        queries, paged, position + 1, scale=0.125
                    )
            x = x + attended.reshape(1, Q_HEADS * HEAD_DIM)
        return x

    def written(self) -> list[mx.array]:
        """The slabs and buffers as last written, to be evaluated with each step."""
        return [*self.slabs, *self.keys, *self.values]

    def _write_row(self, layer: int, row: mx.array, position: int) -> mx.array:
        """The new key and value rows, written where the store's decode step writes them."""
        block, slot = divmod(position, BLOCK_SIZE)
        key_row = block * BLOCK_SIZE + slot
        value_row = (self.n_blocks + block) * BLOCK_SIZE + slot
        slab = self.slabs[layer]
        slab[..., key_row : key_row + 1, :] = row
        slab[..., value_row : value_row + 1, :] = row
        self.slabs[layer] = slab
        return slab

    def _kv_cache_like(
        self, layer: int, queries: mx.array, row: mx.array, position: int
    ) -> mx.array:
        keys, values = self.keys[layer], self.values[layer]
        keys[..., position : position + 1, :] = row
        values[..., position : position + 1, :] = row
        self.keys[layer], self.values[layer] = keys, values
        held = position + 1
        return mx.fast.scaled_dot_product_attention(
            queries, keys[..., :held, :], values[..., :held, :], scale=0.125
        )


def microseconds_per_step(layers: Layers, mode: str, samples: int) -> float:
    """Median wall microseconds per step over ``samples`` runs of pipelined steps."""
    x = mx.random.normal((1, Q_HEADS * HEAD_DIM))
    position = layers.context - 256
    mx.eval(layers.step(mode, x, position))  # compiles the kernels outside the timing
    per_step = []
    for _ in range(samples):
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS_PER_SAMPLE):
            position += 1
            x = layers.step(mode, x, position)
            schedule(x, *layers.written())  # a write nothing reads would never run
        mx.eval(x, *layers.written())
        per_step.append((time.perf_counter() - start) / STEPS_PER_SAMPLE * 1e6)
    return statistics.median(per_step)


def bench_context(context: int, samples: int, progress: Callable[[str], None]) -> dict[str, float]:
    layers = Layers.make(context)
    row = {mode: round(microseconds_per_step(layers, mode, samples), 1) for mode in MODES}
    interaction = (
        row["fused_after_writes"] - row["fused"] - row["slab_writes"] + row["matmul_only"]
    ) / LAYERS
    row["interaction_us_per_layer"] = round(interaction, 1)
    progress(f"context {context}: " + ", ".join(f"{key} {value}" for key, value in row.items()))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    arguments = parser.parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"not measured: the fused kernel needs MLX's CUDA back-end ({reason})")
        return 0
    samples = 2 if arguments.quick else 5

    def progress(line: str) -> None:
        print(line, flush=True)

    report = {
        "device": str(mx.default_device()),
        "layers": LAYERS,
        "us_per_step": {str(c): bench_context(c, samples, progress) for c in CONTEXTS},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
