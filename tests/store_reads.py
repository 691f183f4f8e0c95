"""Which way a test's reads of an MLX store went: by slices or by a take.

Shared by the tests that check when a request is read by slices.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.memory import block_gather


def recording_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each read of the store as ``"slices"`` or ``"take"`` (in call order)."""
    reads: list[str] = []
    by_slices, by_take = block_gather.read_by_slices, block_gather.gather_by_take

    def slicing(
        slab: mx.array, run_rows: tuple[int, int], n_tokens: int
    ) -> tuple[mx.array, mx.array]:
        reads.append("slices")
        return by_slices(slab, run_rows, n_tokens)

    def taking(
        slab: mx.array, read_blocks: mx.array, n_tokens: int, **sizes: int
    ) -> tuple[mx.array, mx.array]:
        reads.append("take")
        return by_take(slab, read_blocks, n_tokens, **sizes)

    monkeypatch.setattr(block_gather, "read_by_slices", slicing)
    monkeypatch.setattr(block_gather, "gather_by_take", taking)
    return reads
