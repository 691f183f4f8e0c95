"""What a command's input makes it allocate, estimated before anything is allocated.

The commands refuse input whose estimate exceeds the machine's memory
(:func:`~veloxquant_mlx.commandline.bad_input.require_fits_in_memory`) and
print the estimate of a long run; the figures behind the estimates live
here, once, each measured on CPython 3.11 (x86-64 Linux):

- :data:`PROCESS_BYTES`: the interpreter with NumPy and MLX loaded; a
  smoke or nightly stress run peaks at 61-68 MB resident in all
  (``benchmarks/bench_command_memory.py``), so this covers everything a run
  holds besides what its input scales;
- a pool's books: :data:`POOL_BYTES_PER_BLOCK` per block id (``tracemalloc``:
  about 41 bytes per idle block, 130 more per checked-out one);
- a store's slabs: per layer, a capacity of up to twice the ids in use (the
  growth rule of ``next_capacity``) times one block's token slots;
- a stress run's recorded calls: :data:`EVENT_BYTES` per call held in a
  window (``tracemalloc``: about 373);
- a linearizability search: :func:`search_bytes` per configuration it holds
  (``tracemalloc``, searches cut by their budget on windows of 733 and 766
  calls: 3.2 to 3.8 KB with 80 block ids, 7.7 KB with 400; a search that
  ends sooner holds less per configuration, 1.4 KB on a 399-call window).

The estimates are upper bounds a little above those figures: they exist to
refuse ``n_blocks=10**12`` in one line instead of being killed for memory,
and to tell a user what a run may take, not to budget it to the byte.

Complexity: O(1). Thread safety: pure functions.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "EVENT_BYTES",
    "POOL_BYTES_PER_BLOCK",
    "PROCESS_BYTES",
    "REQUEST_BYTES",
    "STEP_BYTES",
    "pool_bytes",
    "search_bytes",
    "slab_bytes",
]

#: Resident bytes of a command's process before its input counts: Python, NumPy, MLX.
PROCESS_BYTES: Final = 72 * 2**20
#: Heap bytes of a pool's books per block id, every block checked out (rounded up).
POOL_BYTES_PER_BLOCK: Final = 200
#: Heap bytes of one simulated request (measured: about 195 with tracemalloc).
REQUEST_BYTES: Final = 256
#: Heap bytes the simulator's metrics keep per step (five samples, boxed numbers).
STEP_BYTES: Final = 200
#: Heap bytes of one recorded call of a stress run, held until its window is checked.
EVENT_BYTES: Final = 500
#: Heap bytes of one search configuration besides its state's ids and its window's calls.
_CONFIGURATION_BYTES: Final = 2_000
#: Bytes a configuration's spec state adds per block id (its free lists and books).
_CONFIGURATION_BYTES_PER_ID: Final = 16


def pool_bytes(n_ids: int) -> int:
    """Bytes of a pool's books for ``n_ids`` block ids."""
    return POOL_BYTES_PER_BLOCK * max(n_ids, 0)


def slab_bytes(
    *, n_layers: int, n_ids: int, block_size: int, slot_values: int, itemsize: int
) -> int:
    """Bytes of a store's slabs covering ``n_ids`` ids: up to twice that capacity, per layer.

    Args:
        n_layers: Slabs, one per layer.
        n_ids: The most ids the pool issues.
        block_size: Token slots per block.
        slot_values: Values per token slot (``n_kv_heads * head_dim``).
        itemsize: Bytes per value.
    """
    return n_layers * 2 * max(n_ids, 0) * block_size * slot_values * itemsize


def search_bytes(configurations: int, *, n_ids: int, window_calls: int) -> int:
    """Bytes a linearizability search holds with ``configurations`` configurations.

    Args:
        configurations: The most it expands (its budget).
        n_ids: The most block ids of the pool (each state holds its books).
        window_calls: Calls in the window searched (each configuration's
            bitmask and witness grow with it).
    """
    per_configuration = (
        _CONFIGURATION_BYTES + _CONFIGURATION_BYTES_PER_ID * max(n_ids, 0) + max(window_calls, 0)
    )
    return configurations * per_configuration
