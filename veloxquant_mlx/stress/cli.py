"""The ``veloxquant-mlx stress`` subcommand (also ``python -m stress`` from the repository's
root, where ``stress/`` is: :func:`main`).

:func:`add_arguments` declares the options, :func:`validate` checks those
that span several options (and refuses a pool or a search too big for the
machine's memory), :func:`run` runs the stress test (or, with ``--replay
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
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from veloxquant_mlx.commandline.bad_input import (
    human_bytes,
    memory_note,
    require_fits_in_memory,
)
from veloxquant_mlx.commandline.files import (
    claim_new_folder,
    file_argument,
    out_dir_argument,
    prepare_out_dir,
)
from veloxquant_mlx.commandline.interrupts import InterruptRequest, report_interrupt
from veloxquant_mlx.commandline.sigint import exit_at_once
from veloxquant_mlx.commandline.sizes import (
    EVENT_BYTES,
    PROCESS_BYTES,
    pool_bytes,
    search_bytes,
    slab_bytes,
)
from veloxquant_mlx.commandline.values import any_int, finite_float, int_at_least, int_in
from veloxquant_mlx.commandline.verdicts import Verdict
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.stress.config import (
    MAX_CHECK_INTERVAL,
    MAX_WINDOW_OPS,
    PROFILES,
    STORE_KINDS,
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
    "main",
    "memory_estimate",
    "run",
    "validate",
]

#: More threads than this is a mistake, not a stress test (each has a stack).
MAX_THREADS: Final = 1024
#: The shortest stall timeout: ten of the watchdog's looks (watchdog._POLL_SECONDS).
MIN_STALL_TIMEOUT: Final = 1.0
#: The longest switch interval: a second between thread switches already serialises a
#: run; far above it, CPython stores what it is given as 0 (1e300 became 0.0).
MAX_SWITCH_INTERVAL: Final = 1.0
#: Recorded calls of the barrier's observations and the audit, beyond the workers' calls.
_OBSERVATION_CALLS: Final = 16
#: The options that set the :class:`StressConfig` field of their name to the value given;
#: the profile, ``--ops`` (which ``--duration`` alone clears), ``--mix`` and the pool's
#: options need more. Listed, so that no later option reaches a field by its name alone.
_AS_GIVEN: Final = frozenset(
    {
        "check_budget",
        "check_interval",
        "duration",
        "history_len",
        "replay_backend",
        "search_budget",
        "seed",
        "stall_timeout",
        "storage",
        "switch_interval",
        "threads",
        "window_ops",
    }
)

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

The calls stop after --duration or --ops, whichever comes first (--ops
alone keeps the profile's duration as a bound); the checking then has
--check-budget seconds more to finish, so the run's wall time is at most the
sum of the two (both are printed at the start). What is not checked in time
is listed in the report, and the verdict is then INCONCLUSIVE, never OK; so
is a run whose worker threads made no call.

OK means every check that was asked for was made, on every call: with
--replay-backend none (no replay on a store) or --check-interval 0 (no
check_invariants() during the run) the verdict line names the check that
was off.

The run's folder (--out) receives report.json (with "verdict"), summary.txt,
linearized.jsonl (linearized.partial.jsonl if not every call was checked or
the run was interrupted) and, on a violation, violation-linearizability.jsonl
(the calls before the window, then the window). Replay either later with
veloxquant-mlx replay FILE (or --replay FILE here).

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
        type=file_argument,
        default=None,
        metavar="FILE",
        help="instead of running: replay a trace (linearized.jsonl, a violation-*.jsonl "
        "reproducer) on --replay-backend; the same as veloxquant-mlx replay FILE --on BACKEND",
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
    group.add_argument(
        "--ops",
        type=int_at_least(1),
        metavar="N",
        help="stop after the worker threads made N calls, give or take one per thread "
        "(the last window is shared out evenly; the queries recorded at each barrier "
        "and the final audit's calls come on top), or after the profile's duration if "
        "that comes first",
    )
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
        type=int_in(1, MAX_WINDOW_OPS),
        metavar="N",
        help=f"calls per thread between two barriers (quiescent points; 1..{MAX_WINDOW_OPS})",
    )
    group.add_argument(
        "--switch-interval",
        type=finite_float(0, MAX_SWITCH_INTERVAL, low_inclusive=False),
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
        type=finite_float(0, MAX_CHECK_INTERVAL, low_inclusive=True),
        metavar="SECONDS",
        help=f"seconds between check_invariants() calls (at most {MAX_CHECK_INTERVAL:g}), "
        "plus one when the calls end; 0 turns them off",
    )
    group.add_argument(
        "--stall-timeout",
        type=finite_float(MIN_STALL_TIMEOUT, low_inclusive=True),
        metavar="SECONDS",
        help=f"no progress for this long is a deadlock (at least {MIN_STALL_TIMEOUT:g}: the "
        "watchdog looks every 0.1 s, and a shorter wait takes a busy moment for a deadlock)",
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
        help="the run's folder, refused if it holds an earlier run's files, unless --force "
        "(default: a new reports/stress-PROFILE-TIMESTAMP, -2, -3... if another run has it)",
    )
    group.add_argument(
        "--force",
        action="store_true",
        help="delete an earlier run's files in --out (report, summary, traces, reproducers)",
    )
    group.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    group.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def validate(args: argparse.Namespace) -> str | None:
    """A usage error message for options that conflict or cannot fit, else ``None``."""
    if args.replay is not None:
        return _replay_conflicts(args)
    if args.force and args.out is None:
        return "--force has no effect without --out (the default folder is a new one)"
    if args.mix is not None:
        problem = _mix_problem(args.mix, with_store=args.storage != "none")
        if problem is not None:
            return f"argument --mix: {problem}"
    try:
        config = config_from(args)
        require_fits_in_memory(memory_estimate(config), _sizes_named(config))
    except (TypeError, ValueError) as error:  # BadInputError, the memory's, is a ValueError
        return str(error)
    return None


def _mix_problem(text: str, *, with_store: bool) -> str | None:
    """Why the mix ``text`` cannot run (on a run with no store, if not ``with_store``)."""
    try:
        OperationMix.parse(text)
    except ValueError as error:
        return str(error)
    if with_store:
        return None
    given = OperationMix.given(text)
    for kind in STORE_KINDS:
        if given.get(kind):
            return f"{kind}={given[kind]} has no effect with --storage none; leave it out"
    return None  # a pool call has a positive weight (OperationMix): it still has one without


def _replay_conflicts(args: argparse.Namespace) -> str | None:
    """With ``--replay``, the run's options that were given (they would be ignored): those
    whose value is not the parser's default."""
    given = [
        "--" + name.replace("_", "-")
        for name, default in _option_defaults().items()
        if name not in _REPLAY_OPTIONS and getattr(args, name) != default
    ]
    if not given:
        return None
    refusal = (
        f"--replay replays a trace and runs nothing, so {', '.join(given)} would have no "
        "effect; leave them out"
    )
    if "--search-budget" in given:
        refusal += " (a replay's search budget is veloxquant-mlx replay FILE --budget N)"
    return refusal


