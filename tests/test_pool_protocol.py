"""The typing protocol of the pool: our allocator and a port both satisfy it, and mypy checks it.

``veloxquant_mlx.memory`` publishes ``BlockPool`` (generic in the handle
type) and ``CheckedBlockPool``. The assignments below are checked by
``mypy --strict`` with the rest of the tests; the last test runs mypy on a
port typed with the wrong handle class and expects it to name the calls
that disagree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from veloxquant_mlx.memory import (
    AllocationStats,
    Block,
    BlockPool,
    BlockPoolAllocator,
    CheckedBlockPool,
    PoolConfig,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PortBlock:
    """A port's own handle class: frozen, with the fields docs/API.md lists."""

    block_id: int
    stream: str = "k"
    format: str = "fp16"
    n_used: int = 0
    owner: int | None = None
    ever_allocated: bool = True


@dataclass
class PortPool:
    """A minimal port of the reference API, with its own handle class and plain list history."""

    config: PoolConfig = field(default_factory=PoolConfig)
    stats: AllocationStats = field(default_factory=lambda: AllocationStats(n_blocks=0))
    history: list[AllocationStats] = field(default_factory=list)

    def register_owner(self, owner: int) -> None: ...
    def release_owner(self, owner: int) -> None: ...
    def allocate(
        self, stream: str, n_tokens: int, owner: int, format: str = "fp16"
    ) -> list[PortBlock]:
        return [PortBlock(0, stream, format, n_tokens, owner)]

    def free(self, blocks: list[PortBlock]) -> None: ...
    def free_all(self, owner: int) -> None: ...
    def shrink(self, stream: str, target_free: int) -> int:
        return 0

    def mark_used(self, block: PortBlock, n_used: int) -> None: ...
    def blocks_for(self, owner: int) -> list[PortBlock]:
        return []

    def n_free(self, stream: str = "k") -> int:
        return 0


def ours(pool: BlockPoolAllocator) -> CheckedBlockPool[Block]:
    return pool  # mypy: BlockPoolAllocator satisfies the checked protocol over Block


def a_port(pool: PortPool) -> BlockPool[PortBlock]:
    return pool  # mypy: a port with its own handle class satisfies BlockPool over it


def test_our_allocator_is_a_checked_block_pool_at_run_time() -> None:
    pool = BlockPoolAllocator(PoolConfig(n_blocks=4))
    assert isinstance(ours(pool), CheckedBlockPool)


def test_a_port_is_a_block_pool_but_not_a_checked_one() -> None:
    port = a_port(PortPool())
    assert isinstance(port, BlockPool)
    assert not isinstance(port, CheckedBlockPool)
    assert port.allocate("k", 3, 1)[0].n_used == 3


PORT = textwrap.dedent(
    """
    from dataclasses import dataclass
    from veloxquant_mlx_spec.operations import BlockPool, ConfigLike, StatsLike

    @dataclass
    class MyBlock:
        block_id: int
        stream: str
        format: str
        n_used: int
        owner: int | None
        ever_allocated: bool

    @dataclass
    class OtherBlock(MyBlock):
        extra: int = 0

    class MyPool:
        config: ConfigLike
        stats: StatsLike
        history: list[StatsLike]
        def register_owner(self, owner: int) -> None: ...
        def release_owner(self, owner: int) -> None: ...
        def allocate(
            self, stream: str, n_tokens: int, owner: int, format: str = "fp16"
        ) -> list[MyBlock]:
            return []
        def free(self, blocks: list[MyBlock]) -> None: ...
        def free_all(self, owner: int) -> None: ...
        def shrink(self, stream: str, target_free: int) -> int:
            return 0
        def mark_used(self, block: MyBlock, n_used: int) -> None: ...
        def blocks_for(self, owner: int) -> list[MyBlock]:
            return []
        def n_free(self, stream: str = "k") -> int:
            return 0

    pool: BlockPool[HANDLE] = MyPool()
    """
)


def mypy_on(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "port.py"
    path.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path), str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "MYPYPATH": str(REPO / "spec")},
        check=False,
    )


def test_mypy_accepts_a_port_typed_with_its_own_handle_class(tmp_path: Path) -> None:
    result = mypy_on(PORT.replace("HANDLE", "MyBlock"), tmp_path)
    assert result.returncode == 0, result.stdout


def test_mypy_rejects_a_port_typed_with_another_handle_class(tmp_path: Path) -> None:
    result = mypy_on(PORT.replace("HANDLE", "OtherBlock"), tmp_path)
    assert result.returncode == 1, result.stdout
    assert 'variable has type "BlockPool[OtherBlock]"' in result.stdout
    assert "def allocate(" in result.stdout
    assert result.stdout.count(": error:") == 1, result.stdout
