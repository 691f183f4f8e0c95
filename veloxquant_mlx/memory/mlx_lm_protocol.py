"""mlx-lm's cache conventions that a pool-backed cache speaks: masks, state, saved files, kv_bits.

:class:`~veloxquant_mlx.memory.kv_cache.PoolBackedKVCache` stands in for
mlx-lm's ``KVCache``; this module holds what it must agree with mlx-lm on,
outside the cache itself:

- the attention mask a cache makes (``causal_mask``, as mlx-lm's
  ``create_causal_mask``);
- the ``state`` tuple, ``(keys, values, offset)`` as ``KVCache`` has it
  (``split_state`` also takes ``(keys, values)`` and an empty cache's
  ``(None, None, 0)``);
- saved prompt caches. ``save_prompt_cache`` writes each cache's ``state``
  and class name, and ``load_prompt_cache`` looks that name up in the
  globals of ``mlx_lm.models.cache``. A store is not saved, so
  ``save_kv_caches`` writes a pool-backed list as the ``KVCache`` layers that
  hold the same positions (``kv_cache_from_state``): the file loads with
  mlx-lm alone, in any process, and decodes on exactly as the saved cache
  would (``PoolBackedPromptCache.save`` and ``.load`` use it). A file that
  mlx-lm's ``save_prompt_cache`` wrote from a pool-backed list directly names
  ``PoolBackedKVCache``; only as a fallback for such files,
  ``register_for_loading`` adds that name (one mlx-lm does not define; never
  one it does) to ``mlx_lm.models.cache`` when ``kv_cache`` is imported, so
  they load in a process that imported it, as ``KVCache`` layers too.
- ``generate_step(..., kv_bits=...)``. mlx-lm asks each cache to quantize
  itself (``to_quantized``) once it holds ``quantized_kv_start`` positions
  (5000 by default), after probing ``hasattr(cache, "to_quantized")`` at
  every step. A pool-backed cache cannot: mlx-lm's ``QuantizedKVCache``
  would hold the keys outside the pool and its accounting. It refuses as
  early as it can: ``kv_bits_of_generation`` finds the ``kv_bits`` of the
  mlx-lm generator whose model call is running (the cache checks it at every
  update of more than one position, so at the prompt's first chunk, before
  any block is taken), and the cache's ``to_quantized`` raises as soon as
  mlx-lm looks it up (the first step) for any other caller.

:class:`KVCacheConventions` gathers the part of the cache protocol that
follows from ``offset`` and ``trim`` alone (masks, ``meta_state``, ``size``,
``empty``, ``from_state``, the ``to_quantized`` refusal), so the cache
class holds only its paged data path.

mlx-lm is optional: only ``kv_cache_from_state``, ``save_kv_caches`` and
``register_for_loading`` import it, lazily. Complexity: ``causal_mask``
O(n_queries * (offset + n_queries)); ``split_state`` O(1);
``kv_cache_from_state`` O(positions); ``kv_bits_of_generation`` O(stack
depth), at most ``_MAX_FRAMES`` frames. Thread safety: pure functions,
except that ``register_for_loading`` adds a name to mlx-lm's module once
(idempotent).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, NoReturn

import mlx.core as mx

from veloxquant_mlx.memory.mlx_storage import dtype_name

if TYPE_CHECKING:
    from mlx_lm.models.cache import KVCache

__all__ = [
    "KVCacheConventions",
    "MaskT",
    "causal_mask",
    "kv_bits_of_generation",
    "kv_bits_refusal",
    "kv_cache_from_state",
    "register_for_loading",
    "save_kv_caches",
    "split_state",
]

#: mlx-lm's generators that take ``kv_bits``: ``(module, function)`` names.
_QUANTIZING_GENERATORS: Final = frozenset(
    {("mlx_lm.generate", "generate_step"), ("mlx_lm.generate", "speculative_generate_step")}
)
#: How far up the stack a cache looks for them (a model call is a dozen frames deep).
_MAX_FRAMES: Final = 64

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


def _outline(state: object) -> str:
    """``state`` as a refusal names it: a sequence by its length and its items' types
    (the repr of a layer's arrays runs to pages), anything else by its repr and type."""
    if isinstance(state, Sequence):
        kinds = ", ".join(type(item).__name__ for item in state[:4])
        more = ", ..." if len(state) > 4 else ""
        items = "item" if len(state) == 1 else "items"
        return f"a {type(state).__name__} of {len(state)} {items} ({kinds}{more})"
    return f"{state!r} ({type(state).__name__})"


def split_state(state: object) -> tuple[mx.array, mx.array, int]:
    """``(keys, values[, offset])`` as arrays and an offset (their length if absent).

    ``(None, None[, 0])``, an empty mlx-lm ``KVCache``'s state, means no positions.

    Raises:
        TypeError: Keys or values are not MLX arrays, or the offset is not an int.
        ValueError: Not such a tuple, arrays that are not 4-D (a layer's
            ``(1, heads, n, head_dim)``), or an offset outside ``0 .. n``.
    """
    if not isinstance(state, Sequence) or len(state) not in (2, 3):
        raise ValueError(
            f"state must be (keys, values) or (keys, values, offset), got {_outline(state)}"
        )
    keys, values = state[0], state[1]
    if keys is None and values is None:
        empty = mx.zeros((1, 0, 0, 0))
        return empty, empty, 0
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise TypeError(
            f"state's keys and values must be mlx arrays, got {type(keys).__name__} "
            f"and {type(values).__name__}"
        )
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            "state's keys and values must be (1, heads, n, head_dim) arrays, got shapes "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    length = keys.shape[2]
    offset = state[2] if len(state) == 3 else length
    if type(offset) is not int:
        raise TypeError(f"state's offset must be an int, got {offset!r} ({type(offset).__name__})")
    if not 0 <= offset <= length:
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


def save_kv_caches(
    file_name: str, states: Sequence[object], metadata: dict[str, str] | None = None
) -> None:
    """Save ``states`` (one ``(keys, values, offset)`` per layer) with mlx-lm's
    ``save_prompt_cache``, as ``KVCache`` layers: a file mlx-lm alone loads.

    Raises:
        TypeError, ValueError: A state is not ``(keys, values[, offset])``; as
            ``save_prompt_cache`` for the file and the metadata.
    """
    from mlx_lm.models.cache import save_prompt_cache  # noqa: PLC0415

    caches = [kv_cache_from_state(state) for state in states]
    save_prompt_cache(file_name, caches, metadata)


def kv_bits_of_generation() -> int | None:
    """The ``kv_bits`` of the mlx-lm generator this call runs inside, if it asks for any.

    Looks up the calling stack (at most ``_MAX_FRAMES`` frames) for
    ``generate_step`` or ``speculative_generate_step`` of ``mlx_lm.generate``,
    and reads its ``kv_bits`` argument; ``None`` outside them or without it.
    """
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        code = frame.f_code
        if (frame.f_globals.get("__name__"), code.co_name) in _QUANTIZING_GENERATORS:
            bits = frame.f_locals.get("kv_bits")
            return bits if isinstance(bits, int) else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def kv_bits_refusal(
    bits: object, dtype_name: str, cache_class: str = "PoolBackedKVCache"
) -> ValueError:
    """The error a pool-backed cache (of ``cache_class``) raises for ``kv_bits`` (``bits``
    if known)."""
    asked = f"kv_bits={bits}" if bits is not None else "kv_bits"
    return ValueError(
        f"{asked} cannot quantize a {cache_class}: its keys and values stay in the "
        f"pool's store as {dtype_name}; generate without kv_bits, or use mlx-lm's "
        "make_prompt_cache for a quantized cache"
    )


class KVCacheConventions:
    """mlx-lm's cache protocol, the part that follows from ``offset`` and ``trim``.

    A subclass provides ``offset`` (positions held), ``trim(n)`` and ``_dtype``
    (the dtype its keys are kept in); everything here is derived from those, as
    mlx-lm's ``KVCache`` derives it.
    """

    _dtype: mx.Dtype

    @property
    def offset(self) -> int:
        """Positions held; the rotary offset of the next token."""
        raise NotImplementedError

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions; return how many were dropped."""
        raise NotImplementedError

    def make_mask(
        self,
        N: int,  # noqa: N803 (mlx-lm's keyword)
        return_array: bool = False,
        window_size: int | None = None,
    ) -> MaskT:
        """The attention mask for ``N`` new queries, exactly as mlx-lm's ``KVCache`` makes it.

        ``None`` for one query, ``"causal"`` for several, a boolean ``(N, offset + N)``
        array when ``return_array`` or a ``window_size`` asks for one.
        """
        if window_size is None and not (return_array and N > 1):
            return None if N == 1 else "causal"
        return causal_mask(N, self.offset, window_size)

    @property
    def meta_state(self) -> tuple[str]:
        """The scalar part of the state, as strings: ``(str(offset),)``."""
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, meta_state: Sequence[str]) -> None:
        """Set the offset from ``(str(offset),)``: positions past it are dropped.

        Raises:
            ValueError: Not one decimal string, or an offset above the one held.
        """
        if len(meta_state) != 1 or not str(meta_state[0]).isdecimal():
            raise ValueError(f"meta_state must be (str(offset),), got {meta_state!r}")
        offset = int(meta_state[0])
        if offset > self.offset:
            raise ValueError(f"meta_state offset must be <= {self.offset} (held), got {offset}")
        self.trim(self.offset - offset)

    def size(self) -> int:
        """Positions held (mlx-lm's ``size()``)."""
        return self.offset

    def empty(self) -> bool:
        """Whether no position is held."""
        return self.offset == 0

    @property
    def to_quantized(self) -> Callable[..., NoReturn]:
        """Refused as soon as it is looked up: mlx-lm's ``generate_step(..., kv_bits=...)``
        probes ``hasattr(cache, "to_quantized")`` at every step and calls it once the
        cache holds ``quantized_kv_start`` positions; a pool-backed cache keeps its keys
        and values in the store, so it says so at the first probe, never silently
        staying unquantized. (``hasattr`` passes on any error but ``AttributeError``.)

        Raises:
            ValueError: Always, naming ``kv_bits`` and the store's dtype; nothing changes.
        """
        raise kv_bits_refusal(kv_bits_of_generation(), dtype_name(self._dtype))

    @classmethod
    def from_state(cls, state: Sequence[object], meta_state: object = None) -> KVCache:
        """An mlx-lm ``KVCache`` holding ``state``: what ``load_prompt_cache`` builds for a
        file that names this class (a store is not saved with it, so the file loads as
        plain ``KVCache`` layers; ``PoolBackedPromptCache.load`` pages it again).

        Raises:
            TypeError, ValueError: ``state`` is not ``(keys, values[, offset])``.
        """
        return kv_cache_from_state(state)