def _option_defaults() -> dict[str, object]:
    """Every option of ``stress`` with its default, as the parser declares them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return vars(parser.parse_args([]))


#: The options ``--replay`` uses.
_REPLAY_OPTIONS: Final = frozenset({"replay", "replay_backend", "no_progress"})


def memory_estimate(config: StressConfig) -> int:
    """The most bytes a run of ``config`` may hold at once (see :func:`memory_parts`)."""
    return sum(memory_parts(config))


def memory_parts(config: StressConfig) -> tuple[int, int]:
    """``(run, search)``: bytes of everything but the search, and of a full search.

    The run: the process, the shared pool and store and the replay's pool
    and store (at most ``max_blocks`` ids, or twice ``n_blocks`` when growth
    has no cap: a guess; a store that ``--storage none`` or
    ``--replay-backend none`` leaves out counts nothing), and the windows
    recorded but not yet checked. The
    search: one window's linearizability search holding its whole
    ``search_budget`` of configurations, which only a window far more
    concurrent than the barriers allow needs (figures: :mod:`~veloxquant_mlx.commandline.sizes`).
    """
    pool, store = config.pool, config.store
    ids = _most_ids(pool)
    slabs = slab_bytes(
        n_layers=store.n_layers,
        n_ids=ids,
        block_size=pool.block_size,
        slot_values=store.slot_count(),
        itemsize=8,
    )
    window_calls = config.threads * config.window_ops + _OBSERVATION_CALLS
    windows = (config.max_queued_windows + 2) * window_calls * EVENT_BYTES  # + being made, checked
    stores = (config.storage != "none") + (config.replay_backend != "none")
    run = PROCESS_BYTES + 2 * pool_bytes(ids) + stores * slabs + windows
    search = search_bytes(
        config.search_budget, n_ids=ids + config.history_len, window_calls=window_calls
    )
    return run, search


def _most_ids(pool: PoolConfig) -> int:
    if not pool.grow_on_exhaustion:
        return pool.n_blocks
    return pool.max_blocks if pool.max_blocks is not None else 2 * pool.n_blocks


def _sizes_named(config: StressConfig) -> str:
    pool, store = config.pool, config.store
    return (
        f"a run with --block-size {pool.block_size}, --n-blocks {pool.n_blocks}, "
        f"--max-blocks {pool.max_blocks}, --threads {config.threads}, --window-ops "
        f"{config.window_ops}, --history-len {config.history_len} and --search-budget "
        f"{config.search_budget} (store: {store.n_layers} layers of {store.n_kv_heads} x "
        f"{store.head_dim} {store.dtype} values per token)"
    )


def _pool_from(args: argparse.Namespace, base: PoolConfig) -> PoolConfig:
    """The profile's pool with the options given; a conflict names the options.

    Raises:
        ValueError: ``--max-blocks`` with ``--no-grow``, or ``--n-blocks`` above the
            profile's cap of growth with no ``--max-blocks`` given.
    """
    grow = base.grow_on_exhaustion and not args.no_grow
    if args.max_blocks is not None and not grow:
        raise ValueError(f"--max-blocks {args.max_blocks} has no effect on a pool that never grows")
    max_blocks = base.max_blocks if args.max_blocks is None and grow else args.max_blocks
    n_blocks = base.n_blocks if args.n_blocks is None else args.n_blocks
    if args.max_blocks is None and max_blocks is not None and n_blocks > max_blocks:
        raise ValueError(
            f"--n-blocks {n_blocks} is above the profile's cap of growth, max_blocks "
            f"{max_blocks}; give --max-blocks >= {n_blocks} too, or --no-grow"
        )
    return PoolConfig(
        block_size=base.block_size if args.block_size is None else args.block_size,
        n_blocks=n_blocks,
        separate_kv=base.separate_kv and not args.shared_kv,
        grow_on_exhaustion=grow,
        max_blocks=max_blocks,
    )


def config_from(args: argparse.Namespace) -> StressConfig:
    """The run's configuration: the profile, with every option given applied.

    Raises:
        ValueError, TypeError: The options make an invalid configuration.
    """
    base = profile(args.profile)
    changes: dict[str, object] = {"pool": _pool_from(args, base.pool)}
    # --duration: a time-bound run, the profile's ops go unless given; --ops alone: the
    # profile's duration stays, as the wall-time bound.
    if args.ops is not None or args.duration is not None:
        changes["ops"] = args.ops
    changes.update((k, v) for k, v in vars(args).items() if k in _AS_GIVEN and v is not None)
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
        return _replay(
            args.replay, args.replay_backend or "mlx", show_progress=not args.no_progress
        )
    from veloxquant_mlx.stress.report import is_run_file, summary_text  # noqa: PLC0415
    from veloxquant_mlx.stress.runner import run_stress  # noqa: PLC0415

    config = config_from(args)
    if args.out is None and config.out_dir is not None:  # its own, even in the same second
        config = config.with_options(out_dir=claim_new_folder(config.out_dir))
    if config.out_dir is not None:
        prepare_out_dir(config.out_dir, force=args.force, is_run_file=is_run_file)
    print(start_line(config), file=sys.stderr, flush=True)
    progress = None if args.no_progress else sys.stderr
    with InterruptRequest(args.prog) as interrupt:
        report = run_stress(config, progress=progress, interrupt=interrupt.requested)
    if report.verdict is Verdict.INTERRUPTED:
        return report_interrupt(
            args.prog,
            f"after {report.wall_seconds:.1f} s of calls, {report.operations:,} calls, "
            f"{report.percent_checked_text()} of them checked, "
            f"{len(report.findings)} violations; partial report in {config.out_dir}",
        )
    if any(finding.kind == "deadlock" for finding in report.findings):
        exit_at_once()  # its threads are stuck: the interpreter's exit could abort
    print(json.dumps(report.to_json(), indent=2) if args.json else summary_text(report))
    return report.verdict.exit_status


def start_line(config: StressConfig) -> str:
    """What the run will do and the longest it can take: printed before it starts."""
    limits = []
    if config.ops is not None:
        limits.append(f"{config.ops:,} worker calls")
    most = ""
    if config.duration is not None:
        limits.append(f"{config.duration:g} s")
        most = f"; wall time at most {config.duration + config.check_budget:g} s"
    run, search = memory_parts(config)
    return (
        f"[stress {config.profile}] {config.threads} threads until {' or '.join(limits)}, "
        f"then at most {config.check_budget:g} s of checking{most}; memory "
        f"{memory_note(run + search)} at most ({human_bytes(run)}, plus {human_bytes(search)} "
        f"if a window's search fills its budget); writing to {config.out_dir}"
    )


def _replay(path: Path, backend: str, *, show_progress: bool) -> int:
    """``--replay FILE``: ``veloxquant-mlx replay FILE --on BACKEND`` (the spec, for "none")."""
    from veloxquant_mlx.testing.replay_command import replay_paths  # noqa: PLC0415

    on = "spec" if backend == "none" else backend
    return replay_paths([path], on, show_progress=show_progress)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stress`` (from the repository's root): the ``stress`` subcommand."""
    from veloxquant_mlx.cli import run_alias  # noqa: PLC0415

    return run_alias("python -m stress", "stress", argv)
