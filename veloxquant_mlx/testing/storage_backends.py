"""Backends of the aliasing replay: how to build, feed and read one kind of store.

A :class:`StorageBackend` tells the replay engine
(:mod:`~veloxquant_mlx.testing.aliasing`) and the storage conformance suite
(:mod:`~veloxquant_mlx.testing.storage_conformance`) how to build a store for
a pool and a store shape, turn float32 token values into the store's arrays
(in the store's dtype) and back, how far its capacity may run ahead of the
pool, and how many bytes a dtype takes. :func:`numpy_backend` and
:func:`mlx_backend` are ours; a port of the storage protocol writes its own.

Complexity: O(1), plus the conversions. Thread safety: a backend is immutable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from veloxquant_mlx.memory.block_pool import BlockPoolAllocator
from veloxquant_mlx.memory.storage import BlockStorage
from veloxquant_mlx.testing.traces import StoreSpec

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "TOKEN_DTYPES",
    "StorageBackend",
    "Values",
    "builtin_backend",
    "mlx_backend",
    "numpy_backend",
]

ArrayT = TypeVar("ArrayT")
Values = npt.NDArray[np.float32]

#: Dtypes a replayed store may have: numbers in which every sentinel is exact.
TOKEN_DTYPES: Final = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)


@dataclass(frozen=True)
class StorageBackend(Generic[ArrayT]):
    """What the replay and the conformance suite need to drive one kind of store.

    Attributes:
        name: Shown in messages (``"mlx"``, ``"numpy"``, ``"my-cuda-store"``).
        make_storage: Builds the store under test for a pool and a store shape.
        from_numpy: Turns float32 token values into the store's array type.
        to_numpy: Evaluates an array of the store's type and returns it as float32.
        headroom: The store's capacity stays below ``headroom * pool.id_bound()``
            (unless equal to it): the most its growth rule over-allocates.
        cast: Converts an array made by ``from_numpy`` to a ``StoreSpec.dtype`` name;
            stores refuse tokens of another dtype than theirs. ``None`` for a backend
            whose stores only hold float32.
        dtype_size: Bytes per value of a dtype name; raises ``ValueError`` for a
            name this backend cannot store. ``None``: the backend does not say
            (a command then cannot refuse a trace's store up front).
    """

    name: str
    make_storage: Callable[[BlockPoolAllocator, StoreSpec], BlockStorage[ArrayT]]
    from_numpy: Callable[[Values], ArrayT]
    to_numpy: Callable[[ArrayT], Values]
    headroom: int = 2
    cast: Callable[[ArrayT, str], ArrayT] | None = None
    dtype_size: Callable[[str], int] | None = None

    def tokens(self, values: Values, dtype: str) -> ArrayT:
        """``values`` as the store's array type in ``dtype``: what a write must be given."""
        array = self.from_numpy(values)
        return array if self.cast is None else self.cast(array, dtype)


def _unknown_dtype(backend: str, name: str) -> ValueError:
    known = [dtype for dtype in TOKEN_DTYPES if not (backend == "numpy" and dtype == "bfloat16")]
    return ValueError(f"store dtype must be one of {known} for the {backend} backend, got {name!r}")


def numpy_backend() -> StorageBackend[npt.NDArray[np.generic]]:
    """The backend of :class:`~veloxquant_mlx.memory.numpy_storage.NumpyBlockStorage`."""
    from veloxquant_mlx.memory.numpy_storage import NumpyBlockStorage  # noqa: PLC0415

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> NumpyBlockStorage:
        return NumpyBlockStorage(
            pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, np.dtype(spec.dtype)
        )

    def dtype_size(name: str) -> int:
        if name not in TOKEN_DTYPES or name == "bfloat16":  # NumPy has no bfloat16
            raise _unknown_dtype("numpy", name)
        return np.dtype(name).itemsize

    return StorageBackend(
        "numpy",
        make,
        lambda values: values,
        lambda array: np.array(array, dtype=np.float32),
        cast=lambda array, dtype: array.astype(np.dtype(dtype)),
        dtype_size=dtype_size,
    )


def mlx_backend(*, lazy_writes: bool = False) -> StorageBackend[mx.array]:
    """The backend of :class:`~veloxquant_mlx.memory.mlx_storage.MLXBlockStorage`.

    ``lazy_writes`` builds stores that leave writes unevaluated (named ``"mlx-lazy"``).
    """
    import mlx.core as mx  # noqa: PLC0415

    from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage  # noqa: PLC0415

    def make(pool: BlockPoolAllocator, spec: StoreSpec) -> MLXBlockStorage:
        dtype = getattr(mx, spec.dtype, None)
        if not isinstance(dtype, mx.Dtype):
            raise ValueError(f"store dtype must name an mlx.core dtype, got {spec.dtype!r}")
        return MLXBlockStorage(
            pool, spec.n_layers, spec.n_kv_heads, spec.head_dim, dtype, lazy_writes=lazy_writes
        )

    def to_numpy(array: mx.array) -> Values:
        return np.array(array.astype(mx.float32), dtype=np.float32)

    def cast(array: mx.array, dtype: str) -> mx.array:
        return array.astype(getattr(mx, dtype))

    def dtype_size(name: str) -> int:
        dtype = getattr(mx, name, None)
        if name not in TOKEN_DTYPES or not isinstance(dtype, mx.Dtype):
            raise _unknown_dtype("mlx", name)
        return int(dtype.size)

    name = "mlx-lazy" if lazy_writes else "mlx"
    return StorageBackend(name, make, mx.array, to_numpy, cast=cast, dtype_size=dtype_size)


def builtin_backend(name: str) -> StorageBackend[Any]:
    """The backend ``"mlx"`` or ``"numpy"``.

    Raises:
        ValueError: Any other name.
    """
    if name == "mlx":
        return mlx_backend()
    if name == "numpy":
        return numpy_backend()
    raise ValueError(f"backend must be 'mlx' or 'numpy', got {name!r}")
