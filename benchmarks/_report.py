"""What the benchmarks share: the platform header of a JSON report, printing the
report, raising MLX's buffer-cache limit, and running a main whose sizes may not fit.

A figure means little without what produced it (MLX's version, the device,
and whether the pool ran compiled by mypyc or interpreted: host times differ
between the two). MLX's CPU back-end keeps freed buffers for reuse only up
to its cache limit, 32 MB by default; a long context's per-step buffers
exceed it, and each step would then page-fault fresh memory, a cost of the
back-end's default rather than of the code measured, so the benchmarks that
decode or read long contexts raise it first.

Complexity: O(1) each. Thread safety: call from the benchmark's main thread.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable, Mapping

import mlx.core as mx

from veloxquant_mlx.commandline.bad_input import BadInputError
from veloxquant_mlx.commandline.interrupts import run_command
from veloxquant_mlx.memory import block_pool

#: The buffer-cache limit the benchmarks give MLX (8 GiB).
RAISED_CACHE_LIMIT_BYTES = 8 << 30


def platform_report() -> dict[str, str]:
    """What ran the benchmark: the versions and the device, and which pool build."""
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
        "mlx_lm": installed_version("mlx-lm"),
        "device": str(mx.default_device()),
        # The wheel's pool is compiled by mypyc, a checkout's is not: host time differs.
        "block_pool": "compiled" if block_pool.COMPILED else "interpreted",
    }


def installed_version(distribution: str) -> str:
    """``distribution``'s version, or ``"not installed"`` (mlx-lm is a development
    extra, and most benchmarks run without it)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_report(benchmark: str, figures: Mapping[str, object]) -> None:
    """Print one JSON document to stdout: the benchmark's name, the platform, the figures."""
    report = {"benchmark": benchmark, "platform": platform_report(), **figures}
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


def set_buffer_cache_limit(n_bytes: int = RAISED_CACHE_LIMIT_BYTES) -> int:
    """Set MLX's buffer-cache limit to ``n_bytes`` (by default, raise it to
    :data:`RAISED_CACHE_LIMIT_BYTES`); return the limit it replaced."""
    previous: int = mx.set_cache_limit(n_bytes)
    return previous


def run_benchmark(prog: str, main: Callable[[], int], sizes: str) -> int:
    """``main()``'s exit status, run as the commands run (one line and status 2 on bad
    input, 130 on Ctrl-C); a size the machine cannot hold (a context whose pool needs
    more memory than it has: the pool's ``MemoryError``) is bad input, said to come from
    the options ``sizes`` name."""

    def body() -> int:
        try:
            return main()
        except MemoryError as error:
            raise BadInputError(f"{error}; expected a smaller {sizes}") from None

    return run_command(prog, body)
