"""Paged decode attention: one step of attention over keys and values left in their blocks.

Users: :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage` (its
``attend_through_table``) on behalf of a pool-backed KV cache, once the
model's attention is routed to it (:mod:`~veloxquant_mlx.memory.attention_hook`).

Two implementations of one function, ``softmax(q . K^T * scale) . V`` for a
single query position, with the keys and values of positions ``0 ..
n_tokens - 1`` found through a block table in a head-major slab
``(n_kv_heads, capacity, block_size, head_dim)``:

- :func:`cuda_paged_decode_attention`: a fused kernel for MLX's CUDA
  back-end (``mx.fast.cuda_kernel``; source and launch shapes in
  :mod:`~veloxquant_mlx.memory._paged_attention_cuda`). It reads the keys
  and values in place: no gathered copy is ever made.
- :func:`gathered_decode_attention`: the reference, from MLX operations on
  any back-end: one ``mx.take`` of the table's slab rows (a copy), then
  ``mx.fast.scaled_dot_product_attention``. It is also what the store's
  gather path computes, so the two are compared output for output.

:func:`paged_decode_attention` picks the kernel where it can run
(:func:`cuda_unavailable_reason` and :func:`shape_unsupported_reason` say why
not) and the reference otherwise.

Complexity: each call O(n_tokens * heads * head_dim) device work and O(1)
host work (a handful of MLX calls; the kernels are compiled once per dtype
and shape constants, then cached by MLX). Thread safety: stateless apart
from caches built under ``functools.cache``; MLX's own rules apply to the
arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import mlx.core as mx

from veloxquant_mlx.memory._paged_attention_cuda import (
    COMBINE_INPUTS,
    COMBINE_SOURCE,
    HEADER,
    PASS_INPUTS,
    SINGLE_SOURCE,
    SPLIT_SOURCE,
    launch_shape,
    unsupported_reason,
)

__all__ = [
    "PagedKV",
    "cuda_paged_decode_attention",
    "cuda_unavailable_reason",
    "gather_kv_heads",
    "gathered_decode_attention",
    "kv_slab_rows",
    "paged_decode_attention",
    "shape_unsupported_reason",
]

#: Element types the kernel is built for.
KERNEL_DTYPES: Final = (mx.float16, mx.bfloat16, mx.float32)

_Kernel = Callable[..., Sequence[mx.array]]


@dataclass(frozen=True)
class PagedKV:
    """One layer's keys and values where they lie: a slab and a request's block table.

    Attributes:
        slab: ``(n_kv_heads, capacity, block_size, head_dim)``, head-major; row-contiguous.
        key_ids: ``(n_blocks,)`` int32: the key block of positions ``i * block_size ..``.
        value_ids: ``(n_blocks,)`` int32, parallel to ``key_ids``.
    """

    slab: mx.array
    key_ids: mx.array
    value_ids: mx.array


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot run in this process now (``None`` when it can).

    It needs MLX's CUDA back-end and the GPU as the default device.
    """
    if not _cuda_present():
        return "MLX's CUDA back-end is not available here (mx.cuda.is_available() is False)"
    if mx.default_device() != mx.gpu:
        return f"the default device is {mx.default_device()}, not the GPU"
    return None


