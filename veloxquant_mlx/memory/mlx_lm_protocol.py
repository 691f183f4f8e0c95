"""mlx-lm's cache conventions that a pool-backed cache speaks: masks, state, saved files.

:class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` stands in for
mlx-lm's ``KVCache``; this module holds what it must agree with mlx-lm on,
outside the cache itself:

- the attention mask a cache makes (``causal_mask``, as mlx-lm's
  ``create_causal_mask``);
- the ``state`` tuple, ``(keys, values, offset)`` as ``KVCache`` has it
  (``split_state`` also takes ``(keys, values)`` and an empty cache's
  ``(None, None, 0)``);
- saved prompt caches. ``save_prompt_cache`` writes each cache's ``state``
  and class name; ``load_prompt_cache`` looks that name up in the globals of
  ``mlx_lm.models.cache`` and calls ``from_state``. ``register_for_loading``
  adds the pool-backed class's name there (the one name mlx-lm does not
  define; never one it does): importing ``veloxquant_mlx.memory.kv_cache``
  does it whenever mlx-lm is installed, so a loader must import that module
  first. A store is not saved, so the file loads as plain ``KVCache``
  layers holding the same positions (``kv_cache_from_state``), which decode
  on exactly as the saved cache would; ``PoolBackedPromptCache.copy_from``
  pages them into a pool again.
- ``generate_step(..., kv_bits=...)`` calls ``to_quantized()`` on each cache
  once it holds ``quantized_kv_start`` positions (5000 by default, so a
  short generation never asks). A pool-backed cache raises ``ValueError``
  there rather than stay silently unquantized: mlx-lm's ``QuantizedKVCache``
  would hold the keys outside the pool and its accounting.

mlx-lm is optional: only ``kv_cache_from_state`` and ``register_for_loading``
import it, lazily. Complexity: ``causal_mask`` O(n_queries * (offset +
n_queries)); ``split_state`` O(1); ``kv_cache_from_state`` O(positions).
Thread safety: pure functions, except that ``register_for_loading`` adds a
name to mlx-lm's module once (idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

__all__ = ["MaskT", "causal_mask", "kv_cache_from_state", "register_for_loading", "split_state"]

#: mlx-lm's mask for N queries at ``offset``; a str ("causal"), an array or None.
MaskT = mx.array | str | None


def causal_mask(n_queries: int, offset: int, window_size: int | None = None) -> mx.array:
    """mlx-lm's ``create_causal_mask``: query ``i`` (at ``offset + i``) sees keys ``<= offset + i``.

    With ``window_size`` it sees only the last ``window_size`` of them. Shape
    ``(n_queries, offset + n_queries)``, boolean.
    """
    keys = mx.arange(offset + n_queries)[None]
    queries = mx.arange(offset, offset + n_queries)[:, None]
    mask = queries >= keys
    if window_size is not None:
        mask = mask & (queries < keys + window_size)
    return mask


def split_state(state: object) -> tuple[mx.array, mx.array, int]:
    """``(keys, values[, offset])`` as arrays and an offset (their length if absent).

    ``(None, None[, 0])``, an empty mlx-lm ``KVCache``'s state, means no positions.
    """
    if not isinstance(state, Sequence) or len(state) not in (2, 3):
        raise ValueError(f"state must be (keys, values) or (keys, values, offset), got {state!r}")
    keys, values = state[0], state[1]
    if keys is None and values is None:
        empty = mx.zeros((1, 0, 0, 0))
        return empty, empty, 0
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise TypeError(
            f"state's keys and values must be mlx arrays, got {type(keys).__name__} "
            f"and {type(values).__name__}"
        )
    length = keys.shape[2] if keys.ndim == 4 else 0
    offset = state[2] if len(state) == 3 else length
    if type(offset) is not int or not 0 <= offset <= length:
        raise ValueError(f"state's offset must be an int in 0..{length}, got {offset!r}")
    return keys, values, offset


def kv_cache_from_state(state: object) -> KVCache:
    """An mlx-lm ``KVCache`` holding the positions of ``state`` (``split_state``'s forms).

    Raises:
        TypeError, ValueError: As :func:`split_state`.
    """
    from mlx_lm.models.cache import KVCache  # noqa: PLC0415

    keys, values, offset = split_state(state)
    cache = KVCache()  # type: ignore[no-untyped-call]
    if offset:
        cache.update_and_fetch(keys[..., :offset, :], values[..., :offset, :])  # type: ignore[no-untyped-call]
    return cache


def register_for_loading(cache_type: type) -> None:
    """Let ``load_prompt_cache`` find ``cache_type`` by the name ``save_prompt_cache`` wrote.

    Adds ``cache_type.__name__`` to the globals of ``mlx_lm.models.cache``
    unless mlx-lm defines that name itself; does nothing without mlx-lm.
    """
    try:
        from mlx_lm.models import cache as mlx_lm_cache  # noqa: PLC0415
    except ImportError:  # mlx-lm is optional: then there is nothing to load with
        return
    vars(mlx_lm_cache).setdefault(cache_type.__name__, cache_type)
