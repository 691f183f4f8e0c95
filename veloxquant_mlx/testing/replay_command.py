"""``veloxquant-mlx replay TRACE... [--on spec|pool|numpy|mlx|mlx-lazy]``: replay any trace.

Every trace (docs/TRACE_FORMAT.md) replays with this one command: a
conformance or exhaustive counterexample, a stress run's ``linearized.jsonl``
or reproducer, an aliasing-replay input, a bug report; version 1 traces too.
``--on`` says where: the executable spec alone, the allocator beside it, or
the allocator, the spec and a store (the aliasing replay, which also checks
the store's data; the default, on MLX). ``--factory`` or ``--driver`` names a
port to replay on beside the spec instead of our allocator (the
``pool`` replay, with every observation compared after each call, as the
conformance kit compares them): an exhaustive counterexample found on a port
replays there. Concurrent windows (timed lines) are
linearized on the spec first (``--budget`` bounds that search); see
:func:`veloxquant_mlx.stress.reproducer.replay_trace`.

Every trace named is read and checked before any is replayed: the file must
exist and be a trace, its store's dtype one the backend stores, and what
replaying it allocates (the pool's books, the store's slabs, the replay's
shadow copy) must fit in the machine's memory. Anything else is bad input:
one line naming the file and the value, exit status 2, and nothing replayed.
Then each trace is replayed, one line each, stopping at the first failure
(a last line names the traces left unreplayed); a replay that runs past
10 s also says how far it got on stderr, every 10 s, unless
``--no-progress``.

Verdicts (:mod:`veloxquant_mlx.commandline.verdicts`): a failing replay is a
violation (1); a clean replay of a trace marked partial (a stress run that
was interrupted or gave up), or a window the search budget could not decide,
is inconclusive (3); otherwise OK (0). Ctrl-C: one line, 130.
``python -m veloxquant_mlx.testing.aliasing`` is the same command
(``--backend`` is ``--on``).

Complexity: reading is O(file); replaying as
:func:`~veloxquant_mlx.stress.reproducer.replay_trace` says. Thread safety:
one command per process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from veloxquant_mlx.commandline.bad_input import (
    BadInputError,
    human_bytes,
    physical_memory_bytes,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.files import file_argument
from veloxquant_mlx.commandline.sizes import pool_bytes, slab_bytes
from veloxquant_mlx.commandline.values import int_at_least
from veloxquant_mlx.commandline.verdicts import Verdict, combined
from veloxquant_mlx.testing.driven import DriverFailure
from veloxquant_mlx.testing.port import Port
from veloxquant_mlx.testing.port_options import (
    add_port_options,
    port_from_options,
    port_refusal,
)
from veloxquant_mlx.testing.storage_backends import StorageBackend, builtin_backend, mlx_backend
from veloxquant_mlx.testing.store_operations import Write
from veloxquant_mlx.testing.traces import Trace, TraceFormatError, TraceTooLongError, load
from veloxquant_mlx_spec.operations import Allocate

__all__ = [
    "DESCRIPTION",
    "SUMMARY",
    "TARGETS",
    "add_arguments",
    "load_checked",
    "main",
    "replay_memory_estimate",
    "replay_paths",
    "run",
    "validate",
]

SUMMARY: Final = "replay traces on the spec, a pool or a store; check every recorded outcome"
DESCRIPTION: Final = """\
Replay trace files (JSON lines, docs/TRACE_FORMAT.md): a conformance or
exhaustive counterexample, a stress run's linearized.jsonl or reproducer, an
aliasing-replay input or a bug report. Untimed lines apply in order and each
recorded outcome is checked; a run of timed lines (a concurrent window) is
linearized on the spec first.

--on spec replays on the executable spec alone; --on pool runs the allocator
beside it (store calls are left out); --on numpy|mlx|mlx-lazy also replays
on a store and checks its data after every line (the aliasing replay).
--factory or --driver replays on that port beside the spec instead (as --on
pool, comparing stats, history and handles after every call too).