def shape_unsupported_reason(
    n_q_heads: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype
) -> str | None:
    """Why the kernel cannot serve this attention shape (``None`` when it can)."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not one of float16, bfloat16, float32"
    if n_q_heads % n_kv_heads:
        return f"{n_q_heads} query heads are not a multiple of {n_kv_heads} KV heads"
    return unsupported_reason(head_dim, dtype.size, n_q_heads // n_kv_heads)


def paged_decode_attention(
    queries: mx.array, paged: PagedKV, n_tokens: int, *, scale: float
) -> mx.array:
    """Attention of one query position over the first ``n_tokens`` positions of a table.

    Args:
        queries: ``(1, n_q_heads, 1, head_dim)``, of the slab's dtype.
        paged: The slab and the table; ``n_blocks * block_size >= n_tokens``.
        n_tokens: Positions to attend to, ``>= 1``.
        scale: Multiplies every score before the softmax.

    Returns:
        ``(1, n_q_heads, 1, head_dim)`` of the slab's dtype: the CUDA kernel's result
        where it can run, the gathered reference's otherwise.
    """
    n_kv_heads, _, _, head_dim = paged.slab.shape
    if (
        cuda_unavailable_reason() is None
        and shape_unsupported_reason(queries.shape[1], n_kv_heads, head_dim, paged.slab.dtype)
        is None
    ):
        return cuda_paged_decode_attention(queries, paged, n_tokens, scale=scale)
    return gathered_decode_attention(queries, paged, n_tokens, scale=scale)


def cuda_paged_decode_attention(
    queries: mx.array, paged: PagedKV, n_tokens: int, *, scale: float
) -> mx.array:
    """The fused kernel (arguments as :func:`paged_decode_attention`); GPU only.

    One launch when a partition covers the context, else a split pass and a
    combine pass.
    """
    n_q_heads = queries.shape[1]
    slab = paged.slab
    n_kv_heads, capacity, block_size, head_dim = slab.shape
    group = n_q_heads // n_kv_heads
    shape = launch_shape(n_tokens, n_kv_heads, head_dim, slab.dtype.size, group)
    meta = _meta_array(n_tokens, capacity, shape.part_size)
    threads = shape.warps * 32
    first_pass: dict[str, Any] = {
        "inputs": [queries, slab, paged.key_ids, paged.value_ids, meta, _scale_array(scale)],
        "template": [("T", slab.dtype), *shape.template(head_dim, block_size, group)],
        "grid": (shape.n_parts * threads, n_kv_heads, 1),
        "threadgroup": (threads, 1, 1),
    }
    single, split, combine = _kernels()
    if shape.n_parts == 1:
        return single(**first_pass, output_shapes=[queries.shape], output_dtypes=[slab.dtype])[0]
    partial_o, partial_ml = split(
        **first_pass,
        output_shapes=[(n_q_heads, shape.n_parts, head_dim), (n_q_heads, shape.n_parts, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return combine(
        inputs=[partial_o, partial_ml, meta],
        template=[("T", slab.dtype), ("D", head_dim)],
        grid=(n_q_heads * head_dim, 1, 1),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[slab.dtype],
    )[0]


def gathered_decode_attention(
    queries: mx.array, paged: PagedKV, n_tokens: int, *, scale: float
) -> mx.array:
    """The reference (arguments as :func:`paged_decode_attention`): gather, then MLX's
    scaled dot-product attention. Any back-end."""
    n_kv_heads, capacity, block_size, _ = paged.slab.shape
    n_blocks = -(-n_tokens // block_size)
    rows = kv_slab_rows(paged.key_ids, paged.value_ids, n_blocks, n_kv_heads, capacity)
    keys, values = gather_kv_heads(paged.slab, rows, n_tokens)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)


def kv_slab_rows(
    key_ids: mx.array, value_ids: mx.array, n_blocks: int, n_kv_heads: int, capacity: int
) -> mx.array:
    """``(n_kv_heads, 2 * n_blocks)`` rows of a slab seen as ``(n_kv_heads * capacity,
    block_size, head_dim)``: each head's first ``n_blocks`` key blocks, then its value
    blocks. Row ``h * capacity + b`` is block ``b`` of head ``h``."""
    ids = mx.concatenate([key_ids[:n_blocks], value_ids[:n_blocks]])
    return (mx.arange(n_kv_heads, dtype=mx.int32) * capacity)[:, None] + ids[None]


def gather_kv_heads(slab: mx.array, rows: mx.array, n_tokens: int) -> tuple[mx.array, mx.array]:
    """Keys and values of the first ``n_tokens`` positions, each ``(1, n_kv_heads,
    n_tokens, head_dim)``, by one ``mx.take`` of ``rows`` (from :func:`kv_slab_rows`)."""
    n_kv_heads, capacity, block_size, head_dim = slab.shape
    n_blocks = rows.shape[1] // 2
    flat = slab.reshape(n_kv_heads * capacity, block_size, head_dim)
    both = mx.take(flat, rows, axis=0).reshape(1, n_kv_heads, 2, n_blocks * block_size, head_dim)
    return both[:, :, 0, :n_tokens], both[:, :, 1, :n_tokens]


@functools.cache
def _kernels() -> tuple[_Kernel, _Kernel, _Kernel]:
    """The three kernels, built once (MLX compiles each on first use per template)."""
    build = cast(Callable[..., _Kernel], mx.fast.cuda_kernel)
    single = build(
        name="vq_paged_decode_single",
        input_names=list(PASS_INPUTS),
        output_names=["out"],
        source=SINGLE_SOURCE,
        header=HEADER,
    )
    split = build(
        name="vq_paged_decode_split",
        input_names=list(PASS_INPUTS),
        output_names=["partial_o", "partial_ml"],
        source=SPLIT_SOURCE,
        header=HEADER,
    )
    combine = build(
        name="vq_paged_decode_combine",
        input_names=list(COMBINE_INPUTS),
        output_names=["out"],
        source=COMBINE_SOURCE,
        header=HEADER,
    )
    return single, split, combine


@functools.cache
def _cuda_present() -> bool:
    """Whether MLX's CUDA back-end is there: fixed for the process, so asked once."""
    return bool(mx.cuda.is_available())


@functools.lru_cache(maxsize=16)
def _meta_array(n_tokens: int, capacity: int, part_size: int) -> mx.array:
    """``[n_tokens, capacity, part_size]``: one array per step, shared by its layers."""
    return mx.array([n_tokens, capacity, part_size], dtype=mx.int32)


@functools.lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    """``[scale]`` as a float32 array: one per model, not one per call."""
    return mx.array([scale], dtype=mx.float32)
