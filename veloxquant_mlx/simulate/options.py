"""Command-line options of ``veloxquant-mlx simulate`` and their validation.

:func:`add_arguments` declares the options on an ``argparse`` parser, with
value types that reject bad input at parse time (the message names the value
and what was expected). :func:`validate` then checks the rules that span
several options, and refuses a pool or a workload whose estimated memory
(:func:`memory_estimate`) exceeds the machine's memory, and returns a message
for ``parser.error``. The value types are those of
:mod:`veloxquant_mlx.commandline.values`, shared by every command. The
``*_from`` helpers build the library's configuration objects from the parsed
namespace.

Complexity: O(number of options). Thread safety: pure functions.
"""

from __future__ import annotations

import argparse
import math

from veloxquant_mlx.commandline.bad_input import require_fits_in_memory
from veloxquant_mlx.commandline.sizes import REQUEST_BYTES, STEP_BYTES, pool_bytes
from veloxquant_mlx.commandline.values import any_int, finite_float, int_at_least
from veloxquant_mlx.memory.block_pool import PoolConfig
from veloxquant_mlx.simulate.workload import (
    DECODE_DISTRIBUTIONS,
    MAX_SIGMA,
    PROMPT_DISTRIBUTIONS,
    WorkloadConfig,
)

DEFAULT_DURATION = 10_000  # arrival window in steps when neither --duration nor --requests
DEFAULT_CHECK_EVERY = 100  # steps between checks for a bare --check-invariants


