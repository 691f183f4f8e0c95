"""``python -m stress [OPTIONS]``: the same as ``veloxquant-mlx stress [OPTIONS]``.

A thin entry point: the Ctrl-C handler is installed before the heavy
imports (:func:`~veloxquant_mlx.commandline.sigint.program_main`).
"""

import sys

from veloxquant_mlx.commandline.sigint import exit_process, program_main

if __name__ == "__main__":
    exit_process(
        program_main("veloxquant-mlx stress", "veloxquant_mlx.cli", ["stress", *sys.argv[1:]])
    )
