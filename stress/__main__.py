"""``python -m stress [OPTIONS]``, from the repository's root: the same as
``veloxquant-mlx stress [OPTIONS]``, under its own name in errors and ``--help``.

A thin entry point: the Ctrl-C handler is installed before the heavy
imports (:func:`~veloxquant_mlx.commandline.sigint.program_main`).
"""

import sys

from veloxquant_mlx.commandline.sigint import exit_process, program_main

if __name__ == "__main__":
    exit_process(program_main("python -m stress", "veloxquant_mlx.stress.cli", sys.argv[1:]))
