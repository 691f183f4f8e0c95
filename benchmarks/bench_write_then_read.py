"""What a decode step's reads cost on the device: the store's two paths against ``KVCache``'s.

The fused paged-attention kernel is faster per call than gather + MLX's
attention (``bench_paged_attention.py``), yet a decode step through it is
slower end to end (``bench_kv_cache.py``); on the CPU the gathered path
falls behind ``KVCache`` at long contexts. This benchmark takes the model and
the cache away and times only the device side. It runs a graph of 8 layers,
each a small matmul followed by one of these:

- ``matmul_only``: nothing more (the baseline);
- ``slab_writes``: the decode step's two one-row writes into a slab;
- ``take_after_writes``: the writes, then the store's read of every held
  position (``block_gather.gather_by_take``), with no attention;
- ``gathered``: the writes, the read, then ``mx.fast.scaled_dot_product_attention``
  over the gathered keys and values: the store's default decode path for a
  request whose ids are not one run (one whose ids are is read by slices, as
  ``kv_cache_like`` reads);
- ``fused``: the fused kernel over the slab, with no write (CUDA only);
- ``fused_after_writes``: both, the kernel reading what was just written
  (CUDA only);
- ``kv_cache_like``: two one-row writes into per-layer buffers, then
  ``mx.fast.scaled_dot_product_attention`` over a slice of them, as mlx-lm's
  ``KVCache`` does.

On MLX's CUDA back-end each step is scheduled as soon as it is built, as a
decode loop would, with every slab and buffer it wrote (a write that nothing
reads would otherwise never run); on the CPU each step is evaluated before
the next is built (see ``microseconds_per_step``). The figure is the wall
time per 8-layer step, a median over
samples. Derived, per context: ``take_us_per_layer``, the read alone
(``(take_after_writes - slab_writes) / 8``); ``gathered_speed_over_kv_cache_like``,
the gathered path's steps per second over ``KVCache``'s (what
``bench_kv_cache.py``'s ratio tends to where the device, not the host, decides
a step and attention is most of it); and on
CUDA ``interaction_us_per_layer``, what the write-then-read pair costs beyond its
parts, per layer: ``(fused_after_writes - fused - slab_writes + matmul_only) / 8``.

    python benchmarks/bench_write_then_read.py [--quick]

Progress goes to stderr, one JSON document to stdout. MLX's buffer cache
limit is raised (``_report.set_buffer_cache_limit``). Without MLX's CUDA
back-end the fused modes are left out and it says why (a benchmark reports;
it never fails). Thread safety: single-threaded.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from _report import print_report, set_buffer_cache_limit

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.memory.block_gather import gather_by_take
from veloxquant_mlx.memory.block_table import schedule
from veloxquant_mlx.memory.paged_attention import (
    PagedKV,
    cuda_paged_decode_attention,
    cuda_unavailable_reason,
)

LAYERS = 8
KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 64, 16
CONTEXTS = (256, 4096, 16384, 32768)
#: Modes that run on any back-end, then those that need MLX's CUDA back-end.
PORTABLE_MODES = ("matmul_only", "slab_writes", "take_after_writes", "gathered", "kv_cache_like")
CUDA_MODES = ("fused", "fused_after_writes")
#: Modes that read the held positions with the store's take (its indices: once a step).
READING_MODES = ("take_after_writes", "gathered")
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
    reads: list[mx.array]

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
            reads=[],
        )
        mx.eval(layers.slabs, layers.keys, layers.values, layers.key_ids, layers.value_ids)
        mx.eval(layers.weight)
        return layers

    def step(self, mode: str, x: mx.array, position: int) -> mx.array:
        """One 8-layer step at ``position`` (the new token's), in ``mode``."""
        self.reads = []
        read_blocks = self._read_blocks(position + 1) if mode in READING_MODES else None
        for layer in range(LAYERS):
            queries = (x @ self.weight).reshape(1, Q_HEADS, 1, HEAD_DIM)
            row = mx.broadcast_to(
                x[:, :HEAD_DIM].reshape(1, 1, 1, HEAD_DIM), (1, KV_HEADS, 1, HEAD_DIM)
            )
            attended = queries
            if mode == "kv_cache_like":
                attended = self._kv_cache_like(layer, queries, row, position)
            elif mode != "matmul_only":
                slab = (
                    self.slabs[layer] if mode == "fused" else self._write_row(layer, row, position)
                )
                if read_blocks is not None:
                    keys, values = self._take(slab, read_blocks, position + 1)
                    self.reads += [keys, values]
                if mode == "gathered":
                    attended = mx.fast.scaled_dot_product_attention(
                        queries, keys, values, scale=0.125
                    )
                elif mode in CUDA_MODES:
                    attended = self._fused(slab, queries, position)
            x = x + attended.reshape(1, Q_HEADS * HEAD_DIM)
        return x

    def written(self) -> list[mx.array]:
        """The slabs and buffers as last written, and the step's reads, to be evaluated
        with each step."""
        return [*self.slabs, *self.keys, *self.values, *self.reads]

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

    def _read_blocks(self, n_tokens: int) -> mx.array:
        """The store's block entries of the first ``n_tokens`` positions, ``(2, heads,
        blocks)``: keys, then values (built once per step, as the store's are)."""
        n_blocks = -(-n_tokens // BLOCK_SIZE)
        ids = mx.stack([self.key_ids[:n_blocks], self.value_ids[:n_blocks]])
        first_entries = mx.arange(KV_HEADS, dtype=mx.int32)[None, :, None] * self.capacity
        return first_entries + ids[:, None, :]

    def _take(
        self, slab: mx.array, read_blocks: mx.array, n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        return gather_by_take(
            slab,
            read_blocks,
            n_tokens,
            n_kv_heads=KV_HEADS,
            capacity=self.capacity,
            block_size=BLOCK_SIZE,
            head_dim=HEAD_DIM,
        )

    def _fused(self, slab: mx.array, queries: mx.array, position: int) -> mx.array:
        by_block = slab.reshape(KV_HEADS, self.capacity, BLOCK_SIZE, HEAD_DIM)
        paged = PagedKV(by_block, self.key_ids, self.value_ids)
        return cuda_paged_decode_attention(queries, paged, position + 1, scale=0.125)

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


def microseconds_per_step(layers: Layers, mode: str, samples: int, *, pipelined: bool) -> float:
    """Median wall microseconds per step over ``samples`` runs of steps, each scheduled
    as soon as it is built (``pipelined``) or evaluated before the next is built.

    Pipelined is the GPU's measure: launches overlap. On MLX's CPU back-end a slab
    scheduled with ``mx.async_eval`` while the next step writes it is copied, not
    updated in place (8 slabs of a 4K context: 5.7 ms a step, against 0.15 ms
    evaluated step by step), which would charge the writes a copy a real decode
    step never makes; so there each step is evaluated in turn.
    """
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
            if pipelined:
                schedule(x, *layers.written())  # a write nothing reads would never run
            else:
                mx.eval(x, *layers.written())
        mx.eval(x, *layers.written())
        per_step.append((time.perf_counter() - start) / STEPS_PER_SAMPLE * 1e6)
    return statistics.median(per_step)


def bench_context(
    context: int, samples: int, progress: Callable[[str], None], *, cuda: bool
) -> dict[str, float]:
    """Every mode at ``context``; on MLX's CUDA back-end (``cuda``) the fused ones too,
    and steps pipelined (see :func:`microseconds_per_step`)."""
    layers = Layers.make(context)
    modes = PORTABLE_MODES + CUDA_MODES if cuda else PORTABLE_MODES
    row = {
        mode: round(microseconds_per_step(layers, mode, samples, pipelined=cuda), 1)
        for mode in modes
    }
    row["take_us_per_layer"] = round((row["take_after_writes"] - row["slab_writes"]) / LAYERS, 1)
    row["gathered_speed_over_kv_cache_like"] = round(row["kv_cache_like"] / row["gathered"], 3)
    if "fused_after_writes" in row:
        interaction = (
            row["fused_after_writes"] - row["fused"] - row["slab_writes"] + row["matmul_only"]
        ) / LAYERS
        row["interaction_us_per_layer"] = round(interaction, 1)
    progress(f"context {context}: " + ", ".join(f"{key} {value}" for key, value in row.items()))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    arguments = parser.parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(
            f"the fused modes are left out: they need MLX's CUDA back-end ({reason})",
            file=sys.stderr,
        )
    samples = 2 if arguments.quick else 5
    set_buffer_cache_limit()

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    figures = {
        "layers": LAYERS,
        "us_per_step": {
            str(c): bench_context(c, samples, progress, cuda=reason is None) for c in CONTEXTS
        },
    }
    print_report("write_then_read", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
