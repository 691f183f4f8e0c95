"""Executable spec of `veloxquant_mlx.memory.block_pool`: a pure, sequential model.

It encodes the contract (`docs/CONTRACT.md`, rules `C-...`) as immutable
states and stats views (`model`), one transition per public operation
(`transitions`), and named invariants (`invariants`). It predicts exact
block ids, handle staleness, counters, fragmentation and history; a
conformance harness runs the implementation beside it and maps the n-th
`Block` object handed out to `HandleId` n. No locks, no optimisation, no
MLX: a reader checks it against the contract.
"""

from veloxquant_mlx_spec import invariants, model, transitions

__all__ = ["invariants", "model", "transitions"]
