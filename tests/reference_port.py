"""A port of the reference API as a backend author writes one, for the conformance kit's tests.

:class:`MyPool` has the reference's surface and nothing more: it is built as
``MyPool(config)`` (no ``history_len``), from this module's own
:class:`PoolConfig`, hands out this module's own :class:`Block` handles and
raises this module's own error classes, under the reference's names. Inside,
it keeps its books in our allocator, which makes it conform; what the tests
need is its surface. ``tests/deviant_port.py`` plants deviations in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Final

from veloxquant_mlx.memory import block_pool as books


class PoolConfig:
    """The port's own configuration class, validated as the reference's is."""

    def __init__(
        self,
        block_size: int = 16,
        n_blocks: int = 1024,
        separate_kv: bool = True,
        grow_on_exhaustion: bool = False,
        max_blocks: int | None = None,
    ) -> None:
        books.PoolConfig(block_size, n_blocks, separate_kv, grow_on_exhaustion, max_blocks)
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.separate_kv = separate_kv
        self.grow_on_exhaustion = grow_on_exhaustion
        self.max_blocks = max_blocks


class Block:
    """The port's own handle class: the reference's fields, read from the port's books."""

    def __init__(  # noqa: PLR0917 -- the reference's signature
        self,
        block_id: int,
        stream: str = "kv",
        format: str = "fp16",
        n_used: int = 0,
        owner: int | None = None,
        ever_allocated: bool = False,
    ) -> None:
        self.inner = books.Block(block_id, stream, format, n_used, owner, ever_allocated)

    @classmethod
    def around(cls, inner: books.Block) -> Block:
        block = cls.__new__(cls)
        block.inner = inner
        return block

    @property
    def block_id(self) -> int:
        return self.inner.block_id

    @property
    def stream(self) -> str:
        return self.inner.stream

    @property
    def format(self) -> str:
        return self.inner.format

    @property
    def n_used(self) -> int:
        return self.inner.n_used

    @property
    def owner(self) -> int | None:
        return self.inner.owner

    @property
    def ever_allocated(self) -> bool:
        return self.inner.ever_allocated


class BlockPoolError(RuntimeError):
    """The port's base error."""


class BlockPoolExhaustedError(BlockPoolError):
    """The port's exhaustion error."""


class OwnerAlreadyActiveError(BlockPoolError):
    """The port's owner-already-active error."""


class InvalidFreeError(BlockPoolError, ValueError):
    """The port's invalid-free error."""


#: The books' errors and the port's own, raised in their place.
ERRORS_RAISED: Final[dict[type[BaseException], type[BaseException]]] = {
    books.BlockPoolExhaustedError: BlockPoolExhaustedError,
    books.OwnerAlreadyActiveError: OwnerAlreadyActiveError,
    books.InvalidFreeError: InvalidFreeError,
}


class _PortErrors:
    """Re-raises the books' errors as the port's own classes."""

    def __init__(self, raised: dict[type[BaseException], type[BaseException]]) -> None:
        self.raised = raised

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: object, _: object) -> None:
        mapped = self.raised.get(kind) if kind is not None else None
        if mapped is not None:
            raise mapped(str(error)) from None


class MyPool:
    """A pool with the reference API: ``MyPool(config)``, this module's own classes."""

    #: The port's error for each of the books' (a deviant port raises others).
    raised: ClassVar[dict[type[BaseException], type[BaseException]]] = ERRORS_RAISED

    def __init__(self, config: Any = None) -> None:
        self.config = config or PoolConfig()
        c = self.config
        fields = (c.block_size, c.n_blocks, c.separate_kv, c.grow_on_exhaustion, c.max_blocks)
        self.books = books.BlockPoolAllocator(
            books.PoolConfig(*fields), history_len=self.history_kept()
        )
        self.handles: dict[int, Block] = {}  # id(inner block) -> the port's handle
        self.errors = _PortErrors(self.raised)

    def history_kept(self) -> int:
        return 1024

    def _wrap(self, inner: books.Block) -> Block:
        handle = self.handles.get(id(inner))
        if handle is None or handle.inner is not inner:
            handle = self.handles[id(inner)] = Block.around(inner)
        return handle

    @staticmethod
    def _unwrap(block: object) -> object:
        return block.inner if isinstance(block, Block) else block

    @property
    def stats(self) -> Any:
        return self.books.stats

    @property
    def history(self) -> Any:
        return self.books.history

    def register_owner(self, owner: int) -> None:
        with self.errors:
            self.books.register_owner(owner)

    def release_owner(self, owner: int) -> None:
        self.books.release_owner(owner)

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Any]:
        with self.errors:
            return [self._wrap(b) for b in self.books.allocate(stream, n_tokens, owner, format)]

    def free(self, blocks: Iterable[object]) -> None:
        if isinstance(blocks, list | tuple):
            blocks = type(blocks)(map(self._unwrap, blocks))
        else:
            blocks = self._unwrap(blocks)  # type: ignore[assignment]
        with self.errors:
            self.books.free(blocks)  # type: ignore[arg-type]

    def free_all(self, owner: int) -> None:
        self.books.free_all(owner)

    def shrink(self, stream: str, target_free: int) -> int:
        return self.books.shrink(stream, target_free)

    def mark_used(self, block: object, n_used: int) -> None:
        self.books.mark_used(self._unwrap(block), n_used)  # type: ignore[arg-type]

    def blocks_for(self, owner: int) -> list[Any]:
        return [self._wrap(b) for b in self.books.blocks_for(owner)]

    def n_free(self, stream: str = "k") -> int:
        return self.books.n_free(stream)
