"""Argument checks shared by the block pool's public methods.

Every public entry point of :mod:`veloxquant_mlx.memory.block_pool` validates
its arguments with these helpers *before* it touches any state, so that bad
input raises a clear error and leaves the pool exactly as it was.

The messages follow one pattern: the name of the argument, what was
expected, and the value actually received (``n_tokens must be an int > 0,
got 0``).

Complexity: every helper is O(1). Thread safety: pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Mapping


def require_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) that is at least ``minimum``.

    Args:
        name: The argument's name, for the error message.
        value: What the caller passed.
        minimum: The smallest accepted value, or ``None`` for no bound.

    Returns:
        ``value``, narrowed to ``int``.

    Raises:
        TypeError: ``value`` is not an ``int``, or is a ``bool``.
        ValueError: ``value`` is below ``minimum``.

    raises: TypeError, ValueError
    post: __return__ is value and not isinstance(__return__, bool)
    post: minimum is None or __return__ >= minimum
    """
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def require_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``; raise ``TypeError`` otherwise.

    raises: TypeError
    post: __return__ is value and isinstance(__return__, bool)
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def require_format(value: object) -> str:
    """Return ``value`` if it is a non-empty ``str`` (a compression-format tag).

    Raises:
        TypeError: ``value`` is not a ``str``.
        ValueError: ``value`` is the empty string.

    raises: TypeError, ValueError
    post: __return__ is value and isinstance(__return__, str) and __return__ != ""
    """
    if not isinstance(value, str):
        raise TypeError(f"format must be a non-empty str, got {value!r} ({type(value).__name__})")
    if not value:
        raise ValueError("format must be a non-empty str, got ''")
    return value


def resolve_stream(stream: object, free_list_names: Mapping[str, str]) -> str:
    """Map a caller's stream name to the name of the free list that serves it.

    Args:
        stream: What the caller passed as ``stream``.
        free_list_names: Accepted stream names, each mapped to its free list
            (``{"k": "k", "v": "v"}`` or ``{"k": "kv", "v": "kv", "kv": "kv"}``).

    Returns:
        The free list's name.

    Raises:
        ValueError: ``stream`` is not one of the accepted names (of any type).

    raises: ValueError
    post: isinstance(stream, str) and __return__ == free_list_names[stream]
    """
    if isinstance(stream, str):
        resolved = free_list_names.get(stream)
        if resolved is not None:
            return resolved
    accepted = ", ".join(repr(name) for name in free_list_names)
    raise ValueError(f"stream must be one of {accepted}, got {stream!r}")
