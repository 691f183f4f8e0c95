"""``python -m stress [OPTIONS]``: the same as ``veloxquant-mlx stress [OPTIONS]``."""

import sys

from veloxquant_mlx.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["stress", *sys.argv[1:]]))
