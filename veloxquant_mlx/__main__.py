"""``python -m veloxquant_mlx``: the same command line as ``veloxquant-mlx``."""

from veloxquant_mlx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