Exit status: 0 ok, 1 a replay failed, 2 bad input, 3 inconclusive (a partial
trace, or a window the search budget could not decide), 130 interrupted.
"""
#: Where a trace can be replayed (``--on``).
TARGETS: Final = ("spec", "pool", "numpy", "mlx", "mlx-lazy")
_SHADOW_ITEMSIZE: Final = 4  # the replay's shadow copy and its reads are float32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``replay``'s options."""
    parser.add_argument(
        "traces",
        nargs="+",
        type=file_argument,
        help="trace files, replayed in turn until one fails",
    )
    parser.add_argument(
        "--on",
        "--backend",
        dest="on",
        choices=TARGETS,
        help="spec alone, the pool beside it, or pool, spec and a store (default: mlx; "
        "pool with --factory or --driver)",
    )
    parser.add_argument(
        "--budget",
        type=int_at_least(1),
        default=200_000,
        metavar="N",
        help="configurations one window's linearization may expand (default: %(default)s)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress lines on stderr (a replay over 10 s prints one every 10 s)",
    )
    add_port_options(parser, "replay on")


def validate(args: argparse.Namespace) -> str | None:
    """A port is replayed on beside the spec: ``--on pool``, or no ``--on``."""
    if (args.factory is not None or args.driver is not None) and args.on not in (None, "pool"):
        given = "--factory" if args.factory is not None else "--driver"
        return f"{given} replays on that port beside the spec (--on pool), got --on {args.on}"
    return None


