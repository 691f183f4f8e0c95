"""Shared fixtures and helpers for the black-box block pool tests.

The tests here are written from the API reference (``docs/API.md``) and the
contract (``docs/CONTRACT.md``), not from the implementation. The one helper every
bad-input test relies on is :func:`observe`: a full, side-effect-free picture
of a pool (stats, free counts, owners' blocks, every handle's fields, history)
that two points in time can be compared by.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from veloxquant_mlx.memory import CheckedBlockPool
from veloxquant_mlx.memory.block_pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    PoolConfig,
)
from veloxquant_mlx.testing.profiles import load_profile_from_environment

if TYPE_CHECKING:
    from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache
from veloxquant_mlx_spec import model

# VELOXQUANT_HYPOTHESIS_PROFILE picks ci (default), nightly or mutation.
load_profile_from_environment()

# Every counter field of AllocationStats named by the reference, in its order.
STATS_COUNTERS = (
    "n_blocks",
    "n_allocations",
    "n_frees",
    "n_reused",
    "n_exhausted",
    "n_grown",
    "n_retired",
    "peak_blocks_in_use",
)

StatsView = tuple[tuple[str, float], ...]
HandleView = tuple[int, str, str, int, int | None, bool]


def stats_view(stats: AllocationStats) -> StatsView:
    """Every observable value of a stats object, as a comparable tuple."""
    values: list[tuple[str, float]] = [(name, getattr(stats, name)) for name in STATS_COUNTERS]
    values.append(("_fragmented_count", stats._fragmented_count))
    values.append(("blocks_in_use()", stats.blocks_in_use()))
    values.append(("fragmentation()", stats.fragmentation()))
    return tuple(values)


def handle_view(block: Block) -> HandleView:
    """Every field of a Block handle, as a comparable tuple."""
    return (
        block.block_id,
        block.stream,
        block.format,
        block.n_used,
        block.owner,
        block.ever_allocated,
    )


def stream_names(pool: BlockPoolAllocator) -> tuple[str, ...]:
    """The stream names that are valid on this pool (docs/CONTRACT.md, C-STREAM-NAMES)."""
    return model.stream_names(pool.config)


@dataclass(frozen=True)
class PoolObservation:
    """Everything a caller can see about a pool without changing it."""

    stats: StatsView
    n_free: tuple[tuple[str, int], ...]
    owners: tuple[tuple[int, tuple[Block, ...]], ...]  # Block compares by identity
    handles: tuple[HandleView, ...]
    history: tuple[StatsView, ...]


def observe(
    pool: BlockPoolAllocator,
    owners: Iterable[int] = (),
    handles: Iterable[Block] = (),
) -> PoolObservation:
    """Take a full observation of ``pool``.

    ``owners`` are the owner ids whose ``blocks_for`` is recorded (the handles
    themselves, compared by identity and kept alive, so that a re-created handle
    shows up as a change even if it lands at a freed one's address); ``handles`` are
    the Block objects the test holds, live, stale or foreign.
    """
    return PoolObservation(
        stats=stats_view(pool.stats),
        n_free=tuple((stream, pool.n_free(stream)) for stream in stream_names(pool)),
        owners=tuple((owner, tuple(pool.blocks_for(owner))) for owner in owners),
        handles=tuple(handle_view(block) for block in handles),
        history=tuple(stats_view(entry) for entry in pool.history),
    )


@contextmanager
def pool_unchanged(
    pool: BlockPoolAllocator,
    owners: Iterable[int] = (),
    handles: Iterable[Block] = (),
) -> Iterator[None]:
    """Assert that the body leaves every observable part of ``pool`` as it was."""
    owners = tuple(owners)
    handles = tuple(handles)
    pool.check_invariants()
    before = observe(pool, owners, handles)
    yield
    after = observe(pool, owners, handles)
    assert after == before
    pool.check_invariants()


def assert_only_exhaustion_recorded(before: PoolObservation, after: PoolObservation) -> None:
    """Assert that between two observations one exhausted allocate happened.

    docs/CONTRACT.md#c-all-or-nothing: ``n_exhausted`` goes up by one, one
    history snapshot is added, and nothing else changes.
    """
    expected_stats = tuple(
        (name, value + 1 if name == "n_exhausted" else value) for name, value in before.stats
    )
    assert after.stats == expected_stats
    assert after.n_free == before.n_free
    assert after.owners == before.owners
    assert after.handles == before.handles
    assert after.history[-1] == expected_stats
    assert after.history[:-1] == before.history[len(before.history) + 1 - len(after.history) :]


def assert_predicted_error_names(outcome: object, argument: str, offending: str | None) -> None:
    """A spec transition's (or query's) outcome is an ``Err`` whose message begins with
    ``argument`` and, unless ``offending`` is None, quotes the offending value."""
    error = outcome[1] if isinstance(outcome, tuple) else outcome
    assert isinstance(error, model.Err), error
    assert isinstance(error.message, str), error
    assert error.message.startswith(argument), error.message
    if offending is not None:
        assert offending in error.message, error.message


def block_ids(blocks: Sequence[Block]) -> list[int]:
    return [block.block_id for block in blocks]


def make_pool(
    block_size: int = 4,
    n_blocks: int = 8,
    *,
    separate_kv: bool = True,
    grow_on_exhaustion: bool = False,
    max_blocks: int | None = None,
    history_len: int = 1024,
) -> BlockPoolAllocator:
    config = PoolConfig(
        block_size=block_size,
        n_blocks=n_blocks,
        separate_kv=separate_kv,
        grow_on_exhaustion=grow_on_exhaustion,
        max_blocks=max_blocks,
    )
    return BlockPoolAllocator(config, history_len=history_len)


def leave_free(pool: CheckedBlockPool[Block], n_free: int, owner: int = 999) -> list[Block]:
    """Check out blocks of each stream to ``owner`` until ``n_free`` are left in it (a
    pool that already has fewer is a test set up wrong); returns the blocks taken."""
    taken: list[Block] = []
    for stream in ("k", "v"):
        n_taken = pool.n_free(stream) - n_free
        assert n_taken >= 0, f"stream {stream} has {pool.n_free(stream)} free, below {n_free}"
        if n_taken:
            taken += pool.allocate(stream, n_taken * pool.config.block_size, owner)
    return taken


def book_and_pool_state(book: PooledKVCache, pool: CheckedBlockPool[Block]) -> tuple[object, ...]:
    """What a refused call on ``book`` must leave as it was: its layers' positions, its
    key and value block ids, its reserved blocks, and the pool's free and used blocks and
    copy-on-write count."""
    return (
        tuple(book.layer_offset(layer) for layer in range(book.n_layers)),
        [block.block_id for block in book.key_blocks],
        [block.block_id for block in book.value_blocks],
        book.reserved_blocks,
        pool.n_free("k"),
        pool.n_free("v"),
        pool.stats.blocks_in_use(),
        pool.stats.n_copy_on_write,
    )


def reserved_blocks(book: PooledKVCache, pool: CheckedBlockPool[Block]) -> list[Block]:
    """The owner's blocks that hold no position of ``book``: its reserved ones."""
    in_table = {id(block) for block in (*book.key_blocks, *book.value_blocks)}
    return [block for block in pool.blocks_for(book.owner) if id(block) not in in_table]


