"""Imports: the allocator needs no MLX, and the error classes are where the contract says."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import veloxquant_mlx.memory
from veloxquant_mlx.memory import block_pool

REPO_ROOT = Path(__file__).resolve().parent.parent

BLOCK_MLX = """
import importlib.abc
import sys


class BlockMLX(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx.") or name.startswith("mlx_"):
            raise ImportError(f"MLX is blocked in this test: {name}")
        return None


sys.meta_path.insert(0, BlockMLX())
"""

IMPORT_AND_USE = """
import veloxquant_mlx.memory
from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig

pool = BlockPoolAllocator(PoolConfig(block_size=4, n_blocks=4))
pool.free(pool.allocate("k", 5, owner=1))
pool.check_invariants()
loaded = sorted(m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_")))
assert not loaded, loaded
print("ok")
"""


def run_python(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_block_pool_imports_and_works_without_mlx_installed() -> None:
    result = run_python(BLOCK_MLX + "\nimport sys\n" + IMPORT_AND_USE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_importing_the_memory_package_does_not_load_mlx_eagerly() -> None:
    result = run_python("import sys\n" + IMPORT_AND_USE)
    assert result.returncode == 0, result.stderr


ERRORS = (
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "OwnerAlreadyActiveError",
    "InvalidFreeError",
    "InvariantViolationError",
)


@pytest.mark.parametrize("name", ERRORS)
def test_memory_package_re_exports_the_error(name: str) -> None:
    assert getattr(veloxquant_mlx.memory, name) is getattr(block_pool, name)


@pytest.mark.parametrize(
    ("name", "bases"),
    [
        ("BlockPoolError", (RuntimeError,)),
        ("BlockPoolExhaustedError", (block_pool.BlockPoolError, RuntimeError)),
        ("OwnerAlreadyActiveError", (block_pool.BlockPoolError, RuntimeError)),
        ("InvalidFreeError", (block_pool.BlockPoolError, ValueError, RuntimeError)),
        ("InvariantViolationError", (AssertionError,)),
    ],
)
def test_error_hierarchy_matches_the_contract(name: str, bases: tuple[type, ...]) -> None:
    error = getattr(block_pool, name)
    for base in bases:
        assert issubclass(error, base)


@pytest.mark.parametrize(
    "name", ["PoolConfig", "Block", "AllocationStats", "BlockPoolAllocator", *ERRORS]
)
def test_block_pool_module_provides_the_reference_classes(name: str) -> None:
    assert isinstance(getattr(block_pool, name), type)