def _add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PoolConfig()
    group = parser.add_argument_group("pool (PoolConfig)")
    group.add_argument(
        "--block-size",
        type=int_at_least(1),
        default=defaults.block_size,
        metavar="TOKENS",
        help="token slots per block (default: %(default)s)",
    )
    group.add_argument(
        "--n-blocks",
        type=int_at_least(0),
        default=defaults.n_blocks,
        metavar="BLOCKS",
        help="initial blocks, K and V together (even, unless --shared-kv: each stream gets "
        "half); 0 needs --grow (default: %(default)s)",
    )
    group.add_argument(
        "--shared-kv",
        action="store_true",
        help="one free list for keys and values (separate_kv=False)",
    )
    group.add_argument(
        "--grow",
        action="store_true",
        help="grow the pool on exhaustion instead of raising (grow_on_exhaustion=True)",
    )
    group.add_argument(
        "--max-blocks",
        type=int_at_least(0),
        default=None,
        metavar="BLOCKS",
        help="cap on the grown pool's total blocks, K and V together (needs --grow; even, "
        "unless --shared-kv; default: no cap)",
    )


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkloadConfig()
    group = parser.add_argument_group("request mix (WorkloadConfig)")
    group.add_argument(
        "--arrival-rate",
        type=finite_float(0, low_inclusive=False),
        default=defaults.arrival_rate,
        metavar="PER_STEP",
        help="mean requests arriving per step (Poisson arrivals) (default: %(default)s)",
    )
    group.add_argument(
        "--prompt-mean",
        type=int_at_least(1),
        default=defaults.prompt_mean,
        metavar="TOKENS",
        help="mean prompt length, < --max-seq-len (default: %(default)s)",
    )
    group.add_argument(
        "--prompt-dist",
        choices=PROMPT_DISTRIBUTIONS,
        default=defaults.prompt_dist,
        help="prompt length distribution (default: %(default)s)",
    )
    group.add_argument(
        "--prompt-sigma",
        type=finite_float(0, MAX_SIGMA, low_inclusive=True),
        default=None,  # so that validate() sees it was given: it shapes lognormal lengths only
        metavar="SIGMA",
        help=f"shape of lognormal prompt lengths, 0 to {MAX_SIGMA:g} "
        f"(default: {defaults.prompt_sigma})",
    )
    group.add_argument(
        "--decode-mean",
        type=int_at_least(1),
        default=defaults.decode_mean,
        metavar="TOKENS",
        help="mean generated length, < --max-seq-len (default: %(default)s)",
    )
    group.add_argument(
        "--decode-dist",
        choices=DECODE_DISTRIBUTIONS,
        default=defaults.decode_dist,
        help="generated length distribution (default: %(default)s)",
    )
    group.add_argument(
        "--decode-sigma",
        type=finite_float(0, MAX_SIGMA, low_inclusive=True),
        default=None,  # as --prompt-sigma
        metavar="SIGMA",
        help=f"shape of lognormal generated lengths, 0 to {MAX_SIGMA:g} "
        f"(default: {defaults.decode_sigma})",
    )
    group.add_argument(
        "--abort-fraction",
        type=finite_float(0, 1, low_inclusive=True),
        default=defaults.abort_fraction,
        metavar="FRACTION",
        help="share of requests whose client disconnects mid-decode (default: %(default)s)",
    )
    group.add_argument(
        "--max-seq-len",
        type=int_at_least(2),
        default=defaults.max_seq_len,
        metavar="TOKENS",
        help="context window, caps prompt + generated (default: %(default)s)",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument(
        "--seed", type=any_int, default=0, help="workload random seed (default: %(default)s)"
    )
    length = group.add_mutually_exclusive_group()
    length.add_argument(
        "--duration",
        type=int_at_least(1),
        default=None,
        metavar="STEPS",
        help=f"requests arrive during this many steps, then the pool drains "
        f"(default: {DEFAULT_DURATION})",
    )
    length.add_argument(
        "--requests",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="instead of --duration: stop arrivals after N requests",
    )
    group.add_argument(
        "--check-invariants",
        type=int_at_least(1),
        nargs="?",
        const=DEFAULT_CHECK_EVERY,
        default=0,
        metavar="EVERY",
        help=f"also run pool.check_invariants() every EVERY steps "
        f"(bare flag: {DEFAULT_CHECK_EVERY}; it always runs at the end)",
    )
    group.add_argument(
        "--json",
        action="store_true",
        help="print all figures and the Prometheus text as JSON on stdout, no table",
    )
    group.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line every 10 s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every ``simulate`` option on ``parser``."""
    _add_pool_arguments(parser)
    _add_workload_arguments(parser)
    _add_run_arguments(parser)


def validate(args: argparse.Namespace) -> str | None:
    """Check the rules that span several options.

    Returns:
        A message naming the offending values, or ``None`` if all is well.
    """
    if args.max_blocks is not None and not args.grow:
        return f"--max-blocks {args.max_blocks} has no effect without --grow"
    if args.max_blocks is not None and args.max_blocks < args.n_blocks:
        return f"--max-blocks must be >= --n-blocks ({args.n_blocks}), got {args.max_blocks}"
    if args.n_blocks == 0 and not args.grow:
        return "--n-blocks 0 needs --grow (a pool with no blocks can only grow)"
    if not args.shared_kv:
        for option, blocks in (("--n-blocks", args.n_blocks), ("--max-blocks", args.max_blocks)):
            if blocks is not None and blocks % 2:
                return (
                    f"{option} must be even with separate K and V free lists (every request "
                    f"takes as many K blocks as V blocks, so an odd one is never used), "
                    f"got {blocks}; or pass --shared-kv"
                )
    for stream in ("prompt", "decode"):
        sigma, dist = getattr(args, f"{stream}_sigma"), getattr(args, f"{stream}_dist")
        if sigma is not None and dist != "lognormal":
            return (
                f"--{stream}-sigma {sigma:g} has no effect with --{stream}-dist {dist}; "
                f"expected --{stream}-dist lognormal, or no --{stream}-sigma"
            )
    for option, mean in (("--prompt-mean", args.prompt_mean), ("--decode-mean", args.decode_mean)):
        if mean >= args.max_seq_len:
            return f"{option} must be < --max-seq-len ({args.max_seq_len}), got {mean}"
    try:
        require_fits_in_memory(memory_estimate(args), _sizes_named(args))
    except ValueError as error:
        return str(error)
    return None


#: What :func:`memory_estimate` says of a size past the largest float: 2**1024 bytes.
_BEYOND_FLOATS = 1 << 1024


def memory_estimate(args: argparse.Namespace) -> int:
    """Bytes a simulation of these options may hold: the pool, the requests, the metrics.

    Requests are twice the expected arrivals (or ``--requests``); steps are
    the arrival window plus one context window of drain. A pool that grows
    without a cap is counted at its initial size (its growth follows demand).
    """
    ids = args.max_blocks if args.grow and args.max_blocks is not None else args.n_blocks
    if args.requests is not None:
        requests = args.requests
        steps = args.requests / args.arrival_rate
    else:
        steps = args.duration if args.duration is not None else DEFAULT_DURATION
        requests = 2 * args.arrival_rate * steps
    steps += args.max_seq_len
    total = pool_bytes(ids) + REQUEST_BYTES * requests + STEP_BYTES * steps
    # A float past the largest one (a rate near 0 with --requests, a duration near 2**63
    # with a huge rate) is still too big: refused by the caller, not an int(inf) crash.
    return int(total) if math.isfinite(total) else _BEYOND_FLOATS


def _sizes_named(args: argparse.Namespace) -> str:
    length = (
        f"--requests {args.requests}"
        if args.requests is not None
        else f"--duration {args.duration if args.duration is not None else DEFAULT_DURATION}"
    )
    cap = "" if args.max_blocks is None else f"--max-blocks {args.max_blocks}, "
    return (
        f"a simulation with --n-blocks {args.n_blocks}, {cap}"
        f"{length}, --arrival-rate {args.arrival_rate:g} and --max-seq-len {args.max_seq_len}"
    )


def pool_config_from(args: argparse.Namespace) -> PoolConfig:
    """The :class:`PoolConfig` the options describe."""
    return PoolConfig(
        block_size=args.block_size,
        n_blocks=args.n_blocks,
        separate_kv=not args.shared_kv,
        grow_on_exhaustion=args.grow,
        max_blocks=args.max_blocks,
    )


def workload_config_from(args: argparse.Namespace) -> WorkloadConfig:
    """The :class:`WorkloadConfig` the options describe."""
    defaults = WorkloadConfig()
    return WorkloadConfig(
        arrival_rate=args.arrival_rate,
        prompt_mean=args.prompt_mean,
        prompt_dist=args.prompt_dist,
        prompt_sigma=_given_or(args.prompt_sigma, defaults.prompt_sigma),
        decode_mean=args.decode_mean,
        decode_dist=args.decode_dist,
        decode_sigma=_given_or(args.decode_sigma, defaults.decode_sigma),
        abort_fraction=args.abort_fraction,
        max_seq_len=args.max_seq_len,
    )


def _given_or(value: float | None, default: float) -> float:
    """An option left out (``None``) as its default."""
    return default if value is None else value