def take_all_free(pool: BlockPoolAllocator, stream: str, owner: int) -> list[int]:
    """Check out every free block of ``stream`` and return their ids in hand-out order."""
    n_free = pool.n_free(stream)
    if n_free == 0:
        return []
    return block_ids(pool.allocate(stream, n_free * pool.config.block_size, owner))


@pytest.fixture
def pool() -> BlockPoolAllocator:
    """block_size 4, 8 blocks: ``"k"`` owns ids 0..3, ``"v"`` ids 4..7."""
    return make_pool()


@pytest.fixture
def shared_pool() -> BlockPoolAllocator:
    """block_size 4, 8 blocks on one ``"kv"`` free list."""
    return make_pool(separate_kv=False)


@dataclass
class PopulatedPool:
    """A pool with live, partial, stale, registered-only and foreign handles.

    - owner 1: three ``"k"`` blocks (n_used 4, 4, 2).
    - owner 2: two ``"v"`` blocks (n_used 4, 1).
    - owner 3: held one ``"k"`` block, freed; ``stale`` is that handle.
    - owner 4: registered, holds nothing.
    - ``foreign``: a live handle of an identically configured other pool,
      same block id and owner as ``owner1[0]``.
    """

    pool: BlockPoolAllocator
    other_pool: BlockPoolAllocator
    owner1: list[Block]
    owner2: list[Block]
    stale: Block
    foreign: Block

    @property
    def owners(self) -> tuple[int, ...]:
        return (1, 2, 3, 4, 5)

    @property
    def handles(self) -> tuple[Block, ...]:
        return (*self.owner1, *self.owner2, self.stale, self.foreign)

    def unchanged(self) -> AbstractContextManager[None]:
        """Assert that the body leaves the populated pool exactly as it was."""
        return pool_unchanged(self.pool, self.owners, self.handles)


