"""The memory the commands' estimates promise, beside what their processes really hold.

Each command is run as a user runs it, in its own process, and its peak
resident set (``wait4``'s ``ru_maxrss``) is printed beside the estimate the
command makes before it starts (:mod:`veloxquant_mlx.commandline.sizes`):
the stress profiles (the run's part; a search that fills its budget comes on
top, and their small windows never do), an exhaustive search cut at a
number of states, and a linearizability search cut at its budget on a
window far more concurrent than any profile makes (``tracemalloc``, bytes per
configuration). Nothing passes or fails here; one JSON document is printed.

    python benchmarks/bench_command_memory.py            # about 3 minutes
    python benchmarks/bench_command_memory.py --quick    # shorter runs

Thread safety: runs one child at a time. Linux only (``wait4``, ``ru_maxrss`` in KiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

from veloxquant_mlx.commandline.bad_input import OneLineParser
from veloxquant_mlx.commandline.sizes import search_bytes
from veloxquant_mlx.stress import checker as checker_module
from veloxquant_mlx.stress.cli import memory_parts
from veloxquant_mlx.stress.config import profile
from veloxquant_mlx.stress.linearizability import search
from veloxquant_mlx.stress.runner import run_stress
from veloxquant_mlx.stress.specstep import Checkpoint
from veloxquant_mlx.testing.exhaustive_command import memory_estimate as exhaustive_estimate
from veloxquant_mlx.testing.traces import TraceLine as Event

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def peak_resident_bytes(args: list[str]) -> int:
    """Run ``python ARGS`` from the repository; its peak resident set in bytes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "spec")])}
    process = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL
    )
    _, _, usage = os.wait4(process.pid, 0)
    return usage.ru_maxrss * 1024


def stress_figures(name: str, seconds: float, out: Path) -> dict[str, Any]:
    run, search_part = memory_parts(profile(name))
    args = ["-m", "stress", "--profile", name, "--duration", f"{seconds:g}"]
    measured = peak_resident_bytes([*args, "--no-progress", "--out", str(out / name)])
    return {
        "command": " ".join(["python", *args]),
        "estimate_run_mib": round(run / MIB, 1),
        "estimate_full_search_mib": round(search_part / MIB, 1),
        "measured_peak_mib": round(measured / MIB, 1),
        "run_estimate_over_measured": round(run / measured, 2),
    }


def exhaustive_figures(max_states: int) -> dict[str, Any]:
    args = ["-m", "veloxquant_mlx.testing.exhaustive", "--profile", "nightly"]
    args += ["--scope", "separate-4", "--max-states", str(max_states)]
    measured = peak_resident_bytes(args)
    estimate = exhaustive_estimate(max_states)
    return {
        "command": " ".join(["python", *args]),
        "estimate_mib": round(estimate / MIB, 1),
        "measured_peak_mib": round(measured / MIB, 1),
        "estimate_over_measured": round(estimate / measured, 2),
    }


def concurrent_window(threads: int, window_ops: int) -> tuple[list[Checkpoint], list[Event]]:
    """The window whose search costs most in a run of very wide windows."""
    recorded: list[tuple[int, list[Checkpoint], list[Event]]] = []
    names = vars(checker_module)  # the checker's own reference to search, swapped for a probe
    real = names["search"]

    def spy(starts: list[Checkpoint], events: list[Event], **options: Any) -> Any:
        result = real(starts, events, **{**options, "budget": 3_000})
        recorded.append((result.nodes, list(starts), list(events)))
        return result

    names["search"] = spy
    try:
        config = profile("nightly").with_options(
            ops=threads * window_ops * 10,
            duration=None,
            threads=threads,
            window_ops=window_ops,
            storage="none",
            replay_backend="none",
            progress_interval=0.0,
            check_interval=0.0,
        )
        run_stress(config)
    finally:
        names["search"] = real
    _, starts, events = max(recorded, key=lambda item: item[0])
    return starts, events


def search_figures(budget: int) -> dict[str, Any]:
    starts, events = concurrent_window(threads=16, window_ops=50)
    tracemalloc.start()
    result = search(starts, events, store_layers=profile("nightly").store.n_layers, budget=budget)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    ids = 80 + profile("nightly").history_len
    estimate = search_bytes(result.nodes, n_ids=ids, window_calls=len(events))
    return {
        "window_calls": len(events),
        "configurations": result.nodes,
        "complete": result.complete,
        "measured_bytes_per_configuration": round(peak / max(result.nodes, 1)),
        "estimated_bytes_per_configuration": round(estimate / max(result.nodes, 1)),
    }


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    quick = parser.parse_args().quick
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        figures = {
            "stress": [
                stress_figures("smoke", 5 if quick else 20, out),
                stress_figures("nightly", 5 if quick else 20, out),
            ],
            "exhaustive": exhaustive_figures(20_000 if quick else 100_000),
            "search": search_figures(20_000 if quick else 100_000),
        }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
