"""The ``veloxquant-mlx stress`` subcommand (also ``python -m stress`` from the repository).

:func:`add_arguments` declares the options, :func:`validate` checks those
that span several options (and refuses a pool or a search too big for the
memory available), :func:`run` runs the stress test (or, with ``--replay
FILE``, replays a linearized trace or re-checks a reproducer). A profile
(``--profile smoke|nightly``) gives every default; any option given
overrides it. ``--out`` must be a new folder, or one without an earlier
run's files (``--force`` deletes them); it is checked before the run starts.

Exit statuses (:mod:`veloxquant_mlx.commandline.verdicts`): 0 when every
call was checked and nothing was found, 1 on any violation, 2 on bad input
(one line, nothing written), 3 when the verdict is inconclusive (a window or
the checking time ran out: the report lists what was not checked), 130 on
Ctrl-C (one line; the report is written, marked partial).

Complexity: that of the run. Thread safety: :func:`run` owns the threads it
starts; it writes to ``sys.stdout`` and ``sys.stderr``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

from veloxquant_mlx.commandline.bad_input import human_bytes, require_fits_in_memory
from veloxquant_mlx.commandline.files import out_dir_argument, prepare_out_dir
from veloxquant_mlx.commandline.interrupts import InterruptRequest, report_interrupt
from veloxquant_mlx.commandline.sizes import pool_bytes, slab_bytes
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.simulate.options import any_int, finite_float, int_at_least
from veloxquant_mlx.stress.config import (
    PROFILES,
    OperationMix,
    StressConfig,
    default_out_dir,
    profile,
)

__all__ = [
    "DESCRIPTION",
    "SUMMARY",
    "add_arguments",
    "config_from",
    "memory_estimate",
    "run",
    "validate",
]

PROG: Final = "veloxquant-mlx stress"
#: More threads than this is a mistake, not a stress test (each has a stack).
MAX_THREADS: Final = 1024
#: Bytes one configuration of a window's search holds, beyond its state's ids and history.
_CONFIGURATION_BYTES: Final = 400

SUMMARY = "hammer one pool from many threads; check linearizability and replay on MLX"

DESCRIPTION = """\
N threads share one BlockPoolAllocator and one MLX store and make a seeded
random mix of every call: allocation (with exhaustion and growth), frees of
random subsets, free_all, shrink, mark_used, owner registration and
release, stale and foreign handles, stats and Prometheus readers, store
writes and reads. While it runs, a checker thread calls check_invariants(),
a progress line is printed, and a watchdog dumps every thread's stack and
fails the run if progress stops (deadlock).

