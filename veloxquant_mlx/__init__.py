"""veloxquant_mlx: a formally checked paged KV-cache block allocator for MLX.

The allocator (``veloxquant_mlx.memory.block_pool``) is pure Python and
imports without MLX; the MLX-backed storage and caches load lazily.
"""

__version__ = "0.1.0"
