"""Host time of a decode step's cache calls, this checkout against another revision.

A decode step of a pool-backed cache is one ``update_and_fetch`` per layer;
on a GPU their host work decides the step (issue 9). This benchmark times
only those calls, as the calling thread's CPU time (``time.thread_time``:
MLX's own threads and waits are left out), on a ``lazy_writes`` store of 8
layers, one request, at each context; the step's evaluation and the freeing
of its outputs happen outside the timing. With ``--rows N`` (N >= 2) the
step is a batched one (:func:`~veloxquant_mlx.memory.batch_cache.batch_caches`)
of N requests, row ``r`` prefilled to the context plus ``r`` positions (so the
rows are padded); its figures are per step of all N rows. After each layer's
call, outside the timing, its rows' attention is taken from it as a model with
the attention hook takes it (``attend_rows``, BATCH-ATTEND), so the layer's
reads are freed with the step's outputs, as one request's are; a batch that
nothing attends through would free them in the next layer's call instead.

    python benchmarks/bench_cache_host.py --against e5d3e36      # about two minutes
    python benchmarks/bench_cache_host.py --against main --rounds 9 --contexts 256,4096
    python benchmarks/bench_cache_host.py --against main --rows 4   # a batch of 4 requests
    git archive aa602e6 | tar -x -C /tmp/base     # where the history is not at hand:
    python benchmarks/bench_cache_host.py --against-tree /tmp/base   # (the GPU machine)

``--against REV`` checks REV out into a temporary git worktree
(``_against.checked_out``); ``--against-tree DIR`` takes a checkout made
elsewhere. Each round runs one worker process per tree, which goes first
flipping every round, so the machine's other load falls on both alike. A
worker measures the tree it is given (its source first on the path). The
report gives, per context, the median over rounds of each tree's median
step, and this / base; and the same for the first layer's call of a step
and for each later layer's (the first carries the step's own work: the
book's growth, the liveness check, the step's rows). Last, each worker counts
the Python function calls of a step's cache calls, in a separate pass under
``cProfile``: a figure that neither the machine's load nor its caches move, so
it shows whether a step's host work grows with the context where times on a
shared CPU cannot (the device's work there evicts the host's caches, more so
at long contexts). Nothing passes or fails.

Thread safety: single-threaded. Complexity: rounds x contexts x 2 worker
processes, each ``--rows`` prompts of the context and ``--steps`` decode steps.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, NoReturn

import _against

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
#: What a worker reports, in microseconds: a whole step's calls, the first layer's, a later one's.
FIGURES = ("step", "first_layer", "later_layer")
#: Steps of the counting pass (cProfile), after the timed ones.
COUNTED_STEPS = 16
REPO_ROOT = Path(__file__).resolve().parent.parent


def measure(root: Path, context: int, steps: int, rows: int = 1) -> dict[str, float]:
    """Median host microseconds of one decode step of the tree at ``root``, of its first
    layer's call and of a later layer's (a worker); ``rows`` >= 2: of a batched step."""
    sys.path[:0] = [str(root), str(root / "spec")]
    import mlx.core as mx  # after the tree is put first on the path

    from veloxquant_mlx.memory.block_pool import BlockPoolAllocator, PoolConfig
    from veloxquant_mlx.memory.kv_cache import PoolBackedPromptCache
    from veloxquant_mlx.memory.mlx_storage import MLXBlockStorage
    from veloxquant_mlx.memory.pooled_kv_cache import PooledKVCache

    n_blocks = 2 * rows * ((context + rows + steps) // BLOCK_SIZE + 2)
    pool = BlockPoolAllocator(PoolConfig(block_size=BLOCK_SIZE, n_blocks=n_blocks))
    store = MLXBlockStorage(pool, LAYERS, HEADS, HEAD_DIM, mx.float16, lazy_writes=True)
    requests = []
    for row in range(rows):
        request = PoolBackedPromptCache(store, PooledKVCache(pool, n_layers=LAYERS))
        prompt = mx.zeros((1, HEADS, context + row, HEAD_DIM), mx.float16)
        mx.eval([layer.update_and_fetch(prompt, prompt) for layer in request])
        requests.append(request)
    cache: Sequence[Any] = requests[0]
    if rows > 1:
        from veloxquant_mlx.memory.batch_cache import batch_caches

        cache = batch_caches(requests)
    token = mx.ones((rows, HEADS, 1, HEAD_DIM), mx.float16)
    mx.eval(token)
    calls = [_timed_step(cache, token, mx.eval) for _ in range(steps)]
    kept = calls[steps // 10 :]  # the first steps warm up
    return {
        "step": statistics.median(sum(times) for times in kept) * 1e6,
        "first_layer": statistics.median(times[0] for times in kept) * 1e6,
        "later_layer": statistics.median(t for times in kept for t in times[1:]) * 1e6,
        "python_calls": _python_calls_per_step(cache, token, mx.eval),
    }


def _timed_step(cache: Sequence[Any], token: Any, evaluate: Callable[..., None]) -> list[float]:
    """One decode step; each layer's cache call in seconds of this thread's CPU time.
    A batch's reads are then used as hooked attention uses them, untimed."""
    out, times = [], []
    for layer in cache:
        start = time.thread_time()
        out.append(layer.update_and_fetch(token, token))
        times.append(time.thread_time() - start)
        if hasattr(layer, "attend_rows"):
            out.append(layer.attend_rows(token, 1.0, None))
    evaluate(out)
    del out  # freed here, not inside the next step's timing
    return times


