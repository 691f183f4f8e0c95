"""``python -m veloxquant_mlx`` and the ``veloxquant-mlx`` script: :mod:`veloxquant_mlx.cli`.

A thin entry point: it installs the Ctrl-C handler before the command's
heavy imports (NumPy, MLX), so that a Ctrl-C while they load is one line
and status 130 too (:func:`~veloxquant_mlx.commandline.sigint.program_main`).
"""

from __future__ import annotations

from veloxquant_mlx.commandline.sigint import (
    exit_process,
    exits_at_once,
    program_main,
    run_program,
)

PROG = "veloxquant-mlx"


def main() -> int:
    """The ``veloxquant-mlx`` script: run the command line on ``sys.argv[1:]``.

    An interrupted run, or one that left threads stuck, ends the process here
    (:func:`~veloxquant_mlx.commandline.sigint.exit_process` says why).
    """
    status = program_main(PROG, "veloxquant_mlx.cli")
    if exits_at_once(status):
        exit_process(status)
    return status


if __name__ == "__main__":
    run_program(PROG, "veloxquant_mlx.cli")
