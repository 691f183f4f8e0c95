"""``python -m veloxquant_mlx.testing.aliasing TRACE... [--backend mlx|numpy]``: replay traces.

Every trace named is read and checked before any is replayed: the file must
exist and be a trace (:mod:`~veloxquant_mlx.testing.traces`), its store's
dtype one the backend stores, and what replaying it allocates (the pool's
books, the store's slabs, the replay's shadow copy) must fit in the memory
available. Anything else is bad input: one line naming the file and the
value, exit status 2, and nothing replayed. Then each trace is replayed
through :class:`~veloxquant_mlx.testing.aliasing.AliasingReplay`, one line
each, stopping at the first failure.

Verdicts (:mod:`veloxquant_mlx.commandline.verdicts`): a failing replay is a
violation (1); a clean replay of a trace marked partial (a stress run that
was interrupted or gave up) is inconclusive (3), since the rest of its
history was never recorded; otherwise OK (0). Ctrl-C: one line, 130.

:func:`load_checked` and :func:`replay_verdict` are also what ``python -m
stress --replay`` uses.

Complexity: reading is O(file); replaying as :mod:`.aliasing` says.
Thread safety: one command per process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from veloxquant_mlx.commandline.bad_input import (
    BadInputError,
    OneLineParser,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.commandline.sizes import pool_bytes, slab_bytes
from veloxquant_mlx.commandline.verdicts import Verdict, combined
from veloxquant_mlx.testing.aliasing import (
    ReplayError,
    StorageBackend,
    builtin_backend,
    replay,
)
from veloxquant_mlx.testing.traces import (
    Allocate,
    Trace,
    TraceFormatError,
    Write,
    load,
)

__all__ = ["PROG", "load_checked", "main", "replay_memory_estimate", "replay_verdict"]

PROG: Final = "python -m veloxquant_mlx.testing.aliasing"
_SHADOW_ITEMSIZE: Final = 4  # the replay's shadow copy and its reads are float32


def _most_ids(trace: Trace) -> int:
    """The most block ids the replay's pool can issue: the initial ones plus possible growth."""
    pool = trace.pool
    if not pool.grow_on_exhaustion:
        return pool.n_blocks
    wanted = sum(-(-op.n_tokens // pool.block_size) for op in trace.ops if isinstance(op, Allocate))
    cap = pool.max_blocks
    return pool.n_blocks + (wanted if cap is None else min(wanted, cap - pool.n_blocks))


def replay_memory_estimate(trace: Trace, itemsize: int) -> int:
    """Bytes replaying ``trace`` may allocate: books, slabs, shadow, one gather, sentinels."""
    store, block_size = trace.store, trace.pool.block_size
    ids, values = _most_ids(trace), store.slot_count()
    slabs = slab_bytes(
        n_layers=store.n_layers,
        n_ids=ids,
        block_size=block_size,
        slot_values=values,
        itemsize=itemsize,
    )
    shadow = (store.n_layers + 2) * ids * block_size * values * _SHADOW_ITEMSIZE
    longest_write = max((op.n_tokens for op in trace.ops if isinstance(op, Write)), default=0)
    sentinels = longest_write * values * (8 + _SHADOW_ITEMSIZE + itemsize)
    return pool_bytes(ids) + slabs + shadow + sentinels


def load_checked(path: Path, backend: StorageBackend[Any]) -> Trace:
    """Read the trace at ``path`` and check that ``backend`` can replay it here.

    Raises:
        BadInputError: The file cannot be read or is not a trace, its store's
            dtype is not one ``backend`` stores, or replaying it would need
            more memory than is available. The message names the file.
    """
    try:
        size = path.stat().st_size
        # Parsed ops take about ten times their text: refuse a file that cannot fit.
        require_fits_in_memory(10 * size, f"{path}: a trace file of {size:,} bytes")
        trace = load(path)
    except OSError as error:
        raise BadInputError(f"{path}: cannot read the trace: {error.strerror or error}") from None
    except TraceFormatError as error:
        raise BadInputError(f"{path}: not a trace: {error}") from None
    if backend.dtype_size is None:
        return trace
    try:
        itemsize = backend.dtype_size(trace.store.dtype)
    except ValueError as error:
        raise BadInputError(f"{path}: {error}") from None
    pool, store = trace.pool, trace.store
    require_fits_in_memory(
        replay_memory_estimate(trace, itemsize),
        f"{path}: replaying a pool of n_blocks={pool.n_blocks} (max_blocks={pool.max_blocks}) "
        f"with a store of n_layers={store.n_layers}, n_kv_heads={store.n_kv_heads}, "
        f"head_dim={store.head_dim}, dtype={store.dtype}",
    )
    return trace


def replay_verdict(path: Path, trace: Trace, backend: StorageBackend[Any]) -> tuple[Verdict, str]:
    """Replay ``trace`` (read from ``path``) on ``backend``: its verdict and a line saying it."""
    where = f"{path}: {len(trace.ops)} ops replayed on {backend.name}"
    try:
        replay(trace, backend)
    except ReplayError as failure:
        return Verdict.VIOLATION, f"{path}: replay on {backend.name} FAILED: {failure}"
    if trace.partial:
        return Verdict.INCONCLUSIVE, (
            f"{where}, no failure, but INCONCLUSIVE: the trace is marked partial (its run was "
            "interrupted or its checking gave up), so the rest of that history was never checked"
        )
    return Verdict.OK, f"{where}: ok"


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Replay JSON-lines pool/store traces and check the store's data. Exit "
        "status: 0 ok, 1 a replay failed, 2 bad input, 3 inconclusive (a partial trace), "
        "130 interrupted.",
    )
    parser.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl)")
    parser.add_argument("--backend", choices=("mlx", "numpy"), default="mlx")
    return parser


def _replay_all(paths: Sequence[Path], backend_name: str) -> int:
    backend = builtin_backend(backend_name)
    traces = [(path, load_checked(path, backend)) for path in paths]  # all refused up front
    verdicts = []
    for path, trace in traces:
        verdict, line = replay_verdict(path, trace, backend)
        print(line, file=sys.stderr if verdict is Verdict.VIOLATION else sys.stdout, flush=True)
        verdicts.append(verdict)
        if verdict is Verdict.VIOLATION:
            break  # the first failure is the one to look at
    return combined(verdicts).exit_status


def main(argv: Sequence[str] | None = None) -> int:
    """Replay the trace files ``argv`` names; the exit status (module docstring)."""
    return run_command(PROG, lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    options = _parser().parse_args(argv)
    return _replay_all(options.traces, options.backend)
