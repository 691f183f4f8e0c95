"""The thread tests, the schedule explorer and a no-GIL hammer on free-threaded CPython.

Under a GIL a missing lock can hide for a long time: a thread switch lands
inside a critical section only rarely. Without a GIL (PEP 703, ``3.13t``)
threads really run at once, so a hammer catches it within a second. Which
half of this file runs depends on the interpreter running it:

- **Free-threaded, GIL off** (or launched by the other half): the hammer
  tests below run in-process. Many threads churn one pool; the real
  allocator must conserve every block and count every call; a planted
  allocator whose ``allocate()`` takes no lock must be caught.
- **A GIL build** (the project's ``.venv``, CI): one test runs this file,
  ``test_threading.py``, ``test_schedules.py`` and the stress runner's teeth
  (``test_stress_teeth.py``: planted races its linearizability check must
  catch) under the free-threaded interpreter at ``$VELOXQUANT_FT_PYTHON``
  (default ``~/.cache/ft-python/bin/python3``), and passes only if every one
  of them passes there, none skipped. Without such an interpreter it is
  *skipped with the reason in the report* (``-ra``), because a fresh machine
  need not have one; set ``VELOXQUANT_REQUIRE_FT=1`` wherever one is
  expected (a nightly machine) to make that a failure.
  ``stress/FREE_THREADED.md`` says how to get one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from veloxquant_mlx.memory.block_pool import (
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
)

FT_PYTHON_VARIABLE = "VELOXQUANT_FT_PYTHON"
REQUIRE_FT_VARIABLE = "VELOXQUANT_REQUIRE_FT"
FT_SUITE_VARIABLE = "VELOXQUANT_FT_SUITE"  # set by stress/nightly.sh: run the suite here
INNER_RUN_VARIABLE = "VELOXQUANT_FT_INNER_RUN"  # set by the launcher for the run it starts
DEFAULT_FT_PYTHON = Path.home() / ".cache" / "ft-python" / "bin" / "python3"
REPO_ROOT = Path(__file__).resolve().parent.parent
# What must pass without a GIL: the hammer, the thread tests, the schedule explorer,
# and the stress runner's teeth (planted races caught by its linearizability check).
# The stress runner's own long runs go to the nightly (stress/nightly.sh).
FT_TEST_FILES = (
    "test_free_threaded.py",
    "test_threading.py",
    "test_schedules.py",
    "test_stress_teeth.py",
)

N_THREADS = 8
HAMMER_ROUNDS = 10
PLANTED_MAX_ROUNDS = 100  # caught in round 1 most times when idle; dozens on a loaded 2-core box
HAMMER_ROUND_SECONDS = 0.2


def gil_is_off() -> bool:
    """True on a free-threaded build whose GIL is actually disabled right now."""
    is_enabled: Callable[[], bool] | None = getattr(sys, "_is_gil_enabled", None)
    return is_enabled is not None and not is_enabled()


# ---- the hammer (runs on the free-threaded interpreter) ----------------------------


class NoLockAllocateAllocator(BlockPoolAllocator):
    """Planted bug: ``allocate()`` pops and counts without the lock (exhaustion still locks)."""

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        free_list_name = self._stream_names[stream]
        n_needed = -(-n_tokens // self.config.block_size)
        free_list = self._free_lists[free_list_name]
        if n_needed > len(free_list):
            return super().allocate(stream, n_tokens, owner, format)
        block_ids = [free_list.pop() for _ in range(n_needed)]
        return self._check_out(block_ids, free_list_name, owner, format, n_tokens)


@dataclass
class Tally:
    """What one worker did; summed, it must equal the pool's counters."""

    allocations: int = 0
    exhausted: int = 0
    frees: int = 0
    errors: list[BaseException] = field(default_factory=list)


def churn(pool: BlockPoolAllocator, owner: int, tally: Tally, deadline: float) -> None:
    """Allocate, fill, partly free and free_all on one owner until ``deadline``."""
    rng = random.Random(owner)
    block_size = pool.config.block_size
    while time.monotonic() < deadline:
        try:
            blocks = pool.allocate(rng.choice("kv"), rng.randint(1, 3 * block_size), owner)
        except BlockPoolExhaustedError:
            tally.exhausted += 1
            continue
        tally.allocations += 1
        pool.mark_used(blocks[-1], rng.randint(0, block_size))
        if len(blocks) > 1 and rng.random() < 0.5:
            pool.free(blocks[1:])
            tally.frees += 1
        pool.free_all(owner)
        tally.frees += 1


def hammer_round(pool: BlockPoolAllocator, seconds: float) -> list[str]:
    """Churn ``pool`` from N_THREADS threads at once; return every conservation failure."""
    tallies = [Tally() for _ in range(N_THREADS)]
    # The round's clock starts when every thread is at the barrier, not before they
    # exist: on a loaded machine starting them took longer than a round, and the
    # workers then found their deadline passed and did nothing.
    deadline: list[float] = []
    barrier = threading.Barrier(
        N_THREADS, action=lambda: deadline.append(time.monotonic() + seconds)
    )

    def work(index: int) -> None:
        barrier.wait()
        try:
            churn(pool, index, tallies[index], deadline[0])
        except Exception as error:  # a contract-breaking error is a finding, not a crash
            tallies[index].errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return conservation_failures(pool, tallies)


