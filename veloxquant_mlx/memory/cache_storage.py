"""What a pool-backed KV cache asks of its store, and how its attention reads the store.

Users: :class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` and
:func:`~veloxquant_mlx.memory.prompt_cache.make_pool_backed_cache`; a port of
the store to another backend implements the protocols it wants served.

- :class:`MLXStorage`: the backing-store protocol for ``mx.array`` slabs.
- :class:`GathersHeadMajor` (optional): gathers straight into attention layout.
- :class:`ServesBlockTables` (optional): the decode path through a
  :class:`~veloxquant_mlx.memory.block_table.DeviceBlockTable`: O(1) liveness
  per call, and attention read in place.
- :func:`resolve_attention`: which attention path (``"gather"`` or
  ``"fused"``) a cache over a store takes.

Complexity: ``resolve_attention`` O(1) (a protocol check). Thread safety:
stateless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, Protocol, runtime_checkable

import mlx.core as mx

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.block_table import DeviceBlockTable
from veloxquant_mlx.memory.paged_attention import cuda_unavailable_reason
from veloxquant_mlx.memory.storage import BlockStorage

__all__ = [
    "AUTO_PREFERS_FUSED",
    "AttentionMode",
    "GathersHeadMajor",
    "MLXStorage",
    "ServesBlockTables",
    "resolve_attention",
]

#: Whether ``attention="auto"`` takes the fused kernel where it can run. False: on
#: the H200 the kernel is 2-5x faster than gather + attention per call, but a decode
#: step through it was slower end to end (0.62-0.76x ``KVCache`` against 0.80-0.98x
#: gathered; ``benchmarks/RESULTS.md``, "The fused paged-attention kernel"; measured
#: before the gathered path read a request whose ids run on by slices, which made it
#: faster still): below 32K the kernel takes more device time than MLX's attention,
#: and the unused read is still built on the host.
AUTO_PREFERS_FUSED: Final = False

#: How a cache's attention reads its keys and values: ``"gather"`` (``update_and_fetch``
#: returns them, as slices of the slab or as gathered copies, and mlx-lm's attention
#: reads them), ``"fused"`` (decode attention
#: reads them in place through the block table; prefill still gathers), ``"auto"``
#: (:func:`resolve_attention` picks).
AttentionMode = Literal["auto", "fused", "gather"]
_MODES: Final = ("auto", "fused", "gather")


class MLXStorage(BlockStorage[mx.array], Protocol):
    """A block store of ``mx.array`` slabs that names its element type."""

    @property
    def dtype(self) -> mx.Dtype:
        """Element type of the stored slots."""
        ...


@runtime_checkable
class GathersHeadMajor(Protocol):
    """A store that can gather straight into the layout attention reads (optional).

    ``BlockStorage.gather`` returns ``(n_tokens, heads, head_dim)``, which the
    cache must transpose and copy into ``(heads, n_tokens, head_dim)`` every
    step; a store that keeps its slabs head-major can return that layout from
    a single ``take``, and the cache then uses it instead.
    """

    def gather_heads(self, layer: int, blocks: Sequence[Block], n_tokens: int) -> mx.array:
        """The first ``n_tokens`` slots of ``blocks`` in ``layer`` as ``(heads, n_tokens,
        head_dim)``; never changed by later writes."""
        ...


@runtime_checkable
class ServesBlockTables(Protocol):
    """A store with the decode path through a :class:`DeviceBlockTable` (optional).

    The cache then checks its blocks once per table change instead of once per
    block per call, and can attend in place. ``MLXBlockStorage`` has it.
    """

    def update_through_table(
        self, layer: int, table: DeviceBlockTable, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Store ``(1, heads, n, head_dim)`` keys and values at positions ``start ..``;
        return positions ``0 .. start + n - 1`` as :meth:`fetch_through_table` does."""
        ...

    def fetch_through_table(
        self, layer: int, table: DeviceBlockTable, n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``0 .. n_tokens - 1``, ``(1, heads, n, head_dim)``."""
        ...

    def attend_through_table(
        self, layer: int, table: DeviceBlockTable, n_tokens: int, queries: mx.array, scale: float
    ) -> mx.array:
        """Decode attention of ``queries`` over positions ``0 .. n_tokens - 1``, in place."""
        ...


def resolve_attention(
    storage: object, attention: AttentionMode = "auto"
) -> Literal["fused", "gather"]:
    """The attention mode a cache over ``storage`` uses: ``"fused"`` or ``"gather"``.

    ``"auto"`` is ``"fused"`` where the fused CUDA kernel can run (MLX's CUDA
    back-end, the GPU as default device) and the store serves block tables,
    while ``AUTO_PREFERS_FUSED`` says the kernel is the faster path (measured:
    ``benchmarks/RESULTS.md``); ``"gather"`` otherwise, and always on the CPU.
    ``"fused"`` on another back-end reads through the table with the gathered
    reference (for tests).

    Raises:
        ValueError: ``attention`` is not one of ``"auto"``, ``"fused"``, ``"gather"``,
            or ``"fused"`` for a store without the table path.
    """
    if attention not in _MODES:
        raise ValueError(f"attention must be one of {_MODES}, got {attention!r}")
    serves_tables = isinstance(storage, ServesBlockTables)
    if attention == "fused" and not serves_tables:
        raise ValueError(
            f"attention='fused' needs a store with the block-table path (MLXBlockStorage), "
            f"got {type(storage).__name__}"
        )
    if attention == "auto":
        fused = AUTO_PREFERS_FUSED and serves_tables and cuda_unavailable_reason() is None
        return "fused" if fused else "gather"
    return "fused" if attention == "fused" else "gather"
