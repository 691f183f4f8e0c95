"""Test kits shipped with veloxquant_mlx: conformance suites other backends run."""
