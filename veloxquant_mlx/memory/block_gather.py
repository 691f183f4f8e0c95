"""The decode read of a request's blocks: slices of a run, else ``mx.take``, or one CUDA kernel.

The decode read of
:class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage` returns every
held position of a layer, through the request's block table, as the ``(1,
n_kv_heads, n_tokens, head_dim)`` keys and values attention reads. When each
stream's blocks hold consecutive ids, those positions are one run of rows of
the slab, and :func:`read_by_slices` returns two slices of it, as
``KVCache`` reads its buffers: no copy, and on an H200 the step builds and
launches two ``Slice`` nodes where a gather builds six (most of what the
paging cost a host-bound decode there: ``benchmarks/RESULTS.md``, "Where a
host-bound step's time goes"). Otherwise the positions are copied out. MLX's ``mx.take`` of whole
blocks does it anywhere, but its generic gather reaches about a fifth of an
H200's memory bandwidth: at 32K positions of
``benchmarks/bench_kv_cache.py``'s model the 8 layers' reads took 0.89-0.91
ms, against 0.35-0.39 ms for this kernel
(``benchmarks/bench_block_gather.py``, two runs; figures in ``benchmarks/RESULTS.md``).
Below :data:`KERNEL_MIN_TOKENS` positions the kernel's launch costs more
than it saves, and ``mx.take`` stays (:func:`gather_by_take`, the store's
read everywhere else).

The kernel reads a slab seen as ``(n_kv_heads * capacity, block_size,
head_dim)`` (entry ``h * capacity + b`` is block ``b`` of head ``h``, the
layout of :class:`~veloxquant_mlx.memory.slot_rows.SlotRows`) and the
step's block entries ``(2, n_kv_heads, n_blocks)`` (keys, then values), and
writes ``(2, n_kv_heads, n_tokens, head_dim)`` directly: one thread per 16
bytes of a row, so the last block is cut without a second operation. It is a
copy, so its output is bit for bit that of ``mx.take``.

Complexity: :func:`read_by_slices` O(1) host work (two slices), no device
work of its own; :func:`gather_by_kernel` O(1) host work (one launch and one
split), :func:`gather_by_take` O(1) (five MLX operations); both O(n_tokens)
device work. Thread safety: the kernel object is built
once (``functools.cache``); the per-step metadata arrays are constants (no
graph), shared by any thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Final, cast

import mlx.core as mx

__all__ = [
    "GATHER_SOURCE",
    "KERNEL_MIN_TOKENS",
    "gather_by_kernel",
    "gather_by_take",
    "kernel_gather_unsupported_reason",
    "read_by_slices",
]

#: Fewest positions read for which the kernel clearly beats ``mx.take`` on an H200
#: (``bench_block_gather.py``, 8 layers, take / kernel: 0.15-0.20 / 0.22-0.29 ms at
#: 256 positions, 0.20-0.26 / 0.17-0.20 at 4K, 0.31-0.33 / 0.17-0.22 at 8K); its
#: call also costs 0.4-2 us more host time.
KERNEL_MIN_TOKENS: Final = 8192
#: Bytes each thread copies: one 16-byte word, so a row must be a whole number of them.
WORD_BYTES: Final = 16
#: Threads per block of the launch.
THREADS: Final = 256
#: Element types the kernel is built for.
KERNEL_DTYPES: Final = (mx.float16, mx.bfloat16, mx.float32)

#: Body of ``vq_gather_blocks``. MLX generates the signature ``(const T* slab, const
#: int32_t* blocks, const int32_t* meta, T* out)``; ``meta`` is ``[n_tokens,
#: n_blocks]``, and ``D``, ``BS`` (block size) and ``H`` (KV heads) are template
#: constants. Thread ``g`` copies word ``g % (D / VEC)`` of output row ``g / (D /
#: VEC)``, i.e. position ``t`` of stream-and-head ``sh`` (``sh = s * H + h``).
GATHER_SOURCE: Final = r"""
  constexpr int VEC = 16 / sizeof(T);
  constexpr int WORDS = D / VEC;
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int n_tokens = meta[0];
  const int n_blocks = meta[1];
  if (thread >= 2LL * H * n_tokens * WORDS) return;
  const int word = thread % WORDS;
  const long long row = thread / WORDS;
  const int t = row % n_tokens;
  const long long stream_head = row / n_tokens;
  const long long entry = blocks[stream_head * n_blocks + t / BS];
  const uint4* from = reinterpret_cast<const uint4*>(slab + (entry * BS + t % BS) * D);
  reinterpret_cast<uint4*>(out + row * D)[word] = from[word];