Every call is recorded with its invoke and return times and outcome. The
history is checked for linearizability against the executable spec (Wing &
Gong with Lowe's memoisation, window by window between quiescent points),
and the linearization is replayed through the aliasing replay on MLX
storage and saved as linearized.jsonl. At the end a conservation audit
checks that no block was lost or duplicated.

The calls stop after --duration (or --ops); the checking then has
--check-budget seconds more to finish, so the run's wall time is at most the
sum of the two (both are printed at the start). What is not checked in time
is listed in the report, and the verdict is then INCONCLUSIVE, never OK.

The run's folder (--out) receives report.json (with "verdict"), summary.txt,
linearized.jsonl (linearized.partial.jsonl if not every call was checked or
the run was interrupted) and, on a violation, violation-linearizability.json.
Replay either later with --replay FILE.

Exit status: 0 OK (every call checked, nothing found), 1 violation, 2 bad
input, 3 inconclusive, 130 interrupted (Ctrl-C; a second Ctrl-C stops at
once).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``stress`` on ``parser``."""
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="smoke",
        help="the preset every other option overrides (default: %(default)s)",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="FILE",
        help="instead of running: replay a linearized.jsonl trace on --replay-backend, "
        "or re-check a violation-*.json reproducer",
    )
    _add_run_arguments(parser)
    _add_pool_arguments(parser)
    _add_check_arguments(parser)
    _add_output_arguments(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS),
        metavar="N",
        help=f"worker threads (1..{MAX_THREADS})",
    )
    group.add_argument("--ops", type=int_at_least(1), metavar="N", help="stop after N calls")
    group.add_argument(
        "--duration",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="stop the calls after this long (with --ops: whichever comes first)",
    )
    group.add_argument("--seed", type=any_int, help="seed of every thread's choices")
    group.add_argument(
        "--mix",
        metavar="KIND=WEIGHT,...",
        help="change the operation mix, e.g. 'shrink=10,write=0' (kinds: see the report)",
    )
    group.add_argument(
        "--window-ops",
        type=int_at_least(1),
        metavar="N",
        help="calls per thread between two barriers (quiescent points)",
    )
    group.add_argument(
        "--switch-interval",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="sys.setswitchinterval during the run (smoke and nightly: 1e-6)",
    )


def _add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pool (PoolConfig)")
    group.add_argument("--block-size", type=int_at_least(1), metavar="TOKENS")
    group.add_argument("--n-blocks", type=int_at_least(0), metavar="BLOCKS")
    group.add_argument(
        "--shared-kv", action="store_true", help="one free list for K and V (separate_kv=False)"
    )
    group.add_argument("--no-grow", action="store_true", help="grow_on_exhaustion=False")
    group.add_argument(
        "--max-blocks", type=int_at_least(0), metavar="BLOCKS", help="cap of the grown pool"
    )
    group.add_argument(
        "--history-len", type=int_at_least(0), metavar="N", help="the pool's history_len"
    )


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checks")
    group.add_argument(
        "--check-interval",
        type=finite_float(0, low_inclusive=True),
        metavar="SECONDS",
        help="seconds between check_invariants() calls; 0 turns them off",
    )
    group.add_argument(
        "--stall-timeout",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="no progress for this long is a deadlock",
    )
    group.add_argument(
        "--storage",
        choices=("mlx", "numpy", "none"),
        help="the store the threads share (default: mlx)",
    )
    group.add_argument(
        "--replay-backend",
        choices=("mlx", "numpy", "none"),
        help="store the linearized history is replayed on (default: mlx)",
    )
    group.add_argument(
        "--search-budget",
        type=int_at_least(1),
        metavar="N",
        help="configurations one window's linearizability search may expand",
    )
    group.add_argument(
        "--check-budget",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="seconds the checking may go on after the last call (smoke: 30, nightly: 120)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--out",
        type=out_dir_argument,
        metavar="DIR",
        help="the run's folder (default: reports/stress-PROFILE-TIMESTAMP); refused if it "
        "holds an earlier run's files, unless --force",
    )
    group.add_argument(
        "--force",
        action="store_true",
        help="delete an earlier run's files in --out (report, summary, traces, reproducers)",
    )
    group.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    group.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int from ``low`` to ``high``."""
    expected = f"an int from {low} to {high}"

    def parse(text: str) -> int:
        value = any_int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected
    return parse


def validate(args: argparse.Namespace) -> str | None:
    """A usage error message for options that conflict or cannot fit, else ``None``."""
    if args.mix is not None:
        try:
            OperationMix.parse(args.mix)
        except ValueError as error:
            return f"argument --mix: {error}"
    try:
        config = config_from(args)
    except (TypeError, ValueError) as error:
        return str(error)
    try:
        require_fits_in_memory(memory_estimate(config), _sizes_named(config))
    except ValueError as error:
        return str(error)
    return None


def memory_estimate(config: StressConfig) -> int:
    """Bytes a run of ``config`` may hold at once: pools, stores, and a window's search.

    The shared pool and store and the replay's pool and store cover at most
    ``max_blocks`` ids (twice ``n_blocks`` when growth has no cap: a guess);
    a search holds up to ``search_budget`` configurations, each with its
    state's ids and history.
    """
    pool = config.pool
    if not pool.grow_on_exhaustion:
        ids = pool.n_blocks
    else:
        ids = pool.max_blocks if pool.max_blocks is not None else 2 * pool.n_blocks
    store = config.store
    slabs = slab_bytes(
        n_layers=store.n_layers,
        n_ids=ids,
        block_size=pool.block_size,
        slot_values=store.slot_count(),
        itemsize=8,
    )
    per_configuration = _CONFIGURATION_BYTES + 8 * (ids + config.history_len)
    return 2 * (pool_bytes(ids) + slabs) + config.search_budget * per_configuration


def _sizes_named(config: StressConfig) -> str:
    pool = config.pool
    return (
        f"a run with --n-blocks {pool.n_blocks}, --max-blocks {pool.max_blocks}, "
        f"--history-len {config.history_len} and --search-budget {config.search_budget}"
    )


def _pool_from(args: argparse.Namespace, base: PoolConfig) -> PoolConfig:
    grow = base.grow_on_exhaustion and not args.no_grow
    return PoolConfig(
        block_size=base.block_size if args.block_size is None else args.block_size,
        n_blocks=base.n_blocks if args.n_blocks is None else args.n_blocks,
        separate_kv=base.separate_kv and not args.shared_kv,
        grow_on_exhaustion=grow,
        max_blocks=base.max_blocks if args.max_blocks is None else args.max_blocks,
    )


def config_from(args: argparse.Namespace) -> StressConfig:
    """The run's configuration: the profile, with every option given applied.

    Raises:
        ValueError, TypeError: The options make an invalid configuration.
    """
    base = profile(args.profile)
    changes: dict[str, object] = {"pool": _pool_from(args, base.pool)}
    if args.ops is not None or args.duration is not None:
        changes["ops"], changes["duration"] = args.ops, args.duration
    simple = {
        "threads": args.threads,
        "seed": args.seed,
        "window_ops": args.window_ops,
        "switch_interval": args.switch_interval,
        "history_len": args.history_len,
        "check_interval": args.check_interval,
        "stall_timeout": args.stall_timeout,
        "storage": args.storage,
        "replay_backend": args.replay_backend,
        "search_budget": args.search_budget,
        "check_budget": args.check_budget,
    }
    changes.update({name: value for name, value in simple.items() if value is not None})
    if args.mix is not None:
        changes["mix"] = OperationMix.parse(args.mix)
    if args.no_progress:
        changes["progress_interval"] = 0.0
    changes["out_dir"] = args.out if args.out is not None else default_out_dir(base.profile)
    return base.with_options(**changes)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand; returns the exit status.

    Raises:
        BadInputError: ``--out`` or the ``--replay`` file is refused (the
            command line turns it into one line and status 2).
    """
    if args.replay is not None:
        return _replay(args.replay, args.replay_backend or "mlx")
    from veloxquant_mlx.stress.report import is_run_file, summary_text  # noqa: PLC0415
    from veloxquant_mlx.stress.runner import run_stress  # noqa: PLC0415

    config = config_from(args)
    if config.out_dir is not None:
        prepare_out_dir(config.out_dir, force=args.force, is_run_file=is_run_file)
    print(start_line(config), file=sys.stderr, flush=True)
    progress = None if args.no_progress else sys.stderr
    with InterruptRequest(PROG) as interrupt:
        report = run_stress(config, progress=progress, interrupt=interrupt.requested)
    if report.verdict is Verdict.INTERRUPTED:
        return report_interrupt(
            PROG,
            f"after {report.wall_seconds:.1f} s of calls, {report.operations:,} calls, "
            f"{report.percent_checked():g}% of them checked, {len(report.findings)} "
            f"violations; partial report in {config.out_dir}",
        )
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(summary_text(report))
    return report.verdict.exit_status


def start_line(config: StressConfig) -> str:
    """What the run will do and the longest it can take: printed before it starts."""
    limits = []
    if config.ops is not None:
        limits.append(f"{config.ops:,} calls")
    if config.duration is not None:
        limits.append(f"{config.duration:g} s")
    most = (
        f"; wall time at most {config.duration + config.check_budget:g} s"
        if config.duration is not None
        else ""
    )
    return (
        f"[stress {config.profile}] {config.threads} threads until {' or '.join(limits)}, "
        f"then at most {config.check_budget:g} s of checking{most}; "
        f"memory estimate {human_bytes(memory_estimate(config))}; writing to {config.out_dir}"
    )


def _replay(path: Path, backend: str) -> int:
    from veloxquant_mlx.stress.reproducer import replay_path  # noqa: PLC0415

    verdict, message = replay_path(path, backend)
    print(message, file=sys.stderr if verdict is Verdict.VIOLATION else sys.stdout)
    return verdict.exit_status
