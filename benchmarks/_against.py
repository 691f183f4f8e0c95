"""Run the block pool's figures against another revision, side by side in one run.

``bench_block_pool.py --against REV`` is how a change shows it kept a hot path
as fast as before (issue 12: the allocate+free pair within 5% of the
benchmark before sharing existed). REV is checked out into a temporary git
worktree, removed afterwards; each build (interpreted, compiled) of REV and of
this checkout runs in its own worker, REV's benchmark against REV's
allocator, and samples alternate between the two (which goes first flips
every repeat), so that the machine's other load falls on both alike. The
report gives both medians and this / REV per figure and build, and with
``--callgrind`` both instruction counts (``_two_builds.instructions_per_op``),
which a shared machine's load does not move.

Thread safety: none needed; one comparison at a time. Complexity: the
figures' own, twice, plus one compiled build of REV (a minute or two).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import _two_builds

#: The two sides of the comparison, in report order.
SIDES = ("base", "this")


def refuse(message: str) -> NoReturn:
    """Bad input, as every command says it: one line on stderr, exit status 2."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def checked_out(revision: str) -> Iterator[Path]:
    """A temporary detached git worktree of ``revision``, removed on the way out."""
    root = _two_builds.REPO_ROOT
    git = ["git", "-C", str(root), "worktree"]
    with tempfile.TemporaryDirectory(prefix="veloxquant-bench-base-") as holder:
        path = Path(holder) / "tree"
        added = subprocess.run(
            [*git, "add", "--detach", str(path), revision],
            capture_output=True,
            text=True,
            check=False,
        )
        if added.returncode != 0:
            message = " ".join(added.stderr.split())
            refuse(f"--against {revision!r}: git worktree add failed: {message}")
        try:
            yield path
        finally:
            subprocess.run([*git, "remove", "--force", str(path)], check=False)


def base_tree(path: Path, revision: str) -> _two_builds.Tree:
    """REV's checkout as a worker tree, its compiled build made by its own benchmark code."""
    bench_dir = path / "benchmarks"
    if not (bench_dir / "_two_builds.py").exists():
        refuse(f"--against {revision!r}: it has no benchmarks/_two_builds.py to run")
    print(f"building {revision}'s compiled allocator (a minute or two) ...", file=sys.stderr)
    probe = f"import sys; sys.path.insert(0, {str(bench_dir)!r}); import _two_builds; "
    result = subprocess.run(
        [sys.executable, "-c", probe + "print(_two_builds.build_compiled_site())"],
        cwd=tempfile.gettempdir(),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    site = Path(result.stdout.strip().splitlines()[-1])
    return _two_builds.Tree(bench_dir=bench_dir, source_root=path, site=site)


def compare_against(
    revision: str,
    figure_keys: list[str],
    repeats: int,
    callgrind_ops: Callable[[str], int] | None,
) -> dict[str, Any]:
    """Each figure of each build for REV and this checkout; see the module docstring."""
    with checked_out(revision) as path:
        trees = {
            "base": base_tree(path, revision),
            "this": _two_builds.Tree(site=_two_builds.compiled_site(None)),
        }
        report: dict[str, Any] = {"against": revision, "repeats": repeats}
        for build in _two_builds.BUILDS:
            report[build] = timed(build, trees, figure_keys, repeats)
            if callgrind_ops is not None:
                report[build]["instructions_per_op"] = counted(
                    build, trees, figure_keys, callgrind_ops
                )
    return report


def timed(
    build: _two_builds.Build,
    trees: dict[str, _two_builds.Tree],
    figure_keys: list[str],
    repeats: int,
) -> dict[str, Any]:
    """Medians of both sides, samples alternating, and this / base per value."""
    workers: dict[str, _two_builds.Worker] = {}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    try:
        for side in SIDES:
            workers[side] = _two_builds.start_worker(build, trees[side])
        for key in figure_keys:
            print(f"running {build} {key} ...", file=sys.stderr, flush=True)
            for repeat in range(repeats):
                for side in SIDES[:: 1 if repeat % 2 == 0 else -1]:
                    for name, value in workers[side].sample(key, False).items():
                        samples[side].setdefault(name, []).append(value)
    finally:
        _two_builds.stop(workers.values())
    figures = {}
    for name in samples["base"]:
        base, this = (statistics.median(samples[side][name]) for side in SIDES)
        figures[name] = {"base": round(base, 3), "this": round(this, 3)}
        figures[name]["this_over_base"] = round(this / base, 4)
    modules = {side: worker.module_file for side, worker in workers.items()}
    return {"modules": modules, "median_ns_or_ms": figures}


def counted(
    build: _two_builds.Build,
    trees: dict[str, _two_builds.Tree],
    figure_keys: list[str],
    callgrind_ops: Callable[[str], int],
) -> dict[str, dict[str, float]]:
    """Instructions per operation of both sides, and this / base."""
    counts = {}
    for key in figure_keys:
        print(f"callgrind {build} {key} ...", file=sys.stderr, flush=True)
        n = callgrind_ops(key)
        row = {side: _two_builds.instructions_per_op(build, key, n, trees[side]) for side in SIDES}
        row["this_over_base"] = row["this"] / row["base"]
        counts[key] = {name: round(value, 4) for name, value in row.items()}
    return counts