"""

_Kernel = Callable[..., Sequence[mx.array]]


def kernel_gather_unsupported_reason(head_dim: int, dtype: mx.Dtype) -> str | None:
    """Why the kernel cannot copy rows of ``head_dim`` values of ``dtype`` (``None``
    when it can)."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not one of float16, bfloat16, float32"
    if head_dim * dtype.size % WORD_BYTES:
        return (
            f"a row of {head_dim} values is {head_dim * dtype.size} bytes, "
            f"not a multiple of {WORD_BYTES}"
        )
    return None


def gather_by_take(
    slab: mx.array,
    read_blocks: mx.array,
    n_tokens: int,
    *,
    n_kv_heads: int,
    capacity: int,
    block_size: int,
    head_dim: int,
) -> tuple[mx.array, mx.array]:
    """Keys and values of the first ``n_tokens`` positions, ``(1, n_kv_heads,
    n_tokens, head_dim)`` each, by one ``mx.take`` of whole blocks; any back-end.

    Arguments as :func:`gather_by_kernel`, with the slab's sizes passed in (the
    store knows them; asking the slab costs host time on the decode path).
    """
    by_block = slab.reshape(n_kv_heads * capacity, block_size, head_dim)
    picked = mx.take(by_block, read_blocks, axis=0)  # (2, heads, blocks, bs, dim)
    both = picked.reshape(2, n_kv_heads, -1, head_dim)
    if both.shape[2] != n_tokens:  # the last block is partly held: cut (a split is
        both = mx.split(both, [n_tokens], axis=2)[0]  # cheaper to build than a slice)
    keys, values = mx.split(both, 2)
    return keys, values


def read_by_slices(
    slab: mx.array, run_rows: tuple[int, int], n_tokens: int
) -> tuple[mx.array, mx.array]:
    """Keys and values of the first ``n_tokens`` positions, ``(1, n_kv_heads,
    n_tokens, head_dim)`` each, as two slices of ``slab``; any back-end.

    For a request whose key blocks hold consecutive ids, and so do its value blocks
    (:attr:`~veloxquant_mlx.memory.slot_rows.StepRows.run_rows`: the slab rows where
    the two runs start). Two ``Slice`` nodes and no copy, as ``KVCache`` reads its
    buffers; the values are those the gathers read. The results are views: while
    one is alive, an update of the slab cannot reuse its buffer and copies it.

    Nothing is checked: the caller makes sure that both runs of ``n_tokens`` rows,
    ``>= 1``, lie inside the slab's ``capacity * block_size`` rows (MLX clamps a slice
    that reaches past them, so a wrong row would quietly read fewer positions).
    """
    key_row, value_row = run_rows
    keys = slab[:, :, key_row : key_row + n_tokens]
    values = slab[:, :, value_row : value_row + n_tokens]
    return keys, values


def gather_by_kernel(
    slab: mx.array, read_blocks: mx.array, n_tokens: int, block_size: int
) -> tuple[mx.array, mx.array]:
    """Keys and values of the first ``n_tokens`` positions, ``(1, n_kv_heads,
    n_tokens, head_dim)`` each; on MLX's CUDA back-end only.

    Args:
        slab: One layer's slab, ``(1, n_kv_heads, capacity * block_size, head_dim)``,
            of a dtype and head size :func:`kernel_gather_unsupported_reason` accepts.
        read_blocks: ``(2, n_kv_heads, n_blocks)`` int32 slab entries, keys then
            values, with ``n_blocks * block_size >= n_tokens``.
        n_tokens: Positions to read, ``>= 1``.
        block_size: Positions per block.
    """
    _, n_kv_heads, _, head_dim = slab.shape
    n_blocks = read_blocks.shape[2]
    n_threads = 2 * n_kv_heads * n_tokens * (head_dim * slab.dtype.size // WORD_BYTES)
    both = _kernel()(
        inputs=[slab, read_blocks, _meta(n_tokens, n_blocks)],
        template=[("T", slab.dtype), ("D", head_dim), ("BS", block_size), ("H", n_kv_heads)],
        grid=(-(-n_threads // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(2, n_kv_heads, n_tokens, head_dim)],
        output_dtypes=[slab.dtype],
    )[0]
    keys, values = mx.split(both, 2)
    return keys, values


@functools.cache
def _kernel() -> _Kernel:
    """The kernel, built once (MLX compiles it on first use per template)."""
    build = cast(Callable[..., _Kernel], mx.fast.cuda_kernel)
    return build(
        name="vq_gather_blocks",
        input_names=["slab", "blocks", "meta"],
        output_names=["out"],
        source=GATHER_SOURCE,
    )


@functools.lru_cache(maxsize=16)
def _meta(n_tokens: int, n_blocks: int) -> mx.array:
    """``[n_tokens, n_blocks]``: one array per step, shared by its layers (a constant, no
    graph, so any thread may use it)."""
    return mx.array([n_tokens, n_blocks], dtype=mx.int32)
