"""Run a benchmark's figures in both builds of the allocator, side by side in one run.

``bench_block_pool.py --compare`` measures each figure in two worker
processes, one importing the allocator interpreted (its ``.py`` sources) and
one importing it compiled by mypyc, and asks them for samples in turn
(alternating which goes first), so that whatever else the machine is doing
falls on both alike. Each worker reports the build it really imported
(``block_pool.COMPILED`` and the module's file); the comparison refuses to
run on anything else.

Where the compiled build comes from: the installed package if it is
compiled (a wheel), else a wheel built from this checkout into
``build/bench-compiled`` (rebuilt when the compiled sources change), else
``--compiled-site DIR``. The interpreted worker loads the package's ``.py``
files even where compiled modules sit beside them.

``instructions_per_op`` counts instructions with callgrind instead of
timing: the count of ``2n`` operations minus that of ``n``, over ``n``, so
set-up and start-up cancel. It is deterministic where wall-clock is noisy.

Thread safety: none needed; one comparison at a time. Complexity: the
figures' own.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

Build = Literal["interpreted", "compiled"]
BUILDS: tuple[Build, ...] = ("interpreted", "compiled")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = REPO_ROOT / "build" / "bench-compiled"


def build_inputs() -> tuple[str, ...]:
    """What a compiled build is made from, as ``build_backend.py`` lists it (loaded here
    only when needed: it imports setuptools): a change to any of these means a rebuild."""
    spec = importlib.util.spec_from_file_location("build_backend", REPO_ROOT / "build_backend.py")
    assert spec is not None and spec.loader is not None
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    return ("build_backend.py", *backend.COMPILED_MODULES, *backend.ANALYSED_ONLY)


PACKAGE = "veloxquant_mlx"


class SourceOnlyFinder(importlib.abc.MetaPathFinder):
    """Loads the package's modules from their ``.py`` files, never a compiled module beside."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return spec
        assert spec.origin is not None
        source = Path(spec.origin).parent / f"{fullname.rpartition('.')[2]}.py"
        return importlib.util.spec_from_file_location(fullname, source)


@dataclass(frozen=True)
class Worker:
    """A process serving samples of one build: one request line in, one JSON line out."""

    build: Build
    process: subprocess.Popen[str]
    module_file: str

    def sample(self, figure: str, quick: bool) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"figure": figure, "quick": quick}) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the {self.build} worker died while measuring {figure}")
        values: dict[str, float] = json.loads(reply)
        return values


def compiled_site(explicit: Path | None) -> Path | None:
    """A directory to put first on the compiled worker's path, or None for the installed one."""
    if explicit is not None:
        return explicit
    if imports_compiled(site=None):
        return None
    return build_compiled_site()


def imports_compiled(site: Path | None) -> bool:
    probe = f"from {PACKAGE}.memory import block_pool; print(block_pool.COMPILED)"
    result = run_python(["-c", probe], site)
    return result.returncode == 0 and result.stdout.strip() == "True"


def build_compiled_site() -> Path:
    """Install a wheel of this checkout into CACHE_DIR (pip, build isolation), unless current."""
    digest = hashlib.sha256()
    for name in build_inputs():
        digest.update((REPO_ROOT / name).read_bytes())
    stamp, site = CACHE_DIR / "source-sha256", CACHE_DIR / "site"
    if stamp.exists() and stamp.read_text() == digest.hexdigest() and imports_compiled(site):
        return site
    print(f"building the compiled allocator into {site} (a minute or two) ...", file=sys.stderr)
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*command, "--target", str(site), str(REPO_ROOT)], check=True)
    if not imports_compiled(site):
        raise SystemExit(f"the build in {site} is not compiled (see pip's output above)")
    stamp.write_text(digest.hexdigest())
    return site


def run_python(args: list[str], site: Path | None) -> subprocess.CompletedProcess[str]:
    """This interpreter, from a neutral directory, with ``site`` first on its path."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@dataclass(frozen=True)
class Tree:
    """A checkout whose allocator and benchmark a worker runs.

    ``source_root`` goes first on an interpreted worker's path (``None``: the
    installed package, as for this checkout); ``site`` holds the compiled
    build (``None``: the installed one).
    """

    bench_dir: Path = BENCH_DIR
    source_root: Path | None = None
    site: Path | None = None

    def env(self, build: Build) -> dict[str, str]:
        env = dict(os.environ)
        first = self.site if build == "compiled" else self.source_root
        if first is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(first), env.get("PYTHONPATH", "")])
        return env

    def worker_command(self, build: Build, mode: str) -> list[str]:
        setup = f"import sys; sys.path.insert(0, {str(self.bench_dir)!r}); import _two_builds"
        return [sys.executable, "-c", f"{setup}; _two_builds.{mode}({build!r})"]


def start_worker(build: Build, tree: Tree) -> Worker:
    """A worker of ``tree`` that has checked it imported ``build`` from where it should."""
    process = subprocess.Popen(
        tree.worker_command(build, "serve"),
        cwd=tempfile.gettempdir(),  # not the checkout: its sources would shadow a wheel
        env=tree.env(build),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    hello = json.loads(process.stdout.readline())
    wrong_root = tree.source_root is not None and build == "interpreted"
    if hello["compiled"] is not (build == "compiled") or (
        wrong_root and not hello["file"].startswith(str(tree.source_root))
    ):
        process.kill()
        raise SystemExit(f"the {build} worker imported {hello['file']}")
    return Worker(build, process, hello["file"])


def stop(started: Iterable[Worker]) -> None:
    for worker in started:
        worker.process.kill()
        worker.process.wait()


@contextmanager
def workers(site: Path | None) -> Iterator[dict[Build, Worker]]:
    """Start one worker per build; check that each imported the build it stands for."""
    started: dict[Build, Worker] = {}
    try:
        for build in BUILDS:
            started[build] = start_worker(build, Tree(site=site))
        yield started
    finally:
        stop(started.values())


def import_build(build: Build) -> ModuleType:
    """In a worker: import the allocator as ``build``, then the benchmark's figures."""
    if build == "interpreted":
        sys.meta_path.insert(0, SourceOnlyFinder())
    sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("bench_block_pool")


def serve(build: Build) -> None:
    """Worker main loop: say which build was imported, then answer sample requests."""
    bench = import_build(build)
    block_pool = sys.modules[f"{PACKAGE}.memory.block_pool"]
    print(json.dumps({"compiled": block_pool.COMPILED, "file": block_pool.__file__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        figure = bench.FIGURES_BY_KEY[request["figure"]]
        print(json.dumps(figure.sample(request["quick"])), flush=True)


def run_ops(build: Build) -> None:
    """Callgrind subject: set figure BENCH_FIGURE up and run it BENCH_OPS times (env)."""
    bench = import_build(build)
    figure_key, n = os.environ["BENCH_FIGURE"], int(os.environ["BENCH_OPS"])
    bench.FIGURES_BY_KEY[figure_key].run(n)


def instructions_per_op(build: Build, figure: str, n: int, tree: Tree) -> float:
    """Instructions one operation executes in ``build``: callgrind of 2n minus n, over n."""

    def instructions(ops: int) -> int:
        env = dict(tree.env(build), BENCH_FIGURE=figure, BENCH_OPS=str(ops), PYTHONHASHSEED="0")
        command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        result = subprocess.run(
            [*command, *tree.worker_command(build, "run_ops")],
            cwd=tempfile.gettempdir(),
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        found = re.search(r"Collected : (\d+)", result.stderr)
        assert found is not None, result.stderr[-2000:]
        return int(found.group(1))

    return (instructions(2 * n) - instructions(n)) / n
