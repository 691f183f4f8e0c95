"""A port of the reference API with deliberate deviations, for the conformance kit's tests.

:class:`DeviantPort` is ``tests/reference_port.py``'s ``MyPool`` with the
deviations of :data:`DEVIATIONS` planted, each of a different kind (config
validation, a counter, an error class's base, a default, bad input, a
refused call, the exposition text, a snapshot), one per contract rule. The
kit must list each once, under its rule.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from reference_port import (
    ERRORS_RAISED,
    BlockPoolError,
    BlockPoolExhaustedError,
    MyPool,
    OwnerAlreadyActiveError,
    PoolConfig,
)

from veloxquant_mlx.memory import block_pool as books


class DeviantConfig(PoolConfig):
    """Accepts ``block_size=True`` as 1 (C-CONFIG-TYPES)."""

    def __init__(self, block_size: Any = 16, *args: Any, **kwargs: Any) -> None:
        super().__init__(1 if block_size is True else block_size, *args, **kwargs)


class DeviantInvalidFreeError(BlockPoolError):
    """Not a ``ValueError`` (C-ERROR-CLASSES)."""


class _LiveStats:
    """The pool's running counters themselves, with HELP lines dropped from the text."""

    def __init__(self, counters: books.AllocationStats) -> None:
        self._counters = counters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._counters, name)

    def to_prometheus(self, prefix: str = "veloxquant_block_pool") -> str:
        text = self._counters.to_prometheus(prefix)
        return "".join(line for line in text.splitlines(True) if not line.startswith("# HELP"))


class DeviantPort(MyPool):
    """``MyPool`` with the deviations of :data:`DEVIATIONS` planted."""

    raised: ClassVar[dict[type[BaseException], type[BaseException]]] = {
        **ERRORS_RAISED,
        books.InvalidFreeError: DeviantInvalidFreeError,
    }

    def history_kept(self) -> int:
        return 100  # C-HISTORY: the default is 1024

    @property
    def stats(self) -> Any:
        return _LiveStats(self.books._stats)  # C-STATS-SNAPSHOT and C-PROMETHEUS

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Any]:
        if owner is True:  # C-INT-NOT-BOOL
            owner = 1
        return super().allocate(stream, n_tokens, owner, format)

    def free(self, blocks: Any) -> None:
        super().free(blocks)
        with self.books._lock:  # C-COUNTERS-NFREES: one per block, not one per call
            self.books._stats.n_frees += max(0, len(blocks) - 1)

    def mark_used(self, block: object, n_used: int) -> None:
        valid = type(n_used) is int and 0 <= n_used <= self.config.block_size
        if valid and getattr(block, "owner", 0) is None:  # C-MARK-USED-FREE: refuses a freed block
            raise ValueError("mark_used needs a live block")
        super().mark_used(block, n_used)


#: The deviant port's error classes under the contract's names (``errors=`` for the kit).
DEVIANT_ERRORS: Final[dict[str, type[BaseException]]] = {
    "BlockPoolError": BlockPoolError,
    "BlockPoolExhaustedError": BlockPoolExhaustedError,
    "OwnerAlreadyActiveError": OwnerAlreadyActiveError,
    "InvalidFreeError": DeviantInvalidFreeError,
}

#: Each deviation planted, by the rule it breaks.
DEVIATIONS: Final = (
    "C-CONFIG-TYPES",
    "C-COUNTERS-NFREES",
    "C-ERROR-CLASSES",
    "C-HISTORY",
    "C-INT-NOT-BOOL",
    "C-MARK-USED-FREE",
    "C-PROMETHEUS",
    "C-STATS-SNAPSHOT",
)
