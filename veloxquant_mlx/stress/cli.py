"""The ``veloxquant-mlx stress`` subcommand (also ``python -m stress`` from the repository).

:func:`add_arguments` declares the options, :func:`validate` checks those
that span several options, :func:`run` runs the stress test (or, with
``--replay FILE``, replays a linearized trace or re-checks a reproducer).
A profile (``--profile smoke|nightly``) gives every default; any option
given overrides it.

Exit statuses: 0 when nothing was found (or the replay passed), 1 on any
violation, 2 on a usage error (from :mod:`veloxquant_mlx.cli`).

Complexity: that of the run. Thread safety: :func:`run` owns the threads it
starts; it writes to ``sys.stdout`` and ``sys.stderr``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.simulate.options import any_int, finite_float, int_at_least
from veloxquant_mlx.stress.config import (
    PROFILES,
    OperationMix,
    StressConfig,
    default_out_dir,
    profile,
)

__all__ = ["DESCRIPTION", "SUMMARY", "add_arguments", "config_from", "run", "validate"]

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

The run's folder (--out) receives report.json, summary.txt, linearized.jsonl
and, on a violation, violation-linearizability.json. Replay either later
with --replay FILE. Exit status 1 on any violation.
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
    group.add_argument("--threads", type=int_at_least(1), metavar="N", help="worker threads")
    group.add_argument("--ops", type=int_at_least(1), metavar="N", help="stop after N calls")
    group.add_argument(
        "--duration",
        type=finite_float(0, low_inclusive=False),
        metavar="SECONDS",
        help="stop after this long (with --ops: whichever comes first)",
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


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="the run's folder (default: reports/stress-PROFILE-TIMESTAMP)",
    )
    group.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    group.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def validate(args: argparse.Namespace) -> str | None:
    """A usage error message for options that conflict, else ``None``."""
    if args.mix is not None:
        try:
            OperationMix.parse(args.mix)
        except ValueError as error:
            return f"argument --mix: {error}"
    try:
        config_from(args)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


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
    }
    changes.update({name: value for name, value in simple.items() if value is not None})
    if args.mix is not None:
        changes["mix"] = OperationMix.parse(args.mix)
    if args.no_progress:
        changes["progress_interval"] = 0.0
    changes["out_dir"] = args.out if args.out is not None else default_out_dir(base.profile)
    return base.with_options(**changes)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand; returns the exit status."""
    if args.replay is not None:
        return _replay(args.replay, args.replay_backend or "mlx")
    from veloxquant_mlx.stress.report import summary_text  # noqa: PLC0415
    from veloxquant_mlx.stress.runner import run_stress  # noqa: PLC0415

    config = config_from(args)
    progress = None if args.no_progress else sys.stderr
    if progress is not None:
        print(f"[stress {config.profile}] writing to {config.out_dir}", file=progress)
    report = run_stress(config, progress=progress)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(summary_text(report))
    return 0 if report.ok else 1


def _replay(path: Path, backend: str) -> int:
    from veloxquant_mlx.stress.reproducer import replay_path  # noqa: PLC0415

    try:
        passed, message = replay_path(path, backend)
    except (OSError, ValueError) as error:
        print(f"veloxquant-mlx stress: error: {error}", file=sys.stderr)
        return 2
    print(message, file=sys.stdout if passed else sys.stderr)
    return 0 if passed else 1
