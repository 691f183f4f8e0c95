"""``python -m stress``: the block pool's stress runner, run from the repository root.

A thin shim over :mod:`veloxquant_mlx.stress` (installed with the package, where
the code lives); ``stress/nightly.sh`` runs the nightly profile.
"""
