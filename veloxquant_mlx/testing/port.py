"""What a port hands the conformance kit: its factory, its own classes, the calls it offers.

The factory contract (docs/CONFORMANCE_KIT.md) is forgiving, so that a port of
the reference API needs no wrapper:

- The factory gets a **config**: by default the port's ``PoolConfig``
  built from five keyword arguments (``config_class``; ours when the port
  gives none), or, with ``config_class=None``, the five plain values as
  keyword arguments (``block_size=..., n_blocks=..., ...``).
- ``history_len`` is **optional**: it is passed (as a keyword) only when the
  factory's signature takes it (a parameter of that name, or ``**kwargs``).
  A factory that does not take it is checked at the default length the
  contract fixes, 1024 (C-HISTORY), and only there.
- The port's own classes: ``block_class(block_id)`` builds a block by hand
  (what ``ForeignBlock(None)`` stands for); ``errors`` maps each contract
  error name (``"InvalidFreeError"``...) to the port's class, or is the
  module that defines them under those names. By default the names are
  looked up in the module that defines the pool's class.

:class:`Port` is immutable; :meth:`Port.allocator_factory` adapts it to what
:class:`~veloxquant_mlx.testing.lockstep.Lockstep` calls. Complexity: one
signature inspection per port. Thread safety: immutable.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType, ModuleType
from typing import Any, Final

from veloxquant_mlx.memory.block_pool import Block, PoolConfig
from veloxquant_mlx_spec.model import SpecConfig
from veloxquant_mlx_spec.operations import BlockPool, CheckedBlockPool
from veloxquant_mlx_spec.table import declarations

__all__ = [
    "ALL_CALLS",
    "CONFIG_DEFAULTS",
    "CONFIG_FIELDS",
    "DEFAULT_HISTORY_LEN",
    "ERROR_NAMES",
    "REFERENCE_CALLS",
    "Port",
    "as_port",
    "factory_from_text",
    "port_argument",
]

#: Every call of the table: what our allocator offers.
ALL_CALLS: Final = frozenset(d.name for d in declarations())
#: The reference's and the contract's calls (docs/API.md **R** and **C**): what any port offers.
REFERENCE_CALLS: Final = frozenset(d.name for d in declarations() if d.source != "P")
#: The config's fields, in the reference's order (docs/API.md, PoolConfig).
CONFIG_FIELDS: Final = ("block_size", "n_blocks", "separate_kv", "grow_on_exhaustion", "max_blocks")
#: Their defaults in the reference, as the spec states them.
CONFIG_DEFAULTS: Final[Mapping[str, object]] = MappingProxyType(asdict(SpecConfig()))
#: The history length a pool keeps when it is not told one (C-HISTORY).
DEFAULT_HISTORY_LEN: Final = 1024
#: The error classes of docs/CONTRACT.md C-ERROR-CLASSES, base first.
ERROR_NAMES: Final = (
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "OwnerAlreadyActiveError",
    "InvalidFreeError",
)

#: What ``config_class`` is by default: our ``PoolConfig`` (a sentinel, so ``None`` can mean
#: "plain values").
_OURS: Final = PoolConfig


def _takes_history_len(factory: Callable[..., object]) -> bool | None:
    """Whether ``factory`` takes ``history_len``: optionally, by name or ``**kwargs`` (True),
    always, by name or as its second parameter (None), or not at all (False)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a compiled class without a signature: config only
        return False
    parameters = list(signature.parameters.values())
    named = [p for p in parameters if p.name == "history_len"]
    if named and named[0].default is inspect.Parameter.empty:
        return None  # required: always passed (the default when none is asked for)
    if named or any(p.kind is p.VAR_KEYWORD for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return False


@dataclass(frozen=True)
class Port:
    """A pool under test, as the kit builds and reads it.

    Invariant: ``factory`` is called only through :meth:`build`, which passes
    ``history_len`` only if the factory takes it (``history_lens`` says which
    lengths can then be checked).

    Attributes:
        factory: Makes a pool from a config (see the module docstring).
        config_class: Builds the port's config from the five fields as keywords;
            ``None``: the factory takes the five plain values itself.
        block_class: Builds a block by hand from a block id (the port's ``Block``).
        errors: Contract error name -> the port's class, or the module holding them.
        capabilities: The calls the pool offers (names in the table); ``None``: the
            reference's and the contract's, and the project's additions if a pool
            is a ``CheckedBlockPool`` (one pool is built to see).
        name: How reports call the factory (default: its ``__name__``).
    """

    factory: Callable[..., Any]
    config_class: Callable[..., object] | None = _OURS
    block_class: Callable[[int], object] = Block
    errors: Mapping[str, type[BaseException]] | ModuleType | None = None
    capabilities: frozenset[str] | None = None  # None: what its pools declare
    name: str = ""
    _history: bool | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_history", _takes_history_len(self.factory))
        if self.capabilities is None:
            object.__setattr__(self, "capabilities", self._declared_capabilities())
        unknown = set(self.offered) - ALL_CALLS
        if unknown:
            raise ValueError(
                f"capabilities must be names of the operation table, got {sorted(unknown)}"
            )
        missing = REFERENCE_CALLS - self.offered
        if missing:  # a port checked on fewer calls would pass without them
            raise ValueError(
                "capabilities must include every call of the reference and the contract "
                f"(docs/API.md, R and C), missing {sorted(missing)}"
            )
        if not self.name:
            given = getattr(self.factory, "__name__", "")
            object.__setattr__(self, "name", given if given.isidentifier() else "make_pool")

    @property
    def takes_history_len(self) -> bool:
        """Whether the factory is told a history length (else it keeps its default)."""
        return self._history is not False

    @property
    def history_lens(self) -> tuple[int, ...]:
        """The history lengths the kit may build pools with."""
        return (0, 1, 3, DEFAULT_HISTORY_LEN) if self.takes_history_len else (DEFAULT_HISTORY_LEN,)

    def make_config(self, **fields: object) -> object:
        """The port's config for these fields (raises what the port's class raises)."""
        if self.config_class is None:
            return dict(fields)
        return self.config_class(**fields)

    def build(self, config: object, history_len: int | None = None) -> BlockPool[Any]:
        """A pool for ``config`` (a :class:`PoolConfig` or any object with its five fields).

        Args:
            config: The fields of the pool; converted to the port's config.
            history_len: Passed if the factory takes it; ``None``: the factory's default.

        Raises:
            ValueError: A length other than the default, for a factory that takes none.
        """
        values = {name: getattr(config, name) for name in CONFIG_FIELDS}
        unsupported = history_len not in (None, DEFAULT_HISTORY_LEN)
        if unsupported and not self.takes_history_len:
            raise ValueError(
                f"{self.name} takes no history_len, so only the default "
                f"{DEFAULT_HISTORY_LEN} can be checked, got {history_len}"
            )
        made = None if self.config_class is None else self.make_config(**values)
        if self._history is None:  # (config, history_len): always given
            length = DEFAULT_HISTORY_LEN if history_len is None else history_len
            return self.factory(values if made is None else made, length)  # type: ignore[no-any-return]
        keywords: dict[str, object] = {}
        if self._history and history_len is not None:
            keywords["history_len"] = history_len
        if made is None:
            return self.factory(**values, **keywords)  # type: ignore[no-any-return]
        return self.factory(made, **keywords)  # type: ignore[no-any-return]

    def allocator_factory(self) -> Callable[[PoolConfig, int], BlockPool[Any]]:
        """``(PoolConfig, history_len) -> pool``: what ``Lockstep`` calls."""
        return self.build

    def history_len_for(self, wanted: int) -> int:
        """``wanted``, or the default for a factory that takes no ``history_len``."""
        return wanted if self.takes_history_len else DEFAULT_HISTORY_LEN

    @property
    def offered(self) -> frozenset[str]:
        """The calls the pool offers (names in the table)."""
        assert self.capabilities is not None, "set in __post_init__"
        return self.capabilities

    def _declared_capabilities(self) -> frozenset[str]:
        """The reference's and the contract's calls, and the project's additions if a pool
        is a ``CheckedBlockPool``."""
        try:
            pool = self.build(PoolConfig(block_size=2, n_blocks=2))
            # The protocol check reads the pool's attributes (stats): a port's may raise.
            checked = isinstance(pool, CheckedBlockPool)
        except Exception:  # the checks report a factory that fails; offer the reference's
            return REFERENCE_CALLS
        return ALL_CALLS if checked else REFERENCE_CALLS

    def error_classes(self, pool: object) -> dict[str, type[BaseException] | None]:
        """The port's class for each contract error name (``None``: it has none by that name)."""
        source: object = self.errors
        if source is None:
            source = sys.modules.get(type(pool).__module__)
        found: dict[str, type[BaseException] | None] = {}
        for name in ERROR_NAMES:
            value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
            found[name] = value if isinstance(value, type) else None
        return found

    def error_names(self, pool: object) -> dict[type[BaseException], str]:
        """The contract name of each of the port's error classes (for comparing outcomes)."""
        return {cls: name for name, cls in self.error_classes(pool).items() if cls is not None}


def factory_from_text(text: str) -> Port:
    """The port named ``module:callable`` (the module is imported; ``.`` is on the path).

    The name may also be a :class:`Port` the module builds, for a port with its own
    ``Block`` or config class, or error classes elsewhere (the factory contract).

    Raises:
        ValueError: The text is not of that form, its module cannot be imported (or
            raises while it is), or it names neither a ``Port`` nor anything callable.
    """
    module_name, colon, attribute = text.partition(":")
    if not (colon and module_name and attribute):
        raise ValueError(f"expected module:callable, got {text!r}")
    if os.getcwd() not in sys.path:  # a port's own module, run from its directory
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except Exception as error:  # importing runs the module: a SyntaxError, a NameError...
        raise ValueError(
            f"cannot import {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, Port):
        return target
    if not callable(target):
        raise ValueError(f"{text!r} is neither a Port nor callable")
    return as_port(target)


def port_argument(text: str) -> Port:
    """:func:`factory_from_text` as an argparse ``type``: a command's ``--factory`` option.

    Raises:
        argparse.ArgumentTypeError: What :func:`factory_from_text` refused, in one line.
    """
    try:
        return factory_from_text(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def as_port(
    factory: Port | Callable[..., Any],
    *,
    capabilities: Iterable[str] | None = None,
    **classes: Any,
) -> Port:
    """``factory`` as a :class:`Port` (a port is returned as it is, unless told more).

    Args:
        factory: A port, or a factory (module docstring).
        capabilities: The calls the pool offers (default: what its pools declare).
        classes: ``config_class``, ``block_class``, ``errors``, ``name`` (see :class:`Port`).
    """
    if capabilities is not None:
        classes["capabilities"] = frozenset(capabilities)
    if isinstance(factory, Port):
        return replace(factory, **classes) if classes else factory
    return Port(factory, **classes)