def conservation_failures(pool: BlockPoolAllocator, tallies: list[Tally]) -> list[str]:
    """Every way the pool's books disagree with what the workers did."""
    stats = pool.stats
    failures = [f"a worker raised {error!r}" for t in tallies for error in t.errors]
    expected = {
        "n_allocations": sum(t.allocations for t in tallies),
        "n_exhausted": sum(t.exhausted for t in tallies),
        "n_frees": sum(t.frees for t in tallies),
    }
    for name, count in expected.items():
        if getattr(stats, name) != count:
            failures.append(f"stats.{name} is {getattr(stats, name)}, the workers did {count}")
    n_free = pool.n_free("k") + pool.n_free("v")
    if n_free != stats.n_blocks or stats.blocks_in_use() != 0:
        failures.append(
            f"after every free_all, {n_free} of {stats.n_blocks} blocks are free and "
            f"blocks_in_use() is {stats.blocks_in_use()}"
        )
    try:
        pool.check_invariants()
    except AssertionError as error:
        failures.append(f"check_invariants(): {error}")
    return failures


def tight_pool(pool_type: type[BlockPoolAllocator]) -> BlockPoolAllocator:
    """Fewer blocks than the threads want at once, so they contend for the last ones."""
    return pool_type(PoolConfig(block_size=4, n_blocks=4 * N_THREADS), history_len=0)


def require_gil_off() -> None:
    if not gil_is_off():
        pytest.fail(
            f"{sys.executable} runs with the GIL enabled (an extension module may have "
            "re-enabled it, or PYTHON_GIL=1 is set); the no-GIL hammer would prove nothing"
        )


# ---- the launcher (runs on a GIL build) ------------------------------------------


def free_threaded_python() -> Path | None:
    """The free-threaded interpreter to launch: ``$VELOXQUANT_FT_PYTHON`` or the default."""
    configured = os.environ.get(FT_PYTHON_VARIABLE)
    if configured:
        return Path(configured)
    return DEFAULT_FT_PYTHON if DEFAULT_FT_PYTHON.exists() else None


def skip_or_fail_without_free_threaded_python(reason: str) -> None:
    if os.environ.get(REQUIRE_FT_VARIABLE) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_FT_VARIABLE}=1 requires one")
    pytest.skip(f"{reason}; see stress/FREE_THREADED.md (these tests ran on the GIL build only)")


def ft_test_files() -> list[str]:
    """The files to run; each must exist, so that a rename cannot drop one silently."""
    paths = [REPO_ROOT / "tests" / name for name in FT_TEST_FILES]
    missing = [str(path) for path in paths if not path.exists()]
    assert not missing, f"free-threaded test files are missing: {missing}"
    return [str(path.relative_to(REPO_ROOT)) for path in paths]


def run_free_threaded(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, INNER_RUN_VARIABLE: "1"}
    environment.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [str(python), *args],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


# ---- tests -----------------------------------------------------------------------

if os.environ.get(INNER_RUN_VARIABLE) == "1" or gil_is_off():

    def test_the_interpreter_really_runs_without_a_gil() -> None:
        assert sysconfig.get_config_var("Py_GIL_DISABLED") == 1
        require_gil_off()

    def test_real_allocator_conserves_blocks_under_a_no_gil_hammer() -> None:
        require_gil_off()
        allocations = 0
        for _ in range(HAMMER_ROUNDS):
            pool = tight_pool(BlockPoolAllocator)
            assert hammer_round(pool, HAMMER_ROUND_SECONDS) == []
            allocations += pool.stats.n_allocations
        assert allocations > 1000, "the hammer did too little to count"

    def test_planted_missing_lock_is_caught_by_a_no_gil_hammer() -> None:
        require_gil_off()
        for _ in range(PLANTED_MAX_ROUNDS):
            if hammer_round(tight_pool(NoLockAllocateAllocator), HAMMER_ROUND_SECONDS):
                return
        rounds = f"{PLANTED_MAX_ROUNDS} rounds of {HAMMER_ROUND_SECONDS} s"
        pytest.fail(f"{rounds} found no trace of the missing lock")

else:

    @pytest.mark.slow
    def test_thread_tests_pass_on_a_free_threaded_interpreter(
        record_property: Callable[[str, object], None],
    ) -> None:
        if os.environ.get(FT_SUITE_VARIABLE) != "1" and os.environ.get(REQUIRE_FT_VARIABLE) != "1":
            pytest.skip(
                f"the free-threaded thread suite (about 3 min) runs nightly: stress/nightly.sh "
                f"sets {FT_SUITE_VARIABLE}=1; set it to run it here"
            )
        python = free_threaded_python()
        if python is None:
            skip_or_fail_without_free_threaded_python(
                f"no free-threaded Python: {FT_PYTHON_VARIABLE} is unset and "
                f"{DEFAULT_FT_PYTHON} does not exist"
            )
            return
        assert python.exists(), f"{FT_PYTHON_VARIABLE}={python} names no file"
        probe = run_free_threaded(
            python, "-c", "import sysconfig; print(sysconfig.get_config_var('Py_GIL_DISABLED'))"
        )
        assert probe.returncode == 0 and probe.stdout.strip() == "1", (
            f"{python} is not a free-threaded CPython build: {probe.stdout}{probe.stderr}"
        )
        files = ft_test_files()
        completed = run_free_threaded(
            python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files
        )
        summary = completed.stdout.strip().splitlines()[-1:] or ["(no output)"]
        record_property("free_threaded_run", f"{python}: {' '.join(files)}: {summary[0]}")
        assert completed.returncode == 0, (
            f"under {python}:\n{completed.stdout[-6000:]}\n{completed.stderr[-3000:]}"
        )
        assert "skipped" not in summary[0], f"tests were skipped under {python}: {summary[0]}"
