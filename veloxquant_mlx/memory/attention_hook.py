"""Routes an mlx-lm model's decode attention to caches that attend in place.

Why a hook at all: an mlx-lm attention layer calls
``keys, values = cache.update_and_fetch(keys, values)`` and then
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=...,
mask=...)``, the function of ``mlx_lm.models.base`` that each model module
imports by name (``from .base import scaled_dot_product_attention``; about a
hundred modules do). The cache therefore never sees the queries, and the
fused paged-attention kernel needs them. ``update_and_fetch`` cannot be the
hook: it must return ``(keys, values)`` arrays. The narrowest place that sees
queries *and* the cache is that function, so :func:`install_paged_attention`
replaces the module-level name ``scaled_dot_product_attention`` in the
modules that define the model's layers with a dispatcher:

- if the cache has ``attend_rows(queries, scale, mask)`` (the
  :class:`AttendsRows` protocol; a batch of pool-backed requests,
  :mod:`~veloxquant_mlx.memory.batch_cache`) and there are no attention sinks,
  the cache's answer is returned, unless it answers ``None``;
- if the cache has ``attend_in_place(queries, scale)`` (the
  :class:`AttendsInPlace` protocol; ``PoolBackedKVCache`` in fused mode), the
  mask is ``None`` (one query position, mlx-lm's decode step) and there are
  no attention sinks, the cache's answer is returned, unless it answers
  ``None`` (it cannot serve that call);
- everything else goes to the function the module had, unchanged.

So the replacement changes nothing for any other cache (``KVCache``,
quantized, rotating) or for prefill; it is idempotent, and
:func:`uninstall_paged_attention` restores the originals. The keys and
values that ``update_and_fetch`` returned are still built (lazily) but, on
the fused path, never evaluated: MLX computes only what the output needs.
Only the module's own binding to mlx-lm's ``base.scaled_dot_product_attention``
is replaced; a module that binds another function is left alone.

Complexity: install and uninstall O(modules of the model); the dispatcher
O(1) per call on top of the attention it routes to. Thread safety: install
and uninstall rebind module globals and belong to set-up code, not to a
running decode; the dispatcher itself is stateless.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final, Protocol, runtime_checkable

import mlx.core as mx

__all__ = [
    "AttendsInPlace",
    "AttendsRows",
    "install_paged_attention",
    "uninstall_paged_attention",
]

#: The name mlx-lm's model modules call attention by.
_NAME: Final = "scaled_dot_product_attention"
#: Marks a dispatcher and keeps the function it replaced.
_REPLACED: Final = "__veloxquant_replaced__"

_Attention = Callable[..., mx.array]


@runtime_checkable
class AttendsInPlace(Protocol):
    """A cache that computes decode attention itself, from keys and values it holds."""

    def attend_in_place(self, queries: mx.array, scale: float) -> mx.array | None:
        """Attention of ``queries`` (``(1, n_q_heads, 1, head_dim)``) over every held
        position, or ``None`` if this cache cannot serve the call (the caller then
        uses the keys and values ``update_and_fetch`` returned)."""
        ...


@runtime_checkable
class AttendsRows(Protocol):
    """A batch of caches that computes attention row by row over each row's own positions."""

    def attend_rows(self, queries: mx.array, scale: float, mask: object) -> mx.array | None:
        """Attention of ``queries`` (``(B, n_q_heads, n, head_dim)``), or ``None`` if this
        batch cannot serve the call with ``mask`` (the caller then uses the keys and
        values ``update_and_fetch`` returned, with ``mask``)."""
        ...


def install_paged_attention(model: object) -> int:
    """Route ``model``'s decode attention through caches that attend in place.

    Returns:
        How many modules were rebound by this call (0 when already installed, or
        when no module of the model calls mlx-lm's attention function by name).

    Raises:
        TypeError: ``model`` has no ``modules()`` (not an ``mlx.nn.Module``).
    """
    original = _mlx_lm_attention()
    rebound = 0
    for module in _model_modules(model):
        current = getattr(module, _NAME, None)
        if current is original:
            setattr(module, _NAME, _dispatcher(original))
            rebound += 1
    return rebound


def uninstall_paged_attention(model: object) -> int:
    """Undo :func:`install_paged_attention` in ``model``'s modules.

    Returns:
        How many modules got their original function back.
    """
    restored = 0
    for module in _model_modules(model):
        current = getattr(module, _NAME, None)
        replaced = getattr(current, _REPLACED, None)
        if replaced is not None:
            setattr(module, _NAME, replaced)
            restored += 1
    return restored


def _dispatcher(original: _Attention) -> _Attention:
    def scaled_dot_product_attention(  # noqa: PLR0917 (mlx-lm's signature, called so)
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: object,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        attend_rows = getattr(cache, "attend_rows", None)
        if attend_rows is not None and sinks is None:
            by_rows: mx.array | None = attend_rows(queries, scale, mask)
            if by_rows is not None:
                return by_rows
        attend = getattr(cache, "attend_in_place", None)
        if attend is not None and mask is None and sinks is None:
            attended: mx.array | None = attend(queries, scale)
            if attended is not None:
                return attended
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _REPLACED, original)
    return scaled_dot_product_attention


def _mlx_lm_attention() -> _Attention:
    # mlx-lm is needed only here, by callers that hold an mlx-lm model.
    from mlx_lm.models import base  # noqa: PLC0415

    function: _Attention = base.scaled_dot_product_attention
    return function


def _model_modules(model: object) -> list[ModuleType]:
    """The Python modules that define ``model``'s classes and its submodules' classes."""
    modules_of = getattr(model, "modules", None)
    if not callable(modules_of):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    names = {type(model).__module__} | {type(part).__module__ for part in modules_of()}
    return [sys.modules[name] for name in sorted(names) if name in sys.modules]