@pytest.fixture
def populated() -> PopulatedPool:
    pool = make_pool(block_size=4, n_blocks=12, history_len=64)
    stale = pool.allocate("k", 3, owner=3)[0]
    pool.free_all(3)
    owner1 = pool.allocate("k", 10, owner=1, format="int2")
    owner2 = pool.allocate("v", 5, owner=2, format="int4")
    pool.register_owner(4)
    other_pool = make_pool(block_size=4, n_blocks=12)
    foreign = other_pool.allocate("k", 4, owner=1, format="int2")[0]
    return PopulatedPool(pool, other_pool, owner1, owner2, stale, foreign)


# The exhaustive checker's CI-depth tests record "states / transitions" lines as
# user properties; print them at the end of the run (also under xdist, where a
# passing test's own output is never shown).
_EXHAUSTIVE_COVERAGE: list[str] = []


@pytest.hookimpl(trylast=True)  # after --deselect and -k have removed what does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the ``slow`` tests first, spread over the workers by their cost.

    ``pytest -n auto`` (xdist's ``load`` scheduling) first hands each worker a
    run of consecutive tests, a quarter of its share, then the rest a few at a
    time to whichever worker runs low. Slow tests merely put first would all go
    to the first worker, and a test of half a minute that comes last keeps one
    worker busy while the other waits. So the slow tests, costliest first (the
    marker's ``seconds``, 10 if unsaid), are
    dealt greedily to the worker with the least cost so far, each at the head of
    that worker's first run (those that share a module-scoped fixture, named by
    the marker's ``shares``, together, so it is built once); the quick tests
    fill the runs and then balance the end. Every worker computes the same order
    (xdist requires it).
    """
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    units: dict[str, tuple[float, list[pytest.Item]]] = {}
    quick: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is None:
            quick.append(item)
            continue
        shares = marker.kwargs.get("shares")
        key = item.nodeid if shares is None else f"{item.path}::{shares}"
        cost, members = units.get(key, (0.0, []))
        units[key] = (cost + float(marker.kwargs.get("seconds", 10)), [*members, item])
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for cost, members in sorted(units.values(), key=lambda unit: -unit[0]):
        lightest = loads.index(min(loads))
        heads[lightest] += members
        loads[lightest] += cost
    first_run = max(len(items) // workers // 4, 2)
    ordered: list[pytest.Item] = []
    for head in heads:
        fill = max(first_run - len(head), 0)
        ordered += head + quick[:fill]
        quick = quick[fill:]
    items[:] = ordered + quick


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _EXHAUSTIVE_COVERAGE.extend(
            str(value) for key, value in report.user_properties if key == "exhaustive"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _EXHAUSTIVE_COVERAGE:
        terminalreporter.section("exhaustive check coverage")
        for line in sorted(_EXHAUSTIVE_COVERAGE):
            terminalreporter.write_line(line)


def load_mutation_script(name: str) -> ModuleType:
    """``mutation/<name>.py`` loaded as module ``mutation_<name>`` (the directory is no
    package: its scripts run from the repository root)."""
    path = Path(__file__).resolve().parent.parent / "mutation" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mutation_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