def _python_calls_per_step(
    cache: Sequence[Any], token: Any, evaluate: Callable[..., None]
) -> float:
    """Python function calls (builtins included) a step's cache calls make, counted by
    ``cProfile`` over ``COUNTED_STEPS`` steps."""
    profile = cProfile.Profile()
    for _ in range(COUNTED_STEPS):
        out = []
        for layer in cache:
            profile.enable()
            out.append(layer.update_and_fetch(token, token))
            profile.disable()
            if hasattr(layer, "attend_rows"):
                out.append(layer.attend_rows(token, 1.0, None))
        evaluate(out)
    return pstats.Stats(profile).total_calls / COUNTED_STEPS  # type: ignore[attr-defined, no-any-return]


def compare(
    base: Path, contexts: list[int], rounds: int, steps: int, rows: int = 1
) -> dict[str, object]:
    """Both trees' medians per context, alternating worker processes."""
    trees = {"base": base, "this": REPO_ROOT}
    table = []
    for context in contexts:
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for round_ in range(rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                samples[name].append(_worker(trees[name], context, steps, rows))
        row: dict[str, object] = {"context": context}
        base_calls, this_calls = (samples[name][0]["python_calls"] for name in trees)
        row["base_python_calls_per_step"], row["this_python_calls_per_step"] = (
            base_calls,
            this_calls,
        )
        print(
            f"context {context}, Python calls per step: base {base_calls:.0f}, "
            f"this {this_calls:.0f}",
            file=sys.stderr,
            flush=True,
        )
        for figure in FIGURES:
            base_us, this_us = (
                statistics.median(sample[figure] for sample in samples[name]) for name in trees
            )
            row[f"base_us_per_{figure}"] = round(base_us, 1)
            row[f"this_us_per_{figure}"] = round(this_us, 1)
            row[f"this_over_base_{figure}"] = round(this_us / base_us, 3)
            print(
                f"context {context}, {figure.replace('_', ' ')}: base {base_us:.1f} us, "
                f"this {this_us:.1f} us, this/base {this_us / base_us:.3f}",
                file=sys.stderr,
                flush=True,
            )
        row["samples"] = {
            name: [{key: round(value, 1) for key, value in s.items()} for s in xs]
            for name, xs in samples.items()
        }
        table.append(row)
    return {"layers": LAYERS, "batch_rows": rows, "rounds": rounds, "steps": steps, "rows": table}


def _worker(root: Path, context: int, steps: int, rows: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--worker", str(root), str(context), str(steps)]
    command += [str(rows)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"bench_cache_host.py: error: the worker on {root} failed: {last}", file=sys.stderr)
        raise SystemExit(2 if done.returncode == 2 else 1)  # 2: the sizes were bad input
    figures: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return figures


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as the package's ``OneLineParser`` (not imported: that
    would load this tree before a worker puts the other tree first on the path)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(text: str) -> int:
    """An ``argparse`` type: an int >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def contexts_of(text: str) -> list[int]:
    """``--contexts``: comma-separated ints >= 1."""
    return [positive(part) for part in text.split(",")]


def require_base_tree(parser: _Parser, given: str) -> Path:
    """``--against-tree``: another checkout of this project (its package and spec)."""
    tree = Path(given).resolve()
    parts = ("veloxquant_mlx/memory/kv_cache.py", "spec/veloxquant_mlx_spec/__init__.py")
    if not given or not all((tree / part).is_file() for part in parts):
        parser.error(f"--against-tree {given!r}: no checkout of this project")
    if tree == REPO_ROOT:
        parser.error(f"--against-tree {given!r} is this checkout; expected another one")
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    against = parser.add_mutually_exclusive_group()
    against.add_argument("--against", metavar="REV", help="the revision to compare with")
    against.add_argument(
        "--against-tree",
        metavar="DIR",
        help="a checkout of the base made elsewhere (where git history is not at hand)",
    )
    parser.add_argument("--rounds", type=positive, default=7, help="worker pairs per context")
    parser.add_argument("--steps", type=positive, default=300, help="decode steps per worker")
    parser.add_argument(
        "--contexts", type=contexts_of, default="256,4096", help="comma-separated contexts"
    )
    parser.add_argument(
        "--rows", type=positive, default=1, help="requests per step (>= 2: one batched step)"
    )
    parser.add_argument(
        "--worker", nargs=4, metavar=("ROOT", "CONTEXT", "STEPS", "ROWS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker is not None:
        root, context, steps, rows = args.worker
        try:
            figures = measure(Path(root), int(context), int(steps), int(rows))
        except MemoryError as error:  # a context this machine cannot hold: bad input
            parser.exit(2, f"{parser.prog}: error: {error} (--contexts {context})\n")
        print(json.dumps(figures))
        return 0
    if args.against_tree is not None:
        base_tree: AbstractContextManager[Path] = nullcontext(
            require_base_tree(parser, args.against_tree)
        )
        label = {"against_tree": args.against_tree}
    elif args.against is not None:
        base_tree, label = _against.checked_out(args.against), {"against": args.against}
    else:
        parser.error("--against REV or --against-tree DIR is required")
    with base_tree as base:
        report = compare(base, args.contexts, args.rounds, args.steps, args.rows)
    print(json.dumps({**label, **report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