def run(args: argparse.Namespace) -> int:
    """Replay the traces ``args`` names; the exit status (module docstring)."""
    port = port_from_options(args)
    on = args.on or ("mlx" if port is None else "pool")
    return replay_paths(
        args.traces, on, budget=args.budget, port=port, show_progress=not args.no_progress
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m veloxquant_mlx.testing.aliasing``: the ``replay`` subcommand."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    return run_alias("python -m veloxquant_mlx.testing.aliasing", "replay", argv)


def _backend(on: str) -> StorageBackend[Any] | None:
    if on in ("spec", "pool"):
        return None
    return mlx_backend(lazy_writes=True) if on == "mlx-lazy" else builtin_backend(on)


def replay_paths(
    paths: Sequence[Path],
    on: str,
    *,
    budget: int | None = 200_000,
    port: Port | None = None,
    show_progress: bool = True,
) -> int:
    """Read every trace (refusing bad input up front), replay each; the exit status.

    With ``show_progress``, a replay that runs past 10 s says how far it got on stderr.

    Raises:
        BadInputError: A trace is not one (module docstring); ``port`` cannot build a
            trace's pool, or its driver broke the protocol.
    """
    from veloxquant_mlx.stress.reproducer import replay_trace  # noqa: PLC0415

    backend = _backend(on)
    traces = [(path, load_checked(path, backend)) for path in paths]  # all refused up front
    if port is not None:
        for path, trace in traces:
            _require_builds(port, path, trace)
    verdicts = []
    for index, (path, trace) in enumerate(traces):
        try:
            progress = _progress_of(path) if show_progress else None
            verdict, line = replay_trace(trace, on, budget=budget, port=port, progress=progress)
        except DriverFailure as failure:
            raise BadInputError(f"{failure} (replaying {path})") from None
        print(f"{path}: {line}", file=sys.stderr if verdict is Verdict.VIOLATION else sys.stdout)
        verdicts.append(verdict)
        if verdict is Verdict.VIOLATION:  # the first failure is the one to look at
            _say_not_replayed([later for later, _ in traces[index + 1 :]])
            break
    return combined(verdicts).exit_status


def _say_not_replayed(paths: Sequence[Path]) -> None:
    """After a failure, name the traces left unreplayed (on stderr, one line)."""
    if paths:
        names = ", ".join(str(path) for path in paths)
        print(f"not replayed, after the failure above: {names}", file=sys.stderr)


def _progress_of(path: Path) -> Callable[[str], None]:
    """Where a long replay says how far it got: a line on stderr, naming the file."""
    return lambda text: print(f"  {path}: {text}", file=sys.stderr, flush=True)


def _require_builds(port: Port, path: Path, trace: Trace) -> None:
    """Build ``port``'s pool for ``trace`` once, before any replay: a factory that raises is
    the port's fault, said in one line, not a replay that failed."""
    try:
        port.build(trace.pool, trace.history_len)
    except DriverFailure as failure:
        raise BadInputError(f"{failure} (building the pool of {path})") from None
    except Exception as error:  # the factory's own code: anything it raises is refused
        raise port_refusal(port, error, f"while building the pool of {path}", trace.pool) from None


def _most_ids(trace: Trace) -> int:
    """The most block ids the replay's pool can issue: the initial ones plus possible growth."""
    pool = trace.pool
    if not pool.grow_on_exhaustion:
        return pool.n_blocks
    wanted = sum(
        -(-line.op.n_tokens // pool.block_size)
        for line in trace.lines
        if isinstance(line.op, Allocate) and isinstance(line.op.n_tokens, int)
    )
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
    sentinels = max(_write_sizes(trace), default=0) * values * (8 + _SHADOW_ITEMSIZE + itemsize)
    return pool_bytes(ids) + slabs + shadow + sentinels


def load_checked(path: Path, backend: StorageBackend[Any] | None) -> Trace:
    """Read the trace at ``path`` and check that it can be replayed here (on ``backend``).

    Raises:
        BadInputError: The file cannot be read or is not a trace, its store's
            dtype is not one ``backend`` stores, or replaying it would need
            more memory than the machine has. The message names the file.
    """
    memory = physical_memory_bytes()
    # Parsed lines take about ten times their text: refuse a file that cannot fit, by its
    # size if it has one, else (a pipe, a device) once it has given more than that.
    most = None if memory is None else memory // 10
    try:
        size = path.stat().st_size
        require_fits_in_memory(10 * size, f"{path}: a trace file of {size:,} bytes")
        trace = load(path, max_bytes=most)
    except TraceTooLongError as error:  # read with a limit: the memory is known
        raise BadInputError(
            f"{path}: a trace of {error} needs more memory, once parsed, than this "
            f"machine's {human_bytes(memory or 0)}; expected a smaller trace"
        ) from None
    except OSError as error:
        raise BadInputError(f"{path}: cannot read the trace: {error.strerror or error}") from None
    except TraceFormatError as error:
        raise BadInputError(f"{path}: not a trace: {error}") from None
    pool, store = trace.pool, trace.store
    replaying = (
        f"{path}: replaying a pool of n_blocks={pool.n_blocks} (max_blocks={pool.max_blocks})"
    )
    if backend is None or backend.dtype_size is None:  # the pool's and the spec's books
        require_fits_in_memory(2 * pool_bytes(_most_ids(trace)), replaying)
        return trace
    try:
        itemsize = backend.dtype_size(trace.store.dtype)
    except ValueError as error:
        raise BadInputError(f"{path}: {error}") from None
    largest_write = max(_write_sizes(trace), default=0)
    require_fits_in_memory(
        replay_memory_estimate(trace, itemsize),
        f"{replaying} with a store of n_layers={store.n_layers}, n_kv_heads={store.n_kv_heads}, "
        f"head_dim={store.head_dim}, dtype={store.dtype}"
        + (f", and a write of n_tokens={largest_write:,}" if largest_write else ""),
    )
    return trace


def _write_sizes(trace: Trace) -> list[int]:
    """``n_tokens`` of every store write of ``trace`` (its sentinel values take memory)."""
    return [
        line.op.n_tokens
        for line in trace.lines
        if isinstance(line.op, Write) and isinstance(line.op.n_tokens, int)
    ]
