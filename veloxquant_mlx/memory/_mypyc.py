"""What the allocator's source needs so that one file builds both interpreted and with mypyc.

``block_pool.py`` and the modules it imports run as plain Python (the editable
install, any machine without a C compiler) or compiled by mypyc (``pip install
.``). Two mypyc rules would otherwise change what a caller sees:

- mypyc checks and converts an argument typed ``int``, ``str``, ``list`` or a
  native class where the call enters compiled code: ``True`` arrives as the int
  ``1``, and ``1.5`` is refused with mypyc's own ``TypeError`` message, before the
  method's own checks (and the contract's errors) run. :data:`AsGiven` marks a
  value that comes from a caller and is checked by the code that receives it:
  a type checker reads ``AsGiven[int]`` as ``int``, mypyc passes and stores
  the object exactly as given.
- a class that mypyc cannot compile natively (an exception class deriving from
  ``RuntimeError``, or from two bases) must say so with
  ``@mypyc_attr(native_class=False)``. At run time :func:`mypyc_attr` is a no-op
  here, so the allocator needs no ``mypy_extensions`` installed; mypyc reads the
  decorator while compiling.

Complexity and thread safety: declarations only; nothing here runs per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Never, TypeAlias, TypeVar

__all__ = ["AsGiven", "mypyc_attr"]

_T = TypeVar("_T")

#: ``AsGiven[int]`` is ``int`` to a type checker (``int | Never``), but mypyc
#: keeps the value boxed and unchecked, because ``Never`` maps to ``object``.
AsGiven: TypeAlias = _T | Never  # noqa: RUF020 (the point: mypyc reads Never as object)

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:

    def mypyc_attr(*_flags: str, **_attributes: object) -> Callable[[_T], _T]:
        """Run-time stand-in for ``mypy_extensions.mypyc_attr``: returns the class unchanged."""
        return lambda cls: cls
